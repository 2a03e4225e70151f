"""The step-cost table kept true while serving: each decoding step's measured time against the table's price.

The draft gate of the ``adaptive`` mode (docs/method.md §5, "The draft gate") chooses between plain decoding and
speculation by the prices of the step-cost table measured at start-up (``optimized/cost_model.py``). Prices drift
after that: another process shares the GPU, the clocks change, the requests' contexts grow far past the profiled
length, or the table prices a step differently from how this engine runs it (one step ahead of its token reads, say,
where the host's work hides behind the device's). This module compares, step by step, what a step cost with what the
table said it would, for the two kinds of step the gate weighs:

=============  =============================================  ==========================================
kind           the step                                       the table's price
=============  =============================================  ==========================================
plain          verifies no draft and launches no drafter      ``verify_time(R, R)``
speculative    verifies drafts, or launches the drafter       ``verify_time(N, R) + draft_time(R_d)``
=============  =============================================  ==========================================

(R requests verify N tokens; R_d requests draft.) What a step cost is the time from its launch to the next step's
launch: on CUDA the elapsed time between two events recorded on the stream as each verify is launched — the
device's own time for the step's verify and draft, with any gap the host left — read once the later event has
completed (``Event.query``: no synchronisation); on the CPU the wall clock between the two launches. A step whose
successor also ran prompt chunks is not sampled (the time includes the prompt's forward), and neither is the first
step after the engine went idle (its successor starts with a prefill).

Per kind, the monitor keeps an exponential moving average of ``log(measured / price)`` over ``window`` samples;
``drift = exp(average) − 1`` (the engine's metric). The prices are rescaled per kind **and per batch size** (request
counts in powers of two, :func:`request_bucket`), at the median ratio of that pair's last ``window`` samples (a few
steps that waited for the host do not move a price): how far a table is off depends on the batch (on an H200 the
table's speculative steps ran 16 % under their price at batch 1-16 and 3 % at 256 in one run), and a scale learned
at small batches would misprice a large one. Once a (kind, batch size) pair has ``min_samples`` samples and its
ratio differs from the scale in force by more than ``tolerance`` (relative), :meth:`CostMonitor.update` returns the
new scales:
the scheduler then prices that kind's steps at that batch size at the measured ratio
(``optimized.scheduler.Scheduler.set_price_scales``); a batch size not measured yet keeps the table's prices. The
scale of speculative steps multiplies every budget's step time alike, so it moves the gate's verdict, never the
budget itself.

Switches. The gate weighs what a run of plain steps costs against a run of speculative ones, so only a step between
two steps of its own kind is sampled (``steady_only``, the default). A step next to a switch of kind is not what
either run costs: the first speculative step after plain ones also catches up the drafter's context for the tokens
decoded plainly (on an H100 at 128-255 requests, up to 2.1x its price against 0.91-0.96x for a run of speculative
steps: docs/benchmarks/gate-trace-all-h100.json), and in an engine one step ahead a step next to a switch may hold
the pipeline's refill. ``trace`` keeps every sample with its neighbours' kinds (``scripts/bench_engine.py
--gate-trace --cost-feedback``: ``cost_samples``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from reference.cost_model import CostTable

log = logging.getLogger("dspark.cost_monitor")

KINDS = ("plain", "speculative")

# Samples per kind before its ratio may rescale the prices: one sample is one step, and a few steps' noise (a host
# hiccup, a prefill's tail) must not move the gate.
MIN_SAMPLES = 8
# The moving average's window, in samples of one kind: about a tenth of a second of steps at batch 1 on an H200, so
# that a shared GPU is noticed within a second while single slow steps barely move it.
WINDOW = 32
# Relative change of a kind's ratio against the scale in force that rescales the prices (hysteresis: inside it the
# decisions stay those of the table as it is).
TOLERANCE = 0.10


def request_bucket(num_requests: int) -> int:
    """The batch-size bucket a step of ``num_requests`` requests is priced in: the largest power of two ≤ it."""
    return 1 << (max(int(num_requests), 1).bit_length() - 1)


@dataclass(frozen=True)
class Sample:
    """One step measured (``CostMonitor.trace``): its kind and batch-size bucket, what it cost and the table's price
    (seconds), the kinds of the steps launched just before and after it (``before`` None: the first after idle), and
    whether prompt chunks ran before it in the same call."""

    kind: str
    bucket: int
    measured_s: float
    price_s: float
    before: str | None
    after: str
    prefill: bool


@dataclass
class _Launch:
    """One decoding step as launched: when, and what the table prices it at."""

    stamp: torch.cuda.Event | float  # an event recorded on the stream (CUDA) or the wall clock (CPU)
    kind: str
    price_s: float
    prefill: bool  # prompt chunks ran in the same call, before this launch (and after the previous step's)
    bucket: int  # request_bucket of its requests


class CostMonitor:
    """Measured step times against the table's prices, per kind of step (see the module docstring).

    The engine calls :meth:`launch` as it launches each decoding step's verify, :meth:`drafted` when the same call
    launches the drafter, and :meth:`update` after it has read a step's tokens (the events of earlier launches have
    completed by then, or complete soon: what has not yet completed is looked at in a later call).
    """

    def __init__(self, cost: CostTable, device: torch.device, *, window: int = WINDOW,
                 min_samples: int = MIN_SAMPLES, tolerance: float = TOLERANCE, steady_only: bool = True) -> None:
        if window < 1 or min_samples < 1 or not tolerance > 0:
            raise ValueError(f"need window ≥ 1, min_samples ≥ 1 and tolerance > 0, got {window}, {min_samples}, "
                             f"{tolerance}")
        self.cost, self.device = cost, torch.device(device)
        self.window, self.min_samples, self.tolerance = window, min_samples, tolerance
        # Sample only steps between two of their own kind (see the module docstring, "Switches").
        self.steady_only = steady_only
        self._launches: deque[_Launch] = deque()
        self._log_ratio = dict.fromkeys(KINDS, 0.0)  # moving average of log(measured / price), all batch sizes
        self.samples = dict.fromkeys(KINDS, 0)
        # Per (kind, batch-size bucket): the last ``window`` log ratios (their median sets the price multiplier: one
        # step that waited for the host, a collection or a switch must not move a price) and the samples seen.
        self._bucket_log: dict[tuple[str, int], deque[float]] = {}
        self._bucket_samples: dict[tuple[str, int], int] = {}
        self.scales: dict[int, dict[str, float]] = {}  # bucket -> kind -> multiplier (absent: 1.0, the table's)
        # When a list: every sample taken appends a :class:`Sample` (the step's kind and neighbours, what it cost and
        # its price), for a benchmark to see which steps set a scale. None (the default) keeps nothing.
        self.trace: list[Sample] | None = None
        self._before: str | None = None  # the kind of the step launched before the oldest one waiting

    def launch(self, num_requests: int, num_tokens: int, prefill: bool) -> None:
        """A decoding step's verify of ``num_tokens`` tokens of ``num_requests`` requests is being launched (after
        the call's prompt chunks, if ``prefill``)."""
        if self.device.type == "cuda":
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        plain = num_tokens == num_requests
        price = self.cost.verify_time(num_tokens, num_requests)
        self._launches.append(_Launch(stamp, "plain" if plain else "speculative", price, prefill,
                                      request_bucket(num_requests)))

    def drafted(self, num_requests: int) -> None:
        """The drafter was launched for ``num_requests`` requests after the last launched verify: that step is
        speculative, and the drafter's price is added to it."""
        if not self._launches:
            return
        last = self._launches[-1]
        last.kind = "speculative"
        last.price_s += self.cost.draft_time(num_requests)

    def idle(self) -> None:
        """The engine has no work left: the next launch starts afresh (no sample spans the idle time)."""
        self._launches.clear()
        self._before = None

    def scales_at(self, num_requests: int) -> dict[str, float]:
        """The price multipliers in force for a step of ``num_requests`` requests, per kind."""
        return {**dict.fromkeys(KINDS, 1.0), **self.scales.get(request_bucket(num_requests), {})}

    def update(self) -> dict[int, dict[str, float]] | None:
        """Take the samples whose end has completed; return every batch-size bucket's scales (bucket -> kind ->
        multiplier) if one (kind, bucket) ratio left the tolerance around its scale in force (else None)."""
        while len(self._launches) >= 2:
            first, second = self._launches[0], self._launches[1]
            if isinstance(second.stamp, torch.cuda.Event):
                if not second.stamp.query():  # sync: none, a query; not completed yet: a later call takes it
                    break
                measured = first.stamp.elapsed_time(second.stamp) / 1e3  # sync: none, both events have completed
            else:
                measured = second.stamp - first.stamp
            self._launches.popleft()
            before, self._before = self._before, first.kind
            if second.prefill or first.price_s <= 0 or measured <= 0:
                continue
            if self.trace is not None:
                self.trace.append(Sample(first.kind, first.bucket, measured, first.price_s, before, second.kind,
                                         first.prefill))
            if self.steady_only and not before == first.kind == second.kind:
                continue  # a switch between kinds: not what a run of either kind costs
            self._observe(first.kind, first.bucket, measured / first.price_s)
        changed = False
        for (kind, bucket), n in self._bucket_samples.items():
            if n < self.min_samples:
                continue
            ratio = math.exp(statistics.median(self._bucket_log[(kind, bucket)]))
            in_force = self.scales.get(bucket, {}).get(kind, 1.0)
            if abs(ratio / in_force - 1.0) > self.tolerance:
                log.info("%s steps of %d-%d requests cost %.2fx the table's prices over the last ~%d of them: pricing "
                         "them at that", kind, bucket, 2 * bucket - 1, ratio, min(n, self.window))
                self.scales.setdefault(bucket, {})[kind] = ratio
                changed = True
        return {b: dict(k) for b, k in self.scales.items()} if changed else None

    def _observe(self, kind: str, bucket: int, ratio: float) -> None:
        x = math.log(ratio)
        n = self.samples[kind] = self.samples[kind] + 1
        weight = 1.0 / min(n, self.window)  # a plain mean until the window is full, then a moving average
        self._log_ratio[kind] += weight * (x - self._log_ratio[kind])
        key = (kind, bucket)
        self._bucket_samples[key] = self._bucket_samples.get(key, 0) + 1
        self._bucket_log.setdefault(key, deque(maxlen=self.window)).append(x)

    @property
    def drift(self) -> dict[str, float | None]:
        """Per kind, measured over priced minus one (None before ``min_samples`` samples)."""
        return {kind: (math.exp(self._log_ratio[kind]) - 1.0 if self.samples[kind] >= self.min_samples else None)
                for kind in KINDS}
