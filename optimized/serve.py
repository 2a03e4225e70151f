"""``python -m optimized.serve``: an OpenAI-compatible HTTP server on the optimized engine (docs/serving.md).

With no arguments it serves the default target (SmolLM2-135M-Instruct) with the shipped DSpark drafter and adaptive
verification (docs/method.md §5), on CUDA when present and on the CPU otherwise, at http://127.0.0.1:8000. Flags
take vLLM's names where vLLM has one.

The HTTP server starts at once; ``GET /health`` answers 503 while the engine (in a process of its own with CUDA, on
a thread of the server's on the CPU: ``--engine-process`` / ``--no-engine-process``) loads the weights, builds the
engine (static caches, CUDA graphs), measures or loads the step-cost table and warms every kernel up, each stage
logged with its time, and 200 from then on, so the first request is as fast as the hundredth. SIGTERM (or Ctrl-C)
stops accepting connections, lets the requests in flight finish (at most ``--shutdown-timeout`` seconds), stops the
engine and exits 0; a failure of the engine exits 1. ``--api-server-count N`` runs N HTTP processes on the one port
in front of the engine process (optimized/serving/api_servers.py).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reference.config import DEFAULT_DRAFTER, DEFAULT_MODEL, NGRAM_MODES, SCHEDULER_MODES, NgramConfig, SchedulerConfig

if TYPE_CHECKING:
    from optimized.serving.engine_process import SpawnedEngine
# torch is imported where the engine is built (build_runtime, in the engine process with CUDA), not here and not
# while the flags are resolved: API server 0 starts the engine process before it imports its HTTP stack, so that the
# engine's imports, weights and graphs overlap the HTTP side's start, and the further API servers
# (--api-server-count) are spawned children that import this module again and need neither torch nor the engine.

log = logging.getLogger("dspark.serve")

# Defaults that differ by device. KV memory is slots × positions: SmolLM2 keeps 46 KB of fp32 K/V per position, so
# 8 slots × 2,048 positions are 0.8 GB of a laptop's memory; on a GPU, 256 slots are vLLM's default batch.
DEFAULT_MAX_NUM_SEQS = {"cpu": 8, "cuda": 256}
DEFAULT_MAX_MODEL_LEN = 2048  # prompt + completion; a ShareGPT turn and its answer fit with room
DEFAULT_MAX_WAITING = 1024  # queued requests before 429: well above a closed-loop benchmark at concurrency 256
# --header-timeout and --body-timeout: optimized/serving/app.py's HEADER_TIMEOUT_S and BODY_READ_TIMEOUT_S, which say
# why (restated, not imported: the HTTP stack is imported only after the engine process has started).
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
# The engine in its own process on a GPU host, where the HTTP process and the engine each have cores: 1.5× the plain
# decoding throughput at concurrency 64 and 2.4× at 256 on an H200, 2 % less at 1 (docs/serving.md, "The server's own
# cost"). On the CPU the engine's forward wants the cores itself, and the process mode measured no better there.
DEFAULT_ENGINE_PROCESS = {"cpu": False, "cuda": True}
# HTTP processes with the engine process on CUDA: one saturates its core at ~20k streamed tokens/s, where an H200 runs
# plain decoding at 34k (batch 64) to 76k (batch 256); four measured 1.56x one at concurrency 64 and 2.53x at 256
# (docs/serving.md, "Client or server?"). A quarter of the cores, so that clients, the engine and the HTTP
# processes of a small host still have a core each.
MAX_DEFAULT_API_SERVERS = 4


def default_api_server_count(device: str, engine_process: bool) -> int:
    if device != "cuda" or not engine_process:
        return 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, usable_cores() // 4))


def usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, where the OS tells it), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "enable_adaptive_verification",
             "num_speculative_tokens_per_batch_size", "mode", "threshold", "draft_gate", "prompt_lookup_max",
             "prompt_lookup_min")
# "method": who drafts. dspark: the trained drafter; ngram: prompt lookup in each request's tokens (vLLM's name and
# its prompt_lookup_max/min keys; no checkpoint, no confidences: modes none, fixed and dsd); hybrid: per request and
# step, the drafter's block or the lookup's, whichever is expected to be accepted longer (reference/hybrid.py).
SPEC_METHODS = ("dspark", "ngram", "hybrid")


# --------------------------------------------------------------------------------------------------------------
# --speculative-config
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeConfig:
    """``--speculative-config`` in vLLM's keys, plus ``mode`` for this project's other policies."""

    mode: str = "adaptive"  # one of reference.config.SCHEDULER_MODES except oracle (a simulation)
    k: int | None = None  # num_speculative_tokens: fixed mode's K (default γ)
    dsd_table: dict[int, int] = field(default_factory=dict)  # num_speculative_tokens_per_batch_size
    threshold: float = 0.5  # threshold mode: verify slot k while a_k ≥ threshold
    draft_gate: bool = True  # adaptive mode's draft gate (reference.config.SchedulerConfig.draft_gate)
    drafter: str | None = None  # vLLM's "model" key: the drafter directory
    method: str = "dspark"  # SPEC_METHODS
    lookup_max: int = NgramConfig.max_n  # the n-gram lookup's longest suffix (vLLM's prompt_lookup_max)
    lookup_min: int = NgramConfig.min_n  # its shortest match (prompt_lookup_min)

    @property
    def uses_drafter(self) -> bool:
        """Whether the server loads a DSpark checkpoint (the drafter or the hybrid, in a mode that drafts)."""
        return self.mode != "none" and self.method != "ngram"

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig:
        if not text:
            return cls()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--speculative-config is not valid JSON: {err}") from err
        if not isinstance(d, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(d) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {', '.join(SPEC_KEYS)}")
        method = d.get("method", "dspark")
        if method not in SPEC_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        table = d.get("num_speculative_tokens_per_batch_size") or {}
        if isinstance(table, list):
            table = dict(table)
        try:
            table = {int(b): int(v) for b, v in table.items()}
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError("--speculative-config: num_speculative_tokens_per_batch_size must map batch sizes to "
                             "K, e.g. {\"1\": 7, \"16\": 3, \"64\": 1}") from err
        if "mode" in d:
            mode = d["mode"]
        elif table:
            mode = "dsd"
        elif d.get("enable_adaptive_verification") is False or method == "ngram":
            mode = "fixed"
        else:
            mode = "adaptive"
        if mode not in SCHEDULER_MODES or mode == "oracle":
            modes = ", ".join(m for m in SCHEDULER_MODES if m != "oracle")
            raise ValueError(f"--speculative-config: mode must be one of {modes}, got {mode!r}")
        if method == "ngram" and mode not in NGRAM_MODES:
            raise ValueError(f"--speculative-config: the ngram method has no confidences, so mode {mode!r} cannot run "
                             f"with it; choose one of {', '.join(m.value for m in NGRAM_MODES)}")
        lookup = {}
        for key, name in (("prompt_lookup_max", "lookup_max"), ("prompt_lookup_min", "lookup_min")):
            if key in d:
                if method == "dspark":
                    raise ValueError(f"--speculative-config: {key} is for the ngram and hybrid methods")
                lookup[name] = d[key]
        try:
            NgramConfig(max_n=lookup.get("lookup_max", NgramConfig.max_n),
                        min_n=lookup.get("lookup_min", NgramConfig.min_n))
        except ValueError as err:
            raise ValueError(f"--speculative-config: prompt_lookup_max/min: {err}") from err
        k = d.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or k < 0):
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer ≥ 0, got {k!r}")
        if method == "ngram" and d.get("model") is not None:
            raise ValueError("--speculative-config: the ngram method takes no \"model\" (it has no checkpoint)")
        spec = cls(mode=mode, k=k, dsd_table=table, threshold=float(d.get("threshold", 0.5)),
                   draft_gate=bool(d.get("draft_gate", True)), drafter=d.get("model"), method=method, **lookup)
        spec.scheduler(gamma=max(k or 1, 1))  # validates the values now, before anything loads
        return spec

    def scheduler(self, gamma: int) -> SchedulerConfig:
        """The engine's scheduler config for a drafter of block size γ."""
        if self.k is not None and self.k > gamma:
            raise ValueError(f"num_speculative_tokens {self.k} exceeds the drafter's block size γ = {gamma}")
        if self.k is not None and self.mode not in ("fixed", "none") and self.k != gamma:
            raise ValueError(f"mode {self.mode} verifies up to the drafter's block size γ = {gamma}: "
                             f"num_speculative_tokens must be {gamma} or left out")
        extra = {"dsd_table": self.dsd_table} if self.dsd_table else {}
        return SchedulerConfig(mode=self.mode, k=gamma if self.k is None else self.k, threshold=self.threshold,
                               draft_gate=self.draft_gate, **extra)


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m optimized.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: 'smollm2-135m-instruct', a .gguf file or a local HF directory (default: %(default)s)")
    p.add_argument("--drafter", default=None,
                   help=f"drafter checkpoint directory (default for the default target: {DEFAULT_DRAFTER})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if present, else cpu (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"engine slots (default {DEFAULT_MAX_NUM_SEQS['cuda']} on CUDA, "
                        f"{DEFAULT_MAX_NUM_SEQS['cpu']} on the CPU)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help="prompt + completion tokens per request (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens per step over all prefilling requests (chunked prefill; default: the engine's "
                        "EngineConfig.prefill_chunk, 8192)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every kernel on one tile shape at every step size (EngineConfig.batch_invariant): greedy "
                        "speculative tokens equal plain decoding's in bfloat16 too; 0.6-1.0x the throughput")
    p.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous step's tokens are read (plain decoding and the fixed, "
                        "dsd and adaptive modes), so that the host's work overlaps the device's (default: on with "
                        "CUDA, off on the CPU)")
    p.add_argument("--cost-feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="price plain and speculative steps at their measured times once these drift more than 10%% "
                        "from the cost table (the /metrics gauges dspark:step_cost_*); it makes sampled adaptive "
                        "outputs depend on timing (default: on with CUDA, off on the CPU)")
    p.add_argument("--acceptance-feedback", action="store_true",
                   help="plan the adaptive mode with each draft slot's survivals scaled by how often such drafts "
                        "survived (EngineConfig.acceptance_feedback); it makes sampled adaptive outputs depend on the "
                        "traffic so far (default: off)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients may use; the first is reported (default: --model)")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, vLLM\'s keys: {"method": "dspark" | "ngram" | "hybrid", "num_speculative_tokens": K, '
                        '"enable_adaptive_verification": true, "num_speculative_tokens_per_batch_size": {...}, '
                        '"prompt_lookup_max": N, "prompt_lookup_min": N}, '
                        f'plus "mode" ({", ".join(m for m in SCHEDULER_MODES if m != "oracle")}); '
                        "default: the DSpark drafter, adaptive with its γ")
    p.add_argument("--cost-table", default=None,
                   help="step-cost table JSON (adaptive modes; default: profiled at start-up, cached on disk)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1 request (default: none)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests queued beyond --max-num-seqs before answering 429 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection has to send a whole request's headers, counted from its opening or from "
                        "the end of its previous response; then it is closed (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a request body may go without its next part before the server answers 408 "
                        "(default: %(default)s)")
    p.add_argument("--stream-each-step", action="store_true",
                   help="send every engine step as its own chunk, even to a stream that has fallen behind (default: "
                        "the steps that queued up for a request leave as one chunk)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="build and step the engine in a child process (spawn), so that the HTTP side's Python "
                        "(JSON, SSE, detokenisation, metrics) never delays an engine step; --no-engine-process: "
                        "on a thread of the server's process (default: the process with CUDA, the thread on the CPU)")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="HTTP processes in front of the engine process, sharing the port (vLLM's flag): one HTTP "
                        "process saturates its core long before an H200 engine does (docs/serving.md); default: "
                        "with the engine process on CUDA, a quarter of the CPU cores (1 to 4), else 1")
    p.add_argument("--seed", type=int, default=0, help="root of the random-number contract (default: %(default)s)")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: %(default)s)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per request (default: %(default)s)")
    return p


