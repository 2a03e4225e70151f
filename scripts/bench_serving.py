"""Serving benchmark in the style of ``vllm bench serve``: a closed-loop concurrency sweep against the HTTP server.

The serving frontier of docs/serving.md: for each verify policy (docs/method.md §5) and each concurrency C, C
simulated users each send one streaming chat request at a time, back to back, until ``C × --prompts-per-user``
requests have completed. Names follow ``docs/method.md`` (``τ`` tokens emitted per verify step, ``ℓ`` verify
length).

Method:

* **Prompts:** held-out ShareGPT first turns (``scripts/data.py``: the split the drafter never trained on), English,
  at most ``4 × --max-prompt-tokens`` characters, in file order; request i takes prompt i (cycling), so every mode
  and concurrency sees the same prompts in the same order. ``--prompts-file`` replaces them.
* **Fixed output length:** ``max_tokens = --output-len`` with ``ignore_eos``, temperature ``--temperature`` (0).
* **Warm-up excluded:** before each level, each user sends one request (``min(--output-len, 32)`` tokens) that is
  not measured; the server itself warms up before ``/health`` answers 200.
* **Per request** (server-sent events read with httpx; ``continuous_usage_stats`` gives the exact token count of
  every chunk): TTFT = send → first chunk with a token; ITL = gaps between chunks that carry tokens (a speculative
  step delivers several tokens in one chunk, as in vLLM's benchmark); TPOT = (latency − TTFT) / (tokens − 1).
* **Per level:** TTFT, TPOT and ITL p50/p99 (ms); aggregate output tokens/s = tokens of the measured requests /
  wall time from the first send to the last token; per-user tokens/s = mean over requests of 1 / TPOT (how fast a
  user sees text once it flows); mean accepted length τ = 1 + Δ accepted drafts / Δ verifying request-steps, from
  the server's ``/metrics`` before and after the level (1.0 without speculation).

Either point it at a running server (``--base-url``, one mode, named by ``--label``), or let it start
``python -m optimized.serve`` once per mode (``--launch``; ``--server-args`` are passed through, and
``--max-num-seqs`` defaults to the largest concurrency). The JSON (schema in docs/serving.md) is rewritten after
every level; ``--plot`` draws the frontier, per-user against aggregate tokens/s, one curve per mode.

Example (H200, every mode, one command)::

    python -m scripts.bench_serving --launch --modes none,fixed:1,fixed:3,fixed:5,fixed:7,dsd,adaptive \\
        --concurrency 1,4,16,64,256 --output-len 128 --out docs/benchmarks/serving-h200.json \\
        --plot docs/benchmarks/serving-h200.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import logging
import os
import platform
import queue
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from optimized.serve import usable_cores

log = logging.getLogger("dspark.bench_serving")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODES = "none,fixed:1,fixed:3,fixed:5,fixed:7,dsd,adaptive"
WARMUP_TOKENS = 32  # a warm-up request decodes long enough to pass through prefill, verify and draft steps
START_TIMEOUT_S = 1800  # a cold start on a GPU: weights, graphs, cost profile, warm-up


# --------------------------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """A verify policy as the benchmark names it (``fixed:3``) and as the server's --speculative-config sets it."""

    label: str  # "none", "fixed:3", "dsd", "adaptive", ...
    mode: str  # reference.config.SchedulerConfig.mode
    k: int | None = None  # fixed mode's K

    @classmethod
    def parse(cls, text: str) -> Mode:
        name, _, k = text.partition(":")
        if name == "fixed":
            if not k.isdigit():
                raise ValueError(f"mode {text!r}: fixed needs K, e.g. fixed:3")
            return cls(text, "fixed", int(k))
        if k or name not in ("none", "dsd", "threshold", "adaptive-sync", "adaptive"):
            raise ValueError(f"unknown mode {text!r}: none, fixed:K, dsd, threshold, adaptive-sync or adaptive")
        return cls(text, name)

    def speculative_config(self) -> str:
        spec = {"mode": self.mode} | ({"num_speculative_tokens": self.k} if self.k is not None else {})
        return json.dumps(spec)


