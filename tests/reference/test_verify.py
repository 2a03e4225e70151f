"""Tests of reference/verify.py (docs/method.md §4): exact greedy cases, the random-number keys of the accept /
residual / bonus draws, and losslessness — the emitted tokens follow the target's distribution.

Statistical tests use fixed seeds and significance level α = 0.001.
"""

import pytest
import scipy.stats
import torch

from reference.sampling import Purpose, draft_purpose, hash_uniform, logits_to_probs, sample
from reference.verify import greedy_verify, rejection_sample

ALPHA = 0.001
NAN = float("nan")


def _one_hot(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens.clamp(min=0), V).float()


# --------------------------------------------------------------------------- greedy, by hand


def _greedy_hand_batch():
    """Five requests, γ = 3, V = 5; target argmax per row written out."""
    V = 5
    argmax = torch.tensor([
        [2, 0, 0, 0],  # A: ℓ = 0, ordinary decoding -> emits 2
        [1, 3, 0, 4],  # B: ℓ = 3, drafts 1 3 0 all match -> bonus 4
        [1, 3, 0, 4],  # C: ℓ = 3, drafts 1 2 .. -> x_2 rejected, correction 3
        [4, 4, 2, 1],  # D: ℓ = 2, drafts 4 4 2: x_3 matches but is not verified -> bonus 2
        [3, 0, 0, 0],  # E: padded row, ℓ = 0, rows past 0 are NaN and drafts are garbage
    ])
    target_logits = _one_hot(argmax, V) * 2.0 - 1.0  # [R, γ+1, V]
    target_logits[4, 1:] = NAN
    drafts = torch.tensor([[0, 0, 0], [1, 3, 0], [1, 2, 0], [4, 4, 2], [-1, -1, -1]])
    lens = torch.tensor([0, 3, 3, 2, 0])
    want_tokens = torch.tensor([
        [2, -1, -1, -1],
        [1, 3, 0, 4],
        [1, 3, -1, -1],
        [4, 4, 2, -1],
        [3, -1, -1, -1],
    ])
    want_accepted = torch.tensor([0, 3, 1, 2, 0])
    return drafts, lens, target_logits, want_tokens, want_accepted


def test_greedy_verify_hand_cases():
    drafts, lens, target_logits, want_tokens, want_accepted = _greedy_hand_batch()
    out = greedy_verify(drafts, lens, target_logits)
    assert torch.equal(out.tokens, want_tokens)
    assert torch.equal(out.num_accepted, want_accepted)
    assert torch.equal(out.num_emitted, want_accepted + 1)


def test_rejection_sample_with_one_hot_probs_is_greedy_on_hand_cases():
    drafts, lens, target_logits, want_tokens, want_accepted = _greedy_hand_batch()
    R, gamma = drafts.shape
    target_probs = logits_to_probs(torch.nan_to_num(target_logits), 0.0)  # [R, γ+1, V] one-hot
    target_probs[4, 1:] = NAN  # ignored rows may hold anything
    draft_probs = _one_hot(drafts, 5)  # [R, γ, V]
    draft_probs[4] = NAN
    out = rejection_sample(drafts, lens, draft_probs, target_probs, 99, torch.arange(R), torch.full((R,), 10))
    assert torch.equal(out.tokens, want_tokens)
    assert torch.equal(out.num_accepted, want_accepted)


def test_rejection_sample_one_hot_equals_greedy_verify_random():
    g = torch.Generator().manual_seed(0)
    R, gamma, V = 2000, 5, 7
    target_logits = torch.randint(0, 3, (R, gamma + 1, V), generator=g).float()  # many ties
    argmax = target_logits.argmax(-1)  # [R, γ+1]
    # Drafts agree with the target argmax 80% of the time, so long accepted runs occur.
    agree = torch.rand(R, gamma, generator=g) < 0.8
    drafts = torch.where(agree, argmax[:, :gamma], torch.randint(0, V, (R, gamma), generator=g))
    lens = torch.randint(0, gamma + 1, (R,), generator=g)
    greedy = greedy_verify(drafts, lens, target_logits)
    sampled = rejection_sample(drafts, lens, _one_hot(drafts, V), logits_to_probs(target_logits, 0.0), 5,
                               torch.arange(R), torch.randint(0, 1000, (R,), generator=g))
    for a, b in ((greedy.tokens, sampled.tokens), (greedy.num_accepted, sampled.num_accepted),
                 (greedy.num_emitted, sampled.num_emitted)):
        assert torch.equal(a, b)
    assert int((greedy.num_accepted == lens).sum()) > 100 and int((greedy.num_accepted < lens).sum()) > 100


