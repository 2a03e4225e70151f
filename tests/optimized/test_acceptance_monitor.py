"""The acceptance monitor (optimized/acceptance_monitor.py): verified drafts' outcomes against their forecast
survivals, the per-slot factors it sets, and what the planner and the engine do with them."""

from __future__ import annotations

import numpy as np
import pytest

from optimized.acceptance_monitor import AcceptanceMonitor
from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.scheduler import BudgetPlanner
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.scheduler import stale_budget
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model


def test_a_step_adds_each_verified_slot_as_one_trial():
    """Slot k of a request that verified ℓ ≥ k drafts is a trial: its forecast a_k, survived if ≥ k were accepted;
    requests that verified nothing add nothing; the sums decay by 1 - 1/window a step."""
    m = AcceptanceMonitor(3, window=4)
    m.add([np.array([0.9, 0.5, 0.2]), np.array([0.8, 0.6, 0.4]), None, np.array([0.7, 0.1, 0.0])],
          verified=[2, 3, 0, 1], accepted=[1, 3, 0, 0])
    assert m.forecast == pytest.approx([0.9 + 0.8 + 0.7, 0.5 + 0.6, 0.4])
    assert m.survived.tolist() == [2, 1, 1] and m.trials.tolist() == [3, 2, 1]
    m.add([], [], [])  # a step that verified no draft: only the decay
    assert m.trials.tolist() == [2.25, 1.5, 0.75] and m.forecast == pytest.approx(np.array([2.4, 1.1, 0.4]) * 0.75)


def test_factors_need_enough_trials_and_change_only_past_the_tolerance():
    m = AcceptanceMonitor(2, window=10**9, min_trials=10, tolerance=0.05)
    for _ in range(9):  # 9 trials of slot 1 only: not enough
        m.add([np.array([0.8, 0.5])], [1], [1])
    assert m.measured() is None and m.update() is None
    for _ in range(11):  # slot 1: 20 trials, forecast 0.8 each, 15 survived; slot 2: 11 trials, none survived
        m.add([np.array([0.8, 0.5])], [2], [0 if _ < 5 else 1])
    assert m.trials == pytest.approx([20, 11])
    slot1 = 15 / (20 * 0.8)  # 0.9375 (the decay of a 10⁹-step window: within 1e-7)
    assert m.measured() == pytest.approx([slot1, 0.5])  # slot 2: 0 / 5.5, clipped to the low bound
    assert m.update() == pytest.approx([slot1, 0.5]) and m.factors == pytest.approx([slot1, 0.5])
    m.add([np.array([0.8, 0.5])], [1], [1])  # 16/20.8: within 5 % of the factor in force
    assert m.update() is None
    fresh = AcceptanceMonitor(3, window=10**9, min_trials=2)
    for _ in range(3):
        fresh.add([np.array([0.5, 0.4, 0.3])], [1], [1])  # only slot 1 has trials: the later slots take its factor
    assert fresh.measured() == pytest.approx([1.5, 1.5, 1.5])  # 3 / 1.5, clipped to the high bound


def test_bad_settings_fail_fast():
    with pytest.raises(ValueError, match="window"):
        AcceptanceMonitor(3, window=0)
    with pytest.raises(ValueError, match="low"):
        AcceptanceMonitor(3, low=1.2)


def test_the_planner_plans_with_the_scaled_survivals():
    """None: the reference's budget and verdict exactly. Factors below 1 lower every slot's survival (capped at 1 and
    non-increasing after the product), so the gate closes where it opened and the budget shrinks; the verdict it
    gives is the one on the scaled survivals themselves."""
    table = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=4.0, sizes=list(range(1, 129)))
    planner = BudgetPlanner(table)
    a = np.tile(np.array([0.9, 0.8, 0.7, 0.6], dtype=np.float32), (4, 1))  # [R, γ]
    import torch

    assert planner.budget(a, 4, 4) == stale_budget(torch.from_numpy(a), table, 4, 4)
    assert planner.speculation_pays(a, 4, 4)
    planner.survival_scale = np.array([0.4, 0.4, 0.4, 0.4])
    scaled = np.minimum(np.minimum.accumulate(a * 0.4, axis=1), 1.0).astype(np.float32)
    assert not planner.speculation_pays(a, 4, 4)
    assert planner.budget(a, 4, 4) == BudgetPlanner(table).budget(scaled, 4, 4)
    planner.survival_scale = np.array([1.5, 1.0, 1.5, 1.0])  # above 1: capped, and a slot never above the one before
    want = np.minimum(np.minimum.accumulate(a * np.array([1.5, 1.0, 1.5, 1.0]), axis=1), 1.0).astype(np.float32)
    assert want[0].tolist() == pytest.approx([1.0, 0.8, 0.8, 0.6])
    assert planner.budget(a, 4, 4) == BudgetPlanner(table).budget(want, 4, 4)


@pytest.mark.parametrize("async_decode", [False, True])
def test_engine_feedback_sets_the_factors_and_keeps_greedy_tokens(async_decode):
    """With ``acceptance_feedback`` the engine feeds every verified step to the monitor and installs its factors in
    the planner; greedy tokens equal those of the engine without it (verification is lossless whatever ℓ)."""
    target = Target.from_model(tiny_hf_model("llama"))
    drafter = tiny_drafter(target, gamma=3, seed=0, noise=0.2)
    table = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=0.5, sizes=list(range(1, 129)))
    out = {}
    for feedback in (False, True):
        engine = Engine(target, drafter, EngineConfig(max_num_seqs=2, max_seq_len=128, kernel_backend="torch",
                                                      acceptance_feedback=feedback, async_decode=async_decode),
                        SchedulerConfig(mode="adaptive"), table)
        if feedback:
            engine._acceptance = AcceptanceMonitor(engine.gamma, window=10**6, min_trials=5)  # decide early
        for rid in range(2):
            engine.add_request([5, 6, 7 + rid], SamplingParams(max_new_tokens=40, ignore_eos=True), request_id=rid)
        while engine.has_unfinished():
            engine.step()
        out[feedback] = [engine.sequence(r).output_ids for r in range(2)]
        if feedback:
            monitor = engine._acceptance
            assert monitor.trials[0] > 5 and monitor.factors is not None
            assert engine.survival_scale == pytest.approx(monitor.factors.tolist())
        else:
            assert engine._acceptance is None and engine.survival_scale is None
    assert out[True] == out[False]


def test_the_finish_estimate_scales_the_survivals_once():
    """With acceptance feedback the finish-time estimate runs on the scaled survivals, at the budget the planner plans
    from them (scaled once, as for the budget itself): the reference's estimate on those inputs."""
    import torch

    from reference.scheduler import finish_estimate

    table = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=2.0, sizes=list(range(1, 129)))
    planner = BudgetPlanner(table)
    planner.survival_scale = np.array([0.8, 0.7, 0.6, 0.5])
    a = np.tile(np.array([0.9, 0.8, 0.7, 0.6], dtype=np.float32), (3, 1))  # [R, γ]
    scaled = np.minimum(np.minimum.accumulate(a * planner.survival_scale, axis=1), 1.0).astype(np.float32)
    want = finish_estimate(torch.from_numpy(scaled), torch.tensor([20.0, 30.0, 40.0]), table, planner.budget(a, 3, 3))
    got = planner.finish_estimate(a, [20, 30, 40])
    assert got.speculative_steps == pytest.approx(want.speculative_steps, rel=1e-9)
    assert got.speculative_s == pytest.approx(want.speculative_s, rel=1e-9)
    assert got.plain_s == pytest.approx(want.plain_s)
