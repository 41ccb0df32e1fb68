"""Does this machine's memory rate depend on the process, or on the moment? Reads 1 GiB twice in
each of ``--processes`` fresh processes (two allocations a process, the fastest of 10 sums each) and
prints GB/s per allocation. Two allocations of one process that agree, while processes minutes apart
disagree, point at the host, not at where a process's pages landed (issue 37, the results diary).

    .venv/bin/python benchmarks/probes/process_memrate.py [--processes 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

GIB_FLOATS = 256 * 1024 * 1024


def one_process(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    rates = []
    for _ in range(2):
        x = torch.ones(GIB_FLOATS, dtype=torch.float32)
        x.sum()
        best = min(_timed(x.sum) for _ in range(10))
        rates.append(x.numel() * 4 / best / 1e9)
    print(" ".join(f"{r:.1f}" for r in rates), flush=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        one_process(args.threads)
        return
    print("process  GB/s, first allocation  second")
    for i in range(args.processes):
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
        print(f"{i + 1:7d}  {out[0]:>22}  {out[1]:>6}", flush=True)


if __name__ == "__main__":
    main()
