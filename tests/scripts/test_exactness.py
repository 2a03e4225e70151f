"""``scripts/exactness.py`` end to end on the CPU: tiny bfloat16 models, every op on its Triton kernel through the
interpreter. The invariant setting must make every drafting mode emit plain decoding's tokens, and the JSON must say
so in the schema docs/benchmarks/exactness-*.json uses."""

from __future__ import annotations

import json
import os

import pytest
import torch

from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 (the CI command sets it)")


def test_exactness_script_on_tiny_bfloat16_models(tmp_path):
    from scripts import exactness

    model = tiny_hf_model("llama", num_layers=2)
    drafter = tiny_drafter(Target.from_model(model), gamma=3, seed=0, noise=0.2)
    model.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    target = Target.from_model(model, name="tiny-llama")
    drafter.attach_target(target.embed_tokens, target.lm_head)
    cost = CostTable.affine(fixed_ms=1.0, per_token_ms=0.01, draft_fixed_ms=0.2, sizes=list(range(1, 17)))
    out = tmp_path / "exactness.json"
    prompts = [[5, 9, 3, 17], [60, 2]]
    report = exactness.main(["--modes", "fixed:3", "--batch-sizes", "1,2", "--settings", "invariant",
                             "--max-new-tokens", "4", "--limit", "2", "--kernel-backend", "triton", "--json", str(out)],
                            target=target, drafter=drafter, prompt_ids=prompts, cost=cost)
    saved = json.loads(out.read_text())
    assert saved["dtype"] == "bfloat16" and saved["prompts"] == 2 and saved["max_new_tokens"] == 4
    rows = saved["results"]
    assert {(r["mode"], r["batch_size"]) for r in rows} == {(m, b) for m in ("none", "fixed:3") for b in (1, 2)}
    for r in rows:  # invariant kernels: every mode, and plain decoding in a batch, equal plain decoding alone
        assert r["identical"] == 2 and r["first_difference"] == [], r
        assert r["tokens_per_s"] > 0
    assert report["results"] == rows


def test_exactness_takes_a_trial_table_of_invariant_tiles(tmp_path):
    """``--invariant-tiles``: a table (JSON, a file, or a bench_linear report's proposal) is in force for the run and
    named in its JSON, then the code's table is back; a malformed table stops the run before any model is built."""
    from optimized.kernels import linear as lin
    from scripts import exactness

    before = lin.INVARIANT_TILES
    model = tiny_hf_model("llama", num_layers=2)
    target = Target.from_model(model, name="tiny-llama")
    drafter = tiny_drafter(target, gamma=3, seed=0, noise=0.2)
    cost = CostTable.affine(fixed_ms=1.0, per_token_ms=0.01, draft_fixed_ms=0.2, sizes=list(range(1, 17)))
    table = [dict(max_rows=1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4),
             dict(max_rows=None, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4)]
    report_file = tmp_path / "linear.json"
    report_file.write_text(json.dumps({"proposed_invariant_tiles": table}))
    out = tmp_path / "exactness.json"
    report = exactness.main(["--modes", "fixed:3", "--batch-sizes", "2", "--settings", "invariant",
                             "--max-new-tokens", "3", "--limit", "2", "--kernel-backend", "triton",
                             "--invariant-tiles", str(report_file), "--json", str(out)],
                            target=target, drafter=drafter, prompt_ids=[[5, 9, 3, 17], [60, 2]], cost=cost)
    assert report["invariant_tiles"] == table == json.loads(out.read_text())["invariant_tiles"]
    assert all(r["identical"] == 2 for r in report["results"])  # float32: every mode equals plain decoding
    assert lin.INVARIANT_TILES == before
    with pytest.raises(SystemExit, match="invariant-tiles"):
        exactness.main(["--invariant-tiles", json.dumps(table[1:] + table[:1])], target=target, drafter=drafter)
    for bad in (str(tmp_path / "missing.json"), "[not json"):  # an unreadable file, malformed JSON
        with pytest.raises(SystemExit, match="invariant-tiles"):
            exactness.main(["--invariant-tiles", bad], target=target, drafter=drafter)
    assert lin.INVARIANT_TILES == before
