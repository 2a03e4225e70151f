"""mkdocs hook: benchmark tables rendered from the committed JSON files at build time.

A page line ``<!-- benchmark: KIND FILE… -->`` becomes a Markdown table (or a short paragraph) computed from
the JSON files it names, paths relative to the page. So a new benchmark run updates the pages by itself, and a
number on the site is always the number in the file, with the hardware and the command stored beside it.

A number inside a sentence is written ``<!-- value: NAME FILE key=value… -->`` (anywhere in a line) and becomes
that one number, rendered by :data:`VALUES` from the file (a τ, a speed-up at one batch size, the batch sizes where
speculation pays, a start-up time): prose never retypes a measured number that a run can change.

Kinds (one renderer each, below): ``provenance``, ``engine-throughput``, ``cost-check``, ``speculation-frontier``,
``acceptance``, ``kernels``, ``calibration``, ``calibration-methods``, ``gpu-equivalence``,
``summary``, ``proposers`` (τ of each proposer), ``draft-vocab`` (scripts/draft_vocab.py), ``serving`` and
``startup`` (scripts/bench_serving.py), ``startup-launches``
(scripts/bench_startup.py), ``server-overhead``
(scripts/bench_server_overhead.py), ``step-cost`` (scripts/report_step_cost.py), ``linear-chain``
(scripts/bench_linear.py), ``engine-ab`` (alternating
scripts/bench_engine.py runs of one switch, merged into one file), and ``checkpoint`` (how a shipped drafter was
made, from its ``summary.json``).
An unknown kind, a missing file or a file without the expected fields fails the build.

The JSON files record commands as they ran on the GPU machine, with staging paths under ``/tmp`` that a reader
does not have; :data:`PLACEHOLDERS` names them for what they are (the benchmarks page explains the names).
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import statistics
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.benchmark_tables")

# A directive may be indented (inside an admonition, say): the rendered Markdown gets the same indent.
DIRECTIVE = re.compile(r"^(?P<indent>[ ]*)<!-- benchmark: (?P<kind>[\w-]+)(?P<args>[^>]*?) -->$", flags=re.M)

# Staging paths of the GPU runs -> what the reader has (see docs/benchmarks/index.md, "Reading the commands").
PLACEHOLDERS = [
    (re.compile(r"/tmp/stage/target\.gguf"), "TARGET.gguf"),
    (re.compile(r"/tmp/stage/sharegpt\.json\.gz"), "SHAREGPT.json.gz"),
    (re.compile(r"/tmp/res\d*/|/root/out/"), "docs/benchmarks/"),
    (re.compile(r"/tmp/sd/(\w+)"), r"data/\1"),
    (re.compile(r"/tmp/runs\d*/(\w+)"), r"runs/\1"),
]
# Run-to-run spread of a throughput on the shared H200 machine: the same configuration measured in two runs on
# one machine differed by up to ~10 % (plain decoding at batch 64: 30,430 vs 26,851 tokens/s with the earlier
# 2-layer drafter's build). A ratio inside 1 ± this is reported as a tie.
SPREAD = 0.10


def command(text: str) -> str:
    """A recorded command with the GPU machine's staging paths replaced by :data:`PLACEHOLDERS`."""
    for pattern, repl in PLACEHOLDERS:
        text = pattern.sub(repl, text)
    leftover = re.findall(r"/(?:tmp|root|home)/\S+", text)
    if leftover:
        log.info("benchmark tables: unmapped staging paths %s; shown by their last component", leftover)
        text = re.sub(r"/(?:tmp|root|home)/(?:\S+/)?(\S+)", r"\1", text)
    return text


def _load(page_dir: Path, name: str) -> dict:
    path = page_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"benchmark tables: {path} does not exist")
    return json.loads(path.read_text(encoding="utf-8"))


def _int(x: float) -> str:
    return f"{x:,.0f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- engine


def _engine_rows(data: dict) -> tuple[list[int], list[str], dict[int, dict[str, float]]]:
    """Batch sizes, policy labels (in the run's order) and tokens/s per batch and label."""
    if "summary" not in data or "settings" not in data:
        raise ValueError("benchmark tables: not an engine benchmark (scripts/bench_engine.py) JSON")
    batches = sorted(int(b) for b in data["summary"])
    labels = list(data["settings"]["modes"])
    tps = {b: dict(data["summary"][str(b)]["tokens_per_s"]) for b in batches}
    return batches, labels, tps


def provenance(page_dir: Path, files: list[str]) -> str:
    out = []
    for name in files:
        data = _load(page_dir, name)
        hw = data.get("hardware") or data.get("source") or data.get("note")
        sw = data.get("software") or {}
        versions = ", ".join(f"{k} {v}" for k, v in sw.items() if k in ("torch", "triton", "transformers"))
        line = f"[`{name}`]({name}): {hw}" + (f" ({versions})" if versions else "")
        if data.get("command"):
            line += f"; `{_script(data['command'])}`"
        out.append(f"* {line}")
    return "\n".join(out) + "\n"


