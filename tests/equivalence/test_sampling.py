"""Equivalence of ``optimized.kernels.sampling`` (Triton kernel and torch fallback) with ``reference.sampling``.

Integer outputs (tokens) and the uniforms themselves must be *identical* (torch.equal): the hash is integer
arithmetic and the race uses the same float32 operations. On the CPU the Triton kernels run through Triton's
interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before triton is imported (the CI command
sets it); without it and without CUDA the Triton cases skip.
"""

from __future__ import annotations

import os

import pytest
import torch
from scipy.stats import chisquare

from optimized.kernels import sampling as fast
from reference import sampling as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEEDS = [0, 2**64 - 1, 0x0123456789ABCDEF]  # both seed words exercised, including all-ones


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_hash_uniform_bit_exact(backend, seed):
    # Extremes of every word: request ids up to 2³¹-1, positions and purposes up to 2³²-1, lanes broadcast last.
    rid = torch.tensor([0, 1, 2**31 - 1], device=DEVICE)[:, None, None]  # [3, 1, 1]
    pos = torch.tensor([0, 5, 2**32 - 1], device=DEVICE)[None, :, None]  # [1, 3, 1]
    lanes = torch.arange(97, device=DEVICE)[None, None, :]  # [1, 1, 97]
    for purpose in (int(ref.Purpose.ACCEPT), ref.draft_purpose(7), 2**32 - 1):
        got = fast.hash_uniform(seed, rid, pos, purpose, lanes, backend=backend)
        want = ref.hash_uniform(seed, rid.cpu(), pos.cpu(), purpose, lanes.cpu())
        assert got.dtype == torch.float32 and got.shape == (3, 3, 97)
        assert torch.equal(got.cpu(), want)
        assert bool(((got > 0) & (got < 1)).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_uniform_scalar_and_empty(backend):
    got = fast.hash_uniform(7, torch.tensor(3, device=DEVICE), 11, int(ref.Purpose.BONUS), 0, backend=backend)
    assert got.shape == () and torch.equal(got.cpu(), ref.hash_uniform(7, 3, 11, int(ref.Purpose.BONUS), 0))
    empty = fast.hash_uniform(7, torch.zeros(0, dtype=torch.int64, device=DEVICE), 1, 2, backend=backend)
    assert empty.shape == (0,)


def _weights(R: int, V: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Unnormalised, peaked weights with exact zeros (a residual looks like this), one one-hot row."""
    w = torch.rand(R, V, generator=gen).pow(6) * 3.0  # [R, V]
    w[w < 0.05] = 0.0
    w[0] = 0.0
    w[0, V - 1] = 1.0  # one-hot at the last lane (a greedy row)
    w[:, 0] += 1e-3  # every row keeps positive mass
    return w.to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,V", [(1, 1), (1, 97), (6, 97), (3, 1500)])
def test_sample_matches_reference(backend, dtype, R, V):
    gen = torch.Generator().manual_seed(R * 1000 + V)
    probs = _weights(R, V, dtype, gen)
    rid = torch.randint(0, 2**31, (R,), generator=gen).to(DEVICE)
    pos = torch.randint(0, 2**32, (R,), generator=gen).to(DEVICE)
    purpose = torch.randint(1, 200, (R,), generator=gen).to(DEVICE)
    for p in (purpose, int(ref.Purpose.RESIDUAL)):  # per-row tensor and plain int
        got = fast.sample(probs, 42, rid, pos, p, backend=backend)
        want = ref.sample(probs.cpu(), 42, rid.cpu(), pos.cpu(), p.cpu() if torch.is_tensor(p) else p)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)


@needs_triton
def test_sample_full_vocabulary():
    # SmolLM2's V = 49152 = 48 tiles of 1024: the cross-tile reduction and the lowest-index rule over tiles.
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(2, 49152, generator=gen) * 4, dim=-1).to(DEVICE)  # [2, V]
    rid, pos = torch.tensor([3, 9], device=DEVICE), torch.tensor([100, 2**31 + 5], device=DEVICE)
    got = fast.sample(probs, 5, rid, pos, int(ref.Purpose.BONUS), backend="triton")
    assert torch.equal(got.cpu(), ref.sample(probs.cpu(), 5, rid.cpu(), pos.cpu(), int(ref.Purpose.BONUS)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_batch_independence(backend):
    gen = torch.Generator().manual_seed(2)
    probs = _weights(5, 97, torch.float32, gen)
    rid, pos = torch.arange(5, device=DEVICE) + 10, torch.arange(5, device=DEVICE) * 3
    batch = fast.sample(probs, 9, rid, pos, 4, backend=backend)
    alone = torch.cat([fast.sample(probs[i:i + 1], 9, rid[i:i + 1], pos[i:i + 1], 4, backend=backend)
                       for i in range(5)])
    perm = torch.tensor([3, 0, 4, 1, 2], device=DEVICE)
    permuted = fast.sample(probs[perm], 9, rid[perm], pos[perm], 4, backend=backend)
    assert torch.equal(batch, alone) and torch.equal(batch[perm], permuted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_empty_batch(backend):
    got = fast.sample(torch.zeros(0, 97, device=DEVICE), 1, torch.zeros(0, dtype=torch.int64, device=DEVICE),
                      torch.zeros(0, dtype=torch.int64, device=DEVICE), 4, backend=backend)
    assert got.shape == (0,) and got.dtype == torch.int64


@needs_triton
def test_sample_distribution():
    # 400 independent draws (one per position; the interpreter runs ~15 ms per program) from p; chi-square
    # goodness of fit at significance 1e-3 (expected counts >= 25 per cell).
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    R = 400
    probs = p.expand(R, -1).contiguous().to(DEVICE)
    tokens = fast.sample(probs, 123, torch.full((R,), 7, device=DEVICE), torch.arange(R, device=DEVICE), 4,
                         backend="triton").cpu()
    assert int(tokens.max()) <= 4  # the zero-probability token is never drawn
    counts = torch.bincount(tokens, minlength=6)[:5].double()
    expected = p[:5].double() / p[:5].double().sum() * R
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_bad_inputs_fail_fast():
    probs = torch.ones(2, 5)
    with pytest.raises(ValueError, match="probs"):
        fast.sample(torch.ones(5), 0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="seed"):
        fast.sample(probs, -1, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="request_ids"):
        fast.sample(probs, 0, torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(TypeError, match="positions"):
        fast.sample(probs, 0, torch.zeros(2, dtype=torch.int64), torch.zeros(2), 1)
    with pytest.raises(ValueError, match="backend"):
        fast.sample(probs, 0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1, backend="cuda")


@needs_triton
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("R,V", [(1, 1), (2, 97), (3, 2500), (1, 4096)])
def test_split_race_equals_one_program_race(split, R, V):
    """The split-vocabulary race (chunk winners, then the earliest chunk among the top scores) draws the same token
    as the one-program race and the reference; a chunk of zero weights (its winner scores 0) must not win."""
    gen = torch.Generator().manual_seed(V)
    probs = _weights(R, V, torch.float32, gen)
    if V > 1024:
        probs[:, :1024] = 0.0  # a chunk of zeros: its winner scores 0 and must not win over later chunks
    rid, pos = torch.arange(R, device=DEVICE) + 7, torch.arange(R, device=DEVICE) + 1000
    got = fast.sample(probs, 13, rid, pos, 2, backend="triton", split=split)
    want = ref.sample(probs.cpu(), 13, rid.cpu(), pos.cpu(), 2)  # the reference on the CPU (probs live on DEVICE)
    assert torch.equal(got.cpu(), want)
    if V > 1024:
        assert bool((got >= 1024).all())
