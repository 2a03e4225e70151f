"""Train a DSpark drafter on self-distilled data (docs/method.md §2), on one GPU, several (torchrun) or a CPU.

Names follow docs/method.md: ``p_t`` target, ``p_d`` draft, γ the block size, ``x_0`` the anchor.

One optimisation step, per rank::

    batch      right-padded self-distilled sequences, ≤ --tokens-per-batch padded tokens, gathered on the device
    target     one forward, no grad (bf16 on CUDA)            -> p_t logits [B, S, V] (bf16), features [B, S, m·d]
    drafter    every response position is an anchor (optimized.training.dense_backbone) -> h [B, S, γ, d]
    loss       optimized.training.fused_head_loss: the LM head and the loss fused in row chunks, each target row's
               softmax computed once for the γ slots it teaches; --loss-weights ce,l1,conf[,kl]
    update     AdamW (fused on CUDA), clip --clip, --warmup-frac linear warm-up then cosine to 0

The step is the twin of the reference's (``reference.drafter`` forward + ``reference.losses.dspark_loss`` over
``dense_block_targets``): ``tests/equivalence/test_training.py`` checks the loss and every gradient.
``scripts/bench_training.py`` measures it against the sparse-anchor reference step in supervised slot
predictions per second.

Loss recipe. The default, ``--loss-weights 0,0,1,1`` (KL to the target distribution + the confidence BCE),
differs from the paper's ``0.1,0.9,1.0`` (CE + L1): the L1 term's gradient vanishes while ``p_d`` is small
(docs/method.md §2). ``--l1-ramp F`` adds the paper's L1 term from fraction ``F`` of the schedule on, ramped
linearly to its weight, for a drafter that is then tuned for T = 1 acceptance.

Resuming. Rerunning the same command resumes from ``OUT/_state`` (safetensors weights and optimizer moments,
JSON step count and RNG). Across machines, where only the shipped checkpoint travels (bf16 shards ≤ 15 MB),
``--init-from DIR`` starts from its weights and its recorded step, so one learning-rate schedule spans
several runs on different machines; the AdamW moments restart from zero, and ``--rewarm-steps`` ramps the learning rate
back up over a few steps while they refill. ``--time-budget-min`` then counts this invocation's training (a
resumed ``OUT/_state`` counts the time already spent, since it continues one invocation), and
``--anneal-frac F`` decays the learning rate to 0 over the last fraction ``F`` of that budget, so a run that ends
mid-schedule still ships an annealed drafter (a warm-stable-decay schedule: the next run re-warms and continues
the cosine underneath from the recorded step). ``--init-schedule restart`` instead starts a new schedule of
``--steps`` from the checkpoint's weights (step 0, the usual warm-up): a deepened drafter's own schedule, say, once
the one it came from has ended.

Output in ``--out``: the drafter (``reference.checkpoint`` format, shards ≤ 15 MB) with a README.md,
``metrics.jsonl`` (one JSON object per log/eval event) and ``summary.json``.

Examples::

    python -m scripts.train_drafter --data data/train --eval-data data/heldout --out runs/dspark --steps 20000
    torchrun --nproc-per-node 8 -m scripts.train_drafter --data ... --out ...     # data parallel
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from optimized.training import STAT_NAMES, dense_step_loss, weight_sum
from reference.checkpoint import WEIGHT_FORMATS, load_drafter, save_drafter
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter
from reference.losses import LossWeights, dense_block_targets
from reference.target import DEFAULT_TARGET, Target
from scripts.dataset import (
    MANIFEST,
    TokenData,
    batch_stream,
    example_temperature,
    generation_temperatures,
    load_dataset,
    token_budget_batches,
)
from scripts.runtime import hardware, resolve_device

log = logging.getLogger("dspark.train")

STATE_DIR = "_state"
# Arguments that define the model being trained: a resumed run must not change them.
ARCH_ARGS = ("head", "num_layers", "markov_rank", "markov_factored", "qk_norm", "gamma", "model", "loss_weights",
             "decay", "steps", "seed")


# --------------------------------------------------------------------------- schedule, state


def cosine_decay(progress: float) -> float:
    """From 1 at ``progress`` 0 to 0 at 1 along a half cosine (clamped to [0, 1])."""
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0 at ``total`` (docs/method.md §2)."""
    if step < warmup:
        return (step + 1) / warmup
    return cosine_decay((step - warmup) / max(1, total - warmup))


