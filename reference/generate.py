"""The batched speculative decoding loop: prefill, then draft → schedule → verify → commit (docs/method.md §1–§5).

This is the plain synchronous loop, written for reading, not speed: every request keeps its own target KV cache
and drafter context cache, and the loop touches them one request at a time. ``optimized/`` runs the same method
batched on the device and must emit exactly the same tokens (the equivalence contract). The command line
(``python -m reference.generate``) is :mod:`reference.cli`; only :func:`main` is here.

One step, for the R unfinished requests of a batch::

    draft     drafter backbone over [x_0, M, …, M] + sequential head  → x_1..x_γ, p_d, confidences c_k
    schedule  calibrated prefix survivals a_{r,k} (STS) → verify lengths ℓ_r        (reference/scheduler.py)
    verify    target forward over [x_0, x_1..x_ℓ] → p_t; rejection sampling → accepted + 1 token
    commit    keep the target KV and drafter context of the accepted positions; the emitted token is the
              next anchor x_0

With the n-gram proposer (``reference/ngram.py``) in place of the drafter, *draft* is a lookup in the request's own
tokens (one-hot ``p_d``, no confidences, no drafter context) and *schedule* clips the mode's uniform ℓ to each
proposal's length. With the hybrid proposer (``reference/hybrid.py``), *draft* runs the drafter, then each request
takes the drafter's block or its n-gram continuation (whichever is expected to be accepted longer), *schedule* reads
the chosen block's survivals and clips ℓ to its length, and after *verify* the requests that verified an n-gram block
count its outcome.

Names follow ``docs/method.md`` (``p_t`` target, ``p_d`` draft, ``a`` prefix survival, ``ℓ`` verify length).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from reference.calibration import calibrated_survival
from reference.cli import (
    LOG_FORMAT,
    build_parser,
    print_results,
    setup_from_args,
)
from reference.config import GenerationConfig, SchedulerConfig, SchedulingMode
from reference.cost_model import CostTable, default_bucket_sizes, hardware_name, measure_cost_table
from reference.drafter import DSparkDrafter
from reference.hybrid import HybridProposer, HybridState
from reference.hybrid import check_mode as check_hybrid_mode
from reference.ngram import NgramDraft, NgramProposer, check_mode
from reference.sampling import Purpose, logits_to_probs, sample
from reference.scheduler import Scheduler, fold_recent
from reference.target import Target
from reference.verify import rejection_sample

log = logging.getLogger("dspark.generate")


@dataclass
class Request:
    """The state of one request in the loop (a tiny ``Sequence`` object, as in nano-vllm)."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    verify_lengths: list[int] = field(default_factory=list)  # ℓ chosen at each step
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted at each step (τ - 1)
    survivals: list[torch.Tensor] = field(default_factory=list)  # [γ] calibrated a_k of each step's draft
    recent: torch.Tensor | None = None  # [γ] the draft gate's moving average of those (reference.scheduler.fold_recent)
    hybrid: HybridState | None = None  # the hybrid proposer's per-request state (None with other proposers)
    proposal_sources: list[str] = field(default_factory=list)  # hybrid: what each step verified (reference/hybrid.py)
    # Per-request caches (not part of the result).
    kv: Any = None  # the target's KV cache, holding positions 0..anchor_pos-1
    ctx: Any = None  # the drafter's context cache, holding positions 0..anchor_pos-1

    @property
    def anchor(self) -> int:
        """x_0: the last emitted token."""
        return self.output_ids[-1]

    @property
    def anchor_pos(self) -> int:
        """Absolute position of x_0."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """What one prompt produced, with the per-step statistics the CLI prints."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    verify_lengths: list[int]
    accepted_lengths: list[int]
    text: str = ""
    # The hybrid proposer only: the source of each step's block, "dspark", "ngram" or "none" (no block: the draft gate
    # closed), aligned with verify_lengths. None with the other proposers (and left out of to_json).
    proposal_sources: list[str] | None = None

    @property
    def mean_accepted_length(self) -> float:
        """τ averaged over steps: accepted drafts + 1 emitted token (the prefill token is not a step)."""
        steps = len(self.accepted_lengths)
        return (sum(self.accepted_lengths) + steps) / steps if steps else 0.0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["proposal_sources"] is None:
            del d["proposal_sources"]
        d["mean_accepted_length"] = self.mean_accepted_length
        d["num_steps"] = len(self.accepted_lengths)
        return d


