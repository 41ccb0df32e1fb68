"""Suffix decoding: the trees' counts and drafts on hand-made sequences, the shared tree and its
cache of finished outputs, and lossless speculation on the tiny model."""

import collections
import copy
import random

import pytest
from support.engine import GREEDY, PROMPTS, make_engine, run_alone, run_staggered
from support.kpolicy import RaggedK

from dynaspec import SamplingParams
from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.spec_decode.suffix_tree import SuffixIndex, SuffixTree


def substring_counts(seqs, max_depth):
    counts = collections.Counter()
    for s in seqs:
        for p in range(len(s)):
            for d in range(1, min(max_depth, len(s) - p) + 1):
                counts[tuple(s[p : p + d])] += 1
    return counts


def assert_counts(tree, seqs, rng, vocab):
    expected = substring_counts(seqs, tree.max_depth)
    for pattern, n in expected.items():
        assert tree.count(pattern) == n, pattern
    for _ in range(30):  # and patterns that may not occur
        pattern = [rng.randrange(vocab + 1) for _ in range(rng.randint(1, tree.max_depth))]
        assert tree.count(pattern) == expected.get(tuple(pattern), 0)


@pytest.mark.parametrize("seed", range(4))
def test_token_by_token_updates_count_what_a_rebuild_counts(seed):
    """Sequences grown a few tokens at a time, interleaved, then removed one by one: every substring
    up to the depth is counted as a tree built from the whole sequences counts it, and a tree whose
    sequences are all gone holds nothing."""
    rng = random.Random(seed)
    for _ in range(40):
        depth, vocab = rng.randint(2, 7), rng.randint(1, 4)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(1, 4))]
        grown, rebuilt = SuffixTree(depth), SuffixTree(depth)
        for i, s in enumerate(seqs):
            grown.add(i)
            rebuilt.add(i, s)
        done = [0] * len(seqs)
        while any(d < len(s) for d, s in zip(done, seqs)):
            i = rng.randrange(len(seqs))
            n = rng.randint(1, 3)
            grown.extend(i, seqs[i][done[i] : done[i] + n])
            done[i] = min(len(seqs[i]), done[i] + n)
        assert grown.num_nodes == rebuilt.num_nodes and grown.num_tokens == rebuilt.num_tokens
        assert_counts(grown, seqs, rng, vocab)
        live = list(range(len(seqs)))
        rng.shuffle(live)
        while live:
            grown.remove(live.pop())
            assert_counts(grown, [seqs[i] for i in live], rng, vocab)
        assert grown.num_nodes == 0 and grown.num_tokens == 0 and not grown.root.children


def branches(node):
    yield node
    for child in node.children.values():
        if type(child) is type(node):
            yield from branches(child)


@pytest.mark.parametrize("seed", range(4))
def test_the_best_children_kept_per_token_are_those_a_scan_finds(seed):
    """Each branch keeps its most frequent child (the first seen among equals) as sequences grow and
    go, so that drafting never scans: it is the one a scan of the children finds, and drafts equal
    those of a copy of the tree that forgot them all (and scans each branch it drafts through)."""
    rng = random.Random(seed)
    for _ in range(30):
        depth, vocab = rng.randint(2, 5), rng.randint(1, 3)
        tree = SuffixTree(depth)
        live, next_id = [], 0
        for _ in range(60):
            if rng.random() < 0.2 or not live:
                tree.add(next_id, [rng.randrange(vocab) for _ in range(rng.randint(0, 6))])
                live.append(next_id)
                next_id += 1
            elif rng.random() < 0.7:
                tree.extend(rng.choice(live), [rng.randrange(vocab) for _ in range(rng.randint(1, 3))])
            else:
                tree.remove(live.pop(rng.randrange(len(live))))
            for node in branches(tree.root):
                if node.best is not None:
                    count = {t: getattr(child, "count", 1) for t, child in node.children.items()}
                    assert node.best == max(count, key=count.get)
            scanned = copy.deepcopy(tree)
            for node in branches(scanned.root):
                node.best = None
            for i in live:
                for k in (1, 3):
                    assert tree.speculate(i, k, 2.0, 0.0) == scanned.speculate(i, k, 2.0, 0.0)


