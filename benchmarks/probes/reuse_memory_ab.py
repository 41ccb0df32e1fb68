"""The README's main command with glibc's default malloc thresholds and with `reuse_freed_memory` (the
engine's default): output tok/s and peak RSS, each mode in its own process, alternating (`git show
e12b4e2:results/RESULTS.md`, "Reused logits memory"). Uses the cached n-gram auto profile (made by the
first run of the main command).

    .venv/bin/python benchmarks/probes/reuse_memory_ab.py [--rounds 1]
"""

import argparse
import re
import subprocess
import sys

CHILD = """
import resource, sys
import dynaspec.engine.runner as runner
if sys.argv[1] == "default":
    runner.reuse_freed_memory = lambda: False
from dynaspec.cli import main
main(sys.argv[2:])
print("peak_rss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
MAIN = ["generate", "--model", "qwen2.5-coder-1.5b-instruct", "--chat", "--prompts-file", "humaneval"]
MAIN += ["--num-prompts", "24", "--max-tokens", "96"]
MAIN += ["--speculative-config", '{"method": "ngram", "dynamic_config_path": "auto"}']


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    print(f"{'round':>5} {'malloc':>8} {'tok/s':>7} {'peak RSS MiB':>13}")
    for round_ in range(1, args.rounds + 1):
        for mode in ("default", "reuse"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, *MAIN], check=True, capture_output=True, text=True
            ).stdout
            tok_s = re.search(r"([\d.]+) tokens/s", out).group(1)
            rss = float(re.search(r"peak_rss_mib ([\d.]+)", out).group(1))
            print(f"{round_:>5} {mode:>8} {tok_s:>7} {rss:>13.0f}")


if __name__ == "__main__":
    main()
