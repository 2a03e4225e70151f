"""The engine in its own process (``--engine-process``) against the engine on a thread (``--no-engine-process``).

First the two engine clients alone, on one simulated engine (``scripts/bench_server_overhead.py``'s, no model):
the same outputs in both, an abort that frees the slot, a child that dies or fails to start, and a stop that leaves
no process behind, even when the server process itself is killed. Then two live servers of the tiny model, one per
mode, started side by side: the same text streamed and not, greedy and seeded; a bad request's 400, a disconnect
that frees its slot; and last, a killed engine process that fails every request in flight and stops the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from optimized.sequence import SamplingParams, StepOutput
from optimized.serving.engine_loop import EngineFailed, EngineLoop, NotReady
from optimized.serving.engine_process import EngineProcess, spawn_engine
from optimized.serving.metrics import ServerMetrics
from scripts.bench_server_overhead import SimulatedBuild
from tests.serving.conftest import ROOT, LiveServer, tiny_server_args

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = {"thread": EngineLoop, "process": EngineProcess}
# The event loops a server may run on: uvicorn picks uvloop where it is installed (it comes with uvicorn[standard]),
# and uvloop makes every descriptor it watches non-blocking, the results pipe included.
try:
    import uvloop
except ImportError:  # pragma: no cover - the test extra installs it
    uvloop = None
LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(uvloop is None, reason="uvloop not installed"))]


def run_on(loop: str, coro):
    """``asyncio.run(coro)`` on the named event loop implementation."""
    factory = asyncio.new_event_loop if loop == "asyncio" else uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def sim_build(**kw) -> SimulatedBuild:
    """A simulated engine that emits tokens 10, 11, ...; tokenizer None (nobody decodes here)."""
    settings = dict(token_ids=list(range(10, 60)), tokenizer=None, vocab_size=64, max_num_seqs=2, step_ms=1.0,
                    host_ms=0.0, tokens_per_step=2)
    return SimulatedBuild(**{**settings, **kw})


class Harness:
    """An engine client on this test's event loop, the way ``Server`` drives one."""

    def __init__(self, mode: str, build) -> None:
        self.fatal: list[BaseException] = []
        self.runtime = None  # what on_ready received
        self.gamma = build.tokens_per_step - 1  # what the simulated engine reports
        self.client = MODES[mode](build, max_num_seqs=build.max_num_seqs, max_waiting=4, on_ready=self._ready,
                                  on_fatal=self.fatal.append)

    def _ready(self, runtime):
        assert runtime.vocab_size == 64 and runtime.gamma == self.gamma and runtime.has_drafter
        self.runtime = runtime
        return ServerMetrics("sim", runtime.gamma, runtime.has_drafter)

    async def start(self, timeout: float = 60.0) -> None:
        self.client.start(asyncio.get_running_loop())
        deadline = time.monotonic() + timeout
        while not self.client.ready.is_set():
            assert not self.fatal, self.fatal
            assert time.monotonic() < deadline, "the engine never became ready"
            await asyncio.sleep(0.02)

    async def wait_fatal(self, timeout: float = 30.0) -> BaseException:
        deadline = time.monotonic() + timeout
        while not self.fatal:
            assert time.monotonic() < deadline, "the engine's failure was never reported"
            await asyncio.sleep(0.02)
        return self.fatal[0]


async def collect(handle, timeout: float = 30.0) -> list:
    """Everything a request's queue receives until it finishes (or gets an error)."""
    got = []
    while True:
        item = await asyncio.wait_for(handle.queue.get(), timeout)
        got.append(item if isinstance(item, Exception) else (item.new_token_ids, item.finished, item.finish_reason))
        if isinstance(item, Exception) or item.finished:
            return got


def gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ------------------------------------------------------------------------------------------------------------
# The two engine clients alone
# ------------------------------------------------------------------------------------------------------------