def anneal_factor(frac: float, anneal_frac: float) -> float:
    """1 until fraction ``1 - anneal_frac`` of the time budget, then a cosine to 0 at its end."""
    if anneal_frac <= 0 or frac <= 1.0 - anneal_frac:
        return 1.0
    return cosine_decay((frac - (1.0 - anneal_frac)) / anneal_frac)


def loss_weights_at(base: LossWeights, progress: float, l1_ramp: float | None, l1_weight: float) -> LossWeights:
    """``base``, plus the L1 term ramped linearly from 0 at fraction ``l1_ramp`` to ``l1_weight`` at the end."""
    if l1_ramp is None or progress <= l1_ramp:
        return base
    return base._replace(l1=base.l1 + l1_weight * min(1.0, (progress - l1_ramp) / max(1e-9, 1.0 - l1_ramp)))


def save_state(path: Path, drafter: DSparkDrafter, opt: torch.optim.Optimizer, step: int, elapsed: float,
               budget_elapsed: float, args) -> None:
    """Resume state as tensors + JSON (no pickles): fp32 weights, AdamW moments, step, elapsed time (in all, and the
    part the time budget counts), RNG."""
    path.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in drafter.named_parameters()}
    moments = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    moments[f"{names[id(p)]}.{key}"] = st[key].detach().cpu().contiguous()
            if "step" in st:
                moments[f"{names[id(p)]}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
    save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()},
              str(path / "drafter.safetensors.tmp"))
    save_file(moments, str(path / "optimizer.safetensors.tmp"))
    meta = {"step": step, "elapsed_s": elapsed, "budget_elapsed_s": budget_elapsed,
            "args": {k: v for k, v in vars(args).items()},
            "torch_rng": torch.get_rng_state().tolist(), "python_rng": repr(random.getstate())}
    (path / "state.json.tmp").write_text(json.dumps(meta, default=str))
    for name in ("drafter.safetensors", "optimizer.safetensors", "state.json"):  # the JSON last: it marks completion
        os.replace(path / (name + ".tmp"), path / name)


def load_state(path: Path, drafter: DSparkDrafter, opt: torch.optim.Optimizer, args) -> tuple[int, float]:
    meta = json.loads((path / "state.json").read_text())
    for k in ARCH_ARGS:
        was, now = meta["args"].get(k), json.loads(json.dumps(getattr(args, k), default=str))
        if was != now:
            raise SystemExit(f"cannot resume from {path}: --{k.replace('_', '-')} was {was!r}, now {now!r} "
                             "(use another --out or --no-resume)")
    drafter.load_state_dict(load_file(str(path / "drafter.safetensors")))
    moments = load_file(str(path / "optimizer.safetensors"))
    for n, p in drafter.named_parameters():
        if f"{n}.exp_avg" in moments:
            st = opt.state[p]
            st["exp_avg"] = moments[f"{n}.exp_avg"].to(p.device)
            st["exp_avg_sq"] = moments[f"{n}.exp_avg_sq"].to(p.device)
            # AdamW keeps the step as a (device, when fused) float tensor
            st["step"] = moments[f"{n}.step"].reshape(()).to(p.device if getattr(opt, "_fused", False) else "cpu")
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    return int(meta["step"]), float(meta["elapsed_s"]), float(meta.get("budget_elapsed_s", meta["elapsed_s"]))


