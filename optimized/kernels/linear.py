"""Small-batch projections with their neighbours fused in: ``norm_linear`` (residual add + RMSNorm + matmul, with
an optional SiLU·up epilogue) and ``linear`` (the plain matmul), for steps of one or two token rows.

Why: at batch 1 a decoder layer of SmolLM2-135M reads 7 MB of weights, which the H200's HBM delivers in ~1.5 µs,
but a plain step spent ~25 µs a layer because the layer is nine kernels, each paying a fixed launch-and-drain cost
inside the CUDA graph, and a cuBLAS matmul of one row costs ~3.8 µs however small its matrix
(docs/benchmarks/index.md, "The batch-1 step"). This module turns the layer's

    add+norm → q/k/v matmul → … → o matmul → add+norm → gate/up matmul → SiLU·up → down matmul

into ``norm_linear(qkv)`` → … → ``linear(o)`` → ``norm_linear(gate/up, gated)`` → ``linear(down)``: six kernels a
layer instead of nine. On the H200 one layer's projection chain takes 12.8 µs instead of 22.1 µs at one row and
15.6 instead of 22.2 at two; from four rows on cuBLAS is as fast or faster, so the engine fuses only steps of at most
:data:`FUSED_MAX_ROWS` tokens (:func:`fused_rows`; ``scripts/bench_linear.py`` measures both and sweeps the tiles).

Each program owns ``BLOCK_N`` output columns and walks the input dimension ``K`` in tiles, in one of two kernels
(:func:`kernel_config` picks):

- the row loop (``_norm_linear_rows_kernel``, one or two rows): each weight tile is loaded once and every row of the
  block is multiplied into it in turn, with exactly a one-row step's arithmetic — a first pass computes the row's
  ``x̂ = x + residual`` (rounded to the model dtype, as HF's eager add is; the program of column block 0 stores it,
  the residual stream the layer carries on) and its sum of squares, the second normalises each tile exactly where HF
  rounds (``x̂ / rms`` to the model dtype, then the gain product to the model dtype) and sums ``h · Wᵀ`` over the
  tile in float32. The tile is the whole input row, so every load of a program is in flight at once: a one-row
  product is latency-bound, and a loop of dependent 64-wide tiles ran 2–4× slower than cuBLAS. The rows run one
  after another, though: on the H200 eight rows cost 2.4× one;
- ``tl.dot`` tiles of 16 rows (``_norm_linear_kernel``) for more rows: the same two passes over ``[16, BLOCK_K]``
  tiles, faster than cuBLAS from four rows on. Its tiles do not depend on the number of rows either, so with
  ``row_invariant=True`` every step takes it, one row included, and a row's bits do not depend on how many rows
  share the step (tests/equivalence/test_row_invariance.py): what would change them is the switch between the two
  kernels. (A variant summing the broadcast product ``[BLOCK_M, BLOCK_N, BLOCK_K]`` instead of ``tl.dot``, to
  avoid padding three to 16 rows to a 16-row tile, ran 2–3× slower than the ``tl.dot`` tiles at 4, 8 and 16 rows
  on the H200 and was removed: docs/benchmarks/linear-small-rows-h200.json. So was a one-pass variant with the
  whole row in one tile — the weight loads issued first, the norm computed from the input tile in registers, one
  ``tl.dot`` and no loop over K: its fastest tiles summed to 27.1 µs a layer at eight rows on an H100 against these
  tiles' 20.5, docs/benchmarks/linear-wide-h100.json.)

With ``GATED`` the weight is ``[gate | up]`` (``[2N, K]``, the engine's fused gate/up matrix) and the program
accumulates the gate and up columns of the same outputs, then writes ``silu(gate) · up`` with HF's rounding (each
projection to the model dtype, SiLU to the model dtype, the product to the model dtype).

The torch definition of both ops is the composition of the layer ops' torch definitions with ``F.linear``, the
reference twin of the kernel (``tests/equivalence/test_linear.py``). Outputs differ from it only in the order of
float32 sums (the RMS and the dot products), i.e. by about one output ulp where that order decides a rounding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from optimized.kernels.layer_ops import HAS_TRITON, resolve_backend, rms_norm_torch, silu_mul

if HAS_TRITON:
    import triton
    import triton.language as tl

# Up to this many token rows the projections run as the fused Triton kernels of this module; above it, cuBLAS
# (with the separate norm and SiLU·up kernels of layer_ops): plain decoding at batch 1 and 2. On the H200 the fused
# chain is 1.72× / 1.42× cuBLAS's at one / two rows (scripts/bench_linear.py, docs/benchmarks/linear-h200.json);
# at eight and sixteen rows the 16-row tl.dot tiles cost ~20 / ~21 µs a layer against cuBLAS's ~22
# (docs/benchmarks/linear-small-rows-h200.json). In the engine on an H100 (scripts/bench_engine.py --linear-rows 2
# against 16, docs/benchmarks/engine-h100-linear-rows-*.json) the fixed K = 7 step one step ahead took 1.29 / 1.35 ms
# at batch 1 / 2 with the limit at 16 against 1.47 / 1.51 ms at 2, while the plain step (the same kernels in both
# runs) drifted 0.75 → 0.70 and 0.82 → 0.76 ms between them: net ~5% off a batch-1 speculative step relative to a
# plain one, so the limit is 16 (a fixed K = 7 block of eight rows at batch 1 and 2 takes the fused tiles). Tuned on
# sm_90; the kernels are portable Triton.
FUSED_MAX_ROWS = 16

# Up to this many rows the default kernel loops over the rows against each weight tile (_norm_linear_rows_kernel);
# more rows, and every step of a caller that asks for row invariance, take 16-row tl.dot tiles (_norm_linear_kernel).
# The row loop's rows run one after another: on the H200 its chain costs 14.5 / 15.0 / 21.4 / 34.3 / 73.2 µs a layer
# at 1 / 2 / 4 / 8 / 16 rows against cuBLAS's ~22 (docs/benchmarks/linear-row-loop-h200.json).
ROW_LOOP_ROWS = 2

# The tl.dot tiles of a default (not row-invariant) step of more than ROW_LOOP_ROWS rows, by the op's kind: "norm"
# (add + norm + matmul: q/k/v), "gated" (add + norm + gate/up matmul + SiLU·up) and "plain" (o, down). ``split_k``:
# programs per output tile, each multiplying in its share of the K tiles (1: no split; never more than there are
# tiles); ``rms_whole_row``: the norm's pass over the whole row in one tile; ``num_stages``: Triton's software
# pipelining (None: its default). The split and the one-tile norm serve steps of up to SPLIT_MAX_ROWS rows (the
# fused steps); larger steps take the tile without them. ``scripts/bench_linear.py --sweep`` proposes a table
# (``proposed_dot_tiles``) and ``set_dot_tiles`` installs one. On an H100 (docs/benchmarks/linear-splitk-h100.json) no
# swept tile of an eight-row step beat this table by more than 1.2% (the best: split K = 3 for o and down, 128-column
# tiles at 8 warps for gate/up), and with that proposal a fixed K = 7 step at batch 1 took 1.231 ms against 1.227
# (profile-h100-fixed7-b1-splitk.json, profile-h100-fixed7-b1.json): the table stays, the split is off by default.
DOT_TILE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "split_k", "rms_whole_row", "num_stages")
DOT_TILES: dict[str, dict] = {
    "norm": dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, split_k=1, rms_whole_row=False, num_stages=None),
    "gated": dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, split_k=1, rms_whole_row=False, num_stages=None),
    "plain": dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, split_k=1, rms_whole_row=False, num_stages=None),
}
SPLIT_MAX_ROWS = 16
# The tiles before the split-K sweep (scripts/ab_engine.py --experiment small_rows runs the engine with them).
PREVIOUS_DOT_TILES: dict[str, dict] = {kind: dict(tile) for kind, tile in DOT_TILES.items()}


def check_dot_tiles(tiles: dict) -> dict[str, dict]:
    """``tiles`` as a table in :data:`DOT_TILES`'s format, or a ValueError naming what is wrong with it."""
    if not isinstance(tiles, dict) or set(tiles) != {"norm", "gated", "plain"}:
        raise ValueError(f"a tl.dot tile table has exactly the kinds norm, gated and plain, got {tiles!r}")
    for kind, tile in tiles.items():
        if not isinstance(tile, dict) or set(tile) != set(DOT_TILE_KEYS):
            raise ValueError(f"the {kind} tile has exactly the keys {list(DOT_TILE_KEYS)}, got {tile!r}")
        sizes = [tile["BLOCK_N"], tile["BLOCK_K"], tile["num_warps"]]
        if any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in sizes) or min(sizes[:2]) < 16:
            raise ValueError(f"the {kind} tile's sizes must be powers of two, BLOCK_N/K ≥ 16: {tile}")
        if not isinstance(tile["split_k"], int) or tile["split_k"] < 1 or not isinstance(tile["rms_whole_row"], bool):
            raise ValueError(f"the {kind} tile's split_k must be a positive int and rms_whole_row a bool: {tile}")
        if tile["num_stages"] is not None and (not isinstance(tile["num_stages"], int) or tile["num_stages"] < 1):
            raise ValueError(f"the {kind} tile's num_stages must be None or a positive int: {tile}")
    return {kind: dict(tiles[kind]) for kind in ("norm", "gated", "plain")}


