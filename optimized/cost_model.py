"""Start-up profiling of the engine's step costs: the measured SPS curve of the adaptive scheduler (docs/method.md §5).

``reference/cost_model.py`` defines the table (verify cost keyed by token count, drafter cost keyed by request
count, forced monotone, a staircase over the captured sizes); this file fills it with times measured on the
engine that will serve, the way SERVING-NOTES ("The cost table") asks:

* **After graph capture, through the serving path.** A verify sample is one ``Engine.profile_verify`` call: the
  engine's own ``_verify_and_commit`` on placeholder requests — layout on the device, the verify graph of that
  bucket, ``p_t``, rejection sampling, the one token read and the host commit. A drafter sample is one
  ``Engine.profile_draft`` call: the backbone graph, the fused sequential head and STS. So the table prices what
  a step really costs, host work included, and the drafter curve comes from graph replays only.
* **Layout.** ``n`` verify tokens are carried by ``min(n, max_num_seqs)`` requests with the drafts spread evenly
  (1..γ+1 tokens each). This is exact for every no-speculation step and for every step at the largest batch;
  in between it counts more requests than a real step of ``n`` tokens has, so per-request work (KV reads, the
  host commit) is overestimated there. The table has one axis for tokens; the bias is stated, not hidden.
* **Context length.** Every placeholder request attends over ``context_len`` keys (default 256, a short chat
  turn). Profiling at a long context while serving short requests inflates the fixed part of the cost and
  argues against speculation (SERVING-NOTES).
* **Median of repeats**, with a CUDA synchronisation around each timed call on CUDA (a verify sample ends
  with a host read anyway; the drafter's does not).
* **Every bucket on the GPU with graphs**; eagerly (CPU, ``--enforce-eager``) the step time is dominated by
  launches or host math and is smooth, so a spread subset of the buckets is measured and the staircase of
  :class:`reference.cost_model.CostTable` prices the sizes in between at the next measured size (an upper
  bound, never an extrapolation).
* **Cached on disk** under a fingerprint of everything the times depend on: the model (name, every weight's
  shape and dtype), the drafter config, the device (GPU name and compute capability, or the CPU and its thread
  count), torch/triton versions, ``max_num_seqs``, γ, graphs or eager, the attention backend, the context length.
  A cached table is re-checked on load: two sizes are re-timed, and a difference above 25 % (load drift, a
  different clock) re-profiles, with a warning.

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
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from reference.cost_model import CostTable, measure_cost_table

log = logging.getLogger("dspark.cost_model")

DEFAULT_CONTEXT_LEN = 256  # keys per placeholder request: a short ShareGPT turn plus its answer so far
RECHECK_TOLERANCE = 0.25  # re-profile a cached table when a re-timed size differs by more than this fraction
EAGER_MAX_SIZES = {"cpu": 8, "cuda": 16}  # sizes per curve without graphs: smooth curves, short start-up
FINGERPRINT_VERSION = 1  # bump when the profiling method changes, so old cached tables stop matching


# ---------------------------------------------------------------------------------------------------------
# Profiling one engine
# ---------------------------------------------------------------------------------------------------------


def profile_engine(engine, *, context_len: int = DEFAULT_CONTEXT_LEN, repeats: int = 5, warmup: int = 2,
                   max_sizes: int | None = None, progress: bool = True) -> CostTable:
    """Measure the cost table of an already-built :class:`optimized.engine.Engine` (no request may be running).

    Args:
        engine: the engine that will serve (its graphs, static buffers and caches are used).
        context_len: KV length of every placeholder request; clamped to what the engine's slots hold.
        repeats: timed calls per size (the median is kept).
        warmup: untimed calls per size first.
        max_sizes: measure at most this many sizes per curve, spread over the buckets; default: every bucket
            when CUDA graphs are on, else ``EAGER_MAX_SIZES`` of the device type.
        progress: show a tqdm bar.

    Returns:
        A monotone :class:`CostTable`; ``graph_max_tokens`` is the largest verify bucket (the engine never runs
        more tokens than that in one verify step), ``meta`` records how it was measured.
    """
    if engine.has_unfinished():
        raise RuntimeError("profile_engine needs an idle engine: its placeholder requests overwrite slot state")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats ≥ 1 and warmup ≥ 0, got repeats={repeats}, warmup={warmup}")
    context_len = _fit_context(engine, context_len)
    graphs = bool(engine.verify_graphs.graphs)
    if max_sizes is None:
        max_sizes = None if graphs else EAGER_MAX_SIZES.get(engine.device.type, 8)
    # A step never carries more than (γ+1)·max_num_seqs tokens: buckets past the one covering that never run
    # (an engine without a drafter captures buckets up to 2·max_num_seqs).
    most = engine.verify_graphs.padded(engine.config.max_num_seqs * (engine.gamma + 1))
    token_counts = spread_sizes([s for s in engine.verify_graphs.sizes if s <= most], max_sizes)
    request_counts = [] if engine.drafter is None else spread_sizes(engine.draft_graphs.sizes, max_sizes)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else None  # sync: profiling, off the step loop
    t0 = time.perf_counter()
    table = measure_cost_table(
        lambda n: engine.profile_verify(n, context_len), lambda r: engine.profile_draft(r, context_len),
        token_counts, request_counts, repeats=repeats, warmup=warmup, synchronize=sync,
        hardware=hardware_name(engine.device), graph_max_tokens=max(token_counts), progress=progress)
    table.meta.update({
        "context_len": context_len, "max_num_seqs": engine.config.max_num_seqs, "gamma": engine.gamma,
        "cuda_graphs": graphs, "dtype": str(engine.target.dtype), "torch": torch.__version__,
        "layout": "n tokens over min(n, max_num_seqs) requests, drafts spread evenly",
        "verify_stage": "layout + verify graph + p_t + rejection sampling + token read + host commit",
        "draft_stage": "backbone graph + fused sequential head + STS",
        "profile_s": round(time.perf_counter() - t0, 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    log.info("profiled %d verify sizes (%.3f..%.3f ms) and %d drafter sizes (%s ms) on %s in %.1f s",
             len(table.verify_ms), min(table.verify_ms.values()), max(table.verify_ms.values()), len(table.draft_ms),
             _range(table.draft_ms), table.hardware, table.meta["profile_s"])
    return table


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


def _fit_context(engine, context_len: int) -> int:
    most = engine.config.max_seq_len - 2 * engine.gamma - 4  # Engine._profile_sequences' bound
    if context_len < 1:
        raise ValueError(f"context_len must be ≥ 1, got {context_len}")
    if context_len > most:
        log.warning("context_len %d does not fit max_seq_len %d; profiling at %d", context_len,
                    engine.config.max_seq_len, most)
        return most
    return context_len


# ---------------------------------------------------------------------------------------------------------
# The on-disk cache
# ---------------------------------------------------------------------------------------------------------


def cost_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$DSPARK_CACHE/cost``, else ``~/.cache/dspark/cost``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("DSPARK_CACHE"):
        return Path(os.environ["DSPARK_CACHE"]) / "cost"
    return Path.home() / ".cache" / "dspark" / "cost"


def fingerprint(engine, context_len: int = DEFAULT_CONTEXT_LEN) -> tuple[str, dict[str, Any]]:
    """A key for everything the measured times depend on, and the inputs it was hashed from."""
    hf = engine.reference_target.model
    weights = hashlib.sha256(json.dumps([(name, list(p.shape), str(p.dtype)) for name, p in
                                         hf.named_parameters()]).encode()).hexdigest()[:16]
    drafter = None
    if engine.drafter is not None:
        drafter = json.loads(json.dumps(dataclasses.asdict(engine.ref_drafter.config), default=str, sort_keys=True))
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - only where triton is absent
        triton_version = None
    inputs = {
        "version": FINGERPRINT_VERSION,
        "model": engine.reference_target.name, "weights": weights, "dtype": str(engine.target.dtype),
        "drafter": drafter, "device": hardware_name(engine.device), "torch": torch.__version__,
        "triton": triton_version, "max_num_seqs": engine.config.max_num_seqs, "gamma": engine.gamma,
        "cuda_graphs": bool(engine.verify_graphs.graphs),
        "attention_backend": getattr(engine.target, "attention_backend", None),
        "layer_backend": getattr(engine.target, "layer_backend", None),
        "context_len": _fit_context(engine, context_len),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return key, inputs


def cached_profile(engine, *, cache_dir: str | Path | None = None, context_len: int = DEFAULT_CONTEXT_LEN,
                   repeats: int = 5, recheck: bool = True, tolerance: float = RECHECK_TOLERANCE,
                   progress: bool = True) -> CostTable:
    """The engine's cost table from the fingerprint cache (re-checked), else profiled now and cached.

    Args:
        engine: an idle engine, as for :func:`profile_engine`.
        cache_dir: where tables live (see :func:`cost_cache_dir`).
        context_len, repeats, progress: as for :func:`profile_engine`.
        recheck: re-time the smallest and the largest verify size of a cached table before trusting it.
        tolerance: relative difference above which the cached table is stale.
    """
    key, inputs = fingerprint(engine, context_len)
    path = cost_cache_dir(cache_dir) / f"{key}.json"
    if path.is_file():
        try:
            table = CostTable.load(path)
        except ValueError as e:
            log.warning("unreadable cached cost table %s (%s); re-profiling", path, e)
        else:
            if table.meta.get("fingerprint") != key:
                log.warning("cached cost table %s carries another fingerprint; re-profiling", path)
            elif not recheck or recheck_table(engine, table, tolerance=tolerance):
                log.info("cost table: cache hit %s", path)
                return table
    table = profile_engine(engine, context_len=context_len, repeats=repeats, progress=progress)
    table.meta.update({"fingerprint": key, "fingerprint_inputs": inputs})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    table.save(tmp)
    tmp.replace(path)  # atomic: a concurrent reader sees the old table or the new one, never half a file
    log.info("cost table cached at %s", path)
    return table


def recheck_table(engine, table: CostTable, *, tolerance: float = RECHECK_TOLERANCE, repeats: int = 3) -> bool:
    """Re-time the smallest and the largest verify size; False (and a warning) if either moved by > tolerance."""
    context_len = int(table.meta.get("context_len", DEFAULT_CONTEXT_LEN))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)  # sync: profiling only
    sizes = sorted(table.verify_ms)
    for n in (sizes[0], sizes[-1]):
        engine.profile_verify(n, context_len)  # warm-up
        samples = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            engine.profile_verify(n, context_len)
            sync()
            samples.append((time.perf_counter() - start) * 1e3)
        now, then = statistics.median(samples), table.verify_ms[n]
        if abs(now - then) > tolerance * then:
            log.warning("cached cost table is stale: verify(%d) took %.3f ms now vs %.3f ms cached (> %.0f%%); "
                        "re-profiling", n, now, then, 100 * tolerance)
            return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Entry point used by optimized/generate.py
# ---------------------------------------------------------------------------------------------------------


def profile_engine_cost_table(target, drafter, *, max_num_seqs: int, device: str, dtype: torch.dtype,
                              enforce_eager: bool = False, context_len: int = DEFAULT_CONTEXT_LEN, repeats: int = 5,
                              cache_dir: str | Path | None = None) -> CostTable:
    """Build a profiling engine with the serving settings, and return its (cached) cost table.

    The engine is built with the same ``max_num_seqs``, γ, device and graph setting as the one that will serve,
    so its buckets and graphs are the same; it is released before returning. An engine that is already built
    should call :func:`cached_profile` on itself instead (no second graph capture).
    """
    from optimized.engine import Engine, EngineConfig
    from reference.config import SchedulerConfig

    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be ≥ 1, got {max_num_seqs}")
    gamma = drafter.config.block_size if drafter is not None else 0
    config = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=context_len + 2 * gamma + 8, device=device,
                          dtype=dtype, enforce_eager=enforce_eager)
    sched = SchedulerConfig(mode="fixed" if drafter is not None else "none", k=max(gamma, 1))
    engine = Engine(target, drafter, config, sched)
    table = cached_profile(engine, cache_dir=cache_dir, context_len=context_len, repeats=repeats)
    del engine
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # give the profiling engine's caches and graph pool back before serving
    return table


def hardware_name(device: torch.device | str) -> str:
    """The device as recorded with every number: GPU name and compute capability, or the CPU and its threads."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _range(curve: dict[int, float]) -> str:
    if not curve:
        return "none"
    values = [v for v in curve.values() if math.isfinite(v)]
    return f"{min(values):.3f}..{max(values):.3f}"
