"""``scripts/ab_engine.py``: each experiment's two arms differ only in the change it measures, and the report pairs
them; ``scripts/ab_stale_prior.py`` is its stale-prior experiment under the earlier name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from optimized.kernels import draft_head, linear
from optimized.scheduler import BudgetPlanner
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import ab_engine, ab_stale_prior

pytestmark = pytest.mark.usefixtures("one_thread")


def test_zero_fill_arm_withholds_the_prior_and_restores_it():
    planner = BudgetPlanner.__new__(BudgetPlanner)  # only the prior's state is needed
    planner._stale_seen, planner._stale_prior = np.array([[0.9, 0.5], [np.nan, np.nan]], dtype=np.float32), None
    with ab_engine.arm("prior"):
        np.testing.assert_allclose(planner.stale_prior(), [0.9, 0.5])
    with pytest.raises(RuntimeError), ab_engine.arm("zero_fill"):
        assert planner.stale_prior() is None
        raise RuntimeError("a failing run")
    np.testing.assert_allclose(planner.stale_prior(), [0.9, 0.5])  # restored even after the failure
    with pytest.raises(ValueError, match="unknown arm"), ab_engine.arm("both"):
        pass
    with pytest.raises(ValueError, match="unknown experiment"), ab_engine.arm("prior", "budget"):
        pass


def test_previous_draft_head_arm_restores_the_table():
    table, max_r = draft_head.SPLIT_TABLE, draft_head.SPLIT_MAX_R
    assert ab_engine.arms("draft_head") == ("table", "previous")
    with ab_engine.arm("table", "draft_head"):
        assert draft_head.SPLIT_TABLE is table and draft_head.split_launch(64)["rows"] == 1
    with pytest.raises(RuntimeError), ab_engine.arm("previous", "draft_head"):
        assert draft_head.SPLIT_MAX_R == draft_head.PREVIOUS_SPLIT_MAX_R
        # before the in-graph sweep: 16,384-product tiles at 8 warps, 16 requests a program from 32 on
        assert draft_head.split_launch(16) == dict(tile=16384, warps=8, fused=False, rows=1)
        assert draft_head.split_launch(64) == dict(tile=16384, warps=8, fused=False, rows=16)
        raise RuntimeError("a failing run")
    assert draft_head.SPLIT_TABLE is table and draft_head.SPLIT_MAX_R == max_r


def test_previous_small_rows_arm_restores_the_tiles():
    tiles = linear.DOT_TILES
    assert ab_engine.arms("small_rows") == ("table", "previous")
    with pytest.raises(RuntimeError), ab_engine.arm("previous", "small_rows"):
        assert linear.DOT_TILES is linear.PREVIOUS_DOT_TILES
        # before the split-K sweep: no split, the norm's pass in 256-column tiles, Triton's pipeline depth
        for gated, norm in ((False, True), (True, True), (False, False)):
            cfg = linear.kernel_config(8, 960, 576, gated, norm=norm)
            assert cfg == dict(kernel="dot", BLOCK_M=16, BLOCK_N=32 if gated else 16, BLOCK_K=256, num_warps=4)
        raise RuntimeError("a failing run")
    assert linear.DOT_TILES is tiles


def test_report_pairs_the_arms_per_batch_and_mode(tmp_path):
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    drafter = tiny_drafter(target, gamma=4, markov_rank=8)
    out = tmp_path / "ab.json"
    argv = ["--rounds", "1", "--out", str(out), "--", "--batch-sizes", "1", "--modes", "adaptive+async",
            "--max-new-tokens", "6", "--requests-per-slot", "2", "--warmup", "0", "--repeats", "1",
            "--hf-max-batch", "0", "--context-len", "16", "--cost-cache-dir", str(tmp_path / "cost")]
    report = ab_stale_prior.main(argv, target=target, drafter=drafter, prompt_ids=[[5, 6, 7, 8], [9, 2]])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    cell = report["summary"]["1"]["adaptive+async"]
    assert [len(v) for v in cell["tokens_per_s"].values()] == [1, 1]
    med = cell["median_tokens_per_s"]
    assert med["prior"] > 0 and med["zero_fill"] > 0
    assert cell["prior_over_zero_fill"] == pytest.approx(med["prior"] / med["zero_fill"], rel=1e-3)
    step, tau = cell["median_step_ms"], cell["median_tau"]  # the step's price apart from the acceptance
    assert step["prior"] > 0 and step["zero_fill"] > 0 and tau["prior"] >= 1 and tau["zero_fill"] >= 1
    assert cell["step_zero_fill_over_prior"] == pytest.approx(step["zero_fill"] / step["prior"], rel=1e-3)
    assert report["command"].startswith("python -m scripts.ab_stale_prior --rounds 1")
    with pytest.raises(SystemExit, match="before '--'"):
        ab_stale_prior.main(["--", "--out", str(out)])


def test_target_is_loaded_once_for_every_run(monkeypatch):
    calls = []

    def fake_load(cls, name, *, device="cpu"):
        calls.append((name, device))
        return object()

    monkeypatch.setattr(Target, "load", classmethod(fake_load))
    before = Target.__dict__["load"]
    with ab_engine.target_loaded_once():
        a, b = Target.load("m", device="cpu"), Target.load("m", device="cpu")
        c = Target.load("other", device="cpu")
    assert a is b and c is not a and calls == [("m", "cpu"), ("other", "cpu")]
    assert Target.__dict__["load"] is before  # put back as it was
    Target.load("m")
    assert len(calls) == 3  # outside the block every call loads again


def test_dot_tiles_come_from_a_table_or_a_sweep_report(tmp_path):
    from scripts.bench_linear import proposed_dot_tiles

    def row(op, us, **cfg):
        return {"rows": 8, "op": op, "us": us,
                "config": dict(kernel="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, **cfg)}

    sweep = [row("qkv", 5.0), row("qkv", 4.0, SPLIT_K=3, RMS_BLOCK_K=1024), row("gate_up", 6.0),
             row("gate_up", 7.0, SPLIT_K=2), row("o", 3.0), row("o", 2.0, SPLIT_K=3), row("down", 4.0),
             row("down", 6.0, SPLIT_K=3), row("down", 1.0, SPLIT_K=6),  # split 6: o did not time it
             {"rows": 8, "op": "qkv", "config": "default", "us": 5.5}]
    proposal = proposed_dot_tiles(sweep, 8)
    assert proposal["table"]["norm"] == dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, split_k=3, rms_whole_row=True,
                                             num_stages=None)
    assert proposal["table"]["gated"]["split_k"] == 1
    assert proposal["table"]["plain"]["split_k"] == 1 and proposal["us"]["plain"] == 7.0  # 3 + 4 against 2 + 6
    assert proposal["default_us"]["norm"] == 5.5 and proposal["default_us"]["plain"] is None
    assert proposed_dot_tiles(sweep, 16) == {}
    report = tmp_path / "linear.json"
    report.write_text(json.dumps({"sweep": sweep, "proposed_dot_tiles": [proposal]}))
    assert ab_engine.dot_tiles_from_file(str(report)) == proposal["table"]
    table = tmp_path / "tiles.json"
    table.write_text(json.dumps(proposal["table"]))
    assert ab_engine.dot_tiles_from_file(str(table)) == proposal["table"]
    report.write_text(json.dumps({"sweep": sweep}))
    with pytest.raises(ValueError, match="without a proposed"):
        ab_engine.dot_tiles_from_file(str(report))
