"""Fit Sequential Temperature Scaling per decoding mode on held-out proposals into the checkpoint (docs/method.md §3).

Names follow ``docs/method.md``: ``p_t`` target, ``p_d`` draft, ``c_k`` confidence, ``a_k = Π_{i≤k} c_i`` prefix
survival, ``ℓ`` verify length, γ block size, ``x_0`` anchor.

Where the proposals come from (the direct path). Running the reference decoding loop over prompts would
give the same kind of data slowly, one request at a time. Instead, on held-out *self-distilled* sequences
(``scripts/make_dataset.py --split heldout``), which are the target's own outputs:

1. one target forward over each sequence gives the tapped features of every position;
2. at random response positions ``p`` the drafter drafts a block from the anchor ``x_0 = ids[p]`` and the
   context ``< p`` exactly as at inference: the sequential head *samples* ``x_1..x_γ`` left to right
   (``sample_block``, argmax at T = 0) and reports the raw confidence logits ``z_1..z_γ``;
3. the target verifies the FULL block ``[x_0, x_1..x_γ]`` after the true prefix ``ids[:p]`` and
   ``reference.verify.rejection_sample`` decides acceptance with the random-number contract (greedy:
   argmax matches; T > 0: rejection-sampling outcomes);
4. the labels are the realised prefix survivals ``y_k = 1[drafts 1..k accepted]`` (all γ slots verified, so
   no slot is censored).

Contexts. Each mode is calibrated on the held-out sequences sampled at its own temperature (greedy on the greedy
answers, sampling on the T = 1 answers; ``--contexts matched``, the default, when the set records its temperatures),
so that the fit and the reported ECE are those of the text the mode's requests draft after. The two kinds of text
differ: after greedy text a draft survives more often, and a calibration fitted on both at once was off by up to
3.5 % ECE on the greedy answers alone (docs/benchmarks/index.md, "Calibration"). ``--contexts all`` uses every
sequence for every mode.

The calibration is then fitted per mode on one part of the held-out sequences and the ECE before/after is reported
per position on the other part (``--fit-fraction``), so the "after" number is not measured on the data it was
fitted to. ``--method sts-bias`` (default) fits a temperature and a bias per slot by log-loss
(``reference.calibration.fit_sts_bias``); ``--method sts`` is the paper's temperature-only ECE grid search
(``reference.calibration.fit_sts``); ``--method beta`` fits beta calibration, three parameters per slot, by log-loss
(``reference.calibration.fit_sts_beta``). The result goes into the checkpoint's ``config.json``
(``reference.checkpoint.update_sts_temperatures``); a JSON report and a reliability diagram PNG are written.

Example::

    python scripts/calibrate.py --drafter checkpoints/smollm2-135m-instruct-dspark --data data/sd-heldout \\
        --json runs/calibration.json --plot runs/reliability.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from reference.calibration import (
    apply_sts,
    calibration_report,
    fit_sts,
    fit_sts_beta,
    fit_sts_bias,
    prefix_survival,
    prefix_survival_labels,
    reliability_diagram,
)
from reference.checkpoint import load_drafter, read_drafter_config, update_sts_temperatures
from reference.drafter import DSparkDrafter
from reference.sampling import logits_to_probs
from reference.target import DEFAULT_TARGET, Target
from reference.verify import rejection_sample
from scripts.dataset import (
    Example,
    collate,
    example_temperature,
    generation_temperatures,
    load_dataset,
    pack_blocks,
    token_budget_batches,
)
from scripts.proposals import save_proposals
from scripts.runtime import hardware, resolve_device

log = logging.getLogger("dspark.calibrate")

MODES = {"greedy": 0.0, "sampling": 1.0}  # decoding mode -> draft/target temperature of its proposals
METHODS = ("sts-bias", "sts", "beta")


def store_calibration(drafter_dir: str, mode: str, result: dict) -> None:
    """Write one mode's fitted calibration (a :func:`calibrate_mode` result) into the checkpoint's config.json."""
    update_sts_temperatures(drafter_dir, mode, result["temperatures"], result["biases"], result["log_weights"])


def _verify_chunks(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Consecutive groups of verify sequences whose padded size stays within the token budget."""
    chunks, cur, width = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(width, n) > tokens_per_batch:
            chunks.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        chunks.append(cur)
    return chunks


