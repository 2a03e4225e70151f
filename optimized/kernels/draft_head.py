"""The serial part of drafting, fused: Markov-head sampling of x_1..x_γ together with the confidence head.

Fast twin of ``reference/drafter.py::DSparkDrafter.sample_block`` for the Markov head (docs/method.md §1). Names
follow ``docs/method.md``: ``U_k`` base logits, ``B_k`` sequential bias, ``p_d`` draft distribution, ``z_k``
the confidence logit (``c_k = σ(z_k)`` before STS), ``γ`` block size. Per request, left to right::

    prev = x_0
    for k in 1..γ:
        e      = W1[prev]                                  # [r]   the Markov embedding of the previous token
        logits = U_k + W2 e                                # [V]   B_k = W2 e  (W2: Linear(r -> V), weight [V, r])
        p_d_k  = softmax(logits / T)                       # [V]   one-hot at argmax(logits) when T = 0
        x_k    = argmax_v p_d_k(v) / E_v                   #       exponential race, purpose 1 + 16k, position P + k
        z_k    = conf_w · [h_k; e] + conf_b                #       never sees x_k (losslessness, docs/method.md §5)
        prev   = x_k

Two variants run that loop, with identical arithmetic per vocabulary lane:

* one program per request (:func:`_sample_draft_block_kernel`, grid ``(R,)``). Each slot makes two passes over
  the vocabulary: pass 1 computes the tempered logits tile by tile (the ``[BLOCK_V, r]`` slice of W2 times
  ``e``), keeps an online max/sum for the softmax and the greedy argmax, and parks the tempered logits in the
  ``probs`` output row; pass 2 turns them into ``p_d`` in place and runs the race. A greedy row parks nothing: its
  ``p_d`` is the one-hot of the argmax and its race the argmax itself (below), so pass 2 only stores the one-hot
  (or nothing, with ``store_greedy=False``). W2 is read once per slot
  (the dominant traffic: ``V·r`` weights, resident in L2 across the batch). Its limit: one program streams all
  of W2 γ times, serially (~2 ms at R = 1 and at R = 64, γ = 7, V = 49152, r = 64 on an H200).
* split vocabulary (grid ``(R, NB)``, ``NB = cdiv(V, BLOCK_V)`` blocks; host loop over the slots, no host syncs:
  CUDA-graph capturable). A slot has two dependencies across blocks: every block's ``p_d`` needs the row's softmax
  max and sum, and the next slot's ``W1[prev]`` needs the race winner. Each costs a launch boundary, and each is
  met by a wide launch that leaves one partial per (request, block) and a narrow one (grid ``(R,)``) that reduces a
  row's NB partials once, so the wide launches read their row's result as a scalar (O(R·NB) partial loads per slot;
  re-reducing them in every program of the next wide launch was O(R·NB²): at R = 64, NB = 192 the race launch read
  four partials of all 192 blocks in each of its 12,288 programs). Four launches per slot, 4γ in all:

  - A_k (logits, grid ``(R, NB)``): ``prev = x_{k-1}`` from ``tokens`` (``x_0`` for k = 1); block 0 writes ``z_k``;
    every block computes its tempered logits into the ``probs`` row and writes the block's max, its sum of
    ``exp(x - max)`` and its greedy argmax. Or 16 requests per program (``split_rows``, grid ``(cdiv(R, 16), NB)``),
    which read the block's ``[BLOCK_V, r]`` tile of W2 once for all of them and apply it with ``tl.dot``.
  - S_k (stats, grid ``(R,)``): a sampled row's block maxima and sums combined in one fixed order into the softmax
    max and sum (``[R]`` scratch: every block of the row reads the same bits); a greedy row's block argmaxes into its
    argmax, which is ``x_k`` (its ``p_d`` is the one-hot of the argmax, and a race over a one-hot returns the hot
    lane), written straight into ``tokens``.
  - B_k (race, grid ``(R, NB)``): a sampled row's block turns into ``p_d`` and writes its part of the race (best
    score, lowest index). A greedy row has no race and parked no logits: its blocks store the one-hot, or, with
    ``store_greedy=False``, return at once.
  - W_k (winner, grid ``(R,)``): a sampled row's race partials into ``x_k``, written into ``tokens``.

  Cross-block ties resolve like the serial tiles (a later block wins only with a strictly larger value: the lowest
  index). The softmax sum is accumulated in another order, so ``p_d`` may differ from the one-program kernel in the
  last ulp; tokens agree except on such an ulp-level tie of the race.

Output rows. ``p_d`` of request ``i`` goes to ``probs[i]``, or, given ``probs_rows``, to row ``probs_rows[i]`` of a
caller's ``[S, γ, V]`` buffer (the engine's per-slot state: no copy after the draft). Every store and every re-read
of the parked logits goes through that index, so the scratch of request ``i`` is its own destination row. A negative
index marks a padding row (a CUDA-graph bucket's tail): the kernels skip its work, store nothing into the buffer and
zeros into its tokens and confidence logits.

Greedy rows without ``p_d`` (``store_greedy=False``). A greedy row's ``p_d`` is the one-hot of its own draft token,
so a consumer that knows which rows are greedy needs none of its ``V`` floats per slot (``verify.rejection_sample``
with ``draft_onehot``; greedy verification reads no ``p_d`` at all). The kernels then store nothing for such a row:
its ``probs`` rows keep whatever they held, its tokens and confidence logits are unchanged. (On an H200, fixed K = 7
at R = 64, greedy, the race launches that stored them took 0.26 ms of a step's 3.2 ms of device time:
``scripts/profile_engine.py``, docs/benchmarks/profile-h200-fixed7-b64.json.)

Precision. Compute is fp32. Where the reference rounds a result to the weight dtype (``nn.Linear`` in
fp16/bf16 returns that dtype), the kernel rounds the same intermediate (``B_k`` and ``z_k``) the same way, so
half-precision drafters agree with the reference up to accumulation order.

Only the Markov head is fused. :func:`sample_block` dispatches a :class:`reference.drafter.DSparkDrafter`:
the RNN head and the parallel-only head ("none") run the reference's torch loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from optimized.kernels.common import (
    BIG_INDEX,
    PURPOSE_DRAFT,
    argmax_update,
    exponential_at,
    hash_key,
    per_row_words,
    race_update,
    race_winner,
    resolve_backend,
    split_seed,
)
from optimized.kernels.sampling import sample
from reference.drafter import DraftOutput, DSparkDrafter
from reference.sampling import draft_purpose

__all__ = ["DraftOutput", "sample_block", "sample_draft_block"]

# The W2 tile is BLOCK_V · BLOCK_R ≤ W2_TILE_ELEMENTS products, 128 per thread at 16 warps (r = 64 -> 1024
# vocabulary lanes per step, r = 256 -> 256). One program streams W2 alone, so bytes in flight per step decide
# its speed. Sweep on one H200 (triton 3.6, R = 64, γ = 7, V = 49152, r = 64, bf16 weights), ms per call:
# 8192/4 warps 9.3, 16384/8 5.0, 32768/16 2.8, 65536/16 1.76, 65536/32 1.62 (32 warps left out: register risk).
W2_TILE_ELEMENTS = 65536
NUM_WARPS = 16
MAX_BLOCK_V = 1024  # as RACE_BLOCK_V in common.py
MAX_BLOCK_D = 1024  # hidden-state tile of the confidence dot product (d = 576 for SmolLM2-135M: one tile)
# The split variant's launches by request count R (the draft graph's bucket size), measured inside CUDA graphs with the
# engine's arguments (probs_rows, store_greedy=False, bf16 weights and U_k, SmolLM2's shapes, γ = 7) by
# scripts/bench_draft_head.py on one H100 (docs/benchmarks/draft-head-graph-h100*.json). Each entry serves R below
# ``below`` (None: any R): a W2 tile of ``tile`` products a program (BLOCK_V = tile / BLOCK_R lanes, at most
# MAX_BLOCK_V: 256 and 512 lanes at r = 64), ``warps`` warps a program, with ``fused`` the per-row reductions done by
# the last program of each row to finish the launch before them (an arrival counter per row: an atomic add with
# release/acquire order, the partials then read from L2; two launches a slot instead of four, the same bits), and
# ``rows`` requests a program of the logits launch (1, or a power of two >= 16 for _draft_split_logits_rows_kernel:
# W2's block read once for that many requests and applied with tl.dot).
# Greedy, µs per draft, the table's launch against the one used before (16384-product tiles at 8 warps, separate
# reductions, 16 requests a program from 32 on): R = 1 55.5 / 70.0, R = 4 64.3 / 79.9, R = 16 137.7 / 181.8,
# R = 32 238.8 / 392.1, R = 64 415.2 / 738.7; sampled rows (T = 1) alike (R = 64 517.9 / 913.8). Four warps won at
# every R but one (R = 1: 8 warps 1% ahead at 8,192 products), wider tiles from R = 16 on (65,536 products lost to
# 32,768 at R = 16..256), the fused reductions below R = 32 (3-20% faster there, 1-7% slower from 32 on), and a
# program per request always won over 16, 32 or 64 requests a program sharing W2's block
# (_draft_split_logits_rows_kernel: 1.6-1.8x slower in the graph from R = 16 on). In the engine on an H100, alternated
# with the launches before (scripts/ab_engine.py --experiment draft_head, fixed K = 7 one step ahead,
# docs/benchmarks/draft-head-ab-h100.json), the table gave 1.015x the tokens/s at batch 16 and 1.096x at batch 64.
# (Sharing W2's block wins in eager timings, where launch overhead hides device time: on an H200,
# `scripts/bench_kernels.py --op draft_head` gave R = 64 818 against 1,201 µs a draft.)
SPLIT_TABLE: tuple[dict, ...] = (dict(below=16, tile=16384, warps=4, fused=True, rows=1),
                                 dict(below=32, tile=32768, warps=4, fused=True, rows=1),
                                 dict(below=None, tile=32768, warps=4, fused=False, rows=1))
# The launches used before that sweep (16,384-product tiles at 8 warps, separate reductions, 16 requests a program from
# 32 on; the one-program kernel from PREVIOUS_SPLIT_MAX_R requests on): the baseline arm of
# `scripts/ab_engine.py --experiment draft_head`, which measures the table's effect on the engine.
PREVIOUS_SPLIT_TABLE: tuple[dict, ...] = (dict(below=32, tile=16384, warps=8, fused=False, rows=1),
                                          dict(below=None, tile=16384, warps=8, fused=False, rows=16))
PREVIOUS_SPLIT_MAX_R = 128
# The table's tile overridden at every R (None: the table's): the tests shrink it so that small vocabularies span
# several blocks and end in a partial one.
SPLIT_TILE_ELEMENTS: int | None = None
# `sample_draft_block(split=None)` takes the split variant on CUDA below this many requests, the one-program kernel
# (grid (R,), each program streaming W2 γ times) from it on. In the graph on one H100 the split variant won at every
# R measured, up to 256 (greedy 1,475 against 1,705 µs a draft, T = 1 1,885 against 2,184;
# docs/benchmarks/draft-head-graph-h100-wide.json, -sampled.json); above 256 requests nothing was measured, and the
# one-program kernel stays.
SPLIT_MAX_R = 257


def split_launch(R: int) -> dict:
    """The split variant's launch for ``R`` requests from :data:`SPLIT_TABLE`: ``tile`` (or
    :data:`SPLIT_TILE_ELEMENTS` when set), ``warps``, ``fused`` and ``rows``."""
    entry = next(e for e in SPLIT_TABLE if e["below"] is None or R < e["below"])
    tile = entry["tile"] if SPLIT_TILE_ELEMENTS is None else SPLIT_TILE_ELEMENTS
    return dict(tile=tile, warps=entry["warps"], fused=entry["fused"], rows=entry["rows"])


@triton.jit
def _round_to(x, ref_ptr):
    """Round fp32 ``x`` to the element type of ``ref_ptr`` and back, like an ``nn.Linear`` output in that dtype."""
    return x.to(ref_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _vocab_columns(vocab_ptr, lanes, mask, HAS_VOCAB: tl.constexpr):
    """The token id of each vocabulary lane: ``vocab[lanes]`` with a draft vocabulary, else the lane itself. ``p_d``
    is stored (and the tempered logits parked) at these columns of a full-vocabulary row."""
    cols = lanes
    if HAS_VOCAB:
        cols = tl.load(vocab_ptr + lanes, mask=mask, other=0)
    return cols


@triton.jit
def _vocab_token(vocab_ptr, lane, HAS_VOCAB: tl.constexpr):
    """The token id of one lane (the draw's winner): ``vocab[lane]``, or the lane itself."""
    token = lane.to(tl.int64)
    if HAS_VOCAB:
        token = tl.load(vocab_ptr + lane).to(tl.int64)
    return token


@triton.jit
def _dest_row(probs_rows_ptr, row, HAS_ROWS: tl.constexpr):
    """The ``probs`` row [int64] of request ``row``: ``probs_rows[row]`` (negative: padding), or ``row`` itself."""
    dest = row
    if HAS_ROWS:
        dest = tl.load(probs_rows_ptr + row).to(tl.int64)
    return dest


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _sample_draft_block_kernel(
    tokens_ptr,  # [R, γ] int64 out: x_1..x_γ
    probs_ptr,  # [R or S, γ, V] fp32 out: p_d (also the scratch of the tempered logits between the passes)
    probs_rows_ptr,  # [R] int32/int64: the probs row of each request, negative for padding (read if HAS_ROWS)
    conf_ptr,  # [R, γ] fp32 out: z_k
    base_ptr,  # [R, γ, V] U_k (fp32/fp16/bf16), last dim contiguous
    stride_br,  # base stride over R
    stride_bk,  # base stride over γ
    h_ptr,  # [R, γ, d] backbone output h_k, last dim contiguous
    stride_hr,  # h stride over R
    stride_hk,  # h stride over γ
    anchor_ids_ptr,  # [R] int64 x_0
    anchor_pos_ptr,  # [R] int64 P
    temperature_ptr,  # [R] fp32 T (0 = greedy)
    request_ids_ptr,  # [R] int64 request ids
    w1_ptr,  # [V_out, r] W1 = Embedding(V, r).weight, row-major (indexed by token id)
    w2_ptr,  # [V, r] W2 = Linear(r, V).weight as stored (the draft vocabulary's rows), row-major
    conf_w_ptr,  # [d + r] confidence weight (h part, then the W1 part)
    conf_b_ptr,  # [1] confidence bias
    vocab_ptr,  # [V] int64 token id of each lane (read if HAS_VOCAB)
    seed_lo,  # low 32 bits of the seed
    seed_hi,  # high 32 bits of the seed
    gamma,  # γ
    V,  # vocabulary lanes (Vd with a draft vocabulary)
    V_out,  # length of a probs row (the whole vocabulary)
    d,  # hidden size
    r,  # Markov rank
    HAS_ROWS: tl.constexpr,  # probs rows come from probs_rows_ptr (else request i writes probs row i)
    STORE_GREEDY: tl.constexpr,  # a greedy row writes its one-hot p_d (else it writes no probs at all)
    HAS_VOCAB: tl.constexpr,  # lanes are a draft vocabulary's (token vocab[lane], column vocab[lane] of probs)
    BLOCK_V: tl.constexpr,  # vocabulary tile
    BLOCK_D: tl.constexpr,  # hidden tile
    BLOCK_R: tl.constexpr,  # next power of two >= r
):
    row = tl.program_id(0).to(tl.int64)
    dest = _dest_row(probs_rows_ptr, row, HAS_ROWS)
    if dest < 0:  # padding: no probs row to write, nor to park the logits in
        for j in range(0, gamma):
            tl.store(tokens_ptr + row * gamma + j, 0)
            tl.store(conf_ptr + row * gamma + j, 0.0)
    else:
        rid = tl.load(request_ids_ptr + row)
        anchor = tl.load(anchor_pos_ptr + row)
        prev = tl.load(anchor_ids_ptr + row)
        temp = tl.load(temperature_ptr + row)
        greedy = temp == 0.0
        temp_div = tl.where(greedy, 1.0, temp)  # the reference divides greedy rows by 1 (then takes the one-hot)
        park_len = tl.where(greedy, 0, V)  # lanes whose tempered logits are parked: none for a greedy row
        ranks = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        rank_mask = ranks < r
        conf_w_e = tl.load(conf_w_ptr + d + ranks, mask=rank_mask, other=0.0).to(tl.float32)  # [BLOCK_R]
        conf_b = tl.load(conf_b_ptr).to(tl.float32)

        for j in range(0, gamma):  # slot k = j + 1
            e = tl.load(w1_ptr + prev * r + ranks, mask=rank_mask, other=0.0).to(tl.float32)  # [BLOCK_R] W1[prev]

            # Confidence z_k = conf_w · [h_k; e] + b, before x_k exists.
            z = tl.sum(e * conf_w_e, axis=0)
            for ds in range(0, d, BLOCK_D):
                dims = ds + tl.arange(0, BLOCK_D)  # [BLOCK_D]
                hk = tl.load(h_ptr + row * stride_hr + j * stride_hk + dims, mask=dims < d, other=0.0).to(tl.float32)
                cw = tl.load(conf_w_ptr + dims, mask=dims < d, other=0.0).to(tl.float32)
                z += tl.sum(hk * cw, axis=0)
            tl.store(conf_ptr + row * gamma + j, _round_to(z + conf_b, conf_w_ptr))

            # Pass 1: tempered logits into the probs row, online softmax statistics, greedy argmax.
            out_row = probs_ptr + (dest * gamma + j) * V_out
            run_max = -float("inf")
            run_sum = 0.0
            best = -float("inf")
            best_index = 0
            for start in range(0, V, BLOCK_V):
                lanes = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
                mask = lanes < V
                w2 = tl.load(w2_ptr + lanes[:, None] * r + ranks[None, :], mask=mask[:, None] & rank_mask[None, :],
                             other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
                bias = _round_to(tl.sum(w2 * e[None, :], axis=1), w2_ptr)  # [BLOCK_V] B_k, as Linear returns it
                u_k = tl.load(base_ptr + row * stride_br + j * stride_bk + lanes, mask=mask, other=0.0).to(tl.float32)
                logits = tl.where(mask, u_k + bias, -float("inf"))  # [BLOCK_V]
                best, best_index = argmax_update(best, best_index, logits, lanes)
                x = tl.math.div_rn(logits, temp_div)  # [BLOCK_V]
                park = lanes < park_len
                tl.store(out_row + _vocab_columns(vocab_ptr, lanes, park, HAS_VOCAB), x, mask=park)
                new_max = tl.maximum(run_max, tl.max(x, axis=0))
                # -inf - -inf is NaN: a row that is -inf so far keeps its zero sum (the reference needs one finite
                # logit).
                scale = tl.where(new_max == run_max, 1.0, tl.exp(run_max - new_max))
                run_sum = run_sum * scale + tl.sum(tl.where(x > -float("inf"), tl.exp(x - new_max), 0.0), axis=0)
                run_max = new_max
            # Pass 2 reads lanes another thread of this program wrote in pass 1 (the W2 reduction has its own layout).
            tl.debug_barrier()

            # Pass 2: p_d in place and the exponential race for x_k.
            if greedy:
                # p_d is the one-hot of the argmax, and a race over a one-hot returns its hot lane (its score 1 / E is
                # positive and finite, every other lane scores 0; best_index always lies in [0, V)): x_k is the
                # argmax, without draws and without reading the row (nothing was parked in it).
                if STORE_GREEDY:
                    for start in range(0, V, BLOCK_V):
                        lanes = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
                        mask = lanes < V
                        tl.store(out_row + _vocab_columns(vocab_ptr, lanes, mask, HAS_VOCAB),
                                 (lanes == best_index).to(tl.float32), mask=mask)
                x_k = _vocab_token(vocab_ptr, best_index, HAS_VOCAB)
            else:
                key = hash_key(seed_lo, seed_hi, rid, anchor + j + 1, PURPOSE_DRAFT + 16 * (j + 1))
                race_score = -1.0
                race_index = 0
                for start in range(0, V, BLOCK_V):
                    lanes = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
                    mask = lanes < V
                    cols = _vocab_columns(vocab_ptr, lanes, mask, HAS_VOCAB)
                    x = tl.load(out_row + cols, mask=mask, other=-float("inf"))  # [BLOCK_V]
                    p = tl.math.div_rn(tl.exp(x - run_max), run_sum)  # [BLOCK_V] p_d
                    tl.store(out_row + cols, p, mask=mask)
                    race_score, race_index = race_update(race_score, race_index, p, exponential_at(key, lanes),
                                                         lanes, mask)
                x_k = _vocab_token(vocab_ptr, race_index, HAS_VOCAB)
            tl.store(tokens_ptr + row * gamma + j, x_k)
            prev = x_k


@triton.jit(do_not_specialize=["j"])
def _draft_split_logits_kernel(
    tokens_ptr,  # [R, γ] int64 in: x_{k-1} (slot j - 1), read when j >= 1
    probs_ptr,  # [R or S, γ, V] fp32 out: the tempered logits of slot k (scratch; launch B turns them into p_d)
    probs_rows_ptr,  # [R] int32/int64: the probs row of each request, negative for padding (read if HAS_ROWS)
    conf_ptr,  # [R, γ] fp32 out: z_k, written by block 0
    base_ptr,  # [R, γ, V] U_k (fp32/fp16/bf16), last dim contiguous
    stride_br,  # base stride over R
    stride_bk,  # base stride over γ
    h_ptr,  # [R, γ, d] backbone output h_k, last dim contiguous
    stride_hr,  # h stride over R
    stride_hk,  # h stride over γ
    anchor_ids_ptr,  # [R] int64 x_0, read when j = 0
    temperature_ptr,  # [R] fp32 T (0 = greedy)
    w1_ptr,  # [V_out, r] W1, row-major (indexed by token id)
    w2_ptr,  # [V, r] W2 as stored (the draft vocabulary's rows), row-major
    conf_w_ptr,  # [d + r] confidence weight (h part, then the W1 part)
    conf_b_ptr,  # [1] confidence bias
    vocab_ptr,  # [V] int64 token id of each lane (read if HAS_VOCAB)
    block_max_ptr,  # [R, NB] fp32 out: max of the block's tempered logits
    block_sum_ptr,  # [R, NB] fp32 out: sum of exp(x - block max) over the block
    arg_value_ptr,  # [R, NB] fp32 out: the block's greedy maximum of the (untempered) logits
    arg_index_ptr,  # [R, NB] int64 out: its lowest index
    row_max_ptr,  # [R] fp32 out (FUSED): the stats of a sampled row, as the stats launch writes them
    row_sum_ptr,  # [R] fp32 out (FUSED)
    counter_ptr,  # [R] int32 (FUSED): the row's programs done so far, zero before and after the launch
    j,  # slot index k - 1
    gamma,  # γ
    V,  # vocabulary lanes (Vd with a draft vocabulary)
    V_out,  # length of a probs row (the whole vocabulary)
    d,  # hidden size
    r,  # Markov rank
    nb,  # NB, vocabulary blocks per row
    HAS_ROWS: tl.constexpr,  # probs rows come from probs_rows_ptr (else request i writes probs row i)
    HAS_VOCAB: tl.constexpr,  # lanes are a draft vocabulary's (column vocab[lane] of probs)
    FUSED: tl.constexpr,  # the row's last program does the stats launch's work (no S launch)
    BLOCK_V: tl.constexpr,  # vocabulary block of one program
    BLOCK_D: tl.constexpr,  # hidden tile
    BLOCK_R: tl.constexpr,  # next power of two >= r
    BLOCK_NB: tl.constexpr,  # next power of two >= NB (FUSED)
):
    """Launch A_k, one program per (request, vocabulary block): ``z_k`` (block 0) and the block's partials; with
    ``FUSED``, the last of the row's programs also combines them (launch S's work)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    dest = _dest_row(probs_rows_ptr, row, HAS_ROWS)
    if dest < 0:  # a padding row's zeros: from the stats launch, or here when it is fused away
        if FUSED and blk == 0:
            tl.store(tokens_ptr + row * gamma + j, 0)
            tl.store(conf_ptr + row * gamma + j, 0.0)
    else:
        if j == 0:
            prev = tl.load(anchor_ids_ptr + row)
        else:  # x_{k-1}, reduced once for the row by slot k-1's stats (greedy) or winner (sampled) launch
            prev = tl.load(tokens_ptr + row * gamma + j - 1)
        temp = tl.load(temperature_ptr + row)
        temp_div = tl.where(temp == 0.0, 1.0, temp)  # the reference divides greedy rows by 1 (then takes the one-hot)
        ranks = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        rank_mask = ranks < r
        e = tl.load(w1_ptr + prev * r + ranks, mask=rank_mask, other=0.0).to(tl.float32)  # [BLOCK_R] W1[prev]

        if blk == 0:
            # Confidence z_k = conf_w · [h_k; e] + b, before x_k exists.
            conf_w_e = tl.load(conf_w_ptr + d + ranks, mask=rank_mask, other=0.0).to(tl.float32)  # [BLOCK_R]
            z = tl.sum(e * conf_w_e, axis=0)
            for ds in range(0, d, BLOCK_D):
                dims = ds + tl.arange(0, BLOCK_D)  # [BLOCK_D]
                hk = tl.load(h_ptr + row * stride_hr + j * stride_hk + dims, mask=dims < d, other=0.0).to(tl.float32)
                cw = tl.load(conf_w_ptr + dims, mask=dims < d, other=0.0).to(tl.float32)
                z += tl.sum(hk * cw, axis=0)
            tl.store(conf_ptr + row * gamma + j, _round_to(z + tl.load(conf_b_ptr).to(tl.float32), conf_w_ptr))

        # The block's tempered logits (the one-program kernel's pass 1 on one tile).
        lanes = blk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        w2 = tl.load(w2_ptr + lanes[:, None] * r + ranks[None, :], mask=mask[:, None] & rank_mask[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
        bias = _round_to(tl.sum(w2 * e[None, :], axis=1), w2_ptr)  # [BLOCK_V] B_k, as Linear returns it
        u_k = tl.load(base_ptr + row * stride_br + j * stride_bk + lanes, mask=mask, other=0.0).to(tl.float32)
        logits = tl.where(mask, u_k + bias, -float("inf"))  # [BLOCK_V]
        best, best_index = argmax_update(-float("inf"), 0, logits, lanes)
        x = tl.math.div_rn(logits, temp_div)  # [BLOCK_V]
        # Parked for launch B's softmax; a greedy row's p_d is the one-hot, written there without reading this (the
        # condition as a vector: the interpreter's `&` wants two).
        parked = mask & ((lanes * 0 + temp) != 0.0)  # [BLOCK_V]
        tl.store(probs_ptr + (dest * gamma + j) * V_out + _vocab_columns(vocab_ptr, lanes, parked, HAS_VOCAB), x,
                 mask=parked)
        x_max = tl.max(x, axis=0)
        # An all -inf block keeps a zero sum (shifting by 0 instead: -inf - -inf is NaN).
        x_sum = tl.sum(tl.exp(x - tl.where(x_max > -float("inf"), x_max, 0.0)), axis=0)
        part = row * nb + blk
        tl.store(block_max_ptr + part, x_max)
        tl.store(block_sum_ptr + part, x_sum)
        tl.store(arg_value_ptr + part, best)
        tl.store(arg_index_ptr + part, best_index.to(tl.int64))
        if FUSED:
            if _last_of(counter_ptr + row, nb):
                _row_stats(row, tokens_ptr, temperature_ptr, block_max_ptr, block_sum_ptr, arg_value_ptr,
                           arg_index_ptr, row_max_ptr, row_sum_ptr, vocab_ptr, j, gamma, nb, HAS_VOCAB, BLOCK_NB)


@triton.jit(do_not_specialize=["j"])
def _draft_split_logits_rows_kernel(
    tokens_ptr, probs_ptr, probs_rows_ptr, conf_ptr,  # x_{k-1} in, the rest out, as in _draft_split_logits_kernel
    base_ptr, stride_br, stride_bk, h_ptr, stride_hr, stride_hk, anchor_ids_ptr, temperature_ptr,
    w1_ptr, w2_ptr, conf_w_ptr, conf_b_ptr, vocab_ptr,
    block_max_ptr, block_sum_ptr, arg_value_ptr, arg_index_ptr,  # [R, NB] out
    row_max_ptr, row_sum_ptr,  # [R] out (FUSED)
    counter_ptr,  # [cdiv(R, BLOCK_M)] int32 (FUSED): per group of BLOCK_M requests, as in _draft_split_logits_kernel
    j, gamma,
    R,  # requests (the last program's rows past R are masked out)
    V, V_out, d, r, nb,
    HAS_ROWS: tl.constexpr,
    HAS_VOCAB: tl.constexpr,
    FUSED: tl.constexpr,  # the group's last program does the stats launch's work for its BLOCK_M requests
    BLOCK_M: tl.constexpr,  # requests per program (>= 16: the tl.dot minimum)
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= max(r, 16)
    BLOCK_NB: tl.constexpr,  # next power of two >= NB (FUSED)
):
    """:func:`_draft_split_logits_kernel` for BLOCK_M requests at once (grid ``(cdiv(R, BLOCK_M), NB)``): the
    block's W2 tile is loaded once and ``B_k = W1[prev] · W2ᵀ`` is one ``[BLOCK_M, r] × [r, BLOCK_V]`` product
    (float32, IEEE: the products of half-precision weights are exact, only the order of their sum differs from the
    one-row kernel's). Every other step is that kernel's, row by row; a padding row (``probs_rows`` < 0) reads and
    writes nothing (the stats launch stores its zeros)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    row_ok = rows < R
    dest = rows  # [BLOCK_M] the probs row of each request
    if HAS_ROWS:
        dest = tl.load(probs_rows_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    live = row_ok & (dest >= 0)  # [BLOCK_M] requests past R and padding rows are masked out of every access
    blk = tl.program_id(1)
    if j == 0:
        prev = tl.load(anchor_ids_ptr + rows, mask=live, other=0)  # [BLOCK_M]
    else:  # x_{k-1}, reduced once per row by slot k-1's stats (greedy) or winner (sampled) launch
        prev = tl.load(tokens_ptr + rows * gamma + j - 1, mask=live, other=0)  # [BLOCK_M]
    temp = tl.load(temperature_ptr + rows, mask=live, other=0.0)  # [BLOCK_M]
    temp_div = tl.where(temp == 0.0, 1.0, temp)
    ranks = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rank_mask = ranks < r
    e = tl.load(w1_ptr + prev[:, None] * r + ranks[None, :], mask=live[:, None] & rank_mask[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_R] W1[prev]

    if blk == 0:
        conf_w_e = tl.load(conf_w_ptr + d + ranks, mask=rank_mask, other=0.0).to(tl.float32)  # [BLOCK_R]
        z = tl.sum(e * conf_w_e[None, :], axis=1)  # [BLOCK_M]
        for ds in range(0, d, BLOCK_D):
            dims = ds + tl.arange(0, BLOCK_D)  # [BLOCK_D]
            hk = tl.load(h_ptr + rows[:, None] * stride_hr + j * stride_hk + dims[None, :],
                         mask=live[:, None] & (dims[None, :] < d), other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
            cw = tl.load(conf_w_ptr + dims, mask=dims < d, other=0.0).to(tl.float32)
            z += tl.sum(hk * cw[None, :], axis=1)
        z = _round_to(z + tl.load(conf_b_ptr).to(tl.float32), conf_w_ptr)  # [BLOCK_M]
        tl.store(conf_ptr + rows * gamma + j, z, mask=live)

    lanes = blk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    lane_ok = lanes < V
    w2 = tl.load(w2_ptr + lanes[:, None] * r + ranks[None, :], mask=lane_ok[:, None] & rank_mask[None, :],
                 other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R], read once for BLOCK_M requests
    bias = _round_to(tl.dot(e, tl.trans(w2), input_precision="ieee"), w2_ptr)  # [BLOCK_M, BLOCK_V] B_k
    both = live[:, None] & lane_ok[None, :]
    u_k = tl.load(base_ptr + rows[:, None] * stride_br + j * stride_bk + lanes[None, :], mask=both,
                  other=0.0).to(tl.float32)
    logits = tl.where(lane_ok[None, :], u_k + bias, -float("inf"))  # [BLOCK_M, BLOCK_V]
    best = tl.max(logits, axis=1)  # [BLOCK_M] the block's greedy maximum, its lowest index (argmax_update's rule)
    best_index = tl.min(tl.where(logits == best[:, None], lanes[None, :], BIG_INDEX), axis=1)
    best_index = tl.where(best > -float("inf"), best_index, 0)
    x = tl.math.div_rn(logits, temp_div[:, None])  # [BLOCK_M, BLOCK_V]
    parked = both & (temp[:, None] != 0.0)  # a greedy row's p_d is launch B's one-hot
    cols = _vocab_columns(vocab_ptr, lanes, lane_ok, HAS_VOCAB)  # [BLOCK_V]
    tl.store(probs_ptr + (dest[:, None] * gamma + j) * V_out + cols[None, :], x, mask=parked)
    x_max = tl.max(x, axis=1)  # [BLOCK_M]
    x_sum = tl.sum(tl.exp(x - tl.where(x_max > -float("inf"), x_max, 0.0)[:, None]), axis=1)
    part = rows * nb + blk
    tl.store(block_max_ptr + part, x_max, mask=live)
    tl.store(block_sum_ptr + part, x_sum, mask=live)
    tl.store(arg_value_ptr + part, best, mask=live)
    tl.store(arg_index_ptr + part, best_index.to(tl.int64), mask=live)
    if FUSED:
        if _last_of(counter_ptr + tl.program_id(0), nb):  # the group's rows, one by one, as the stats launch does
            for i in range(0, BLOCK_M):
                row = tl.program_id(0).to(tl.int64) * BLOCK_M + i
                if row < R:
                    if _dest_row(probs_rows_ptr, row, HAS_ROWS) < 0:
                        tl.store(tokens_ptr + row * gamma + j, 0)
                        tl.store(conf_ptr + row * gamma + j, 0.0)
                    else:
                        _row_stats(row, tokens_ptr, temperature_ptr, block_max_ptr, block_sum_ptr, arg_value_ptr,
                                   arg_index_ptr, row_max_ptr, row_sum_ptr, vocab_ptr, j, gamma, nb, HAS_VOCAB,
                                   BLOCK_NB)


@triton.jit
def _row_stats(row, tokens_ptr, temperature_ptr, block_max_ptr, block_sum_ptr, arg_value_ptr, arg_index_ptr,
               row_max_ptr, row_sum_ptr, vocab_ptr, j, gamma, nb, HAS_VOCAB: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Launch S_k's work on one live row: its NB partials of launch A combined once, in one fixed order — a greedy row's
    argmax into ``tokens`` (its ``x_k``), a sampled row's softmax max and sum into ``row_max`` / ``row_sum``. The
    partials are read from L2 (``.cg``): with fused reductions they were written by other programs of the running
    launch, and this SM's L1 may hold older lines of them."""
    blocks = tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    valid = blocks < nb
    if tl.load(temperature_ptr + row) == 0.0:
        # A greedy row's p_d is the one-hot of its argmax, and a race over a one-hot returns its hot lane (its score
        # 1 / E is positive and finite, every other lane scores 0): x_k is the argmax, no race needed.
        values = tl.load(arg_value_ptr + row * nb + blocks, mask=valid, other=-float("inf"),
                         cache_modifier=".cg")  # [BLOCK_NB]
        indices = tl.load(arg_index_ptr + row * nb + blocks, mask=valid, other=0,
                          cache_modifier=".cg")  # [BLOCK_NB] int64
        best = tl.max(values, axis=0)
        # Lowest index among the blocks holding the maximum: blocks cover ascending lanes and each reports its lowest
        # maximal lane, so this is the serial argmax's first maximum.
        best_index = tl.min(tl.where(valid & (values == best), indices, BIG_INDEX), axis=0)
        tl.store(tokens_ptr + row * gamma + j, _vocab_token(vocab_ptr, best_index, HAS_VOCAB))
    else:
        maxes = tl.load(block_max_ptr + row * nb + blocks, mask=valid, other=-float("inf"),
                        cache_modifier=".cg")  # [BLOCK_NB]
        sums = tl.load(block_sum_ptr + row * nb + blocks, mask=valid, other=0.0, cache_modifier=".cg")  # [BLOCK_NB]
        run_max = tl.max(maxes, axis=0)
        run_sum = tl.sum(tl.where(maxes > -float("inf"), sums * tl.exp(maxes - run_max), 0.0), axis=0)
        tl.store(row_max_ptr + row, run_max)
        tl.store(row_sum_ptr + row, run_sum)


@triton.jit
def _last_of(counter_ptr, nb):
    """Whether this program is the last of the ``nb`` programs sharing ``counter_ptr`` to get here (fused reductions:
    that one reduces what all of them wrote). Every thread's stores are ordered before the ticket (the barrier, then
    the atomic's release); the last program's acquire orders its reads of them after it. The last resets the counter
    for the next launch."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == nb - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit(do_not_specialize=["j"])
def _draft_split_stats_kernel(
    tokens_ptr,  # [R, γ] int64 out: x_k of a greedy row (its argmax), 0 for a padding row
    conf_ptr,  # [R, γ] fp32 out: z_k = 0 for a padding row
    probs_rows_ptr,  # [R] int32/int64: negative for padding rows (read if HAS_ROWS)
    temperature_ptr,  # [R] fp32 T (0 = greedy)
    block_max_ptr,  # [R, NB] fp32 in: launch A's partials
    block_sum_ptr,  # [R, NB] fp32 in
    arg_value_ptr,  # [R, NB] fp32 in
    arg_index_ptr,  # [R, NB] int64 in
    row_max_ptr,  # [R] fp32 out: the softmax max of a sampled row's tempered logits
    row_sum_ptr,  # [R] fp32 out: its sum of exp(x - max)
    vocab_ptr,  # [V] int64 token id of each lane (read if HAS_VOCAB)
    j,  # slot index k - 1
    gamma,  # γ
    nb,  # NB, vocabulary blocks per row
    HAS_ROWS: tl.constexpr,  # padding rows are marked in probs_rows_ptr
    HAS_VOCAB: tl.constexpr,  # lanes are a draft vocabulary's (token vocab[lane])
    BLOCK_NB: tl.constexpr,  # next power of two >= NB
):
    """Launch S_k, one program per request: the row's NB partials of launch A combined once, in one fixed order."""
    row = tl.program_id(0).to(tl.int64)
    if _dest_row(probs_rows_ptr, row, HAS_ROWS) < 0:  # padding: launch A wrote no partials, B and W skip the row
        tl.store(tokens_ptr + row * gamma + j, 0)
        tl.store(conf_ptr + row * gamma + j, 0.0)
    else:
        _row_stats(row, tokens_ptr, temperature_ptr, block_max_ptr, block_sum_ptr, arg_value_ptr, arg_index_ptr,
                   row_max_ptr, row_sum_ptr, vocab_ptr, j, gamma, nb, HAS_VOCAB, BLOCK_NB)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "j"])
def _draft_split_race_kernel(
    tokens_ptr,  # [R, γ] int64 in: x_k of a greedy row (read if STORE_GREEDY); out (FUSED): x_k of a sampled row
    probs_ptr,  # [R or S, γ, V] fp32 in: tempered logits of slot k; out: p_d
    probs_rows_ptr,  # [R] int32/int64: the probs row of each request, negative for padding (read if HAS_ROWS)
    anchor_pos_ptr,  # [R] int64 P
    temperature_ptr,  # [R] fp32 T (0 = greedy)
    request_ids_ptr,  # [R] int64 request ids
    row_max_ptr,  # [R] fp32 in: the stats launch's softmax max
    row_sum_ptr,  # [R] fp32 in: its sum
    race_score_ptr,  # [R, NB] fp32 out: the block's best p_d / E
    race_index_ptr,  # [R, NB] int64 out: its lowest index
    counter_ptr,  # [R] int32 (FUSED): the row's programs done so far, zero before and after the launch
    vocab_ptr,  # [V] int64 token id of each lane (read if HAS_VOCAB)
    seed_lo,  # low 32 bits of the seed
    seed_hi,  # high 32 bits of the seed
    j,  # slot index k - 1
    gamma,  # γ
    V,  # vocabulary lanes (Vd with a draft vocabulary)
    V_out,  # length of a probs row (the whole vocabulary)
    nb,  # NB, vocabulary blocks per row
    HAS_ROWS: tl.constexpr,  # probs rows come from probs_rows_ptr (else request i writes probs row i)
    STORE_GREEDY: tl.constexpr,  # a greedy row writes its one-hot p_d (else it writes no probs at all)
    HAS_VOCAB: tl.constexpr,  # lanes are a draft vocabulary's (column vocab[lane] of probs)
    FUSED: tl.constexpr,  # the row's last program picks the race winner (launch W's work; no W launch)
    BLOCK_V: tl.constexpr,  # vocabulary block of one program
    BLOCK_NB: tl.constexpr,  # next power of two >= NB (FUSED)
):
    """Launch B_k, one program per (request, vocabulary block): the block's ``p_d`` and its part of the race; with
    ``FUSED``, the last of a sampled row's programs also picks the winner (launch W's work)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    dest = _dest_row(probs_rows_ptr, row, HAS_ROWS)
    if dest >= 0:  # a padding row has no logits parked and no race: the stats launch wrote its zeros
        lanes = blk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        cols = _vocab_columns(vocab_ptr, lanes, mask, HAS_VOCAB)  # [BLOCK_V] token id = probs column of each lane
        out_row = probs_ptr + (dest * gamma + j) * V_out
        if tl.load(temperature_ptr + row) == 0.0:
            # The stats launch already wrote x_k, the argmax; launch A parked nothing. Only the one-hot p_d is left.
            if STORE_GREEDY:
                hot = tl.load(tokens_ptr + row * gamma + j)
                tl.store(out_row + cols, (cols == hot).to(tl.float32), mask=mask)
        else:
            run_max = tl.load(row_max_ptr + row)  # the same bits for every block of the row
            run_sum = tl.load(row_sum_ptr + row)
            x = tl.load(out_row + cols, mask=mask, other=-float("inf"))  # [BLOCK_V]
            p = tl.math.div_rn(tl.exp(x - run_max), run_sum)  # [BLOCK_V] p_d
            tl.store(out_row + cols, p, mask=mask)
            # Purpose 1 + 16k; the runtime `j` first (the interpreter cannot add a tensor to a constexpr on the
            # left).
            rid = tl.load(request_ids_ptr + row)
            anchor = tl.load(anchor_pos_ptr + row)
            key = hash_key(seed_lo, seed_hi, rid, anchor + j + 1, 16 * (j + 1) + PURPOSE_DRAFT)
            race_score, race_index = race_update(-1.0, 0, p, exponential_at(key, lanes), lanes, mask)
            tl.store(race_score_ptr + row * nb + blk, race_score)
            tl.store(race_index_ptr + row * nb + blk, race_index.to(tl.int64))
            if FUSED:
                if _last_of(counter_ptr + row, nb):
                    lane = race_winner(race_score_ptr, race_index_ptr, row, nb, BLOCK_NB)
                    tl.store(tokens_ptr + row * gamma + j, _vocab_token(vocab_ptr, lane, HAS_VOCAB))


@triton.jit(do_not_specialize=["j"])
def _draft_split_winner_kernel(
    tokens_ptr,  # [R, γ] int64 out: x_k of a sampled row
    probs_rows_ptr,  # [R] int32/int64: negative for padding rows (read if HAS_ROWS)
    temperature_ptr,  # [R] fp32 T (0 = greedy)
    race_score_ptr,  # [R, NB] fp32 in: slot k's race partials (sampled rows only)
    race_index_ptr,  # [R, NB] int64 in
    vocab_ptr,  # [V] int64 token id of each lane (read if HAS_VOCAB)
    j,  # slot index k - 1
    gamma,  # γ
    nb,  # NB, vocabulary blocks per row
    HAS_ROWS: tl.constexpr,  # padding rows are marked in probs_rows_ptr
    HAS_VOCAB: tl.constexpr,  # lanes are a draft vocabulary's (token vocab[lane])
    BLOCK_NB: tl.constexpr,  # next power of two >= NB
):
    """Launch W_k, one program per request: a sampled row's race winner from its NB partials, reduced once."""
    row = tl.program_id(0).to(tl.int64)
    if _dest_row(probs_rows_ptr, row, HAS_ROWS) >= 0:
        if tl.load(temperature_ptr + row) != 0.0:  # greedy and padding rows ran no race: the stats launch wrote x_k
            lane = race_winner(race_score_ptr, race_index_ptr, row, nb, BLOCK_NB)
            tl.store(tokens_ptr + row * gamma + j, _vocab_token(vocab_ptr, lane, HAS_VOCAB))


def _sample_draft_block_torch(base_logits, h, anchor_ids, anchor_pos, temperature, seed, rid, w1, w2, conf_w, conf_b,
                              vocab=None):
    """Torch fallback: the same loop with torch ops (the reference's arithmetic, sync-free). With ``vocab`` the loop
    runs over its lanes and maps the draws and ``p_d`` to token ids, as ``DSparkDrafter.sample_block`` does."""
    R, gamma, V = base_logits.shape
    temp = temperature.float()[:, None]  # [R, 1]
    greedy = temp == 0
    prev = anchor_ids  # [R]
    tokens, probs, confs = [], [], []
    for k in range(1, gamma + 1):
        e = F.embedding(prev, w1)  # [R, r]
        logits = base_logits[:, k - 1].float() + F.linear(e, w2).float()  # [R, V]
        soft = torch.softmax(logits / torch.where(greedy, torch.ones_like(temp), temp), dim=-1)  # [R, V]
        one_hot = F.one_hot(logits.argmax(dim=-1), V).float()  # [R, V]
        p_d = torch.where(greedy, one_hot, soft)  # [R, V]
        x_k = sample(p_d, seed, rid, anchor_pos + k, draft_purpose(k), backend="torch")  # [R]
        if vocab is not None:  # lane j is token vocab[j]
            x_k = vocab[x_k]
            p_d = p_d.new_zeros(R, w1.shape[0]).index_copy_(1, vocab, p_d)  # [R, V_out]
        z_in = torch.cat((h[:, k - 1].to(conf_w.dtype), e.to(conf_w.dtype)), dim=-1)  # [R, d + r]
        confs.append(F.linear(z_in, conf_w[None, :], conf_b).squeeze(-1).float())
        tokens.append(x_k)
        probs.append(p_d)
        prev = x_k
    return DraftOutput(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1),
                       conf_logits=torch.stack(confs, dim=1))


def _scatter_rows(probs_out: Tensor, probs: Tensor, probs_rows: Tensor) -> None:
    """``probs_out[probs_rows[i]] = probs[i]`` for every ``probs_rows[i] >= 0``, sync-free (CUDA-graph capturable).

    A boolean mask would sync (``nonzero``), so every request is scattered and a padding row goes to slot 0 with the
    value slot 0 ends up with anyway (its request's ``p_d`` if a live row names it, else its current content): every
    duplicate index carries identical bits, and the rows not named keep theirs.
    """
    S, R = probs_out.shape[0], probs.shape[0]
    live = probs_rows >= 0  # [R]
    owner = torch.full((S + 1,), -1, dtype=torch.int64, device=probs.device)  # [S + 1] request writing each slot
    owner.index_copy_(0, torch.where(live, probs_rows, S).long(), torch.arange(R, device=probs.device))  # S: trash
    slot0 = torch.where(owner[0] >= 0, probs.index_select(0, owner[:1].clamp(min=0))[0], probs_out[0])  # [γ, V]
    values = torch.where(live[:, None, None], probs, slot0)  # [R, γ, V]
    probs_out.index_put_((torch.where(live, probs_rows, 0).long(),), values)


def sample_draft_block(
    base_logits: Tensor,
    h: Tensor,
    anchor_ids: Tensor,
    anchor_pos: Tensor,
    temperature: Tensor,
    seed: int,
    request_ids: Tensor,
    w1: Tensor,
    w2: Tensor,
    conf_w: Tensor,
    conf_b: Tensor,
    backend: str = "auto",
    *,
    split: bool | None = None,
    split_rows: int | None = None,
    probs_out: Tensor | None = None,
    probs_rows: Tensor | None = None,
    store_greedy: bool = True,
    vocab: Tensor | None = None,
    fused_reductions: bool | None = None,
    split_tile: int | None = None,
    split_warps: int | None = None,
) -> DraftOutput:
    """Sample a Markov-head block and its confidence logits (the loop in the module docstring).

    Args:
        base_logits: ``[R, γ, V]`` ``U_k = lm_head(h_k)`` (fp32/fp16/bf16, read as float32; the engine passes the
            LM head's dtype).
        h: ``[R, γ, d]`` backbone output.
        anchor_ids: ``[R]`` int64 anchors ``x_0``.
        anchor_pos: ``[R]`` int64 anchor positions ``P``; slot ``k`` draws at ``P + k``.
        temperature: ``[R]`` float, 0 for greedy rows.
        seed: generation seed.
        request_ids: ``[R]`` request ids.
        w1: ``[V, r]`` ``MarkovHead.w1.weight`` (``Embedding(V, r)``).
        w2: ``[V, r]`` ``MarkovHead.w2.weight`` exactly as stored by ``Linear(r, V, bias=False)``; same dtype as w1.
        conf_w: ``[d + r]`` (or ``[1, d + r]``) ``conf_head.weight``: the ``h_k`` part, then the ``W1`` part.
        conf_b: ``[1]`` (or 0-d) ``conf_head.bias``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        split: Triton variant: ``True`` the split-vocabulary kernels (grid ``(R, NB)``), ``False`` one program per
            request, ``None`` split on CUDA when ``R < SPLIT_MAX_R``. Ignored by the torch backend.
        split_rows: requests per program of the split variant's logits launch: 1, or a power of two >= 16 (W2's
            block shared by that many requests); ``None``: :func:`split_launch`'s choice for R.
        probs_out: optional contiguous ``[R, γ, V]`` float32 buffer the draft distributions are written into (and
            returned as). The engine's draft graphs pass views of one static buffer, so the graphs of all request
            buckets share it instead of each keeping its own output (5.5 GiB over the buckets of 256 requests at
            V = 49,152 and γ = 7).
        probs_rows: optional ``[R]`` int32/int64 device tensor that sends request ``i``'s distributions to row
            ``probs_rows[i]`` of ``probs_out``, which is then a contiguous float32 ``[S, γ, V]`` buffer of any
            ``S >= 1`` (the engine's per-slot state; ``probs_out`` is required). Non-negative entries must be
            distinct and ``< S`` (not checked: a check would sync). A negative entry marks a padding row: nothing is
            written to ``probs_out`` for it (its work is skipped) and its tokens and confidence logits are 0. Rows
            of ``probs_out`` that no entry names are left untouched (the torch backend rewrites slot 0 with the
            bits it ends up with anyway).
        store_greedy: ``False``: a greedy row (``T = 0``) writes no ``p_d`` (its one-hot of ``x_k``, implicit for
            ``verify.rejection_sample(draft_onehot=...)``): its rows of ``probs_out`` are left untouched, or, without
            ``probs_out``, its rows of the returned ``probs`` are unspecified. Tokens, confidence logits and the other
            rows' ``p_d`` are the same bits as with ``True``.
        vocab: a draft vocabulary, ``[Vd]`` int64 ascending token ids (``DSparkDrafter.draft_vocab``), or None.
            Then ``base_logits`` is ``[R, γ, Vd]`` and ``w2`` ``[Vd, r]`` (their rows for those tokens), ``w1``
            stays ``[V, r]`` (indexed by token id), lane ``j`` of the draw is token ``vocab[j]``, and ``p_d`` is
            written into full ``[.., V]`` rows at columns ``vocab`` only: the other columns of ``probs_out`` are
            never written (the engine's buffer is zero there, so ``p_d`` is 0 outside the vocabulary).
        fused_reductions: the split variant's per-row reductions done by the last program of each row in the logits
            and race launches (2γ launches instead of 4γ; the same arithmetic in the same order, so the same bits);
            ``None``: :func:`split_launch`'s choice for R.
        split_tile: the split variant's W2 tile, ``BLOCK_V · BLOCK_R`` products a program (a power of two >= 16;
            ``None``: :func:`split_launch`'s choice for R). A wider tile means fewer vocabulary blocks: the softmax
            sums combine other partials, so sampled rows' ``p_d`` may differ in the last ulp; greedy tokens do not
            change.
        split_warps: warps a program of the split variant's launches (``None``: :func:`split_launch`'s choice).

    Returns:
        :class:`reference.drafter.DraftOutput`: tokens ``[R, γ]`` int64, probs ``[R, γ, V]`` fp32 (with
        ``probs_rows``: ``probs_out`` itself, the whole ``[S, γ, V]`` buffer, so ``probs[probs_rows[i]]`` is request
        ``i``'s block), conf_logits ``[R, γ]`` fp32.
    """
    if base_logits.ndim != 3 or h.ndim != 3 or base_logits.shape[:2] != h.shape[:2]:
        raise ValueError(f"base_logits [R, γ, V] and h [R, γ, d] disagree: {tuple(base_logits.shape)} vs "
                         f"{tuple(h.shape)}")
    R, gamma, V = base_logits.shape  # V: the lanes drawn from (Vd with a draft vocabulary)
    d = h.shape[2]
    if gamma < 1 or V < 1:
        raise ValueError(f"need γ >= 1 and V >= 1, got base_logits {tuple(base_logits.shape)}")
    v_out = V if vocab is None else w1.shape[0]  # the length of a p_d row: the whole vocabulary
    if vocab is not None and (vocab.shape != (V,) or vocab.dtype != torch.int64 or vocab.device != base_logits.device
                              or V > v_out):
        raise ValueError(f"vocab must be an int64 [Vd={V}] tensor on {base_logits.device} (the lanes of base_logits), "
                         f"at most w1's {v_out} rows, got {vocab.dtype} {tuple(vocab.shape)} on {vocab.device}")
    if (w1.ndim != 2 or w1.shape[0] != v_out or w2.ndim != 2 or w2.shape != (V, w1.shape[1])
            or w1.dtype != w2.dtype):
        raise ValueError(f"w1 and w2 must be [V={v_out}, r] and [{V}, r] of one dtype (Embedding(V, r).weight and "
                         f"Linear(r, V).weight{', its draft-vocabulary rows' if vocab is not None else ''}), got "
                         f"{tuple(w1.shape)} {w1.dtype} and {tuple(w2.shape)} {w2.dtype}")
    r = w1.shape[1]
    conf_w = conf_w.reshape(-1)
    conf_b = torch.as_tensor(conf_b, device=conf_w.device).reshape(-1)
    if conf_w.shape != (d + r,) or conf_b.shape != (1,):
        raise ValueError(f"conf_w must hold d + r = {d + r} weights and conf_b one bias, got "
                         f"{tuple(conf_w.shape)} and {tuple(conf_b.shape)}")
    dev = base_logits.device
    anchor_ids = per_row_words(anchor_ids, R, dev, "anchor_ids")  # [R]
    anchor_pos = per_row_words(anchor_pos, R, dev, "anchor_pos")  # [R]
    rid = per_row_words(request_ids, R, dev, "request_ids")  # [R]
    temperature = torch.as_tensor(temperature, device=dev)
    if temperature.shape != (R,) or not temperature.dtype.is_floating_point:
        raise ValueError(f"temperature must be a float tensor [R={R}], got {temperature.dtype} "
                         f"{tuple(temperature.shape)}")
    if probs_rows is not None:
        if probs_out is None:
            raise ValueError("probs_rows needs probs_out, the [S, γ, V] buffer its entries index")
        if probs_rows.shape != (R,) or probs_rows.dtype not in (torch.int32, torch.int64) or probs_rows.device != dev:
            raise ValueError(f"probs_rows must be an int32/int64 [R={R}] tensor on {dev}, got {probs_rows.dtype} "
                             f"{tuple(probs_rows.shape)} on {probs_rows.device}")
    rows_out = R if probs_rows is None else "S"
    if probs_out is not None and (probs_out.shape[1:] != (gamma, v_out) or probs_out.shape[0] < 1
                                  or (probs_rows is None and probs_out.shape[0] != R)
                                  or probs_out.dtype != torch.float32 or probs_out.device != dev
                                  or not probs_out.is_contiguous()):
        raise ValueError(f"probs_out must be a contiguous float32 [{rows_out}, γ={gamma}, V={v_out}] tensor on {dev}, "
                         f"got {probs_out.dtype} {tuple(probs_out.shape)} on {probs_out.device}")
    lo, hi = split_seed(seed)
    if resolve_backend(backend, base_logits) == "torch":
        out = _sample_draft_block_torch(base_logits, h, anchor_ids, anchor_pos, temperature, seed, rid,
                                        w1, w2, conf_w, conf_b.to(conf_w.dtype), vocab)
        if probs_out is None:
            return out
        greedy = temperature == 0  # [R]
        if probs_rows is None:
            probs = out.probs if store_greedy else torch.where(greedy[:, None, None], probs_out, out.probs)  # [R, γ, V]
            return DraftOutput(tokens=out.tokens, probs=probs_out.copy_(probs), conf_logits=out.conf_logits)
        # Unstored greedy rows are scattered like padding: they leave their slots as they are.
        _scatter_rows(probs_out, out.probs, probs_rows if store_greedy else torch.where(greedy, -1, probs_rows))
        live = probs_rows[:, None] >= 0  # [R, 1]
        return DraftOutput(tokens=torch.where(live, out.tokens, 0), probs=probs_out,
                           conf_logits=torch.where(live, out.conf_logits, 0.0))
    out = DraftOutput(tokens=torch.empty(R, gamma, dtype=torch.int64, device=dev),
                      # zeros with a vocabulary: its columns are the only ones written
                      probs=(torch.empty if vocab is None else torch.zeros)(R, gamma, v_out, dtype=torch.float32,
                                                                            device=dev) if probs_out is None
                      else probs_out,
                      conf_logits=torch.empty(R, gamma, dtype=torch.float32, device=dev))
    if R == 0:
        return out
    base_logits = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    block_r = triton.next_power_of_2(r)
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(d))
    temperature = temperature.float().contiguous()
    w1, w2, conf_w, conf_b = w1.contiguous(), w2.contiguous(), conf_w.contiguous(), conf_b.to(conf_w.dtype).contiguous()
    if split is None:  # the interpreter runs programs one by one: there the split variant only adds launches
        split = base_logits.is_cuda and R < SPLIT_MAX_R
    if split:
        launch = split_launch(R)
        tile = launch["tile"] if split_tile is None else split_tile
        warps = launch["warps"] if split_warps is None else split_warps
        if not (isinstance(tile, int) and tile >= 16 and not tile & (tile - 1)):
            raise ValueError(f"split_tile must be a power of two >= 16, got {split_tile!r}")
        if warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"split_warps must be 1, 2, 4, 8 or 16, got {split_warps!r}")
        rows = launch["rows"] if split_rows is None else split_rows
        if rows != 1 and (rows < 16 or rows & (rows - 1)):
            raise ValueError(f"split_rows must be 1 or a power of two >= 16, got {rows}")
        _launch_split(out, base_logits, h, anchor_ids, anchor_pos, temperature, rid, w1, w2, conf_w, conf_b,
                      lo, hi, block_r, block_d, rows, probs_rows, store_greedy, vocab,
                      launch["fused"] if fused_reductions is None else fused_reductions, tile=tile, warps=warps)
        return out
    block_v = max(16, min(MAX_BLOCK_V, W2_TILE_ELEMENTS // block_r, triton.next_power_of_2(V)))
    _sample_draft_block_kernel[(R,)](
        out.tokens, out.probs, out.probs if probs_rows is None else probs_rows, out.conf_logits,
        base_logits, base_logits.stride(0), base_logits.stride(1),
        h, h.stride(0), h.stride(1),
        anchor_ids, anchor_pos, temperature, rid,
        w1, w2, conf_w, conf_b, vocab if vocab is not None else anchor_ids,
        lo, hi, gamma, V, v_out, d, r,
        HAS_ROWS=probs_rows is not None, STORE_GREEDY=store_greedy, HAS_VOCAB=vocab is not None,
        BLOCK_V=block_v, BLOCK_D=block_d,
        BLOCK_R=block_r, num_warps=NUM_WARPS,
    )
    return out


def _launch_split(out: DraftOutput, base_logits: Tensor, h: Tensor, anchor_ids: Tensor, anchor_pos: Tensor,
                  temperature: Tensor, rid: Tensor, w1: Tensor, w2: Tensor, conf_w: Tensor, conf_b: Tensor,
                  lo: int, hi: int, block_r: int, block_d: int, rows: int = 1,
                  probs_rows: Tensor | None = None, store_greedy: bool = True, vocab: Tensor | None = None,
                  fused: bool = False, *, tile: int, warps: int) -> None:
    """The split-vocabulary variant into ``out``: 4γ launches (A, S, B, W per slot), or with ``fused`` 2γ and one
    memset (the last program of a row in A and B does S's and W's work), no host syncs (CUDA-graph capturable).

    Inputs as :func:`sample_draft_block` after its checks (contiguous weights, fp32 ``temperature``); ``out.probs``
    is ``[S, γ, V]`` when ``probs_rows`` is given. Only the race launch writes greedy rows' ``p_d`` (the logits
    launches never park them), so ``store_greedy`` goes to it alone. ``out.tokens`` doubles as the hand-over of
    ``x_k`` from a slot's reductions to the next slot's logits launch. The per-block partials live in ``[R, NB]``
    scratch tensors allocated here, the row statistics in ``[R]`` ones.
    """
    R, gamma, V = base_logits.shape
    d, r = h.shape[2], w1.shape[1]
    v_out = out.probs.shape[2]
    has_vocab = vocab is not None
    lane_ids = vocab if has_vocab else anchor_ids  # any pointer when unread (HAS_VOCAB=False)
    block_v = max(16, min(MAX_BLOCK_V, tile // block_r, triton.next_power_of_2(V)))
    nb = triton.cdiv(V, block_v)
    block_nb = triton.next_power_of_2(nb)
    dev = base_logits.device
    block_max, block_sum, arg_value, race_score = torch.empty(4, R, nb, dtype=torch.float32, device=dev)
    arg_index, race_index = torch.empty(2, R, nb, dtype=torch.int64, device=dev)
    row_max, row_sum = torch.empty(2, R, dtype=torch.float32, device=dev)
    has_rows = probs_rows is not None
    dest = out.probs if probs_rows is None else probs_rows  # [R]; any pointer when unread (HAS_ROWS=False)
    # Fused reductions: one arrival counter per row (per group of `rows` requests in the logits launch), zero between
    # launches (the last arrival resets it); one memset a draft instead of 2γ reduction launches.
    counter = torch.zeros(R, dtype=torch.int32, device=dev) if fused else row_max  # any pointer when unread
    for j in range(gamma):
        if rows > 1:
            _draft_split_logits_rows_kernel[(triton.cdiv(R, rows), nb)](
                out.tokens, out.probs, dest, out.conf_logits,
                base_logits, base_logits.stride(0), base_logits.stride(1),
                h, h.stride(0), h.stride(1),
                anchor_ids, temperature, w1, w2, conf_w, conf_b, lane_ids,
                block_max, block_sum, arg_value, arg_index, row_max, row_sum, counter,
                j, gamma, R, V, v_out, d, r, nb,
                HAS_ROWS=has_rows, HAS_VOCAB=has_vocab, FUSED=fused, BLOCK_M=rows, BLOCK_V=block_v,
                BLOCK_D=block_d, BLOCK_R=max(16, block_r), BLOCK_NB=block_nb,
                num_warps=warps,
            )
        else:
            _draft_split_logits_kernel[(R, nb)](
                out.tokens, out.probs, dest, out.conf_logits,
                base_logits, base_logits.stride(0), base_logits.stride(1),
                h, h.stride(0), h.stride(1),
                anchor_ids, temperature, w1, w2, conf_w, conf_b, lane_ids,
                block_max, block_sum, arg_value, arg_index, row_max, row_sum, counter,
                j, gamma, V, v_out, d, r, nb,
                HAS_ROWS=has_rows, HAS_VOCAB=has_vocab, FUSED=fused, BLOCK_V=block_v, BLOCK_D=block_d,
                BLOCK_R=block_r, BLOCK_NB=block_nb,
                num_warps=warps,
            )
        if not fused:
            # `warps` as the race launch had when it combined the sums itself: the same reduction tree over
            # the same [BLOCK_NB] layout, so the softmax sum keeps its bits (the fused reduction runs in the logits
            # launch, at `warps` too).
            _draft_split_stats_kernel[(R,)](
                out.tokens, out.conf_logits, dest, temperature, block_max, block_sum, arg_value, arg_index,
                row_max, row_sum, lane_ids, j, gamma, nb,
                HAS_ROWS=has_rows, HAS_VOCAB=has_vocab, BLOCK_NB=block_nb, num_warps=warps,
            )
        _draft_split_race_kernel[(R, nb)](
            out.tokens, out.probs, dest, anchor_pos, temperature, rid, row_max, row_sum, race_score, race_index,
            counter, lane_ids, lo, hi, j, gamma, V, v_out, nb,
            HAS_ROWS=has_rows, STORE_GREEDY=store_greedy, HAS_VOCAB=has_vocab, FUSED=fused, BLOCK_V=block_v,
            BLOCK_NB=block_nb, num_warps=warps,
        )
        if not fused:
            # One warp: a max and a min over NB partials, exact in any order.
            _draft_split_winner_kernel[(R,)](out.tokens, dest, temperature, race_score, race_index, lane_ids, j,
                                             gamma, nb, HAS_ROWS=has_rows, HAS_VOCAB=has_vocab, BLOCK_NB=block_nb,
                                             num_warps=1)


@torch.no_grad()
def sample_block(
    drafter: DSparkDrafter,
    h: Tensor,
    anchor_ids: Tensor,
    anchor_pos: Tensor,
    temperature: Tensor,
    seed: int,
    request_ids: Tensor,
    backend: str = "auto",
    *,
    split: bool | None = None,
    split_rows: int | None = None,
    probs_out: Tensor | None = None,
    probs_rows: Tensor | None = None,
    store_greedy: bool = True,
    fused_reductions: bool | None = None,
    split_tile: int | None = None,
    split_warps: int | None = None,
) -> DraftOutput:
    """``drafter.sample_block`` with the Markov head fused; the RNN and "none" heads run the reference loop.

    Args:
        drafter: a :class:`reference.drafter.DSparkDrafter` with its target attached.
        h, anchor_ids, anchor_pos, temperature, seed, request_ids: as ``DSparkDrafter.sample_block``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` for the fused Markov path.
        split: the Triton variant, as :func:`sample_draft_block` (``None``: by batch size).
        split_rows: requests per program of the split logits launch, as :func:`sample_draft_block`.
        probs_out: a buffer for the draft distributions, as :func:`sample_draft_block` (Markov head only).
        probs_rows: ``[R]`` rows of ``probs_out`` to write, negative for padding, as :func:`sample_draft_block`
            (Markov head only; the other heads reject it).
        store_greedy: ``False``: greedy rows write no ``p_d``, as :func:`sample_draft_block` (Markov head; the other
            heads return every row's ``p_d`` regardless).
        fused_reductions: the split variant's reductions in 2γ launches, as :func:`sample_draft_block`.
        split_tile, split_warps: the split variant's W2 tile and warps, as :func:`sample_draft_block`.
    """
    if drafter.config.head != "markov":
        if probs_out is not None or probs_rows is not None:
            raise ValueError(f"probs_out and probs_rows are for the Markov head, not {drafter.config.head!r}")
        return drafter.sample_block(h, anchor_ids, anchor_pos, temperature, seed, request_ids)
    w1, w2 = drafter.markov_tables()  # [V, r] each: the parameters, or the factored head's materialised tables
    vocab = drafter.draft_vocab  # [Vd] or None
    if vocab is not None:
        w2 = drafter.draft_tables()[1]  # [Vd, r]: W2's rows of the draft vocabulary
    # [R, γ, V or Vd] U_k in the LM head's dtype: every backend upcasts it to float32 as it reads (exact), which gives
    # the reference's float32 U_k without materialising it (at batch 64 that copy is 88 MB).
    base = drafter.draft_base_logits(h, float32=False)
    return sample_draft_block(base, h, anchor_ids, anchor_pos, temperature, seed, request_ids,
                              w1, w2, drafter.conf_head.weight, drafter.conf_head.bias,
                              backend=backend, split=split, split_rows=split_rows, probs_out=probs_out,
                              probs_rows=probs_rows, store_greedy=store_greedy, vocab=vocab,
                              fused_reductions=fused_reductions, split_tile=split_tile, split_warps=split_warps)
