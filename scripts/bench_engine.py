"""End-to-end engine benchmark: output tokens/s of every verify policy against transformers' ``generate``.

One run measures, at each batch size, the optimized engine in every requested mode (docs/method.md §5: ``none``,
``fixed`` K, ``dsd``, ``adaptive``, …) and HF ``model.generate`` (greedy, left-padded, ``min_new_tokens =
max_new_tokens``) as the named baseline. Modes prefixed ``ngram:`` (``ngram:fixed:K``, ``ngram:dsd``) draft with the
training-free n-gram proposer (``reference/ngram.py``, block ``--ngram-gamma``) instead of the DSpark drafter: the
free baseline a trained drafter must beat, measured in the same run. Modes prefixed ``hybrid:`` (``hybrid:fixed:K``,
``hybrid:adaptive``, ...) draft with the hybrid proposer (``reference/hybrid.py``: per request and step, the drafter's
block or the n-gram continuation, whichever is expected to be accepted longer; its rows add the share of steps that
verified an n-gram block, ``ngram_step_fraction``). A DSpark mode suffixed ``+ahead``
(``adaptive+ahead``, ``fixed:7+ahead``) runs on a second engine built with ``EngineConfig.draft_ahead`` (the next
block drafted before the token read), and a mode suffixed ``+async`` (``none+async``, ``fixed:7+async``,
``adaptive+async``) on one built with ``EngineConfig.async_decode`` (steps launched one ahead of their token reads;
with a drafter also ``cost_feedback`` and a cost table profiled the way it runs: the engine a server runs on CUDA),
each beside the same mode without it (the plain modes run with every switch off, although on CUDA the engine's
defaults turn them on). ``adaptive:finish`` (``adaptive:finish+async``, ...) is adaptive with the finish-time gate
(``EngineConfig.finish_time_gate``: the workload is an offline batch, so once no request waits the gate weighs the
time to finish the running ones; with ``--gate-trace`` its rows add the estimates, ``finish_trace``). Names follow
``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length, ``τ`` emitted tokens
per verify step).

Method, per configuration (engine × mode × batch size):

* one engine per kind (no drafter, the DSpark drafter, the n-gram proposer, the hybrid) sized for the largest batch,
  built once:
  its CUDA graphs and
  caches serve every batch size and mode (``Engine.set_scheduler`` switches the policy between runs), as a
  server with a fixed ``max_num_seqs`` would;
* the cost table is profiled once on the drafter engine's runner (``optimized.cost_model.cached_profile``: graph
  replays, medians, cached under a fingerprint), logged, and written into the JSON with the results;
* ``--warmup`` untimed runs, then ``--repeats`` timed runs of the whole workload (prefill included, EOS ignored, each
  request emits exactly ``--max-new-tokens``); the median tokens/s is reported, where tokens/s = generated tokens /
  wall time of the workload;
* the workload at batch size B: with ``--requests-per-slot 1`` (the default) a closed batch of B requests that start
  together, so the run lasts as long as its slowest request; with ``--requests-per-slot N``, B·N requests of which at
  most B are in flight, the next admitted as soon as one finishes (its prefill joins the running decode steps): the
  steady state of a server at ``max_num_seqs = B``. With speculation the two differ: requests accept at different
  rates, and a closed batch ends in a tail of a few slow requests at a small batch. ``--min-requests M`` raises the
  workload to at least M requests at every batch size (still at most B in flight): a closed batch of 1 is a single
  prompt, so batch 1's τ and speed-ups would otherwise rest on one prompt;
* ``--output-len-spread F`` (0 by default) gives request i its own length, drawn once from the seed uniformly in
  ``[(1 - F) · --max-new-tokens, --max-new-tokens]`` and the same in every mode: with equal lengths plain decoding's
  requests finish and are refilled together (a prompt step every ~N steps) while speculative requests finish at
  different steps (a prompt in nearly every step), which favours plain decoding in the steady state; varied lengths,
  as a server's requests have, desynchronise both alike. Hugging Face's closed batches keep the fixed length;
* ``τ`` = tokens emitted by verify steps / verify steps (summed over requests), the host scheduling share =
  ``engine.stats["host_schedule_s"] / engine.stats["step_s"]``.

The JSON is rewritten after every configuration, so a run cut off by a time limit still leaves its results;
``--time-budget-s`` stops cleanly before the limit. Plots (one PNG, four panels): tokens/s against batch size per
mode, speed-up over no speculation, the measured SPS curve (verify ms against tokens, drafter ms against
requests), and the host scheduling share of a step.

Example (H200)::

    python -m scripts.bench_engine --model /tmp/stage/target.gguf --sharegpt-file /tmp/stage/sharegpt.json.gz \\
        --out docs/benchmarks/engine-h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from optimized.cost_model import DEFAULT_CONTEXT_LEN, cached_profile
from optimized.cost_monitor import Sample
from optimized.engine import Engine, EngineConfig, SamplingParams, frozen_heap
from reference.cli import DEFAULT_DRAFTER, LOG_FORMAT, add_hybrid_args, load_or_init_drafter
from reference.config import HybridConfig, NgramConfig, ProposerKind, SchedulerConfig, SchedulingMode
from reference.cost_model import hardware_name
from reference.drafter import DSparkDrafter
from reference.hybrid import NGRAM, HybridProposer
from reference.ngram import NgramProposer
from reference.scheduler import FinishEstimate
from reference.target import Target
from scripts.benchmarking import (
    add_engine_source_args,
    default_tag,
    load_prompts,
    parse_config,
    request_lengths,
    sync,
)

log = logging.getLogger("dspark.bench_engine")

DEFAULT_MODES = "none,fixed:1,fixed:3,fixed:5,fixed:7,dsd,adaptive"
DEFAULT_BATCH_SIZES = "1,4,16,64,256"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BenchConfig:
    """What one benchmark run measures."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256])
    modes: list[str] = field(default_factory=lambda: DEFAULT_MODES.split(","))  # "none", "fixed:K", "ngram:fixed:K", …
    max_new_tokens: int = 128  # emitted per request (EOS ignored)
    requests_per_slot: int = 1  # B·N requests at batch size B, at most B in flight (1: a closed batch of B)
    min_requests: int = 1  # at least this many requests at every batch size (at most B in flight)
    output_len_spread: float = 0.0  # request lengths uniform in [(1 - F)·max_new_tokens, max_new_tokens] (0: equal)
    warmup: int = 1  # untimed runs per configuration (Triton JIT of prefill shapes, allocator)
    repeats: int = 3  # timed runs per configuration; the median is reported
    hf_max_batch: int = 256  # HF generate only up to this batch size (it is slow); 0 = never
    hf_repeats: int = 1  # HF runs take seconds each and vary little; one timed run after a short warm-up
    time_budget_s: float | None = None  # start no new configuration after this many seconds (model load included)
    enforce_eager: bool = False  # engine without CUDA graphs
    prefill_graph_tokens: int = EngineConfig.prefill_graph_tokens  # 0: every prefill eager (the A/B of prefill graphs)
    layer_backend: str | None = None  # EngineConfig.layer_backend (None: fused Triton layer ops on CUDA)
    linear_rows: int | None = None  # EngineConfig.linear_rows (None: the fused projections' default; 0: cuBLAS)
    batch_invariant: bool = False  # EngineConfig.batch_invariant (exact greedy in bfloat16, one tile shape a kernel)
    draft_context_lag: int = EngineConfig.draft_context_lag  # plain steps' features parked per slot before an append
    context_len: int = DEFAULT_CONTEXT_LEN  # KV length the cost table is profiled at
    cost_cache_dir: str | None = None  # default $DSPARK_CACHE/cost or ~/.cache/dspark/cost
    seed: int = 0
    ngram_gamma: int = NgramConfig.gamma  # the n-gram proposer's block for the ngram: modes (K ≤ this)
    ngram_max_n: int = NgramConfig.max_n  # its longest suffix n-gram
    ngram_min_n: int = NgramConfig.min_n  # its shortest match (also the hybrid's lookup, whose block is the drafter's)
    hybrid_prior_accept: float = HybridConfig.prior_accept  # the hybrid's prior of an n-gram slot's acceptance
    hybrid_prior_accept_sampling: float = HybridConfig.prior_accept_sampling  # the same for requests at T > 0
    hybrid_prior_strength: float = HybridConfig.prior_strength  # and its pseudo-counts
    gate_trace: bool = False  # adaptive rows also summarise the draft gate's estimates (gate_trace, gate_trace_summary)
    # and every drafting row the forecast: drafts the confidence head expected to be accepted against those that were
    cost_feedback: bool = False  # EngineConfig.cost_feedback for every engine (the server's CUDA default): the draft
    # gate prices steps at their measured times once they drift from the cost table; rows record the final drift
    acceptance_feedback: bool = False  # EngineConfig.acceptance_feedback: survivals scaled by their measured outcomes
    # With cost_feedback: which steps the monitor prices from, "steady" (between two of their own kind, the engine's
    # default) or "all" (switches between kinds too; CostMonitor.steady_only off)
    cost_samples: str = "steady"

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive integers, got {self.batch_sizes}")
        if (self.max_new_tokens < 1 or self.warmup < 0 or self.repeats < 1 or self.hf_repeats < 1
                or self.requests_per_slot < 1 or self.min_requests < 1):
            raise ValueError("need max_new_tokens ≥ 1, warmup ≥ 0, repeats ≥ 1, hf_repeats ≥ 1, "
                             "requests_per_slot ≥ 1 and min_requests ≥ 1")
        if not 0.0 <= self.output_len_spread < 1.0:
            raise ValueError(f"output_len_spread must lie in [0, 1), got {self.output_len_spread}")
        if self.cost_samples not in ("steady", "all"):
            raise ValueError(f"cost_samples must be 'steady' or 'all', got {self.cost_samples!r}")
        NgramConfig(self.ngram_gamma, self.ngram_max_n, self.ngram_min_n)  # validates the n-gram fields
        HybridConfig(max_n=self.ngram_max_n, min_n=self.ngram_min_n, prior_accept=self.hybrid_prior_accept,
                     prior_accept_sampling=self.hybrid_prior_accept_sampling,
                     prior_strength=self.hybrid_prior_strength)  # and the hybrid's
        for m in self.modes:
            base, variant = split_variant(m)
            kind, mode, _ = parse_config(base, gamma=None, ngram_gamma=self.ngram_gamma)
            if variant == "ahead" and (kind is not ProposerKind.DSPARK or not mode.drafts):
                raise ValueError(f"mode {m!r}: '+ahead' drafts ahead with the DSpark drafter; it needs a drafting mode")
            if variant == "async" and mode.drafts and (kind is not ProposerKind.DSPARK or not mode.plans_blind):
                raise ValueError(f"mode {m!r}: '+async' runs steps one ahead of their reads, which needs mode none or "
                                 "a DSpark mode planned without the step's outcome (fixed, dsd, adaptive)")
        self.batch_sizes = sorted(set(self.batch_sizes))

    def workload_size(self, batch_size: int) -> int:
        """Requests run at one batch size (at most ``batch_size`` of them in flight)."""
        return max(batch_size * self.requests_per_slot, self.min_requests)


