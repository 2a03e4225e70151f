"""All host planning of the engine: admission, chunked prefill, the verify budget, the draft gate, finishing.

Implements the host side of docs/method.md §5 in its production form. The host owns the list of sequences and a
slot (a row of the static KV caches) per running sequence. Before each step's device work, :meth:`Scheduler.schedule`
decides, in a typed :class:`StepPlan`,

* which waiting sequences are admitted (a free slot, first come first served),
* how many prompt tokens each prefilling sequence runs this step (chunked prefill),
* how the decoding sequences verify: the budget B of ``adaptive`` from a *stale* host copy of their calibrated
  prefix survivals (:class:`BudgetPlanner`, the copy is ``staleness`` drafts old, so computing B never waits for the
  device; the per-request allocation ℓ_r = top-B of the *current* survivals happens on the device), or the
  lengths the host knows on its own (``none``, ``fixed``, ``dsd``, ``oracle``; with the n-gram proposer, ``fixed``
  and ``dsd`` are clipped to each request's ``proposal_len``). The two synchronous policies
  (``threshold``, ``adaptive-sync``) get their lengths after the engine reads the current survivals
  (:meth:`Scheduler.synchronous_lengths`).

After the device work it commits the emitted tokens (EOS, length limit, stop strings; :meth:`Scheduler.postprocess`)
and decides whether the next step drafts at all (:class:`DraftGate`). Nothing here touches a device tensor.

Names follow ``docs/method.md`` (``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size, ``Θ`` throughput).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from optimized.cost_monitor import request_bucket
from optimized.sequence import Sequence, Status, StepOutput
from reference.config import SchedulerConfig, SchedulingMode
from reference.cost_model import CostTable
from reference.scheduler import (
    MONOTONE_TOL,
    OUTCOME_COLUMNS,
    FinishEstimate,
    calibrate_rows,
    fill_stale_rows,
    finish_pays,
    finish_survivals,
    gate_margin,
    outcome_factors,
    population_rows,
)
from reference.scheduler import Scheduler as Policy


class PrefillChunk(NamedTuple):
    """Prompt positions ``start .. start + length - 1`` of ``seq``, run this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def completes(self) -> bool:
        """The chunk ends the prompt: the sequence samples its first token and starts decoding."""
        return self.start + self.length == len(self.seq.prompt_ids)


@dataclass
class StepPlan:
    """What one step runs, decided on the host before any device work.

    The verify lengths are given in one of two forms: ``budget`` (``adaptive``: B drafts over all requests, allocated
    on the device as the top-B of the current survivals) or ``lengths`` (ℓ per decoding request, known to the host).
    """

    prefill: list[PrefillChunk]  # prompt chunks, in admission order
    decoding: list[Sequence]  # the requests that verify this step, in admission order
    mode: SchedulingMode  # the policy this step: NONE while nobody holds drafts (no drafter, or the gate closed)
    budget: int | None = None  # adaptive: B, from the stale survivals
    lengths: list[int] | None = None  # [R] ℓ per decoding request (none, fixed, dsd, oracle; synchronous modes later)

    @property
    def num_verify_tokens(self) -> int:
        """N = R + Σ ℓ, the unpadded tokens of the verify forward (the top-B allocation always spends all of B)."""
        drafts = self.budget if self.budget is not None else sum(self.lengths or ())
        return len(self.decoding) + drafts


