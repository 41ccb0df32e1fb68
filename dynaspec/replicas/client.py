"""The ingress's ``Backend`` over engine replicas: each engine request is one streaming call.

``submit`` starts one ``generate`` call per engine request through a streaming deployment handle
(Ray Serve routes it with ``LoadAwareRouter``) and waits for the replica's ``Accepted``, so a
request the replica refuses gets its 400/503 before any response starts. A call that fails
before it was accepted (its replica died, or was dying when the router chose it) is sent again,
and the router, told of the death by Serve, picks another replica. Once accepted, each output is
put on the submission's queue; if the replica dies mid-request the queue gets a ``RequestFailed``
(503, or an SSE error event), never a hang. ``abort`` cancels the call, which aborts the request
in its replica's engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from dynaspec.engine.request import FinishReason, RequestOutput
from dynaspec.models.tokenizer import Tokenizer
from dynaspec.replicas.board import ReplicaBoard, ReplicaReport
from dynaspec.replicas.metrics import ReplicaCollector
from dynaspec.replicas.replica import Accepted
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.backend import Prompt, RequestFailed, Unavailable
from dynaspec.server.metrics import Metrics

log = logging.getLogger(__name__)

START_ATTEMPTS = 4  # a request whose replica died before accepting it is sent again up to this often
ACCEPT_TIMEOUT_S = 300.0  # no replica accepted the request in this time (none running): a 503
REPLICA_DIED = (RayActorError, ActorUnavailableError)


@dataclass(slots=True)
class _Call:
    """One engine request in flight on a replica."""

    queue: asyncio.Queue
    arrival: float  # monotonic
    num_prompt_tokens: int
    replica: str = ""
    task: asyncio.Task | None = None
    first_token: float | None = None
    last: RequestOutput | None = None


class ReplicaClient:
    def __init__(
        self,
        handle: DeploymentHandle,
        tokenizer: Tokenizer,
        max_model_len: int,
        board: ReplicaBoard,
        metrics: Metrics | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.board = board
        self.metrics = metrics or Metrics()
        self.metrics.registry.register(ReplicaCollector(board))
        self._generate = handle.options(method_name="generate", stream=True)
        self._calls: dict[str, _Call] = {}
        self._draining = False

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        return list(prompt)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def submit(
        self, requests: list[tuple[Prompt, SamplingParams, str]], replica: str | None = None
    ) -> asyncio.Queue:
        if self._draining:
            raise Unavailable("the server is shutting down", retry_after_s=5)
        queue: asyncio.Queue = asyncio.Queue()
        started: list[str] = []
        try:
            for prompt, params, request_id in requests:
                ids = self.prompt_token_ids(prompt)
                call = _Call(queue, time.monotonic(), len(ids))
                gen, accepted = await self._start(ids, params, request_id, replica)
                call.replica = accepted.replica
                self._calls[request_id] = call
                started.append(request_id)
                self.metrics.request_started(len(ids))
                call.task = asyncio.create_task(self._pump(request_id, gen, call))
        except BaseException:
            for request_id in started:
                self.abort(request_id)
            raise
        return queue

    async def _start(
        self, ids: list[int], params: SamplingParams, request_id: str, replica: str | None
    ) -> tuple[DeploymentResponseGenerator, Accepted]:
        error: Exception | None = None
        for attempt in range(START_ATTEMPTS):
            gen = self._generate.remote(ids, params, request_id, replica=replica)
            try:
                first = await asyncio.wait_for(gen.__anext__(), ACCEPT_TIMEOUT_S)
            except TimeoutError:
                gen.cancel()
                raise Unavailable(
                    f"no engine replica accepted the request in {ACCEPT_TIMEOUT_S:.0f} s"
                ) from None
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except RayTaskError as e:  # raised by the replica: bad input (400), full (503)
                if isinstance(e.cause, (ValueError, Unavailable)):
                    raise e.cause from None
                raise RequestFailed(f"engine replica error: {e.cause!r}") from None
            except REPLICA_DIED as e:  # nothing started there: send it again
                error = e
                log.warning("replica died before accepting request %s (attempt %d)", request_id, attempt + 1)
                await asyncio.sleep(0.25 * (attempt + 1))
                continue
            return gen, first
        raise Unavailable(f"no engine replica could take the request: {type(error).__name__}")

    async def _pump(self, request_id: str, gen: DeploymentResponseGenerator, call: _Call) -> None:
        finished = False
        try:
            async for item in gen:
                if isinstance(item, ReplicaReport):
                    self.board.update(item)
                    continue
                out: RequestOutput = item
                if out.new_token_ids:
                    self.metrics.tokens_generated(len(out.new_token_ids))
                    if call.first_token is None:
                        call.first_token = time.monotonic()
                call.last = out
                finished = out.finished
                call.queue.put_nowait(out)
                if finished:
                    reason = out.finish_reason.value if out.finish_reason else "unknown"
                    self.metrics.observe_request(
                        reason, call.arrival, call.first_token, time.monotonic(), len(out.output_token_ids)
                    )
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # the replica died mid-request (or its call failed): fail this request
            if not finished:
                log.warning("request %s failed on replica %s: %s", request_id, call.replica, type(e).__name__)
                self.metrics.observe_request("error", call.arrival, call.first_token, time.monotonic(), 0)
                call.queue.put_nowait(
                    RequestFailed(
                        f"the engine replica serving this request failed ({type(e).__name__}); "
                        "the request was lost, retry it"
                    )
                )
        finally:
            self._calls.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None and call.task is not None:
            call.task.cancel()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def busy(self) -> bool:
        return bool(self._calls)

    def drain(self) -> None:
        self._draining = True

    def abort_all(self) -> None:
        """Abort every request; each one's queue gets a final output with finish reason abort."""
        for request_id, call in list(self._calls.items()):
            self.abort(request_id)
            last = call.last
            call.queue.put_nowait(
                RequestOutput(
                    request_id,
                    [],
                    True,
                    FinishReason.ABORT,
                    list(last.output_token_ids) if last else [],
                    last.text if last else "",
                    call.num_prompt_tokens,
                )
            )
