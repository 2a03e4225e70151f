"""The target's fast forward: Llama-family decoder (Llama/SmolLM2, Qwen2, Qwen3) over per-slot static KV caches.

Computes what ``reference.target.Target.forward`` computes — the next-token logits ``p_t`` (docs/method.md §4) and the
tapped residual-stream features the drafter reads (docs/method.md §1, "Target context") — for a whole ragged batch at
once: prefill chunks and verify steps ``[x_0, x_1..x_ℓ]`` of many requests packed into one token list. Names
follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).

Layout of one step (host constants: N tokens, R request rows; everything per request lives in device tensors)::

    input_ids, positions          [N]     tokens packed request after request; rows past cu[R] are padding
    cu_seqlens_q                  [R+1]   request r owns tokens cu[r]..cu[r+1]-1 (length 0 for a padded row)
    kv_lens                       [R]     keys visible to request r after this step = last position + 1
    slot_ids                      [R]     the request's cache slot; -1 marks a padded row

The KV cache is ``[L, S+1, T, Hkv, D]``: one contiguous row of T positions per slot, plus one trash slot (index
S) that absorbs the writes of padding tokens, so the append needs no data-dependent branch (no host sync, CUDA-graph
safe). A verify step writes the K/V of all its tokens at their positions; rejected positions are simply
overwritten by the next step (the engine tracks lengths; nothing is cropped).

Weights are the HF model's own tensors, except that q/k/v and gate/up are fused into one matmul each. The fused
tensors become the storage of the HF module's parameters too (they are rebound to views), so the fusion costs no
memory and the HF model keeps working, e.g. as the reference in equivalence tests.

The building blocks (``LayerWeights``, ``decoder_layer`` and the layer ops it calls) are shared with the
drafter (``optimized/models/drafter.py``), whose backbone layers have the target's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optimized.kernels.attention import varlen_attention
from optimized.kernels.layer_ops import resolve_backend, rope_append_kv, rope_lookup, rope_table, silu_mul
from optimized.kernels.layer_ops import rms_norm as fused_rms_norm
from optimized.kernels.linear import FUSED_MAX_ROWS, fused_rows, linear, norm_linear
from reference.config import default_target_layer_ids

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# RoPE variants whose inverse frequencies do not depend on the sequence length; "dynamic" and "longrope" rescale
# with the length (a host-side decision per step) and are not supported by the static-shape engine.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# ---------------------------------------------------------------------------------------------------------
# Building blocks. The element-wise ops (RMSNorm, RoPE, KV append, SiLU) live in optimized/kernels/layer_ops.py, each
# as a torch definition that rounds exactly like HF Llama/Qwen (fp16/bf16 outputs agree bit-for-bit in the common
# cases, fp32 to summation order) and a fused Triton kernel of the same signature.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    """One Llama-family decoder layer's tensors, q/k/v and gate/up fused along the output dimension."""

    input_norm: Tensor  # [d]
    qkv: Tensor  # [(H + 2·Hkv)·D, d]
    qkv_bias: Tensor | None  # [(H + 2·Hkv)·D] (Qwen2) or None
    q_norm: Tensor | None  # [D] (Qwen3) or None
    k_norm: Tensor | None  # [D] (Qwen3) or None
    o_proj: Tensor  # [d, H·D]
    post_norm: Tensor  # [d]
    gate_up: Tensor  # [2·I, d]
    down: Tensor  # [d, I]


@dataclass(frozen=True)
class AttentionShape:
    """Head counts and numerics shared by every layer of one model."""

    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    eps: float  # RMSNorm epsilon (layer norms and q/k norms)
    scale: float  # softmax scale, D^-0.5 for every supported family


def fuse_linears(linears: list[nn.Linear], rebind: bool) -> tuple[Tensor, Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input into one matrix.

    With ``rebind`` the modules' parameters are replaced by views of the fused tensors, so both share one
    storage (no extra memory; later in-place weight loads reach both). Without it the fused tensors are copies.
    """
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears], dim=0)  # [Σ out, in]
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("cannot fuse linears of which only some have a bias")
        bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None  # [Σ out]
        if rebind:
            start = 0
            for lin in linears:
                rows = lin.weight.shape[0]
                lin.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
                start += rows
    return weight, bias


def layer_weights(layer: nn.Module, rebind: bool) -> LayerWeights:
    """Read a decoder layer with HF (and reference drafter) parameter names into :class:`LayerWeights`."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj], rebind)
    gate_up, _ = fuse_linears([mlp.gate_proj, mlp.up_proj], rebind)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(), qkv=qkv, qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
        o_proj=attn.o_proj.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=gate_up, down=mlp.down_proj.weight.detach(),
    )


