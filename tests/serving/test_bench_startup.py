"""scripts/bench_startup.py: the start-up benchmark against a live tiny server, and its reading of the server's log."""

from __future__ import annotations

import json
from datetime import datetime

from scripts import bench_startup
from tests.serving.conftest import server_env, tiny_server_args

IMPORTS = "imports (torch, transformers, the engine and its kernels)"
PREFILL = ("2026-12-03 10:00:08,500 dspark.graphs INFO captured 22 prefill graphs (16..2048) in 0.50 s (warm-up of 9 "
           "sizes 0.20 s), 9.0 MiB of graph memory")
LOG = f"""\
2026-12-03 10:00:01,500 dspark.serve INFO the engine runs in its own process
2026-12-03 10:00:02,000 dspark.serve INFO start-up: {IMPORTS} ...
2026-12-03 10:00:05,000 dspark.serve INFO start-up: {IMPORTS} done in 3.00 s
2026-12-03 10:00:05,100 dspark.serve INFO start-up: target weights ...
2026-12-03 10:00:06,100 dspark.serve INFO start-up: target weights done in 1.00 s
2026-12-03 10:00:08,000 dspark.graphs INFO captured 87 verify graphs (1..2048) in 4.10 s (warm-up 1.20 s), 64 MiB
{PREFILL}
a line without a time stamp
2026-12-03 10:00:09,000 dspark.serve INFO start-up: kernel warm-up done in 0.40 s
"""


def test_parse_log_reads_stages_graphs_and_when_things_began():
    launched = datetime(2026, 12, 3, 10, 0, 0).timestamp()
    got = bench_startup.parse_log(LOG, launched)
    assert got["first_log_s"] == 1.5 and got["engine_first_stage_s"] == 2.0
    assert got["stages"] == {IMPORTS: 3.0, "target weights": 1.0, "kernel warm-up": 0.4}
    assert got["graphs"] == {"verify": {"count": 87, "seconds": 4.1, "warmup_s": 1.2},
                             "prefill": {"count": 22, "seconds": 0.5, "warmup_s": 0.2, "warmed_sizes": 9}}


def test_bench_startup_times_launches_and_requests(tiny_dirs, tmp_path, monkeypatch):
    """Two launches of the tiny server with its defaults (adaptive, the engine on a thread on the CPU): each reaches
    /health 200, logs its stages, and answers the timed requests."""
    for key, value in server_env(tmp_path / "cache").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "startup.json"
    args = ["--server-args", " ".join(tiny_server_args(tiny_dirs)), "--launches", "2", "--requests", "3",
            "--max-tokens", "4", "--log-dir", str(tmp_path / "logs"), "--out", str(out)]
    report = bench_startup.main(args)
    assert json.loads(out.read_text()) == report
    assert [r["launch"] for r in report["launches"]] == [1, 2]
    for r in report["launches"]:
        assert 0 < r["first_log_s"] <= r["engine_first_stage_s"] <= r["ready_s"]
        assert {"target weights", "drafter", "kernel warm-up"} <= set(r["stages"])
        assert len(r["requests_ms"]) == 3 and all(ms > 0 for ms in r["requests_ms"])
    # the first launch profiled the step-cost table into the cache; the second found it there (the tiny model
    # profiles in a fraction of a second, so the two stage times are too close to compare)
    logs = [(tmp_path / "logs" / f"startup-{i}.log").read_text() for i in (1, 2)]
    assert "cost table cached at" in logs[0] and "cost table: cache hit" not in logs[0]
    assert "cost table: cache hit" in logs[1]
    assert "launch 2: ready" in bench_startup.summarize(report)
