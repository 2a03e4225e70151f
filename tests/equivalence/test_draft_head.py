"""Equivalence of ``optimized.kernels.draft_head`` (fused Markov-head sampling) with ``DSparkDrafter.sample_block``.

Tokens are integers: identical (torch.equal). ``p_d`` and the confidence logits are floats:

* fp32 drafter: the kernel only reorders fp32 sums (the W2·e product, the online softmax), a few ulps of
  O(1) values, so ``p_d`` within 2e-6 absolute and ``z_k`` within 1e-5 absolute.
* bf16/fp16 *inputs* (target logits, hidden states) are upcast exactly, so the same fp32 tolerances hold.
* a bf16 drafter: both sides round ``B_k`` and ``z_k`` to bf16, but an fp32 sum in another order can land one
  bf16 ulp (≤ 2^-7 relative) away, so ``p_d`` within 1e-2 absolute on O(1) logits, and ``z_k`` within two bf16
  ulps (2^-6 relative): CPU bf16 ``addmm`` may round the product and the bias sum separately, the kernel once.

The Triton cases run through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by the CI command)
and skip without it. Every Triton variant is checked: one program per request (``"triton"``), the
split-vocabulary kernels (``"triton-split"``) and the split kernels whose logits launch takes 16 requests per program
(``"triton-split-rows"``, ``B_k`` by ``tl.dot``), the split ones with a shrunken tile so that even small vocabularies
span several blocks and end in a partial one (the cross-block reductions are what they add: per slot, the per-row
launches that combine the blocks' softmax statistics and greedy argmax, and the blocks' race partials). Their softmax
sums (and the rows kernel's ``B_k``) are combined in another order, an ulp-level change inside the same tolerances.

``probs_rows`` (the engine's per-slot output) only moves where ``p_d`` is stored: every backend must give the block
of the same call without it bit for bit (``torch.equal``), and leave the buffer's other rows as they were.
``store_greedy=False`` only drops the greedy rows' (one-hot) stores: the rest stays bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels import draft_head as fast
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
BACKENDS = [pytest.param("triton", marks=needs_triton), pytest.param("triton-split", marks=needs_triton),
            pytest.param("triton-split-rows", marks=needs_triton), "torch"]
PROB_ATOL_FP32 = 2e-6
CONF_ATOL_FP32 = 1e-5
SMALL_SPLIT_TILE = 128  # SPLIT_TILE_ELEMENTS in tests: BLOCK_V = 16 lanes for r <= 8, several blocks for V = 97
SENTINEL = float("nan")  # fills probs_out before a probs_rows call: a row read before its write would turn p_d NaN


@pytest.fixture
def variant(backend, monkeypatch):
    """``backend`` param -> ``dict(backend=..., split=...)`` keywords; the split variant gets small blocks."""
    if backend == "triton-split":
        monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", SMALL_SPLIT_TILE)
        return {"backend": "triton", "split": True, "split_rows": 1}
    if backend == "triton-split-rows":  # 16 requests per program share each W2 block (tl.dot)
        monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", SMALL_SPLIT_TILE)
        return {"backend": "triton", "split": True, "split_rows": 16}
    return {"backend": backend, "split": False if backend == "triton" else None}


def make_drafter(V: int, gamma: int, rank: int, d: int = 32, head: str = "markov", seed: int = 0,
                 lm_dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """A tiny drafter with a random (non-zero) W2 and an attached random target embedding / LM head."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(vocab_size=V, hidden_size=d, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        intermediate_size=64, target_num_layers=4, block_size=gamma, markov_rank=rank, head=head)
    drafter = DSparkDrafter(cfg)
    with torch.no_grad():
        if drafter.seq_head is not None:
            drafter.seq_head.w2.weight.normal_(0, 0.5)  # W2 starts at zero; make the Markov bias matter
        drafter.conf_head.weight.normal_(0, 0.2)
        drafter.conf_head.bias.fill_(0.3)
    lm_head = torch.nn.Linear(d, V, bias=False)
    torch.nn.init.normal_(lm_head.weight, std=0.3)
    drafter.attach_target(torch.nn.Embedding(V, d), lm_head.to(lm_dtype))
    return drafter


def on_device(drafter: DSparkDrafter) -> DSparkDrafter:
    """Move the drafter *and* its attached (not owned) target modules to DEVICE, in place."""
    for module in drafter.target_modules():
        module.to(DEVICE)
    return drafter.to(DEVICE)


