"""One engine change, on and off, in one run: ``bench_engine`` alternated between two arms, for a same-run A/B.

Two runs of the same build on a shared GPU can differ by more than a change worth having, so the arms alternate
(``new``, ``old``, ``new``, ... ``--rounds`` times each) within one process, and the report gives each arm's median over
its rounds, per batch size and mode, and the ratio of the two medians. The target is loaded once for every run; each
run builds its engines (and captures their graphs) under its arm. Every argument after ``--`` goes to
``scripts/bench_engine.py`` unchanged (its ``--out`` is set per run, in a temporary folder). The experiments
(``--experiment``):

* ``stale_prior``, arms ``prior`` and ``zero_fill``: the adaptive budget's stale-row prior. A step of the asynchronous
  ``adaptive`` mode in which no request has survivals ``staleness`` drafts old (a request alone in the engine, on its
  first two verifies) fills those rows with the mean stale curve of the last step that had one
  (``reference.scheduler.Scheduler.stale_prior``); ``zero_fill`` is the engine with ``BudgetPlanner.stale_prior``
  answering "none yet" at every step, so the rows are zeros and that step verifies none of its drafts.
  ``scripts/replay_budget.py`` prices the same difference from a cost table.
* ``draft_head``, arms ``table`` and ``previous``: the Markov head's launches (``optimized/kernels/draft_head.py``):
  ``SPLIT_TABLE`` and ``SPLIT_MAX_R`` as they are, against ``PREVIOUS_SPLIT_TABLE`` and ``PREVIOUS_SPLIT_MAX_R``, the
  launches before ``scripts/bench_draft_head.py`` measured them in the draft graph.
* ``small_rows``, arms ``table`` and ``previous``: the fused projections' ``tl.dot`` launches for steps of 3 to 16
  token rows (``optimized/kernels/linear.py``): ``DOT_TILES`` as it is (split K, the norm's pass in one tile, the
  pipeline depth ``scripts/bench_linear.py --sweep`` chose) against ``PREVIOUS_DOT_TILES``.

Example (arrivals, one request at a time; docs/benchmarks/stale-prior-ab-h100.json came from this experiment, run as
``python -m scripts.ab_stale_prior``, which remains its shorthand)::

    python -m scripts.ab_engine --experiment stale_prior --rounds 3 --out stale-prior-ab.json -- \\
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

from optimized.kernels import draft_head, linear
from optimized.scheduler import BudgetPlanner
from reference.cli import LOG_FORMAT
from reference.target import Target
from scripts import bench_engine
from scripts.benchmarking import dot_tiles_from_file

log = logging.getLogger("dspark.ab_engine")


@contextlib.contextmanager
def _zero_fill() -> Iterator[None]:
    """The adaptive budget with its prior withheld: the stale rows of a step without any are zeros."""
    original = BudgetPlanner.stale_prior
    BudgetPlanner.stale_prior = lambda self: None  # no prior yet: the stale rows are filled with zeros
    try:
        yield
    finally:
        BudgetPlanner.stale_prior = original


@contextlib.contextmanager
def _previous_draft_head() -> Iterator[None]:
    """The Markov head's launches before the in-graph sweep (``PREVIOUS_SPLIT_TABLE``, ``PREVIOUS_SPLIT_MAX_R``)."""
    saved = draft_head.SPLIT_TABLE, draft_head.SPLIT_MAX_R
    draft_head.SPLIT_TABLE, draft_head.SPLIT_MAX_R = draft_head.PREVIOUS_SPLIT_TABLE, draft_head.PREVIOUS_SPLIT_MAX_R
    try:
        yield
    finally:
        draft_head.SPLIT_TABLE, draft_head.SPLIT_MAX_R = saved


@contextlib.contextmanager
def _previous_small_rows() -> Iterator[None]:
    """The fused projections' tl.dot tiles before the split-K sweep (``PREVIOUS_DOT_TILES``)."""
    saved = linear.DOT_TILES
    linear.DOT_TILES = linear.PREVIOUS_DOT_TILES
    try:
        yield
    finally:
        linear.DOT_TILES = saved


# experiment -> (what it compares, (the engine as it is, arm name), (the baseline arm's name, its context))
EXPERIMENTS: dict[str, tuple[str, str, tuple[str, Any]]] = {
    "stale_prior": ("the adaptive budget's stale-row prior (prior) and zeros instead (zero_fill)", "prior",
                    ("zero_fill", _zero_fill)),
    "draft_head": ("the Markov head's launches from the in-graph sweep (table) and those before it (previous)",
                   "table", ("previous", _previous_draft_head)),
    "small_rows": ("the fused projections' tl.dot tiles of 3-16 rows from the split-K sweep (table) and those before "
                   "it (previous)", "table", ("previous", _previous_small_rows)),
}


def arms(experiment: str) -> tuple[str, str]:
    """The two arms of ``experiment``: the engine as it is, then the baseline."""
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}; expected one of {sorted(EXPERIMENTS)}")
    _, new, (old, _) = EXPERIMENTS[experiment]
    return new, old


@contextlib.contextmanager
def arm(name: str, experiment: str = "stale_prior") -> Iterator[None]:
    """The engine as it is (the experiment's first arm) or with the change undone (its baseline arm)."""
    new, old = arms(experiment)
    if name not in (new, old):
        raise ValueError(f"unknown arm {name!r}; expected one of {(new, old)}")
    if name == new:
        yield
        return
    with EXPERIMENTS[experiment][2][1]():
        yield


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


