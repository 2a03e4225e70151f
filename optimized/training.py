"""The fast training step of the drafter: every response position an anchor, one fused LM-head loss.

Twin of the reference training step (``reference.drafter.DSparkDrafter.forward`` + ``head_logits`` +
``reference.losses.dspark_loss`` over :func:`reference.losses.dense_block_targets`), computing the same loss
and the same gradients (``tests/equivalence/test_training.py``) at a fraction of the memory traffic. Names
follow docs/method.md: ``p_t`` target, ``p_d`` draft, γ the block size, ``x_0`` the anchor, ``w_k`` the
position weights.

What makes it fast, and why each piece is exact:

* **Every position is an anchor** (``[B, S]`` blocks per batch instead of a few sampled ones): the target
  forward is paid once per token anyway, and each target row ``j`` is the teacher of γ slots (slot ``k`` of
  the block anchored at ``j-k+1``). :func:`fused_head_loss` reads each target row once, computes its softmax
  once and scores it against all γ slots that predict it.
* **Two-part attention** (:func:`dense_backbone`). A query of block ``p`` sees the context keys ``c < p``
  and the γ keys of its own block. The reference packs the blocks after the context and masks a
  ``[S·γ, S + S·γ]`` score matrix, ``S·γ`` columns of which are zero but for γ; here the block part is a
  batched ``γ × γ`` product and the two parts share one softmax. Same arithmetic, ~γ·S/(S+γ)·... fewer FLOPs.
* **The LM head and the loss fused in row chunks** (:class:`_HeadLoss`). Draft logits ``[rows, V]`` exist
  one chunk at a time; the chunk's loss *and* its gradient with respect to the LM-head input are computed in
  the forward pass (the gradient of soft cross-entropy is ``p_d - p_t``, of CE ``p_d - onehot``, of L1
  ``p_d ⊙ (s - Σ p_d s)`` with ``s = sign(p_d - p_t)``), so backward is a multiplication by the incoming
  scalar. No ``[B, S, γ, V]`` tensor, no full-vocabulary float32 copy of the target logits, no second
  pass over the logits in backward (the reference's chunked loss recomputes its chunks under
  checkpointing).
* **Only the rows that teach** (``num_rows``): a target row teaches a valid slot only where it and the next
  position are response tokens; the caller counts those rows on the host when the data is loaded, and the LM head
  and the loss run on them alone (prompt and padding rows would cost as much and contribute nothing).
* **One kernel per chunk for the per-row work** (``optimized.kernels.distill_loss``, on a GPU): the softmaxes,
  the loss terms and the gradient read each bf16 logits row three times and write the gradient over it, where
  the same arithmetic in torch makes about fifteen passes over float32 temporaries.
* **No host synchronisation**: targets and validity are built on the device with fixed shapes, the loss
  denominators are tensors, and the per-slot statistics come back as one tensor the caller reads when it
  logs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from optimized.kernels.distill_loss import ROW_STATS, distill_rows
from reference.drafter import DSparkDrafter, apply_rope, rope_cos_sin
from reference.losses import PAPER_WEIGHTS, BlockTargets, LossWeights, dense_block_targets, position_weights

# Elements of one [rows, V] float32 temporary in the fused loss. About five such temporaries are alive per chunk,
# so 2**26 (256 MiB each, ~1.3 GB in all) keeps the loss's memory small next to the backbone's activations on a
# GPU while making each chunk's matrix products large (1365 rows of SmolLM2's 49152-wide vocabulary); on a CPU a
# chunk of 2**22 elements keeps the temporaries in cache-friendly sizes.
CUDA_CHUNK_ELEMENTS = 2**26
CPU_CHUNK_ELEMENTS = 2**22
# With the Triton kernel the only [rows, V] temporary is the bf16 logits chunk, overwritten by its gradient: 2**28
# elements (512 MiB) make the LM-head products large and the chunks few.
TRITON_CHUNK_ELEMENTS = 2**28

STAT_NAMES = ("count", "label_hit", "target_hit", "accept_proxy", "ce", "kl", "l1")
"""Columns of :attr:`HeadLoss.slot_stats`: per slot, sums over valid slots (not weighted by ``w_k``)."""


# --------------------------------------------------------------------------- backbone


def dense_backbone(drafter: DSparkDrafter, input_ids: Tensor, features: Tensor, attention_mask: Tensor, *,
                   attention: str = "auto") -> Tensor:
    """The parallel backbone for a block anchored at every position: ``h [B, S, γ, d]``.

    Same result as ``drafter(input_ids, arange(S), features, arange(S), attention_mask)`` (the reference's
    packed forward with ``anchors = every position``), computed with the two-part attention of the module
    docstring.

    Args:
        drafter: the drafter, its target attached (for the embedding of the anchors).
        input_ids: ``[B, S]`` int64 right-padded tokens; position ``p`` is block ``p``'s anchor ``x_0``.
        features: ``[B, S, m·d]`` the target's tapped features at every position.
        attention_mask: ``[B, S]`` bool, False on padding (padding is never a context key of a real anchor).
        attention: how the block queries attend. ``"einsum"``: the two-part attention, its ``[.., S, γ, S + γ]``
            scores materialised; ``"flex"``: one FlexAttention call over ``[context; every block]`` keys with a
            block-sparse mask (context keys ``c < p``, the keys of block ``p`` itself), compiled on CUDA, so no score
            tensor is materialised. ``"auto"``: ``"flex"`` on CUDA (3.1× the training step's throughput at 8,192
            tokens per batch and 3 layers on an H200, ``docs/benchmarks/training-flex-h200.json``), ``"einsum"``
            elsewhere (FlexAttention has no backward on a CPU).

    Returns:
        ``h [B, S, γ, d]`` after the final norm; slot ``k`` (index ``k-1``) of block ``p`` predicts ``p + k``.
    """
    if attention not in ("auto", "einsum", "flex"):
        raise ValueError(f"attention must be 'auto', 'einsum' or 'flex', got {attention!r}")
    if attention == "auto":
        attention = "flex" if input_ids.is_cuda else "einsum"
    cfg = drafter.config
    B, S = input_ids.shape
    gamma, H, Hkv, D = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G = H // Hkv
    if features.shape[:2] != (B, S) or attention_mask.shape != (B, S):
        raise ValueError(f"input_ids {tuple(input_ids.shape)}, features {tuple(features.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must share [B, S]")
    device = input_ids.device
    pos = torch.arange(S, device=device)
    blk_pos = (pos[:, None] + torch.arange(gamma, device=device)).reshape(1, S * gamma).expand(B, -1)  # [B, S·γ]
    ctx_pos = pos.expand(B, S)  # [B, S]
    flex = attention == "flex"
    if flex:
        block_mask = _block_mask(S, gamma, device)
    else:
        # Block p sees context key c iff c < p (the anchor's own features do not exist at draft time) and c is real.
        sees_ctx = (pos[None, :] < pos[:, None])[None] & attention_mask.bool()[:, None, :]  # [B, S(p), S(c)]
        sees_ctx = sees_ctx[:, None, None, :, None, :]  # [B, 1, 1, S, 1, S] over (Hkv, G, p, slot, c)

    x = drafter.block_embeddings(input_ids).reshape(B, S * gamma, -1)  # [B, S·γ, d]
    h_ctx = drafter.project_context(features)  # [B, S, d]
    for layer in drafter.layers:
        attn = layer.self_attn
        xn = layer.input_layernorm(x)
        q = attn.q_proj(xn).view(B, S * gamma, H, D)  # [B, S·γ, H, D]
        if attn.q_norm is not None:
            q = attn.q_norm(q)
        cos, sin = rope_cos_sin(blk_pos, D, attn.rope_theta, q.dtype)  # [B, S·γ, D]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, S·γ, D]
        k_blk, v_blk = attn.project_kv(xn, blk_pos)  # [B, Hkv, S·γ, D] each
        k_ctx, v_ctx = attn.project_kv(h_ctx, ctx_pos)  # [B, Hkv, S, D] each
        if flex:  # keys [context (S); blocks (S·γ)], queries in block order: one block-sparse attention
            y = _flex_attention(q.is_cuda)(q, torch.cat((k_ctx, k_blk), dim=2), torch.cat((v_ctx, v_blk), dim=2),
                                  block_mask=block_mask, enable_gqa=True)  # [B, H, S·γ, D]
        else:
            q = q.reshape(B, Hkv, G, S, gamma, D) * D ** -0.5  # query head i reads kv head i // G, as the reference
            k_blk, v_blk = k_blk.view(B, Hkv, S, gamma, D), v_blk.view(B, Hkv, S, gamma, D)
            s_ctx = torch.einsum("bhgpid,bhcd->bhgpic", q, k_ctx)  # [B, Hkv, G, S, γ, S]
            s_ctx = s_ctx.masked_fill(~sees_ctx, float("-inf"))
            s_blk = torch.einsum("bhgpid,bhpjd->bhgpij", q, k_blk)  # [B, Hkv, G, S, γ, γ]: own block, non-causal
            # One softmax over [context | own block]; every row has its own block's keys, so none is empty.
            probs = torch.cat((s_ctx, s_blk), dim=-1).float().softmax(dim=-1).to(q.dtype)  # [.., S, γ, S + γ]
            y = torch.einsum("bhgpic,bhcd->bhgpid", probs[..., :S], v_ctx) \
                + torch.einsum("bhgpij,bhpjd->bhgpid", probs[..., S:], v_blk)  # [B, Hkv, G, S, γ, D]
            y = y.reshape(B, H, S * gamma, D)
        y = y.transpose(1, 2).reshape(B, S * gamma, H * D)
        x = x + attn.o_proj(y)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.final_norm(x).view(B, S, gamma, -1)


def _block_mask(S: int, gamma: int, device: torch.device):
    """FlexAttention's block mask for queries ``p·γ + i`` over keys ``[context c < S; block keys S + p'·γ + j]``:
    context key ``c`` iff ``c < p``, block key iff ``p' = p``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        p = q_idx // gamma
        return ((kv_idx < S) & (kv_idx < p)) | ((kv_idx >= S) & ((kv_idx - S) // gamma == p))

    return create_block_mask(mask_mod, None, None, S * gamma, S * (1 + gamma), device=device)


_FLEX: dict[bool, object] = {}


def _flex_attention(cuda: bool):
    """``flex_attention``: compiled once per process for CUDA tensors (dynamic shapes: every batch has its own
    ``B, S``); eager for CPU tensors (the unfused implementation, for the CPU tests)."""
    if cuda not in _FLEX:
        import warnings

        from torch.nn.attention.flex_attention import flex_attention

        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        _FLEX[cuda] = torch.compile(flex_attention, dynamic=True) if cuda else flex_attention
    return _FLEX[cuda]


# --------------------------------------------------------------------------- fused LM head + loss


class HeadLoss(NamedTuple):
    """What :func:`fused_head_loss` returns."""

    loss: Tensor  # scalar: w_ce·L_ce + w_l1·L_l1 + w_kl·L_kl (+ w_conf·L_conf when conf_logits are given)
    terms: dict[str, Tensor]  # detached scalars "ce", "l1", "kl", "conf": the weighted means of dspark_loss
    c_star: Tensor  # [B, S, γ] float32 Σ_v min(p_d, p_t), detached (the confidence target); 0 where invalid
    slot_stats: Tensor  # [γ, len(STAT_NAMES)] float32 per-slot sums over valid slots, detached


def _row_order(B: int, S: int, gamma: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Draft rows ordered by the target row they are scored against.

    Slot ``k`` of block ``p`` predicts position ``p + k`` from the target row ``j = p + k - 1``. Row
    ``(b, j, k)`` of the returned order is draft row ``(b, j - k + 1, k)`` of the flattened ``[B, S, γ]``
    layout, so the γ draft rows of one target row are adjacent and its softmax is computed once.

    Returns:
        ``index [B·S·γ]`` int64 into the flattened draft rows (clamped where ``j - k + 1 < 0``) and
        ``exists [B·S·γ]`` bool, False for those clamped entries.
    """
    j = torch.arange(S, device=device)[:, None]  # [S, 1]
    k = torch.arange(gamma, device=device)[None, :]  # [1, γ] (slot k+1)
    p = j - k  # [S, γ] the anchor of slot k+1 that is scored against target row j
    exists = (p >= 0).expand(B, S, gamma)  # [B, S, γ]
    b = torch.arange(B, device=device)[:, None, None]  # [B, 1, 1]
    index = (b * S + p.clamp_min(0)) * gamma + k  # [B, S, γ]
    return index.reshape(-1), exists.reshape(-1)


class _HeadLoss(torch.autograd.Function):
    """Fused, chunked ``lm_head`` (+ full-table ``W2``) and the loss terms, gradients computed in forward."""

    @staticmethod
    def forward(ctx, x_lm: Tensor, x_seq: Tensor | None, w2: Tensor | None, lm_weight: Tensor, target_logits: Tensor,
                labels: Tensor, row_weight: Tensor, weights: LossWeights, chunk_rows: int, mm_dtype: torch.dtype,
                backend: str):
        # x_lm [M, d], x_seq [M, r] | None, w2 [V, r] | None, lm_weight [V, d] (frozen), target_logits [T, V],
        # labels [M], row_weight [M] = w_k / Σ w_k over valid slots (0 where invalid). Rows are ordered by
        # _row_order: rows [γ·t, γ·(t+1)) are the γ slots scored against target row t, so M = γ·T.
        M, T = labels.shape[0], target_logits.shape[0]
        gamma = M // T
        dev = x_lm.device
        w_lm = lm_weight.to(mm_dtype)  # [V, d]; matrix products in mm_dtype (bf16 on a GPU), fp32 accumulation
        w_2 = None if w2 is None else w2.detach().to(mm_dtype)  # [V, r]
        grad_x = torch.empty(M, x_lm.shape[1], dtype=torch.float32, device=dev)
        grad_seq = None if x_seq is None else torch.empty(M, x_seq.shape[1], dtype=torch.float32, device=dev)
        grad_w2 = None if w2 is None else torch.zeros(w2.shape, dtype=torch.float32, device=dev)
        per_row = torch.empty(M, len(ROW_STATS), dtype=torch.float32, device=dev)  # ce, l1, kl, c*, hits
        rows_t = max(1, chunk_rows // gamma)  # target rows per chunk
        term_weights = (weights.ce, weights.kl, weights.l1)
        with torch.autocast(dev.type, enabled=False):
            for t0 in range(0, T, rows_t):
                t1 = min(t0 + rows_t, T)
                r0, r1 = t0 * gamma, t1 * gamma
                z = x_lm[r0:r1].detach().to(mm_dtype) @ w_lm.t()  # [c·γ, V] U (+ the factored Markov bias)
                if x_seq is not None:
                    z += x_seq[r0:r1].detach().to(mm_dtype) @ w_2.t()  # + B = W2·x_seq (full tables)
                # dL/dz and the per-row terms (optimized.kernels.distill_loss), the gradient written over z
                gm, per_row[r0:r1] = distill_rows(z, target_logits[t0:t1], labels[r0:r1], row_weight[r0:r1],
                                                  term_weights, out=z, backend=backend)
                grad_x[r0:r1] = (gm @ w_lm).float()  # [c·γ, d]
                if x_seq is not None:
                    grad_seq[r0:r1] = (gm @ w_2).float()  # [c·γ, r]
                    grad_w2 += (gm.t() @ x_seq[r0:r1].detach().to(mm_dtype)).float()  # [V, r]
        means = (row_weight[:, None] * per_row[:, :3]).sum(0)  # [3] weighted means of ce, l1, kl
        loss = weights.ce * means[0] + weights.l1 * means[1] + weights.kl * means[2]
        ctx.save_for_backward(grad_x, *(() if grad_seq is None else (grad_seq, grad_w2)))
        ctx.dtypes = (x_lm.dtype, None if x_seq is None else x_seq.dtype, None if w2 is None else w2.dtype)
        ctx.mark_non_differentiable(means, per_row)
        return loss, means, per_row

    @staticmethod
    def backward(ctx, grad_loss, _means, _per_row):
        x_dtype, seq_dtype, w2_dtype = ctx.dtypes
        grads = ctx.saved_tensors
        gx = (grads[0] * grad_loss).to(x_dtype)
        if seq_dtype is None:
            return gx, None, None, None, None, None, None, None, None, None, None
        return (gx, (grads[1] * grad_loss).to(seq_dtype), (grads[2] * grad_loss).to(w2_dtype),
                None, None, None, None, None, None, None, None)


def fused_head_loss(drafter: DSparkDrafter, h: Tensor, targets: BlockTargets, target_logits: Tensor, *,
                    weights: LossWeights | tuple = PAPER_WEIGHTS, decay: float = 4.0,
                    chunk_elements: int | None = None, denominator: Tensor | None = None,
                    num_rows: int | None = None, backend: str = "auto") -> HeadLoss:
    """The DSpark loss of a dense batch (every position an anchor), the LM head fused into it.

    Equals ``dspark_loss(*drafter.head_logits(h, targets.prev_tokens), p_t, ...)`` over the valid slots of
    :func:`reference.losses.dense_block_targets`, with ``p_t`` the target logits of row ``p + k - 1``; the
    weights ``(ce, l1, conf, kl)`` and position decay mean the same.

    Args:
        drafter: the drafter (its target attached): its heads and the target's LM head are used.
        h: ``[B, S, γ, d]`` from :func:`dense_backbone`.
        targets: :func:`reference.losses.dense_block_targets` of the batch (``[B, S, γ]`` fields).
        target_logits: ``[B, S, V]`` the target's logits at every position, any float dtype (bf16 is fine: each
            row is read once and converted chunk by chunk).
        weights: :class:`reference.losses.LossWeights` or a 3/4-tuple.
        decay: λ of the position weights.
        chunk_elements: elements of one ``[rows, V]`` temporary (default: by device).
        denominator: ``Σ w_k`` over the valid slots that the means divide by; default this batch's
            (:func:`weight_sum`). Data-parallel training passes the sum over every rank's batch, so that the
            ranks' summed gradients are exactly the gradient of one process on the whole global batch.
        num_rows: an upper bound on the target rows that teach a valid slot, known on the host
            (``reference.losses.teacher_rows``: the positions ``j`` with ``j`` and ``j + 1`` both response
            tokens). The LM head and the loss then run on that many target rows (teachers first) instead of all
            ``B·S``: prompt and padding positions cost nothing. ``None``: every row. A bound below the true count drops
            supervision, so pass the exact count or more.
        backend: the per-row loss work (``optimized.kernels.distill_loss``): ``"auto"`` runs the Triton kernel on
            CUDA and the torch definition elsewhere; ``"triton"`` / ``"torch"`` force one.

    Returns:
        :class:`HeadLoss`.
    """
    w = LossWeights.of(weights)
    B, S, gamma, d = h.shape
    V = target_logits.shape[-1]
    if target_logits.shape[:2] != (B, S):
        raise ValueError(f"target_logits must be [B, S, V] = [{B}, {S}, V], got {tuple(target_logits.shape)}")
    if targets.labels.shape != (B, S, gamma):
        raise ValueError(f"targets must be [B, S, γ] = [{B}, {S}, {gamma}], got {tuple(targets.labels.shape)}")
    x_lm, x_seq, e_prev = drafter.head_features(h, targets.prev_tokens)  # [B, S, γ, d], [.., r] | None
    lm_weight = drafter.target_modules()[1].weight.detach()  # [V, d], frozen
    w2 = drafter.seq_head.w2.weight if x_seq is not None else None  # [V, r] trainable table

    valid = targets.valid  # [B, S, γ]
    wk = position_weights(gamma, decay).to(h.device)  # [γ]
    wv = torch.where(valid, wk, 0.0)  # [B, S, γ]
    denom = (wv.sum() if denominator is None else denominator).clamp_min(1e-12)  # Σ w_k, a tensor (no sync)

    index, exists = _row_order(B, S, gamma, h.device)  # [B·S·γ] each
    ok = exists & valid.reshape(-1)[index]  # [B·S·γ]
    teacher_logits = target_logits.reshape(B * S, V)  # [B·S, V]
    if num_rows is not None and num_rows < B * S:
        # Keep the target rows that teach a valid slot (stable: in order), then others up to num_rows; a fixed
        # count known on the host, so no sync. The γ draft rows of each kept target row stay adjacent.
        teaches = ok.view(B * S, gamma).any(dim=1)  # [B·S]
        keep = torch.argsort((~teaches).to(torch.int8), stable=True)[:max(num_rows, 1)]  # [R]
        sel = (keep[:, None] * gamma + torch.arange(gamma, device=h.device)).reshape(-1)  # [R·γ]
        index, ok, teacher_logits = index[sel], ok[sel], teacher_logits[keep]

    def ordered(t: Tensor) -> Tensor:  # [B, S, γ, ...] -> [M, ...] in target-row order
        return t.reshape(B * S * gamma, *t.shape[3:])[index]

    row_weight = ordered(wv / denom) * ok  # [M]
    dev = h.device.type
    mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    if backend == "auto":
        backend = "triton" if h.is_cuda else "torch"
    elements = chunk_elements or (TRITON_CHUNK_ELEMENTS if backend == "triton" and h.is_cuda
                                  else CUDA_CHUNK_ELEMENTS if h.is_cuda else CPU_CHUNK_ELEMENTS)
    loss, means, per_row = _HeadLoss.apply(
        ordered(x_lm), None if x_seq is None else ordered(x_seq), w2, lm_weight, teacher_logits,
        ordered(targets.labels), row_weight, w, max(gamma, elements // max(V, 1)), mm_dtype, backend)
    # c* back in the [B, S, γ] layout: each valid draft row appears exactly once in the order; the others add 0
    # (accumulating, so that the clamped indices of rows that do not exist cannot overwrite a real value).
    c_star = torch.zeros(B * S * gamma, device=h.device).index_put_(
        (index,), torch.where(ok, per_row[:, 3], 0.0), accumulate=True).view(B, S, gamma)
    terms = {"ce": means[0], "l1": means[1], "kl": means[2]}

    conf_logits = drafter.conf_logits(h, e_prev) if w.conf > 0 else None  # [B, S, γ]
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")  # [B, S, γ]
        conf = torch.where(valid, bce * wv, 0.0).sum() / denom
        terms["conf"] = conf.detach()
        loss = loss + w.conf * conf

    # Per-slot sums over valid slots (STAT_NAMES); the slot of ordered row (b, j, k) is k.
    slot = torch.arange(gamma, device=h.device).repeat(per_row.shape[0] // gamma)  # [M]
    cols = torch.stack((torch.ones_like(row_weight), per_row[:, 4], per_row[:, 5], per_row[:, 3], per_row[:, 0],
                        per_row[:, 2], per_row[:, 1]), dim=1) * ok[:, None].float()  # [M, 7]
    stats = torch.zeros(gamma, len(STAT_NAMES), device=h.device).index_add_(0, slot, cols)
    return HeadLoss(loss=loss, terms=terms, c_star=c_star, slot_stats=stats)


def weight_sum(targets: BlockTargets, decay: float = 4.0) -> Tensor:
    """``Σ w_k`` over the valid slots of a batch: the denominator of every loss term's weighted mean."""
    gamma = targets.valid.shape[-1]
    return torch.where(targets.valid, position_weights(gamma, decay).to(targets.valid.device), 0.0).sum()


def dense_step_loss(drafter: DSparkDrafter, input_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor,
                    features: Tensor, target_logits: Tensor, *, weights: LossWeights | tuple = PAPER_WEIGHTS,
                    decay: float = 4.0, chunk_elements: int | None = None,
                    denominator: Tensor | None = None, num_rows: int | None = None,
                    backend: str = "auto", attention: str = "auto") -> HeadLoss:
    """One dense training step's loss: targets, backbone and fused head loss of a right-padded batch.

    Args:
        input_ids, loss_mask, attention_mask: ``[B, S]`` (int64, bool, bool).
        features: ``[B, S, m·d]`` and target_logits ``[B, S, V]`` from one target forward of the batch.
        denominator, num_rows, backend: see :func:`fused_head_loss`.
        attention: see :func:`dense_backbone`.
    """
    targets = dense_block_targets(input_ids, loss_mask & attention_mask, drafter.config.block_size)
    h = dense_backbone(drafter, input_ids, features, attention_mask, attention=attention)  # [B, S, γ, d]
    return fused_head_loss(drafter, h, targets, target_logits, weights=weights, decay=decay,
                           chunk_elements=chunk_elements, denominator=denominator, num_rows=num_rows,
                           backend=backend)