# --------------------------------------------------------------------------- evaluation


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights stay in the optimizer); plain fp32 on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def evaluate(drafter: DSparkDrafter, target: Target, data: TokenData, eval_batches: list[list[int]], weights,
             decay: float, device: torch.device, backend: str = "auto", batch_groups: list[str] | None = None
             ) -> dict:
    """Held-out loss terms and per-slot teacher-forced acceptance proxies over every eligible anchor.

    ``accept_proxy[k] = E[Σ_v min(p_d, p_t)]`` (the probability that rejection sampling at T = 1 accepts slot k
    given the true prefix), ``greedy_match[k] = P(argmax p_d = argmax p_t)`` and ``label_acc[k] =
    P(argmax p_d = x*)``, over valid slots. With ``batch_groups`` (a label per batch, e.g. the temperature its
    sequences were sampled at: see :func:`eval_batches_by_temperature`) the two proxies are also reported per group
    under ``by_group``: T = 1 requests draft after sampled text, which is harder to predict than greedy text.
    """
    was_training = drafter.training
    drafter.eval()
    sums: dict[str, float] = {}
    stats = None
    group_stats: dict[str, torch.Tensor] = {}
    for i, idx in enumerate(eval_batches):
        b = data.batch(idx)
        logits_t, features = target.forward_batch(b.input_ids, b.attention_mask.long(), float_logits=False)
        with autocast(device):
            out = dense_step_loss(drafter, b.input_ids, b.loss_mask, b.attention_mask, features, logits_t,
                                  weights=weights, decay=decay, num_rows=b.num_teacher_rows, backend=backend)
        for k, v in {"loss": out.loss, **out.terms}.items():
            sums[k] = sums.get(k, 0.0) + float(v)  # sync: evaluation only
        stats = out.slot_stats if stats is None else stats + out.slot_stats
        if batch_groups is not None:
            g = batch_groups[i]
            group_stats[g] = out.slot_stats if g not in group_stats else group_stats[g] + out.slot_stats
    drafter.train(was_training)

    def proxies(t: torch.Tensor) -> dict[str, list]:
        s = dict(zip(STAT_NAMES, t.cpu().unbind(1)))  # sync: evaluation only
        n = s["count"].clamp_min(1)
        return {"accept_proxy": (s["accept_proxy"] / n).tolist(), "greedy_match": (s["target_hit"] / n).tolist(),
                "label_acc": (s["label_hit"] / n).tolist(), "slots": s["count"].long().tolist()}

    result = {**{k: v / max(len(eval_batches), 1) for k, v in sums.items()}, **proxies(stats)}
    if len(group_stats) > 1:
        result["by_group"] = {g: {k: v for k, v in proxies(t).items() if k != "label_acc"}
                              for g, t in sorted(group_stats.items())}
    return result


def eval_batches_by_temperature(lengths: list[int], temperatures: list[float | None], tokens_per_batch: int,
                                seed: int) -> tuple[list[list[int]], list[str] | None]:
    """Held-out batches that never mix sequences sampled at different temperatures, and each batch's label
    (``"T=0"``, ``"T=1"``, ...), so that :func:`evaluate` reports the proxies per temperature; one set of batches
    and no labels when the set records a single temperature or none."""
    if len({t for t in temperatures}) < 2:
        return token_budget_batches(lengths, tokens_per_batch, seed, epoch=0), None
    batches, labels = [], []
    for t in sorted({t for t in temperatures}, key=lambda x: (x is None, x or 0.0)):
        members = [i for i, x in enumerate(temperatures) if x == t]
        for b in token_budget_batches([lengths[i] for i in members], tokens_per_batch, seed, epoch=0):
            batches.append([members[j] for j in b])
            labels.append("T=?" if t is None else f"T={t:g}")
    return batches, labels


# --------------------------------------------------------------------------- output


