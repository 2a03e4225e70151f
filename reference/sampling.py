"""Sampling: temperature / top-k / top-p, and the random-number contract every draw goes through.

This file implements the random-number contract, fixed bit for bit in ``docs/contracts.md``, and the sampling
primitives that the drafter (docs/method.md §1, slots sampled left to right) and the verifier (docs/method.md §4,
accept test, residual and bonus) are built on. Names follow ``docs/method.md``: ``p_t`` target, ``p_d`` draft,
``ℓ`` verify length, ``γ`` block size.

**Why a hash instead of a generator.** Every uniform is a pure function of
``(seed, request_id, position, purpose, lane)``. The order in which requests are batched, padded or
scheduled then cannot change a request's output, a request never depends on its neighbours, and the
Triton twin (``optimized/``) can draw the very same numbers without sharing generator state.

**The hash** works on unsigned 32-bit words, all arithmetic modulo 2³²::

    mix32(x):  x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16
    step(h, w) = mix32((h ^ w) + 0x9E3779B9)
    h = 0x2545F491
    for w in (seed & 0xFFFFFFFF, seed >> 32, request_id, position, purpose, lane): h = step(h, w)
    u = ((h >> 9) + 0.5) / 2**23

``u`` keeps the top 23 bits of ``h``: ``(2j + 1) / 2²⁴`` has at most 24 significant bits, so it is exact
in float32 and lies in ``[2⁻²⁴, 1 - 2⁻²⁴]``, strictly inside (0, 1). (Keeping 24 bits, ``(h >> 8) + 0.5``,
needs 25 significant bits; float32 rounds the top value to exactly 1.0 and ``-log u`` to 0.)

Torch has no uint32, and int64 multiplication of two 32-bit words overflows. So :func:`_mul32` multiplies
by the two 16-bit halves of the constant and masks, keeping every intermediate below 2⁴⁹: the result does
not rely on signed-overflow behaviour and is the same on every device.

**Categorical draws** use the exponential race: ``token = argmax_v p(v) / E_v`` with ``E_v = -log u_v``
(``u_v`` at ``lane = v``) is an exact sample from ``p / Σp`` — it is Gumbel-max in disguise — so residual
distributions ``max(0, p_t - p_d)`` need no normalisation. Ties go to the lowest index.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

# The contract's constants, public so that the fast path's kernels take them from here (one source of truth).
MASK32 = 0xFFFFFFFF
HASH_INIT = 0x2545F491  # arbitrary odd start word, so that an all-zero key does not hash to mix32(golden)
GOLDEN = 0x9E3779B9  # 2³² / golden ratio: the usual additive constant that decorrelates successive words
MIX_MUL_1 = 0x7FEB352D  # multipliers of the "lowbias32" integer finaliser (bias-searched by C. Wellons)
MIX_MUL_2 = 0x846CA68B
UNIFORM_BITS = 23  # see the module docstring: 23 bits + the half-step offset = 24 bits, exact in float32
_MAX_REQUEST_ID = 2**31  # contract: request ids are below 2³¹ (they fit int32 on the device side)


class Purpose(enum.IntEnum):
    """What a uniform is used for; part of the hash key so different uses never share numbers."""

    DRAFT = 1  # draft slot k uses DRAFT + 16·k, see draft_purpose
    ACCEPT = 2  # the accept test of a draft token (lane 0)
    RESIDUAL = 3  # the recovered token after a rejection, drawn from max(0, p_t - p_d)
    BONUS = 4  # the token drawn from p_t after all ℓ drafts were accepted (also the first token after prefill)


def draft_purpose(slot: int) -> int:
    """Purpose word of draft slot ``k`` (1..γ): ``1 + 16·k``.

    The slot is part of the key so that a position re-drafted from a later anchor (at another slot)
    gets fresh numbers instead of repeating the draft that was just rejected.
    """
    if slot < 1:
        raise ValueError(f"draft slots are numbered from 1, got slot {slot}")
    return int(Purpose.DRAFT) + 16 * slot


# --------------------------------------------------------------------------- the hash


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2³²`` for words ``x < 2³²`` held in int64, without overflowing int64.

    ``x·c = x·c_lo + 2¹⁶·x·c_hi``; only the low 16 bits of ``x·c_hi`` survive the shift modulo 2³²,
    so every intermediate stays below 2⁴⁹.
    """
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & MASK32


def _mix32(x: Tensor) -> Tensor:
    # x is non-negative, so the arithmetic right shift of int64 equals the logical one of uint32.
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL_2)
    return x ^ (x >> 16)


def _step(h: Tensor, w: Tensor) -> Tensor:
    # Only the low 32 bits of a word enter, as the Triton twin's uint32 cast does (validated words are < 2³² anyway).
    return _mix32(((h ^ (w & MASK32)) + GOLDEN) & MASK32)


