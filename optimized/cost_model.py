"""Start-up profiling of the engine's step costs: the measured SPS curve the adaptive scheduler needs.

``reference/cost_model.py`` defines the table (verify cost keyed by token count and, with a drafter, by request
count too; drafter cost keyed by request count; forced monotone, a staircase over the captured sizes;
docs/method.md §5); this file fills it with times
measured on the model runner of the engine that will serve (``engine.runner``):

* **After graph capture, through the serving path.** A verify sample is the stage that
  ``ModelRunner.prepare_dummy_verify`` returns: the runner's own ``verify`` stage on placeholder requests — layout on
  the device, the verify graph of that bucket, ``p_t``, rejection sampling and the one token read (the scheduler's
  host commit is not included). A drafter sample is the stage ``ModelRunner.prepare_dummy_draft`` returns: the
  backbone graph, the fused sequential head and STS. Putting the placeholders into their slots (a few small copies
  per request, which a real request pays once at admission) happens before the clock starts. Timed with it, the
  set-up added tens of µs per request on the H200: a one-token verify of 64 requests was priced at 6.5 ms while a
  whole plain-decoding step of 64 requests took 1.9 ms in the same run. So the table
  prices what a step's device work really costs, and the drafter curve comes from graph replays only.
* **Layout.** The token curve carries ``n`` verify tokens by ``min(n, max_num_seqs)`` requests with the drafts
  spread evenly (1..γ+1 tokens each): exact for every no-speculation step and for every step at the largest batch,
  but in between it counts more requests than a real step of ``n`` tokens has, and per-request work (KV reads, the
  token read) is a large part of a small model's step (one request's 8 tokens cost about what 1 does; 8 requests'
  8 tokens cost more). So with a drafter the table also holds
  curves keyed by request count: for ``r`` in 1, 2, 4, … up to ``max_num_seqs``, ``n`` tokens of ``r`` requests for
  ``n`` in ``r..r·(γ+1)`` (``REQUEST_CURVE_POINTS`` says how many, spread over the verify buckets), and the
  scheduler prices a step of ``R`` requests on the curve of the smallest ``r ≥ R``
  (``reference.cost_model.CostTable.verify_time``).
* **Context length.** Every placeholder request attends over ``context_len`` keys (default 256, a short chat
  turn). Profiling at a long context while serving short requests inflates the fixed part of the cost and
  argues against speculation.
* **Priced the way the engine runs.** An engine one step ahead of its token reads (``EngineConfig.async_decode``, the
  CUDA default) overlaps a stage's host work with the previous stage's device work, so a sample there launches the
  stage ``PIPELINE_DEPTH`` times back to back, reads only the last one's tokens, and takes the difference with one
  stage launched alone, per extra stage: the larger of the host's launches and the device's work, not their sum, and
  without the pipeline's fill and drain, which a serving engine pays once and not every few steps. (Divided instead,
  the four stages' fill and drain went into each: on an H100 the drafter stage was priced at 0.396 ms for one request
  and 1.214 ms for 64, against 0.331 and 1.109 ms marginally, and runs of speculative steps cost 0.91-0.96 of their
  prices against 0.96-1.04 after: docs/benchmarks/gate-trace-all-h100.json and gate-trace-steady-h100.json.) A
  synchronous engine's sample is one stage, launch to read. While serving, ``optimized/cost_monitor.py`` compares
  the table with measured steps and rescales its prices if they drift.
* **Median of repeats**, with a CUDA synchronisation around each timed call on CUDA (a verify sample ends
  with a host read anyway; the drafter's does not).
* **Every bucket on the GPU with graphs**; eagerly (CPU, ``--enforce-eager``) the step time is dominated by
  launches or host math and is smooth, so a spread subset of the buckets is measured and the staircase of
  :class:`reference.cost_model.CostTable` prices the sizes in between at the next measured size (an upper
  bound, never an extrapolation).
* **Cached on disk** under a fingerprint of everything the times depend on: the model (name, every weight's
  shape and dtype), the drafter config (its calibration values left out: they do not change a step), the device
  (GPU name and compute capability, or the CPU and its thread count), torch/triton versions, ``max_num_seqs``, γ,
  graphs or eager, the attention backend, the context length. A cached table is re-checked on load: two sizes are
  re-timed (a median of several calls), and only a difference above 25 % on a GPU (2× on a CPU) that persists —
  every round, spread over a second, on the same side and by about the same factor (a different clock, a changed
  setting; not an outlier, not a busy moment of the host) — re-profiles, with a warning.

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length,
``SPS`` steps per second).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from optimized.config import EngineConfig
from optimized.runner import ModelRunner
from reference.config import cache_folder
from reference.cost_model import CostTable, hardware_name, marginal_ms, measure_cost_table

log = logging.getLogger("dspark.cost_model")

DEFAULT_CONTEXT_LEN = 256  # keys per placeholder request: a short ShareGPT turn plus its answer so far
# Re-profile a cached table when a re-timed size differs by more than this fraction, per device type. On a GPU, 25 %
# is far outside a graph replay's noise. A CPU's step times move with whatever else the host runs (a 2-core machine
# running tests beside a start-up measured 1.25-1.6x its cached times), and its tables steer only demos and tests:
# there a table is stale only when it is off by 2x.
RECHECK_TOLERANCE = {"cuda": 0.25, "cpu": 1.0}
# A re-check that finds a size off times it again, up to RECHECK_ROUNDS rounds in all, after a pause of
# RECHECK_PAUSE_S each: a burst of load (the HTTP side importing its stack beside the engine's start-up, a neighbour's
# job) slows one round by a random amount, and a second later it has moved or gone; a drift (another clock, another
# setting) reads the same in every round. Confirming costs about a second; a needless re-profile on a CPU cost 46 s of
# a 62 s start-up.
RECHECK_ROUNDS = 3
RECHECK_PAUSE_S = 0.5
# The rounds of a drift agree on its size: their ratios to the cached time lie within this factor of one another
# (half the tolerance, e.g. 1.5× on a CPU); readings that scatter wider are load, not a new steady cost.
RECHECK_AGREEMENT = 0.5
EAGER_MAX_SIZES = {"cpu": 8, "cuda": 16}  # sizes per curve without graphs: smooth curves, short start-up
FINGERPRINT_VERSION = 7  # bump when the profiling method changes, so old cached tables stop matching
# Stages per timed sample of an engine that runs one step ahead of its reads (ModelRunner.pipelined): launched back to
# back, only the last one's tokens read, so that each stage's price is what it costs in the pipeline (the larger of
# its host launches and its device work) rather than launch + device + read in series. Four amortise the one read
# and the fill of the pipeline to a quarter while keeping a sample's context growth (≤ 3 blocks) small.
PIPELINE_DEPTH = 4
# Request-count curves: (request counts, token counts per curve) measured at most, with CUDA graphs and without
# (eager steps are smooth and slow to time, so fewer points do).
REQUEST_CURVE_POINTS = {True: (None, 6), False: (4, 3)}
# The drafter config's calibration fields (reference.config.DrafterConfig): per mode and slot, fitted after training.
CALIBRATION_FIELDS = ("sts_temperatures", "sts_biases", "sts_log_weights")


# ---------------------------------------------------------------------------------------------------------
# Profiling one engine's runner
# ---------------------------------------------------------------------------------------------------------


def profile_engine(runner: ModelRunner, *, context_len: int = DEFAULT_CONTEXT_LEN, repeats: int = 5, warmup: int = 2,
                   max_sizes: int | None = None, progress: bool = True) -> CostTable:
    """Measure the cost table of an engine's model runner (``engine.runner``; no request may hold a slot).

    Args:
        runner: the runner of the engine that will serve (its graphs, static buffers and caches are used).
        context_len: KV length of every placeholder request; clamped to what the runner's slots hold.
        repeats: timed calls per size (the median is kept).
        warmup: untimed calls per size first.
        max_sizes: measure at most this many sizes per curve, spread over the buckets; default: every bucket
            when CUDA graphs are on, else ``EAGER_MAX_SIZES`` of the device type.
        progress: show a tqdm bar.

    Returns:
        A monotone :class:`CostTable`; ``graph_max_tokens`` is the largest verify bucket (the engine never runs
        more tokens than that in one verify step), ``meta`` records how it was measured.
    """
    if not runner.idle:
        raise RuntimeError("profile_engine needs an idle engine: its placeholder requests overwrite slot state")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats ≥ 1 and warmup ≥ 0, got repeats={repeats}, warmup={warmup}")
    context_len = _fit_context(runner, context_len)
    depth = _depth(runner)
    graphs = runner.uses_graphs
    if max_sizes is None:
        max_sizes = None if graphs else EAGER_MAX_SIZES.get(runner.device.type, 8)
    # A step never carries more than (γ+1)·max_num_seqs tokens: buckets past the one covering that never run.
    most = runner.verify_graphs.padded(runner.config.max_num_seqs * (runner.gamma + 1))
    token_counts = spread_sizes([s for s in runner.verify_graphs.sizes if s <= most], max_sizes)
    request_counts = [] if runner.drafter is None else spread_sizes(runner.draft_graphs.sizes, max_sizes)
    tokens_by_requests = request_curves(runner, *REQUEST_CURVE_POINTS[graphs]) if runner.gamma else {}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else None  # sync: profiling, off the step loop
    t0 = time.perf_counter()
    table = measure_cost_table(
        lambda n: runner.prepare_dummy_verify(n, context_len, repeat=depth),
        lambda r: runner.prepare_dummy_draft(r, context_len, repeat=depth),
        token_counts, request_counts, repeats=repeats, warmup=warmup, synchronize=sync,
        hardware=hardware_name(runner.device), graph_max_tokens=max(token_counts), progress=progress,
        verify_requests_fn=lambda r, n: runner.prepare_dummy_verify(n, context_len, num_requests=r, repeat=depth),
        tokens_by_requests=tokens_by_requests, steps_per_call=depth, marginal=depth > 1)
    table.meta.update({
        "context_len": context_len, "max_num_seqs": runner.config.max_num_seqs, "gamma": runner.gamma,
        "cuda_graphs": graphs, "dtype": str(runner.target.dtype), "torch": torch.__version__,
        "layout": "n tokens over min(n, max_num_seqs) requests, drafts spread evenly; request curves: n tokens "
                  "over r requests",
        "verify_stage": "layout + verify graph + p_t + rejection sampling + token read",
        "draft_stage": "backbone graph + fused sequential head + STS",
        # stages launched back to back, priced at what one more adds (PIPELINE_DEPTH against one, a sample)
        "pipelined": depth > 1,
        "profile_s": round(time.perf_counter() - t0, 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    log.info("profiled %d verify sizes (%.3f..%.3f ms) and %d drafter sizes (%s ms) on %s in %.1f s",
             len(table.verify_ms), min(table.verify_ms.values()), max(table.verify_ms.values()), len(table.draft_ms),
             _range(table.draft_ms), table.hardware, table.meta["profile_s"])
    return table


def request_curves(runner: ModelRunner, max_counts: int | None, sizes_per_curve: int) -> dict[int, list[int]]:
    """Request count ``r`` -> the token counts to profile it at: ``r`` in 1, 2, 4, … and ``max_num_seqs`` (at most
    ``max_counts`` of them, spread), each at up to ``sizes_per_curve`` verify sizes in ``r..r·(γ+1)``, always ``r``
    itself (no drafts) and ``r·(γ+1)`` (every draft)."""
    most = runner.config.max_num_seqs
    counts = spread_sizes(sorted({1 << i for i in range(most.bit_length()) if 1 << i <= most} | {most}), max_counts)
    out = {}
    for r in counts:
        full = r * (runner.gamma + 1)
        sizes = [s for s in runner.verify_graphs.sizes if r < s < full] + [r, full]
        out[r] = spread_sizes(sizes, sizes_per_curve)
    return out


def spread_sizes(sizes: list[int], max_sizes: int | None) -> list[int]:
    """At most ``max_sizes`` of the sorted bucket ``sizes``, always the first and the last, geometrically spread.

    Geometric, because step cost changes fastest (relative to itself) at small sizes, where batch-1 decisions
    are made. Each target is rounded up to a bucket, so every measured size is one the engine really runs.
    """
    sizes = sorted(set(int(s) for s in sizes))
    if not sizes:
        raise ValueError("no sizes to profile")
    if max_sizes is None or len(sizes) <= max_sizes:
        return sizes
    if max_sizes < 2:
        raise ValueError(f"max_sizes must be ≥ 2 (the smallest and the largest bucket), got {max_sizes}")
    lo, hi = sizes[0], sizes[-1]
    picked = set()
    for i in range(max_sizes):
        target = lo * (hi / lo) ** (i / (max_sizes - 1))
        picked.add(next(s for s in sizes if s >= target - 1e-9))
    return sorted(picked)


def _depth(runner: ModelRunner) -> int:
    """Stages per timed sample: ``PIPELINE_DEPTH`` where the engine runs one step ahead of its reads, else 1."""
    return PIPELINE_DEPTH if runner.pipelined else 1


def _fit_context(runner: ModelRunner, context_len: int) -> int:
    # the placeholders' bound (ModelRunner.prepare_dummy_verify), less the blocks a pipelined sample moves on by
    most = runner.config.max_seq_len - 2 * runner.gamma - 4 - (_depth(runner) - 1) * (runner.gamma + 1)
    if context_len < 1:
        raise ValueError(f"context_len must be ≥ 1, got {context_len}")
    if context_len > most:
        log.warning("context_len %d does not fit max_seq_len %d; profiling at %d", context_len,
                    runner.config.max_seq_len, most)
        return most
    return context_len


# ---------------------------------------------------------------------------------------------------------
# The on-disk cache
# ---------------------------------------------------------------------------------------------------------


def cost_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$DSPARK_CACHE/cost``, else ``~/.cache/dspark/cost``."""
    return Path(cache_dir) if cache_dir is not None else cache_folder("cost")


