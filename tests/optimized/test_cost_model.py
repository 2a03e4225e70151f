"""Start-up profiling of the engine (``optimized/cost_model.py``, docs/method.md §5 "Cost table") on the CPU.

Checks that a profile through the engine's own serving path yields a valid monotone table over sizes the engine
really runs, that the fingerprint cache is hit on a second call and missed when a setting changes, and that the
load-time re-check catches a stale table. Names follow ``docs/method.md`` (``ℓ`` verify length, ``SPS``).
"""

from __future__ import annotations

import json

import pytest
import torch

from optimized import cost_model
from optimized.cost_model import cached_profile, fingerprint, profile_engine, profile_engine_cost_table, spread_sizes
from optimized.engine import Engine, EngineConfig, SamplingParams
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model

GAMMA = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    return target, tiny_drafter(target, gamma=GAMMA, markov_rank=8)


def _engine(models, max_num_seqs=4, mode="fixed"):
    target, drafter = models
    # torch kernels: these tests are about the profiling and caching mechanics (timing the Triton interpreter
    # would only make them slow; the kernels' equivalence is tested in tests/equivalence).
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=64, kernel_backend="torch")
    return Engine(target, drafter if mode != "none" else None, cfg, SchedulerConfig(mode=mode, k=GAMMA))


def test_spread_sizes_keeps_ends_and_buckets():
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]
    got = spread_sizes(sizes, 5)
    assert got[0] == 1 and got[-1] == 40 and len(got) <= 5
    assert set(got) <= set(sizes)
    assert spread_sizes(sizes, None) == sizes
    with pytest.raises(ValueError, match="max_sizes"):
        spread_sizes(sizes, 1)


def test_profile_on_cpu_is_monotone_and_covers_the_buckets(models):
    engine = _engine(models)
    table = profile_engine(engine.runner, context_len=16, repeats=2, warmup=1, progress=False)
    sizes = sorted(table.verify_ms)
    # The largest bucket is (γ+1)·max_num_seqs = 20 tokens: always measured, and it bounds the graph region.
    assert sizes[0] == 1 and sizes[-1] == 20 == table.graph_max_tokens
    assert len(sizes) <= cost_model.EAGER_MAX_SIZES["cpu"]
    assert set(sizes) <= set(engine.runner.verify_graphs.sizes)
    assert sorted(table.draft_ms) == [1, 2, 3, 4]
    # Request curves: r = 1, 2, 4 requests (max_num_seqs = 4), each from r tokens (no drafts) to r·(γ+1).
    assert sorted(table.verify_ms_by_requests) == [1, 2, 4]
    for r, curve in table.verify_ms_by_requests.items():
        assert min(curve) == r and max(curve) == r * (GAMMA + 1) and len(curve) <= 3
    for curve in (table.verify_ms, table.draft_ms, *table.verify_ms_by_requests.values()):
        values = [curve[k] for k in sorted(curve)]
        assert all(b >= a for a, b in zip(values, values[1:])), curve
    # The staircase prices every runnable size, and the table drives the scheduler.
    for n in range(1, 21):
        assert table.verify_time(n) > 0
    assert table.meta["context_len"] == 16 and table.hardware.startswith("CPU")
    # Profiling left the engine idle and its slots reusable: adaptive mode with the measured table emits the
    # target's greedy tokens (verification is lossless), exactly as an engine that never profiled or drafted.
    engine.set_cost_table(table)
    engine.set_scheduler(SchedulerConfig(mode="adaptive"))
    plain = _engine(models, mode="none")
    outputs = []
    for e in (engine, plain):
        rids = [e.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in ([5, 6, 7], [9, 2])]
        while e.has_unfinished():
            e.step()
        outputs.append([e.sequence(r).output_ids for r in rids])
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 20


def test_profile_engine_without_drafter(models):
    engine = _engine(models, max_num_seqs=3, mode="none")
    table = profile_engine(engine.runner, context_len=8, repeats=1, warmup=0, progress=False)
    # Without drafts a step carries one token per request: sizes past 3 are never profiled (nor run).
    assert table.draft_ms == {} and sorted(table.verify_ms) == [1, 2, 3] and table.verify_ms_by_requests == {}


