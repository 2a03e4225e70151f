"""The prefix scheduler: how many drafts each request verifies this step (docs/method.md §5).

Survivals in, verify lengths out. Request ``r`` drafted ``x_{r,1..γ}`` with calibrated prefix survivals
``a_{r,j} = Π_{i≤j} c_{r,i}``, the probability that drafts 1..j are all accepted. Verifying ``ℓ_r`` of them
puts ``n = T_0 + Σ_r ℓ_r`` tokens in the target's forward (``T_0``: one anchor per decoding request plus any
prefill tokens) and emits, in expectation, ``τ = R_s + Σ_r Σ_{j≤ℓ_r} a_{r,j}`` tokens (``R_s``: requests that
sample a token this step). The scheduler maximises ``Θ = τ · SPS(n)``.

**Why a global top-B is optimal.** For a fixed total ``B = Σ ℓ_r`` the step cost is fixed, so the best
allocation maximises the sum of the chosen survivals: the ``B`` largest. Because ``a_{r,j}`` is
non-increasing in ``j`` and ties rank the smaller slot first, the ``B`` largest form a prefix of every
request's block. The whole problem is therefore one number, the budget ``B``.

**Ranking.** Every global order in this module sorts candidates ``(r, j)`` by survival descending, then slot
``j`` ascending, then request ``r`` ascending. The tie-break never looks at values, so two implementations
(this one and ``optimized/``) that see equal survivals still agree on the allocation.

**Losslessness.** Rejection sampling stays exact only if the decision to verify slot ``k`` uses nothing
that was sampled at or after ``x_k`` (docs/method.md §5: whether slot ``k`` is verified may depend only on information
available before ``x_k`` was sampled). ``a_{r,k+1}`` depends on ``x_{r,k}`` (the confidence head reads the
previous token), so a rule that looks at ``a_{r,k+1}`` to decide slot ``k`` would favour drafts *because*
their continuation looks good, and the output would drift from ``p_t`` (docs/method.md Appendix A: (0.7, 0.3)
becomes (0.85, 0.15)). The policies:

* :func:`algorithm1` (paper, synchronous, ``adaptive-sync``): admit candidates in rank order while ``Θ``
  improves, stop at the first non-improvement. Whether ``(r, k)`` is admitted depends only on the
  candidates ranked at or before it, whose survivals do not depend on ``x_{r,k}``. Lossless, but on a
  jagged (staircase) cost curve the early stop can miss a better budget past a step.
* :func:`best_budget` is the unconstrained argmax of ``Θ(B)`` over ``B = 0..R·γ``. It sees every survival,
  so applied to the *current* survivals it is anticipating (not lossless). It is safe only on stale ones.
* The asynchronous production variant (``adaptive``), :meth:`Scheduler.lengths`, is described there.
* The draft gate (``adaptive``, beyond the paper), :meth:`Scheduler.should_draft` (:func:`draft_forced`, then
  :func:`speculation_pays`): whether this step drafts at all, decided before any of its drafts exists, from the
  survivals of earlier drafts. A step that does not draft verifies ``ℓ = 0`` (ordinary decoding), so the gate
  cannot bias the output either.

Names follow ``docs/method.md``: ``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size, ``p_t``
target and ``p_d`` draft distributions, ``SPS`` steps per second, ``Θ`` emitted tokens per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from reference.config import SchedulerConfig, SchedulingMode
from reference.cost_model import CostTable

MONOTONE_TOL = 1e-6  # slack for survivals that were not produced by a float cumprod (e.g. STS in another dtype)


# ---------------------------------------------------------------------------- survivals and ranking
def prefix_survival(conf: Tensor) -> Tensor:
    """Per-slot conditional confidences ``c`` -> prefix survivals ``a_{r,k} = Π_{i≤k} c_{r,i}``.

    Args:
        conf: ``[R, γ]`` confidences in [0, 1] (already calibrated by STS when they come from a drafter).

    Returns:
        ``[R, γ]`` prefix survivals, non-increasing along the slot axis.
    """
    if conf.dim() != 2:
        raise ValueError(f"conf must be [R, γ], got shape {tuple(conf.shape)}")
    if not torch.is_floating_point(conf):
        raise ValueError(f"conf must be a floating-point tensor, got {conf.dtype}")
    if not bool(((conf >= 0) & (conf <= 1)).all()):
        raise ValueError("confidences must lie in [0, 1] (NaN is not allowed)")
    return torch.cumprod(conf, dim=1)  # [R, γ]


def rank_candidates(a: Tensor) -> tuple[Tensor, Tensor]:
    """Global order of all candidates ``(r, j)``: survival descending, then slot ascending, then request ascending.

    Args:
        a: ``[R, γ]`` prefix survivals.

    Returns:
        ``(rows, slots)``, each ``[R·γ]`` int64: the request and the 0-based slot of the i-th best candidate.
    """
    a = _checked_survivals(a, "a")
    R, gamma = a.shape
    if R == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    # Lay the candidates out slot-major (flat index j·R + r): a *stable* descending sort then keeps equal
    # survivals in (slot, request) order, which is exactly the value-independent tie-break.
    flat = a.t().reshape(-1)  # [γ·R]
    order = torch.sort(flat, descending=True, stable=True).indices  # [γ·R]
    return order % R, order // R


def allocate_top_b(a: Tensor, budget: int) -> Tensor:
    """Give the verify budget to the ``budget`` best candidates; returns ``ℓ`` ``[R]`` int64.

    The chosen set is a prefix of every request's block (module docstring), so ``ℓ_r`` is simply how many
    of the chosen candidates belong to request ``r``.
    """
    R, gamma = _shape(a, "a")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= R * gamma:
        raise ValueError(f"budget must be an integer in [0, R·γ] = [0, {R * gamma}], got {budget!r}")
    rows, _ = rank_candidates(a)
    lens = torch.bincount(rows[:budget], minlength=R)  # [R]
    return lens.to(device=a.device, dtype=torch.long)


def expected_tokens(a: Tensor, lens: Tensor, num_requests: int | None = None) -> float:
    """``τ = R_s + Σ_r Σ_{j≤ℓ_r} a_{r,j}``: expected tokens emitted by a step that verifies ``lens``.

    Args:
        a: ``[R, γ]`` prefix survivals.
        lens: ``[R]`` verify lengths in 0..γ.
        num_requests: ``R_s``, requests that sample a token this step; default ``R``.
    """
    a = _checked_survivals(a, "a")
    R, gamma = a.shape
    lens = _checked_lengths(lens, R, gamma, "lens")
    n_s = _num_sampling(num_requests, R)
    verified = torch.arange(gamma) < lens[:, None]  # [R, γ]
    return n_s + float((a * verified).sum())


# ---------------------------------------------------------------------------- the budget
def throughput_curve(a: Tensor, cost: CostTable, num_anchor_tokens: int, num_requests: int | None) -> list[float]:
    """``Θ(B)`` for ``B = 0..R·γ`` along the global ranking (the best allocation of each size)."""
    a = _checked_survivals(a, "a")
    R, gamma = a.shape
    n_s = _num_sampling(num_requests, R)
    t0 = _num_anchor_tokens(num_anchor_tokens, R)
    rows, slots = rank_candidates(a)
    gains = a[rows, slots].tolist()  # [R·γ] descending survivals
    theta, tau = [], float(n_s)
    for b in range(R * gamma + 1):
        if b > 0:
            tau += gains[b - 1]
        # The drafter drafted the full block for all R requests whatever B is, so its cost is keyed by R.
        step = cost.step_time(t0 + b, R)
        theta.append(tau / step if step > 0 else 0.0)
    return theta


def best_budget(a: Tensor, cost: CostTable, num_anchor_tokens: int, num_requests: int | None = None) -> int:
    """The unconstrained argmax over ``B = 0..R·γ`` of ``Θ(B) = (R_s + Σ of the B largest a) / step_time(T_0 + B, R)``.

    Global, not the first local maximum: measured cost curves are staircases, and a budget that fills the
    next CUDA graph can beat every smaller one. Ties go to the smaller ``B``. NOT lossless on the current
    step's survivals (module docstring); :class:`Scheduler` calls it on stale ones only.

    Args:
        a: ``[R, γ]`` prefix survivals.
        cost: the step-cost table.
        num_anchor_tokens: ``T_0``, the verify tokens that are not drafts (≥ R: one anchor per request).
        num_requests: ``R_s``, requests that sample a token this step (default ``R``).
    """
    theta = throughput_curve(a, cost, num_anchor_tokens, num_requests)
    return max(range(len(theta)), key=lambda b: (theta[b], -b))


def algorithm1(a: Tensor, cost: CostTable, num_anchor_tokens: int, num_requests: int | None = None) -> Tensor:
    """Paper Algorithm 1: admit candidates in rank order while ``Θ`` strictly improves; stop at the first
    non-improvement. Returns ``ℓ`` ``[R]`` int64. Arguments as in :func:`best_budget`.

    The stop is what keeps it lossless on the current survivals: admitting ``(r, k)`` depends only on
    candidates ranked at or before it, and none of those depends on ``x_{r,k}``.
    """
    theta = throughput_curve(a, cost, num_anchor_tokens, num_requests)
    budget = 0
    while budget + 1 < len(theta) and theta[budget + 1] > theta[budget]:
        budget += 1
    return allocate_top_b(a, budget)


def speculation_pays(a_latest: Tensor, cost: CostTable, num_anchor_tokens: int, num_requests: int | None = None,
                     margin: float = 0.0) -> bool:
    """Whether drafting is worth it this step: ``(1 + margin) · max_B Θ(B) ≥ R_s / verify_time(T_0, R)``, i.e. plain
    decoding is not expected to be more than ``margin`` faster.

    ``Θ(B)`` is :func:`best_budget`'s curve on ``a_latest`` (NaN rows filled by :func:`fill_stale_rows`); its step
    time counts the drafter's cost for all R requests, which a step that does not draft saves.

    Args:
        a_latest: ``[R, γ]`` survivals of each request's latest draft (NaN rows for requests without one).
        cost: the step-cost table (its ``draft_ms`` must be measured, else drafting looks free).
        num_anchor_tokens: ``T_0``. num_requests: ``R_s`` (default R).
        margin: how much faster plain decoding must look before drafting stops (the draft gate passes
            :func:`gate_margin`).
    """
    a = fill_stale_rows(a_latest)
    n_s = _num_sampling(num_requests, a.shape[0])
    plain = cost.verify_time(_num_anchor_tokens(num_anchor_tokens, a.shape[0]), a.shape[0])
    theta_plain = n_s / plain if plain > 0 else 0.0
    return (1.0 + margin) * max(throughput_curve(a, cost, num_anchor_tokens, num_requests)) >= theta_plain


class FinishEstimate(NamedTuple):
    """What finishing the running requests costs, drafting every step or decoding plainly (:func:`finish_estimate`)."""

    speculative_s: float  # expected seconds until the last request finishes, every step drafting at the planned budget
    plain_s: float  # seconds until the last request finishes by plain decoding
    speculative_steps: float  # expected steps until the last request finishes, drafting
    plain_steps: int  # steps until the last request finishes, plainly (its longest remaining answer)


def finish_estimate(a_latest: Tensor, remaining: Tensor, cost: CostTable, budget: int | None = None, *,
                   plain_scale: float = 1.0, speculative_scale: float = 1.0) -> FinishEstimate:
    """The time to finish every running request when no other request is coming (an offline batch draining),
    drafting every step against decoding plainly. The draft gate of an engine told so compares these two
    (:func:`finish_pays`) instead of one step's ``Θ``, because here the last request to finish sets the time.

    Why the step's ``Θ`` misleads here: a drafting step emits more tokens per second than a plain one at every batch
    size where ``speculation_pays``, yet the batch is done only when its slowest request is. Plain decoding finishes
    a batch of equal answers in exactly their length in steps, all at the full batch's price; drafting finishes most
    requests early but keeps stepping for the few whose drafts keep failing, and the most such laggards a batch holds
    the more requests it has. On a GPU where a large batch's drafting step costs several plain steps, that tail
    outweighs the gain.

    The model: request ``r`` verifies ``ℓ_r`` drafts each step (the global top-``B`` allocation of its survivals at
    the planned ``budget``) and so emits ``1 + A_r`` tokens, where ``P(A_r ≥ j) = a_{r,j}`` for ``j ≤ ℓ_r``: mean
    ``g_r = 1 + Σ_j a_{r,j}`` and variance ``Σ_j (2j − 1) a_{r,j} − (Σ_j a_{r,j})²``. Over its ``n_r`` remaining
    tokens it needs ``F_r`` steps, approximately normal with mean ``n_r / g_r`` and variance ``n_r · var / g_r³``
    (a renewal count). Step ``t`` runs while some request is unfinished, with probability
    ``1 − Π_r P(F_r ≤ t)``, and costs the drafting step of the requests expected to be left then. Plain decoding
    needs exactly ``n_r`` steps for request ``r``, each priced at the requests left.

    Args:
        a_latest: ``[R, γ]`` each request's recent survivals (NaN rows: none yet, filled as :func:`fill_stale_rows`).
        remaining: ``[R]`` tokens each request may still emit (at least 1).
        cost: the step-cost table (drafting steps at ``step_time``, plain ones at ``verify_time`` of one token each).
        budget: the drafts ``B`` a step verifies for all ``R`` requests (default: :func:`best_budget` of ``a_latest``).
        plain_scale, speculative_scale: multipliers of the table's plain and drafting prices (measured drift).
    """
    a = fill_stale_rows(a_latest).to(torch.float64)  # [R, γ]
    R, gamma = a.shape
    n = torch.as_tensor(remaining, dtype=torch.float64).reshape(-1)  # [R]
    if n.shape[0] != R or not bool((n >= 1).all()):
        raise ValueError(f"remaining must hold one count ≥ 1 per request ({R}), got {n.tolist()}")
    if budget is None:
        budget = best_budget(a, cost, R)
    lens = allocate_top_b(a, budget)  # [R]
    verified = (torch.arange(gamma) < lens[:, None]).to(torch.float64)  # [R, γ]
    mean = (a * verified).sum(dim=1)  # [R] E[A_r]
    second = ((2 * torch.arange(1, gamma + 1, dtype=torch.float64) - 1) * a * verified).sum(dim=1)  # [R] E[A_r²]
    rate = 1.0 + mean  # [R] tokens per step
    mu = n / rate  # [R] expected steps to finish
    sigma = (n * (second - mean**2).clamp_min(0.0) / rate**3).sqrt()  # [R]
    per_request = budget / R  # drafts verified per request and step

    prices: dict[int, float] = {}  # drafting-step price by requests left (a step count has few distinct values)

    def drafting_step(live: float) -> float:
        k = max(1, round(live))
        if k not in prices:
            prices[k] = speculative_scale * cost.step_time(k + round(k * per_request), k)
        return prices[k]

    def plain_step(live: int) -> float:
        return plain_scale * cost.verify_time(live, live)

    # Plain: the longest answers set the steps; between two remaining lengths the step prices the requests left.
    plain_s, done, left = 0.0, 0, R
    for length, count in zip(*torch.unique(n, return_counts=True)):
        steps = int(length) - done
        plain_s += steps * plain_step(left)
        done, left = int(length), left - int(count)
    # Drafting: step t (t = 0, 1, ...) runs while some F_r > t; its expected price counts the requests left.
    horizon = int(math.ceil(float((mu + 6 * sigma).max()))) + 1
    t = torch.arange(horizon, dtype=torch.float64)[:, None] + 0.5  # [T, 1] (continuity correction)
    z = (t - mu[None, :]) / sigma.clamp_min(1e-9)[None, :]  # [T, R]
    unfinished = 0.5 * torch.erfc(z / math.sqrt(2.0))  # [T, R] P(F_r > t)
    some = 1.0 - torch.exp(torch.log1p(-unfinished.clamp_max(1 - 1e-15)).sum(dim=1))  # [T] P(max F > t)
    live = unfinished.sum(dim=1)  # [T] expected requests left
    speculative_s = sum(p * drafting_step(m / p) for p, m in zip(some.tolist(), live.tolist()) if p > 1e-6)
    return FinishEstimate(speculative_s, plain_s, float(some.sum()), int(n.max()))


def finish_survivals(mean: Tensor, var: Tensor, count: Tensor) -> Tensor:
    """Each request's survivals for :func:`finish_estimate`: the mean of all its drafts' survivals so far, shrunk
    towards the batch's mean by as much as their noise explains the spread between requests (James–Stein).

    A request's rate over the rest of its answer is not that of its last few drafts: a request whose first drafts
    failed is forecast far slower than it turns out, and the finish time is the slowest request's. Per slot ``k``,
    with ``m_r`` request ``r``'s mean over its ``n_r`` drafts and ``v_r`` their variance, the noise of a mean is
    ``σ²_k = mean_r(v_r / n_r)`` and the spread ``S²_k`` the variance of the ``m_r`` across requests; the row becomes
    ``m̄ + w_k (m_r − m̄)`` with ``w_k = clip(1 − σ²_k / S²_k, 0, 1)``: a spread the noise accounts for is pooled, one
    beyond it is kept. No knob. On the CPU (float32, the shipped drafter, held-out ShareGPT, closed batches of 16 and
    64 drafting every step, three prompt groups each; ``scripts/check_finish_estimate.py``,
    ``docs/benchmarks/finish-estimate-cpu.json``) the expected steps after each request's fourth draft were 0.98-1.27
    times the steps taken (after the eighth 1.00-1.18), against 1.06-1.34 (1.08-1.48) from the draft gate's moving
    averages of the last few drafts.

    Args:
        mean: ``[R, γ]`` each request's mean survivals over its drafts.
        var: ``[R, γ]`` their variance across its drafts (ddof 1); ignored where ``count < 2`` (no noise known).
        count: ``[R]`` the drafts each request has made (≥ 1).

    Returns:
        ``[R, γ]`` float32 in ``[0, 1]``, non-increasing along each row; ``mean`` itself for a single request.
    """
    m = mean.to(torch.float64)
    if m.shape[0] < 2:
        return mean.to(torch.float32)
    n = count.to(torch.float64)[:, None]  # [R, 1]
    noise = torch.where(n >= 2, var.to(torch.float64) / n, torch.zeros_like(m)).mean(dim=0)  # [γ] σ²_k
    centre = m.mean(dim=0)  # [γ] m̄
    spread = m.var(dim=0)  # [γ] S²_k (ddof 1)
    w = torch.where(spread > 0, (1.0 - noise / spread.clamp_min(1e-30)).clamp(0.0, 1.0), torch.zeros_like(spread))
    rows = (centre + w * (m - centre)).clamp(0.0, 1.0)  # [R, γ]
    return torch.cummin(rows, dim=1).values.to(torch.float32)  # survivals never grow along the block


def population_rows(history: Tensor, count: int) -> Tensor:
    """``count`` stand-in survival rows for requests that have not drafted yet, drawn from ``history``: the mean
    survivals of requests that finished before them, taken at evenly spaced quantiles of their expected accepted
    drafts ``Σ_k a_k`` (the ``(i + ½)/count`` quantiles, ``i = 0..count-1``).

    Why: the finish-time estimate (:func:`finish_estimate`) prices the slowest request, so it needs the spread of
    the batch's rates, not only their mean. A batch that has not drafted yet has no rates of its own; without a
    stand-in its gate must draft a few times for every request before it can judge, and on a GPU where a large
    batch's drafting step costs two plain steps those drafts alone can cost more than the gate later saves. The
    rates of earlier requests of the same traffic give the spread; evenly spaced quantiles give it without noise
    (the same rows for the same history), and a batch as large as the history takes every row once.

    Args:
        history: ``[H, γ]`` earlier requests' mean survivals (H ≥ 1).
        count: rows wanted (≥ 0).

    Returns:
        ``[count, γ]`` float32, ordered from the slowest request's row to the fastest's.
    """
    if history.dim() != 2 or history.shape[0] < 1:
        raise ValueError(f"history must be [H ≥ 1, γ], got {tuple(history.shape)}")
    if count < 0:
        raise ValueError(f"count must be ≥ 0, got {count}")
    ranked = history[torch.argsort(history.to(torch.float64).sum(dim=1), stable=True)]  # [H, γ] slowest first
    h = ranked.shape[0]
    picks = ((torch.arange(count, dtype=torch.float64) + 0.5) * h / max(count, 1)).long().clamp_max(h - 1)  # [count]
    return ranked[picks].to(torch.float32)


OUTCOME_COLUMNS = 6  # per request, over its verified drafting steps: steps, Σe, Σx, Σe², Σx², Σe·x (outcome_factors)


def outcome_row(survivals: Tensor, verified: int, accepted: int) -> Tensor:
    """One verified draft's contribution to its request's :func:`outcome_factors` sums: the drafts expected to be
    accepted ``e = Σ_{k ≤ ℓ} a_k`` (its survivals over the ``verified`` slots) and those accepted ``x``:
    ``[1, e, x, e², x², e·x]`` float64."""
    e = float(survivals[:verified].to(torch.float64).sum())
    x = float(accepted)
    return torch.tensor([1.0, e, x, e * e, x * x, e * x], dtype=torch.float64)


def outcome_factors(sums: Tensor, relative: bool = False) -> Tensor:
    """Each request's factor between the drafts it had accepted and those its survivals forecast, pooled towards the
    batch's factor by as much as their noise explains the spread between requests (James–Stein, as
    :func:`finish_survivals` pools survivals).

    Why: the finish time is the slowest request's, and the requests a batch is left with are those whose drafts
    were accepted less than forecast. On an H200 (bf16, the shipped drafter) the drafts verified while a batch of 64
    or 256 drained to its last 1-16 requests survived 0.72-0.87 times as often as their survivals forecast, against
    0.95 over the whole batch (``docs/benchmarks/engine-h200-acceptance-feedback.json``, ``forecast``): a request's
    own outcomes so far tell how far its forecasts run ahead of it. Measured, they hardly moved the estimate on an
    H100 (``docs/benchmarks/finish-estimate-h100.json``), so the engine's gate applies them only when asked
    (``DraftGate.outcomes``).

    Per request ``r`` over its ``n_r`` verified drafting steps ``t``, with ``e_t`` the expected and ``x_t`` the
    accepted drafts: ``c_r = Σx / Σe``, its noise ``Σ(x_t − c_r e_t)² / (Σe)² · n_r / (n_r − 1)``; the batch's
    ``c̄ = ΣΣx / ΣΣe``, the spread ``S²`` the variance of the ``c_r`` across requests, the noise ``σ²`` their mean
    noise; the factor is ``c̄ + w (c_r − c̄)`` with ``w = clip(1 − σ² / S², 0, 1)``. A request with no verified draft
    takes ``c̄``. No knob.

    Args:
        sums: ``[R, 6]`` per request: steps, ``Σe``, ``Σx``, ``Σe²``, ``Σx²``, ``Σe·x`` (rows of :func:`outcome_row`
            added up).
        relative: divide by ``c̄`` (each request against the batch), for survivals a batch-wide calibration has
            scaled already (``EngineConfig.acceptance_feedback``).

    Returns:
        ``[R]`` float64 factors > 0; ones where the batch has no expected drafts at all.
    """
    s = sums.to(torch.float64)
    n, e, x, ee, xx, ex = s.unbind(dim=1)  # [R] each
    total = float(e.sum())
    if total <= 0:
        return torch.ones_like(n)
    pooled = float(x.sum()) / total
    c = torch.where(e > 0, x / e.clamp_min(1e-30), torch.full_like(e, pooled))  # [R] c_r
    known = (n >= 2) & (e > 0)
    resid = (xx - 2 * c * ex + c * c * ee).clamp_min(0.0)  # [R] Σ(x − c e)²
    noise_r = resid / (e * e).clamp_min(1e-30) * n / (n - 1).clamp_min(1.0)  # [R] var of c_r
    out = torch.full_like(e, pooled)
    if int(known.sum()) >= 2:
        noise = float(noise_r[known].mean())
        spread = float(c[known].var())
        w = min(max(1.0 - noise / spread, 0.0), 1.0) if spread > 0 else 0.0
        out = torch.where(known, pooled + w * (c - pooled), out)
    out = out.clamp_min(1e-3)
    return out / pooled if relative and pooled > 0 else out


def calibrate_rows(rows: Tensor, factors: Tensor) -> Tensor:
    """``rows`` ``[R, γ]`` survivals times each request's factor ``[R]``, capped at 1 and non-increasing along each
    row again (as the planner applies a batch-wide factor per slot). float32."""
    scaled = (rows.to(torch.float64) * factors.to(torch.float64)[:, None]).clamp(0.0, 1.0)
    return torch.cummin(scaled, dim=1).values.to(torch.float32)


def finish_pays(estimate: FinishEstimate, margin: float = 0.0) -> bool:
    """Whether a draining batch should draft: ``(1 + margin) · plain ≥ speculative`` time to finish (``margin`` read
    as in :func:`speculation_pays`: plain decoding must look more than ``margin`` faster to win). The engine's
    finish-time gate passes none: its verdict, either way, stands without probes until it is re-estimated, so
    neither answer needs the benefit of the doubt."""
    return (1.0 + margin) * estimate.plain_s >= estimate.speculative_s


def gate_margin(config: SchedulerConfig, num_requests: int) -> float:
    """The draft gate's margin for a batch of ``num_requests`` requests: ``config.gate_margin / √R``.

    The gate weighs the batch's mean expected gain, estimated from each request's recent survivals. One request's
    estimate swings from draft to draft, and a gate closed by a swing stays closed for ``probe_every`` plain steps,
    while a wrong "open" is undone at the next step: so a single request closes the gate only when plain decoding
    looks clearly faster. The mean over ``R`` requests is steadier by ``√R``, and so is the margin: at batch 256 a
    fixed 15 % margin kept a batch drafting that plain decoding beat by 10 % a step.
    """
    return config.gate_margin / math.sqrt(max(num_requests, 1))


def fold_recent(recent: Tensor, a: Tensor, window: int) -> Tensor:
    """The draft gate's running view of a request after its next draft: ``recent + (a − recent) / window``, an
    exponential moving average in which each draft's survivals weigh ``1/window`` (``a`` itself where ``recent`` is
    NaN: the first draft). One draft's survivals are a noisy forecast of the next one's; the average is steadier, and
    still a non-increasing row. Element-wise, so a batch of rows folds exactly as each row alone (the engine folds
    all its requests in one operation and gets the reference's floats).

    Args:
        recent: ``[.., γ]`` the running view so far (NaN: none yet). a: ``[.., γ]`` the new draft's survivals.
        window: ``SchedulerConfig.gate_window``.
    """
    return torch.where(torch.isnan(recent), a, recent + (a - recent) / window)


def draft_forced(config: SchedulerConfig, a_latest: Tensor | None, steps_without_draft: int) -> bool:
    """The draft gate's rule before any cost is weighed: ``True`` when the next step drafts whatever
    :func:`speculation_pays` would say — the mode has no gate or it is off, no request has survivals yet (nothing is
    known), or ``config.probe_every`` plain steps have passed (the survivals went stale while nobody drafted).
    Otherwise the gate's verdict is :func:`speculation_pays` (or a twin of it with the same cost table and margin).

    Args:
        config: the policy (its mode, ``draft_gate`` and ``probe_every``).
        a_latest: ``[R, γ]`` each request's recent survivals (:func:`fold_recent`), NaN rows for requests without
            any, or ``None`` when none has drafted.
        steps_without_draft: consecutive steps, up to now, that did not draft.
    """
    if not (config.mode.has_draft_gate and config.draft_gate):
        return True
    return a_latest is None or bool(torch.isnan(a_latest).all()) or steps_without_draft >= config.probe_every


def fill_stale_rows(a_stale: Tensor, prior: Tensor | None = None) -> Tensor:
    """Replace NaN rows (requests with no stale survivals) by the mean stale curve of the other requests.

    With no stale row at all the fill is ``prior`` ``[γ]`` — the mean stale curve of the last step that had one
    (:attr:`Scheduler.stale_prior`): a request that arrives alone, or a batch that starts together, is expected to
    draft as the requests before it did — or zeros when there is none: such candidates add nothing to ``τ``, so the
    budget ignores them (ties go to the smaller budget). A mean of non-increasing rows is non-increasing, so the
    result is a valid survival matrix.
    """
    R, gamma = _shape(a_stale, "a_stale")
    missing = torch.isnan(a_stale)  # [R, γ]
    row_missing = missing.all(dim=1)  # [R]
    if bool((missing.any(dim=1) & ~row_missing).any()):
        raise ValueError("a_stale has rows that are partly NaN; a request has either a full stale row or none")
    known = a_stale[~row_missing]  # [R_known, γ]
    _checked_survivals(known, "a_stale")
    if known.shape[0] > 0:
        fill = known.mean(dim=0)  # [γ]
    elif prior is not None:
        fill = torch.as_tensor(prior, dtype=a_stale.dtype, device=a_stale.device)  # [γ]
        if tuple(fill.shape) != (gamma,):
            raise ValueError(f"prior must have shape ({gamma},) like a row of a_stale, got {tuple(fill.shape)}")
        _checked_survivals(fill[None], "prior")
    else:
        fill = torch.zeros(gamma, dtype=a_stale.dtype, device=a_stale.device)
    return torch.where(row_missing[:, None], fill[None, :], a_stale)  # [R, γ]


def stale_mean(a_stale: Tensor) -> Tensor | None:
    """The mean stale curve ``[γ]`` of the requests that have a stale row (what :func:`fill_stale_rows` fills the
    others with), None when none has one."""
    known = a_stale[~torch.isnan(a_stale).all(dim=1)]  # [R_known, γ]
    return known.mean(dim=0) if known.shape[0] > 0 else None


def stale_budget(a_stale: Tensor, cost: CostTable, num_anchor_tokens: int, num_requests: int | None = None,
                 prior: Tensor | None = None) -> int:
    """The asynchronous budget: :func:`best_budget` of the stale survivals, NaN rows filled by :func:`fill_stale_rows`
    (with ``prior`` when no request has a stale row).

    This is the host half of the ``adaptive`` mode (:meth:`Scheduler.lengths`); an engine that allocates on the
    device calls it directly and must get the same integer.
    """
    return best_budget(fill_stale_rows(a_stale, prior), cost, num_anchor_tokens, num_requests)


# ---------------------------------------------------------------------------- the policies
@dataclass
class Scheduler:
    """Chooses every request's verify length ``ℓ_r`` each step, by ``config.mode`` (docs/method.md §5, baselines).

    Attributes:
        config: the policy and its parameters.
        gamma: block size γ of the drafter; no request verifies more than γ drafts (0 in mode ``none``: no drafter).
        cost: step-cost table; required by the modes whose ``needs_cost_table`` is set.
    """

    config: SchedulerConfig
    gamma: int
    cost: CostTable | None = None
    # Loop state of the draft gate: consecutive steps, up to now, that did not draft (the loop updates it).
    steps_without_draft: int = field(default=0, init=False)
    # Loop state of the adaptive budget: the mean stale curve [γ] of the last step in which some request had a stale
    # row (stale_mean), the fill of a step in which none has (fill_stale_rows); None before the first. lengths()
    # updates it.
    stale_prior: Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        mode = self.config.mode
        least = 1 if mode.drafts else 0
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < least:
            raise ValueError(f"gamma must be an integer ≥ {least} in mode '{mode}', got {self.gamma!r}")
        if mode.needs_cost_table and self.cost is None:
            raise ValueError(f"scheduler mode '{mode}' needs a cost table (cost=None)")
        if mode is SchedulingMode.ADAPTIVE and self.config.staleness < 1:
            raise ValueError("adaptive mode with staleness 0 would take the unconstrained argmax over the current "
                             "survivals, which is not lossless (docs/method.md Appendix A); use staleness ≥ 1, or "
                             "mode 'adaptive-sync' for a synchronous scheduler")

    def lengths(self, a_current: Tensor, *, a_stale: Tensor | None = None, num_anchor_tokens: int | None = None,
                accepted_if_full: Tensor | None = None, num_requests: int | None = None) -> Tensor:
        """Verify lengths ``ℓ`` ``[R]`` int64 for this step.

        Modes:
            * ``none``: 0 (ordinary decoding).
            * ``fixed``: ``min(k, γ)`` for every request.
            * ``dsd``: ``K`` from ``dsd_table`` at the largest key ≤ R (the smallest key's ``K`` when R is below
              every key), clipped to γ (vLLM #32374).
            * ``threshold``: the largest ``ℓ`` with ``a_{r,ℓ} ≥ threshold`` (0 if even ``a_{r,1}`` is below).
            * ``adaptive-sync``: :func:`algorithm1` on ``a_current``.
            * ``adaptive``: budget ``K = best_budget(a_stale)``, then ``allocate_top_b(a_current, K)``.
            * ``oracle``: ``accepted_if_full`` (simulation only: needs the outcome of verifying everything).

        The asynchronous ``adaptive`` mode, precisely. Steps are numbered by the engine; step ``t`` verifies
        the blocks drafted from step ``t``'s anchors, whose survivals are ``a^(t)`` (``a_current``). In an
        overlapped engine the host plans step ``t`` while the device is still running step ``t-1``; the
        survivals of step ``t-1`` are being produced and copied on a side stream right then, so the newest
        copy the host can read without synchronising is that of step ``t-2``. Hence ``a_stale`` row ``r``
        holds the calibrated survivals request ``r`` had at step ``t - config.staleness`` (default 2; vLLM's
        merged code uses 1), i.e. those of its draft ``staleness`` drafts before the current one (a decoding
        request drafts every step, so the two counts agree). A request with no such draft (it joined since)
        is a NaN row; it gets the mean stale curve of the other requests, or, if no request has one, that of the
        last step in which some request had one (:attr:`stale_prior`: a request that arrives alone drafts, it is
        expected, as those before it did), or zeros before any (then the budget ignores it, yet the allocation from
        current values may still give it slots). The prior is older than the stale rows, so it anticipates nothing.

        Why both parts are non-anticipating, hence lossless:
            * the budget ``K`` is a function of step ``t - staleness``'s survivals and of ``T_0``, all fixed
              before any draft of step ``t`` was sampled;
            * given ``K``, slot ``k`` of request ``r`` is verified iff fewer than ``K`` candidates rank ahead of
              ``(r, k)``. Its own later slots never do (``a_{r,j}`` is non-increasing in ``j`` and ties rank the
              later slot after the earlier one), so the decision reads ``a_{r,≤k}``, which depends only on
              ``x_{r,<k}``, and the other requests' survivals, which do not depend on request ``r``'s draws.
        The unconstrained argmax is safe only on stale values: on current ones ``K`` itself would read
        ``a_{r,k+1}``, a function of ``x_{r,k}``, and the choice to verify ``x_{r,k}`` would depend on ``x_{r,k}``.

        Args:
            a_current: ``[R, γ]`` calibrated prefix survivals of this step's drafts.
            a_stale: ``[R, γ]`` survivals of ``config.staleness`` steps earlier, NaN rows for requests without
                one (``adaptive`` only).
            num_anchor_tokens: ``T_0``, non-draft tokens in this verify forward (adaptive modes only).
            accepted_if_full: ``[R]`` int, how many drafts full verification would accept (``oracle`` only).
            num_requests: ``R_s``, requests that sample a token this step (adaptive modes; default ``R``).
        """
        a = _checked_survivals(a_current, "a_current")
        R, gamma = a.shape
        if gamma != self.gamma:
            raise ValueError(f"a_current has {gamma} slots but the scheduler's block size is γ = {self.gamma}")
        cfg, device = self.config, a_current.device
        mode = cfg.mode
        if mode is SchedulingMode.NONE:
            lens = torch.zeros(R, dtype=torch.long)
        elif mode in (SchedulingMode.FIXED, SchedulingMode.DSD):
            lens = torch.full((R,), self.uniform_length(R), dtype=torch.long)
        elif mode is SchedulingMode.THRESHOLD:
            # a is non-increasing along j, so the slots at or above the threshold are a prefix: count them.
            lens = (a >= cfg.threshold).sum(dim=1)
        elif mode is SchedulingMode.ADAPTIVE_SYNC:
            lens = algorithm1(a, self.cost, self._anchor_tokens(num_anchor_tokens), num_requests)
        elif mode is SchedulingMode.ADAPTIVE:
            if a_stale is None:
                raise ValueError("adaptive mode needs a_stale (NaN rows for requests without stale survivals)")
            if tuple(a_stale.shape) != (R, gamma):
                raise ValueError(f"a_stale has shape {tuple(a_stale.shape)}, expected {(R, gamma)} like a_current")
            budget = stale_budget(a_stale, self.cost, self._anchor_tokens(num_anchor_tokens), num_requests,
                                  prior=self.stale_prior)
            mean = stale_mean(a_stale)
            if mean is not None:
                self.stale_prior = mean
            lens = allocate_top_b(a, budget)
        elif mode is SchedulingMode.ORACLE:
            if accepted_if_full is None:
                raise ValueError("oracle mode needs accepted_if_full (simulation only)")
            lens = _checked_lengths(accepted_if_full, R, gamma, "accepted_if_full")
        else:  # SchedulerConfig validates the mode; this guards against a mode added there but not here
            raise ValueError(f"scheduler mode {mode!r} is not implemented")
        return lens.to(device=device, dtype=torch.long)

    def uniform_length(self, num_requests: int) -> int:
        """ℓ of every request in the modes that ignore the survivals: ``min(k, γ)`` (``fixed``) or the ``dsd_table``
        entry at the largest key ≤ R (the smallest key's when R is below every key), clipped to γ (``dsd``)."""
        cfg = self.config
        if cfg.mode is SchedulingMode.FIXED:
            return min(cfg.k, self.gamma)
        if cfg.mode is SchedulingMode.DSD:
            keys = sorted(cfg.dsd_table)
            key = max((b for b in keys if b <= num_requests), default=keys[0])
            return min(cfg.dsd_table[key], self.gamma)
        raise ValueError(f"mode '{cfg.mode}' has no uniform verify length")

    def should_draft(self, a_latest: Tensor | None, steps_without_draft: int, *, num_anchor_tokens: int,
                     num_requests: int | None = None) -> bool:
        """Whether the next step drafts (the draft gate; always ``True`` outside ``adaptive`` or with the gate off).

        Decided before the step's drafts are sampled, from each request's recent survivals (``a_latest``, the
        running average of :func:`fold_recent`; NaN rows for requests without any): drafting stops while
        :func:`speculation_pays` says plain decoding is faster, and resumes for one probing step after
        ``config.probe_every`` plain steps (the survivals go stale while nobody drafts) or when no request has
        survivals at all (nothing is known yet).

        Args:
            a_latest: ``[R, γ]`` or ``None`` (no request has drafted yet).
            steps_without_draft: consecutive steps, up to now, that did not draft.
            num_anchor_tokens: ``T_0`` of the next step. num_requests: ``R_s`` (default R).
        """
        if draft_forced(self.config, a_latest, steps_without_draft):
            return True
        return speculation_pays(a_latest, self.cost, num_anchor_tokens, num_requests,
                                gate_margin(self.config, a_latest.shape[0]))

    @staticmethod
    def _anchor_tokens(num_anchor_tokens: int | None) -> int:
        if num_anchor_tokens is None:
            raise ValueError("adaptive modes need num_anchor_tokens (T_0, the non-draft tokens of the verify forward)")
        return num_anchor_tokens


# ---------------------------------------------------------------------------- validation
def _shape(a: Tensor, name: str) -> tuple[int, int]:
    if not isinstance(a, Tensor) or a.dim() != 2:
        raise ValueError(f"{name} must be an [R, γ] tensor, got {getattr(a, 'shape', type(a).__name__)}")
    if not torch.is_floating_point(a):
        raise ValueError(f"{name} must be a floating-point tensor, got {a.dtype}")
    return a.shape[0], a.shape[1]


def _checked_survivals(a: Tensor, name: str) -> Tensor:
    """Validate prefix survivals and return them as a float64 CPU tensor, exactly non-increasing along j.

    Tiny increases (≤ 1e-6, float noise from a calibration in another dtype) are flattened by a running
    minimum; without it a slot could outrank the one before it and top-B would stop being a prefix.
    """
    _shape(a, name)
    a = a.detach().to("cpu", torch.float64)  # [R, γ]
    if not bool(((a >= 0) & (a <= 1)).all()):
        raise ValueError(f"{name} must lie in [0, 1] (NaN is not allowed)")
    if a.shape[1] > 1 and bool((a[:, 1:] - a[:, :-1] > MONOTONE_TOL).any()):
        raise ValueError(f"{name} must be non-increasing along the slot axis (prefix survivals); "
                         f"pass confidences through prefix_survival first")
    return torch.cummin(a, dim=1).values


def _checked_lengths(lens: Tensor, R: int, gamma: int, name: str) -> Tensor:
    if not isinstance(lens, Tensor) or tuple(lens.shape) != (R,):
        raise ValueError(f"{name} must be an [R] = [{R}] tensor, got {getattr(lens, 'shape', type(lens).__name__)}")
    if torch.is_floating_point(lens) or lens.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {lens.dtype}")
    lens = lens.detach().to("cpu", torch.long)
    if bool(((lens < 0) | (lens > gamma)).any()):
        raise ValueError(f"{name} must lie in 0..γ = 0..{gamma}, got {lens.tolist()}")
    return lens


def _num_sampling(num_requests: int | None, R: int) -> int:
    if num_requests is None:
        return R
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < R:
        raise ValueError(f"num_requests (requests that sample this step) must be an integer ≥ R = {R}, "
                         f"got {num_requests!r}: every drafting request samples at least its bonus token")
    return num_requests


def _num_anchor_tokens(t0: int, R: int) -> int:
    if isinstance(t0, bool) or not isinstance(t0, int) or t0 < R:
        raise ValueError(f"num_anchor_tokens (T_0) must be an integer ≥ R = {R} (one anchor per request), got {t0!r}")
    return t0
