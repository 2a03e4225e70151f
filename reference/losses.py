"""Training losses of the DSpark drafter, anchor sampling and the training block mask (docs/method.md §2).

Names follow ``docs/method.md``: ``p_t`` is the target distribution, ``p_d`` the draft distribution,
``c`` the confidence, ``a`` the prefix survival and ``ℓ`` the verify length; γ is the block size and
``x_0`` the anchor.

A training sequence of S tokens carries many blocks at once. Each block starts at an anchor position
``p`` (both ``p`` and ``p+1`` are assistant tokens); its slot ``k = 1..γ`` predicts the token at ``p+k``.
Anchors are either a random subset (:func:`sample_anchors` + :func:`block_targets`) or every eligible
position (:func:`dense_block_targets`, what the fast trainer in ``optimized/training.py`` uses). The blocks
are packed into one drafter forward under :func:`block_attention_mask`, and the per-slot outputs are scored
by :func:`dspark_loss` with position weights ``w_k = exp(-(k-1)/λ)``::

    L_ce   = - Σ_k w_k log p_d_k(x*_k)
    L_kl   =   Σ_k w_k KL(p_t_k ‖ p_d_k)                      (soft cross-entropy minus the target's entropy)
    L_l1   =   Σ_k w_k ‖p_d_k - p_t_k‖_1                      (full L1, no 1/2)
    L_conf =   Σ_k w_k BCE(c_k, c*_k),  c*_k = Σ_v min(p_d_k, p_t_k)   (T = 1, detached)
    L      = w_ce L_ce + w_l1 L_l1 + w_conf L_conf + w_kl L_kl      (the paper: 0.1, 0.9, 1.0, 0)

each term a weighted mean over the valid slots (validity is cumulative along k). ``L_kl`` is not in the
paper: it is the distillation loss of EAGLE-style drafters. Its gradient ``p_d - p_t`` does not vanish
while ``p_d`` is still small, where the gradient of ``L_l1`` does, and it uses the whole target
distribution where ``L_ce`` sees one sampled token (docs/method.md §2 explains the choice of recipe).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Rows (slots) of [rows, V] logits scored per chunk in dspark_loss. On a CPU, 2**22 float32 elements = 16 MiB per
# temporary: small next to the logits themselves at V = 49152 (85 rows per chunk), large enough that the
# per-chunk Python overhead is negligible against the V-wide kernels. On a GPU the same chunk would cost ~100
# chunks × ~30 kernel launches per training step, so chunks are 16× larger there (256 MiB per temporary, about
# 1.3 GB of temporaries at the peak: small next to an H200's memory).
_CHUNK_ELEMENTS = 2**22
_CUDA_CHUNK_ELEMENTS = 2**26


class LossWeights(NamedTuple):
    """Weights of the four loss terms. A plain 3-tuple ``(ce, l1, conf)`` is the paper's form (``kl = 0``)."""

    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    kl: float = 0.0

    @classmethod
    def of(cls, weights: Sequence[float]) -> LossWeights:
        """Validate ``(ce, l1, conf)`` or ``(ce, l1, conf, kl)``: finite, non-negative, not all zero."""
        if isinstance(weights, LossWeights):
            w = weights
        elif len(weights) in (3, 4):
            w = cls(*(float(x) for x in weights))
        else:
            raise ValueError(f"weights must be (w_ce, w_l1, w_conf) or (w_ce, w_l1, w_conf, w_kl), got {weights}")
        if any(not (x >= 0 and math.isfinite(x)) for x in w):
            raise ValueError(f"loss weights must be finite and non-negative, got {tuple(w)}")
        if not any(w):
            raise ValueError("weights are all zero: nothing to train")
        return w

    @property
    def needs_target(self) -> bool:
        """Whether ``p_t`` is needed (every term but CE uses it)."""
        return self.l1 > 0 or self.conf > 0 or self.kl > 0


PAPER_WEIGHTS = LossWeights()
"""The paper's mix: 0.1 L_ce + 0.9 L_l1 + 1.0 L_conf."""


