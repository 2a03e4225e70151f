"""The training-scaling report on the CPU: ``train_drafter`` on one rank and on two (torchrun, gloo), then
``scripts/report_training_scaling.py`` over both (docs/method.md §2 for the step being measured).

The tiny random target and self-distilled data of ``tests/scripts/test_pipeline.py``, smaller; one thread, as there.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import make_dataset, report_training_scaling, train_drafter
from tests.scripts.test_pipeline import GAMMA, VOCAB, _tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread", "torch_kernels")

STEPS, LOG_EVERY = 6, 1


@pytest.fixture(scope="module", autouse=True)
def torch_kernels():
    """The engine that make_dataset runs uses its torch kernels, not the Triton interpreter (as in test_pipeline)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny target and a self-distilled dataset of 24 prompts × 2 temperatures."""
    root = tmp_path_factory.mktemp("scaling")
    _tiny_llama().save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(24):
            ids = torch.randint(2, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            f.write(json.dumps({"id": f"p{i}", "input_ids": ids}) + "\n")
    assert make_dataset.main(["--out", str(root / "data"), "--model", str(root / "target"), "--prompt-ids",
                              str(root / "prompts.jsonl"), "--max-new-tokens", "24", "--shard-size", "16",
                              "--batch-size", "8", "--device", "cpu"]) == 0
    return root


def _train_args(root: Path, out: str, tokens: int = 256) -> list[str]:
    # Evaluations and saves far apart, as in scripts/reproduce/training_scaling_h200.sh: every interval but the
    # first measures training alone.
    return ["--data", str(root / "data"), "--eval-examples", "8", "--out", str(root / out), "--model",
            str(root / "target"), "--device", "cpu", "--steps", str(STEPS), "--tokens-per-batch", str(tokens),
            "--gamma", str(GAMMA), "--markov-rank", "16", "--log-every", str(LOG_EVERY), "--eval-every", "1000",
            "--save-every", "1000", "--no-resume"]


@pytest.fixture(scope="module")
def runs(workdir):
    """Run directories: one rank in-process, two ranks under torchrun, and one rank at twice the per-rank batch."""
    assert train_drafter.main(_train_args(workdir, "scale-1")) == 0
    assert train_drafter.main(_train_args(workdir, "scale-1-big", tokens=512)) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29531", "-m", "scripts.train_drafter", *_train_args(workdir, "scale-2")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: workdir / name for name in ("scale-1", "scale-1-big", "scale-2")}


def _report(tmp_path: Path, *pairs: str) -> dict:
    out = tmp_path / "training-scaling"
    args = [x for pair in pairs for x in ("--run", pair)]
    assert report_training_scaling.main([*args, "--out", str(out), "--note", "CPU test"]) == 0
    return json.loads(out.with_suffix(".json").read_text())


def _median_after_first(run: Path) -> float:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["slot_predictions_per_s"] for r in recs if r["event"] == "train"][1:])


def test_report_on_one_and_two_ranks(runs, tmp_path):
    rep = _report(tmp_path, f"2={runs['scale-2']}", f"1={runs['scale-1']}")
    assert (tmp_path / "training-scaling.png").stat().st_size > 10_000
    assert rep["note"] == "CPU test" and rep["scaling"] == "weak" and rep["backend"] == "gloo"
    assert rep["hardware"].startswith("CPU") and rep["tokens_per_batch_per_rank"] == 256 and rep["gamma"] == GAMMA
    assert rep["software"]["torch"] == torch.__version__
    one, two = rep["results"]  # sorted by GPU count
    for r in (one, two):
        for key in ("gpus", "slot_predictions_per_s", "per_gpu", "efficiency", "steps", "median_step_s"):
            assert key in r, key
        assert r["steps"] == STEPS and r["intervals"] == STEPS // LOG_EVERY - 1  # the first interval left out
        assert r["median_step_s"] > 0 and r["summary_slot_predictions_per_s"] > 0
    assert one["gpus"] == 1 and one["efficiency"] == 1.0 and one["per_gpu"] == one["slot_predictions_per_s"]
    assert two["gpus"] == 2 and json.loads((runs["scale-2"] / "summary.json").read_text())["world_size"] == 2
    assert two["slot_predictions_per_s"] == pytest.approx(_median_after_first(runs["scale-2"]))
    assert one["slot_predictions_per_s"] == pytest.approx(_median_after_first(runs["scale-1"]))
    assert two["per_gpu"] == pytest.approx(two["slot_predictions_per_s"] / 2)
    assert two["efficiency"] == pytest.approx(two["slot_predictions_per_s"] / (2 * one["slot_predictions_per_s"]))
    assert rep["commands"][0].startswith("python -m scripts.train_drafter ")
    assert rep["commands"][1].startswith("torchrun --nproc-per-node 2 -m scripts.train_drafter ")


def test_report_refuses_a_mislabelled_run(runs, tmp_path):
    with pytest.raises(SystemExit, match="world_size 2 rank.*not 4"):
        _report(tmp_path, f"1={runs['scale-1']}", f"4={runs['scale-2']}")
    with pytest.raises(SystemExit, match="number of GPUs"):
        _report(tmp_path, f"one={runs['scale-1']}")


def test_report_refuses_mismatched_per_rank_batches(runs, tmp_path):
    # 1 rank × 512 tokens against 2 ranks × 256: the same global batch, not a weak-scaling pair.
    with pytest.raises(SystemExit, match="per-rank batches differ.*1: 512, 2: 256"):
        _report(tmp_path, f"1={runs['scale-1-big']}", f"2={runs['scale-2']}")
    with pytest.raises(SystemExit, match="no one-GPU run"):
        _report(tmp_path, f"2={runs['scale-2']}")


def test_intervals_leave_out_start_up_evaluations_saves_and_earlier_invocations():
    def rec(step: int, elapsed: float, sps: float) -> dict:
        return {"event": "train", "step": step, "elapsed_s": elapsed, "slot_predictions_per_s": sps}

    old = [rec(2, 1.0, 1.0), rec(4, 2.0, 1.0)]  # an earlier invocation appended to the same metrics.jsonl
    new = [rec(2, 5.0, 10.0), rec(4, 6.0, 20.0), rec(6, 9.0, 30.0), rec(8, 10.0, 40.0), rec(10, 11.0, 50.0)]
    records = report_training_scaling.last_invocation(old + new)
    assert records == new
    kept = report_training_scaling.interval_throughputs(records, log_every=2, eval_every=4, save_every=8)
    # (0, 2] is start-up, (4, 6] follows the evaluation at step 4, (8, 10] the save at step 8.
    assert kept == [{"steps": 2, "seconds": 1.0, "slot_predictions_per_s": 20.0},
                    {"steps": 2, "seconds": 1.0, "slot_predictions_per_s": 40.0}]
