"""The benchmark scripts end to end on the CPU: ``scripts/bench_engine.py`` and ``scripts/bench_kernels.py``.

A tiny random target and drafter stand in for SmolLM2 (no download). The engine benchmark must write its
JSON schema and its plot, emit exactly the requested tokens in every configuration, and stop cleanly on its time
budget; the kernel benchmark must cover every op, and under the Triton interpreter its two backends must agree.
Names follow ``docs/method.md`` (``τ`` emitted tokens per verify step, ``ℓ`` verify length).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimized.engine import Engine, EngineConfig
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import bench_engine, bench_host, bench_kernels
from scripts.benchmarking import parse_config, parse_mode

ROOT = Path(__file__).resolve().parents[2]

GAMMA = 4
PROMPTS = [[5, 6, 7, 8], [9, 2], [3, 3, 4, 10, 11, 12]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    return target, tiny_drafter(target, gamma=GAMMA, markov_rank=8)


def _run(models, tmp_path, *extra):
    target, drafter = models
    out = tmp_path / "engine-test.json"
    argv = ["--batch-sizes", "1,2", "--modes", "none,fixed:2,adaptive", "--max-new-tokens", "10", "--warmup", "0",
            "--repeats", "1", "--context-len", "16", "--cost-cache-dir", str(tmp_path / "cost"), "--out", str(out),
            *extra]
    report = bench_engine.main(argv, target=target, drafter=drafter, prompt_ids=PROMPTS)
    return report, out


def test_bench_engine_writes_the_schema_and_plot(models, tmp_path):
    report, out = _run(models, tmp_path)
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(report))
    for key in ("hardware", "command", "model", "drafter", "results"):
        assert key in on_disk, key
    assert on_disk["complete"] is True and on_disk["model"] == "tiny-llama"
    assert "--batch-sizes 1,2" in on_disk["command"]
    rows = {(r["engine"], r["label"], r["batch_size"]): r for r in on_disk["results"]}
    expected = {("optimized", m, b) for m in ("none", "fixed:2", "adaptive") for b in (1, 2)} | {
        ("hf", "hf", b) for b in (1, 2)}
    assert set(rows) == expected
    for (engine, label, b), r in rows.items():
        for key in ("mode", "k", "output_tokens_per_s", "mean_accepted_length"):
            assert key in r, (label, key)
        assert r["output_tokens_per_s"] > 0
        assert r["tokens"] == b * 10, "every request emits exactly --max-new-tokens (EOS ignored)"
        if engine == "optimized":
            assert 0.0 <= r["host_schedule_fraction"] < 1.0 and r["engine_steps"] > 0
    # No speculation: one token per verify step; fixed K = 2 verifies exactly 2 drafts and emits 1..3 per step.
    assert rows[("optimized", "none", 2)]["mean_accepted_length"] == 1.0
    assert rows[("optimized", "none", 2)]["k"] == 0
    fixed = rows[("optimized", "fixed:2", 2)]
    assert fixed["mean_verify_length"] == 2.0 and fixed["k"] == 2
    assert 1.0 <= fixed["mean_accepted_length"] <= 3.0
    # The measured SPS table travels with the results and is a valid, monotone cost table of this engine.
    table = CostTable.from_dict(on_disk["cost_table"])
    assert max(table.verify_ms) == 2 * (GAMMA + 1) and sorted(table.draft_ms) == [1, 2]
    assert on_disk["summary"]["1"]["adaptive_over_none"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_bench_engine_one_step_ahead_variants(models, tmp_path):
    """``+async`` on plain decoding and on the DSpark modes planned without the step's outcome: an engine one step
    ahead of its reads, the drafting one with its own (pipelined) cost table; the summary names adaptive's best
    variant against the best other mode. '+async' on a synchronous policy is refused."""
    report, out = _run(models, tmp_path, "--modes", "none,none+async,fixed:2+async,adaptive,adaptive+async",
                       "--hf-max-batch", "0")
    labels = {(r["label"], r["batch_size"]) for r in report["results"]}
    assert {("fixed:2+async", 2), ("adaptive+async", 1)} <= labels
    assert CostTable.from_dict(report["cost_table_async"]).meta["pipelined"] is True
    assert report["cost_table"]["meta"]["pipelined"] is False
    summary = report["summary"]["2"]
    assert summary["best_adaptive"] in ("adaptive", "adaptive+async") and summary["best_other"] != "hf"
    assert summary["best_adaptive_over_best_other"] > 0
    with pytest.raises(ValueError, match="one ahead"):
        bench_engine.BenchConfig(modes=["threshold+async"])


def test_bench_engine_gate_trace_summarises_the_gates_estimates(models, tmp_path):
    """--gate-trace: adaptive rows say how often the draft gate evaluated and drafted, and by batch size the
    quartiles of best Θ over Θ_plain (the planner's own numbers) and the margin; other rows carry nothing."""
    report, _ = _run(models, tmp_path, "--gate-trace", "--hf-max-batch", "0", "--cost-feedback")
    rows = {(r["label"], r["batch_size"]): r for r in report["results"]}
    assert all("gate_trace_summary" not in rows[(m, b)] for m in ("none", "fixed:2") for b in (1, 2))
    # With --cost-feedback, the rows of an engine with a cost table also list the steps its monitor measured.
    samples = rows[("fixed:2", 2)]["cost_samples"]
    assert samples and sum(s["samples"] for s in samples) > 0
    for s in samples:
        assert s["kind"] in ("plain", "speculative") and s["before"] in ("idle", "plain", "speculative")
        assert s["measured_ms"] > 0 and s["price_ms"] > 0 and s["bucket"] in (1, 2)
    trace = rows[("adaptive", 2)]["gate_trace_summary"]
    assert trace["evaluations"] > 0 and 0 <= trace["drafted"] <= trace["evaluations"]
    for bucket, row in trace["by_batch"].items():
        assert int(bucket) in (1, 2) and row["evaluations"] > 0
        assert row["margin"] == pytest.approx(0.3 / int(bucket) ** 0.5, abs=1e-4)  # R = bucket here (powers of 2)
        q1, q2, q3 = row["best_over_plain_quartiles"]
        assert 0 < q1 <= q2 <= q3
    # The estimates are the planner's: its verdict is (1 + margin) · best ≥ plain.
    engine_gate = bench_engine.gate_trace_summary([(4, 1.0, 1.2, 0.15, False), (4, 1.5, 1.2, 0.15, True)])
    assert engine_gate["by_batch"]["4"]["best_over_plain_quartiles"] == [pytest.approx(1 / 1.2, rel=1e-3), 1.25, 1.25]
    assert engine_gate["drafted"] == 1 and engine_gate["evaluations"] == 2
    # adaptive:finish runs the finish-time gate (its rows carry its estimates, finish_trace_summary's format below;
    # these short answers end before every request has drafted the gate's window of times, so it may have none);
    # plain adaptive rows never do.
    finished, _ = _run(models, tmp_path, "--gate-trace", "--hf-max-batch", "0", "--modes",
                       "none,adaptive,adaptive:finish")
    frows = {(r["label"], r["batch_size"]): r for r in finished["results"]}
    assert all("finish_trace" not in frows[(m, b)] for m in ("none", "adaptive") for b in (1, 2))
    assert all("finish_trace" in frows[("adaptive:finish", b)] for b in (1, 2))
    from reference.scheduler import FinishEstimate

    finish = bench_engine.finish_trace_summary([(2, FinishEstimate(0.3, 0.2, 40.0, 60), 0.2, False),
                                                 (1, FinishEstimate(0.1, 0.2, 20.0, 30), 0.3, True)])
    assert finish["evaluations"] == 2 and finish["drafted"] == 1
    assert finish["estimates"][0] == {"requests": 2, "speculative_over_plain": 1.5, "speculative_steps": 40.0,
                                      "plain_steps": 60, "margin": 0.2, "drafted": False}
    assert finished["summary"]["2"]["best_adaptive"] in ("adaptive", "adaptive:finish")
    # And every drafting row the forecast: drafts expected to be accepted (the survivals planned with) and accepted.
    assert all("forecast" not in rows[("none", b)] for b in (1, 2))
    for b in (1, 2):
        for label in ("fixed:2", "adaptive"):
            for bucket, f in rows[(label, b)]["forecast"].items():
                assert int(bucket) <= b and f["request_steps"] > 0
                assert 0 < f["expected_accepted_per_request"] <= f["verified_per_request"] <= GAMMA
                assert 0 <= f["accepted_per_request"] <= f["verified_per_request"]
        assert {f["verified_per_request"] for f in rows[("fixed:2", b)]["forecast"].values()} == {2.0}


def test_forecast_adds_each_requests_survivals_against_its_accepted_drafts():
    from optimized.sequence import StepStats

    def stats(verified, accepted, survival):
        return StepStats(step_time_s=0.0, num_running=len(verified), num_waiting=0, num_decoding=len(verified),
                         verify_tokens=len(verified) + sum(verified), budget=None, drafted=True, verified=verified,
                         accepted=accepted, predicted_survival=survival, request_ids=list(range(len(verified))))

    forecast: dict = {}
    bench_engine.add_forecast(forecast, stats([2, 3, 0], [1, 3, 0], [[0.9, 0.5], [0.8, 0.6, 0.4], []]))
    bench_engine.add_forecast(forecast, stats([], [], []))  # a step that verified nothing
    bench_engine.add_forecast(forecast, None)  # before the first step
    bench_engine.add_forecast(forecast, stats([1], [0], [[0.5]]))  # one request: its own bucket
    assert forecast[4] == pytest.approx([3.2, 4, 5, 2]) and forecast[1] == pytest.approx([0.5, 0, 1, 1])
    summary = bench_engine.forecast_summary(forecast)
    assert summary["4"] == {"request_steps": 2, "verified_per_request": 2.5, "expected_accepted_per_request": 1.6,
                            "accepted_per_request": 2.0, "accepted_over_expected": 1.25}
    assert summary["1"]["accepted_over_expected"] == 0.0


def test_bench_engine_feedback_runs_the_engines_as_the_server_does(models, tmp_path):
    """--cost-feedback: every engine keeps its step prices true (EngineConfig.cost_feedback); drafting rows record
    where the drift and the price scales ended up. --acceptance-feedback likewise for the survivals."""
    report, _ = _run(models, tmp_path, "--cost-feedback", "--acceptance-feedback", "--hf-max-batch", "0", "--modes",
                     "none,adaptive")
    assert report["settings"]["cost_feedback"] is True and report["settings"]["acceptance_feedback"] is True
    row = next(r for r in report["results"] if r["label"] == "adaptive" and r["batch_size"] == 2)
    assert set(row["cost_drift"]) == {"plain", "speculative"} and set(row["price_scales"]) == {"plain", "speculative"}
    assert all(v > 0 for v in row["price_scales"].values())
    assert all(int(b) >= 1 and all(v > 0 for v in kinds.values()) for b, kinds in row["price_scales_by_batch"].items())
    # --acceptance-feedback: drafting rows say which survival factors the planner ended with (None: too few trials)
    plain = next(r for r in report["results"] if r["label"] == "none")
    assert "survival_scale" in row and "survival_scale" not in plain
    assert row["survival_scale"] is None or (len(row["survival_scale"]) == GAMMA
                                             and all(0.5 <= x <= 1.5 for x in row["survival_scale"]))


def test_bench_engine_time_budget_leaves_partial_results(models, tmp_path):
    report, out = _run(models, tmp_path, "--time-budget-s", "0", "--hf-max-batch", "0")
    on_disk = json.loads(out.read_text())
    assert on_disk["complete"] is False and "time budget" in on_disk["stopped_early"]
    assert on_disk["results"] == [] and "cost_table" in on_disk


def test_bench_engine_ngram_modes_without_a_drafter(models, tmp_path):
    """``ngram:`` modes run the n-gram proposer's engine beside plain decoding; no drafter, no cost table needed."""
    target, _ = models
    out = tmp_path / "engine-ngram.json"
    argv = ["--batch-sizes", "2", "--modes", "none,ngram:fixed:2,ngram:fixed,ngram:dsd", "--ngram-gamma", "3",
            "--max-new-tokens", "10", "--warmup", "0", "--repeats", "1", "--hf-max-batch", "0", "--out", str(out)]
    report = bench_engine.main(argv, target=target, drafter=None, prompt_ids=[[5, 6, 7, 5, 6], [9, 2, 9, 2]])
    rows = {r["label"]: r for r in report["results"]}
    assert set(rows) == {"none", "ngram:fixed:2", "ngram:fixed", "ngram:dsd"} and "cost_table" not in report
    assert rows["none"]["proposer"] is None and rows["ngram:fixed:2"]["proposer"] == "ngram"
    assert rows["ngram:fixed"]["k"] == 3 and rows["ngram:fixed:2"]["k"] == 2
    for label in ("ngram:fixed:2", "ngram:fixed", "ngram:dsd"):
        r = rows[label]
        assert r["tokens"] == 2 * 10
        assert 0.0 <= r["mean_verify_length"] <= (r["k"] or 3), "ℓ is clipped to k and to each proposal"
        assert 1.0 <= r["mean_accepted_length"] <= 1 + r["mean_verify_length"] + 1e-9
    assert report["summary"]["2"]["best_ngram"].startswith("ngram:")
    assert report["settings"]["ngram_gamma"] == 3


def test_bench_engine_steady_state_keeps_the_batch_full(models, tmp_path):
    """``--requests-per-slot N``: B·N requests, at most B in flight, each freed slot refilled at once; the same
    greedy tokens per prompt as a closed batch, and every request emits exactly --max-new-tokens."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(max_num_seqs=4, max_seq_len=64, seed=0),
                    SchedulerConfig(mode="fixed", k=2))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(7)]
    in_flight, step = [], engine.step

    def counting_step():
        in_flight.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()

    engine.step = counting_step
    stats = bench_engine.run_engine(engine, prompts, 6, concurrency=3)
    assert stats["tokens"] == 7 * 6 and max(in_flight) == 3
    assert in_flight.count(3) > len(in_flight) // 2, "freed slots are refilled: the batch stays full"
    steady = [engine.sequence(i).output_ids for i in range(7)]
    engine.step = step
    bench_engine.run_engine(engine, prompts, 6)  # a closed batch of all 7
    assert [engine.sequence(i).output_ids for i in range(7)] == steady

    report, _ = _run(models, tmp_path, "--requests-per-slot", "3", "--hf-max-batch", "0")
    assert report["settings"]["requests_per_slot"] == 3
    for r in report["results"]:
        assert r["tokens"] == 3 * r["batch_size"] * 10
        assert r["per_request_tokens_per_s"] == r["output_tokens_per_s"] / r["batch_size"]
    with pytest.raises(SystemExit):
        _run(models, tmp_path, "--requests-per-slot", "zero")
    with pytest.raises(ValueError, match="requests_per_slot"):
        bench_engine.BenchConfig(requests_per_slot=0)


def test_bench_engine_min_requests_raises_every_batch_size_to_that_many_requests(models, tmp_path):
    """``--min-requests M``: batch 1 runs M different prompts one after another instead of one prompt; a batch size
    whose workload is already larger keeps it."""
    report, _ = _run(models, tmp_path, "--min-requests", "3", "--hf-max-batch", "0")
    assert report["settings"]["min_requests"] == 3
    assert {r["batch_size"]: r["tokens"] for r in report["results"]} == {1: 3 * 10, 2: 3 * 10}
    report, _ = _run(models, tmp_path, "--min-requests", "3", "--requests-per-slot", "2", "--hf-max-batch", "0")
    assert {r["batch_size"]: r["tokens"] for r in report["results"]} == {1: 3 * 10, 2: 4 * 10}
    assert bench_engine.BenchConfig(min_requests=5).workload_size(8) == 8
    with pytest.raises(ValueError, match="min_requests"):
        bench_engine.BenchConfig(min_requests=0)


def test_bench_engine_output_len_spread_gives_every_mode_the_same_varied_lengths(models, tmp_path):
    lengths = bench_engine.request_lengths(200, 40, 0.5, seed=3)
    assert lengths == bench_engine.request_lengths(200, 40, 0.5, seed=3)  # the same in every mode of a run
    assert min(lengths) >= 20 and max(lengths) <= 40 and len(set(lengths)) > 10
    assert bench_engine.request_lengths(5, 40, 0.0, seed=3) == [40] * 5
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(max_num_seqs=3, max_seq_len=64, seed=0),
                    SchedulerConfig(mode="fixed", k=2))
    stats = bench_engine.run_engine(engine, [PROMPTS[i % 3] for i in range(5)], [3, 9, 5, 7, 4], concurrency=2)
    assert stats["tokens"] == 3 + 9 + 5 + 7 + 4
    assert [len(engine.sequence(i).output_ids) for i in range(5)] == [3, 9, 5, 7, 4]
    with pytest.raises(ValueError, match="lengths for"):
        bench_engine.run_engine(engine, PROMPTS, [3, 4])

    report, _ = _run(models, tmp_path, "--requests-per-slot", "2", "--output-len-spread", "0.5", "--hf-max-batch", "0")
    assert report["settings"]["output_len_spread"] == 0.5
    for b in (1, 2):
        tokens = {r["tokens"] for r in report["results"] if r["batch_size"] == b}
        assert tokens == {sum(bench_engine.request_lengths(2 * b, 10, 0.5, seed=0))}  # every mode, the same work
    with pytest.raises(ValueError, match="output_len_spread"):
        bench_engine.BenchConfig(output_len_spread=1.0)


def test_bench_engine_variant_modes_run_beside_the_plain_ones(models, tmp_path):
    """``MODE+ahead`` runs the same mode on an engine that drafts before the token read (only those rows do), and
    ``none+async`` plain decoding with the read one step behind: the same tokens, one more step at the end."""
    report, _ = _run(models, tmp_path, "--modes", "none,none+async,fixed:2,fixed:2+ahead,adaptive,adaptive+ahead",
                     "--batch-sizes", "2", "--hf-max-batch", "0")
    rows = {r["label"]: r for r in report["results"]}
    assert set(rows) == {"none", "none+async", "fixed:2", "fixed:2+ahead", "adaptive", "adaptive+ahead"}
    assert rows["none+async"]["tokens"] == rows["none"]["tokens"] and rows["none+async"]["mode"] == "none"
    assert rows["none"]["engine_steps"] <= rows["none+async"]["engine_steps"] <= rows["none"]["engine_steps"] + 1
    assert rows["fixed:2+ahead"]["draft_ahead_fraction"] > 0 and rows["fixed:2"]["draft_ahead_fraction"] == 0
    assert rows["fixed:2+ahead"]["mode"] == "fixed" and rows["fixed:2+ahead"]["k"] == 2
    # Drafting ahead changes no decision: the same accepted and verify lengths (greedy, same prompts).
    for mode in ("fixed:2", "adaptive"):
        for key in ("mean_accepted_length", "mean_verify_length", "engine_steps", "tokens"):
            assert rows[mode + "+ahead"][key] == rows[mode][key], (mode, key)
    summary = report["summary"]["2"]
    assert summary["best_fixed"] == "fixed:2" and "adaptive_ahead_over_adaptive" in summary
    assert "none_async_over_none" in summary
    with pytest.raises(ValueError, match="ahead"):
        bench_engine.BenchConfig(modes=["none+ahead"])
    with pytest.raises(ValueError, match="async"):
        bench_engine.BenchConfig(modes=["ngram:fixed:2+async"])  # the n-gram lookup reads the committed tokens
    with pytest.raises(ValueError, match="suffix"):
        bench_engine.BenchConfig(modes=["fixed:2+later"])


def test_parse_config_of_the_ngram_modes():
    assert parse_config("fixed:3", 7) == ("dspark", "fixed", 3)
    assert parse_config("ngram:fixed:3", None, 5) == ("ngram", "fixed", 3)
    assert parse_config("ngram:fixed", None, 5) == ("ngram", "fixed", 5)
    assert parse_config("ngram:dsd", None) == ("ngram", "dsd", None)
    for bad in ("ngram:adaptive", "ngram:threshold", "ngram:adaptive:nogate", "ngram:none", "ngram:fixed:6"):
        with pytest.raises(ValueError):
            parse_config(bad, 7, 5)


def test_parse_config_of_the_hybrid_modes():
    assert parse_config("hybrid:fixed:3", 7) == ("hybrid", "fixed", 3)
    assert parse_config("hybrid:fixed", 4) == ("hybrid", "fixed", 4)
    assert parse_config("hybrid:adaptive:nogate", None) == ("hybrid", "adaptive", None)
    assert parse_config("hybrid:threshold", None) == ("hybrid", "threshold", None)
    for bad in ("hybrid:none", "hybrid:oracle", "hybrid:fixed:8", "hybrid"):
        with pytest.raises(ValueError):
            parse_config(bad, 7)


def test_bench_engine_hybrid_modes(models, tmp_path):
    """``hybrid:`` modes run the hybrid proposer's engine with the drafter's cost table: every request emits exactly
    its tokens, the rows report how often an n-gram block was verified, and nothing runs one step ahead."""
    report, _ = _run(models, tmp_path, "--modes", "fixed:2,hybrid:fixed:2,hybrid:adaptive,hybrid:adaptive:nogate",
                     "--batch-sizes", "2", "--hf-max-batch", "0")
    rows = {r["label"]: r for r in report["results"]}
    assert set(rows) == {"fixed:2", "hybrid:fixed:2", "hybrid:adaptive", "hybrid:adaptive:nogate"}
    for label in ("hybrid:fixed:2", "hybrid:adaptive", "hybrid:adaptive:nogate"):
        r = rows[label]
        assert r["proposer"] == "hybrid" and r["tokens"] == 2 * 10 and 0.0 <= r["ngram_step_fraction"] <= 1.0
        assert r["draft_ahead_fraction"] == 0
    assert rows["hybrid:fixed:2"]["k"] == 2 and rows["hybrid:fixed:2"]["mean_verify_length"] <= 2.0
    assert "ngram_step_fraction" not in rows["fixed:2"]
    assert report["summary"]["2"]["best_hybrid"].startswith("hybrid:") and "cost_table" in report
    only, _ = _run(models, tmp_path, "--modes", "hybrid:adaptive", "--batch-sizes", "1", "--hf-max-batch", "0")
    assert "cost_table" in only, "without a DSpark mode the hybrid engine profiles the table itself"
    with pytest.raises(ValueError, match="ahead"):
        bench_engine.BenchConfig(modes=["hybrid:fixed:2+ahead"])
    with pytest.raises(ValueError, match="prior_accept"):
        bench_engine.BenchConfig(modes=["hybrid:fixed:2"], hybrid_prior_accept=1.0)


def test_parse_mode_rejects_bad_specs():
    assert parse_mode("fixed:3", 7) == ("fixed", 3)
    assert parse_mode("fixed", 5) == ("fixed", 5)
    assert parse_mode("adaptive", 7) == ("adaptive", None)
    for bad in ("fixed:8", "fixed:x", "dsd:2", "oracle", "fast"):
        with pytest.raises(ValueError, match="mode"):
            parse_mode(bad, 7)


def test_bench_host_times_the_planning_and_agrees_with_the_reference(tmp_path):
    out = tmp_path / "host-test.json"
    report = bench_host.main(["--batches", "1,3", "--gamma", "3", "--repeats", "2", "--warmup", "3", "--steps", "3",
                              "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert on_disk["hardware"].startswith("CPU") and "--batches 1,3" in on_disk["command"]
    assert {"python", "torch", "numpy"} <= set(on_disk["software"])
    assert [r["R"] for r in on_disk["results"]] == [1, 3]
    for r in on_disk["results"]:
        assert r["steps"] == 2 * 3 and r["agree"] == r["steps"], "the engine decided as the reference twins"
        assert r["drafted_steps"] == r["steps"], "the gate stays open: every timed step is a full adaptive step"
        assert 0 < r["host_us_min"] <= r["host_us"] <= r["host_us_max"] and r["reference_us"] > 0
        assert len(r["runs_host_us"]) == 2 and r["ahead_us"] == 0  # planning ahead is off unless asked
    ahead = bench_host.main(["--batches", "3", "--gamma", "3", "--repeats", "1", "--warmup", "3", "--steps", "3",
                             "--plan-ahead", "--out", str(tmp_path / "host-ahead.json")])["results"][0]
    assert ahead["agree"] == ahead["steps"] == 3 and ahead["ahead_us"] > 0  # the same decisions, planned ahead
    # A drafter priced out keeps the gate closed (the adaptive engine's plain steps), one step ahead of the reads,
    # beside plain decoding measured in the same run; both commit their tokens on the host every step.
    closed = bench_host.main(["--batches", "3", "--gamma", "3", "--repeats", "1", "--warmup", "3", "--steps", "3",
                              "--draft-ms", "50", "--async-decode", "--plain-baseline",
                              "--out", str(tmp_path / "host-closed.json")])
    row = closed["results"][0]
    assert closed["settings"]["async_decode"] and row["steps"] == 3
    assert row["agree"] is None and row["reference_us"] is None  # the twins replay the synchronous engine only
    assert row["drafted_steps"] < row["steps"] and row["commit_us"] > 0
    assert row["plain"]["commit_us"] > 0 and row["plain"]["step_us"] > row["plain"]["host_us"] > 0


def test_bench_kernels_all_ops_on_cpu(tmp_path):
    out = tmp_path / "kernels-test.json"
    report = bench_kernels.main(["--op", "all", "--repeats", "1", "--iters", "1", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["hardware"] == report["hardware"] and on_disk["roofline_gbps"] == 4800.0
    assert {r["op"] for r in on_disk["results"]} == set(bench_kernels.OPS)
    for r in on_disk["results"]:
        assert r["us"] > 0 and r["bytes"] > 0 and r["gb_per_s"] > 0
    assert out.with_suffix(".png").is_file()


def test_bench_kernels_verify_cases_measure_what_they_name():
    """accept_all must accept every draft and reject_first none, or the bytes per call would be wrong."""
    cases = bench_kernels.verify_cases(bench_kernels.Shapes.tiny(), 3, torch.device("cpu"),
                                       torch.Generator(device="cpu").manual_seed(0))
    accepted = {c.case: c.call("torch").num_accepted for c in cases}
    assert torch.equal(accepted["accept_all"], torch.full((3,), 7))
    assert torch.equal(accepted["reject_first"], torch.zeros(3, dtype=torch.long))
    assert torch.equal(accepted["greedy"], torch.full((3,), 7))
    assert torch.equal(accepted["greedy_packed"], torch.full((3,), 7))


def test_bench_kernels_backends_agree_under_the_interpreter(tmp_path):
    """TRITON_INTERPRET=1 must be set before triton is imported, hence a subprocess."""
    out = tmp_path / "kernels-interp.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "scripts/bench_kernels.py", "--op", "all", "--batches", "2", "--repeats", "1",
                    "--iters", "1", "--out", str(out)], cwd=ROOT, env=env, check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert report["triton"] == "interpreter"
    agreements = [r for r in report["results"] if "agreement" in r]
    assert {r["op"] for r in agreements} == set(bench_kernels.OPS)
    for r in agreements:
        if "equal" in r["agreement"]:
            assert r["agreement"]["equal"], r
        else:  # attention in fp32: the online softmax vs SDPA differ by summation order only
            assert r["agreement"]["max_abs_diff"] < 1e-5, r


def test_bench_linear_under_the_interpreter(tmp_path):
    """The fused-projection benchmark end to end on the CPU (tiny shapes, eager, interpreted): both chains agree and
    the sweep records every tile it tried and the best one. TRITON_INTERPRET=1 goes to a subprocess (see above)."""
    out = tmp_path / "linear-interp.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "scripts/bench_linear.py", "--rows", "1,2", "--sweep", "--sweep-rows", "1",
                    "--sweep-max-configs", "3", "--repeats", "1", "--out", str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    report = json.loads(out.read_text())
    assert report["triton"] == "interpreter" and [r["rows"] for r in report["chain"]] == [1, 2]
    for r in report["chain"]:
        assert r["unfused_us_per_layer"] > 0 and r["fused_us_per_layer"] > 0
        assert r["max_rel_diff"] < 1e-5  # float32: the two chains differ in summation order only
    summary = [e for e in report["sweep"] if e["config"] == "default"]
    assert {e["op"] for e in summary} == {"qkv", "o", "gate_up", "down"}
    assert all(e["best_us"] <= e["us"] for e in summary)
    assert out.with_suffix(".png").is_file()


def test_proposed_invariant_tiles_take_the_fastest_tile_identical_in_every_op():
    """The table bench_linear proposes: at each swept size the tile identical to the base in every op with the least
    summed time (a faster tile that changes bits in one op is passed over), neighbours merged, the last for any size;
    an op's narrower input caps BLOCK_K as kernel_config does."""
    from optimized.kernels.linear import invariant_tiles
    from scripts.bench_linear import proposed_invariant_tiles

    def tile(bm, bn, bk):
        return dict(kernel="dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)

    def ranked(k, entries):
        return {"op": "x", "k": k, "row_counts": [1, 64, 512],
                "ranked": [{"config": cfg, "identical": same, "us": dict(zip(("1", "64", "512"), us))}
                           for cfg, same, us in entries]}

    base, wide, tall, odd = tile(16, 32, 256), tile(16, 64, 256), tile(64, 64, 256), tile(32, 32, 256)
    sweep = [ranked(576, [(base, True, (5, 6, 30)), (wide, True, (6, 6.5, 20)), (tall, True, (9, 9, 10)),
                          (odd, False, (1, 1, 1))]),  # fastest everywhere, but not the base's bits in this op
             ranked(1536, [(base, True, (5, 6, 30)), (wide, True, (6, 5, 20)), (tall, True, (9, 9, 10)),
                           (odd, True, (1, 1, 1))]),
             ranked(96, [(tile(16, 32, 128), True, (5, 6, 30)), (tile(16, 64, 128), True, (6, 6, 20)),
                         (tile(64, 64, 128), True, (9, 9, 10)), (tile(32, 32, 128), True, (1, 1, 1))])]
    tiles = proposed_invariant_tiles(sweep)
    assert tiles == [dict(max_rows=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4),
                     dict(max_rows=64, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4),
                     dict(max_rows=None, BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4)]
    with invariant_tiles(tiles):  # a table the kernels accept
        pass
    sweep[0]["ranked"] = [dict(r, identical=r["config"] == base) for r in sweep[0]["ranked"]]
    assert proposed_invariant_tiles(sweep) == [dict(max_rows=None, **{k: base[k] for k in tiles[0] if k in base})]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 (the CI command sets it)")
def test_bench_linear_goes_on_past_a_tile_that_fails(tmp_path, monkeypatch):
    """A default tile that does not compile on some GPU (shared memory, registers) is recorded, not fatal: the chain
    row keeps its unfused time and the error, the sweep its other tiles and no default time."""
    from scripts import bench_linear

    real_chain, real_op = bench_linear.chain, bench_linear.one_op

    def chain(x, layers, fused, backend, hidden):
        if fused and x.shape[0] == 2:
            raise RuntimeError("out of resources: shared memory, required: 999999")
        return real_chain(x, layers, fused, backend, hidden)

    def one_op(op, x, layers, config, backend):
        fn = real_op(op, x, layers, config, backend)
        if config is None and op == "qkv":
            def failing():
                raise RuntimeError("out of resources: registers")
            return failing
        return fn

    monkeypatch.setattr(bench_linear, "chain", chain)
    monkeypatch.setattr(bench_linear, "one_op", one_op)
    out = tmp_path / "linear.json"
    report = bench_linear.main(["--rows", "1,2", "--sweep", "--sweep-rows", "1", "--sweep-max-configs", "2",
                                "--repeats", "1", "--out", str(out)])
    rows = {r["rows"]: r for r in report["chain"]}
    assert rows[1]["fused_us_per_layer"] > 0 and "fused_error" not in rows[1]
    assert rows[2]["fused_error"].startswith("out of resources") and "fused_us_per_layer" not in rows[2]
    assert rows[2]["unfused_us_per_layer"] > 0
    qkv = next(e for e in report["sweep"] if e["config"] == "default" and e["op"] == "qkv")
    assert qkv["us"] is None and qkv["best"] is not None and qkv["best_us"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 (the CI command sets it)")
def test_bench_linear_invariant_sweep_checks_bits_and_proposes_a_table(tmp_path):
    """The row-invariant sweep end to end (tiny shapes, interpreted): every op ranks its tiles with an ``identical``
    flag (the base tile is identical to itself), a per-size table of identical tiles, and a proposed table that the
    kernels accept."""
    from optimized.kernels.linear import check_invariant_tiles
    from scripts import bench_linear

    out = tmp_path / "linear-invariant.json"
    report = bench_linear.main(["--rows", "1", "--invariant-sweep", "1,3", "--sweep-max-configs", "2",
                                "--repeats", "1", "--out", str(out)])
    sweep = report["invariant_sweep"]
    assert [op["op"] for op in sweep] == ["qkv", "o", "gate_up", "down"]
    for op in sweep:
        base = next(r for r in op["ranked"] if r["default"])
        assert base["identical"] and set(base["us"]) == {"1", "3"}
        assert [t["rows"] for t in op["table"]] == [1, 3]
        assert all(next(r for r in op["ranked"] if r["config"] == t["config"])["identical"] for t in op["table"])
    check_invariant_tiles(report["proposed_invariant_tiles"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))


def test_pause_watch_counts_collections_and_triton_compiles():
    """bench_engine's stall evidence: a collection run while watching is counted with its time, and Triton's
    cache-miss hook (what a compiled Triton calls before compiling a kernel for a new specialization; the interpreter
    used here compiles nothing) counts a compile and lets it go ahead; both hooks are gone after the watch."""
    import gc

    from triton import knobs

    before = len(gc.callbacks)
    with bench_engine.PauseWatch() as watch:
        gc.collect(1)
        hook = knobs.runtime.jit_cache_hook
        assert not hook(key="k", repr="kernel", fn=None, compile=None, is_manual_warmup=False, already_compiled=False)
    summary = watch.summary()
    assert summary["gc_collections"][1] >= 1 and summary["gc_ms"] > 0
    assert summary["jit_compiles"] == 1
    assert len(gc.callbacks) == before and knobs.runtime.jit_cache_hook is not hook
