"""The engine's vectorised budget equals the reference's stale budget exactly (same integer, ties included)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from optimized.scheduler import BudgetPlanner, step_time_curve
from reference.cost_model import CostTable
from reference.scheduler import fill_stale_rows, stale_budget


def _random_survivals(gen: torch.Generator, r: int, g: int, nan_rows: int = 0) -> torch.Tensor:
    conf = torch.rand(r, g, generator=gen)
    if torch.rand(1, generator=gen).item() < 0.3:  # heavy ties: quantised confidences
        conf = (conf * 4).round() / 4
    a = torch.cumprod(conf, dim=1)
    a[:nan_rows] = float("nan")
    return a


def _with_request_curves(gen: torch.Generator, cost: CostTable, r: int, g: int) -> CostTable:
    """Half the time, the table also gets verify curves keyed by request count (around R, so they are read)."""
    if torch.rand(1, generator=gen).item() < 0.5:
        return cost
    curves = {}
    for rr in sorted({max(1, r - 1), r, r + 2}):
        sizes = sorted({rr, rr * (g + 1)} | {int(x) for x in torch.randint(rr, rr * (g + 1) + 1, (3,), generator=gen)})
        ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 2, 0) + 0.5
        curves[rr] = dict(zip(sizes, ms.tolist()))
    return CostTable(cost.verify_ms, cost.draft_ms, cost.graph_max_tokens, cost.hardware, cost.meta, curves)


def test_budget_planner_equals_reference_stale_budget():
    gen = torch.Generator().manual_seed(0)
    for i in range(300):
        r, g = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        sizes = sorted({int(x) for x in torch.randint(1, r * (g + 1) + 8, (6,), generator=gen)} | {r * (g + 1)})
        ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 3, 0) + 1.0
        cost = CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: 0.5, r: 0.5 + 0.1 * r})
        cost = _with_request_curves(gen, cost, r, g)
        a = _random_survivals(gen, r, g, nan_rows=i % 3 if r > 2 else 0)
        planner = BudgetPlanner(cost)
        assert planner.budget(a, r) == stale_budget(a, cost, r), i
        assert planner.budget(a, r) == stale_budget(a, cost, r), "cached curve changed the answer"
        assert planner.budget(a.numpy(), r) == stale_budget(a, cost, r), "NumPy input (the engine's) differs"


@pytest.mark.parametrize("graph_max", [None, "mid"])
def test_step_time_curve_equals_the_tables_lookups(graph_max):
    """The vectorised curve is ``cost.step_time(n, R)`` float for float: the staircase, the request curves (where they
    reach and where they fall back), the eager region past the largest graph, and 0 tokens."""
    gen = torch.Generator().manual_seed(1)
    for i in range(60):
        r, g = int(torch.randint(1, 12, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        sizes = sorted({int(x) for x in torch.randint(1, r * (g + 1) + 16, (8,), generator=gen)})
        ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 3, 0) + 1.0
        gmax = None if graph_max is None or len(sizes) < 3 else sizes[len(sizes) // 2]
        cost = CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: 0.5, 4: 0.7, 9: 1.3},
                         graph_max_tokens=gmax)
        cost = _with_request_curves(gen, cost, r, g)
        for first in (0, r):
            count = r * g + 20  # past the largest measured size too (the eager line, or its extension)
            want = [cost.step_time(n, r) for n in range(first, first + count)]
            got = step_time_curve(cost, first, count, r)
            assert got.dtype == np.float64 and got.tolist() == want, (i, first)


def test_unchecked_fill_of_new_requests_equals_the_references():
    """The engine plans on its own survivals without the range checks (check=False), and fills the rows of requests
    too new to have stale survivals by its own cheaper route: the same budget and gate verdict as the reference,
    float for float, with NaN rows anywhere, all rows NaN, or none."""
    from reference.scheduler import speculation_pays

    gen = torch.Generator().manual_seed(5)
    for i in range(300):
        r, g = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        a = _random_survivals(gen, r, g)
        a[torch.rand(r, generator=gen) < (0.3 if i % 5 else 1.0)] = float("nan")  # every 5th: all rows new
        cost = CostTable.affine(fixed_ms=1.0 + (i % 7), per_token_ms=0.01 * (1 + i % 3), draft_fixed_ms=0.3,
                                sizes=list(range(1, r * (g + 1) + 1)))
        planner = BudgetPlanner(cost)
        arr = a.numpy()
        assert np.array_equal(planner._filled(arr, check=False), fill_stale_rows(a).numpy(), equal_nan=True), i
        assert planner.budget(arr, r, check=False) == stale_budget(a, cost, r), i
        assert planner.speculation_pays(arr, r, check=False) == speculation_pays(a, cost, r), i


def test_budget_zero_when_drafts_do_not_pay():
    cost = CostTable(verify_ms={1: 1.0, 2: 100.0, 16: 200.0}, draft_ms={1: 0.01})
    a = torch.tensor([[0.1, 0.01]])
    assert BudgetPlanner(cost).budget(a, 1) == stale_budget(a, cost, 1) == 0


def test_planner_gate_equals_reference_speculation_pays():
    """The draft gate's NumPy twin gives the reference's boolean (same Θ values, same comparison), both ways."""
    from reference.scheduler import speculation_pays

    gen = torch.Generator().manual_seed(1)
    seen = set()
    for i in range(300):
        r, g = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        sizes = sorted({int(x) for x in torch.randint(1, r * (g + 1) + 8, (6,), generator=gen)} | {r, r * (g + 1)})
        ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 3, 0) + 1.0
        draft = float(torch.rand(1, generator=gen)) * 6
        cost = CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: draft, 8: draft + 0.1})
        cost = _with_request_curves(gen, cost, r, g)
        a = _random_survivals(gen, r, g, nan_rows=i % 3 if r > 2 else 0)
        margin = (0.0, 0.15)[i % 2]
        expected = speculation_pays(a, cost, r, margin=margin)
        assert BudgetPlanner(cost).speculation_pays(a, r, margin=margin) == expected, i
        assert BudgetPlanner(cost).speculation_pays(a.numpy(), r, margin=margin) == expected, i
        seen.add(expected)
    assert seen == {True, False}  # both answers were exercised


def test_engine_gate_average_equals_reference_fold():
    """The scheduler's draft gate folds the moving average for all requests at once, per slot; the floats equal
    folding each request's rows one by one as the reference does, also when a slot passes to a new request."""
    from optimized.scheduler import DraftGate
    from reference.config import SchedulerConfig
    from reference.scheduler import fold_recent

    gate = DraftGate(SchedulerConfig(mode="adaptive", gate_window=4), gamma=4, max_num_seqs=3, planner=None)
    gen = torch.Generator().manual_seed(0)
    row = lambda: torch.cumprod(torch.rand(4, generator=gen), 0)  # noqa: E731
    seqs = [SimpleNamespace(slot=0, survivals=[]), SimpleNamespace(slot=2, survivals=[row()])]

    def expected(s):
        if not s.survivals:
            return torch.full((4,), float("nan"))
        acc = torch.full((4,), float("nan"))
        for a in s.survivals:
            acc = fold_recent(acc, a, 4)
        return acc

    for step in range(8):
        if step == 3:
            seqs[1] = SimpleNamespace(slot=2, survivals=[row()])  # slot 2 changes hands
        if step == 5:  # a draft with NaN: the average is NaN there, and the next draft takes its place (where)
            seqs[0].survivals[-1] = torch.tensor([0.5, float("nan"), float("nan"), float("nan")])
        got = gate.recent_survivals(seqs)  # [R, γ] NumPy float32
        again = gate.recent_survivals(seqs)  # nothing new to fold: the same averages
        assert again is None if got is None else np.array_equal(again, got, equal_nan=True)
        if all(not s.survivals for s in seqs):
            assert got is None
        else:
            got = torch.from_numpy(got)
            want = torch.stack([expected(s) for s in seqs])
            assert torch.equal(got.isnan(), want.isnan()), step  # NaN rows: requests that never drafted
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), step  # every other float bit for bit
        for s in seqs:
            s.survivals.append(row())


