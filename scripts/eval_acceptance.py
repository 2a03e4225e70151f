"""Accepted length τ of a drafter on a prompt file: full block verified, batch-1 semantics (docs/method.md §4, §6).

Names follow ``docs/method.md``: ``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length,
``τ`` tokens emitted by one verification (accepted drafts + 1).

Every prompt is decoded by the reference loop (``reference.generate``) in scheduler mode ``fixed`` with
``k = γ``: each step verifies the whole block, so τ measures the drafter alone (no scheduler). By the
random-number contract a request's tokens depend only on its own id, prompt and the seed, never on its
neighbours, so batching prompts (``--batch-size``) gives exactly the batch-1 result, only faster.

``--proposer ngram`` measures the training-free n-gram (prompt-lookup) proposer (``reference/ngram.py``) the same
way, with no checkpoint: the baseline row a trained drafter's τ is compared with. Its blocks may be shorter than γ
(or empty), so each step verifies ``min(γ, m)`` slots, and a step without a proposal counts with τ = 1.

``--proposer hybrid`` (with ``--drafter``) measures the hybrid proposer (``reference/hybrid.py``): each request takes,
step by step, the drafter's block or its n-gram continuation, whichever is expected to be accepted longer; an n-gram
block verifies its ``min(γ, m)`` slots.

Reported (OUT.json):

* ``mean_accepted_length``: τ pooled over all steps of all prompts, ``Σ (accepted + 1) / steps``
  (the paper's definition), with its standard error ``mean_accepted_length_se`` (prompts as clusters: two drafters
  whose τ differ by less than about twice it are not told apart by these prompts, which matters most for sampled
  runs); ``mean_accepted_length_macro`` averages the per-prompt τ instead;
* ``per_domain``: domain → pooled τ; ``per_domain_detail`` adds counts and per-position acceptance;
* with ``--proposer hybrid``, ``sources`` (overall and in each domain's detail): per source (``dspark``, ``ngram``),
  how many steps verified its block, their share of the steps and their τ; and ``per_prompt``: each (prompt, seed)
  run's domain, steps, τ and the same per-source figures;
* ``per_position_acceptance``: ``P(slot k accepted | slots 1..k-1 accepted, slot k verified)`` for k = 1..γ (paper
  Figure 2), with the number of such steps in ``per_position_counts``; ``per_position_verified`` is the share of
  steps that verified slot k (1 for a trained drafter's full blocks; below 1 where n-gram proposals ran short), and
  ``mean_verify_length`` the mean ℓ;
* counts, settings, hardware, command, wall time.

``--seeds N`` (sampled runs only) decodes every prompt with N seeds and pools them: the per-domain and per-position
figures count every (prompt, seed) run (``per_domain_detail``'s ``prompts`` counts runs), and τ's standard error
treats each run as a cluster.

Usage::

    python -m scripts.eval_acceptance --drafter DIR --prompts-file F.jsonl [--temperature T] \\
        [--max-new-tokens N] [--gamma G] --json OUT.json
    python -m scripts.eval_acceptance --proposer ngram [--gamma 7] --prompts-file F.jsonl --json OUT.json
    python -m scripts.eval_acceptance --proposer hybrid --drafter DIR --prompts-file F.jsonl --json OUT.json

Prompt lines are ``{"prompt": str, "domain": str}`` (``"input_ids": [...]`` may replace ``"prompt"`` for a
target without tokenizer). It runs on a CPU too, slowly: use a handful of prompts there.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from reference.checkpoint import load_drafter, read_drafter_config
from reference.cli import add_hybrid_args, read_domain_prompts
from reference.config import (
    PROPOSER_KINDS,
    GenerationConfig,
    HybridConfig,
    NgramConfig,
    ProposerKind,
    SchedulerConfig,
)
from reference.generate import GenerationResult, generate
from reference.hybrid import SOURCES, HybridProposer
from reference.ngram import NgramProposer
from reference.target import DEFAULT_TARGET, Target
from scripts.runtime import hardware, resolve_device

log = logging.getLogger("dspark.eval_acceptance")


def tau_standard_error(results: list[GenerationResult]) -> float | None:
    """Standard error of the pooled τ, with the prompts as clusters (a prompt's steps are not independent: a prompt
    that loops is accepted all along). τ = Σ_p S_p / Σ_p n_p over prompts p with n_p steps emitting S_p tokens; its
    cluster-robust (ratio-estimator) variance is Σ_p (S_p − τ·n_p)² / N², N = Σ_p n_p, times P/(P−1)."""
    sums = [(sum(r.accepted_lengths) + len(r.accepted_lengths), len(r.accepted_lengths)) for r in results
            if r.accepted_lengths]
    if len(sums) < 2:
        return None
    total = sum(n for _, n in sums)
    tau = sum(s for s, _ in sums) / total
    var = sum((s - tau * n) ** 2 for s, n in sums) / total ** 2 * len(sums) / (len(sums) - 1)
    return var ** 0.5


def source_summary(results: list[GenerationResult]) -> dict[str, dict]:
    """The hybrid proposer's choices: per source that verified any step (``dspark``, ``ngram``; ``none``: steps that
    verified no block), its steps, their share of all steps and their pooled τ (accepted drafts + 1 per step)."""
    steps: dict[str, list[int]] = {}
    for r in results:
        for source, accepted in zip(r.proposal_sources or [], r.accepted_lengths, strict=True):
            steps.setdefault(source, []).append(accepted)
    total = sum(len(a) for a in steps.values())
    return {source: {"steps": len(steps[source]), "share": len(steps[source]) / total,
                     "mean_accepted_length": (sum(steps[source]) + len(steps[source])) / len(steps[source])}
            for source in SOURCES if source in steps}


def summarise(results: list[GenerationResult], gamma: int) -> dict:
    """Pooled τ, per-prompt macro τ and per-position conditional acceptance of a set of results (and, for the hybrid
    proposer's, its choices: :func:`source_summary`)."""
    steps = [a for r in results for a in r.accepted_lengths]  # accepted drafts per verification step
    acc = torch.tensor(steps, dtype=torch.long)  # [steps]
    ell = torch.tensor([v for r in results for v in r.verify_lengths], dtype=torch.long)  # [steps] ℓ of each step
    # Slot k is judged in the steps that accepted slots 1..k-1 and verified slot k (a short proposal ends earlier).
    reached = [int(((acc >= k - 1) & (ell >= k)).sum()) for k in range(1, gamma + 1)]
    passed = [int((acc >= k).sum()) for k in range(1, gamma + 1)]
    per_prompt = [r.mean_accepted_length for r in results if r.accepted_lengths]
    return {
        "mean_accepted_length": float(acc.float().mean() + 1) if steps else None,
        "mean_accepted_length_se": tau_standard_error(results),
        "mean_accepted_length_macro": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "mean_verify_length": float(ell.float().mean()) if steps else None,
        "per_position_acceptance": [p / n if n else None for p, n in zip(passed, reached)],
        "per_position_counts": reached,
        "per_position_verified": [float((ell >= k).float().mean()) if steps else None for k in range(1, gamma + 1)],
        "prompts": len(results),
        "steps": len(steps),
        "generated_tokens": sum(len(r.token_ids) for r in results),
        **({"sources": source_summary(results)} if any(r.proposal_sources is not None for r in results) else {}),
    }


def spread_over_domains(rows: list[tuple[str, list[int]]], limit: int | None) -> list[tuple[str, list[int]]]:
    """At most ``limit`` of the (domain, ids) rows, taken in turn from each domain (its rows in file order, the
    domains in order of first appearance), returned in file order: a limited run still reports every domain."""
    if limit is None or limit >= len(rows):
        return rows
    by_domain: dict[str, list[int]] = {}
    for i, (domain, _) in enumerate(rows):
        by_domain.setdefault(domain, []).append(i)
    queues = [list(idx) for idx in by_domain.values()]
    picked: list[int] = []
    while len(picked) < limit:
        for q in queues:
            if q and len(picked) < limit:
                picked.append(q.pop(0))
    return [rows[i] for i in sorted(picked)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory (--proposer dspark or hybrid)")
    p.add_argument("--proposer", default=ProposerKind.DSPARK.value, choices=PROPOSER_KINDS,
                   help="the trained drafter (--drafter), the training-free n-gram lookup (no checkpoint), or the "
                        "hybrid of the two (--drafter; per request and step, the block expected to be accepted longer)")
    p.add_argument("--ngram-max-n", type=int, default=NgramConfig.max_n,
                   help="n-gram proposer (and the hybrid's lookup): longest suffix tried")
    p.add_argument("--ngram-min-n", type=int, default=NgramConfig.min_n,
                   help="n-gram proposer (and the hybrid's lookup): shortest match")
    add_hybrid_args(p)
    p.add_argument("--prompts-file", required=True, help='JSONL, one {"prompt": ..., "domain": ...} per line')
    p.add_argument("--json", required=True, help="output JSON file")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = lossless sampling (top-p off)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--gamma", type=int, default=None,
                   help="block size γ (must equal the drafter's; the n-gram proposer's, default 7)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: 'smollm2-135m-instruct', a .gguf or an HF dir")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target and drafter dtype; auto = bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call (results do not depend on it)")
    p.add_argument("--seed", type=int, default=0, help="generation seed (random-number contract)")
    p.add_argument("--seeds", type=int, default=1,
                   help="sampled runs (T > 0): decode every prompt with seeds --seed .. --seed + N - 1 and pool "
                        "them, which shrinks τ's standard error by about √N (each (prompt, seed) is one cluster)")
    p.add_argument("--limit", type=int, default=None,
                   help="use N prompts, taken in turn from each domain in file order (the evaluation file is sorted "
                        "by domain: the first N lines would be one domain); default: all (%(default)s)")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--engine", choices=["optimized", "reference"], default="optimized",
                   help="who runs the loop: the batched engine (fast) or the reference loop (one request at a "
                        "time); both emit the same tokens and accepted lengths (tests/equivalence)")
    p.add_argument("--enforce-eager", action="store_true", help="optimized engine without CUDA graphs")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be ≥ 1, got {args.batch_size}")
    if args.seeds < 1 or (args.seeds > 1 and args.temperature == 0):
        raise SystemExit(f"--seeds must be ≥ 1, and 1 for greedy decoding (which no seed changes), got {args.seeds}")
    device = resolve_device(args.device)
    ngram, hybrid = args.proposer == ProposerKind.NGRAM, args.proposer == ProposerKind.HYBRID
    if ngram == (args.drafter is not None):
        raise SystemExit("give --drafter DIR for the trained drafter (--proposer dspark or hybrid), or --proposer "
                         "ngram (no checkpoint), not both")
    if ngram:
        try:
            ngram_cfg = NgramConfig(gamma=NgramConfig.gamma if args.gamma is None else args.gamma,
                                    max_n=args.ngram_max_n, min_n=args.ngram_min_n)
        except ValueError as e:
            raise SystemExit(str(e)) from e
        gamma, layer_ids = ngram_cfg.gamma, None
    else:
        cfg = read_drafter_config(args.drafter)
        gamma, layer_ids = cfg.block_size, cfg.target_layer_ids
        if args.gamma is not None and args.gamma != gamma:
            raise SystemExit(f"--gamma {args.gamma} differs from the drafter's trained block size γ = {gamma}")
        if hybrid:
            try:
                hybrid_cfg = HybridConfig(gamma=gamma, max_n=args.ngram_max_n, min_n=args.ngram_min_n,
                                          prior_accept=args.hybrid_prior_accept,
                                          prior_accept_sampling=args.hybrid_prior_accept_sampling,
                                          prior_strength=args.hybrid_prior_strength)
            except ValueError as e:
                raise SystemExit(str(e)) from e
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    target = Target.load(args.model, layer_ids=layer_ids, device=device, dtype=dtype)
    if ngram:
        drafter = NgramProposer(ngram_cfg)
        drafter_config = {"kind": "ngram", "gamma": gamma, "max_n": ngram_cfg.max_n, "min_n": ngram_cfg.min_n}
    else:
        drafter = load_drafter(args.drafter, target, device=device, dtype=target.dtype)
        drafter_config = {"head": cfg.head, "num_layers": cfg.num_layers, "markov_rank": cfg.markov_rank,
                          "sts_temperatures": cfg.sts_temperatures}
        if hybrid:
            drafter = HybridProposer(drafter, hybrid_cfg)
            drafter_config |= {"kind": "hybrid", "max_n": hybrid_cfg.max_n, "min_n": hybrid_cfg.min_n,
                               "prior_accept": hybrid_cfg.prior_accept,
                               "prior_accept_sampling": hybrid_cfg.prior_accept_sampling,
                               "prior_strength": hybrid_cfg.prior_strength}
    prompts = spread_over_domains(read_domain_prompts(args.prompts_file, target,
                                                      chat_template=not args.no_chat_template), args.limit)
    seeds = list(range(args.seed, args.seed + args.seeds))
    sched = SchedulerConfig(mode="fixed", k=gamma)  # full block verified every step: τ of the drafter alone
    log.info("%d prompts, %s, γ = %d, T = %g, %d new tokens, seed(s) %s, %s", len(prompts), args.proposer, gamma,
             args.temperature, args.max_new_tokens, seeds, device)

    t0 = time.perf_counter()
    results: list[GenerationResult] = []
    domains: list[str] = []  # of each result (prompts repeat once per seed)
    runs: list[tuple[int, int]] = []  # (prompt index, seed) of each result
    if args.engine == "optimized":  # imported only when used: the reference loop needs none of it
        from optimized.engine import EngineConfig
        from optimized.generate import generate as engine_generate
    for seed in seeds:
        gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=seed,
                               chat_template=not args.no_chat_template)
        for start in tqdm(range(0, len(prompts), args.batch_size), desc=f"eval (seed {seed})", unit="batch"):
            chunk = prompts[start:start + args.batch_size]
            ids = list(range(start, start + len(chunk)))
            if args.engine == "reference":
                results += generate(target, drafter, [p for _, p in chunk], gen, sched, request_ids=ids)
            else:
                engine_cfg = EngineConfig(max_num_seqs=len(chunk), device=str(target.device), dtype=target.dtype,
                                          seed=gen.seed, enforce_eager=args.enforce_eager)
                results += engine_generate(target, drafter, [p for _, p in chunk], gen, sched, request_ids=ids,
                                           engine_config=engine_cfg)
            domains += [d for d, _ in chunk]
            runs += [(i, seed) for i in ids]
    wall = time.perf_counter() - t0

    by_domain: dict[str, list[GenerationResult]] = defaultdict(list)
    for domain, r in zip(domains, results, strict=True):
        by_domain[domain].append(r)
    overall = summarise(results, gamma)
    detail = {d: summarise(rs, gamma) for d, rs in sorted(by_domain.items())}
    report = {
        "mean_accepted_length": overall["mean_accepted_length"],
        "mean_accepted_length_macro": overall["mean_accepted_length_macro"],
        "mean_accepted_length_se": overall["mean_accepted_length_se"],
        "per_domain": {d: s["mean_accepted_length"] for d, s in detail.items()},
        "mean_verify_length": overall["mean_verify_length"],
        "per_position_acceptance": overall["per_position_acceptance"],
        "per_position_counts": overall["per_position_counts"],
        "per_position_verified": overall["per_position_verified"],
        "per_domain_detail": detail,
        **({"sources": overall["sources"],
            "per_prompt": [{"prompt": i, "seed": seed, "domain": d, "steps": len(r.accepted_lengths),
                            "mean_accepted_length": r.mean_accepted_length, "sources": source_summary([r])}
                           for (i, seed), d, r in zip(runs, domains, results, strict=True)]}
           if hybrid else {}),
        "counts": {**{k: overall[k] for k in ("steps", "generated_tokens")}, "prompts": len(prompts),
                   "seeds": len(seeds)},
        "settings": {"temperature": args.temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": args.max_new_tokens,
                     "gamma": gamma, "scheduler": "fixed", "k": gamma, "seed": args.seed, "seeds": seeds,
                     "chat_template": not args.no_chat_template, "dtype": str(target.dtype).removeprefix("torch."),
                     "engine": args.engine},
        "proposer": str(args.proposer),
        "drafter": "ngram" if ngram else str(args.drafter),
        "drafter_config": drafter_config,
        "model": args.model,
        "prompts_file": str(args.prompts_file),
        "hardware": hardware(device, 1),
        "wall_s": round(wall, 1),
        "command": " ".join(["scripts/eval_acceptance.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("τ = %.3f (%s); per position %s; %.1f s -> %s", report["mean_accepted_length"],
             ", ".join(f"{d} {t:.3f}" for d, t in report["per_domain"].items()),
             " ".join(f"{p:.2f}" if p is not None else "-" for p in report["per_position_acceptance"]), wall, out)
    if hybrid:
        log.info("hybrid: n-gram block in %s of the steps (%s)", ", ".join(
            f"{s['sources'].get('ngram', {}).get('share', 0.0):.0%} in {d}" for d, s in detail.items()),
            ", ".join(f"τ {src} {v['mean_accepted_length']:.3f}" for src, v in report["sources"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