def test_cache_hit_then_invalidated_by_a_setting(models, tmp_path, monkeypatch):
    calls = []
    real = cost_model.profile_engine

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_model, "profile_engine", counting)
    engine = _engine(models)
    first = cached_profile(engine.runner, cache_dir=tmp_path, context_len=16, repeats=1, recheck=False, progress=False)
    files = list(tmp_path.glob("*.json"))
    assert len(calls) == 1 and len(files) == 1
    assert json.loads(files[0].read_text())["meta"]["fingerprint"] == files[0].stem
    second = cached_profile(engine.runner, cache_dir=tmp_path, context_len=16, repeats=1, recheck=False, progress=False)
    assert len(calls) == 1, "second call must be a cache hit"
    assert second.verify_ms == first.verify_ms and second.draft_ms == first.draft_ms  # read back exactly
    # Another setting (max_num_seqs, context length) is another fingerprint: profiled again, cached separately.
    cached_profile(_engine(models, max_num_seqs=2).runner, cache_dir=tmp_path, context_len=16, repeats=1, recheck=False,
                   progress=False)
    cached_profile(engine.runner, cache_dir=tmp_path, context_len=8, repeats=1, recheck=False, progress=False)
    assert len(calls) == 3 and len(list(tmp_path.glob("*.json"))) == 3
    assert fingerprint(engine.runner, 16)[0] != fingerprint(engine.runner, 8)[0]
    # The verify buckets are the sizes the table steps at: other buckets (another bucket rule) are another key.
    key, sizes = fingerprint(engine.runner, 16)[0], engine.runner.verify_graphs.sizes
    try:
        engine.runner.verify_graphs.sizes = [*sizes[:-2], sizes[-1]]
        assert fingerprint(engine.runner, 16)[0] != key
    finally:
        engine.runner.verify_graphs.sizes = sizes
    # So is another limit of the fused small-batch projections (the cost of one- and two-token steps changes).
    limit = engine.runner.target.linear_rows
    try:
        engine.runner.target.linear_rows = 0
        assert fingerprint(engine.runner, 16)[0] != key
    finally:
        engine.runner.target.linear_rows = limit


def test_fingerprint_follows_the_drafters_shape_not_its_calibration(models):
    """A recalibrated drafter (new STS temperatures and biases) costs what it cost: same key, so a served drafter
    that was only recalibrated starts without re-profiling. Another kind of calibration (beta's log-weights add ops
    to the draft stage) or another shape (more layers) is another key."""
    import dataclasses

    target, drafter = models
    engine = _engine(models)
    key = fingerprint(engine.runner, 16)[0]
    config = drafter.config
    try:
        drafter.config = dataclasses.replace(config, sts_temperatures={"greedy": [0.7] * GAMMA},
                                             sts_biases={"greedy": [0.1] * GAMMA})
        calibrated = fingerprint(engine.runner, 16)[0]
        drafter.config = dataclasses.replace(config, sts_temperatures={"greedy": [1.3] * GAMMA},
                                             sts_biases={"greedy": [-0.2] * GAMMA})
        assert fingerprint(engine.runner, 16)[0] == calibrated != key
        drafter.config = dataclasses.replace(config, sts_temperatures={"greedy": [1.3] * GAMMA},
                                             sts_biases={"greedy": [-0.2] * GAMMA},
                                             sts_log_weights={"greedy": [0.5] * GAMMA})
        assert fingerprint(engine.runner, 16)[0] != calibrated
        drafter.config = dataclasses.replace(config, num_layers=config.num_layers + 1)
        assert fingerprint(engine.runner, 16)[0] != key
    finally:
        drafter.config = config


