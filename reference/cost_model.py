"""The cost table: how long one decoding step takes, as a function of its size (docs/method.md §5, "Cost table").

The scheduler maximises ``Θ = τ · SPS(n)``, so it needs ``SPS``: target steps per second when the verify
forward carries ``n`` tokens, with the drafter's cost for the batch added. Real step times are not smooth.
An engine that replays CUDA graphs runs a batch of 121 tokens in the 128-token graph, so the cost is a
*staircase* over the captured sizes; past the largest graph the engine runs eagerly and the curve jumps
(vLLM's published profile: about 20.6 ms at 1024 tokens, 104 ms just past the graph limit). This module
keeps those facts explicit:

* ``verify_ms`` maps a measured token count to its median step time; ``draft_ms`` maps a request count to
  the median time of one drafter step (the drafter always drafts the full block, so its cost depends on
  the number of requests only, never on how many drafts get verified).
* ``verify_ms_by_requests`` (optional) adds the second thing a verify step's cost depends on: how many requests
  carry its tokens. Each request reads its own KV context and adds its own row of per-request work, so ``n``
  tokens from one request cost less than ``n`` one-token requests, and on a small model the difference decides
  how long a batch-1 verify should be. For each measured request count ``r`` it holds a curve over token counts
  ``n ≥ r``; a query for ``R`` requests reads the curve of the smallest measured ``r ≥ R`` (an upper bound, like the
  staircase) and falls back to ``verify_ms`` where that curve has no size ≥ ``n``.
* :meth:`CostTable.monotone` forces both curves non-decreasing (a running maximum): measurement noise must
  never make a bigger step look cheaper, or the scheduler would chase noise.
* Inside the graph region a size costs the smallest measured size at or above it (the staircase). Above
  ``graph_max_tokens`` (the eager region) the cost is interpolated linearly among the points measured
  *in that region only*: bridging the cliff with a line from a graph point would understate it.

Times are stored in milliseconds (as measured) and returned in seconds. The dummy forwards are passed in
as callables by whoever owns the target and the drafter, so this module depends on neither.
Names follow ``docs/method.md`` (``SPS``, ``Θ``, ``ℓ`` verify length).
"""

from __future__ import annotations

import bisect
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

_FORMAT = "dspark-cost-table/2"  # written into every saved table; load refuses other formats
_READABLE_FORMATS = (_FORMAT, "dspark-cost-table/1")  # /1: the same without verify_ms_by_requests


