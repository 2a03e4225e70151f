"""Varlen attention over per-slot KV caches: the attention of every target verify/prefill step and of the drafter.

Implements the attention of docs/method.md §1 (drafter block: non-causal over context + block) and §4 (target verify of
``[x_0, x_1..x_ℓ]``: causal). Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix
survival, ``ℓ`` verify length, ``γ`` block size).

The math, per request ``r`` with ``q_len_r = cu_seqlens_q[r+1] - cu_seqlens_q[r]`` queries and ``kv_len_r``
visible keys (the new tokens' keys are already written to the cache)::

    pos(i)  = kv_len_r - q_len_r + i                     absolute position of query i (0-based)
    keys(i) = {0..pos(i)} if causal else {0..kv_len_r-1}
    o_i     = softmax(scale · q_i · K[keys(i)]ᵀ) · V[keys(i)]

with K, V read from ``k_cache[slot_ids[r]]``. Grouped-query attention: query head ``h`` reads key/value head
``h // (H / Hkv)``.

Two implementations with one signature:

* ``_varlen_attention_kernel`` (Triton): one program per (request, KV head, query tile). The tile packs the
  ``G = H / Hkv`` query heads that share a KV head into its rows (row = query · G + head-in-group), so each key
  tile is loaded once per KV head instead of once per query head: decode attention is bound by reading the
  cache, and G is 3 (SmolLM2) to 4 (Qwen3-8B). It loops over key tiles with an online softmax and fp32
  accumulators. Every per-request length is read from device tensors; the grid depends only on host constants
  (R, Hkv, and the upper bound ``max_q_len``), so it is CUDA-graph capturable. Programs whose tile starts past
  their request's ``q_len`` exit at once, so padded rows (``q_len = 0``) cost one launch slot and compute nothing.
  One extra row of programs (``r = R``) writes the zeros of the rows past ``cu_seqlens_q[R]``, so the output needs
  no zero-fill launch before the kernel (one fewer node per layer in a CUDA graph).
* ``_varlen_attention_torch``: per-request masked SDPA in fp32. It reads the lengths on the host, so it is the
  CPU path (there the "device" is the host) and never runs under a CUDA graph.

Output rows that belong to no request (tokens past ``cu_seqlens_q[R]``) are zero in both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # Triton is optional on CPU machines; the torch path needs nothing else.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _varlen_attention_kernel(
        q_ptr,  # [N, H, D] queries, last dim contiguous
        k_ptr,  # [S, T, Hkv, D] key cache of one layer
        v_ptr,  # [S, T, Hkv, D] value cache of one layer
        o_ptr,  # [N, H, D] output; every row is written (rows of no request get zeros)
        cu_ptr,  # [R + 1] int32 query start offsets, non-decreasing
        kv_len_ptr,  # [R] int32 visible keys per request (the new tokens included)
        slot_ptr,  # [R] int32 cache slot of each request
        stride_qn, stride_qh,  # q strides (elements) over tokens and heads
        stride_ks, stride_kt, stride_kh,  # k cache strides over slots, positions, heads
        stride_vs, stride_vt, stride_vh,  # v cache strides over slots, positions, heads
        stride_on, stride_oh,  # o strides over tokens and heads
        num_requests,  # R: programs with r = R zero the rows past cu[R]
        num_tokens,  # N
        qk_scale,  # softmax scale · log2(e): the kernel works in base 2 (exp2 is the fast instruction)
        GROUP: tl.constexpr,  # G = H / Hkv query heads per KV head
        CAUSAL: tl.constexpr,  # causal (target verify/prefill) or full (drafter block) visibility
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two
        BLOCK_M: tl.constexpr,  # rows per program: (queries per tile) · G, rounded to a power of two
        BLOCK_N: tl.constexpr,  # keys per inner iteration
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact-ish), "tf32" otherwise (ignored for 16-bit)
    ):
        r = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        QUERIES_PER_TILE: tl.constexpr = BLOCK_M // GROUP
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM

        if r == num_requests:  # the rows of no request (a graph bucket's padding): zeros, strided over the tiles
            head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
            zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(o_ptr.dtype.element_ty)
            step = tl.num_programs(2) * QUERIES_PER_TILE
            for first in range(tl.load(cu_ptr + num_requests) + tile * QUERIES_PER_TILE, num_tokens, step):
                token = (first + rows // GROUP).to(tl.int64)  # [BLOCK_M]
                ok = (rows < QUERIES_PER_TILE * GROUP) & (token < num_tokens)
                tl.store(o_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :], zeros,
                         mask=ok[:, None] & dim_ok[None, :])
            return

        q_start = tl.load(cu_ptr + r)
        q_len = tl.load(cu_ptr + r + 1) - q_start
        first_q = tile * QUERIES_PER_TILE
        if first_q >= q_len:  # padded request row, or a tile past this request's queries
            return
        kv_len = tl.load(kv_len_ptr + r)
        slot = tl.load(slot_ptr + r).to(tl.int64)

        q_idx = first_q + rows // GROUP  # [BLOCK_M] query index inside the request
        head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
        row_ok = (rows < QUERIES_PER_TILE * GROUP) & (q_idx < q_len)
        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        q_pos = kv_len - q_len + q_idx  # [BLOCK_M] absolute position of each row's query

        if CAUSAL:  # the last query of the tile sees the most keys
            last_q = tl.minimum(first_q + QUERIES_PER_TILE, q_len) - 1
            key_end = kv_len - q_len + last_q + 1
        else:
            key_end = kv_len

        k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
        v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (base-2 logits)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running numerator · V
        for key_start in range(0, key_end, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            key_ok = keys < key_end
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + keys[:, None] * stride_kt + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_base + keys[:, None] * stride_vt + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
            visible = key_ok[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            # Key 0 lies in the first tile and every valid row sees it, so m_new is finite from the first
            # iteration on and exp2(-inf - m_new) = 0 for masked keys (no NaN from -inf - -inf).
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Rows masked out (row_ok false) still ran on zero queries; their l_i > 0 keeps the division finite.
        o = acc / l_i[:, None]
        tl.store(o_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _check_inputs(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids) -> None:
    """Shape/dtype validation that needs no device sync (values are trusted: checking them would sync)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [N, H, D] and k/v caches [S, T, Hkv, D] of one shape, got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"head dims differ or H={num_heads} is not a multiple of Hkv={num_kv_heads}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_requests = kv_lens.shape[0]
    if cu_seqlens_q.shape != (num_requests + 1,) or slot_ids.shape != (num_requests,):
        raise ValueError(f"expected cu_seqlens_q [R+1] and kv_lens, slot_ids [R]; got {tuple(cu_seqlens_q.shape)}, "
                         f"{tuple(kv_lens.shape)}, {tuple(slot_ids.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("kv_lens", kv_lens), ("slot_ids", slot_ids)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head) dimension")


