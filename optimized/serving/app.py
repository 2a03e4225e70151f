"""The HTTP side of the server: FastAPI routes for the OpenAI API, ``/health`` and ``/metrics``.

Handlers validate a request (``protocol.py``), turn it into token ids and ``SamplingParams``, hand it to the engine
loop, and stream what comes back; they never touch the engine. Every error leaves in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``:

=====  ==========================================================================================================
400    malformed JSON, wrong types, out-of-range values, unsupported parameters, prompt + max_tokens longer than
       ``--max-model-len``
401    ``--api-key`` set and the ``/v1/*`` request lacks ``Authorization: Bearer <key>``
404    unknown model name, unknown route
408    a request body that stopped arriving (``--body-timeout`` seconds without its next part)
413    a body larger than any prompt that fits ``--max-model-len`` could be
429    more requests in flight than ``--max-num-seqs`` + ``--max-waiting`` (with ``Retry-After``)
503    the engine is still starting (``/health`` answers 503 until warm-up is done), or ``--shutdown-timeout`` ran out
       before the request finished (``shutting_down``)
=====  ==========================================================================================================

Once a stream's headers are out, an error (the engine failed, the shutdown timeout ran out) leaves as an error event
in the same body, followed by ``data: [DONE]``.

A client that disconnects is noticed while its request waits or streams; its request is aborted, which frees the
engine slot before the next step.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import logging
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from optimized.sequence import SamplingParams, StepOutput
from optimized.serving.api_servers import ApiServerGroup, MetricsExchange, PeerSpec
from optimized.serving.engine_loop import (
    EngineClient,
    EngineFailed,
    EngineLoop,
    NotReady,
    Overloaded,
    RequestHandle,
    Runtime,
    seed_key,
)
from optimized.serving.engine_process import EnginePeer, EngineProcess, SpawnedEngine
from optimized.serving.metrics import ServerMetrics
from optimized.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from optimized.serving.text import TextStream, token_text

log = logging.getLogger("dspark.serve")

GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS): 1/T would overflow the logits
# Bytes of request body per token of --max-model-len: a long token (SmolLM2's longest are ~16 characters) fully
# \u-escaped in JSON is ~100 bytes, so a body above this cannot hold a prompt that fits; plus room for the rest.
BODY_BYTES_PER_TOKEN = 128
BODY_BYTES_OVERHEAD = 64 * 1024


class APIError(Exception):
    """An error that leaves as an OpenAI error body with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, ErrorResponse(error=ErrorInfo(message=message, type=type, param=param,
                                                                       code=code))
        self.headers = headers  # extra response headers (Retry-After on 429 and 503)


class ClientDisconnected(Exception):
    """The client went away before its response was complete."""


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body.model_dump(), status_code=err.status, headers=err.headers)


# Retry-After on a 429 (full) or a 503 (not ready yet), in whole seconds as the header allows: a slot frees whenever
# any running request finishes, which at the engine's step rates (a few ms a step) is well within the smallest value.
RETRY_AFTER_S = "1"
# Defaults of --header-timeout and --body-timeout. A request's headers must be complete within this many seconds of
# the connection's opening or of the previous response's end, or the connection is closed: uvicorn's keep-alive timer
# (5 s) closes a connection that stays silent after a response, but nothing closes one that never sends a request,
# or sends its headers a byte at a time, and each holds a socket and a protocol. A client sends its request as it
# connects, so 10 s is slack for any network.
HEADER_TIMEOUT_S = 10.0
# A request body must arrive within this many seconds of its previous part (or of the headers): the largest body a
# prompt of --max-model-len tokens makes is a few hundred kB, seconds even on a slow link; a client that stops
# half-way would otherwise hold a connection and a task for ever.
BODY_READ_TIMEOUT_S = 30.0