def uniform_from_words(words: list[Tensor]) -> Tensor:
    """The contract's uniform of int64 word tensors ``(seed_lo, seed_hi, request_id, position, purpose, lane)``,
    broadcast; nothing is validated and nothing syncs (the fast path's torch fallback calls it on device tensors).
    :func:`hash_uniform` is the checked entry point."""
    h = torch.tensor(HASH_INIT, dtype=torch.int64, device=words[0].device)
    for w in words:  # broadcasting grows h only when a word is wider, so the vocabulary lane comes last
        h = _step(h, w)
    return ((h >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) / float(2**UNIFORM_BITS)


def _as_word(x: int | Tensor, name: str, limit: int, device: torch.device | None) -> Tensor:
    """An int or integer tensor as an int64 tensor of words, checked to lie in ``[0, limit)``."""
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor or int, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
        raise ValueError(f"{name} must lie in [0, {limit}), got values in [{int(t.min())}, {int(t.max())}]")
    return t


def hash_uniform(
    seed: int,
    request_ids: int | Tensor,
    positions: int | Tensor,
    purpose: int | Tensor,
    lane: int | Tensor = 0,
) -> Tensor:
    """Uniforms in (0, 1) keyed by ``(seed, request_id, position, purpose, lane)`` (the contract above).

    Args:
        seed: generation seed, ``0 <= seed < 2⁶⁴`` (split into its low and high 32-bit words).
        request_ids: request ids ``< 2³¹``, int or int64 tensor.
        positions: absolute positions of the tokens being decided, ``< 2³²``.
        purpose: a :class:`Purpose` value or :func:`draft_purpose` word, ``< 2³²``.
        lane: vocabulary index for categorical draws, 0 for the accept test, ``< 2³²``.

    Returns:
        float32 tensor of the broadcast shape of the tensor arguments (0-d if all are ints), on their device.
    """
    if isinstance(seed, Tensor):
        seed = int(seed)
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    device = next((t.device for t in (request_ids, positions, purpose, lane) if isinstance(t, Tensor)), None)
    words = [
        _as_word(seed & MASK32, "seed", 2**32, device),
        _as_word(seed >> 32, "seed", 2**32, device),
        _as_word(request_ids, "request_ids", _MAX_REQUEST_ID, device),
        _as_word(positions, "positions", 2**32, device),
        _as_word(purpose, "purpose", 2**32, device),
        _as_word(lane, "lane", 2**32, device),
    ]
    return uniform_from_words(words)


# --------------------------------------------------------------------------- logits -> probabilities


def _per_row(x: float | int | Tensor, rows: int, ndim: int, dtype: torch.dtype, device: torch.device,
             name: str) -> Tensor:
    """A per-request parameter (scalar or ``[R]``) shaped ``[R, 1, …, 1]`` to broadcast over ``[R, …, V]``."""
    t = torch.as_tensor(x, dtype=dtype, device=device)
    if t.ndim == 0:
        t = t.expand(rows)
    if t.shape != (rows,):
        raise ValueError(f"{name} must be a scalar or have shape [{rows}] (one per request), got {tuple(t.shape)}")
    return t.reshape(rows, *([1] * (ndim - 1)))


def logits_to_probs(
    logits: Tensor,
    temperature: float | Tensor,
    top_p: float | Tensor | None = None,
    top_k: int | Tensor | None = None,
) -> Tensor:
    """Turn logits into the distribution a request samples from (float32).

    Order (docs/contracts.md): temperature, top-k, top-p, renormalise.

    * temperature 0: one-hot at the argmax (lowest index on ties), so greedy rows go through the same
      verification code exactly (docs/method.md §4: accept iff ``x_k = argmax p_t``).
    * top-k: keep the logits ``>=`` the k-th largest (ties at the k-th are all kept); 0 turns it off.
    * top-p: stable descending sort of the top-k distribution, keep the smallest prefix whose mass reaches
      ``top_p`` (the first token always); 1.0 turns it off.

    Args:
        logits: ``[R, …, V]`` logits of any float dtype; computed in float32.
        temperature: scalar or ``[R]``, ``>= 0``, broadcast over the middle dimensions.
        top_p: scalar or ``[R]`` in (0, 1]; None means off.
        top_k: scalar or ``[R]`` integers ``>= 0``; None means off.

    Returns:
        ``[R, …, V]`` float32 probabilities, each row summing to 1.
    """
    if logits.ndim < 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float tensor [R, ..., V], got {logits.dtype} {tuple(logits.shape)}")
    x = logits.float()  # [R, …, V]
    if torch.isnan(x).any() or (x == float("inf")).any():
        raise ValueError("logits contain NaN or +inf")
    if not torch.isfinite(x).any(dim=-1).all():
        raise ValueError("a logits row has no finite entry (every token masked)")
    R, V, dev = x.shape[0], x.shape[-1], x.device

    temp = _per_row(temperature, R, x.ndim, torch.float32, dev, "temperature")  # [R, 1, …, 1]
    if torch.isnan(temp).any() or (temp < 0).any():
        raise ValueError("temperature must be >= 0 (0 means greedy)")
    greedy = temp == 0  # [R, 1, …, 1]
    x = x / torch.where(greedy, torch.ones_like(temp), temp)

    # Filters that are off for every row cost nothing (two vocabulary sorts otherwise): the result is the same.
    if top_k is not None and not isinstance(top_k, Tensor) and int(top_k) == 0:
        top_k = None
    elif isinstance(top_k, Tensor) and bool((top_k == 0).all()):
        top_k = None
    if top_p is not None and not isinstance(top_p, Tensor) and float(top_p) == 1.0:
        top_p = None
    elif isinstance(top_p, Tensor) and bool((top_p == 1).all()):
        top_p = None
    keep = torch.ones_like(x, dtype=torch.bool)  # [R, …, V]
    if top_k is not None:
        k = _per_row(top_k, R, x.ndim, torch.int64, dev, "top_k")
        if (k < 0).any():
            raise ValueError("top_k must be >= 0 (0 means off)")
        k = torch.where((k == 0) | (k > V), torch.full_like(k, V), k)  # off, or more than V: keep all
        sorted_x = x.sort(dim=-1, descending=True).values  # [R, …, V]
        kth = sorted_x.gather(-1, (k - 1).expand(*x.shape[:-1], 1))  # [R, …, 1] the k-th largest logit
        keep &= x >= kth
    if top_p is not None:
        p = _per_row(top_p, R, x.ndim, torch.float32, dev, "top_p")
        if torch.isnan(p).any() or (p <= 0).any() or (p > 1).any():
            raise ValueError("top_p must lie in (0, 1] (1 means off)")
        probs = x.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # [R, …, V] after top-k
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [R, …, V]
        cum = sorted_p.cumsum(dim=-1)  # [R, …, V]
        mass_before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)  # [R, …, V] exclusive
        # A token is in the smallest prefix reaching top_p iff the tokens before it have not reached it;
        # the first token has mass_before = 0 < top_p, so it is always kept.
        # top_p = 1 is "off" explicitly: rounding can make the cumulative sum reach 1 before the tail.
        keep_sorted = (mass_before < p) | (p >= 1)
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    probs = x.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # [R, …, V] renormalised over the kept set

    one_hot = torch.nn.functional.one_hot(logits.float().argmax(dim=-1), V).to(torch.float32)  # [R, …, V]
    return torch.where(greedy, one_hot, probs)


