"""The server with and without one malloc arena (`dynaspec.heap.one_arena`; `git show
e12b4e2:results/RESULTS.md`, "One malloc arena"): a real `dynaspec serve` on loopback, fixed K=5 n-gram
drafting, 24 concurrent HumanEval requests, so a verify pass's logits (24 x 6 rows x 151,936 x 4 bytes =
88 MB) outgrow the 64 MiB heaps of the engine thread's own arena. Each mode in its own server process,
alternating: "arenas" makes a thread allocate before dynaspec is imported, which fixes glibc's arena
limit at its default (the engine thread then gets an arena of its own, as before this change); "one" is
the default. Output tok/s from `dynaspec bench serve`, the server's peak RSS from /proc.

    .venv/bin/python benchmarks/probes/engine_thread_memory.py [--rounds 2]
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SERVER = """
import sys, threading
if sys.argv[1] == "arenas":
    t = threading.Thread(target=lambda: bytearray(1 << 20))  # a second arena before dynaspec's import
    t.start(); t.join()
from dynaspec.cli import main
main(sys.argv[2:])
"""
SPEC = '{"method": "ngram", "num_speculative_tokens": 5}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def run(mode: str, args: argparse.Namespace) -> tuple[float, float]:
    port = free_port()
    cmd = [sys.executable, "-c", SERVER, mode, "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--speculative-config", SPEC]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            bench = [sys.executable, "-m", "dynaspec", "bench", "serve", "--base-url", url]
            bench += ["--dataset", "humaneval", "--num-prompts", str(args.prompts), "--max-tokens", "96"]
            bench += ["--max-concurrency", str(args.concurrency), "--temperature", "0"]
            subprocess.run(bench + ["--result-file", result.name], check=True, capture_output=True)
            tok_s = json.loads(Path(result.name).read_text())["result"]["output_throughput"]
        return tok_s, peak_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=24)
    args = p.parse_args()
    print(f"{'round':>5} {'arenas':>7} {'tok/s':>7} {'peak RSS MiB':>13}")
    for round_ in range(1, args.rounds + 1):
        for mode in ("arenas", "one"):
            tok_s, rss = run(mode, args)
            print(f"{round_:>5} {mode:>7} {tok_s:>7.1f} {rss:>13.0f}", flush=True)


if __name__ == "__main__":
    main()