def set_dot_tiles(tiles: dict) -> None:
    """Install a table of default ``tl.dot`` tiles (:func:`check_dot_tiles` first)."""
    global DOT_TILES
    DOT_TILES = check_dot_tiles(tiles)


@contextlib.contextmanager
def dot_tiles_in_force(tiles: dict | None) -> Iterator[None]:
    """``tiles`` installed as :func:`set_dot_tiles` does for the block, and the table before it put back after it,
    whatever the block raised (``None``: the table as it is)."""
    global DOT_TILES
    saved = DOT_TILES
    if tiles is not None:
        set_dot_tiles(tiles)
    try:
        yield
    finally:
        DOT_TILES = saved


# The row-invariant tl.dot tiles by step size, smallest first: each entry serves steps of up to ``max_rows`` rows
# (None: any). Several entries let a large step take larger tiles — but only tiles that give every row the bits the
# first entry gives it, or a token's bits would depend on its step again. Whether two tiles agree is the GPU's
# matrix instructions' business, so it is measured, not assumed: ``scripts/bench_linear.py --invariant-sweep`` marks
# each tile it times ``identical`` or not against this table's first entry and proposes a table of the fastest
# identical ones, which ``set_invariant_tiles`` (``scripts/exactness.py --invariant-tiles``) installs for a trial and
# tests/equivalence/test_linear.py checks on the device. On the H200 every projection's 32 × 64 tile gave the 16 × 32
# tile's bits at 1..2048 rows and ran 1.2–1.6× faster at 512 and 2048 rows (docs/benchmarks/linear-invariant-h200.json);
# with this table the exactness benchmark's greedy tokens stayed identical to plain decoding at batch 1 in every mode
# and batch size (docs/benchmarks/exactness-h200.json).
INVARIANT_TILES: tuple[dict, ...] = (dict(max_rows=64, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4),
                                     dict(max_rows=None, BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, num_warps=4))
