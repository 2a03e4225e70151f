"""What the benchmark and profiling scripts (``scripts.bench_engine``, ``scripts.profile_engine``,
``scripts.bench_kernels``) share: the flags that choose prompts, device, dtype and graphs, the prompts those flags
select, the ``[ngram:|hybrid:]mode[:K]`` spelling of a configuration, seeded request lengths, a device barrier for
timing and the device tag of output files; and the flags and models of the scripts that study a drafter's drafts
(``scripts.replay_budget``, ``scripts.check_finish_estimate``). A library: no command line here.

Names follow ``docs/method.md`` (``ℓ`` verify length, ``γ`` block size).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from optimized.config import EngineConfig
from optimized.kernels import linear
from reference.cli import DEFAULT_DRAFTER, load_or_init_drafter
from reference.config import SCHEDULER_MODES, NgramConfig, ProposerKind, SchedulingMode
from reference.drafter import DSparkDrafter
from reference.hybrid import check_mode as check_hybrid_mode
from reference.ngram import check_mode
from reference.target import Target


def parse_mode(spec: str, gamma: int | None) -> tuple[SchedulingMode, int | None]:
    """``"fixed:3"`` -> (FIXED, 3); ``"adaptive"`` -> (ADAPTIVE, None); ``"adaptive:nogate"`` -> (ADAPTIVE, None)
    with the draft gate off (the paper's adaptive mode, which drafts every step), ``"adaptive:finish"`` -> (ADAPTIVE,
    None) with the finish-time gate (``EngineConfig.finish_time_gate``; the caller reads the label of both). Fixed
    without K verifies the whole block (K = γ). Unknown modes, the simulation-only ``oracle`` and K > γ fail."""
    if spec in ("adaptive:nogate", "adaptive:finish"):
        return SchedulingMode.ADAPTIVE, None
    name, _, k = spec.partition(":")
    if name not in SCHEDULER_MODES or name == SchedulingMode.ORACLE:
        raise ValueError(f"unknown benchmark mode {spec!r}; choose none, fixed:K, dsd, threshold, adaptive-sync, "
                         "adaptive")
    mode = SchedulingMode(name)
    if k and mode is not SchedulingMode.FIXED:
        raise ValueError(f"mode {spec!r}: only fixed takes a K")
    if not k:
        return mode, (gamma if mode is SchedulingMode.FIXED else None)
    if not k.isdigit() or int(k) < 1 or (gamma is not None and int(k) > gamma):
        raise ValueError(f"mode {spec!r}: K must be an integer in 1..γ{'' if gamma is None else f' = {gamma}'}")
    return mode, int(k)


def parse_config(spec: str, gamma: int | None, ngram_gamma: int = NgramConfig.gamma
                 ) -> tuple[ProposerKind, SchedulingMode, int | None]:
    """A configuration with its drafter kind: ``"fixed:3"`` -> (DSPARK, FIXED, 3), the modes of :func:`parse_mode`
    drafted by the DSpark drafter (block ``gamma``); ``"ngram:fixed:3"`` -> (NGRAM, FIXED, 3), the n-gram proposer
    (block ``ngram_gamma``), which runs ``fixed[:K]`` and ``dsd`` only (it has no confidences); ``"hybrid:adaptive"``
    -> (HYBRID, ADAPTIVE, None), the hybrid of the drafter and the lookup (``reference/hybrid.py``, block ``gamma``),
    which runs the drafter's modes."""
    kind, sep, rest = spec.partition(":")
    if kind == ProposerKind.HYBRID:
        mode, k = parse_mode(rest, gamma)
        if not mode.drafts:
            raise ValueError(f"mode {spec!r}: the hybrid proposer drafts; plain decoding is mode 'none'")
        check_hybrid_mode(mode)
        return ProposerKind.HYBRID, mode, k
    if kind != ProposerKind.NGRAM:
        return (ProposerKind.DSPARK, *parse_mode(spec, gamma))
    mode, k = parse_mode(rest, ngram_gamma)
    if not mode.drafts:
        raise ValueError(f"mode {spec!r}: the n-gram proposer drafts; plain decoding is mode 'none'")
    check_mode(mode)
    return ProposerKind.NGRAM, mode, k


def add_engine_source_args(p: argparse.ArgumentParser) -> None:
    """Prompts, device, dtype, graphs and layer ops: the flags both engine scripts take."""
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="drop longer prompts (after the template)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts-file", default=None, help='JSONL, one {"prompt": ...} per line')
    src.add_argument("--sharegpt-file", default=None, help="ShareGPT .json(.gz) (default: the packaged file)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                   help="where the engine runs (cuda when a GPU is present)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (EngineConfig.enforce_eager)")
    p.add_argument("--prefill-graph-tokens", type=int, default=EngineConfig.prefill_graph_tokens,
                   help="longest prefill step that replays a CUDA graph (0: every prefill eager, to measure them)")
    p.add_argument("--layer-backend", default=None, choices=["auto", "triton", "torch"],
                   help="element-wise layer ops (RMSNorm, RoPE+append, SiLU): default the kernel backend (fused Triton "
                        "on CUDA); torch = the unfused ops, to measure the fusion")
    p.add_argument("--linear-rows", type=int, default=None,
                   help="steps of at most this many tokens run the fused small-batch projections "
                        "(optimized/kernels/linear.py; default its FUSED_MAX_ROWS); 0 = cuBLAS always, to measure them")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every kernel on one tile shape at every step size (EngineConfig.batch_invariant): exact "
                        "greedy tokens in bfloat16, at some speed")


