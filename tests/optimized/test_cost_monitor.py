"""The cost monitor (optimized/cost_monitor.py): measured step times against the table, and the prices it sets.

The monitor's clock on the CPU is ``time.perf_counter``; these tests replace it by a counter they advance, so every
measured step time is exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

import optimized.cost_monitor as cm
from optimized.cost_monitor import CostMonitor, request_bucket
from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.scheduler import BudgetPlanner, Scheduler
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(cm.time, "perf_counter", c)
    return c


def _table() -> CostTable:
    # plain step of R requests: 1 + 0.01 R ms; speculative adds 0.01 ms a draft token and 0.5 ms of drafter
    return CostTable.affine(fixed_ms=1.0, per_token_ms=0.01, draft_fixed_ms=0.5, sizes=list(range(1, 257)))


def _steps(monitor: CostMonitor, clock: Clock, n: int, seconds: float, requests: int = 4, tokens: int = 4,
           drafted: int = 0, prefill: bool = False) -> None:
    for _ in range(n):
        monitor.launch(requests, tokens, prefill)
        if drafted:
            monitor.drafted(drafted)
        clock.now += seconds


def test_ratio_per_kind_and_the_rescale(clock):
    table = _table()
    monitor = CostMonitor(table, "cpu", window=8, min_samples=4, tolerance=0.1)
    plain = table.verify_time(4, 4)
    spec = table.verify_time(20, 4) + table.draft_time(4)
    # three plain steps at twice the price: two complete, of which the first has no step before it (not a sample)
    _steps(monitor, clock, 3, 2.0 * plain)
    assert monitor.update() is None and monitor.drift == {"plain": None, "speculative": None}
    _steps(monitor, clock, 3, 2.0 * plain)
    scales = monitor.update()  # four samples ≥ min_samples: the ratio 2 is 100 % off the scale 1
    assert scales == {4: {"plain": pytest.approx(2.0)}}  # 4 requests: the bucket of 4-7
    assert monitor.scales_at(5) == {"plain": pytest.approx(2.0), "speculative": 1.0}
    assert monitor.drift["plain"] == pytest.approx(1.0)
    _steps(monitor, clock, 6, 0.5 * spec, tokens=20, drafted=4)  # speculative steps at half their price
    scales = monitor.update()
    # the switch is no sample: neither the last plain step (a speculative one follows) nor the first speculative one
    assert monitor.samples == {"plain": 4, "speculative": 4}
    assert scales[4]["speculative"] == pytest.approx(0.5)
    assert monitor.update() is None, "nothing new: no rescale"


def test_each_batch_size_is_priced_on_its_own_steps(clock):
    """Steps of 4 requests at twice their price rescale the bucket of 4-7 only: a batch of 64 is still priced at
    the table's until its own steps say otherwise (at 0.9 of the price: inside the tolerance, no rescale)."""
    table = _table()
    monitor = CostMonitor(table, "cpu", window=8, min_samples=4, tolerance=0.1)
    _steps(monitor, clock, 6, 2.0 * table.verify_time(4, 4))
    _steps(monitor, clock, 6, 0.9 * table.verify_time(64, 64), requests=64, tokens=64)
    scales = monitor.update()
    assert set(scales) == {4} and monitor.scales_at(64) == {"plain": 1.0, "speculative": 1.0}
    assert monitor.scales_at(7)["plain"] == pytest.approx(2.0) and monitor.scales_at(8)["plain"] == 1.0
    assert [request_bucket(n) for n in (1, 2, 3, 4, 7, 8, 255, 256, 300)] == [1, 2, 2, 4, 4, 8, 128, 256, 256]