def _varlen_attention_triton(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids, causal, scale, max_q_len, out,
                             row_invariant=False):
    num_tokens, num_heads, head_dim = q.shape
    num_requests = kv_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_tokens == 0:
        return torch.empty_like(q) if out is None else out
    if num_requests == 0:
        return torch.zeros_like(q) if out is None else out.zero_()
    o = torch.empty_like(q) if out is None else out  # [N, H, D]; the kernel writes every row
    # Tile sizes: 16 is tl.dot's minimum M/N/K. A tile holds up to 64 (query, head) rows: decode/verify steps
    # (max_q_len ≤ γ+1 = 8, G ≤ 8) fit in one tile, long prefill chunks split into 64-row tiles so the
    # accumulator stays in registers (64 × D fp32).
    # With row_invariant every step takes the prefill shape (64-row tiles, 4 warps), whatever its max_q_len: the
    # tile shape picks the matrix instructions and how a row's scores are spread over the threads, hence the order
    # of its sums, so one shape for every step gives a query the same bits alone, in a verify block or beside a
    # prefill chunk. A step's other requests never share its programs, and the key tiles are aligned to BLOCK_N
    # from key 0, so a tile that holds later queries only adds fully masked key tiles: exact no-ops (α = 1, p = 0).
    tile_q_len = 64 if row_invariant else max_q_len
    block_m = max(16, triton.next_power_of_2(group * max(1, min(tile_q_len, 64 // group or 1))))
    block_n, num_warps = _key_tile(head_dim, block_m, tile_q_len)
    num_stages = 3
    if q.dtype == torch.float32:
        # fp32 tiles are twice the bytes and the ieee dot runs on FMAs, whose operands are staged in shared
        # memory: 128-key tiles over 3 stages need ~180 KB of the H200's 227 KB (sm_90 compile, triton 3.9),
        # so fp32 (the exactness runs, not serving) takes 64-key tiles over 2 stages (≤ 64 KB).
        block_n, num_stages = 64, 2
    queries_per_tile = block_m // group
    # One more request row of programs zeroes the rows of no request (see the kernel).
    grid = (num_requests + 1, num_kv_heads, triton.cdiv(max(max_q_len, 1), queries_per_tile))
    _varlen_attention_kernel[grid](
        q, k_cache, v_cache, o, cu_seqlens_q, kv_lens, slot_ids,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o.stride(0), o.stride(1),
        num_requests, num_tokens,
        scale * math.log2(math.e),
        GROUP=group, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return o


def _key_tile(head_dim: int, block_m: int, max_q_len: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) from a sweep on one H200 (sm_90, triton 3.6, bf16; BLOCK_N ∈ {32, 64, 128} × warps ∈
    {4, 8} × stages ∈ {2, 3}): D = 64 (SmolLM2) prefers 128-key tiles (R=64, 8 queries, 1024 keys: 42.7 → 29.9 µs,
    with 8 warps once the tile has ≥ 32 rows); D = 128 (Qwen3-8B shape) is best at 64 keys and 4 warps (72 µs,
    3.7 TB/s). Re-sweep for other devices (e.g. B300, sm_100) and key the table by capability then.
    """
    if head_dim <= 64:
        return 128, (8 if block_m >= 32 and max_q_len <= 16 else 4)
    return 64, 4


def _varlen_attention_torch(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids, causal, scale, out):
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    o = torch.zeros_like(q) if out is None else out.zero_()  # [N, H, D]
    # sync: the per-request loop needs the lengths on the host; this is the CPU path, where host and device are
    # the same memory, and it is never captured in a CUDA graph (the Triton kernel is).
    cu, kv, slots = cu_seqlens_q.tolist(), kv_lens.tolist(), slot_ids.tolist()  # sync: CPU path only, never graphed
    for r, (kv_len, slot) in enumerate(zip(kv, slots)):
        start, q_len = cu[r], cu[r + 1] - cu[r]
        if q_len == 0:
            continue
        if not 0 < q_len <= kv_len <= k_cache.shape[1]:
            raise ValueError(f"request {r}: need 0 < q_len ({q_len}) ≤ kv_len ({kv_len}) ≤ cache length "
                             f"({k_cache.shape[1]})")
        q_r = q[start:start + q_len].transpose(0, 1).float()  # [H, q_len, D]
        k_r = k_cache[slot, :kv_len].transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, kv_len, D]
        v_r = v_cache[slot, :kv_len].transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, kv_len, D]
        mask = None
        if causal:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)  # [q_len]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, kv_len]
        o_r = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=mask, scale=scale)  # [H, q_len, D]
        o[start:start + q_len] = o_r.transpose(0, 1).to(q.dtype)
    return o


def varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    max_q_len: int | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    row_invariant: bool = False,
) -> torch.Tensor:
    """Attention of packed ragged queries against per-slot KV caches.

    Args:
        q: ``[N, H, D]`` queries of all requests, packed request after request.
        k_cache: ``[S, T, Hkv, D]`` key cache of one layer (slot, position, head, dim); the new tokens' keys
            are already written at their positions.
        v_cache: ``[S, T, Hkv, D]`` value cache, laid out like ``k_cache``.
        cu_seqlens_q: ``[R + 1]`` int32 query offsets; request r owns rows ``cu[r]..cu[r+1]-1``. Padded request
            rows have length 0 (offset repeated).
        kv_lens: ``[R]`` int32 keys visible to request r, its new tokens included (so ``q_len ≤ kv_len``).
        slot_ids: ``[R]`` int32 cache slot of each request.
        causal: query i of request r sees keys ``0..kv_len-q_len+i`` if True, all ``kv_len`` keys if False.
        scale: softmax scale (usually ``D ** -0.5``).
        max_q_len: host-side upper bound on every ``q_len`` (sizes the Triton grid: keep it constant under CUDA
            graphs, e.g. γ+1 for verify steps); ``None`` uses N, always a valid bound.
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA tensors, torch otherwise).
        out: optional ``[N, H, D]`` buffer of q's dtype and device to write into; every row of it is written.
        row_invariant: Triton only: one tile shape for every step (the prefill one), so that a query's output is
            the same bits whatever ``max_q_len`` and the other requests of its step (slower for decode steps).

    Returns:
        ``[N, H, D]`` attention output in q's dtype (``out`` when given); rows that belong to no request are zero.
    """
    _check_inputs(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if backend == "auto":
        backend = "triton" if (q.is_cuda and HAS_TRITON) else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' but triton is not installed (pip install triton)")
        bound = q.shape[0] if max_q_len is None else int(max_q_len)
        return _varlen_attention_triton(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids, causal, scale, bound,
                                        out, row_invariant)
    if backend == "torch":
        return _varlen_attention_torch(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids, causal, scale, out)
    raise ValueError(f"unknown attention backend {backend!r}; choose 'auto', 'triton' or 'torch'")