# --------------------------------------------------------------------------- the random-number keys


def test_accept_residual_and_bonus_use_the_contract_keys():
    # p_d puts all mass on token 0, p_t gives it 0.2: accept iff u <= 0.2 with u at (P + 1, ACCEPT), and the
    # residual max(0, p_t - p_d) = 0.8 on token 1 only. After acceptance the bonus is drawn from row 1 at
    # (P + 2, BONUS).
    R, seed = 400, 2**63 - 1
    req = torch.arange(R) * 7 + 3
    anchor = torch.arange(R) % 50 + 100
    drafts = torch.zeros(R, 1, dtype=torch.long)
    draft_probs = torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(R, 1, 4)
    bonus_row = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target_probs = torch.stack([torch.tensor([0.2, 0.8, 0.0, 0.0]), bonus_row]).expand(R, 2, 4)
    out = rejection_sample(drafts, torch.ones(R, dtype=torch.long), draft_probs, target_probs, seed, req, anchor)
    u = hash_uniform(seed, req, anchor + 1, Purpose.ACCEPT, 0)
    accepted = u <= 0.2
    assert torch.equal(out.num_accepted, accepted.long())
    bonus = sample(bonus_row.expand(R, 4), seed, req, anchor + 2, Purpose.BONUS)
    want_first = torch.where(accepted, 0, 1)
    assert torch.equal(out.tokens[:, 0], want_first)
    assert torch.equal(out.tokens[:, 1], torch.where(accepted, bonus, -1))
    assert 40 < int(accepted.sum()) < 120  # about 0.2 · 400 accepted: both branches were exercised


def test_all_zero_residual_falls_back_to_target_row():
    # p_t ≤ p_d everywhere (an unnormalised p_t, as float rounding can produce): a rejected draft leaves a
    # residual of zeros, and the recovered token comes from p_t itself, with the RESIDUAL key.
    R, seed = 200, 11
    req, anchor = torch.arange(R), torch.full((R,), 5)
    draft_probs = torch.tensor([0.5, 0.5, 0.0]).expand(R, 1, 3)
    p_t = torch.tensor([0.25, 0.5, 0.0])
    target_probs = torch.stack([p_t, torch.tensor([1.0, 0.0, 0.0])]).expand(R, 2, 3)
    out = rejection_sample(torch.zeros(R, 1, dtype=torch.long), torch.ones(R, dtype=torch.long), draft_probs,
                           target_probs, seed, req, anchor)
    rejected = out.num_accepted == 0
    assert torch.equal(rejected, hash_uniform(seed, req, anchor + 1, Purpose.ACCEPT) > 0.5)
    recovered = sample(p_t.expand(R, 3), seed, req, anchor + 1, Purpose.RESIDUAL)
    assert torch.equal(out.tokens[rejected, 0], recovered[rejected])
    assert int(rejected.sum()) > 50


def test_rejection_sample_is_deterministic_and_batch_independent():
    g = torch.Generator().manual_seed(4)
    R, gamma, V = 64, 4, 9
    draft_probs = torch.rand(R, gamma, V, generator=g).softmax(-1)
    target_probs = torch.rand(R, gamma + 1, V, generator=g).softmax(-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).reshape(R, gamma)
    lens = torch.randint(0, gamma + 1, (R,), generator=g)
    req = torch.randperm(10_000, generator=g)[:R]
    anchor = torch.randint(0, 4000, (R,), generator=g)
    args = (drafts, lens, draft_probs, target_probs, 77, req, anchor)
    out = rejection_sample(*args)
    again = rejection_sample(*args)
    assert torch.equal(out.tokens, again.tokens) and torch.equal(out.num_accepted, again.num_accepted)
    perm = torch.randperm(R, generator=g)
    shuffled = rejection_sample(*(a[perm] if isinstance(a, torch.Tensor) else a for a in args))
    assert torch.equal(shuffled.tokens, out.tokens[perm])
    alone = rejection_sample(*(a[5:6] if isinstance(a, torch.Tensor) else a for a in args))
    assert torch.equal(alone.tokens, out.tokens[5:6])


