"""Tests of reference/hybrid.py: the n-gram acceptance estimate by hand (prior, counts of verified slots only, buckets
per match length), the choice rule (ties, no match, no earlier DSpark draft, the earlier draft's survivals and not
the current one's), the block layout, and the reference loop with the hybrid proposer: greedy output equal to the
target alone in every mode, the n-gram block taken on a repetitive prompt and the drafter's where the lookup finds
nothing, ℓ never past an n-gram block's end, a request's tokens independent of its batch, and sampled output
following the target's distribution.

Statistical tests use fixed seeds and significance level α = 0.001, as tests/reference/test_verify.py. Names follow
``docs/method.md`` (``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size).
"""

from __future__ import annotations

import json

import pytest
import torch

from reference.config import GenerationConfig, HybridConfig, SchedulerConfig
from reference.cost_model import CostTable
from reference.drafter import DraftOutput
from reference.generate import generate
from reference.hybrid import (
    DSPARK,
    NGRAM,
    PLAIN,
    HybridProposer,
    HybridState,
    NgramAcceptance,
    check_mode,
    expected_length,
)
from reference.ngram import find_match
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from tests.conftest import pooled_chisquare_pvalue
from tests.reference.test_generate import _exact_sequence_probs

ALPHA = 0.001
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster, and the machine is shared

MODES = ["none", "fixed", "dsd", "threshold", "adaptive-sync", "adaptive"]
PROMPTS = [[5, 9, 3, 17, 5, 9, 3], [2, 40, 41, 42, 43, 7, 8], [60], [11, 12, 11, 12, 11]]


def _cost(per_token_ms: float = 0.3, draft_ms: float = 0.0) -> CostTable:
    return CostTable.affine(fixed_ms=5.0, per_token_ms=per_token_ms, draft_fixed_ms=draft_ms, sizes=list(range(1, 129)))


def _hybrid(target: Target, gamma: int = 4, bias: float | None = None, **config) -> HybridProposer:
    """A hybrid of a random tiny drafter; ``bias`` shifts every calibrated confidence logit (a drafter that is sure
    of itself, or hopeless), which steers the choice without touching the weights."""
    drafter = tiny_drafter(target, gamma=gamma, noise=0.2)
    if bias is not None:
        drafter.config.sts_biases = {mode: [bias] * gamma for mode in ("greedy", "sampling")}
    return HybridProposer(drafter, HybridConfig(gamma=gamma, **config))


def _contexts(prompt: list[int], result) -> list[list[int]]:
    """The context each step of ``result`` drafted from: the prompt and the tokens emitted before the step."""
    out, emitted = [], 1  # the prefill token
    for acc in result.accepted_lengths:
        out.append(prompt + result.token_ids[:emitted])
        emitted += acc + 1
    return out


# --------------------------------------------------------------------------- the estimate, by hand


def test_prior_alone_halves_the_survival_slot_by_slot():
    est = NgramAcceptance(HybridConfig(gamma=4))
    assert est.survival(2, 3) == [0.5, 0.25, 0.125, 0.0]  # zero past m = 3
    assert est.survival(1, 4) == [0.5, 0.25, 0.125, 0.0625]
    strong = NgramAcceptance(HybridConfig(gamma=4, prior_accept=0.8, prior_strength=5.0))  # α = 4, β = 1
    assert strong.conditional(3, 1) == pytest.approx(0.8)
    strong.update(3, verify_len=2, num_accepted=0)  # slot 1 rejected
    assert strong.conditional(3, 1) == pytest.approx(4 / 6)
    assert strong.conditional(3, 2) == pytest.approx(0.8)  # slot 2 was verified but never reached: no count


