"""Merge ``scripts/eval_acceptance.py`` outputs of several arms and temperatures into one JSON + plot.

    python -m scripts.report_acceptance --eval dspark:0=a.json --eval dspark:1=b.json ... \
        --out docs/benchmarks/acceptance

Writes OUT.json (per arm and temperature: τ, τ per domain, per-position conditional acceptance, counts,
hardware, command) and OUT.png (per-position acceptance: the paper's Figure 2). ``--merge OLD.json`` starts from
the runs of an earlier report (its note too, unless ``--note`` is given) and adds or replaces the ``--eval`` ones,
so one new arm does not mean re-measuring the others:

    python -m scripts.report_acceptance --merge docs/benchmarks/acceptance.json --eval "ngram:0=ngram.json" \
        --out docs/benchmarks/acceptance
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    p.add_argument("--eval", action="append", required=True, help="ARM:TEMPERATURE=FILE.json")
    p.add_argument("--out", required=True, help="output prefix")
    p.add_argument("--note", default=None, help="free text recorded in the JSON")
    p.add_argument("--merge", default=None, help="an earlier report whose runs are kept unless --eval replaces them")
    args = p.parse_args(argv)
    runs, note = {}, ""
    if args.merge:
        old = json.loads(Path(args.merge).read_text())
        if not isinstance(old.get("runs"), dict):
            raise SystemExit(f"{args.merge}: not a report of this script (no 'runs' object)")
        runs, note = old["runs"], old.get("note", "")
    note = note if args.note is None else args.note
    for item in args.eval:
        key, _, path = item.partition("=")
        arm, _, temp = key.rpartition(":")
        if not arm or not temp or not path:
            raise SystemExit(f"--eval expects ARM:TEMPERATURE=FILE.json, got {item!r}")
        r = json.loads(Path(path).read_text())
        runs.setdefault(arm, {})[f"T={temp}"] = {
            k: r[k] for k in ("mean_accepted_length", "mean_accepted_length_se", "per_domain",
                              "per_position_acceptance", "per_position_counts", "counts", "settings", "hardware",
                              "command", "wall_s") if k in r}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"note": note, "runs": runs}, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({t for arm in runs.values() for t in arm})
    # One colour per arm across the panels and one legend below them (arm names are long): "arm (τ T=0 / T=1)".
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4.2 + 0.25 * len(runs)), squeeze=False)
    handles = []
    for i, (arm, per_t) in enumerate(runs.items()):
        style = {"color": colours[i % len(colours)], "marker": "os^Dv<>"[i // len(colours) % 7]}
        lines = []
        for ax, t in zip(axes[0], temps):
            if t in per_t:
                acc = [x if x is not None else float("nan") for x in per_t[t]["per_position_acceptance"]]
                lines += ax.plot(range(1, len(acc) + 1), acc, **style)
        if lines:  # one legend entry per arm, whichever panels it appears in
            taus = ", ".join(f"{t}: {per_t[t]['mean_accepted_length']:.3f}" for t in temps if t in per_t)
            lines[0].set_label(f"{arm} (τ at {taus})")
            handles.append(lines[0])
    for ax, t in zip(axes[0], temps):
        ax.set_title(f"P(slot k accepted | slots < k accepted), {t}")
        ax.set_xlabel("draft slot k")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * len(runs) / 2 + 0.02, 1, 1))
    fig.savefig(out.with_suffix(".png"), dpi=120)
    for arm, per_t in runs.items():
        print(arm, {t: round(v["mean_accepted_length"], 3) for t, v in per_t.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
