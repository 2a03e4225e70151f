"""The training pipeline end to end on a tiny random target: data → self-distillation → training → STS → τ.

Covers ``scripts/data.py``, ``make_dataset.py``, ``train_drafter.py``, ``calibrate.py`` and ``eval_acceptance.py``
(docs/method.md §2, §3). Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival,
``ℓ`` verify length). Everything runs on the CPU with one thread: the tiny matmuls are faster single-threaded,
and a shared 2-core machine makes multi-threaded BLAS spin.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference.calibration import apply_sts, prefix_survival
from reference.checkpoint import load_drafter
from reference.losses import teacher_rows
from reference.target import Target
from scripts import calibrate, data, dataset, eval_acceptance, make_dataset, quantize_drafter, train_drafter

GAMMA = 4
VOCAB = 96
EOS = 1
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread", "torch_kernels")


@pytest.fixture(scope="module", autouse=True)
def torch_kernels():
    """The engine inside the scripts runs its torch kernels, not the Triton interpreter (``kernel_backend="auto"``
    reads ``TRITON_INTERPRET``): these tests are about the pipeline; the kernels' equivalence is tested on its own
    (tests/equivalence), and interpreting them here would only make the pipeline tests several times slower."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield


def _tiny_llama():
    """A random Llama whose outputs are peaked but not degenerate.

    Untied embeddings: with tied ones a random model mostly repeats its input token (h ≈ E[x], logits = E·h).
    The LM head is scaled so that greedy decoding has clear winners and T = 0.2 sampling is nearly greedy.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny target directory, a prompt-ids file and a self-distilled dataset built by make_dataset.main."""
    root = tmp_path_factory.mktemp("pipeline")
    _tiny_llama().save_pretrained(root / "target")
    g = torch.Generator().manual_seed(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(40):
            n = int(torch.randint(3, 12, (1,), generator=g))
            ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
            f.write(json.dumps({"id": f"p{i}", "input_ids": ids}) + "\n")
    rc = make_dataset.main(["--out", str(root / "data"), "--model", str(root / "target"), "--prompt-ids",
                            str(root / "prompts.jsonl"), "--max-new-tokens", "24", "--shard-size", "16",
                            "--batch-size", "8", "--device", "cpu"])
    assert rc == 0
    return root


def _train_args(root: Path, out: str, *extra: str) -> list[str]:
    return ["--data", str(root / "data"), "--eval-examples", "8", "--out", str(root / out), "--model",
            str(root / "target"), "--device", "cpu", "--steps", "8", "--tokens-per-batch", "256",
            "--gamma", str(GAMMA), "--markov-rank", "16", "--log-every", "2",
            "--eval-every", "4", "--save-every", "4", *extra]


@pytest.fixture(scope="module")
def trained(workdir):
    """A drafter trained for 8 steps in one go."""
    assert train_drafter.main(_train_args(workdir, "run_a")) == 0
    return workdir / "run_a"


# --------------------------------------------------------------------------- data.py


def test_iter_json_array_keeps_complete_records_of_a_truncated_file(tmp_path):
    records = [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": f"question {i}, {{x}}]"},
                                                    {"from": "gpt", "value": "answer"}]} for i in range(4)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"c3_0"') + 10]  # ends inside the 4th record
    path = tmp_path / "share.json"
    path.write_text(cut)
    prompts = data.load_sharegpt(path)
    assert [p.id for p in prompts] == ["c0_0", "c1_0", "c2_0"]
    assert prompts[1].prompt == "question 1, {x}]"  # braces and brackets inside strings do not confuse the parser
    gz = tmp_path / "share.json.gz"
    with gzip.open(gz, "wt") as f:
        f.write(text)  # a complete array, gzipped (the GPU staging format)
    assert len(data.load_sharegpt(gz)) == 4
    assert len(data.load_sharegpt(gz, limit=2)) == 2
    with pytest.raises(ValueError, match="not a JSON array"):
        list(data.iter_json_array('{"id": 1}'))


def test_packaged_sharegpt_file_parses_to_its_complete_records():
    prompts = data.load_sharegpt()
    assert 17_000 < len(prompts) < 17_671 + 1
    assert len({p.id for p in prompts}) == len(prompts)
    train, held = data.split(prompts)
    assert len(train) + len(held) == len(prompts)
    assert 0.03 < len(held) / len(prompts) < 0.07  # 3 % hashed + every math-like prompt (~2 %)
    assert not {p.id for p in train} & {p.id for p in held}
    assert all(data.is_held_out(p.id) or data.looks_like_math(p.prompt) for p in held)


def test_split_is_deterministic_and_keeps_conversation_parts_together():
    assert data.conversation_key("QWJhYvA_12") == "QWJhYvA"
    assert data.conversation_key("no_suffix_x") == "no_suffix_x"
    ids = [f"conv{i}" for i in range(4000)]
    flags = [data.is_held_out(f"{c}_0") for c in ids]
    assert flags == [data.is_held_out(f"{c}_5") for c in ids]
    # 4000 Bernoulli(0.03) draws: mean 120, sd 10.8; ±5 sd.
    assert 66 < sum(flags) < 174


def test_math_like_and_language_filters():
    assert data.looks_like_math("Solve the equation 3x + 2 = 11 for x.")
    assert data.looks_like_math("What is the integral of x^2 cos(2x)? Compute it step by step.")
    assert not data.looks_like_math("Write a poem about the 2020-02-03 parquet file.")
    assert not data.looks_like_math("```python\nx = 1 + 2\n```  calculate the sum")
    assert data.is_english("Hello, how are you?")
    assert not data.is_english("안녕하세요, 어떻게 지내세요?")
    kept = data.filter_prompts([data.Prompt("a", "Hello there"), data.Prompt("b", "   "),
                                data.Prompt("c", "你好世界"), data.Prompt("d", "x" * 50)], max_chars=20)
    assert [p.id for p in kept] == ["a"]
    with pytest.raises(ValueError, match="count_tokens"):
        data.filter_prompts([], max_tokens=5)


