"""Tests of reference/checkpoint.py: round trips, sharding, STS temperatures and every corruption failing fast."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference.checkpoint import (
    INDEX_FILE,
    MAX_SHARD_BYTES,
    SCALE_SUFFIX,
    dequantize_int8_rows,
    load_drafter,
    quantize_int8_rows,
    read_drafter_config,
    save_drafter,
    update_sts_temperatures,
    write_draft_vocab,
)
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter
from reference.target import Target
from reference.testing import tiny_hf_model
from tests.conftest import TINY_D, TINY_GAMMA, TINY_TAPS, TINY_V, tiny_drafter_config

V, D_MODEL, GAMMA, TAPS = TINY_V, TINY_D, TINY_GAMMA, TINY_TAPS


make_config = tiny_drafter_config


def make_target() -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """A plain embedding and LM head standing in for the target's modules."""
    torch.manual_seed(100)
    return torch.nn.Embedding(V, D_MODEL).requires_grad_(False), torch.nn.Linear(D_MODEL, V).requires_grad_(False)


def make_drafter(cfg: DrafterConfig) -> DSparkDrafter:
    """A drafter whose every tensor is random (W2 = 0 and unit norms would hide mistakes in the round trip)."""
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    drafter.attach_target(*make_target())
    return drafter.eval()


def make_context(B: int, S: int):
    features = torch.randn(B, S, len(TAPS) * D_MODEL, generator=torch.Generator().manual_seed(1))  # [B, S, m·d]
    return features, torch.arange(S).expand(B, S).clone(), torch.ones(B, S, dtype=torch.bool)


def fake_target(num_layers: int = 4, hidden_size: int = D_MODEL, vocab_size: int = V, **attrs) -> SimpleNamespace:
    emb, lm = make_target()
    return SimpleNamespace(embed_tokens=emb, lm_head=lm, num_layers=num_layers, hidden_size=hidden_size,
                           vocab_size=vocab_size, **attrs)


def outputs(drafter):
    """h, draft logits and confidence logits on fixed inputs."""
    features, positions, valid = make_context(B=2, S=9)
    h = drafter(torch.tensor([[4, 5], [6, 7]]), torch.tensor([[3, 8], [5, 9]]), features, positions, valid)
    prev = torch.arange(2 * 2 * GAMMA).view(2, 2, GAMMA) % V
    return (h, *drafter.head_logits(h, prev))


@pytest.fixture
def saved(tmp_path):
    drafter = make_drafter(make_config("markov", qk_norm=True, target_name="tiny"))
    directory = save_drafter(drafter, tmp_path / "ckpt", extra={"step": 12})
    return drafter, directory


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_round_trip_identical(tmp_path, head):
    drafter = make_drafter(make_config(head))
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, fake_target())
    assert loaded.config == drafter.config
    for a, b in zip(outputs(drafter), outputs(loaded), strict=True):
        assert torch.equal(a, b)  # same weights, same target modules, same math: bit-identical


def test_config_json_layout(saved):
    drafter, directory = saved
    config = json.loads((directory / "config.json").read_text())
    assert config["format"] == "dspark-drafter" and config["format_version"] == 1
    assert config["drafter"] == drafter.config.to_dict()
    assert config["target"] == {"name": "tiny", "num_layers": 4, "hidden_size": D_MODEL, "vocab_size": V}
    assert config["dtype"] == "float32" and config["extra"] == {"step": 12}
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert not any("embed_tokens" in k or "lm_head" in k for k in load_file(directory / "model.safetensors"))


def test_sharding(tmp_path):
    drafter = make_drafter(make_config("rnn"))
    limit = 60_000  # the drafter holds ~0.3 MB of float32 (largest tensor 48 KiB): this forces several shards
    save_drafter(drafter, tmp_path, max_shard_bytes=limit)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    assert all(p.stat().st_size <= limit for p in shards)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(drafter.state_dict())
    assert {p.name for p in shards} == set(index["weight_map"].values())
    loaded = load_drafter(tmp_path, fake_target())
    for a, b in zip(outputs(drafter), outputs(loaded), strict=True):
        assert torch.equal(a, b)

    # Saving again as one file replaces the shards and the index.
    save_drafter(drafter, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "model.safetensors").stat().st_size <= MAX_SHARD_BYTES

    with pytest.raises(ValueError, match="context_proj.weight.*alone exceeds"):
        save_drafter(drafter, tmp_path / "tiny_shards", max_shard_bytes=4_000)


