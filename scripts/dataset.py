"""The self-distilled dataset on disk and in memory: safetensors shards, a flat token buffer, token-budget batches.

Written by ``scripts/make_dataset.py``, read by ``train_drafter``, ``calibrate`` and the benchmarks. Names follow
docs/method.md (``p_t`` target, ``p_d`` draft).

A shard ``shard-00000.safetensors`` holds the examples of a contiguous range of requests, concatenated:

    tokens      [T] uint16 (int32 when the vocabulary has more than 65,536 rows): prompt + response, per example
    loss_mask   [T] uint8, 1 on response tokens (the final end-of-turn token included)
    offsets     [n+1] int64, example i is tokens[offsets[i]:offsets[i+1]]
    metadata    "ids" (JSON list of example ids), "num_prompts", "wall_s"

Tensors only, no pickles: a shard from anywhere loads without running code. uint16 halves the size of the
token ids, which matters when a dataset travels between machines in a few files of ≤ 16 MB.

In memory (:class:`TokenData`) the whole dataset is one flat buffer on the training device (20 M tokens are
160 MB as int64), and a batch is one gather (:meth:`TokenData.batch`): no per-sequence Python work per step.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from reference.losses import block_targets, sample_anchors, teacher_rows

SHARD_GLOB = "shard-*.safetensors"
MANIFEST = "manifest.json"  # the dataset's settings and shard list (scripts/make_dataset.py writes it)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class Example:
    """One self-distilled sequence."""

    id: str
    input_ids: Tensor  # [S] int64: prompt + response
    loss_mask: Tensor  # [S] bool: True on response tokens (the assistant turn, final EOS included)


def pack_shard(ids: list[str], prompts: list[list[int]], responses: list[list[int]], vocab_size: int
               ) -> dict[str, Tensor]:
    """Concatenate prompt + response per example (examples with < 2 response tokens are dropped).

    Returns the tensors of a shard and, under ``"ids"``, the kept example ids (a list, not a tensor).
    """
    tokens, masks, offsets, kept = [], [], [0], []
    for pid, p, r in zip(ids, prompts, responses, strict=True):
        if len(r) < 2:  # a training anchor needs p and p+1 in the response
            continue
        tokens.extend(p + r)
        masks.extend([0] * len(p) + [1] * len(r))
        offsets.append(len(tokens))
        kept.append(pid)
    dtype = torch.uint16 if vocab_size <= 2**16 else torch.int32
    return {"tokens": torch.tensor(tokens, dtype=torch.int64).to(dtype),
            "loss_mask": torch.tensor(masks, dtype=torch.uint8),
            "offsets": torch.tensor(offsets, dtype=torch.int64), "ids": kept}


def write_shard(path: Path, shard: dict, *, num_prompts: int, wall_s: float, extra: dict | None = None) -> None:
    """Write atomically (a killed run never leaves a half shard that a resumed run would trust)."""
    meta = {"ids": json.dumps(shard["ids"]), "num_prompts": str(num_prompts), "wall_s": f"{wall_s:.3f}",
            **{k: json.dumps(v) for k, v in (extra or {}).items()}}
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v for k, v in shard.items() if isinstance(v, Tensor)}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and the metadata of one shard."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def shard_examples(tensors: dict[str, Tensor], meta: dict[str, str]) -> list[Example]:
    offsets = tensors["offsets"].tolist()
    tokens, mask = tensors["tokens"].to(torch.int64), tensors["loss_mask"].bool()
    ids = json.loads(meta["ids"])
    return [Example(id=ids[i], input_ids=tokens[a:b], loss_mask=mask[a:b])
            for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]


def shard_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    files = sorted(directory.glob(SHARD_GLOB))
    if not files:
        raise FileNotFoundError(f"{directory} holds no {SHARD_GLOB} files: run scripts/make_dataset.py first")
    return files


def example_id(prompt_id: str | int, temperature_index: int) -> str:
    """``"P@k"``: the answer to prompt ``P`` sampled at the ``k``-th of the dataset's temperatures."""
    return f"{prompt_id}@{temperature_index}"


def generation_temperatures(directory: str | Path) -> tuple[float, ...] | None:
    """The temperatures the dataset's responses were sampled at (``manifest.json``'s ``settings.temperatures``), or
    ``None`` when the directory records none (:func:`example_id` indexes into them)."""
    manifest = Path(directory) / MANIFEST
    if not manifest.is_file():
        return None
    temps = json.loads(manifest.read_text()).get("settings", {}).get("temperatures")
    return None if temps is None else tuple(float(t) for t in temps)


