"""``python -m scripts.gpu_equivalence``: ``reference.generate`` against the engine with CUDA graphs, token for token.

Level 3 of the equivalence contract on CUDA. For every scheduler mode (``none``, ``fixed`` with K = 3 and K = γ,
``dsd``, ``threshold``, ``adaptive-sync``, ``adaptive``, ``oracle``) and every temperature, both loops decode the
same prompts with the same target, drafter, seed and cost table, and every request is compared: emitted token ids,
per-step accepted lengths and per-step verify lengths. How a difference is explained (decision margins, near-ties,
batch coupling) is the library's docstring, ``scripts/equivalence.py``. Names follow ``docs/method.md`` (``p_t``
target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size).

The same setup on both sides:

* the engine runs with CUDA graphs (``enforce_eager=False``; ``--enforce-eager`` runs the same comparison
  without them) and ``kernel_backend="auto"``, i.e. its Triton kernels on CUDA;
* ONE fixed cost table for both loops: the synthetic affine table of ``tests/equivalence/test_end_to_end.py``
  (5 ms + 0.3 ms per verified token). A profiled table would differ between the two loops and between runs, and
  the adaptive policies decide from it, so only a fixed table makes their decisions comparable and the result
  reproducible;
* float32 with TF32 off by default (``--dtype bfloat16`` is allowed; expect near-ties there);
* all prompts form one batch that is prefilled in one engine step, so both loops step in lockstep and the
  batch-coupled policies (``dsd``, ``adaptive-sync``, ``adaptive``) see the same requests every step.

A request whose tokens and per-step lengths are all equal is ``identical``; any other is a ``near-tie`` (its smallest
decision margin lies below ``--tie-threshold``) or a ``MISMATCH`` (exit status 1). Every result row also reports the
target's logits at the first differing token (common prefix recomputed in float32): ``logit_gap = |l(a) − l(b)|``
between the two chosen tokens and ``top2_gap``. At T > 0 the tokens come from exponential races and accept tests, so
that logit gap is information only: the decision margin is ``gap``.

The JSON (rewritten after every mode and temperature, so a run cut off by a time limit keeps its results) holds the
hardware, command, model, drafter, dtype, graphs, kernel backend, the cost table, one row per request and
configuration, per-configuration wall times and CUDA-graph replay counts, and a summary by status and mode.

A configuration that crashes (either loop) is recorded with its traceback and the run goes on; the exit status is
then 1 as well.

Example (H200; ``--time-budget-s`` stops cleanly before a time limit)::

    python -m scripts.gpu_equivalence --model /tmp/stage/target.gguf --device cuda --time-budget-s 500 \\
        --json docs/benchmarks/gpu-equivalence.json

On a CPU, in seconds: ``python -m scripts.gpu_equivalence --tiny --device cpu`` (a tiny random Llama target and
drafter, built like the CPU equivalence suite's).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from optimized.kernels.common import resolve_backend
from reference.checkpoint import load_drafter, read_drafter_config
from reference.cli import DEFAULT_DRAFTER, LOG_FORMAT, load_or_init_drafter, read_domain_prompts
from reference.config import SchedulerConfig
from reference.cost_model import CostTable, hardware_name
from reference.drafter import DSparkDrafter
from reference.target import DEFAULT_TARGET, Target
from scripts.equivalence import (
    COST_FIXED_MS,
    COST_PER_TOKEN_MS,
    DTYPES,
    TIE_THRESHOLD,
    TINY_DSD_TABLE,
    TINY_MAX_NEW_TOKENS,
    TINY_THRESHOLD,
    RunSettings,
    full_precision,
    load_tiny,
    parse_modes,
    run_config,
    summarise,
)

log = logging.getLogger("dspark.gpu_equivalence")

ROOT = Path(__file__).resolve().parent.parent
# "fixed" alone is K = γ. The paper's policy runs early, so a run stopped by --time-budget-s still has it.
DEFAULT_MODES = "fixed:3,adaptive,none,fixed,dsd,threshold,adaptive-sync,oracle"
DEFAULT_PROMPTS = ROOT / "docs" / "benchmarks" / "eval_prompts_small.jsonl"
# The first 152-step drafter's first-slot survivals lay around 0.1-0.3 (τ ≈ 1.23): on three of the small eval prompts
# (CPU, float32, 24 tokens) 0.1 gave a mix of ℓ = 0, 1 and 2, the CLI's 0.5 almost only 0. Kept for comparability.
DEFAULT_THRESHOLD = 0.1
DEFAULT_MAX_NEW_TOKENS = 64


def _in_repo(path: str | Path) -> str:
    """``path`` relative to the repository when it lies inside it (the JSON is committed; machines differ)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def load_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    drafter_dir = args.drafter or (str(DEFAULT_DRAFTER) if DEFAULT_DRAFTER.exists() else None)
    layer_ids = read_drafter_config(drafter_dir).target_layer_ids if drafter_dir else None
    target = Target.load(args.model, layer_ids=layer_ids, device=device, dtype=dtype)
    if drafter_dir:
        drafter = load_drafter(drafter_dir, target, device=device, dtype=dtype)
    else:
        drafter = load_or_init_drafter(None, target, None, args.seed)  # warns loudly: random drafter
    prompts = read_domain_prompts(args.prompts_file, target, chat_template=not args.no_chat_template,
                                  limit=args.limit)
    return target, drafter, prompts, args.model, _in_repo(drafter_dir) if drafter_dir else "random init (no checkpoint)"


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'mode':<14} {'T':>4} {'identical':>9} {'near-tie':>8} {'MISMATCH':>8} {'τ':>6} {'graph runs':>11} "
          f"{'ref s':>7} {'opt s':>7}")
    for c in report["configs"]:
        if "error" in c:
            print(f"{c['label']:<14} {c['temperature']:>4g} ERROR {c['error']}")
            continue
        runs = c["graph_runs"]
        graph = sum(v["graph"] for v in runs.values())
        total = graph + sum(v["eager"] for v in runs.values())
        tau = f"{c['mean_accepted_length']:.2f}" if c["mean_accepted_length"] is not None else "-"
        n = c["counts"]
        print(f"{c['label']:<14} {c['temperature']:>4g} {n['identical']:>9} {n['near-tie']:>8} {n['MISMATCH']:>8} "
              f"{tau:>6} {f'{graph}/{total}':>11} {c['reference_s']:>7.1f} {c['optimized_s']:>7.1f}")
    for r in report["results"]:
        if r["status"] != "identical":
            gap = f"{r['gap']:.3g}" if r.get("gap") is not None else "-"
            print(f"  {r['status']}: {r['label']} T={r['temperature']:g} prompt {r['prompt_index']}: "
                  f"step {r['first_step']} ({r['cause']}), token {r['first_divergence']}, gap {gap} "
                  f"[{r.get('gap_source')}]" + (f", via prompt {r['explained_by']['prompt_index']}"
                                                if r.get("explained_by") else ""))
    counts = report["summary"]["counts"]
    errors = report["summary"].get("errors", 0)
    print(f"\n{counts['identical']} identical, {counts['near-tie']} near-tie, {counts['MISMATCH']} MISMATCH"
          + (f", {errors} configuration(s) FAILED" if errors else "")
          + f" ({'complete' if report['complete'] else 'INCOMPLETE'}; {report['wall_s']:.0f} s)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_equivalence", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: 'smollm2-135m-instruct', a .gguf or an HF dir")
    p.add_argument("--drafter", default=None,
                   help=f"drafter checkpoint directory (default {DEFAULT_DRAFTER} if it exists, else a random one)")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), help='JSONL, {"prompt": ..., "domain": ...}')
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens per request (default {DEFAULT_MAX_NEW_TOKENS}; {TINY_MAX_NEW_TOKENS} with --tiny)")
    p.add_argument("--stop-at-eos", action="store_true", help="finish requests at EOS (default: ignore EOS, so "
                   "every request decodes --max-new-tokens and the whole length is compared)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations of both loops")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma list; fixed:K, or fixed alone for K = γ")
    p.add_argument("--temperatures", default="0,1", help="comma list")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter of the target at T > 0")
    p.add_argument("--threshold", type=float, default=None,
                   help=f"mode threshold (default {DEFAULT_THRESHOLD}; {TINY_THRESHOLD} with --tiny)")
    p.add_argument("--seed", type=int, default=0, help="generation seed (random-number contract)")
    p.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine's target on its row-invariant kernels (EngineConfig.batch_invariant; Triton)")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="engine ops: auto = Triton on CUDA (or under TRITON_INTERPRET=1), else torch")
    p.add_argument("--tie-threshold", type=float, default=None,
                   help="largest margin (log units) accepted as a near-tie (default: 1e-3 float32, 0.25 bfloat16)")
    p.add_argument("--json", default=None, help="output JSON file, rewritten after every configuration")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new configuration after this many seconds (the JSON then says complete: false)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random target + drafter of the CPU equivalence suite instead of --model/--drafter")
    p.add_argument("--tiny-family", default="llama", choices=["llama", "qwen3"], help="target family with --tiny")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    t_start = time.perf_counter()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.max_new_tokens is None:
        args.max_new_tokens = TINY_MAX_NEW_TOKENS if args.tiny else DEFAULT_MAX_NEW_TOKENS
    if args.threshold is None:
        args.threshold = TINY_THRESHOLD if args.tiny else DEFAULT_THRESHOLD
    args.dsd_table = dict(TINY_DSD_TABLE) if args.tiny else SchedulerConfig().dsd_table
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    settings = RunSettings(max_new_tokens=args.max_new_tokens, top_p=args.top_p, seed=args.seed,
                           stop_at_eos=args.stop_at_eos, threshold=args.threshold, dsd_table=args.dsd_table,
                           enforce_eager=args.enforce_eager, kernel_backend=args.kernel_backend,
                           batch_invariant=args.batch_invariant)
    tie_threshold = args.tie_threshold if args.tie_threshold is not None else TIE_THRESHOLD[args.dtype]
    if device.type == "cuda" and dtype == torch.float32:
        # TF32 would round matmul inputs to 10 mantissa bits, differently in cuBLAS and in the Triton kernels.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

    if args.tiny:
        if device.type == "cpu":
            torch.set_num_threads(1)  # tiny matmuls run faster on one thread (tests/conftest.py, one_thread)
        target, drafter, prompts, model_name, drafter_name = load_tiny(args.tiny_family, device, dtype)
    else:
        target, drafter, prompts, model_name, drafter_name = load_models(args, device, dtype)
    if args.limit is not None:
        prompts = prompts[:args.limit]
    gamma = drafter.config.block_size
    specs = parse_modes(args.modes, gamma)
    cost = CostTable.affine(COST_FIXED_MS, COST_PER_TOKEN_MS, sizes=range(1, len(prompts) * (gamma + 1) + 1))
    replay_cache: list[tuple[Target, DSparkDrafter]] = []

    def replay_models():
        if not replay_cache:
            replay_cache.append(full_precision(target, drafter))
        return replay_cache[0]

    graphs = device.type == "cuda" and not args.enforce_eager
    report: dict[str, Any] = {
        "hardware": hardware_name(device),
        "command": "python -m scripts.gpu_equivalence " + shlex.join(argv),
        "model": model_name, "drafter": drafter_name, "gamma": gamma, "dtype": args.dtype, "device": str(device),
        "graphs": graphs, "kernel_backend": resolve_backend(args.kernel_backend, torch.empty(0, device=device)),
        "batch_invariant": args.batch_invariant,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
        "cost_table": {"choice": "one fixed synthetic affine table for both loops (the CPU e2e test's), for "
                                 "determinism: a profiled table differs between loops and runs",
                       **cost.to_dict()},
        "tie_threshold": tie_threshold,
        "settings": {"max_new_tokens": args.max_new_tokens, "temperatures": temperatures, "top_p": args.top_p,
                     "seed": args.seed, "ignore_eos": not args.stop_at_eos, "threshold": args.threshold,
                     "dsd_table": {str(k): v for k, v in args.dsd_table.items()}, "modes": [s.label for s in specs],
                     "prompts": len(prompts), "prompts_file": None if args.tiny else _in_repo(args.prompts_file),
                     "chat_template": not args.no_chat_template},
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "complete": False, "configs": [], "results": [], "summary": summarise([]), "wall_s": 0.0,
    }
    out = Path(args.json) if args.json else None
    log.info("%d prompts, γ = %d, %s on %s, graphs %s, kernels %s, modes %s, T %s", len(prompts), gamma,
             args.dtype, device, graphs, report["kernel_backend"], ",".join(s.label for s in specs), temperatures)

    configs = [(spec, t) for spec in specs for t in temperatures]
    for spec, temperature in tqdm(configs, desc="equivalence", unit="config"):
        if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
            log.warning("time budget of %.0f s spent: stopping before %s T=%g", args.time_budget_s, spec.label,
                        temperature)
            break
        try:
            rows, info = run_config(target, drafter, prompts, spec, temperature, settings, cost, tie_threshold,
                                    replay_models)
        except Exception as e:  # a one-shot run records every configuration's outcome, a crash included
            log.exception("%s T=%g failed", spec.label, temperature)
            rows, info = [], {"label": spec.label, "mode": spec.mode, "k": spec.k, "temperature": temperature,
                              "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["results"] += rows
        report["configs"].append(info)
        report["summary"] = summarise(report["results"])
        report["summary"]["errors"] = sum("error" in c for c in report["configs"])
        report["complete"] = len(report["configs"]) == len(configs)
        report["wall_s"] = round(time.perf_counter() - t_start, 1)
        if "error" not in info:
            log.info("%s T=%g: %s; τ %s; reference %.1f s, engine %.1f s; graph runs %s", spec.label, temperature,
                     ", ".join(f"{v} {k}" for k, v in info["counts"].items()), info["mean_accepted_length"],
                     info["reference_s"], info["optimized_s"], info["graph_runs"])
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")
        gc.collect()  # the configuration's engine (caches, graph pool) goes before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(report)
    if not report["complete"]:
        log.warning("INCOMPLETE: %d of %d configurations ran", len(report["configs"]), len(configs))
    return 1 if report["summary"]["counts"]["MISMATCH"] or report["summary"].get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
