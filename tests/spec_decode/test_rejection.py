"""Verification keeps the target's own tokens: chi-square on a tiny vocabulary, plain decoding's draws
token for token, and the counter-based uniforms they come from."""

import numpy as np
import pytest
import torch
from support.sampling import sampling_rows
from support.stats import CHI2_CRIT, chi2

from dynaspec.engine.sampler import (
    COUPLED_TOKENS,
    counter_uniforms,
    coupled_draw,
    greedy_tokens,
    processed_probs,
    sample_at,
    top_probability,
)
from dynaspec.engine.types import Drafts
from dynaspec.spec_decode.device_verify import verify_on_device
from dynaspec.spec_decode.ngram import match_confidence, ngram_draft
from dynaspec.spec_decode.rejection import rejection_sample

V, K, N = 6, 2, 12000


def _run(target_logits, draft_tokens, temperature=1.0, top_k=0, top_p=1.0):
    sampling = sampling_rows([temperature] * N, top_k, top_p)
    logits = target_logits.expand(N, K + 1, V)
    out = rejection_sample(logits, draft_tokens, [K] * N, sampling)
    p = processed_probs(target_logits, sampling.temperature[:1], sampling.top_k[:1], sampling.top_p[:1])[0]
    return out, p


def _draws(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # q: [K, V] -> [N, K]
    return torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(K)], dim=1)


def _coupled(q: torch.Tensor, n: int) -> torch.Tensor:  # q: [K, V] -> [n, K]
    """Drafts as the drafter draws them: row i's draft j at (seed i, output position j)."""
    seeds = torch.arange(n)
    return torch.stack(
        [coupled_draw(q[j].expand(n, -1), seeds, torch.full_like(seeds, j)) for j in range(K)], 1
    )


def _plain(p: torch.Tensor, seed: int, length: int) -> list[int]:  # p: [K + 1, V]
    """Plain decoding's tokens at output positions 0.. of a row seeded with ``seed``."""
    return coupled_draw(p[:length], torch.full((length,), seed), torch.arange(length)).tolist()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.8)])
@pytest.mark.parametrize("coupled", [True, False])
def test_draft_model_drafts_keep_the_target_distribution(top_k, top_p, coupled):
    """Drafts drawn at the target's uniforms (as the drafter draws them) or independently of them:
    the first token follows p[0], the second, among rows that kept the first draft, p[1]."""
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    draft_logits = target_logits[:, :K] + torch.randn(1, K, V, generator=gen)  # a drafter near the target
    q = processed_probs(draft_logits, torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]))[
        0
    ]  # [K, V]
    drafts = _coupled(q, N) if coupled else _draws(q, gen)
    out, p = _run(target_logits, drafts, top_k=top_k, top_p=top_p)
    p = p.numpy()
    first = np.bincount([o[0] for o in out], minlength=V)
    assert chi2(first, p[0]) < CHI2_CRIT
    second = np.bincount(
        [o[1] for o, d in zip(out, drafts.tolist()) if len(o) > 1 and o[0] == d[0]], minlength=V
    )
    assert second.sum() > 1000
    assert chi2(second, p[1]) < CHI2_CRIT


def test_coupled_drafts_are_kept_more_often_than_independent_ones():
    """A draft drawn at the target's (seed, position) is the target's draw unless their races
    differ: a draft from the target's own distribution is always kept, and a near one at least at
    Gumbel coupling's bound (1 - TV) / (1 + TV), well above independent draws' sum p(x) q(x)."""
    gen = torch.Generator().manual_seed(4)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    p = torch.softmax(target_logits[0], -1)  # [K + 1, V]
    sampling = sampling_rows([1.0] * N)
    out = rejection_sample(target_logits.expand(N, K + 1, V), _coupled(p[:K], N), [K] * N, sampling)
    assert all(len(o) == K + 1 for o in out)  # q == p: every draft kept
    q = torch.softmax(target_logits[0, :K] + 0.6 * torch.randn(K, V, generator=gen), -1)
    out = rejection_sample(target_logits.expand(N, K + 1, V), _coupled(q, N), [K] * N, sampling)
    kept = np.mean([len(o) > 1 for o in out])
    tv = 0.5 * float((p[0] - q[0]).abs().sum())
    assert kept > (1 - tv) / (1 + tv) - 3 / np.sqrt(N)
    assert kept > float((p[0] * q[0]).sum()) + 0.1


