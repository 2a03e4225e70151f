"""Train a DSpark drafter on self-distilled data (docs/method.md §2), on one GPU, several (torchrun) or a CPU.

Names follow ``docs/method.md``: ``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length,
γ the block size, ``x_0`` the anchor.

One optimisation step, per rank::

    batch      right-padded self-distilled sequences (token budget --tokens-per-batch = B·S_max)
    target     forward_batch, no grad (bf16 weights on CUDA)     -> p_t logits [B, S, V], features [B, S, m·d]
    anchors    --anchors-per-seq random response positions per sequence (losses.sample_anchors); their
               γ-token blocks are packed into one drafter forward under the block mask
    drafter    forward (bf16 autocast, fp32 master weights)      -> h [B, nb, γ, d]
               head_logits teacher-forced on the true previous tokens -> p_d logits [B, nb, γ, V], z [B, nb, γ]
    loss       losses.dspark_loss(p_d, p_t gathered at target_pos, labels, z, valid) with --loss-weights
    update     AdamW (lr 6e-4, weight decay 0), clip 1.0, 4 % linear warm-up then cosine to 0 over --steps

Why the features are recomputed instead of stored: see ``scripts/make_dataset.py`` (11 KB per token stored
versus one forward of a 135M model per batch).

Memory. The big tensors are V-wide: target logits ``[B, S, V]`` float32 (4·V bytes per token: 16k tokens ·
49152 · 4 B = 3.2 GB), draft logits ``[B·nb·γ, V]`` float32 and their gradient (two copies of
``B·nb·γ·V·4`` bytes: 32 sequences · 32 anchors · 7 slots → 1.4 GB each), and the gathered ``p_t`` rows of the
same size. ``dspark_loss`` scores the rows in chunks, so no further V-wide temporaries are built. Size
``--tokens-per-batch`` and ``--anchors-per-seq`` to the device: 16384 tokens and 32 anchors take about
10-15 GB with SmolLM2 on an H200; on a CPU use a few hundred tokens.

Arms of the paper's ablation (same data, steps and seed): ``--head markov`` (DSpark), ``--head rnn``,
``--head none`` with the default loss mix (parallel-only, CE + L1 + confidence), and ``--head none
--loss-weights 1,0,0`` (CE only, the paper's "DFlash" baseline).

Output in ``--out``: the drafter (``reference.checkpoint`` format, shards ≤ 15 MB) with a README.md,
``metrics.jsonl`` (one JSON object per log/eval event), ``summary.json``, and ``_state/state.pt`` (optimizer,
scheduler, step, RNG: resume state; do not ship it). Rerunning the same command resumes from ``_state``.

Examples::

    python scripts/train_drafter.py --data data/sd-train --eval-data data/sd-heldout --out runs/markov \\
        --head markov --steps 3000 --time-budget-min 8
    torchrun --nproc-per-node 8 scripts/train_drafter.py --data ... --out ...     # data parallel
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference.checkpoint import save_drafter  # noqa: E402
from reference.config import DrafterConfig  # noqa: E402
from reference.drafter import DSparkDrafter  # noqa: E402
from reference.losses import block_targets, dspark_loss, sample_anchors  # noqa: E402
from reference.target import DEFAULT_TARGET, Target  # noqa: E402
from scripts.make_dataset import MANIFEST, Example, load_dataset, resolve_device  # noqa: E402

log = logging.getLogger("dspark.train")

STATE_DIR = "_state"
STATE_FILE = "state.pt"
# Arguments that define the model being trained: a resumed run must not change them.
ARCH_ARGS = ("head", "num_layers", "markov_rank", "gamma", "model", "loss_weights", "decay", "steps", "seed")


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """Right-padded sequences; every field ``[B, S]``."""

    input_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor  # bool: True on the first len_b positions
    loss_mask: torch.Tensor  # bool: True on response tokens


def collate(examples: list[Example], max_len: int) -> Batch:
    """Right-pad (and right-truncate to ``max_len``) a list of examples."""
    lens = [min(len(e.input_ids), max_len) for e in examples]
    S = max(lens)
    ids = torch.zeros(len(examples), S, dtype=torch.long)  # [B, S]; pad id 0 is masked everywhere
    attn = torch.zeros(len(examples), S, dtype=torch.bool)  # [B, S]
    lmask = torch.zeros(len(examples), S, dtype=torch.bool)  # [B, S]
    for b, (e, n) in enumerate(zip(examples, lens)):
        ids[b, :n] = e.input_ids[:n]
        attn[b, :n] = True
        lmask[b, :n] = e.loss_mask[:n]
    return Batch(ids, attn, lmask)


def token_budget_batches(lengths: list[int], tokens_per_batch: int, seed: int, epoch: int, rank: int = 0,
                         world: int = 1, window: int = 256) -> list[list[int]]:
    """One epoch of index batches for one rank, with ``B · S_max ≤ tokens_per_batch`` (padded tokens).

    The epoch's shuffle is a function of ``(seed, epoch)`` only, shared by every rank; rank r keeps every
    world-th example (like DistributedSampler). Examples are sorted by length inside windows of ``window``
    so a batch holds similar lengths (little padding) while batches stay random; then the batch order is
    shuffled. A sequence longer than the budget forms a batch of one (it is truncated by --max-seq-len).
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order = order[rank::world]
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        cur: list[int] = []
        for i in sorted(order[start:start + window], key=lambda j: lengths[j]):
            if cur and (len(cur) + 1) * max(lengths[i], max(lengths[j] for j in cur)) > tokens_per_batch:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def batch_stream(lengths: list[int], tokens_per_batch: int, seed: int, rank: int, world: int, skip: int):
    """Endless batches, epoch after epoch, starting after ``skip`` batches (the resumed step count).

    The position in the data is a pure function of the step, so resuming needs no loader state.
    """
    epoch, done = 0, 0
    while True:
        batches = token_budget_batches(lengths, tokens_per_batch, seed, epoch, rank, world)
        if not batches:
            raise ValueError(f"rank {rank} has no training examples (only {len(lengths)} for {world} ranks)")
        for idx in batches:
            if done >= skip:
                yield epoch, idx
            done += 1
        epoch += 1


