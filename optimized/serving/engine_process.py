"""The engine in its own process (``python -m optimized.serve --engine-process``; vLLM calls this the engine core).

The HTTP process keeps the event loop, the tokenizer, request validation, detokenisation, metrics and the
per-request streams; a child process started with the ``spawn`` method builds the engine (the same start-up code as
the in-thread mode, given as a picklable callable) and steps it with the same loop
(:func:`optimized.serving.engine_loop.run_steps`). The two processes share no interpreter lock, so streaming no
longer delays the engine's next step.

Two one-way pipes (``multiprocessing.connection``, pickle) join them:

* commands, HTTP process → engine: ``("add", request_id, prompt_ids, SamplingParams)``, ``("abort", request_id)``,
  and ``None`` (stop). A thread of the child receives them into the step loop's inbox, so a burst of requests is
  taken off the pipe while a step runs and never waits for the step to end before it can be written.
* results, engine → HTTP process: ``("ready", Runtime)`` once start-up is done (the tokenizer and the facts the
  server needs; no engine), then one ``("step", outputs, StepStats, errors, idle)`` per engine step (each output a
  plain tuple of the ``StepOutput`` fields), or ``("failed", exception)`` if start-up or a step raised. Each message
  is framed by this module (its pickle's length in 8 bytes, then the pickle): see :class:`FrameReader`. Nothing in
  a message needs torch to unpickle (``StepStats`` lives in ``optimized.sequence``), so an HTTP process never
  imports it; API server 0 does not import it to resolve the device either (optimized/serving/device.py).

The HTTP process reads the results pipe on its event loop (``add_reader``), without ever blocking: the pipe's end is
non-blocking, a message is unpickled once all its bytes have arrived, however many reads that takes (the ready
message carries the tokenizer, megabytes; a step at a large batch is larger than a pipe's 64 KiB buffer). A blocking
``Connection.recv`` there would stall every stream while a message trickles in, and under uvloop (which uvicorn
picks when it is installed, and which makes every descriptor it watches non-blocking) it fails half-way through a
large message. Each step message goes straight to :meth:`~optimized.serving.engine_loop.EngineClient._dispatch`,
the same code the engine thread reaches through one ``call_soon_threadsafe`` per step in the in-thread mode, so
``submit``, ``abort`` and their errors (``Overloaded``, ``NotReady``, ``EngineFailed``) behave exactly alike. No
thread of the HTTP process has to win the interpreter lock from a busy event loop to take a message.

With several API servers (``--api-server-count``, optimized/serving/api_servers.py) the child gets one such pair of
pipes per server: each server's commands are received by a thread of their own, outputs go back to the server whose
request they are (request id mod the number of servers), step statistics to server 0. Server 0's pipe ending stops
the engine; a further server's ending aborts that server's requests only.

If the child dies (killed, crashed), the results pipe reaches its end: every request in flight gets
``EngineFailed``, ``/health`` answers 503 and the server stops, as when the engine thread dies. The child never
outlives the server: it is a daemon process, ``stop`` asks it to finish and joins it (then terminates, then kills
it), and a child whose command pipe closes (the HTTP process is gone, however it ended) stops by itself — at once if
that happens during its start-up. That takes one of the child's threads, which a start-up busy in C code that holds
the interpreter lock would not let run; so the first thing the child does is :func:`die_with_parent`: on Linux the
kernel kills it when the server dies (``PR_SET_PDEATHSIG``), whatever it is doing. The child ignores SIGINT: a Ctrl-C
reaches the whole process group, and the HTTP process drains the requests in flight before it stops the engine.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
import multiprocessing
import operator
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from optimized.sequence import StepOutput
from optimized.serving.api_servers import set_process_name
from optimized.serving.engine_loop import EngineClient, Runtime, run_steps

log = logging.getLogger("dspark.serve")

_STOP_RETRY_S = 5.0  # after terminate(), and after kill(), wait this long for the child to go
_PR_SET_PDEATHSIG = 1  # prctl(2)'s option number, <linux/prctl.h>
# Where the kernel cannot kill the child with its parent: how often a thread of the child checks that its parent is
# still there. Half a second is a few microseconds of work a second, and well within the server's own stop timeouts.
_PARENT_POLL_S = 0.5
_READ_LIMIT = 1 << 20  # bytes taken from the results pipe per event-loop turn at most: a fast engine never starves it
_LENGTH = struct.Struct("!Q")  # a results message on the pipe: its pickle's length, then the pickle
# A StepOutput on the wire: a plain tuple of its fields, a third of the pickling time of the dataclass.
_OUTPUT_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(StepOutput)))


def framed_sender(conn: Connection) -> Callable[[Any], None]:
    """``send(message)`` for the child's end of the results pipe: the pickle's length, then the pickle, written in
    full (the child's end blocks: an engine ahead of a busy HTTP process waits for room in the pipe)."""
    fd = conn.fileno()
    os.set_blocking(fd, True)

    def send(message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_LENGTH.pack(len(data)) + data)
        while view:
            view = view[os.write(fd, view):]

    return send


class FrameReader:
    """Whole messages (as :func:`framed_sender` writes them) from a pipe end made non-blocking, as the bytes arrive.

    :meth:`read` takes what the pipe holds now and returns the pickles it completed; the bytes of a message not yet
    whole wait in :attr:`buffer` for the next call. :attr:`closed` turns true at the end of the pipe (the writer is
    gone); bytes of a message cut short there are left in the buffer, never unpickled.
    """

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd, self.buffer, self.closed = fd, bytearray(), False

    def read(self, limit: int = _READ_LIMIT) -> list[bytes]:
        taken = 0
        while taken < limit and not self.closed:
            try:
                chunk = os.read(self.fd, limit - taken)
            except BlockingIOError:  # nothing more for now
                break
            if not chunk:
                self.closed = True
            self.buffer += chunk
            taken += len(chunk)
        messages, start, buf, head = [], 0, self.buffer, _LENGTH.size
        while len(buf) - start >= head:
            end = start + head + _LENGTH.unpack_from(buf, start)[0]
            if end > len(buf):
                break
            messages.append(bytes(buf[start + head:end]))
            start = end
        del buf[:start]
        return messages


def import_tokenizer_modules() -> None:
    """Import transformers' tokenizer classes, as unpickling the engine's tokenizer would.

    The ready message carries the tokenizer; unpickling it in a fresh API server first imports transformers (about
    0.6 s of one CPU core, 90 % of it the import, the rest building the Rust tokenizer), on the event loop, after the
    engine is ready: with several API servers starting at once that held ``/health`` back by seconds. Done on a
    thread while the engine starts (tens of seconds), the unpickle later finds the modules loaded. Failing here
    is harmless: the unpickle then imports (or fails) as before."""
    try:
        from transformers import PreTrainedTokenizerFast  # noqa: F401 (resolves transformers' lazy tokenizer classes)
    except Exception as err:  # noqa: BLE001 (a missing or broken install surfaces at the unpickle, with its message)
        log.debug("tokenizer modules not imported ahead: %r", err)


class PipeClient(EngineClient):
    """The event-loop side of an engine in another process, over one pair of pipes: commands out (``_send``),
    results in (read on the event loop, :meth:`_receive`). :class:`EngineProcess` starts that process;
    :class:`EnginePeer` attaches to one that another API server started (``--api-server-count``)."""

    def __init__(self, build: Callable[[], Runtime] | None, *, max_num_seqs: int, max_waiting: int,
                 on_ready: Callable[[Runtime], Any], on_fatal: Callable[[BaseException], None], index: int = 0,
                 count: int = 1) -> None:
        super().__init__(build, max_num_seqs=max_num_seqs, max_waiting=max_waiting, on_ready=on_ready,
                         on_fatal=on_fatal, index=index, count=count)
        self._commands: Connection | None = None  # event-loop thread only
        self._results: Connection | None = None  # event-loop thread only
        self._reader: FrameReader | None = None  # reads self._results (event-loop thread only)
        self._stopping = False

    def _attach(self, commands: Connection, results: Connection) -> None:
        """Use this pair of pipe ends from now on; results are read whenever the event loop sees them readable.
        Meanwhile a thread imports what the ready message's tokenizer will need (:func:`import_tokenizer_modules`)."""
        self._commands, self._results = commands, results
        self._reader = FrameReader(results.fileno())
        self._aio.add_reader(results.fileno(), self._receive)
        threading.Thread(target=import_tokenizer_modules, name="dspark-tokenizer-imports", daemon=True).start()

    def _send(self, cmd: tuple | None) -> None:
        try:
            self._commands.send(cmd)
        except (OSError, ValueError):  # the engine is gone: the end of its results pipe fails every request
            pass

    # ------------------------------------------------------------------ results, on the event loop

    def _receive(self) -> None:
        """The results pipe is readable: take what it holds (at most ``_READ_LIMIT`` bytes in one go, so that a fast
        engine never starves the event loop) and handle every message that is now whole, each step straight into
        :meth:`_dispatch`. Never blocks: a message still arriving waits in the reader for the next call."""
        try:
            for data in self._reader.read():
                msg = pickle.loads(data)
                if msg[0] == "step":
                    self._dispatch([StepOutput(*out) for out in msg[1]], msg[2], msg[3], msg[4])
                elif msg[0] == "ready":
                    self.metrics = self._on_ready(msg[1])
                    self.ready.set()
                else:  # "failed": the child logged the traceback and exits
                    self._engine_failed(msg[1])
                    return
            if self._reader.closed:  # the child is gone (its messages, all taken above, said nothing of why)
                self._ended()
        except OSError:
            self._ended()
        except Exception as err:  # on_ready raised, or a message would not unpickle
            log.exception("engine process: the server could not take its message")
            self._engine_failed(err)

    def _ended(self) -> None:
        """The results pipe ended (the child exited): stop watching it; unless we are stopping, that is a failure."""
        if self._stopping:
            self._close_results()
        else:
            self._engine_failed(self._died())

    def _engine_failed(self, err: BaseException) -> None:
        self._close_results()
        if self._stopping:
            return
        log.error("the engine process failed: %s", err)
        self._failed(err)

    def _close_results(self) -> None:
        if self._results is not None and not self._results.closed:
            if self._aio is not None and not self._aio.is_closed():
                self._aio.remove_reader(self._results.fileno())
            self._results.close()

    def _died(self) -> BaseException:
        return RuntimeError("the engine process exited unexpectedly")


@dataclasses.dataclass
class SpawnedEngine:
    """An engine process started by :func:`spawn_engine`: the child, and this process's ends of its pipes, one
    ``(commands in, results out)`` pair per API server (index 0 first)."""

    proc: multiprocessing.process.BaseProcess
    channels: list[tuple[Connection, Connection]]


def spawn_engine(build: Callable[[], Runtime], count: int = 1) -> SpawnedEngine:
    """Start the engine process (``engine_main``), which calls ``build`` at once: its imports, weights, graphs and
    warm-up run from here on. ``python -m optimized.serve`` calls this before it imports its HTTP stack and hands
    the result to :class:`EngineProcess`, which attaches to it once the event loop runs; results the child sends
    meanwhile wait in the pipe. Call it on a thread that lives as long as the engine should (the main thread): on
    Linux the child dies with that thread (:func:`die_with_parent`)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = [], []  # per API server: (commands in, results out) here, (commands out, results in) there
    for _ in range(count):
        commands_out, commands_in = ctx.Pipe(duplex=False)
        results_out, results_in = ctx.Pipe(duplex=False)
        ours.append((commands_in, results_out))
        theirs.append((commands_out, results_in))
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    proc = ctx.Process(target=engine_main, name="dspark-engine", daemon=True,
                       args=(build, theirs, root.level, fmt, os.getpid()))
    proc.start()
    for commands_out, results_in in theirs:  # the child's ends: once it exits, our reads see the end of the pipe
        commands_out.close()
        results_in.close()
    return SpawnedEngine(proc, ours)


class EngineProcess(PipeClient):
    """The engine in a child process; the same interface as :class:`~optimized.serving.engine_loop.EngineLoop`.

    ``build`` must be picklable (a module-level function, or a ``functools.partial`` / dataclass instance over
    picklable settings): it is sent to the child, which calls it to build the :class:`Runtime`. With ``count`` > 1
    the child also gets a pair of pipes for each further API server: :attr:`peer_channels` holds their HTTP-side
    ends (``(commands, results)``, index 1, 2, ...) from :meth:`start` on, for :class:`EnginePeer` in those servers.
    """

    def __init__(self, build: Callable[[], Runtime], *, max_num_seqs: int, max_waiting: int,
                 on_ready: Callable[[Runtime], Any], on_fatal: Callable[[BaseException], None], count: int = 1,
                 spawned: SpawnedEngine | None = None) -> None:
        """``spawned``: the child, already started with ``build`` by :func:`spawn_engine` (else :meth:`start`
        starts it)."""
        super().__init__(build, max_num_seqs=max_num_seqs, max_waiting=max_waiting, on_ready=on_ready,
                         on_fatal=on_fatal, index=0, count=count)
        if spawned is not None and len(spawned.channels) != count:
            raise ValueError(f"the engine process was started for {len(spawned.channels)} API servers, not {count}")
        self._spawned = spawned
        self._proc: multiprocessing.process.BaseProcess | None = None
        self.peer_channels: list[tuple[Connection, Connection]] = []

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before ``start`` and after ``stop``)."""
        return None if self._proc is None else self._proc.pid

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        spawned = self._spawned if self._spawned is not None else spawn_engine(self._build, self.count)
        self._spawned = None  # the pipes are ours from here on
        self._proc = spawned.proc
        self._attach(*spawned.channels[0])
        self.peer_channels = spawned.channels[1:]

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to stop, wait ``timeout`` seconds, then terminate it, then kill it. A child still starting
        is terminated at once: no request is in flight, and its start-up (graph capture, a cost profile) would only
        be read by the stop once it had finished, seconds later (e.g. when the port turns out to be taken)."""
        self._stopping = True
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if not self.ready.is_set() and proc.is_alive():
            proc.terminate()
        self._send(None)
        # Wait, taking what the child still sends (a step in flight, a late ready message): a child blocked on a full
        # pipe would never see the stop.
        deadline = time.monotonic() + timeout
        while proc.is_alive() and time.monotonic() < deadline:
            try:
                if self._results is not None and not self._results.closed and not self._reader.closed and \
                        self._results.poll(0.05):
                    self._reader.read()  # dropped: nobody waits for these any more
                else:
                    proc.join(0.05)
            except (EOFError, OSError):
                proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("the engine process did not stop within %.0f s: terminating it", timeout)
            proc.terminate()
            proc.join(_STOP_RETRY_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_STOP_RETRY_S)
        self._close_results()
        self._commands.close()

    def _died(self) -> BaseException:
        proc = self._proc
        if proc is not None:
            proc.join(_STOP_RETRY_S)
        code = None if proc is None else proc.exitcode
        how = ("still running" if code is None else f"killed by signal {-code}" if code < 0
               else f"exit code {code}")
        return RuntimeError(f"the engine process exited unexpectedly ({how})")


class EnginePeer(PipeClient):
    """A further API server's view of an engine process that API server 0 started (``--api-server-count``): the
    same client over the pair of pipes it was handed (:attr:`EngineProcess.peer_channels`). It neither starts nor
    stops the engine: :meth:`stop` closes its command pipe, and the engine aborts whatever this server still had
    in flight and carries on with the others."""

    def __init__(self, channel: tuple[Connection, Connection], *, max_num_seqs: int, max_waiting: int,
                 on_ready: Callable[[Runtime], Any], on_fatal: Callable[[BaseException], None], index: int,
                 count: int) -> None:
        super().__init__(None, max_num_seqs=max_num_seqs, max_waiting=max_waiting, on_ready=on_ready,
                         on_fatal=on_fatal, index=index, count=count)
        self._channel = channel

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self._attach(*self._channel)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._close_results()
        if self._commands is not None:
            self._commands.close()

    def _died(self) -> BaseException:
        return RuntimeError("the engine process exited (its server stopped or failed)")


# --------------------------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid``, the process that spawned it, ends, however either of them is busy.

    On Linux the kernel sends this process SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, through
    ctypes): no thread of ours has to run for it, so a start-up stuck in C code that holds the interpreter lock (an
    import, a weight conversion, a graph capture) dies as promptly as an idle loop. The kernel means the parent
    *thread* that forked this process: the server spawns its engine from its main thread, which lives as long as
    the server. A parent that died before this call (while the child was still being spawned) is caught by
    comparing ``os.getppid()`` with ``parent_pid`` after it. Elsewhere (or if prctl fails) a daemon thread makes the
    same comparison every ``_PARENT_POLL_S`` seconds."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):  # no prctl in this libc
            armed = False
    if os.getppid() != parent_pid:  # re-parented already: the server died before the kernel was told
        os._exit(0)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="dspark-parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)  # the server is gone: nobody will read anything this process does any more


def engine_main(build: Callable[[], Runtime], channels: list[tuple[Connection, Connection]], log_level: int,
                log_format: str | None, parent_pid: int | None = None) -> None:
    """The engine process: build the runtime, report ready, step until told to stop (or API server 0 is gone).
    ``parent_pid``: the server's process, which this one must not outlive (:func:`die_with_parent`).

    ``channels``: per API server, (commands in, results out). Every output goes to the server whose request it is
    (request id mod the number of servers); step statistics and the idle signal go to server 0, whose metrics hold
    the engine's. A further server that goes away (its command pipe ends, or its results pipe breaks) has its
    requests aborted; the others carry on."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the HTTP process drains, then stops us
    if log_format is not None:
        logging.basicConfig(level=log_level, format=log_format, stream=sys.stderr)
    set_process_name("dspark-engine")
    count = len(channels)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    started = threading.Event()  # the runtime is built: from then on a stop ends the step loop in order
    live: list[set[int]] = [set() for _ in range(count)]  # per server: its request ids still in the engine
    for i, (commands, _) in enumerate(channels):
        threading.Thread(target=_receive_commands, args=(commands, inbox, stop, live[i], i == 0, started),
                         name=f"dspark-commands-{i}", daemon=True).start()
    sends = [framed_sender(results) for _, results in channels]
    gone = [False] * count  # further servers whose results pipe broke

    def send(i: int, message) -> None:
        if i == 0:  # server 0's pipe failing ends the engine (below)
            sends[0](message)
        elif not gone[i]:
            try:
                sends[i](message)
            except OSError:  # that server is gone: its receiver thread sees the end and aborts its requests
                gone[i] = True

    try:
        runtime = build()
        # This process lives as long as the engine: what start-up left alive (the engine, its imports) is moved out
        # of the garbage collector's reach, so that a full collection walks only what the steps allocate (a stall of
        # the step loop otherwise; optimized/serving/app.py's freeze_heap says how long). build_runtime has done it
        # for the real engine (a second full collection would only lengthen the start-up); a simulated one
        # (scripts/bench_server_overhead.py) gets it here.
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
        started.set()
        ready = Runtime(None, runtime.tokenizer, runtime.vocab_size, runtime.gamma, runtime.has_drafter)
        for i in reversed(range(count)):  # server 0 last: once it answers /health, every server has the engine
            send(i, ("ready", ready))

        def post(outputs, stats, errors, idle: bool) -> None:
            mine = [[] for _ in range(count)]
            refused = [[] for _ in range(count)]
            for out in outputs:
                i = out.request_id % count
                mine[i].append(_OUTPUT_FIELDS(out))
                if out.finished:
                    live[i].discard(out.request_id)
            for rid, err in errors:
                refused[rid % count].append((rid, err))
                live[rid % count].discard(rid)
            send(0, ("step", mine[0], stats, refused[0], idle))
            for i in range(1, count):
                if mine[i] or refused[i]:
                    send(i, ("step", mine[i], None, refused[i], False))

        run_steps(runtime.engine, inbox, stop, post)
    except BaseException as err:
        if stop.is_set() and isinstance(err, OSError):  # the server went away while a step was being sent
            return
        log.exception("engine loop failed")
        for i in range(count):
            try:
                send(i, ("failed", _portable(err)))
            except OSError:
                pass
        sys.exit(1)
    finally:
        for _, results in channels:
            results.close()


def _receive_commands(commands: Connection, inbox: queue.SimpleQueue, stop: threading.Event, live: set[int],
                      primary: bool, started: threading.Event) -> None:
    """Child thread, one per API server: its commands into the step loop's inbox until ``None`` or the end of the
    pipe. Then API server 0 (``primary``) stops the engine; a further server has its requests aborted.

    API server 0 gone before the runtime is built (killed during start-up, however it ended): nobody will ever use
    this engine, and its start-up (graph capture, a cost profile) would run on for up to a minute at full speed, so
    the process ends at once (no request can be in flight yet, nothing is left to flush)."""
    ended = False
    try:
        while (cmd := commands.recv()) is not None:
            if cmd[0] == "add":
                live.add(cmd[1])
            else:
                live.discard(cmd[1])
            inbox.put(cmd)
    except (EOFError, OSError):  # that server is gone
        ended = True
    if primary:
        if ended and not started.is_set():
            log.warning("the server went away while the engine was starting: the engine process stops")
            os._exit(0)
        stop.set()
        inbox.put(None)  # wakes an idle step loop
        return
    for rid in live.copy():  # aborting one that finished meanwhile is a no-op
        inbox.put(("abort", rid))
    live.clear()


def _portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
