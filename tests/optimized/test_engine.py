"""The engine facade (``optimized/engine.py``): warm-up leaves results unchanged, and ``last_step_stats`` reports
what each step did, checked against the requests' own records on a tiny model."""

from __future__ import annotations

import pytest
import torch

from optimized.engine import Engine, EngineConfig, SamplingParams, StepStats
from optimized.graphs import PrefillBuffers, bucket_sizes, prefill_bucket_sizes
from optimized.runner import ModelRunner
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts.equivalence import count_graph_runs

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 3, 17], [2, 40, 41, 42, 43, 7, 8], [60]]


@pytest.fixture(scope="module")
def models():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    return target, tiny_drafter(target, gamma=4, noise=0.2)


def _cost(draft_ms: float = 0.0) -> CostTable:
    return CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=draft_ms, sizes=list(range(1, 129)))


def _engine(models, mode: str, cost: CostTable | None = None, **sched) -> Engine:
    target, drafter = models
    cfg = EngineConfig(max_num_seqs=3, max_seq_len=96, kernel_backend="torch", seed=3)
    return Engine(target, drafter if mode != "none" else None, cfg, SchedulerConfig(mode=mode, **sched), cost)


def _run(engine: Engine, temperature: float, max_new_tokens: int = 12) -> tuple[list, list[StepStats]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in PROMPTS]
    stats = []
    while engine.has_unfinished():
        engine.step()
        stats.append(engine.last_step_stats())
    seqs = [engine.sequence(r) for r in rids]
    return [(s.output_ids, s.verify_lengths, s.accepted_lengths) for s in seqs], stats