def test_dtypes(tmp_path):
    drafter = make_drafter(make_config()).to(torch.bfloat16)
    save_drafter(drafter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    for name, t in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t)
    as_fp32 = load_drafter(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in as_fp32.parameters())


def test_a_target_sets_the_default_dtype(tmp_path):
    """Beside a target, a bfloat16 checkpoint loads in the target's dtype (its layers would otherwise run in another
    precision than the shared embedding and LM head, and than the engine, which casts to the target's dtype)."""
    target = Target.from_model(tiny_hf_model("qwen3", vocab_size=V), layer_ids=(0, 1, 2))  # float32
    save_drafter(make_drafter(make_config("markov", qk_norm=True)).to(torch.bfloat16), tmp_path)
    assert all(p.dtype == torch.float32 for p in load_drafter(tmp_path, target).parameters())
    assert all(p.dtype == torch.bfloat16 for p in load_drafter(tmp_path, target, dtype=torch.bfloat16).parameters())


def test_sts_temperatures(saved):
    _, directory = saved
    cfg = update_sts_temperatures(directory, "greedy", [1.0, 1.5, 2.0, 2.5])
    assert cfg.sts_temperatures == {"greedy": [1.0, 1.5, 2.0, 2.5]}
    update_sts_temperatures(directory, "sampling", [0.5] * GAMMA)
    assert read_drafter_config(directory).sts_temperatures == {"greedy": [1.0, 1.5, 2.0, 2.5],
                                                               "sampling": [0.5] * GAMMA}
    before = (directory / "config.json").read_text()
    with pytest.raises(ValueError, match="sts_temperatures"):
        update_sts_temperatures(directory, "greedy", [1.0, 2.0])  # γ = 4 temperatures needed
    with pytest.raises(ValueError, match="unknown decoding mode"):
        update_sts_temperatures(directory, "beam", [1.0] * GAMMA)
    assert (directory / "config.json").read_text() == before  # a rejected update leaves the file alone
    assert load_drafter(directory).config.sts_temperatures["sampling"] == [0.5] * GAMMA


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_missing_directory_and_config(tmp_path, saved):
    _, directory = saved
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_drafter(directory)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(format="hf-model"), "format is 'hf-model'"),
    (lambda c: c.update(format_version=2), "format_version 2"),
    (lambda c: c["drafter"].update(flux_capacitor=1), r"unknown DrafterConfig fields \['flux_capacitor'\]"),
    (lambda c: c.update(notes="x"), r"unknown top-level keys \['notes'\]"),
    (lambda c: c.pop("dtype"), "missing key 'dtype'"),
    (lambda c: c.update(dtype="float7"), "unknown dtype 'float7'"),
    (lambda c: c["drafter"].update(markov_rank=8), r"tensor '.+' in model.safetensors has shape .+ config implies"),
])
def test_corrupt_config(saved, edit, message):
    _, directory = saved
    _edit_config(directory, edit)
    with pytest.raises(ValueError, match=message):
        load_drafter(directory)


