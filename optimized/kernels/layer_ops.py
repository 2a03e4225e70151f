"""The element-wise parts of a Llama-family decoder layer, fused: RMSNorm (+ residual add), q/k-norm + RoPE + KV
append, and SiLU·up. Used by the target (``optimized/models/target.py``) and the drafter backbone.

Why: at batch 1 a verify step of SmolLM2-135M is ~1,200 tiny kernels (30 layers × ~40: an RMSNorm alone is seven
element-wise launches — cast, square, mean, add ε, rsqrt, multiply, cast, scale), and a kernel inside a CUDA graph
still costs a few microseconds however little it does. Fused, a layer is nine launches: add+norm, qkv matmul,
RoPE+append, attention, o matmul, add+norm, gate/up matmul, SiLU·up, down matmul (the residual add rides on the next
norm). Steps of up to 16 tokens (a decode step of up to 16 requests, a verify block of eight at batch 1 or 2) fold
the norms and SiLU·up into the matmuls too (``optimized/kernels/linear.py``): six launches.

Each op has a torch path (the readable definition, written to round exactly like HF Llama/Qwen, and the reference
twin of the Triton kernel) and a Triton path with the same signature:

=====================  ============================================================================================
``rms_norm``           ``y = w · (x̂ / rms(x̂))`` with ``x̂ = x + residual`` (when given); returns ``(y, x̂)``
``rope_append_kv``     Qwen3 per-head q/k RMSNorm (optional), rotate-half RoPE of q and k, K/V written to the cache
                       at ``(slot, position)`` of every token; returns the rotated q
``silu_mul``           ``silu(gate) · up`` of a fused ``[gate | up]`` row
=====================  ============================================================================================

Rounding. The Triton kernels compute in float32 and round to the model dtype after exactly the operations where
HF's eager code rounds (the residual sum; the normalised activations before the gain; the gain product; each RoPE
product and their sum; SiLU before the product). What can still differ is the last float32 bit of a sum's order
(the RMS reduction) and of ``exp``/``rsqrt`` (Triton's vs the torch kernels'): float32 results agree to ~1e-6
relative, fp16/bf16 results to one ulp where such a bit lands on a rounding boundary.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton is optional on CPU machines; the torch paths need nothing else.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False


def resolve_backend(backend: str, x: Tensor) -> str:
    """``"auto"``: Triton for CUDA tensors, torch otherwise (on the CPU the torch path is the fast one; the tests
    force ``"triton"`` under ``TRITON_INTERPRET=1`` to execute the kernels there)."""
    if backend == "auto":
        return "triton" if (x.is_cuda and HAS_TRITON) else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' but triton is not installed (pip install triton)")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to interpret on the CPU")
        return "triton"
    if backend == "torch":
        return "torch"
    raise ValueError(f"unknown layer-op backend {backend!r}; choose 'auto', 'triton' or 'torch'")


# ---------------------------------------------------------------------------------------------------------
# Torch definitions (HF's rounding; also the building blocks of the eager path)
# ---------------------------------------------------------------------------------------------------------


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF RMSNorm: normalise in float32, cast back, then scale by the gain. x [..., d] -> [..., d]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [N, D] for absolute ``positions`` [N], computed in float32 then cast (HF's order)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rope_table(num_positions: int, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> Tensor:
    """``[P, 2·D]``: :func:`rope_cos_sin` of the positions ``0..P-1``, each row its cos then its sin.

    A step's tables are then rows of it (:func:`rope_lookup`: one gather) instead of eight small kernels each time the
    forward runs — in a CUDA graph at batch 1 each of those kernels costs a few microseconds however little it does.
    The entries are elementwise float32 functions of the position, so a row holds exactly the bits that computing
    that position's tables in the step gives (tests/equivalence/test_layer_ops.py)."""
    cos, sin = rope_cos_sin(torch.arange(num_positions, device=inv_freq.device), inv_freq, scaling, dtype)
    return torch.cat((cos, sin), dim=1)  # [P, 2·D]


