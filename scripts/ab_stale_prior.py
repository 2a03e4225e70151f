"""The adaptive budget's stale-row prior, on and off, in one run: ``bench_engine`` alternated between the two arms.

A step of the asynchronous ``adaptive`` mode in which no request has survivals ``staleness`` drafts old (a request
alone in the engine, on its first two verifies) fills those rows with the mean stale curve of the last step that had
one (``reference.scheduler.Scheduler.stale_prior``); before, it filled them with zeros and verified none of that
step's drafts. ``scripts/replay_budget.py`` prices the difference from a cost table; this script measures it on the
engine itself. Two runs of the same build on a shared GPU can differ by more than the difference, so the arms
alternate (``prior``, ``zero_fill``, ``prior``, ... ``--rounds`` times each) within one process and the report gives
each arm's median over its rounds, per batch size and mode, and the ratio of the two medians. The target is loaded
once for every run.

The ``zero_fill`` arm is the engine with ``BudgetPlanner.stale_prior`` answering "none yet" at every step (so the
rows are zeros, as before the prior); nothing else differs. Every argument after ``--`` goes to
``scripts/bench_engine.py`` unchanged (its ``--out`` is set per run, in a temporary folder).

Example (arrivals, one request at a time; the GPU numbers in ``docs/benchmarks/`` come from this command)::

    python -m scripts.ab_stale_prior --rounds 3 --out docs/benchmarks/stale-prior-ab-h100.json -- \\
        --modes fixed:7+async,adaptive+async --batch-sizes 1 --requests-per-slot 16 --output-len-spread 0.5 \\
        --hf-max-batch 0 --repeats 3 --cost-feedback
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optimized.scheduler import BudgetPlanner
from reference.cli import LOG_FORMAT
from reference.target import Target
from scripts import bench_engine

log = logging.getLogger("dspark.ab_stale_prior")

ARMS = ("prior", "zero_fill")


@contextlib.contextmanager
def arm(name: str) -> Iterator[None]:
    """The engine as it is (``prior``) or with its budget's prior withheld (``zero_fill``: zeros, as before it)."""
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r}; expected one of {ARMS}")
    if name == "prior":
        yield
        return
    original = BudgetPlanner.stale_prior
    BudgetPlanner.stale_prior = lambda self: None  # no prior yet: the stale rows are filled with zeros
    try:
        yield
    finally:
        BudgetPlanner.stale_prior = original


@contextlib.contextmanager
def target_loaded_once() -> Iterator[None]:
    """``Target.load`` remembered by its arguments for the block: every run of both arms shares one target (each
    run already builds an engine per configuration from one), instead of loading and converting it again."""
    loaded: dict[str, Target] = {}
    original = Target.__dict__["load"]  # the classmethod itself, put back as it was

    def load(cls: type[Target], *args: Any, **kwargs: Any) -> Target:
        key = repr((args, sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = original.__func__(cls, *args, **kwargs)
        return loaded[key]

    Target.load = classmethod(load)
    try:
        yield
    finally:
        Target.load = original


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size and mode: each arm's tokens/s over its rounds, their medians and ``prior / zero_fill``."""
    table: dict[str, dict[str, dict[str, list[float]]]] = {}
    for run in runs:
        for r in run["results"]:
            if r.get("engine") != "optimized":
                continue
            cell = table.setdefault(str(r["batch_size"]), {}).setdefault(r["label"], {a: [] for a in ARMS})
            cell[run["arm"]].append(float(r["output_tokens_per_s"]))
    out: dict[str, Any] = {}
    for b, modes in table.items():
        out[b] = {}
        for label, arms in modes.items():
            med = {a: round(statistics.median(v), 1) if v else None for a, v in arms.items()}
            ratio = (round(med["prior"] / med["zero_fill"], 4)
                     if med["prior"] is not None and med["zero_fill"] else None)
            out[b][label] = {"tokens_per_s": arms, "median_tokens_per_s": med, "prior_over_zero_fill": ratio}
    return out


def main(argv: list[str] | None = None, **bench_kwargs: Any) -> dict[str, Any]:
    """Command line; ``bench_kwargs`` (``target``, ``drafter``, ``prompt_ids``) go to ``bench_engine.main`` (tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, bench_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs of each arm, alternated")
    p.add_argument("--out", default="stale-prior-ab.json", help="the JSON report")
    args = p.parse_args(own)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if any(a == "--out" or a.startswith("--out=") for a in bench_argv):
        raise SystemExit("give --out before '--': each bench_engine run writes its own file in a temporary folder")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    start = time.time()
    runs = []
    with tempfile.TemporaryDirectory() as tmp, target_loaded_once():
        for i in range(args.rounds):
            for name in ARMS:
                log.info("round %d/%d, arm %s", i + 1, args.rounds, name)
                with arm(name):
                    report = bench_engine.main([*bench_argv, "--out", str(Path(tmp) / f"{name}-{i}.json")],
                                               **bench_kwargs)
                runs.append({"arm": name, "round": i, **report})
    first = runs[0]
    result = {"what": "bench_engine with the adaptive budget's stale-row prior (prior) and without it (zero_fill), "
                      "alternated in one process",
              "hardware": first["hardware"], "model": first["model"], "drafter": first["drafter"],
              "command": "python -m scripts.ab_stale_prior " + shlex.join(argv),
              "rounds": args.rounds, "settings": first["settings"], "summary": summarise(runs),
              "total_s": round(time.time() - start, 1)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for b, modes in result["summary"].items():
        for label, cell in modes.items():
            log.info("batch %4s %-16s prior / zero_fill %s (medians %s)", b, label, cell["prior_over_zero_fill"],
                     cell["median_tokens_per_s"])
    log.info("wrote %s", args.out)
    return result


if __name__ == "__main__":
    main()
