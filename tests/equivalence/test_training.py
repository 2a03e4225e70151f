"""The fast training step (optimized/training.py) against the reference one, loss and gradients.

Reference: ``DSparkDrafter.forward`` with every position as an anchor (the dense packed mask),
``head_logits`` and ``reference.losses.dspark_loss`` over ``dense_block_targets``, target logits gathered at
``p + k - 1``. Fast: ``dense_backbone`` + ``fused_head_loss``. Float32 on the CPU: the same math in another
order, so 1e-5 relative tolerances (losses O(1), gradients O(1e-2)).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from optimized.training import STAT_NAMES, dense_backbone, dense_step_loss, fused_head_loss
from reference.drafter import DSparkDrafter
from reference.losses import block_targets, dense_block_targets, dspark_loss, teacher_rows
from tests.conftest import TINY_D, TINY_TAPS, TINY_V, tiny_drafter_config

TOL = dict(atol=2e-5, rtol=1e-4)
# These tests run on CPU tensors, so the Triton variant needs the interpreter even on a GPU machine
# (tests/equivalence/test_distill_loss.py runs the kernel itself on the GPU there).
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
# The per-row loss work in torch or in the Triton kernel; every target row, or only the rows that teach a slot.
VARIANTS = [pytest.param("torch", False, id="torch-all-rows"), pytest.param("torch", True, id="torch-teacher-rows"),
            pytest.param("triton", True, id="triton-teacher-rows", marks=needs_triton)]


def _num_rows(compact: bool, lmask, attn):
    return teacher_rows(lmask & attn) if compact else None


def _drafter(head: str, factored: bool = False, qk_norm: bool = False, mask_token_id=None, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(head=head, qk_norm=qk_norm, markov_factored=factored, mask_token_id=mask_token_id)
    drafter = DSparkDrafter(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    emb, lm = nn.Embedding(TINY_V, TINY_D), nn.Linear(TINY_D, TINY_V, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(TINY_V, TINY_D, generator=g))
        lm.weight.copy_(torch.randn(TINY_V, TINY_D, generator=g) * 0.5)
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1, generator=g)  # the zero-initialised W2 / P must matter here
    drafter.attach_target(emb.requires_grad_(False), lm.requires_grad_(False))
    return drafter


def _batch(B=3, S=13, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_V, (B, S), generator=g)
    lengths = torch.tensor([S, S - 4, S - 7])[:B]
    attn = torch.arange(S)[None, :] < lengths[:, None]  # [B, S] right padded
    prompt = torch.tensor([3, 2, 1])[:B]
    lmask = attn & (torch.arange(S)[None, :] >= prompt[:, None])  # [B, S] response tokens
    lmask[1, 6] = False  # a hole inside a response: blocks must stop at it
    features = torch.randn(B, S, len(TINY_TAPS) * TINY_D, generator=g)
    target_logits = torch.randn(B, S, TINY_V, generator=g) * 2
    return ids, lmask, attn, features, target_logits


def test_dense_block_targets_equal_sparse_ones_at_every_eligible_anchor():
    ids, lmask, attn, _, _ = _batch()
    gamma = 4
    dense = dense_block_targets(ids, lmask, gamma)
    for b in range(ids.shape[0]):
        n = int(attn[b].sum())
        eligible = torch.nonzero(lmask[b, :n - 1] & lmask[b, 1:n]).flatten()
        sparse = block_targets(ids[b, :n], lmask[b, :n], eligible, gamma)
        assert torch.equal(dense.valid[b, eligible], sparse.valid)
        v = sparse.valid
        assert torch.equal(dense.labels[b, eligible][v], sparse.labels[v])
        assert torch.equal(dense.prev_tokens[b, eligible][v], sparse.prev_tokens[v])
        assert torch.equal(dense.target_pos[b, eligible][v], sparse.target_pos[v])
        others = torch.ones(ids.shape[1], dtype=torch.bool)
        others[eligible] = False
        assert not dense.valid[b, others].any()  # prompt, padding and the hole's neighbours are never anchors


@pytest.mark.parametrize("attention", ["einsum", "flex"])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("mask_token_id", [None, 5])
def test_dense_backbone_equals_the_packed_reference_forward(qk_norm, mask_token_id, attention):
    drafter = _drafter("markov", qk_norm=qk_norm, mask_token_id=mask_token_id)
    ids, _, attn, features, _ = _batch()
    B, S = ids.shape
    pos = torch.arange(S).expand(B, S)
    ref = drafter(ids, pos, features, pos, attn)  # [B, S, γ, d]: the dense mask of the reference
    with torch.set_grad_enabled(attention != "flex"):  # FlexAttention has no backward on a CPU (see below)
        fast = dense_backbone(drafter, ids, features, attn, attention=attention)
    real = attn[:, :, None, None].expand_as(ref)  # anchors on padding are garbage in both (never supervised)
    torch.testing.assert_close(fast[real], ref[real], **TOL)


def _reference_loss(drafter, ids, lmask, attn, features, target_logits, weights, decay):
    B, S = ids.shape
    pos = torch.arange(S).expand(B, S)
    t = dense_block_targets(ids, lmask & attn, drafter.config.block_size)
    h = drafter(ids, pos, features, pos, attn)  # [B, S, γ, d]
    draft, conf = drafter.head_logits(h, t.prev_tokens)  # [B, S, γ, V], [B, S, γ]
    p_t = target_logits[torch.arange(B)[:, None, None], t.target_pos]  # [B, S, γ, V]
    flat = lambda x: x.flatten(0, 1)  # noqa: E731  [B, S, γ, ...] -> [B·S, γ, ...]
    return dspark_loss(flat(draft), flat(p_t), flat(t.labels), flat(conf), flat(t.valid), decay=decay,
                       weights=weights), draft, p_t, t


@pytest.mark.parametrize("backend,compact", VARIANTS)
@pytest.mark.parametrize("head,factored", [("markov", False), ("markov", True), ("rnn", False), ("none", False)])
@pytest.mark.parametrize("weights", [(0.1, 0.9, 1.0), (0.0, 0.0, 1.0, 1.0), (1.0, 0.0, 0.0), (0.3, 0.5, 0.7, 0.2)])
def test_fused_loss_and_gradients_equal_the_reference(head, factored, weights, backend, compact):
    ids, lmask, attn, features, target_logits = _batch()
    ref_drafter = _drafter(head, factored)
    fast_drafter = _drafter(head, factored)
    ref, *_ = _reference_loss(ref_drafter, ids, lmask, attn, features, target_logits, weights, 3.0)
    # A chunk far smaller than the batch: several chunks, one ending mid-sequence.
    fast = dense_step_loss(fast_drafter, ids, lmask, attn, features, target_logits, weights=weights, decay=3.0,
                           chunk_elements=TINY_V * 4 * 5, num_rows=_num_rows(compact, lmask, attn),
                           backend=backend)
    torch.testing.assert_close(fast.loss, ref["loss"], **TOL)
    for name in ("ce", "l1", "kl", "conf"):
        if name in fast.terms:
            torch.testing.assert_close(fast.terms[name], ref[name].detach(), **TOL)
    ref["loss"].backward()
    fast.loss.backward()
    for (name, p_ref), p_fast in zip(ref_drafter.named_parameters(), fast_drafter.parameters()):
        if p_ref.grad is None:
            assert p_fast.grad is None or not p_fast.grad.any(), name
            continue
        torch.testing.assert_close(p_fast.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend,compact", VARIANTS)
def test_slot_statistics_and_confidence_target(backend, compact):
    ids, lmask, attn, features, target_logits = _batch()
    drafter = _drafter("markov")
    ref, draft, p_t, t = _reference_loss(drafter, ids, lmask, attn, features, target_logits, (0.1, 0.9, 1.0), 4.0)
    fast = dense_step_loss(drafter, ids, lmask, attn, features, target_logits, chunk_elements=TINY_V * 7,
                           num_rows=_num_rows(compact, lmask, attn), backend=backend)
    stats = dict(zip(STAT_NAMES, fast.slot_stats.unbind(1)))
    v = t.valid  # [B, S, γ]
    torch.testing.assert_close(stats["count"], v.sum((0, 1)).float())
    hit = (draft.argmax(-1) == t.labels) & v
    torch.testing.assert_close(stats["label_hit"], hit.sum((0, 1)).float())
    match = (draft.argmax(-1) == p_t.argmax(-1)) & v
    torch.testing.assert_close(stats["target_hit"], match.sum((0, 1)).float())
    c_star = torch.minimum(draft.softmax(-1), p_t.softmax(-1)).sum(-1)
    torch.testing.assert_close(fast.c_star[v], c_star[v], **TOL)
    assert not fast.c_star[~v].any()
    torch.testing.assert_close(stats["accept_proxy"], torch.where(v, c_star, 0.0).sum((0, 1)), **TOL)


def test_fused_loss_keeps_no_vocabulary_wide_tensor_for_backward():
    """Memory: the gradient is computed chunk by chunk in forward; nothing V-wide per slot survives to backward."""
    ids, lmask, attn, features, target_logits = _batch(B=2, S=40)
    drafter = _drafter("markov", factored=True)
    t = dense_block_targets(ids, lmask & attn, drafter.config.block_size)
    h = dense_backbone(drafter, ids, features, attn)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out = fused_head_loss(drafter, h, t, target_logits, chunk_elements=TINY_V * 8)
    assert not [s for s in saved if s and s[-1] == TINY_V and s[0] != TINY_V], saved  # [V, r] tables are fine
    out.loss.backward()


def test_markov_tables_match_the_factored_head():
    drafter = _drafter("markov", factored=True)
    w1, w2 = drafter.markov_tables()
    tokens = torch.tensor([3, 7, 11])
    torch.testing.assert_close(w1[tokens], drafter.prev_embedding(tokens), **TOL)
    e = torch.randn(3, drafter.config.markov_rank)
    lm = drafter.target_modules()[1]
    torch.testing.assert_close(e @ w2.t(), lm(drafter.seq_head.w2_proj(e)), **TOL)
    assert drafter.markov_tables()[0] is w1  # cached
    with torch.no_grad():
        drafter.seq_head.w2_proj.weight.add_(1.0)
    assert drafter.markov_tables()[1] is not w2  # a parameter update invalidates the cache


def test_teacher_rows_are_exactly_the_rows_that_teach_a_slot():
    """The host count behind num_rows: a smaller bound would drop supervision, a larger one only costs time."""
    ids, lmask, attn, _, _ = _batch()
    t = dense_block_targets(ids, lmask & attn, 4)
    B, S, gamma = t.valid.shape
    teaching = torch.zeros(B, S, dtype=torch.bool)
    for k in range(gamma):  # slot k+1 of block p is taught by row p + k
        teaching[:, k:] |= t.valid[:, :S - k, k]
    assert teacher_rows(lmask & attn) == int(teaching.sum())
    assert teacher_rows(lmask[1]) == int(teaching[1].sum())  # one sequence


def test_a_loose_row_bound_changes_nothing():
    ids, lmask, attn, features, target_logits = _batch()
    drafter = _drafter("markov", factored=True)
    exact = dense_step_loss(drafter, ids, lmask, attn, features, target_logits, num_rows=teacher_rows(lmask & attn))
    loose = dense_step_loss(drafter, ids, lmask, attn, features, target_logits,
                            num_rows=teacher_rows(lmask & attn) + 5)
    torch.testing.assert_close(loose.loss, exact.loss, **TOL)
    torch.testing.assert_close(loose.slot_stats, exact.slot_stats, **TOL)
    torch.testing.assert_close(loose.c_star, exact.c_star, **TOL)


def _cuda(drafter):
    emb, lm = drafter.target_modules()  # shared, not submodules: moved and attached again
    drafter.cuda().attach_target(emb.cuda(), lm.cuda())
    return drafter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a GPU")
def test_flex_attention_backbone_has_the_reference_gradients():
    ids, lmask, attn, features, target_logits = (t.cuda() for t in _batch())
    ref_drafter, flex_drafter = (_cuda(_drafter("markov", qk_norm=True)) for _ in range(2))
    ref = dense_step_loss(ref_drafter, ids, lmask, attn, features, target_logits, attention="einsum")
    flex = dense_step_loss(flex_drafter, ids, lmask, attn, features, target_logits, attention="flex")
    torch.testing.assert_close(flex.loss, ref.loss, **TOL)
    ref.loss.backward()
    flex.loss.backward()
    for (name, p_ref), p_flex in zip(ref_drafter.named_parameters(), flex_drafter.parameters()):
        if p_ref.grad is not None:
            torch.testing.assert_close(p_flex.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)
