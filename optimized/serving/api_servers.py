"""Several HTTP processes in front of one engine process (``python -m optimized.serve --api-server-count N``).

One HTTP process runs out of CPU long before the engine does: on an H200, plain decoding at 64 requests makes
~34k tokens/s, and the HTTP process (HTTP, JSON, SSE framing, detokenisation, metrics) delivers ~20k of them with
its one core busy (docs/serving.md, "Client or server?"). vLLM's answer is ``--api-server-count``, and so is ours:

* API server 0 is the process ``python -m optimized.serve`` started. It binds the listening socket, starts the engine
  process (:class:`~optimized.serving.engine_process.EngineProcess`, one pair of pipes per API server) and then
  servers 1 .. N-1, each a ``spawn`` child (:func:`api_server_main`) that receives the listening socket and its
  pair of pipes and runs the same app on the same socket: the kernel hands each new connection to whichever process
  accepts it first. Request ids are ≡ the server's index mod N, so the engine process sends every output to the
  server whose request it is.
* ``/metrics`` answers for the whole server, whichever process takes the scrape: every API server publishes a
  snapshot of its metrics on a Unix socket in a private directory (:class:`MetricsExchange`), and the process that
  takes the scrape adds them up (request counters and histograms are sums; the engine's own statistics reach
  server 0 only). ``/health`` on server 0 turns 200 once every server has the engine.
* Lifecycle: SIGTERM (or Ctrl-C) to server 0 reaches the others; each stops accepting and lets its requests finish,
  server 0 waits for them to exit, then stops the engine. If a further server dies, server 0 stops the whole server
  (exit 1), as when the engine fails; if server 0 dies, the engine sees its pipe end and stops, and the others see
  the engine's end and stop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("dspark.serve")

_GATHER_TIMEOUT_S = 2.0  # a scrape waits this long for each further server's snapshot
_KILL_AFTER_S = 5.0  # after the drain's deadline, terminate, then kill, a further server that is still running


def set_process_name(name: str) -> None:
    """The process's name in ``ps``/``top`` and ``/proc/PID/comm`` (Linux, at most 15 bytes), so that tools (and
    ``scripts/bench_serving.py``) tell the engine process from the API servers; a no-op elsewhere."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


