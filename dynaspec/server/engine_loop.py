"""The engine, stepping in one background thread, fed by asyncio handlers.

Only the loop thread touches the engine. Handlers submit work and aborts through a lock-protected
inbox and receive each step's outputs on their own asyncio queue (``call_soon_threadsafe``).
When nothing is running, the thread sleeps on a condition until work arrives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from dynaspec.engine.engine import Engine
from dynaspec.engine.request import Request, RequestOutput
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Submission:
    prompt: str | list[int] | list[dict]
    params: SamplingParams
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future


@dataclass(slots=True)
class Snapshot:
    """What /metrics reads, refreshed by the loop thread after every step."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    stats: dict = field(default_factory=dict)


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.snapshot = Snapshot()
        self._cond = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dynaspec-engine", daemon=True)
        self._refresh()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    async def submit(self, prompt, params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; returns the queue its RequestOutputs arrive on. Bad input raises ValueError."""
        loop = asyncio.get_running_loop()
        sub = _Submission(prompt, params, request_id, loop, asyncio.Queue(), loop.create_future())
        with self._cond:
            self._inbox.append(sub)
            self._cond.notify()
        await sub.accepted
        return sub.queue

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self._aborts or self.engine.has_unfinished()):
                    self._cond.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for sub in inbox:
                self._admit(sub)
            for request_id in aborts:
                if self.engine.abort(request_id):
                    self.metrics.request_aborted()
                self._streams.pop(request_id, None)
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception:  # keep serving: fail the running requests, not the server
                    log.exception("engine step failed; aborting running requests")
                    outputs = self._fail_running()
                for out in outputs:
                    self._deliver(out)
            self._refresh()

    def _admit(self, sub: _Submission) -> None:
        try:
            request = self.engine.add_request(sub.prompt, sub.params, sub.request_id)
        except ValueError as e:
            sub.loop.call_soon_threadsafe(_set_exception, sub.accepted, e)
            return
        self._streams[sub.request_id] = (sub.loop, sub.queue, request)
        self.metrics.request_started(len(request.prompt_token_ids))
        sub.loop.call_soon_threadsafe(_set_result, sub.accepted, None)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if out.new_token_ids:
            self.metrics.tokens_generated(len(out.new_token_ids))
        if target is None:
            return
        loop, queue, request = target
        if out.finished:
            del self._streams[out.request_id]
            self.metrics.request_finished(request, time.monotonic())
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail_running(self) -> list[RequestOutput]:
        outputs = []
        for r in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(r.request_id)
            outputs.append(
                RequestOutput(
                    r.request_id,
                    [],
                    True,
                    r.finish_reason,
                    list(r.output_token_ids),
                    r.output_text,
                    len(r.prompt_token_ids),
                )
            )
        return outputs

    def _refresh(self) -> None:
        s = self.engine.scheduler
        self.snapshot = Snapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_cache_usage=self.engine.allocator.usage,
            stats=self.engine.stats(),
        )


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
