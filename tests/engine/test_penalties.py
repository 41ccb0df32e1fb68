"""Penalties and logit bias stay lossless under speculation: greedy output equals plain output, and
sampled output follows the penalized target distribution at every position of the verify window."""

import numpy as np
import pytest
import torch
from support.engine import PROMPTS, make_engine, run_staggered
from support.sampling import sampling_rows
from support.stats import CHI2_CRIT, chi2

from dynaspec import SamplingParams
from dynaspec.engine.sampler import Penalties, SamplingTensors, apply_penalties, processed_probs
from dynaspec.engine.types import Drafts
from dynaspec.spec_decode.rejection import verify

PENALIZED = SamplingParams(
    max_tokens=24,
    temperature=0.0,
    ignore_eos=True,
    presence_penalty=0.4,
    frequency_penalty=0.6,
    repetition_penalty=1.3,
    logit_bias={7: 3.0, 40: -100.0},
)


@pytest.fixture(scope="module")
def plain(target_dir):
    return run_staggered(make_engine(target_dir), PROMPTS, PENALIZED)


def test_penalties_change_the_output(target_dir, plain):
    """(So the equality below has power.)"""
    unpenalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert run_staggered(make_engine(target_dir), PROMPTS, unpenalized) != plain


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        # the target drafting for itself, in its own weights (a CPU drafter's default is 4 bits)
        {
            "method": "draft_model",
            "model": "TARGET",
            "num_speculative_tokens": 4,
            "draft_quantization": "auto",
        },
        {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3},
    ],
)
def test_penalized_greedy_with_speculation_equals_plain(target_dir, draft_dir, plain, spec):
    spec = dict(spec)
    if "model" in spec:
        spec["model"] = str(target_dir if spec["model"] == "TARGET" else draft_dir)
    engine = make_engine(target_dir, speculative_config=spec)
    assert run_staggered(engine, PROMPTS, PENALIZED) == plain
    assert engine.stats()["spec"]["num_draft_tokens"] > 0
    if spec.get("model") == str(target_dir):  # the drafter sees the same penalties: it agrees
        assert engine.stats()["spec"]["acceptance_rate"] > 0.95


V, K, N = 6, 2, 12000


def _penalties(n: int, output: list[int]) -> Penalties:
    counts = torch.zeros(n, V)
    for t in output:
        counts[:, t] += 1
    return Penalties(
        presence=torch.full((n,), 0.5),
        frequency=torch.full((n,), 1.5),
        repetition=torch.full((n,), 1.2),
        output_counts=counts,
        prompt_mask=torch.zeros(n, V, dtype=torch.bool).index_fill_(1, torch.tensor([4]), True),
        logit_bias=torch.zeros(n, V).index_fill_(1, torch.tensor([5]), 1.0),
    )


def _sampling(penalties: Penalties) -> SamplingTensors:
    return sampling_rows([1.0] * N, penalties=penalties)


def _expected(target_logits, penalties_1, context_tokens) -> np.ndarray:
    """The penalized target distribution at one position, given the window tokens before it."""
    one = torch.ones(1)
    logits = apply_penalties(target_logits, penalties_1, context_tokens, first=context_tokens.shape[1])
    return processed_probs(logits, one, torch.zeros(1, dtype=torch.long), one)[0, 0].numpy()


@pytest.mark.parametrize("drafter", ["deterministic", "draft_model"])
def test_sampled_with_penalties_follows_the_penalized_target(drafter):
    gen = torch.Generator().manual_seed(2)
    # token 2 likely at both positions, so whether the window's first 2 is counted matters
    target_logits = torch.tensor(
        [[[0.5, 0.0, 1.5, 0.0, 0.2, 0.0], [0.0, 0.3, 2.0, 0.0, 0.0, 0.5], [0.1, 0.2, 0.3, 0.0, 0.0, 0.0]]]
    )
    output = [1, 3, 3]  # generated so far
    penalties = _penalties(N, output)
    if drafter == "deterministic":
        drafts = torch.tensor([[2, 0]]).expand(N, K)
    else:
        q_rows = torch.randn(K, V, generator=gen).softmax(-1)
        drafts = torch.stack([torch.multinomial(q_rows[i], N, True, generator=gen) for i in range(K)], 1)
    result = verify(target_logits.expand(N, K + 1, V), Drafts(drafts, [K] * N), _sampling(penalties))
    out = result.token_ids
    one = _penalties(1, output)
    empty = torch.zeros(1, 0, dtype=torch.long)
    first = np.bincount([o[0] for o in out], minlength=V)
    assert chi2(first, _expected(target_logits[:, :1], one, empty)) < CHI2_CRIT
    # the second token, among rows that accepted draft token 2 first, counts that 2 as context
    second = np.bincount(
        [o[1] for o, d in zip(out, drafts.tolist()) if len(o) > 1 and o[0] == d[0] == 2], minlength=V
    )
    assert second.sum() > 500
    with_window = _expected(target_logits[:, 1:2], one, torch.tensor([[2]]))
    assert chi2(second, with_window) < CHI2_CRIT
    # power: the distribution that forgets the window's draft token is rejected
    assert chi2(second, _expected(target_logits[:, 1:2], one, empty)) > CHI2_CRIT


def test_unpenalized_rows_keep_their_logits_bit_for_bit():
    logits = torch.randn(2, 3, V)
    p = _penalties(2, [1])
    p.presence[1], p.frequency[1], p.repetition[1] = 0.0, 0.0, 1.0
    p.logit_bias[1] = 0.0
    out = apply_penalties(logits, p, torch.tensor([[1, 2], [1, 2]]))
    assert torch.equal(out[1], logits[1]) and not torch.equal(out[0], logits[0])
