"""The C++ kernels of a git revision against the working tree's (`git show e12b4e2:results/RESULTS.md`, "The
kernel's one-row loop and prefetch"): the engine's plain decode (tok/s of engine steps at each batch size,
after a chat prompt or, with --context N, N tokens of text), or with --stream,
benchmarks/probes/qmm_stream.py with the given arguments (weights streamed from memory), or with
--attention, benchmarks/probes/attention_kernel.py with the given arguments, or with --rows,
benchmarks/probes/qmm_rows.py (ms per call against rows, in cache). Each variant runs in its own
process (the kernels build once per source version, then are cached), alternating in rounds.

    .venv/bin/python benchmarks/probes/kernel_ab.py --rev 52fede7 [--batch-sizes 1,8] [--rounds 2]
    .venv/bin/python benchmarks/probes/kernel_ab.py --rev 52fede7 --stream "--format Q4_K --rows 1"
    .venv/bin/python benchmarks/probes/kernel_ab.py --rev 84d4c9c \
        --attention "--tail 2000 --cache bfloat16 --cold"
    .venv/bin/python benchmarks/probes/kernel_ab.py --rev 02a233a --rounds 6 --rows "--rows 1,2,3,8 --no-amx"
    .venv/bin/python benchmarks/probes/kernel_ab.py --rev 84d4c9c --batch-sizes 1 --context 8000
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "dynaspec" / "models" / "csrc"
SCRIPTS = {"stream": "qmm_stream.py", "attention": "attention_kernel.py", "rows": "qmm_rows.py"}
PATCH = """
import sys
from pathlib import Path
import dynaspec.models.kernels as kernels
if sys.argv[1] != "-":  # another revision's sources, before the kernels are first built
    kernels.KERNEL_SOURCES = [Path(sys.argv[1]) / p.name for p in kernels.KERNEL_SOURCES]
"""
SCRIPT = (
    PATCH
    + """
import runpy
script = sys.argv[3]
sys.argv = [script, *sys.argv[2].split()]
runpy.run_path(script, run_name="__main__")
"""
)
ENGINE = (
    PATCH
    + """
from dynaspec import SamplingParams
from dynaspec.bench.common import ms_per_call
from dynaspec.engine.engine import Engine, EngineConfig
assert kernels.kernel_error() is None, kernels.kernel_error()
engine = Engine(EngineConfig(model=sys.argv[2], progress=False, kv_cache_memory_gb=0.5))
ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a quicksort in Python."}])
if int(sys.argv[5]):  # a long context: that many tokens of the HumanEval prompts' text
    from dynaspec.datasets import load_prompts
    text = "\\n".join(load_prompts("humaneval", chat=False))
    ids = engine.tokenizer.encode(text)[: int(sys.argv[5])]
params = SamplingParams(max_tokens=10**4, temperature=0.0, ignore_eos=True)
for bs in map(int, sys.argv[3].split(",")):
    requests = [engine.add_request(ids, params) for _ in range(bs)]
    while not all(r.is_decoding for r in requests):  # the prompts' prefill
        engine.step()
    for _ in range(10):
        engine.step()
    print(f"bs {bs} {bs * 1000 / ms_per_call(engine.step, int(sys.argv[4])):.2f}")
    for r in requests:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
"""
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", required=True, help="git revision whose dynaspec/models/csrc is compared")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--context", type=int, default=0, help="decode after this many tokens of text")
    p.add_argument(
        "--stream", default=None, help="run benchmarks/probes/qmm_stream.py with these arguments instead"
    )
    p.add_argument(
        "--attention", default=None, help="run benchmarks/probes/attention_kernel.py with these arguments"
    )
    p.add_argument("--rows", default=None, help="run benchmarks/probes/qmm_rows.py with these arguments")
    args = p.parse_args()
    script = next(((SCRIPTS[k], getattr(args, k)) for k in SCRIPTS if getattr(args, k) is not None), None)
    with tempfile.TemporaryDirectory() as old:
        for f in CSRC.iterdir():
            rel = f.relative_to(CSRC.parent.parent.parent).as_posix()
            show = subprocess.run(["git", "show", f"{args.rev}:{rel}"], capture_output=True, check=False)
            if show.returncode == 0:
                (Path(old) / f.name).write_bytes(show.stdout)
        if script is None:
            sizes = args.batch_sizes.split(",")
            print(f"{'round':>5} {'kernels':>12} " + " ".join(f"{'bs ' + b + ' tok/s':>12}" for b in sizes))
        for round_ in range(1, args.rounds + 1):
            for name, src in ((args.rev, old), ("working tree", "-")):
                if script is not None:
                    cmd = [
                        sys.executable,
                        "-c",
                        SCRIPT,
                        src,
                        script[1],
                        str(Path(__file__).parent / script[0]),
                    ]
                else:
                    cmd = [sys.executable, "-c", ENGINE, src, args.model, args.batch_sizes, str(args.steps)]
                    cmd.append(str(args.context))
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                if script is not None:
                    print(f"{round_:>5} {name:>12} {out.strip()}", flush=True)
                    continue
                rates = re.findall(r"^bs \d+ ([\d.]+)$", out, re.M)
                print(f"{round_:>5} {name:>12} " + " ".join(f"{r:>12}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
