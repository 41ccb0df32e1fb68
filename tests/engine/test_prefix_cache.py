"""Prefix caching: prompt blocks computed once and shared change no output (tiny model, float32).

The CPU kernels are batch invariant, so a block's K/V are the same bits whichever pass computed
them: every output, sampled ones included, must equal the engine's without the cache."""

import dataclasses

import pytest
from support.eagle import target_config, write_head
from support.engine import GREEDY, PROMPTS, make_engine, run_staggered
from support.tiny import DEFAULT_GGUF_TYPES, make_tiny_gguf

from dynaspec import SamplingParams
from dynaspec.engine.kv_cache import BlockAllocator
from dynaspec.engine.request import block_key

SYSTEM = "You are a careful assistant. Answer in one line, and never repeat the question. "
SHARED = [SYSTEM + p for p in PROMPTS]  # a long common prefix, then each prompt's own tokens


def chain(*blocks: list[int]) -> list[bytes]:
    keys = []
    for tokens in blocks:
        keys.append(block_key(keys[-1] if keys else b"", tokens))
    return keys


def drain(engine, prompts, params=GREEDY):
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return requests


def test_allocator_shares_counts_references_and_evicts_the_least_recent_first():
    a = BlockAllocator(4, 2, prefix_caching=True)
    k0, k1, k2 = chain([1, 2], [3, 4], [5, 6])
    first: list[int] = []
    assert a.grow(first, 4) and len(first) == 2 and a.num_touched == 2
    a.register(first[0], k0)
    a.register(first[1], k1)
    a.register(first[1], k2)  # a block keeps its first key
    assert a.cached_prefix([k0, k1, k2]) == 2 and a.num_cached_blocks == 2
    second = a.acquire([k0, k1])
    assert second == first
    a.free(first)  # still held by the second request
    assert a.num_free == 2 and a.usage == 0.5
    a.free(second)  # now cached, unheld: free to take, still matchable
    assert a.num_free == 4 and a.usage == 0.0 and a.cached_prefix([k0, k1]) == 2
    taken: list[int] = []
    assert a.grow(taken, 6)  # the 2 plain blocks, then the request's last block is evicted first
    assert a.num_evicted == 1 and a.cached_prefix([k0, k1]) == 1 and a.num_touched == 4
    again = a.acquire([k0])
    assert a.num_free == 0 and not a.grow(again, 4)
    a.free(taken)
    a.free(again)
    a.reset_prefix_cache()
    assert a.num_cached_blocks == 0 and a.num_free == 4 and a.cached_prefix([k0]) == 0


def test_a_key_cached_under_another_block_keeps_the_first_and_off_caches_nothing():
    a = BlockAllocator(4, 2, prefix_caching=True)
    (k0,) = chain([7, 8])
    x, y = [], []
    a.grow(x, 2)
    a.grow(y, 2)
    a.register(x[0], k0)
    a.register(y[0], k0)  # two requests computed the same tokens at once
    assert a.acquire([k0]) == x[:1]
    off = BlockAllocator(4, 2)
    off.register(0, k0)
    assert off.cached_prefix([k0]) == 0 and off.num_cached_blocks == 0


def test_unshare_gives_a_holder_a_fresh_block_and_counts_shared_blocks():
    a = BlockAllocator(3, 2, prefix_caching=True)
    (k0,) = chain([1, 2])
    first: list[int] = []
    a.grow(first, 2)
    a.register(first[0], k0)
    assert a.num_shared == 0 and not a.is_shared(first[0])
    second = a.acquire([k0])
    third = a.acquire([k0])
    assert a.num_shared == 1 and a.is_shared(first[0])
    copy = a.unshare(second[0])  # the caller copies the K/V over and puts it in its table
    assert copy not in (None, first[0]) and a.num_unshared == 1 and a.is_shared(first[0])
    assert a.unshare(third[0]) not in (None, copy) and a.num_shared == 0 and a.num_free == 0
    a.acquire([k0])
    assert a.unshare(first[0]) is None and a.num_shared == 1  # no block free: nothing changes


