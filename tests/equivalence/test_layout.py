"""Equivalence of the one-launch verify layout (``optimized.kernels.layout``) with its torch definition.

The Triton kernel runs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by the CI command);
without it those cases skip. Every output is an integer, so the comparison is exact: the token fields up to
``n_pad`` (the buffer past it must keep its junk), and all ``M + 1`` / ``M`` per-row entries, padding rows included.
The shapes span both token blocks of the kernel (64 tokens up to M = 127 rows, 16 above), grids of one program and
of many with a partial last block, R = M, and γ = 0 (the no-speculation engine).
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.layout import HAS_TRITON, verify_layout, verify_layout_torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED), reason="Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")


def buffers(max_rows: int, max_tokens: int) -> dict[str, torch.Tensor]:
    """Static buffers as the engine's StaticBuffers hold them, pre-filled with junk a layout must overwrite."""
    return {"input_ids": torch.full((max_tokens,), 77), "positions": torch.full((max_tokens,), 77),
            "token_slot": torch.full((max_tokens,), 77), "cu": torch.full((max_rows + 1,), 77, dtype=torch.int32),
            "kv_lens": torch.full((max_rows,), 77, dtype=torch.int32),
            "slot_ids": torch.full((max_rows,), 77, dtype=torch.int32)}


def case(seed: int, r: int, max_rows: int, gamma: int, pad: int, lens_kind: str = "random"):
    """R requests in random slots of ``max_rows + 1`` (the engine's trash slot is the extra one); ``lens_kind``
    ``"random"`` draws every ℓ in 0..γ, ``"zero"`` and ``"full"`` pin them all to 0 or γ."""
    g = torch.Generator().manual_seed(seed)
    slots = max_rows + 1
    rows = torch.randperm(max_rows, generator=g)[:r]  # any slots, in any order
    lens = torch.randint(0, gamma + 1, (r,), generator=g)  # [R]
    if lens_kind != "random":
        lens.fill_(0 if lens_kind == "zero" else gamma)
    anchor = torch.randint(0, 1000, (slots,), generator=g)
    anchor_pos = torch.randint(0, 500, (slots,), generator=g)
    drafts = torch.randint(0, 1000, (slots, max(gamma, 1)), generator=g)
    n_pad = int((lens + 1).sum()) + pad
    return rows, lens, anchor, anchor_pos, drafts, n_pad


def assert_layouts_equal(rows, lens, anchor, anchor_pos, drafts, n_pad, max_rows, max_tokens):
    """Triton under the interpreter against the torch twin, into junk-filled buffers of the given sizes."""
    out_t, out_ref = buffers(max_rows, max_tokens), buffers(max_rows, max_tokens)
    verify_layout(rows, lens, anchor, anchor_pos, drafts, n_pad, out_t, backend="triton")
    verify_layout(rows, lens, anchor, anchor_pos, drafts, n_pad, out_ref, backend="torch")
    for name in out_ref:
        limit = n_pad if name in ("input_ids", "positions", "token_slot") else None  # tokens past n_pad: untouched
        assert torch.equal(out_t[name][:limit], out_ref[name][:limit]), name
        if limit is not None:
            assert bool((out_t[name][n_pad:] == 77).all()), f"{name} written past n_pad"


@needs_interpreter
@pytest.mark.parametrize("seed,r,max_rows,gamma,pad", [
    (0, 1, 1, 7, 0), (1, 1, 4, 7, 3), (2, 3, 8, 7, 5), (3, 8, 8, 3, 0), (4, 5, 64, 7, 11), (5, 40, 256, 7, 9),
    (6, 2, 4, 0, 1),  # γ = 0: the no-speculation engine (every ℓ = 0)
    (7, 2, 2, 7, 0), (8, 7, 16, 7, 64), (9, 64, 64, 7, 0), (10, 64, 127, 7, 5),  # M = 127: last 64-token block
    (11, 64, 128, 7, 100), (12, 256, 256, 7, 0), (13, 256, 257, 7, 37), (14, 200, 257, 1, 3),
    (15, 37, 100, 0, 0), (16, 256, 256, 0, 17)])
def test_triton_layout_matches_torch(seed, r, max_rows, gamma, pad):
    rows, lens, anchor, anchor_pos, drafts, n_pad = case(seed, r, max_rows, gamma, pad)
    assert_layouts_equal(rows, lens, anchor, anchor_pos, drafts, n_pad, max_rows, n_pad + 4)


@needs_interpreter
@pytest.mark.parametrize("lens_kind", ["zero", "full"])
@pytest.mark.parametrize("r,max_rows,pad", [(1, 1, 0), (2, 5, 15), (7, 7, 1), (64, 65, 0), (256, 257, 16)])
def test_triton_layout_extreme_lengths(lens_kind, r, max_rows, pad):
    """Every ℓ = 0 (one token per request) or every ℓ = γ (γ + 1 each), with and without padding tokens; the
    token counts land on and across block boundaries (16 and 64 tokens)."""
    rows, lens, anchor, anchor_pos, drafts, n_pad = case(r + pad, r, max_rows, 7, pad, lens_kind)
    assert_layouts_equal(rows, lens, anchor, anchor_pos, drafts, n_pad, max_rows, n_pad)


@needs_interpreter
def test_triton_layout_random_shapes():
    """Forty random (R, M, γ, padding) draws, R in 1..M and M in 1..257: anything the fixed cases missed."""
    g = torch.Generator().manual_seed(1234)
    for seed in range(40):
        max_rows = int(torch.randint(1, 258, (1,), generator=g))
        r = int(torch.randint(1, max_rows + 1, (1,), generator=g))
        gamma = int(torch.randint(0, 9, (1,), generator=g))
        pad = int(torch.randint(0, 3, (1,), generator=g)) * int(torch.randint(0, 70, (1,), generator=g))
        rows, lens, anchor, anchor_pos, drafts, n_pad = case(100 + seed, r, max_rows, gamma, pad)
        assert_layouts_equal(rows, lens, anchor, anchor_pos, drafts, n_pad, max_rows, n_pad + 3)


