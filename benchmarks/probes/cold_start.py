"""What a K policy's cold start costs at one request: prompt by prompt, the pair decodes each prompt
under fixed K=1, a fresh per-request policy (the profile's acceptance prior, ``prior_weight`` 16),
a fresh one with a lighter prior (4 pseudo-drafts), and one policy kept from prompt to prompt (a
server's), in alternating order; output tok/s of each against K=1's on the same prompt (issue 37,
the results diary: a sweep gives every run a fresh policy).

    .venv/bin/python benchmarks/probes/cold_start.py --profile <profile.json> --prompts 8   # ~2 min
"""

from __future__ import annotations

import argparse
import statistics
import time

from dynaspec.bench.common import k_policies, write_result
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams

SPEC = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="the pair's profile (e.g. its cached auto profile)")
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--first", type=int, default=10, help="the first prompt of the dataset taken")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", help="JSON path")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=SPEC))
    prompts = load_prompts(args.dataset)[args.first : args.first + args.prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    makers = k_policies([1], profile, 5, 3)  # K=1 and per-request as the benchmarks make them
    kept = makers["per-request"]()
    configs = {
        "K=1": makers["K=1"],
        "fresh": makers["per-request"],
        "fresh, prior 4": lambda: GoodputK(profile, 5, 3, per_request=True, prior_weight=4.0),
        "kept": lambda: kept,
    }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for i, prompt in enumerate(prompts):
        for name in list(configs) if i % 2 == 0 else list(configs)[::-1]:
            engine.set_k_policy(configs[name]())
            start = time.perf_counter()
            request = engine.add_request(prompt, params)
            while engine.has_unfinished():
                engine.step()
            rates[name].append(len(request.output_token_ids) / (time.perf_counter() - start))
    result = {"args": vars(args), "tok_s": rates, "vs_k1": {}}
    for name, xs in rates.items():
        ratio = statistics.fmean(x / y for x, y in zip(xs, rates["K=1"]))
        result["vs_k1"][name] = round(ratio, 4)
        print(f"{name:15s} {statistics.fmean(xs):6.2f} tok/s, {ratio:.3f}x K=1 (prompt by prompt)")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