@pytest.mark.parametrize("mode", ["none", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_warmup_leaves_results_unchanged(models, mode, temperature):
    cold = _engine(models, mode, _cost())
    warm = _engine(models, mode, _cost())
    assert warm.warmup() > 0
    assert warm.runner.idle and not warm.has_unfinished()
    assert warm.last_step_stats() is None and warm.stats["steps"] == 0  # dummy steps are not engine steps
    assert _run(warm, temperature)[0] == _run(cold, temperature)[0]
    with pytest.raises(RuntimeError, match="idle"):
        warm.add_request([4, 5], SamplingParams(max_new_tokens=2))
        warm.step()
        warm.warmup()


def test_last_step_stats_match_the_requests_records(models):
    engine = _engine(models, "adaptive", _cost(), staleness=1)
    assert engine.last_step_stats() is None
    results, stats = _run(engine, temperature=1.0)
    first = stats[0]  # the prefill step: nobody verified, everybody drafted
    assert (first.num_decoding, first.verify_tokens, first.verified, first.predicted_survival) == (0, 0, [], [])
    assert first.drafted and first.budget is None and first.num_running == 3 and first.num_waiting == 0
    assert all(s.step_time_s > 0 for s in stats) and all(s.budget is not None for s in stats[1:])
    seqs = {s.request_id: s for s in engine._ids.values()}
    step_of = {rid: 0 for rid in seqs}  # verify steps seen so far per request
    for st in stats[1:]:
        assert st.num_decoding == len(st.request_ids) == len(st.verified) == len(st.accepted)
        assert st.verify_tokens == st.num_decoding + sum(st.verified) and st.budget == sum(st.verified)
        for rid, ell, acc, a in zip(st.request_ids, st.verified, st.accepted, st.predicted_survival):
            seq, k = seqs[rid], step_of[rid]
            assert (ell, acc) == (seq.verify_lengths[k], seq.accepted_lengths[k])
            # The survivals of the draft this step verified: that request's k-th draft.
            assert a == seq.survivals[k][:ell].tolist() and len(a) == ell
            assert all(1.0 >= x >= y >= 0.0 for x, y in zip(a, a[1:]))
            step_of[rid] += 1
    assert step_of == {rid: len(s.verify_lengths) for rid, s in seqs.items()}
    assert stats[-1].num_running == 0 and stats[-1].num_waiting == 0


def test_last_step_stats_when_the_gate_closes(models):
    """A drafter far dearer than what it saves: after the first draft the gate closes, nothing is verified."""
    engine = _engine(models, "adaptive", _cost(draft_ms=40.0), probe_every=3)
    _, stats = _run(engine, temperature=0.0, max_new_tokens=10)
    assert any(not s.drafted for s in stats[1:]), "the gate never closed"
    for before, st in zip(stats, stats[1:]):
        if before.drafted:  # the gate was open: a budget was planned (it may be 0)
            assert st.budget is not None and st.budget == sum(st.verified)
        else:  # ordinary decoding: no budget, nothing verified, no survivals
            assert st.budget is None and st.verified == [0] * st.num_decoding == st.accepted
            assert st.predicted_survival == [[]] * st.num_decoding and st.verify_tokens == st.num_decoding


def test_last_step_stats_without_a_drafter(models):
    _, stats = _run(_engine(models, "none"), temperature=0.0, max_new_tokens=4)
    for st in stats:
        assert not st.drafted and st.budget is None and st.verified == [0] * st.num_decoding
        assert st.accepted == [0] * st.num_decoding and st.predicted_survival == [[]] * st.num_decoding


def test_fixed_mode_reports_the_verified_survivals(models):
    torch.manual_seed(0)
    _, stats = _run(_engine(models, "fixed", k=3), temperature=0.0, max_new_tokens=8)
    for st in stats[1:]:
        assert st.budget is None and st.verified == [3] * st.num_decoding
        assert [len(a) for a in st.predicted_survival] == [3] * st.num_decoding


def test_release_forgets_finished_requests_only(models):
    engine = _engine(models, "fixed", k=2)
    done = engine.add_request([4, 5], SamplingParams(max_new_tokens=2, ignore_eos=True))
    running = engine.add_request([6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.sequence(done).finished and not engine.sequence(running).finished
    engine.release(done)
    with pytest.raises(KeyError):
        engine.sequence(done)
    with pytest.raises(ValueError, match="still running"):
        engine.release(running)
    assert engine.abort(running)
    engine.release(running)
    assert not engine.has_unfinished()


def test_pipelining_switches_default_to_on_cuda_only(models):
    """plan_ahead, draft_ahead and async_decode: None means on CUDA; on the CPU there is nothing to overlap."""
    target, drafter = models
    sched = SchedulerConfig(mode="fixed", k=2)
    cpu = Engine(target, drafter, EngineConfig(max_num_seqs=2, max_seq_len=64), sched)
    assert cpu.pipelining == {"plan_ahead": False, "draft_ahead": False, "async_decode": False}
    forced = Engine(target, drafter, EngineConfig(max_num_seqs=2, max_seq_len=64, plan_ahead=True, draft_ahead=True,
                                                  async_decode=True), sched)
    assert forced.pipelining == {"plan_ahead": True, "draft_ahead": True, "async_decode": True}
    no_plan = Engine(target, drafter, EngineConfig(max_num_seqs=2, max_seq_len=64, plan_ahead=False,
                                                   draft_ahead=True), sched)
    assert no_plan.pipelining["draft_ahead"] is False  # drafting ahead needs the verdict planned ahead


def test_prefill_buffers_pad_every_row_and_token():
    """One step's chunks in the prefill graphs' buffers; everything past them is padding that writes to the trash slot
    and reads nothing (zero-length rows, the offset repeated), and a second, smaller load leaves nothing behind."""
    pb = PrefillBuffers(max_rows=4, max_tokens=10, device=torch.device("cpu"), vocab_size=7)
    pb.load([1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 0, 1], [0, 5, 7], [5, 2], [2, 0], [6])
    assert pb.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0, 0]
    assert pb.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 0, 0]
    assert pb.token_slot.tolist() == [2, 2, 2, 2, 2, 0, 0, -1, -1, -1]
    assert pb.cu.tolist() == [0, 5, 7, 7, 7] and pb.kv_lens.tolist() == [5, 2, 0, 0]
    assert pb.slot_ids.tolist() == [2, 0, -1, -1] and pb.last_rows.tolist() == [6, 0, 0, 0]
    pb.load([9], [3], [0, 1], [4], [1], [0])
    assert pb.token_slot.tolist() == [1] + [-1] * 9 and pb.cu.tolist() == [0, 1, 1, 1, 1]
    assert pb.slot_ids.tolist() == [1, -1, -1, -1] and pb.kv_lens.tolist() == [4, 0, 0, 0]
    with pytest.raises(ValueError, match="exceed"):
        pb.load(list(range(11)), list(range(11)), [0, 11], [11], [0], [10])
    assert prefill_bucket_sizes(10) == [10] and prefill_bucket_sizes(2048)[-1] == 2048
    sizes = prefill_bucket_sizes(2048)
    assert all(b / a <= 2 and b % 16 == 0 for a, b in zip(sizes, sizes[1:])) and len(sizes) <= 24


@pytest.mark.parametrize("max_tokens", [1, 5, 8, 9, 100, 256, 257, 512, 1000, 2048, 4096])
def test_verify_buckets_bound_the_padding(max_tokens):
    """Every token count 1..max runs in a bucket: exactly below 9, at most 7 tokens more up to 128, and at most
    1/16 more past it; the count grows like the logarithm (87 graphs for 256 requests of γ + 1 = 8 tokens)."""
    sizes = bucket_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    assert sizes[:8] == list(range(1, min(8, max_tokens) + 1))
    for n in range(1, max_tokens + 1):
        b = next(s for s in sizes if s >= n)
        assert b == n if n <= 8 else (b - n <= 7 if n <= 128 else b - n <= n / 16)
    if max_tokens == 2048:
        assert len(sizes) == 87


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefill_in_groups_equals_one_eager_prefill(models, temperature, monkeypatch):
    """Twenty prompts admitted together: with small prefill graphs (16 chunks, 10 tokens) the step's chunks run in
    several groups through the graphs' buffers and the longer ones eagerly alone; the tokens, verify and accepted
    lengths equal those of one eager forward per step (``prefill_graph_tokens=0``)."""
    target, drafter = models
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 90, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 14, (20,), generator=gen)]
    out, runs, forwards = {}, {}, {}
    forward = ModelRunner._prefill_forward

    def counting_forward(runner, chunks):
        forwards[graph_tokens] = forwards.get(graph_tokens, 0) + 1
        return forward(runner, chunks)

    monkeypatch.setattr(ModelRunner, "_prefill_forward", counting_forward)
    for graph_tokens in (0, 10):
        cfg = EngineConfig(max_num_seqs=20, max_seq_len=64, prefill_chunk=120, prefill_graph_tokens=graph_tokens,
                           kernel_backend="torch", seed=3)
        engine = Engine(target, drafter, cfg, SchedulerConfig(mode="fixed", k=3))
        params = SamplingParams(max_new_tokens=6, temperature=temperature, ignore_eos=True)
        with count_graph_runs() as counts:
            rids = [engine.add_request(p, params) for p in prompts]
            while engine.has_unfinished():
                engine.step()
        out[graph_tokens] = [(engine.sequence(r).output_ids, engine.sequence(r).verify_lengths,
                              engine.sequence(r).accepted_lengths) for r in rids]
        # 20 prompts of ≤ 13 tokens, 120 prompt tokens a step: two prefill steps whatever the grouping
        assert engine.stats["prefill_steps"] == 2 and engine.stats["prefill_s"] > 0
        runs[graph_tokens] = counts.get("prefill", {"graph": 0, "eager": 0})
    assert runs[0]["eager"] == 0  # no prefill through the graphs' function at all
    assert forwards[0] == 2 < forwards[10]  # without prefill graphs: one forward per step, as before them
    assert runs[10]["eager"] >= 3  # 20 prompts of ≤ 13 tokens: several groups (and the long prompts alone)
    assert out[10] == out[0]


