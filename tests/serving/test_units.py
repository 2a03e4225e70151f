"""The server's pieces without a server: text streaming with stop strings, the speculative config, the live
calibration window, the request schemas, the spliced chunk events."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.serving.conftest import char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


TRICKY_PIECES = ["", " hello", 'a "quoted" word', "back\\slash", "new\nline\ttab\r", "\x00\x01\x1f\x7f",
                 "é中文😀", "\u2028\u2029\ufeff", "</script>", "@@dspark-piece@@", "{\"json\": [1, 2]}"]


def _chunks():
    """The two streamed chunk kinds, each as a function of its text and running usage (ids and model as a server
    would set them)."""
    from optimized.serving.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        CompletionChoice,
        CompletionChunk,
        DeltaMessage,
    )

    def chat(piece, usage=None):
        return ChatCompletionChunk(id="chatcmpl-0123abcd", created=1764633600, model="smollm2-135m-instruct",
                                   choices=[ChatChunkChoice(delta=DeltaMessage(content=piece))], usage=usage)

    def completion(piece, usage=None):
        return CompletionChunk(id="cmpl-0123abcd", created=1764633600, model="smollm2-135m-instruct",
                               choices=[CompletionChoice(text=piece)], usage=usage)

    return {"chat": chat, "completion": completion}


def _usage(prompt, completion):
    from optimized.serving.protocol import Usage

    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _marked_usage(prompt):
    """A template's running usage: the two count markers in place of the completion and total counts."""
    from optimized.serving.app import PieceEvent
    from optimized.serving.protocol import Usage

    completion, total = PieceEvent.COUNT_MARKS
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("running_usage", [False, True])
def test_spliced_chunk_events_are_the_models_bytes(kind, running_usage):
    """The fast path of a stream (the chunk's JSON split around its text and token counts, the text escaped by
    json.dumps) gives exactly the bytes that building and serialising the pydantic chunk gives, for text that needs
    escaping too, with and without the running usage of ``continuous_usage_stats``."""
    from optimized.serving.app import PieceEvent, _sse

    make, prompt = _chunks()[kind], 37
    event = PieceEvent(make(PieceEvent.MARK, _marked_usage(prompt) if running_usage else None), prompt)
    for n, piece in enumerate(TRICKY_PIECES, start=1):
        assert event(piece, n) == _sse(make(piece, _usage(prompt, n) if running_usage else None)), piece


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=24), st.integers(0, 10**6))
def test_spliced_chunk_events_match_on_any_text(piece, n):
    from optimized.serving.app import PieceEvent, _sse

    for make in _chunks().values():
        assert PieceEvent(make(PieceEvent.MARK))(piece) == _sse(make(piece))
        assert PieceEvent(make(PieceEvent.MARK, _marked_usage(5)), 5)(piece, n) == _sse(make(piece, _usage(5, n)))


def test_a_marker_that_is_not_unique_falls_back_to_the_models():
    """A served model name that contains the text marker leaves the split ambiguous: no fast path, not a wrong one.
    A count marker in the name is harmless (the name comes before the text, the counts after it)."""
    from optimized.serving.app import PieceEvent, _sse, piece_events
    from optimized.serving.protocol import CompletionChoice, CompletionChunk

    def make(name, piece, usage):
        return CompletionChunk(id="cmpl-1", created=1, model=name, choices=[CompletionChoice(text=piece)], usage=usage)

    for usage in (None, _marked_usage(3)):
        template = make(PieceEvent.MARK, PieceEvent.MARK, usage)
        assert piece_events(template, 3) is None
        with pytest.raises(ValueError, match="exactly once"):
            PieceEvent(template, 3)
    name = f"model-{PieceEvent.COUNT_MARKS[0]}"
    event = piece_events(make(name, PieceEvent.MARK, _marked_usage(3)), 3)
    assert event("hi", 4) == _sse(make(name, "hi", _usage(3, 4)))


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_strings_are_never_streamed(tok, step):
    """The engine stops at the token that completes a stop string; the streamed pieces never show any of it,
    even when a stop string's first characters arrive steps before its last, and the final text is cut."""
    from optimized.serving.text import TextStream

    ids = tok("The answer is 42. STOP here")["input_ids"]
    stream, pieces = TextStream(tok, stop=("STOP", "zz")), []
    for i in range(0, len(ids), step):
        piece = stream.add(ids[i:i + step], finished=False)
        pieces.append(piece)
        assert "S" not in "".join(pieces)[len("The answer is 42. "):]
        if stream.stopped:
            break
    pieces.append(stream.add([], finished=True))
    assert "".join(pieces) == stream.text == "The answer is 42. "


