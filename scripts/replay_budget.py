"""What the adaptive budget's fill of a step without stale survivals is worth to requests that arrive one at a time.

The asynchronous ``adaptive`` mode plans each step's budget from survivals ``staleness`` (2) drafts old
(``reference.scheduler.Scheduler.lengths``). A request's first two verifies have no such row; when no other request
has one either (a request alone in the engine, or a batch that starts together), the budget used to see rows of
zeros and verified none of those drafts, though the drafter had paid for them. The fill is now the mean stale curve of
the last step that had one (``Scheduler.stale_prior``). This script measures the difference where it is largest, one
request at a time.

It decodes held-out prompts with the optimized engine in mode ``fixed`` with ``k = γ`` (every draft verified;
float32 on the CPU by default: the tokens and survivals do not depend on the hardware's speed), keeping each request's
calibrated survivals per draft and the drafts accepted. It then replays, request after request, the budget each
policy would have planned at each step, priced by a measured cost table (``--cost-table``: a cost table JSON, or a
benchmark JSON holding ``cost_table_async``), with one request in the engine:

* ``fixed``: every draft verified, ``ℓ = γ``;
* ``zero_fill``: the adaptive policy made afresh for each request (no prior: its first two budgets see zeros), as
  the engine planned before the prior;
* ``prior``: the adaptive policy kept across the requests, as the engine keeps it (its prior carries over);
* ``current``: the budget on the step's own survivals (not lossless: an upper mark, not a mode).

A step's accepted drafts under a budget of ``ℓ`` are ``min(ℓ, accepted with the whole block verified)`` (a verified
slot's outcome does not depend on the slots after it: the random-number contract). The replay keeps the drafts of
the full-block run, so a policy that accepts fewer tokens at a step is credited with the next step's drafts as that
run had them: a per-step replay, not a re-decoding. Reported per policy: τ (tokens per step), mean ℓ, seconds per
step at the table's prices (verify of ``1 + ℓ`` tokens plus the draft, one request) and tokens per second, relative
to ``fixed``.

Example::

    python -m scripts.replay_budget --requests 48 --cost-table docs/benchmarks/engine-h100-async-all.json \\
        --out docs/benchmarks/budget-prior-cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from optimized.engine import Engine, EngineConfig, SamplingParams
from reference.cli import LOG_FORMAT
from reference.config import SchedulerConfig
from reference.cost_model import CostTable, hardware_name
from reference.drafter import DSparkDrafter
from reference.scheduler import Scheduler, best_budget
from reference.target import Target
from scripts.benchmarking import add_drafted_decode_args, load_drafted_models, load_prompts

log = logging.getLogger("dspark.replay_budget")


def record(target: Target, drafter: DSparkDrafter, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
           device: str, dtype: torch.dtype) -> list[dict]:
    """Decode ``prompts`` verifying every draft; per request, its drafts' survivals ``[n, γ]`` and accepted counts."""
    longest = max(len(p) for p in prompts)
    engine = Engine(target, drafter, EngineConfig(max_num_seqs=batch_size, max_seq_len=longest + max_new_tokens + 64,
                                                  device=device, dtype=dtype, seed=0, async_decode=False),
                    SchedulerConfig(mode="fixed", k=drafter.config.block_size))
    traces = []
    for i in tqdm(range(0, len(prompts), batch_size), desc="decoding (full blocks)"):
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
               for p in prompts[i:i + batch_size]]
        while engine.has_unfinished():
            engine.step()
        for rid in ids:
            seq = engine.sequence(rid)
            n = min(len(seq.survivals), len(seq.accepted_lengths))
            traces.append({"survivals": torch.tensor([list(map(float, a)) for a in seq.survivals[:n]],
                                                     dtype=torch.float32).reshape(n, -1),
                           "accepted": [int(x) for x in seq.accepted_lengths[:n]]})
    return traces


