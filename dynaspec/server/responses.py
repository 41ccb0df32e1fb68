"""OpenAI's response shapes: a full choice, a stream chunk, log-probabilities, usage and errors."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from dynaspec.engine.types import TokenLogprob
from dynaspec.server.protocol import ChatRequest, CompletionRequest
from dynaspec.server.state import AppState, Choice


def full_choice(state: AppState, c: Choice, body: CompletionRequest | ChatRequest, chat: bool) -> dict:
    out = c.final
    reason = out.finish_reason.value if out.finish_reason else "stop"
    choice: dict[str, Any] = {"index": c.index, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        if body.logprobs:
            choice["logprobs"] = {"content": chat_logprobs(state, out.output_token_ids, c.logprobs)}
        return choice
    choice["text"] = c.echo_text + out.text
    if body.logprobs is not None:
        tokens, entries = out.output_token_ids, list(c.logprobs)
        if body.echo:
            tokens = c.prompt_ids + tokens
            entries = list(out.prompt_logprobs or [None] * len(c.prompt_ids)) + entries
        offset = 0 if body.echo else len(c.echo_text)
        choice["logprobs"] = completion_logprobs(state, tokens, entries, offset)
    return choice


def completion_logprobs(
    state: AppState, tokens: list[int], entries: list[TokenLogprob | None], offset: int
) -> dict:
    texts = [state.token_text(t) for t in tokens]
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
            alternatives.setdefault(state.token_text(i), lp)  # tokens that decode alike keep the likeliest
        top.append(alternatives)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(state: AppState, tokens: list[int], entries: list[TokenLogprob]) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text = state.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {**one(t, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
        for t, e in zip(tokens, entries)
    ]


def stream_logprobs(
    state: AppState, entries: list[tuple[int, TokenLogprob]], chat: bool, offset: int
) -> dict:
    tokens = [t for t, _ in entries]
    lps = [e for _, e in entries]
    if chat:
        return {"content": chat_logprobs(state, tokens, lps)}
    return completion_logprobs(state, tokens, lps, offset)


def chunk(
    state: AppState,
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
        "model": state.served_model_name,
        "choices": [choice],
    }


def usage_chunk(state: AppState, response_id: str, created: int, chat: bool, usage: dict) -> dict:
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": state.served_model_name,
        "choices": [],
        "usage": usage,
    }


def usage_of(choices: list[Choice]) -> dict:
    """Each prompt's tokens counted once (not once per sample); every sample's output tokens; of
    the prompt tokens, those the first sample took from the prefix cache (OpenAI's
    ``prompt_tokens_details.cached_tokens``; the other samples share what the first computed)."""
    prompt_tokens = sum(len(c.prompt_ids) for c in choices if c.sample == 0)
    cached = sum(c.final.num_cached_tokens for c in choices if c.sample == 0 and c.final is not None)
    completion = sum(len(c.final.output_token_ids) for c in choices if c.final is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def error(
    status: int, message: str, param: str | None, code: str | None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": code}},
    )
