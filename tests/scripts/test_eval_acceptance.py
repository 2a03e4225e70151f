"""``scripts/eval_acceptance.py --proposer ngram``: the n-gram baseline's τ per domain and per slot, with no checkpoint.

A tiny random target saved to disk stands in for SmolLM2 (no download); the trained drafter's arm is covered by
tests/scripts/test_pipeline.py. Names follow ``docs/method.md`` (``τ`` emitted tokens per verify step, ``ℓ``).
"""

from __future__ import annotations

import json

import pytest

from reference.testing import tiny_hf_model
from scripts import eval_acceptance

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3
# Prompts with repeats (the lookup finds something) and one without, in two domains.
PROMPTS = [([5, 6, 7, 5, 6, 7, 5], "code"), ([9, 2, 9, 2, 9], "code"), ([3, 40, 41, 42], "chat"), ([60], "chat")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_ngram")
    tiny_hf_model("llama", num_layers=2).save_pretrained(root / "target")
    pf = root / "eval.jsonl"
    pf.write_text("".join(json.dumps({"input_ids": ids, "domain": d}) + "\n" for ids, d in PROMPTS))
    return root / "target", pf


def _eval(files, tmp_path, *extra):
    target, pf = files
    out = tmp_path / "tau.json"
    assert eval_acceptance.main(["--proposer", "ngram", "--gamma", str(GAMMA), "--prompts-file", str(pf), "--model",
                                 str(target), "--device", "cpu", "--max-new-tokens", "16", "--json", str(out),
                                 *extra]) == 0
    return json.loads(out.read_text())


def test_ngram_tau_per_domain_and_slot(files, tmp_path):
    r = _eval(files, tmp_path, "--temperature", "1.0")
    assert r["proposer"] == "ngram" and r["drafter"] == "ngram"
    assert r["drafter_config"] == {"kind": "ngram", "gamma": GAMMA, "max_n": 3, "min_n": 1}
    assert set(r["per_domain"]) == {"chat", "code"} and r["counts"]["prompts"] == len(PROMPTS)
    assert r["settings"]["gamma"] == GAMMA and len(r["per_position_acceptance"]) == GAMMA
    assert 1.0 <= r["mean_accepted_length"] <= GAMMA + 1
    assert 0.0 <= r["mean_verify_length"] <= GAMMA
    verified = r["per_position_verified"]
    assert all(1.0 >= a >= b >= 0.0 for a, b in zip(verified, verified[1:])), "ℓ ≥ k + 1 implies ℓ ≥ k"
    # τ = 1 + Σ_k P(slots 1..k accepted), and P(slots 1..k accepted) = acceptance_k · counts_k / steps: slot k is
    # judged in the counts_k steps that accepted slots 1..k-1 and verified slot k.
    steps = r["counts"]["steps"]
    passed = [(c or 0.0) * n for c, n in zip(r["per_position_acceptance"], r["per_position_counts"])]
    assert abs(1.0 + sum(passed) / steps - r["mean_accepted_length"]) < 1e-6  # τ is a float32 mean in the script
    assert r["per_position_counts"][0] == round(verified[0] * steps)
    # The reference loop measures exactly what the (default) optimized engine measures.
    ref = _eval(files, tmp_path, "--temperature", "1.0", "--engine", "reference")
    assert ref["per_domain_detail"] == r["per_domain_detail"]


def test_ngram_refuses_a_checkpoint(files, tmp_path):
    target, pf = files
    with pytest.raises(SystemExit, match="not both"):
        eval_acceptance.main(["--proposer", "ngram", "--drafter", "somewhere", "--prompts-file", str(pf), "--model",
                              str(target), "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="not both"):  # the trained drafter's arm needs its checkpoint
        eval_acceptance.main(["--prompts-file", str(pf), "--model", str(target), "--json", str(tmp_path / "x.json")])


def test_tau_standard_error_treats_prompts_as_clusters():
    from reference.generate import GenerationResult

    def result(accepted):
        return GenerationResult(0, [1], [2] * len(accepted), "length", [3] * len(accepted), accepted)

    # Two prompts: one always accepts 3, the other never. τ = (4·10 + 1·10) / 20 = 2.5; each prompt's residual
    # S_p − τ·n_p is ±15, so the variance is 2·15² / 20² · 2/1 and the error 1.5: large, because two prompts say
    # little. Steps treated as independent would claim 1.5 / √10 ≈ 0.47.
    se = eval_acceptance.tau_standard_error([result([3] * 10), result([0] * 10)])
    assert se == pytest.approx(1.5)
    assert eval_acceptance.tau_standard_error([result([1, 2])]) is None  # one prompt: no spread to measure
    same = [result([1, 2, 1]) for _ in range(5)]
    assert eval_acceptance.tau_standard_error(same) == pytest.approx(0.0)
    summary = eval_acceptance.summarise([result([3] * 10), result([0] * 10)], gamma=3)
    assert summary["mean_accepted_length"] == pytest.approx(2.5) and summary["mean_accepted_length_se"] == se


def test_several_seeds_pool_their_runs(files, tmp_path):
    one = _eval(files, tmp_path, "--temperature", "1.0")
    two = _eval(files, tmp_path, "--temperature", "1.0", "--seeds", "2")
    assert two["settings"]["seeds"] == [0, 1] and two["counts"]["seeds"] == 2
    assert two["counts"]["prompts"] == len(PROMPTS) == one["counts"]["prompts"]
    assert sum(d["prompts"] for d in two["per_domain_detail"].values()) == 2 * len(PROMPTS)
    seed1 = _eval(files, tmp_path, "--temperature", "1.0", "--seed", "1")
    assert two["counts"]["steps"] == one["counts"]["steps"] + seed1["counts"]["steps"]  # seed 0's runs, then seed 1's
    assert two["mean_accepted_length_se"] is not None
    with pytest.raises(SystemExit, match="--seeds"):
        _eval(files, tmp_path, "--seeds", "2")  # greedy: no seed changes anything


def test_hybrid_reports_its_choices_per_domain_and_prompt(files, tmp_path):
    """``--proposer hybrid --drafter DIR``: τ, and how often each source was chosen and its τ, overall, per domain and
    per prompt; the counts add up to the steps, and the reference loop measures what the engine measures."""
    from reference.checkpoint import save_drafter
    from reference.target import Target
    from reference.testing import tiny_drafter

    target_dir, pf = files
    ckpt = tmp_path / "drafter"
    save_drafter(tiny_drafter(Target.load(str(target_dir)), gamma=GAMMA, noise=0.2), ckpt)
    out = tmp_path / "hybrid.json"
    argv = ["--proposer", "hybrid", "--drafter", str(ckpt), "--prompts-file", str(pf), "--model", str(target_dir),
            "--device", "cpu", "--max-new-tokens", "16", "--temperature", "1.0", "--hybrid-prior-accept", "0.8",
            "--json", str(out)]
    assert eval_acceptance.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["proposer"] == "hybrid" and r["drafter_config"]["kind"] == "hybrid"
    assert r["drafter_config"]["prior_accept"] == 0.8 and r["drafter_config"]["max_n"] == 3
    steps = r["counts"]["steps"]
    assert set(r["sources"]) == {"dspark", "ngram"}, "the code prompts repeat: both sources must be chosen"
    assert sum(s["steps"] for s in r["sources"].values()) == steps
    assert sum(s["share"] for s in r["sources"].values()) == pytest.approx(1.0)
    pooled = sum(s["mean_accepted_length"] * s["steps"] for s in r["sources"].values()) / steps
    assert pooled == pytest.approx(r["mean_accepted_length"], abs=1e-6)  # τ splits by source
    for domain, detail in r["per_domain_detail"].items():
        rows = [p for p in r["per_prompt"] if p["domain"] == domain]
        assert sum(s["steps"] for s in detail["sources"].values()) == detail["steps"] == sum(p["steps"] for p in rows)
    assert len(r["per_prompt"]) == len(PROMPTS) and [p["domain"] for p in r["per_prompt"]] == [d for _, d in PROMPTS]
    assert all(sum(s["steps"] for s in p["sources"].values()) == p["steps"] for p in r["per_prompt"])
    ref_out = tmp_path / "hybrid-ref.json"
    assert eval_acceptance.main([*argv[:-1], str(ref_out), "--engine", "reference"]) == 0
    ref = json.loads(ref_out.read_text())
    assert ref["per_domain_detail"] == r["per_domain_detail"] and ref["per_prompt"] == r["per_prompt"]
    with pytest.raises(SystemExit, match="not both"):  # the hybrid drafts with the trained drafter too
        eval_acceptance.main(["--proposer", "hybrid", "--prompts-file", str(pf), "--model", str(target_dir),
                              "--json", str(tmp_path / "x.json")])