def example_temperature(example: Example, temperatures: tuple[float, ...]) -> float | None:
    """The temperature ``example`` was sampled at (its id, :func:`example_id`), or ``None`` for an id of another
    form."""
    _, sep, k = example.id.rpartition("@")
    if not sep or not k.isdigit() or int(k) >= len(temperatures):
        return None
    return temperatures[int(k)]


def load_dataset(directory: str | Path, limit: int | None = None) -> list[Example]:
    """All examples of a dataset directory, in shard order (at most ``limit``)."""
    examples: list[Example] = []
    for f in shard_files(directory):
        examples.extend(shard_examples(*read_shard(f)))
        if limit is not None and len(examples) >= limit:
            return examples[:limit]
    return examples


# --------------------------------------------------------------------------- in memory, on the device


@dataclass
class Batch:
    """Right-padded sequences; every field ``[B, S]``."""

    input_ids: Tensor  # int64
    attention_mask: Tensor  # bool: True on the first len_b positions
    loss_mask: Tensor  # bool: True on response tokens
    num_teacher_rows: int | None = None  # host-known count of reference.losses.teacher_rows (no device sync)


class TokenData:
    """A list of examples as one flat token buffer on a device; batches are built by one gather.

    Args:
        examples: the sequences.
        max_len: longer sequences are truncated to their first ``max_len`` tokens.
        device: where the buffer lives (the training device).
    """

    def __init__(self, examples: list[Example], max_len: int, device: torch.device | str = "cpu") -> None:
        if not examples:
            raise ValueError("no examples")
        self.lengths = [min(len(e.input_ids), max_len) for e in examples]
        # Per sequence, the target rows that teach a slot (reference.losses.teacher_rows), counted on the host
        # once, so that a batch knows its count without reading the device.
        self.teachers = [teacher_rows(e.loss_mask[:n]) for e, n in zip(examples, self.lengths)]
        self.tokens = torch.cat([e.input_ids[:n] for e, n in zip(examples, self.lengths)]).to(device)  # [T]
        self.loss_mask = torch.cat([e.loss_mask[:n] for e, n in zip(examples, self.lengths)]).to(device)  # [T]
        starts = [0]
        for n in self.lengths[:-1]:
            starts.append(starts[-1] + n)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)  # [N]
        self.lens = torch.tensor(self.lengths, dtype=torch.int64, device=device)  # [N]
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def batch(self, idx: list[int]) -> Batch:
        """Right-padded ``[B, S_max]`` batch of examples ``idx`` (one gather, no per-sequence loop)."""
        S = max(self.lengths[i] for i in idx)
        sel = torch.tensor(idx, dtype=torch.int64, device=self.device)  # [B]
        pos = torch.arange(S, device=self.device)  # [S]
        attn = pos[None, :] < self.lens[sel][:, None]  # [B, S]
        flat = (self.starts[sel][:, None] + pos[None, :]).clamp(max=self.tokens.numel() - 1)  # [B, S]
        ids = torch.where(attn, self.tokens[flat].to(torch.int64), 0)  # pad id 0 is masked everywhere
        return Batch(ids, attn, self.loss_mask[flat] & attn, sum(self.teachers[i] for i in idx))


def token_budget_batches(lengths: list[int], tokens_per_batch: int, seed: int, epoch: int, rank: int = 0,
                         world: int = 1, window: int = 256) -> list[list[int]]:
    """One epoch of index batches for one rank, with ``B · S_max ≤ tokens_per_batch`` (padded tokens).

    The epoch's shuffle is a function of ``(seed, epoch)`` only, shared by every rank; rank r keeps every
    world-th example (like DistributedSampler). Examples are sorted by length inside windows of ``window``
    so a batch holds similar lengths (little padding) while batches stay random; then the batch order is
    shuffled. A sequence longer than the budget forms a batch of one.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order = order[rank::world]
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        cur: list[int] = []
        longest = 0
        for i in sorted(order[start:start + window], key=lambda j: lengths[j]):
            if cur and (len(cur) + 1) * max(lengths[i], longest) > tokens_per_batch:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, lengths[i])
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def batch_stream(lengths: list[int], tokens_per_batch: int, seed: int, rank: int, world: int, skip: int):
    """Endless ``(epoch, indices)`` batches, epoch after epoch, starting after ``skip`` batches.

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


# --------------------------------------------------------------------------- sparse anchors (calibration, baseline)


def collate(examples: list[Example], max_len: int) -> Batch:
    """Right-pad (and right-truncate to ``max_len``) a list of examples on the CPU (sparse-anchor users)."""
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
