"""Benchmark of the fused small-batch projections (``optimized/kernels/linear.py``) inside CUDA graphs.

A decoder layer's projection chain — add+norm, q/k/v matmul, o matmul, add+norm, gate/up matmul, SiLU·up, down
matmul — is captured for every layer of a model-sized stack (distinct weights per layer, so they stream from HBM
as in the engine, not from L2) in one CUDA graph, and its replay timed, in two forms:

=========  ==================================================================================================
unfused    the engine's chain for large steps: Triton RMSNorm and SiLU·up kernels (``layer_ops``), cuBLAS
           ``F.linear`` — seven kernels a layer
fused      ``norm_linear`` (add+norm+q/k/v), ``linear`` (o), ``norm_linear`` gated (add+norm+gate/up+SiLU·up),
           ``linear`` (down) — four kernels a layer
=========  ==================================================================================================

at M = 1..64 token rows. Timing inside a graph is what the engine pays: launch and drain of each kernel node, not
the 40–90 µs of a Python-side launch. Each point is the median over ``--repeats`` of the mean of ``--iters``
replays, reported per layer. With ``--sweep`` each of the four fused ops is also timed alone (one graph of all
layers' calls) over a grid of tile sizes at the ``--sweep-rows`` sizes, to choose ``kernel_config``. The chain's
outputs are compared between the two forms (max relative difference; they differ in float32 summation order).

    python -m scripts.bench_linear --sweep --out docs/benchmarks/linear-h200.json

On the CPU (``--tiny``, the default there) it runs miniature shapes eagerly: a smoke test, not a timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from tqdm import tqdm

from optimized.kernels.layer_ops import rms_norm, silu_mul
from optimized.kernels.linear import DOT_TILE_KEYS, FUSED_MAX_ROWS, kernel_config, linear, norm_linear
from reference.cli import LOG_FORMAT
from reference.cost_model import hardware_name
from scripts.benchmarking import default_tag, save_plot

log = logging.getLogger("dspark.bench_linear")
ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-5


def make_layers(num_layers: int, hidden: int, qkv: int, inter: int, device, dtype, seed: int = 0) -> list[dict]:
    """Random weights of the shapes of one model's layers (Llama: q/k/v and gate/up fused)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return [dict(g1=1 + rand(hidden, scale=0.1), qkv=rand(qkv, hidden, scale=hidden ** -0.5),
                 o=rand(hidden, hidden, scale=hidden ** -0.5), g2=1 + rand(hidden, scale=0.1),
                 gate_up=rand(2 * inter, hidden, scale=hidden ** -0.5), down=rand(hidden, inter, scale=inter ** -0.5))
            for _ in range(num_layers)]


def chain(x: torch.Tensor, layers: list[dict], fused: bool, backend: str, hidden: int) -> torch.Tensor:
    """The projection chain of every layer (the q columns stand in for the attention output); returns the stream."""
    pending = torch.zeros_like(x)
    for w in layers:
        if fused:
            qkv, x = norm_linear(pending, w["qkv"], norm_weight=w["g1"], eps=EPS, residual=x, backend=backend)
            o = linear(qkv[:, :hidden], w["o"], backend=backend)
            act, x = norm_linear(o, w["gate_up"], norm_weight=w["g2"], eps=EPS, residual=x, gated=True,
                                 backend=backend)
            pending = linear(act, w["down"], backend=backend)
        else:
            h, x = rms_norm(pending, w["g1"], EPS, residual=x, backend=backend)
            qkv = F.linear(h, w["qkv"])
            h, x = rms_norm(F.linear(qkv[:, :hidden], w["o"]), w["g2"], EPS, residual=x, backend=backend)
            pending = F.linear(silu_mul(F.linear(h, w["gate_up"]), backend=backend), w["down"])
    return x + pending


