"""Tests of reference/cost_model.py: monotone curves, the staircase, the cliff, JSON, and profiling."""

from __future__ import annotations

import json
import math

import pytest

from reference import cost_model
from reference.cost_model import CostTable, default_bucket_sizes, measure_cost_table

# Table values are small decimal numbers and the code divides by 1e3 once, so float64 results agree
# with the hand-computed ones to a few ulps; 1e-12 relative leaves room for that and nothing else.
REL = 1e-12


def test_monotone_is_a_running_max():
    table = CostTable({1: 5.0, 2: 4.0, 4: 6.0, 8: 5.5, 16: 7.0}, {1: 2.0, 2: 1.0, 4: 3.0})
    mono = table.monotone()
    assert mono.verify_ms == {1: 5.0, 2: 5.0, 4: 6.0, 8: 6.0, 16: 7.0}
    assert mono.draft_ms == {1: 2.0, 2: 2.0, 4: 3.0}
    assert table.verify_ms[2] == 4.0  # the original is not modified
    times = [mono.step_time(n, r) for n in range(1, 30) for r in (1, 2, 3, 4)]
    assert all(math.isfinite(t) for t in times)
    for r in (1, 2, 3, 4):
        curve = [mono.step_time(n, r) for n in range(0, 40)]
        assert all(b >= a for a, b in zip(curve, curve[1:]))


def test_staircase_pads_to_the_next_graph():
    table = CostTable({n: float(n) for n in default_bucket_sizes(256)}, {})
    assert table.padded_tokens(121) == 128
    assert table.verify_time(121) == pytest.approx(table.verify_time(128), rel=REL)
    assert table.verify_time(121) == pytest.approx(0.128, rel=REL)
    assert table.padded_tokens(128) == 128 and table.padded_tokens(3) == 4 and table.padded_tokens(0) == 0
    assert table.verify_time(0) == 0.0
    assert table.padded_tokens(257) == 257  # no separate eager regime: beyond the table runs unpadded


def test_draft_staircase_and_zero_requests():
    table = CostTable({1: 1.0}, {1: 0.9, 4: 1.5, 16: 3.0})
    assert table.draft_time(0) == 0.0
    assert table.draft_time(1) == pytest.approx(0.9e-3, rel=REL)
    assert table.draft_time(3) == pytest.approx(1.5e-3, rel=REL)
    assert table.draft_time(5) == pytest.approx(3.0e-3, rel=REL)
    # above 16: the line through (4, 1.5) and (16, 3.0), slope 0.125 ms per request
    assert table.draft_time(24) == pytest.approx(4.0e-3, rel=REL)
    assert table.step_time(1, 3) == pytest.approx(1e-3 + 1.5e-3, rel=REL)
    assert table.sps(1, 3) == pytest.approx(1 / 2.5e-3, rel=REL)
    assert CostTable({1: 1.0}, {}).draft_time(7) == 0.0  # drafter not modelled
    with pytest.raises(ValueError, match="SPS undefined"):
        CostTable({1: 1.0}, {}).sps(0, 0)


def test_extrapolation_above_the_graphs_uses_only_eager_points():
    # Shaped like vLLM's published profile: a gentle graph staircase, then a cliff past the last graph.
    table = CostTable({1: 5.0, 128: 9.5, 1024: 20.6, 1100: 104.0, 1200: 110.0, 1400: 118.0}, {},
                      graph_max_tokens=1024)
    assert table.verify_time(1000) == pytest.approx(20.6e-3, rel=REL)  # staircase inside the graphs
    assert table.padded_tokens(1000) == 1024 and table.padded_tokens(1150) == 1150
    assert table.verify_time(1150) == pytest.approx(107.0e-3, rel=REL)  # between eager points only
    assert table.verify_time(1300) == pytest.approx(114.0e-3, rel=REL)
    assert table.verify_time(1600) == pytest.approx(126.0e-3, rel=REL)  # last eager segment, 0.04 ms/token
    # Just past the cliff: the eager line extended down (104 - 0.06·75 = 99.5), not a line from 1024's 20.6.
    assert table.verify_time(1025) == pytest.approx(99.5e-3, rel=REL)
    # The same points with no cliff declared: everything is staircase, then the top segment extends.
    flat = CostTable(dict(table.verify_ms), {})
    assert flat.verify_time(1150) == pytest.approx(110.0e-3, rel=REL)
    assert flat.verify_time(1600) == pytest.approx(126.0e-3, rel=REL)


