"""Equivalence of the fused small-batch projections (``optimized.kernels.linear``) with their torch definition: the
layer ops' torch definitions (HF's rounding, tied to HF in test_models.py) composed with ``F.linear``.

The Triton kernel runs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by the CI command). Two
interpreter artefacts shape the CPU cases: it rounds float32 → bfloat16 toward zero (the GPU rounds to nearest even,
see test_layer_ops.py), and its ``tl.dot`` on bfloat16 operands returns garbage (triton 3.9), so bfloat16 runs the
row-loop kernel on the CPU and both kernels in the ``gpu`` cases, where the kernel is compiled. Tolerances: the kernel
and the definition round at the same points and differ only in float32 summation order (the RMS and the dot
products), so outputs agree to about one output ulp.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.layer_ops import HAS_TRITON
from optimized.kernels.linear import (
    FUSED_MAX_ROWS,
    ROW_LOOP_ROWS,
    fused_rows,
    kernel_config,
    linear,
    norm_linear,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED), reason="Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
on_gpu = [pytest.mark.gpu, pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()),
                                              reason="needs a CUDA device")]
EPS = 1e-5


def case(m, k, n, dtype, *, gated=False, norm=True, residual=True, bias=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * n if gated else n, k, generator=g) * k ** -0.5
    out = dict(x=x, weight=w,
               norm_weight=1 + 0.1 * torch.randn(k, generator=g) if norm else None,
               residual=torch.randn(m, k, generator=g) if residual else None,
               bias=0.1 * torch.randn(n, generator=g) if bias else None)
    return {key: None if t is None else t.to(device=device, dtype=dtype) for key, t in out.items()}


def check(dtype, y, y_ref, total, total_ref, bits_on_gpu=True):
    """About one output ulp apart (relative to the output's scale); the residual sum exact."""
    ulp = {torch.float32: 2e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    interpreted_bf16 = dtype == torch.bfloat16 and not y.is_cuda  # rounds toward zero: a few ulps, systematically
    tol = (8 if interpreted_bf16 else 2) * ulp
    scale = y_ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol * scale, rtol=tol)
    if not interpreted_bf16:
        assert torch.equal(total, total_ref)
    if y.is_cuda and bits_on_gpu and dtype != torch.float32:
        assert (y == y_ref).float().mean() > 0.9  # same rounding points: mostly the same bits


def run_both(kw, gated, config=None):
    y, total = norm_linear(**kw, eps=EPS, gated=gated, backend="triton", config=config)
    y_ref, total_ref = norm_linear(**kw, eps=EPS, gated=gated, backend="torch")
    return y, y_ref, total, total_ref


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 16, 21])  # row loop, tl.dot (3 and 21: masked rows)
@pytest.mark.parametrize("gated", [False, True])
def test_norm_linear_matches_torch(dtype, m, gated):
    if dtype == torch.bfloat16 and kernel_config(m, 40, 72, gated)["kernel"] == "dot":
        pytest.skip("the interpreter's tl.dot on bfloat16 is broken; compiled in test_gpu_bfloat16_bits")
    kw = case(m, 72, 40, dtype, gated=gated)  # K = 72 is not a tile multiple: masked tail
    check(dtype, *run_both(kw, gated))


@needs_interpreter
@pytest.mark.parametrize("norm,residual", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("m", [1, 16])
def test_flags_and_bias(norm, residual, m):
    kw = case(m, 40, 24, torch.float32, norm=norm, residual=residual, bias=not norm)
    y, y_ref, total, total_ref = run_both(kw, gated=False)
    check(torch.float32, y, y_ref, total, total_ref)
    if not residual:
        assert total is kw["x"]  # nothing added: no copy


@needs_interpreter
@pytest.mark.parametrize("config", [dict(kernel="rows", BLOCK_M=1, BLOCK_N=4, BLOCK_K=16, num_warps=1),
                                    dict(kernel="rows", BLOCK_M=4, BLOCK_N=8, BLOCK_K=32, num_warps=2),
                                    dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=32, num_warps=2),  # rows: BLOCK_M < 16
                                    dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4)])
def test_any_tiling_gives_the_same_result(config):
    """Tiles smaller than every dimension: several programs over rows and columns, several K steps."""
    kw = case(5, 50, 36, torch.float32, gated=True)
    check(torch.float32, *run_both(kw, True, config))