def write_readme(out: Path, args, summary: dict) -> None:
    """README.md of the checkpoint directory: data, steps, wall time, hardware, command."""
    data = summary.get("data_manifest") or {}
    settings = data.get("settings", {})
    ev = summary.get("final_eval") or {}
    lines = [
        f"# DSpark drafter: head={args.head}, {args.num_layers} layers, γ={args.gamma}",
        "",
        f"Target: `{Path(args.model).name}`. Trained by `scripts/train_drafter.py` (docs/method.md §2); load with "
        "`reference.checkpoint.load_drafter`.",
        "",
        "| | |", "|---|---|",
        f"| data | {summary['train_examples']:,} sequences"
        + (f", {data.get('response_tokens'):,} response tokens, self-distilled at T ∈ {settings.get('temperatures')}"
           if data.get("response_tokens") else "") + " |",
        f"| held-out eval | {summary['eval_examples']} sequences |",
        f"| steps | {summary['steps_done']} of {args.steps} planned ({summary['stop_reason']}) |",
    ]
    if summary.get("deepened_from_layers"):
        lines += [f"| deepened | from the {summary['deepened_from_layers']} layers of `{args.init_from}` "
                  f"(the new layers started as the identity) |"]
    lines += [
        f"| batch | ≤ {args.tokens_per_batch} padded tokens per rank, every response position an anchor, "
        f"{summary['world_size']} rank(s) |",
        f"| supervised slot predictions | {summary['slot_predictions']:,} "
        f"({summary['slot_predictions_per_s']:,.0f} per second) |",
        f"| optimiser | AdamW lr {args.lr}, {args.warmup_frac:.0%} warm-up + cosine, wd {args.weight_decay}, "
        f"clip {args.clip} |",
        f"| loss | weights (CE, L1, conf, KL) = {tuple(args.loss_weights)}"
        + (f", L1 ramped in from {args.l1_ramp:.0%} to {args.l1_weight}" if args.l1_ramp is not None else "")
        + f", position decay λ = {args.decay} |",
        f"| sequential head | {args.head}, rank {args.markov_rank}"
        + (", factored through the frozen embedding" if args.markov_factored else "") + " |",
        f"| wall time | {summary['wall_s'] / 60:.1f} min |",
        f"| hardware | {summary['hardware']} |",
        f"| parameters | {summary['parameters']:,} (the target's embedding and LM head are shared, not stored) |",
    ]
    if ev:
        lines += [f"| held-out loss | {ev['loss']:.4f} (KL {ev.get('kl', float('nan')):.3f}, "
                  f"CE {ev.get('ce', float('nan')):.3f}, L1 {ev.get('l1', float('nan')):.3f}) |",
                  "| accept proxy Σmin(p_d,p_t) per slot | " + ", ".join(f"{x:.3f}" for x in ev["accept_proxy"]) + " |",
                  "| greedy match per slot | " + ", ".join(f"{x:.3f}" for x in ev["greedy_match"]) + " |"]
        lines += [f"| accept proxy on text sampled at {g} | " + ", ".join(f"{x:.3f}" for x in r["accept_proxy"]) + " |"
                  for g, r in ev.get("by_group", {}).items()]
    lines += ["", "Command:", "", "```", summary["command"], "```", "",
              "`metrics.jsonl` holds the training curve."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- main


def parse_weights(text: str) -> LossWeights:
    try:
        return LossWeights.of([float(x) for x in text.split(",")])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--loss-weights expects ce,l1,conf or ce,l1,conf,kl (non-negative, not all "
                                         f"0), got {text!r}: {e}") from e


def parse_mask_token(text: str) -> int | str:
    if text in ("auto", "learned"):
        return text
    try:
        return int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--mask-token-id expects auto, learned or a token id, got {text!r}") from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", required=True, help="self-distilled training set (scripts/make_dataset.py --out)")
    p.add_argument("--eval-data", default=None, help="held-out set; default: the last --eval-examples of --data")
    p.add_argument("--eval-examples", type=int, default=256, help="held-out sequences used for evaluation")
    p.add_argument("--out", required=True, help="checkpoint directory (resumes from OUT/_state when present)")
    p.add_argument("--model", default=DEFAULT_TARGET,
                   help="target: 'smollm2-135m-instruct', a .gguf file or a local HF model directory")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (under torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--head", choices=("markov", "rnn", "none"), default="markov", help="sequential head")
    p.add_argument("--num-layers", type=int, default=2,
                   help="backbone depth; with --init-from, more layers than the checkpoint has deepen it (the new "
                        "layers start as the identity: DSparkDrafter.deepened)")
    p.add_argument("--markov-rank", type=int, default=64, help="r of W1/W2")
    p.add_argument("--markov-factored", action=argparse.BooleanOptionalAction, default=True,
                   help="factor W1/W2 through the target's frozen embedding / LM head (2·d·r instead of 2·V·r "
                        "parameters; Markov head only)")
    p.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="per-head RMSNorm on queries and keys (the vLLM/speculators DSpark layer has it)")
    p.add_argument("--mask-token-id", type=parse_mask_token, default="auto",
                   help="the mask token M: a vocabulary row id, 'learned' (a trained vector), or 'auto' (the "
                        "highest-id special token of the target that is no end/chat token and never occurs in the "
                        "data; 'learned' if none)")
    p.add_argument("--gamma", type=int, default=7, help="block size γ")
    p.add_argument("--tokens-per-batch", type=int, default=16384, help="padded tokens B·S_max per rank and step")
    p.add_argument("--max-seq-len", type=int, default=1024, help="longer sequences are truncated")
    p.add_argument("--steps", type=int, default=2000,
                   help="optimizer steps; sizes the cosine schedule (0: schedule over --time-budget-min instead)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--warmup-frac", type=float, default=0.04,
                   help="linear warm-up over this fraction of the schedule, then a cosine to 0 (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--loss-weights", type=parse_weights, default=LossWeights(ce=0.0, l1=0.0, conf=1.0, kl=1.0),
                   help="w_ce,w_l1,w_conf[,w_kl]; the paper's mix is 0.1,0.9,1.0 and its CE-only ('DFlash') arm 1,0,0")
    p.add_argument("--l1-ramp", type=float, default=None,
                   help="from this fraction of the schedule on, add the L1 term, ramped linearly to --l1-weight")
    p.add_argument("--l1-weight", type=float, default=0.9, help="final weight of the ramped L1 term")
    p.add_argument("--decay", type=float, default=4.0, help="λ of the position weights exp(-(k-1)/λ)")
    p.add_argument("--loss-backend", choices=("auto", "triton", "torch"), default="auto",
                   help="the loss's per-row work: auto = the Triton kernel on CUDA, torch elsewhere")
    p.add_argument("--attention", choices=("auto", "einsum", "flex"), default="auto",
                   help="the backbone's block attention (optimized.training.dense_backbone): auto = flex on CUDA, "
                        "einsum elsewhere (FlexAttention has no backward on a CPU)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initialisation and of the batch order (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=20,
                   help="log the training loss and throughput every N steps (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=500,
                   help="held-out evaluation (loss terms, per-slot acceptance proxy) every N steps "
                        "(default: %(default)s)")
    p.add_argument("--save-every", type=int, default=1000, help="resume-state interval in steps")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="stop and save when this invocation's training time reaches this (a resumed OUT/_state "
                        "counts the time already spent; --init-from does not); the schedule stays sized by --steps")
    p.add_argument("--anneal-frac", type=float, default=0.0,
                   help="decay the learning rate to 0 along a cosine over the last fraction F of --time-budget-min "
                        "(the schedule underneath continues in the next run, see --init-from; default: %(default)s)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end this invocation after N more steps (resume later); splits a run over short device calls")
    p.add_argument("--init-from", default=None,
                   help="start from this drafter checkpoint's weights and recorded step (a run continued on another "
                        "machine from the shipped bf16 checkpoint); the optimizer moments restart")
    p.add_argument("--init-schedule", choices=("continue", "restart"), default="continue",
                   help="with --init-from: continue its learning-rate schedule from its recorded step, or restart: "
                        "a new schedule of --steps from step 0 (warm-up included) on its weights")
    p.add_argument("--rewarm-steps", type=int, default=50,
                   help="with --init-from: ramp the learning rate linearly over this many steps while AdamW's moments "
                        "refill")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="dtype of the saved drafter")
    p.add_argument("--save-weights", choices=WEIGHT_FORMATS, default="full",
                   help="int8: weight matrices in 8 bits with a scale per row, half the size of bfloat16 "
                        "(reference.checkpoint; the resume state keeps float32)")
    p.add_argument("--no-resume", action="store_true", help="ignore OUT/_state and start fresh")
    return p


