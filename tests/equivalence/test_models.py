"""Equivalence of the optimized models with the reference ones on tiny random targets (CPU, fp32).

* ``OptimizedTarget.forward`` over ragged packed steps (prefill chunks of different lengths, verify steps with
  1..γ+1 queries per request, a padded zero-length row, padding tokens past the last request, a rejection that
  makes the next step overwrite cached positions) against ``reference.target.Target.forward`` run per request.
* ``OptimizedDrafter.backbone`` with contexts appended in chunks against ``DSparkDrafter.backbone_cached``.

The torch attention path runs for every family; the Triton kernel runs through the interpreter for the llama
family when ``TRITON_INTERPRET=1`` (the CI command sets it).

Tolerance: 1e-4 absolute and relative in fp32. The two sides agree up to float32 summation order (fused q/k/v and
gate/up matmuls, online softmax vs SDPA), i.e. ~1e-6 relative per op; logits of size ~10 after 4 layers stay
well inside 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.attention import HAS_TRITON
from optimized.models import OptimizedDrafter, OptimizedTarget
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter
from reference.target import Target
from reference.testing import tiny_hf_model

ATOL = RTOL = 1e-4
VOCAB = 96
GAMMA = 7
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1" else [])


def tiny_target(family: str) -> Target:
    """A tiny random target of the family (``reference.testing.tiny_hf_model``: Qwen2 with q/k/v biases)."""
    return Target.from_model(tiny_hf_model(family, vocab_size=VOCAB))


# One scripted run for three requests living in slots 2, 0, 3 (never their own index). Each step is a list of
# rows (request, start position, number of tokens); request None is a padded zero-length row.
PROMPT_LENS = {"A": 9, "B": 5, "C": 12}
SLOTS = {"A": 2, "B": 0, "C": 3}
STEPS = [
    [("A", 0, 6), (None, 0, 0), ("B", 0, 5), ("C", 0, 4)],  # chunked prefill, different chunk lengths
    [("C", 4, 8), ("A", 6, 3)],  # the rest of the prompts, order swapped
    [("A", 9, 4), ("B", 5, 1), (None, 0, 0), ("C", 12, GAMMA + 1)],  # verify: 1..γ+1 queries
    [("A", 11, 2), ("B", 6, 3), ("C", 20, 1)],  # A rejected at its 2nd draft: positions 11, 12 are rewritten
]
PAD_TOKENS = 3  # tokens past the last request (a CUDA-graph bucket larger than the step)


def run_steps(target: Target, opt: OptimizedTarget, seed: int = 0):
    """Drive both implementations through STEPS; yield (optimized, reference) logits and features per step."""
    g = torch.Generator().manual_seed(seed)
    ref_caches = {name: target.new_cache() for name in SLOTS}
    for step in STEPS:
        ids, pos, cu, kv_lens, slots, ref_logits, ref_feats = [], [], [0], [], [], [], []
        for name, start, n in step:
            tokens = torch.randint(0, VOCAB, (n,), generator=g)
            ids.append(tokens)
            pos.append(torch.arange(start, start + n))
            cu.append(cu[-1] + n)
            kv_lens.append(start + n)
            slots.append(-1 if name is None else SLOTS[name])
            if name is not None:
                cache = ref_caches[name]
                target.crop(cache, start)  # the reference drops rejected positions; the optimized one overwrites
                logits, feats = target.forward(tokens, cache, start)
                ref_logits.append(logits)
                ref_feats.append(feats)
        n_valid = cu[-1]
        ids.append(torch.randint(0, VOCAB, (PAD_TOKENS,), generator=g))
        pos.append(torch.arange(PAD_TOKENS))  # positions every request reads: they must land in the trash slot
        rows = torch.randperm(n_valid, generator=g)  # logits in an arbitrary requested order
        logits, feats = opt.forward(torch.cat(ids), torch.cat(pos), torch.tensor(cu, dtype=torch.int32),
                                    torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
                                    logits_rows=rows, max_q_len=max(n for _, _, n in step))
        assert logits.dtype == torch.float32 and logits.shape == (n_valid, VOCAB)
        assert feats.shape == (n_valid + PAD_TOKENS, opt.feature_size)
        yield logits, feats[:n_valid], torch.cat(ref_logits)[rows], torch.cat(ref_feats)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_target_matches_reference(family):
    target = tiny_target(family)
    opt = OptimizedTarget(target, attention_backend="torch")
    opt.allocate_cache(max_num_seqs=4, max_seq_len=32)
    for logits, feats, ref_logits, ref_feats in run_steps(target, opt):
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(feats, ref_feats, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_target_from_weights_only_load_is_identical(tmp_path, monkeypatch, family):
    """The optimized target built on ``Target.load(..., forward=False)`` (reference/target_weights.py: no HF model
    class) computes exactly what it computes built on the HF model loaded from the same directory."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))  # the load's record of the directory goes here
    path = tmp_path / family
    tiny_target(family).model.save_pretrained(path)
    outs = []
    for forward in (True, False):
        opt = OptimizedTarget(Target.load(str(path), forward=forward), attention_backend="torch")
        opt.allocate_cache(max_num_seqs=4, max_seq_len=32)
        outs.append(list(run_steps(Target.load(str(path)), opt)))
    for (logits, feats, ref_logits, _), (light_logits, light_feats, _, _) in zip(*outs):
        assert torch.equal(logits, light_logits) and torch.equal(feats, light_feats)
        torch.testing.assert_close(light_logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("family,linear_rows", [
    ("llama", 0), ("qwen3", 0),  # qwen3: the fused kernel's per-head q/k norm
    ("llama", 16), ("qwen2", 16), ("qwen3", 16)])  # steps ≤ 16 tokens through norm_linear (qwen2: q/k/v bias)
def test_target_matches_reference_triton_interpreted(family, linear_rows):
    """Attention and the fused layer ops (RMSNorm, RoPE + KV append, SiLU·up) as Triton kernels; with
    ``linear_rows=16`` the steps of at most 16 tokens (two of the four below) also run the fused small-batch
    projections, on their tl.dot tiles (the one- and two-token tiles: tests/equivalence/test_linear.py)."""
    target = tiny_target(family)
    opt = OptimizedTarget(target, attention_backend="triton", linear_rows=linear_rows)
    opt.allocate_cache(max_num_seqs=4, max_seq_len=32)
    for logits, feats, ref_logits, ref_feats in run_steps(target, opt):
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(feats, ref_feats, atol=ATOL, rtol=RTOL)


def test_taps_read_from_the_next_norm_are_the_separate_add():
    """A tapped layer's output is read from the sum the next layer's first norm computes: the same bits, in bf16 too,
    as adding the layer's MLP output on its own (what the taps cost before: one add kernel each)."""
    from optimized.kernels.layer_ops import rope_cos_sin
    from optimized.models.target import decoder_layer, run_layers, token_write_index

    target = tiny_target("llama")
    target.model.to(torch.bfloat16)
    opt = OptimizedTarget(target, attention_backend="torch")
    opt.allocate_cache(max_num_seqs=1, max_seq_len=16)
    n = 6
    x0 = torch.randn(n, opt.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    positions = torch.arange(n)
    cu, kv_lens, slots = (torch.tensor(v, dtype=torch.int32) for v in ([0, n], [n], [0]))
    write_slots, write_pos = token_write_index(positions, cu, slots, opt.k_cache.shape[1] - 1)
    cos, sin = rope_cos_sin(positions, opt.inv_freq, opt.rope_scaling, torch.bfloat16)
    args = (opt.shape, cos, sin, opt.k_cache, opt.v_cache, write_slots, write_pos, cu, kv_lens, slots)
    taps = (0, opt.num_layers - 2)
    out, tapped = run_layers(x0, opt.layers, *args, causal=True, max_q_len=n, backend="torch", taps=taps)
    x, pending, expected = x0, None, {}
    for i, w in enumerate(opt.layers):  # the separate adds
        x, pending, _ = decoder_layer(x, pending, w, opt.shape, cos, sin, opt.k_cache[i], opt.v_cache[i],
                                      write_slots, write_pos, cu, kv_lens, slots, causal=True, max_q_len=n,
                                      backend="torch")
        if i in taps:
            x, pending = x + pending, None
            expected[i] = x
    assert set(tapped) == set(taps)
    for i in taps:
        assert torch.equal(tapped[i], expected[i])
    assert torch.equal(out, x + pending)


def test_target_fused_weights_share_storage():
    """Fusing q/k/v and gate/up costs no memory: the HF parameters become views of the fused tensors."""
    target = tiny_target("llama")
    opt = OptimizedTarget(target)
    attn = target.model.model.layers[1].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == opt.layers[1].qkv.untyped_storage().data_ptr()
    assert opt.layer_ids == target.layer_ids


def test_target_logits_out_buffer():
    """``logits_out`` (the verify graphs' one static output) gets exactly the logits, and is what is returned."""
    target = tiny_target("llama")
    opt = OptimizedTarget(target, attention_backend="torch")
    opt.allocate_cache(max_num_seqs=2, max_seq_len=16)
    ids, pos = torch.tensor([5, 9, 3, 7]), torch.arange(4)
    cu, kv, slots = (torch.tensor(v, dtype=torch.int32) for v in ([0, 4, 4], [4, 0], [1, -1]))
    expected, _ = opt.forward(ids, pos, cu, kv, slots)
    buffer = torch.full((6, VOCAB), float("nan"))
    logits, _ = opt.forward(ids, pos, cu, kv, slots, logits_out=buffer[:4])
    assert logits.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:4], expected) and buffer[4:].isnan().all()
    with pytest.raises(ValueError, match="logits_out"):
        opt.forward(ids, pos, cu, kv, slots, logits_out=buffer[:3])


