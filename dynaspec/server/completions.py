"""One (chat) completion request: its sampling parameters, its engine requests (one per prompt and
sample), and their outputs gathered into one response or streamed as SSE chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from dynaspec.engine.request import RequestOutput
from dynaspec.engine.types import TokenLogprob
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.backend import Prompt, RequestFailed
from dynaspec.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    logit_bias_ids,
    refuse_unsupported,
)
from dynaspec.server.responses import chunk, full_choice, sse, stream_logprobs, usage_chunk, usage_of
from dynaspec.server.state import AppState, Choice


async def serve(
    state: AppState,
    body: CompletionRequest | ChatRequest,
    prompts: list[Prompt],
    max_tokens: int | None,
    http: Request,
    replica: str | None,
    chat: bool,
):
    """The response to ``body``: a JSON body, or an SSE stream with ``body.stream``."""
    if body.model != state.served_model_name:
        raise APIError(
            404,
            f"model '{body.model}' does not exist; this server serves '{state.served_model_name}'",
            "model",
            "model_not_found",
            "not_found_error",
        )
    refuse_unsupported(body)
    state.ignored.note(body)
    params = _params(state, body, max_tokens, chat)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = []
    for p, prompt in enumerate(prompts):
        try:
            ids = state.backend.prompt_token_ids(prompt)
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", "prompt") from None
        for i in range(body.n):  # sample i of a seeded request is seeded with seed + i
            sample = params if params.seed is None else replace(params, seed=params.seed + i)
            index = p * body.n + i
            choices.append(Choice(index, i, f"{response_id}-{index}", ids, "", sample))
    try:
        queue = await state.backend.submit([(c.prompt_ids, c.params, c.request_id) for c in choices], replica)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(":", 1)[0]) from None
    if not chat and body.echo:  # only now: the engine has checked that token-id prompts decode
        texts = [
            prompt
            if isinstance(prompt, str)
            else state.backend.tokenizer.decode(choices[i * body.n].prompt_ids)
            for i, prompt in enumerate(prompts)
        ]
        for c in choices:
            c.echo_text = texts[c.index // body.n]
    by_id = {c.request_id: c for c in choices}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return StreamingResponse(
            _stream(state, queue, response_id, by_id, chat, include_usage, http),
            media_type="text/event-stream",
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
            state.backend.abort(c.request_id)
        raise
    usage = usage_of(choices)
    http.state.usage = usage
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": [full_choice(state, c, body, chat) for c in choices],
        "usage": usage,
    }


def _params(
    state: AppState, body: CompletionRequest | ChatRequest, max_tokens: int | None, chat: bool
) -> SamplingParams:
    """The sampling parameters of sample 0 (the others differ in their seed only)."""
    max_len = state.backend.max_model_len
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


async def _stream(
    state: AppState,
    queue,
    response_id: str,
    by_id: dict[str, Choice],
    chat: bool,
    include_usage: bool,
    http: Request,
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
                yield sse(
                    chunk(state, response_id, created, chat, c.index, {"role": "assistant", "content": ""})
                )
            elif c.echo_text:
                yield sse(chunk(state, response_id, created, chat, c.index, c.echo_text))
        while unfinished:
            try:
                out = _output(await queue.get())
            except RequestFailed as e:  # the stream has started: an error event ends it
                yield sse({"error": {"message": str(e), "type": "server_error", "code": "engine_failed"}})
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
                    logprobs = stream_logprobs(state, pending[c.request_id], chat, sent[c.request_id])
                pending[c.request_id] = []
                piece = text[sent[c.request_id] : upto]
                yield sse(chunk(state, response_id, created, chat, c.index, piece, logprobs=logprobs))
                sent[c.request_id] = upto
            if out.finished:
                c.final = out
                unfinished -= 1
                reason = out.finish_reason.value if out.finish_reason else "stop"
                yield sse(chunk(state, response_id, created, chat, c.index, "", reason))
        usage = usage_of(choices)
        http.state.usage = usage
        if include_usage:
            yield sse(usage_chunk(state, response_id, created, chat, usage))
        yield "data: [DONE]\n\n"
    finally:
        for c in choices:  # the client went away (or the server is stopping): free its KV now
            if c.final is None:
                state.backend.abort(c.request_id)


def _output(item: RequestOutput | RequestFailed) -> RequestOutput:
    """A queue item: an output, or the failure of the engine that served the request (raised)."""
    if isinstance(item, RequestFailed):
        raise item
    return item