def test_planner_checks_and_theta_are_the_same_for_numpy_and_tensors():
    """NumPy input (what the scheduler passes) and tensor input give the same Θ curve bit for bit, through the fill of
    NaN rows too, and fail with the reference's messages (range, NaN, monotone, partly-NaN rows, shape)."""
    cost = CostTable.affine(fixed_ms=2.0, per_token_ms=0.05, draft_fixed_ms=0.5, sizes=list(range(1, 65)))
    planner = BudgetPlanner(cost)
    gen = torch.Generator().manual_seed(2)
    theta = lambda *args: np.array(list(planner._theta(*args))).tobytes()  # noqa: E731 (bit for bit)
    for nan_rows in (0, 1, 3):
        a = _random_survivals(gen, 5, 4, nan_rows=nan_rows)
        assert theta(a, 5, None) == theta(a.numpy(), 5, None)
        assert theta(a.double(), 5, 6) == theta(a.numpy(), 5, 6)
    a = _random_survivals(gen, 5, 4)
    assert planner.budget(a.numpy(), 5, check=False) == planner.budget(a, 5) == stale_budget(a, cost, 5)
    a[1] = float("nan")  # unchecked input still has its NaN rows filled
    assert planner.budget(a.numpy(), 5, check=False) == stale_budget(a, cost, 5)
    good = torch.tensor([[0.9, 0.5], [0.8, 0.8]])
    bad = {"lie in": [[1.5, 0.5], [0.8, 0.8]], "non-increasing": [[0.5, 0.9], [0.8, 0.8]],
           "partly NaN": [[0.9, float("nan")], [0.8, 0.8]]}
    for match, rows in bad.items():
        for a in (torch.tensor(rows), np.array(rows, dtype=np.float32)):
            with pytest.raises(ValueError, match=match):
                planner.budget(a, 2)
            with pytest.raises(ValueError, match=match):
                stale_budget(torch.as_tensor(a), cost, 2)
    with pytest.raises(ValueError, match="non-empty"):
        planner.budget(np.zeros((0, 2), dtype=np.float32), 1)
    assert planner.budget(good.numpy(), 2) == planner.budget(good, 2) == stale_budget(good, cost, 2)


