"""Row invariance of the target's kernels: a token's row computed alone equals, bit for bit, the same row computed in
a block of other rows (the other requests of a batch, or the other tokens of its own verify).

This is what exact greedy decoding in bfloat16 rests on: a speculative step must compute each token's logits with the
same reduction order as a plain step, or the first bit that differs can change an argmax (docs/numerics.md). Run under
the Triton interpreter on the CPU (``TRITON_INTERPRET=1``). The interpreter runs ``tl.dot`` through NumPy, whose
matrix products may pick their own order by shape: the tests below that hold here are the kernels whose reduction
does not depend on the block. The projections are row-invariant with ``row_invariant=True`` (their row loop at any
size; by default up to ``optimized.kernels.linear.ROW_LOOP_ROWS`` rows, larger steps taking ``tl.dot`` tiles, whose
order depends on the block).
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.layout import HAS_TRITON

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED),
                                reason="Triton kernels on CPU need TRITON_INTERPRET=1 (the CI command sets it)")
DTYPES = [torch.float32, torch.bfloat16]
K, N = 96, 40  # a projection's input and output widths (small: the interpreter is slow)


def _rows(dtype: torch.dtype, m: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, K, generator=gen).to(dtype)  # [m, K]
    weight = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)  # [N, K]
    gain = (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)  # [K]
    return x, weight, gain


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [2, 8, 64])
def test_rms_norm_row_alone_equals_the_row_in_a_block(dtype, block):
    from optimized.kernels.layer_ops import rms_norm

    x, _, gain = _rows(dtype)
    alone, _ = rms_norm(x[:1], gain, 1e-5, backend="triton")  # [1, K]
    together, _ = rms_norm(x[:block], gain, 1e-5, backend="triton")  # [block, K]
    assert torch.equal(together[0], alone[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [2, 8, 16])
@pytest.mark.parametrize("gated", [False, True])
def test_fused_projection_row_alone_equals_the_row_in_a_block(dtype, block, gated):
    """The fused add + norm + projection with ``row_invariant`` gives every row the same bits alone, in a two-row step
    (a plain step's size) and in an 8- or 16-row block (a verify's): the row loop runs each row through the one-row
    arithmetic."""
    from optimized.kernels.linear import norm_linear

    x, weight, gain = _rows(dtype)
    residual = x.flip(0)  # [m, K] another stream for the residual add
    w = torch.cat([weight, weight.flip(1)]) if gated else weight  # [gate | up] when gated

    def project(rows: slice):
        return norm_linear(x[rows], w, norm_weight=gain, eps=1e-5, residual=residual[rows], gated=gated,
                           backend="triton", row_invariant=True)

    together, total = project(slice(0, block))
    for j in {0, block // 2, block - 1}:
        alone, alone_total = project(slice(j, j + 1))
        assert torch.equal(together[j], alone[0]) and torch.equal(total[j], alone_total[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_request_does_not_depend_on_the_other_requests(dtype):
    """A request's attention output is the same alone and beside requests of other lengths and other slots."""
    from optimized.kernels.attention import varlen_attention

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, length = 6, 2, 16, 96
    k_cache = torch.randn(3, length, kv_heads, dim, generator=gen).to(dtype)  # [S, T, Hkv, D]
    v_cache = torch.randn(3, length, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(12, heads, dim, generator=gen).to(dtype)  # [N, H, D]

    def attend(cu, kv, slots, max_q_len):
        i32 = torch.int32
        return varlen_attention(q[:cu[-1]], k_cache, v_cache, torch.tensor(cu, dtype=i32), torch.tensor(kv, dtype=i32),
                                torch.tensor(slots, dtype=i32), causal=True, scale=dim ** -0.5, max_q_len=max_q_len,
                                backend="triton")

    alone = attend([0, 4], [50], [1], 4)  # one request: 4 queries over 50 keys in slot 1
    batch = attend([0, 4, 5, 12], [50, 90, 20], [1, 0, 2], 7)  # the same request first, then two others
    assert torch.equal(batch[:4], alone)
