"""The types the stages of a step exchange: plan, drafts, result, timing, and what the K policy sees.

Stages import these, never each other: the scheduler makes a ``SchedulePlan``, the proposer
``Drafts``, the rejection sampler a ``StepResult``; the engine times the passes (``StepTiming``)
and hands all three to the K policy and the statistics as one ``StepRecord``. Nothing here
imports torch at run time, so the K-choice package (plain Python) can use these types too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from dynaspec.engine.request import Request


@dataclass(slots=True)
class PrefillChunk:
    request: Request
    num_tokens: int  # prompt tokens computed this step
    completes: bool = False  # reaches the last prompt token, so the step samples the first output token
    first: bool = False  # the request's first chunk since it was admitted (after its cached blocks)

    def __post_init__(self) -> None:
        r = self.request
        self.completes = r.num_computed_tokens + self.num_tokens == r.num_tokens
        self.first = r.num_computed_tokens == r.num_cached_tokens


@dataclass(slots=True)
class SchedulePlan:
    """Who runs this step, how many tokens each, and K."""

    decodes: list[Request]  # each verifies its last token plus up to k_caps[i] draft tokens
    k_caps: list[int]  # [num_decodes] the K cap of each decode: the policy's K for it, cut to its tokens left
    prefills: list[PrefillChunk]
    chosen_k: int = 0  # the policy's K for the load (statistics): the largest K of any decode
    # a decode stops drafting before the first draft position whose drafter top probability is
    # below this (0: never); decided from the drafter's distribution, before its token is known
    min_draft_confidence: float = 0.0
    released: list[str] = field(default_factory=list)  # request ids preempted or finished since the last plan
    # [num_decodes] or empty: which decodes draft from a match that costs no drafter pass (a draft
    # model with suffix decoding: ``DraftCandidate.free_rates``), as the K policy chose
    free_rows: list[bool] = field(default_factory=list)

    @property
    def k(self) -> int:
        """The most draft tokens any decode may get this step (0: the proposer does not run)."""
        return max(self.k_caps, default=0)

    @property
    def sampled(self) -> list[Request]:
        """Requests that get new tokens this step: decodes, then prefills that complete."""
        return self.decodes + [c.request for c in self.prefills if c.completes]

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class DraftPass(NamedTuple):
    """One forward pass of a draft model, as the cost model prices it."""

    rows: int  # requests in the pass
    extra_tokens: int  # tokens beyond one per row: the drafter catching up on tokens it has not seen
    ms: float


@dataclass(slots=True)
class DeviceDrafts:
    """What a drafter that ran on fixed shapes (a CUDA graph) knows only on the device until the
    step's one copy back: how many drafts each row keeps (confidence stops) and their confidence."""

    lens: torch.Tensor  # [num_decodes] int64 drafts kept per decode (<= Drafts.draft_lens[i])
    confidence: torch.Tensor  # [num_decodes, k] float32 the drafter's top probability per position
    timer: Callable[[], list[DraftPass]]  # the drafter's passes, timed (call after the step's wait)


@dataclass(slots=True)
class Drafts:
    """The draft tokens for a step's decodes (row i belongs to ``plan.decodes[i]``)."""

    token_ids: torch.Tensor  # [num_decodes, k] int64; entries past draft_lens[i] are padding
    draft_lens: list[int]  # [num_decodes] draft tokens of each decode (0..k_caps[i])
    passes: list[DraftPass] = field(default_factory=list)  # the drafter's passes, timed
    # [num_decodes][draft_lens[i]] the drafter's top probability at each draft position; None for
    # proposers without a distribution (n-gram)
    confidence: list[list[float]] | None = None
    # set by a drafter on fixed shapes: draft_lens then holds each decode's cap, and the lengths
    # kept and the confidences come back with the step's results
    pending: DeviceDrafts | None = None

    @property
    def k(self) -> int:
        return self.token_ids.shape[1]

    def timed_passes(self) -> list[DraftPass]:
        """The drafter's passes with their times (after the step's results came back)."""
        return self.passes if self.pending is None else self.pending.timer()


class TokenLogprob(NamedTuple):
    """A token's log-probability under the target's raw distribution, and the most likely tokens."""

    logprob: float
    rank: int  # 1 for the most likely token
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(slots=True)
class PromptLogits:
    """Target logits over part of a prompt whose tokens are scored (``prompt_logprobs``)."""

    request_id: str
    logits: torch.Tensor  # [len(token_ids), vocab] float32: row j predicts token_ids[j]
    token_ids: list[int]  # the prompt tokens scored, in order


@dataclass(slots=True)
class TargetLogits:
    """What the target's pass of a step returns."""

    sampled: torch.Tensor  # [len(plan.sampled), k + 1, vocab] float32: decodes' windows, completing prefills
    prompts: list[PromptLogits] = field(default_factory=list)  # prefill chunks that score their prompt
    # [tokens of the pass, len(layers) * hidden] the target's hidden states entering the layers the
    # proposer reads (Proposer.hidden_layers), one row per token computed, in the pass's order (each
    # decode's last token and drafts, then each prefill chunk); None when it reads none
    hidden: torch.Tensor | None = None


