"""Recorded calibration proposals on disk: what ``scripts/calibrate.py --dump-proposals DIR`` writes, and what
``scripts/compare_calibration.py`` and ``scripts/analyze_proposals.py`` read.

A proposal is one drafted block whose whole block of γ drafts was verified: its raw confidence logits ``z_1..z_γ``
and how many drafts were accepted. From these, any calibration method and any verify policy can be evaluated offline
(a verified slot's outcome does not depend on how many later slots were verified).

One file per decoding mode, ``DIR/proposals-<mode>.safetensors`` (safetensors, never pickles):

* tensors ``conf_logits`` ``[M, γ]`` float32 and ``num_accepted`` ``[M]`` int64;
* metadata ``mode`` (``greedy`` or ``sampling``), ``gamma``, ``temperature`` (the decoding temperature) and
  ``calibration`` (JSON: the temperatures, biases and log weights fitted when they were recorded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PATTERN = "proposals-*.safetensors"


def save_proposals(directory: str | Path, mode: str, conf_logits: torch.Tensor, num_accepted: torch.Tensor, *,
                   gamma: int, temperature: float, calibration: dict | None = None) -> Path:
    """Write ``DIR/proposals-<mode>.safetensors``; returns its path."""
    if conf_logits.ndim != 2 or conf_logits.shape[1] != gamma or num_accepted.shape != conf_logits.shape[:1]:
        raise ValueError(f"expected conf_logits [M, γ={gamma}] and num_accepted [M], got "
                         f"{tuple(conf_logits.shape)} and {tuple(num_accepted.shape)}")
    path = Path(directory) / f"proposals-{mode}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"conf_logits": conf_logits.detach().float().cpu().contiguous(),
               "num_accepted": num_accepted.detach().long().cpu().contiguous()}, str(path),
              metadata={"mode": mode, "gamma": str(gamma), "temperature": repr(float(temperature)),
                        "calibration": json.dumps(calibration or {})})
    return path


def load_proposals(directory: str | Path) -> list[dict]:
    """Every proposals file of ``directory``, by mode name: dicts with ``conf_logits``, ``num_accepted``, ``mode``,
    ``gamma``, ``temperature`` and the recorded calibration's keys (``temperatures``, ``biases``, ...)."""
    paths = sorted(Path(directory).glob(PATTERN))
    if not paths:
        raise SystemExit(f"no {PATTERN} in {directory} (scripts/calibrate.py --dump-proposals DIR writes them)")
    records = []
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            missing = {"mode", "gamma", "temperature"} - set(meta)
            if missing:
                raise SystemExit(f"{path}: not a proposals file (metadata lacks {sorted(missing)})")
            records.append({"conf_logits": f.get_tensor("conf_logits"), "num_accepted": f.get_tensor("num_accepted"),
                            "mode": meta["mode"], "gamma": int(meta["gamma"]),
                            "temperature": float(meta["temperature"]),
                            **json.loads(meta.get("calibration", "{}"))})
    return records
