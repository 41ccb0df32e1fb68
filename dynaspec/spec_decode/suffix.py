"""Model-free drafting from suffix trees (suffix decoding, as vLLM's ``"method": "suffix"``).

A request drafts from its own prompt and output, and from the outputs of other requests: live ones
and a cache of finished ones (spec_decode/suffix_tree.py). The trees follow each request token by
token as the request is drafted for, and a finished request's output joins the cache. Each draft
token carries its frequency among the continuations seen (``Drafts.confidence``), so confidence
stops and per-request K weigh it as they weigh a draft model's; the host time it takes is reported
as the drafter's passes, which the goodput policy prices.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from dynaspec.engine.request import RequestStatus
from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.types import DraftPass, Drafts, SchedulePlan
from dynaspec.spec_decode.proposer import Proposer, ProposerContext, register_proposer
from dynaspec.spec_decode.suffix_tree import Speculation, SuffixIndex

if TYPE_CHECKING:
    from dynaspec.engine.request import Request
    from dynaspec.kpolicy.config import SpeculativeConfig


@register_proposer("suffix")
class SuffixProposer(Proposer):
    def __init__(self, spec_config: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        self.settings = spec_config.suffix
        self.max_spec_factor = self.settings.max_spec_factor
        self.min_token_prob = self.settings.min_token_prob
        self.reset()

    def reset(self) -> None:
        """An empty index: no live request, no cached output."""
        s = self.settings
        self.index = SuffixIndex(s.max_tree_depth, s.max_cached_requests, s.max_cached_tokens)
        self._requests: dict[str, Request] = {}  # live requests the index follows
        self._num_output: dict[str, int] = {}  # output tokens of each the index has seen

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        if plan.k == 0:
            return self.no_drafts(plan)
        start = time.perf_counter()
        for r in plan.decodes:
            self._follow(r)
        rows: list[list[int]] = []
        confidence: list[list[float]] = []
        for r, cap in zip(plan.decodes, plan.k_caps):
            spec = self.speculate(r, cap)
            keep = next(
                (j for j, p in enumerate(spec.probs) if p < plan.min_draft_confidence), len(spec.probs)
            )
            rows.append(spec.tokens[:keep])
            confidence.append(spec.probs[:keep])
        if self.fill_drafts:  # the profiler's: a short row repeats its last token, at no confidence
            for r, row, conf, cap in zip(plan.decodes, rows, confidence, plan.k_caps):
                pad = cap - len(row)
                row += [row[-1] if row else r.output_token_ids[-1]] * pad
                conf += [0.0] * pad
        padded = [row + [0] * (plan.k - len(row)) for row in rows]
        tokens = torch.tensor(padded, dtype=torch.long).view(plan.num_decodes, plan.k)  # [num_decodes, k]
        ms = (time.perf_counter() - start) * 1e3
        # the host time, as one pass per draft position over the rows asking for it (the cost
        # model's shape: a step's drafting costs K passes)
        passes = [DraftPass(sum(cap > j for cap in plan.k_caps), 0, ms / plan.k) for j in range(plan.k)]
        return Drafts(tokens.to(self.ctx.device), [len(r) for r in rows], passes, confidence)

    def speculate(self, r: Request, max_tokens: int) -> Speculation:
        """Up to ``max_tokens`` draft tokens for ``r`` from its best match, the index brought up to
        date with its tokens first."""
        self._follow(r)
        return self.index.speculate(r.request_id, max_tokens, self.max_spec_factor, self.min_token_prob)

    def _follow(self, r: Request) -> None:
        """Bring the index up to date with the request's tokens (added on first sight)."""
        rid = r.request_id
        seen = self._num_output.get(rid)
        if seen is None:
            self.index.add(rid, r.prompt_token_ids, r.output_token_ids)
            self._requests[rid] = r
        elif seen < len(r.output_token_ids):
            self.index.extend(rid, r.output_token_ids[seen:])
        self._num_output[rid] = len(r.output_token_ids)

    def release(self, request_ids: list[str]) -> None:
        """A finished request's output joins the cache; a preempted one is forgotten (it starts
        again from its prompt and output when it is scheduled again)."""
        for rid in request_ids:
            r = self._requests.pop(rid, None)
            if r is None:
                continue
            if r.status is RequestStatus.FINISHED:
                self._follow(r)  # the tokens of its last step
                self.index.finish(rid)
            else:
                self.index.drop(rid)
            del self._num_output[rid]

    def stats(self) -> dict:
        return self.index.stats()