def make_inputs(R: int, gamma: int, V: int, d: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(R, gamma, d, generator=gen)  # [R, γ, d]
    anchor_ids = torch.randint(0, V, (R,), generator=gen)
    anchor_pos = torch.randint(0, 2**31, (R,), generator=gen)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.5, 0.0, 0.3])[torch.arange(R) % 6]  # greedy and sampled rows
    request_ids = torch.randint(0, 2**31, (R,), generator=gen)
    return h, anchor_ids, anchor_pos, temperature, request_ids


def to_device(*ts):
    return [t.to(DEVICE) for t in ts]


def assert_close_fp32(got, want):
    assert torch.equal(got.tokens.cpu(), want.tokens)
    torch.testing.assert_close(got.probs.cpu(), want.probs, atol=PROB_ATOL_FP32, rtol=0)
    torch.testing.assert_close(got.conf_logits.cpu(), want.conf_logits, atol=CONF_ATOL_FP32, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,gamma,V,rank", [(1, 1, 97, 8), (5, 4, 97, 5), (3, 7, 130, 16)])
def test_sample_block_matches_reference(backend, variant, R, gamma, V, rank):
    drafter = make_drafter(V, gamma, rank, seed=R + gamma)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=V + rank)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 2**33 + 1, request_ids)
    got = fast.sample_block(on_device(drafter), *to_device(h, anchor_ids, anchor_pos, temperature), 2**33 + 1,
                            request_ids.to(DEVICE), **variant)
    assert got.probs.dtype == torch.float32 and got.tokens.dtype == torch.int64
    assert_close_fp32(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probs_out_receives_the_same_block(backend, variant):
    """``probs_out`` (the engine's one static output buffer of every draft graph): the distributions are written
    into the caller's rows, the block is the one returned without it, and the rows past R are untouched."""
    R, gamma, V, rank = 3, 4, 97, 5
    drafter = on_device(make_drafter(V, gamma, rank, seed=1))
    h, anchor_ids, anchor_pos, temperature, request_ids = to_device(*make_inputs(R, gamma, V, seed=2))
    want = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 5, request_ids, **variant)
    buffer = torch.full((R + 2, gamma, V), -1.0, device=DEVICE)
    got = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 5, request_ids, **variant,
                            probs_out=buffer[:R])
    assert got.probs.data_ptr() == buffer.data_ptr()
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.conf_logits, want.conf_logits)
    assert torch.equal(buffer[:R], want.probs) and bool((buffer[R:] == -1.0).all())
    with pytest.raises(ValueError, match="probs_out"):
        fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 5, request_ids, **variant,
                          probs_out=buffer[:R, :, :-1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,gamma,V,rank,slots", [(1, 3, 211, 8, 4), (3, 7, 300, 16, 8), (5, 4, 257, 12, 11)])
def test_probs_rows_write_the_slots(backend, variant, R, gamma, V, rank, slots):
    """``probs_rows`` = distinct random slots of a larger buffer (S > R) in random order: slot ``probs_rows[i]`` holds
    request i's block exactly as the same call returns it without ``probs_rows``, the other slots keep the sentinel,
    and tokens and confidence logits do not change. Greedy and sampled rows mixed (make_inputs) for R > 1."""
    drafter = on_device(make_drafter(V, gamma, rank, seed=R + V))
    h, anchor_ids, anchor_pos, temperature, request_ids = to_device(*make_inputs(R, gamma, V, seed=rank))
    want = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 2**35 + 7, request_ids, **variant)
    rows = torch.randperm(slots, generator=torch.Generator().manual_seed(R * V))[:R]  # [R]
    buffer = torch.full((slots, gamma, V), SENTINEL, device=DEVICE)  # [S, γ, V]
    got = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 2**35 + 7, request_ids, **variant,
                            probs_out=buffer, probs_rows=rows.to(DEVICE))
    assert got.probs is buffer
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.conf_logits, want.conf_logits)
    assert torch.equal(buffer[rows.to(DEVICE)], want.probs)
    named = torch.zeros(slots, dtype=torch.bool)
    named[rows] = True
    assert bool(buffer[~named.to(DEVICE)].isnan().all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_probs_rows_padding_writes_nothing(backend, variant):
    """Negative entries (a CUDA-graph bucket's padding, int32 like the engine's slot ids): such a request writes no
    slot, and its tokens and confidence logits are 0; the live requests are unaffected. Requests 1 and 3 are padding,
    one greedy and one sampled (T = 0 and 1.5); request 2 writes slot 0. Then a batch of padding only."""
    R, gamma, V, rank, slots = 5, 3, 211, 8, 7
    drafter = on_device(make_drafter(V, gamma, rank, seed=3))
    h, anchor_ids, anchor_pos, temperature, request_ids = to_device(*make_inputs(R, gamma, V, seed=6))
    want = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 13, request_ids, **variant)
    rows = torch.tensor([4, -1, 0, -1, 2], dtype=torch.int32, device=DEVICE)  # [R]
    live = rows >= 0  # [R]
    buffer = torch.full((slots, gamma, V), SENTINEL, device=DEVICE)  # [S, γ, V]
    got = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 13, request_ids, **variant,
                            probs_out=buffer, probs_rows=rows)
    assert torch.equal(buffer[rows[live].long()], want.probs[live])
    assert bool(buffer[[1, 3, 5, 6]].isnan().all())
    assert torch.equal(got.tokens[live], want.tokens[live]) and not got.tokens[~live].any()
    assert torch.equal(got.conf_logits[live], want.conf_logits[live]) and not got.conf_logits[~live].any()

    buffer.fill_(SENTINEL)
    got = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 13, request_ids, **variant,
                            probs_out=buffer, probs_rows=torch.full_like(rows, -1))
    assert bool(buffer.isnan().all()) and not got.tokens.any() and not got.conf_logits.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [None, [5, 2, -1, 0, 7], [3, 0, 6, -1, 8]])
