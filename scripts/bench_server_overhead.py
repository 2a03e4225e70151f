"""Server overhead benchmark: the HTTP server in front of a simulated engine, so that the server's own cost shows.

``scripts/bench_serving.py`` measures the server with the real engine behind it; where its tokens/s fall short of
``scripts/bench_engine.py`` at the same concurrency, the difference is the server's cost (HTTP, JSON, SSE,
detokenisation, the hand-off between the engine thread and the event loop) — or the benchmark client's. This script
takes the engine out of the picture: the real ``optimized.serving`` app (same routes, same engine loop, same
tokenizer) runs in front of :class:`SimulatedEngine`, which has the engine's public API (``add_request``, ``abort``,
``step``, ``release``, ``last_step_stats``) but no model. Each simulated step

* waits ``--step-ms`` in ``time.sleep`` (the GIL is free, as while the host waits for the device), then
* holds the GIL for ``--host-ms`` of pure-Python work (the engine's own host work: planning, launches), then
* gives every running request ``--tokens-per-step`` tokens (1: plain decoding; more: what speculation emits per
  step), taken from real English text tokenised by the target's tokenizer, so detokenisation does real work.

So the engine alone would deliver exactly ``R × tokens_per_step`` tokens every ``step_ms + host_ms``. Per
concurrency level (closed loop of ``bench_serving``: C users, streaming chat requests of ``--output-len`` tokens,
``ignore_eos``, one warm-up round) it reports:

* ``output_tokens_per_s`` seen by the client, and ``engine_bound_tokens_per_s``, what the engine alone could give
  at the measured number of decoding requests per step (``C_eff × tokens_per_step / (step_ms + host_ms)``);
  their ratio is the server's efficiency (1.0: the server costs nothing);
* ``step_period_ms``: wall time per engine step under load (from ``dspark:steps``) against the simulated
  ``step_ms + host_ms``: the excess is time the engine thread waited (for the GIL, mostly);
* CPU time per delivered token of the server process and of the client (``/proc``, ``time.process_time``): which
  of the two saturates first.

Arms, each in its own server process: two ways of streaming, ``coalesce`` (the server as shipped: the steps that
queued up for a request while its stream was busy leave as one chunk) and ``per-step`` (one chunk per engine step,
always), crossed with two places for the engine (``--engine-modes``): ``thread`` (the engine on a thread of the
server process, sharing its interpreter lock; these arms keep their names, ``coalesce`` and ``per-step``) and
``process`` (``optimized.serve --engine-process``: the engine in a child process; arms ``process+coalesce`` and
``process+per-step``), or ``process:N`` (that with N HTTP processes on one port, ``--api-server-count N``; arms
``process:N+coalesce``, ...). The server CPU per token is the HTTP processes' (all N); the engine process's is
reported beside it.
The engine modes of one streaming arm run side by side and take turns at every level (``--repeats N`` turns each):
the report keeps each arm's median run per level and, for a process arm, the median of its paired ratios to the
thread arm measured just before it (robust to a machine whose load drifts).

Usage (any machine; no GPU needed, the target is only used for its tokenizer)::

    python -m scripts.bench_server_overhead --concurrency 1,16,64,256 --tokens-per-step 1,3 --repeats 3 \\
        --out docs/benchmarks/server-overhead-cpu.json --plot docs/benchmarks/server-overhead-cpu.png

Names follow ``docs/method.md`` (``τ`` tokens per step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from optimized.engine import StepStats
from optimized.sequence import StepOutput
from scripts.bench_serving import WARMUP_TOKENS, closed_loop, percentile, process_cpu_s, wait_healthy

log = logging.getLogger("dspark.bench_server_overhead")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

ROOT = Path(__file__).resolve().parent.parent
# Text the simulated engine "generates" (tokenised once with the target's tokenizer; each request starts at its own
# offset): ordinary English with punctuation, numbers and a little code, so incremental detokenisation does the
# work it does for real output.
TEXT = (
    "Speculative decoding lets a small drafter propose several tokens that the large target model then checks in "
    "one forward pass. When the drafter is right, the target accepts a whole run of tokens at the cost of a single "
    "step; when it is wrong, nothing is lost but the drafter's time, because the verifier keeps exactly the tokens "
    "the target would have produced on its own. In practice the gain depends on three numbers: how many tokens are "
    "accepted per step (often 2 to 5), how much a verify step of several tokens costs compared with one token, and "
    "how much the drafter itself costs. For example:\n\n```python\ndef accepted(draft, target):\n    n = 0\n"
    "    for d, t in zip(draft, target):\n        if d != t:\n            break\n        n += 1\n    return n\n```\n\n"
    "A server in front of such an engine streams every step's tokens to its clients as server-sent events. "
)


# --------------------------------------------------------------------------------------------------------------
# The simulated engine
# --------------------------------------------------------------------------------------------------------------


class SimulatedEngine:
    """The engine's public API without a model: fixed step time, fixed tokens per step (see the module docstring).

    A request's first step emits one token (as a prefill does); every later step emits ``tokens_per_step`` tokens,
    never past ``max_new_tokens``. Requests wait for a slot beyond ``max_num_seqs``, first come first served.
    """

    def __init__(self, token_ids: list[int], *, max_num_seqs: int, step_ms: float, host_ms: float,
                 tokens_per_step: int) -> None:
        if not token_ids:
            raise ValueError("the simulated engine needs a non-empty token list")
        if max_num_seqs < 1 or tokens_per_step < 1 or step_ms < 0 or host_ms < 0:
            raise ValueError("max_num_seqs and tokens_per_step must be ≥ 1, step_ms and host_ms ≥ 0")
        self.token_ids = token_ids
        self.max_num_seqs, self.tokens_per_step = max_num_seqs, tokens_per_step
        self.step_s, self.host_s = step_ms / 1000.0, host_ms / 1000.0
        self._next_id = 0
        self._waiting: list[int] = []
        self._running: list[int] = []
        self._requests: dict[int, list] = {}  # id -> [params, emitted, offset, finished]
        self._last: StepStats | None = None

    def add_request(self, prompt_ids: list[int], params=None, request_id: int | None = None) -> int:
        if not prompt_ids:
            raise ValueError("empty prompt")
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid) + 1
        limit = params.max_new_tokens if params is not None else 128
        self._requests[rid] = [limit, 0, (rid * 7919) % len(self.token_ids), False]
        self._waiting.append(rid)
        return rid

    def abort(self, request_id: int) -> bool:
        req = self._requests.get(request_id)
        if req is None or req[3]:
            return False
        req[3] = True
        for queue in (self._waiting, self._running):
            if request_id in queue:
                queue.remove(request_id)
        return True

    def release(self, request_id: int) -> None:
        req = self._requests.get(request_id)
        if req is not None and req[3]:
            del self._requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def warmup(self) -> float:
        return 0.0

    def last_step_stats(self) -> StepStats | None:
        return self._last

    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.pop(0))
        time.sleep(self.step_s)  # the device's share: the GIL is free
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:  # the engine's host share: holds the GIL
            pass
        outputs, decoding, n_tok = [], [], len(self.token_ids)
        for rid in self._running:
            req = self._requests[rid]
            limit, emitted, offset = req[0], req[1], req[2]
            n = min(1 if emitted == 0 else self.tokens_per_step, limit - emitted)
            if emitted:
                decoding.append(rid)
            ids = [self.token_ids[(offset + emitted + i) % n_tok] for i in range(n)]
            req[1] = emitted + n
            finished = req[1] >= limit
            req[3] = finished
            outputs.append(StepOutput(rid, ids, finished, "length" if finished else None))
        self._running = [rid for rid in self._running if not self._requests[rid][3]]
        k = self.tokens_per_step - 1
        self._last = StepStats(
            step_time_s=time.perf_counter() - t0, num_running=len(self._running), num_waiting=len(self._waiting),
            num_decoding=len(decoding), verify_tokens=len(decoding) * (k + 1), budget=None, drafted=k > 0,
            verified=[k] * len(decoding), accepted=[k] * len(decoding),
            predicted_survival=[[1.0] * k for _ in decoding], request_ids=decoding)
        return outputs


# --------------------------------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SimulatedBuild:
    """The server's ``build`` for a SimulatedEngine: picklable, so that it also runs in the engine process."""

    token_ids: list[int]
    tokenizer: Any
    vocab_size: int
    max_num_seqs: int
    step_ms: float
    host_ms: float
    tokens_per_step: int

    def __call__(self):
        from optimized.serving.engine_loop import Runtime

        engine = SimulatedEngine(self.token_ids, max_num_seqs=self.max_num_seqs, step_ms=self.step_ms,
                                 host_ms=self.host_ms, tokens_per_step=self.tokens_per_step)
        gamma = self.tokens_per_step - 1
        return Runtime(engine, self.tokenizer, self.vocab_size, gamma, gamma > 0)