@torch.no_grad()
def collect_proposals(target: Target, drafter: DSparkDrafter, examples: list[Example], *, temperature: float,
                      seed: int, anchors_per_seq: int, tokens_per_batch: int, max_seq_len: int = 2048,
                      progress: bool = True) -> dict[str, torch.Tensor]:
    """Draft real blocks at random anchors of held-out sequences and verify every slot with the target.

    Args:
        target, drafter: the models (the drafter attached to the target, same device).
        examples: held-out self-distilled sequences.
        temperature: 0 = greedy proposals and verification; > 0 = sampling at that temperature (top-p off).
        seed: generation seed of the random-number contract; anchors are drawn from it too.
        anchors_per_seq: proposals per sequence.
        tokens_per_batch: padded-token budget of one target forward.

    Returns:
        ``conf_logits [M, γ]`` float32, ``num_accepted [M]`` int64, ``sequence [M]`` (index of the example
        each proposal came from), ``anchor_pos [M]`` and ``draft_tokens [M, γ]``, on the CPU.
    """
    device, gamma = target.device, drafter.config.block_size
    lengths = [min(len(e.input_ids), max_seq_len) for e in examples]
    gen = torch.Generator().manual_seed(seed)
    confs, accepted, seqs, anchors, drafts = [], [], [], [], []
    next_request = 0
    batches = token_budget_batches(lengths, tokens_per_batch, seed, epoch=0)
    for idx in tqdm(batches, desc=f"proposals T={temperature:g}", unit="batch", disable=not progress):
        batch = collate([examples[i] for i in idx], max_seq_len)
        blocks = pack_blocks(batch, anchors_per_seq, gamma, gen)
        ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
        _, features = target.forward_batch(ids, attn.long())  # [B, S, m·d]
        B, S = ids.shape
        ctx_pos = torch.arange(S, device=device).expand(B, S)  # [B, S]
        blk = blocks.to(device)
        h = drafter(blk.anchor_ids, blk.anchor_pos, features, ctx_pos, attn)  # [B, nb, γ, d]
        real = blk.valid[:, :, 0]  # [B, nb]: padding blocks have no valid slot
        rows, cols = real.nonzero(as_tuple=True)  # [n] each
        n = rows.numel()
        if n == 0:
            continue
        anchor_ids, anchor_pos = blk.anchor_ids[rows, cols], blk.anchor_pos[rows, cols]  # [n] each
        request_ids = torch.arange(next_request, next_request + n, device=device)  # [n] unique per proposal
        next_request += n
        temps = torch.full((n,), float(temperature), device=device)
        draft = drafter.sample_block(h[rows, cols], anchor_ids, anchor_pos, temps, seed, request_ids)
        # Verify sequences: the true prefix ids[:p], then [x_0, x_1..x_γ] at positions p..p+γ.
        pos_cpu, rows_cpu = anchor_pos.cpu(), rows.cpu()
        seq_len = (pos_cpu + 1 + gamma).tolist()
        target_probs = torch.empty(n, gamma + 1, target.vocab_size, device=device)  # [n, γ+1, V]
        for chunk in _verify_chunks(seq_len, tokens_per_batch):
            width = max(seq_len[j] for j in chunk)
            vids = torch.zeros(len(chunk), width, dtype=torch.long)  # [c, W]
            vmask = torch.zeros(len(chunk), width, dtype=torch.long)  # [c, W]
            for r, j in enumerate(chunk):
                p = int(pos_cpu[j])
                vids[r, : p + 1] = batch.input_ids[int(rows_cpu[j]), : p + 1]
                vids[r, p + 1: p + 1 + gamma] = draft.tokens[j].cpu()
                vmask[r, : p + 1 + gamma] = 1
            logits, _ = target.forward_batch(vids.to(device), vmask.to(device))  # [c, W, V]
            sel = torch.tensor(chunk, device=device)
            rows_at = anchor_pos[sel][:, None] + torch.arange(gamma + 1, device=device)  # [c, γ+1] rows p..p+γ
            block_logits = logits[torch.arange(len(chunk), device=device)[:, None], rows_at]  # [c, γ+1, V]
            c = len(chunk)
            target_probs[sel] = logits_to_probs(block_logits, torch.full((c,), float(temperature), device=device),
                                                torch.ones(c, device=device),
                                                torch.zeros(c, dtype=torch.long, device=device))
            del logits
        lens = torch.full((n,), gamma, dtype=torch.long, device=device)  # full block verified
        result = rejection_sample(draft.tokens, lens, draft.probs, target_probs, seed, request_ids, anchor_pos)
        confs.append(draft.conf_logits.float().cpu())
        accepted.append(result.num_accepted.cpu())
        seqs.append(torch.tensor(idx)[rows_cpu])
        anchors.append(pos_cpu)
        drafts.append(draft.tokens.cpu())
    if not confs:
        raise ValueError("no proposals: the held-out sequences have no response positions to anchor on")
    return {"conf_logits": torch.cat(confs), "num_accepted": torch.cat(accepted).long(), "sequence": torch.cat(seqs),
            "anchor_pos": torch.cat(anchors), "draft_tokens": torch.cat(drafts)}


