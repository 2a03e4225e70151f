"""What every kernel module shares: the backend choice, the contract's hash in Triton, and the exponential race.

The random-number contract (``reference/sampling.py``, fixed bit for bit in ``docs/contracts.md``) in Triton::

    mix32(x):   x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16   (mod 2³²)
    step(h, w): mix32((h ^ w) + 0x9E3779B9)
    h = 0x2545F491;  for w in (seed_lo, seed_hi, request_id, position, purpose, lane): h = step(h, w)
    u = ((h >> 9) + 0.5) / 2²³          (float32, exact, strictly inside (0, 1))
    token = argmax_v p(v) / E_v,  E_v = -log u_v     (ties -> lowest v)

Triton has a real ``uint32``, so the kernels multiply with wrap-around instead of the 16-bit split the torch code
needs. The first five words are the same for every lane of a row, so the kernels hash them once per row
(:func:`hash_key`, a scalar) and only the last step runs per vocabulary lane (:func:`uniform_at`). The torch
fallback of every op draws its uniforms from ``reference.sampling.uniform_from_words`` (:func:`hash_uniform_torch`):
one torch hash in the project.

The ``@triton.jit`` helpers here are building blocks for the kernels of ``sampling``, ``verify`` and
``draft_head``; they are called from inside kernels only. Names follow ``docs/method.md`` (``p_t`` target, ``p_d``
draft, ``γ`` block size).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference import sampling as contract
from reference.sampling import Purpose

__all__ = [
    "BIG_INDEX", "PURPOSE_ACCEPT", "PURPOSE_BONUS", "PURPOSE_DRAFT", "PURPOSE_RESIDUAL", "RACE_BLOCK_V",
    "argmax_update", "exponential_at", "hash_key", "hash_step", "hash_uniform_torch", "mix32", "per_row_words",
    "race_update", "race_winner", "resolve_backend", "split_seed", "uniform_at",
]

_UNIFORM_SHIFT = 32 - contract.UNIFORM_BITS
_UNIFORM_SCALE = 1.0 / 2**contract.UNIFORM_BITS  # a power of two: multiplying by it is exact

# Module-level constants used inside @triton.jit functions must be tl.constexpr; their values are the contract's.
HASH_INIT: tl.constexpr = tl.constexpr(contract.HASH_INIT)
GOLDEN: tl.constexpr = tl.constexpr(contract.GOLDEN)
MIX_MUL_1: tl.constexpr = tl.constexpr(contract.MIX_MUL_1)
MIX_MUL_2: tl.constexpr = tl.constexpr(contract.MIX_MUL_2)
UNIFORM_SHIFT: tl.constexpr = tl.constexpr(_UNIFORM_SHIFT)
UNIFORM_SCALE: tl.constexpr = tl.constexpr(_UNIFORM_SCALE)
BIG_INDEX: tl.constexpr = tl.constexpr(2**31 - 1)  # "no index" for the lowest-index tie break

# Purpose words as kernel constants (one source of truth: reference.sampling.Purpose).
PURPOSE_DRAFT: tl.constexpr = tl.constexpr(int(Purpose.DRAFT))
PURPOSE_ACCEPT: tl.constexpr = tl.constexpr(int(Purpose.ACCEPT))
PURPOSE_RESIDUAL: tl.constexpr = tl.constexpr(int(Purpose.RESIDUAL))
PURPOSE_BONUS: tl.constexpr = tl.constexpr(int(Purpose.BONUS))

# Vocabulary tile of the race: 1024 fp32 lanes keep four warps busy (8 values per thread) and bound the
# registers a program holds; V = 49152 is 48 tiles. Not yet swept on the H200 (scripts/bench_kernels.py).
RACE_BLOCK_V = 1024


# --------------------------------------------------------------------------- host helpers


def resolve_backend(backend: str, *tensors: Tensor) -> str:
    """``"triton"`` or ``"torch"``: the explicit choice, or for ``"auto"`` Triton on CUDA / under the interpreter.

    ``"auto"`` runs the Triton kernel when the tensors live on CUDA or when ``TRITON_INTERPRET=1`` (the CPU tests
    then execute the real kernel code in Triton's interpreter; the variable must be set before Triton is imported).
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    on_cuda = any(t.is_cuda for t in tensors if isinstance(t, Tensor))
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "triton" and not (on_cuda or interpreted):
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to interpret on the CPU")
    if backend != "auto":
        return backend
    return "triton" if on_cuda or interpreted else "torch"


def split_seed(seed: int) -> tuple[int, int]:
    """The generation seed as its (low, high) 32-bit words; a host int, so no device sync."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed & contract.MASK32, seed >> 32


def per_row_words(x: int | Tensor, R: int, device: torch.device, name: str) -> Tensor:
    """An int or ``[R]`` integer tensor as a contiguous ``[R]`` int64 device tensor (no sync: an int is filled in on
    the device, where ``torch.as_tensor(int, device=cuda)`` would be a blocking copy that waits for the queue)."""
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.full((R,), x, dtype=torch.int64, device=device)
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an int or an integer tensor, got dtype {t.dtype}")
    if t.ndim == 0:
        t = t.expand(R)
    if t.shape != (R,):
        raise ValueError(f"{name} must be an int or have shape [{R}] (one per row), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).contiguous()


def hash_uniform_torch(seed: int, words: list[Tensor]) -> Tensor:
    """The torch fallback's uniforms: ``seed`` and the int64 ``words`` (request id, position, purpose, lane),
    broadcast, through the reference's own hash (unchecked, no sync)."""
    lo, hi = split_seed(seed)
    device = words[0].device
    seed_words = [torch.tensor(lo, device=device), torch.tensor(hi, device=device)]
    return contract.uniform_from_words(seed_words + [w.to(torch.int64) for w in words])


# --------------------------------------------------------------------------- Triton helpers


@triton.jit
def mix32(x):
    """lowbias32 finaliser on uint32 words; uint32 multiplication wraps modulo 2³² by definition."""
    x = x ^ (x >> 16)
    x = x * MIX_MUL_1
    x = x ^ (x >> 15)
    x = x * MIX_MUL_2
    return x ^ (x >> 16)


@triton.jit
def hash_step(h, w):
    """One absorption step ``mix32((h ^ w) + golden)``; ``w`` is any integer (cast to its low 32 bits)."""
    return mix32((h ^ tl.cast(w, tl.uint32)) + GOLDEN)


@triton.jit
def hash_key(seed_lo, seed_hi, request_id, position, purpose):
    """The hash state after the five per-draw words; scalar per row, shared by every vocabulary lane."""
    h = hash_step(tl.cast(HASH_INIT, tl.uint32), seed_lo)
    h = hash_step(h, seed_hi)
    h = hash_step(h, request_id)
    h = hash_step(h, position)
    return hash_step(h, purpose)


@triton.jit
def uniform_at(key, lane):
    """float32 uniform in (0, 1) for ``lane`` (scalar or tile) under a row's ``key`` from :func:`hash_key`."""
    h = hash_step(key, lane)
    return ((h >> UNIFORM_SHIFT).to(tl.float32) + 0.5) * UNIFORM_SCALE


@triton.jit
def exponential_at(key, lanes):
    """``E_v = -log u_v`` [BLOCK_V] fp32 for the vocabulary ``lanes`` of a row's ``key``; always > 0."""
    return -tl.log(uniform_at(key, lanes))


@triton.jit
def race_update(best_score, best_index, weight, exponential, lanes, mask):
    """Fold one vocabulary tile into a running exponential race ``argmax_v weight(v) / E_v``.

    ``weight`` [BLOCK_V] fp32 (non-negative), ``exponential`` [BLOCK_V] from :func:`exponential_at`,
    ``lanes`` [BLOCK_V] vocabulary ids, ``mask`` [BLOCK_V] in range. Tiles must arrive in ascending lane
    order: a later tile wins only with a strictly larger score, and inside a tile the lowest lane among the
    maxima wins, so ties go to the lowest index as in torch.argmax.
    """
    score = tl.math.div_rn(weight, exponential)  # [BLOCK_V] exactly as torch: p / -log(u)
    score = tl.where(mask, score, -1.0)  # real scores are >= 0, so padding lanes never win
    tile_best = tl.max(score, axis=0)
    tile_index = tl.min(tl.where(score == tile_best, lanes, BIG_INDEX), axis=0)
    better = tile_best > best_score
    return tl.where(better, tile_best, best_score), tl.where(better, tile_index, best_index)


@triton.jit
def race_winner(score_ptr, index_ptr, row, nb, BLOCK_NB: tl.constexpr):
    """The race winner of ``row`` [int64] from its ``nb`` partials (best score per vocabulary block, lowest index on
    ties), as written by a split race (the split sampler, the draft head's split kernels).

    Blocks cover ascending lanes and each partial holds its block's lowest index among its maxima, so the lowest
    index among the blocks with the best score is what the serial :func:`race_update` fold returns.
    """
    blocks = tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    valid = blocks < nb
    # From L2 (.cg): a fused reduction reads partials other programs of the running launch wrote
    scores = tl.load(score_ptr + row * nb + blocks, mask=valid, other=-2.0,
                     cache_modifier=".cg")  # real partials are >= -1
    indices = tl.load(index_ptr + row * nb + blocks, mask=valid, other=0, cache_modifier=".cg")  # [BLOCK_NB] int64
    best = tl.max(scores, axis=0)
    return tl.min(tl.where(valid & (scores == best), indices, BIG_INDEX), axis=0).to(tl.int64)


@triton.jit
def argmax_update(best_value, best_index, values, lanes):
    """Fold one tile of ``values`` [BLOCK_V] (padding = -inf) into a running lowest-index argmax."""
    tile_best = tl.max(values, axis=0)
    tile_index = tl.min(tl.where(values == tile_best, lanes, BIG_INDEX), axis=0)
    better = tile_best > best_value
    return tl.where(better, tile_best, best_value), tl.where(better, tile_index, best_index)
