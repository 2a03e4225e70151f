"""The optimized engine: continuous batching + confidence-scheduled speculative decoding on static caches.

The same method as ``reference/generate.py`` (docs/method.md §1–§5), in nano-vllm's shape: three rooms behind a thin
facade. ``optimized/sequence.py`` holds request state, ``optimized/scheduler.py`` all host planning (admission,
chunked prefill, the verify budget, the draft gate, finishing), ``optimized/runner.py`` the device (caches, CUDA
graphs, the prefill / verify / draft stages). One :meth:`Engine.step`::

    schedule   admit waiting requests, choose prefill chunks, and the verify budget B from a stale host copy of
               the survivals (no wait on the device)
    run        prefill chunks; verify every decoding request (ℓ_r = top-B of the current survivals, on the device);
               one host read of the emitted tokens
    postprocess  commit the tokens (finishing, streaming, stop strings); the draft gate decides whether the next
               step drafts, and if so the drafter proposes the next block (survivals stay on the device) — or, with
               the n-gram proposer (reference/ngram.py), the host looks the next blocks up in the requests' tokens,
               or, with the hybrid proposer (reference/hybrid.py), the drafter proposes and the host chooses per
               request between its block and the n-gram one (the survivals are read at once; the outcome of each
               verified n-gram block is counted after the token read)

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from optimized.acceptance_monitor import SAMPLE_EVERY, AcceptanceMonitor
from optimized.config import EngineConfig
from optimized.cost_monitor import CostMonitor
from optimized.runner import LaunchedPrefill, LaunchedVerify, ModelRunner, StageOutput
from optimized.scheduler import Scheduler, StepPlan
from optimized.sequence import SamplingParams, Sequence, Status, StepOutput, StepStats
from reference.config import SchedulerConfig, SchedulingMode
from reference.cost_model import CostTable
from reference.drafter import DSparkDrafter
from reference.hybrid import HybridProposer
from reference.hybrid import check_mode as check_hybrid_mode
from reference.ngram import NgramProposer, check_mode
from reference.target import Target

__all__ = ["Engine", "EngineConfig", "SamplingParams", "Sequence", "Status", "StepOutput", "StepStats", "frozen_heap"]


@contextlib.contextmanager
def frozen_heap(collect: bool = True) -> Iterator[None]:
    """Every object alive on entry out of the cyclic garbage collector's reach for the block (``gc.freeze``), given
    back on exit (``gc.unfreeze``), so that what the block's steps allocate is all a collection walks.

    On a GPU the host's pauses show in the steps: a full collection of an unfrozen heap (the model, the engine, the
    imported modules) stalled one step of a closed batch of 256 for 0.21 s on an H100's host (``runs_pauses`` in
    docs/benchmarks/engine-h100-no-stand-ins.json). A process that serves until it exits freezes its heap once after
    start-up instead (``python -m optimized.serve``); a block is for callers that build engines one after
    another, whose reference cycles must be collectable again afterwards. ``collect``: collect first, so that what
    is garbage already is not kept until the block ends (a full collection, a fraction of a second)."""
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _longest_context(seqs: list[Sequence]) -> int:
    """The longest context among ``seqs`` (prompt and output tokens; the anchor position of that request + 1), 0 for
    none: one pass of Python over the requests, done once a step."""
    return max([len(s.prompt_ids) + len(s.output_ids) for s in seqs], default=0)


class Engine:
    """``add_request`` / ``step`` / ``abort`` over a fixed set of slots."""

    def __init__(self, target: Target, drafter: DSparkDrafter | NgramProposer | HybridProposer | None,
                 config: EngineConfig, sched: SchedulerConfig, cost: CostTable | None = None) -> None:
        """``drafter``: the DSpark drafter, the n-gram proposer (modes none, fixed, dsd), the hybrid of the two (every
        mode but oracle), or None (mode none)."""
        if sched.mode.drafts and drafter is None:
            raise ValueError(f"mode '{sched.mode}' needs a drafter")
        if isinstance(drafter, NgramProposer):
            check_mode(sched.mode)
        if isinstance(drafter, HybridProposer):
            check_hybrid_mode(sched.mode)
        # An adaptive engine may be built without a cost table so that the table can be profiled on this very
        # engine (its own graphs and buckets, no second capture); step() refuses to run until it is installed.
        self.config = config
        self.runner = ModelRunner(target, drafter if sched.mode.drafts else None, config)
        self.scheduler = Scheduler(sched, gamma=self.runner.gamma, max_num_seqs=config.max_num_seqs,
                                   max_seq_len=config.max_seq_len, prefill_chunk=config.prefill_chunk, cost=cost,
                                   eos_token_ids=target.eos_token_ids, tokenizer=target.tokenizer)
        self.scheduler.finish_time_gate = config.finish_time_gate  # an offline batch: the gate weighs finish times
        self._ids: dict[int, Sequence] = {}
        self._last: tuple | None = None  # the raw material of last_step_stats(), assembled only when asked
        self._verified: StageOutput | None = None  # this step's verify result, if any request decoded
        self._survivals: list[np.ndarray | None] = []  # [γ] host survivals of each verified request's draft
        self._ahead_on = config.plan_ahead if config.plan_ahead is not None else self.runner.device.type == "cuda"
        self._draft_ahead_on = self._ahead_on and config.draft_ahead is not False
        self._async_on = self.runner.pipelined
        self._feedback_on = (config.cost_feedback if config.cost_feedback is not None
                             else self.runner.device.type == "cuda")
        self._monitor: CostMonitor | None = None  # measured step times against the table (cost_feedback)
        # the verified drafts' outcomes against their forecast survivals (acceptance_feedback)
        # (the DSpark drafter's confidence head; the n-gram and hybrid proposers estimate their own online)
        self._acceptance = (AcceptanceMonitor(self.runner.gamma) if config.acceptance_feedback and self.runner.gamma
                            and not self.runner.host_proposals else None)
        if cost is not None:
            self._watch(cost)
        self._priced_requests = 1  # decoding requests of the last step launched (price_scales reports their bucket)
        self._drafted_ahead: tuple[list[Sequence], torch.Tensor] | None = None  # this step's early draft, if any
        # One step ahead (EngineConfig.async_decode): the launched verify whose tokens are unread, the most tokens it
        # can emit per request (keyed by id(seq)), and the block drafted behind it whose survivals are not recorded.
        self._in_flight: tuple[StepPlan, LaunchedVerify] | None = None
        self._reach: dict[int, int] = {}
        # Blocks drafted one step ahead whose survivals are not recorded yet (seqs, host copy, its copy's event),
        # oldest first: at most one between steps, two within one.
        self._pending: deque[tuple[list[Sequence], torch.Tensor, torch.cuda.Event | None]] = deque()
        self.reset_stats()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def gamma(self) -> int:
        """γ, the drafter's block size (0 without a drafter)."""
        return self.runner.gamma

    @property
    def pipelining(self) -> dict[str, bool]:
        """The host/device overlap switches as resolved for this engine's device (``EngineConfig.plan_ahead``,
        ``draft_ahead``, ``async_decode``; None there means on CUDA, off on the CPU)."""
        return {"plan_ahead": self._ahead_on, "draft_ahead": self._draft_ahead_on, "async_decode": self._async_on}

    @property
    def sched_config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def cost(self) -> CostTable | None:
        return self.scheduler.cost

    # ------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue a tokenised prompt; returns its request id (which keys its random numbers)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        vocab = self.runner.vocab
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        rid = request_id if request_id is not None else (max(self._ids, default=-1) + 1)
        if rid in self._ids and not self._ids[rid].finished:
            raise ValueError(f"request id {rid} is already running")
        if len(prompt_ids) >= self.config.max_seq_len - self.gamma - 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_seq_len {self.config.max_seq_len} "
                             f"(γ = {self.gamma} positions are scratch)")
        seq = Sequence(request_id=rid, prompt_ids=list(prompt_ids), params=params or SamplingParams())
        self.scheduler.add(seq)
        self._ids[rid] = seq
        return rid

    def abort(self, request_id: int) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def sequence(self, request_id: int) -> Sequence:
        return self._ids[request_id]

    def release(self, request_id: int) -> None:
        """Forget a finished request's ``Sequence`` (a long-running server must not keep every request it served)."""
        seq = self._ids.get(request_id)
        if seq is not None and not seq.finished:
            raise ValueError(f"request {request_id} is still running: abort it first")
        self._ids.pop(request_id, None)

    def set_cost_table(self, cost: CostTable) -> None:
        """Install the step-cost table (e.g. ``optimized.cost_model.cached_profile(engine.runner)``)."""
        self.scheduler.set_cost_table(cost)
        self._watch(cost)

    def _watch(self, cost: CostTable) -> None:
        """Measure steps against ``cost`` from now on (``EngineConfig.cost_feedback``)."""
        self._monitor = CostMonitor(cost, self.runner.device) if self._feedback_on else None

    @property
    def cost_monitor(self) -> CostMonitor | None:
        """The check of measured steps against the cost table (``EngineConfig.cost_feedback``), or None when off."""
        return self._monitor

    @property
    def cost_drift(self) -> dict[str, float | None] | None:
        """Per kind of step (``plain``, ``speculative``): measured time over the cost table's price, minus one (None
        until enough steps of that kind ran), or None without a cost table or with ``cost_feedback`` off."""
        return self._monitor.drift if self._monitor is not None else None

    @property
    def survival_scale(self) -> list[float] | None:
        """The per-slot factors the adaptive planner multiplies the survivals by (``EngineConfig.acceptance_feedback``:
        drafts that survived over drafts forecast to); None: the survivals as they are."""
        scale = self.scheduler.planner.survival_scale
        return None if scale is None else [float(x) for x in scale]

    @property
    def price_scales(self) -> dict[str, float]:
        """The multipliers of the table's prices the draft gate uses now, at the batch size of the last decoding step
        (1.0: the table's own; ``EngineConfig.cost_feedback`` measures them per batch-size bucket)."""
        plain, speculative = self.scheduler.planner.scales(self._priced_requests)
        return {"plain": plain, "speculative": speculative}

    @property
    def price_scales_by_batch(self) -> dict[int, dict[str, float]]:
        """Every batch-size bucket's measured price multipliers (``EngineConfig.cost_feedback``; empty when off or
        before any bucket drifted): the smallest request count of the bucket -> kind -> multiplier."""
        return {b: dict(k) for b, k in self._monitor.scales.items()} if self._monitor is not None else {}

    def set_scheduler(self, sched: SchedulerConfig) -> None:
        """Switch the verify-length policy between runs, keeping caches and graphs (benchmarks of every mode)."""
        if self.has_unfinished():
            raise RuntimeError("cannot switch the scheduler while requests are running")
        has_drafter = self.gamma > 0  # built with a drafter or the n-gram proposer
        if self.runner.proposer is not None:
            check_mode(sched.mode)
        if self.runner.hybrid is not None:
            check_hybrid_mode(sched.mode)
        if sched.mode.drafts != has_drafter:
            raise ValueError(f"mode '{sched.mode}' on an engine built {'with' if has_drafter else 'without'} a "
                             "drafter: build a separate engine (mode none never drafts, the others need a drafter)")
        if sched.mode.needs_cost_table and self.cost is None:
            raise ValueError(f"mode '{sched.mode}' needs a cost table: call set_cost_table first")
        self._pending.clear()  # blocks drafted one step ahead for requests that have all finished since
        self.scheduler.set_config(sched)

    def warmup(self) -> float:
        """Compile and warm every kernel a step can run (graphs were captured at construction), so that the first
        request is as fast as the tenth; returns the seconds it took. Leaves no state behind: requests decode
        exactly as without it."""
        if self.has_unfinished():
            raise RuntimeError("warm up an idle engine: the placeholder requests overwrite slot state")
        t0 = time.perf_counter()
        self.runner.warmup()
        return time.perf_counter() - t0

    def last_step_stats(self) -> StepStats | None:
        """What the last :meth:`step` did (None before the first). Assembled from host copies the step already made:
        no device read; the survivals of the verified drafts were copied to the host when they were drafted."""
        if self._last is None:
            return None
        plan, verified, survivals, step_s, drafted = self._last
        budget = None
        if plan.mode is SchedulingMode.ADAPTIVE:
            budget = plan.budget
        elif plan.mode is SchedulingMode.ADAPTIVE_SYNC:
            budget = sum(plan.lengths)
        lengths = verified.verified if verified is not None else []
        predicted = [[] if a is None or n == 0 else a[:n].tolist()  # sync: none, NumPy host copies made at draft time
                     for a, n in zip(survivals, lengths)]
        return StepStats(
            step_time_s=step_s, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_decoding=len(plan.decoding), verify_tokens=verified.num_tokens if verified is not None else 0,
            budget=budget, drafted=drafted, verified=list(lengths),
            accepted=[len(t) - 1 for t in verified.tokens] if verified is not None else [],
            predicted_survival=predicted, request_ids=[s.request_id for s in plan.decoding],
            gate_closed=bool(plan.decoding) and plan.mode is SchedulingMode.NONE and self.sched_config.mode.drafts,
            cost_drift=self.cost_drift, price_scales=self.price_scales if self._monitor is not None else None)

    def reset_stats(self) -> None:
        """Zero the cumulative counters in ``stats``: steps, drafting steps (of which ``draft_ahead_steps`` drafted
        before the token read: ``EngineConfig.draft_ahead``, or one step ahead; ``drafts_dropped`` counts early drafts
        that nobody kept: the gate closed once some requests had finished), seconds of step, of host planning on the
        critical path (``host_schedule_s``) and of planning done while the device verified (``host_ahead_s``), steps
        that ran prompt chunks (``prefill_steps``) and the seconds of their prefill stage (``prefill_s``: launch to
        the read of the first tokens, which waits for the prefill's device work when a prompt completes), and the
        seconds of committing the decoding requests' tokens on the host once read (``host_commit_s``: per request,
        stop checks and outputs; at R = 256 much of a small target's plain step)."""
        self.stats = {"steps": 0, "draft_steps": 0, "draft_ahead_steps": 0, "drafts_dropped": 0,
                      "host_schedule_s": 0.0, "host_ahead_s": 0.0, "step_s": 0.0, "prefill_steps": 0, "prefill_s": 0.0,
                      "host_commit_s": 0.0}

    # ------------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------------

    @property
    def _one_ahead(self) -> bool:
        """Whether steps run one ahead of their token reads (``EngineConfig.async_decode``): plain decoding, and every
        mode whose next plan needs nothing of this step's tokens (``SchedulingMode.plans_blind``) with the DSpark
        drafter, whose drafts come from device state. Not the n-gram or the hybrid proposer (they look their drafts up
        in the committed tokens) nor the synchronous policies."""
        mode = self.sched_config.mode
        return self._async_on and mode.plans_blind and (not self.runner.host_proposals or not mode.drafts)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One engine step: schedule (host), run (device, one token read), postprocess (host), draft (device).

        One step ahead where the mode allows it (:meth:`_step_one_ahead`); synchronously otherwise, and for as long
        as a decoding request is near the end of its slot (the read must then come first: :meth:`_room_ahead`)."""
        if self._one_ahead:
            seqs = self.scheduler.decoding()  # the requests decoding now: nothing before the read changes who they are
            longest = _longest_context(seqs)
            if self._room_ahead(seqs, longest):
                return self._step_one_ahead(seqs, longest)
        outputs = self._drain()  # a step left in flight by the pipeline: read it before stepping synchronously
        t0 = time.perf_counter()
        plan = self._schedule()
        t1 = time.perf_counter()
        outputs += self._prefill(plan) + self._verify(plan)
        t2 = time.perf_counter()
        drafters = self.scheduler.drafters()  # the draft gate: who drafts for the next step
        t3 = time.perf_counter()
        if self._drafted_ahead is not None:  # the drafter already ran, before the token read
            self._keep_early_drafts(drafters)
        elif drafters:
            self._draft(drafters)
        self._account(plan, t0, (t1 - t0) + (t3 - t2), bool(drafters))
        return outputs

    def _step_one_ahead(self, decoding: list[Sequence], longest: int) -> list[StepOutput]:
        """A step launched before the previous step's tokens are read: plan and launch this step's verify (each
        request's anchor and its drafts are on the device already), let the draft gate decide on the tokens committed
        so far and launch the next block's draft behind the verify, then read and commit the previous step's tokens
        while the device runs both. The device's queue never waits for the host's commit.

        The plan is made before the previous step's tokens are committed, so a request that finished in that step
        may be verified, and drafted for, once more (its rows are dropped when this step is read), and the adaptive
        budget reads survivals one draft older than the synchronous engine would (the draft this step verifies is
        still on its way to the host: ``Scheduler.schedule(ahead=1)``). Requests the step in flight surely finishes by
        length are left out. A request whose next block might not fit its slot after the steps in flight drafts after
        the read instead (:meth:`_draft_late`). Plain decoding (``none``, or a gate that stays closed) is this same
        loop without the draft. ``decoding`` are the requests decoding now and ``longest`` the longest context among
        them (:func:`_longest_context`), found once for the step."""
        t0 = time.perf_counter()
        plan = self._schedule(exclude=self._done_in_flight(), unrecorded=len(self._pending))
        t1 = time.perf_counter()
        # The prompt chunks first, their first tokens read only after this step's verify is launched behind them: a
        # read here would leave the device idle while the host commits them and launches the verify.
        prefilled = self._launch_prefill(plan)
        launched = None
        if plan.decoding:
            self._monitor_launch(plan)
            launched = self.runner.launch_verify(plan)
        previous, reach_before = self._in_flight, self._reach
        self._in_flight = (plan, launched) if launched is not None else None
        self._reach = self._reach_of(plan) if launched is not None else {}
        self._gate_s = 0.0
        drafters = self._draft_early(decoding, longest, reach_before, [] if prefilled is None else prefilled.seqs)
        outputs = []
        if previous is not None:
            done_plan, done = previous
            out = self.runner.collect_verify(done)
            # The survivals of the drafts that step verified: recorded at the previous call.
            self._verified = out
            self._survivals = [s.survivals[-1] if done_plan.mode.drafts and s.survivals else None for s in out.seqs]
            self._record_outcomes(out)
            outputs += self._commit(out)
        if prefilled is not None:
            outputs += self._collect_prefill(prefilled)
        self._record_pending(keep_last=int(bool(drafters)))
        drafted = bool(drafters)
        self.stats["draft_ahead_steps"] += drafted  # drafted before the token read
        if drafters is None:  # a block might not fit before the read: draft now, after it
            drafted, drained = self._draft_late()
            outputs += drained
        # The statistics describe the step whose tokens were read (none: only this step's prefill, if any).
        self._account(done_plan if previous is not None else StepPlan(plan.prefill, [], plan.mode), t0,
                      (t1 - t0) + self._gate_s, drafted)
        return outputs

    def _draft_early(self, decoding: list[Sequence], longest: int, reach_before: dict[int, int],
                     starting: list[Sequence]) -> list[Sequence] | None:
        """One step ahead, before the read: the draft gate on the requests decoding now (the tokens committed so far)
        and, if they draft, their next block launched behind the verify just launched. Returns who drafted ([] when
        the gate said no), or None when a block might not fit a slot after the two steps in flight (each emits up to
        ℓ + 1 tokens): then the draft waits for the read (:meth:`_draft_late`), and so does the gate.

        The drafters are this step's requests and those that start decoding with it (``starting``: their prompt ended
        in this call, and its first token, on the device already, is read after this); not those the step in flight
        surely finishes, which this step left out. ``decoding`` and ``longest``: as :meth:`_step_one_ahead` got them
        (the requests decoding now; the prompts ending in this call have not started decoding yet)."""
        if not self.sched_config.mode.drafts:
            return []
        t0 = time.perf_counter()
        reach = self._reach
        if len(reach) == len(decoding):  # the usual step verifies every request decoding now (its plan's requests
            seqs = decoding  # are those, in the same order): no pass of Python over them
        else:
            seqs = [s for s in decoding if id(s) in reach or id(s) not in reach_before]
        if starting:  # their anchor is the first token, one position past the prompt the host knows of
            seqs = seqs + [s for s in starting if s.params.max_new_tokens > 1]
            reach_before = {**reach_before, **dict.fromkeys(map(id, starting), 1)}
            longest = max(longest, _longest_context(starting))
        ahead = max(reach_before.values(), default=0) + max(reach.values(), default=0)
        if (self.scheduler.slot_full(longest - 1 + ahead)
                and any(self.scheduler.slot_full(s.anchor_pos + reach_before.get(id(s), 0) + reach.get(id(s), 0))
                        for s in seqs)):
            return None
        drafters = self.scheduler.drafters(seqs)
        self._gate_s = time.perf_counter() - t0  # host planning on the critical path, as the schedule's
        if drafters:
            self._launch_pending(drafters)
        return drafters

    def _draft_late(self) -> tuple[bool, list[StepOutput]]:
        """One step ahead, after the read: the draft gate on the requests decoding now, and, if they draft, their next
        block launched behind the verify in flight; one that could run past the end of its slot after that step
        (it may emit up to ℓ + 1 tokens) waits for that step's read too. Returns whether the drafter ran and the
        outputs of such a read."""
        drafters = self.scheduler.drafters()
        if not drafters:
            return False, []
        drained = []
        if any(self.scheduler.slot_full(s.anchor_pos + self._reach.get(id(s), 0)) for s in drafters):
            drained = self._drain()
            drafters = [s for s in drafters if not s.finished]
            if not drafters:
                return False, drained
        self._launch_pending(drafters)
        return True, drained

    def _launch_pending(self, seqs: list[Sequence]) -> None:
        """Launch the drafter for ``seqs`` without waiting; its survivals are recorded once their copy has landed."""
        host = self._launch_draft(seqs, blocking=False)
        self._pending.append((seqs, host, self.runner.draft_copied))

    def _record_pending(self, keep_last: int = 0) -> None:
        """Record the survivals of the blocks drafted one step ahead, oldest first, once their copies to the host have
        landed (the device has then finished those drafts; what is queued behind them keeps it busy), leaving the
        newest ``keep_last`` in flight."""
        while len(self._pending) > keep_last:
            seqs, survivals, copied = self._pending.popleft()
            if copied is not None:
                copied.synchronize()  # sync: this draft's copy only, not the work queued behind it
            self.scheduler.record_drafts(seqs, survivals)

    def _drain(self) -> list[StepOutput]:
        """Read and commit the step in flight, if any, and record the pending draft: what an engine one step ahead
        leaves behind when it next steps synchronously."""
        outputs = []
        if self._in_flight is not None:
            _, launched = self._in_flight
            self._in_flight, self._reach = None, {}
            outputs = self._commit(self.runner.collect_verify(launched))
        self._record_pending()
        return outputs

    def _commit(self, out: StageOutput) -> list[StepOutput]:
        """Commit a step read one step late: rows of requests that finished (or were aborted) since its launch are
        dropped."""
        t0 = time.perf_counter()
        finished = Status.FINISHED
        live = [i for i, s in enumerate(out.seqs) if s.status is not finished]
        if len(live) == len(out.seqs):  # the usual step: nobody finished since the launch
            outputs = self.scheduler.postprocess(out.seqs, out.tokens, out.logprobs, out.verified, out.top_logprobs)
        else:
            def pick(rows: list | None) -> list | None:
                return None if rows is None else [rows[i] for i in live]

            outputs = self.scheduler.postprocess([out.seqs[i] for i in live], pick(out.tokens), pick(out.logprobs),
                                                 pick(out.verified), pick(out.top_logprobs))
        self.stats["host_commit_s"] += time.perf_counter() - t0
        return outputs

    def _reach_of(self, plan: StepPlan) -> dict[int, int]:
        """The most tokens the step of ``plan`` can emit for each of its requests (ℓ + 1), keyed by ``id(seq)``."""
        if plan.budget is not None:  # top-B: each request gets at most min(γ, B) drafts
            return dict.fromkeys(map(id, plan.decoding), min(self.gamma, plan.budget) + 1)
        if not plan.lengths or not any(plan.lengths):  # plain decoding: one token each
            return dict.fromkeys(map(id, plan.decoding), 1)
        return {id(s): n + 1 for s, n in zip(plan.decoding, plan.lengths)}

    def _surely_done(self, seq: Sequence) -> bool:
        """Whether the step in flight surely finishes ``seq`` by length — it emits at least one token: the request's
        limit, or the end of its slot, as the scheduler's commit will find — so that it needs no further step. (EOS
        and stop strings cannot be known before the read: such a request runs one dropped row.)"""
        return id(seq) in self._reach and (len(seq.output_ids) + 1 >= seq.params.max_new_tokens
                                           or self.scheduler.slot_full(seq.anchor_pos + 1))

    def _done_in_flight(self) -> set[int]:
        """``id`` of every request the step in flight surely finishes (:meth:`_surely_done`), found in one pass over
        that step's requests: at batch 256 a call per decoding request cost a third of a millisecond of host time."""
        if self._in_flight is None:
            return set()
        # slot_full(anchor_pos + 1), i.e. anchor_pos + γ + 3 ≥ max_seq_len, spelt out: anchor_pos = prompt + output - 1
        room = self.scheduler.max_seq_len - self.scheduler.gamma - 2
        return {id(s) for s in self._in_flight[0].decoding
                if len(s.output_ids) + 1 >= s.params.max_new_tokens or len(s.prompt_ids) + len(s.output_ids) >= room}

    def _room_ahead(self, seqs: list[Sequence], longest: int) -> bool:
        """Whether every decoding request (``seqs``, whose longest context is ``longest``) can be verified before the
        step in flight is read: after that step its anchor lies up to ℓ + 1 positions further, and the block verified
        from there must still fit its slot (near the end of a slot, the synchronous engine's rule — finish when the
        next block would not fit — needs the exact anchor). Requests that step surely finishes are left out anyway.

        The longest context bounds every request's anchor, so the exact per-request checks (a third of a millisecond
        of host time a step at batch 256) run only when that bound says some slot might fill."""
        reach = self._reach
        if not seqs or not self.scheduler.slot_full(longest - 1 + max(reach.values(), default=0)):
            return True
        full = self.scheduler.slot_full
        return not any(reach.get(id(s), 0) > 1 and full(s.anchor_pos + reach[id(s)]) and not self._surely_done(s)
                       for s in seqs)

    def _schedule(self, exclude: set[int] | None = None, unrecorded: int = 0) -> StepPlan:
        if not self.scheduler.ready:
            raise RuntimeError(f"mode '{self.sched_config.mode}' needs a cost table: call set_cost_table (e.g. with "
                               "optimized.cost_model.cached_profile(engine.runner)) before stepping")
        self._verified, self._survivals, self._drafted_ahead = None, [], None
        return self.scheduler.schedule(exclude, ahead=unrecorded)

    def _prefill(self, plan: StepPlan) -> list[StepOutput]:
        prefilled = self._launch_prefill(plan)
        return [] if prefilled is None else self._collect_prefill(prefilled)

    def _launch_prefill(self, plan: StepPlan) -> LaunchedPrefill | None:
        """Launch the plan's prompt chunks (None when it has none); :meth:`_collect_prefill` reads and commits them."""
        if not plan.prefill:
            return None
        t0 = time.perf_counter()
        prefilled = self.runner.launch_prefill(plan.prefill)
        self.stats["prefill_steps"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0
        return prefilled

    def _collect_prefill(self, prefilled: LaunchedPrefill) -> list[StepOutput]:
        t0 = time.perf_counter()
        out = self.runner.collect_prefill(prefilled)
        self.stats["prefill_s"] += time.perf_counter() - t0
        return self.scheduler.postprocess(out.seqs, out.tokens, out.logprobs, top_logprobs=out.top_logprobs)

    def _verify(self, plan: StepPlan) -> list[StepOutput]:
        if not plan.decoding:
            return []
        if plan.mode.synchronous:  # ℓ from this step's own survivals: the host waits for them
            self.scheduler.synchronous_lengths(plan, self.runner.current_survivals(plan.decoding))
        if plan.mode.drafts:  # the host copies [γ] of the drafts being verified (for last_step_stats)
            self._survivals = [s.survivals[-1] if s.survivals else None for s in plan.decoding]
        else:
            self._survivals = [None] * len(plan.decoding)
        self._monitor_launch(plan)
        out: StageOutput = self.runner.verify(plan, self._plan_ahead if self._ahead_on else None)
        self._verified = out
        self._record_outcomes(out)
        if self.runner.hybrid is not None:  # each verified n-gram block's outcome joins its request's counts
            for seq, source in zip(out.seqs, self.runner.observe_hybrid(out)):
                seq.proposal_sources.append(source)
        t0 = time.perf_counter()
        outputs = self.scheduler.postprocess(out.seqs, out.tokens, out.logprobs, out.verified, out.top_logprobs)
        self.stats["host_commit_s"] += time.perf_counter() - t0
        return outputs

    def _plan_ahead(self) -> None:
        """While the device verifies: the next step's planning (``Scheduler.plan_ahead``), once the last draft's
        survivals have landed on the host, and, when the planned verdict is that the requests decoding now draft,
        their drafter stage (``EngineConfig.draft_ahead``). Timed apart from ``host_schedule_s``: it is off the
        critical path."""
        t0 = time.perf_counter()
        self.runner.wait_for_drafts()
        verdict = self.scheduler.plan_ahead()
        if self._draft_ahead_on and verdict:
            self._draft_ahead()
        self.stats["host_ahead_s"] += time.perf_counter() - t0

    def _draft_ahead(self) -> None:
        """Launch the next block's draft for every request decoding now, queued behind this step's token copy: the
        device drafts while the host waits for the tokens and commits them. The drafter reads only device state the
        verify has already written (anchors, positions, the drafter's context), so each request's block is the one
        it would draft after the read. Not when a request may run out of slot this step (its block would not fit:
        the read decides) or when the draft must block (staleness 0) or is decided on the host (the n-gram and the
        hybrid proposers)."""
        seqs = self.scheduler.decoding()
        if (not seqs or self.runner.host_proposals or self.sched_config.staleness == 0
                or any(self.scheduler.slot_full(s.anchor_pos + self.gamma + 1) for s in seqs)):  # ≤ γ+1 emitted
            return
        self._drafted_ahead = (seqs, self._launch_draft(seqs, blocking=False))

    def _keep_early_drafts(self, drafters: list[Sequence]) -> None:
        """Commit the early draft for the requests the gate lets draft, after the read: all of them, or those that
        did not finish (their rows of it), or nobody (then the device's draft buffers are simply never read: the next
        step verifies no drafts, and a later draft overwrites them)."""
        seqs, survivals = self._drafted_ahead
        self.stats["draft_ahead_steps"] += 1
        if not drafters:
            self.stats["drafts_dropped"] += 1
            return
        if len(drafters) == len(seqs) and all(a is b for a, b in zip(drafters, seqs)):  # nobody finished
            self.scheduler.record_drafts(seqs, survivals)
            return
        index = {s.request_id: i for i, s in enumerate(seqs)}
        rows = survivals.numpy()  # sync: none, a view; the copy may still be landing (nobody reads it before then)
        self.scheduler.record_drafts(drafters, [rows[index[s.request_id]] for s in drafters])

    def _draft(self, seqs: list[Sequence]) -> None:
        """The next step's blocks: the n-gram lookup (host), the hybrid choice (the drafter, then the host), or the
        drafter (device; survivals copied back)."""
        if self.runner.proposer is not None:
            self.scheduler.record_proposals(seqs, self.runner.propose(seqs))
            return
        if self.runner.hybrid is not None:
            if self._monitor is not None:
                self._monitor.drafted(len(seqs))
            survivals, lengths = self.runner.draft_hybrid(seqs)
            self.scheduler.record_drafts(seqs, survivals)
            self.scheduler.record_proposals(seqs, lengths)
            return
        stale = self.sched_config.staleness > 0  # staleness 0 reads the copy at the next step's start: it blocks
        self.scheduler.record_drafts(seqs, self._launch_draft(seqs, blocking=not stale))

    def _launch_draft(self, seqs: list[Sequence], blocking: bool) -> torch.Tensor:
        """The drafter stage for ``seqs`` (``ModelRunner.draft``), counted in the step being measured."""
        if self._monitor is not None:
            self._monitor.drafted(len(seqs))
        return self.runner.draft(seqs, blocking=blocking)

    def _record_outcomes(self, out: StageOutput) -> None:
        """A read verify step's drafts against their forecast, for the finish-time estimate's per-request factors
        (``DraftGate.record_outcomes``; nothing unless the finish-time gate keeps statistics with ``outcomes`` on)."""
        gate = self.scheduler.gate
        if gate.track and gate.outcomes and out.verified is not None:
            gate.record_outcomes(out.seqs, self._survivals, out.verified, [len(t) - 1 for t in out.tokens])

    def _monitor_launch(self, plan: StepPlan) -> None:
        """Stamp the launch of this step's verify for the cost monitor (``EngineConfig.cost_feedback``)."""
        self._priced_requests = len(plan.decoding)
        if self._monitor is not None:
            self._monitor.launch(len(plan.decoding), plan.num_verify_tokens, bool(plan.prefill))

    def _account(self, plan: StepPlan, t0: float, host_s: float, drafted: bool) -> None:
        if self._monitor is not None:  # steps whose end has been reached: measured against the table
            scales = self._monitor.update()
            if scales is not None:
                self.scheduler.set_price_scales(scales)
            if not self.has_unfinished():
                self._monitor.idle()
        step_s = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["draft_steps"] += drafted
        self.stats["host_schedule_s"] += host_s
        self.stats["step_s"] += step_s
        self._last = (plan, self._verified, self._survivals, step_s, drafted)
        if (self._acceptance is not None and self._verified is not None and self._verified.verified is not None
                and self.stats["steps"] % SAMPLE_EVERY == 0):  # one step's verified drafts in SAMPLE_EVERY
            out = self._verified
            self._acceptance.add(self._survivals, out.verified, [len(t) - 1 for t in out.tokens])
            factors = self._acceptance.update()
            if factors is not None:
                self.scheduler.set_survival_scale(factors)
