"""``python -m scripts.exactness``: does greedy speculative decoding emit plain decoding's tokens in bfloat16?

In float32 every mode does (the equivalence suite). In bfloat16 a verify step computes a token's logits as one row of
a block, a plain step as the only row, and kernels whose reduction order depends on the step's shape can flip a
near-tie (docs/numerics.md). ``EngineConfig.batch_invariant`` runs the target's projections and LM head through the
row-invariant row loop; this script measures what that buys and what it costs:

* for each setting (``--settings``: ``default`` kernels, ``invariant`` = ``batch_invariant``), each batch size
  (``--batch-sizes``) and each mode (``--modes``, plus plain decoding ``none``), the prompts run greedy in closed
  batches of that size (EOS ignored, ``--max-new-tokens`` each), after one untimed batch (Triton compiles the
  shapes it meets);
* ``identical``: how many prompts emitted exactly the tokens plain decoding emitted at the same batch size and
  setting (and ``none`` at each batch size against ``none`` at the first: a request alone and in a batch);
  ``first_difference``: the token index of each differing prompt's first difference;
* ``throughput_ratio``: per batch size and mode, tokens/s of the invariant setting over the default's
  (``invariant_over_default``), the same run.

JSON to ``--json`` (``docs/benchmarks/exactness-<tag>.json`` by default), rewritten after every configuration::

    python -m scripts.exactness --model TARGET.gguf --sharegpt-file SHAREGPT.json.gz --limit 64 \\
        --max-new-tokens 256 --modes fixed:7,dsd,adaptive --batch-sizes 1,16,64

On the CPU (float32 unless ``--dtype``) the kernels run through Triton's interpreter with ``TRITON_INTERPRET=1``
(the invariant setting needs the Triton layer ops): slow, for tests with tiny models.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from optimized.cost_model import DEFAULT_CONTEXT_LEN, cached_profile
from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.kernels import linear as linear_kernels
from reference.cli import DEFAULT_DRAFTER, LOG_FORMAT, load_or_init_drafter
from reference.config import SchedulerConfig
from reference.cost_model import CostTable, hardware_name
from reference.target import Target
from scripts.benchmarking import add_engine_source_args, default_tag, load_prompts, parse_mode

log = logging.getLogger("dspark.exactness")
ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("default", "invariant")


def run_batches(engine: Engine, prompts: list[list[int]], batch_size: int, max_new_tokens: int
                ) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt, in closed batches of ``batch_size`` (in order), and the seconds they took."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        ids = [engine.add_request(p, params) for p in prompts[start:start + batch_size]]
        while engine.has_unfinished():
            engine.step()
        tokens += [list(engine.sequence(i).output_ids) for i in ids]
        for i in ids:
            engine.release(i)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()  # sync: the timed work ends here
    return tokens, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.exactness", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: name, .gguf or HF directory")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (default: the shipped one)")
    p.add_argument("--modes", default="fixed:7,dsd,adaptive", help="comma list of drafting modes (plain runs too)")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma list of closed-batch sizes")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of: default, invariant")
    p.add_argument("--limit", type=int, default=64, help="prompts (each batch size runs all of them)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens each request generates (EOS ignored)")
    p.add_argument("--cost-table", default=None, help="a saved cost table for adaptive (default: profiled)")
    p.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT_LEN, help="KV length of the cost profile")
    p.add_argument("--cost-cache-dir", default=None, help="where profiled cost tables are cached")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="the engine's kernels (auto: Triton on CUDA or under TRITON_INTERPRET=1)")
    p.add_argument("--seed", type=int, default=0, help="EngineConfig.seed")
    p.add_argument("--invariant-tiles", default=None,
                   help="a table of row-invariant tl.dot tiles for the invariant setting, as JSON or a JSON file "
                        "(optimized.kernels.linear.INVARIANT_TILES's format), or the JSON report of "
                        "scripts/bench_linear.py --invariant-sweep (its proposed table): a trial of larger tiles for "
                        "large steps, whose bits this run checks (default: the table in the code)")
    p.add_argument("--json", default=None, help="output JSON (default docs/benchmarks/exactness-<tag>.json)")
    add_engine_source_args(p)
    return p


def main(argv: list[str] | None = None, *, target: Target | None = None, drafter=None,
         prompt_ids: list[list[int]] | None = None, cost: CostTable | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    settings = args.settings.split(",")
    if not settings or any(s not in SETTINGS for s in settings):
        raise SystemExit(f"--settings takes {', '.join(SETTINGS)}, got {args.settings!r}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    tiles = None
    if args.invariant_tiles:
        text = args.invariant_tiles
        try:
            if not text.lstrip().startswith("["):  # a file: the table, or a bench_linear report
                text = Path(text).read_text()
            tiles = json.loads(text)
            if isinstance(tiles, dict):  # a scripts/bench_linear.py report: its proposal
                if "proposed_invariant_tiles" not in tiles:
                    raise ValueError("the report has no proposed_invariant_tiles (run bench_linear --invariant-sweep)")
                tiles = tiles["proposed_invariant_tiles"]
            linear_kernels.check_invariant_tiles(tiles)  # now, before any model is loaded
        except (OSError, ValueError) as err:  # an unreadable file, bad JSON (a ValueError), a malformed table
            raise SystemExit(f"--invariant-tiles: {err}") from err
    with linear_kernels.invariant_tiles(tiles):
        return _run(args, settings, batch_sizes, target, drafter, prompt_ids, cost, argv)


def _run(args: argparse.Namespace, settings: list[str], batch_sizes: list[int], target: Target | None, drafter,
         prompt_ids: list[list[int]] | None, cost: CostTable | None, argv: list[str] | None) -> dict[str, Any]:
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if target is None:
        target = Target.load(args.model, device=args.device, dtype=getattr(torch, dtype_name))
    if drafter is None:
        drafter = load_or_init_drafter(args.drafter or str(DEFAULT_DRAFTER), target, None, args.seed)
    gamma = drafter.config.block_size
    modes = ["none"] + [m for m in args.modes.split(",") if m != "none"]
    parsed = {m: parse_mode(m, gamma) for m in modes}
    if prompt_ids is None:
        prompt_ids = load_prompts(args, target, args.limit)
    prompts = prompt_ids[:args.limit]
    if cost is None and args.cost_table:
        cost = CostTable.load(args.cost_table)
    device = torch.device(target.device)
    out = Path(args.json) if args.json else ROOT / "docs" / "benchmarks" / f"exactness-{default_tag(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "hardware": hardware_name(device), "dtype": str(target.dtype).removeprefix("torch."),
        "command": "python -m scripts.exactness " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                        else sys.argv[1:])),
        "model": target.name or args.model, "drafter": args.drafter or str(DEFAULT_DRAFTER),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        # the row-invariant tiles in force on this device (a table is used only where it was verified)
        "invariant_tiles": [dict(t) for t in linear_kernels.invariant_tile_table(
            torch.cuda.get_device_capability(device) if device.type == "cuda" else None, target.dtype)],
        "results": [], "throughput_ratio": [],
    }
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + 2 * gamma + 8
    tokens_per_s: dict[tuple[str, int, str], float] = {}
    for setting in settings:
        for mode_name in tqdm(modes, desc=setting, disable=None):
            mode, k = parsed[mode_name]
            cfg = EngineConfig(max_num_seqs=max(batch_sizes), max_seq_len=max(max_seq_len, args.context_len + 2 * gamma
                                                                               + 8),
                               device=str(device), dtype=target.dtype, kernel_backend=args.kernel_backend,
                               seed=args.seed, batch_invariant=setting == "invariant")
            sched = SchedulerConfig(mode=mode) if k is None else SchedulerConfig(mode=mode, k=k)
            engine = Engine(target, drafter if mode.drafts else None, cfg, sched, cost)
            if mode.needs_cost_table and cost is None:
                engine.set_cost_table(cached_profile(engine.runner, cache_dir=args.cost_cache_dir,
                                                     context_len=args.context_len))
            plain_first = None
            for b in batch_sizes:
                run_batches(engine, prompts[:b], b, min(8, args.max_new_tokens))  # untimed: compiles the shapes
                tokens, seconds = run_batches(engine, prompts, b, args.max_new_tokens)
                tokens_per_s[(setting, b, mode_name)] = sum(map(len, tokens)) / seconds
                row = {"setting": setting, "mode": mode_name, "batch_size": b, "prompts": len(prompts),
                       "max_new_tokens": args.max_new_tokens, "tokens_per_s": round(tokens_per_s[(setting, b,
                                                                                                  mode_name)], 1)}
                if mode_name == "none":
                    plain = report.setdefault("_plain", {})
                    plain[(setting, b)] = tokens
                    plain_first = plain_first or (b, tokens)
                    against, label = plain_first[1], f"none at batch {plain_first[0]}"
                else:
                    against, label = report["_plain"][(setting, b)], f"none at batch {b}"
                diffs = [first_difference(t, ref) for t, ref in zip(tokens, against)]
                row.update(against=label, identical=sum(d is None for d in diffs),
                           first_difference=sorted(d for d in diffs if d is not None))
                report["results"].append(row)
                log.info("%-9s %-9s B=%-3d identical %d/%d against %s, %.0f tokens/s", setting, mode_name, b,
                         row["identical"], len(prompts), label, row["tokens_per_s"])
            del engine
            _save(report, out)
    if set(SETTINGS) <= set(settings):
        report["throughput_ratio"] = [
            {"batch_size": b, "mode": m,
             "invariant_over_default": round(tokens_per_s[("invariant", b, m)] / tokens_per_s[("default", b, m)], 3)}
            for b in batch_sizes for m in modes]
    _save(report, out)
    log.info("wrote %s", out)
    return {k: v for k, v in report.items() if k != "_plain"}


def _save(report: dict[str, Any], out: Path) -> None:
    out.write_text(json.dumps({k: v for k, v in report.items() if k != "_plain"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