# ----------------------------------------------------------------------------------------------------------
# The stages of one step
# ----------------------------------------------------------------------------------------------------------


def prefill(target: Target, drafter: DSparkDrafter | None, req: Request, gen: GenerationConfig) -> None:
    """Run the prompt through the target; the last row gives the first token, sampled like a bonus token."""
    prompt = torch.tensor(req.prompt_ids, dtype=torch.long, device=target.device)  # [S]
    req.kv = target.new_cache()
    logits, features = target.forward(prompt, req.kv, start_pos=0)  # [S, V], [S, m*d]
    if drafter is not None:
        req.ctx = drafter.new_context_cache()
        req.ctx.append(features, torch.arange(len(req.prompt_ids), device=target.device))
    p_t = logits_to_probs(logits[-1:], *_sampling_params(gen, 1, target.device))  # [1, V]
    dev = target.device
    position = torch.tensor([len(req.prompt_ids)], device=dev)
    first = sample(p_t, gen.seed, torch.tensor([req.request_id], device=dev), position, int(Purpose.BONUS))
    _emit(target, req, [int(first)], gen)


def draft(drafter: DSparkDrafter, reqs: list[Request], gen: GenerationConfig):
    """The drafter proposes γ tokens per request; returns the DraftOutput and calibrated survivals [R, γ]."""
    h = torch.stack([drafter.backbone_cached(r.anchor, r.anchor_pos, r.ctx) for r in reqs])  # [R, γ, d]
    dev = h.device
    anchors = torch.tensor([r.anchor for r in reqs], device=dev)  # [R]
    anchor_pos = torch.tensor([r.anchor_pos for r in reqs], device=dev)  # [R]
    ids = torch.tensor([r.request_id for r in reqs], device=dev)  # [R]
    out = drafter.sample_block(h, anchors, anchor_pos, _sampling_params(gen, len(reqs), dev)[0], gen.seed, ids)
    survival = calibrated_survival(drafter.config, gen.decode_mode, out.conf_logits.float().cpu())  # [R, γ], host
    return out, survival


def hybrid_draft(proposer: HybridProposer, reqs: list[Request], gen: GenerationConfig):
    """The hybrid block of every request (reference/hybrid.py): the drafter's block and survivals, with the rows of the
    requests whose n-gram continuation is expected to be accepted longer replaced by it. Returns the block, the chosen
    survivals ``[R, γ]`` and each row's length cap ``[R]`` (γ, or the n-gram block's m)."""
    out, survival = draft(proposer.drafter, reqs, gen)  # the drafter runs for everybody: its a_k are the next E_d
    choices = proposer.choose([r.hybrid for r in reqs], [r.prompt_ids + r.output_ids for r in reqs], survival)
    return proposer.merge(out, survival, choices)


def lookup(proposer: NgramProposer, scheduler: Scheduler, reqs: list[Request], vocab_size: int):
    """The n-gram proposer's block for every request and its verify lengths ``[R]``: the mode's uniform ℓ (fixed
    or dsd), clipped to each proposal's length (reference/ngram.py)."""
    drafts: NgramDraft = proposer.draft([r.prompt_ids + r.output_ids for r in reqs], vocab_size)
    uniform = torch.full((len(reqs),), scheduler.uniform_length(len(reqs)), dtype=torch.long)  # [R]
    return drafts, torch.minimum(uniform, drafts.lengths)


def verify(target: Target, reqs: list[Request], drafts, lens: torch.Tensor, gen: GenerationConfig):
    """Target forward over [x_0, x_1..x_ℓ] per request, then lossless rejection sampling (docs/method.md §4).

    ``drafts`` holds ``tokens [R, γ]`` and ``probs [R, γ, V]`` (a drafter's ``DraftOutput`` or an ``NgramDraft``)."""
    gamma = drafts.tokens.shape[1]
    vocab = target.vocab_size
    dev = target.device
    target_probs = torch.zeros(len(reqs), gamma + 1, vocab, device=dev)  # [R, γ+1, V]; rows past ℓ_r unused
    features = []
    for i, r in enumerate(reqs):
        ell = int(lens[i])
        block = torch.tensor([r.anchor, *drafts.tokens[i, :ell].tolist()], device=target.device)  # [ℓ+1]
        logits, feats = target.forward(block, r.kv, start_pos=r.anchor_pos)  # [ℓ+1, V], [ℓ+1, m*d]
        target_probs[i, : ell + 1] = logits_to_probs(logits[None], *_sampling_params(gen, 1, dev))[0]
        features.append(feats)
    ids = torch.tensor([r.request_id for r in reqs], device=dev)
    anchor_pos = torch.tensor([r.anchor_pos for r in reqs], device=dev)
    result = rejection_sample(drafts.tokens.to(dev), lens.to(dev), drafts.probs.to(dev), target_probs, gen.seed, ids,
                              anchor_pos)
    return result, features


