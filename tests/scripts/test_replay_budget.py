"""``scripts/replay_budget.py``: the replay of each budget policy on recorded drafts (exact counts on a hand-made
trace), and the whole script on the CPU with a tiny target and drafter."""

from __future__ import annotations

import json
import math

import pytest
import torch

from reference.cost_model import CostTable
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import replay_budget

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3
# Verifying drafts is nearly free next to the step's fixed price: with survivals this high every budget pays.
COST = CostTable.affine(fixed_ms=10.0, per_token_ms=0.01, draft_fixed_ms=1.0, sizes=list(range(1, 9)))


def _trace(steps: int, accepted: int) -> dict:
    return {"survivals": torch.tensor([[0.9, 0.8, 0.7]] * steps), "accepted": [accepted] * steps}


def test_the_replay_counts_each_policy_exactly():
    traces = [_trace(4, 2), _trace(3, 1)]  # two requests, one after the other
    results = {name: replay_budget.replay(traces, COST, GAMMA, 2, fn, keep)
               for name, (fn, keep) in replay_budget.POLICIES.items()}
    step = lambda ell: COST.step_time(1 + ell, 1)  # noqa: E731
    # fixed: every draft verified; the accepted ones and the bonus token each step
    fixed = results["fixed"]
    assert fixed["steps"] == 7 and fixed["mean_verify_length"] == GAMMA
    assert fixed["tau"] == pytest.approx((4 * 3 + 3 * 2) / 7, abs=1e-4)
    assert fixed["tokens_per_s"] == pytest.approx(18 / (7 * step(GAMMA)), rel=1e-4)
    # zero fill: the first two steps of each request verify nothing (one token each), then every draft pays
    zero = results["zero_fill"]
    assert zero["mean_verify_length"] == pytest.approx(3 * GAMMA / 7, abs=1e-3)
    assert zero["tau"] == pytest.approx((2 + 2 * 3 + 2 + 1 * 2) / 7, abs=1e-4)
    # the prior: only the very first request's first two steps lack it; the second request borrows the first's curve
    prior = results["prior"]
    assert prior["mean_verify_length"] == pytest.approx(5 * GAMMA / 7, abs=1e-3)
    assert prior["tau"] == pytest.approx((2 + 2 * 3 + 3 * 2) / 7, abs=1e-4)
    assert prior["tokens_per_s"] > zero["tokens_per_s"]
    # the step's own survivals: every step verifies, as fixed does here
    assert results["current"]["tau"] == fixed["tau"]


def test_the_script_writes_its_report(tmp_path):
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    drafter = tiny_drafter(target, gamma=GAMMA, noise=0.2)
    table = tmp_path / "bench.json"
    table.write_text(json.dumps({"cost_table_async": COST.to_dict()}))
    out = tmp_path / "replay.json"
    prompts = [[5, 6, 7, 8], [9, 2], [3, 3, 4, 10, 11, 12]]
    report = replay_budget.main(["--cost-table", str(table), "--requests", "3", "--max-new-tokens", "12",
                                 "--batch-size", "2", "--out", str(out)], target=target, drafter=drafter,
                                prompt_ids=prompts)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["requests"] == 3 and set(report["results"]) == set(replay_budget.POLICIES)
    steps = {r["steps"] for r in report["results"].values()}
    assert steps == {report["drafts"]} and report["drafts"] >= 3 * 12 / (GAMMA + 1)
    assert report["results"]["fixed"]["over_fixed"] == 1.0
    for r in report["results"].values():
        assert 1 <= r["tau"] <= GAMMA + 1 and 0 <= r["mean_verify_length"] <= GAMMA and not math.isnan(r["step_ms"])
    with pytest.raises(SystemExit, match="not a cost table"):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"verify_ms": "nope"}))
        replay_budget.main(["--cost-table", str(bad), "--out", str(out)], target=target, drafter=drafter,
                           prompt_ids=prompts)
