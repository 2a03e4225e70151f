"""Prometheus metrics of the server, in one registry per app (docs/serving.md, "Metrics").

Names that vLLM's server also exports keep vLLM's name and meaning (``vllm:`` prefix, a ``model_name`` label), so
dashboards built for vLLM read this server unchanged. What is particular to confidence-scheduled verification has
the ``dspark:`` prefix: step time and size, verify length ℓ and budget B per step, the draft gate, and the live
calibration of the confidence head.

**Calibration, live.** For every draft slot k = 1..γ the server keeps the last ``calibration_window`` *trials*:
a slot of a draft that the target verified (k ≤ ℓ_r), with the calibrated prefix survival a_k the scheduler
planned with and whether the slot survived (k ≤ accepted_r). Unverified slots are censored, not counted as
rejections (a trimmed draft says nothing about the confidence head). The gauges give, per slot, the mean predicted
survival, the realised survival rate, and their difference (positive: the head is over-confident). Names follow
docs/method.md (``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size).

Step-level observations arrive with each engine step (``observe_step``), request-level ones from the request
handlers, all on the server's event loop, tens of thousands of times a second under load. So counters and
histograms are plain Python numbers that an observation adds to, with no lock (:class:`LoopCounter`,
:class:`LoopHistogram`), and the gauges that summarise windows are computed only when ``/metrics`` is scraped (on the
same event loop): prometheus-client's own metrics take a lock per observation, and recomputing the windows' means
and the calibration gauges on every step cost more than all of a step's other bookkeeping. The exposition is
prometheus-client's, the same names and values (the tests compare the two).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so that vLLM dashboards' quantiles line up; ITL gains
# three sub-10 ms buckets: a 135M target on an H200 steps in a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)
# Verify tokens per step N = R + Σℓ: powers of two up to (γ+1)·256 requests.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(12))
CALIBRATION_WINDOW = 2000  # trials per slot: ±2.2 points of binomial noise on a rate near 0.5 (1.96·√(.25/2000))
STEP_WINDOW = 256  # steps behind the moving means of the accepted and verify lengths


class LoopCounter:
    """A Prometheus counter (``NAME_total``) counted by one thread without a lock, rendered at scrape time.

    ``labels`` are constant label values (e.g. the model name); with ``key`` one more label whose value each
    :meth:`inc` names, one sample per value seen (e.g. the draft position)."""

    def __init__(self, name: str, doc: str, registry: CollectorRegistry, labels: dict[str, str] | None = None,
                 key: str | None = None) -> None:
        self.name, self.doc, self.key = name, doc, key
        self.labels = dict(labels or {})
        self.values: dict[str | None, float] = {} if key else {None: 0.0}
        registry.register(self)

    def inc(self, amount: float = 1.0, key: str | None = None) -> None:
        self.values[key] = self.values.get(key, 0.0) + amount

    def collect(self):
        names = list(self.labels) + ([self.key] if self.key else [])
        family = CounterMetricFamily(self.name, self.doc, labels=names)
        for key, value in self.values.items():
            family.add_metric(list(self.labels.values()) + ([key] if self.key else []), value)
        yield family

    def describe(self):
        return self.collect()


class LoopHistogram:
    """A Prometheus histogram (``_bucket``, ``_count``, ``_sum``) observed by one thread without a lock: a count per
    bucket (an observation ``v`` goes to the first bucket whose bound is ≥ v, as prometheus-client places it) and
    the sum, made cumulative at scrape time."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry,
                 labels: dict[str, str] | None = None) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets must be sorted, got {buckets}")
        self.name, self.doc, self.labels = name, doc, dict(labels or {})
        self.bounds = tuple(bounds) + ((math.inf,) if not bounds or bounds[-1] != math.inf else ())
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cumulative = itertools.accumulate(self.counts)
        family.add_metric(list(self.labels.values()),
                          [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative, strict=True)], self.sum)
        yield family

    def describe(self):
        return self.collect()


