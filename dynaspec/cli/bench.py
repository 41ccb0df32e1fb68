"""`dynaspec bench <name>`: each benchmark is a module dynaspec.bench.<name> with add_parser(sub)."""

from __future__ import annotations

import importlib

BENCHMARKS = ["decode", "spec", "sweep", "serve"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: print a table, write JSON")
    bench_sub = p.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"dynaspec.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"dynaspec.bench.{name}":
                raise
            continue
        module.add_parser(bench_sub)
