"""The hybrid proposer: per request and step, the DSpark block or the n-gram continuation, whichever is expected to be
accepted longer (docs/method.md §1, §4, §5; the n-gram proposer is ``reference/ngram.py``).

The trained drafter is weak where the text copies its input (summaries, answers over a given context, edits of code
in the prompt), and prompt lookup is strong exactly there; elsewhere lookup finds nothing or guesses badly. The hybrid
runs both every step and lets each request take, for the next verification, the block with the larger **expected
accepted length** ``E = Σ_k a_k``, where ``a_k`` is the probability that drafts ``1..k`` all survive (the expected
number of accepted drafts of a block whose every slot is verified).

**The DSpark side.** ``E_d = Σ_k a_k`` over the calibrated prefix survivals of the request's *latest DSpark draft made
at an earlier step* (the drafter runs at every step, so this is normally the previous step's). Not the current
draft's: its ``a_k`` for ``k ≥ 2`` read the draws ``x_1..x_{k-1}`` (the confidence head sees the previous token), so
a choice that read them would decide whether the drafter's ``x_1`` is verified *after* looking at ``x_1``, which
breaks the losslessness rule of docs/method.md §5 exactly as Appendix A's example does: were ``a_2`` high after
``x_1 = A`` and low after ``x_1 = B``, the DSpark blocks that get verified would start with A more often than ``p_d``
draws it, and the output would lean towards A. An earlier draft's survivals are functions of earlier draws only, whose
random numbers are never reused (the contract keys them by position and slot, and anchors only move forward), so
given the choice the current block is still an exact sample of its ``p_d``.

A greedy request could read the current draft's survivals (its tokens are the target's argmax whatever block is
verified), and every request reads the earlier draft's all the same: on the CPU (float32, 105 prompts of
``docs/benchmarks/eval_tasks.jsonl``, 256 tokens, the shipped drafter) choosing a greedy request's block on the current
draft's survivals gave τ 2.906 against 2.929, with context QA 2.52 against 2.69 and translation 3.29 against 3.39
(``docs/benchmarks/proposers-tasks-cpu.json``). The n-gram blocks it took were accepted less (τ 2.97 against 3.67
on context QA, 2.22 against 2.87 on chat): a weak earlier draft marks a stretch the answer copies from its input,
where the lookup is right; a weak current draft more often marks text new to both.

**The n-gram side.** The lookup of ``reference/ngram.py`` (longest recurring suffix, ``min_n ≤ n ≤ max_n``) proposes
``x_1..x_m`` (``m ≤ γ``). Its survivals are estimated online from the request's own verifications of earlier n-gram
blocks, bucketed by the match length ``n`` and the slot ``k``: ``N_{n,k}`` counts the blocks of match length ``n``
that verified slot ``k`` with slots ``1..k-1`` accepted (slot ``k`` accepted or the first rejected one; slots never
verified say nothing and do not count), ``A_{n,k}`` those that accepted it. With a Beta(α, β) prior
(``HybridConfig.prior_accept`` for a greedy request, ``prior_accept_sampling`` for one that samples, and
``prior_strength``),

    ĉ_{n,k} = (A_{n,k} + α) / (N_{n,k} + α + β),    a^ng_k = Π_{j ≤ k} ĉ_{n,j} (k ≤ m),  0 past m,
    E_ng = Σ_k a^ng_k.

A posterior mean per slot, chained like the drafter's conditional confidences ``c_k`` into prefix survivals. The
counts are per request, never shared: a request's choices, hence its tokens, never depend on the other requests of
its batch, and the reference loop (batched or one request at a time) and the engine agree.

**The rule.** The n-gram block iff ``E_ng > E_d``. Ties, a request without a match, and a request without an earlier
DSpark draft (its first step) take the DSpark block. Every input is known before this step's draws: the context, the
earlier draft's survivals and the outcomes of earlier verifications.

**What the scheduler and the verifier see.** The chosen block's tokens; its ``p_d`` (the drafter's distributions, or
the one-hot of the n-gram tokens, as ``reference/ngram.py`` verifies them); its survivals (the drafter's current
``a_k``, or ``a^ng_k``, zero past ``m``), so the modes that read survivals (``threshold``, ``adaptive-sync``,
``adaptive`` and its draft gate) run with the hybrid as with the drafter alone; and its length cap (``γ``, or ``m``):
every mode's ``ℓ_r`` is clipped to it (a top-B allocation could otherwise hand out zero-survival slots past ``m``).
The ``oracle`` simulation is refused (:func:`check_mode`). The choice is a deterministic function of what came before
the step, and rejection sampling uses the chosen block's own ``p_d``: the output is the target's (docs/method.md §4).

**After verification**, a request that verified an n-gram block adds its outcome to the ``(n, k)`` buckets
(:meth:`HybridState.observe`). The drafter runs every step for every request whatever is chosen: its survivals are the
next step's ``E_d``, and its draws, keyed by the random-number contract (``reference/sampling.py``), are the same
numbers whether or not its block is taken.

The engine's twin (``optimized/runner.py``, ``ModelRunner.draft_hybrid``) runs the drafter, then this module's
:class:`HybridState` on the host beside its incremental lookup index (``optimized/ngram.py``), and overwrites the
device rows of the requests that take the n-gram block.

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length, ``γ``
block size, ``τ`` tokens emitted per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reference.config import HybridConfig, SchedulingMode
from reference.drafter import DraftOutput, DSparkDrafter
from reference.ngram import find_match

# What a step verified, per request (``Request.proposal_sources``, ``Sequence.proposal_sources``).
DSPARK, NGRAM, PLAIN = "dspark", "ngram", "none"  # PLAIN: no block (mode none, or the draft gate closed)
SOURCES: tuple[str, ...] = (DSPARK, NGRAM, PLAIN)

# Every policy but the oracle simulation, which verifies the whole block and records its outcome: an n-gram block
# past its length m has nothing to verify.
HYBRID_MODES: tuple[SchedulingMode, ...] = tuple(m for m in SchedulingMode if m is not SchedulingMode.ORACLE)


def check_mode(mode: SchedulingMode) -> None:
    """Refuse the scheduling modes the hybrid proposer cannot drive (the ``oracle`` simulation)."""
    if SchedulingMode(mode) not in HYBRID_MODES:
        raise ValueError(f"the hybrid proposer's n-gram blocks may be shorter than γ, so scheduler mode '{mode}' "
                         f"cannot run with it; choose one of {', '.join(m.value for m in HYBRID_MODES)}")


def expected_length(survival: Sequence[float]) -> float:
    """``E = Σ_k a_k``, the expected number of accepted drafts of a block whose slots are all verified, summed in slot
    order in float64 (the reference and the engine call this one function on the same floats)."""
    total = 0.0
    for a in survival:
        total += float(a)
    return total


class NgramAcceptance:
    """One request's online estimate of its n-gram blocks' survivals (module docstring): counts per (n, k)."""

    def __init__(self, config: HybridConfig, sampling: bool = False) -> None:
        self.config = config
        self.prior = config.prior_for(sampling)  # (α, β): the request's decoding mode picks the prior
        shape = (config.max_n, config.gamma)  # row n - 1, column k - 1
        self.trials = [[0] * shape[1] for _ in range(shape[0])]  # N_{n,k}: slot k verified with 1..k-1 accepted
        self.accepted = [[0] * shape[1] for _ in range(shape[0])]  # A_{n,k}: and accepted

    def _row(self, n: int) -> int:
        cfg = self.config
        if not cfg.min_n <= n <= cfg.max_n:
            raise ValueError(f"match length n = {n} outside {cfg.min_n}..{cfg.max_n}")
        return n - 1

    def conditional(self, n: int, k: int) -> float:
        """``ĉ_{n,k} = (A + α) / (N + α + β)``: the posterior mean of P(slot k accepted | slots 1..k-1 accepted)."""
        row, (alpha, beta) = self._row(n), self.prior
        return (self.accepted[row][k - 1] + alpha) / (self.trials[row][k - 1] + alpha + beta)

    def survival(self, n: int, m: int) -> list[float]:
        """``[a^ng_1..a^ng_γ]`` of a block of ``m`` tokens after a match of length ``n``: the running product of the
        conditionals up to ``m``, then zeros (float64)."""
        if not 1 <= m <= self.config.gamma:
            raise ValueError(f"an n-gram block holds 1..γ = 1..{self.config.gamma} tokens, got m = {m}")
        out, a = [], 1.0
        for k in range(1, self.config.gamma + 1):
            if k <= m:
                a *= self.conditional(n, k)
                out.append(a)
            else:
                out.append(0.0)
        return out

    def update(self, n: int, verify_len: int, num_accepted: int) -> None:
        """Count one verification of a block of match length ``n``: slots ``1..ℓ`` were verified and ``1..num_accepted``
        accepted. Slots ``1..min(num_accepted + 1, ℓ)`` were reached (the last one rejected when ``num_accepted < ℓ``);
        the others were never verified and count nothing."""
        if not 0 <= num_accepted <= verify_len <= self.config.gamma:
            raise ValueError(f"need 0 ≤ accepted ≤ ℓ ≤ γ, got accepted {num_accepted}, ℓ {verify_len}")
        row = self._row(n)
        for k in range(1, min(num_accepted + 1, verify_len) + 1):
            self.trials[row][k - 1] += 1
            self.accepted[row][k - 1] += k <= num_accepted


@dataclass(frozen=True)
class Choice:
    """One request's block for the next verification."""

    source: str  # DSPARK or NGRAM
    tokens: tuple[int, ...] = ()  # NGRAM: x_1..x_m (DSPARK: the drafter's block, not kept here)
    survival: tuple[float, ...] = ()  # NGRAM: [γ] a^ng_k, zero past m (float64)
    n: int = 0  # NGRAM: the match length
    e_ngram: float | None = None  # E_ng (None: no match)
    e_dspark: float | None = None  # E_d of the earlier DSpark draft (None: none yet)

    def cap(self, gamma: int) -> int:
        """The most slots a verification may take from this block: ``m`` (the n-gram block) or ``γ`` (the drafter's)."""
        return len(self.tokens) if self.source == NGRAM else gamma