def position_weights(gamma: int, decay: float = 4.0) -> Tensor:
    """Per-slot loss weights ``w_k = exp(-(k-1)/decay)`` for ``k = 1..γ``.

    Args:
        gamma: block size γ.
        decay: λ. The authors' code uses 4.0 with γ = 7 (the paper text writes λ = γ; docs/method.md §2 picks 4.0).

    Returns:
        ``[γ]`` float32 weights, ``w_1 = 1``, decreasing.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be ≥ 1, got {gamma}")
    if not (decay > 0 and math.isfinite(decay)):
        raise ValueError(f"decay must be a finite positive number, got {decay}")
    k = torch.arange(1, gamma + 1, dtype=torch.float32)  # [γ]
    return torch.exp(-(k - 1) / decay)


def sample_anchors(loss_mask: Tensor, num_anchors: int, gamma: int,
                   generator: torch.Generator | None = None) -> Tensor:
    """Draw distinct anchor positions of one sequence, uniformly without replacement.

    A position ``p`` is eligible when it and the next token are both assistant tokens
    (``loss_mask[p] and loss_mask[p+1]``, ``p+1 < S``): the anchor is an emitted response token and slot 1
    has a target to learn. Later slots may run past the response; :func:`block_targets` masks them.

    Args:
        loss_mask: ``[S]`` bool, True on assistant tokens.
        num_anchors: how many anchors to draw at most.
        gamma: block size γ (validated only; eligibility needs just slot 1 inside the response).
        generator: source of randomness (CPU generator); ``None`` uses torch's global one.

    Returns:
        ``[nb]`` int64 sorted positions, ``nb = min(num_anchors, #eligible)`` (empty when none is eligible),
        on ``loss_mask``'s device.
    """
    if loss_mask.dim() != 1 or loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a 1-D bool tensor [S], got {tuple(loss_mask.shape)} {loss_mask.dtype}")
    if num_anchors < 0:
        raise ValueError(f"num_anchors must be ≥ 0, got {num_anchors}")
    if gamma < 1:
        raise ValueError(f"gamma must be ≥ 1, got {gamma}")
    eligible = torch.nonzero(loss_mask[:-1] & loss_mask[1:]).flatten()  # [E] candidate positions p
    if num_anchors >= eligible.numel():
        return eligible.to(torch.int64)
    # A uniformly random permutation's first n entries are a uniform n-subset, drawn without replacement.
    device = generator.device if generator is not None else "cpu"  # randperm must run where its generator lives
    pick = torch.randperm(eligible.numel(), generator=generator, device=device)[:num_anchors]  # [nb]
    return eligible[pick.to(eligible.device)].sort().values.to(torch.int64)


class BlockTargets(NamedTuple):
    """Teacher-forcing targets of the blocks of one sequence; every field is ``[nb, γ]``."""

    labels: Tensor  # int64: x*_k = input_ids[p+k]; 0 where p+k ≥ S
    prev_tokens: Tensor  # int64: x_{k-1} = input_ids[p+k-1] (slot 1: the anchor x_0); 0 where out of range
    target_pos: Tensor  # int64: p+k-1, the target row whose logits predict p+k (clamped to S-1 when invalid)
    valid: Tensor  # bool: slot k supervised; cumulative along k


def block_targets(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, gamma: int) -> BlockTargets:
    """Labels, teacher-forced previous tokens and validity of every slot of every block.

    Slot ``k`` of the block anchored at ``p`` predicts position ``p+k``. It is valid iff ``p+k < S``, the
    token there is an assistant token and every earlier slot of the block is valid: supervision stops at the
    first slot past the response, because at inference a block never continues past a rejected prefix.

    Args:
        input_ids: ``[S]`` int64 token ids of the sequence.
        loss_mask: ``[S]`` bool, True on assistant tokens.
        anchors: ``[nb]`` int64 anchor positions in ``[0, S)``.
        gamma: block size γ.

    Returns:
        :class:`BlockTargets` with ``[nb, γ]`` fields. Out-of-range ids are 0 and out-of-range
        ``target_pos`` entries are clamped to ``S-1`` so that a gather never fails; those slots are invalid.
    """
    if input_ids.dim() != 1 or loss_mask.shape != input_ids.shape or loss_mask.dtype != torch.bool:
        raise ValueError(f"input_ids [S] and a bool loss_mask [S] are required, got {tuple(input_ids.shape)} "
                         f"and {tuple(loss_mask.shape)} {loss_mask.dtype}")
    if anchors.dim() != 1:
        raise ValueError(f"anchors must be 1-D [nb], got {tuple(anchors.shape)}")
    if gamma < 1:
        raise ValueError(f"gamma must be ≥ 1, got {gamma}")
    S = input_ids.numel()
    anchors = anchors.to(device=input_ids.device, dtype=torch.int64)
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= S):
        raise ValueError(f"anchors must lie in [0, {S}), got min {int(anchors.min())} max {int(anchors.max())}")
    k = torch.arange(1, gamma + 1, device=input_ids.device)  # [γ]
    pos = anchors[:, None] + k  # [nb, γ] position each slot predicts
    in_range = pos < S  # [nb, γ]
    prev_in_range = pos - 1 < S  # [nb, γ] slot 1's prev is the anchor itself, always in range
    pos_c = pos.clamp(max=S - 1)
    prev_c = (pos - 1).clamp(max=S - 1)
    labels = torch.where(in_range, input_ids[pos_c], 0)  # [nb, γ]
    prev_tokens = torch.where(prev_in_range, input_ids[prev_c], 0)  # [nb, γ]
    # Cumulative validity: cumprod of the per-slot condition along k.
    valid = (in_range & loss_mask[pos_c]).to(torch.int64).cumprod(dim=1).bool()  # [nb, γ]
    return BlockTargets(labels=labels.to(torch.int64), prev_tokens=prev_tokens.to(torch.int64),
                        target_pos=prev_c, valid=valid)


def dense_block_targets(input_ids: Tensor, loss_mask: Tensor, gamma: int) -> BlockTargets:
    """Every position of every sequence as an anchor: the targets of ``[B, S]`` blocks at once.

    Block ``p`` of row ``b`` is anchored at position ``p``. It is supervised iff ``p`` and ``p+1`` are both
    assistant tokens (the eligibility rule of :func:`sample_anchors`); its slots then follow
    :func:`block_targets`. Ineligible blocks (prompt, padding) keep all slots invalid, so a batch has the
    same fixed ``[B, S, γ]`` shape whatever its content (no per-sequence Python work, no host sync).
    For a row, the result at the eligible positions equals :func:`block_targets` with
    ``anchors = eligible positions``.

    Args:
        input_ids: ``[B, S]`` int64, right-padded.
        loss_mask: ``[B, S]`` bool, True on assistant tokens (False on padding).
        gamma: block size γ.

    Returns:
        :class:`BlockTargets` with ``[B, S, γ]`` fields; ``target_pos`` indexes the row's ``S`` positions.
    """
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape or loss_mask.dtype != torch.bool:
        raise ValueError(f"input_ids [B, S] and a bool loss_mask [B, S] are required, got {tuple(input_ids.shape)} "
                         f"and {tuple(loss_mask.shape)} {loss_mask.dtype}")
    if gamma < 1:
        raise ValueError(f"gamma must be ≥ 1, got {gamma}")
    B, S = input_ids.shape
    device = input_ids.device
    k = torch.arange(1, gamma + 1, device=device)  # [γ]
    pos = torch.arange(S, device=device)[:, None] + k  # [S, γ] position slot k of block p predicts
    in_range = pos < S  # [S, γ]
    pos_c = pos.clamp(max=S - 1)  # [S, γ]
    prev_c = (pos - 1).clamp(max=S - 1)  # [S, γ]; slot 1's previous token is the anchor itself
    labels = torch.where(in_range, input_ids[:, pos_c], 0)  # [B, S, γ]
    prev_tokens = input_ids[:, prev_c]  # [B, S, γ]; where p+k-1 ≥ S the slot is invalid anyway
    eligible = torch.zeros_like(loss_mask)  # [B, S]
    eligible[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    slot_ok = in_range & loss_mask[:, pos_c]  # [B, S, γ]
    valid = (slot_ok & eligible[:, :, None]).to(torch.int64).cumprod(dim=2).bool()  # [B, S, γ]
    return BlockTargets(labels=labels.to(torch.int64), prev_tokens=prev_tokens.to(torch.int64),
                        target_pos=prev_c.expand(B, S, gamma), valid=valid)


def teacher_rows(loss_mask: Tensor) -> int:
    """How many target rows of a sequence (or ``[B, S]`` batch) teach a valid slot of :func:`dense_block_targets`.

    Row ``j`` teaches slot ``k`` of block ``j - k + 1``; such a slot is valid only if ``j`` and ``j + 1`` are both
    response tokens, and then slot 1 of block ``j`` is valid too. So the count is the number of positions ``j``
    with ``loss_mask[j]`` and ``loss_mask[j + 1]``. Count on the host copy of the mask when the data is loaded:
    the fast training loss uses it to skip prompt and padding rows without reading the device (on a device
    tensor, this call synchronises).
    """
    m = loss_mask.bool()
    return int((m[..., :-1] & m[..., 1:]).sum())


def block_attention_mask(anchors: Tensor, gamma: int, ctx_len: int, ctx_valid: Tensor | None = None) -> Tensor:
    """The boolean attention mask of the packed training forward (True = may attend).

    Layout. Queries are the ``nb·γ`` block slots in block order: row ``j·γ + (k-1)`` is slot ``k`` of block
    ``j``. Keys are the context first, then the blocks::

        keys = [context 0 .. ctx_len-1 | block 0's γ slots | block 1's γ slots | ...]

    A query of block ``j`` may attend to context position ``c`` iff ``c < anchors[j]`` (the anchor's own
    target features do not exist yet at draft time) and ``ctx_valid[c]``, and to every slot of its own block
    (non-causal inside the block), never to another block. Context positions are never queries. Every row
    has at least its own block's keys, so no row is empty.

    Args:
        anchors: ``[nb]`` int64 anchor positions in ``[0, ctx_len]``.
        gamma: block size γ.
        ctx_len: number of context keys S.
        ctx_valid: optional ``[ctx_len]`` bool, False for padding context positions.

    Returns:
        ``[nb·γ, ctx_len + nb·γ]`` bool mask on ``anchors``' device.
    """
    if anchors.dim() != 1:
        raise ValueError(f"anchors must be 1-D [nb], got {tuple(anchors.shape)}")
    if gamma < 1 or ctx_len < 0:
        raise ValueError(f"need gamma ≥ 1 and ctx_len ≥ 0, got gamma={gamma} ctx_len={ctx_len}")
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) > ctx_len):
        raise ValueError(f"anchors must lie in [0, {ctx_len}] (context positions before them must exist), "
                         f"got min {int(anchors.min())} max {int(anchors.max())}")
    if ctx_valid is not None and (ctx_valid.shape != (ctx_len,) or ctx_valid.dtype != torch.bool):
        raise ValueError(f"ctx_valid must be a bool tensor [{ctx_len}], got {tuple(ctx_valid.shape)} {ctx_valid.dtype}")
    device = anchors.device
    nb = anchors.numel()
    ctx = torch.arange(ctx_len, device=device)[None, :] < anchors[:, None]  # [nb, S]
    if ctx_valid is not None:
        ctx = ctx & ctx_valid.to(device)[None, :]
    ctx = ctx.repeat_interleave(gamma, dim=0)  # [nb·γ, S] every slot of block j shares block j's context row
    block_of = torch.arange(nb * gamma, device=device) // gamma  # [nb·γ] block index of each query/key slot
    own = block_of[:, None] == block_of[None, :]  # [nb·γ, nb·γ] block-diagonal
    return torch.cat([ctx, own], dim=1)


def _slot_terms(draft_logits: Tensor, target_logits: Tensor | None, labels: Tensor) -> tuple[Tensor, ...]:
    """Per-slot CE, L1, c* and KL for a chunk of rows, in float32.

    Args:
        draft_logits: ``[n, V]`` draft logits ``U + B`` of any float dtype.
        target_logits: ``[n, V]`` target logits (detached), or ``None`` for CE only.
        labels: ``[n]`` int64 ground-truth tokens x*.

    Returns:
        ``ce [n]`` (−log p_d(x*)), and when the target is given ``l1 [n]`` (‖p_d − p_t‖₁),
        ``c_star [n]`` (Σ_v min(p_d, p_t), no graph) and ``kl [n]`` (KL(p_t ‖ p_d)).
    """
    z = draft_logits.float()  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    ce = lse - z.gather(-1, labels[:, None]).squeeze(-1)  # [n]; avoids a full log_softmax tensor
    if target_logits is None:
        return (ce,)
    p_d = torch.exp(z - lse[:, None])  # [n, V]
    log_p_t = torch.log_softmax(target_logits.float(), dim=-1)  # [n, V]
    p_t = log_p_t.exp()  # [n, V]
    diff = p_d - p_t  # [n, V]
    l1 = diff.abs().sum(dim=-1)  # [n]
    # KL(p_t ‖ p_d) = Σ p_t (log p_t − z) + lse, using Σ p_t = 1; xlogy-style: p_t = 0 contributes 0.
    kl = (p_t * (log_p_t - z)).nan_to_num(0.0).sum(dim=-1) + lse  # [n]
    with torch.no_grad():
        # min(p_d, p_t) = p_d - relu(p_d - p_t): reuses diff instead of a third full-width operand.
        c_star = (p_d - diff.clamp_min(0)).sum(dim=-1).clamp(0.0, 1.0)  # [n]
    return ce, l1, c_star, kl


def _weighted_mean(term: Tensor, w: Tensor, valid: Tensor) -> Tensor:
    """``Σ w_k·term / Σ w_k`` over valid slots; 0 (still in the graph) when no slot is valid."""
    wv = torch.where(valid, w, 0.0)  # [N, γ]
    denom = wv.sum()
    # where, not multiply: an invalid slot's term is excluded even if it is inf/NaN in the forward pass.
    num = torch.where(valid, term * wv, 0.0).sum()
    return num / torch.where(denom > 0, denom, torch.ones_like(denom))


def dspark_loss(draft_logits: Tensor, target_logits: Tensor | None, labels: Tensor, conf_logits: Tensor | None,
                valid: Tensor, *, decay: float = 4.0,
                weights: tuple[float, float, float] = (0.1, 0.9, 1.0)) -> dict[str, Tensor]:
    """The DSpark training loss ``w_ce·L_ce + w_l1·L_l1 + w_conf·L_conf`` (docs/method.md §2), in float32.

    Each term is a weighted mean over the valid slots, ``Σ_{n,k valid} w_k·term[n,k] / Σ_{n,k valid} w_k``.
    The confidence target ``c* = Σ_v min(p_d, p_t)`` (at T = 1) is detached: the confidence head learns to
    predict the acceptance probability, it does not pull the draft distribution towards its own estimate.

    Arms: ``weights=(1, 0, 0)`` is the CE-only "DFlash" baseline; pass ``target_logits=None`` and
    ``conf_logits=None`` to skip the target softmax entirely. ``(w_ce, w_l1, 0)`` is the parallel-only mix and
    may pass ``conf_logits=None``. A term whose weight is 0 but whose inputs are given is still reported,
    detached, as a diagnostic. Keys whose inputs are missing are absent from the result.

    Memory. The logits are scored in row chunks of about ``2**22`` elements (``2**26`` on CUDA), each under activation
    checkpointing, so no full ``[N, γ, V]`` float32 temporary is ever built: beyond the inputs, the peak
    is about five ``[chunk, V]`` float32 temporaries plus, in backward, the gradient of ``draft_logits``
    (``[N, γ, V]`` in its own dtype; at most two copies while the chunk gradients are concatenated).
    The price is one extra forward pass over the logits in backward. Invalid slots are computed and
    masked, not skipped, so they must hold finite logits.

    Args:
        draft_logits: ``[N, γ, V]`` draft logits ``U + B`` (teacher forced).
        target_logits: ``[N, γ, V]`` target logits predicting the same tokens (T = 1), or ``None``
            when ``w_l1 == w_conf == 0``. Never receives a gradient.
        labels: ``[N, γ]`` int64 ground-truth tokens.
        conf_logits: ``[N, γ]`` confidence-head logits, or ``None`` when ``w_conf == 0``.
        valid: ``[N, γ]`` bool, cumulative validity from :func:`block_targets`.
        decay: λ of the position weights (:func:`position_weights`).
        weights: ``(w_ce, w_l1, w_conf)`` or ``(w_ce, w_l1, w_conf, w_kl)`` (:class:`LossWeights`),
            non-negative, not all zero.

    Returns:
        ``{"loss", "ce", "l1", "conf", "kl"}`` float32 scalars carrying gradients (a zero-weight term detached),
        plus detached diagnostics ``"acc"`` (argmax hit rate over valid slots) and ``"conf_target_mean"``
        (mean c* over valid slots). No valid slot gives a zero loss that still backpropagates.
    """
    w_ce, w_l1, w_conf, w_kl = LossWeights.of(weights)
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [N, γ, V], got {tuple(draft_logits.shape)}")
    N, gamma, V = draft_logits.shape
    if target_logits is None and (w_l1 > 0 or w_conf > 0 or w_kl > 0):
        raise ValueError("target_logits is None but w_l1, w_conf or w_kl is positive: those terms need p_t")
    if conf_logits is None and w_conf > 0:
        raise ValueError("conf_logits is None but w_conf is positive")
    if target_logits is not None and target_logits.shape != draft_logits.shape:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must match draft_logits {(N, gamma, V)}")
    if labels.shape != (N, gamma) or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 [N, γ] = [{N}, {gamma}], got {tuple(labels.shape)} {labels.dtype}")
    if valid.shape != (N, gamma) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [N, γ] = [{N}, {gamma}], got {tuple(valid.shape)} {valid.dtype}")
    if conf_logits is not None and conf_logits.shape != (N, gamma):
        raise ValueError(f"conf_logits must be [N, γ] = [{N}, {gamma}], got {tuple(conf_logits.shape)}")

    w = position_weights(gamma, decay).to(draft_logits.device)[None, :].expand(N, gamma)  # [N, γ]
    rows_z = draft_logits.reshape(N * gamma, V)  # [N·γ, V]
    rows_t = None if target_logits is None else target_logits.detach().reshape(N * gamma, V)
    rows_y = labels.reshape(N * gamma)  # [N·γ]

    elements = _CUDA_CHUNK_ELEMENTS if draft_logits.is_cuda else _CHUNK_ELEMENTS
    chunk = max(1, elements // max(V, 1))
    recompute = torch.is_grad_enabled() and draft_logits.requires_grad
    parts: list[tuple[Tensor, ...]] = []
    for start in range(0, N * gamma, chunk):
        args = (rows_z[start:start + chunk], None if rows_t is None else rows_t[start:start + chunk],
                rows_y[start:start + chunk])
        # Checkpointing keeps only the (already existing) input slices alive between forward and backward;
        # the chunk's temporaries are rebuilt one chunk at a time during backward.
        parts.append(checkpoint(_slot_terms, *args, use_reentrant=False) if recompute else _slot_terms(*args))
    if not parts:  # N = 0: no rows at all; keep the graph so that backward still runs
        empty = rows_z.float().sum(dim=-1)  # [0]
        parts = [(empty,) if rows_t is None else (empty, empty, empty, empty)]
    terms = [torch.cat(col).reshape(N, gamma) for col in zip(*parts)]  # each [N, γ] float32

    ce = _weighted_mean(terms[0], w, valid)
    out: dict[str, Tensor] = {"ce": ce if w_ce > 0 else ce.detach()}
    loss = w_ce * out["ce"]
    if rows_t is not None:
        l1_slot, c_star, kl_slot = terms[1], terms[2], terms[3]  # [N, γ] each
        l1 = _weighted_mean(l1_slot, w, valid)
        out["l1"] = l1 if w_l1 > 0 else l1.detach()
        loss = loss + w_l1 * out["l1"]
        kl = _weighted_mean(kl_slot, w, valid)
        out["kl"] = kl if w_kl > 0 else kl.detach()
        loss = loss + w_kl * out["kl"]
        nv = valid.sum().clamp_min(1)
        out["conf_target_mean"] = (torch.where(valid, c_star, 0.0).sum() / nv).detach()
        if conf_logits is not None:
            bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")  # [N, γ]
            conf = _weighted_mean(bce, w, valid)
            out["conf"] = conf if w_conf > 0 else conf.detach()
            loss = loss + w_conf * out["conf"]
    with torch.no_grad():
        hit = draft_logits.argmax(dim=-1) == labels  # [N, γ]; argmax is exact in any float dtype
        out["acc"] = (hit & valid).sum().float() / valid.sum().clamp_min(1)
    out["loss"] = loss
    return out
