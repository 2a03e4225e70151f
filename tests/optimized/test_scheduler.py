"""The engine's host planning (``optimized/scheduler.py``): admission, chunked prefill and the typed ``StepPlan``.

Host-only: no model, no device. The plans are compared with what the reference policy decides for the same inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from optimized.scheduler import PrefillChunk, Scheduler, StepPlan
from optimized.sequence import SamplingParams, Sequence, Status
from reference.config import SchedulerConfig, SchedulingMode
from reference.cost_model import CostTable
from reference.scheduler import Scheduler as Policy
from reference.scheduler import (
    calibrate_rows,
    finish_survivals,
    outcome_factors,
    outcome_row,
    population_rows,
    stale_budget,
)

GAMMA = 4


def _scheduler(mode: str, **kw) -> Scheduler:
    cost = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, sizes=list(range(1, 129)))
    return Scheduler(SchedulerConfig(mode=mode, **kw), gamma=GAMMA if mode != "none" else 0, max_num_seqs=2,
                     max_seq_len=64, prefill_chunk=6, cost=cost)


def _seq(rid: int, prompt_len: int) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(range(2, 2 + prompt_len)), params=SamplingParams())


def test_admission_and_chunked_prefill():
    sched = _scheduler("fixed", k=3)
    seqs = [_seq(0, 4), _seq(1, 5), _seq(2, 1)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    # Two slots: the third request waits. Six prompt tokens per step: request 1 gets the two left after request 0.
    assert [s.status for s in seqs] == [Status.PREFILL, Status.PREFILL, Status.WAITING]
    assert plan.prefill == [PrefillChunk(seqs[0], 0, 4), PrefillChunk(seqs[1], 0, 2)]
    assert [c.completes for c in plan.prefill] == [True, False]
    assert plan.decoding == [] and plan.num_verify_tokens == 0
    seqs[0].status = Status.DECODE  # what postprocess does after the first token
    plan = sched.schedule()
    assert plan.prefill == [PrefillChunk(seqs[1], 2, 3)] and plan.prefill[0].completes
    assert plan.decoding == [seqs[0]] and plan.mode is SchedulingMode.FIXED and plan.lengths == [3]
    assert plan.num_verify_tokens == 1 + 3
    sched.finish(seqs[0], "stop")  # its slot goes to the waiting request
    plan = sched.schedule()
    assert seqs[2].status is Status.PREFILL and seqs[2].slot == seqs[0].slot
    assert plan.prefill[-1] == PrefillChunk(seqs[2], 0, 1)


def _decoding(sched: Scheduler, survivals: list[list[torch.Tensor]]) -> list[Sequence]:
    seqs = [_seq(i, 3) for i in range(len(survivals))]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s, rows in zip(seqs, survivals):
        s.status, s.num_prefilled, s.survivals = Status.DECODE, 3, list(rows)
    return seqs


def test_plans_follow_the_reference_policy():
    gen = torch.Generator().manual_seed(0)
    row = lambda: torch.cumprod(torch.rand(GAMMA, generator=gen), 0)  # noqa: E731
    history = [[row(), row(), row()], [row()]]  # request 1 is too new for a stale row
    for mode, kw in [("fixed", {"k": 2}), ("dsd", {"dsd_table": {1: 4, 2: 3}}), ("oracle", {}), ("none", {}),
                     ("adaptive", {"staleness": 2}), ("threshold", {"threshold": 0.3}), ("adaptive-sync", {})]:
        sched = _scheduler(mode, **kw)
        seqs = _decoding(sched, history if mode != "none" else [[], []])
        plan = sched.schedule()
        assert isinstance(plan, StepPlan) and plan.decoding == seqs and plan.prefill == []
        policy = Policy(sched.config, gamma=sched.gamma, cost=sched.cost)
        if mode in ("fixed", "dsd"):
            assert plan.lengths == policy.lengths(torch.zeros(2, GAMMA)).tolist() and plan.budget is None
        elif mode == "oracle":
            assert plan.lengths == [GAMMA, GAMMA]
        elif mode == "none":
            assert plan.mode is SchedulingMode.NONE and plan.lengths == [0, 0] and plan.num_verify_tokens == 2
        elif mode == "adaptive":
            stale = torch.stack([history[0][0], torch.full((GAMMA,), float("nan"))])
            assert plan.budget == stale_budget(stale, sched.cost, 2) and plan.lengths is None
            assert plan.num_verify_tokens == 2 + plan.budget
        else:  # synchronous: the lengths come after the current survivals are read
            assert plan.lengths is None and plan.budget is None and plan.mode.synchronous
            current = torch.stack([h[-1] for h in history])
            sched.synchronous_lengths(plan, current)
            assert plan.lengths == policy.lengths(current, num_anchor_tokens=2).tolist()


def test_gate_closed_plans_plain_decoding():
    sched = _scheduler("adaptive")
    _decoding(sched, [[torch.tensor([0.9, 0.8, 0.7, 0.6])]])
    sched.drafted = False  # the gate closed at the end of the last step: nobody holds drafts
    plan = sched.schedule()
    assert plan.mode is SchedulingMode.NONE and plan.lengths == [0] and plan.budget is None


def test_record_drafts_keeps_numpy_row_views_and_plans_as_the_reference():
    """The drafts' host survivals are kept as NumPy views of the ``[R, γ]`` host tensor (no copy, no read); the stale
    budget planned from them is the reference's."""
    sched = _scheduler("adaptive", staleness=1)
    seqs = _decoding(sched, [[], []])
    gen = torch.Generator().manual_seed(1)
    drafts = [torch.cumprod(torch.rand(2, GAMMA, generator=gen), 1) for _ in range(2)]  # [R, γ] host copies
    for host in drafts:
        sched.record_drafts(seqs, host)
    for r, s in enumerate(seqs):
        assert all(isinstance(a, np.ndarray) for a in s.survivals)
        assert all(np.shares_memory(a, host.numpy()) and np.array_equal(a, host[r]) for a, host in zip(s.survivals,
                                                                                                         drafts))
    plan = sched.schedule()
    assert plan.budget == stale_budget(drafts[0], sched.cost, 2)  # staleness 1: the draft before the current one