class CalibrationWindow:
    """The last ``size`` trials of every draft slot: per slot, bounded queues of the predicted a_k and of whether the
    slot survived. A step appends its trials one by one (a few hundred at 64 requests, plain Python appends: about a
    fifth of what building NumPy arrays per step cost); the means are taken when someone asks (a scrape)."""

    def __init__(self, gamma: int, size: int = CALIBRATION_WINDOW) -> None:
        self.gamma, self.size = gamma, size
        self.predicted = [deque(maxlen=size) for _ in range(gamma)]  # per slot: a_k of each trial, newest last
        self.survived = [deque(maxlen=size) for _ in range(gamma)]  # per slot: 1.0 if the slot survived, else 0.0
        self.count = [0] * gamma  # per slot: trials ever seen

    def add(self, predicted: list[list[float]], verified: list[int], accepted: list[int]) -> None:
        """One step: ``predicted[r]`` the calibrated a_{1..ℓ_r} request r verified with (empty if it held no draft),
        ``verified[r]`` = ℓ_r, ``accepted[r]`` its accepted drafts. Slot k of request r is a trial if k ≤ ℓ_r; the
        slots past ℓ_r are censored."""
        for a, v, acc in zip(predicted, verified, accepted, strict=True):
            for k in range(min(v, len(a), self.gamma)):
                self.predicted[k].append(a[k])
                self.survived[k].append(1.0 if k < acc else 0.0)
                self.count[k] += 1

    def summary(self) -> list[tuple[float, float, int]]:
        """Per slot: (mean predicted a_k, realised survival rate, trials in the window)."""
        return [self.slot_summary(k) for k in range(self.gamma)]

    def slot_summary(self, k: int) -> tuple[float, float, int]:
        """Slot ``k`` (0-based): (mean predicted a_k, realised survival rate, trials in the window)."""
        n = len(self.predicted[k])
        if not n:
            return float("nan"), float("nan"), 0
        return math.fsum(self.predicted[k]) / n, math.fsum(self.survived[k]) / n, n


