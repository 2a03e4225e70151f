"""Tests of reference/calibration.py: ECE, reliability data, censored labels and Sequential Temperature Scaling."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from reference import calibration
from reference.calibration import (
    apply_sts,
    calibration_report,
    default_temperature_grid,
    expected_calibration_error,
    fit_sts,
    prefix_survival,
    prefix_survival_labels,
    reliability_diagram,
    temperatures_for,
)
from reference.config import DrafterConfig

# ECE is a float64 sum of at most a few thousand terms: 1e-12 absolute is far above its rounding error.
F64_TOL = 1e-12


# ----------------------------------------------------------------------------------------------- ECE


def test_ece_of_perfectly_calibrated_data_is_small():
    """p ~ U(0,1), y ~ Bernoulli(p), M = 200k, 20 bins.

    Each bin holds ~10k samples, so its accuracy deviates from its mean confidence by a normal error of
    std σ_b = sqrt(mean p(1-p) / n_b) ≈ 0.39 / 100. E[ECE] ≈ sqrt(2/π) · Σ_b (n_b/M) σ_b ≈ 0.0031 with a std
    of about 0.0005, so the bound 0.006 is more than five standard deviations above the mean.
    """
    g = torch.Generator().manual_seed(0)
    p = torch.rand(200_000, generator=g, dtype=torch.float64)
    y = (torch.rand(200_000, generator=g, dtype=torch.float64) < p).double()
    assert expected_calibration_error(p, y) < 0.006


def test_ece_hand_computed():
    # Bin [0.10, 0.15): conf 0.1, accuracy 1/4 -> |0.15| · 4/6; bin [0.80, 0.85): conf 0.8, accuracy 1/2 -> 0.3 · 2/6.
    p = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.8, 0.8], dtype=torch.float64)
    y = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert expected_calibration_error(p, y) == pytest.approx(0.15 * 4 / 6 + 0.3 * 2 / 6, abs=F64_TOL)
    # One over-confident bin: always 0.9, right half the time.
    assert expected_calibration_error(torch.full((10,), 0.9, dtype=torch.float64),
                                      torch.tensor([1.0, 0.0] * 5)) == pytest.approx(0.4, abs=F64_TOL)
    # Edges: p = 1 falls in the last bin, p = 0 in the first; both perfectly calibrated.
    assert expected_calibration_error(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.0
    # Two different confidences in one bin [0.5, 0.55) pool before the absolute value: |0.52 - 0.5| = 0.02.
    assert expected_calibration_error(torch.tensor([0.51, 0.53], dtype=torch.float64),
                                      torch.tensor([1.0, 0.0])) == pytest.approx(0.02, abs=F64_TOL)
    assert expected_calibration_error(torch.tensor([0.51, 0.53], dtype=torch.float64), torch.tensor([1.0, 0.0]),
                                      num_bins=100) == pytest.approx((0.49 + 0.53) / 2, abs=F64_TOL)  # apart


def test_ece_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        expected_calibration_error(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="labels"):
        expected_calibration_error(torch.tensor([0.5]), torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_calibration_error(torch.tensor([1.5]), torch.tensor([1.0]))


def test_reliability_diagram():
    p = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.8, 0.8, 1.0])
    y = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    d = reliability_diagram(p, y, num_bins=10)
    assert sum(d["count"]) == 7
    assert d["count"] == [0, 4, 0, 0, 0, 0, 0, 0, 2, 1]
    assert d["lower"][1] == 0.1 and d["upper"][1] == 0.2 and d["upper"][-1] == 1.0
    assert d["mean_confidence"][1] == pytest.approx(0.1, abs=1e-7) and d["accuracy"][1] == 0.25
    assert d["accuracy"][8] == 0.5 and d["mean_confidence"][0] is None and d["accuracy"][0] is None
    assert d["ece"] == pytest.approx(expected_calibration_error(p, y, num_bins=10), abs=F64_TOL)
    g = torch.Generator().manual_seed(1)
    big = reliability_diagram(torch.rand(5000, generator=g), torch.randint(0, 2, (5000,), generator=g).float())
    assert sum(big["count"]) == 5000 and len(big["count"]) == 20


# ----------------------------------------------------------------------------------------------- labels


def test_prefix_survival_labels_censor_unverified_slots():
    y = prefix_survival_labels(torch.tensor([2, 0, 3, 1, 0]), torch.tensor([3, 2, 3, 1, 0]), gamma=3)
    nan = float("nan")
    expected = torch.tensor([[1, 1, 0], [0, 0, nan], [1, 1, 1], [1, nan, nan], [nan, nan, nan]])
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="num_accepted"):
        prefix_survival_labels(torch.tensor([3]), torch.tensor([2]), gamma=3)
    with pytest.raises(ValueError, match="verify_lens"):
        prefix_survival_labels(torch.tensor([0]), torch.tensor([4]), gamma=3)


def test_fit_rejects_non_prefix_labels():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="prefix-survival"):
        fit_sts(z, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))  # rises after a rejection
    with pytest.raises(ValueError, match="prefix-survival"):
        fit_sts(z, torch.tensor([[1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]]))  # observed after a censored slot
    with pytest.raises(ValueError, match="float"):
        fit_sts(z, torch.ones(2, 3, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------- STS


def _synthetic(seed: int, M: int = 20_000, gamma: int = 7, scale: float = 3.0):
    """Proposals with known conditional acceptance q_k = σ(u_k); the head reports z_k = 3·u_k (over-confident).

    Acceptance is drawn slot by slot given the earlier slots were accepted. 70 % of proposals verify all γ
    slots, the rest a uniform ℓ in 1..γ-1, so later slots are censored for part of the data.
    Returns (z [M, γ], labels [M, γ], true prefix survival [M, γ]).
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(M, gamma, generator=g, dtype=torch.float64) * 1.2 + torch.linspace(1.8, 1.0, gamma,
                                                                                         dtype=torch.float64)
    accepted = torch.rand(M, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(u)  # [M, γ]
    ell = torch.where(torch.rand(M, generator=g) < 0.7, torch.full((M,), gamma),
                      torch.randint(1, gamma, (M,), generator=g))  # [M]
    num_accepted = torch.minimum(accepted.long().cumprod(dim=1).sum(dim=1), ell)
    return (scale * u).float(), prefix_survival_labels(num_accepted, ell, gamma), prefix_survival(torch.sigmoid(u))


@pytest.fixture(scope="module")
def fitted():
    z, y, _ = _synthetic(seed=0)
    return z, y, fit_sts(z, y)


def test_sts_calibrates_overconfident_head(fitted):
    z, y, temps = fitted
    assert len(temps) == 7 and all(isinstance(t, float) for t in temps)
    report = calibration_report(z, y, temps)
    for pos in report["positions"]:
        assert pos["ece_before"] > 0.10, pos  # the ×3 logits are badly over-confident
        assert pos["ece_after"] < 0.02, pos  # the requirement, in-sample
    # The true temperature is 3 (z = 3·u). Slot 1's ECE is sharp in T; later products flatten the objective.
    assert 2.5 < temps[0] < 3.6, temps
    # Held out: the ECE of the *true* survivals at these counts is 0.6-1.5 % (sampling noise alone), so 3 % is
    # a margin over noise, still far below the 12-27 % before calibration.
    z2, y2, _ = _synthetic(seed=1)
    for pos in calibration_report(z2, y2, temps)["positions"]:
        assert pos["ece_after"] < 0.03, pos


def test_sts_preserves_ranking(fitted):
    z, _, temps = fitted
    c = apply_sts(z.double(), temps)  # float64: no two distinct logits collapse onto one sigmoid value
    for k in range(z.shape[1]):
        order = torch.argsort(z[:, k], stable=True)
        assert bool((c[order, k].diff() >= 0).all())
        assert torch.equal(torch.argsort(c[:, k], stable=True), order)


def test_fit_is_sequential_and_matches_slot_by_slot_by_hand():
    z, y, _ = _synthetic(seed=2, M=1500, gamma=4)
    grid = torch.logspace(-1, 1, 41, dtype=torch.float64)  # 0.1 .. 10, enough for a hand loop
    temps = fit_sts(z, y, grid=grid)
    # By hand: slot by slot, every candidate scored with the public ECE, earlier temperatures fixed.
    fixed: list[float] = []
    a_prev = torch.ones(z.shape[0], dtype=torch.float64)
    for k in range(z.shape[1]):
        rows = ~y[:, k].isnan()
        scores = [expected_calibration_error(a_prev[rows] * torch.sigmoid(z[rows, k].double() / t), y[rows, k])
                  for t in grid.tolist()]
        best = min(range(len(scores)), key=lambda i: (scores[i], i))
        fixed.append(grid[best].item())
        a_prev = a_prev * torch.sigmoid(z[:, k].double() / fixed[-1])
    assert temps == fixed
    # Sequential dependence: slot 2's temperature moves when only slot 1's logits change.
    z_sharper = z.clone()
    z_sharper[:, 0] *= 4
    moved = fit_sts(z_sharper, y, grid=grid)
    assert moved[0] != temps[0] and moved[1] != temps[1]


def test_censored_slots_change_nothing():
    z, y, _ = _synthetic(seed=3, M=3000, gamma=5)
    censored = y.isnan()
    assert bool(censored.any())
    grid = torch.logspace(-1, 1, 61, dtype=torch.float64)
    z2 = torch.where(censored, torch.full_like(z, 40.0), z)  # a wild logit in every censored slot
    assert fit_sts(z, y, grid=grid) == fit_sts(z2, y, grid=grid)
    temps = fit_sts(z, y, grid=grid)
    assert calibration_report(z, y, temps) == calibration_report(z2, y, temps)
    # Whereas labelling those slots 0 (the wrong treatment) changes the fit.
    assert fit_sts(z, torch.nan_to_num(y, nan=0.0), grid=grid) != temps


def test_slot_without_verified_proposals_keeps_t1(caplog):
    z, y, _ = _synthetic(seed=4, M=800, gamma=3)
    y[:, 2] = float("nan")  # nobody verified slot 3
    with caplog.at_level(logging.WARNING, logger="reference.calibration"):
        temps = fit_sts(z, y)
    assert temps[2] == 1.0 and "slot 3" in caplog.text
    assert calibration_report(z, y, temps)["positions"][2]["ece_after"] is None


def test_apply_and_prefix_survival():
    z = torch.tensor([[0.0, 2.0, -1.0], [4.0, 0.0, 1.0]])
    c = apply_sts(z, [1.0, 2.0, 0.5])
    expected = torch.sigmoid(torch.tensor([[0.0, 1.0, -2.0], [4.0, 0.0, 2.0]]))
    torch.testing.assert_close(c, expected, rtol=1e-6, atol=0)  # float32 sigmoid: a few ulps
    a = prefix_survival(c)
    torch.testing.assert_close(a[:, 2], c[:, 0] * c[:, 1] * c[:, 2], rtol=1e-6, atol=0)
    assert bool((a[:, 1:] <= a[:, :-1]).all())
    with pytest.raises(ValueError, match="one temperature per slot"):
        apply_sts(z, [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        apply_sts(z, [1.0, 0.0, 1.0])


def test_default_grid():
    grid = default_temperature_grid()
    assert grid.numel() == 301 and bool((grid.diff() > 0).all())
    assert grid[0].item() == pytest.approx(0.05, rel=1e-12) and grid[-1].item() == pytest.approx(20.0, rel=1e-12)
    assert grid[150].item() == pytest.approx(1.0, abs=1e-12)  # T = 1 is on the grid
    assert math.log(grid[1].item() / grid[0].item()) == pytest.approx(math.log(400) / 300, rel=1e-9)


def _config(**kw):
    kw = {"block_size": 3, **kw}
    return DrafterConfig(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=128, target_num_layers=4, **kw)


def test_temperatures_for(caplog):
    calibration._warn_uncalibrated.cache_clear()
    cfg = _config(sts_temperatures={"greedy": [1.5, 2.0, 3.0]})
    assert temperatures_for(cfg, "greedy") == [1.5, 2.0, 3.0]
    with caplog.at_level(logging.WARNING, logger="reference.calibration"):
        assert temperatures_for(cfg, "sampling") == [1.0, 1.0, 1.0]
        assert temperatures_for(cfg, "sampling") == [1.0, 1.0, 1.0]
    assert caplog.text.count("'sampling'") == 1  # warned once
    with pytest.raises(ValueError, match="decoding mode"):
        temperatures_for(cfg, "beam")


def test_slot_with_too_few_verified_proposals_keeps_t1(caplog):
    """A deep slot reached by a handful of proposals is not fitted: its ECE minimiser would run to a grid edge."""
    z, y, _ = _synthetic(seed=5, M=800, gamma=3)
    reached = (~y[:, 2].isnan()).nonzero().flatten()
    y[reached[10:], 2] = float("nan")  # only 10 proposals verified slot 3
    with caplog.at_level(logging.WARNING, logger="reference.calibration"):
        temps = fit_sts(z, y, min_count=50)
    assert temps[2] == 1.0 and "(< 50)" in caplog.text
    assert fit_sts(z, y, min_count=50)[:2] == fit_sts(z, y, min_count=5)[:2]  # earlier slots unaffected


def test_ece_noise_floor_matches_simulated_calibrated_data_and_shrinks_with_samples():
    from reference.calibration import ece_noise_floor

    g = torch.Generator().manual_seed(3)
    small = torch.rand(500, generator=g)
    large = torch.rand(20000, generator=g)
    med_small, p95_small = ece_noise_floor(small, 20, repeats=100, seed=1)
    med_large, _ = ece_noise_floor(large, 20, repeats=100, seed=1)
    assert 0 < med_small <= p95_small
    assert med_large < med_small / 3  # ~1/sqrt(n): 40x the samples, ~6x smaller
    # An independent draw of calibrated labels lands in the simulated distribution's bulk.
    y = (torch.rand(500, generator=g) < small).float()
    assert expected_calibration_error(small, y) < 2 * p95_small
    # Certain predictions (0 or 1) have no sampling noise at all.
    assert ece_noise_floor(torch.tensor([0.0, 1.0, 1.0, 0.0]), repeats=10) == (0.0, 0.0)
    with pytest.raises(ValueError, match="non-empty"):
        ece_noise_floor(torch.tensor([]))


def test_calibration_report_carries_the_noise_floor():
    z = torch.randn(400, 3)
    labels = (torch.rand(400, 3) < torch.sigmoid(z)).float().cumprod(-1)  # prefix survival: non-increasing in k
    report = calibration_report(z, labels, [1.0, 1.0, 1.0])
    for pos in report["positions"]:
        assert 0 <= pos["ece_floor_median"] <= pos["ece_floor_p95"] < 0.5


# ------------------------------------------------------------------------------------ STS with a bias


def test_sts_bias_recovers_scale_and_offset():
    """z = 3·u − 1.5·3 (over-confident and offset): the log-loss fit finds T ≈ 3 and b ≈ 1.5 at slot 1, and the
    held-out ECE is far below what temperature alone reaches."""
    from reference.calibration import fit_sts_bias

    z, y, _ = _synthetic(seed=0)
    z_off = z - 4.5  # σ(z/3 + 1.5) = σ(u): the true calibration is T = 3, b = 1.5
    temps, biases = fit_sts_bias(z_off, y)
    assert len(temps) == len(biases) == 7
    assert 2.7 < temps[0] < 3.3 and 1.3 < biases[0] < 1.7, (temps, biases)
    z2, y2, _ = _synthetic(seed=1)
    biased = calibration_report(z2 - 4.5, y2, temps, biases=biases)
    assert biased["biases"] == biases
    assert all(p["ece_after"] < 0.02 for p in biased["positions"]), biased["positions"]
    temp_only = calibration_report(z2 - 4.5, y2, fit_sts(z_off, y))
    assert max(p["ece_after"] for p in temp_only["positions"]) > max(p["ece_after"] for p in biased["positions"])


def test_sts_bias_preserves_ranking_and_defaults():
    from reference.calibration import biases_for, fit_sts_bias

    z, y, _ = _synthetic(seed=2, M=3000)
    temps, biases = fit_sts_bias(z, y)
    c = apply_sts(z.double(), temps, biases)
    for k in range(z.shape[1]):
        assert torch.equal(torch.argsort(c[:, k], stable=True), torch.argsort(z[:, k], stable=True))
    assert torch.equal(apply_sts(z, temps, None), apply_sts(z, temps))  # no bias = the paper's STS
    assert torch.equal(apply_sts(z, [1.0] * 7, [0.0] * 7), torch.sigmoid(z))
    with pytest.raises(ValueError, match="bias"):
        apply_sts(z, temps, [0.0] * 6)
    cfg = _config(block_size=7, sts_biases={"greedy": biases})
    assert biases_for(cfg, "greedy") == biases and biases_for(cfg, "sampling") is None
    with pytest.raises(ValueError, match="sts_biases"):
        _config(block_size=7, sts_biases={"greedy": [float("inf")] * 7})


def test_sts_bias_slot_with_too_few_proposals_keeps_identity(caplog):
    from reference.calibration import fit_sts_bias

    z, y, _ = _synthetic(seed=3, M=400)
    y[:, 3:] = float("nan")  # slots 4..7 never verified
    with caplog.at_level(logging.WARNING):
        temps, biases = fit_sts_bias(z, y)
    assert temps[3:] == [1.0] * 4 and biases[3:] == [0.0] * 4


def test_calibrated_survival_reads_the_checkpoint_calibration():
    from reference.calibration import calibrated_survival

    z = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))
    cfg = _config(sts_temperatures={"greedy": [1.5, 2.0, 0.5]}, sts_biases={"greedy": [0.1, -0.2, 0.3]})
    assert torch.equal(calibrated_survival(cfg, "greedy", z),
                       prefix_survival(apply_sts(z, [1.5, 2.0, 0.5], [0.1, -0.2, 0.3])))
    assert torch.equal(calibrated_survival(cfg, "sampling", z), prefix_survival(torch.sigmoid(z)))  # uncalibrated
