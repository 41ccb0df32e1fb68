"""`dynaspec serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse

from dynaspec.engine.args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.set_defaults(func=run)


def build_server(args: argparse.Namespace):
    """Engine, engine loop and app; returns (app, engine_loop)."""
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.server.app import build_app
    from dynaspec.server.engine_loop import EngineLoop

    engine = Engine(EngineConfig(model=args.model, **engine_kwargs(args)))
    loop = EngineLoop(engine)
    return build_app(loop, args.served_model_name or args.model), loop


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app, loop = build_server(args)
    loop.start()
    print(
        f"dynaspec serving {args.served_model_name or args.model} on http://{args.host}:{args.port}",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        loop.stop()
    return 0