VARIANTS = ("ahead", "async")  # the "+" suffixes: EngineConfig.draft_ahead, EngineConfig.async_decode


def split_variant(spec: str) -> tuple[str, str | None]:
    """``"adaptive+ahead"`` -> ("adaptive", "ahead"), ``"none"`` -> ("none", None): the mode, and the engine variant
    it runs on (``ahead``: ``EngineConfig.draft_ahead``; ``async``: ``EngineConfig.async_decode``)."""
    base, plus, rest = spec.partition("+")
    if plus and rest not in VARIANTS:
        raise ValueError(f"mode {spec!r}: the suffix is '+ahead' or '+async'")
    return base, rest or None


# ---------------------------------------------------------------------------------------------------------
# One timed run of each engine
# ---------------------------------------------------------------------------------------------------------


def run_engine(engine: Engine, prompts: list[list[int]], max_new_tokens: int | list[int],
               concurrency: int | None = None, forecast: dict[int, list[float]] | None = None) -> dict[str, float]:
    """Decode every prompt once (``max_new_tokens``: one length for all, or one per prompt; EOS ignored), at most
    ``concurrency`` in flight (None: all at once, a closed batch); wall time, tokens and the per-step statistics.
    ``forecast``: if given, every verifying step's drafts are added to it (:func:`add_forecast`; host work per step,
    so not for timing runs)."""
    lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    if len(lengths) != len(prompts):
        raise ValueError(f"{len(lengths)} lengths for {len(prompts)} prompts")
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    in_flight = len(prompts) if concurrency is None else min(concurrency, len(prompts))
    engine.reset_stats()
    sync(engine.device)
    pauses = PauseWatch()
    longest, longest_at = 0.0, -1
    t0 = time.perf_counter()
    for i in range(in_flight):
        engine.add_request(prompts[i], params[i], request_id=i)
    admitted = in_flight
    with pauses:
        while engine.has_unfinished():
            t_step = time.perf_counter()
            for out in engine.step():
                if out.finished and admitted < len(prompts):  # a slot freed: the next request takes it
                    engine.add_request(prompts[admitted], params[admitted], request_id=admitted)
                    admitted += 1
            if forecast is not None:
                add_forecast(forecast, engine.last_step_stats())
            took = time.perf_counter() - t_step
            if took > longest:
                longest, longest_at = took, engine.stats["steps"]
    sync(engine.device)
    wall = time.perf_counter() - t0
    seqs = [engine.sequence(i) for i in range(len(prompts))]
    tokens = sum(len(s.output_ids) for s in seqs)
    verify_steps = sum(len(s.accepted_lengths) for s in seqs)
    emitted = sum(sum(s.accepted_lengths) + len(s.accepted_lengths) for s in seqs)  # accepted drafts + 1 per step
    verified = sum(sum(s.verify_lengths) for s in seqs)
    sources = [x for s in seqs for x in s.proposal_sources]  # the hybrid proposer's (empty for the others)
    stats = engine.stats
    return {
        **({"ngram_step_fraction": sources.count(NGRAM) / len(sources)} if sources else {}),
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "mean_accepted_length": emitted / verify_steps if verify_steps else 0.0,
        "mean_verify_length": verified / verify_steps if verify_steps else 0.0,
        "engine_steps": stats["steps"], "step_ms": 1e3 * stats["step_s"] / max(stats["steps"], 1),
        "host_schedule_ms": 1e3 * stats["host_schedule_s"] / max(stats["steps"], 1),
        "host_schedule_fraction": stats["host_schedule_s"] / stats["step_s"] if stats["step_s"] else 0.0,
        # the host's commit of the read tokens (stop checks, outputs): with planning, what a step one ahead of its
        # reads waits for once the host is slower than the device
        "host_commit_ms": 1e3 * stats["host_commit_s"] / max(stats["steps"], 1),
        # planning done while the device verified (EngineConfig.plan_ahead, on CUDA): off the critical path
        "host_ahead_ms": 1e3 * stats["host_ahead_s"] / max(stats["steps"], 1),
        # steps that ran the drafter (the adaptive draft gate skips some); 0 for no speculation
        "draft_step_fraction": stats["draft_steps"] / max(stats["steps"], 1),
        # steps whose draft was launched before the token read (EngineConfig.draft_ahead; the "+ahead" modes)
        "draft_ahead_fraction": stats["draft_ahead_steps"] / max(stats["steps"], 1),
        # steps that ran prompt chunks, and the mean time of their prefill stage (with its first-token read)
        "prefill_step_fraction": stats["prefill_steps"] / max(stats["steps"], 1),
        "prefill_ms": 1e3 * stats["prefill_s"] / max(stats["prefill_steps"], 1),
        # what a slow run's time went to: its longest engine.step() call (wall, and the step count after it), the
        # Python garbage collector's pauses and the Triton kernels compiled during the run (PauseWatch)
        "longest_step_ms": 1e3 * longest, "longest_step_at": longest_at, **pauses.summary(),
    }


