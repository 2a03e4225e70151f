"""scripts/profile_server.py: samples land in the right stages, a stage split adds up to its process's CPU, a baseline
gives ratios, and the harness runs end to end against the real server stack with the synthetic engine."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from scripts.profile_server import ROOT, build_parser, classify, compare, read_raw, stage_split

# Frames as py-spy prints them with --full-filenames, at lines past the files' ends: no source line is found, so none
# is taken for a wait.
LIB = "/usr/lib/python3.11/site-packages"


def frame(func: str, path: str) -> str:
    """A frame of ``path`` in this repository (``optimized/...``, ``scripts/...``) or, otherwise, in a library."""
    root = ROOT if path.startswith(("optimized/", "scripts/")) else LIB
    return f"{func} ({root}/{path}:99999)"


def stack(*frames: str) -> str:
    return ";".join(frames)


UVICORN = frame("run", "uvicorn/server.py")
EVENTS = stack(UVICORN, frame("events", "optimized/serving/app.py"))
LOOP = frame("run_steps", "optimized/serving/engine_loop.py")


def test_samples_are_classified_from_the_innermost_frame():
    assert classify(stack(EVENTS, frame("add", "optimized/serving/text.py")), "http") == "detokenize"
    assert classify(stack(EVENTS, frame("__call__", "optimized/serving/app.py")),
                    "http") == "SSE chunk: JSON + framing"
    assert classify(stack(EVENTS, frame("send", "uvicorn/protocols/http/httptools_impl.py")),
                    "http") == "ASGI response + socket writes"
    assert classify(stack(UVICORN, frame("_receive", "optimized/serving/engine_process.py")),
                    "http") == "results: read + unpickle"
    assert classify(stack(LOOP, frame("step", "scripts/bench_server_overhead.py")), "engine") == "engine step"
    assert classify(stack(LOOP, frame("post", "optimized/serving/engine_process.py"),
                          frame("send", "optimized/serving/engine_process.py")), "engine") == "message: pickle + write"
    assert classify(stack(frame("one_request", "scripts/bench_serving.py"), frame("loads", "json/__init__.py")),
                    "client") == "JSON parse"
    assert classify("somewhere (/elsewhere.py:1)", "http") == "other"


def test_waits_are_idle(tmp_path):
    src = tmp_path / "loop.py"
    src.write_text("def step():\n    time.sleep(0.01)\n    return [1]\n")
    assert classify(stack(LOOP, f"step ({src}:2)"), "engine") == "idle"
    assert classify(stack(frame("step", "scripts/bench_server_overhead.py"), f"step ({src}:3)"),
                    "engine") == "engine step"


def test_stage_split_shares_out_the_measured_cpu(tmp_path):
    raw = tmp_path / "http-1.txt"
    raw.write_text(f"{stack(EVENTS, frame('add', 'optimized/serving/text.py'))} 30\n"
                   f"{stack(UVICORN, frame('_receive', 'optimized/serving/engine_process.py'))} 10\n")
    src = tmp_path / "wait.py"
    src.write_text("event.wait(1)\n")
    samples = {"http": read_raw(raw), "engine": Counter({frame("step", "scripts/bench_server_overhead.py"): 3,
                                                         frame("post", "optimized/serving/engine_process.py"): 1,
                                                         stack(LOOP, f"wait ({src}:1)"): 5})}
    split = stage_split(samples, {"engine_process": 4.0, "http_processes": 40.0, "client": 50.0})
    assert split["http_processes"]["us_per_token"] == {"detokenize": 30.0, "results: read + unpickle": 10.0}
    assert split["engine_process"]["us_per_token"] == {"engine step": 3.0, "message: collect outputs": 1.0}
    assert split["engine_process"]["idle_samples"] == 5
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
    assert (args.engine, args.concurrency, args.step_ms, args.profile) == ("synthetic", [64, 256], None, False)


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
    (server0,) = row["cpu_share"]["each_http_process"]  # one HTTP process: it is all of them
    assert server0 == pytest.approx(row["cpu_share"]["http_processes"], abs=0.002)
    assert report["command"].startswith("python -m scripts.profile_server --model")
