"""The equivalence harness on the CPU (``scripts/equivalence.py`` and its command line ``scripts/gpu_equivalence.py``):
the tiny run end to end, and the divergence analysis on constructed cases.

On a CPU in float32 the two loops agree exactly, so the analysis never runs in the end-to-end test; here it is driven
by hand. A reference run is "compared" against a copy of itself edited at one step, and the classification must
follow the recomputed margins: a token whose logit exactly ties the reference's choice is a near-tie, a token far
down the distribution or a verify length that no floating-point decision produces is a MISMATCH. The float32
replay must also reproduce every step of the reference run it explains. Names follow ``docs/method.md``
(``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from reference.config import GenerationConfig, SchedulerConfig
from reference.cost_model import CostTable
from reference.generate import GenerationResult
from reference.generate import generate as ref_generate
from reference.sampling import sample
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import equivalence as ge
from scripts import gpu_equivalence

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 3, 17], [2, 40, 41, 42, 43, 7, 8], [60]]
ROW_KEYS = ("mode", "k", "temperature", "prompt_index", "domain", "status", "n_tokens", "first_divergence",
            "chosen_ref", "chosen_opt", "logit_gap", "top2_gap")


@pytest.fixture(scope="module")
def models():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    return target, tiny_drafter(target, gamma=3, noise=0.2)


def _cost() -> CostTable:
    return CostTable.affine(ge.COST_FIXED_MS, ge.COST_PER_TOKEN_MS, sizes=range(1, len(PROMPTS) * 4 + 1))


def _run(models, mode: str, temperature: float, max_new_tokens: int = 8):
    target, drafter = models
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=3, ignore_eos=True)
    sched = SchedulerConfig(mode=mode, k=2, threshold=0.05, dsd_table={1: 3, 2: 2, 3: 1})
    return gen, sched, ref_generate(target, drafter, PROMPTS, gen, sched, _cost())


def _replayer(models, gen, sched, ref, opt) -> ge.Replayer:
    target, drafter = models
    return ge.Replayer(target, drafter, PROMPTS, gen, sched, _cost(), ref, opt)


def test_tiny_run_writes_the_schema_and_finds_every_request_identical(tmp_path):
    out = tmp_path / "ge.json"
    argv = ["--tiny", "--device", "cpu", "--modes", "fixed:2,threshold,adaptive", "--temperatures", "0,1",
            "--max-new-tokens", "8", "--kernel-backend", "torch", "--json", str(out)]
    assert gpu_equivalence.main(argv) == 0
    report = json.loads(out.read_text())
    for key in ("hardware", "command", "model", "drafter", "dtype", "graphs", "kernel_backend", "cost_table",
                "tie_threshold", "results", "summary", "complete", "wall_s"):
        assert key in report, key
    assert report["complete"] is True and report["graphs"] is False  # CPU: no CUDA graphs
    assert report["dtype"] == "float32" and report["tie_threshold"] == 1e-3 and report["kernel_backend"] == "torch"
    assert "--modes fixed:2,threshold,adaptive" in report["command"]
    assert report["cost_table"]["meta"]["synthetic"] == "affine"
    rows = report["results"]
    assert {(r["label"], r["temperature"], r["prompt_index"]) for r in rows} == {
        (m, t, i) for m in ("fixed:2", "threshold", "adaptive") for t in (0.0, 1.0) for i in range(3)}
    for r in rows:
        assert all(k in r for k in ROW_KEYS), r
        assert r["status"] == "identical" and r["n_tokens"] == 8 and r["first_divergence"] is None
    assert all(r["k"] == 2 for r in rows if r["mode"] == "fixed")
    assert report["summary"]["counts"] == {"identical": 18, "near-tie": 0, "MISMATCH": 0}
    assert report["summary"]["per_mode"]["adaptive T=1"] == {"identical": 3, "near-tie": 0, "MISMATCH": 0}
    for c in report["configs"]:  # every verify and draft ran through the engine's graph runners, eagerly on CPU
        assert c["graph_runs"]["verify"]["graph"] == 0 and c["graph_runs"]["verify"]["eager"] > 0
        assert c["graph_runs"]["draft"]["eager"] > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the row-invariant kernels are Triton's")
def test_tiny_run_with_the_batch_invariant_engine(tmp_path):
    """``--batch-invariant``: the engine's target on its row-invariant kernels keeps every request identical to the
    reference loop (float32, under the interpreter on the CPU), and the report says which kernels ran."""
    out = tmp_path / "ge.json"
    argv = ["--tiny", "--device", "cpu", "--modes", "fixed:2,adaptive", "--temperatures", "0", "--max-new-tokens",
            "6", "--kernel-backend", "triton", "--batch-invariant", "--json", str(out)]
    assert gpu_equivalence.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["batch_invariant"] is True and report["kernel_backend"] == "triton"
    assert report["summary"]["counts"] == {"identical": 6, "near-tie": 0, "MISMATCH": 0}


def test_parse_modes():
    specs = ge.parse_modes("none,fixed:3,fixed,adaptive", gamma=7)
    assert [(s.label, s.mode, s.k) for s in specs] == [("none", "none", None), ("fixed:3", "fixed", 3),
                                                       ("fixed:7", "fixed", 7), ("adaptive", "adaptive", None)]
    for bad in ("fixed:9", "dsd:2", "nonsense"):
        with pytest.raises(SystemExit):
            ge.parse_modes(bad, gamma=7)


def test_first_difference_names_the_step_and_the_cause():
    # Steps: [11, 12] (ℓ 2, 1 accepted), [13] (ℓ 1, 0 accepted), [14, 15, 16] (ℓ 2, 2 accepted).
    ref = GenerationResult(0, [5], [10, 11, 12, 13, 14, 15, 16], "length", [2, 1, 2], [1, 0, 2])

    def edit(**changes) -> GenerationResult:
        return GenerationResult(**{**copy.deepcopy(ref.__dict__), **changes})

    assert [s.start for s in ge.steps_of(ref)] == [1, 3, 4]
    assert ge.first_difference(ref, edit()) is None
    assert ge.first_difference(ref, edit(token_ids=[9, 11, 12, 13, 14, 15, 16])) == ge.Divergence(
        None, "prefill", 0, 0)
    assert ge.first_difference(ref, edit(verify_lengths=[2, 2, 2])) == ge.Divergence(1, "verify_length", None, None)
    assert ge.first_difference(ref, edit(accepted_lengths=[1, 1, 1])) == ge.Divergence(
        1, "accepted_length", None, None)
    assert ge.first_difference(ref, edit(token_ids=[10, 11, 12, 13, 14, 99, 16])) == ge.Divergence(2, "token", 1, 5)
    assert ge.first_difference(ref, edit(finish_reason="stop")).cause == "finish"


def test_exact_logit_tie_is_a_near_tie_and_a_far_token_a_mismatch(models):
    """Give an unused token b the embedding (= LM-head row) of the token a the reference emits: l(b) = l(a) at every
    position, the reference still picks a (ties go to the lowest index), and a run that picked b is a near-tie."""
    target, drafter = copy.deepcopy(models)
    gen, sched, ref = _run((target, drafter), "fixed", 0.0)
    step = ge.steps_of(ref[0])[1]
    i = step.start + step.accepted  # the recovered token of step 1
    a = ref[0].token_ids[i]
    used = {t for p in PROMPTS for t in p} | {t for r in ref for t in r.token_ids}
    b = next(v for v in range(target.vocab_size - 1, a, -1) if v not in used)
    with torch.no_grad():
        target.embed_tokens.weight[b] = target.embed_tokens.weight[a]
    _, _, again = _run((target, drafter), "fixed", 0.0)
    assert [r.token_ids for r in again] == [r.token_ids for r in ref], "the tie must not change the reference"

    tied = copy.deepcopy(ref)
    tied[0].token_ids[i] = b
    div = ge.first_difference(ref[0], tied[0])
    assert div == ge.Divergence(1, "token", step.accepted, i)
    row = ge.explain(_replayer((target, drafter), gen, sched, ref, tied), 0, div, threshold=1e-3)
    assert row["status"] == "near-tie" and row["gap"] == 0.0 and row["logit_gap"] == 0.0
    assert (row["chosen_ref"], row["chosen_opt"]) == (a, b)
    assert row["replay_agrees"] is True and row["gap_source"].startswith("target argmax")

    replayer = _replayer((target, drafter), gen, sched, ref, ref)
    logits = replayer.next_logits(PROMPTS[0] + ref[0].token_ids[:i])
    far = copy.deepcopy(ref)
    far[0].token_ids[i] = c = int(logits.argmin())
    row = ge.explain(_replayer((target, drafter), gen, sched, ref, far), 0, ge.first_difference(ref[0], far[0]), 1e-3)
    assert row["status"] == "MISMATCH" and row["chosen_opt"] == c
    assert row["logit_gap"] == pytest.approx(float(logits[a] - logits[c]), abs=1e-4) and row["logit_gap"] > 1.0
    assert row["gap"] == pytest.approx(row["logit_gap"], abs=1e-4)


def test_a_length_no_float_decides_is_a_mismatch(models):
    """Mode fixed: ℓ never reads a float, so a different verify length has no margin at all."""
    gen, sched, ref = _run(models, "fixed", 0.0)
    opt = copy.deepcopy(ref)
    opt[1].verify_lengths[1] = 1
    div = ge.first_difference(ref[1], opt[1])
    row = ge.explain(_replayer(models, gen, sched, ref, opt), 1, div, threshold=1e-3)
    assert (row["cause"], row["first_step"], row["first_divergence"]) == ("verify_length", 1, None)
    assert row["status"] == "MISMATCH" and row["gap"] is None and row["margins"] == []


@pytest.mark.parametrize("mode", ["threshold", "adaptive"])
def test_survival_driven_length_is_judged_by_its_margins(models, mode):
    """threshold / adaptive: a different ℓ is explained by the drafts and survivals of that step, and the status
    follows the smallest margin against the tie threshold."""
    gen, sched, ref = _run(models, mode, 1.0)
    opt = copy.deepcopy(ref)
    opt[0].verify_lengths[2] = (ref[0].verify_lengths[2] + 1) % 4
    div = ge.first_difference(ref[0], opt[0])
    replayer = _replayer(models, gen, sched, ref, opt)
    margins = replayer.margins(0, div)
    assert margins and all(m >= 0 for m, _ in margins)
    assert any(what.startswith("draft race") for _, what in margins)
    schedule = "threshold" if mode == "threshold" else "stale budget"
    assert any(what.startswith(schedule) for _, what in margins)
    smallest = min(m for m, _ in margins if math.isfinite(m))
    row = ge.explain(replayer, 0, div, threshold=smallest * 2)
    assert row["status"] == "near-tie" and row["gap"] == pytest.approx(smallest)
    assert ge.explain(replayer, 0, div, threshold=smallest / 2)["status"] == "MISMATCH"
    assert row["replay_agrees"] is True


def test_sampled_token_difference_reports_the_race_gap(models):
    gen, sched, ref = _run(models, "fixed", 1.0)
    step = ge.steps_of(ref[2])[0]
    i = step.start + step.accepted
    opt = copy.deepcopy(ref)
    opt[2].token_ids[i] = (ref[2].token_ids[i] + 1) % 96
    row = ge.explain(_replayer(models, gen, sched, ref, opt), 2, ge.first_difference(ref[2], opt[2]), 1e-3)
    assert row["gap_source"].startswith("target race") and "note" in row
    assert row["logit_gap"] is not None and row["top2_gap"] >= 0
    assert row["status"] == ("near-tie" if row["gap"] < 1e-3 else "MISMATCH")


@pytest.mark.parametrize("mode", ["none", "dsd", "threshold", "adaptive-sync", "adaptive", "oracle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_reproduces_every_step_of_the_reference(models, mode, temperature):
    """The float32 replay of a step (drafts, survivals, schedule, verification) equals what the reference did."""
    gen, sched, ref = _run(models, mode, temperature, max_new_tokens=6)
    replayer = _replayer(models, gen, sched, ref, ref)
    for rid, r in enumerate(ref):
        assert replayer.check(rid, None)
        for s in range(len(r.accepted_lengths)):
            assert replayer.check(rid, s), (rid, s)
            for cause in ("verify_length", "accepted_length"):
                margins = replayer.margins(rid, ge.Divergence(s, cause, None, None))
                assert all(m >= 0 for m, _ in margins), margins


def test_coupled_modes_inherit_an_earlier_near_tie():
    def row(i, step, status, cause="verify_length"):
        return {"prompt_index": i, "first_step": step, "status": status, "cause": cause}

    rows = [row(0, 2, "near-tie"), row(1, 3, "MISMATCH", "token"), row(2, 2, "MISMATCH"), row(3, 1, "MISMATCH"),
            row(4, 2, "MISMATCH", "accepted_length")]
    ge.apply_coupling(rows, "adaptive")  # later steps, and the same step's allocation, are shared
    assert [r["status"] for r in rows] == ["near-tie", "near-tie", "near-tie", "MISMATCH", "MISMATCH"]
    assert rows[1]["explained_by"] == {"prompt_index": 0, "first_step": 2}
    rows = [row(0, None, "near-tie", "prefill"), row(1, 0, "MISMATCH"), row(2, 4, "MISMATCH", "token")]
    ge.apply_coupling(rows, "adaptive-sync")  # a prefill token precedes every step
    assert [r["status"] for r in rows] == ["near-tie"] * 3
    rows = [row(0, 2, "near-tie"), row(1, 2, "MISMATCH"), row(2, 3, "MISMATCH")]
    ge.apply_coupling(rows, "dsd")  # the batch size changes only after a step: the same step does not explain
    assert [r["status"] for r in rows] == ["near-tie", "MISMATCH", "near-tie"]
    rows = [row(0, 0, "near-tie"), row(1, 3, "MISMATCH")]
    ge.apply_coupling(rows, "fixed")  # independent requests: nothing is inherited
    assert rows[1]["status"] == "MISMATCH"


def test_margin_primitives():
    logits = torch.tensor([1.0, 3.0, 2.5, -1.0])
    assert ge.top2_gap(logits) == pytest.approx(0.5)
    assert ge.argmax_margin(logits, 1) == pytest.approx(0.5) and ge.argmax_margin(logits, 3) == pytest.approx(4.0)
    assert ge.pair_gap(logits, 0, 2) == pytest.approx(1.5)
    assert ge.accept_margin(0.5, 0.2, 0.1) == pytest.approx(0.0, abs=1e-12)  # u·p_d = p_t: on the boundary
    assert ge.accept_margin(0.5, 0.2, 0.0) == math.inf
    probs = torch.tensor([0.5, 0.5, 0.0])
    winner = int(sample(probs[None], 7, torch.tensor([1]), torch.tensor([4]), 4)[0])
    gap = ge.race_margin(probs, 7, 1, 4, 4)
    assert gap > 0 and ge.race_margin(probs, 7, 1, 4, 4, pair=(winner, 1 - winner)) == pytest.approx(gap)
    assert ge.race_margin(probs, 7, 1, 4, 4, pair=(0, 2)) == math.inf  # a zero-probability token cannot be drawn
    assert ge.race_margin(torch.tensor([0.0, 1.0]), 7, 1, 4, 4) == math.inf