def fingerprint(runner: ModelRunner, context_len: int = DEFAULT_CONTEXT_LEN) -> tuple[str, dict[str, Any]]:
    """A key for everything the measured times depend on, and the inputs it was hashed from."""
    hf = runner.reference_target.model
    weights = hashlib.sha256(json.dumps([(name, list(p.shape), str(p.dtype)) for name, p in
                                         hf.named_parameters()]).encode()).hexdigest()[:16]
    drafter = None
    if runner.drafter is not None:
        drafter = json.loads(json.dumps(dataclasses.asdict(runner.ref_drafter.config), default=str, sort_keys=True))
        # Calibration values change what the confidences are, not what a step costs: keep only which modes carry
        # which kind of calibration (the ops the draft stage runs), so a recalibrated drafter reuses its table.
        for name in CALIBRATION_FIELDS:
            drafter[name] = sorted(drafter.get(name) or {})
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - only where triton is absent
        triton_version = None
    inputs = {
        "version": FINGERPRINT_VERSION,
        "model": runner.reference_target.name, "weights": weights, "dtype": str(runner.target.dtype),
        "drafter": drafter, "device": hardware_name(runner.device), "torch": torch.__version__,
        "triton": triton_version, "max_num_seqs": runner.config.max_num_seqs, "gamma": runner.gamma,
        "cuda_graphs": runner.uses_graphs,
        "verify_buckets": list(runner.verify_graphs.sizes),  # the table's staircase steps at these sizes
        "attention_backend": getattr(runner.target, "attention_backend", None),
        "layer_backend": getattr(runner.target, "layer_backend", None),
        # steps of at most this many tokens run the fused small-batch projections: their cost changes with it
        "linear_rows": runner.target.linear_rows,
        "context_len": _fit_context(runner, context_len),
        "pipelined": runner.pipelined,  # stages priced back to back (one step ahead) or launch-to-read
        "draft_context_lag": runner.context_lag,  # plain steps with a drafter: the target alone, or + the context
    }
    if runner.target.row_invariant:  # one tile shape a kernel: other prices (the default engine's keys unchanged)
        inputs["row_invariant"] = True
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return key, inputs


