"""Triton twins of lossless verification: speculative rejection sampling and greedy verification.

Fast twin of ``reference/verify.py`` (docs/method.md §4), equal to it token for token. Names follow
``docs/method.md``: ``p_t`` target, ``p_d`` draft, ``ℓ`` verify length, ``γ`` block size, ``τ`` emitted.
The terms (accepted, recovered/residual, bonus, emitted) and the positions are defined in the reference's
module docstring; in short, for request ``r`` with anchor at position ``P``:

* slot ``k = 1..ℓ`` (index ``j = k - 1``) is accepted iff ``u · p_d_k(x_k) <= p_t_k(x_k)`` with
  ``u = hash_uniform(seed, r, P + k, ACCEPT, 0)``; the scan stops at the first rejection, ``n`` accepted;
* the one drawn token uses row ``n``: the residual ``max(0, p_t_n - p_d_n)`` (purpose RESIDUAL; ``p_t_n``
  itself if the residual is all zero through rounding) when ``n < ℓ``, else the bonus ``p_t_ℓ``
  (purpose BONUS), at position ``P + n + 1``.

One program per request row. The scan is serial (γ ≈ 7 scalar loads per row, each slot's accept key hashed
once); the final categorical draw streams row ``n`` of ``p_t`` (and ``p_d``) once in vocabulary tiles and runs
*two* races with the same uniforms, one on the residual and one on ``p_t``, so the rounding fallback needs no
second pass. With few rows (batch 1 is one program walking 49,152 lanes on one SM) the split variant gives each
row ``VERIFY_SPLIT_CHUNK``-lane programs that each repeat the cheap scan and race over their chunk, and a second
launch reduces the chunk winners (``common.race_winner``, the whole-row race's tie rule): the same tokens.
``ℓ`` is read from the device inside the kernel: a padded row has ``ℓ = 0`` and draws a bonus from its row 0
(whatever it holds), so nothing on the host needs the lengths.

Implicit one-hot drafts (``draft_onehot``). A greedy draft, or an n-gram proposal, was drawn from the one-hot of its
own token, so its ``p_d`` rows need not exist in memory: a flagged row's ``p_d_k`` is taken to be the one-hot of
``x_k`` and ``draft_probs`` is never read for it. The arithmetic is the explicit one-hot's: the accept test uses
``p_d_k(x_k) = 1`` (``u <= p_t_k(x_k)``), and the residual ``max(0, p_t_n - p_d_n)`` is formed lane by lane as before
with ``p_d_n`` = 1 at lane ``x_{n+1}`` and 0 elsewhere (for ``p_t_n <= 1``: ``p_t_n`` with that lane zeroed), so the
tokens are bit-identical to passing the one-hot rows.

Greedy verification folds each verified logit row's argmax over vocabulary chunks in parallel, then scans each
request in a second launch. It reads the logits either blocked ``[R, γ+1, V]`` (the reference's layout) or packed
as the verify forward wrote them, ``[N, V]`` with request ``r``'s rows from ``row_starts[r]`` on, in place.

Unlike the reference, these kernels do not validate values (that would synchronise): a verified draft token
outside ``[0, V)`` is treated as rejected instead of raising, and non-finite probabilities give undefined
(but memory-safe) tokens. Packed row starts are trusted: ``row_starts[r] + ℓ_r`` must lie below ``N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from optimized.kernels.common import (
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    PURPOSE_RESIDUAL,
    RACE_BLOCK_V,
    argmax_update,
    exponential_at,
    hash_key,
    per_row_words,
    race_update,
    race_winner,
    resolve_backend,
    split_seed,
    uniform_at,
)
from optimized.kernels.sampling import hash_uniform, sample
from reference.sampling import Purpose
from reference.verify import PAD_TOKEN, VerifyResult, assemble_result, check_block_shapes

__all__ = ["VerifyResult", "advance_anchors", "greedy_verify", "rejection_sample"]

# Vocabulary tile of the greedy argmax: as RACE_BLOCK_V (1024 fp32 lanes per step, 4 warps), not yet swept.
ARGMAX_BLOCK_V = 1024
# Lanes of one greedy-argmax program: 12 chunks per SmolLM2 row (V = 49,152), so batch 1 (8 rows) runs 96 programs
# and every row of a large batch is read once, in parallel, instead of one program walking a request's rows.
GREEDY_CHUNK = 4 * ARGMAX_BLOCK_V
PAD_TOKEN_K: tl.constexpr = tl.constexpr(PAD_TOKEN)  # reference.verify.PAD_TOKEN inside kernels
# rejection_sample(split=None) on CUDA below this many rows gives each row's final draw VERIFY_SPLIT_CHUNK-lane
# programs (as sampling.sample does): one program per row walked 49,152 lanes in 0.16 ms of a 2.0 ms H200 step at
# batch 1 (profile adaptive-b1, docs/benchmarks/profile-h200-adaptive-b1.json).
VERIFY_SPLIT_CHUNK = RACE_BLOCK_V
VERIFY_SPLIT_MAX_R = 64


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _store_result(tokens_ptr, num_accepted_ptr, num_emitted_ptr, draft_tokens_ptr, row, gamma, n, last,
                  BLOCK_G: tl.constexpr):
    """Write ``[x_1..x_n, last, PAD…]`` [γ+1], ``n`` and ``τ = n + 1`` for one row."""
    slots = tl.arange(0, BLOCK_G)  # [BLOCK_G] >= γ + 1
    drafts = tl.load(draft_tokens_ptr + row * gamma + slots, mask=slots < n, other=PAD_TOKEN_K)
    out = tl.where(slots < n, drafts, tl.where(slots == n, last.to(tl.int64), PAD_TOKEN_K))
    tl.store(tokens_ptr + row * (gamma + 1) + slots, out, mask=slots < gamma + 1)
    tl.store(num_accepted_ptr + row, n.to(tl.int64))
    tl.store(num_emitted_ptr + row, n.to(tl.int64) + 1)


def _empty_result(R: int, gamma: int, device: torch.device) -> VerifyResult:
    return VerifyResult(tokens=torch.full((R, gamma + 1), PAD_TOKEN, dtype=torch.int64, device=device),
                        num_accepted=torch.zeros(R, dtype=torch.int64, device=device),
                        num_emitted=torch.ones(R, dtype=torch.int64, device=device))


# --------------------------------------------------------------------------- rejection_sample


@triton.jit
def _accept_scan(draft_tokens_ptr, verify_lens_ptr, draft_probs_ptr, stride_dr, stride_dk, draft_onehot_ptr,
                 target_probs_ptr, stride_tr, stride_tk, request_ids_ptr, anchor_pos_ptr, seed_lo, seed_hi, gamma, V,
                 row, HAS_ONEHOT: tl.constexpr):
    """Row ``row``'s serial accept scan and what its final draw reads: ``n`` accepted, whether a verified slot was
    rejected, the draw's key, the ``p_t`` row ``n`` and the ``p_d`` row it subtracts, how many lanes of that ``p_d``
    row to read (``V`` for a residual of an explicit row, 0 for a bonus or an implicit one-hot row), and the lane of
    an implicit one-hot ``p_d`` row (``x_{n+1}`` for its residual, -1: no lane, otherwise)."""
    ell = tl.load(verify_lens_ptr + row)
    rid = tl.load(request_ids_ptr + row)
    anchor = tl.load(anchor_pos_ptr + row)
    draft_row = draft_probs_ptr + row * stride_dr
    target_row = target_probs_ptr + row * stride_tr
    explicit = ell >= 0  # True: p_d is in draft_probs; a tensor so that it combines with the loads below
    if HAS_ONEHOT:
        explicit = tl.load(draft_onehot_ptr + row) == 0
    # Slot j (k = j + 1) is tested only while every earlier slot was accepted.
    n = ell * 0  # int64 accepted count
    alive = ell >= 0  # True; a tensor so the loop can carry it
    for j in range(0, gamma):
        x = tl.load(draft_tokens_ptr + row * gamma + j)
        live = alive & (j < ell) & (x >= 0) & (x < V)
        # An implicit one-hot row is not read: `other` is its p_d(x) = 1.
        pd_x = tl.load(draft_row + j * stride_dk + x, mask=live & explicit, other=1.0).to(tl.float32)
        pt_x = tl.load(target_row + j * stride_tk + x, mask=live, other=0.0).to(tl.float32)
        u = uniform_at(hash_key(seed_lo, seed_hi, rid, anchor + j + 1, PURPOSE_ACCEPT), 0)
        accepted = live & (u * pd_x <= pt_x)
        n += accepted.to(tl.int64)
        alive = accepted
    # One categorical draw from row n: residual if a verified slot was rejected, bonus otherwise.
    rejected = n < ell
    purpose = tl.where(rejected, PURPOSE_RESIDUAL, PURPOSE_BONUS)
    key = hash_key(seed_lo, seed_hi, rid, anchor + n + 1, purpose)
    pt_ptr = target_row + n * stride_tk
    pd_slot = tl.minimum(n, gamma - 1)
    pd_ptr = draft_row + pd_slot * stride_dk
    pd_len = tl.where(rejected & explicit, V, 0)  # p_d is read only for a residual; as a bound, not a scalar mask
    # The rejected draft x_{n+1}: the hot lane of an implicit one-hot row (out of [0, V) it is the all-zero row).
    pd_hot = tl.where(rejected & (explicit == 0), tl.load(draft_tokens_ptr + row * gamma + pd_slot), -1)
    return n, rejected, key, pt_ptr, pd_ptr, pd_len, pd_hot


@triton.jit
def _races(pt_ptr, pd_ptr, pd_len, pd_hot, key, first, count, V, HAS_ONEHOT: tl.constexpr, BLOCK_V: tl.constexpr):
    """The final draw's two races over lanes ``first .. first + count - 1`` (below ``V``), tile by tile in ascending
    order with the same uniforms: the residual ``max(0, p_t - p_d)`` and ``p_t`` itself. Returns each race's best
    score and index, and the residual's largest value (zero means "all zero": the rounding fallback to ``p_t``).
    ``p_d`` is read from ``pd_ptr`` below lane ``pd_len``, else 0, with a 1 at lane ``pd_hot`` (an implicit one-hot
    row's; -1 for none)."""
    res_score = -1.0
    res_index = 0
    res_mass = 0.0
    pt_score = -1.0
    pt_index = 0
    for start in range(0, count, BLOCK_V):
        lanes = first + start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        p_t = tl.load(pt_ptr + lanes, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_V]
        p_d = tl.load(pd_ptr + lanes, mask=lanes < pd_len, other=0.0).to(tl.float32)  # [BLOCK_V]
        if HAS_ONEHOT:
            p_d = tl.where(lanes == pd_hot, 1.0, p_d)  # [BLOCK_V] the explicit one-hot's values: 1, else 0
        residual = tl.maximum(p_t - p_d, 0.0)  # [BLOCK_V]
        e = exponential_at(key, lanes)  # [BLOCK_V] the same uniforms serve both races
        res_score, res_index = race_update(res_score, res_index, residual, e, lanes, mask)
        pt_score, pt_index = race_update(pt_score, pt_index, p_t, e, lanes, mask)
        res_mass = tl.maximum(res_mass, tl.max(tl.where(mask, residual, 0.0), axis=0))
    return res_score, res_index, res_mass, pt_score, pt_index


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _rejection_sample_kernel(
    tokens_ptr,  # [R, γ+1] int64 out: accepted drafts, the drawn token, PAD
    num_accepted_ptr,  # [R] int64 out: n
    num_emitted_ptr,  # [R] int64 out: τ = n + 1
    draft_tokens_ptr,  # [R, γ] int64 drafts x_1..x_γ (contiguous)
    verify_lens_ptr,  # [R] int64 ℓ in 0..γ (device-side: padded rows have 0)
    draft_probs_ptr,  # [R, γ, V] p_d (fp32/fp16/bf16), last dim contiguous; not read for a one-hot row
    stride_dr,  # draft_probs stride over R
    stride_dk,  # draft_probs stride over γ
    draft_onehot_ptr,  # [R] bool: row r's p_d is the one-hot of its drafts (read if HAS_ONEHOT)
    target_probs_ptr,  # [R, γ+1, V] p_t (fp32/fp16/bf16), last dim contiguous
    stride_tr,  # target_probs stride over R
    stride_tk,  # target_probs stride over γ+1
    request_ids_ptr,  # [R] int64 request ids
    anchor_pos_ptr,  # [R] int64 anchor positions P
    seed_lo,  # low 32 bits of the seed
    seed_hi,  # high 32 bits of the seed
    gamma,  # γ
    V,  # vocabulary size
    HAS_ONEHOT: tl.constexpr,  # draft_onehot_ptr flags implicit one-hot rows (else every row's p_d is explicit)
    BLOCK_V: tl.constexpr,  # vocabulary tile of the final draw
    BLOCK_G: tl.constexpr,  # next power of two >= γ + 1 (output row)
):
    row = tl.program_id(0).to(tl.int64)
    n, rejected, key, pt_ptr, pd_ptr, pd_len, pd_hot = _accept_scan(
        draft_tokens_ptr, verify_lens_ptr, draft_probs_ptr, stride_dr, stride_dk, draft_onehot_ptr, target_probs_ptr,
        stride_tr, stride_tk, request_ids_ptr, anchor_pos_ptr, seed_lo, seed_hi, gamma, V, row, HAS_ONEHOT)
    res_score, res_index, res_mass, pt_score, pt_index = _races(pt_ptr, pd_ptr, pd_len, pd_hot, key, 0, V, V,
                                                                HAS_ONEHOT, BLOCK_V)
    last = tl.where(rejected & (res_mass > 0.0), res_index, pt_index)
    _store_result(tokens_ptr, num_accepted_ptr, num_emitted_ptr, draft_tokens_ptr, row, gamma, n, last, BLOCK_G)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _rejection_sample_split_kernel(
    res_score_ptr,  # [R, NB] fp32 out: the residual race's best score in each vocabulary chunk
    res_index_ptr,  # [R, NB] int64 out: its index
    res_mass_ptr,  # [R, NB] fp32 out: the residual's largest value in the chunk
    pt_score_ptr,  # [R, NB] fp32 out: the p_t race's best score in the chunk
    pt_index_ptr,  # [R, NB] int64 out: its index
    draft_tokens_ptr, verify_lens_ptr, draft_probs_ptr, stride_dr, stride_dk, draft_onehot_ptr, target_probs_ptr,
    stride_tr, stride_tk, request_ids_ptr, anchor_pos_ptr, seed_lo, seed_hi, gamma, V,
    NB,  # chunks per row
    HAS_ONEHOT: tl.constexpr,  # as in _rejection_sample_kernel
    CHUNK: tl.constexpr,  # vocabulary lanes per program (a multiple of BLOCK_V)
    BLOCK_V: tl.constexpr,
):
    """Grid (R, NB): program (r, b) repeats row r's accept scan (γ scalar loads) and runs both races of
    :func:`_rejection_sample_kernel` over lanes b·CHUNK .. (b+1)·CHUNK-1, tile by tile in ascending order."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n, rejected, key, pt_ptr, pd_ptr, pd_len, pd_hot = _accept_scan(
        draft_tokens_ptr, verify_lens_ptr, draft_probs_ptr, stride_dr, stride_dk, draft_onehot_ptr, target_probs_ptr,
        stride_tr, stride_tk, request_ids_ptr, anchor_pos_ptr, seed_lo, seed_hi, gamma, V, row, HAS_ONEHOT)
    res_score, res_index, res_mass, pt_score, pt_index = _races(pt_ptr, pd_ptr, pd_len, pd_hot, key, chunk * CHUNK,
                                                                CHUNK, V, HAS_ONEHOT, BLOCK_V)
    out = row * NB + chunk
    tl.store(res_score_ptr + out, res_score)
    tl.store(res_index_ptr + out, res_index.to(tl.int64))
    tl.store(res_mass_ptr + out, res_mass)
    tl.store(pt_score_ptr + out, pt_score)
    tl.store(pt_index_ptr + out, pt_index.to(tl.int64))


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _rejection_sample_split_reduce_kernel(
    tokens_ptr, num_accepted_ptr, num_emitted_ptr,  # outputs as in _rejection_sample_kernel
    res_score_ptr, res_index_ptr, res_mass_ptr, pt_score_ptr, pt_index_ptr,  # [R, NB] chunk partials
    draft_tokens_ptr, verify_lens_ptr, draft_probs_ptr, stride_dr, stride_dk, draft_onehot_ptr, target_probs_ptr,
    stride_tr, stride_tk, request_ids_ptr, anchor_pos_ptr, seed_lo, seed_hi, gamma, V,
    NB,
    HAS_ONEHOT: tl.constexpr,  # as in _rejection_sample_kernel
    BLOCK_NB: tl.constexpr,  # next power of two >= NB
    BLOCK_G: tl.constexpr,
):
    """One program per row: the scan once more (for ``n``), then the two race winners and the residual's mass
    from the chunk partials, and the row's result exactly as :func:`_rejection_sample_kernel` writes it."""
    row = tl.program_id(0).to(tl.int64)
    n, rejected, key, _, _, _, _ = _accept_scan(
        draft_tokens_ptr, verify_lens_ptr, draft_probs_ptr, stride_dr, stride_dk, draft_onehot_ptr, target_probs_ptr,
        stride_tr, stride_tk, request_ids_ptr, anchor_pos_ptr, seed_lo, seed_hi, gamma, V, row, HAS_ONEHOT)
    res_index = race_winner(res_score_ptr, res_index_ptr, row, NB, BLOCK_NB)
    pt_index = race_winner(pt_score_ptr, pt_index_ptr, row, NB, BLOCK_NB)
    blocks = tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    res_mass = tl.max(tl.load(res_mass_ptr + row * NB + blocks, mask=blocks < NB, other=0.0), axis=0)
    last = tl.where(rejected & (res_mass > 0.0), res_index, pt_index)
    _store_result(tokens_ptr, num_accepted_ptr, num_emitted_ptr, draft_tokens_ptr, row, gamma, n, last, BLOCK_G)


def _rejection_sample_torch(draft_tokens, verify_lens, draft_probs, target_probs, seed, rid, anchor, draft_onehot):
    """Torch fallback: the same arithmetic, vectorised over rows and slots (no host sync). A flagged row's ``p_d``
    values are selected away (``torch.where``), so whatever ``draft_probs`` holds there never reaches a result."""
    R, gamma = draft_tokens.shape
    V = target_probs.shape[-1]
    p_t = target_probs.float()  # [R, γ+1, V]
    p_d = draft_probs.float()  # [R, γ, V]
    dev = p_t.device
    k = torch.arange(1, gamma + 1, device=dev)  # [γ]
    live = (k[None, :] <= verify_lens[:, None]) & (draft_tokens >= 0) & (draft_tokens < V)  # [R, γ]
    x = torch.where(live, draft_tokens, torch.zeros_like(draft_tokens))[..., None]  # [R, γ, 1]
    pd_x = p_d.gather(-1, x).squeeze(-1)  # [R, γ]
    if draft_onehot is not None:
        pd_x = torch.where(draft_onehot[:, None], 1.0, pd_x)  # [R, γ] a one-hot row's p_d_k(x_k) = 1
    pt_x = p_t[:, :gamma].gather(-1, x).squeeze(-1)  # [R, γ]
    positions = anchor[:, None] + k[None, :]  # [R, γ] P + k
    u = hash_uniform(seed, rid[:, None], positions, int(Purpose.ACCEPT), 0, backend="torch")  # [R, γ]
    accepted = live & (u * pd_x <= pt_x)  # [R, γ]
    n = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R] leading run
    rejected = n < verify_lens  # [R]
    rows = torch.arange(R, device=dev)
    pt_n = p_t[rows, n]  # [R, V]
    pd_n = p_d[rows, n.clamp(max=gamma - 1)]  # [R, V]
    if draft_onehot is not None:  # the one-hot of the rejected draft x_{n+1} (all zero when it lies outside [0, V))
        x_n = draft_tokens[rows, n.clamp(max=gamma - 1)]  # [R]
        hot = (torch.arange(V, device=dev)[None, :] == x_n[:, None]).float()  # [R, V]
        pd_n = torch.where(draft_onehot[:, None], hot, pd_n)  # [R, V]
    residual = (pt_n - pd_n).clamp(min=0)  # [R, V]
    residual = torch.where((residual.amax(-1) > 0)[:, None], residual, pt_n)  # rounding fallback to p_t
    dist = torch.where(rejected[:, None], residual, pt_n)  # [R, V]
    purpose = torch.where(rejected, int(Purpose.RESIDUAL), int(Purpose.BONUS))  # [R]
    last = sample(dist, seed, rid, anchor + n + 1, purpose, backend="torch")  # [R]
    return assemble_result(draft_tokens, n, last)