def test_eval_prompts_are_held_out_and_cover_three_domains(tmp_path):
    written = data.write_eval_prompts(tmp_path / "eval.jsonl", 5)
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["domain"] for r in rows] == ["chat"] * 5 + ["code"] * 5 + ["math"] * 5
    assert [r["id"] for r in rows] == [p.id for p in written]
    for r in rows:
        if r["domain"] == "code":
            assert r["id"].startswith("HumanEval/") and "```python" in r["prompt"]
        else:
            assert data.is_held_out(r["id"]) or data.looks_like_math(r["prompt"])
    assert all(data.looks_like_math(r["prompt"]) for r in rows if r["domain"] == "math")
    assert len(data.load_humaneval()) == 164


def test_eval_tasks_map_spec_bench_categories_and_add_code(tmp_path):
    """A miniature Spec-Bench file: each category lands in its task (MT-Bench's eight are one chat task, first turn
    only), HumanEval fills the code task, the tasks come in EVAL_TASKS order; a file of another kind fails."""
    rows = [{"question_id": i, "category": c, "turns": [f"{c} question {i}", "second turn"]}
            for i, c in enumerate(["writing", "coding", "translation", "summarization", "qa", "math_reasoning", "rag"])]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = data.eval_tasks(path, n_code=4)
    assert [p.domain for p in prompts] == ["chat", "chat", "code", "code", "code", "code", "math", "summarization",
                                           "context_qa", "translation", "qa"]
    assert prompts[0].prompt == "writing question 0" and prompts[0].id == "spec-bench/0"
    assert [p.id for p in prompts if p.domain == "code"] == ["HumanEval/0", "HumanEval/41", "HumanEval/82",
                                                               "HumanEval/123"]
    path.write_text(json.dumps({"prompt": "not spec-bench"}) + "\n")
    with pytest.raises(ValueError, match="not a Spec-Bench question"):
        data.eval_tasks(path)


def test_gsm8k_training_problems_become_math_prompts_and_the_test_split_is_refused(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f" How many apples, {i}? ", "answer": "#### 3"}) + "\n"
                            for i in range(3)))
    prompts = data.load_gsm8k_train(path)
    assert [(p.id, p.prompt, p.domain) for p in prompts][:1] == [("gsm8k-train/1", "How many apples, 0?", "math")]
    assert len(prompts) == 3
    (tmp_path / "test.jsonl").write_text(path.read_text())
    with pytest.raises(ValueError, match="test split"):
        data.load_gsm8k_train(tmp_path / "test.jsonl")
    assert data.main(["gsm8k-prompts", "--gsm8k", str(path), "--out", str(tmp_path / "out.jsonl")]) == 0
    assert [p.prompt for p in data.read_prompt_file(tmp_path / "out.jsonl")] == [p.prompt for p in prompts]