def cached_profile(runner: ModelRunner, *, cache_dir: str | Path | None = None, context_len: int = DEFAULT_CONTEXT_LEN,
                   repeats: int = 5, recheck: bool = True, tolerance: float | None = None,
                   progress: bool = True) -> CostTable:
    """The runner's cost table from the fingerprint cache (re-checked), else profiled now and cached.

    Args:
        runner: an idle engine's runner (``engine.runner``), as for :func:`profile_engine`.
        cache_dir: where tables live (see :func:`cost_cache_dir`).
        context_len, repeats, progress: as for :func:`profile_engine`.
        recheck: re-time the smallest and the largest verify size of a cached table before trusting it.
        tolerance: relative difference above which the cached table is stale (None: ``RECHECK_TOLERANCE`` of the
            runner's device type).
    """
    key, inputs = fingerprint(runner, context_len)
    path = cost_cache_dir(cache_dir) / f"{key}.json"
    if path.is_file():
        try:
            table = CostTable.load(path)
        except ValueError as e:
            log.warning("unreadable cached cost table %s (%s); re-profiling", path, e)
        else:
            if table.meta.get("fingerprint") != key:
                log.warning("cached cost table %s carries another fingerprint; re-profiling", path)
            elif not recheck or recheck_table(runner, table, tolerance=tolerance):
                log.info("cost table: cache hit %s", path)
                return table
    table = profile_engine(runner, context_len=context_len, repeats=repeats, progress=progress)
    table.meta.update({"fingerprint": key, "fingerprint_inputs": inputs})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    table.save(tmp)
    tmp.replace(path)  # atomic: a concurrent reader sees the old table or the new one, never half a file
    log.info("cost table cached at %s", path)
    return table


