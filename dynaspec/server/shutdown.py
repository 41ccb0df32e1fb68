"""Running the app under uvicorn with a graceful shutdown.

On the first SIGTERM or SIGINT the engine loop stops taking requests (503, /health says draining),
requests already running finish for up to ``shutdown_timeout`` seconds, then whatever remains is
aborted (its clients get finish reason "abort"), and the process exits 0 once the responses are
out. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from dynaspec.server.backend import Backend

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # how long aborted requests' final chunks get to reach their clients


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop: Backend, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn would re-raise the signal after its shutdown (exit status 128 + sig): not recorded here
        if self._drain_task is not None or self._loop is None:
            log.warning("second %s: aborting every request now", signal.Signals(sig).name)
            self.engine_loop.abort_all()
            self.should_exit = True
            return
        log.info(
            "%s: draining (no new requests; running ones get up to %.0f s)",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )
        self.engine_loop.drain()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine_loop.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine_loop.busy:
            log.warning("shutdown timeout: aborting the requests still running")
            self.engine_loop.abort_all()
            flush_until = time.monotonic() + FLUSH_S
            while self.engine_loop.busy and time.monotonic() < flush_until:
                await asyncio.sleep(0.05)
        self.should_exit = True