def test_torch_layout_by_hand():
    """Two requests in slots 2 and 0 with ℓ = 2 and 0, one padding token: every field spelled out."""
    rows, lens = torch.tensor([2, 0]), torch.tensor([2, 0])
    anchor, anchor_pos = torch.tensor([10, 11, 12]), torch.tensor([5, 6, 7])
    drafts = torch.tensor([[100, 101], [110, 111], [120, 121]])
    out = buffers(3, 6)
    verify_layout(rows, lens, anchor, anchor_pos, drafts, 5, out, backend="torch")
    assert out["input_ids"][:5].tolist() == [12, 120, 121, 10, 0]
    assert out["positions"][:5].tolist() == [7, 8, 9, 5, 0]
    assert out["token_slot"][:5].tolist() == [2, 2, 2, 0, -1]
    assert out["cu"].tolist() == [0, 3, 4, 4]
    assert out["kv_lens"].tolist() == [10, 6, 0]
    assert out["slot_ids"].tolist() == [2, 0, -1]
    ref = verify_layout_torch(rows, lens, anchor, anchor_pos, drafts, 5)
    assert torch.equal(ref["input_ids"], out["input_ids"][:5])


def test_layout_rejects_bad_sizes():
    rows, lens, anchor, anchor_pos, drafts, n_pad = case(0, 3, 4, 7, 0)
    with pytest.raises(ValueError, match="token slots"):
        verify_layout(rows, lens, anchor, anchor_pos, drafts, n_pad, buffers(4, n_pad - 1), backend="torch")
    with pytest.raises(ValueError, match="rows"):
        verify_layout(rows, lens, anchor, anchor_pos, drafts, n_pad, buffers(2, n_pad), backend="torch")


# --------------------------------------------------------------------------- the drafter stage's inputs and outputs


def draft_buffers(max_rows: int) -> dict[str, torch.Tensor]:
    """The draft graph's static inputs, pre-filled with junk that the load must overwrite up to r_pad."""
    return {"anchor_ids": torch.full((max_rows,), 77), "anchor_pos": torch.full((max_rows,), 77),
            "draft_slots": torch.full((max_rows,), 77, dtype=torch.int32),
            "draft_temperature": torch.full((max_rows,), 7.0), "draft_request_id": torch.full((max_rows,), 77)}


@needs_interpreter
@pytest.mark.parametrize("r,r_pad", [(1, 1), (3, 4), (5, 8), (16, 16), (130, 256)])
@pytest.mark.parametrize("sampling", [True, False])
def test_draft_load_matches_torch(r, r_pad, sampling):
    """The one-launch load writes exactly the torch definition's inputs: the slots' anchors, positions (and, for a
    head sampled in the graph, temperatures and request ids), padding rows up to r_pad, nothing past it."""
    from optimized.kernels.layout import draft_load

    g = torch.Generator().manual_seed(r * 10 + r_pad)
    S = r + 20
    rows = torch.randperm(S, generator=g)[:r]  # [R] int64 distinct slots
    anchor, anchor_pos = torch.randint(0, 1000, (S,), generator=g), torch.randint(0, 500, (S,), generator=g)
    temperature = torch.rand(S, generator=g) * (torch.rand(S, generator=g) > 0.5)  # greedy and sampled slots
    request_id = torch.randint(0, 10**6, (S,), generator=g)
    per_slot = (temperature, request_id) if sampling else (None, None)
    want, got = draft_buffers(r_pad + 8), draft_buffers(r_pad + 8)  # rows past r_pad must keep their junk
    draft_load(rows, anchor, anchor_pos, *per_slot, r_pad, want, backend="torch")
    draft_load(rows, anchor, anchor_pos, *per_slot, r_pad, got, backend="triton")
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert int(want["draft_slots"][r_pad:].eq(77).all()) and int(want["draft_slots"][r:r_pad].eq(-1).all())


@needs_interpreter
@pytest.mark.parametrize("r,gamma", [(1, 7), (6, 4)])
def test_draft_store_matches_torch(r, gamma):
    """The one-launch store scatters the drafts and survivals into their slots and flags the greedy slots' one-hot
    p_d, exactly as the torch definition; every other slot is untouched."""
    from optimized.kernels.layout import draft_store

    g = torch.Generator().manual_seed(r + gamma)
    S = 12
    rows = torch.randperm(S, generator=g)[:r]
    tokens = torch.randint(0, 1000, (r, gamma), generator=g)
    survival = torch.rand(r, gamma, generator=g)
    temperature = torch.rand(S, generator=g) * (torch.arange(S) % 2)  # even slots greedy
    outs = []
    for backend in ("torch", "triton"):
        slots_tokens, onehot = torch.full((S, gamma), -5), torch.zeros(S, dtype=torch.bool)
        slots_survival = torch.full((S, gamma), -1.0)
        onehot[S - 1] = True  # a flag left from an earlier draft: kept where no request writes
        draft_store(rows, tokens, survival, temperature, slots_tokens, onehot, slots_survival, backend=backend)
        outs.append((slots_tokens, onehot, slots_survival))
    for want, got in zip(*outs):
        assert torch.equal(got, want)
    assert torch.equal(outs[0][0][rows], tokens) and torch.equal(outs[0][1][rows], temperature[rows] == 0)
