"""Continuous batching for the optimized engine: request state, admission, chunked prefill, finishing.

Implements the host side of docs/method.md §5 in its production form. The host owns the list of sequences and a
slot (a row of the static KV caches) per running sequence; each step it decides

* which waiting sequences are admitted (a free slot and room in the token budget),
* how many prompt tokens each prefilling sequence runs this step (chunked prefill),
* the verify **budget** B of the decoding sequences, from a *stale* host copy of their calibrated prefix
  survivals (``reference.scheduler.best_budget``; the copy is ``staleness`` drafts old, so computing B never
  waits for the device). The per-request allocation ℓ_r = top-B of the *current* survivals happens on the
  device (``optimized.kernels.allocate``).

Names follow ``docs/method.md`` (``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size).
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from reference.config import SchedulerConfig


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet (no slot)
    PREFILL = "prefill"  # admitted, prompt not fully in the cache yet
    DECODE = "decode"  # has an anchor and a draft; takes part in speculative steps
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """Per-request decoding parameters (the server fills these from the request body)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()  # stop strings (checked on the decoded text; the stop string is cut off)
    ignore_eos: bool = False
    logprobs: bool = False  # return the target log-probability of every emitted token
    # With logprobs: log-probabilities of the target's own distribution (log-softmax of its logits, what OpenAI and
    # vLLM report) instead of log p_t, the temperature-scaled and filtered distribution the token is drawn from
    # (which is one-hot, log-probability 0, for greedy decoding).
    raw_logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens per position, from the same distribution
    # Keys this request's random numbers in place of its request id (the contract's request word, < 2³¹): the same
    # seed, prompt and parameters give the same tokens whatever else runs. None: keyed by the request id.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and self.temperature == self.temperature and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0, got {self.top_k}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be ≥ 0, got {self.top_logprobs}")
        if (self.top_logprobs or self.raw_logprobs) and not self.logprobs:
            raise ValueError("top_logprobs and raw_logprobs need logprobs=True")
        if self.seed is not None and not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must lie in [0, 2³¹) (the request word of the random contract), got {self.seed}")