def test_target_bad_input_fails_fast():
    target = tiny_target("llama")
    opt = OptimizedTarget(target)
    ids, pos = torch.zeros(3, dtype=torch.long), torch.arange(3)
    cu, kv, slots = (torch.tensor(v, dtype=torch.int32) for v in ([0, 3], [3], [0]))
    with pytest.raises(RuntimeError, match="allocate_cache"):
        opt.forward(ids, pos, cu, kv, slots)
    opt.allocate_cache(1, 8)
    with pytest.raises(ValueError, match="int32"):
        opt.forward(ids, pos, cu.long(), kv, slots)
    with pytest.raises(ValueError, match="layer_ids"):
        OptimizedTarget(target.model, layer_ids=[3])


# ---------------------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------------------


def tiny_drafter(target: Target, mask_token_id: int | None, seed: int = 1) -> DSparkDrafter:
    """A 2-layer drafter for ``target`` with O(1)-scale random weights (the 0.02 init would make every attention
    nearly uniform and hide masking mistakes)."""
    cfg = DrafterConfig.from_target_config(target.config, target_layer_ids=target.layer_ids, block_size=GAMMA,
                                           num_layers=2, markov_rank=8, mask_token_id=mask_token_id)
    drafter = DSparkDrafter(cfg)
    drafter.attach_target(target.embed_tokens, target.lm_head)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(std=1.5 * p.shape[1] ** -0.5)
            else:
                p.normal_(std=0.5)
    return drafter.eval()


