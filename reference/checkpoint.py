"""Save and load a DSpark drafter directory: ``config.json`` plus sharded safetensors.

The format stores what docs/method.md §1 says the drafter owns (context projection, backbone layers, sequential and
confidence heads, the learned mask vector) and the STS temperatures of docs/method.md §3 (inside the drafter config).
The target's embedding and LM head are shared and never saved. Names follow docs/method.md (``p_t`` target,
``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).

Layout of a checkpoint directory::

    config.json                     {"format": "dspark-drafter", "format_version": 1,
                                     "drafter": DrafterConfig.to_dict(),
                                     "target": {"name", "num_layers", "hidden_size", "vocab_size"},
                                     "dtype": "float32" | "bfloat16" | ...,
                                     "quantization": {"method": "int8-per-row", "tensors": [...]} (optional),
                                     "extra": {...} (optional)}
    model.safetensors               when everything fits in one shard, otherwise
    model-00001-of-0000N.safetensors ... + model.safetensors.index.json  {"metadata": {...}, "weight_map": {...}}

Shards hold at most 15 MB by default so that checkpoints can live in the repository without Git LFS.
Every loading problem fails fast with a message naming the file or key.

Weights can be stored in 8 bits (``save_drafter(..., weights="int8")``): each large weight matrix ``W`` as int8
``Q`` with one float32 scale per row, ``W ≈ Q · s`` with ``s = max|W_row| / 127`` (symmetric, rounded to nearest),
under its own name and ``<name>_scale``; norms, biases, the learned mask vector and the one-row confidence head keep
``dtype``. That halves a bfloat16 checkpoint; :func:`load_drafter` dequantizes, so everything downstream sees an
ordinary drafter (the rounding error is at most 0.4 % of a row's largest weight; docs/models.md gives the measured
effect on acceptance).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter, check_draft_vocab

FORMAT = "dspark-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 15_000_000  # the repository's per-file limit for shipped checkpoints
_TOP_LEVEL_KEYS = {"format", "format_version", "drafter", "target", "dtype", "quantization", "extra"}
WEIGHT_FORMATS = ("full", "int8")
INT8_METHOD = "int8-per-row"
SCALE_SUFFIX = "_scale"
# Upper bound of the safetensors header per tensor (name, dtype, shape, offsets as JSON) plus the file's
# 8-byte length prefix and alignment padding; real entries are ~100 bytes, the file size is checked anyway.
_HEADER_BYTES_PER_TENSOR = 256
_HEADER_BYTES_FIXED = 64


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy packing in state_dict order: a new shard starts when the next tensor would overflow."""
    shards: list[list[str]] = [[]]
    used = _HEADER_BYTES_FIXED
    for name, t in tensors.items():
        size = t.numel() * t.element_size() + _HEADER_BYTES_PER_TENSOR + len(name)
        if size + _HEADER_BYTES_FIXED > max_shard_bytes:
            raise ValueError(f"tensor {name!r} ({size} bytes) alone exceeds max_shard_bytes={max_shard_bytes}; "
                             "save in a smaller dtype or lower the rank")
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = _HEADER_BYTES_FIXED
        shards[-1].append(name)
        used += size
    return shards


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [R, C]`` → ``(Q int8 [R, C], s float32 [R])`` with ``W ≈ Q · s[:, None]``: per-row symmetric absmax,
    round to nearest. An all-zero row gets scale 1 (and Q = 0), so dequantizing never divides by zero."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``Q · s[:, None]`` of :func:`quantize_int8_rows`."""
    return q.float() * scale.float()[:, None]


