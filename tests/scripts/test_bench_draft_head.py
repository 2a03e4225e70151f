"""``scripts/bench_draft_head.py``: the sweep's grid, its reading of the module defaults, and one tiny run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from optimized.kernels import draft_head
from scripts import bench_draft_head

needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="the Triton kernels on CPU need TRITON_INTERPRET=1 (the CI command sets it)")


def test_grid_and_default_follow_the_module_constants(monkeypatch):
    few = bench_draft_head.variants(4, [4096, 8192], [4, 8], tiny=False)
    many = bench_draft_head.variants(64, [4096, 8192], [4, 8], tiny=False)
    assert few[0] == {"split": False} and many[0] == {"split": False}
    assert {v["split_rows"] for v in few[1:]} == {1} and {v["split_rows"] for v in many[1:]} == {1, 16, 32, 64}
    assert {v["split_rows"] for v in bench_draft_head.variants(40, [4096], [4], tiny=False)[1:]} == {1, 16, 32}
    assert len(many) == 1 + 4 * 2 * 2 * 2 and len(set(map(bench_draft_head.label, many))) == len(many)
    cuda = torch.device("cuda")  # only its type is read
    monkeypatch.setattr(draft_head, "SPLIT_MAX_R", 128)
    monkeypatch.setattr(draft_head, "SPLIT_TABLE", (dict(below=16, tile=4096, warps=4, fused=True, rows=1),
                                                    dict(below=None, tile=8192, warps=8, fused=False, rows=16)))
    assert bench_draft_head.default_variant(128, cuda) == {"split": False}
    assert bench_draft_head.default_variant(4, torch.device("cpu")) == {"split": False}  # the interpreter's choice
    small, large = bench_draft_head.default_variant(15, cuda), bench_draft_head.default_variant(16, cuda)
    assert small == dict(split=True, split_rows=1, split_tile=4096, split_warps=4, fused_reductions=True)
    assert large == dict(split=True, split_rows=16, split_tile=8192, split_warps=8, fused_reductions=False)
    monkeypatch.setattr(draft_head, "SPLIT_TILE_ELEMENTS", 128)  # an override wins over the table at every R
    assert bench_draft_head.default_variant(16, cuda)["split_tile"] == 128
    assert large in bench_draft_head.variants(16, [8192], [8], tiny=False)


@needs_triton
def test_tiny_sweep_writes_every_variant(tmp_path):
    out = tmp_path / "dh.json"
    report = bench_draft_head.main(["--device", "cpu", "--batches", "2", "--temperatures", "0,1", "--tiles", "1024",
                                    "--warps", "4", "--rows", "1", "--repeats", "1", "--iters", "1",
                                    "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["complete"] and report["timing"].startswith("eager")
    assert report["defaults"]["SPLIT_MAX_R"] == draft_head.SPLIT_MAX_R
    assert [(r["R"], r["temperature"]) for r in report["results"]] == [(2, 0.0), (2, 1.0)]
    for row in report["results"]:
        assert row["default"] == "one-program" and row["best_us"] <= row["default_us"]
        assert len(row["variants"]) == 3  # one program; one request a program, fused or not
        # Greedy tokens never depend on how the vocabulary is cut; these sampled rows are far from any race tie.
        assert all(v["tokens_equal"] for v in row["variants"])
