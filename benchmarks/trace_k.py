"""Per-step trace of the K caps a policy gives at C=2 (results/RESULTS.md, "Cross-dataset, the other
way"): the MT-Bench profile, 10 HumanEval prompts in a closed loop of 2, 128 tokens, greedy; fixed
K=3 beside per-request K. Run: .venv/bin/python benchmarks/trace_k.py (about 2 minutes)."""

import time
from collections import Counter

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.policy import FixedK, GoodputK
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams

SPEC = {
    "method": "draft_model",
    "model": "qwen2.5-coder-0.5b-instruct",
    "draft_vocab_size": 32768,
    "num_speculative_tokens": 5,
}
engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=SPEC))
profile = load_profile("results/profile_qwen_pair_mtbench.json")
prompts = load_prompts("humaneval", chat=True)[:10]
plans = []  # every step's plan, recorded as the scheduler makes it
schedule = engine.scheduler.schedule
engine.scheduler.schedule = lambda policy: plans.append(schedule(policy)) or plans[-1]
params = SamplingParams(max_tokens=128, temperature=0.0)
for name, policy in (("K=3", FixedK(3)), ("per-request", GoodputK(profile, 5, 3, per_request=True))):
    engine.set_k_policy(policy)
    for prompt in prompts[:2]:
        engine.add_request(prompt, params)
    queued, rows, start = prompts[2:], [], time.perf_counter()
    while engine.has_unfinished():
        began = time.perf_counter()
        finished = sum(o.finished for o in engine.step())
        plan = plans[-1]
        rows.append((round((time.perf_counter() - began) * 1000), tuple(plan.k_caps), len(plan.prefills)))
        for _ in range(finished):  # the closed loop: a finished request is replaced
            if queued:
                engine.add_request(queued.pop(0), params)
    probes = policy.snapshot().get("probes", 0)
    print(f"{name}: wall {time.perf_counter() - start:.1f} s, {len(rows)} steps, {probes} probes")
    print("  K caps per step (most common):", Counter(r[1] for r in rows).most_common(6))
    print(
        "  steps with prefill:",
        sum(1 for r in rows if r[2]),
        "steps over 400 ms:",
        [r for r in rows if r[0] > 400][:8],
    )
