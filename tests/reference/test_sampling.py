"""Tests of reference/sampling.py: the random-number contract (bit-exact), its statistics, and
temperature / top-k / top-p against brute-force definitions.

Statistical tests use fixed seeds and significance level α = 0.001 (a correct implementation fails
one such test with probability 0.1%, and since the seeds are fixed the outcome is reproducible).
"""

import random

import pytest
import scipy.stats
import torch

from reference.sampling import Purpose, draft_purpose, hash_uniform, logits_to_probs, sample

ALPHA = 0.001
M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- the hash, bit for bit


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def _uniform_int(seed: int, request_id: int, position: int, purpose: int, lane: int) -> float:
    """The contract on Python ints (arbitrary precision, so no overflow question arises)."""
    h = 0x2545F491
    for w in (seed & M32, seed >> 32, request_id, position, purpose, lane):
        h = _mix32_int((((h ^ w) & M32) + 0x9E3779B9) & M32)
    return ((h >> 9) + 0.5) / 2**23  # exact in double, and exactly representable in float32


def test_hash_uniform_matches_pure_python_contract():
    rng = random.Random(1234)
    seeds = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1] + [rng.randrange(2**63) for _ in range(30)]
    extremes = [(0, 0, 0, 0), (2**31 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1), (0, 2**32 - 1, 0, 2**32 - 1),
                (2**31 - 1, 0, int(Purpose.BONUS), 151935)]
    for seed in seeds:
        keys = extremes + [(rng.randrange(2**31), rng.randrange(2**32), rng.choice([2, 3, 4, draft_purpose(7),
                            rng.randrange(2**32)]), rng.randrange(2**32)) for _ in range(60)]
        req, pos, pur, lane = (torch.tensor(c, dtype=torch.int64) for c in zip(*keys))
        got = hash_uniform(seed, req, pos, pur, lane)
        want = torch.tensor([_uniform_int(seed, *key) for key in keys], dtype=torch.float32)
        assert got.dtype == torch.float32
        assert torch.equal(got, want), f"seed {seed}"
    # Python-int arguments and broadcasting give the same numbers.
    assert hash_uniform(7, 3, 11, 2, 5).item() == _uniform_int(7, 3, 11, 2, 5)
    grid = hash_uniform(7, torch.arange(3)[:, None], 11, Purpose.RESIDUAL, torch.arange(4)[None, :])  # [3, 4]
    want = torch.tensor([[_uniform_int(7, r, 11, 3, v) for v in range(4)] for r in range(3)], dtype=torch.float32)
    assert torch.equal(grid, want)


def test_hash_uniform_is_strictly_inside_unit_interval_and_exact():
    u = hash_uniform(99, torch.arange(1000)[:, None], torch.arange(1000)[None, :], Purpose.ACCEPT)  # [1000, 1000]
    assert 0 < u.min().item() and u.max().item() < 1
    # Every value is an odd multiple of 2^-24: no rounding happened in float32.
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round()) and bool((scaled.long() % 2 == 1).all())
    # The extreme words themselves map to the extremes of the grid, never to 0 or 1.
    assert 2**-24 <= _uniform_int(0, 0, 0, 0, 0) <= 1 - 2**-24


def test_hash_uniform_is_uniform_ks():
    # Along positions (the accept test) and along lanes (a categorical draw): KS against U(0, 1).
    u_pos = hash_uniform(2024, torch.arange(200)[:, None], torch.arange(1000)[None, :], Purpose.ACCEPT)
    u_lane = hash_uniform(2024, 5, 17, Purpose.BONUS, torch.arange(200_000))
    for u in (u_pos.flatten(), u_lane):
        assert scipy.stats.kstest(u.double().numpy(), "uniform").pvalue > ALPHA
    # Different purposes at the same key are not the same numbers (nor correlated).
    a = hash_uniform(2024, 5, torch.arange(20_000), Purpose.ACCEPT)
    b = hash_uniform(2024, 5, torch.arange(20_000), Purpose.RESIDUAL)
    assert scipy.stats.pearsonr(a.double().numpy(), b.double().numpy()).pvalue > ALPHA


def test_hash_uniform_rejects_bad_keys():
    with pytest.raises(ValueError, match="seed"):
        hash_uniform(-1, 0, 0, 2)
    with pytest.raises(ValueError, match="seed"):
        hash_uniform(2**64, 0, 0, 2)
    with pytest.raises(ValueError, match="request_ids"):
        hash_uniform(0, torch.tensor([2**31]), 0, 2)
    with pytest.raises(ValueError, match="positions"):
        hash_uniform(0, 0, torch.tensor([-1]), 2)
    with pytest.raises(TypeError, match="lane"):
        hash_uniform(0, 0, 0, 2, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="slot"):
        draft_purpose(0)
    assert draft_purpose(1) == 17 and draft_purpose(7) == 113


