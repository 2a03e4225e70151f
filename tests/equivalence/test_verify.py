"""Equivalence of ``optimized.kernels.verify`` (Triton kernels and torch fallbacks) with ``reference.verify``.

Every field of the :class:`VerifyResult` (tokens, accepted counts, τ) is integer and must be *identical*
(torch.equal), for fp32/fp16/bf16 inputs, ragged verify lengths including padded rows (ℓ = 0, garbage drafts,
NaN in the rows that are never read), γ = 1, V not a power of two, and the residual's rounding fallback.
``greedy_verify`` is also checked on packed ``[N, V]`` logits with per-request row starts (the verify forward's
own output, read in place) against the same logits gathered to ``[R, γ+1, V]``.
The Triton cases run through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by the CI command)
and skip without it.
"""

from __future__ import annotations

import os

import pytest
import torch
from scipy.stats import chisquare

from optimized.kernels import verify as fast
from reference import verify as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
BACKENDS = [pytest.param("triton", marks=needs_triton), "torch"]
# rejection_sample also runs its split-vocabulary kernels, with 32-lane chunks so that V = 97 spans 4 of them.
RS_BACKENDS = [pytest.param("triton", marks=needs_triton), pytest.param("triton-split", marks=needs_triton), "torch"]
SPLIT_TEST_CHUNK = 32


def rejection_sample(*args, backend: str, **kwargs) -> ref.VerifyResult:
    """``fast.rejection_sample`` with ``backend`` one of RS_BACKENDS (``triton`` is the one-program kernel)."""
    if backend != "triton-split":
        return fast.rejection_sample(*args, backend=backend, split=False if backend == "triton" else None, **kwargs)
    chunk, fast.VERIFY_SPLIT_CHUNK = fast.VERIFY_SPLIT_CHUNK, SPLIT_TEST_CHUNK
    try:
        return fast.rejection_sample(*args, backend="triton", split=True, **kwargs)
    finally:
        fast.VERIFY_SPLIT_CHUNK = chunk
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1, 97), (6, 4, 97), (3, 7, 130)]  # (R, γ, V): R = 1, γ = 1, V not a power of two


def make_case(R: int, gamma: int, V: int, dtype: torch.dtype, seed: int, agreement: float = 0.7):
    """Drafts sampled from p_d; p_t mixes p_d with another distribution so roughly ``agreement`` is accepted.

    Row 0 is a padded row (ℓ = 0, drafts -1); rows past ℓ hold NaN, which neither implementation may read.
    """
    gen = torch.Generator().manual_seed(seed)
    p_d = torch.softmax(torch.randn(R, gamma, V, generator=gen) * 3, dim=-1)  # [R, γ, V]
    other = torch.softmax(torch.randn(R, gamma + 1, V, generator=gen) * 3, dim=-1)  # [R, γ+1, V]
    p_t = other.clone()
    p_t[:, :gamma] = agreement * p_d + (1 - agreement) * other[:, :gamma]
    drafts = torch.multinomial(p_d.reshape(-1, V), 1, generator=gen).reshape(R, gamma)  # [R, γ]
    lens = torch.randint(0, gamma + 1, (R,), generator=gen)  # [R]
    lens[-1] = gamma  # at least one fully verified row when R > 1
    lens[0] = 0
    drafts[0] = -1
    slot = torch.arange(gamma + 1)[None, :]  # [1, γ+1]
    p_t[slot > lens[:, None]] = float("nan")  # rows past ℓ are never read
    rid = torch.randint(0, 2**31, (R,), generator=gen)
    anchor = torch.randint(0, 2**20, (R,), generator=gen)
    to = lambda t: t.to(DEVICE)
    return to(drafts), to(lens), to(p_d.to(dtype)), to(p_t.to(dtype)), to(rid), to(anchor)


