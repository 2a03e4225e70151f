"""How much sampled verification would accept if the drafter's proposals were sharpened, per draft slot.

When decoding samples (T > 0), the drafter proposes x_k ~ p_d,k and the verifier accepts it with probability
min(1, p_t / p_d), so a slot whose prefix was accepted survives with probability Σ_v min(p_t(v), p_d,k(v))
(docs/method.md §4). A drafter trained on a mass-covering loss (KL(p_t ‖ p_d)) tends to spread p_d wider than
p_t; proposing from a sharpened q_s ∝ p_d^{1/s} (s < 1) instead, and verifying against q_s, stays lossless (the
verifier only needs the distribution the draft was drawn from) and may accept more. This script measures that
offline: it decodes the prompts with the reference loop (fixed K = γ, every draft verified) and, at every verify,
evaluates Σ_v min(p_t, q_s) for each factor s at every slot whose prefix was accepted (the slot that was rejected
included), from the very p_d and p_t the verifier saw. s = 1 is the acceptance the decode had; the τ column chains
the per-slot means (τ = 1 + Σ_k Π_{j≤k} a_j), which is an estimate: the sharpened proposals would also change which
prefixes get accepted.

    python -m scripts.analyze_sharpening --drafter checkpoints/smollm2-135m-instruct-dspark \\
        --prompts-file docs/benchmarks/eval_prompts.jsonl --every 3 --max-new-tokens 96 --json sharpening.json

It wraps ``reference.generate.rejection_sample`` for the run to observe the distributions (the tokens decoded are
the loop's own). The reference loop is eager: on the project's 2-core CPU, 20 prompts of 96 tokens take ~12 min.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

import reference.generate as reference_loop
from reference.checkpoint import load_drafter, read_drafter_config
from reference.cli import LOG_FORMAT, read_domain_prompts
from reference.config import GenerationConfig, SchedulerConfig, SchedulingMode
from reference.target import DEFAULT_TARGET, Target
from scripts.runtime import hardware, resolve_device

log = logging.getLogger("dspark.analyze_sharpening")
DEFAULT_FACTORS = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)


class SharpeningTally:
    """Σ_v min(p_t, q_s) summed per factor s and slot k over the verified slots whose prefix was accepted."""

    def __init__(self, factors: tuple[float, ...], gamma: int) -> None:
        if not factors or any(s <= 0 for s in factors):
            raise ValueError(f"factors must be positive, got {factors}")
        self.factors, self.gamma = tuple(factors), gamma
        self.sums = torch.zeros(len(factors), gamma, dtype=torch.float64)  # [F, γ]
        self.counts = torch.zeros(gamma, dtype=torch.float64)  # [γ] slots evaluated

    def add(self, draft_probs: torch.Tensor, target_probs: torch.Tensor, verify_lens: torch.Tensor,
            num_accepted: torch.Tensor) -> None:
        """One verify: ``draft_probs`` [R, γ, V] (what each draft was drawn from), ``target_probs`` [R, γ+1, V],
        ``verify_lens`` [R] ℓ_r, ``num_accepted`` [R]."""
        g = draft_probs.shape[1]
        # slot k (0-based) counts when its prefix was accepted and it was verified: k ≤ accepted_r and k < ℓ_r
        slot = torch.arange(g, device=draft_probs.device)[None, :]  # [1, γ]
        reached = (slot <= num_accepted[:, None]) & (slot < verify_lens[:, None])  # [R, γ]
        if not reached.any():
            return
        log_pd = torch.log(draft_probs.double().clamp_min(1e-300))  # [R, γ, V]
        p_t = target_probs[:, :g].double()  # [R, γ, V]
        for i, s in enumerate(self.factors):
            overlap = torch.minimum(torch.softmax(log_pd / s, dim=-1), p_t).sum(-1)  # [R, γ] Σ_v min(p_t, q_s)
            self.sums[i] += torch.where(reached, overlap, 0.0).sum(0).cpu()
        self.counts += reached.sum(0).double().cpu()

    def report(self) -> list[dict]:
        """Per factor: the mean overlap per slot and the chained τ estimate."""
        rows = []
        for i, s in enumerate(self.factors):
            means = [(self.sums[i, k] / self.counts[k]).item() if self.counts[k] else None for k in range(self.gamma)]
            tau, survive = 1.0, 1.0
            for a in means:
                if a is None:
                    break
                survive *= a
                tau += survive
            rows.append({"factor": s, "per_slot": means, "tau_estimate": tau})
        return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.analyze_sharpening", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    p.add_argument("--prompts-file", required=True, help='JSONL, one {"prompt": ..., "domain": ...} per line')
    p.add_argument("--every", type=int, default=1, help="use every N-th prompt of the file")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens decoded per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampling temperature studied (> 0)")
    p.add_argument("--factors", default=",".join(map(str, DEFAULT_FACTORS)), help="comma list of sharpening factors s")
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: 'smollm2-135m-instruct', a .gguf or an HF dir")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0, help="root of the random-number contract (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    if args.temperature <= 0 or args.every < 1:
        raise SystemExit("--temperature must be > 0 (greedy drafts are one-hot: nothing to sharpen), --every ≥ 1")
    try:
        factors = tuple(float(x) for x in args.factors.split(",") if x.strip())
    except ValueError as e:
        raise SystemExit(f"--factors: {e}") from e
    device = resolve_device(args.device)
    cfg = read_drafter_config(args.drafter)
    target = Target.load(args.model, layer_ids=cfg.target_layer_ids, device=device,
                         dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    drafter = load_drafter(args.drafter, target, device=device, dtype=target.dtype)
    prompts = [ids for _, ids in read_domain_prompts(args.prompts_file, target)][::args.every]
    try:
        tally = SharpeningTally(factors, cfg.block_size)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    verify = reference_loop.rejection_sample

    def observed(draft_tokens, verify_lens, draft_probs, target_probs, *rest, **kw):
        result = verify(draft_tokens, verify_lens, draft_probs, target_probs, *rest, **kw)
        tally.add(draft_probs, target_probs, verify_lens, result.num_accepted)
        return result

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    t0 = time.perf_counter()
    reference_loop.rejection_sample = observed
    try:
        reference_loop.generate(target, drafter, prompts, gen,
                                SchedulerConfig(mode=SchedulingMode.FIXED, k=cfg.block_size), progress=True)
    finally:
        reference_loop.rejection_sample = verify
    rows = tally.report()
    for row in rows:
        log.info("s = %-5g a_k %s  τ ≈ %.3f", row["factor"],
                 " ".join("-" if a is None else f"{a:.3f}" for a in row["per_slot"]), row["tau_estimate"])
    report = {"drafter": str(args.drafter), "prompts_file": str(args.prompts_file), "prompts": len(prompts),
              "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "slots_evaluated": tally.counts.tolist(), "factors": rows, "hardware": hardware(device, 1),
              "wall_s": round(time.perf_counter() - t0, 1),
              "command": " ".join(["python -m scripts.analyze_sharpening", *(sys.argv[1:] if argv is None else argv)])}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
