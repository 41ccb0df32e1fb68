"""OpenAI-compatible HTTP API over a backend: the in-process engine loop or engine replicas.

Bad input never reaches the engine thread as an exception: bodies are validated here (pydantic;
see ``protocol.py`` for which fields are refused or ignored) and the engine's own ValueErrors come
back as 400s, in OpenAI's error shape. One HTTP request becomes one engine request per prompt and
sample (``n``); a streaming client that goes away has its requests aborted, freeing their KV blocks.
A request whose engine went away (a replica that died) gets a 503, or an SSE error event once its
stream has started. The ``X-Dynaspec-Replica`` header pins a request to one replica (tests, debugging).
Log-probabilities are the target's raw ones (before penalties, temperature, top-k and top-p).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dynaspec.engine.request import RequestOutput
from dynaspec.engine.types import TokenLogprob
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.backend import Backend, RequestFailed, Unavailable
from dynaspec.server.middleware import Guard, GuardConfig
from dynaspec.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    IgnoredFields,
    logit_bias_ids,
    refuse_unsupported,
)


@dataclass(slots=True)
class Choice:
    """One engine request of an HTTP request: a prompt and a sample of it."""

    index: int  # OpenAI's choice index: prompt index * n + sample index
    sample: int  # 0..n-1
    request_id: str
    prompt_ids: list[int]
    echo_text: str  # the prompt's text with echo, else empty
    params: SamplingParams
    final: RequestOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the output tokens so far


REPLICA_HEADER = "x-dynaspec-replica"  # pins a request to one engine replica (tests, debugging)


def build_app(backend: Backend, served_model_name: str, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(title="dynaspec", version="0.1.0")
    app.add_middleware(Guard, config=guard or GuardConfig())
    tokenizer = backend.tokenizer
    max_len = backend.max_model_len
    ignored = IgnoredFields()
    token_texts: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        text = token_texts.get(token_id)
        if text is None:
            text = token_texts[token_id] = tokenizer.decode([token_id])
        return text

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.kind)

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable):
        response = _error(503, str(exc), None, "server_unavailable", "server_error")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(RequestFailed)
    async def _request_failed(_: Request, exc: RequestFailed):
        return _error(503, str(exc), None, "engine_failed", "server_error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return _error(
                400, f"request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json"
            )
        return _error(400, f"{param}: {first.get('msg', 'invalid value')}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), None, None)

    @app.get("/health")
    async def health():
        if backend.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
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
        return PlainTextResponse(backend.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "prompt: must not be empty", "prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        return await _serve(body, prompts, max_tokens, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(body, [messages], limit, http, chat=True)

    def _params(body: CompletionRequest | ChatRequest, max_tokens: int | None, chat: bool) -> SamplingParams:
        """The sampling parameters of sample 0 (the others differ in their seed only)."""
        echo = not chat and body.echo
        if max_tokens is not None and max_tokens < (0 if echo else 1):
            raise APIError(400, f"max_tokens: must be >= 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and max_tokens >= max_len:
            raise APIError(
                400, f"max_tokens: {max_tokens} exceeds the model's context of {max_len} tokens", "max_tokens"
            )
        if chat:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        prompt_logprobs = None
        if echo and (logprobs is not None or max_tokens == 0):
            prompt_logprobs = logprobs or 0
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else max_len,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=logit_bias_ids(body.logit_bias),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None

    async def _serve(
        body: CompletionRequest | ChatRequest,
        prompts: list,
        max_tokens: int | None,
        http: Request,
        chat: bool,
    ):
        if body.model != served_model_name:
            raise APIError(
                404,
                f"model '{body.model}' does not exist; this server serves '{served_model_name}'",
                "model",
                "model_not_found",
                "not_found_error",
            )
        refuse_unsupported(body)
        ignored.note(body)
        params = _params(body, max_tokens, chat)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = []
        for p, prompt in enumerate(prompts):
            try:
                ids = backend.prompt_token_ids(prompt)
            except ValueError as e:
                raise APIError(400, f"prompt: {e}", "prompt") from None
            echo = ""
            if not chat and body.echo:
                echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
            for i in range(body.n):  # sample i of a seeded request is seeded with seed + i
                sample = params if params.seed is None else replace(params, seed=params.seed + i)
                index = p * body.n + i
                choices.append(Choice(index, i, f"{response_id}-{index}", ids, echo, sample))
        try:
            queue = await backend.submit(
                [(c.prompt_ids, c.params, c.request_id) for c in choices], http.headers.get(REPLICA_HEADER)
            )
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
        by_id = {c.request_id: c for c in choices}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(
                _stream(queue, response_id, by_id, chat, include_usage, http), media_type="text/event-stream"
            )
        try:
            unfinished = len(choices)
            while unfinished:
                out = _output(await queue.get())
                choice = by_id[out.request_id]
                choice.logprobs.extend(out.new_logprobs or [])
                if out.finished:
                    choice.final = out
                    unfinished -= 1
        except BaseException:
            for c in choices:
                backend.abort(c.request_id)
            raise
        usage = _usage(choices)
        http.state.usage = usage
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [_full_choice(c, body, chat) for c in choices],
            "usage": usage,
        }

    def _full_choice(c: Choice, body, chat: bool) -> dict:
        out = c.final
        reason = out.finish_reason.value if out.finish_reason else "stop"
        choice: dict[str, Any] = {"index": c.index, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
            if body.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(out.output_token_ids, c.logprobs)}
            return choice
        choice["text"] = c.echo_text + out.text
        if body.logprobs is not None:
            tokens, entries = out.output_token_ids, list(c.logprobs)
            if body.echo:
                tokens = c.prompt_ids + tokens
                entries = list(out.prompt_logprobs or [None] * len(c.prompt_ids)) + entries
            choice["logprobs"] = _completion_logprobs(tokens, entries, 0 if body.echo else len(c.echo_text))
        return choice

    def _completion_logprobs(tokens: list[int], entries: list[TokenLogprob | None], offset: int) -> dict:
        texts = [token_text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        top = []
        for t, e in zip(tokens, entries):
            if e is None:
                top.append(None)
                continue
            alternatives: dict[str, float] = {}
            for i, lp in [*e.top, (t, e.logprob)]:  # the chosen token is always listed
                alternatives.setdefault(token_text(i), lp)  # tokens that decode alike keep the likeliest
            top.append(alternatives)
        return {
            "tokens": texts,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_logprobs(tokens: list[int], entries: list[TokenLogprob]) -> list[dict]:
        def one(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [
            {**one(t, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
            for t, e in zip(tokens, entries)
        ]

    async def _stream(
        queue, response_id: str, by_id: dict[str, Choice], chat: bool, include_usage: bool, http: Request
    ) -> AsyncIterator[str]:
        created = int(time.time())
        choices = list(by_id.values())
        sent = dict.fromkeys(by_id, 0)  # characters of each choice's text sent
        pending: dict[str, list[tuple[int, TokenLogprob]]] = {rid: [] for rid in by_id}  # logprobs unsent
        unfinished = len(choices)
        wants_logprobs = any(c.params.logprobs is not None for c in choices)
        try:
            for c in choices:
                if chat:
                    yield _sse(
                        _chunk(response_id, created, chat, c.index, {"role": "assistant", "content": ""})
                    )
                elif c.echo_text:
                    yield _sse(_chunk(response_id, created, chat, c.index, c.echo_text))
            while unfinished:
                try:
                    out = _output(await queue.get())
                except RequestFailed as e:  # the stream has started: an error event ends it
                    yield _sse(
                        {"error": {"message": str(e), "type": "server_error", "code": "engine_failed"}}
                    )
                    yield "data: [DONE]\n\n"
                    return
                c = by_id[out.request_id]
                pending[c.request_id].extend(zip(out.new_token_ids, out.new_logprobs or []))
                hold = max((len(s) for s in c.params.stop), default=1) - 1  # a stop string may still complete
                text = out.text
                upto = len(text) if out.finished else max(sent[c.request_id], len(text) - hold)
                if upto > sent[c.request_id] or (out.finished and pending[c.request_id]):
                    logprobs = None
                    if wants_logprobs:
                        logprobs = _stream_logprobs(pending[c.request_id], chat, sent[c.request_id])
                    pending[c.request_id] = []
                    piece = text[sent[c.request_id] : upto]
                    yield _sse(_chunk(response_id, created, chat, c.index, piece, logprobs=logprobs))
                    sent[c.request_id] = upto
                if out.finished:
                    c.final = out
                    unfinished -= 1
                    reason = out.finish_reason.value if out.finish_reason else "stop"
                    yield _sse(_chunk(response_id, created, chat, c.index, "", reason))
            usage = _usage(choices)
            http.state.usage = usage
            if include_usage:
                yield _sse(_usage_chunk(response_id, created, chat, usage))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:  # the client went away (or the server is stopping): free its KV now
                if c.final is None:
                    backend.abort(c.request_id)

    def _stream_logprobs(entries: list[tuple[int, TokenLogprob]], chat: bool, offset: int) -> dict:
        tokens = [t for t, _ in entries]
        lps = [e for _, e in entries]
        if chat:
            return {"content": _chat_logprobs(tokens, lps)}
        return _completion_logprobs(tokens, lps, offset)

    def _chunk(
        response_id: str,
        created: int,
        chat: bool,
        index: int,
        delta: str | dict,
        reason: str | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        if chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        return {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": served_model_name,
            "choices": [choice],
        }

    def _usage_chunk(response_id: str, created: int, chat: bool, usage: dict) -> dict:
        return {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": served_model_name,
            "choices": [],
            "usage": usage,
        }

    return app


def _usage(choices: list[Choice]) -> dict:
    """Each prompt's tokens counted once (not once per sample); every sample's output tokens."""
    prompt_tokens = sum(len(c.prompt_ids) for c in choices if c.sample == 0)
    completion = sum(len(c.final.output_token_ids) for c in choices if c.final is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _output(item: RequestOutput | RequestFailed) -> RequestOutput:
    """A queue item: an output, or the failure of the engine that served the request (raised)."""
    if isinstance(item, RequestFailed):
        raise item
    return item


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
