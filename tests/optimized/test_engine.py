"""The engine facade (``optimized/engine.py``): warm-up leaves results unchanged, and ``last_step_stats`` reports
what each step did, checked against the requests' own records on a tiny model."""

from __future__ import annotations

import pytest
import torch

from optimized.engine import Engine, EngineConfig, SamplingParams, StepStats
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 3, 17], [2, 40, 41, 42, 43, 7, 8], [60]]


@pytest.fixture(scope="module")
def models():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    return target, tiny_drafter(target, gamma=4, noise=0.2)


def _cost(draft_ms: float = 0.0) -> CostTable:
    return CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=draft_ms, sizes=list(range(1, 129)))


def _engine(models, mode: str, cost: CostTable | None = None, **sched) -> Engine:
    target, drafter = models
    cfg = EngineConfig(max_num_seqs=3, max_seq_len=96, kernel_backend="torch", seed=3)
    return Engine(target, drafter if mode != "none" else None, cfg, SchedulerConfig(mode=mode, **sched), cost)


def _run(engine: Engine, temperature: float, max_new_tokens: int = 12) -> tuple[list, list[StepStats]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in PROMPTS]
    stats = []
    while engine.has_unfinished():
        engine.step()
        stats.append(engine.last_step_stats())
    seqs = [engine.sequence(r) for r in rids]
    return [(s.output_ids, s.verify_lengths, s.accepted_lengths) for s in seqs], stats


@pytest.mark.parametrize("mode", ["none", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_warmup_leaves_results_unchanged(models, mode, temperature):
    cold = _engine(models, mode, _cost())
    warm = _engine(models, mode, _cost())
    assert warm.warmup() > 0
    assert warm.runner.idle and not warm.has_unfinished()
    assert warm.last_step_stats() is None and warm.stats["steps"] == 0  # dummy steps are not engine steps
    assert _run(warm, temperature)[0] == _run(cold, temperature)[0]
    with pytest.raises(RuntimeError, match="idle"):
        warm.add_request([4, 5], SamplingParams(max_new_tokens=2))
        warm.step()
        warm.warmup()


def test_last_step_stats_match_the_requests_records(models):
    engine = _engine(models, "adaptive", _cost(), staleness=1)
    assert engine.last_step_stats() is None
    results, stats = _run(engine, temperature=1.0)
    first = stats[0]  # the prefill step: nobody verified, everybody drafted
    assert (first.num_decoding, first.verify_tokens, first.verified, first.predicted_survival) == (0, 0, [], [])
    assert first.drafted and first.budget is None and first.num_running == 3 and first.num_waiting == 0
    assert all(s.step_time_s > 0 for s in stats) and all(s.budget is not None for s in stats[1:])
    seqs = {s.request_id: s for s in engine._ids.values()}
    step_of = {rid: 0 for rid in seqs}  # verify steps seen so far per request
    for st in stats[1:]:
        assert st.num_decoding == len(st.request_ids) == len(st.verified) == len(st.accepted)
        assert st.verify_tokens == st.num_decoding + sum(st.verified) and st.budget == sum(st.verified)
        for rid, ell, acc, a in zip(st.request_ids, st.verified, st.accepted, st.predicted_survival):
            seq, k = seqs[rid], step_of[rid]
            assert (ell, acc) == (seq.verify_lengths[k], seq.accepted_lengths[k])
            # The survivals of the draft this step verified: that request's k-th draft.
            assert a == seq.survivals[k][:ell].tolist() and len(a) == ell
            assert all(1.0 >= x >= y >= 0.0 for x, y in zip(a, a[1:]))
            step_of[rid] += 1
    assert step_of == {rid: len(s.verify_lengths) for rid, s in seqs.items()}
    assert stats[-1].num_running == 0 and stats[-1].num_waiting == 0


def test_last_step_stats_when_the_gate_closes(models):
    """A drafter far dearer than what it saves: after the first draft the gate closes, nothing is verified."""
    engine = _engine(models, "adaptive", _cost(draft_ms=40.0), probe_every=3)
    _, stats = _run(engine, temperature=0.0, max_new_tokens=10)
    assert any(not s.drafted for s in stats[1:]), "the gate never closed"
    for before, st in zip(stats, stats[1:]):
        if before.drafted:  # the gate was open: a budget was planned (it may be 0)
            assert st.budget is not None and st.budget == sum(st.verified)
        else:  # ordinary decoding: no budget, nothing verified, no survivals
            assert st.budget is None and st.verified == [0] * st.num_decoding == st.accepted
            assert st.predicted_survival == [[]] * st.num_decoding and st.verify_tokens == st.num_decoding


def test_last_step_stats_without_a_drafter(models):
    _, stats = _run(_engine(models, "none"), temperature=0.0, max_new_tokens=4)
    for st in stats:
        assert not st.drafted and st.budget is None and st.verified == [0] * st.num_decoding
        assert st.accepted == [0] * st.num_decoding and st.predicted_survival == [[]] * st.num_decoding


def test_fixed_mode_reports_the_verified_survivals(models):
    torch.manual_seed(0)
    _, stats = _run(_engine(models, "fixed", k=3), temperature=0.0, max_new_tokens=8)
    for st in stats[1:]:
        assert st.budget is None and st.verified == [3] * st.num_decoding
        assert [len(a) for a in st.predicted_survival] == [3] * st.num_decoding


def test_release_forgets_finished_requests_only(models):
    engine = _engine(models, "fixed", k=2)
    done = engine.add_request([4, 5], SamplingParams(max_new_tokens=2, ignore_eos=True))
    running = engine.add_request([6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.sequence(done).finished and not engine.sequence(running).finished
    engine.release(done)
    with pytest.raises(KeyError):
        engine.sequence(done)
    with pytest.raises(ValueError, match="still running"):
        engine.release(running)
    assert engine.abort(running)
    engine.release(running)
    assert not engine.has_unfinished()