def commit(target: Target, req: Request, tokens: list[int], features: torch.Tensor | None,
           gen: GenerationConfig) -> None:
    """Keep the caches of the accepted positions and append the emitted tokens.

    ``tokens`` are the accepted drafts plus the recovered/bonus token. The target KV cache and the drafter
    context gain positions anchor_pos..anchor_pos+accepted (x_0 and the accepted drafts); the last emitted
    token becomes the next anchor, whose features do not exist yet (docs/method.md §1).
    """
    start, keep = req.anchor_pos, len(tokens)  # positions start..start+keep-1 are now verified
    target.crop(req.kv, start + keep)
    if req.ctx is not None and features is not None:
        req.ctx.append(features[:keep], torch.arange(start, start + keep, device=features.device))
    _emit(target, req, tokens, gen)


def _emit(target: Target, req: Request, tokens: list[int], gen: GenerationConfig) -> None:
    """Append emitted tokens, stopping at EOS (tokens after an accepted EOS are dropped) or the length limit."""
    for tok in tokens:
        req.output_ids.append(tok)
        if not gen.ignore_eos and tok in target.eos_token_ids:
            req.finish_reason = "stop"
            return
        if len(req.output_ids) >= gen.max_new_tokens:
            req.finish_reason = "length"
            return
        if len(req.prompt_ids) + len(req.output_ids) >= max_positions(target):
            req.finish_reason = "length"  # the next anchor would sit past the model's position range
            return


# ----------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def generate(
    target: Target,
    drafter: DSparkDrafter | NgramProposer | HybridProposer | None,
    prompts: list[list[int]],
    gen: GenerationConfig,
    sched: SchedulerConfig,
    cost: CostTable | None = None,
    request_ids: list[int] | None = None,
    progress: bool = False,
) -> list[GenerationResult]:
    """Decode a batch of tokenised prompts with speculative decoding; all prompts form one batch.

    Args:
        target: the target model (the output distribution is the target's, whatever the drafter does).
        drafter: the DSpark drafter, the n-gram proposer (modes none, fixed and dsd only), or the hybrid of the two
            (every mode but oracle); may be None only in mode "none".
        prompts: token ids per prompt (chat template already applied).
        gen: sampling, seed and limits.
        sched: the verify-length policy (docs/method.md §5).
        cost: the SPS table for the adaptive modes.
        request_ids: ids keying the random numbers (default 0..R-1); a request's output depends only on
            its own id, prompt and the seed, never on its neighbours in the batch.
    """
    mode = sched.mode
    if mode.drafts and drafter is None:
        raise ValueError(f"mode '{mode}' needs a drafter")
    if isinstance(drafter, NgramProposer):
        check_mode(mode)
    if isinstance(drafter, HybridProposer):
        check_hybrid_mode(mode)
    if mode.needs_cost_table and cost is None:
        raise ValueError(f"mode '{mode}' needs a cost table (see reference.cost_model)")
    ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
    if len(ids) != len(prompts) or len(set(ids)) != len(ids):
        raise ValueError("request_ids must be unique, one per prompt")
    gamma = drafter.config.gamma if mode.drafts else 0
    scheduler = Scheduler(sched, gamma=gamma, cost=cost)
    hybrid = isinstance(drafter, HybridProposer) and mode.drafts
    model = drafter.drafter if hybrid else drafter
    features_to = model if mode.drafts and isinstance(model, DSparkDrafter) else None  # who reads the features

    reqs = [Request(request_id=i, prompt_ids=list(p),
                    hybrid=drafter.new_state(sampling=gen.temperature > 0) if hybrid else None)
            for i, p in zip(ids, prompts)]
    for r in reqs:
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id}: empty prompt")
        prefill(target, features_to, r, gen)

    bar = _progress(progress, sum(gen.max_new_tokens for _ in reqs))
    while active := [r for r in reqs if not r.finished]:
        step(target, drafter, scheduler, active, gen)
        bar.update(sum(len(r.output_ids) for r in reqs) - bar.n)
    bar.close()
    return [_result(target, r) for r in reqs]


