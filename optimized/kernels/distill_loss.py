"""The training loss's per-row work, fused: draft softmax, target softmax, the loss terms and ``dL/dz`` in one kernel.

Fast twin of the elementwise part of ``optimized.training``'s fused LM-head loss (itself the twin of
``reference.losses.dspark_loss``, docs/method.md §2). Names follow ``docs/method.md``: ``p_t`` target, ``p_d``
draft, ``γ`` the block size. The draft rows come ordered by the target row that teaches them: rows
``[γ·t, γ·(t+1))`` are the γ slots scored against target row ``t``. Per draft row ``m`` (teacher ``t = m // γ``),
with ``z`` its draft logits, ``ℓ`` the target's logits, ``y`` its label and ``a`` its loss weight::

    lse_d = logsumexp(z),  lse_t = logsumexp(ℓ),  p_d = exp(z - lse_d),  p_t = exp(ℓ - lse_t)
    ce    = lse_d - z[y]                          kl = Σ p_t (log p_t - z) + lse_d     (0·log 0 = 0)
    l1    = Σ |p_d - p_t|                         c* = clamp(Σ min(p_d, p_t), 0, 1)
    dL/dz = a · [w_ce (p_d - onehot(y)) + w_kl (p_d - p_t) + w_l1 p_d ⊙ (s - Σ p_d s)],   s = sign(p_d - p_t)

plus two flags for the training log: ``argmax z == y`` and ``argmax z == argmax ℓ`` (lowest index on ties, as
``torch.argmax``).

Why a kernel. The torch version keeps about fifteen full ``[rows, V]`` float32 temporaries per chunk (the two
softmaxes, their difference, its absolute value and sign, the gradient, the casts), each a full pass over memory:
with ``V = 49152`` that traffic, not the LM-head matrix products, dominates the training step. The kernel reads a
row of ``z`` and its teacher row three times (max/sum, then the sums that need both normalisers, then the
gradient) and writes the gradient once, in the dtype of the following matrix product, optionally over ``z``
itself (``out=z``: each tile is read before it is overwritten by the same program). The γ programs of one
teacher row run next to each other, so the teacher row is read from L2 after the first.

One program per draft row, ``BLOCK_V`` vocabulary lanes per tile; compute in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from optimized.kernels.common import BIG_INDEX, argmax_update, resolve_backend

__all__ = ["ROW_STATS", "distill_rows", "distill_rows_torch"]

ROW_STATS = ("ce", "l1", "kl", "c_star", "label_hit", "target_hit")
"""Columns of the ``[M, 6]`` float32 per-row output of :func:`distill_rows`."""

# 2048 lanes with 8 warps: 8 float32 values per thread per input; V = 49152 is 24 tiles. Not swept on the H200.
DISTILL_BLOCK_V = 2048


@triton.jit
def _tile_probs(z_row, t_row, lanes, V, lse_d, lse_t):
    """One vocabulary tile of a draft row and its teacher row, normalised: ``z``, ``log p_t``, ``p_d``, ``p_t`` (padding
    lanes: ``z = log p_t = -inf``, ``p_d = p_t = 0``), the lanes and their validity."""
    ok = lanes < V
    zt = tl.load(z_row + lanes, mask=ok, other=float("-inf")).to(tl.float32)
    lpt = tl.load(t_row + lanes, mask=ok, other=float("-inf")).to(tl.float32) - lse_t
    return zt, lpt, tl.exp(zt - lse_d), tl.exp(lpt), lanes, ok


@triton.jit
def _distill_rows_kernel(z_ptr, t_ptr, label_ptr, weight_ptr, out_ptr, stats_ptr, V, w_ce, w_kl, w_l1,
                         GAMMA: tl.constexpr, HAS_L1: tl.constexpr, BLOCK_V: tl.constexpr):
    m = tl.program_id(0)
    t = m // GAMMA
    z_row = z_ptr + m.to(tl.int64) * V
    t_row = t_ptr + t.to(tl.int64) * V
    out_row = out_ptr + m.to(tl.int64) * V
    lanes0 = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")

    # pass 1: online max / sum of exp for both rows, and both argmaxes
    mz = tl.full((), neg_inf, tl.float32)
    sz = tl.zeros((), tl.float32)
    mt = tl.full((), neg_inf, tl.float32)
    st = tl.zeros((), tl.float32)
    bz = tl.full((), neg_inf, tl.float32)
    iz = tl.full((), BIG_INDEX, tl.int32)
    bt = tl.full((), neg_inf, tl.float32)
    it = tl.full((), BIG_INDEX, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        lanes = v0 + lanes0
        ok = lanes < V
        zt = tl.load(z_row + lanes, mask=ok, other=neg_inf).to(tl.float32)
        tt = tl.load(t_row + lanes, mask=ok, other=neg_inf).to(tl.float32)
        bz, iz = argmax_update(bz, iz, zt, lanes)
        bt, it = argmax_update(bt, it, tt, lanes)
        nz = tl.maximum(mz, tl.max(zt, axis=0))
        sz = tl.where(mz > neg_inf, sz * tl.exp(mz - nz), 0.0) \
            + tl.sum(tl.where(zt > neg_inf, tl.exp(zt - nz), 0.0), axis=0)
        mz = nz
        nt = tl.maximum(mt, tl.max(tt, axis=0))
        st = tl.where(mt > neg_inf, st * tl.exp(mt - nt), 0.0) \
            + tl.sum(tl.where(tt > neg_inf, tl.exp(tt - nt), 0.0), axis=0)
        mt = nt
    lse_d = mz + tl.log(sz)
    lse_t = mt + tl.log(st)

    # pass 2: the sums that need both normalisers
    ent = tl.zeros((), tl.float32)   # Σ p_t log p_t
    ptz = tl.zeros((), tl.float32)   # Σ p_t z
    l1 = tl.zeros((), tl.float32)    # Σ |p_d - p_t|
    cs = tl.zeros((), tl.float32)    # Σ min(p_d, p_t)
    pds = tl.zeros((), tl.float32)   # Σ p_d s
    for v0 in range(0, V, BLOCK_V):
        zt, lpt, p_d, p_t, lanes, ok = _tile_probs(z_row, t_row, v0 + lanes0, V, lse_d, lse_t)
        live = p_t > 0.0
        ent += tl.sum(p_t * tl.where(live, lpt, 0.0), axis=0)  # no 0·(-inf) even in masked lanes
        ptz += tl.sum(p_t * tl.where(live, zt, 0.0), axis=0)
        diff = p_d - p_t
        l1 += tl.sum(tl.abs(diff), axis=0)
        cs += tl.sum(tl.minimum(p_d, p_t), axis=0)
        if HAS_L1:
            sgn = tl.where(diff > 0.0, 1.0, tl.where(diff < 0.0, -1.0, 0.0))
            pds += tl.sum(p_d * sgn, axis=0)

    # pass 3: dL/dz, written in the output's dtype (possibly over z)
    y = tl.load(label_ptr + m)
    a = tl.load(weight_ptr + m).to(tl.float32)
    z_y = tl.load(z_row + y).to(tl.float32)  # read before pass 3 may overwrite it
    for v0 in range(0, V, BLOCK_V):
        zt, lpt, p_d, p_t, lanes, ok = _tile_probs(z_row, t_row, v0 + lanes0, V, lse_d, lse_t)
        g = p_d * (a * (w_ce + w_kl)) - p_t * (a * w_kl)
        if HAS_L1:
            diff = p_d - p_t
            sgn = tl.where(diff > 0.0, 1.0, tl.where(diff < 0.0, -1.0, 0.0))
            g += (a * w_l1) * p_d * (sgn - pds)
        g = tl.where(lanes == y, g - a * w_ce, g)
        tl.store(out_row + lanes, g.to(out_ptr.dtype.element_ty), mask=ok)

    row = stats_ptr + m.to(tl.int64) * 6
    tl.store(row + 0, lse_d - z_y)
    tl.store(row + 1, l1)
    tl.store(row + 2, ent - ptz + lse_d)
    tl.store(row + 3, tl.minimum(tl.maximum(cs, 0.0), 1.0))
    tl.store(row + 4, (iz == y).to(tl.float32))
    tl.store(row + 5, (iz == it).to(tl.float32))


def _check(z: Tensor, target_logits: Tensor, labels: Tensor, row_weight: Tensor, out: Tensor | None) -> int:
    if z.dim() != 2 or target_logits.dim() != 2 or z.shape[1] != target_logits.shape[1]:
        raise ValueError(f"z [M, V] and target_logits [T, V] must share V, got {tuple(z.shape)} and "
                         f"{tuple(target_logits.shape)}")
    M, T = z.shape[0], target_logits.shape[0]
    if T == 0 or M % T:
        raise ValueError(f"z must hold γ rows per target row (M = γ·T), got M = {M}, T = {T}")
    if labels.shape != (M,) or row_weight.shape != (M,):
        raise ValueError(f"labels and row_weight must be [M] = [{M}], got {tuple(labels.shape)} and "
                         f"{tuple(row_weight.shape)}")
    if out is not None and out.shape != z.shape:
        raise ValueError(f"out must be [M, V] = {tuple(z.shape)}, got {tuple(out.shape)}")
    return M // T


def distill_rows_torch(z: Tensor, target_logits: Tensor, labels: Tensor, row_weight: Tensor,
                       weights: tuple[float, float, float], *, grad_dtype: torch.dtype | None = None,
                       out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The torch definition of :func:`distill_rows` (same signature; full-size float32 temporaries)."""
    gamma = _check(z, target_logits, labels, row_weight, out)
    w_ce, w_kl, w_l1 = (float(w) for w in weights)
    M, V = z.shape
    c = M // gamma
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1, keepdim=True)  # [M, 1]
    p_d = torch.exp(zf - lse)  # [M, V]
    log_p_t = torch.log_softmax(target_logits.float(), dim=-1)  # [c, V]: once per target row
    p_t = log_p_t.exp()  # [c, V]
    neg_entropy = (p_t * log_p_t).nan_to_num(0.0).sum(-1)  # [c] Σ p_t log p_t
    p_d3, z3 = p_d.view(c, gamma, V), zf.view(c, gamma, V)
    y = labels
    ce = (lse - zf.gather(1, y[:, None])).squeeze(1)  # [M] −log p_d(x*)
    kl = (neg_entropy[:, None] - torch.einsum("cv,cgv->cg", p_t, z3)).reshape(-1) + lse.squeeze(1)
    diff = p_d3 - p_t[:, None, :]  # [c, γ, V]
    l1 = diff.abs().sum(-1).reshape(-1)  # [M] ‖p_d − p_t‖₁
    c_star = (p_d3 - diff.clamp_min(0)).sum(-1).reshape(-1).clamp(0.0, 1.0)  # [M] Σ min(p_d, p_t)
    a = row_weight.float()[:, None]  # [M, 1]
    # dL/dz row by row: a·[w_ce (p_d − onehot(x*)) + w_kl (p_d − p_t) + w_l1 p_d ⊙ (s − Σ p_d s)].
    g = p_d * (a * (w_ce + w_kl))  # [M, V]
    if w_ce:
        g.scatter_add_(1, y[:, None], -a * w_ce)
    if w_kl:
        g.view(c, gamma, V).sub_(p_t[:, None, :] * (a * w_kl).view(c, gamma, 1))
    if w_l1:
        s = diff.sign().view(-1, V)  # [M, V]
        g += (a * w_l1) * p_d * (s - (p_d * s).sum(-1, keepdim=True))
    stats = torch.stack((ce, l1, kl, c_star, (zf.argmax(-1) == y).float(),
                         (z3.argmax(-1) == log_p_t.argmax(-1)[:, None]).reshape(-1).float()), dim=1)  # [M, 6]
    dtype = out.dtype if out is not None else (grad_dtype or z.dtype)
    if out is None:
        return g.to(dtype), stats
    out.copy_(g)
    return out, stats