def test_coupled_draw_follows_the_distribution_beyond_its_racing_tokens():
    """A vocabulary larger than the racing tokens: draws from the race and from the rest together
    follow the distribution (the rest's tokens, here scattered over the ids, are drawn too)."""
    vocab, n = COUPLED_TOKENS + 8, 40000
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(vocab, generator=gen) * 0.5, -1)
    seeds = torch.arange(n) * 7919
    draws = coupled_draw(probs.expand(n, -1), seeds, torch.full_like(seeds, 3))
    counts = np.bincount(draws.numpy(), minlength=vocab)
    rest = probs.topk(vocab - COUPLED_TOKENS, largest=False).indices
    assert counts[rest.numpy()].sum() > 0.05 * n  # the rest won its race often enough to matter
    assert chi2(counts, probs.numpy()) < 72.05  # 39 degrees of freedom, p = 0.001


def test_deterministic_drafts_keep_the_target_distribution():
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    drafts = torch.tensor([[2, 3]]).expand(N, K)  # n-gram style: q is one-hot
    out, p = _run(target_logits, drafts)
    p = p.numpy()
    assert chi2(np.bincount([o[0] for o in out], minlength=V), p[0]) < CHI2_CRIT
    assert abs(np.mean([o[0] == 2 for o in out]) - p[0][2]) < 0.02  # draft x is kept with p(x)
    second = np.bincount([o[1] for o in out if len(o) > 1], minlength=V)  # after the first was kept
    assert second.sum() > 1000
    assert chi2(second, p[1]) < CHI2_CRIT


@pytest.mark.parametrize("coupled", [True, False])
def test_every_emitted_token_is_plain_decodings_draw(coupled):
    """Whatever the drafts, a row emits plain decoding's tokens at its positions (the same seed and
    output positions), keeping its drafts up to the first that differs."""
    gen = torch.Generator().manual_seed(2)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    n = 400
    p = torch.softmax(target_logits[0], -1)
    drafts = (
        _coupled(torch.softmax(torch.randn(K, V, generator=gen), -1), n)
        if coupled
        else torch.randint(0, V, (n, K), generator=gen)
    )
    out = rejection_sample(target_logits.expand(n, K + 1, V), drafts, [K] * n, sampling_rows([1.0] * n))
    for i, emitted in enumerate(out):
        assert emitted == _plain(p, i, len(emitted))
        kept = len(emitted) - 1
        assert emitted[:kept] == drafts[i, :kept].tolist()
        assert kept == K or emitted[kept] != drafts[i, kept]
    assert any(len(o) > 1 for o in out) and any(len(o) == 1 for o in out)


