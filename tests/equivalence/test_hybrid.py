"""The hybrid proposer's twins: the engine (``ModelRunner.draft_hybrid``) emits what ``reference.generate`` emits with
``reference/hybrid.py`` — the same token ids, per-step verify and accepted lengths and per-step sources — greedy and
sampled, in every mode it runs (the equivalence contract, level 3: docs/architecture.md), with the draft gate closing,
and with requests that join mid-run and reuse a slot (a new request must not inherit the old one's counts). On CUDA
(marked ``gpu``), the same comparison with the engine's graphs and Triton kernels, in float32 with TF32 off.
"""

from __future__ import annotations

import pytest
import torch

from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.generate import generate as opt_generate
from reference.config import GenerationConfig, HybridConfig, SchedulerConfig
from reference.cost_model import CostTable
from reference.generate import generate as ref_generate
from reference.hybrid import DSPARK, NGRAM, PLAIN, HybridProposer
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster, and the machine is shared

PROMPTS = [[5, 9, 3, 17, 5, 9, 3], [2, 40, 41, 42, 43, 7, 8], [60], [11, 12, 11, 12, 11]]
MODES = ["fixed", "dsd", "threshold", "adaptive-sync", "adaptive"]


def _cost(per_token_ms: float, draft_ms: float = 0.0) -> CostTable:
    return CostTable.affine(fixed_ms=5.0, per_token_ms=per_token_ms, draft_fixed_ms=draft_ms, sizes=list(range(1, 129)))


