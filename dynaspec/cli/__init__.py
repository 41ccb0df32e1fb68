"""`dynaspec` command line: one subcommand module per job.

User errors (bad flags, unknown models, malformed configs) print one line and exit 2, without a
traceback; each module's ``run`` raises ValueError for those.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ["generate", "models", "serve", "bench", "profile", "train_draft"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynaspec", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"dynaspec.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"dynaspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
