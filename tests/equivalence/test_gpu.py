"""End to end on CUDA: ``reference.generate`` equals the engine with CUDA graphs on and its Triton kernels.

Level 3 of the equivalence contract on the device: the comparison of ``test_end_to_end.py`` (its ``_compare``:
token ids, per-step accepted and verify lengths, finish reasons) with the tiny Llama and Qwen3 targets moved to CUDA
in float32 with TF32 off, the engine capturing its verify, prefill and draft graphs (``enforce_eager=False``) and
running every op on its Triton kernel; every mode, greedy and seeded sampling. Then the graph path against the eager
path of the same engine, token for token, and the GPU equivalence script on CUDA. The full-size run on the real
target is ``python -m scripts.gpu_equivalence`` (``docs/benchmarks/gpu-equivalence.json``).
Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).

Every test is marked ``gpu`` and skipped where CUDA is not available.
"""

from __future__ import annotations

import json

import pytest
import torch

from optimized.engine import Engine, EngineConfig, SamplingParams
from optimized.generate import generate as opt_generate
from reference.checkpoint import read_drafter_config
from reference.cli import DEFAULT_DRAFTER, load_or_init_drafter
from reference.config import GenerationConfig, SchedulerConfig
from reference.target import Target, default_gguf_path
from scripts import equivalence as ge
from scripts import gpu_equivalence
from tests.equivalence.test_end_to_end import MODES, _compare, _cost

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 9, 3, 17], [2, 40, 41, 42, 43, 7, 8], [60]]  # as in test_end_to_end.py


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 means float32: TF32 rounds matmul inputs to 10 mantissa bits, differently in cuBLAS and Triton."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _cuda_models(family: str):
    """The CPU suite's tiny target (4 layers) and drafter (γ = 4, noise 0.2), built on the CPU and moved to CUDA."""
    target, drafter, *_ = ge.load_tiny(family, torch.device("cuda"), torch.float32)
    assert target.device.type == "cuda" and next(drafter.parameters()).device.type == "cuda"
    return target, drafter