SPLIT_CASES = [dict(SPLIT_K=2), dict(SPLIT_K=3), dict(SPLIT_K=4, RMS_BLOCK_K=64), dict(RMS_BLOCK_K=64),
               dict(SPLIT_K=9)]  # 9 splits of 4 K tiles: some programs get no tile and add zeros


def split_config(extra):
    return dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, **extra)


@needs_interpreter
@pytest.mark.parametrize("extra", SPLIT_CASES, ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_split_k_and_whole_row_norm_tile(extra, gated):
    """K dealt out to several programs per output tile, their partials added by the last one in split order, and the
    norm's pass in one whole-row tile: the definition to float32 summation order, the residual sum exact, the same
    bits on every call (the reduction order does not depend on which program finishes last), and the ticket
    counters handed back at zero for the next launch."""
    from optimized.kernels import linear as module

    kw = case(5, 50, 36, torch.float32, gated=gated, bias=not gated)
    first = run_both(kw, gated, split_config(extra))
    check(torch.float32, *first)
    again, *_ = run_both(kw, gated, split_config(extra))
    assert torch.equal(first[0], again)
    assert all(int(t.abs().sum()) == 0 for t in module._TICKETS.values())


def test_dot_tiles_table_drives_the_default_launch():
    from optimized.kernels import linear as module

    saved = module.DOT_TILES
    try:
        module.set_dot_tiles(dict(saved, norm=dict(saved["norm"], BLOCK_K=64, split_k=4, rms_whole_row=True,
                                                   num_stages=2),
                                  plain=dict(saved["plain"], BLOCK_K=256, split_k=9)))
        cfg = kernel_config(8, 960, 576, False, norm=True)
        assert cfg == dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2, SPLIT_K=4,
                           RMS_BLOCK_K=1024)
        assert kernel_config(8, 576, 576, False)["SPLIT_K"] == 3  # no more programs than K tiles (576 / 256)
        big = kernel_config(FUSED_MAX_ROWS + 1, 960, 576, False, norm=True)  # above the fused steps: no split
        assert "SPLIT_K" not in big and "RMS_BLOCK_K" not in big
        assert kernel_config(8, 960, 576, False, row_invariant=True, norm=True).get("SPLIT_K", 1) == 1
        with pytest.raises(ValueError, match="kinds"):
            module.set_dot_tiles({"norm": saved["norm"]})
        with pytest.raises(ValueError, match="split_k"):
            module.set_dot_tiles(dict(saved, gated=dict(saved["gated"], split_k=0)))
        with pytest.raises(ValueError, match="powers of two"):
            module.set_dot_tiles(dict(saved, plain=dict(saved["plain"], BLOCK_N=24)))
    finally:
        module.DOT_TILES = saved


def test_dot_tiles_in_force_for_a_block_only():
    from optimized.kernels import linear as module

    saved = module.DOT_TILES
    table = dict(saved, plain=dict(saved["plain"], split_k=3))
    with pytest.raises(RuntimeError), module.dot_tiles_in_force(table):
        assert module.DOT_TILES == table and module.DOT_TILES is not table  # a checked copy, as set_dot_tiles
        assert kernel_config(8, 576, 576, False)["SPLIT_K"] == 3
        raise RuntimeError("a failing run")
    assert module.DOT_TILES is saved
    with module.dot_tiles_in_force(None):
        assert module.DOT_TILES is saved
    with pytest.raises(ValueError, match="kinds"), module.dot_tiles_in_force({"norm": saved["norm"]}):
        pass
    assert module.DOT_TILES is saved


def test_split_k_is_refused_with_row_invariance():
    if not (HAS_TRITON and (INTERPRETED or torch.cuda.is_available())):
        pytest.skip("the Triton path checks its config")
    kw = case(3, 32, 16, torch.float32, device="cpu" if INTERPRETED else "cuda")
    with pytest.raises(ValueError, match="SPLIT_K"):
        norm_linear(kw["x"], kw["weight"], backend="triton", row_invariant=True, config=split_config(dict(SPLIT_K=2)))
    with pytest.raises(ValueError, match="SPLIT_K"):
        norm_linear(kw["x"], kw["weight"], backend="triton", config=split_config(dict(SPLIT_K=0)))