def test_hysteresis_and_the_moving_average(clock):
    table = _table()
    monitor = CostMonitor(table, "cpu", window=4, min_samples=2, tolerance=0.1)
    plain = table.verify_time(4, 4)
    _steps(monitor, clock, 4, 1.05 * plain)  # 5 % off: inside the tolerance, the table's prices stay
    assert monitor.update() is None and monitor.scales_at(4)["plain"] == 1.0
    assert monitor.drift["plain"] == pytest.approx(0.05)
    _steps(monitor, clock, 12, 3.0 * plain)  # a shared GPU: the window forgets the old steps
    scales = monitor.update()
    assert scales is not None and math.isclose(scales[4]["plain"], 3.0, rel_tol=0.05)


def test_prefill_and_idle_are_not_sampled(clock):
    table = _table()
    monitor = CostMonitor(table, "cpu", window=8, min_samples=1, tolerance=0.1)
    plain = table.verify_time(4, 4)
    monitor.launch(4, 4, prefill=False)
    clock.now += 10 * plain  # the step and then a prompt's forward before the next launch
    monitor.launch(4, 4, prefill=True)
    clock.now += plain
    monitor.update()
    assert monitor.samples["plain"] == 0, "a step followed by a prefill is not a sample"
    monitor.idle()
    clock.now += 100.0  # nothing to do for a while
    _steps(monitor, clock, 3, plain)  # the first after idle has no step before it: the second is the sample
    monitor.update()
    assert monitor.samples["plain"] == 1 and monitor.drift["plain"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("steady_only", [True, False])
def test_switches_between_kinds_set_no_price(clock, steady_only):
    """An engine that alternates short runs of plain and speculative steps, the plain steps next to a switch costing
    3x their price: with ``steady_only`` (the default) only the steps inside a run of one kind are priced, so plain
    steps keep the table's price; with every step sampled, the switches make them look 3x dearer than they are."""
    table = _table()
    monitor = CostMonitor(table, "cpu", window=32, min_samples=4, tolerance=0.1, steady_only=steady_only)
    plain = table.verify_time(4, 4)
    spec = table.verify_time(20, 4) + table.draft_time(4)
    for _ in range(6):
        _steps(monitor, clock, 1, 3 * plain)  # the first plain step after a switch
        _steps(monitor, clock, 1, plain)
        _steps(monitor, clock, 1, 3 * plain)  # the last plain step before the switch
        _steps(monitor, clock, 4, spec, tokens=20, drafted=4)
    monitor.update()
    if steady_only:
        assert monitor.scales_at(4) == {"plain": 1.0, "speculative": 1.0}
        assert monitor.drift["plain"] == pytest.approx(0.0, abs=1e-9)
    else:
        assert monitor.scales_at(4)["plain"] == pytest.approx(3.0, rel=1e-6)  # the median of 3, 1, 3, 3, 1, 3, ...


def test_a_few_slow_steps_do_not_move_a_price(clock):
    """Steps that waited for the host (a collection, a burst of requests) are outliers: the price multiplier is the
    median of the window, so a few of them leave it, while a lasting change moves it."""
    table = _table()
    monitor = CostMonitor(table, "cpu", window=16, min_samples=4, tolerance=0.1)
    plain = table.verify_time(4, 4)
    for i in range(17):
        _steps(monitor, clock, 1, (20.0 if i % 4 == 3 else 1.0) * plain)  # every fourth step 20x its price
    assert monitor.update() is None and monitor.scales_at(4)["plain"] == 1.0
    _steps(monitor, clock, 12, 2.0 * plain)  # now most of the window: the price follows
    assert monitor.update()[4]["plain"] == pytest.approx(2.0)


def test_the_trace_names_each_sample_and_its_neighbours(clock):
    """With a trace list, every sample taken is kept with the kinds of the steps launched before and after it, so a
    benchmark can tell a run of one kind from the switches between kinds."""
    table = _table()
    monitor = CostMonitor(table, "cpu", window=8, min_samples=1, tolerance=0.1)
    monitor.trace = []
    plain = table.verify_time(4, 4)
    _steps(monitor, clock, 2, plain)  # plain, plain
    _steps(monitor, clock, 2, 3 * plain, tokens=20, drafted=4)  # speculative, speculative
    _steps(monitor, clock, 1, 2 * plain)  # plain again (its own end is not launched yet: no sample)
    monitor.update()
    got = [(s.kind, s.before, s.after, round(s.measured_s / plain, 6)) for s in monitor.trace]
    assert got == [("plain", None, "plain", 1.0), ("plain", "plain", "speculative", 1.0),
                   ("speculative", "plain", "speculative", 3.0), ("speculative", "speculative", "plain", 3.0)]
    assert all(s.bucket == 4 and not s.prefill for s in monitor.trace)
    assert monitor.trace[2].price_s == pytest.approx(table.verify_time(20, 4) + table.draft_time(4))
    monitor.idle()  # after idle the next step has no neighbour before it
    _steps(monitor, clock, 2, plain)
    monitor.update()
    assert monitor.trace[-1].before is None


def test_bad_settings_fail_fast():
    with pytest.raises(ValueError, match="window"):
        CostMonitor(_table(), "cpu", window=0)


def test_price_scales_move_the_gate_not_the_budget():
    """The gate weighs Θ_plain / s_plain against Θ(B) / s_spec; the budget is the same argmax whatever the scales."""
    table = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=2.0, sizes=list(range(1, 129)))
    planner = BudgetPlanner(table)
    a = np.tile(np.array([0.9, 0.8, 0.7, 0.6], dtype=np.float32), (4, 1))  # [R, γ]
    budget = planner.budget(a, 4, 4)
    assert planner.speculation_pays(a, 4, 4)
    planner.speculative_scale = 3.0  # speculative steps measured at three times their price
    assert not planner.speculation_pays(a, 4, 4)
    assert planner.budget(a, 4, 4) == budget
    planner.plain_scale = 3.0  # and plain ones too: back to the table's verdict
    assert planner.speculation_pays(a, 4, 4)
    # per batch size, as the engine sets them: the bucket of 4-7 requests has its own, other sizes the defaults
    sched = Scheduler(SchedulerConfig(mode="adaptive"), gamma=4, max_num_seqs=8, max_seq_len=64, prefill_chunk=8,
                      cost=table)
    sched.set_price_scales({4: {"speculative": 3.0}})
    assert not sched.planner.speculation_pays(a, 4, 4) and sched.planner.speculation_pays(a[:2], 2, 2)
    assert sched.planner.scales(6) == (1.0, 3.0) and sched.planner.scales(8) == (1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        sched.set_price_scales({4: {"plain": 0.0}})


def test_engine_feedback_rescales_and_reports_drift():
    """With ``cost_feedback`` on, a table far from this machine's times is rescaled after a few steps; off (the CPU
    default), the engine keeps the table's prices and reports no drift."""
    target = Target.from_model(tiny_hf_model("llama"))
    drafter = tiny_drafter(target, gamma=3, seed=0, noise=0.2)
    table = CostTable.affine(fixed_ms=1e-4, per_token_ms=1e-6, draft_fixed_ms=1e-4, sizes=list(range(1, 129)))
    for feedback in (False, True):
        engine = Engine(target, drafter, EngineConfig(max_num_seqs=2, max_seq_len=128, kernel_backend="torch",
                                                      cost_feedback=feedback), SchedulerConfig(mode="adaptive"), table)
        for rid in range(2):
            engine.add_request([5, 6, 7 + rid], SamplingParams(max_new_tokens=40, ignore_eos=True), request_id=rid)
        while engine.has_unfinished():
            engine.step()
        if feedback:
            drift = engine.cost_drift
            assert drift["speculative"] is not None and drift["speculative"] > 10, "CPU steps cost far more"
            assert engine.price_scales["speculative"] > 10
            assert any(kinds.get("speculative", 1.0) > 10 for kinds in engine.price_scales_by_batch.values())
        else:
            assert engine.cost_drift is None and engine.price_scales == {"plain": 1.0, "speculative": 1.0}
            assert engine.price_scales_by_batch == {}
