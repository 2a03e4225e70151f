"""Tiny random models for the tests and for the CPU runs of the equivalence harness.

Built without any download: a small HF causal LM of a supported family (Llama and Qwen3 tie embedding and LM head as
the default target does; Qwen2 does not), and a one-layer DSpark drafter for it. The test suite
(``tests/conftest.py``) and ``scripts/gpu_equivalence.py --tiny`` build their models here, so both compare the same
objects.
"""

from __future__ import annotations

import torch


def tiny_hf_model(family: str = "llama", vocab_size: int = 96, num_layers: int = 4, seed: int = 0):
    """A small random HF causal LM of the given family, in fp32 eval mode: llama, qwen3, or qwen2 (with q/k/v biases
    drawn at random, HF initialises them to zero, and an untied LM head)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**(common | dict(tie_word_embeddings=False, rope_theta=1e6))))
    else:
        raise ValueError(family)
    # Random init gives near-uniform logits; scale the embedding so greedy decoding has clear winners.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        if family == "qwen2":  # make the biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.5)
    return model.eval()


# A standalone drafter config (no target model): vocabulary, width, block size and the tapped layers.
TINY_V, TINY_D, TINY_GAMMA, TINY_TAPS = 96, 64, 4, (0, 1, 2)


def tiny_drafter_config(head: str = "markov", qk_norm: bool = False, **overrides):
    """A small :class:`reference.config.DrafterConfig` for drafter-only tests; ``overrides`` replace any field."""
    from reference.config import DrafterConfig

    fields = dict(vocab_size=TINY_V, hidden_size=TINY_D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, rms_norm_eps=1e-6, target_num_layers=4, target_layer_ids=TINY_TAPS,
                  block_size=TINY_GAMMA, head=head, markov_rank=16, qk_norm=qk_norm)
    fields.update(overrides)
    return DrafterConfig(**fields)


def tiny_drafter(target, *, gamma: int = 4, seed: int = 0, head: str = "markov", markov_rank: int = 16,
                 noise: float = 0.0):
    """A random one-layer DSpark drafter for ``target`` (a reference Target), attached and in eval mode.

    ``noise`` adds N(0, noise²) to every parameter after the standard init: the zero-initialised W2 of the
    Markov head then carries signal, so drafts and confidences vary across a batch.
    """
    from reference.config import DrafterConfig
    from reference.drafter import DSparkDrafter

    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(target.config, num_layers=1, block_size=gamma, head=head,
                                           markov_rank=markov_rank, target_layer_ids=target.layer_ids)
    drafter = DSparkDrafter(cfg).eval()
    if noise:
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(torch.randn_like(p) * noise)
    drafter.attach_target(target.embed_tokens, target.lm_head)
    return drafter