def test_a_row_further_on_draws_at_its_own_output_positions():
    """A row at output position t verifies with the uniforms of t, t + 1, ...: its window's tokens
    are the ones plain decoding draws there."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, K + 1, V, generator=gen)
    drafts = torch.randint(0, V, (3, K), generator=gen)
    out = rejection_sample(logits, drafts, [K] * 3, sampling_rows([1.0] * 3, positions=[0, 7, 100]))
    for b, (emitted, t) in enumerate(zip(out, [0, 7, 100])):
        n = len(emitted)
        probs = torch.softmax(logits[b, :n], -1)
        assert emitted == coupled_draw(probs, torch.full((n,), b), torch.arange(t, t + n)).tolist()


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
    out = rejection_sample(logits, drafts, [3, 1], sampling_rows([0.0, 0.0]))
    assert out == [[1, 2, 3], [0, 0]]


def test_the_device_path_emits_what_the_host_path_does():
    """verify_on_device (one copy back) and the host path agree row for row on a batch mixing
    greedy and sampled rows, ragged draft counts, and a completing prefill."""
    gen = torch.Generator().manual_seed(6)
    rows, k, vocab = 9, 3, 40
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 2
    decodes = rows - 1
    drafts = Drafts(torch.randint(0, vocab, (decodes, k), generator=gen), [3, 0, 1, 2, 3, 3, 1, 2])
    drafts.token_ids[:, 0] = logits[:decodes, 0].argmax(-1)  # some first drafts right for greedy rows
    temperatures = [0.0, 1.0, 0.7, 0.0, 1.0, 1.3, 0.0, 1.0, 1.0]
    sampling = sampling_rows(temperatures, top_k=0, positions=list(range(rows)))
    device = verify_on_device(logits, drafts, sampling)
    tokens = torch.cat([drafts.token_ids, torch.zeros(1, k, dtype=torch.long)])
    host = rejection_sample(logits, tokens, drafts.draft_lens + [0], sampling)
    assert device.token_ids == host
    assert any(len(t) > 1 for t in host)


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
    assert ngram_draft(toks, 1, 3, 3)[0] == [9, 2, 6]  # "6 7" last seen before 9
    assert ngram_draft(np.array([1, 2, 3]), 1, 3, 2)[0] == []
    assert ngram_draft(np.array([4, 2, 4]), 1, 2, 5)[0] == [2, 4]


def naive_ngram_draft(tokens, n_min, n_max, k):
    """The lookup as first written: for n from the longest down, every window compared."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start, before = int(hits[-1]) + n, int(hits[-2]) + n if len(hits) > 1 else None
            draft = tokens[start : start + k].tolist()
            agreed = [
                None if before is None or before + j >= length else int(tokens[before + j]) == t
                for j, t in enumerate(draft)
            ]
            return draft, [match_confidence(n, n_max, a) for a in agreed]
    return [], []


@pytest.mark.parametrize("seed", range(4))
def test_ngram_draft_finds_what_comparing_every_window_finds(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        tokens = rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 60)))
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 4))
        assert ngram_draft(tokens, n_min, n_max, 5) == naive_ngram_draft(tokens, n_min, n_max, 5)


def test_ngram_proposer_keeps_each_request_s_tokens_as_they_grow():
    from types import SimpleNamespace

    from dynaspec.spec_decode.ngram import NgramProposer

    spec = SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=4)
    proposer = NgramProposer(spec, SimpleNamespace(device="cpu"))
    request = SimpleNamespace(request_id="r", prompt_token_ids=[3, 1, 4, 1, 5], output_token_ids=[])
    for token in [9, 2, 6, 5, 3, 5, 8, 9, 7, 9] * 20:  # past the first array's room
        request.output_token_ids.append(token)
        request.num_tokens = 5 + len(request.output_token_ids)
        whole = request.prompt_token_ids + request.output_token_ids
        assert proposer.tokens_of(request).tolist() == whole
        assert proposer.free_rates(request) == tuple(ngram_draft(np.array(whole), 1, 3, 4)[1])
    proposer.release(["r"])
    assert proposer._arrays == {} and proposer._matches == {}


def test_ngram_confidence_follows_the_match_length_and_its_previous_occurrence():
    toks = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    draft, confidence = ngram_draft(toks, 1, 3, 3)  # "6 7" before 9 2 6; the time before, before 8 1 6
    base = match_confidence(2, 3, None)
    assert draft == [9, 2, 6]
    assert confidence == [match_confidence(2, 3, False)] * 2 + [match_confidence(2, 3, True)]
    assert confidence[0] < base < confidence[2]
    # a longer match is surer; one seen once has only its length
    assert match_confidence(1, 3, None) < base < match_confidence(3, 3, None)
    assert ngram_draft(np.array([1, 2, 3, 1, 2]), 1, 2, 4) == ([3, 1, 2], [match_confidence(2, 2, None)] * 3)
    assert ngram_draft(np.array([1, 2, 3]), 1, 3, 2) == ([], [])


