"""Request state: one ``Sequence`` per request, its ``SamplingParams``, its ``Status``, and what a step emits for it.

The engine's three rooms talk through these objects: the scheduler (``optimized/scheduler.py``) moves a sequence
through its statuses and owns its host bookkeeping, the model runner (``optimized/runner.py``) reads its slot, prompt
and parameters, and the engine (``optimized/engine.py``) hands ``StepOutput`` and ``StepStats`` to the caller. Names
follow ``docs/method.md`` (``ℓ`` verify length, ``a`` prefix survival, ``γ`` block size).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from reference.config import GenerationConfig, check_sampling


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet (no slot)
    PREFILL = "prefill"  # admitted, prompt not fully in the cache yet
    DECODE = "decode"  # has an anchor (and drafts while the gate is open); takes part in speculative steps
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
        check_sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be ≥ 0, got {self.top_logprobs}")
        if (self.top_logprobs or self.raw_logprobs) and not self.logprobs:
            raise ValueError("top_logprobs and raw_logprobs need logprobs=True")
        if self.seed is not None and not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must lie in [0, 2³¹) (the request word of the random contract), got {self.seed}")

    @classmethod
    def from_generation(cls, gen: GenerationConfig) -> SamplingParams:
        """The parameters of a ``GenerationConfig`` (the reference loop's per-batch settings) for one request."""
        return cls(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                   ignore_eos=gen.ignore_eos)


@dataclass
class Sequence:
    """One request as the engine sees it."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    status: Status = Status.WAITING
    slot: int = -1  # row of the static caches, while admitted
    num_prefilled: int = 0  # prompt tokens already planned into the KV cache
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # [(token, logprob)] per position
    finish_reason: str | None = None
    verify_lengths: list[int] = field(default_factory=list)  # ℓ of every verify step
    accepted_lengths: list[int] = field(default_factory=list)  # accepted drafts of every verify step
    survivals: list[np.ndarray] = field(default_factory=list)  # host copies [γ] float32 of a_k, one per draft
    proposal_len: int | None = None  # the n-gram proposer's current block length m (ℓ ≤ m); None: a full γ block
    proposal_sources: list[str] = field(default_factory=list)  # hybrid: each verify's block source (reference/hybrid)

    @property
    def anchor_pos(self) -> int:
        """Absolute position of the anchor x_0 (the last emitted token)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request (for streaming). Slotted: the engine makes one per request a step."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # [(token, logprob)] per token


@dataclass
class StepStats:
    """What the last :meth:`optimized.engine.Engine.step` did, for metrics (a server's live calibration error, its
    dashboards). It lives here, beside ``StepOutput``, because it crosses the engine process's pipe every step: an API
    server that unpickles it imports this module (NumPy), not the engine (torch, Triton).

    The per-request lists are aligned with ``request_ids``: the requests that verified this step, in batch order.
    """

    step_time_s: float  # host wall time of the step
    num_running: int  # admitted requests after the step (prefilling or decoding)
    num_waiting: int  # requests still waiting for a slot after the step
    num_decoding: int  # requests that verified this step (R)
    verify_tokens: int  # tokens in the verify forward, N = R + Σℓ (0 when nobody decoded)
    budget: int | None  # the adaptive modes' planned draft budget Σℓ (B); None in other modes or with the gate closed
    drafted: bool  # whether the drafter ran in this step (for the next step's verify); False when the gate skipped it
    verified: list[int]  # ℓ_r of each decoding request
    accepted: list[int]  # accepted drafts of each decoding request
    predicted_survival: list[list[float]]  # the calibrated a_{r,1..ℓ_r} of each request's verified slots ([] if none)
    request_ids: list[int]  # the decoding requests, in the order of the lists above
    # The step verified no drafts because the adaptive mode's draft gate had closed (None: not reported; a consumer
    # then infers it from the previous step's ``drafted``, which only holds for an engine that reads every step).
    gate_closed: bool | None = None
    # Per kind of step ("plain", "speculative"): measured time over the cost table's price minus one, and the price
    # multiplier the gate uses now (EngineConfig.cost_feedback; None when off or before enough steps).
    cost_drift: dict[str, float | None] | None = None
    price_scales: dict[str, float] | None = None
