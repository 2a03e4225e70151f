"""Several API servers in front of one engine process (``python -m optimized.serve --api-server-count N``).

First the pieces on one event loop: the engine process routes every output to the API server whose request it is
and drops a server that goes away (its requests aborted, the others served on); the metrics of several servers add
up to those of one server that saw everything. Then a live server of the tiny model with two API servers: the same
greedy text as requests run one by one, one ``/metrics`` for the whole server whichever process answers, a drain on
SIGTERM that leaves no process behind, and a dead API server that stops the whole server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from optimized.engine import StepStats
from optimized.sequence import SamplingParams
from optimized.serving.engine_process import EnginePeer, EngineProcess
from optimized.serving.metrics import ServerMetrics
from tests.serving.conftest import LiveServer, tiny_server_args
from tests.serving.test_engine_process import collect, gone, sim_build

pytestmark = pytest.mark.usefixtures("one_thread")


class Pair:
    """API servers 0 and 1 of one simulated engine process, both on this test's event loop."""

    def __init__(self, build) -> None:
        self.fatal: list[BaseException] = []
        kw = dict(max_num_seqs=build.max_num_seqs, max_waiting=4, on_fatal=self.fatal.append,
                  on_ready=lambda rt: ServerMetrics("sim", rt.gamma, rt.has_drafter))
        self.server0 = EngineProcess(build, count=2, **kw)
        self.build_kw = kw

    async def start(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        self.server0.start(loop)
        (channel,) = self.server0.peer_channels
        self.server1 = EnginePeer(channel, index=1, count=2, **self.build_kw)
        self.server1.start(loop)
        deadline = time.monotonic() + timeout
        while not (self.server0.ready.is_set() and self.server1.ready.is_set()):
            assert not self.fatal and time.monotonic() < deadline, self.fatal or "the engine never became ready"
            await asyncio.sleep(0.02)


def test_each_api_server_gets_its_own_outputs_and_a_departed_one_frees_its_slots():
    async def scenario():
        pair = Pair(sim_build(max_num_seqs=1))
        await pair.start()
        a, b = pair.server0, pair.server1
        asked = [(c, n, c.submit([1, 2], SamplingParams(max_new_tokens=n))) for n in (5, 7) for c in (a, b)]
        assert [h.request_id % 2 for _, _, h in asked] == [c.index for c, _, _ in asked] == [0, 1, 0, 1]
        for _, n, h in asked:  # each queue gets its own request's tokens, nothing else
            got = await collect(h)
            assert sum(len(ids) for ids, _, _ in got) == n and got[-1][1:] == (True, "length")
        assert a.in_flight == b.in_flight == 0
        assert a.metrics.steps.values[None] > 0 and b.metrics.steps.values[None] == 0  # engine statistics: server 0
        assert a.metrics.generation_tokens.values[None] == b.metrics.generation_tokens.values[None] == 12

        # One slot: server 1's long request holds it and server 0's waits, until server 1 leaves.
        long = b.submit([1], SamplingParams(max_new_tokens=100_000))
        await asyncio.wait_for(long.queue.get(), 30)  # it runs
        waiting = a.submit([1], SamplingParams(max_new_tokens=3))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiting.queue.get(), 0.3)
        b.stop()
        got = await collect(waiting)
        assert sum(len(ids) for ids, _, _ in got) == 3 and got[-1][1:] == (True, "length")
        assert not pair.fatal
        a.stop()

    asyncio.run(scenario())


def _stats(decoding: int, k: int, accepted: list[int]) -> StepStats:
    return StepStats(step_time_s=0.004, num_running=decoding, num_waiting=1, num_decoding=decoding,
                     verify_tokens=decoding * (k + 1), budget=decoding * k, drafted=True, verified=[k] * decoding,
                     accepted=accepted, predicted_survival=[[0.9, 0.7, 0.5][:k] for _ in range(decoding)],
                     request_ids=list(range(decoding)))


def test_the_metrics_of_several_api_servers_add_up():
    """Server 0 sees the engine's steps and some requests, server 1 other requests: their merged exposition is
    that of one server that saw it all."""
    one, zero, first = (ServerMetrics("m", 3, True) for _ in range(3))
    for stats in (_stats(2, 3, [3, 1]), _stats(3, 2, [0, 2, 1]), _stats(1, 3, [2])):
        one.observe_step(stats)
        zero.observe_step(stats)
    for target in (one, zero):
        target.request_added(11)
        target.tokens_delivered(1, first=True, gap=0.02)
        target.tokens_delivered(3, first=False, gap=0.004)
        target.request_finished("length", 0.5)
    for target in (one, first):
        target.request_added(7)
        target.tokens_delivered(2, first=True, gap=0.3)
        target.request_finished("stop", 1.5)
        target.request_added(5)
        target.request_finished("abort", 0.1)
    merged = ServerMetrics.merged("m", 3, True, [first.snapshot(), zero.snapshot()])
    expected = _samples(one)
    assert _samples(merged) == expected
    assert {("dspark:calibration_trials", (("slot", "3"),)), ("vllm:request_success_total",
            (("finished_reason", "abort"), ("model_name", "m")))} <= set(expected)


