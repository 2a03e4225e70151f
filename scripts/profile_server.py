"""Where the serving path's host time goes, per generated token: the CPU time of every process of the server stack
and of the client, split into stages by a sampling profiler.

The stack is the real one: ``optimized.serve``'s engine process (``--engine-process``), its pipe, its HTTP
process(es) (``--api-server-count``) with their SSE streams, driven by ``scripts/bench_serving.py``'s closed-loop
client (C users, streaming chat requests of ``--output-len`` tokens, ``ignore_eos``, continuous usage, one warm-up
round per level). Behind it runs either

* ``--engine synthetic`` (no GPU, no model): ``scripts/bench_server_overhead.py``'s ``SimulatedEngine``, the
  engine's public API that gives every running request ``--tokens-per-step`` tokens (1: plain decoding) of real
  English text every ``--step-ms`` (a sleep: the device's share; no simulated host work), so that whatever CPU the
  engine process spends is the serving layer's own plus a small, separately reported cost of the simulated step; or
* ``--engine real``: ``python -m optimized.serve`` with ``--server-args`` (on a GPU host, the real engine).

Per level it reports

* ``cpu_us_per_token``: CPU time (user + system, Linux ``/proc``) per delivered token of the engine process, of the
  HTTP processes (all of them) and of the client processes, measured without a profiler attached;
* with ``--profile`` (py-spy, ``pip install py-spy``; it needs ptrace rights over the server's processes), each
  process's samples sorted into stages (:data:`STAGES`: the first rule that matches a frame, searching each stack
  from its innermost frame out), the waits dropped (:data:`IDLE_CALLS`), and each stage's share of the rest times
  the process's CPU as µs per token. The profile is taken
  in a second pass of the same level, so the sampler's own cost never enters ``cpu_us_per_token``. In the engine
  process the ``engine step`` stage is the (simulated or real) engine itself; everything else there is the serving
  layer's per-step host work (commands in, outputs collected, the message built, pickled and written).

Usage (CPU, the synthetic engine; about two minutes on a 2-core machine)::

    python -m scripts.profile_server --concurrency 64,256 --profile --out docs/benchmarks/serving-host-profile-cpu.json

On a GPU host with the real engine (plain decoding)::

    python -m scripts.profile_server --engine real --concurrency 64,256 --profile \\
        --server-args "--speculative-config '{\\"mode\\": \\"none\\"}'" --out serving-host-profile.json

``--baseline OLD.json`` copies the ``cpu_us_per_token`` and stage numbers of an earlier report into the new one as
``before`` beside each level, with ``after / before`` ratios: same harness, same settings, two versions of the code.
"""

from __future__ import annotations

import argparse
import json
import linecache
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from scripts.bench_server_overhead import engine_steps
from scripts.bench_serving import (
    WARMUP_TOKENS,
    _cpu_s,
    closed_loop,
    served_model,
    server_processes,
    stop_server,
    wait_healthy,
)

log = logging.getLogger("dspark.profile_server")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 1800  # the real engine's cold start on a GPU: weights, graphs, cost profile, warm-up

