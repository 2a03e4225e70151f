"""The engine's start-up configuration: sizes and switches fixed for its life (static caches, CUDA-graph buckets).

A separate type from the scheduling policy (``reference.config.SchedulerConfig``), which may change between runs
(``Engine.set_scheduler``), and from the per-request ``SamplingParams`` (``optimized/sequence.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("auto", "triton", "torch")


@dataclass
class EngineConfig:
    """Sizes fixed at start-up (static caches and CUDA-graph buckets depend on them)."""

    max_num_seqs: int = 64  # slots of the static KV caches = the largest decoding batch
    max_seq_len: int = 2048  # positions per slot (prompt + output + γ scratch for the drafter block)
    prefill_chunk: int = 8192  # prompt tokens per step over all prefilling requests (chunked prefill)
    # The longest prefill step (prompt tokens over its chunks, at most 16 prompts) that replays a CUDA graph; longer
    # chunks run eagerly, where the launches of 30 layers cost milliseconds whatever the length. 0: prefill eagerly.
    prefill_graph_tokens: int = 2048
    enforce_eager: bool = False  # True: no CUDA graphs (the same code path, launched eagerly)
    kernel_backend: str = "auto"  # "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"
    # The element-wise layer ops (RMSNorm, RoPE + KV append, SiLU·up; optimized/kernels/layer_ops.py): None follows
    # kernel_backend; "torch" keeps the unfused HF-rounding ops on CUDA too (to measure what the fusion buys).
    layer_backend: str | None = None
    # Steps of at most this many tokens (a decode step of up to 16 requests, a verify block of eight tokens at batch 1
    # or 2, the drafter's block) run each layer's projections as fused small-batch Triton kernels with the norms and
    # SiLU·up folded in (optimized/kernels/linear.py), six kernels a layer instead of nine. None: that module's
    # FUSED_MAX_ROWS; 0: never (cuBLAS at every size, to measure what the fusion buys). Only where the layer ops run
    # on Triton.
    linear_rows: int | None = None
    # Every target step, whatever its size, runs each kernel on one tile shape (row_invariant: the projections and
    # LM head on optimized/kernels/linear.py's tl.dot tiles, the attention on one query tile): a token's logits are
    # then the same bits in a verify block, a batch or a step of its own, so greedy speculative decoding emits plain
    # decoding's tokens in bfloat16 too (docs/numerics.md). 0.6-1.0x the default's throughput on the H200; for
    # deployments that need exact greedy output. Only where the layer ops run on Triton (on the GPU).
    batch_invariant: bool = False
    seed: int = 0  # root of the random-number contract (reference/sampling.py)
    # Plan the next step (the draft gate's verdict, the adaptive budget) while the device verifies, instead of
    # after the token read: the same decisions, off the host's critical path. None: on CUDA, where the device runs
    # ahead of the host (on the CPU the forward has finished by then, so it would only move the work).
    plan_ahead: bool | None = None
    # With plan_ahead: when the gate's verdict planned ahead says the requests decoding now draft, launch the
    # drafter for them before the token read, so that the device drafts while the host commits the tokens. Drafts of
    # requests that finish in the step are dropped (their slots are freed); the decisions and tokens are unchanged
    # (tests/equivalence/test_end_to_end.py). None: wherever plan_ahead is on (1.02-1.13x adaptive's tokens/s in a
    # steady state on an H200, docs/benchmarks/index.md).
    draft_ahead: bool | None = None
    # Steps one ahead of their token reads: step n+1's verify is launched before step n's tokens are read (each
    # request's next anchor, and its next drafts, are already on the device), so the host's commit, the draft gate and
    # the next launches overlap the device's forward. Plain decoding and the modes that plan without this step's outcome
    # (none, fixed, dsd, adaptive: SchedulingMode.plans_blind) with the DSpark drafter; the n-gram and hybrid proposers
    # and the synchronous policies step synchronously. Outputs come back one step later; a request that finished at step
    # n has run one wasted row in step n+1, whose tokens are dropped; near the end of a slot the engine steps
    # synchronously. The adaptive budget then reads survivals one draft older at steps where requests join or finish, so
    # its verify lengths can differ from the synchronous engine's there (greedy tokens never do). None: on CUDA (plain
    # decoding 1.06-1.13x faster on an H200); on the CPU the forward has finished before the read, so there is nothing
    # to overlap.
    async_decode: bool | None = None
    # Compare each decoding step's measured time with the cost table's price, per kind of step (plain, speculative),
    # and price a kind at its measured ratio once it drifts by more than 10 % (optimized/cost_monitor.py): the draft
    # gate then weighs what steps cost now (another process on the GPU, a table profiled in other conditions). It
    # makes the adaptive schedule depend on measured times, so sampled adaptive outputs are then not repeatable from
    # run to run (greedy outputs are unaffected). None: on CUDA; off on the CPU, where the equivalence tests hold the
    # schedule to the reference's.
    cost_feedback: bool | None = None
    # Compare the survivals the confidence head forecast for verified drafts with the drafts that survived, slot by
    # slot, and plan the adaptive budget and the draft gate with the survivals times the measured ratio (clipped to
    # 0.5-1.5) once it moves by more than 5 % (optimized/acceptance_monitor.py): a head over-confident on the traffic
    # being served otherwise keeps a large batch drafting that plain decoding would beat. Like cost_feedback it makes
    # the adaptive schedule depend on the traffic so far (sampled adaptive outputs are then not repeatable; greedy ones
    # are unaffected). Off by default.
    acceptance_feedback: bool = False
    # An offline batch (every request known up front: optimized.generate, scripts/bench_engine): once no request waits
    # for a slot, the adaptive mode's draft gate compares the expected time to finish the running requests drafting
    # every step against plain decoding (reference.scheduler.finish_estimate), instead of one step's tokens per second.
    # There the slowest request sets the time: at large batch sizes a drafting step outearns a plain one, yet plain
    # decoding finishes the batch sooner. Wrong for a server, whose clients send again as soon as they are answered
    # (the next request is only not known yet): off by default, and `python -m optimized.serve` leaves it off.
    finish_time_gate: bool = False
    # A step that verifies no drafts (plain decoding on an engine with a drafter: the draft gate closed) runs the
    # target alone, as the engine without a drafter does (its own CUDA graphs, a one-token query per request): the
    # tapped features of its tokens wait in a per-slot buffer of this many positions instead of being projected into
    # the drafter's context, and are appended in one batched call before the request's next draft (or when the
    # buffer is full). The drafter's context ends up with the same features either way. 0: every step appends them.
    draft_context_lag: int = 32
    device: str = "cpu"  # where the caches, graphs and kernels live: "cpu" or "cuda[:N]" (the target's device)
    dtype: torch.dtype = torch.float32  # the caches' dtype = the target's (bfloat16 on a GPU, float32 for exact tests)

    def __post_init__(self) -> None:
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"kernel_backend must be auto, triton or torch, got {self.kernel_backend!r}")
        if self.layer_backend is not None and self.layer_backend not in BACKENDS:
            raise ValueError(f"layer_backend must be None, auto, triton or torch, got {self.layer_backend!r}")
        if self.max_num_seqs < 1 or self.max_seq_len < 2 or self.prefill_chunk < 1:
            raise ValueError("max_num_seqs, max_seq_len and prefill_chunk must be positive")
        if self.linear_rows is not None and self.linear_rows < 0:
            raise ValueError(f"linear_rows must be None or ≥ 0 (0: never fused), got {self.linear_rows}")
        if self.batch_invariant and self.layer_backend == "torch":
            raise ValueError("batch_invariant runs the projections on the Triton kernels: it needs the Triton layer "
                             "ops, not layer_backend='torch'")
        if self.draft_context_lag < 0:
            raise ValueError(f"draft_context_lag must be ≥ 0 (0: append every step), got {self.draft_context_lag}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be ≥ 0 (0: eager prefill), got {self.prefill_graph_tokens}")
