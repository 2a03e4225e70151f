"""Equivalence of the one-launch verify layout (``optimized.kernels.layout``) with its torch definition.

The Triton kernel runs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by the CI command);
without it those cases skip. Every output is an integer, so the comparison is exact.
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


def case(seed: int, r: int, max_rows: int, gamma: int, pad: int):
    g = torch.Generator().manual_seed(seed)
    slots = max_rows + 1
    rows = torch.randperm(max_rows, generator=g)[:r]  # any slots, in any order
    lens = torch.randint(0, gamma + 1, (r,), generator=g)
    anchor = torch.randint(0, 1000, (slots,), generator=g)
    anchor_pos = torch.randint(0, 500, (slots,), generator=g)
    drafts = torch.randint(0, 1000, (slots, max(gamma, 1)), generator=g)
    n_pad = int((lens + 1).sum()) + pad
    return rows, lens, anchor, anchor_pos, drafts, n_pad


@needs_interpreter
@pytest.mark.parametrize("seed,r,max_rows,gamma,pad", [
    (0, 1, 1, 7, 0), (1, 1, 4, 7, 3), (2, 3, 8, 7, 5), (3, 8, 8, 3, 0), (4, 5, 64, 7, 11), (5, 40, 256, 7, 9),
    (6, 2, 4, 0, 1)])  # γ = 0: the no-speculation engine (every ℓ = 0)
def test_triton_layout_matches_torch(seed, r, max_rows, gamma, pad):
    rows, lens, anchor, anchor_pos, drafts, n_pad = case(seed, r, max_rows, gamma, pad)
    max_tokens = n_pad + 4
    out_t, out_ref = buffers(max_rows, max_tokens), buffers(max_rows, max_tokens)
    verify_layout(rows, lens, anchor, anchor_pos, drafts, n_pad, out_t, backend="triton")
    verify_layout(rows, lens, anchor, anchor_pos, drafts, n_pad, out_ref, backend="torch")
    for name in out_ref:
        limit = n_pad if name in ("input_ids", "positions", "token_slot") else None  # tokens past n_pad: untouched
        assert torch.equal(out_t[name][:limit], out_ref[name][:limit]), name


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
