"""The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft): speculation is lossless on real weights.

float32: greedy output with the draft model equals plain greedy output token for token.
bfloat16: a K+1-token verify pass and a 1-token decode can round differently, so an argmax may flip
where the target's top two logits nearly tie; every divergence must happen at such a near-tie.
"""

from __future__ import annotations

import pytest
import torch

from dynaspec import SamplingParams
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.runner import TokenRun
from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.kpolicy.policy import FixedK, make_policy

pytestmark = pytest.mark.packs

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
    [{"role": "user", "content": "Write a bash one-liner that counts the lines of all .py files."}],
]
MAX_TOKENS = 24
# bf16 logits of this model round at ~0.06-0.125 near |logit| 10-20; a flip needs a gap of a few ulps
NEAR_TIE = 0.5
SPEC = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}


def _plain_and_speculative(dtype: str) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """One engine (one load of each model): K=0 first, which never runs the drafter (the plain
    path), then K=4."""
    engine = Engine(
        EngineConfig(
            model=TARGET, dtype=dtype, speculative_config=SPEC, kv_cache_memory_gb=0.5, progress=False
        )
    )
    outputs = []
    for policy in (FixedK(0), make_policy(SpeculativeConfig.parse(SPEC))):
        engine.set_k_policy(policy)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        requests = [engine.add_request(p, params) for p in PROMPTS]
        while engine.has_unfinished():
            engine.step()
        outputs.append([r.output_token_ids for r in requests])
    return engine, outputs[0], outputs[1]


def _top2_gap(engine: Engine, token_ids: list[int]) -> float:
    """Target's top-1 minus top-2 logit for the next token after ``token_ids`` (one prefill pass)."""
    blocks: list[int] = []
    assert engine.allocator.grow(blocks, len(token_ids))
    try:
        logits = engine.runner.run([TokenRun(token_ids, 0, blocks, [len(token_ids) - 1])])[0]
    finally:
        engine.allocator.free(blocks)
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_float32_speculative_equals_plain():
    engine, plain, spec = _plain_and_speculative("float32")
    assert spec == plain
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0


def test_bfloat16_divergences_only_at_near_ties():
    engine, plain, spec = _plain_and_speculative("bfloat16")
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0
    divergences = []
    for prompt, a, b in zip(PROMPTS, plain, spec):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            continue
        prefix = engine.tokenizer.apply_chat_template(prompt) + a[:first]
        divergences.append((first, _top2_gap(engine, prefix)))
    print(
        f"bf16: {len(divergences)}/{len(PROMPTS)} prompts diverged; (token index, top-2 gap): {divergences}"
    )
    for index, gap in divergences:
        assert gap < NEAR_TIE, f"divergence at token {index} with a top-2 logit gap of {gap:.3f}"