def split_qkv(qkv: Tensor, shape: AttentionShape) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection [N, (H + 2·Hkv)·D] as views q [N, H, D], k [N, Hkv, D], v [N, Hkv, D] (no copy)."""
    n, H, Hkv, D = qkv.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(n, H, D), k.view(n, Hkv, D), v.view(n, Hkv, D)


def decoder_layer(x: Tensor, pending: Tensor | None, w: LayerWeights, shape: AttentionShape, cos: Tensor,
                  sin: Tensor, k_cache: Tensor, v_cache: Tensor, write_slots: Tensor, write_pos: Tensor,
                  cu_seqlens_q: Tensor, kv_lens: Tensor, slot_ids: Tensor, *, causal: bool,
                  max_q_len: int | None, backend: str, layer_backend: str | None = None,
                  linear_rows: int | None = None, row_invariant: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One pre-norm layer over packed tokens: x + attn(norm(x)), then + mlp(norm(·)). x [N, d] -> [N, d].

    The layer's input is ``x + pending`` (``pending`` = the previous layer's MLP output, not yet added, or ``None``),
    and its output is returned the same way, ``(x', mlp_out, x_in)``, so each residual add happens inside the next
    RMSNorm: :func:`run_layers` adds the last one. ``x_in = x + pending`` is the stream entering the layer, i.e. the
    previous layer's output, which its first norm computes anyway (the tapped features are read from it). The new
    tokens' K/V are written to the cache first, so attention reads every visible key from one place.

    ``backend`` picks the attention kernel, ``layer_backend`` (default: the same) the element-wise ops; with Triton
    a layer is nine launches: add+norm, qkv, RoPE+append, attention, o, add+norm, gate/up, SiLU·up, down. A step of
    at most ``linear_rows`` tokens (default ``optimized.kernels.linear.FUSED_MAX_ROWS``; 0: never) runs the
    projections as the fused small-batch Triton kernels instead, six launches: add+norm+qkv, RoPE+append,
    attention, o, add+norm+gate/up+SiLU·up, down. With ``row_invariant`` every step does, every projection on
    the one tl.dot tile shape and the attention on one tile shape, so that a token's outputs do not depend on the
    other tokens of its step (slower at one or two rows).
    """
    ops = backend if layer_backend is None else layer_backend
    n = x.shape[0]
    fused = (row_invariant or fused_rows(n, linear_rows)) and resolve_backend(ops, x) == "triton"
    # x + pending = HF's `residual + hidden_states` (a bf16 add is commutative), inside the norm
    inp, res = (x, None) if pending is None else (pending, x)
    if fused:
        qkv, x = norm_linear(inp, w.qkv, w.qkv_bias, norm_weight=w.input_norm, eps=shape.eps, residual=res,
                             backend=ops, row_invariant=row_invariant)
    else:
        h, x = fused_rms_norm(inp, w.input_norm, shape.eps, residual=res, backend=ops)
        qkv = F.linear(h, w.qkv, w.qkv_bias)
    x_in = x
    q, k, v = split_qkv(qkv, shape)
    q = rope_append_kv(q, k, v, cos, sin, k_cache, v_cache, write_slots, write_pos, w.q_norm, w.k_norm, shape.eps,
                       backend=ops)  # [N, H, D]
    o = varlen_attention(q, k_cache, v_cache, cu_seqlens_q, kv_lens, slot_ids, causal=causal, scale=shape.scale,
                         max_q_len=max_q_len, backend=backend, row_invariant=row_invariant).view(n, -1)  # [N, H·D]
    if fused:
        o = linear(o, w.o_proj, backend=ops, row_invariant=row_invariant)  # [N, d]
        act, x = norm_linear(o, w.gate_up, norm_weight=w.post_norm, eps=shape.eps, residual=x, gated=True,
                             backend=ops, row_invariant=row_invariant)  # [N, I]
        return x, linear(act, w.down, backend=ops, row_invariant=row_invariant), x_in
    h, x = fused_rms_norm(F.linear(o, w.o_proj), w.post_norm, shape.eps, residual=x, backend=ops)
    return x, F.linear(silu_mul(F.linear(h, w.gate_up), backend=ops), w.down), x_in