def test_budgets_without_stale_rows_take_the_reference_prior_across_batches():
    """A step in which no request has a stale row (the first ``staleness`` steps of a request that arrives alone, or
    of a batch that starts together) fills every row with the mean stale curve of the last step that had one: the
    engine's budgets equal those of the reference policy stepped through the same stale matrices — with the budget
    planned during the verify (``plan_ahead``) or at the schedule, and with the prior kept between batches."""
    gen = torch.Generator().manual_seed(3)
    row = lambda: torch.cumprod(0.55 + 0.45 * torch.rand(GAMMA, generator=gen), 0)  # noqa: E731
    for ahead in (False, True):
        sched = _scheduler("adaptive", staleness=2)
        policy = Policy(sched.config, gamma=sched.gamma, cost=sched.cost)
        budgets, expected = [], []
        for _batch in range(3):  # each batch starts with no stale row; the first has no prior either
            seqs = _decoding(sched, [[], []])
            for _step in range(4):
                rows = torch.stack([row(), row()])  # [R, γ] this step's drafts
                sched.record_drafts(seqs, rows)
                stale = torch.stack([torch.from_numpy(s.survivals[-3]) if len(s.survivals) > 2
                                     else torch.full((GAMMA,), float("nan")) for s in seqs])
                expected.append(int(policy.lengths(rows, a_stale=stale, num_anchor_tokens=2).sum()))
                budgets.append(sched.schedule().budget)
                if ahead:  # the next step's budget, planned while this one verifies
                    sched.plan_ahead()
            for s in seqs:
                sched.finish(s, "length")
        assert budgets == expected, (ahead, budgets, expected)
        assert (sched.ahead_hits > 0) == ahead
        # the batches after the first budget their first two steps from the prior, not zeros
        assert expected[0] == expected[1] == 0 and expected[4] > 0 and expected[8] > 0