def test_store_greedy_false_writes_no_greedy_rows(backend, variant, rows):
    """``store_greedy=False``: greedy rows (requests 1 and 4, T = 0) write nothing, so their rows of the buffer keep
    the sentinel; the sampled rows' p_d, every token and every confidence logit are the bits of the default call,
    whose greedy rows are the one-hot of their own tokens (the implicit p_d the verifier assumes). Without probs_rows,
    and with slots that include padding (request 2 or 3) and slot 0 owned by a sampled or by a greedy request."""
    R, gamma, V, rank, slots = 5, 3, 211, 8, 9
    drafter = on_device(make_drafter(V, gamma, rank, seed=7))
    h, anchor_ids, anchor_pos, temperature, request_ids = to_device(*make_inputs(R, gamma, V, seed=8))
    greedy = temperature == 0  # [R]
    assert greedy.tolist() == [False, True, False, False, True]
    want = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 2**34 + 5, request_ids, **variant)
    one_hot = (torch.arange(V, device=DEVICE)[None, None, :] == want.tokens[..., None]).float()  # [R, γ, V]
    assert torch.equal(want.probs[greedy], one_hot[greedy])
    if rows is None:
        dest, buffer = torch.arange(R, device=DEVICE), torch.full((R, gamma, V), SENTINEL, device=DEVICE)
    else:
        dest, buffer = torch.tensor(rows, device=DEVICE), torch.full((slots, gamma, V), SENTINEL, device=DEVICE)
    got = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 2**34 + 5, request_ids, **variant,
                            probs_out=buffer, probs_rows=None if rows is None else dest.to(torch.int32),
                            store_greedy=False)
    live = dest >= 0  # [R]
    assert torch.equal(got.tokens[live], want.tokens[live]) and not got.tokens[~live].any()
    assert torch.equal(got.conf_logits[live], want.conf_logits[live]) and not got.conf_logits[~live].any()
    stored = live & ~greedy  # [R] the sampled live requests
    assert torch.equal(buffer[dest[stored]], want.probs[stored])
    written = torch.zeros(buffer.shape[0], dtype=torch.bool, device=DEVICE)
    written[dest[stored]] = True
    assert bool(buffer[~written].isnan().all())  # greedy requests' slots, padding, slots no request names


