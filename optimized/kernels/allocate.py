"""Top-B allocation of verify lengths on the device: the second half of the production scheduler (docs/method.md §5).

Fast twin of ``reference/scheduler.py::allocate_top_b``. Names follow ``docs/method.md``: ``a`` prefix
survival, ``ℓ`` verify length, ``γ`` block size. Given the current survivals ``a [R, γ]`` and a token budget
``B`` (computed earlier on the host from stale confidences, docs/method.md §5 "Production variant"), the step verifies
the ``B`` best candidates ``(r, j)`` of one global ranking and ``ℓ_r`` counts request ``r``'s winners.

The ranking is (survival descending, slot ascending, request ascending), value-independent on ties (so two
implementations that see equal survivals agree). It is realised by one *stable* descending sort of the survivals
laid out slot-major (flat index ``j·R + r``): equal survivals keep their flat order, which is exactly slot, then
request. Because ``a_{r,j}`` is non-increasing in ``j`` the winners of each row form a prefix, so the count
is the verify length.

Everything stays on the device and nothing synchronises: ``budget`` may be a 0-d device tensor (the engine
computes it without a host round trip), and it enters only through a comparison ``rank < budget``.

Two implementations of one ranking. The torch one sorts: one stable sort of ``R·γ`` values and a scatter of ranks, a
handful of small launches. The Triton one is a single launch with one program per request: each of its ``γ``
candidates counts the candidates ranked before it (larger survival, or equal survival and smaller flat index) over
all ``R·γ`` of them (``γ × R·γ`` comparisons per program), and ``ℓ_r`` is how many of those counts are below ``B``.
An adaptive step launches it outside the CUDA graphs, before the verify: at batch 1 on an H200 the sort's eight
launches were the kernels an adaptive step launched beyond a fixed-K step. It also reads the rows of a larger
survival buffer directly (``rows``), which saves the gather. The count is exact for the survivals the engine
produces (finite, in [0, 1]); NaN is not validated (that would synchronise) and ranks arbitrarily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from optimized.kernels.common import resolve_backend

__all__ = ["allocate_top_b"]


# Rows of candidates compared at a time by the Triton kernel (a power of two; γ ≤ 64 candidates per request).
ALLOCATE_BLOCK = 256


@triton.jit(do_not_specialize=["R", "budget"])
def _allocate_top_b_kernel(
    lens_ptr,  # [R] int64 out: ℓ_r
    a_ptr,  # [S, γ] survivals (any float dtype), last dim contiguous
    stride_a,  # a's stride over rows
    rows_ptr,  # [R] int64 rows of a to rank (HAS_ROWS), else rows 0..R-1
    budget_ptr,  # 0-d integer budget on the device (BUDGET_IN_MEMORY)
    budget,  # B as a host int (otherwise)
    R,  # requests
    gamma,  # γ
    HAS_ROWS: tl.constexpr,
    BUDGET_IN_MEMORY: tl.constexpr,
    BLOCK_G: tl.constexpr,  # γ rounded up to a power of two
    BLOCK: tl.constexpr,  # candidates compared per inner iteration
):
    """Program ``r``: ``ℓ_r`` = how many of request r's candidates rank below ``budget``, where a candidate's rank is
    the number of candidates before it in (survival descending, flat index j·R + r ascending) order."""
    r = tl.program_id(0).to(tl.int64)
    if BUDGET_IN_MEMORY:
        limit = tl.load(budget_ptr).to(tl.int64)
    else:
        limit = budget.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    else:
        row = r
    slots = tl.arange(0, BLOCK_G)  # [BLOCK_G] this request's slots j
    mine_ok = slots < gamma
    mine = tl.load(a_ptr + row * stride_a + slots, mask=mine_ok, other=0.0).to(tl.float32)  # [BLOCK_G]
    mine_flat = slots.to(tl.int64) * R + r  # [BLOCK_G] flat index j·R + r
    rank = tl.zeros([BLOCK_G], dtype=tl.int64)
    total = R * gamma
    for start in range(0, total, BLOCK):
        flat = start + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK] flat indices j·R + r' of the other candidates
        ok = flat < total
        other_row = flat % R
        if HAS_ROWS:
            other_row = tl.load(rows_ptr + other_row, mask=ok, other=0)
        other = tl.load(a_ptr + other_row * stride_a + flat // R, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
        before = (other[None, :] > mine[:, None]) | ((other[None, :] == mine[:, None])
                                                      & (flat[None, :] < mine_flat[:, None]))  # [BLOCK_G, BLOCK]
        rank += tl.sum((before & ok[None, :]).to(tl.int64), axis=1)
    won = mine_ok & (rank < limit)
    tl.store(lens_ptr + r, tl.sum(won.to(tl.int64), axis=0))


def allocate_top_b(a: Tensor, budget: int | Tensor, backend: str = "auto", *, rows: Tensor | None = None) -> Tensor:
    """Verify lengths from a global top-``budget`` of the survivals; twin of ``reference.scheduler.allocate_top_b``.

    Args:
        a: ``[R, γ]`` prefix survivals (any float dtype; compared in float32), or with ``rows`` a ``[S, γ]`` buffer
            of which rows ``rows`` are ranked.
        budget: ``B``, the number of draft tokens to verify this step: a Python int in ``[0, R·γ]`` or a 0-d
            integer tensor on ``a``'s device (not validated, to avoid a sync: a negative value acts as 0, a
            value above ``R·γ`` verifies everything).
        backend: ``"auto"`` (Triton on CUDA or under the interpreter), ``"triton"`` or ``"torch"``.
        rows: ``[R]`` int64 rows of ``a`` (the engine's slots): the same result as ``allocate_top_b(a[rows], ...)``
            without materialising ``a[rows]`` in the Triton path.

    Returns:
        ``[R]`` int64 verify lengths ``ℓ``, ``Σ ℓ = min(B, R·γ)``.
    """
    if a.ndim != 2 or not a.dtype.is_floating_point:
        raise ValueError(f"a must be a float tensor [R, γ] of survivals, got {a.dtype} {tuple(a.shape)}")
    if rows is not None and (rows.ndim != 1 or rows.dtype != torch.int64 or rows.device != a.device):
        raise ValueError(f"rows must be a [R] int64 tensor on a's device, got {rows.dtype} {tuple(rows.shape)} "
                         f"on {rows.device}")
    if isinstance(budget, Tensor):
        if budget.ndim != 0 or budget.dtype.is_floating_point or budget.dtype == torch.bool:
            raise ValueError(f"budget tensor must be a 0-d integer tensor, got {budget.dtype} {tuple(budget.shape)}")
        if budget.device != a.device:
            raise ValueError(f"budget lives on {budget.device} but a on {a.device}; keep both on the device")
    R, gamma = (a.shape[0] if rows is None else rows.shape[0]), a.shape[1]
    if not isinstance(budget, Tensor) and (isinstance(budget, bool) or not isinstance(budget, int)
                                           or not 0 <= budget <= R * gamma):
        raise ValueError(f"budget must be an integer in [0, R·γ] = [0, {R * gamma}] or a 0-d integer tensor, "
                         f"got {budget!r}")
    if resolve_backend(backend, a) == "torch" or gamma > 64:
        return _allocate_top_b_torch(a if rows is None else a[rows], budget)
    lens = torch.empty(R, dtype=torch.int64, device=a.device)  # [R]
    if R == 0:
        return lens
    if a.stride(-1) != 1:
        a = a.contiguous()
    in_memory = isinstance(budget, Tensor)
    _allocate_top_b_kernel[(R,)](
        lens, a, a.stride(0), rows if rows is not None else lens, budget if in_memory else lens,
        0 if in_memory else budget, R, gamma, HAS_ROWS=rows is not None, BUDGET_IN_MEMORY=in_memory,
        BLOCK_G=triton.next_power_of_2(gamma), BLOCK=ALLOCATE_BLOCK)
    return lens


def _allocate_top_b_torch(a: Tensor, budget: int | Tensor) -> Tensor:
    """The ranking by one stable sort (torch fallback; ``a`` is ``[R, γ]``)."""
    R, gamma = a.shape
    flat = a.float().t().reshape(-1)  # [γ·R] slot-major: flat index j·R + r
    order = torch.sort(flat, descending=True, stable=True).indices  # [γ·R] best first, ties by (slot, request)
    rank = torch.empty_like(order)  # [γ·R] position of each candidate in the ranking
    rank[order] = torch.arange(order.numel(), device=a.device)
    selected = rank < budget  # [γ·R]
    return selected.view(gamma, R).sum(dim=0, dtype=torch.int64)  # [R]
