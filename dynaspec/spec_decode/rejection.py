"""Lossless verification of draft tokens against the target's distribution (a pure function).

Greedy rows accept drafts while they equal the target's argmax. Sampled rows with a drafter's
distribution q accept draft x with probability min(1, p(x) / q(x)); at the first rejection they
sample from normalize(max(0, p - q)); after all drafts are accepted they sample a bonus token from
p. The emitted sequence is thus distributed exactly as the target's own samples.

Deterministic drafts (n-gram: q is a one-hot) take the target's own sample at each position, with
the draws plain decoding makes (one uniform from the request's generator per emitted token, in
order), and keep going while it equals the draft. Draft x is accepted with probability p(x), as
rejection sampling with a one-hot q accepts it, and at the first mismatch the token emitted is p's
sample given that it is not x, which is rejection sampling's residual. Because the draws are
plain decoding's, a request with a seed emits exactly the tokens it would without speculation,
whatever K each step chose (as long as the target's probabilities do not depend on the batch):
an RL rollout is reproducible across loads, and configurations compare on the same text.

Penalties and logit bias are applied to the target's logits first, each window position with the
draft tokens before it counted as context (the drafter applies them alike), so the distribution
verified is the penalized one. Log-probabilities are reported from the raw target logits of the
same pass, for accepted draft tokens as for the recovered or bonus one.
"""

from __future__ import annotations

import torch

from dynaspec.engine.sampler import (
    SamplingTensors,
    apply_penalties,
    processed_probs,
    sample_from,
    token_logprobs,
)
from dynaspec.engine.types import Drafts, StepResult, TokenLogprob
from dynaspec.spec_decode.device_verify import verify_greedy
from dynaspec.spec_decode.synthetic import SyntheticAcceptance, synthetic_emitted


def verify(
    target_logits: torch.Tensor,  # [len(plan.sampled), k + 1, vocab] float32, decodes first
    drafts: Drafts,  # for the decodes: the first len(drafts.draft_lens) rows
    sampling: SamplingTensors,  # [len(plan.sampled)]
    synthetic: SyntheticAcceptance | None = None,  # not lossless: accept at these rates whatever the tokens
) -> StepResult:
    """Rejection-sample a step: decodes verify their drafts, completing prefills sample a first token."""
    # the argmax decides: on the GPU (or after a drafter on fixed shapes), one copy back; on the
    # CPU the argmax over the verified positions alone, below, costs less than over whole windows
    if sampling.plain_greedy and (target_logits.is_cuda or drafts.pending is not None):
        return verify_greedy(target_logits, drafts, synthetic)
    target_logits = target_logits.float()  # a fixed-shape pass gives the head's dtype
    num_rows, num_decodes = target_logits.shape[0], len(drafts.draft_lens)
    extra = num_rows - num_decodes  # prefill rows: no drafts
    tokens = torch.cat([drafts.token_ids, drafts.token_ids.new_zeros(extra, drafts.k)])
    probs = drafts.probs
    if probs is not None and extra:
        probs = torch.cat([probs, probs.new_zeros(extra, *probs.shape[1:])])
    logits = target_logits
    if sampling.penalties is not None:
        logits = apply_penalties(target_logits, sampling.penalties, tokens)
    num_drafts = drafts.draft_lens + [0] * extra
    if synthetic is None:
        emitted = rejection_sample(logits, tokens, num_drafts, probs, sampling)
    else:
        emitted = synthetic_sample(logits, tokens, synthetic.accepted(num_drafts), sampling)
    return StepResult(
        token_ids=emitted,
        draft_lens=list(drafts.draft_lens),
        logprobs=emitted_logprobs(target_logits, emitted, sampling.num_logprobs),
        draft_confidence=drafts.confidence,
    )


def emitted_logprobs(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab] raw
    emitted: list[list[int]],  # [batch] tokens emitted at window positions 0..
    num_logprobs: list[int | None],  # [batch] None: the row wants none
) -> list[list[TokenLogprob] | None]:
    """The raw target log-probabilities of each row's emitted tokens, from the verify pass."""
    rows = [b for b, n in enumerate(num_logprobs) if n is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(emitted)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.long, device=target_logits.device)
    scored = token_logprobs(
        target_logits.index_select(0, index), [emitted[b] for b in rows], [num_logprobs[b] for b in rows]
    )
    for b, entries in zip(rows, scored):
        out[b] = entries
    return out