def recheck_table(runner: ModelRunner, table: CostTable, *, tolerance: float | None = None,
                  repeats: int = 3, rounds: int = RECHECK_ROUNDS) -> bool:
    """Re-time the smallest and the largest verify size; False (and a warning) if either has drifted by more than a
    factor of 1 + ``tolerance``, slower or faster.

    Noise is told from drift in three ways. Each reading is the median of ``repeats`` timed calls, so an outlier call
    does not count. A size off in the first round is timed again, up to ``rounds`` rounds, ``RECHECK_PAUSE_S`` apart,
    and any round within the tolerance clears it: a busy moment of the host passes, a drift does not. And the rounds
    must agree: all beyond the tolerance on the same side, and, when slower, their ratios to the cached time within a
    factor of 1 + ``RECHECK_AGREEMENT`` · ``tolerance`` of one another (load slows calls by random amounts; a new clock
    or setting by a steady one). Rounds all faster than the table are drift however they scatter: load never makes a
    call faster (a table measured on a slower machine reads 100× too slow here, in rounds that scatter by 2× on a busy
    2-core CI host). ``tolerance`` None: ``RECHECK_TOLERANCE`` of the runner's device type."""
    if tolerance is None:
        tolerance = RECHECK_TOLERANCE.get(runner.device.type, RECHECK_TOLERANCE["cuda"])
    if repeats < 1 or rounds < 1:
        raise ValueError(f"need repeats ≥ 1 and rounds ≥ 1, got repeats={repeats}, rounds={rounds}")
    context_len = int(table.meta.get("context_len", DEFAULT_CONTEXT_LEN))
    depth = int(table.meta.get("steps_per_call", 1))  # timed the way the table was
    marginal = bool(table.meta.get("marginal", False))
    sizes = sorted(table.verify_ms)
    for n in (sizes[0], sizes[-1]):
        runner.prepare_dummy_verify(n, context_len, repeat=depth)()  # warm-up
        then, ratios = table.verify_ms[n], []
        for r in range(rounds):
            if r:
                time.sleep(RECHECK_PAUSE_S)
            now = statistics.median(time_verify(runner, n, context_len, depth, marginal) for _ in range(repeats))
            ratios.append(now / then)
            if max(now / then, then / now) <= 1.0 + tolerance:  # within the factor either way: this size is fine
                break
        else:
            faster = all(x < 1 for x in ratios)
            same_side = faster or all(x > 1 for x in ratios)
            steady = max(ratios) / min(ratios) <= 1.0 + RECHECK_AGREEMENT * tolerance
            seen = "/".join(f"{x * then:.3f}" for x in ratios)
            if same_side and (steady or faster):  # load slows calls, never speeds them up: faster rounds are drift
                log.warning("cached cost table is stale: verify(%d) took %s ms now vs %.3f ms cached (beyond %.0f%% "
                            "in %d rounds); re-profiling", n, seen, then, 100 * tolerance, rounds)
                return False
            log.info("cost table re-check: verify(%d) read %s ms vs %.3f ms cached, %s: host noise, table kept", n,
                     seen, then, "on both sides" if not same_side else "scattered")
    return True