# Stages: (process kind, stage, substrings of a py-spy frame "function (file:line)"). A sample belongs to the stage of
# the first rule that one of its frames matches, frames searched from the innermost out, rules in this order. What
# matches no rule is "other" (interpreter start-up, logging, the garbage collector outside any of these).
STAGES: list[tuple[str, str, tuple[str, ...]]] = [
    ("engine", "engine step", ("step (scripts/bench_server_overhead.py", "step (optimized/engine.py",
                               "last_step_stats (")),
    ("engine", "commands in", ("_receive_commands (", "apply_commands (")),
    ("engine", "message: pickle + write", ("send (optimized/serving/engine_process.py",)),
    ("engine", "message: collect outputs", ("post (optimized/serving/engine_process.py",
                                            "run_steps (optimized/serving/engine_loop.py")),
    ("http", "results: read + unpickle", ("read (optimized/serving/engine_process.py", "_receive (")),
    ("http", "metrics", ("optimized/serving/metrics.py", "prometheus_client")),
    ("http", "detokenize", ("optimized/serving/text.py",)),
    ("http", "SSE chunk: JSON + framing", ("__call__ (optimized/serving/app.py", "_sse (", "format_sse_event",
                                           "model_dump_json")),
    ("http", "dispatch to streams", ("_dispatch (", "put_nowait (", "__anext__ (optimized/serving/app.py")),
    ("http", "ASGI response + socket writes", ("starlette/responses.py", "fastapi/sse.py", "starlette/middleware",
                                               "uvicorn/protocols/http", "send (optimized/serving/app.py",
                                               "timed_send (")),
    ("http", "request intake: parse, validate, tokenize", ("fastapi/routing.py", "starlette/routing.py",
                                                            "chat_completions (", "completions (", "pydantic",
                                                            "tokenization", "jinja")),
    ("http", "event loop", ("asyncio/", "uvloop")),
    ("client", "JSON parse", ("json/",)),
    ("client", "SSE line splitting", ("aiter_lines", "aiter_text", "_decoders.py")),
    ("client", "HTTP read (httpx, httpcore, h11)", ("httpx/", "httpcore/", "h11/", "anyio/")),
    ("client", "request loop", ("one_request (", "_users (")),
    ("client", "event loop", ("asyncio/", "uvloop")),
]


# A sample whose innermost frame waits (its source line calls one of these) is idle time: py-spy's own idle detection
# misses these waits on some kernels, so they are dropped here. The event loop's own poll (uvloop's run_forever, in C)
# shows as its Python caller's line (run_until_complete): dropped too, with the little C work it does besides waiting.
IDLE_CALLS = ("sleep(", ".wait(", ".acquire(True", "select(", "read(handle", ".get(timeout", "inbox.get(",
              "run_until_complete(",
              "run_forever(", "_recv_bytes(", ".poll(", "epoll")
_FRAME = re.compile(r"\((?P<file>[^()]*):(?P<line>\d+)\)$")


_LIBRARY = re.compile(r"^.*/(?:site-packages|lib/python3\.\d+)/")


def short(frame: str) -> str:
    """A frame as py-spy prints it without --full-filenames: paths from the project root or the library root."""
    m = _FRAME.search(frame)
    if m is None:
        return frame
    path = m["file"].removeprefix(f"{ROOT}/")
    return f"{frame[:m.start()]}({_LIBRARY.sub('', path)}:{m['line']})"


def is_idle(frame: str) -> bool:
    """Whether the innermost frame of a sample is a wait (:data:`IDLE_CALLS` on its source line)."""
    m = _FRAME.search(frame)
    if m is None:
        return False
    line = linecache.getline(m["file"], int(m["line"]))
    return any(call in line for call in IDLE_CALLS)


def classify(stack: str, kind: str) -> str:
    """The stage of one py-spy sample (``frame;frame;...``, outermost first) in a process of ``kind``: ``idle`` when
    its innermost frame waits."""
    frames = stack.split(";")
    if is_idle(frames[-1]):
        return "idle"
    for frame in map(short, reversed(frames)):
        for k, stage, marks in STAGES:
            if k == kind and any(m in frame for m in marks):
                return stage
    return "other"


def read_raw(path: Path) -> Counter:
    """py-spy's ``--format raw`` file: {stack: samples}."""
    counts: Counter = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if n.isdigit():
                counts[stack] += int(n)
    return counts


# --------------------------------------------------------------------------------------------------------------
# The server and its processes
# --------------------------------------------------------------------------------------------------------------


