"""Choose a drafter's draft vocabulary: the Vd token ids the target emits most often, from self-distilled data.

A draft vocabulary (``DrafterConfig.draft_vocab_size``, docs/method.md §1) makes the drafter propose only Vd of the
target's V tokens: its LM-head product and its sequential head's softmax and draw run over Vd lanes instead of V,
which is most of the draft stage at large batch (the draft head swept all 49,152 tokens of SmolLM2 seven times a
step). ``p_d`` is 0 outside the subset, so decoding stays lossless; a draft can only be accepted where the target's
token lies inside it, so the cost is the target's probability mass outside the subset. EAGLE-3 ships the same idea
(``draft_vocab_size``, the ``d2t`` / ``t2d`` tables of the speculators format, which ``scripts/export_speculators.py``
writes for such a drafter).

The subset is the ``--size`` most frequent tokens of the *responses* (``loss_mask``) of a dataset written by
``scripts/make_dataset.py`` — the target's own outputs on training prompts, never an evaluation set — plus
``--always`` ids (end-of-turn and other special tokens a drafter must be able to propose). Ties in frequency go to
the lower id. The report gives the coverage (share of response tokens inside the subset) on that data and, with
``--heldout-data``, on held-out responses, for every size of ``--report-sizes``::

    python -m scripts.draft_vocab --data data/train --heldout-data data/heldout --size 16384 \\
        --drafter checkpoints/smollm2-135m-instruct-dspark --out checkpoints/dspark-vd16k --json vocab.json

``--out`` writes a copy of ``--drafter`` restricted to the subset (``reference.checkpoint.write_draft_vocab``: every
stored tensor keeps its bytes, int8 weights included; calibration and metadata unchanged; ``--out`` equal to
``--drafter`` rewrites it in place). Without ``--drafter`` only the report is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from reference.checkpoint import load_drafter, write_draft_vocab
from reference.cli import LOG_FORMAT
from scripts.dataset import read_shard, shard_files

log = logging.getLogger("dspark.draft_vocab")

DEFAULT_REPORT_SIZES = (4096, 8192, 16384, 24576, 32768)


def response_counts(directory: str | Path, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64: how often each token occurs in the responses (``loss_mask``) of a dataset directory."""
    try:
        files = shard_files(directory)
    except FileNotFoundError as err:
        raise SystemExit(f"no dataset shards: {err}") from err
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in tqdm(files, desc=f"counting {Path(directory).name}", unit="shard"):
        tensors, _ = read_shard(path)
        tokens = tensors["tokens"].long()[tensors["loss_mask"].bool()]
        if tokens.numel() and int(tokens.max()) >= vocab_size:
            raise SystemExit(f"{path}: token id {int(tokens.max())} outside the vocabulary of {vocab_size}")
        counts += torch.bincount(tokens, minlength=vocab_size)
    return counts


def choose(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` ids of the draft vocabulary, ascending: every ``always`` id, then the most frequent ids (ties to
    the lower id)."""
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise SystemExit(f"--size must lie in [1, {vocab_size}], got {size}")
    bad = [t for t in always if not 0 <= t < vocab_size]
    if bad:
        raise SystemExit(f"--always ids {bad} outside the vocabulary of {vocab_size}")
    if len(set(always)) > size:
        raise SystemExit(f"--always names {len(set(always))} ids, more than --size {size}")
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[torch.tensor(sorted(set(always)), dtype=torch.long)] = True
    # The rest by count descending, ties to the lower id (a stable sort of the ids by -count keeps it first).
    order = torch.sort(-counts, stable=True).indices
    rest = order[~keep[order]][: size - int(keep.sum())]
    keep[rest] = True
    return keep.nonzero().flatten()


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of counted tokens inside ``ids``."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else float("nan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", required=True, nargs="+",
                   help="dataset directories (scripts/make_dataset.py, training prompts) whose responses are counted")
    p.add_argument("--heldout-data", nargs="*", default=[],
                   help="dataset directories of held-out prompts: coverage reported there too (never chosen from)")
    p.add_argument("--size", type=int, default=16384, help="Vd, the number of token ids kept")
    p.add_argument("--always", default="",
                   help="comma-separated ids kept whatever their count (end-of-turn ids occur once per response, so "
                        "the counts keep them anyway)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="V when no --drafter gives it (the target's vocabulary size)")
    p.add_argument("--drafter", default=None, help="drafter checkpoint to restrict (its V is the vocabulary size)")
    p.add_argument("--out", default=None, help="where the restricted drafter is written (needs --drafter)")
    p.add_argument("--report-sizes", default=",".join(map(str, DEFAULT_REPORT_SIZES)),
                   help="comma-separated sizes whose coverage the report lists")
    p.add_argument("--json", default=None, help="write the report (sizes, coverage, the chosen ids) here")
    args = p.parse_args(argv)
    if args.out and not args.drafter:
        p.error("--out needs --drafter, the checkpoint to restrict")
    if not args.drafter and not args.vocab_size:
        p.error("give --drafter (its vocabulary size) or --vocab-size")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    args = parse_args(argv)
    drafter = None
    always = [int(t) for t in args.always.split(",") if t.strip()]
    if args.drafter:
        drafter = load_drafter(args.drafter)
        vocab_size = drafter.config.vocab_size
        if drafter.draft_vocab is not None:
            log.info("%s already has a draft vocabulary of %d ids: it is replaced", args.drafter,
                     drafter.config.draft_vocab_size)
    else:
        vocab_size = args.vocab_size
    counts = sum(response_counts(d, vocab_size) for d in args.data)
    heldout = sum(response_counts(d, vocab_size) for d in args.heldout_data) if args.heldout_data else None
    log.info("%d response tokens counted, %d distinct ids", int(counts.sum()), int((counts > 0).sum()))
    sizes = sorted({int(s) for s in args.report_sizes.split(",") if s.strip()} | {args.size})
    rows = []
    for size in sizes:
        if size > vocab_size:
            continue
        ids = choose(counts, size, always)
        row = {"size": size, "coverage_train": round(coverage(counts, ids), 5)}
        if heldout is not None:
            row["coverage_heldout"] = round(coverage(heldout, ids), 5)
        rows.append(row)
        log.info("Vd = %6d: coverage %.4f on the counted responses%s", size, row["coverage_train"],
                 f", {row['coverage_heldout']:.4f} held out" if heldout is not None else "")
    ids = choose(counts, args.size, always)
    report = {
        "command": "python -m scripts.draft_vocab " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "vocab_size": vocab_size,
        "size": args.size,
        "response_tokens": int(counts.sum()),
        "heldout_response_tokens": None if heldout is None else int(heldout.sum()),
        "sizes": rows,
        "ids": ids.tolist(),
    }
    if args.out:
        out = Path(args.out)
        if out.resolve() != Path(args.drafter).resolve():
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(args.drafter, out)  # weights, model card, training record: as they are
        coverage_row = next(r for r in rows if r["size"] == args.size)
        write_draft_vocab(out, ids, extra={"draft_vocab": {"command": report["command"], "size": args.size,
                                                           "response_tokens": report["response_tokens"],
                                                           "coverage": coverage_row}})
        log.info("wrote %s: the drafter of %s restricted to %d ids", out, args.drafter, args.size)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
