"""Prompt lookup: a training-free n-gram proposer, the baseline drafter kind (docs/method.md §4, §6).

A trained drafter must beat what a user gets for free. Text often repeats itself — code that edits code, answers
that quote the question, lists, boilerplate — and the free guess is: *what followed the last few tokens the last
time they occurred?* This is the ``ngram`` speculative method of vLLM and transformers' ``prompt_lookup_num_tokens``.

**The lookup.** The context is a request's tokens so far, ``c = prompt + output``; its last token is the anchor
``x_0``. For ``n = max_n, max_n - 1, …, min_n`` (the longest first), take the suffix ``c[L-n:]`` and look for an
earlier occurrence ``c[i:i+n] == c[L-n:]`` with ``i < L - n`` (the suffix itself does not count; an occurrence may
overlap it). The first ``n`` that has one wins, and the proposal is the up-to-γ tokens that followed it,
``x_1..x_m = c[i+n : i+n+γ]``, cut short by the end of the context (``m ≤ γ``). No match: ``m = 0``.

**Which occurrence.** When the suffix occurs several times, the *earliest* one is taken (smallest ``i``), as vLLM's
and transformers' implementations do, so this baseline is theirs. It is also the occurrence with the most tokens
after it, so it never proposes fewer tokens than a later one would. Unlike transformers, the proposal is not cut at
an end-of-sequence token: the loop stops at an emitted EOS anyway, and an EOS the target agrees with is accepted.

**Verification stays lossless.** The proposal is a deterministic function of the context, so its draft
distribution is one-hot, ``p_d_k = δ_{x_k}``. Rejection sampling (``reference/verify.py``) then accepts ``x_k`` with
probability ``min(1, p_t_k(x_k) / 1) = p_t_k(x_k)`` and, on a rejection, draws the recovered token from
``normalize(max(0, p_t_k − δ_{x_k}))``: ``p_t_k`` with ``x_k`` removed. Greedy requests (one-hot ``p_t``) accept
``x_k`` iff it is the target's argmax. Both are the verifier's ordinary arithmetic on one-hot rows, the same as for a
greedy drafter's drafts; nothing here needs special handling.

**Verify lengths.** The proposer has no confidences, so it runs with the scheduling modes that ignore survivals:
``fixed`` (``ℓ_r = min(k, m_r)``) and ``dsd`` (the table's ``K``, clipped to ``m_r`` likewise); ``none`` is plain
decoding. The survival-reading modes (``threshold``, ``adaptive-sync``, ``adaptive``) and the ``oracle`` simulation
are refused (:func:`check_mode`). A request with a short or empty proposal simply verifies fewer slots that step;
``ℓ_r = 0`` is a plain decoding step. τ counts such steps too (one token each), as they cost a target forward.

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``ℓ`` verify length, ``γ`` block size, ``τ``
tokens emitted per step). The engine's twin is ``optimized/ngram.py`` (the same proposals from an incremental index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reference.config import NGRAM_MODES, NgramConfig, SchedulingMode


def find_match(context: Sequence[int], max_n: int, min_n: int) -> tuple[int, int] | None:
    """The longest suffix n-gram of ``context`` (``min_n ≤ n ≤ max_n``) that occurred before, and where.

    Returns:
        ``(n, i)``: ``context[i:i+n] == context[-n:]`` with ``i < len(context) - n`` the earliest such start, or
        ``None`` when no suffix of length ``min_n..max_n`` occurred earlier.
    """
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):  # a suffix needs ≥ 1 token before it to recur
        suffix = list(context[length - n:])
        for i in range(length - n):  # every start before the suffix's own, earliest first
            if list(context[i:i + n]) == suffix:
                return n, i
    return None


def propose(context: Sequence[int], gamma: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``gamma`` tokens that followed the longest recurring suffix of ``context`` (module docstring).

    Args:
        context: the request's tokens so far (prompt + output); the last one is the anchor ``x_0``.
        gamma: γ, the most tokens proposed.
        max_n, min_n: the n-gram lengths tried, longest first.

    Returns:
        ``[x_1..x_m]`` with ``0 ≤ m ≤ γ`` (``[]`` when nothing matched).
    """
    match = find_match(context, max_n, min_n)
    if match is None:
        return []
    n, i = match
    return [int(t) for t in context[i + n:i + n + gamma]]


def check_mode(mode: SchedulingMode) -> None:
    """Refuse the scheduling modes the n-gram proposer cannot drive (they read confidences it does not have)."""
    if SchedulingMode(mode) not in NGRAM_MODES:
        raise ValueError(f"the n-gram proposer has no confidences, so scheduler mode '{mode}' cannot run with it; "
                         f"choose one of {', '.join(m.value for m in NGRAM_MODES)}")


@dataclass
class NgramDraft:
    """One proposal step for R requests, laid out like a drafter's block for the verifier."""

    tokens: Tensor  # [R, γ] int64: x_1..x_m of each proposal, then 0 (never verified: ℓ_r ≤ m_r)
    probs: Tensor  # [R, γ, V] float32: p_d = one-hot of each slot's token (the proposal is deterministic)
    lengths: Tensor  # [R] int64: m_r, the proposal lengths in 0..γ


class NgramProposer:
    """The n-gram proposer as a drafter kind: ``config.gamma`` is its block size, :meth:`draft` its draft stage."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def propose(self, context: Sequence[int]) -> list[int]:
        """:func:`propose` with this proposer's γ and n-gram lengths."""
        cfg = self.config
        return propose(context, cfg.gamma, cfg.max_n, cfg.min_n)

    def draft(self, contexts: list[Sequence[int]], vocab_size: int) -> NgramDraft:
        """The proposals of R requests as a ``[R, γ]`` block with one-hot ``p_d`` (``contexts``: prompt + output)."""
        gamma = self.config.gamma
        proposals = [self.propose(c) for c in contexts]
        tokens = torch.zeros(len(contexts), gamma, dtype=torch.long)  # [R, γ]
        for r, p in enumerate(proposals):
            tokens[r, :len(p)] = torch.tensor(p, dtype=torch.long)
        probs = torch.nn.functional.one_hot(tokens, vocab_size).float()  # [R, γ, V]
        lengths = torch.tensor([len(p) for p in proposals], dtype=torch.long)  # [R]
        return NgramDraft(tokens, probs, lengths)

    def __repr__(self) -> str:
        cfg = self.config
        return f"NgramProposer(gamma={cfg.gamma}, max_n={cfg.max_n}, min_n={cfg.min_n})"
