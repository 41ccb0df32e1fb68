"""A drafter (a draft model or an EAGLE head) with suffix drafts beside it
(``"enable_suffix_decoding": true``, Arctic Inference's option).

In an RL rollout the same prompt is sampled many times and comes back every epoch, so a request's
next tokens are often in its siblings' and predecessors' outputs: a suffix match drafts them for the
host time of a tree walk, where the drafter costs a pass per draft position. Before the K policy
chooses, each decode's best suffix match is offered to it as a free draft (``free_rates``: each
token's frequency); the policy prices those rows without drafter passes and chooses which take
their match (``SchedulePlan.free_rows``, ``GoodputK``). Here those rows get their match and the
others the drafter's drafts, in one ``Drafts`` of the step. An EAGLE head still reads the
target's states of every row (``read_hidden`` gets the step's whole ``Drafts``), so a row that
drafted from its match catches the head up at its next drafter step, like a step of K=0. A wide
batch where the drafter's passes do not pay can still draft where a match is confident; a tail of
a few requests keeps the drafter where it does better.

Verification treats every draft token as proposed for certain (rejection.py), so which source
drafted a row never changes what the target emits.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.types import DraftPass, Drafts, SchedulePlan, StepResult
from dynaspec.spec_decode.proposer import Proposer
from dynaspec.spec_decode.suffix_tree import Speculation

if TYPE_CHECKING:
    from dynaspec.engine.request import Request
    from dynaspec.spec_decode.suffix import SuffixProposer


class HybridProposer(Proposer):
    """``model`` drafts where the policy does not take a row's suffix match from ``suffix``."""

    def __init__(self, model: Proposer, suffix: SuffixProposer, max_k: int) -> None:
        self.model, self.suffix = model, suffix
        super().__init__(model.ctx)
        self.max_k = max_k  # the longest match offered
        self._matches: dict[str, Speculation] = {}  # this step's offered matches, by request id
        self._match_ms = 0.0  # host time of the matches offered since the last step's drafts
        self._counts = _SourceCounts()

    # the profiler's fixed K drafts from the model alone (a fixed policy takes no free row)
    @property
    def fill_drafts(self) -> bool:
        return self.model.fill_drafts

    @fill_drafts.setter
    def fill_drafts(self, value: bool) -> None:
        self.model.fill_drafts = value

    @property
    def window(self) -> int | None:
        return getattr(self.model, "window", None)

    @window.setter
    def window(self, tokens: int | None) -> None:
        self.model.window = tokens

    def free_rates(self, request: Request) -> tuple[float, ...]:
        start = time.perf_counter()
        spec = self.suffix.speculate(request, self.max_k)
        self._match_ms += (time.perf_counter() - start) * 1e3
        if not spec.tokens:
            self._matches.pop(request.request_id, None)
            return ()
        self._matches[request.request_id] = spec
        return tuple(spec.probs)

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        free = plan.free_rows or [False] * plan.num_decodes
        if plan.k == 0 or not any(free):
            self._end_step(0.0)
            return self.model.propose(plan, sampling)
        model_caps = [0 if f else cap for f, cap in zip(free, plan.k_caps)]
        drafted = self.model.propose(dataclasses.replace(plan, k_caps=model_caps), sampling)
        start = time.perf_counter()
        tokens = torch.zeros(plan.num_decodes, plan.k, dtype=torch.long, device=self.ctx.device)
        tokens[:, : drafted.k] = drafted.token_ids
        lens = list(drafted.draft_lens)
        confidence = drafted.confidence or [[] for _ in range(plan.num_decodes)]
        for i, (r, cap) in enumerate(zip(plan.decodes, plan.k_caps)):
            if not free[i] or cap == 0:
                continue
            spec = self._matches.get(r.request_id) or self.suffix.speculate(r, cap)
            row = spec.tokens[:cap]
            if row:
                tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            lens[i] = len(row)
            confidence[i] = spec.probs[: len(row)]
        ms = self._end_step((time.perf_counter() - start) * 1e3)
        passes = list(drafted.passes)
        if passes:  # the matches' host time goes with the drafter's first pass of the step
            first = passes[0]
            passes[0] = DraftPass(first.rows, first.extra_tokens, first.ms + ms)
        return Drafts(tokens, lens, passes, confidence)

    def _end_step(self, drafting_ms: float) -> float:
        """The step's matches' host time (offered, plus ``drafting_ms`` spent drafting them),
        counted; the offered matches are forgotten."""
        ms = self._match_ms + drafting_ms
        self._counts.match_ms += ms
        self._match_ms, self._matches = 0.0, {}
        return ms

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        self.model.commit(plan, result)
        free = plan.free_rows or [False] * plan.num_decodes
        self._counts.observe(free, result.draft_lens, result.num_accepted)

    def release(self, request_ids: list[str]) -> None:
        self.model.release(request_ids)
        self.suffix.release(request_ids)
        for rid in request_ids:
            self._matches.pop(rid, None)

    def reset(self) -> None:
        self.model.reset()
        self.suffix.reset()
        self._matches, self._match_ms, self._counts = {}, 0.0, _SourceCounts()

    def stats(self) -> dict:
        return {**self.model.stats(), "suffix": self.suffix.stats(), "sources": self._counts.to_dict()}

    # the rest is the drafter's
    def hidden_layers(self) -> tuple[int, ...]:
        return self.model.hidden_layers()

    def read_hidden(self, plan: SchedulePlan, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        self.model.read_hidden(plan, drafts, hidden)

    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token()

    def allocate_kv(self, num_slots: int) -> None:
        self.model.allocate_kv(num_slots)

    def shares_cached_blocks(self) -> bool:
        return self.model.shares_cached_blocks()

    def kv_writes(self, request: Request, cap: int) -> tuple[int, int] | None:
        return self.model.kv_writes(request, cap)

    def copy_kv_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.model.copy_kv_blocks(pairs)

    def unseen_tokens(self, request: Request) -> int:
        return self.model.unseen_tokens(request)

    def catchup_tokens(self, context_tokens: int) -> int:
        return self.model.catchup_tokens(context_tokens)

    def assume_read(self, request: Request, num_tokens: int, slots: torch.Tensor) -> None:
        self.model.assume_read(request, num_tokens, slots)

    def pays_for_unfilled_positions(self) -> bool:
        return self.model.pays_for_unfilled_positions()

    def catch_up(self, prompts: list[list[int]], block_tables: list[list[int]]) -> float | None:
        return self.model.catch_up(prompts, block_tables)


@dataclasses.dataclass(slots=True)
class _SourceCounts:
    """Rows that drafted from each source, their draft tokens and those accepted."""

    suffix: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])
    model: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])
    match_ms: float = 0.0  # host time of the suffix matches, offered and drafted

    def observe(self, free: list[bool], draft_lens: list[int], accepted: list[int]) -> None:
        for f, n, a in zip(free, draft_lens, accepted):
            if n:
                counts = self.suffix if f else self.model
                counts[0] += 1
                counts[1] += n
                counts[2] += a

    def to_dict(self) -> dict:
        def one(c: list[int]) -> dict:
            return {"rows": c[0], "draft_tokens": c[1], "accepted": c[2]}

        return {"suffix": one(self.suffix), "model": one(self.model), "match_ms": round(self.match_ms, 2)}
