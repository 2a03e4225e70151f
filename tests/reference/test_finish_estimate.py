"""Tests of the finish-time estimate (reference/scheduler.py ``finish_estimate``, ``finish_pays``): its exact limits,
its agreement with a simulation of the batch it models, and its verdicts where a closed batch's slowest request
decides."""

from __future__ import annotations

import random

import pytest
import torch

from reference.cost_model import CostTable
from reference.scheduler import (
    allocate_top_b,
    best_budget,
    calibrate_rows,
    finish_estimate,
    finish_pays,
    finish_survivals,
    outcome_factors,
    outcome_row,
    prefix_survival,
)

TABLE = CostTable.affine(fixed_ms=1.0, per_token_ms=0.01, draft_fixed_ms=0.3, draft_per_request_ms=0.004,
                         sizes=list(range(1, 2049)), request_counts=range(1, 257))


def survivals(rows: list[float], gamma: int = 4) -> torch.Tensor:
    """``[R, γ]`` prefix survivals of per-slot acceptance ``p`` per request: ``a_j = p^j``."""
    return prefix_survival(torch.tensor([[p] * gamma for p in rows], dtype=torch.float64))


def simulate(a: torch.Tensor, remaining: list[int], table: CostTable, budget: int, runs: int, seed: int) -> float:
    """The mean time to finish the batch, drafting at ``budget`` every step: per request, its accepted drafts drawn
    slot by slot from the survivals (``P(A ≥ j) = a_j``), each step priced at the requests still running."""
    rng = random.Random(seed)
    lens = allocate_top_b(a, budget).tolist()
    rows = a.tolist()
    per = budget / a.shape[0]
    total = 0.0
    for _ in range(runs):
        left = [float(n) for n in remaining]
        while any(x > 0 for x in left):
            live = [r for r, x in enumerate(left) if x > 0]
            k = len(live)
            total += table.step_time(k + round(k * per), k)
            for r in live:
                accepted, before = 0, 1.0
                for j in range(lens[r]):
                    if rng.random() >= rows[r][j] / before:
                        break
                    accepted, before = accepted + 1, rows[r][j]
                left[r] -= 1 + accepted
    return total / runs


def test_plain_time_is_the_staircase_of_the_remaining_lengths():
    """Plain decoding takes exactly each request's remaining tokens in steps, each priced at the requests left."""
    a = survivals([0.5, 0.5, 0.5])
    est = finish_estimate(a, torch.tensor([10, 4, 4]), TABLE)
    want = 4 * TABLE.verify_time(3, 3) + 6 * TABLE.verify_time(1, 1)
    assert est.plain_s == pytest.approx(want, rel=1e-12)
    assert est.plain_steps == 10


def test_certain_drafts_finish_in_a_known_number_of_steps():
    """Survivals of 1 accept every verified draft: no spread, and the drafting batch finishes in n / (1 + ℓ) steps,
    each priced at the full batch."""
    a = torch.ones(2, 4, dtype=torch.float64)
    est = finish_estimate(a, torch.tensor([20, 20]), TABLE, budget=8)
    assert est.speculative_steps == pytest.approx(4.0, abs=1e-6)  # 20 tokens at 5 a step
    assert est.speculative_s == pytest.approx(4 * TABLE.step_time(2 + 8, 2), rel=1e-6)


def test_useless_drafts_never_pay():
    """Survivals of 0: drafting emits what plain decoding does, at a dearer step."""
    a = torch.zeros(4, 4, dtype=torch.float64)
    est = finish_estimate(a, torch.tensor([16] * 4), TABLE, budget=4)
    assert est.speculative_steps == pytest.approx(16.0, abs=1e-6)
    assert est.speculative_s > est.plain_s and not finish_pays(est)


@pytest.mark.parametrize("num_requests", [1, 8, 64])
def test_the_estimate_matches_a_simulation_of_its_model(num_requests):
    """Heterogeneous requests (per-slot acceptance 0.45-0.9): the estimated time to finish is within 3 % of the
    simulated mean, at every batch size (the slowest request's tail included)."""
    rng = random.Random(num_requests)
    a = survivals([rng.uniform(0.45, 0.9) for _ in range(num_requests)])
    remaining = [rng.choice([48, 64]) for _ in range(num_requests)]
    budget = best_budget(a, TABLE, num_requests)
    est = finish_estimate(a, torch.tensor(remaining), TABLE, budget)
    sim = simulate(a, remaining, TABLE, budget, runs=400 if num_requests < 64 else 40, seed=0)
    assert est.speculative_s == pytest.approx(sim, rel=0.03)


def test_a_large_batch_finishes_sooner_plainly_where_one_step_says_draft():
    """A memory-bound table whose drafting step outearns a plain one at 256 requests (Θ), while the laggards'
    tail makes plain decoding finish the closed batch first; at 4 requests drafting finishes first."""
    table = CostTable.affine(fixed_ms=1.0, per_token_ms=0.001, draft_fixed_ms=0.3, draft_per_request_ms=0.002,
                             sizes=list(range(1, 2049)), request_counts=range(1, 257))
    rng = random.Random(0)
    big = survivals([rng.uniform(0.3, 0.9) for _ in range(256)])
    budget = best_budget(big, table, 256)
    tau = 256 + float((big * (torch.arange(4) < allocate_top_b(big, budget)[:, None])).sum())
    assert tau / table.step_time(256 + budget, 256) > 256 / table.verify_time(256, 256)  # the step's Θ says draft
    assert not finish_pays(finish_estimate(big, torch.full((256,), 128), table, budget))
    small = big[:4]
    assert finish_pays(finish_estimate(small, torch.full((4,), 128), table))


