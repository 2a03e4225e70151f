"""``scripts/report_acceptance.py``: eval_acceptance outputs merged per arm and temperature, and ``--merge``."""

from __future__ import annotations

import json

import pytest

from scripts import report_acceptance


def _eval(path, tau: float, hardware: str = "CPU x86_64") -> str:
    path.write_text(json.dumps({
        "mean_accepted_length": tau, "mean_accepted_length_se": 0.04, "per_domain": {"chat": tau},
        "per_position_acceptance": [0.5, None],
        "per_position_counts": [10, 0], "counts": {"prompts": 2, "steps": 10}, "settings": {"temperature": 0.0},
        "hardware": hardware, "command": "scripts/eval_acceptance.py ...", "wall_s": 1.0, "not_copied": 1}))
    return str(path)


def test_report_then_merge_adds_and_replaces_arms(tmp_path):
    out = tmp_path / "acc"
    a0, a1 = _eval(tmp_path / "a0.json", 1.5), _eval(tmp_path / "a1.json", 1.4)
    assert report_acceptance.main(["--eval", f"dspark:0={a0}", "--eval", f"dspark:1={a1}", "--out", str(out),
                                   "--note", "first"]) == 0
    first = json.loads(out.with_suffix(".json").read_text())
    assert first["note"] == "first" and set(first["runs"]["dspark"]) == {"T=0", "T=1"}
    assert first["runs"]["dspark"]["T=0"]["mean_accepted_length"] == 1.5
    assert first["runs"]["dspark"]["T=0"]["mean_accepted_length_se"] == 0.04
    assert "not_copied" not in first["runs"]["dspark"]["T=0"] and out.with_suffix(".png").is_file()
    # --merge keeps the earlier arms and note, adds the new arm and replaces a re-measured run.
    ng, again = _eval(tmp_path / "ng.json", 2.2), _eval(tmp_path / "again.json", 1.6)
    assert report_acceptance.main(["--merge", str(out.with_suffix(".json")), "--eval", f"n-gram, n ≤ 3:0={ng}",
                                   "--eval", f"dspark:0={again}", "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["note"] == "first" and list(merged["runs"]) == ["dspark", "n-gram, n ≤ 3"]
    assert merged["runs"]["dspark"]["T=0"]["mean_accepted_length"] == 1.6
    assert merged["runs"]["dspark"]["T=1"] == first["runs"]["dspark"]["T=1"]
    assert merged["runs"]["n-gram, n ≤ 3"]["T=0"]["mean_accepted_length"] == 2.2


def test_bad_arguments_fail_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="ARM:TEMPERATURE=FILE"):
        report_acceptance.main(["--eval", "no-temperature", "--out", str(tmp_path / "x")])
    (tmp_path / "other.json").write_text(json.dumps({"results": []}))
    with pytest.raises(SystemExit, match="no 'runs' object"):
        report_acceptance.main(["--merge", str(tmp_path / "other.json"), "--eval",
                                f"a:0={_eval(tmp_path / 'a.json', 1.0)}", "--out", str(tmp_path / "x")])