def test_update_counts_the_reached_slots_of_each_match_length():
    est = NgramAcceptance(HybridConfig(gamma=4, max_n=3))
    est.update(2, verify_len=3, num_accepted=1)  # slot 1 accepted, slot 2 the first rejected, slot 3 not reached
    assert est.trials[1] == [1, 1, 0, 0] and est.accepted[1] == [1, 0, 0, 0]
    assert est.conditional(2, 1) == pytest.approx(2 / 3) and est.conditional(2, 2) == pytest.approx(1 / 3)
    assert est.conditional(2, 3) == 0.5 and est.conditional(1, 1) == 0.5  # other slots, other buckets: the prior
    est.update(2, verify_len=2, num_accepted=2)  # all verified slots accepted; slots 3..γ were never verified
    assert est.trials[1] == [2, 2, 0, 0] and est.accepted[1] == [2, 1, 0, 0]
    est.update(2, verify_len=0, num_accepted=0)  # nothing verified: nothing learnt
    assert est.trials[1] == [2, 2, 0, 0]
    assert est.survival(2, 2) == pytest.approx([3 / 4, 3 / 4 * 2 / 4, 0.0, 0.0])
    for bad in ((2, 2, 3), (2, 5, 1), (4, 2, 1), (0, 2, 1)):  # accepted > ℓ, ℓ > γ, n > max_n, n < min_n
        with pytest.raises(ValueError):
            est.update(*bad)


def test_config_is_validated():
    for bad in (dict(prior_accept=0.0), dict(prior_accept=1.0), dict(prior_accept_sampling=0.0),
                dict(prior_accept_sampling=1.5), dict(prior_strength=0.0), dict(prior_strength=float("inf")),
                dict(gamma=0), dict(min_n=3, max_n=2)):
        with pytest.raises(ValueError):
            HybridConfig(**bad)
    cfg = HybridConfig(prior_accept=0.25, prior_accept_sampling=0.5, prior_strength=4.0)
    assert cfg.prior == cfg.prior_for(sampling=False) == (1.0, 3.0) and cfg.prior_for(sampling=True) == (2.0, 2.0)
    # A request's decoding mode picks its prior: with no history, a greedy request's first n-gram slot is estimated
    # at prior_accept, a sampling one's at prior_accept_sampling.
    assert NgramAcceptance(cfg).conditional(1, 1) == 0.25
    assert NgramAcceptance(cfg, sampling=True).conditional(1, 1) == 0.5
    assert HybridState(cfg, sampling=True).acceptance.prior == (2.0, 2.0)
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    drafter = tiny_drafter(target, gamma=4)
    assert HybridProposer(drafter).config.gamma == 4
    with pytest.raises(ValueError, match="block size"):
        HybridProposer(drafter, HybridConfig(gamma=7))
    check_mode("adaptive")
    with pytest.raises(ValueError, match="oracle"):
        check_mode("oracle")
    with pytest.raises(ValueError, match="oracle"):
        generate(target, HybridProposer(drafter), [[3, 4]], GenerationConfig(max_new_tokens=2),
                 SchedulerConfig("oracle"))


# --------------------------------------------------------------------------- the choice rule


def test_choice_reads_the_earlier_draft_and_prefers_the_drafter_on_ties():
    state = HybridState(HybridConfig(gamma=4))
    halves = [0.5, 0.25, 0.125, 0.0625]  # E = 0.9375, the prior's E_ng of a 4-token block
    # The first step has no earlier DSpark draft: the drafter's block, whatever the current survivals say.
    assert state.choose(2, [7, 8, 9, 10], [0.0] * 4).source == DSPARK
    assert state.dspark == [0.0] * 4  # kept for the next choice
    # E_d = 0 (the previous draft), E_ng = 0.9375: the n-gram block, though the current draft looks perfect.
    c = state.choose(2, [7, 8, 9, 10], [1.0] * 4)
    assert (c.source, c.tokens, c.n, c.e_dspark) == (NGRAM, (7, 8, 9, 10), 2, 0.0)
    assert c.survival == tuple(halves) and c.e_ngram == expected_length(halves) and c.cap(4) == 4
    c = state.choose(2, [7, 8, 9, 10], halves)  # E_d = 4 > E_ng
    assert c.source == DSPARK and c.e_ngram == 0.9375 and c.cap(4) == 4
    c = state.choose(2, [7, 8, 9, 10], [0.9] * 4)  # E_d = E_ng exactly: a tie takes the drafter's block
    assert c.source == DSPARK and c.e_dspark == c.e_ngram
    c = state.choose(None, [], [0.0] * 4)  # no match: the drafter's block, even against E_d = 3.6
    assert c.source == DSPARK and c.e_ngram is None
    c = state.choose(1, [7], [0.0] * 4)  # a one-token block after E_d = 0: E_ng = 0.5
    assert c.source == NGRAM and c.survival == (0.5, 0.0, 0.0, 0.0) and c.cap(4) == 1


