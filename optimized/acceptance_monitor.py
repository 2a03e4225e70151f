"""The drafts' survivals kept true while serving: each slot's accepted drafts against what the confidence head forecast.

The adaptive mode plans with the calibrated prefix survivals ``a_{r,k}`` of each request's drafts (docs/method.md
§4–§5): the budget ranks slots by them and the draft gate weighs their sum, the expected accepted drafts, against
plain decoding. They were calibrated on held-out prompts of the training distribution; on other traffic the head can be
over- or under-confident, and a bias does not average out over the requests of a batch, while the gate's margin
shrinks with the batch (``reference.scheduler.gate_margin``). This module compares, slot by slot, the survivals
forecast for verified drafts with the drafts that survived:

* a verified slot k of a request (k ≤ ℓ, its verify length) is one trial: forecast ``a_k``, outcome 1 if its first k
  drafts were all accepted, else 0 — so over many trials the sum of outcomes over the sum of forecasts is the factor
  by which the head's slot-k survivals are off on this traffic;
* both sums decay by ``1 − 1/window`` per step taken (an exponential moving window of about ``window`` of them); the
  engine takes one read step in ``SAMPLE_EVERY`` (consecutive steps' trials are alike, and at 256 requests a step's
  bookkeeping costs about 0.14 ms of host time on the project's 2-core CPU);
* once every slot with trials has ``min_trials`` of them, :meth:`AcceptanceMonitor.update` returns the per-slot factors
  (clipped to ``[low, high]``; a slot with too few trials takes the factor of the slot before it) when one has moved
  by more than ``tolerance`` from the factors in force. The scheduler then plans with ``min(1, a_k · factor_k)``, made
  non-increasing along the slots again (``optimized.scheduler.BudgetPlanner``).

The engine feeds it the verified steps it reads (``EngineConfig.acceptance_feedback``). Like ``cost_feedback``, it
makes the adaptive schedule depend on the traffic seen so far, so sampled adaptive outputs are then not repeatable from
run to run; greedy outputs are unaffected (verification is lossless whatever the verify lengths).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("dspark.acceptance_monitor")

WINDOW = 64  # steps taken: the sums' decay is 1 - 1/WINDOW per step taken
SAMPLE_EVERY = 4  # the engine adds one read step in this many
MIN_TRIALS = 200  # trials a slot needs (decayed count) before its factor counts: ±7 % at a survival of 0.5
TOLERANCE = 0.05  # relative change of a factor against the one in force that replans
LOW, HIGH = 0.5, 1.5  # the factors' bounds: a broken head must not silence the gate for ever, nor inflate it


class AcceptanceMonitor:
    """Per draft slot, decayed sums of forecast survivals, of outcomes and of trials (see the module docstring)."""

    def __init__(self, gamma: int, *, window: int = WINDOW, min_trials: float = MIN_TRIALS,
                 tolerance: float = TOLERANCE, low: float = LOW, high: float = HIGH) -> None:
        if gamma < 1 or window < 1 or not min_trials > 0 or not tolerance > 0 or not 0 < low <= 1 <= high:
            raise ValueError(f"need γ ≥ 1, window ≥ 1, min_trials > 0, tolerance > 0 and 0 < low ≤ 1 ≤ high, got "
                             f"{gamma}, {window}, {min_trials}, {tolerance}, {low}, {high}")
        self.gamma, self.window, self.min_trials, self.tolerance = gamma, window, min_trials, tolerance
        self.low, self.high = low, high
        self.forecast = np.zeros(gamma)  # [γ] decayed Σ a_k over the trials
        self.survived = np.zeros(gamma)  # [γ] decayed Σ 1[accepted ≥ k]
        self.trials = np.zeros(gamma)  # [γ] decayed trial counts
        self.factors: np.ndarray | None = None  # [γ] the factors in force (None: the survivals as they are)
        self._slots = np.arange(1, gamma + 1)  # [γ] k = 1..γ

    def add(self, survivals: list, verified: list[int], accepted: list[int]) -> None:
        """One step's verified requests: each one's forecast survivals (at least its ℓ first; None or empty for a
        request that verified no draft), its verify length ℓ and its accepted drafts."""
        keep = 1.0 - 1.0 / self.window
        self.forecast *= keep
        self.survived *= keep
        self.trials *= keep
        idx = [i for i, n in enumerate(verified) if n and survivals[i] is not None and len(survivals[i])]
        if not idx:
            return
        rows = [survivals[i] for i in idx]
        try:  # the engine's rows: one [γ] host array each, stacked in one call
            a = np.asarray(rows, dtype=np.float64)  # [R, ≥γ] (a ragged list raises)
        except ValueError:
            a = None
        if a is None or a.ndim != 2 or a.shape[1] < self.gamma:  # shorter rows (callers that pass ℓ values only)
            a = np.zeros((len(rows), self.gamma))  # [R, γ]
            for i, row in enumerate(rows):
                n = min(len(row), self.gamma)
                a[i, :n] = np.asarray(row[:n], dtype=np.float64)
        lengths = np.asarray(verified)[idx][:, None]  # [R, 1]
        acc = np.asarray(accepted)[idx][:, None]  # [R, 1]
        trial = self._slots <= lengths  # [R, γ] the verified slots
        self.forecast += np.where(trial, a[:, :self.gamma], 0.0).sum(axis=0)
        self.survived += ((acc >= self._slots) & trial).sum(axis=0)
        self.trials += trial.sum(axis=0)

    def measured(self) -> np.ndarray | None:
        """The per-slot factors the trials so far support (``[γ]``), or None while slot 1 has too few trials."""
        if self.trials[0] < self.min_trials:
            return None
        out = np.ones(self.gamma)
        for k in range(self.gamma):
            if self.trials[k] >= self.min_trials and self.forecast[k] > 0:
                out[k] = np.clip(self.survived[k] / self.forecast[k], self.low, self.high)
            else:  # too few trials (the budget seldom verifies that far): the slot before it
                out[k] = out[k - 1]
        return out

    def update(self) -> np.ndarray | None:
        """The new factors if one moved by more than ``tolerance`` from those in force (else None)."""
        now = self.measured()
        if now is None:
            return None
        before = np.ones(self.gamma) if self.factors is None else self.factors
        if np.all(np.abs(now / before - 1.0) <= self.tolerance):
            return None
        log.info("drafts survive %s× as often as forecast (slots 1..%d): planning with that",
                 np.array2string(now, precision=2, separator=", "), self.gamma)
        self.factors = now
        return now.copy()