class Server:
    """The server under test on a free port: the synthetic engine (``scripts.bench_server_overhead serve``) or
    ``python -m optimized.serve``, always with the engine in its own process."""

    def __init__(self, args: argparse.Namespace, step_ms: float, log_path: Path) -> None:
        self.step_ms = step_ms if args.engine == "synthetic" else None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        seqs = str(args.max_num_seqs or max(args.concurrency))
        if args.engine == "synthetic":
            cmd = ["-m", "scripts.bench_server_overhead", "serve", "--model", args.model, "--step-ms",
                   str(step_ms), "--host-ms", "0", "--tokens-per-step", str(args.tokens_per_step)]
        else:
            cmd = ["-m", "optimized.serve", "--disable-uvicorn-access-log", *shlex.split(args.server_args)]
        cmd = [sys.executable, *cmd, "--port", str(port), "--max-num-seqs", seqs, "--engine-process",
               "--api-server-count", str(args.api_server_count)]
        log.info("launching %s (log: %s)", shlex.join(cmd), log_path)
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=pythonpath))
        self.log_path = log_path

    def wait_ready(self) -> None:
        wait_healthy(self.url, self.proc, self.log_path, START_TIMEOUT_S)

    def processes(self) -> dict[str, list[int]]:
        """{"http": [server 0, further API servers], "engine": [the engine process]} (Linux ``/proc``)."""
        api, engine = server_processes(self.proc.pid)
        return {"http": [self.proc.pid, *api], "engine": engine}

    def stop(self) -> None:
        stop_server(self.proc, 60)
        self._log.close()


# --------------------------------------------------------------------------------------------------------------
# One level
# --------------------------------------------------------------------------------------------------------------


def run_level(server: Server, model: str, prompts: list[str], args: argparse.Namespace, concurrency: int,
              profile_dir: Path | None) -> dict:
    """Warm up, then one closed-loop pass of ``concurrency`` users: the level's row, CPU seconds per process from
    ``/proc``. With ``profile_dir``, the pass runs under py-spy (one sampler per server process, and one on this
    process when it is the client) and the samples come back too, per process kind."""
    closed_loop(server.url, model, prompts, concurrency, concurrency, min(args.output_len, WARMUP_TOKENS), 0.0, None)
    n = max(concurrency * args.prompts_per_user, args.min_requests)
    pids = server.processes()
    spies = []
    if profile_dir is not None:
        targets = [(kind, pid) for kind, group in pids.items() for pid in group]
        if args.client_processes == 1:  # the client runs in this process: sampled as well
            targets.append(("client", os.getpid()))
        for kind, pid in targets:
            out = profile_dir / f"{kind}-{pid}.txt"
            spies.append((kind, out, subprocess.Popen(
                [shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid), "--rate", str(args.rate),
                 "--format", "raw", "--full-filenames", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(1.0)  # py-spy attaches
    cpu0 = {pid: _cpu_s(pid) for group in pids.values() for pid in group}
    steps0 = engine_steps(server.url)
    results, wall, client_cpu = closed_loop(server.url, model, prompts, concurrency, n, args.output_len, 0.0, None,
                                            args.client_processes)
    steps = engine_steps(server.url) - steps0 - 1  # the scrape is no step; the last one may be a tail
    used = {pid: _cpu_s(pid) - t for pid, t in cpu0.items()}  # CPU seconds of each server process in the pass
    cpu = {kind: sum(used[pid] for pid in group) for kind, group in pids.items()}
    each = [used[pid] for pid in pids["http"]]  # server 0 first: it also takes every step's stats
    samples: dict[str, Counter] = {}
    for kind, out, spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
        samples.setdefault(kind, Counter()).update(read_raw(out))
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.itl_s) + 1 for r in ok)

    def per_token(seconds: float) -> float:
        return round(seconds / max(tokens, 1) * 1e6, 2)

    return {"concurrency": concurrency, "step_ms": server.step_ms, "requests": len(ok),
            "errors": len(results) - len(ok), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1), "engine_steps": steps,
            "tokens_per_step": round(tokens / max(steps, 1), 2), "tokens_per_chunk": round(tokens / max(chunks, 1), 3),
            "cpu_us_per_token": {"engine_process": per_token(cpu["engine"]), "http_processes": per_token(cpu["http"]),
                                 "client": per_token(client_cpu)},
            "cpu_share": {"engine_process": round(cpu["engine"] / wall, 3),
                          "http_processes": round(cpu["http"] / wall, 3), "client": round(client_cpu / wall, 3),
                          # per HTTP process, API server 0 first (the metrics of every step are its work): one near
                          # 1.0 is a process that cannot go faster, and the engine's pipe to it fills
                          "each_http_process": [round(x / wall, 3) for x in each]},
            **({"samples": samples} if profile_dir is not None else {})}


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with each process's CPU per token replaced by its median over the runs (a
    machine shared with other work moves single runs by 10-20 %)."""
    row = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
    if len(runs) > 1:
        row["cpu_us_per_token"] = {k: statistics.median(r["cpu_us_per_token"][k] for r in runs)
                                   for k in row["cpu_us_per_token"]}
        row["repeats"] = {"output_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
                          "cpu_us_per_token": [r["cpu_us_per_token"] for r in runs]}
    return row


def stage_split(samples: dict[str, Counter], cpu_us: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each process kind's µs per token (the unprofiled pass's) shared out over its stages by their shares of the
    samples that were not idle."""
    split = {}
    for kind, key in (("engine", "engine_process"), ("http", "http_processes"), ("client", "client")):
        counts: Counter = Counter()
        for stack, n in samples.get(kind, Counter()).items():
            counts[classify(stack, kind)] += n
        idle = counts.pop("idle", 0)
        total = sum(counts.values())
        if total:
            stages = {stage: round(cpu_us[key] * n / total, 2) for stage, n in counts.most_common()}
            split[key] = {"samples": total, "idle_samples": idle, "us_per_token": stages}
            if kind == "engine":
                split[key]["serving_us_per_token"] = round(cpu_us[key] - stages.get("engine step", 0.0), 2)
    return split


