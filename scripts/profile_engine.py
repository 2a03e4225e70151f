"""Where a decoding step's time goes: one engine configuration under ``torch.profiler``.

``scripts.bench_engine`` says *how fast* each policy is; this script says *why*, for one configuration (mode ×
batch size). On the H200 (2026-11-29) a verify step cost 4.2 ms at one token and a draft stage 2.3 ms at one request
for a 135M target whose weights an H200 reads in < 0.1 ms (``docs/benchmarks/engine-h200.json``): the time is in
launches and serial kernels, and this is the tool that splits it.

Method. The engine is built as a server would build it (CUDA graphs unless ``--enforce-eager``), ``--batch-size``
requests are admitted and prefilled, ``--warmup`` decoding steps run, then:

1. ``--steps`` steps are timed without the profiler (device synchronised around each): the median step time;
2. the same number of further steps run under ``torch.profiler`` (CPU and, on CUDA, kernel activity), and the
   report aggregates per step: device kernel time, the number of kernel launches the host issued
   (``cudaLaunchKernel``-like runtime calls) against graph replays (``cudaGraphLaunch``), and the top operators by
   self device time and by self host time.

``--refill TOKENS`` profiles a server's steady state instead of a closed batch: each request asks for a length drawn
from the seed in ``[TOKENS / 2, TOKENS]``, and before every step the waiting queue is topped up to ``--batch-size``
requests, so a finished request's slot is refilled at once and steps that also prefill a new prompt mix with steps
that only decode. The report then splits the timed steps (``refill``): the median step with and without a prefill,
the share of steps that prefilled, and the median prefill stage (launch to the read of the first tokens, which also
waits for whatever the device still runs).

Usage (H200)::

    python -m scripts.profile_engine --model /tmp/stage/target.gguf --mode fixed:3 --batch-size 1 \\
        --out docs/benchmarks/profile-h200-fixed3-b1.json [--trace trace.json]

Names follow ``docs/method.md`` (``ℓ`` verify length, ``τ`` emitted tokens per verify step).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from optimized.cost_model import DEFAULT_CONTEXT_LEN, cached_profile
from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.kernels import linear
from reference.cli import DEFAULT_DRAFTER, LOG_FORMAT, load_or_init_drafter
from reference.config import SchedulerConfig, SchedulingMode
from reference.cost_model import hardware_name
from reference.drafter import DSparkDrafter
from reference.target import Target
from scripts.benchmarking import (
    add_engine_source_args,
    dot_tiles_from_file,
    load_prompts,
    parse_mode,
    request_lengths,
    sync,
)

log = logging.getLogger("dspark.profile_engine")

# Host-side runtime calls that put work on the device: single kernel launches (CUDA runtime/driver names as the
# profiler reports them) versus whole-graph replays.
KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
MEMCPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyAsync", "cudaMemsetAsync")


def build_engine(target: Target, drafter: DSparkDrafter | None, mode: SchedulingMode, k: int | None,
                 batch_size: int, max_seq_len: int, enforce_eager: bool, context_len: int, cost_cache_dir: str | None,
                 seed: int, layer_backend: str | None = None, draft_ahead: bool = False,
                 async_decode: bool = False, prefill_graph_tokens: int = EngineConfig.prefill_graph_tokens,
                 linear_rows: int | None = None, batch_invariant: bool = False, keep_drafter: bool = False) -> Engine:
    """An engine sized for ``batch_size`` slots in one policy; adaptive policies get a profiled cost table. The
    drafter is attached only to a mode that drafts; ``keep_drafter`` with mode none builds a drafting engine (fixed
    K = γ) whose draft gate never opens, so every step is plain as a drafting engine runs it while its gate is closed:
    the target alone, its features parked for the drafter's context."""
    closed = keep_drafter and not mode.drafts  # plain decoding on a drafting engine: fixed K = γ, its gate shut
    if closed:
        mode, k = SchedulingMode.FIXED, drafter.config.gamma
    sched = SchedulerConfig(mode=mode) if k is None else SchedulerConfig(mode=mode, k=k)
    cfg = EngineConfig(max_num_seqs=batch_size, max_seq_len=max_seq_len, device=str(target.device),
                       dtype=target.dtype, enforce_eager=enforce_eager, seed=seed, layer_backend=layer_backend,
                       plan_ahead=True if draft_ahead else None, draft_ahead=draft_ahead, async_decode=async_decode,
                       prefill_graph_tokens=prefill_graph_tokens, linear_rows=linear_rows,
                       batch_invariant=batch_invariant)
    engine = Engine(target, drafter if mode.drafts else None, cfg, sched)
    if closed:  # every step plain: the target alone, features parked (EngineConfig.draft_context_lag)
        engine.scheduler.gate.decide = lambda seqs: False
    if mode.needs_cost_table:
        engine.set_cost_table(cached_profile(engine.runner, cache_dir=cost_cache_dir, context_len=context_len))
    return engine