def _gen(temperature: float, max_new_tokens: int = 14) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=0.95 if temperature else 1.0, seed=99, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_graphs_reference_equals_optimized_every_mode(family, temperature):
    target, drafter = _cuda_models(family)
    with ge.count_graph_runs() as runs:
        for mode in MODES:
            _compare(target, drafter, PROMPTS, _gen(temperature), mode, backend="triton")
    # Every verify (≤ 3·(γ+1) = 15 tokens), prefill (3 prompts of ≤ 7 tokens) and draft (≤ 3 requests) fits a
    # captured bucket: nothing ran eagerly.
    for stage in ("verify", "prefill", "draft"):
        assert runs[stage]["graph"] > 0 and runs[stage]["eager"] == 0, runs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphs_equal_eager_token_for_token(temperature):
    """The same engine settings with and without CUDA graphs: identical tokens and per-step lengths."""
    target, drafter = _cuda_models("llama")
    gen = _gen(temperature, max_new_tokens=20)
    for mode in ("fixed", "threshold", "adaptive"):
        sched = SchedulerConfig(mode=mode, k=3, threshold=0.05)
        out, runs = {}, {}
        for eager in (False, True):
            cfg = EngineConfig(max_num_seqs=len(PROMPTS), seed=gen.seed, kernel_backend="triton", device="cuda",
                               dtype=torch.float32, enforce_eager=eager, cost_feedback=False)  # timing-free schedule
            with ge.count_graph_runs() as counts:
                out[eager] = opt_generate(target, drafter, PROMPTS, gen, sched, _cost(), engine_config=cfg)
            runs[eager] = counts
        assert runs[False]["verify"]["graph"] > 0 and runs[True]["verify"]["graph"] == 0, runs
        assert runs[False]["prefill"]["graph"] > 0 and runs[True]["prefill"]["graph"] == 0, runs
        for a, b in zip(out[True], out[False]):
            assert b.token_ids == a.token_ids, f"{mode}: tokens differ"
            assert b.accepted_lengths == a.accepted_lengths, f"{mode}: accepted lengths differ"
            assert b.verify_lengths == a.verify_lengths, f"{mode}: verify lengths differ"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_ahead_equals_drafting_after_the_read(temperature):
    """``draft_ahead`` on CUDA with graphs: the drafter launched behind the token copy, before the host waits for it,
    gives the same tokens and per-step lengths as drafting after the read; requests finish at different steps."""
    target, drafter = _cuda_models("llama")
    lengths = [9, 17, 13]
    out, ahead = {}, {}
    for early in (False, True):
        cfg = EngineConfig(max_num_seqs=len(PROMPTS), seed=99, kernel_backend="triton", device="cuda",
                           dtype=torch.float32, plan_ahead=True, draft_ahead=early, async_decode=False,
                           cost_feedback=False)
        engine = Engine(target, drafter, cfg, SchedulerConfig(mode="adaptive"), _cost())
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True),
                               request_id=i)
        while engine.has_unfinished():
            engine.step()
        out[early] = [(engine.sequence(i).output_ids, engine.sequence(i).verify_lengths,
                       engine.sequence(i).accepted_lengths) for i in range(len(PROMPTS))]
        ahead[early] = engine.stats["draft_ahead_steps"]
    assert out[True] == out[False]
    assert ahead[False] == 0 < ahead[True]


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_speculation_one_step_ahead_on_cuda(mode):
    """Speculation one step ahead of the reads (``async_decode``, the CUDA default) with CUDA graphs, greedy: the same
    tokens as the synchronous engine and as plain decoding (each step's anchors and drafts are read on the device)."""
    target, drafter = _cuda_models("llama")
    lengths = [9, 17, 13]
    out = {}
    for one_ahead, d, m in ((False, drafter, mode), (True, drafter, mode), (True, None, "none")):
        cfg = EngineConfig(max_num_seqs=len(PROMPTS), seed=99, kernel_backend="triton", device="cuda",
                           dtype=torch.float32, async_decode=one_ahead, cost_feedback=False)
        engine = Engine(target, d, cfg, SchedulerConfig(mode=m, k=3), _cost())
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=i)
        while engine.has_unfinished():
            engine.step()
        out[(one_ahead, m)] = [engine.sequence(i).output_ids for i in range(len(PROMPTS))]
    assert out[(True, mode)] == out[(False, mode)] == out[(True, "none")]


@pytest.mark.parametrize("mode", ["none", "fixed", "adaptive"])
def test_decoding_steps_one_ahead_never_wait_for_the_stream(mode):
    """Once every prompt is in, a step one ahead of its reads neither synchronises the stream nor makes a blocking
    copy (``torch.cuda.set_sync_debug_mode("error")`` raises on either): its only waits are the events of the token
    read and of the draft's survivals, which wait for exactly that much of the queue. A plain host→device copy would
    drain the queue the pipeline keeps full, and the device would idle while the host launches the next graph."""
    target, drafter = _cuda_models("llama")
    cfg = EngineConfig(max_num_seqs=len(PROMPTS), seed=99, kernel_backend="triton", device="cuda",
                       dtype=torch.float32, async_decode=True)
    engine = Engine(target, None if mode == "none" else drafter, cfg, SchedulerConfig(mode=mode, k=3), _cost())
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), request_id=i)
    while not all(engine.sequence(i).output_ids for i in range(len(PROMPTS))):  # the prefills (they read tokens)
        engine.step()
    engine.step()
    _step(engine, 6, strict=True)
    assert all(len(engine.sequence(i).output_ids) > 6 for i in range(len(PROMPTS)))


def _step(engine: Engine, steps: int, strict: bool) -> None:
    """``steps`` engine steps, with any stream synchronisation raising an error if ``strict``."""
    if strict:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["none", "adaptive"])
