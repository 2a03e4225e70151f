"""The server's pieces without a server: text streaming with stop strings, the speculative config, the live
calibration window, the request schemas."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.conftest import char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


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
    for bad, match in [('{"method": "eagle"}', "method"), ('{"speculative_tokens": 3}', "unknown keys"),
                       ('{"mode": "oracle"}', "mode"), ('{"num_speculative_tokens": -1}', "≥ 0"), ("[1]", "object"),
                       ("{", "JSON"), ('{"num_speculative_tokens_per_batch_size": 5}', "batch sizes")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="exceeds"):
        SpeculativeConfig.parse('{"mode": "fixed", "num_speculative_tokens": 9}').scheduler(7)
    with pytest.raises(ValueError, match="must be 7"):
        SpeculativeConfig.parse('{"mode": "adaptive", "num_speculative_tokens": 5}').scheduler(7)


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
