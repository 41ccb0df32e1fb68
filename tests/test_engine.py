"""Continuous batching, chunked prefill, KV budget and sampling on a tiny random model (float32)."""

import pytest

from dynaspec import LLM, SamplingParams
from dynaspec.engine.engine import Engine, EngineConfig

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "Hello, world! How are you today? I am fine, thank you. And you?",
    "import torch\nx = torch.zeros(4, 8)\n",
    "class Request:",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_gb", 0.01)
    kw.setdefault("progress", False)
    return Engine(EngineConfig(model=str(path), **kw))


def run_alone(path, prompts, params=GREEDY, **kw):
    outs = []
    for p in prompts:
        engine = make_engine(path, **kw)
        r = engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
        outs.append(r.output_token_ids)
    return outs


def run_staggered(engine, prompts, params=GREEDY, arrive_every=2):
    """Add one prompt every `arrive_every` steps, so requests join a running batch."""
    requests = []
    pending = list(prompts)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            requests.append(engine.add_request(pending.pop(0), params))
        engine.step()
        step += 1
    return [r.output_token_ids for r in requests]


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