def test_drafts_continue_the_longest_earlier_match_by_frequency():
    tree = SuffixTree(8)
    tree.add("a", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2])
    spec = tree.speculate("a", 4, max_spec_factor=2.0, min_token_prob=0.1)
    # "1 2" occurred 3 times before: always then 3 (3/3), then 4 twice and 5 once (2/3), then 1 or 9
    assert spec.match_len == 2
    assert spec.tokens == [3, 4, 1, 2]
    assert spec.probs == pytest.approx([1.0, 2 / 3, 1 / 2, 1.0])
    assert spec.score == pytest.approx(1 + 2 / 3 + 1 / 3 + 1 / 3)
    # the cumulative probability stops it; the spec factor and the depth bound its length
    assert tree.speculate("a", 4, 2.0, min_token_prob=0.4).tokens == [3, 4]
    assert tree.speculate("a", 4, max_spec_factor=0.5, min_token_prob=0.1).tokens == [3]
    shallow = SuffixTree(3)
    shallow.add("a", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2])
    spec = shallow.speculate("a", 4, 2.0, 0.1)  # match + draft <= 3: a match of 1 ("2")
    assert spec.match_len == 1 and spec.tokens == [3, 4]


def test_no_draft_without_an_earlier_continuation():
    tree = SuffixTree(8)
    tree.add("a", [5, 6, 7, 8])
    assert tree.speculate("a", 4, 1.0, 0.1).tokens == []
    tree.add("b", [5, 6, 7, 8])  # the same tokens, in lockstep: neither has a continuation yet
    assert tree.speculate("a", 4, 1.0, 0.1).tokens == []
    tree.extend("b", [9])
    assert tree.speculate("a", 4, 4.0, 0.1).tokens == [9]


def test_a_request_drafts_what_a_live_request_with_its_prompt_generated():
    index = SuffixIndex(max_depth=16, max_cached_requests=10, max_cached_tokens=1000)
    prompt = list(range(100, 130))
    output = [7, 3, 9, 4, 4, 8, 1, 6, 2, 5]
    index.add("first", prompt)
    index.extend("first", output)
    index.add("second", prompt)  # no output yet: its prompt's end continues as the first's did
    spec = index.speculate("second", 5, max_spec_factor=1.0, min_token_prob=0.1)
    assert spec.tokens == output[:5] and spec.probs == [1.0] * 5
    index.extend("second", output[:6])
    assert index.speculate("second", 4, 1.0, 0.1).tokens == output[6:10]
    index.add("other", list(range(200, 230)))  # another prompt: nothing to draft from
    assert index.speculate("other", 5, 1.0, 0.1).tokens == []


def test_finished_outputs_stay_within_the_budget_least_recently_used_first():
    index = SuffixIndex(max_depth=8, max_cached_requests=100, max_cached_tokens=60)
    rng = random.Random(0)
    prompts = {name: [rng.randrange(1000) for _ in range(12)] for name in "abcd"}
    outputs = {name: [rng.randrange(1000) for _ in range(13)] for name in "abcd"}  # 7 + 13 = 20 tokens each
    for name in "abc":
        index.add(name, prompts[name], outputs[name])
        index.finish(name)
    assert index.stats()["cached_requests"] == 3 and index.cached_tokens == 60
    index.add("a2", prompts["a"])  # a's prompt again: a becomes the most recently used
    assert index.speculate("a2", 4, 1.0, 0.1).tokens == outputs["a"][:4]
    index.add("d", prompts["d"], outputs["d"])
    index.finish("d")  # over budget: b (least recently used) goes, a stays
    stats = index.stats()
    assert stats["cached_requests"] == 3 and stats["cached_tokens"] <= 60
    index.add("b2", prompts["b"])
    assert index.speculate("b2", 4, 1.0, 0.1).tokens == []
    index.add("c2", prompts["c"])
    assert index.speculate("c2", 4, 1.0, 0.1).tokens == outputs["c"][:4]
    for name in ("a2", "b2", "c2"):
        index.drop(name)
    assert index.shared.num_tokens == index.cached_tokens  # live requests leave nothing behind
    for i in range(20):  # a stream of finished requests: memory stays bounded
        index.add(i, [rng.randrange(1000) for _ in range(10)], [rng.randrange(50) for _ in range(25)])
        index.finish(i)
        assert index.cached_tokens <= 60 and index.shared.num_tokens == index.cached_tokens
    nothing = SuffixIndex(max_depth=8, max_cached_requests=0, max_cached_tokens=60)
    nothing.add("a", prompts["a"], outputs["a"])
    nothing.finish("a")
    assert nothing.stats() == {
        "live_requests": 0,
        "cached_requests": 0,
        "cached_tokens": 0,
        "tree_tokens": 0,
        "tree_nodes": 0,
    }


