"""A target's weights without its forward: Hugging Face's module tree and parameter names, read from safetensors.

The optimized engine runs the target with its own kernels (``optimized/models/target.py``); from the model it needs
only the tensors, the config, the RoPE inverse frequencies and the embedding / LM-head modules the drafter shares.
Building the Hugging Face ``*ForCausalLM`` for that means importing ``transformers``' modeling stack, several seconds
of a server's start-up (measured on the H200 in docs/serving.md, "Start-up"). :func:`load_causal_lm_weights` builds
instead a plain module tree with the same attribute paths and parameter names as HF's Llama, Qwen2 and Qwen3, with
every tensor loaded and cast exactly as ``from_pretrained`` loads and casts it:

    CausalLMWeights
      model: DecoderWeights
        embed_tokens: nn.Embedding                        [V, d]
        layers[l]: DecoderLayerWeights
          self_attn: q_proj, k_proj, v_proj, o_proj       nn.Linear (q/k/v bias: Qwen2, or Llama's attention_bias)
                     q_norm, k_norm                        [D] (Qwen3)
          mlp: gate_proj, up_proj, down_proj               nn.Linear
          input_layernorm, post_attention_layernorm        [d]
        norm                                               [d]
        rotary_emb: inv_freq [D/2] float32, rope_type, attention_scaling
      lm_head: nn.Linear                                   [V, d] (the embedding's own parameter when tied)

``reference.target.Target.load(..., forward=False)`` wraps it; ``tests/reference/test_target_weights.py`` checks
every parameter, buffer and attribute against the HF model loaded from the same directory, bit for bit.

The config and the tokenizer still need transformers, and with some versions even its config classes are expensive
to import: a config class's docstring decorator imports the auto-model module, which imports the generation code
(with transformers 5.17 on the H200 machine that chain pulled in scikit-learn, SciPy and torch._dynamo: 6.9 s), and
``AutoTokenizer``'s module does the same. So the first load of a directory records what transformers resolved for
it — the config's full dictionary, the generation config's, the RoPE table and the tokenizer's class — under
``$DSPARK_CACHE/hf-records`` (default ``~/.cache/dspark/hf-records``), keyed by the directory, its files' sizes and
modification times and the transformers version (:func:`load_weights_and_tokenizer`). Later loads read the record,
build the config as a :class:`RecordedConfig` (the same attributes) and call the tokenizer class's own
``from_pretrained``, which is what ``AutoTokenizer`` ends with: no config class, no auto module is imported.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from reference.config import cache_folder

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Checkpoint entries that are not parameters and that HF ignores too (RoPE tables some older exports saved).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


class RMSNormWeight(nn.Module):
    """An RMSNorm's scale, under HF's name ``weight`` (the op itself lives in the engine's kernels)."""

    def __init__(self, size: int, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device))


class Linear(nn.Linear):
    """``nn.Linear`` whose tensors come from a checkpoint: no random initialisation (which on the meta device would
    import torch._dynamo, most of a second)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table comes from a checkpoint (see :class:`Linear`)."""

    def reset_parameters(self) -> None:
        pass


class AttentionWeights(nn.Module):
    def __init__(self, config: Any, device=None) -> None:
        super().__init__()
        model_type, d = config.model_type, config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or d // heads
        self.scaling = self.head_dim ** -0.5  # HF's softmax scale for all three families
        qkv_bias = True if model_type == "qwen2" else bool(getattr(config, "attention_bias", False))
        o_bias = bool(getattr(config, "attention_bias", False)) if model_type == "llama" else False
        self.q_proj = Linear(d, heads * self.head_dim, bias=qkv_bias, device=device)
        self.k_proj = Linear(d, kv_heads * self.head_dim, bias=qkv_bias, device=device)
        self.v_proj = Linear(d, kv_heads * self.head_dim, bias=qkv_bias, device=device)
        self.o_proj = Linear(heads * self.head_dim, d, bias=o_bias, device=device)
        if model_type == "qwen3":
            self.q_norm = RMSNormWeight(self.head_dim, device)
            self.k_norm = RMSNormWeight(self.head_dim, device)