def test_text_without_stop_is_sent_as_it_comes(tok):
    from optimized.serving.text import TextStream

    ids = tok("hello world")["input_ids"]
    stream = TextStream(tok)
    assert [stream.add([i], finished=False) for i in ids] == list("hello world")
    assert stream.add([1], finished=True) == ""  # </s> is a special token: no text


def test_text_stream_decodes_once_per_chunk(tok, monkeypatch):
    """The window's start stays put for a few tokens, its text kept: one decode per chunk, plus one each time the
    window starts again, and the pieces still add up to one decode of all the ids."""
    from optimized.serving import text

    calls = []
    decoder = text.plain_decoder

    def counting(tokenizer):
        decode = decoder(tokenizer)
        return lambda ids: calls.append(len(ids)) or decode(ids)

    monkeypatch.setattr(text, "plain_decoder", counting)
    ids = tok("the quick brown fox jumps over the lazy dog, twice: the quick brown fox")["input_ids"]
    stream = text.TextStream(tok)
    pieces = [stream.add([i], finished=False) for i in ids]
    pieces.append(stream.add([], finished=True))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) < len(calls) <= len(ids) + len(ids) // text._WINDOW + 2
    assert max(calls) <= text._WINDOW + 1


def test_plain_decoder_is_the_tokenizers_own_decode(tok):
    """The fast path (the Rust tokenizer's decode) against its twin, the tokenizer's ``decode``: the same text for
    random ids, special tokens and unknown ids included. A tokenizer that cleans its text up afterwards, or whose
    class changes ``_decode``, keeps its own ``decode``: the same text again, from the slow path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from optimized.serving.text import plain_decoder

    fast = plain_decoder(tok)
    assert fast.func == tok._tokenizer.decode  # the fast path is taken for the test tokenizer (BPE, no clean-up)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, len(tok), int(rng.integers(0, 12))).tolist()
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True)
    # word-level with clean-up: "hello ." becomes "hello." in transformers' decode, not in the Rust one
    words = Tokenizer(models.WordLevel(vocab={"hello": 0, ".": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    cleaned = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert plain_decoder(cleaned)([0, 1]) == cleaned.decode([0, 1], skip_special_tokens=True) == "hello."
    assert cleaned._tokenizer.decode([0, 1]) == "hello ."

    class Shouting(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    loud = Shouting(tokenizer_object=tok._tokenizer)
    assert plain_decoder(loud)(tok("abc")["input_ids"]) == "ABC"


def test_speculative_config_speaks_vllm():
    from optimized.serve import SpeculativeConfig

    assert SpeculativeConfig.parse(None).mode == "adaptive"
    spec = SpeculativeConfig.parse('{"method": "dspark", "num_speculative_tokens": 3, '
                                   '"enable_adaptive_verification": false}')
    assert (spec.mode, spec.scheduler(7).k) == ("fixed", 3)
    spec = SpeculativeConfig.parse('{"num_speculative_tokens_per_batch_size": {"1": 7, "16": 3}}')
    assert spec.mode == "dsd" and spec.scheduler(7).dsd_table == {1: 7, 16: 3}
    assert SpeculativeConfig.parse('{"enable_adaptive_verification": true}').scheduler(7).mode == "adaptive"
    assert SpeculativeConfig.parse('{"mode": "none"}').mode == "none"
    assert SpeculativeConfig.parse('{"mode": "threshold", "threshold": 0.3}').scheduler(7).threshold == 0.3
    ngram = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (ngram.method, ngram.mode, ngram.lookup_max, ngram.lookup_min, ngram.uses_drafter) == ("ngram", "fixed", 4,
                                                                                                  1, False)
    hybrid = SpeculativeConfig.parse('{"method": "hybrid", "prompt_lookup_min": 2}')
    assert (hybrid.method, hybrid.mode, hybrid.lookup_min, hybrid.uses_drafter) == ("hybrid", "adaptive", 2, True)
    for bad, match in [('{"method": "ngram", "mode": "adaptive"}', "no confidences"),
                       ('{"method": "ngram", "model": "d"}', "no checkpoint"),
                       ('{"prompt_lookup_max": 3}', "ngram and hybrid"),
                       ('{"method": "hybrid", "prompt_lookup_max": 1, "prompt_lookup_min": 2}', "min_n"),
                       ('{"method": "eagle"}', "method"), ('{"speculative_tokens": 3}', "unknown keys"),
                       ('{"mode": "oracle"}', "mode"), ('{"num_speculative_tokens": -1}', "≥ 0"), ("[1]", "object"),
                       ("{", "JSON"), ('{"num_speculative_tokens_per_batch_size": 5}', "batch sizes")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="exceeds"):
        SpeculativeConfig.parse('{"mode": "fixed", "num_speculative_tokens": 9}').scheduler(7)
    with pytest.raises(ValueError, match="must be 7"):
        SpeculativeConfig.parse('{"mode": "adaptive", "num_speculative_tokens": 5}').scheduler(7)


def test_acceptance_feedback_flag_reaches_the_engine(tiny_dirs):
    """``--acceptance-feedback`` (off by default) builds the engine with EngineConfig.acceptance_feedback: the adaptive
    mode's monitor of the drafts' outcomes exists, and without the flag it does not."""
    from optimized.serve import build_parser, build_runtime, resolve

    model_dir, drafter_dir = tiny_dirs
    base = ["--model", str(model_dir), "--drafter", str(drafter_dir), "--device", "cpu", "--max-model-len", "64",
            "--max-num-seqs", "2"]
    assert build_parser().parse_args(base).acceptance_feedback is False
    on = build_runtime(resolve(build_parser().parse_args(base + ["--acceptance-feedback"]))).engine
    off = build_runtime(resolve(build_parser().parse_args(base))).engine
    assert on.config.acceptance_feedback and on._acceptance is not None and on.survival_scale is None
    assert not off.config.acceptance_feedback and off._acceptance is None


@pytest.mark.parametrize("config", ['{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
                                    '{"method": "hybrid", "mode": "fixed"}', '{"method": "hybrid"}'])
def test_the_server_runs_the_ngram_and_hybrid_proposers_losslessly(tiny_dirs, config):
    """``--speculative-config`` methods ngram and hybrid build the engine with that proposer (the ngram one without
    a drafter checkpoint), and its greedy tokens are plain decoding's."""
    from optimized.engine import SamplingParams
    from optimized.serve import build_parser, build_runtime, resolve
    from reference.hybrid import HybridProposer
    from reference.ngram import NgramProposer

    model_dir, drafter_dir = tiny_dirs
    base = ["--model", str(model_dir), "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "2"]
    spec = json.loads(config)
    argv = base + ([] if spec["method"] == "ngram" else ["--drafter", str(drafter_dir)])
    if spec["method"] == "ngram":
        with pytest.raises(ValueError, match="no checkpoint"):
            resolve(build_parser().parse_args(argv + ["--drafter", str(drafter_dir), "--speculative-config", config]))
    runtime = build_runtime(resolve(build_parser().parse_args(argv + ["--speculative-config", config])))
    plain = build_runtime(resolve(build_parser().parse_args(base + ["--speculative-config", '{"mode": "none"}'])))
    proposer = runtime.engine.runner.proposer or runtime.engine.runner.hybrid
    assert isinstance(proposer, NgramProposer if spec["method"] == "ngram" else HybridProposer)
    if spec["method"] == "ngram":
        assert (proposer.config.gamma, proposer.config.max_n) == (3, 2)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10]]
    outputs = []
    for rt in (runtime, plain):
        for rid, prompt in enumerate(prompts):
            rt.engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), request_id=rid)
        while rt.engine.has_unfinished():
            rt.engine.step()
        outputs.append([list(rt.engine.sequence(rid).output_ids) for rid in range(len(prompts))])
    assert [len(o) for o in outputs[1]] == [12, 12] and outputs[0] == outputs[1]


