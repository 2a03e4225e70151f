"""Equivalence of ``optimized.kernels.attention.varlen_attention`` (Triton kernel and torch fallback) with a naive
float64 attention over the same ragged batch.

The Triton kernel runs on the CPU through Triton's interpreter; that needs ``TRITON_INTERPRET=1`` in the
environment before triton is imported (the CI command sets it), so those cases skip without it.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.attention import HAS_TRITON, varlen_attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED), reason="Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")

# Tolerances tied to the dtype's machine epsilon (fp16 2^-10, bf16 2^-7): the output is rounded once to the dtype
# and the kernel also rounds the softmax weights to the value dtype before the P·V product (as FlashAttention
# does), so a few ulps of O(1) outputs. fp32: the online softmax only reorders fp32 sums (~1e-7 relative).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4 * 2.0**-10, torch.bfloat16: 4 * 2.0**-7}


def naive_attention(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids, causal, scale):
    """Float64 attention, one request and one head at a time, masks spelled out."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for r in range(kv_lens.shape[0]):
        start, end, kv_len, slot = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1]), int(kv_lens[r]), int(slot_ids[r])
        for i in range(end - start):
            pos = kv_len - (end - start) + i
            visible = pos + 1 if causal else kv_len
            for h in range(q.shape[1]):
                k = k_cache[slot, :visible, h // group].double()  # [visible, D]
                v = v_cache[slot, :visible, h // group].double()
                w = torch.softmax(k @ q[start + i, h].double() * scale, dim=0)  # [visible]
                out[start + i, h] = w @ v
    return out


def ragged_case(num_heads, num_kv_heads, head_dim, q_lens, kv_lens, dtype, num_slots=6, cache_len=160,
                extra_rows=2, seed=0):
    """Random queries and caches; slots are a permutation so request r does not live in slot r."""
    g = torch.Generator().manual_seed(seed)
    n = sum(q_lens) + extra_rows  # extra rows belong to no request: they must come back zero
    q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_slots, cache_len, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, cache_len, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    slots = torch.randperm(num_slots, generator=g)[: len(q_lens)].to(torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), slots


# (H, Hkv, D, q_lens, kv_lens): verify-like steps (1..γ+1 queries, a padded zero-length row), a chunked prefill
# with several key tiles, and awkward shapes (G = 3 as in SmolLM2, D not a power of two).
CASES = [
    (4, 2, 16, [3, 0, 1, 8], [7, 0, 4, 8]),
    (6, 2, 24, [5, 2, 0], [5, 9, 3]),
    (4, 4, 16, [1, 1], [1, 33]),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_fallback_matches_naive(case, causal, dtype):
    q, k, v, cu, kv_lens, slots = ragged_case(*case, dtype=dtype)
    scale = case[2] ** -0.5
    out = varlen_attention(q, k, v, cu, kv_lens, slots, causal=causal, scale=scale, backend="torch")
    assert out.dtype == dtype and out.shape == q.shape
    expected = naive_attention(q, k, v, cu, kv_lens, slots, causal, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("row_invariant", [False, True])  # True: the one tile shape of EngineConfig.batch_invariant
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES + [(6, 2, 16, [40, 3], [150, 70])])  # 2 query tiles, 3 key tiles
def test_triton_kernel_matches_naive_fp32(case, causal, row_invariant):
    q, k, v, cu, kv_lens, slots = ragged_case(*case, dtype=torch.float32)
    scale = case[2] ** -0.5
    out = varlen_attention(q, k, v, cu, kv_lens, slots, causal=causal, scale=scale, backend="triton",
                           max_q_len=max(case[3]), row_invariant=row_invariant)
    expected = naive_attention(q, k, v, cu, kv_lens, slots, causal, scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=needs_interpreter), "torch",
    pytest.param("triton-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA device")])])