def test_both_modes_deliver_the_same_steps_and_free_aborted_slots():
    """Three requests over two slots: the same steps in both modes. Then one slot, a long request and one that
    waits for it: aborting the long one lets the waiting one run. The process mode's stop leaves no child."""

    async def scenario(mode: str):
        h = Harness(mode, sim_build())
        await h.start()
        handles = [h.client.submit([1, 2], SamplingParams(max_new_tokens=n)) for n in (5, 7, 3)]
        outputs = [await collect(x) for x in handles]
        assert h.client.in_flight == 0
        # the abort frees the slot: max_num_seqs 2, two long requests hold both, a third waits
        long = [h.client.submit([1], SamplingParams(max_new_tokens=100_000)) for _ in range(2)]
        waiting = h.client.submit([1], SamplingParams(max_new_tokens=3))
        first = await asyncio.wait_for(long[0].queue.get(), 30)
        assert isinstance(first, StepOutput) and waiting.queue.empty()
        h.client.abort(long[0])
        after_abort = await collect(waiting)
        h.client.abort(long[1])
        assert h.client.in_flight == 0 and h.client.metrics is not None
        pid = getattr(h.client, "pid", None)
        h.client.stop()
        return outputs, after_abort, pid, h.fatal

    thread, process = asyncio.run(scenario("thread")), asyncio.run(scenario("process"))
    assert thread[0] == process[0]
    assert [len(x) for x in process[0]] == [3, 4, 2]  # one "prefill" token, then 2 per step
    assert process[0][0] == [([10], False, None), ([11, 12], False, None), ([13, 14], True, "length")]
    assert thread[1] == process[1] and process[1][-1][1]
    assert thread[3] == process[3] == []
    assert process[2] is not None and gone(process[2])


@pytest.mark.parametrize("loop", LOOPS)
def test_messages_larger_than_the_pipe_arrive_whole_on_either_event_loop(loop):
    """A ready message of megabytes (a real tokenizer is one) and steps of ~100 KB, over a pipe that holds 64 KiB:
    each arrives over many reads of the non-blocking pipe, unpickled once whole, on asyncio's loop and on uvloop's
    (which makes the pipe non-blocking by itself: a blocking ``recv`` there failed half-way through the ready
    message, and the server stopped before its first request)."""
    blob = {"vocab": "x" * 3_000_000, "merges": list(range(100_000))}  # stands in for a tokenizer

    async def scenario():
        h = Harness("process", sim_build(tokenizer=blob, max_num_seqs=64, tokens_per_step=1024))
        await h.start()
        assert h.runtime.tokenizer == blob
        handles = [h.client.submit([1], SamplingParams(max_new_tokens=4097)) for _ in range(64)]
        outputs = [await collect(x) for x in handles]
        assert h.client.in_flight == 0 and not h.fatal
        h.client.stop()
        return outputs

    outputs = run_on(loop, scenario())
    token_ids = list(range(10, 60))
    for i, got in enumerate(outputs):  # the simulated engine's tokens, in order: 1, then 4 steps of 1024 each
        assert [len(tokens) for tokens, _, _ in got] == [1, 1024, 1024, 1024, 1024]
        start = (i * 7919) % len(token_ids)
        flat = [t for tokens, _, _ in got for t in tokens]
        assert flat == [token_ids[(start + j) % len(token_ids)] for j in range(4097)]
        assert got[-1][1:] == (True, "length")


def test_frames_survive_any_split_of_the_bytes():
    """The reader against the sender, byte by byte and in odd chunks: every message whole and in order, none twice,
    and a message cut short by the end of the pipe never unpickled."""
    import pickle
    import threading

    from optimized.serving.engine_process import FrameReader, framed_sender

    messages = [("ready", b"\x00" * 200_000), ("step", list(range(5000)), None, [], False), ("failed", None), ()]
    for limit in (1, 7, 65_536, 1 << 20):
        reader_end, writer_end = multiprocessing_pipe()
        writer = threading.Thread(target=lambda w=writer_end: [framed_sender(w)(m) for m in messages] + [w.close()])
        writer.start()
        reader, got = FrameReader(reader_end.fileno()), []
        while not reader.closed:
            reader_end.poll(5)
            got += [pickle.loads(data) for data in reader.read(limit)]
        writer.join()
        assert got == messages and not reader.buffer
        reader_end.close()
    # the end of the pipe in the middle of a message: nothing half-read comes out
    reader_end, writer_end = multiprocessing_pipe()
    data = pickle.dumps(("step", [1, 2, 3]))
    os.write(writer_end.fileno(), len(data).to_bytes(8, "big") + data[:-1])
    writer_end.close()
    reader = FrameReader(reader_end.fileno())
    assert reader.read() == [] and reader.closed and len(reader.buffer) == 8 + len(data) - 1
    reader_end.close()