class MLPWeights(nn.Module):
    def __init__(self, config: Any, device=None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False)) if config.model_type == "llama" else False
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, inter, bias=bias, device=device)
        self.up_proj = Linear(d, inter, bias=bias, device=device)
        self.down_proj = Linear(inter, d, bias=bias, device=device)


class DecoderLayerWeights(nn.Module):
    def __init__(self, config: Any, device=None) -> None:
        super().__init__()
        self.self_attn = AttentionWeights(config, device)
        self.mlp = MLPWeights(config, device)
        self.input_layernorm = RMSNormWeight(config.hidden_size, device)
        self.post_attention_layernorm = RMSNormWeight(config.hidden_size, device)


class RotaryEmbedding(nn.Module):
    """RoPE's inverse frequencies ``[D/2]`` (float32) and output scale, computed as HF's rotary module computes them
    (or given: ``rope`` = ``(rope_type, inv_freq, attention_scaling)``, as a record holds them)."""

    def __init__(self, config: Any, rope: tuple[str, Tensor, float] | None = None) -> None:
        super().__init__()
        self.rope_type, inv_freq, self.attention_scaling = rope or rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class DecoderWeights(nn.Module):
    def __init__(self, config: Any, device=None, rope: tuple[str, Tensor, float] | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayerWeights(config, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNormWeight(config.hidden_size, device)
        self.rotary_emb = RotaryEmbedding(config, rope)


class CausalLMWeights(nn.Module):
    """HF's ``*ForCausalLM`` without the forward: same attribute paths, parameter names and registration order.

    Built on ``device="meta"`` (shapes only, nothing allocated) by :func:`load_causal_lm_weights`, which then puts
    each loaded tensor in its place; the RoPE table is real from the start."""

    def __init__(self, config: Any, generation_config: Any = None, device=None,
                 rope: tuple[str, Tensor, float] | None = None) -> None:
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.model = DecoderWeights(config, device, rope)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise RuntimeError("this target was loaded without its forward (Target.load(..., forward=False): weights for "
                           "the optimized engine); load it with forward=True to run the reference forward")


def rope_inverse_frequencies(config: Any) -> tuple[str, Tensor, float]:
    """``(rope_type, inv_freq [D/2] float32, attention_scaling)`` of an HF config, as its rotary module computes them.

    The default type is HF's formula ``1 / θ^(2i/D)`` written the same way (same float32 operations, same bits);
    every other type calls HF's own initialiser from ``transformers.modeling_rope_utils`` (a light import).
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return rope_type, inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown RoPE type {rope_type!r} in the model config; known: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return rope_type, inv_freq, float(scaling)


def has_safetensors(path: Path) -> bool:
    """Whether an HF directory holds its weights as safetensors (one file or an index of shards)."""
    return (path / SAFETENSORS_FILE).is_file() or (path / SAFETENSORS_INDEX).is_file()


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map: not a safetensors index")
        return {name: path / file for name, file in weight_map.items()}
    from safetensors import safe_open

    file = path / SAFETENSORS_FILE
    with safe_open(file, framework="pt") as f:
        return dict.fromkeys(f.keys(), file)


def load_causal_lm_weights(path: Path, config: Any, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                           generation_config: Any = None, rope: tuple[str, Tensor, float] | None = None
                           ) -> CausalLMWeights:
    """Build :class:`CausalLMWeights` for ``config`` and fill it from the safetensors in ``path``.

    Every floating tensor is cast to ``dtype`` (what ``from_pretrained(dtype=...)`` does); an LM head tied to the
    embedding (``tie_word_embeddings``) is the embedding's parameter, whatever the files hold under ``lm_head``.
    A missing tensor or a wrong shape fails with its name; entries the tree has no place for are logged and skipped
    (HF warns about them the same way).
    """
    from safetensors import safe_open

    # Shapes only: nothing is allocated until a tensor is loaded into its place. (Passed as an argument: the
    # `with torch.device(...)` context would import torch._dynamo, as a random initialisation on meta does.)
    model = CausalLMWeights(config, generation_config, device="meta", rope=rope)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(device)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    expected = dict(model.named_parameters())
    if tied:
        expected.pop("lm_head.weight")
    files = _weight_files(path)
    missing = [name for name in expected if name not in files]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) a {config.model_type} model of this "
                         f"config needs, e.g. {', '.join(missing[:4])}")
    skipped = sorted(n for n in files if n not in expected and not n.endswith(IGNORED_SUFFIXES)
                     and not (tied and n == "lm_head.weight"))
    if skipped:
        logger.warning("%s: %d checkpoint tensor(s) not used by a %s model, e.g. %s", path, len(skipped),
                       config.model_type, ", ".join(skipped[:4]))
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                stored = f.get_tensor(name)
                want = expected[name]
                if tuple(stored.shape) != tuple(want.shape):
                    raise ValueError(f"{file}: tensor {name} has shape {tuple(stored.shape)}, the config implies "
                                     f"{tuple(want.shape)}")
                value = stored.to(device=device, dtype=dtype if stored.is_floating_point() else stored.dtype)
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    config.dtype = dtype  # as from_pretrained records the dtype it loaded in
    return model.eval()


# ---------------------------------------------------------------------------------------------------------
# What transformers resolved for a directory, recorded
# ---------------------------------------------------------------------------------------------------------

RECORDED_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
                  "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                  "chat_template.jinja")


class RecordedConfig(SimpleNamespace):
    """An HF config's (or generation config's) attributes, from its recorded ``to_dict()``: what the engine, the drafter
    and the server read (``model_type``, the shapes, ``rope_parameters``, ``eos_token_id``, ...), without the class."""

    def to_dict(self) -> dict[str, Any]:
        """A copy of the attributes, a torch dtype written as its name (``"bfloat16"``), as HF's ``to_dict`` does."""
        return json.loads(json.dumps(vars(self), default=lambda v: str(v).removeprefix("torch.")))


def record_root() -> Path:
    return cache_folder("hf-records")


def _record_key(path: Path) -> dict[str, Any]:
    import transformers

    files = {}
    for name in RECORDED_FILES:
        try:
            st = (path / name).stat()
        except OSError:
            continue
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"path": str(path.resolve()), "files": files, "transformers": transformers.__version__}