@dataclass
class ServeArgs:
    """The command line, resolved: devices, dtypes, defaults and the speculative config."""

    args: argparse.Namespace
    spec: SpeculativeConfig
    device: str
    dtype: str  # a torch dtype's name ("bfloat16"); build_runtime makes it the torch.dtype
    max_num_seqs: int
    drafter: str | None
    engine_process: bool
    api_server_count: int


def resolve(args: argparse.Namespace) -> ServeArgs:
    """Check the flags before anything loads; raises ValueError with a message for the user. Imports no torch where
    the device is certain without it (optimized/serving/device.py)."""
    from optimized.serving.device import detect_device

    spec = SpeculativeConfig.parse(args.speculative_config)
    found = detect_device() if args.device in ("auto", "cuda") else args.device
    if args.device == "cuda" and found != "cuda":
        raise ValueError("--device cuda: no CUDA device is available")
    device = found
    dtype = ("bfloat16" if device == "cuda" else "float32") if args.dtype == "auto" else args.dtype
    max_num_seqs = args.max_num_seqs or DEFAULT_MAX_NUM_SEQS[device]
    for name, value in (("--max-num-seqs", max_num_seqs), ("--max-model-len", args.max_model_len),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens or 1)):
        if value < 1:
            raise ValueError(f"{name} must be ≥ 1, got {value}")
    if args.max_waiting < 0 or args.shutdown_timeout < 0:
        raise ValueError("--max-waiting and --shutdown-timeout must be ≥ 0")
    for name, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value}")
    if args.drafter and spec.drafter and args.drafter != spec.drafter:
        raise ValueError("--drafter and the speculative config's \"model\" name different drafters")
    if args.drafter and spec.method == "ngram":
        raise ValueError("--drafter with the ngram method: the n-gram lookup uses no checkpoint")
    drafter = args.drafter or spec.drafter
    if drafter is None and spec.uses_drafter:
        if args.model.lower() != DEFAULT_MODEL:
            raise ValueError(f"no drafter for {args.model}: pass --drafter DIR (a DSpark checkpoint trained for it) "
                             "or --speculative-config '{\"mode\": \"none\"}'")
        drafter = str(DEFAULT_DRAFTER)
    engine_process = DEFAULT_ENGINE_PROCESS[device] if args.engine_process is None else args.engine_process
    api_servers = args.api_server_count
    if api_servers is None:
        api_servers = default_api_server_count(device, engine_process)
    elif api_servers < 1:
        raise ValueError(f"--api-server-count must be ≥ 1, got {api_servers}")
    elif api_servers > 1:
        if args.engine_process is False:
            raise ValueError("--api-server-count > 1 needs the engine in its own process: drop --no-engine-process")
        engine_process = True
    return ServeArgs(args, spec, device, dtype, max_num_seqs, drafter, engine_process, api_servers)