def engine_throughput(page_dir: Path, files: list[str]) -> str:
    data = _load(page_dir, files[0])
    batches, labels, tps = _engine_rows(data)
    with_hf = any("hf" in tps[b] for b in batches)
    header = ["batch"] + (["HF `generate`"] if with_hf else []) + [f"`{lab}`" for lab in labels]
    rows = []
    for b in batches:
        best = max(tps[b][lab] for lab in labels if lab in tps[b])
        cells = [str(b)] + ([_int(tps[b]["hf"]) if "hf" in tps[b] else "–"] if with_hf else [])
        for lab in labels:
            v = tps[b].get(lab)
            cells.append("–" if v is None else (f"**{_int(v)}**" if v == best else _int(v)))
        rows.append(cells)
    return _table(header, rows) + "\nOutput tokens per second; the best policy of each batch size in bold.\n"


def _base(label: str) -> str:
    """A policy label's mode: ``"fixed:7+async"`` -> ``"fixed:7"`` (the suffix names an engine variant)."""
    return label.partition("+")[0]


def _adaptive(label: str) -> bool:
    """Whether a label is a variant of the adaptive mode (``adaptive+async``, ``adaptive:finish+async``, ...)."""
    return _base(label).partition(":")[0] == "adaptive"


def frontier(data: dict) -> list[dict]:
    """Per batch: plain decoding at its best (``none`` or a pipelined variant), the best speculative policy, and the
    verdict (ratios inside 1 ± SPREAD tie); ``adaptive`` is its best variant."""
    batches, labels, tps = _engine_rows(data)
    out = []
    for b in batches:
        plain = {lab: tps[b][lab] for lab in labels if _base(lab) == "none" and lab in tps[b]}
        none_label = max(plain, key=plain.get)
        none = plain[none_label]
        spec = {lab: tps[b][lab] for lab in labels if _base(lab) != "none" and lab in tps[b]}
        best = max(spec, key=spec.get)
        ratio = spec[best] / none
        verdict = ("speculation helps" if ratio > 1 + SPREAD else
                   "plain decoding is faster" if ratio < 1 - SPREAD else "a tie (within the spread)")
        adaptive = max((v for lab, v in spec.items() if _adaptive(lab)), default=float("nan"))
        out.append({"batch": b, "none": none, "none_label": none_label, "best": best, "best_tps": spec[best],
                    "ratio": ratio, "adaptive": adaptive / none, "verdict": verdict})
    return out


def cost_check(page_dir: Path, files: list[str]) -> str:
    """The engine's step-cost table against the steps it measured in the same run: what the adaptive scheduler
    believed a step costs (the table's verify time at the run's mean tokens per step, plus its drafter time on the
    share of steps that drafted) and what it cost."""
    from reference.cost_model import CostTable  # the table's own pricing (staircase, request-count curves)

    data = _load(page_dir, files[0])
    if "cost_table" not in data or "results" not in data:
        raise ValueError(f"benchmark tables: {files[0]} has no cost table (scripts/bench_engine.py records one)")
    tables = {False: CostTable.from_dict(data["cost_table"])}
    if "cost_table_async" in data:  # the engine one step ahead is priced by its own (pipelined) profile
        tables[True] = CostTable.from_dict(data["cost_table_async"])
    rows = []
    for r in data["results"]:
        if r.get("engine") != "optimized" or r.get("step_ms") is None:
            continue
        table = tables.get(r["label"].endswith("+async") and r["mode"] != "none", tables[False])
        n, drafts = r["batch_size"], r["mode"] != "none"
        tokens = round(n * (1 + (r.get("mean_verify_length") or 0))) if drafts else n
        drafting = r.get("draft_step_fraction", 1.0) if drafts else 0.0  # the share of steps that ran the drafter
        priced = 1e3 * (table.verify_time(tokens, n) + (drafting * table.draft_time(n) if drafting else 0.0))
        rows.append([f"`{r['label']}`", str(n), str(tokens), f"{r['step_ms']:.2f}", f"{priced:.2f}",
                     f"{r['step_ms'] / priced:.2f}"])
    return _table(["policy", "batch", "tokens verified per step", "measured step ms", "table's price ms",
                   "measured / table"], rows) + (
        "\nThe table's price is its verify time for that many tokens (the run's mean per step) of that many "
        "requests, plus the drafter's time for them on the share of steps that drafted.\n")


def speculation_frontier(page_dir: Path, files: list[str]) -> str:
    rows = []
    for r in frontier(_load(page_dir, files[0])):
        rows.append([str(r["batch"]), f"{_int(r['none'])} (`{r['none_label']}`)", f"`{r['best']}`",
                     _int(r["best_tps"]), f"{r['ratio']:.2f}×", f"{r['adaptive']:.2f}×", r["verdict"]])
    header = ["batch", "plain decoding, its best variant", "best speculative policy", "its tokens/s",
              "best / plain", "`adaptive` (best variant) / plain", "verdict"]
    return _table(header, rows) + (f"\nA ratio within 1 ± {SPREAD:.2f} counts as a tie: that is the run-to-run "
                                   "spread of the same configuration on this machine.\n")


# ---------------------------------------------------------------------------------------------------- drafters


def _slots(rates: list[float | None], counts: list[int] | None) -> str:
    """Per-slot rates; a slot reached fewer than 30 times shows its raw count instead (noise, not a rate)."""
    out = []
    for i, r in enumerate(rates):
        n = counts[i] if counts else None
        if r is None or (n is not None and n == 0):
            out.append("–")
        elif n is not None and n < 30:
            out.append(f"({round(r * n)}/{n})")
        else:
            out.append(f"{r:.2f}")
    return " ".join(out)


