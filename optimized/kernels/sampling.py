"""Triton twins of the random-number contract: the uint32 hash and the exponential-race sampler.

Fast twin of ``reference/sampling.py`` (``hash_uniform``, ``sample``), which implements the random-number
contract of ``docs/contracts.md``; the drafter's slots (docs/method.md §1) and the verifier's accept test, residual
and bonus draws (docs/method.md §4) are all built on these two primitives. Names follow ``docs/method.md``:
``p_t`` target, ``p_d`` draft, ``ℓ`` verify length, ``γ`` block size.

The math, once more, because the kernels below must reproduce it bit for bit::

    mix32(x):   x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16   (mod 2³²)
    step(h, w): mix32((h ^ w) + 0x9E3779B9)
    h = 0x2545F491;  for w in (seed_lo, seed_hi, request_id, position, purpose, lane): h = step(h, w)
    u = ((h >> 9) + 0.5) / 2²³          (float32, exact, strictly inside (0, 1))
    token = argmax_v p(v) / E_v,  E_v = -log u_v     (ties -> lowest v)

Triton has a real ``uint32``, so the kernels multiply with wrap-around instead of the 16-bit split the torch
code needs. The first five words are the same for every lane of a row, so the kernels hash them once per row
(:func:`_hash_key`, a scalar) and only the last step runs per vocabulary lane (:func:`_uniform_at`).

Exactness. Integer outputs equal the reference exactly as long as the float32 race scores do. The division
uses ``div_rn`` (IEEE round-to-nearest, as torch does); ``tl.log`` may differ from torch's ``log`` by an ulp
on some devices, which can flip a token only when the two best scores of a row agree to ~1e-7 relative.

Backends. Every public op takes ``backend="auto" | "triton" | "torch"``; ``"auto"`` runs the Triton kernel
when the tensors live on CUDA or when ``TRITON_INTERPRET=1`` (the CPU tests then execute the real kernel
code in Triton's interpreter; the variable must be set before this module is imported), and the torch
fallback otherwise. Neither path synchronises with the host: values are not validated (the reference does
that), only shapes and dtypes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.sampling import Purpose

__all__ = ["hash_uniform", "resolve_backend", "sample"]

_MASK32 = 0xFFFFFFFF
_UNIFORM_BITS = 23  # reference/sampling.py: 23 bits + the half-step offset = 24 significant bits, exact in fp32

_HASH_INIT = 0x2545F491  # the contract's constants (docs/contracts.md, reference/sampling.py)
_GOLDEN = 0x9E3779B9
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B
_UNIFORM_SHIFT = 32 - _UNIFORM_BITS
_UNIFORM_SCALE = 1.0 / 2**_UNIFORM_BITS  # a power of two: multiplying by it is exact

# Module-level constants used inside @triton.jit functions must be tl.constexpr.
HASH_INIT: tl.constexpr = tl.constexpr(_HASH_INIT)
GOLDEN: tl.constexpr = tl.constexpr(_GOLDEN)
MIX_MUL_1: tl.constexpr = tl.constexpr(_MIX_MUL_1)
MIX_MUL_2: tl.constexpr = tl.constexpr(_MIX_MUL_2)
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
# sample(split=None) on CUDA below this many rows splits each row's vocabulary over programs of SAMPLE_SPLIT_CHUNK
# lanes (48 programs per row at V = 49,152). A heuristic not yet timed on a GPU: at R = 1 the one-program race
# took 0.089 ms of device time (H200 profile none-b1); from ~R = 132 rows the one-program grid fills the SMs alone.
SAMPLE_SPLIT_CHUNK = RACE_BLOCK_V
SAMPLE_SPLIT_MAX_R = 64
# Elementwise tile of the hash test kernel; it is a test/diagnostic kernel, the size is not tuned.
HASH_BLOCK = 1024


# --------------------------------------------------------------------------- backend choice


def resolve_backend(backend: str, *tensors: Tensor) -> str:
    """``"triton"`` or ``"torch"``: the explicit choice, or for ``"auto"`` Triton on CUDA / under the interpreter."""
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
    return seed & _MASK32, seed >> 32


# --------------------------------------------------------------------------- Triton helpers (reusable)


@triton.jit
def _mix32(x):
    """lowbias32 finaliser on uint32 words; uint32 multiplication wraps modulo 2³² by definition."""
    x = x ^ (x >> 16)
    x = x * MIX_MUL_1
    x = x ^ (x >> 15)
    x = x * MIX_MUL_2
    return x ^ (x >> 16)


@triton.jit
def _hash_step(h, w):
    """One absorption step ``mix32((h ^ w) + golden)``; ``w`` is any integer (cast to its low 32 bits)."""
    return _mix32((h ^ tl.cast(w, tl.uint32)) + GOLDEN)


@triton.jit
def _hash_key(seed_lo, seed_hi, request_id, position, purpose):
    """The hash state after the five per-draw words; scalar per row, shared by every vocabulary lane."""
    h = _hash_step(tl.cast(HASH_INIT, tl.uint32), seed_lo)
    h = _hash_step(h, seed_hi)
    h = _hash_step(h, request_id)
    h = _hash_step(h, position)
    return _hash_step(h, purpose)


@triton.jit
def _uniform_at(key, lane):
    """float32 uniform in (0, 1) for ``lane`` (scalar or tile) under a row's ``key`` from :func:`_hash_key`."""
    h = _hash_step(key, lane)
    return ((h >> UNIFORM_SHIFT).to(tl.float32) + 0.5) * UNIFORM_SCALE