# The GPUs (compute capability) and input dtypes for which the table's tiles were found bit-identical (the H200's
# sweep ran in bfloat16; in float32 a 32 × 64 tile of 256 columns does not even fit the H200's shared memory); on any
# other GPU or dtype the first tile serves every step (one tile for every size: invariant by construction), until a
# sweep there says otherwise. None: every GPU and dtype (a table installed with set_invariant_tiles is taken as given).
INVARIANT_TILES_ARCHS: frozenset[tuple[int, int]] | None = frozenset({(9, 0)})
INVARIANT_TILES_DTYPES: frozenset[torch.dtype] | None = frozenset({torch.bfloat16})


def check_invariant_tiles(tiles: list[dict]) -> tuple[dict, ...]:
    """``tiles`` as a table in :data:`INVARIANT_TILES`'s format, or a ValueError naming what is wrong with it: a list
    of dicts with exactly the keys ``max_rows``, ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``; ``max_rows``
    increasing and the last None; tile sizes powers of two, BLOCK_M/N/K ≥ 16 (tl.dot's smallest tile)."""
    keys = {"max_rows", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"}
    if not isinstance(tiles, (list, tuple)) or not tiles or not all(isinstance(t, dict) for t in tiles):
        raise ValueError(f"a row-invariant tile table is a non-empty list of dicts, got {tiles!r}")
    for t in tiles:
        if set(t) != keys:
            raise ValueError(f"a row-invariant tile has exactly the keys {sorted(keys)}, got {sorted(t)}")
        sizes = [t["BLOCK_M"], t["BLOCK_N"], t["BLOCK_K"], t["num_warps"]]
        if any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in sizes) or min(sizes[:3]) < 16:
            raise ValueError(f"tile sizes must be powers of two, BLOCK_M/N/K ≥ 16: {t}")
    bounds = [t["max_rows"] for t in tiles]
    if bounds[-1] is not None:
        raise ValueError("the last row-invariant tile must serve any step size (max_rows None)")
    inner = bounds[:-1]
    if any(not isinstance(b, int) or b < 1 for b in inner) or inner != sorted(set(inner)):
        raise ValueError(f"row-invariant tiles' max_rows must increase, the last None, got {bounds}")
    return tuple(dict(t) for t in tiles)


