"""``scripts/report_proposers.py``: eval_acceptance runs of several proposers collected in one report, like for like."""

from __future__ import annotations

import json

import pytest

from scripts import report_proposers

SETTINGS = {"max_new_tokens": 256, "gamma": 7, "scheduler": "fixed", "k": 7, "dtype": "bfloat16",
            "engine": "optimized", "temperature": 0.0}


def _eval(path, tau: float, *, hybrid: bool = False, prompts: str = "docs/benchmarks/eval_tasks.jsonl",
          max_new_tokens: int = 256) -> str:
    run = {"mean_accepted_length": tau, "mean_accepted_length_se": 0.05,
           "per_domain": {"chat": tau + 0.1, "summarization": tau - 0.1},
           "counts": {"steps": 100, "prompts": 2}, "settings": {**SETTINGS, "max_new_tokens": max_new_tokens},
           "prompts_file": prompts, "hardware": "1x NVIDIA H200", "drafter": "checkpoints/d",
           "command": f"scripts/eval_acceptance.py --model /tmp/stage/target.gguf --prompts-file {prompts} "
                      f"--limit 210 --json /tmp/res/{path.name}"}
    if hybrid:
        split = {"dspark": {"steps": 60, "share": 0.6, "mean_accepted_length": 3.0},
                 "ngram": {"steps": 40, "share": 0.4, "mean_accepted_length": 2.5}}
        run["sources"] = split
        run["per_domain_detail"] = {"chat": {"sources": split}, "summarization": {"sources": split}}
    path.write_text(json.dumps(run))
    return str(path)


def test_report_collects_runs_with_the_hybrids_sources(tmp_path):
    out = tmp_path / "proposers.json"
    d, n, h = _eval(tmp_path / "d.json", 2.5), _eval(tmp_path / "n.json", 2.0), _eval(tmp_path / "h.json", 2.8,
                                                                                          hybrid=True)
    assert report_proposers.main(["--run", f"dspark:0={d}", "--run", f"ngram:0={n}", "--run", f"hybrid:0={h}",
                                  "--script", "scripts/reproduce/x.sh", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["proposer"], r["temperature"], r["tau"]) for r in report["results"]] == [
        ("dspark", 0.0, 2.5), ("ngram", 0.0, 2.0), ("hybrid", 0.0, 2.8)]
    hybrid = report["results"][2]
    assert hybrid["sources"]["ngram"]["share"] == 0.4 and set(hybrid["per_domain_sources"]) == {"chat",
                                                                                                 "summarization"}
    assert "sources" not in report["results"][0]
    # Machine paths become placeholders; the prompt file and its --limit are stated.
    assert "--model TARGET.gguf" in hybrid["command"] and "RESULTS/h.json" in hybrid["command"]
    assert "/tmp/" not in json.dumps(report)
    assert report["prompts"].startswith("docs/benchmarks/eval_tasks.jsonl (--limit 210")
    assert report["settings"]["mode"] == "fixed K = 7 (the full block verified)"


@pytest.mark.parametrize("bad", [{"prompts": "other.jsonl"}, {"max_new_tokens": 128}])
def test_unlike_runs_are_refused(tmp_path, bad):
    d, n = _eval(tmp_path / "d.json", 2.5), _eval(tmp_path / "n.json", 2.0, **bad)
    with pytest.raises(SystemExit, match="cannot report these runs together"):
        report_proposers.main(["--run", f"dspark:0={d}", "--run", f"ngram:0={n}", "--out", str(tmp_path / "o.json")])


def test_bad_arguments_fail_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="PROPOSER:TEMPERATURE=FILE"):
        report_proposers.main(["--run", "dspark=x.json", "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="missing.json"):
        report_proposers.main(["--run", f"dspark:0={tmp_path / 'missing.json'}", "--out", str(tmp_path / "o.json")])