def test_context_prompts_use_training_texts_only(tmp_path):
    """context-prompts: long English turns become summarization and context-QA prompts, short ones and non-English
    human turns translations; held-out conversations, math-like ones and turns with code are never used, each text
    once, the same prompts on every run."""
    held = next(f"held{i}" for i in range(10_000) if data.is_held_out(f"held{i}"))
    train_ids = [f"conv{i}" for i in range(400) if not data.is_held_out(f"conv{i}")][:12]
    long_text = "The committee met on May 3, 2021 in Geneva and agreed on three measures. " * 20  # 280 words
    records = [{"id": held, "conversations": [{"from": "human", "value": long_text}]},
               {"id": train_ids[0], "conversations": [{"from": "human", "value": "Solve 3 + 4 = ? and x^2 = 9, "
                                                       "calculate the sum " + long_text}]},
               {"id": train_ids[1], "conversations": [{"from": "human", "value": "```python\n" + long_text + "```"}]}]
    for rid in train_ids[2:8]:
        records.append({"id": rid, "conversations": [{"from": "human", "value": "Tell me about the committee."},
                                                     {"from": "gpt", "value": f"{rid}: " + long_text}]})
    for rid in train_ids[8:10]:
        records.append({"id": rid, "conversations": [
            {"from": "human", "value": "Das Komitee traf sich im Mai in Genf und beschloss drei Maßnahmen für die "
                                       "Zukunft der Region, über die später berichtet wurde. " * 2 + "äöüß " * 20},
            {"from": "gpt", "value": f"{rid} " + "The committee met in Geneva and agreed on three measures. " * 3}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    prompts = data.context_prompts(path, per_task=10)
    by_task = {t: [p for p in prompts if p.domain == t] for t in data.CONTEXT_TASKS}
    assert len(by_task["summarization"]) == 3 and len(by_task["context_qa"]) == 3  # 6 long texts, split in two
    assert len(by_task["translation"]) == 4  # 2 German human turns into English, 2 short English answers out of it
    assert sum("into English" in p.prompt for p in by_task["translation"]) == 2
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids) and not any(held in i or train_ids[0] in i or train_ids[1] in i for i in ids)
    assert all(long_text.strip() in p.prompt for p in by_task["summarization"] + by_task["context_qa"])
    assert data.context_prompts(path, per_task=10) == prompts, "deterministic"
    assert data.context_prompts(path, per_task=1, seed=1)[0].domain == "summarization"
    assert data.main(["context-prompts", "--sharegpt-file", str(path), "--per-task", "2", "--out",
                      str(tmp_path / "ctx.jsonl")]) == 0
    assert [p.domain for p in data.read_prompt_file(tmp_path / "ctx.jsonl")] == ["summarization"] * 2 + [
        "context_qa"] * 2 + ["translation"] * 2


def test_make_dataset_takes_a_text_prompts_file_but_never_an_evaluation_set(tmp_path):
    """--prompts-file: text prompts chat-templated by the target, the length filter and --limit applied in order;
    a file under docs/benchmarks/ (the evaluation sets) and two prompt sources at once are refused."""
    from types import SimpleNamespace

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x " * n, "id": f"q{n}"}) + "\n" for n in (2, 50, 3, 4)))
    target = SimpleNamespace(encode=lambda text, chat_template: [7] * (len(text.split()) + 3))
    args = make_dataset.build_parser().parse_args(["--out", "o", "--prompts-file", str(path), "--max-prompt-tokens",
                                                   "10", "--limit", "2"])
    assert make_dataset.tokenised_prompts(args, target) == [("q2", [7] * 5), ("q3", [7] * 6)]
    assert make_dataset.settings_split(args) == "prompts-file:prompts.jsonl"
    with pytest.raises(SystemExit):
        make_dataset.main(["--out", str(tmp_path / "o"), "--prompts-file", str(ROOT / "docs" / "benchmarks" /
                                                                                "eval_tasks.jsonl")])
    with pytest.raises(SystemExit):
        make_dataset.main(["--out", str(tmp_path / "o"), "--prompts-file", str(path), "--prompt-ids", str(path)])


def test_committed_eval_tasks_file_has_every_task():
    rows = [json.loads(line) for line in (ROOT / "docs" / "benchmarks" / "eval_tasks.jsonl").read_text().splitlines()]
    counts = {t: sum(r["domain"] == t for r in rows) for t in data.EVAL_TASKS}
    assert all(n >= 30 for n in counts.values()), counts
    assert len({r["id"] for r in rows}) == len(rows)


# --------------------------------------------------------------------------- make_dataset.py


def test_engine_generation_equals_one_by_one_greedy_decoding():
    from optimized.engine import Engine, EngineConfig, SamplingParams
    from reference.config import SchedulerConfig

    model = _tiny_llama()
    target = Target.from_model(model)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 12, (6,), generator=g).tolist()
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
    engine = Engine(target, None, EngineConfig(max_num_seqs=4, max_seq_len=32), SchedulerConfig(mode="none"))
    got = make_dataset.engine_responses(engine, prompts, [SamplingParams(max_new_tokens=10)] * 6, list(range(6)),
                                        frozenset({EOS}))
    for p, out in zip(prompts, got):
        ids, want = list(p), []
        for _ in range(10):  # plain greedy decoding without padding or cache
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            want.append(nxt)
            ids.append(nxt)
            if nxt == EOS:
                break
        assert out == want


def _shard(path: Path):
    tensors, meta = dataset.read_shard(path)
    return tensors, json.loads(meta["ids"])


def test_shards_hold_prompt_plus_response_with_the_response_mask(workdir):
    manifest = json.loads((workdir / "data" / "manifest.json").read_text())
    assert manifest["num_shards"] == 3 and manifest["complete"] and manifest["prompts"] == 40
    assert manifest["settings"]["temperatures"] == [0.0, 1.0] and manifest["settings"]["top_p"] == 1.0
    prompts = {json.loads(line)["id"]: json.loads(line)["input_ids"]
               for line in (workdir / "prompts.jsonl").read_text().splitlines()}
    examples = dataset.load_dataset(workdir / "data")
    assert len(examples) == manifest["examples"] and sum(int(e.loss_mask.sum()) for e in examples) == \
        manifest["response_tokens"]
    assert {e.id.rsplit("@", 1)[1] for e in examples} == {"0", "1"}  # one response per temperature
    greedy = {}
    for e in examples:
        pid, temp = e.id.rsplit("@", 1)
        p = prompts[pid]
        assert torch.equal(e.input_ids[: len(p)], torch.tensor(p))
        assert torch.equal(e.loss_mask, torch.arange(len(e.input_ids)) >= len(p))  # 1 exactly on the response
        response = e.input_ids[len(p):].tolist()
        assert len(response) >= 2 and EOS not in response[:-1]  # cut after the first end token, which is kept
        assert response[-1] == EOS or len(response) == 24
        if temp == "0":  # settings["temperatures"][0] = 0: greedy
            greedy[pid] = response
    assert len(greedy) > 20
    tensors, _ = _shard(workdir / "data" / dataset.shard_name(0))
    assert tensors["tokens"].dtype == torch.uint16  # a 96-token vocabulary fits in 16 bits


def test_make_dataset_resumes_by_skipping_finished_shards(workdir, tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    tensors, ids = _shard(workdir / "data" / dataset.shard_name(0))
    dataset.write_shard(out / dataset.shard_name(0), {**tensors, "ids": ["sentinel"] * len(ids)}, num_prompts=16,
                        wall_s=1.0)  # a recognisable, finished shard 0
    args = ["--out", str(out), "--model", str(workdir / "target"), "--prompt-ids", str(workdir / "prompts.jsonl"),
            "--max-new-tokens", "24", "--shard-size", "16", "--batch-size", "8", "--device", "cpu"]
    assert make_dataset.main(args) == 0
    assert _shard(out / dataset.shard_name(0))[1][0] == "sentinel"  # not regenerated
    for i in (1, 2):  # regenerated from the same (seed, request id) keys: identical to the first run
        (a, ida), (b, idb) = _shard(out / dataset.shard_name(i)), _shard(workdir / "data" / dataset.shard_name(i))
        assert torch.equal(a["tokens"], b["tokens"]) and ida == idb


def test_make_dataset_is_independent_of_the_batch_size(workdir, tmp_path):
    """The random-number contract: sampled responses depend on (seed, request id, position), not on batching."""
    out = tmp_path / "data"
    args = ["--out", str(out), "--model", str(workdir / "target"), "--prompt-ids", str(workdir / "prompts.jsonl"),
            "--max-new-tokens", "24", "--shard-size", "16", "--batch-size", "3", "--device", "cpu", "--limit", "16",
            "--prompts-out", str(tmp_path / "selected.jsonl")]
    assert make_dataset.main(args) == 0
    (a, ida), (b, idb) = _shard(out / dataset.shard_name(0)), _shard(workdir / "data" / dataset.shard_name(0))
    assert ida == idb and torch.equal(a["tokens"], b["tokens"])
    # --prompts-out: the prompts that were answered, in order, in the evaluation scripts' prompt-file format.
    given = [json.loads(x) for x in (workdir / "prompts.jsonl").read_text().splitlines()][:16]
    selected = [json.loads(x) for x in (tmp_path / "selected.jsonl").read_text().splitlines()]
    assert [(x["id"], x["input_ids"]) for x in selected] == [(x["id"], x["input_ids"]) for x in given]
    assert {x["domain"] for x in selected} == {"prompt-ids"}
    assert {f"{x['id']}@0" for x in selected} <= set(ida)  # the dataset's example ids name these prompts


def test_make_dataset_time_budget_stops_between_shards_and_rerun_completes(workdir, tmp_path):
    out = tmp_path / "data"
    args = ["--out", str(out), "--model", str(workdir / "target"), "--prompt-ids", str(workdir / "prompts.jsonl"),
            "--max-new-tokens", "24", "--shard-size", "16", "--batch-size", "8", "--device", "cpu"]
    assert make_dataset.main([*args, "--time-budget-s", "0"]) == 0  # the budget is spent by the model load
    manifest = json.loads((out / make_dataset.MANIFEST).read_text())
    assert not manifest["complete"] and manifest["shards_present"] == 0 and not list(out.glob(dataset.SHARD_GLOB))
    assert make_dataset.main(args) == 0  # no budget: resumes and finishes every shard
    manifest = json.loads((out / make_dataset.MANIFEST).read_text())
    assert manifest["complete"] and manifest["shards_present"] == manifest["num_shards"] == 3


def test_shard_order_starts_where_asked_and_covers_every_shard_once():
    assert make_dataset.shard_order(7, 0, 0, 1) == list(range(7))
    assert make_dataset.shard_order(7, 5, 0, 1) == [5, 6, 0, 1, 2, 3, 4]
    ranks = [make_dataset.shard_order(7, 5, r, 3) for r in range(3)]
    assert ranks[2] == [5, 2] and sorted(i for r in ranks for i in r) == list(range(7))
    with pytest.raises(SystemExit, match="outside"):
        make_dataset.shard_order(7, 7, 0, 1)


def test_token_data_batches_equal_the_padded_examples(workdir):
    examples = dataset.load_dataset(workdir / "data", limit=10)
    data = dataset.TokenData(examples, max_len=20)
    b = data.batch([3, 0, 7])
    ref = dataset.collate([examples[i] for i in (3, 0, 7)], 20)
    assert torch.equal(b.input_ids, ref.input_ids) and torch.equal(b.attention_mask, ref.attention_mask)
    assert torch.equal(b.loss_mask, ref.loss_mask)
    # the host-side count the fast loss sizes its rows by (truncation to max_len included)
    assert b.num_teacher_rows == teacher_rows(ref.loss_mask) > 0


# --------------------------------------------------------------------------- train_drafter.py


def test_token_budget_batches_partition_the_data_across_ranks():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 120, (500,), generator=g).tolist()
    seen = []
    for rank in range(3):
        batches = dataset.token_budget_batches(lengths, 400, seed=1, epoch=2, rank=rank, world=3)
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 400
        seen += [i for b in batches for i in b]
    assert sorted(seen) == list(range(500))  # every example exactly once per epoch
    again = dataset.token_budget_batches(lengths, 400, seed=1, epoch=2, rank=1, world=3)
    assert again == dataset.token_budget_batches(lengths, 400, seed=1, epoch=2, rank=1, world=3)
    assert again != dataset.token_budget_batches(lengths, 400, seed=1, epoch=3, rank=1, world=3)


def test_lr_schedule_warms_up_linearly_then_decays_to_zero():
    total, warmup = 100, 4
    f = [train_drafter.lr_factor(s, total, warmup) for s in range(total + 1)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and abs(f[52] - 0.5) < 1e-12 and f[total] == 0.0
    assert all(a >= b for a, b in zip(f[4:], f[5:]))


def test_anneal_factor_holds_then_decays_to_zero_over_the_last_fraction():
    f = [train_drafter.anneal_factor(x / 100, 0.4) for x in range(101)]
    assert f[:61] == [1.0] * 61 and abs(f[80] - 0.5) < 1e-12 and f[100] == 0.0
    assert all(a >= b for a, b in zip(f, f[1:]))
    assert train_drafter.anneal_factor(0.99, 0.0) == 1.0  # off by default


def test_pack_blocks_labels_are_the_next_tokens_of_each_anchor(workdir):
    examples = dataset.load_dataset(workdir / "data", limit=6)
    batch = dataset.collate(examples, 1024)
    blocks = dataset.pack_blocks(batch, 5, GAMMA, torch.Generator().manual_seed(0))
    for b, e in enumerate(examples):
        S = len(e.input_ids)
        for j in range(blocks.anchor_pos.shape[1]):
            p = int(blocks.anchor_pos[b, j])
            if not blocks.valid[b, j, 0]:
                continue  # padding block
            assert e.loss_mask[p] and e.loss_mask[p + 1] and int(blocks.anchor_ids[b, j]) == int(e.input_ids[p])
            for k in range(1, GAMMA + 1):
                ok = p + k < S
                assert bool(blocks.valid[b, j, k - 1]) == (ok and bool(blocks.valid[b, j, :k - 1].all()))
                if ok:
                    assert int(blocks.labels[b, j, k - 1]) == int(e.input_ids[p + k])
                    assert int(blocks.prev_tokens[b, j, k - 1]) == int(e.input_ids[p + k - 1])
                    assert int(blocks.target_pos[b, j, k - 1]) == p + k - 1


def test_training_overfits_a_fixed_batch(workdir):
    from optimized.training import dense_step_loss
    from reference.config import DrafterConfig
    from reference.drafter import DSparkDrafter

    target = Target.load(str(workdir / "target"))
    data = dataset.TokenData(dataset.load_dataset(workdir / "data", limit=8), 1024)
    b = data.batch(list(range(8)))
    logits, features = target.forward_batch(b.input_ids, b.attention_mask.long())
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(target.config, block_size=GAMMA, markov_rank=16, markov_factored=True,
                                           qk_norm=True, target_layer_ids=target.layer_ids)
    drafter = DSparkDrafter(cfg)
    drafter.attach_target(target.embed_tokens, target.lm_head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(20):
        out = dense_step_loss(drafter, b.input_ids, b.loss_mask, b.attention_mask, features, logits,
                              weights=(0.0, 0.0, 1.0, 1.0))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    # Memorising 8 sequences: the loss must fall well below its start.
    assert losses[-1] < 0.6 * losses[0], losses


def test_training_writes_a_loadable_checkpoint_and_logs(trained):

    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["drafter"]["block_size"] == GAMMA and cfg["drafter"]["head"] == "markov"
    assert cfg["extra"]["training"]["steps_done"] == 8
    events = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"] == [2, 4, 6, 8]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8] and len(evals[-1]["accept_proxy"]) == GAMMA
    assert all(0.0 <= x <= 1.0 for x in evals[-1]["accept_proxy"] + evals[-1]["greedy_match"])
    # The held-out proxies per temperature the text was sampled at: they add up to the overall ones, slot by slot.
    groups = evals[-1]["by_group"]
    assert set(groups) == {"T=0", "T=1"}
    for k in range(GAMMA):
        n = [g["slots"][k] for g in groups.values()]
        assert sum(n) == evals[-1]["slots"][k] > 0
        mixed = sum(g["accept_proxy"][k] * c for g, c in zip(groups.values(), n)) / sum(n)
        assert mixed == pytest.approx(evals[-1]["accept_proxy"][k], abs=1e-5)
    readme = (trained / "README.md").read_text()
    assert "accept proxy on text sampled at T=1" in readme
    assert "8 of 8 planned" in readme and "Command" in readme and "hardware" in readme
    target = Target.load(str(trained.parent / "target"))
    drafter = load_drafter(trained, target)
    assert drafter.config.markov_rank == 16


def test_resumed_training_equals_uninterrupted_training(workdir, trained):
    assert train_drafter.main(_train_args(workdir, "run_b", "--stop-after", "5")) == 0
    state = json.loads((workdir / "run_b" / "_state" / "state.json").read_text())
    assert state["step"] == 5
    assert train_drafter.main(_train_args(workdir, "run_b")) == 0
    a, b = load_file(trained / "model.safetensors"), load_file(workdir / "run_b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # same data order, anchors, optimizer and schedule state: bit-identical on the CPU
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(SystemExit, match="--head"):
        train_drafter.main(_train_args(workdir, "run_b", "--head", "rnn"))


# --------------------------------------------------------------------------- calibrate.py


def test_greedy_proposal_labels_match_an_independent_target_check(workdir, trained):

    target = Target.load(str(workdir / "target"))
    drafter = load_drafter(trained, target)
    examples = dataset.load_dataset(workdir / "data", limit=6)
    props = calibrate.collect_proposals(target, drafter, examples, temperature=0.0, seed=3, anchors_per_seq=4,
                                        tokens_per_batch=128, progress=False)
    M = props["num_accepted"].numel()
    assert M > 10 and props["conf_logits"].shape == (M, GAMMA)
    for j in range(M):
        e = examples[int(props["sequence"][j])]
        p, x = int(props["anchor_pos"][j]), props["draft_tokens"][j]
        seq = torch.cat([e.input_ids[: p + 1], x])[None]  # true prefix, anchor, drafts
        with torch.no_grad():
            greedy = target.model(seq).logits[0, p: p + GAMMA].argmax(-1)  # [γ] target's choice at p+1..p+γ
        matches = (greedy == x).long().cumprod(0).sum()
        assert int(props["num_accepted"][j]) == int(matches)


def test_calibrate_writes_temperatures_report_and_plot(workdir, trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in trained.iterdir():
        if f.is_file():
            (ckpt / f.name).write_bytes(f.read_bytes())
    rc = calibrate.main(["--drafter", str(ckpt), "--data", str(workdir / "data"), "--model", str(workdir / "target"),
                         "--device", "cpu", "--anchors-per-seq", "6", "--tokens-per-batch", "512",
                         "--method", "sts",  # the paper's ECE grid search: never worse than T = 1 on its fit data
                         "--dump-proposals", str(tmp_path / "proposals")])
    assert rc == 0
    temps = json.loads((ckpt / "config.json").read_text())["drafter"]["sts_temperatures"]
    assert set(temps) == {"greedy", "sampling"}
    assert all(len(t) == GAMMA and all(x > 0 for x in t) for t in temps.values())
    report = json.loads((ckpt / "calibration.json").read_text())
    for mode in ("greedy", "sampling"):
        r = report["modes"][mode]
        assert r["temperatures"] == temps[mode]
        assert r["num_fit"] + r["num_report"] == r["num_proposals"] and r["num_report"] > 0
        pos = r["ece_fit"]["positions"]
        assert [p["k"] for p in pos] == list(range(1, GAMMA + 1))
        # STS minimises ECE slot by slot on the fit data, and T = 1 is in its grid: never worse there.
        assert all(p["ece_after"] <= p["ece_before"] + 1e-12 for p in pos if p["count"])
    # Each mode was calibrated on the held-out answers sampled at its own temperature.
    examples, sampled_at = dataset.load_dataset(workdir / "data"), dataset.generation_temperatures(workdir / "data")
    assert sampled_at == (0.0, 1.0)
    for mode, t in (("greedy", 0.0), ("sampling", 1.0)):
        want = sum(dataset.example_temperature(e, sampled_at) == t for e in examples)
        assert report["modes"][mode]["num_sequences"] == want and 0 < want < len(examples)
        assert report["modes"][mode]["contexts"] == f"the held-out sequences sampled at T = {t:g}"
    assert (ckpt / "reliability.png").stat().st_size > 10_000
    # The recorded proposals (safetensors) carry what was fitted, and the offline tools read them.
    from scripts import analyze_proposals
    from scripts.proposals import load_proposals

    records = {r["mode"]: r for r in load_proposals(tmp_path / "proposals")}
    assert set(records) == {"greedy", "sampling"}
    for mode, rec in records.items():
        assert rec["conf_logits"].shape == (report["modes"][mode]["num_proposals"], GAMMA)
        assert rec["temperatures"] == temps[mode] and rec["gamma"] == GAMMA
    assert analyze_proposals.main(["--proposals", str(tmp_path / "proposals"), "--method", "sts",
                                   "--out", str(tmp_path / "analysis")]) == 0
    assert set(json.loads((tmp_path / "analysis.json").read_text())["modes"]) == {"greedy", "sampling"}
    assert analyze_proposals.main(["--proposals", str(tmp_path / "proposals"), "--method", "beta",
                                   "--out", str(tmp_path / "beta")]) == 0  # every calibrate method refits here too


def test_calibration_contexts_match_the_mode_or_fall_back_to_every_sequence():
    ex = [dataset.Example(id=i, input_ids=torch.zeros(3, dtype=torch.long), loss_mask=torch.ones(3, dtype=torch.bool))
          for i in ("7@0", "7@1", "8@0", "8@1", "odd-id")]
    temps = (0.0, 1.0)
    assert [dataset.example_temperature(e, temps) for e in ex] == [0.0, 1.0, 0.0, 1.0, None]
    assert [e.id for e in calibrate.mode_contexts(ex, temps, 1.0, "matched")[0]] == ["7@1", "8@1"]
    assert [e.id for e in calibrate.mode_contexts(ex, temps, 0.0, "matched")[0]] == ["7@0", "8@0"]
    assert calibrate.mode_contexts(ex, temps, 1.0, "all")[0] == ex
    assert calibrate.mode_contexts(ex, None, 1.0, "matched")[0] == ex  # a set that records no temperatures
    assert calibrate.mode_contexts(ex, temps, 0.7, "matched")[0] == ex  # none sampled at 0.7
    assert dataset.generation_temperatures("/nonexistent-directory") is None


def test_threshold_sweep_applies_the_whole_calibration():
    """analyze_proposals' static-threshold simulation reads the survivals through every fitted term (beta
    calibration's log weights included): a log weight that lowers the survivals shortens the verified prefix."""
    from scripts.analyze_proposals import threshold_sweep

    z = torch.linspace(-3, 3, 40)[:, None].expand(40, 3).contiguous()  # [M, γ]
    accepted = torch.full((40,), 3)
    plain = threshold_sweep(z, accepted, [1.0] * 3, [0.5], [0.0] * 3)[0]
    weighted = threshold_sweep(z, accepted, [1.0] * 3, [0.5], [0.0] * 3, [0.8] * 3)[0]  # + 0.8·log σ(z) ≤ 0
    a = prefix_survival(apply_sts(z, [1.0] * 3, [0.0] * 3, [0.8] * 3))
    assert weighted["mean_verify_length"] == pytest.approx(float((a >= 0.5).sum(1).float().mean()))
    assert weighted["mean_verify_length"] < plain["mean_verify_length"]


# --------------------------------------------------------------------------- eval_acceptance.py


def test_eval_acceptance_reports_tau_per_domain_and_position(workdir, trained, tmp_path):
    prompts = [json.loads(line)["input_ids"] for line in (workdir / "prompts.jsonl").read_text().splitlines()][:5]
    pf = tmp_path / "eval.jsonl"
    lines = [json.dumps({"input_ids": p, "domain": ["chat", "code"][i % 2]}) for i, p in enumerate(prompts)]
    pf.write_text("\n".join(lines) + "\n")
    reports = []
    for bs in ("1", "4"):
        out = tmp_path / f"tau{bs}.json"
        assert eval_acceptance.main(["--drafter", str(trained), "--prompts-file", str(pf), "--model",
                                     str(workdir / "target"), "--device", "cpu", "--temperature", "1.0",
                                     "--max-new-tokens", "16", "--batch-size", bs, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    r = reports[0]
    for key in ("mean_accepted_length", "per_domain", "per_position_acceptance", "counts", "settings", "hardware",
                "command"):
        assert key in r
    assert set(r["per_domain"]) == {"chat", "code"} and r["counts"]["prompts"] == 5
    assert len(r["per_position_acceptance"]) == GAMMA and r["settings"]["gamma"] == GAMMA
    assert 1.0 <= r["mean_accepted_length"] <= GAMMA + 1
    # τ = 1 + Σ_k P(slots 1..k accepted) = 1 + Σ_k Π_{j≤k} P(slot j | slots < j): exact up to float32 rounding.
    surv, acc = 1.0, 1.0
    for c in r["per_position_acceptance"]:
        surv *= c or 0.0
        acc += surv
    assert abs(acc - r["mean_accepted_length"]) < 1e-5
    # The random-number contract: batching never changes a request's output.
    assert reports[0]["per_domain_detail"] == reports[1]["per_domain_detail"]
    # The equivalence contract: the reference loop measures exactly what the (default) optimized engine measures.
    out = tmp_path / "tau_ref.json"
    assert eval_acceptance.main(["--drafter", str(trained), "--prompts-file", str(pf), "--model",
                                 str(workdir / "target"), "--device", "cpu", "--temperature", "1.0",
                                 "--max-new-tokens", "16", "--batch-size", "4", "--engine", "reference",
                                 "--json", str(out)]) == 0
    ref = json.loads(out.read_text())
    assert ref["settings"]["engine"] == "reference" and r["settings"]["engine"] == "optimized"
    assert ref["per_domain_detail"] == reports[1]["per_domain_detail"]
    with pytest.raises(SystemExit, match="block size"):
        eval_acceptance.main(["--drafter", str(trained), "--prompts-file", str(pf), "--model", str(workdir / "target"),
                              "--device", "cpu", "--gamma", "3", "--json", str(tmp_path / "x.json")])


def test_train_schedule_by_time_budget(workdir):
    """--steps 0 runs warm-up + cosine over the wall-clock budget and stops when it is spent."""
    args = _train_args(workdir, "run_time")
    args[args.index("--steps") + 1] = "0"
    assert train_drafter.main([*args, "--time-budget-min", "0.05"]) == 0
    summary = json.loads((workdir / "run_time" / "summary.json").read_text())
    assert summary["stop_reason"].startswith("time budget") and summary["steps_done"] > 0
    lrs = [json.loads(x)["lr"] for x in (workdir / "run_time" / "metrics.jsonl").read_text().splitlines()
           if json.loads(x)["event"] == "train"]
    assert lrs[-1] < max(lrs)  # decayed along the clock


def test_init_from_a_checkpoint_continues_its_schedule(workdir, trained):
    """A run continued elsewhere from the shipped (bf16) checkpoint: its step, a re-warmed learning rate."""
    args = _train_args(workdir, "run_c")
    args[args.index("--steps") + 1] = "12"
    assert train_drafter.main([*args, "--init-from", str(trained), "--rewarm-steps", "2"]) == 0
    summary = json.loads((workdir / "run_c" / "summary.json").read_text())
    assert summary["steps_done"] == 12
    lrs = {e["step"]: e["lr"] for e in map(json.loads, (workdir / "run_c" / "metrics.jsonl").read_text().splitlines())
           if e["event"] == "train"}
    assert sorted(lrs) == [10, 12]  # steps 9-12 only: it started at the checkpoint's step 8
    with pytest.raises(SystemExit, match="disagrees"):
        train_drafter.main([*_train_args(workdir, "run_d"), "--init-from", str(trained), "--markov-rank", "8"])
    with pytest.raises(SystemExit, match="disagrees"):  # a checkpoint is deepened, never cut
        train_drafter.main([*_train_args(workdir, "run_d"), "--init-from", str(trained), "--num-layers", "1"])


def test_init_schedule_restart_starts_a_new_schedule_on_the_checkpoints_weights(workdir, trained):
    """--init-schedule restart: step 0 of a new --steps schedule (its warm-up, then the cosine) from the weights."""
    args = _train_args(workdir, "run_restart", "--init-from", str(trained), "--init-schedule", "restart",
                       "--warmup-frac", "0.5")
    args[args.index("--steps") + 1] = "6"
    assert train_drafter.main(args) == 0
    summary = json.loads((workdir / "run_restart" / "summary.json").read_text())
    assert summary["steps_done"] == 6
    lrs = {e["step"]: e["lr"] for e in map(json.loads, (workdir / "run_restart" / "metrics.jsonl").read_text()
                                          .splitlines()) if e["event"] == "train"}
    assert sorted(lrs) == [2, 4, 6]  # from step 0, not from the checkpoint's step 8
    assert lrs[2] < lrs[4] > lrs[6]  # warm-up over the first 3 steps, then the decay
    first = load_drafter(trained)
    restarted = load_drafter(workdir / "run_restart")
    assert not torch.equal(first.layers[0].mlp.down_proj.weight, restarted.layers[0].mlp.down_proj.weight)
    with pytest.raises(SystemExit, match="needs --init-from"):
        train_drafter.main([*_train_args(workdir, "run_e"), "--init-schedule", "restart"])


def test_init_from_with_more_layers_deepens_the_checkpoint(workdir, trained):
    """--num-layers above the checkpoint's continues its schedule with new layers that start as the identity."""
    args = _train_args(workdir, "run_deep", "--num-layers", "3", "--save-weights", "int8")
    args[args.index("--steps") + 1] = "10"
    assert train_drafter.main([*args, "--init-from", str(trained), "--rewarm-steps", "1"]) == 0
    summary = json.loads((workdir / "run_deep" / "summary.json").read_text())
    assert summary["steps_done"] == 10 and summary["deepened_from_layers"] == 2
    config = json.loads((workdir / "run_deep" / "config.json").read_text())
    assert config["drafter"]["num_layers"] == 3 and config["extra"]["training"]["deepened_from_layers"] == 2
    assert "layers.2.mlp.down_proj.weight" in config["quantization"]["tensors"]  # --save-weights int8
    assert "deepened" in (workdir / "run_deep" / "README.md").read_text()
    deep = load_drafter(workdir / "run_deep")
    assert deep.layers[2].self_attn.o_proj.weight.abs().max() > 0  # trained away from zero


def test_init_from_counts_only_this_runs_time_and_anneals_to_zero(workdir, trained, tmp_path):
    """A new loan from a checkpoint that already trained longer than this loan's budget still trains the whole
    budget (the budget is this invocation's), and --anneal-frac brings the learning rate to ~0 at its end."""
    import shutil

    init = tmp_path / "long-trained"
    shutil.copytree(trained, init)
    config = json.loads((init / "config.json").read_text())
    config["extra"]["training"]["wall_s"] = 1e6  # far beyond the budget below
    (init / "config.json").write_text(json.dumps(config))
    args = _train_args(workdir, "run_anneal")
    args[args.index("--steps") + 1] = "100000"
    assert train_drafter.main([*args, "--init-from", str(init), "--rewarm-steps", "1", "--time-budget-min", "0.04",
                               "--anneal-frac", "0.5", "--log-every", "1"]) == 0
    summary = json.loads((workdir / "run_anneal" / "summary.json").read_text())
    assert summary["stop_reason"].startswith("time budget") and summary["steps_done"] > 8 + 2
    assert summary["wall_s"] > 1e6  # the recorded total still includes the earlier training
    lrs = [e["lr"] for e in map(json.loads, (workdir / "run_anneal" / "metrics.jsonl").read_text().splitlines())
           if e["event"] == "train"]
    assert lrs[-1] < 0.5 * max(lrs)
    with pytest.raises(SystemExit, match="anneal"):
        train_drafter.main([*args, "--anneal-frac", "0.5"])  # no time budget to anneal over


def test_bench_training_compares_both_steps(workdir, tmp_path):
    from scripts import bench_training

    out = tmp_path / "training.json"
    assert bench_training.main(["--data", str(workdir / "data"), "--model", str(workdir / "target"), "--device", "cpu",
                                "--tokens-per-batch", "256", "--warmup", "0", "--repeats", "2", "--num-layers", "1",
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ref, old, fast = report["results"]
    assert (ref["step"], old["step"], fast["step"]) == ("reference", "fast-torch", "fast")
    # Every eligible anchor against 32 sampled ones per sequence: the fast step supervises more slots per batch.
    assert fast["slot_predictions_per_step"] >= ref["slot_predictions_per_step"] > 0
    # Skipping the rows that teach nothing skips no supervised slot.
    assert fast["slot_predictions_per_step"] == old["slot_predictions_per_step"]
    assert report["speedup"] == pytest.approx(fast["slot_predictions_per_s"] / ref["slot_predictions_per_s"])
    assert report["ratios"]["fast/fast-torch"] == pytest.approx(fast["slot_predictions_per_s"]
                                                                / old["slot_predictions_per_s"])


def test_torchrun_two_ranks_train_like_one_process_on_the_global_batch(workdir):
    """Data parallel on the CPU (gloo): 2 ranks × T tokens per step reach the weights of 1 process × 2T tokens."""
    import os
    import subprocess
    import sys

    def args(out: str, tokens: int) -> list[str]:
        a = _train_args(workdir, out, "--eval-every", "100", "--save-every", "100", "--no-resume")
        a[a.index("--steps") + 1] = "4"
        a[a.index("--tokens-per-batch") + 1] = str(tokens)
        return a

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29517", "-m", "scripts.train_drafter", *args("ddp_2", 256)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert train_drafter.main(args("ddp_1", 512)) == 0
    # The float32 master weights (the shipped checkpoint is bf16, whose rounding would hide or magnify differences).
    two, one = (load_file(workdir / run / "_state" / "drafter.safetensors") for run in ("ddp_2", "ddp_1"))
    # Same sequences at every step, the loss divided by the same global Σ w_k: only the summation order differs,
    # which moves gradients by ~1e-7 relative; AdamW's normalisation can magnify that for gradients near zero, up
    # to ~3e-6 here after 4 steps, while one step moves a weight by up to lr ≈ 1e-4 (wrong batches or per-rank
    # means would differ by that much).
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=0, msg=k)
    summary = json.loads((workdir / "ddp_2" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps_done"] == 4


def test_make_dataset_on_two_ranks_writes_the_shards_of_one(workdir, tmp_path, monkeypatch):
    """Sharded over processes (RANK / WORLD_SIZE as torchrun sets them), the data is the same as on one."""
    out = tmp_path / "data"
    args = ["--out", str(out), "--model", str(workdir / "target"), "--prompt-ids", str(workdir / "prompts.jsonl"),
            "--max-new-tokens", "24", "--shard-size", "16", "--batch-size", "8", "--device", "cpu"]
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert make_dataset.main(args) == 0
    for i in range(3):
        (a, ida), (b, idb) = _shard(out / dataset.shard_name(i)), _shard(workdir / "data" / dataset.shard_name(i))
        assert ida == idb and torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    assert json.loads((out / make_dataset.MANIFEST).read_text())["complete"]


# --------------------------------------------------------------------------- quantize_drafter.py


def test_quantize_drafter_writes_an_int8_copy_and_measures_it(workdir, trained, tmp_path):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text((workdir / "prompts.jsonl").read_text())
    out, report = tmp_path / "q", tmp_path / "report.json"
    assert quantize_drafter.main(["--drafter", str(trained), "--out", str(out), "--check", "--model",
                                  str(workdir / "target"), "--prompts-file", str(pf), "--limit", "3",
                                  "--max-new-tokens", "8", "--device", "cpu", "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["weight_bytes"]["int8"] < 0.75 * r["weight_bytes"]["original"]  # float32 → int8 (+ small tensors)
    for temp in ("T=0", "T=1"):
        res = r["results"][temp]
        assert len(res["sum_min_int8"]) == GAMMA and sum(res["slots"]) > 0
        assert all(a >= 0.9 for a in res["argmax_agree"]) and all(t < 0.05 for t in res["tv"])
        assert all(abs(a - b) < 0.02 for a, b in zip(res["sum_min_int8"], res["sum_min_original"], strict=True))
    config = json.loads((out / "config.json").read_text())
    original = json.loads((trained / "config.json").read_text())
    assert config["quantization"]["tensors"] and config["extra"] == original["extra"]
    assert config["drafter"] == original["drafter"] and (out / "README.md").is_file()
    # in place, without --check
    copy = tmp_path / "inplace"
    quantize_drafter.main(["--drafter", str(trained), "--out", str(copy)])
    assert quantize_drafter.main(["--drafter", str(copy), "--out", str(copy)]) == 0
    assert json.loads((copy / "config.json").read_text())["quantization"] == config["quantization"]