def multiprocessing_pipe():
    """A one-way pipe as the engine process has it: (read end, write end)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pipe(duplex=False)


def test_a_dead_engine_process_fails_every_request_in_flight():
    async def scenario():
        h = Harness("process", sim_build())
        await h.start()
        handles = [h.client.submit([1], SamplingParams(max_new_tokens=100_000)) for _ in range(3)]  # 2 run, 1 waits
        await asyncio.wait_for(handles[0].queue.get(), 30)
        os.kill(h.client.pid, signal.SIGKILL)
        err = await h.wait_fatal()
        assert "killed by signal 9" in str(err) and h.client.failed is err
        for handle in handles:
            items = []
            while not items or isinstance(items[-1], StepOutput):
                items.append(await asyncio.wait_for(handle.queue.get(), 30))
            assert isinstance(items[-1], EngineFailed) and "exited unexpectedly" in str(items[-1])
        assert h.client.in_flight == 0
        with pytest.raises(NotReady):
            h.client.submit([1], SamplingParams())
        h.client.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", list(MODES))
def test_a_start_up_failure_reports_the_builders_error(mode):
    async def scenario():
        h = Harness(mode, sim_build(token_ids=[]))  # SimulatedEngine refuses an empty token list
        h.client.start(asyncio.get_running_loop())
        err = await h.wait_fatal()
        assert isinstance(err, ValueError) and "non-empty token list" in str(err)
        assert h.client.failed is err and not h.client.ready.is_set()
        with pytest.raises(NotReady):
            h.client.submit([1], SamplingParams())
        h.client.stop()

    asyncio.run(scenario())


@dataclasses.dataclass
class StampedBuild:
    """A simulated engine's build that first writes the time it started into ``path`` (picklable)."""

    path: str
    inner: SimulatedBuild

    def __call__(self):
        Path(self.path).write_text(repr(time.time()))
        return self.inner()


def test_an_engine_spawned_ahead_builds_before_the_server_attaches(tmp_path):
    """``python -m optimized.serve`` starts the engine process before its HTTP side exists (``spawn_engine``): the
    child builds with no event loop on this side; the client attached later gets the ready message that waited in
    the pipe and serves. A client for another number of API servers than the child was started for is refused."""
    build = StampedBuild(str(tmp_path / "built"), sim_build())
    spawned = spawn_engine(build)
    deadline = time.monotonic() + 60
    while not (tmp_path / "built").exists():
        assert time.monotonic() < deadline, "the spawned engine never started building"
        time.sleep(0.02)
    with pytest.raises(ValueError, match="started for 1 API servers, not 2"):
        EngineProcess(build, max_num_seqs=2, max_waiting=4, on_ready=None, on_fatal=None, count=2, spawned=spawned)

    async def scenario():
        h = Harness("process", build.inner)
        h.client = EngineProcess(build, max_num_seqs=2, max_waiting=4, on_ready=h._ready, on_fatal=h.fatal.append,
                                 spawned=spawned)
        attached = time.time()
        await h.start()
        assert float((tmp_path / "built").read_text()) < attached and h.client.pid == spawned.proc.pid
        handle = h.client.submit([1, 2], SamplingParams(max_new_tokens=4))
        got = await collect(handle)
        assert [t for ids, _, _ in got for t in ids] == [10, 11, 12, 13] and got[-1][1]
        h.client.stop()
        assert gone(spawned.proc.pid)

    asyncio.run(scenario())


@dataclasses.dataclass
class SlowBuild:
    """A build that takes ``seconds`` before it gives the simulated engine (picklable)."""

    seconds: float
    inner: SimulatedBuild

    def __call__(self):
        time.sleep(self.seconds)
        return self.inner()


