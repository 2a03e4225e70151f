"""The equivalence harness: ``reference.generate`` against the engine, token for token, with every difference explained.

The library behind ``scripts/gpu_equivalence.py`` (its module docstring describes a run) and its tests. For one
scheduler mode and temperature, :func:`run_config` decodes the same prompts with both loops (same target, drafter,
seed and cost table) and compares every request: emitted token ids, per-step accepted lengths and per-step verify
lengths (:func:`first_difference`). A request that differs is explained, never skipped: :class:`Replayer`
recomputes the first differing step in float32 with the reference target and drafter on the common prefix, and
each decision of that step that could have caused the difference gets a *margin* in natural-log units (a logit gap
is one): the top-1/top-2 gap of an argmax, the log-gap between the winner and the runner-up of an exponential race
``p(v) / E_v`` (sampled drafts, residual and bonus tokens), ``|log u·p_d(x) − log p_t(x)|`` of an accept test,
``|log a_j − log threshold|``, the log-gap between the last admitted and the first excluded survival of a top-B
allocation, or between two throughputs ``Θ(B)`` that a budget compared. The smallest relevant margin is the
request's ``gap``; below the tie threshold the difference is a floating-point ``near-tie``, otherwise a ``MISMATCH``
(:func:`explain`). In the batch-coupled modes a difference that follows a near-tie of another request is a near-tie
too (:func:`apply_coupling`).

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length,
``γ`` block size).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from optimized.engine import EngineConfig
from optimized.generate import generate as opt_generate
from optimized.graphs import GraphRunner
from reference.calibration import calibrated_survival
from reference.config import SCHEDULER_MODES, GenerationConfig, SchedulerConfig, SchedulingMode
from reference.cost_model import CostTable
from reference.drafter import DSparkDrafter
from reference.generate import GenerationResult
from reference.generate import generate as ref_generate
from reference.sampling import Purpose, draft_purpose, hash_uniform, logits_to_probs, sample
from reference.scheduler import Scheduler, fill_stale_rows, rank_candidates, throughput_curve
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from reference.verify import rejection_sample

log = logging.getLogger("dspark.equivalence")

STATUSES = ("identical", "near-tie", "MISMATCH")
# The cost table of tests/equivalence/test_end_to_end.py: a step costs a fixed 5 ms plus 0.3 ms per verified token.
COST_FIXED_MS, COST_PER_TOKEN_MS = 5.0, 0.3
# Tie thresholds, in logit units. float32: a logit (|l| ≲ 40) computed with another summation order (cuBLAS vs
# Triton tiles, a batched vs an unbatched forward) moves by ~1e-5 (2⁻²³ relative per rounding, growing ~√d over a
# d = 576 reduction and 30 layers); 1e-3 leaves two orders of magnitude. bfloat16 keeps 8 significant bits: SmolLM2's
# top logits lie in [16, 32) (median 24 on a sample prompt), where bf16 values are 2⁻³ = 0.125 apart, so two runs that
# round differently cannot resolve gaps below that; 0.25 is two such steps (a CPU bf16 run of SmolLM2, 3 prompts ×
# 3 modes × 2 temperatures × 32 tokens, measured differences up to 0.19).
TIE_THRESHOLD = {"float32": 1e-3, "bfloat16": 0.25}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The tiny run reproduces the CPU end-to-end test (tests/equivalence/test_end_to_end.py): its prompts, γ = 4, the
# drafter noise that makes confidences vary, and the threshold / DSD table that give its random drafter varied lengths.
TINY_PROMPTS = [[5, 9, 3, 17], [2, 40, 41, 42, 43, 7, 8], [60]]
TINY_GAMMA = 4
TINY_THRESHOLD = 0.05
TINY_DSD_TABLE = {1: 4, 2: 2, 3: 1}
TINY_MAX_NEW_TOKENS = 14
_TINY_PROB = 1e-30  # floor before a log: survivals and throughputs may be exactly 0

Margin = tuple[float, str]  # (margin in log units, the decision it belongs to)


# ----------------------------------------------------------------------------------------------------------
# What is compared: the steps of one request
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One verify step of one request, as recorded in a :class:`GenerationResult`."""

    verify: int  # ℓ
    accepted: int  # drafts accepted (τ - 1)
    tokens: list[int]  # the emitted tokens (τ of them, fewer in the last step if the request finished inside it)
    start: int  # index of the step's first token in ``token_ids`` (index 0 is the prefill token)


def steps_of(result: GenerationResult) -> list[Step]:
    """Split a result's tokens into its verify steps (the first token comes from the prefill, not a step)."""
    steps, start = [], 1
    for ell, n in zip(result.verify_lengths, result.accepted_lengths):
        steps.append(Step(ell, n, result.token_ids[start:start + n + 1], start))
        start += n + 1
    return steps