@pytest.mark.parametrize("extra_rows", [1, 21])  # 21 padding rows: more than one tile's queries per program
def test_rows_of_no_request_are_zeroed_in_a_dirty_buffer(backend, extra_rows):
    # Under a CUDA graph the output is whatever the pool held: the kernel itself must write the padding rows' zeros.
    case = ragged_case(*CASES[0], dtype=torch.float32, extra_rows=extra_rows)
    if backend == "triton-cuda":  # the compiled kernel (the interpreter runs the same code on the CPU)
        backend, case = "triton", tuple(t.cuda() for t in case)
    q, k, v, cu, kv_lens, slots = case
    dirty = torch.full_like(q, float("nan"))
    out = varlen_attention(q, k, v, cu, kv_lens, slots, causal=True, scale=0.25, backend=backend, max_q_len=8,
                           out=dirty)
    assert out is dirty
    expected = naive_attention(*(t.cpu() for t in case), True, 0.25)
    torch.testing.assert_close(out.double().cpu(), expected, atol=TOLERANCE[torch.float32],
                               rtol=TOLERANCE[torch.float32])
    assert torch.equal(out[int(cu[-1]):], torch.zeros_like(out[int(cu[-1]):]))
    with pytest.raises(ValueError, match="out must be"):
        varlen_attention(q, k, v, cu, kv_lens, slots, causal=True, scale=0.25, backend=backend, out=dirty[1:])


@needs_interpreter
def test_triton_kernel_fp16():
    # bf16 is checked on CUDA only (test below): the interpreter's tl.dot misreads bf16 operands (triton 3.9).
    case = CASES[0]
    q, k, v, cu, kv_lens, slots = ragged_case(*case, dtype=torch.float16)
    out = varlen_attention(q, k, v, cu, kv_lens, slots, causal=True, scale=0.25, backend="triton", max_q_len=8)
    expected = naive_attention(q, k, v, cu, kv_lens, slots, True, 0.25)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_kernel_on_cuda(dtype, causal):
    for case in CASES + [(6, 2, 16, [40, 3], [150, 70]), (32, 8, 128, [8, 0, 1, 5], [120, 0, 7, 77])]:
        q, k, v, cu, kv_lens, slots = ragged_case(*case, dtype=dtype)
        scale = case[2] ** -0.5
        out = varlen_attention(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), kv_lens.cuda(), slots.cuda(), causal=causal,
                               scale=scale, max_q_len=max(case[3]))
        expected = naive_attention(q, k, v, cu, kv_lens, slots, causal, scale)
        # fp32 on CUDA: "ieee" dot precision, so the fp32 tolerance holds (no TF32 rounding).
        torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_interpreter
def test_triton_grid_bound_larger_than_needed():
    """A static grid (max_q_len = N, far above every q_len) gives the same result: extra tiles exit early."""
    case = CASES[0]
    q, k, v, cu, kv_lens, slots = ragged_case(*case, dtype=torch.float32)
    tight = varlen_attention(q, k, v, cu, kv_lens, slots, causal=True, scale=0.25, backend="triton", max_q_len=8)
    loose = varlen_attention(q, k, v, cu, kv_lens, slots, causal=True, scale=0.25, backend="triton")
    assert torch.equal(tight, loose)


def test_bad_inputs_fail_fast():
    q, k, v, cu, kv_lens, slots = ragged_case(*CASES[0], dtype=torch.float32)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu.long(), kv_lens, slots, causal=True, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q[:, :3], k, v, cu, kv_lens, slots, causal=True, scale=1.0)
    with pytest.raises(ValueError, match=r"\[R\+1\]"):
        varlen_attention(q, k, v, cu[:-1], kv_lens, slots, causal=True, scale=1.0)
    with pytest.raises(ValueError, match="q_len"):
        varlen_attention(q, k, v, cu, torch.tensor([2, 0, 4, 8], dtype=torch.int32), slots, causal=True, scale=1.0,
                         backend="torch")
    with pytest.raises(ValueError, match="backend"):
        varlen_attention(q, k, v, cu, kv_lens, slots, causal=True, scale=1.0, backend="flash")
