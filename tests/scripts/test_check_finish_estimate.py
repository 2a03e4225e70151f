"""``scripts/check_finish_estimate.py`` on the CPU with a tiny target and drafter: the report's schema, its step
counts against the engine's own records, and the estimate at each checkpoint."""

from __future__ import annotations

import json

import pytest

from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import check_finish_estimate

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8], [9, 2], [3, 3, 4, 10, 11, 12], [7, 1, 2]]


def test_the_check_reports_steps_and_estimates(tmp_path):
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    drafter = tiny_drafter(target, gamma=4, noise=0.2)
    out = tmp_path / "finish.json"
    report = check_finish_estimate.main(["--batch-sizes", "1,2", "--groups", "2", "--max-new-tokens", "16",
                                         "--out", str(out)], target=target, drafter=drafter, prompt_ids=PROMPTS)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [(r["batch_size"], r["group"]) for r in report["results"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for row in report["results"]:
        # the prefill step, then one verify per step: the longest request's verify steps + 1
        assert row["steps"] == row["request_steps_max"] + 1
        assert row["request_steps_mean"] <= row["request_steps_max"] and 1 <= row["tau"] <= 5
        assert set(row["estimates"]) <= {"1", "4", "8"} and "1" in row["estimates"]
        for e in row["estimates"].values():
            assert e["steps_left"] == row["steps"] - e["after_step"] and e["expected_steps"] > 0
            assert 1 <= e["forecast_tau"] <= 5
            assert e["expected_over_taken"] == pytest.approx(e["expected_steps"] / max(e["steps_left"], 1), abs=1e-3)
            assert e["expected_steps_means"] > 0  # without the outcome factors
            assert e["means_over_taken"] == pytest.approx(e["expected_steps_means"] / max(e["steps_left"], 1),
                                                          abs=1e-3)
            assert e["expected_steps_recent"] > 0  # the same estimate from the draft gate's moving averages
            assert e["recent_over_taken"] == pytest.approx(e["expected_steps_recent"] / max(e["steps_left"], 1),
                                                           abs=1e-3)
    with pytest.raises(SystemExit, match="groups"):
        check_finish_estimate.main(["--groups", "0", "--out", str(out)], target=target, drafter=drafter,
                                   prompt_ids=PROMPTS)
