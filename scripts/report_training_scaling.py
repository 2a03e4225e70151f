"""Data-parallel training scaling: throughput of ``scripts/train_drafter.py`` runs on 1, 2, 4, 8 GPUs → JSON + plot.

Each run is a ``train_drafter`` output directory (``summary.json`` and ``metrics.jsonl``) of the same training
step (docs/method.md §2) on a different number of ranks. The scaling is weak: every rank takes the same
``--tokens-per-batch`` padded tokens per step, so N ranks train on N times the tokens per step, and ideally in
the same time. Throughput is measured in supervised slot predictions per second (one valid (block, slot) pair
that the loss scores, as in ``scripts/bench_training.py``):

* per run, the median of the per-interval figures that ``train_drafter`` logs every ``--log-every`` steps,
  leaving out the first interval (start-up and warm-up) and any interval that begins with an evaluation or a
  resume-state save; the summary's whole-run figure is kept beside it;
* scaling efficiency ``throughput_N / (N · throughput_1)``: 1 is perfect scaling.

The report refuses a run set that does not measure one workload: a run whose ``world_size`` differs from its
label, per-rank batches, γ or drafter shapes that differ between runs, runs on different hardware, or a set
without the one-rank baseline.

    python -m scripts.report_training_scaling --run 1=runs/scale-1 --run 2=runs/scale-2 --run 4=runs/scale-4 \
        --run 8=runs/scale-8 --out docs/benchmarks/training-scaling

Writes OUT.json (hardware, per-rank tokens per batch, γ, the commands, software versions and
``results: [{gpus, slot_predictions_per_s, per_gpu, efficiency, ...}]``) and OUT.png (throughput against the
number of GPUs with the ideal line, and the efficiency per GPU count).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
from pathlib import Path

import torch

# Arguments that define the work of one training step: runs of one scaling set must agree on every one.
WORKLOAD_ARGS = ("tokens_per_batch", "gamma", "num_layers", "head", "markov_rank", "markov_factored", "max_seq_len")
COMMAND_PREFIX = "python -m scripts.train_drafter"


def interval_throughputs(records: list[dict], log_every: int, eval_every: int, save_every: int) -> list[dict]:
    """The logged intervals that measure training alone, as ``{"steps", "seconds", "slot_predictions_per_s"}``.

    ``records`` are the train records of one invocation, in order. Interval ``(a, b]`` holds steps ``a+1 … b``
    and whatever ran after the log at step ``a``: it is left out when ``a`` is 0 (model and data already loaded,
    but the first steps warm up allocators and kernels) or when an evaluation or a resume-state save ran at
    step ``a``. Its length in seconds comes from the records' ``elapsed_s``, where both ends are logged.
    """
    kept = []
    for prev, rec in zip([None, *records], records):
        a = 0 if prev is None else prev["step"]
        if a == 0 or a % eval_every == 0 or a % save_every == 0:
            continue
        seconds = rec["elapsed_s"] - prev["elapsed_s"] if "elapsed_s" in rec and "elapsed_s" in prev else None
        kept.append({"steps": rec["step"] - a, "seconds": seconds,
                     "slot_predictions_per_s": rec["slot_predictions_per_s"]})
    return kept


def last_invocation(records: list[dict]) -> list[dict]:
    """The train records written by the last ``train_drafter`` invocation into this directory.

    ``metrics.jsonl`` is appended to: a rerun with ``--no-resume`` starts its step count again after the old
    records, so the last invocation starts at the last record whose step is not above its predecessor's. A resumed
    run continues the count and cannot be told apart this way; measure scaling on fresh runs (``--no-resume``
    into an empty directory, as ``scripts/reproduce/training_scaling_h200.sh`` does).
    """
    start = 0
    for i in range(1, len(records)):
        if records[i]["step"] <= records[i - 1]["step"]:
            start = i
    return records[start:]


def load_run(label: str, directory: Path) -> dict:
    """One run: its summary, its train records, and the throughput figures derived from them."""
    try:
        gpus = int(label)
    except ValueError:
        raise SystemExit(f"--run {label}={directory}: the label must be the number of GPUs (1, 2, 4, 8)") from None
    summary_path, metrics_path = directory / "summary.json", directory / "metrics.jsonl"
    for path in (summary_path, metrics_path):
        if not path.is_file():
            raise SystemExit(f"--run {label}={directory}: no {path.name} (not a finished train_drafter output "
                             "directory)")
    summary = json.loads(summary_path.read_text())
    if summary.get("world_size") != gpus:
        raise SystemExit(f"--run {label}={directory}: the run was trained on world_size {summary.get('world_size')} "
                         f"rank(s), not {gpus}; label each run with its number of GPUs")
    args = summary["args"]
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    records = last_invocation([r for r in records if r.get("event") == "train"])
    intervals = interval_throughputs(records, args["log_every"], args["eval_every"], args["save_every"])
    if not intervals:
        raise SystemExit(f"--run {label}={directory}: {len(records)} logged interval(s), none usable after leaving "
                         "out the first one and those after an evaluation or a save; log more often (--log-every) "
                         "than the run evaluates and saves, over more steps")
    per_s = [x["slot_predictions_per_s"] for x in intervals]
    step_s = [x["seconds"] / x["steps"] for x in intervals if x["seconds"] is not None]
    command = summary["command"]
    if gpus > 1 and command.startswith(COMMAND_PREFIX):  # train_drafter records its own argv, not torchrun's
        command = f"torchrun --nproc-per-node {gpus} -m scripts.train_drafter" + command[len(COMMAND_PREFIX):]
    return {
        "gpus": gpus, "directory": str(directory), "summary": summary, "args": args, "command": command,
        "slot_predictions_per_s": statistics.median(per_s),
        "median_step_s": statistics.median(step_s) if step_s else None,
        "intervals": len(intervals), "interval_range": [min(per_s), max(per_s)],
    }


def device_name(hardware: str) -> str:
    """``"8x NVIDIA H200"`` → ``"NVIDIA H200"``: the device, whatever the number of ranks."""
    return re.sub(r"^\d+x ", "", hardware)


def check_one_workload(runs: list[dict]) -> None:
    """Refuse a run set that does not measure one workload (see the module docstring)."""
    labels = [r["gpus"] for r in runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"each GPU count may appear once, got {labels}")
    if 1 not in labels:
        raise SystemExit(f"no one-GPU run (--run 1=DIR): the scaling efficiency is relative to it; got {labels}")
    for key in WORKLOAD_ARGS:
        values = {r["gpus"]: r["args"].get(key) for r in runs}
        if len({json.dumps(v) for v in values.values()}) > 1:
            what = ("per-rank batches differ (--tokens-per-batch): weak scaling compares equal per-rank batches"
                    if key == "tokens_per_batch" else f"--{key.replace('_', '-')} differs")
            raise SystemExit(f"the runs do not train one workload: {what}; by GPU count: {values}")
    devices = {r["gpus"]: device_name(r["summary"]["hardware"]) for r in runs}
    if len(set(devices.values())) > 1:
        raise SystemExit(f"the runs ran on different hardware: {devices}")


def software() -> dict:
    """Versions of the reporting environment (the runs' host, where the report runs right after them)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
        try:
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            versions["nccl"] = None
    return versions


def report(runs: list[dict], note: str, command: str) -> dict:
    runs = sorted(runs, key=lambda r: r["gpus"])
    base = runs[0]["slot_predictions_per_s"]  # the one-GPU run, checked by check_one_workload
    args = runs[0]["args"]
    device = device_name(runs[0]["summary"]["hardware"])
    results = []
    for r in runs:
        n, tput = r["gpus"], r["slot_predictions_per_s"]
        results.append({
            "gpus": n, "slot_predictions_per_s": tput, "per_gpu": tput / n, "efficiency": tput / (n * base),
            "steps": r["summary"]["steps_done"], "median_step_s": r["median_step_s"],
            "intervals": r["intervals"], "interval_range": r["interval_range"],
            "summary_slot_predictions_per_s": r["summary"]["slot_predictions_per_s"],
            "summary_efficiency": r["summary"]["slot_predictions_per_s"] / (
                n * runs[0]["summary"]["slot_predictions_per_s"]),
            "hardware": r["summary"]["hardware"], "command": r["command"],
        })
    return {
        "benchmark": "data-parallel training scaling (weak: fixed per-rank batch), supervised slot predictions per "
                     "second",
        "note": note,
        "hardware": device,
        "backend": "gloo" if device.startswith("CPU") else "nccl",
        "scaling": "weak",
        "tokens_per_batch_per_rank": args["tokens_per_batch"],
        "gamma": args["gamma"],
        "drafter": {k: args.get(k) for k in ("head", "num_layers", "markov_rank", "markov_factored", "max_seq_len")},
        "model": Path(str(args.get("model"))).name,
        "throughput": "median of the per-interval slot predictions per second logged every --log-every steps, "
                      "the first interval and those after an evaluation or a save left out (on N ranks, the "
                      "slots of all ranks); efficiency = throughput_N / (N · throughput_1)",
        "software": software(),
        "commands": [r["command"] for r in runs],
        "command": command,
        "results": results,
    }


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = rep["results"]
    gpus = [r["gpus"] for r in res]
    tput = [r["slot_predictions_per_s"] / 1e3 for r in res]
    base = res[0]["slot_predictions_per_s"] / 1e3
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    ax.plot(gpus, [n * base for n in gpus], ls="--", color="#999", label="ideal (N × one GPU)")
    ax.plot(gpus, tput, marker="o", color="#3949ab", label="measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(n) for n in gpus])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("GPUs (ranks, data parallel, one host)")
    ax.set_ylabel("supervised slot predictions / s (thousands)")
    ax.set_title(f"Training throughput, {rep['tokens_per_batch_per_rank']:,} tokens per rank")
    ax.legend()
    ax = axes[1]
    eff = [r["efficiency"] for r in res]
    bars = ax.bar([str(n) for n in gpus], eff, color="#3949ab")
    ax.bar_label(bars, labels=[f"{e:.0%}" for e in eff])
    ax.axhline(0.85, ls=":", color="#c62828", label="85 %")
    ax.set_ylim(0, max(1.1, max(eff) * 1.1))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("throughput_N / (N · throughput_1)")
    ax.set_title(f"Scaling efficiency, {rep['hardware']}")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True,
                   help="N=DIR: a train_drafter output directory trained on N GPUs (ranks)")
    p.add_argument("--out", required=True, help="output prefix (writes OUT.json and OUT.png)")
    p.add_argument("--note", default="", help="free text recorded in the JSON")
    args = p.parse_args(argv)
    runs = []
    for item in args.run:
        label, sep, directory = item.partition("=")
        if not sep or not directory:
            raise SystemExit(f"--run expects N=DIR, got {item!r}")
        runs.append(load_run(label.strip(), Path(directory)))
    check_one_workload(runs)
    rep = report(runs, args.note,
                 " ".join(["python -m scripts.report_training_scaling", *(sys.argv[1:] if argv is None else argv)]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=2) + "\n")
    plot(rep, out.with_suffix(".png"))
    for r in rep["results"]:
        print(f"{r['gpus']} GPU(s): {r['slot_predictions_per_s']:,.0f} slot predictions/s, "
              f"{r['per_gpu']:,.0f} per GPU, efficiency {r['efficiency']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
