"""The n-gram proposer's twins: ``optimized/ngram.py``'s incremental index proposes what ``reference/ngram.py``
proposes, and the engine with the n-gram proposer emits what ``reference.generate`` emits — the same token ids and
the same per-step verify and accepted lengths, greedy and sampled, on tiny random Llama- and Qwen3-style targets and
on SmolLM2 (the equivalence contract, level 3: docs/architecture.md).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.generate import generate as opt_generate
from optimized.ngram import NgramIndex
from reference.config import GenerationConfig, NgramConfig, SchedulerConfig
from reference.generate import generate as ref_generate
from reference.ngram import NgramProposer, propose
from reference.target import Target
from reference.testing import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster, and the machine is shared


@pytest.mark.parametrize("max_n,min_n,gamma", [(3, 1, 7), (2, 2, 3), (4, 2, 1), (1, 1, 5)])
def test_index_proposes_what_the_reference_proposes(max_n, min_n, gamma):
    """Random contexts over a 4-token vocabulary (many recurring n-grams), grown in random chunks as requests grow
    step by step: after every chunk the index's proposal equals the reference scan's."""
    rng = random.Random(max_n * 100 + min_n * 10 + gamma)
    cfg = NgramConfig(gamma=gamma, max_n=max_n, min_n=min_n)
    for _ in range(40):
        prompt = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        output: list[int] = []
        index = NgramIndex(cfg)
        while len(output) < 30:
            index.sync(prompt, output)
            assert index.propose() == propose(prompt + output, gamma, max_n, min_n)
            output += [rng.randrange(4) for _ in range(rng.randint(1, gamma + 1))]


def _compare(target, prompts, gen, sched, gamma=4, backend="torch", warmup=False):
    proposer = NgramProposer(NgramConfig(gamma=gamma))
    ref = ref_generate(target, proposer, prompts, gen, sched)
    cfg = EngineConfig(max_num_seqs=len(prompts), seed=gen.seed, kernel_backend=backend, device=str(target.device),
                       dtype=target.dtype)
    opt = opt_generate(target, proposer, prompts, gen, sched, engine_config=cfg, warmup=warmup)
    for a, b in zip(ref, opt):
        assert b.token_ids == a.token_ids, f"{sched.mode}: tokens differ"
        assert b.verify_lengths == a.verify_lengths, f"{sched.mode}: verify lengths differ"
        assert b.accepted_lengths == a.accepted_lengths, f"{sched.mode}: accepted lengths differ"
        assert b.finish_reason == a.finish_reason
    return ref


PROMPTS = [[5, 9, 3, 17, 5, 9, 3], [2, 40, 41, 42, 43, 7, 8], [60], [11, 12, 11, 12, 11]]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reference_equals_optimized(family, temperature):
    target = Target.from_model(tiny_hf_model(family))
    gen = GenerationConfig(max_new_tokens=16, temperature=temperature, top_p=0.95 if temperature else 1.0, seed=99,
                           ignore_eos=True)
    full = _compare(target, PROMPTS, gen, SchedulerConfig(mode="fixed", k=4))
    assert any(sum(r.accepted_lengths) for r in full), "nothing accepted: the speculative path went untested"
    assert any(v < 4 for r in full for v in r.verify_lengths), "no proposal was short: clipping went untested"
    _compare(target, PROMPTS, gen, SchedulerConfig(mode="fixed", k=2))
    _compare(target, PROMPTS, gen, SchedulerConfig(mode="dsd", dsd_table={1: 4, 3: 3}))


def test_triton_kernels_end_to_end():
    """The same comparison, sampled, with every engine op on its Triton kernel (the interpreter on CPU; greedy rows
    take the same rejection-sampling kernel with one-hot p_t)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    gen = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    _compare(target, [[5, 9, 3, 5, 9], [60]], gen, SchedulerConfig(mode="fixed", k=3), gamma=3, backend="triton")


def test_warmup_leaves_no_state():
    """The warm-up of an engine with the n-gram proposer (verify with full blocks, no drafter) changes no output."""
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    gen = GenerationConfig(max_new_tokens=10, temperature=1.0, seed=8, ignore_eos=True)
    _compare(target, PROMPTS, gen, SchedulerConfig(mode="fixed", k=4), warmup=True)


def test_eos_stops_like_the_reference():
    target = Target.from_model(tiny_hf_model("llama"))
    gen = GenerationConfig(max_new_tokens=30, temperature=1.0, seed=5)
    _compare(target, [[3, 1, 4, 1, 5], [9, 2, 6, 9, 2]], gen, SchedulerConfig(mode="fixed", k=4))


def test_continuous_batching_and_slot_reuse_match_alone():
    """Requests joining mid-run and a slot reused after a finish (a new request must not inherit the old lookup
    index): greedy tokens equal each request decoded alone by the reference loop without speculation."""
    target = Target.from_model(tiny_hf_model("qwen3"))
    engine = Engine(target, NgramProposer(NgramConfig(gamma=3)), EngineConfig(max_num_seqs=2, max_seq_len=96,
                                                                             prefill_chunk=5),
                    SchedulerConfig(mode="fixed", k=3))
    prompts = {0: [5, 6, 7, 5, 6, 7, 5], 1: [3], 2: [40, 41, 40], 3: [7, 7, 7]}
    limits = {0: 9, 1: 4, 2: 6, 3: 5}
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=limits[0], ignore_eos=True), request_id=0)
    engine.add_request(prompts[1], SamplingParams(max_new_tokens=limits[1], ignore_eos=True), request_id=1)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 2:  # join while others run; two slots, so request 3 waits for a free one
            for rid in (2, 3):
                engine.add_request(prompts[rid], SamplingParams(max_new_tokens=limits[rid], ignore_eos=True),
                                   request_id=rid)
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for rid, prompt in prompts.items():
        alone = ref_generate(target, None, [prompt], gen, SchedulerConfig(mode="none"))[0].token_ids
        assert engine.sequence(rid).output_ids == alone[:limits[rid]], f"request {rid}"


def test_engine_refuses_modes_that_need_confidences():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    cfg = EngineConfig(max_num_seqs=1, max_seq_len=32)
    for mode in ("threshold", "adaptive-sync", "adaptive", "oracle"):
        with pytest.raises(ValueError, match="no confidences"):
            Engine(target, NgramProposer(), cfg, SchedulerConfig(mode=mode))
    engine = Engine(target, NgramProposer(), cfg, SchedulerConfig(mode="fixed"))
    assert engine.gamma == NgramConfig().gamma and engine.runner.drafter is None
    with pytest.raises(ValueError, match="no confidences"):
        engine.set_scheduler(SchedulerConfig(mode="threshold"))
    engine.set_scheduler(SchedulerConfig(mode="dsd"))


@pytest.mark.slow
def test_smollm2_reference_equals_optimized(smollm2_target):
    """The real target, a prompt that invites copying, γ = 7: greedy (also equal to the target alone) and sampled."""
    target = smollm2_target
    prompts = [target.encode("Repeat exactly: the cat sat on the mat, the cat sat on the mat.")]
    sched = SchedulerConfig(mode="fixed", k=7)
    greedy = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    spec = _compare(target, prompts, greedy, sched, gamma=7)
    assert sum(spec[0].accepted_lengths) > 0, "nothing accepted: the speculative path went untested"
    plain = ref_generate(target, None, prompts, greedy, SchedulerConfig(mode="none"))
    assert spec[0].token_ids == plain[0].token_ids
    _compare(target, prompts, GenerationConfig(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True), sched,
             gamma=7)
