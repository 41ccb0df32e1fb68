"""One engine replica: a Ray Serve deployment class wrapping an engine and its engine loop.

Each replica owns its engine, K policy (and profile), statistics and KV cache, and chooses K from
its own load and acceptance; nothing is shared between replicas. ``generate`` streams one
request: first ``Accepted`` (so the ingress can tell a refused request, 400/503, from one that
started), then the request's ``RequestOutput``s, then this replica's ``ReplicaReport``. A caller
that cancels (a client that went away) aborts the request in this replica's engine.
``record_routing_stats`` (polled by Serve's controller) gives the same report to the router.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from ray import serve

from dynaspec.engine.build import build_engine
from dynaspec.engine.engine import EngineConfig
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.routing import prediction_curve, proxy_curve
from dynaspec.replicas.board import ReplicaReport
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.engine_loop import EngineLoop


@dataclass(slots=True, frozen=True)
class Accepted:
    """The first item of a replica's stream: the request is in its engine."""

    replica: str


class EngineReplica:
    def __init__(
        self, engine_config: EngineConfig, max_waiting: int | None, num_threads: int, stats_interval: float
    ) -> None:
        torch.set_num_threads(num_threads)
        self.engine = build_engine(engine_config)
        self.loop = EngineLoop(self.engine, max_waiting=max_waiting, stats_interval=stats_interval)
        self.loop.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.active = 0  # generate calls in progress (admitted or about to be)
        self.served = 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, replica: str | None = None
    ) -> AsyncIterator[Accepted | object]:
        """Stream one request (``replica`` is the router's pin, unused here)."""
        self.active += 1
        finished = False
        try:
            queue = await self.loop.submit([(prompt_ids, params, request_id)])
            yield Accepted(self.replica_id)
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
            self.served += 1
            yield self.report()
        finally:
            self.active -= 1
            if not finished:
                self.loop.abort(request_id)

    def record_routing_stats(self) -> dict:
        return self.report().to_dict()

    def info(self) -> dict:
        return {"replica": self.replica_id, "pid": os.getpid(), "max_model_len": self.engine.max_model_len}

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("the engine loop thread has stopped")

    def __del__(self) -> None:
        self.loop.stop()

    def report(self) -> ReplicaReport:
        snap = self.loop.snapshot
        engine = self.engine
        load = max(snap.running + snap.waiting, self.active)
        spec = snap.stats.get("spec")
        policy = engine.k_policy
        k = engine.counters.chosen_k
        if isinstance(policy, GoodputK):  # the goodput model predicts ms per token
            curve = prediction_curve(
                policy.itl, policy.acceptance.rates(), policy.max_k, load, engine.config.max_num_seqs
            )
        else:
            curve = []
        proxy = not curve
        if proxy:
            curve = proxy_curve(load)
        return ReplicaReport(
            replica=self.replica_id,
            time=time.time(),
            pid=os.getpid(),
            running=snap.running,
            waiting=max(snap.waiting, self.active - snap.running),
            free_kv_blocks=engine.allocator.num_free,
            kv_cache_usage=snap.kv_cache_usage,
            k=k,
            acceptance=spec["acceptance_rate"] if spec and spec["num_draft_tokens"] else None,
            ms_per_token=[round(t, 3) for t in curve],
            ms_per_token_is_proxy=proxy,
            requests_served=self.served,
            generation_tokens=snap.stats.get("num_generated_tokens", 0),
            prompt_tokens=snap.stats.get("num_prompt_tokens", 0),
            num_drafts=spec["num_drafts"] if spec else 0,
            num_draft_tokens=spec["num_draft_tokens"] if spec else 0,
            num_accepted_tokens=spec["num_accepted_tokens"] if spec else 0,
            accepted_per_pos=list(spec["accepted_per_pos"]) if spec else [],
        )