def test_calibration_window_counts_verified_slots_only():
    """Trials are the verified slots; a slot survived if it lies inside the accepted prefix; the window keeps the
    last W trials of each slot. Checked against a brute-force list of trials."""
    from optimized.serving.metrics import CalibrationWindow

    rng = np.random.default_rng(0)
    gamma, size = 4, 50
    window, trials = CalibrationWindow(gamma, size), [[] for _ in range(gamma)]
    for _ in range(40):
        r = int(rng.integers(1, 6))
        pred = np.sort(rng.random((r, gamma)), axis=1)[:, ::-1].tolist()  # non-increasing prefix survivals
        verified = rng.integers(0, gamma + 1, r).tolist()
        accepted = [int(rng.integers(0, v + 1)) for v in verified]
        held = [p if rng.random() > 0.2 else [] for p in pred]  # some requests hold no draft
        window.add(held, verified, accepted)
        for a, v, acc in zip(held, verified, accepted):
            for k in range(v if a else 0):
                trials[k].append((a[k], float(k < acc)))
    for k, (pred_mean, real_mean, n) in enumerate(window.summary()):
        last = trials[k][-size:]
        assert n == len(last)
        if n:
            assert pred_mean == pytest.approx(np.mean([p for p, _ in last]))
            assert real_mean == pytest.approx(np.mean([s for _, s in last]))


