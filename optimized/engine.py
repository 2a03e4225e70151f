"""The optimized engine: continuous batching + confidence-scheduled speculative decoding on static caches.

The same method as ``reference/generate.py`` (docs/method.md §1–§5), batched on the device. One ``step()``::

    plan      admit waiting requests, choose prefill chunks, and the verify budget B from a stale host copy of
              the survivals (no wait on the device)
    prefill   prompt chunks through the target (eager, never in a decode graph); finished prompts sample
              their first token and append their features to the drafter context
    verify    one varlen target forward over [x_0, x_1..x_ℓ] of every decoding request (CUDA graph per token
              bucket), ℓ_r = top-B of the *current* survivals on the device, then rejection sampling
    commit    one host read of the emitted tokens (finishing, streaming, stop strings)
    draft     drafter context += features of the verified positions; backbone over [x_0, M, …, M]; fused
              sequential-head sampling + confidence; STS → survivals for the next step

Every per-request length, offset and position is derived on the device from device tensors. The host holds
totals only (the number of decoding requests, the budget B). The single host↔device synchronisation per step
is the read of the emitted tokens (named below); the budget never waits for the device.

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from optimized.graphs import GraphRunner, StaticBuffers, bucket_sizes
from optimized.kernels.allocate import allocate_top_b
from optimized.kernels.draft_head import sample_block
from optimized.kernels.layout import verify_layout
from optimized.kernels.sampling import sample
from optimized.kernels.verify import rejection_sample
from optimized.models.drafter import OptimizedDrafter
from optimized.models.target import OptimizedTarget
from optimized.scheduler import BatchScheduler, BudgetPlanner, SamplingParams, Sequence, Status
from reference.calibration import biases_for, temperatures_for
from reference.config import SchedulerConfig
from reference.cost_model import CostTable
from reference.drafter import DSparkDrafter
from reference.sampling import Purpose, logits_to_probs
from reference.scheduler import Scheduler
from reference.target import Target

log = logging.getLogger("dspark.engine")


@dataclass
class EngineConfig:
    """Sizes fixed at start-up (static caches and CUDA-graph buckets depend on them)."""

    max_num_seqs: int = 64  # slots of the static KV caches = the largest decoding batch
    max_seq_len: int = 2048  # positions per slot (prompt + output + γ scratch for the drafter block)
    prefill_chunk: int = 8192  # prompt tokens per step over all prefilling requests (chunked prefill)
    enforce_eager: bool = False  # True: no CUDA graphs (the same code path, launched eagerly)
    kernel_backend: str = "auto"  # "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"
    # The element-wise layer ops (RMSNorm, RoPE + KV append, SiLU·up; optimized/kernels/layer_ops.py): None follows
    # kernel_backend; "torch" keeps the unfused HF-rounding ops on CUDA too (to measure what the fusion buys).
    layer_backend: str | None = None
    seed: int = 0  # root of the random-number contract (reference/sampling.py)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kernel_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"kernel_backend must be auto, triton or torch, got {self.kernel_backend!r}")
        if self.layer_backend not in (None, "auto", "triton", "torch"):
            raise ValueError(f"layer_backend must be None, auto, triton or torch, got {self.layer_backend!r}")
        if self.max_num_seqs < 1 or self.max_seq_len < 2 or self.prefill_chunk < 1:
            raise ValueError("max_num_seqs, max_seq_len and prefill_chunk must be positive")


@dataclass
class StepStats:
    """What one ``step()`` did, read on the host after it (for monitoring: the server's metrics).

    The per-request lists run over the requests that verified this step, in one order. A draft slot ``k`` of
    request ``i`` is a calibration trial only if it was verified (``k < verified[i]``); it survived if
    ``k < accepted[i]``. Unverified slots are censored, not rejections.
    """

    step_time_s: float  # host wall time of the step; it ends with the token read, so the device work is inside
    num_running: int  # requests holding a slot after the step
    num_waiting: int  # requests queued for a slot after the step
    num_decoding: int  # R: requests that verified this step (prefill-only requests excluded)
    verify_tokens: int  # N = R + Σℓ: tokens of the verify forward (0 when nobody verified)
    budget: int | None  # adaptive mode: the verify budget B of this step; None in other modes or with no drafts
    drafted: bool  # whether the drafter ran at the end of this step (False: mode none, or the draft gate closed)
    verified: list[int] = field(default_factory=list)  # ℓ_r per verifying request
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verifying request (emitted - 1)
    # Calibrated prefix survivals a_{r,1..γ} of the draft each request verified ([] if it held none).
    predicted_survival: list[list[float]] = field(default_factory=list)


@dataclass
class StepOutput:
    """What one step produced for one request (for streaming)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # [(token, logprob)] per token


class Engine:
    """``add_request`` / ``step`` / ``abort`` over a fixed set of slots."""

    def __init__(self, target: Target, drafter: DSparkDrafter | None, config: EngineConfig,
                 sched: SchedulerConfig, cost: CostTable | None = None) -> None:
        if sched.mode != "none" and drafter is None:
            raise ValueError(f"mode {sched.mode!r} needs a drafter")
        # An adaptive engine may be built without a cost table so that the table can be profiled on this very
        # engine (its own graphs and buckets, no second capture); step() refuses to run until it is installed.
        self.config, self.sched_config, self.cost = config, sched, cost
        self.device = torch.device(config.device)
        self.reference_target = target
        self.gamma = drafter.config.block_size if drafter is not None else 0
        self.vocab = target.vocab_size
        # Static caches: max_num_seqs slots (+ a trash slot the models add for padding writes).
        self.target = OptimizedTarget(target, attention_backend=config.kernel_backend,
                                      layer_backend=config.layer_backend)
        self.target.allocate_cache(config.max_num_seqs, config.max_seq_len)
        self.drafter = None
        self.ref_drafter = drafter
        if drafter is not None and sched.mode != "none":
            self.drafter = OptimizedDrafter(drafter, attention_backend=config.kernel_backend,
                                            layer_backend=config.layer_backend)
            self.drafter.allocate_cache(config.max_num_seqs, config.max_seq_len)
            self.sts = {mode: torch.tensor(temperatures_for(drafter.config, mode), device=self.device)
                        for mode in ("greedy", "sampling")}
            # b = 0 for a mode calibrated without biases: adding +0.0 leaves every float as the reference has it
            self.sts_bias = {mode: torch.tensor(biases_for(drafter.config, mode) or [0.0] * self.gamma,
                                                device=self.device) for mode in ("greedy", "sampling")}
        self._setup_graphs()
        self.batch = BatchScheduler(sched, config.max_num_seqs, config.max_seq_len, config.prefill_chunk)
        needs_table = sched.mode in ("adaptive", "adaptive-sync") and cost is None
        self.policy = None if needs_table else Scheduler(sched, gamma=max(self.gamma, 1), cost=cost)  # see step()
        self.planner = BudgetPlanner(cost)
        self.eos = sorted(target.eos_token_ids)
        self.tokenizer = target.tokenizer
        self._alloc_state(config.max_num_seqs)
        self._ids: dict[int, Sequence] = {}
        self.drafted = True  # whether the current decoding requests hold drafts (the draft gate may skip a step)
        self._gate_cache = None  # (requests and their draft counts, recent survivals, verdict) of the last gate
        # The gate's moving average per slot (host), how many of the slot's drafts it holds, and whose they are.
        self._recent = np.full((config.max_num_seqs, max(self.gamma, 1)), np.nan, dtype=np.float32)
        self._recent_count = [0] * config.max_num_seqs
        self._recent_owner: list[Sequence | None] = [None] * config.max_num_seqs
        self.stats = {"steps": 0, "host_schedule_s": 0.0, "step_s": 0.0}
        self._last_stats: StepStats | None = None
        self._verify_record: tuple[int, list[int], list[int], list[list[float]]] = (0, [], [], [])

    # ------------------------------------------------------------------------------------------------------
    # Per-slot device state
    # ------------------------------------------------------------------------------------------------------

    def _alloc_state(self, slots: int) -> None:
        dev, g = self.device, max(self.gamma, 1)
        self.anchor = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] x_0 of each slot
        self.anchor_pos = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] its absolute position
        self.draft_tokens = torch.zeros(slots, g, dtype=torch.long, device=dev)  # [S, γ]
        self.draft_probs = torch.zeros(slots, g, self.vocab, dtype=torch.float32, device=dev)  # [S, γ, V]
        self.survival = torch.zeros(slots, g, dtype=torch.float32, device=dev)  # [S, γ] calibrated a_k
        self.request_id = torch.zeros(slots, dtype=torch.long, device=dev)  # [S]
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)  # [S]
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)  # [S]
        self.top_k = torch.zeros(slots, dtype=torch.long, device=dev)  # [S]

    def _setup_graphs(self) -> None:
        """One verify graph per token bucket and one draft graph per request bucket (CUDA only)."""
        cfg, g = self.config, max(self.gamma, 1)
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager
        max_tokens = cfg.max_num_seqs * (g + 1)
        self.buffers = StaticBuffers(cfg.max_num_seqs, max_tokens, self.device, self.target.lm_head.shape[0])
        self.max_q_len = g + 1
        b = self.buffers

        def verify_fn(n: int):
            logits, features = self.target.forward(b.input_ids[:n], b.positions[:n], b.cu, b.kv_lens, b.slot_ids,
                                                   None, max_q_len=self.max_q_len, logits_out=b.logits[:n])
            if self.drafter is not None:  # the features of every verified token go to the drafter context
                self.drafter.append_context(features, b.positions[:n], b.token_slot[:n])
            return (logits,)

        # The Markov head's sampling kernels read only device tensors, so the whole drafter stage — backbone, fused
        # head, STS survivals — is one graph. The RNN and parallel-only heads run the reference loop after it.
        self.head_in_graph = self.drafter is not None and self.ref_drafter.config.head == "markov"

        def draft_fn(r: int):
            h = self.drafter.backbone(b.anchor_ids[:r], b.anchor_pos[:r], b.draft_slots[:r])
            if not self.head_in_graph:
                return (h,)
            temperature = b.draft_temperature[:r]
            out = sample_block(self.ref_drafter, h, b.anchor_ids[:r], b.anchor_pos[:r], temperature,
                               self.config.seed, b.draft_request_id[:r], backend=self.config.kernel_backend)
            return out.tokens, out.probs, self._survival(out.conf_logits, temperature)

        self.verify_graphs = GraphRunner("verify", verify_fn, bucket_sizes(max_tokens), use_graphs)
        self.verify_graphs.capture()
        self.draft_graphs = None
        if self.drafter is not None:
            self.draft_graphs = GraphRunner("draft", draft_fn, bucket_sizes(cfg.max_num_seqs), use_graphs,
                                            pool=self.verify_graphs.pool)
            try:
                self.draft_graphs.capture()
            except RuntimeError as err:  # keep serving: the head then runs eagerly after the backbone graph
                if not self.head_in_graph:
                    raise
                log.warning("capturing the draft head failed (%s); the head runs outside the draft graph", err)
                self.head_in_graph = False
                torch.cuda.synchronize()  # sync: start-up capture, off the step loop
                self.draft_graphs = GraphRunner("draft", draft_fn, bucket_sizes(cfg.max_num_seqs), use_graphs,
                                                pool=self.verify_graphs.pool)
                self.draft_graphs.capture()

    # ------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue a tokenised prompt; returns its request id (which keys its random numbers)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab})")
        rid = request_id if request_id is not None else (max(self._ids, default=-1) + 1)
        if rid in self._ids and not self._ids[rid].finished:
            raise ValueError(f"request id {rid} is already running")
        params = params or SamplingParams()
        room = self.config.max_seq_len - self.gamma - 1
        if len(prompt_ids) + params.max_new_tokens + self.gamma + 1 > self.config.max_seq_len:
            if len(prompt_ids) >= room:
                raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_seq_len "
                                 f"{self.config.max_seq_len} (γ = {self.gamma} positions are scratch)")
        seq = Sequence(request_id=rid, prompt_ids=list(prompt_ids), params=params)
        self.batch.add(seq)
        self._ids[rid] = seq
        return rid

    def abort(self, request_id: int) -> bool:
        return self.batch.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.batch.has_work()

    def sequence(self, request_id: int) -> Sequence:
        return self._ids[request_id]

    def release(self, request_id: int) -> None:
        """Forget a finished request (its ``Sequence``), so a long-running server does not keep every request."""
        seq = self._ids.get(request_id)
        if seq is not None and not seq.finished:
            raise ValueError(f"request {request_id} is still running: abort it first")
        self._ids.pop(request_id, None)

    def last_step_stats(self) -> StepStats | None:
        """What the latest ``step()`` did (``None`` before the first step)."""
        return self._last_stats

    def warmup(self, new_tokens: int | None = None) -> float:
        """Run the serving path once on dummy requests, so that compilation happens now and not in the first
        user request: eager prefill at a few lengths, greedy and sampled verification with and without top-p /
        top-k, log-probabilities, the drafter and the draft gate, at one and at several requests. Graph capture
        already happened in the constructor; an adaptive engine needs its cost table first. Returns seconds.
        """
        if self.batch.has_work():
            raise RuntimeError("warm-up runs dummy requests: call it before serving")
        t0 = time.perf_counter()
        g = self.gamma
        new = new_tokens or g + 2  # prefill, then verify + draft steps until the draft slots have all been used
        longest = self.config.max_seq_len - new - 2 * g - 2
        if longest < 1:
            raise ValueError(f"max_seq_len {self.config.max_seq_len} leaves no room for a warm-up request")
        # Prompt lengths 1, 16 and 17: Triton specialises integer arguments equal to 1 and divisible by 16.
        lengths = [min(n, longest) for n in (17, 16, 1, 33)]
        params = [SamplingParams(max_new_tokens=new, ignore_eos=True),
                  SamplingParams(max_new_tokens=new, temperature=0.8, ignore_eos=True, logprobs=True),
                  SamplingParams(max_new_tokens=new, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),
                  SamplingParams(max_new_tokens=new, temperature=0.0, top_k=5, ignore_eos=True, logprobs=True,
                                 raw_logprobs=True, top_logprobs=5)]
        rounds = [[(lengths[0], params[0])], list(zip(lengths, params))[: self.config.max_num_seqs]]
        first = max(self._ids, default=-1) + 1
        for batch in rounds:
            ids = [self.add_request([(7 * j + 3 * i + 1) % self.vocab for j in range(n)], p, request_id=first + i)
                   for i, (n, p) in enumerate(batch)]
            first += len(ids)
            while self.batch.has_work():
                self.step()
            for rid in ids:
                self.release(rid)
        if self.policy is not None:
            self.policy.steps_without_draft = 0  # serving starts as a fresh engine would
        self._gate_cache, self._last_stats = None, None
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # sync: start-up, off the step loop
        return time.perf_counter() - t0

    def set_cost_table(self, cost: CostTable) -> None:
        """Install the step-cost table (measured on this engine by ``optimized.cost_model.profile_engine``)."""
        self.cost = cost
        self.policy = Scheduler(self.sched_config, gamma=max(self.gamma, 1), cost=cost)
        self.planner = BudgetPlanner(cost)
        self._gate_cache = None

    def set_scheduler(self, sched: SchedulerConfig) -> None:
        """Switch the verify-length policy between runs, keeping caches and graphs (benchmarks of every mode)."""
        if self.batch.has_work():
            raise RuntimeError("cannot switch the scheduler while requests are running")
        if (sched.mode == "none") != (self.drafter is None):
            raise ValueError(f"mode {sched.mode!r} on an engine built {'without' if self.drafter is None else 'with'} "
                             "a drafter: build a separate engine (mode none never drafts, the others need a drafter)")
        if sched.mode in ("adaptive", "adaptive-sync") and self.cost is None:
            raise ValueError(f"mode {sched.mode!r} needs a cost table: call set_cost_table first")
        self.sched_config = sched
        self.batch.config = sched
        self.policy = Scheduler(sched, gamma=max(self.gamma, 1), cost=self.cost)
        self._gate_cache = None

    # ------------------------------------------------------------------------------------------------------
    # Profiling dummy steps (optimized/cost_model.py): the serving code path and graphs, on placeholder slots
    # ------------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_verify(self, num_tokens: int, context_len: int) -> None:
        """One verify stage of ``num_tokens`` tokens for requests whose anchors sit at ``context_len``.

        ``min(num_tokens, max_num_seqs)`` placeholder requests (slots 0..) share the drafts evenly — the top-B
        allocation of equal survivals — so every query length is 1..γ+1 as in serving. It runs
        ``_verify_and_commit`` itself: layout, graph replay, p_t, rejection sampling, the token read, the commit.
        """
        r = min(num_tokens, self.config.max_num_seqs)
        if num_tokens < 1 or num_tokens > r * (self.gamma + 1):
            raise ValueError(f"num_tokens must lie in 1..{self.config.max_num_seqs * (self.gamma + 1)}, "
                             f"got {num_tokens}")
        seqs = self._profile_sequences(r, context_len)
        self.survival[:r] = 1.0  # equal survivals: ties go by (slot, request), which spreads the drafts evenly
        self._verify_and_commit(seqs, {"mode": "adaptive", "budget": num_tokens - r}, [])

    @torch.inference_mode()
    def profile_draft(self, num_requests: int, context_len: int) -> None:
        """One drafter stage (backbone graph + fused head + STS) for ``num_requests`` placeholder requests."""
        if self.drafter is None:
            raise RuntimeError("this engine has no drafter (mode none)")
        if not 1 <= num_requests <= self.config.max_num_seqs:
            raise ValueError(f"num_requests must lie in 1..{self.config.max_num_seqs}, got {num_requests}")
        self._draft(self._profile_sequences(num_requests, context_len))

    def _profile_sequences(self, count: int, context_len: int) -> list[Sequence]:
        """Placeholder decoding requests in slots 0..count-1, anchors at ``context_len`` (reset on every call)."""
        if self.batch.has_work():
            raise RuntimeError("profiling overwrites slot state: run it while no request is running")
        if not 1 <= context_len <= self.config.max_seq_len - 2 * self.gamma - 4:
            raise ValueError(f"context_len must lie in 1..max_seq_len - 2γ - 4 = "
                             f"{self.config.max_seq_len - 2 * self.gamma - 4}, got {context_len}")
        cached = getattr(self, "_profile_seqs", None)
        if cached is None or len(cached[1]) < count or cached[0] != context_len:
            prompt = [0] * context_len  # shared by all placeholders, never mutated
            params = SamplingParams(max_new_tokens=self.config.max_seq_len, ignore_eos=True)
            seqs = [Sequence(request_id=i, prompt_ids=prompt, params=params, slot=i)
                    for i in range(self.config.max_num_seqs)]
            self._profile_seqs = (context_len, seqs)
        seqs = self._profile_seqs[1][:count]
        for s in seqs:  # host state back to "one token emitted after the context"
            s.status, s.output_ids, s.survivals, s.verify_lengths, s.accepted_lengths = Status.DECODE, [0], [], [], []
        self.request_id[:count] = torch.arange(count, device=self.device)
        self.temperature[:count], self.top_p[:count], self.top_k[:count] = 0.0, 1.0, 0  # greedy, no filters
        self.anchor[:count] = 0
        self.anchor_pos[:count] = context_len
        return seqs

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One engine step: plan, prefill, verify, commit, draft."""
        if self.sched_config.mode in ("adaptive", "adaptive-sync") and self.cost is None:
            raise RuntimeError(f"mode {self.sched_config.mode!r} needs a cost table: call set_cost_table (e.g. with "
                               "optimized.cost_model.cached_profile(engine)) before stepping")
        t0 = time.perf_counter()
        self.batch.admit()
        prefill_plan = self.batch.plan_prefill()
        decoding = self.batch.decoding()
        plan = self._plan_verify(decoding) if decoding else None
        t1 = time.perf_counter()
        outputs: list[StepOutput] = []
        newly_decoding = self._prefill(prefill_plan, outputs) if prefill_plan else []
        if decoding:
            self._verify_and_commit(decoding, plan, outputs)
        to_draft = [s for s in decoding + newly_decoding if not s.finished]
        t2 = time.perf_counter()
        self.drafted = bool(to_draft) and self.drafter is not None and self._draft_gate(to_draft)
        t3 = time.perf_counter()
        if self.drafted:
            self._draft(to_draft)
            self.stats["draft_steps"] = self.stats.get("draft_steps", 0) + 1
        t_end = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["host_schedule_s"] += (t1 - t0) + (t3 - t2)
        self.stats["step_s"] += t_end - t0
        n_tokens, verified, accepted, predicted = self._verify_record if decoding else (0, [], [], [])
        self._last_stats = StepStats(t_end - t0, len(self.batch.running), len(self.batch.waiting), len(decoding),
                                     n_tokens, plan["budget"] if plan else None, self.drafted, verified, accepted,
                                     predicted)
        return outputs

    # ------------------------------------------------------------------------------------------------------
    # Stages
    # ------------------------------------------------------------------------------------------------------

    def _prefill(self, plan: list[tuple[Sequence, int]], outputs: list[StepOutput]) -> list[Sequence]:
        """Run prompt chunks; sequences whose prompt completes get their first token (a bonus draw)."""
        dev = self.device
        tokens, positions, cu, kv_lens, slots, last_rows, done = [], [], [0], [], [], [], []
        for seq, n in plan:
            start = seq.num_prefilled
            tokens += seq.prompt_ids[start:start + n]
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            kv_lens.append(start + n)
            slots.append(seq.slot)
            seq.num_prefilled += n
            if seq.num_prefilled == len(seq.prompt_ids):
                last_rows.append(cu[-1] - 1)
                done.append(seq)
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)  # [N]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)  # [N]
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)  # [R+1]
        kv_t = torch.tensor(kv_lens, dtype=torch.int32, device=dev)  # [R]
        slot_t = torch.tensor(slots, dtype=torch.int32, device=dev)  # [R]
        rows = torch.tensor(last_rows, dtype=torch.long, device=dev)  # [M]
        logits, features = self.target.forward(tok, pos, cu_t, kv_t, slot_t, logits_rows=rows)  # [M, V], [N, m*d]
        if self.drafter is not None:
            slot_of_token = torch.repeat_interleave(slot_t.long(), torch.diff(cu_t).long())  # [N]
            self.drafter.append_context(features, pos, slot_of_token)
        if not done:
            return []
        for seq in done:
            self._load_params(seq)
        done_slots = torch.tensor([s.slot for s in done], dtype=torch.long, device=dev)
        p_t = logits_to_probs(logits, self.temperature[done_slots], self.top_p[done_slots], self.top_k[done_slots])
        positions_first = torch.tensor([len(s.prompt_ids) for s in done], dtype=torch.long, device=dev)
        first = sample(p_t, self.config.seed, self.request_id[done_slots], positions_first, int(Purpose.BONUS),
                       backend=self.config.kernel_backend)
        logp = torch.log(p_t.gather(1, first[:, None]))  # [M, 1]
        want = self._extra_logprob_rows(done)
        top = None
        if want:
            idx = torch.tensor(want, device=dev)
            logp, top = self._extra_logprobs(done, want, logits[idx][:, None], p_t[idx][:, None], first[:, None], logp)
        self.anchor[done_slots] = first
        self.anchor_pos[done_slots] = positions_first
        # sync: the first token is streamed and checked for EOS on the host.
        first_host, logp_host = first.tolist(), logp[:, 0].tolist()  # sync: first tokens (prefill step only)
        top_host = self._top_to_host(done, want, top)  # sync: only when a request asked for top logprobs
        for i, (seq, tok_id, lp) in enumerate(zip(done, first_host, logp_host)):
            seq.status = Status.DECODE
            self._emit(seq, [tok_id], [lp], outputs, top_host[i][:1] if top_host[i] else None)
        return done

    def _extra_logprob_rows(self, seqs: list[Sequence]) -> list[int]:
        """Rows whose request asked for raw or top log-probabilities (known on the host from the parameters)."""
        return [i for i, s in enumerate(seqs) if s.params.logprobs and (s.params.raw_logprobs or s.params.top_logprobs)]

    def _extra_logprobs(self, seqs: list[Sequence], want: list[int], logits: torch.Tensor, probs: torch.Tensor,
                        tokens: torch.Tensor, logp: torch.Tensor):
        """Raw log-probabilities and top-k alternatives of the rows in ``want`` (the other rows are untouched).

        Args:
            logits: [W, E, V] target logits at the emitted positions of the wanted rows.
            probs: [W, E, V] p_t there (what the tokens were drawn from).
            tokens: [R, E] emitted ids of every row (-1 pads).
            logp: [R, E] log p_t of those.

        Returns:
            ``logp`` with the raw rows replaced by log-softmax values, and ``(top ids, top logprobs)`` [W, E, k] (or
            None when nobody asked for alternatives), each row from the distribution its request reports.
        """
        dev = logits.device
        raw = torch.log_softmax(logits.float(), dim=-1)  # [W, E, V]
        is_raw = torch.tensor([seqs[i].params.raw_logprobs for i in want], device=dev)[:, None, None]  # [W, 1, 1]
        dist = torch.where(is_raw, raw, torch.log(probs.float().clamp_min(1e-30)))  # [W, E, V]
        idx = torch.tensor(want, device=dev)
        logp = logp.clone()
        logp[idx] = dist.gather(2, tokens[idx].clamp(min=0)[..., None])[..., 0]
        k = min(max(seqs[i].params.top_logprobs for i in want), self.vocab)
        if k == 0:
            return logp, None
        values, ids = torch.topk(dist, k, dim=-1)  # [W, E, k] descending
        return logp, (ids, values)

    @staticmethod
    def _top_to_host(seqs: list[Sequence], want: list[int], top) -> list[list[list[tuple[int, float]]] | None]:
        """Per row: the top alternatives per emitted position, cut to the request's own k (None for other rows)."""
        out: list[list[list[tuple[int, float]]] | None] = [None] * len(seqs)
        if top is None:
            return out
        ids, values = top[0].tolist(), top[1].tolist()  # sync: [W, E, k], only when asked
        for j, i in enumerate(want):
            k = seqs[i].params.top_logprobs
            if k:
                out[i] = [list(zip(t[:k], v[:k])) for t, v in zip(ids[j], values[j])]
        return out

    def _draft_gate(self, seqs: list[Sequence]) -> bool:
        """Whether the next step drafts: ``Scheduler.should_draft`` on each request's recent survivals (host copies
        that landed with an earlier token read), with the NumPy planner as its fast twin. Counts the plain steps.

        While the gate is closed nobody drafts, so the inputs repeat: the verdict is reused for as long as the same
        requests hold the same drafts (exactly what re-evaluating would return, without its host cost)."""
        cfg = self.sched_config
        if cfg.mode != "adaptive" or not cfg.draft_gate:
            return True
        key = (tuple(s.request_id for s in seqs), tuple(len(s.survivals) for s in seqs))
        cached = self._gate_cache if self._gate_cache is not None and self._gate_cache[0] == key else None
        if cached is None:
            recent = self._recent_survivals(seqs, cfg.gate_window)  # [R, γ] host, or None
            verdict = None if recent is None else self.planner.speculation_pays(recent, len(seqs), None,
                                                                                  cfg.gate_margin)
            cached = self._gate_cache = (key, recent, verdict)
        _, recent, verdict = cached
        drafts = self.policy.should_draft(recent, self.policy.steps_without_draft, num_anchor_tokens=len(seqs),
                                          pays=lambda *_: verdict)
        self.policy.steps_without_draft = 0 if drafts else self.policy.steps_without_draft + 1
        return drafts

    def _recent_survivals(self, seqs: list[Sequence], window: int) -> torch.Tensor | None:
        """Each request's moving average of its drafts' survivals (``reference.scheduler.fold_recent``), kept per slot
        and folded for all requests with a new draft at once. NumPy float32: the same IEEE operations as the
        reference's torch ones, at a microsecond each instead of several. The rows folded here were copied to the
        host by earlier steps' drafts, and this step's token read has synchronised since, so they have landed."""
        for s in seqs:  # a slot that changed hands starts afresh
            if self._recent_owner[s.slot] is not s:
                self._recent_owner[s.slot], self._recent_count[s.slot] = s, 0
                self._recent[s.slot] = np.nan
        while True:  # normally one pass: a request drafts at most once between two gates
            todo = [s for s in seqs if self._recent_count[s.slot] < len(s.survivals)]
            if not todo:
                break
            rows = [s.slot for s in todo]
            new = torch.stack([s.survivals[self._recent_count[s.slot]] for s in todo]).numpy()  # [n, γ] float32
            old = self._recent[rows]
            self._recent[rows] = np.where(np.isnan(old), new, old + (new - old) / np.float32(window))
            for s in todo:
                self._recent_count[s.slot] += 1
        slots = [s.slot for s in seqs]
        if all(self._recent_count[i] == 0 for i in slots):
            return None
        return torch.from_numpy(self._recent[slots])  # [R, γ]

    def _plan_verify(self, decoding: list[Sequence]) -> dict:
        """Host part of scheduling: the verify budget from stale survivals (never waits for the device)."""
        mode, r = self.sched_config.mode, len(decoding)
        plan = {"mode": mode, "budget": None}
        if self.drafter is not None and not self.drafted:  # the draft gate closed: ordinary decoding this step
            plan["mode"] = "none"
        elif mode == "adaptive":
            stale = torch.stack([self._stale(s) for s in decoding])  # [R, γ] host copy, NaN rows = too new
            plan["budget"] = self.planner.budget(stale, num_anchor_tokens=r, num_requests=r)
        return plan

    def _stale(self, seq: Sequence) -> torch.Tensor:
        """The survivals ``staleness`` drafts before the current one (NaN when the request is too new)."""
        k = self.sched_config.staleness
        # seq.survivals[-1] is the current draft; the reference appends it after reading the stale row.
        if k == 0:
            return seq.survivals[-1]
        if len(seq.survivals) >= k + 1:
            return seq.survivals[-(k + 1)]
        return torch.full((self.gamma,), float("nan"))

    def _verify_lengths(self, decoding: list[Sequence], rows: torch.Tensor, plan: dict) -> tuple[torch.Tensor, int]:
        """ℓ [R] on the device and the total verify tokens N = R + Σℓ (known to the host where possible)."""
        mode, r, g = plan["mode"], len(decoding), self.gamma
        if mode == "none":
            return torch.zeros(r, dtype=torch.long, device=self.device), r
        if mode == "adaptive":
            budget = plan["budget"]
            return allocate_top_b(self.survival[rows], budget), r + budget
        if mode in ("fixed", "dsd"):
            lens = self.policy.lengths(torch.zeros(r, g), a_stale=None, num_anchor_tokens=r)  # host-only rule
            return lens.to(self.device), r + int(lens.sum())
        if mode == "oracle":
            return torch.full((r,), g, dtype=torch.long, device=self.device), r * (g + 1)
        # threshold and adaptive-sync decide from the current survivals, which live on the device.
        # sync: these two policies are synchronous by definition (the paper's Algorithm 1 reads the current a).
        a_now = self.survival[rows].cpu()  # sync: synchronous policies only (see above)
        lens = self.policy.lengths(a_now, a_stale=None, num_anchor_tokens=r)
        return lens.to(self.device), r + int(lens.sum())

    def _verify_and_commit(self, decoding: list[Sequence], plan: dict, outputs: list[StepOutput]) -> None:
        dev, g = self.device, self.gamma
        rows = torch.tensor([s.slot for s in decoding], dtype=torch.long, device=dev)  # [R] slot of each row
        r = len(decoding)
        lens, n_tokens = self._verify_lengths(decoding, rows, plan)  # [R], host int
        n_pad = self.verify_graphs.padded(n_tokens)
        # Token layout, on the device, straight into the graphs' static buffers (one launch with Triton): request j
        # owns tokens cu[j] .. cu[j+1]-1 = [x_0, x_1..x_ℓ] (optimized/kernels/layout.py).
        b = self.buffers
        verify_layout(rows, lens, self.anchor, self.anchor_pos, self.draft_tokens, n_pad, b.layout(),
                      backend=self.config.kernel_backend)
        cu = b.cu[: r + 1].long()  # [R+1]
        slot_of = b.token_slot[:n_pad]  # [N_pad] slot of each packed token, -1 for padding
        (logits,) = self.verify_graphs.run(n_pad)  # [N_pad, V]; also appends drafter context (see _setup_graphs)
        # p_t at every verified position, laid out [R, γ+1, V] for the verifier by one gather: row j of request r
        # is packed token cu[r] + j. Rows past ℓ_r repeat row ℓ_r (the verifier never reads them), so nothing
        # is zero-filled or scattered.
        probs = self._target_probs(logits, slot_of, decoding)  # [N_pad, V]
        j = torch.arange(g + 1, device=dev)
        src = cu[:r, None] + torch.minimum(j[None, :], lens[:, None])  # [R, γ+1] packed row of each (r, j)
        target_probs = probs[src]  # [R, γ+1, V]
        if g:
            result = rejection_sample(self.draft_tokens[rows], lens, self.draft_probs[rows], target_probs,
                                      self.config.seed, self.request_id[rows], self.anchor_pos[rows],
                                      backend=self.config.kernel_backend)
            emitted, n_emitted = result.tokens, result.num_emitted
        else:
            bonus = sample(target_probs[:, 0], self.config.seed, self.request_id[rows], self.anchor_pos[rows] + 1,
                           int(Purpose.BONUS), backend=self.config.kernel_backend)
            emitted, n_emitted = bonus[:, None], torch.ones(r, dtype=torch.long, device=dev)
        # log p_t of every emitted token (logprobs are returned with speculation on).
        e = emitted.shape[1]
        safe = emitted.clamp(min=0)
        logp = torch.log(target_probs[:, :e].gather(2, safe[..., None])[..., 0].clamp_min(1e-30))  # [R, E]
        want = self._extra_logprob_rows(decoding)
        top = None
        if want:  # raw log-probabilities / alternatives, from the same packed logits rows as p_t
            idx = torch.tensor(want, device=dev)
            logp, top = self._extra_logprobs(decoding, want, logits[src[idx, :e]], target_probs[idx, :e], emitted,
                                             logp)
        # The next anchor: the last emitted token, one position past the accepted prefix.
        last = emitted.gather(1, (n_emitted - 1)[:, None])[:, 0]
        self.anchor[rows] = last
        self.anchor_pos[rows] += n_emitted
        if plan["mode"] == "oracle":
            lens = torch.clamp(n_emitted, max=g)  # verify exactly the accepted prefix + the rejected slot
        # sync: the one host read per step — emitted tokens drive finishing, streaming and stop strings.
        host = torch.cat([emitted, n_emitted[:, None], lens[:, None]], 1).cpu()  # sync: the one read per step
        logp_host = logp.cpu() if any(s.params.logprobs for s in decoding) else None  # sync: same read, if asked
        # One conversion to Python lists per step: per-row tensor indexing costs ~1 ms of host time at R = 64.
        host_rows = host.tolist()  # sync: host tensor already
        logp_rows = logp_host.tolist() if logp_host is not None else None  # sync: host tensor already
        top_rows = self._top_to_host(decoding, want, top)  # sync: only when a request asked for top logprobs
        # For StepStats: the survivals of the drafts verified now. These host copies were made by the previous
        # step's draft; the token read above has synchronised since, so they have landed (no further sync).
        drafts_held = plan["mode"] != "none"
        self._verify_record = (n_tokens, [row[-1] for row in host_rows], [row[-2] - 1 for row in host_rows],
                               [s.survivals[-1].tolist() if drafts_held and s.survivals else [] for s in decoding])
        for i, seq in enumerate(decoding):
            row = host_rows[i]
            n = row[-2]
            seq.verify_lengths.append(row[-1])
            seq.accepted_lengths.append(n - 1)
            self._emit(seq, row[:n], logp_rows[i][:n] if logp_rows is not None else [], outputs,
                       top_rows[i][:n] if top_rows[i] else None)

    def _target_probs(self, logits: torch.Tensor, slot_of: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """p_t rows at the request's temperature; the reference ``logits_to_probs`` only where filters are on.

        Without top-k/top-p (the host knows from the requests' parameters) this is the same arithmetic as the
        reference — ``logits / T`` then softmax, one-hot argmax at T = 0 — without its two vocabulary sorts and
        its validation reads (each a device→host sync).
        """
        if any(s.params.top_p < 1.0 or s.params.top_k > 0 for s in seqs):
            # sync: the reference op validates its inputs on the host; only requests with filters pay for it.
            return logits_to_probs(logits.float(), self.temperature[slot_of], self.top_p[slot_of], self.top_k[slot_of])
        x = logits.float()  # [N, V]
        temp = self.temperature[slot_of][:, None]  # [N, 1]
        greedy = temp == 0
        probs = (x / torch.where(greedy, torch.ones_like(temp), temp)).softmax(dim=-1)
        # Greedy rows become the one-hot of the argmax: zeroed, then +1 at the argmax (adding 0 to the other rows
        # leaves them bit-identical). No [N, V] int64 one_hot: at N = 2048, V = 49152 that is 0.8 GB per step.
        probs = torch.where(greedy, torch.zeros((), dtype=probs.dtype, device=probs.device), probs)
        return probs.scatter_add_(1, x.argmax(dim=-1, keepdim=True), greedy.to(probs.dtype))

    def _draft(self, seqs: list[Sequence]) -> None:
        """Backbone + fused sequential head for every decoding request; survivals stay on the device."""
        dev = self.device
        rows = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        r = len(seqs)
        r_pad = self.draft_graphs.padded(r)
        if self.head_in_graph:
            self.buffers.load_draft(self.anchor[rows], self.anchor_pos[rows], rows.to(torch.int32), r_pad,
                                    self.temperature[rows], self.request_id[rows])
            tokens, probs, survival = (t[:r] for t in self.draft_graphs.run(r_pad))  # [R, γ], [R, γ, V], [R, γ]
        else:
            self.buffers.load_draft(self.anchor[rows], self.anchor_pos[rows], rows.to(torch.int32), r_pad)
            (h,) = self.draft_graphs.run(r_pad)  # [R_pad, γ, d]
            out = sample_block(self.ref_drafter, h[:r], self.anchor[rows], self.anchor_pos[rows],
                               self.temperature[rows], self.config.seed, self.request_id[rows],
                               backend=self.config.kernel_backend)
            tokens, probs = out.tokens, out.probs
            survival = self._survival(out.conf_logits, self.temperature[rows])
        self.draft_tokens[rows] = tokens
        self.draft_probs[rows] = probs
        self.survival[rows] = survival
        # The host keeps a copy for the stale budget of later steps. With staleness ≥ 1 it is read only after the
        # next step's token sync, so on CUDA this copy overlaps with the next step's work. Staleness 0 reads it at
        # the very start of the next step, before any sync: that copy must have landed, so it blocks.
        host = survival.to("cpu", non_blocking=self.sched_config.staleness > 0)  # sync: only with staleness 0
        for seq, row in zip(seqs, host.unbind(0)):  # one call for R row views
            seq.survivals.append(row)

    def _survival(self, conf_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """Calibrated prefix survivals a_k = Π_{j≤k} σ(c_j / T_j + b_j) with the calibration of each row's mode
        (the same float32 operations as ``reference.calibration.apply_sts``; a mode without biases adds +0.0, which
        changes no float: -0.0 becomes +0.0, and σ(±0) is the same)."""
        greedy = (temperature == 0)[:, None]
        x = conf_logits.float() / torch.where(greedy, self.sts["greedy"], self.sts["sampling"])  # [R, γ]
        x = x + torch.where(greedy, self.sts_bias["greedy"], self.sts_bias["sampling"])
        return torch.cumprod(torch.sigmoid(x), dim=1)

    # ------------------------------------------------------------------------------------------------------
    # Host bookkeeping
    # ------------------------------------------------------------------------------------------------------

    def _load_params(self, seq: Sequence) -> None:
        p, s = seq.params, seq.slot
        self.request_id[s] = seq.request_id if p.seed is None else p.seed  # the request word of the random contract
        self.temperature[s] = p.temperature
        self.top_p[s] = p.top_p
        self.top_k[s] = p.top_k

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float], outputs: list[StepOutput],
              top: list[list[tuple[int, float]]] | None = None) -> None:
        """Append emitted tokens; stop at EOS (later tokens dropped), the length limit or a stop string."""
        new, new_lp, new_top = [], [], []
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            new.append(tok)
            if logprobs:
                seq.logprobs.append(logprobs[i])
                new_lp.append(logprobs[i])
            if top:
                seq.top_logprobs.append(top[i])
                new_top.append(top[i])
            reason = None
            if not seq.params.ignore_eos and tok in self.eos:
                reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens:
                reason = "length"
            elif seq.anchor_pos + self.gamma + 2 >= self.config.max_seq_len:
                reason = "length"  # the next block would not fit the slot
            if reason is None and seq.params.stop and self.tokenizer is not None and self._hit_stop(seq):
                reason = "stop"
            if reason is not None:
                self.batch.finish(seq, reason)
                break
        outputs.append(StepOutput(seq.request_id, new, seq.finished, seq.finish_reason, new_lp, new_top))

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return any(s in text for s in seq.params.stop)
