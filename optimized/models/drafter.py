"""The drafter's fast parallel backbone over a static per-slot context cache (docs/method.md §1).

Computes what ``reference.drafter.DSparkDrafter.backbone_cached`` computes, for R requests at once. Names follow
``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length, ``γ`` block size,
``x_0`` the anchor, ``U_k`` base logits).

Two stages, both free of host syncs and with static shapes:

* :meth:`OptimizedDrafter.append_context` — target features of newly verified tokens ``[N, m·d]`` →
  ``H_ctx = RMSNorm(W_c · features)`` → every layer's own k/v projection (+ RoPE at the token's absolute position)
  → written into the context cache ``[L, S+1, T+γ, Hkv, D]`` at ``(slot, position)``.
* :meth:`OptimizedDrafter.backbone` — the block ``[x_0, M, …, M]`` at positions ``P..P+γ-1``: each layer writes the
  block's K/V at ``P..P+γ-1`` of the request's slot (scratch: the context append of accepted tokens overwrites it
  later) and runs the varlen attention kernel *non-causally* with ``kv_len = P + γ``. Because the cache holds the
  context at exactly ``0..P-1``, this is docs/method.md §1's mask: every block token sees the whole context before the
  anchor and the whole block, nothing else.

The requirement this places on the engine: before ``backbone`` for an anchor at P, the features of positions
``0..P-1`` of that request have been appended (stale entries at ≥ P are never visible).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from optimized.kernels.layer_ops import rms_norm, rope_append_kv, rope_lookup, rope_table
from optimized.kernels.linear import FUSED_MAX_ROWS
from optimized.models.target import AttentionShape, check_int32, fuse_linears, layer_weights, run_layers
from reference.drafter import DSparkDrafter


class OptimizedDrafter:
    """Batched backbone of a :class:`reference.drafter.DSparkDrafter` with a static context cache.

    Weights are read from the reference module when this is built (fused q/k/v and gate/up are copies: the drafter
    is small, and its checkpoint code saves the reference module, which must not share storage between keys).
    Rebuild after loading new drafter weights.
    """

    def __init__(self, drafter: DSparkDrafter, *, embed_weight: Tensor | None = None,
                 lm_head_weight: Tensor | None = None, attention_backend: str = "auto",
                 layer_backend: str | None = None, linear_rows: int | None = None) -> None:
        """Args:
            drafter: the reference drafter, with its target attached (``attach_target``) unless both weights below
                are given.
            embed_weight: ``[V, d]`` the target's input embedding (default: the attached one).
            lm_head_weight: ``[V, d]`` the target's LM head (default: the attached one).
            attention_backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
            layer_backend: the same for the element-wise layer ops (RMSNorm, RoPE + append, SiLU); ``None`` follows
                ``attention_backend``.
            linear_rows: backbone steps of at most this many tokens (R·γ) run the projections as fused small-batch
                Triton kernels (``optimized/kernels/linear.py``); ``None``: its ``FUSED_MAX_ROWS``, 0: never.
        """
        cfg = drafter.config
        self.config = cfg
        self.gamma = cfg.block_size
        if embed_weight is None or lm_head_weight is None:
            # The target's modules are shared with the drafter, never owned by it (reference/drafter.py).
            embed, lm_head = drafter.target_modules()
            embed_weight = embed.weight if embed_weight is None else embed_weight
            lm_head_weight = lm_head.weight if lm_head_weight is None else lm_head_weight
        self.embed = embed_weight.detach()  # [V, d]
        self.lm_head = lm_head_weight.detach()  # [V, d]
        self.shape = AttentionShape(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                                    head_dim=cfg.head_dim, eps=float(cfg.rms_norm_eps), scale=cfg.head_dim ** -0.5)
        self.context_proj = drafter.context_proj.weight.detach()  # [d, m·d] W_c
        self.context_norm = drafter.context_norm.weight.detach()  # [d]
        self.final_norm = drafter.final_norm.weight.detach()  # [d]
        self.layers = [layer_weights(layer, rebind=False) for layer in drafter.layers]
        # The context K/V of all layers come from the same H_ctx: one matmul for every layer's k and v.
        attns = [layer.self_attn for layer in drafter.layers]
        self.context_kv, self.context_kv_bias = fuse_linears(
            [lin for a in attns for lin in (a.k_proj, a.v_proj)], rebind=False)  # [L·2·Hkv·D, d]
        self.mask_token_id = cfg.mask_token_id
        self.mask_embedding = None if cfg.mask_token_id is not None else drafter.mask_embedding.detach()  # [d]
        self.dtype = self.context_proj.dtype
        self.device = self.context_proj.device
        # The reference's RoPE formula, θ^(-2i/D) in float32, so context keys rotate bit-identically.
        d = cfg.head_dim
        self.inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d)
        self.attention_backend = attention_backend
        self.layer_backend = attention_backend if layer_backend is None else layer_backend
        self.linear_rows = FUSED_MAX_ROWS if linear_rows is None else linear_rows  # the limit in force
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.rope: Tensor | None = None  # [max_seq_len + γ, 2·D] cos | sin per position, made with the caches
        self._block_offsets = self._block_starts = torch.empty(0, dtype=torch.int32)  # made with the caches

    def allocate_cache(self, max_num_seqs: int, max_seq_len: int) -> None:
        """Allocate the context caches ``[L, max_num_seqs + 1, max_seq_len + γ, Hkv, D]``.

        ``max_seq_len`` is the target's: a request's context never exceeds it, and the γ extra positions hold the
        block of an anchor at the last position. The last slot is trash for padding writes. Zero-filled so
        never-written positions are finite.
        """
        if max_num_seqs < 1 or max_seq_len < 1:
            raise ValueError(f"max_num_seqs and max_seq_len must be ≥ 1, got {max_num_seqs}, {max_seq_len}")
        s = self.shape
        size = (len(self.layers), max_num_seqs + 1, max_seq_len + self.gamma, s.num_kv_heads, s.head_dim)
        self.k_cache = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.rope = rope_table(max_seq_len + self.gamma, self.inv_freq, 1.0, self.dtype)  # every cache position
        # the backbone's index constants, made once instead of by small kernels in every draft (graph nodes too):
        # block offsets 0..γ-1, and the block starts 0, γ, 2γ, … (cu_seqlens of R blocks = its first R + 1 entries)
        self._block_offsets = torch.arange(self.gamma, device=self.device)  # [γ] int64
        self._block_starts = (torch.arange(max_num_seqs + 2, device=self.device) * self.gamma).to(torch.int32)

    def _require_cache(self) -> tuple[Tensor, Tensor]:
        if self.k_cache is None:
            raise RuntimeError("no context cache: call allocate_cache(max_num_seqs, max_seq_len) first")
        return self.k_cache, self.v_cache

    @torch.inference_mode()
    def append_context(self, features: Tensor, positions: Tensor, slot_of_token: Tensor) -> None:
        """Project target features into every layer's context K/V and write them at their positions.

        Args:
            features: ``[N, m·d]`` tapped target features (the target's dtype; cast to the drafter's).
            positions: ``[N]`` absolute positions of those tokens.
            slot_of_token: ``[N]`` cache slot of each token; -1 (padding) writes to the trash slot.
        """
        k_cache, v_cache = self._require_cache()
        n, md = features.shape[0], self.context_proj.shape[1]
        if features.dim() != 2 or features.shape[1] != md:
            raise ValueError(f"features must be [N, m·d] = [N, {md}], got {tuple(features.shape)}")
        if positions.shape != (n,) or slot_of_token.shape != (n,):
            raise ValueError(f"positions and slot_of_token must be [N] = [{n}], got {tuple(positions.shape)} and "
                             f"{tuple(slot_of_token.shape)}")
        s = self.shape
        trash = k_cache.shape[1] - 1
        is_trash = slot_of_token < 0
        slots = torch.where(is_trash, trash, slot_of_token.long())  # [N]
        pos = torch.where(is_trash, 0, positions.long())  # [N]
        ops = self.layer_backend
        h_ctx, _ = rms_norm(F.linear(features.to(self.dtype), self.context_proj), self.context_norm, s.eps,
                            backend=ops)  # [N, d]
        kv = F.linear(h_ctx, self.context_kv, self.context_kv_bias)  # [N, L·2·Hkv·D]
        kv = kv.view(n, len(self.layers), 2, s.num_kv_heads, s.head_dim)  # [N, L, 2, Hkv, D]
        cos, sin = rope_lookup(self.rope, pos)  # [N, D] each: rows of the table made with the caches
        for i, w in enumerate(self.layers):  # k_norm (Qwen3-style drafters), RoPE of k, then k and v to the cache
            rope_append_kv(None, kv[:, i, 0], kv[:, i, 1], cos, sin, k_cache[i], v_cache[i], slots, pos,
                           k_norm=w.k_norm, eps=s.eps, backend=ops)

    @torch.inference_mode()
    def backbone(self, anchor_ids: Tensor, anchor_pos: Tensor, slot_ids: Tensor) -> Tensor:
        """The parallel backbone for R requests: ``[x_0, M, …, M]`` → h ``[R, γ, d]`` (after the final norm).

        Args:
            anchor_ids: ``[R]`` int64 anchors x_0.
            anchor_pos: ``[R]`` their absolute positions P; context positions ``0..P-1`` must be appended.
            slot_ids: ``[R]`` int32 cache slot per request; -1 marks a padded row (it computes a throw-away block in
                the trash slot, so R can stay a static bucket size).
        """
        k_cache, v_cache = self._require_cache()
        r, g, d = anchor_ids.shape[0], self.gamma, self.embed.shape[1]
        if anchor_ids.shape != (r,) or anchor_pos.shape != (r,):
            raise ValueError(f"anchor_ids and anchor_pos must be [R], got {tuple(anchor_ids.shape)} and "
                             f"{tuple(anchor_pos.shape)}")
        check_int32(slot_ids=slot_ids)
        trash = k_cache.shape[1] - 1
        padded = slot_ids < 0
        slots = torch.where(padded, trash, slot_ids).to(torch.int32)  # [R]
        anchor_pos = torch.where(padded, 0, anchor_pos.long())  # [R]
        starts = self._block_starts
        if starts.shape[0] > r and starts.device == anchor_pos.device:  # the constants of allocate_cache
            offsets, cu = self._block_offsets, starts[:r + 1]  # [γ]; [R+1]: γ queries each
        else:  # more requests than the caches' slots (padded buckets)
            offsets = torch.arange(g, device=anchor_pos.device)
            cu = (torch.arange(r + 1, device=anchor_pos.device) * g).to(torch.int32)
        positions = (anchor_pos[:, None] + offsets).reshape(r * g)  # [R·γ] P..P+γ-1
        # [R·γ] each slot γ times, in memory: the kernels read it as a contiguous array (a reshape of the expand could
        # be a stride-0 view, at R = 1)
        write_slots = slots.long()[:, None].expand(r, g).contiguous().view(r * g)
        kv_lens = (anchor_pos + g).to(torch.int32)  # [R]: context 0..P-1 plus the block
        cos, sin = rope_lookup(self.rope, positions)  # [R·γ, D]

        x = self._block_embeddings(anchor_ids).reshape(r * g, d)  # [R·γ, d]
        x, _ = run_layers(x, self.layers, self.shape, cos, sin, k_cache, v_cache, write_slots, positions, cu, kv_lens,
                          slots, causal=False, max_q_len=g, backend=self.attention_backend,
                          layer_backend=self.layer_backend, linear_rows=self.linear_rows)
        return rms_norm(x, self.final_norm, self.shape.eps, backend=self.layer_backend)[0].view(r, g, d)

    def base_logits(self, h: Tensor) -> Tensor:
        """U_k = lm_head(h_k) in float32: h ``[R, γ, d]`` → ``[R, γ, V]`` (the target's LM head, shared)."""
        return F.linear(h.to(self.lm_head.dtype), self.lm_head).float()

    def _block_embeddings(self, anchor_ids: Tensor) -> Tensor:
        """[x_0, M, …, M] embedded: anchor_ids [R] -> [R, γ, d] in the drafter's dtype."""
        x0 = F.embedding(anchor_ids, self.embed).to(self.dtype)  # [R, d]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(self.dtype)  # [d], the learned vector
        else:
            mask = self.embed[self.mask_token_id].to(self.dtype)  # [d], a spare vocabulary row
        masks = mask.expand(x0.shape[0], self.gamma - 1, x0.shape[1])  # [R, γ-1, d]
        return torch.cat((x0[:, None], masks), dim=1)  # [R, γ, d]

