"""scripts/export_speculators.py against the speculators package's own DSpark model (the format vLLM loads).

A small random drafter for the real default target (SmolLM2-135M-Instruct) is exported and loaded with
``speculators.models.dspark.DSparkDraftModel`` on the CPU; on a chat-templated prompt its draft logits and
confidence logits at every anchor and slot must match ours (``DSparkDrafter.forward`` + ``head_logits``, teacher
forced), and greedy drafting with their heads (vLLM's left-to-right loop) must give our ``sample_block`` tokens.
Drafters the format cannot express are refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from reference.checkpoint import load_drafter, save_drafter
from reference.config import DrafterConfig
from reference.drafter import DSparkDrafter
from scripts import export_speculators
from tests.conftest import tiny_drafter_config

PROMPT = "Explain in two sentences why the sky is blue, then give one example of Rayleigh scattering."
MASK_TOKEN_ID = 16  # SmolLM2's special token <empty_output>; any row works for a random drafter
# float32 on both sides; they differ only in operation order (SDPA vs eager attention, the factored Markov bias
# added to h before the LM head vs the materialised table added after it). Measured on SmolLM2 with |logits| ≤ 93:
# ≤ 7e-5 on draft logits, ≤ 8e-7 on confidence logits over four head variants (torch 2.13 CPU); the bounds leave
# > 10x room.
LOGIT_ATOL, CONF_ATOL = 1e-3, 1e-5
# Their weights that the checkpoint must not carry: the verifier's, reloaded from it (speculators) or shared (vLLM).
VERIFIER_OWNED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def random_drafter(target, head: str, factored: bool) -> DSparkDrafter:
    """One backbone layer with random weights; the sequential head's W2 is non-zero so it changes the drafts."""
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(
        target.config, num_layers=1, qk_norm=True, mask_token_id=MASK_TOKEN_ID, head=head, markov_rank=32,
        markov_factored=factored, target_layer_ids=target.layer_ids, target_name="smollm2-135m-instruct",
        sts_temperatures={"greedy": [1.5] * 7}, sts_biases={"greedy": [-0.25] * 7})
    drafter = DSparkDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith(("w2.weight", "w2_proj.weight")):
                p.normal_(0.0, 0.5)  # a bias B of a few logits
            elif "norm" in name:
                p.uniform_(0.5, 1.5)  # RMSNorm gains other than 1, so a swapped norm would show
    return drafter.eval()


