"""The engine's finish-time estimate (``optimized.scheduler.finish_estimate_host``, through ``BudgetPlanner``) against
its reference twin ``reference.scheduler.finish_estimate``: the same estimate to rounding on random batches, with
ties among the survivals, NaN rows, repeated remaining lengths, measured price multipliers and every budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimized.scheduler import BudgetPlanner, _Prices, finish_estimate_host
from reference.cost_model import CostTable
from reference.scheduler import fill_stale_rows, finish_estimate, prefix_survival

TABLE = CostTable.affine(fixed_ms=1.0, per_token_ms=0.01, draft_fixed_ms=0.3, draft_per_request_ms=0.004,
                         sizes=list(range(1, 2049)), request_counts=range(1, 257))


def random_survivals(rng: np.random.Generator, r: int, gamma: int, ties: bool = False) -> np.ndarray:
    """``[R, γ]`` float32 prefix survivals; with ``ties``, drawn from a few values so that candidates tie."""
    if ties:
        p = rng.choice([0.25, 0.5, 0.75, 1.0], size=(r, gamma))
    else:
        p = rng.uniform(0.05, 0.99, size=(r, gamma))
    return prefix_survival(torch.from_numpy(p)).to(torch.float32).numpy()


def assert_same(got, want) -> None:
    assert got.plain_steps == want.plain_steps
    assert got.plain_s == pytest.approx(want.plain_s, rel=1e-12)
    assert got.speculative_steps == pytest.approx(want.speculative_steps, rel=1e-12)
    assert got.speculative_s == pytest.approx(want.speculative_s, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("r", [1, 2, 7, 64, 256])
def test_the_host_estimate_is_the_reference_estimate(seed, r):
    rng = np.random.default_rng(1000 * r + seed)
    gamma = int(rng.integers(1, 8))
    a = random_survivals(rng, r, gamma, ties=seed % 2 == 1)
    if seed % 3 == 0:  # a few distinct lengths (a closed batch) or every one its own
        remaining = rng.choice([1, 17, 64, 128], size=r)
    else:
        remaining = rng.integers(1, 300, size=r)
    for budget in sorted({0, 1, int(rng.integers(0, r * gamma + 1)), r * gamma}):
        want = finish_estimate(torch.from_numpy(a), torch.from_numpy(remaining), TABLE, budget)
        assert_same(finish_estimate_host(a, remaining.tolist(), TABLE, budget), want)


def test_the_planner_estimate_fills_rows_and_prices_as_the_reference():
    """Through the planner: NaN rows filled as the reference fills them, and measured price multipliers per batch
    size (a drafting step of few requests left is priced in another bucket than the full batch's)."""
    rng = np.random.default_rng(7)
    a = random_survivals(rng, 40, 5)
    a[[3, 17]] = np.nan
    remaining = rng.integers(20, 140, size=40).tolist()
    planner = BudgetPlanner(TABLE)
    planner.price_scales = {64: (1.1, 0.9), 8: (1.0, 1.3)}
    budget = planner.budget(a, 40, 40)
    filled = fill_stale_rows(torch.from_numpy(a))
    want = finish_estimate(filled, torch.tensor(remaining), _Prices(planner), budget)
    assert_same(planner.finish_estimate(a, remaining), want)


def test_the_host_estimate_rejects_bad_remaining_counts():
    a = np.full((3, 4), 0.5, dtype=np.float32)
    with pytest.raises(ValueError, match="remaining"):
        finish_estimate_host(a, [4, 0, 2], TABLE, 3)
    with pytest.raises(ValueError, match="remaining"):
        finish_estimate_host(a, [4, 2], TABLE, 3)