# --------------------------------------------------------------------------------------------------------------
# One request, one level
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, output_len: int,
                      temperature: float) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
            "temperature": temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    res, last, tokens = RequestResult(ok=False), None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            # The body as it arrives, cut into events here: httpx's aiter_lines decodes and splits every network read
            # through three more async generators (scripts/profile_server.py). The server frames every event as one
            # "data: ..." line and a blank line (optimized/serving/app.py). Leaving at [DONE], before the body's end,
            # closes the connection, as before: with every connection kept alive instead, httpcore's pool scans all
            # of them at each request's start and end, which doubled this client's CPU per token at 256 users.
            pending, done = b"", False
            async for raw in r.aiter_raw():
                *events, pending = (pending + raw).split(b"\n\n")
                for event in events:
                    data = event.removeprefix(b"data:").strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        return res
                    n = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    if n > tokens:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_s = now - t0
                        else:
                            res.itl_s.append(now - last)
                        last, tokens = now, n
                if done:
                    break
    except httpx.HTTPError as err:
        res.error = f"{type(err).__name__}: {err}"
        return res
    res.latency_s = (last or time.perf_counter()) - t0
    res.output_tokens = tokens
    res.ok = tokens == output_len
    if not res.ok:
        res.error = f"{tokens} tokens instead of {output_len}"
    return res


