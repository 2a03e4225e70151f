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

Step-level observations arrive from the engine loop (``observe_step``); request-level ones from the request
handlers. prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class CalibrationWindow:
    """The last ``size`` trials of every draft slot, in NumPy ring buffers (one vectorised update per step)."""

    def __init__(self, gamma: int, size: int = CALIBRATION_WINDOW) -> None:
        self.gamma, self.size = gamma, size
        self.predicted = np.zeros((gamma, size), dtype=np.float64)  # [γ, W] a_k of each trial
        self.survived = np.zeros((gamma, size), dtype=np.float64)  # [γ, W] 1.0 if slot k survived
        self.count = np.zeros(gamma, dtype=np.int64)  # [γ] trials ever seen (the ring position is count % W)

    def add(self, predicted: list[list[float]], verified: list[int], accepted: list[int]) -> None:
        rows = [i for i, a in enumerate(predicted) if a and verified[i] > 0]  # requests that verified a draft
        if not rows:
            return
        a = np.full((len(rows), self.gamma), np.nan)  # [M, γ]; a_{1..ℓ} of each row, NaN past ℓ (never a trial)
        for j, i in enumerate(rows):
            a[j, : len(predicted[i])] = predicted[i][: self.gamma]
        v = np.array([verified[i] for i in rows])[:, None]  # [M, 1]
        acc = np.array([accepted[i] for i in rows])[:, None]  # [M, 1]
        slot = np.arange(self.gamma)[None, :]  # [1, γ] 0-based slot index
        trial = slot < v  # [M, γ] verified slots only (the rest are censored)
        alive = slot < acc  # [M, γ]
        for k in range(self.gamma):
            n = int(trial[:, k].sum())
            if n == 0:
                continue
            keep = min(n, self.size)
            pos = (self.count[k] + np.arange(n - keep, n)) % self.size  # [keep] ring positions
            self.predicted[k, pos] = a[trial[:, k], k][-keep:]
            self.survived[k, pos] = alive[trial[:, k], k][-keep:]
            self.count[k] += n

    def summary(self) -> list[tuple[float, float, int]]:
        """Per slot: (mean predicted a_k, realised survival rate, trials in the window)."""
        out = []
        for k in range(self.gamma):
            n = int(min(self.count[k], self.size))
            out.append((float(self.predicted[k, :n].mean()) if n else float("nan"),
                        float(self.survived[k, :n].mean()) if n else float("nan"), n))
        return out


