"""Tests of reference/ngram.py: the lookup by hand (longest suffix, ties, no match, short proposals, matches that run
to the end of the context), the mode check, and that verification of a one-hot draft is lossless — the reference loop
with the n-gram proposer is greedy-identical to the target alone and samples the target's distribution.

Statistical tests use fixed seeds and significance level α = 0.001, as tests/reference/test_verify.py.
"""

from __future__ import annotations

import pytest
import scipy.stats
import torch

from reference.config import GenerationConfig, NgramConfig, SchedulerConfig
from reference.generate import generate
from reference.ngram import NgramProposer, check_mode, find_match, propose
from reference.target import Target
from reference.testing import tiny_hf_model
from reference.verify import rejection_sample
from tests.conftest import pooled_chisquare_pvalue
from tests.reference.test_generate import _exact_sequence_probs

ALPHA = 0.001
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster, and the machine is shared


# --------------------------------------------------------------------------- the lookup, by hand


def test_longest_suffix_wins():
    # Suffix 3-gram [1, 2, 3] occurred at 0; the 1-gram [3] occurred later at 5 with another continuation.
    ctx = [1, 2, 3, 9, 8, 3, 7, 0, 1, 2, 3]
    assert find_match(ctx, max_n=3, min_n=1) == (3, 0)
    assert propose(ctx, gamma=4) == [9, 8, 3, 7]
    # Capped at n = 1, the unigram [3] is matched at its earliest occurrence (2), the same continuation here.
    assert find_match(ctx, max_n=1, min_n=1) == (1, 2)


def test_shorter_n_when_the_longer_did_not_recur():
    ctx = [5, 6, 7, 4, 6, 7]  # [4, 6, 7] never occurred before; [6, 7] did, at 1
    assert find_match(ctx, max_n=3, min_n=1) == (2, 1)
    assert propose(ctx, gamma=2) == [4, 6]


def test_ties_take_the_earliest_occurrence():
    # The suffix [4, 5] occurs at 0 (followed by 1) and at 3 (followed by 2): the earliest wins (vLLM, transformers).
    ctx = [4, 5, 1, 4, 5, 2, 4, 5]
    assert find_match(ctx, max_n=2, min_n=1) == (2, 0)
    assert propose(ctx, gamma=3) == [1, 4, 5]


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4], gamma=7) == []
    assert find_match([1, 2, 3, 4], max_n=3, min_n=1) is None
    assert propose([7], gamma=7) == []  # a one-token context has nothing before its suffix
    # min_n = 2: the unigram [3] recurs but is too short to count.
    assert propose([3, 1, 2, 3], gamma=7, max_n=3, min_n=2) == []
    assert propose([3, 1, 2, 3], gamma=7, max_n=3, min_n=1) == [1, 2, 3]


def test_proposal_shorter_than_gamma_at_the_end_of_the_context():
    # The match at 0 leaves only four tokens after it, the last of them the anchor itself.
    ctx = [1, 2, 8, 9, 1, 2]
    assert propose(ctx, gamma=7) == [8, 9, 1, 2]
    # An occurrence that ends just before the anchor proposes the anchor alone.
    assert propose([6, 3, 3], gamma=5) == [3]


def test_match_overlapping_the_suffix_runs_to_the_end():
    # [7, 7, 7] recurs at 0, overlapping the suffix at 1; what follows runs into the suffix and stops at the end.
    ctx = [7, 7, 7, 7]
    assert find_match(ctx, max_n=3, min_n=1) == (3, 0)
    assert propose(ctx, gamma=7) == [7]
    assert propose([2, 7, 7, 7, 7, 7], gamma=7) == [7, 7]  # [7, 7, 7] at 1 -> tokens 4, 5


def test_proposer_lays_out_a_one_hot_block():
    proposer = NgramProposer(NgramConfig(gamma=3, max_n=2, min_n=1))
    draft = proposer.draft([[1, 2, 3, 1, 2], [4, 5], [9, 9]], vocab_size=10)
    assert torch.equal(draft.lengths, torch.tensor([3, 0, 1]))
    assert torch.equal(draft.tokens, torch.tensor([[3, 1, 2], [0, 0, 0], [9, 0, 0]]))
    assert draft.probs.shape == (3, 3, 10)
    assert torch.equal(draft.probs.argmax(-1), draft.tokens)
    assert torch.equal(draft.probs.sum(-1), torch.ones(3, 3))


def test_config_and_mode_are_validated():
    for bad in (dict(gamma=0), dict(max_n=0), dict(min_n=0), dict(min_n=3, max_n=2), dict(gamma=True)):
        with pytest.raises(ValueError):
            NgramConfig(**bad)
    for mode in ("none", "fixed", "dsd"):
        check_mode(mode)
    for mode in ("threshold", "adaptive-sync", "adaptive", "oracle"):
        with pytest.raises(ValueError, match="no confidences"):
            check_mode(mode)
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    with pytest.raises(ValueError, match="no confidences"):
        generate(target, NgramProposer(), [[3, 4]], GenerationConfig(max_new_tokens=2), SchedulerConfig("adaptive"))


# --------------------------------------------------------------------------- verification of one-hot drafts


