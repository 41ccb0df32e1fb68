"""The rejection sampler preserves the target distribution (chi-square on a tiny vocabulary)."""

import numpy as np
import pytest
import torch
from support.stats import CHI2_CRIT, chi2

from dynaspec.engine.sampler import SamplingTensors, processed_probs, sample_from
from dynaspec.spec_decode.ngram import ngram_lookup
from dynaspec.spec_decode.rejection import rejection_sample

V, K, N = 6, 2, 12000


def _sampling(n: int, temperature=1.0, top_k=0, top_p=1.0) -> SamplingTensors:
    """n sampled rows alike, row i seeded with i."""
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), top_p),
        generators=[torch.Generator().manual_seed(i) for i in range(n)],
        all_greedy=False,
    )


def _run(target_logits, draft_probs, draft_tokens, temperature=1.0, top_k=0, top_p=1.0):
    sampling = _sampling(N, temperature, top_k, top_p)
    logits = target_logits.expand(N, K + 1, V)
    out = rejection_sample(logits, draft_tokens, [K] * N, draft_probs, sampling)
    p = processed_probs(target_logits, sampling.temperature[:1], sampling.top_k[:1], sampling.top_p[:1])[0]
    return out, p.numpy()


def _draws(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # q: [K, V] -> [N, K]
    return torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(K)], dim=1)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.8)])
def test_draft_model_rejection_preserves_target_distribution(top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    draft_logits = torch.randn(1, K, V, generator=gen) * 1.5
    q = processed_probs(draft_logits, torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]))[
        0
    ]  # [K, V]
    drafts = _draws(q, gen)
    out, p = _run(target_logits, q.expand(N, K, V), drafts, top_k=top_k, top_p=top_p)
    first = np.bincount([o[0] for o in out], minlength=V)
    assert chi2(first, p[0]) < CHI2_CRIT
    # the second token, among rows that accepted the first draft, follows p[1]
    second = np.bincount(
        [o[1] for o, d in zip(out, drafts.tolist()) if len(o) > 1 and o[0] == d[0]], minlength=V
    )
    assert second.sum() > 1000
    assert chi2(second, p[1]) < CHI2_CRIT


def test_deterministic_drafts_rejection_preserves_target_distribution():
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    drafts = torch.tensor([[2, 3]]).expand(N, K)  # n-gram style: q is one-hot
    out, p = _run(target_logits, None, drafts)
    assert chi2(np.bincount([o[0] for o in out], minlength=V), p[0]) < CHI2_CRIT
    assert abs(np.mean([o[0] == 2 for o in out]) - p[0][2]) < 0.02  # draft x is kept with p(x)
    second = np.bincount([o[1] for o in out if len(o) > 1], minlength=V)  # after the first was kept
    assert second.sum() > 1000
    assert chi2(second, p[1]) < CHI2_CRIT


def test_deterministic_drafts_take_plain_decodings_draws():
    """Each emitted token is the sample plain decoding would draw there from the same generator."""
    gen = torch.Generator().manual_seed(2)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    n = 400
    sampling = _sampling(n)
    drafts = torch.randint(0, V, (n, K), generator=gen)
    out = rejection_sample(target_logits.expand(n, K + 1, V), drafts, [K] * n, None, sampling)
    p = processed_probs(target_logits, sampling.temperature[:1], sampling.top_k[:1], sampling.top_p[:1])[0]
    for i, emitted in enumerate(out):
        plain = torch.Generator().manual_seed(i)
        assert emitted == [sample_from(p[j], plain) for j in range(len(emitted))]
        kept = len(emitted) - 1
        assert emitted[:kept] == drafts[i, :kept].tolist()
        assert kept == K or emitted[kept] != drafts[i, kept]
    assert any(len(o) > 1 for o in out) and any(len(o) == 1 for o in out)


def test_a_wrong_acceptance_rule_would_be_caught():
    """The same statistic rejects a sampler that accepts drafts blindly (so the test has power)."""
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    draft_logits = torch.randn(1, K, V, generator=gen) * 1.5
    q = processed_probs(draft_logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))[0]
    drafts = _draws(q, gen)
    p = processed_probs(target_logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))[
        0
    ].numpy()
    blind = np.bincount(drafts[:, 0].numpy(), minlength=V)
    assert chi2(blind, p[0]) > CHI2_CRIT