class ServerMetrics:
    """Every metric of the server. ``gamma`` = 0 (mode none) leaves the speculative metrics at zero."""

    def __init__(self, model_name: str, gamma: int, has_drafter: bool,
                 calibration_window: int = CALIBRATION_WINDOW) -> None:
        self.registry = CollectorRegistry()
        self.has_drafter = has_drafter
        r, m = self.registry, ["model_name"]
        label = {"model_name": model_name}
        # --- vLLM's names ---
        self.running = Gauge("vllm:num_requests_running", "Requests holding an engine slot.", m, registry=r).labels(
            **label)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for a slot.", m, registry=r).labels(**label)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", m,
                                     registry=r).labels(**label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r).labels(**label)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", m, registry=r,
                              buckets=TTFT_BUCKETS).labels(**label)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between two deliveries of tokens to one request (a step may deliver several).", m,
                             registry=r, buckets=ITL_BUCKETS).labels(**label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", m, registry=r,
                             buckets=E2E_BUCKETS).labels(**label)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               m + ["finished_reason"], registry=r)
        self._model = model_name
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Request-steps that verified a draft.", m,
                                  registry=r).labels(**label)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified (Σℓ).", m,
                                        registry=r).labels(**label)
        self.num_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m,
                                    registry=r).labels(**label)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by slot (0-based, as vLLM).", m + ["position"],
                                        registry=r)
        # --- this project's ---
        self.steps = Counter("dspark:steps", "Engine steps.", registry=r)
        self.decode_steps = Counter("dspark:decode_steps", "Engine steps in which requests verified (R > 0).",
                                    registry=r)
        self.request_steps = Counter("dspark:request_steps",
                                     "Verifying request-steps (Σ R); tokens emitted by them = this + accepted.",
                                     registry=r)
        self.gate_closed = Counter("dspark:draft_gate_closed_steps",
                                   "Decode steps run without drafts because the draft gate closed.", registry=r)
        self.step_time = Histogram("dspark:step_time_seconds", "Host wall time of one engine step.", registry=r,
                                   buckets=STEP_BUCKETS)
        self.verify_tokens = Histogram("dspark:verify_tokens", "Target tokens per verify step, N = R + Σℓ.",
                                       registry=r, buckets=TOKEN_BUCKETS)
        self.verify_length = Histogram("dspark:verify_length", "Verify length ℓ per request-step.", registry=r,
                                       buckets=tuple(float(k) for k in range(max(gamma, 1) + 1)))
        self.budget = Histogram("dspark:budget", "Verify budget B = Σℓ per step (adaptive mode).", registry=r,
                                buckets=TOKEN_BUCKETS)
        self.mean_accepted = Gauge("dspark:mean_accepted_length",
                                   f"Tokens emitted per verifying request-step (τ), last {STEP_WINDOW} steps.",
                                   registry=r)
        self.mean_verify = Gauge("dspark:mean_verify_length", f"Mean ℓ per request-step, last {STEP_WINDOW} steps.",
                                 registry=r)
        self.gate_closed_ratio = Gauge("dspark:draft_gate_closed_ratio",
                                       f"Share of the last {STEP_WINDOW} decode steps run with the gate closed.",
                                       registry=r)
        slot = ["slot"]
        self.cal_pred = Gauge("dspark:calibration_predicted_survival",
                              "Mean calibrated prefix survival a_k of the verified trials of slot k in the window.",
                              slot, registry=r)
        self.cal_real = Gauge("dspark:calibration_realised_survival",
                              "Share of the verified trials of slot k in the window that survived.", slot, registry=r)
        self.cal_error = Gauge("dspark:calibration_error",
                               "Predicted minus realised survival of slot k over the window (> 0: over-confident).",
                               slot, registry=r)
        self.cal_trials = Gauge("dspark:calibration_trials", "Verified trials of slot k in the window.", slot,
                                registry=r)
        self.calibration = CalibrationWindow(gamma, calibration_window) if gamma else None
        self._recent = np.zeros((STEP_WINDOW, 4))  # per decode step: request-steps, accepted, Σℓ, gate closed
        self._recent_n = 0
        self._drafted_before = False  # whether the last step ran the drafter (so this step verifies drafts)

    # ---------------------------------------------------------------- engine side

    def observe_step(self, st) -> None:
        """One ``optimized.engine.StepStats``."""
        self.steps.inc()
        self.step_time.observe(st.step_time_s)
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        drafted_before, self._drafted_before = self._drafted_before, st.drafted
        if not st.num_decoding:
            return
        self.decode_steps.inc()
        self.request_steps.inc(st.num_decoding)
        self.verify_tokens.observe(st.verify_tokens)
        if st.budget is not None:
            self.budget.observe(st.budget)
        accepted, verified = sum(st.accepted), sum(st.verified)
        held = [bool(a) for a in st.predicted_survival]  # requests that verified at least one draft
        # The gate closed for this step when the previous step ran no drafter: nobody held drafts to verify.
        closed = self.has_drafter and not drafted_before
        if closed:
            self.gate_closed.inc()
        for v in st.verified:
            self.verify_length.observe(v)
        if any(held):
            self.num_drafts.inc(sum(held))
            self.num_draft_tokens.inc(verified)
            self.num_accepted.inc(accepted)
            for pos in range(max(st.accepted, default=0)):
                self.accepted_per_pos.labels(self._model, str(pos)).inc(sum(a > pos for a in st.accepted))
        self._recent[self._recent_n % STEP_WINDOW] = (st.num_decoding, accepted, verified, closed)
        self._recent_n += 1
        w = self._recent[: min(self._recent_n, STEP_WINDOW)].sum(axis=0)
        self.mean_accepted.set(1.0 + w[1] / w[0])
        self.mean_verify.set(w[2] / w[0])
        self.gate_closed_ratio.set(w[3] / min(self._recent_n, STEP_WINDOW))
        if self.calibration is not None and any(held):
            self.calibration.add(st.predicted_survival, st.verified, st.accepted)
            for k, (pred, real, n) in enumerate(self.calibration.summary(), start=1):
                if n:
                    self.cal_pred.labels(str(k)).set(pred)
                    self.cal_real.labels(str(k)).set(real)
                    self.cal_error.labels(str(k)).set(pred - real)
                    self.cal_trials.labels(str(k)).set(n)

    def idle(self) -> None:
        """No request is left in the engine."""
        self.running.set(0)
        self.waiting.set(0)

    # ---------------------------------------------------------------- request side

    def request_added(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens_delivered(self, n: int, first: bool, gap: float) -> None:
        """``n`` tokens reached a request, ``gap`` seconds after its arrival (first) or its previous tokens."""
        self.generation_tokens.inc(n)
        (self.ttft if first else self.itl).observe(gap)

    def request_finished(self, reason: str, latency: float) -> None:
        self.success.labels(self._model, reason).inc()
        if reason != "abort":  # a client that left says nothing about how long requests take
            self.e2e.observe(latency)