def rejection_sample(
    draft_tokens: Tensor,
    verify_lens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    seed: int,
    request_ids: Tensor,
    anchor_positions: Tensor,
    backend: str = "auto",
    *,
    split: bool | None = None,
    draft_onehot: Tensor | None = None,
) -> VerifyResult:
    """Verify each request's first ``ℓ_r`` drafts; twin of ``reference.verify.rejection_sample``.

    Args:
        draft_tokens: ``[R, γ]`` int64 drafts ``x_1..x_γ``; slots past ``ℓ_r`` are ignored.
        verify_lens: ``[R]`` int64 ``ℓ_r`` in 0..γ (device tensor; 0 for padded rows).
        draft_probs: ``[R, γ, V]`` p_d each draft was sampled from (fp32/fp16/bf16); rows flagged in
            ``draft_onehot`` are never read (they may hold anything, NaN included).
        target_probs: ``[R, γ+1, V]`` p_t rows; row ``i`` is for position ``P + i + 1``.
        seed: generation seed.
        request_ids: ``[R]`` request ids.
        anchor_positions: ``[R]`` absolute anchor positions ``P``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        split: Triton variant: ``True`` gives each row's final draw ``VERIFY_SPLIT_CHUNK``-lane programs and reduces
            their winners in a second launch; ``False`` one program per row; ``None`` splits on CUDA below
            ``VERIFY_SPLIT_MAX_R`` rows. Same tokens either way.
        draft_onehot: optional ``[R]`` bool device tensor: where true, row ``r``'s ``p_d_k`` is the one-hot of
            ``draft_tokens[r, k-1]`` at every slot (a greedy draft's or an n-gram proposal's) and ``draft_probs[r]`` is
            not read. The result is bit-identical to passing those one-hot rows in ``draft_probs``.

    Returns:
        :class:`reference.verify.VerifyResult` (tokens ``[R, γ+1]``, num_accepted ``[R]``, num_emitted ``[R]``).
    """
    R, gamma = check_block_shapes(draft_tokens, verify_lens)
    V = target_probs.shape[-1]
    if target_probs.shape != (R, gamma + 1, V) or draft_probs.shape != (R, gamma, V) or V == 0:
        raise ValueError(f"expected draft_probs [R={R}, γ={gamma}, V] and target_probs [R, γ+1, V], got "
                         f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    if not (draft_probs.dtype.is_floating_point and target_probs.dtype.is_floating_point):
        raise ValueError(f"probabilities must be float tensors, got {draft_probs.dtype} and {target_probs.dtype}")
    dev = target_probs.device
    if draft_onehot is not None and (draft_onehot.shape != (R,) or draft_onehot.dtype != torch.bool
                                     or draft_onehot.device != dev):
        raise ValueError(f"draft_onehot must be a bool [R={R}] tensor on {dev}, got {draft_onehot.dtype} "
                         f"{tuple(draft_onehot.shape)} on {draft_onehot.device}")
    rid = per_row_words(request_ids, R, dev, "request_ids")  # [R]
    anchor = per_row_words(anchor_positions, R, dev, "anchor_positions")  # [R]
    lo, hi = split_seed(seed)
    if resolve_backend(backend, target_probs) == "torch":
        return _rejection_sample_torch(draft_tokens, verify_lens, draft_probs, target_probs, seed, rid, anchor,
                                       draft_onehot)
    out = _empty_result(R, gamma, dev)
    if R == 0:
        return out
    draft_probs = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    target_probs = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    has_onehot = draft_onehot is not None
    onehot = draft_onehot.contiguous() if has_onehot else verify_lens  # [R]; any pointer when unread
    inputs = (draft_tokens.contiguous(), verify_lens.contiguous(), draft_probs, draft_probs.stride(0),
              draft_probs.stride(1), onehot, target_probs, target_probs.stride(0), target_probs.stride(1), rid, anchor,
              lo, hi, gamma, V)  # what every variant's kernels read
    block_g = triton.next_power_of_2(gamma + 1)
    if split is None:
        split = target_probs.is_cuda and R < VERIFY_SPLIT_MAX_R
    if not split:
        _rejection_sample_kernel[(R,)](out.tokens, out.num_accepted, out.num_emitted, *inputs,
                                       HAS_ONEHOT=has_onehot, BLOCK_V=RACE_BLOCK_V, BLOCK_G=block_g)
        return out
    chunk = VERIFY_SPLIT_CHUNK
    nb = triton.cdiv(V, chunk)
    partial = dict(device=dev, dtype=torch.float32)
    res_score, res_mass, pt_score = (torch.empty(R, nb, **partial) for _ in range(3))  # [R, NB] each
    res_index, pt_index = (torch.empty(R, nb, dtype=torch.int64, device=dev) for _ in range(2))  # [R, NB] each
    _rejection_sample_split_kernel[(R, nb)](res_score, res_index, res_mass, pt_score, pt_index, *inputs, nb,
                                            HAS_ONEHOT=has_onehot, CHUNK=chunk, BLOCK_V=min(RACE_BLOCK_V, chunk))
    _rejection_sample_split_reduce_kernel[(R,)](out.tokens, out.num_accepted, out.num_emitted, res_score, res_index,
                                                res_mass, pt_score, pt_index, *inputs, nb, HAS_ONEHOT=has_onehot,
                                                BLOCK_NB=triton.next_power_of_2(nb), BLOCK_G=block_g, num_warps=1)
    return out


# --------------------------------------------------------------------------- greedy_verify


@triton.jit
def _greedy_argmax_partials_kernel(
    part_value_ptr,  # [R·(γ+1), NB] fp32 out: the chunk's largest logit
    part_index_ptr,  # [R·(γ+1), NB] int64 out: its lowest index
    verify_lens_ptr,  # [R] int64 ℓ in 0..γ
    logits_ptr,  # [R, γ+1, V] target logits, or packed [N, V] when PACKED (fp32/fp16/bf16), last dim contiguous
    row_starts_ptr,  # [R] int32/int64 packed row of (r, 0) when PACKED; not read otherwise
    stride_lr,  # logits stride over R (0 when PACKED: the request's rows start at row_starts[r])
    stride_lk,  # logits stride over γ+1 (over N when PACKED)
    gamma,  # γ
    V,  # vocabulary size
    NB,  # chunks per row
    PACKED: tl.constexpr,  # row (r, j) is logits[row_starts[r] + j] instead of logits[r, j]
    CHUNK: tl.constexpr,  # vocabulary lanes of one program (a multiple of BLOCK_V)
    BLOCK_V: tl.constexpr,  # vocabulary tile
):
    """Grid (R·(γ+1), NB): program (r·(γ+1) + j, b) folds lanes b·CHUNK .. (b+1)·CHUNK-1 of row j of request r
    into its chunk's argmax, tile by tile in ascending order (rows past ℓ_r are skipped: never read)."""
    pos = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row = pos // (gamma + 1)
    j = pos % (gamma + 1)
    if j <= tl.load(verify_lens_ptr + row):
        first = 0
        if PACKED:
            first = tl.load(row_starts_ptr + row).to(tl.int64)
        logits_row = logits_ptr + row * stride_lr + (first + j) * stride_lk
        best = -float("inf")
        best_index = 0
        for start in range(0, CHUNK, BLOCK_V):
            lanes = chunk * CHUNK + start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            values = tl.load(logits_row + lanes, mask=lanes < V, other=-float("inf")).to(tl.float32)  # [BLOCK_V]
            best, best_index = argmax_update(best, best_index, values, lanes)
        tl.store(part_value_ptr + pos * NB + chunk, best)
        tl.store(part_index_ptr + pos * NB + chunk, best_index.to(tl.int64))


@triton.jit
def _greedy_verify_reduce_kernel(
    tokens_ptr,  # [R, γ+1] int64 out
    num_accepted_ptr,  # [R] int64 out
    num_emitted_ptr,  # [R] int64 out
    draft_tokens_ptr,  # [R, γ] int64 drafts (contiguous)
    verify_lens_ptr,  # [R] int64 ℓ in 0..γ
    part_value_ptr,  # [R·(γ+1), NB] fp32 chunk partials
    part_index_ptr,  # [R·(γ+1), NB] int64
    anchor_ptr,  # [S] int64 in/out when ANCHOR: each slot's anchor token
    anchor_pos_ptr,  # [S] int64 in/out when ANCHOR: its position
    slots_ptr,  # [R] int64 when ANCHOR: the slot of each request (distinct)
    gamma,  # γ
    NB,  # chunks per row
    BLOCK_NB: tl.constexpr,  # next power of two >= NB
    BLOCK_G: tl.constexpr,  # next power of two >= γ + 1
    ANCHOR: tl.constexpr,  # also move each request's anchor: the last emitted token, n + 1 positions on
):
    """One program per request: row j's argmax from its chunk partials (the largest value, the lowest index among
    the chunks that hold it: the whole-row fold's answer, chunks being ascending and each holding its lowest
    index), then the accept scan, which reads row j only while rows 0..j-1 all matched; with ``ANCHOR``, the
    request's slot gets its next anchor (each slot belongs to one request: no two programs write one slot)."""
    row = tl.program_id(0).to(tl.int64)
    ell = tl.load(verify_lens_ptr + row)
    n = ell * 0
    last = n
    alive = ell >= 0
    blocks = tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    valid = blocks < NB
    for j in range(0, gamma + 1):
        if alive:
            base = (row * (gamma + 1) + j) * NB
            values = tl.load(part_value_ptr + base + blocks, mask=valid, other=-float("inf"))  # [BLOCK_NB]
            indices = tl.load(part_index_ptr + base + blocks, mask=valid, other=0)  # [BLOCK_NB] int64
            best, best_index = argmax_update(-float("inf"), 0, values, indices)
            x = tl.load(draft_tokens_ptr + row * gamma + j, mask=j < gamma, other=-1)
            matched = (j < ell) & (x == best_index)
            last = best_index.to(tl.int64)
            n += matched.to(tl.int64)
            alive = matched
    _store_result(tokens_ptr, num_accepted_ptr, num_emitted_ptr, draft_tokens_ptr, row, gamma, n, last, BLOCK_G)
    if ANCHOR:
        slot = tl.load(slots_ptr + row)
        tl.store(anchor_ptr + slot, last.to(tl.int64))
        tl.store(anchor_pos_ptr + slot, tl.load(anchor_pos_ptr + slot) + n.to(tl.int64) + 1)


def advance_anchors(tokens: Tensor, num_emitted: Tensor, anchor: Tensor, anchor_pos: Tensor, slots: Tensor) -> None:
    """The next anchor of each verified request, in place: ``anchor[slots[r]]`` = its last emitted token
    (``tokens[r, τ_r - 1]``), ``anchor_pos[slots[r]] += τ_r`` (``num_emitted``). The torch definition of
    :func:`greedy_verify`'s ``anchors=`` update; the runner applies it after :func:`rejection_sample` too."""
    anchor[slots] = tokens.gather(1, (num_emitted - 1)[:, None])[:, 0]  # [R]
    anchor_pos[slots] += num_emitted


def _greedy_verify_torch(draft_tokens: Tensor, verify_lens: Tensor, target_logits: Tensor) -> VerifyResult:
    """Torch fallback over gathered ``[R, γ+1, V]`` logits (no host sync)."""
    gamma = draft_tokens.shape[1]
    target_argmax = target_logits.float().argmax(dim=-1)  # [R, γ+1], lowest index on ties
    verified = torch.arange(1, gamma + 1, device=draft_tokens.device)[None, :] <= verify_lens[:, None]  # [R, γ]
    matched = verified & (draft_tokens == target_argmax[:, :gamma])  # [R, γ]
    n = matched.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]
    return assemble_result(draft_tokens, n, target_argmax.gather(1, n[:, None]).squeeze(1))