def _arm_label(arm: str) -> str:
    """A drafter's label as a reader needs it: what it is (layers, step, trainer), without the bookkeeping of the
    runs that trained it (bracketed remarks on how the GPU time was split)."""
    arm = re.sub(r"\s*\([^()]*\bloans?\b[^()]*\)", "", arm)
    arm = re.sub(r",?\s*measured in its training loan(?:\s*\(loan \d+\))?", "", arm)
    return arm.strip(" ,")


def _select_arms(data: dict, args: list[str]) -> list[tuple[str, dict]]:
    """The runs of an acceptance file, all of them or those of ``arms=0,3`` (indices in the file's order)."""
    runs = list(data["runs"].items())
    named = dict(a.split("=", 1) for a in args if "=" in a)
    if "arms" in named:
        runs = [runs[int(i)] for i in named["arms"].split(",")]
    return runs


def acceptance(page_dir: Path, files: list[str]) -> str:
    data = _load(page_dir, files[0])
    rows = []
    for arm, temps in _select_arms(data, files[1:]):
        arm = _arm_label(arm)
        for t, run in temps.items():
            dom = run.get("per_domain", {})
            where = " ".join(x for x in (_short_hardware(run.get("hardware", "")),
                                         run.get("settings", {}).get("dtype", "")) if x)
            se = run.get("mean_accepted_length_se")  # runs measured before it was recorded have none
            tau = f"**{run['mean_accepted_length']:.3f}**" + (f" ± {se:.3f}" if se is not None else "")
            rows.append([arm, t.replace("T=", ""), tau,
                         " / ".join(f"{dom[d]:.2f}" for d in dom), str(run["counts"]["steps"]),
                         _slots(run["per_position_acceptance"], run.get("per_position_counts")), where])
    domains = " / ".join(next(iter(_select_arms(data, files[1:])[0][1].values())).get("per_domain", {}))
    header = ["drafter", "T", "τ", f"τ by domain ({domains})", "steps",
              "P(slot k accepted, given slots 1..k-1 accepted), k = 1..γ", "measured on"]
    return _table(header, rows) + ("\nτ counts the accepted drafts plus the token the target emits; ± is its standard "
                                   "error with the prompts as clusters, where recorded. A slot reached fewer than 30 "
                                   "times shows its count, (accepted/reached), not a rate.\n")


def _short_hardware(name: str) -> str:
    """``1x NVIDIA H200`` → ``H200``, ``CPU x86_64 (2 threads)`` → ``CPU``: the table's narrow column."""
    if "H200" in name or "NVIDIA" in name:
        return name.split("NVIDIA", 1)[-1].split("(")[0].strip()
    return "CPU" if name.upper().startswith("CPU") else name


def calibration(page_dir: Path, files: list[str]) -> str:
    data = _load(page_dir, files[0])
    header = ["decoding", "method", "proposals"] + [f"slot {k}" for k in range(1, 8)]
    rows = []
    for mode, m in data["modes"].items():
        pos = m["ece_heldout"]["positions"]
        rows.append([mode, m.get("method", ""), str(m["num_report"])]
                    + [f"{_pct(p['ece_before'])} → **{_pct(p['ece_after'])}**" for p in pos])
        rows.append([f"*{mode}, floor*", "", ""]
                    + [f"*{_pct(p.get('ece_floor_median'))} ({_pct(p.get('ece_floor_p95'))})*" for p in pos])
    return _table(header, rows) + (
        "\nHeld-out ECE of the prefix survival in %, before → after calibration. *Floor*: what a perfectly "
        "calibrated predictor would measure on the same proposals (median, 95th percentile in brackets).\n")


def calibration_methods(page_dir: Path, files: list[str]) -> str:
    data = _load(page_dir, files[0])
    beta = all("beta" in s for s in data["sets"].values())
    header = ["proposals", "decoding", "count", "uncalibrated", "STS (paper)", "STS + bias (shipped)",
              *(["beta"] if beta else []), "floor (p95)"]
    rows = []
    for name, s in data["sets"].items():
        drafter, mode = name.split("/")
        fmt = lambda xs: " ".join(f"{100 * x:.1f}" for x in xs)  # noqa: E731
        rows.append([f"`{drafter}`", mode, f"{s['num_proposals']:,}", fmt(s["before"]), fmt(s["sts"]),
                     f"**{fmt(s['sts-bias'])}**", *([fmt(s["beta"])] if beta else []), fmt(s["floor_p95"])])
    return _table(header, rows) + f"\n{data['metric']}; mean over {data['splits']} random half splits, in %.\n"


# ---------------------------------------------------------------------------------------------------- kernels


def kernels(page_dir: Path, files: list[str]) -> str:
    data = _load(page_dir, files[0])
    batches = data["shapes"]["batches"]
    cells: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in data["results"]:
        cells.setdefault((r["op"], r["case"], r["backend"]), {})[r["R"]] = r["us"]
    rows = [[f"`{op}` ({case})", backend] + [_int(v[b]) if b in v else "–" for b in batches]
            for (op, case, backend), v in cells.items()]
    return _table(["op (case)", "backend"] + [f"R = {b} (µs)" for b in batches], rows)


