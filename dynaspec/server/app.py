"""OpenAI-compatible HTTP API over a backend: the in-process engine loop or engine replicas.

Bad input never reaches the engine thread as an exception: bodies are validated here (pydantic;
see ``protocol.py`` for which fields are refused or ignored) and the engine's own ValueErrors come
back as 400s, in OpenAI's error shape. One HTTP request becomes one engine request per prompt and
sample (``n``); a streaming client that goes away has its requests aborted, freeing their KV blocks.
A request whose engine went away (a replica that died) gets a 503, or an SSE error event once its
stream has started. The ``X-Dynaspec-Replica`` header pins a request to one replica (tests, debugging).
Log-probabilities are the target's raw ones (before penalties, temperature, top-k and top-p).

The routes and error handlers below reach the app's ``AppState`` (state.py) through the request;
``completions.py`` serves a (chat) completion, ``responses.py`` shapes what goes back.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dynaspec.server.backend import Backend, RequestFailed, Unavailable
from dynaspec.server.completions import serve
from dynaspec.server.middleware import Guard, GuardConfig
from dynaspec.server.protocol import APIError, ChatRequest, CompletionRequest
from dynaspec.server.responses import error
from dynaspec.server.state import AppState

REPLICA_HEADER = "x-dynaspec-replica"  # pins a request to one engine replica (tests, debugging)


def build_app(backend: Backend, served_model_name: str, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(title="dynaspec", version="0.1.0")
    app.add_middleware(Guard, config=guard or GuardConfig())
    app.state.dynaspec = AppState(backend, served_model_name)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Unavailable, _unavailable)
    app.add_exception_handler(RequestFailed, _request_failed)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(router)
    return app


async def _app_state(request: Request) -> AppState:
    return request.app.state.dynaspec


StateDep = Annotated[AppState, Depends(_app_state)]
router = APIRouter()


@router.get("/health")
async def health(state: StateDep):
    if state.backend.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(state: StateDep):
    return {
        "object": "list",
        "data": [
            {
                "id": state.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "dynaspec",
                "max_model_len": state.backend.max_model_len,
            }
        ],
    }


@router.get("/metrics")
async def metrics(state: StateDep):
    return PlainTextResponse(state.backend.render_metrics(), media_type="text/plain; version=0.0.4")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request, state: StateDep):
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "prompt: must not be empty", "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    return await serve(state, body, prompts, max_tokens, http, http.headers.get(REPLICA_HEADER), chat=False)


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, http: Request, state: StateDep):
    messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await serve(state, body, [messages], limit, http, http.headers.get(REPLICA_HEADER), chat=True)


async def _api_error(_: Request, exc: APIError):
    return error(exc.status, exc.message, exc.param, exc.code, exc.kind)


async def _unavailable(_: Request, exc: Unavailable):
    response = error(503, str(exc), None, "server_unavailable", "server_error")
    response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def _request_failed(_: Request, exc: RequestFailed):
    return error(503, str(exc), None, "engine_failed", "server_error")


async def _validation_error(_: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return error(400, f"request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json")
    return error(400, f"{param}: {first.get('msg', 'invalid value')}", param, "invalid_value")


async def _http_error(_: Request, exc: StarletteHTTPException):
    return error(exc.status_code, str(exc.detail), None, None)


def _text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)
