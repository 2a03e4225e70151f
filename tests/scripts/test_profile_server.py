"""scripts/profile_server.py: samples land in the right stages, a stage split adds up to its process's CPU, a baseline
gives ratios, and the harness runs end to end against the real server stack with the synthetic engine."""

from __future__ import annotations

import json
from collections import Counter

from scripts.profile_server import build_parser, classify, compare, read_raw, stage_split

UVICORN = "run (uvicorn/server.py:70);"
EVENTS = UVICORN + "events (optimized/serving/app.py:750);"


def test_samples_are_classified_from_the_innermost_frame():
    assert classify(EVENTS + "add (optimized/serving/text.py:60)", "http") == "detokenize"
    assert classify(EVENTS + "__call__ (optimized/serving/app.py:470)", "http") == "SSE chunk: JSON + framing"
    assert classify(EVENTS + "send (uvicorn/protocols/http/httptools_impl.py:542)",
                    "http") == "ASGI response + socket writes"
    receive = UVICORN + "_receive (optimized/serving/engine_process.py:183)"
    assert classify(receive, "http") == "results: read + unpickle"
    assert classify("run_steps (optimized/serving/engine_loop.py:261);step (scripts/bench_server_overhead.py:155)",
                    "engine") == "engine step"
    assert classify("run_steps (optimized/serving/engine_loop.py:261);post (optimized/serving/engine_process.py:450);"
                    "send (optimized/serving/engine_process.py:90)", "engine") == "message: pickle + write"
    assert classify("one_request (scripts/bench_serving.py:140);loads (json/__init__.py:346)", "client") == "JSON parse"
    assert classify("somewhere (elsewhere.py:1)", "http") == "other"


def test_stage_split_shares_out_the_measured_cpu(tmp_path):
    raw = tmp_path / "http-1.txt"
    raw.write_text(f"{EVENTS}add (optimized/serving/text.py:60) 30\n{UVICORN}_receive "
                   "(optimized/serving/engine_process.py:183) 10\n")
    samples = {"http": read_raw(raw), "engine": Counter({"step (scripts/bench_server_overhead.py:155)": 3,
                                                         "post (optimized/serving/engine_process.py:450)": 1})}
    split = stage_split(samples, {"engine_process": 4.0, "http_processes": 40.0, "client": 50.0})
    assert split["http_processes"]["us_per_token"] == {"detokenize": 30.0, "results: read + unpickle": 10.0}
    assert split["engine_process"]["us_per_token"] == {"engine step": 3.0, "message: collect outputs": 1.0}
    assert split["engine_process"]["serving_us_per_token"] == 1.0 and "client" not in split


def test_a_baseline_gives_ratios():
    before = {"results": [{"concurrency": 64, "output_tokens_per_s": 100.0, "tokens_per_chunk": 1.0,
                           "cpu_us_per_token": {"engine_process": 4.0, "http_processes": 40.0, "client": 0.0}}]}
    rows = [{"concurrency": 64, "output_tokens_per_s": 150.0,
             "cpu_us_per_token": {"engine_process": 2.0, "http_processes": 30.0, "client": 5.0}},
            {"concurrency": 256, "output_tokens_per_s": 1.0, "cpu_us_per_token": {}}]
    compare(rows, before)
    assert rows[0]["after_over_before"] == {"engine_process": 0.5, "http_processes": 0.75, "output_tokens_per_s": 1.5}
    assert rows[0]["before"]["cpu_us_per_token"]["http_processes"] == 40.0 and "before" not in rows[1]


def test_defaults_and_step_times():
    args = build_parser().parse_args([])
    assert (args.engine, args.concurrency, args.step_ms, args.profile) == ("synthetic", [64, 256], [10.0, 20.0], False)


def test_harness_runs_end_to_end(tmp_path):
    """Tiny tokenizer, two users, the synthetic engine in its own process behind one HTTP process."""
    from scripts import profile_server
    from tests.serving.conftest import char_tokenizer, tiny_model

    model_dir = tmp_path / "tiny"
    tiny_model().save_pretrained(model_dir)  # the synthetic server loads the target for its tokenizer
    char_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "profile.json"
    report = profile_server.main(["--model", str(model_dir), "--concurrency", "2", "--step-ms", "1", "--output-len",
                                  "30", "--min-requests", "6", "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    (row,) = report["results"]
    assert row["concurrency"] == 2 and row["requests"] == 6 and row["errors"] == 0 and row["output_tokens"] == 180
    assert row["engine_steps"] > 0 and row["output_tokens_per_s"] > 0
    assert set(row["cpu_us_per_token"]) == {"engine_process", "http_processes", "client"}
    assert row["cpu_us_per_token"]["http_processes"] > 0 and row["cpu_us_per_token"]["client"] > 0
    assert report["command"].startswith("python -m scripts.profile_server --model")
