"""The traffic of `dynaspec bench soak` (soak.py): a fixed-seed mix of what clients send a server, each
request checked as it comes back.

Kinds, drawn by weight (``MIX``): greedy requests recorded alone before the load (plain, stop strings,
penalties, logprobs; completions and chats, streaming or not, ``n`` = 2, prompt lists), whose answers
must equal the recorded ones; sampled requests with ``n`` > 1; echo scoring; sampled streams with
logprobs; streams the client drops; and bad requests from the schema fuzzer's families, which must
get their 4xx with an error body.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

SERVE_MAX_BODY_BYTES = 8 * 2**20  # `dynaspec serve`'s default --max-body-bytes
TOKEN_ID_OUT_OF_RANGE = 10**9  # above any vocabulary
FALLBACK_CONTEXT = 2**17  # tokens, for a server whose /v1/models does not say its max_model_len

# the traffic mix: kind -> weight (a request's kind is drawn from these, per client, fixed seed)
MIX = {
    "greedy": 24,  # a recorded greedy request, streaming or not: the answer must equal the reference
    "greedy_n": 5,  # the same with n = 2: both samples equal the reference
    "prompt_list": 8,  # 2-3 recorded prompts in one request: each choice equals its reference
    "sampled": 12,  # temperature, top-p, a seed, n = 2-4, completion or chat, streaming or not
    "scoring": 9,  # echo + logprobs + max_tokens 0: the prompt's tokens scored, nothing generated
    "stream_logprobs": 7,  # sampled stream with logprobs: every token has its entry
    "disconnect": 12,  # a stream the client drops after two chunks
    "bad": 23,  # a request the server must refuse with a 4xx
}
# greedy variants: fields added to a greedy request (each prompt is recorded under each)
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "stop": {"stop": ["\n\n", "return"]},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "logprobs": {"logprobs": 2},
}
CHAT_VARIANTS = ("plain", "penalties")
# out-of-range fields the server refuses with a 400 naming them
OUT_OF_RANGE = (
    {"temperature": -1},
    {"top_p": 7},
    {"n": 0},
    {"n": 129},
    {"logprobs": 50},
    {"max_tokens": -3},
    {"presence_penalty": 3},
    {"frequency_penalty": -7},
    {"logit_bias": {"x": 1}},
    {"max_tokens": "many"},
)
BAD_FAMILIES = (
    "malformed_json",
    "oversized_body",
    "oversized_prompt",
    "out_of_range",
    "token_ids",
    "too_many_sequences",
    "unknown_model",
    "refused_field",
)
# the kinds whose answers count in the latency percentiles (not bad requests, not dropped streams)
LATENCY_KINDS = ("greedy", "greedy_n", "prompt_list", "sampled", "scoring", "stream_logprobs")


class StreamError(Exception):
    """An SSE error event: the server failed a request after its stream had started."""


@dataclass(slots=True)
class Outcome:
    kind: str  # a MIX key; "bad:<family>"; "stream_error" (an SSE error event); "transport" (no answer)
    status: int | None  # None: no HTTP answer (a transport error or a timeout)
    latency_s: float
    done_s: float  # when it ended, seconds from the load's start
    ok: bool  # answered as its kind must be
    detail: str = ""  # what was wrong, when not ok
    greedy_compared: int = 0  # greedy texts compared with their reference
    greedy_mismatched: int = 0


@dataclass(frozen=True, slots=True)
class Greedy:
    """A greedy request whose answer is recorded alone on the idle server before the load."""

    chat: bool
    prompt: str
    variant: str


@dataclass(slots=True)
class Traffic:
    """The prompts and references every client draws from."""

    model: str
    prompts: list[str]
    greedy: list[Greedy]
    references: dict[Greedy, str] = field(default_factory=dict)
    max_tokens: int = 32
    max_body_bytes: int = SERVE_MAX_BODY_BYTES
    max_model_len: int = FALLBACK_CONTEXT


def _greedy_payload(traffic: Traffic, g: Greedy, n: int = 1, stream: bool = False) -> tuple[str, dict]:
    fields = dict(VARIANTS[g.variant])
    body: dict[str, Any] = {"model": traffic.model, "max_tokens": traffic.max_tokens, "temperature": 0}
    if g.chat:
        if "logprobs" in fields:
            fields = {"logprobs": True, "top_logprobs": fields["logprobs"]}
        body["messages"] = [{"role": "user", "content": g.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = g.prompt
        path = "/v1/completions"
    body.update(fields, n=n, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return path, body


async def _post(client, path: str, body: dict | bytes, stream: bool) -> tuple[int, Any]:
    """(status, the JSON body) or, streaming, (status, {choice index: [chunk choices]} plus usage);
    an SSE error event raises StreamError."""
    kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"content": body}
    if isinstance(body, bytes):
        kwargs["headers"] = {"content-type": "application/json"}
    if not stream:
        r = await client.post(path, **kwargs)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text[:200]}}
    by_index: dict[int, list[dict]] = {}
    usage = None
    async with client.stream("POST", path, **kwargs) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return r.status_code, {"error": {"message": text[:200]}}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(f"{path}: {chunk['error'].get('message', chunk['error'])}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                by_index.setdefault(c["index"], []).append(c)
    return r.status_code, {"choices": by_index, "usage": usage}


def _texts(data: dict, chat: bool, stream: bool) -> dict[int, str]:
    """Each choice's text by index, from a full response or a stream's chunks."""
    if not stream:
        return {c["index"]: (c["message"]["content"] if chat else c["text"]) for c in data["choices"]}
    out = {}
    for index, chunks in data["choices"].items():
        pieces = [(c["delta"].get("content") or "") if chat else c["text"] for c in chunks]
        out[index] = "".join(pieces)
    return out


def _finished(data: dict, stream: bool) -> dict[int, str | None]:
    if not stream:
        return {c["index"]: c["finish_reason"] for c in data["choices"]}
    return {
        i: next((c["finish_reason"] for c in cs if c["finish_reason"]), None)
        for i, cs in data["choices"].items()
    }


def _compare(expected: dict[int, str], got: dict[int, str]) -> tuple[int, int, str]:
    """(compared, mismatched, detail) of greedy texts against their references."""
    mismatched = [i for i in expected if got.get(i) != expected[i]]
    detail = ""
    if mismatched:
        i = mismatched[0]
        detail = f"greedy choice {i}: {got.get(i)!r} != reference {expected[i]!r}"
    return len(expected), len(mismatched), detail


async def _greedy(client, traffic: Traffic, rng: random.Random, kind: str) -> Outcome:
    stream = rng.random() < 0.5
    if kind == "prompt_list":
        variant = rng.choice(list(VARIANTS))
        entries = [g for g in traffic.greedy if not g.chat and g.variant == variant]
        chosen = rng.sample(entries, min(len(entries), rng.randint(2, 3)))
        path, body = _greedy_payload(traffic, chosen[0], stream=stream)
        body["prompt"] = [g.prompt for g in chosen]
        expected = {i: traffic.references[g] for i, g in enumerate(chosen)}
        chat = False
    else:
        g = rng.choice(traffic.greedy)
        n = 2 if kind == "greedy_n" else 1
        path, body = _greedy_payload(traffic, g, n=n, stream=stream)
        expected = dict.fromkeys(range(n), traffic.references[g])
        chat = g.chat
    status, data = await _post(client, path, body, stream)
    if status != 200:
        return outcome(kind, status, False, _error_text(data))
    compared, mismatched, detail = _compare(expected, _texts(data, chat, stream))
    out = outcome(kind, status, not mismatched, detail)
    out.greedy_compared, out.greedy_mismatched = compared, mismatched
    if not mismatched and not stream and not chat and "logprobs" in body:  # an entry per output token
        entries = sum(len(c["logprobs"]["token_logprobs"]) for c in data["choices"])
        if entries != data["usage"]["completion_tokens"]:
            out.ok, out.detail = False, "logprobs: not one entry per output token"
    return out


async def _sampled(client, traffic: Traffic, rng: random.Random) -> Outcome:
    chat, stream, n = rng.random() < 0.5, rng.random() < 0.5, rng.randint(2, 4)
    prompt = rng.choice(traffic.prompts)
    body: dict[str, Any] = {
        "model": traffic.model,
        "max_tokens": traffic.max_tokens,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": rng.randrange(2**31),
        "n": n,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    status, data = await _post(client, "/v1/chat/completions" if chat else "/v1/completions", body, stream)
    if status != 200:
        return outcome("sampled", status, False, _error_text(data))
    reasons = _finished(data, stream)
    ok = sorted(reasons) == list(range(n)) and all(r in ("stop", "length") for r in reasons.values())
    return outcome("sampled", status, ok, "" if ok else f"choices and finish reasons: {reasons}")


async def _scoring(client, traffic: Traffic, rng: random.Random) -> Outcome:
    prompt = rng.choice(traffic.prompts)
    body = {"model": traffic.model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    status, data = await _post(client, "/v1/completions", body, False)
    if status != 200:
        return outcome("scoring", status, False, _error_text(data))
    choice = data["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    ok = (
        choice["text"] == prompt
        and len(lps) == data["usage"]["prompt_tokens"]
        and lps[0] is None
        and all(lp <= 0 for lp in lps[1:])
    )
    return outcome("scoring", status, ok, "" if ok else "echo scoring: text or prompt logprobs wrong")


async def _stream_logprobs(client, traffic: Traffic, rng: random.Random) -> Outcome:
    body = {
        "model": traffic.model,
        "prompt": rng.choice(traffic.prompts),
        "max_tokens": traffic.max_tokens,
        "temperature": 0.7,
        "seed": rng.randrange(2**31),
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, data = await _post(client, "/v1/completions", body, True)
    if status != 200:
        return outcome("stream_logprobs", status, False, _error_text(data))
    entries = sum(len(c["logprobs"]["tokens"]) for c in data["choices"].get(0, []) if c["logprobs"])
    ok = data["usage"] is not None and entries == data["usage"]["completion_tokens"]
    return outcome("stream_logprobs", status, ok, "" if ok else "stream logprobs: not one entry per token")


async def _disconnect(client, traffic: Traffic, rng: random.Random) -> Outcome:
    chat = rng.random() < 0.5
    prompt = rng.choice(traffic.prompts)
    body: dict[str, Any] = {
        "model": traffic.model,
        "max_tokens": 4 * traffic.max_tokens,
        "ignore_eos": True,
        "temperature": 0.7,
        "n": rng.choice((1, 2)),
        "stream": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return outcome("disconnect", r.status_code, False, (await r.aread()).decode()[:200])
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if chunks == 2:
                    break  # leaving the block closes the connection mid-stream
    return outcome("disconnect", 200, True)


async def _bad(client, traffic: Traffic, rng: random.Random) -> Outcome:
    """A fuzz family's request; it must get its 4xx, with an error body."""
    family = rng.choice(BAD_FAMILIES)
    good = {"model": traffic.model, "prompt": rng.choice(traffic.prompts), "max_tokens": 4}
    path, expected = "/v1/completions", 400
    body: dict | bytes = good
    if family == "malformed_json":
        body = json.dumps(good).encode()[: rng.randint(1, 30)]
    elif family == "oversized_body":
        body = json.dumps({**good, "prompt": "x" * (traffic.max_body_bytes + 1024)}).encode()
        expected = 413
    elif family == "oversized_prompt":
        body = {**good, "prompt": "word " * (traffic.max_model_len + 16)}  # more tokens than the context
    elif family == "out_of_range":
        body = {**good, **rng.choice(OUT_OF_RANGE)}
    elif family == "token_ids":  # every sub-request of a list with n > 1 fails validation
        body = {**good, "prompt": [[TOKEN_ID_OUT_OF_RANGE, 5], [7, -TOKEN_ID_OUT_OF_RANGE]], "n": 3}
        body["echo"] = rng.random() < 0.5  # echo decodes the prompt: only once its ids are checked
    elif family == "too_many_sequences":  # more sequences than may ever wait: a 400, not a 503
        body = {**good, "prompt": [good["prompt"]] * 9, "n": 128}
    elif family == "unknown_model":
        body, expected = {**good, "model": "no-such-model"}, 404
    elif family == "refused_field":
        body = {"model": traffic.model, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}
        path = "/v1/chat/completions"
    try:
        status, data = await _post(client, path, body, False)
    except Exception as e:  # the server may close an oversized upload before it is all sent
        if family != "oversized_body":
            raise
        return outcome(f"bad:{family}", None, True, f"{type(e).__name__} (connection closed early)")
    ok = status == expected and bool(data.get("error", {}).get("message"))
    return outcome(f"bad:{family}", status, ok, "" if ok else f"expected {expected}: {status} {data}"[:300])


def outcome(kind: str, status: int | None, ok: bool, detail: str = "") -> Outcome:
    return Outcome(kind, status, 0.0, 0.0, ok, detail)


def _error_text(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", ""))[:200]
    return str(data)[:200]


async def one_request(client, traffic: Traffic, rng: random.Random) -> Outcome:
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    if kind in ("greedy", "greedy_n", "prompt_list"):
        return await _greedy(client, traffic, rng, kind)
    if kind == "sampled":
        return await _sampled(client, traffic, rng)
    if kind == "scoring":
        return await _scoring(client, traffic, rng)
    if kind == "stream_logprobs":
        return await _stream_logprobs(client, traffic, rng)
    if kind == "disconnect":
        return await _disconnect(client, traffic, rng)
    return await _bad(client, traffic, rng)


async def record_references(client, traffic: Traffic) -> None:
    """Each greedy request alone, one at a time, on the idle server."""
    for g in traffic.greedy:
        path, body = _greedy_payload(traffic, g)
        status, data = await _post(client, path, body, False)
        if status != 200:
            raise RuntimeError(f"the reference for {g} failed: {status} {_error_text(data)}")
        traffic.references[g] = _texts(data, g.chat, False)[0]
