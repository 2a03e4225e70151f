"""A peer's client against ours: the serving benchmark's numbers cross-checked with GuideLLM.

``scripts/bench_serving.py`` measures the server with our own client. A client can be its own bottleneck, or count
differently (what a "token" is in a stream chunk, when the clock starts), so this script runs, against one running
server and at each ``--concurrency`` C, first our client and then GuideLLM (``pip install guidellm``; vLLM's
project's benchmarking tool) on the same workload, and writes both side by side:

* **Same workload:** the same prompts (one JSONL written here, read by both clients: ``--prompts-file``, or the
  held-out ShareGPT first turns of ``--sharegpt-file`` as ``bench_serving`` picks them), N = max(C ×
  ``--requests-per-user``, ``--min-requests``) streaming chat requests, C at a time (our closed-loop users;
  GuideLLM's ``concurrent`` profile with C streams), ``--output-len`` tokens each with ``ignore_eos``, temperature 0
  (GuideLLM sends it through its request-body extras). Our client warms each level up first (one unmeasured request
  per user); GuideLLM runs right after it, on the warm server.
* **Side by side, per level:** aggregate output tokens/s (ours: tokens / wall time from the first send to the last
  token; GuideLLM: its output tokens / its benchmark duration, and the time-weighted mean rate its console prints),
  TTFT and TPOT medians, completed and failed requests, and the ratio GuideLLM / ours of the aggregate.
* **The engine alone, optionally:** ``--engine-report`` names ``scripts/bench_engine.py`` reports measured on the same
  prompts (closed batches, or continuous arrivals with ``--requests-per-slot``); each level then records the engine's
  tokens/s at batch size C in ``--engine-modes`` (default: the label and its one-step-ahead variant) and what each
  client measured through the server over the fastest of them. ``--annotate REPORT`` adds that to a report already
  written, running no client.

GuideLLM counts tokens with a tokenizer: ``--tokenizer`` (an HF tokenizer directory), or the one of ``--model``
(the server's target: a name, a .gguf file or an HF directory), saved to a temporary directory.

Example (a server already running on port 8000, plain decoding)::

    python -m optimized.serve --model TARGET.gguf --speculative-config '{"mode": "none"}' &
    python -m scripts.peer_check_serving --base-url http://127.0.0.1:8000 --label none --model TARGET.gguf \\
        --sharegpt-file SHAREGPT.json.gz --concurrency 64,256 --out docs/benchmarks/serving-peer-h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("dspark.peer_check_serving")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None, help="the running server, e.g. http://127.0.0.1:8000 (required "
                   "unless --annotate)")
    p.add_argument("--label", default="adaptive", help="the mode the server runs (recorded in the JSON)")
    p.add_argument("--concurrency", default="64,256", help="comma-separated concurrent users (streams)")
    p.add_argument("--requests-per-user", type=int, default=8,
                   help="measured requests per level: max(C × this, --min-requests); both clients send the same")
    p.add_argument("--min-requests", type=int, default=64, help="the fewest measured requests per level")
    p.add_argument("--output-len", type=int, default=128, help="tokens each request generates (ignore_eos)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="drop ShareGPT prompts longer than 4x this in characters (as bench_serving does)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts-file", default=None, help='JSONL, one {"prompt": ...} per line')
    src.add_argument("--sharegpt-file", default=None, help="ShareGPT .json(.gz) (none: the packaged file)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the server's target, for GuideLLM's tokenizer (when --tokenizer is not given)")
    p.add_argument("--tokenizer", default=None, help="an HF tokenizer directory for GuideLLM (default: --model's)")
    p.add_argument("--guidellm", default="guidellm", help="the GuideLLM command (a path or a name on PATH)")
    p.add_argument("--hardware", default=None, help="recorded in the JSON (default: this machine's GPU or CPU)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="the most either client may run at one level")
    p.add_argument("--work-dir", default=None, help="where the clients' files go (default: a temporary directory)")
    p.add_argument("--out", default="serving-peer.json", help="JSON report (rewritten after every level)")
    p.add_argument("--engine-report", action="append", default=[],
                   help="a scripts/bench_engine.py JSON on the same prompts (repeatable): the engine alone per level")
    p.add_argument("--engine-modes", default=None,
                   help="bench_engine modes compared (comma-separated; default: LABEL,LABEL+async)")
    p.add_argument("--annotate", default=None,
                   help="a report this script wrote: add --engine-report's numbers to it (in place) and run no client")
    args = p.parse_args(argv)
    if args.base_url is None and args.annotate is None:
        p.error("--base-url is required (or --annotate REPORT)")
    if args.annotate is not None and not args.engine_report:
        p.error("--annotate needs at least one --engine-report")
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1:
        p.error(f"--concurrency needs positive integers, got {args.concurrency!r}")
    if args.output_len < 2 or args.min_requests < 1 or args.requests_per_user < 1:
        p.error("--output-len must be at least 2, --min-requests and --requests-per-user at least 1")
    return args


def prompts(args: argparse.Namespace) -> list[str]:
    """The workload's prompts, chosen as ``bench_serving`` chooses them (held-out split, filter, file order)."""
    from scripts.bench_serving import load_prompts

    found = load_prompts(args)
    if not found:
        raise SystemExit("no prompt to send: the prompt source is empty after filtering")
    return found