def test_cached_verify_time_equals_the_cost_table():
    cost = CostTable(verify_ms={1: 1.0, 4: 2.0, 16: 3.5, 64: 9.0, 128: 15.0}, draft_ms={1: 0.5}, graph_max_tokens=16,
                     verify_ms_by_requests={1: {1: 0.9, 8: 1.1}, 4: {4: 1.8, 32: 2.5}})
    planner = BudgetPlanner(cost)
    for n in (*range(0, 40), 64, 100, 200, 1, 3, 64):  # graph, eager and extrapolated; again: cached
        for r in (1, 2, 4, 5):  # a request curve, the next one up, none (5 > 4: the token curve)
            assert planner.verify_time(n, r) == cost.verify_time(n, r), (n, r)


def test_draft_gate_decides_as_the_reference_should_draft():
    """The gate's verdict over a run (drafts appended between decisions, slots changing hands, the gate closing and
    probing) equals the reference's ``Scheduler.should_draft`` on the reference's moving averages, which a draft
    after plain steps restarts (``reference.generate.step``)."""
    from optimized.scheduler import DraftGate
    from reference.config import SchedulerConfig
    from reference.scheduler import Scheduler as Policy

    g, window = 3, 2
    gen = torch.Generator().manual_seed(3)
    row = lambda: torch.cumprod(torch.rand(g, generator=gen), 0).numpy()  # noqa: E731 (the engine keeps NumPy rows)
    seen, restarts = set(), 0
    for draft_ms in (0.0, 3.0, 6.0, 30.0):
        cfg = SchedulerConfig(mode="adaptive", gate_window=window, probe_every=3, gate_margin=0.1)
        cost = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=draft_ms, sizes=list(range(1, 64)))
        gate = DraftGate(cfg, gamma=g, max_num_seqs=3, planner=BudgetPlanner(cost))
        policy = Policy(cfg, gamma=g, cost=cost)
        seqs = [SimpleNamespace(request_id=i, slot=i, survivals=[], since=0) for i in range(3)]
        for step in range(30):
            if step % 7 == 6:  # a request finishes; a new one takes its slot
                seqs[step % 3] = SimpleNamespace(request_id=100 + step, slot=step % 3, survivals=[], since=0)
            # the reference's average: the drafts since the last restart (the draft after a run of plain steps)
            recent = [_fold_all(s.survivals[s.since:], window) if s.survivals[s.since:] else None for s in seqs]
            latest = None if all(x is None for x in recent) else torch.stack(
                [torch.full((g,), float("nan")) if x is None else x for x in recent])
            expected = policy.should_draft(latest, policy.steps_without_draft, num_anchor_tokens=len(seqs))
            if expected and policy.steps_without_draft:
                restarts += 1
                for s in seqs:
                    s.since = len(s.survivals)
            policy.steps_without_draft = 0 if expected else policy.steps_without_draft + 1
            assert gate.decide(seqs) == expected, (draft_ms, step)
            assert gate.steps_without_draft == policy.steps_without_draft
            seen.add(expected)
            if expected:
                for s in seqs:
                    s.survivals.append(row())
                gate.recorded += 1  # as Scheduler.record_drafts counts a block of drafts
    assert seen == {True, False} and restarts > 2