@pytest.mark.parametrize("stop_on_token", [False, True])
def test_mixed_k_and_confidence_stops_keep_the_target_distribution(stop_on_token):
    """Rows of one batch verify 0, 1 or 2 drafts, cut by a confidence stop decided on the drafter's
    distribution or on the token it drew (the rule that biases rejection sampling with a residual).
    Either way every emitted token is the target's own draw, so both follow p."""
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(1, K + 1, V, generator=gen) * 1.5
    p_target = torch.softmax(target_logits[0], -1)
    q = torch.softmax(torch.randn(K, V, generator=gen) * 1.5, -1)
    drafts = _coupled(q, N)
    caps = [min(2, r % 6) for r in range(N)]  # a sixth draft nothing, a sixth 1, the rest 2
    confident = q[1][drafts[:, 1]] >= 0.3 if stop_on_token else torch.full((N,), bool(q[1].max() >= 0.3))
    lens = [min(c, 2 if bool(ok) else 1) for c, ok in zip(caps, confident)]
    assert {0, 1, 2} <= set(lens)
    out = rejection_sample(target_logits.expand(N, K + 1, V), drafts, lens, sampling_rows([1.0] * N))
    p = p_target.numpy()
    assert chi2(np.bincount([o[0] for o in out], minlength=V), p[0]) < CHI2_CRIT
    second = np.bincount([o[1] for o in out if len(o) > 1], minlength=V)
    assert second.sum() > 1000
    assert chi2(second, p[1]) < CHI2_CRIT
    for i in range(0, N, 997):
        assert out[i] == _plain(p_target, i, len(out[i]))


def test_sample_at_follows_the_distribution_and_never_draws_a_zero():
    probs = (
        torch.tensor([0.0, 0.3, 0.0, 0.05, 0.45, 0.2, 0.0]) * 7.0
    )  # unnormalized, zeros inside and at the end
    seeds = torch.arange(N)
    u = counter_uniforms(seeds, torch.full_like(seeds, 3))
    counts = np.bincount(sample_at(probs.expand(N, -1), u).numpy(), minlength=len(probs))
    # 3 degrees of freedom (4 tokens of positive probability): critical value 16.27 at p = 0.001
    assert chi2(counts, (probs / probs.sum()).numpy()) < 16.27
    one = torch.zeros(1, 151936)
    one[0, -1] = 1.0  # the last token only: found, not clamped past the end
    assert sample_at(one, torch.tensor([0.999999])).tolist() == [151935]


@pytest.mark.parametrize("along", ["seeds", "positions", "streams"])
def test_counter_uniforms_are_uniform_and_independent_of_neighbours(along):
    """Adjacent seeds (a request's n samples are seeded seed + i), adjacent output positions and
    adjacent token ids give uniforms that fill 20 bins evenly and do not correlate with their
    neighbour's."""
    n = 40000
    a = torch.arange(n) + 123456789
    fixed = torch.full((n,), 42)
    u = {
        "seeds": lambda: counter_uniforms(a, fixed),
        "positions": lambda: counter_uniforms(fixed, a),
        "streams": lambda: counter_uniforms(fixed, fixed, a),
    }[along]()
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = np.bincount((u * 20).long().numpy(), minlength=20)
    assert chi2(counts, np.full(20, 0.05)) < 43.8  # 19 degrees of freedom, p = 0.001
    x, y = u[:-1].double() - 0.5, u[1:].double() - 0.5
    assert abs(float((x * y).mean() / (x * x).mean())) < 4 / np.sqrt(n)
    big = counter_uniforms(torch.tensor([(1 << 63) - 1, 0]), torch.tensor([5, 5]))
    assert big[0] != big[1]  # the seed's high bits count


def test_greedy_tokens_and_top_probability_are_torch_s_argmax_and_softmax_max():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 1000, generator=g) * 4
    logits[0, 1, [10, 500, 900]] = 50.0  # ties: the first maximum, as torch.argmax
    logits[1, 2, 7] = float("nan")  # NaN wins, as in torch.argmax
    logits[2, 0, :] = float("-inf")
    logits[2, 0, 999] = 0.0
    views = [logits, logits[:, 1], logits.transpose(0, 1), logits[:, :, ::2]]  # strided views too
    views += [logits[0, 0], logits[:0, 0]]  # one row alone (a 0-d answer), no rows
    for x in views + [x.bfloat16() for x in views]:
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
    rows = logits[:, 0]  # no NaN: a softmax's maximum is defined
    probability, top = top_probability(rows)
    expected = torch.softmax(rows, -1).max(-1)
    assert torch.equal(top, expected.indices)
    assert torch.allclose(probability, expected.values, rtol=1e-5, atol=1e-7)
    assert probability[2].item() == 1.0  # one finite logit: certain