def test_bad_remaining_counts_fail_fast():
    a = survivals([0.5, 0.5])
    with pytest.raises(ValueError, match="remaining"):
        finish_estimate(a, torch.tensor([3]), TABLE)
    with pytest.raises(ValueError, match="remaining"):
        finish_estimate(a, torch.tensor([3, 0]), TABLE)


def test_finish_survivals_pool_as_much_spread_as_the_noise_explains():
    """James–Stein per slot: no noise keeps every request's mean, noise as large as the spread pools every row into
    the batch's mean, and in between each row moves towards it by 1 − noise / spread; a single request, or requests
    with one draft each (no noise known), keep their means; rows stay non-increasing and in [0, 1]."""
    mean = torch.tensor([[0.9, 0.6], [0.5, 0.4], [0.1, 0.05]], dtype=torch.float64)
    count = torch.tensor([4, 4, 4])
    centre, spread = mean.mean(0), mean.var(0)
    assert torch.allclose(finish_survivals(mean, torch.zeros_like(mean), count).double(), mean, atol=1e-7)
    loud = torch.full_like(mean, 1.0)  # per-draft variance 1: noise 0.25 ≥ the spread of either slot
    assert torch.allclose(finish_survivals(mean, loud, count).double(), centre.expand(3, 2), atol=1e-7)
    var = torch.tensor([[0.04, 0.02], [0.08, 0.02], [0.0, 0.02]], dtype=torch.float64)
    w = 1 - (var / 4).mean(0) / spread  # per slot
    want = torch.cummin((centre + w * (mean - centre)).clamp(0, 1), dim=1).values
    assert torch.allclose(finish_survivals(mean, var, count).double(), want, atol=1e-7)
    assert torch.allclose(finish_survivals(mean, var, torch.tensor([1, 1, 1])).double(), mean, atol=1e-7)
    assert torch.equal(finish_survivals(mean[:1], var[:1], count[:1]), mean[:1].float())
    rising = torch.tensor([[0.2, 0.9], [0.3, 0.1]], dtype=torch.float64)  # pooled rows are made non-increasing
    out = finish_survivals(rising, torch.zeros_like(rising), torch.tensor([2, 2]))
    assert out.dtype == torch.float32 and bool((out[:, 1] <= out[:, 0]).all()) and bool(((out >= 0) & (out <= 1)).all())


def _outcome_sums(trials: list[list[tuple[float, float]]]) -> torch.Tensor:
    """``[R, 6]`` outcome sums of per-request (expected, accepted) steps."""
    return torch.stack([sum((torch.tensor([1.0, e, x, e * e, x * x, e * x], dtype=torch.float64) for e, x in t),
                            torch.zeros(6, dtype=torch.float64)) for t in trials])


def test_outcome_row_sums_the_verified_slots_only():
    a = torch.tensor([0.9, 0.6, 0.3, 0.1])
    row = outcome_row(a, verified=2, accepted=1)
    e = 0.9 + 0.6
    assert torch.allclose(row, torch.tensor([1.0, e, 1.0, e * e, 1.0, e], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(outcome_row(a, 0, 0), torch.zeros(6, dtype=torch.float64).index_fill(0, torch.tensor([0]), 1))


def test_outcome_factors_keep_a_request_that_lags_beyond_the_noise():
    """Requests whose outcomes differ only by noise all get the batch's factor; a request that had accepted far
    fewer drafts than forecast, step after step, keeps most of its own (lower) factor; relative factors are each
    request's over the batch's; a request with no verified draft takes the batch's factor."""
    same = _outcome_sums([[(2.0, 2.0), (2.0, 1.0), (2.0, 3.0)], [(2.0, 3.0), (2.0, 1.0), (2.0, 2.0)],
                          [(2.0, 1.0), (2.0, 2.0), (2.0, 3.0)]])
    f = outcome_factors(same)
    assert torch.allclose(f, torch.ones(3, dtype=torch.float64))  # the same totals: no spread at all
    noisy = _outcome_sums([[(2.0, 0.0), (2.0, 4.0)], [(2.0, 4.0), (2.0, 1.0)], [(2.0, 2.0), (2.0, 2.0)]])
    pooled = 13 / 12
    assert torch.allclose(outcome_factors(noisy), torch.full((3,), pooled, dtype=torch.float64))  # noise ≥ spread
    steady = [[(2.0, 2.0)] * 8, [(2.0, 2.1), (2.0, 1.9)] * 4, [(2.0, 0.5), (2.0, 0.6)] * 4]  # the third lags
    f = outcome_factors(_outcome_sums(steady))
    c = torch.tensor([1.0, 1.0, 0.275], dtype=torch.float64)
    centre = (16 + 16 + 4.4) / 48
    assert bool((f[2] < 0.35) & (f[2] >= 0.275)) and torch.allclose(f[:2], f[:1].expand(2))
    assert bool(((f - centre).abs() <= (c - centre).abs() + 1e-12).all())  # pooled towards the batch, never past it
    rel = outcome_factors(_outcome_sums(steady), relative=True)
    assert torch.allclose(rel, f / centre)
    with_new = _outcome_sums(steady + [[]])
    assert torch.allclose(outcome_factors(with_new)[3], torch.tensor(centre, dtype=torch.float64))
    assert torch.equal(outcome_factors(torch.zeros(2, 6)), torch.ones(2, dtype=torch.float64))


def test_calibrate_rows_scales_caps_and_keeps_rows_non_increasing():
    rows = torch.tensor([[0.9, 0.8, 0.2], [0.5, 0.4, 0.3]])
    out = calibrate_rows(rows, torch.tensor([1.5, 0.5], dtype=torch.float64))
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, 0.3], [0.25, 0.2, 0.15]]))