@pytest.mark.parametrize("async_decode", [False, True])
def test_plain_steps_park_the_drafter_context_and_append_it_before_the_next_draft(models, async_decode):
    """With the gate closed, steps run the target alone (the plain graphs) and park their features; a probe's draft
    first appends them. Every token and every gate decision equal an engine that appends the context at every step —
    also when the parking buffer fills (2 positions here) and is appended in the middle of a run — and so do the
    drafts' survivals, up to float32 rounding: the parked features are the same, but a batched append projects them
    as a matrix of several rows, and a CPU BLAS may sum a row of it in another order than the row alone (some do:
    one ulp apart on an AMD EPYC with torch 2.13)."""
    target, drafter = models
    results = {}
    for lag in (0, 2, 32):
        cfg = EngineConfig(max_num_seqs=3, max_seq_len=96, kernel_backend="torch", seed=3, draft_context_lag=lag,
                           async_decode=async_decode)
        engine = Engine(target, drafter, cfg, SchedulerConfig(mode="adaptive", probe_every=4), _cost(draft_ms=40.0))
        plain_runs = []
        if lag:
            run = engine.runner.plain_graphs.run
            engine.runner.plain_graphs.run = lambda n, run=run, seen=plain_runs: seen.append(n) or run(n)
        else:
            assert engine.runner.plain_graphs is None
        outputs, stats = _run(engine, temperature=1.0, max_new_tokens=20)
        closed = [st for st in stats if st.gate_closed]
        assert closed and any(st.drafted for st in stats[stats.index(closed[0]):]), "the gate never reopened"
        assert len(plain_runs) == (len(closed) if lag else 0)
        results[lag] = (outputs, [st.predicted_survival for st in stats], [st.gate_closed for st in stats])
    for lag in (2, 32):
        outputs, survivals, closed = results[lag]
        assert outputs == results[0][0] and closed == results[0][2]
        assert [[len(a) for a in step] for step in survivals] == [[len(a) for a in step] for step in results[0][1]]
        for step, want in zip(survivals, results[0][1]):
            for a, b in zip(step, want):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-7)