# --------------------------------------------------------------------------- sample


def test_sample_is_independent_of_the_batch():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(16, 50, generator=g) ** 3  # [16, 50]
    req = torch.randperm(1000, generator=g)[:16]
    pos = torch.randint(0, 5000, (16,), generator=g)
    purpose = torch.tensor([draft_purpose(1 + i % 7) for i in range(16)])
    batch = sample(probs, 5, req, pos, purpose)
    alone = torch.cat([sample(probs[i:i + 1], 5, req[i:i + 1], pos[i:i + 1], purpose[i:i + 1]) for i in range(16)])
    assert torch.equal(batch, alone)
    perm = torch.randperm(16, generator=g)
    assert torch.equal(sample(probs[perm], 5, req[perm], pos[perm], purpose[perm]), batch[perm])
    # Determinism, and scale invariance (×2 is exact in float32, so the race is unchanged): residuals
    # need no normalisation.
    assert torch.equal(sample(probs, 5, req, pos, purpose), batch)
    assert torch.equal(sample(2 * probs, 5, req, pos, purpose), batch)


def test_sample_matches_categorical_chi_square():
    p = torch.tensor([0.30, 0.05, 0.0, 0.20, 0.15, 0.02, 0.08, 0.20])  # [8], one impossible token
    n = 20_000
    tokens = sample(p.expand(n, 8), 31337, torch.arange(n), torch.full((n,), 42), Purpose.BONUS)  # [n]
    counts = torch.bincount(tokens, minlength=8)
    assert counts[2] == 0, "a zero-probability token was sampled"
    nz = p > 0
    chi = scipy.stats.chisquare(counts[nz].double().numpy(), (p[nz] * n).double().numpy())
    assert chi.pvalue > ALPHA, chi


