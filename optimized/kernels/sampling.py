"""Triton twins of the random-number contract: the uint32 hash and the exponential-race sampler.

Fast twin of ``reference/sampling.py`` (``hash_uniform``, ``sample``), which implements the random-number
contract of ``docs/contracts.md``; the drafter's slots (docs/method.md §1) and the verifier's accept test, residual
and bonus draws (docs/method.md §4) are all built on these two primitives. Names follow ``docs/method.md``:
``p_t`` target, ``p_d`` draft, ``ℓ`` verify length, ``γ`` block size.

The hash and the race are spelled out in ``optimized/kernels/common.py``, where their Triton building blocks live
(shared with ``verify`` and ``draft_head``); this module holds the two ops built from them.

Exactness. Integer outputs equal the reference exactly as long as the float32 race scores do. The division
uses ``div_rn`` (IEEE round-to-nearest, as torch does); ``tl.log`` may differ from torch's ``log`` by an ulp
on some devices, which can flip a token only when the two best scores of a row agree to ~1e-7 relative.

Backends. Every public op takes ``backend="auto" | "triton" | "torch"`` (``common.resolve_backend``). Neither
path synchronises with the host: values are not validated (the reference does that), only shapes and dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from optimized.kernels.common import (
    RACE_BLOCK_V,
    exponential_at,
    hash_key,
    hash_uniform_torch,
    per_row_words,
    race_update,
    race_winner,
    resolve_backend,
    split_seed,
    uniform_at,
)

__all__ = ["hash_uniform", "sample"]

# sample(split=None) on CUDA below this many rows splits each row's vocabulary over programs of SAMPLE_SPLIT_CHUNK
# lanes (48 programs per row at V = 49,152). A heuristic not yet timed on a GPU: at R = 1 the one-program race
# took 0.089 ms of device time (H200 profile none-b1); from ~R = 132 rows the one-program grid fills the SMs alone.
SAMPLE_SPLIT_CHUNK = RACE_BLOCK_V
SAMPLE_SPLIT_MAX_R = 64
# Elementwise tile of the hash test kernel; it is a test/diagnostic kernel, the size is not tuned.
HASH_BLOCK = 1024


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
    key = hash_key(seed_lo, seed_hi, rid, pos, purpose)
    tl.store(out_ptr + offs, uniform_at(key, lane), mask=mask)


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
        return hash_uniform_torch(seed, words)
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
    key = hash_key(seed_lo, seed_hi, tl.load(request_ids_ptr + row), tl.load(positions_ptr + row),
                    tl.load(purposes_ptr + row))
    best_score = -1.0
    best_index = 0
    for start in range(0, V, BLOCK_V):
        lanes = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        p = tl.load(probs_ptr + row * stride_pr + lanes, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_V]
        best_score, best_index = race_update(best_score, best_index, p, exponential_at(key, lanes), lanes, mask)
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
    key = hash_key(seed_lo, seed_hi, tl.load(request_ids_ptr + row), tl.load(positions_ptr + row),
                    tl.load(purposes_ptr + row))
    best_score = -1.0
    best_index = 0
    for start in range(0, CHUNK, BLOCK_V):
        lanes = chunk * CHUNK + start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = lanes < V
        p = tl.load(probs_ptr + row * stride_pr + lanes, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_V]
        best_score, best_index = race_update(best_score, best_index, p, exponential_at(key, lanes), lanes, mask)
    tl.store(best_score_ptr + row * NB + chunk, best_score)
    tl.store(best_index_ptr + row * NB + chunk, best_index.to(tl.int64))


@triton.jit
def _sample_split_reduce_kernel(tokens_ptr, best_score_ptr, best_index_ptr, NB, BLOCK_NB: tl.constexpr):
    """One program per row: the token from its chunk winners (``common.race_winner``, the whole-row race's tie
    rule), so it equals :func:`_sample_kernel`'s."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(tokens_ptr + row, race_winner(best_score_ptr, best_index_ptr, row, NB, BLOCK_NB))


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
    rid = per_row_words(request_ids, R, probs.device, "request_ids")  # [R]
    pos = per_row_words(positions, R, probs.device, "positions")  # [R]
    pur = per_row_words(purpose, R, probs.device, "purpose")  # [R]
    lo, hi = split_seed(seed)
    if resolve_backend(backend, probs) == "torch":
        lanes = torch.arange(V, device=probs.device)[None, :]  # [1, V]
        u = hash_uniform_torch(seed, [rid[:, None], pos[:, None], pur[:, None], lanes])  # [R, V]
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
