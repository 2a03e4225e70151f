"""scripts/peer_check_serving.py's plumbing: the workload both clients get and the side-by-side report, with our
client stubbed and a stand-in GuideLLM (the real one is not a test dependency; docs/serving.md runs it)."""

from __future__ import annotations

import json
import stat
import sys

import pytest

from scripts import peer_check_serving

FAKE_GUIDELLM = """#!{python}
import json, sys
if sys.argv[1] == "--version":
    print("guidellm version: 0.0-test")
    sys.exit(0)
scenario = json.load(open(sys.argv[sys.argv.index("--scenario") + 1]))["spec"]
rows = [json.loads(line) for line in open(scenario["data"][0]["path"])]
json.dump(scenario, open(scenario["outputs"][0]["path"] + ".spec", "w"))
tokens = sum(r["output_tokens_count"] for r in rows)
ok = lambda **s: {{"successful": s}}
report = {{"benchmarks": [{{"duration": 2.0, "metrics": {{
    "output_token_count": ok(total_sum=tokens), "output_tokens_per_second": ok(mean=tokens / 2.5),
    "time_to_first_token_ms": ok(median=12.0), "time_per_output_token_ms": ok(median=1.5),
    "request_totals": {{"successful": len(rows), "errored": 0, "incomplete": 0}}}}}}]}}
json.dump(report, open(scenario["outputs"][0]["path"], "w"))
"""


def _fake_guidellm_and_prompts(tmp_path):
    """The fake GuideLLM executable and a five-prompt JSONL file, in ``tmp_path``."""
    guidellm = tmp_path / "guidellm"
    guidellm.write_text(FAKE_GUIDELLM.format(python=sys.executable))
    guidellm.chmod(guidellm.stat().st_mode | stat.S_IEXEC)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
    return guidellm, prompts


def test_both_clients_get_one_workload_and_the_report_puts_them_side_by_side(tmp_path, monkeypatch):
    guidellm, prompts = _fake_guidellm_and_prompts(tmp_path)
    seen = []

    def ours(args, c, n, prompts_path, work):  # our client, stubbed: what it was asked to send
        seen.append((c, n, [json.loads(line)["prompt"] for line in prompts_path.read_text().splitlines()]))
        return {"output_tokens_per_s": 100.0 * c, "ttft_ms_p50": 10.0, "tpot_ms_p50": 1.0, "requests": n,
                "errors": 0, "output_tokens": n * 16, "duration_s": 1.0}

    monkeypatch.setattr(peer_check_serving, "ours", ours)
    out, work = tmp_path / "peer.json", tmp_path / "work"
    report = peer_check_serving.main(["--base-url", "http://127.0.0.1:9", "--label", "none", "--concurrency", "2,8",
                                      "--min-requests", "6", "--requests-per-user", "2", "--output-len", "16",
                                      "--prompts-file", str(prompts),
                                      "--tokenizer", "tok-dir", "--guidellm", str(guidellm), "--hardware", "test",
                                      "--work-dir", str(work), "--out", str(out)])
    assert json.loads(out.read_text()) == report and report["peer"] == "guidellm version: 0.0-test"
    assert [(c, n) for c, n, _ in seen] == [(2, 6), (8, 16)]  # max(2 C, --min-requests) requests a level (2 a user)
    assert seen[0][2] == [f"question {i % 5}" for i in range(6)]  # request i takes prompt i, cycling
    for (c, n, texts), row in zip(seen, report["results"]):
        spec = json.loads((work / f"guidellm-{c}.json.spec").read_text())
        assert spec["profile"] == {"kind": "concurrent", "streams": c}
        assert spec["constraints"] == [{"kind": "max_requests", "count": n}]
        assert spec["backend"]["extras"] == {"body": {"temperature": 0.0}}  # greedy, as our client sends
        assert spec["backend"]["target"] == "http://127.0.0.1:9" and spec["tokenizer"]["model"] == "tok-dir"
        data = [json.loads(line) for line in (work / f"guidellm-{c}-data.jsonl").read_text().splitlines()]
        assert [d["prompt"] for d in data] == texts and {d["output_tokens_count"] for d in data} == {16}
        assert row["guidellm"]["output_tokens_per_s"] == n * 16 / 2.0  # its tokens over its duration
        assert row["guidellm"]["requests"] == n and row["guidellm"]["errors"] == 0
        assert row["guidellm_over_bench_serving"] == round(n * 8 / (100.0 * c), 3)