class PauseWatch:
    """Counts, while entered, what can stall a step loop from outside the engine's own work: the garbage collector's
    collections (``gc.callbacks``: their number per generation and their total time) and Triton compiling a kernel
    for a specialization it has not met yet (``triton.knobs.runtime.jit_cache_hook``, called on a cache miss; where
    this Triton has no such hook, ``jit_compiles`` is None). Used by :func:`run_engine`: a timed run far slower than
    its repeats shows whether one of these was the cause."""

    def __init__(self) -> None:
        self.gc_s = 0.0
        self.collections = [0, 0, 0]
        self.compiles: int | None = None
        self._gc_t0 = 0.0
        self._knobs = None
        self._previous_hook = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.collections[info["generation"]] += 1

    def _on_compile(self, *args, **kwargs):
        self.compiles += 1
        if self._previous_hook is not None:
            return self._previous_hook(*args, **kwargs)
        return None  # a true value would tell Triton to skip the compile

    def __enter__(self) -> PauseWatch:
        gc.callbacks.append(self._on_gc)
        try:
            from triton import knobs
            self._knobs = knobs.runtime if hasattr(knobs.runtime, "jit_cache_hook") else None
        except ImportError:  # no Triton (or one without knobs): compiles not counted
            self._knobs = None
        if self._knobs is not None:
            self.compiles = 0
            self._previous_hook = self._knobs.jit_cache_hook
            self._knobs.jit_cache_hook = self._on_compile
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._previous_hook

    def summary(self) -> dict[str, Any]:
        return {"gc_ms": 1e3 * self.gc_s, "gc_collections": list(self.collections), "jit_compiles": self.compiles}


def add_forecast(forecast: dict[int, list[float]], stats) -> None:
    """Add one step's verified drafts to ``forecast`` (batch size R rounded up to a power of two -> [drafts the
    confidence head expected to be accepted, drafts accepted, verified drafts, request-steps]): the expectation of a
    request's ℓ verified drafts is the sum of their calibrated prefix survivals a_1..a_ℓ (docs/method.md §4), what the
    draft gate and the budget plan with."""
    if stats is None or not stats.verified:
        return
    bucket = 1 << max(stats.num_decoding - 1, 0).bit_length()
    row = forecast.setdefault(bucket, [0.0, 0.0, 0.0, 0.0])
    for a, accepted, verified in zip(stats.predicted_survival, stats.accepted, stats.verified):
        if verified and a:
            row[0] += float(sum(a))
            row[1] += accepted
            row[2] += verified
            row[3] += 1


