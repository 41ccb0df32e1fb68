"""A real dynaspec server on loopback for tests: uvicorn in a background thread, free port."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from dynaspec.bench.common import free_port
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.server.app import build_app
from dynaspec.server.engine_loop import EngineLoop
from dynaspec.server.middleware import GuardConfig


@contextmanager
def running_server(
    model_dir,
    name: str = "tiny",
    guard: GuardConfig | None = None,
    max_waiting: int | None = None,
    **engine_kwargs,
):
    engine_kwargs.setdefault("dtype", "float32")
    engine_kwargs.setdefault("kv_cache_memory_gb", 0.02)
    engine = Engine(EngineConfig(model=str(model_dir), progress=False, **engine_kwargs))
    loop = EngineLoop(engine, max_waiting=max_waiting)
    loop.start()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(loop, name, guard), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base, loop
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        loop.stop()