@dataclass
class Sequence:
    """One request as the engine sees it."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    status: Status = Status.WAITING
    slot: int = -1
    num_prefilled: int = 0  # prompt tokens already in the KV cache
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # [(token, logprob)] per position
    finish_reason: str | None = None
    verify_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    survivals: list[torch.Tensor] = field(default_factory=list)  # host copies [γ], one per draft
    text_offset: int = 0  # for stop strings: decoded characters already checked

    @property
    def anchor_pos(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class BatchScheduler:
    """Admission and prefill planning over a fixed number of slots (the engine's ``max_num_seqs``)."""

    def __init__(self, config: SchedulerConfig, max_num_seqs: int, max_seq_len: int, prefill_chunk: int) -> None:
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk  # prompt tokens per step over all prefilling sequences
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in slot order of admission
        self.free_slots = list(range(max_num_seqs))[::-1]
        self._ids = itertools.count()

    def add(self, seq: Sequence) -> None:
        if len(seq.prompt_ids) + 1 > self.max_seq_len:
            raise ValueError(f"prompt of {len(seq.prompt_ids)} tokens does not fit max_seq_len {self.max_seq_len}")
        self.waiting.append(seq)

    def abort(self, request_id: int) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)

    def admit(self) -> None:
        """Give free slots to waiting sequences, first come first served."""
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = Status.PREFILL
            self.running.append(seq)

    def plan_prefill(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of prompt tokens to run) for this step, within the chunk budget."""
        budget, plan = self.prefill_chunk, []
        for seq in self.running:
            if seq.status is not Status.PREFILL or budget <= 0:
                continue
            n = min(len(seq.prompt_ids) - seq.num_prefilled, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.status is Status.DECODE]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class BudgetPlanner:
    """The host half of the ``adaptive`` mode, vectorised: the twin of ``reference.scheduler.stale_budget``.

    The reference walks ``B = 0..R·γ`` in Python and asks the cost table for every step time; at R = 256 that
    is 1,800 table lookups per step on the host. Here the step-time curve is cached per ``(T_0, R)`` (the
    table is fixed for the engine's life) and Θ(B) for every B is one float64 cumulative sum. The result is
    the same integer: τ(B) is accumulated in the same order and precision (float64, sequential cumsum on the
    host), so ties resolve identically (the smaller B), as ``tests/optimized/test_budget.py`` checks.

    This runs on the host every step, so it is written in NumPy on the CPU copy of the survivals: about a
    microsecond per NumPy call against several for each small torch op. On the project's 2-core CPU
    (2026-11-29, 300 calls of ``budget(torch.stack(rows), R, R)`` after a warm-up) a plan took 130 / 140 /
    220 µs at R = 1 / 16 / 256 with torch ops and 31 / 35 / 96 µs in NumPy. Rows with NaN (requests too new to
    have stale survivals) take the reference's own fill, in torch, so the filled values are bit-identical.
    """

    def __init__(self, cost) -> None:
        self.cost = cost
        self._curves: dict[tuple[int, int, int], np.ndarray] = {}

    def _step_times(self, t0: int, r: int, candidates: int) -> np.ndarray:
        key = (t0, r, candidates)
        curve = self._curves.get(key)
        if curve is None:
            curve = np.array([self.cost.step_time(t0 + b, r) for b in range(candidates + 1)],
                             dtype=np.float64)  # [R·γ + 1] seconds
            if len(self._curves) > 4096:  # bounded: (T_0, R) pairs are few in steady state
                self._curves.clear()
            self._curves[key] = curve
        return curve

    def budget(self, a_stale: torch.Tensor, num_anchor_tokens: int, num_requests: int | None = None) -> int:
        return int(np.argmax(self._theta(a_stale, num_anchor_tokens, num_requests)))  # first max = smaller B on ties

    def speculation_pays(self, a_latest: torch.Tensor, num_anchor_tokens: int, num_requests: int | None = None,
                         margin: float = 0.0) -> bool:
        """The twin of ``reference.scheduler.speculation_pays`` (the draft gate): same Θ values, same comparison."""
        n_s = a_latest.shape[0] if num_requests is None else num_requests
        plain = self.cost.verify_time(num_anchor_tokens)
        theta_plain = n_s / plain if plain > 0 else 0.0
        return bool((1.0 + margin) * float(self._theta(a_latest, num_anchor_tokens, num_requests).max()) >= theta_plain)

    def _theta(self, a_stale: torch.Tensor, num_anchor_tokens: int, num_requests: int | None) -> np.ndarray:
        """Θ(B) for B = 0..R·γ along the global ranking, as the reference's ``_throughput_curve``."""
        from reference.scheduler import _MONOTONE_TOL, fill_stale_rows

        # [R, γ] host copy kept by the engine (no device read happens here).
        a = a_stale.detach().to("cpu", torch.float32)  # sync: none in practice, a_stale already lives on the host
        if a.dim() != 2 or a.shape[0] == 0 or a.shape[1] == 0:
            raise ValueError(f"a_stale must be a non-empty [R, γ] matrix, got {tuple(a.shape)}")
        arr = a.numpy()
        if np.isnan(arr).any():
            arr = fill_stale_rows(a).numpy()  # the reference's fill (and its checks), bit for bit
        else:  # the reference's checks of fill_stale_rows, in float64 as it does them
            a64 = arr.astype(np.float64)
            if not ((a64 >= 0) & (a64 <= 1)).all():
                raise ValueError("a_stale must lie in [0, 1] (NaN is not allowed)")
            if a64.shape[1] > 1 and (np.diff(a64, axis=1) > _MONOTONE_TOL).any():
                raise ValueError("a_stale must be non-increasing along the slot axis (prefix survivals); "
                                 "pass confidences through prefix_survival first")
        r, g = arr.shape
        n_s = r if num_requests is None else num_requests
        gains = np.sort(arr.ravel())[::-1].astype(np.float64)  # [R·γ] descending (equal values: order immaterial)
        tau = np.cumsum(np.concatenate(([float(n_s)], gains)))  # [R·γ+1] sequential, as torch's CPU cumsum
        step = self._step_times(num_anchor_tokens, r, r * g)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(step > 0, tau / np.maximum(step, 1e-300), 0.0)  # [R·γ + 1]
