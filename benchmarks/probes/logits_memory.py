"""What a step's logits cost in memory traffic alone, with glibc's default thresholds and with
`reuse_freed_memory` (`git show e12b4e2:results/RESULTS.md`, "Reused logits memory"): ms to allocate and
write a [rows, vocab] float32 buffer, and to copy it into a padded [bs, K+1, vocab] one as the runner did
before it returned a view, at the verify shapes of a step. Each mode runs in its own process, since mallopt
is process-wide.

    .venv/bin/python benchmarks/probes/logits_memory.py
"""

import argparse
import subprocess
import sys

import torch

from dynaspec.bench.common import ms_per_call

SHAPES = ((1, 6), (4, 6), (8, 4), (32, 1), (32, 2), (24, 6))  # (batch, K + 1)


def measure(mode: str, vocab: int, repeats: int) -> None:
    if mode == "reuse":
        from dynaspec.heap import reuse_freed_memory

        assert reuse_freed_memory()
    for bs, width in SHAPES:
        flat = torch.randn(bs * width, vocab)
        fill_ms = ms_per_call(lambda rows=bs * width: torch.empty(rows, vocab).fill_(1.0), repeats)
        copy_ms = ms_per_call(lambda flat=flat, bs=bs, width=width: padded_copy(flat, bs, width), repeats)
        print(f"{mode},{bs},{width},{bs * width * vocab * 4 / 1e6:.0f},{fill_ms:.2f},{copy_ms:.2f}")


def padded_copy(flat: torch.Tensor, bs: int, width: int) -> torch.Tensor:
    out = flat.new_zeros(bs, width, flat.shape[-1])
    for i in range(bs):
        out[i] = flat[i * width : (i + 1) * width]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--mode", choices=["default", "reuse"], help=argparse.SUPPRESS)  # one child's mode
    args = p.parse_args()
    if args.mode:
        measure(args.mode, args.vocab, args.repeats)
        return
    rows: dict[tuple[int, int], dict[str, list[str]]] = {}
    for mode in ("default", "reuse"):
        argv = [sys.executable, __file__, "--mode", mode, "--vocab", str(args.vocab)]
        argv += ["--repeats", str(args.repeats)]
        for line in subprocess.run(argv, check=True, capture_output=True, text=True).stdout.split():
            _, bs, width, mb, fill, copy = line.split(",")
            rows.setdefault((int(bs), int(width)), {"mb": [mb]})[mode] = [fill, copy]
    print(f"ms per step, vocab {args.vocab} (float32 logits); a fresh buffer written / padded copy")
    heads = ("write, default", "write, reused", "copy, default", "copy, reused")
    print(f"{'bs':>3} {'K+1':>4} {'MB':>5} " + " ".join(f"{h:>14}" for h in heads))
    for (bs, width), r in rows.items():
        (mb,), (fd, cd), (fr, cr) = r["mb"], r["default"], r["reuse"]
        print(f"{bs:>3} {width:>4} {mb:>5} " + " ".join(f"{v:>14}" for v in (fd, fr, cd, cr)))


if __name__ == "__main__":
    main()