def save_drafter(drafter: DSparkDrafter, directory: str | os.PathLike, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                 extra: dict[str, Any] | None = None, weights: str = "full") -> Path:
    """Write ``drafter`` to ``directory`` (created if needed; old weight files there are replaced).

    Args:
        drafter: the drafter; only its own parameters are written (no embedding, no LM head).
        directory: destination directory.
        max_shard_bytes: upper bound on each safetensors file's size.
        extra: JSON-serialisable metadata stored under ``"extra"`` (training run, data, step, ...).
        weights: ``"full"`` stores every tensor in the drafter's dtype; ``"int8"`` stores each weight matrix (but
            the confidence head's single row) as int8 with a float32 scale per row (about half a bfloat16
            checkpoint).

    Returns:
        The directory as a Path.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in drafter.state_dict().items()}
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"drafter parameters mix dtypes {sorted(map(str, dtypes))}; cast it to one dtype first")
    dtype = str(dtypes.pop()).removeprefix("torch.")
    quantized = []
    if weights == "int8":
        for name in list(tensors):
            t = tensors[name]
            if t.dim() == 2 and t.shape[0] > 1 and name.endswith("weight"):  # not the one-row confidence head
                tensors[name], tensors[name + SCALE_SUFFIX] = quantize_int8_rows(t)
                quantized.append(name)
    cfg = drafter.config
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "drafter": cfg.to_dict(),
        "target": {"name": cfg.target_name, "num_layers": cfg.target_num_layers, "hidden_size": cfg.hidden_size,
                   "vocab_size": cfg.vocab_size},
        "dtype": dtype,
    }
    if quantized:
        config["quantization"] = {"method": INT8_METHOD, "tensors": quantized}
    if extra:
        config["extra"] = extra
    # Stale weight files from an earlier save would otherwise be mixed with the new ones.
    for old in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        old.unlink(missing_ok=True)
    shards = _plan_shards(tensors, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [_shard_name(i + 1, len(shards)) for i in range(len(shards))]
    for fname, keys in zip(names, shards, strict=True):
        path = directory / fname
        save_file({k: tensors[k] for k in keys}, str(path), metadata={"format": "pt"})
        if path.stat().st_size > max_shard_bytes:  # guards the header estimate above
            raise RuntimeError(f"{path} is {path.stat().st_size} bytes, over max_shard_bytes={max_shard_bytes}")
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: fname for fname, keys in zip(names, shards, strict=True) for k in keys}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _write_json(directory / CONFIG_FILE, config)
    return directory


def write_draft_vocab(directory: str | os.PathLike, token_ids: torch.Tensor | list[int],
                      extra: dict[str, Any] | None = None) -> Path:
    """Give the checkpoint in ``directory`` a draft vocabulary (``DrafterConfig.draft_vocab_size``), in place.

    Every stored tensor keeps its bytes (int8 weights stay int8): the ``draft_vocab`` tensor (``token_ids``
    ascending, int64) is added to, or replaced in, the last weight file, and ``config.json`` gets the new size and
    ``extra`` merged into its ``"extra"``. The result is loaded back once, so a bad vocabulary fails here.
    """
    directory = Path(directory)
    path, config = _read_config_json(directory)
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
    cfg = DrafterConfig.from_dict(config["drafter"])
    check_draft_vocab(ids, cfg.vocab_size)
    files = _weight_files(directory)
    target = files.get("draft_vocab", sorted(set(files.values()))[-1])
    with safe_open(str(target), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    tensors["draft_vocab"] = ids.contiguous()
    save_file(tensors, str(target), metadata=metadata)
    index_path = directory / INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"]["draft_vocab"] = target.name
        index["metadata"]["total_size"] = sum(
            t.numel() * t.element_size() for p in sorted(set(index["weight_map"].values()))
            for t in load_file(str(directory / p)).values())
        _write_json(index_path, index)
    config["drafter"] = DrafterConfig.from_dict(dict(config["drafter"], draft_vocab_size=int(ids.numel()))).to_dict()
    if extra:
        config["extra"] = dict(config.get("extra") or {}, **extra)
    _write_json(path, config)
    load_drafter(directory)  # a check that the directory loads (shapes, the vocabulary's rules)
    return directory


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write atomically, so an interrupted rewrite never leaves a truncated config.json."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _read_config_json(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"drafter checkpoint directory {directory} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a DSpark drafter checkpoint")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{path}: format is {found!r}, expected {FORMAT!r}")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {config.get('format_version')!r} is not supported "
                         f"(this code reads version {FORMAT_VERSION})")
    unknown = sorted(set(config) - _TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {unknown} (free-form metadata belongs under 'extra')")
    for key in ("drafter", "target", "dtype"):
        if key not in config:
            raise ValueError(f"{path}: missing key {key!r}")
    return path, config


def read_drafter_config(directory: str | os.PathLike) -> DrafterConfig:
    """The :class:`DrafterConfig` stored in ``directory/config.json`` (validated)."""
    path, config = _read_config_json(directory)
    try:
        return DrafterConfig.from_dict(config["drafter"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: 'drafter' section: {e}") from e


def update_sts_temperatures(directory: str | os.PathLike, mode: str, temps: list[float],
                            biases: list[float] | None = None, log_weights: list[float] | None = None) -> DrafterConfig:
    """Store the calibration of decoding ``mode`` ("greedy" or "sampling") in place: one temperature per slot and,
    for ``--method sts-bias``, one bias per slot, for ``--method beta`` also one log weight per slot. ``None`` removes
    the mode's old biases or log weights (they belong to the temperatures they were fitted with)."""
    path, config = _read_config_json(directory)
    drafter = dict(config["drafter"])
    drafter["sts_temperatures"] = {**drafter.get("sts_temperatures", {}), mode: [float(t) for t in temps]}
    old_biases = {m: b for m, b in drafter.get("sts_biases", {}).items() if m != mode}
    drafter["sts_biases"] = old_biases if biases is None else {**old_biases, mode: [float(b) for b in biases]}
    old_weights = {m: w for m, w in drafter.get("sts_log_weights", {}).items() if m != mode}
    drafter["sts_log_weights"] = (old_weights if log_weights is None
                                  else {**old_weights, mode: [float(w) for w in log_weights]})
    cfg = DrafterConfig.from_dict(drafter)  # validates the mode and the γ positive temperatures
    config["drafter"] = cfg.to_dict()
    _write_json(path, config)
    return cfg


