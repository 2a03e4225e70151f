"""Tests of reference/drafter.py (docs/method.md §1): masks, KV injection, cache, heads and block sampling.

Float tolerances are for float32 on CPU: 1e-5 where the same math runs with different shapes (packed vs
single blocks, cached vs recomputed context), exact equality where only masked-out or unrelated inputs change.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from scipy import stats

from reference import sampling
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter, apply_rope, block_attention_mask, rope_cos_sin
from tests.conftest import TINY_D, TINY_GAMMA, TINY_TAPS, TINY_V, tiny_drafter_config

V, D_MODEL, GAMMA, TAPS = TINY_V, TINY_D, TINY_GAMMA, TINY_TAPS
FP32_TOL = 1e-5  # same math in a different order (shapes) in float32, activations O(1)


make_config = tiny_drafter_config


def make_target(seed: int = 0) -> tuple[nn.Embedding, nn.Linear]:
    """A plain embedding and LM head standing in for the target's modules."""
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(V, D_MODEL)
    lm = nn.Linear(D_MODEL, V, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(V, D_MODEL, generator=g))
        lm.weight.copy_(torch.randn(V, D_MODEL, generator=g) * 0.5)
    return emb.requires_grad_(False), lm.requires_grad_(False)


def make_drafter(cfg: DrafterConfig, seed: int = 0, trained_heads: bool = True) -> DSparkDrafter:
    """A drafter with non-trivial weights: W2 = 0 at init would hide the sequential head from every test."""
    torch.manual_seed(seed)
    drafter = DSparkDrafter(cfg)
    drafter.attach_target(*make_target(seed))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)  # larger than the 0.02 init so every path visibly moves h and the logits
        if trained_heads and drafter.seq_head is not None:
            drafter.seq_head.w2.weight.normal_(0, 1.0)
    return drafter.eval()