def test_prompts_joining_one_ahead_never_wait_for_the_stream(mode):
    """A prompt that arrives while others decode one step ahead: its prefill, its first token and the step's verify
    are launched back to back, and the first token is read after the verify is launched, by its own event. Neither
    that step nor the next synchronise the stream (``set_sync_debug_mode("error")``), and the tokens are those of
    the synchronous engine."""
    target, drafter = _cuda_models("llama")
    outputs = {}
    for one_ahead in (False, True):
        cfg = EngineConfig(max_num_seqs=len(PROMPTS) + 1, seed=99, kernel_backend="triton", device="cuda",
                           dtype=torch.float32, async_decode=one_ahead)
        engine = Engine(target, None if mode == "none" else drafter, cfg, SchedulerConfig(mode=mode), _cost())
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, params, request_id=i)
        while not all(engine.sequence(i).output_ids for i in range(len(PROMPTS))):
            engine.step()
        engine.step()
        engine.add_request([11, 12, 13, 14, 15], params, request_id=len(PROMPTS))
        _step(engine, 3, strict=one_ahead)
        while engine.has_unfinished():
            engine.step()
        outputs[one_ahead] = [engine.sequence(i).output_ids for i in range(len(PROMPTS) + 1)]
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_target_logits_on_cuda(dtype):
    """Compiled on the GPU: with the row-invariant kernels (``EngineConfig.batch_invariant``) a tiny target gives 8
    tokens the same logits, bit for bit, as one verify block and as 8 one-token steps (the interpreter's twin is in
    tests/equivalence/test_row_invariance.py)."""
    from tests.equivalence.test_row_invariance import target_logits

    plain, verify = target_logits(True, dtype, device="cuda")
    assert torch.equal(plain, verify), (plain - verify).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_logits_beside_a_prefill_on_cuda(dtype):
    """Compiled on the GPU: with the row-invariant kernels a decoded token gets the same logits, bit for bit, in a
    step of its own and beside another request's 40-token prefill chunk (where the default attention takes larger
    tiles and other matrix instructions)."""
    from tests.equivalence.test_row_invariance import logits_beside_a_prefill

    alone, mixed = logits_beside_a_prefill(True, dtype, device="cuda")
    assert torch.equal(alone, mixed), (alone - mixed).abs().max().item()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_decoding_one_step_ahead_on_cuda(temperature):
    """``async_decode`` with CUDA graphs: step n+1 launched before step n's tokens are read gives the reference's
    tokens (each request's next input token is read on the device, not from the host)."""
    target, _ = _cuda_models("llama")
    lengths = [9, 17, 13]
    out = {}
    for one_ahead in (False, True):
        cfg = EngineConfig(max_num_seqs=len(PROMPTS), seed=99, kernel_backend="triton", device="cuda",
                           dtype=torch.float32, async_decode=one_ahead)
        engine = Engine(target, None, cfg, SchedulerConfig(mode="none"))
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True),
                               request_id=i)
        while engine.has_unfinished():
            engine.step()
        out[one_ahead] = [engine.sequence(i).output_ids for i in range(len(PROMPTS))]
    assert out[True] == out[False]
    assert [len(t) for t in out[True]] == lengths


def test_gpu_equivalence_script_on_cuda(tmp_path):
    """The equivalence script, tiny models: graphs on, Triton kernels, every request identical, graphs replayed."""
    out = tmp_path / "gpu-equivalence.json"
    argv = ["--tiny", "--device", "cuda", "--modes", "none,fixed:2,dsd,adaptive,oracle", "--max-new-tokens", "12",
            "--json", str(out)]
    assert gpu_equivalence.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["graphs"] is True and report["kernel_backend"] == "triton" and report["tf32"] is False
    assert report["complete"] and report["summary"]["counts"]["identical"] == len(report["results"]) == 5 * 2 * 3
    assert all(c["graph_runs"]["verify"]["graph"] > 0 for c in report["configs"])


@pytest.mark.slow
def test_smollm2_cuda_graphs_equal_reference():
    """The real target and the shipped drafter on CUDA in float32: greedy fixed-K and sampling with adaptive."""
    try:
        default_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2 is not installed here: {e}")
    target = Target.load(layer_ids=read_drafter_config(DEFAULT_DRAFTER).target_layer_ids, device="cuda")
    drafter = load_or_init_drafter(str(DEFAULT_DRAFTER), target)
    prompts = [target.encode("List two uses of copper."), target.encode("Write a haiku about the sea.")]
    _compare(target, drafter, prompts, GenerationConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True), "fixed",
             backend="triton")
    _compare(target, drafter, prompts, GenerationConfig(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
             "adaptive", backend="triton")