@dataclass(slots=True)
class StepResult:
    token_ids: list[list[int]]  # per plan.sampled request: its accepted draft tokens, then one sampled token
    draft_lens: list[int]  # [num_decodes] draft tokens each decode verified
    # per plan.sampled request: one TokenLogprob per emitted token, or None if it asked for none
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # request id -> scored
    # [num_decodes][draft_lens[i]] the drafter's top probability at each verified draft position,
    # where the drafter has one and it came back with the results (Drafts.pending); else None
    draft_confidence: list[list[float]] | None = None

    @property
    def num_accepted(self) -> list[int]:
        """[num_decodes] accepted draft tokens of each decode."""
        return [len(t) - 1 for t in self.token_ids[: len(self.draft_lens)]]


@dataclass(slots=True)
class StepTiming:
    """Wall times of one step's passes (milliseconds)."""

    verify_tokens: int  # decode tokens the target verified: sum over decodes of 1 + draft length
    prefill_tokens: int
    target_ms: float
    draft_passes: list[DraftPass] = field(default_factory=list)
    decode_rows: int = 0  # decodes verified (requests, not tokens)
    context_tokens: int = 0  # their contexts' tokens together (what their attention reads)
    # the whole engine step's wall time (schedule to update, as the profiler times its grid's
    # cells; 0: not timed): what the goodput policy's live grid cells learn from
    step_ms: float = 0.0

    @classmethod
    def of(
        cls, plan: SchedulePlan, result: StepResult, target_ms: float, draft_passes: list[DraftPass]
    ) -> StepTiming:
        return cls(
            verify_tokens=plan.num_decodes + sum(result.draft_lens),
            prefill_tokens=sum(c.num_tokens for c in plan.prefills),
            target_ms=target_ms,
            draft_passes=list(draft_passes),
            decode_rows=plan.num_decodes,
            context_tokens=sum(r.num_tokens for r in plan.decodes),
        )


@dataclass(slots=True)
class StepRecord:
    """Everything a step tells the K policy and the statistics: fed once per step by the engine."""

    plan: SchedulePlan
    result: StepResult
    timing: StepTiming
    draft_confidence: list[list[float]] | None = None  # Drafts.confidence of the step
    # a draft position the proposer left empty (a confidence stop) still cost it a pass (a draft model)
    unfilled_positions_paid: bool = False


@dataclass(frozen=True, slots=True)
class DraftCandidate:
    """A request of the load as the K policy sees it when deciding who drafts."""

    unseen_tokens: int  # tokens the proposer must process before drafting (1 when caught up)
    tokens_left: int  # tokens the request may still generate
    prompt_tokens: int = 0  # what the drafter reads of its prompt: about what a request taking its slot costs
    max_tokens: int = 1  # its whole output budget, over which that catch-up is repaid
    decoding: bool = (
        True  # False while its prompt is being prefilled (or it waits): it counts, cannot draft yet
    )
    request_id: str = ""  # whose acceptance history applies (per-request K)
    context_tokens: int = 0  # its context (prompt and output so far): what its rows' attention reads
    # a draft it may take at no drafter pass (a suffix match beside a draft model): the estimated
    # probability of each of its tokens given the ones before; empty: none
    free_rates: tuple[float, ...] = ()
    # True where the proposer drafts nothing but that match (model-free: the n-gram), so its rows
    # are priced by their matches alone
    match_only: bool = False

    def catchup_owed(self) -> float:
        """Catch-up tokens the request still owes the drafter, per token it may still generate."""
        return (self.unseen_tokens - 1) / max(1, self.tokens_left) if self.unseen_tokens > 1 else 0.0

    def catchup_per_token(self) -> float:
        """Catch-up tokens drafting in this slot costs per generated token: the larger of what the
        request still owes (its unseen tokens over its tokens left) and the steady-state price of a
        drafting slot under continuous load, where a finished request is replaced by a new one whose
        prompt the drafter must catch up on (one prompt per output budget)."""
        return max(self.catchup_owed(), self.prompt_tokens / max(1, self.max_tokens))


class KPolicy(Protocol):
    """Chooses K for each step; the engine owns it and feeds it one record per step."""

    def choose(self, candidates: Sequence[DraftCandidate]) -> tuple[int, list[int]]:
        """(K chosen for the load, draft tokens wanted per candidate: 0..K each)."""
        ...

    def min_draft_confidence(self) -> float:
        """The drafter's top probability below which a decode stops drafting (0: never)."""
        ...

    def free_rows(self) -> list[bool]:
        """Of the last choice's candidates, which draft their free match (``free_rates``); empty:
        none."""
        ...

    def observe(self, record: StepRecord) -> None: ...

    def snapshot(self) -> dict: ...