def top_frames(samples: Counter, n: int = 15) -> list[list]:
    """The innermost frames that took the most samples (what the stage rules may have missed)."""
    leaf: Counter = Counter()
    for stack, k in samples.items():
        leaf[short(stack.rsplit(";", 1)[-1])] += k
    total = sum(leaf.values()) or 1
    return [[frame, round(k / total, 4)] for frame, k in leaf.most_common(n)]


def compare(rows: list[dict], baseline: dict) -> None:
    """Put the baseline's numbers of the same concurrency beside each row, with after / before ratios."""
    old = {r["concurrency"]: r for r in baseline["results"]}
    for row in rows:
        before = old.get(row["concurrency"])
        if before is None:
            continue
        row["before"] = {k: before[k] for k in ("output_tokens_per_s", "tokens_per_chunk", "cpu_us_per_token",
                                                "stages") if k in before}
        row["after_over_before"] = {k: round(v / before["cpu_us_per_token"][k], 3)
                                    for k, v in row["cpu_us_per_token"].items() if before["cpu_us_per_token"].get(k)}
        row["after_over_before"]["output_tokens_per_s"] = round(
            row["output_tokens_per_s"] / before["output_tokens_per_s"], 3)


def code_version() -> str:
    """The commit of the code under test (``+dirty`` with uncommitted changes), or "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run(args: argparse.Namespace) -> dict:
    from scripts import data

    prompts = [p.prompt for p in data.read_prompt_file(args.prompts_file)]
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.profile and shutil.which("py-spy") is None:
        raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
    report = {
        "what": "CPU time per generated token of each process of the serving stack (engine process, HTTP "
                "processes, benchmark client) and, from py-spy samples, of each stage inside the server processes",
        "hardware": f"{platform.machine()}, {os.cpu_count()} CPUs (server and client processes on the same machine)",
        "engine": ("synthetic: SimulatedEngine, no model; the engine step is a sleep" if args.engine == "synthetic"
                   else "real: python -m optimized.serve"),
        "command": "python -m scripts.profile_server " + shlex.join(args.argv),
        "settings": {k: getattr(args, k) for k in ("engine", "step_ms", "tokens_per_step", "api_server_count",
                                                   "output_len", "prompts_per_user", "client_processes", "repeats",
                                                   "rate", "server_args")},
        "python": platform.python_version(),
        "code": code_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "results": [],
    }
    server = None  # the synthetic engine's step time is fixed at launch: one server per level; the real one is shared
    try:
        for c, step_ms in zip(args.concurrency, args.step_ms, strict=True):
            if server is None or args.engine == "synthetic":
                if server is not None:
                    server.stop()
                server = Server(args, step_ms, log_dir / f"server-c{c}.log")
                server.wait_ready()
                model = served_model(server.url, None)[0]
            runs = [run_level(server, model, prompts, args, c, None) for _ in range(args.repeats)]
            row = median_run(runs)
            if args.profile:
                prof_dir = log_dir / f"c{c}"
                prof_dir.mkdir(exist_ok=True)
                prof = run_level(server, model, prompts, args, c, prof_dir)
                row["stages"] = stage_split(prof["samples"], row["cpu_us_per_token"])
                row["top_frames"] = {kind: top_frames(s) for kind, s in prof["samples"].items()}
                row["profiled_pass_tokens_per_s"] = prof["output_tokens_per_s"]
            log.info("c=%d: %.0f tok/s, CPU µs/token %s", c, row["output_tokens_per_s"], row["cpu_us_per_token"])
            report["results"].append(row)
    finally:
        if server is not None:
            server.stop()
    if args.baseline:
        baseline = json.loads(Path(args.baseline).read_text())
        report["baseline"] = {"code": baseline.get("code", "unknown"), "command": baseline.get("command"),
                              "load_average_at_start": baseline.get("load_average_at_start")}
        compare(report["results"], baseline)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        log.info("wrote %s", args.out)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.profile_server", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=["synthetic", "real"], default="synthetic",
                   help="synthetic: SimulatedEngine behind the real server, no model; real: python -m optimized.serve")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="synthetic engine: the target whose tokenizer the server uses")
    p.add_argument("--step-ms", type=lambda t: [float(x) for x in t.split(",")], default=None,
                   help="synthetic engine: time per step (a sleep), one value or one per --concurrency level; none: "
                        "10 ms up to 64 users, 20 ms above (6.4k and 12.8k tokens/s offered at 64 and 256 users, "
                        "below what a 2-core machine serves)")
    p.add_argument("--tokens-per-step", type=int, default=1,
                   help="synthetic engine: tokens per running request per step (1: plain decoding)")
    p.add_argument("--server-args", default="", help="real engine: extra flags for python -m optimized.serve")
    p.add_argument("--api-server-count", type=int, default=1, help="HTTP processes in front of the engine process")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine slots (none: the largest concurrency)")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[64, 256],
                   help="comma list of closed-loop user counts")
    p.add_argument("--output-len", type=int, default=128, help="tokens per request")
    p.add_argument("--prompts-per-user", type=int, default=2, help="measured requests per user and level")
    p.add_argument("--min-requests", type=int, default=16, help="fewest measured requests per level")
    p.add_argument("--client-processes", type=int, default=1, help="client processes (scripts/bench_serving.py)")
    p.add_argument("--prompts-file", default=str(ROOT / "docs/benchmarks/eval_prompts.jsonl"),
                   help="JSONL of {'prompt': ...} lines")
    p.add_argument("--repeats", type=int, default=1,
                   help="unprofiled passes per level: the report keeps the median (CPU per token of each process)")
    p.add_argument("--profile", action="store_true",
                   help="a second pass per level under py-spy: the stages of each server process")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--baseline", default=None, help="an earlier report of this script: before/after ratios")
    p.add_argument("--log-dir", default="runs/profile_server", help="server log and raw profiles (not published)")
    p.add_argument("--out", default=None, help="JSON report (none: printed only)")
    return p


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.step_ms is None:
        args.step_ms = [10.0 if c <= 64 else 20.0 for c in args.concurrency]
    if len(args.step_ms) == 1:
        args.step_ms *= len(args.concurrency)
    if len(args.step_ms) != len(args.concurrency):
        raise SystemExit("--step-ms: one value, or one per --concurrency level")
    report = run(args)
    if not args.out:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    return report


if __name__ == "__main__":
    main()
