"""Host planning benchmark: the µs per ``adaptive`` step that the engine spends planning on the host, on the CPU.

The engine times its host planning in ``Engine.step`` (``stats["host_schedule_s"]``): ``Scheduler.schedule`` (admission,
prefill chunks and the verify budget B of the stale survivals, ``BudgetPlanner.budget``) plus ``Scheduler.drafters``
(the draft gate: the moving average of each request's survivals, then ``speculation_pays``). On a GPU that is time the
device may wait for, so it should stay a small share of a step. With ``--plan-ahead`` (``EngineConfig.plan_ahead``, the
engine's default on CUDA) the gate's verdict and the next budget are planned while the device verifies: ``host_us``
then counts what is left on the critical path and ``ahead_us`` what moved off it (``stats["host_ahead_s"]``; on the
CPU the forward has already run by then, so there it is moved, not hidden). This script measures it with the tiny
random models of ``reference.testing`` on the CPU, at R = 1, 4, 16, 64, 256 decoding requests (one engine per R,
``max_num_seqs = R``), and, for a same-run baseline, the reference twins on the very same survivals:

* engine: ``--repeats`` runs per R; each admits R fresh requests, runs ``--warmup`` untimed steps (so that every
  request has its stale survivals), then ``--steps`` timed steps; the run's µs per step is ``host_schedule_s /
  steps``. The median over the runs is reported, with the smallest and largest.
* reference: for each of the same steps, ``reference.scheduler.stale_budget`` on the stale survivals the engine's
  schedule read (stacked with ``torch.stack``, as ``reference.generate`` does) and the reference gate
  (``reference.scheduler.fold_recent`` of each request's new drafts, then ``Scheduler.should_draft``) on the survivals
  the engine's gate read, replayed after the run (so that the reference's torch work between the steps does not
  disturb the engine's timing; the replay runs back to back, without the model's forwards in between, which favours
  the reference). The median over the runs of their µs per step is reported. Their answers are compared with the
  engine's: ``agree`` counts the steps whose budget and gate verdict equal the reference's (every one, or the engine
  is wrong).

The cost table is synthetic (``CostTable.affine``, every size 1..``--max-tokens``) with a drafter cheap enough that the
gate stays open, so every timed step plans a budget and evaluates the gate: the adaptive step's full host work
(``--draft-ms 50`` prices the drafter out: the gate stays closed, the adaptive engine's plain steps). Every row also
has ``commit_us``, the host's commit of the read tokens per step (``stats["host_commit_s"]``), and with
``--plain-baseline`` the same numbers of plain decoding (no drafter) at that R, measured in the same run; with
``--async-decode`` both run one step ahead of their reads, as on CUDA (the reference twins replay the synchronous
engine, so they are skipped then). Times on a loaded machine are noisy: compare numbers from one run, or runs on the
same idle machine. JSON goes to ``docs/benchmarks/host-<tag>.json`` (``--out`` elsewhere) with one PNG next to it
when matplotlib is installed.

    python -m scripts.bench_host --out /tmp/host-cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from optimized.engine import Engine, EngineConfig, SamplingParams
from reference.cli import LOG_FORMAT
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.scheduler import Scheduler as Policy
from reference.scheduler import fold_recent, stale_budget
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts.benchmarking import save_plot

log = logging.getLogger("dspark.bench_host")

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 8


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class ReferenceTwin:
    """The reference's host planning, replayed on the survivals the engine planned from, timed.

    While the engine runs, each step leaves a light snapshot: the decoding requests and how many drafts each held
    when the engine's schedule and gate read them (``Sequence.survivals`` only grows, so the rows stay reachable).
    Afterwards :meth:`budget` and :meth:`gate` rebuild the very inputs from those snapshots, in step order, and time
    the reference on them: ``stale_budget`` (after stacking the stale rows as ``reference.generate`` does), then
    ``fold_recent`` of each request's new drafts and ``Scheduler.should_draft``. Replaying after the run keeps the
    reference's torch work from disturbing the engine's timing.
    """

    def __init__(self, engine: Engine, cost: CostTable) -> None:
        self.cost, self.gamma = cost, engine.gamma
        self.staleness, self.window = engine.sched_config.staleness, engine.sched_config.gate_window
        self.policy = Policy(engine.sched_config, gamma=engine.gamma, cost=cost)
        self.recent: dict[int, tuple[torch.Tensor, int]] = {}  # request id -> (moving average [γ], drafts folded)
        self.steps_without_draft = 0

    def budget(self, snapshot: list[tuple[Any, int]]) -> tuple[int, float]:
        """The reference budget of the requests ``snapshot`` (request, drafts held) and the seconds it took."""
        k, nan = self.staleness, torch.full((self.gamma,), float("nan"))
        rows = [torch.as_tensor(s.survivals[n - k - 1]) if n > k else nan for s, n in snapshot]  # untimed
        t = time.perf_counter()
        budget = stale_budget(torch.stack(rows), self.cost, len(snapshot), len(snapshot))  # [R, γ] stale
        return budget, time.perf_counter() - t

    def gate(self, snapshot: list[tuple[Any, int]], drafted: bool) -> tuple[bool, float]:
        """The reference gate's verdict for the requests ``snapshot`` and the seconds it took (fold included)."""
        new = {s.request_id: [torch.as_tensor(a) for a in s.survivals[self.recent.get(s.request_id, (None, 0))[1]:n]]
               for s, n in snapshot}  # the drafts each request's average has not folded yet, untimed
        t = time.perf_counter()
        for s, _ in snapshot:
            acc, n = self.recent.get(s.request_id, (torch.full((self.gamma,), float("nan")), 0))
            for a in new[s.request_id]:
                acc = fold_recent(acc, a, self.window)
            self.recent[s.request_id] = (acc, n + len(new[s.request_id]))
        latest = None
        if any(self.recent[s.request_id][1] for s, _ in snapshot):
            latest = torch.stack([self.recent[s.request_id][0] for s, _ in snapshot])  # [R, γ]
        verdict = self.policy.should_draft(latest, self.steps_without_draft, num_anchor_tokens=len(snapshot))
        seconds = time.perf_counter() - t
        self.steps_without_draft = 0 if drafted else self.steps_without_draft + 1
        return verdict, seconds


