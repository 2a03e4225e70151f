"""The engine's side of the server: the one thread (or process) that owns the engine, and the event loop's view
of it.

Request handlers run on the asyncio event loop and never touch the engine. They talk to it through two calls,
:meth:`EngineClient.submit` and :meth:`EngineClient.abort`, which hand commands to the engine; between two steps the
engine side applies them (``Engine.add_request`` / ``Engine.abort``, the engine's public API is the only door) and
hands every step's outputs back to the event loop in one ``call_soon_threadsafe`` call, where they are sorted into
per-request queues. So an abort (a client that went away) frees its slot before the next step.

Two places the engine can run, one interface:

* :class:`EngineLoop`: a thread of the server's own process, with a thread-safe inbox. The engine's Python then
  shares the global interpreter lock with the event loop (HTTP, JSON, SSE, detokenisation, metrics).
* :class:`optimized.serving.engine_process.EngineProcess`: a child process running :func:`run_steps` on the same
  kind of inbox, one message per step back over a pipe; the HTTP process's work no longer delays a step.

While the engine is idle it blocks on its inbox. Step-level statistics (``Engine.last_step_stats``) and request
latencies go to :class:`optimized.serving.metrics.ServerMetrics` on the event loop, which overlaps with the
engine's next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dspark.serve")

_WAKE_S = 0.5  # an idle engine thread re-checks its stop flag this often
# Request ids key the random numbers of unseeded requests (the contract's request word, < 2³¹). Unseeded requests
# count in [0, 2³⁰); a request's `seed` maps into [2³⁰, 2³¹), so the two never share random numbers.
_ID_SPACE = 2**30


class Overloaded(Exception):
    """More requests than slots + --max-waiting."""


class NotReady(Exception):
    """The engine is still starting (or has failed)."""


class EngineFailed(Exception):
    """The engine thread died; every request in flight gets this."""


def seed_key(seed: int) -> int:
    """The random-number key of a request with an OpenAI ``seed`` (any 64-bit integer)."""
    return _ID_SPACE + seed % _ID_SPACE


@dataclass
class RequestHandle:
    """The event-loop side of one request: its queue of ``StepOutput`` and its timings (for the metrics)."""

    request_id: int
    prompt_tokens: int
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_delivery: float | None = None
    finished: bool = False


@dataclass
class Runtime:
    """What start-up produced: the engine and the facts the server needs about it."""

    engine: Any  # optimized.engine.Engine
    tokenizer: Any
    vocab_size: int
    gamma: int  # 0 without a drafter
    has_drafter: bool


class EngineClient:
    """The event-loop side of an engine, wherever it runs: the requests in flight, ``submit`` / ``abort``, and the
    sorting of every step's outputs into the request queues (``_dispatch``, one call per step).

    Subclasses say where the engine runs and how a command reaches it (``_send``): :class:`EngineLoop` on a thread
    of this process, :class:`optimized.serving.engine_process.EngineProcess` in a child process.
    """

    # Whether the Runtime handed to on_ready is the very object the engine uses (same process, another thread): then
    # the server copies what it mutates or uses concurrently (the tokenizer). A Runtime that came through a pipe is
    # already this process's own copy.
    shares_runtime = False

    def __init__(self, build: Callable[[], Runtime] | None, *, max_num_seqs: int, max_waiting: int,
                 on_ready: Callable[[Runtime], Any], on_fatal: Callable[[BaseException], None], index: int = 0,
                 count: int = 1) -> None:
        """``index`` of ``count`` API servers sharing one engine (``--api-server-count``): this client's request ids
        are ≡ ``index`` mod ``count`` (the engine process routes each output by its id), and it admits its share
        of the ``max_num_seqs + max_waiting`` requests in flight before answering 429."""
        if not 0 <= index < count:
            raise ValueError(f"API server index {index} is not in [0, {count})")
        self._build, self._on_ready, self._on_fatal = build, on_ready, on_fatal
        self.index, self.count = index, count
        self.capacity = -(-(max_num_seqs + max_waiting) // count)  # requests in flight before 429
        self.metrics = None  # ServerMetrics, from on_ready
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._requests: dict[int, RequestHandle] = {}  # event-loop thread only
        self._ids = itertools.count()
        self._aio: asyncio.AbstractEventLoop | None = None

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def _send(self, cmd: tuple) -> None:
        """Hand a command (``("add", rid, prompt_ids, params)`` or ``("abort", rid)``) to the engine."""
        raise NotImplementedError

    # ------------------------------------------------------------------ event-loop side

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def submit(self, prompt_ids: list[int], params) -> RequestHandle:
        """Queue a request (``SamplingParams`` already validated); raises NotReady or Overloaded."""
        if not self.ready.is_set() or self.failed is not None:
            raise NotReady()
        if len(self._requests) >= self.capacity:
            raise Overloaded()
        rid = self.index + self.count * (next(self._ids) % (_ID_SPACE // self.count))
        handle = RequestHandle(rid, len(prompt_ids), time.perf_counter())
        self._requests[rid] = handle
        self.metrics.request_added(len(prompt_ids))
        self._send(("add", rid, prompt_ids, params))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request (its client went away); the engine frees the slot before its next step."""
        if handle.finished:
            return
        handle.finished = True
        if self._requests.pop(handle.request_id, None) is not None:
            self._send(("abort", handle.request_id))
            self.metrics.request_finished("abort", time.perf_counter() - handle.arrival)

    def cut(self, err: BaseException) -> int:
        """On the event loop: end every request in flight with ``err`` (its stream raises it next) and free its slot in
        the engine; returns how many there were. A server whose ``--shutdown-timeout`` runs out does this, so that its
        clients read an error rather than a cut connection."""
        handles = list(self._requests.values())
        for handle in handles:
            self.abort(handle)
            handle.queue.put_nowait(err)
        return len(handles)

    def _dispatch(self, outputs: list, stats, errors: list[tuple[int, Exception]], idle: bool) -> None:
        """On the event loop: sort one step's outputs into the request queues; record latencies and step stats."""
        now = time.perf_counter()
        m = self.metrics
        if stats is not None:
            m.observe_step(stats)
        if idle:
            m.idle()
        for rid, err in errors:
            handle = self._requests.pop(rid, None)
            if handle is not None:
                handle.finished = True
                handle.queue.put_nowait(err)
        for out in outputs:
            handle = self._requests.get(out.request_id)
            if handle is None:  # aborted meanwhile
                continue
            if out.new_token_ids:
                m.tokens_delivered(len(out.new_token_ids), first=handle.last_delivery is None,
                                   gap=now - (handle.last_delivery or handle.arrival))
                handle.last_delivery = now
            if out.finished:
                del self._requests[out.request_id]
                handle.finished = True
                m.request_finished(out.finish_reason or "length", now - handle.arrival)
            handle.queue.put_nowait(out)

    def _fail_all(self, err: BaseException) -> None:
        self.failed = err
        for handle in self._requests.values():
            handle.finished = True
            handle.queue.put_nowait(EngineFailed(str(err)))
        self._requests.clear()

    # ------------------------------------------------------------------ any thread

    def _post(self, outputs, stats, errors, idle: bool) -> None:
        """One step's results to the event loop: one ``call_soon_threadsafe`` per step."""
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._dispatch, outputs, stats, errors, idle)

    def _failed(self, err: BaseException) -> None:
        """The engine is unusable: fail every request in flight, stop the server."""
        self.failed = err
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._fail_all, err)
        self._on_fatal(err)


