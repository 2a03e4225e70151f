"""The engine's monitoring and lifecycle API used by the server: ``last_step_stats``, ``warmup``, ``release``."""

from __future__ import annotations

import pytest

from optimized.engine import Engine, EngineConfig, StepStats
from optimized.scheduler import SamplingParams
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from tests.conftest import tiny_drafter, tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(mode: str = "adaptive", slots: int = 3) -> Engine:
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    drafter = tiny_drafter(target, gamma=4, noise=0.2)
    cost = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, sizes=list(range(1, 129)))
    return Engine(target, drafter, EngineConfig(max_num_seqs=slots, max_seq_len=96, kernel_backend="torch"),
                  SchedulerConfig(mode=mode, k=3), cost)


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
            if v:  # a verified draft carries the survivals it was scheduled with: γ non-increasing values
                assert len(a) == 4 and all(x >= y for x, y in zip(a, a[1:]))
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