def forecast_summary(forecast: dict[int, list[float]]) -> dict[str, Any]:
    """Per batch-size bucket: verified drafts per request-step and accepted drafts per request-step, expected and
    measured, and measured over expected (below 1: the survivals the scheduler plans with were optimistic)."""
    out = {}
    for bucket, (expected, accepted, verified, n) in sorted(forecast.items()):
        if n:
            out[str(bucket)] = {"request_steps": int(n), "verified_per_request": round(verified / n, 4),
                                "expected_accepted_per_request": round(expected / n, 4),
                                "accepted_per_request": round(accepted / n, 4),
                                "accepted_over_expected": round(accepted / expected, 4) if expected else None}
    return out


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, device: torch.device) -> dict:
    """HF ``generate``, greedy, left padding, exactly ``max_new_tokens`` per row (EOS suppressed until then)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)  # [B, S]
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    sync(device)
    wall = time.perf_counter() - t0
    tokens = len(prompts) * (out.shape[1] - longest)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "mean_accepted_length": 1.0}


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


def run_benchmark(target: Target, drafter: DSparkDrafter | None, prompts: list[list[int]], cfg: BenchConfig, *,
                  out: str | Path, command: str, model_name: str | None = None,
                  drafter_name: str | None = None, started_at: float | None = None) -> dict[str, Any]:
    """Measure every configuration and write ``out`` (JSON) and ``out`` with suffix ``.png``; returns the report.

    Args:
        target: the target (its device and dtype are the engine's).
        drafter: the DSpark drafter; may be None only if no mode drafts with it (``none`` and ``ngram:`` modes; the
            ``hybrid:`` modes draft with it).
        prompts: tokenised prompts (chat template applied); batch size B uses the first B (cycled if fewer).
        cfg: what to measure.
        out: JSON path; the plot is written next to it.
        command: the command line that produced the numbers (recorded).
        model_name, drafter_name: recorded names (default: the target's name, the drafter's config).
        started_at: ``time.monotonic()`` the time budget counts from (default: now; ``main`` passes its own
            start, so model loading counts too).
    """
    start = time.monotonic() if started_at is None else started_at
    out = Path(out)
    device = torch.device(target.device)
    gamma = drafter.config.block_size if drafter is not None else 0
    modes = [(spec, *parse_config(split_variant(spec)[0], gamma or None, cfg.ngram_gamma)) for spec in cfg.modes]
    if drafter is None and any(kind is not ProposerKind.NGRAM and m.drafts for _, kind, m, _ in modes):
        raise ValueError("speculative modes need a drafter")
    ngram = NgramConfig(cfg.ngram_gamma, cfg.ngram_max_n, cfg.ngram_min_n)
    uses_ngram = any(kind is ProposerKind.NGRAM for _, kind, _, _ in modes)
    if not prompts or any(not p for p in prompts):
        raise ValueError("need at least one non-empty tokenised prompt")
    most = max(cfg.workload_size(b) for b in cfg.batch_sizes)  # requests of the largest workload
    if len(prompts) < most:
        log.warning("%d prompts for %d requests: prompts are reused", len(prompts), most)
    report: dict[str, Any] = {
        "hardware": hardware_name(device),
        "command": command,
        "model": model_name or target.name,
        "drafter": drafter_name or ("none" if drafter is None else json.loads(json.dumps(asdict(drafter.config),
                                                                                          default=str))),
        "settings": {**asdict(cfg), "dtype": str(target.dtype), "num_prompts": len(prompts), "gamma": gamma,
                     "greedy": True, "ignore_eos": True},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _version("transformers"), "triton": _version("triton")},
        "results": [],
        "complete": False,
    }

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    # Engines, sized once for the largest batch.
    max_b = max(cfg.batch_sizes)
    longest = max(len(p) for p in prompts[:most])
    scratch = max(gamma, ngram.gamma if uses_ngram else 0)  # the largest block of any engine
    max_seq_len = max(longest + cfg.max_new_tokens, cfg.context_len) + 2 * scratch + 8
    # The plain modes run with both pipelining switches off, whatever the defaults, so that "+ahead" and "+async"
    # are each one switch against the same engine
    econf = dict(max_num_seqs=max_b, max_seq_len=max_seq_len, device=str(device), dtype=target.dtype,
                 enforce_eager=cfg.enforce_eager, layer_backend=cfg.layer_backend, seed=cfg.seed,
                 linear_rows=cfg.linear_rows, batch_invariant=cfg.batch_invariant,
                 prefill_graph_tokens=cfg.prefill_graph_tokens, draft_ahead=False, async_decode=False,
                 cost_feedback=cfg.cost_feedback, acceptance_feedback=cfg.acceptance_feedback,
                 draft_context_lag=cfg.draft_context_lag)
    engines: dict[str, Engine] = {}
    t_build = time.perf_counter()
    if any(not m.drafts for _, _, m, _ in modes):
        engines["none"] = Engine(target, None, EngineConfig(**econf), SchedulerConfig(mode="none"))
    if any(split_variant(label)[1] == "async" for label, _, m, _ in modes if not m.drafts):  # plain, one step ahead
        engines["none+async"] = Engine(target, None, EngineConfig(**{**econf, "async_decode": True}),
                                       SchedulerConfig(mode="none"))
    if uses_ngram:  # no drafter, no cost table: the fixed and dsd modes need neither
        engines["ngram"] = Engine(target, NgramProposer(ngram), EngineConfig(**econf),
                                  SchedulerConfig(mode="fixed", k=ngram.gamma))
    table = None
    if any(kind is ProposerKind.DSPARK and m.drafts for _, kind, m, _ in modes):
        spec = Engine(target, drafter, EngineConfig(**econf), SchedulerConfig(mode="fixed", k=gamma))
        table = cached_profile(spec.runner, cache_dir=cfg.cost_cache_dir, context_len=cfg.context_len)
        spec.set_cost_table(table)
        engines["spec"] = spec
        if any(split_variant(label)[1] == "ahead" for label, *_ in modes):  # drafting before the token read
            ahead = EngineConfig(**{**econf, "draft_ahead": True}, plan_ahead=True)
            engines["spec+ahead"] = Engine(target, drafter, ahead, SchedulerConfig(mode="fixed", k=gamma), table)
        if any(split_variant(label)[1] == "async" for label, kind, m, _ in modes if m.drafts):
            # One step ahead of the reads, with the cost monitor: the engine as a server runs it on CUDA. Its table is
            # priced the way it runs (stages back to back), so it is profiled on its own runner.
            one_ahead = Engine(target, drafter, EngineConfig(**{**econf, "async_decode": True,
                                                                "cost_feedback": None}),
                               SchedulerConfig(mode="fixed", k=gamma))
            one_ahead.set_cost_table(cached_profile(one_ahead.runner, cache_dir=cfg.cost_cache_dir,
                                                    context_len=cfg.context_len))
            engines["spec+async"] = one_ahead
            report["cost_table_async"] = one_ahead.cost.to_dict()
        report["cost_table"] = table.to_dict()
        log.info("cost table (%s): verify ms %s | draft ms %s", table.hardware, _brief(table.verify_ms),
                 _brief(table.draft_ms))
    if any(kind is ProposerKind.HYBRID for _, kind, _, _ in modes):
        hybrid = HybridProposer(drafter, HybridConfig(gamma=gamma, max_n=cfg.ngram_max_n, min_n=cfg.ngram_min_n,
                                                      prior_accept=cfg.hybrid_prior_accept,
                                                      prior_accept_sampling=cfg.hybrid_prior_accept_sampling,
                                                      prior_strength=cfg.hybrid_prior_strength))
        engines["hybrid"] = Engine(target, hybrid, EngineConfig(**econf), SchedulerConfig(mode="fixed", k=gamma))
        if table is None:  # the drafter's steps are the same graphs in either engine: one profile serves both
            table = cached_profile(engines["hybrid"].runner, cache_dir=cfg.cost_cache_dir, context_len=cfg.context_len)
            report["cost_table"] = table.to_dict()
        engines["hybrid"].set_cost_table(table)
    for engine in engines.values():
        if engine.cost_monitor is not None:
            engine.cost_monitor.steady_only = cfg.cost_samples == "steady"
    report["engine_build_s"] = round(time.perf_counter() - t_build, 2)
    save()

    jobs = [(b, spec_, kind, m, k) for b in cfg.batch_sizes for spec_, kind, m, k in modes]
    if cfg.hf_max_batch:
        jobs += [(b, "hf", None, SchedulingMode.NONE, None) for b in cfg.batch_sizes if b <= cfg.hf_max_batch]
    jobs.sort(key=lambda j: (j[0], j[1] == "hf"))  # batch by batch; HF last in each (slowest, a baseline)
    for b, label, kind, mode, k in tqdm(jobs, desc="benchmark", unit="config"):
        if cfg.time_budget_s is not None and time.monotonic() - start > cfg.time_budget_s:
            report["stopped_early"] = f"time budget of {cfg.time_budget_s:.0f} s spent before {label} at batch {b}"
            log.warning("%s; writing what was measured", report["stopped_early"])
            break
        batch = [prompts[i % len(prompts)] for i in range(b)]  # HF: a closed batch of B
        workload = [prompts[i % len(prompts)] for i in range(cfg.workload_size(b))]
        t_cfg = time.perf_counter()
        if label == "hf":
            row = _measure_hf(target, batch, cfg, device)
        else:
            base, variant = split_variant(label)
            name = {ProposerKind.NGRAM: "ngram", ProposerKind.HYBRID: "hybrid"}.get(kind, "spec" if mode.drafts
                                                                                      else "none")
            engine = engines[name if variant is None else f"{name}+{variant}"]
            sched = SchedulerConfig(mode=mode, k=k if k is not None else engine.gamma,
                                    draft_gate=not base.endswith("adaptive:nogate"))
            engine.set_scheduler(sched)
            engine.scheduler.finish_time_gate = base.endswith("adaptive:finish")  # an offline batch's finish times
            lengths = request_lengths(len(workload), cfg.max_new_tokens, cfg.output_len_spread, cfg.seed)
            gate = engine.scheduler.gate
            gate.trace = [] if cfg.gate_trace and gate.active else None
            gate.finish_trace = [] if gate.trace is not None and engine.scheduler.finish_time_gate else None
            forecast = {} if cfg.gate_trace and mode.drafts else None
            monitor = engine.cost_monitor
            if monitor is not None:
                monitor.trace = [] if cfg.gate_trace else None
            row = _measure(lambda e=engine, p=workload, n=lengths, c=b, f=forecast: run_engine(e, p, n, c, f),
                           cfg.warmup, cfg.repeats)
            row = {"engine": "optimized", "proposer": kind if mode.drafts else None, "mode": mode, "label": label,
                   "k": _k_of(sched, b), **row}
            if gate.trace is not None:
                row["gate_trace_summary"] = gate_trace_summary(gate.trace)
                gate.trace = None
            if gate.finish_trace is not None:
                row["finish_trace"] = finish_trace_summary(gate.finish_trace)
                gate.finish_trace = None
            if forecast:
                row["forecast"] = forecast_summary(forecast)
            if monitor is not None and monitor.trace is not None:
                row["cost_samples"] = cost_samples_summary(monitor.trace)
                monitor.trace = None
            if cfg.cost_feedback and engine.cost_drift is not None:  # where the step prices ended up
                row["cost_drift"] = {k: None if v is None else round(v, 4) for k, v in engine.cost_drift.items()}
                row["price_scales"] = {k: round(v, 4) for k, v in engine.price_scales.items()}
                row["price_scales_by_batch"] = {str(b): {k: round(v, 4) for k, v in kinds.items()}
                                                for b, kinds in sorted(engine.price_scales_by_batch.items())}
            if cfg.acceptance_feedback and mode.drafts:  # the survival factors the planner ended with (None: 1)
                scale = engine.survival_scale
                row["survival_scale"] = None if scale is None else [round(x, 4) for x in scale]
        row.update({"batch_size": b, "elapsed_s": round(time.perf_counter() - t_cfg, 3)})
        row["per_request_tokens_per_s"] = row["output_tokens_per_s"] / b
        report["results"].append(row)
        log.info("batch %4d %-14s %9.1f tokens/s  τ = %.2f  %s", b, label, row["output_tokens_per_s"],
                 row["mean_accepted_length"],
                 f"host {100 * row['host_schedule_fraction']:.1f}% of {row['step_ms']:.2f} ms/step, prefill in "
                 f"{100 * row['prefill_step_fraction']:.0f}% of steps ({row['prefill_ms']:.2f} ms)"
                 if "step_ms" in row else "")
        report["summary"] = summarize(report["results"])
        save()
    else:
        report["complete"] = True
    report["summary"] = summarize(report["results"])
    report["total_s"] = round(time.monotonic() - start, 1)
    save()
    try:
        plot(report, out.with_suffix(".png"))
    except Exception as e:  # a plot must never cost the measured numbers
        log.warning("plotting failed: %s", e)
    log.info("wrote %s (%d configurations)", out, len(report["results"]))
    return report


def finish_trace_summary(trace: list[tuple[int, FinishEstimate, float, bool]]) -> dict[str, Any]:
    """What the finish-time gate estimated over a configuration's runs (warm-up included): how often it estimated
    and drafted, and its first 64 estimates in order, each with R, the expected time to finish drafting over plainly,
    the expected steps drafting against the plain steps left, the margin and whether it drafted."""
    return {"evaluations": len(trace), "drafted": sum(v for *_, v in trace),
            "estimates": [{"requests": r, "speculative_over_plain": (round(e.speculative_s / e.plain_s, 4)
                                                                      if e.plain_s > 0 else None),
                           "speculative_steps": round(e.speculative_steps, 1), "plain_steps": e.plain_steps,
                           "margin": round(m, 4), "drafted": v} for r, e, m, v in trace[:64]]}


def cost_samples_summary(samples: list[Sample]) -> list[dict[str, Any]]:
    """The steps the cost monitor measured over a configuration's runs (warm-up included), grouped by kind, batch-size
    bucket and the kinds of the steps before and after: how many, and the medians of measured over priced, of the
    measured time and of the price (ms). Which steps set a kind's price scale, and whether a switch between kinds
    costs what a run of one kind does."""
    groups: dict[tuple[str, int, str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.kind, s.bucket, s.before or "idle", s.after), []).append(s)
    rows = []
    for (kind, bucket, before, after), group in sorted(groups.items()):
        rows.append({"kind": kind, "bucket": bucket, "before": before, "after": after, "samples": len(group),
                     "measured_over_price": round(statistics.median(s.measured_s / s.price_s for s in group), 4),
                     "measured_ms": round(1e3 * statistics.median(s.measured_s for s in group), 4),
                     "price_ms": round(1e3 * statistics.median(s.price_s for s in group), 4),
                     "after_prefill": sum(s.prefill for s in group)})
    return rows


def gate_trace_summary(trace: list[tuple[int, float, float, float, bool]]) -> dict[str, Any]:
    """What the draft gate estimated over a configuration's runs (warm-up included): how often it evaluated and said
    "draft", and, by batch size R (rounded to a power of two), the quartiles of best Θ over Θ_plain and the margin."""
    by_r: dict[int, list[tuple[float, float, bool]]] = {}
    for r, best, plain, margin, verdict in trace:
        bucket = 1 << max(r - 1, 0).bit_length()  # R rounded up to a power of two
        by_r.setdefault(bucket, []).append((best / plain if plain > 0 else float("inf"), margin, verdict))
    out = {}
    for bucket, rows in sorted(by_r.items()):
        ratios = sorted(x for x, _, _ in rows)
        q = [ratios[min(len(ratios) - 1, int(f * len(ratios)))] for f in (0.25, 0.5, 0.75)]
        out[str(bucket)] = {"evaluations": len(rows), "drafted": sum(v for _, _, v in rows),
                            "best_over_plain_quartiles": [round(x, 4) for x in q],
                            "margin": round(rows[-1][1], 4)}
    return {"evaluations": len(trace), "drafted": sum(v for *_, v in trace), "by_batch": out}


def _measure(run, warmup: int, repeats: int) -> dict[str, Any]:
    """Warm-up runs, then timed runs; the median run (by tokens/s) gives every reported statistic."""
    for _ in range(warmup):
        run()
    with frozen_heap():  # no full collection of the engine's own objects lands in a timed run
        runs = [run() for _ in range(repeats)]
    # each timed run's stall evidence, in the order they ran (the statistics below are the median run's)
    pauses = [{"tokens_per_s": round(r["tokens_per_s"], 2), **{k: r[k] for k in PAUSE_KEYS if k in r}} for r in runs]
    runs.sort(key=lambda r: r["tokens_per_s"])
    mid = runs[len(runs) // 2]
    row = {key: v for key, v in mid.items() if key != "tokens_per_s"}
    row["output_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    row["runs_tokens_per_s"] = [round(r["tokens_per_s"], 2) for r in runs]
    if any(len(p) > 1 for p in pauses):
        row["runs_pauses"] = pauses
    return row


PAUSE_KEYS = ("longest_step_ms", "longest_step_at", "gc_ms", "gc_collections", "jit_compiles")


def _measure_hf(target: Target, batch: list[list[int]], cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """HF ``generate`` on the same prompts: a short warm-up generate (kernels, allocator), then timed runs."""
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else None
    pad = pad if pad is not None else min(target.eos_token_ids, default=0)
    if cfg.warmup:
        run_hf(target.model, batch, min(cfg.max_new_tokens, 8), pad, device)  # a full-length warm-up costs seconds
    row = _measure(lambda: run_hf(target.model, batch, cfg.max_new_tokens, pad, device), 0, cfg.hf_repeats)
    return {"engine": "hf", "proposer": None, "mode": "none", "label": "hf", "k": 0, **row}


def _k_of(sched: SchedulerConfig, batch_size: int) -> int | None:
    """The verify length a mode uses at this batch size, where it is fixed (fixed K; dsd's table entry)."""
    if not sched.mode.drafts:
        return 0
    if sched.mode is SchedulingMode.FIXED:
        return sched.k
    if sched.mode is SchedulingMode.DSD:
        keys = [b for b in sorted(sched.dsd_table) if b <= batch_size]
        return sched.dsd_table[keys[-1]] if keys else sched.dsd_table[min(sched.dsd_table)]
    return None


def summarize(results: list[dict]) -> dict[str, Any]:
    """Per batch size: the baselines, the best fixed K (drafter and n-gram), adaptive, and the speed goals as ratios."""
    by_b: dict[int, dict[str, dict]] = {}
    for r in results:
        by_b.setdefault(r["batch_size"], {})[r["label"]] = r
    out: dict[str, Any] = {}
    for b, rows in sorted(by_b.items()):
        tps = {label: r["output_tokens_per_s"] for label, r in rows.items()}
        fixed = {label: v for label, v in tps.items() if label.startswith("fixed") and not split_variant(label)[1]}
        s: dict[str, Any] = {"tokens_per_s": {k: round(v, 2) for k, v in tps.items()}}
        ngram = {label: v for label, v in tps.items() if label.startswith("ngram:")}
        hybrid = {label: v for label, v in tps.items() if label.startswith("hybrid:")}
        if fixed:
            best = max(fixed, key=fixed.get)
            s["best_fixed"] = best
        if ngram:
            s["best_ngram"] = max(ngram, key=ngram.get)
        if hybrid:
            s["best_hybrid"] = max(hybrid, key=hybrid.get)
        none, hf, adaptive = tps.get("none"), tps.get("hf"), tps.get("adaptive")
        if none and hf:
            s["none_over_hf"] = round(none / hf, 3)
        if adaptive and none:
            s["adaptive_over_none"] = round(adaptive / none, 3)
        if adaptive and fixed:
            s["adaptive_over_best_fixed"] = round(adaptive / fixed[s["best_fixed"]], 3)
        if ngram and adaptive:
            s["adaptive_over_best_ngram"] = round(adaptive / ngram[s["best_ngram"]], 3)
        if ngram and fixed:
            s["best_fixed_over_best_ngram"] = round(fixed[s["best_fixed"]] / ngram[s["best_ngram"]], 3)
        if tps.get("none+async") and none:
            s["none_async_over_none"] = round(tps["none+async"] / none, 3)
        if tps.get("adaptive+ahead") and adaptive:
            s["adaptive_ahead_over_adaptive"] = round(tps["adaptive+ahead"] / adaptive, 3)
        if tps.get("adaptive:nogate") and none:
            s["adaptive_nogate_over_none"] = round(tps["adaptive:nogate"] / none, 3)
        # adaptive's best variant against the best of every other mode measured (plain, fixed K, dsd, n-gram; any
        # pipelining): the policy is meant to pick, at every batch size, whichever of them pays best.
        adaptive_all = {lbl: v for lbl, v in tps.items() if split_variant(lbl)[0].startswith("adaptive")}
        others = {lbl: v for lbl, v in tps.items() if lbl != "hf" and lbl not in adaptive_all}
        if adaptive_all and others:
            best_a, best_o = max(adaptive_all, key=adaptive_all.get), max(others, key=others.get)
            s.update({"best_adaptive": best_a, "best_other": best_o,
                      "best_adaptive_over_best_other": round(adaptive_all[best_a] / others[best_o], 3)})
        if "none" in rows and "host_schedule_fraction" in rows["none"]:
            s["host_schedule_fraction_none"] = round(rows["none"]["host_schedule_fraction"], 4)
        if "adaptive" in rows:
            s["host_schedule_fraction_adaptive"] = round(rows["adaptive"]["host_schedule_fraction"], 4)
        out[str(b)] = s
    return out


# ---------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """Four panels: tokens/s, speed-up over no speculation, the SPS curve, host scheduling share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    labels = list(dict.fromkeys(r["label"] for r in results))
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    ax = axes[0, 0]
    for label in labels:
        pts = sorted((r["batch_size"], r["output_tokens_per_s"]) for r in results if r["label"] == label)
        ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if label == "hf" else "-")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="output tokens/s", title="Throughput")
    _legend(ax)
    ax = axes[0, 1]
    none = {r["batch_size"]: r["output_tokens_per_s"] for r in results if r["label"] == "none"}
    for label in labels:
        pts = sorted((r["batch_size"], r["output_tokens_per_s"] / none[r["batch_size"]]) for r in results
                     if r["label"] == label and r["batch_size"] in none)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if label == "hf" else "-")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel="batch size", ylabel="× tokens/s of mode none", title="Speed-up over no speculation")
    _legend(ax)
    ax = axes[1, 0]
    table = report.get("cost_table")
    if table:
        v = sorted((int(n), ms) for n, ms in table["verify_ms"].items())
        ax.step(*zip(*v), where="pre", marker=".", label="verify (tokens)")
        if table["draft_ms"]:
            d = sorted((int(n), ms) for n, ms in table["draft_ms"].items())
            ax.step(*zip(*d), where="pre", marker=".", label="drafter (requests)")
        ax.set(xscale="log", xlabel="tokens / requests", ylabel="ms per stage",
               title=f"Measured SPS curve (context {table['meta'].get('context_len')} keys)")
        _legend(ax)
    ax = axes[1, 1]
    for label in labels:
        pts = sorted((r["batch_size"], 100 * r["host_schedule_fraction"]) for r in results
                     if r["label"] == label and "host_schedule_fraction" in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.axhline(5.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xscale="log", xlabel="batch size", ylabel="% of step time", title="Host scheduling share (goal ≤ 5%)")
    _legend(ax)
    batch_sizes = sorted({r["batch_size"] for r in results})
    for ax in (axes[0, 0], axes[0, 1], axes[1, 1]):  # label the measured batch sizes, not powers of ten
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.minorticks_off()
    fig.suptitle(f"{report['model']} on {report['hardware']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # a partial report may leave a panel empty
        ax.legend(fontsize=8)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _brief(curve: dict[int, float]) -> str:
    keys = sorted(curve)
    if not keys:
        return "none"
    pick = sorted({keys[0], keys[len(keys) // 4], keys[len(keys) // 2], keys[-1]})
    return ", ".join(f"{k}: {curve[k]:.3f}" for k in pick)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_engine", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: name, .gguf or HF directory")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the shipped one, else random init)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="comma list of batch sizes B")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma list: none, fixed:K, dsd, threshold, adaptive-sync, "
                   "adaptive (adaptive:finish: with the finish-time gate of an offline batch); ngram:fixed:K and "
                   "ngram:dsd draft with the n-gram proposer; hybrid:MODE (every drafting mode above) with the hybrid "
                   "of the drafter and the n-gram lookup")
    p.add_argument("--ngram-gamma", type=int, default=NgramConfig.gamma, help="the n-gram proposer's block γ")
    p.add_argument("--ngram-max-n", type=int, default=NgramConfig.max_n,
                   help="n-gram proposer (and the hybrid's lookup): longest suffix tried")
    p.add_argument("--ngram-min-n", type=int, default=NgramConfig.min_n,
                   help="n-gram proposer (and the hybrid's lookup): shortest match")
    add_hybrid_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens each request generates (EOS ignored)")
    add_engine_source_args(p)
    p.add_argument("--requests-per-slot", type=int, default=1,
                   help="N: B·N requests at batch size B, at most B in flight (1: a closed batch of B requests)")
    p.add_argument("--min-requests", type=int, default=1,
                   help="M: at least M requests at every batch size, at most B in flight (batch 1 would otherwise "
                        "measure one prompt)")
    p.add_argument("--output-len-spread", type=float, default=0.0,
                   help="F: request lengths uniform in [(1-F)·max-new-tokens, max-new-tokens], the same in every "
                        "mode (0: all equal); with --requests-per-slot, varied lengths desynchronise plain decoding's "
                        "refills as a server's traffic does")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per configuration before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (the median is reported)")
    p.add_argument("--hf-max-batch", type=int, default=256, help="skip HF generate above this batch size")
    p.add_argument("--hf-repeats", type=int, default=1, help="timed runs of HF generate per batch size")
    p.add_argument("--gate-trace", action="store_true",
                   help="adaptive rows also summarise the draft gate's estimates: best Θ over Θ_plain by batch size, "
                        "how often it said draft (gate_trace_summary), and every drafting row the accepted drafts "
                        "expected from the confidence head against those accepted (forecast), and, with "
                        "--cost-feedback, the steps the cost monitor measured by kind and neighbours (cost_samples); "
                        "costs host time, so not for timing runs")
    p.add_argument("--cost-feedback", action="store_true",
                   help="run every engine with EngineConfig.cost_feedback, as python -m optimized.serve does on CUDA: "
                        "the draft gate prices steps at their measured times once they drift more than 10%% from the "
                        "cost table (rows record cost_drift and price_scales)")
    p.add_argument("--cost-samples", choices=("steady", "all"), default="steady",
                   help="with --cost-feedback, the steps the monitor prices from: 'steady' (between two steps of their "
                        "own kind, the engine's default) or 'all' (the switches between plain and speculative too)")
    p.add_argument("--acceptance-feedback", action="store_true",
                   help="run every engine with EngineConfig.acceptance_feedback: the adaptive planner scales each "
                        "slot's forecast survivals by the measured ratio of drafts that survived (rows record "
                        "survival_scale)")
    p.add_argument("--draft-context-lag", type=int, default=EngineConfig.draft_context_lag,
                   help="EngineConfig.draft_context_lag: a plain step's features wait in a buffer of this many "
                        "positions per slot and are appended to the drafter's context before the request's next draft, "
                        "or when the buffer is full (0: every plain step appends them)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting new configurations after this many seconds (None: no limit); the JSON says "
                        "whether it is complete")
    p.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT_LEN, help="KV length of the cost profile")
    p.add_argument("--cost-cache-dir", default=None,
                   help="where cost tables are cached by fingerprint (None: optimized.cost_model's default)")
    p.add_argument("--seed", type=int, default=0, help="root of the random-number contract (EngineConfig.seed)")
    p.add_argument("--tag", default=None, help="output name engine-<tag>.json (default from the device)")
    p.add_argument("--out", default=None, help="JSON path (default docs/benchmarks/engine-<tag>.json)")
    return p