def time_verify(runner: ModelRunner, n: int, context_len: int, depth: int, marginal: bool = False) -> float:
    """Milliseconds per stage of one timed dummy verify stage of ``n`` tokens (``depth`` stages back to back), its
    placeholders' set-up untimed; the re-check's one clock reading. ``marginal``: what ``depth`` stages take beyond
    one, per stage (the table's ``meta["marginal"]``, ``reference.cost_model.measure_cost_table``)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)  # sync: profiling only

    def once(steps: int) -> float:
        step = runner.prepare_dummy_verify(n, context_len, repeat=depth)
        sync()
        start = time.perf_counter()
        step(steps)
        sync()
        return (time.perf_counter() - start) * 1e3

    if not marginal or depth < 2:
        return once(depth) / depth
    return marginal_ms(once(1), once(depth), depth)


# ---------------------------------------------------------------------------------------------------------
# A profile before the serving engine exists
# ---------------------------------------------------------------------------------------------------------


def profile_engine_cost_table(target, drafter, *, max_num_seqs: int, device: str, dtype: torch.dtype,
                              enforce_eager: bool = False, context_len: int = DEFAULT_CONTEXT_LEN, repeats: int = 5,
                              cache_dir: str | Path | None = None) -> CostTable:
    """Build a profiling runner with the serving settings, and return its (cached) cost table.

    The runner is built with the same ``max_num_seqs``, γ, device and graph setting as the engine that will serve,
    so its buckets and graphs are the same; it is released before returning. An engine that is already built
    should call :func:`cached_profile` on its own runner instead (no second graph capture).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be ≥ 1, got {max_num_seqs}")
    gamma = drafter.config.block_size if drafter is not None else 0
    config = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=context_len + 2 * gamma + 8, device=device,
                          dtype=dtype, enforce_eager=enforce_eager)
    runner = ModelRunner(target, drafter, config)
    table = cached_profile(runner, cache_dir=cache_dir, context_len=context_len, repeats=repeats)
    del runner
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # give the profiling runner's caches and graph pool back before serving
    return table


def _range(curve: dict[int, float]) -> str:
    if not curve:
        return "none"
    values = [v for v in curve.values() if math.isfinite(v)]
    return f"{min(values):.3f}..{max(values):.3f}"
