"""Tests of reference/losses.py: the three loss terms by explicit loops, anchors, block targets and mask."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from reference import losses
from reference.losses import (
    block_attention_mask,
    block_targets,
    dspark_loss,
    position_weights,
    sample_anchors,
)

# float32 loss values are sums of a few dozen terms of size O(1): 1e-5 absolute is ~100 ulps of headroom.
F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _example(seed: int = 0, N: int = 2, gamma: int = 3, V: int = 5):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(N, gamma, V, generator=g) * 2
    target = torch.randn(N, gamma, V, generator=g) * 2
    labels = torch.randint(0, V, (N, gamma), generator=g)
    conf = torch.randn(N, gamma, generator=g)
    valid = torch.tensor([[True, True, True], [True, True, False]])[:N, :gamma]
    return draft, target, labels, conf, valid


def _loop_reference(draft, target, labels, conf, valid, decay, weights):
    """The loss terms by explicit Python loops over blocks, slots and vocabulary entries (float64)."""
    N, gamma, V = draft.shape
    sums = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    wsum = 0.0
    for n in range(N):
        for k in range(gamma):
            if not valid[n, k]:
                continue
            w = math.exp(-k / decay)  # slot k+1: exp(-((k+1)-1)/λ)
            zd = [float(x) for x in draft[n, k]]
            zt = [float(x) for x in target[n, k]]
            ed = [math.exp(x - max(zd)) for x in zd]
            et = [math.exp(x - max(zt)) for x in zt]
            pd = [e / sum(ed) for e in ed]
            pt = [e / sum(et) for e in et]
            ce = -math.log(pd[int(labels[n, k])])
            l1 = sum(abs(pd[v] - pt[v]) for v in range(V))
            cstar = sum(min(pd[v], pt[v]) for v in range(V))
            c = 1.0 / (1.0 + math.exp(-float(conf[n, k])))
            bce = -(cstar * math.log(c) + (1 - cstar) * math.log(1 - c))
            sums["ce"] += w * ce
            sums["l1"] += w * l1
            sums["conf"] += w * bce
            wsum += w
    out = {key: val / wsum for key, val in sums.items()}
    out["loss"] = weights[0] * out["ce"] + weights[1] * out["l1"] + weights[2] * out["conf"]
    return out


def test_position_weights_decay():
    w = position_weights(7, decay=4.0)
    expected = torch.tensor([math.exp(-(k - 1) / 4.0) for k in range(1, 8)], dtype=torch.float32)
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=0)  # float32 exp: a few ulps
    assert w[0] == 1.0 and bool((w[1:] < w[:-1]).all())
    torch.testing.assert_close(position_weights(3, decay=2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]),
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="decay"):
        position_weights(3, decay=0.0)
    with pytest.raises(ValueError, match="gamma"):
        position_weights(0)


@pytest.mark.parametrize("decay", [4.0, 1.5])
def test_dspark_loss_matches_explicit_loops(decay):
    draft, target, labels, conf, valid = _example()
    out = dspark_loss(draft, target, labels, conf, valid, decay=decay)
    ref = _loop_reference(draft, target, labels, conf, valid, decay, (0.1, 0.9, 1.0))
    for key in ("loss", "ce", "l1", "conf"):
        assert out[key].dtype == torch.float32
        torch.testing.assert_close(out[key], torch.tensor(ref[key], dtype=torch.float32), **F32_TOL, msg=key)
    # Diagnostics: argmax hit rate and mean c* over the 5 valid slots.
    hits = [(int(draft[n, k].argmax()) == int(labels[n, k])) for n in range(2) for k in range(3) if valid[n, k]]
    assert float(out["acc"]) == pytest.approx(sum(hits) / 5, abs=1e-7)
    pd, pt = draft.softmax(-1), target.softmax(-1)
    cstar = torch.minimum(pd, pt).sum(-1)[valid].mean()
    torch.testing.assert_close(out["conf_target_mean"], cstar, **F32_TOL)
    assert not out["acc"].requires_grad and not out["conf_target_mean"].requires_grad


def test_invalid_slots_are_ignored():
    draft, target, labels, conf, valid = _example()
    base = dspark_loss(draft, target, labels, conf, valid)
    draft2, target2, conf2, labels2 = draft.clone(), target.clone(), conf.clone(), labels.clone()
    draft2[1, 2] += 7.0
    target2[1, 2] -= 3.0
    conf2[1, 2] = 9.0
    labels2[1, 2] = (labels[1, 2] + 1) % 5
    moved = dspark_loss(draft2, target2, labels2, conf2, valid)
    for key in ("loss", "ce", "l1", "conf", "acc", "conf_target_mean"):
        assert torch.equal(base[key], moved[key]), key


def test_chunking_does_not_change_the_result(monkeypatch):
    """Scoring 1 row per chunk (checkpointed) must equal the single-chunk result, values and gradients."""
    draft, target, labels, conf, valid = _example(seed=3)

    def run():
        d = draft.clone().requires_grad_()
        c = conf.clone().requires_grad_()
        out = dspark_loss(d, target, labels, c, valid)
        out["loss"].backward()
        return out["loss"].detach(), d.grad, c.grad

    whole = run()
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 5)  # V = 5 -> one row per chunk, six chunks
    chunked = run()
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # same float32 ops per row, different grouping


def test_cstar_is_detached():
    draft, target, labels, conf, valid = _example(seed=1)
    d = draft.clone().requires_grad_()
    c = conf.clone().requires_grad_()
    out = dspark_loss(d, target, labels, c, valid)
    # No gradient from L_conf reaches the draft logits: c* is a detached target.
    g_draft, g_conf = torch.autograd.grad(out["conf"], (d, c), allow_unused=True)
    assert g_draft is None or torch.equal(g_draft, torch.zeros_like(d))
    assert g_conf is not None and float(g_conf.abs().sum()) > 0
    # d L_conf / d z_conf = w_k (σ(z) - c*) / Σw on valid slots, 0 elsewhere.
    w = position_weights(3)[None, :].expand(2, 3)
    cstar = torch.minimum(draft.softmax(-1), target.softmax(-1)).sum(-1)
    expected = torch.where(valid, w * (conf.sigmoid() - cstar), 0.0) / w[valid].sum()
    torch.testing.assert_close(g_conf, expected, **F32_TOL)


def test_target_logits_get_no_gradient():
    draft, target, labels, conf, valid = _example(seed=2)
    t = target.clone().requires_grad_()
    out = dspark_loss(draft.clone().requires_grad_(), t, labels, conf, valid)
    out["loss"].backward()
    assert t.grad is None


def test_ce_only_arm_and_parallel_mix():
    draft, target, labels, conf, valid = _example(seed=4)
    ref = _loop_reference(draft, target, labels, conf, valid, 4.0, (1.0, 0.0, 0.0))
    d = draft.clone().requires_grad_()
    out = dspark_loss(d, None, labels, None, valid, weights=(1, 0, 0))
    assert set(out) == {"loss", "ce", "acc"}
    torch.testing.assert_close(out["loss"], torch.tensor(ref["ce"], dtype=torch.float32), **F32_TOL)
    out["loss"].backward()
    assert d.grad is not None and bool(d.grad.isfinite().all())

    # (w_ce, w_l1, 0): no confidence head needed; L1 still reported and differentiated.
    out = dspark_loss(draft, target, labels, None, valid, weights=(0.1, 0.9, 0.0))
    assert "conf" not in out
    torch.testing.assert_close(out["loss"], torch.tensor(0.1 * ref["ce"] + 0.9 * ref["l1"], dtype=torch.float32),
                               **F32_TOL)

    # Zero-weight terms with given inputs are diagnostics: reported, but detached.
    out = dspark_loss(draft.clone().requires_grad_(), target, labels, conf, valid, weights=(1, 0, 0))
    assert not out["l1"].requires_grad and not out["conf"].requires_grad
    torch.testing.assert_close(out["l1"], torch.tensor(ref["l1"], dtype=torch.float32), **F32_TOL)

    with pytest.raises(ValueError, match="target_logits is None"):
        dspark_loss(draft, None, labels, conf, valid)
    with pytest.raises(ValueError, match="conf_logits is None"):
        dspark_loss(draft, target, labels, None, valid)
    with pytest.raises(ValueError, match="all zero"):
        dspark_loss(draft, target, labels, conf, valid, weights=(0, 0, 0))


def test_empty_valid_gives_zero_loss_that_backpropagates():
    draft, target, labels, conf, _ = _example()
    d = draft.clone().requires_grad_()
    c = conf.clone().requires_grad_()
    out = dspark_loss(d, target, labels, c, torch.zeros(2, 3, dtype=torch.bool))
    assert float(out["loss"].detach()) == 0.0 and out["loss"].requires_grad
    out["loss"].backward()
    assert torch.equal(d.grad, torch.zeros_like(d)) and torch.equal(c.grad, torch.zeros_like(c))
    # No rows at all.
    d0 = torch.zeros(0, 3, 5, requires_grad=True)
    out = dspark_loss(d0, torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3),
                      torch.zeros(0, 3, dtype=torch.bool))
    out["loss"].backward()
    assert float(out["loss"].detach()) == 0.0 and d0.grad.shape == (0, 3, 5)


def test_bf16_inputs_give_finite_float32_loss_and_gradients():
    g = torch.Generator().manual_seed(5)
    N, gamma, V = 4, 7, 257
    draft = (torch.randn(N, gamma, V, generator=g) * 8).bfloat16().requires_grad_()  # peaked: tiny probabilities
    target = (torch.randn(N, gamma, V, generator=g) * 8).bfloat16()
    conf = (torch.randn(N, gamma, generator=g) * 20).bfloat16().requires_grad_()  # saturated sigmoids
    labels = torch.randint(0, V, (N, gamma), generator=g)
    valid = torch.ones(N, gamma, dtype=torch.bool)
    valid[1, 4:] = False
    out = dspark_loss(draft, target, labels, conf, valid)
    assert out["loss"].dtype == torch.float32 and bool(out["loss"].isfinite())
    out["loss"].backward()
    assert draft.grad.dtype == torch.bfloat16 and bool(draft.grad.float().isfinite().all())
    assert bool(conf.grad.float().isfinite().all())
    # Same value as computing from the float32 upcast of the same bf16 numbers.
    ref = dspark_loss(draft.detach().float(), target.float(), labels, conf.detach().float(), valid)
    torch.testing.assert_close(out["loss"].detach(), ref["loss"], **F32_TOL)


def test_dspark_loss_rejects_bad_shapes():
    draft, target, labels, conf, valid = _example()
    with pytest.raises(ValueError, match="labels"):
        dspark_loss(draft, target, labels.int(), conf, valid)
    with pytest.raises(ValueError, match="valid"):
        dspark_loss(draft, target, labels, conf, valid.long())
    with pytest.raises(ValueError, match="target_logits"):
        dspark_loss(draft, target[:, :2], labels, conf, valid)


# ----------------------------------------------------------------------------------------------- anchors


def _brute_eligible(mask):
    return [p for p in range(len(mask) - 1) if mask[p] and mask[p + 1]]


def test_sample_anchors_eligibility_distinctness_determinism():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    eligible = _brute_eligible(mask.tolist())  # [2, 3, 6, 9, 10, 11]
    for seed in range(20):
        a = sample_anchors(mask, 4, gamma=7, generator=torch.Generator().manual_seed(seed))
        assert a.dtype == torch.int64 and a.numel() == 4
        assert set(a.tolist()) <= set(eligible)
        assert torch.equal(a, a.sort().values) and len(set(a.tolist())) == 4
        b = sample_anchors(mask, 4, gamma=7, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(a, b)


def test_sample_anchors_edge_cases():
    mask = torch.tensor([0, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert torch.equal(sample_anchors(mask, 10, gamma=3), torch.tensor([3]))  # fewer eligible than asked
    none = sample_anchors(torch.tensor([1, 0, 1, 0, 1], dtype=torch.bool), 4, gamma=3)
    assert none.dtype == torch.int64 and none.numel() == 0
    assert sample_anchors(torch.tensor([True]), 4, gamma=3).numel() == 0  # S = 1: no p+1
    assert sample_anchors(torch.ones(8, dtype=torch.bool), 0, gamma=3).numel() == 0
    with pytest.raises(ValueError, match="loss_mask"):
        sample_anchors(torch.ones(8), 2, gamma=3)


def test_sample_anchors_is_uniform():
    """Each eligible position is drawn with probability n/E; binomial test per position at α = 1e-3 (Bonferroni)."""
    mask = torch.ones(13, dtype=torch.bool)  # E = 12 eligible positions
    trials, n = 3000, 4
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(13, dtype=torch.int64)
    for _ in range(trials):
        counts[sample_anchors(mask, n, gamma=7, generator=gen)] += 1
    assert counts[12] == 0
    for p in range(12):
        pval = stats.binomtest(int(counts[p]), trials, n / 12).pvalue
        assert pval > 1e-3 / 12, (p, int(counts[p]))


# ----------------------------------------------------------------------------------------------- block targets


def test_block_targets_by_hand():
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    bt = block_targets(ids, mask, torch.tensor([2, 5, 6]), gamma=3)
    assert torch.equal(bt.labels, torch.tensor([[13, 14, 15], [16, 17, 0], [17, 0, 0]]))
    assert torch.equal(bt.prev_tokens, torch.tensor([[12, 13, 14], [15, 16, 17], [16, 17, 0]]))
    assert torch.equal(bt.target_pos, torch.tensor([[2, 3, 4], [5, 6, 7], [6, 7, 7]]))
    # Anchor 2: slot 2 lands on a user token (mask[4] = 0), which also invalidates slot 3 (mask[5] = 1).
    assert torch.equal(bt.valid, torch.tensor([[True, False, False], [True, True, False], [True, False, False]]))


def test_block_targets_cumulative_validity_random():
    g = torch.Generator().manual_seed(7)
    S, gamma = 40, 5
    ids = torch.randint(0, 100, (S,), generator=g)
    mask = torch.rand(S, generator=g) < 0.8
    anchors = torch.arange(S)
    bt = block_targets(ids, mask, anchors, gamma)
    for j, p in enumerate(anchors.tolist()):
        ok = True
        for k in range(1, gamma + 1):
            ok = ok and p + k < S and bool(mask[p + k])
            assert bool(bt.valid[j, k - 1]) == ok
            if p + k < S:
                assert int(bt.labels[j, k - 1]) == int(ids[p + k])
            assert int(bt.prev_tokens[j, k - 1]) == (int(ids[p + k - 1]) if p + k - 1 < S else 0)
    with pytest.raises(ValueError, match="anchors"):
        block_targets(ids, mask, torch.tensor([S]), gamma)


# ----------------------------------------------------------------------------------------------- block mask


def _brute_mask(anchors, gamma, ctx_len, ctx_valid):
    nb = len(anchors)
    m = torch.zeros(nb * gamma, ctx_len + nb * gamma, dtype=torch.bool)
    for j in range(nb):
        for k in range(gamma):
            q = j * gamma + k
            for c in range(ctx_len):
                m[q, c] = c < anchors[j] and (ctx_valid is None or bool(ctx_valid[c]))
            for j2 in range(nb):
                for k2 in range(gamma):
                    m[q, ctx_len + j2 * gamma + k2] = j2 == j
    return m


@pytest.mark.parametrize("with_valid", [False, True])
def test_block_attention_mask_matches_brute_force(with_valid):
    anchors = torch.tensor([0, 3, 4, 9])
    ctx_len, gamma = 10, 3
    ctx_valid = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool) if with_valid else None
    got = block_attention_mask(anchors, gamma, ctx_len, ctx_valid)
    assert got.shape == (12, 22) and got.dtype == torch.bool
    assert torch.equal(got, _brute_mask(anchors.tolist(), gamma, ctx_len, ctx_valid))
    assert bool(got.any(dim=1).all())  # no query row is empty, even for the anchor at position 0
    with pytest.raises(ValueError, match="anchors"):
        block_attention_mask(torch.tensor([11]), gamma, ctx_len)