class MetricsExchange:
    """Each API server's metrics snapshot, readable by the others: server ``index`` answers every connection to
    ``DIR/api-INDEX.sock`` with the pickle of ``snapshot()`` and closes it. The directory is private to the server
    (``tempfile.mkdtemp``: mode 0700), so only its own processes read the pickles."""

    def __init__(self, directory: str, index: int, count: int) -> None:
        self.directory, self.index, self.count = directory, index, count
        self._snapshot: Callable[[], dict] | None = None
        self._server: asyncio.AbstractServer | None = None

    def path(self, index: int) -> str:
        return os.path.join(self.directory, f"api-{index}.sock")

    async def start(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot
        self._server = await asyncio.start_unix_server(self._answer, self.path(self.index))

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(pickle.dumps(self._snapshot(), protocol=pickle.HIGHEST_PROTOCOL))
            await writer.drain()
        except (ConnectionError, OSError):  # the asking server went away
            pass
        finally:
            writer.close()

    async def gather(self) -> list[dict]:
        """Every server's snapshot, this one's first; a server that does not answer within ``_GATHER_TIMEOUT_S``
        is left out (and logged)."""
        others = [i for i in range(self.count) if i != self.index]
        answers = await asyncio.gather(*(self._ask(i) for i in others), return_exceptions=True)
        snapshots = [self._snapshot()]
        for i, answer in zip(others, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("API server %d did not share its metrics: %r", i, answer)
            else:
                snapshots.append(answer)
        return snapshots

    async def _ask(self, index: int) -> dict:
        async def ask() -> dict:
            reader, writer = await asyncio.open_unix_connection(self.path(index))
            try:
                return pickle.loads(await reader.read())
            finally:
                writer.close()

        return await asyncio.wait_for(ask(), _GATHER_TIMEOUT_S)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


@dataclass
class PeerSpec:
    """What API server ``index`` > 0 is handed at spawn (picklable: the socket and the pipe ends travel as file
    descriptors)."""

    index: int
    count: int
    channel: tuple[Connection, Connection]  # (commands out, results in) of EngineProcess.peer_channels
    sock: socket.socket  # the listening socket, shared by every API server
    exchange_dir: str
    settings: Any  # optimized.serving.app.ServerSettings
    max_num_seqs: int
    max_waiting: int
    uvicorn: dict = field(default_factory=dict)  # uvicorn.Config's keyword arguments (log level, access log, ...)
    log_level: int = logging.INFO
    log_format: str | None = None


class ApiServerGroup:
    """API server 0's view of servers 1 .. N-1: spawns them once the engine process has their pipes, forwards the
    signal that stops the server, waits for them on the way out, and reports one that dies (``on_fatal``)."""

    def __init__(self, count: int, sock: socket.socket, settings, *, max_num_seqs: int, max_waiting: int,
                 uvicorn_options: dict) -> None:
        if count < 2:
            raise ValueError("an API server group needs at least 2 servers")
        self.count, self.sock, self.settings = count, sock, settings
        self.max_num_seqs, self.max_waiting, self.uvicorn_options = max_num_seqs, max_waiting, uvicorn_options
        self.exchange_dir = tempfile.mkdtemp(prefix="dspark-serve-")
        self.exchange = MetricsExchange(self.exchange_dir, 0, count)
        self.on_fatal: Callable[[BaseException], None] = lambda err: None
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._stopping = False
        self._aio: asyncio.AbstractEventLoop | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, channels: list[tuple[Connection, Connection]], aio_loop: asyncio.AbstractEventLoop) -> None:
        """Spawn servers 1 .. N-1, server i on ``channels[i - 1]`` (whose ends are closed here once it has them)."""
        if len(channels) != self.count - 1:
            raise ValueError(f"{self.count - 1} further API servers need as many channels, got {len(channels)}")
        self._aio = aio_loop
        ctx = multiprocessing.get_context("spawn")
        root = logging.getLogger()
        fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
        for i, channel in enumerate(channels, start=1):
            spec = PeerSpec(i, self.count, channel, self.sock, self.exchange_dir, self.settings, self.max_num_seqs,
                            self.max_waiting, self.uvicorn_options, root.level, fmt)
            proc = ctx.Process(target=api_server_main, args=(spec,), name=f"dspark-api-{i}", daemon=True)
            proc.start()
            for end in channel:
                end.close()
            aio_loop.add_reader(proc.sentinel, self._exited, proc)
            self._procs.append(proc)
        log.info("API servers 1-%d started (pids %s)", self.count - 1, ", ".join(map(str, self.pids)))

    def _exited(self, proc: multiprocessing.process.BaseProcess) -> None:
        """Event loop: a further server's process ended."""
        self._aio.remove_reader(proc.sentinel)
        proc.join()
        if not self._stopping:
            err = RuntimeError(f"API server {proc.name} exited unexpectedly (exit code {proc.exitcode})")
            log.error("%s: stopping the server", err)
            self.on_fatal(err)

    def signal_all(self, sig: int = signal.SIGTERM) -> None:
        """Ask every further server that still runs to drain and stop."""
        self._stopping = True
        for proc in self._procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    async def stop(self, timeout: float) -> None:
        """Stop servers 1 .. N-1: SIGTERM, up to ``timeout`` s for their drains, then terminate and kill."""
        self.signal_all()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout + _KILL_AFTER_S
        while any(p.is_alive() for p in self._procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for proc in self._procs:
            if proc.is_alive():
                log.warning("API server %s did not stop in time: killing it", proc.name)
                proc.kill()
            proc.join(_KILL_AFTER_S)
            if self._aio is not None and not self._aio.is_closed():
                self._aio.remove_reader(proc.sentinel)
        await self.exchange.close()
        shutil.rmtree(self.exchange_dir, ignore_errors=True)


def api_server_main(spec: PeerSpec) -> None:
    """API server ``spec.index`` > 0: the same app on the shared socket, over its own pipes to the engine."""
    from optimized.serving.app import Server, serve_until_stopped

    if spec.log_format is not None:
        logging.basicConfig(level=spec.log_level, format=spec.log_format, stream=sys.stderr)
    set_process_name(f"dspark-api-{spec.index}")
    server = Server(spec.settings, None, max_num_seqs=spec.max_num_seqs, max_waiting=spec.max_waiting, peer=spec)
    # Ctrl-C reaches the whole process group: server 0 forwards it as a SIGTERM, so it is not acted on here twice.
    sys.exit(serve_until_stopped(server, sockets=[spec.sock], on_signal=lambda sig: sig != signal.SIGINT,
                                 **spec.uvicorn))