class HybridState:
    """One request's memory: its n-gram acceptance counts, the survivals of its latest DSpark draft, and the block it
    holds (chosen by :meth:`choose`, settled by :meth:`observe`)."""

    def __init__(self, config: HybridConfig, sampling: bool = False) -> None:
        self.config = config
        self.acceptance = NgramAcceptance(config, sampling)  # sampling: the request decodes at T > 0
        self.dspark: list[float] | None = None  # [γ] a_k of the latest DSpark draft (for the *next* choice)
        self.held: Choice | None = None  # the block the next verification takes (None: nobody drafted)

    def choose(self, match_n: int | None, proposal: Sequence[int], dspark_survival: Sequence[float]) -> Choice:
        """The block of this step (the module docstring's rule), then remember this step's DSpark survivals.

        Args:
            match_n: the lookup's match length (None: no suffix recurred).
            proposal: the lookup's ``x_1..x_m`` (empty without a match).
            dspark_survival: ``[γ]`` the current DSpark draft's calibrated ``a_k``: *not* read by this choice (the
                losslessness rule), kept as the next step's ``E_d``.
        """
        e_d = None if self.dspark is None else expected_length(self.dspark)
        choice = Choice(DSPARK, e_dspark=e_d)
        if match_n is not None and proposal:
            survival = self.acceptance.survival(match_n, len(proposal))
            e_ng = expected_length(survival)
            if e_d is not None and e_ng > e_d:
                choice = Choice(NGRAM, tuple(int(t) for t in proposal), tuple(survival), match_n, e_ng, e_d)
            else:
                choice = Choice(DSPARK, e_ngram=e_ng, e_dspark=e_d)
        self.dspark = [float(a) for a in dspark_survival]
        self.held = choice
        return choice

    def observe(self, verify_len: int, num_accepted: int) -> str:
        """Settle the held block after its verification (ℓ slots verified, ``num_accepted`` accepted): an n-gram block
        updates the counts. Returns the block's source, ``PLAIN`` when the step verified no block."""
        held, self.held = self.held, None
        if held is None:
            return PLAIN
        if held.source == NGRAM and verify_len > 0:
            self.acceptance.update(held.n, verify_len, num_accepted)
        return held.source


