"""Beta calibration per slot (reference.calibration.fit_sts_beta, apply_sts with log weights): parameter recovery,
monotonicity in z, held-out ECE against STS + bias where a two-parameter map cannot fit, storage round trips."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from reference.calibration import (
    apply_sts,
    calibrated_survival,
    calibration_report,
    fit_sts_beta,
    fit_sts_bias,
    log_weights_for,
    prefix_survival,
    prefix_survival_labels,
)
from reference.config import DrafterConfig
from scripts import calibrate

F = torch.nn.functional
ALPHA, BETA, M_SHIFT = (2.0, 1.6, 2.4), (0.5, 0.7, 0.4), (0.3, 0.0, -0.2)


def _beta_proposals(seed: int, M: int = 20_000, alpha=ALPHA, beta=BETA, m=M_SHIFT):
    """Full-block proposals whose conditional acceptance is the beta map of the raw confidence:
    ``q_k = σ(α_k log σ(z_k) − β_k log σ(−z_k) + m_k)``. With α ≠ β no ``σ(z/T + b)`` equals it.
    Returns (z [M, γ] float32, labels [M, γ])."""
    gamma = len(alpha)
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(M, gamma, generator=g, dtype=torch.float64) * 2.0 + 1.5).float()
    a, b, c = (torch.tensor(x, dtype=torch.float64) for x in (alpha, beta, m))
    zd = z.double()
    q = torch.sigmoid(a * F.logsigmoid(zd) - b * F.logsigmoid(-zd) + c)  # [M, γ]
    accepted = torch.rand(M, gamma, generator=g, dtype=torch.float64) < q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    return z, prefix_survival_labels(num_accepted, torch.full((M,), gamma), gamma)


@pytest.fixture(scope="module")
def beta_fit():
    z, y = _beta_proposals(seed=0)
    return z, y, fit_sts_beta(z, y)


def _config(**kw):
    return DrafterConfig(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=128, target_num_layers=4, block_size=3, **kw)


def test_fit_recovers_known_beta_parameters():
    z, y = _beta_proposals(seed=0)
    temps, biases, weights = fit_sts_beta(z, y, l2=0.0)  # unpenalised: the maximum-likelihood estimate
    for k in range(2):  # slots 1-2 keep ~12k and ~8k survivors of 20k, enough to pin three parameters down
        beta = 1.0 / temps[k]
        alpha = weights[k] + beta
        assert abs(alpha - ALPHA[k]) < 0.25 and abs(beta - BETA[k]) < 0.1 and abs(biases[k] - M_SHIFT[k]) < 0.2, (
            k, alpha, beta, biases[k])


def test_identity_parameters_and_stsbias_special_case():
    z = torch.randn(50, 3, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(apply_sts(z, [1.0] * 3, [0.0] * 3, [0.0] * 3), torch.sigmoid(z))
    # w = 0 is STS + bias to the last bit: adding 0·logsigmoid(z) = ±0.0 changes no float
    assert torch.equal(apply_sts(z, [1.3, 0.7, 2.0], [0.2, -0.1, 0.0], [0.0] * 3),
                       apply_sts(z, [1.3, 0.7, 2.0], [0.2, -0.1, 0.0]))
    # the documented order of operations, which the engine reproduces in float32
    t, b, w = torch.tensor([1.3, 0.7, 2.0]), torch.tensor([0.2, -0.1, 0.0]), torch.tensor([0.5, -0.4, 1.1])
    assert torch.equal(apply_sts(z, t.tolist(), b.tolist(), w.tolist()),
                       torch.sigmoid(z / t + b + w * F.logsigmoid(z)))


def test_beta_calibration_is_increasing_in_z(beta_fit):
    z, _, (temps, biases, weights) = beta_fit
    grid = torch.linspace(-30, 30, 20_001, dtype=torch.float64)[:, None].expand(-1, 3)  # [N, γ]
    c = apply_sts(grid, temps, biases, weights)  # float64: distinct logits stay distinct
    assert bool((c[1:] > c[:-1]).all()), "fitted map not strictly increasing"
    # at the edge w = -1/T + ε the map is still increasing; at or below the edge it is rejected
    edge = [-1.0 / t + 1e-3 for t in temps]
    c = apply_sts(grid, temps, biases, edge)
    assert bool((c[1:] >= c[:-1]).all())
    with pytest.raises(ValueError, match="increasing"):
        apply_sts(grid, temps, biases, [-1.0 / t for t in temps])
    with pytest.raises(ValueError, match="log weight"):
        apply_sts(grid, temps, biases, [0.0, 0.0])
    # the ranking of each slot's proposals is that of the raw logits
    cz = apply_sts(z.double(), temps, biases, weights)
    for k in range(3):
        assert torch.equal(torch.argsort(cz[:, k], stable=True), torch.argsort(z[:, k], stable=True))


def test_heldout_ece_beats_sts_bias_where_two_parameters_cannot_fit(beta_fit):
    z, y, (temps, biases, weights) = beta_fit
    z2, y2 = _beta_proposals(seed=1)  # held out: fitted on seed 0, reported on seed 1
    beta = calibration_report(z2, y2, temps, biases=biases, log_weights=weights)
    assert beta["log_weights"] == weights
    t_b, b_b = fit_sts_bias(z, y)
    platt = calibration_report(z2, y2, t_b, biases=b_b)
    ece_beta = [p["ece_after"] for p in beta["positions"]]
    ece_platt = [p["ece_after"] for p in platt["positions"]]
    floor = [p["ece_floor_p95"] for p in beta["positions"]]
    assert all(e <= f for e, f in zip(ece_beta, floor)), (ece_beta, floor)  # at the noise floor
    assert ece_platt[0] > 2 * floor[0] and ece_beta[0] < ece_platt[0] / 2, (ece_platt, ece_beta)


def test_beta_equals_sts_bias_when_the_truth_is_a_platt_map():
    """Where STS + bias is the right model (α = β), beta calibration fits the same map: no loss from the extra
    parameter beyond noise."""
    z, y = _beta_proposals(seed=2, alpha=(0.5, 0.7, 0.4), beta=(0.5, 0.7, 0.4))
    z2, y2 = _beta_proposals(seed=3, alpha=(0.5, 0.7, 0.4), beta=(0.5, 0.7, 0.4))
    temps, biases, weights = fit_sts_beta(z, y)
    beta = calibration_report(z2, y2, temps, biases=biases, log_weights=weights)
    temps, biases = fit_sts_bias(z, y)
    platt = calibration_report(z2, y2, temps, biases=biases)
    for pb, pp in zip(beta["positions"], platt["positions"]):
        assert pb["ece_after"] < pp["ece_after"] + 0.005 and pb["ece_after"] < pb["ece_floor_p95"] + 0.003


def test_slot_with_too_few_proposals_keeps_identity(caplog):
    z, y = _beta_proposals(seed=4, M=2000)
    y[:, 1:] = float("nan")  # slots 2..3 never verified
    with caplog.at_level(logging.WARNING):
        temps, biases, weights = fit_sts_beta(z, y)
    assert temps[1:] == [1.0] * 2 and biases[1:] == [0.0] * 2 and weights[1:] == [0.0] * 2
    assert "slot 2" in caplog.text


def test_json_round_trip_gives_the_same_survivals(beta_fit, tmp_path):
    """What calibrate.py writes (JSON floats) reproduces the fitted survivals bit for bit."""
    z, _, (temps, biases, weights) = beta_fit
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"temperatures": temps, "biases": biases, "log_weights": weights}))
    back = json.loads(path.read_text())
    assert torch.equal(prefix_survival(apply_sts(z, back["temperatures"], back["biases"], back["log_weights"])),
                       prefix_survival(apply_sts(z, temps, biases, weights)))


def test_calibrated_survival_reads_the_configs_log_weights():
    z = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))
    cal = {"sts_temperatures": {"greedy": [1.5, 2.0, 0.5]}, "sts_biases": {"greedy": [0.1, -0.2, 0.3]}}
    cfg = _config(**cal)
    assert log_weights_for(cfg, "greedy") is None  # STS + bias: no log weights
    with pytest.raises(ValueError, match="decoding mode"):
        log_weights_for(cfg, "beam")

    cfg = _config(**cal, sts_log_weights={"greedy": [0.4, 0.0, 1.2]})
    assert log_weights_for(cfg, "greedy") == [0.4, 0.0, 1.2] and log_weights_for(cfg, "sampling") is None
    assert torch.equal(calibrated_survival(cfg, "greedy", z),
                       prefix_survival(apply_sts(z, [1.5, 2.0, 0.5], [0.1, -0.2, 0.3], [0.4, 0.0, 1.2])))


def test_checkpoint_round_trip(tmp_path):
    from reference.checkpoint import read_drafter_config, save_drafter
    from reference.drafter import DSparkDrafter
    from tests.conftest import TINY_GAMMA, tiny_drafter_config

    save_drafter(DSparkDrafter(tiny_drafter_config()), tmp_path)
    g = TINY_GAMMA
    res = {"temperatures": [1.2, 0.9, 2.0, 1.0][:g], "biases": [0.1, 0.2, -0.3, 0.0][:g],
           "log_weights": [0.5, 0.0, -0.2, 0.3][:g]}
    calibrate.store_calibration(str(tmp_path), "greedy", res)
    cfg = read_drafter_config(tmp_path)
    z = torch.randn(7, g, generator=torch.Generator().manual_seed(8))
    assert torch.equal(calibrated_survival(cfg, "greedy", z),
                       prefix_survival(apply_sts(z, res["temperatures"], res["biases"], res["log_weights"])))
    calibrate.store_calibration(str(tmp_path), "greedy", {**res, "log_weights": None})  # re-fit as sts-bias
    assert log_weights_for(read_drafter_config(tmp_path), "greedy") is None  # stale weights dropped


def test_log_weights_that_break_monotonicity_are_refused():
    """A stored w_k ≤ -1/T_k would make the calibration decrease in z (and reorder the scheduler's ranking)."""
    with pytest.raises(ValueError, match="w_k > -1/T_k"):
        _config(sts_temperatures={"greedy": [2.0, 1.0, 1.0]}, sts_log_weights={"greedy": [-0.5, 0.0, 0.0]})
    with pytest.raises(ValueError, match="w_k > -1/T_k"):  # weights without the temperatures they were fitted with
        _config(sts_log_weights={"greedy": [0.1, 0.0, 0.0]})


def test_calibrate_mode_beta_reports_heldout_ece():
    z, y = _beta_proposals(seed=5, M=6000)
    num_accepted = torch.nan_to_num(y, nan=0.0).sum(dim=1).long()
    proposals = {"conf_logits": z, "num_accepted": num_accepted, "sequence": torch.arange(z.shape[0]) // 8}
    res = calibrate.calibrate_mode(proposals, 3, 0.5, 0, "beta")
    assert res["method"] == "beta" and len(res["log_weights"]) == 3
    before = [p["ece_before"] for p in res["ece_heldout"]["positions"]]
    after = [p["ece_after"] for p in res["ece_heldout"]["positions"]]
    assert after[0] < before[0] / 2, (before, after)
    assert calibrate.calibrate_mode(proposals, 3, 0.5, 0, "sts-bias")["log_weights"] is None