@pytest.fixture(scope="module")
def gguf_target(target_dir, tmp_path_factory):
    """The tiny target in GGUF blocks: the C++ kernels, whose rows are batch invariant. Every matrix
    quantized: a BF16 one stays dense, in PyTorch's matmul, whose sums depend on the call's rows on
    some CPUs (zen5: the first logprob moved by 6e-7 when the prompt's cached blocks were skipped)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    make_tiny_gguf(target_dir, path, {**DEFAULT_GGUF_TYPES, "up_proj.weight": "Q8_0"})
    return path


@pytest.mark.parametrize("weights", ["dense", "gguf"])
def test_a_repeated_prompt_takes_its_blocks_and_its_output_and_logprobs_stay(weights, request):
    """GGUF blocks give the same bits whichever pass computed a block; dense float32 weights go
    through PyTorch's matmul, whose sums depend on the pass's shape (as chunked prefill's do)."""
    model = request.getfixturevalue("gguf_target" if weights == "gguf" else "target_dir")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    on = make_engine(model, block_size=4)
    assert on.prefix_caching
    (first,) = drain(on, [SHARED[2]], params)
    (second,) = drain(on, [SHARED[2]], params)
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == (n - 1) // 4 * 4 > 0
    assert second.output_token_ids == first.output_token_ids
    off = make_engine(model, block_size=4, enable_prefix_caching=False)
    (plain,) = drain(off, [SHARED[2]], params)
    assert plain.output_token_ids == first.output_token_ids
    if weights == "gguf":
        assert second.output_logprobs == first.output_logprobs == plain.output_logprobs
    else:
        got = [e.logprob for e in second.output_logprobs]
        assert got == pytest.approx([e.logprob for e in first.output_logprobs], abs=1e-5)
    stats = on.stats()["prefix_cache"]
    assert stats["enabled"] and stats["cached_prompt_tokens"] == second.num_cached_tokens
    assert stats["hit_rate"] == round(second.num_cached_tokens / (2 * n), 4)
    assert off.stats()["prefix_cache"]["cached_prompt_tokens"] == 0


def test_samples_of_one_prompt_compute_it_once_and_follow_their_seeds(target_dir):
    sampled = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        engine = make_engine(target_dir, block_size=4, enable_prefix_caching=caching)
        requests = [engine.add_request(SHARED[0], dataclasses.replace(sampled, seed=s)) for s in range(4)]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        outs[caching] = [r.output_token_ids for r in requests], [r.num_cached_tokens for r in requests]
    n = len(engine.prompt_token_ids(SHARED[0]))
    cached = (n - 1) // 4 * 4
    assert outs[True][0] == outs[False][0] and len(set(map(tuple, outs[True][0]))) > 1
    # the first computes the prompt; the others wait a step for its blocks and take them
    assert outs[True][1] == [0, cached, cached, cached] and outs[False][1] == [0, 0, 0, 0]


def test_shared_prefixes_under_a_tight_budget_preempt_evict_and_keep_every_output(target_dir):
    plain = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    want = run_staggered(plain, SHARED + SHARED[:2], arrive_every=1)
    engine = make_engine(target_dir, kv_cache_memory_gb=128 * 512 / 2**30, block_size=4)
    assert engine.prefix_caching and engine.allocator.num_blocks * 4 == 128
    assert run_staggered(engine, SHARED + SHARED[:2], arrive_every=1) == want
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache"]["evicted_blocks"] > 0
    assert stats["prefix_cache"]["cached_prompt_tokens"] > 0 and engine.allocator.usage == 0.0


def test_a_second_turn_takes_the_first_turn_and_its_answer_from_the_cache(target_dir):
    engine = make_engine(target_dir, block_size=4)
    (turn1,) = drain(engine, [PROMPTS[3]])
    follow = turn1.all_token_ids + engine.prompt_token_ids(" and then")
    (turn2,) = drain(engine, [follow])
    assert turn2.num_cached_tokens == (len(turn1.all_token_ids) - 1) // 4 * 4  # the answer's blocks too
    off = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    (plain,) = drain(off, [follow])
    assert turn2.output_token_ids == plain.output_token_ids


def test_a_request_for_prompt_logprobs_computes_every_position(target_dir):
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    engine = make_engine(target_dir, block_size=4)
    drain(engine, [SHARED[1]])
    (scored,) = drain(engine, [SHARED[1]], params)
    off = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    (plain,) = drain(off, [SHARED[1]], params)
    assert scored.num_cached_tokens == 0 and scored.prompt_logprobs == plain.prompt_logprobs


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafts_with_cached_prefixes_equal_plain_decoding(target_dir, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    plain = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    want = run_staggered(plain, SHARED + SHARED, arrive_every=2)
    engine = make_engine(target_dir, block_size=4, speculative_config=spec)
    assert engine.prefix_caching
    assert run_staggered(engine, SHARED + SHARED, arrive_every=2) == want
    assert engine.stats()["prefix_cache"]["cached_prompt_tokens"] > 0


def test_a_draft_model_with_cached_prefixes_equals_plain_and_drafts_as_without(target_dir):
    """The drafter writes its K/V at indices of its own (a window of 12 closes them up inside the
    shared prompt blocks), so each request copies a shared block before its drafter writes there:
    every step's drafts are the ones made without the cache, and the output is plain decoding's."""
    plain = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    want = run_staggered(plain, SHARED + SHARED, arrive_every=2)
    for window in (12, 0):
        # the target drafts for itself: drafts from K/V another request wrote would miss
        spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
        spec |= {"draft_quantization": "none", "draft_context_window": window}
        drafts, cache = {}, {}
        for caching in (False, True):
            engine = make_engine(
                target_dir, block_size=4, speculative_config=spec, enable_prefix_caching=caching
            )
            assert engine.prefix_caching == caching
            drafts[caching] = record_drafts(engine.proposer)
            assert run_staggered(engine, SHARED + SHARED, arrive_every=2) == want
            cache[caching] = engine.stats()["prefix_cache"]
        assert drafts[True] == drafts[False] and len(drafts[True]) > 20
        assert cache[True]["cached_prompt_tokens"] > 0 and cache[True]["unshared_blocks"] > 0
        assert engine.allocator.num_shared == 0 and engine.allocator.usage == 0.0


def test_a_drafter_with_a_window_copies_a_long_shared_prompt_only_as_far_as_it_writes(target_dir):
    """Two requests on one long prompt: the second takes the first's prompt blocks from the cache,
    and its drafter (4 sinks and a window of 12) writes its first 16 indices, not the prompt's
    length: a few blocks are copied, not all of them shared."""
    long = SYSTEM * 3 + PROMPTS[0]
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
    spec["draft_context_window"] = 12
    plain = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    want = run_staggered(plain, [long, long], arrive_every=3)
    engine = make_engine(target_dir, block_size=4, speculative_config=spec)
    assert run_staggered(engine, [long, long], arrive_every=3) == want
    cache = engine.stats()["prefix_cache"]
    shared = cache["cached_prompt_tokens"] // 4
    assert shared >= 15 and 0 < cache["unshared_blocks"] < shared // 2


def test_a_drafting_request_without_a_block_for_its_copy_drafts_nothing_and_stays_lossless(target_dir):
    """No free block for a copy: the request drafts nothing that step (its drafter would write into
    a block another request shares); the others draft, and the output is plain decoding's."""
    plain = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    want = run_staggered(plain, SHARED + SHARED, arrive_every=2)
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
    drafted = {}
    for copies in (True, False):
        engine = make_engine(target_dir, block_size=4, speculative_config=spec)
        if not copies:
            engine.allocator.unshare = lambda block: None
        drafts = record_drafts(engine.proposer)
        assert run_staggered(engine, SHARED + SHARED, arrive_every=2) == want
        assert engine.stats()["prefix_cache"]["cached_prompt_tokens"] > 0
        drafted[copies] = sum(len(tokens) for step in drafts for _, tokens in step)
    assert 0 < drafted[False] < drafted[True]


def record_drafts(proposer) -> list:
    """Each step's draft tokens, as ``proposer.propose`` returns them (appended as it runs)."""
    steps, propose = [], proposer.propose

    def recorded(plan, sampling):
        drafts = propose(plan, sampling)
        rows = drafts.token_ids.tolist()
        steps.append([(r.request_id, row[:n]) for r, row, n in zip(plan.decodes, rows, drafts.draft_lens)])
        return drafts

    proposer.propose = recorded
    return steps


def test_an_eagle_head_leaves_prefix_caching_off_and_refuses_it(target_dir, tmp_path):
    """An EAGLE head reads the target's hidden states of every position, which a cached prefix
    skips computing."""
    head = write_head(tmp_path / "head", "eagle3", target_config(target_dir))
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    assert not make_engine(target_dir, speculative_config=spec).prefix_caching
    with pytest.raises(
        ValueError, match="enable_prefix_caching: not with speculative_config.method 'eagle3'"
    ):
        make_engine(target_dir, speculative_config=spec, enable_prefix_caching=True)


def test_prefix_caching_off_inside_a_block_empties_the_cache(target_dir):
    engine = make_engine(target_dir, block_size=4)
    drain(engine, [SHARED[0]])
    assert engine.allocator.num_cached_blocks > 0
    with engine.prefix_caching_off():
        (again,) = drain(engine, [SHARED[0]])
        assert not engine.prefix_caching and again.num_cached_tokens == 0
        assert engine.allocator.num_cached_blocks == 0
    assert engine.prefix_caching and engine.allocator.num_cached_blocks == 0


def test_a_preempted_request_takes_back_its_prompt_and_output_blocks(target_dir):
    engine = make_engine(target_dir, block_size=4)
    r = engine.add_request(SHARED[0], GREEDY)
    while len(r.output_token_ids) < 10:
        engine.step()
    engine.scheduler._preempt(r)  # as when a newer request's blocks run out
    tokens = r.num_tokens
    while engine.has_unfinished():
        engine.step()
    assert r.num_cached_tokens == (tokens - 1) // 4 * 4 > len(r.prompt_token_ids)
    off = make_engine(target_dir, block_size=4, enable_prefix_caching=False)
    (plain,) = drain(off, [SHARED[0]])
    assert r.output_token_ids == plain.output_token_ids