def one_op(op: str, x: torch.Tensor, layers: list[dict], config: dict | None, backend: str) -> Callable[[], Any]:
    """Every layer's call of one fused op (inputs of the right widths), for the tile sweep."""
    inter = layers[0]["down"].shape[1]
    act = x.new_ones(x.shape[0], inter)
    if op == "qkv":
        return lambda: [norm_linear(x, w["qkv"], norm_weight=w["g1"], eps=EPS, residual=x, backend=backend,
                                    config=config) for w in layers]
    if op == "o":
        return lambda: [linear(x, w["o"], backend=backend, config=config) for w in layers]
    if op == "gate_up":
        return lambda: [norm_linear(x, w["gate_up"], norm_weight=w["g2"], eps=EPS, residual=x, gated=True,
                                    backend=backend, config=config) for w in layers]
    if op == "down":
        return lambda: [linear(act, w["down"], backend=backend, config=config) for w in layers]
    raise ValueError(op)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, iters: int, graphs: bool) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` runs of ``fn`` (as one CUDA graph when ``graphs``), µs."""
    fn()  # compiles the kernels and allocates
    run = fn
    if graphs:
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def sweep_configs(rows: int, k_max: int, norm: bool = True) -> list[dict]:
    """Tile grid of the sweep for inputs of at most ``k_max`` columns: up to two rows, row-loop tiles of 256 columns up
    to the whole row (a weight tile of at most 8192 values in registers); from two rows on, ``tl.dot`` tiles of 16
    rows, each also with its K tiles split over 2–9 programs per output tile (``SPLIT_K``, four warps), with 1, 2 or 4
    software-pipeline stages (Triton's ``num_stages``; its default is 3) and, for an op with a norm (``norm``), with
    the norm's pass over the whole row in one tile (``RMS_BLOCK_K``). Tiles wider than the row are left out."""
    widest = 1 << (k_max - 1).bit_length()
    configs = []
    block_m = 1 << (rows - 1).bit_length()
    if rows <= 2:
        for bn, bk, warps in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (1, 2, 4, 8)):
            if bn * bk <= 8192 and min(256, widest) <= bk <= max(256, widest):
                configs.append(dict(kernel="rows", BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps))
    if rows > 1:
        dots = [dict(kernel="dot", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn in (16, 32)
                for bk in (64, 128, 256, 512) if bk <= widest for w in (4, 8)]
        dots += [dict(kernel="dot", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, SPLIT_K=split)
                 for bn in (16, 32) for bk in (64, 128, 256) if bk <= widest
                 for split in (2, 3, 4, 6, 9) if split <= -(-k_max // bk)]
        dots += [dict(kernel="dot", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)
                 for bn in (16, 32) for bk in (64, 128) if bk <= widest for stages in (1, 2, 4)]
        if norm:  # the same tiles with the norm's sums of squares in one whole-row tile
            dots += [dict(cfg, RMS_BLOCK_K=widest) for cfg in dots if cfg["BLOCK_K"] < widest]
        configs += dots
    return configs


KIND_OPS = {"norm": ("qkv",), "gated": ("gate_up",), "plain": ("o", "down")}  # DOT_TILES' kinds and their ops


def _dot_key(cfg: dict) -> tuple:
    """A swept ``tl.dot`` config as a DOT_TILES entry (the same entry for every op of a kind)."""
    return (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg.get("SPLIT_K", 1), "RMS_BLOCK_K" in cfg,
            cfg.get("num_stages"))


def proposed_dot_tiles(sweep: list[dict], rows: int) -> dict[str, Any]:
    """From the tile sweep at ``rows`` rows: per kind of ``DOT_TILES`` the ``tl.dot`` entry with the least time summed
    over the kind's ops (an entry only if every op of the kind timed it), with that time and the time of the
    table in force (``default_us``, from the same sweep). ``{"table": DOT_TILES-format, "us": ..., "default_us": ...}``;
    empty if the sweep has no ``tl.dot`` rows at ``rows``."""
    table, us, default_us = {}, {}, {}
    for kind, ops in KIND_OPS.items():
        times: dict[tuple, dict[str, float]] = {}
        for entry in sweep:
            cfg = entry["config"]
            if entry["rows"] == rows and entry["op"] in ops and isinstance(cfg, dict) and cfg["kernel"] == "dot":
                times.setdefault(_dot_key(cfg), {})[entry["op"]] = entry["us"]
        whole = {key: sum(t.values()) for key, t in times.items() if set(t) == set(ops)}
        if not whole:
            return {}
        best = min(whole, key=whole.get)
        table[kind] = dict(zip(DOT_TILE_KEYS, best, strict=True))
        us[kind] = round(whole[best], 3)
        defaults = [e["us"] for e in sweep if e["rows"] == rows and e["op"] in ops and e["config"] == "default"]
        default_us[kind] = round(sum(defaults), 3) if len(defaults) == len(ops) and None not in defaults else None
    return {"rows": rows, "table": table, "us": us, "default_us": default_us}


def _tensors(outputs: list) -> list[torch.Tensor]:
    """The tensors of one op's per-layer outputs (``norm_linear`` returns ``(y, x̂)``, ``linear`` ``y``)."""
    return [t for out in outputs for t in (out if isinstance(out, tuple) else (out,))]


def invariant_configs(k_max: int) -> list[dict]:
    """The tl.dot tiles the row-invariant sweep tries (rows, columns and K columns a program; four or eight warps)."""
    widest = 1 << (k_max - 1).bit_length()
    return [dict(kernel="dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bm in (16, 32, 64, 128)
            for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)
            if bk <= widest and bm * bn <= 8192 and (w == 4 or bm * bn >= 4096)]


def invariant_sweep(rows: list[int], layers: list[dict], hidden: int, inter: int, device, dtype, backend: str,
                    repeats: int, iters: int, graphs: bool, gen: torch.Generator,
                    max_configs: int | None = None) -> list[dict]:
    """Each op over :func:`invariant_configs` at every row count, each tile's output compared bit for bit with the
    first tile of ``INVARIANT_TILES`` on the same rows (``identical``: every row count agrees; only such tiles may
    share a row-invariant table with it). Per op: the tiles ranked by the geometric mean over the row counts of
    (time / the best time at that row count), and ``table``: the fastest identical tile at each row count."""
    results = []
    for op in ("qkv", "o", "gate_up", "down"):
        k, n = (inter, hidden) if op == "down" else (hidden, {"qkv": layers[0]["qkv"].shape[0], "o": hidden,
                                                              "gate_up": inter}[op])
        base = kernel_config(1, n, k, op == "gate_up", row_invariant=True)  # the table's first tile
        grid = invariant_configs(k)
        if max_configs and len(grid) > max_configs:
            step = len(grid) / max_configs
            grid = [grid[int(i * step)] for i in range(max_configs)]
        if base not in grid:
            grid.insert(0, base)
        times: dict[int, list[float | None]] = {}
        identical = [True] * len(grid)
        for m in rows:
            x = torch.randn(m, hidden, generator=gen).to(device=device, dtype=dtype)
            reference = [t.clone() for t in _tensors(one_op(op, x, layers[:2], base, backend)())]
            row_times = []
            for i, cfg in enumerate(tqdm(grid, desc=f"invariant sweep {op} M={m}", disable=None)):
                try:
                    got = _tensors(one_op(op, x, layers[:2], cfg, backend)())
                    identical[i] &= all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
                    row_times.append(timed(one_op(op, x, layers, cfg, backend), device, repeats, iters, graphs)
                                     / len(layers))
                except Exception as e:  # a tile that does not compile (shared memory, registers) is skipped
                    log.warning("M=%d %s %s: %s", m, op, cfg, str(e).splitlines()[0][:200])
                    row_times.append(None)
            times[m] = row_times
        ranked = []
        for i, cfg in enumerate(grid):
            per_row = {m: times[m][i] for m in rows}
            if any(t is None for t in per_row.values()):
                continue
            slowdown = statistics.geometric_mean([per_row[m] / min(t for t in times[m] if t is not None)
                                                  for m in rows])
            ranked.append({"config": cfg, "default": cfg == base, "identical": identical[i],
                           "us": {str(m): round(t, 3) for m, t in per_row.items()}, "slowdown": round(slowdown, 4)})
        ranked.sort(key=lambda r: r["slowdown"])
        table = []
        for m in rows:  # the fastest tile at m among those identical to the base
            fastest = min((r for r in ranked if r["identical"]), key=lambda r: r["us"][str(m)])
            table.append({"rows": m, "config": fastest["config"], "us": fastest["us"][str(m)],
                          "base_us": next(r for r in ranked if r["default"])["us"][str(m)]})
        best, dflt = ranked[0], next(r for r in ranked if r["default"])
        log.info("invariant sweep %-8s best %s (×%.3f, identical %s), default ×%.3f; %d of %d tiles identical", op,
                 best["config"], best["slowdown"], best["identical"], dflt["slowdown"],
                 sum(r["identical"] for r in ranked), len(ranked))
        for row in table:
            log.info("  M=%4d fastest identical %s %.2f µs (base %.2f µs)", row["rows"], row["config"], row["us"],
                     row["base_us"])
        results.append({"op": op, "k": k, "row_counts": rows, "ranked": ranked, "table": table})
    return results


def proposed_invariant_tiles(sweep: list[dict]) -> list[dict]:
    """One row-invariant table for every op (``optimized.kernels.linear.INVARIANT_TILES``'s format, for
    ``set_invariant_tiles`` or ``scripts/exactness.py --invariant-tiles``): at each swept row count the tile identical
    to the base in every op with the least time summed over the ops; each entry serves up to its row count, the last
    any size, equal neighbours merged."""
    rows = sweep[0]["row_counts"]

    def key(cfg: dict, k: int) -> tuple:  # BLOCK_K as kernel_config caps it for an input of k columns
        return cfg["BLOCK_M"], cfg["BLOCK_N"], min(cfg["BLOCK_K"], 1 << (k - 1).bit_length()), cfg["num_warps"]

    by_op = [({key(r["config"], op["k"]): r for r in op["ranked"]}, op["k"]) for op in sweep]
    widest_k = max(op["k"] for op in sweep)
    candidates = [r["config"] for r in next(op for op in sweep if op["k"] == widest_k)["ranked"]]
    common = [c for c in candidates
              if all(key(c, k) in ranks and ranks[key(c, k)]["identical"] for ranks, k in by_op)]
    if not common:
        raise ValueError("no tile is identical to the base tile in every op")
    tiles: list[dict] = []
    for i, m in enumerate(rows):
        cfg = min(common, key=lambda c: sum(ranks[key(c, k)]["us"][str(m)] for ranks, k in by_op))
        tile = {"max_rows": m if i < len(rows) - 1 else None,
                **{name: cfg[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")}}
        if tiles and all(tiles[-1][name] == tile[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")):
            tiles[-1]["max_rows"] = tile["max_rows"]  # the same tile as the smaller size's: one entry
        else:
            tiles.append(tile)
    return tiles


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                prog="python -m scripts.bench_linear", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                   help="cuda if present, else cpu (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--rows", default=None, help="comma list of token rows M (default 1,2,4,8,16,32,64; tiny 1,3)")
    p.add_argument("--layers", type=int, default=None, help="layers in the stack (default 30, SmolLM2; tiny 2)")
    p.add_argument("--hidden", type=int, default=576, help="model width d (SmolLM2-135M: 576)")
    p.add_argument("--qkv", type=int, default=960, help="fused q/k/v width (H + 2·Hkv)·D (SmolLM2-135M: 960)")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP width I (SmolLM2-135M: 1536)")
    p.add_argument("--tiny", action="store_true", help="miniature shapes (default on the CPU)")
    p.add_argument("--sweep", action="store_true", help="also time each fused op over a grid of tile sizes")
    p.add_argument("--sweep-rows", default="1,8", help="row counts of the sweep (default: %(default)s)")
    p.add_argument("--sweep-ops", default="qkv,o,gate_up,down",
                   help="the fused ops the sweep times, comma list of qkv, o, gate_up, down (default: %(default)s)")
    p.add_argument("--invariant-sweep", default="",
                   help="comma list of row counts: time each op over a grid of tl.dot tiles at every one of them, "
                        "compare each tile's bits with the first row-invariant tile's, rank the tiles by their "
                        "geometric-mean slowdown against each size's best, and propose the fastest identical tile per "
                        "size (empty: no such sweep)")
    p.add_argument("--sweep-max-configs", type=int, default=None,
                   help="try at most this many tiles per op, evenly spaced over the grid (default: all)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed graph replays per configuration (the median is reported) (default: %(default)s)")
    p.add_argument("--iters", type=int, default=None, help="runs per timed loop (default 20 on cuda, 1 on cpu)")
    p.add_argument("--out", default=None, help="JSON path (default docs/benchmarks/linear-<device tag>.json)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    graphs = device.type == "cuda"
    backend = "triton"
    if device.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("on the CPU the Triton kernels run only under TRITON_INTERPRET=1")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    hidden, qkv, inter = (48, 80, 96) if tiny else (args.hidden, args.qkv, args.intermediate)
    num_layers = args.layers or (2 if tiny else 30)
    rows = [int(r) for r in args.rows.split(",")] if args.rows else ([1, 3] if tiny else [1, 2, 4, 8, 16, 32, 64])
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")] if args.sweep else []
    sweep_ops = [op for op in args.sweep_ops.split(",") if op]
    if not set(sweep_ops) <= {"qkv", "o", "gate_up", "down"}:
        raise SystemExit(f"--sweep-ops takes qkv, o, gate_up and down, got {args.sweep_ops!r}")
    iters = args.iters or (20 if graphs else 1)
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"linear-{default_tag(device)}.json"
    command = "python -m scripts.bench_linear " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                     else sys.argv[1:]))
    layers = make_layers(num_layers, hidden, qkv, inter, device, dtype)
    weight_mb = sum(t.numel() * t.element_size() for w in layers for t in w.values()) / 1e6
    report: dict[str, Any] = {
        "hardware": hardware_name(device), "command": command, "torch": torch.__version__,
        "software": {"torch": torch.__version__, "triton": triton.__version__},
        "triton": "compiled" if graphs else "interpreter", "dtype": str(dtype).removeprefix("torch."),
        "shape": {"layers": num_layers, "hidden": hidden, "qkv": qkv, "intermediate": inter,
                  "weight_mb": round(weight_mb, 1)},
        "fused_max_rows": FUSED_MAX_ROWS, "repeats": args.repeats, "iters": iters, "chain": [], "sweep": [],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for m in tqdm(rows, desc="chain", disable=None):
        x = torch.randn(m, hidden, generator=gen).to(device=device, dtype=dtype)
        unfused = timed(lambda x=x: chain(x, layers, False, backend, hidden), device, args.repeats, iters,
                        graphs) / num_layers
        row = {"rows": m, "unfused_us_per_layer": round(unfused, 3),
               "default_config": {op: kernel_config(m, n, hidden if op != "down" else inter, op == "gate_up",
                                                   norm=op in ("qkv", "gate_up"))
                                  for op, n in (("qkv", qkv), ("o", hidden), ("gate_up", inter), ("down", hidden))}}
        try:
            fused = timed(lambda x=x: chain(x, layers, True, backend, hidden), device, args.repeats, iters,
                          graphs) / num_layers
            ref, got = chain(x, layers, False, backend, hidden).float(), chain(x, layers, True, backend, hidden).float()
        except Exception as e:  # a default tile that does not compile on this GPU: recorded, the rest still runs
            log.warning("M=%d fused chain failed: %s", m, str(e).splitlines()[0][:300])
            row["fused_error"] = str(e).splitlines()[0][:300]
            report["chain"].append(row)
            out.write_text(json.dumps(report, indent=2) + "\n")
            continue
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        row.update(fused_us_per_layer=round(fused, 3), speedup=round(unfused / fused, 3),
                   max_rel_diff=float(f"{rel:.3g}"))
        report["chain"].append(row)
        log.info("M=%3d  unfused %.2f µs/layer  fused %.2f µs/layer  (%.2fx)  max rel diff %.2g", m, unfused, fused,
                 row["speedup"], rel)
        out.write_text(json.dumps(report, indent=2) + "\n")
    for m in sweep_rows:
        x = torch.randn(m, hidden, generator=gen).to(device=device, dtype=dtype)
        for op in sweep_ops:
            try:
                default = timed(one_op(op, x, layers, None, backend), device, args.repeats, iters, graphs) / num_layers
            except Exception as e:  # the default tile does not compile here: every other tile is still timed
                log.warning("M=%d %s default tile failed: %s", m, op, str(e).splitlines()[0][:200])
                default = float("inf")
            best = (default, None)
            grid = sweep_configs(m, inter if op == "down" else hidden, norm=op in ("qkv", "gate_up"))
            if args.sweep_max_configs and len(grid) > args.sweep_max_configs:
                step = len(grid) / args.sweep_max_configs
                grid = [grid[int(i * step)] for i in range(args.sweep_max_configs)]
            for cfg in tqdm(grid, desc=f"sweep M={m} {op}", disable=None):
                try:
                    us = timed(one_op(op, x, layers, cfg, backend), device, args.repeats, iters, graphs) / num_layers
                except Exception as e:  # a tile that does not compile (shared memory, registers) is skipped
                    log.warning("M=%d %s %s: %s", m, op, cfg, str(e).splitlines()[0][:200])
                    continue
                report["sweep"].append({"rows": m, "op": op, "config": cfg, "us": round(us, 3)})
                if us < best[0]:
                    best = (us, cfg)
            log.info("sweep M=%d %-8s default %.2f µs, best %.2f µs %s", m, op, default, best[0], best[1])
            finite = (lambda us: round(us, 3) if us != float("inf") else None)  # None: the tile did not compile
            report["sweep"].append({"rows": m, "op": op, "config": "default", "us": finite(default),
                                    "best": best[1], "best_us": finite(best[0])})
            out.write_text(json.dumps(report, indent=2) + "\n")
    proposals = [p for p in (proposed_dot_tiles(report["sweep"], m) for m in sweep_rows) if p]
    if proposals:  # the default tl.dot launches the sweep proposes (optimized.kernels.linear.set_dot_tiles)
        report["proposed_dot_tiles"] = proposals
        for proposal in proposals:
            log.info("proposed DOT_TILES at %d rows: %s (µs per layer by kind %s, the table in force %s)",
                     proposal["rows"], json.dumps(proposal["table"]), proposal["us"], proposal["default_us"])
        out.write_text(json.dumps(report, indent=2) + "\n")
    inv_rows = [int(r) for r in args.invariant_sweep.split(",") if r]
    if inv_rows:
        report["invariant_sweep"] = invariant_sweep(inv_rows, layers, hidden, inter, device, dtype, backend,
                                                    args.repeats, iters, graphs, gen, args.sweep_max_configs)
        out.write_text(json.dumps(report, indent=2) + "\n")  # the sweep is kept whatever the proposal finds
        try:
            report["proposed_invariant_tiles"] = proposed_invariant_tiles(report["invariant_sweep"])
            log.info("proposed row-invariant tiles (scripts/exactness.py --invariant-tiles): %s",
                     json.dumps(report["proposed_invariant_tiles"]))
        except ValueError as err:  # no tile gave the base tile's bits in every op: nothing to propose
            log.warning("no row-invariant table proposed: %s", err)
        out.write_text(json.dumps(report, indent=2) + "\n")
    save_plot(plot, report, out.with_suffix(".png"), log)
    log.info("wrote %s", out)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """µs per layer of the projection chain against token rows, unfused and fused."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ms = [r["rows"] for r in report["chain"]]
    for key, label in (("unfused_us_per_layer", "unfused (cuBLAS + norm/SiLU kernels)"),
                       ("fused_us_per_layer", "fused (norm_linear / linear)")):
        rows = [r for r in report["chain"] if key in r]  # a fused chain that failed to compile has no time
        ax.plot([r["rows"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax.set(xscale="log", xlabel="token rows M", ylabel="µs per layer (in a CUDA graph)",
           title=f"Projection chain of one layer, {report['hardware']}")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.axvline(report["fused_max_rows"], color="grey", linestyle=":", label="engine's fused limit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
    raise SystemExit(0)