def test_stopping_a_starting_engine_does_not_wait_for_its_start_up():
    """A server that stops before the engine is ready (its port was taken, say) terminates the engine process at
    once instead of waiting for a start-up that nobody will use."""

    async def scenario():
        h = Harness("process", sim_build())
        h.client = EngineProcess(SlowBuild(60.0, sim_build()), max_num_seqs=2, max_waiting=4, on_ready=h._ready,
                                 on_fatal=h.fatal.append)
        h.client.start(asyncio.get_running_loop())
        pid = h.client.pid
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        h.client.stop()
        assert time.monotonic() - t0 < 5 and gone(pid, timeout=5)
        assert not h.fatal  # a requested stop is not a failure

    asyncio.run(scenario())


_PEER_IMPORTS_SCRIPT = """
import asyncio, multiprocessing, sys, threading
sys.path.insert(0, {root!r})
from optimized.serving.engine_process import EnginePeer
async def main():
    commands_in, commands_out = multiprocessing.Pipe(duplex=False)
    results_in, results_out = multiprocessing.Pipe(duplex=False)
    peer = EnginePeer((commands_out, results_in), max_num_seqs=1, max_waiting=1, on_ready=lambda rt: None,
                      on_fatal=lambda err: None, index=1, count=2)
    peer.start(asyncio.get_running_loop())
    for t in threading.enumerate():
        if t.name == "dspark-tokenizer-imports":
            await asyncio.to_thread(t.join, 60)
    print("tokenizer classes", "transformers.tokenization_utils_tokenizers" in sys.modules, flush=True)
    print("torch", "torch" in sys.modules, flush=True)
    peer.stop()
asyncio.run(main())
"""