# (family, mask token, backend of attention and layer ops): the interpreted Triton kernels run for two families.
DRAFTER_CASES = [("llama", None, "torch"), ("qwen3", VOCAB - 1, "torch"), ("qwen2", None, "torch")] + [
    (family, mask, b) for b in BACKENDS if b == "triton" for family, mask in (("llama", None), ("qwen3", VOCAB - 1))]


@pytest.mark.parametrize("family,mask_token_id,backend", DRAFTER_CASES)
def test_drafter_backbone_matches_reference(family, mask_token_id, backend):
    target = tiny_target(family)
    drafter = tiny_drafter(target, mask_token_id)
    opt = OptimizedDrafter(drafter, attention_backend=backend)
    opt.allocate_cache(max_num_seqs=4, max_seq_len=24)
    md = opt.context_proj.shape[1]
    g = torch.Generator().manual_seed(0)
    slots = {"A": 3, "B": 1, "C": 0}
    refs = {name: drafter.new_context_cache() for name in slots}
    # Context chunks (request, first position, count), several requests per append call, plus padding tokens.
    rounds = [
        ([("A", 0, 3), ("B", 0, 5)], {"A": 3, "B": 5, "C": 0}),  # C has an empty context (P = 0)
        ([("B", 5, 4), ("A", 3, 2)], {"A": 5, "B": 9, "C": 0}),
        ([("A", 5, 3), ("C", 0, 1)], {"A": 8, "B": 9, "C": 1}),  # overwrites A's block scratch at 5..7
    ]
    for chunks, anchor_pos in rounds:
        feats, pos, slot_of = [], [], []
        for name, start, n in chunks:
            f = 3 * torch.randn(n, md, generator=g)
            refs[name].append(f, torch.arange(start, start + n))
            feats.append(f)
            pos.append(torch.arange(start, start + n))
            slot_of.append(torch.full((n,), slots[name]))
        feats.append(torch.randn(2, md, generator=g))  # padding tokens
        pos.append(torch.tensor([0, 2]))  # positions every request reads: trash slot only
        slot_of.append(torch.tensor([-1, -1]))
        opt.append_context(torch.cat(feats), torch.cat(pos), torch.cat(slot_of))

        names = ["B", None, "A", "C"]  # a padded row in the middle
        anchors = torch.randint(0, VOCAB, (len(names),), generator=g)
        h = opt.backbone(anchors, torch.tensor([anchor_pos.get(n, 0) for n in names]),
                         torch.tensor([-1 if n is None else slots[n] for n in names], dtype=torch.int32))
        assert h.shape == (len(names), GAMMA, target.hidden_size)
        for i, name in enumerate(names):
            if name is None:
                continue
            expected = drafter.backbone_cached(int(anchors[i]), anchor_pos[name], refs[name])  # [γ, d]
            torch.testing.assert_close(h[i], expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(opt.base_logits(h[:1]), drafter.base_logits(h[:1]), atol=ATOL, rtol=RTOL)