@dataclass
class Divergence:
    """Where two runs of one request first differ."""

    step: int | None  # the first differing verify step; None when the prefill token differs
    cause: str  # "prefill" | "verify_length" | "accepted_length" | "token" | "steps" | "finish"
    offset: int | None  # cause "token": index of the first differing token inside the step
    token_index: int | None  # first differing index of the token ids (None if the token ids are equal)


def first_difference(ref: GenerationResult, opt: GenerationResult) -> Divergence | None:
    """The first step where ``opt`` departs from ``ref`` and what differs there; None if they are identical.

    Within a step the verify length is decided first, then the accepted count, then the tokens, so the cause is
    the earliest of the three that differs.
    """
    a, b = ref.token_ids, opt.token_ids
    token_index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if token_index is None and len(a) != len(b):
        token_index = min(len(a), len(b))
    if a[:1] != b[:1]:
        return Divergence(None, "prefill", 0, token_index)
    sa, sb = steps_of(ref), steps_of(opt)
    for s, (x, y) in enumerate(zip(sa, sb)):
        if x.verify != y.verify:
            return Divergence(s, "verify_length", None, token_index)
        if x.accepted != y.accepted:
            return Divergence(s, "accepted_length", None, token_index)
        if x.tokens != y.tokens:
            offset = next((i for i, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
                          min(len(x.tokens), len(y.tokens)))
            return Divergence(s, "token", offset, token_index)
    if len(sa) != len(sb) or token_index is not None:
        return Divergence(min(len(sa), len(sb)), "steps", None, token_index)
    if ref.finish_reason != opt.finish_reason:
        return Divergence(len(sa), "finish", None, token_index)
    return None


# ----------------------------------------------------------------------------------------------------------
# Margins of single decisions, in log units
# ----------------------------------------------------------------------------------------------------------


def top2_gap(logits: Tensor) -> float:
    """Top-1 minus top-2 of ``logits`` [V]: how far an argmax is from flipping."""
    top = logits.double().topk(2).values
    return float(top[0] - top[1])


def argmax_margin(logits: Tensor, token: int) -> float:
    """Distance of the greedy test "``token`` is the argmax of ``logits`` [V]" from flipping either way."""
    x = logits.double()
    best = int(x.argmax())
    if best == token:
        return top2_gap(x)
    return float(x[best] - x[token])


def pair_gap(logits: Tensor, x: int, y: int) -> float:
    """``|l(x) − l(y)|`` of ``logits`` [V]: how far an argmax that chose one of x, y is from choosing the other."""
    return abs(float(logits[x].double() - logits[y].double()))


def race_margin(weights: Tensor, seed: int, request_id: int, position: int, purpose: int,
                pair: tuple[int, int] | None = None) -> float:
    """Log-gap of the race ``argmax_v w(v) / E_v`` (``reference.sampling.sample``): winner vs runner-up, or between
    the two tokens of ``pair`` (the tokens two runs drew).

    ``weights`` [V] are the (unnormalised) probabilities the draw used; ``E_v = -log u_v`` with ``u_v`` the uniform of
    ``(seed, request_id, position, purpose, lane = v)``. Infinite when the decision cannot flip: fewer than two
    tokens can win, or a token of ``pair`` has zero weight.
    """
    w = weights.double()
    if int((w > 0).sum()) < 2:
        return math.inf
    lanes = torch.arange(w.shape[0], device=w.device)
    u = hash_uniform(seed, request_id, position, int(purpose), lanes).double()  # [V]
    score = torch.log(w) - torch.log(-torch.log(u))  # [V] log(w / E); -inf where w = 0
    if pair is not None:
        gap = float(score[pair[0]] - score[pair[1]])
        return abs(gap) if math.isfinite(gap) else math.inf
    top = score.topk(2).values
    return float(top[0] - top[1])


def accept_margin(u: float, pd_x: float, pt_x: float) -> float:
    """``|log(u·p_d(x)) − log p_t(x)|``: how far the accept test ``u·p_d(x) ≤ p_t(x)`` is from flipping."""
    if pt_x <= 0 or pd_x <= 0:
        return math.inf  # certain rejection (p_t = 0) or a draft that could not have been drawn
    return abs(math.log(u) + math.log(pd_x) - math.log(pt_x))


def log_gap(x: float, y: float) -> float:
    """``|log x − log y|`` for non-negative x, y (survivals, throughputs)."""
    return abs(math.log(max(float(x), _TINY_PROB)) - math.log(max(float(y), _TINY_PROB)))


# ----------------------------------------------------------------------------------------------------------
# Recomputing one step in float32
# ----------------------------------------------------------------------------------------------------------


@dataclass
class StepReplay:
    """One request's step recomputed on the common prefix: the drafts and every probability a decision read."""

    position: int  # P, absolute position of the anchor x_0
    drafts: list[int]  # x_1..x_γ ([] in mode none)
    draft_logits: Tensor | None  # [γ, V] float32, U + B before temperature
    draft_probs: Tensor | None  # [γ, V] float32, the p_d each draft was drawn from
    survival: Tensor | None  # [γ] float64 calibrated prefix survivals a_j
    target_logits: Tensor  # [γ+1, V] float32; row i is for position P + i + 1
    target_probs: Tensor  # [γ+1, V] float32 p_t at the run's temperature and filters


class Replayer:
    """Recomputes steps of one configuration's reference run with float32 models and measures decision margins.

    Every replay starts from the reference run's own tokens (the common prefix, up to the first divergence), runs
    the target over the prefix in one forward, fills a fresh drafter context, drafts with the run's seed and
    request id, and runs the target over ``[x_0, x_1..x_γ]``.
    """

    def __init__(self, target: Target, drafter: DSparkDrafter | None, prompts: list[list[int]],
                 gen: GenerationConfig, sched: SchedulerConfig, cost: CostTable,
                 ref: list[GenerationResult], opt: list[GenerationResult]) -> None:
        self.target = target
        self.drafter = drafter if sched.mode.drafts else None
        self.gamma = self.drafter.config.block_size if self.drafter is not None else 0
        self.prompts, self.gen, self.sched, self.cost = prompts, gen, sched, cost
        self.ref, self.opt = ref, opt
        self.ref_steps = [steps_of(r) for r in ref]
        self.opt_steps = [steps_of(r) for r in opt]
        self._cache: dict[tuple[int, int], StepReplay] = {}

    @property
    def greedy(self) -> bool:
        return self.gen.temperature == 0

    # --- recomputation -----------------------------------------------------------------------------------

    def prefix(self, rid: int, step: int) -> list[int]:
        """Prompt + emitted tokens up to and including the anchor of ``step`` (the reference run's tokens)."""
        return self.prompts[rid] + self.ref[rid].token_ids[:self.ref_steps[rid][step].start]

    def _probs(self, logits: Tensor) -> Tensor:
        """p_t rows [N, V] of logits [N, V] at the run's temperature, top-p and top-k."""
        return logits_to_probs(logits[None], self.gen.temperature, self.gen.top_p, self.gen.top_k)[0]

    @torch.inference_mode()
    def next_logits(self, ids: list[int]) -> Tensor:
        """The target's logits [V] for the token after ``ids`` (one forward, float32)."""
        x = torch.tensor(ids, dtype=torch.long, device=self.target.device)
        logits, _ = self.target.forward(x, self.target.new_cache(), start_pos=0)  # [N, V]
        return logits[-1]

    @torch.inference_mode()
    def replay(self, rid: int, step: int) -> StepReplay:
        """The step recomputed on the common prefix (cached)."""
        key = (rid, step)
        if key in self._cache:
            return self._cache[key]
        prefix = self.prefix(rid, step)
        dev, gen = self.target.device, self.gen
        pos = len(prefix) - 1  # P; the context is positions 0..P-1
        ids = torch.tensor(prefix, dtype=torch.long, device=dev)  # [P+1]
        kv = self.target.new_cache()
        _, features = self.target.forward(ids[:pos], kv, start_pos=0)  # [P, m·d]
        drafts: list[int] = []
        draft_logits = draft_probs = survival = None
        if self.drafter is not None:
            ctx = self.drafter.new_context_cache()
            ctx.append(features, torch.arange(pos, device=dev))
            h = self.drafter.backbone_cached(prefix[-1], pos, ctx)  # [γ, d]

            def one(x, dtype=torch.long):
                return torch.tensor([x], dtype=dtype, device=dev)  # [1]

            out = self.drafter.sample_block(h[None], one(prefix[-1]), one(pos), one(gen.temperature, torch.float32),
                                            gen.seed, one(rid))
            prev = torch.cat([one(prefix[-1]), out.tokens[0, :-1]])  # [γ] x_0..x_{γ-1}
            draft_logits = self.drafter.head_logits(h[None], prev[None])[0][0]  # [γ, V]
            draft_probs = out.probs[0]  # [γ, V]
            survival = calibrated_survival(self.drafter.config, gen.decode_mode,
                                           out.conf_logits.float().cpu())[0].double()  # [γ]
            drafts = out.tokens[0].tolist()
        block = torch.tensor([prefix[-1], *drafts], dtype=torch.long, device=dev)  # [γ+1]
        logits, _ = self.target.forward(block, kv, start_pos=pos)  # [γ+1, V]
        replay = StepReplay(pos, drafts, draft_logits, draft_probs, survival, logits, self._probs(logits))
        self._cache[key] = replay
        return replay

    def active(self, results: list[GenerationResult], step: int) -> list[int]:
        """Requests that ran ``step`` (every request takes part in every step until it finishes)."""
        return [r for r, res in enumerate(results) if len(res.accepted_lengths) > step]

    def batch_survivals(self, step: int) -> tuple[list[int], Tensor]:
        """The requests of ``step`` and their replayed survivals ``a`` [R, γ] (the allocation's input)."""
        rids = self.active(self.ref, step)
        return rids, torch.stack([self.replay(r, step).survival for r in rids])

    def stale_survivals(self, rids: list[int], step: int) -> Tensor:
        """``a_stale`` [R, γ] of the adaptive budget: survivals ``staleness`` steps earlier, NaN rows before that."""
        k = self.sched.staleness
        rows = [self.replay(r, step - k).survival if step >= k else torch.full((self.gamma,), math.nan,
                                                                             dtype=torch.float64) for r in rids]
        return torch.stack(rows)

    # --- the reference's decisions, replayed -------------------------------------------------------------

    def scheduled_length(self, rid: int, step: int) -> int | None:
        """ℓ of ``rid`` at ``step`` by the scheduler on the replayed survivals; None in mode oracle (chosen after)."""
        mode = self.sched.mode
        if mode is SchedulingMode.ORACLE:
            return None
        if not mode.drafts:
            return 0
        scheduler = Scheduler(self.sched, gamma=self.gamma, cost=self.cost)
        if mode is SchedulingMode.THRESHOLD:
            return int(scheduler.lengths(self.replay(rid, step).survival[None])[0])
        if mode.needs_cost_table:
            rids, a = self.batch_survivals(step)
            stale = self.stale_survivals(rids, step) if mode is SchedulingMode.ADAPTIVE else None
            lens = scheduler.lengths(a, a_stale=stale, num_anchor_tokens=len(rids))
            return int(lens[rids.index(rid)])
        return scheduler.uniform_length(len(self.active(self.ref, step)))  # fixed, dsd: only the batch size matters

    def verify(self, rid: int, step: int, ell: int) -> tuple[list[int], int]:
        """Emitted tokens and accepted count of the replayed step when ``ell`` drafts are verified."""
        rep, dev = self.replay(rid, step), self.target.device
        ids, anchor = torch.tensor([rid], device=dev), torch.tensor([rep.position], device=dev)
        if not rep.drafts:  # mode none: the bonus token of row 0
            tok = sample(rep.target_probs[:1], self.gen.seed, ids, anchor + 1, int(Purpose.BONUS))
            return [int(tok[0])], 0
        res = rejection_sample(torch.tensor([rep.drafts], device=dev), torch.tensor([ell], device=dev),
                               rep.draft_probs[None], rep.target_probs[None], self.gen.seed, ids, anchor)
        n = int(res.num_accepted[0])
        return res.tokens[0, :n + 1].tolist(), n

    def check(self, rid: int, step: int | None) -> bool:
        """Does the replay reproduce the reference run at ``step`` (None: the prefill token)? If it does not, the
        reference itself sat on a near-tie there, and the margins are still those of the float32 recomputation."""
        if step is None:
            probs = self._probs(self.next_logits(self.prompts[rid])[None])
            dev = probs.device
            tok = sample(probs, self.gen.seed, torch.tensor([rid], device=dev),
                         torch.tensor([len(self.prompts[rid])], device=dev), int(Purpose.BONUS))
            return int(tok[0]) == self.ref[rid].token_ids[0]
        want = self.ref_steps[rid][step]
        ell = self.scheduled_length(rid, step)
        if ell is not None and ell != want.verify:
            return False
        oracle = self.sched.mode is SchedulingMode.ORACLE
        tokens, n = self.verify(rid, step, self.gamma if oracle else want.verify)
        if oracle and want.verify != min(n + 1, self.gamma):
            return False
        return n == want.accepted and tokens[:len(want.tokens)] == want.tokens

    # --- margins -----------------------------------------------------------------------------------------

    def margins(self, rid: int, div: Divergence) -> list[Margin]:
        """Margins of the decisions of the first differing step that can produce ``div``'s kind of difference."""
        gen = self.gen
        if div.cause == "prefill":
            prompt = self.prompts[rid]
            logits = self.next_logits(prompt)
            if self.greedy:
                return [(top2_gap(logits), "target argmax (prefill token)")]
            return [(race_margin(self._probs(logits[None])[0], gen.seed, rid, len(prompt), Purpose.BONUS),
                     "target race (prefill token, bonus)")]
        if div.cause in ("steps", "finish"):
            return []  # equal steps cannot end differently: no floating-point decision explains it
        s, g = div.step, self.gamma
        a, b = self.ref_steps[rid][s], self.opt_steps[rid][s]
        cause, oracle = div.cause, self.sched.mode is SchedulingMode.ORACLE
        if oracle and cause == "verify_length":
            cause = "accepted_length"  # the oracle verifies all γ and records ℓ from the outcome
        ell_max = g if oracle else max(a.verify, b.verify)
        out: list[Margin] = []
        if cause == "verify_length":
            if self.sched.mode.reads_survivals:  # a_j reads x_{j-1}: drafts 1..γ-1 shape the survivals
                out += self._draft_margins(rid, s, range(1, g))
            out += self._schedule_margins(rid, s)  # none in modes none, fixed, dsd: ℓ there never reads a float
        elif cause == "accepted_length":
            out += self._draft_margins(rid, s, range(1, ell_max + 1))
            out += self._accept_margins(rid, s, ell_max)
        else:  # "token": same ℓ and accepted count, a different token; the margin between the two tokens drawn
            d = div.offset
            pair = (a.tokens[d], b.tokens[d]) if d < min(len(a.tokens), len(b.tokens)) else None
            if d < a.accepted:  # an accepted draft differs: its draw
                out += self._draft_margins(rid, s, [d + 1], pair)
            else:  # the recovered / bonus token differs
                ell = g if oracle else a.verify
                out.append(self._final_margin(rid, s, a.accepted, ell, pair))
        return out

    def _draft_margins(self, rid: int, step: int, slots, pair: tuple[int, int] | None = None) -> list[Margin]:
        """The draws of draft slots ``slots``: any flip, or (``pair``) a flip between the two drafts the runs drew."""
        rep = self.replay(rid, step)
        out = []
        for k in slots:
            if self.greedy:
                logits = rep.draft_logits[k - 1]
                gap = top2_gap(logits) if pair is None else pair_gap(logits, *pair)
                out.append((gap, f"draft argmax (slot {k})"))
            else:
                out.append((race_margin(rep.draft_probs[k - 1], self.gen.seed, rid, rep.position + k,
                                        draft_purpose(k), pair), f"draft race (slot {k})"))
        return out

    def _accept_margins(self, rid: int, step: int, ell: int) -> list[Margin]:
        rep = self.replay(rid, step)
        out = []
        for k in range(1, ell + 1):
            x = rep.drafts[k - 1]
            if self.greedy:
                out.append((argmax_margin(rep.target_logits[k - 1], x), f"accept test (slot {k}, argmax)"))
            else:
                u = float(hash_uniform(self.gen.seed, rid, rep.position + k, int(Purpose.ACCEPT), 0))
                out.append((accept_margin(u, float(rep.draft_probs[k - 1, x]), float(rep.target_probs[k - 1, x])),
                            f"accept test (slot {k})"))
        return out

    def _final_margin(self, rid: int, step: int, n: int, ell: int, pair: tuple[int, int] | None) -> Margin:
        """The token drawn after ``n`` accepted drafts out of ``ell``: recovered (n < ℓ) or bonus (n = ℓ)."""
        rep = self.replay(rid, step)
        if self.greedy:
            row = rep.target_logits[n]
            return (top2_gap(row) if pair is None else pair_gap(row, *pair)), f"target argmax (row {n})"
        p_t = rep.target_probs[n]
        if n < ell:
            dist = (p_t - rep.draft_probs[n]).clamp(min=0)
            dist = dist if float(dist.sum()) > 0 else p_t  # the verifier's rounding fallback
            purpose, what = Purpose.RESIDUAL, "residual"
        else:
            dist, purpose, what = p_t, Purpose.BONUS, "bonus"
        return (race_margin(dist, self.gen.seed, rid, rep.position + n + 1, purpose, pair),
                f"target race ({what}, slot {n + 1})")

    def _schedule_margins(self, rid: int, step: int) -> list[Margin]:
        """Margins of the verify-length decision: only the survival-driven policies have any."""
        mode = self.sched.mode
        if mode is SchedulingMode.THRESHOLD:
            if self.sched.threshold <= 0:
                return []  # every slot passes whatever its survival
            a = self.replay(rid, step).survival
            return [(log_gap(a[j], self.sched.threshold), f"threshold (slot {j + 1})") for j in range(self.gamma)]
        if not mode.needs_cost_table:
            return []  # none, fixed, dsd: ℓ depends on the batch size only, never on a float
        rids, a = self.batch_survivals(step)
        r = len(rids)
        out: list[Margin] = []
        # The allocation reads every request's survivals, which depend on every request's drafts.
        for other in (q for q in rids if q != rid):
            drafts = self._draft_margins(other, step, range(1, self.gamma))
            out += [(m, f"{what}, request {other}") for m, what in drafts]
        rows, slots = rank_candidates(a)
        gains = a[rows, slots].tolist()  # [R·γ] survivals in rank order
        opt_rids = self.active(self.opt, step)
        budgets = {sum(self.ref_steps[q][step].verify for q in rids),
                   sum(self.opt_steps[q][step].verify for q in opt_rids)}
        for budget in sorted(budgets):
            if 0 < budget < len(gains):
                out.append((log_gap(gains[budget - 1], gains[budget]), f"top-B boundary (B = {budget})"))
        if mode is SchedulingMode.ADAPTIVE_SYNC:  # Algorithm 1 compares Θ(B+1) with Θ(B) to the first non-improvement
            theta = throughput_curve(a, self.cost, r, None)
            for b in range(min(max(budgets) + 1, len(theta) - 1)):
                out.append((log_gap(theta[b + 1], theta[b]), f"Θ({b + 1}) vs Θ({b})"))
        else:  # the stale budget is the argmax of Θ over the stale survivals, which the drafts of that step shaped
            k = self.sched.staleness
            for other in rids if step >= k else []:
                drafts = self._draft_margins(other, step - k, range(1, self.gamma))
                out += [(m, f"{what}, request {other}, step {step - k}") for m, what in drafts]
            theta = throughput_curve(fill_stale_rows(self.stale_survivals(rids, step)), self.cost, r, None)
            best = max(range(len(theta)), key=lambda b: (theta[b], -b))
            others = [t for b, t in enumerate(theta) if b != best]
            if others:
                out.append((log_gap(theta[best], max(others)), f"stale budget Θ({best}) vs runner-up"))
        return out


# ----------------------------------------------------------------------------------------------------------
# Classification
# ----------------------------------------------------------------------------------------------------------


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def explain(replayer: Replayer, rid: int, div: Divergence, threshold: float) -> dict[str, Any]:
    """The analysis fields of one differing request (see the module docstring) and its status."""
    ref, opt = replayer.ref[rid], replayer.opt[rid]
    fields: dict[str, Any] = {"first_step": div.step, "cause": div.cause, "first_divergence": div.token_index}
    margins = replayer.margins(rid, div)
    finite = sorted((m for m in margins if math.isfinite(m[0])), key=lambda m: m[0])
    gap, source = finite[0] if finite else (math.inf, "no floating-point decision can explain it")
    if div.token_index is not None:
        i = div.token_index
        a = ref.token_ids[i] if i < len(ref.token_ids) else None
        b = opt.token_ids[i] if i < len(opt.token_ids) else None
        logits = replayer.next_logits(replayer.prompts[rid] + ref.token_ids[:i])
        logit_gap = abs(float(logits[a]) - float(logits[b])) if a is not None and b is not None else None
        fields.update(chosen_ref=a, chosen_opt=b, logit_gap=logit_gap, top2_gap=top2_gap(logits))
        if replayer.greedy and logit_gap is not None and logit_gap > gap:
            # At T = 0 the tokens are the target's argmax path whatever the drafts and lengths: a token difference
            # needs its own near-tie of the target, whatever explained the first differing step.
            gap, source = logit_gap, f"target logits at token {i} (the step's own margin: {source})"
    else:
        fields.update(chosen_ref=None, chosen_opt=None, logit_gap=None, top2_gap=None)
    if not replayer.greedy and div.token_index is not None:
        fields["note"] = ("T > 0: tokens are exponential-race draws and accept tests; logit_gap is information, "
                          "the decision margin is gap")
    fields["replay_agrees"] = replayer.check(rid, div.step) if div.cause not in ("steps", "finish") else None
    fields.update(gap=_finite(gap), gap_source=source,
                  margins=[{"gap": m, "decision": what} for m, what in finite[:5]],
                  status="near-tie" if gap < threshold else "MISMATCH")
    return fields


def apply_coupling(rows: list[dict[str, Any]], mode: SchedulingMode | str) -> None:
    """In the batch-coupled modes, explain a request's difference by a near-tie of another request before it.

    Any difference of another request at an earlier step changes the batch that later steps schedule (``dsd``: its
    size, once a request finishes; the adaptive policies: the survivals and stale survivals they allocate from). At
    the same step only a different allocation is shared: another request's verify length (cause
    ``verify_length``) in the adaptive policies. Rows are updated in place (``status``, ``explained_by``); explained
    rows can explain later ones.
    """
    mode = SchedulingMode(mode)
    if not mode.batch_coupled:
        return

    def step_of(row):
        return -1 if row["first_step"] is None else row["first_step"]  # the prefill precedes step 0

    roots = [r for r in rows if r["status"] == "near-tie"]
    for row in sorted((r for r in rows if r["status"] == "MISMATCH" and not r.get("analysis_error")), key=step_of):
        for root in roots:
            same_allocation = mode is not SchedulingMode.DSD and root["cause"] == "verify_length" == row["cause"]
            if step_of(root) < step_of(row) or (step_of(root) == step_of(row) and same_allocation):
                row["status"] = "near-tie"
                row["explained_by"] = {"prompt_index": root["prompt_index"], "first_step": root["first_step"]}
                roots.append(row)
                break


# ----------------------------------------------------------------------------------------------------------
# Running one configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeSpec:
    label: str  # "fixed:3", "adaptive", …
    mode: str
    k: int | None  # mode fixed only


def parse_modes(text: str, gamma: int) -> list[ModeSpec]:
    """``"none,fixed:3,fixed,…"``; ``fixed`` alone verifies the whole block (K = γ)."""
    specs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, k = item.partition(":")
        if name not in SCHEDULER_MODES:
            raise SystemExit(f"unknown mode {name!r}; choose from {', '.join(SCHEDULER_MODES)}")
        if name == "fixed":
            kk = gamma if not k else int(k)
            if not 0 <= kk <= gamma:
                raise SystemExit(f"fixed:{kk} outside 0..γ = 0..{gamma}")
            specs.append(ModeSpec(f"fixed:{kk}", name, kk))
        elif k:
            raise SystemExit(f"{item!r}: only mode fixed takes :K")
        else:
            specs.append(ModeSpec(name, name, None))
    if not specs:
        raise SystemExit("--modes is empty")
    return specs


@contextlib.contextmanager
def count_graph_runs():
    """Count, per graph runner ("verify", "prefill", "draft"), the runs replayed from a captured CUDA graph and the
    eager ones."""
    counts: dict[str, dict[str, int]] = {}
    original = GraphRunner.run

    def counting_run(runner: GraphRunner, n_pad: int):
        per = counts.setdefault(runner.name, {"graph": 0, "eager": 0})
        per["graph" if n_pad in runner.graphs else "eager"] += 1
        return original(runner, n_pad)

    GraphRunner.run = counting_run
    try:
        yield counts
    finally:
        GraphRunner.run = original


def full_precision(target: Target, drafter: DSparkDrafter) -> tuple[Target, DSparkDrafter]:
    """float32 copies of the models for the margins (the same objects when the run is float32 already)."""
    if target.dtype == torch.float32:
        return target, drafter
    model = copy.deepcopy(target.model).float()
    target32 = Target.from_model(model, target.tokenizer, layer_ids=target.layer_ids, name=target.name)
    drafter32 = copy.deepcopy(drafter).float()
    drafter32.attach_target(target32.embed_tokens, target32.lm_head)
    return target32, drafter32


@dataclass(frozen=True)
class RunSettings:
    """What every configuration of one comparison shares (the command line fills it)."""

    max_new_tokens: int
    top_p: float = 1.0  # nucleus filter of the target at T > 0
    seed: int = 0  # generation seed (random-number contract)
    stop_at_eos: bool = False  # False: every request decodes max_new_tokens, so the whole length is compared
    threshold: float = 0.5  # mode threshold
    dsd_table: dict[int, int] = field(default_factory=lambda: dict(TINY_DSD_TABLE))  # mode dsd
    enforce_eager: bool = False  # engine without CUDA graphs
    kernel_backend: str = "auto"  # engine ops: Triton on CUDA (or under TRITON_INTERPRET=1), else torch
    batch_invariant: bool = False  # engine target on its row-invariant kernels (EngineConfig.batch_invariant)


def run_config(target: Target, drafter: DSparkDrafter, prompts: list[tuple[str, list[int]]], spec: ModeSpec,
               temperature: float, settings: RunSettings, cost: CostTable, tie_threshold: float,
               replay_models) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Both loops on one (mode, temperature); one row per request, plus the configuration's timings.

    ``replay_models()`` returns the float32 target and drafter the divergence analysis recomputes with.
    """
    gamma = drafter.config.block_size
    ids = [p for _, p in prompts]
    gen = GenerationConfig(max_new_tokens=settings.max_new_tokens, temperature=temperature, top_p=settings.top_p,
                           seed=settings.seed, ignore_eos=not settings.stop_at_eos)
    sched = SchedulerConfig(mode=spec.mode, k=spec.k if spec.k is not None else gamma, threshold=settings.threshold,
                            dsd_table=settings.dsd_table)
    t0 = time.perf_counter()
    ref = ref_generate(target, drafter, ids, gen, sched, cost)
    t_ref = time.perf_counter() - t0
    longest = max(len(p) for p in ids)
    # One prefill step for the whole batch keeps the engine in lockstep with the reference (module docstring), and so
    # do steps read one by one with the table's prices as they are: an engine one step ahead plans the adaptive budget
    # from survivals one draft older where requests finish, and cost feedback prices steps at measured times.
    cfg = EngineConfig(max_num_seqs=len(ids), max_seq_len=longest + settings.max_new_tokens + 2 * gamma + 8,
                       prefill_chunk=max(8192, sum(len(p) for p in ids)), enforce_eager=settings.enforce_eager,
                       kernel_backend=settings.kernel_backend, seed=settings.seed, device=str(target.device),
                       dtype=target.dtype, async_decode=False, cost_feedback=False,
                       batch_invariant=settings.batch_invariant)
    t0 = time.perf_counter()
    with count_graph_runs() as graph_runs:
        opt = opt_generate(target, drafter, ids, gen, sched, cost, engine_config=cfg)
    if target.device.type == "cuda":
        torch.cuda.synchronize()  # sync: end of the timed engine run
    t_opt = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    replayer = None
    for rid, ((domain, _), a, b) in enumerate(zip(prompts, ref, opt)):
        row: dict[str, Any] = {
            "mode": spec.mode, "label": spec.label, "k": spec.k, "temperature": temperature, "prompt_index": rid,
            "domain": domain, "status": "identical", "n_tokens": len(a.token_ids), "steps": len(a.accepted_lengths),
            "mean_accepted_length": round(a.mean_accepted_length, 4), "first_divergence": None, "first_step": None,
            "cause": None, "chosen_ref": None, "chosen_opt": None, "logit_gap": None, "top2_gap": None,
            "gap": None, "gap_source": None,
        }
        div = first_difference(a, b)
        if div is not None:
            row.update(n_tokens_opt=len(b.token_ids), first_step=div.step, cause=div.cause,
                       first_divergence=div.token_index, status="MISMATCH")
            try:
                if replayer is None:
                    replayer = Replayer(*replay_models(), ids, gen, sched, cost, ref, opt)
                row.update(explain(replayer, rid, div, tie_threshold))
            except Exception as e:  # an analysis that fails leaves the difference unexplained, never skipped
                log.exception("analysis of %s T=%g prompt %d failed", spec.label, temperature, rid)
                row["analysis_error"] = repr(e)
        rows.append(row)
    apply_coupling(rows, spec.mode)

    steps = sum(len(r.accepted_lengths) for r in ref)
    emitted = sum(n + 1 for r in ref for n in r.accepted_lengths)
    info = {"label": spec.label, "mode": spec.mode, "k": spec.k, "temperature": temperature,
            "counts": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
            "mean_accepted_length": round(emitted / steps, 4) if steps else None,
            "reference_s": round(t_ref, 3), "optimized_s": round(t_opt, 3), "graph_runs": graph_runs}
    return rows, info


# ----------------------------------------------------------------------------------------------------------
# Models and the summary
# ----------------------------------------------------------------------------------------------------------


def load_tiny(family: str, device: torch.device, dtype: torch.dtype):
    """The CPU equivalence suite's tiny random target and drafter, moved to ``device`` (they are built on the CPU)."""
    model = tiny_hf_model(family)
    name = f"tiny-{family}"
    drafter = tiny_drafter(Target.from_model(model, name=name), gamma=TINY_GAMMA, seed=0, noise=0.2)
    model.to(device=device, dtype=dtype)  # in place: the drafter's attached embedding and head move with it
    drafter.to(device=device, dtype=dtype)
    target = Target.from_model(model, name=name)  # re-wrapped: Target records its device and dtype at creation
    drafter.attach_target(target.embed_tokens, target.lm_head)
    return target, drafter, [("tiny", list(p)) for p in TINY_PROMPTS], name, "tiny random (reference.testing)"


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    per_mode: dict[str, Counter] = {}
    for r in rows:
        per_mode.setdefault(f"{r['label']} T={r['temperature']:g}", Counter())[r["status"]] += 1
    return {"counts": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
            "per_mode": {k: {s: c.get(s, 0) for s in STATUSES} for k, c in per_mode.items()}}