def _samples(registry) -> dict:
    """A registry's exposition as {(sample name, sorted labels): value}, without the ``_created`` timestamps."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.name.endswith("_created")}


def test_loop_metrics_expose_what_prometheus_clients_own_would():
    """LoopCounter and LoopHistogram against their twins, prometheus-client's Counter and Histogram, fed the same
    observations (values on the bucket bounds, below the first, past the last, negative): the same samples."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from optimized.serving.metrics import ITL_BUCKETS, LoopCounter, LoopHistogram

    rng = np.random.default_rng(1)
    values = [*ITL_BUCKETS, 0.0, -1.0, 1e6, *rng.exponential(0.05, 500).tolist()]
    fast, twin = CollectorRegistry(), CollectorRegistry()
    label = {"model_name": "m"}
    h, h2 = (LoopHistogram("x:latency_seconds", "doc", ITL_BUCKETS, fast, label),
             Histogram("x:latency_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=twin).labels(**label))
    c, c2 = LoopCounter("x:tokens", "doc", fast, label), Counter("x:tokens", "doc", ["model_name"],
                                                               registry=twin).labels(**label)
    k, k2 = (LoopCounter("x:done", "doc", fast, label, key="reason"),
             Counter("x:done", "doc", ["model_name", "reason"], registry=twin))
    u, u2 = LoopCounter("x:steps", "doc", fast), Counter("x:steps", "doc", registry=twin)
    for i, v in enumerate(values):
        h.observe(v)
        h2.observe(v)
        c.inc(i % 3)
        c2.inc(i % 3)
        k.inc(1.0, "stop" if i % 4 else "length")
        k2.labels("m", "stop" if i % 4 else "length").inc()
    u.inc()
    u2.inc()
    got, want = _samples(fast), _samples(twin)
    assert got.keys() == want.keys() and all(got[x] == pytest.approx(want[x], rel=1e-12) for x in want)
    with pytest.raises(ValueError, match="sorted"):
        LoopHistogram("x:bad", "doc", (2.0, 1.0), CollectorRegistry())


def test_server_metrics_gauges_are_computed_when_scraped():
    """The window means and the calibration gauges read the state at scrape time: nothing before the first decode
    step (0, and no calibration slot yet), then exactly the window's numbers, slot k only once it had a trial."""
    from types import SimpleNamespace

    from optimized.serving.metrics import ServerMetrics

    m = ServerMetrics("m", gamma=3, has_drafter=True)

    def step(verified, accepted, pred, drafted=True, running=2):
        m.observe_step(SimpleNamespace(step_time_s=0.002, num_running=running, num_waiting=1,
                                       num_decoding=len(verified), verify_tokens=len(verified) + sum(verified),
                                       budget=sum(verified), drafted=drafted, verified=verified, accepted=accepted,
                                       predicted_survival=pred, request_ids=list(range(len(verified)))))

    empty = _samples(m.registry)
    assert empty[("dspark:mean_accepted_length", ())] == 0.0
    assert not [x for x in empty if x[0].startswith("dspark:calibration")]
    step([], [], [], drafted=True)  # a prefill-only step: the drafter ran, nobody verified yet
    step([2, 1], [1, 0], [[0.9, 0.5], [0.8]])  # slots 1 and 2 get trials, slot 3 none
    got = _samples(m.registry)
    assert got[("vllm:num_requests_running", (("model_name", "m"),))] == 2
    assert got[("dspark:mean_accepted_length", ())] == pytest.approx(1 + 1 / 2)
    assert got[("dspark:mean_verify_length", ())] == pytest.approx(3 / 2)
    assert got[("dspark:draft_gate_closed_ratio", ())] == 0.0
    slots = {dict(labels)["slot"] for name, labels in got if name == "dspark:calibration_trials"}
    assert slots == {"1", "2"}
    assert got[("dspark:calibration_predicted_survival", (("slot", "1"),))] == pytest.approx(0.85)
    assert got[("dspark:calibration_realised_survival", (("slot", "1"),))] == pytest.approx(0.5)
    assert got[("dspark:calibration_error", (("slot", "2"),))] == pytest.approx(0.5 - 0.0)
    assert got[("dspark:calibration_trials", (("slot", "2"),))] == 1
    step([0], [0], [[]], drafted=False)  # no draft verified, but the step before had run the drafter: gate open
    step([0], [0], [[]], drafted=False)  # the previous step ran no drafter: this one counts as gate-closed
    got = _samples(m.registry)
    assert got[("dspark:draft_gate_closed_ratio", ())] == pytest.approx(1 / 3)
    assert got[("dspark:draft_gate_closed_steps_total", ())] == 1
    m.idle()
    assert _samples(m.registry)[("vllm:num_requests_running", (("model_name", "m"),))] == 0


def test_request_schemas():
    from pydantic import ValidationError

    from optimized.serving.protocol import ChatCompletionRequest, CompletionRequest

    msg = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = ChatCompletionRequest(messages=msg, max_completion_tokens=5, stop="x")
    assert (req.messages[0].text(), req.token_limit, req.stop_strings) == ("ab", 5, ("x",))
    assert CompletionRequest(prompt=["only one"]).prompt == "only one"
    assert CompletionRequest(prompt=[[1, 2, 3]]).prompt == [1, 2, 3]
    for bad in [dict(prompt=["a", "b"]), dict(prompt="a", n=2), dict(prompt="a", stop=[""]),
                dict(prompt="a", logit_bias={"5": 1.0}), dict(prompt="a", echo=True),
                dict(prompt="a", stream_options={"include_usage": True}), dict(prompt="a", temperature=float("nan"))]:
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=msg, top_logprobs=2)


# ---------------------------------------------------------------------------------------------------------------
# Coalescing queued steps into one chunk
# ---------------------------------------------------------------------------------------------------------------


class _Handle:
    def __init__(self):
        import asyncio

        self.request_id, self.finished, self.queue = 7, False, asyncio.Queue()


class _Request:
    async def receive(self):  # a client that never disconnects
        import asyncio

        await asyncio.Event().wait()


class _Server:
    class settings:  # noqa: N801
        coalesce_steps = True

    class loop:  # noqa: N801 (stands in for the EngineLoop instance)
        aborted = []

        @classmethod
        def abort(cls, handle):
            cls.aborted.append(handle.request_id)


def _run(coro):
    import asyncio

    return asyncio.run(coro)


def test_queued_steps_leave_as_one_chunk():
    """Steps that queued while the stream was busy merge into one output (tokens and log-probabilities in order,
    the last step's finish); an error queued behind them is raised on the next read, after their tokens."""
    from optimized.sequence import StepOutput
    from optimized.serving.app import OutputStream
    from optimized.serving.engine_loop import EngineFailed

    async def scenario():
        handle = _Handle()
        stream = OutputStream(_Server(), handle, _Request())
        handle.queue.put_nowait(StepOutput(7, [1, 2], False, None, [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2)]]))
        handle.queue.put_nowait(StepOutput(7, [3], False, None, [-0.3], [[(3, -0.3)]]))
        handle.queue.put_nowait(StepOutput(7, [4, 5], True, "length", [-0.4, -0.5], [[(4, -0.4)], [(5, -0.5)]]))
        merged = await stream.__anext__()
        assert merged.new_token_ids == [1, 2, 3, 4, 5] and merged.finished and merged.finish_reason == "length"
        assert merged.new_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
        assert [t for [(t, _)] in merged.new_top_logprobs] == [1, 2, 3, 4, 5]

        handle.queue.put_nowait(StepOutput(7, [6], False))
        handle.queue.put_nowait(EngineFailed("boom"))
        handle.queue.put_nowait(StepOutput(7, [8], False))
        assert (await stream.__anext__()).new_token_ids == [6]
        with pytest.raises(EngineFailed):
            await stream.__anext__()
        assert (await stream.__anext__()).new_token_ids == [8]
        handle.finished = True
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        stream.close()

    _run(scenario())