def _compare(target, proposer, prompts, gen, sched, cost, backend="torch"):
    """Reference vs engine (torch kernels unless told, steps read one by one, the table's prices as they are)."""
    ref = ref_generate(target, proposer, prompts, gen, sched, cost)
    cfg = EngineConfig(max_num_seqs=len(prompts), seed=gen.seed, kernel_backend=backend, device=str(target.device),
                       dtype=target.dtype, async_decode=False, cost_feedback=False)
    opt = opt_generate(target, proposer, prompts, gen, sched, cost, engine_config=cfg)
    for a, b in zip(ref, opt):
        assert b.token_ids == a.token_ids, f"{sched.mode}: tokens differ"
        assert b.verify_lengths == a.verify_lengths, f"{sched.mode}: verify lengths differ"
        assert b.accepted_lengths == a.accepted_lengths, f"{sched.mode}: accepted lengths differ"
        assert b.proposal_sources == a.proposal_sources, f"{sched.mode}: sources differ"
        assert b.finish_reason == a.finish_reason
    return ref


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reference_equals_optimized(family, temperature):
    """Every mode; the adaptive budget once priced as usual and once with verification nearly free, where it asks for
    slots past an n-gram block's end (the device must clip them as the reference does)."""
    target = Target.from_model(tiny_hf_model(family))
    # At T = 1 too the prior of a greedy request, so that n-gram blocks are taken (the random drafter's are rejected)
    proposer = HybridProposer(tiny_drafter(target, gamma=4, noise=0.2),
                              HybridConfig(gamma=4, prior_accept_sampling=0.5))
    gen = GenerationConfig(max_new_tokens=18, temperature=temperature, top_p=0.95 if temperature else 1.0, seed=99,
                           ignore_eos=True)
    sources = []
    for mode in MODES:
        sched = SchedulerConfig(mode=mode, k=3, threshold=0.05, dsd_table={1: 4, 2: 2, 3: 1}, staleness=1)
        for per_token_ms in (0.3, 0.001) if mode == "adaptive" else (0.3,):
            out = _compare(target, proposer, PROMPTS, gen, sched, _cost(per_token_ms))
            sources += [s for r in out for s in r.proposal_sources]
            assert any(sum(r.accepted_lengths) for r in out), f"{mode}: nothing accepted"
    assert sources.count(NGRAM) and sources.count(DSPARK), "both sources must be exercised"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_gate_closes_identically(temperature):
    """An expensive drafter: the adaptive mode's gate closes (plain steps, no block held) and probes again."""
    target = Target.from_model(tiny_hf_model("llama"))
    proposer = HybridProposer(tiny_drafter(target, gamma=4, noise=0.2))
    gen = GenerationConfig(max_new_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    sched = SchedulerConfig(mode="adaptive", probe_every=3, staleness=1)
    out = _compare(target, proposer, PROMPTS, gen, sched, _cost(0.3, draft_ms=6.0))
    sources = {s for r in out for s in r.proposal_sources}
    assert PLAIN in sources and sources - {PLAIN}, f"the gate must close and open, got {sources}"


def test_continuous_batching_and_slot_reuse_match_alone():
    """Requests joining mid-run and a slot reused after a finish: each request's greedy tokens, lengths and sources
    equal the reference loop's for the request alone (its hybrid state is its own, never its slot's)."""
    target = Target.from_model(tiny_hf_model("qwen3"))
    proposer = HybridProposer(tiny_drafter(target, gamma=3, noise=0.2), HybridConfig(gamma=3, prior_accept=0.8))
    sched = SchedulerConfig(mode="fixed", k=3)
    engine = Engine(target, proposer, EngineConfig(max_num_seqs=2, max_seq_len=96, prefill_chunk=5), sched)
    prompts = {0: [5, 6, 7, 5, 6, 7, 5], 1: [3], 2: [40, 41, 40], 3: [7, 7, 7]}
    limits = {0: 12, 1: 4, 2: 9, 3: 8}
    for rid in (0, 1):
        engine.add_request(prompts[rid], SamplingParams(max_new_tokens=limits[rid], ignore_eos=True), request_id=rid)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 2:  # join while others run; two slots, so request 3 waits for a free one
            for rid in (2, 3):
                engine.add_request(prompts[rid], SamplingParams(max_new_tokens=limits[rid], ignore_eos=True),
                                   request_id=rid)
    sources = []
    for rid, prompt in prompts.items():
        gen = GenerationConfig(max_new_tokens=limits[rid], ignore_eos=True)
        alone = ref_generate(target, proposer, [prompt], gen, sched, request_ids=[rid])[0]
        seq = engine.sequence(rid)
        assert (seq.output_ids, seq.accepted_lengths, seq.proposal_sources) == \
            (alone.token_ids, alone.accepted_lengths, alone.proposal_sources), f"request {rid}"
        sources += seq.proposal_sources
    assert NGRAM in sources


def test_engine_refuses_the_oracle():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    proposer = HybridProposer(tiny_drafter(target, gamma=3))
    cfg = EngineConfig(max_num_seqs=1, max_seq_len=32)
    with pytest.raises(ValueError, match="oracle"):
        Engine(target, proposer, cfg, SchedulerConfig(mode="oracle"))
    engine = Engine(target, proposer, cfg, SchedulerConfig(mode="fixed", k=3))
    assert engine.gamma == 3 and engine.runner.drafter is not None and engine.runner.host_proposals
    with pytest.raises(ValueError, match="oracle"):
        engine.set_scheduler(SchedulerConfig(mode="oracle"))
    engine.set_scheduler(SchedulerConfig(mode="threshold"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_graphs_reference_equals_optimized(temperature):
    """On CUDA in float32 (TF32 off): the engine with its CUDA graphs (the drafter's stage, whose survivals the host
    then reads, included) and Triton kernels against the reference loop on the same device."""
    from scripts import equivalence as ge

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        target, drafter, *_ = ge.load_tiny("llama", torch.device("cuda"), torch.float32)
        proposer = HybridProposer(drafter)
        gen = GenerationConfig(max_new_tokens=18, temperature=temperature, top_p=0.95 if temperature else 1.0,
                               seed=99, ignore_eos=True)
        sources = []
        with ge.count_graph_runs() as runs:
            for mode in ("fixed", "threshold", "adaptive"):
                sched = SchedulerConfig(mode=mode, k=3, threshold=0.05, staleness=1)
                out = _compare(target, proposer, PROMPTS, gen, sched, _cost(0.001), backend="triton")
                sources += [s for r in out for s in r.proposal_sources]
        assert runs["draft"]["graph"] > 0 and runs["verify"]["graph"] > 0, runs
        assert sources.count(NGRAM) and sources.count(DSPARK), "both sources must be exercised"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
