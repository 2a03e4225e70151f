"""The engine's monitoring and lifecycle API used by the server: ``last_step_stats``, ``warmup``, ``release``."""

from __future__ import annotations

import gc

import pytest

from optimized.engine import Engine, EngineConfig, SamplingParams, StepStats, frozen_heap
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from tests.conftest import tiny_drafter, tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(mode: str = "adaptive", slots: int = 3) -> Engine:
    return _engine_and_target(mode, slots)[0]


def _engine_and_target(mode: str = "adaptive", slots: int = 3) -> tuple[Engine, Target]:
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    drafter = tiny_drafter(target, gamma=4, noise=0.2)
    cost = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, sizes=list(range(1, 129)))
    engine = Engine(target, drafter, EngineConfig(max_num_seqs=slots, max_seq_len=96, kernel_backend="torch"),
                    SchedulerConfig(mode=mode, k=3), cost)
    return engine, target


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.sequence(i).output_ids for i in ids]


@pytest.mark.parametrize("mode", ["adaptive", "fixed", "none"])
def test_step_stats_account_for_every_verified_token(mode):
    engine = _engine(mode)
    assert engine.last_step_stats() is None
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for p in ([5, 9, 3], [2, 40, 41, 42], [60], [7, 7]):  # four requests on three slots: one waits
        engine.add_request(p, params)
    seen_waiting, emitted = False, 0
    while engine.has_unfinished():
        outs = engine.step()
        st = engine.last_step_stats()
        assert isinstance(st, StepStats) and st.step_time_s > 0
        seen_waiting |= st.num_waiting > 0
        assert st.num_running <= 3
        assert len(st.verified) == len(st.accepted) == len(st.predicted_survival) == st.num_decoding
        if st.num_decoding:
            assert st.verify_tokens == st.num_decoding + sum(st.verified)
        assert all(0 <= a <= v for a, v in zip(st.accepted, st.verified))
        for v, a in zip(st.verified, st.predicted_survival):
            if v:  # the calibrated survivals a_1..a_ℓ of the verified slots, non-increasing
                assert len(a) == v and all(x >= y for x, y in zip(a, a[1:]))
        if mode == "adaptive" and st.budget is not None:
            assert sum(st.verified) == st.budget
        if mode != "adaptive":
            assert st.budget is None
        if mode == "none":
            assert not st.drafted
        emitted += sum(len(o.new_token_ids) for o in outs)
    assert seen_waiting and emitted == 4 * 12
    assert engine.last_step_stats().num_running == engine.last_step_stats().num_waiting == 0


def test_warmup_leaves_a_fresh_engine():
    """After warm-up nothing runs, nothing is remembered, and outputs equal those of an engine never warmed up."""
    warm, cold = _engine(), _engine()
    assert warm.warmup() > 0
    assert not warm.has_unfinished() and warm.last_step_stats() is None
    prompts, params = [[5, 9, 3], [2, 40, 41, 42]], SamplingParams(max_new_tokens=10, temperature=0.9)
    assert _run(warm, prompts, params) == _run(cold, prompts, params)


def test_release_forgets_only_finished_requests():
    engine = _engine("fixed")
    rid = engine.add_request([4, 5, 6], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="still running"):
        engine.release(rid)
    assert engine.abort(rid)
    engine.release(rid)
    with pytest.raises(KeyError):
        engine.sequence(rid)
    engine.release(rid)  # idempotent


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_raw_and_top_logprobs_are_the_targets(temperature):
    """Raw log-probabilities and top-k alternatives equal log-softmax of a plain forward over prompt + output, in
    the prefill token and in every speculative step; a neighbour asking only for p_t log-probabilities keeps them."""
    import torch

    engine, target = _engine_and_target("adaptive")
    raw = SamplingParams(max_new_tokens=11, temperature=temperature, ignore_eos=True, logprobs=True,
                         raw_logprobs=True, top_logprobs=3)
    plain = SamplingParams(max_new_tokens=11, temperature=0.7, ignore_eos=True, logprobs=True)
    a = engine.add_request([4, 5, 6], raw)
    b = engine.add_request([9, 8], plain)
    streamed = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == a:
                assert len(out.new_top_logprobs) == len(out.new_logprobs) == len(out.new_token_ids)
                streamed += out.new_top_logprobs
    for rid, scale in ((a, 1.0), (b, 0.7)):
        seq = engine.sequence(rid)
        ids = torch.tensor(seq.prompt_ids + seq.output_ids)
        logits, _ = target.forward(ids, target.new_cache(), start_pos=0)
        logp = torch.log_softmax(logits / scale, -1)[len(seq.prompt_ids) - 1: -1]  # [n_out, V]
        expect = [float(logp[i, t]) for i, t in enumerate(seq.output_ids)]
        assert seq.logprobs == pytest.approx(expect, abs=1e-4)  # fp32 logits through two code paths
        if rid == a:
            assert seq.top_logprobs == streamed and len(streamed) == 11
            top = torch.topk(logp, 3, dim=-1)
            for i, alts in enumerate(seq.top_logprobs):
                assert [t for t, _ in alts] == top.indices[i].tolist()
                assert [v for _, v in alts] == pytest.approx(top.values[i].tolist(), abs=1e-4)
                if temperature == 0:  # greedy emits the most likely token
                    assert alts[0][0] == seq.output_ids[i]
        else:
            assert seq.top_logprobs == []