# --------------------------------------------------------------------------------------------------------------
# Start-up (runs on the engine thread, or in the engine process, while /health answers 503)
# --------------------------------------------------------------------------------------------------------------


@contextmanager
def _stage(name: str, times: dict[str, float]):
    log.info("start-up: %s ...", name)
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0
    log.info("start-up: %s done in %.2f s", name, times[name])


def build_runtime(sa: ServeArgs, freeze_gc: bool = False):
    """Load the target and drafter, build the engine, install its cost table, warm it up.

    ``freeze_gc`` (the server's own start-up): then move everything alive — the model, the engine, its graphs, the
    imported modules — out of the cyclic garbage collector's reach (``gc.freeze``). They live as long as the process,
    and a full collection otherwise walks all of them: on the 2-core CPU, with the tiny test models, a full
    collection during decoding steps took about 100 ms instead of under 10 (``scripts/bench_host.py`` at R = 256
    with a ``gc.callbacks`` probe), a stall of every request in flight. Not for a process that builds engines one
    after another (tests, benchmarks): a frozen engine's reference cycles are never collected."""
    args, times, t0 = sa.args, {}, time.perf_counter()
    with _stage("imports (torch, transformers, the engine and its kernels)", times):
        # transformers for the tokenizer's class only: the engine loads the weights without transformers' model,
        # config and auto classes once the directory is recorded (Target.load(..., forward=False))
        import torch
        import transformers  # noqa: F401

        from optimized.cost_model import DEFAULT_CONTEXT_LEN, cached_profile
        from optimized.engine import Engine, EngineConfig
        from optimized.serving.engine_loop import Runtime
        from reference.cli import load_or_init_drafter
        from reference.config import HybridConfig
        from reference.cost_model import CostTable
        from reference.hybrid import HybridProposer
        from reference.ngram import NgramProposer
        from reference.target import Target
    if sa.device == "cuda" and not torch.cuda.is_available():  # resolve() asked the driver; torch has the last word
        raise ValueError(f"the CUDA driver shows a device, but this torch ({torch.__version__}) cannot use it: "
                         "pass --device cpu, or install a torch built for this driver")
    dtype = getattr(torch, sa.dtype)
    with _stage("target weights", times):
        target = Target.load(args.model, device=sa.device, dtype=dtype, forward=False)
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and args.max_model_len > limit:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's {limit} positions")
    drafter, spec = None, sa.spec
    if spec.mode != "none":
        with _stage("drafter", times):
            lookup = dict(max_n=spec.lookup_max, min_n=spec.lookup_min)
            if spec.method == "ngram":  # no checkpoint: the block is num_speculative_tokens (default 7)
                drafter = NgramProposer(NgramConfig(gamma=spec.k or NgramConfig.gamma, **lookup))
            else:
                drafter = load_or_init_drafter(sa.drafter, target, seed=args.seed)
                if spec.method == "hybrid":
                    drafter = HybridProposer(drafter, HybridConfig(gamma=drafter.config.block_size, **lookup))
    gamma = drafter.config.block_size if drafter is not None else 0
    sched = sa.spec.scheduler(max(gamma, 1))
    cost = CostTable.load(args.cost_table) if args.cost_table else None
    extra = {"prefill_chunk": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    # Positions per slot: the longest request plus the drafter's scratch block (as optimized.generate sizes them).
    cfg = EngineConfig(max_num_seqs=sa.max_num_seqs, max_seq_len=args.max_model_len + 2 * gamma + 2,
                       enforce_eager=args.enforce_eager, seed=args.seed, device=sa.device, dtype=dtype,
                       batch_invariant=args.batch_invariant,
                       async_decode=args.async_decode, cost_feedback=args.cost_feedback,
                       acceptance_feedback=args.acceptance_feedback, **extra)
    graphs = sa.device == "cuda" and not args.enforce_eager
    with _stage("engine (static caches" + (", CUDA graphs)" if graphs else ")"), times):
        engine = Engine(target, drafter, cfg, sched, cost)
    if cost is None and sched.mode in ("adaptive", "adaptive-sync"):
        with _stage("step-cost table (profiled, or cached under a fingerprint)", times):
            context = max(1, min(DEFAULT_CONTEXT_LEN, cfg.max_seq_len - 2 * gamma - 8))
            engine.set_cost_table(cached_profile(engine.runner, context_len=context))
    with _stage("kernel warm-up", times):
        engine.warmup()
    log.info("start-up: ready in %.2f s (%s); mode %s, γ = %d, %d slots, max model len %d, %s %s, overlap %s",
             time.perf_counter() - t0, ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), sched.mode, gamma,
             sa.max_num_seqs, args.max_model_len, sa.device, sa.dtype,
             ", ".join(k for k, on in engine.pipelining.items() if on) or "off")
    if target.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer: the server needs one")
    if freeze_gc:
        gc.collect()
        gc.freeze()
    return Runtime(engine, target.tokenizer, target.vocab_size, gamma, drafter is not None)


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------