def test_one_hot_draft_is_accepted_with_p_t_and_the_residual_removes_it():
    """One deterministic draft x against a soft p_t: P(accept) = p_t(x), and the emitted token follows p_t."""
    V, n, x = 6, 20_000, 2
    p_row = torch.tensor([0.05, 0.15, 0.4, 0.1, 0.2, 0.1])  # p_t of slot 1
    bonus = torch.full((V,), 1.0 / V)
    p_t = torch.stack([p_row, bonus])[None].expand(n, 2, V).contiguous()  # [n, γ+1 = 2, V]
    p_d = torch.nn.functional.one_hot(torch.tensor(x), V).float().expand(n, 1, V).contiguous()  # [n, 1, V]
    drafts = torch.full((n, 1), x)
    out = rejection_sample(drafts, torch.ones(n, dtype=torch.long), p_d, p_t, 11, torch.arange(n),
                           torch.zeros(n, dtype=torch.long))
    hits = int(out.num_accepted.sum())
    assert scipy.stats.binomtest(hits, n, float(p_row[x])).pvalue > ALPHA
    rejected = out.num_accepted == 0
    assert not bool((out.tokens[rejected, 0] == x).any()), "the residual must exclude the rejected draft"
    first = out.tokens[:, 0]  # accepted x, or the residual draw: together distributed as p_t
    counts = torch.bincount(first, minlength=V).double()
    expected = p_row.double() / p_row.double().sum() * n  # renormalised in float64: scipy checks the totals to 1e-8
    assert scipy.stats.chisquare(counts.numpy(), expected.numpy()).pvalue > ALPHA


# --------------------------------------------------------------------------- the loop with the n-gram proposer


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_target_only(family):
    target = Target.from_model(tiny_hf_model(family))
    prompts = [[5, 9, 3, 17, 5, 9, 3], [2, 40, 41, 42, 43, 7, 8], [60], [11, 12, 11, 12, 11]]
    gen = GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    baseline = generate(target, None, prompts, gen, SchedulerConfig(mode="none"))
    proposer = NgramProposer(NgramConfig(gamma=5))
    for sched in (SchedulerConfig(mode="fixed", k=5), SchedulerConfig(mode="dsd", dsd_table={1: 5, 3: 2})):
        out = generate(target, proposer, prompts, gen, sched)
        for b, o in zip(baseline, out):
            assert o.token_ids == b.token_ids, f"{family}/{sched.mode}: n-gram greedy differs from target greedy"
            assert all(0 <= a <= v <= 5 for a, v in zip(o.accepted_lengths, o.verify_lengths))
    # Random greedy models loop, and loops are what prompt lookup predicts: the proposer must really speculate.
    assert sum(sum(o.accepted_lengths) for o in out) > 0


def test_verify_length_is_clipped_to_the_proposal():
    """ℓ_r = min(k, m_r) each step, m_r being the lookup on the tokens before that step."""
    target = Target.from_model(tiny_hf_model("llama"))
    prompt = [3, 4, 5, 3, 4]
    gen = GenerationConfig(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    out = generate(target, NgramProposer(NgramConfig(gamma=4)), [prompt], gen, SchedulerConfig(mode="fixed", k=3))[0]
    assert len(out.verify_lengths) > 0
    emitted = 1  # the prefill token
    for ell, acc in zip(out.verify_lengths, out.accepted_lengths):
        assert ell == min(3, len(propose(prompt + out.token_ids[:emitted], gamma=4)))
        emitted += acc + 1


def test_sampling_matches_target_distribution():
    """Goodness of fit of tokens 2..3 (those the first n-gram draft decides) at α = 0.001, as the drafter's test in
    tests/reference/test_generate.py: 800 requests, cells pooled to ≥ 5 expected counts."""
    vocab, n_tokens, n_requests, temperature = 5, 3, 800, 1.0
    model = tiny_hf_model("llama", vocab_size=vocab, num_layers=2, seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.25)  # soften: every continuation has visible mass
    target = Target.from_model(model)
    prompt = [2, 3, 4, 2, 3]  # the suffix [2, 3] recurs: the first step already proposes [4, 2, 3]
    exact_full = _exact_sequence_probs(target, prompt, n_tokens, temperature)
    exact: dict[tuple, float] = {}
    for seq, pr in exact_full.items():  # marginal of tokens 2..3 (token 1 comes from the prefill)
        exact[seq[1:]] = exact.get(seq[1:], 0.0) + pr
    gen = GenerationConfig(max_new_tokens=n_tokens, temperature=temperature, seed=4321, ignore_eos=True)
    sched = SchedulerConfig(mode="fixed", k=3)
    out = generate(target, NgramProposer(NgramConfig(gamma=3)), [prompt] * n_requests, gen, sched)
    accepted = sum(sum(r.accepted_lengths) for r in out)
    assert accepted > 0.2 * n_requests, f"only {accepted} drafts accepted: the test would be weak"
    counts = {k: 0 for k in exact}
    for r in out:
        counts[tuple(r.token_ids[1:n_tokens])] += 1
    p = pooled_chisquare_pvalue(counts, exact, n_requests)
    assert p > ALPHA, f"output distribution differs from the target's (p = {p:.2e})"
