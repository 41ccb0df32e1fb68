"""Log-probabilities are the target's raw ones, identical with and without speculation, and prompt
scoring (prompt_logprobs, max_tokens 0) matches the model's own forward pass."""

import pytest
import torch
from support.engine import PROMPTS, make_engine
from support.tiny import dynaspec_logits, load_hf_dir

from dynaspec import SamplingParams

SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": "draft",  # the target itself as drafter: most drafts are accepted
}


def run(engine, prompts, params):
    requests = []
    for i, p in enumerate(prompts):
        requests.append(engine.add_request(p, params))
        if i % 2:
            engine.step()  # later prompts join a running batch
    while engine.has_unfinished():
        engine.step()
    return requests


def spec_of(name, target_dir):
    spec = SPECS[name]
    if spec == "draft":
        return {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
    return spec


@pytest.fixture(scope="module")
def plain_runs(target_dir):
    out = {}
    for kind, params in PARAMS.items():
        out[kind] = run(make_engine(target_dir), PROMPTS, params)
    return out


PARAMS = {
    "greedy": SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=4),
    "sampled": SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_logprobs_equal_with_and_without_speculation(target_dir, plain_runs, method, kind):
    engine = make_engine(target_dir, speculative_config=spec_of(method, target_dir))
    spec = run(engine, PROMPTS, PARAMS[kind])
    stats = engine.stats()["spec"]
    assert stats["num_draft_tokens"] > 0
    if kind == "greedy" or method == "draft_model":  # accepted drafts' logprobs came from verify windows
        assert stats["num_accepted_tokens"] > 0
    for a, b in zip(plain_runs[kind], spec):
        if kind == "greedy":
            assert a.output_token_ids == b.output_token_ids
        n = len(b.output_token_ids)
        assert len(b.output_logprobs) == n
        same = 0  # sampled runs diverge (other random draws); compare while the tokens agree
        while same < n and a.output_token_ids[same] == b.output_token_ids[same]:
            same += 1
        for x, y in zip(a.output_logprobs[:same], b.output_logprobs[:same]):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)


def test_greedy_logprobs_are_the_model_forward(target_dir):
    """Each greedy token's logprob is log_softmax of a full forward over prompt + output, rank 1."""
    engine = make_engine(target_dir)
    (r,) = run(engine, PROMPTS[:1], PARAMS["greedy"])
    config, weights, _ = load_hf_dir(target_dir)
    ids = r.prompt_token_ids + r.output_token_ids
    logp = dynaspec_logits(config, weights, ids).log_softmax(-1)
    p = len(r.prompt_token_ids)
    for j, (token, entry) in enumerate(zip(r.output_token_ids, r.output_logprobs)):
        assert entry.rank == 1 and entry.top[0][0] == token
        assert entry.logprob == pytest.approx(float(logp[p - 1 + j, token]), abs=1e-4)
        assert len(entry.top) == 4


@pytest.mark.parametrize("chunk", [512, 5])
def test_prompt_scoring_matches_the_model_forward(target_dir, chunk):
    """max_tokens 0 + prompt_logprobs: log-probabilities of every prompt token but the first, also
    when the prompt is prefilled in chunks, and nothing is generated."""
    engine = make_engine(target_dir, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    requests = run(engine, PROMPTS, params)
    config, weights, _ = load_hf_dir(target_dir)
    for r in requests:
        assert r.output_token_ids == [] and r.finish_reason.value == "length"
        ids = r.prompt_token_ids
        logp = dynaspec_logits(config, weights, ids).log_softmax(-1)
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ids)
        got = torch.tensor([e.logprob for e in r.prompt_logprobs[1:]])
        want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert all(len(e.top) == 2 for e in r.prompt_logprobs[1:])
    assert engine.allocator.usage == 0.0
