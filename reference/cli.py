"""The command line shared by ``python -m reference.generate`` and ``python -m optimized.generate``.

Both CLIs take the same flags (:func:`build_parser`), build the same target, drafter, configs and tokenised prompts
(:func:`setup_from_args`) and print the same output (:func:`print_results`); only the loop that decodes differs.
The reference loop or the engine is never imported here, so either package's CLI pulls in only its own loop.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from reference.checkpoint import load_drafter
from reference.config import (  # noqa: F401 (DEFAULT_DRAFTER, DEFAULT_MODEL: the CLIs import them from here)
    DEFAULT_DRAFTER,
    DEFAULT_MODEL,
    PROPOSER_KINDS,
    SCHEDULER_MODES,
    DrafterConfig,
    GenerationConfig,
    HybridConfig,
    NgramConfig,
    ProposerKind,
    SchedulerConfig,
    SchedulingMode,
)
from reference.drafter import DSparkDrafter
from reference.hybrid import HybridProposer
from reference.hybrid import check_mode as check_hybrid_mode
from reference.ngram import NgramProposer, check_mode
from reference.target import Target

if TYPE_CHECKING:
    from reference.generate import GenerationResult

log = logging.getLogger("dspark.generate")

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


# ----------------------------------------------------------------------------------------------------------
# The drafter a command line asks for
# ----------------------------------------------------------------------------------------------------------


def load_or_init_drafter(path: str | None, target: Target, gamma: int | None = None, seed: int = 0) -> DSparkDrafter:
    """Load a drafter checkpoint, or (no checkpoint) build a randomly initialised one — loudly."""
    if path is not None and Path(path).exists():
        drafter = load_drafter(path, target, device=target.device, dtype=target.dtype)
        if gamma is not None and gamma != drafter.config.block_size:
            raise ValueError(f"--gamma {gamma} differs from the drafter's trained block size "
                             f"{drafter.config.block_size}; a drafter drafts the block it was trained for")
        return drafter
    if path is not None and path != str(DEFAULT_DRAFTER):
        raise FileNotFoundError(f"drafter checkpoint {path} does not exist")
    banner = "!" * 100
    log.warning("\n%s\nNO TRAINED DRAFTER at %s: using a RANDOMLY INITIALISED drafter (seed %d).\n"
                "Output is still exactly the target's (verification is lossless), but acceptance will be near "
                "zero and there is no speed-up. Train one with scripts/train_drafter.py.\n%s",
                banner, path or DEFAULT_DRAFTER, seed, banner)
    torch.manual_seed(seed)
    config = DrafterConfig.from_target_config(target.config, block_size=gamma or 7, target_name=target.name,
                                              target_layer_ids=target.layer_ids)
    drafter = DSparkDrafter(config).to(device=target.device, dtype=target.dtype).eval()
    drafter.attach_target(target.embed_tokens, target.lm_head)
    return drafter



def build_parser(prog: str = "python -m reference.generate") -> argparse.ArgumentParser:
    """The flags both ``python -m reference.generate`` and ``python -m optimized.generate`` take."""
    p = argparse.ArgumentParser(prog=prog, description="Speculative decoding with a DSpark drafter: prefill, then "
                                "draft → schedule → verify → commit (docs/method.md §1–§5).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: 'smollm2-135m-instruct', a .gguf file or a local HF model directory")
    p.add_argument("--drafter", default=None, help=f"drafter checkpoint directory (default {DEFAULT_DRAFTER})")
    p.add_argument("--proposer", default=ProposerKind.DSPARK.value, choices=PROPOSER_KINDS,
                   help="who drafts: the trained DSpark drafter, the training-free n-gram lookup "
                        "(reference/ngram.py; modes none, fixed and dsd; no checkpoint), or the hybrid of the two "
                        "(reference/hybrid.py: per request and step, the block expected to be accepted longer; the "
                        "drafter's checkpoint; every mode but oracle)")
    p.add_argument("--mode", default=None, choices=SCHEDULER_MODES,
                   help="verify-length policy (default adaptive; fixed with --proposer ngram)")
    p.add_argument("--k", type=int, default=None, help="verify length in mode fixed (default γ)")
    p.add_argument("--gamma", type=int, default=None,
                   help="block size γ (must match the drafter; the n-gram proposer's, default 7)")
    p.add_argument("--ngram-max-n", type=int, default=NgramConfig.max_n,
                   help="n-gram proposer (and the hybrid's lookup): longest suffix tried")
    p.add_argument("--ngram-min-n", type=int, default=NgramConfig.min_n,
                   help="n-gram proposer (and the hybrid's lookup): shortest match")
    add_hybrid_args(p)
    p.add_argument("--threshold", type=float, default=0.5, help="prefix-survival threshold in mode threshold")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of this mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="root of the random-number contract (docs/contracts.md)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--cost-table", default=None, help="SPS table JSON (measured at start-up if absent)")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--ignore-eos", action="store_true", help="decode to --max-new-tokens (benchmarks)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt per line")
    return p


def add_hybrid_args(p: argparse.ArgumentParser) -> None:
    """The hybrid proposer's prior flags (HybridConfig), shared with the scripts that run it."""
    p.add_argument("--hybrid-prior-accept", type=float, default=HybridConfig.prior_accept,
                   help="hybrid proposer: prior mean of an n-gram slot's conditional acceptance, before the request's "
                        "own verifications (HybridConfig.prior_accept)")
    p.add_argument("--hybrid-prior-accept-sampling", type=float, default=HybridConfig.prior_accept_sampling,
                   help="hybrid proposer: the same prior mean for a request that samples (T > 0), whose target seldom "
                        "continues a verbatim copy (HybridConfig.prior_accept_sampling)")
    p.add_argument("--hybrid-prior-strength", type=float, default=HybridConfig.prior_strength,
                   help="hybrid proposer: pseudo-counts of that prior, α + β of its Beta distribution "
                        "(HybridConfig.prior_strength)")