def summarise(runs: list[dict[str, Any]], names: tuple[str, str] = ("prior", "zero_fill")) -> dict[str, Any]:
    """Per batch size and mode: each arm's tokens/s over its rounds, their medians and ``NEW_over_OLD``, the ratio of
    the medians (``names``: the two arms, the engine as it is first); likewise each arm's engine step time
    (``step_ms``) and mean accepted length (``tau``), and ``step_OLD_over_NEW``, the ratio of the median step times.

    Tokens/s is τ × steps/s. Arms whose kernels sum in another order can emit other greedy tokens in bfloat16, and so
    accept other drafts: their τ differs by chance, and only the step time says which step is cheaper."""
    new, old = names
    table: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for run in runs:
        for r in run["results"]:
            if r.get("engine") != "optimized":
                continue
            cell = table.setdefault(str(r["batch_size"]), {}).setdefault(
                r["label"], {key: {a: [] for a in names} for key in ("tokens_per_s", "step_ms", "tau")})
            cell["tokens_per_s"][run["arm"]].append(float(r["output_tokens_per_s"]))
            if "step_ms" in r:
                cell["step_ms"][run["arm"]].append(float(r["step_ms"]))
            if "mean_accepted_length" in r:
                cell["tau"][run["arm"]].append(float(r["mean_accepted_length"]))

    def medians(arms: dict[str, list[float]], digits: int) -> dict[str, float | None]:
        return {a: round(statistics.median(v), digits) if v else None for a, v in arms.items()}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    out: dict[str, Any] = {}
    for b, modes in table.items():
        out[b] = {}
        for label, cell in modes.items():
            tps, step, tau = medians(cell["tokens_per_s"], 1), medians(cell["step_ms"], 4), medians(cell["tau"], 3)
            out[b][label] = {"tokens_per_s": cell["tokens_per_s"], "median_tokens_per_s": tps,
                             f"{new}_over_{old}": ratio(tps[new], tps[old]),
                             "step_ms": cell["step_ms"], "median_step_ms": step,
                             f"step_{old}_over_{new}": ratio(step[old], step[new]),
                             "tau": cell["tau"], "median_tau": tau}
    return out


def main(argv: list[str] | None = None, *, prog: str = "ab_engine", experiment: str = "stale_prior",
         **bench_kwargs: Any) -> dict[str, Any]:
    """Command line; ``bench_kwargs`` (``target``, ``drafter``, ``prompt_ids``) go to ``bench_engine.main`` (tests);
    ``prog`` names the script in the recorded command, ``experiment`` is ``--experiment``'s default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, bench_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--experiment", default=experiment, choices=sorted(EXPERIMENTS), help="the change measured")
    p.add_argument("--rounds", type=int, default=3, help="runs of each arm, alternated")
    p.add_argument("--out", default=None, help="the JSON report (default EXPERIMENT-ab.json)")
    p.add_argument("--dot-tiles", default=None,
                   help="small_rows: a JSON file with the tl.dot tiles of the table arm, a DOT_TILES table or a "
                        "scripts/bench_linear.py --sweep report (its first proposed table) (default: DOT_TILES as "
                        "it is)")
    args = p.parse_args(own)
    if args.dot_tiles and args.experiment != "small_rows":
        raise SystemExit("--dot-tiles is for --experiment small_rows")
    tiles = dot_tiles_from_file(args.dot_tiles) if args.dot_tiles else None
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if any(a == "--out" or a.startswith("--out=") for a in bench_argv):
        raise SystemExit("give --out before '--': each bench_engine run writes its own file in a temporary folder")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    names = arms(args.experiment)
    out_path = Path(args.out or f"{args.experiment.replace('_', '-')}-ab.json")
    start = time.time()
    runs = []
    with tempfile.TemporaryDirectory() as tmp, target_loaded_once(), linear.dot_tiles_in_force(tiles):
        for i in range(args.rounds):
            for name in names:
                log.info("round %d/%d, arm %s", i + 1, args.rounds, name)
                with arm(name, args.experiment):
                    report = bench_engine.main([*bench_argv, "--out", str(Path(tmp) / f"{name}-{i}.json")],
                                               **bench_kwargs)
                runs.append({"arm": name, "round": i, **report})
        table = linear.DOT_TILES  # the table arm's tiles
    first = runs[0]
    result = {"what": f"bench_engine with {EXPERIMENTS[args.experiment][0]}, alternated in one process",
              "experiment": args.experiment, "arms": list(names),
              "hardware": first["hardware"], "model": first["model"], "drafter": first["drafter"],
              "command": f"python -m scripts.{prog} " + shlex.join(argv),
              "rounds": args.rounds, "settings": first["settings"], "summary": summarise(runs, names),
              **({"dot_tiles": {"table": table, "previous": linear.PREVIOUS_DOT_TILES}}
                 if args.experiment == "small_rows" else {}),
              "total_s": round(time.time() - start, 1)}
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    key, step_key = f"{names[0]}_over_{names[1]}", f"step_{names[1]}_over_{names[0]}"
    for b, modes in result["summary"].items():
        for label, cell in modes.items():
            log.info("batch %4s %-16s %s %s (medians %s), %s %s (ms %s), τ %s", b, label, key, cell[key],
                     cell["median_tokens_per_s"], step_key, cell[step_key], cell["median_step_ms"], cell["median_tau"])
    log.info("wrote %s", out_path)
    return result


if __name__ == "__main__":
    main()