def set_invariant_tiles(tiles: list[dict], archs: frozenset[tuple[int, int]] | None = None,
                        dtypes: frozenset[torch.dtype] | None = None) -> None:
    """Install a table of row-invariant tiles (:func:`check_invariant_tiles` first), for the GPUs of ``archs`` and
    the input dtypes of ``dtypes`` (None: all)."""
    global INVARIANT_TILES, INVARIANT_TILES_ARCHS, INVARIANT_TILES_DTYPES
    INVARIANT_TILES, INVARIANT_TILES_ARCHS, INVARIANT_TILES_DTYPES = check_invariant_tiles(tiles), archs, dtypes


@contextlib.contextmanager
def invariant_tiles(tiles: list[dict] | None) -> Iterator[None]:
    """:func:`set_invariant_tiles` for the duration of a ``with`` block (None: the table in force), then the table
    before it again."""
    previous = INVARIANT_TILES, INVARIANT_TILES_ARCHS, INVARIANT_TILES_DTYPES
    if tiles is not None:
        set_invariant_tiles(tiles)
    try:
        yield
    finally:
        set_invariant_tiles(list(previous[0]), previous[1], previous[2])


def invariant_tile_table(arch: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> tuple[dict, ...]:
    """The row-invariant tiles in force on a GPU of compute capability ``arch`` (None: not a GPU, e.g. the Triton
    interpreter, whose tl.dot sums in an order of its own) for inputs of ``dtype``: :data:`INVARIANT_TILES`, or its
    first tile alone where the table was not verified."""
    if ((INVARIANT_TILES_ARCHS is None or arch in INVARIANT_TILES_ARCHS)
            and (INVARIANT_TILES_DTYPES is None or dtype in INVARIANT_TILES_DTYPES)):
        return INVARIANT_TILES
    return (dict(INVARIANT_TILES[0], max_rows=None),)


def fused_rows(n: int, limit: int | None = None) -> bool:
    """Whether a step of ``n`` token rows takes the fused small-batch projections (``limit`` None = the default)."""
    return 0 < n <= (FUSED_MAX_ROWS if limit is None else limit)


# ---------------------------------------------------------------------------------------------------------
# Torch definitions (the reference twins)
# ---------------------------------------------------------------------------------------------------------


def norm_linear_torch(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None, eps: float,
                      residual: Tensor | None, gated: bool) -> tuple[Tensor, Tensor]:
    total = x if residual is None else x + residual
    h = total if norm_weight is None else rms_norm_torch(total, norm_weight, eps)
    y = F.linear(h, weight, bias)
    return (silu_mul(y, backend="torch") if gated else y), total


# ---------------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _input_tile(x_ptr, res_ptr, rows, rmask, cols, kmask, stride_xm, stride_rm, HAS_RESIDUAL: tl.constexpr):
        """Rows × columns of x̂ = x (+ residual, rounded to the model dtype), zeros outside the masks."""
        mask = rmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _inv_rms(x_ptr, res_ptr, sum_ptr, rows, rmask, K, eps, stride_xm, stride_rm, stride_sm, store,
                 HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
        """Pass 1 over ``rows``: each row's 1 / rms of x̂ = x (+ residual), walking K in tiles; with ``store`` (the
        program of column block 0) x̂ is written to the residual stream too."""
        sum_sq = tl.zeros(rows.shape, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            x = _input_tile(x_ptr, res_ptr, rows, rmask, cols, kmask, stride_xm, stride_rm, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if store:
                    tl.store(sum_ptr + rows[:, None] * stride_sm + cols[None, :], x,
                             mask=rmask[:, None] & kmask[None, :])
            xf = x.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        return tl.math.rsqrt(sum_sq / K + eps)

    @triton.jit
    def _store_output(acc, acc_up, b_ptr, y_ptr, rows, rmask, outs, omask, stride_ym, HAS_BIAS: tl.constexpr,
                      GATED: tl.constexpr):
        """The epilogue: bias, then (gated) silu(gate) rounded, times up, rounded, as layer_ops' SiLU·up kernel."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + outs, mask=omask, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        if GATED:
            gate = out.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
            up = acc_up.to(y_ptr.dtype.element_ty)
            out = (act.to(tl.float32) * up.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_ym + outs[None, :], out, mask=rmask[:, None] & omask[None, :])

    @triton.jit
    def _norm_linear_kernel(
        x_ptr, res_ptr, gain_ptr, w_ptr, b_ptr, y_ptr, sum_ptr,  # x, res, sum [M, K]; w [N or 2N, K]; y [M, N]
        part_ptr, ticket_ptr,  # split K only: partial sums [SPLIT_K, M, N or 2N] float32; a ticket per output tile
        M, N, K, eps,
        stride_xm, stride_rm, stride_wn, stride_ym, stride_sm,
        NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        RMS_BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    ):
        """``[BLOCK_M, BLOCK_K]`` input tiles against ``[BLOCK_N, BLOCK_K]`` weight tiles, walking K, each pair one
        ``tl.dot`` (matrix instructions, 16 rows a tile at least).

        Pass 1 (the norm's sums of squares) walks K in ``RMS_BLOCK_K`` tiles, which may be the whole row: one load
        in flight instead of a chain of dependent ones. With ``SPLIT_K`` > 1 the K tiles are dealt out to ``SPLIT_K``
        programs per output tile (grid axis 2), which gives a few-row step more programs than its ``N / BLOCK_N``
        column blocks; each writes its partial sums to ``part_ptr`` and takes a ticket, and the program that takes
        the last one adds the partials in split order — the same order whichever program finishes last, so the
        result is deterministic — applies the epilogue and hands the ticket counter back at zero for the next
        launch."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < M
        outs = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        omask = outs < N
        if NORM:  # pass 1: the residual sum (stored once) and each row's 1 / rms
            inv_rms = _inv_rms(x_ptr, res_ptr, sum_ptr, rows, rmask, K, eps, stride_xm, stride_rm, stride_sm,
                               (pid_n == 0) & (pid_k == 0), HAS_RESIDUAL, RMS_BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # this split's K columns, whole tiles
        k_lo = pid_k * k_per
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BLOCK_K):  # pass 2: normalise each tile, multiply it in
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            h = _input_tile(x_ptr, res_ptr, rows, rmask, cols, kmask, stride_xm, stride_rm, HAS_RESIDUAL)
            if NORM:
                normed = (h.to(tl.float32) * inv_rms[:, None]).to(h.dtype)  # HF casts back before the gain
                gain = tl.load(gain_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
                h = (gain[None, :] * normed.to(tl.float32)).to(h.dtype)
            wmask = omask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + outs[:, None] * stride_wn + cols[None, :], mask=wmask, other=0.0)  # [BLOCK_N, BLOCK_K]
            if GATED:
                w_up = tl.load(w_ptr + (outs[:, None] + N) * stride_wn + cols[None, :], mask=wmask, other=0.0)
            # into the accumulator: each row's products summed in K order, whatever BLOCK_K
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
            if GATED:
                acc_up = tl.dot(h, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
        if SPLIT_K == 1:
            _store_output(acc, acc_up, b_ptr, y_ptr, rows, rmask, outs, omask, stride_ym, HAS_BIAS, GATED)
        else:
            width = 2 * N if GATED else N  # a partial row holds the gate columns, then the up columns
            tile_mask = rmask[:, None] & omask[None, :]
            mine = part_ptr + (pid_k * M + rows[:, None]) * width + outs[None, :]
            tl.store(mine, acc, mask=tile_mask)
            if GATED:
                tl.store(mine + N, acc_up, mask=tile_mask)
            tl.debug_barrier()  # every thread's partials are written before the ticket releases them
            ticket = ticket_ptr + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:  # the last split: reduce
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT_K):  # in split order, whichever program came last
                    theirs = part_ptr + (s * M + rows[:, None]) * width + outs[None, :]
                    acc += tl.load(theirs, mask=tile_mask, other=0.0, cache_modifier=".cg")  # L2, not a stale L1
                    if GATED:
                        acc_up += tl.load(theirs + N, mask=tile_mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # the counter at zero for the next launch
                _store_output(acc, acc_up, b_ptr, y_ptr, rows, rmask, outs, omask, stride_ym, HAS_BIAS, GATED)

    @triton.jit
    def _norm_linear_rows_kernel(
        x_ptr, res_ptr, gain_ptr, w_ptr, b_ptr, y_ptr, sum_ptr,  # x, res, sum [M, K]; w [N or 2N, K]; y [M, N]
        M, N, K, eps,
        stride_xm, stride_rm, stride_wn, stride_ym, stride_sm,
        NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """A few rows: each weight tile is loaded once, then every row of the block is multiplied into it in turn.

        Row ``m`` goes through exactly the arithmetic of a one-row step — its own sum of squares over ``[1, BLOCK_K]``
        tiles, its own ``[1, BLOCK_K] × [BLOCK_N, BLOCK_K]`` product summed over K — so a row's output does not
        depend on how many rows share the step (tests/equivalence/test_row_invariance.py), and eight rows cost
        about what one costs: the weights stream from memory once, and the extra products are a few hundred
        multiply-adds per thread.
        """
        pid_n = tl.program_id(0)
        first = tl.program_id(1) * BLOCK_M
        lanes = tl.arange(0, BLOCK_M)  # [BLOCK_M] the block's rows
        one = tl.arange(0, 1)  # [1] a one-row tile's row index
        outs = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        omask = outs < N
        inv_rms = tl.zeros([BLOCK_M], tl.float32)
        if NORM:  # pass 1: each row's residual sum (stored once) and 1 / rms, one row at a time
            for m in tl.static_range(BLOCK_M):
                row = (first + m + one).to(tl.int64)  # [1]
                row_inv = _inv_rms(x_ptr, res_ptr, sum_ptr, row, row < M, K, eps, stride_xm, stride_rm, stride_sm,
                                   pid_n == 0, HAS_RESIDUAL, BLOCK_K)  # [1]
                inv_rms = tl.where(lanes == m, tl.sum(row_inv), inv_rms)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # pass 2: one weight tile, every row of the block against it
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            wmask = omask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + outs[:, None] * stride_wn + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
            if GATED:
                w_up = tl.load(w_ptr + (outs[:, None] + N) * stride_wn + cols[None, :], mask=wmask,
                               other=0.0).to(tl.float32)
            if NORM:
                gain = tl.load(gain_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                row = (first + m + one).to(tl.int64)  # [1]
                live = row < M
                h = _input_tile(x_ptr, res_ptr, row, live, cols, kmask, stride_xm, stride_rm, HAS_RESIDUAL)
                if NORM:  # normalise as HF rounds: x̂ / rms to the model dtype, then the gain product
                    inv = tl.sum(tl.where(lanes == m, inv_rms, 0.0))  # this row's 1 / rms
                    normed = (h.to(tl.float32) * inv).to(h.dtype)
                    h = (gain[None, :] * normed.to(tl.float32)).to(h.dtype)
                hf = h.to(tl.float32)  # [1, BLOCK_K]
                mine = lanes[:, None] == m
                acc = tl.where(mine, acc + tl.sum(hf * w, axis=1)[None, :], acc)
                if GATED:
                    acc_up = tl.where(mine, acc_up + tl.sum(hf * w_up, axis=1)[None, :], acc_up)
        rows = (first + lanes).to(tl.int64)
        _store_output(acc, acc_up, b_ptr, y_ptr, rows, rows < M, outs, omask, stride_ym, HAS_BIAS, GATED)


_TICKETS: dict[torch.device, Tensor] = {}


def _tickets(device: torch.device, count: int) -> Tensor:
    """The split-K kernels' ticket counters on ``device``: ``count`` int32 zeros, one per output tile of a launch.

    Every launch hands its counters back at zero, so one buffer serves every launch on the device — as long as no two
    split-K launches run at the same time on two streams (the engine runs its forward on one stream). It is
    allocated, zeroed, the first time a device needs it, which must not be inside a CUDA graph capture (the zeroing
    would be captured, not run): run a step eagerly first, as the engine's warm-up does."""
    have = _TICKETS.get(device)
    if have is None or have.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K projection's ticket counters are allocated at the first eager call on a "
                               "device, not inside a CUDA graph capture: run the step once before capturing it")
        have = _TICKETS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return have


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """The compute capability of CUDA device ``index`` (None: the current one), read once per device: a row-invariant
    projection asks on every call, and eager steps make hundreds of calls."""
    return torch.cuda.get_device_capability(index)


def dot_tile(m: int, k: int, gated: bool, norm: bool) -> dict:
    """The default ``tl.dot`` launch of an ``m``-row step of an op with ``k`` input columns (:data:`DOT_TILES`)."""
    tile = DOT_TILES["gated" if gated else "norm" if norm else "plain"]
    block_k = min(tile["BLOCK_K"], triton.next_power_of_2(k))
    cfg = dict(kernel="dot", BLOCK_M=16, BLOCK_N=tile["BLOCK_N"], BLOCK_K=block_k, num_warps=tile["num_warps"])
    if tile["num_stages"]:
        cfg["num_stages"] = tile["num_stages"]
    if m <= SPLIT_MAX_ROWS:
        split = min(tile["split_k"], triton.cdiv(k, block_k))  # no more programs than K tiles
        if split > 1:
            cfg["SPLIT_K"] = split
        if norm and tile["rms_whole_row"]:
            cfg["RMS_BLOCK_K"] = triton.next_power_of_2(k)
    return cfg


def kernel_config(m: int, n: int, k: int, gated: bool, row_invariant: bool = False,
                  arch: tuple[int, int] | None = None, dtype: torch.dtype | None = None, norm: bool = False) -> dict:
    """Kernel, tile sizes and warps for an ``[m, k] · [n, k]ᵀ`` step (``n`` output columns, gate and up counted once).

    Up to :data:`ROW_LOOP_ROWS` rows: the row loop (``kernel="rows"``), with the whole input row in one tile
    (``BLOCK_K`` = K rounded up to a power of two, up to 2048), so that every weight load of a program is in flight
    at once, and as few output columns a program as keep its weight tile at ~2048 values: one to four columns,
    hundreds of programs. A one-row step is latency-bound, and this was the fastest shape of the sweep on the H200
    (scripts/bench_linear.py: 2–4× faster than 64-wide K tiles walked in a loop). More rows: ``tl.dot`` tiles of 16
    rows (``kernel="dot"``) as :data:`DOT_TILES` gives them for the op's kind (``norm``: the op has a norm in front;
    :func:`dot_tile`); on the H200 at 8 rows its chain costs ~20 µs a layer against cuBLAS's ~22 with the
    separate norm and SiLU kernels (docs/benchmarks/linear-small-rows-h200.json).

    With ``row_invariant`` every ``m`` takes a ``tl.dot`` tile of :data:`INVARIANT_TILES` by step size, on a GPU of
    compute capability ``arch`` for inputs of ``dtype`` the table verified there (:func:`invariant_tile_table`;
    elsewhere its first tile alone): a row's products are summed into its accumulator in K order by matrix
    instructions that give it the same bits whether its tile holds 1 or 16 real rows (padding rows are zeros that no
    real row reads) — no split of ``K``. Either kernel alone is row-invariant; switching between them at
    ``ROW_LOOP_ROWS`` is what makes a token's bits depend on its step, so the invariant mode gives up the row loop's
    one-row speed for the dot tiles' many-row speed (the row loop runs its rows one after another: an engine with
    every step on it ran 7× slower than the default at batch 64).
    """
    if row_invariant:  # the first tile of the table in force on this GPU that serves m rows
        tile = next(t for t in invariant_tile_table(arch, dtype) if t["max_rows"] is None or m <= t["max_rows"])
        return dict(kernel="dot", BLOCK_M=tile["BLOCK_M"], BLOCK_N=tile["BLOCK_N"],
                    BLOCK_K=min(tile["BLOCK_K"], triton.next_power_of_2(k)), num_warps=tile["num_warps"])
    if m > ROW_LOOP_ROWS:
        return dot_tile(m, k, gated, norm or gated)
    block_k = min(triton.next_power_of_2(k), 2048)
    return dict(kernel="rows", BLOCK_M=min(triton.next_power_of_2(m), 16), BLOCK_N=max(1, 2048 // block_k),
                BLOCK_K=block_k, num_warps=2)


# ---------------------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------------------


def norm_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm_weight: Tensor | None = None,
                eps: float = 1e-6, residual: Tensor | None = None, gated: bool = False, backend: str = "auto",
                config: dict | None = None, row_invariant: bool = False) -> tuple[Tensor, Tensor]:
    """``y = F.linear(w · norm(x̂), weight, bias)`` with ``x̂ = x + residual``; returns ``(y, x̂)``.

    Args:
        x: ``[M, K]`` rows (contiguous last dimension; row strides are free).
        weight: ``[N, K]``, or ``[2N, K]`` = ``[gate | up]`` with ``gated``; contiguous.
        bias: ``[N]`` or ``None`` (ungated only).
        norm_weight: ``[K]`` RMSNorm gain, or ``None`` for no norm (then ``residual`` must be ``None``).
        residual: ``[M, K]`` added to ``x`` before the norm, or ``None``.
        gated: return ``silu(x̂ W_gateᵀ) · (x̂ W_upᵀ)`` ``[M, N]`` instead of the projection.
        config: the kernel (``kernel``: ``"rows"`` or ``"dot"``) and its tile sizes (``BLOCK_M``, ``BLOCK_N``,
            ``BLOCK_K``, ``num_warps``, optionally Triton's ``num_stages``; for ``"dot"`` also ``RMS_BLOCK_K``, the
            norm pass's tile, default ``BLOCK_K``, and ``SPLIT_K``, programs per output tile, default 1), default
            :func:`kernel_config` (the benchmark sweeps them).
        row_invariant: compute every row with the one ``tl.dot`` configuration at any size, so that a row's output
            does not depend on the other rows of the step (slower than the row loop at one or two rows).

    Returns:
        ``(y [M, N], x̂ [M, K])``; ``x̂`` is ``x`` itself when there is no residual.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    rows_out = weight.shape[0]
    if gated and rows_out % 2:
        raise ValueError(f"a gated weight is [gate | up] = [2N, K]; got {rows_out} rows")
    if bias is not None and (gated or bias.shape != (rows_out,)):
        raise ValueError(f"bias must be [{rows_out}] and only on an ungated projection (Llama/Qwen MLPs have none), "
                         f"got {tuple(bias.shape)}{' with gated' if gated else ''}")
    if norm_weight is None and residual is not None:
        raise ValueError("a residual is added only in front of a norm (norm_weight)")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if resolve_backend(backend, x) == "torch":
        return norm_linear_torch(x, weight, bias, norm_weight, eps, residual, gated)
    for name, t in (("x", x), ("weight", weight)) + ((("residual", residual),) if residual is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, got strides {t.stride()}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    n = rows_out // 2 if gated else rows_out
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    if m:
        arch = _capability(x.device.index) if x.is_cuda and row_invariant else None
        cfg = dict(kernel_config(m, n, k, gated, row_invariant, arch, x.dtype, norm=norm_weight is not None)
                   if config is None else config)
        block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
        kind = cfg.pop("kernel", "rows" if block_m < 16 else "dot")
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        dummy = x  # stands in for absent pointers (never read: the flags compile the accesses away)
        extra: tuple = ()
        if kind == "dot":
            kernel = _norm_linear_kernel
            cfg["DOT_PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"
            split_k = cfg.setdefault("SPLIT_K", 1)
            cfg.setdefault("RMS_BLOCK_K", cfg["BLOCK_K"])
            if not isinstance(split_k, int) or split_k < 1 or (split_k > 1 and row_invariant):
                raise ValueError(f"SPLIT_K must be a positive int (1 with row_invariant: a split changes the sums' "
                                 f"order), got {split_k!r}")
            if split_k > 1:
                parts = torch.empty((split_k, m, rows_out), dtype=torch.float32, device=x.device)
                extra = (parts, _tickets(x.device, grid[0] * grid[1]))
                grid = grid + (split_k,)
            else:
                extra = (dummy, dummy)
        elif kind == "rows":
            kernel = _norm_linear_rows_kernel
        else:
            raise ValueError(f"config['kernel'] must be 'rows' or 'dot', got {kind!r}")
        res = residual if residual is not None else x
        kernel[grid](
            x, res, norm_weight if norm_weight is not None else dummy, weight,
            bias if bias is not None else dummy, y, total, *extra,
            m, n, k, eps,
            x.stride(0), res.stride(0), weight.stride(0), y.stride(0), total.stride(0),
            NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, **cfg,
        )
    return y, total


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, backend: str = "auto",
           config: dict | None = None, row_invariant: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` for a few rows (``x [M, K]``, ``weight [N, K]``) as one Triton kernel."""
    return norm_linear(x, weight, bias, backend=backend, config=config, row_invariant=row_invariant)[0]