def run_layers(x: Tensor, layers: list[LayerWeights], shape: AttentionShape, cos: Tensor, sin: Tensor,
               k_cache: Tensor, v_cache: Tensor, write_slots: Tensor, write_pos: Tensor, cu_seqlens_q: Tensor,
               kv_lens: Tensor, slot_ids: Tensor, *, causal: bool, max_q_len: int | None, backend: str,
               layer_backend: str | None = None, linear_rows: int | None = None, taps: tuple[int, ...] = (),
               row_invariant: bool = False) -> tuple[Tensor, dict[int, Tensor]]:
    """Every decoder layer over x [N, d] (caches ``[L, S, T, Hkv, D]``). Returns the residual stream after the last
    layer and ``{l: stream after layer l}`` for the tapped layers. Every residual add rides on the next layer's
    RMSNorm, the tapped ones too: layer l's output is the sum layer l + 1's first norm computes (the same bits as a
    separate add), so a tap costs no kernel; only the last layer's add is a separate one."""
    pending, tapped = None, {}
    for i, w in enumerate(layers):
        x, pending, x_in = decoder_layer(x, pending, w, shape, cos, sin, k_cache[i], v_cache[i], write_slots,
                                         write_pos, cu_seqlens_q, kv_lens, slot_ids, causal=causal,
                                         max_q_len=max_q_len, backend=backend, layer_backend=layer_backend,
                                         linear_rows=linear_rows, row_invariant=row_invariant)
        if i - 1 in taps:
            tapped[i - 1] = x_in
    x = x + pending
    if len(layers) - 1 in taps:
        tapped[len(layers) - 1] = x
    return x, tapped


def check_int32(**tensors: Tensor) -> None:
    """Metadata tensors must be int32 1-D (what the kernels index with); fail fast with the name."""
    for name, t in tensors.items():
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------------------
# The target
# ---------------------------------------------------------------------------------------------------------