@pytest.mark.parametrize(
    "change, field",
    [
        ({"method": "ngram", "suffix_decoding_max_tree_depth": 16}, "suffix_decoding_max_tree_depth"),
        (
            {"method": "draft_model", "model": "x", "suffix_decoding_min_token_prob": 0.2},
            "suffix_decoding_min_token_prob",
        ),
        ({"suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"suffix_decoding_max_cached_tokens": "many"}, "suffix_decoding_max_cached_tokens"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
        ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
        ({"model": "x"}, "model"),
    ],
)
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=rf"^speculative_config\.{field}:"):
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 5} | change)


def test_config_defaults_are_vllm_s():
    spec = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 5})
    assert spec.suffix[:2] == (24, 10000) and spec.suffix[3:] == (1.0, 0.1)
    spec = SpeculativeConfig.parse(
        {"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_cached_requests": 0}
    )
    assert spec.suffix.max_cached_requests == 0 and SpeculativeConfig.parse(spec.to_dict()) == spec


# ---- the engine on the tiny model ----------------------------------------------------------------
SIBLINGS = [PROMPTS[0]] * 3 + [PROMPTS[3]] + [PROMPTS[0]]  # n samples of one prompt, and strays


@pytest.fixture(scope="module")
def plain(target_dir):
    return run_alone(target_dir, PROMPTS)


def siblings_plain(plain):
    """Plain greedy outputs of SIBLINGS."""
    return [plain[0]] * 3 + [plain[3], plain[0]]


def suffix_engine(target_dir, k, options=None, **kw):
    spec = {"method": "suffix", "num_speculative_tokens": k} | (options or {})
    return make_engine(target_dir, speculative_config=spec, **kw)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_with_staggered_arrivals(target_dir, plain, k):
    engine = suffix_engine(target_dir, k)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert engine.stats()["spec"]["num_draft_tokens"] > 0
    assert engine.allocator.usage == 0.0


def test_identical_prompts_draft_from_each_other_and_equal_plain(target_dir, plain):
    engine = suffix_engine(target_dir, 5)
    outs = run_staggered(engine, SIBLINGS, arrive_every=3)
    assert outs == siblings_plain(plain)
    spec = engine.stats()["spec"]
    # a later sample of one prompt drafts what those ahead of it generated, until it catches up
    # with them (in lockstep, none of them has a continuation yet)
    assert spec["num_accepted_tokens"] >= GREEDY.max_tokens
    engine.add_request(PROMPTS[1], GREEDY)  # the next step releases the last finished requests
    while engine.has_unfinished():
        engine.step()
    stats = engine.proposer.stats()  # that one finished, unreleased: still live
    assert stats["cached_requests"] == len(SIBLINGS) and stats["live_requests"] == 1
    # each output after its prompt's last max_tree_depth - 1 tokens
    tails = sum(min(23, len(engine.prompt_token_ids(p))) for p in SIBLINGS)
    assert stats["cached_tokens"] == tails + len(SIBLINGS) * GREEDY.max_tokens