def test_recheck_detects_a_stale_table(models, tmp_path, monkeypatch):
    engine = _engine(models)
    table = cached_profile(engine.runner, cache_dir=tmp_path, context_len=16, repeats=1, recheck=False, progress=False)
    path = next(tmp_path.glob("*.json"))
    # A table measured on a 100× slower machine: far outside any timing noise, so the re-check must reject it.
    stale = CostTable({n: v * 100 for n, v in table.verify_ms.items()}, table.draft_ms, table.graph_max_tokens,
                      table.hardware, table.meta)
    stale.save(path)
    calls = []
    monkeypatch.setattr(cost_model, "profile_engine", lambda *a, **k: calls.append(1) or table)
    fresh = cached_profile(engine.runner, cache_dir=tmp_path, context_len=16, repeats=1, progress=False)
    assert calls == [1] and fresh.verify_ms == table.verify_ms
    assert CostTable.load(path).verify_ms == table.verify_ms  # the stale file was replaced


@pytest.fixture
def cached_table(models, tmp_path, monkeypatch):
    """(engine, cached table, re-check on load) with the re-check's clock scripted: ``recheck(clock)`` loads the table
    through ``cached_profile`` while each timed verify of ``n`` tokens reads ``clock(n, i) ×`` the cached time (``i``
    counts the calls), and returns whether it re-profiled. No pauses between rounds."""
    engine = _engine(models)
    table = cached_profile(engine.runner, cache_dir=tmp_path, context_len=16, repeats=1, recheck=False, progress=False)
    monkeypatch.setattr(cost_model, "RECHECK_PAUSE_S", 0.0)

    def recheck(clock) -> bool:
        calls, profiled = [], []

        def timed(runner, n, context_len, depth, marginal=False):
            calls.append(n)
            return table.verify_ms[n] * clock(n, len(calls) - 1)

        with monkeypatch.context() as m:
            m.setattr(cost_model, "time_verify", timed)
            m.setattr(cost_model, "profile_engine", lambda *a, **k: profiled.append(1) or table)
            cached_profile(engine.runner, cache_dir=tmp_path, context_len=16, repeats=1, progress=False)
        assert calls, "the cached table was not re-checked"
        return bool(profiled)

    return engine, table, recheck


def test_recheck_keeps_the_table_through_noise(cached_table):
    """A busy host at start-up does not re-profile: an outlier call in every round (the median of three hides it),
    one slow round that the next round clears, and rounds beyond the tolerance but scattered (load, not a steady new
    cost) or on both sides all keep the cached table (CPU tolerance: a factor of 2). Calls 0-2 are the smallest
    size's first round."""
    _, table, recheck = cached_table
    small = min(table.verify_ms)
    assert not recheck(lambda n, i: 1.0)
    assert not recheck(lambda n, i: 10.0 if i % 3 == 1 else 1.0)  # one call of every round 10× slow
    assert not recheck(lambda n, i: 3.0 if i < 3 else 1.0)  # verify(smallest): one round 3× slow, then on time
    assert not recheck(lambda n, i: (3.0, 3.0, 3.0, 6.0, 6.0, 6.0, 3.0, 3.0, 3.0)[i] if n == small else 1.0)
    assert not recheck(lambda n, i: (3.0, 3.0, 3.0, 0.3, 0.3, 0.3, 3.0, 3.0, 3.0)[i] if n == small else 1.0)


