"""Collect ``scripts/eval_acceptance.py`` runs of several proposers (and temperatures) on one prompt file into one JSON.

    python -m scripts.report_proposers --run dspark:0=dspark-t0.json --run ngram:0=ngram-t0.json \
        --run hybrid:0=hybrid-t0.json --script scripts/reproduce/proposers_tasks_h200.sh \
        --out docs/benchmarks/proposers-tasks-h200.json

Each ``--run PROPOSER:TEMPERATURE=FILE`` adds one result: τ overall (pooled over every verify step, with its standard
error), τ per domain of the prompt file, and, for the hybrid proposer, how its steps split between its two sources,
overall and per domain. The runs must share the prompt file, the number of new tokens, the verify policy and the
hardware, or the table would compare unlike things: the script refuses them otherwise. The machine-specific paths of
each run's command (the target's file, the JSON it wrote) are replaced by placeholders. ``docs/hooks`` renders the
file as a table (``<!-- benchmark: proposers FILE -->``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

# What must be equal across the runs of one report (from each run's "settings", then its top level).
SHARED_SETTINGS = ("max_new_tokens", "gamma", "scheduler", "k", "dtype", "engine")


def portable_command(command: str) -> str:
    """The run's command with its machine-specific paths replaced: ``--model`` by ``TARGET.gguf`` (a ``.gguf`` file;
    a model name stays), ``--json`` by its file name under ``docs/benchmarks/``."""
    words = shlex.split(command)
    for i, word in enumerate(words[:-1]):
        if word == "--model" and words[i + 1].endswith(".gguf"):
            words[i + 1] = "TARGET.gguf"
        elif word == "--json":
            words[i + 1] = f"RESULTS/{Path(words[i + 1]).name}"
    return " ".join(shlex.quote(w) for w in words)


def result(proposer: str, temperature: float, run: dict[str, Any]) -> dict[str, Any]:
    """One row of the report from one eval_acceptance JSON."""
    row = {"proposer": proposer, "temperature": temperature, "tau": round(run["mean_accepted_length"], 4),
           "tau_se": round(run["mean_accepted_length_se"], 4) if run.get("mean_accepted_length_se") is not None
           else None,
           "per_domain": {d: round(v, 4) for d, v in run["per_domain"].items()},
           "steps": run["counts"]["steps"], "command": portable_command(run["command"])}
    if run.get("sources"):
        row["sources"] = _sources(run["sources"])
        row["per_domain_sources"] = {d: _sources(detail["sources"]) for d, detail in run["per_domain_detail"].items()
                                     if detail.get("sources")}
    return row


def _sources(src: dict[str, Any]) -> dict[str, Any]:
    return {name: {"steps": v["steps"], "share": round(v["share"], 4),
                   "mean_accepted_length": round(v["mean_accepted_length"], 4) if v["steps"] else None}
            for name, v in src.items()}


def build(runs: list[tuple[str, float, dict[str, Any]]], script: str | None, note: str | None) -> dict[str, Any]:
    """The report of ``runs`` (proposer, temperature, eval_acceptance JSON), checked for like-for-like settings."""
    if not runs:
        raise ValueError("no runs given")
    first = runs[0][2]
    for proposer, t, run in runs[1:]:
        for key in ("prompts_file", "hardware"):
            if run.get(key) != first.get(key):
                raise ValueError(f"{proposer} at T={t:g}: {key} {run.get(key)!r} differs from the first run's "
                                 f"{first.get(key)!r}")
        for key in SHARED_SETTINGS:
            if run["settings"].get(key) != first["settings"].get(key):
                raise ValueError(f"{proposer} at T={t:g}: settings.{key} {run['settings'].get(key)!r} differs from "
                                 f"the first run's {first['settings'].get(key)!r}")
    s = first["settings"]
    limit = re.search(r"--limit (\d+)", first["command"])
    prompts = first["prompts_file"] + (f" (--limit {limit.group(1)}: that many prompts, taken in turn from each "
                                       "domain)" if limit else "")
    mode = f"{s['scheduler']} K = {s['k']}" + (" (the full block verified)" if s.get("k") == s.get("gamma") else "")
    report = {"hardware": f"{first['hardware']}, {s.get('dtype', '')}, {s.get('engine', '')} engine".strip(", "),
              "prompts": prompts,
              "settings": {"mode": mode, "max_new_tokens": s["max_new_tokens"], "gamma": s.get("gamma"),
                           "drafter": first.get("drafter")},
              "script": script or "",
              "results": [result(p, t, run) for p, t, run in runs]}
    if note:
        report["note"] = note
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="PROPOSER:T=FILE",
                   help="an eval_acceptance JSON of one proposer at one temperature (repeat; table order)")
    p.add_argument("--script", default=None, help="the script that ran them, recorded in the report")
    p.add_argument("--note", default=None, help="free text recorded in the report")
    p.add_argument("--out", required=True, help="output JSON path")
    args = p.parse_args(argv)
    runs = []
    for item in args.run:
        key, _, path = item.partition("=")
        proposer, _, temp = key.rpartition(":")
        if not proposer or not temp or not path:
            raise SystemExit(f"--run expects PROPOSER:TEMPERATURE=FILE, got {item!r}")
        try:
            runs.append((proposer, float(temp), json.loads(Path(path).read_text())))
        except (OSError, ValueError) as err:
            raise SystemExit(f"--run {item}: {err}") from err
    try:
        report = build(runs, args.script, args.note)
    except (ValueError, KeyError) as err:
        raise SystemExit(f"cannot report these runs together: {err}") from err
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for r in report["results"]:
        print(f"{r['proposer']:>8} T={r['temperature']:g}  τ {r['tau']:.3f}  "
              + "  ".join(f"{d} {v:.2f}" for d, v in r["per_domain"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
