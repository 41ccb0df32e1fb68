"""Decode steps on fixed shapes (engine/static_pass.py), eagerly on the CPU: the very code a CUDA
graph records. Greedy output equals the varlen step's, token for token (float32), for plain decoding,
draft_model and ngram, ragged per-request K with confidence stops, staggered arrivals and
preemption; seeded sampling is the same with and without it."""

import random

import pytest
import torch
from support.engine import PROMPTS, make_engine, run_alone, run_staggered
from support.kpolicy import RaggedK

from dynaspec import SamplingParams
from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.goodput import EVERY_N_UP_TO, GoodputK
from dynaspec.kpolicy.profile import Profile
from dynaspec.models.attention import build_attention_metadata, paged_attention


@pytest.fixture(scope="module")
def plain(target_dir):
    return run_alone(target_dir, PROMPTS)


def static_engine(target_dir, spec=None, **kw):
    return make_engine(target_dir, speculative_config=spec, static_decode=True, **kw)


def test_plain_decoding_on_fixed_shapes_equals_the_varlen_step(target_dir, plain):
    engine = static_engine(target_dir)
    assert engine.runner.static is not None
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["draft_model", "ngram", "self"])
def test_speculation_on_fixed_shapes_equals_plain(target_dir, draft_dir, plain, method, k):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    if method == "self":  # the target drafting for itself: long accepted runs, catch-up of 2 tokens
        spec = {
            "method": "draft_model",
            "model": str(target_dir),
            "num_speculative_tokens": k,
            "draft_quantization": "auto",
        }
    engine = static_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    stats = engine.stats()["spec"]
    assert stats["num_draft_tokens"] > 0
    if method == "self":
        assert stats["acceptance_rate"] > 0.9
    assert engine.allocator.usage == 0.0


@pytest.mark.parametrize("min_confidence", [0.0, 0.2])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_ragged_k_and_confidence_stops_on_fixed_shapes_equal_plain(
    target_dir, draft_dir, plain, method, min_confidence
):
    spec = {"method": method, "num_speculative_tokens": 5}
    spec |= {"model": str(target_dir)} if method == "draft_model" else {"prompt_lookup_min": 1}
    engine = static_engine(target_dir, spec)
    policy = RaggedK(min_confidence)
    engine.set_k_policy(policy)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert any(len(set(lens)) > 1 for lens in policy.draft_lens), "no ragged step"
    if method == "draft_model":  # the confidence stop is decided on the device, its lengths come back
        drafted, asked = sum(map(sum, policy.draft_lens)), sum(map(sum, policy.k_caps))
        assert drafted < asked if min_confidence else drafted == asked


def test_preemption_on_fixed_shapes_equals_plain(target_dir, plain):
    spec = {
        "method": "draft_model",
        "model": str(target_dir),
        "num_speculative_tokens": 4,
        "draft_quantization": "auto",
    }
    engine = static_engine(target_dir, spec, kv_cache_memory_gb=64 * 1024 / 2**30, block_size=4)  # 64 tokens
    assert run_staggered(engine, PROMPTS, arrive_every=1) == plain
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.usage == 0.0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_is_the_same_on_fixed_shapes(target_dir, draft_dir, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= {"model": str(draft_dir)} if method == "draft_model" else {"prompt_lookup_min": 1}
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    outs = [
        run_staggered(make_engine(target_dir, speculative_config=spec, static_decode=on), PROMPTS, params)
        for on in (False, True)
    ]
    assert outs[0] == outs[1]


def test_batched_prefill_groups_attend_as_one_group_per_chunk():
    torch.manual_seed(0)
    q_lens, ctx_lens = [1, 40, 3, 50, 64, 20, 33], [30, 40, 60, 50, 100, 20, 90]
    tables = [[j * 16 + t for t in range(16)] for j in range(len(q_lens))]
    n, heads, kv_heads, dim = sum(q_lens), 4, 2, 32
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    caches = torch.randn(2, 16 * 8 * len(q_lens), kv_heads, dim)
    outs = []
    for batched in (False, True):
        meta = build_attention_metadata(
            q_lens, ctx_lens, tables, 8, torch.device("cpu"), batch_prefills=batched
        )
        outs.append(paged_attention(q, k, v, caches[0].clone(), caches[1].clone(), meta))
        assert len(meta.groups) == (6 if not batched else 5)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_pricing_the_counts_where_goodput_can_peak_chooses_as_pricing_every_count(monkeypatch):
    """Beyond EVERY_N_UP_TO requests the policy prices only the counts where the goodput can peak
    (peak_counts): its choice equals the choice over every count."""
    from dynaspec.kpolicy import goodput as module

    rng = random.Random(0)
    for trial in range(40):
        max_k = rng.randint(1, 5)
        alpha = sorted((rng.uniform(0.2, 0.95) for _ in range(max_k)), reverse=True)
        stats = {
            bs: {k: 10 + 0.2 * bs + (0.5 + 0.05 * bs * rng.uniform(0.5, 2)) * k for k in range(max_k + 1)}
            for bs in (1, 8, 64, 256)
        }
        profile = Profile(max_k, alpha, stats)
        bs = rng.randint(EVERY_N_UP_TO + 1, 256)
        unseen = [rng.choice([1, 1, 1, 30, 200]) for _ in range(bs)]
        candidates = [
            DraftCandidate(u, rng.randint(2, 300), 100, 300, rng.random() > 0.1, str(i))
            for i, u in enumerate(unseen)
        ]
        chosen = []
        for every in (EVERY_N_UP_TO, 10**6):
            monkeypatch.setattr(module, "EVERY_N_UP_TO", every)
            policy = GoodputK(profile, max_k, 1, per_request=False, min_confidence=0.0)
            chosen.append(policy.choose(candidates))
        assert chosen[0] == chosen[1], trial