def assert_same(got: ref.VerifyResult, want: ref.VerifyResult) -> None:
    assert torch.equal(got.tokens.cpu(), want.tokens)
    assert torch.equal(got.num_accepted.cpu(), want.num_accepted)
    assert torch.equal(got.num_emitted.cpu(), want.num_emitted)


def reference_rejection_sample(drafts, lens, p_d, p_t, seed, rid, anchor) -> ref.VerifyResult:
    return ref.rejection_sample(drafts.cpu(), lens.cpu(), p_d.cpu(), p_t.cpu(), seed, rid.cpu(), anchor.cpu())


# --------------------------------------------------------------------------- rejection_sample


@pytest.mark.parametrize("backend", RS_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,gamma,V", SHAPES)
def test_rejection_sample_matches_reference(backend, dtype, R, gamma, V):
    for seed, agreement in ((R + gamma + V, 0.7), (5, 0.97)):  # mostly rejections, then mostly bonus draws
        case = make_case(R, gamma, V, dtype, seed, agreement)
        got = rejection_sample(*case[:4], 2**40 + seed, *case[4:], backend=backend)
        assert_same(got, reference_rejection_sample(*case[:4], 2**40 + seed, *case[4:]))


@pytest.mark.parametrize("backend", RS_BACKENDS)
def test_rejection_sample_all_accepted_and_padded(backend):
    # p_t = p_d: every verified draft is accepted, so num_accepted = ℓ and the last token is the bonus.
    drafts, lens, p_d, _, rid, anchor = make_case(5, 3, 97, torch.float32, seed=3)
    p_t = torch.cat([p_d, p_d[:, :1]], dim=1)  # [R, γ+1, V]
    got = rejection_sample(drafts, lens, p_d, p_t, 11, rid, anchor, backend=backend)
    assert torch.equal(got.num_accepted, lens)
    assert_same(got, reference_rejection_sample(drafts, lens, p_d, p_t, 11, rid, anchor))


@pytest.mark.parametrize("backend", RS_BACKENDS)
def test_rejection_sample_residual_rounding_fallback(backend):
    # p_t = p_d / 2 (unnormalised): a rejected slot's residual max(0, p_t - p_d) is all zero, so the
    # recovered token comes from p_t itself, with purpose RESIDUAL.
    drafts, _, p_d, _, rid, anchor = make_case(8, 2, 97, torch.float32, seed=4)
    drafts = drafts.clamp(min=0)
    lens = torch.full((8,), 2, device=DEVICE)
    p_t = torch.cat([p_d, p_d[:, :1]], dim=1) * 0.5
    got = rejection_sample(drafts, lens, p_d, p_t, 1, rid, anchor, backend=backend)
    assert bool((got.num_accepted < 2).any())  # the fallback is exercised
    assert_same(got, reference_rejection_sample(drafts, lens, p_d, p_t, 1, rid, anchor))


@needs_triton
@pytest.mark.parametrize("split", [False, True])
def test_rejection_sample_full_vocabulary(split):
    # The shipped tiles: V = 49152 is 48 one-program tiles, or 48 split chunks of 1024 lanes.
    drafts, lens, p_d, p_t, rid, anchor = make_case(2, 3, 49152, torch.bfloat16, seed=6, agreement=0.5)
    got = fast.rejection_sample(drafts, lens, p_d, p_t, 2, rid, anchor, backend="triton", split=split)
    assert_same(got, reference_rejection_sample(drafts, lens, p_d, p_t, 2, rid, anchor))


@pytest.mark.parametrize("backend", RS_BACKENDS)
def test_rejection_sample_batch_independence(backend):
    case = make_case(6, 4, 97, torch.float32, seed=8)
    drafts, lens, p_d, p_t, rid, anchor = case
    batch = rejection_sample(*case[:4], 3, *case[4:], backend=backend)
    for i in range(6):
        one = rejection_sample(drafts[i:i + 1], lens[i:i + 1], p_d[i:i + 1], p_t[i:i + 1], 3,
                               rid[i:i + 1], anchor[i:i + 1], backend=backend)
        assert torch.equal(one.tokens[0], batch.tokens[i]) and torch.equal(one.num_accepted[0], batch.num_accepted[i])


@needs_triton
def test_rejection_sample_is_lossless():
    # γ = 1, ℓ = 1, the same (p_d, p_t) for 300 requests: the emitted token must follow p_t (accepted draft or
    # residual). Chi-square goodness of fit at significance 1e-3.
    R = 300
    p_d = torch.tensor([0.5, 0.3, 0.1, 0.1])
    p_t = torch.tensor([0.2, 0.3, 0.4, 0.1])
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(p_d, R, replacement=True, generator=gen)[:, None]  # [R, 1]
    out = fast.rejection_sample(drafts.to(DEVICE), torch.ones(R, dtype=torch.int64, device=DEVICE),
                                p_d.expand(R, 1, 4).contiguous().to(DEVICE),
                                p_t.expand(R, 2, 4).contiguous().to(DEVICE), 77,
                                torch.arange(R, device=DEVICE), torch.zeros(R, dtype=torch.int64, device=DEVICE),
                                backend="triton")
    counts = torch.bincount(out.tokens[:, 0].cpu(), minlength=4).double()
    expected = p_t.double() / p_t.double().sum() * R
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def make_onehot_case(R: int, gamma: int, V: int, dtype: torch.dtype, seed: int):
    """A mixed batch with implicit one-hot drafts: ``flags`` [R] marks the rows whose p_d is the one-hot of their own
    drafts (greedy drafts or n-gram proposals), every third row unflagged with its real p_d. Flagged rows of every
    second kind verify against a greedy (one-hot) p_t whose argmax is the draft about half the time; the others
    against a sampled p_t. Row 0 is padding (ℓ = 0, drafts -1, NaN past ℓ), as in :func:`make_case`.

    Returns ``(drafts, lens, explicit, garbage, p_t, rid, anchor, flags)``: ``explicit`` holds the one-hot rows, and
    ``garbage`` the same p_d with NaN and huge values in the flagged rows (which must not be read)."""
    drafts, lens, p_d, p_t, rid, anchor = make_case(R, gamma, V, torch.float32, seed, agreement=0.5)
    gen = torch.Generator().manual_seed(seed)
    flags = torch.arange(R) % 3 != 2  # [R]
    greedy_target = flags & (torch.arange(R) % 2 == 1)  # [R] one-hot p_t as well (a greedy request)
    follow = torch.rand(R, gamma + 1, generator=gen) < 0.5  # [R, γ+1] the target's argmax is the draft
    argmax = torch.randint(0, V, (R, gamma + 1), generator=gen)  # [R, γ+1]
    argmax[:, :gamma] = torch.where(follow[:, :gamma], drafts.cpu().clamp(min=0), argmax[:, :gamma])
    one_hot_t = torch.nn.functional.one_hot(argmax, V).float()  # [R, γ+1, V]
    p_t = torch.where(greedy_target[:, None, None], one_hot_t, p_t.cpu())  # [R, γ+1, V]
    slot = torch.arange(gamma + 1)[None, :]
    p_t[slot > lens.cpu()[:, None]] = float("nan")  # rows past ℓ are never read
    one_hot_d = (torch.arange(V)[None, None, :] == drafts.cpu()[..., None]).float()  # [R, γ, V] (drafts -1: zeros)
    explicit = torch.where(flags[:, None, None], one_hot_d, p_d.cpu())  # [R, γ, V]
    junk = torch.tensor([float("nan"), 1e30, -5.0])[torch.arange(gamma * V) % 3].reshape(gamma, V)  # [γ, V]
    garbage = torch.where(flags[:, None, None], junk, p_d.cpu())  # [R, γ, V]
    to = lambda t: t.to(DEVICE)
    return (drafts, lens, to(explicit.to(dtype)), to(garbage.to(dtype)), to(p_t.to(dtype)), rid, anchor,
            to(flags))


@pytest.mark.parametrize("backend", RS_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,gamma,V", [(1, 1, 97), (6, 4, 97), (9, 7, 130)])
def test_rejection_sample_implicit_onehot(backend, dtype, R, gamma, V):
    """``draft_onehot``: flagged rows take p_d as the one-hot of their drafts and never read ``draft_probs`` (NaN and
    junk there), unflagged rows use theirs; tokens, accepted and emitted counts are identical to the explicit one-hot
    rows' (fast, and the reference's), with greedy and sampled target rows in one batch."""
    for seed in range(2):
        drafts, lens, explicit, garbage, p_t, rid, anchor, flags = make_onehot_case(R, gamma, V, dtype, 17 * R + seed)
        want = reference_rejection_sample(drafts, lens, explicit, p_t, 2**36 + seed, rid, anchor)
        assert_same(rejection_sample(drafts, lens, explicit, p_t, 2**36 + seed, rid, anchor, backend=backend), want)
        got = rejection_sample(drafts, lens, garbage, p_t, 2**36 + seed, rid, anchor, backend=backend,
                               draft_onehot=flags)
        assert_same(got, want)
        if backend == "torch":
            continue
        twin = fast.rejection_sample(drafts, lens, garbage, p_t, 2**36 + seed, rid, anchor, draft_onehot=flags,
                                     backend="torch")  # Triton against the torch twin directly
        for field in ("tokens", "num_accepted", "num_emitted"):
            assert torch.equal(getattr(got, field), getattr(twin, field)), field


@pytest.mark.parametrize("backend", RS_BACKENDS)
def test_rejection_sample_implicit_onehot_exercises_every_branch(backend):
    """A larger mixed batch: flagged rows accept, reject (a residual of p_t minus the implicit one-hot) and draw
    bonuses; a flagged row whose p_t is half its one-hot (unnormalised) takes the residual's rounding fallback. All
    equal to the explicit one-hot rows."""
    R, gamma, V = 40, 4, 97
    drafts, lens, explicit, garbage, p_t, rid, anchor, flags = make_onehot_case(R, gamma, V, torch.float32, 5)
    lens[1:] = torch.randint(1, gamma + 1, (R - 1,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    p_t = p_t.nan_to_num(0.25)  # every row verified now: no NaN left in rows 0..ℓ
    p_t[3] = torch.cat([explicit[3], explicit[3, :1]]) * 0.5  # flagged row 3: accept iff u <= 1/2, else the fallback
    want = reference_rejection_sample(drafts, lens, explicit, p_t, 9, rid, anchor)
    got = rejection_sample(drafts, lens, garbage, p_t, 9, rid, anchor, backend=backend, draft_onehot=flags)
    assert_same(got, want)
    hot = flags & (lens > 0)
    assert bool((hot & (got.num_accepted < lens)).any()) and bool((hot & (got.num_accepted == lens)).any())
    assert bool((hot & (got.num_accepted > 0)).any())
    everything = torch.ones(R, dtype=torch.bool, device=DEVICE)  # a batch of one-hot rows only, p_d never read
    nan = torch.full_like(explicit, float("nan"))
    all_hot = rejection_sample(drafts, lens, nan, p_t, 9, rid, anchor, backend=backend, draft_onehot=everything)
    one_hot_d = (torch.arange(V, device=DEVICE)[None, None, :] == drafts[..., None]).float()  # [R, γ, V]
    assert_same(all_hot, reference_rejection_sample(drafts, lens, one_hot_d, p_t, 9, rid, anchor))


# --------------------------------------------------------------------------- greedy_verify


def make_greedy_case(R: int, gamma: int, V: int, dtype: torch.dtype, seed: int, full_row: bool = False):
    """Integer-valued logits in a small range (many exact ties), drafts that mostly follow the argmax; ``full_row``
    verifies all γ drafts of the last request (so ℓ = γ occurs, and with R > 1 ℓ = 0 too; at R = 1 the one request
    is verified in full instead of padded)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (R, gamma + 1, V), generator=gen).to(dtype)  # [R, γ+1, V]
    argmax = logits.float().argmax(dim=-1)  # [R, γ+1] lowest index on ties
    drafts = argmax[:, :gamma].clone()
    flip = torch.rand(R, gamma, generator=gen) < 0.25
    drafts[flip] = (drafts[flip] + 1) % V
    lens = torch.randint(0, gamma + 1, (R,), generator=gen)
    proposed = drafts[-1].clone()
    lens[0], drafts[0] = 0, -1  # a padded row
    if full_row:
        lens[-1], drafts[-1] = gamma, proposed
    slot = torch.arange(gamma + 1)[None, :]
    logits[slot > lens[:, None]] = float("nan")  # rows past ℓ are never read
    return drafts.to(DEVICE), lens.to(DEVICE), logits.to(DEVICE)


def pack_logits(lens: torch.Tensor, logits: torch.Tensor, seed: int, shuffle: bool = False, pad: int = 5):
    """Blocked ``[R, γ+1, V]`` logits packed as the verify forward writes them: rows 0..ℓ_r of request r from
    ``starts[r]`` on, and ``pad`` NaN rows past the last request (rows past ℓ_r do not exist). ``shuffle`` stores the
    requests in a random order with a NaN row between neighbours, so the starts are neither sorted nor contiguous.

    Returns the packed ``[N, V]`` logits and ``starts`` ``[R]`` int64 (``cu`` ``[R+1]`` when not shuffled)."""
    R, V = logits.shape[0], logits.shape[2]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(R, generator=gen).tolist() if shuffle else list(range(R))
    nan_row = torch.full((1, V), float("nan"), dtype=logits.dtype)
    pieces, starts, n = [], [0] * R, 0
    for r in order:
        starts[r] = n
        pieces.append(logits[r, : int(lens[r]) + 1].cpu())  # [ℓ_r + 1, V]
        n += int(lens[r]) + 1
        if shuffle:
            pieces.append(nan_row)
            n += 1
    pieces.append(nan_row.expand(pad, V))  # padding tokens past cu[R]
    packed = torch.cat(pieces).to(DEVICE)  # [N, V]
    if shuffle:
        return packed, torch.tensor(starts, device=DEVICE)
    return packed, torch.tensor(starts + [n], dtype=torch.int32, device=DEVICE)  # [R+1] as the layout's cu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,gamma,V", SHAPES)
def test_greedy_verify_matches_reference(backend, dtype, R, gamma, V):
    drafts, lens, logits = make_greedy_case(R, gamma, V, dtype, seed=R * gamma + V)
    got = fast.greedy_verify(drafts, lens, logits, backend=backend)
    assert_same(got, ref.greedy_verify(drafts.cpu(), lens.cpu(), logits.cpu()))


@needs_triton
def test_greedy_verify_full_vocabulary():
    drafts, lens, logits = make_greedy_case(2, 2, 49152, torch.bfloat16, seed=1)
    want = ref.greedy_verify(drafts.cpu(), lens.cpu(), logits.cpu())
    assert_same(fast.greedy_verify(drafts, lens, logits, backend="triton"), want)
    packed, cu = pack_logits(lens, logits, seed=1)
    assert_same(fast.greedy_verify(drafts, lens, packed, backend="triton", row_starts=cu), want)


PACKED_SHAPES = [(1, 1, 97), (1, 7, 130), (6, 4, 97), (37, 7, 130)]  # (R, γ, V): R = 1, γ = 1, a 37-request batch


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,gamma,V", PACKED_SHAPES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_greedy_verify_packed_matches_gathered(backend, dtype, R, gamma, V, shuffle):
    """Packed logits with row starts (``cu`` [R+1] int32, or [R] int64 starts in shuffled order with NaN rows
    between requests) give the result of the same rows gathered to [R, γ+1, V], and of the reference; the rows past
    cu[R] (padding tokens) hold NaN, and rows past ℓ_r are absent."""
    drafts, lens, logits = make_greedy_case(R, gamma, V, dtype, seed=7 * R + gamma + V + shuffle, full_row=True)
    want = ref.greedy_verify(drafts.cpu(), lens.cpu(), logits.cpu())
    packed, starts = pack_logits(lens, logits, seed=R + gamma, shuffle=shuffle)
    got = fast.greedy_verify(drafts, lens, packed, backend=backend, row_starts=starts)
    assert_same(got, want)
    assert_same(fast.greedy_verify(drafts, lens, logits, backend=backend), want)  # blocked: the same


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_verify_packed_triton_matches_torch(dtype):
    """The Triton kernel reading packed rows in place against the torch twin's gather, on random lengths (no
    reference in between): 37 requests, every ℓ in 0..γ, integer logits full of ties."""
    gen = torch.Generator().manual_seed(11)
    R, gamma, V = 37, 7, 130
    drafts, _, logits = make_greedy_case(R, gamma, V, dtype, seed=11)
    lens = torch.randint(0, gamma + 1, (R,), generator=gen).to(DEVICE)  # [R]
    lens[:2] = torch.tensor([0, gamma])
    packed, cu = pack_logits(lens, logits.nan_to_num(0.0), seed=11)
    got = fast.greedy_verify(drafts, lens, packed, backend="triton", row_starts=cu)
    want = fast.greedy_verify(drafts, lens, packed, backend="torch", row_starts=cu)
    for field in ("tokens", "num_accepted", "num_emitted"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,gamma,V", [(1, 7, 97), (6, 4, 130)])
def test_greedy_verify_moves_the_anchors(backend, R, gamma, V):
    """``anchors=(anchor, anchor_pos, slots)``: each request's slot gets its last emitted token and moves τ positions
    on, in the verify kernel itself (Triton) or by ``advance_anchors`` (torch), the same result; other slots keep
    theirs, and the verification result is unchanged."""
    drafts, lens, logits = make_greedy_case(R, gamma, V, torch.float32, seed=3 * R + gamma, full_row=True)
    packed, cu = pack_logits(lens, logits, seed=R)
    S = 2 * R + 3
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(R))[:R].to(DEVICE)  # [R] distinct
    anchor = torch.arange(S, dtype=torch.int64, device=DEVICE) + 1000  # [S]
    anchor_pos = torch.arange(S, dtype=torch.int64, device=DEVICE) * 10  # [S]
    want = ref.greedy_verify(drafts.cpu(), lens.cpu(), logits.cpu())
    want_anchor, want_pos = anchor.clone(), anchor_pos.clone()
    for r in range(R):
        tau = int(want.num_emitted[r])
        want_anchor[slots[r]] = int(want.tokens[r, tau - 1])
        want_pos[slots[r]] += tau
    got = fast.greedy_verify(drafts, lens, packed, backend=backend, row_starts=cu, anchors=(anchor, anchor_pos, slots))
    assert_same(got, want)
    assert torch.equal(anchor, want_anchor) and torch.equal(anchor_pos, want_pos)


@needs_triton
@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the NaN rows nobody reads
def test_greedy_verify_ties_across_chunks_and_rows_after_a_mismatch():
    """The argmax is split over vocabulary chunks: a maximum repeated in later chunks (and within one) resolves to
    its lowest index, as one argmax over the whole row; the rows after the first mismatch are read by no decision
    (here they hold NaN) and rows past ℓ not at all."""
    from optimized.kernels.verify import GREEDY_CHUNK

    R, gamma, V = 3, 4, 3 * GREEDY_CHUNK + 5
    logits = torch.full((R, gamma + 1, V), -1.0)
    for r in range(R):
        for j in range(gamma + 1):
            lanes = [GREEDY_CHUNK + 7 + r + j, 2 * GREEDY_CHUNK + 1, 2 * GREEDY_CHUNK + 3, V - 1]
            logits[r, j, lanes] = 2.5  # ties in three chunks: the lowest lane wins
    argmax = logits.argmax(dim=-1)
    drafts = argmax[:, :gamma].clone()
    drafts[1, 1] += 1  # request 1 stops at slot 2: its rows 2..4 decide nothing
    lens = torch.tensor([4, 4, 2])
    clean = logits.to(torch.bfloat16)  # the reference refuses NaN in rows 0..ℓ
    logits[1, 2:] = float("nan")
    logits[2, 3:] = float("nan")  # past ℓ
    got = fast.greedy_verify(drafts.to(DEVICE), lens.to(DEVICE), logits.to(torch.bfloat16).to(DEVICE),
                             backend="triton")
    want = ref.greedy_verify(drafts, lens, clean)
    assert_same(got, want)
    assert got.num_accepted.tolist() == [4, 1, 2]
    assert got.tokens[1, :2].tolist() == [drafts[1, 0].item(), argmax[1, 1].item()]
    packed, cu = pack_logits(lens, logits.to(torch.bfloat16), seed=0)  # the same rows, read in place
    assert_same(fast.greedy_verify(drafts.to(DEVICE), lens.to(DEVICE), packed, backend="triton", row_starts=cu), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    drafts = torch.zeros(0, 3, dtype=torch.int64, device=DEVICE)
    lens = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = fast.greedy_verify(drafts, lens, torch.zeros(0, 4, 10, device=DEVICE), backend=backend)
    assert out.tokens.shape == (0, 4) and out.num_emitted.shape == (0,)
    cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = fast.greedy_verify(drafts, lens, torch.zeros(0, 10, device=DEVICE), backend=backend, row_starts=cu)
    assert out.tokens.shape == (0, 4) and out.num_emitted.shape == (0,)
    p_d, p_t = torch.zeros(0, 3, 10, device=DEVICE), torch.zeros(0, 4, 10, device=DEVICE)
    out = fast.rejection_sample(drafts, lens, p_d, p_t, 0, lens, lens, backend=backend)
    assert out.tokens.shape == (0, 4) and out.num_accepted.shape == (0,)


def test_bad_inputs_fail_fast():
    drafts, lens = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_tokens"):
        fast.greedy_verify(drafts.int(), lens, torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="verify_lens"):
        fast.greedy_verify(drafts, lens[:1], torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="target_logits"):
        fast.greedy_verify(drafts, lens, torch.zeros(2, 3, 5))
    packed, cu = torch.zeros(9, 5), torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="row_starts must be"):
        fast.greedy_verify(drafts, lens, packed, row_starts=cu[:1])  # neither [R] nor [R+1]
    with pytest.raises(ValueError, match="row_starts must be int32 or int64"):
        fast.greedy_verify(drafts, lens, packed, row_starts=cu.float())
    with pytest.raises(ValueError, match="packed"):
        fast.greedy_verify(drafts, lens, torch.zeros(2, 4, 5), row_starts=cu)  # blocked logits with row starts
    with pytest.raises(ValueError, match="packed"):
        fast.greedy_verify(drafts, lens, torch.zeros(0, 5), row_starts=cu)  # no rows to read
    with pytest.raises(ValueError, match="float"):
        fast.greedy_verify(drafts, lens, packed.long(), row_starts=cu)
    with pytest.raises(ValueError, match="target_probs"):
        fast.rejection_sample(drafts, lens, torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), 0, lens, lens)
    with pytest.raises(ValueError, match="draft_onehot"):
        fast.rejection_sample(drafts, lens, torch.zeros(2, 3, 5), torch.zeros(2, 4, 5), 0, lens, lens,
                              draft_onehot=lens)  # int64, not bool
