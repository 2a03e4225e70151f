"""Row invariance of the target's kernels: a token's row computed alone equals, bit for bit, the same row computed in
a block of other rows (the other requests of a batch, or the other tokens of its own verify).

This is what exact greedy decoding in bfloat16 rests on: a speculative step must compute each token's logits with the
same reduction order as a plain step, or the first bit that differs can change an argmax (docs/numerics.md). Run under
the Triton interpreter on the CPU (``TRITON_INTERPRET=1``), and compiled on the GPU by tests/equivalence/test_gpu.py
(the interpreter runs ``tl.dot`` through NumPy, whose products need not follow the GPU's order). The projections are
row-invariant with ``row_invariant=True`` (one ``tl.dot`` tile shape at every size; by default up to
``optimized.kernels.linear.ROW_LOOP_ROWS`` rows take the row loop, larger steps ``tl.dot`` tiles: each is
row-invariant alone, the switch between them is not), and so is the attention (one tile shape for every step).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from optimized.kernels.layout import HAS_TRITON

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED),
                                reason="Triton kernels on CPU need TRITON_INTERPRET=1 (the CI command sets it)")
DTYPES = [torch.float32, torch.bfloat16]
K, N = 96, 40  # a projection's input and output widths (small: the interpreter is slow)


@pytest.fixture(autouse=True)
def _interpreted_dot_by_row(monkeypatch):
    """The interpreter's ``tl.dot`` with each row of the tile multiplied on its own.

    The interpreter hands a whole tile to ``np.matmul``, and OpenBLAS's float32 GEMM sums a row's products in an order
    that can depend on where the row sits in the matrix (on a 2-core AVX2 machine rows 0–5 of a 16-row tile round
    one way, rows 6–15 another): a row alone, at the top of its tile, then differs in its last bit from the same row
    seventh in a block. The GPU's matrix instructions treat every row of a tile alike, which is the property these
    tests stand for; a product per row, the same call for every row, models it on the CPU."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data  # [M, K], [K, N]
        rows = [np.matmul(a_data[i:i + 1], b_data, dtype=d.data.dtype) for i in range(a_data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    if hasattr(interpreter, "InterpreterBuilder"):
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


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
@pytest.mark.parametrize("block", [2, 8, 16, 40, 200])
@pytest.mark.parametrize("gated", [False, True])
def test_fused_projection_row_alone_equals_the_row_in_a_block(dtype, block, gated):
    """The fused add + norm + projection with ``row_invariant`` gives every row the same bits alone, in a two-row step
    (a plain step's size), in an 8- or 16-row block (a verify's), across three 16-row tiles and in a 200-row step (a
    prefill chunk's): one tile shape at every size, the row alone in a tile of zeros included."""
    from optimized.kernels.linear import norm_linear

    x, weight, gain = _rows(dtype, m=max(64, block))
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


def target_logits(row_invariant: bool, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny target's logits for the 8 tokens after a prompt, computed as 8 one-token steps (plain decoding) in slot
    0 and as one 8-token block (a verify) in slot 1, with every op on its Triton kernel (also used on the GPU by
    tests/equivalence/test_gpu.py)."""
    from optimized.models.target import OptimizedTarget
    from reference.testing import tiny_hf_model

    target = OptimizedTarget(tiny_hf_model("llama", num_layers=2).to(device=device, dtype=dtype),
                             attention_backend="triton", row_invariant=row_invariant)
    target.allocate_cache(2, 32)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 96, (5,), generator=gen).to(device)
    block = torch.randint(2, 96, (8,), generator=gen).to(device)

    def step(tokens, start, slot):
        n = tokens.shape[0]
        i32 = dict(dtype=torch.int32, device=device)
        logits, _ = target.forward(tokens, torch.arange(start, start + n, device=device), torch.tensor([0, n], **i32),
                                   torch.tensor([start + n], **i32), torch.tensor([slot], **i32), max_q_len=n)
        return logits  # [n, V]

    step(prompt, 0, 0), step(prompt, 0, 1)  # the same prompt in both slots
    plain = torch.cat([step(block[i:i + 1], 5 + i, 0) for i in range(8)])  # [8, V]
    verify = step(block, 5, 1)  # [8, V]
    return plain, verify


def logits_beside_a_prefill(row_invariant: bool, dtype: torch.dtype, device: str = "cpu"
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny target's logits for one decoded token, computed in a step of its own (``max_q_len`` 1, a plain step of
    batch 1) and in a step beside another request's 40-token prefill chunk (``max_q_len`` 40: the engine's mixed
    steps, where the attention's tile shape would follow the longest query). Also used on the GPU."""
    from optimized.models.target import OptimizedTarget
    from reference.testing import tiny_hf_model

    target = OptimizedTarget(tiny_hf_model("llama", num_layers=2).to(device=device, dtype=dtype),
                             attention_backend="triton", row_invariant=row_invariant)
    target.allocate_cache(3, 64)
    gen = torch.Generator().manual_seed(4)
    prompt, other = torch.randint(2, 96, (5,), generator=gen), torch.randint(2, 96, (40,), generator=gen)
    token = torch.randint(2, 96, (1,), generator=gen)
    i32 = dict(dtype=torch.int32, device=device)

    def step(tokens, positions, cu, kv_lens, slots, max_q_len):
        logits, _ = target.forward(tokens.to(device), positions.to(device), torch.tensor(cu, **i32),
                                   torch.tensor(kv_lens, **i32), torch.tensor(slots, **i32), max_q_len=max_q_len)
        return logits

    for slot in (0, 1):  # the same prompt in two slots
        step(prompt, torch.arange(5), [0, 5], [5], [slot], 5)
    alone = step(token, torch.tensor([5]), [0, 1], [6], [0], 1)[0]  # [V]
    mixed = step(torch.cat((token, other)), torch.cat((torch.tensor([5]), torch.arange(40))), [0, 1, 41], [6, 40],
                 [1, 2], 40)[0]  # [V]: the token's row; the prefill's 40 rows follow it
    return alone, mixed


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoded_tokens_logits_do_not_depend_on_a_prefill_beside_it(dtype):
    """With ``row_invariant`` a decoded token gets the same logits, bit for bit, in a step of its own and beside
    another request's prefill chunk: the attention takes one tile shape whatever the step's longest query."""
    alone, mixed = logits_beside_a_prefill(True, dtype)
    assert torch.equal(alone, mixed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_logits_of_a_verify_block_are_plain_decodings(dtype):
    """With ``row_invariant`` the target gives a token the same logits, bit for bit, in a verify block of 8 as in a
    plain step of one: every projection and the LM head on one tile shape, the attention on one tile shape, and the
    norms and RoPE a row per program. This is what makes speculative greedy decoding exact in bfloat16."""
    plain, verify = target_logits(True, dtype)
    assert torch.equal(plain, verify)


def test_bfloat16_engine_with_row_invariance_speculates_plain_decodings_tokens():
    """The engine with ``EngineConfig.batch_invariant``, bfloat16, every op on Triton (the interpreter): greedy
    fixed-K and adaptive speculation emit plain decoding's tokens (the target-level test above is the bit-level
    guarantee; this runs it through the engine's verify and plain steps, drafts and batches of two)."""
    from optimized.engine import Engine, EngineConfig, SamplingParams
    from reference.config import SchedulerConfig
    from reference.cost_model import CostTable
    from reference.target import Target
    from reference.testing import tiny_drafter, tiny_hf_model

    model = tiny_hf_model("llama", num_layers=2)
    drafter = tiny_drafter(Target.from_model(model), gamma=3, seed=0, noise=0.2)
    model.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    target = Target.from_model(model)
    drafter.attach_target(target.embed_tokens, target.lm_head)
    cost = CostTable.affine(fixed_ms=1.0, per_token_ms=0.01, draft_fixed_ms=0.2, sizes=list(range(1, 17)))
    out = {}
    for mode in ("none", "fixed", "adaptive"):
        cfg = EngineConfig(max_num_seqs=2, max_seq_len=48, kernel_backend="triton", dtype=torch.bfloat16,
                           batch_invariant=True, seed=1)
        engine = Engine(target, drafter if mode != "none" else None, cfg, SchedulerConfig(mode=mode, k=3), cost)
        for rid, prompt in enumerate([[5, 9, 3, 17], [60, 2]]):
            engine.add_request(prompt, SamplingParams(max_new_tokens=7, ignore_eos=True), request_id=rid)
        while engine.has_unfinished():
            engine.step()
        out[mode] = [engine.sequence(rid).output_ids for rid in range(2)]
    assert out["fixed"] == out["none"] and out["adaptive"] == out["none"]