def test_draft_context_lag_must_not_be_negative():
    with pytest.raises(ValueError, match="draft_context_lag"):
        EngineConfig(draft_context_lag=-1)


@pytest.mark.parametrize("async_decode", [False, True])
def test_the_finish_time_gate_keeps_greedy_tokens(models, async_decode):
    """``EngineConfig.finish_time_gate`` reaches the scheduler; once nothing waits the gate weighs finish times (its
    trace records them), and greedy tokens equal the ordinary gate's (verification is lossless whatever drafts)."""
    target, drafter = models
    out, traces = {}, {}
    for finish in (False, True):
        cfg = EngineConfig(max_num_seqs=3, max_seq_len=96, kernel_backend="torch", seed=3, async_decode=async_decode,
                           finish_time_gate=finish)
        engine = Engine(target, drafter, cfg, SchedulerConfig(mode="adaptive"), _cost(draft_ms=0.0))
        assert engine.scheduler.finish_time_gate is finish
        engine.scheduler.gate.finish_trace = []
        results, _ = _run(engine, temperature=0.0, max_new_tokens=40)  # three requests, three slots: nothing waits
        out[finish] = [r[0] for r in results]
        traces[finish] = engine.scheduler.gate.finish_trace
    assert out[True] == out[False]
    assert traces[False] == [] and traces[True], "the finish-time gate never weighed the batch"
    assert all(2 <= r <= 3 and est.plain_steps <= 40 for r, est, _, _ in traces[True])  # one request: the ordinary gate
