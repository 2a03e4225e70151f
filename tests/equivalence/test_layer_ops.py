"""Equivalence of the fused layer ops (``optimized.kernels.layer_ops``) with their torch definitions, which round like
HF's eager Llama/Qwen code (tests/equivalence/test_models.py ties the torch path to HF itself).

The Triton kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by the CI command);
without it those cases skip. Tolerances: float32 differs only in the order of the RMS sum and in exp/rsqrt's last
bit (~1e-6 relative); fp16/bf16 outputs are rounded to the dtype after the same operations as the torch path, so
they agree to one ulp of the output where such a float32 bit decides the rounding. One interpreter artefact:
Triton's interpreter rounds float32 → bfloat16 toward zero (the GPU rounds to nearest even), so on the CPU bf16
outputs differ by up to an ulp in many elements; the bit-for-bit check of bf16 runs in the ``gpu`` tests.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.layer_ops import (
    HAS_TRITON,
    rms_norm,
    rms_norm_torch,
    rope_append_kv,
    rope_cos_sin,
    rope_lookup,
    rope_table,
    silu_mul,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED), reason="Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def close(actual, expected, dtype, scale=1.0, mostly_identical=True):
    """Equal up to about one output ulp (relative to the tensor's magnitude), and (by default) mostly bit-identical."""
    tol = 2 * ULP[dtype] * scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * expected.float().abs().max().item(),
                               rtol=tol)
    if mostly_identical and (dtype == torch.float16 or (dtype == torch.bfloat16 and actual.is_cuda)):
        # the rounding points are the same, so nearly every element is bit-identical
        assert (actual == expected).float().mean() > 0.97


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    n, d = 5, 96  # d not a power of two: masked tail
    x = (torch.randn(n, d, generator=g) * 3).to(dtype)
    res = torch.randn(n, d, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    y, total = rms_norm(x, w, 1e-6, res, backend="triton")
    y_ref, total_ref = rms_norm(x, w, 1e-6, res, backend="torch")
    if dtype != torch.bfloat16 or total.is_cuda:  # the interpreter's bf16 rounding: see the module docstring
        assert torch.equal(total, total_ref)  # the residual add rounds identically
    close(total, total_ref, dtype)
    close(y, y_ref, dtype)
    if not with_residual:
        assert total is x  # no copy of the input when there is nothing to add


@needs_interpreter
def test_rms_norm_reads_strided_rows():
    """Row views of a wider tensor (the engine's static buffers, gathered rows) need no contiguous copy."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 80, generator=g)
    x = wide[:, 8:72]  # row stride 80, last dim contiguous
    w = torch.randn(64, generator=g)
    y, _ = rms_norm(x, w, 1e-5, backend="triton")
    close(y, rms_norm_torch(x, w, 1e-5), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("with_q", [True, False])
def test_rope_append_kv_matches_torch(dtype, qk_norm, with_q):
    g = torch.Generator().manual_seed(2)
    n, heads, kv_heads, d, slots, length = 6, 6, 2, 16, 3, 12
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)  # one fused projection row per token
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)  # strided views, as in a layer
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.tensor([0, 1, 5, 3, 11, 0])
    slot_ids = torch.tensor([0, 0, 1, 2, 2, 3])  # slot 3 = the trash slot
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    qn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None
    caches = {}
    for backend in ("triton", "torch"):
        kc = torch.zeros(slots + 1, length, kv_heads, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        q_out = rope_append_kv(q if with_q else None, k, v, cos, sin, kc, vc, slot_ids, positions, qn, kn, 1e-6,
                               backend=backend)
        caches[backend] = (q_out, kc, vc)
    (q_tri, k_tri, v_tri), (q_ref, k_ref, v_ref) = caches["triton"], caches["torch"]
    assert torch.equal(v_tri, v_ref)  # a copy
    close(k_tri, k_ref, dtype, scale=2)
    if with_q:
        assert q_tri.shape == (n, heads, d) and q_tri.is_contiguous()
        close(q_tri, q_ref, dtype, scale=2)
    else:
        assert q_tri is None and q_ref is None
    untouched = torch.ones(slots + 1, length, dtype=torch.bool)
    untouched[slot_ids, positions] = False
    assert (k_tri[untouched] == 0).all() and (v_tri[untouched] == 0).all()  # nothing else written


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2 * 1500, generator=g) * 4).to(dtype)  # 1500: two column blocks, a masked tail
    out = silu_mul(gate_up, backend="triton")
    close(out, silu_mul(gate_up, backend="torch"), dtype)


def test_torch_paths_are_the_hf_building_blocks():
    """The torch path is HF's arithmetic, spelled out (so the kernels above are compared with HF's rounding)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(32, generator=g).to(torch.bfloat16)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6, backend="torch")[0], expected)
    gate_up = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(silu_mul(gate_up, backend="torch"),
                       torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:])


