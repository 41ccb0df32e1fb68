"""`dynaspec serve`: the OpenAI-compatible server, over one in-process engine or, with
``--replicas N``, over N engine replicas on Ray Serve (``dynaspec.replicas``, imported only then)."""

from __future__ import annotations

import argparse
import logging
import os

from dynaspec.engine.args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("DYNASPEC_API_KEY"),
        help="require 'Authorization: Bearer <key>' on /v1/* (default: $DYNASPEC_API_KEY; none: open)",
    )
    g.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")
    g.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=512,
        help="requests that may wait for a slot; beyond it new requests get 503 with Retry-After",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted",
    )
    g.add_argument("--no-access-log", action="store_true", help="no log line per request")
    g.add_argument(
        "--stats-interval", type=float, default=10.0, help="seconds between stats lines while busy (0: none)"
    )
    r = p.add_argument_group("replicas (Ray Serve; needs the ray extra: pip install 'dynaspec[ray]')")
    r.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve behind this server, each choosing its own K "
        "(default: one engine in this process, no Ray)",
    )
    r.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: start a local Ray instance)"
    )
    r.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="CPUs reserved per replica, also its torch threads (default: max(1, cores // N))",
    )
    r.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs reserved per replica")
    p.set_defaults(func=run)


def build_server(args: argparse.Namespace):
    """The backend (one engine loop, or a client of engine replicas) and the app over it; returns
    (app, backend)."""
    from dynaspec.engine.args import check_at_least
    from dynaspec.engine.build import build_engine
    from dynaspec.engine.engine import EngineConfig
    from dynaspec.kpolicy.config import SpeculativeConfig
    from dynaspec.server.app import build_app
    from dynaspec.server.middleware import GuardConfig

    check_at_least(("--max-body-bytes", args.max_body_bytes, 1), ("--max-waiting", args.max_waiting, 0))
    if args.shutdown_timeout < 0 or args.stats_interval < 0:
        raise ValueError("--shutdown-timeout and --stats-interval: must be >= 0")
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is not None and spec.synthetic_acceptance_rate is not None:
        raise ValueError(
            "speculative_config.synthetic_acceptance_rate: serve refuses it: it accepts drafts whatever "
            "their tokens, so outputs are not the target's (use it with profile, generate or bench)"
        )
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    if args.replicas is not None:
        backend = _replica_client(args, config)
    else:
        from dynaspec.server.engine_loop import EngineLoop

        backend = EngineLoop(
            build_engine(config), max_waiting=args.max_waiting, stats_interval=args.stats_interval
        )
    guard = GuardConfig(
        api_key=args.api_key or None,
        protect_metrics=args.protect_metrics,
        max_body_bytes=args.max_body_bytes,
        access_log=not args.no_access_log,
    )
    return build_app(backend, args.served_model_name or args.model, guard), backend


def _replica_client(args: argparse.Namespace, config):
    try:
        from dynaspec.replicas.launch import ReplicaOptions, build_client
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'dynaspec[ray]' ({e})") from None
    options = ReplicaOptions(
        num_replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica,
        ray_address=args.ray_address,
        max_waiting=args.max_waiting,
        stats_interval=args.stats_interval,
    )
    return build_client(config, options)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dynaspec.server.shutdown import GracefulServer

    # what an operator reads (start, access lines, stats lines, shutdown) is logged at INFO
    logging.getLogger("dynaspec").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    app, backend = build_server(args)
    if args.replicas is None:
        backend.start()
    logging.getLogger("dynaspec.serve").info(
        "dynaspec serving %s on http://%s:%d%s",
        args.served_model_name or args.model,
        args.host,
        args.port,
        " (API key required)" if args.api_key else "",
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    try:
        GracefulServer(config, backend, args.shutdown_timeout).run()
    finally:
        if args.replicas is None:
            backend.stop()
        else:
            from dynaspec.replicas.launch import shutdown

            shutdown()
    return 0
