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
computes it without a host round trip), and it enters only through a comparison ``rank < budget``. A sort of
``R·γ`` ≤ a few thousand survivals is a handful of small launches and is CUDA-graph capturable, so this op
needs no Triton kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["allocate_top_b"]


def allocate_top_b(a: Tensor, budget: int | Tensor) -> Tensor:
    """Verify lengths from a global top-``budget`` of the survivals; twin of ``reference.scheduler.allocate_top_b``.

    Args:
        a: ``[R, γ]`` prefix survivals (any float dtype; compared in float32).
        budget: ``B``, the number of draft tokens to verify this step: a Python int in ``[0, R·γ]`` or a 0-d
            integer tensor on ``a``'s device (not validated, to avoid a sync: a negative value acts as 0, a
            value above ``R·γ`` verifies everything).

    Returns:
        ``[R]`` int64 verify lengths ``ℓ``, ``Σ ℓ = min(B, R·γ)``.
    """
    if a.ndim != 2 or not a.dtype.is_floating_point:
        raise ValueError(f"a must be a float tensor [R, γ] of survivals, got {a.dtype} {tuple(a.shape)}")
    if isinstance(budget, Tensor):
        if budget.ndim != 0 or budget.dtype.is_floating_point or budget.dtype == torch.bool:
            raise ValueError(f"budget tensor must be a 0-d integer tensor, got {budget.dtype} {tuple(budget.shape)}")
        if budget.device != a.device:
            raise ValueError(f"budget lives on {budget.device} but a on {a.device}; keep both on the device")
    R, gamma = a.shape
    if not isinstance(budget, Tensor) and (isinstance(budget, bool) or not isinstance(budget, int)
                                           or not 0 <= budget <= R * gamma):
        raise ValueError(f"budget must be an integer in [0, R·γ] = [0, {R * gamma}] or a 0-d integer tensor, "
                         f"got {budget!r}")
    flat = a.float().t().reshape(-1)  # [γ·R] slot-major: flat index j·R + r
    order = torch.sort(flat, descending=True, stable=True).indices  # [γ·R] best first, ties by (slot, request)
    rank = torch.empty_like(order)  # [γ·R] position of each candidate in the ranking
    rank[order] = torch.arange(order.numel(), device=a.device)
    selected = rank < budget  # [γ·R]
    return selected.view(gamma, R).sum(dim=0, dtype=torch.int64)  # [R]