def test_probs_rows_needs_a_buffer():
    R, gamma, V, d, r = 2, 3, 11, 4, 5
    base, h = torch.zeros(R, gamma, V), torch.zeros(R, gamma, d)
    ids, temp = torch.zeros(R, dtype=torch.int64), torch.ones(R)
    weights = torch.zeros(V, r), torch.zeros(V, r), torch.zeros(d + r), torch.zeros(1)
    with pytest.raises(ValueError, match="probs_rows needs probs_out"):
        fast.sample_draft_block(base, h, ids, ids, temp, 0, ids, *weights, probs_rows=ids)
    with pytest.raises(ValueError, match="probs_rows must be"):
        fast.sample_draft_block(base, h, ids, ids, temp, 0, ids, *weights, probs_out=torch.zeros(4, gamma, V),
                                probs_rows=ids.float())
    with pytest.raises(ValueError, match="probs_out must be"):  # S rows are fine, another block shape is not
        fast.sample_draft_block(base, h, ids, ids, temp, 0, ids, *weights, probs_out=torch.zeros(4, gamma + 1, V),
                                probs_rows=ids)
    with pytest.raises(ValueError, match="Markov head"):
        fast.sample_block(make_drafter(V, gamma, r, head="rnn"), h, ids, ids, temp, 0, ids,
                          probs_out=torch.zeros(4, gamma, V), probs_rows=ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(backend, variant, dtype):
    # A half-precision target: U = lm_head(h) arrives in `dtype`, and so do the hidden states. The reference sees
    # the same values upcast (its LM head runs in `dtype`; h is chosen exactly representable).
    R, gamma, V = 4, 3, 97
    drafter = make_drafter(V, gamma, 8, lm_dtype=dtype)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=1)
    h = h.to(dtype).float()
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 7, request_ids)
    lm_head = drafter.target_modules()[1]
    base = lm_head(h.to(dtype))  # [R, γ, V] in dtype
    head = drafter.seq_head
    got = fast.sample_draft_block(*to_device(base, h.to(dtype), anchor_ids, anchor_pos, temperature), 7,
                                  request_ids.to(DEVICE), *to_device(head.w1.weight, head.w2.weight,
                                                                     drafter.conf_head.weight, drafter.conf_head.bias),
                                  **variant)
    assert_close_fp32(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_drafter(backend, variant):
    R, gamma, V = 4, 3, 97
    drafter = make_drafter(V, gamma, 8, lm_dtype=torch.bfloat16).to(torch.bfloat16)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=2)
    h = h.to(torch.bfloat16)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 9, request_ids)
    got = fast.sample_block(on_device(drafter), *to_device(h, anchor_ids, anchor_pos, temperature), 9,
                            request_ids.to(DEVICE), **variant)
    assert torch.equal(got.tokens.cpu(), want.tokens)
    torch.testing.assert_close(got.probs.cpu(), want.probs, atol=1e-2, rtol=0)
    torch.testing.assert_close(got.conf_logits.cpu(), want.conf_logits, atol=0, rtol=2.0**-6)


@needs_triton
@pytest.mark.parametrize("split", [False, True])
def test_full_vocabulary(split):
    # The shipped tiles: V = 49152 is 48 one-program tiles, or NB = 48 split blocks of 1024 lanes at r = 8.
    drafter = make_drafter(49152, 2, 8)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(2, 2, 49152, seed=3)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 3, request_ids)
    got = fast.sample_block(on_device(drafter), *to_device(h, anchor_ids, anchor_pos, temperature), 3,
                            request_ids.to(DEVICE), backend="triton", split=split)
    assert_close_fp32(got, want)


@needs_triton
@pytest.mark.parametrize("R,rank,V,tile", [(1, 64, 203, SMALL_SPLIT_TILE), (4, 3, 203, SMALL_SPLIT_TILE),
                                           (7, 64, 203, SMALL_SPLIT_TILE), (6, 64, 600, None)])
def test_split_matches_reference(monkeypatch, R, rank, V, tile):
    # Greedy and sampled rows mixed (R > 1), r from 3 to 64, V not a multiple of BLOCK_V: 13 blocks of 16 lanes
    # (the last holds 11), or with the shipped tile (None) 3 blocks of 256 lanes at r = 64 (the last holds 88).
    if tile is not None:
        monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", tile)
    gamma = 5
    drafter = make_drafter(V, gamma, rank, seed=R + rank)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=R * rank)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 2**40 + 3, request_ids)
    got = fast.sample_block(on_device(drafter), *to_device(h, anchor_ids, anchor_pos, temperature), 2**40 + 3,
                            request_ids.to(DEVICE), backend="triton", split=True)
    assert_close_fp32(got, want)


@needs_triton
@pytest.mark.parametrize("split_rows", [1, 16])
def test_triton_variants_agree(monkeypatch, split_rows):
    # Masked vocabulary (-inf U_k: a whole 16-lane block in row 0, scattered lanes in row 3) and greedy rows whose
    # maximum is tied across blocks (W2 = 0 keeps U_k's ties): both variants and the torch twin pick the same tokens.
    monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", SMALL_SPLIT_TILE)
    R, gamma, V, d, r = 5, 3, 150, 32, 8
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(R, gamma, V, generator=gen) * 2  # [R, γ, V]
    base[0, :, 32:48] = -float("inf")
    base[3, :, ::7] = -float("inf")
    base[1, :, [21, 70, 149]] = 50.0  # row 1 is greedy: ties across blocks 1, 4 and 9 go to lane 21
    base[4, :, [100, 60]] = 50.0  # row 4 is greedy: lane 60
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, d=d, seed=12)
    w1 = torch.randn(V, r, generator=gen)
    conf_w, conf_b = torch.randn(d + r, generator=gen), torch.tensor([0.1])
    for w2 in (torch.randn(V, r, generator=gen), torch.zeros(V, r)):
        args = to_device(base, h, anchor_ids, anchor_pos, temperature)
        rest = to_device(request_ids, w1, w2, conf_w, conf_b)
        outs = [fast.sample_draft_block(*args, 5, *rest, backend="triton", split=split, split_rows=split_rows)
                for split in (False, True)]
        want = fast.sample_draft_block(base, h, anchor_ids, anchor_pos, temperature, 5, request_ids, w1, w2, conf_w,
                                       conf_b, backend="torch")
        one, split = outs
        assert torch.equal(one.tokens, split.tokens)
        assert_close_fp32(split, want)
        torch.testing.assert_close(split.probs, one.probs, atol=PROB_ATOL_FP32, rtol=0)
        torch.testing.assert_close(split.conf_logits, one.conf_logits, atol=CONF_ATOL_FP32, rtol=0)
        assert (split.probs[0, :, 32:48] == 0).all() and (split.probs[3, :, ::7] == 0).all()
        if not w2.any():
            assert (split.tokens[1] == 21).all() and (split.tokens[4] == 60).all()