@dataclass
class CostTable:
    """Measured step times of the target's verify forward and of the drafter.

    Attributes:
        verify_ms: total verify-forward token count ``n`` -> median milliseconds. The measured sizes are
            the sizes the engine can actually run (its CUDA-graph buckets, plus optional eager sizes
            above ``graph_max_tokens``).
        draft_ms: request count ``R`` -> median milliseconds of one drafter step for ``R`` requests. An
            empty table means the drafter's cost is not counted (a target-only model of the step, as in
            docs/method.md Appendix A).
        graph_max_tokens: the largest captured graph size, itself a measured size. Sizes above it form a
            separate regime with no padding; ``None`` means every measured size is a graph size.
        hardware: device name the table was measured on ("synthetic ..." for made-up tables).
        meta: free-form provenance (model, settings, KV context length, the command that measured it).
        verify_ms_by_requests: request count ``r`` -> {token count ``n ≥ r`` -> median milliseconds of a verify
            forward whose ``n`` tokens belong to ``r`` requests}; empty: the cost depends on ``n`` alone.
    """

    verify_ms: dict[int, float]
    draft_ms: dict[int, float]
    graph_max_tokens: int | None = None
    hardware: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    verify_ms_by_requests: dict[int, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.verify_ms = _checked_curve(self.verify_ms, "verify_ms")
        self.draft_ms = _checked_curve(self.draft_ms, "draft_ms")
        if not isinstance(self.verify_ms_by_requests, dict):
            raise ValueError("verify_ms_by_requests must map request counts to curves")
        by_requests = {}
        for r, curve in self.verify_ms_by_requests.items():
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(f"verify_ms_by_requests: request counts must be positive integers, got {r!r}")
            curve = _checked_curve(curve, f"verify_ms_by_requests[{r}]")
            if not curve or min(curve) < r:
                raise ValueError(f"verify_ms_by_requests[{r}] must measure token counts ≥ {r} (each request "
                                 f"carries at least its anchor token), got {sorted(curve)}")
            by_requests[r] = curve
        self.verify_ms_by_requests = dict(sorted(by_requests.items()))
        if not self.verify_ms:
            raise ValueError("verify_ms is empty: a cost table needs at least one measured verify size")
        if self.graph_max_tokens is not None:
            if isinstance(self.graph_max_tokens, bool) or not isinstance(self.graph_max_tokens, int):
                raise ValueError(f"graph_max_tokens must be an integer or None, got {self.graph_max_tokens!r}")
            if self.graph_max_tokens not in self.verify_ms:
                raise ValueError(f"graph_max_tokens={self.graph_max_tokens} is not a measured size in verify_ms "
                                 f"(measured: {sorted(self.verify_ms)}); the largest graph must be profiled")
        if not isinstance(self.hardware, str):
            raise ValueError(f"hardware must be a string, got {type(self.hardware).__name__}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")

    # ------------------------------------------------------------------ shaping
    def monotone(self) -> CostTable:
        """A copy whose curves are running maxima: step time non-decreasing in ``n`` and in ``R``."""
        return CostTable(_running_max(self.verify_ms), _running_max(self.draft_ms), self.graph_max_tokens,
                         self.hardware, dict(self.meta),
                         {r: _running_max(c) for r, c in self.verify_ms_by_requests.items()})

    # ------------------------------------------------------------------ queries
    def padded_tokens(self, num_tokens: int) -> int:
        """The token count that would actually run: the next graph size, or ``num_tokens`` itself when eager."""
        n = _check_count(num_tokens, "num_tokens")
        if n == 0:
            return 0
        graph = self.graph_sizes()
        i = bisect.bisect_left(graph, n)
        return graph[i] if i < len(graph) else n

    def verify_time(self, num_tokens: int, num_requests: int | None = None) -> float:
        """Seconds of one verify forward carrying ``num_tokens`` tokens (0 tokens: no forward, 0 s).

        With ``num_requests`` and a ``verify_ms_by_requests`` curve for at least that many requests: the
        staircase of the smallest such curve (its cost at the smallest measured size ≥ n), when it has a size
        ≥ n. Otherwise ``verify_ms``: in the graph region the cost of the smallest measured size ≥ n (a batch
        of 121 tokens costs the 128-token graph); above it, linear interpolation among the measured points
        above the graph region, extended linearly past the last one, never below the largest graph's cost, so
        the curve stays monotone across the cliff.
        """
        n = _check_count(num_tokens, "num_tokens")
        if n == 0:
            return 0.0
        if num_requests is not None and self.verify_ms_by_requests:
            r = _check_count(num_requests, "num_requests")
            counts = list(self.verify_ms_by_requests)
            j = bisect.bisect_left(counts, r)
            if j < len(counts):
                curve = self.verify_ms_by_requests[counts[j]]
                sizes = list(curve)
                i = bisect.bisect_left(sizes, n)
                if i < len(sizes):
                    return curve[sizes[i]] / 1e3
        graph = self.graph_sizes()
        i = bisect.bisect_left(graph, n)
        if i < len(graph):
            return self.verify_ms[graph[i]] / 1e3
        if self.graph_max_tokens is None:
            # No separate eager regime was measured: the curve's own top segment is all we know.
            ms = _linear(self.verify_ms, sorted(self.verify_ms), n, "verify_ms")
        else:
            eager = [s for s in sorted(self.verify_ms) if s > self.graph_max_tokens]
            if not eager:
                raise ValueError(f"{n} tokens exceed graph_max_tokens={self.graph_max_tokens} and no size above "
                                 "it was measured; the eager cost past the graph cliff cannot be guessed from "
                                 "graph sizes (profile some eager sizes or enlarge the bucket list)")
            ms = max(_linear(self.verify_ms, eager, n, "verify_ms"), self.verify_ms[self.graph_max_tokens])
        return ms / 1e3

    def draft_time(self, num_requests: int) -> float:
        """Seconds of one drafter step for ``num_requests`` requests: a staircase over measured counts.

        0 requests cost nothing; so does any count when ``draft_ms`` is empty (drafter not modelled).
        Above the largest measured count: the line through the two largest measured counts.
        """
        r = _check_count(num_requests, "num_requests")
        if r == 0 or not self.draft_ms:
            return 0.0
        sizes = sorted(self.draft_ms)
        i = bisect.bisect_left(sizes, r)
        if i < len(sizes):
            return self.draft_ms[sizes[i]] / 1e3
        return _linear(self.draft_ms, sizes, r, "draft_ms") / 1e3

    def step_time(self, num_tokens: int, num_requests: int) -> float:
        """Seconds of one decoding step: verify ``num_tokens`` tokens of ``num_requests`` requests, plus the drafter
        for those ``num_requests`` requests."""
        return self.verify_time(num_tokens, num_requests) + self.draft_time(num_requests)

    def sps(self, num_tokens: int, num_requests: int) -> float:
        """Steps per second, ``1 / step_time``."""
        t = self.step_time(num_tokens, num_requests)
        if t <= 0.0:
            raise ValueError(f"a step of {num_tokens} tokens and {num_requests} requests does no work; SPS undefined")
        return 1.0 / t

    def graph_sizes(self) -> list[int]:
        """The measured sizes in the graph region (all of them when ``graph_max_tokens`` is None), ascending."""
        sizes = sorted(self.verify_ms)
        if self.graph_max_tokens is None:
            return sizes
        return [s for s in sizes if s <= self.graph_max_tokens]

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "hardware": self.hardware,
            "graph_max_tokens": self.graph_max_tokens,
            "verify_ms": {str(k): v for k, v in sorted(self.verify_ms.items())},
            "draft_ms": {str(k): v for k, v in sorted(self.draft_ms.items())},
            "verify_ms_by_requests": {str(r): {str(n): v for n, v in sorted(c.items())}
                                      for r, c in self.verify_ms_by_requests.items()},
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (keys as strings, JSON has no integer keys)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Read a table written by :meth:`save`, validating every field; errors name the file and the field."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cost table {path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"cost table {path}: {e}") from e

    @classmethod
    def from_dict(cls, d: Any) -> CostTable:
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        if d.get("format") not in _READABLE_FORMATS:
            raise ValueError(f"format is {d.get('format')!r}, expected one of {list(_READABLE_FORMATS)}")
        known = {"format", "hardware", "graph_max_tokens", "verify_ms", "draft_ms", "meta"}
        if d["format"] == _FORMAT:
            known.add("verify_ms_by_requests")
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown fields {unknown}")
        for name in ("verify_ms", "draft_ms"):
            if not isinstance(d.get(name), dict):
                raise ValueError(f"{name} must be an object mapping sizes to milliseconds")
        by_requests = d.get("verify_ms_by_requests", {})
        if not isinstance(by_requests, dict) or not all(isinstance(c, dict) for c in by_requests.values()):
            raise ValueError("verify_ms_by_requests must map request counts to objects mapping sizes to milliseconds")
        return cls(
            verify_ms=_int_keys(d["verify_ms"], "verify_ms"),
            draft_ms=_int_keys(d["draft_ms"], "draft_ms"),
            graph_max_tokens=d.get("graph_max_tokens"),
            hardware=d.get("hardware", ""),
            meta=d.get("meta", {}),
            verify_ms_by_requests={r: _int_keys(c, f"verify_ms_by_requests[{r}]")
                                   for r, c in _int_keys(by_requests, "verify_ms_by_requests").items()},
        )

    # ------------------------------------------------------------------ synthetic tables
    @classmethod
    def affine(cls, fixed_ms: float, per_token_ms: float, draft_fixed_ms: float = 0.0,
               draft_per_request_ms: float = 0.0, sizes: Sequence[int] | None = None,
               request_counts: Sequence[int] | None = None) -> CostTable:
        """A SYNTHETIC table ``verify(n) = fixed + per_token·n`` ms, for CPU demos and tests (nothing is measured).

        Args:
            fixed_ms: cost of a verify forward independent of its size (weights read once per step).
            per_token_ms: added cost per verified token.
            draft_fixed_ms, draft_per_request_ms: the drafter's ``fixed + per_request·R``; both 0 leaves the
                drafter out of the model (empty ``draft_ms``).
            sizes: token counts to tabulate; default ``default_bucket_sizes(512)``, so the staircase applies
                exactly as on a CUDA-graph engine. Pass every size (``range(1, N+1)``) for a smooth curve.
            request_counts: request counts tabulated for the drafter; default 1..64.
        """
        if not (fixed_ms >= 0 and per_token_ms >= 0 and draft_fixed_ms >= 0 and draft_per_request_ms >= 0):
            raise ValueError("affine cost coefficients must be ≥ 0")
        sizes = list(default_bucket_sizes(512) if sizes is None else sizes)
        verify = {int(n): fixed_ms + per_token_ms * n for n in sizes}
        draft = {}
        if draft_fixed_ms > 0 or draft_per_request_ms > 0:
            counts = range(1, 65) if request_counts is None else request_counts
            draft = {int(r): draft_fixed_ms + draft_per_request_ms * r for r in counts}
        meta = {"synthetic": "affine", "fixed_ms": fixed_ms, "per_token_ms": per_token_ms,
                "draft_fixed_ms": draft_fixed_ms, "draft_per_request_ms": draft_per_request_ms}
        return cls(verify, draft, None, "synthetic (affine, not measured)", meta)


def default_bucket_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture CUDA graphs for (and to profile), up to and including ``max_tokens``.

    ``1, 2, 4``, then every multiple of 8 below 256, then every multiple of 16, then ``max_tokens`` itself.
    Why: each captured graph costs memory and capture time, so sizes cannot be dense; padding wastes at
    most 7 tokens where a token is a large share of the step (small batches) and at most 15 where it is
    not; multiples of 8/16 match tensor-core tile sizes, so a padded size costs little more than the
    unpadded one would. This is the shape of vLLM's default capture list. ``max_tokens`` is appended so the
    largest bucket covers exactly ``(γ+1) × max_num_seqs``, the most tokens one verify step carries.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_tokens + 1, 16))
    sizes = [s for s in sizes if s <= max_tokens]
    if sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def measure_cost_table(verify_fn: Callable[[int], Callable[[], None] | None],
                       draft_fn: Callable[[int], Callable[[], None] | None],
                       token_counts: Sequence[int], request_counts: Sequence[int], *, repeats: int = 5,
                       warmup: int = 2, synchronize: Callable[[], None] | None = None, hardware: str = "",
                       graph_max_tokens: int | None = None, progress: bool = True,
                       verify_requests_fn: Callable[[int, int], Callable[[], None] | None] | None = None,
                       tokens_by_requests: dict[int, Sequence[int]] | None = None,
                       steps_per_call: int = 1, marginal: bool = False) -> CostTable:
    """Profile dummy steps and return a monotone cost table.

    Each size is run ``warmup`` times untimed (allocator, autotuning, lazy graph capture), then ``repeats``
    times timed with ``time.perf_counter``; the median is kept because step times have a long right tail
    (the odd host hiccup) that a mean would absorb. ``synchronize`` (``torch.cuda.synchronize`` on a GPU)
    runs before and after each timed call, since CUDA launches return before the work is done. A function that
    returns a callable has only prepared the step (placeholder requests put in their slots: what admission does once
    per request, not every step), and only the returned step is timed; one that returns ``None`` is timed whole.

    Args:
        verify_fn: runs (or prepares and returns) one dummy verify forward of the given total token count.
        draft_fn: runs (or prepares and returns) one dummy drafter step for the given number of requests.
        token_counts: verify sizes to measure (the engine's bucket sizes, plus eager sizes if any).
        request_counts: request counts to measure the drafter at (may be empty: drafter not modelled).
        repeats: timed calls per size.
        warmup: untimed calls per size before timing.
        synchronize: device barrier, or ``None`` on the CPU.
        hardware: device name recorded in the table.
        graph_max_tokens: largest captured graph size (must be among ``token_counts``), ``None`` if all are.
        progress: show a tqdm bar.
        verify_requests_fn: runs (or prepares and returns) one dummy verify of ``n`` tokens carried by ``r``
            requests, called as ``verify_requests_fn(r, n)``; with ``tokens_by_requests`` it fills
            ``verify_ms_by_requests``.
        tokens_by_requests: request count ``r`` -> the token counts (each ≥ r) to measure it at.
        steps_per_call: how many steps one timed call runs (steps launched back to back, as an engine that runs
            ahead of its reads does); each sample is the call's time divided by it.
        marginal: with ``steps_per_call`` > 1, price a step at what one more step adds: each sample times the
            prepared step run once and run ``steps_per_call`` times (the preparations return steps that take how
            many to run back to back), and is their difference over ``steps_per_call - 1``. A call's fixed part —
            the first launch before the device starts, the last read after it stops — is then not charged to each
            step: a pipeline that never drains pays it once, not every ``steps_per_call`` steps, and it weighs most
            on the cheapest steps. (A sample the noise makes non-positive falls back to the call's time divided.)
    """
    if repeats < 1 or warmup < 0 or steps_per_call < 1:
        raise ValueError(f"need repeats ≥ 1, warmup ≥ 0 and steps_per_call ≥ 1, got repeats={repeats}, "
                         f"warmup={warmup}, steps_per_call={steps_per_call}")
    marginal = marginal and steps_per_call > 1
    sync = synchronize or (lambda: None)

    def timed_ms(fn: Callable[[int], Callable[..., None] | None], size: int, steps: int | None) -> float:
        """One timed call: the whole step, or its preparation (untimed) and then the step it returns (``steps``
        of them back to back when given)."""
        sync()
        start = time.perf_counter()
        step = fn(size)
        if callable(step):
            sync()
            start = time.perf_counter()
            step() if steps is None else step(steps)
        sync()
        return (time.perf_counter() - start) * 1e3

    def median_ms(fn: Callable[[int], Callable[..., None] | None], size: int) -> float:
        for _ in range(warmup):
            step = fn(size)
            if callable(step):
                step()
        samples = []
        for _ in range(repeats):
            if marginal:
                samples.append(marginal_ms(timed_ms(fn, size, 1), timed_ms(fn, size, steps_per_call), steps_per_call))
            else:
                samples.append(timed_ms(fn, size, None) / steps_per_call)
        return statistics.median(samples)

    tokens_by_requests = tokens_by_requests or {}
    if tokens_by_requests and verify_requests_fn is None:
        raise ValueError("tokens_by_requests needs verify_requests_fn")
    verify, draft = {}, {}
    by_requests = {int(r): {} for r in sorted(tokens_by_requests)}
    # (the curve a measurement goes to, what to run, its size)
    jobs = [(verify, verify_fn, int(n)) for n in token_counts] + [(draft, draft_fn, int(r)) for r in request_counts]
    jobs += [(by_requests[int(r)], lambda n, r=int(r): verify_requests_fn(r, n), int(n))
             for r in sorted(tokens_by_requests) for n in tokens_by_requests[r]]
    for curve, fn, size in tqdm(jobs, desc="profiling step costs", disable=not progress):
        curve[size] = median_ms(fn, size)
    meta = {"repeats": repeats, "warmup": warmup, "steps_per_call": steps_per_call, "marginal": marginal}
    return CostTable(verify, draft, graph_max_tokens, hardware, meta, by_requests).monotone()