def distill_rows(z: Tensor, target_logits: Tensor, labels: Tensor, row_weight: Tensor,
                 weights: tuple[float, float, float], *, grad_dtype: torch.dtype | None = None,
                 out: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Loss terms and ``dL/dz`` of ``M = γ·T`` draft rows against their ``T`` teacher rows.

    Args:
        z: ``[M, V]`` draft logits (any float dtype), rows ordered by teacher (row ``m`` is taught by ``m // γ``).
        target_logits: ``[T, V]`` the target's logits of the teacher rows (any float dtype).
        labels: ``[M]`` int64 the tokens ``x*`` the rows predict.
        row_weight: ``[M]`` float32 each row's loss weight ``a`` (0 for a row that is not supervised).
        weights: ``(w_ce, w_kl, w_l1)``.
        grad_dtype: dtype of the returned gradient (default ``z.dtype``); ignored when ``out`` is given.
        out: ``[M, V]`` where to write the gradient; may be ``z`` itself.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see ``optimized.kernels.common.resolve_backend``).

    Returns:
        ``(grad [M, V], stats [M, 6])``: ``dL/dz`` with ``L = Σ_m a_m (w_ce ce + w_kl kl + w_l1 l1)`` and the
        float32 per-row :data:`ROW_STATS`.
    """
    gamma = _check(z, target_logits, labels, row_weight, out)
    if resolve_backend(backend, z) == "torch":
        return distill_rows_torch(z, target_logits, labels, row_weight, weights, grad_dtype=grad_dtype, out=out)
    w_ce, w_kl, w_l1 = (float(w) for w in weights)
    M, V = z.shape
    z, target_logits = z.contiguous(), target_logits.contiguous()
    if out is None:
        out = torch.empty(M, V, dtype=grad_dtype or z.dtype, device=z.device)
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    stats = torch.empty(M, len(ROW_STATS), dtype=torch.float32, device=z.device)
    if M:
        _distill_rows_kernel[(M,)](z, target_logits, labels.to(torch.int64).contiguous(),
                                   row_weight.to(torch.float32).contiguous(), out, stats, V, w_ce, w_kl, w_l1,
                                   GAMMA=gamma, HAS_L1=w_l1 != 0.0, BLOCK_V=DISTILL_BLOCK_V, num_warps=8)
    return out, stats
