"""Equivalence of ``optimized.kernels.allocate.allocate_top_b`` with ``reference.scheduler.allocate_top_b``.

Verify lengths are integers: identical (torch.equal) for every budget 0..R·γ, for an int budget and a 0-d
device-tensor budget, with many exact ties (survivals quantised to a coarse grid, so the value-independent
tie-break (slot, then request) decides), for fp32/fp16/bf16 survivals, R = 1, γ = 1 and an empty batch.
"""

from __future__ import annotations

import pytest
import torch

from optimized.kernels.allocate import allocate_top_b
from reference import scheduler as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def survivals(R: int, gamma: int, seed: int, levels: int = 4) -> torch.Tensor:
    """Prefix survivals a = cumprod(c) with c on a grid of ``levels`` values: many exact ties in a."""
    gen = torch.Generator().manual_seed(seed)
    conf = torch.randint(1, levels + 1, (R, gamma), generator=gen).float() / levels  # [R, γ] in (0, 1]
    return torch.cumprod(conf, dim=1)  # [R, γ] non-increasing along γ


@pytest.mark.parametrize("R,gamma", [(1, 1), (1, 7), (5, 1), (5, 4), (33, 7)])
def test_matches_reference_every_budget(R, gamma):
    a = survivals(R, gamma, seed=R * 10 + gamma)
    a_dev = a.to(DEVICE)
    for budget in range(R * gamma + 1):
        want = ref.allocate_top_b(a, budget)
        assert torch.equal(allocate_top_b(a_dev, budget).cpu(), want)
        got = allocate_top_b(a_dev, torch.tensor(budget, device=DEVICE))  # the engine's sync-free budget
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
        assert int(want.sum()) == budget


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_survivals(dtype):
    a = survivals(9, 7, seed=3, levels=3).to(dtype)  # rounding to the dtype keeps the ties
    for budget in (0, 1, 10, 31, 63):
        assert torch.equal(allocate_top_b(a.to(DEVICE), budget).cpu(), ref.allocate_top_b(a, budget))


def test_all_equal_survivals_break_ties_by_slot_then_request():
    # Four requests, equal survivals everywhere: budget 6 takes slot 1 of all four, then slot 2 of requests 0, 1.
    a = torch.full((4, 3), 0.5, device=DEVICE)
    assert allocate_top_b(a, 6).tolist() == [2, 2, 1, 1]


def test_tensor_budget_out_of_range_clamps():
    a = survivals(3, 4, seed=1).to(DEVICE)
    assert allocate_top_b(a, torch.tensor(-2, device=DEVICE)).tolist() == [0, 0, 0]
    assert allocate_top_b(a, torch.tensor(100, device=DEVICE)).tolist() == [4, 4, 4]


def test_empty_batch():
    got = allocate_top_b(torch.zeros(0, 7, device=DEVICE), 0)
    assert got.shape == (0,) and got.dtype == torch.int64


def test_bad_inputs_fail_fast():
    a = survivals(2, 3, seed=0)
    with pytest.raises(ValueError, match="budget"):
        allocate_top_b(a, 7)  # above R·γ
    with pytest.raises(ValueError, match="budget"):
        allocate_top_b(a, -1)
    with pytest.raises(ValueError, match="budget"):
        allocate_top_b(a, torch.tensor([1]))
    with pytest.raises(ValueError, match="a must be"):
        allocate_top_b(a[0], 1)