def _record_file(key: dict[str, Any]) -> Path:
    return record_root() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")


def load_weights_and_tokenizer(path: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                               tokenizer: bool = True) -> tuple[CausalLMWeights, Any]:
    """The weights (:func:`load_causal_lm_weights`) and the tokenizer of an HF directory with safetensors weights.

    The first time (per directory, files and transformers version) config, generation config and tokenizer come from
    ``AutoConfig``, ``GenerationConfig`` and ``AutoTokenizer`` and are recorded (module docstring); after that from
    the record. A record that cannot be read or written is skipped (the load takes the first-time path).
    """
    key = _record_key(path)
    record_file = _record_file(key)
    try:
        record = json.loads(record_file.read_text())
        if record.get("key") != key:
            raise ValueError("stale record")
        tok = None
        if tokenizer:
            module, name = record["tokenizer"]
            tok = getattr(importlib.import_module(module), name).from_pretrained(path)
        config = RecordedConfig(**record["config"])
        generation = RecordedConfig(**record["generation_config"])
        rope = (record["rope"]["type"], torch.tensor(record["rope"]["inv_freq"], dtype=torch.float32),
                record["rope"]["attention_scaling"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        record = None
    if record is None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        config = AutoConfig.from_pretrained(path)
        generation = (GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file()
                      else GenerationConfig.from_model_config(config))
        tok = AutoTokenizer.from_pretrained(path) if tokenizer else None
        rope = rope_inverse_frequencies(config)
        _write_record(record_file, {
            "key": key, "config": config.to_dict(), "generation_config": generation.to_dict(),
            "tokenizer": [type(tok).__module__, type(tok).__qualname__] if tok is not None else None,
            "rope": {"type": rope[0], "inv_freq": rope[1].tolist(), "attention_scaling": rope[2]}})
    model = load_causal_lm_weights(path, config, dtype=dtype, device=device, generation_config=generation, rope=rope)
    return model, tok


def _write_record(file: Path, record: dict[str, Any]) -> None:
    try:  # best effort: without a record (a read-only cache, say) every load takes the first-time path
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, default=str))
        tmp.replace(file)
    except OSError as err:
        logger.debug("no record of %s written (%s)", record["key"]["path"], err)