@needs_triton
@pytest.mark.parametrize("split_rows", [1, 16])
@pytest.mark.parametrize("R,mode", [(1, "mixed"), (3, "mixed"), (17, "greedy"), (17, "sampled"), (17, "mixed"),
                                    (33, "mixed")])
def test_split_reductions_match_one_program(monkeypatch, split_rows, R, mode):
    """The split launches of each slot (logits, per-row statistics, race, per-row race winner) against the
    one-program kernel and the torch twin: the same tokens, ``p_d`` and ``z_k`` within the fp32 tolerances. One and
    16 requests per logits program, batches that end in a partial 16-row program (17, 33), greedy, sampled and mixed
    rows. Requests 1, 5, 9, ... tie their maximum across vocabulary blocks 1 and 2 (U_k = 50 and a zero W2 row at
    lanes 21 and 37, so every ``prev`` keeps the tie): a greedy one takes lane 21. Then the same call with
    ``probs_rows`` (every third request from the second on is padding) and both ``store_greedy``: the same tokens and
    ``z_k`` bit for bit (zeros for padding), the same ``p_d`` bits in the named slots, nothing anywhere else."""
    monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", SMALL_SPLIT_TILE)  # BLOCK_V = 16: NB = 3, the last 8 lanes
    gamma, V, d, r = 2, 40, 32, 8
    gen = torch.Generator().manual_seed(10 * R + split_rows)
    base = torch.randn(R, gamma, V, generator=gen) * 2  # [R, γ, V]
    base[1::4, :, 21] = base[1::4, :, 37] = 50.0
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, d=d, seed=R)
    if mode != "mixed":
        temperature = torch.full((R,), 0.0 if mode == "greedy" else 0.8)
    w1, w2 = torch.randn(V, r, generator=gen), torch.randn(V, r, generator=gen)
    w2[[21, 37]] = 0.0
    conf_w, conf_b = torch.randn(d + r, generator=gen), torch.tensor([0.1])
    args, rest = to_device(base, h, anchor_ids, anchor_pos, temperature), to_device(request_ids, w1, w2, conf_w, conf_b)
    want = fast.sample_draft_block(base, h, anchor_ids, anchor_pos, temperature, 3, request_ids, w1, w2, conf_w,
                                   conf_b, backend="torch")
    one = fast.sample_draft_block(*args, 3, *rest, backend="triton", split=False)
    split = dict(backend="triton", split=True, split_rows=split_rows)
    got = fast.sample_draft_block(*args, 3, *rest, **split)
    assert torch.equal(got.tokens, one.tokens)
    assert_close_fp32(got, want)
    torch.testing.assert_close(got.probs, one.probs, atol=PROB_ATOL_FP32, rtol=0)
    torch.testing.assert_close(got.conf_logits, one.conf_logits, atol=CONF_ATOL_FP32, rtol=0)
    greedy = temperature.to(DEVICE) == 0  # [R]
    tied = torch.zeros(R, dtype=torch.bool, device=DEVICE)  # [R]
    tied[1::4] = True
    assert (got.tokens[greedy & tied] == 21).all()

    dest = torch.randperm(R + 2, generator=gen)[:R].to(DEVICE)  # [R] slots of an [R + 2, γ, V] buffer
    dest[1::3] = -1
    live = dest >= 0  # [R]
    for store_greedy in (True, False):
        buffer = torch.full((R + 2, gamma, V), SENTINEL, device=DEVICE)  # [S, γ, V]
        again = fast.sample_draft_block(*args, 3, *rest, **split, probs_out=buffer, probs_rows=dest.to(torch.int32),
                                        store_greedy=store_greedy)
        assert torch.equal(again.tokens[live], got.tokens[live]) and not again.tokens[~live].any()
        assert torch.equal(again.conf_logits[live], got.conf_logits[live]) and not again.conf_logits[~live].any()
        stored = live if store_greedy else live & ~greedy  # [R]
        assert torch.equal(buffer[dest[stored]], got.probs[stored])
        written = torch.zeros(R + 2, dtype=torch.bool, device=DEVICE)  # [S]
        written[dest[stored]] = True
        assert bool(buffer[~written].isnan().all())


