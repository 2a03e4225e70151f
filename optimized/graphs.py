"""All CUDA-graph capture in one place: verify graphs per total-token bucket, draft graphs per request count.

One static buffer set serves every graph. A verify graph runs the target over ``n`` packed tokens (every
request may carry 1..γ+1 of them, the query-length bound is γ+1) and, when a drafter is present, appends
the tapped features of those tokens to the drafter's context cache. A draft graph runs the drafter's
backbone for ``R`` request rows and, for the Markov head, the fused sequential head and the calibrated survivals.
The row dimension of every graph is ``max_num_seqs``: unused rows are
padding (zero queries, slot -1), with query offsets filled by the exact total so they stay non-decreasing
(the attention kernel reads its row bounds from them).

A prefill graph runs the target over ``n`` packed prompt tokens of at most ``PrefillBuffers.max_rows`` prompts
(chunks of any length: the query-length bound is the bucket size), computes the logits of each chunk's last token
and appends the features to the drafter's context. Prefill has its own buffers and coarser buckets: a prompt arrives
once, so padding costs little, while an eager prefill costs several milliseconds of kernel launches — in a server's
steady state, where some request is always being admitted, more than the decode step itself. A prefill never runs in
a decode graph (their query-length bounds differ).

With ``enforce_eager`` (or on CPU) the same functions run without graphs, so both paths execute the same
code.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("dspark.graphs")


def bucket_sizes(max_tokens: int) -> list[int]:
    """Token buckets: every size up to 8 (batch-1 steps carry 1..γ+1 tokens: no padding there), then steps of 8 to
    256 and, from there, steps of 1/16 of the size (16 from 256, 32 from 512, 64 from 1,024, ...). Past 128 tokens a
    padded step so runs at most 1/16 more tokens than it needs (6.25 %, about 3 % on average) at every size, and the
    number of graphs grows with the logarithm of the largest bucket instead of linearly: 87 graphs for 2,048 tokens
    (256 requests of γ + 1 = 8), where steps of 16 above 256 made 151, whose capture took 10.4 s of a 22.5 s warm
    start-up on the H200. Each graph costs capture time at start-up and a little memory."""
    sizes = list(range(1, min(8, max_tokens) + 1))
    n = 16
    while n < max_tokens:
        sizes.append(n)
        n += max(8, (1 << (n.bit_length() - 1)) // 16)  # 1/16 of the largest power of two ≤ n, at least 8
    if max_tokens not in sizes:
        sizes.append(max_tokens)
    return sorted(set(s for s in sizes if s <= max_tokens))


def prefill_bucket_sizes(max_tokens: int) -> list[int]:
    """Prefill token buckets: multiples of 16 growing by about 1.25× (16, 32, 48, 64, 80, 96, 112, 128, 160, ...)
    up to ``max_tokens`` — at most 25% padding, about 20 graphs for 2,048 tokens."""
    sizes, n = [], 16
    while n < max_tokens:
        sizes.append(n)
        n = max(n + 16, int(n * 1.25) // 16 * 16)
    sizes.append(max_tokens)
    return sorted(set(s for s in sizes if 1 <= s <= max_tokens))


def warmup_sizes(sizes: list[int]) -> list[int]:
    """The buckets a :class:`GraphRunner` runs eagerly before capturing all of them: the smallest bucket of each size
    class, and the largest.

    What a first call does that a capture must not (Triton compiling or loading a kernel for a new specialization)
    depends on a size's class, not on the size: Triton specializes integer arguments on ``== 1`` and on divisibility
    by 16, our kernels pick tile sizes from the next power of two of a length, and the fused small-batch projections
    run only up to a few rows. So a class is (the size itself up to 8, its next power of two, divisible by 16 or not),
    and one bucket of each covers the others (the GPU equivalence tests replay every bucket against eager runs).
    Warming all 87 verify buckets took 3.1–3.2 s of a 22.6 s warm start-up on the H200, one of each class 1.3–1.6 s.
    """
    first: dict[tuple[int, int, bool], int] = {}
    for s in sorted(sizes):
        first.setdefault((s if s <= 8 else 0, 1 << (s - 1).bit_length(), s % 16 == 0), s)
    return sorted(set(first.values()) | ({max(sizes)} if sizes else set()))


class GraphRunner:
    """Captures ``fn`` once per bucket size over static input buffers; replays the smallest bucket ≥ n.

    ``fn(n)`` must read its inputs from the runner's static buffers (sliced to ``n`` tokens where they are
    per token) and return a tuple of tensors. Outputs are views into graph memory, valid until the next
    replay of any graph sharing the pool; the engine consumes them within the step.
    """

    def __init__(self, name: str, fn: Callable[[int], tuple[Tensor, ...]], sizes: list[int], enabled: bool,
                 pool=None) -> None:
        self.name, self.fn, self.sizes, self.enabled = name, fn, sorted(sizes), enabled
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]] = {}
        self.pool = pool

    def padded(self, n: int) -> int:
        """The size that actually runs for n (the bucket, or n itself above the largest bucket)."""
        for s in self.sizes:
            if s >= n:
                return s
        return n

    def capture(self) -> None:
        if not self.enabled:
            return
        before, t0 = torch.cuda.memory_allocated(), time.perf_counter()
        # Warm up one bucket of each size class first (warmup_sizes): a first call compiles or loads kernels (Triton
        # at each new specialization; none of ours autotunes), and cuBLAS creates its handle, which must not happen
        # inside a capture. One pass is enough; a second ran every bucket again and took about a third of the stage.
        warmed = warmup_sizes(self.sizes)
        self._warm_up(warmed)
        warm = time.perf_counter() - t0
        # No garbage collection inside a capture: a collection there that frees another engine's graphs (an engine
        # dropped in a reference cycle, then a new one built) destroys graph executables while the stream captures,
        # which CUDA forbids, and the capture fails. The collector waits until the last graph is captured; garbage
        # goes at its next run, outside any capture.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for s in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool blocks
                try:
                    self.graphs[s] = self._capture_one(s)
                except RuntimeError as err:
                    # A failed capture leaves the allocator recording into the pool: no second attempt can follow.
                    skipped = "" if s in warmed else " (a size the warm-up skipped)"
                    raise RuntimeError(f"capturing the {self.name} graph of {s} failed{skipped}: {err}. Serve with "
                                       "--enforce-eager (no CUDA graphs) and report it") from err
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize()  # sync: start-up capture, off the step loop
        log.info("captured %d %s graphs (%s..%s) in %.2f s (warm-up of %d sizes %.2f s), %.1f MiB of graph memory",
                 len(self.graphs), self.name, self.sizes[0], self.sizes[-1], time.perf_counter() - t0, len(warmed),
                 warm, (torch.cuda.memory_allocated() - before) / 2**20)

    def _warm_up(self, sizes: list[int]) -> None:
        """Run ``fn`` eagerly at ``sizes`` on a side stream (as PyTorch's CUDA-graph notes prescribe), then sync."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for s in sizes:
                self.fn(s)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()  # sync: start-up capture, off the step loop

    def _capture_one(self, s: int) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.fn(s)
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def run(self, n_pad: int) -> tuple[Tensor, ...]:
        """Replay the graph of size ``n_pad`` (inputs already in the static buffers), or run eagerly."""
        entry = self.graphs.get(n_pad)
        if entry is None:
            return self.fn(n_pad)
        graph, out = entry
        graph.replay()
        return out


class StaticBuffers:
    """The one static input set of the verify and draft graphs."""

    def __init__(self, max_rows: int, max_tokens: int, device: torch.device, vocab_size: int) -> None:
        i32, i64 = torch.int32, torch.long
        self.max_rows, self.max_tokens = max_rows, max_tokens
        # [N, V] fp32 verify logits: the one output buffer of every verify graph (valid until the next verify).
        # (The draft graphs write their distributions straight into the runner's per-slot p_d, through draft_slots.)
        self.logits = torch.zeros(max_tokens, vocab_size, dtype=torch.float32, device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=i64, device=device)  # [N]
        self.positions = torch.zeros(max_tokens, dtype=i64, device=device)  # [N]
        self.token_slot = torch.full((max_tokens,), -1, dtype=i64, device=device)  # [N] drafter append slot
        self.cu = torch.zeros(max_rows + 1, dtype=i32, device=device)  # [R+1]
        self.kv_lens = torch.zeros(max_rows, dtype=i32, device=device)  # [R]
        self.slot_ids = torch.full((max_rows,), -1, dtype=i32, device=device)  # [R]
        self.anchor_ids = torch.zeros(max_rows, dtype=i64, device=device)  # [R] draft graph inputs
        self.anchor_pos = torch.zeros(max_rows, dtype=i64, device=device)  # [R]
        self.draft_slots = torch.full((max_rows,), -1, dtype=i32, device=device)  # [R]
        self.draft_temperature = torch.zeros(max_rows, dtype=torch.float32, device=device)  # [R] sampling head inputs
        self.draft_request_id = torch.zeros(max_rows, dtype=i64, device=device)  # [R]

    def layout(self) -> dict[str, Tensor]:
        """The verify inputs by name, for ``optimized.kernels.layout.verify_layout`` to fill in place."""
        return {"input_ids": self.input_ids, "positions": self.positions, "token_slot": self.token_slot,
                "cu": self.cu, "kv_lens": self.kv_lens, "slot_ids": self.slot_ids}

    def draft_inputs(self) -> dict[str, Tensor]:
        """The draft graph's inputs by name, for ``optimized.kernels.layout.draft_load`` to fill in place."""
        return {"anchor_ids": self.anchor_ids, "anchor_pos": self.anchor_pos, "draft_slots": self.draft_slots,
                "draft_temperature": self.draft_temperature, "draft_request_id": self.draft_request_id}


class PrefillBuffers:
    """The static inputs of the prefill graphs: up to ``max_rows`` prompt chunks of ``max_tokens`` tokens in all.

    The int64 inputs are views of one device tensor and the int32 ones of another, so a step loads them with two
    host→device copies, each covering the whole buffer (its padding included, so no state survives a step).
    """

    def __init__(self, max_rows: int, max_tokens: int, device: torch.device, vocab_size: int) -> None:
        self.max_rows, self.max_tokens = max_rows, max_tokens
        p, r = max_tokens, max_rows
        self._host64 = np.zeros(3 * p + r, dtype=np.int64)
        self._host32 = np.zeros(3 * r + 1, dtype=np.int32)
        self._flat64 = torch.zeros(3 * p + r, dtype=torch.long, device=device)
        self._flat32 = torch.zeros(3 * r + 1, dtype=torch.int32, device=device)
        self.input_ids = self._flat64[:p]  # [P]
        self.positions = self._flat64[p:2 * p]  # [P]
        self.token_slot = self._flat64[2 * p:3 * p]  # [P] drafter append slot, -1 for padding
        self.last_rows = self._flat64[3 * p:]  # [Rp] logits rows: the last token of each completed chunk first
        self.cu = self._flat32[:r + 1]  # [Rp+1]
        self.kv_lens = self._flat32[r + 1:2 * r + 1]  # [Rp]
        self.slot_ids = self._flat32[2 * r + 1:]  # [Rp], -1 for padding
        self.slot_ids.fill_(-1)
        self.token_slot.fill_(-1)
        # [Rp, V] fp32 logits of the last rows: the one output buffer of every prefill graph.
        self.logits = torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device)

    def load(self, tokens: list[int], positions: list[int], cu: list[int], kv_lens: list[int], slots: list[int],
             last_rows: list[int]) -> None:
        """Write one step's chunks (host lists, as ``ModelRunner.prefill`` builds them); the rest becomes padding:
        tokens 0 at position 0 in slot -1 (the trash slot), rows of length 0 (the offset repeated), logits row 0."""
        p, r = self.max_tokens, self.max_rows
        n, rows = len(tokens), len(slots)
        if n > p or rows > r:
            raise ValueError(f"{rows} chunks of {n} tokens exceed the prefill buffers ({r} chunks, {p} tokens)")
        h64, h32 = self._host64, self._host32
        h64[:] = 0
        h64[2 * p:3 * p] = -1
        h64[:n] = tokens
        h64[p:p + n] = positions
        h64[2 * p:2 * p + n] = np.repeat(np.asarray(slots, dtype=np.int64), np.diff(cu))
        h64[3 * p:3 * p + len(last_rows)] = last_rows
        h32[:rows + 1] = cu
        h32[rows + 1:r + 1] = cu[-1]
        h32[r + 1:2 * r + 1] = 0
        h32[r + 1:r + 1 + rows] = kv_lens
        h32[2 * r + 1:] = -1
        h32[2 * r + 1:2 * r + 1 + rows] = slots
        # Pageable sources: each copy stages the host array before returning, so the arrays may be rewritten next
        # step while the device has not yet run the copy.
        self._flat64.copy_(torch.from_numpy(h64), non_blocking=True)
        self._flat32.copy_(torch.from_numpy(h32), non_blocking=True)