def test_eager_region_needs_measured_points():
    table = CostTable({1: 5.0, 8: 6.0}, {}, graph_max_tokens=8)
    with pytest.raises(ValueError, match="exceed graph_max_tokens=8"):
        table.verify_time(9)
    with pytest.raises(ValueError, match="at least two sizes"):
        CostTable({4: 5.0}, {}).verify_time(5)


def test_affine_table():
    smooth = CostTable.affine(2.0, 0.5, draft_fixed_ms=1.0, draft_per_request_ms=0.25, sizes=range(1, 9))
    assert "synthetic" in smooth.hardware
    for n in range(1, 20):  # exact inside, and the top-segment extension of a line is the same line
        assert smooth.verify_time(n) == pytest.approx((2.0 + 0.5 * n) / 1e3, rel=REL)
    assert smooth.draft_time(3) == pytest.approx(1.75e-3, rel=REL)
    bucketed = CostTable.affine(2.0, 0.5)
    assert bucketed.verify_time(121) == pytest.approx((2.0 + 0.5 * 128) / 1e3, rel=REL)
    assert bucketed.draft_ms == {}


def test_json_round_trip(tmp_path):
    table = CostTable({1: 5.0, 8: 6.5, 16: 30.0, 32: 40.0}, {1: 0.9, 8: 1.2}, graph_max_tokens=8,
                      hardware="NVIDIA H200", meta={"model": "SmolLM2-135M", "context": 1024})
    path = tmp_path / "cost.json"
    table.save(path)
    loaded = CostTable.load(path)
    assert loaded == table
    assert loaded.verify_time(20) == table.verify_time(20)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["verify_ms"].update({"12x": 1.0}), "verify_ms key '12x' is not an integer"),
    (lambda d: d["verify_ms"].update({"12": -1.0}), r"verify_ms\[12\] = -1.0 is not a positive finite"),
    (lambda d: d["draft_ms"].update({"2": "fast"}), r"draft_ms\[2\] = 'fast' is not a positive finite"),
    (lambda d: d["verify_ms"].update({"0": 1.0}), "verify_ms key 0 is not a positive integer"),
    (lambda d: d.update({"graph_max_tokens": 12}), "graph_max_tokens=12 is not a measured size"),
    (lambda d: d.update({"verify_ms": {}}), "verify_ms is empty"),
    (lambda d: d.update({"format": "something-else"}), "format is 'something-else'"),
    (lambda d: d.update({"extra": 1}), r"unknown fields \['extra'\]"),
    (lambda d: d.pop("draft_ms"), "draft_ms must be an object"),
])
def test_bad_json_is_rejected_with_a_clear_message(tmp_path, mutate, message):
    d = CostTable({1: 5.0, 8: 6.0}, {1: 1.0}, graph_max_tokens=8).to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message) as info:
        CostTable.load(path)
    assert "bad.json" in str(info.value)


def test_unparsable_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        CostTable.load(path)


def test_default_bucket_sizes():
    sizes = default_bucket_sizes(8 * 64)  # (γ+1)·max_num_seqs with γ = 7, 64 requests
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))
    assert all(s % 8 == 0 for s in sizes[3:]) and all(s % 16 == 0 for s in sizes if s >= 256)
    assert default_bucket_sizes(100)[-1] == 100 and default_bucket_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError):
        default_bucket_sizes(0)


def test_measure_cost_table_takes_medians_with_a_fake_clock(monkeypatch):
    """A fake clock advanced only by the callables: the i-th timed call of size n costs n + noise[i] ms."""
    clock = [0.0]
    noise = [0.0, 3.0, -0.5, 0.25, 50.0]  # one large outlier per size: the median (0.25) must ignore it
    calls: dict[tuple[str, int], int] = {}
    warmup = 2

    def fake_fn(kind, base):
        def run(size):
            i = calls.get((kind, size), 0)
            calls[(kind, size)] = i + 1
            timed = i - warmup
            clock[0] += (base(size) + (noise[timed] if timed >= 0 else 1000.0)) / 1e3
        return run

    syncs = []
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    table = measure_cost_table(fake_fn("v", lambda n: 10.0 + n), fake_fn("d", lambda r: 1.0 + r),
                               [1, 2, 4, 8], [1, 3], repeats=5, warmup=warmup,
                               synchronize=lambda: syncs.append(1), hardware="fake", progress=False)
    assert table.verify_ms == pytest.approx({n: 10.25 + n for n in (1, 2, 4, 8)}, rel=1e-9)
    assert table.draft_ms == pytest.approx({1: 2.25, 3: 4.25}, rel=1e-9)
    assert all(c == warmup + 5 for c in calls.values())
    assert len(syncs) == 2 * 5 * 6  # before and after every timed call
    assert table.hardware == "fake"


