"""The A/B table of ``qmm_rows.py`` runs: per shape and rows, the median over rounds of each build
and their ratio (after / before).

    .venv/bin/python benchmarks/probes/qmm_rows_table.py results/xeon/eagle41d/qmm_rows
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="before_<round>.json and after_<round>.json of qmm_rows.py --out")
    folder = Path(ap.parse_args().folder)
    runs = {
        which: [json.loads(p.read_text())["ms"] for p in sorted(folder.glob(f"{which}_*.json"))]
        for which in ("before", "after")
    }
    print("| shape / rows | before ms | after ms | after / before |")
    print("|---|---|---|---|")
    for key in runs["before"][0]:
        before = statistics.median(r[key] for r in runs["before"])
        after = statistics.median(r[key] for r in runs["after"])
        print(f"| {key} | {before:.3f} | {after:.3f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