def tokenizer_dir(args: argparse.Namespace, work: Path) -> str:
    """An HF tokenizer directory GuideLLM can load offline: ``--tokenizer``, or ``--model``'s saved to ``work``."""
    if args.tokenizer:
        return args.tokenizer
    from reference.target import Target

    path = work / "tokenizer"
    Target.load(args.model).tokenizer.save_pretrained(path)
    return str(path)


def run(cmd: list[str], timeout_s: float, log_path: Path) -> None:
    """Run a client to completion, its output to ``log_path``; fail with the log's tail if it fails."""
    log.info("running %s", shlex.join(cmd))
    with open(log_path, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        tail = log_path.read_text()[-2000:]
        raise SystemExit(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited {proc.returncode}:\n{tail}")


def ours(args: argparse.Namespace, c: int, n: int, prompts_path: Path, work: Path) -> dict[str, Any]:
    """One level of ``scripts.bench_serving`` (its row of the report)."""
    out = work / f"ours-{c}.json"
    run([sys.executable, "-m", "scripts.bench_serving", "--base-url", args.base_url, "--label", args.label,
         "--concurrency", str(c), "--prompts-per-user", "1", "--min-requests", str(n), "--output-len",
         str(args.output_len), "--prompts-file", str(prompts_path), "--out", str(out)],
        args.timeout_s, work / f"ours-{c}.log")
    row = json.loads(out.read_text())["results"][0]
    return {"output_tokens_per_s": row["output_tokens_per_s"], "ttft_ms_p50": row["ttft_ms_p50"],
            "tpot_ms_p50": row["tpot_ms_p50"], "requests": row["requests"], "errors": row["errors"],
            "output_tokens": row["output_tokens"], "duration_s": row["duration_s"]}


def guidellm_scenario(args: argparse.Namespace, c: int, n: int, data_path: Path, tokenizer: str,
                      out: Path) -> dict[str, Any]:
    """GuideLLM's run configuration for one level (a scenario file: the request-body extras need nesting)."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": args.base_url, "request_format": "/v1/chat/completions",
                    "extras": {"body": {"temperature": 0.0}}},
        "profile": {"kind": "concurrent", "streams": c},
        "constraints": [{"kind": "max_requests", "count": n}],
        "data": [{"kind": "json_file", "path": str(data_path)}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def peer(args: argparse.Namespace, c: int, n: int, data_path: Path, tokenizer: str, work: Path) -> dict[str, Any]:
    """One level of GuideLLM, read back from its JSON report."""
    out = work / f"guidellm-{c}.json"
    scenario = work / f"guidellm-{c}-scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(args, c, n, data_path, tokenizer, out), indent=2))
    run([args.guidellm, "run", "--scenario", str(scenario), "--disable-console-interactive"], args.timeout_s,
        work / f"guidellm-{c}.log")
    return read_guidellm(out)


def read_guidellm(path: Path) -> dict[str, Any]:
    """The numbers compared, from a GuideLLM JSON report of one benchmark."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ok = lambda name: m[name]["successful"]  # noqa: E731 (a lookup, read once per field)
    tokens = ok("output_token_count")["total_sum"]
    duration = float(bench["duration"])
    totals = m["request_totals"]
    return {"output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
            "output_tokens_per_s_mean_rate": ok("output_tokens_per_second")["mean"],
            "ttft_ms_p50": ok("time_to_first_token_ms")["median"],
            "tpot_ms_p50": ok("time_per_output_token_ms")["median"],
            "requests": totals["successful"], "errors": totals["errored"] + totals["incomplete"],
            "output_tokens": tokens, "duration_s": duration}


def engine_alone(report: dict[str, Any], engine_reports: list[str], modes: list[str] | None) -> dict[str, Any]:
    """Add to each level of ``report`` the engine alone at batch size C from ``engine_reports``
    (``scripts/bench_engine.py`` JSONs, keyed by file name) in ``modes`` (default: the report's label and its
    one-step-ahead variant), and each client's tokens/s over the fastest of them. A level a report lacks is left out
    of that report's entry; a report none of whose modes were measured is an error (the wrong file)."""
    modes = modes or [report["label"], report["label"] + "+async"]
    for path in engine_reports:
        data = json.loads(Path(path).read_text())
        summary, name = data.get("summary") or {}, Path(path).name
        if not any(m in (summary.get(str(r["concurrency"])) or {}).get("tokens_per_s", {})
                   for r in report["results"] for m in modes):
            raise SystemExit(f"{path}: no level of {modes} at the report's concurrencies: not the engine report "
                             "of this workload?")
        for row in report["results"]:
            measured = (summary.get(str(row["concurrency"])) or {}).get("tokens_per_s", {})
            engine = {m: measured[m] for m in modes if m in measured}
            if not engine:
                continue
            best = max(engine, key=engine.get)
            entry = {"requests_per_slot": data.get("settings", {}).get("requests_per_slot", 1),
                     "tokens_per_s": engine, "fastest": best}
            for client in ("bench_serving", "guidellm"):
                entry[f"{client}_over_engine"] = round(row[client]["output_tokens_per_s"] / engine[best], 3)
            row.setdefault("engine_alone", {})[name] = entry
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = parse_args(argv)
    modes = args.engine_modes.split(",") if args.engine_modes else None
    if args.annotate is not None:
        path = Path(args.annotate)
        report = engine_alone(json.loads(path.read_text()), args.engine_report, modes)
        report["engine_alone_command"] = ("python -m scripts.peer_check_serving "
                                          + shlex.join(argv if argv is not None else sys.argv[1:]))
        path.write_text(json.dumps(report, indent=2) + "\n")
        log.info("added the engine alone to %s", path)
        return report
    if shutil.which(args.guidellm) is None:
        raise SystemExit(f"GuideLLM not found ({args.guidellm!r}): pip install guidellm, or pass --guidellm PATH")
    for path in args.engine_report:  # an unreadable engine report fails now, not after the clients have run
        json.loads(Path(path).read_text())
    command = "python -m scripts.peer_check_serving " + shlex.join(argv if argv is not None else sys.argv[1:])
    work_ctx = tempfile.TemporaryDirectory(prefix="peer-check-") if args.work_dir is None else None
    work = Path(args.work_dir or work_ctx.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        texts = prompts(args)
        tokenizer = tokenizer_dir(args, work)
        report: dict[str, Any] = {"hardware": args.hardware or _hardware(), "command": command,
                                  "label": args.label, "output_len": args.output_len,
                                  "prompts": args.prompts_file or "ShareGPT held-out split, file order",
                                  "peer": _guidellm_version(args.guidellm), "results": []}
        for c in args.levels:
            n = max(args.requests_per_user * c, args.min_requests)
            batch = [texts[i % len(texts)] for i in range(n)]  # request i takes prompt i, cycling, for both
            ours_path, peer_path = work / f"prompts-{c}.jsonl", work / f"guidellm-{c}-data.jsonl"
            ours_path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in batch))
            peer_path.write_text("".join(json.dumps({"prompt": t, "output_tokens_count": args.output_len}) + "\n"
                                         for t in batch))
            t0 = time.perf_counter()
            mine = ours(args, c, n, ours_path, work)
            theirs = peer(args, c, n, peer_path, tokenizer, work)
            ratio = theirs["output_tokens_per_s"] / mine["output_tokens_per_s"] if mine["output_tokens_per_s"] else 0
            report["results"].append({"label": args.label, "concurrency": c, "requests": n, "bench_serving": mine,
                                      "guidellm": theirs, "guidellm_over_bench_serving": round(ratio, 3)})
            log.info("C=%4d  ours %8.0f tokens/s  GuideLLM %8.0f tokens/s (%.2fx)  TTFT p50 %.1f / %.1f ms  "
                     "(%.0f s)", c, mine["output_tokens_per_s"], theirs["output_tokens_per_s"], ratio,
                     mine["ttft_ms_p50"], theirs["ttft_ms_p50"], time.perf_counter() - t0)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        if args.engine_report:  # once every level is measured (and written: a mismatched report loses no run)
            engine_alone(report, args.engine_report, modes)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if work_ctx is not None:
            work_ctx.cleanup()
    log.info("wrote %s", args.out)
    return report


def _hardware() -> str:
    from scripts.bench_serving import hardware

    return hardware()


def _guidellm_version(command: str) -> str:
    try:
        out = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "guidellm (version unknown)"
    return out or "guidellm (version unknown)"


if __name__ == "__main__":
    main()