def decoding_steps(engine: Engine, count: int, feed: Callable[[], None] | None = None,
                   prefills: list[tuple[bool, float]] | None = None) -> list[float]:
    """Run ``count`` engine steps; their wall times in ms (fewer if every request finished). Each step is
    synchronised, except on an engine one step ahead of its reads (``async_decode``), whose steps overlap by design:
    there a step's time is the wall time from its start to the next one's (the device synchronised before the first
    and after the last). ``feed`` runs before each step (``--refill``: top up the waiting queue); ``prefills``
    receives, per step, whether it ran a prefill stage and that stage's ms."""
    overlap = engine.pipelining["async_decode"]
    starts, ends = [], []
    sync(engine.device)
    for _ in range(count):
        if feed is not None:
            feed()
        if not engine.has_unfinished():
            break
        if not overlap:
            sync(engine.device)
        before = engine.stats["prefill_steps"], engine.stats["prefill_s"]
        starts.append(time.perf_counter())
        engine.step()
        if not overlap:
            sync(engine.device)
        ends.append(time.perf_counter())
        if prefills is not None:
            prefills.append((engine.stats["prefill_steps"] > before[0], 1e3 * (engine.stats["prefill_s"] - before[1])))
    sync(engine.device)
    if overlap and starts:
        ends = starts[1:] + [time.perf_counter()]  # a step lasts until the next one starts (the last: until idle)
    return [1e3 * (b - a) for a, b in zip(starts, ends)]


class Refill:
    """``--refill``: keeps ``batch_size`` requests waiting behind the running ones, each of a seeded length in
    ``[tokens / 2, tokens]`` (``scripts.benchmarking.request_lengths`` with spread 0.5, as ``bench_engine``'s
    ``--output-len-spread 0.5``), prompts taken in turn."""

    def __init__(self, engine: Engine, prompts: list[list[int]], batch_size: int, tokens: int, temperature: float,
                 seed: int, feeds: int) -> None:
        """``feeds``: how many times it will be called; each call adds at most ``batch_size`` requests."""
        self.engine, self.prompts, self.batch_size, self.temperature = engine, prompts, batch_size, temperature
        self.lengths = request_lengths(batch_size * (feeds + 1), max(1, tokens), 0.5, seed)
        self.added = 0

    def __call__(self) -> None:
        while len(self.engine.scheduler.waiting) < self.batch_size:
            params = SamplingParams(max_new_tokens=self.lengths[self.added % len(self.lengths)],
                                    temperature=self.temperature, ignore_eos=True)
            self.engine.add_request(self.prompts[self.added % len(self.prompts)], params, request_id=self.added)
            self.added += 1


def refill_report(prefills: list[tuple[bool, float]], times: list[float], tokens: int) -> dict[str, Any]:
    """The timed steps of a ``--refill`` run, split by whether they prefilled."""
    with_p = [t for t, (p, _) in zip(times, prefills, strict=True) if p]
    without = [t for t, (p, _) in zip(times, prefills, strict=True) if not p]
    stage = [ms for p, ms in prefills if p]
    return {"tokens": tokens, "prefill_step_fraction": len(with_p) / len(times) if times else None,
            "step_ms_median_with_prefill": statistics.median(with_p) if with_p else None,
            "step_ms_median_without_prefill": statistics.median(without) if without else None,
            "prefill_stage_ms_median": statistics.median(stage) if stage else None}