def step(target: Target, drafter: DSparkDrafter | NgramProposer | HybridProposer | None, scheduler: Scheduler,
         reqs: list[Request], gen: GenerationConfig) -> None:
    """One speculative step for the active requests: draft, schedule, verify, commit."""
    mode = scheduler.config.mode
    if not mode.drafts:
        drafts = _empty_draft(len(reqs), target.vocab_size)
        lens = torch.zeros(len(reqs), dtype=torch.long)
    elif isinstance(drafter, NgramProposer):
        drafts, lens = lookup(drafter, scheduler, reqs, target.vocab_size)
    elif not scheduler.should_draft(_recent_survivals(reqs, scheduler.gamma), scheduler.steps_without_draft,
                                    num_anchor_tokens=len(reqs)):
        # The draft gate (adaptive mode): plain decoding is expected to be faster this step, so nobody drafts.
        scheduler.steps_without_draft += 1
        drafts = _empty_draft(len(reqs), target.vocab_size)
        lens = torch.zeros(len(reqs), dtype=torch.long)
    else:
        # A draft after plain steps (a probe of the closed gate, or its reopening) restarts each request's moving
        # average: the survivals folded before the plain run describe text that has since been decoded.
        restart = scheduler.steps_without_draft > 0
        scheduler.steps_without_draft = 0
        caps = None  # [R] the most slots each block can verify (the hybrid's n-gram blocks may be shorter than γ)
        if isinstance(drafter, HybridProposer):
            drafts, survival, caps = hybrid_draft(drafter, reqs, gen)  # the chosen blocks and their survivals
        else:
            drafts, survival = draft(drafter, reqs, gen)  # survival [R, γ]
        stale = _stale_survivals(reqs, scheduler.config.staleness, survival.shape[1])
        if mode is SchedulingMode.ORACLE:
            lens = torch.full((len(reqs),), drafts.tokens.shape[1], dtype=torch.long)  # verify all, count less
        else:
            lens = scheduler.lengths(survival, a_stale=stale, num_anchor_tokens=len(reqs))
        if caps is not None:
            lens = torch.minimum(lens, caps)
        for r, a in zip(reqs, survival):
            r.survivals.append(a)
            r.recent = fold_recent(torch.full_like(a, float("nan")) if r.recent is None or restart else r.recent, a,
                                   scheduler.config.gate_window)

    result, features = verify(target, reqs, drafts, lens, gen)
    if mode is SchedulingMode.ORACLE:
        # The oracle verifies exactly the accepted prefix + the rejected slot (so the emitted token is the same
        # recovered token); it is simulated by verifying everything and recording the shorter length.
        lens = torch.clamp(result.num_accepted + 1, max=drafts.tokens.shape[1])
    for i, r in enumerate(reqs):
        n = int(result.num_emitted[i])
        r.verify_lengths.append(int(lens[i]))
        r.accepted_lengths.append(n - 1)
        if r.hybrid is not None:  # an n-gram block's outcome joins the request's acceptance counts
            r.proposal_sources.append(r.hybrid.observe(int(lens[i]), n - 1))
        commit(target, r, result.tokens[i, :n].tolist(), features[i], gen)


def _recent_survivals(reqs: list[Request], gamma: int) -> torch.Tensor | None:
    """The draft gate's input [R, γ]: each request's moving average (NaN rows for requests that never drafted);
    None when none has drafted."""
    if all(r.recent is None for r in reqs):
        return None
    return torch.stack([torch.full((gamma,), float("nan")) if r.recent is None else r.recent for r in reqs])


