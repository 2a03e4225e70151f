"""The OpenAI API schemas the server speaks, as pydantic models: requests, responses, stream chunks, errors.

Field names, defaults and ranges follow the OpenAI API reference (and vLLM's server where OpenAI is silent: ``top_k``,
``ignore_eos``, an optional ``model``). A request is validated here, before it reaches the engine: a wrong type or an
out-of-range value becomes a 400 with an OpenAI-style error body (``app.py``). Parameters that this server does not
implement are accepted at their neutral value and refused with a clear message otherwise, never silently ignored.
Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (vLLM's default --max-logprobs is the same)
_INT64 = 2**63


class APIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


class StreamOptions(APIModel):
    include_usage: bool = False  # one last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # vLLM: the running usage in every chunk


class SamplingRequest(APIModel):
    """The fields completions and chat completions share."""

    model: str | None = None  # None: the (first) served model name
    max_tokens: int | None = Field(None, ge=1)  # None: up to --max-model-len
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 and -1 switch it off
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: decode to max_tokens (benchmarks)
    # Accepted at their neutral values only (the engine samples from the target distribution exactly).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n must be 1: this server returns one choice per request (send {v} requests instead)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                     "stop_token_ids")
    @classmethod
    def _neutral_only(cls, v, info: ValidationInfo):
        if v != cls.model_fields[info.field_name].default and v not in ({}, []):
            raise ValueError(f"{info.field_name} is not supported by this server (only its neutral value is accepted)")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a raw prompt, no chat template."""

    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top alternatives per token (+ the sampled one)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("send one prompt per request (batched prompts are not supported)")
            return v[0]
        return v

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo or self.suffix or (self.best_of not in (None, 1)):
            raise ValueError("echo, suffix and best_of are not supported by this server")
        return self


class TextPart(APIModel):
    type: Literal["text"]
    text: str


class ChatMessage(APIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ResponseFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the target's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools and tool_choice are not supported by this server")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format other than text is not supported by this server")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------------------


class Usage(APIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(APIModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(APIModel):
    content: list[TokenLogprob]


class CompletionLogprobs(APIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort"] | None


class CompletionChoice(APIModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(APIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(APIModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(APIModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(APIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(APIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(APIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(APIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(APIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(APIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dspark"
    root: str
    max_model_len: int


class ModelList(APIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(APIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(APIModel):
    error: ErrorInfo