def hybrid_from_args(args: argparse.Namespace, drafter: DSparkDrafter) -> HybridProposer:
    """The hybrid of ``drafter`` and the lookup the flags describe (a bad setting exits with its message)."""
    try:
        config = HybridConfig(gamma=drafter.config.block_size, max_n=args.ngram_max_n, min_n=args.ngram_min_n,
                              prior_accept=args.hybrid_prior_accept,
                              prior_accept_sampling=args.hybrid_prior_accept_sampling,
                              prior_strength=args.hybrid_prior_strength)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    return HybridProposer(drafter, config)


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSONL file; a line that is not a JSON object fails
    with ``path:line`` in the message. Shared by the CLIs and the scripts that read prompt files."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            rows.append((n, obj))
    return rows


def read_prompts(args: argparse.Namespace) -> list[str]:
    """Prompts from --prompt flags or a JSONL file; bad lines fail with their line number."""
    if args.prompt:
        return list(args.prompt)
    try:
        rows = read_jsonl(args.prompts_file)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    prompts = []
    for n, obj in rows:
        if not isinstance(obj.get("prompt"), str):
            raise SystemExit(f'{args.prompts_file}:{n}: expected an object with a string "prompt"')
        prompts.append(obj["prompt"])
    if not prompts:
        raise SystemExit(f"{args.prompts_file}: no prompts")
    return prompts


def read_domain_prompts(path: str | Path, target: Target, chat_template: bool = True,
                        limit: int | None = None) -> list[tuple[str, list[int]]]:
    """(domain, token ids) per line of a JSONL prompt file of ``{"prompt": ..., "domain": ...}`` (or
    ``{"input_ids": [...]}``) objects, the evaluation and equivalence scripts' format; bad lines fail with their
    line number. ``domain`` defaults to ``"all"``; ``limit`` keeps the first prompts only."""
    try:
        records = read_jsonl(path)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    rows = []
    for n, obj in records:
        domain = str(obj.get("domain", "all"))
        if isinstance(obj.get("input_ids"), list) and obj["input_ids"]:
            ids = [int(t) for t in obj["input_ids"]]
        elif isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            ids = target.encode(obj["prompt"], chat_template=chat_template)
        else:
            raise SystemExit(f'{path}:{n}: expected a non-empty "prompt" string or "input_ids" list')
        rows.append((domain, ids))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    return rows