def marginal_ms(one_ms: float, many_ms: float, steps: int) -> float:
    """What one more step adds: a call of ``steps`` steps back to back took ``many_ms``, the same call of one step
    ``one_ms``; their difference per extra step leaves out what every call pays once (the first launch, the last
    read). A difference the noise makes non-positive falls back to the long call divided by its steps."""
    extra = (many_ms - one_ms) / (steps - 1)
    return extra if extra > 0 else many_ms / steps


def hardware_name(device: torch.device | str) -> str:
    """The device as every measured number records it: GPU name and compute capability, or the CPU and its threads."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------- helpers
def _checked_curve(curve: Any, name: str) -> dict[int, float]:
    if not isinstance(curve, dict):
        raise ValueError(f"{name} must be a dict of size -> milliseconds, got {type(curve).__name__}")
    out = {}
    for k, v in curve.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{name} key {k!r} is not a positive integer size")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}[{k}] = {v!r} is not a positive finite number of milliseconds")
        out[k] = float(v)
    return dict(sorted(out.items()))


def _int_keys(curve: dict[str, Any], name: str) -> dict[int, Any]:
    out = {}
    for k, v in curve.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise ValueError(f"{name} key {k!r} is not an integer size") from None
    return out


def _running_max(curve: dict[int, float]) -> dict[int, float]:
    out, best = {}, 0.0
    for k in sorted(curve):
        best = max(best, curve[k])
        out[k] = best
    return out


def _check_count(x: int, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {x!r}")
    return x


def _linear(curve: dict[int, float], points: list[int], x: int, name: str) -> float:
    """Piecewise-linear value at ``x`` through ``points`` (sorted), extended by the end segments."""
    if len(points) == 1:
        if x <= points[0]:
            return curve[points[0]]
        raise ValueError(f"{x} lies above {name}'s only measured size in its region ({points[0]}); "
                         "at least two sizes are needed to extrapolate")
    i = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
    x0, x1 = points[i - 1], points[i]
    y0, y1 = curve[x0], curve[x1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