def make_context(B: int, S: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(B, S, len(TAPS) * D_MODEL, generator=g)  # [B, S, m·d]
    positions = torch.arange(S).expand(B, S).clone()  # [B, S]
    valid = torch.ones(B, S, dtype=torch.bool)  # [B, S]
    return features, positions, valid


HEADS = [("markov", False), ("markov", True), ("rnn", False), ("rnn", True), ("none", False), ("none", True)]


def test_rope_matches_hf_llama():
    """The context keys must be rotated exactly as the target (HF Llama convention) would rotate them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=10000.0)
    positions = torch.tensor([[0, 1, 7, 300, 2047]])  # [1, T]
    x = torch.randn(1, 4, 5, 16)  # [B, H, T, D]
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf_cfg)(x, positions)
    ref, _ = apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(positions, 16, 10000.0, torch.float32)
    torch.testing.assert_close(apply_rope(x, cos, sin), ref, atol=1e-6, rtol=1e-6)


def test_block_mask_layout():
    anchor_pos = torch.tensor([[2, 5]])  # [1, nb=2]
    ctx_pos = torch.tensor([[0, 1, 2, 3, 4, 5]])
    ctx_valid = torch.tensor([[True, True, True, False, True, True]])
    mask = block_attention_mask(anchor_pos, ctx_pos, ctx_valid, gamma=2)[0, 0]  # [Q=4, S+Q=10]
    expected = torch.tensor([
        # ctx 0..5 (pos 3 invalid)     block 0   block 1
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("head,qk_norm", HEADS)
def test_confidence_and_draft_never_see_x_k(head, qk_norm):
    """Perturbing x_j (the prev token of slot j+1) leaves slots 1..j exactly unchanged (docs/method.md §1, §5)."""
    drafter = make_drafter(make_config(head, qk_norm))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 3, GAMMA, D_MODEL, generator=g)  # [B, nb, γ, d]
    prev = torch.randint(0, V, (2, 3, GAMMA), generator=g)  # [B, nb, γ]
    draft, conf = drafter.head_logits(h, prev)
    for j in range(1, GAMMA):
        changed = prev.clone()
        changed[..., j] = (changed[..., j] + 1 + torch.arange(6).view(2, 3)) % V
        draft2, conf2 = drafter.head_logits(h, changed)
        assert torch.equal(draft2[..., :j, :], draft[..., :j, :])
        assert torch.equal(conf2[..., :j], conf[..., :j])
        if head == "none":
            assert torch.equal(draft2, draft) and torch.equal(conf2, conf)
        else:  # the perturbed token does reach slot j+1 (index j): the test can fail
            assert (conf2[..., j] - conf[..., j]).abs().min() > 1e-6
            assert (draft2[..., j, :] - draft[..., j, :]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("head,qk_norm", HEADS)
def test_context_at_or_after_anchor_is_invisible(head, qk_norm):
    drafter = make_drafter(make_config(head, qk_norm, attention_bias=qk_norm))
    features, positions, valid = make_context(B=2, S=12)
    valid[1, 3] = False  # a padding slot before the anchor
    anchor_ids = torch.tensor([[5, 7], [9, 11]])
    anchor_pos = torch.tensor([[6, 6], [8, 8]])  # [B, nb]
    h = drafter(anchor_ids, anchor_pos, features, positions, valid)

    later = features.clone()
    later[0, 6:] += 5.0  # positions ≥ anchor 6
    later[1, 8:] -= 3.0  # positions ≥ anchor 8
    later[1, 3] += 7.0  # invalid position
    assert torch.equal(drafter(anchor_ids, anchor_pos, later, positions, valid), h)

    earlier = features.clone()
    earlier[0, 5] += 1.0
    earlier[1, 0] += 1.0
    diff = (drafter(anchor_ids, anchor_pos, earlier, positions, valid) - h).abs().amax(dim=(-1, -2))  # [B, nb]
    assert (diff > 1e-3).all()


def test_parallel_only_equals_markov_with_zero_w2():
    parallel = make_drafter(make_config("none"))
    markov = DSparkDrafter(make_config("markov"))
    markov.attach_target(*parallel._target)
    backbone = {k: v for k, v in parallel.state_dict().items() if not k.startswith("conf_head")}
    missing, unexpected = markov.load_state_dict(backbone, strict=False)
    assert not unexpected and all(k.startswith(("seq_head", "conf_head")) for k in missing)
    assert torch.equal(markov.seq_head.w2.weight, torch.zeros_like(markov.seq_head.w2.weight))  # zero init

    features, positions, valid = make_context(B=2, S=10)
    anchor_ids, anchor_pos = torch.tensor([[3, 4], [5, 6]]), torch.tensor([[4, 9], [2, 7]])
    h_p = parallel(anchor_ids, anchor_pos, features, positions, valid)
    h_m = markov(anchor_ids, anchor_pos, features, positions, valid)
    assert torch.equal(h_p, h_m)
    prev = torch.randint(0, V, (2, 2, GAMMA))
    assert torch.equal(parallel.head_logits(h_p, prev)[0], markov.head_logits(h_m, prev)[0])


@pytest.mark.parametrize("head,qk_norm", HEADS)
def test_cached_context_matches_forward(head, qk_norm):
    drafter = make_drafter(make_config(head, qk_norm))
    S = 17
    features, positions, valid = make_context(B=1, S=S)
    anchors = [(4, 11), (9, 16), (17, 5)]  # (anchor_pos, anchor_id): p ranges over partial and full context
    anchor_pos = torch.tensor([[p for p, _ in anchors]])
    anchor_ids = torch.tensor([[t for _, t in anchors]])
    h_fwd = drafter(anchor_ids, anchor_pos, features, positions, valid)[0]  # [nb, γ, d]

    cache = drafter.new_context_cache()
    for start, end in ((0, 3), (3, 4), (4, 11), (11, 17)):
        cache.append(features[0, start:end], positions[0, start:end])
    assert cache.length == S
    for i, (p, t) in enumerate(anchors):
        # The cache holds all 17 positions; positions ≥ p must be masked, as in forward.
        torch.testing.assert_close(drafter.backbone_cached(t, p, cache), h_fwd[i], atol=FP32_TOL, rtol=0)


def test_cache_rejects_bad_appends():
    drafter = make_drafter(make_config())
    features, positions, _ = make_context(B=1, S=6)
    cache = drafter.new_context_cache()
    cache.append(features[0, :3], positions[0, :3])
    with pytest.raises(ValueError, match="beyond the cached"):
        cache.append(features[0, 2:4], positions[0, 2:4])
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.append(features[0, 3:5], torch.tensor([5, 4]))
    with pytest.raises(ValueError, match="m·d"):
        cache.append(features[0, 3:5, :D_MODEL], positions[0, 3:5])
    assert cache.length == 3


@pytest.mark.parametrize("head,qk_norm", [("markov", False), ("rnn", True)])
def test_packed_blocks_equal_blocks_alone(head, qk_norm):
    drafter = make_drafter(make_config(head, qk_norm))
    features, positions, valid = make_context(B=2, S=14)
    valid[0, 12:] = False  # right padding of a shorter sequence
    anchor_ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    anchor_pos = torch.tensor([[2, 7, 11], [5, 13, 14]])
    packed = drafter(anchor_ids, anchor_pos, features, positions, valid)  # [B, nb, γ, d]
    for b in range(2):
        for i in range(3):
            alone = drafter(anchor_ids[b:b + 1, i:i + 1], anchor_pos[b:b + 1, i:i + 1], features[b:b + 1],
                            positions[b:b + 1], valid[b:b + 1])
            torch.testing.assert_close(packed[b, i], alone[0, 0], atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("head,qk_norm", HEADS)
def test_sample_block_greedy_is_sequential_argmax(head, qk_norm):
    drafter = make_drafter(make_config(head, qk_norm))
    R = 8
    g = torch.Generator().manual_seed(5)
    h = torch.randn(R, GAMMA, D_MODEL, generator=g)
    anchor_ids = torch.randint(0, V, (R,), generator=g)
    anchor_pos = torch.arange(R) + 20
    out = drafter.sample_block(h, anchor_ids, anchor_pos, torch.zeros(R), seed=7, request_ids=torch.arange(R))

    # Manual loop over the teacher-forced heads, feeding back the previously *sampled* token.
    tokens = torch.zeros(R, GAMMA, dtype=torch.long)
    for r in range(R):
        chosen = []
        for k in range(GAMMA):
            prev = torch.tensor([int(anchor_ids[r])] + chosen + [0] * (GAMMA - 1 - len(chosen)))
            draft, conf = drafter.head_logits(h[r], prev)
            chosen.append(int(draft[k].argmax()))
            torch.testing.assert_close(out.conf_logits[r, k], conf[k], atol=1e-6, rtol=0)
        tokens[r] = torch.tensor(chosen)
    assert torch.equal(out.tokens, tokens)
    assert torch.equal(out.probs, nn.functional.one_hot(tokens, V).float())
    if head != "none":  # the sequential head changes some greedy choices: the comparison is not vacuous
        assert not torch.equal(tokens, drafter.base_logits(h).argmax(-1))


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_sample_block_seeded_and_batch_independent(head):
    drafter = make_drafter(make_config(head))
    g = torch.Generator().manual_seed(6)
    h = torch.randn(3, GAMMA, D_MODEL, generator=g)
    anchor_ids, anchor_pos = torch.tensor([3, 50, 90]), torch.tensor([10, 4, 33])
    temperature, request_ids = torch.tensor([1.0, 0.7, 1.3]), torch.tensor([11, 12, 13])
    batch = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 123, request_ids)
    again = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 123, request_ids)
    assert torch.equal(batch.tokens, again.tokens)
    for r in range(3):
        alone = drafter.sample_block(h[r:r + 1], anchor_ids[r:r + 1], anchor_pos[r:r + 1], temperature[r:r + 1],
                                     123, request_ids[r:r + 1])
        assert torch.equal(alone.tokens[0], batch.tokens[r])
        torch.testing.assert_close(alone.probs[0], batch.probs[r], atol=1e-6, rtol=0)
    other_seed = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 124, request_ids)
    assert not torch.equal(other_seed.tokens, batch.tokens)


def test_sample_block_draws_from_reported_probs():
    """probs[r, k] is softmax(U_k + B_k(x_{k-1})/T) for the sampled prefix, and x_k follows it.

    Chi-square goodness of fit of slot 1 over 4000 requests sharing one h and anchor, at significance 1e-3
    (a correct sampler fails one run in a thousand; this seed is fixed, so the test is deterministic).
    """
    drafter = make_drafter(make_config("markov"))
    R = 4000
    h = torch.randn(1, GAMMA, D_MODEL, generator=torch.Generator().manual_seed(8)).expand(R, -1, -1)
    out = drafter.sample_block(h, torch.full((R,), 17), torch.full((R,), 40), torch.ones(R), 99, torch.arange(R))
    prev = torch.cat((torch.full((R, 1), 17), out.tokens[:, :-1]), dim=1)  # [R, γ]
    draft, _ = drafter.head_logits(h, prev)
    expected = sampling.logits_to_probs(draft, torch.ones(R), torch.ones(R), torch.zeros(R, dtype=torch.long))
    torch.testing.assert_close(out.probs, expected, atol=1e-6, rtol=0)

    p1 = out.probs[0, 0].double()
    counts = torch.bincount(out.tokens[:, 0], minlength=V).double()
    big = p1 * R >= 5  # pool the rare tokens so that every cell expects ≥ 5 draws
    observed = torch.cat((counts[big], counts[~big].sum().view(1)))
    expect = torch.cat((p1[big], p1[~big].sum().view(1))) * R
    assert stats.chisquare(observed.numpy(), expect.numpy()).pvalue > 1e-3


def test_target_modules_are_shared_not_owned():
    drafter = make_drafter(make_config("rnn", mask_token_id=None))
    emb, lm = drafter._target
    names = set(drafter.state_dict())
    assert not any("embed" in n and n != "mask_embedding" for n in names)
    assert not any("lm_head" in n for n in names)
    own = {id(p) for p in drafter.parameters()}
    assert id(emb.weight) not in own and id(lm.weight) not in own
    assert drafter.num_parameters() == sum(p.numel() for p in drafter.state_dict().values())


def test_mask_token_choices():
    # A learned vector, initialised at the embedding table's scale when the target is first attached.
    torch.manual_seed(0)
    drafter = DSparkDrafter(make_config())
    emb, lm = make_target()
    with torch.no_grad():
        emb.weight.mul_(10.0)
    drafter.attach_target(emb, lm)
    assert 5.0 < drafter.mask_embedding.std().item() < 20.0  # N(0, 10²) over 64 entries
    before = drafter.mask_embedding.detach().clone()
    drafter.attach_target(emb, lm)  # attaching again must not rescale it twice
    assert torch.equal(drafter.mask_embedding, before)

    # A spare vocabulary row: no parameter of its own, and the row really is what the block embeds.
    drafter = make_drafter(make_config(mask_token_id=V - 1))
    assert "mask_embedding" not in drafter.state_dict()
    features, positions, valid = make_context(B=1, S=6)
    args = (torch.tensor([[2]]), torch.tensor([[4]]), features, positions, valid)
    h = drafter(*args)
    with torch.no_grad():
        drafter._target[0].weight[V - 1] += 1.0
    assert (drafter(*args) - h).abs().max() > 1e-3


def test_fresh_heads_start_parallel_and_get_gradients():
    drafter = make_drafter(make_config("markov"), trained_heads=False)
    with torch.no_grad():
        drafter.seq_head.w2.weight.zero_()
    features, positions, valid = make_context(B=1, S=8)
    h = drafter(torch.tensor([[3]]), torch.tensor([[6]]), features, positions, valid)
    prev = torch.tensor([[[3, 4, 5, 6]]])
    draft, conf = drafter.head_logits(h, prev)
    assert torch.equal(draft, drafter.base_logits(h))  # B = 0 at init
    (draft.logsumexp(-1).sum() - draft[..., 0].sum() + conf.sum()).backward()
    assert drafter.seq_head.w2.weight.grad.abs().max() > 0
    assert drafter.seq_head.w1.weight.grad.abs().max() > 0  # through the confidence head
    assert drafter.context_proj.weight.grad.abs().max() > 0


@pytest.mark.parametrize("head,qk_norm", [("markov", True), ("rnn", False)])
def test_deepened_drafter_computes_the_same_and_trains_its_new_layers(head, qk_norm):
    drafter = make_drafter(make_config(head, qk_norm))
    deep = drafter.deepened(drafter.config.num_layers + 2)
    assert deep.config.num_layers == drafter.config.num_layers + 2 and deep.config.head == head
    assert all(a is b for a, b in zip(deep.target_modules(), drafter.target_modules(), strict=True))
    assert not deep.training
    for name, tensor in drafter.state_dict().items():  # the trained weights, untouched
        assert torch.equal(deep.state_dict()[name], tensor)

    features, positions, valid = make_context(B=2, S=10)
    anchor_ids, anchor_pos = torch.tensor([[3, 4], [5, 6]]), torch.tensor([[4, 9], [2, 7]])
    h = drafter(anchor_ids, anchor_pos, features, positions, valid)
    h_deep = deep(anchor_ids, anchor_pos, features, positions, valid)
    assert torch.equal(h, h_deep)  # the new layers add exact zeros to the residual stream
    prev = torch.randint(0, V, (2, 2, GAMMA))
    for a, b in zip(drafter.head_logits(h, prev), deep.head_logits(h_deep, prev), strict=True):
        assert torch.equal(a, b)

    # The zeroed output projections get a gradient at once, and through them the new layers learn.
    draft, conf = deep.head_logits(deep(anchor_ids, anchor_pos, features, positions, valid), prev)
    (draft.logsumexp(-1).sum() - draft[..., 0].sum() + conf.sum()).backward()
    new = deep.layers[-1]
    assert new.self_attn.o_proj.weight.grad.abs().max() > 0 and new.mlp.down_proj.weight.grad.abs().max() > 0
    assert new.self_attn.q_proj.weight.grad is not None
    with pytest.raises(ValueError, match="only adds layers"):
        drafter.deepened(drafter.config.num_layers - 1)


def test_bad_inputs_fail_fast():
    drafter = DSparkDrafter(make_config())
    features, positions, valid = make_context(B=1, S=5)
    with pytest.raises(RuntimeError, match="attach_target"):
        drafter(torch.tensor([[1]]), torch.tensor([[3]]), features, positions, valid)
    drafter.attach_target(*make_target())
    with pytest.raises(ValueError, match="m·d"):
        drafter(torch.tensor([[1]]), torch.tensor([[3]]), features[..., :D_MODEL], positions, valid)
    with pytest.raises(ValueError, match="ctx_pos"):
        drafter(torch.tensor([[1]]), torch.tensor([[3]]), features, positions[:, :4], valid)
    with pytest.raises(ValueError, match="prev_tokens"):
        drafter.head_logits(torch.zeros(2, GAMMA, D_MODEL), torch.zeros(2, GAMMA - 1, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden size"):
        drafter.attach_target(nn.Embedding(V, 32), nn.Linear(32, V))
