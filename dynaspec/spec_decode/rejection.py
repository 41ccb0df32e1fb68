"""Lossless verification: a row keeps its drafts while they are the target's own tokens (a pure function).

At each window position the target's token is the one it would emit alone: the argmax for a
greedy row; for a sampled one the draw from its processed distribution at the uniform of (seed,
output position) (engine/sampler.py). A row keeps its drafts while each equals the target's token
at its position, then emits the target's token at the first that differs (a recovered token), or
after all of them the bonus token. The emitted tokens are plain decoding's, so the output follows
the target's distribution whatever the drafts, and a seeded request emits the same tokens with
speculation as without, at any K and in any batch (as long as the target's probabilities do not
depend on the batch): an RL rollout reproduces across loads, and configurations compare on the
same text.

A drafter with a distribution q draws its draft for position t with the same function of (seed, t)
(``coupled_draw``), which couples the two draws: where q and p agree, the draft is the target's
token. Deterministic drafts (n-gram) are kept with probability p(x), as rejection sampling with a
one-hot q keeps them. A sampled drafter's drafts are kept a little less often than with rejection
sampling's min(1, p(x)/q(x)) and a residual, whose output depends on the drafts and so on K: the
results record's "Sampled verification" compares the two on the offline pair.

Penalties and logit bias are applied to the target's logits first, each window position with the
draft tokens before it counted as context (the drafter applies them alike), so the distribution
verified is the penalized one. Log-probabilities are reported from the raw target logits of the
same pass, for accepted draft tokens as for the recovered or bonus one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynaspec.engine.sampler import SamplingTensors, apply_penalties, target_tokens, token_logprobs
from dynaspec.engine.types import Drafts, StepResult, TokenLogprob
from dynaspec.spec_decode.device_verify import verify_on_device
from dynaspec.spec_decode.synthetic import SyntheticAcceptance, synthetic_emitted


def verify(
    target_logits: torch.Tensor,  # [len(plan.sampled), k + 1, vocab] float32, decodes first
    drafts: Drafts,  # for the decodes: the first len(drafts.draft_lens) rows
    sampling: SamplingTensors,  # [len(plan.sampled)]
    synthetic: SyntheticAcceptance | None = None,  # not lossless: accept at these rates whatever the tokens
) -> StepResult:
    """Verify a step: decodes verify their drafts, completing prefills sample a first token."""
    # the logits and the seeds decide: on the GPU (or after a drafter on fixed shapes), one copy
    # back; on the CPU the tokens at the verified positions alone, below, cost less than whole windows
    if sampling.plain and (target_logits.is_cuda or drafts.pending is not None):
        return verify_on_device(target_logits, drafts, sampling, synthetic)
    target_logits = target_logits.float()  # a fixed-shape pass gives the head's dtype
    num_rows, num_decodes = target_logits.shape[0], len(drafts.draft_lens)
    extra = num_rows - num_decodes  # prefill rows: no drafts
    tokens = torch.cat([drafts.token_ids, drafts.token_ids.new_zeros(extra, drafts.k)])
    logits = target_logits
    if sampling.penalties is not None:
        logits = apply_penalties(target_logits, sampling.penalties, tokens)
    num_drafts = drafts.draft_lens + [0] * extra
    if synthetic is None:
        emitted = rejection_sample(logits, tokens, num_drafts, sampling)
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
    sampling: SamplingTensors,  # [batch]
) -> list[list[int]]:  # per row: accepted drafts followed by one recovered or bonus token
    counts = [n + 1 for n in num_drafts]
    device = target_logits.device
    owner = torch.tensor([b for b, c in enumerate(counts) for _ in range(c)], dtype=torch.long, device=device)
    first = torch.tensor([j for c in counts for j in range(c)], dtype=torch.long, device=device)
    verified = _verified_positions(target_logits, range(len(counts)), num_drafts)  # [sum(counts), vocab]
    chosen = target_tokens(verified[:, None, :], sampling.rows(owner), first)[:, 0].tolist()
    drafts = draft_tokens.tolist()
    emitted, at = [], 0
    for b, c in enumerate(counts):
        emitted.append(kept_then_target(drafts[b][: c - 1], chosen[at : at + c]))
        at += c
    return emitted


def kept_then_target(
    drafts: list[int],  # [n] the drafts a row verifies
    target: list[int],  # [n + 1] the target's token at each of their positions and one more
) -> list[int]:
    """The drafts up to the first that differs from the target's token, then the target's token there."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return target[: accepted + 1]


def synthetic_sample(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab] float32
    draft_tokens: torch.Tensor,  # [batch, k] int64
    num_accepted: list[int],  # [batch] drafts each row accepts (from SyntheticAcceptance)
    sampling: SamplingTensors,
) -> list[list[int]]:  # per row: its accepted drafts followed by the target's token
    """Synthetic acceptance's emitted tokens: each row keeps its first ``num_accepted[b]`` drafts
    whatever they are, then takes the target's token at that window position."""
    batch = target_logits.shape[0]
    rows = torch.arange(batch, device=target_logits.device)
    at = torch.tensor(num_accepted, dtype=torch.long, device=target_logits.device)
    chosen = target_tokens(target_logits[rows, at][:, None, :], sampling, at)[:, 0].tolist()
    drafts = draft_tokens.tolist()
    return [synthetic_emitted(drafts[b], num_accepted[b], chosen[b]) for b in range(batch)]


def _verified_positions(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
    rows: Sequence[int],
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