@pytest.mark.parametrize("extra", [dict(SPLIT_K=2), dict(SPLIT_K=3, RMS_BLOCK_K=1024), dict(SPLIT_K=9)], ids=str)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("_", [pytest.param(None, marks=on_gpu)])
def test_gpu_split_k(extra, gated, _):
    """Compiled on the device at SmolLM2's widths, bf16, 8 rows (a K = 7 block): split K against the definition, the
    same bits on 20 calls in a row (the last program's reduction order is fixed, and its ticket read sees every
    partial), and the counters at zero afterwards."""
    from optimized.kernels import linear as module

    kw = case(8, 576, 1536 if gated else 960, torch.bfloat16, gated=gated, device="cuda")
    cfg = dict(kernel="dot", BLOCK_M=16, BLOCK_N=32 if gated else 16, BLOCK_K=64, num_warps=4, **extra)
    first = run_both(kw, gated, cfg)
    check(torch.bfloat16, *first)
    for _ in range(20):
        assert torch.equal(norm_linear(**kw, eps=EPS, gated=gated, backend="triton", config=cfg)[0], first[0])
    torch.cuda.synchronize()
    assert all(int(t.abs().sum()) == 0 for t in module._TICKETS.values())


@needs_interpreter
def test_reads_strided_rows():
    """Row views (the q columns of a fused q/k/v output, gathered rows) need no contiguous copy."""
    kw = case(3, 40, 24, torch.float32)
    wide = torch.randn(3, 100)
    wide[:, 10:50] = kw["x"]
    kw_strided = dict(kw, x=wide[:, 10:50])
    y, _ = norm_linear(**kw_strided, eps=EPS, backend="triton")
    y_ref, _ = norm_linear(**kw, eps=EPS, backend="torch")
    check(torch.float32, y, y_ref, y, y)
    assert torch.allclose(linear(wide[:, 10:50], kw["weight"], backend="triton"),
                          torch.nn.functional.linear(kw["x"], kw["weight"]), atol=1e-5)


def test_bad_inputs_name_the_problem():
    kw = case(2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        norm_linear(kw["x"], kw["weight"][:, :5])
    with pytest.raises(ValueError, match="gate"):
        norm_linear(kw["x"], kw["weight"][:3], gated=True)
    with pytest.raises(ValueError, match="residual is added only"):
        norm_linear(kw["x"], kw["weight"], residual=kw["x"])
    with pytest.raises(ValueError, match="norm_weight"):
        norm_linear(kw["x"], kw["weight"], norm_weight=torch.ones(3))
    with pytest.raises(ValueError, match="bias"):
        norm_linear(kw["x"], torch.ones(8, 8), torch.ones(8), gated=True)
    if HAS_TRITON and (INTERPRETED or torch.cuda.is_available()):  # the Triton path runs: its config is checked
        kw = case(2, 8, 4, torch.float32, device="cpu" if INTERPRETED else "cuda")
        with pytest.raises(ValueError, match="kernel"):
            norm_linear(kw["x"], kw["weight"], backend="triton",
                        config=dict(kernel="gemv", BLOCK_M=2, BLOCK_N=4, BLOCK_K=8, num_warps=1))


def test_torch_path_is_the_composition_of_the_layer_ops():
    from optimized.kernels.layer_ops import rms_norm, silu_mul

    kw = case(4, 16, 8, torch.float32, gated=True)
    y, total = norm_linear(**kw, eps=EPS, gated=True, backend="torch")
    h, total_ref = rms_norm(kw["x"], kw["norm_weight"], EPS, residual=kw["residual"], backend="torch")
    assert torch.equal(total, total_ref)
    assert torch.equal(y, silu_mul(torch.nn.functional.linear(h, kw["weight"]), backend="torch"))


def test_row_limit_and_configs():
    assert fused_rows(1) and fused_rows(FUSED_MAX_ROWS) and not fused_rows(FUSED_MAX_ROWS + 1)
    assert not fused_rows(0) and not fused_rows(4, limit=0) and fused_rows(40, limit=64)
    for gated in (False, True):
        one = kernel_config(1, 960, 576, gated)
        same_tile = ("kernel", "BLOCK_N", "BLOCK_K", "num_warps")
        for m in range(1, 65):
            cfg, invariant = kernel_config(m, 960, 576, gated), kernel_config(m, 960, 576, gated, row_invariant=True)
            # row invariance: one kernel and one tile at every size (the default's many-row tl.dot tiles), no split
            # of K; by default the row loop up to ROW_LOOP_ROWS rows, the whole row in one tile
            assert invariant == kernel_config(64, 960, 576, gated, row_invariant=True) and invariant["kernel"] == "dot"
            if m <= ROW_LOOP_ROWS:
                assert {key: cfg[key] for key in same_tile} == {key: one[key] for key in same_tile}
                assert cfg["kernel"] == "rows" and cfg["BLOCK_M"] >= m and cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 2048
            else:
                assert cfg["kernel"] == "dot" and cfg["BLOCK_M"] == invariant["BLOCK_M"] == 16


@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 37])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("_", [pytest.param(None, marks=on_gpu)])
def test_gpu_bfloat16_bits(m, gated, dtype, _):
    """Compiled on the device: SmolLM2's widths, both paths, bf16 mostly bit-identical to cuBLAS + the layer ops."""
    kw = case(m, 576, 1536 if gated else 960, dtype, gated=gated, device="cuda")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in the cuBLAS twin too
    try:
        check(dtype, *run_both(kw, gated))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@needs_interpreter