def test_greedy_rows_accept_while_equal_to_argmax():
    logits = torch.full((2, 4, 5), -5.0)
    for b, best in enumerate([[1, 2, 3, 4], [0, 0, 0, 0]]):
        for i, t in enumerate(best):
            logits[b, i, t] = 5.0
    drafts = torch.tensor([[1, 2, 0], [0, 0, 0]])
    sampling = SamplingTensors(
        torch.zeros(2),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        [torch.Generator(), torch.Generator()],
        True,
    )
    out = rejection_sample(logits, drafts, [3, 1], None, sampling)
    assert out == [[1, 2, 3], [0, 0]]


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    p = processed_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))[0, 0]
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = processed_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.85]))[0, 0]
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    g = processed_probs(logits, torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1))[0, 0]
    assert g.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_ngram_lookup_prefers_longest_latest_match():
    toks = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert ngram_lookup(toks, 1, 3, 3) == [9, 2, 6]  # "6 7" last seen before 9
    assert ngram_lookup(np.array([1, 2, 3]), 1, 3, 2) == []
    assert ngram_lookup(np.array([4, 2, 4]), 1, 2, 5) == [2, 4]


def _ragged_draws(q0, q1_of, caps, threshold, stop_on_token, gen):
    """Drafts of N rows with caps K_r in {0, 1, 2}: draft 0 from q0, draft 1 from q1_of[draft 0],
    cut by a confidence stop: decided on the distribution (max q1 < threshold, as the drafter does) or,
    wrongly, on the token drawn (q1(draft 1) < threshold)."""
    d0 = torch.multinomial(q0, N, replacement=True, generator=gen)
    d1 = torch.stack([torch.multinomial(q1_of[int(x)], 1, generator=gen)[0] for x in d0])
    probs = torch.stack([torch.stack([q0, q1_of[int(x)]]) for x in d0])  # [N, 2, V]
    lens = []
    for r in range(N):
        confident = (q1_of[int(d0[r])][d1[r]] if stop_on_token else q1_of[int(d0[r])].max()) >= threshold
        lens.append(min(caps[r], 2 if confident else 1))
    return torch.stack([d0, d1], dim=1), probs, lens


@pytest.mark.parametrize("stop_on_token", [False, True])
def test_mixed_k_and_confidence_stops_keep_the_target_distribution(stop_on_token):
    """Rows of one batch verify 0, 1 or 2 drafts, cut by a confidence stop. Stopping on the drafter's
    distribution (what a prefix decides) keeps every emitted token distributed as the target's; a stop
    that looks at the drawn token itself biases it, and the same statistic catches that."""
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    p_target = torch.softmax(target_logits[0], -1)
    q0 = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    # the drafter's second distribution depends on its first token: peaked on the token the target
    # finds least likely after some first tokens (confident and wrong), flat after the others
    rare = int(p_target[1].argmin())
    q1_of = torch.full((V, V), 0.4 / (V - 1))
    q1_of[:, rare] = 0.6
    q1_of[V // 2 :] = 1.0 / V
    caps = [min(2, r % 6) for r in range(N)]  # a sixth draft nothing, a sixth 1, the rest 2
    drafts, probs, lens = _ragged_draws(q0, q1_of, caps, 0.5, stop_on_token, gen)
    assert {0, 1, 2} <= set(lens)
    sampling = _sampling(N)
    out = rejection_sample(target_logits.expand(N, K + 1, V), drafts, lens, probs, sampling)
    p = p_target.numpy()
    first = np.bincount([o[0] for o in out], minlength=V)
    assert chi2(first, p[0]) < CHI2_CRIT
    second = np.bincount([o[1] for o in out if len(o) > 1], minlength=V)
    assert chi2(second, p[1]) < CHI2_CRIT or stop_on_token
    # where the stop could act: rows that may draft 2 after a first token with a confident drafter
    # (the first token accepted, so the row's prefix is that token: the next one must follow p[1])
    where = [
        o[1]
        for o, c, d in zip(out, caps, drafts.tolist())
        if c == 2 and d[0] < V // 2 and o[0] == d[0] and len(o) > 1
    ]
    second = np.bincount(where, minlength=V)
    assert second.sum() > 600
    if stop_on_token:
        assert chi2(second, p[1]) > CHI2_CRIT
    else:
        assert chi2(second, p[1]) < CHI2_CRIT


def test_sample_from_follows_the_distribution_and_never_draws_a_zero():
    from dynaspec.engine.sampler import sample_from

    probs = (
        torch.tensor([0.0, 0.3, 0.0, 0.05, 0.45, 0.2, 0.0]) * 7.0
    )  # unnormalized, zeros inside and at the end
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([sample_from(probs, gen) for _ in range(N)], minlength=len(probs))
    # 3 degrees of freedom (4 tokens of positive probability): critical value 16.27 at p = 0.001
    assert chi2(counts, (probs / probs.sum()).numpy()) < 16.27
    one = torch.zeros(151936)
    one[-1] = 1.0  # the last token only: found, not clamped past the end
    assert sample_from(one, gen) == 151935