def replay(traces: list[dict], cost: CostTable, gamma: int, staleness: int,
           budget_of: Callable[[Scheduler, torch.Tensor, torch.Tensor], int], keep: bool) -> dict:
    """One policy over the requests in turn (one in the engine at a time): τ, mean ℓ, seconds per step, tokens/s."""
    config = SchedulerConfig(mode="adaptive", staleness=staleness)
    policy = Scheduler(config, gamma=gamma, cost=cost)
    tokens = steps = verified = 0
    seconds = 0.0
    for tr in traces:
        if not keep:
            policy = Scheduler(config, gamma=gamma, cost=cost)
        a, acc = tr["survivals"], tr["accepted"]
        for j in range(len(acc)):
            stale = a[j - staleness][None] if j >= staleness else torch.full((1, gamma), float("nan"))
            ell = budget_of(policy, a[j][None], stale)
            tokens += min(ell, acc[j]) + 1
            verified += ell
            steps += 1
            seconds += cost.step_time(1 + ell, 1)
    return {"tau": round(tokens / steps, 4), "mean_verify_length": round(verified / steps, 3), "steps": steps,
            "step_ms": round(1e3 * seconds / steps, 4), "tokens_per_s": round(tokens / seconds, 1)}


POLICIES: dict[str, tuple[Callable[[Scheduler, torch.Tensor, torch.Tensor], int], bool]] = {
    "fixed": (lambda policy, now, stale: policy.gamma, True),
    "zero_fill": (lambda policy, now, stale: int(policy.lengths(now, a_stale=stale,
                                                                          num_anchor_tokens=1).sum()), False),
    "prior": (lambda policy, now, stale: int(policy.lengths(now, a_stale=stale,
                                                                      num_anchor_tokens=1).sum()), True),
    "current": (lambda policy, now, stale: best_budget(now, policy.cost, 1), True),
}


def load_cost_table(path: str) -> tuple[CostTable, str]:
    """A cost table JSON, or a benchmark JSON's ``cost_table_async`` (else its ``cost_table``); and its hardware."""
    data = json.loads(Path(path).read_text())
    table = data.get("cost_table_async") or data.get("cost_table") or data
    try:
        return CostTable.from_dict(table), table.get("hardware", "unknown")
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"{path}: not a cost table, nor a benchmark JSON with one ({e})") from e


def main(argv: list[str] | None = None, *, target: Target | None = None, drafter: DSparkDrafter | None = None,
         prompt_ids: list[list[int]] | None = None) -> dict:
    """Record, replay and write ``--out``; ``target``, ``drafter``, ``prompt_ids`` replace the loaded ones (tests)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_drafted_decode_args(p, max_prompt_tokens=384)
    p.add_argument("--cost-table", required=True, help="cost table JSON, or a benchmark JSON with cost_table_async")
    p.add_argument("--requests", type=int, default=48, help="requests (held-out prompts), replayed one at a time")
    p.add_argument("--staleness", type=int, default=SchedulerConfig.staleness, help="the budget's staleness")
    p.add_argument("--batch-size", type=int, default=4, help="requests decoded together while recording")
    p.add_argument("--out", default="budget-prior.json", help="the JSON report")
    args = p.parse_args(argv)
    if args.requests < 1 or args.max_new_tokens < 2 or args.staleness < 1 or args.batch_size < 1:
        raise SystemExit("need --requests ≥ 1, --max-new-tokens ≥ 2, --staleness ≥ 1 and --batch-size ≥ 1")
    cost, cost_hw = load_cost_table(args.cost_table)
    target, drafter, dtype = load_drafted_models(args, target, drafter)
    prompts = prompt_ids if prompt_ids is not None else load_prompts(args, target, args.requests)
    prompts = prompts[:args.requests]
    start = time.time()
    traces = record(target, drafter, prompts, args.max_new_tokens, args.batch_size, args.device, dtype)
    gamma = drafter.config.block_size
    results = {name: replay(traces, cost, gamma, args.staleness, fn, keep) for name, (fn, keep) in POLICIES.items()}
    base = results["fixed"]["tokens_per_s"]
    for r in results.values():
        r["over_fixed"] = round(r["tokens_per_s"] / base, 4)
    report = {"what": "adaptive budgets replayed one request at a time on the drafts of a full-block run, priced by a "
                      "measured cost table",
              "hardware": hardware_name(args.device),
              "prices": cost_hw, "device": args.device, "dtype": str(dtype),
              "command": "python -m scripts.replay_budget " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "drafter": args.drafter,
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "requests": len(traces), "drafts": sum(len(t["accepted"]) for t in traces), "results": results,
              "total_s": round(time.time() - start, 1)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        log.info("%-10s τ %.3f  ℓ %.2f  %.3f ms/step  %.3f× fixed", name, r["tau"], r["mean_verify_length"],
                 r["step_ms"], r["over_fixed"])
    log.info("wrote %s", args.out)
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    main()
