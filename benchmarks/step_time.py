"""Engine step time for plain decoding at batch 1 and 8 (the probe quoted in results/RESULTS.md).

.venv/bin/python benchmarks/step_time.py
"""

import time

from dynaspec import LLM, SamplingParams

llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="bfloat16", progress=False, max_num_seqs=8)
engine = llm.engine
for bs in (1, 8):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [engine.add_request("def fib(n):" + " x" * 100, params) for _ in range(bs)]
    while not all(r.is_decoding for r in requests):
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    step = (time.perf_counter() - start) / 10
    print(f"batch {bs}: step {step * 1000:.1f} ms, {bs / step:.2f} tokens/s")
    for r in requests:
        engine.abort(r.request_id)
