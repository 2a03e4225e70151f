"""In-graph sweep of the fused draft head's launch parameters (``optimized/kernels/draft_head.py``).

The engine runs the drafter's Markov head inside its draft CUDA graph, once per drafting step, for R requests (the
graph's bucket size): γ slots, each a pass over the whole vocabulary. Which kernel runs, and how, is decided by
module constants: ``SPLIT_MAX_R`` (one program per request from that many requests on, else the split-vocabulary
kernels), and for the split kernels ``SPLIT_TABLE`` (by R: the W2 tile, the warps, and whether the per-row reductions
are done by the last program of each row instead of launches of their own, and the requests a program of the logits
launch). This script times every combination the way the engine pays for it: each variant is captured in
a CUDA graph with the engine's arguments (``probs_out`` with ``probs_rows``, ``store_greedy=False``, bf16 weights and
U_k, SmolLM2-135M's shapes, γ = 7) and the graph replayed. Eager timings would add ~0.9 ms of Python launch overhead
a draft and hide the device time that decides.

Per batch size R and temperature (greedy rows, the engine's default, and sampled rows at T = 1) it reports each
variant's µs per draft (median over ``--repeats`` of the mean of ``--iters`` replays), whether its tokens equal the
current default's (greedy: they must; sampled: a different block cut changes the softmax sums in the last ulp, which
may flip a race between near-equal lanes), the current default, the fastest variant and their ratio. The defaults
are changed by hand from this report, with the JSON cited where they are set. The report is rewritten after every
(R, T), so a run cut short keeps what it measured (``complete`` says whether it finished).

    python -m scripts.bench_draft_head --out docs/benchmarks/draft-head-graph-h100.json

On the CPU (``--tiny``, the default there) it runs miniature shapes eagerly under the Triton interpreter: a smoke
test of the sweep, not a timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from optimized.kernels import draft_head
from reference.cli import LOG_FORMAT
from reference.cost_model import hardware_name
from scripts.bench_kernels import time_us
from scripts.benchmarking import default_tag, save_plot

log = logging.getLogger("dspark.bench_draft_head")
ROOT = Path(__file__).resolve().parent.parent

FULL = dict(vocab=49152, hidden=576, rank=64, gamma=7)  # SmolLM2-135M with the shipped drafter's Markov head
TINY = dict(vocab=300, hidden=32, rank=16, gamma=3)


ROWS = (1, 16, 32, 64)  # requests a program of the split logits launch (1, or powers of two >= 16: the tl.dot minimum)


def variants(R: int, tiles: list[int], warps: list[int], tiny: bool, rows_options: tuple[int, ...] = ROWS
             ) -> list[dict]:
    """The launch configurations tried at R requests: the one-program kernel, then the split kernels over requests a
    program (up to R: 16 only from 16 requests on, 32 from 32, 64 from 64; 1 and 16 at any R with ``tiny``), W2
    tile, warps and fused reductions."""
    out = [dict(split=False)]
    for rows, tile, w, fused in itertools.product(rows_options, tiles, warps, (False, True)):
        if rows > 1 and rows > R and not (tiny and rows == 16):
            continue  # a program of more rows than requests only adds masked lanes
        out.append(dict(split=True, split_rows=rows, split_tile=tile, split_warps=w, fused_reductions=fused))
    return out


def default_variant(R: int, device: torch.device) -> dict:
    """What ``sample_draft_block`` does today at R requests (its ``None`` arguments resolved)."""
    split = device.type == "cuda" and R < draft_head.SPLIT_MAX_R
    if not split:
        return dict(split=False)
    launch = draft_head.split_launch(R)
    return dict(split=True, split_rows=launch["rows"], split_tile=launch["tile"], split_warps=launch["warps"],
                fused_reductions=launch["fused"])


def label(v: dict) -> str:
    if not v["split"]:
        return "one-program"
    return (f"split rows={v['split_rows']} tile={v['split_tile']} warps={v['split_warps']}"
            f"{' fused' if v['fused_reductions'] else ''}")


def make_inputs(R: int, shapes: dict, temperature: float, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> dict:
    """The engine's arguments for R requests: bf16 U_k ``[R, γ, V]`` and ``h``, the drafter's tables, one slot row
    each in an ``[R, γ, V]`` fp32 buffer."""
    g, V, d, r = shapes["gamma"], shapes["vocab"], shapes["hidden"], shapes["rank"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return dict(base_logits=rand(R, g, V, scale=2.0), h=rand(R, g, d),
                anchor_ids=torch.randint(0, V, (R,), generator=gen).to(device),
                anchor_pos=torch.full((R,), 300, device=device), temperature=torch.full((R,), temperature,
                                                                                       device=device),
                seed=7, request_ids=torch.arange(R, device=device),
                w1=rand(V, r, scale=0.1), w2=rand(V, r, scale=0.1), conf_w=rand(d + r, scale=0.05),
                conf_b=torch.zeros(1, dtype=dtype, device=device),
                probs_out=torch.zeros(R, g, V, dtype=torch.float32, device=device),
                probs_rows=torch.arange(R, dtype=torch.int32, device=device))


def draft_fn(inputs: dict, variant: dict) -> Callable[[], torch.Tensor]:
    """One draft of ``variant`` on ``inputs`` (greedy rows store no ``p_d``, as in the engine): its tokens."""
    def call() -> torch.Tensor:
        return draft_head.sample_draft_block(**inputs, backend="triton", store_greedy=False, **variant).tokens
    return call


def time_graph(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, iters: int
               ) -> tuple[float, torch.Tensor]:
    """µs per call of ``fn`` replayed from a CUDA graph, and its output; on the CPU (the interpreter: a smoke test, not
    a timing) the time of one eager call."""
    if device.type != "cuda":
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e6, out
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compiles, and leaves the allocations the capture reuses
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return time_us(graph.replay, device, repeats, iters), out.clone()


def sweep(batches: list[int], temperatures: list[float], shapes: dict, device: torch.device, dtype: torch.dtype,
          tiles: list[int], warps: list[int], repeats: int, iters: int, tiny: bool, rows_options: tuple[int, ...],
          on_row: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every variant at every (R, T): its µs per draft and whether its tokens equal the default variant's.
    ``on_row`` gets the rows so far after each (R, T) (the report is written as it grows)."""
    rows = []
    for R, temp in itertools.product(batches, temperatures):
        inputs = make_inputs(R, shapes, temp, device, dtype, seed=R)
        base = default_variant(R, device)
        grid = variants(R, tiles, warps, tiny, rows_options)
        if base not in grid:
            grid.insert(0, base)
        base_us, base_tokens = time_graph(draft_fn(inputs, base), device, repeats, iters)
        results = []
        for v in tqdm(grid, desc=f"R={R} T={temp}", disable=None):
            try:
                us, tokens = (base_us, base_tokens) if v == base else time_graph(draft_fn(inputs, v), device,
                                                                                  repeats, iters)
            except Exception as e:  # a tile that does not compile (registers, shared memory) is skipped
                log.warning("R=%d T=%s %s: %s", R, temp, label(v), str(e).splitlines()[0][:200])
                continue
            results.append({"variant": label(v), "config": v, "us": round(us, 2),
                            "tokens_equal": bool(torch.equal(tokens, base_tokens))})
        best = min(results, key=lambda x: x["us"])
        rows.append({"R": R, "temperature": temp, "default": label(base), "default_us": round(base_us, 2),
                     "best": best["variant"], "best_us": best["us"], "best_over_default": round(best["us"] / base_us,
                                                                                                  4),
                     "variants": sorted(results, key=lambda x: x["us"])})
        log.info("R=%4d T=%.1f default %-45s %8.1f µs | best %-45s %8.1f µs (×%.3f)", R, temp, label(base), base_us,
                 best["variant"], best["us"], best["us"] / base_us)
        on_row(rows)
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["temperatures"]), figsize=(6 * len(report["temperatures"]), 4.2),
                             squeeze=False)
    for ax, temp in zip(axes[0], report["temperatures"]):
        rows = [r for r in report["results"] if r["temperature"] == temp]
        Rs = [r["R"] for r in rows]
        families = {"one-program": lambda v: not v["split"],
                    "split, 1 row a program": lambda v: v["split"] and v["split_rows"] == 1,
                    "split, 16 rows a program": lambda v: v["split"] and v["split_rows"] == 16}
        for name, member in families.items():
            pts = [(r["R"], min((v["us"] for v in r["variants"] if member(v["config"])), default=None)) for r in rows]
            pts = [(R, us) for R, us in pts if us is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{name} (best tile)")
        ax.plot(Rs, [r["default_us"] for r in rows], "k--", marker="x", label="the default when measured")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests R")
        ax.set_ylabel("µs per draft (γ slots), in a CUDA graph")
        ax.set_title(f"draft head, {'greedy' if temp == 0 else f'T = {temp}'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(report["hardware"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                   help="where to run (default cuda when available, else cpu)")
    p.add_argument("--batches", default=None, help="comma list of R (default 1,4,16,32,64,128,256; tiny 1,17)")
    p.add_argument("--temperatures", default="0,1", help="comma list of T, 0 for greedy rows (default 0,1)")
    p.add_argument("--tiles", default=None, help="comma list of split W2 tiles (default 4096,8192,16384,32768)")
    p.add_argument("--warps", default="4,8", help="comma list of split warps (default 4,8)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="comma list of requests a program of the split logits launch, 1 or powers of two >= 16 "
                        f"(default {','.join(map(str, ROWS))})")
    p.add_argument("--tiny", action="store_true", help="miniature shapes (default on the CPU)")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per variant, the median reported (default 5)")
    p.add_argument("--iters", type=int, default=None,
                   help="replays per timed loop (default 20; the CPU smoke test times one eager call)")
    p.add_argument("--out", default=None, help="JSON path (default docs/benchmarks/draft-head-graph-<tag>.json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    shapes = TINY if tiny else FULL
    batches = [int(b) for b in (args.batches or ("1,17" if tiny else "1,4,16,32,64,128,256")).split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    tiles = [int(t) for t in (args.tiles or ("256,1024" if tiny else "4096,8192,16384,32768")).split(",")]
    warps = [int(w) for w in args.warps.split(",")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters or (20 if device.type == "cuda" else 1)
    started = time.perf_counter()
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"draft-head-graph-{default_tag(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "hardware": hardware_name(device),
        "command": "python -m scripts.bench_draft_head " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "software": {"torch": torch.__version__, "triton": draft_head.triton.__version__},
        "timing": "CUDA graph replays" if device.type == "cuda" else "eager, Triton interpreter (not a timing)",
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": shapes,
        "temperatures": temps,
        "defaults": {"SPLIT_MAX_R": draft_head.SPLIT_MAX_R,
                     "SPLIT_TABLE": [dict(e) for e in draft_head.SPLIT_TABLE]},
        "repeats": args.repeats,
        "iters": iters,
        "results": [],
        "complete": False,
    }

    def write(rows: list[dict]) -> None:  # after every (R, T): a run cut short keeps what it measured
        report.update(results=rows, total_s=round(time.perf_counter() - started, 1))
        out.write_text(json.dumps(report, indent=1) + "\n")

    rows_options = tuple(int(r) for r in args.rows.split(","))
    sweep(batches, temps, shapes, device, dtype, tiles, warps, args.repeats, iters, tiny, rows_options, on_row=write)
    report["complete"] = True
    write(report["results"])
    log.info("wrote %s", out)
    save_plot(plot, report, out.with_suffix(".png"), log)
    return report


if __name__ == "__main__":
    main()