def _samples(metrics: ServerMetrics) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of an exposition (the order of the samples is not part of it)."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ------------------------------------------------------------------------------------------------------------
# A live server with two API servers
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two(tiny_dirs, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    server = LiveServer(tiny_server_args(tiny_dirs, "--api-server-count", "2"), cache, cache / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _children(srv: LiveServer) -> dict[str, psutil.Process]:
    return {p.name(): p for p in psutil.Process(srv.proc.pid).children() if p.name().startswith("dspark-")}


def test_two_api_servers_serve_the_same_text_and_one_metrics(two):
    procs = _children(two)
    assert sorted(procs) == ["dspark-api-1", "dspark-engine"]
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
              for p in ("hello", "abc", "The quick brown fox", "1 2 3")] * 6
    alone = {b["prompt"]: httpx.post(two.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
             for b in bodies[:4]}
    cpu0 = procs["dspark-api-1"].cpu_times()

    async def burst() -> list[httpx.Response]:
        async def one(body):  # a connection of its own: either API server may accept it
            async with httpx.AsyncClient(base_url=two.url, timeout=60) as c:
                return await c.post("/v1/completions", json=body)
        return await asyncio.gather(*(one(b) for b in bodies))

    responses = asyncio.run(burst())
    assert [r.json()["choices"][0]["text"] for r in responses] == [alone[b["prompt"]] for b in bodies]

    async def streams() -> list[str]:  # the same, streamed: the SSE path of whichever server accepts
        async def one(body):
            async with httpx.AsyncClient(base_url=two.url, timeout=60) as c:
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    chunks = [json.loads(line.removeprefix("data: ")) async for line in r.aiter_lines()
                              if line.startswith("data: {")]
            return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        return await asyncio.gather(*(one(b) for b in bodies[:8]))

    assert asyncio.run(streams()) == [alone[b["prompt"]] for b in bodies[:8]]
    sent = len(alone) + len(bodies) + 8
    for _ in range(5):  # the kernel hands a connection to whichever process accepts first: on a loaded machine one
        cpu1 = procs["dspark-api-1"].cpu_times()  # burst may all land on one; more bursts, and both must have served
        if cpu1.user + cpu1.system > cpu0.user + cpu0.system:
            break
        assert [r.json()["choices"][0]["text"] for r in asyncio.run(burst())] == [alone[b["prompt"]] for b in bodies]
        sent += len(bodies)
    assert cpu1.user + cpu1.system > cpu0.user + cpu0.system, "API server 1 took no connection"

    totals = set()
    for _ in range(6):  # each scrape on a new connection: whichever process answers, the whole server's numbers
        text = httpx.get(two.url + "/metrics", timeout=10).text
        lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line and not line.startswith("#")}
        totals.add((lines['vllm:request_success_total{finished_reason="length",model_name="tiny"}'],
                    lines['vllm:generation_tokens_total{model_name="tiny"}'], lines["dspark:steps_total"]))
    assert len(totals) == 1
    (requests, tokens, steps), = totals
    assert requests == sent and tokens == 24 * requests and steps > 0


def test_a_dead_api_server_stops_the_whole_server(two):
    """Last: it ends the module's server. Killing API server 1 stops server 0 (exit 1) and the engine."""
    procs = _children(two)
    procs["dspark-api-1"].kill()
    assert two.proc.wait(60) == 1
    assert gone(procs["dspark-engine"].pid)
    assert "exited unexpectedly" in two.log.read_text()


def test_sigterm_drains_every_api_server(tiny_dirs, tmp_path):
    """Three API servers with an API key: every one of them asks for it; SIGTERM lets the requests in flight finish
    on all of them, then every process exits."""
    server = LiveServer(tiny_server_args(tiny_dirs, "--api-server-count", "3", "--api-key", "sesame"), tmp_path,
                        tmp_path / "server.log")
    key = {"Authorization": "Bearer sesame"}
    try:
        server.wait_ready()
        procs = _children(server)
        assert sorted(procs) == ["dspark-api-1", "dspark-api-2", "dspark-engine"]
        body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        for _ in range(6):  # new connections, whichever server takes them
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

        async def requests_across_a_sigterm() -> list[httpx.Response]:
            async def one():
                async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=key) as c:
                    return await c.post("/v1/completions", json=body)
            tasks = [asyncio.create_task(one()) for _ in range(6)]
            await asyncio.sleep(0.5)  # in flight
            os.kill(server.proc.pid, signal.SIGTERM)
            return await asyncio.gather(*tasks)

        responses = asyncio.run(requests_across_a_sigterm())
        assert [r.status_code for r in responses] == [200] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses)
        assert server.proc.wait(60) == 0
        assert all(gone(p.pid) for p in procs.values())
    finally:
        server.stop()