@needs_triton
@pytest.mark.parametrize("split_rows,R", [(1, 3), (16, 17)])
def test_fused_reductions_same_bits(monkeypatch, split_rows, R):
    """The split variant with its per-row reductions fused into the logits and race launches (the last program of a
    row, or of a group of 16 rows, reduces; 2γ launches instead of 4γ) against the separate reduction launches:
    the same tokens, ``p_d`` and ``z_k`` bit for bit over greedy and sampled rows — with and without ``probs_rows``
    (padding rows: zeros) and ``store_greedy``, with a draft vocabulary — and a second fused call gives the same bits
    (the arrival counters are back at zero after every launch)."""
    monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", SMALL_SPLIT_TILE)  # NB = 3 blocks (V = 40), 7 with V = 97
    gamma, V, d, r = 3, 40, 32, 8
    gen = torch.Generator().manual_seed(R + split_rows)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, d=d, seed=R)  # mixed T
    base = torch.randn(R, gamma, V, generator=gen) * 2
    w1, w2 = torch.randn(V, r, generator=gen), torch.randn(V, r, generator=gen)
    conf_w, conf_b = torch.randn(d + r, generator=gen), torch.tensor([-0.2])
    args, rest = to_device(base, h, anchor_ids, anchor_pos, temperature), to_device(request_ids, w1, w2, conf_w, conf_b)
    split = dict(backend="triton", split=True, split_rows=split_rows)
    dest = torch.randperm(R + 2, generator=gen)[:R].to(DEVICE)  # [R] slots of an [R + 2, γ, V] buffer
    dest[1::3] = -1
    for extra, calls in (({}, (False, True, True)), ({"probs_rows": dest.to(torch.int32), "store_greedy": False},
                                                      (False, True))):
        outs = []
        for fused in calls:
            kw = dict(extra)
            if "probs_rows" in kw:
                kw["probs_out"] = torch.full((R + 2, gamma, V), SENTINEL, device=DEVICE)
            out = fast.sample_draft_block(*args, 7, *rest, **split, **kw, fused_reductions=fused)
            outs.append((out.tokens.clone(), out.probs.clone(), out.conf_logits.clone()))
        for got in outs[1:]:
            for a, b in zip(outs[0], got):
                assert torch.equal(a.nan_to_num(nan=-7.0), b.nan_to_num(nan=-7.0))
    if split_rows == 1:  # a draft vocabulary: lanes map to token ids
        drafter, vocab = restricted_drafter(97, gamma, r, 60, seed=R)
        inputs = to_device(h, anchor_ids, anchor_pos, temperature)
        plain, fused = (fast.sample_block(on_device(drafter), *inputs, 5, request_ids.to(DEVICE), **split,
                                          fused_reductions=f) for f in (False, True))
        assert torch.equal(plain.tokens, fused.tokens) and torch.equal(plain.probs, fused.probs)
        assert torch.equal(plain.conf_logits, fused.conf_logits)


@needs_triton
@pytest.mark.parametrize("rows", [16, 32])
def test_split_rows_over_several_row_blocks(monkeypatch, rows):
    """The rows kernel with more requests than one program holds (37: full blocks and a partial one), a rank that
    is no power of two (padded to the tl.dot minimum), greedy and sampled rows: the reference's tokens."""
    monkeypatch.setattr(fast, "SPLIT_TILE_ELEMENTS", SMALL_SPLIT_TILE)
    R, gamma, V, rank = 37, 3, 300, 20
    drafter = make_drafter(V, gamma, rank, seed=4)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=5)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 11, request_ids)
    got = fast.sample_block(on_device(drafter), *to_device(h, anchor_ids, anchor_pos, temperature), 11,
                            request_ids.to(DEVICE), backend="triton", split=True, split_rows=rows)
    assert_close_fp32(got, want)
    with pytest.raises(ValueError, match="split_rows"):
        fast.sample_block(drafter, *to_device(h, anchor_ids, anchor_pos, temperature), 11, request_ids.to(DEVICE),
                          backend="triton", split=True, split_rows=8)


