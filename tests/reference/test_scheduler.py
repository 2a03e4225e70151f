"""Tests of reference/scheduler.py: optimality against exhaustive search, Algorithm 1's early stop, the
deterministic tie-break, every policy, and losslessness computed exactly by enumerating outcomes."""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from fractions import Fraction

import pytest
import torch

from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.scheduler import (
    Scheduler,
    algorithm1,
    allocate_top_b,
    best_budget,
    expected_tokens,
    fill_stale_rows,
    prefix_survival,
    rank_candidates,
    stale_budget,
    stale_mean,
)

# Θ is computed in float64 from a handful of additions and one division; two allocations with the same
# verified set give bit-identical Θ, and different sets differ by far more than 1e-12 relative.
REL = 1e-12


def theta(a, lens, cost, t0, n_s=None):
    """Θ = τ · SPS of one allocation (the quantity every budget maximises)."""
    return expected_tokens(a, lens, n_s) / cost.step_time(t0 + int(lens.sum()), a.shape[0])


def exhaustive_best(a, cost, t0, n_s):
    """Max of Θ over EVERY per-request prefix allocation ℓ ∈ {0..γ}^R, and the smallest total reaching it."""
    R, gamma = a.shape
    scored = []
    for ell in itertools.product(range(gamma + 1), repeat=R):
        lens = torch.tensor(ell, dtype=torch.long)
        scored.append((theta(a, lens, cost, t0, n_s), sum(ell)))
    best = max(s for s, _ in scored)
    return best, min(b for s, b in scored if s >= best * (1 - REL))


def random_survivals(rng, R, gamma):
    conf = torch.tensor([[rng.uniform(0.02, 1.0) for _ in range(gamma)] for _ in range(R)], dtype=torch.float64)
    return prefix_survival(conf)


def random_jagged_table(rng, max_tokens, R):
    """A random staircase: a random subset of sizes, random jumps (some cliffs), noise, then monotone()."""
    sizes = sorted(rng.sample(range(1, max_tokens + 3), k=rng.randint(2, max_tokens + 2)))
    verify, level = {}, rng.uniform(1.0, 10.0)
    for s in sizes:
        level += rng.choice([0.0, rng.uniform(0.0, 1.0), rng.uniform(2.0, 10.0)])
        verify[s] = level * rng.uniform(0.8, 1.0)  # noise can dip below the previous size; monotone() fixes it
    above = [s for s in sizes if len([t for t in sizes if t > s]) >= 2]
    graph_max = rng.choice(above) if above and rng.random() < 0.4 else None
    draft = {r: rng.uniform(0.1, 3.0) for r in range(1, R + 1)} if rng.random() < 0.7 else {}
    return CostTable(verify, draft, graph_max).monotone()


# ---------------------------------------------------------------------------- optimality
def test_best_budget_with_top_b_equals_exhaustive_search():
    rng = random.Random(1234)
    for _ in range(300):
        R, gamma = rng.randint(1, 3), rng.randint(1, 3)
        a = random_survivals(rng, R, gamma)
        t0, n_s = R + rng.randint(0, 3), R + rng.randint(0, 2)
        cost = random_jagged_table(rng, t0 + R * gamma, R)
        budget = best_budget(a, cost, t0, n_s)
        lens = allocate_top_b(a, budget)
        assert int(lens.sum()) == budget
        best, smallest_total = exhaustive_best(a, cost, t0, n_s)
        assert theta(a, lens, cost, t0, n_s) == pytest.approx(best, rel=REL)
        assert budget == smallest_total  # ties go to the smaller budget


def test_algorithm1_is_optimal_when_the_throughput_curve_is_unimodal():
    # τ(B) is concave (sorted gains) and a smooth affine cost is linear in B, so Θ(B) is unimodal and the
    # first non-improvement is the global maximum.
    rng = random.Random(99)
    for _ in range(200):
        R, gamma = rng.randint(1, 3), rng.randint(1, 3)
        a = random_survivals(rng, R, gamma)
        t0 = R + rng.randint(0, 3)
        cost = CostTable.affine(rng.uniform(0.5, 20.0), rng.uniform(0.01, 3.0), draft_fixed_ms=rng.uniform(0, 2),
                                draft_per_request_ms=rng.uniform(0, 1), sizes=range(1, t0 + R * gamma + 1))
        lens = algorithm1(a, cost, t0)
        assert torch.equal(lens, allocate_top_b(a, best_budget(a, cost, t0)))
        assert theta(a, lens, cost, t0) == pytest.approx(exhaustive_best(a, cost, t0, R)[0], rel=REL)