def configs_from_args(args: argparse.Namespace, gamma: int) -> tuple[GenerationConfig, SchedulerConfig]:
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed, chat_template=not args.no_chat_template,
                           ignore_eos=args.ignore_eos)
    k = gamma if args.k is None else args.k
    if k > gamma:
        raise SystemExit(f"--k {k} exceeds the block size γ = {gamma}")
    sched = SchedulerConfig(mode=cli_mode(args), k=k, threshold=args.threshold)
    return gen, sched


def cli_mode(args: argparse.Namespace) -> SchedulingMode:
    """``--mode``, defaulting to the proposer's natural policy: ``adaptive`` for the drafter, ``fixed`` for n-grams."""
    if args.mode is not None:
        return SchedulingMode(args.mode)
    return SchedulingMode.FIXED if args.proposer == ProposerKind.NGRAM else SchedulingMode.ADAPTIVE


def build_proposer(args: argparse.Namespace, target: Target) -> DSparkDrafter | NgramProposer | HybridProposer | None:
    """The drafter kind ``--proposer`` names (None in mode none): the checkpoint (or a loud random init), the n-gram
    proposer, which needs no checkpoint, or the hybrid of the two; the mode is checked here, before anything is
    measured."""
    mode = cli_mode(args)
    if args.proposer == ProposerKind.HYBRID:
        try:
            check_hybrid_mode(mode)
        except ValueError as e:
            raise SystemExit(str(e)) from e
    if args.proposer != ProposerKind.NGRAM:
        if not mode.drafts:
            return None
        drafter = load_or_init_drafter(args.drafter or str(DEFAULT_DRAFTER), target, args.gamma, args.seed)
        return hybrid_from_args(args, drafter) if args.proposer == ProposerKind.HYBRID else drafter
    if args.drafter is not None:
        raise SystemExit("--drafter names a checkpoint; the n-gram proposer has none (drop one of the two)")
    try:
        check_mode(mode)
        gamma = NgramConfig.gamma if args.gamma is None else args.gamma
        config = NgramConfig(gamma=gamma, max_n=args.ngram_max_n, min_n=args.ngram_min_n)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    return NgramProposer(config) if mode.drafts else None


def setup_from_args(args: argparse.Namespace, device: str = "cpu", dtype: torch.dtype = torch.float32, *,
                    forward: bool = True):
    """The part of both CLIs before the cost table: target, drafter, configs and tokenised prompts. ``forward=False``
    loads the target's weights without its HF forward (the optimized engine's CLI: see ``Target.load``)."""
    prompts = read_prompts(args)
    target = Target.load(args.model, device=device, dtype=dtype, forward=forward)
    drafter = build_proposer(args, target)
    gamma = drafter.config.gamma if drafter is not None else (args.gamma or 7)
    gen, sched = configs_from_args(args, gamma)
    token_prompts = [target.encode(p, chat_template=gen.chat_template) for p in prompts]
    return target, drafter, gen, sched, token_prompts


def print_results(results: list[GenerationResult], as_json: bool, elapsed: float, mode: SchedulingMode) -> None:
    """One JSON line per prompt (--json) or readable text; a throughput line on stderr."""
    for r in results:
        if as_json:
            print(json.dumps(r.to_json()), flush=True)
        else:
            print(f"--- prompt {r.request_id} ({r.finish_reason}, τ = {r.mean_accepted_length:.2f}) ---")
            print(r.text)
    n = sum(len(r.token_ids) for r in results)
    log.info("%d tokens in %.2f s (%.1f tokens/s), mode %s", n, elapsed, n / max(elapsed, 1e-9), mode)


