"""Where an EAGLE head's decode step goes at batch 1: step time, the target's pass and the head's
passes, at K=0 and K=k, on one MT-Bench prompt (greedy, 40 tokens); with --draft-model instead of
a head, the same for a draft model's passes.

    .venv/bin/python benchmarks/probes/eagle_step.py bench-results/heads/qwen15-eagle3 --k 3 \
        [--draft-quantization int8]
    .venv/bin/python benchmarks/probes/eagle_step.py --draft-model qwen2.5-coder-0.5b-instruct --k 1
"""

from __future__ import annotations

import argparse
import time

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.policy import FixedK
from dynaspec.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", nargs="?", help="an EAGLE-3 checkpoint directory")
    ap.add_argument("--draft-model", help="a draft model (pack name or path) instead of a head")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--draft-quantization", choices=["none", "int8", "int4"], help="the head's linears")
    args = ap.parse_args()
    if (args.head is None) == (args.draft_model is None):
        ap.error("give an EAGLE-3 head or --draft-model, one of the two")
    method, drafter = ("eagle3", args.head) if args.head else ("draft_model", args.draft_model)
    spec = {"method": method, "model": drafter, "num_speculative_tokens": args.k}
    if args.draft_quantization:
        spec["draft_quantization"] = args.draft_quantization
    config = EngineConfig(
        model=args.model, speculative_config=spec, max_num_seqs=1, kv_cache_memory_gb=1.0, progress=False
    )
    engine = Engine(config)
    prompt = load_prompts("mtbench", chat=True)[0]
    for k in (0, args.k):
        engine.set_k_policy(FixedK(k))
        engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        engine.step()  # the prefill
        start, steps = time.perf_counter(), 0
        with engine.recording() as run:
            while engine.has_unfinished():
                engine.step()
                steps += 1
        step_ms = (time.perf_counter() - start) * 1000 / steps
        target_ms = sum(t.target_ms for t in run.timings) / len(run.timings)
        passes = [ms for t in run.timings for _, _, ms in t.draft_passes]
        head_ms = sum(passes) / len(passes) if passes else 0.0
        print(
            f"K={k}: {steps} steps, {step_ms:.1f} ms a step, target pass {target_ms:.1f} ms, "
            f"{len(passes)} drafter passes of {head_ms:.1f} ms"
        )


if __name__ == "__main__":
    main()
