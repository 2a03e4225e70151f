"""The packed token layout of a verify step, built on the device in one launch.

Every decoding request ``r`` (cache slot ``rows[r]``, verify length ``ℓ_r``) contributes ``[x_0, x_1..x_ℓ]``: its
anchor and its first ``ℓ_r`` drafts, at positions ``P_r .. P_r + ℓ_r``. The target's varlen forward reads (names as
in ``optimized/models/target.py``)::

    input_ids, positions, token_slot   [N_pad]   token t of request r sits at cu[r] + j (j = 0 anchor, j ≥ 1 draft);
                                                 tokens past cu[R] are padding: id 0, position 0, slot -1
    cu                                 [M + 1]   int32 query offsets, cu[r+1] = Σ_{r' ≤ r} (ℓ_r' + 1); rows r ≥ R repeat
                                                 the total (zero-length padded rows)
    kv_lens, slot_ids                  [M]       int32 P_r + ℓ_r + 1 and the slot; padded rows 0 and -1

``verify_layout_torch`` spells this out with torch ops (about thirty launches, each a few microseconds of host time
at batch 1); ``verify_layout`` (Triton) writes the same integers into the caller's buffers in one launch over blocks
of ``BLOCK_T`` tokens. Every program recomputes the offsets by a prefix sum over the at most ``M + 1`` rows (a few
hundred integers, cheaper than a second launch) and finds each of its tokens' request by counting the offsets at or
below it; program 0 also writes the per-row outputs. One program walking all ``N_pad`` tokens took 0.27-0.38 ms per
step at 256 requests × 8 tokens on an H200 (0.07-0.09 ms at 64), inside the engine's graphed step. Both read only
device tensors and the grid depends only on ``n_pad`` and the buffer sizes (no host sync), so either can precede a
CUDA-graph replay.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

# The [BLOCK_T, BLOCK_R] owner comparison of one program: 64 tokens against up to 128 rows (M ≤ 127), 16 against
# more, so the tile stays at 8,192 lanes (64 per thread at 4 warps) up to M = 511. These are the one-program
# kernel's tiles, kept for the parallel grid without a sweep; 256 requests × 8 tokens are 128 programs (H200: 132 SMs).
LAYOUT_BLOCK_T_FEW_ROWS = 64
LAYOUT_BLOCK_T_MANY_ROWS = 16
LAYOUT_FEW_ROWS = 128  # BLOCK_R (the next power of two ≥ M + 1) up to which the larger token block is used


def verify_layout_torch(rows: Tensor, lens: Tensor, anchor: Tensor, anchor_pos: Tensor, draft_tokens: Tensor,
                        n_pad: int) -> dict[str, Tensor]:
    """The layout of ``R = len(rows)`` requests over ``n_pad`` tokens (see the module docstring); R rows only."""
    dev, r, g = rows.device, rows.shape[0], draft_tokens.shape[1]
    cu = torch.zeros(r + 1, dtype=torch.long, device=dev)
    cu[1:] = torch.cumsum(lens + 1, 0)  # [R+1]
    t = torch.arange(n_pad, device=dev)  # [N_pad]
    owner = torch.searchsorted(cu[1:], t, right=True).clamp(max=r - 1)  # [N_pad] row of each token
    offset = t - cu[owner]  # [N_pad] 0 = anchor, k = draft slot k
    valid = t < cu[r]
    slot_of = rows[owner]
    drafts = draft_tokens[slot_of, (offset - 1).clamp(min=0, max=max(g - 1, 0))] if g else anchor[slot_of]
    tokens = torch.where(offset == 0, anchor[slot_of], drafts)
    return {
        "input_ids": torch.where(valid, tokens, torch.zeros_like(tokens)),
        "positions": torch.where(valid, anchor_pos[slot_of] + offset, torch.zeros_like(offset)),
        "token_slot": torch.where(valid, slot_of, torch.full_like(slot_of, -1)),  # -1: padding → trash slot
        "cu": cu.to(torch.int32),
        "kv_lens": (anchor_pos[rows] + lens + 1).to(torch.int32),
        "slot_ids": rows.to(torch.int32),
    }


if HAS_TRITON:

    @triton.jit
    def _verify_layout_kernel(
        rows_ptr,  # [R] int64 cache slot of each request
        lens_ptr,  # [R] int64 verify length ℓ of each request
        anchor_ptr,  # [S] int64 anchor token of each slot
        anchor_pos_ptr,  # [S] int64 anchor position P of each slot
        draft_ptr,  # [S, γ] int64 drafts of each slot (a [S, 1] stand-in when γ = 0: never read)
        stride_draft,  # draft stride over S
        ids_ptr,  # [N_pad] int64 out: input_ids
        pos_ptr,  # [N_pad] int64 out: positions
        tslot_ptr,  # [N_pad] int64 out: token_slot
        cu_ptr,  # [M + 1] int32 out: query offsets (program 0)
        kv_ptr,  # [M] int32 out: kv_lens (program 0)
        slot_ptr,  # [M] int32 out: slot_ids (program 0)
        num_rows,  # R
        n_pad,  # tokens to lay out
        max_rows,  # M
        gamma,  # γ
        BLOCK_R: tl.constexpr,  # next power of two ≥ M + 1
        BLOCK_T: tl.constexpr,  # tokens of one program
    ):
        """Grid (cdiv(N_pad, BLOCK_T),): program b lays out tokens b·BLOCK_T .. (b+1)·BLOCK_T - 1; program 0 also
        writes cu, kv_lens and slot_ids for all M rows."""
        block = tl.program_id(0)
        r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        live = r < num_rows
        lens = tl.load(lens_ptr + r, mask=live, other=0)  # [BLOCK_R]
        slot = tl.load(rows_ptr + r, mask=live, other=0)  # [BLOCK_R]
        q_len = tl.where(live, lens + 1, 0)  # [BLOCK_R] zero-length rows past R keep the offsets flat
        cu_incl = tl.cumsum(q_len, axis=0)  # [BLOCK_R] cu[r + 1]
        total = tl.sum(q_len, axis=0)

        if block == 0:  # the per-row outputs, one writer
            in_buf = r < max_rows
            tl.store(cu_ptr + r + 1, cu_incl.to(tl.int32), mask=in_buf)
            tl.store(cu_ptr + r, tl.zeros_like(r), mask=r == 0)
            apos = tl.load(anchor_pos_ptr + slot, mask=live, other=0)  # [BLOCK_R]
            tl.store(kv_ptr + r, tl.where(live, apos + lens + 1, 0).to(tl.int32), mask=in_buf)
            tl.store(slot_ptr + r, tl.where(live, slot, -1).to(tl.int32), mask=in_buf)

        t = block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        before = (cu_incl[None, :] <= t[:, None]) & live[None, :]  # [BLOCK_T, BLOCK_R] rows ending at or before t
        owner = tl.minimum(tl.sum(before.to(tl.int32), axis=1), num_rows - 1)  # [BLOCK_T] searchsorted(cu[1:], t)
        is_owner = r[None, :] == owner[:, None]  # [BLOCK_T, BLOCK_R]
        offset = t - tl.sum(tl.where(before, q_len[None, :], 0), axis=1)  # [BLOCK_T] t - cu[owner]
        t_slot = tl.sum(tl.where(is_owner, slot[None, :], 0), axis=1)  # [BLOCK_T]
        valid = t < total
        anchor = tl.load(anchor_ptr + t_slot, mask=valid, other=0)  # [BLOCK_T]
        draft = tl.load(draft_ptr + t_slot * stride_draft + tl.maximum(offset - 1, 0),
                        mask=valid & (offset > 0) & (offset <= gamma), other=0)  # [BLOCK_T]
        t_pos = tl.load(anchor_pos_ptr + t_slot, mask=valid, other=0) + offset  # [BLOCK_T]
        in_range = t < n_pad
        tl.store(ids_ptr + t, tl.where(valid, tl.where(offset == 0, anchor, draft), 0), mask=in_range)
        tl.store(pos_ptr + t, tl.where(valid, t_pos, 0), mask=in_range)
        tl.store(tslot_ptr + t, tl.where(valid, t_slot, -1), mask=in_range)


def verify_layout(rows: Tensor, lens: Tensor, anchor: Tensor, anchor_pos: Tensor, draft_tokens: Tensor, n_pad: int,
                  out: dict[str, Tensor], backend: str = "auto") -> None:
    """Write the layout into ``out`` (the static buffers: ``input_ids``/``positions``/``token_slot`` ``[≥ n_pad]``
    int64, ``cu`` ``[M + 1]``, ``kv_lens``/``slot_ids`` ``[M]`` int32, M ≥ R); rows R..M-1 become padding.

    Args:
        rows: ``[R]`` int64 cache slot of each request (R ≥ 1). lens: ``[R]`` int64 verify lengths ℓ.
        anchor, anchor_pos: ``[S]`` per-slot anchor token and position. draft_tokens: ``[S, γ]`` per-slot drafts.
        n_pad: tokens to lay out (≥ R + Σℓ; the graph bucket).
        backend: ``"triton"`` (CUDA, or the interpreter), ``"torch"``, or ``"auto"`` (Triton on CUDA).
    """
    r, m = rows.shape[0], out["slot_ids"].shape[0]
    if r < 1 or r > m or lens.shape != (r,) or out["input_ids"].shape[0] < n_pad:
        raise ValueError(f"need 1 ≤ R ≤ {m} rows with [R] lengths and ≥ n_pad = {n_pad} token slots, got rows "
                         f"{tuple(rows.shape)}, lens {tuple(lens.shape)}, {out['input_ids'].shape[0]} token slots")
    if _backend(rows, backend) == "torch":
        lay = verify_layout_torch(rows, lens, anchor, anchor_pos, draft_tokens, n_pad)
        for name in ("input_ids", "positions", "token_slot"):
            out[name][:n_pad].copy_(lay[name])
        out["cu"][: r + 1].copy_(lay["cu"])
        out["cu"][r + 1:].copy_(lay["cu"][r].expand(m - r))
        out["kv_lens"][:r].copy_(lay["kv_lens"])
        out["kv_lens"][r:].zero_()
        out["slot_ids"][:r].copy_(lay["slot_ids"])
        out["slot_ids"][r:].fill_(-1)
        return
    draft = draft_tokens if draft_tokens.numel() else anchor[:, None]  # γ = 0 (no drafter): never read
    block_r = triton.next_power_of_2(m + 1)
    block_t = LAYOUT_BLOCK_T_FEW_ROWS if block_r <= LAYOUT_FEW_ROWS else LAYOUT_BLOCK_T_MANY_ROWS
    grid = (max(triton.cdiv(n_pad, block_t), 1),)  # host ints only; at least program 0, the per-row writer
    _verify_layout_kernel[grid](
        rows.contiguous(), lens.contiguous(), anchor, anchor_pos, draft, draft.stride(0),
        out["input_ids"], out["positions"], out["token_slot"], out["cu"], out["kv_lens"], out["slot_ids"],
        r, n_pad, m, draft_tokens.shape[1],
        BLOCK_R=block_r, BLOCK_T=block_t, num_warps=4,
    )


# --------------------------------------------------------------------------- the drafter stage's inputs and outputs
#
# The drafter stage of R requests (``ModelRunner.draft``) gathers each request's anchor, position, temperature and
# request id from its slot into the draft graph's static inputs (padding rows R..R_pad-1: slot -1, anchor 0 at
# position 0, greedy, request 0), and afterwards scatters the graph's drafts and survivals back into the slots, with
# the flag that a greedy slot's p_d is the one-hot of its draft. In torch that is about fifteen launches at batch 1
# (a gather, a copy and a fill per input; a scatter per output), each a few microseconds of host time on a step that
# is host-bound there; here it is one launch each way.


DRAFT_LOAD_BLOCK = 128  # rows of the draft inputs one program of draft_load writes


def draft_load_torch(rows: Tensor, anchor: Tensor, anchor_pos: Tensor, temperature: Tensor | None,
                     request_id: Tensor | None, r_pad: int, out: dict[str, Tensor]) -> None:
    """The definition: rows 0..R-1 of the draft inputs from the slots ``rows``, rows R..``r_pad``-1 padding."""
    r = rows.shape[0]
    out["anchor_ids"][:r].copy_(anchor[rows])
    out["anchor_pos"][:r].copy_(anchor_pos[rows])
    out["draft_slots"][:r].copy_(rows)
    out["draft_slots"][r:r_pad].fill_(-1)
    out["anchor_pos"][r:r_pad].zero_()
    out["anchor_ids"][r:r_pad].zero_()
    if temperature is not None:
        out["draft_temperature"][:r].copy_(temperature[rows])
        out["draft_request_id"][:r].copy_(request_id[rows])
        out["draft_temperature"][r:r_pad].zero_()
        out["draft_request_id"][r:r_pad].zero_()


def draft_store_torch(rows: Tensor, tokens: Tensor, survival: Tensor, temperature: Tensor, draft_tokens: Tensor,
                      draft_onehot: Tensor, survival_slots: Tensor) -> None:
    """The definition: each request's drafts and survivals into its slot, and whether its p_d is a one-hot (greedy)."""
    draft_tokens[rows] = tokens
    draft_onehot[rows] = temperature[rows] == 0
    survival_slots[rows] = survival