def setup_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device); initialises torch.distributed under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    device = resolve_device(device_arg)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def pick_mask_token(choice: int | str, target: Target, data: TokenData) -> int | None:
    """The mask token id (None = a learned vector); see ``--mask-token-id``."""
    if choice == "learned":
        return None
    if isinstance(choice, int):
        if not 0 <= choice < target.vocab_size:
            raise SystemExit(f"--mask-token-id {choice} is outside the vocabulary [0, {target.vocab_size})")
        return choice
    tok = target.tokenizer
    specials = sorted(getattr(tok, "added_tokens_decoder", {}) or {}) if tok is not None else []
    taken = set(target.eos_token_ids) | {getattr(tok, n, None) for n in ("bos_token_id", "pad_token_id")}
    if tok is not None and getattr(tok, "chat_template", None):
        taken |= {i for i in specials if tok.convert_ids_to_tokens(i) in tok.chat_template}
    seen = set(torch.unique(data.tokens).tolist())  # sync: once, at start-up
    free = [i for i in specials if i not in taken and i not in seen and i < target.vocab_size]
    return free[-1] if free else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world, device = setup_distributed(args.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    command = " ".join(["python -m scripts.train_drafter", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    if args.head != "markov":
        args.markov_factored = False  # only the Markov head has a factored form

    target = Target.load(args.model, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    examples = load_dataset(args.data)
    if args.eval_data:
        eval_examples = load_dataset(args.eval_data, limit=args.eval_examples)
    else:
        if len(examples) <= args.eval_examples:
            raise SystemExit(f"--data has {len(examples)} sequences, too few to hold out --eval-examples "
                             f"{args.eval_examples}; pass --eval-data or lower --eval-examples")
        examples, eval_examples = examples[:-args.eval_examples], examples[-args.eval_examples:]
    eval_source = args.eval_data or args.data
    sampled_at = generation_temperatures(eval_source)
    eval_temperatures = [None if sampled_at is None else example_temperature(e, sampled_at) for e in eval_examples]
    data = TokenData(examples, args.max_seq_len, device)
    eval_data = TokenData(eval_examples, args.max_seq_len, device)
    del examples, eval_examples
    log.info("%d training sequences (%d response tokens), %d held-out sequences", len(data),
             data.num_response_tokens, len(eval_data))

    torch.manual_seed(args.seed)  # identical initial weights on every rank and in every arm of a comparison
    grown_from = None  # the layer count of an --init-from drafter deepened to --num-layers
    if args.init_from:
        drafter = load_drafter(args.init_from, device=device, dtype=torch.float32)
        config = drafter.config
        got = {"head": config.head, "markov_rank": config.markov_rank, "markov_factored": config.markov_factored,
               "qk_norm": config.qk_norm, "gamma": config.block_size}
        clash = {k: (v, getattr(args, k)) for k, v in got.items() if v != getattr(args, k)}
        if args.num_layers < config.num_layers:
            clash["num_layers"] = (config.num_layers, args.num_layers)
        if clash:
            raise SystemExit(f"--init-from {args.init_from} disagrees with the arguments: {clash}")
        if args.num_layers > config.num_layers:
            # More capacity without starting over: the new layers begin as the identity (DSparkDrafter.deepened)
            log.info("deepening the %d-layer drafter of %s to %d layers (the new layers start as the identity)",
                     config.num_layers, args.init_from, args.num_layers)
            grown_from = config.num_layers
            drafter = drafter.deepened(args.num_layers)
            config = drafter.config
    else:
        mask_id = pick_mask_token(args.mask_token_id, target, data)
        config = DrafterConfig.from_target_config(
            target.config, num_layers=args.num_layers, block_size=args.gamma, head=args.head,
            markov_rank=args.markov_rank, markov_factored=args.markov_factored, qk_norm=args.qk_norm,
            mask_token_id=mask_id, target_name=Path(target.name).name, target_layer_ids=target.layer_ids)
        drafter = DSparkDrafter(config).to(device)  # fp32 master weights
    drafter.attach_target(target.embed_tokens, target.lm_head)
    log.info("drafter: %s head%s, %d layers, γ=%d, rank %d, q/k-norm %s, mask %s, %s parameters, taps %s", config.head,
             " (factored)" if config.markov_factored else "", config.num_layers, config.block_size, config.markov_rank,
             config.qk_norm, config.mask_token_id if config.mask_token_id is not None else "learned",
             f"{drafter.num_parameters():,}", list(config.target_layer_ids))
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            fused=device.type == "cuda")
    if args.steps == 0 and args.time_budget_min is None:
        raise SystemExit("--steps 0 (schedule by time) needs --time-budget-min")
    if not 0.0 <= args.anneal_frac <= 1.0:
        raise SystemExit(f"--anneal-frac must lie in [0, 1], got {args.anneal_frac}")
    if args.anneal_frac > 0 and args.time_budget_min is None:
        raise SystemExit("--anneal-frac anneals over the time budget: it needs --time-budget-min")
    if args.init_schedule == "restart" and not args.init_from:
        raise SystemExit("--init-schedule restart starts a new schedule on a checkpoint's weights: it needs "
                         "--init-from")

    # elapsed_before: training time recorded before this invocation (the checkpoint's total wall time);
    # budget_before: the part of it the time budget counts (a resumed _state continues one invocation, a loan
    # started --init-from is a new one)
    step, elapsed_before, budget_before, rewarm_from = 0, 0.0, 0.0, None
    state_dir = out / STATE_DIR
    if (state_dir / "state.json").is_file() and not args.no_resume:
        step, elapsed_before, budget_before = load_state(state_dir, drafter, opt, args)
        log.info("resumed from %s at step %d (%.1f min already spent)", state_dir, step, elapsed_before / 60)
    elif args.init_from:
        training = json.loads((Path(args.init_from) / "config.json").read_text()).get("extra", {}).get("training", {})
        elapsed_before = float(training.get("wall_s", 0))  # the wall time reported counts the weights' whole training
        if args.init_schedule == "restart":
            log.info("initialised from %s (its step %d); a new schedule of %d steps from step 0", args.init_from,
                     int(training.get("steps_done", 0)), args.steps)
        else:
            step = rewarm_from = int(training.get("steps_done", 0))
            log.info("initialised from %s at its step %d; learning rate re-warmed over %d steps", args.init_from,
                     step, args.rewarm_steps)
    # The schedule: warm-up + cosine over --steps, or over the time budget (--steps 0), where `progress` follows
    # the clock every step so a run of fixed wall-clock length (a lent GPU) still decays to 0.
    warmup = max(1, math.ceil(args.warmup_frac * (args.steps or 10_000)))

    def schedule(s: int, frac: float) -> float:
        base = lr_factor(s, args.steps, warmup) if args.steps else lr_factor(int(frac * 10_000), 10_000, warmup)
        if rewarm_from is not None and s - rewarm_from < args.rewarm_steps:
            base *= (s - rewarm_from + 1) / args.rewarm_steps
        return base * anneal_factor(frac, args.anneal_frac)

    if world > 1:  # every rank starts from rank 0's weights (they are equal by seed; this makes it a guarantee)
        for p_ in drafter.parameters():
            dist.broadcast(p_.data, src=0)

    eval_batches, eval_groups = [], None
    if rank == 0:  # batches of one sampling temperature each, so that the proxies are also reported per temperature
        eval_batches, eval_groups = eval_batches_by_temperature(eval_data.lengths, eval_temperatures,
                                                                args.tokens_per_batch, args.seed)

    def held_out() -> dict:
        return evaluate(drafter, target, eval_data, eval_batches, args.loss_weights, args.decay, device,
                        args.loss_backend, eval_groups)

    # Global batches of world · --tokens-per-batch padded tokens, drawn identically on every rank from (seed, epoch);
    # rank r takes every world-th sequence of each. The data seen at a step is then the same whatever the number of
    # processes, so a run resumes on another GPU count, and N ranks at B tokens train like one process at N·B.
    stream = batch_stream(data.lengths, args.tokens_per_batch * world, args.seed, 0, 1, skip=step)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None

    def emit(record: dict) -> None:
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()

    budget_s = None if args.time_budget_min is None else args.time_budget_min * 60
    total = args.steps or 10**9  # --steps 0: the time budget ends training
    stop_at = total if args.stop_after is None else min(total, step + args.stop_after)
    stop_reason = "steps" if args.stop_after is None else f"--stop-after {args.stop_after}"
    last_eval, last_eval_step = None, -1
    bar = tqdm(total=args.steps or None, initial=step, desc="train", unit="step", disable=rank != 0)
    t_start = time.perf_counter()  # the time budget counts training, not the model and data loading before it
    t_log, slots_log = time.perf_counter(), torch.zeros((), device=device)
    slots_total, t_train = 0, 0.0
    drafter.train()
    while step < stop_at:
        elapsed = budget_before + time.perf_counter() - t_start
        frac = min(1.0, elapsed / budget_s) if budget_s else 0.0
        progress = frac if not args.steps else step / args.steps
        if budget_s is not None and elapsed >= budget_s:
            # Every rank checks its own clock; they agree to within a step, and all-reducing the verdict every
            # step would add a sync. Under torchrun a per-step agreement is made below, only then.
            stop_reason = f"time budget {args.time_budget_min} min"
        if world > 1:
            flag = torch.tensor(float(stop_reason.startswith("time")), device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # sync: every rank must stop at the same step
            if flag.item():
                stop_reason = f"time budget {args.time_budget_min} min"
        if stop_reason.startswith("time"):
            log.info("time budget reached after %.1f min at step %d: stopping", elapsed / 60, step)
            break
        for group in opt.param_groups:
            group["lr"] = args.lr * schedule(step, frac)
        weights = loss_weights_at(args.loss_weights, progress, args.l1_ramp, args.l1_weight)
        epoch, idx = next(stream)
        b = data.batch(idx[rank::world] or idx[:1])  # a rank left without a sequence repeats one, weighted 0 below
        t0 = time.perf_counter()
        denominator = None
        if world > 1:
            # Every loss term is a mean over the global batch: divide by the Σ w_k of all ranks' slots, then sum
            # the ranks' gradients. (A rank holding only a repeated sequence contributes no slot.)
            denominator = weight_sum(dense_block_targets(b.input_ids, b.loss_mask & b.attention_mask, args.gamma),
                                     args.decay) * float(len(idx[rank::world]) > 0)
            dist.all_reduce(denominator)  # no host sync: the sum stays on the device
        logits_t, features = target.forward_batch(b.input_ids, b.attention_mask.long(), float_logits=False)
        with autocast(device):
            out_loss = dense_step_loss(drafter, b.input_ids, b.loss_mask, b.attention_mask, features, logits_t,
                                       weights=weights, decay=args.decay, denominator=denominator,
                                       num_rows=b.num_teacher_rows, backend=args.loss_backend,
                                       attention=args.attention)
        del logits_t, features
        opt.zero_grad(set_to_none=True)
        out_loss.loss.backward()
        if world > 1:
            # Data parallel: sum the ranks' gradients (each already divided by the global Σ w_k). The loss is a
            # function, not a module's forward, so the reduction is written out: one flat buffer, one all-reduce.
            grads = [p_.grad if p_.grad is not None else torch.zeros_like(p_) for p_ in drafter.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for p_, new in zip(drafter.parameters(), torch._utils._unflatten_dense_tensors(flat, grads)):
                p_.grad = new.view_as(p_)
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        step += 1
        slots_log += out_loss.slot_stats[:, 0].sum()
        t_train += time.perf_counter() - t0
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            if world > 1:
                dist.all_reduce(slots_log)  # every rank's supervised slots (ranks hold different sequences)
            n_slots = float(slots_log)  # sync: logging only, every --log-every steps
            slots_total += int(n_slots)
            losses = torch.stack([out_loss.loss.detach(), *out_loss.terms.values()])
            if world > 1:
                dist.all_reduce(losses)  # each rank holds its share of the global means: their sum is the loss
            rec = {"event": "train", "step": step, "epoch": epoch, "lr": opt.param_groups[0]["lr"],
                   "grad_norm": float(grad_norm), "slot_predictions_per_s": n_slots / (now - t_log),
                   "elapsed_s": elapsed_before + now - t_start,
                   **dict(zip(["loss", *out_loss.terms], losses.tolist())), "weights": list(weights)}
            stats = dict(zip(STAT_NAMES, out_loss.slot_stats.cpu().unbind(1)))
            rec["acc"] = float(stats["label_hit"].sum() / stats["count"].sum().clamp_min(1))
            t_log, slots_log = now, torch.zeros((), device=device)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}",
                            sps=f"{rec['slot_predictions_per_s'] / 1e3:.0f}k")
            emit(rec)
        if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            last_eval = held_out()
            last_eval_step = step
            emit({"event": "eval", "step": step, **last_eval})
            log.info("eval step %d: loss %.4f  greedy match %s  accept proxy %s", step, last_eval["loss"],
                     " ".join(f"{x:.3f}" for x in last_eval["greedy_match"]),
                     " ".join(f"{x:.3f}" for x in last_eval["accept_proxy"]))
            for g, r in last_eval.get("by_group", {}).items():
                log.info("  on text sampled at %s: accept proxy %s", g, " ".join(f"{x:.3f}" for x in r["accept_proxy"]))
        if rank == 0 and step % args.save_every == 0:
            run_s = time.perf_counter() - t_start
            save_state(state_dir, drafter, opt, step, elapsed_before + run_s, budget_before + run_s, args)
        if world > 1 and step % args.save_every == 0:
            dist.barrier()
    bar.close()

    if rank == 0:
        run_s = time.perf_counter() - t_start
        wall = elapsed_before + run_s
        save_state(state_dir, drafter, opt, step, wall, budget_before + run_s, args)
        if last_eval_step != step:
            last_eval = held_out()
            emit({"event": "eval", "step": step, **last_eval})
        export = DSparkDrafter(config)
        export.load_state_dict({k: v.detach().cpu() for k, v in drafter.state_dict().items()})
        manifest_path = Path(args.data) / MANIFEST
        summary = {
            "steps_done": step, "steps_planned": args.steps, "stop_reason": stop_reason, "wall_s": round(wall, 1),
            "hardware": hardware(device, world), "world_size": world, "command": command,
            "train_examples": len(data), "train_response_tokens": data.num_response_tokens,
            "eval_examples": len(eval_data), "parameters": drafter.num_parameters(),
            "slot_predictions": slots_total, "slot_predictions_per_s": slots_total / max(t_train, 1e-9),
            "final_eval": last_eval, "deepened_from_layers": grown_from,
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            "data_manifest": json.loads(manifest_path.read_text()) if manifest_path.is_file() else None,
        }
        if summary["data_manifest"]:
            summary["data_manifest"].pop("shards", None)  # per-shard detail stays in the data directory
        provenance = {k: summary[k] for k in ("steps_done", "stop_reason", "wall_s", "hardware", "command",
                                              "train_examples", "deepened_from_layers") if summary[k] is not None}
        save_drafter(export.to(getattr(torch, args.save_dtype)), out, extra={"training": provenance},
                     weights=args.save_weights)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        write_readme(out, args, summary)
        log.info("saved drafter to %s after %d steps (%.1f min)", out, step, wall / 60)
        metrics.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