class HybridProposer:
    """The DSpark drafter and the n-gram lookup as one drafter kind; ``config.gamma`` is the block size of both.

    The reference loop (``reference/generate.py``) runs the drafter as usual, then :meth:`choose` and :meth:`merge`
    turn its block into the hybrid block; each request keeps its own :class:`HybridState`.
    """

    def __init__(self, drafter: DSparkDrafter, config: HybridConfig | None = None) -> None:
        gamma = drafter.config.block_size
        self.drafter = drafter
        self.config = config or HybridConfig(gamma=gamma)
        if self.config.gamma != gamma:
            raise ValueError(f"HybridConfig.gamma = {self.config.gamma} differs from the drafter's block size γ = "
                             f"{gamma}: both sources draft the same block")

    def new_state(self, sampling: bool = False) -> HybridState:
        """A request's state; ``sampling``: it decodes at T > 0 (the n-gram prior is ``prior_accept_sampling``)."""
        return HybridState(self.config, sampling)

    def lookup(self, context: Sequence[int]) -> tuple[int | None, list[int]]:
        """The lookup of ``reference/ngram.py``: ``(n, x_1..x_m)``, or ``(None, [])`` when no suffix recurred."""
        cfg = self.config
        match = find_match(context, cfg.max_n, cfg.min_n)
        if match is None:
            return None, []
        n, i = match
        return n, [int(t) for t in context[i + n:i + n + cfg.gamma]]

    def choose(self, states: list[HybridState], contexts: list[Sequence[int]], dspark_survival: Tensor) -> list[Choice]:
        """Every request's block (``dspark_survival`` ``[R, γ]``: the current DSpark draft's calibrated survivals)."""
        rows = dspark_survival.tolist()  # [R][γ] Python floats of the float32 values
        return [state.choose(*self.lookup(ctx), row) for state, ctx, row in zip(states, contexts, rows)]

    def merge(self, draft: DraftOutput, survival: Tensor, choices: list[Choice]) -> tuple[DraftOutput, Tensor, Tensor]:
        """The hybrid block: the drafter's rows, with the requests that chose the n-gram block replaced by it.

        Args:
            draft: the drafter's block (tokens ``[R, γ]``, p_d ``[R, γ, V]``).
            survival: ``[R, γ]`` float32, its calibrated survivals (host).
            choices: one per request.

        Returns:
            ``(block, survival, caps)``: n-gram rows hold ``x_1..x_m`` then 0, the one-hot ``p_d`` of those tokens and
            ``a^ng`` (float32); ``caps`` ``[R]`` int64 is each row's most verifiable slots (γ or m).
        """
        gamma = self.config.gamma
        tokens, probs, survival = draft.tokens.clone(), draft.probs.clone(), survival.clone()
        caps = torch.tensor([c.cap(gamma) for c in choices], dtype=torch.long)  # [R]
        for i, c in enumerate(choices):
            if c.source != NGRAM:
                continue
            row = torch.zeros(gamma, dtype=torch.long, device=tokens.device)  # [γ] slots past m hold 0 (never verified)
            row[:len(c.tokens)] = torch.tensor(c.tokens, dtype=torch.long)
            tokens[i] = row
            probs[i] = torch.nn.functional.one_hot(row, probs.shape[-1]).to(probs.dtype)  # [γ, V] p_d = δ_{x_k}
            survival[i] = torch.tensor(c.survival, dtype=torch.float32)
        return DraftOutput(tokens, probs, draft.conf_logits), survival, caps

    def __repr__(self) -> str:
        cfg = self.config
        return (f"HybridProposer(gamma={cfg.gamma}, max_n={cfg.max_n}, min_n={cfg.min_n}, "
                f"prior_accept={cfg.prior_accept}, prior_accept_sampling={cfg.prior_accept_sampling}, "
                f"prior_strength={cfg.prior_strength})")
