"""Export a DSpark drafter to the ``speculators`` DSpark format that vLLM loads (``--speculative-config``).

The drafter is the one of docs/method.md §1; ``docs/vllm.md`` shows how to serve the result. Names follow
``docs/method.md``: ``p_t`` target, ``p_d`` draft, ``c_k`` confidence, ``ℓ`` verify length, ``γ`` block size,
``x_0`` the anchor.

Usage::

    python -m scripts.export_speculators --drafter DIR --out OUT [--model smollm2-135m-instruct] \\
        [--verifier NAME_OR_PATH] [--dtype bfloat16]

``OUT`` receives ``config.json`` and ``model.safetensors`` in the layout of the ``speculators`` package's
``DSparkDraftModel`` (``speculators_model_type: "dspark"``).

The two formats describe the same network. Our checkpoint (``reference/checkpoint.py``) → theirs:

====================================  ==========================================================================
ours                                  speculators / vLLM
====================================  ==========================================================================
``context_proj`` (W_c)                ``fc``
``context_norm``                      ``hidden_norm``
``layers.{i}.*``                      ``layers.{i}.*`` (a Qwen3-style layer; ``o_proj.bias`` zeros if q/k/v have
                                      biases, because their ``attention_bias`` covers all four projections)
``final_norm``                        ``norm``
Markov W1 [V, r], W2 [V, r]           ``markov_head.markov_w1`` / ``markov_w2`` (factored heads are materialised
                                      first: ``DSparkDrafter.markov_tables``)
RNN W1, cell, W2                      ``markov_head.markov_w1`` / ``joint_proj`` / ``markov_w2``
                                      (``markov_head_type: "rnn"``, the same recurrence)
no sequential head (B = 0)            a rank-1 Markov head of zeros, and a confidence head reading ``h_k`` only
``conf_head``                         ``confidence_head.proj``
tapped layer ``l`` (output of ``l``)  ``aux_hidden_state_layer_ids`` ``l + 1`` (their id is HF's
                                      ``hidden_states[l]``, the *input* of layer ``l``)
embedding, LM head                    not saved: the verifier's, shared and frozen, in both
``draft_vocab`` (Vd ascending ids)    ``draft_vocab_size`` = Vd, ``d2t`` [Vd] (offsets: token = i + d2t[i]),
                                      ``t2d`` [V] (bool, True for the Vd tokens); ``markov_w2`` and their LM head
                                      hold those Vd rows (their loader picks the LM head's rows by ``t2d``)
====================================  ==========================================================================

Our block is anchor-first: slot k of ``[x_0, M, …, M]`` predicts ``x_{k+1}``, which is their
``sample_from_anchor: true`` with ``block_size = γ`` (γ speculative tokens per step). The mask ``M`` is the
embedding row ``mask_token_id``.

What the format cannot express is refused with the reason: a learned mask vector (their mask is always a vocabulary
row) and a drafter without per-head q/k RMSNorm (their layer always has ``q_norm``/``k_norm``). Our STS calibration
(docs/method.md §3) travels as the extra key ``sts_calibration``; the speculators config allows extra keys and vLLM
does not read them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from reference.checkpoint import load_drafter, read_drafter_config
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter, MarkovHead, RNNHead
from reference.target import DEFAULT_TARGET, Target

log = logging.getLogger("dspark.export_speculators")

# The speculators release whose DSparkSpeculatorConfig / DSparkDraftModel this layout was written against and
# tested with (tests/scripts/test_export_speculators.py).
SPECULATORS_VERSION = "0.9.0"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """The drafter uses something the speculators DSpark format cannot express."""


def check_exportable(cfg: DrafterConfig) -> None:
    """Raise :class:`ExportError` listing every feature of ``cfg`` the speculators DSpark format cannot hold."""
    problems = []
    if cfg.mask_token_id is None:
        problems.append(
            "it masks with a learned vector (mask_token_id is None); the speculators/vLLM DSpark drafter embeds the "
            "mask as a vocabulary row (mask_token_id), so this drafter's mask cannot be written. Train one with a "
            "vocabulary-row mask token (scripts/train_drafter.py --mask-token-id auto or an id; the default)")
    if not cfg.qk_norm:
        problems.append(
            "it has no per-head q/k RMSNorm (qk_norm is False); the speculators/vLLM DSpark layer always normalises "
            "queries and keys per head, which is not the identity. Train one with --qk-norm (the default)")
    if problems:
        raise ExportError("cannot export this drafter to the speculators DSpark format: " + "; ".join(problems))


def speculators_config(cfg: DrafterConfig, *, verifier_name_or_path: str, verifier_architectures: list[str],
                       max_position_embeddings: int) -> dict[str, Any]:
    """The ``config.json`` of a speculators DSpark checkpoint holding the drafter ``cfg``.

    Args:
        cfg: the drafter's config (validated by :func:`check_exportable`).
        verifier_name_or_path: recorded as the verifier; speculators reads the embedding and LM head from it, and
            ``vllm serve OUT`` would serve it as the target.
        verifier_architectures: the verifier's HF ``architectures``.
        max_position_embeddings: the target's; vLLM sizes the drafter's rotary tables by it.
    """
    gamma, d = cfg.block_size, cfg.hidden_size
    head_type = {"markov": "vanilla", "rnn": "rnn", "none": "vanilla"}[cfg.head]
    rank = 1 if cfg.head == "none" else cfg.markov_rank  # "none": a zero rank-1 head gives B = 0 exactly
    layer = {
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": d,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        # Our drafter rotates with plain RoPE at the target's θ (reference.drafter.rope_cos_sin), whatever scaling
        # the target itself uses, so the exported layer says exactly that.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(max_position_embeddings),
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }
    config: dict[str, Any] = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        # Vd with a draft vocabulary (t2d / d2t tables in the weights), else the full vocabulary (no tables)
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": d,
        "block_size": gamma,
        "aux_hidden_state_layer_ids": [int(l) + 1 for l in cfg.target_layer_ids],
        "mask_token_id": int(cfg.mask_token_id),
        "sample_from_anchor": True,
        # Full-attention layers are non-causal inside the block either way; true also keeps vLLM versions that
        # translate this flag into a global ``causal`` override from making the block causal.
        "sliding_window_non_causal": True,
        "markov_rank": rank,
        "markov_head_type": head_type,
        "enable_confidence_head": True,
        "confidence_head_with_markov": cfg.head != "none",
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
        # Extra keys (speculators keeps them, vLLM does not read them): our per-slot calibration
        # ĉ_k = σ(z_k / T_k + b_k) per decoding mode (docs/method.md §3) and the source drafter's own config.
        "sts_calibration": {mode: {"temperatures": list(temps), "biases": list(cfg.sts_biases.get(mode, [0.0] * gamma)),
                                   "log_weights": list(cfg.sts_log_weights.get(mode, [0.0] * gamma))}
                            for mode, temps in cfg.sts_temperatures.items()},
        "source_drafter_config": cfg.to_dict(),
    }
    return config


def speculators_state_dict(drafter: DSparkDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors under speculators' names, in ``dtype`` (embedding and LM head excluded).

    A factored Markov head is materialised through the attached target (``DSparkDrafter.markov_tables``), in the
    drafter's dtype; load the drafter in float32 for tables rounded once.
    """
    cfg = drafter.config
    check_exportable(cfg)
    ours = drafter.state_dict()
    renames = {"context_proj.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight",
               "final_norm.weight": "norm.weight", "conf_head.weight": "confidence_head.proj.weight",
               "conf_head.bias": "confidence_head.proj.bias"}
    out = {theirs: ours[name] for name, theirs in renames.items()}
    out.update({name: t for name, t in ours.items() if name.startswith("layers.")})
    if cfg.attention_bias:
        # Their attention_bias also puts a bias on o_proj; ours has none, i.e. zero.
        for i in range(cfg.num_layers):
            out[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
    head = drafter.seq_head
    vocab = drafter.draft_vocab  # [Vd] or None
    if isinstance(head, MarkovHead):
        w1, w2 = drafter.markov_tables()  # [V, r] each, as Embedding(V, r).weight / Linear(r, V).weight
        out["markov_head.markov_w1.weight"], out["markov_head.markov_w2.weight"] = w1, w2
    elif isinstance(head, RNNHead):
        out["markov_head.markov_w1.weight"] = ours["seq_head.w1.weight"]
        out["markov_head.joint_proj.weight"] = ours["seq_head.cell.weight"]  # over [s_{k-1}; W1[x_{k-1}]; h_k]
        out["markov_head.joint_proj.bias"] = ours["seq_head.cell.bias"]
        out["markov_head.markov_w2.weight"] = ours["seq_head.w2.weight"]
    else:
        out["markov_head.markov_w1.weight"] = torch.zeros(cfg.vocab_size, 1)
        out["markov_head.markov_w2.weight"] = torch.zeros(cfg.vocab_size, 1)
    if vocab is not None:  # W1 stays indexed by the verifier's ids; W2 projects to the draft vocabulary only
        ids = vocab.to(out["markov_head.markov_w2.weight"].device)
        out["markov_head.markov_w2.weight"] = out["markov_head.markov_w2.weight"].index_select(0, ids)
        out["d2t"] = vocab - torch.arange(vocab.numel(), device=vocab.device)  # their offsets: id = i + d2t[i]
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=vocab.device)
        out["t2d"] = t2d.index_fill_(0, vocab, True)
    exported = {k for k in renames} | {k for k in ours if k.startswith(("layers.", "seq_head."))} | {"draft_vocab"}
    left = sorted(set(ours) - exported)
    if left:  # a new drafter parameter this mapping does not know about must not be dropped silently
        raise ExportError(f"no speculators name for drafter tensors {left}")
    # floating tensors in the export dtype; the vocabulary tables keep theirs (int64 offsets, a bool mask)
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous() for k, v in out.items()}