def _engine_report(path, per_batch: dict, requests_per_slot: int = 1):
    path.write_text(json.dumps({"settings": {"requests_per_slot": requests_per_slot},
                                "summary": {str(b): {"tokens_per_s": t} for b, t in per_batch.items()}}))
    return str(path)


def test_annotate_adds_the_engine_alone_at_each_level_against_its_fastest_mode(tmp_path):
    """--annotate: each level gets the engine's tokens/s at batch size C in the label's modes (the label and its
    one-step-ahead variant), from each report, and both clients' ratio to the fastest; a level a report lacks is
    left out; the command is recorded. A report measured in none of the modes is refused (the wrong file)."""
    report = {"label": "none", "results": [
        {"concurrency": c, "bench_serving": {"output_tokens_per_s": ours}, "guidellm": {"output_tokens_per_s": peer}}
        for c, ours, peer in ((64, 30.0, 33.0), (256, 60.0, 66.0))]}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps(report))
    closed = _engine_report(tmp_path / "closed.json", {64: {"none": 40.0, "none+async": 50.0, "adaptive": 99.0},
                                                       256: {"none": 120.0}})
    steady = _engine_report(tmp_path / "steady.json", {256: {"none+async": 100.0}}, requests_per_slot=8)
    out = peer_check_serving.main(["--annotate", str(path), "--engine-report", closed, "--engine-report", steady])
    assert json.loads(path.read_text()) == out and "--annotate" in out["engine_alone_command"]
    low, high = out["results"]
    assert low["engine_alone"] == {"closed.json": {  # adaptive is another mode: not compared
        "requests_per_slot": 1, "tokens_per_s": {"none": 40.0, "none+async": 50.0}, "fastest": "none+async",
        "bench_serving_over_engine": 0.6, "guidellm_over_engine": 0.66}}  # steady.json has no batch 64
    assert high["engine_alone"]["closed.json"]["fastest"] == "none"
    assert high["engine_alone"]["closed.json"]["bench_serving_over_engine"] == 0.5
    assert high["engine_alone"]["steady.json"] == {
        "requests_per_slot": 8, "tokens_per_s": {"none+async": 100.0}, "fastest": "none+async",
        "bench_serving_over_engine": 0.6, "guidellm_over_engine": 0.66}
    wrong = _engine_report(tmp_path / "wrong.json", {64: {"fixed:7": 10.0}})
    with pytest.raises(SystemExit, match="not the engine report"):
        peer_check_serving.main(["--annotate", str(path), "--engine-report", wrong])
    with pytest.raises(SystemExit):  # --annotate without an engine report
        peer_check_serving.main(["--annotate", str(path)])


def test_a_live_run_adds_the_engine_alone_once_its_levels_are_measured(tmp_path, monkeypatch):
    """With --engine-report the measured report gets the engine alone at the levels the engine report has; an
    unreadable engine report fails before either client runs."""
    guidellm, prompts = _fake_guidellm_and_prompts(tmp_path)
    ran = []

    def ours(args, c, n, prompts_path, work):
        ran.append(c)
        return {"output_tokens_per_s": 10.0 * c, "ttft_ms_p50": 10.0, "tpot_ms_p50": 1.0, "requests": n,
                "errors": 0, "output_tokens": n * 16, "duration_s": 1.0}

    monkeypatch.setattr(peer_check_serving, "ours", ours)
    common = ["--base-url", "http://127.0.0.1:9", "--label", "none", "--concurrency", "2,8", "--min-requests", "4",
              "--output-len", "16", "--prompts-file", str(prompts), "--tokenizer", "tok-dir", "--guidellm",
              str(guidellm), "--hardware", "test", "--work-dir", str(tmp_path / "work")]
    with pytest.raises(FileNotFoundError):
        peer_check_serving.main([*common, "--engine-report", str(tmp_path / "missing.json"), "--out",
                                 str(tmp_path / "x.json")])
    assert ran == []
    engine = _engine_report(tmp_path / "engine.json", {2: {"none": 40.0, "none+async": 80.0}})
    out = tmp_path / "peer.json"
    report = peer_check_serving.main([*common, "--engine-report", engine, "--out", str(out)])
    assert ran == [2, 8] and json.loads(out.read_text()) == report
    low, high = report["results"]
    assert low["engine_alone"]["engine.json"]["fastest"] == "none+async"
    assert low["engine_alone"]["engine.json"]["bench_serving_over_engine"] == 0.25  # 20 / 80
    assert "engine_alone" not in high  # the engine report has no batch 8
