"""The engine, stepping in one background thread, fed by asyncio handlers.

Only the loop thread touches the engine. Handlers submit work and aborts through a lock-protected
inbox and receive each step's outputs on their own asyncio queue (``call_soon_threadsafe``).
When nothing is running, the thread sleeps on a condition until work arrives.

The loop also guards admission (a bound on waiting requests; nothing new while draining for
shutdown) and, while busy, logs a stats line every ``stats_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from dynaspec.engine.engine import Engine
from dynaspec.engine.request import Request, RequestOutput
from dynaspec.models.tokenizer import Tokenizer
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.backend import Prompt, Unavailable
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
class _StatsWindow:
    """Counters at the last stats line, to print rates since then."""

    time: float
    prompt_tokens: int
    generated_tokens: int
    draft_tokens: int
    accepted_tokens: int


@dataclass(slots=True)
class Snapshot:
    """What /metrics reads, refreshed by the loop thread after every step."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    stats: dict = field(default_factory=dict)


class EngineLoop:
    """The in-process ``Backend`` (server/backend.py)."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics | None = None,
        max_waiting: int | None = None,  # None: no bound on requests waiting for a slot
        stats_interval: float = 10.0,  # seconds between stats lines while busy; 0: none
    ) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.max_waiting = max_waiting
        self.stats_interval = stats_interval
        self.snapshot = Snapshot()
        self._cond = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._abort_all = False
        self._draining = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dynaspec-engine", daemon=True)
        self._window = self._stats_window()
        self._refresh()
        self.metrics.attach(lambda: self.snapshot)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        return self.engine.prompt_token_ids(prompt)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def submit(
        self, requests: list[tuple[Prompt, SamplingParams, str]], replica: str | None = None
    ) -> asyncio.Queue:
        """Queue (prompt, params, request id) triples as one unit; returns the one queue their
        RequestOutputs arrive on. Bad input raises ValueError (and none of them runs); a full or
        draining server raises Unavailable. ``replica`` is ignored (one engine)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        subs = [_Submission(p, sp, rid, loop, queue, loop.create_future()) for p, sp, rid in requests]
        with self._cond:
            if self._draining:
                raise Unavailable("the server is shutting down", retry_after_s=5)
            waiting = self.snapshot.waiting + len(self._inbox)
            if self.max_waiting is not None and len(subs) > self.max_waiting:  # waiting cannot help
                raise ValueError(
                    f"n: {len(subs)} sequences (n x prompts) in one request exceed the server's bound of "
                    f"{self.max_waiting} waiting requests (--max-waiting)"
                )
            if self.max_waiting is not None and waiting + len(subs) > self.max_waiting:
                raise Unavailable(f"the server is full: {waiting} requests waiting (--max-waiting)")
            self._inbox.extend(subs)
            self._cond.notify()
        try:  # gather retrieves every sub-request's failure, not only the first
            await asyncio.gather(*(sub.accepted for sub in subs))
        except BaseException:
            for sub in subs:
                self.abort(sub.request_id)
            raise
        return queue

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def drain(self) -> None:
        """Take no new requests (Unavailable) from now on; running ones go on."""
        with self._cond:
            self._draining = True

    @property
    def alive(self) -> bool:
        """The loop thread runs (started and not stopped)."""
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def busy(self) -> bool:
        """Requests queued, running or still being delivered."""
        with self._cond:
            return bool(self._inbox or self._streams or self.engine.has_unfinished())

    def abort_all(self) -> None:
        """Abort every request; each one's stream gets a final output with finish reason abort."""
        with self._cond:
            self._abort_all = True
            self._cond.notify()

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stop
                    or self._inbox
                    or self._aborts
                    or self._abort_all
                    or self.engine.has_unfinished()
                ):
                    self._cond.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                abort_all, self._abort_all = self._abort_all, False
            for unit in _units(inbox):
                self._admit(unit)
            for request_id in aborts:
                if self.engine.abort(request_id):
                    self.metrics.request_aborted()
                self._streams.pop(request_id, None)
            if abort_all:
                for out in self._fail_running():
                    self._deliver(out)
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception:  # keep serving: fail the running requests, not the server
                    log.exception("engine step failed; aborting running requests")
                    outputs = self._fail_running()
                for out in outputs:
                    self._deliver(out)
            self._refresh()
            self._log_stats()

    def _admit(self, unit: list[_Submission]) -> None:
        """Add one request's sub-requests (its prompts and n samples) all, or none: the first bad
        one fails them all and takes back those already added."""
        added = []
        try:
            for sub in unit:
                added.append((sub, self.engine.add_request(sub.prompt, sub.params, sub.request_id)))
        except ValueError as e:
            for sub, _ in added:
                self.engine.abort(sub.request_id)
            for sub in unit:
                sub.loop.call_soon_threadsafe(_set_exception, sub.accepted, e)
            return
        for sub, request in added:
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
        """Abort every request; their final outputs (finish reason abort)."""
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

    def _stats_window(self) -> _StatsWindow:
        c = self.engine.counters
        return _StatsWindow(
            time.monotonic(),
            c.num_prompt_tokens,
            c.num_generated_tokens,
            c.spec.num_draft_tokens,
            c.spec.num_accepted_tokens,
        )

    def _log_stats(self) -> None:
        """One line every stats_interval seconds while there is work, as the reference engine prints."""
        now = time.monotonic()
        if not self.stats_interval or now - self._window.time < self.stats_interval:
            return
        before, after = self._window, self._stats_window()
        self._window = after
        snap = self.snapshot
        generated = after.generated_tokens - before.generated_tokens
        if not (generated or snap.running or snap.waiting):
            return
        elapsed = after.time - before.time
        line = (
            f"prompt {(after.prompt_tokens - before.prompt_tokens) / elapsed:.1f} tok/s, "
            f"generation {generated / elapsed:.1f} tok/s, running {snap.running}, "
            f"waiting {snap.waiting}, KV cache {100 * snap.kv_cache_usage:.1f}%"
        )
        if self.engine.k_policy is not None:
            drafted = after.draft_tokens - before.draft_tokens
            accepted = after.accepted_tokens - before.accepted_tokens
            rate = f"{accepted / drafted:.2f}" if drafted else "n/a"
            line += f", K chosen {self.engine.counters.chosen_k}, acceptance {rate}"
        log.info("%s", line)

    def _refresh(self) -> None:
        s = self.engine.scheduler
        self.snapshot = Snapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_cache_usage=self.engine.allocator.usage,
            stats=self.engine.stats(),
        )


def _units(inbox: list[_Submission]) -> list[list[_Submission]]:
    """The inbox's sub-requests grouped by the request they came in (they share its queue), in order."""
    units: dict[int, list[_Submission]] = {}
    for sub in inbox:
        units.setdefault(id(sub.queue), []).append(sub)
    return list(units.values())


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