@triton.jit
def _exponential_at(key, lanes):
    """``E_v = -log u_v`` [BLOCK_V] fp32 for the vocabulary ``lanes`` of a row's ``key``; always > 0."""
    return -tl.log(_uniform_at(key, lanes))


@triton.jit
def _race_update(best_score, best_index, weight, exponential, lanes, mask):
    """Fold one vocabulary tile into a running exponential race ``argmax_v weight(v) / E_v``.

    ``weight`` [BLOCK_V] fp32 (non-negative), ``exponential`` [BLOCK_V] from :func:`_exponential_at`,
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
def _race_winner(score_ptr, index_ptr, row, nb, BLOCK_NB: tl.constexpr):
    """The race winner of ``row`` [int64] from its ``nb`` partials (best score per vocabulary block, lowest index on
    ties), as written by a split race (``_sample_split_kernel``, the draft head's split kernels).

    Blocks cover ascending lanes and each partial holds its block's lowest index among its maxima, so the lowest
    index among the blocks with the best score is what the serial ``_race_update`` fold returns.
    """
    blocks = tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    valid = blocks < nb
    scores = tl.load(score_ptr + row * nb + blocks, mask=valid, other=-2.0)  # real partials are >= -1
    indices = tl.load(index_ptr + row * nb + blocks, mask=valid, other=0)  # [BLOCK_NB] int64
    best = tl.max(scores, axis=0)
    return tl.min(tl.where(valid & (scores == best), indices, BIG_INDEX), axis=0).to(tl.int64)


@triton.jit
def _argmax_update(best_value, best_index, values, lanes):
    """Fold one tile of ``values`` [BLOCK_V] (padding = -inf) into a running lowest-index argmax."""
    tile_best = tl.max(values, axis=0)
    tile_index = tl.min(tl.where(values == tile_best, lanes, BIG_INDEX), axis=0)
    better = tile_best > best_value
    return tl.where(better, tile_best, best_value), tl.where(better, tile_index, best_index)


# --------------------------------------------------------------------------- hash_uniform


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "n"])
def _hash_uniform_kernel(
    out_ptr,  # [n] float32 uniforms
    request_ids_ptr,  # [n] integer request ids (< 2³¹)
    positions_ptr,  # [n] integer absolute positions (< 2³²)
    purposes_ptr,  # [n] integer purpose words
    lanes_ptr,  # [n] integer lanes
    seed_lo,  # low 32 bits of the seed
    seed_hi,  # high 32 bits of the seed
    n,  # number of elements
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    rid = tl.load(request_ids_ptr + offs, mask=mask, other=0)
    pos = tl.load(positions_ptr + offs, mask=mask, other=0)
    purpose = tl.load(purposes_ptr + offs, mask=mask, other=0)
    lane = tl.load(lanes_ptr + offs, mask=mask, other=0)
    key = _hash_key(seed_lo, seed_hi, rid, pos, purpose)
    tl.store(out_ptr + offs, _uniform_at(key, lane), mask=mask)


def _mul32_torch(x: Tensor, c: int) -> Tensor:
    # int64 has no wrap-around uint32 multiply: split the constant in 16-bit halves (products stay < 2⁴⁹).
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _hash_step_torch(h: Tensor, w: Tensor) -> Tensor:
    x = ((h ^ (w & _MASK32)) + _GOLDEN) & _MASK32
    x = x ^ (x >> 16)
    x = _mul32_torch(x, _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32_torch(x, _MIX_MUL_2)
    return x ^ (x >> 16)


def _hash_uniform_torch(seed: int, words: list[Tensor]) -> Tensor:
    lo, hi = split_seed(seed)
    device = words[0].device
    h = torch.tensor(_HASH_INIT, dtype=torch.int64, device=device)
    for w in [torch.tensor(lo, device=device), torch.tensor(hi, device=device), *words]:
        h = _hash_step_torch(h, w.to(torch.int64))
    return ((h >> _UNIFORM_SHIFT).to(torch.float32) + 0.5) * _UNIFORM_SCALE


def hash_uniform(
    seed: int,
    request_ids: int | Tensor,
    positions: int | Tensor,
    purpose: int | Tensor,
    lane: int | Tensor = 0,
    backend: str = "auto",
) -> Tensor:
    """Uniforms keyed by ``(seed, request_id, position, purpose, lane)``; twin of ``reference.sampling.hash_uniform``.

    Args:
        seed: generation seed, an int in ``[0, 2⁶⁴)``.
        request_ids: int or integer tensor (broadcast with the others).
        positions: int or integer tensor.
        purpose: int or integer tensor (:class:`reference.sampling.Purpose` / ``draft_purpose``).
        lane: int or integer tensor (vocabulary index, 0 for the accept test).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        float32 tensor of the broadcast shape, on the tensors' device.
    """
    split_seed(seed)  # validates the seed before any launch
    args = (request_ids, positions, purpose, lane)
    device = next((t.device for t in args if isinstance(t, Tensor)), torch.device("cpu"))
    words = []
    for name, x in zip(("request_ids", "positions", "purpose", "lane"), args):
        t = torch.as_tensor(x, device=device)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or an integer tensor, got dtype {t.dtype}")
        words.append(t.to(torch.int64))
    words = list(torch.broadcast_tensors(*words))
    shape = words[0].shape
    if resolve_backend(backend, *words) == "torch":
        return _hash_uniform_torch(seed, words)
    flat = [w.contiguous().reshape(-1) for w in words]  # [n] each
    out = torch.empty(flat[0].numel(), dtype=torch.float32, device=device)  # [n]
    if out.numel():
        lo, hi = split_seed(seed)
        grid = (triton.cdiv(out.numel(), HASH_BLOCK),)
        _hash_uniform_kernel[grid](out, *flat, lo, hi, out.numel(), BLOCK=HASH_BLOCK)
    return out.reshape(shape)


# --------------------------------------------------------------------------- sample


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _sample_kernel(
    tokens_ptr,  # [R] int64 output tokens
    probs_ptr,  # [R, V] non-negative weights (fp32 / fp16 / bf16), rows need not be normalised
    stride_pr,  # row stride of probs (elements)
    request_ids_ptr,  # [R] integer request ids
    positions_ptr,  # [R] integer positions of the drawn tokens
    purposes_ptr,  # [R] integer purpose words
    seed_lo,  # low 32 bits of the seed
    seed_hi,  # high 32 bits of the seed
    V,  # vocabulary size
    BLOCK_V: tl.constexpr,  # vocabulary tile
):
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: R·V can exceed 2³¹ at large batches
    key = _hash_key(seed_lo, seed_hi, tl.load(request_ids_ptr + row), tl.load(positions_ptr + row),
                    tl.load(purposes_ptr + row))
    best_score = -1.0
    best_index = 0
    for start in range(0, V, BLOCK_V):
        lanes = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        p = tl.load(probs_ptr + row * stride_pr + lanes, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_V]
        best_score, best_index = _race_update(best_score, best_index, p, _exponential_at(key, lanes), lanes, mask)
    tl.store(tokens_ptr + row, best_index.to(tl.int64))


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _sample_split_kernel(
    best_score_ptr,  # [R, NB] fp32 out: the race winner's score in each vocabulary chunk
    best_index_ptr,  # [R, NB] int64 out: its vocabulary index
    probs_ptr, stride_pr, request_ids_ptr, positions_ptr, purposes_ptr, seed_lo, seed_hi, V,
    NB,  # chunks per row
    CHUNK: tl.constexpr,  # vocabulary lanes per program (a multiple of BLOCK_V)
    BLOCK_V: tl.constexpr,
):
    """Grid (R, NB): program (r, b) runs the race over lanes b·CHUNK .. (b+1)·CHUNK-1 of row r, tile by tile in
    ascending order exactly as :func:`_sample_kernel` does over the whole row."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    key = _hash_key(seed_lo, seed_hi, tl.load(request_ids_ptr + row), tl.load(positions_ptr + row),
                    tl.load(purposes_ptr + row))
    best_score = -1.0
    best_index = 0
    for start in range(0, CHUNK, BLOCK_V):
        lanes = chunk * CHUNK + start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        p = tl.load(probs_ptr + row * stride_pr + lanes, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_V]
        best_score, best_index = _race_update(best_score, best_index, p, _exponential_at(key, lanes), lanes, mask)
    tl.store(best_score_ptr + row * NB + chunk, best_score)
    tl.store(best_index_ptr + row * NB + chunk, best_index.to(tl.int64))