def test_seed_keys_the_random_numbers():
    """A seeded request's random numbers do not depend on its request id, nor (with fixed verify lengths) on its
    neighbours; it is exactly the request word it replaces. Sampled tokens depend on the verify lengths too (an
    unverified position takes the bonus draw instead of an accept test), so under the adaptive policy, whose budget
    depends on the whole batch, only the same load reproduces them. (T = 4: the tiny target is nearly
    deterministic at T = 1.)"""
    def sample(mode, prompts, seeds, first_id):
        engine = _engine(mode)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=12, temperature=4.0, ignore_eos=True, seed=s),
                                  request_id=first_id + i) for i, (p, s) in enumerate(zip(prompts, seeds))]
        while engine.has_unfinished():
            engine.step()
        return [engine.sequence(i).output_ids for i in ids]

    for mode in ("fixed", "adaptive"):
        alone = sample(mode, [[5, 9, 3]], [1234], 0)[0]
        assert sample(mode, [[5, 9, 3]], [1234], 99)[0] == alone
        assert sample(mode, [[5, 9, 3]], [None], 1234)[0] == alone
        assert sample(mode, [[5, 9, 3]], [77], 0)[0] != alone
    crowd = sample("fixed", [[2, 40, 41], [5, 9, 3], [5, 9, 3]], [None, 1234, 77], 50)
    assert crowd[1] == sample("fixed", [[5, 9, 3]], [1234], 0)[0]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**31)
    with pytest.raises(ValueError, match="need logprobs"):
        SamplingParams(top_logprobs=2)


def test_bad_engine_settings_name_the_problem():
    """A setting the engine cannot honour fails at construction with a message that names it."""
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, layer_backend="torch")
    with pytest.raises(ValueError, match="linear_rows"):
        EngineConfig(linear_rows=-1)
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="cuda")
    assert EngineConfig(batch_invariant=True).batch_invariant


def test_generate_cli_passes_the_finish_time_gate(monkeypatch, capsys):
    """``python -m optimized.generate --finish-time-gate`` builds the engine with EngineConfig.finish_time_gate (off
    without the flag)."""
    import optimized.generate as og
    from reference.target import Target
    from reference.testing import tiny_hf_model

    target = Target.from_model(tiny_hf_model("llama"))
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: target))
    monkeypatch.setattr(Target, "encode", lambda self, p, chat_template=True: [ord(c) % 90 + 2 for c in p])
    seen, real = [], og.generate

    def spy(*args, engine_config=None, **kwargs):
        seen.append(engine_config.finish_time_gate)
        return real(*args, engine_config=engine_config, **kwargs)

    monkeypatch.setattr(og, "generate", spy)
    for extra in ([], ["--finish-time-gate"]):
        assert og.main(["--prompt", "abc", "--mode", "none", "--max-new-tokens", "3", "--json", *extra]) == 0
    assert seen == [False, True]


def test_frozen_heap_freezes_for_the_block_and_gives_the_heap_back():
    """frozen_heap moves what is alive on entry out of the collector's reach for the block (a full collection inside
    does not walk it) and gives it back on exit, on an error too: afterwards an engine's cycles are collectable."""
    gc.unfreeze()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="inside"), frozen_heap(collect=False):
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0
