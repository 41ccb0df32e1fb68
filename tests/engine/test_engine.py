"""Continuous batching, chunked prefill, KV budget and sampling on a tiny random model (float32)."""

import pytest
from support.engine import GREEDY, PROMPTS, make_engine, run_alone, run_staggered

from dynaspec import LLM, SamplingParams


@pytest.fixture(scope="module")
def alone(target_dir):
    return run_alone(target_dir, PROMPTS)


def test_batched_arrivals_equal_each_prompt_alone(target_dir, alone):
    engine = make_engine(target_dir, max_num_seqs=4)
    assert run_staggered(engine, PROMPTS, arrive_every=3) == alone
    assert engine.allocator.usage == 0.0


def test_chunked_prefill_equals_whole_prefill(target_dir, alone):
    engine = make_engine(target_dir, max_num_batched_tokens=5)
    assert run_staggered(engine, PROMPTS, arrive_every=1) == alone


def test_tight_kv_budget_waits_and_preempts_but_outputs_stay(target_dir, alone):
    # room for 64 tokens (512 bytes each: 2 layers x K,V x 2 heads x 16 dims x 4 bytes):
    # requests must wait and be preempted, and still match
    engine = make_engine(target_dir, kv_cache_memory_gb=64 * 512 / 2**30, block_size=4)
    assert engine.allocator.num_blocks * 4 == 64
    assert run_staggered(engine, PROMPTS, arrive_every=1) == alone
    assert engine.allocator.usage == 0.0
    assert engine.scheduler.num_preemptions > 0


def test_llm_generate_returns_in_input_order(target_dir, alone):
    llm = LLM(str(target_dir), dtype="float32", kv_cache_memory_gb=0.01, progress=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)


def test_prompt_longer_than_context_is_refused(target_dir):
    engine = make_engine(target_dir, max_model_len=16)
    with pytest.raises(ValueError, match="prompt: .* context of 16"):
        engine.add_request(list(range(1, 17)), GREEDY)
    r = engine.add_request(list(range(1, 10)), GREEDY)  # the engine still serves
    while engine.has_unfinished():
        engine.step()
    assert len(r.output_token_ids) == 16 - 9 and r.finish_reason.value == "length"


def test_stop_string_and_max_tokens(target_dir, alone):
    llm = LLM(str(target_dir), dtype="float32", kv_cache_memory_gb=0.01, progress=False)
    full = llm.generate(PROMPTS[0], GREEDY)[0]
    stop = full.text[5:8]
    assert stop
    cut = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    short = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert short.token_ids == full.token_ids[:3]


def test_seeded_sampling_is_reproducible(target_dir):
    llm = LLM(str(target_dir), dtype="float32", kv_cache_memory_gb=0.01, progress=False)
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
        for s in (1, 1, 2)
    ]
    a, b, c = llm.generate([PROMPTS[0]] * 3, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(seed="x"), "seed"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_chat_messages_use_the_template(target_dir):
    engine = make_engine(target_dir)
    r = engine.add_request([{"role": "user", "content": "hi"}], GREEDY)
    assert r.prompt_token_ids == engine.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
