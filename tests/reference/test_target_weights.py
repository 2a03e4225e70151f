"""Tests of reference/target_weights.py: ``Target.load(..., forward=False)`` holds what the HF model holds, bit for bit.

Each family is saved with ``save_pretrained`` and loaded both ways from the same directory; every parameter (name,
registration order, dtype, bits), the RoPE tables, the attention scale, the tied LM head and the eos ids must agree,
and the optimized target built from either load must compute identical logits and features.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from optimized.cost_model import fingerprint
from reference.target import Target
from reference.target_weights import CausalLMWeights, RecordedConfig, record_root, rope_inverse_frequencies
from reference.testing import tiny_hf_model

FAMILIES = ["llama", "qwen2", "qwen3"]  # qwen2: q/k/v biases and an untied LM head (tiny_hf_model)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test records into its own cache (reference.target_weights.record_root)."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))


def _saved(tmp_path, family: str, tokenizer: bool = False, **save_kw):
    model = tiny_hf_model(family)
    path = tmp_path / family
    model.save_pretrained(path, **save_kw)
    if tokenizer:  # a small word-level tokenizer over the tiny vocabulary
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = {f"w{i}": i for i in range(model.config.vocab_size - 1)} | {"[UNK]": model.config.vocab_size - 1}
        tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="w1").save_pretrained(path)
    return path


def _loads(path, **kw) -> tuple[Target, Target, Target]:
    """The HF load, then two weights-only loads: the first resolves and records, the second reads the record."""
    first = Target.load(str(path), forward=False, **kw)
    assert len(list(record_root().glob("*.json"))) == 1
    return Target.load(str(path), **kw), first, Target.load(str(path), forward=False, **kw)


def _assert_same_weights(hf: Target, light: Target) -> None:
    a, b = list(hf.model.named_parameters()), list(light.model.named_parameters())
    assert [n for n, _ in a] == [n for n, _ in b]  # the step-cost table's fingerprint hashes this list
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    hf_rope, rope = hf.model.model.rotary_emb, light.model.model.rotary_emb
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(hf_rope.inv_freq, rope.inv_freq)
    assert (rope.rope_type, rope.attention_scaling) == (hf_rope.rope_type, hf_rope.attention_scaling)
    for hf_layer, layer in zip(hf.model.model.layers, light.model.model.layers):
        assert hf_layer.self_attn.scaling == layer.self_attn.scaling
    tied = hf.model.lm_head.weight is hf.model.model.embed_tokens.weight
    assert (light.lm_head.weight is light.embed_tokens.weight) == tied
    assert torch.equal(hf.lm_head.weight, light.lm_head.weight)
    assert light.eos_token_ids == hf.eos_token_ids and light.layer_ids == hf.layer_ids
    assert _as_json(light.config.to_dict()) == _as_json(hf.config.to_dict())  # (a record is JSON: str keys)
    assert light.model.generation_config.eos_token_id == hf.model.generation_config.eos_token_id


def _as_json(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_only_load_equals_the_hf_model(tmp_path, family, dtype):
    hf, first, recorded = _loads(_saved(tmp_path, family, tokenizer=family == "llama"), dtype=dtype)
    assert isinstance(recorded.config, RecordedConfig) and not isinstance(first.config, RecordedConfig)
    for light in (first, recorded):
        assert isinstance(light.model, CausalLMWeights) and light.dtype == dtype
        _assert_same_weights(hf, light)
        if family == "llama":
            assert type(light.tokenizer) is type(hf.tokenizer)
            assert light.encode("w3 w5 w90 nope", chat_template=False) == hf.encode("w3 w5 w90 nope",
                                                                                    chat_template=False)


def test_cost_table_key_is_the_same_for_both_loads(tmp_path):
    from optimized.config import EngineConfig
    from optimized.runner import ModelRunner

    path = _saved(tmp_path, "llama")
    keys = []
    for forward in (True, False):
        runner = ModelRunner(Target.load(str(path), forward=forward), None, EngineConfig(max_num_seqs=2,
                                                                                          max_seq_len=32))
        keys.append(fingerprint(runner, context_len=8))
    assert keys[0] == keys[1]


def test_sharded_checkpoint(tmp_path):
    path = _saved(tmp_path, "qwen3", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    hf, first, recorded = _loads(path)
    _assert_same_weights(hf, first)
    _assert_same_weights(hf, recorded)


def test_a_changed_directory_is_resolved_again(tmp_path):
    """The record is keyed by the files: an edited config is read again, not taken from the record."""
    path = _saved(tmp_path, "llama")
    Target.load(str(path), forward=False)
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (path / "config.json").write_text(json.dumps(config))
    light = Target.load(str(path), forward=False)
    assert light.config.rms_norm_eps == 1e-5 and not isinstance(light.config, RecordedConfig)
    assert len(list(record_root().glob("*.json"))) == 2
    record = next(record_root().glob("*.json"))
    record.write_text("{not json")  # a damaged record is skipped, not trusted
    assert Target.load(str(path), forward=False).config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_scaled_rope_types_match_hf(tmp_path, rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_theta": 50000.0, **rope})
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    hf, first, recorded = _loads(tmp_path / "m")
    for light in (first, recorded):
        assert light.model.model.rotary_emb.rope_type == rope["rope_type"]
        _assert_same_weights(hf, light)


def test_bad_checkpoints_fail_with_the_tensor_name(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _saved(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    good = dict(tensors)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.down_proj\.weight"):
        Target.load(str(path), forward=False)
    tensors = dict(good, **{"model.norm.weight": torch.ones(3)})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\), the config implies \(64,\)"):
        Target.load(str(path), forward=False)


def test_weights_only_target_refuses_the_reference_forward(tmp_path):
    target = Target.load(str(_saved(tmp_path, "llama")), forward=False)
    with pytest.raises(RuntimeError, match="forward=False"):
        target.forward(torch.tensor([1, 2]), target.new_cache(), 0)


def test_pytorch_bin_checkpoint_loads_through_transformers(tmp_path):
    path = _saved(tmp_path, "llama")
    model = Target.load(str(path)).model
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    target = Target.load(str(path), forward=False)
    assert not isinstance(target.model, CausalLMWeights)  # no safetensors: the HF class, which reads the .bin
    for (name, a), b in zip(model.state_dict().items(), target.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_default_rope_is_hfs_formula():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32, rope_parameters={"rope_theta": 1e6})
    rope_type, inv_freq, scaling = rope_inverse_frequencies(config)
    assert rope_type == "default" and scaling == 1.0 and inv_freq.shape == (16,)
    assert torch.equal(inv_freq, 1.0 / (1e6 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32)))


def test_weights_only_load_imports_no_model_class(tmp_path):
    """The point of the loader: once a directory is recorded, loading its weights and tokenizer imports neither
    transformers' model or config classes, its auto classes, its generation code, nor torch._dynamo (which a random
    initialisation on the meta device would import): the engine's start-up spent seconds there."""
    path = _saved(tmp_path, "llama", tokenizer=True)
    code = textwrap.dedent(f"""
        import sys, torch, transformers
        before = set(sys.modules)  # some versions register modules of their own at `import transformers`
        from reference.target import Target
        Target.load({str(path)!r}, forward=False, dtype=torch.bfloat16)
        print(sorted(m for m in set(sys.modules) - before if m in ("transformers.modeling_utils", "torch._dynamo")
                     or m.startswith(("transformers.models.auto.", "transformers.generation."))
                     or m.startswith("transformers.models.") and (".modeling_" in m or ".configuration_" in m)))
    """)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]
    assert runs[0] != "[]"  # the first load resolves the directory with transformers' auto classes
    assert runs[1] == "[]", runs[1]


def test_smollm2_weights_only_load_equals_the_hf_load(smollm2_target, monkeypatch, tmp_path):
    """The default target: weights, config, eos ids and the tokenizer (class, chat template, encodings) of both
    weights-only loads equal the HF load's."""
    monkeypatch.delenv("DSPARK_CACHE")  # the dequantized weights the session fixture loaded (built once)
    monkeypatch.setattr("reference.target_weights.record_root", lambda: tmp_path / "records")
    loads = [Target.load(forward=False) for _ in range(2)]
    assert isinstance(loads[1].config, RecordedConfig)
    prompts = ["Hello!", "def f(x):\n    return x  # ünïcödé", "  two  spaces and\ttabs", ""]
    for light in loads:
        _assert_same_weights(smollm2_target, light)
        assert type(light.tokenizer) is type(smollm2_target.tokenizer)
        for p in prompts:
            for chat in (True, False):
                assert light.encode(p, chat_template=chat) == smollm2_target.encode(p, chat_template=chat)
