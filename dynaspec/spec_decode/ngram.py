"""Model-free drafting by prompt lookup: continue the latest earlier occurrence of the trailing n-gram."""

from __future__ import annotations

import numpy as np
import torch

from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.types import Drafts, SchedulePlan
from dynaspec.spec_decode.proposer import Proposer, ProposerContext, register_proposer


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest trailing n-gram.

    ``tokens`` is the request's prompt + output so far (1-D int array). Longer n-grams are tried
    first; an empty list means no n in [n_min, n_max] matched.
    """
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, spec_config, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        self.n_min = spec_config.prompt_lookup_min
        self.n_max = spec_config.prompt_lookup_max

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        if plan.k == 0:
            return self.no_drafts(plan)
        rows = [
            ngram_lookup(np.asarray(r.all_token_ids), self.n_min, self.n_max, cap) if cap else []
            for r, cap in zip(plan.decodes, plan.k_caps)
        ]
        if self.fill_drafts:  # a lookup without a match, or a short one, repeats the last token
            rows = [
                row + [row[-1] if row else r.all_token_ids[-1]] * (cap - len(row))
                for r, row, cap in zip(plan.decodes, rows, plan.k_caps)
            ]
        tokens = torch.zeros(plan.num_decodes, plan.k, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return Drafts(tokens.to(self.ctx.device), [len(r) for r in rows])
