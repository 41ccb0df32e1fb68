"""The decode step on fixed shapes, replayed as CUDA graphs (CUDA only: skipped elsewhere).

Greedy output with graphs equals the varlen path's, plain and speculative, and a replayed step
makes no host sync but its one planned wait (``torch.cuda.set_sync_debug_mode("error")``).
"""

import pytest
import torch
from support.engine import run_staggered
from support.tiny import cached_tiny_model_dir

from dynaspec import SamplingParams
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.models import fused_ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import torch\nx = torch.zeros(4, 8)\n", "class A:"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return cached_tiny_model_dir(root, arch="qwen2", seed=0, num_layers=2), cached_tiny_model_dir(
        root, arch="qwen2", seed=1, num_layers=1
    )


def engine(path, **kw) -> Engine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_gb", 0.05)
    kw.setdefault("max_num_seqs", 8)
    return Engine(EngineConfig(model=str(path), device="cuda", progress=False, **kw))


def run(e: Engine) -> list[list[int]]:
    return run_staggered(e, PROMPTS, GREEDY, arrive_every=2)


@pytest.mark.parametrize("method", ["none", "draft_model", "self", "ngram"])
def test_graphs_give_the_varlen_paths_greedy_tokens(dirs, method):
    target, draft = dirs
    spec = {
        "none": None,
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        "self": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    }[method]
    plain = run(engine(target, static_decode=False))
    graphed = engine(target, speculative_config=spec)
    assert graphed.graph_stats["graphs"] > 0
    assert run(graphed) == plain
    assert graphed.allocator.usage == 0.0
    if method == "self":
        assert graphed.stats()["spec"]["acceptance_rate"] > 0.9


def test_a_replayed_step_makes_no_host_sync(dirs):
    target, _ = dirs
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    e = engine(target, speculative_config=spec)
    requests = [
        e.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for p in PROMPTS
    ]
    while not all(r.is_decoding for r in requests):
        e.step()
    for _ in range(3):  # drafter caught up: steady state
        e.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            e.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_sampled_speculation_on_cuda_emits_plain_decodings_tokens(dirs, method):
    """Sampled rows verify on the device (one copy back) and draw at (seed, output position): a
    seeded request emits on CUDA what plain decoding on CUDA emits, at K = 4, joining a batch."""
    target, draft = dirs
    spec = {
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    }[method]
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    plain = run_staggered(engine(target, static_decode=False), PROMPTS, params, arrive_every=2)
    e = engine(target, speculative_config=spec)
    assert run_staggered(e, PROMPTS, params, arrive_every=2) == plain
    assert e.stats()["spec"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["draft_model", "self"])
def test_bf16_greedy_speculation_equals_plain(dirs, method, monkeypatch):
    """In bfloat16 too, with ``batch_invariant``: the fixed-shape step's kernels round each row the
    same whatever the rows beside it (few-row projections in 16-row tiles, attention splits at
    fixed key positions), so a verify pass of K + 1 rows a request computes a plain step's
    numbers. The prompts arrive together: one prefill, then fixed-shape steps only (a mixed step's
    cuBLAS is not row invariant)."""
    monkeypatch.setattr(fused_ops, "BATCH_INVARIANT", False)  # the engines set it; put back after
    target, draft = dirs
    drafter = str(draft if method == "draft_model" else target)
    spec = {"method": "draft_model", "model": drafter, "num_speculative_tokens": 4}

    def together(e: Engine) -> list[list[int]]:
        requests = [e.add_request(p, GREEDY) for p in PROMPTS]
        while e.has_unfinished():
            e.step()
        return [r.output_token_ids for r in requests]

    plain = together(engine(target, dtype="bfloat16", batch_invariant=True))
    e = engine(target, dtype="bfloat16", speculative_config=spec, batch_invariant=True)
    assert together(e) == plain
    assert e.stats()["spec"]["num_draft_tokens"] > 0
