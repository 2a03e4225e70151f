"""The real default target behind the server: SmolLM2-135M-Instruct and the shipped drafter, with the server's
defaults (no --model, no --drafter, adaptive verification, CPU), against the target's own greedy decoding (the tiny
model's tests compare with ``python -m optimized.generate`` too).

A synthetic cost table is given (``--cost-table``), so start-up does not profile the CPU; it changes verify lengths
only, never greedy tokens.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.serving.conftest import server_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
PROMPT = "Name three planets."


@pytest.fixture(scope="module")
def cost_table(tmp_path_factory):
    from reference.cost_model import CostTable

    path = tmp_path_factory.mktemp("cost") / "cost.json"
    # Up to 8 slots × (γ + 1) = 64 verify tokens; 20 ms + 1 ms per token is the shape of the CPU's curve.
    CostTable.affine(fixed_ms=20.0, per_token_ms=1.0, draft_fixed_ms=10.0, sizes=list(range(1, 65))).save(path)
    return path


def test_smollm2_server_serves_the_targets_greedy_text(smollm2_target, cost_table, tmp_path, monkeypatch):
    """Started the way ``scripts/bench_serving.py --launch`` starts it (its LaunchedServer: the command line, the
    wait for /health, SIGTERM at the end), queried by the openai client and by the benchmark itself."""
    import torch

    from scripts import bench_serving

    for key, value in server_env(None).items():  # DSPARK_CACHE unchanged: the dequantized weights are cached there
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the server on the torch kernels (see conftest.py)
    # Defaults but two: 2 slots of 256 positions instead of 8 of 2,048 (a faster start on the shared CI cores).
    server = bench_serving.LaunchedServer(bench_serving.Mode.parse("adaptive"),
                                          ["--cost-table", str(cost_table), "--max-num-seqs", "2",
                                           "--max-model-len", "256"], tmp_path / "server.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        kw = dict(model="smollm2-135m-instruct", messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                  temperature=0)
        full = client.chat.completions.create(**kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
        report = bench_serving.main(["--base-url", server.url, "--concurrency", "1", "--output-len", "4",
                                     "--min-requests", "1", "--prompts-per-user", "1", "--prompts-file", str(prompts)])
        log = server.log_path.read_text()
        assert "mode adaptive, γ = 7, 2 slots, max model len 256, cpu float32" in log
    finally:
        server.stop()
    assert server.proc.returncode == 0 and "drained" in server.log_path.read_text()
    assert report["results"][0]["requests"] == 1 and report["results"][0]["errors"] == 0
    # The target alone, argmax after argmax (what every mode must emit at T = 0).
    ids, new = smollm2_target.encode(PROMPT), []
    with torch.no_grad():
        while len(new) < 12 and not (new and new[-1] in smollm2_target.eos_token_ids):
            new.append(int(smollm2_target.model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    assert full.choices[0].message.content == streamed == smollm2_target.decode(new)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(ids), len(new))


def test_text_stream_matches_a_full_decode(smollm2_target):
    """Byte-level BPE splits characters across tokens (accents, CJK, emoji): the incremental text, fed one token
    at a time or in uneven steps, equals one decode of all the ids."""
    from optimized.serving.text import TextStream

    tok = smollm2_target.tokenizer
    text = "Café naïve — 日本語のテキスト 🚀🎉 done.\nNext line: ∑ x² ≥ 0"
    ids = tok(text)["input_ids"]
    for step in (1, 2, 3, 7):
        stream, out = TextStream(tok), []
        for i in range(0, len(ids), step):
            out.append(stream.add(ids[i:i + step], finished=i + step >= len(ids)))
        assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in piece for piece in out)
