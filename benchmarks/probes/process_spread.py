"""How much one process's step costs differ from another's: ITL(bs, K) of the draft pair at fixed K,
the Ks alternating in blocks within the process, printed as one JSON line (ms a step per K and each
K's ratio to K=0). Run it in several fresh processes, with and without a setting (here: the
weights in 2 MiB pages, DYNASPEC_HUGE_PAGES=0|1), and compare the spread of the ratios between
processes: the auto profile times such cells once per process (issue 37: two fresh profiles'
drafting cells differed by 10-15% at the same plain cell).

    for i in 1 2 3; do for hp in 0 1; do DYNASPEC_HUGE_PAGES=$hp .venv/bin/python \\
        benchmarks/probes/process_spread.py --tag hp$hp >> spread.jsonl; done; done
    .venv/bin/python benchmarks/probes/process_spread.py --summary spread.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dynaspec import SamplingParams
from dynaspec.bench.common import ms_per_call
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.policy import FixedK


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    spec = {"method": "draft_model", "model": args.drafter, "num_speculative_tokens": max(args.ks)}
    engine = Engine(
        EngineConfig(model=args.model, speculative_config=spec, kv_cache_memory_gb=0.5, progress=False)
    )
    prompts = load_prompts("humaneval", chat=True)[: args.batch_size]
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while not all(r.is_decoding for r in requests):
        engine.step()
    ms: dict[int, list[float]] = {k: [] for k in args.ks}
    for block in range(args.blocks):
        for k in args.ks if block % 2 == 0 else list(reversed(args.ks)):
            engine.set_k_policy(FixedK(k))
            engine.step()  # the drafter catches up outside the clock
            ms[k].append(ms_per_call(engine.step, args.steps))
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {
        "tag": args.tag,
        "batch_size": args.batch_size,
        "ms": {str(k): round(v, 2) for k, v in med.items()},
        "ratio_to_k0": {str(k): round(med[k] / med[args.ks[0]], 4) for k in args.ks},
    }


def summary(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for tag in sorted({r["tag"] for r in rows}):
        mine = [r for r in rows if r["tag"] == tag]
        print(f"{tag}: {len(mine)} processes")
        for k in mine[0]["ms"]:
            plain = [r["ms"][k] for r in mine]
            ratio = [r["ratio_to_k0"][k] for r in mine]
            spread = (max(ratio) - min(ratio)) / statistics.mean(ratio)
            print(
                f"  K={k}: ms {min(plain):.1f}-{max(plain):.1f}; ratio to K=0 "
                f"{min(ratio):.3f}-{max(ratio):.3f} (spread {spread:.1%})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--ks", default="0,1,2,3", type=lambda s: [int(k) for k in s.split(",")])
    ap.add_argument("--blocks", type=int, default=6, help="blocks per K, the Ks alternating")
    ap.add_argument("--steps", type=int, default=5, help="steps timed per block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--summary", default=None, help="summarize a file of this probe's JSON lines instead")
    args = ap.parse_args()
    if args.summary:
        summary(args.summary)
        return
    print(json.dumps(measure(args)), flush=True)


if __name__ == "__main__":
    main()