def serve(args: argparse.Namespace) -> int:
    """Run the real app in front of a SimulatedEngine (the child process the benchmark launches)."""
    from optimized.serve import run_http
    from optimized.serving.app import ServerSettings
    from reference.target import Target

    target = Target.load(args.model)  # for its tokenizer only (CPU, once; the dequantised weights are cached)
    tokenizer, vocab = target.tokenizer, target.vocab_size
    del target
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    build = SimulatedBuild(ids, tokenizer, vocab, args.max_num_seqs, args.step_ms, args.host_ms, args.tokens_per_step)
    settings = ServerSettings(served_model_names=["simulated"], model_root=args.model, max_model_len=4096,
                              coalesce_steps=not args.per_step)
    return run_http(settings, build, host="127.0.0.1", port=args.port, max_num_seqs=args.max_num_seqs,
                    max_waiting=4 * args.max_num_seqs, engine_process=args.engine_process,
                    api_server_count=args.api_server_count,
                    uvicorn_options=dict(log_level="warning", access_log=False))


class ServerProcess:
    """``python -m scripts.bench_server_overhead serve ...`` on a free port."""

    def __init__(self, args: argparse.Namespace, arm: str, engine: str, tokens_per_step: int, log_path: Path) -> None:
        self.arm, self.engine, self.tokens_per_step = arm, engine, tokens_per_step
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "scripts.bench_server_overhead", "serve", "--port", str(self.port),
               "--model", args.model, "--max-num-seqs", str(args.max_num_seqs), "--step-ms", str(args.step_ms),
               "--host-ms", str(args.host_ms), "--tokens-per-step", str(tokens_per_step)]
        cmd += ["--per-step"] if arm == "per-step" else []
        if engine != "thread":  # process, or process:N (N API servers)
            cmd += ["--engine-process", "--api-server-count", engine.partition(":")[2] or "1"]
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=pythonpath))
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        wait_healthy(self.url, self.proc, self.log_path, timeout_s)

    def cpu_s(self) -> tuple[float, float]:
        """User + system CPU seconds so far (Linux /proc) of the server's HTTP processes and of its engine process
        (0 in the thread mode)."""
        return process_cpu_s(self.proc.pid) or (0.0, 0.0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def arm_label(arm: str, engine: str) -> str:
    """The arm's name in the report: the chunking arm, prefixed by ``process+`` when the engine has its own process
    (the thread arms keep the names of earlier reports), or ``process:N+`` with N HTTP processes."""
    return arm if engine == "thread" else f"{engine}+{arm}"


def engine_steps(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "dspark:steps_total":
                return s.value
    raise RuntimeError("the server exports no dspark:steps_total")


def measure_level(server: ServerProcess, prompts: list[str], args: argparse.Namespace, concurrency: int) -> dict:
    closed_loop(server.url, "simulated", prompts, concurrency, concurrency, min(args.output_len, WARMUP_TOKENS),
                0.0, None)
    n = max(concurrency * args.prompts_per_user, args.min_requests)
    steps0, (cpu0, engine_cpu0) = engine_steps(server.url), server.cpu_s()
    results, wall, client_cpu = closed_loop(server.url, "simulated", prompts, concurrency, n, args.output_len, 0.0,
                                            None)
    steps = engine_steps(server.url) - steps0 - 1  # the scrape itself is no step; the last step may be a tail
    server_cpu, engine_cpu = (now - before for now, before in zip(server.cpu_s(), (cpu0, engine_cpu0)))
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.itl_s) + 1 for r in ok)  # token-carrying chunks
    period_s = wall / max(steps, 1)
    # Requests decoding per step on average: every token came from some step; the first token of each request came
    # from a one-token "prefill" step.
    tokens_per_engine_step = tokens / max(steps, 1)
    ideal_period_s = (args.step_ms + args.host_ms) / 1000.0
    tpots = [r.tpot_s for r in ok if r.tpot_s]
    return {
        "arm": arm_label(server.arm, server.engine), "chunks_per": server.arm, "engine": server.engine,
        "tokens_per_step": server.tokens_per_step, "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(results) - len(ok), "output_tokens": tokens, "chunks": chunks, "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "engine_bound_tokens_per_s": tokens_per_engine_step / ideal_period_s,
        "server_efficiency": (tokens / wall) / (tokens_per_engine_step / ideal_period_s),
        "engine_steps": steps, "step_period_ms": period_s * 1000.0, "simulated_step_ms": ideal_period_s * 1000.0,
        "tokens_per_engine_step": tokens_per_engine_step,
        "server_cpu_us_per_chunk": server_cpu / max(chunks, 1) * 1e6,
        "server_cpu_us_per_token": server_cpu / max(tokens, 1) * 1e6,
        "client_cpu_us_per_token": client_cpu / max(tokens, 1) * 1e6,
        "client_cpu_us_per_chunk": client_cpu / max(chunks, 1) * 1e6,
        "engine_process_cpu_us_per_token": engine_cpu / max(tokens, 1) * 1e6,
        "server_cpu_share": server_cpu / wall, "client_cpu_share": client_cpu / wall,
        "tpot_ms_p50": percentile(tpots, 50) * 1000.0, "ttft_ms_p50": percentile([r.ttft_s for r in ok], 50) * 1000.0,
    }