def export_speculators(drafter_dir: str | os.PathLike, out_dir: str | os.PathLike, *, model: str = DEFAULT_TARGET,
                       target: Target | None = None, verifier: str | None = None, dtype: torch.dtype | None = None,
                       target_dtype: torch.dtype = torch.float32) -> Path:
    """Write the drafter in ``drafter_dir`` as a speculators DSpark checkpoint into ``out_dir``.

    Args:
        drafter_dir: our checkpoint directory (``reference.checkpoint.save_drafter``).
        out_dir: destination (created; its ``config.json`` and ``model.safetensors`` are replaced).
        model: the target to load when ``target`` is None (name, .gguf or HF directory, as in ``Target.load``).
        target: an already loaded target (its embedding materialises factored Markov tables; its shapes are checked).
        verifier: the verifier recorded in the config; default: the HF directory the target was loaded from.
        dtype: tensor dtype of the export; default: the drafter checkpoint's.
        target_dtype: dtype ``model`` is loaded in (the whole target is loaded, on the CPU).

    Returns:
        ``out_dir`` as a Path.
    """
    cfg = read_drafter_config(drafter_dir)
    check_exportable(cfg)  # before loading anything
    if dtype is None:
        stored = json.loads((Path(drafter_dir) / CONFIG_FILE).read_text())["dtype"]
        dtype = DTYPES.get(stored, torch.float32)
    if target is None:
        target = Target.load(model, layer_ids=cfg.target_layer_ids, dtype=target_dtype)
    # float32: the factored tables are materialised once, then rounded to ``dtype``.
    drafter = load_drafter(drafter_dir, target, dtype=torch.float32)
    tensors = speculators_state_dict(drafter, dtype)
    if cfg.head == "rnn":
        log.warning("RNN head exported as markov_head_type 'rnn': speculators runs it, vLLM's DSpark drafter runs "
                    "'vanilla' Markov heads only")
    config = speculators_config(
        cfg, verifier_name_or_path=verifier or str(target.config.name_or_path or target.name),
        verifier_architectures=list(getattr(target.config, "architectures", None) or []),
        max_position_embeddings=target.config.max_position_embeddings)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    log.info("wrote %s (%d tensors, %s, γ = %d, taps %s -> aux ids %s)", out, len(tensors), dtype,
             cfg.block_size, list(cfg.target_layer_ids), config["aux_hidden_state_layer_ids"])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="our drafter checkpoint directory")
    p.add_argument("--out", required=True, help="directory for the speculators-format checkpoint")
    p.add_argument("--model", default=DEFAULT_TARGET,
                   help="the drafter's target: 'smollm2-135m-instruct', a .gguf file or a local HF directory")
    p.add_argument("--verifier", default=None,
                   help="verifier name or path recorded in the config (e.g. an HF hub id); default: the local HF "
                        "directory the target was loaded from")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="tensor dtype; default: the drafter's")
    p.add_argument("--target-dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype the target is loaded in on the CPU (bfloat16 halves the memory of a large target)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        export_speculators(args.drafter, args.out, model=args.model, verifier=args.verifier,
                           dtype=DTYPES[args.dtype] if args.dtype else None, target_dtype=DTYPES[args.target_dtype])
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
