"""Store a drafter's weight matrices in 8 bits, and measure what that costs in acceptance.

``reference.checkpoint`` can keep every weight matrix of a drafter (but the confidence head's single row) as int8
with one float32 scale per row (``save_drafter(..., weights="int8")``), half the size of bfloat16. This script writes
such a copy of a checkpoint (the calibration, the training provenance and the run's README travel with it) and, with
``--check``, measures the two side by side (names as in docs/method.md: ``p_t`` target, ``p_d`` draft):

1. the target continues each prompt of ``--prompts-file`` greedily and at T = 1 (the engine, mode none, ``--seed``);
2. both drafters are teacher-forced on those continuations, a block anchored at every response position
   (``optimized.training.dense_backbone`` + ``head_logits`` with the true previous tokens);
3. per slot: the acceptance proxy ``Σ_v min(p_t, p_d)`` of each drafter (at T = 1 the chance that a sampled draft
   token survives verification; at T = 0 the target's and the draft's distributions are compared unsharpened),
   each drafter's greedy match with the target, how often the two drafters' argmax agree, and the total-variation
   distance between their distributions.

Usage::

    python -m scripts.quantize_drafter --drafter DIR --out DIR_INT8
    python -m scripts.quantize_drafter --drafter DIR --out DIR_INT8 --check \\
        --prompts-file docs/benchmarks/eval_prompts.jsonl --limit 30 --max-new-tokens 128 --json report.json

``--out`` may be ``--drafter`` itself (the weights are replaced in place).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from optimized.generate import generate
from optimized.training import dense_backbone
from reference.checkpoint import CONFIG_FILE, load_drafter, save_drafter
from reference.cli import read_domain_prompts
from reference.config import GenerationConfig, SchedulerConfig
from reference.drafter import DSparkDrafter
from reference.losses import dense_block_targets
from reference.target import DEFAULT_TARGET, Target
from scripts.runtime import hardware, resolve_device

log = logging.getLogger("dspark.quantize_drafter")
RUN_FILES = ("README.md", "summary.json", "metrics.jsonl")  # the training run's record, copied beside the weights


def quantize(src: Path, out: Path) -> None:
    """Write ``src`` to ``out`` with int8 weight matrices, keeping its dtype, calibration and ``extra``."""
    config = json.loads((src / CONFIG_FILE).read_text())
    drafter = load_drafter(src)  # the stored dtype, on the CPU
    if config.get("quantization"):
        log.info("%s is already stored in int8; rewriting it unchanged in form", src)
    save_drafter(drafter, out, extra=config.get("extra"), weights="int8")
    if out.resolve() != src.resolve():
        for name in RUN_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)


def weight_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("model*.safetensors"))


def continuations(target: Target, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int
                  ) -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's continuation) per prompt: the engine without speculation (EOS honoured)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    results = generate(target, None, prompts, gen, SchedulerConfig(mode="none"))
    return [(r.prompt_ids, r.token_ids) for r in results]


@torch.no_grad()
def compare(target: Target, drafters: dict[str, DSparkDrafter], seqs: list[tuple[list[int], list[int]]],
            temperature: float) -> dict:
    """Per-slot teacher-forced agreement of each drafter with the target and of the drafters with each other."""
    names = list(drafters)
    gamma = drafters[names[0]].config.block_size
    device = next(drafters[names[0]].parameters()).device
    sums = {k: torch.zeros(gamma, dtype=torch.float64) for k in
            [f"sum_min_{n}" for n in names] + [f"greedy_match_{n}" for n in names] + ["argmax_agree", "tv", "n"]}
    for prompt, out in tqdm(seqs, desc=f"teacher-forced, T = {temperature:g}", leave=False):
        if not out:
            continue
        ids = torch.tensor([prompt + out], device=device)  # [1, S]
        mask = torch.ones_like(ids, dtype=torch.bool)  # [1, S]
        response = torch.zeros_like(mask)
        response[0, len(prompt):] = True
        logits_t, features = target.forward_batch(ids, mask.long())  # [1, S, V], [1, S, m·d]
        tg = dense_block_targets(ids, response, gamma)
        rows = tg.valid[0].any(-1)  # anchors with at least one supervised slot
        prev, valid, pos = tg.prev_tokens[0][rows], tg.valid[0][rows], tg.target_pos[0][rows]  # [n, γ]
        p_t = torch.softmax(logits_t[0][pos].float() / max(temperature, 1.0), -1)  # [n, γ, V]
        z = {}
        for n, d in drafters.items():
            h = dense_backbone(d, ids, features.to(next(d.parameters()).dtype), mask)[0][rows]  # [n, γ, d]
            z[n] = d.head_logits(h, prev)[0].float()  # [n, γ, V]
            sums[f"sum_min_{n}"] += (torch.minimum(p_t, torch.softmax(z[n], -1)).sum(-1) * valid).sum(0).double().cpu()
            sums[f"greedy_match_{n}"] += ((z[n].argmax(-1) == p_t.argmax(-1)) * valid).sum(0).double().cpu()
        a, b = (z[n] for n in names[:2])
        sums["argmax_agree"] += ((a.argmax(-1) == b.argmax(-1)) * valid).sum(0).double().cpu()
        tv = (torch.softmax(a, -1) - torch.softmax(b, -1)).abs().sum(-1) / 2  # [n, γ]
        sums["tv"] += (tv * valid).sum(0).double().cpu()
        sums["n"] += valid.sum(0).double().cpu()
    count = sums.pop("n").clamp(min=1)
    report = {k: [round(x, 4) for x in (v / count).tolist()] for k, v in sums.items()}
    report["slots"] = count.long().tolist()
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=type("Formatter", (argparse.RawDescriptionHelpFormatter,
                                                               argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--drafter", required=True, help="checkpoint directory to quantize")
    p.add_argument("--out", required=True, help="where the int8 copy goes (may be --drafter itself)")
    p.add_argument("--check", action="store_true", help="measure the copy against the original (see above)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="the drafter's target (for --check)")
    p.add_argument("--prompts-file", default="docs/benchmarks/eval_prompts.jsonl", help="JSONL prompts (--check)")
    p.add_argument("--limit", type=int, default=30, help="prompts used, spread evenly over the file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's continuations")
    p.add_argument("--seed", type=int, default=7, help="seed of the T = 1 continuations")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--json", default=None, help="write the --check report here")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    src, out = Path(args.drafter), Path(args.out)
    if not args.check:
        quantize(src, out)
        log.info("wrote %s", out)
        return 0
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    target = Target.load(args.model, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    original = load_drafter(src, target)  # loaded before an in-place --out replaces it
    size = {"original": weight_bytes(src)}
    quantize(src, out)
    size["int8"] = weight_bytes(out)
    drafters = {"original": original, "int8": load_drafter(out, target)}
    rows = read_domain_prompts(args.prompts_file, target, chat_template=True)
    rows = rows[::max(1, len(rows) // args.limit)][:args.limit]
    report = {"drafter": str(src), "out": str(out), "model": args.model, "hardware": hardware(device),
              "command": "python -m scripts.quantize_drafter " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": {"prompts_file": args.prompts_file, "prompts": len(rows),
                           "max_new_tokens": args.max_new_tokens, "seed": args.seed},
              "weight_bytes": size,
              "results": {}}
    for temperature in (0.0, 1.0):
        seqs = continuations(target, [ids for _, ids in rows], temperature, args.max_new_tokens, args.seed)
        log.info("T = %g: %d continuation tokens", temperature, sum(len(o) for _, o in seqs))
        report["results"][f"T={temperature:g}"] = compare(target, drafters, seqs, temperature)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
