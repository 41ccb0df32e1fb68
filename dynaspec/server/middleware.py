"""What every HTTP request passes through: the API key, the body size limit, the access log, and a
logged OpenAI-style 500 for any error a handler did not expect (pure ASGI, so streams pass as is)."""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
access_log = logging.getLogger("dynaspec.access")


@dataclass(slots=True)
class GuardConfig:
    api_key: str | None = None  # None: no key needed; else a Bearer token on /v1/*
    protect_metrics: bool = False  # /metrics needs the key too
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413
    access_log: bool = True  # one line per request


class Guard:
    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_status)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not status:
                await _send_error(send_status, 500, "internal server error", "server_error", "internal_error")
        finally:
            if self.config.access_log:
                tokens_in, tokens_out = _usage(scope)
                client = scope.get("client") or ("-", 0)
                access_log.info(
                    '%s "%s %s" %d tokens in %s out %s %.1f ms',
                    client[0],
                    scope["method"],
                    scope["path"],
                    status,
                    tokens_in,
                    tokens_out,
                    (time.perf_counter() - start) * 1000,
                )

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if self._key is not None and (
            path.startswith("/v1/") or (path == "/metrics" and self.config.protect_metrics)
        ):
            presented = _bearer(scope)
            if presented is None or not hmac.compare_digest(presented, self._key):
                await _send_error(
                    send,
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    "invalid_api_key",
                    {"www-authenticate": "Bearer"},
                )
                return
        limit = self.config.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, 413, f"request body exceeds {limit} bytes", "invalid_request_error", None)
            return
        received = 0

        async def limited_receive() -> Message:  # bodies without a length (chunked) are counted
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"request body exceeds {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _bearer(scope: Scope) -> bytes | None:
    value = _header(scope, b"authorization")
    if value is None or value[:7].lower() != b"bearer ":
        return None
    return value[7:].strip()


def _usage(scope: Scope) -> tuple[str, str]:
    usage = (scope.get("state") or {}).get("usage")
    if not usage:
        return "-", "-"
    return str(usage["prompt_tokens"]), str(usage["completion_tokens"])


async def _send_error(
    send: Send, status: int, message: str, kind: str, code: str | None, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