def summarize_profile(prof, steps: int, top: int = 15) -> dict[str, Any]:
    """Per-step aggregates of a ``torch.profiler`` run: launches, graph replays, device time, top operators."""
    steps = max(steps, 1)
    rows = []
    launches = graph_launches = memcpys = 0
    for e in prof.key_averages():
        name = e.key
        if name in KERNEL_LAUNCH_CALLS:
            launches += e.count
        elif name in GRAPH_LAUNCH_CALLS:
            graph_launches += e.count
        elif name in MEMCPY_CALLS:
            memcpys += e.count
        device_us = float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)
        rows.append({"name": name, "calls_per_step": e.count / steps,
                     "self_host_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                     "self_device_ms_per_step": device_us / 1e3 / steps})
    # Device kernels: events that ran on the device (their self time is device time).
    device_ms = sum(r["self_device_ms_per_step"] for r in rows)
    by_device = sorted((r for r in rows if r["self_device_ms_per_step"] > 0),
                       key=lambda r: r["self_device_ms_per_step"], reverse=True)[:top]
    by_host = sorted(rows, key=lambda r: r["self_host_ms_per_step"], reverse=True)[:top]
    return {
        "kernel_launches_per_step": launches / steps,
        "graph_launches_per_step": graph_launches / steps,
        "memcpy_calls_per_step": memcpys / steps,
        "device_ms_per_step": device_ms,
        "top_by_device_time": [_rounded(r) for r in by_device],
        "top_by_host_time": [_rounded(r) for r in by_host],
    }


def _rounded(row: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}


def run_profile(target: Target, drafter: DSparkDrafter | None, prompts: list[list[int]], args: argparse.Namespace,
                command: str) -> dict[str, Any]:
    """Build, admit, warm up, time, profile; returns the report (also written to ``args.out`` if given)."""
    mode, k = parse_mode(args.mode, drafter.config.block_size if drafter is not None else None)
    if (mode.drafts or args.keep_drafter) and drafter is None:
        raise SystemExit(f"mode {args.mode!r}{' with --keep-drafter' if args.keep_drafter else ''} needs a drafter")
    batch = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    gamma = drafter.config.block_size if drafter is not None else 0
    # Enough room for every step this run can take: each step emits at most γ + 1 tokens per request (a closed
    # batch), or a request's own length (--refill).
    total_steps = args.warmup + 2 * args.steps
    max_new = args.refill or total_steps * (gamma + 1) + 8
    max_seq_len = max(len(p) for p in (prompts if args.refill else batch)) + max_new + 2 * gamma + 8
    engine = build_engine(target, drafter, mode, k, args.batch_size, max(max_seq_len, args.context_len + 2 * gamma + 8),
                          args.enforce_eager, args.context_len, args.cost_cache_dir, args.seed, args.layer_backend,
                          args.draft_ahead, args.async_decode, args.prefill_graph_tokens, args.linear_rows,
                          args.batch_invariant, args.keep_drafter)
    refill = None
    if args.refill:
        refill = Refill(engine, prompts, args.batch_size, args.refill, args.temperature, args.seed,
                        feeds=1 + args.warmup + 2 * args.steps)
        refill()  # the first batch_size requests (the next ones join as their slots free)
    else:
        params = SamplingParams(max_new_tokens=max_new, temperature=args.temperature, ignore_eos=True)
        for i, p in enumerate(batch):
            engine.add_request(p, params, request_id=i)
    prefill_steps = 0
    while engine.has_unfinished() and any(not engine.sequence(i).output_ids for i in range(len(batch))):
        engine.step()  # prefill (chunked) until every request has its first token
        prefill_steps += 1
    decoding_steps(engine, args.warmup, refill)
    prefills = [] if refill else None
    timed = decoding_steps(engine, args.steps, refill, prefills)
    device = torch.device(target.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled = decoding_steps(engine, args.steps, refill)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    seqs = [engine.sequence(i) for i in range(refill.added if refill else len(batch))]
    verify_steps = sum(len(s.accepted_lengths) for s in seqs)
    emitted = sum(sum(s.accepted_lengths) + len(s.accepted_lengths) for s in seqs)
    report = {
        "hardware": hardware_name(device),
        "command": command,
        "model": target.name,
        "settings": {"mode": args.mode, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                     "temperature": args.temperature, "enforce_eager": args.enforce_eager,
                     "layer_backend": args.layer_backend or "default",
                     "linear_rows": engine.runner.target.linear_rows,
                     "batch_invariant": engine.runner.target.row_invariant,
                     "draft_head_in_graph": engine.runner.head_in_graph, "draft_ahead": args.draft_ahead,
                     "async_decode": args.async_decode, "refill": args.refill, "keep_drafter": args.keep_drafter,
                     "dtype": str(target.dtype), "prefill_steps": prefill_steps, "gamma": gamma,
                     "dot_tiles": linear.DOT_TILES},
        "step_ms_median": statistics.median(timed) if timed else None,
        "step_ms_all": [round(t, 3) for t in timed],
        "profiled_step_ms_median": statistics.median(profiled) if profiled else None,
        "mean_accepted_length": emitted / verify_steps if verify_steps else None,
        "host_schedule_fraction": (engine.stats["host_schedule_s"] / engine.stats["step_s"]
                                   if engine.stats.get("step_s") else None),
        "profile": summarize_profile(prof, len(profiled), top=args.top),
    }
    if refill is not None:
        report["refill"] = refill_report(prefills, timed, args.refill)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    return report


def print_report(report: dict) -> None:
    p = report["profile"]
    s = report["settings"]
    graphs = "cpu" not in report["hardware"].lower() and not s["enforce_eager"]
    print(f"\n{report['model']} on {report['hardware']}: mode {s['mode']}, batch {s['batch_size']}, "
          f"{'CUDA graphs where captured' if graphs else 'eager'}")
    print(f"step {report['step_ms_median']:.3f} ms (median of {len(report['step_ms_all'])}; "
          f"{report['profiled_step_ms_median']:.3f} ms under the profiler)  τ = {report['mean_accepted_length']}")
    if "refill" in report:
        r = report["refill"]
        fmt = lambda x: "-" if x is None else f"{x:.3f} ms"  # noqa: E731
        print(f"steady state (--refill {r['tokens']}): {r['prefill_step_fraction']:.0%} of the steps prefill; "
              f"step {fmt(r['step_ms_median_with_prefill'])} with a prefill, {fmt(r['step_ms_median_without_prefill'])}"
              f" without; prefill stage {fmt(r['prefill_stage_ms_median'])}")
    print(f"per step: {p['kernel_launches_per_step']:.1f} kernel launches, {p['graph_launches_per_step']:.1f} graph "
          f"replays, {p['memcpy_calls_per_step']:.1f} copies, {p['device_ms_per_step']:.3f} ms of device time")
    for title, key, col in (("top by device time", "top_by_device_time", "self_device_ms_per_step"),
                            ("top by host time", "top_by_host_time", "self_host_ms_per_step")):
        print(f"\n{title} (ms per step, calls per step):")
        for r in p[key][:10]:
            print(f"  {r[col]:8.4f}  {r['calls_per_step']:6.1f}  {r['name'][:90]}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.profile_engine", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: name, .gguf or HF directory")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the shipped one)")
    p.add_argument("--mode", default="fixed:3", help="none, fixed:K, dsd, threshold, adaptive-sync or adaptive")
    p.add_argument("--batch-size", type=int, default=1, help="decoding requests in the batch")
    p.add_argument("--steps", type=int, default=20, help="decoding steps timed, and as many profiled")
    p.add_argument("--warmup", type=int, default=5, help="decoding steps before timing")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--draft-ahead", action="store_true",
                   help="EngineConfig.draft_ahead: the next block drafted before the token read")
    p.add_argument("--keep-drafter", action="store_true",
                   help="attach the drafter to a mode that does not draft (--mode none): the plain steps of a drafting "
                        "engine whose gate is closed (the target alone, its features parked for the drafter)")
    p.add_argument("--refill", type=int, default=0, metavar="TOKENS",
                   help="a server's steady state: requests of seeded lengths in [TOKENS/2, TOKENS], the waiting queue "
                        "topped up to --batch-size before every step (0: one closed batch)")
    p.add_argument("--async-decode", action="store_true",
                   help="EngineConfig.async_decode: steps launched one ahead of their token reads (modes none, fixed, "
                        "dsd, adaptive)")
    add_engine_source_args(p)
    p.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT_LEN, help="KV length of the cost profile")
    p.add_argument("--cost-cache-dir", default=None,
                   help="where cost tables are cached by fingerprint (None: optimized.cost_model's default)")
    p.add_argument("--seed", type=int, default=0, help="root of the random-number contract (EngineConfig.seed)")
    p.add_argument("--top", type=int, default=15, help="operators listed per table")
    p.add_argument("--trace", default=None, help="also write a Chrome trace (chrome://tracing, Perfetto) here")
    p.add_argument("--dot-tiles", default=None, metavar="FILE",
                   help="run with the fused projections' tl.dot tiles of 3-16-row steps from FILE: a DOT_TILES table "
                        "or a scripts/bench_linear.py --sweep report (its first proposed table); recorded in the "
                        "report's settings (default: DOT_TILES in optimized/kernels/linear.py as it is)")
    p.add_argument("--out", default=None, help="JSON report path")
    return p


def main(argv: list[str] | None = None, *, target: Target | None = None, drafter: DSparkDrafter | None = None,
         prompt_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Command line; tests pass an already-built ``target``/``drafter`` and tokenised ``prompt_ids``."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    tiles = dot_tiles_from_file(args.dot_tiles) if args.dot_tiles else None  # before the model loads: fails fast
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0 or args.refill < 0:
        raise SystemExit("need --batch-size ≥ 1, --steps ≥ 1, --warmup ≥ 0 and --refill ≥ 0")
    if target is None:
        dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
        target = Target.load(args.model, device=args.device, dtype=getattr(torch, dtype))
    if drafter is None and (parse_mode(args.mode, None)[0].drafts or args.keep_drafter):
        drafter = load_or_init_drafter(args.drafter or str(DEFAULT_DRAFTER), target, None, args.seed)
    if prompt_ids is None:
        prompt_ids = load_prompts(args, target, 4 * args.batch_size if args.refill else args.batch_size)
    command = "python -m scripts.profile_engine " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                      else sys.argv[1:]))
    with linear.dot_tiles_in_force(tiles):
        return run_profile(target, drafter, prompt_ids, args, command)


if __name__ == "__main__":
    main()
    raise SystemExit(0)
