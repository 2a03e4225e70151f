"""``python -m optimized.generate``: the reference CLI, flag for flag and output for output, on the engine.

Adds ``--device cpu|cuda``, ``--enforce-eager`` and ``--max-num-seqs`` to the flags of :mod:`reference.cli`. With the
same model, drafter, seed, mode and cost table, the emitted token ids and per-step accepted lengths equal
``reference.generate``'s (the equivalence contract, tested in ``tests/equivalence/test_end_to_end.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import time

import torch

from optimized.cost_model import DEFAULT_CONTEXT_LEN, cached_profile
from optimized.engine import Engine, EngineConfig, SamplingParams, frozen_heap
from reference.cli import LOG_FORMAT, build_parser, print_results, setup_from_args
from reference.config import GenerationConfig, SchedulerConfig
from reference.cost_model import CostTable
from reference.drafter import DSparkDrafter
from reference.generate import GenerationResult
from reference.hybrid import HybridProposer
from reference.ngram import NgramProposer
from reference.target import Target

log = logging.getLogger("dspark.optimized.generate")


def generate(target: Target, drafter: DSparkDrafter | NgramProposer | HybridProposer | None, prompts: list[list[int]],
             gen: GenerationConfig, sched: SchedulerConfig, cost: CostTable | None = None,
             request_ids: list[int] | None = None, engine_config: EngineConfig | None = None,
             warmup: bool = False) -> list[GenerationResult]:
    """The engine twin of ``reference.generate.generate``: same arguments, same results.

    ``warmup`` runs :meth:`Engine.warmup` before the first request (the CLI does; the results are the same).
    """
    ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
    cfg = engine_config or EngineConfig(max_num_seqs=max(len(prompts), 1), device=str(target.device),
                                        dtype=target.dtype, seed=gen.seed)
    if cfg.seed != gen.seed:
        raise ValueError("engine_config.seed must equal the generation seed")
    longest = max(len(p) for p in prompts) if prompts else 0
    scratch = 2 * (drafter.config.gamma if drafter is not None and sched.mode.drafts else 0)
    cfg.max_seq_len = max(cfg.max_seq_len, longest + gen.max_new_tokens + scratch + 2)
    engine = Engine(target, drafter, cfg, sched, cost)
    if cost is None and sched.mode.needs_cost_table:
        # Profile this engine's own graphs (cached under a fingerprint of model, device and settings).
        context = max(1, min(DEFAULT_CONTEXT_LEN, cfg.max_seq_len - 2 * engine.gamma - 8))
        engine.set_cost_table(cached_profile(engine.runner, context_len=context))
    if warmup:
        engine.warmup()
    params = SamplingParams.from_generation(gen)
    for rid, p in zip(ids, prompts):
        engine.add_request(list(p), params, request_id=rid)
    # On a GPU, nothing alive before the batch starts is walked by a collection while it decodes (frozen_heap); the
    # engine's own reference cycles are collectable again below.
    with frozen_heap(collect=False) if engine.device.type == "cuda" else contextlib.nullcontext():
        while engine.has_unfinished():
            engine.step()
    results = []
    hybrid = engine.runner.hybrid is not None
    for rid in ids:
        s = engine.sequence(rid)
        text = target.decode(s.output_ids) if target.tokenizer is not None else ""
        results.append(GenerationResult(rid, s.prompt_ids, s.output_ids, s.finish_reason or "length",
                                        s.verify_lengths, s.accepted_lengths, text,
                                        s.proposal_sources if hybrid else None))
    if engine.device.type == "cuda":
        # The runner's graph closures refer back to it (a reference cycle): collect it now, so that a caller that
        # builds one engine per batch (scripts/eval_acceptance.py) never holds several engines' caches at once.
        del engine
        gc.collect()
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m optimized.generate`` (the flags of :func:`reference.cli.build_parser` and three of the engine)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    parser = build_parser(prog="python -m optimized.generate")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                        help="cuda if present, else cpu (default: %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="every kernel on one tile shape at every step size (EngineConfig.batch_invariant): greedy "
                             "speculative tokens equal plain decoding's in bfloat16 too, at some speed")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine slots (default: the batch size)")
    parser.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each step before the previous step's tokens are read (EngineConfig.async_decode; "
                             "default: on with CUDA)")
    parser.add_argument("--cost-feedback", action=argparse.BooleanOptionalAction, default=None,
                        help="price steps at their measured times once these drift from the cost table "
                             "(EngineConfig.cost_feedback; default: on with CUDA)")
    parser.add_argument("--acceptance-feedback", action="store_true",
                        help="plan the adaptive mode with the survivals scaled by how often drafts survived "
                             "(EngineConfig.acceptance_feedback; default: off)")
    parser.add_argument("--finish-time-gate", action="store_true",
                        help="once every prompt has a slot, let the adaptive mode's draft gate weigh the time to "
                             "finish the batch, drafting against plain decoding (EngineConfig.finish_time_gate; "
                             "default: off)")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, drafter, gen, sched, prompts = setup_from_args(args, device=args.device, dtype=dtype, forward=False)
    # Without --cost-table, generate() profiles the serving engine itself (no second engine, no second capture).
    cost = CostTable.load(args.cost_table) if args.cost_table else None
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs or len(prompts), device=args.device, dtype=dtype,
                       enforce_eager=args.enforce_eager, seed=gen.seed, async_decode=args.async_decode,
                       cost_feedback=args.cost_feedback, batch_invariant=args.batch_invariant,
                       acceptance_feedback=args.acceptance_feedback, finish_time_gate=args.finish_time_gate)
    t0 = time.perf_counter()
    results = generate(target, drafter, prompts, gen, sched, cost, engine_config=cfg, warmup=True)
    print_results(results, args.json, time.perf_counter() - t0, sched.mode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