@dataclass
class Blocks:
    """The packed training blocks of a batch: anchors ``[B, nb]``, per-slot fields ``[B, nb, γ]``."""

    anchor_ids: torch.Tensor  # int64 x_0
    anchor_pos: torch.Tensor  # int64 p
    labels: torch.Tensor  # int64 x*_k
    prev_tokens: torch.Tensor  # int64 x_{k-1} (teacher forced)
    target_pos: torch.Tensor  # int64 row of the target logits predicting p+k
    valid: torch.Tensor  # bool, cumulative along k

    def to(self, device) -> Blocks:
        return Blocks(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def pack_blocks(batch: Batch, num_anchors: int, gamma: int, generator: torch.Generator) -> Blocks:
    """Sample anchors per sequence and build their teacher-forcing targets, padded to the largest nb.

    Padding blocks sit at position 0 with every slot invalid: they attend to their own block only and are
    masked out of every loss term.
    """
    B = batch.input_ids.shape[0]
    per_seq = []
    for b in range(B):
        n = int(batch.attention_mask[b].sum())
        ids, lmask = batch.input_ids[b, :n], batch.loss_mask[b, :n]
        anchors = sample_anchors(lmask, num_anchors, gamma, generator)  # [nb_b]
        per_seq.append((ids, anchors, block_targets(ids, lmask, anchors, gamma)))
    nb = max(1, max(a.numel() for _, a, _ in per_seq))
    out = Blocks(*(torch.zeros(B, nb, dtype=torch.long) for _ in range(2)),
                 *(torch.zeros(B, nb, gamma, dtype=torch.long) for _ in range(3)),
                 torch.zeros(B, nb, gamma, dtype=torch.bool))
    for b, (ids, anchors, t) in enumerate(per_seq):
        k = anchors.numel()
        out.anchor_ids[b, :k] = ids[anchors]
        out.anchor_pos[b, :k] = anchors
        out.labels[b, :k], out.prev_tokens[b, :k] = t.labels, t.prev_tokens
        out.target_pos[b, :k], out.valid[b, :k] = t.target_pos, t.valid
    return out


def anchor_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """Anchor randomness keyed by (seed, rank, step): a resumed run draws the same anchors."""
    return torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)


# --------------------------------------------------------------------------- model step