def load_theirs(out_dir):
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    config = DSparkSpeculatorConfig.from_pretrained(out_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    return DSparkDraftModel.from_pretrained(out_dir, config=config).eval()


def their_outputs(model, input_ids, features, anchors, gamma):
    """Their training forward over all ``anchors`` at once: teacher-forced draft and confidence logits [nb, γ, ..],
    plus the backbone output h and base logits U (caught on their ``norm`` and ``lm_head`` modules)."""
    import speculators.models.dspark.core as core
    from speculators.models.dspark import DSparkDraftModel

    S, nb = input_ids.shape[1], anchors.numel()
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, anchors] = 1  # with max_anchors = nb every valid position is an anchor, in order
    seen = {}
    hooks = [model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("h", o)),
             model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("base", o))]
    original = core.compute_metrics

    def catch(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["conf"] = logits, confidence_logits
        return original(logits, targets, confidence_logits, *args, **kwargs)

    # The CPU losses are the eager ones (the fused default is a Triton kernel); they only score, we compare inputs.
    kwargs = DSparkDraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager", max_anchors=nb)[1]
    core.compute_metrics = catch
    try:
        with torch.no_grad():
            model(hidden_states=features, input_ids=input_ids, loss_mask=loss_mask,
                  verifier_last_hidden_states=torch.zeros(1, S, model.hidden_size),
                  document_ids=torch.zeros(1, S, dtype=torch.long), **kwargs)
    finally:
        core.compute_metrics = original
        for hook in hooks:
            hook.remove()
    return (seen["logits"].view(nb, gamma, -1), seen["conf"].view(nb, gamma), seen["h"].view(nb, gamma, -1),
            seen["base"].view(nb, gamma, -1))


@torch.no_grad()
def their_greedy(model, h, base, anchor_ids):
    """Greedy drafting as vLLM runs it: slot k adds the sequential bias of the tokens drafted so far, argmax; the
    confidence of slot k reads [h_k; W1[x_{k-1}]]. Returns tokens [nb, γ] and confidence logits [nb, γ]."""
    nb, gamma = base.shape[:2]
    prev = torch.zeros(nb, gamma, dtype=torch.long)
    prev[:, 0] = anchor_ids
    head, with_markov = model.markov_head, model.config.confidence_head_with_markov
    tokens, confs = [], []
    for k in range(gamma):
        # Slot k's bias depends on prev[:, :k+1] only (the RNN state runs left to right), so the rest is filler.
        emb = head.prev_embeddings(prev)
        bias = head.block_bias(prev_token_ids=prev, hidden_states=h, prev_emb=emb)[:, k]  # [nb, V]
        x_k = (base[:, k] + bias).argmax(-1)
        if model.d2t is not None:  # a draft-vocabulary lane to its token id (vLLM's d2t offsets)
            x_k = x_k + model.d2t[x_k]
        feats = torch.cat((h[:, k], emb[:, k]), -1) if with_markov else h[:, k]
        confs.append(model.confidence_head(feats))
        tokens.append(x_k)
        if k + 1 < gamma:
            prev[:, k + 1] = x_k
    return torch.stack(tokens, 1), torch.stack(confs, 1)


@pytest.mark.slow
# The full-table Markov head takes the factored head's path with its parameters as the tables, so it is left out.
# With a draft vocabulary (the 16k most frequent ids stand-in: every third id) their model drafts over its rows only.
@pytest.mark.parametrize("head,factored,draft_vocab", [("markov", True, False), ("rnn", False, False),
                                                      ("none", False, False), ("markov", True, True)])
def test_export_matches_speculators_model(smollm2_target, tmp_path, head, factored, draft_vocab):
    pytest.importorskip("speculators.models.dspark", reason="pip install -e '.[export]' && "
                                                            "pip install --no-deps speculators==0.9.0")
    target = smollm2_target
    drafter = random_drafter(target, head, factored)
    vocab = None
    if draft_vocab:
        vocab = torch.arange(0, drafter.config.vocab_size, 3)
        vocab[MASK_TOKEN_ID // 3] = MASK_TOKEN_ID  # any ascending ids
        drafter = drafter.restrict_vocab(vocab)
    save_drafter(drafter, tmp_path / "ours")
    out = export_speculators.export_speculators(tmp_path / "ours", tmp_path / "theirs", target=target)
    config = json.loads((out / "config.json").read_text())
    gamma = drafter.config.block_size
    assert config["aux_hidden_state_layer_ids"] == [l + 1 for l in target.layer_ids]
    assert config["mask_token_id"] == MASK_TOKEN_ID and config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == gamma
    assert config["draft_vocab_size"] == (drafter.config.vocab_size if vocab is None else vocab.numel())

    theirs = load_theirs(out)
    if vocab is not None:
        # speculators builds the model before it reads t2d from the weights, so it cannot pick the verifier's LM-head
        # rows during from_pretrained (vLLM selects them itself, by t2d): pick them now that t2d is loaded.
        theirs._load_verifier_weights(overwrite_lm_head=True)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert saved == set(theirs.state_dict()) - VERIFIER_OWNED  # nothing missing (HF would init it randomly), no extra
    assert torch.equal(theirs.embed_tokens.weight, target.embed_tokens.weight)  # reloaded from the verifier

    ids = target.encode(PROMPT)  # chat-templated
    S = len(ids)
    input_ids = torch.tensor([ids])
    _, features = target.forward_batch(input_ids, torch.ones_like(input_ids))  # [1, S, m·d]: our taps, concatenated
    # Their aux id l is HF's hidden_states[l]; the export maps our layer l (its output) to l + 1.
    hidden_states = target.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    assert torch.equal(torch.cat([hidden_states[l] for l in config["aux_hidden_state_layer_ids"]], -1), features)

    anchors = torch.arange(S - gamma)  # every position whose block stays inside the prompt (their anchor rule)
    logits, conf, h, base = their_outputs(theirs, input_ids, features, anchors, gamma)

    ours = load_drafter(tmp_path / "ours", target)
    positions = torch.arange(S)[None]
    prev = input_ids[0, anchors[:, None] + torch.arange(gamma)][None]  # [1, nb, γ]: x_0, then the true tokens
    with torch.no_grad():
        our_h = ours(input_ids[:, anchors], anchors[None], features, positions, torch.ones(1, S, dtype=torch.bool))
        our_logits, our_conf = ours.head_logits(our_h, prev)
    if vocab is not None:  # their logits are over the draft vocabulary's rows (their d2t maps them back)
        assert torch.equal(theirs.d2t + torch.arange(vocab.numel()), vocab) and int(theirs.t2d.sum()) == vocab.numel()
        our_logits = our_logits[..., vocab]
    torch.testing.assert_close(logits, our_logits[0], rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(conf, our_conf[0], rtol=0, atol=CONF_ATOL)
    if head != "none":  # the sequential head matters: it moves the argmax somewhere
        assert not torch.equal(logits.argmax(-1), base.argmax(-1))

    # Greedy drafting, ours through the cached-context inference path (one backbone call per anchor, so every 5th).
    some = torch.arange(0, anchors.numel(), 5)
    cache = ours.new_context_cache()
    cache.append(features[0], torch.arange(S))
    our_h = torch.stack([ours.backbone_cached(ids[a], int(a), cache) for a in anchors[some]])  # [n, γ, d]
    n = some.numel()
    draft = ours.sample_block(our_h, input_ids[0, anchors[some]], anchors[some], torch.zeros(n), seed=0,
                              request_ids=torch.arange(n))
    tokens, confs = their_greedy(theirs, h[some], base[some], input_ids[0, anchors[some]])
    assert torch.equal(tokens, draft.tokens)
    torch.testing.assert_close(confs, draft.conf_logits, rtol=0, atol=CONF_ATOL)
    # Our calibration rides along as an extra key that their config keeps (and vLLM does not read).
    assert theirs.config.sts_calibration == {"greedy": {"temperatures": [1.5] * 7, "biases": [-0.25] * 7,
                                                        "log_weights": [0.0] * 7}}
    assert theirs.config.source_drafter_config == drafter.config.to_dict()


def test_learned_mask_vector_is_refused(tmp_path, capsys):
    cfg = tiny_drafter_config(mask_token_id=None, qk_norm=True)
    save_drafter(DSparkDrafter(cfg), tmp_path / "ours")
    rc = export_speculators.main(["--drafter", str(tmp_path / "ours"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "learned vector" in err and "mask_token_id" in err
    assert not (tmp_path / "out").exists()  # refused before anything is loaded or written


def test_missing_qk_norm_is_refused():
    with pytest.raises(export_speculators.ExportError, match="q/k RMSNorm"):
        export_speculators.check_exportable(tiny_drafter_config(mask_token_id=5, qk_norm=False))


def test_the_shipped_drafter_is_exportable():
    """The drafter in checkpoints/ has a vocabulary-row mask token and q/k RMSNorm: vLLM can serve it."""
    from reference.config import DrafterConfig

    cfg = json.loads((Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-dspark"
                      / "config.json").read_text())["drafter"]
    export_speculators.check_exportable(DrafterConfig.from_dict(cfg))
