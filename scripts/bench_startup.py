"""Start-up benchmark: how long ``python -m optimized.serve`` takes from the command to ``GET /health`` = 200, where
that time goes, and whether the first request after it is as fast as the tenth.

Each of ``--launches`` launches starts the server with ``--server-args`` (nothing else: the defaults are what is
measured), polls ``/health`` every 0.1 s until it answers 200, sends ``--requests`` identical greedy completions one
after another (``--max-tokens`` tokens each, ``ignore_eos``), then stops the server with SIGTERM. From the server's
log it takes the time of its first line and of the engine's first start-up stage (both from the command) and every
stage's own time (``start-up: NAME done in S s``, and each CUDA-graph set's capture and warm-up). The first launch
on a fresh machine is the cold start (Triton compiles every kernel, the step-cost table is profiled); later launches
are warm (kernels and the table cached). The JSON is rewritten after every launch.

Example (H200; docs/serving.md, "Start-up")::

    python -m scripts.bench_startup --launches 3 --server-args "--model TARGET.gguf" \\
        --out docs/benchmarks/startup-h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

from scripts.bench_serving import LaunchedServer, hardware, served_model

log = logging.getLogger("dspark.bench_startup")

# The server's log lines (format "%(asctime)s %(name)s %(levelname)s %(message)s", optimized/serve.py).
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) \w+ (.*)$")
STAGE_DONE = re.compile(r"start-up: (.+?) done in ([\d.]+) s")
# "(warm-up of 21 sizes 1.30 s)" since the warm-up runs one bucket per size class; "(warm-up 3.10 s)" before
GRAPHS = re.compile(r"captured (\d+) (\w+) graphs \(.*?\) in ([\d.]+) s \(warm-up (?:of (\d+) sizes )?([\d.]+) s")


def parse_log(text: str, launched_at: float) -> dict:
    """Stage times, graph captures, and when (seconds after ``launched_at``, a ``time.time()``) the server logged
    its first line, the engine began its first stage, and the server said it was ready."""
    out: dict = {"stages": {}, "graphs": {}, "first_log_s": None, "engine_first_stage_s": None}
    for line in text.splitlines():
        m = STAMP.match(line)
        if m is None:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - launched_at
        message = m.group(3)
        if out["first_log_s"] is None:
            out["first_log_s"] = round(at, 2)
        if out["engine_first_stage_s"] is None and message.startswith("start-up: ") and message.endswith(" ..."):
            out["engine_first_stage_s"] = round(at, 2)
        if (s := STAGE_DONE.search(message)) is not None:
            out["stages"][s.group(1)] = float(s.group(2))
        if (g := GRAPHS.search(message)) is not None:
            out["graphs"][g.group(2)] = {"count": int(g.group(1)), "seconds": float(g.group(3)),
                                         "warmup_s": float(g.group(5))}
            if g.group(4) is not None:
                out["graphs"][g.group(2)]["warmed_sizes"] = int(g.group(4))
    return out


def time_requests(url: str, n: int, max_tokens: int) -> list[float]:
    """``n`` identical greedy completions, one after another; milliseconds each."""
    model, _ = served_model(url, None)
    body = {"model": model, "prompt": "The history of the printing press", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    times = []
    with httpx.Client(timeout=600) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            times.append(round((time.perf_counter() - t0) * 1000, 2))
    return times


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    server_args = shlex.split(args.server_args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"hardware": args.hardware or hardware(), "command": shlex.join(["python", "-m", "scripts.bench_startup",
                                                                              *argv]),
              "settings": {"server_args": server_args, "requests": args.requests, "max_tokens": args.max_tokens},
              "launches": []}
    for i in range(1, args.launches + 1):
        log_path = log_dir / f"startup-{i}.log"
        launched_at = time.time()
        server = LaunchedServer(None, server_args, log_path, poll_s=0.1)
        try:
            ready_s = server.wait_ready()
            requests_ms = time_requests(server.url, args.requests, args.max_tokens)
        finally:
            server.stop()
        row = {"launch": i, "ready_s": round(ready_s, 2), **parse_log(log_path.read_text(), launched_at),
               "requests_ms": requests_ms}
        log.info("launch %d: /health 200 after %.1f s (first log line %.1f s, engine's first stage %.1f s); "
                 "stages %s; requests %s ms", i, ready_s, row["first_log_s"] or -1, row["engine_first_stage_s"] or -1,
                 ", ".join(f"{k} {v:.2f} s" for k, v in row["stages"].items()), requests_ms)
        report["launches"].append(row)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def summarize(report: dict) -> str:
    lines = []
    for r in report["launches"]:
        first, rest = r["requests_ms"][0], r["requests_ms"][1:]
        line = f"launch {r['launch']}: ready {r['ready_s']:.1f} s; first request {first:.0f} ms"
        lines.append(line + (f", then median {statistics.median(rest):.0f} ms" if rest else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=type("Formatter", (argparse.RawDescriptionHelpFormatter,
                                                               argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--server-args", default="", help="flags for python -m optimized.serve (quoted, one string)")
    p.add_argument("--launches", type=int, default=3, help="launches in a row: the first may be cold, the rest warm")
    p.add_argument("--requests", type=int, default=10, help="greedy completions timed after each launch")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="completion tokens of each timed request (default: %(default)s)")
    p.add_argument("--log-dir", default="runs/startup", help="the servers' logs")
    p.add_argument("--hardware", default=None,
                   help="hardware label recorded in the JSON (none: detected) (default: %(default)s)")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    if args.launches < 1 or args.requests < 1:
        p.error("--launches and --requests must be ≥ 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    report = run(args, argv)
    print(summarize(report))
    return report


if __name__ == "__main__":
    main()
    raise SystemExit(0)