class EngineLoop(EngineClient):
    """Owns the engine on one thread of this process; see the module docstring."""

    shares_runtime = True

    def __init__(self, build: Callable[[], Runtime], *, max_num_seqs: int, max_waiting: int,
                 on_ready: Callable[[Runtime], Any], on_fatal: Callable[[BaseException], None]) -> None:
        super().__init__(build, max_num_seqs=max_num_seqs, max_waiting=max_waiting, on_ready=on_ready,
                         on_fatal=on_fatal)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, cmd: tuple) -> None:
        self._inbox.put(cmd)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            runtime = self._build()
            self.metrics = self._on_ready(runtime)
            self.ready.set()
            run_steps(runtime.engine, self._inbox, self._stop, self._post)
        except BaseException as err:  # the engine is unusable: fail every request, stop the server
            log.exception("engine loop failed")
            self._failed(err)


# --------------------------------------------------------------------------------------------------------------
# The step loop (on the engine thread, or in the engine process)
# --------------------------------------------------------------------------------------------------------------


def run_steps(engine, inbox: queue.SimpleQueue, stop: threading.Event, post: Callable[..., None]) -> None:
    """Step ``engine`` until ``stop`` is set: apply the inbox between two steps, ``post(outputs, stats, errors,
    idle)`` after each step. While the engine is idle, block on the inbox (a ``None`` in it only wakes the loop)."""
    while not stop.is_set():
        errors, emptied = apply_commands(engine, inbox, block=not engine.has_unfinished())
        if engine.has_unfinished():
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    engine.release(out.request_id)
            post(outputs, engine.last_step_stats(), errors, False)
        elif errors or emptied:  # refused requests, or an abort emptied the engine (no step will report it)
            post([], None, errors, True)


def apply_commands(engine, inbox: queue.SimpleQueue, block: bool) -> tuple[list[tuple[int, Exception]], bool]:
    """Apply the queued commands through the engine's public API; returns (refused requests, whether an abort
    emptied the engine)."""
    errors, emptied = [], False
    try:
        cmd = inbox.get(timeout=_WAKE_S) if block else inbox.get_nowait()
    except queue.Empty:
        return errors, emptied
    while cmd is not None:
        if cmd[0] == "add":
            _, rid, prompt_ids, params = cmd
            try:
                engine.add_request(prompt_ids, params, request_id=rid)
            except ValueError as err:  # the server validates first; this is a last line of defence
                errors.append((rid, err))
        else:
            engine.abort(cmd[1])
            engine.release(cmd[1])
            emptied = not engine.has_unfinished()
        try:
            cmd = inbox.get_nowait()
        except queue.Empty:
            break
    return errors, emptied