@pytest.mark.parametrize("m,row_invariant", [(1, False), (2, False), (8, False), (8, True)])
@pytest.mark.parametrize("op", ["qkv", "o", "gate_up", "down"])
def test_default_tiles_at_smollm2_widths(m, row_invariant, op):
    """The engine's own tiles at SmolLM2's input widths: the row loop's (one to four columns a program, the whole row
    of 576 or 1536 in one tile) for the steps the engine fuses, the broadcast tiles of an 8-row verify block, and its
    tl.dot tiles with row invariance (few output columns: the tiles depend on K, and the interpreter is slow; the full
    shapes run compiled in test_gpu_bfloat16_bits)."""
    k, n, gated, norm = {"qkv": (576, 15, False, True), "o": (576, 9, False, False),
                         "gate_up": (576, 12, True, True), "down": (1536, 9, False, False)}[op]
    kw = case(m, k, n, torch.float32, gated=gated, norm=norm, residual=norm)
    cfg = kernel_config(m, n, k, gated, row_invariant)
    if cfg["kernel"] == "rows":
        assert cfg["BLOCK_K"] >= k and cfg["BLOCK_N"] <= 4
    y, total = norm_linear(**kw, eps=EPS, gated=gated, backend="triton", row_invariant=row_invariant)
    y_ref, total_ref = norm_linear(**kw, eps=EPS, gated=gated, backend="torch")
    check(torch.float32, y, y_ref, total, total_ref)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("_", [pytest.param(None, marks=on_gpu)])
def test_gpu_projection_is_row_invariant(gated, dtype, _):
    """Compiled on the device at SmolLM2's widths, with ``row_invariant``: every row of a 2-, 8-, 16- or 40-row step,
    and of a step at either side of each bound of ``INVARIANT_TILES`` (another tile), has the bits it has alone (the
    CPU twin is tests/equivalence/test_row_invariance.py, under the interpreter)."""
    from optimized.kernels.linear import invariant_tile_table

    table = invariant_tile_table(torch.cuda.get_device_capability(), dtype)  # the table in force on this GPU
    bounds = [t["max_rows"] for t in table[:-1]]  # each tile of the table against a row alone (the first)
    kw = case(max([40] + [b + 1 for b in bounds]), 576, 1536 if gated else 960, dtype, gated=gated, device="cuda")

    def project(rows: slice):
        return norm_linear(**{key: v if v is None or v.dim() < 2 or key == "weight" else v[rows]
                              for key, v in kw.items()}, eps=EPS, gated=gated, backend="triton", row_invariant=True)

    for block in sorted({2, 8, 16, 40} | set(bounds) | {b + 1 for b in bounds}):
        together, total = project(slice(0, block))
        for j in range(block):
            alone, alone_total = project(slice(j, j + 1))
            assert torch.equal(together[j], alone[0]) and torch.equal(total[j], alone_total[0]), (block, j)