class DraftStep(nn.Module):
    """The drafter's training forward (backbone + teacher-forced heads) as one module, so DDP can wrap it."""

    def __init__(self, drafter: DSparkDrafter, with_conf: bool = True) -> None:
        super().__init__()
        self.drafter = drafter
        # Without a confidence loss the confidence logits are not returned, so that DDP's unused-parameter
        # search (which starts from forward's outputs) sees the confidence head as unused.
        self.with_conf = with_conf

    def forward(self, blocks: Blocks, features: torch.Tensor, attention_mask: torch.Tensor):
        """features [B, S, m·d], attention_mask [B, S] -> draft_logits [B, nb, γ, V], conf_logits [B, nb, γ] | None."""
        B, S = attention_mask.shape
        ctx_pos = torch.arange(S, device=features.device).expand(B, S)  # [B, S]
        h = self.drafter(blocks.anchor_ids, blocks.anchor_pos, features, ctx_pos, attention_mask)  # [B, nb, γ, d]
        draft_logits, conf_logits = self.drafter.head_logits(h, blocks.prev_tokens)
        return draft_logits, conf_logits if self.with_conf else None


def gather_target_logits(logits: torch.Tensor, target_pos: torch.Tensor) -> torch.Tensor:
    """p_t logits of every slot: logits [B, S, V], target_pos [B, nb, γ] -> [B, nb, γ, V]."""
    b = torch.arange(logits.shape[0], device=logits.device)[:, None, None]  # [B, 1, 1]
    return logits[b, target_pos]


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights stay in the optimizer); plain fp32 on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                        enabled=False)