def test_one_step_at_a_time_is_not_delayed():
    """A stream that keeps up gets every step as it comes: nothing waits for a later step to merge with."""
    import asyncio

    from optimized.sequence import StepOutput
    from optimized.serving.app import OutputStream

    async def scenario():
        handle = _Handle()
        stream = OutputStream(_Server(), handle, _Request())
        got = []
        for i in range(3):
            handle.queue.put_nowait(StepOutput(7, [i], i == 2, "stop" if i == 2 else None))
            got.append(await asyncio.wait_for(stream.__anext__(), timeout=5))
        assert [o.new_token_ids for o in got] == [[0], [1], [2]]
        stream.close()

    _run(scenario())


def test_stream_each_step_flag_turns_coalescing_off():
    from optimized.serve import build_parser, server_settings

    assert server_settings(build_parser().parse_args([])).coalesce_steps
    assert not server_settings(build_parser().parse_args(["--stream-each-step"])).coalesce_steps


def test_engine_process_flag_and_a_picklable_build():
    """``--engine-process/--no-engine-process``; what the engine process receives (the build) survives pickling."""
    import functools
    import pickle

    from optimized.serve import DEFAULT_ENGINE_PROCESS, build_parser, build_runtime, resolve

    assert build_parser().parse_args([]).engine_process is None  # the device decides
    assert DEFAULT_ENGINE_PROCESS == {"cpu": False, "cuda": True}
    assert resolve(build_parser().parse_args(["--device", "cpu"])).engine_process is False
    assert resolve(build_parser().parse_args(["--device", "cpu", "--engine-process"])).engine_process is True
    assert build_parser().parse_args(["--engine-process"]).engine_process is True
    assert build_parser().parse_args(["--no-engine-process"]).engine_process is False
    sa = resolve(build_parser().parse_args(["--device", "cpu", "--speculative-config", '{"mode": "fixed"}']))
    build = pickle.loads(pickle.dumps(functools.partial(build_runtime, sa)))
    assert build.func is build_runtime and build.args[0].spec.mode == "fixed" and build.args[0].dtype == sa.dtype


