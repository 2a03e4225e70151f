"""The host planning's Python-float fast paths (``optimized/scheduler.py``) give the very results of its NumPy paths
and of the reference: the draft gate's moving-average fold (:func:`fold_floats`, ``DraftGate.PYTHON_MAX_FOLD``) and
the stale budget of a step in which every request has its row (``BudgetPlanner.stale_budget``).

Both fast paths replace float32 NumPy arithmetic by Python floats, so these tests compare bits, on random inputs:
NaN rows, ties, subnormal survivals, R = 1, and batch sizes on both sides of each size threshold.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from optimized.scheduler import BudgetPlanner, DraftGate, fold_floats
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.scheduler import fold_recent, stale_budget, stale_mean


def _same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 arrays bit for bit (so -0.0 differs from 0.0), NaN where the other is NaN."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    known = ~np.isnan(a)
    return np.array_equal(a[known].view(np.uint32), b[known].view(np.uint32))


def _random_float32(rng: np.random.Generator, n: int) -> np.ndarray:
    """``[n]`` float32 in [0, 1]: half uniform, half uniform over the bit patterns (every exponent down to the
    subnormals equally often), some exact ties and zeros."""
    uniform = rng.random(n, dtype=np.float32)
    bits = rng.integers(0, 0x3F800001, n, dtype=np.uint32).view(np.float32)  # 0x3F800000 is 1.0
    a = np.where(rng.random(n) < 0.5, uniform, bits)
    a[rng.random(n) < 0.05] = 0.5  # ties
    a[rng.random(n) < 0.02] = 0.0
    return a.astype(np.float32)


def test_fold_floats_is_the_float32_fold_bit_for_bit():
    """``old + (new − old) / window`` in float64 rounded to float32 after each operation is NumPy's (and torch's)
    float32 fold, on a million random pairs, subnormals included; NaN averages take the draft itself."""
    rng = np.random.default_rng(0)
    n = 1 << 20
    old, new = _random_float32(rng, n), _random_float32(rng, n)
    old[rng.random(n) < 0.1] = np.nan  # no average yet
    new[rng.random(n) < 0.01] = np.nan  # a NaN draft: NaN stays NaN
    for window in (1, 2, 3, 4, 7, 10, 64):
        w = np.float32(window)
        expected = np.where(np.isnan(old), new, old + (new - old) / w)  # the engine's NumPy fold
        got = np.frombuffer(fold_floats(old.tolist(), new.tolist(), float(w)), dtype=np.float32)
        assert _same_floats(got, expected), window
        ref = fold_recent(torch.from_numpy(old[:4096]), torch.from_numpy(new[:4096]), window).numpy()  # the reference
        assert _same_floats(got[:4096], ref), window
    # without any NaN average the select is skipped: the same floats still
    clean = np.nan_to_num(old, nan=0.25)
    expected = clean + (new - clean) / np.float32(4)
    assert _same_floats(np.frombuffer(fold_floats(clean.tolist(), new.tolist(), 4.0), dtype=np.float32), expected)


def _gate(max_fold: int, g: int, slots: int, window: int) -> DraftGate:
    gate = DraftGate(SchedulerConfig(mode="adaptive", gate_window=window), gamma=g, max_num_seqs=slots, planner=None)
    gate.PYTHON_MAX_FOLD = max_fold  # the instance's threshold: 0 always NumPy, huge always Python floats
    return gate


def test_gate_fold_on_python_floats_equals_the_numpy_fold_and_the_reference():
    """Three gates fed the same run — NumPy only, Python floats only, and the default threshold (which crosses it
    as R changes) — return the same float32 moving averages bit for bit and keep the same per-slot state; each
    average is the reference's ``fold_recent`` of the request's drafts. The run has R = 1, batches on both sides of
    ``PYTHON_MAX_FOLD``, slots changing hands, requests with several drafts to fold (several passes), some with
    none, NaN drafts, tied survivals and restarts (a draft after plain steps)."""
    rng = np.random.default_rng(1)
    for g, window in ((7, 4), (3, 2), (1, 8)):
        top = DraftGate.PYTHON_MAX_FOLD // g  # the largest R folded on Python floats by default
        slots = top + 8
        gates = [_gate(0, g, slots, window), _gate(10**9, g, slots, window), _gate(DraftGate.PYTHON_MAX_FOLD, g,
                                                                                    slots, window)]
        owners: dict[int, SimpleNamespace] = {}
        crossed = set()
        for step in range(120):
            r = int(rng.choice([1, 1, 2, 4, top, top + 1, slots]))  # R·γ on both sides of the default threshold
            chosen = sorted(rng.choice(slots, size=r, replace=False).tolist(), key=lambda _: rng.random())
            seqs = []
            for slot in chosen:
                if slot not in owners or rng.random() < 0.1:  # a new request takes the slot
                    owners[slot] = SimpleNamespace(slot=slot, survivals=[], rows=[])
                seq = owners[slot]
                for _ in range(int(rng.choice([0, 1, 1, 1, 2, 3]))):  # drafts since the last gate
                    a = np.cumprod(_random_float32(rng, g)).astype(np.float32)  # non-increasing, as survivals
                    if rng.random() < 0.02:
                        a[rng.integers(0, g):] = np.nan
                    seq.survivals.append(a)
                seqs.append(seq)
            crossed.add(r * g <= DraftGate.PYTHON_MAX_FOLD)
            got = [gate.recent_survivals(seqs) for gate in gates]
            if got[0] is None:
                assert got[1] is None and got[2] is None, step
            else:
                assert _same_floats(got[1], got[0]) and _same_floats(got[2], got[0]), (g, step)
                for i, seq in enumerate(seqs):  # the reference: every draft of the request, folded one by one
                    acc = torch.full((g,), float("nan"))
                    for a in seq.survivals[seq.since if hasattr(seq, "since") else 0:]:
                        acc = fold_recent(acc, torch.from_numpy(a), window)
                    assert _same_floats(got[0][i], acc.numpy()), (g, step, i)
            assert _same_floats(gates[1]._recent, gates[0]._recent) and _same_floats(gates[2]._recent,
                                                                                      gates[0]._recent)
            assert gates[1]._count == gates[0]._count == gates[2]._count
            if step % 17 == 16:  # a draft after plain steps restarts the averages (DraftGate.decide)
                for gate in gates:
                    gate._recent[[s.slot for s in seqs]] = np.nan
                for seq in seqs:
                    seq.since = len(seq.survivals)
        assert crossed == {True, False}


def _cost(rng: np.random.Generator, r: int, g: int) -> CostTable:
    sizes = sorted({int(x) for x in rng.integers(1, r * (g + 1) + 8, 6)} | {r, r * (g + 1)})
    ms = np.cumsum(rng.random(len(sizes)) * 3) + 1.0
    draft = float(rng.random()) * 4
    return CostTable(verify_ms=dict(zip(sizes, ms.tolist())), draft_ms={1: draft, 8: draft + 0.1})


def test_stale_budget_on_python_floats_equals_the_reference():
    """``BudgetPlanner.stale_budget`` as the engine calls it (``check=False``): on steps in which every request has
    a stale row it plans on Python floats (up to ``PYTHON_MAX_CANDIDATES`` survivals), otherwise as before. Over a
    run of random stale matrices (R = 1, sizes on both sides of the threshold, ties, some NaN rows, all-NaN steps
    that take the prior) the budgets equal the reference's ``stale_budget`` with the reference's prior, and so does
    the prior kept; with ``record=False`` nothing is kept."""
    rng = np.random.default_rng(2)
    for g in (1, 4, 7):
        planner, prior, crossed = BudgetPlanner(None), None, set()
        for step in range(150):
            r = int(rng.choice([1, 1, 2, 5, 16, 36, 37, 40]))  # 36·7 = 252 ≤ 256 < 37·7
            planner.cost = cost = _cost(rng, r, g)
            conf = rng.random((r, g), dtype=np.float32)
            if rng.random() < 0.3:
                conf = np.round(conf * 4) / 4  # heavy ties
            a = np.cumprod(conf, axis=1).astype(np.float32)  # [R, γ]
            kind = rng.random()
            if kind < 0.15:
                a[:] = np.nan  # nobody has a stale row: the prior fills them
            elif kind < 0.3:
                a[rng.random(r) < 0.5] = np.nan  # some requests are too new
            record = bool(rng.random() < 0.9)
            crossed.add(a.size <= planner.PYTHON_MAX_CANDIDATES and not np.isnan(a).any())
            t0 = r + int(rng.integers(0, 3))
            n_s = None if rng.random() < 0.5 else r + 1
            expected = stale_budget(torch.from_numpy(a.copy()), cost, t0, n_s, prior=prior)
            assert planner.stale_budget(a, t0, n_s, check=False, record=record) == expected, (g, step, r)
            if record and not np.isnan(a).all():  # the reference's Scheduler keeps this step's mean stale curve
                prior = stale_mean(torch.from_numpy(a.copy()))
            want = None if prior is None else prior.numpy()
            got = planner.stale_prior()
            assert (got is None and want is None) or _same_floats(got, want), (g, step)
        assert crossed == {True, False}


def test_stale_budget_with_checks_or_a_survival_scale_takes_the_checked_path():
    """The fast path is for the engine's own survivals only: with ``check`` the reference's range and monotonicity
    checks still run, and with a survival scale the scaled rows are planned (both equal to their NumPy twins)."""
    cost = CostTable.affine(fixed_ms=2.0, per_token_ms=0.05, draft_fixed_ms=0.5, sizes=list(range(1, 65)))
    planner = BudgetPlanner(cost)
    bad = np.array([[0.5, 0.9]], dtype=np.float32)  # increasing: not prefix survivals
    try:
        planner.stale_budget(bad, 1)
    except ValueError as e:
        assert "non-increasing" in str(e)
    else:
        raise AssertionError("checked survivals were not checked")
    a = np.array([[0.9, 0.7, 0.2], [0.6, 0.5, 0.5]], dtype=np.float32)
    planner.survival_scale = np.array([1.1, 0.8, 0.5])
    scaled = planner._scaled(a)
    plain = BudgetPlanner(cost)
    assert planner.stale_budget(a, 2, check=False) == plain.stale_budget(scaled, 2, check=False) == stale_budget(
        torch.from_numpy(scaled.copy()), cost, 2)
