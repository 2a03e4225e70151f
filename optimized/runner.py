"""The model runner: the engine's device side — static caches, CUDA graphs, and the prefill / verify / draft stages.

The same method as ``reference/generate.py`` (docs/method.md §1–§5), batched on the device. Three stages, each one
public method that takes host objects in (sequences, a :class:`optimized.scheduler.StepPlan`) and gives host lists
back:

    prefill   prompt chunks through the target (a prefill graph per token bucket, eager past the largest; never in a
              decode graph); finished prompts sample their first token; the features go to the drafter context
    verify    one varlen target forward over [x_0, x_1..x_ℓ] of every decoding request (CUDA graph per token bucket;
              the graph also appends the verified features to the drafter context; a step that verifies no
              drafts runs the target alone and parks the features until the request's next draft), ℓ_r = top-B of
              the *current* survivals on the device (or the plan's lengths), then rejection sampling (greedy
              verification from the logits when every request is greedy: the same tokens without p_t), then the one
              token read
    draft     backbone over [x_0, M, …, M]; fused sequential-head sampling + confidence; STS → survivals for the next
              step (one graph per request bucket for the Markov head); p_d written into the slots' rows, except a
              greedy request's, whose p_d is the one-hot of its drafts and stays implicit (``draft_onehot``)
    propose   the n-gram proposer's draft stage instead (reference/ngram.py): a lookup on the host in each request's
              own tokens (optimized/ngram.py), uploaded as drafts whose p_d is one-hot (implicit, as for greedy
              drafts); no drafter forward, no context
    hybrid    the hybrid proposer's draft stage (reference/hybrid.py): the drafter stage, its survivals read at once,
              then on the host each request's lookup and choice; the rows of requests that take the n-gram block get
              its tokens, one-hot p_d, estimated survivals and length cap (ℓ ≤ m); after the token read, the outcome
              of each verified n-gram block joins its request's acceptance counts

Every per-request length, offset and position is derived on the device from device tensors. The host holds totals
only (the number of decoding requests, the budget B). The single host↔device synchronisation per step is the read of
the emitted tokens (named below); the synchronous policies add the read of the current survivals.

Profiling and warm-up run the same stages on placeholder requests (:meth:`ModelRunner.dummy_verify`,
:meth:`ModelRunner.dummy_draft`, :meth:`ModelRunner.warmup`); ``optimized/cost_model.py`` times them.

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from optimized.config import EngineConfig
from optimized.graphs import GraphRunner, PrefillBuffers, StaticBuffers, bucket_sizes, prefill_bucket_sizes
from optimized.kernels.allocate import allocate_top_b
from optimized.kernels.draft_head import sample_block
from optimized.kernels.layout import draft_load, draft_store, verify_layout
from optimized.kernels.sampling import sample
from optimized.kernels.verify import advance_anchors, greedy_verify, rejection_sample
from optimized.models.drafter import OptimizedDrafter
from optimized.models.target import OptimizedTarget
from optimized.ngram import NgramIndex
from optimized.scheduler import PrefillChunk, StepPlan
from optimized.sequence import SamplingParams, Sequence, Status
from reference.calibration import biases_for, log_weights_for, temperatures_for
from reference.config import SchedulingMode
from reference.drafter import DSparkDrafter
from reference.hybrid import NGRAM, HybridProposer, HybridState
from reference.ngram import NgramProposer
from reference.sampling import Purpose, logits_to_probs
from reference.target import Target

log = logging.getLogger("dspark.runner")

# Prompt chunks one prefill graph takes at most (more in one step run as several graph launches).
PREFILL_GRAPH_ROWS = 16

# Placeholder requests of the warm-up: how many prompt tokens each carries. 72 > 64 so that a chunk spans more than
# one 64-row query tile of the attention kernel (its tile choice depends on the chunk length), as long prompts do.
WARMUP_PROMPT_LEN = 72


@dataclass
class StageOutput:
    """What a prefill or verify stage emitted, on the host: one entry per sequence, in the order given."""

    seqs: list[Sequence]
    tokens: list[list[int]]  # emitted tokens (the first token after a prompt; accepted drafts + 1 after a verify)
    logprobs: list[list[float]] | None  # log p_t of each emitted token (None: nobody asked for them)
    verified: list[int] | None = None  # verify only: ℓ of each request (oracle: the accepted prefix + 1, ≤ γ)
    num_tokens: int = 0  # verify only: N = R + Σℓ, the unpadded tokens of the verify forward
    # Per sequence, the top alternatives [(token, logprob)] of each emitted position (None: not asked for).
    top_logprobs: list[list[list[tuple[int, float]]] | None] | None = None


@dataclass
class LaunchedVerify:
    """A verify stage whose device work and token copy are queued and whose tokens the host has not read yet."""

    seqs: list[Sequence]  # the plan's decoding requests, in batch order
    host: torch.Tensor  # [R, E + 2] emitted tokens, their count and ℓ, on the host once ``copied`` has completed
    logp_host: torch.Tensor | None  # [R, E] log p_t of the emitted tokens, if a request asked
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA); None on the CPU, where they are done
    want: list[int]  # rows that asked for raw or top logprobs
    top: tuple[torch.Tensor, torch.Tensor] | None  # their top alternatives, on the device
    num_tokens: int  # N = R + Σℓ


@dataclass
class LaunchedPrefill:
    """A prefill stage whose forward, first-token draws and their copy to the host are queued, unread by the host."""

    seqs: list[Sequence]  # the requests whose prompt these chunks complete (they get their first token)
    first: torch.Tensor | None  # [M] their first tokens, on the host once ``copied`` has completed
    logp: torch.Tensor | None  # [M] log p_t of those tokens, likewise
    top: list | None  # their top alternatives, already on the host (read at launch: only when a request asked)
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA); None on the CPU, where they are done


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the device.

    A host list copied to the GPU the plain way is a pageable copy, which PyTorch follows with a stream
    synchronisation: the host waits for every kernel queued before it — in a step launched one ahead of its reads, the
    very queue the pipeline keeps full — and the device then idles while the host launches the next graph. Here the
    values are staged in pinned memory and copied asynchronously, in stream order (the caching host allocator keeps
    the staging block until the copy has run). On the CPU it is ``torch.tensor``."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)  # sync: none (pinned)


def extra_logprob_rows(seqs: list[Sequence]) -> list[int]:
    """Rows whose request asked for raw or top log-probabilities (known on the host from the parameters)."""
    return [i for i, s in enumerate(seqs) if s.params.logprobs and (s.params.raw_logprobs or s.params.top_logprobs)]


def extra_logprobs(seqs: list[Sequence], want: list[int], logits: torch.Tensor, probs: torch.Tensor,
                   tokens: torch.Tensor, logp: torch.Tensor):
    """Raw log-probabilities and top-k alternatives of the rows in ``want`` (the other rows are untouched).

    Args:
        logits: [W, E, V] target logits at the emitted positions of the wanted rows.
        probs: [W, E, V] p_t there (what the tokens were drawn from).
        tokens: [R, E] emitted ids of every row (-1 pads).
        logp: [R, E] log p_t of those.

    Returns:
        ``logp`` with the raw rows replaced by log-softmax values, and ``(top ids, top logprobs)`` [W, E, k] (or None
        when nobody asked for alternatives), each row from the distribution its request reports.
    """
    dev = logits.device
    raw = torch.log_softmax(logits.float(), dim=-1)  # [W, E, V]
    is_raw = upload([seqs[i].params.raw_logprobs for i in want], torch.bool, dev)[:, None, None]  # [W, 1, 1]
    dist = torch.where(is_raw, raw, torch.log(probs.float().clamp_min(1e-30)))  # [W, E, V]
    idx = upload(want, torch.long, dev)
    logp = logp.clone()
    logp[idx] = dist.gather(2, tokens[idx].clamp(min=0)[..., None])[..., 0]
    k = min(max(seqs[i].params.top_logprobs for i in want), dist.shape[-1])
    if k == 0:
        return logp, None
    values, ids = torch.topk(dist, k, dim=-1)  # [W, E, k] descending
    return logp, (ids, values)


def top_to_host(seqs: list[Sequence], want: list[int], top) -> list[list[list[tuple[int, float]]] | None]:
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


class ModelRunner:
    """Static caches over ``max_num_seqs`` slots, the graphs, and the stages of a step."""

    def __init__(self, target: Target, drafter: DSparkDrafter | NgramProposer | HybridProposer | None,
                 config: EngineConfig) -> None:
        """Args:
            target: the reference target (its weights are read, never copied where they can be shared).
            drafter: the reference drafter, the n-gram proposer, the hybrid of the two, or None (no speculation: every
                verify carries the anchor alone).
            config: sizes and backends fixed for the runner's life.
        """
        self.config = config
        self.device = torch.device(config.device)
        self.gamma = drafter.config.gamma if drafter is not None else 0  # γ: drafts per request and step
        # The n-gram proposer drafts on the host (propose); only a DSpark drafter has a model (draft).
        self.proposer = drafter if isinstance(drafter, NgramProposer) else None
        self._ngram: list[tuple[Sequence, NgramIndex] | None] = [None] * config.max_num_seqs  # (owner, index) per slot
        # The hybrid proposer: the drafter's stage, then a host choice per request (draft_hybrid); per slot, its
        # request's lookup index and HybridState.
        self.hybrid = drafter if isinstance(drafter, HybridProposer) else None
        self._hybrid: list[tuple[Sequence, NgramIndex, HybridState] | None] = [None] * config.max_num_seqs
        drafter = None if self.proposer is not None else drafter
        if self.hybrid is not None:
            drafter = self.hybrid.drafter
        self.reference_target, self.ref_drafter = target, drafter
        self.vocab = target.vocab_size
        # Static caches: max_num_seqs slots (+ a trash slot the models add for padding writes).
        self.target = OptimizedTarget(target, attention_backend=config.kernel_backend,
                                      layer_backend=config.layer_backend, linear_rows=config.linear_rows,
                                      row_invariant=config.batch_invariant)
        self.target.allocate_cache(config.max_num_seqs, config.max_seq_len)
        self.drafter = None
        if drafter is not None:
            self.drafter = OptimizedDrafter(drafter, attention_backend=config.kernel_backend,
                                            layer_backend=config.layer_backend, linear_rows=config.linear_rows)
            self.drafter.allocate_cache(config.max_num_seqs, config.max_seq_len)
            self.sts = {mode: torch.tensor(temperatures_for(drafter.config, mode), device=self.device)
                        for mode in ("greedy", "sampling")}
            # b = 0 for a mode calibrated without biases: adding +0.0 leaves every float as the reference has it
            self.sts_bias = {mode: torch.tensor(biases_for(drafter.config, mode) or [0.0] * self.gamma,
                                                device=self.device) for mode in ("greedy", "sampling")}
            # beta calibration's w·log σ(z), only where a mode has it: an STS or STS + bias checkpoint keeps the draft
            # step's kernels as they were (where one mode has weights, the other's w = 0 adds ±0.0: no float changes)
            weights = {mode: log_weights_for(drafter.config, mode) for mode in ("greedy", "sampling")}
            self.sts_logw = None if not any(weights.values()) else {
                mode: torch.tensor(w or [0.0] * self.gamma, device=self.device) for mode, w in weights.items()}
        self._alloc_state(config.max_num_seqs)
        # Plain steps' tapped features not yet in the drafter's context (EngineConfig.draft_context_lag): per slot,
        # position p's row sits at p mod lag; the last slot takes padding rows. _lag[slot] counts them (host).
        self.context_lag = config.draft_context_lag if self.drafter is not None else 0
        self._lag = np.zeros(config.max_num_seqs, dtype=np.int64)  # [S] host
        if self.context_lag:
            self.pending_features = torch.zeros(config.max_num_seqs + 1, self.context_lag, self.target.feature_size,
                                                dtype=self.target.dtype, device=self.device)  # [S+1, lag, m·d]
        self._owner: list[Sequence | None] = [None] * config.max_num_seqs  # the request whose state a slot holds
        self._placeholders_cache: tuple[int, list[Sequence]] | None = None  # (context length, placeholder sequences)
        self._drafts_copied: torch.cuda.Event | None = None  # recorded after the last non-blocking survivals copy
        self._capture_graphs()

    # ------------------------------------------------------------------------------------------------ start-up

    def _alloc_state(self, slots: int) -> None:
        dev, g = self.device, self.gamma
        self.anchor = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] x_0 of each slot
        self.anchor_pos = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] its absolute position
        self.draft_tokens = torch.zeros(slots, g, dtype=torch.long, device=dev)  # [S, γ]
        # [S, 1] a step that verifies no drafts (an engine without a drafter, or a plain step of one with a drafter)
        # goes through greedy_verify too, with one slot no row ever verifies: no gather of the slots' drafts
        self.no_drafts = torch.zeros(slots, 1, dtype=torch.long, device=dev)
        self.draft_probs = torch.zeros(slots, g, self.vocab, dtype=torch.float32, device=dev)  # [S, γ, V]
        # [S] p_d of the slot's drafts is the one-hot of its own tokens (greedy drafts, n-gram proposals), implicit:
        # its draft_probs rows are neither written nor read (rejection_sample's draft_onehot).
        self.draft_onehot = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.survival = torch.zeros(slots, g, dtype=torch.float32, device=dev)  # [S, γ] calibrated a_k
        # [S] the most slots of a slot's block a verify may take: γ, or a hybrid n-gram block's m (draft_hybrid)
        self.proposal_cap = torch.full((slots,), g, dtype=torch.long, device=dev)
        self.request_id = torch.zeros(slots, dtype=torch.long, device=dev)  # [S]
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)  # [S]
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)  # [S]
        self.top_k = torch.zeros(slots, dtype=torch.long, device=dev)  # [S]

    def _capture_graphs(self) -> None:
        """One verify graph per token bucket and one draft graph per request bucket (CUDA only): all capture here."""
        cfg, g = self.config, self.gamma
        use_graphs = self.device.type == "cuda" and not cfg.enforce_eager
        max_tokens = cfg.max_num_seqs * (g + 1)  # every request verifies its anchor and at most γ drafts
        # The Markov head's sampling kernels read only device tensors, so the whole drafter stage — backbone, fused
        # head, STS survivals — is one graph. The RNN and parallel-only heads run the reference loop after it.
        self.head_in_graph = self.drafter is not None and self.ref_drafter.config.head == "markov"
        self.buffers = StaticBuffers(cfg.max_num_seqs, max_tokens, self.device, self.target.lm_head.shape[0])
        self.max_q_len = g + 1
        b = self.buffers

        def verify_fn(n: int):
            logits, features = self.target.forward(b.input_ids[:n], b.positions[:n], b.cu, b.kv_lens, b.slot_ids,
                                                   None, max_q_len=self.max_q_len, logits_out=b.logits[:n])
            if self.drafter is not None:  # the features of every verified token go to the drafter context
                self.drafter.append_context(features, b.positions[:n], b.token_slot[:n])
            return (logits,)

        def draft_fn(r: int):
            h = self.drafter.backbone(b.anchor_ids[:r], b.anchor_pos[:r], b.draft_slots[:r])
            if not self.head_in_graph:
                return (h,)
            temperature = b.draft_temperature[:r]
            out = sample_block(self.ref_drafter, h, b.anchor_ids[:r], b.anchor_pos[:r], temperature,
                               self.config.seed, b.draft_request_id[:r], backend=self.config.kernel_backend,
                               probs_out=self.draft_probs, probs_rows=b.draft_slots[:r],  # p_d into the slots
                               store_greedy=False)  # greedy rows' one-hot p_d stays implicit (draft_onehot)
            return out.tokens, out.probs, self._survival(out.conf_logits, temperature)

        self.verify_graphs = GraphRunner("verify", verify_fn, bucket_sizes(max_tokens), use_graphs)
        self.verify_graphs.capture()

        # Plain steps of an engine with a drafter (EngineConfig.draft_context_lag): the target alone, a one-token
        # query per request as in an engine without a drafter, and the features parked for a later append.
        self.plain_graphs = None
        if self.context_lag:
            trash, lag = cfg.max_num_seqs, self.context_lag

            def plain_fn(n: int):
                logits, features = self.target.forward(b.input_ids[:n], b.positions[:n], b.cu, b.kv_lens, b.slot_ids,
                                                       None, max_q_len=1, logits_out=b.logits[:n])
                slot = b.token_slot[:n]
                self.pending_features[torch.where(slot < 0, trash, slot), b.positions[:n] % lag] = features
                return (logits,)

            self.plain_graphs = GraphRunner("plain", plain_fn, bucket_sizes(cfg.max_num_seqs), use_graphs,
                                            pool=self.verify_graphs.pool)
            self.plain_graphs.capture()

        # Prefill: the last token of each chunk gets logits (only completed prompts' rows are read).
        pb = self.prefill_buffers = PrefillBuffers(min(PREFILL_GRAPH_ROWS, cfg.max_num_seqs),
                                                   max(1, min(cfg.prefill_graph_tokens, cfg.prefill_chunk)),
                                                   self.device, self.target.lm_head.shape[0])

        def prefill_fn(n: int):
            logits, features = self.target.forward(pb.input_ids[:n], pb.positions[:n], pb.cu, pb.kv_lens, pb.slot_ids,
                                                   pb.last_rows, max_q_len=n, logits_out=pb.logits)
            if self.drafter is not None:
                self.drafter.append_context(features, pb.positions[:n], pb.token_slot[:n])
            return (logits,)

        self.prefill_graphs = GraphRunner("prefill", prefill_fn, prefill_bucket_sizes(pb.max_tokens),
                                          use_graphs and cfg.prefill_graph_tokens > 0, pool=self.verify_graphs.pool)
        try:
            self.prefill_graphs.capture()
        except RuntimeError as err:  # keep serving: the same function then runs eagerly, as with enforce_eager
            log.warning("capturing the prefill graphs failed (%s); prefill runs eagerly", err)
            torch.cuda.synchronize()  # sync: start-up capture, off the step loop
            self.prefill_graphs.graphs.clear()
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

    @property
    def pipelined(self) -> bool:
        """Whether the engine runs steps one ahead of their token reads (``EngineConfig.async_decode``, None: on
        CUDA): its stages then run back to back on the device, the host's work behind them, and the cost profile
        prices them that way."""
        flag = self.config.async_decode
        return flag if flag is not None else self.device.type == "cuda"

    @property
    def uses_graphs(self) -> bool:
        """Whether verify steps replay captured CUDA graphs (False on CPU or with ``enforce_eager``)."""
        return bool(self.verify_graphs.graphs)

    @property
    def idle(self) -> bool:
        """No request's state lives in the slots (dummy steps would overwrite it)."""
        return all(s is None or s.finished for s in self._owner)

    # ------------------------------------------------------------------------------------------------ stages

    def prefill(self, chunks: list[PrefillChunk]) -> StageOutput:
        """Run prompt chunks; sequences whose prompt completes get their first token (a bonus draw), read at once.

        A sequence's first chunk loads its sampling parameters into its slot. Chunks run in groups that fit the
        prefill graphs (``PREFILL_GRAPH_ROWS`` chunks, ``EngineConfig.prefill_graph_tokens`` tokens); a chunk longer
        than that runs eagerly on its own, and with ``prefill_graph_tokens=0`` all of them in one eager forward.
        """
        return self.collect_prefill(self.launch_prefill(chunks))

    def launch_prefill(self, chunks: list[PrefillChunk]) -> LaunchedPrefill:
        """:meth:`prefill` without its read: the forward, the first tokens (written to the completed requests' anchors
        on the device, where their first verify reads them) and their copy to the host are queued, and
        :meth:`collect_prefill` reads them. An engine one step ahead launches the step's verify in between, so that the
        device does not wait for the host's read of the first tokens (the read waits for the copy only)."""
        dev = self.device
        self._bind([seq for seq, start, _ in chunks if start == 0])
        groups = self._prefill_groups(chunks)
        done, logits = [], []
        for group in groups:
            group_done, group_logits = self._prefill_forward(group)
            done += group_done
            if group_done:
                # a graph's logits buffer is rewritten by the next group's replay: keep this group's rows
                logits.append(group_logits.clone() if len(groups) > 1 else group_logits)
        if not done:
            return LaunchedPrefill([], None, None, None, None)
        logits = logits[0] if len(logits) == 1 else torch.cat(logits)  # [M, V] the completed prompts' last rows
        done_slots = upload([s.slot for s in done], torch.long, dev)
        # The reference op only where a request filters: its input checks are device→host syncs, each a pipeline
        # bubble in a step that is about to read its first tokens anyway.
        p_t = self._target_probs(logits, done_slots, done)  # [M, V]
        positions_first = upload([len(s.prompt_ids) for s in done], torch.long, dev)
        first = sample(p_t, self.config.seed, self.request_id[done_slots], positions_first, int(Purpose.BONUS),
                       backend=self.config.kernel_backend)
        logp = torch.log(p_t.gather(1, first[:, None]))  # [M, 1]
        want = extra_logprob_rows(done)
        top = None
        if want:
            idx = upload(want, torch.long, dev)
            logp, top = extra_logprobs(done, want, logits[idx][:, None], p_t[idx][:, None], first[:, None], logp)
        self.anchor[done_slots] = first
        self.anchor_pos[done_slots] = positions_first
        first_host = first.to("cpu", non_blocking=True)  # sync: none (a pinned copy, waited for by collect_prefill)
        logp_host = logp[:, 0].to("cpu", non_blocking=True)  # sync: none (likewise)
        copied = None
        if dev.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        top_host = top_to_host(done, want, top)  # sync: only when a request asked for top logprobs
        return LaunchedPrefill(done, first_host, logp_host, top_host, copied)

    def collect_prefill(self, launched: LaunchedPrefill) -> StageOutput:
        """Wait for a launched prefill's copy of the first tokens (not for anything queued after it) and return them:
        the first token is streamed and checked for EOS on the host."""
        if not launched.seqs:
            return StageOutput([], [], None)
        if launched.copied is not None:
            launched.copied.synchronize()  # sync: the first tokens' copy only
        first, logp = launched.first.tolist(), launched.logp.tolist()  # sync: host tensors already
        return StageOutput(launched.seqs, [[t] for t in first], [[lp] for lp in logp],
                           top_logprobs=[t[:1] if t else None for t in launched.top])

    def _prefill_groups(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        """The step's chunks in launch order: groups that fit the prefill buffers (a chunk longer than they hold alone),
        or all of them in one eager forward when prefill graphs are off (``prefill_graph_tokens=0``)."""
        if not self.config.prefill_graph_tokens:
            return [chunks]
        pb = self.prefill_buffers
        groups: list[list[PrefillChunk]] = []
        tokens = 0  # in the last group
        for c in chunks:
            if groups and len(groups[-1]) < pb.max_rows and tokens + c.length <= pb.max_tokens:
                groups[-1].append(c)
                tokens += c.length
            else:
                groups.append([c])
                tokens = c.length
        return groups

    def _prefill_forward(self, chunks: list[PrefillChunk]) -> tuple[list[Sequence], torch.Tensor]:
        """One target forward over ``chunks`` (their features appended to the drafter context). Returns the sequences
        whose prompt these chunks complete and the ``[M, V]`` logits of their last prompt token."""
        tokens, positions, cu, kv_lens, slots, last_rows, done = [], [], [0], [], [], [], []
        for seq, start, n in chunks:
            tokens += seq.prompt_ids[start:start + n]
            positions += range(start, start + n)
            cu.append(cu[-1] + n)
            kv_lens.append(start + n)
            slots.append(seq.slot)
            if start + n == len(seq.prompt_ids):
                last_rows.append(cu[-1] - 1)
                done.append(seq)
        pb = self.prefill_buffers
        if self.config.prefill_graph_tokens and len(chunks) <= pb.max_rows and len(tokens) <= pb.max_tokens:
            # the static buffers and a prefill graph (eager on the CPU or with enforce_eager: the same function)
            pb.load(tokens, positions, cu, kv_lens, slots, last_rows)
            (logits,) = self.prefill_graphs.run(self.prefill_graphs.padded(len(tokens)))  # [Rp, V]
            return done, logits[:len(done)]
        dev = self.device  # a chunk longer than the largest prefill graph (or none): eagerly, over exactly its tokens
        tok = upload(tokens, torch.long, dev)  # [N]
        pos = upload(positions, torch.long, dev)  # [N]
        cu_t = upload(cu, torch.int32, dev)  # [R+1]
        kv_t = upload(kv_lens, torch.int32, dev)  # [R]
        slot_t = upload(slots, torch.int32, dev)  # [R]
        rows = upload(last_rows, torch.long, dev)  # [M]
        logits, features = self.target.forward(tok, pos, cu_t, kv_t, slot_t, logits_rows=rows)  # [M, V], [N, m*d]
        if self.drafter is not None:
            slot_of_token = torch.repeat_interleave(slot_t.long(), torch.diff(cu_t).long())  # [N]
            self.drafter.append_context(features, pos, slot_of_token)
        return done, logits

    def current_survivals(self, seqs: list[Sequence]) -> torch.Tensor:
        """``[R, γ]`` host copy of the survivals of the drafts ``seqs`` hold now, for a synchronous policy."""
        rows = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        # sync: threshold and adaptive-sync are synchronous by definition (the paper's Algorithm 1 reads the current a).
        return self.survival[rows].cpu()  # sync: synchronous policies only (see above)

    def verify(self, plan: StepPlan, while_device_runs: Callable[[], None] | None = None) -> StageOutput:
        """Verify the plan's decoding requests: layout, verify graph, p_t, rejection sampling, the one token read.

        ``while_device_runs`` is called after every launch of the verify and the (non-blocking) copy of its tokens to
        the host, before the host waits for that copy: host work placed there overlaps with the device's verify (on
        CUDA; on the CPU the forward has already run), and device work it launches (the next block's draft) runs
        after the copy without delaying it."""
        launched = self.launch_verify(plan)
        if while_device_runs is not None:
            while_device_runs()
        return self.collect_verify(launched)

    def launch_verify(self, plan: StepPlan) -> LaunchedVerify:
        """The verify stage up to its token copy, which is issued without waiting: every launch, no host read. The
        device state the next stage needs (each request's anchor and its position) is updated on the device."""
        decoding, dev, g = plan.decoding, self.device, self.gamma
        r = len(decoding)
        slots = [s.slot for s in decoding]
        if plan.budget is not None:  # ℓ = top-B of the current survivals, on the device
            rows = upload(slots, torch.long, dev)  # [R] slot of each row
            lens = allocate_top_b(self.survival, plan.budget, self.config.kernel_backend, rows=rows)  # [R]
            if self.hybrid is not None:  # top-B may reach an n-gram block's zero survivals past its m
                lens = torch.minimum(lens, self.proposal_cap[rows])
        else:  # ℓ known to the host (0 for plain decoding): one upload with the slots
            known = plan.lengths if plan.lengths is not None else [0] * r
            both = upload(slots + list(known), torch.long, dev)  # [2R]
            rows, lens = both[:r], both[r:]  # [R] slot of each row, [R] ℓ
        n_tokens = plan.num_verify_tokens
        plain = bool(self.context_lag) and plan.mode is SchedulingMode.NONE  # the target alone, features parked
        graphs = self.plain_graphs if plain else self.verify_graphs
        if plain:
            held = np.array(slots, dtype=np.intp)  # [R]
            if (self._lag[held] >= self.context_lag).any():  # a full buffer: append it first
                self.catch_up_context(decoding)
            self._lag[held] += 1  # slots are distinct
        n_pad = graphs.padded(n_tokens)
        # Token layout, on the device, straight into the graphs' static buffers (one launch with Triton): request j
        # owns tokens cu[j] .. cu[j+1]-1 = [x_0, x_1..x_ℓ] (optimized/kernels/layout.py).
        b = self.buffers
        verify_layout(rows, lens, self.anchor, self.anchor_pos, self.draft_tokens, n_pad, b.layout(),
                      backend=self.config.kernel_backend)
        slot_of = b.token_slot[:n_pad]  # [N_pad] slot of each packed token, -1 for padding
        (logits,) = graphs.run(n_pad)  # [N_pad, V]; also appends (or parks) drafter context (see _capture_graphs)

        def packed_rows() -> torch.Tensor:
            """[R, γ+1] the packed row of each (r, j): row j of request r is packed token cu[r] + j. Rows past ℓ_r
            repeat row ℓ_r (the verifier never reads them), so the verifier's [R, γ+1, ...] layout is one gather,
            and nothing is zero-filled or scattered."""
            j = torch.arange(g + 1, device=dev)
            return b.cu[:r, None].long() + torch.minimum(j[None, :], lens[:, None])

        want = extra_logprob_rows(decoding)
        asked = any(s.params.logprobs for s in decoding)  # log p_t is computed only for a request that reads it
        logp, moved = None, False  # moved: the anchors were advanced by the verify kernel itself
        if not want and all(s.params.temperature == 0 for s in decoding):
            # Every request greedy: p_t is the one-hot of the argmax, with which rejection sampling accepts a draft
            # iff it is the argmax and otherwise draws the argmax (uniforms lie in (0, 1)), and log p_t of every
            # emitted token is log 1 = 0. Verify from the logits directly: no softmax, no one-hot, the same tokens.
            # Read in place from the packed rows (row (r, j) is packed row cu[r] + j); the anchors move in the same
            # kernel. Without a drafter every ℓ is 0: each row's argmax, through the same kernel (a dozen eager
            # launches fewer than index, argmax and the anchors' update, host work that bounds plain decoding one
            # step ahead at large batches).
            moved = True
            # [R, γ] the drafts, or [R, 1] never read when no row verifies any (plain decoding: every ℓ is 0)
            drafts = self.no_drafts[:r] if plan.mode is SchedulingMode.NONE or not g else self.draft_tokens[rows]
            result = greedy_verify(drafts, lens, logits, backend=self.config.kernel_backend, row_starts=b.cu[: r + 1],
                                   anchors=(self.anchor, self.anchor_pos, rows))
            emitted, n_emitted = result.tokens, result.num_emitted
            if asked:
                logp = torch.zeros(emitted.shape, dtype=torch.float32, device=dev)  # [R, E]
        else:
            # p_t at every verified position, laid out [R, γ+1, V] for the verifier.
            probs = self._target_probs(logits, slot_of, decoding)  # [N_pad, V]
            src = packed_rows()  # [R, γ+1]
            target_probs = probs[src]  # [R, γ+1, V]
            if g:
                result = rejection_sample(self.draft_tokens[rows], lens, self.draft_probs[rows], target_probs,
                                          self.config.seed, self.request_id[rows], self.anchor_pos[rows],
                                          backend=self.config.kernel_backend, draft_onehot=self.draft_onehot[rows])
                emitted, n_emitted = result.tokens, result.num_emitted
            else:
                bonus = sample(target_probs[:, 0], self.config.seed, self.request_id[rows], self.anchor_pos[rows] + 1,
                               int(Purpose.BONUS), backend=self.config.kernel_backend)
                emitted, n_emitted = bonus[:, None], torch.ones(r, dtype=torch.long, device=dev)
            if asked:  # log p_t of every emitted token (logprobs are returned with speculation on)
                emitted_p = target_probs[:, :emitted.shape[1]].gather(2, emitted.clamp(min=0)[..., None])[..., 0]
                logp = torch.log(emitted_p.clamp_min(1e-30))  # [R, E]
        e = emitted.shape[1]
        top = None
        if want:  # raw log-probabilities / alternatives, from the same packed logits rows as p_t (a request that
            # wants them sends the step down the p_t branch above, which built src)
            idx = upload(want, torch.long, dev)
            logp, top = extra_logprobs(decoding, want, logits[src[idx, :e]], target_probs[idx, :e], emitted, logp)
        if not moved:  # the next anchor: the last emitted token, one position past the accepted prefix
            advance_anchors(emitted, n_emitted, self.anchor, self.anchor_pos, rows)
        if plan.mode is SchedulingMode.ORACLE:
            lens = torch.clamp(n_emitted, max=g)  # verify exactly the accepted prefix + the rejected slot
        # The one host read per step — emitted tokens drive finishing, streaming and stop strings — issued without
        # waiting, so that work launched by while_device_runs queues behind the copy, not in front of it.
        host = torch.cat([emitted, n_emitted[:, None], lens[:, None]], 1).to("cpu", non_blocking=True)
        logp_host = logp.to("cpu", non_blocking=True) if logp is not None else None
        copied = None
        if dev.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedVerify(decoding, host, logp_host, copied, want, top, n_tokens)

    def collect_verify(self, launched: LaunchedVerify) -> StageOutput:
        """Wait for a launched verify's token copy (not for anything queued after it) and return its tokens."""
        decoding, host, logp_host, want, top = (launched.seqs, launched.host, launched.logp_host, launched.want,
                                                launched.top)
        if launched.copied is not None:
            launched.copied.synchronize()  # sync: the one read per step (its copies, not what was launched since)
        # One conversion to Python lists per step: per-row tensor indexing costs ~1 ms of host time at R = 64.
        host_rows = host.tolist()  # sync: host tensor already
        logp_rows = logp_host.tolist() if logp_host is not None else None  # sync: host tensor already
        tokens = [row[:row[-2]] for row in host_rows]
        logprobs = None if logp_rows is None else [lp[:len(t)] for lp, t in zip(logp_rows, tokens)]
        top_rows = top_to_host(decoding, want, top)  # sync: only when a request asked for top logprobs
        top_rows = [t[:len(tok)] if t else None for t, tok in zip(top_rows, tokens)]
        return StageOutput(decoding, tokens, logprobs, [row[-1] for row in host_rows], launched.num_tokens, top_rows)

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

    def catch_up_context(self, seqs: list[Sequence]) -> None:
        """Append the parked features of ``seqs``' plain steps to the drafter's context, in one batched call.

        A slot's k parked tokens are its last k verified ones, one a plain step: positions anchor - k .. anchor - 1
        (the device's anchor, after every step launched so far; a step that verifies drafts appends its own
        features, and none runs between a request's plain steps and its next draft, which calls this first)."""
        lagging = [(s.slot, int(self._lag[s.slot])) for s in seqs if self._lag[s.slot]]
        if not lagging:
            return
        slots, back = [], []
        for slot, k in lagging:
            slots += [slot] * k
            back += range(k, 0, -1)
            self._lag[slot] = 0
        dev = self.device
        slot_t = upload(slots, torch.long, dev)  # [M]
        pos = self.anchor_pos[slot_t] - upload(back, torch.long, dev)  # [M]
        features = self.pending_features[slot_t, pos % self.context_lag]  # [M, m·d]
        self.drafter.append_context(features, pos, slot_t)

    def draft(self, seqs: list[Sequence], *, blocking: bool = True) -> torch.Tensor:
        """Backbone + fused sequential head for ``seqs``; returns the host copy ``[R, γ]`` of the new survivals.

        The drafts and the survivals stay on the device for the next verify. The host copy is for the stale budget
        of later steps and the draft gate: with ``blocking=False`` it is issued without waiting, and lands by the
        next step's token read (on CUDA it overlaps with the next step's work).
        """
        dev = self.device
        if self.context_lag:
            self.catch_up_context(seqs)  # the features of their plain steps, if any, join the context first
        rows = upload([s.slot for s in seqs], torch.long, dev)
        r = len(seqs)
        r_pad = self.draft_graphs.padded(r)
        backend = self.config.kernel_backend
        if self.head_in_graph:  # the graph writes p_d straight into the slots' rows of self.draft_probs
            draft_load(rows, self.anchor, self.anchor_pos, self.temperature, self.request_id, r_pad,
                       self.buffers.draft_inputs(), backend=backend)
            tokens, _, survival = self.draft_graphs.run(r_pad)
            tokens, survival = tokens[:r], survival[:r]  # [R, γ] each
        else:
            draft_load(rows, self.anchor, self.anchor_pos, None, None, r_pad, self.buffers.draft_inputs(),
                       backend=backend)
            (h,) = self.draft_graphs.run(r_pad)  # [R_pad, γ, d]
            out = sample_block(self.ref_drafter, h[:r], self.anchor[rows], self.anchor_pos[rows],
                               self.temperature[rows], self.config.seed, self.request_id[rows],
                               backend=self.config.kernel_backend)
            tokens = out.tokens
            self.draft_probs[rows] = out.probs  # [R, γ, V]
            survival = self._survival(out.conf_logits, self.temperature[rows])
        # Into the slots: the drafts, their survivals, and that a greedy draft's p_d is the one-hot of its token.
        draft_store(rows, tokens, survival, self.temperature, self.draft_tokens, self.draft_onehot, self.survival,
                    backend=backend)
        host = survival.to("cpu", non_blocking=not blocking)  # sync: only when blocking (staleness 0)
        if dev.type == "cuda" and not blocking:
            self._drafts_copied = torch.cuda.Event()
            self._drafts_copied.record()  # after the copy: wait_for_drafts waits for exactly this much of the stream
        return host

    @property
    def draft_copied(self) -> torch.cuda.Event | None:
        """The event recorded after the last non-blocking copy of survivals (None on the CPU, or once waited for): an
        engine with two drafts in flight waits for each one's copy on its own event."""
        return self._drafts_copied

    def wait_for_drafts(self) -> None:
        """Wait until the last draft's host copy of the survivals has landed (it was issued without waiting).

        The next token read waits for it anyway (the copy precedes the verify in the stream); this waits for the
        draft alone, so that host work can read the survivals while the device still verifies."""
        if self._drafts_copied is not None:
            self._drafts_copied.synchronize()  # sync: the draft's copy only, not the verify queued behind it
            self._drafts_copied = None

    def propose(self, seqs: list[Sequence]) -> list[int]:
        """The n-gram proposer's draft stage for ``seqs``: the host lookup (``optimized/ngram.py``) in each request's
        tokens, uploaded into the draft buffers; returns the proposal lengths ``m_r`` (0..γ).

        A proposal's ``p_d`` is the one-hot of its own tokens at any temperature: the rows are flagged in
        ``draft_onehot`` and no ``p_d`` is written.
        """
        g, dev = self.gamma, self.device
        proposals = []
        for s in seqs:
            entry = self._ngram[s.slot]
            if entry is None or entry[0] is not s:  # a slot that changed hands starts afresh
                entry = self._ngram[s.slot] = (s, NgramIndex(self.proposer.config))
            entry[1].sync(s.prompt_ids, s.output_ids)
            proposals.append(entry[1].propose())
        # sync: the upload of the [R, γ] ids is a pageable host→device copy, which waits for the stream — idle here:
        # this step's token read drained it, and brought the very tokens the lookup reads. Slots past m_r hold 0 and
        # are never verified.
        new = torch.tensor([p + [0] * (g - len(p)) for p in proposals], dtype=torch.long, device=dev)  # [R, γ]
        rows = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)  # [R]
        self.draft_tokens[rows] = new
        self.draft_onehot[rows] = True
        return [len(p) for p in proposals]

    @property
    def host_proposals(self) -> bool:
        """Whether the blocks are decided on the host from the committed tokens (the n-gram or the hybrid proposer):
        the engine then drafts after each token read, never ahead of it."""
        return self.proposer is not None or self.hybrid is not None

    def _hybrid_entry(self, seq: Sequence) -> tuple[Sequence, NgramIndex, HybridState]:
        """``seq``'s lookup index and hybrid state (a slot that changed hands starts afresh)."""
        entry = self._hybrid[seq.slot]
        if entry is None or entry[0] is not seq:
            cfg = self.hybrid.config
            entry = self._hybrid[seq.slot] = (seq, NgramIndex(cfg.ngram),
                                              HybridState(cfg, sampling=seq.params.temperature > 0))
        return entry

    def draft_hybrid(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int | None]]:
        """The hybrid proposer's draft stage for ``seqs`` (``reference/hybrid.py``): the drafter stage for all of
        them, then per request the lookup and :meth:`HybridState.choose`, which reads the survivals of the request's
        earlier DSpark draft and keeps this one's; the requests that take the n-gram block get its tokens, one-hot
        ``p_d`` (``draft_onehot``), estimated survivals and length cap in their device rows.

        Returns the host survivals ``[R, γ]`` of the chosen blocks (for the stale budget and the draft gate) and each
        request's n-gram block length ``m`` (None: the drafter's block).
        """
        g, dev = self.gamma, self.device
        # sync: the choice reads the drafter's survivals on the host (as the n-gram lookup, this stage is synchronous)
        dspark = self.draft(seqs, blocking=True)  # [R, γ] host
        rows_dspark = dspark.tolist()  # sync: none, a host tensor
        chosen = dspark.clone()  # [R, γ] host: the drafter's rows, the n-gram rows replaced below
        slots, tokens, lengths = [], [], []
        for i, s in enumerate(seqs):
            _, index, state = self._hybrid_entry(s)
            index.sync(s.prompt_ids, s.output_ids)
            match = index.match()
            proposal = [] if match is None else index.tokens[match[1] + match[0]:match[1] + match[0] + g]
            choice = state.choose(None if match is None else match[0], proposal, rows_dspark[i])
            if choice.source == NGRAM:
                m = len(choice.tokens)
                slots.append(s.slot)
                tokens.append(list(choice.tokens) + [0] * (g - m))  # slots past m are never verified
                chosen[i] = torch.tensor(choice.survival, dtype=torch.float32)
                lengths.append(m)
            else:
                lengths.append(None)
        all_rows = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)  # [R]
        self.proposal_cap[all_rows] = g
        if slots:
            # sync: pageable host→device copies of a few [K, γ] rows; the stream is idle (the token read drained it)
            rows = torch.tensor(slots, dtype=torch.long, device=dev)  # [K]
            self.draft_tokens[rows] = torch.tensor(tokens, dtype=torch.long, device=dev)  # [K, γ]
            self.draft_onehot[rows] = True  # p_d = δ_{x_k}: the draft_probs rows are neither written nor read
            picked = [i for i, m in enumerate(lengths) if m is not None]
            self.survival[rows] = chosen[picked].to(dev)  # [K, γ] a^ng, zero past m
            self.proposal_cap[rows] = torch.tensor([lengths[i] for i in picked], dtype=torch.long, device=dev)
        return chosen, lengths

    def observe_hybrid(self, out: StageOutput) -> list[str]:
        """After a verify's token read: settle each request's hybrid block (``HybridState.observe``: an n-gram block's
        outcome joins its counts). Returns each request's source of the verified block (``"none"`` without one)."""
        return [self._hybrid_entry(s)[2].observe(ell, len(tokens) - 1)
                for s, ell, tokens in zip(out.seqs, out.verified, out.tokens)]

    def _survival(self, conf_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """Calibrated prefix survivals a_k = Π_{j≤k} σ(c_j / T_j + b_j + w_j · log σ(c_j)) with the calibration of
        each row's mode (the same float32 operations, in the same order, as ``reference.calibration.apply_sts``; a
        mode without biases or log weights adds ±0.0, which changes no float: -0.0 becomes +0.0, and σ(±0) is the
        same)."""
        greedy = (temperature == 0)[:, None]
        z = conf_logits.float()  # [R, γ]
        x = z / torch.where(greedy, self.sts["greedy"], self.sts["sampling"])  # [R, γ]
        x = x + torch.where(greedy, self.sts_bias["greedy"], self.sts_bias["sampling"])
        if self.sts_logw is not None:
            w = torch.where(greedy, self.sts_logw["greedy"], self.sts_logw["sampling"])  # [R, γ]
            x = x + w * torch.nn.functional.logsigmoid(z)
        return torch.cumprod(torch.sigmoid(x), dim=1)

    def _bind(self, seqs: list[Sequence]) -> None:
        """Give each of ``seqs``' slots its request id and sampling parameters: one non-blocking upload per field for
        all of them (a Python number written into a CUDA tensor element is a blocking copy, which waits for the whole
        queue: with steps one ahead, a request's arrival would drain the pipeline)."""
        if not seqs:
            return
        dev = self.device
        for seq in seqs:
            self._owner[seq.slot] = seq
            self._lag[seq.slot] = 0  # the previous owner's parked features are never appended
        slots = upload([seq.slot for seq in seqs], torch.long, dev)  # [n]
        # The request word of the random-number contract: the request id, or the request's own seed.
        self.request_id[slots] = upload([s.request_id if s.params.seed is None else s.params.seed for s in seqs],
                                        self.request_id.dtype, dev)
        self.temperature[slots] = upload([s.params.temperature for s in seqs], self.temperature.dtype, dev)
        self.top_p[slots] = upload([s.params.top_p for s in seqs], self.top_p.dtype, dev)
        self.top_k[slots] = upload([s.params.top_k for s in seqs], self.top_k.dtype, dev)

    # ------------------------------------------------------------------------------------------------ dummy steps

    @torch.inference_mode()
    def dummy_verify(self, num_tokens: int, context_len: int, temperature: float = 0.0,
                     num_requests: int | None = None) -> None:
        """One verify stage of ``num_tokens`` tokens for placeholder requests whose anchors sit at ``context_len``.

        ``num_requests`` placeholder requests (slots 0..; default ``min(num_tokens, max_num_seqs)``) share the drafts
        evenly — the top-B allocation of equal survivals — so every query length is 1..γ+1 as in serving. It runs
        :meth:`verify` itself: layout, graph replay, p_t, rejection sampling, the token read. Needs an idle runner.
        """
        self.prepare_dummy_verify(num_tokens, context_len, temperature, num_requests)()

    @torch.inference_mode()
    def prepare_dummy_verify(self, num_tokens: int, context_len: int, temperature: float = 0.0,
                             num_requests: int | None = None, repeat: int = 1) -> Callable[[], None]:
        """:meth:`dummy_verify` in two parts: place the placeholder requests in their slots now (what a request's
        admission does once, not every step), and return the verify stage itself, which a profile times alone.

        ``repeat`` > 1: the stage launched that many times back to back and only the last one's tokens read, as an
        engine one step ahead runs it (:attr:`pipelined`); each launch moves the anchors on by what it emits, so the
        context must leave room for ``repeat - 1`` more blocks. The returned stage takes an optional count
        (1..``repeat``) to launch fewer (a marginal price is the difference of two counts)."""
        if repeat < 1 or context_len + (repeat - 1) * (self.gamma + 1) > self.config.max_seq_len - 2 * self.gamma - 4:
            raise ValueError(f"{repeat} verify stages from context {context_len} do not fit max_seq_len "
                             f"{self.config.max_seq_len} (γ = {self.gamma})")
        r = min(num_tokens, self.config.max_num_seqs) if num_requests is None else num_requests
        if not 1 <= r <= self.config.max_num_seqs:
            raise ValueError(f"num_requests must lie in 1..{self.config.max_num_seqs}, got {r}")
        if num_tokens < r or num_tokens > r * (self.gamma + 1):
            raise ValueError(f"{r} requests carry {r}..{r * (self.gamma + 1)} tokens, got num_tokens={num_tokens}")
        seqs = self._placeholder_decoding(r, context_len, temperature)
        if self.gamma and num_tokens > r:
            self.survival[:r] = 1.0  # equal survivals: ties go by (slot, request), which spreads the drafts evenly
            plan = StepPlan([], seqs, SchedulingMode.ADAPTIVE, budget=num_tokens - r)
        else:
            plan = StepPlan([], seqs, SchedulingMode.NONE, lengths=[0] * r)

        @torch.inference_mode()
        def stage(steps: int = repeat) -> None:
            if not 1 <= steps <= repeat:
                raise ValueError(f"this stage was prepared for 1..{repeat} launches, got {steps}")
            for _ in range(steps - 1):
                self.launch_verify(plan)
            self.verify(plan)

        return stage

    @torch.inference_mode()
    def dummy_draft(self, num_requests: int, context_len: int, temperature: float = 0.0) -> None:
        """One drafter stage (backbone graph + fused head + STS) for ``num_requests`` placeholder requests."""
        self.prepare_dummy_draft(num_requests, context_len, temperature)()

    @torch.inference_mode()
    def prepare_dummy_draft(self, num_requests: int, context_len: int, temperature: float = 0.0,
                            repeat: int = 1) -> Callable[[], None]:
        """:meth:`dummy_draft` in two parts: the placeholders' slot set-up now, the drafter stage returned (``repeat``
        > 1: launched that many times back to back, the last survivals' copy waited for, as :attr:`pipelined`; the
        returned stage takes an optional count, 1..``repeat``, as :meth:`prepare_dummy_verify`'s)."""
        if self.drafter is None:
            raise RuntimeError("this runner has no drafter (mode none)")
        if not 1 <= num_requests <= self.config.max_num_seqs:
            raise ValueError(f"num_requests must lie in 1..{self.config.max_num_seqs}, got {num_requests}")
        if repeat < 1:
            raise ValueError(f"repeat must be ≥ 1, got {repeat}")
        seqs = self._placeholder_decoding(num_requests, context_len, temperature)
        if repeat == 1:
            return torch.inference_mode()(lambda steps=1: self.draft(seqs))

        @torch.inference_mode()
        def stage(steps: int = repeat) -> None:
            if not 1 <= steps <= repeat:
                raise ValueError(f"this stage was prepared for 1..{repeat} launches, got {steps}")
            for _ in range(steps):
                self.draft(seqs, blocking=False)
            self.wait_for_drafts()

        return stage

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every stage once per shape class a real step can take, so that no compilation or autotuning happens
        in a request: prefill of short and long chunks, greedy and sampled, then verify without drafts and with
        every draft, and the drafter, at batch 1, 2 and ``max_num_seqs`` (Triton specialises integer arguments equal
        to 1 or divisible by 16, and the split sampler switches at 64 rows). The captured graphs were warmed by their
        capture. No state is left behind: placeholders only use slot state that a request's first prefill chunk
        overwrites, and nothing reaches the scheduler. Needs an idle runner."""
        self._check_idle()
        cfg = self.config
        prompt_len = max(1, min(WARMUP_PROMPT_LEN, cfg.max_seq_len - 2 * self.gamma - 4))
        for r in sorted({1, min(2, cfg.max_num_seqs), cfg.max_num_seqs}):
            for temperature in (0.0, 1.0):
                seqs = self._placeholders(r, prompt_len, temperature)
                for s in seqs:
                    s.status, s.num_prefilled, s.output_ids = Status.PREFILL, 0, []
                self.prefill([PrefillChunk(s, 0, prompt_len) for s in seqs])
                self.prefill([PrefillChunk(seqs[0], prompt_len - 1, 1)])  # a one-token chunk
                self._release()
                self.dummy_verify(r, prompt_len, temperature)
                if self.drafter is not None:
                    self.dummy_draft(r, prompt_len, temperature)
                if self.gamma:
                    self.dummy_verify(r * (self.gamma + 1), prompt_len, temperature)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # sync: start-up, off the step loop

    def _check_idle(self) -> None:
        if not self.idle:
            raise RuntimeError("dummy steps need an idle engine: their placeholder requests overwrite slot state")

    def _placeholders(self, count: int, context_len: int, temperature: float) -> list[Sequence]:
        """Placeholder sequences in slots 0..count-1 over a prompt of ``context_len`` zeros, bound to their slots."""
        self._check_idle()
        if not 1 <= context_len <= self.config.max_seq_len - 2 * self.gamma - 4:
            raise ValueError(f"context_len must lie in 1..max_seq_len - 2γ - 4 = "
                             f"{self.config.max_seq_len - 2 * self.gamma - 4}, got {context_len}")
        if self._placeholders_cache is None or self._placeholders_cache[0] != context_len:
            prompt = [0] * context_len  # shared by all placeholders, never mutated
            params = SamplingParams(max_new_tokens=self.config.max_seq_len, ignore_eos=True)
            self._placeholders_cache = (context_len, [Sequence(request_id=i, prompt_ids=prompt, params=params, slot=i)
                                                      for i in range(self.config.max_num_seqs)])
        seqs = self._placeholders_cache[1][:count]
        for s in seqs:
            s.params.temperature = temperature
        self._bind(seqs)
        return seqs

    def _placeholder_decoding(self, count: int, context_len: int, temperature: float) -> list[Sequence]:
        """Placeholders that decode: one token emitted after the context, the anchor at ``context_len``."""
        seqs = self._placeholders(count, context_len, temperature)
        for s in seqs:
            s.status, s.output_ids, s.survivals = Status.DECODE, [0], []
        self.anchor[:count] = 0
        self.anchor_pos[:count] = context_len
        self._release()
        return seqs

    def _release(self) -> None:
        """Placeholders leave their slots to real requests (their state is overwritten on a request's first chunk)."""
        self._owner = [None] * self.config.max_num_seqs
