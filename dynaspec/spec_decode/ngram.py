"""Model-free drafting by prompt lookup: continue the latest earlier occurrence of the trailing n-gram,
each token with a confidence (the match's length, and whether its previous occurrence went on alike)."""

from __future__ import annotations

import numpy as np
import torch

from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.types import Drafts, SchedulePlan
from dynaspec.spec_decode.proposer import Proposer, ProposerContext, register_proposer

# A draft token's confidence (``Drafts.confidence``): what the target accepted of such tokens on
# the pair's greedy answers (32 MT-Bench and 32 HumanEval prompts, ``results/README.md``, "Confidence
# for n-gram drafts"): the longest n-gram (n_max) matched alone 0.75 and 0.99 at the first
# position, each shorter n less (n=2 of 2-4: 0.43 and 0.70); where the match's previous occurrence
# went on differently at that position, 0.1-0.36. These values only sort tokens into the confidence
# bins whose acceptance the goodput policy measures (``ConfidenceCalibration``), a prior it replaces.
LONGEST_MATCH_CONFIDENCE = 0.75
SHORTER_MATCH_STEP = 0.15  # less per token shorter than n_max
AGREED_BONUS = 0.15  # the previous occurrence went on the same way
DIFFERED_FACTOR = 0.25  # ... or differently


MAX_OFFERED = 8  # the longest match offered to the K policy when the config names no maximum K


def match_confidence(n: int, n_max: int, agreed: bool | None) -> float:
    """A draft token's confidence from the matched n-gram's length ``n`` and whether the match's
    previous occurrence continued with the same token at that position (None: there is none)."""
    base = max(0.3, LONGEST_MATCH_CONFIDENCE - SHORTER_MATCH_STEP * max(0, n_max - n))
    if agreed is None:
        return base
    return min(0.9, base + AGREED_BONUS) if agreed else base * DIFFERED_FACTOR


def ngram_match(tokens: np.ndarray, n_min: int, n_max: int) -> tuple[int, int, int | None] | None:
    """The longest trailing n-gram of ``tokens`` (n in [n_min, n_max]) seen before: (n, where its
    most recent earlier occurrence goes on, where the occurrence before that goes on or None), or
    None where no such n matched. ``tokens`` is the request's prompt + output so far (1-D int array).
    """
    length = len(tokens)
    longest = min(n_max, length - 1)
    if longest < n_min or n_min < 1:
        return None
    # every earlier occurrence of the last token ends a candidate match (one pass over the context);
    # each is then extended backwards while it agrees, up to the longest n (a few tiny passes)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, longest):
        alive &= ends >= j
        alive[alive] = tokens[ends[alive] - j] == tokens[length - 1 - j]
        matched += alive
    n = int(matched.max(initial=0))
    if n < n_min:
        return None
    hits = ends[matched >= n]  # the ends of the n-gram's occurrences, in order
    return n, int(hits[-1]) + 1, int(hits[-2]) + 1 if len(hits) > 1 else None


def ngram_draft(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> tuple[list[int], list[float]]:
    """Up to k tokens that followed the most recent earlier match of the longest trailing n-gram
    (``ngram_match``), and each token's confidence (``match_confidence``); empty lists where no n
    in [n_min, n_max] matched."""
    match = ngram_match(tokens, n_min, n_max)
    if match is None:
        return [], []
    n, start, before = match
    draft = tokens[start : start + k].tolist()
    length = len(tokens)
    confidence = [
        match_confidence(
            n, n_max, None if before is None or before + j >= length else int(tokens[before + j]) == t
        )
        for j, t in enumerate(draft)
    ]
    return draft, confidence


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, spec_config, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        self.n_min = spec_config.prompt_lookup_min
        self.n_max = spec_config.prompt_lookup_max
        # the longest match offered before the policy chooses (``free_rates``)
        self.max_k = spec_config.num_speculative_tokens or MAX_OFFERED
        self.matches_only = True  # its match is all it can draft: the policy prices each row by it
        # this step's lookups, by request id: (the request's tokens then, the draft, its confidence)
        self._matches: dict[str, tuple[int, list[int], list[float]]] = {}
        # each live request's tokens as an array, appended to as it grows (its length in use)
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def free_rates(self, request) -> tuple[float, ...]:
        """The confidence of each token of the request's match (up to ``max_k``), kept for
        ``propose``: the same context gives the same match."""
        draft, conf = ngram_draft(self.tokens_of(request), self.n_min, self.n_max, self.max_k)
        self._matches[request.request_id] = (request.num_tokens, draft, conf)
        return tuple(conf)

    def _match(self, request, cap: int) -> tuple[list[int], list[float]]:
        kept = self._matches.get(request.request_id)
        if kept is not None and kept[0] == request.num_tokens and cap <= self.max_k:
            return kept[1][:cap], kept[2][:cap]
        return ngram_draft(self.tokens_of(request), self.n_min, self.n_max, cap)

    def tokens_of(self, request) -> np.ndarray:
        """The request's prompt and output as an array, kept from step to step and appended to
        (a lookup is then ~0.01 ms at any context; building the array from the lists was 0.06 ms
        at 4,096 tokens and 0.27 at 16,384)."""
        total = request.num_tokens
        buf, n = self._arrays.get(request.request_id, (None, 0))
        if buf is None or n > total:
            buf, n = np.empty(max(64, 2 * total), dtype=np.int64), 0
        elif total > len(buf):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        prompt = len(request.prompt_token_ids)
        if n < prompt:
            buf[n:prompt] = request.prompt_token_ids[n:]
            n = prompt
        if total > n:
            buf[n:total] = request.output_token_ids[n - prompt : total - prompt]
        self._arrays[request.request_id] = (buf, total)
        return buf[:total]

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._matches.pop(rid, None)
            self._arrays.pop(rid, None)

    def reset(self) -> None:
        self._matches, self._arrays = {}, {}

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        if plan.k == 0:
            self._matches = {}
            return self.no_drafts(plan)
        rows: list[list[int]] = []
        confidence: list[list[float]] = []
        for r, cap in zip(plan.decodes, plan.k_caps):
            draft, conf = self._match(r, cap) if cap else ([], [])
            keep = next((j for j, p in enumerate(conf) if p < plan.min_draft_confidence), len(conf))  # a stop
            rows.append(draft[:keep])
            confidence.append(conf[:keep])
        if self.fill_drafts:  # a lookup without a match, or a short one, repeats the last token
            for r, row, conf, cap in zip(plan.decodes, rows, confidence, plan.k_caps):
                pad = cap - len(row)
                row += [row[-1] if row else r.all_token_ids[-1]] * pad
                conf += [0.0] * pad
        self._matches = {}
        tokens = torch.zeros(plan.num_decodes, plan.k, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return Drafts(tokens.to(self.ctx.device), [len(r) for r in rows], confidence=confidence)
