"""``scripts/profile_engine.py`` on the CPU with a tiny random target: the report's layout and its accounting."""

from __future__ import annotations

import json

import pytest

from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import profile_engine

PROMPTS = [[5, 6, 7, 8], [9, 2], [3, 3, 4, 10, 11, 12]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = Target.from_model(tiny_hf_model("llama", num_layers=2), name="tiny-llama")
    return target, tiny_drafter(target, gamma=3, markov_rank=8)


@pytest.mark.parametrize("mode", ["none", "fixed:2", "adaptive"])
def test_profile_report(models, tmp_path, mode):
    target, drafter = models
    out = tmp_path / "profile.json"
    report = profile_engine.main(["--mode", mode, "--batch-size", "2", "--steps", "3", "--warmup", "1",
                                  "--context-len", "16", "--cost-cache-dir", str(tmp_path / "cost"),
                                  "--out", str(out), "--trace", str(tmp_path / "trace.json")],
                                 target=target, drafter=drafter, prompt_ids=PROMPTS)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["settings"]["mode"] == mode and report["model"] == "tiny-llama"
    assert len(report["step_ms_all"]) == 3 and report["step_ms_median"] > 0
    prof = report["profile"]
    assert prof["kernel_launches_per_step"] == 0 and prof["graph_launches_per_step"] == 0  # CPU: no device work
    host = prof["top_by_host_time"]
    assert host and all(r["self_host_ms_per_step"] >= 0 and r["calls_per_step"] > 0 for r in host)
    assert host == sorted(host, key=lambda r: r["self_host_ms_per_step"], reverse=True)
    assert prof["device_ms_per_step"] == 0 and prof["top_by_device_time"] == []
    assert (tmp_path / "trace.json").is_file()
    if mode != "none":
        assert report["mean_accepted_length"] >= 1.0


def test_profile_rejects_bad_arguments(models):
    target, drafter = models
    with pytest.raises(SystemExit):
        profile_engine.main(["--steps", "0"], target=target, drafter=drafter, prompt_ids=PROMPTS)
    with pytest.raises(ValueError, match="unknown benchmark mode"):
        profile_engine.main(["--mode", "sometimes"], target=target, drafter=drafter, prompt_ids=PROMPTS)


def test_profile_refill_splits_the_steps_that_prefill(models, tmp_path):
    """--refill: requests of 2-4 tokens behind a batch of 2 keep admitting prompts, so some timed steps prefill and
    some do not; every added request is accounted for in τ."""
    target, drafter = models
    report = profile_engine.main(["--mode", "fixed:2", "--batch-size", "2", "--steps", "12", "--warmup", "1",
                                  "--refill", "4", "--context-len", "16", "--cost-cache-dir", str(tmp_path / "cost")],
                                 target=target, drafter=drafter, prompt_ids=PROMPTS)
    r = report["refill"]
    assert report["settings"]["refill"] == 4 and r["tokens"] == 4
    assert 0 < r["prefill_step_fraction"] < 1
    assert r["step_ms_median_with_prefill"] > 0 and r["step_ms_median_without_prefill"] > 0
    assert r["prefill_stage_ms_median"] > 0 and len(report["step_ms_all"]) == 12
    assert report["mean_accepted_length"] >= 1.0
    with pytest.raises(SystemExit):
        profile_engine.main(["--refill", "-1"], target=target, drafter=drafter, prompt_ids=PROMPTS)


def test_profile_keep_drafter_runs_plain_steps_of_a_drafting_engine(models, tmp_path, monkeypatch):
    """--keep-drafter with mode none: the drafter is attached, every step is plain and parks its features for the
    drafter's context (the steps a drafting engine takes while its gate is closed); without it, no drafter."""
    target, drafter = models
    built = []
    real = profile_engine.build_engine
    monkeypatch.setattr(profile_engine, "build_engine", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    args = ["--mode", "none", "--batch-size", "2", "--steps", "3", "--warmup", "1", "--context-len", "16",
            "--cost-cache-dir", str(tmp_path / "cost")]
    report = profile_engine.main(args + ["--keep-drafter"], target=target, drafter=drafter, prompt_ids=PROMPTS)
    runner = built[-1].runner
    assert report["settings"]["keep_drafter"] and runner.drafter is not None
    assert runner.context_lag and any(runner._lag)  # plain steps parked their features
    assert report["mean_accepted_length"] == 1.0
    profile_engine.main(args, target=target, drafter=drafter, prompt_ids=PROMPTS)
    assert built[-1].runner.drafter is None


def test_dot_tiles_flag_installs_a_table_for_the_run_only(models, tmp_path, monkeypatch):
    from optimized.kernels import linear
    target, drafter = models
    table = {kind: dict(tile, split_k=2) for kind, tile in linear.DOT_TILES.items()}
    (tmp_path / "tiles.json").write_text(json.dumps(table))
    in_force, seen = linear.DOT_TILES, []
    run_profile = profile_engine.run_profile

    def spy(*args, **kwargs):  # the table in force while the engine runs
        seen.append(linear.DOT_TILES)
        return run_profile(*args, **kwargs)

    monkeypatch.setattr(profile_engine, "run_profile", spy)
    report = profile_engine.main(["--mode", "fixed:2", "--batch-size", "1", "--steps", "1", "--warmup", "0",
                                  "--context-len", "16", "--cost-cache-dir", str(tmp_path / "cost"),
                                  "--dot-tiles", str(tmp_path / "tiles.json")],
                                 target=target, drafter=drafter, prompt_ids=PROMPTS[:1])
    assert seen == [table] and report["settings"]["dot_tiles"] == table
    assert linear.DOT_TILES is in_force  # put back after the run
    (tmp_path / "bad.json").write_text(json.dumps({"norm": {}}))
    with pytest.raises(ValueError, match="kinds norm, gated and plain"):
        profile_engine.main(["--mode", "none", "--dot-tiles", str(tmp_path / "bad.json")],
                            target=target, drafter=drafter, prompt_ids=PROMPTS[:1])
    assert linear.DOT_TILES is in_force