def test_sample_ties_go_to_lowest_index_for_one_hot_and_rejects_bad_probs():
    one_hot = torch.zeros(3, 10)
    one_hot[torch.arange(3), torch.tensor([0, 4, 9])] = 1.0
    assert torch.equal(sample(one_hot, 0, torch.arange(3), torch.zeros(3, dtype=torch.long), 4),
                       torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="positive mass"):
        sample(torch.zeros(1, 4), 0, torch.tensor([0]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="finite"):
        sample(torch.tensor([[0.5, float("nan")]]), 0, torch.tensor([0]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="shape"):
        sample(torch.ones(2, 4), 0, torch.tensor([0, 1, 2]), torch.tensor([0, 0]), 4)


# --------------------------------------------------------------------------- logits_to_probs


def _brute_force_probs(logits: list[float], temperature: float, top_p: float, top_k: int) -> list[float]:
    """The definition in docs/contracts.md, one row, on Python floats (float64)."""
    V = len(logits)
    if temperature == 0:
        best = max(range(V), key=lambda v: (logits[v], -v))  # lowest index among the maxima
        return [1.0 if v == best else 0.0 for v in range(V)]
    x = [lv / temperature for lv in logits]
    keep = [True] * V
    if 0 < top_k < V:
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = [xv >= kth for xv in x]
    if top_p < 1:
        m = max(x)
        w = [torch.tensor(xv - m).exp().item() if k else 0.0 for xv, k in zip(x, keep)]
        z = sum(w)
        order = sorted(range(V), key=lambda v: -w[v])  # Python's sort is stable
        mass, keep_p = 0.0, [False] * V
        for v in order:
            if mass >= top_p:
                break
            keep_p[v] = True
            mass += w[v] / z
        keep = [a and b for a, b in zip(keep, keep_p)]
    m = max(xv for xv, k in zip(x, keep) if k)
    w = [torch.tensor(xv - m).exp().item() if k else 0.0 for xv, k in zip(x, keep)]
    return [wv / sum(w) for wv in w]


def _prefix_masses(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """Cumulative masses of the sorted top-k distribution of the scaled logits ``x`` (float64)."""
    x = x.double()
    if 0 < top_k < len(x):
        x = x.masked_fill(x < x.sort(descending=True).values[top_k - 1], float("-inf"))
    return x.softmax(-1).sort(descending=True).values.cumsum(-1)


def test_logits_to_probs_matches_brute_force():
    g = torch.Generator().manual_seed(7)
    R, V = 40, 23
    logits = torch.randn(R, V, generator=g) * 2
    logits[3, [1, 5, 9]] = logits[3].max() + 1  # a three-way tie at the top
    logits[4, [2, 6]] = 9.0  # a tie at the top, both inside k = 2
    temperature = torch.rand(R, generator=g) * 1.5 + 0.3
    temperature[:4] = 0.0
    top_k = torch.randint(0, V + 3, (R,), generator=g)  # includes 0 (off) and k >= V
    top_k[4] = 2
    top_p = torch.rand(R, generator=g) * 0.9 + 0.1
    top_p[::5] = 1.0
    top_p[4] = 1.0
    for r in range(R):
        # Avoid top_p values within float32 rounding of a prefix mass: there the definition is decided by
        # rounding, not by the rule under test. Move such a top_p off the boundary deterministically.
        x = logits[r] / max(temperature[r].item(), 1e-9)
        if top_p[r] < 1 and (_prefix_masses(x, int(top_k[r])) - top_p[r].double()).abs().min() < 1e-4:
            top_p[r] = top_p[r] - 3e-4
    probs = logits_to_probs(logits, temperature, top_p=top_p, top_k=top_k)  # [R, V]
    assert probs.dtype == torch.float32
    want = torch.tensor([_brute_force_probs(logits[r].tolist(), temperature[r].item(), top_p[r].item(),
                                            int(top_k[r])) for r in range(R)], dtype=torch.float64)
    assert torch.equal(probs > 0, want > 0), "kept sets differ"
    torch.testing.assert_close(probs.double(), want, atol=1e-6, rtol=1e-5)  # float32 softmax vs float64
    assert torch.equal(probs[3], torch.nn.functional.one_hot(torch.tensor(1), V).float())  # lowest index
    assert torch.equal((probs[4] > 0).nonzero().flatten(), torch.tensor([2, 6]))  # k = 2 keeps the tied pair


def test_logits_to_probs_hand_cases():
    flat = torch.zeros(1, 4)
    # Four equal tokens, top_p = 0.5: the stable sort keeps the two lowest indices.
    assert torch.equal(logits_to_probs(flat, 1.0, top_p=0.5), torch.tensor([[0.5, 0.5, 0.0, 0.0]]))
    assert torch.equal(logits_to_probs(flat, 0.0), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # top-k keeps every token tied with the k-th largest.
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert torch.equal(logits_to_probs(logits, 1.0, top_k=2) > 0, torch.tensor([[True, True, True, False]]))
    # top_p = 1 is off even when float32 mass reaches 1 early (a long, tiny tail).
    tail = torch.cat([torch.tensor([[30.0]]), torch.zeros(1, 1000)], dim=1)
    assert bool((logits_to_probs(tail, 1.0, top_p=1.0) > 0).all())
    # -inf logits (banned tokens) stay at probability 0.
    banned = torch.tensor([[0.0, float("-inf"), 1.0]])
    assert logits_to_probs(banned, 0.7)[0, 1] == 0


def test_logits_to_probs_broadcasts_over_middle_dims_and_sums_to_one():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, 1000, generator=g) * 3  # [R, γ, V]
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.3, 2.0])
    top_p = torch.tensor([1.0, 0.9, 0.95, 1.0, 0.5])
    top_k = torch.tensor([0, 50, 0, 10, 200])
    probs = logits_to_probs(logits, temperature, top_p=top_p, top_k=top_k)  # [R, γ, V]
    # float32 sums of up to 1000 terms: error of a few ulps of 1 per term at most.
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, 7), atol=1e-5, rtol=0)
    for r in range(5):
        row = logits_to_probs(logits[r], temperature[r].item(), top_p=top_p[r].item(), top_k=int(top_k[r]))
        assert torch.equal(probs[r], row)  # the middle dim is only a batch dim
    # Plain temperature scaling is the softmax of logits / T.
    torch.testing.assert_close(logits_to_probs(logits, temperature[1:2].expand(5)),
                               (logits / 0.5).softmax(-1), atol=1e-6, rtol=1e-5)


def test_logits_to_probs_bf16_input():
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(4, 300, generator=g) * 4).bfloat16()
    probs = logits_to_probs(logits, torch.tensor([0.0, 0.8, 1.0, 1.0]), top_p=0.9, top_k=40)
    assert probs.dtype == torch.float32
    # bf16 is only the input format: the computation is float32, so it equals running on the upcast logits.
    assert torch.equal(probs, logits_to_probs(logits.float(), torch.tensor([0.0, 0.8, 1.0, 1.0]), top_p=0.9,
                                              top_k=40))
    assert probs[0].argmax() == logits[0].float().argmax() and probs[0].max() == 1


def test_logits_to_probs_rejects_bad_input():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(logits, -1.0)
    with pytest.raises(ValueError, match="top_p"):
        logits_to_probs(logits, 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        logits_to_probs(logits, 1.0, top_k=-2)
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(logits, torch.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        logits_to_probs(torch.tensor([[0.0, float("nan")]]), 1.0)
    with pytest.raises(ValueError, match="no finite"):
        logits_to_probs(torch.full((1, 3), float("-inf")), 1.0)
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.zeros(5), 1.0)