def test_verify_rejects_bad_input():
    R, gamma, V = 2, 3, 4
    drafts = torch.zeros(R, gamma, dtype=torch.long)
    p_d = torch.full((R, gamma, V), 0.25)
    p_t = torch.full((R, gamma + 1, V), 0.25)
    req, anchor = torch.arange(R), torch.zeros(R, dtype=torch.long)
    with pytest.raises(ValueError, match="verify_lens"):
        rejection_sample(drafts, torch.tensor([0, 4]), p_d, p_t, 0, req, anchor)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(drafts, torch.tensor([0, 1]), p_d, p_t[:, :gamma], 0, req, anchor)
    bad = p_t.clone()
    bad[1, 1] = NAN
    with pytest.raises(ValueError, match="finite"):
        rejection_sample(drafts, torch.tensor([0, 1]), p_d, bad, 0, req, anchor)
    zero = p_d.clone()
    zero[0, 0, 0] = 0.0
    with pytest.raises(ValueError, match="zero draft probability"):
        rejection_sample(drafts, torch.tensor([1, 0]), zero, p_t, 0, req, anchor)
    with pytest.raises(ValueError, match="draft tokens"):
        rejection_sample(drafts + V, torch.tensor([1, 0]), p_d, p_t, 0, req, anchor)
    with pytest.raises(ValueError, match="NaN"):
        greedy_verify(drafts, torch.tensor([0, 1]), bad)


# --------------------------------------------------------------------------- losslessness


def _mixed(g: torch.Generator, *shape: int, floor: float) -> torch.Tensor:
    """Random distributions with every entry >= floor / V (keeps expected chi-square counts large)."""
    p = (torch.randn(*shape, generator=g) * 1.2).softmax(-1)
    return (1 - floor) * p + floor / shape[-1]


def _first_two_tokens(target_fn, draft_fn, V: int, gamma: int, n: int, seed: int, g: torch.Generator):
    """Run the speculative loop (draft, choose ℓ, verify) until every request emitted two tokens.

    ``target_fn(prev, pos)`` / ``draft_fn(prev, slot)`` give ``[n, V]`` distributions of the token at ``pos``
    after token ``prev``. ℓ is drawn independently of the drafts (a non-anticipating schedule). Drafts use
    the contract keys, so the whole run exercises the real key layout across steps.
    Returns the first two emitted tokens ``[n, 2]`` and the first step's (ℓ, num_accepted).
    """
    req = torch.arange(n)
    anchor_tok = torch.zeros(n, dtype=torch.long)  # x_0 = token 0 at position 0
    anchor_pos = torch.zeros(n, dtype=torch.long)
    emitted, first_step = [], None
    for _ in range(2):
        prev, drafts, p_d = anchor_tok, [], []
        for k in range(1, gamma + 1):
            probs = draft_fn(prev, k)  # [n, V]
            prev = sample(probs, seed, req, anchor_pos + k, draft_purpose(k))
            drafts.append(prev)
            p_d.append(probs)
        drafts_t = torch.stack(drafts, 1)  # [n, γ]
        inputs = torch.cat([anchor_tok[:, None], drafts_t], 1)  # [n, γ+1] what the target runs on
        p_t = torch.stack([target_fn(inputs[:, i], anchor_pos + i + 1) for i in range(gamma + 1)], 1)
        lens = torch.randint(0, gamma + 1, (n,), generator=g)
        out = rejection_sample(drafts_t, lens, torch.stack(p_d, 1), p_t, seed, req, anchor_pos)
        # Structure: accepted drafts are a prefix of the drafts, then one token, then padding.
        assert bool((out.num_accepted <= lens).all())
        slot = torch.arange(gamma + 1)[None, :]
        assert torch.equal(out.tokens[slot < out.num_accepted[:, None]],
                           drafts_t[slot[:, :gamma] < out.num_accepted[:, None]])
        assert torch.equal(out.tokens >= 0, slot < out.num_emitted[:, None])
        if first_step is None:
            first_step = (lens, out.num_accepted)
        emitted.append(out.tokens)
        anchor_tok = out.tokens.gather(1, out.num_accepted[:, None]).squeeze(1)
        anchor_pos = anchor_pos + out.num_emitted
    tokens = torch.cat(emitted, 1)  # [n, 2(γ+1)]
    first_two = torch.stack([row[row >= 0][:2] for row in tokens])  # every row emitted >= 1 token per step
    return first_two, first_step