def server_settings(args: argparse.Namespace):
    """The HTTP side's settings from the command line."""
    from optimized.serving.app import ServerSettings

    return ServerSettings(served_model_names=args.served_model_name or [args.model], model_root=args.model,
                          max_model_len=args.max_model_len, api_key=args.api_key,
                          coalesce_steps=not args.stream_each_step, shutdown_timeout=args.shutdown_timeout,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sa = resolve(args)
    except ValueError as err:
        parser.error(str(err))
    # A partial over the resolved settings, not a closure: the engine process receives it pickled.
    build = functools.partial(build_runtime, sa, freeze_gc=True)
    spawned = None
    if sa.engine_process:  # start the engine first: its start-up overlaps the HTTP side's imports and start
        from optimized.serving.engine_process import spawn_engine

        spawned = spawn_engine(build, count=sa.api_server_count)
    log.info("the engine runs %s", "in its own process" if sa.engine_process else "on a thread of this process")
    settings = server_settings(args)
    options = dict(log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                   timeout_graceful_shutdown=args.shutdown_timeout)
    return run_http(settings, build, host=args.host, port=args.port, max_num_seqs=sa.max_num_seqs,
                    max_waiting=args.max_waiting, engine_process=sa.engine_process,
                    api_server_count=sa.api_server_count, uvicorn_options=options, spawned=spawned)


def run_http(settings, build, *, host: str, port: int, max_num_seqs: int, max_waiting: int, engine_process: bool,
             api_server_count: int = 1, uvicorn_options: dict | None = None,
             spawned: SpawnedEngine | None = None) -> int:
    """Serve until SIGTERM / SIGINT (exit code 0, after the drain) or a failure of the engine or of an API server
    (1). ``build`` makes the engine's :class:`~optimized.serving.engine_loop.Runtime` (picklable with
    ``engine_process``); ``api_server_count`` > 1 runs that many HTTP processes on one socket
    (optimized/serving/api_servers.py). ``spawned``: the engine process, already started by
    :func:`~optimized.serving.engine_process.spawn_engine` with ``build`` (else the server starts it)."""
    import uvicorn

    from optimized.serving.api_servers import ApiServerGroup
    from optimized.serving.app import Server, serve_until_stopped

    options = uvicorn_options or {}
    group = sockets = None
    if api_server_count > 1:  # the socket is bound here and shared with the further servers
        sock = uvicorn.Config(None, host=host, port=port).bind_socket()
        sockets = [sock]
        group = ApiServerGroup(api_server_count, sock, settings, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                               uvicorn_options=options)
        log.info("%d API servers share %s:%d", api_server_count, host, port)
    server = Server(settings, build, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                    engine_process=engine_process, group=group, spawned=spawned)

    def on_signal(sig: int) -> bool:  # the further API servers drain too (Ctrl-C reaches them through this)
        if group is not None:
            group.signal_all()
        return True

    return serve_until_stopped(server, sockets=sockets, on_signal=on_signal, host=host, port=port, **options)


if __name__ == "__main__":
    raise SystemExit(main())