def test_measure_cost_table_times_only_the_step_a_preparation_returns(monkeypatch):
    """A function that returns a callable has prepared the step (placeholders into their slots, once per request at
    admission in serving): its own time stays out of the table, and the returned step runs once per call."""
    clock, steps = [0.0], []

    def prepare(cost_of_setup, cost_of_step):
        def fn(size):
            clock[0] += cost_of_setup(size) / 1e3  # e.g. per-request slot writes: not a cost of the step

            def step():
                steps.append(size)
                clock[0] += cost_of_step(size) / 1e3
            return step
        return fn

    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    table = measure_cost_table(prepare(lambda n: 100.0 * n, lambda n: 2.0 + n),
                               prepare(lambda r: 50.0 * r, lambda r: 1.0),
                               [1, 8], [1, 4], repeats=3, warmup=1, progress=False)
    assert table.verify_ms == pytest.approx({1: 3.0, 8: 10.0}, rel=1e-9)
    assert table.draft_ms == pytest.approx({1: 1.0, 4: 1.0}, rel=1e-9)
    assert sorted(steps) == sorted([1] * 4 + [8] * 4 + [1] * 4 + [4] * 4)  # warm-up + timed, each step run once


def test_measure_cost_table_marginal_leaves_the_pipelines_fill_out(monkeypatch):
    """Steps launched back to back cost a fixed fill and drain per call plus the steady price per step: divided over
    the call's steps, the fill is charged to every step (most to the cheapest); ``marginal`` prices the steady step
    alone, from the call run once and ``steps_per_call`` times."""
    clock, runs = [0.0], []
    fill = 1.0  # ms a call pays whatever its length

    def prepare(per_step):
        def fn(size):
            def step(steps=4):
                runs.append(steps)
                clock[0] += (fill + steps * per_step(size)) / 1e3
            return step
        return fn

    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    kwargs = dict(repeats=3, warmup=1, progress=False, steps_per_call=4)
    divided = measure_cost_table(prepare(lambda n: 1.0 + 0.1 * n), prepare(lambda r: 0.5), [1, 8], [1], **kwargs)
    assert divided.verify_ms == pytest.approx({1: 1.35, 8: 2.05}, rel=1e-9)  # 1.1 and 1.8, each + fill / 4
    assert divided.meta["marginal"] is False
    runs.clear()
    table = measure_cost_table(prepare(lambda n: 1.0 + 0.1 * n), prepare(lambda r: 0.5), [1, 8], [1],
                               marginal=True, **kwargs)
    assert table.verify_ms == pytest.approx({1: 1.1, 8: 1.8}, rel=1e-9)
    assert table.draft_ms == pytest.approx({1: 0.5}, rel=1e-9)
    assert table.meta["marginal"] is True and table.meta["steps_per_call"] == 4
    assert sorted(set(runs)) == [1, 4] and runs.count(1) == 3 * 3  # each timed sample: once, then four
    # one step per call: nothing to difference, the call's time is the price
    single = measure_cost_table(prepare(lambda n: 1.0), lambda r: None, [1], [], repeats=1, warmup=0,
                                progress=False, marginal=True)
    assert single.verify_ms == pytest.approx({1: 5.0}) and single.meta["marginal"] is False


def test_measure_cost_table_forces_monotone(monkeypatch):
    clock = [0.0]
    cost = {1: 5.0, 2: 4.0, 4: 6.0}

    def verify(n):
        clock[0] += cost[n] / 1e3

    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    table = measure_cost_table(verify, lambda r: None, [1, 2, 4], [], repeats=3, warmup=0, progress=False)
    assert table.verify_ms == pytest.approx({1: 5.0, 2: 5.0, 4: 6.0}, rel=1e-9)
    assert table.draft_ms == {}