def _weight_files(directory: Path) -> dict[str, Path]:
    """Which file holds each tensor: from the index when sharded, else the single file."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = {name: directory / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"shard {path.name} is listed in {index_path} but absent")
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _quantized_tensors(config: dict[str, Any], expected: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """The names config.json's ``quantization`` section says are stored in int8 (validated), or []."""
    quant = config.get("quantization")
    if quant is None:
        return []
    where = directory / CONFIG_FILE
    if not isinstance(quant, dict) or quant.get("method") != INT8_METHOD:
        found = quant.get("method") if isinstance(quant, dict) else quant
        raise ValueError(f"{where}: quantization method {found!r} is not supported (this code reads "
                         f"{INT8_METHOD!r})")
    names = quant.get("tensors")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: quantization.tensors must be a list of tensor names")
    bad = sorted(n for n in names if n not in expected or expected[n].dim() != 2)
    if bad:
        raise ValueError(f"{where}: quantization.tensors names {bad}, which are not weight matrices of this drafter")
    return names


def _check_target(cfg: DrafterConfig, target: Any, directory: Path) -> None:
    problems = []
    if target.hidden_size != cfg.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if target.vocab_size != cfg.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
    if cfg.target_num_layers and target.num_layers != cfg.target_num_layers:
        problems.append(f"trained for a {cfg.target_num_layers}-layer target, this one has {target.num_layers}")
    if any(not 0 <= i < target.num_layers for i in cfg.target_layer_ids):
        problems.append(f"layer ids {list(cfg.target_layer_ids)} out of range for {target.num_layers} layers")
    layer_ids = getattr(target, "layer_ids", None)
    if layer_ids is not None and tuple(layer_ids) != tuple(cfg.target_layer_ids):
        problems.append(f"target taps layers {list(layer_ids)}, the drafter needs {list(cfg.target_layer_ids)} "
                        "(load the target with layer_ids=those)")
    if problems:
        raise ValueError(f"drafter {directory} does not match the target: " + "; ".join(problems))


def load_drafter(directory: str | os.PathLike, target: Any = None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> DSparkDrafter:
    """Load a drafter saved by :func:`save_drafter`.

    Args:
        directory: the checkpoint directory.
        target: optional target (with ``embed_tokens``, ``lm_head``, ``vocab_size``, ``hidden_size``,
            ``num_layers``): validated against the checkpoint and attached.
        device: where to put the drafter; None: the target's device, or the CPU without a target.
        dtype: parameter dtype; None: the target's dtype (the drafter shares its embedding and LM head, and a
            bfloat16 checkpoint beside a float32 target would run its own layers in another precision), or the
            stored one without a target.

    Returns:
        The drafter in eval mode.
    """
    directory = Path(directory)
    cfg = read_drafter_config(directory)
    _, config = _read_config_json(directory)
    stored_dtype = getattr(torch, str(config["dtype"]), None)
    if not isinstance(stored_dtype, torch.dtype):
        raise ValueError(f"{directory / CONFIG_FILE}: unknown dtype {config['dtype']!r}")
    if target is not None:
        _check_target(cfg, target, directory)

    drafter = DSparkDrafter(cfg)
    expected = drafter.state_dict()
    quantized = _quantized_tensors(config, expected, directory)
    files = _weight_files(directory)
    # every stored tensor and its shape: the drafter's own, plus one scale per row of each int8 matrix
    shapes = {name: list(t.shape) for name, t in expected.items()}
    shapes |= {name + SCALE_SUFFIX: [expected[name].shape[0]] for name in quantized}
    missing = sorted(set(shapes) - set(files))
    unexpected = sorted(set(files) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"checkpoint {directory} does not fit its config: missing tensors {missing}, "
                         f"unexpected tensors {unexpected}")
    raw: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if files.get(name) != path:
                    raise ValueError(f"tensor {name!r} found in {path.name}, the index places it elsewhere")
                t = f.get_tensor(name)
                if list(t.shape) != shapes[name]:
                    raise ValueError(f"tensor {name!r} in {path.name} has shape {list(t.shape)}, "
                                     f"the config implies {shapes[name]}")
                raw[name] = t
    absent = sorted(set(files) - set(raw))
    if absent:
        raise ValueError(f"tensors {absent} are listed in {INDEX_FILE} but absent from their shards")
    state = {name: raw[name] for name in expected}
    for name in quantized:
        q, scale = raw[name], raw[name + SCALE_SUFFIX]
        if q.dtype != torch.int8 or scale.dtype != torch.float32:
            raise ValueError(f"{directory}: quantized tensor {name!r} must be int8 with a float32 scale, found "
                             f"{str(q.dtype).removeprefix('torch.')} and {str(scale.dtype).removeprefix('torch.')}")
        state[name] = dequantize_int8_rows(q, scale)
    drafter.load_state_dict(state, strict=True)
    if device is None:
        device = getattr(target, "device", None) or "cpu"
    if dtype is None:
        dtype = getattr(target, "dtype", None) or stored_dtype
    drafter = drafter.to(device=device, dtype=dtype).eval()
    if target is not None:
        drafter.attach_target(target.embed_tokens, target.lm_head)
    return drafter