def test_auto_variant_follows_batch_size(monkeypatch):
    launches = []
    monkeypatch.setattr(fast, "_launch_split", lambda *a, **kw: launches.append(a[0].tokens.shape[0]))
    R, gamma, V, r = 3, 2, 40, 4
    base, h = torch.zeros(R, gamma, V, device=DEVICE), torch.zeros(R, gamma, 8, device=DEVICE)
    ids, temp = torch.zeros(R, dtype=torch.int64, device=DEVICE), torch.zeros(R, device=DEVICE)
    weights = to_device(torch.zeros(V, r), torch.zeros(V, r), torch.zeros(8 + r), torch.zeros(1))
    for split, max_r in [(None, R + 1), (None, R), (True, 1), (False, 100)]:
        monkeypatch.setattr(fast, "SPLIT_MAX_R", max_r)
        fast.sample_draft_block(base, h, ids, ids, temp, 0, ids, *weights, backend="triton", split=split)
    # Auto splits on CUDA below SPLIT_MAX_R (never in the interpreter, where it only adds launches); True forces it.
    assert launches == ([R, R] if DEVICE == "cuda" else [R])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_independence(backend, variant):
    drafter = on_device(make_drafter(97, 4, 8))
    inputs = to_device(*make_inputs(5, 4, 97, seed=4))
    batch = fast.sample_block(drafter, *inputs[:4], 1, inputs[4], **variant)
    for i in range(5):
        one = fast.sample_block(drafter, *[t[i:i + 1] for t in inputs[:4]], 1, inputs[4][i:i + 1], **variant)
        assert torch.equal(one.tokens[0], batch.tokens[i])
        torch.testing.assert_close(one.probs[0], batch.probs[i], atol=PROB_ATOL_FP32, rtol=0)


@pytest.mark.parametrize("head", ["rnn", "none"])
def test_other_heads_fall_back_to_reference(head):
    drafter = make_drafter(97, 3, 8, head=head)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(3, 3, 97, seed=5)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 4, request_ids)
    got = fast.sample_block(drafter, h, anchor_ids, anchor_pos, temperature, 4, request_ids)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.probs, want.probs)


def test_bad_inputs_fail_fast():
    R, gamma, V, d, r = 2, 3, 11, 4, 5
    base, h = torch.zeros(R, gamma, V), torch.zeros(R, gamma, d)
    ids, temp = torch.zeros(R, dtype=torch.int64), torch.ones(R)
    w1, w2, cw, cb = torch.zeros(V, r), torch.zeros(V, r), torch.zeros(d + r), torch.zeros(1)
    with pytest.raises(ValueError, match="w1 and w2"):
        fast.sample_draft_block(base, h, ids, ids, temp, 0, ids, w1, torch.zeros(r, V), cw, cb)
    with pytest.raises(ValueError, match="conf_w"):
        fast.sample_draft_block(base, h, ids, ids, temp, 0, ids, w1, w2, torch.zeros(d), cb)
    with pytest.raises(ValueError, match="temperature"):
        fast.sample_draft_block(base, h, ids, ids, torch.ones(R + 1), 0, ids, w1, w2, cw, cb)
    with pytest.raises(ValueError, match="h"):
        fast.sample_draft_block(base, h[:, :2], ids, ids, temp, 0, ids, w1, w2, cw, cb)


# --- a draft vocabulary (DrafterConfig.draft_vocab_size): drafts from a subset of the tokens -------------------------


def restricted_drafter(V: int, gamma: int, rank: int, keep: int, seed: int) -> tuple[DSparkDrafter, torch.Tensor]:
    """A tiny drafter proposing only ``keep`` random token ids (sorted), and those ids."""
    full = make_drafter(V, gamma, rank, seed=seed)
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:keep].sort().values
    return full.restrict_vocab(vocab), vocab


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("R,gamma,V,rank,keep", [(1, 3, 97, 8, 40), (6, 4, 203, 5, 61), (17, 2, 130, 16, 129)])
def test_draft_vocab_matches_reference(backend, variant, R, gamma, V, rank, keep):
    """Every variant draws the reference's tokens and ``p_d`` with a draft vocabulary: tokens from the subset only
    (anchors outside it included: W1 is indexed by token id), ``p_d`` zero outside it and a distribution over it;
    written into an engine-style zero buffer through ``probs_rows``, the same block lands in the named slots."""
    drafter, vocab = restricted_drafter(V, gamma, rank, keep, seed=R + keep)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=V + R)
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 2**36 + 11, request_ids)
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    assert bool(torch.isin(want.tokens, vocab).all()) and not want.probs[..., outside].any()
    torch.testing.assert_close(want.probs.sum(-1), torch.ones(R, gamma))
    got = fast.sample_block(on_device(drafter), *to_device(h, anchor_ids, anchor_pos, temperature), 2**36 + 11,
                            request_ids.to(DEVICE), **variant)
    assert_close_fp32(got, want)
    slots = torch.randperm(R + 3, generator=torch.Generator().manual_seed(R))[:R].to(DEVICE)  # [R]
    buffer = torch.zeros(R + 3, gamma, V, device=DEVICE)  # the engine's per-slot p_d: zero where never written
    got = fast.sample_block(drafter, *to_device(h, anchor_ids, anchor_pos, temperature), 2**36 + 11,
                            request_ids.to(DEVICE), **variant, probs_out=buffer, probs_rows=slots)
    assert torch.equal(got.tokens.cpu(), want.tokens)
    torch.testing.assert_close(buffer[slots].cpu(), want.probs, atol=PROB_ATOL_FP32, rtol=0)