def test_observe_settles_the_held_block():
    state = HybridState(HybridConfig(gamma=3))
    assert state.observe(0, 0) == PLAIN  # no block held: a plain step
    state.choose(None, [], [0.1, 0.01, 0.001])
    assert state.observe(3, 3) == DSPARK and state.acceptance.trials == [[0] * 3] * 3  # the drafter's: no count
    state.choose(3, [4, 5], [0.1, 0.01, 0.001])  # E_ng = 0.75 > E_d = 0.111
    assert state.observe(2, 1) == NGRAM
    assert state.acceptance.trials[2] == [1, 1, 0] and state.acceptance.accepted[2] == [1, 0, 0]
    assert state.held is None and state.observe(0, 0) == PLAIN


def test_states_are_per_request():
    proposer = _hybrid(Target.from_model(tiny_hf_model("llama", num_layers=2)), gamma=3)
    a, b = proposer.new_state(), proposer.new_state()
    a.choose(None, [], [0.0] * 3)
    a.choose(1, [5], [0.0] * 3)
    a.observe(1, 1)
    assert a.acceptance.trials[0][0] == 1 and b.acceptance.trials[0][0] == 0 and b.dspark is None


def test_merge_lays_out_the_chosen_blocks():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    proposer = _hybrid(target, gamma=3)
    V = target.vocab_size
    probs = torch.softmax(torch.randn(2, 3, V), -1)
    draft = DraftOutput(torch.tensor([[1, 2, 3], [4, 5, 6]]), probs, torch.zeros(2, 3))
    survival = torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]])
    states = [proposer.new_state(), proposer.new_state()]
    for s in states:
        s.dspark = [0.0, 0.0, 0.0]  # an earlier draft that expected nothing: any match wins
    choices = proposer.choose(states, [[7, 8, 9, 7, 8], [1, 2, 3]], survival)  # a match of [7, 8]; none
    assert [c.source for c in choices] == [NGRAM, DSPARK] and choices[0].tokens == (9, 7, 8)
    assert states[0].dspark == pytest.approx([0.9, 0.8, 0.7])  # this step's drafter survivals, for the next step
    block, chosen, caps = proposer.merge(draft, survival, choices)
    assert torch.equal(block.tokens, torch.tensor([[9, 7, 8], [4, 5, 6]]))
    assert torch.equal(block.probs[0], torch.nn.functional.one_hot(torch.tensor([9, 7, 8]), V).float())
    assert torch.equal(block.probs[1], probs[1]) and torch.equal(chosen[1], survival[1])
    assert torch.equal(chosen[0], torch.tensor([0.5, 0.25, 0.125]))
    assert torch.equal(caps, torch.tensor([3, 3]))
    assert torch.equal(draft.tokens[0], torch.tensor([1, 2, 3]))  # the drafter's block is not modified in place
    states[1].dspark = [0.0, 0.0, 0.0]
    short = proposer.choose([states[1]], [[6, 6]], survival[:1])  # [6] recurs: a one-token block
    _, chosen, caps = proposer.merge(DraftOutput(draft.tokens[:1], probs[:1], torch.zeros(1, 3)), survival[:1], short)
    assert caps.tolist() == [1] and chosen[0].tolist() == [0.5, 0.0, 0.0]