# ---------------------------------------------------------------------------------------------------- equivalence


def gpu_equivalence(page_dir: Path, files: list[str]) -> str:
    rows = []
    for name in files:
        data = _load(page_dir, name)
        for label, counts in data["summary"]["per_mode"].items():
            ok = counts["identical"]
            total = sum(counts.values())
            rows.append([f"`{label}`", f"{ok}/{total}", str(counts["near-tie"]), str(counts["MISMATCH"]),
                         f"[{name}]({name})" + ("" if data.get("complete", True) else " (cut by its time budget)")])
    return _table(["mode, temperature", "identical prompts", "near-ties", "mismatches", "file"], rows)


def summary(page_dir: Path, files: list[str]) -> str:
    """The one-screen summary: files are ``acceptance=…``, ``engine=…``, ``equivalence=a.json,b.json``."""
    named = dict(arg.split("=", 1) for arg in files)
    acc = _load(page_dir, named["acceptance"])
    arm, temps = next(iter(acc["runs"].items()))
    taus = ", ".join(f"{run['mean_accepted_length']:.2f} at {t.replace('T=', 'T = ')}" for t, run in temps.items())
    eq_ok = eq_total = 0
    for name in named["equivalence"].split(","):
        eq = _load(page_dir, name)
        for counts in eq["summary"]["per_mode"].values():
            eq_ok, eq_total = eq_ok + counts["identical"], eq_total + sum(counts.values())
    engine = _load(page_dir, named["engine"])
    rows = frontier(engine)
    helps = [str(r["batch"]) for r in rows if r["verdict"] == "speculation helps"]
    ties = [str(r["batch"]) for r in rows if r["verdict"].startswith("a tie")]
    loses = [str(r["batch"]) for r in rows if r["verdict"] == "plain decoding is faster"]
    best = max(rows, key=lambda r: r["ratio"])
    worst = min(rows, key=lambda r: r["ratio"])
    lines = [
        "| question | answer | measured on |", "|---|---|---|",
        f"| Do `reference/` and `optimized/` emit the same tokens? | **{eq_ok}/{eq_total}** prompt × mode × "
        f"temperature runs identical in float32, CUDA graphs and Triton kernels on | {eq['hardware']} |",
        f"| How many tokens does one verification emit (τ)? | **{taus}** (drafter `{_arm_label(arm)}`, full block "
        f"of γ = 7, on the project's evaluation prompts) "
        f"| {temps[next(iter(temps))].get('hardware', '')} |",
        f"| Where does speculation beat plain decoding? | best gain **{best['ratio']:.2f}×** at batch "
        f"{best['batch']}; helps at batch {', '.join(helps) or 'none'}; tie at {', '.join(ties) or 'none'}; "
        f"plain decoding faster at {', '.join(loses) or 'none'} (down to {worst['ratio']:.2f}× at batch "
        f"{worst['batch']}) | {engine['hardware']} |",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- checkpoints


def _script(cmd: str) -> str:
    """``train_drafter.py …`` or ``scripts/x.py …`` as the command a reader runs from the repository root."""
    cmd = command(cmd)
    m = re.match(r"(?:python -m scripts\.|python )?(?:scripts/)?(\w+)(?:\.py)?\s(.*)", cmd)
    return f"python -m scripts.{m[1]} {m[2]}" if m else cmd


def checkpoint(page_dir: Path, files: list[str]) -> str:
    """How a checkpoint directory's drafter was made: its data and training commands, from ``summary.json``."""
    directory = (page_dir / files[0]).resolve()
    summary = _load(directory, "summary.json")
    data = summary.get("data_manifest", {})
    rows = [
        ["data", f"{data.get('examples', '?'):,} self-distilled sequences, {data.get('response_tokens', 0):,} "
                 f"response tokens, sampled at T = {data.get('settings', {}).get('temperature', '?')} "
                 f"({data.get('hardware', '?')}, {data.get('generation_wall_s', 0):.0f} s)"],
        ["training", f"{summary['steps_done']:,} of {summary['steps_planned']:,} steps, "
                     f"{summary['wall_s'] / 60:.1f} min on {summary['hardware']} "
                     f"({summary['world_size']} rank{'s' if summary['world_size'] > 1 else ''})"],
        ["drafter", f"{summary['parameters']:,} parameters (the target's embedding and LM head are shared), "
                    f"head `{summary['args']['head']}`, {summary['args']['num_layers']} layers, "
                    f"γ = {summary['args']['gamma']}"],
        ["held-out", f"CE {summary['final_eval']['ce']:.3f}; Σ min(p_d, p_t) per slot "
                     + " ".join(f"{x:.2f}" for x in summary["final_eval"]["accept_proxy"])],
    ]
    out = _table(["", ""], rows) + "\n```bash\n"
    if data.get("command"):
        out += _script(data["command"]) + "\n"
    out += _script(summary["command"]) + "\n```\n"
    return out


# ---------------------------------------------------------------------------------------------------- serving


def _serving_rows(data: dict) -> tuple[list[int], list[str], dict[tuple[int, str], dict]]:
    if "results" not in data or "startup" not in data:
        raise ValueError("benchmark tables: not a serving benchmark (scripts/bench_serving.py) JSON")
    rows = {(r["concurrency"], r["label"]): r for r in data["results"]}
    labels = list(dict.fromkeys(r["label"] for r in data["results"]))
    return sorted({c for c, _ in rows}), labels, rows


def serving(page_dir: Path, files: list[str]) -> str:
    """Aggregate (per-user) output tokens/s per concurrency and mode, τ per mode, adaptive against the best other."""
    data = _load(page_dir, files[0])
    levels, labels, rows = _serving_rows(data)
    header = ["concurrency"] + [f"`{lab}`" for lab in labels] + (["`adaptive` / best other"]
                                                                  if "adaptive" in labels else [])
    out = []
    for c in levels:
        here = {lab: rows[(c, lab)] for lab in labels if (c, lab) in rows}
        best = max(r["output_tokens_per_s"] for r in here.values())
        cells = [str(c)]
        for lab in labels:
            r = here.get(lab)
            if r is None:
                cells.append("–")
                continue
            v = f"{_int(r['output_tokens_per_s'])} ({_int(r['per_user_tokens_per_s'])})"
            cells.append(f"**{v}**" if r["output_tokens_per_s"] == best else v)
        if "adaptive" in labels:
            others = [r["output_tokens_per_s"] for lab, r in here.items() if lab != "adaptive"]
            a = here.get("adaptive")
            cells.append(f"{a['output_tokens_per_s'] / max(others):.2f}×" if a and others else "–")
        out.append(cells)
    taus = ", ".join(f"`{lab}` {min(rows[(c, lab)]['mean_accepted_length'] for c in levels if (c, lab) in rows):.2f}–"
                     f"{max(rows[(c, lab)]['mean_accepted_length'] for c in levels if (c, lab) in rows):.2f}"
                     for lab in labels if lab != "none")
    errors = sum(r["errors"] for r in data["results"])
    return (_table(header, out) + "\nAggregate output tokens/s (per-user tokens/s in brackets); the best mode of each "
            f"concurrency in bold. Mean accepted length τ over the levels: {taus}. Failed requests: {errors}.\n")


def startup(page_dir: Path, files: list[str]) -> str:
    """Time from the command to /health = 200 of each launch, in launch order."""
    data = _load(page_dir, files[0])
    _serving_rows(data)
    rows = [[str(s["launch"]), f"`{s['mode']}`", f"{s['ready_s']:.1f} s"] for s in data["startup"]]
    return _table(["launch", "mode", "command → `/health` 200"], rows)


def startup_launches(page_dir: Path, files: list[str]) -> str:
    """scripts/bench_startup.py: each launch's time to /health = 200, where it went, and its first requests."""
    data = _load(page_dir, files[0])
    if "launches" not in data:
        raise ValueError("benchmark tables: not a start-up benchmark (scripts/bench_startup.py) JSON")

    def stage(r: dict, prefix: str) -> str:
        found = [v for k, v in r["stages"].items() if k.startswith(prefix)]
        return f"{found[0]:.1f} s" if found else "–"

    rows = []
    for r in data["launches"]:
        graphs = ", ".join(f"{g['count']} {name} {g['seconds']:.1f} s" for name, g in r["graphs"].items())
        first, rest = r["requests_ms"][0], r["requests_ms"][1:]
        rows.append([str(r["launch"]), f"**{r['ready_s']:.1f} s**", f"{r['first_log_s']:.1f} s",
                     f"{r['engine_first_stage_s']:.1f} s", stage(r, "imports"), stage(r, "target weights"),
                     stage(r, "engine") + (f" ({graphs})" if graphs else ""), stage(r, "step-cost table"),
                     stage(r, "kernel warm-up"),
                     f"{first:.0f} / {statistics.median(rest):.0f} ms" if rest else f"{first:.0f} ms"])
    return _table(["launch", "command → `/health` 200", "first log line", "engine's first stage", "imports",
                   "target weights", "caches and graphs", "step-cost table", "warm-up",
                   "first request / median of the next"], rows)


def server_overhead(page_dir: Path, files: list[str]) -> str:
    """scripts/bench_server_overhead.py: server tokens/s against the simulated engine alone, per arm."""
    data = _load(page_dir, files[0])
    if "results" not in data or not all("server_efficiency" in r for r in data["results"]):
        raise ValueError("benchmark tables: not a server-overhead benchmark (scripts/bench_server_overhead.py) JSON")
    rows = []
    for r in data["results"]:
        rows.append([f"`{r['arm']}`", str(r["tokens_per_step"]), str(r["concurrency"]),
                     _int(r["output_tokens_per_s"]), _int(r["engine_bound_tokens_per_s"]),
                     f"{r['server_efficiency']:.2f}", f"{r['step_period_ms']:.2f} ({r['simulated_step_ms']:.2f})",
                     f"{r['server_cpu_us_per_token']:.0f} / {r['client_cpu_us_per_token']:.0f}"])
    return _table(["arm", "tokens/step", "concurrency", "server tokens/s", "engine alone", "ratio",
                   "step period ms (simulated)", "CPU µs/token server / client"], rows)


def linear_chain(page_dir: Path, files: list[str]) -> str:
    """scripts/bench_linear.py: µs per layer of the projection chain, unfused and fused, per token-row count."""
    data = _load(page_dir, files[0])
    if "chain" not in data or "fused_max_rows" not in data:
        raise ValueError("benchmark tables: not a fused-projection benchmark (scripts/bench_linear.py) JSON")
    limit = data["fused_max_rows"]
    rows = [[str(r["rows"]) + (" (engine: fused)" if r["rows"] <= limit else ""),
             f"{r['unfused_us_per_layer']:.1f}", f"{r['fused_us_per_layer']:.1f}", f"{r['speedup']:.2f}×"]
            for r in data["chain"]]
    return _table(["token rows M", "unfused µs/layer (7 kernels)", "fused µs/layer (4 kernels)", "unfused / fused"],
                  rows)


def engine_ab(page_dir: Path, files: list[str]) -> str:
    """Alternating engine runs of one switch (``runs`` of a merged scripts/bench_engine.py file): step ms per mode."""
    data = _load(page_dir, files[0])
    if "runs" not in data or not all("results" in r for r in data["runs"]):
        raise ValueError("benchmark tables: not an engine A/B file (a 'runs' list of scripts/bench_engine.py results)")
    columns = list(dict.fromkeys((r["batch_size"], r["label"]) for run in data["runs"] for r in run["results"]))
    rows = []
    for i, run in enumerate(data["runs"], 1):
        ms = {(r["batch_size"], r["label"]): r["step_ms"] for r in run["results"]}
        rows.append([str(i), str(run["linear_rows"])] + [f"{ms[c]:.3f}" if c in ms else "–" for c in columns])
    return _table(["run", "`--linear-rows`"] + [f"batch {b} `{lab}` (ms/step)" for b, lab in columns], rows)


def step_cost(page_dir: Path, files: list[str]) -> str:
    """Where a step's time goes, before and after (scripts/report_step_cost.py): wall and device ms per step and the
    device ms of each component, per configuration."""
    data = _load(page_dir, files[0])
    comps = data["components"]
    rows = []
    for r in data["results"]:
        if "after" not in r:
            continue
        a, b = r["after"], r.get("before")  # a configuration profiled after only shows "–" before

        def pair(before: float | None, after: float) -> str:
            return f"{'–' if before is None else f'{before:.2f}'} → {after:.2f}"

        cells = [f"`{r['mode']}`", str(r["batch_size"]), pair(b and b["step_ms"], a["step_ms"]),
                 pair(b and b["device_ms"], a["device_ms"])]
        cells += [pair(b and b["components_ms"][c], a["components_ms"][c]) for c in comps]
        rows.append(cells)
    return _table(["mode", "batch", "wall ms / step", "device ms / step"] + comps, rows) + (
        "\nms per step, before → after; components are device time (scripts/report_step_cost.py says which kernels "
        "each holds).\n")


# ---------------------------------------------------------------------------------------------------- inline values

INLINE = re.compile(r"<!-- value: (?P<name>[\w-]+)(?P<args>[^>]*?) -->")


VERDICTS = {"helps": "speculation helps", "loses": "plain decoding is faster", "ties": "a tie"}


def _and(items: list[str]) -> str:
    return "none" if not items else items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _range(xs: list[float], digits: int = 2, unit: str = "×") -> str:
    """``1.17×`` for one value (or several that round alike), ``1.17–1.40×`` for a range, ``none`` for no value."""
    if not xs:
        return "none"
    lo, hi = f"{min(xs):.{digits}f}", f"{max(xs):.{digits}f}"
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def _engine_quantity(data: dict, batch: int, q: str) -> float:
    """One engine-benchmark ratio at one batch size: ``ratio`` (best speculative policy / plain decoding at its
    best), ``adaptive`` (adaptive's best variant / plain decoding at its best), ``adaptive-vs-best`` (adaptive's
    best variant / the best of every other policy, plain decoding included)."""
    row = next((r for r in frontier(data) if r["batch"] == batch), None)
    if row is None:
        raise ValueError(f"benchmark values: no batch {batch} in the engine file")
    if q == "ratio":
        return row["ratio"]
    if q == "adaptive":
        return row["adaptive"]
    if q == "adaptive-vs-best":
        tps = data["summary"][str(batch)]["tokens_per_s"]
        mine = max(v for lab, v in tps.items() if _adaptive(lab))
        return mine / max(v for lab, v in tps.items() if not _adaptive(lab) and lab != "hf")
    raise ValueError(f"benchmark values: unknown engine quantity {q!r}")


def _serving_quantity(data: dict, concurrency: int, q: str) -> float:
    """One serving-benchmark ratio at one concurrency: ``ratio`` (best speculative mode / plain decoding),
    ``adaptive`` (adaptive / plain decoding), ``adaptive-vs-best`` (adaptive / the best other mode)."""
    here = {r["label"]: r["output_tokens_per_s"] for r in data["results"] if r["concurrency"] == concurrency}
    if not here:
        raise ValueError(f"benchmark values: no concurrency {concurrency} in the serving file")
    if q == "ratio":
        return max(v for lab, v in here.items() if lab != "none") / here["none"]
    if q == "adaptive":
        return here["adaptive"] / here["none"]
    if q == "adaptive-vs-best":
        return here["adaptive"] / max(v for lab, v in here.items() if lab != "adaptive")
    raise ValueError(f"benchmark values: unknown serving quantity {q!r}")


def value(name: str, args: list[str], page_dir: Path) -> str:
    """The inline number ``<!-- value: NAME FILE key=value… -->`` stands for (see the module docstring)."""
    if not args:
        raise ValueError(f"benchmark values: {name} needs a JSON file")
    data = _load(page_dir, args[0])
    opt = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    if name == "tau":  # τ of one drafter (arm index, default the first: the shipped one) at one temperature,
        arm = list(data["runs"].values())[int(opt.get("arm", 0))]  # over all prompts or one domain's (domain=code)
        run = arm["T=" + opt.get("T", "0")]
        return f"{run['per_domain'][opt['domain']] if 'domain' in opt else run['mean_accepted_length']:.2f}"
    if name in ("engine", "engine-range"):
        batches = [int(b) for b in opt["batch"].split(",")] if "batch" in opt else \
            sorted(int(b) for b in data["summary"])
        if "verdict" in opt:  # only the batch sizes with that verdict (helps, loses, ties)
            word = VERDICTS[opt["verdict"]]
            batches = [r["batch"] for r in frontier(data) if r["verdict"].startswith(word)]
        return _range([_engine_quantity(data, b, opt.get("q", "ratio")) for b in batches])
    if name == "engine-batches":  # the batch sizes with a verdict: helps, loses or ties
        word = VERDICTS[opt["verdict"]]
        return _and([str(r["batch"]) for r in frontier(data) if r["verdict"].startswith(word)])
    if name == "engine-step":  # one policy's step time over another's at one batch size (label=fixed:7 over=none)
        step = {r["label"]: r["step_ms"] for r in data["results"] if r.get("batch_size") == int(opt["batch"])}
        return f"{step[opt['label']] / step[opt['over']]:.2f}×"
    if name == "engine-ratio":  # one policy's tokens/s over another's at one batch size (label=… over=…)
        tps = data["summary"][opt["batch"]]["tokens_per_s"]
        return f"{tps[opt['label']] / tps[opt['over']]:.2f}×"
    if name == "engine-tau":  # mean accepted length of one policy, over the batch sizes named (default all)
        taus = [r["mean_accepted_length"] for r in data["results"] if r.get("label") == opt["label"]
                and ("batch" not in opt or r["batch_size"] in {int(b) for b in opt["batch"].split(",")})]
        return _range(taus, unit="")
    if name in ("serving", "serving-range"):
        levels = [int(c) for c in opt["concurrency"].split(",")] if "concurrency" in opt else \
            sorted({r["concurrency"] for r in data["results"]})
        return _range([_serving_quantity(data, c, opt.get("q", "ratio")) for c in levels])
    if name == "serving-tps":  # aggregate output tokens/s of one mode at one concurrency
        level = int(opt["concurrency"])
        r = next(r for r in data["results"] if r["label"] == opt["label"] and r["concurrency"] == level)
        return _int(r["output_tokens_per_s"])
    if name == "startup":  # command → /health 200 of a start-up benchmark's launches: first (cold) or the rest
        ready = [r["ready_s"] for r in data["launches"]]
        return _range(ready[:1] if opt.get("launch") == "cold" else ready[1:], digits=1, unit=" s")
    if name == "field":  # one number at a dotted path of any benchmark file (list items by index), as a percentage
        node = data  # with pct=1
        for key in opt["path"].split("."):
            node = node[int(key)] if isinstance(node, list) else node[key]
        return f"{100 * node:.0f} %" if opt.get("pct") else f"{node:.{int(opt.get('digits', 2))}f}"
    if name == "equivalence":  # identical prompt × mode × temperature runs over every named file
        ok = total = 0
        for f in args:
            for counts in _load(page_dir, f)["summary"]["per_mode"].values():
                ok, total = ok + counts["identical"], total + sum(counts.values())
        return f"{ok}/{total}"
    raise ValueError(f"benchmark values: unknown value {name!r}")


def proposers(page_dir: Path, files: list[str]) -> str:
    """τ of each proposer on one prompt set (scripts/report_proposers.py: eval_acceptance runs collected in one file),
    overall and per domain, with the hybrid's split between its two sources and, greedy, the hybrid's τ over the
    better of the other two in each domain."""
    data = _load(page_dir, files[0])
    results = data["results"]
    domains = list(results[0]["per_domain"])
    temps = sorted({r["temperature"] for r in results})
    rows = []
    for r in results:
        src = r.get("sources") or {}
        split = ", ".join(f"{name} {v['share']:.0%} of steps (τ {v['mean_accepted_length']:.2f})"
                          for name, v in src.items() if v["steps"])
        rows.append([f"`{r['proposer']}`"] + ([f"{r['temperature']:g}"] if len(temps) > 1 else [])
                    + [f"**{r['tau']:.2f}**"] + [f"{r['per_domain'][d]:.2f}" for d in domains] + [split or "–"])
    by = {(r["proposer"], r["temperature"]): r for r in results}
    for t in temps:  # the hybrid against the better of its two sources, where all three ran
        hybrid, dspark, ngram = by.get(("hybrid", t)), by.get(("dspark", t)), by.get(("ngram", t))
        if hybrid and dspark and ngram:
            ratio = [hybrid["per_domain"][d] / max(dspark["per_domain"][d], ngram["per_domain"][d]) for d in domains]
            rows.append(["*hybrid ÷ better of the two*"] + ([f"{t:g}"] if len(temps) > 1 else [])
                        + [f"*{hybrid['tau'] / max(dspark['tau'], ngram['tau']):.2f}×*"]
                        + [f"*{x:.2f}×*" for x in ratio] + [""])
    header = ["proposer"] + (["T"] if len(temps) > 1 else []) + ["τ, all"] + domains + ["blocks taken from"]
    s = data["settings"]
    decoding = "greedy" if temps == [0.0] else "T = " + " and ".join(f"{t:g}" for t in temps)
    note = f" {data['note']}" if data.get("note") else ""
    return _table(header, rows) + (f"\n{data['hardware']}; {data['prompts']}; {s['mode']}, {s['max_new_tokens']} "
                                   f"new tokens, {decoding}.{note} Script: `{data['script']}`.\n")


def draft_vocab(page_dir: Path, files: list[str]) -> str:
    """A draft vocabulary's trade: coverage and τ per size, then a speculative step's device time and the engine's
    throughput with and without it (scripts/draft_vocab.py; scripts/reproduce/draft_vocab_h200.sh)."""
    data = _load(page_dir, files[0])
    full = data["vocab_size"]
    domains = list(data["sizes"][0]["greedy"]["per_domain"])
    rows = []
    for r in data["sizes"]:
        t1 = r.get("t1")
        by_domain = " / ".join(f"{r['greedy']['per_domain'][d]:.2f}" for d in domains)
        rows.append([f"{r['size']:,}" + (" (all)" if r["size"] == full else ""), _pct(r["coverage_heldout"]) + " %",
                     f"**{r['greedy']['tau']:.2f}**", by_domain, f"{t1['tau']:.2f}" if t1 else "–"])
    first = _table(["Vd", "held-out coverage", "τ greedy", f"τ by domain ({' / '.join(domains)})", "τ at T = 1"],
                   rows)
    rows = [[str(p["batch_size"]), f"{p['vocab']:,}", f"{p['draft_head_ms']:.2f}", f"{p['device_ms_per_step']:.2f}",
             f"{p['step_ms']:.2f}", f"{p['mean_accepted_length']:.2f}"] for p in data["step_profile"]]
    second = _table(["batch", "Vd", "draft head, ms", "device time, ms / step", "step, ms", "τ (these prompts)"],
                    rows)
    eng = data["engine_tokens_per_s"]
    sizes = sorted(eng, key=int, reverse=True)
    rows = []
    for b in sorted(eng[sizes[0]], key=int):
        for mode in ("none+async", "fixed:7", "adaptive+async"):
            rows.append([b, f"`{mode}`"] + [_int(eng[v][b][mode]) for v in sizes] +
                        [f"{eng[sizes[1]][b][mode] / eng[sizes[0]][b][mode]:.2f}×"])
    third = _table(["batch", "mode"] + [f"Vd = {int(v):,}" for v in sizes] + [f"{int(sizes[1]):,} / {int(sizes[0]):,}"],
                   rows)
    c = data["commands"]
    return (first + f"\n{data['hardware']}; τ: `{command(c['tau'])}`.\n\n" + second
            + f"\nProfile: `{command(c['profile'])}`.\n\n" + third
            + f"\nTokens/s, closed batches, two runs of one script back to back: `{command(c['engine'])}`; "
              f"script `{c['script']}`.\n")


RENDERERS = {
    "proposers": proposers,
    "draft-vocab": draft_vocab,
    "step-cost": step_cost,
    "linear-chain": linear_chain,
    "engine-ab": engine_ab,
    "provenance": provenance,
    "engine-throughput": engine_throughput,
    "cost-check": cost_check,
    "speculation-frontier": speculation_frontier,
    "acceptance": acceptance,
    "calibration": calibration,
    "calibration-methods": calibration_methods,
    "kernels": kernels,
    "gpu-equivalence": gpu_equivalence,
    "summary": summary,
    "checkpoint": checkpoint,
    "serving": serving,
    "startup": startup,
    "startup-launches": startup_launches,
    "server-overhead": server_overhead,
}


def render(kind: str, args: list[str], page_dir: Path) -> str:
    if kind not in RENDERERS:
        raise ValueError(f"benchmark tables: unknown kind {kind!r}; known: {', '.join(RENDERERS)}")
    if not args:
        raise ValueError(f"benchmark tables: {kind} needs at least one JSON file")
    return RENDERERS[kind](page_dir, args)


def on_page_markdown(markdown, page, config, files):
    page_dir = Path(page.file.abs_src_path).parent
    def rendered(m: re.Match) -> str:
        text = render(m["kind"], shlex.split(m["args"]), page_dir)
        return "\n".join(m["indent"] + line if line else line for line in text.split("\n"))

    markdown = DIRECTIVE.sub(rendered, markdown)
    return INLINE.sub(lambda m: value(m["name"], shlex.split(m["args"]), page_dir), markdown)
