"""Sequential Temperature Scaling (STS) of the confidence head, and the calibration metrics (docs/method.md §3).

Names follow ``docs/method.md``: ``p_t`` target, ``p_d`` draft, ``c_k`` the confidence of slot k,
``a_k = Π_{i≤k} c_i`` the prefix survival, ``ℓ`` the verify length, γ the block size.

The scheduler (docs/method.md §5) multiplies confidences and compares the products against step costs, so it needs
calibrated *absolute* values, not just a good ranking. STS fits one temperature per slot on held-out
proposals: each proposal gives raw confidence logits ``z_1..z_γ`` and prefix-survival labels
``y_k = 1[drafts 1..k all accepted]`` for the slots that were verified (``k ≤ ℓ``); unverified slots are
censored (NaN), never labelled 0. For ``k = 1..γ`` in order, ``T_k`` minimises the ECE of
``Π_{i≤k} σ(z_i/T_i)`` against ``y_k`` with ``T_1..T_{k-1}`` already fixed. Dividing a logit by a positive
temperature is monotone, so every slot keeps its ranking.

Two log-loss variants refine it, both strictly increasing in ``z``: :func:`fit_sts_bias` (a temperature and a bias
per slot, what ``scripts/calibrate.py`` ships) and :func:`fit_sts_beta` (beta calibration, three parameters per slot).
All three are applied by :func:`apply_sts`.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import Tensor

from reference.config import DrafterConfig

log = logging.getLogger(__name__)

DECODE_MODES = ("greedy", "sampling")


def default_temperature_grid() -> Tensor:
    """The default STS search grid: 301 log-spaced temperatures from 0.05 to 20.

    Why: T > 1 softens an over-confident head and T < 1 sharpens an under-confident one, and the two ends
    are symmetric in log-space (0.05 = 1/20), so with 301 points T = 1 is the exact midpoint (index 150).
    Neighbouring points differ by a factor 400^(1/300) ≈ 1.020, which moves a calibrated probability by
    less than 0.5 % (|dσ(z/T)/d log T| = σ(1-σ)|z/T| ≤ 0.23 over the logits that matter, times 0.02),
    well below the ~1 % ECE the paper reaches after calibration. A grid, unlike a gradient method, also
    copes with ECE being piecewise constant in T.
    """
    return torch.logspace(math.log10(0.05), math.log10(20.0), 301, dtype=torch.float64)


def _check_probs_labels(probs: Tensor, labels: Tensor, num_bins: int) -> None:
    if probs.dim() != 1 or labels.shape != probs.shape:
        raise ValueError(f"probs and labels must be 1-D of equal length, got {tuple(probs.shape)} "
                         f"and {tuple(labels.shape)}")
    if probs.numel() == 0:
        raise ValueError("ECE of an empty set is undefined: no probabilities given")
    if num_bins < 1:
        raise ValueError(f"num_bins must be ≥ 1, got {num_bins}")
    if bool(((probs < 0) | (probs > 1) | probs.isnan()).any()):
        raise ValueError("probs must lie in [0, 1]")
    if bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError("labels must be 0 or 1 (censored slots must be removed before computing ECE)")


def _bin_index(probs: Tensor, num_bins: int) -> Tensor:
    """Equal-width bins ``[i/B, (i+1)/B)`` on [0, 1], the last one closed so that p = 1 lands in it."""
    return (probs * num_bins).long().clamp(0, num_bins - 1)


def _ece_batched(probs: Tensor, labels: Tensor, num_bins: int) -> Tensor:
    """ECE of G (probability, label) vector pairs at once.

    Args:
        probs: ``[G, M]`` probabilities (e.g. one row per candidate temperature).
        labels: ``[M]`` 0/1 outcomes shared by every row, or ``[G, M]`` one label vector per row.
        num_bins: B.

    Returns:
        ``[G]`` float64 ``Σ_b (n_b/M)·|mean conf_b − accuracy_b| = Σ_b |Σ_{i∈b}(p_i − y_i)| / M``.
    """
    G, M = probs.shape
    probs = probs.double()
    gap = probs - labels.double().expand(G, M)  # [G, M] per-sample signed miscalibration
    bins = _bin_index(probs, num_bins) + num_bins * torch.arange(G, device=probs.device)[:, None]  # [G, M]
    per_bin = torch.zeros(G * num_bins, dtype=torch.float64, device=probs.device)
    per_bin.index_add_(0, bins.flatten(), gap.flatten())  # [G·B] Σ (p - y) in each bin
    return per_bin.view(G, num_bins).abs().sum(dim=1) / M


def expected_calibration_error(probs: Tensor, labels: Tensor, num_bins: int = 20) -> float:
    """Expected calibration error with equal-width bins, weighted by bin count.

    ``ECE = Σ_b (n_b / M) · |mean(p in b) − mean(y in b)|``, bins ``[i/B, (i+1)/B)`` with the last closed.

    Args:
        probs: ``[M]`` predicted probabilities in [0, 1].
        labels: ``[M]`` outcomes in {0, 1}.
        num_bins: B; docs/method.md §3 uses 20.
    """
    _check_probs_labels(probs, labels, num_bins)
    return float(_ece_batched(probs[None, :], labels, num_bins)[0])


def ece_noise_floor(probs: Tensor, num_bins: int = 20, repeats: int = 200, seed: int = 0) -> tuple[float, float]:
    """The ECE a perfectly calibrated predictor would show with these confidences on this many samples.

    Binned ECE is biased upwards on a finite sample: even when every ``y_i ~ Bernoulli(p_i)``, the per-bin
    means scatter around the confidences by about ``sqrt(p(1-p)/n_b)``. On ~2,000 proposals and 20 bins that
    floor is ~3 % where ``p`` is spread around 0.5, so a measured ECE is only evidence of miscalibration once it
    clears this floor. The floor is estimated by simulation: ``repeats`` label vectors drawn from ``probs``
    itself (seeded, so reports are reproducible), ECE of each.

    Args:
        probs: ``[M]`` predicted probabilities in [0, 1].
        num_bins: B, as in :func:`expected_calibration_error`.
        repeats: simulated label vectors.
        seed: seed of the simulation.

    Returns:
        ``(median, 95th percentile)`` of the simulated ECE.
    """
    if probs.dim() != 1 or probs.numel() == 0:
        raise ValueError(f"probs must be a non-empty 1-D tensor, got shape {tuple(probs.shape)}")
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    p = probs.detach().double().cpu()
    gen = torch.Generator().manual_seed(seed)
    y = (torch.rand(repeats, p.numel(), generator=gen, dtype=torch.float64) < p[None, :]).double()  # [R, M]
    ece = _ece_batched(p.expand(repeats, -1), y, num_bins)  # [R]
    return float(ece.median()), float(ece.quantile(0.95))


def reliability_diagram(probs: Tensor, labels: Tensor, num_bins: int = 20) -> dict:
    """Per-bin data of a reliability diagram, JSON-ready.

    Returns:
        ``{"num_bins", "lower", "upper", "count", "mean_confidence", "accuracy", "ece"}``; the per-bin
        entries are lists of length B, with ``None`` mean/accuracy for empty bins.
    """
    _check_probs_labels(probs, labels, num_bins)
    probs, labels = probs.double(), labels.double()
    bins = _bin_index(probs, num_bins)  # [M]
    count = torch.bincount(bins, minlength=num_bins)  # [B]
    conf_sum = torch.bincount(bins, weights=probs, minlength=num_bins)  # [B]
    hit_sum = torch.bincount(bins, weights=labels, minlength=num_bins)  # [B]
    n = count.tolist()
    return {
        "num_bins": num_bins,
        "lower": [i / num_bins for i in range(num_bins)],
        "upper": [(i + 1) / num_bins for i in range(num_bins)],
        "count": n,
        "mean_confidence": [float(c) / k if k else None for c, k in zip(conf_sum.tolist(), n)],
        "accuracy": [float(h) / k if k else None for h, k in zip(hit_sum.tolist(), n)],
        "ece": float(_ece_batched(probs[None, :], labels, num_bins)[0]),
    }


def prefix_survival_labels(num_accepted: Tensor, verify_lens: Tensor, gamma: int) -> Tensor:
    """Prefix-survival labels of M proposals, with unverified slots censored.

    ``y_k = 1[drafts 1..k all accepted] = 1[k ≤ num_accepted]`` for ``k ≤ ℓ``, and NaN for ``k > ℓ``: a slot
    the scheduler never sent to the target says nothing about the drafter. A slot ``k ≤ ℓ`` after the first
    rejection is a real 0 (its prefix did not survive).

    Args:
        num_accepted: ``[M]`` int, accepted drafts per proposal (``0 ≤ num_accepted ≤ ℓ``).
        verify_lens: ``[M]`` int, verify length ℓ per proposal (``0 ≤ ℓ ≤ γ``).
        gamma: block size γ.

    Returns:
        ``[M, γ]`` float32 labels in {0, 1, NaN}.
    """
    if num_accepted.dim() != 1 or verify_lens.shape != num_accepted.shape:
        raise ValueError(f"num_accepted and verify_lens must be 1-D [M] of equal length, got "
                         f"{tuple(num_accepted.shape)} and {tuple(verify_lens.shape)}")
    if gamma < 1:
        raise ValueError(f"gamma must be ≥ 1, got {gamma}")
    acc, ell = num_accepted.long(), verify_lens.long()
    if bool(((ell < 0) | (ell > gamma)).any()):
        raise ValueError(f"verify_lens must lie in [0, {gamma}]")
    if bool(((acc < 0) | (acc > ell)).any()):
        raise ValueError("num_accepted must lie in [0, verify_len] for every proposal")
    k = torch.arange(1, gamma + 1, device=acc.device)[None, :]  # [1, γ]
    y = (k <= acc[:, None]).float()  # [M, γ]
    return torch.where(k <= ell[:, None], y, torch.full_like(y, float("nan")))


def _check_logits_labels(conf_logits: Tensor, labels: Tensor) -> None:
    if conf_logits.dim() != 2 or labels.shape != conf_logits.shape:
        raise ValueError(f"conf_logits and labels must both be [M, γ], got {tuple(conf_logits.shape)} "
                         f"and {tuple(labels.shape)}")
    if not labels.is_floating_point():
        raise ValueError(f"labels must be float with NaN for censored slots, got {labels.dtype}")
    known = ~labels.isnan()
    if bool((known & (labels != 0) & (labels != 1)).any()):
        raise ValueError("labels must be 0, 1 or NaN (censored)")
    # Prefix-survival labels never rise along k and are never observed after a censored slot.
    later = labels[:, 1:]
    earlier = labels[:, :-1]
    if bool((~later.isnan() & (earlier.isnan() | (later > earlier))).any()):
        raise ValueError("labels are not prefix-survival labels: y_k must be non-increasing in k and censoring "
                         "must be a suffix (use prefix_survival_labels; per-slot acceptance labels are wrong here)")


def fit_sts(conf_logits: Tensor, labels: Tensor, *, grid: Tensor | None = None, num_bins: int = 20,
            min_count: int = 50) -> list[float]:
    """Fit one temperature per slot, sequentially (docs/method.md §3).

    For ``k = 1..γ``: ``T_k = argmin_{T ∈ grid} ECE(Π_{i<k} σ(z_i/T_i) · σ(z_k/T), y_k)`` over the rows where
    ``y_k`` is not censored, with ``T_1..T_{k-1}`` fixed. Ties go to the smallest T in the grid. A slot with no
    uncensored row keeps ``T_k = 1`` (and a warning is logged), and so does a slot with fewer than
    ``min_count`` of them: with a handful of labels (deep slots of a weak drafter) the ECE minimiser runs to an
    edge of the grid and the temperature means nothing.

    Args:
        conf_logits: ``[M, γ]`` raw confidence logits z.
        labels: ``[M, γ]`` prefix-survival labels (:func:`prefix_survival_labels`), NaN = censored.
        grid: ``[G]`` positive candidate temperatures; default :func:`default_temperature_grid`.
        num_bins: ECE bins; docs/method.md §3 uses 20.
        min_count: fewest verified proposals a slot needs to be fitted (20 bins, a couple of labels per bin).

    Returns:
        ``[T_1, .., T_γ]`` as Python floats.
    """
    _check_logits_labels(conf_logits, labels)
    grid = default_temperature_grid() if grid is None else grid.double().flatten()
    if grid.numel() == 0 or bool((grid <= 0).any()) or not bool(grid.isfinite().all()):
        raise ValueError("grid must hold finite positive temperatures")
    z = conf_logits.double()  # [M, γ]
    grid = grid.to(z.device)
    a_prev = torch.ones(z.shape[0], dtype=torch.float64, device=z.device)  # [M] Π_{i<k} ĉ_i, fixed so far
    temps: list[float] = []
    for k in range(z.shape[1]):
        rows = ~labels[:, k].isnan()  # [M] uncensored at slot k
        if int(rows.sum()) < max(min_count, 1):
            log.warning("STS: slot %d has %d verified proposals (< %d); keeping T = 1", k + 1, int(rows.sum()),
                        max(min_count, 1))
            t_k = 1.0
        else:
            cand = a_prev[rows][None, :] * torch.sigmoid(z[rows, k][None, :] / grid[:, None])  # [G, m]
            ece = _ece_batched(cand, labels[rows, k].to(z.device), num_bins)  # [G]
            t_k = float(grid[int(torch.argmin(ece))])  # argmin returns the first minimum: smallest T on ties
        temps.append(t_k)
        a_prev = a_prev * torch.sigmoid(z[:, k] / t_k)
    return temps


def _fit_sequential_logloss(conf_logits: Tensor, labels: Tensor, logit, num_params: int, *, min_count: int,
                            min_each: int, l2: float, max_iter: int, name: str) -> list[Tensor]:
    """Fit ``ĉ_k = σ(logit(θ_k, z_k))`` slot by slot by the log-loss of the prefix survival (shared by the log-loss
    methods). For ``k = 1..γ``, with slots ``< k`` fixed, ``θ_k`` minimises the log-loss of ``Π_{i<k} ĉ_i · ĉ_k``
    against ``y_k`` over the uncensored rows plus ``l2 · |θ_k|²`` (L-BFGS in float64 from ``θ = 0``, which every method
    makes the identity ``ĉ = σ(z)``; deterministic). A slot with fewer than ``min_count`` verified proposals, or fewer
    than ``min_each`` accepted or rejected ones, keeps ``θ_k = 0``.

    Returns:
        γ float64 parameter vectors ``[num_params]``.
    """
    _check_logits_labels(conf_logits, labels)
    z = conf_logits.double()  # [M, γ]
    a_prev = torch.ones(z.shape[0], dtype=torch.float64, device=z.device)  # [M] Π_{i<k} ĉ_i, fixed so far
    thetas = []
    for k in range(z.shape[1]):
        rows = ~labels[:, k].isnan()
        positives = int(labels[rows, k].sum())
        params = torch.zeros(num_params, dtype=torch.float64, device=z.device, requires_grad=True)
        if int(rows.sum()) < max(min_count, 1) or min(positives, int(rows.sum()) - positives) < min_each:
            log.warning("%s: slot %d has %d verified proposals, %d accepted (need %d and %d of each); keeping the "
                        "identity", name, k + 1, int(rows.sum()), positives, max(min_count, 1), min_each)
        else:
            y, prev, zk = labels[rows, k].double().to(z.device), a_prev[rows], z[rows, k]
            opt = torch.optim.LBFGS([params], max_iter=max_iter, line_search_fn="strong_wolfe")

            def closure(y=y, prev=prev, zk=zk, params=params, opt=opt):
                opt.zero_grad()
                # log Π_{i≤k} ĉ_i, computed stably; log(1 - a) through log1p(-a) with a < 1
                log_a = prev.clamp_min(1e-300).log() + torch.nn.functional.logsigmoid(logit(params, zk))
                log_not_a = torch.log1p(-log_a.exp().clamp(max=1 - 1e-12))
                loss = -(y * log_a + (1 - y) * log_not_a).mean() + l2 * (params**2).sum()
                loss.backward()
                return loss

            with torch.enable_grad():
                opt.step(closure)
        theta = params.detach()
        thetas.append(theta)
        a_prev = a_prev * torch.sigmoid(logit(theta, z[:, k]))
    return thetas


def fit_sts_bias(conf_logits: Tensor, labels: Tensor, *, min_count: int = 50, min_each: int = 10,
                 l2: float = 1e-3, max_iter: int = 200) -> tuple[list[float], list[float]]:
    """STS with a per-slot bias (sequential Platt scaling): ``ĉ_k = σ(z_k / T_k + b_k)``, fitted slot by slot.

    For ``k = 1..γ``, with slots ``< k`` fixed: ``(T_k, b_k)`` minimise the log-loss of ``Π_{i<k} ĉ_i · ĉ_k`` against
    ``y_k`` over the uncensored rows, plus ``l2 · (log² T_k + b_k²)`` (L-BFGS on ``(log T_k, b_k)`` in float64 from
    ``(1, 0)``; deterministic). The small penalty keeps deep slots with a few dozen positives from running to
    degenerate fits (a temperature of 10⁴, a bias of 10) that an unpenalised log-loss reaches there.
    Why not the paper's temperature-only ECE grid search (:func:`fit_sts`): a temperature cannot move a slot's mean
    confidence, only its spread, and on our drafters the confidences sit a few points above the realised rate; and
    the binned ECE is a noisy objective that a grid search overfits. On the H200 proposals of 2026-11-29, averaged
    over 10 random half splits, held-out ECE per slot fell from 3.8 2.9 2.2 1.6 0.9 0.6 0.4 % (STS) to
    1.5 1.2 0.8 0.6 0.4 0.4 0.3 % (this) in sampling mode, and from 2.4 1.4 1.1 1.0 1.1 0.9 0.8 % to
    2.0 1.3 1.0 0.7 0.5 0.5 0.5 % in greedy mode (13,741 proposals; ``scripts/compare_calibration.py``,
    docs/benchmarks/calibration-methods.json).
    The bias shifts every confidence of a slot alike, so the ranking is preserved as with STS.

    Args:
        conf_logits: ``[M, γ]`` raw confidence logits z.
        labels: ``[M, γ]`` prefix-survival labels (:func:`prefix_survival_labels`), NaN = censored.
        min_count: fewest verified proposals a slot needs to be fitted; below it ``(T_k, b_k) = (1, 0)``.
        min_each: fewest accepted and fewest rejected ones it needs, likewise.
        l2: weight of the penalty on ``(log T_k, b_k)``.
        max_iter: L-BFGS iterations per slot.

    Returns:
        ``([T_1, .., T_γ], [b_1, .., b_γ])`` as Python floats.
    """
    thetas = _fit_sequential_logloss(conf_logits, labels, lambda p, z: z / p[0].exp() + p[1], 2, min_count=min_count,
                                     min_each=min_each, l2=l2, max_iter=max_iter, name="STS")
    return [float(t[0].exp()) for t in thetas], [float(t[1]) for t in thetas]


def fit_sts_beta(conf_logits: Tensor, labels: Tensor, *, min_count: int = 50, min_each: int = 10,
                 l2: float = 1e-3, max_iter: int = 200) -> tuple[list[float], list[float], list[float]]:
    """Beta calibration per slot, fitted slot by slot like :func:`fit_sts_bias`:
    ``ĉ_k = σ(α_k · log c_k − β_k · log(1 − c_k) + m_k)`` on the raw confidence ``c_k = σ(z_k)``.

    Three parameters per slot instead of two: where STS + bias can only stretch and shift the logit, the two
    exponents bend the map differently at the confident and the unconfident end (a head whose high confidences
    are over-confident and whose low ones are about right, say). ``α, β > 0`` make it strictly increasing in
    ``z``, so the ranking is preserved; ``α = β = 1, m = 0`` is the identity. The fit runs on
    ``(log α_k, log β_k, m_k)`` from 0 with the penalty ``l2 · |·|²`` of :func:`fit_sts_bias`, so ``α, β`` stay
    positive by construction.

    Since ``log σ(z) − log σ(−z) = z``, the same map is ``σ(z / T + b + w · log σ(z))`` with ``T = 1/β``,
    ``b = m``, ``w = α − β``: STS + bias plus one term, which is the form :func:`apply_sts` takes
    (``log_weights``) and the checkpoint stores (``w = 0`` is STS + bias). On the recorded H200 proposals of
    ``docs/benchmarks/data/`` (10 random half splits) held-out ECE at slots 1–3 of the two weaker drafters falls
    by 0.3–0.9 points against STS + bias and is unchanged on the 13,741-proposal set that STS + bias already fits at
    the noise floor (``scripts/compare_calibration.py``, docs/benchmarks/calibration-methods.json).

    Args:
        conf_logits: ``[M, γ]`` raw confidence logits z.
        labels: ``[M, γ]`` prefix-survival labels (:func:`prefix_survival_labels`), NaN = censored.
        min_count: fewest verified proposals a slot needs to be fitted; below it the slot keeps the identity
            ``(T_k, b_k, w_k) = (1, 0, 0)``.
        min_each: fewest accepted and fewest rejected ones it needs, likewise.
        l2: weight of the penalty on ``(log α_k, log β_k, m_k)``.
        max_iter: L-BFGS iterations per slot.

    Returns:
        ``([T_1, .., T_γ], [b_1, .., b_γ], [w_1, .., w_γ])`` as Python floats, for :func:`apply_sts`.
    """
    F = torch.nn.functional

    def logit(p, z):  # α·log σ(z) − β·log σ(−z) + m
        return p[0].exp() * F.logsigmoid(z) - p[1].exp() * F.logsigmoid(-z) + p[2]

    thetas = _fit_sequential_logloss(conf_logits, labels, logit, 3, min_count=min_count, min_each=min_each, l2=l2,
                                     max_iter=max_iter, name="beta calibration")
    alpha, beta = [float(t[0].exp()) for t in thetas], [float(t[1].exp()) for t in thetas]
    return [1.0 / b for b in beta], [float(t[2]) for t in thetas], [a - b for a, b in zip(alpha, beta)]


def _check_temperatures(conf_logits: Tensor, temperatures) -> Tensor:
    t = torch.as_tensor(temperatures, dtype=torch.float64).flatten()
    if conf_logits.dim() < 1 or t.numel() != conf_logits.shape[-1]:
        raise ValueError(f"need one temperature per slot: {t.numel()} temperatures for conf_logits "
                         f"{tuple(conf_logits.shape)}")
    if bool((t <= 0).any()) or not bool(t.isfinite().all()):
        raise ValueError(f"temperatures must be finite and positive, got {t.tolist()}")
    return t


def apply_sts(conf_logits: Tensor, temperatures, biases=None, log_weights=None) -> Tensor:
    """Calibrated per-slot confidences ``ĉ_k = σ(z_k / T_k + b_k + w_k · log σ(z_k))`` (``w = 0``: STS + bias,
    ``b = w = 0``: the paper's STS; ``w ≠ 0`` comes from :func:`fit_sts_beta`).

    The operations run in this order, in the dtype of ``conf_logits``: ``z / T``, ``+ b``, ``+ w · logsigmoid(z)``,
    ``sigmoid``; an engine that reproduces the reference's survivals has to follow it.

    Args:
        conf_logits: ``[.., γ]`` raw confidence logits.
        temperatures: γ positive temperatures (list or tensor).
        biases: γ finite biases, or ``None`` for none.
        log_weights: γ finite weights ``w_k > −1/T_k`` (what keeps the map increasing in z), or ``None`` for none.

    Returns:
        ``[.., γ]`` confidences in the dtype of ``conf_logits`` (float32 for integer input).
    """
    t = _check_temperatures(conf_logits, temperatures)
    dtype = conf_logits.dtype if conf_logits.is_floating_point() else torch.float32
    x = conf_logits / t.to(device=conf_logits.device, dtype=dtype)
    if biases is not None:
        b = torch.as_tensor(biases, dtype=torch.float64).flatten()
        if b.numel() != t.numel() or not bool(b.isfinite().all()):
            raise ValueError(f"need one finite bias per slot ({t.numel()}), got {b.tolist()}")
        x = x + b.to(device=conf_logits.device, dtype=dtype)
    if log_weights is not None:
        w = _check_log_weights(log_weights, t)
        z = conf_logits if conf_logits.is_floating_point() else conf_logits.to(dtype)
        x = x + w.to(device=conf_logits.device, dtype=dtype) * torch.nn.functional.logsigmoid(z)
    return torch.sigmoid(x)


def _check_log_weights(log_weights, temperatures: Tensor) -> Tensor:
    w = torch.as_tensor(log_weights, dtype=torch.float64).flatten()
    if w.numel() != temperatures.numel() or not bool(w.isfinite().all()):
        raise ValueError(f"need one finite log weight per slot ({temperatures.numel()}), got {w.tolist()}")
    if bool((w <= -1.0 / temperatures).any()):
        raise ValueError(f"log weights must exceed -1/T per slot (else the calibration is not increasing in z), got "
                         f"{w.tolist()} with temperatures {temperatures.tolist()}")
    return w


def prefix_survival(conf: Tensor) -> Tensor:
    """Prefix survival ``a_k = Π_{i≤k} c_i`` along the last dimension: ``[.., γ] -> [.., γ]``."""
    return torch.cumprod(conf, dim=-1)


def calibration_report(conf_logits: Tensor, labels: Tensor, temperatures, num_bins: int = 20, biases=None,
                       log_weights=None) -> dict:
    """Per-slot ECE of the prefix survival before (T = 1) and after the calibration (:func:`apply_sts`), JSON-ready.

    Returns:
        ``{"num_bins", "temperatures", "positions": [...]}``, one entry per slot k with ``k``, ``count``
        (uncensored proposals), ``survival_rate`` (mean y_k), ``mean_a_before``/``mean_a_after`` and
        ``ece_before``/``ece_after``; the float fields are ``None`` where ``count`` is 0.
    """
    _check_logits_labels(conf_logits, labels)
    t = _check_temperatures(conf_logits, temperatures)
    z = conf_logits.double()
    a_before = prefix_survival(torch.sigmoid(z))  # [M, γ]
    a_after = prefix_survival(apply_sts(z, t, biases, log_weights))  # [M, γ]
    positions = []
    for k in range(z.shape[1]):
        rows = ~labels[:, k].isnan()
        n = int(rows.sum())
        entry: dict = {"k": k + 1, "count": n}
        if n:
            y = labels[rows, k].double()
            entry.update(
                survival_rate=float(y.mean()),
                mean_a_before=float(a_before[rows, k].mean()),
                mean_a_after=float(a_after[rows, k].mean()),
                ece_before=expected_calibration_error(a_before[rows, k], y, num_bins),
                ece_after=expected_calibration_error(a_after[rows, k], y, num_bins),
            )
            entry["ece_floor_median"], entry["ece_floor_p95"] = ece_noise_floor(a_after[rows, k], num_bins, seed=k)
        else:
            entry.update(survival_rate=None, mean_a_before=None, mean_a_after=None, ece_before=None, ece_after=None,
                         ece_floor_median=None, ece_floor_p95=None)
        positions.append(entry)
    report = {"num_bins": num_bins, "temperatures": [float(x) for x in t.tolist()], "positions": positions}
    if biases is not None:
        report["biases"] = [float(b) for b in biases]
    if log_weights is not None:
        report["log_weights"] = [float(w) for w in log_weights]
    return report


@functools.cache
def _warn_uncalibrated(mode: str) -> None:
    """Log once per mode (the cache is the once-ness) that the scheduler runs on raw confidences."""
    log.warning("no STS temperatures for decoding mode %r: using raw confidences (T = 1); "
                "run scripts/calibrate.py for calibrated prefix survivals", mode)


def calibrated_survival(config: DrafterConfig, mode: str, conf_logits: Tensor) -> Tensor:
    """Prefix survivals ``a_k = Π_{i≤k} σ(z_i / T_i + b_i + w_i · log σ(z_i))`` of raw confidence logits ``[.., γ]``
    under the checkpoint's calibration for decoding ``mode`` (what the scheduler reads)."""
    return prefix_survival(apply_sts(conf_logits, temperatures_for(config, mode), biases_for(config, mode),
                                     log_weights_for(config, mode)))


def log_weights_for(config: DrafterConfig, mode: str) -> list[float] | None:
    """The beta-calibration log weights ``w_k`` of one decoding mode (:func:`fit_sts_beta`), or ``None`` (STS or
    STS + bias)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"unknown decoding mode {mode!r}; choose one of {', '.join(DECODE_MODES)}")
    weights = config.sts_log_weights.get(mode)
    return [float(w) for w in weights] if weights else None


def biases_for(config: DrafterConfig, mode: str) -> list[float] | None:
    """The calibration biases of one decoding mode, or ``None`` (the paper's STS: no bias)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"unknown decoding mode {mode!r}; choose one of {', '.join(DECODE_MODES)}")
    biases = config.sts_biases.get(mode)
    return [float(b) for b in biases] if biases else None


def temperatures_for(config: DrafterConfig, mode: str) -> list[float]:
    """The STS temperatures of one decoding mode ("greedy" or "sampling"); all ones if uncalibrated.

    Greedy labels are argmax matches and sampling labels are rejection-sampling outcomes, so the two modes
    keep separate sets (docs/method.md §3).
    """
    if mode not in DECODE_MODES:
        raise ValueError(f"unknown decoding mode {mode!r}; choose one of {', '.join(DECODE_MODES)}")
    temps = config.sts_temperatures.get(mode)
    if not temps:
        _warn_uncalibrated(mode)
        return [1.0] * config.block_size
    return [float(t) for t in temps]