def _check_row_starts(row_starts: Tensor, R: int, target_logits: Tensor) -> None:
    """Shapes, dtypes and device of packed ``target_logits [N, V]`` and ``row_starts [R] / [R+1]`` (no values read:
    that ``row_starts[r] + ℓ_r < N`` is the caller's contract, as checking it would synchronise)."""
    if not isinstance(row_starts, Tensor) or row_starts.ndim != 1 or row_starts.shape[0] not in (R, R + 1):
        shape = tuple(row_starts.shape) if isinstance(row_starts, Tensor) else type(row_starts).__name__
        raise ValueError(f"row_starts must be [R={R}] or [R+1={R + 1}] (cu), got {shape}")
    if row_starts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_starts must be int32 or int64, got {row_starts.dtype}")
    if row_starts.device != target_logits.device:
        raise ValueError(f"row_starts is on {row_starts.device}, target_logits on {target_logits.device}")
    if target_logits.ndim != 2 or target_logits.shape[1] == 0 or (R and target_logits.shape[0] == 0):
        raise ValueError(f"with row_starts, target_logits must be the packed [N ≥ 1, V ≥ 1] logits, got "
                         f"{tuple(target_logits.shape)}")


def greedy_verify(
    draft_tokens: Tensor, verify_lens: Tensor, target_logits: Tensor, backend: str = "auto", *,
    row_starts: Tensor | None = None, anchors: tuple[Tensor, Tensor, Tensor] | None = None,
) -> VerifyResult:
    """Greedy verification (accept while ``x_k == argmax p_t_k``); twin of ``reference.verify.greedy_verify``.

    Two layouts of the target logits, the same result. Blocked (``row_starts=None``): ``target_logits[r, j]`` is row
    ``j`` of request ``r``, exactly the reference's argument. Packed: ``target_logits`` is the verify forward's
    ``[N, V]`` output and row ``j ≤ ℓ_r`` of request ``r`` is ``target_logits[row_starts[r] + j]``; the result is the
    reference's (and the blocked call's) on the gathered ``target_logits[row_starts[:R, None] + min(j, ℓ_r)]``
    ``[R, γ+1, V]``. The Triton path reads the packed rows in place (no ``[R, γ+1, V]`` copy: 201 MB at R = 256,
    V = 49,152 in bf16); the torch path is that gather, the twin.

    Args:
        draft_tokens: ``[R, γ]`` int64 drafts; slots past ``ℓ_r`` are ignored.
        verify_lens: ``[R]`` int64 ``ℓ_r`` in 0..γ.
        target_logits: ``[R, γ+1, V]`` target logits (fp32/fp16/bf16), or packed ``[N, V]`` with ``row_starts``;
            rows past ``ℓ_r`` are never read (packed, they need not exist) and rows past row ``n`` never affect the
            result (they may hold anything, NaN included).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        row_starts: ``[R]`` or ``[R+1]`` (the layout's ``cu``; the last entry is not read) int32/int64 device tensor,
            the packed row of each request's row 0; ``row_starts[r] + ℓ_r < N`` is not checked (a host sync).
        anchors: ``(anchor [S], anchor_pos [S], slots [R])`` int64 device tensors, slots distinct: also move each
            request's anchor in place, as :func:`advance_anchors` does (the Triton path in the same kernel, no
            launch of its own).

    Returns:
        :class:`reference.verify.VerifyResult`.
    """
    R, gamma = check_block_shapes(draft_tokens, verify_lens)
    if row_starts is not None:
        _check_row_starts(row_starts, R, target_logits)
    elif target_logits.ndim != 3 or target_logits.shape[:2] != (R, gamma + 1) or target_logits.shape[2] == 0:
        raise ValueError(f"target_logits must be [R={R}, γ+1={gamma + 1}, V], got {tuple(target_logits.shape)}")
    if not target_logits.dtype.is_floating_point:
        raise ValueError(f"target_logits must be a float tensor, got {target_logits.dtype}")
    dev = target_logits.device
    if resolve_backend(backend, target_logits) == "torch":
        if row_starts is not None:
            j = torch.arange(gamma + 1, device=dev)  # [γ+1]
            src = row_starts[:R, None].long() + torch.minimum(j[None, :], verify_lens[:, None])  # [R, γ+1]
            target_logits = target_logits[src]  # [R, γ+1, V] rows past ℓ_r repeat row ℓ_r (never decide)
        out = _greedy_verify_torch(draft_tokens, verify_lens, target_logits)
        if anchors is not None:
            advance_anchors(out.tokens, out.num_emitted, *anchors)
        return out
    if R == 0:
        return _empty_result(R, gamma, dev)
    # Uninitialised: the reduce kernel writes every row of all three (no fill launches).
    out = VerifyResult(tokens=torch.empty(R, gamma + 1, dtype=torch.int64, device=dev),
                       num_accepted=torch.empty(R, dtype=torch.int64, device=dev),
                       num_emitted=torch.empty(R, dtype=torch.int64, device=dev))
    if anchors is not None:
        anchor, anchor_pos, slots = anchors
        if not (anchor.dtype == anchor_pos.dtype == slots.dtype == torch.int64 and slots.shape == (R,)
                and anchor.is_contiguous() and anchor_pos.is_contiguous()):
            raise ValueError("anchors must be contiguous int64 (anchor [S], anchor_pos [S]) and int64 slots [R]")
        slots = slots.contiguous()
    else:
        anchor = anchor_pos = slots = out.num_accepted  # placeholders, never read (ANCHOR=False)
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    V = logits.shape[-1]
    if row_starts is None:  # [R, γ+1, V]
        starts, stride_r, stride_k = verify_lens, logits.stride(0), logits.stride(1)  # starts: a pointer, not read
    else:  # [N, V]: request r's rows begin at row_starts[r]
        starts, stride_r, stride_k = row_starts.contiguous(), 0, logits.stride(0)
    nb = triton.cdiv(V, GREEDY_CHUNK)
    part_value = torch.empty(R * (gamma + 1), nb, dtype=torch.float32, device=dev)  # [R·(γ+1), NB]
    part_index = torch.empty(R * (gamma + 1), nb, dtype=torch.int64, device=dev)
    _greedy_argmax_partials_kernel[(R * (gamma + 1), nb)](
        part_value, part_index, verify_lens.contiguous(), logits, starts, stride_r, stride_k, gamma, V, nb,
        PACKED=row_starts is not None, CHUNK=GREEDY_CHUNK, BLOCK_V=ARGMAX_BLOCK_V,
    )
    _greedy_verify_reduce_kernel[(R,)](
        out.tokens, out.num_accepted, out.num_emitted, draft_tokens.contiguous(), verify_lens.contiguous(),
        part_value, part_index, anchor, anchor_pos, slots, gamma, nb,
        BLOCK_NB=triton.next_power_of_2(nb), BLOCK_G=triton.next_power_of_2(gamma + 1), ANCHOR=anchors is not None,
    )
    return out