def step_losses(model: nn.Module, target: Target, batch: Batch, blocks: Blocks, weights, decay: float,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Target forward, drafter forward and the DSpark loss of one batch."""
    ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
    logits_t, features = target.forward_batch(ids, attn.long())  # [B, S, V] fp32, [B, S, m·d]
    blocks = blocks.to(device)
    with autocast(device):
        draft_logits, conf_logits = model(blocks, features, attn)  # [B, nb, γ, V], [B, nb, γ]
    needs_target = weights[1] > 0 or weights[2] > 0
    p_t = gather_target_logits(logits_t, blocks.target_pos).flatten(0, 1) if needs_target else None
    del logits_t
    return dspark_loss(draft_logits.flatten(0, 1), p_t, blocks.labels.flatten(0, 1),
                       conf_logits.flatten(0, 1) if weights[2] > 0 and conf_logits is not None else None,
                       blocks.valid.flatten(0, 1),
                       decay=decay, weights=weights)


@torch.no_grad()
def evaluate(drafter: DSparkDrafter, target: Target, eval_batches: list[tuple[Batch, Blocks]], weights, decay,
             device: torch.device) -> dict:
    """Held-out loss terms and per-position teacher-forced acceptance proxies.

    ``accept_proxy[k] = E[Σ_v min(p_d, p_t)]`` at T = 1 (the probability that rejection sampling accepts slot k
    given the true prefix) and ``greedy_match[k] = P(argmax p_d = argmax p_t)``, over valid slots.
    """
    model = DraftStep(drafter).eval()
    gamma = drafter.config.block_size
    sums = {k: 0.0 for k in ("loss", "ce", "l1", "conf")}
    proxy, match, count = torch.zeros(gamma), torch.zeros(gamma), torch.zeros(gamma)
    n_batches = 0
    for batch, blocks in eval_batches:
        ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
        logits_t, features = target.forward_batch(ids, attn.long())
        blk = blocks.to(device)
        with autocast(device):
            draft_logits, conf_logits = model(blk, features, attn)
        p_t_logits = gather_target_logits(logits_t, blk.target_pos)  # [B, nb, γ, V]
        del logits_t
        # Every term is reported, a zero-weight one as a detached diagnostic (dspark_loss's contract).
        out = dspark_loss(draft_logits.flatten(0, 1), p_t_logits.flatten(0, 1), blk.labels.flatten(0, 1),
                          conf_logits.flatten(0, 1), blk.valid.flatten(0, 1), decay=decay, weights=weights)
        for k in sums:
            sums[k] += float(out[k])
        n_batches += 1
        d, t, v = draft_logits.flatten(0, 2), p_t_logits.flatten(0, 2), blk.valid.flatten(0, 2)  # [M, V], [M]
        slot = torch.arange(gamma, device=device).repeat(v.numel() // gamma)  # [M] slot index of each row
        for s in range(0, v.numel(), 1024):  # rows in chunks: two [chunk, V] float32 softmaxes at a time
            e = slice(s, s + 1024)
            ov = (torch.softmax(d[e].float(), -1).minimum(torch.softmax(t[e].float(), -1))).sum(-1)  # [c]
            hit = (d[e].argmax(-1) == t[e].argmax(-1)).float()  # [c]
            w = v[e].float()
            proxy.index_add_(0, slot[e].cpu(), (ov * w).cpu())
            match.index_add_(0, slot[e].cpu(), (hit * w).cpu())
            count.index_add_(0, slot[e].cpu(), w.cpu())
    n = count.clamp_min(1)
    return {**{k: v / max(n_batches, 1) for k, v in sums.items()},
            "accept_proxy": (proxy / n).tolist(), "greedy_match": (match / n).tolist(),
            "slots": count.long().tolist()}


def build_eval_batches(examples: list[Example], args, gamma: int) -> list[tuple[Batch, Blocks]]:
    """Fixed held-out batches and anchors (seeded once), so every evaluation scores the same blocks."""
    lengths = [min(len(e.input_ids), args.max_seq_len) for e in examples]
    gen = torch.Generator().manual_seed(args.seed + 7919)
    out = []
    for idx in token_budget_batches(lengths, args.tokens_per_batch, args.seed, epoch=0):
        batch = collate([examples[i] for i in idx], args.max_seq_len)
        out.append((batch, pack_blocks(batch, args.anchors_per_seq, gamma, gen)))
    return out


# --------------------------------------------------------------------------- schedule, state


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0 at ``total`` (docs/method.md §2)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def save_state(path: Path, drafter: DSparkDrafter, opt, sched, step: int, elapsed: float, args) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "elapsed_s": elapsed, "drafter": drafter.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "args": vars(args), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "python_rng": random.getstate()}
    tmp = path / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path / STATE_FILE)  # atomic: a kill during the save keeps the previous state


def load_state(path: Path, drafter: DSparkDrafter, opt, sched, args) -> tuple[int, float]:
    state = torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
    for k in ARCH_ARGS:
        if state["args"].get(k) != getattr(args, k):
            raise SystemExit(f"cannot resume from {path}: --{k.replace('_', '-')} was {state['args'].get(k)!r}, "
                             f"now {getattr(args, k)!r} (use another --out or --no-resume)")
    drafter.load_state_dict(state["drafter"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"]), float(state["elapsed_s"])


def hardware(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{world}x {torch.cuda.get_device_name(device)}"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads) x{world}"


def write_readme(out: Path, args, summary: dict) -> None:
    """README.md of the checkpoint directory: data, steps, wall time, hardware, command (house rule 10)."""
    data = summary.get("data_manifest") or {}
    settings = data.get("settings", {})
    ev = summary.get("final_eval") or {}
    lines = [
        f"# DSpark drafter: head={args.head}, {args.num_layers} layers, γ={args.gamma}",
        "",
        f"Target: `{args.model}`. Trained by `scripts/train_drafter.py` (docs/method.md §2); load with "
        "`reference.checkpoint.load_drafter`.",
        "",
        "| | |", "|---|---|",
        f"| data | `{args.data}`: {summary['train_examples']} sequences"
        + (f", {data.get('response_tokens')} response tokens, self-distilled at T={settings.get('temperature')}"
           f" top_p={settings.get('top_p')}" if data else "") + " |",
        f"| held-out eval | {summary['eval_examples']} sequences |",
        f"| steps | {summary['steps_done']} of {args.steps} planned ({summary['stop_reason']}) |",
        f"| batch | ≤ {args.tokens_per_batch} padded tokens per rank, {args.anchors_per_seq} anchors per sequence, "
        f"{summary['world_size']} rank(s) |",
        f"| optimiser | AdamW lr {args.lr}, {args.warmup_frac:.0%} warm-up + cosine, wd {args.weight_decay}, "
        f"clip {args.clip} |",
        f"| loss | weights (CE, L1, conf) = {args.loss_weights}, position decay λ = {args.decay} |",
        f"| Markov rank | {args.markov_rank} |",
        f"| wall time | {summary['wall_s'] / 60:.1f} min |",
        f"| hardware | {summary['hardware']} |",
        f"| parameters | {summary['parameters']:,} (the target's embedding and LM head are shared, not stored) |",
    ]
    if ev:
        lines += [f"| held-out loss | {ev['loss']:.4f} (CE {ev['ce']:.3f}, L1 {ev['l1']:.3f}, conf {ev['conf']:.3f}) |",
                  "| accept proxy Σmin(p_d,p_t) per slot | " + ", ".join(f"{x:.3f}" for x in ev["accept_proxy"]) + " |"]
    lines += ["", "Command:", "", "```", summary["command"], "```", "",
              "`metrics.jsonl` holds the training curve; `_state/` (if present) is resume state, not part of the "
              "checkpoint."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- main


def parse_weights(text: str) -> tuple[float, float, float]:
    try:
        w = tuple(float(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--loss-weights expects three numbers like 0.1,0.9,1.0, got {text!r}") from e
    if len(w) != 3 or any(x < 0 for x in w) or not any(w):
        raise argparse.ArgumentTypeError(f"--loss-weights needs three non-negative numbers, not all 0: {text!r}")
    return w


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", required=True, help="self-distilled training set (scripts/make_dataset.py --out)")
    p.add_argument("--eval-data", default=None, help="held-out set; default: the last --eval-examples of --data")
    p.add_argument("--eval-examples", type=int, default=256, help="held-out sequences used for evaluation")
    p.add_argument("--out", required=True, help="checkpoint directory (resumes from OUT/_state when present)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: 'smollm2-135m-instruct', a .gguf or an HF dir")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (under torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--head", choices=("markov", "rnn", "none"), default="markov", help="sequential head")
    p.add_argument("--num-layers", type=int, default=2, help="backbone depth")
    p.add_argument("--markov-rank", type=int, default=64, help="r of W1/W2 (≤ 76 keeps W1, W2 under 15 MB in fp32)")
    p.add_argument("--gamma", type=int, default=7, help="block size γ")
    p.add_argument("--anchors-per-seq", type=int, default=32, help="training blocks per sequence")
    p.add_argument("--tokens-per-batch", type=int, default=16384, help="padded tokens B·S_max per rank and step")
    p.add_argument("--max-seq-len", type=int, default=1024, help="longer sequences are truncated")
    p.add_argument("--steps", type=int, default=2000,
                   help="optimizer steps; sizes the cosine schedule (0: schedule over --time-budget-min instead)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--loss-weights", type=parse_weights, default=(0.1, 0.9, 1.0),
                   help="w_ce,w_l1,w_conf; the CE-only ('DFlash') arm uses 1,0,0")
    p.add_argument("--decay", type=float, default=4.0, help="λ of the position weights exp(-(k-1)/λ)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=int, default=500, help="resume-state interval in steps")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="stop and save when total wall time reaches this (schedule stays sized by --steps)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end this invocation after N more steps (resume later); splits a run over short device calls")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the saved drafter (bfloat16 halves the checkpoint; needed for Markov rank > 76)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world, device = setup_distributed(args.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    command = " ".join([Path(sys.argv[0]).name if argv is None else "train_drafter.py", *(sys.argv[1:] if argv is None
                                                                                           else argv)])
    out = Path(args.out)
    t_start = time.perf_counter()

    target = Target.load(args.model, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    examples = load_dataset(args.data)
    if args.eval_data:
        eval_examples = load_dataset(args.eval_data, limit=args.eval_examples)
    else:
        if len(examples) <= args.eval_examples:
            raise SystemExit(f"--data has {len(examples)} sequences, too few to hold out --eval-examples "
                             f"{args.eval_examples}; pass --eval-data or lower --eval-examples")
        examples, eval_examples = examples[:-args.eval_examples], examples[-args.eval_examples:]
    log.info("%d training sequences, %d held-out sequences", len(examples), len(eval_examples))

    torch.manual_seed(args.seed)  # identical initial weights on every rank and in every arm of a comparison
    config = DrafterConfig.from_target_config(target.config, num_layers=args.num_layers, block_size=args.gamma,
                                              head=args.head, markov_rank=args.markov_rank, target_name=target.name,
                                              target_layer_ids=target.layer_ids)
    drafter = DSparkDrafter(config).to(device)  # fp32 master weights
    drafter.attach_target(target.embed_tokens, target.lm_head)
    log.info("drafter: %s head, %d layers, γ=%d, rank %d, %s parameters, taps %s", args.head, args.num_layers,
             args.gamma, args.markov_rank, f"{drafter.num_parameters():,}", list(config.target_layer_ids))
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.steps == 0 and args.time_budget_min is None:
        raise SystemExit("--steps 0 (schedule by time) needs --time-budget-min")
    # --steps 0: the warm-up + cosine schedule runs over the time budget instead of a step count, so a run of a
    # fixed wall-clock length (a lent GPU) still decays to 0. `progress` is updated every step from the clock.
    progress = {"frac": 0.0}
    warmup = max(1, math.ceil(args.warmup_frac * args.steps))
    if args.steps:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, warmup))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(int(progress["frac"] * 10_000), 10_000,
                                                                           int(args.warmup_frac * 10_000)))

    step, elapsed_before = 0, 0.0
    state_dir = out / STATE_DIR
    if (state_dir / STATE_FILE).is_file() and not args.no_resume:
        step, elapsed_before = load_state(state_dir, drafter, opt, sched, args)
        log.info("resumed from %s at step %d (%.1f min already spent)", state_dir, step, elapsed_before / 60)
    model: nn.Module = DraftStep(drafter, with_conf=args.loss_weights[2] > 0)
    if world > 1:
        # With w_conf = 0 the confidence head is outside the graph; DDP must be told to expect unused parameters.
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                                    find_unused_parameters=args.loss_weights[2] == 0)

    eval_batches = build_eval_batches(eval_examples, args, args.gamma) if rank == 0 else []
    lengths = [min(len(e.input_ids), args.max_seq_len) for e in examples]
    stream = batch_stream(lengths, args.tokens_per_batch, args.seed, rank, world, skip=step)
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
    t_log, tokens_log = time.perf_counter(), 0
    drafter.train()
    while step < stop_at:
        elapsed = elapsed_before + time.perf_counter() - t_start
        if budget_s is not None:
            progress["frac"] = min(1.0, elapsed / budget_s)
        stop = torch.tensor(float(budget_s is not None and elapsed >= budget_s), device=device)
        if world > 1:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            stop_reason = f"time budget {args.time_budget_min} min"
            log.info("time budget reached after %.1f min at step %d: stopping", elapsed / 60, step)
            break
        epoch, idx = next(stream)
        batch = collate([examples[i] for i in idx], args.max_seq_len)
        blocks = pack_blocks(batch, args.anchors_per_seq, args.gamma, anchor_generator(args.seed, rank, step))
        losses = step_losses(model, target, batch, blocks, args.loss_weights, args.decay, device)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        sched.step()
        step += 1
        tokens_log += int(batch.attention_mask.sum())
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            rec = {"event": "train", "step": step, "epoch": epoch, "lr": sched.get_last_lr()[0],
                   "grad_norm": float(grad_norm), "tokens_per_s": tokens_log * world / (now - t_log),
                   "elapsed_s": elapsed_before + now - t_start,
                   **{k: v.item() for k, v in losses.items()}}
            t_log, tokens_log = now, 0
            bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}")
            emit(rec)
        if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            drafter.eval()
            last_eval = evaluate(drafter, target, eval_batches, args.loss_weights, args.decay, device)
            drafter.train()
            last_eval_step = step
            emit({"event": "eval", "step": step, **last_eval})
            log.info("eval step %d: loss %.4f  accept proxy %s", step, last_eval["loss"],
                     " ".join(f"{x:.3f}" for x in last_eval["accept_proxy"]))
        if rank == 0 and step % args.save_every == 0:
            save_state(state_dir, drafter, opt, sched, step, elapsed_before + time.perf_counter() - t_start, args)
        if world > 1 and step % args.save_every == 0:
            dist.barrier()
    bar.close()

    if rank == 0:
        wall = elapsed_before + time.perf_counter() - t_start
        save_state(state_dir, drafter, opt, sched, step, wall, args)
        if last_eval_step != step:
            drafter.eval()
            last_eval = evaluate(drafter, target, eval_batches, args.loss_weights, args.decay, device)
            emit({"event": "eval", "step": step, **last_eval})
        save_dtype = getattr(torch, args.save_dtype)
        export = DSparkDrafter(config)
        export.load_state_dict({k: v.detach().cpu() for k, v in drafter.state_dict().items()})
        manifest_path = Path(args.data) / MANIFEST
        summary = {
            "steps_done": step, "steps_planned": args.steps, "stop_reason": stop_reason, "wall_s": round(wall, 1),
            "hardware": hardware(device, world), "world_size": world, "command": command,
            "train_examples": len(examples), "eval_examples": len(eval_examples),
            "parameters": drafter.num_parameters(), "final_eval": last_eval, "args": vars(args),
            "data_manifest": json.loads(manifest_path.read_text()) if manifest_path.is_file() else None,
        }
        if summary["data_manifest"]:
            summary["data_manifest"].pop("shards", None)  # per-shard detail stays in the data directory
        save_drafter(export.to(save_dtype), out, extra={"training": {k: summary[k] for k in (
            "steps_done", "stop_reason", "wall_s", "hardware", "command", "train_examples")}})
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