def test_emitting_tokens_at_once_finishes_as_token_by_token():
    """The fast commit (no logprobs, no stop strings) keeps the same tokens and finishes for the same reason as the
    token-by-token loop: EOS before, at and after the length limit and the end of the slot, ignore_eos, empty steps."""
    rng = np.random.default_rng(0)
    sched = {}
    for path in ("plain", "each"):
        sched[path] = Scheduler(SchedulerConfig(mode="fixed", k=3), gamma=3, max_num_seqs=1, max_seq_len=24,
                                prefill_chunk=64, eos_token_ids=[2, 7])
    cases = 0
    for _ in range(3000):
        prompt = [1] * int(rng.integers(1, 12))
        params = dict(max_new_tokens=int(rng.integers(1, 14)), ignore_eos=bool(rng.integers(0, 4) == 0))
        out0 = [int(t) for t in rng.integers(3, 9, size=int(rng.integers(1, 6)))]
        tokens = [int(t) for t in rng.integers(0, 10, size=int(rng.integers(0, 6)))]
        results = []
        for path, s in sched.items():
            seq = Sequence(request_id=0, prompt_ids=prompt, params=SamplingParams(**params), slot=0,
                           status=Status.DECODE, output_ids=list(out0))
            s.running, s.free_slots = [seq], []
            emit = s.postprocess([seq], [tokens], None)[0] if path == "plain" else s._emit_each(seq, tokens, [])
            results.append((emit, seq.output_ids, seq.finish_reason, seq.status, s.free_slots))
        assert results[0] == results[1], (prompt, params, out0, tokens)
        cases += results[0][2] is not None
    assert cases > 500  # both reasons and both paths were exercised often


