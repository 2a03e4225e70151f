"""The engine's vectorised budget equals the reference's stale budget exactly (same integer, ties included)."""

from __future__ import annotations

import torch

from optimized.scheduler import BudgetPlanner
from reference.cost_model import CostTable
from reference.scheduler import stale_budget


def _random_survivals(gen: torch.Generator, r: int, g: int, nan_rows: int = 0) -> torch.Tensor:
    conf = torch.rand(r, g, generator=gen)
    if torch.rand(1, generator=gen).item() < 0.3:  # heavy ties: quantised confidences
        conf = (conf * 4).round() / 4
    a = torch.cumprod(conf, dim=1)
    a[:nan_rows] = float("nan")
    return a


def test_budget_planner_equals_reference_stale_budget():
    gen = torch.Generator().manual_seed(0)
    for i in range(300):
        r, g = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
        sizes = sorted({int(x) for x in torch.randint(1, r * (g + 1) + 8, (6,), generator=gen)} | {r * (g + 1)})
        ms = torch.cumsum(torch.rand(len(sizes), generator=gen) * 3, 0) + 1.0
        cost = CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: 0.5, r: 0.5 + 0.1 * r})
        a = _random_survivals(gen, r, g, nan_rows=i % 3 if r > 2 else 0)
        planner = BudgetPlanner(cost)
        assert planner.budget(a, r) == stale_budget(a, cost, r), i
        assert planner.budget(a, r) == stale_budget(a, cost, r), "cached curve changed the answer"


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
        a = _random_survivals(gen, r, g, nan_rows=i % 3 if r > 2 else 0)
        margin = (0.0, 0.15)[i % 2]
        expected = speculation_pays(a, cost, r, margin=margin)
        assert BudgetPlanner(cost).speculation_pays(a, r, margin=margin) == expected, i
        seen.add(expected)
    assert seen == {True, False}  # both answers were exercised


def test_engine_gate_average_equals_reference_fold():
    """The scheduler's draft gate folds the moving average for all requests at once, per slot; the floats equal
    folding each request's rows one by one as the reference does, also when a slot passes to a new request."""
    from types import SimpleNamespace

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

    for step in range(6):
        if step == 3:
            seqs[1] = SimpleNamespace(slot=2, survivals=[row()])  # slot 2 changes hands
        got = gate.recent_survivals(seqs)
        if all(not s.survivals for s in seqs):
            assert got is None
        else:
            want = torch.stack([expected(s) for s in seqs])
            assert torch.equal(got.isnan(), want.isnan()), step  # NaN rows: requests that never drafted
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), step  # every other float bit for bit
        for s in seqs:
            s.survivals.append(row())