def plot(report: dict, path: Path) -> None:
    """One panel per tokens-per-step: the client's tokens/s of every arm against the engine alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["tokens_per_step"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(ks), figsize=(5.5 * len(ks), 4.2), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rows_k = [r for r in report["results"] if r["tokens_per_step"] == k]
        arms = list(dict.fromkeys(r["arm"] for r in rows_k))
        for arm in arms:
            rows = sorted((r for r in rows_k if r["arm"] == arm), key=lambda r: r["concurrency"])
            style = "o-" if arm.startswith("process") else "s--"
            ax.plot([r["concurrency"] for r in rows], [r["output_tokens_per_s"] for r in rows], style, label=arm)
        rows = sorted((r for r in rows_k if r["arm"] == arms[0]), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rows], [r["engine_bound_tokens_per_s"] for r in rows], "x:", color="k",
                label="engine alone")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{k} token{'s' if k > 1 else ''} per request per step", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"Server in front of a simulated engine ({s['step_ms']} ms asleep + {s['host_ms']} ms host per "
                 f"step), {report['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from scripts import data

    prompts = [p.prompt for p in data.read_prompt_file(args.prompts_file)]
    report = {
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (server and client "
                    "processes on the same machine)",
        "command": "python -m scripts.bench_server_overhead " + shlex.join(sys.argv[1:]),
        "settings": {k: getattr(args, k) for k in ("step_ms", "host_ms", "max_num_seqs", "output_len",
                                                    "prompts_per_user", "min_requests", "prompts_file")},
        "software": {"python": platform.python_version(), "switch_interval_s": sys.getswitchinterval()},
        "repeats": args.repeats,
        "load_average_at_start": os.getloadavg(),
        "results": [],  # per arm and level, the repeat with the median tokens/s
        "runs": [],  # every repeat
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir or out.parent)
    log_dir.mkdir(parents=True, exist_ok=True)
    # The engine modes of one arm run side by side (an idle server costs nothing), and every level is measured in
    # turns, mode after mode, repeat after repeat: on a shared machine whose load drifts, the two modes of a level are
    # measured seconds apart, and `paired_ratio` compares them repeat by repeat.
    for k, arm in itertools.product(args.tokens_per_step, args.arms):
        servers = {}
        try:
            for engine in args.engine_modes:
                label = arm_label(arm, engine)
                servers[engine] = ServerProcess(args, arm, engine, k, log_dir / f"server-overhead-{label}-{k}.log")
            for server in servers.values():
                server.wait_ready()
            for c in args.concurrency:
                for rep in range(args.repeats):
                    for server in servers.values():
                        row = {**measure_level(server, prompts, args, c), "repeat": rep}
                        log.info("%s, %d tok/step, C=%4d: %8.0f tok/s (engine alone %8.0f, ×%.2f); step period "
                                 "%.2f ms (simulated %.2f); CPU per token server %.0f µs, client %.0f µs",
                                 row["arm"], k, c, row["output_tokens_per_s"], row["engine_bound_tokens_per_s"],
                                 row["server_efficiency"], row["step_period_ms"], row["simulated_step_ms"],
                                 row["server_cpu_us_per_token"], row["client_cpu_us_per_token"])
                        report["runs"].append(row)
                    report["results"] = median_rows(report["runs"])
                    report["load_average_at_end"] = os.getloadavg()
                    out.write_text(json.dumps(report, indent=1) + "\n")
        finally:
            for server in servers.values():
                server.stop()
    if args.plot:
        plot(report, Path(args.plot))
    eff = [r["server_efficiency"] for r in report["results"]]
    log.info("server efficiency median %.2f (min %.2f); wrote %s", statistics.median(eff), min(eff), out)
    return 0


def median_rows(runs: list[dict]) -> list[dict]:
    """Per (tokens per step, arm, concurrency), the run with the median tokens/s (the lower middle one of an even
    count), with every repeat's tokens/s beside it and, for a process arm, ``paired_ratio``: the median over repeats
    of its tokens/s over the thread arm's of the same repeat (measured just before it). Sorted by tokens per step,
    arm (in the order they ran) and concurrency."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["tokens_per_step"], r["arm"], r["concurrency"]), []).append(r)
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    rows = []
    for key in sorted(groups, key=lambda key: (key[0], arms.index(key[1]), key[2])):
        group = groups[key]
        ranked = sorted(group, key=lambda r: r["output_tokens_per_s"])
        row = {**ranked[(len(ranked) - 1) // 2], "repeats_output_tokens_per_s": [r["output_tokens_per_s"]
                                                                                 for r in group]}
        thread = {r["repeat"]: r for r in groups.get((key[0], row["chunks_per"], key[2]), [])}
        pairs = [r["output_tokens_per_s"] / thread[r["repeat"]]["output_tokens_per_s"] for r in group
                 if row["engine"] != "thread" and r["repeat"] in thread]
        if pairs:
            row["paired_ratio"] = statistics.median(pairs)
        rows.append(row)
    return rows


