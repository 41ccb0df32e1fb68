"""`dynaspec bench <name>`: each benchmark is a module dynaspec.bench.<name> with add_parser(sub)."""

from __future__ import annotations

import importlib

BENCHMARKS = [
    "decode",
    "spec",
    "footprint",
    "perplexity",
    "sweep",
    "rollout",
    "serve",
    "qmatmul",
    "replicas_sim",
    "soak",
]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: print a table, write JSON")
    bench_sub = p.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        importlib.import_module(f"dynaspec.bench.{name}").add_parser(bench_sub)