# --------------------------------------------------------------------------- the loop with the hybrid proposer


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_target_only(family):
    target = Target.from_model(tiny_hf_model(family))
    gen = GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    baseline = generate(target, None, PROMPTS, gen, SchedulerConfig(mode="none"))
    proposer = _hybrid(target)
    sources = set()
    for mode in MODES:
        sched = SchedulerConfig(mode=mode, k=3, threshold=0.05, dsd_table={1: 4, 3: 2})
        out = generate(target, proposer, PROMPTS, gen, sched, _cost(per_token_ms=0.01))
        for b, o in zip(baseline, out):
            assert o.token_ids == b.token_ids, f"{family}/{mode}: hybrid greedy differs from target greedy"
        if mode != "none":
            sources |= {s for r in out for s in r.proposal_sources}
            assert all(len(r.proposal_sources) == len(r.verify_lengths) for r in out)
    assert {DSPARK, NGRAM} <= sources, f"both sources must be exercised, got {sources}"


def test_ngram_taken_on_a_repetitive_prompt_and_the_drafter_without_a_match():
    """A drafter with hopeless calibrated survivals (E_d ≈ 0): from its second step on, a request takes the n-gram
    block exactly when the lookup finds one; a drafter sure of itself (E_d ≈ γ) keeps its own block throughout."""
    target = Target.from_model(tiny_hf_model("llama"))
    gen = GenerationConfig(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    sched = SchedulerConfig(mode="fixed", k=4)
    prompts = [[11, 12, 13, 11, 12, 13, 11, 12], [60, 61, 62, 63]]
    weak = generate(target, _hybrid(target, bias=-8.0), prompts, gen, sched)
    matched = 0
    for prompt, r in zip(prompts, weak):
        for step, (ctx, source) in enumerate(zip(_contexts(prompt, r), r.proposal_sources)):
            found = find_match(ctx, 3, 1) is not None
            matched += found
            assert source == (NGRAM if found and step > 0 else DSPARK), f"step {step} of {prompt}"
    assert weak[0].proposal_sources.count(NGRAM) >= len(weak[0].proposal_sources) - 1 and matched
    assert weak[1].proposal_sources[0] == DSPARK  # the second prompt has no recurring token at first
    sure = generate(target, _hybrid(target, bias=8.0), prompts, gen, sched)
    assert all(s == DSPARK for r in sure for s in r.proposal_sources)
    assert [r.token_ids for r in sure] == [r.token_ids for r in weak]  # greedy: the target's tokens either way


@pytest.mark.parametrize("mode", ["fixed", "threshold", "adaptive-sync", "adaptive"])
def test_verify_length_never_passes_the_ngram_block(mode):
    """ℓ ≤ m for every n-gram block, in every mode: with verification nearly free the adaptive budget asks for
    every slot, the zero-survival ones past m included, and threshold 0 admits them too."""
    target = Target.from_model(tiny_hf_model("llama"))
    gen = GenerationConfig(max_new_tokens=20, temperature=1.0, seed=2, ignore_eos=True)
    sched = SchedulerConfig(mode=mode, k=4, threshold=0.0, staleness=1)
    out = generate(target, _hybrid(target, bias=-8.0), PROMPTS, gen, sched, _cost(per_token_ms=0.001))
    short = 0
    for prompt, r in zip(PROMPTS, out):
        for ctx, ell, source in zip(_contexts(prompt, r), r.verify_lengths, r.proposal_sources):
            if source == NGRAM:
                n, i = find_match(ctx, 3, 1)
                m = len(ctx[i + n:i + n + 4])
                assert ell <= m
                short += m < 4
    assert short, "no n-gram block was shorter than γ: the cap went untested"


def test_a_request_decodes_alike_alone_and_in_a_batch():
    """Per-request state: sampled tokens, lengths and sources of each request equal those of the request alone."""
    target = Target.from_model(tiny_hf_model("qwen3"))
    proposer = _hybrid(target, prior_accept_sampling=0.5)  # sampled: the greedy prior, so that both sources occur
    gen = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    sched = SchedulerConfig(mode="fixed", k=4)
    batch = generate(target, proposer, PROMPTS, gen, sched)
    assert any(NGRAM in r.proposal_sources for r in batch)
    for rid, (prompt, r) in enumerate(zip(PROMPTS, batch)):
        alone = generate(target, proposer, [prompt], gen, sched, request_ids=[rid])[0]
        assert (alone.token_ids, alone.accepted_lengths, alone.proposal_sources) == \
            (r.token_ids, r.accepted_lengths, r.proposal_sources)


def test_sampling_matches_target_distribution():
    """Goodness of fit of tokens 2..4 at α = 0.001 (as tests/reference/test_ngram.py): 800 requests on a prompt whose
    suffix recurs, with a prior that makes the n-gram block attractive, so both sources decide tokens."""
    vocab, n_tokens, n_requests, temperature = 5, 4, 800, 1.0
    model = tiny_hf_model("llama", vocab_size=vocab, num_layers=2, seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.25)  # soften: every continuation has visible mass
    target = Target.from_model(model)
    prompt = [2, 3, 4, 2, 3]
    exact_full = _exact_sequence_probs(target, prompt, n_tokens, temperature)
    exact: dict[tuple, float] = {}
    for seq, pr in exact_full.items():  # marginal of tokens 2..4 (token 1 comes from the prefill)
        exact[seq[1:]] = exact.get(seq[1:], 0.0) + pr
    gen = GenerationConfig(max_new_tokens=n_tokens, temperature=temperature, seed=4321, ignore_eos=True)
    proposer = _hybrid(target, gamma=3, prior_accept=0.9, prior_accept_sampling=0.9)
    out = generate(target, proposer, [prompt] * n_requests, gen, SchedulerConfig(mode="fixed", k=3))
    sources = [s for r in out for s in r.proposal_sources]
    assert sources.count(NGRAM) > 0.1 * n_requests and sources.count(DSPARK) > 0.1 * n_requests, "one source only"
    counts = {k: 0 for k in exact}
    for r in out:
        counts[tuple(r.token_ids[1:n_tokens])] += 1
    p = pooled_chisquare_pvalue(counts, exact, n_requests)
    assert p > ALPHA, f"output distribution differs from the target's (p = {p:.2e})"


def test_cli_runs_the_hybrid_in_both_packages(tmp_path, capsys, monkeypatch):
    """``--proposer hybrid`` on ``python -m reference.generate`` and ``python -m optimized.generate``: the same JSON
    lines (tokens, lengths, sources), the prior flags reach the config, and the oracle is refused."""
    from optimized.generate import main as engine_main
    from reference.checkpoint import save_drafter
    from reference.generate import main

    target = Target.from_model(tiny_hf_model("llama"))
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: target))
    monkeypatch.setattr(Target, "encode", lambda self, p, chat_template=True: [ord(c) % 90 + 2 for c in p])
    cost = tmp_path / "cost.json"
    _cost().save(cost)
    ckpt = tmp_path / "drafter"
    save_drafter(tiny_drafter(target, gamma=4, noise=0.2), ckpt)
    argv = ["--prompt", "abcabcab", "--prompt", "xyz", "--proposer", "hybrid", "--drafter", str(ckpt), "--mode",
            "adaptive", "--cost-table", str(cost), "--json", "--max-new-tokens", "12", "--temperature", "1",
            "--hybrid-prior-accept", "0.7", "--hybrid-prior-strength", "3", "--ignore-eos"]
    seen = []
    original = HybridProposer.__init__

    def spy(self, drafter, config=None):
        seen.append(config)
        original(self, drafter, config)

    monkeypatch.setattr(HybridProposer, "__init__", spy)
    outputs = []
    for run in (main, engine_main):
        assert run(argv) == 0
        outputs.append([json.loads(x) for x in capsys.readouterr().out.strip().splitlines()])
    ref, opt = outputs
    assert len(ref) == 2 and [(r["token_ids"], r["accepted_lengths"], r["proposal_sources"]) for r in ref] == \
        [(r["token_ids"], r["accepted_lengths"], r["proposal_sources"]) for r in opt]
    assert all(len(r["proposal_sources"]) == len(r["verify_lengths"]) for r in ref)
    assert seen[0] == HybridConfig(gamma=4, prior_accept=0.7, prior_strength=3.0) == seen[1]
    with pytest.raises(SystemExit, match="oracle"):
        main([*argv[:-1], "--mode", "oracle"])
    with pytest.raises(SystemExit, match="prior_accept"):
        main([*argv, "--hybrid-prior-accept", "1.5"])