def mode_contexts(examples: list[Example], temperatures: tuple[float, ...] | None, temperature: float, contexts: str
                  ) -> tuple[list[Example], str]:
    """The held-out sequences one mode is calibrated on, and a description of them for the report.

    ``contexts="matched"``: those sampled at ``temperature`` (greedy: 0), if the set records its temperatures and
    holds some; otherwise (and with ``"all"``) every sequence."""
    if contexts == "all":
        return examples, "every held-out sequence"
    if temperatures is None:
        log.warning("the held-out set records no sampling temperatures (no manifest.json): calibrating on every "
                    "sequence")
        return examples, "every held-out sequence (the set records no temperatures)"
    chosen = [e for e in examples if example_temperature(e, temperatures) == temperature]
    if not chosen:
        log.warning("no held-out sequence was sampled at T = %g (the set has %s): calibrating on every sequence",
                    temperature, ", ".join(f"{t:g}" for t in temperatures))
        return examples, f"every held-out sequence (none sampled at T = {temperature:g})"
    return chosen, f"the held-out sequences sampled at T = {temperature:g}"


def conditional_acceptance(num_accepted: torch.Tensor, gamma: int) -> list[float | None]:
    """P(slot k accepted | slots 1..k-1 accepted), k = 1..γ (paper Figure 2), from full-block proposals."""
    out = []
    for k in range(1, gamma + 1):
        reached = int((num_accepted >= k - 1).sum())
        out.append(float((num_accepted >= k).sum()) / reached if reached else None)
    return out


def fit_split(sequence: torch.Tensor, fit_fraction: float, seed: int) -> torch.Tensor:
    """[M] bool, True for proposals of the sequences used to fit (a seeded random fraction of the sequences)."""
    ids = sorted(set(sequence.tolist()))
    random.Random(seed).shuffle(ids)
    n_fit = max(1, round(fit_fraction * len(ids))) if fit_fraction < 1 else len(ids)
    fit_ids = torch.tensor(ids[:n_fit])
    return torch.isin(sequence, fit_ids)