def test_missing_and_unexpected_tensors(saved):
    _, directory = saved
    path = directory / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "final_norm.weight"}, path)
    with pytest.raises(ValueError, match=r"missing tensors \['final_norm.weight'\]"):
        load_drafter(directory)
    save_file({**tensors, "extra_head.weight": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra_head.weight'\]"):
        load_drafter(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_drafter(directory)


def test_missing_shard(tmp_path):
    save_drafter(make_drafter(make_config()), tmp_path, max_shard_bytes=60_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {victim.name} is listed in .*{INDEX_FILE} but absent"):
        load_drafter(tmp_path)


def test_target_mismatch(saved):
    _, directory = saved
    with pytest.raises(ValueError, match="hidden size 64 != target's 32"):
        load_drafter(directory, fake_target(hidden_size=32))
    with pytest.raises(ValueError, match="vocab size 96 != target's 100"):
        load_drafter(directory, fake_target(vocab_size=100))
    with pytest.raises(ValueError, match=r"layer ids \[0, 1, 2\] out of range for 2 layers"):
        load_drafter(directory, fake_target(num_layers=2))
    with pytest.raises(ValueError, match=r"target taps layers \[1\]"):
        load_drafter(directory, fake_target(layer_ids=(1,)))
    loaded = load_drafter(directory, fake_target(layer_ids=(0, 1, 2)))
    assert loaded._target is not None


def test_with_real_target_features(tmp_path):
    """Integration with reference/target.py: its features feed the loaded drafter through the cache."""
    target = Target.from_model(tiny_hf_model("qwen3", vocab_size=V), layer_ids=(0, 1, 2))
    drafter = make_drafter(make_config("markov", qk_norm=True))
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target)
    ids = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(0))
    _, features = target.forward(ids, target.new_cache(), 0)  # [8, m·d], an inference-mode tensor
    loaded.requires_grad_(False)  # serving: inference tensors may not enter an autograd graph
    cache = loaded.new_context_cache()
    cache.append(features[:7], torch.arange(7))
    h = loaded.backbone_cached(int(ids[7]), 7, cache)  # [γ, d]
    h_fwd = loaded(ids[7].view(1, 1), torch.tensor([[7]]), features[None], torch.arange(8)[None],
                   torch.ones(1, 8, dtype=torch.bool))[0, 0]
    torch.testing.assert_close(h, h_fwd, atol=1e-5, rtol=0)  # fp32, different shapes


def test_sts_biases_are_stored_with_their_temperatures_and_dropped_without(saved):
    _, directory = saved
    cfg = update_sts_temperatures(directory, "greedy", [1.0] * GAMMA, [0.5, -0.5, 0.25, 0.0])
    assert cfg.sts_biases == {"greedy": [0.5, -0.5, 0.25, 0.0]}
    update_sts_temperatures(directory, "sampling", [2.0] * GAMMA, [0.1] * GAMMA)
    assert read_drafter_config(directory).sts_biases == {"greedy": [0.5, -0.5, 0.25, 0.0], "sampling": [0.1] * GAMMA}
    # Temperature-only STS for greedy: the old greedy biases were fitted with other temperatures, so they go.
    cfg = update_sts_temperatures(directory, "greedy", [1.5] * GAMMA)
    assert cfg.sts_biases == {"sampling": [0.1] * GAMMA}
    assert load_drafter(directory).config.sts_biases == {"sampling": [0.1] * GAMMA}
    with pytest.raises(ValueError, match="sts_biases"):
        update_sts_temperatures(directory, "greedy", [1.0] * GAMMA, [float("nan")] * GAMMA)


def test_int8_rows_round_to_nearest_within_half_a_step():
    w = torch.randn(5, 40) * torch.tensor([1e-3, 0.1, 1.0, 30.0, 0.0])[:, None]  # rows of very different scale
    q, scale = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5,)
    assert q[:4].abs().amax(dim=1).tolist() == [127] * 4  # each row's largest weight uses the full range
    assert torch.equal(q[4], torch.zeros(40, dtype=torch.int8)) and scale[4] == 1.0  # an all-zero row
    err = (dequantize_int8_rows(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_int8_weights_round_trip(tmp_path, head):
    drafter = make_drafter(make_config(head, qk_norm=True)).to(torch.bfloat16)
    save_drafter(drafter, tmp_path / "full")
    save_drafter(drafter, tmp_path / "int8", weights="int8")
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    names = config["quantization"]["tensors"]
    assert config["quantization"]["method"] == "int8-per-row" and config["dtype"] == "bfloat16"
    assert "conf_head.weight" not in names and "layers.0.mlp.down_proj.weight" in names
    stored = load_file(tmp_path / "int8" / "model.safetensors")
    assert all(stored[n].dtype == torch.int8 and stored[n + SCALE_SUFFIX].dtype == torch.float32 for n in names)
    assert stored["conf_head.weight"].dtype == torch.bfloat16
    size = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("full", "int8")}
    assert size["int8"] < 0.62 * size["full"]

    loaded = load_drafter(tmp_path / "int8", fake_target(), dtype=torch.float32)
    original = drafter.float().state_dict()
    for name, t in loaded.state_dict().items():
        if name in names:  # within half a quantisation step of the bfloat16 weight
            step = original[name].abs().amax(dim=1, keepdim=True) / 127
            assert ((t - original[name]).abs() <= step / 2 + 1e-6).all(), name
        else:
            assert torch.equal(t, original[name]), name
    # the drafter computes nearly what it did (and ``full`` exactly)
    exact = load_drafter(tmp_path / "full", fake_target(), dtype=torch.float32)
    for a, b, c in zip(outputs(drafter.float()), outputs(exact), outputs(loaded), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, atol=0.05 * a.abs().max().item(), rtol=0)


def test_int8_checkpoint_failures(tmp_path):
    drafter = make_drafter(make_config())
    with pytest.raises(ValueError, match="weights must be one of"):
        save_drafter(drafter, tmp_path / "x", weights="fp4")
    directory = save_drafter(drafter, tmp_path / "q", weights="int8")
    config_path = directory / "config.json"
    good = json.loads(config_path.read_text())
    for edit, message in (
        (lambda c: c["quantization"].update(method="nf4"), "method 'nf4' is not supported"),
        (lambda c: c["quantization"].update(tensors="all"), "must be a list"),
        (lambda c: c["quantization"]["tensors"].append("final_norm.weight"), "not weight matrices"),
        (lambda c: c.pop("quantization"), "unexpected tensors"),  # the scales no longer fit the config
    ):
        bad = json.loads(json.dumps(good))
        edit(bad)
        config_path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            load_drafter(directory)
    config_path.write_text(json.dumps(good))
    tensors = load_file(directory / "model.safetensors")
    name = good["quantization"]["tensors"][0]
    tensors[name] = tensors[name].float()  # dequantized by someone, config not updated
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="must be int8 with a float32 scale"):
        load_drafter(directory)
    tensors[name + SCALE_SUFFIX] = tensors[name + SCALE_SUFFIX][:-1]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        load_drafter(directory)


@pytest.mark.parametrize("weights", ["full", "int8"])
def test_round_trip_keeps_the_draft_vocabulary(tmp_path, weights):
    """A restricted drafter's vocabulary travels in the checkpoint (an int64 tensor beside the weights, never
    quantized) and comes back in its config and buffer; a stored vocabulary that breaks the rules fails the load."""
    vocab = [0, 3, 5, V - 1]
    drafter = make_drafter(make_config("markov")).restrict_vocab(vocab)
    save_drafter(drafter, tmp_path, weights=weights)
    loaded = load_drafter(tmp_path, fake_target())
    assert loaded.config.draft_vocab_size == len(vocab) and loaded.draft_vocab.tolist() == vocab
    assert loaded.draft_vocab.dtype == torch.int64
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["draft_vocab"].tolist() == vocab
    save_file(stored | {"draft_vocab": torch.tensor([0, 5, 3, V - 1])}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="distinct and ascending"):
        load_drafter(tmp_path, fake_target())


def test_write_draft_vocab_keeps_every_stored_byte(tmp_path):
    """Restricting a sharded int8 checkpoint in place: every tensor it held keeps its bytes (no dequantize and
    re-quantize round trip), the vocabulary joins the last shard and the index, and the config says its size."""
    drafter = make_drafter(make_config("markov"))
    save_drafter(drafter, tmp_path, weights="int8", max_shard_bytes=60_000)
    before = {}
    for shard in sorted(tmp_path.glob("model*.safetensors")):
        before |= load_file(shard)
    write_draft_vocab(tmp_path, [V - 1, 2, 0], extra={"why": "test"})
    after = {}
    for shard in sorted(tmp_path.glob("model*.safetensors")):
        after |= load_file(shard)
    assert set(after) == set(before) | {"draft_vocab"} and after["draft_vocab"].tolist() == [0, 2, V - 1]
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"]["draft_vocab"] == sorted(p.name for p in tmp_path.glob("model*.safetensors"))[-1]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["drafter"]["draft_vocab_size"] == 3 and config["extra"]["why"] == "test"
    assert load_drafter(tmp_path).draft_vocab.tolist() == [0, 2, V - 1]
    with pytest.raises(ValueError, match="distinct"):
        write_draft_vocab(tmp_path, [1, 1])
