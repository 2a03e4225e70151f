"""Compare calibration methods on recorded proposals: the paper's STS (temperature per slot, ECE grid search), STS
with a per-slot bias and beta calibration (both log-loss fits), by held-out ECE per slot averaged over random half
splits.

Reads ``proposals-<mode>.safetensors`` files written by ``scripts/calibrate.py --dump-proposals`` (raw confidence
logits and full-block outcomes, ``scripts/proposals.py``), so it runs on a CPU in seconds; the noise floor (what a
perfectly calibrated predictor would measure on the same held-out half, ``reference.calibration.ece_noise_floor``) is
reported alongside.

    python -m scripts.compare_calibration --proposals docs/benchmarks/data/dspark \\
        docs/benchmarks/data/markov-620steps --out docs/benchmarks/calibration-methods.json

``--calibration DRAFTER_DIR`` also scores a calibration already stored in a checkpoint (no refit) on the same held-out
halves (``stored``): for example a calibration fitted on other proposals, measured on these.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

import torch

from reference.calibration import (
    biases_for,
    calibration_report,
    fit_sts,
    fit_sts_beta,
    fit_sts_bias,
    log_weights_for,
    prefix_survival_labels,
    temperatures_for,
)
from reference.checkpoint import read_drafter_config
from reference.cli import LOG_FORMAT
from scripts.proposals import load_proposals

log = logging.getLogger("dspark.compare_calibration")


def compare(conf_logits: torch.Tensor, num_accepted: torch.Tensor, gamma: int, splits: int,
            stored: tuple[list[float], list[float] | None, list[float] | None] | None = None) -> dict:
    """Mean held-out ECE per slot (and its noise floor) of each method over ``splits`` random half splits; with
    ``stored`` (temperatures, biases, log weights), also that calibration's, unfitted, on the same halves."""
    m = conf_logits.shape[0]
    labels = prefix_survival_labels(num_accepted, torch.full((m,), gamma), gamma)  # all γ verified: no censoring
    rows: dict[str, list[list[float]]] = {"before": [], "sts": [], "sts-bias": [], "beta": [], "floor_median": [],
                                          "floor_p95": []}
    if stored is not None:
        rows["stored"] = []
    for s in range(splits):
        perm = torch.randperm(m, generator=torch.Generator().manual_seed(s))
        fit, held = perm[: m // 2], perm[m // 2:]
        sts = calibration_report(conf_logits[held], labels[held], fit_sts(conf_logits[fit], labels[fit]))
        temps, biases = fit_sts_bias(conf_logits[fit], labels[fit])
        biased = calibration_report(conf_logits[held], labels[held], temps, biases=biases)
        temps, biases, weights = fit_sts_beta(conf_logits[fit], labels[fit])
        beta = calibration_report(conf_logits[held], labels[held], temps, biases=biases, log_weights=weights)
        rows["before"].append([p["ece_before"] for p in sts["positions"]])
        rows["sts"].append([p["ece_after"] for p in sts["positions"]])
        rows["sts-bias"].append([p["ece_after"] for p in biased["positions"]])
        rows["beta"].append([p["ece_after"] for p in beta["positions"]])
        rows["floor_median"].append([p["ece_floor_median"] for p in biased["positions"]])
        rows["floor_p95"].append([p["ece_floor_p95"] for p in biased["positions"]])
        if stored is not None:
            fixed = calibration_report(conf_logits[held], labels[held], stored[0], biases=stored[1],
                                       log_weights=stored[2])
            rows["stored"].append([p["ece_after"] for p in fixed["positions"]])
    return {key: [round(x, 5) for x in torch.tensor(v).mean(dim=0).tolist()] for key, v in rows.items()}


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                prog="python -m scripts.compare_calibration", description=__doc__.split("\n")[0])
    p.add_argument("--proposals", nargs="+", required=True, help="directories holding proposals-<mode>.safetensors")
    p.add_argument("--splits", type=int, default=10, help="random half splits averaged")
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--calibration", default=None,
                   help="a drafter checkpoint directory whose stored calibration is also scored (no refit)")
    args = p.parse_args(argv)
    config = read_drafter_config(args.calibration) if args.calibration else None
    logging.getLogger("reference.calibration").setLevel(logging.ERROR)  # per-slot "too few" notes, every split
    args_used = argv if argv is not None else sys.argv[1:]
    report = {"command": "python -m scripts.compare_calibration " + shlex.join(args_used),
              "splits": args.splits, "metric": "held-out ECE of the prefix survival per slot (20 bins), mean over "
              "splits; floor = what a perfectly calibrated predictor would measure on the same half", "sets": {}}
    for directory in args.proposals:
        for rec in load_proposals(directory):
            mode = rec["mode"]
            stored = None if config is None else (temperatures_for(config, mode), biases_for(config, mode),
                                                  log_weights_for(config, mode))
            result = compare(rec["conf_logits"], rec["num_accepted"], int(rec["gamma"]), args.splits, stored)
            result["num_proposals"] = int(rec["conf_logits"].shape[0])
            report["sets"][f"{Path(directory).name}/{rec['mode']}"] = result
            log.info("%s %s (%d proposals): STS %s | STS+bias %s | beta %s | floor p95 %s", Path(directory).name,
                     rec["mode"], result["num_proposals"], *(" ".join(f"{100 * x:.1f}" for x in result[k])
                                                             for k in ("sts", "sts-bias", "beta", "floor_p95")))
            if stored is not None:
                log.info("  the calibration stored in %s: %s", args.calibration,
                         " ".join(f"{100 * x:.1f}" for x in result["stored"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", out)
    return report


if __name__ == "__main__":
    main()
