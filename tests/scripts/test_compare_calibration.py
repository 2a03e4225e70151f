"""scripts/compare_calibration.py on synthetic proposals: both methods reported per slot, the biased one better
where the head's confidences are offset (which a temperature cannot undo)."""

from __future__ import annotations

import json

import torch

from scripts import compare_calibration


def test_compare_calibration_report(tmp_path):
    g = torch.Generator().manual_seed(0)
    m, gamma = 4000, 3
    u = torch.randn(m, gamma, generator=g) + 0.5  # true logit of acceptance per slot
    accepted = torch.rand(m, gamma, generator=g) < torch.sigmoid(u)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    for mode in ("greedy", "sampling"):
        torch.save({"conf_logits": u + 1.0, "num_accepted": num_accepted, "mode": mode, "gamma": gamma,
                    "temperatures": [1.0] * gamma, "temperature": 0.0}, tmp_path / f"proposals-{mode}.pt")
    out = tmp_path / "methods.json"
    report = compare_calibration.main(["--proposals", str(tmp_path), "--splits", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    res = report["sets"][f"{tmp_path.name}/greedy"]
    assert res["num_proposals"] == m and all(len(res[k]) == gamma for k in ("before", "sts", "sts-bias", "floor_p95"))
    assert res["sts-bias"][0] < res["sts"][0] < res["before"][0]  # the +1 offset: only a bias removes it
    assert res["sts-bias"][0] < 2 * res["floor_p95"][0]