def rejection_sample(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab] float32; row b valid up to num_drafts[b] + 1
    draft_tokens: torch.Tensor,  # [batch, k] int64
    num_drafts: list[int],  # [batch] drafts to verify per row (0 <= n <= k)
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] or None for deterministic drafts
    sampling: SamplingTensors,
) -> list[list[int]]:  # per row: accepted drafts followed by one recovered or bonus token
    batch = target_logits.shape[0]
    greedy = (sampling.temperature == 0).tolist()
    emitted: list[list[int]] = [[] for _ in range(batch)]
    drafts = draft_tokens.tolist()

    greedy_rows = [b for b in range(batch) if greedy[b]]
    if greedy_rows:
        argmax = _verified_positions(target_logits, greedy_rows, num_drafts).argmax(-1).tolist()
        at = 0
        for b in greedy_rows:
            n = num_drafts[b]
            row, at = argmax[at : at + n + 1], at + n + 1
            accepted = 0
            while accepted < n and drafts[b][accepted] == row[accepted]:
                accepted += 1
            emitted[b] = row[: accepted + 1]

    sampled_rows = [b for b in range(batch) if not greedy[b]]
    if sampled_rows:
        counts = [num_drafts[b] + 1 for b in sampled_rows]
        owner = torch.tensor(
            [b for b, c in zip(sampled_rows, counts) for _ in range(c)],
            dtype=torch.long,
            device=target_logits.device,
        )
        p_all = processed_probs(
            _verified_positions(target_logits, sampled_rows, num_drafts)[:, None, :],
            sampling.temperature[owner],
            sampling.top_k[owner],
            sampling.top_p[owner],
        )[:, 0]  # [sum(counts), vocab]
        for b, p in zip(sampled_rows, p_all.split(counts)):
            q = None if draft_probs is None else draft_probs[b]
            emitted[b] = _verify_row(p, drafts[b], num_drafts[b], q, sampling.generators[b])
    return emitted


def synthetic_sample(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab] float32
    draft_tokens: torch.Tensor,  # [batch, k] int64
    num_accepted: list[int],  # [batch] drafts each row accepts (from SyntheticAcceptance)
    sampling: SamplingTensors,
) -> list[list[int]]:  # per row: its accepted drafts followed by the target's token
    """Synthetic acceptance's emitted tokens: each row keeps its first ``num_accepted[b]`` drafts
    whatever they are, then takes the target's token at that window position (the argmax for a
    greedy row, a sample from p with the request's generator for a sampled one)."""
    batch = target_logits.shape[0]
    rows = torch.arange(batch, device=target_logits.device)
    at = torch.tensor(num_accepted, dtype=torch.long, device=target_logits.device)
    logits = target_logits[rows, at]  # [batch, vocab]
    probs = processed_probs(logits[:, None, :], sampling.temperature, sampling.top_k, sampling.top_p)[:, 0]
    greedy = (sampling.temperature == 0).tolist()
    argmax = logits.argmax(-1).tolist()
    drafts = draft_tokens.tolist()
    return [
        synthetic_emitted(
            drafts[b],
            num_accepted[b],
            argmax[b] if greedy[b] else sample_from(probs[b], sampling.generators[b]),
        )
        for b in range(batch)
    ]


def _verified_positions(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
    rows: list[int],
    num_drafts: list[int],
) -> torch.Tensor:  # [sum(num_drafts[b] + 1 for b in rows), vocab]
    """The logits of the window positions each row verifies (its drafts and one more), in row
    order. A step's window is as wide as its longest draft; with a K per request most of it is
    padding: over all of it, a step of 8 decodes, one drafting 5, spent 16.2 ms outside the
    target's pass, 2.9 ms over these positions only (the results diary, "Per-request K with
    n-gram on mixed traffic")."""
    width, vocab = target_logits.shape[1], target_logits.shape[2]
    flat = [b * width + j for b in rows for j in range(num_drafts[b] + 1)]
    index = torch.tensor(flat, dtype=torch.long, device=target_logits.device)
    return target_logits.reshape(-1, vocab).index_select(0, index)


def _verify_row(
    p: torch.Tensor,  # [n + 1, vocab] target probabilities at the verified positions
    drafts: list[int],  # [k]
    n: int,
    q: torch.Tensor | None,  # [k, vocab] draft probabilities, or None for one-hot drafts
    generator: torch.Generator,
) -> list[int]:
    if q is None:
        return _follow_samples(p, drafts, n, generator)
    out = []
    u = torch.rand(n, generator=generator, device=p.device).tolist() if n else []
    for i in range(n):
        x = drafts[i]
        if u[i] * float(q[i, x]) < float(p[i, x]):  # u < p/q without dividing
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any sample from p is exact
            residual = p[i]
        out.append(sample_from(residual, generator))
        return out
    out.append(sample_from(p[n], generator))
    return out


def _follow_samples(
    p: torch.Tensor,  # [n + 1, vocab] target probabilities at the verified positions
    drafts: list[int],  # [k] deterministic drafts
    n: int,
    generator: torch.Generator,
) -> list[int]:
    """The target's own samples, one per position with plain decoding's draws, up to and including
    the first that differs from its draft (or the bonus after all n)."""
    out = []
    for i in range(n + 1):
        token = sample_from(p[i], generator)
        out.append(token)
        if i == n or token != drafts[i]:
            break
    return out
