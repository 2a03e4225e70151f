"""scripts/bench_server_overhead.py: the simulated engine keeps the engine's contract, and the benchmark runs end to
end against the real app (tiny tokenizer, a few requests) and writes its schema."""

from __future__ import annotations

import json

import pytest

from optimized.sequence import SamplingParams
from scripts.bench_server_overhead import SimulatedEngine


def test_simulated_engine_contract():
    eng = SimulatedEngine(list(range(10, 30)), max_num_seqs=2, step_ms=0.0, host_ms=0.0, tokens_per_step=3)
    a = eng.add_request([1, 2], SamplingParams(max_new_tokens=5), request_id=0)
    b = eng.add_request([1], SamplingParams(max_new_tokens=2), request_id=1)
    c = eng.add_request([1], SamplingParams(max_new_tokens=4), request_id=2)  # waits for a slot
    out = {o.request_id: o for o in eng.step()}
    assert set(out) == {a, b} and all(len(o.new_token_ids) == 1 for o in out.values())  # the "prefill" token
    stats = eng.last_step_stats()
    assert stats.num_running == 2 and stats.num_waiting == 1 and stats.num_decoding == 0
    out = {o.request_id: o for o in eng.step()}
    assert len(out[a].new_token_ids) == 3 and not out[a].finished
    assert len(out[b].new_token_ids) == 1 and out[b].finished and out[b].finish_reason == "length"
    eng.release(b)
    assert eng.last_step_stats().verified == [2, 2]
    out = {o.request_id: o for o in eng.step()}
    assert out[a].finished and len(out[a].new_token_ids) == 1 and len(out[c].new_token_ids) == 1
    assert eng.abort(c) and not eng.abort(c) and not eng.has_unfinished()
    with pytest.raises(ValueError):
        eng.add_request([], None)


def test_benchmark_writes_its_report(tmp_path):
    """The chunking arms with the engine on a thread (the names of earlier reports), then the engine process."""
    from scripts import bench_server_overhead
    from tests.serving.conftest import char_tokenizer, tiny_model

    model_dir = tmp_path / "tiny"
    tiny_model().save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    # 30 tokens a request: enough server CPU in a level (tens of ms) for /proc's 10 ms clock ticks to count
    common = ["--model", str(model_dir), "--concurrency", "2", "--output-len", "30", "--prompts-per-user", "2",
              "--min-requests", "4", "--step-ms", "1", "--host-ms", "0.1"]
    out = tmp_path / "overhead.json"
    assert bench_server_overhead.main([*common, "--tokens-per-step", "1", "--engine-modes", "thread",
                                       "--out", str(out), "--plot", str(tmp_path / "overhead.png")]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["tokens_per_step"], r["arm"], r["engine"], r["chunks_per"]) for r in rows] == [
        (1, "coalesce", "thread", "coalesce"), (1, "per-step", "thread", "per-step")]
    assert (tmp_path / "overhead.png").stat().st_size > 0
    out2 = tmp_path / "overhead-process.json"
    # Three times the requests here: with two HTTP processes each takes about half of a level's server CPU.
    assert bench_server_overhead.main([*common, "--min-requests", "12", "--tokens-per-step", "3", "--arms", "coalesce",
                                       "--engine-modes", "process,process:2", "--out", str(out2)]) == 0
    rows2 = json.loads(out2.read_text())["results"]
    assert [(r["tokens_per_step"], r["arm"], r["engine"]) for r in rows2] == [
        (3, "process+coalesce", "process"), (3, "process:2+coalesce", "process:2")]
    for r in rows + rows2:
        n = 4 if r in rows else 12
        assert r["errors"] == 0 and r["requests"] == n and r["output_tokens"] == 30 * n and r["concurrency"] == 2
        assert r["output_tokens_per_s"] > 0 and r["engine_steps"] > 0 and r["server_cpu_us_per_token"] > 0
        assert r["engine_process_cpu_us_per_token"] >= 0 and (r["engine"] != "thread" or
                                                               r["engine_process_cpu_us_per_token"] == 0)


def test_engine_modes_are_checked():
    from scripts.bench_server_overhead import build_parser

    assert build_parser().parse_args([]).engine_modes == ["thread", "process"]
    assert build_parser().parse_args(["--engine-modes", "process:4"]).engine_modes == ["process:4"]
    for bad in ("thread,fork", "process:", "process:x", "thread:2"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--engine-modes", bad])