if HAS_TRITON:

    @triton.jit
    def _draft_load_kernel(rows_ptr, anchor_ptr, anchor_pos_ptr, temperature_ptr, request_id_ptr,
                           out_anchor_ptr, out_pos_ptr, out_slots_ptr, out_temp_ptr, out_rid_ptr, r, r_pad,
                           SAMPLING: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] input rows
        live = i < r
        pad = (i >= r) & (i < r_pad)
        slot = tl.load(rows_ptr + i, mask=live, other=0)  # [BLOCK] int64
        tl.store(out_anchor_ptr + i, tl.load(anchor_ptr + slot, mask=live, other=0), mask=live | pad)
        tl.store(out_pos_ptr + i, tl.load(anchor_pos_ptr + slot, mask=live, other=0), mask=live | pad)
        tl.store(out_slots_ptr + i, tl.where(live, slot, -1).to(tl.int32), mask=live | pad)
        if SAMPLING:
            tl.store(out_temp_ptr + i, tl.load(temperature_ptr + slot, mask=live, other=0.0), mask=live | pad)
            tl.store(out_rid_ptr + i, tl.load(request_id_ptr + slot, mask=live, other=0), mask=live | pad)

    @triton.jit
    def _draft_store_kernel(rows_ptr, tokens_ptr, stride_t, survival_ptr, stride_s, temperature_ptr,
                            draft_tokens_ptr, stride_d, onehot_ptr, survival_slots_ptr, stride_ss, gamma,
                            BLOCK_G: tl.constexpr):
        i = tl.program_id(0)
        slot = tl.load(rows_ptr + i)
        k = tl.arange(0, BLOCK_G)  # [BLOCK_G] draft slots
        mask = k < gamma
        tl.store(draft_tokens_ptr + slot * stride_d + k, tl.load(tokens_ptr + i * stride_t + k, mask=mask),
                 mask=mask)
        tl.store(survival_slots_ptr + slot * stride_ss + k, tl.load(survival_ptr + i * stride_s + k, mask=mask),
                 mask=mask)
        tl.store(onehot_ptr + slot, (tl.load(temperature_ptr + slot) == 0).to(tl.int1))