def main(argv: list[str] | None = None, *, target: Target | None = None, drafter: DSparkDrafter | None = None,
         prompt_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Command line; tests pass an already-built ``target``/``drafter`` and tokenised ``prompt_ids``."""
    started_at = time.monotonic()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    cfg = BenchConfig(batch_sizes=[int(b) for b in args.batch_sizes.split(",")], modes=args.modes.split(","),
                      max_new_tokens=args.max_new_tokens, requests_per_slot=args.requests_per_slot,
                      min_requests=args.min_requests,
                      output_len_spread=args.output_len_spread,
                      warmup=args.warmup, repeats=args.repeats,
                      hf_max_batch=args.hf_max_batch, hf_repeats=args.hf_repeats, time_budget_s=args.time_budget_s,
                      enforce_eager=args.enforce_eager, prefill_graph_tokens=args.prefill_graph_tokens,
                      layer_backend=args.layer_backend, linear_rows=args.linear_rows, context_len=args.context_len,
                      batch_invariant=args.batch_invariant,
                      cost_cache_dir=args.cost_cache_dir, seed=args.seed, ngram_gamma=args.ngram_gamma,
                      ngram_max_n=args.ngram_max_n, ngram_min_n=args.ngram_min_n,
                      hybrid_prior_accept=args.hybrid_prior_accept,
                      hybrid_prior_accept_sampling=args.hybrid_prior_accept_sampling,
                      hybrid_prior_strength=args.hybrid_prior_strength, gate_trace=args.gate_trace,
                      cost_feedback=args.cost_feedback, acceptance_feedback=args.acceptance_feedback,
                      cost_samples=args.cost_samples, draft_context_lag=args.draft_context_lag)
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if target is None:
        target = Target.load(args.model, device=args.device, dtype=getattr(torch, dtype_name))
        model_name = args.model if target.name in ("", args.model) else f"{target.name} ({args.model})"
    else:
        model_name = target.name
    drafter_name = None
    if drafter is None and any(kind is not ProposerKind.NGRAM and mode.drafts
                               for kind, mode, _ in (parse_config(split_variant(m)[0], None, cfg.ngram_gamma)
                                                     for m in cfg.modes)):
        path = args.drafter or str(DEFAULT_DRAFTER)
        drafter = load_or_init_drafter(path, target, None, args.seed)
        drafter_name = path if Path(path).exists() else f"RANDOM INIT (seed {args.seed}; no checkpoint at {path})"
    if prompt_ids is None:
        prompt_ids = load_prompts(args, target, max(cfg.workload_size(b) for b in cfg.batch_sizes))
    device = torch.device(target.device)
    tag = args.tag or default_tag(device)
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"engine-{tag}.json"
    command = "python -m scripts.bench_engine " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                     else sys.argv[1:]))
    return run_benchmark(target, drafter, prompt_ids, cfg, out=out, command=command, model_name=model_name,
                         drafter_name=drafter_name, started_at=started_at)


if __name__ == "__main__":
    main()
    raise SystemExit(0)
