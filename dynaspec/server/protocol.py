"""The OpenAI request bodies and what each field does here.

Fields the server implements are declared and type-checked; fields that would change the output
but are not implemented (tools, a JSON response format, best_of above n, suffix) are refused by
name; any other field (user, metadata, store, service_tier, ...) is accepted and ignored, logged
once per field name.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynaspec.sampling_params import MAX_LOGPROBS

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """SDKs and gateways send null for fields they leave unset: it means the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


MAX_IGNORED_NAMES = 64  # ignored field names remembered (and logged); a fuzzer sends endless new ones


class IgnoredFields:
    """Logs each ignored field name the first time a request sends it, for the first
    ``MAX_IGNORED_NAMES`` names: a server that runs for days keeps a bounded set and log."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._full = False  # MAX_IGNORED_NAMES names seen: no more are remembered or logged

    def note(self, body: BaseModel) -> None:
        for name in body.model_extra or {}:
            if self._full or name in self._seen:
                continue
            if len(self._seen) == MAX_IGNORED_NAMES:
                self._full = True
                log.info("ignoring more request field names; the first %d were logged", MAX_IGNORED_NAMES)
                continue
            self._seen.add(name)
            log.info("ignoring request field %r (not used by this server)", name)


def refuse_unsupported(body: CompletionRequest | ChatRequest) -> None:
    """A 400 naming the first field that would change the output and is not implemented."""
    if isinstance(body, ChatRequest):
        for name in ("tools", "functions"):
            if getattr(body, name):
                _refuse(name, "tool calling is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(body, name) not in (None, "none", "auto"):
                _refuse(name, "tool calling is not supported")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            _refuse("response_format", "only the text response format is supported")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs", "invalid_value")
    else:
        if body.suffix:
            _refuse("suffix", "suffix (insertion) is not supported")
        if body.best_of is not None and body.best_of != body.n:
            message = "best_of other than n is not supported" if body.best_of > body.n else "must be >= n"
            _refuse("best_of", message)
        if body.echo and body.stream and body.logprobs is not None:
            _refuse("echo", "echo with logprobs is not supported when streaming")


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def _refuse(name: str, message: str) -> None:
    raise APIError(400, f"unsupported parameter: {name}: {message}", name, "unsupported_parameter")