def test_draft_vocab_is_the_renormalised_subset():
    """The reference's meaning: greedy drafts are the argmax over the subset, and a sampled ``p_d`` is the full
    softmax restricted to the subset and renormalised (the logits are the full vocabulary's, row for row)."""
    V, gamma, rank = 97, 3, 8
    full = make_drafter(V, gamma, rank, seed=4)
    vocab = torch.arange(0, V, 3)  # every third token
    drafter = full.restrict_vocab(vocab)
    h, anchor_ids, anchor_pos, _, request_ids = make_inputs(4, gamma, V, seed=9)
    tables = full.markov_tables()
    for temperature in (torch.zeros(4), torch.ones(4)):
        out = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 3, request_ids)
        prev = anchor_ids
        for k in range(gamma):
            logits = full.base_logits(h[:, k]) + torch.nn.functional.linear(tables[0][prev], tables[1]).float()
            sub = logits[:, vocab]
            if temperature[0] == 0:
                assert torch.equal(out.tokens[:, k], vocab[sub.argmax(-1)])
            else:
                torch.testing.assert_close(out.probs[:, k, vocab], sub.softmax(-1), atol=1e-6, rtol=1e-5)
            prev = out.tokens[:, k]


def test_draft_vocab_rejects_bad_ids():
    drafter = make_drafter(50, 2, 4)
    for ids, message in (([3, 3, 7], "distinct and ascending"), ([0, 50], r"lie in \[0, 50\)"), ([], "non-empty")):
        with pytest.raises(ValueError, match=message):
            drafter.restrict_vocab(ids)
    restricted = drafter.restrict_vocab([9, 1, 4])  # sorted for the caller
    assert restricted.draft_vocab.tolist() == [1, 4, 9] and restricted.config.draft_vocab_size == 3
    state = restricted.state_dict() | {"draft_vocab": torch.tensor([4, 1, 9])}  # a stored vocabulary out of order
    with pytest.raises(ValueError, match="distinct and ascending"):
        restricted.load_state_dict(state)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig(vocab_size=50, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      intermediate_size=64, target_num_layers=4, draft_vocab_size=51)


@needs_triton
@pytest.mark.parametrize("split_rows", [1, 16])
def test_split_tile_and_warps_are_free_parameters(split_rows):
    """The split variant's W2 tile and warps (``split_tile``, ``split_warps``: what ``scripts/bench_draft_head.py``
    sweeps) change how the vocabulary is cut into blocks, not what is drawn: greedy and sampled rows keep the
    reference's tokens and ``p_d`` within the fp32 tolerance at every tile, from blocks of 16 lanes to one block
    for the whole vocabulary; a tile or warp count that is no power of two fails fast."""
    R, gamma, V, rank = 17, 2, 203, 16
    drafter = make_drafter(V, gamma, rank, seed=21)
    h, anchor_ids, anchor_pos, temperature, request_ids = make_inputs(R, gamma, V, seed=22)  # greedy and sampled
    want = drafter.sample_block(h, anchor_ids, anchor_pos, temperature, 13, request_ids)
    inputs = to_device(h, anchor_ids, anchor_pos, temperature)
    for tile, warps in ((256, 4), (1024, 8), (4096, 2)):  # 16, 64 and 256 lanes a block: 13, 4 and 1 blocks
        got = fast.sample_block(on_device(drafter), *inputs, 13, request_ids.to(DEVICE), backend="triton", split=True,
                                split_rows=split_rows, split_tile=tile, split_warps=warps)
        assert_close_fp32(got, want)
    for bad in (dict(split_tile=300), dict(split_tile=8), dict(split_warps=3)):
        with pytest.raises(ValueError, match="split_tile|split_warps"):
            fast.sample_block(on_device(drafter), *inputs, 13, request_ids.to(DEVICE), backend="triton", split=True,
                              **bad)
