"""Equivalence of ``optimized.kernels.allocate.allocate_top_b`` with ``reference.scheduler.allocate_top_b``.

Verify lengths are integers: identical (torch.equal) for every budget 0..R·γ, for an int budget and a 0-d
device-tensor budget, with many exact ties (survivals quantised to a coarse grid, so the value-independent
tie-break (slot, then request) decides), for fp32/fp16/bf16 survivals, R = 1, γ = 1 and an empty batch.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.allocate import allocate_top_b
from reference import scheduler as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]


def survivals(R: int, gamma: int, seed: int, levels: int = 4) -> torch.Tensor:
    """Prefix survivals a = cumprod(c) with c on a grid of ``levels`` values: many exact ties in a."""
    gen = torch.Generator().manual_seed(seed)
    conf = torch.randint(1, levels + 1, (R, gamma), generator=gen).float() / levels  # [R, γ] in (0, 1]
    return torch.cumprod(conf, dim=1)  # [R, γ] non-increasing along γ


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,gamma", [(1, 1), (1, 7), (5, 1), (5, 4), (33, 7), (40, 7)])  # 280 > one 256-wide block
def test_matches_reference_every_budget(R, gamma, backend):
    a = survivals(R, gamma, seed=R * 10 + gamma)
    a_dev = a.to(DEVICE)
    n = R * gamma
    # Every budget, or (large R·γ, where the interpreted kernel is slow) both ends and every 29th in between.
    budgets = range(n + 1) if n <= 35 or DEVICE == "cuda" or backend == "torch" else [*range(0, n, 29), n - 1, n]
    for budget in budgets:
        want = ref.allocate_top_b(a, budget)
        assert torch.equal(allocate_top_b(a_dev, budget, backend).cpu(), want)
        got = allocate_top_b(a_dev, torch.tensor(budget, device=DEVICE), backend)  # the engine's sync-free budget
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
        assert int(want.sum()) == budget


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_a_larger_buffer(backend):
    # The engine's call: the survivals of slots `rows` (in batch order) out of the [S, γ] buffer of every slot.
    buffer = survivals(12, 7, seed=5)  # [S, γ]
    rows = torch.tensor([7, 2, 11, 0, 5])
    for budget in (0, 3, 17, 35):
        want = ref.allocate_top_b(buffer[rows], budget)
        got = allocate_top_b(buffer.to(DEVICE), budget, backend, rows=rows.to(DEVICE))
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_survivals(dtype, backend):
    a = survivals(9, 7, seed=3, levels=3).to(dtype)  # rounding to the dtype keeps the ties
    for budget in (0, 1, 10, 31, 63):
        assert torch.equal(allocate_top_b(a.to(DEVICE), budget, backend).cpu(), ref.allocate_top_b(a, budget))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_equal_survivals_break_ties_by_slot_then_request(backend):
    # Four requests, equal survivals everywhere: budget 6 takes slot 1 of all four, then slot 2 of requests 0, 1.
    a = torch.full((4, 3), 0.5, device=DEVICE)
    assert allocate_top_b(a, 6, backend).tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_budget_out_of_range_clamps(backend):
    a = survivals(3, 4, seed=1).to(DEVICE)
    assert allocate_top_b(a, torch.tensor(-2, device=DEVICE), backend).tolist() == [0, 0, 0]
    assert allocate_top_b(a, torch.tensor(100, device=DEVICE), backend).tolist() == [4, 4, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    got = allocate_top_b(torch.zeros(0, 7, device=DEVICE), 0, backend)
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
    with pytest.raises(ValueError, match="rows"):
        allocate_top_b(a, 1, rows=torch.tensor([0, 1], dtype=torch.int32))