class OptimizedTarget:
    """Fast batched forward of a Llama/Qwen2/Qwen3 target with static per-slot KV caches.

    Build it once the weights are final and on their device (``OptimizedTarget(target)`` for a
    ``reference.target.Target``, or :meth:`load`), then call :meth:`allocate_cache` once at start-up.
    """

    def __init__(self, model, layer_ids=None, *, attention_backend: str = "auto",
                 layer_backend: str | None = None, linear_rows: int | None = None,
                 row_invariant: bool = False) -> None:
        """Args:
            model: a ``reference.target.Target`` or its HF ``LlamaForCausalLM``/``Qwen2ForCausalLM``/
                ``Qwen3ForCausalLM``. The HF q/k/v and gate/up parameters are rebound to views of the fused
                tensors (same values, shared storage).
            layer_ids: tapped decoder layers l (features = concat of the residual stream after each, HF's
                ``hidden_states[l + 1]``), in the order the drafter expects; default: the Target's, else
                :func:`reference.config.default_target_layer_ids`.
            attention_backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
            layer_backend: the same choice for the element-wise layer ops (``optimized/kernels/layer_ops.py``);
                ``None`` follows ``attention_backend``. ``"torch"`` on CUDA runs the unfused HF-rounding ops (A/B).
            linear_rows: steps of at most this many tokens run the projections as fused small-batch Triton
                kernels (``optimized/kernels/linear.py``; Triton layer ops only); ``None``: its ``FUSED_MAX_ROWS``,
                0: never.
            row_invariant: every step, whatever its size, runs the projections and the LM head on the fused
                kernels' one tl.dot tile shape and the attention on one query tile shape (Triton only), so that a
                token's logits are the same bits in a step of one token and in a verify block or a batch:
                speculative greedy decoding then emits plain decoding's tokens in bfloat16 too (docs/numerics.md).
                Slower: 0.6-1.0x the default's throughput on the H200.
        """
        self.source = model  # what this was built from (a Target keeps the tokenizer and the eos ids)
        if hasattr(model, "layer_ids") and hasattr(model, "model"):  # a reference.target.Target
            layer_ids = model.layer_ids if layer_ids is None else layer_ids
            model = model.model
        hf_model = model  # the HF *ForCausalLM
        if layer_ids is None:
            layer_ids = default_target_layer_ids(hf_model.config.num_hidden_layers)
        config = hf_model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported target model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                                    or ()):
            raise ValueError("sliding-window attention layers are not supported by the optimized target")
        decoder = hf_model.model
        self.num_layers = len(decoder.layers)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        if not self.layer_ids or any(not 0 <= i < self.num_layers - 1 for i in self.layer_ids):
            raise ValueError(f"layer_ids {self.layer_ids} invalid for a {self.num_layers}-layer target: tap layers "
                             f"0..{self.num_layers - 2} (the last layer's output is returned after the final norm)")
        rotary = decoder.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} rescales with the sequence length; supported: "
                             f"{STATIC_ROPE_TYPES}")
        attn0 = decoder.layers[0].self_attn
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.shape = AttentionShape(
            num_heads=num_heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, eps=float(config.rms_norm_eps),
            scale=float(getattr(attn0, "scaling", head_dim ** -0.5)))
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.attention_backend = attention_backend
        self.layer_backend = attention_backend if layer_backend is None else layer_backend
        self.linear_rows = FUSED_MAX_ROWS if linear_rows is None else linear_rows  # the limit in force
        self.row_invariant = bool(row_invariant)
        self.embed = decoder.embed_tokens.weight.detach()  # [V, d]
        self.final_norm = decoder.norm.weight.detach()  # [d]
        self.lm_head = hf_model.get_output_embeddings().weight.detach()  # [V, d] (the embedding when tied)
        self.inv_freq = rotary.inv_freq.detach().float()  # [D/2]
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers = [layer_weights(layer, rebind=True) for layer in decoder.layers]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None
        self.rope: Tensor | None = None  # [max_seq_len, 2·D] cos | sin per position, made with the caches

    @classmethod
    def load(cls, name_or_dir: str = "smollm2-135m-instruct", *, layer_ids=None, device="cpu",
             dtype: torch.dtype = torch.float32, attention_backend: str = "auto",
             layer_backend: str | None = None, linear_rows: int | None = None,
             row_invariant: bool = False) -> OptimizedTarget:
        """Load a target with :meth:`reference.target.Target.load` (default SmolLM2 GGUF, a .gguf or an HF dir)."""
        from reference.target import Target

        return cls(Target.load(name_or_dir, layer_ids=layer_ids, device=device, dtype=dtype),
                   attention_backend=attention_backend, layer_backend=layer_backend, linear_rows=linear_rows,
                   row_invariant=row_invariant)

    @property
    def feature_size(self) -> int:
        """m·d: width of the concatenated tapped features."""
        return len(self.layer_ids) * self.hidden_size

    def allocate_cache(self, max_num_seqs: int, max_seq_len: int) -> None:
        """Allocate the static KV caches ``[L, max_num_seqs + 1, max_seq_len, Hkv, D]`` (last slot = trash).

        Zero-filled so that never-written positions hold finite values (they are never visible, but a NaN
        from uninitialised memory times a zero weight would still be NaN).
        """
        if max_num_seqs < 1 or max_seq_len < 1:
            raise ValueError(f"max_num_seqs and max_seq_len must be ≥ 1, got {max_num_seqs}, {max_seq_len}")
        s = self.shape
        size = (self.num_layers, max_num_seqs + 1, max_seq_len, s.num_kv_heads, s.head_dim)
        self.k_cache = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(size, dtype=self.dtype, device=self.device)
        # every position the caches can hold: a step's RoPE tables are a gather from it, not eight kernels
        self.rope = rope_table(max_seq_len, self.inv_freq, self.rope_scaling, self.dtype)

    @property
    def max_num_seqs(self) -> int:
        return self._require_cache().shape[1] - 1

    @property
    def max_seq_len(self) -> int:
        return self._require_cache().shape[2]

    def _require_cache(self) -> Tensor:
        if self.k_cache is None:
            raise RuntimeError("no KV cache: call allocate_cache(max_num_seqs, max_seq_len) first")
        return self.k_cache

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor,
                slot_ids: Tensor, logits_rows: Tensor | None = None, *, max_q_len: int | None = None,
                logits_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run one packed ragged step: write every token's K/V to its slot, return logits and features.

        Args:
            input_ids: ``[N]`` int64 tokens, packed request after request (rows past ``cu_seqlens_q[R]`` are
                padding: computed, written to the trash slot, never read).
            positions: ``[N]`` int32/int64 absolute positions; for request r's token i this must equal
                ``kv_lens[r] - q_len_r + i`` (the engine's bookkeeping; not checked, checking would sync).
            cu_seqlens_q: ``[R + 1]`` int32 query offsets (non-decreasing; a padded row repeats the offset).
            kv_lens: ``[R]`` int32 keys visible to each request after this step (its tokens included).
            slot_ids: ``[R]`` int32 cache slot per request, -1 for padded rows.
            logits_rows: ``[M]`` int64 token rows whose logits are wanted (verified positions, the last prefill
                token); ``None`` = all N rows.
            max_q_len: host upper bound on any request's query count (γ+1 for verify steps; keeps the attention
                grid static under CUDA graphs); ``None`` = N.
            logits_out: optional ``[M, V]`` float32 buffer the logits are written into (and returned as). The engine's
                verify graphs pass one static buffer, so the graphs of all token buckets share their largest output
                instead of each keeping its own ``[n, V]`` (≈ 25 GiB over the buckets of 2048 tokens at V = 49152).

        Returns:
            ``(logits [M, V] float32, features [N, m·d] in the model dtype)``; logits row j is ``p_t`` (before
            temperature) for the token after ``input_ids[logits_rows[j]]``.
        """
        k_cache, v_cache = self._require_cache(), self.v_cache
        n = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape != (n,):
            raise ValueError(f"input_ids and positions must both be [N], got {tuple(input_ids.shape)} and "
                             f"{tuple(positions.shape)}")
        check_int32(cu_seqlens_q=cu_seqlens_q, kv_lens=kv_lens, slot_ids=slot_ids)
        trash = k_cache.shape[1] - 1
        write_slots, write_pos = token_write_index(positions, cu_seqlens_q, slot_ids, trash)  # [N] each
        attn_slots = torch.where(slot_ids < 0, trash, slot_ids).to(torch.int32)  # [R]
        cos, sin = rope_lookup(self.rope, positions)  # [N, D] each: rows of the table made with the caches

        x = F.embedding(input_ids, self.embed)  # [N, d]
        # taps[l] = the residual stream after layer l = HF's hidden_states[l + 1]
        x, taps = run_layers(x, self.layers, self.shape, cos, sin, k_cache, v_cache, write_slots, write_pos,
                             cu_seqlens_q, kv_lens, attn_slots, causal=True, max_q_len=max_q_len,
                             backend=self.attention_backend, layer_backend=self.layer_backend,
                             linear_rows=self.linear_rows, taps=self.layer_ids, row_invariant=self.row_invariant)
        features = torch.cat([taps[l] for l in self.layer_ids], dim=-1)  # [N, m·d], in layer_ids order
        rows = x if logits_rows is None else x.index_select(0, logits_rows)  # [M, d]
        normed, _ = fused_rms_norm(rows, self.final_norm, self.shape.eps, backend=self.layer_backend)
        if self.row_invariant and resolve_backend(self.layer_backend, normed) == "triton":
            logits = linear(normed, self.lm_head, backend=self.layer_backend, row_invariant=True)  # [M, V]
        else:
            logits = F.linear(normed, self.lm_head)  # [M, V] model dtype
        if logits_out is None:
            return logits.float(), features
        if logits_out.shape != logits.shape or logits_out.dtype != torch.float32:
            raise ValueError(f"logits_out must be float32 {tuple(logits.shape)}, got {logits_out.dtype} "
                             f"{tuple(logits_out.shape)}")
        return logits_out.copy_(logits), features  # the same rounding as .float(), into the caller's buffer


def token_write_index(positions: Tensor, cu_seqlens_q: Tensor, slot_ids: Tensor, trash: int
                      ) -> tuple[Tensor, Tensor]:
    """Cache coordinates of every packed token: (slot [N], position [N]), both int64.

    A token's request is found by binary search in the offsets (no host loop). Tokens of padded request rows
    (slot -1) and padding tokens past ``cu_seqlens_q[R]`` go to position 0 of the trash slot.
    """
    n = positions.shape[0]
    token = torch.arange(n, device=positions.device, dtype=cu_seqlens_q.dtype)  # [N]
    request = torch.searchsorted(cu_seqlens_q[1:], token, right=True)  # [N] in 0..R (R = past the last request)
    padded_slots = torch.cat((slot_ids.long(), slot_ids.new_full((1,), -1).long()))  # [R + 1]
    slots = padded_slots[request]  # [N]
    is_trash = slots < 0
    slots = torch.where(is_trash, trash, slots)
    pos = torch.where(is_trash, 0, positions.long())
    return slots, pos