def test_api_server_count_flag():
    """``--api-server-count N`` (vLLM's flag): N ≥ 1; more than one puts the engine in its own process."""
    from optimized.serve import build_parser, default_api_server_count, resolve, usable_cores

    def parse(*argv):
        return resolve(build_parser().parse_args(["--device", "cpu", *argv]))

    assert build_parser().parse_args([]).api_server_count is None  # the device and the cores decide
    assert parse().api_server_count == 1 and parse("--engine-process").api_server_count == 1  # CPU: one
    assert parse("--api-server-count", "3").engine_process is True  # the CPU's default is the thread
    assert parse("--api-server-count", "3").api_server_count == 3
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_cores() == cores
    assert default_api_server_count("cuda", True) == max(1, min(4, cores // 4))
    assert default_api_server_count("cuda", False) == default_api_server_count("cpu", True) == 1
    for argv, message in ((["--api-server-count", "0"], "must be ≥ 1"),
                          (["--api-server-count", "2", "--no-engine-process"], "own process")):
        with pytest.raises(ValueError, match=message):
            parse(*argv)


def test_step_cost_gauges_follow_the_engine():
    """The engine's measured step costs (``StepStats.cost_drift`` / ``price_scales``) become two labelled gauges,
    each appearing once the engine has measured that kind; a gate the engine reports closed counts whatever the
    previous step drafted."""
    from optimized.sequence import StepStats
    from optimized.serving.metrics import ServerMetrics

    m = ServerMetrics("m", 3, True)

    def value(name, kind):
        return m.registry.get_sample_value(name, {"kind": kind})

    assert value("dspark:step_cost_drift", "plain") is None, "no gauge before the engine reports"
    st = StepStats(step_time_s=0.001, num_running=1, num_waiting=0, num_decoding=1, verify_tokens=1, budget=None,
                   drafted=True, verified=[0], accepted=[0], predicted_survival=[[]], request_ids=[0],
                   gate_closed=True, cost_drift={"plain": 0.25, "speculative": None},
                   price_scales={"plain": 1.25, "speculative": 1.0})
    m.observe_step(st)
    assert value("dspark:step_cost_drift", "plain") == 0.25
    assert value("dspark:step_cost_drift", "speculative") is None, "not measured yet"
    assert value("dspark:step_cost_scale", "plain") == 1.25
    assert m.registry.get_sample_value("dspark:draft_gate_closed_steps_total") == 1
    merged = ServerMetrics.merged("m", 3, True, [ServerMetrics("m", 3, True).snapshot(), m.snapshot()])
    assert merged.registry.get_sample_value("dspark:step_cost_scale", {"kind": "plain"}) == 1.25


def test_a_body_that_stops_arriving_gets_a_408_and_a_whole_one_is_untouched():
    """The body-limit middleware times out a body whose next part does not come (a client that stopped half-way),
    answering 408 in the OpenAI error shape instead of holding the connection; a body sent whole passes, and the
    receive after it (a stream's disconnect watch) is not timed."""
    import asyncio
    import json

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from optimized.serving.app import BodyLimitMiddleware

    waited = []

    async def echo(request):
        body = await request.json()
        waited.append(await asyncio.wait_for(request.receive(), 1.0))  # after the body: untimed, here 1 s
        return JSONResponse(body)

    inner = Starlette(routes=[Route("/echo", echo, methods=["POST"])])

    app = BodyLimitMiddleware(inner, max_bytes=10_000, read_timeout=0.2)
    scope = {"type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"20")],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}

    async def call(parts: list[bytes], complete: bool, then_disconnect_after: float) -> tuple[int, dict]:
        queue: asyncio.Queue = asyncio.Queue()
        for i, part in enumerate(parts):
            queue.put_nowait({"type": "http.request", "body": part,
                              "more_body": i < len(parts) - 1 or not complete})

        async def receive():
            if queue.empty():
                await asyncio.sleep(then_disconnect_after)
                return {"type": "http.disconnect"}
            return await queue.get()

        sent = []

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, json.loads(body)

    status, body = asyncio.run(call([b'{"a": 1, "b'], False, then_disconnect_after=5.0))  # half a body, then nothing
    assert status == 408 and body["error"]["code"] == "request_timeout"
    status, body = asyncio.run(call([b'{"a": 1, "b": 22222}'], True, then_disconnect_after=0.5))
    assert status == 200 and body == {"a": 1, "b": 22222}
    assert waited == [{"type": "http.disconnect"}], "the receive after the body waited past the body timeout"


def test_a_connection_that_sends_no_whole_headers_is_closed():
    """uvicorn's protocol with the header timeout (what ``serve_until_stopped`` runs): a connection that sends nothing,
    or half a request line, is closed after the timeout, and so is a kept-alive one that sends half of its next
    request's headers after a response; a whole request is answered as usual, however long its answer takes."""
    import asyncio
    import socket
    import threading
    import time

    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from optimized.serving.app import header_timeout
    from tests.serving.conftest import free_port

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":  # an answer that outlasts the header timeout
            await asyncio.sleep(0.8)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    # keep-alive far longer than the header timeout: the closes below are the header timeout's
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=header_timeout(AutoHTTPProtocol, 0.3), timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)

        def closed_by_server(sock: socket.socket, payload: bytes, since: float | None = None) -> bool:
            """Whether the server closes ``sock`` after ``payload``, the timeout after ``since`` (default: now)."""
            t0 = time.monotonic() if since is None else since
            sock.sendall(payload)
            data = sock.recv(1024)  # b"": the server closed the connection
            return data == b"" and 0.1 < time.monotonic() - t0 < 4

        def connect() -> socket.socket:
            return socket.create_connection(("127.0.0.1", port), timeout=5)

        with connect() as sock:
            assert closed_by_server(sock, b""), "an idle connection stayed open"
        with connect() as sock:
            assert closed_by_server(sock, b"POST /v1/chat/completions HTT"), "half a request line stayed open"
        with connect() as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.1 200"), "a slow answer was cut"
            answered = time.monotonic()  # the next request's headers are due 0.3 s after the answer
            assert closed_by_server(sock, b"GET / HTTP/1.1\r\nHost: x\r\nX-Half: ", since=answered), \
                "half of a kept-alive connection's next headers stayed open"
    finally:
        server.should_exit = True
        thread.join(10)


def test_timeout_flags():
    """``--header-timeout`` and ``--body-timeout`` reach the HTTP side's settings; their defaults are the app's."""
    from optimized.serve import build_parser, resolve, server_settings
    from optimized.serving.app import BODY_READ_TIMEOUT_S, HEADER_TIMEOUT_S

    default = server_settings(build_parser().parse_args([]))
    assert (default.header_timeout, default.body_timeout) == (HEADER_TIMEOUT_S, BODY_READ_TIMEOUT_S)
    got = server_settings(build_parser().parse_args(["--header-timeout", "2.5", "--body-timeout", "4"]))
    assert (got.header_timeout, got.body_timeout) == (2.5, 4.0)
    for flag in ("--header-timeout", "--body-timeout"):
        with pytest.raises(ValueError, match=f"{flag} must be > 0"):
            resolve(build_parser().parse_args(["--device", "cpu", flag, "0"]))


def test_the_servers_engine_is_frozen_out_of_the_garbage_collector(tiny_dirs):
    """The server builds its engine with ``freeze_gc``: everything alive after start-up is out of the cyclic
    collector's reach (a full collection would walk the model and the engine in the middle of decoding steps);
    a plain ``build_runtime`` (tests, benchmarks building engines one after another) freezes nothing."""
    import gc

    from optimized.serve import build_parser, build_runtime, resolve

    model_dir, _ = tiny_dirs
    sa = resolve(build_parser().parse_args(["--model", str(model_dir), "--device", "cpu", "--max-model-len", "64",
                                            "--max-num-seqs", "2", "--speculative-config", '{"mode": "none"}']))
    assert gc.get_freeze_count() == 0
    build_runtime(sa)
    assert gc.get_freeze_count() == 0
    try:
        runtime = build_runtime(sa, freeze_gc=True)
        assert gc.get_freeze_count() > 0
        engine = runtime.engine
        assert all(o is not engine for o in gc.get_objects())  # frozen: in no generation the collector walks
    finally:
        gc.unfreeze()