@triton.jit
def _sample_split_reduce_kernel(tokens_ptr, best_score_ptr, best_index_ptr, NB, BLOCK_NB: tl.constexpr):
    """One program per row: the token from its chunk winners (:func:`_race_winner`, the whole-row race's tie rule),
    so it equals :func:`_sample_kernel`'s."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(tokens_ptr + row, _race_winner(best_score_ptr, best_index_ptr, row, NB, BLOCK_NB))


def _per_row_words(x: int | Tensor, R: int, device: torch.device, name: str) -> Tensor:
    """An int or ``[R]`` integer tensor as a contiguous ``[R]`` int64 device tensor (no sync)."""
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an int or an integer tensor, got dtype {t.dtype}")
    if t.ndim == 0:
        t = t.expand(R)
    if t.shape != (R,):
        raise ValueError(f"{name} must be an int or have shape [{R}] (one per row), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64).contiguous()


def sample(
    probs: Tensor,
    seed: int,
    request_ids: Tensor,
    positions: Tensor,
    purpose: int | Tensor,
    backend: str = "auto",
    *,
    split: bool | None = None,
) -> Tensor:
    """One token per row by the exponential race; twin of ``reference.sampling.sample``.

    Args:
        probs: ``[R, V]`` non-negative weights (fp32/fp16/bf16; computed in fp32), rows need not be normalised.
        seed: generation seed.
        request_ids: ``[R]`` request ids.
        positions: ``[R]`` absolute positions of the tokens being drawn.
        purpose: int or ``[R]`` purpose words.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        split: Triton variant: ``True`` splits each row's vocabulary over ``SAMPLE_SPLIT_CHUNK``-lane programs and
            reduces the chunk winners in a second launch; ``False`` one program per row; ``None`` splits on CUDA
            below ``SAMPLE_SPLIT_MAX_R`` rows (one program walking 49,152 lanes took 0.089 ms of an H200 step at
            R = 1, profile ``none-b1``, 2026-11-29). Same tokens either way.

    Returns:
        ``[R]`` int64 tokens; ties go to the lowest index.
    """
    if probs.ndim != 2 or not probs.dtype.is_floating_point:
        raise ValueError(f"probs must be a float tensor [R, V], got {probs.dtype} {tuple(probs.shape)}")
    R, V = probs.shape
    if V == 0:
        raise ValueError("probs has an empty vocabulary dimension")
    rid = _per_row_words(request_ids, R, probs.device, "request_ids")  # [R]
    pos = _per_row_words(positions, R, probs.device, "positions")  # [R]
    pur = _per_row_words(purpose, R, probs.device, "purpose")  # [R]
    lo, hi = split_seed(seed)
    if resolve_backend(backend, probs) == "torch":
        lanes = torch.arange(V, device=probs.device)[None, :]  # [1, V]
        u = _hash_uniform_torch(seed, [rid[:, None], pos[:, None], pur[:, None], lanes])  # [R, V]
        return (probs.float() / -torch.log(u)).argmax(dim=-1)
    tokens = torch.empty(R, dtype=torch.int64, device=probs.device)  # [R]
    if R:
        if probs.stride(-1) != 1:
            probs = probs.contiguous()
        if split is None:
            split = probs.is_cuda and R < SAMPLE_SPLIT_MAX_R
        if split:
            nb = triton.cdiv(V, SAMPLE_SPLIT_CHUNK)
            scores = torch.empty(R, nb, dtype=torch.float32, device=probs.device)  # [R, NB]
            indices = torch.empty(R, nb, dtype=torch.int64, device=probs.device)  # [R, NB]
            _sample_split_kernel[(R, nb)](scores, indices, probs, probs.stride(0), rid, pos, pur, lo, hi, V, nb,
                                          CHUNK=SAMPLE_SPLIT_CHUNK, BLOCK_V=RACE_BLOCK_V)
            _sample_split_reduce_kernel[(R,)](tokens, scores, indices, nb, BLOCK_NB=triton.next_power_of_2(nb),
                                              num_warps=1)
        else:
            _sample_kernel[(R,)](tokens, probs, probs.stride(0), rid, pos, pur, lo, hi, V, BLOCK_V=RACE_BLOCK_V)
    return tokens