def calibrate_mode(proposals: dict[str, torch.Tensor], gamma: int, fit_fraction: float, seed: int,
                   method: str = "sts-bias") -> dict:
    """Fit the calibration (``method`` "sts-bias", "sts" or "beta") on the fit split; report ECE per position on
    both splits (JSON-ready). ``biases`` is ``None`` for "sts", ``log_weights`` is ``None`` except for "beta"."""
    z, acc = proposals["conf_logits"], proposals["num_accepted"]
    labels = prefix_survival_labels(acc, torch.full_like(acc, gamma), gamma)  # [M, γ], nothing censored
    fit = fit_split(proposals["sequence"], fit_fraction, seed)
    held = ~fit if bool((~fit).any()) else fit  # with --fit-fraction 1 the report is on the fit data itself
    weights = None
    if method == "sts-bias":
        temps, biases = fit_sts_bias(z[fit], labels[fit])
    elif method == "sts":
        temps, biases = fit_sts(z[fit], labels[fit]), None
    elif method == "beta":
        temps, biases, weights = fit_sts_beta(z[fit], labels[fit])
    else:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    return {
        "method": method, "temperatures": temps, "biases": biases, "log_weights": weights,
        "num_proposals": int(z.shape[0]), "num_fit": int(fit.sum()), "num_report": int(held.sum()),
        "report_on_fit_data": not bool((~fit).any()),
        "mean_accepted_length": float(acc.float().mean() + 1),
        "per_position_acceptance": conditional_acceptance(acc, gamma),
        "ece_fit": calibration_report(z[fit], labels[fit], temps, biases=biases, log_weights=weights),
        "ece_heldout": calibration_report(z[held], labels[held], temps, biases=biases, log_weights=weights),
        "reliability": {
            "before": [reliability_diagram(prefix_survival(torch.sigmoid(z[held].double()))[:, k], labels[held, k])
                       for k in range(gamma)],
            "after": [reliability_diagram(prefix_survival(apply_sts(z[held].double(), temps, biases, weights))[:, k],
                                          labels[held, k]) for k in range(gamma)],
        },
    }


