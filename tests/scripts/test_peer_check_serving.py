"""scripts/peer_check_serving.py's plumbing: the workload both clients get and the side-by-side report, with our
client stubbed and a stand-in GuideLLM (the real one is not a test dependency; docs/serving.md runs it)."""

from __future__ import annotations

import json
import stat
import sys

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


def test_both_clients_get_one_workload_and_the_report_puts_them_side_by_side(tmp_path, monkeypatch):
    guidellm = tmp_path / "guidellm"
    guidellm.write_text(FAKE_GUIDELLM.format(python=sys.executable))
    guidellm.chmod(guidellm.stat().st_mode | stat.S_IEXEC)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
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
