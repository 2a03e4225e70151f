"""scripts/compare_calibration.py on synthetic proposals: both methods reported per slot, the biased one better
where the head's confidences are offset (which a temperature cannot undo)."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import compare_calibration
from scripts.proposals import load_proposals, save_proposals


def test_compare_calibration_report(tmp_path):
    g = torch.Generator().manual_seed(0)
    m, gamma = 4000, 3
    u = torch.randn(m, gamma, generator=g) + 0.5  # true logit of acceptance per slot
    accepted = torch.rand(m, gamma, generator=g) < torch.sigmoid(u)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    for mode in ("greedy", "sampling"):
        save_proposals(tmp_path, mode, u + 1.0, num_accepted, gamma=gamma, temperature=0.0 if mode == "greedy" else 1.0,
                       calibration={"temperatures": [1.0] * gamma})
    out = tmp_path / "methods.json"
    report = compare_calibration.main(["--proposals", str(tmp_path), "--splits", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    res = report["sets"][f"{tmp_path.name}/greedy"]
    assert res["num_proposals"] == m and all(len(res[k]) == gamma for k in ("before", "sts", "sts-bias", "floor_p95"))
    assert res["sts-bias"][0] < res["sts"][0] < res["before"][0]  # the +1 offset: only a bias removes it
    assert res["sts-bias"][0] < 2 * res["floor_p95"][0]


def test_compare_calibration_scores_a_stored_calibration_unfitted(tmp_path):
    """--calibration DIR: a checkpoint's stored calibration is scored on the same held-out halves without a refit;
    the bias that exactly undoes the confidences' +1 offset scores near the floor, no calibration scores as "before"."""
    from reference.checkpoint import CONFIG_FILE, FORMAT, FORMAT_VERSION
    from reference.config import DrafterConfig

    g = torch.Generator().manual_seed(1)
    m, gamma = 4000, 3
    u = torch.randn(m, gamma, generator=g)
    num_accepted = (torch.rand(m, gamma, generator=g) < torch.sigmoid(u)).long().cumprod(dim=1).sum(dim=1)
    save_proposals(tmp_path / "p", "greedy", u + 1.0, num_accepted, gamma=gamma, temperature=0.0)
    for name, biases in (("exact", {"greedy": [-1.0] * gamma}), ("none", {})):
        config = DrafterConfig(vocab_size=97, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               intermediate_size=64, target_num_layers=4, block_size=gamma,
                               sts_temperatures={"greedy": [1.0] * gamma} if biases else {}, sts_biases=biases)
        (tmp_path / name).mkdir()
        stored = {"format": FORMAT, "format_version": FORMAT_VERSION, "drafter": config.to_dict(), "target": {},
                  "dtype": "float32"}
        (tmp_path / name / CONFIG_FILE).write_text(json.dumps(stored))
    exact = compare_calibration.main(["--proposals", str(tmp_path / "p"), "--splits", "2", "--out",
                                      str(tmp_path / "a.json"), "--calibration", str(tmp_path / "exact")])
    res = exact["sets"]["p/greedy"]
    assert len(res["stored"]) == gamma and res["stored"][0] < res["before"][0]
    assert res["stored"][0] < 2 * res["floor_p95"][0]
    none = compare_calibration.main(["--proposals", str(tmp_path / "p"), "--splits", "2", "--out",
                                     str(tmp_path / "b.json"), "--calibration", str(tmp_path / "none")])
    assert none["sets"]["p/greedy"]["stored"] == pytest.approx(none["sets"]["p/greedy"]["before"])


def test_proposals_round_trip_as_safetensors(tmp_path):
    conf = torch.randn(5, 3)
    acc = torch.tensor([0, 3, 1, 2, 0])
    path = save_proposals(tmp_path, "sampling", conf, acc, gamma=3, temperature=1.0,
                          calibration={"temperatures": [1.1, 1.2, 1.3], "biases": None})
    assert path.name == "proposals-sampling.safetensors"
    (rec,) = load_proposals(tmp_path)
    assert torch.equal(rec["conf_logits"], conf) and torch.equal(rec["num_accepted"], acc)
    assert (rec["mode"], rec["gamma"], rec["temperature"]) == ("sampling", 3, 1.0)
    assert rec["temperatures"] == [1.1, 1.2, 1.3] and rec["biases"] is None
    with pytest.raises(ValueError, match="expected conf_logits"):
        save_proposals(tmp_path, "greedy", conf, acc[:4], gamma=3, temperature=0.0)
    with pytest.raises(SystemExit, match="no proposals"):
        load_proposals(tmp_path / "empty")
