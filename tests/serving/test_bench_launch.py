"""``scripts/bench_serving.py --launch``: it starts ``python -m optimized.serve`` per mode, sweeps, and stops it
(the one-command sweep the GPU run uses), here with the tiny test model, one mode, one level."""

from __future__ import annotations

import json

import pytest

from tests.serving.conftest import server_env

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_serving_launches_one_server_per_mode(tiny_dirs, tmp_path, monkeypatch):
    from scripts import bench_serving

    for key, value in server_env(tmp_path).items():  # the launched server inherits this environment
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    model_dir, drafter_dir = tiny_dirs
    report = bench_serving.main(["--launch", "--modes", "fixed:2", "--server-args",
                                 f"--model {model_dir} --drafter {drafter_dir} --max-model-len 64",
                                 "--concurrency", "1", "--output-len", "6", "--prompts-per-user", "1",
                                 "--min-requests", "2", "--prompts-file", str(prompts),
                                 "--log-dir", str(tmp_path / "logs")])
    (row,) = report["results"]
    assert (row["mode"], row["k"], row["label"], row["requests"], row["errors"]) == ("fixed", 2, "fixed:2", 2, 0)
    assert report["drafter"] == str(drafter_dir) and report["model"] == str(model_dir)
    log = (tmp_path / "logs" / "serve-fixed2.log").read_text()
    assert "mode fixed" in log and "--max-num-seqs" in report["settings"]["server_args"]
    assert "drained" in log  # stopped with SIGTERM after the sweep
