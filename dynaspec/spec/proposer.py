"""The proposer interface, its registry, and the drafts it hands the verifier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.scheduler import SchedulePlan, StepResult


@dataclass(slots=True)
class Drafts:
    token_ids: torch.Tensor  # [num_decodes, k] int64; entries past num_drafts[i] are padding
    num_drafts: list[int]  # [num_decodes]
    probs: torch.Tensor | None  # [num_decodes, k, vocab] draft distributions, None when drafts are deterministic

    @classmethod
    def none(cls, num_decodes: int, device: torch.device) -> Drafts:
        return cls(torch.zeros(num_decodes, 0, dtype=torch.long, device=device), [0] * num_decodes, None)

    @property
    def k(self) -> int:
        return self.token_ids.shape[1]

    def padded(self, num_rows: int) -> Drafts:
        """Extend with rows that draft nothing (prefills that sample their first token)."""
        extra = num_rows - len(self.num_drafts)
        if extra == 0:
            return self
        tokens = torch.cat([self.token_ids, self.token_ids.new_zeros(extra, self.k)])
        probs = None
        if self.probs is not None:
            probs = torch.cat([self.probs, self.probs.new_zeros(extra, *self.probs.shape[1:])])
        return Drafts(tokens, self.num_drafts + [0] * extra, probs)


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may know of the engine: no scheduler, no target model."""

    target_tokenizer: object
    dtype: torch.dtype
    device: torch.device
    block_size: int


class Proposer(Protocol):
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes this proposer needs per token (0 if it keeps none)."""

    def allocate_kv(self, num_slots: int) -> None:
        """Create KV storage addressed by the same slots as the target's (no-op if none)."""

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        """Up to plan.max_drafts[i] drafts for each decode; must not run at all when plan.k == 0."""

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        """Learn what was accepted (e.g. how much of the drafter's own KV stays valid)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget requests that finished or were preempted."""


class NoProposer:
    """No speculation: every step verifies only the last token."""

    def kv_bytes_per_token(self) -> int:
        return 0

    def allocate_kv(self, num_slots: int) -> None:
        pass

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        return Drafts.none(plan.num_decodes, sampling.temperature.device)

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        pass

    def release(self, request_ids: list[str]) -> None:
        pass


ProposerFactory = Callable[[object, ProposerContext], Proposer]  # (SpeculativeConfig, context)
PROPOSERS: dict[str, ProposerFactory] = {}


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        return factory

    return wrap


def make_proposer(spec_config, ctx: ProposerContext) -> Proposer:
    if spec_config is None:
        return NoProposer()
    import dynaspec.spec.draft_model  # noqa: F401  registers draft_model
    import dynaspec.spec.ngram  # noqa: F401  registers ngram

    return PROPOSERS[spec_config.method](spec_config, ctx)