def rope_lookup(table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The cos/sin tables ``[N, D]`` of ``positions`` ``[N]`` (each ``< P``) from a :func:`rope_table` ``[P, 2·D]``:
    two views of one gathered ``[N, 2·D]`` block (row stride 2·D, which the RoPE kernels take)."""
    rows = table.index_select(0, positions)  # [N, 2·D]
    d = table.shape[1] // 2
    return rows[:, :d], rows[:, d:]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of x [N, heads, D] with tables [N, D] (Llama convention, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # [N, heads, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
    """KV append: cache[slots[i], positions[i]] = k[i] (and v). One scatter per tensor, no host sync.

    Advanced indexing bounds-checks both indices (an error on CPU, a device assert on CUDA), so a position past
    the cache cannot silently spill into the next slot. Duplicate (slot, position) pairs only occur in the trash
    slot, where any winner is fine.
    """
    k_cache.index_put_((slots, positions), k)
    v_cache.index_put_((slots, positions), v)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels: one program per token row (decode/verify steps have few rows; each row is one model width)
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr,  # x, residual, y, sum: [N, d] rows (row strides below); w: [d]
        stride_x, stride_res, stride_y, stride_sum,
        d, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # x̂ = x + residual, rounded to the model dtype as HF's eager add is
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / d + eps)
        normed = (xf * inv_rms).to(x.dtype)  # HF casts back before the gain
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(y_ptr + row * stride_y + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _rope_heads(src_ptr, stride_src, cos, sin, norm_ptr, eps, heads, head_dim,
                    HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Load ``heads`` rows of one token, per-head RMSNorm (optional), rotate-half RoPE. Returns [BLOCK_H, BLOCK_D]
        in the model dtype plus its mask. ``cos``/``sin`` [1, BLOCK_D] are the token's table row in float32."""
        h = tl.arange(0, BLOCK_H)[:, None]
        col = tl.arange(0, BLOCK_D)[None, :]
        half = head_dim // 2
        partner = tl.where(col < half, col + half, col - half)  # rotate_half: [-x2, x1]
        mask = (h < heads) & (col < head_dim)
        x = tl.load(src_ptr + h * stride_src + col, mask=mask, other=0.0)
        xp = tl.load(src_ptr + h * stride_src + partner, mask=mask, other=0.0)
        if HAS_NORM:  # Qwen3: RMSNorm over each head's D values, before RoPE (same rounding as _rms_norm_kernel)
            xf = x.to(tl.float32)
            inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / head_dim + eps)[:, None]
            w = tl.load(norm_ptr + col, mask=col < head_dim, other=0.0).to(tl.float32)
            wp = tl.load(norm_ptr + partner, mask=col < head_dim, other=0.0).to(tl.float32)
            x = (w * (xf * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype)
            xp = (wp * (xp.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype)
        rotated = tl.where(col < half, -xp.to(tl.float32), xp.to(tl.float32))
        # HF: q·cos + rotate_half(q)·sin, each product rounded to the model dtype, then the sum.
        a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        b = (rotated * sin).to(x.dtype).to(tl.float32)
        return (a + b).to(x.dtype), mask

    @triton.jit
    def _rope_append_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr,  # q [N, H, D] (in), k/v [N, Hkv, D] (in), rotated q out [N, H, D]
        cos_ptr, sin_ptr,  # [N, D] tables in the model dtype
        qn_ptr, kn_ptr,  # [D] q/k norm gains (Qwen3) or dummies
        kc_ptr, vc_ptr,  # [S, T, Hkv, D] caches of one layer
        slot_ptr, pos_ptr,  # [N] int64 cache coordinates of each token
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
        stride_cos,
        stride_cs, stride_ct, stride_ch,  # cache strides over slots, positions, heads (k and v alike)
        num_heads, num_kv_heads, head_dim, eps,
        HAS_Q: tl.constexpr, HAS_NORM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK_D)[None, :]
        cmask = col < head_dim
        cos = tl.load(cos_ptr + n * stride_cos + col, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + n * stride_cos + col, mask=cmask, other=0.0).to(tl.float32)
        if HAS_Q:
            q, qmask = _rope_heads(q_ptr + n * stride_qn, stride_qh, cos, sin, qn_ptr, eps, num_heads,
                                   head_dim, HAS_NORM, BLOCK_H, BLOCK_D)
            h = tl.arange(0, BLOCK_H)[:, None]
            tl.store(qo_ptr + n * stride_on + h * stride_oh + col, q, mask=qmask)
        k, kmask = _rope_heads(k_ptr + n * stride_kn, stride_kh, cos, sin, kn_ptr, eps, num_kv_heads,
                               head_dim, HAS_NORM, BLOCK_HKV, BLOCK_D)
        hk = tl.arange(0, BLOCK_HKV)[:, None]
        dst = tl.load(slot_ptr + n) * stride_cs + tl.load(pos_ptr + n) * stride_ct + hk * stride_ch + col
        tl.store(kc_ptr + dst, k, mask=kmask)
        v = tl.load(v_ptr + n * stride_vn + hk * stride_vh + col, mask=kmask, other=0.0)
        tl.store(vc_ptr + dst, v, mask=kmask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch's silu: x / (1 + e^-x) in float32, then rounded
        tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------------------


def _rows(t: Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a 2-D tensor with a contiguous last dimension, got shape "
                         f"{tuple(t.shape)} and strides {t.stride()}")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, *, backend: str = "auto"
             ) -> tuple[Tensor, Tensor]:
    """RMSNorm of ``x̂ = x + residual`` (or of ``x``): returns ``(w · norm(x̂), x̂)``, both ``[N, d]``.

    The sum is what a pre-norm layer carries on as its residual stream, so the add and the norm share one pass.
    """
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if resolve_backend(backend, x) == "torch":
        total = x if residual is None else x + residual
        return rms_norm_torch(total, weight, eps), total
    _rows(x, "x")
    n, d = x.shape
    y = torch.empty_like(x)
    if residual is None:
        total, res = x, x
    else:
        _rows(residual, "residual")
        total, res = torch.empty_like(x), residual
    if n:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(n,)](x, res, weight, y, total, x.stride(0), res.stride(0), y.stride(0), total.stride(0),
                               d, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=4 if block <= 2048 else 8)
    return y, total


