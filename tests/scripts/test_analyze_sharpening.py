"""``scripts/analyze_sharpening.py``: the per-slot overlap Σ_v min(p_t, q_s) of sharpened proposals, and a run.

The tally is checked against a brute-force loop over rows and slots; the script runs end to end on a tiny random
target and a tiny drafter saved to disk (no download), and refuses greedy decoding (one-hot drafts).
"""

from __future__ import annotations

import json

import pytest
import torch

from reference.checkpoint import save_drafter
from reference.target import Target
from reference.testing import tiny_drafter, tiny_hf_model
from scripts import analyze_sharpening
from scripts.analyze_sharpening import SharpeningTally

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tally_matches_a_brute_force_loop():
    torch.manual_seed(0)
    R, g, V = 5, 4, 11
    draft = torch.softmax(torch.randn(R, g, V) * 2, -1)
    target = torch.softmax(torch.randn(R, g + 1, V) * 2, -1)
    lens, accepted = torch.tensor([4, 2, 0, 3, 4]), torch.tensor([1, 2, 0, 0, 4])
    tally = SharpeningTally((0.5, 1.0, 2.0), g)
    tally.add(draft, target, lens, accepted)
    want = torch.zeros(3, g, dtype=torch.float64)
    counts = torch.zeros(g)
    for r in range(R):
        for k in range(g):
            if k <= accepted[r] and k < lens[r]:  # the prefix was accepted and the slot verified
                counts[k] += 1
                for i, s in enumerate((0.5, 1.0, 2.0)):
                    q = draft[r, k].double() ** (1 / s)
                    want[i, k] += torch.minimum(q / q.sum(), target[r, k].double()).sum()
    assert torch.equal(tally.counts, counts.double())
    assert torch.allclose(tally.sums, want, atol=1e-12)
    rows = tally.report()
    a = [want[1, k] / counts[k] for k in range(g)]
    assert rows[1]["per_slot"] == pytest.approx([x.item() for x in a])
    assert rows[1]["tau_estimate"] == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2]
                                                    + a[0] * a[1] * a[2] * a[3])
    with pytest.raises(ValueError, match="positive"):
        SharpeningTally((0.0,), g)


def test_the_script_runs_end_to_end(tmp_path):
    hf = tiny_hf_model("llama", num_layers=2)
    hf.save_pretrained(tmp_path / "target")
    target = Target.load(str(tmp_path / "target"))
    save_drafter(tiny_drafter(target, gamma=3), tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([5, 6, 7], [9, 2], [3, 40, 41])))
    out = tmp_path / "s.json"
    assert analyze_sharpening.main(["--drafter", str(tmp_path / "drafter"), "--prompts-file", str(prompts),
                                    "--model", str(tmp_path / "target"), "--device", "cpu", "--max-new-tokens", "12",
                                    "--factors", "0.5,1.0", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prompts"] == 3 and [f["factor"] for f in r["factors"]] == [0.5, 1.0]
    assert r["slots_evaluated"][0] > 0 and all(0.0 <= a <= 1.0 for f in r["factors"] for a in f["per_slot"] if a)
    with pytest.raises(SystemExit, match="temperature"):
        analyze_sharpening.main(["--drafter", str(tmp_path / "drafter"), "--prompts-file", str(prompts),
                                 "--temperature", "0"])
