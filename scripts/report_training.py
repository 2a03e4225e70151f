"""Collect the arms of a training comparison into one JSON + plot (the drafter ablation table).

For every run directory (``scripts/train_drafter.py --out``) it reads ``summary.json`` and ``metrics.jsonl``
and reports the held-out teacher-forced metrics of the final evaluation: the loss terms and the per-slot
acceptance proxy ``Σ_v min(p_d, p_t)`` (the expected acceptance probability of slot k when slots before it
carry the ground-truth tokens), plus the expected accepted length implied by that proxy,
``τ ≈ 1 + Σ_k Π_{i≤k} proxy_i`` (exact only if slot acceptances were independent).

    python -m scripts.report_training --run markov=DIR --run rnn=DIR ... --out docs/benchmarks/training
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def implied_tau(proxy: list[float]) -> float:
    tau, survive = 1.0, 1.0
    for p in proxy:
        survive *= p
        tau += survive
    return tau


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="NAME=DIR of a training run")
    p.add_argument("--out", required=True, help="output prefix (writes OUT.json and OUT.png)")
    p.add_argument("--source", default="", help="free text: hardware and command of the runs")
    args = p.parse_args(argv)
    arms, curves = {}, {}
    for item in args.run:
        name, _, d = item.partition("=")
        run = Path(d)
        summary = json.loads((run / "summary.json").read_text())
        final = summary["final_eval"]
        arms[name] = {
            "steps": summary["steps_done"], "wall_s": summary["wall_s"], "hardware": summary["hardware"],
            "command": summary["command"], "parameters": summary["parameters"],
            "heldout_loss": final.get("loss"), "heldout_ce": final.get("ce"), "heldout_l1": final.get("l1"),
            "accept_proxy": final.get("accept_proxy"), "implied_tau": implied_tau(final.get("accept_proxy", [])),
        }
        metrics = run / "metrics.jsonl"
        if metrics.is_file():
            recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            curves[name] = [(r["step"], r["ce"]) for r in recs if r.get("event") == "train" and "ce" in r]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"source": args.source, "arms": arms}, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in curves.items():
        axes[0].plot([s for s, _ in pts], [c for _, c in pts], label=name)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("training CE (weighted, per slot)")
    axes[0].legend()
    axes[0].set_title("Training curves")
    for name, arm in arms.items():
        proxy = arm["accept_proxy"] or []
        axes[1].plot(range(1, len(proxy) + 1), proxy, marker="o", label=f"{name} (τ≈{arm['implied_tau']:.2f})")
    axes[1].set_xlabel("draft slot k")
    axes[1].set_ylabel("held-out Σ min(p_d, p_t)")
    axes[1].legend()
    axes[1].set_title("Teacher-forced acceptance proxy per slot")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(json.dumps({k: (v["steps"], round(v["implied_tau"], 3)) for k, v in arms.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