def _engine_modes(text: str) -> list[str]:
    modes = text.split(",")
    for mode in modes:
        kind, _, n = mode.partition(":")
        if not (mode in ("thread", "process") or (kind == "process" and n.isdigit() and int(n) >= 1)):
            raise argparse.ArgumentTypeError(f"engine modes are thread, process and process:N, got {mode!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="(internal) the server process")
    for q in (p, s):
        q.add_argument("--model", default="smollm2-135m-instruct", help="target whose tokenizer the server uses")
        q.add_argument("--max-num-seqs", type=int, default=256,
                       help="slots of the simulated engine (default: %(default)s)")
        q.add_argument("--step-ms", type=float, default=2.5, help="simulated device time per step (GIL free)")
        q.add_argument("--host-ms", type=float, default=0.3, help="simulated host work per step (GIL held)")
    s.add_argument("--port", type=int, required=True, help="port to listen on (default: %(default)s)")
    s.add_argument("--tokens-per-step", type=int, default=1,
                   help="tokens each running request gets per simulated step (default: %(default)s)")
    s.add_argument("--per-step", action="store_true", help="one chunk per engine step (no coalescing)")
    s.add_argument("--engine-process", action="store_true", help="the simulated engine in its own process")
    s.add_argument("--api-server-count", type=int, default=1, help="HTTP processes (with --engine-process)")
    p.add_argument("--tokens-per-step", type=lambda t: [int(x) for x in t.split(",")], default=[1, 3],
                   help="comma list: tokens each request gets per step (1 = plain decoding)")
    p.add_argument("--arms", type=lambda t: t.split(","), default=["coalesce", "per-step"],
                   help="comma list: coalesce (the server's default: queued steps leave as one chunk), per-step")
    p.add_argument("--engine-modes", type=_engine_modes, default=["thread", "process"],
                   help="comma list: thread (the engine on a thread of the server process), process (in its own "
                        "process, optimized.serve --engine-process), process:N (that and N HTTP processes, "
                        "--api-server-count N); each crossed with --arms")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16, 64, 256],
                   help="comma list of concurrency levels (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every arm this many times (arms interleaved); the report keeps the median run")
    p.add_argument("--output-len", type=int, default=128, help="tokens per request (default: %(default)s)")
    p.add_argument("--prompts-per-user", type=int, default=4,
                   help="requests per simulated user and level (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=16, help="fewest requests per level (default: %(default)s)")
    p.add_argument("--prompts-file", default=str(ROOT / "docs/benchmarks/eval_prompts.jsonl"),
                   help="JSONL of {'prompt': ...} lines: the requests' prompts (default: %(default)s)")
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/server-overhead-cpu.json"),
                   help="JSON path of the results (default: %(default)s)")
    p.add_argument("--plot", default=None, help="PNG path of the plot (none: no plot) (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="server logs (default: next to --out)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    return serve(args) if args.cmd == "serve" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