def test_an_api_server_imports_the_tokenizer_classes_while_the_engine_starts_and_never_torch():
    """A pipe client imports transformers' tokenizer classes on a thread as soon as it attaches, so that the ready
    message's tokenizer unpickles without an import on the event loop; an API server still never imports torch."""
    out = subprocess.run([sys.executable, "-c", _PEER_IMPORTS_SCRIPT.format(root=str(ROOT))], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "tokenizer classes True" in out.stdout and "torch False" in out.stdout, out.stdout


_ORPHAN_SCRIPT = """
import asyncio, sys, time
sys.path.insert(0, {root!r})
from tests.serving.test_engine_process import Harness, sim_build
async def main():
    h = Harness("process", sim_build())
    await h.start()
    print(h.client.pid, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_the_engine_process_does_not_outlive_a_killed_server():
    """SIGKILL leaves the server no chance to stop its engine: the engine sees its command pipe close and exits."""
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT.format(root=str(ROOT))], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.kill()
        parent.wait()
        assert gone(child), "the engine process outlived its server"
    finally:
        parent.kill()
        parent.wait()


_STARTING_ORPHAN_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {root!r})
from optimized.serving.engine_process import EngineProcess
from tests.serving.test_engine_process import SlowBuild, sim_build
async def main():
    client = EngineProcess(SlowBuild(60.0, sim_build()), max_num_seqs=2, max_waiting=4, on_ready=lambda rt: None,
                           on_fatal=lambda err: None)
    client.start(asyncio.get_running_loop())
    print(client.pid, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_the_engine_process_does_not_outlive_a_server_killed_during_its_start_up():
    """SIGKILL while the engine is still building (a 60 s start-up here): the engine sees its command pipe close and
    exits at once instead of finishing a start-up nobody will use."""
    parent = subprocess.Popen([sys.executable, "-c", _STARTING_ORPHAN_SCRIPT.format(root=str(ROOT))], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the child is importing or building by now
        assert psutil.pid_exists(child)
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        assert gone(child, timeout=15), "the starting engine process outlived its server"
        assert time.monotonic() - t0 < 15
    finally:
        parent.kill()
        parent.wait()


@dataclasses.dataclass
class LockedBuild:
    """A start-up stuck in C code that never releases the interpreter lock (one ``sum`` over a range too long to end):
    no other thread of the child runs while it lasts, the one that would notice the server's pipe closing included.
    It touches ``path`` first (picklable)."""

    path: str

    def __call__(self):
        Path(self.path).touch()
        sum(range(1 << 62))


_LOCKED_ORPHAN_SCRIPT = (_STARTING_ORPHAN_SCRIPT.replace("SlowBuild(60.0, sim_build())", "LockedBuild({path!r})")
                         .replace("SlowBuild, sim_build", "LockedBuild"))


def test_the_engine_process_dies_with_its_server_even_when_its_threads_cannot_run(tmp_path):
    """SIGKILL to the server while the engine's start-up holds the interpreter lock: the kernel ends the engine
    (die_with_parent), which a thread of the engine watching its command pipe could not do."""
    locked = tmp_path / "locked"
    script = _LOCKED_ORPHAN_SCRIPT.format(root=str(ROOT), path=str(locked))
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while not locked.exists():
            assert time.monotonic() < deadline, "the engine process never began its start-up"
            time.sleep(0.05)
        time.sleep(0.2)  # in the sum by now
        parent.kill()
        parent.wait()
        assert gone(child.pid, timeout=5), "the engine process outlived its server"
    finally:
        parent.kill()
        parent.wait()
        if child is not None and child.is_running():  # only if the test failed
            child.kill()


@pytest.mark.parametrize("stage", ["spawned", "building"])
def test_a_server_killed_during_start_up_leaves_no_engine_process(tiny_dirs, tmp_path, stage):
    """``python -m optimized.serve --engine-process``, SIGKILLed while its engine process starts: just spawned (the
    child still unpickling its arguments, before it could ask to die with its parent) or building the engine (its
    start-up stages under way). Either way the engine process is gone within seconds, instead of running its
    start-up to the end."""
    srv = LiveServer(tiny_server_args(tiny_dirs, "--engine-process"), tmp_path, tmp_path / "server.log")
    engine = None
    try:
        deadline = time.monotonic() + 60
        while not (children := _engine_children(srv)):
            assert srv.proc.poll() is None and time.monotonic() < deadline, "no engine process was started"
            time.sleep(0.01)
        (engine,) = children
        while stage == "building" and "start-up: target weights ..." not in srv.log.read_text():
            assert time.monotonic() < deadline, "the engine never began loading the weights"
            time.sleep(0.05)
        srv.proc.kill()
        srv.proc.wait()
        assert gone(engine.pid, timeout=5), f"the engine process outlived its server ({stage})"
    finally:
        srv.stop()
        if engine is not None and engine.is_running():  # only if the test failed
            engine.kill()


# ------------------------------------------------------------------------------------------------------------
# Live servers, one per mode
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_dirs, tmp_path_factory):
    """{mode: LiveServer} of the tiny model, started side by side. One given cost table: a sampled request's tokens
    depend on its verify lengths, which the adaptive scheduler plans from the table (two profiles would differ)."""
    from reference.cost_model import CostTable

    cache = tmp_path_factory.mktemp("cache")
    table = cache / "cost.json"
    CostTable.affine(fixed_ms=5.0, per_token_ms=0.3, sizes=list(range(1, 65))).save(table)
    started = {mode: LiveServer(tiny_server_args(tiny_dirs, flag, "--cost-table", str(table)), cache,
                                cache / f"server-{mode}.log")
               for mode, flag in (("thread", "--no-engine-process"), ("process", "--engine-process"))}
    try:
        for srv in started.values():
            srv.wait_ready()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


CHAT, COMPLETIONS, MSG = "/v1/chat/completions", "/v1/completions", [{"role": "user", "content": "Hello there"}]
LONG = {"prompt": "x", "max_tokens": 90, "ignore_eos": True, "temperature": 0}  # ~90 steps of the tiny model


def _engine_children(srv: LiveServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def _text(url: str, path: str, body: dict) -> tuple[str, dict | None]:
    """(text, usage) of a completion, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=60).json()
        c = r["choices"][0]
        return (c["message"]["content"] if "message" in c else c["text"]), r["usage"]
    parts, usage = [], None
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts), usage


