"""The real pair (Qwen2.5-Coder 1.5B target, 0.5B draft): speculation is lossless on real weights.

Default configuration (the GGUF's own quantized blocks, float32 activations, bfloat16 KV cache):
every kernel on the path is batch invariant (integer dot products in the quantized matmul, row-wise
attention, per-row norms), so greedy output with the draft model equals plain greedy output token
for token, whatever shares the pass: 20 HumanEval and MT-Bench prompts at concurrency 4 (8 alone)
against plain outputs four at a time.
Dense bfloat16 (`--quantization none`): a K+1-token verify pass and a 1-token decode can round
differently in oneDNN's matmuls, so an argmax may flip where the target's top two logits nearly
tie; every divergence must happen at such a near-tie.
"""

from __future__ import annotations

import pytest
import torch

from dynaspec import SamplingParams
from dynaspec.datasets import load_prompts
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
DEFAULT_MAX_TOKENS = 32
# bf16 logits of this model round at ~0.06-0.125 near |logit| 10-20; a flip needs a gap of a few ulps
NEAR_TIE = 0.5
SPEC = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}


def _run(engine: Engine, prompts, max_tokens: int, concurrency: int) -> list[list[int]]:
    """Greedy outputs with at most `concurrency` requests running at once."""
    engine.scheduler.max_num_seqs = concurrency
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in requests]


def _plain_and_speculative(
    prompts, max_tokens: int, concurrency: int, **config
) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """One engine (one load of each model): K=0 first, which never runs the drafter (the plain
    path), then K=4."""
    engine = Engine(
        EngineConfig(model=TARGET, speculative_config=SPEC, kv_cache_memory_gb=0.5, progress=False, **config)
    )
    outputs = []
    for policy in (FixedK(0), make_policy(SpeculativeConfig.parse(SPEC))):
        engine.set_k_policy(policy)
        outputs.append(_run(engine, prompts, max_tokens, concurrency))
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


@pytest.fixture(scope="module")
def default_engine() -> Engine:
    return Engine(EngineConfig(model=TARGET, speculative_config=SPEC, kv_cache_memory_gb=0.5, progress=False))


@pytest.fixture(scope="module")
def default_plain(default_engine) -> tuple[list, list[list[int]]]:
    """20 HumanEval and MT-Bench prompts, alternating, and their plain greedy outputs, four requests
    sharing each pass: batch invariance makes them every concurrency's plain outputs."""
    code, chat = load_prompts("humaneval", chat=True)[:10], load_prompts("mt_bench", chat=True)[:10]
    prompts = [p for pair in zip(code, chat) for p in pair]
    default_engine.set_k_policy(FixedK(0))
    return prompts, _run(default_engine, prompts, DEFAULT_MAX_TOKENS, 4)


@pytest.mark.parametrize(("concurrency", "count"), [(1, 8), (4, 20)])
def test_default_quantized_speculative_equals_plain(default_engine, default_plain, concurrency, count):
    """Speculative greedy output equals plain, alone (the first 8 prompts) and four at a time (all
    20), against plain outputs taken four at a time."""
    engine = default_engine
    # the file's own blocks for the target, 4 bits at load for the drafter (the CPU default)
    assert engine.quantization == "gguf" and engine.proposer.model.quantization == "int4"
    prompts, plain = default_plain
    engine.set_k_policy(make_policy(SpeculativeConfig.parse(SPEC)))
    with engine.recording() as rec:
        spec = _run(engine, prompts[:count], DEFAULT_MAX_TOKENS, concurrency)
    assert rec.spec.num_accepted_tokens > 0
    mismatched = [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b]
    assert not mismatched, f"speculative output differs from plain for prompts {mismatched}"


def test_seeded_sampled_ngram_speculation_emits_plain_decodings_text():
    """n-gram drafts take plain decoding's draws (spec_decode/rejection.py): on the real weights a
    seeded sampled request emits the same tokens at K=0 and K=5, four sharing each pass."""
    engine = Engine(
        EngineConfig(
            model=TARGET,
            speculative_config={"method": "ngram", "num_speculative_tokens": 5},
            kv_cache_memory_gb=0.5,
            progress=False,
        )
    )
    prompts = load_prompts("humaneval", chat=True)[:4]
    outputs = []
    for k in (0, 5):
        engine.set_k_policy(FixedK(k))
        with engine.recording() as rec:
            params = [SamplingParams(max_tokens=48, temperature=1.0, seed=100 + i) for i in range(4)]
            requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            while engine.has_unfinished():
                engine.step()
        outputs.append([r.output_token_ids for r in requests])
    assert rec.spec.num_accepted_tokens > 0
    assert outputs[0] == outputs[1]


def test_bfloat16_dense_divergences_only_at_near_ties():
    engine, plain, spec = _plain_and_speculative(
        PROMPTS, MAX_TOKENS, 4, dtype="bfloat16", quantization="none"
    )
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
