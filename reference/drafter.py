"""The DSpark drafter: parallel backbone with target-context KV injection, sequential head, confidence head.

Implements ``docs/method.md`` §1. Names follow docs/method.md: ``p_t`` target, ``p_d`` draft, ``a`` prefix
survival, ``ℓ`` verify length, ``γ`` block size, ``x_0`` the anchor, ``U_k`` base logits, ``B_k`` the
sequential head's bias, ``c_k`` confidence (returned here as its logit ``z_k``; STS calibrates it).

One drafting step for a request whose anchor ``x_0`` sits at absolute position ``p``::

    H_ctx   = RMSNorm(W_c · concat(H^(l1..lm)))          target features at positions < p
    block   = [x_0, M, …, M]                              γ inputs at positions p..p+γ-1
    h_1..γ  = backbone(block; keys/values += k/v_proj(H_ctx))   non-causal inside the block
    U_k     = lm_head(h_k)                                the target's LM head, shared and frozen
    B_k     = W2(W1[x_{k-1}])  (Markov)  or an RNN over the prefix; 0 for the parallel-only ablation
    p_d,k   = softmax(U_k + B_k),   z_k = w·[h_k; W1[x_{k-1}]] + b,   c_k = σ(z_k)

With a draft vocabulary (``DrafterConfig.draft_vocab_size`` = Vd > 0) the drafter proposes only the Vd token ids of
its ``draft_vocab`` buffer (ascending): ``U_k`` and ``B_k`` are computed for those rows of the LM head and of W2
only, the softmax and the draw run over them (lane j of the draw is token ``draft_vocab[j]``), and ``p_d`` is 0 for
every other token. Verification reads that ``p_d`` like any other, so decoding stays lossless; what is lost is only
acceptance where the target's token lies outside the subset. Training and the teacher-forced heads
(:meth:`DSparkDrafter.head_logits`) keep the whole vocabulary.

Only the sequential head is serial (``sample_block``); the backbone runs once per step. The classes go
from leaf to root, as in nanoGPT's ``model.py``: RMSNorm, rotary helpers, Attention, MLP, Layer, the heads,
the context cache and finally :class:`DSparkDrafter`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference import sampling
from reference.config import DrafterConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32 like HF Llama/Qwen."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Rotary position embedding, HF Llama convention (rotate_half, inv_freq = θ^(-2i/D)). The context keys must
# be rotated exactly like the target would rotate them, because they are the target's positions.
# ---------------------------------------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin tables for absolute ``positions`` [..., T] -> two tensors [..., T, D].

    Computed in float32 on the fly (not a buffer): a buffer would be cast to bf16 by ``.to(dtype)`` and
    lose the precision that large positions need.
    """
    # 1 / θ^(2i/D), spelled as HF spells it: θ^(-2i/D) rounds differently, and at position ~2000 the ulp of
    # inv_freq already moves the angle by 1e-5.
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim  # [D/2]
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, D] by the tables ``cos``/``sin`` [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D], broadcast over heads
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention whose keys/values are the injected context followed by the block itself.

    Queries come only from the block. The context K/V are produced by this layer's own ``k_proj``/
    ``v_proj`` from ``H_ctx`` (:meth:`project_kv`) and may be computed once and cached across steps.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, H, Hkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(d, H * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, Hkv * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, Hkv * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        # Qwen3 normalises every query/key head before RoPE; Llama and Qwen2 do not.
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE'd at ``positions``) and values of ``x`` [B, T, d] -> two tensors [B, Hkv, T, D]."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, k.dtype)  # [B, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        return k, v.transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Attend from the block tokens to [context; block].

        Args:
            x: block hidden states [B, Q, d] (Q = all block tokens of a row, several blocks when packed).
            positions: their absolute positions [B, Q].
            ctx_k, ctx_v: this layer's context keys/values [B, Hkv, S, D] (keys already RoPE'd).
            mask: boolean [B, 1, Q, S + Q], True where the query may attend.
        """
        B, Q, _ = x.shape
        q = self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)  # [B, Q, H, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)  # [B, Q, D]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, Q, D]
        k, v = self.project_kv(x, positions)  # [B, Hkv, Q, D]
        k = torch.cat((ctx_k, k), dim=2)  # [B, Hkv, S + Q, D]
        v = torch.cat((ctx_v, v), dim=2)  # [B, Hkv, S + Q, D]
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [B, H, S + Q, D]: query head i reads kv head i // group
        v = v.repeat_interleave(group, dim=1)  # [B, H, S + Q, D]
        # Every query sees at least its own block, so no row is fully masked (which would give NaN).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, Q, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward of the target's shape: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One pre-norm backbone layer: x + attn(norm(x)), then x + mlp(norm(x)). HF parameter names."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------------------
# Sequential heads. Both add a bias B_k = W2·x_seq,k to the base logits, where x_seq,k is W1[x_{k-1}] for the
# Markov head and tanh(o_k) of a small recurrent cell for the RNN head. Teacher forcing (training) and
# left-to-right sampling (inference) run the same arithmetic (DSparkDrafter.head_features / sample_block).
# W2 starts at zero, so a fresh drafter is exactly its parallel-only self (B = 0); W2's gradient
# dL/dB ⊗ W1[x] is non-zero from the first step, and W1 is trained through the confidence head meanwhile.
# ---------------------------------------------------------------------------------------------------------


class MarkovHead(nn.Module):
    """B_k = W2(W1[x_{k-1}]): a low-rank bigram bias, the same W1, W2 for every slot (docs/method.md §1).

    Two parameterisations of the same bias (``DrafterConfig.markov_factored``):

    * full tables (the paper's): ``W1 = Embedding(V, r)``, ``W2 = Linear(r, V)``; ``2·V·r`` parameters
      (6.3 M for SmolLM2 at r = 64, most of a 2-layer drafter);
    * factored through the target's frozen embedding ``E`` and LM head ``W_lm``: ``W1 = A(E)`` and
      ``W2 = W_lm·P`` with ``A: d → r`` (``w1_proj``) and ``P: r → d`` (``w2_proj``); ``2·d·r`` parameters.
      Then ``U_k + B_k = lm_head(h_k + P·W1[x_{k-1}])``: the bias is a vector added to ``h_k`` before the
      LM head, so training needs no second V-wide product. The tables exist only at inference, materialised
      once by :meth:`DSparkDrafter.markov_tables` (the engine's fused draft kernel and the reference loop
      read the same tables, so both draw from bit-identical logits).

    The target's modules belong to :class:`DSparkDrafter`, so it computes ``W1[x]`` and the factored bias
    (``prev_embedding``, ``head_features``); this class only holds the parameters.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        r, d = config.markov_rank, config.hidden_size
        self.factored = config.markov_factored
        if self.factored:
            # A ~ N(0, 1/d·σ_E²) would make A(E[x]) unit-scale; σ_E is unknown until a target is attached, so
            # A ~ N(0, 1/d) here and W1's scale is learned. P starts at zero: B = 0 at init, as W2 = 0 below.
            self.w1_proj = nn.Linear(d, r, bias=False)
            nn.init.normal_(self.w1_proj.weight, std=d ** -0.5)
            self.w2_proj = nn.Linear(r, d, bias=False)
            nn.init.zeros_(self.w2_proj.weight)
            return
        # W1 ~ N(0, 1) (nn.Embedding's default): unit-scale entries, like the RMS-normalised h_k they sit
        # next to in the confidence head's input.
        self.w1 = nn.Embedding(config.vocab_size, r)
        self.w2 = nn.Linear(r, config.vocab_size, bias=False)
        nn.init.zeros_(self.w2.weight)


class RNNHead(nn.Module):
    """Gated recurrent bias (docs/method.md §1 variant): z_k = [s_{k-1}; W1[x_{k-1}]; h_k] -> (g, c, o),
    s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c), B_k = W2·tanh(o), s_0 = 0."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        r, d = config.markov_rank, config.hidden_size
        self.rank = r
        self.w1 = nn.Embedding(config.vocab_size, r)  # N(0, 1), as in the Markov head
        self.cell = nn.Linear(r + r + d, 3 * r)
        self.w2 = nn.Linear(r, config.vocab_size, bias=False)
        nn.init.zeros_(self.w2.weight)

    def initial_state(self, h: torch.Tensor) -> torch.Tensor:
        """s_0 = 0 [.., r] for a slot's hidden state h [.., d]."""
        return h.new_zeros(*h.shape[:-1], self.rank)

    def step(self, e_prev: torch.Tensor, h_k: torch.Tensor, state: torch.Tensor):
        """One slot: (W1[x_{k-1}] [.., r], h_k [.., d], s_{k-1}) -> (tanh(o_k) [.., r], s_k); B_k = W2·tanh(o_k)."""
        z = torch.cat((state, e_prev, h_k), dim=-1)  # [.., 2r + d]
        g, c, o = self.cell(z).chunk(3, dim=-1)  # each [.., r]
        gate = torch.sigmoid(g)
        state = gate * state + (1 - gate) * torch.tanh(c)  # [.., r]
        return torch.tanh(o), state

    def teacher_forced_inputs(self, e_prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e_prev [.., γ, r], h [.., γ, d] -> tanh(o) [.., γ, r], the W2 inputs; serial over γ (cheap: γ ≈ 7)."""
        state, outs = self.initial_state(h[..., 0, :]), []
        for k in range(h.shape[-2]):
            out, state = self.step(e_prev[..., k, :], h[..., k, :], state)
            outs.append(out)
        return torch.stack(outs, dim=-2)


@dataclass
class DraftOutput:
    """One drafting step for R requests."""

    tokens: torch.Tensor  # [R, γ] int64: x_1..x_γ
    probs: torch.Tensor  # [R, γ, V] float32: p_d, the exact distribution each x_k was drawn from
    conf_logits: torch.Tensor  # [R, γ] float32: z_k, uncalibrated; c_k = σ(z_k / T_k) after STS


def block_attention_mask(anchor_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
                         gamma: int) -> torch.Tensor:
    """Who may attend to whom when nb blocks of γ tokens are packed after S context tokens.

    A block token sees valid context positions strictly before its anchor (the anchor's own target
    features do not exist at draft time) and every token of its own block (non-causal); never another
    block. Context tokens are never queries, so they have no rows.

    Args:
        anchor_pos: [B, nb] absolute positions of the anchors.
        ctx_pos: [B, S] absolute positions of the context tokens.
        ctx_valid: [B, S] bool, False for padding.
        gamma: block size γ.

    Returns:
        Boolean mask [B, 1, nb·γ, S + nb·γ], True = may attend.
    """
    B, nb = anchor_pos.shape
    q_anchor = anchor_pos.repeat_interleave(gamma, dim=1)  # [B, Q]: the anchor of each query's block
    sees_ctx = ctx_valid[:, None, :] & (ctx_pos[:, None, :] < q_anchor[:, :, None])  # [B, Q, S]
    block_id = torch.arange(nb, device=anchor_pos.device).repeat_interleave(gamma)  # [Q]
    sees_block = (block_id[:, None] == block_id[None, :]).expand(B, -1, -1)  # [B, Q, Q]
    return torch.cat((sees_ctx, sees_block), dim=-1).unsqueeze(1)  # [B, 1, Q, S + Q]


class ContextCache:
    """Per-request projected context K/V of every backbone layer, appended as tokens get verified.

    Only the context is cached (docs/method.md §1): the block's own K/V change every step and are recomputed.
    Create one with :meth:`DSparkDrafter.new_context_cache`.
    """

    def __init__(self, drafter: DSparkDrafter) -> None:
        self._drafter = drafter
        cfg, p = drafter.config, drafter.context_proj.weight
        empty = p.new_zeros(cfg.num_key_value_heads, 0, cfg.head_dim)  # [Hkv, 0, D]
        self.keys = [empty] * cfg.num_layers  # per layer [Hkv, n, D], RoPE'd at the context positions
        self.values = [empty] * cfg.num_layers  # per layer [Hkv, n, D]
        self.positions = torch.zeros(0, dtype=torch.long, device=p.device)  # [n]

    @property
    def length(self) -> int:
        """Number of cached context positions."""
        return int(self.positions.numel())

    @torch.no_grad()
    def append(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Add target features [n, m·d] at absolute ``positions`` [n] (increasing, past the cached ones)."""
        cfg = self._drafter.config
        if features.dim() != 2 or features.shape[1] != cfg.num_taps * cfg.hidden_size:
            raise ValueError(f"features must be [n, m·d] = [n, {cfg.num_taps * cfg.hidden_size}], "
                             f"got {list(features.shape)}")
        positions = positions.to(device=self.positions.device, dtype=torch.long)
        if positions.shape != (features.shape[0],):
            raise ValueError(f"positions must be [n] = [{features.shape[0]}], got {list(positions.shape)}")
        if positions.numel() == 0:
            return
        if (positions[1:] <= positions[:-1]).any():
            raise ValueError("positions must be strictly increasing")
        if self.length and positions[0] <= self.positions[-1]:
            raise ValueError(f"position {int(positions[0])} is not beyond the cached ones "
                             f"(last cached {int(self.positions[-1])})")
        h_ctx = self._drafter.project_context(features)[None]  # [1, n, d]
        for i, layer in enumerate(self._drafter.layers):
            k, v = layer.self_attn.project_kv(h_ctx, positions[None])  # [1, Hkv, n, D]
            self.keys[i] = torch.cat((self.keys[i], k[0]), dim=1)
            self.values[i] = torch.cat((self.values[i], v[0]), dim=1)
        self.positions = torch.cat((self.positions, positions))


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless ``ids`` is a valid draft vocabulary: a non-empty 1-d int64 tensor of distinct token
    ids in ``[0, vocab_size)``, ascending (lane order = token order, so ties of the draft's argmax and race resolve
    to the lowest token id, as over the whole vocabulary)."""
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype != torch.long:
        raise ValueError(f"a draft vocabulary is a non-empty 1-d int64 tensor of token ids, got {ids.dtype} "
                         f"{list(ids.shape)}")
    ids = ids.detach().cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be distinct and ascending")


class DSparkDrafter(nn.Module):
    """The drafter of docs/method.md §1. The target's embedding and LM head are attached, never owned."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d, m = config.hidden_size, config.num_taps
        self.context_proj = nn.Linear(m * d, d, bias=False)  # W_c
        self.context_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(d, config.rms_norm_eps)
        if config.mask_token_id is None:
            # The target has no spare vocabulary row for M: learn one vector. Drawn N(0, 1) here and rescaled
            # to the embedding table's std by the first attach_target (the table is unknown until then).
            self.mask_embedding = nn.Parameter(torch.randn(d))
        self._mask_init_pending = config.mask_token_id is None
        # Loaded weights must never be rescaled by a later attach_target.
        self.register_load_state_dict_post_hook(DSparkDrafter._loaded_hook)
        r = config.markov_rank
        self.seq_head: MarkovHead | RNNHead | None = None  # "none": the parallel-only ablation, B = 0
        if config.head == "markov":
            self.seq_head = MarkovHead(config)
        elif config.head == "rnn":
            self.seq_head = RNNHead(config)
        # The confidence head reads [h_k; W1[x_{k-1}]]; with no sequential head there is no W1, only h_k.
        self.conf_head = nn.Linear(d + (0 if self.seq_head is None else r), 1)
        self._init_weights()
        self._tables_cache: tuple | None = None  # materialised factored Markov tables (markov_tables)
        self._vocab_cache: tuple | None = None  # the draft vocabulary's LM-head and W2 rows (draft_tables)
        # The draft vocabulary: Vd ascending token ids, a buffer so that checkpoints carry it (restrict_vocab sets
        # it; the identity until then). None: the whole vocabulary.
        self.draft_vocab: torch.Tensor | None
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        # A tuple, not attributes: nn.Module would register the target's modules as submodules, putting
        # them into state_dict, parameters() and the drafter's optimiser.
        self._target: tuple[nn.Module, nn.Module] | None = None

    def _init_weights(self) -> None:
        # HF's initializer_range 0.02 for the backbone (nanoGPT does the same); W1 keeps N(0, 1), W2 stays 0.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith(("w2", "w1_proj", "w2_proj")):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @staticmethod
    def _loaded_hook(module: DSparkDrafter, incompatible_keys) -> None:
        module._mask_init_pending = False
        if module.draft_vocab is not None:
            check_draft_vocab(module.draft_vocab, module.config.vocab_size)

    def restrict_vocab(self, token_ids: torch.Tensor | list[int]) -> DSparkDrafter:
        """This drafter proposing only ``token_ids`` (a draft vocabulary; module docstring): a copy whose config has
        ``draft_vocab_size = len(token_ids)`` and whose ``draft_vocab`` holds them in ascending order. The weights
        are shared in value (copied), the attached target stays attached."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        check_draft_vocab(ids, self.config.vocab_size)
        param = next(self.parameters())
        restricted = DSparkDrafter(replace(self.config, draft_vocab_size=int(ids.numel())))
        restricted = restricted.to(device=param.device, dtype=param.dtype)
        state = {k: v for k, v in self.state_dict().items() if k != "draft_vocab"} | {"draft_vocab": ids}
        restricted.load_state_dict(state, strict=True)
        if self._target is not None:
            restricted.attach_target(*self._target)
        return restricted.train(self.training)

    # --- the target's shared modules ---------------------------------------------------------------------

    def attach_target(self, embed_tokens: nn.Embedding, lm_head: nn.Module) -> None:
        """Share the target's (frozen) embedding and LM head. They are not stored, saved or trained here."""
        if embed_tokens.weight.shape[0] < self.config.vocab_size:
            raise ValueError(f"embedding has {embed_tokens.weight.shape[0]} rows, the drafter's vocabulary is "
                             f"{self.config.vocab_size}")
        if embed_tokens.weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"embedding width {embed_tokens.weight.shape[1]} != drafter hidden size "
                             f"{self.config.hidden_size}")
        self._target = (embed_tokens, lm_head)
        if self._mask_init_pending:
            with torch.no_grad():
                self.mask_embedding.mul_(embed_tokens.weight.float().std().to(self.mask_embedding.dtype))
            self._mask_init_pending = False

    def target_modules(self) -> tuple[nn.Module, nn.Module]:
        """The attached target's ``(embed_tokens, lm_head)``; raises if none is attached."""
        if self._target is None:
            raise RuntimeError("no target attached: call attach_target(embed_tokens, lm_head) first")
        return self._target

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target_modules()[0](tokens).to(self.context_proj.weight.dtype)

    def base_logits(self, h: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """U = lm_head(h) in float32; h is cast to the LM head's dtype (the target may run in bf16).

        ``float32=False`` leaves U in the LM head's dtype, the same values before the exact upcast: for a consumer
        that upcasts as it reads (the fused draft kernels), without a float32 copy of ``[R, γ, V]``.
        """
        lm_head = self.target_modules()[1]
        weight = next(lm_head.parameters(), None)
        u = lm_head(h if weight is None else h.to(weight.dtype))
        return u.float() if float32 else u

    def block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[x_0, M, …, M] embedded: anchor_ids [...] -> [..., γ, d]."""
        x0 = self._embed(anchor_ids)  # [..., d]
        if self.config.mask_token_id is None:
            mask = self.mask_embedding.to(x0.dtype)
        else:
            mask = self._embed(torch.tensor(self.config.mask_token_id, device=anchor_ids.device))
        masks = mask.expand(*x0.shape[:-1], self.config.block_size - 1, x0.shape[-1])  # [..., γ-1, d]
        return torch.cat((x0.unsqueeze(-2), masks), dim=-2)  # [..., γ, d]

    # --- the parallel backbone -----------------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c · concat(H^(l1..lm))): features [..., S, m·d] -> [..., S, d]."""
        expected = self.config.num_taps * self.config.hidden_size
        if features.shape[-1] != expected:
            raise ValueError(f"context features must have m·d = {expected} channels, got {features.shape[-1]}")
        return self.context_norm(self.context_proj(features.to(self.context_proj.weight.dtype)))

    def _backbone(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                  mask: torch.Tensor) -> torch.Tensor:
        """Block embeddings x [B, Q, d] at positions [B, Q] -> h [B, Q, d] (after the final norm)."""
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, positions, ctx_k, ctx_v, mask)
        return self.final_norm(x)

    def forward(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, ctx_features: torch.Tensor,
                ctx_pos: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Training forward: nb blocks per sequence, packed under :func:`block_attention_mask`.

        Args:
            anchor_ids: [B, nb] int64, the anchors x_0.
            anchor_pos: [B, nb] int64, their absolute positions p.
            ctx_features: [B, S, m·d], the target's tapped features.
            ctx_pos: [B, S] int64, absolute positions of the context tokens.
            ctx_valid: [B, S] bool, False for padding.

        Returns:
            h [B, nb, γ, d]; slot k (index k-1) of a block predicts the token at p + k.
        """
        B, nb = anchor_ids.shape
        S, gamma = ctx_features.shape[1], self.config.block_size
        if anchor_pos.shape != (B, nb):
            raise ValueError(f"anchor_pos must be [B, nb] = {[B, nb]}, got {list(anchor_pos.shape)}")
        if ctx_features.dim() != 3 or ctx_features.shape[0] != B:
            raise ValueError(f"ctx_features must be [B, S, m·d] with B = {B}, got {list(ctx_features.shape)}")
        if ctx_pos.shape != (B, S) or ctx_valid.shape != (B, S):
            raise ValueError(f"ctx_pos and ctx_valid must be [B, S] = {[B, S]}, got {list(ctx_pos.shape)} "
                             f"and {list(ctx_valid.shape)}")
        x = self.block_embeddings(anchor_ids).reshape(B, nb * gamma, -1)  # [B, Q, d], Q = nb·γ
        offsets = torch.arange(gamma, device=anchor_pos.device)
        positions = (anchor_pos[..., None] + offsets).reshape(B, nb * gamma)  # [B, Q]
        h_ctx = self.project_context(ctx_features)  # [B, S, d]
        ctx_kv = [layer.self_attn.project_kv(h_ctx, ctx_pos) for layer in self.layers]  # per layer [B, Hkv, S, D]
        mask = block_attention_mask(anchor_pos, ctx_pos, ctx_valid.bool(), gamma)  # [B, 1, Q, S + Q]
        h = self._backbone(x, positions, ctx_kv, mask)  # [B, Q, d]
        return h.view(B, nb, gamma, -1)

    def new_context_cache(self) -> ContextCache:
        return ContextCache(self)

    @torch.no_grad()
    def backbone_cached(self, anchor_id: int, anchor_pos: int, cache: ContextCache) -> torch.Tensor:
        """Inference backbone for one request: the cached context (positions < anchor_pos) -> h [γ, d]."""
        gamma, device = self.config.block_size, cache.positions.device
        x = self.block_embeddings(torch.tensor([int(anchor_id)], device=device))  # [1, γ, d]
        positions = (int(anchor_pos) + torch.arange(gamma, device=device))[None]  # [1, γ]
        sees_ctx = (cache.positions < int(anchor_pos)).expand(gamma, -1)  # [γ, n]
        sees_block = torch.ones(gamma, gamma, dtype=torch.bool, device=device)  # [γ, γ]
        mask = torch.cat((sees_ctx, sees_block), dim=-1)[None, None]  # [1, 1, γ, n + γ]
        ctx_kv = [(k[None], v[None]) for k, v in zip(cache.keys, cache.values, strict=True)]  # [1, Hkv, n, D]
        return self._backbone(x, positions, ctx_kv, mask)[0]

    # --- the heads -------------------------------------------------------------------------------------------

    def conf_logits(self, h_k: torch.Tensor, e_prev: torch.Tensor | None) -> torch.Tensor:
        """z_k = w·[h_k; W1[x_{k-1}]] + b: h_k [.., d], e_prev [.., r] | None -> [..] float32. Never sees x_k."""
        z = h_k if e_prev is None else torch.cat((h_k, e_prev), dim=-1)
        return self.conf_head(z).squeeze(-1).float()

    def prev_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """W1[x]: tokens [...] int64 -> [..., r] (the full table, or ``A·E[x]`` when factored)."""
        head = self.seq_head
        if head is None:
            raise RuntimeError("the parallel-only drafter has no W1")
        if getattr(head, "factored", False):
            return head.w1_proj(self._embed(tokens))
        return head.w1(tokens)

    def head_features(self, h: torch.Tensor, prev_tokens: torch.Tensor):
        """The inputs of the draft logits, teacher forced: ``U + B = lm_head(x_lm) + W2(x_seq)``.

        Args:
            h: backbone output [.., γ, d].
            prev_tokens: [.., γ] int64, x_{k-1} for each slot.

        Returns:
            ``(x_lm [.., γ, d], x_seq [.., γ, r] | None, e_prev [.., γ, r] | None)``. ``x_lm`` feeds the
            target's LM head (``h``, or ``h + P·W1[x_{k-1}]`` for the factored Markov head), ``x_seq`` feeds
            the full ``W2`` table (``W1[x_{k-1}]`` for the Markov head, ``tanh(o_k)`` for the RNN head; None
            otherwise), ``e_prev = W1[x_{k-1}]`` feeds the confidence head. The fast trainer's fused LM-head
            loss (``optimized/training.py``) consumes exactly these.
        """
        if prev_tokens.shape != h.shape[:-1] or h.shape[-2] != self.config.block_size:
            raise ValueError(f"h [.., γ={self.config.block_size}, d] and prev_tokens [.., γ] disagree: "
                             f"{list(h.shape)} vs {list(prev_tokens.shape)}")
        head = self.seq_head
        if head is None:
            return h, None, None
        e_prev = self.prev_embedding(prev_tokens)  # [.., γ, r]
        if isinstance(head, MarkovHead):
            if head.factored:
                return h + head.w2_proj(e_prev), None, e_prev
            return h, e_prev, e_prev
        return h, head.teacher_forced_inputs(e_prev, h), e_prev

    def head_logits(self, h: torch.Tensor, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced heads (training, calibration).

        Args:
            h: backbone output [.., γ, d].
            prev_tokens: [.., γ] int64, x_{k-1} for each slot: the anchor, then the ground-truth tokens.

        Returns:
            draft_logits [.., γ, V] float32 (U + B; p_d = softmax of it) and conf_logits [.., γ] float32.
        """
        x_lm, x_seq, e_prev = self.head_features(h, prev_tokens)
        logits = self.base_logits(x_lm)  # [.., γ, V]
        if x_seq is not None:
            logits = logits + self.seq_head.w2(x_seq).float()
        return logits, self.conf_logits(h, e_prev)

    def markov_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov head's ``(W1 [V, r], W2 [V, r])`` as stored by ``Embedding(V, r)`` / ``Linear(r, V)``.

        The full tables are the parameters themselves. Factored tables are materialised once,
        ``W1 = A(E)`` and ``W2 = W_lm·P``, and cached until a parameter or the attached target changes;
        inference (this class's :meth:`sample_block` and the engine's fused draft kernel) reads these, so
        both draw from bit-identical logits.
        """
        head = self.seq_head
        if not isinstance(head, MarkovHead):
            raise RuntimeError(f"markov_tables needs the Markov head, this drafter has {self.config.head!r}")
        if not head.factored:
            return head.w1.weight, head.w2.weight
        embed, lm_head = self.target_modules()
        key = (head.w1_proj.weight._version, head.w2_proj.weight._version, id(embed), id(lm_head),
               head.w1_proj.weight.device, head.w1_proj.weight.dtype)
        if self._tables_cache is None or self._tables_cache[0] != key:
            with torch.no_grad():
                dtype = head.w1_proj.weight.dtype
                w1 = head.w1_proj(embed.weight.to(dtype))  # [V, r]
                w2 = lm_head.weight.to(dtype) @ head.w2_proj.weight  # [V, d] @ [d, r] -> [V, r]
            self._tables_cache = (key, w1.contiguous(), w2.contiguous())
        return self._tables_cache[1], self._tables_cache[2]

    def draft_tables(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of the draft vocabulary (``draft_vocab``, Vd ids): ``(LM head [Vd, d], W2 [Vd, r] | None)``.

        W2 is the Markov table of :meth:`markov_tables` or the RNN head's output weight (None for the parallel-only
        head). Gathered once and cached until a weight, the vocabulary or the attached target changes: the
        reference loop and the engine's fused draft kernel read these same rows, so both compute bit-identical
        logits (``F.linear`` over the gathered rows, never a gather of full-vocabulary logits, whose matmul has
        another shape and may round differently)."""
        if self.draft_vocab is None:
            raise RuntimeError("draft_tables needs a draft vocabulary (DrafterConfig.draft_vocab_size > 0)")
        lm_head = self.target_modules()[1]
        head = self.seq_head
        if isinstance(head, MarkovHead):
            w2 = self.markov_tables()[1]
        else:
            w2 = None if head is None else head.w2.weight
        def version(t: torch.Tensor) -> tuple:  # inference tensors keep no version counter
            return t.data_ptr(), None if t.is_inference() else t._version, t.device, t.dtype

        key = (id(lm_head), version(lm_head.weight), version(self.draft_vocab), None if w2 is None else version(w2))
        if self._vocab_cache is None or self._vocab_cache[0] != key:
            vocab = self.draft_vocab.to(lm_head.weight.device)
            with torch.no_grad():
                lm = lm_head.weight.index_select(0, vocab).contiguous()  # [Vd, d]
                w2_rows = None if w2 is None else w2.index_select(0, vocab.to(w2.device)).contiguous()  # [Vd, r]
            self._vocab_cache = (key, lm, w2_rows)
        return self._vocab_cache[1], self._vocab_cache[2]

    def draft_base_logits(self, h: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """U over the tokens the drafter proposes: :meth:`base_logits` ``[.., V]``, or with a draft vocabulary
        ``lm_head(h)`` over its rows only, ``[.., Vd]`` (lane j is token ``draft_vocab[j]``)."""
        if self.draft_vocab is None:
            return self.base_logits(h, float32=float32)
        lm = self.draft_tables()[0]
        u = F.linear(h.to(lm.dtype), lm)
        return u.float() if float32 else u

    @torch.no_grad()
    def sample_block(self, h: torch.Tensor, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                     temperature: torch.Tensor, seed: int, request_ids: torch.Tensor) -> DraftOutput:
        """Draw x_1..x_γ left to right, the only serial part of drafting (docs/method.md §1).

        Args:
            h: backbone output [R, γ, d].
            anchor_ids, anchor_pos, request_ids: [R] int64.
            temperature: [R] float; 0 gives one-hot argmax rows (greedy).
            seed: the generation seed of the random-number contract.
        """
        R, gamma = h.shape[0], self.config.block_size
        if h.dim() != 3 or h.shape[1] != gamma:
            raise ValueError(f"h must be [R, γ={gamma}, d], got {list(h.shape)}")
        for name, t in (("anchor_ids", anchor_ids), ("anchor_pos", anchor_pos), ("temperature", temperature),
                        ("request_ids", request_ids)):
            if t.shape != (R,):
                raise ValueError(f"{name} must be [R] = [{R}], got {list(t.shape)}")
        vocab = self.draft_vocab  # [Vd] the tokens it may propose, or None: all V
        base = self.draft_base_logits(h)  # [R, γ, Vd or V]
        tables = self.markov_tables() if isinstance(self.seq_head, MarkovHead) else None
        if vocab is not None:  # B_k's rows: those of the draft vocabulary (None for the parallel-only head)
            w2 = self.draft_tables()[1]
        else:  # all of W2: the Markov table, or the RNN head's output weight
            w2 = tables[1] if tables is not None else getattr(self.seq_head, "w2", None)
            w2 = w2.weight if isinstance(w2, nn.Linear) else w2
        top_p = torch.ones(R, device=h.device)  # drafts are never truncated: p_d must cover what it proposes
        top_k = torch.zeros(R, dtype=torch.long, device=h.device)
        prev = anchor_ids.long()  # [R]: x_0
        state = self.seq_head.initial_state(h[:, 0]) if isinstance(self.seq_head, RNNHead) else None
        tokens, probs, confs = [], [], []
        for k in range(1, gamma + 1):
            h_k = h[:, k - 1]  # [R, d]
            logits = base[:, k - 1]  # [R, V]
            e_prev = None
            if tables is not None:  # Markov: e = W1[x_{k-1}], B_k = W2·e from the (materialised) tables
                e_prev = F.embedding(prev, tables[0])  # [R, r]
                logits = logits + F.linear(e_prev, w2).float()
            elif self.seq_head is not None:
                e_prev = self.seq_head.w1(prev)  # [R, r]
                out, state = self.seq_head.step(e_prev, h_k, state)
                logits = logits + F.linear(out, w2).float()
            p_d = sampling.logits_to_probs(logits, temperature, top_p, top_k)  # [R, Vd or V]
            x_k = sampling.sample(p_d, seed, request_ids, anchor_pos + k, sampling.draft_purpose(k))  # [R] lanes
            if vocab is not None:  # lane j is token draft_vocab[j]; p_d is 0 at every other token
                x_k = vocab[x_k]
                p_d = p_d.new_zeros(R, self.config.vocab_size).index_copy_(1, vocab, p_d)  # [R, V]
            confs.append(self.conf_logits(h_k, e_prev))
            tokens.append(x_k)
            probs.append(p_d)
            prev = x_k
        return DraftOutput(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1).float(),
                           conf_logits=torch.stack(confs, dim=1))

    def num_parameters(self) -> int:
        """Trainable parameters owned by the drafter (the shared embedding and LM head excluded)."""
        return sum(p.numel() for p in self.parameters())

    def deepened(self, num_layers: int) -> DSparkDrafter:
        """This drafter with ``num_layers`` backbone layers, computing exactly what it computes.

        The new layers go after the trained ones, freshly initialised except for their two output projections
        (``self_attn.o_proj`` and ``mlp.down_proj``), which start at zero: each new layer then adds nothing to the
        residual stream, so the deeper drafter's logits and confidences equal this one's, and training continues
        from the trained drafter with more capacity instead of from scratch. The zeroed projections get a
        gradient from the first step (it is the layer's branch input times the upstream gradient), and the
        rest of the layer learns through them, as a zero-initialised residual branch does.
        """
        have = self.config.num_layers
        if num_layers < have:
            raise ValueError(f"cannot deepen a {have}-layer drafter to {num_layers} layers (it only adds layers)")
        config = replace(self.config, num_layers=num_layers)
        param = next(self.parameters())
        grown = DSparkDrafter(config).to(device=param.device, dtype=param.dtype)
        missing, unexpected = grown.load_state_dict(self.state_dict(), strict=False)
        new_layers = tuple(f"layers.{i}." for i in range(have, num_layers))
        assert not unexpected and all(k.startswith(new_layers) for k in missing), (missing, unexpected)
        with torch.no_grad():
            for layer in grown.layers[have:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        if self._target is not None:
            grown.attach_target(*self._target)
        return grown.train(self.training)