def test_modes_serve_the_same_text(servers):
    assert _engine_children(servers["thread"]) == [] and len(_engine_children(servers["process"])) == 1
    bodies = []
    for stream in (False, True):
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        bodies += [(CHAT, {"messages": MSG, "max_tokens": 20, "temperature": 0, **extra}),
                   ("/v1/completions", {"prompt": "abc", "max_tokens": 16, "temperature": 0, **extra}),
                   (CHAT, {"messages": MSG, "max_tokens": 20, "temperature": 1.3, "top_p": 0.9, "seed": 7, **extra})]
    got = {mode: [_text(srv.url, path, body) for path, body in bodies] for mode, srv in servers.items()}
    assert got["thread"] == got["process"]
    texts = [t for t, _ in got["process"]]
    assert texts[:3] == texts[3:]  # streamed == not streamed
    assert all(u["completion_tokens"] > 0 for _, u in got["process"])


def _loaded_torch(pid: int) -> bool:
    """Whether the process has torch's shared library mapped (Linux: /proc/PID/maps)."""
    return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_the_http_process_never_imports_torch(servers):
    """With the engine in its own process, the HTTP process resolves the device, starts the engine, takes its ready
    message and every step's outputs and stats, and serves, without importing torch: a late import would land on
    the first request (seconds on a GPU host). The engine process has it, as it must."""
    srv = servers["process"]
    for body in ({"prompt": "abc", "max_tokens": 8, "temperature": 0},
                 {"prompt": "abc", "max_tokens": 8, "temperature": 0, "logprobs": 2, "stream": True}):
        _text(srv.url, COMPLETIONS, body)
    assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 200
    assert not _loaded_torch(srv.proc.pid), "the HTTP process imported torch"
    assert _loaded_torch(_engine_children(srv)[0].pid)


def test_process_mode_refuses_bad_requests_and_frees_disconnected_slots(servers):
    url = servers["process"].url
    r = httpx.post(url + CHAT, json={"messages": MSG, "max_tokens": 500}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + CHAT, json={"messages": MSG, "n": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"

    async def disconnect():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", COMPLETIONS, json={**LONG, "stream": True}) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {\"id"):
                    pass
            # the stream is closed mid-generation; the next step must not run it

    asyncio.run(disconnect())
    deadline = time.monotonic() + 15
    while True:
        metrics = httpx.get(url + "/metrics", timeout=10).text
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) == 0:
            break
        assert time.monotonic() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.1)
    assert 'finished_reason="abort"' in metrics
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_killed_engine_process_fails_requests_in_flight_and_stops_the_server(servers):
    """Last: it ends the process-mode server. Streams in flight get an error event, a non-streamed request a 500,
    /health stops answering 200, and the server exits 1."""
    srv = servers["process"]
    (engine,) = _engine_children(srv)

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=httpx.Limits(max_connections=32)) as c:
            plain = [asyncio.create_task(c.post(COMPLETIONS, json=LONG)) for _ in range(8)]  # the 8 slots
            streams = []
            for _ in range(2):  # these wait for a slot (a chat stream sends its first event at once)
                cm = c.stream("POST", CHAT, json={"messages": MSG, "max_tokens": 60, "ignore_eos": True,
                                                  "stream": True})
                r = await cm.__aenter__()
                assert r.status_code == 200
                streams.append((cm, r.aiter_lines()))
            waiting = 'vllm:num_requests_waiting{model_name="tiny"} 2.0'
            while waiting not in (await c.get("/metrics")).text:  # all ten are in the engine
                await asyncio.sleep(0.005)
            engine.kill()
            for cm, lines in streams:
                events = [line async for line in lines if line.startswith("data:")]
                await cm.__aexit__(None, None, None)
                assert events[-1] == "data: [DONE]", "the error event ends the stream as a stream ends"
                assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_failed"
            for r in await asyncio.gather(*plain):
                assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"

    asyncio.run(scenario())
    try:
        health = httpx.get(srv.url + "/health", timeout=5).status_code
    except httpx.TransportError:
        health = None  # already stopped
    assert health != 200
    assert srv.proc.wait(30) == 1
    assert "the engine process failed" in srv.log.read_text()
