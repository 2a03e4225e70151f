"""Where a step's device time goes, before and after a change: ``scripts/profile_engine.py`` reports side by side.

``profile_engine`` writes one JSON per configuration (mode × batch size) with the step's wall time, its device time
and the kernels that took it. This script reads two sets of such reports — ``--before`` and ``--after``, files or
folders, paired by mode and batch size — sorts every kernel into the components of a speculative step, and writes
one compact JSON (per configuration and side: wall and device ms per step, ms per component, kernel launches and
graph replays) with a bar chart of the components.

Components (by kernel name; the reports list each configuration's top kernels by device time, the rest is "other"):

==============  ==========================================================================================
projections     the target's and the drafter's matrix products (cuBLAS ``nvjet*``/``gemm``, the fused
                small-batch ``_norm_linear``/``_linear`` kernels)
attention       ``_varlen_attention``
layer ops       RMSNorm, RoPE + KV append, SiLU·up
draft head      the Markov head's sampling kernels (``_sample_draft_block``, ``_draft_split_*``)
verify          the verify layout, greedy verification, rejection sampling, the top-B allocation, argmax
copies          indexing, gathers, scatters and dtype copies (``aten::index``, ``index_put``, elementwise copies)
other           everything else, and kernels below the reports' top list
==============  ==========================================================================================

Usage::

    python -m scripts.report_step_cost --before base/ --after new/ --out docs/benchmarks/step-cost-h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from scripts.benchmarking import save_plot

log = logging.getLogger("dspark.report_step_cost")

# (component, substrings of kernel names that belong to it), first match wins
COMPONENTS: list[tuple[str, tuple[str, ...]]] = [
    ("draft head", ("_sample_draft_block", "_draft_split")),
    ("attention", ("_varlen_attention",)),
    ("layer ops", ("_rms_norm", "_rope_append", "_silu_mul")),
    ("projections", ("nvjet", "gemm", "_norm_linear", "_linear_kernel", "cutlass")),
    ("verify", ("_verify_layout", "_greedy", "_rejection_sample", "_allocate", "argmax", "ArgMax")),
    ("copies", ("aten::index", "index_put", "index_elementwise", "indexSelect", "gather", "scatter", "copy",
                "elementwise")),
]
ORDER = [name for name, _ in COMPONENTS] + ["other"]


def component(kernel: str) -> str:
    """The component a kernel (or operator) name belongs to."""
    for name, keys in COMPONENTS:
        if any(k in kernel for k in keys):
            return name
    return "other"


def breakdown(report: dict[str, Any]) -> dict[str, Any]:
    """One profile report -> wall and device ms per step, ms per component, launches and graph replays.

    The reports list operators and the kernels they launched alike (an ``aten::index`` and its CUDA kernel both carry
    device time), so only names that are kernels are counted: those that do not start with ``aten::`` unless no
    kernel of theirs is listed (a listed operator then stands for its kernels)."""
    prof = report["profile"]
    top = prof["top_by_device_time"]
    kernels = [t for t in top if not t["name"].startswith("aten::")]
    parts = dict.fromkeys(ORDER, 0.0)
    for t in kernels:
        parts[component(t["name"])] += t["self_device_ms_per_step"]
    device = prof["device_ms_per_step"]
    # device time counts every event with device time: operators and their kernels twice. The kernels alone:
    kernel_ms = sum(t["self_device_ms_per_step"] for t in kernels)
    ops_ms = sum(t["self_device_ms_per_step"] for t in top if t["name"].startswith("aten::"))
    parts["other"] += max(device - ops_ms - kernel_ms, 0.0)
    return {
        "command": report.get("command"),
        "step_ms": round(report["step_ms_median"], 4),
        "device_ms": round(device - ops_ms, 4),
        "mean_accepted_length": round(report.get("mean_accepted_length", 0.0), 3),
        "kernel_launches": prof["kernel_launches_per_step"],
        "graph_launches": prof["graph_launches_per_step"],
        "components_ms": {k: round(v, 4) for k, v in parts.items()},
    }


def key_of(report: dict[str, Any]) -> tuple[str, int]:
    s = report["settings"]
    return str(s["mode"]), int(s["batch_size"])


def load(paths: list[str]) -> dict[tuple[str, int], dict[str, Any]]:
    """Every profile report under ``paths`` (files or folders), keyed by (mode, batch size)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    out = {}
    for f in files:
        data = json.loads(f.read_text())
        if "profile" in data and "settings" in data:
            out[key_of(data)] = data
    if not out:
        raise SystemExit(f"no profile_engine reports under {paths}")
    return out


def build(before: dict, after: dict, command: str) -> dict[str, Any]:
    keys = sorted(set(before) | set(after), key=lambda k: (k[0] != "none", k[0], k[1]))
    rows = []
    for mode, b in keys:
        row: dict[str, Any] = {"mode": mode, "batch_size": b}
        for side, reports in (("before", before), ("after", after)):
            if (mode, b) in reports:
                row[side] = breakdown(reports[(mode, b)])
                row[side]["settings"] = reports[(mode, b)]["settings"]
        rows.append(row)
    hardware = next(iter(after.values() or before.values())).get("hardware")
    return {"hardware": hardware, "command": command, "components": ORDER, "results": rows}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if "before" in r or "after" in r]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 4.5))
    colors = plt.get_cmap("tab10")
    labels, x = [], 0.0
    for r in rows:
        for side in ("before", "after"):
            if side not in r:
                continue
            bottom = 0.0
            for i, name in enumerate(ORDER):
                ms = r[side]["components_ms"][name]
                ax.bar(x, ms, bottom=bottom, width=0.8, color=colors(i), label=name if not labels else None)
                bottom += ms
            ax.plot([x - 0.4, x + 0.4], [r[side]["step_ms"]] * 2, color="black", lw=1.5)
            labels.append((x, f"{r['mode']}\nB={r['batch_size']}\n{side}"))
            x += 1.0
        x += 0.6
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylabel("ms per step (bars: device time by component; line: wall time)")
    ax.set_title(f"Where a step's time goes, before and after ({report['hardware']})")
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--before", nargs="+", required=True, help="profile_engine JSON files or folders (the baseline)")
    p.add_argument("--after", nargs="+", required=True, help="profile_engine JSON files or folders (the change)")
    p.add_argument("--out", required=True, help="JSON path; the plot goes next to it as .png")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    command = "python -m scripts.report_step_cost " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    report = build(load(args.before), load(args.after), command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    save_plot(plot, report, out.with_suffix(".png"), log)
    for r in report["results"]:
        sides = "  ".join(f"{s} {r[s]['step_ms']:.2f}/{r[s]['device_ms']:.2f} ms" for s in ("before", "after")
                          if s in r)
        log.info("%-9s B=%-4d %s", r["mode"], r["batch_size"], sides)
    return report


if __name__ == "__main__":
    main()