def test_a_finished_output_is_drafted_for_the_same_prompt_later(target_dir, plain):
    engine = suffix_engine(target_dir, 5)
    assert run_staggered(engine, [PROMPTS[2], PROMPTS[1]], arrive_every=100) == [plain[2], plain[1]]
    before = engine.stats()["spec"]["num_accepted_tokens"]
    assert run_staggered(engine, [PROMPTS[2]]) == [plain[2]]
    assert engine.stats()["spec"]["num_accepted_tokens"] - before >= GREEDY.max_tokens - 6
    engine.proposer.reset()  # what benchmarks do between configurations: the cache is gone
    assert engine.stats()["spec"]["proposer"]["cached_requests"] == 0
    before = engine.stats()["spec"]["num_accepted_tokens"]
    assert run_staggered(engine, [PROMPTS[2]]) == [plain[2]]
    assert engine.stats()["spec"]["num_accepted_tokens"] - before < GREEDY.max_tokens - 6


SAMPLED = [
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True)
    for s in (11, 11, 12, 13, 11)
]


@pytest.fixture(scope="module")
def plain_sampled(target_dir):
    return [run_alone(target_dir, [p], params)[0] for p, params in zip(SIBLINGS, SAMPLED)]


@pytest.mark.parametrize("k", [2, 5])
def test_seeded_sampled_equals_plain_sampled(target_dir, plain_sampled, k):
    """Suffix drafts are deterministic, as n-gram drafts: a seeded sampled request emits the tokens
    plain decoding draws, identical prompts with their own seeds included."""
    prompts, params = SIBLINGS, SAMPLED
    engine = suffix_engine(target_dir, k)
    requests = []
    for step in range(1000):
        if step % 2 == 0 and len(requests) < len(prompts):
            requests.append(engine.add_request(prompts[len(requests)], params[len(requests)]))
        if not engine.has_unfinished() and len(requests) == len(prompts):
            break
        engine.step()
    assert [r.output_token_ids for r in requests] == plain_sampled
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("min_confidence", [0.0, 0.7])
def test_ragged_per_request_k_with_confidence_stops_equals_plain(target_dir, plain, min_confidence):
    engine = suffix_engine(target_dir, 5, {"suffix_decoding_min_token_prob": 0.0})
    policy = RaggedK(min_confidence)
    engine.set_k_policy(policy)
    assert run_staggered(engine, SIBLINGS + PROMPTS, arrive_every=2) == siblings_plain(plain) + plain
    assert any(len(set(lens)) > 1 for lens in policy.draft_lens)
    assert all(d <= c for lens, caps in zip(policy.draft_lens, policy.k_caps) for d, c in zip(lens, caps))


@pytest.mark.parametrize("static_decode", [False, True])
def test_preempted_requests_start_again_and_equal_plain(target_dir, plain, static_decode):
    """Room for 64 tokens: requests wait and are preempted (forgotten, then followed again from
    their prompt and output), on the varlen and the fixed-shape step."""
    engine = suffix_engine(
        target_dir, 4, kv_cache_memory_gb=64 * 512 / 2**30, block_size=4, static_decode=static_decode
    )
    assert run_staggered(engine, SIBLINGS + PROMPTS, arrive_every=1) == siblings_plain(plain) + plain
    assert engine.scheduler.num_preemptions > 0 and engine.allocator.usage == 0.0
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0


def test_goodput_prices_its_host_time_and_stays_lossless(tmp_path, target_dir, plain):
    from dynaspec.kpolicy.profile import Profile, save_profile

    stats = {bs: {k: 50.0 + 5 * bs + (2 + bs) * k for k in range(4)} for bs in (1, 2, 4, 8)}
    save_profile(Profile(3, [0.8, 0.6, 0.45], stats), tmp_path / "p.json")
    options = {"dynamic_config_path": str(tmp_path / "p.json"), "draft_confidence_threshold": "auto"}
    engine = suffix_engine(target_dir, 3, options)
    with engine.recording() as recording:
        outs = run_staggered(engine, SIBLINGS, arrive_every=2)
    assert outs == siblings_plain(plain)
    passes = [p for t in recording.timings for p in t.draft_passes]
    assert passes and all(p.ms > 0 and p.rows > 0 for p in passes)  # the host time, as passes
    snapshot = engine.stats()["spec"]["policy"]
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0
    assert 0.0 <= snapshot["min_draft_confidence"] <= 0.8