def _fold_all(rows: list[np.ndarray], window: int) -> torch.Tensor:
    """The reference's moving average of a request's drafts, folded one by one."""
    from reference.scheduler import fold_recent

    acc = torch.full((len(rows[0]),), float("nan"))
    for a in rows:
        acc = fold_recent(acc, torch.from_numpy(a), window)
    return acc


def test_python_and_numpy_theta_agree_bit_for_bit():
    """Θ on Python floats (few candidates) and in NumPy (many) are the same floats, so the same budget and verdict;
    each path is forced on the same inputs and checked against the reference."""
    from reference.scheduler import speculation_pays

    gen = torch.Generator().manual_seed(4)
    python, numpy_ = BudgetPlanner(None), BudgetPlanner(None)
    python.PYTHON_MAX_CANDIDATES, numpy_.PYTHON_MAX_CANDIDATES = 10**9, 0
    for i in range(200):
        r, g = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        sizes = sorted({int(x) for x in torch.randint(1, r * (g + 1) + 8, (8,), generator=gen)} | {r, r * (g + 1)})
        ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 3, 0) + 1.0
        cost = CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: 0.5, 8: 0.5 + i % 5})
        cost = _with_request_curves(gen, cost, r, g)
        python.cost, numpy_.cost = cost, cost
        python._curves.clear(), numpy_._curves.clear(), python._verify_times.clear(), numpy_._verify_times.clear()
        a = _random_survivals(gen, r, g, nan_rows=i % 3 if r > 2 else 0).numpy()
        t0, n_s = r + i % 3, None if i % 2 else r + 1
        py, np_ = python._theta(a, t0, n_s), numpy_._theta(a, t0, n_s)
        assert not isinstance(py, np.ndarray) and isinstance(np_, np.ndarray)
        assert np.array_equal(np.array(list(py)), np_), i
        assert python.budget(a, t0, n_s) == numpy_.budget(a, t0, n_s) == stale_budget(torch.from_numpy(a), cost, t0,
                                                                                       n_s), i
        for margin in (0.0, 0.1, -0.5, -2.0):  # the Python path stops at the first budget that pays when 1 + margin > 0
            pays = speculation_pays(torch.from_numpy(a), cost, t0, n_s, margin=margin)
            assert python.speculation_pays(a, t0, n_s, margin) == numpy_.speculation_pays(a, t0, n_s, margin) == pays


def test_planner_curves_are_the_step_time_curve():
    """The planner slices its step times out of one verify curve per request curve of the table (a steady server's
    batch size changes nearly every step): float for float :func:`step_time_curve` at every (T_0, R), the eager
    region past the largest graph included, as the cached curve grows and when the table changes."""
    gen = torch.Generator().manual_seed(7)
    planner = BudgetPlanner(None)
    for i in range(80):
        if i % 20 == 0:  # a new table: the planner's caches must not survive it
            sizes = sorted({int(x) for x in torch.randint(1, 120, (10,), generator=gen)})
            ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 3, 0) + 1.0
            cost = CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: 0.5, 4: 0.7, 9: 1.3},
                             graph_max_tokens=sizes[len(sizes) // 2] if i % 40 else None)
            cost = _with_request_curves(gen, cost, 6, 7)
            planner.cost = cost
        r, g = int(torch.randint(1, 12, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        t0 = r + int(torch.randint(0, 3, (1,), generator=gen))
        step, step_list = planner._step_times(t0, r, r * g)
        want = step_time_curve(cost, t0, r * g + 1, r)
        want = np.where(want > 0, np.maximum(want, 1e-300), np.inf)
        assert np.array_equal(step, want), i
        assert step_list is None or step_list == want.tolist()


def test_planner_prices_no_step_past_the_tables_graphs():
    """A table profiled only up to its largest graph (no eager sizes above it) prices every step the engine can take;
    the planner's cached verify curve must not reach past what a step asks for (growing batches: R = 1..5 at γ = 7,
    the largest step exactly the largest graph)."""
    sizes = list(range(1, 41))
    cost = CostTable(verify_ms={n: 1.0 + 0.01 * n for n in sizes}, draft_ms={1: 0.5, 5: 0.7}, graph_max_tokens=40)
    planner = BudgetPlanner(cost)
    gen = torch.Generator().manual_seed(8)
    for r in range(1, 6):
        a = _random_survivals(gen, r, 7).numpy()
        assert planner.budget(a, r, check=False) == stale_budget(torch.from_numpy(a), cost, r)