def rope_append_kv(q: Tensor | None, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor, positions: Tensor, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                   eps: float = 1e-6, *, backend: str = "auto") -> Tensor | None:
    """RoPE q and k (after the per-head q/k RMSNorm when the gains are given), write k and v into the caches.

    Args:
        q: ``[N, H, D]`` queries (any row/head strides, contiguous D) or ``None`` (context-only appends).
        k, v: ``[N, Hkv, D]`` keys and values of the same tokens.
        cos, sin: ``[N, D]`` RoPE tables in the model dtype (:func:`rope_cos_sin`).
        k_cache, v_cache: ``[S, T, Hkv, D]`` one layer's caches; token i goes to ``[slots[i], positions[i]]``.
        slots, positions: ``[N]`` int64 cache coordinates (bounds are the caller's contract on the Triton path).
        q_norm, k_norm: ``[D]`` gains of Qwen3's per-head RMSNorm, or ``None`` (without q, only k_norm counts).

    Returns:
        the rotated q ``[N, H, D]`` (contiguous), or ``None`` when ``q`` is ``None``.
    """
    if q is not None and (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (Qwen3) or not at all")
    n, hkv, d = k.shape
    if v.shape != k.shape or cos.shape != (n, d) or sin.shape != (n, d) or slots.shape != (n,) \
            or positions.shape != (n,):
        raise ValueError(f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)}, slots {tuple(slots.shape)}, positions {tuple(positions.shape)}")
    if q is not None and (q.shape[0] != n or q.shape[2] != d):
        raise ValueError(f"q must be [N={n}, H, D={d}], got {tuple(q.shape)}")
    if resolve_backend(backend, k) == "torch":
        if k_norm is not None:
            k = rms_norm_torch(k, k_norm, eps)
            q = None if q is None else rms_norm_torch(q, q_norm, eps)
        write_kv(k_cache, v_cache, slots, positions, apply_rope(k, cos, sin), v)
        return None if q is None else apply_rope(q, cos, sin)
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)) + (
            (("q", q),) if q is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if k_cache.stride() != v_cache.stride() or cos.stride() != sin.stride():
        raise ValueError("k_cache/v_cache (and cos/sin) must share one layout")
    if n > 1 and (slots.stride(0) != 1 or positions.stride(0) != 1):  # the kernel reads them as arrays
        raise ValueError(f"slots and positions must be contiguous, got strides {slots.stride()} and "
                         f"{positions.stride()}")
    heads = 0 if q is None else q.shape[1]
    q_out = None if q is None else torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    if n:
        qq, qo = (k, k) if q is None else (q, q_out)  # placeholders when there is no q (never read or written)
        qn = k_norm if q_norm is None else q_norm
        qn = qn if qn is not None else cos
        kn = k_norm if k_norm is not None else cos
        _rope_append_kernel[(n,)](
            qq, k, v, qo, cos, sin, qn, kn, k_cache, v_cache, slots, positions,
            qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), qo.stride(0),
            qo.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            max(heads, 1), hkv, d, eps,
            HAS_Q=q is not None, HAS_NORM=k_norm is not None,
            BLOCK_H=triton.next_power_of_2(max(heads, 1)), BLOCK_HKV=triton.next_power_of_2(hkv),
            BLOCK_D=triton.next_power_of_2(d), num_warps=4,
        )
    return q_out


def silu_mul(gate_up: Tensor, *, backend: str = "auto") -> Tensor:
    """``silu(gate) · up`` for a fused ``[N, 2I]`` row ``[gate | up]`` → ``[N, I]`` (HF's rounding)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    if resolve_backend(backend, gate_up) == "torch":
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    _rows(gate_up, "gate_up")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                         BLOCK=block, num_warps=4)
    return out