def test_algorithm1_early_stop_loses_on_a_staircase():
    # 4 requests, CUDA-graph buckets 4, 8, 16, 32: the first draft pays for the whole 8-token graph, so
    # Θ drops at B = 1 and Algorithm 1 stops, while filling the graphs pays off much later.
    cost = CostTable({4: 10.0, 8: 14.0, 16: 15.0, 32: 17.0}, {})
    a = prefix_survival(torch.full((4, 7), 0.95, dtype=torch.float64))
    early = algorithm1(a, cost, num_anchor_tokens=4)
    assert torch.equal(early, torch.zeros(4, dtype=torch.long))
    budget = best_budget(a, cost, num_anchor_tokens=4)
    assert budget == 28
    full = allocate_top_b(a, budget)
    assert torch.equal(full, torch.full((4,), 7, dtype=torch.long))
    assert theta(a, early, cost, 4) == pytest.approx(400.0, rel=REL)  # 4 tokens / 10 ms
    assert theta(a, full, cost, 4) > 3.9 * theta(a, early, cost, 4)


def test_serving_notes_cliff_admits_exactly_one_draft():
    a = prefix_survival(torch.tensor([[0.1, 0.1], [0.9, 0.9]]))
    assert torch.allclose(a, torch.tensor([[0.1, 0.01], [0.9, 0.81]]), rtol=0, atol=1e-7)  # float32 products
    # Graphs up to 3 tokens; eager (the cliff) from 4 on.
    cost = CostTable({2: 10.0, 3: 10.5, 4: 30.0, 6: 34.0}, {1: 1.0, 2: 1.0}, graph_max_tokens=3)
    assert best_budget(a, cost, num_anchor_tokens=2) == 1
    expected = torch.tensor([0, 1])
    assert torch.equal(allocate_top_b(a, 1), expected)
    assert torch.equal(algorithm1(a, cost, 2), expected)
    sched = Scheduler(SchedulerConfig(mode="adaptive"), gamma=2, cost=cost)
    assert torch.equal(sched.lengths(a, a_stale=a, num_anchor_tokens=2), expected)


def test_zero_and_full_budget():
    a = torch.tensor([[0.9, 0.8], [0.5, 0.2]])
    steep = CostTable.affine(1.0, 100.0, sizes=range(1, 7))  # every draft costs far more than it can return
    assert best_budget(a, steep, 2) == 0
    assert torch.equal(algorithm1(a, steep, 2), torch.zeros(2, dtype=torch.long))
    assert torch.equal(allocate_top_b(a, 0), torch.zeros(2, dtype=torch.long))
    flat = CostTable({n: 10.0 for n in range(1, 7)}, {})  # drafts are free: verify everything
    assert best_budget(a, flat, 2) == 4
    assert torch.equal(allocate_top_b(a, 4), torch.full((2,), 2, dtype=torch.long))
    # zero survivals add nothing, so a free table still prefers the smaller budget (ties -> smaller B)
    assert best_budget(torch.tensor([[0.9, 0.0], [0.0, 0.0]]), flat, 2) == 1