def _chi_square_pair(first_two: torch.Tensor, joint: torch.Tensor) -> float:
    V = joint.shape[0]
    counts = torch.bincount(first_two[:, 0] * V + first_two[:, 1], minlength=V * V).double()
    joint = joint.flatten().double()
    expected = joint / joint.sum() * len(first_two)  # renormalised in float64: scipy checks the totals to 1e-8
    assert expected.min() >= 5, "chi-square needs expected counts >= 5"
    return scipy.stats.chisquare(counts.numpy(), expected.numpy()).pvalue


def test_lossless_independent_slots():
    g = torch.Generator().manual_seed(2026)
    V, gamma, n = 6, 3, 20_000
    p_t_at = _mixed(g, 2 * gamma + 3, V, floor=0.3)  # p_t of the token at position i, whatever came before
    p_d_slot = _mixed(g, gamma + 1, V, floor=0.0)  # p_d of slot k, independent of the other slots
    p_d_slot[:, 0] = 0.0  # token 0 is never drafted: it can only come from a residual or a bonus
    p_d_slot /= p_d_slot.sum(-1, keepdim=True)
    first_two, (lens, accepted) = _first_two_tokens(
        lambda prev, pos: p_t_at[pos], lambda prev, k: p_d_slot[k].expand(len(prev), V), V, gamma, n, 123, g)
    joint = p_t_at[1][:, None] * p_t_at[2][None, :]  # [V, V] target distribution of positions 1 and 2
    assert _chi_square_pair(first_two, joint) > ALPHA

    # Acceptance rate of slot 1 (ℓ >= 1), and of slot 2 given slot 1 accepted (ℓ >= 2): both are
    # Σ_v min(p_t, p_d) of their slot. Binomial test at α.
    for k, mask in ((1, lens >= 1), (2, (lens >= 2) & (accepted >= 1))):
        rate = torch.minimum(p_t_at[k], p_d_slot[k]).sum().item()
        hits = int((accepted[mask] >= k).sum())
        assert scipy.stats.binomtest(hits, int(mask.sum()), rate).pvalue > ALPHA, (k, hits, int(mask.sum()), rate)


def test_lossless_markov_model():
    # A tiny "model": p_t(· | prev) = A[prev], p_d(· | prev) = B[prev]; drafts follow the draft chain.
    g = torch.Generator().manual_seed(7)
    V, gamma, n = 6, 3, 20_000
    A = _mixed(g, V, V, floor=0.3)  # [V, V] target transition matrix
    B = _mixed(g, V, V, floor=0.0)  # [V, V] draft transition matrix, far from A
    first_two, (lens, accepted) = _first_two_tokens(lambda prev, pos: A[prev], lambda prev, k: B[prev],
                                                    V, gamma, n, 2**40 + 5, g)
    joint = A[0][:, None] * A  # [V, V]: x_1 ~ A[x_0 = 0], x_2 ~ A[x_1]
    assert _chi_square_pair(first_two, joint) > ALPHA
    rate = torch.minimum(A[0], B[0]).sum().item()
    mask = lens >= 1
    hits = int((accepted[mask] >= 1).sum())
    assert scipy.stats.binomtest(hits, int(mask.sum()), rate).pvalue > ALPHA


def test_lossy_verifier_is_detected():
    # The chi-square test has power: verifying against the draft itself (p_t := p_d, so every draft is
    # accepted) emits the draft chain's distribution, and the test must tell it from the target's.
    g = torch.Generator().manual_seed(7)
    V, gamma, n = 6, 3, 20_000
    A = _mixed(g, V, V, floor=0.3)
    B = _mixed(g, V, V, floor=0.0)
    first_two, _ = _first_two_tokens(lambda prev, pos: B[prev], lambda prev, k: B[prev], V, gamma, n, 1, g)
    assert _chi_square_pair(first_two, A[0][:, None] * A) < ALPHA
