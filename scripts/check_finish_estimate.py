"""How well the finish-time estimate predicts a closed batch: its expected drafting steps against the steps taken.

``reference.scheduler.finish_estimate`` (the finish-time gate of an offline batch, ``EngineConfig.finish_time_gate``)
models each request's steps to finish from its survivals. This script checks the model where it matters, the number of
steps a closed batch of B requests takes while drafting every step: it runs the adaptive mode with the draft gate off
(every step drafts, at the planned budget) on B prompts at a time, and after the requests' 1st, 4th and 8th draft asks
the estimate for the expected steps still to go. Steps do not depend on the hardware (the tokens do not depend on the
schedule either), so the default is the CPU in float32; the prices are a synthetic table, which only the budget, not the
step count, reads. Three estimates at each checkpoint: from the survivals the finish-time gate reads
(``expected_steps_means``: each request's mean over all its drafts, pooled towards the batch's,
``reference.scheduler.finish_survivals``), from the same means times each request's factor between the drafts it had
accepted and those forecast (``expected_steps``: ``reference.scheduler.outcome_factors``, which the gate applies only
with ``DraftGate.outcomes`` on), and from the draft gate's moving averages of the last few drafts
(``expected_steps_recent``).

Writes one JSON: per batch size and prompt group, the steps the batch took, both estimates after each checkpoint and
their ratios to the steps that were left (``expected_over_taken``, ``recent_over_taken``), the τ the survivals forecast
then (whole blocks verified) against the τ the batch reached, and the mean and largest verify steps of a request (the
mean is set by τ, the largest is the batch's tail).

Example::

    python -m scripts.check_finish_estimate --batch-sizes 16,64 --groups 2 --out finish-estimate-cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from optimized.engine import Engine, EngineConfig, SamplingParams
from reference.cli import LOG_FORMAT
from reference.config import SchedulerConfig
from reference.cost_model import CostTable, hardware_name
from reference.drafter import DSparkDrafter
from reference.target import Target
from scripts.benchmarking import add_drafted_decode_args, load_drafted_models, load_prompts

log = logging.getLogger("dspark.check_finish_estimate")

CHECKPOINTS = (1, 4, 8)  # after each request's n-th draft


def check_batch(target: Target, drafter: DSparkDrafter, prompts: list[list[int]], max_new_tokens: int,
                device: str, dtype: torch.dtype) -> dict:
    """One closed batch, drafting every step: the steps it took and the estimate at each checkpoint."""
    r = len(prompts)
    table = CostTable.affine(fixed_ms=1.0, per_token_ms=0.002, draft_fixed_ms=0.5, draft_per_request_ms=0.004,
                             sizes=list(range(1, r * (drafter.config.block_size + 1) + 1)),
                             request_counts=range(1, r + 1))
    longest = max(len(p) for p in prompts)
    engine = Engine(target, drafter, EngineConfig(max_num_seqs=r, max_seq_len=longest + max_new_tokens + 32,
                                                  device=device, dtype=dtype, seed=0, async_decode=False),
                    SchedulerConfig(mode="adaptive", draft_gate=False), table)
    engine.scheduler.gate.track = True  # keep every draft's statistics, as the finish-time gate does
    engine.scheduler.gate.outcomes = True  # and each request's outcomes, for the estimate with their factors
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), request_id=i)
    steps, estimates = 0, {}
    while engine.has_unfinished():
        engine.step()
        steps += 1
        seqs = engine.scheduler.decoding()
        held = {len(s.survivals) for s in seqs}
        if len(held) == 1 and (n := held.pop()) in CHECKPOINTS and n not in estimates:
            if device == "cuda":  # the newest draft's survivals are copied to the host without waiting: let them land
                torch.cuda.synchronize()  # sync: the engine itself reads them only after the next step's token read
            gate = engine.scheduler.gate
            recent = gate.recent_survivals(seqs)  # the draft gate's view: [R, γ] moving averages (folds the drafts)
            left = [max(1, s.params.max_new_tokens - len(s.output_ids)) for s in seqs]
            planner = engine.scheduler.planner
            est = planner.finish_estimate(gate.finish_survivals(seqs, recent, outcomes=True), left)
            # the same pooled means without each request's outcome factor, and the moving averages instead
            est_means = planner.finish_estimate(gate.finish_survivals(seqs, recent, outcomes=False), left)
            est_recent = planner.finish_estimate(recent, left)
            estimates[n] = {"after_step": steps, "requests": len(seqs),
                            "expected_steps": round(est.speculative_steps, 2),
                            "expected_steps_means": round(est_means.speculative_steps, 2),
                            "expected_steps_recent": round(est_recent.speculative_steps, 2),
                            # τ if every request verified its whole block: 1 + Σ_k a_k, averaged over the batch
                            "forecast_tau": round(1.0 + float(recent.sum(axis=1).mean()), 3)}
    for e in estimates.values():
        e["steps_left"] = steps - e["after_step"]
        e["expected_over_taken"] = round(e["expected_steps"] / max(e["steps_left"], 1), 3)
        e["means_over_taken"] = round(e["expected_steps_means"] / max(e["steps_left"], 1), 3)
        e["recent_over_taken"] = round(e["expected_steps_recent"] / max(e["steps_left"], 1), 3)
    verify_steps = [len(engine.sequence(i).verify_lengths) for i in range(r)]
    return {"steps": steps, "estimates": {str(k): v for k, v in sorted(estimates.items())},
            "request_steps_mean": round(sum(verify_steps) / r, 2), "request_steps_max": max(verify_steps),
            "tau": round(r * (max_new_tokens - 1) / sum(verify_steps), 3)}


def main(argv: list[str] | None = None, *, target: Target | None = None, drafter: DSparkDrafter | None = None,
         prompt_ids: list[list[int]] | None = None) -> dict:
    """Run the check and write ``--out``; ``target``, ``drafter`` and ``prompt_ids`` replace the loaded ones (tests)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_drafted_decode_args(p, max_prompt_tokens=256)
    p.add_argument("--batch-sizes", default="16,64", help="comma list of closed-batch sizes B")
    p.add_argument("--groups", type=int, default=2, help="prompt groups (batches of distinct prompts) per batch size")
    p.add_argument("--out", default="finish-estimate.json", help="the JSON report")
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not sizes or min(sizes) < 1 or args.groups < 1 or args.max_new_tokens < 2:
        raise SystemExit("need batch sizes ≥ 1, --groups ≥ 1 and --max-new-tokens ≥ 2")
    target, drafter, dtype = load_drafted_models(args, target, drafter)
    needed = sum(sizes) * args.groups
    prompts = prompt_ids if prompt_ids is not None else load_prompts(args, target, needed)
    if len(prompts) < needed:
        log.warning("%d prompts for %d requests: groups reuse prompts", len(prompts), needed)
    report = {"what": "finish-time estimate (expected drafting steps left) against the steps a closed batch took, "
                      "adaptive mode with the draft gate off",
              "hardware": hardware_name(args.device),
              "device": args.device, "dtype": str(dtype), "command": "python -m scripts.check_finish_estimate "
              + shlex.join(argv if argv is not None else sys.argv[1:]), "model": args.model, "drafter": args.drafter,
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": []}
    start, offset = time.time(), 0
    for b in tqdm(sizes, desc="batch sizes"):
        for g in range(args.groups):
            group = [prompts[(offset + i) % len(prompts)] for i in range(b)]
            offset += b
            row = {"batch_size": b, "group": g, **check_batch(target, drafter, group, args.max_new_tokens,
                                                              args.device, dtype)}
            log.info("batch %d group %d: %d steps (requests %.1f mean, %d max); expected/taken %s (moving averages "
                     "%s)", b, g, row["steps"], row["request_steps_mean"], row["request_steps_max"],
                     {k: e["expected_over_taken"] for k, e in row["estimates"].items()},
                     {k: e["recent_over_taken"] for k, e in row["estimates"].items()})
            report["results"].append(row)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # each batch as it ends: a cut run keeps it
    report["total_s"] = round(time.time() - start, 1)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", args.out)
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    main()
