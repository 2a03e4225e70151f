"""Kernel benchmark: every Triton op of ``optimized/kernels`` against its torch fallback, in µs and % of HBM roofline.

Names follow ``docs/method.md`` (``p_t``
target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size). The decode-time ops are
memory bound, so each is judged by the bytes it must move at least (its *compulsory* traffic, stated per op
below) divided by its time, against the H200's 4.8 TB/s of HBM bandwidth:

=============  =======================================================================================
op             compulsory bytes per call
=============  =======================================================================================
attention      verify step (γ+1 causal queries per request, ``context`` keys): K and V of every visible
               key once, q read and o written once
sampling       the ``[R, V]`` fp32 probabilities once (exponential race); rows ``triton`` (one program per row)
               and ``triton-split`` (vocabulary chunks over programs, then a reduction)
verify         rejection sampling, fp32 ``p_d``/``p_t``: case ``accept_all`` (``p_d = p_t``, drafts are the
               modes) reads the bonus row of ``p_t``; case ``reject_first`` (draft 1 impossible) reads
               one ``p_t`` and one ``p_d`` row for the residual; ``greedy`` reads the γ+1 logit rows;
               ``greedy_packed`` reads the same rows in place from the packed ``[N, V]`` verify output
               (``row_starts``; its torch row is the gather to ``[R, γ+1, V]`` and the argmax)
allocate       the ``[R, γ]`` survivals once (device sort; its twin is the reference's host op)
draft_head     the ``[R, γ, V]`` base logits (the drafter's dtype) read and fp32 ``p_d`` written once, plus
               W1/W2 once; rows ``triton`` (one program per request), ``triton-split`` (vocabulary split over
               programs) and ``triton-split-rows`` (the same, 16 requests per program sharing each W2 block)
layer_ops      the fused element-wise ops of one decoder layer over the N = R·(γ+1) verify tokens:
               ``rms_norm`` (x and residual read, sum and output written), ``rope_append`` (q, k, v read,
               rotated q and k/v cache rows written), ``silu_mul`` ([gate | up] read, the product written);
               ``torch`` is the unfused HF-rounding chain (7, ~12 and 2 launches)
=============  =======================================================================================

Shapes are SmolLM2-135M's (H = 9, Hkv = 3, D = 64, V = 49152, d = 576, Markov rank r = 64) with γ = 7 and
R = 1..256 requests, in the engine's dtypes (bf16 activations/caches, fp32 probabilities). ``--tiny`` (default on
the CPU) shrinks everything for smoke tests; there the torch path runs, and the Triton path only under the
interpreter (``TRITON_INTERPRET=1``: correct, not fast). Each timing is the median over ``--repeats`` of a loop
of ``--iters`` calls between device synchronisations; integer outputs are compared between the two backends
and the result recorded. JSON goes to ``docs/benchmarks/kernels-<tag>.json`` with one PNG next to it.

    python -m scripts.bench_kernels --op all --out docs/benchmarks/kernels-h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from optimized.kernels.allocate import allocate_top_b
from optimized.kernels.attention import varlen_attention
from optimized.kernels.draft_head import sample_draft_block
from optimized.kernels.layer_ops import rms_norm, rope_append_kv, rope_cos_sin, silu_mul
from optimized.kernels.sampling import sample
from optimized.kernels.verify import greedy_verify, rejection_sample
from reference import scheduler as ref_scheduler
from reference.cli import LOG_FORMAT
from reference.cost_model import hardware_name
from scripts.benchmarking import default_tag

log = logging.getLogger("dspark.bench_kernels")

OPS = ("attention", "sampling", "verify", "allocate", "draft_head", "layer_ops")
H200_HBM_GBPS = 4800.0  # NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shapes:
    """Model and step sizes of the benchmark."""

    num_heads: int = 9  # H, SmolLM2-135M
    num_kv_heads: int = 3  # Hkv
    head_dim: int = 64  # D
    vocab: int = 49152  # V
    hidden: int = 576  # d (the confidence head reads h_k)
    intermediate: int = 1536  # I, the MLP width
    markov_rank: int = 64  # r, DrafterConfig default
    gamma: int = 7  # γ, the paper's block size
    context: int = 512  # keys before the verified block (a ShareGPT prompt plus part of its answer)
    batches: tuple[int, ...] = (1, 4, 16, 64, 256)  # R

    @classmethod
    def tiny(cls) -> Shapes:
        """CPU smoke-test sizes: the same structure (GQA groups, γ) in miniature."""
        return cls(num_heads=4, num_kv_heads=2, head_dim=16, vocab=256, hidden=32, intermediate=48, markov_rank=8,
                   gamma=7, context=24, batches=(1, 4))


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


def time_us(fn: Callable[[], Any], device: torch.device, repeats: int, iters: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, in µs (two untimed calls first)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    fn()  # the first call compiles (Triton JIT) and allocates
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def triton_available(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on the CPU through the interpreter (set before triton was imported)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------------------
# One case per op: (inputs, call(backend), compulsory bytes, output comparison)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    op: str
    case: str
    R: int
    call: Callable[[str], Any]  # backend -> output
    bytes: int  # compulsory traffic of one call
    compare: Callable[[Any, Any], Any]  # (triton output, torch output) -> JSON-able agreement measure
    shape: dict[str, Any]
    dtype: str
    variants: tuple[str, ...] = ()  # further fast backends, timed and compared with torch like "triton"


def _equal(a, b) -> bool:
    if hasattr(a, "tokens"):  # DraftOutput / VerifyResult: the integer outputs decide
        fields = ("tokens", "num_accepted", "num_emitted") if hasattr(a, "num_emitted") else ("tokens",)
        return all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()) for f in fields)
    return bool(torch.equal(a.cpu(), b.cpu()))


def _max_abs_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max().cpu())


def attention_case(s: Shapes, R: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    q_len, kv_len = s.gamma + 1, s.context + s.gamma + 1
    n = R * q_len
    slots = R + 1  # one extra slot, as the engine's trash slot
    q = torch.randn(n, s.num_heads, s.head_dim, generator=gen, device=device).to(dtype)  # [N, H, D]
    k = torch.randn(slots, kv_len, s.num_kv_heads, s.head_dim, generator=gen, device=device).to(dtype)  # [S, T, Hkv, D]
    v = torch.randn(slots, kv_len, s.num_kv_heads, s.head_dim, generator=gen, device=device).to(dtype)  # [S, T, Hkv, D]
    cu = (torch.arange(R + 1) * q_len).to(device, torch.int32)  # [R+1]
    kv_lens = torch.full((R,), kv_len, dtype=torch.int32, device=device)  # [R]
    slot_ids = torch.arange(R, dtype=torch.int32, device=device)  # [R]
    es = q.element_size()
    nbytes = 2 * R * kv_len * s.num_kv_heads * s.head_dim * es + 2 * n * s.num_heads * s.head_dim * es

    def call(backend: str):
        return varlen_attention(q, k, v, cu, kv_lens, slot_ids, causal=True, scale=s.head_dim ** -0.5,
                                max_q_len=q_len, backend=backend)

    return Case("attention", "verify", R, call, nbytes, lambda a, b: {"max_abs_diff": _max_abs_diff(a, b)},
                {"N": n, "H": s.num_heads, "Hkv": s.num_kv_heads, "D": s.head_dim, "kv_len": kv_len}, str(dtype))


def sampling_case(s: Shapes, R: int, device: torch.device, gen: torch.Generator) -> Case:
    probs = torch.softmax(torch.randn(R, s.vocab, generator=gen, device=device) * 3, dim=-1)  # [R, V] fp32
    rid = torch.arange(R, device=device)
    pos = torch.full((R,), 100, device=device)

    def call(backend: str):
        split = {"triton": False, "triton-split": True}.get(backend)  # each Triton variant forced
        return sample(probs, 1234, rid, pos, 2, backend="torch" if split is None else "triton", split=split)

    return Case("sampling", "race", R, call, R * s.vocab * 4, lambda a, b: {"equal": _equal(a, b)},
                {"R": R, "V": s.vocab}, "float32", variants=("triton-split",))


def verify_cases(s: Shapes, R: int, device: torch.device, gen: torch.Generator) -> list[Case]:
    g, V = s.gamma, s.vocab
    p_t = torch.softmax(torch.randn(R, g + 1, V, generator=gen, device=device) * 3, dim=-1)  # [R, γ+1, V]
    modes = p_t[:, :g].argmax(-1)  # [R, γ] the most likely drafts
    rid, anchor = torch.arange(R, device=device), torch.full((R,), 50, device=device)
    lens = torch.full((R,), g, dtype=torch.long, device=device)  # [R] verify everything
    cases = []
    # accept_all: p_d = p_t and x_k = argmax, so every ratio is 1: every draft is accepted, the bonus row is read.
    accept = (modes, p_t[:, :g].contiguous(), p_t)
    # reject_first: draft 1 has zero target probability, so the residual of slot 1 is sampled.
    p_t_rej = p_t.clone()
    p_t_rej[torch.arange(R, device=device), 0, modes[:, 0]] = 0.0
    reject = (modes, accept[1], p_t_rej)
    for name, (drafts, p_d, pt), nbytes in (("accept_all", accept, R * V * 4 + R * g * 8),
                                            ("reject_first", reject, 2 * R * V * 4)):
        def call(backend: str, drafts=drafts, p_d=p_d, pt=pt):
            return rejection_sample(drafts, lens, p_d, pt, 7, rid, anchor, backend=backend)

        cases.append(Case("verify", name, R, call, nbytes, lambda a, b: {"equal": _equal(a, b)},
                          {"R": R, "gamma": g, "V": V}, "float32"))
    logits = torch.log(p_t)  # [R, γ+1, V]: argmax = the drafts, so all γ+1 rows are read

    def greedy(backend: str):
        return greedy_verify(accept[0], lens, logits, backend=backend)

    cases.append(Case("verify", "greedy", R, greedy, R * (g + 1) * V * 4, lambda a, b: {"equal": _equal(a, b)},
                      {"R": R, "gamma": g, "V": V}, "float32"))
    packed = logits.reshape(R * (g + 1), V)  # [N, V] the verify forward's layout, every ℓ = γ
    cu = torch.arange(0, R * (g + 1) + 1, g + 1, dtype=torch.int32, device=device)  # [R+1] as the layout writes it

    def greedy_packed(backend: str):
        return greedy_verify(accept[0], lens, packed, backend=backend, row_starts=cu)

    cases.append(Case("verify", "greedy_packed", R, greedy_packed, R * (g + 1) * V * 4,
                      lambda a, b: {"equal": _equal(a, b)}, {"R": R, "gamma": g, "V": V}, "float32"))
    return cases


def allocate_case(s: Shapes, R: int, device: torch.device, gen: torch.Generator) -> Case:
    conf = torch.rand(R, s.gamma, generator=gen, device=device)
    a = torch.cumprod(conf, dim=1)  # [R, γ] prefix survivals
    a_host, budget = a.cpu(), (R * s.gamma) // 3

    def call(backend: str):
        if backend == "triton":  # the device op (torch sort on the device; no Triton kernel is needed)
            return allocate_top_b(a, budget)
        return ref_scheduler.allocate_top_b(a_host, budget)  # the reference's host op

    return Case("allocate", "top_b", R, call, R * s.gamma * 4, lambda x, y: {"equal": _equal(x, y)},
                {"R": R, "gamma": s.gamma, "budget": budget}, "float32")


def draft_head_case(s: Shapes, R: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Case:
    g, V, d, r = s.gamma, s.vocab, s.hidden, s.markov_rank
    base = (torch.randn(R, g, V, generator=gen, device=device) * 2).to(dtype)  # [R, γ, V] U_k as the engine passes it
    h = torch.randn(R, g, d, generator=gen, device=device).to(dtype)  # [R, γ, d]
    w1 = (torch.randn(V, r, generator=gen, device=device) * 0.1).to(dtype)  # [V, r]
    w2 = (torch.randn(V, r, generator=gen, device=device) * 0.1).to(dtype)  # [V, r]
    conf_w = (torch.randn(d + r, generator=gen, device=device) * 0.05).to(dtype)  # [d + r]
    conf_b = torch.zeros(1, dtype=dtype, device=device)
    anchors = torch.randint(0, V, (R,), generator=gen, device=device)
    pos, rid = torch.full((R,), 40, device=device), torch.arange(R, device=device)
    temp = torch.zeros(R, device=device)  # greedy rows, the benchmark's decoding
    es = w1.element_size()

    def call(backend: str):
        split, rows = {"triton": (False, 1), "triton-split": (True, 1), "triton-split-rows": (True, 16)}.get(
            backend, (None, None))  # each Triton variant forced
        return sample_draft_block(base, h, anchors, pos, temp, 99, rid, w1, w2, conf_w, conf_b,
                                  backend="torch" if split is None else "triton", split=split, split_rows=rows)

    return Case("draft_head", "markov_greedy", R, call, R * g * V * (es + 4) + 2 * V * r * es,
                lambda a, b: {"equal": _equal(a, b), "conf_max_abs_diff": _max_abs_diff(a.conf_logits, b.conf_logits)},
                {"R": R, "gamma": g, "V": V, "d": d, "r": r}, str(dtype),
                variants=("triton-split", "triton-split-rows"))


def layer_op_cases(s: Shapes, R: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[Case]:
    n, d, inter = R * (s.gamma + 1), s.hidden, s.intermediate
    H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
    x = torch.randn(n, d, generator=gen, device=device).to(dtype)  # [N, d]
    res = torch.randn(n, d, generator=gen, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=gen, device=device)).to(dtype)
    qkv = torch.randn(n, (H + 2 * Hkv) * D, generator=gen, device=device).to(dtype)  # the fused projection
    q, k, v = (t.view(n, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    positions = (s.context + torch.arange(n, device=device) % (s.gamma + 1)).long()  # [N]
    slots = (torch.arange(n, device=device) // (s.gamma + 1)).long()  # [N] request r → slot r
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    k_cache = torch.zeros(R + 1, s.context + s.gamma + 1, Hkv, D, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    gate_up = torch.randn(n, 2 * inter, generator=gen, device=device).to(dtype)
    es = x.element_size()
    diff = lambda a, b: {"max_abs_diff": _max_abs_diff(a, b)}  # noqa: E731
    shape = {"N": n, "d": d, "H": H, "Hkv": Hkv, "D": D, "I": inter}
    return [
        Case("layer_ops", "rms_norm", R, lambda b: rms_norm(x, w, 1e-5, res, backend=b)[0], 4 * n * d * es, diff,
             shape, str(dtype)),
        Case("layer_ops", "rope_append", R,
             lambda b: rope_append_kv(q, k, v, cos, sin, k_cache, v_cache, slots, positions, backend=b),
             2 * n * (H + 2 * Hkv) * D * es, diff, shape, str(dtype)),
        Case("layer_ops", "silu_mul", R, lambda b: silu_mul(gate_up, backend=b), 3 * n * inter * es, diff, shape,
             str(dtype)),
    ]


def build_cases(op: str, s: Shapes, device: torch.device, dtype: torch.dtype) -> list[Case]:
    gen = torch.Generator(device=device).manual_seed(0)  # inputs are drawn on the device: R = 256 is ~1 GB
    cases = []
    for R in s.batches:
        if op == "attention":
            cases.append(attention_case(s, R, device, dtype, gen))
        elif op == "sampling":
            cases.append(sampling_case(s, R, device, gen))
        elif op == "verify":
            cases += verify_cases(s, R, device, gen)
        elif op == "allocate":
            cases.append(allocate_case(s, R, device, gen))
        elif op == "draft_head":
            cases.append(draft_head_case(s, R, device, dtype, gen))
        elif op == "layer_ops":
            cases += layer_op_cases(s, R, device, dtype, gen)
        else:
            raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)} or all")
    return cases


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


def run(ops: list[str], shapes: Shapes, device: torch.device, dtype: torch.dtype, *, repeats: int, iters: int,
        roofline_gbps: float, out: Path, command: str) -> dict[str, Any]:
    """Time every case on both backends; write JSON (after every op) and a PNG; returns the report."""
    use_triton = triton_available(device)
    report: dict[str, Any] = {
        "hardware": hardware_name(device), "command": command, "roofline_gbps": roofline_gbps,
        "roofline": "NVIDIA H200 HBM3e, 4.8 TB/s" if roofline_gbps == H200_HBM_GBPS else "user-given",
        "triton": "compiled" if device.type == "cuda" else ("interpreter" if use_triton else "not available"),
        "shapes": asdict(shapes), "repeats": repeats, "iters": iters, "torch": torch.__version__, "results": [],
    }
    if device.type != "cuda" and use_triton:
        log.warning("TRITON_INTERPRET=1: Triton times are the interpreter's (a correctness smoke test, not speed)")
    out.parent.mkdir(parents=True, exist_ok=True)
    for op in ops:
        for case in build_cases(op, shapes, device, dtype):
            # The reference twin of `allocate` is a host op: it is the "torch" row of that op.
            backends = ["triton", *case.variants, "torch"] if use_triton or op == "allocate" else ["torch"]
            times, outputs = {}, {}
            for backend in backends:
                times[backend] = time_us(lambda b=backend, c=case: c.call(b), device, repeats, iters)
                outputs[backend] = case.call(backend)
            for backend, us in times.items():
                gbps = case.bytes / (us * 1e-6) / 1e9
                row = {"op": case.op, "case": case.case, "backend": _label(op, backend), "R": case.R,
                       "shape": case.shape, "dtype": case.dtype, "us": round(us, 3), "bytes": case.bytes,
                       "gb_per_s": _sig(gbps), "roofline_pct": _sig(100 * gbps / roofline_gbps)}
                if backend != "torch" and "torch" in times:
                    row["speedup_vs_torch"] = round(times["torch"] / us, 2)
                    row["agreement"] = case.compare(outputs[backend], outputs["torch"])
                report["results"].append(row)
                log.info("%-10s %-13s R=%4d %-14s %10.1f µs %9.1f GB/s %6.1f%% roofline", case.op, case.case, case.R,
                         row["backend"], us, gbps, row["roofline_pct"])
        out.write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(report, out.with_suffix(".png"))
    except Exception as e:  # a plot must never cost the measured numbers
        log.warning("plotting failed: %s", e)
    log.info("wrote %s (%d rows)", out, len(report["results"]))
    return report


def _sig(x: float) -> float:
    """Four significant digits: readable JSON that keeps tiny CPU numbers non-zero."""
    return float(f"{x:.4g}")


def _label(op: str, backend: str) -> str:
    if op == "allocate":
        return "device" if backend == "triton" else "reference-host"
    return backend


def plot(report: dict[str, Any], path: Path) -> None:
    """One panel per op: µs against R per (case, backend), with the % of roofline of the fast path annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    cols = min(3, len(ops))
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        series = dict.fromkeys((r["case"], r["backend"]) for r in report["results"] if r["op"] == op)
        for case, backend in series:
            pts = sorted((r["R"], r["us"], r["roofline_pct"]) for r in report["results"]
                         if r["op"] == op and r["case"] == case and r["backend"] == backend)
            xs, ys, pct = zip(*pts)
            fast = backend.startswith("triton") or backend == "device"
            ax.plot(xs, ys, marker="o", linestyle="-" if fast else "--", label=f"{case} · {backend}")
            if fast:
                for x, y, p in zip(xs, ys, pct):
                    ax.annotate(f"{p:.0f}%", (x, y), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center")
        ax.set(xscale="log", yscale="log", xlabel="requests R", ylabel="µs per call", title=op)
        batches = sorted({r["R"] for r in report["results"] if r["op"] == op})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(f"Kernels on {report['hardware']} (labels: % of {report['roofline_gbps']:.0f} GB/s roofline)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    p = argparse.ArgumentParser(prog="python -m scripts.bench_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--op", default="all", choices=[*OPS, "all"],
                   help="the op to benchmark, or all (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                   help="cuda if present, else cpu (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="activations and caches (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--batches", default=None, help="comma list of R (default 1,4,16,64,256; tiny: 1,4)")
    p.add_argument("--tiny", action="store_true", help="miniature shapes (default on the CPU)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed calls per configuration (the median is reported) (default: %(default)s)")
    p.add_argument("--iters", type=int, default=None, help="calls per timed loop (default 20 on cuda, 2 on cpu)")
    p.add_argument("--roofline-gbps", type=float, default=H200_HBM_GBPS,
                   help="memory bandwidth the %% of roofline is computed against, GB/s (the H200's HBM) (default: "
                         "%(default)s)")
    p.add_argument("--tag", default=None, help="output name kernels-<tag>.json (default from the device)")
    p.add_argument("--out", default=None,
                   help="write the results as JSON to this path (and a PNG beside it) (default: %(default)s)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    shapes = Shapes.tiny() if tiny else Shapes()
    if args.batches:
        shapes = Shapes(**{**asdict(shapes), "batches": tuple(int(b) for b in args.batches.split(","))})
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.repeats < 1:
        raise SystemExit("--repeats must be ≥ 1")
    iters = args.iters or (20 if device.type == "cuda" else 2)
    tag = args.tag or default_tag(device)
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"kernels-{tag}.json"
    command = "python -m scripts.bench_kernels " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                      else sys.argv[1:]))
    ops = list(OPS) if args.op == "all" else [args.op]
    return run(ops, shapes, device, dtype, repeats=args.repeats, iters=iters, roofline_gbps=args.roofline_gbps,
               out=out, command=command)


if __name__ == "__main__":
    main()
    raise SystemExit(0)