def test_bad_inputs_fail_with_names():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8), 1e-6, torch.randn(2, 4), backend="torch")
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(4), 1e-6, backend="torch")
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.randn(2, 7), backend="torch")
    with pytest.raises(ValueError, match="unknown layer-op backend"):
        silu_mul(torch.randn(2, 8), backend="cuda")
    k = torch.randn(3, 1, 4)
    cache = torch.zeros(2, 4, 1, 4)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rope_append_kv(k, k, k, torch.ones(3, 4), torch.zeros(3, 4), cache, cache.clone(), torch.zeros(3).long(),
                       torch.arange(3), q_norm=torch.ones(4), backend="torch")
    with pytest.raises(ValueError, match="shapes disagree"):
        rope_append_kv(None, k, k, torch.ones(2, 4), torch.zeros(2, 4), cache, cache.clone(), torch.zeros(3).long(),
                       torch.arange(3), backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_ops_round_like_torch_on_cuda(dtype):
    """On the GPU (round-to-nearest casts) the fused kernels are nearly bit-identical to the torch chain."""
    g = torch.Generator(device="cuda").manual_seed(5)
    n, d, heads, kv_heads, D = 64, 576, 9, 3, 64
    x, res = (torch.randn(n, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).to(dtype)
    y, total = rms_norm(x, w, 1e-5, res, backend="triton")
    y_ref, total_ref = rms_norm(x, w, 1e-5, res, backend="torch")
    assert torch.equal(total, total_ref)
    close(y, y_ref, dtype)
    gate_up = (torch.randn(n, 2 * 1536, generator=g, device="cuda") * 4).to(dtype)
    close(silu_mul(gate_up, backend="triton"), silu_mul(gate_up, backend="torch"), dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * D, generator=g, device="cuda").to(dtype)
    q, k, v = (t.view(n, -1, D) for t in qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1))
    pos = torch.arange(n, device="cuda")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    cos, sin = rope_cos_sin(pos, inv_freq, 1.0, dtype)
    outs = []
    for backend in ("triton", "torch"):
        kc = torch.zeros(2, n, kv_heads, D, dtype=dtype, device="cuda")
        vc = torch.zeros_like(kc)
        outs.append((rope_append_kv(q, k, v, cos, sin, kc, vc, torch.zeros_like(pos), pos, backend=backend), kc, vc))
    # RoPE on sm_90 (Triton 3.6, 2026-11-29): 83% (bf16) / 80% (fp16) of the outputs were bit-identical and the rest
    # one ulp apart — the compiled kernel evidently keeps q·cos unrounded into the sum (one rounding where HF's eager
    # chain has three), which the interpreter does not. fp32 is unaffected (GPU equivalence: 48/48 identical), so the
    # GPU check of RoPE is the one-ulp bound only.
    close(outs[0][0], outs[1][0], dtype, scale=2, mostly_identical=False)
    close(outs[0][1], outs[1][1], dtype, scale=2, mostly_identical=False)
    assert torch.equal(outs[0][2], outs[1][2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_rope_table_rows_are_the_step_tables(dtype, device):
    """A gather from the table of every cache position gives exactly the bits of computing the step's tables (the
    models take their RoPE tables from it), for positions in any order, repeated, and at either end of the table."""
    head_dim, positions = 64, 3000
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    table = rope_table(positions, inv_freq, 1.25, dtype)
    assert table.shape == (positions, 2 * head_dim) and table.dtype == dtype
    pos = torch.tensor([0, 2999, 17, 17, 1024, 5, 2048, 1], device=device)
    cos, sin = rope_lookup(table, pos)
    want_cos, want_sin = rope_cos_sin(pos, inv_freq, 1.25, dtype)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1  # the layout the RoPE kernel takes


@needs_interpreter
def test_rope_append_refuses_strided_slots():
    """The kernel reads slots and positions as arrays: a stride-0 view (an expanded slot) is an error, not a write
    at another token's coordinates."""
    n, hkv, d = 4, 2, 8
    k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    cos, sin = torch.ones(n, d), torch.zeros(n, d)
    k_cache, v_cache = torch.zeros(2, 16, hkv, d), torch.zeros(2, 16, hkv, d)
    slots = torch.zeros(1, dtype=torch.long).expand(n)  # stride 0
    with pytest.raises(ValueError, match="contiguous"):
        rope_append_kv(None, k, v, cos, sin, k_cache, v_cache, slots, torch.arange(n), backend="triton")