class ServerMetrics:
    """Every metric of the server. ``gamma`` = 0 (mode none) leaves the speculative metrics at zero.

    Every method runs on the server's event loop, as does the ``/metrics`` route that renders :attr:`registry`."""

    def __init__(self, model_name: str, gamma: int, has_drafter: bool,
                 calibration_window: int = CALIBRATION_WINDOW) -> None:
        self.registry = r = CollectorRegistry()
        self.has_drafter = has_drafter
        label = {"model_name": model_name}
        # --- vLLM's names ---
        self.num_running = self.num_waiting = 0  # read by the two gauges at scrape time
        Gauge("vllm:num_requests_running", "Requests holding an engine slot.", ["model_name"], registry=r).labels(
            **label).set_function(lambda: self.num_running)
        Gauge("vllm:num_requests_waiting", "Requests queued for a slot.", ["model_name"], registry=r).labels(
            **label).set_function(lambda: self.num_waiting)
        self.prompt_tokens = LoopCounter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", r, label)
        self.generation_tokens = LoopCounter("vllm:generation_tokens", "Generated tokens.", r, label)
        self.ttft = LoopHistogram("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS, r,
                                  label)
        self.itl = LoopHistogram("vllm:inter_token_latency_seconds",
                                 "Time between two deliveries of tokens to one request (a step may deliver several).",
                                 ITL_BUCKETS, r, label)
        self.e2e = LoopHistogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS, r, label)
        self.success = LoopCounter("vllm:request_success", "Finished requests by finish reason.", r, label,
                                   key="finished_reason")
        self.num_drafts = LoopCounter("vllm:spec_decode_num_drafts", "Request-steps that verified a draft.", r, label)
        self.num_draft_tokens = LoopCounter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified (Σℓ).", r,
                                            label)
        self.num_accepted = LoopCounter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", r, label)
        self.accepted_per_pos = LoopCounter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                            "Accepted draft tokens by slot (0-based, as vLLM).", r, label,
                                            key="position")
        self._positions = [str(k) for k in range(max(gamma, 1))]
        # --- this project's ---
        self.steps = LoopCounter("dspark:steps", "Engine steps.", r)
        self.decode_steps = LoopCounter("dspark:decode_steps", "Engine steps in which requests verified (R > 0).", r)
        self.request_steps = LoopCounter("dspark:request_steps",
                                         "Verifying request-steps (Σ R); tokens emitted by them = this + accepted.", r)
        self.gate_closed = LoopCounter("dspark:draft_gate_closed_steps",
                                       "Decode steps run without drafts because the draft gate closed.", r)
        self.step_time = LoopHistogram("dspark:step_time_seconds", "Host wall time of one engine step.", STEP_BUCKETS,
                                       r)
        self.verify_tokens = LoopHistogram("dspark:verify_tokens", "Target tokens per verify step, N = R + Σℓ.",
                                           TOKEN_BUCKETS, r)
        self.verify_length = LoopHistogram("dspark:verify_length", "Verify length ℓ per request-step.",
                                           tuple(float(k) for k in range(max(gamma, 1) + 1)), r)
        self.budget = LoopHistogram("dspark:budget", "Verify budget B = Σℓ per step (adaptive mode).", TOKEN_BUCKETS,
                                    r)
        self._recent = np.zeros((STEP_WINDOW, 4))  # per decode step: request-steps, accepted, Σℓ, gate closed
        self._recent_n = 0
        Gauge("dspark:mean_accepted_length", f"Tokens emitted per verifying request-step (τ), last {STEP_WINDOW} "
              "steps.", registry=r).set_function(lambda: self._window(1.0, 1, 0))
        Gauge("dspark:mean_verify_length", f"Mean ℓ per request-step, last {STEP_WINDOW} steps.",
              registry=r).set_function(lambda: self._window(0.0, 2, 0))
        Gauge("dspark:draft_gate_closed_ratio", f"Share of the last {STEP_WINDOW} decode steps run with the gate "
              "closed.", registry=r).set_function(lambda: self._window(0.0, 3, None))
        slot = ["slot"]
        self._calibration_gauges = (
            Gauge("dspark:calibration_predicted_survival",
                  "Mean calibrated prefix survival a_k of the verified trials of slot k in the window.", slot,
                  registry=r),
            Gauge("dspark:calibration_realised_survival",
                  "Share of the verified trials of slot k in the window that survived.", slot, registry=r),
            Gauge("dspark:calibration_error",
                  "Predicted minus realised survival of slot k over the window (> 0: over-confident).", slot,
                  registry=r),
            Gauge("dspark:calibration_trials", "Verified trials of slot k in the window.", slot, registry=r))
        # The engine's measured step costs against its table (EngineConfig.cost_feedback), as last reported.
        self.cost_drift: dict[str, float | None] = {}
        self.price_scales: dict[str, float] = {}
        kind = ["kind"]
        self._cost_gauges = (
            Gauge("dspark:step_cost_drift", "Measured step time over the cost table's price, minus one, by kind of "
                  "step (plain, speculative); a kind appears once the engine has measured enough of its steps.", kind,
                  registry=r),
            Gauge("dspark:step_cost_scale", "Multiplier of the cost table's prices the draft gate uses now, by kind "
                  "of step (1: the table's own).", kind, registry=r))
        self._cost_kinds: set[str] = set()  # kinds whose gauges exist
        self._calibrated_slots = 0  # slots 1..this have had a trial: their gauges exist
        self.calibration = CalibrationWindow(gamma, calibration_window) if gamma else None
        self._drafted_before = False  # whether the last step ran the drafter (so this step verifies drafts)

    def _window(self, offset: float, column: int, denominator: int | None) -> float:
        """``offset`` + the sum of a column of the last STEP_WINDOW decode steps over the sum of column
        ``denominator`` (None: over the number of steps); 0 before the first decode step, as a gauge never set."""
        n = min(self._recent_n, STEP_WINDOW)
        if not n:
            return 0.0
        w = self._recent[:n].sum(axis=0)
        return offset + w[column] / (n if denominator is None else w[denominator])

    def _calibration_gauge(self, k: int, field: int):
        """The scrape-time value of one calibration gauge of slot k (0-based): predicted, realised, error, trials."""
        def value() -> float:
            pred, real, n = self.calibration.slot_summary(k)
            return (pred, real, pred - real, float(n))[field]
        return value

    # ---------------------------------------------------------------- engine side

    def observe_step(self, st) -> None:
        """One ``optimized.sequence.StepStats``."""
        self.steps.inc()
        self.step_time.observe(st.step_time_s)
        drift = getattr(st, "cost_drift", None)  # fields an engine may not report (tests, simulated engines)
        if drift is not None:
            self.cost_drift = drift
            self.price_scales = getattr(st, "price_scales", None) or self.price_scales
            self._show_cost_kinds()
        self.num_running, self.num_waiting = st.num_running, st.num_waiting
        drafted_before, self._drafted_before = self._drafted_before, st.drafted
        if not st.num_decoding:
            return
        self.decode_steps.inc()
        self.request_steps.inc(st.num_decoding)
        self.verify_tokens.observe(st.verify_tokens)
        if st.budget is not None:
            self.budget.observe(st.budget)
        accepted, verified = sum(st.accepted), sum(st.verified)
        held = sum(1 for a in st.predicted_survival if a)  # requests that verified at least one draft
        # The gate closed for this step: as the engine reports it, else when the previous step ran no drafter
        # (nobody held drafts to verify; true of an engine that reads each step before the next).
        reported = getattr(st, "gate_closed", None)
        closed = self.has_drafter and (reported if reported is not None else not drafted_before)
        if closed:
            self.gate_closed.inc()
        for v in st.verified:
            self.verify_length.observe(v)
        if held:
            self.num_drafts.inc(held)
            self.num_draft_tokens.inc(verified)
            self.num_accepted.inc(accepted)
            for pos in range(max(st.accepted, default=0)):
                self.accepted_per_pos.inc(sum(a > pos for a in st.accepted), self._positions[pos])
        self._recent[self._recent_n % STEP_WINDOW] = (st.num_decoding, accepted, verified, closed)
        self._recent_n += 1
        if self.calibration is not None and held:
            self.calibration.add(st.predicted_survival, st.verified, st.accepted)
            self._show_calibrated_slots()

    def _show_cost_kinds(self) -> None:
        """The step-cost gauges of every kind of step the engine has measured (a kind appears with its first value)."""
        for k, value in self.cost_drift.items():
            if value is not None and k not in self._cost_kinds:
                self._cost_gauges[0].labels(k).set_function(lambda k=k: self.cost_drift[k])
                self._cost_gauges[1].labels(k).set_function(lambda k=k: self.price_scales.get(k, 1.0))
                self._cost_kinds.add(k)

    def _show_calibrated_slots(self) -> None:
        """The calibration gauges of every slot that has had a trial (a slot's gauges appear with its first)."""
        while self._calibrated_slots < self.calibration.gamma and self.calibration.count[self._calibrated_slots]:
            k = self._calibrated_slots
            for field, gauge in enumerate(self._calibration_gauges):
                gauge.labels(str(k + 1)).set_function(self._calibration_gauge(k, field))
            self._calibrated_slots += 1

    def idle(self) -> None:
        """No request is left in the engine."""
        self.num_running = self.num_waiting = 0

    # ---------------------------------------------------------------- request side

    def request_added(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens_delivered(self, n: int, first: bool, gap: float) -> None:
        """``n`` tokens reached a request, ``gap`` seconds after its arrival (first) or its previous tokens."""
        self.generation_tokens.inc(n)
        (self.ttft if first else self.itl).observe(gap)

    def request_finished(self, reason: str, latency: float) -> None:
        self.success.inc(1.0, reason)
        if reason != "abort":  # a client that left says nothing about how long requests take
            self.e2e.observe(latency)

    # ---------------------------------------------------------------- several API servers (api_servers.py)

    def _loop_metrics(self) -> list[LoopCounter | LoopHistogram]:
        return [m for m in vars(self).values() if isinstance(m, (LoopCounter, LoopHistogram))]

    def snapshot(self) -> dict:
        """Everything this instance counted, as plain (picklable) values: what one API server contributes to the
        scrape of a server that runs several (:meth:`merged`)."""
        cal = self.calibration
        return {
            "counters": {m.name: dict(m.values) for m in self._loop_metrics() if isinstance(m, LoopCounter)},
            "histograms": {m.name: (list(m.counts), m.sum) for m in self._loop_metrics()
                           if isinstance(m, LoopHistogram)},
            "requests": (self.num_running, self.num_waiting),
            "recent": (self._recent.copy(), self._recent_n),
            "costs": (dict(self.cost_drift), dict(self.price_scales)),
            "calibration": None if cal is None else ([list(q) for q in cal.predicted], [list(q) for q in cal.survived],
                                                      list(cal.count)),
        }

    @classmethod
    def merged(cls, model_name: str, gamma: int, has_drafter: bool, snapshots: list[dict]) -> ServerMetrics:
        """The metrics of a server whose API servers took these snapshots: counters, histograms and request gauges
        add up; the engine's step statistics (the windows behind the mean gauges, the calibration trials) reach
        only API server 0, so they come from the one snapshot that has them."""
        out = cls(model_name, gamma, has_drafter)
        for snap in snapshots:
            out._absorb(snap)
        return out

    def _absorb(self, snap: dict) -> None:
        for m in self._loop_metrics():
            if isinstance(m, LoopCounter):
                for key, value in snap["counters"].get(m.name, {}).items():
                    m.values[key] = m.values.get(key, 0.0) + value
            elif m.name in snap["histograms"]:
                counts, total = snap["histograms"][m.name]
                m.counts = [a + b for a, b in zip(m.counts, counts, strict=True)]
                m.sum += total
        self.num_running += snap["requests"][0]
        self.num_waiting += snap["requests"][1]
        recent, n = snap["recent"]
        if n > self._recent_n:
            self._recent, self._recent_n = recent.copy(), n
        drift, scales = snap.get("costs", ({}, {}))
        if drift:  # the engine's step statistics reach one API server
            self.cost_drift, self.price_scales = dict(drift), dict(scales)
            self._show_cost_kinds()
        cal = snap["calibration"]
        if self.calibration is not None and cal is not None and sum(cal[2]) > sum(self.calibration.count):
            size = self.calibration.size
            self.calibration.predicted = [deque(q, maxlen=size) for q in cal[0]]
            self.calibration.survived = [deque(q, maxlen=size) for q in cal[1]]
            self.calibration.count = list(cal[2])
            self._show_calibrated_slots()
