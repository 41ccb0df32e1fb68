"""OpenAI-compatible HTTP API over the engine loop.

Bad input never reaches the engine thread as an exception: bodies are validated here (pydantic,
unknown fields refused) and the engine's own ValueErrors come back as 400s, in OpenAI's error
shape. A streaming client that goes away has its request aborted, freeing its KV blocks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from dynaspec.engine.request import RequestOutput
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.engine_loop import EngineLoop


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
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# fields the engine does not implement: refused unless left at their neutral value
_UNSUPPORTED = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "logprobs": None,
    "echo": False,
    "best_of": None,
    "suffix": None,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
}


def build_app(engine_loop: EngineLoop, served_model_name: str) -> FastAPI:
    app = FastAPI(title="dynaspec", version="0.1.0")
    engine = engine_loop.engine
    max_len = engine.max_model_len
    engine_loop.metrics.attach(lambda: engine_loop.snapshot)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return _error(
                400, f"request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json"
            )
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unsupported parameter: {param}", param, "unsupported_parameter")
        return _error(400, f"{param}: {first.get('msg', 'invalid value')}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), None, None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dynaspec",
                    "max_model_len": max_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine_loop.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        prompt: str | list[int] = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(
                    400, "prompt: batches of prompts are not supported; send one per request", "prompt"
                )
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        return await _serve(
            body, prompt, body.max_tokens if body.max_tokens is not None else 16, http, chat=False
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(body, messages, limit, http, chat=True)

    async def _serve(body: _Common, prompt, max_tokens: int | None, http: Request, chat: bool):
        if body.model != served_model_name:
            raise APIError(
                404,
                f"model '{body.model}' does not exist; this server serves '{served_model_name}'",
                "model",
                "model_not_found",
                "not_found_error",
            )
        for name, neutral in _UNSUPPORTED.items():
            value = getattr(body, name, neutral)
            if name in body.model_fields_set and value != neutral and value not in (None, False, {}, []):
                raise APIError(400, f"unsupported parameter: {name}", name, "unsupported_parameter")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens: must be >= 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and max_tokens >= max_len:
            raise APIError(
                400, f"max_tokens: {max_tokens} exceeds the model's context of {max_len} tokens", "max_tokens"
            )
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else max_len,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                ignore_eos=body.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            queue = await engine_loop.submit(prompt, params, request_id)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(
                _stream(queue, request_id, params, chat, include_usage, http),
                media_type="text/event-stream",
            )
        try:
            while True:
                out: RequestOutput = await queue.get()
                if out.finished:
                    break
        except BaseException:
            engine_loop.abort(request_id)
            raise
        return _full_response(out, request_id, chat)

    async def _stream(
        queue, request_id: str, params: SamplingParams, chat: bool, include_usage: bool, http: Request
    ) -> AsyncIterator[str]:
        created = int(time.time())
        sent = 0
        finished = False
        hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may still complete
        try:
            if chat:
                yield _sse(_chunk(request_id, created, chat, {"role": "assistant", "content": ""}, None))
            while True:
                out: RequestOutput = await queue.get()
                text = out.text
                upto = len(text) if out.finished else max(sent, len(text) - hold)
                if upto > sent:
                    yield _sse(_chunk(request_id, created, chat, text[sent:upto], None))
                    sent = upto
                if out.finished:
                    finished = True
                    reason = out.finish_reason.value if out.finish_reason else "stop"
                    yield _sse(_chunk(request_id, created, chat, "", reason))
                    if include_usage:
                        yield _sse(_usage_chunk(request_id, created, chat, out))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:  # the client went away (or the server is stopping): free its KV now
                engine_loop.abort(request_id)

    def _full_response(out: RequestOutput, request_id: str, chat: bool) -> dict:
        reason = out.finish_reason.value if out.finish_reason else "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [choice],
            "usage": _usage(out),
        }

    def _chunk(request_id: str, created: int, chat: bool, delta: str | dict, reason: str | None) -> dict:
        if chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        return {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": served_model_name,
            "choices": [choice],
        }

    def _usage_chunk(request_id: str, created: int, chat: bool, out: RequestOutput) -> dict:
        return {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": served_model_name,
            "choices": [],
            "usage": _usage(out),
        }

    return app


def _usage(out: RequestOutput) -> dict:
    n = len(out.output_token_ids)
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": n,
        "total_tokens": out.num_prompt_tokens + n,
    }


def _text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(
    status: int, message: str, param: str | None, code: str | None, kind: str = "invalid_request_error"
):
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": code}},
    )
