"""scripts/draft_vocab.py: the draft vocabulary chosen from the responses of a self-distilled dataset."""

from __future__ import annotations

import json

import pytest
import torch

from reference.checkpoint import load_drafter, save_drafter
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import dataset, draft_vocab


def write_data(directory, prompts, responses, vocab_size):
    directory.mkdir(parents=True)
    shard = dataset.pack_shard([str(i) for i in range(len(prompts))], prompts, responses, vocab_size)
    dataset.write_shard(directory / dataset.shard_name(0), shard, num_prompts=len(prompts), wall_s=0.0)


def test_counts_responses_only_and_keeps_the_most_frequent(tmp_path):
    # Prompts are full of token 50, which no response holds: it must not be counted. Responses: 7 ×5, 3 ×3, 9 ×3
    # (a tie: 3 goes first), 11 once.
    write_data(tmp_path / "train", [[50] * 20, [50] * 9], [[7, 7, 7, 3, 9, 11], [7, 7, 3, 3, 9, 9]], 64)
    counts = draft_vocab.response_counts(tmp_path / "train", 64)
    assert counts[50] == 0 and counts[7] == 5 and counts[3] == 3 and counts[9] == 3 and counts[11] == 1
    assert draft_vocab.choose(counts, 2, []).tolist() == [3, 7]  # ascending ids; the 3 / 9 tie to the lower id
    assert draft_vocab.choose(counts, 3, [60]).tolist() == [3, 7, 60]  # --always first, then by count
    assert draft_vocab.coverage(counts, torch.tensor([3, 7])) == pytest.approx(8 / 12)
    with pytest.raises(SystemExit, match="--size"):
        draft_vocab.choose(counts, 65, [])


def test_writes_a_restricted_checkpoint_and_report(tmp_path):
    target = Target.from_model(tiny_hf_model("llama", num_layers=2))
    drafter = tiny_drafter(target, gamma=3)
    save_drafter(drafter, tmp_path / "src")
    v = drafter.config.vocab_size
    write_data(tmp_path / "train", [[1, 2]] * 3, [[5, 6, 6], [6, 8, 8], [9, 6, 5]], v)
    write_data(tmp_path / "heldout", [[1, 2]], [[6, 6, 13]], v)
    rc = draft_vocab.main(["--data", str(tmp_path / "train"), "--heldout-data", str(tmp_path / "heldout"),
                           "--size", "4", "--report-sizes", "2,4", "--drafter", str(tmp_path / "src"),
                           "--out", str(tmp_path / "out"), "--json", str(tmp_path / "vocab.json")])
    assert rc == 0
    report = json.loads((tmp_path / "vocab.json").read_text())
    assert report["ids"] == [5, 6, 8, 9] and report["response_tokens"] == 9
    assert report["sizes"] == [{"size": 2, "coverage_train": round(6 / 9, 5), "coverage_heldout": round(2 / 3, 5)},
                               {"size": 4, "coverage_train": 1.0, "coverage_heldout": round(2 / 3, 5)}]
    restricted = load_drafter(tmp_path / "out", target)
    assert restricted.draft_vocab.tolist() == [5, 6, 8, 9]
    source = load_drafter(tmp_path / "src", target)
    kept = {k: t for k, t in restricted.state_dict().items() if k != "draft_vocab"}
    assert all(torch.equal(t, kept[k]) for k, t in source.state_dict().items())  # the same weights


def test_bad_arguments_fail_fast(tmp_path):
    with pytest.raises(SystemExit):
        draft_vocab.main(["--data", str(tmp_path), "--out", str(tmp_path / "x"), "--vocab-size", "10"])
    with pytest.raises(SystemExit, match="no dataset shards"):
        draft_vocab.main(["--data", str(tmp_path), "--vocab-size", "10"])