# ---------------------------------------------------------------------------------------------------------------
# Verify cost keyed by request count too
# ---------------------------------------------------------------------------------------------------------------


def _two_axis() -> CostTable:
    # The H200's batch-1 shape: 8 one-token requests cost 2.61 ms, 8 tokens of one request hardly more than 1 token.
    return CostTable(verify_ms={1: 1.95, 2: 2.11, 4: 2.41, 8: 2.61, 16: 3.10, 32: 3.49},
                     draft_ms={1: 0.56, 4: 0.60},
                     verify_ms_by_requests={1: {1: 1.95, 2: 1.96, 4: 1.97, 8: 1.99}, 4: {4: 2.41, 8: 2.45, 32: 2.60}})


def test_request_curves_are_read_for_the_smallest_request_count_at_or_above():
    t = _two_axis()
    assert t.verify_time(8) == pytest.approx(2.61e-3, rel=REL)  # no request count: the token curve
    assert t.verify_time(8, 1) == pytest.approx(1.99e-3, rel=REL)  # one request carries the 8 tokens
    assert t.verify_time(3, 1) == pytest.approx(1.97e-3, rel=REL)  # staircase within the curve
    assert t.verify_time(6, 2) == pytest.approx(2.45e-3, rel=REL)  # 2 requests: the 4-request curve bounds them
    assert t.verify_time(9, 1) == pytest.approx(3.10e-3, rel=REL)  # past the curve's sizes: the token curve
    assert t.verify_time(16, 5) == pytest.approx(3.10e-3, rel=REL)  # more requests than any curve: the token curve
    assert t.step_time(8, 1) == pytest.approx((1.99 + 0.56) / 1e3, rel=REL)
    assert t.verify_time(0, 1) == 0.0


def test_request_curves_change_the_batch_one_budget():
    """Priced as eight one-token requests, a batch-1 step verifies a short prefix; priced as what it is, one
    request's eight tokens, the full block pays (the case the H200 profile showed)."""
    import torch

    from reference.scheduler import best_budget

    # Prefix survivals of the shipped drafter's measured per-slot acceptance (0.40, 0.34, 0.34, 0.38, 0.52, ...).
    a = torch.cumprod(torch.tensor([[0.40, 0.34, 0.34, 0.38, 0.52, 0.67, 0.68]]), dim=1)
    tokens_only = CostTable(_two_axis().verify_ms, _two_axis().draft_ms)
    assert best_budget(a, tokens_only, 1) < 7
    assert best_budget(a, _two_axis(), 1) == 7


def test_request_curves_round_trip_validate_and_go_monotone(tmp_path):
    t = _two_axis()
    t.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json").verify_ms_by_requests == t.verify_ms_by_requests
    old = t.to_dict()
    old["format"] = "dspark-cost-table/1"
    del old["verify_ms_by_requests"]
    assert CostTable.from_dict(old).verify_ms_by_requests == {}  # tables of the first format still load
    old["verify_ms_by_requests"] = {}
    with pytest.raises(ValueError, match="unknown fields"):
        CostTable.from_dict(old)
    with pytest.raises(ValueError, match="token counts ≥ 4"):
        CostTable({1: 1.0}, {}, verify_ms_by_requests={4: {2: 1.0, 8: 2.0}})
    with pytest.raises(ValueError, match="positive integers"):
        CostTable({1: 1.0}, {}, verify_ms_by_requests={0: {1: 1.0}})
    noisy = CostTable({1: 1.0}, {}, verify_ms_by_requests={2: {2: 1.0, 4: 0.9, 8: 1.2}}).monotone()
    assert noisy.verify_ms_by_requests == {2: {2: 1.0, 4: 1.0, 8: 1.2}}


def test_measure_fills_request_curves():
    from reference.cost_model import measure_cost_table

    calls = []
    t = measure_cost_table(lambda n: None, lambda r: None, [1, 8], [1], repeats=1, warmup=0, progress=False,
                           verify_requests_fn=lambda r, n: calls.append((r, n)), tokens_by_requests={1: [1, 8], 2: [2]})
    assert sorted(t.verify_ms_by_requests) == [1, 2] and sorted(t.verify_ms_by_requests[1]) == [1, 8]
    assert calls == [(1, 1), (1, 8), (2, 2)]
