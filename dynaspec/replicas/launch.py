"""Start (or join) Ray, deploy N engine replicas on Ray Serve, and build the ingress app over them.

The HTTP server stays dynaspec's own (FastAPI under uvicorn in this process, as for one engine):
the same endpoints, validation, middleware and graceful shutdown; Serve's HTTP proxy is not
started (``proxy_location="Disabled"``). Requests reach the replicas through a deployment handle
whose router is ``LoadAwareRouter``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from dynaspec.engine.engine import EngineConfig
from dynaspec.heap import ARENA_ENV
from dynaspec.models.loader import resolve_model
from dynaspec.replicas.board import board_for
from dynaspec.replicas.client import ReplicaClient
from dynaspec.replicas.replica import EngineReplica
from dynaspec.replicas.router import LoadAwareRouter

log = logging.getLogger(__name__)

APP_NAME = "dynaspec"
DEPLOYMENT_NAME = "engine"
ROUTING_STATS_PERIOD_S = 0.5  # how often Serve's controller collects each replica's report
HEALTH_CHECK_PERIOD_S = 2.0  # how soon a dead replica is noticed and replaced


@dataclass(slots=True)
class ReplicaOptions:
    num_replicas: int
    cpus_per_replica: float | None = None  # None: max(1, cores // num_replicas)
    gpus_per_replica: float = 0.0
    ray_address: str | None = None  # None: start a local Ray instance
    max_waiting: int | None = 512  # per replica
    stats_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--replicas: must be >= 1, got {self.num_replicas}")
        if self.cpus_per_replica is None:
            self.cpus_per_replica = float(max(1, (os.cpu_count() or 1) // self.num_replicas))
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0:
            raise ValueError("--cpus-per-replica: must be > 0; --gpus-per-replica: must be >= 0")


def max_ongoing_requests(config: EngineConfig, max_waiting: int | None) -> int:
    """Requests Serve may hand one replica at once: its running slots plus its waiting room
    (continuous batching admits them as slots free), not Serve's default of 5."""
    return config.max_num_seqs + (max_waiting if max_waiting is not None else 4 * config.max_num_seqs)


def start_ray(options: ReplicaOptions) -> None:
    if ray.is_initialized():
        return
    if options.ray_address:
        ray.init(address=options.ray_address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=int(max(1, round(options.num_replicas * options.cpus_per_replica))),
            num_gpus=int(options.num_replicas * options.gpus_per_replica) or None,
            include_dashboard=False,
            log_to_driver=False,
        )


def deploy(config: EngineConfig, options: ReplicaOptions, board: str = APP_NAME):
    """N replicas of the engine as a Serve deployment; returns its handle once all are healthy."""
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        EngineReplica,
        name=DEPLOYMENT_NAME,
        num_replicas=options.num_replicas,
        ray_actor_options={
            "num_cpus": options.cpus_per_replica,
            "num_gpus": options.gpus_per_replica,
            # one malloc arena (dynaspec/heap.py): Ray's worker has threads before it imports dynaspec
            "runtime_env": {"env_vars": dict(ARENA_ENV)},
        },
        max_ongoing_requests=max_ongoing_requests(config, options.max_waiting),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=RequestRouterConfig(
            request_router_class=LoadAwareRouter,
            request_router_kwargs={"board": board},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=10.0,
        ),
    )
    threads = max(1, int(options.cpus_per_replica))
    app = deployment.bind(config, options.max_waiting, threads, options.stats_interval)
    return serve.run(app, name=APP_NAME, route_prefix=None)


def build_client(config: EngineConfig, options: ReplicaOptions) -> ReplicaClient:
    """Start Ray, deploy the replicas, and return the ingress's backend over them."""
    start_ray(options)
    handle = deploy(config, options)
    info = handle.info.remote().result()
    tokenizer = resolve_model(config.model, progress=False).tokenizer()
    log.info(
        "%d engine replicas on Ray Serve (%.3g CPUs, %.3g GPUs each)",
        options.num_replicas,
        options.cpus_per_replica,
        options.gpus_per_replica,
    )
    return ReplicaClient(handle, tokenizer, info["max_model_len"], board_for(APP_NAME))


def shutdown() -> None:
    """Delete the replicas and leave Ray (which stops a local instance; a joined cluster runs on)."""
    serve.delete(APP_NAME)
    ray.shutdown()
