"""Verification on the device, with one copy back to the host per step.

For a step whose rows use no penalties or logprobs, the target's logits and the rows' seeds decide
everything: a row accepts its drafts up to the first that differs from the target's token (the
argmax, or the draw at its seed's uniform: engine/sampler.py) or the first its drafter did not
keep, then emits the target's token there. Tokens, matches and counts stay on the device; the host
receives, in one copy, each row's window of target tokens, draft count, accepted count and drafts
(and the drafter's confidences where they are still on the device), then waits once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dynaspec.engine.sampler import SamplingTensors, target_tokens, to_device
from dynaspec.engine.types import Drafts, StepResult

if TYPE_CHECKING:
    from dynaspec.spec_decode.synthetic import SyntheticAcceptance


def verify_on_device(
    target_logits: torch.Tensor,  # [rows, k + 1, vocab], decodes first (then completing prefills)
    drafts: Drafts,  # for the decodes: the first len(drafts.draft_lens) rows
    sampling: SamplingTensors,  # [rows], without penalties or logprobs
    synthetic: SyntheticAcceptance | None = None,
) -> StepResult:
    rows, width = target_logits.shape[0], target_logits.shape[1]
    num_decodes, k, device = len(drafts.draft_lens), width - 1, target_logits.device
    chosen = target_tokens(target_logits, sampling)  # [rows, k + 1]
    if drafts.pending is not None:
        lens = drafts.pending.lens  # [num_decodes]
    else:
        lens = to_device(drafts.draft_lens, torch.long, device)
    tokens = drafts.token_ids.to(device)  # [num_decodes, k]
    if rows > num_decodes:  # completing prefills: no drafts
        lens = torch.cat([lens, lens.new_zeros(rows - num_decodes)])
        tokens = torch.cat([tokens, tokens.new_zeros(rows - num_decodes, k)])
    parts = [chosen, lens[:, None], tokens]
    if k:
        verified = torch.arange(k, device=device)[None, :] < lens[:, None]  # [rows, k]
        matched = (tokens == chosen[:, :k]) & verified
        parts.append(matched.long().cumprod(1).sum(1, keepdim=True))  # [rows, 1] accepted
    host = _to_host(torch.cat(parts, 1))
    confidence = None
    if drafts.pending is not None:
        confidence = _to_host(drafts.pending.confidence)
    done = torch.cuda.Event() if device.type == "cuda" else None
    if done is not None:
        done.record()
        done.synchronize()  # the step's one wait
    host_rows = host.tolist()
    draft_lens = [row[width] for row in host_rows]
    accepted = [row[-1] if k else 0 for row in host_rows]
    if synthetic is not None:
        accepted = synthetic.accepted(draft_lens)
    emitted = []
    for row, n, a in zip(host_rows, draft_lens, accepted):
        a = min(a, n)
        drafted = row[width + 1 : width + 1 + k]
        emitted.append(drafted[:a] + [row[a]])
    kept = drafts.confidence
    if confidence is not None:
        kept = [c[:n] for c, n in zip(confidence.tolist(), draft_lens)]
    return StepResult(token_ids=emitted, draft_lens=draft_lens[:num_decodes], draft_confidence=kept)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into pinned memory (read after the step's wait)."""
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