@dataclass
class ServerSettings:
    """What the command line fixes about the HTTP side."""

    served_model_names: list[str]  # the first is reported in responses; any of them is accepted
    model_root: str  # --model, as /v1/models reports it
    max_model_len: int  # prompt + completion tokens per request
    api_key: str | None = None
    # Send the steps that queued up for a request while its stream was busy as one chunk (OutputStream). Off: one
    # chunk per engine step whatever the load (scripts/bench_server_overhead.py measures both).
    coalesce_steps: bool = True
    shutdown_timeout: float = 30.0  # --shutdown-timeout: how long API server 0 waits for the others to drain
    header_timeout: float = HEADER_TIMEOUT_S  # --header-timeout: a request's headers, or the connection is closed
    body_timeout: float = BODY_READ_TIMEOUT_S  # --body-timeout: each part of a request's body, or a 408


class Server:
    """The state the routes share: settings, the engine loop, and (once ready) the tokenizer and metrics."""

    def __init__(self, settings: ServerSettings, build: Callable[[], Runtime] | None, *, max_num_seqs: int,
                 max_waiting: int, engine_process: bool = False, group: ApiServerGroup | None = None,
                 peer: PeerSpec | None = None, spawned: SpawnedEngine | None = None) -> None:
        """``build`` makes the engine on the engine thread or, with ``engine_process``, in a child process (then it
        must be picklable; see optimized/serving/engine_process.py).

        With ``--api-server-count`` N > 1 (optimized/serving/api_servers.py), API server 0 passes ``group`` (it
        starts the engine process with a pair of pipes per server, then the other servers) and server i > 0
        passes ``peer`` (its pipes; ``build`` is None). ``spawned``: the engine process, already started with
        ``build`` (``engine_process`` only; optimized/serving/engine_process.py, ``spawn_engine``)."""
        self.settings = settings
        self.group, self.peer = group, peer
        share = dict(max_num_seqs=max_num_seqs, max_waiting=max_waiting, on_ready=self._ready, on_fatal=self._fatal)
        if peer is not None:
            self.loop: EngineClient = EnginePeer(peer.channel, index=peer.index, count=peer.count, **share)
            self.exchange = MetricsExchange(peer.exchange_dir, peer.index, peer.count)
        elif group is not None:
            if not engine_process:
                raise ValueError("several API servers share an engine process: the engine cannot run on a thread")
            self.loop = EngineProcess(build, count=group.count, spawned=spawned, **share)
            self.exchange = group.exchange
            group.on_fatal = self._fatal
        else:
            if spawned is not None and not engine_process:
                raise ValueError("an engine process was started, but the server runs the engine on a thread")
            self.loop = EngineProcess(build, spawned=spawned, **share) if engine_process else EngineLoop(build, **share)
            self.exchange = None
        self._all_ready = group is None  # server 0 of a group: whether every further server has the engine
        self._aio: asyncio.AbstractEventLoop | None = None  # the event loop, once started
        self.cut_requests = 0  # requests ended with an error because --shutdown-timeout ran out
        self.runtime: Runtime | None = None
        self.tokenizer: Any = None
        self.metrics: ServerMetrics | None = None
        self.on_fatal: Callable[[BaseException], None] = lambda err: None  # set by serve.py (stops uvicorn)
        # Whether this process lives as long as the server (serve_until_stopped sets it): then, once ready, the heap
        # is moved out of the garbage collector's reach (freeze_heap).
        self.freeze_gc = False

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def _ready(self, runtime: Runtime) -> ServerMetrics:
        """Engine thread (or the engine process's reader thread), once start-up is done; runs before the first
        request is accepted."""
        self.runtime = runtime
        # With the engine on a thread, the handlers take their own copy: the engine thread decodes with the original
        # (stop strings) concurrently. From the engine process, the unpickled tokenizer is this process's own already.
        self.tokenizer = copy.deepcopy(runtime.tokenizer) if self.loop.shares_runtime else runtime.tokenizer
        self.metrics = ServerMetrics(self.model_name, runtime.gamma, runtime.has_drafter)
        if self.freeze_gc:
            freeze_heap()
        return self.metrics

    def _fatal(self, err: BaseException) -> None:
        self.on_fatal(err)

    # ---------------------------------------------------------------- lifecycle (the app's lifespan)

    async def start(self) -> None:
        loop = self._aio = asyncio.get_running_loop()
        self.loop.start(loop)
        if self.exchange is not None:
            await self.exchange.start(self.metrics_snapshot)
        if self.group is not None:  # the engine process exists now, with a pair of pipes for each further server
            self.group.start(self.loop.peer_channels, loop)

    def cut_after(self, seconds: float) -> None:
        """From any thread (a signal handler): in ``seconds``, end every request still in flight with a 503
        ``shutting_down`` error — in the stream for a streaming request, so that its client reads why it ended and the
        server's drain finishes before uvicorn cuts the connection."""
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._aio.call_later, seconds, self._cut)

    def _cut(self) -> None:
        err = APIError(503, "the server is shutting down, and its --shutdown-timeout ran out before this request "
                            "finished", type="server_error", code="shutting_down")
        n = self.loop.cut(err)
        self.cut_requests += n
        if n:
            log.warning("shutdown: %d request(s) still running when --shutdown-timeout ran out were ended with an "
                        "error", n)

    async def stop(self) -> None:
        if self.group is not None:  # they drain first: the engine serves their requests until they have left
            await self.group.stop(self.settings.shutdown_timeout)
        elif self.exchange is not None:
            await self.exchange.close()
        self.loop.stop()

    def metrics_snapshot(self) -> dict:
        """This API server's share of the metrics, for the others' scrapes (api_servers.MetricsExchange)."""
        ready = self.loop.ready.is_set() and self.loop.failed is None
        return {"ready": ready, "metrics": self.metrics.snapshot() if self.metrics is not None else None}

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of the whole server: with several API servers, their snapshots added up."""
        if self.exchange is None:
            return generate_latest(self.metrics.registry) if self.metrics is not None else b""
        if self.runtime is None:  # this server has not heard from the engine yet: nothing to add up
            return b""
        snapshots = [s["metrics"] for s in await self.exchange.gather() if s["metrics"] is not None]
        rt = self.runtime
        return generate_latest(ServerMetrics.merged(self.model_name, rt.gamma, rt.has_drafter, snapshots).registry)

    async def check_health(self) -> None:
        """``/health``: 200 once the engine is ready here; on server 0 of a group, once every server has it."""
        self.check_ready()
        if not self._all_ready:
            answers = await self.exchange.gather()
            if len(answers) < self.group.count or not all(a["ready"] for a in answers):
                raise APIError(503, "the API servers are starting; retry when GET /health answers 200",
                               type="server_error", code="not_ready")
            self._all_ready = True

    # ---------------------------------------------------------------- request preparation

    def check_ready(self) -> None:
        if self.loop.failed is not None:
            raise APIError(503, "the engine has failed; the server is shutting down", type="server_error",
                           code="engine_failed")
        if not self.loop.ready.is_set():
            raise APIError(503, "the engine is starting; retry when GET /health answers 200", type="server_error",
                           code="not_ready")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            served = ", ".join(self.settings.served_model_names)
            raise APIError(404, f"The model `{name}` does not exist. Served: {served}", param="model",
                           code="model_not_found")

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if min(ids) < 0 or max(ids) >= self.runtime.vocab_size:
            raise APIError(400, f"prompt token ids must lie in [0, {self.runtime.vocab_size})", param=param)
        return ids

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return self.check_prompt(list(self.tokenizer(body.prompt)["input_ids"]), "prompt")
        return self.check_prompt(list(body.prompt), "prompt")

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The messages through the target's chat template (the same rendering as ``Target.encode``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja's TemplateError and friends: the template refused these messages
            raise APIError(400, f"the chat template cannot render these messages: {err}", param="messages") from err
        return self.check_prompt(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), "messages")

    def sampling_params(self, body: SamplingRequest, prompt_len: int, limit: int | None, logprobs: bool,
                        top: int, param: str) -> SamplingParams:
        max_len = self.settings.max_model_len
        room = max_len - prompt_len
        if room < 1 or (limit is not None and limit > room):
            asked = prompt_len + (limit if limit is not None else 1)
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                                f"{asked} tokens ({prompt_len} in the {param}, {asked - prompt_len} in the "
                                "completion). Please reduce the length of the prompt or the completion.",
                           param=param if room < 1 else "max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(
                max_new_tokens=room if limit is None else limit,
                temperature=0.0 if body.temperature < GREEDY_BELOW else body.temperature,
                top_p=body.top_p, top_k=min(max(body.top_k, 0), self.runtime.vocab_size),
                stop=body.stop_strings, ignore_eos=body.ignore_eos, logprobs=logprobs, raw_logprobs=logprobs,
                top_logprobs=top, seed=None if body.seed is None else seed_key(body.seed))
        except ValueError as err:
            raise APIError(400, str(err)) from err

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        try:
            return self.loop.submit(prompt_ids, params)
        except NotReady as err:
            raise APIError(503, "the engine is not ready", type="server_error", code="not_ready",
                           headers={"Retry-After": RETRY_AFTER_S}) from err
        except Overloaded as err:
            raise APIError(429, f"too many requests in flight ({self.loop.capacity} = --max-num-seqs + "
                                "--max-waiting); retry later", type="rate_limit_error",
                           code="too_many_requests", headers={"Retry-After": RETRY_AFTER_S}) from err

    # ---------------------------------------------------------------- logprobs in OpenAI's two shapes

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        text = token_text(self.tokenizer, token_id)
        return text, list(text.encode("utf-8"))

    def chat_logprobs(self, out) -> ChatLogprobs:
        content = []
        for i, (tok, lp) in enumerate(zip(out.new_token_ids, out.new_logprobs)):
            text, raw = self._token(tok)
            alts = out.new_top_logprobs[i] if i < len(out.new_top_logprobs) else []
            content.append(TokenLogprob(token=text, logprob=lp, bytes=raw, top_logprobs=[
                TopLogprob(token=t, logprob=v, bytes=b) for t, b, v in ((*self._token(a), v) for a, v in alts)]))
        return ChatLogprobs(content=content)

    def completion_logprobs(self, out, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for i, (tok, value) in enumerate(zip(out.new_token_ids, out.new_logprobs)):
            text, _ = self._token(tok)
            top = {self._token(a)[0]: v for a, v in (out.new_top_logprobs[i] if i < len(out.new_top_logprobs) else [])}
            top[text] = value  # OpenAI: the sampled token is always among them
            lp.tokens.append(text)
            lp.token_logprobs.append(value)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp


class OutputStream:
    """A request's ``StepOutput`` s as an async iterator; notices a client disconnect while waiting or streaming.

    ``close()`` (always called, in a ``finally``) aborts the request if it has not finished, which frees its slot.
    """

    _DISCONNECTED = object()

    def __init__(self, server: Server, handle: RequestHandle, request: Request) -> None:
        self.server, self.handle = server, handle
        self._pending = None  # an item taken from the queue while coalescing, returned next
        self.coalesce = server.settings.coalesce_steps
        self._watch = asyncio.create_task(self._watch_disconnect(request))

    async def _watch_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.server.loop.abort(self.handle)  # free the slot now, whatever the consumer is doing
        self.handle.queue.put_nowait(self._DISCONNECTED)

    def __aiter__(self) -> AsyncIterator:
        return self

    async def __anext__(self) -> StepOutput:
        queue = self.handle.queue
        if self._pending is not None:
            item, self._pending = self._pending, None
        elif self.handle.finished and queue.empty():
            raise StopAsyncIteration
        else:
            item = await queue.get()
        if item is self._DISCONNECTED:
            raise ClientDisconnected()
        if isinstance(item, ValueError):  # the engine refused the request (the server validates first)
            raise APIError(400, str(item))
        if isinstance(item, Exception):
            raise item
        # Steps that queued up while this stream was busy (an event loop behind its engine) leave as one chunk: under
        # load each SSE event, JSON document and socket write then carries several steps' tokens, so the server's
        # cost per token falls exactly when it matters, and no token waits longer than it did.
        while self.coalesce and not item.finished and not queue.empty():
            nxt = queue.get_nowait()
            if not isinstance(nxt, StepOutput):  # an error or the disconnect: after these tokens
                self._pending = nxt
                break
            item = merge_outputs(item, nxt)
        return item

    def close(self) -> None:
        self._watch.cancel()
        self.server.loop.abort(self.handle)  # no-op for a finished request


def merge_outputs(first: StepOutput, then: StepOutput) -> StepOutput:
    """Two consecutive step outputs of one request as one (tokens and log-probabilities concatenated)."""
    return StepOutput(first.request_id, first.new_token_ids + then.new_token_ids, then.finished, then.finish_reason,
                      first.new_logprobs + then.new_logprobs, first.new_top_logprobs + then.new_top_logprobs)


def _stream_error(err: Exception) -> ErrorResponse:
    if isinstance(err, APIError):
        return err.body
    return APIError(500, f"the engine failed: {err}", type="server_error", code="engine_failed").body


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _sse(model) -> bytes:
    return format_sse_event(data_str=model.model_dump_json())


_SSE_DONE = format_sse_event(data_str="[DONE]")


class PieceEvent:
    """The SSE event of a streamed chunk whose only varying fields are its text and its running usage, by splicing.

    Most chunks of a stream differ from each other only in the text piece and, with ``continuous_usage_stats``, the
    token counts (no finish reason, no log-probabilities): the chunk's JSON is rendered once with markers in place
    of the text and of the two counts and split there, and each event is the fixed parts around
    ``json.dumps(piece)`` and the two numbers: one string escape per chunk instead of building four models and
    serialising them (about 3 against 13 µs on the project's CPU). Python's escaping with ``ensure_ascii=False``
    gives the same bytes as pydantic's for any text (``tests/serving/test_units.py``).
    """

    MARK = "@@dspark-piece@@"
    COUNT_MARKS = (987654321987, 987654321989)  # completion_tokens, total_tokens of the template's usage

    def __init__(self, template, prompt_tokens: int = 0) -> None:
        """``template``: the chunk model with :attr:`MARK` as its text and, for a running usage, a usage of
        ``prompt_tokens`` with :attr:`COUNT_MARKS` as its completion and total counts."""
        text = template.model_dump_json()
        marks = [json.dumps(self.MARK)] + [str(m) for m in self.COUNT_MARKS if str(m) in text]
        if len(marks) == 2:  # one count without the other: not a template of this class
            raise ValueError("the chunk template has only one of the two count markers")
        parts = []
        for mark in marks:  # in this order in the JSON: the choices come before the usage
            head, *rest = text.split(mark)
            if len(rest) != 1:  # the marker also occurs elsewhere (a served model name, say): not splittable
                raise ValueError("each marker must occur in the chunk template exactly once, in order")
            parts.append(head)
            text = rest[0]
        self.parts, self.tail, self.prompt_tokens = parts, text, prompt_tokens

    def __call__(self, piece: str, completion_tokens: int = 0) -> bytes:
        data = self.parts[0] + json.dumps(piece, ensure_ascii=False)
        if len(self.parts) == 3:
            data += (self.parts[1] + str(completion_tokens) + self.parts[2]
                     + str(self.prompt_tokens + completion_tokens))
        return format_sse_event(data_str=data + self.tail)


def piece_events(template, prompt_tokens: int = 0) -> PieceEvent | None:
    """A :class:`PieceEvent` for ``template``, or None where a marker cannot be told apart (the models then)."""
    try:
        return PieceEvent(template, prompt_tokens)
    except ValueError:
        return None


def _template_usage(body, prompt_tokens: int) -> Usage | None:
    """The running usage of a chunk template (:attr:`PieceEvent.COUNT_MARKS`), or None without continuous usage."""
    if not body.continuous_usage:
        return None
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=PieceEvent.COUNT_MARKS[0],
                 total_tokens=PieceEvent.COUNT_MARKS[1])


def _json(model, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


# --------------------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------------------


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass



class BodyLimitMiddleware:
    """Refuse a body larger than any request whose prompt fits ``--max-model-len`` could be (413), before reading
    it. A body without Content-Length that grows past the limit is cut off while being read (FastAPI answers 400).
    A body that stops arriving (``read_timeout`` seconds without its next part) gets a 408."""

    def __init__(self, app, max_bytes: int, read_timeout: float = BODY_READ_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            err = APIError(413, f"request body of {length} bytes exceeds {self.max_bytes} bytes, more than a prompt "
                                "of --max-model-len tokens needs", code="request_too_large")
            return await error_response(err)(scope, receive, send)
        seen, body_done, timed_out = 0, False, False

        async def limited_receive():
            nonlocal seen, body_done, timed_out
            if body_done:  # after the body: the disconnect watch waits here as long as a stream lasts
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except TimeoutError:
                timed_out = True
                raise _BodyTimeout() from None
            seen += len(message.get("body", b""))
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if seen > self.max_bytes:
                raise _BodyTooLarge()
            return message

        forwarded = False  # whether any of the app's response reached the client

        async def timed_send(message) -> None:
            # The app answers a body it could not read in its own way (a 400, a 422, a 500); a body that stopped
            # arriving gets the 408 below instead, so nothing of that answer is forwarded.
            nonlocal forwarded
            if not timed_out:
                forwarded = True
                await send(message)

        try:
            await self.app(scope, limited_receive, timed_send)
        except _BodyTimeout:  # the app let the read's failure through
            pass
        if timed_out and not forwarded:
            err = APIError(408, f"the request body stopped arriving ({self.read_timeout:g} s without its next part)",
                           code="request_timeout")
            await error_response(err)(scope, receive, send)


class APIKeyMiddleware:
    """Every ``/v1/*`` request needs ``Authorization: Bearer <key>``, checked before anything else is parsed."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key):
                err = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                               type="authentication_error", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(server: Server) -> FastAPI:
    settings = server.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        yield
        await server.stop()

    app = FastAPI(title="DSpark OpenAI-compatible server", lifespan=lifespan)
    # add_middleware puts each new one outside the last: the key is checked first, then the body size.
    app.add_middleware(BodyLimitMiddleware,
                       max_bytes=BODY_BYTES_OVERHEAD + BODY_BYTES_PER_TOKEN * settings.max_model_len,
                       read_timeout=settings.body_timeout)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    # ---------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        errors = err.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, loc = "the request body is not valid JSON", []
        elif first.get("type") == "missing" and not loc:
            message = "the request body is missing"
        else:
            msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            message = f"{'.'.join(loc)}: {msg}" if loc else msg
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(APIError(400, message, param=".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(err.status_code)
        return error_response(APIError(err.status_code, str(err.detail), type=kind, code=code))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, err: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(EngineFailed)
    async def _failed(request: Request, err: EngineFailed):
        return error_response(APIError(500, f"the engine failed: {err}", type="server_error", code="engine_failed"))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", type="server_error"))

    # ---------------------------------------------------------------- plain routes

    @app.get("/health")
    async def health():
        await server.check_health()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(await server.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return _json(ModelList(data=[ModelCard(id=name, root=settings.model_root, max_model_len=settings.max_model_len)
                                     for name in settings.served_model_names]))

    # ---------------------------------------------------------------- completions

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        server.check_ready()
        server.check_model(body.model)
        prompt = server.completion_prompt(body)
        want_lp = body.logprobs is not None
        params = server.sampling_params(body, len(prompt), body.max_tokens, want_lp, body.logprobs or 0, "prompt")
        handle = server.submit(prompt, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        text, stream = TextStream(server.tokenizer, params.stop), OutputStream(server, handle, request)
        n_prompt = len(prompt)

        def chunk(piece: str, finish: str | None, n_out: int, lp=None) -> CompletionChunk:
            return CompletionChunk(id=rid, created=created, model=server.model_name, choices=[CompletionChoice(
                text=piece, logprobs=lp, finish_reason=finish)],
                usage=_usage(n_prompt, n_out) if body.continuous_usage else None)

        if body.stream:
            # The common chunk (text and running usage) by splicing; finish and log-probabilities by the models.
            fast = None if want_lp else piece_events(CompletionChunk(
                id=rid, created=created, model=server.model_name,
                choices=[CompletionChoice(text=PieceEvent.MARK)], usage=_template_usage(body, n_prompt)), n_prompt)

            async def events():
                n_out, offset = 0, 0
                try:
                    async for out in stream:
                        n_out += len(out.new_token_ids)
                        piece = text.add(out.new_token_ids, out.finished)
                        lp = server.completion_logprobs(out, offset) if want_lp else None
                        offset += len(piece)
                        if fast is not None and piece and not out.finished:
                            yield fast(piece, n_out)
                        elif piece or lp or out.finished:
                            yield _sse(chunk(piece, out.finish_reason if out.finished else None, n_out, lp))
                    if body.include_usage:
                        yield _sse(CompletionChunk(id=rid, created=created, model=server.model_name, choices=[],
                                                   usage=_usage(n_prompt, n_out)))
                    yield _SSE_DONE
                except (EngineFailed, APIError) as err:  # the headers are out: the error goes in the stream
                    yield _sse(_stream_error(err))
                    yield _SSE_DONE  # then the stream ends as any stream does (vLLM's order too)
                except ClientDisconnected:  # nobody is listening any more; close() below aborts the request
                    return
                finally:
                    stream.close()
            return EventSourceResponse(events())

        n_out, reason, lp = 0, None, CompletionLogprobs() if want_lp else None
        try:
            async for out in stream:
                n_out += len(out.new_token_ids)
                text.add(out.new_token_ids, out.finished)
                if want_lp:
                    part = server.completion_logprobs(out, lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0)
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(lp, name).extend(getattr(part, name))
                reason = out.finish_reason
        finally:
            stream.close()
        return _json(CompletionResponse(id=rid, created=created, model=server.model_name, choices=[
            CompletionChoice(text=text.text, logprobs=lp, finish_reason=reason)], usage=_usage(n_prompt, n_out)))

    # ---------------------------------------------------------------- chat completions

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_ready()
        server.check_model(body.model)
        prompt = server.chat_prompt(body)
        top = body.top_logprobs or 0
        params = server.sampling_params(body, len(prompt), body.token_limit, body.logprobs, top, "messages")
        handle = server.submit(prompt, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        text, stream = TextStream(server.tokenizer, params.stop), OutputStream(server, handle, request)
        n_prompt = len(prompt)

        if body.stream:
            def chunk(delta: DeltaMessage, finish=None, lp=None, n_out=0) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=server.model_name, choices=[
                    ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=finish)],
                    usage=_usage(n_prompt, n_out) if body.continuous_usage else None)

            # The common chunk (text and running usage) by splicing; finish and log-probabilities by the models.
            fast = None if body.logprobs else piece_events(ChatCompletionChunk(
                id=rid, created=created, model=server.model_name,
                choices=[ChatChunkChoice(delta=DeltaMessage(content=PieceEvent.MARK))],
                usage=_template_usage(body, n_prompt)), n_prompt)

            async def events():
                n_out = 0
                try:
                    yield _sse(chunk(DeltaMessage(role="assistant", content="")))
                    async for out in stream:
                        n_out += len(out.new_token_ids)
                        piece = text.add(out.new_token_ids, out.finished)
                        lp = server.chat_logprobs(out) if body.logprobs else None
                        if fast is not None and piece and not out.finished:
                            yield fast(piece, n_out)
                        elif piece or lp or out.finished:
                            yield _sse(chunk(DeltaMessage(content=piece) if piece else DeltaMessage(),
                                             out.finish_reason if out.finished else None, lp, n_out))
                    if body.include_usage:
                        yield _sse(ChatCompletionChunk(id=rid, created=created, model=server.model_name, choices=[],
                                                       usage=_usage(n_prompt, n_out)))
                    yield _SSE_DONE
                except (EngineFailed, APIError) as err:  # the headers are out: the error goes in the stream
                    yield _sse(_stream_error(err))
                    yield _SSE_DONE  # then the stream ends as any stream does (vLLM's order too)
                except ClientDisconnected:  # nobody is listening any more; close() below aborts the request
                    return
                finally:
                    stream.close()
            return EventSourceResponse(events())

        n_out, reason, content = 0, None, []
        try:
            async for out in stream:
                n_out += len(out.new_token_ids)
                text.add(out.new_token_ids, out.finished)
                if body.logprobs:
                    content += server.chat_logprobs(out).content
                reason = out.finish_reason
        finally:
            stream.close()
        choice = ChatChoice(message=AssistantMessage(content=text.text), finish_reason=reason,
                            logprobs=ChatLogprobs(content=content) if body.logprobs else None)
        return _json(ChatCompletionResponse(id=rid, created=created, model=server.model_name, choices=[choice],
                                            usage=_usage(n_prompt, n_out)))

    return app



def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic garbage collector's reach (``gc.freeze``).

    An HTTP process holds transformers, pydantic, FastAPI and the tokenizer: hundreds of thousands of objects that live
    as long as it does. Streaming allocates containers at every step (unpickled outputs, events), so full collections
    come every second or so, and each walked all of them: on the project's 2-core CPU at 256 streams, 11 of them took
    1.6 s (about 140 ms each, every stream stalled meanwhile) against 0.5 s for all the young-generation collections
    (a ``gc.callbacks`` probe under ``scripts/profile_server.py``). Frozen, a full collection walks what streaming
    allocated only. For a process that serves until it exits (``serve_until_stopped``); the frozen objects' cycles
    are never collected."""
    gc.collect()
    gc.freeze()


def header_timeout(protocol: type, seconds: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol class ``protocol`` (h11 or httptools), closing a connection that has not completed a
    request's headers ``seconds`` after it opened or after its previous response ended.

    Both protocols keep ``cycle`` (the request being served) until the next request's headers are complete, so a
    timer that finds ``cycle`` unchanged knows that none were. An idle connection after a response is closed by
    uvicorn's keep-alive timer first (5 s) unless this timeout is shorter; one that sends half a request line or
    half its headers, which cancels the keep-alive timer, is closed by this one."""

    class HeaderTimeout(protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()

        def _await_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._close_without_headers, self.cycle)

        def _close_without_headers(self, cycle) -> None:
            self._header_timer = None
            # ``cycle`` still the latest request and done with (None: there was none): no headers came since
            # armed. A pipelined request started by the previous response's end is still being answered: wait.
            waiting = cycle is None or cycle.response_complete
            if self.cycle is cycle and waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    HeaderTimeout.__name__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeout


def serve_until_stopped(server: Server, *, sockets: list | None = None,
                        on_signal: Callable[[int], bool] = lambda sig: True, **config: Any) -> int:
    """Run ``server``'s app under uvicorn (``config``: ``uvicorn.Config``'s keywords) until SIGTERM / SIGINT has
    drained it (returns 0) or its engine failed (1). ``on_signal(sig)`` runs on each stop signal first and says
    whether this process drains on it (API server 0 forwards it to the others; they ignore Ctrl-C themselves)."""
    # uvicorn cuts the connections still open when its graceful shutdown times out; the requests still running are
    # ended with an error event a little before (a tenth of the timeout, at most a second), so that they end cleanly.
    timeout = config.get("timeout_graceful_shutdown")
    cut_after = None if timeout is None else max(0.0, timeout - min(1.0, 0.1 * timeout))

    class HTTPServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if on_signal(sig):
                if cut_after is not None and not self.should_exit:  # the first stop signal
                    server.cut_after(cut_after)
                super().handle_exit(sig, frame)

    if "http" not in config:  # uvicorn's choice ("auto": httptools if installed, else h11), with the header timeout
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        config["http"] = header_timeout(AutoHTTPProtocol, server.settings.header_timeout)
    server.freeze_gc = True
    http = HTTPServer(uvicorn.Config(build_app(server), **config))
    exit_code = 0

    def fatal(err: BaseException) -> None:  # engine thread (or reader thread): stop the HTTP server, exit 1
        nonlocal exit_code
        exit_code = 1
        http.should_exit = True

    server.on_fatal = fatal
    # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal to the handler it found at start: these make
    # that a no-op, so a drained server exits 0.
    def stopped(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if server.cut_requests:
            log.warning("%s: stopped; %d request(s) were ended by --shutdown-timeout", name, server.cut_requests)
        else:
            log.info("%s: drained", name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopped)
    http.run(sockets=sockets)
    return exit_code
