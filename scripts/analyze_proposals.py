"""Offline studies of recorded drafter proposals: STS calibration, per-position acceptance, threshold sweep.

Input: the ``proposals-<mode>.safetensors`` files that ``scripts/calibrate.py --dump-proposals DIR`` writes (raw
confidence logits ``z_1..z_γ`` of every held-out proposal and how many of its drafts the target accepted
under full-block verification). Because a verified slot's outcome does not depend on how many later slots
are verified (the random-number contract keys every draw by position), any verify-length policy can be
simulated exactly from these records:

* **STS** (docs/method.md §3): fit on one half of the proposals, ECE before/after per position on the other half,
  temperatures written into the drafter's ``config.json`` with ``--write``.
* **Per-position conditional acceptance** (the paper's Figure 2): P(slot k accepted | slots < k accepted).
* **Static threshold sweep** (the paper's Figure 5): verify slot j while the calibrated prefix survival
  a_j ≥ θ; report τ (accepted + 1 per step) and verified tokens per step for a grid of θ.

    python -m scripts.analyze_proposals --proposals DIR --drafter CKPT [--write] --out docs/benchmarks/calibration
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from reference.calibration import apply_sts, prefix_survival
from reference.cli import LOG_FORMAT
from scripts.calibrate import METHODS, calibrate_mode, conditional_acceptance, plot_reliability, store_calibration
from scripts.proposals import load_proposals

log = logging.getLogger("dspark.analyze_proposals")


def threshold_sweep(conf_logits: torch.Tensor, num_accepted: torch.Tensor, temperatures: list[float],
                    thresholds: list[float], biases: list[float] | None = None,
                    log_weights: list[float] | None = None) -> list[dict]:
    """τ and verified tokens per step of the static-threshold policy, simulated from full-block outcomes."""
    a = prefix_survival(apply_sts(conf_logits.float(), temperatures, biases, log_weights))  # [M, γ]
    rows = []
    for theta in thresholds:
        lens = (a >= theta).sum(dim=1)  # [M] ℓ: a is non-increasing, so the count is the prefix length
        accepted = torch.minimum(num_accepted, lens)
        tau = (accepted + 1).float().mean().item()
        verified = (lens + 1).float().mean().item()  # anchor + ℓ drafts per request and step
        rows.append({"threshold": theta, "mean_verify_length": lens.float().mean().item(),
                     "tau": tau, "verified_tokens_per_step": verified, "tau_per_verified_token": tau / verified})
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                prog="python -m scripts.analyze_proposals", description=__doc__.split("\n")[0])
    p.add_argument("--proposals", required=True, help="directory holding proposals-<mode>.safetensors")
    p.add_argument("--drafter", default=None, help="checkpoint whose config.json receives the temperatures")
    p.add_argument("--write", action="store_true", help="write the fitted STS temperatures into --drafter")
    p.add_argument("--fit-fraction", type=float, default=0.5,
                   help="share of the proposals the calibration is fitted on; the rest measure it (default: "
                         "%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fit/report split (default: %(default)s)")
    p.add_argument("--method", default="sts-bias", choices=list(METHODS),
                   help="calibration fitted (scripts/calibrate.py --method)")
    p.add_argument("--source", default="", help="free text recorded in the JSON (hardware, command of the dump)")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json, OUT-reliability.png, OUT-sweep.png")
    args = p.parse_args(argv)
    if args.write and not args.drafter:
        raise SystemExit("--write needs --drafter")
    results, report = {}, {"source": args.source, "modes": {}}
    for rec in load_proposals(args.proposals):
        mode, gamma = rec["mode"], int(rec["gamma"])
        proposals = {"conf_logits": rec["conf_logits"], "num_accepted": rec["num_accepted"],
                     "sequence": torch.arange(rec["num_accepted"].shape[0])}
        res = calibrate_mode(proposals, gamma, args.fit_fraction, args.seed, args.method)
        res["temperature"] = rec["temperature"]
        results[mode] = res
        sweep = threshold_sweep(rec["conf_logits"], rec["num_accepted"], res["temperatures"],
                                [round(0.05 * i, 2) for i in range(0, 20)], res["biases"], res["log_weights"])
        report["modes"][mode] = {**res, "conditional_acceptance": conditional_acceptance(rec["num_accepted"], gamma),
                                 "threshold_sweep": sweep}
        log.info("%s: %d proposals, τ(full block) = %.3f, T = %s", mode, rec["num_accepted"].shape[0],
                 (rec["num_accepted"].float() + 1).mean().item(), " ".join(f"{t:.3f}" for t in res["temperatures"]))
        if args.write:
            store_calibration(args.drafter, mode, res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot_reliability(results, out.with_name(out.name + "-reliability.png"), "STS reliability (held-out proposals)")
    _plot_sweep(report, out.with_name(out.name + "-sweep.png"))
    log.info("wrote %s", out.with_suffix(".json"))
    return 0


def _plot_sweep(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rec in report["modes"].items():
        sweep = rec["threshold_sweep"]
        th = [r["threshold"] for r in sweep]
        axes[0].plot(th, [r["tau"] for r in sweep], marker="o", label=f"{mode}: τ")
        axes[0].plot(th, [r["verified_tokens_per_step"] for r in sweep], ls="--", label=f"{mode}: verified tokens")
        acc = rec["conditional_acceptance"]
        axes[1].plot(range(1, len(acc) + 1), [x if x is not None else float("nan") for x in acc], marker="o",
                     label=mode)
    axes[0].set_xlabel("static threshold θ on calibrated prefix survival")
    axes[0].set_ylabel("per request and step")
    axes[0].legend()
    axes[0].set_title("Static confidence threshold sweep (Fig. 5)")
    axes[1].set_xlabel("draft slot k")
    axes[1].set_ylabel("P(accept k | 1..k-1 accepted)")
    axes[1].set_ylim(0, 1)
    axes[1].legend()
    axes[1].set_title("Per-position conditional acceptance (Fig. 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