class BudgetPlanner:
    """The host half of the ``adaptive`` mode, fast: the twin of ``reference.scheduler.stale_budget`` (the budget)
    and of ``reference.scheduler.speculation_pays`` (the draft gate).

    The reference walks ``B = 0..R·γ`` in Python and asks the cost table for every step time; at R = 256 that
    is 1,800 table lookups per step on the host. Here the step-time curve is cached per ``(T_0, R)`` (the
    table is fixed for the engine's life) and Θ(B) for every B is one float64 cumulative sum. The result is
    the same integer: τ(B) is accumulated in the same order and precision (float64, sequential sums on the
    host), so ties resolve identically (the smaller B), as ``tests/optimized/test_budget.py`` checks.

    This runs on the host every step, between the device's forwards, where what counts is how many distinct
    operations run, not their arithmetic: the forwards evict the caches, so a small NumPy call that takes a
    microsecond in a tight loop takes several to tens of µs in the engine. Hence the survivals arrive as NumPy
    arrays (``Scheduler.record_drafts`` keeps them so; torch tensors are accepted too), and Θ is computed on
    Python floats while there are at most ``PYTHON_MAX_CANDIDATES`` candidates (a sort and one accumulate, no
    NumPy call) and in a few NumPy calls above that. Both give the same floats: the float64 sums run in the same
    order, and Python and NumPy divide alike. :meth:`stale_budget` takes the Python floats straight from the
    matrix when no row is NaN (the usual step), skipping the NumPy tests for missing rows. ``scripts/bench_host.py``
    measures the host planning of a whole step. Rows with NaN (requests too new to have stale survivals) take the
    reference's own fill, in torch, so the filled values are bit-identical.
    """

    # Up to this many candidates R·γ, Θ is computed on Python floats. On the project's 2-core CPU (2026-12-01, tiny
    # models, γ = 7, two engines stepped in turn) that made a whole adaptive step's host planning 1.5× faster at
    # R = 1 and 4 and 1.25× at R = 16 than NumPy did, 1.1× at R = 32; NumPy was 1.1× faster at R = 64 (NumPy's cost
    # hardly depends on the size, Python's grows with it).
    PYTHON_MAX_CANDIDATES = 256

    def __init__(self, cost: CostTable | None) -> None:
        self.cost = cost  # and empty caches (the setter)
        # Multipliers of the table's prices of plain and of speculative steps, from the engine's measurements
        # (optimized/cost_monitor.py): per batch-size bucket (request_bucket) in ``price_scales``, these two for a
        # bucket without its own; 1.0 is the table as it is (the reference's twin: a product with 1.0 is exact).
        self.plain_scale = self.speculative_scale = 1.0
        self.price_scales: dict[int, tuple[float, float]] = {}  # bucket -> (plain, speculative)
        # Per-slot factors of the survivals from the drafts that survived (optimized/acceptance_monitor.py): Θ is
        # computed on min(1, a_k · factor_k), non-increasing again. None: the survivals as they are (the reference's).
        self.survival_scale: np.ndarray | None = None
        # The adaptive budget's prior (reference.scheduler.Scheduler.stale_prior): the last stale matrix in which some
        # request had a row; its mean stale curve is computed only for a step in which no request has one.
        self._stale_seen: np.ndarray | None = None  # [R, γ] float32, never written after it is kept
        self._stale_prior: np.ndarray | None = None  # [γ] its mean, once asked for

    @property
    def cost(self) -> CostTable | None:
        """The step-cost table the budget is priced on; setting another one empties the caches of its prices."""
        return self._cost

    @cost.setter
    def cost(self, cost: CostTable | None) -> None:
        self._cost = cost
        self._curves: dict[tuple[int, int, int], tuple[np.ndarray, list[float] | None]] = {}
        self._verify_times: dict[tuple[int, int], float] = {}
        self._draft_times: dict[int, float] = {}
        # verify seconds for 0, 1, 2, … tokens, per request curve of the table (None: none of them), grown as needed
        self._verify_curves: dict[int | None, np.ndarray] = {}

    def _step_times(self, t0: int, r: int, candidates: int) -> tuple[np.ndarray, list[float] | None]:
        """What Θ(B) divides τ(B) by, for B = 0..``candidates``: the step time ``step_time(T_0 + B, R)``, at least
        1e-300, and ∞ where the step time is not positive (Θ = τ / ∞ = 0 there, as the reference's ``else 0.0``).
        As an array, and as a list for the Python-float Θ (None above ``PYTHON_MAX_CANDIDATES``).

        The same floats as :func:`step_time_curve`, which a steady server's changing batch size would call nearly
        every step (130 µs at R = 256 on the project's 2-core CPU): the verify times depend on R only through the
        table's request curve that R picks, so they are computed once per curve and sliced (about 10 µs)."""
        key = (t0, r, candidates)
        curve = self._curves.get(key)
        if curve is None:
            verify = self._verify_curve(r, t0 + candidates + 1)[t0:t0 + candidates + 1]  # [R·γ + 1] seconds
            step = verify + self.cost.draft_time(r)  # step_time = verify_time + draft_time, the same float sum
            step = np.where(step > 0, np.maximum(step, 1e-300), np.inf)  # [R·γ + 1]
            lst = step.tolist() if candidates <= self.PYTHON_MAX_CANDIDATES else None  # sync: none, host NumPy
            curve = (step, lst)  # cached per (T_0, R)
            if len(self._curves) > 4096:  # bounded: (T_0, R) pairs are few in steady state
                self._curves.clear()
            self._curves[key] = curve
        return curve

    def _verify_curve(self, r: int, upto: int) -> np.ndarray:
        """``[≥ upto]`` float64: ``cost.verify_time(n, r)`` for n = 0, 1, 2, …, as :func:`verify_time_curve`, kept per
        request curve of the table (the one R picks: the smallest measured count ≥ R) and recomputed longer when a
        step needs more (never longer than asked: a table without eager sizes cannot price a step past its graphs)."""
        which = request_curve(self.cost, r)
        curve = self._verify_curves.get(which)
        if curve is None or len(curve) < upto:  # exactly as long as asked: past the graphs a table may stop
            curve = self._verify_curves[which] = verify_time_curve(self.cost, 0, upto, r)
        return curve

    def verify_time(self, num_tokens: int, num_requests: int) -> float:
        """``cost.verify_time(num_tokens, num_requests)``, cached: the table's lookup sorts its sizes, tens of µs."""
        key = (num_tokens, num_requests)
        t = self._verify_times.get(key)
        if t is None:
            if len(self._verify_times) > 4096:  # bounded, as the curves
                self._verify_times.clear()
            t = self._verify_times[key] = self.cost.verify_time(num_tokens, num_requests)
        return t

    def budget(self, a_stale: np.ndarray | torch.Tensor, num_anchor_tokens: int, num_requests: int | None = None,
               *, check: bool = True) -> int:
        """The twin of ``reference.scheduler.stale_budget``: the argmax of Θ(B), the smaller B on ties.

        ``check=False`` skips the range and monotonicity checks, for survivals that hold them by construction (the
        engine's own: cumulative products of sigmoids, and moving averages of such rows); NaN rows are looked for
        and filled either way."""
        return self._best(self._theta(a_stale, num_anchor_tokens, num_requests, check))[0]

    def stale_budget(self, a_stale: np.ndarray, num_anchor_tokens: int, num_requests: int | None = None, *,
                     check: bool = True, record: bool = True) -> int:
        """The budget of an ``adaptive`` plan, as ``reference.scheduler.Scheduler.lengths`` computes it: :meth:`budget`,
        except that in a step in which no request has a stale row (a request that arrives alone, a batch that starts
        together) every row is the mean stale curve of the last step in which some request had one (the reference's
        ``stale_prior``; zeros before any, as :meth:`budget`). ``a_stale`` ``[R, γ]`` float32 is then kept as that
        step's (unless ``record`` is False: a budget planned ahead of its step is recorded when the step uses it,
        :meth:`note_stale`), and must not be written afterwards."""
        arr = np.asarray(a_stale, dtype=np.float32)  # [R, γ]
        if not check and self.survival_scale is None and 0 < arr.size <= self.PYTHON_MAX_CANDIDATES and arr.ndim == 2:
            # The usual step at small R, on Python floats: one C call reads every survival, and the NaN test is a sum
            # (NaN exactly when some entry is NaN). With no NaN, every request has its row: the matrix is kept for the
            # prior (note_stale's test holds) and Θ needs no fill: the same floats as below, without a dozen NumPy
            # calls (each several µs on a host whose caches the forwards evicted).
            gains = arr.ravel().tolist()  # sync: none, host NumPy; [R·γ]
            if not math.isnan(sum(gains)):
                if record:
                    self._stale_seen, self._stale_prior = arr, None
                r, g = arr.shape
                return self._best(self._theta_floats(gains, num_anchor_tokens, r, g, num_requests))[0]
        if arr.ndim == 2 and arr.shape[0] and np.isnan(arr[:, 0]).all():  # rows are whole: no request has one
            prior = self.stale_prior()
            if prior is not None:
                arr = np.repeat(prior[None, :], arr.shape[0], axis=0)  # [R, γ] fill_stale_rows with the prior
        elif record:
            self.note_stale(arr)
        return self.budget(arr, num_anchor_tokens, num_requests, check=check)

    def note_stale(self, a_stale: np.ndarray) -> None:
        """Keep ``a_stale`` ``[R, γ]`` float32 (not written afterwards) as the last step's stale survivals, for
        :meth:`stale_prior`, if some request has a row in it."""
        if a_stale.shape[0] and not np.isnan(a_stale[:, 0]).all():
            self._stale_seen, self._stale_prior = a_stale, None

    def stale_prior(self) -> np.ndarray | None:
        """``reference.scheduler.stale_mean`` of the last stale survivals kept (``[γ]`` float32, the same torch mean
        of the same contiguous rows), None before any."""
        if self._stale_prior is None and self._stale_seen is not None:
            seen = self._stale_seen
            known = seen[~np.isnan(seen[:, 0])]  # [R_known, γ] a fresh contiguous array, as the reference's index
            self._stale_prior = torch.from_numpy(known).mean(dim=0).numpy()  # sync: none, a CPU tensor
        return self._stale_prior

    def scales(self, num_requests: int) -> tuple[float, float]:
        """The (plain, speculative) price multipliers for a step of ``num_requests`` requests."""
        return self.price_scales.get(request_bucket(num_requests), (self.plain_scale, self.speculative_scale))

    def speculation_pays(self, a_latest: np.ndarray | torch.Tensor, num_anchor_tokens: int,
                         num_requests: int | None = None, margin: float = 0.0, *, check: bool = True) -> bool:
        """The twin of ``reference.scheduler.speculation_pays`` (the draft gate): same Θ values, same comparison.
        ``check`` as in :meth:`budget`."""
        n_s = a_latest.shape[0] if num_requests is None else num_requests
        plain = self.verify_time(num_anchor_tokens, a_latest.shape[0])
        theta_plain = n_s / plain if plain > 0 else 0.0
        theta = self._theta(a_latest, num_anchor_tokens, num_requests, check)
        # Θ_plain and every Θ(B) at the measured prices: Θ(B) / s_spec against Θ_plain / s_plain (both 1: the table's).
        s_plain, s_spec = self.scales(a_latest.shape[0])
        scale = (1.0 + margin) * s_plain / s_spec
        if isinstance(theta, np.ndarray) or scale <= 0:
            return scale * self._best(theta)[1] >= theta_plain
        # Θ on Python floats, one budget at a time: the first that pays answers. The same boolean as with the best
        # Θ, because scale > 0 keeps scale·Θ largest where Θ is (rounding is monotone).
        return any(scale * t >= theta_plain for t in theta)

    def gate_estimates(self, a_latest: np.ndarray, num_anchor_tokens: int) -> tuple[float, float]:
        """``(best Θ at the measured prices, Θ_plain)``: the two numbers :meth:`speculation_pays` compares (before
        its margin), for a trace of the gate's decisions (``DraftGate.trace``); not on the engine's hot path."""
        r = a_latest.shape[0]
        plain = self.verify_time(num_anchor_tokens, r)
        best = self._best(self._theta(a_latest, num_anchor_tokens, None, check=False))[1]
        s_plain, s_spec = self.scales(r)
        return best * s_plain / s_spec, (r / plain if plain > 0 else 0.0)

    def finish_estimate(self, a_latest: np.ndarray, remaining: list[int]) -> FinishEstimate:
        """``reference.scheduler.finish_estimate`` at this planner's prices (the survivals scaled as the budget sees
        them, the measured price multipliers, the budget it would plan), its table lookups cached: host NumPy
        (:func:`finish_estimate_host`, the same estimate to rounding)."""
        arr = np.asarray(a_latest, dtype=np.float32)  # [R, γ]
        r = arr.shape[0]
        budget = self.budget(arr, r, r, check=False)  # the budget it would plan (it scales the survivals itself)
        a = self._scaled(arr)  # [R, γ] float32
        if np.isnan(a).any():  # rows of requests without a draft: filled (and checked) as the reference fills them
            a = fill_stale_rows(torch.from_numpy(np.ascontiguousarray(a))).numpy()
        # the measured multipliers per batch size, in the prices (each step of the estimate has its own batch)
        return finish_estimate_host(a, remaining, _Prices(self), budget)

    def _scaled(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` ``[R, γ]`` float32 times the per-slot ``survival_scale``, capped at 1 and non-increasing again (NaN
        rows stay NaN); ``arr`` itself without a scale."""
        if self.survival_scale is None:
            return arr
        return np.minimum(np.minimum.accumulate(arr * self.survival_scale[:arr.shape[1]], axis=1),
                          1.0).astype(np.float32)  # [R, γ] in [0, 1], non-increasing

    @staticmethod
    def _best(theta: Iterator[float] | np.ndarray) -> tuple[int, float]:
        """The budget with the largest Θ (the first, i.e. the smaller B, on ties) and that Θ."""
        if isinstance(theta, np.ndarray):
            b = int(theta.argmax())  # the first maximum
            return b, float(theta[b])
        theta = list(theta)
        best = max(theta)
        return theta.index(best), best  # the first maximum

    def _theta(self, a_stale: np.ndarray | torch.Tensor, num_anchor_tokens: int, num_requests: int | None,
               check: bool = True) -> Iterator[float] | np.ndarray:
        """Θ(B) for B = 0..R·γ along the global ranking, as ``reference.scheduler.throughput_curve``: Python floats
        (an iterator, B = 0 first) up to ``PYTHON_MAX_CANDIDATES`` candidates, a float64 array above."""
        if isinstance(a_stale, torch.Tensor):  # sync: none in practice, the callers' tensors live on the host
            a_stale = a_stale.detach().to("cpu", torch.float32).numpy()
        arr = np.asarray(a_stale, dtype=np.float32)  # [R, γ] (no copy if it is float32 already)
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"a_stale must be a non-empty [R, γ] matrix, got {tuple(arr.shape)}")
        arr = self._scaled(arr)  # what the drafts' outcomes say of the forecasts (acceptance feedback), if anything
        r, g = arr.shape
        n_s = r if num_requests is None else num_requests
        if r * g <= self.PYTHON_MAX_CANDIDATES:
            gains = arr.ravel().tolist()  # sync: none, host NumPy; [R·γ]
            # Unchecked survivals lie in [0, 1] or are NaN, so their sum is NaN exactly when a row must be filled.
            if check or math.isnan(sum(gains)):
                gains = self._filled(arr, check).ravel().tolist()  # sync: none, host NumPy
            return self._theta_floats(gains, num_anchor_tokens, r, g, num_requests)
        step, _ = self._step_times(num_anchor_tokens, r, r * g)  # [R·γ + 1]
        gains = np.sort(self._filled(arr, check), axis=None)[::-1]  # [R·γ] descending
        tau = np.cumsum(np.concatenate(([float(n_s)], gains)))  # [R·γ + 1] float64, sequential as the sums above
        return tau / step

    def _theta_floats(self, gains: list[float], num_anchor_tokens: int, r: int, g: int,
                      num_requests: int | None) -> Iterator[float]:
        """Θ(B) for B = 0..R·γ on Python floats (an iterator, B = 0 first) from ``gains``, the ``[R·γ]`` filled
        survivals as floats (sorted here, in place): the same float64 sums in the same order as the NumPy path."""
        _, step_list = self._step_times(num_anchor_tokens, r, r * g)  # [R·γ + 1]
        gains.sort(reverse=True)  # descending (equal values: order immaterial)
        n_s = r if num_requests is None else num_requests
        tau = itertools.accumulate(gains, initial=float(n_s))  # [R·γ + 1] sequential float64 sums
        return map(operator.truediv, tau, step_list)  # [R·γ + 1] τ(B) / step(B), computed as they are read

    @staticmethod
    def _filled(arr: np.ndarray, check: bool) -> np.ndarray:
        """``arr`` ``[R, γ]`` float32 with its NaN rows filled and checked as the reference does (``fill_stale_rows``;
        without NaN its range and monotonicity checks run only with ``check``)."""
        if np.isnan(arr).any():
            if check:
                # the reference's fill and its checks. sync: none, CPU tensors over host NumPy
                return fill_stale_rows(torch.from_numpy(arr)).numpy()
            # The engine's own rows (whole rows NaN or none): the reference's fill without its checks, the known
            # rows' mean by the very torch op it uses on the same contiguous float32 rows, the rest in NumPy (5x
            # cheaper on the host than the reference function's dozen torch calls; the same floats, as
            # tests/optimized/test_budget.py checks).
            missing = np.isnan(arr).all(axis=1)  # [R]
            known = arr[~missing]  # [R_known, γ] a fresh contiguous array, as the reference's boolean index
            fill = (torch.from_numpy(known).mean(dim=0).numpy() if known.shape[0]  # sync: none, a CPU tensor
                    else np.zeros(arr.shape[1], dtype=arr.dtype))  # [γ]
            return np.where(missing[:, None], fill[None, :], arr)  # [R, γ]
        if check:  # the reference's checks of fill_stale_rows, in float64 as it does them
            a64 = arr.astype(np.float64)  # [R, γ]
            if not (a64.min() >= 0 and a64.max() <= 1):
                raise ValueError("a_stale must lie in [0, 1] (NaN is not allowed)")
            if a64.shape[1] > 1 and (a64[:, 1:] - a64[:, :-1] > MONOTONE_TOL).any():
                raise ValueError("a_stale must be non-increasing along the slot axis (prefix survivals); "
                                 "pass confidences through prefix_survival first")
        return arr


class _Prices:
    """The two lookups ``finish_estimate`` makes of a cost table, through the planner's caches (the table's own
    lookups sort its sizes: tens of µs each, and an estimate makes a hundred), at the planner's measured multipliers
    for each batch size: ``verify_time`` prices the plain steps, ``step_time`` the drafting ones."""

    def __init__(self, planner: BudgetPlanner) -> None:
        self.planner = planner

    def verify_time(self, num_tokens: int, num_requests: int) -> float:
        return self.planner.scales(num_requests)[0] * self.planner.verify_time(num_tokens, num_requests)

    def step_time(self, num_tokens: int, num_requests: int) -> float:
        draft = self.planner._draft_times.get(num_requests)
        if draft is None:
            draft = self.planner._draft_times[num_requests] = self.planner.cost.draft_time(num_requests)
        return self.planner.scales(num_requests)[1] * (self.planner.verify_time(num_tokens, num_requests) + draft)


def finish_estimate_host(a: np.ndarray, remaining: list[int] | np.ndarray, cost: CostTable | _Prices,
                         budget: int) -> FinishEstimate:
    """``reference.scheduler.finish_estimate(a, remaining, cost, budget)`` in NumPy: the same model and the same
    float64 arithmetic, equal to rounding (sums in another order; ``tests/optimized/test_finish_estimate_host.py``).

    The reference walks the drafting steps one at a time in Python and runs its ``[T, R]`` normal tail through
    torch: at R = 256 (about 130 steps) 2.8 ms on the project's 2-core CPU with the other core busy, more with
    torch's threads contending, between a verify launch and the next. Here the steps' prices are looked up once per
    distinct number of requests left and the tail is computed only where it is below 1 (``erfc`` is exactly 2 below
    −6): 1.6 ms on the same machine, one torch thread.

    Args:
        a: ``[R, γ]`` survivals without NaN (float32 or float64), as the reference's once filled.
        remaining: ``[R]`` tokens each request may still emit (at least 1).
        cost: the prices (``step_time`` of drafting steps, ``verify_time`` of plain ones).
        budget: the drafts ``B`` a step verifies for all ``R`` requests.
    """
    a = np.asarray(a, dtype=np.float32).astype(np.float64)  # [R, γ] as the reference's float32 -> float64
    r, gamma = a.shape
    n = np.asarray(remaining, dtype=np.float64).reshape(-1)  # [R]
    if n.shape[0] != r or not bool((n >= 1).all()):
        got = n.tolist()  # sync: none, host NumPy (an error path)
        raise ValueError(f"remaining must hold one count ≥ 1 per request ({r}), got {got}")
    # allocate_top_b: a stable descending sort of the slot-major candidates (ties: slot, then request ascending)
    order = np.argsort(-a.T.reshape(-1), kind="stable")[:budget]  # [B] flat j·R + r
    lens = np.bincount(order % r, minlength=r)  # [R]
    verified = np.arange(gamma) < lens[:, None]  # [R, γ]
    av = np.where(verified, a, 0.0)  # [R, γ]
    mean = av.sum(axis=1)  # [R] E[A_r]
    second = (av * (2 * np.arange(1, gamma + 1, dtype=np.float64) - 1)).sum(axis=1)  # [R] E[A_r²]
    rate = 1.0 + mean  # [R]
    mu = n / rate  # [R] expected steps to finish
    sigma = np.sqrt(n * np.maximum(second - mean**2, 0.0) / rate**3)  # [R]
    per_request = budget / r

    # Plain: the longest answers set the steps; between two remaining lengths the step prices the requests left.
    plain_s, done, left = 0.0, 0, r
    lengths, counts = np.unique(n, return_counts=True)
    for length, count in zip(lengths.tolist(), counts.tolist()):  # sync: none, host NumPy
        plain_s += (int(length) - done) * cost.verify_time(left, left)
        done, left = int(length), left - count

    # Drafting: step t runs while some F_r > t, priced at the requests expected to be left.
    horizon = int(math.ceil(float((mu + 6 * sigma).max()))) + 1
    spread = np.maximum(sigma, 1e-9)  # [R]
    # Before step `first` every request's tail is below −6 standard scores (a step earlier than needed, for
    # rounding): P(F_r > t) is exactly 1 there for all r, so those steps are the same step, counted at once.
    first = min(horizon, max(0, math.floor(float((mu - 6.0 * math.sqrt(2.0) * spread).min() - 0.5)) - 1))
    t = np.arange(first, horizon, dtype=np.float64)[:, None] + 0.5  # [T', 1]
    x = (t - mu[None, :]) / spread[None, :] / math.sqrt(2.0)  # [T', R]
    unfinished = np.ones_like(x)  # [T', R] P(F_r > t): 0.5·erfc(x), exactly 1 where x < −6
    tail = x >= -6.0
    below = 0.5 * torch.special.erfc(torch.from_numpy(x[tail])).numpy()  # [n] the tail where it is below 1
    unfinished[tail] = below
    one = math.log1p(-(1 - 1e-15))  # log P(F_r ≤ t) where the tail is 1 (clamped, as the reference)
    logs = np.full_like(x, one)  # [T', R]
    logs[tail] = np.log1p(-np.minimum(below, 1 - 1e-15))
    full = 1.0 - math.exp(r * one)  # P(max F > t) while every tail is 1
    some = 1.0 - np.exp(logs.sum(axis=1))  # [T'] P(max F > t)
    live = unfinished.sum(axis=1)  # [T'] expected requests left
    keep = some > 1e-6
    p = some[keep]
    k = np.maximum(1, np.rint(live[keep] / p)).astype(np.int64)  # requests left (round half to even, as round)
    ks, where = np.unique(k, return_inverse=True)
    left_counts = ks.tolist()  # sync: none, host NumPy; one lookup per distinct number of requests left
    prices = np.array([cost.step_time(q + round(q * per_request), q) for q in left_counts])
    speculative_s = float(np.dot(p, prices[where]))
    if first:  # the steps before it: all r requests left
        k_full = max(1, round(r / full))
        speculative_s += first * full * cost.step_time(k_full + round(k_full * per_request), k_full)
    return FinishEstimate(speculative_s, plain_s, first * full + float(some.sum()), int(n.max()))


def step_time_curve(cost: CostTable, first: int, count: int, num_requests: int) -> np.ndarray:
    """``[cost.step_time(n, num_requests) for n in range(first, first + count)]`` as a float64 array, the same floats:
    :func:`verify_time_curve` plus the drafter's time, the sum ``CostTable.step_time`` takes (the planner slices its
    cached verify curves and adds the same term, ``BudgetPlanner._step_times``)."""
    return verify_time_curve(cost, first, count, num_requests) + cost.draft_time(num_requests)  # the same float sum


def verify_time_curve(cost: CostTable, first: int, count: int, num_requests: int) -> np.ndarray:
    """``[cost.verify_time(n, num_requests) for n in range(first, first + count)]`` as a float64 array, the same
    floats. ``num_requests`` matters only through the table's request curve it picks (the smallest measured count ≥
    it, :func:`request_curve`): the rest is the graph staircase and, past it, the eager region's line.

    Asked one lookup at a time, the 1,793 sizes of a budget at R = 256 took 23 ms on the project's 2-core CPU. Here
    the staircases are looked up for all sizes at once (``np.searchsorted`` where ``CostTable.verify_time`` bisects)
    and the same table entries are divided by the same 1e3; only sizes past the largest graph (the eager region,
    interpolated) are asked one by one."""
    ns = np.arange(first, first + count, dtype=np.int64)  # [count] token counts
    verify = np.full(count, np.nan, dtype=np.float64)  # [count] seconds, NaN: not found yet
    verify[ns == 0] = 0.0
    todo = ns > 0  # [count]
    which = request_curve(cost, num_requests)
    if which is not None:  # the curve of the smallest measured r ≥ R, where it reaches
        curve = cost.verify_ms_by_requests[which]
        _staircase(verify, ns, todo, list(curve), curve)
    graph = cost.graph_sizes()
    _staircase(verify, ns, np.isnan(verify), graph, cost.verify_ms)
    for i in np.flatnonzero(np.isnan(verify)).tolist():  # sync: none (host NumPy); past the largest graph, interpolate
        verify[i] = cost.verify_time(int(ns[i]), num_requests)
    return verify


def request_curve(cost: CostTable, num_requests: int) -> int | None:
    """The request count whose verify curve (``cost.verify_ms_by_requests``) a step of ``num_requests`` requests
    reads — the smallest measured count ≥ it, as ``CostTable.verify_time`` picks it — or None (no such curve)."""
    counts = list(cost.verify_ms_by_requests)
    if not counts or num_requests <= 0:
        return None
    j = bisect.bisect_left(counts, num_requests)
    return counts[j] if j < len(counts) else None


def _staircase(out: np.ndarray, ns: np.ndarray, where: np.ndarray, sizes: list[int], ms: dict[int, float]) -> None:
    """``out[i] = ms[s] / 1e3`` for the smallest size ``s ≥ ns[i]`` of ``sizes`` (sorted), where ``where[i]`` and
    such a size exists; ``CostTable.verify_time``'s staircase, vectorised."""
    if not sizes:
        return
    idx = np.searchsorted(np.asarray(sizes, dtype=np.int64), ns, side="left")  # [count] bisect_left
    hit = where & (idx < len(sizes))
    values = np.array([ms[s] for s in sizes], dtype=np.float64) / 1e3  # [len(sizes)] seconds, as verify_time divides
    out[hit] = values[idx[hit]]


def fold_floats(old: list[float], new: list[float], window: float) -> array:
    """``reference.scheduler.fold_recent`` on Python floats, with the float32 results of the engine's NumPy fold: the
    entries of ``old`` (the moving averages, NaN: none yet) and ``new`` (the drafts' survivals) are float32 values,
    and so is ``window``; returns the folded ``array('f')``, ``new`` where ``old`` is NaN.

    Each float32 operation of ``old + (new − old) / window`` is done in float64 and rounded to float32 (storing into
    an ``array('f')`` rounds to nearest): for +, − and ÷ of float32 operands that is the float32 result itself, as
    float64 carries more than 2·24 + 2 bits (double rounding is innocuous then: Figueroa, "When is double rounding
    innocuous?", 1995). ``tests/optimized/test_scheduler_host_fastpath.py`` checks it bit for bit on random floats."""
    diff = array("f", map(operator.sub, new, old))  # float32(new − old)
    step = array("f", map(operator.truediv, diff, itertools.repeat(window)))  # float32(diff / window)
    avg = array("f", map(operator.add, old, step))  # float32(old + step)
    if math.isnan(sum(old)):  # some average is NaN (none yet): the draft itself there (o != o: o is NaN)
        avg = array("f", [n if o != o else a for o, n, a in zip(old, new, avg)])
    return avg


def holdings(seqs: list[Sequence], ahead: int = 0) -> tuple[tuple[int, int], ...]:
    """What the gate's verdict and a budget are planned from: each request and how many drafts it holds (``ahead``
    more). Equal holdings mean equal inputs, so a decision computed earlier for them is the decision now."""
    return tuple([(s.request_id, len(s.survivals) + ahead) for s in seqs])


class DraftGate:
    """Whether the next step drafts (``adaptive`` mode's draft gate): the reference's ``Scheduler.should_draft`` —
    :func:`reference.scheduler.draft_forced`, then ``speculation_pays`` through the :class:`BudgetPlanner` — on each
    request's moving average of its drafts' survivals.

    While the gate is closed nobody drafts, so the inputs repeat: the verdict is reused for as long as the same
    requests hold the same drafts (exactly what re-evaluating would return, without its host cost). That is checked
    without reading the requests: the same request objects in the same order (a pointer comparison), and no draft
    recorded since (:attr:`recorded`; a request's survivals grow only through ``Scheduler.record_drafts``).
    """

    def __init__(self, config: SchedulerConfig, gamma: int, max_num_seqs: int, planner: BudgetPlanner) -> None:
        self.config, self.gamma, self.planner = config, gamma, planner
        self.steps_without_draft = 0  # consecutive steps, up to now, that did not draft
        self._window = np.float32(config.gate_window)  # the moving average's window, as the float32 it divides by
        # (drafts recorded, finishing, the requests, recent survivals, verdict) of the last evaluation
        self._cache: tuple[int, bool, list[Sequence], np.ndarray | None, bool | None] | None = None
        # (survivals, whether they are all NaN) of forced's last all-NaN test, kept for the same survivals object
        self._all_nan: tuple[np.ndarray, bool] | None = None
        # Blocks of drafts recorded so far (Scheduler.record_drafts): the requests' draft counts change only with it.
        self.recorded = 0
        # Per slot: the moving average (NaN before the first draft), how many of the slot's drafts it holds, and whose
        # drafts they are.
        self._recent = np.full((max_num_seqs, gamma), np.nan, dtype=np.float32)  # [S, γ]
        # The same memory as a flat float32 memoryview (never rebind _recent): its items read and write as Python floats
        # (writes round to float32), for the fold of a few requests without NumPy calls (recent_survivals).
        self._recent_floats = memoryview(self._recent.reshape(-1))  # [S·γ] 'f'
        self._count = [0] * max_num_seqs
        self._owner: list[Sequence | None] = [None] * max_num_seqs
        # With ``track`` (the finish-time gate on): per slot, the sum and the sum of squares of every draft's
        # survivals folded since, and their count, [S, 2γ + 1] float64, for the finish-time estimate's per-request
        # means and their noise (reference.scheduler.finish_survivals). Off, the fold skips it (one indexed add of
        # [R, 2γ + 1] a step: ~18 µs at R = 256 on the project's CPU).
        self.track = False
        self._moments = np.zeros((max_num_seqs, 2 * gamma + 1))
        # ... and, with ``outcomes`` on too, per slot, its verified drafts' outcomes against their forecast
        # (reference.scheduler.outcome_row summed: steps, Σe, Σx, Σe², Σx², Σe·x), for per-request factors of the
        # estimate's survivals (outcome_factors). Off by default: on an H100 in bf16 (docs/benchmarks/
        # finish-estimate-h100.json) they moved the estimate's expected/taken steps from 1.09 to 1.06 after four drafts
        # and not at all after eight, while the finish-time gate they fed decoded one request at a time 10% slower
        # (engine-h100-gc-freeze.json: 1,659 against 1,847 tokens/s without the gate).
        self.outcomes = False
        self._outcomes = np.zeros((max_num_seqs, OUTCOME_COLUMNS))
        self._slot_k = np.arange(1, gamma + 1)  # [γ] k = 1..γ
        # When a list: every fresh verdict appends (R, best Θ, Θ_plain, margin, verdict) — a diagnostic for
        # benchmarks (scripts/bench_engine.py --gate-trace), computed only then.
        self.trace: list[tuple[int, float, float, float, bool]] | None = None
        # The finish-time gate (EngineConfig.finish_time_gate): set by the scheduler while no request waits in an
        # offline batch; the verdict then weighs the time to finish the running requests (reference.scheduler.
        # finish_estimate), kept for FINISH_REUSE evaluations while the batch keeps most of its requests.
        self.finishing = False
        # (R estimated at, verdict, evaluations it still answers, whether it read stand-in rows of the history)
        self._finish: tuple[int, bool, int, bool] | None = None
        # With ``track``: the mean survivals of requests that left their slots after at least gate_window drafts, the
        # last HISTORY of them: stand-ins for the requests of a finishing batch that have not drafted enough yet
        # (reference.scheduler.population_rows), once there are PRIOR_MIN.
        self.history: deque[np.ndarray] = deque(maxlen=self.HISTORY)
        self._ranked: np.ndarray | None = None  # [H, γ] the history ranked slowest first (None: changed since)
        # When a list: every fresh finish-time verdict appends (R, FinishEstimate, margin, verdict), as ``trace``; its
        # margin is 0.0 (finish_pays without one: _finish_verdict).
        self.finish_trace: list[tuple[int, FinishEstimate, float, bool]] | None = None

    # A finish-time verdict answers this many evaluations while the batch keeps all but 1/FINISH_BAND of the requests
    # it was estimated for (below FINISH_BAND requests: all of them): a drafting batch changes its survivals every
    # step and, once its first requests are done, its size too, and an estimate (finish_estimate_host: about 1.6 ms
    # of host time at 256 requests on the project's 2-core CPU with its other core busy, the reference's 2.8 ms)
    # need not follow each. Re-estimated whenever the size changed, a draining
    # batch made an estimate nearly every step, between the verify launch and the draft launch (on an H200,
    # scripts/bench_engine.py --gate-trace: 105 estimates in 101 steps at batch 64, 130 in 119 at 256).
    FINISH_REUSE = 8
    FINISH_BAND = 8
    # The finish-time gate judges a batch that has not drafted from the requests before it once it has seen this many
    # (a batch of 64 then takes a row of every ~2nd quantile), out of the last HISTORY.
    PRIOR_MIN = 32
    HISTORY = 1024
    # Up to this many survivals R·γ a step's fold runs on Python floats (fold_floats) rather than in NumPy: a NumPy
    # call costs several µs on a host whose caches the forwards evicted, a Python float a fraction of one; the two
    # broke even near R = 8 at γ = 7 on the project's 2-core CPU (DraftGate._fold_floats).
    PYTHON_MAX_FOLD = 64

    @property
    def active(self) -> bool:
        return self.config.mode.has_draft_gate and self.config.draft_gate

    def forget_verdict(self) -> None:
        """Drop the cached verdict (the prices changed): the next decision weighs the costs again."""
        self._cache = self._finish = None

    def reset(self, config: SchedulerConfig, planner: BudgetPlanner) -> None:
        """A new policy or cost table: forget the cached verdict and the plain-step count, as a new reference
        ``Scheduler`` would (the per-slot averages stay valid: they depend on the drafts only)."""
        self.config, self.planner, self._cache, self.steps_without_draft = config, planner, None, 0
        self._finish = None
        self._window = np.float32(config.gate_window)

    def decide(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` (the next step's decoding requests) draft; counts the plain steps."""
        if not self.active:
            return True
        recent, verdict = self._evaluate(seqs)
        if self.finishing and verdict is not None:
            # Finishing an offline batch: the verdict holds for as long as it says. Nothing probes: the requests'
            # survivals can only go stale with their contexts, and the estimate already priced every step to the end.
            # (Before every request has drafted gate_window times, the verdict is the ordinary gate's, or one on
            # stand-ins from the history once the gate has one: DraftGate.prior_survivals.)
            drafts = verdict
        else:
            # The reference's ``draft_forced(...) or verdict`` in the other order (the same boolean): a paying verdict
            # drafts whatever draft_forced says, so its rules run only when the cost says no, or nothing is known yet
            # (every step while the gate is closed: NumPy on the host array, not torch, ~10x cheaper at R = 256).
            drafts = verdict or self.forced(recent)
        if drafts and self.steps_without_draft:  # a draft after plain steps restarts the moving averages (as
            # reference.generate.step): every recorded draft is folded, the next one folds as the first
            self._recent[[s.slot for s in seqs]] = np.nan
        self.steps_without_draft = 0 if drafts else self.steps_without_draft + 1
        return drafts

    def forced(self, recent: np.ndarray | None) -> bool:
        """``reference.scheduler.draft_forced`` on the recent survivals ``recent`` (``[R, γ]`` host float32 or None)
        and this gate's count of plain steps: the same rules in the same order, in NumPy. They run every step while
        the gate is closed, on the same (cached) survivals: their all-NaN test is kept for that array object (the
        survivals are fresh arrays, never written after the evaluation that made them)."""
        config = self.config
        if not (config.mode.has_draft_gate and config.draft_gate):
            return True
        if recent is None or self.steps_without_draft >= config.probe_every:
            return True
        if self._all_nan is None or self._all_nan[0] is not recent:
            self._all_nan = (recent, bool(np.isnan(recent).all()))
        return self._all_nan[1]

    def prepare(self, seqs: list[Sequence]) -> bool | None:
        """The cost's verdict for ``seqs`` ahead of :meth:`decide` (which then reuses it if the same requests hold the
        same drafts): whether speculation pays, None when the gate is off or nobody has drafted. Changes no count."""
        return self._evaluate(seqs)[1] if self.active else None

    def _evaluate(self, seqs: list[Sequence]) -> tuple[np.ndarray | None, bool | None]:
        """The recent survivals of ``seqs`` and the cost's verdict on them, cached while the inputs repeat: the same
        requests (the same objects, in the same order), no draft recorded since, the same ``finishing``. At R = 256
        the check compares 256 pointers; building each request's (id, draft count) and comparing them cost about
        0.2 ms a step on the project's CPU, and an H100 host spent 0.33 ms a step planning such a step against
        0.06 ms for plain decoding (docs/benchmarks/engine-host-h100.json)."""
        cache = self._cache
        if (cache is None or cache[0] != self.recorded or cache[1] != self.finishing or len(cache[2]) != len(seqs)
                or not all(map(operator.is_, cache[2], seqs))):
            recent = self.recent_survivals(seqs)  # [R, γ] host float32, or None
            margin = gate_margin(self.config, len(seqs))
            # A batch's finish time is judged on a few drafts of every request (the moving average's window): one
            # draft's survivals are noisy, and a finishing batch's plain verdict stands until the batch changes.
            finishing = self.finishing and recent is not None and min(
                self._count[s.slot] for s in seqs) >= self.config.gate_window
            # ... or, before that, on stand-ins from the requests it has seen finish (their spread is what prices the
            # slowest request), so that a batch plain decoding finishes sooner does not draft to find that out.
            prior = self.finishing and not finishing and len(self.history) >= self.PRIOR_MIN
            if finishing or prior:
                verdict = self._finish_verdict(seqs, recent, prior=prior)
            elif recent is None:
                verdict = None
            else:
                verdict = self.planner.speculation_pays(recent, len(seqs), None, margin, check=False)
            if self.trace is not None and recent is not None and not (finishing or prior):
                best, plain = self.planner.gate_estimates(recent, len(seqs))
                self.trace.append((len(seqs), best, plain, margin, bool(verdict)))
            self._cache = (self.recorded, self.finishing, list(seqs), recent, verdict)
        return self._cache[3], self._cache[4]

    def _finish_verdict(self, seqs: list[Sequence], recent: np.ndarray | None, prior: bool = False) -> bool:
        """Whether drafting finishes the running requests sooner than plain decoding (``finish_pays``, without the
        ordinary gate's margin: that margin leans towards drafting because a wrong close lasts until the next probe
        while a wrong open is undone at the next step, and a finish-time verdict, either way, stands without probes
        until it is re-estimated. On an H100 a closed batch of 64 sat that close to break-even: its estimate put
        drafting at 1.08 times plain decoding's time with a margin of 0.04 (docs/benchmarks/gate-trace-prior-h100.json),
        and runs whose measured prices moved it inside the margin drafted throughout and took 1.13 times as long as
        plain decoding (docs/benchmarks/engine-h100-async-all.json)), re-estimated
        after ``FINISH_REUSE`` evaluations or once the batch has lost more than 1/``FINISH_BAND`` of the requests
        it was estimated for (any request below ``FINISH_BAND`` requests), or grown. With ``prior``, the rows of
        requests with fewer than gate_window drafts are stand-ins from :attr:`history` (:meth:`prior_survivals`),
        and a verdict estimated so does not answer for a batch whose every request has drafted enough."""
        r = len(seqs)
        if self._finish is not None:
            r_est, verdict, left, was_prior = self._finish
            if left > 0 and r_est - r_est // self.FINISH_BAND <= r <= r_est and was_prior == prior:
                self._finish = (r_est, verdict, left - 1, prior)
                return verdict
        remaining = [max(1, s.params.max_new_tokens - len(s.output_ids)) for s in seqs]
        rows = self.prior_survivals(seqs) if prior else self.finish_survivals(seqs, recent)
        estimate = self.planner.finish_estimate(rows, remaining)
        verdict = finish_pays(estimate)
        if self.finish_trace is not None:
            self.finish_trace.append((r, estimate, 0.0, verdict))
        self._finish = (r, verdict, self.FINISH_REUSE - 1, prior)
        return verdict

    def prior_survivals(self, seqs: list[Sequence]) -> np.ndarray:
        """The finish-time estimate's rows for a batch some of whose requests have drafted fewer than gate_window
        times: each of the others its mean over all its drafts, each of those a stand-in from the requests seen
        finish (``reference.scheduler.population_rows`` of :attr:`history`, as many as there are such requests).
        ``[R, γ]`` float32."""
        g = self.gamma
        moments = self._moments[np.array([s.slot for s in seqs], dtype=np.intp)]  # [R, 2γ + 1]
        n = moments[:, 2 * g]  # [R] drafts summed
        own = n >= self.config.gate_window
        rows = np.empty((len(seqs), g), dtype=np.float32)
        rows[own] = moments[own, :g] / n[own, None]
        new = np.flatnonzero(~own)
        if new.size:
            rows[new] = self._stand_ins(int(new.size))
        return rows

    def _stand_ins(self, count: int) -> np.ndarray:
        """``reference.scheduler.population_rows(history, count)`` ``[count, γ]`` float32, the same rows: the history
        ranked once until it changes (stacking and sorting 1,024 rows took ~0.7 ms on the project's CPU, and a
        finishing batch asks again each time one of its requests finishes), then the same quantile picks."""
        if self._ranked is None:
            # population_rows of the whole history is the history ranked, slowest first
            self._ranked = population_rows(torch.from_numpy(np.stack(self.history)), len(self.history)).numpy()
        h = self._ranked.shape[0]
        picks = np.minimum(((np.arange(count, dtype=np.float64) + 0.5) * h / max(count, 1)).astype(np.int64), h - 1)
        return self._ranked[picks]  # [count, γ]

    def _claim(self, slot: int, seq: Sequence) -> None:
        """``slot`` changed hands: what was kept of its previous request is forgotten, after its mean survivals join
        :attr:`history` (while ``track``, if it drafted at least gate_window times)."""
        n = self._moments[slot, 2 * self.gamma]
        if self.track and self._owner[slot] is not None and n >= self.config.gate_window:
            self.history.append((self._moments[slot, :self.gamma] / n).astype(np.float32))
            self._ranked = None
        self._owner[slot], self._count[slot] = seq, 0
        self._recent[slot] = np.nan
        self._moments[slot] = 0.0
        self._outcomes[slot] = 0.0

    def record_outcomes(self, seqs: list[Sequence], survivals: list, verified: list[int] | None,
                        accepted: list[int]) -> None:
        """One read step's verified drafts into their requests' outcome sums (only while ``track``): each request's
        forecast survivals of the draft it verified (None: it verified none), its verify length ℓ and the drafts
        accepted. The rows of ``reference.scheduler.outcome_row``, summed in one indexed add."""
        if not (self.track and self.outcomes) or not verified:
            return
        idx = [i for i, n in enumerate(verified) if n and survivals[i] is not None]
        if not idx:
            return
        owner = self._owner
        for i in idx:
            if owner[seqs[i].slot] is not seqs[i]:
                self._claim(seqs[i].slot, seqs[i])
        rows = np.array([seqs[i].slot for i in idx], dtype=np.intp)  # [n] distinct slots
        a = np.asarray([survivals[i] for i in idx], dtype=np.float64)  # [n, γ]
        lengths = np.asarray([verified[i] for i in idx])[:, None]  # [n, 1]
        e = np.where(self._slot_k <= lengths, a, 0.0).sum(axis=1)  # [n] expected accepted
        x = np.asarray([accepted[i] for i in idx], dtype=np.float64)  # [n]
        self._outcomes[rows] += np.stack([np.ones_like(e), e, x, e * e, x * x, e * x], axis=1)

    def finish_survivals(self, seqs: list[Sequence], recent: np.ndarray, outcomes: bool | None = None) -> np.ndarray:
        """The survivals the finish-time estimate reads for ``seqs``, whose moving averages :meth:`recent_survivals`
        has just returned as ``recent``: each request's mean over all its drafts since ``track`` was set, pooled
        towards the batch's by ``reference.scheduler.finish_survivals``, times its factor between the drafts it had
        accepted and those forecast (``reference.scheduler.outcome_factors``) where ``outcomes`` (default: the gate's
        :attr:`outcomes`) says so; ``recent`` itself while a request has none tracked. ``[R, γ]`` float32."""
        g = self.gamma
        moments = self._moments[np.array([s.slot for s in seqs], dtype=np.intp)]  # [R, 2γ + 1]
        n = moments[:, 2 * g]  # [R] drafts summed
        if not self.track or (n < 1).any():
            return recent
        mean = moments[:, :g] / n[:, None]  # [R, γ]
        var = (moments[:, g:2 * g] - n[:, None] * mean * mean) / np.maximum(n - 1.0, 1.0)[:, None]  # [R, γ] ddof 1
        rows = finish_survivals(torch.from_numpy(mean), torch.from_numpy(np.maximum(var, 0.0)), torch.from_numpy(n))
        sums = self._outcomes[np.array([s.slot for s in seqs], dtype=np.intp)]  # [R, 6]
        if (self.outcomes if outcomes is None else outcomes) and sums[:, 0].sum() > 0:  # forecasts against outcomes
            factors = outcome_factors(torch.from_numpy(sums), relative=self.planner.survival_scale is not None)
            rows = calibrate_rows(rows, factors)
        return rows.numpy()

    def recent_survivals(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Each request's moving average of its drafts' survivals (``reference.scheduler.fold_recent``), kept per slot
        and folded for all requests with a new draft at once in one ``[S, γ]`` array: ``[R, γ]`` float32 (a fresh
        array), or None when none has drafted. NumPy float32: the same IEEE operations as the reference's torch
        ones. The rows folded here were copied to the host by earlier steps' drafts, and this step's token read has
        synchronised since, so they have landed. (Per-slot rows in Python lists cost 280 µs a step at R = 256 on
        the project's CPU, ``scripts/bench_host.py``; the array, one pass over the requests and one fold, less.)
        A fold of at most ``PYTHON_MAX_FOLD`` survivals runs on Python floats instead (:meth:`_fold_floats`): the
        same float32 results, without NumPy's per-call cost, which dominates at a few requests."""
        owner, count, recent = self._owner, self._count, self._recent
        # One pass over the requests (at R = 256 each pass of Python over them costs tens of µs): a slot that changed
        # hands starts afresh, and each request's next unfolded draft is picked up.
        slots, todo, new_rows = [], [], []
        for s in seqs:
            slot = s.slot
            if owner[slot] is not s:
                self._claim(slot, s)
            slots.append(slot)
            if count[slot] < len(s.survivals):
                todo.append(s)
                new_rows.append(s.survivals[count[slot]])
        everybody, passes, folded = len(todo) == len(seqs), 0, None
        while todo:  # normally one pass: a request drafts at most once between two gates
            if len(todo) * self.gamma <= self.PYTHON_MAX_FOLD and not self.track:
                folded = self._fold_floats([s.slot for s in todo], new_rows)  # [n, γ] float32, the same floats
            else:
                rows = np.array([s.slot for s in todo], dtype=np.intp)  # [n] distinct slots
                new = np.array(new_rows)  # [n, γ] float32
                old = recent[rows]  # [n, γ]
                # fold_recent: the draft itself where there is no average yet (NaN), else old + (new - old) / window
                folded = np.where(np.isnan(old), new, old + (new - old) / self._window)  # [n, γ] float32
                recent[rows] = folded
                if self.track:  # one indexed add
                    wide = new.astype(np.float64)  # [n, γ]
                    self._moments[rows] += np.concatenate([wide, wide * wide, np.ones((len(rows), 1))], axis=1)
            passes += 1
            later, new_rows = [], []
            for s in todo:
                count[s.slot] += 1
                if count[s.slot] < len(s.survivals):
                    later.append(s)
                    new_rows.append(s.survivals[count[s.slot]])
            todo = later
        if passes == 1 and everybody:  # the usual step: every request folded one draft, in order
            return folded  # [R, γ] the very rows asked for
        if all(count[slot] == 0 for slot in slots):
            return None
        return recent[np.array(slots, dtype=np.intp)]  # [R, γ] a copy

    def _fold_floats(self, slots: list[int], new_rows: list) -> np.ndarray:
        """The NumPy fold of :meth:`recent_survivals` for a few requests (``slots``, distinct, and their drafts'
        float32 rows ``new_rows``), on Python floats: :func:`fold_floats`, the same float32 results. In the engine
        (caches cold after the forwards) the NumPy fold's nine calls made :meth:`recent_survivals` take ~54 µs of the
        gate's ~93 µs at R = 1 on the project's 2-core CPU; this takes it to ~30 µs, and at R = 8 (56 survivals)
        both cost about the same (``scripts/bench_host.py``), hence ``PYTHON_MAX_FOLD``. Each average is read and
        written through the flat float32 view of ``_recent``. Returns the folded ``[n, γ]`` rows (a fresh array)."""
        g, flat, old, new = self.gamma, self._recent_floats, [], []
        for slot, row in zip(slots, new_rows):
            old += flat[slot * g:(slot + 1) * g].tolist()  # sync: none, a host memoryview; [γ] the average
            new += row.tolist()  # sync: none, host NumPy (a landed host copy: see recent_survivals); [γ]
        folded = fold_floats(old, new, float(self._window))  # [n·γ] array('f')
        for i, slot in enumerate(slots):
            flat[slot * g:(slot + 1) * g] = folded[i * g:(i + 1) * g]  # the same float32 bits
        return np.frombuffer(folded, dtype=np.float32).reshape(len(slots), g)  # [n, γ] over the fresh array's memory


class Scheduler:
    """Admission, chunked prefill, verify planning, finishing and the draft gate over ``max_num_seqs`` slots.

    Args:
        config: the verify-length policy (``Engine.set_scheduler`` may replace it between runs).
        gamma: the drafter's block size γ (0 without a drafter).
        max_num_seqs, max_seq_len, prefill_chunk: the engine's sizes (``EngineConfig``).
        cost: the step-cost table (modes whose ``needs_cost_table`` is set cannot plan without it).
        eos_token_ids: tokens that finish a request (unless it ignores EOS).
        tokenizer: decodes outputs for stop strings (None: stop strings are not checked).
    """

    def __init__(self, config: SchedulerConfig, *, gamma: int, max_num_seqs: int, max_seq_len: int,
                 prefill_chunk: int, cost: CostTable | None = None, eos_token_ids=(), tokenizer=None) -> None:
        self.gamma, self.max_num_seqs, self.max_seq_len = gamma, max_num_seqs, max_seq_len
        self.prefill_chunk = prefill_chunk  # prompt tokens per step over all prefilling sequences
        self.eos = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in order of admission
        self.free_slots = list(range(max_num_seqs))[::-1]
        self.drafted = True  # whether the current decoding requests hold drafts (the draft gate may skip a step)
        self.config, self.cost = config, cost
        self.planner = BudgetPlanner(cost)
        self.policy = self._policy()
        self.gate = DraftGate(config, gamma, max_num_seqs, self.planner)
        self._nan_row = np.full(gamma, np.nan, dtype=np.float32)  # [γ] the stale row of a request too new for one
        # The next step's budget, planned ahead by plan_ahead: ((request id, drafts held) of each request, B, the
        # stale survivals it was planned on)
        self._ahead: tuple[tuple[tuple[int, int], ...], int, np.ndarray] | None = None
        self.ahead_hits = 0  # steps whose budget was planned ahead (for tests and benchmarks)
        # An offline batch (EngineConfig.finish_time_gate): once no request waits, the draft gate weighs the time to
        # finish the running requests instead of one step's throughput (DraftGate.finishing).
        self.finish_time_gate = False

    @property
    def finish_time_gate(self) -> bool:
        """Whether the draft gate weighs an offline batch's finish time once no request waits (and, from when it is
        set, keeps the statistics of every draft that the estimate reads: ``DraftGate.track``)."""
        return self.gate.track

    @finish_time_gate.setter
    def finish_time_gate(self, on: bool) -> None:
        self.gate.track = bool(on)

    # ------------------------------------------------------------------------------------------------ configuration

    def _policy(self) -> Policy | None:
        """The reference policy for the host-side rules; None while a mode that needs a cost table has none."""
        if self.config.mode.needs_cost_table and self.cost is None:
            return None
        return Policy(self.config, gamma=self.gamma, cost=self.cost)

    @property
    def ready(self) -> bool:
        """Whether steps can be planned (a mode that needs a cost table has one)."""
        return self.policy is not None

    def set_cost_table(self, cost: CostTable) -> None:
        self.cost, self.planner, self._ahead = cost, BudgetPlanner(cost), None
        self.policy = self._policy()
        self.gate.reset(self.config, self.planner)

    def set_config(self, config: SchedulerConfig) -> None:
        self.config, self._ahead = config, None
        self.policy = self._policy()
        self.gate.reset(config, self.planner)

    def set_price_scales(self, scales: dict[int, dict[str, float]]) -> None:
        """Price plain and speculative steps at these multiples of the cost table's prices, per batch-size bucket
        (``optimized.cost_monitor.request_bucket`` -> ``{"plain": s_plain, "speculative": s_spec}``, a kind left out
        at 1.0; the engine's measured ratios, ``optimized/cost_monitor.py``): at R requests the draft gate weighs
        Θ_plain / s_plain against Θ(B) / s_spec of R's bucket, and a bucket left out is priced at the table's. The
        budget is unchanged by them (every Θ(B) scales alike); the gate's cached verdict is dropped, its plain-step
        count kept."""
        table = {}
        for bucket, kinds in scales.items():
            plain, speculative = kinds.get("plain", 1.0), kinds.get("speculative", 1.0)
            if not (plain > 0 and speculative > 0):
                raise ValueError(f"price scales must be positive, got {plain} and {speculative} at {bucket} requests")
            table[request_bucket(bucket)] = (float(plain), float(speculative))
        self.planner.price_scales = table
        self.gate.forget_verdict()

    def set_survival_scale(self, factors: np.ndarray | None) -> None:
        """Plan with the drafts' survivals times these per-slot factors (``[γ]``, positive; the engine's measured
        outcome over forecast, ``optimized/acceptance_monitor.py``), capped at 1 and non-increasing; None: as they are.
        The budget and the draft gate both see them; the gate's cached verdict is dropped."""
        if factors is not None:
            factors = np.asarray(factors, dtype=np.float64)
            if factors.ndim != 1 or not (factors > 0).all():
                raise ValueError(f"survival factors must be a positive [γ] vector, got {factors!r}")
        self.planner.survival_scale = factors
        self.gate.forget_verdict()

    # ------------------------------------------------------------------------------------------------ requests

    def add(self, seq: Sequence) -> None:
        if len(seq.prompt_ids) + 1 > self.max_seq_len:
            raise ValueError(f"prompt of {len(seq.prompt_ids)} tokens does not fit max_seq_len {self.max_seq_len}")
        self.waiting.append(seq)

    def abort(self, request_id: int) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decoding(self) -> list[Sequence]:
        decode = Status.DECODE  # a local: the comprehension runs over every running request
        return [s for s in self.running if s.status is decode]

    # ------------------------------------------------------------------------------------------------ planning

    def schedule(self, exclude: set[int] | None = None, ahead: int = 0) -> StepPlan:
        """Admit, choose the prompt chunks, and plan the verify of the decoding requests (never waits for a device).

        For an engine running one step ahead of its token reads (``EngineConfig.async_decode``): ``exclude`` leaves
        out decoding requests (by ``id``) that the step still in flight surely finishes, and ``ahead = 1`` says that
        the drafts these requests verify now have not been recorded yet (their survivals are still on their way to the
        host), so the stale survivals sit one place nearer the end of each request's list (:meth:`_stale_survivals`)."""
        while self.waiting and self.free_slots:  # first come, first served
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.free_slots.pop(), Status.PREFILL
            self.running.append(seq)
        chunks, room, decoding = [], self.prefill_chunk, []
        for seq in self.running:
            if seq.status is Status.DECODE:
                if not exclude or id(seq) not in exclude:
                    decoding.append(seq)
            elif seq.status is Status.PREFILL and room > 0:
                n = min(len(seq.prompt_ids) - seq.num_prefilled, room)
                chunks.append(PrefillChunk(seq, seq.num_prefilled, n))
                seq.num_prefilled += n
                room -= n
        return self._plan_verify(chunks, decoding, ahead)

    def _plan_verify(self, chunks: list[PrefillChunk], decoding: list[Sequence], unrecorded: int = 0) -> StepPlan:
        r, mode = len(decoding), self.config.mode
        ahead, self._ahead = self._ahead, None  # a budget planned ahead lives until the very next schedule
        if not decoding:
            return StepPlan(chunks, decoding, mode)
        if not (mode.drafts and self.drafted):  # no drafter, or the draft gate closed: ordinary decoding
            return StepPlan(chunks, decoding, SchedulingMode.NONE, lengths=[0] * r)
        if mode is SchedulingMode.ADAPTIVE:
            if not unrecorded and ahead is not None and ahead[0] == holdings(decoding):  # planned during the verify
                self.ahead_hits += 1
                self.planner.note_stale(ahead[2])
                return StepPlan(chunks, decoding, mode, budget=ahead[1])
            stale = self._stale_survivals(decoding, ahead=unrecorded)  # [R, γ] host copy, NaN rows = too new
            # The engine's own survivals (no range or monotonicity check: they hold by construction).
            budget = self.planner.stale_budget(stale, num_anchor_tokens=r, num_requests=r, check=False)
            return StepPlan(chunks, decoding, mode, budget=budget)
        if mode in (SchedulingMode.FIXED, SchedulingMode.DSD):  # the n-gram proposer's blocks may be shorter
            k = self.policy.uniform_length(r)
            return StepPlan(chunks, decoding, mode, lengths=[k if s.proposal_len is None else min(k, s.proposal_len)
                                                             for s in decoding])
        if mode is SchedulingMode.ORACLE:  # verify everything; the recorded length is cut to the outcome later
            return StepPlan(chunks, decoding, mode, lengths=[self.gamma] * r)
        return StepPlan(chunks, decoding, mode)  # synchronous: lengths after the current survivals are read

    def synchronous_lengths(self, plan: StepPlan, a_current: torch.Tensor) -> None:
        """ℓ of a synchronous policy (``threshold``, ``adaptive-sync``) from this step's survivals ``[R, γ]`` (host)."""
        r = len(plan.decoding)
        lengths = self.policy.lengths(a_current, a_stale=None, num_anchor_tokens=r)  # [R] host
        plan.lengths = lengths.tolist()  # sync: none, a_current is on the host (runner.current_survivals waited)
        if any(s.proposal_len is not None for s in plan.decoding):  # the hybrid's n-gram blocks: ℓ ≤ m
            plan.lengths = [n if s.proposal_len is None else min(n, s.proposal_len)
                            for n, s in zip(plan.lengths, plan.decoding)]

    def _stale_survivals(self, decoding: list[Sequence], ahead: int = 0) -> np.ndarray:
        """``[R, γ]``: each request's survivals ``staleness`` drafts before its current one (NaN when too new), or,
        with ``ahead = 1``, what that will be once every request has drafted once more — which is also the row of the
        current draft's stale survivals while that draft is not recorded yet (an engine one step ahead)."""
        k = self.config.staleness - ahead
        # seq.survivals[-1] is the current draft (k = 0 reads it); the reference appends it after reading the stale row.
        return np.array([s.survivals[-(k + 1)] if len(s.survivals) > k else self._nan_row for s in decoding])

    def plan_ahead(self) -> bool:
        """Plan while the device verifies (the host would otherwise wait for the token read): the draft gate's
        verdict for the requests decoding now and, where they will draft, the next step's budget — from survivals
        already on the host (the runner waited for the last draft's copy). Both are pure functions of inputs that
        the verify does not change, so :meth:`drafters` and the next :meth:`schedule` reuse them exactly when their
        inputs are these (nobody finished, nobody new): the same decisions, off the critical path.

        Returns whether the requests decoding now will draft after this step unless some of them finish in it: the
        mode drafts and the gate is off or its cost says speculation pays (not when only a probe would draft)."""
        self._ahead = None
        seqs = self.decoding()
        if not seqs or not self.config.mode.drafts:
            return False
        self.gate.finishing = self._finishing(seqs)
        verdict = self.gate.prepare(seqs)  # cached for drafters(); None: gate off, or nothing known yet
        # The budget reads drafts `staleness` old, so with staleness ≥ 1 it is known before the next draft lands.
        if self.config.mode is SchedulingMode.ADAPTIVE and self.config.staleness > 0 and verdict is not False:
            stale = self._stale_survivals(seqs, ahead=1)  # [R, γ] the next step's stale rows
            r = len(seqs)
            self._ahead = (holdings(seqs, ahead=1),
                           self.planner.stale_budget(stale, num_anchor_tokens=r, num_requests=r, check=False,
                                                     record=False), stale)
        return verdict is True or not self.gate.active

    # ------------------------------------------------------------------------------------------------ after the device

    def postprocess(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list[float]] | None,
                    verified: list[int] | None = None,
                    top_logprobs: list[list[list[tuple[int, float]]] | None] | None = None) -> list[StepOutput]:
        """Commit each sequence's emitted tokens (and, for a verify step, its ℓ and accepted count).

        A request without logprobs or stop strings (the common case) is committed at once, inline, to the same effect
        as :meth:`_emit_each`'s token-by-token loop: at R = 256 this loop is a large part of a plain step's host time
        (two calls a request cost about a third more), and a plain step of a small target there waits for its host."""
        outputs = []
        append = outputs.append
        decode, eos, stops = Status.DECODE, self.eos, self.tokenizer is not None
        room = self.max_seq_len - self.gamma - 1  # the anchor after the k-th token must stay below this (slot_full)
        for i, seq in enumerate(seqs):
            new = tokens[i]
            if verified is None:  # the first token after the prompt: the sequence starts decoding
                seq.status = decode
            else:
                seq.verify_lengths.append(verified[i])
                seq.accepted_lengths.append(len(new) - 1)
            lp = logprobs[i] if logprobs is not None else []
            top = top_logprobs[i] if top_logprobs is not None else None
            params = seq.params
            if lp or top or (params.stop and stops):
                append(self._emit_each(seq, new, lp, top))
                continue
            # At once: the first token that finishes the request is the last kept (EOS, then the length limit — the
            # k-th token for k ≥ limit: len(out) + k ≥ max_new_tokens, or the anchor len(prompt) + len(out) + k - 1
            # fills the slot — as _emit_each checks them; EOS at the same token wins).
            out = seq.output_ids
            cut, reason = len(new), None
            limit = min(params.max_new_tokens - len(out), room - len(seq.prompt_ids) - len(out))
            if limit < 1:
                limit = 1
            if not params.ignore_eos and eos and not eos.isdisjoint(new):
                cut, reason = next(j for j, t in enumerate(new) if t in eos) + 1, "stop"
            if limit < cut or (reason is None and limit == cut):
                cut, reason = limit, "length"
            new = new[:cut]
            out.extend(new)
            if reason is not None:
                self.finish(seq, reason)
            append(StepOutput(seq.request_id, new, seq.status is Status.FINISHED, seq.finish_reason, [], []))
        return outputs

    def _emit_each(self, seq: Sequence, tokens: list[int], logprobs: list[float],
                   top: list[list[tuple[int, float]]] | None = None) -> StepOutput:
        """Append one request's emitted tokens one by one (logprobs to keep, stop strings to look for), stopping at the
        first that finishes it: EOS (later tokens dropped), then the length limit, then the end of the slot, then a stop
        string. :meth:`postprocess` commits a request without logprobs or stop strings at once, to the same effect."""
        new, new_lp, new_top = [], [], []
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            new.append(tok)
            if logprobs:
                seq.logprobs.append(logprobs[i])
                new_lp.append(logprobs[i])
            if top:
                seq.top_logprobs.append(top[i])
                new_top.append(top[i])
            reason = None
            if not seq.params.ignore_eos and tok in self.eos:
                reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens:
                reason = "length"
            elif self.slot_full(seq.anchor_pos):
                reason = "length"  # the next block would not fit the slot
            if reason is None and seq.params.stop and self.tokenizer is not None and self._hit_stop(seq):
                reason = "stop"
            if reason is not None:
                self.finish(seq, reason)
                break
        return StepOutput(seq.request_id, new, seq.finished, seq.finish_reason, new_lp, new_top)

    def slot_full(self, anchor_pos: int) -> bool:
        """Whether a request whose anchor sits at ``anchor_pos`` is finished by its slot: the next block (the anchor and
        γ drafts, then the bonus position) would not fit in ``max_seq_len``."""
        return anchor_pos + self.gamma + 2 >= self.max_seq_len

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return any(s in text for s in seq.params.stop)

    def _finishing(self, seqs: list[Sequence]) -> bool:
        """Whether the draft gate weighs finish times for ``seqs``: the finish-time gate is on, no request waits, and
        there are two requests or more. One request's finish time is its own rate over its remaining tokens, which
        the ordinary gate already weighs — and it probes again when that rate changes within the answer, where a
        finish-time verdict would stand to the end (on an H100 the finish-time gate decoded one request at a time
        10% slower than the ordinary gate: docs/benchmarks/engine-h100-gc-freeze.json)."""
        return self.finish_time_gate and not self.waiting and len(seqs) > 1

    def drafters(self, seqs: list[Sequence] | None = None) -> list[Sequence]:
        """The requests that draft at the end of this step for the next one: every decoding request (or ``seqs``, an
        engine one step ahead drafting before its read), or nobody when the draft gate closes (or there is no
        drafter)."""
        if seqs is None:
            seqs = self.decoding()
        seqs = seqs if self.config.mode.drafts else []
        self.gate.finishing = self._finishing(seqs)
        self.drafted = bool(seqs) and self.gate.decide(seqs)
        return seqs if self.drafted else []

    def record_drafts(self, seqs: list[Sequence], survivals: torch.Tensor | list[np.ndarray]) -> None:
        """Keep each request's host copy ``[γ]`` of its new draft's survivals (for the stale budget and the gate).

        Kept as NumPy row views of the ``[R, γ]`` host tensor (or the given rows): the planning reads them with
        NumPy, and a view neither copies nor reads the data, which with a non-blocking copy may still be landing (it
        has by the next step's token read, before anything reads it)."""
        rows = survivals.numpy() if isinstance(survivals, torch.Tensor) else survivals
        for seq, row in zip(seqs, rows):  # R row views of the one [R, γ] array
            seq.survivals.append(row)
        self.gate.recorded += 1  # the draft gate's cached verdict no longer answers for these requests

    @staticmethod
    def record_proposals(seqs: list[Sequence], lengths: list[int | None]) -> None:
        """Keep each request's n-gram proposal length ``m_r`` (its verify length is clipped to it; None: a full γ
        block, the hybrid proposer's DSpark blocks)."""
        for seq, m in zip(seqs, lengths):
            seq.proposal_len = m