def measure(target: Target, drafter, r: int, args: argparse.Namespace) -> dict[str, Any]:
    """One engine at ``max_num_seqs = r``; ``args.repeats`` runs of ``args.steps`` timed steps each."""
    cost = CostTable.affine(fixed_ms=args.fixed_ms, per_token_ms=args.per_token_ms, draft_fixed_ms=args.draft_ms,
                            sizes=list(range(1, args.max_tokens + 1)))
    max_seq_len = PROMPT_LEN + (args.warmup + args.steps + 2) * (args.gamma + 1) + args.gamma + 2
    engine = Engine(target, drafter, EngineConfig(max_num_seqs=r, max_seq_len=max_seq_len, kernel_backend="torch",
                                                  seed=0, plan_ahead=args.plan_ahead, async_decode=args.async_decode),
                    SchedulerConfig(mode="adaptive"), cost)
    params = SamplingParams(max_new_tokens=max_seq_len, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(r)
    host_us, ahead_us, step_us, commit_us, ref_us, drafted, agree, steps = [], [], [], [], [], 0, 0, 0
    for _ in range(args.repeats):
        rids = [engine.add_request(torch.randint(2, target.vocab_size, (PROMPT_LEN,), generator=gen).tolist(), params)
                for _ in range(r)]
        sched, history = engine.scheduler, []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                engine.reset_stats()
            plans = sched.drafted and bool(sched.decoding())  # whether this step plans a budget
            before = [(s, len(s.survivals)) for s in sched.decoding()]  # what the schedule reads
            engine.step()
            st = engine.last_step_stats()
            after = [(s, len(s.survivals) - st.drafted) for s in sched.decoding()]  # what the gate read
            history.append((plans, before, after, st))
        stats = engine.stats
        host_us.append(1e6 * stats["host_schedule_s"] / stats["steps"])
        ahead_us.append(1e6 * stats["host_ahead_s"] / stats["steps"])
        step_us.append(1e6 * stats["step_s"] / stats["steps"])
        commit_us.append(1e6 * stats["host_commit_s"] / stats["steps"])
        drafted += stats["draft_steps"]
        if args.async_decode:  # the twins replay the synchronous engine's inputs: nothing to compare one step ahead
            steps += args.steps
            for rid in rids:
                engine.abort(rid)
                engine.release(rid)
            continue
        twin, ref_s = ReferenceTwin(engine, cost), 0.0
        for i, (plans, before, after, st) in enumerate(history):
            budget, budget_s = twin.budget(before) if plans else (None, 0.0)
            verdict, gate_s = twin.gate(after, st.drafted) if after else (st.drafted, 0.0)
            if i >= args.warmup:
                steps += 1
                ref_s += budget_s + gate_s
                agree += budget == st.budget and verdict == st.drafted
        ref_us.append(1e6 * ref_s / args.steps)
        for rid in rids:
            engine.abort(rid)
            engine.release(rid)
    if ref_us and agree != steps:
        log.warning("R=%d: the engine's decisions differ from the reference's at %d of %d steps", r, steps - agree,
                     steps)
    host = statistics.median(host_us)
    ref = statistics.median(ref_us) if ref_us else None
    return {"R": r, "host_us": round(host, 1), "host_us_min": round(min(host_us), 1),
            "host_us_max": round(max(host_us), 1), "ahead_us": round(statistics.median(ahead_us), 1),
            "reference_us": None if ref is None else round(ref, 1),
            "speedup_vs_reference": None if ref is None else round(ref / host, 2),
            "step_us": round(statistics.median(step_us), 1),
            "host_share_pct": round(100 * host / statistics.median(step_us), 2),
            "commit_us": round(statistics.median(commit_us), 1),
            "drafted_steps": drafted, "steps": steps, "agree": agree if ref_us else None,
            "runs_host_us": [round(x, 1) for x in host_us]}


def measure_plain(target: Target, r: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same-run baseline at ``max_num_seqs = r``: plain decoding (no drafter), as many runs and steps; its host
    planning (``host_us``) and commit (``commit_us``) per step."""
    max_seq_len = PROMPT_LEN + (args.warmup + args.steps + 2) * (args.gamma + 1) + args.gamma + 2
    engine = Engine(target, None, EngineConfig(max_num_seqs=r, max_seq_len=max_seq_len, kernel_backend="torch",
                                               seed=0, async_decode=args.async_decode), SchedulerConfig(mode="none"))
    params = SamplingParams(max_new_tokens=max_seq_len, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(r)
    host_us, commit_us, step_us = [], [], []
    for _ in range(args.repeats):
        rids = [engine.add_request(torch.randint(2, target.vocab_size, (PROMPT_LEN,), generator=gen).tolist(), params)
                for _ in range(r)]
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                engine.reset_stats()
            engine.step()
        stats = engine.stats
        host_us.append(1e6 * stats["host_schedule_s"] / stats["steps"])
        commit_us.append(1e6 * stats["host_commit_s"] / stats["steps"])
        step_us.append(1e6 * stats["step_s"] / stats["steps"])
        for rid in rids:
            engine.abort(rid)
            engine.release(rid)
    return {"host_us": round(statistics.median(host_us), 1), "commit_us": round(statistics.median(commit_us), 1),
            "step_us": round(statistics.median(step_us), 1)}


def run(args: argparse.Namespace, out: Path, command: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    drafter = tiny_drafter(target, gamma=args.gamma, noise=0.2)
    report: dict[str, Any] = {
        "hardware": f"CPU {cpu_name()} ({torch.get_num_threads()} threads)",
        "command": command,
        "software": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "settings": {"gamma": args.gamma, "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps,
                     "model": "reference.testing tiny llama (2 layers)", "mode": "adaptive (gate on)",
                     "plan_ahead": args.plan_ahead, "async_decode": args.async_decode,
                     "plain_baseline": args.plain_baseline,
                     "cost": {"fixed_ms": args.fixed_ms, "per_token_ms": args.per_token_ms,
                              "draft_fixed_ms": args.draft_ms, "sizes": f"1..{args.max_tokens}"}},
        "results": [],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in args.batches:
        row = measure(target, drafter, r, args)
        if args.plain_baseline:
            row["plain"] = measure_plain(target, r, args)
        report["results"].append(row)
        twin = ("" if row["reference_us"] is None else
                f"  reference {row['reference_us']:7.1f} µs  ×{row['speedup_vs_reference']:.1f}  agree "
                f"{row['agree']}/{row['steps']}")
        plain = "" if "plain" not in row else (f"  | plain: host {row['plain']['host_us']:.1f}, commit "
                                               f"{row['plain']['commit_us']:.1f} µs")
        log.info("R=%4d  host %7.1f µs/step (%5.1f .. %5.1f)  ahead %7.1f µs  commit %7.1f µs%s%s", r, row["host_us"],
                 row["host_us_min"], row["host_us_max"], row["ahead_us"], row["commit_us"], twin, plain)
        out.write_text(json.dumps(report, indent=2) + "\n")
    save_plot(plot, report, out.with_suffix(".png"), log)
    log.info("wrote %s", out)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """Host µs per adaptive step against R: the engine's planning (median, min..max band) and commit, the reference
    twins, and plain decoding's when measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    rs = [row["R"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(rs, [row["host_us"] for row in rows], marker="o", label="engine: schedule + gate")
    ax.fill_between(rs, [row["host_us_min"] for row in rows], [row["host_us_max"] for row in rows], alpha=0.2)
    if all(row["reference_us"] is not None for row in rows):
        ax.plot(rs, [row["reference_us"] for row in rows], marker="s", linestyle="--",
                label="reference twins (stale_budget + should_draft)")
    ax.plot(rs, [row["commit_us"] for row in rows], marker="^", label="engine: commit of the read tokens")
    if all("plain" in row for row in rows):
        ax.plot(rs, [row["plain"]["host_us"] for row in rows], marker="o", linestyle=":", color="gray",
                label="plain decoding (schedule)")
        ax.plot(rs, [row["plain"]["commit_us"] for row in rows], marker="^", linestyle=":", color="gray",
                label="plain decoding (commit)")
    ax.set(xscale="log", yscale="log", xlabel="decoding requests R", ylabel="µs per adaptive step",
           title=f"Host planning on {report['hardware']}")
    ax.set_xticks(rs, [str(r) for r in rs])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                prog="python -m scripts.bench_host", description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,4,16,64,256", help="comma list of R")
    p.add_argument("--gamma", type=int, default=7, help="the tiny drafter's block size γ")
    p.add_argument("--repeats", type=int, default=7, help="runs per R (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per run (prefill, first drafts)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--fixed-ms", type=float, default=2.0, help="synthetic cost table: verify ms at 0 tokens")
    p.add_argument("--per-token-ms", type=float, default=0.002, help="synthetic cost table: verify ms per token")
    p.add_argument("--draft-ms", type=float, default=0.5, help="synthetic cost table: drafter ms per step")
    p.add_argument("--max-tokens", type=int, default=2048, help="synthetic cost table: sizes 1..max")
    p.add_argument("--plan-ahead", action=argparse.BooleanOptionalAction, default=False,
                   help="EngineConfig.plan_ahead: plan while the device verifies (the engine's default on CUDA); "
                        "host_us then counts the critical path only and ahead_us what moved off it (on the CPU the "
                        "forward has run by then, so it is moved, not hidden)")
    p.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=False,
                   help="EngineConfig.async_decode: each step launched before the previous one's tokens are read (the "
                        "engine's default on CUDA), the loop whose host work a GPU step waits for at large R")
    p.add_argument("--plain-baseline", action="store_true",
                   help="also run plain decoding (no drafter) at each R: its host planning and commit per step "
                        "(rows' 'plain'), the baseline an adaptive step's host work is compared with")
    p.add_argument("--tag", default="cpu", help="output name host-<tag>.json")
    p.add_argument("--out", default=None,
                   help="the JSON path (default: docs/benchmarks/host-<tag>.json, with a PNG beside it)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.repeats < 1 or args.steps < 1 or args.warmup < 3:
        raise SystemExit("--repeats and --steps must be ≥ 1, --warmup ≥ 3 (the stale survivals need drafts)")
    if max(args.batches) * (args.gamma + 1) > args.max_tokens:
        raise SystemExit(f"--max-tokens must cover R·(γ+1) = {max(args.batches) * (args.gamma + 1)} tokens")
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"host-{args.tag}.json"
    command = "python -m scripts.bench_host " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:]))
    return run(args, out, command)


if __name__ == "__main__":
    main()
    raise SystemExit(0)
