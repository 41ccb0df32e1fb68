"""What the HTTP app runs over: one engine in this process, or engine replicas elsewhere.

The app (``build_app``: routes in app.py, the completion path in completions.py, the response
shapes in responses.py) holds every endpoint, the validation, streaming and error shapes once, over
this interface. ``EngineLoop`` (engine_loop.py) implements it for the in-process engine;
``dynaspec.replicas.client.ReplicaClient`` for engine replicas on Ray Serve.

A submission's queue carries ``RequestOutput``s, or a ``RequestFailed`` when the engine serving a
request went away mid-request (a replica that died): the app answers 503, or ends a stream that
had started with an SSE error event.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from dynaspec.models.tokenizer import Tokenizer
from dynaspec.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]


class Unavailable(Exception):
    """The server takes no new requests now (full, or shutting down): a 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailed(Exception):
    """A request lost with the engine that served it: a 503 (or an SSE error event mid-stream)."""


class Backend(Protocol):
    tokenizer: Tokenizer
    max_model_len: int

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of text, token ids or chat messages; bad input raises ValueError."""
        ...

    async def submit(
        self, requests: list[tuple[Prompt, SamplingParams, str]], replica: str | None = None
    ) -> asyncio.Queue:
        """Queue (prompt, params, request id) triples; returns the one queue their outputs arrive on.
        Bad input raises ValueError, a full or draining server ``Unavailable``. ``replica`` pins the
        requests to one engine replica where there are several (ignored otherwise)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def render_metrics(self) -> bytes:
        """The Prometheus text of /metrics."""
        ...

    @property
    def draining(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    def drain(self) -> None: ...

    def abort_all(self) -> None: ...