def add_drafted_decode_args(p: argparse.ArgumentParser, *, max_prompt_tokens: int) -> None:
    """Target, drafter, answer length, prompts and device: the flags of the scripts that decode held-out prompts with
    a drafter to study its drafts (``scripts.replay_budget``, ``scripts.check_finish_estimate``); the CPU in float32 by
    default, since the drafts do not depend on the hardware's speed. :func:`load_drafted_models` loads what they
    name."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="target: name, .gguf or HF directory")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter checkpoint")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (EOS ignored)")
    p.add_argument("--max-prompt-tokens", type=int, default=max_prompt_tokens,
                   help="drop longer prompts (after the template)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts-file", default=None, help='JSONL, one {"prompt": ...} per line')
    src.add_argument("--sharegpt-file", default=None, help="ShareGPT .json(.gz) (default: the packaged file)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine runs")


def load_drafted_models(args: argparse.Namespace, target: Target | None = None,
                        drafter: DSparkDrafter | None = None) -> tuple[Target, DSparkDrafter, torch.dtype]:
    """The target and drafter :func:`add_drafted_decode_args` names (``target``/``drafter`` given: those, as tests
    pass them), the drafter on the target's device and dtype: bfloat16 on CUDA, float32 on the CPU."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if target is None:
        target = Target.load(args.model, device=args.device, dtype=dtype)
    if drafter is None:
        drafter = load_or_init_drafter(args.drafter, target)
    return target, drafter.to(device=args.device, dtype=dtype), dtype


def load_prompts(args: argparse.Namespace, target: Target, needed: int) -> list[list[int]]:
    """Tokenised prompts (chat template) from --prompts-file, else held-out ShareGPT; too-long ones are dropped."""
    from scripts import data  # the dataset helpers (ShareGPT parsing, the held-out split)

    if args.prompts_file:
        texts = [p.prompt for p in data.read_prompt_file(args.prompts_file)]
    else:
        _, held = data.split(data.load_sharegpt(args.sharegpt_file))
        texts = [p.prompt for p in data.filter_prompts(held, max_chars=4 * args.max_prompt_tokens)]
    prompts = []
    for text in texts:
        ids = target.encode(text, chat_template=True)
        if 0 < len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) >= needed:
            break
    if not prompts:
        raise SystemExit(f"no prompt fits --max-prompt-tokens {args.max_prompt_tokens}")
    return prompts


def request_lengths(n: int, max_new_tokens: int, spread: float, seed: int) -> list[int]:
    """Output length of each of ``n`` requests: ``max_new_tokens`` each (spread 0), or drawn uniformly in
    ``[(1 - spread) · max_new_tokens, max_new_tokens]`` from ``seed``, the same for every mode of a run."""
    if spread == 0:
        return [max_new_tokens] * n
    g = torch.Generator().manual_seed(seed)
    low = max(1, math.ceil((1 - spread) * max_new_tokens))
    return torch.randint(low, max_new_tokens + 1, (n,), generator=g).tolist()


def sync(device: torch.device) -> None:
    """Wait for the device (timing only: never inside the engine's step loop)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: benchmark timing, around whole runs or steps


def default_tag(device: torch.device) -> str:
    """``h200`` on an H200, the lower-cased GPU name elsewhere, ``cpu`` on the CPU (names the output files)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for short in ("h200", "h100", "b300", "b200", "a100"):
        if short in name:
            return short
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def save_plot(plot: Callable[[dict[str, Any], Path], None], report: dict[str, Any], path: Path,
              log: logging.Logger) -> None:
    """Draw ``report`` to ``path`` with ``plot``; a plot never costs the measured numbers (already written)."""
    try:
        plot(report, path)
    except ImportError:
        log.info("matplotlib is not installed: no plot")
    except Exception as e:
        log.warning("plotting failed: %s", e)


def dot_tiles_from_file(path: str) -> dict:
    """The tl.dot tile table in ``path``: a DOT_TILES table itself, or a ``bench_linear --sweep`` report's first
    proposed one (a ValueError if it has none)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "sweep" in data:  # a bench_linear report
        proposals = data.get("proposed_dot_tiles") or []
        if not proposals:
            raise ValueError(f"{path} is a bench_linear report without a proposed tl.dot table (run it with --sweep)")
        data = proposals[0]["table"]
    return linear.check_dot_tiles(data)