def test_recheck_reprofiles_a_steady_drift(cached_table):
    """A drift that every round reads alike, slower or faster, in one size or both, re-profiles, and so do rounds all
    faster than the table however they scatter. In the third case the smallest size passes in calls 0-2, and the
    largest size's rounds are calls 3-5, 6-8, 9-11."""
    _, table, recheck = cached_table
    large = max(table.verify_ms)
    assert recheck(lambda n, i: 3.0)
    assert recheck(lambda n, i: 0.3)
    assert recheck(lambda n, i: (3.0, 3.6, 2.7)[(i - 3) // 3] if n == large else 1.0)  # rounds agree within 1.5×
    # Every round far faster than the table, scattered (a busy host's noise on top of a table from a slower machine):
    # load never speeds a call up, so this is drift all the same.
    assert recheck(lambda n, i: (0.01, 0.03, 0.005)[i // 3])


def test_profile_engine_cost_table_entry_point(models, tmp_path):
    target, drafter = models
    table = profile_engine_cost_table(target, drafter, max_num_seqs=2, device="cpu", dtype=torch.float32,
                                      context_len=8, repeats=1, cache_dir=tmp_path)
    assert max(table.verify_ms) == 2 * (GAMMA + 1) and sorted(table.draft_ms) == [1, 2]
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_profiling_refuses_a_busy_engine(models):
    engine = _engine(models)
    engine.add_request([3, 4], None)
    engine.step()  # the request now holds a slot
    with pytest.raises(RuntimeError, match="idle"):
        profile_engine(engine.runner, progress=False)


def test_dummy_verify_checks_its_layout(models):
    runner = _engine(models).runner
    runner.dummy_verify(5, 8, num_requests=1)  # one request, its anchor and 4 drafts
    with pytest.raises(ValueError, match="carry"):
        runner.dummy_verify(6, 8, num_requests=1)  # more than γ + 1 tokens for one request
    with pytest.raises(ValueError, match="carry"):
        runner.dummy_verify(1, 8, num_requests=2)  # fewer tokens than requests
    with pytest.raises(ValueError, match="num_requests"):
        runner.dummy_verify(5, 8, num_requests=5)  # more requests than slots


def test_prepared_dummy_stages_run_only_when_called(models):
    """The profile times the returned stage alone: preparing places the placeholders (anchors at the context
    length), and only calling the stage verifies (the anchors advance) or drafts (the survivals are written)."""
    runner = _engine(models).runner
    verify = runner.prepare_dummy_verify(4 * (GAMMA + 1), 8)  # 4 placeholder requests, every draft verified
    assert runner.anchor_pos[:4].tolist() == [8] * 4
    verify()
    assert all(p > 8 for p in runner.anchor_pos[:4].tolist())
    draft = runner.prepare_dummy_draft(3, 8)
    runner.survival[:3] = -1.0
    draft()
    assert ((runner.survival[:3] >= 0) & (runner.survival[:3] <= 1)).all()


def test_pipelined_engine_is_priced_back_to_back(models):
    """An engine one step ahead of its reads (``async_decode``) gets a table of stages launched back to back
    (``PIPELINE_DEPTH`` a sample, the price per stage), fingerprinted apart from the launch-to-read table."""
    target, drafter = models
    cfg = EngineConfig(max_num_seqs=2, max_seq_len=64, kernel_backend="torch", async_decode=True)
    engine = Engine(target, drafter, cfg, SchedulerConfig(mode="fixed", k=GAMMA))
    assert engine.runner.pipelined and engine.pipelining["async_decode"]
    table = profile_engine(engine.runner, context_len=8, repeats=1, warmup=0, max_sizes=2, progress=False)
    assert table.meta["pipelined"] and table.meta["steps_per_call"] == cost_model.PIPELINE_DEPTH
    assert table.meta["marginal"], "priced at what one more stage adds, not the call divided"
    assert fingerprint(engine.runner, 8)[0] != fingerprint(_engine(models, max_num_seqs=2).runner, 8)[0]
    runner = engine.runner
    stage = runner.prepare_dummy_verify(2 * (GAMMA + 1), 8, repeat=cost_model.PIPELINE_DEPTH)
    stage()  # four verifies, every draft: the anchors moved on by what each emitted
    assert all(8 + cost_model.PIPELINE_DEPTH <= p <= 8 + cost_model.PIPELINE_DEPTH * (GAMMA + 1)
               for p in runner.anchor_pos[:2].tolist())
    with pytest.raises(ValueError, match="do not fit"):
        runner.prepare_dummy_verify(2, 60, repeat=cost_model.PIPELINE_DEPTH)
    one = runner.prepare_dummy_verify(2, 8, repeat=cost_model.PIPELINE_DEPTH)
    one(1)  # a single launch of a stage prepared for four: one verify, one token each
    assert runner.anchor_pos[:2].tolist() == [9, 9]
    with pytest.raises(ValueError, match="prepared for"):
        one(cost_model.PIPELINE_DEPTH + 1)
    assert cost_model.time_verify(runner, 2, 8, cost_model.PIPELINE_DEPTH, marginal=True) > 0