def _backend(rows: Tensor, backend: str) -> str:
    """``"triton"`` or ``"torch"`` for a layout op on ``rows``' device (``"auto"``: Triton on CUDA)."""
    if backend == "auto":
        return "triton" if (rows.is_cuda and HAS_TRITON) else "torch"
    if backend == "triton" and not (HAS_TRITON and (rows.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")):
        raise ValueError("backend='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1)")
    if backend not in ("triton", "torch"):
        raise ValueError(f"unknown layout backend {backend!r}; choose 'auto', 'triton' or 'torch'")
    return backend


def draft_load(rows: Tensor, anchor: Tensor, anchor_pos: Tensor, temperature: Tensor | None,
               request_id: Tensor | None, r_pad: int, out: dict[str, Tensor], backend: str = "auto") -> None:
    """Fill the draft graph's inputs for the requests in slots ``rows`` (:func:`draft_load_torch` defines them).

    Args:
        rows: ``[R]`` int64 slots (R ≥ 1). anchor, anchor_pos: ``[S]`` int64 per slot. temperature ``[S]`` float32
            and request_id ``[S]`` int64 per slot, or both None (a head sampled outside the graph: not loaded).
        r_pad: the draft graph's bucket (≥ R; rows past it are left as they are).
        out: the static buffers ``anchor_ids``, ``anchor_pos`` ``[≥ r_pad]`` int64, ``draft_slots`` int32,
            ``draft_temperature`` float32 and ``draft_request_id`` int64.
        backend: ``"triton"`` (CUDA, or the interpreter), ``"torch"``, or ``"auto"`` (Triton on CUDA).
    """
    r = rows.shape[0]
    if r < 1 or r_pad < r or out["anchor_ids"].shape[0] < r_pad or (temperature is None) != (request_id is None):
        raise ValueError(f"need 1 ≤ R ≤ r_pad ≤ {out['anchor_ids'].shape[0]} and temperature and request_id both "
                         f"given or both None, got R = {r}, r_pad = {r_pad}")
    if _backend(rows, backend) == "torch":
        draft_load_torch(rows, anchor, anchor_pos, temperature, request_id, r_pad, out)
        return
    sampling = temperature is not None
    block = DRAFT_LOAD_BLOCK  # one compiled variant whatever the bucket (a few idle lanes at small batch)
    _draft_load_kernel[(triton.cdiv(r_pad, block),)](
        rows.contiguous(), anchor, anchor_pos, temperature if sampling else anchor, request_id if sampling else anchor,
        out["anchor_ids"], out["anchor_pos"], out["draft_slots"], out["draft_temperature"], out["draft_request_id"],
        r, r_pad, SAMPLING=sampling, BLOCK=block,
    )


def draft_store(rows: Tensor, tokens: Tensor, survival: Tensor, temperature: Tensor, draft_tokens: Tensor,
                draft_onehot: Tensor, survival_slots: Tensor, backend: str = "auto") -> None:
    """Scatter the drafter stage's ``tokens`` ``[R, γ]`` int64 and ``survival`` ``[R, γ]`` float32 into the slots
    ``rows`` of ``draft_tokens`` / ``survival_slots`` ``[S, γ]``, and ``draft_onehot[slot] = temperature[slot] == 0``
    (:func:`draft_store_torch` defines it). Slots must be distinct."""
    r, gamma = tokens.shape
    if r < 1 or rows.shape != (r,) or survival.shape != (r, gamma):
        raise ValueError(f"need R ≥ 1 slots for [R, γ] tokens and survivals, got rows {tuple(rows.shape)}, tokens "
                         f"{tuple(tokens.shape)}, survival {tuple(survival.shape)}")
    if _backend(rows, backend) == "torch":
        draft_store_torch(rows, tokens, survival, temperature, draft_tokens, draft_onehot, survival_slots)
        return
    if draft_tokens.stride(1) != 1 or survival_slots.stride(1) != 1:
        raise ValueError("draft_store needs the slots' [S, γ] tensors contiguous along γ")
    tokens, survival = tokens.contiguous(), survival.contiguous()  # no copy when they are (the draft graph's outputs)
    _draft_store_kernel[(r,)](
        rows.contiguous(), tokens, tokens.stride(0), survival, survival.stride(0), temperature,
        draft_tokens, draft_tokens.stride(0), draft_onehot, survival_slots, survival_slots.stride(0), gamma,
        BLOCK_G=triton.next_power_of_2(gamma),
    )