def _stale_survivals(reqs: list[Request], staleness: int, gamma: int) -> torch.Tensor:
    """a_stale [R, γ]: each request's survivals from ``staleness`` steps ago; NaN rows for requests too new.

    The current step's survivals are appended after this call, so ``survivals[-staleness]`` is the draft
    made ``staleness`` steps before the current one (staleness=0 means "the current draft", for studies).
    """
    rows = []
    for r in reqs:
        if staleness == 0:
            rows.append(None)
        elif len(r.survivals) >= staleness:
            rows.append(r.survivals[-staleness])
        else:
            rows.append(torch.full((gamma,), float("nan")))
    if staleness == 0:
        return None
    return torch.stack(rows)


def max_positions(target: Target) -> int:
    """The target's context window (positions 0..max-1)."""
    return int(getattr(target.config, "max_position_embeddings", None) or 2**31 - 1)


def _empty_draft(num_requests: int, vocab: int):
    """No draft (mode ``none``, or the draft gate closed): a one-slot placeholder block that is never verified (ℓ = 0
    for every request)."""
    from reference.drafter import DraftOutput

    return DraftOutput(
        tokens=torch.zeros(num_requests, 1, dtype=torch.long),
        probs=torch.full((num_requests, 1, vocab), 1.0 / vocab),
        conf_logits=torch.zeros(num_requests, 1),
    )


def _result(target: Target, r: Request) -> GenerationResult:
    text = target.decode(r.output_ids) if target.tokenizer is not None else ""
    return GenerationResult(r.request_id, r.prompt_ids, r.output_ids, r.finish_reason or "length",
                            r.verify_lengths, r.accepted_lengths, text,
                            r.proposal_sources if r.hybrid is not None else None)


def _sampling_params(gen: GenerationConfig, n: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request temperature, top-p and top-k tensors [n] (one config for the whole batch)."""
    return (torch.full((n,), float(gen.temperature), device=device),
            torch.full((n,), float(gen.top_p), device=device),
            torch.full((n,), int(gen.top_k), dtype=torch.long, device=device))


def _progress(enabled: bool, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="tok", desc="generate")


# ----------------------------------------------------------------------------------------------------------
# The loop's own cost table (the CLI measures it when no --cost-table is given)
# ----------------------------------------------------------------------------------------------------------


def measure_reference_cost_table(target: Target, drafter: DSparkDrafter, max_requests: int,
                                 repeats: int = 3) -> CostTable:
    """Time dummy verify forwards and drafter steps of this loop (the reference's own SPS curve)."""
    gamma = drafter.config.block_size
    ctx_len = 64  # a short, realistic context: long profiling contexts inflate the fixed cost
    dummy = torch.zeros(ctx_len, dtype=torch.long, device=target.device)

    def verify_fn(n: int) -> None:
        kv = target.new_cache()
        target.forward(dummy, kv, start_pos=0)
        target.forward(torch.zeros(n, dtype=torch.long, device=target.device), kv, start_pos=ctx_len)

    ctx = drafter.new_context_cache()
    ctx.append(torch.zeros(ctx_len, drafter.config.num_taps * drafter.config.hidden_size, device=target.device,
                           dtype=target.dtype), torch.arange(ctx_len, device=target.device))

    def draft_fn(r: int) -> None:
        h = torch.stack([drafter.backbone_cached(0, ctx_len, ctx) for _ in range(r)])
        dev = target.device
        drafter.sample_block(h, torch.zeros(r, dtype=torch.long, device=dev), torch.full((r,), ctx_len, device=dev),
                             torch.zeros(r, device=dev), 0, torch.arange(r, device=dev))

    sizes = default_bucket_sizes(max_requests * (gamma + 1))
    return measure_cost_table(verify_fn, draft_fn, sizes, list(range(1, max_requests + 1)), repeats=repeats,
                              warmup=1, hardware=hardware_name(target.device), progress=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m reference.generate`` (flags: :func:`reference.cli.build_parser`)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    target, drafter, gen, sched, prompts = setup_from_args(args)
    cost = None
    if sched.mode.needs_cost_table:
        if args.cost_table:
            cost = CostTable.load(args.cost_table)
        else:
            log.info("no --cost-table: measuring this machine's SPS curve (pass --cost-table to reuse one)")
            model = drafter.drafter if isinstance(drafter, HybridProposer) else drafter
            cost = measure_reference_cost_table(target, model, max_requests=len(prompts))
    t0 = time.perf_counter()
    results = generate(target, drafter, prompts, gen, sched, cost, progress=not args.json)
    print_results(results, args.json, time.perf_counter() - t0, sched.mode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