# --------------------------------------------------------------------------- categorical draws


def sample(
    probs: Tensor,
    seed: int,
    request_ids: Tensor,
    positions: Tensor,
    purpose: int | Tensor,
) -> Tensor:
    """Draw one token per row by the exponential race ``argmax_v p(v) / E_v``, ``E_v = -log u_v``.

    ``probs`` need not be normalised (a residual ``max(0, p_t - p_d)`` can be passed as is). Row ``r``
    uses only its own key ``(seed, request_ids[r], positions[r], purpose[r], lane = v)``, so its token is
    the same alone, inside any batch and under any permutation of the batch.

    Args:
        probs: ``[R, V]`` non-negative weights, each row with positive mass; computed in float32.
        seed: generation seed.
        request_ids: ``[R]`` request ids.
        positions: ``[R]`` absolute position of the token being drawn.
        purpose: int or ``[R]`` purpose words (:class:`Purpose` / :func:`draft_purpose`).

    Returns:
        ``[R]`` int64 token ids; ties go to the lowest index.
    """
    if probs.ndim != 2 or not probs.dtype.is_floating_point:
        raise ValueError(f"probs must be a float tensor [R, V], got {probs.dtype} {tuple(probs.shape)}")
    p = probs.float()  # [R, V]
    R, V = p.shape
    if not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError("probs must be finite and non-negative")
    if not (p.sum(dim=-1) > 0).all():
        raise ValueError("a probs row has no positive mass; nothing can be sampled from it")

    def column(x: int | Tensor, name: str) -> int | Tensor:
        if not isinstance(x, Tensor) or x.ndim == 0:
            return x
        if x.shape != (R,):
            raise ValueError(f"{name} must have shape [{R}] (one per row of probs), got {tuple(x.shape)}")
        return x.to(p.device)[:, None]  # [R, 1]

    # A one-hot row (greedy, or a distribution left with a single token) wins the race at its only positive
    # entry whatever the uniforms are, so drawing them would not change the token: skip the hash then.
    if bool((p.count_nonzero(dim=-1) == 1).all()):
        return p.argmax(dim=-1)
    lanes = torch.arange(V, device=p.device)[None, :]  # [1, V]
    u = hash_uniform(seed, column(request_ids, "request_ids"), column(positions, "positions"),
                     column(purpose, "purpose"), lanes)  # [R, V] (broadcast)
    u = u.expand(R, V)
    race = p / -torch.log(u)  # [R, V]; u < 1 so -log u > 0
    return race.argmax(dim=-1)  # torch.argmax returns the first maximal index
