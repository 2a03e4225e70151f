"""The reference loop end to end: greedy losslessness in every mode, sampling losslessness, the CLI.

Greedy: speculative output must equal target-only greedy output token for token, whatever the drafter
proposes and whatever the scheduler verifies. Sampling: the output distribution must be the target's; we
compare the empirical distribution of the first generated tokens with the exact target distribution,
enumerated from the target's own conditionals, by a chi-square test at α = 0.001 with a fixed seed (the
test then fails spuriously with probability 0.1% per mode for a correct implementation, never for this seed).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from reference.config import GenerationConfig, SchedulerConfig
from reference.cost_model import CostTable
from reference.generate import generate, main
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from tests.conftest import pooled_chisquare_pvalue

MODES = ["none", "fixed", "dsd", "threshold", "adaptive-sync", "adaptive", "oracle"]


def _cost(per_token_ms: float = 0.2) -> CostTable:
    # A synthetic affine curve for CPU tests: 10 ms fixed + per_token_ms per verified token (sizes up to 4096,
    # so the batch of the distribution test stays inside the table).
    # Every size is "captured" (no staircase), so the adaptive modes see a smooth curve.
    return CostTable.affine(fixed_ms=10.0, per_token_ms=per_token_ms, sizes=list(range(1, 8193)))


def _drafter_for(target: Target, gamma: int = 4, head: str = "markov", seed: int = 0, scale: float = 1.0):
    # Random but confident heads, so drafts and confidences vary across the batch.
    return tiny_drafter(target, gamma=gamma, head=head, seed=seed, noise=0.05 * scale)


def _sched(mode: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(mode=mode, k=kw.pop("k", 3), threshold=kw.pop("threshold", 0.05), **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_target_only_every_mode(family):
    target = Target.from_model(tiny_hf_model(family))
    drafter = _drafter_for(target)
    prompts = [[5, 9, 3, 17], [2, 40, 41, 42, 43, 7, 8], [60]]
    gen = GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    baseline = generate(target, None, prompts, gen, _sched("none"))
    for mode in MODES:
        out = generate(target, drafter, prompts, gen, _sched(mode), _cost())
        for b, o in zip(baseline, out):
            assert o.token_ids == b.token_ids, f"{family}/{mode}: speculative greedy differs from target greedy"
            assert len(o.token_ids) == 24
            assert sum(a + 1 for a in o.accepted_lengths) + 1 == len(o.token_ids) or o.finish_reason == "length"
            assert all(0 <= a <= v for a, v in zip(o.accepted_lengths, o.verify_lengths)), mode


def test_greedy_drafter_that_agrees_gets_accepted():
    """A drafter whose heads copy the target's greedy choice is accepted: the loop really speculates."""
    target = Target.from_model(tiny_hf_model("llama"))
    drafter = _drafter_for(target, gamma=4)
    gen = GenerationConfig(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    out = generate(target, drafter, [[3, 4, 5]], gen, _sched("fixed", k=4))[0]
    assert len(out.verify_lengths) == len(out.accepted_lengths)
    assert all(v == 4 for v in out.verify_lengths)
    # τ counts accepted + 1 per step; steps * 1 + accepted + first token == emitted tokens
    assert len(out.accepted_lengths) + sum(out.accepted_lengths) + 1 >= len(out.token_ids)


def test_eos_stops_and_later_tokens_are_dropped():
    target = Target.from_model(tiny_hf_model("llama"))
    gen = GenerationConfig(max_new_tokens=40, temperature=0.0)
    free = generate(target, None, [[7, 8, 9]], GenerationConfig(max_new_tokens=40, ignore_eos=True), _sched("none"))
    ids = free[0].token_ids
    eos = next(iter(target.eos_token_ids))
    out = generate(target, _drafter_for(target), [[7, 8, 9]], gen, _sched("fixed", k=4))[0]
    if eos in ids:
        assert out.token_ids == ids[: ids.index(eos) + 1] and out.finish_reason == "stop"
    else:
        assert out.token_ids == ids and out.finish_reason == "length"


def _exact_sequence_probs(target: Target, prompt: list[int], n: int, temperature: float) -> dict[tuple, float]:
    """P(first n generated tokens) under the target alone, by enumeration of its conditionals (one batch)."""
    seqs = list(itertools.product(range(target.vocab_size), repeat=n))
    ids = torch.tensor([prompt + list(s) for s in seqs])  # [V^n, S]
    logits, _ = target.forward_batch(ids, torch.ones_like(ids))
    logp = torch.log_softmax(logits.double() / temperature, -1)  # [V^n, S, V]
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
    picked = logp[:, rows].gather(2, ids[:, len(prompt):, None])[..., 0]  # [V^n, n]
    probs = picked.sum(1).exp()
    return {s: float(p) for s, p in zip(seqs, probs)}


@pytest.mark.parametrize("mode", ["fixed", "adaptive-sync", "adaptive"])
def test_sampling_matches_target_distribution(mode):
    """Goodness of fit of tokens 3 and 4 (the ones speculation decides) at α = 0.001.

    800 requests over the 25 pairs (pooled to ≥ 5 expected per cell) detect a verifier that draws the
    correction from p_t instead of the residual (tests/reference/test_verify.py holds the high-power checks).
    """
    vocab, n_tokens, n_requests, temperature = 5, 4, 800, 1.0
    model = tiny_hf_model("llama", vocab_size=vocab, num_layers=2, seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.25)  # soften: every continuation has visible mass
    target = Target.from_model(model)
    drafter = _drafter_for(target, gamma=3, scale=4.0, seed=1)
    prompt = [2, 3, 4]
    exact_full = _exact_sequence_probs(target, prompt, n_tokens, temperature)
    exact: dict[tuple, float] = {}
    for seq, pr in exact_full.items():  # marginal of tokens 3..4 (the first two come from prefill + a step with
        exact[seq[2:]] = exact.get(seq[2:], 0.0) + pr  # no stale survivals yet in the adaptive mode)
    gen = GenerationConfig(max_new_tokens=n_tokens, temperature=temperature, seed=1234, ignore_eos=True)
    # Verification nearly free next to the fixed cost, so the adaptive modes admit drafts for most requests;
    # staleness 1 lets the asynchronous budget act from the second step on.
    sched = _sched(mode, k=3, staleness=1)
    out = generate(target, drafter, [prompt] * n_requests, gen, sched, _cost(per_token_ms=0.0005))
    counts = {k: 0 for k in exact}
    for r in out:
        counts[tuple(r.token_ids[2:n_tokens])] += 1
    accepted = sum(sum(r.accepted_lengths) for r in out)
    assert accepted > 0.2 * n_requests, f"only {accepted} drafts accepted: the test would be weak"
    p = pooled_chisquare_pvalue(counts, exact, n_requests)
    assert p > 1e-3, f"{mode}: output distribution differs from the target's (p = {p:.2e})"


def test_request_output_independent_of_batch():
    """A request's sampled output depends only on its id, prompt and seed, not on its neighbours."""
    target = Target.from_model(tiny_hf_model("qwen3"))
    drafter = _drafter_for(target)
    gen = GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    alone = generate(target, drafter, [[5, 6, 7]], gen, _sched("fixed"), request_ids=[11])[0]
    batch = generate(target, drafter, [[1, 2], [5, 6, 7], [9]], gen, _sched("fixed"), request_ids=[3, 11, 4])[1]
    assert alone.token_ids == batch.token_ids


@pytest.mark.slow
def test_smollm2_greedy_identical_across_modes(smollm2_target):
    """Every mode on the real target with the shipped drafter, on a prompt no test was written for.

    The CPU here streams the 135M weights at a few GB/s, so each verify step costs ~0.4 s: one prompt and
    eight tokens keep the whole mode matrix near a minute.
    """
    from reference.cli import DEFAULT_DRAFTER, load_or_init_drafter

    target = smollm2_target
    drafter = load_or_init_drafter(str(DEFAULT_DRAFTER), target)
    prompts = [target.encode("Qu'est-ce qu'un volcan ? Réponds en une phrase.")]
    gen = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    baseline = generate(target, None, prompts, gen, _sched("none"))
    for mode in MODES[1:]:
        out = generate(target, drafter, prompts, gen, _sched(mode, k=7), _cost())
        assert [o.token_ids for o in out] == [b.token_ids for b in baseline], mode


def test_cli_json(tmp_path, capsys, monkeypatch):
    target = Target.from_model(tiny_hf_model("llama"))

    class _Tok:  # a character-level stand-in tokenizer for the tiny model
        chat_template = None
        eos_token_id = None

        def get_vocab(self):
            return {}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    target.tokenizer = _Tok()
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: target))
    monkeypatch.setattr(Target, "encode", lambda self, p, chat_template=True: [ord(c) % 90 + 2 for c in p])
    cost = tmp_path / "cost.json"
    _cost().save(cost)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "world!"}) + "\n")
    from reference.checkpoint import save_drafter

    ckpt = tmp_path / "drafter"
    save_drafter(_drafter_for(target), ckpt)
    rc = main(["--prompts-file", str(prompts), "--mode", "adaptive", "--cost-table", str(cost), "--json",
               "--max-new-tokens", "6", "--drafter", str(ckpt)])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2
    for obj in lines:
        for key in ("token_ids", "text", "verify_lengths", "accepted_lengths", "finish_reason"):
            assert key in obj
        assert len(obj["verify_lengths"]) == len(obj["accepted_lengths"])


def test_cli_rejects_bad_prompts_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2"):
        main(["--prompts-file", str(bad), "--mode", "none"])