def test_invariant_tile_table_picks_by_step_size_and_checks_its_shape():
    """A row-invariant table of several tiles serves each step size from the first entry that covers it; a table that
    could leave a size unserved, or names tiles tl.dot cannot run, fails at once; the context restores the table."""
    from optimized.kernels import linear as lin

    before = lin.INVARIANT_TILES
    table = [dict(max_rows=64, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4),
             dict(max_rows=None, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8)]
    with lin.invariant_tiles(table):
        small, large = kernel_config(64, 960, 576, False, True), kernel_config(65, 960, 576, False, True)
        assert (small["BLOCK_M"], small["BLOCK_N"], small["BLOCK_K"]) == (16, 32, 256)
        assert (large["BLOCK_M"], large["BLOCK_N"], large["BLOCK_K"], large["num_warps"]) == (64, 64, 64, 8)
        assert kernel_config(1, 40, 48, True, True)["BLOCK_K"] == 64  # capped at the row's width, as ever
    assert lin.INVARIANT_TILES == before
    bad = [[],  # nothing serves any size
           [dict(max_rows=8, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4)],  # nothing past 8 rows
           [dict(max_rows=64, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4),
            dict(max_rows=8, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4),
            dict(max_rows=None, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4)],  # bounds not increasing
           [dict(max_rows=None, BLOCK_M=8, BLOCK_N=32, BLOCK_K=256, num_warps=4)],  # below tl.dot's 16
           [dict(max_rows=None, BLOCK_M=16, BLOCK_N=48, BLOCK_K=256, num_warps=4)],  # not a power of two
           [dict(max_rows=None, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256)],  # a key missing
           "16x32", [16, 32],  # not a list of tiles
           [dict(max_rows="64", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4),
            dict(max_rows=None, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4)]]  # a bound that is no count
    for table in bad:
        with pytest.raises(ValueError):
            lin.set_invariant_tiles(table)
        assert lin.INVARIANT_TILES == before


def test_the_tile_table_is_used_only_on_the_gpus_it_was_verified_on():
    """The shipped table serves a GPU of a verified compute capability with inputs of a verified dtype; any other GPU
    or dtype, and the interpreter (arch None), take the table's first tile for every step size, which is invariant by
    construction. A table installed by hand serves every device and dtype until the context restores the shipped one
    and its lists."""
    from optimized.kernels import linear as lin

    arch, dtype = next(iter(lin.INVARIANT_TILES_ARCHS)), next(iter(lin.INVARIANT_TILES_DTYPES))
    first = lin.INVARIANT_TILES[0]
    for where in [(arch, dtype), (None, dtype), ((99, 0), dtype), (arch, torch.float32), (arch, None)]:
        verified = where == (arch, dtype)
        tiles = lin.invariant_tile_table(*where)
        assert tiles == lin.INVARIANT_TILES if verified else tiles == (dict(first, max_rows=None),)
        for m in (1, 64, 65, 2048):
            cfg = kernel_config(m, 960, 576, False, True, *where)
            want = first if not verified else next(t for t in lin.INVARIANT_TILES
                                                   if t["max_rows"] is None or m <= t["max_rows"])
            assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]) == (want["BLOCK_M"], want["BLOCK_N"],
                                                                         want["num_warps"])
    before = lin.INVARIANT_TILES, lin.INVARIANT_TILES_ARCHS, lin.INVARIANT_TILES_DTYPES
    table = [dict(max_rows=8, BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4),
             dict(max_rows=None, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8)]
    with lin.invariant_tiles(table):
        assert lin.invariant_tile_table((99, 0), torch.float16) == lin.check_invariant_tiles(table)
    assert (lin.INVARIANT_TILES, lin.INVARIANT_TILES_ARCHS, lin.INVARIANT_TILES_DTYPES) == before


@needs_interpreter
def test_a_two_tile_table_computes_the_same_projection():
    """Each tile of a two-entry table computes the projection (the interpreter's tl.dot need not sum in the GPU's
    order, so the bits across tiles are the device's to check: test_gpu_projection_is_row_invariant)."""
    from optimized.kernels import linear as lin

    table = [dict(max_rows=4, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4),
             dict(max_rows=None, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4)]
    with lin.invariant_tiles(table):
        for m in (3, 9):
            kw = case(m, 50, 36, torch.float32, gated=True)
            y, total = norm_linear(**kw, eps=EPS, gated=True, backend="triton", row_invariant=True)
            y_ref, total_ref = norm_linear(**kw, eps=EPS, gated=True, backend="torch")
            check(torch.float32, y, y_ref, total, total_ref)