def plot_reliability(results: dict[str, dict], path: Path, title: str) -> None:
    """One row per mode, one panel per slot: bin accuracy vs mean a_k before (grey) and after STS (blue)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    gamma = len(next(iter(results.values()))["reliability"]["before"])
    fig, axes = plt.subplots(len(modes), gamma, figsize=(2.2 * gamma, 2.4 * len(modes)), squeeze=False)
    for r, mode in enumerate(modes):
        rel = results[mode]["reliability"]
        for k in range(gamma):
            ax = axes[r][k]
            ax.plot([0, 1], [0, 1], color="black", lw=0.7, ls=":")
            for key, color in (("before", "0.6"), ("after", "tab:blue")):
                d = rel[key][k]
                pts = [(c, a) for c, a in zip(d["mean_confidence"], d["accuracy"]) if c is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", ms=2.5, lw=1, color=color,
                            label=f"{key} ECE {100 * d['ece']:.1f}%")
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.set_title(f"{mode}, a_{k + 1}", fontsize=8)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=5, loc="upper left")
            if k == 0:
                ax.set_ylabel("realised survival", fontsize=7)
            if r == len(modes) - 1:
                ax.set_xlabel("predicted a_k", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory (its config.json is updated)")
    p.add_argument("--data", required=True, help="held-out self-distilled set (make_dataset.py --split heldout)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: 'smollm2-135m-instruct', a .gguf or an HF dir")
    p.add_argument("--modes", default="greedy,sampling", help="comma list of decoding modes to calibrate")
    p.add_argument("--sampling-temperature", type=float, default=1.0, help="temperature of the sampling mode")
    p.add_argument("--max-examples", type=int, default=None, help="use at most this many held-out sequences")
    p.add_argument("--contexts", default="matched", choices=["matched", "all"],
                   help="matched: each mode on the sequences sampled at its temperature (when the set records them); "
                        "all: every sequence for every mode")
    p.add_argument("--anchors-per-seq", type=int, default=16, help="proposals per sequence")
    p.add_argument("--tokens-per-batch", type=int, default=16384, help="padded tokens per target forward")
    p.add_argument("--fit-fraction", type=float, default=0.5,
                   help="share of sequences used to fit; ECE is reported on the rest (1 = fit and report on all)")
    p.add_argument("--seed", type=int, default=0,
                   help="root of the random-number contract (proposals and the fit/report split) (default: "
                         "%(default)s)")
    p.add_argument("--method", default="sts-bias", choices=list(METHODS),
                   help="sts-bias: temperature + bias per slot by log-loss; sts: the paper's temperature-only ECE "
                        "grid search; beta: beta calibration (3 parameters per slot) by log-loss")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the report here (default DRAFTER/calibration.json)")
    p.add_argument("--dump-proposals", default=None,
                   help="directory for proposals-<mode>.safetensors (raw confidence logits + accepted counts, "
                        "scripts/proposals.py)")
    p.add_argument("--plot", default=None, help="reliability diagram PNG (default DRAFTER/reliability.png)")
    p.add_argument("--no-write", action="store_true", help="do not update the checkpoint's config.json")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes must name some of {', '.join(MODES)}, got {args.modes!r}")
    if not 0 < args.fit_fraction <= 1:
        raise SystemExit(f"--fit-fraction must lie in (0, 1], got {args.fit_fraction}")
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    cfg = read_drafter_config(args.drafter)
    target = Target.load(args.model, layer_ids=cfg.target_layer_ids, device=device,
                         dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    drafter = load_drafter(args.drafter, target, device=device, dtype=target.dtype)
    examples = load_dataset(args.data, limit=args.max_examples)
    log.info("calibrating %s on %d held-out sequences, modes %s", args.drafter, len(examples), modes)
    results = {}
    temps = generation_temperatures(args.data)
    for mode in modes:
        temperature = args.sampling_temperature if mode == "sampling" else MODES[mode]
        chosen, contexts = mode_contexts(examples, temps, temperature, args.contexts)
        log.info("%s: %d sequences (%s)", mode, len(chosen), contexts)
        proposals = collect_proposals(target, drafter, chosen, temperature=temperature, seed=args.seed,
                                      anchors_per_seq=args.anchors_per_seq, tokens_per_batch=args.tokens_per_batch)
        res = calibrate_mode(proposals, cfg.block_size, args.fit_fraction, args.seed, args.method)
        res.update(temperature=temperature, contexts=contexts, num_sequences=len(chosen))
        if args.dump_proposals:
            # Raw proposals (logits + full-block outcomes) for offline studies: the static-threshold sweep
            # (scripts/threshold_sweep.py) simulates any policy exactly from these, since a verified slot's
            # outcome does not depend on how many later slots were verified.
            save_proposals(args.dump_proposals, mode, proposals["conf_logits"], proposals["num_accepted"],
                           gamma=cfg.block_size, temperature=temperature,
                           calibration={k: res[k] for k in ("temperatures", "biases", "log_weights")})
        results[mode] = res
        before = [p["ece_before"] for p in res["ece_heldout"]["positions"]]
        after = [p["ece_after"] for p in res["ece_heldout"]["positions"]]
        log.info("%s: %d proposals, τ = %.3f, T_k = %s", mode, res["num_proposals"], res["mean_accepted_length"],
                 " ".join(f"{t:.3f}" for t in res["temperatures"]))
        floor = [p["ece_floor_median"] for p in res["ece_heldout"]["positions"]]
        log.info("%s held-out ECE before %s -> after %s (a perfectly calibrated predictor would measure %s)", mode,
                 *(" ".join("-" if e is None else f"{100 * e:.1f}%" for e in v) for v in (before, after, floor)))
        if not args.no_write:
            store_calibration(args.drafter, mode, res)
    command = " ".join(["scripts/calibrate.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"drafter": str(args.drafter), "data": str(args.data), "model": args.model,
              "num_sequences": len(examples), "anchors_per_seq": args.anchors_per_seq, "seed": args.seed,
              "fit_fraction": args.fit_fraction, "written_to_config": not args.no_write, "modes": results,
              "hardware": hardware(device, 1), "wall_s": round(time.perf_counter() - t0, 1), "command": command}
    json_path = Path(args.json) if args.json else Path(args.drafter) / "calibration.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot_path = Path(args.plot) if args.plot else Path(args.drafter) / "reliability.png"
    plot_reliability(results, plot_path, f"STS reliability, {Path(args.drafter).name} (held-out proposals)")
    log.info("wrote %s and %s", json_path, plot_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