def _finishing(survival_rows: list[float], waiting: int = 0) -> tuple[Scheduler, list[Sequence]]:
    """An adaptive scheduler whose decoding requests have drafted once (per-slot acceptance ``p`` each), 40 tokens to
    go each, ``waiting`` more requests queued behind them, and the finish-time gate on."""
    cost = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=2.0, sizes=list(range(1, 129)))
    r = len(survival_rows)
    sched = Scheduler(SchedulerConfig(mode="adaptive"), gamma=GAMMA, max_num_seqs=r, max_seq_len=64,
                      prefill_chunk=64, cost=cost)
    sched.finish_time_gate = True
    seqs = [Sequence(request_id=i, prompt_ids=[2, 3, 4], params=SamplingParams(max_new_tokens=40))
            for i in range(r + waiting)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s, p in zip(seqs, survival_rows):  # gate_window drafts each: the finish-time gate decides from then on
        s.status, s.num_prefilled = Status.DECODE, 3
        s.survivals = [np.cumprod(np.full(GAMMA, p, dtype=np.float32))] * sched.config.gate_window
    return sched, seqs[:r]


def test_the_finish_time_gate_reads_each_requests_pooled_mean():
    """The gate keeps, per slot, the sum and the sum of squares of every draft it folds: the finish-time estimate's
    rows are reference.scheduler.finish_survivals of each request's mean and variance over all its drafts (not the
    moving average of the last few); a slot that changes hands starts again."""
    sched, seqs = _finishing([0.9, 0.7, 0.5, 0.2])
    rng = np.random.default_rng(0)
    for s in seqs:  # drafts that vary from one to the next
        s.survivals = [np.cumprod(np.clip(rng.normal(s.survivals[0][0], 0.1, GAMMA), 0.01, 1.0)).astype(np.float32)
                       for _ in range(7)]
    gate = sched.gate
    assert gate.track  # the finish-time gate keeps the statistics
    recent = gate.recent_survivals(seqs)  # folds every draft
    hist = [np.array(s.survivals, dtype=np.float64) for s in seqs]  # [n, γ] each
    want = finish_survivals(torch.tensor(np.stack([h.mean(0) for h in hist])),
                            torch.tensor(np.stack([h.var(0, ddof=1) for h in hist])), torch.tensor([7] * 4))
    np.testing.assert_allclose(gate.finish_survivals(seqs, recent), want.numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(gate.finish_survivals(seqs, recent), recent)
    newcomer = Sequence(request_id=99, prompt_ids=[2], params=SamplingParams(max_new_tokens=8), slot=seqs[0].slot)
    newcomer.survivals = [np.full(GAMMA, 0.5, dtype=np.float32)] * 2
    gate.recent_survivals([newcomer] + seqs[1:])  # its two drafts only, not the slot's previous owner's seven
    moments = gate._moments[newcomer.slot]  # [Σ a | Σ a² | n]
    assert gate._count[newcomer.slot] == 2 and moments[2 * GAMMA] == 2
    assert np.allclose(moments[:GAMMA], 1.0) and np.allclose(moments[GAMMA:2 * GAMMA], 0.5)
    sched.finish_time_gate = False  # off: nothing is kept, and the estimate would read the moving averages
    assert not gate.track and gate.finish_survivals(seqs, recent) is recent


def test_the_finish_time_gate_scales_each_request_by_its_outcomes():
    """With ``outcomes`` on (off by default: nothing is summed), the gate sums, per slot, each verified draft's
    expected and accepted drafts (reference.scheduler.outcome_row) while it keeps statistics; the estimate's rows
    are then finish_survivals times each request's outcome_factors (reference.scheduler.calibrate_rows), relative to
    the batch once a batch-wide calibration scales the survivals; a request that verified no draft adds nothing, and
    a slot that changes hands starts again."""
    sched, seqs = _finishing([0.8, 0.8, 0.8, 0.8])
    gate = sched.gate
    recent = gate.recent_survivals(seqs)
    gate.record_outcomes(seqs, [s.survivals[-1] for s in seqs], [4] * 4, [0] * 4)
    assert not gate.outcomes and not gate._outcomes.any()  # off: nothing summed
    gate.outcomes = True
    base = gate.finish_survivals(seqs, recent)  # no outcomes yet: the pooled means alone
    rng = np.random.default_rng(1)
    want = torch.zeros(4, 6, dtype=torch.float64)
    for _ in range(6):
        rows = [np.cumprod(np.clip(rng.normal(0.8, 0.05, GAMMA), 0.01, 1.0)).astype(np.float32) for _ in seqs]
        verified = [4, 3, 4, 0]  # the last request verified no draft this step
        accepted = [4, 3, int(rng.integers(0, 2)), 0]  # the third request lags its forecast
        gate.record_outcomes(seqs, rows[:3] + [None], verified, accepted)
        for i in range(3):
            want[i] += outcome_row(torch.from_numpy(rows[i]), verified[i], accepted[i])
    np.testing.assert_allclose(gate._outcomes[[s.slot for s in seqs]], want.numpy(), rtol=1e-6)
    factors = outcome_factors(want)
    assert factors[2] < factors[0]
    got = gate.finish_survivals(seqs, recent)
    np.testing.assert_allclose(got, calibrate_rows(torch.from_numpy(base), factors).numpy(), rtol=1e-6)
    sched.set_survival_scale(np.ones(GAMMA))  # a batch-wide calibration in force: each request against the batch
    np.testing.assert_allclose(gate.finish_survivals(seqs, recent),
                               calibrate_rows(torch.from_numpy(base), outcome_factors(want, relative=True)).numpy(),
                               rtol=1e-6)
    newcomer = Sequence(request_id=99, prompt_ids=[2], params=SamplingParams(max_new_tokens=8), slot=seqs[0].slot)
    gate.record_outcomes([newcomer], [np.full(GAMMA, 0.5, dtype=np.float32)], [2], [1])
    np.testing.assert_allclose(gate._outcomes[newcomer.slot], [1, 1.0, 1, 1.0, 1, 1.0])
    sched.finish_time_gate = False  # off: nothing is summed
    gate.record_outcomes([newcomer], [np.full(GAMMA, 0.5, dtype=np.float32)], [2], [1])
    assert gate._outcomes[newcomer.slot][0] == 1


def test_the_finish_time_gate_weighs_the_slowest_request():
    """Three requests whose drafts nearly always pass and one whose drafts nearly never do: one step's Θ says draft,
    but the laggard finishes no sooner drafting, so the closed batch decodes plainly (and does not probe while it
    holds the same requests); four good requests draft. While requests wait for a slot, the ordinary gate decides."""
    sched, seqs = _finishing([0.95, 0.95, 0.95, 0.05])
    assert sched.planner.speculation_pays(np.array([s.survivals[-1] for s in seqs]), 4, check=False)
    assert sched.drafters() == []
    for _ in range(sched.config.probe_every + 2):  # plain steps: the verdict stands, no probing draft
        assert sched.drafters() == []
    sched.finish_time_gate = False  # the ordinary gate drafts for the same batch
    assert sched.drafters() == seqs

    sched, seqs = _finishing([0.95] * 4)
    assert sched.drafters() == seqs

    sched, seqs = _finishing([0.95, 0.95, 0.95, 0.05], waiting=1)
    assert sched.drafters() == seqs and not sched.gate.finishing

    sched, seqs = _finishing([0.95, 0.95, 0.95, 0.05])  # one draft fewer than the window: the ordinary gate
    for s in seqs:
        s.survivals = s.survivals[1:]
    assert sched.drafters() == seqs

    sched, seqs = _finishing([0.05])  # one request: the ordinary gate, which probes again after probe_every steps
    steps = [sched.drafters() for _ in range(sched.config.probe_every + 1)]
    assert not sched.gate.finishing
    assert steps[:-1] == [[]] * sched.config.probe_every and steps[-1] == seqs


def _next_batch(sched: Scheduler, done: list[Sequence], tag: int) -> list[Sequence]:
    """Finish ``done`` and put a batch of as many new requests, none of which has drafted, in their slots."""
    fresh = []
    for i, old in enumerate(done):
        sched.finish(old, "length")
        s = Sequence(request_id=tag + i, prompt_ids=[2, 3, 4], params=SamplingParams(max_new_tokens=40))
        sched.add(s)
        fresh.append(s)
    sched.schedule()
    for s in fresh:
        s.status, s.num_prefilled = Status.DECODE, 3
    return fresh


def test_a_finishing_batch_is_judged_on_the_requests_before_it():
    """The mean survivals of each request that leaves its slot after gate_window drafts join the gate's history
    (only while it keeps statistics); once the history holds PRIOR_MIN rows, a finishing batch that has not drafted
    is judged at once on stand-ins from it (reference.scheduler.population_rows): a batch after laggards decodes
    plainly from its first step, without the drafts the gate would otherwise need to judge it, and a batch after
    fast requests drafts. Short of PRIOR_MIN rows, or with requests waiting, the gate drafts to find out, as before."""
    from optimized.scheduler import DraftGate

    rows = [0.95] * 24 + [0.05] * 8  # a quarter of the traffic has drafts that nearly never pass
    sched, seqs = _finishing(rows)
    gate, k = sched.gate, DraftGate.PRIOR_MIN
    assert len(rows) == k
    assert sched.drafters() == []  # this batch's own drafts: the laggards set the finish time
    fresh = _next_batch(sched, seqs, 100)
    assert sched.drafters() == []  # the first batch's rows joined the history: plain from the first step
    want = {tuple(np.cumprod(np.full(GAMMA, p, dtype=np.float32))) for p in (0.95, 0.05)}
    assert len(gate.history) == k and {tuple(h) for h in gate.history} == want
    assert all(not s.survivals for s in fresh)
    np.testing.assert_array_equal(gate.prior_survivals(fresh),
                                  population_rows(torch.tensor(np.stack(gate.history)), k).numpy())
    for _ in range(sched.config.probe_every + 2):  # the verdict stands: no probe
        assert sched.drafters() == []
    sched.add(Sequence(request_id=999, prompt_ids=[2], params=SamplingParams(max_new_tokens=4)))
    assert sched.drafters() == fresh  # a request waits: the ordinary gate, which knows nothing yet, drafts

    sched, seqs = _finishing([0.95] * k)  # fast traffic: the batch after it drafts
    assert sched.drafters() == seqs
    fresh = _next_batch(sched, seqs, 100)
    assert sched.drafters() == fresh and len(sched.gate.history) == k

    sched, seqs = _finishing(rows)  # one request short of gate_window drafts: k - 1 rows, too few to judge on
    seqs[0].survivals = seqs[0].survivals[1:]
    sched.drafters()
    fresh = _next_batch(sched, seqs, 100)
    assert sched.drafters() == fresh and len(sched.gate.history) == k - 1

    sched, seqs = _finishing(rows)
    sched.finish_time_gate = False  # no statistics kept: no history
    sched.drafters()
    fresh = _next_batch(sched, seqs, 100)
    assert sched.drafters() == fresh and len(sched.gate.history) == 0


def test_the_gate_reuses_its_verdict_only_for_the_same_requests_holding_the_same_drafts():
    """The draft gate's verdict is cached without reading the requests: reused for the same request objects in the
    same order with no draft recorded since (and the same finishing flag), evaluated again after any new draft, for
    another set of requests of the same size, or in another order; a reused verdict is what a fresh gate decides."""
    from optimized.scheduler import DraftGate

    cost = CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, draft_fixed_ms=2.0, sizes=list(range(1, 129)))
    sched = Scheduler(SchedulerConfig(mode="adaptive"), gamma=GAMMA, max_num_seqs=6, max_seq_len=64,
                      prefill_chunk=64, cost=cost)
    rows = [np.cumprod(np.full(GAMMA, p, dtype=np.float32)) for p in (0.9, 0.2, 0.6, 0.95, 0.1, 0.4)]
    seqs = _decoding(sched, [[torch.from_numpy(r)] for r in rows])
    gate, calls = sched.gate, []
    pays = sched.planner.speculation_pays
    sched.planner.speculation_pays = lambda *a, **k: calls.append(len(a[0])) or pays(*a, **k)

    def fresh_verdict(group: list[Sequence]) -> bool:
        twin = DraftGate(sched.config, GAMMA, 6, sched.planner)
        return twin._evaluate(group)[1]

    sched.drafters(seqs[:4])
    assert calls == [4]
    sched.drafters(seqs[:4])
    sched.drafters(list(seqs[:4]))  # another list of the same objects: reused
    assert calls == [4]
    sched.record_drafts(seqs[:4], rows[:4])  # a new draft: evaluated again
    sched.drafters(seqs[:4])
    assert len(calls) == 2
    sched.drafters(seqs[:3] + seqs[4:5])  # as many requests, one of them another: evaluated again
    assert len(calls) == 3
    sched.drafters([seqs[1], seqs[0], seqs[2], seqs[4]])  # the same requests in another order: evaluated again
    assert len(calls) == 4
    sched.drafters(seqs[:5])  # one more request: evaluated again
    assert len(calls) == 5
    calls.clear()
    for group in (seqs[:4], seqs[1:5], seqs):
        cached = gate._evaluate(group)[1]
        assert cached == fresh_verdict(group) and gate._evaluate(group)[1] == cached


def test_stand_ins_are_population_rows_of_the_history_as_it_is_now():
    """The gate ranks its history once until it changes: its stand-ins for any number of requests are
    ``population_rows`` of the history at that moment, before and after more requests join it."""
    rows = [0.95, 0.3, 0.7, 0.05, 0.5, 0.9, 0.2, 0.8] * 4
    sched, seqs = _finishing(rows)
    sched.drafters()
    fresh = _next_batch(sched, seqs, 100)
    sched.drafters()  # the new requests claim their slots: the first batch's rows join the history
    gate = sched.gate
    for count in (1, 2, 5, 31, 32, 33, 100):
        np.testing.assert_array_equal(gate._stand_ins(count),
                                      population_rows(torch.tensor(np.stack(gate.history)), count).numpy())
    rows_fresh = [np.cumprod(np.full(GAMMA, 0.1 + 0.02 * i, dtype=np.float32)) for i in range(len(fresh))]
    for _ in range(sched.config.gate_window):  # the new batch drafts gate_window times, its rows unlike the first's
        sched.record_drafts(fresh, rows_fresh)
    sched.drafters()
    _next_batch(sched, fresh, 200)
    sched.drafters()
    assert len(gate.history) == 2 * len(rows)
    for count in (1, 7, 64, 65):
        np.testing.assert_array_equal(gate._stand_ins(count),
                                      population_rows(torch.tensor(np.stack(gate.history)), count).numpy())


def test_population_rows_take_evenly_spaced_quantiles():
    """``reference.scheduler.population_rows``: rows ranked by expected accepted drafts, taken at the (i + ½)/n
    quantiles; n = H returns every row once, slowest first; one row for many requests repeats it."""
    from reference.scheduler import population_rows

    rng = np.random.default_rng(3)
    hist = torch.from_numpy(np.cumprod(rng.random((10, GAMMA)), axis=1).astype(np.float32))
    order = torch.argsort(hist.double().sum(1))
    assert torch.equal(population_rows(hist, 10), hist[order])
    assert torch.equal(population_rows(hist, 2), hist[order[[2, 7]]])
    assert torch.equal(population_rows(hist, 5), hist[order[[1, 3, 5, 7, 9]]])
    assert torch.equal(population_rows(hist[:1], 3), hist[:1].repeat(3, 1))
    assert population_rows(hist, 0).shape == (0, GAMMA)
    for bad in (torch.zeros(0, GAMMA), torch.zeros(GAMMA)):
        try:
            population_rows(bad, 2)
        except ValueError:
            continue
        raise AssertionError("an empty or 1-D history must be refused")


def test_a_finish_time_verdict_weighs_the_estimate_without_the_gates_margin():
    """The ordinary gate drafts unless plain decoding looks more than its margin faster; a finish-time verdict, which
    no probe revisits either way, takes whichever finishes sooner: 2% slower drafting is plain, 2% faster drafts."""
    from reference.scheduler import FinishEstimate, gate_margin

    for ratio, drafts in ((1.02, False), (0.98, True)):
        sched, seqs = _finishing([0.9] * 4)
        assert gate_margin(sched.config, 4) > 0.1
        sched.planner.finish_estimate = lambda a, remaining, r=ratio: FinishEstimate(r, 1.0, 20.0, 40)
        assert (sched.drafters() == seqs) is drafts


def test_a_finish_time_verdict_stands_while_the_batch_keeps_most_of_its_requests():
    """One estimate answers up to FINISH_REUSE evaluations while the batch keeps all but 1/FINISH_BAND of the requests
    it was estimated for (all of them below FINISH_BAND requests); fewer, or more, re-estimate at once."""
    sched, seqs = _finishing([0.9] * 64)
    gate, calls = sched.gate, []
    estimate = sched.planner.finish_estimate
    sched.planner.finish_estimate = lambda a, remaining: calls.append(len(remaining)) or estimate(a, remaining)
    band = 64 // gate.FINISH_BAND
    for r in (64, 63, 60, 64 - band, 64 - band - 1, 64, 60):
        sched.drafters(seqs[:r])
    assert calls == [64, 64 - band - 1, 64]  # 63, 60, 56 reuse the first; 55 and 64 (grown) do not; 60 reuses the third
    for _ in range(gate.FINISH_REUSE):  # at most FINISH_REUSE evaluations per estimate (each after a new draft:
        # the same drafts again would reuse the cached verdict without evaluating)
        sched.record_drafts(seqs, [s.survivals[-1] for s in seqs])
        sched.drafters(seqs[:60])
    assert calls[3:] == [60]

    sched, seqs = _finishing([0.9] * 6)  # below FINISH_BAND requests: any change re-estimates
    calls = []
    estimate = sched.planner.finish_estimate
    sched.planner.finish_estimate = lambda a, remaining: calls.append(len(remaining)) or estimate(a, remaining)
    for r in (6, 6, 5, 5, 4):
        sched.drafters(seqs[:r])
    assert calls == [6, 5, 4]


def test_the_gates_forced_draft_is_the_references():
    """``DraftGate.forced`` (NumPy, run every step the gate is closed) is ``reference.scheduler.draft_forced``: no
    survivals at all, only NaN rows, enough plain steps for a probe, the gate off, a mode without a gate."""
    from reference.scheduler import draft_forced

    rng = np.random.default_rng(0)
    for mode, gate_on in (("adaptive", True), ("adaptive", False), ("fixed", True)):
        kw = {"k": GAMMA} if mode == "fixed" else {}
        gate = _scheduler(mode, draft_gate=gate_on, **kw).gate
        for _ in range(200):
            rows = int(rng.integers(1, 5))
            recent = np.cumprod(rng.random((rows, GAMMA)), axis=1).astype(np.float32)
            recent[rng.random(rows) < 0.5] = np.nan
            recent = None if rng.random() < 0.1 else recent
            gate.steps_without_draft = int(rng.integers(0, 2 * gate.config.probe_every))
            want = draft_forced(gate.config, None if recent is None else torch.from_numpy(recent),
                                gate.steps_without_draft)
            assert gate.forced(recent) == want, (mode, gate_on, recent, gate.steps_without_draft)
            assert gate.forced(recent) == want  # again: the kept all-NaN test of the same array
