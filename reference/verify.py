"""Lossless verification of a drafted block: speculative rejection sampling over ragged verify lengths.

Implements docs/method.md §4 (Leviathan et al. 2023, Chen et al. 2023); names follow ``docs/method.md``:
``p_t`` target, ``p_d`` draft, ``ℓ`` verify length, ``γ`` block size, ``τ`` tokens emitted.

Terms, per request ``r`` with anchor ``x_0`` at absolute position ``P`` (docs/contracts.md, "Positions"):

* **draft tokens** ``x_1..x_γ``: slot ``k`` proposes the token at position ``P + k``, sampled from
  ``p_d_k``; only the first ``ℓ_r`` (0..γ) are verified, the rest are ignored.
* **target rows**: the target ran on ``[x_0, x_1..x_ℓ]``; its row ``i`` (0..ℓ) is ``p_t`` of the token at
  position ``P + i + 1``, so row ``k - 1`` judges slot ``k`` and row ``ℓ`` is the bonus distribution.
* **accepted tokens**: for ``k = 1..ℓ`` in order, ``x_k`` is accepted iff ``u · p_d_k(x_k) <= p_t_k(x_k)``,
  i.e. with probability ``min(1, p_t_k(x_k) / p_d_k(x_k))``, where
  ``u = hash_uniform(seed, r, P + k, ACCEPT, lane=0)``. Verification stops at the first rejection.
* **recovered token** (the residual): at the first rejected slot ``k``, one token is drawn from
  ``normalize(max(0, p_t_k - p_d_k))`` at position ``P + k`` with purpose ``RESIDUAL``. If that residual is
  all zero (possible only through float rounding, when ``p_t_k ≈ p_d_k``), it is drawn from ``p_t_k``.
* **bonus token**: if all ``ℓ`` drafts are accepted, one token is drawn from ``p_t_{ℓ+1}`` at position
  ``P + ℓ + 1`` with purpose ``BONUS``. ``ℓ = 0`` is ordinary decoding: the bonus is the only token.
* **emitted tokens**: the accepted drafts then the recovered/bonus token, ``τ = num_accepted + 1`` of
  them. The last one always sits at position ``P + τ`` and becomes the next anchor.

Accepted drafts keep the target's distribution exactly because the accept/residual pair is the standard
rejection-sampling identity ``p_d(x)·min(1, p_t/p_d) + P(reject)·residual(x) = p_t(x)``; it holds only if
``p_d_k`` is *exactly* the distribution ``x_k`` was drawn from (including top-k/top-p and temperature),
and if ``ℓ`` was chosen without looking at the drafts it admits (docs/method.md §5).

Greedy requests pass one-hot ``p_t`` and ``p_d`` (``logits_to_probs`` at temperature 0): the accept test
becomes ``x_k == argmax p_t_k`` (``u ∈ (0, 1)``) and the residual is the one-hot of the target argmax,
which :func:`greedy_verify` computes directly.

End of sequence is not handled here: the generation loop drops every emitted token after an accepted
(or emitted) EOS, and counts τ up to and including the EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reference.sampling import Purpose, hash_uniform, sample

PAD_TOKEN = -1  # fills VerifyResult.tokens after the emitted ones


@dataclass
class VerifyResult:
    """Outcome of verifying one batch of drafted blocks."""

    tokens: Tensor  # [R, γ+1] int64: accepted drafts, then the recovered/bonus token, then PAD_TOKEN
    num_accepted: Tensor  # [R] int64: accepted drafts, 0..ℓ_r
    num_emitted: Tensor  # [R] int64: τ = num_accepted + 1


def check_block_shapes(draft_tokens: Tensor, verify_lens: Tensor) -> tuple[int, int]:
    """Shapes and dtypes of ``draft_tokens [R, γ]`` and ``verify_lens [R]``; returns ``(R, γ)``.

    Reads no values (no host↔device sync), so the optimized twins validate with it too.
    """
    if draft_tokens.ndim != 2 or draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64 [R, γ], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    R, gamma = draft_tokens.shape
    if gamma < 1:
        raise ValueError("draft_tokens must have at least one slot (γ >= 1)")
    if verify_lens.shape != (R,) or verify_lens.dtype != torch.int64:
        raise ValueError(f"verify_lens must be int64 [{R}], got {verify_lens.dtype} {tuple(verify_lens.shape)}")
    return R, gamma


def _check_blocks(draft_tokens: Tensor, verify_lens: Tensor) -> tuple[int, int]:
    """:func:`check_block_shapes` plus the range of every ℓ_r (reads values: the reference may sync)."""
    R, gamma = check_block_shapes(draft_tokens, verify_lens)
    if R and (int(verify_lens.min()) < 0 or int(verify_lens.max()) > gamma):
        raise ValueError(f"verify_lens must lie in [0, γ={gamma}], got {verify_lens.tolist()}")
    return R, gamma


def assemble_result(draft_tokens: Tensor, num_accepted: Tensor, last_token: Tensor) -> VerifyResult:
    """Lay out ``[x_1..x_n, last, -1, …]`` per row from the accepted count ``n`` and the final token.

    Pure tensor ops, no host sync: the optimized torch fallbacks use it as is."""
    R, gamma = draft_tokens.shape
    slot = torch.arange(gamma + 1, device=draft_tokens.device)[None, :]  # [1, γ+1]
    n = num_accepted[:, None]  # [R, 1]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((R, 1), PAD_TOKEN)], dim=1)  # [R, γ+1]
    tokens = torch.where(slot < n, padded_drafts, torch.full_like(padded_drafts, PAD_TOKEN))
    tokens = torch.where(slot == n, last_token[:, None], tokens)  # [R, γ+1]
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)


def _accepted_prefix(accepted: Tensor) -> Tensor:
    """Length of the leading run of True per row: ``[R, γ] bool -> [R] int64``."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def rejection_sample(
    draft_tokens: Tensor,
    verify_lens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    seed: int,
    request_ids: Tensor,
    anchor_positions: Tensor,
) -> VerifyResult:
    """Verify each request's first ``ℓ_r`` drafts against the target (see the module docstring).

    Args:
        draft_tokens: ``[R, γ]`` int64 drafts ``x_1..x_γ``; slots past ``ℓ_r`` are ignored.
        verify_lens: ``[R]`` int64 ``ℓ_r`` in 0..γ; 0 is ordinary decoding (also used for padded rows).
        draft_probs: ``[R, γ, V]`` exactly the ``p_d_k`` each draft was sampled from (one-hot for greedy).
        target_probs: ``[R, γ+1, V]`` ``p_t`` rows; row ``i`` is for position ``P + i + 1``; rows past
            ``ℓ_r`` are ignored and may hold anything, NaN included.
        seed: generation seed.
        request_ids: ``[R]`` int64 request ids (the random-number key, not the batch index).
        anchor_positions: ``[R]`` int64 absolute position ``P`` of each anchor ``x_0``.

    Returns:
        :class:`VerifyResult` with the emitted tokens, accepted counts and ``τ``.
    """
    R, gamma = _check_blocks(draft_tokens, verify_lens)
    V = target_probs.shape[-1]
    if target_probs.shape != (R, gamma + 1, V) or draft_probs.shape != (R, gamma, V):
        raise ValueError(f"expected draft_probs [R={R}, γ={gamma}, V] and target_probs [R, γ+1, V], got "
                         f"{tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    for name, t in (("request_ids", request_ids), ("anchor_positions", anchor_positions)):
        if t.shape != (R,):
            raise ValueError(f"{name} must have shape [{R}], got {tuple(t.shape)}")
    p_t = target_probs.float()  # [R, γ+1, V]
    p_d = draft_probs.float()  # [R, γ, V]
    dev = p_t.device

    k = torch.arange(1, gamma + 1, device=dev)  # [γ] slot numbers
    verified = k[None, :] <= verify_lens[:, None]  # [R, γ] slots 1..ℓ_r
    used_rows = torch.cat([torch.ones(R, 1, dtype=torch.bool, device=dev), verified], dim=1)  # [R, γ+1] rows 0..ℓ
    if not torch.isfinite(p_t[used_rows]).all() or (p_t[used_rows] < 0).any():
        raise ValueError("target_probs rows 0..ℓ must be finite and non-negative")
    if not torch.isfinite(p_d[verified]).all() or (p_d[verified] < 0).any():
        raise ValueError("draft_probs of the verified slots must be finite and non-negative")
    if ((draft_tokens[verified] < 0) | (draft_tokens[verified] >= V)).any():
        raise ValueError(f"verified draft tokens must lie in [0, V={V})")

    # Accept test of every slot at once; slots past ℓ read token 0 and are masked out afterwards.
    x = torch.where(verified, draft_tokens, torch.zeros_like(draft_tokens))[..., None]  # [R, γ, 1]
    pd_x = p_d.gather(-1, x).squeeze(-1)  # [R, γ] p_d_k(x_k)
    pt_x = p_t[:, :gamma].gather(-1, x).squeeze(-1)  # [R, γ] p_t_k(x_k)
    if (verified & (pd_x <= 0)).any():
        raise ValueError("a verified draft token has zero draft probability: draft_probs is not the "
                         "distribution the draft was sampled from")
    u = hash_uniform(seed, request_ids[:, None], anchor_positions[:, None] + k[None, :], Purpose.ACCEPT, 0)  # [R, γ]
    accepted = verified & (u * pd_x <= pt_x)  # [R, γ]
    num_accepted = _accepted_prefix(accepted)  # [R] n, 0..ℓ

    # The one drawn token sits at row n either way: the first rejected slot k = n + 1 (a residual of
    # p_t row n and p_d slot n + 1) or, when n = ℓ, the bonus row ℓ. Its position is P + n + 1.
    rejected = num_accepted < verify_lens  # [R]
    rows = torch.arange(R, device=dev)
    pt_n = p_t[rows, num_accepted]  # [R, V]
    pd_n = p_d[rows, num_accepted.clamp(max=gamma - 1)]  # [R, V] (unused where not rejected)
    residual = (pt_n - pd_n).clamp(min=0)  # [R, V]
    residual = torch.where((residual.sum(-1) > 0)[:, None], residual, pt_n)  # rounding fallback to p_t
    dist = torch.where(rejected[:, None], residual, pt_n)  # [R, V]
    purpose = torch.where(rejected, int(Purpose.RESIDUAL), int(Purpose.BONUS))  # [R]
    last = sample(dist, seed, request_ids, anchor_positions + num_accepted + 1, purpose)  # [R]
    return assemble_result(draft_tokens, num_accepted, last)


def greedy_verify(draft_tokens: Tensor, verify_lens: Tensor, target_logits: Tensor) -> VerifyResult:
    """Greedy verification: accept while ``x_k == argmax p_t_k``; the last token is the target argmax.

    Equal to :func:`rejection_sample` with one-hot ``p_d`` and ``p_t`` (temperature 0), with no random
    numbers and no probabilities.

    Args:
        draft_tokens: ``[R, γ]`` int64 drafts; slots past ``ℓ_r`` are ignored.
        verify_lens: ``[R]`` int64 ``ℓ_r`` in 0..γ.
        target_logits: ``[R, γ+1, V]`` target logits (any float dtype); rows past ``ℓ_r`` are ignored.

    Returns:
        :class:`VerifyResult`.
    """
    R, gamma = _check_blocks(draft_tokens, verify_lens)
    if target_logits.ndim != 3 or target_logits.shape[:2] != (R, gamma + 1):
        raise ValueError(f"target_logits must be [R={R}, γ+1={gamma + 1}, V], got {tuple(target_logits.shape)}")
    verified = torch.arange(1, gamma + 1, device=draft_tokens.device)[None, :] <= verify_lens[:, None]  # [R, γ]
    used_rows = torch.cat([torch.ones_like(verified[:, :1]), verified], dim=1)  # [R, γ+1] rows 0..ℓ
    if torch.isnan(target_logits[used_rows]).any():
        raise ValueError("target_logits rows 0..ℓ contain NaN")
    target_argmax = target_logits.float().argmax(dim=-1)  # [R, γ+1], lowest index on ties
    accepted = verified & (draft_tokens == target_argmax[:, :gamma])  # [R, γ]
    num_accepted = _accepted_prefix(accepted)  # [R]
    last = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [R] correction or bonus
    return assemble_result(draft_tokens, num_accepted, last)