async def _users(base_url: str, model: str, prompts: list[str], users: int, num_requests: int, output_len: int,
                 temperature: float, api_key: str | None, take) -> tuple[list[RequestResult], float, float]:
    """``users`` simulated users, each with one request in flight, until ``take()`` (the next request's index, shared
    by every client process) reaches ``num_requests``; returns the results and the first send's and the last
    completion's ``perf_counter`` times (CLOCK_MONOTONIC on Linux: comparable across processes)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=30)) as client:
        async def user() -> None:
            while (i := take()) < num_requests:
                results.append(await one_request(client, model, prompts[i % len(prompts)], output_len, temperature))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(users)))
        return results, t0, time.perf_counter()


def run_async(coro):
    """``asyncio.run(coro)`` on uvloop where it is installed (the server's extra brings it), its event loop in C, with
    what was alive before out of the garbage collector's reach meanwhile: full collections, frequent at thousands of
    events a second, then walk only what the level allocates (optimized/serving/app.py's ``freeze_heap`` says why).
    Together with the event splitting of :func:`one_request`, they took this client's CPU per streamed token from
    about 75 to about 45 µs at 256 users on a 2-core CPU (docs/benchmarks/serving-host-profile-cpu.json)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    gc.collect()
    gc.freeze()
    try:
        return asyncio.run(coro) if uvloop is None else uvloop.run(coro)
    finally:
        gc.unfreeze()


def _client_process(level: tuple, users: int, counter, start, out) -> None:
    """One client process of a level: its share of the users, started with the others (``start``); puts (results,
    first send, last completion, CPU seconds) on ``out``."""
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def take() -> int:
        with counter.get_lock():
            i = counter.value
            counter.value += 1
        return i

    try:
        out.put("ready")
        start.wait()
        cpu0 = time.process_time()
        results, t0, t1 = run_async(_users(*level[:3], users, *level[3:], take))
        out.put((results, t0, t1, time.process_time() - cpu0))
    except BaseException as err:  # the parent must not wait for this process's share: tell it why (as text, which
        out.put(RuntimeError(f"{type(err).__name__}: {err}"))  # always pickles)
        raise


def closed_loop(base_url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                output_len: int, temperature: float, api_key: str | None,
                processes: int = 1) -> tuple[list[RequestResult], float, float]:
    """``concurrency`` users, each with one request in flight, until ``num_requests`` were sent; returns the results,
    the wall time from the first send to the last completion and the client's CPU seconds. Request i takes prompt i
    (cycling) in order of sending. ``processes`` > 1 spreads the users over that many client processes (one event
    loop each), so that the client is not what limits a fast server: the benchmark's own CPU share is in the
    report (``client_cpu_share``)."""
    level = (base_url, model, prompts, num_requests, output_len, temperature, api_key)
    processes = max(1, min(processes, concurrency))
    if processes == 1:
        order = itertools.count()
        cpu0 = time.process_time()
        results, t0, t1 = run_async(_users(base_url, model, prompts, concurrency, num_requests, output_len,
                                           temperature, api_key, lambda: next(order)))
        return results, t1 - t0, time.process_time() - cpu0
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    counter, start, out = ctx.Value("q", 0), ctx.Event(), ctx.Queue()
    shares = [concurrency // processes + (p < concurrency % processes) for p in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(level, n, counter, start, out), daemon=True) for n in shares]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:  # every process imported and connected its queue: start them together
            if (msg := out.get(timeout=120)) != "ready":
                raise RuntimeError(f"a client process failed to start: {msg!r}")
        start.set()
        parts = []
        while len(parts) < len(procs):
            try:
                parts.append(out.get(timeout=5))
            except queue.Empty:  # a process that died without a word (killed) would leave us waiting forever
                if dead := [p for p in procs if p.exitcode not in (None, 0)]:
                    raise RuntimeError(f"a client process died (exit code {dead[0].exitcode})") from None
        if failed := [p for p in parts if isinstance(p, BaseException)]:
            raise RuntimeError(f"a client process failed: {failed[0]}") from failed[0]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts), sum(p[3] for p in parts)


def _share(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation, as numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


SCRAPED = ("dspark:request_steps_total", "vllm:spec_decode_num_accepted_tokens_total", "dspark:steps_total",
           "dspark:decode_steps_total", "dspark:step_time_seconds_sum", "vllm:time_to_first_token_seconds_sum",
           "vllm:time_to_first_token_seconds_count")


def scrape_counters(base_url: str, api_key: str | None) -> dict[str, float]:
    """The counters of ``/metrics`` that a level's report takes differences of (summed over label sets; 0 for one
    the server does not expose)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = dict.fromkeys(SCRAPED, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def process_cpu_s(pid: int | None) -> tuple[float, float] | None:
    """CPU seconds (user + system, Linux ``/proc``) of the server's HTTP processes (process ``pid`` and, with
    ``--api-server-count``, the further API servers among its children, named ``dspark-api-N``) and of its engine
    process (a multiprocessing child; 0 with the engine on a thread); None where they cannot be read (another OS,
    no pid)."""
    if pid is None or not Path(f"/proc/{pid}/stat").exists():
        return None
    api, engine = server_processes(pid)
    return _cpu_s(pid) + sum(map(_cpu_s, api)), sum(map(_cpu_s, engine))


def server_processes(pid: int) -> tuple[list[int], list[int]]:
    """(the further API servers, the engine process(es)) among the children of server ``pid`` (Linux ``/proc``):
    multiprocessing children, the API servers named ``dspark-api-N``."""
    children: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        tasks = []
    for task in tasks:  # the process's threads come and go: one that ended meanwhile has no children to read
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    spawned = [c for c in children if "spawn_main" in _cmdline(c)]
    api = [c for c in spawned if _comm(c).startswith("dspark-api")]
    return api, [c for c in spawned if c not in api]


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # gone meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def cpu_shares(client_s: float, server0: tuple[float, float] | None, server1: tuple[float, float] | None,
               wall_s: float) -> dict[str, float | None]:
    """CPU seconds per second of a level's wall time (1.0: one core busy throughout) of the client (all its
    processes), the server's HTTP processes and its engine process; None where unknown."""
    def share(seconds: float) -> float | None:
        return round(seconds / wall_s, 3) if wall_s > 0 else None

    known = server0 is not None and server1 is not None
    return {"client_cpu_share": share(client_s),
            "server_cpu_share": share(server1[0] - server0[0]) if known else None,
            "engine_process_cpu_share": share(server1[1] - server0[1]) if known else None}


def summarize(mode: Mode, concurrency: int, results: list[RequestResult], wall_s: float,
              before: dict[str, float], after: dict[str, float],
              cpu: dict[str, float | None] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    delta = {k: after[k] - before[k] for k in SCRAPED}
    steps = delta["dspark:request_steps_total"]
    accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
    tpots = [r.tpot_s for r in ok if r.tpot_s]
    itls = [x for r in ok for x in r.itl_s]
    ms = 1000.0
    engine_steps, first_tokens = delta["dspark:steps_total"], delta["vllm:time_to_first_token_seconds_count"]
    return {
        "mode": mode.mode, "k": mode.k, "label": mode.label, "concurrency": concurrency,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "per_user_tokens_per_s": statistics.fmean(1.0 / t for t in tpots) if tpots else float("nan"),
        "ttft_ms_p50": percentile([r.ttft_s for r in ok], 50) * ms,
        "ttft_ms_p99": percentile([r.ttft_s for r in ok], 99) * ms,
        "tpot_ms_p50": percentile(tpots, 50) * ms, "tpot_ms_p99": percentile(tpots, 99) * ms,
        "itl_ms_p50": percentile(itls, 50) * ms, "itl_ms_p99": percentile(itls, 99) * ms,
        "mean_accepted_length": 1.0 + accepted / steps if steps else 1.0,
        "requests": len(ok), "errors": len(results) - len(ok), "output_tokens": tokens, "duration_s": wall_s,
        # Where the time went (docs/serving.md, "Reading a level"): the engine's own steps from the server's
        # counters, TTFT as the server measures it (submit to first token) beside the client's mean, CPU shares.
        "engine_steps": int(engine_steps), "engine_decode_steps": int(delta["dspark:decode_steps_total"]),
        "engine_requests_per_step": (steps / delta["dspark:decode_steps_total"]
                                     if delta["dspark:decode_steps_total"] else None),
        "engine_step_ms_mean": delta["dspark:step_time_seconds_sum"] / engine_steps * ms if engine_steps else None,
        "engine_busy_share": delta["dspark:step_time_seconds_sum"] / wall_s if wall_s > 0 else None,
        "ttft_ms_mean": statistics.fmean(r.ttft_s for r in ok) * ms if ok else float("nan"),
        "server_ttft_ms_mean": (delta["vllm:time_to_first_token_seconds_sum"] / first_tokens * ms
                                if first_tokens else None),
        **(cpu or {"client_cpu_share": None, "server_cpu_share": None, "engine_process_cpu_share": None}),
    }


# --------------------------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------------------------


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float, poll_s: float = 0.5) -> float:
    """Poll ``url``/health every ``poll_s`` seconds until it answers 200; returns the seconds it took. Fails when
    ``proc`` exits first or the time runs out, naming the server's log."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"server not ready after {timeout_s} s; see {log_path}")


class LaunchedServer:
    """``python -m optimized.serve`` for one mode (None: the server's default), on a free port; stopped with SIGTERM
    (it drains, exits 0). ``wait_ready`` polls /health every ``poll_s`` seconds."""

    def __init__(self, mode: Mode | None, server_args: list[str], log_path: Path, poll_s: float = 0.5) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        spec = ["--speculative-config", mode.speculative_config()] if mode is not None else []
        cmd = [sys.executable, "-m", "optimized.serve", "--port", str(port), "--disable-uvicorn-access-log", *spec,
               *server_args]
        log.info("launching %s (log: %s)", shlex.join(cmd), log_path)
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        # The project root first, then whatever PYTHONPATH already holds (packages installed with --target, say).
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=pythonpath))
        self.log_path, self.poll_s = log_path, poll_s

    def wait_ready(self) -> float:
        return wait_healthy(self.url, self.proc, self.log_path, START_TIMEOUT_S, self.poll_s)

    def stop(self) -> None:
        stop_server(self.proc, 120)
        self._log.close()


def stop_server(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the server drains and exits 0), then SIGKILL if it is still there after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served_model(base_url: str, api_key: str | None) -> tuple[str, str]:
    """(name to request, model root) from /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    card = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    return card["id"], card.get("root", card["id"])


# --------------------------------------------------------------------------------------------------------------
# Prompts, report, plot
# --------------------------------------------------------------------------------------------------------------


def load_prompts(args: argparse.Namespace) -> list[str]:
    from scripts import data

    if args.prompts_file:
        return [p.prompt for p in data.read_prompt_file(args.prompts_file)]
    _, held = data.split(data.load_sharegpt(args.sharegpt_file))
    prompts = [p.prompt for p in data.filter_prompts(held, max_chars=4 * args.max_prompt_tokens)]
    if not prompts:
        raise SystemExit("no ShareGPT prompt passed the filter")
    return prompts


def hardware() -> str:
    try:
        import torch

        from optimized.cost_model import hardware_name

        return hardware_name("cuda" if torch.cuda.is_available() else "cpu")
    except ImportError:
        return f"CPU {platform.processor() or platform.machine()}"


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    labels = list(dict.fromkeys(r["label"] for r in report["results"]))
    for label in labels:
        rows = sorted((r for r in report["results"] if r["label"] == label), key=lambda r: r["concurrency"])
        ax.plot([r["output_tokens_per_s"] for r in rows], [r["per_user_tokens_per_s"] for r in rows], "o-",
                label=label)
        for r in rows:
            ax.annotate(str(r["concurrency"]), (r["output_tokens_per_s"], r["per_user_tokens_per_s"]),
                        textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("aggregate output tokens/s")
    ax.set_ylabel("per-user tokens/s (1 / TPOT)")
    ax.set_title(f"Serving frontier, {report['model']} on {report['hardware']}\n(points: concurrency)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write(report: dict, out: str | Path | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                prog="python -m scripts.bench_serving", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000 (one mode)")
    where.add_argument("--launch", action="store_true", help="start python -m optimized.serve once per --modes")
    p.add_argument("--modes", default=DEFAULT_MODES, help="with --launch: comma-separated none, fixed:K, dsd, adaptive")
    p.add_argument("--label", default="adaptive", help="with --base-url: the mode the running server serves")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --base-url: the server's process id, for its CPU share (a launched one is known)")
    p.add_argument("--server-args", default="", help="with --launch: extra flags for the server (one string)")
    p.add_argument("--concurrency", default="1,4,16,64,256", help="comma-separated user counts")
    p.add_argument("--prompts-per-user", type=int, default=8,
                   help="measured requests per level = C × this: each user's first and last requests overlap the "
                        "level's ramp-up and drain, so more requests per user measure the steady state")
    p.add_argument("--min-requests", type=int, default=16, help="but at least this many per level")
    p.add_argument("--output-len", type=int, default=128,
                   help="tokens per request (ignore_eos: exactly this many) (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the requests (0: greedy) (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="drop prompts longer than 4× this in characters")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts-file", default=None, help='JSONL, one {"prompt": ...} per line')
    src.add_argument("--sharegpt-file", default=None, help="ShareGPT .json(.gz) (none: the packaged file)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server requires one (default: %(default)s)")
    p.add_argument("--client-processes", type=int, default=max(1, min(8, usable_cores() // 2)),
                   help="client processes sharing the users of a level (default: half the cores, 1 to 8), so that "
                        "the client is not what limits a fast server: on the H200 machine's 16 cores four processes "
                        "were each a whole core busy at 64 and 256 users")
    p.add_argument("--hardware", default=None, help="recorded in the JSON (default: this machine's GPU or CPU)")
    p.add_argument("--drafter", default=None, help="recorded in the JSON (default: from --server-args or shipped)")
    p.add_argument("--log-dir", default="runs/bench_serving", help="with --launch: the servers' logs (not published)")
    p.add_argument("--out", default=None, help="JSON report")
    p.add_argument("--plot", default=None, help="PNG of the frontier")
    return p


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = build_parser().parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [Mode.parse(m) for m in args.modes.split(",")] if args.launch else [Mode.parse(args.label)]
    server_args = shlex.split(args.server_args)
    if args.launch and "--max-num-seqs" not in server_args:
        server_args += ["--max-num-seqs", str(max(levels))]
    prompts = load_prompts(args)
    drafter = args.drafter
    if drafter is None and "--drafter" in server_args:
        drafter = server_args[server_args.index("--drafter") + 1]
    if drafter is None:  # the server's default, or whatever the running server was started with
        drafter = "checkpoints/smollm2-135m-instruct-dspark" if args.launch else "unknown (pass --drafter)"
    report = {"hardware": args.hardware or hardware(), "model": None, "drafter": drafter,
              "command": shlex.join(["python", "-m", "scripts.bench_serving", *(argv if argv is not None
                                                                                  else sys.argv[1:])]),
              "settings": {"output_len": args.output_len, "temperature": args.temperature,
                           "prompts_per_user": args.prompts_per_user, "min_requests": args.min_requests,
                           "client_processes": args.client_processes,
                           "prompts": args.prompts_file or "ShareGPT held-out split, file order",
                           "server_args": server_args if args.launch else None},
              "startup": [], "results": []}
    for mode in modes:
        server = None
        if args.launch:
            log_dir = Path(args.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
            server = LaunchedServer(mode, server_args, log_dir / f"serve-{mode.label.replace(':', '')}.log")
            ready_s = server.wait_ready()
            log.info("%s: server ready in %.1f s", mode.label, ready_s)
            # Command → /health 200 (weights, cost profile, graphs, warm-up). The first launch of a fresh machine
            # is the cold start-up (nothing cached); later launches find the compiled kernels in Triton's cache.
            report["startup"].append({"mode": mode.label, "launch": len(report["startup"]) + 1,
                                      "ready_s": round(ready_s, 2)})
        base_url = server.url if server else args.base_url.rstrip("/")
        try:
            model, root = served_model(base_url, args.api_key)
            report["model"] = report["model"] or root
            for c in levels:
                n = max(c * args.prompts_per_user, args.min_requests)
                closed_loop(base_url, model, prompts, c, c, min(args.output_len, WARMUP_TOKENS), args.temperature,
                            args.api_key, args.client_processes)  # warm-up: one request per user
                before = scrape_counters(base_url, args.api_key)
                pid = getattr(getattr(server, "proc", None), "pid", None) if server else args.server_pid
                server_cpu0 = process_cpu_s(pid)
                results, wall, client_cpu = closed_loop(base_url, model, prompts, c, n, args.output_len,
                                                        args.temperature, args.api_key, args.client_processes)
                cpu = cpu_shares(client_cpu, server_cpu0, process_cpu_s(pid), wall)
                row = summarize(mode, c, results, wall, before, scrape_counters(base_url, args.api_key), cpu)
                if row["errors"]:
                    log.warning("%s C=%d: %d failed requests, e.g. %s", mode.label, c, row["errors"],
                                next(r.error for r in results if not r.ok))
                log.info("%-9s C=%-4d %8.1f tok/s  %7.1f tok/s/user  TTFT p50 %7.1f ms  TPOT p50 %6.1f ms  "
                         "ITL p99 %7.1f ms  τ %.2f  engine busy %s", mode.label, c, row["output_tokens_per_s"],
                         row["per_user_tokens_per_s"], row["ttft_ms_p50"], row["tpot_ms_p50"], row["itl_ms_p99"],
                         row["mean_accepted_length"], _share(row["engine_busy_share"]))
                report["results"].append(row)
                write(report, args.out)
        finally:
            if server is not None:
                server.stop()
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
    raise SystemExit(0)