def test_ties_are_broken_by_slot_then_request():
    rows, slots = rank_candidates(torch.full((2, 2), 0.5))
    assert torch.equal(rows, torch.tensor([0, 1, 0, 1])) and torch.equal(slots, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(allocate_top_b(torch.full((2, 2), 0.5), 1), torch.tensor([1, 0]))
    assert torch.equal(allocate_top_b(torch.full((2, 2), 0.5), 3), torch.tensor([2, 1]))
    rows, slots = rank_candidates(torch.tensor([[0.9, 0.5], [0.5, 0.4]]))
    assert torch.equal(rows, torch.tensor([0, 1, 0, 1])) and torch.equal(slots, torch.tensor([0, 0, 1, 1]))


def test_top_b_matches_a_python_sort_with_many_ties():
    rng = random.Random(7)
    for _ in range(100):
        R, gamma = rng.randint(1, 5), rng.randint(1, 4)
        # survivals on a coarse grid so equal values across requests and slots are common
        a = torch.tensor([sorted((rng.randint(0, 4) / 4 for _ in range(gamma)), reverse=True) for _ in range(R)])
        order = sorted((-float(a[r, j]), j, r) for r in range(R) for j in range(gamma))
        budget = rng.randint(0, R * gamma)
        expected = torch.zeros(R, dtype=torch.long)
        for _, _, r in order[:budget]:
            expected[r] += 1
        assert torch.equal(allocate_top_b(a, budget), expected)
        rows, slots = rank_candidates(a)
        assert [(j, r) for _, j, r in order] == list(zip(slots.tolist(), rows.tolist()))


# ---------------------------------------------------------------------------- docs/method.md Appendix A, exactly
P_T = (Fraction(7, 10), Fraction(3, 10))  # target distribution at slot 1 over tokens (A, B)
P_D = (Fraction(1, 2), Fraction(1, 2))  # draft distribution at slot 1
C2 = (0.9, 0.0)  # c_2 after drafting A, after drafting B
APPENDIX_COST = CostTable({1: 1000.0, 2: 2000.0, 3: 1000.0 / 0.45}, {})  # SPS(1, 2, 3) = 1.0, 0.5, 0.45


def appendix_a_first_token(policy):
    """Exact distribution of the first emitted token when ``policy`` (a [1, 2] -> ℓ [1]) picks ℓ after x_1 is drafted.

    Enumerates x_1 ∈ {A, B} (p_d = ½ each), then verification of slot 1: accept x_1 with probability
    min(1, p_t/p_d), else emit from normalize(max(0, p_t - p_d)). With ℓ = 0 the first token is drawn from p_t.
    """
    dist = [Fraction(0), Fraction(0)]
    residual = [max(Fraction(0), t - d) for t, d in zip(P_T, P_D)]
    residual = [r / sum(residual) for r in residual]
    for x1 in (0, 1):
        a = torch.tensor([[0.8, 0.8 * C2[x1]]], dtype=torch.float64)  # [1, 2] survivals after drafting x_1
        ell = int(policy(a)[0])
        if ell == 0:
            for v in (0, 1):
                dist[v] += P_D[x1] * P_T[v]
            continue
        accept = min(Fraction(1), P_T[x1] / P_D[x1])
        dist[x1] += P_D[x1] * accept
        for v in (0, 1):
            dist[v] += P_D[x1] * (1 - accept) * residual[v]
    return tuple(dist)


def test_appendix_a_full_path_argmax_is_not_lossless():
    full_path = lambda a: allocate_top_b(a, best_budget(a, APPENDIX_COST, num_anchor_tokens=1))
    after_a = torch.tensor([[0.8, 0.72]], dtype=torch.float64)
    after_b = torch.tensor([[0.8, 0.0]], dtype=torch.float64)
    assert theta(after_a, torch.tensor([0]), APPENDIX_COST, 1) == pytest.approx(1.0, rel=REL)
    assert theta(after_a, torch.tensor([1]), APPENDIX_COST, 1) == pytest.approx(0.9, rel=REL)
    assert theta(after_a, torch.tensor([2]), APPENDIX_COST, 1) == pytest.approx(1.134, rel=REL)
    assert int(full_path(after_a)[0]) == 2 and int(full_path(after_b)[0]) == 0
    assert appendix_a_first_token(full_path) == (Fraction(17, 20), Fraction(3, 20))


def test_appendix_a_algorithm1_is_lossless():
    assert appendix_a_first_token(lambda a: algorithm1(a, APPENDIX_COST, 1)) == P_T
    sync = Scheduler(SchedulerConfig(mode="adaptive-sync"), gamma=2, cost=APPENDIX_COST)
    assert appendix_a_first_token(lambda a: sync.lengths(a, num_anchor_tokens=1)) == P_T


@pytest.mark.parametrize("stale", [[0.8, 0.72], [0.8, 0.0], [0.8, 0.8], [math.nan, math.nan]])
def test_appendix_a_stale_budget_is_lossless(stale):
    sched = Scheduler(SchedulerConfig(mode="adaptive"), gamma=2, cost=APPENDIX_COST)
    a_stale = torch.tensor([stale], dtype=torch.float64)
    assert appendix_a_first_token(lambda a: sched.lengths(a, a_stale=a_stale, num_anchor_tokens=1)) == P_T


def test_two_request_policies_are_lossless_by_exact_enumeration():
    """Per-request output law of one step, enumerated exactly over both requests' drafts (R = 2, γ = 2, V = 2).

    Each request has its own random target p_t(· | prefix), drafter p_d(· | prefix) and confidences
    c_k(prefix); the first two output tokens (continued from p_t when the step emits only one) must follow
    p_t for every non-anticipating policy, including top-K of the *current* survivals across requests. The
    full-path argmax must be caught by the same harness on some instance, or the harness proves nothing.
    """
    V, gamma = 2, 2

    def rand_dist(rng):
        w = [rng.uniform(0.05, 1.0) for _ in range(V)]
        return [x / sum(w) for x in w]

    def model(rng):
        prefixes = [p for n in range(gamma + 1) for p in itertools.product(range(V), repeat=n)]
        # c_2 near 0 after one token and near 1 after the other, as in Appendix A: that is what tempts an
        # anticipating rule to verify x_1 only when its continuation looks good.
        conf = {p: rng.uniform(0.05, 0.3) if rng.random() < 0.5 else rng.uniform(0.7, 0.99) for p in prefixes}
        return {p: rand_dist(rng) for p in prefixes}, {p: rand_dist(rng) for p in prefixes}, conf

    def emitted(m, drafts, ell, weight, out):
        """Add the law of the first 2 output tokens, given the drafts and ℓ, into ``out``."""
        p_t, p_d, _ = m

        def cont(prefix, prob):  # the bonus / next steps: plain target sampling
            if len(prefix) >= 2:
                out[prefix[:2]] += prob
                return
            for v in range(V):
                cont(prefix + (v,), prob * p_t[prefix][v])

        def verify(k, prefix, prob):
            if k > ell:
                return cont(prefix, prob)
            x, pt, pd = drafts[k - 1], p_t[prefix], p_d[prefix]
            acc = min(1.0, pt[x] / pd[x])
            verify(k + 1, prefix + (x,), prob * acc)
            res = [max(0.0, pt[v] - pd[v]) for v in range(V)]
            if acc < 1.0:
                for v in range(V):
                    cont(prefix + (v,), prob * (1 - acc) * res[v] / sum(res))

        verify(1, (), weight)

    def output_laws(models, policy):
        laws = [defaultdict(float) for _ in models]
        for d0 in itertools.product(range(V), repeat=gamma):
            for d1 in itertools.product(range(V), repeat=gamma):
                drafts = (d0, d1)
                prob, conf = 1.0, []
                for (_, p_d, c), d in zip(models, drafts):
                    prob *= p_d[()][d[0]] * p_d[d[:1]][d[1]]
                    conf.append([c[()], c[d[:1]]])
                lens = policy(prefix_survival(torch.tensor(conf, dtype=torch.float64)))
                for r, m in enumerate(models):
                    emitted(m, drafts[r], int(lens[r]), prob, laws[r])
        return laws

    def max_error(models, policy):
        err = 0.0
        for m, law in zip(models, output_laws(models, policy)):
            p_t = m[0]
            for seq in itertools.product(range(V), repeat=2):
                err = max(err, abs(law[seq] - p_t[()][seq[0]] * p_t[seq[:1]][seq[1]]))
        return err

    rng = random.Random(2024)
    worst_anticipating = 0.0
    for _ in range(25):
        models = [model(rng), model(rng)]
        if rng.random() < 0.5:
            cost = random_jagged_table(rng, 2 + 2 * gamma, 2)
        else:  # Appendix A's shape: the first draft is dear, further ones nearly free
            cost = CostTable({2: 1.0, 3: rng.uniform(1.5, 2.5), 6: rng.uniform(2.5, 3.0)}, {})
        a_stale = random_survivals(rng, 2, gamma)
        policies = {
            "adaptive-sync": Scheduler(SchedulerConfig(mode="adaptive-sync"), gamma, cost),
            "adaptive": Scheduler(SchedulerConfig(mode="adaptive"), gamma, cost),
            "threshold": Scheduler(SchedulerConfig(mode="threshold", threshold=rng.uniform(0.1, 0.9)), gamma),
        }
        for name, sched in policies.items():
            policy = lambda a, s=sched, st=a_stale: s.lengths(a, a_stale=st, num_anchor_tokens=2)
            assert max_error(models, policy) < 1e-12, name  # float64 sums of ~100 terms
        full_path = lambda a, c=cost: allocate_top_b(a, best_budget(a, c, 2))
        worst_anticipating = max(worst_anticipating, max_error(models, full_path))
    assert worst_anticipating > 1e-3


# ---------------------------------------------------------------------------- the other policies
def make(mode, gamma=4, cost=None, **kw):
    return Scheduler(SchedulerConfig(mode=mode, **kw), gamma=gamma, cost=cost)


def test_none_and_fixed_clipping():
    a = torch.full((3, 4), 0.5)
    assert torch.equal(make("none").lengths(a), torch.zeros(3, dtype=torch.long))
    assert torch.equal(make("fixed", k=3).lengths(a), torch.full((3,), 3, dtype=torch.long))
    assert torch.equal(make("fixed", k=10).lengths(a), torch.full((3,), 4, dtype=torch.long))
    assert make("fixed", k=2).lengths(a).dtype == torch.int64


@pytest.mark.parametrize("R, expected", [(1, 7), (3, 7), (4, 5), (15, 5), (16, 3), (1000, 1)])
def test_dsd_lookup_uses_the_largest_key_at_or_below_the_batch(R, expected):
    sched = make("dsd", gamma=7, dsd_table={1: 7, 4: 5, 16: 3, 64: 2, 256: 1})
    assert torch.equal(sched.lengths(torch.full((R, 7), 0.5)), torch.full((R,), expected, dtype=torch.long))


def test_dsd_below_the_smallest_key_and_clipping():
    sched = make("dsd", gamma=4, dsd_table={4: 6, 16: 2})
    assert torch.equal(sched.lengths(torch.full((2, 4), 0.5)), torch.full((2,), 4, dtype=torch.long))
    assert torch.equal(sched.lengths(torch.full((20, 4), 0.5)), torch.full((20,), 2, dtype=torch.long))


def test_threshold():
    a = torch.tensor([[0.9, 0.6, 0.5, 0.2], [0.4, 0.3, 0.1, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.equal(make("threshold", threshold=0.5).lengths(a), torch.tensor([3, 0, 4]))
    assert torch.equal(make("threshold", threshold=0.0).lengths(a), torch.tensor([4, 4, 4]))
    assert torch.equal(make("threshold", threshold=1.0).lengths(a), torch.tensor([0, 0, 4]))


def test_oracle_passes_through():
    accepted = torch.tensor([0, 4, 2])
    assert torch.equal(make("oracle").lengths(torch.full((3, 4), 0.5), accepted_if_full=accepted), accepted)
    with pytest.raises(ValueError, match="accepted_if_full"):
        make("oracle").lengths(torch.full((3, 4), 0.5))
    with pytest.raises(ValueError, match="0..γ"):
        make("oracle").lengths(torch.full((3, 4), 0.5), accepted_if_full=torch.tensor([0, 5, 2]))


def test_adaptive_budget_comes_from_stale_and_allocation_from_current():
    cost = CostTable({2: 10.0, 3: 12.0, 4: 14.0, 5: 30.0, 6: 30.0}, {})
    sched = make("adaptive", gamma=2, cost=cost)
    a_stale = torch.tensor([[0.9, 0.8], [0.9, 0.8]])
    a_now = torch.tensor([[0.1, 0.05], [0.1, 0.05]])
    assert best_budget(a_stale, cost, 2) == 2 and best_budget(a_now, cost, 2) == 0
    assert torch.equal(sched.lengths(a_now, a_stale=a_stale, num_anchor_tokens=2), torch.tensor([1, 1]))
    # A request that joined since (NaN row) borrows the mean stale curve, and current values place the slots.
    a_stale = torch.tensor([[0.9, 0.8], [math.nan, math.nan]])
    assert torch.equal(fill_stale_rows(a_stale), torch.tensor([[0.9, 0.8], [0.9, 0.8]]))
    assert stale_budget(a_stale, cost, 2) == 2
    a_now = torch.tensor([[0.3, 0.1], [0.95, 0.9]])
    assert torch.equal(sched.lengths(a_now, a_stale=a_stale, num_anchor_tokens=2), torch.tensor([0, 2]))
    # No stale row at all in a scheduler's first steps: zeros, a zero budget.
    all_new = torch.full((2, 2), math.nan)
    assert torch.equal(fill_stale_rows(all_new), torch.zeros(2, 2))
    fresh = make("adaptive", gamma=2, cost=cost)
    assert torch.equal(fresh.lengths(a_now, a_stale=all_new, num_anchor_tokens=2), torch.tensor([0, 0]))
    assert fresh.stale_prior is None


def test_a_step_without_stale_rows_takes_the_last_mean_stale_curve():
    """Requests that arrive after others left (alone, or a batch starting together) are expected to draft as the
    requests before them did: the budget fills their rows with the mean stale curve of the last step that had one,
    not with zeros (which would verify none of their first `staleness` drafts)."""
    cost = CostTable({2: 10.0, 3: 12.0, 4: 14.0, 5: 30.0, 6: 30.0}, {})
    sched = make("adaptive", gamma=2, cost=cost)
    a_now = torch.tensor([[0.95, 0.9], [0.95, 0.9]])
    first = torch.tensor([[0.9, 0.8], [0.5, 0.2]])
    sched.lengths(a_now, a_stale=first, num_anchor_tokens=2)
    assert torch.equal(sched.stale_prior, stale_mean(first)) and torch.allclose(sched.stale_prior,
                                                                                 torch.tensor([0.7, 0.5]))
    # The next batch starts with no stale row: the prior fills every row, so the budget is the one it prices.
    all_new = torch.full((2, 2), math.nan)
    prior_rows = sched.stale_prior.expand(2, 2)
    assert torch.equal(fill_stale_rows(all_new, sched.stale_prior), prior_rows)
    expected = best_budget(prior_rows, cost, 2)
    assert expected > 0
    assert stale_budget(all_new, cost, 2, prior=sched.stale_prior) == expected
    lens = sched.lengths(a_now, a_stale=all_new, num_anchor_tokens=2)
    assert int(lens.sum()) == expected
    assert torch.allclose(sched.stale_prior, torch.tensor([0.7, 0.5]))  # a step without rows keeps the prior
    # Known rows are filled from the batch, never from the prior; the prior follows the newest known rows.
    some = torch.tensor([[0.2, 0.1], [math.nan, math.nan]])
    assert torch.equal(fill_stale_rows(some, torch.tensor([0.9, 0.9])), torch.tensor([[0.2, 0.1], [0.2, 0.1]]))
    sched.lengths(a_now, a_stale=some, num_anchor_tokens=2)
    assert torch.equal(sched.stale_prior, torch.tensor([0.2, 0.1]))
    assert stale_mean(all_new) is None
    # A malformed prior is refused with its shape or range named.
    with pytest.raises(ValueError, match="prior must have shape"):
        fill_stale_rows(all_new, torch.tensor([0.5, 0.4, 0.3]))
    with pytest.raises(ValueError, match="prior must lie in"):
        fill_stale_rows(all_new, torch.tensor([1.5, 0.4]))


# ---------------------------------------------------------------------------- validation
def test_input_validation():
    cost = CostTable.affine(5.0, 0.1)
    good = torch.tensor([[0.9, 0.5]])
    with pytest.raises(ValueError, match="non-increasing"):
        allocate_top_b(torch.tensor([[0.5, 0.9]]), 1)
    allocate_top_b(torch.tensor([[0.5, 0.5 + 1e-7]]), 2)  # float noise below the 1e-6 tolerance is accepted
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        best_budget(torch.tensor([[1.5, 0.9]]), cost, 1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        best_budget(torch.tensor([[math.nan, 0.9]]), cost, 1)
    with pytest.raises(ValueError, match=r"\[R, γ\]"):
        rank_candidates(torch.tensor([0.9, 0.5]))
    with pytest.raises(ValueError, match="floating-point"):
        rank_candidates(torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="budget"):
        allocate_top_b(good, 3)
    with pytest.raises(ValueError, match="num_anchor_tokens"):
        best_budget(torch.full((3, 2), 0.5), cost, 2)
    with pytest.raises(ValueError, match="num_requests"):
        best_budget(torch.full((3, 2), 0.5), cost, 3, num_requests=2)
    with pytest.raises(ValueError, match="needs a cost table"):
        make("adaptive")
    with pytest.raises(ValueError, match="staleness 0"):
        make("adaptive", cost=cost, staleness=0)
    with pytest.raises(ValueError, match="block size"):
        make("fixed", gamma=4).lengths(good)
    sched = make("adaptive", gamma=2, cost=cost)
    with pytest.raises(ValueError, match="needs a_stale"):
        sched.lengths(good, num_anchor_tokens=1)
    with pytest.raises(ValueError, match="a_stale has shape"):
        sched.lengths(good, a_stale=torch.full((2, 2), 0.5), num_anchor_tokens=1)
    with pytest.raises(ValueError, match="partly NaN"):
        sched.lengths(good, a_stale=torch.tensor([[0.5, math.nan]]), num_anchor_tokens=1)
    with pytest.raises(ValueError, match="num_anchor_tokens"):
        sched.lengths(good, a_stale=good)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        prefix_survival(torch.tensor([[0.5, 1.2]]))


def test_empty_batch():
    a = torch.zeros(0, 3)
    cost = CostTable.affine(5.0, 0.1)
    assert best_budget(a, cost, 0) == 0
    assert allocate_top_b(a, 0).shape == (0,)
    assert make("adaptive", gamma=3, cost=cost).lengths(a, a_stale=a, num_anchor_tokens=0).shape == (0,)


def test_draft_gate_rule():
    """should_draft: always outside adaptive or with the gate off; with nothing known; on the probe step; else
    exactly when the best budget beats plain decoding (speculation_pays)."""
    from reference.scheduler import speculation_pays

    cheap = CostTable.affine(fixed_ms=5.0, per_token_ms=0.1, draft_fixed_ms=0.5, sizes=list(range(1, 65)))
    dear = CostTable.affine(fixed_ms=5.0, per_token_ms=0.1, draft_fixed_ms=50.0, sizes=list(range(1, 65)))
    a = torch.tensor([[0.9, 0.8, 0.7], [0.5, 0.2, 0.1]])
    assert speculation_pays(a, cheap, 2) and not speculation_pays(a, dear, 2)
    assert speculation_pays(a, dear, 2, margin=100.0)  # a huge margin keeps drafting
    gated = Scheduler(SchedulerConfig(mode="adaptive", probe_every=4, gate_margin=0.0), gamma=3, cost=dear)
    assert not gated.should_draft(a, 0, num_anchor_tokens=2)
    assert gated.should_draft(a, 4, num_anchor_tokens=2)  # the probe
    assert gated.should_draft(None, 0, num_anchor_tokens=2)  # nobody drafted yet
    assert gated.should_draft(torch.full((2, 3), float("nan")), 0, num_anchor_tokens=2)
    assert not gated.should_draft(torch.tensor([[0.9, 0.8, 0.7], [float("nan")] * 3]), 0, num_anchor_tokens=2)
    assert Scheduler(SchedulerConfig(mode="adaptive", draft_gate=False), gamma=3, cost=dear).should_draft(
        a, 0, num_anchor_tokens=2)
    assert Scheduler(SchedulerConfig(mode="fixed", k=2), gamma=3, cost=dear).should_draft(a, 0, num_anchor_tokens=2)
    # Θ(B) counts the draft for every B, so with a perfect drafter and a cheap draft, drafting pays.
    assert Scheduler(SchedulerConfig(mode="adaptive"), gamma=3, cost=cheap).should_draft(
        torch.ones(2, 3), 0, num_anchor_tokens=2)
    with pytest.raises(ValueError, match="probe_every"):
        SchedulerConfig(probe_every=0)


def test_draft_gate_margin_shrinks_with_the_batch():
    """The margin is gate_margin / √R: one request keeps drafting where plain decoding looks 10 % faster a step, a
    batch of 256 with the same per-request survivals stops (the engine's gate reads the same function)."""
    from reference.scheduler import gate_margin

    cfg = SchedulerConfig(mode="adaptive", gate_margin=0.3)
    assert gate_margin(cfg, 1) == 0.3 and gate_margin(cfg, 4) == 0.15 and gate_margin(cfg, 0) == 0.3
    assert gate_margin(cfg, 256) == pytest.approx(0.3 / 16)
    # Every verify costs 1 ms and the draft 1 ms. Plain decoding: R tokens per ms. Drafting, at best one draft a
    # request (survival 0.8, the second 0): 1.8 R tokens per 2 ms, 0.9× plain decoding's rate.
    for r, drafts in ((1, True), (256, False)):
        cost = CostTable(verify_ms={n: 1.0 for n in (1, 2, 3, 256, 512, 768)}, draft_ms={1: 1.0, 256: 1.0})
        a = torch.tensor([[0.8, 0.0]]).expand(r, 2).contiguous()  # [R, γ]
        policy = Scheduler(cfg, gamma=2, cost=cost)
        assert policy.should_draft(a, 0, num_anchor_tokens=r) is drafts, r
