"""Benchmark: supervised slot predictions per second of the fast training step against the reference step.

Both steps train the same drafter on the same batches of self-distilled data, target forward included
(docs/method.md §2):

* **reference** (the baseline, the project's earlier trainer): ``--anchors-per-seq`` random anchors per sequence
  (``reference.losses.sample_anchors``), the packed forward under the dense block mask
  (``DSparkDrafter.forward``), ``head_logits`` materialising ``[B, nb, γ, V]`` float32 logits, the target logits
  gathered per slot in float32, ``reference.losses.dspark_loss``;
* **fast-torch**: every response position an anchor, ``optimized.training.dense_step_loss`` (two-part attention,
  fused LM head + loss, each target row's softmax shared by its γ slots) with the loss's per-row work in torch
  and over every target row, prompt and padding included;
* **fast** (the trainer's step): the same, with the per-row work in one Triton kernel on a GPU
  (``optimized.kernels.distill_loss``) and only the target rows that teach a slot;
* **fast-flex** (GPU only, not in the default list): ``fast`` with the backbone's block attention as one compiled
  FlexAttention call (``dense_backbone(attention="flex")``) instead of the materialised two-part scores.

A supervised slot prediction is one valid (block, slot) pair that the loss scores. The report gives each
step's median time over ``--repeats`` timed steps (after ``--warmup``), slot predictions per step and per
second, peak memory, and the ratios fast / reference and fast / fast-torch. JSON to ``--json`` (default
``docs/benchmarks/training-<device>.json``) and a bar plot beside it.

    python -m scripts.bench_training --data data/train --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from optimized.training import dense_step_loss
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter
from reference.losses import LossWeights, dspark_loss
from reference.target import DEFAULT_TARGET, Target
from scripts.dataset import TokenData, collate, load_dataset, pack_blocks, token_budget_batches
from scripts.runtime import hardware, resolve_device

log = logging.getLogger("dspark.bench_training")

STEPS = ("reference", "fast-torch", "fast", "fast-flex")


def reference_step(drafter: DSparkDrafter, target: Target, data: TokenData, idx: list[int], anchors: int,
                   weights: LossWeights, gen: torch.Generator) -> torch.Tensor:
    """The sparse-anchor step: returns the loss (backward done) and the number of supervised slots."""
    device = data.device
    batch = collate([_example(data, i) for i in idx], max(data.lengths[i] for i in idx))
    blocks = pack_blocks(batch, anchors, drafter.config.block_size, gen).to(device)
    ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
    logits_t, features = target.forward_batch(ids, attn.long())  # [B, S, V] float32
    B, S = ids.shape
    with _autocast(device):
        ctx = torch.arange(S, device=device).expand(B, S)
        h = drafter(blocks.anchor_ids, blocks.anchor_pos, features, ctx, attn)  # [B, nb, γ, d]
        draft, conf = drafter.head_logits(h, blocks.prev_tokens)  # [B, nb, γ, V] float32
    p_t = logits_t[torch.arange(B, device=device)[:, None, None], blocks.target_pos]  # [B, nb, γ, V]
    del logits_t
    out = dspark_loss(draft.flatten(0, 1), p_t.flatten(0, 1), blocks.labels.flatten(0, 1), conf.flatten(0, 1),
                      blocks.valid.flatten(0, 1), weights=weights)
    out["loss"].backward()
    return blocks.valid.sum()


def fast_step(drafter: DSparkDrafter, target: Target, data: TokenData, idx: list[int],
              weights: LossWeights, variant: str = "fast") -> torch.Tensor:
    """The trainer's step; ``variant`` "fast-torch" is it as it was before the per-row kernel and the row
    selection (every target row, the torch per-row work): the same-run baseline of those two changes."""
    b = data.batch(idx)
    logits_t, features = target.forward_batch(b.input_ids, b.attention_mask.long(), float_logits=False)
    old = variant == "fast-torch"
    with _autocast(data.device):
        out = dense_step_loss(drafter, b.input_ids, b.loss_mask, b.attention_mask, features, logits_t,
                              weights=weights, num_rows=None if old else b.num_teacher_rows,
                              backend="torch" if old else "auto",
                              attention="flex" if variant == "fast-flex" else "auto")
    out.loss.backward()
    return out.slot_stats[:, 0].sum()


def _example(data: TokenData, i: int):
    from scripts.dataset import Example

    a, n = int(data.starts[i]), data.lengths[i]
    return Example(str(i), data.tokens[a:a + n].long().cpu(), data.loss_mask[a:a + n].cpu())


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, step, batches, device: torch.device, warmup: int, repeats: int) -> dict:
    times, slots = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        n = step(batches[i % len(batches)])
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            slots.append(int(n))  # sync: after timing
    med = statistics.median(times)
    per_step = statistics.median(slots)
    rec = {"step": name, "median_step_s": med, "slot_predictions_per_step": per_step,
           "slot_predictions_per_s": sum(slots) / sum(times), "repeats": repeats,
           "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None}
    log.info("%s: %.1f ms per step, %.0f slot predictions per step, %.0f per second", name, med * 1e3, per_step,
             rec["slot_predictions_per_s"])
    return rec


def profile(step, batches, device: torch.device, path: Path, steps: int = 3) -> None:
    """Operator table of ``steps`` training steps (torch.profiler), sorted by device time, written to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} fast training steps on {hardware(device)}\n"
                    + prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70) + "\n")
    log.info("profile of %d fast steps written to %s", steps, path)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="self-distilled data (scripts/make_dataset.py --out)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: name, .gguf file or HF directory")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    p.add_argument("--tokens-per-batch", type=int, default=16384,
                   help="padded tokens per training step (default: %(default)s)")
    p.add_argument("--anchors-per-seq", type=int, default=32, help="the reference step's anchors per sequence")
    p.add_argument("--num-layers", type=int, default=2, help="drafter backbone depth (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed steps per variant (the median is reported) (default: %(default)s)")
    p.add_argument("--limit", type=int, default=4096, help="sequences loaded")
    p.add_argument("--json", default=None, help="write the results as JSON to this path (default: %(default)s)")
    p.add_argument("--steps", default="reference,fast-torch,fast",
                   help="which steps to time: reference (sparse anchors), fast-torch (every anchor, per-row loss work "
                        "in torch on every row), fast (the trainer's step), fast-flex (it with FlexAttention in the "
                        "backbone; GPU only)")
    p.add_argument("--profile", default=None,
                   help="also profile 3 fast steps (torch.profiler) and write the operator table to this file")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = Target.load(args.model, device=device, dtype=dtype)
    data = TokenData(load_dataset(args.data, limit=args.limit), 1024, device)
    batches = token_budget_batches(data.lengths, args.tokens_per_batch, seed=0, epoch=0)
    names = [n for n in args.steps.split(",") if n]
    if not names or any(n not in STEPS for n in names):
        raise SystemExit(f"--steps takes a comma-separated list of {', '.join(STEPS)}; got {args.steps!r}")
    results = []
    for name in names:
        torch.manual_seed(0)
        fast = name.startswith("fast")
        cfg = DrafterConfig.from_target_config(target.config, num_layers=args.num_layers, head="markov",
                                               markov_factored=fast, qk_norm=True, target_layer_ids=target.layer_ids)
        drafter = DSparkDrafter(cfg).to(device)
        drafter.attach_target(target.embed_tokens, target.lm_head)
        gen = torch.Generator().manual_seed(0)
        if fast:
            step = lambda idx, d=drafter, v=name: fast_step(d, target, data, idx,  # noqa: E731
                                                            LossWeights(0.0, 0.0, 1.0, 1.0), v)
        else:
            step = lambda idx, d=drafter, g=gen: reference_step(d, target, data, idx, args.anchors_per_seq,  # noqa: E731
                                                         LossWeights(), g)
        results.append(measure(name, step, batches, device, args.warmup, args.repeats))
        if name == "fast" and args.profile:
            profile(step, batches, device, Path(args.profile))
        del drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by_name = {r["step"]: r["slot_predictions_per_s"] for r in results}
    ratio = by_name["fast"] / by_name["reference"] if {"fast", "reference"} <= by_name.keys() else None
    ratios = {f"{a}/{b}": by_name[a] / by_name[b] for a in by_name for b in by_name
              if a != b and (a == "fast" or (a == "fast-flex" and b == "fast"))}
    for k, v in ratios.items():
        log.info("%s: %.2fx supervised slot predictions per second", k, v)
    report = {"benchmark": "training step, supervised slot predictions per second", "hardware": hardware(device),
              "torch": torch.__version__, "model": Path(args.model).name, "tokens_per_batch": args.tokens_per_batch,
              "gamma": 7, "command": " ".join(["python -m scripts.bench_training", *(argv or sys.argv[1:])]),
              "results": results, "speedup": ratio, "ratios": ratios}
    out = Path(args.json or f"docs/benchmarks/training-{'h200' if device.type == 'cuda' else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar([r["step"] for r in results], [r["slot_predictions_per_s"] / 1e3 for r in results],
               color=[{"reference": "#999", "fast-torch": "#9fa8da"}.get(r["step"], "#3949ab") for r in results])
        ax.set_ylabel("supervised slot predictions / s (thousands)")
        ax.set_title(f"training step on {report['hardware']}" + (f": {ratio:.1f}x" if ratio else ""))
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        log.warning("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
