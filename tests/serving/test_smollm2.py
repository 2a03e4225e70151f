"""The real default target behind the server: SmolLM2-135M-Instruct and the shipped drafter, with the server's
defaults (no --model, no --drafter, adaptive verification, CPU), against ``python -m optimized.generate``.

A synthetic cost table is given to both (``--cost-table``), so neither spends start-up profiling the CPU; it
changes verify lengths only, never greedy tokens.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.serving.conftest import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
PROMPT = "Name three planets."


@pytest.fixture(scope="module")
def cost_table(tmp_path_factory):
    from reference.cost_model import CostTable

    path = tmp_path_factory.mktemp("cost") / "cost.json"
    # Up to 8 slots × (γ + 1) = 64 verify tokens; 20 ms + 1 ms per token is the shape of the CPU's curve.
    CostTable.affine(fixed_ms=20.0, per_token_ms=1.0, draft_fixed_ms=10.0, sizes=list(range(1, 65))).save(path)
    return path


def test_smollm2_server_equals_generate(smollm2_target, cost_table, tmp_path, capsys, monkeypatch):
    # Defaults but two: 2 slots of 256 positions instead of 8 of 2,048 (a faster start on the shared CI cores).
    server = LiveServer(["--cost-table", str(cost_table), "--max-num-seqs", "2", "--max-model-len", "256"], None,
                        tmp_path / "server.log")  # DSPARK_CACHE unchanged: the dequantized weights are cached there
    try:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        kw = dict(model="smollm2-135m-instruct", messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                  temperature=0)
        full = client.chat.completions.create(**kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        assert "mode adaptive, γ = 7, 2 slots, max model len 256, cpu float32" in server.log.read_text()
    finally:
        assert server.stop() == 0
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CLI on the torch kernels, as the server runs
    from optimized.generate import main as generate_main

    capsys.readouterr()
    assert generate_main(["--prompt", PROMPT, "--max-new-tokens", "12", "--json", "--cost-table", str(cost_table),
                          "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out.splitlines()[0])
    assert full.choices[0].message.content == streamed == cli["text"]
    assert full.usage.completion_tokens == len(cli["token_ids"])
    assert full.usage.prompt_tokens == len(smollm2_target.encode(PROMPT))


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
