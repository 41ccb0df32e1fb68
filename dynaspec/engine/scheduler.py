"""Continuous batching: who runs this step, how many tokens each, and K for the decodes.

The scheduler owns requests and KV blocks, never tensors. Decoding requests run first, each with
room reserved for K draft tokens; the rest of the token budget goes to prefill chunks, so a long
prompt never stalls running decodes for more than one chunk. Drafts never take budget from pending
prefill: when the prompts waiting or being prefilled need more than the decodes' own tokens leave
of the budget (a burst, such as a rollout's start), the drafts are cut to what is left, deepest
first, after each is capped at one token fewer than its request has left (so a request near its end
leaves the room it cannot use to the others). A draft row is worth at most one token and costs what
a prompt token costs, and a prompt held back delays every token of its request. A draft model's
catch-up (the tokens of a request it has not seen, a whole prompt when the request starts drafting)
obeys the same token budget in the drafter's pass: requests whose catch-up does not fit draft in a
later step (all but the oldest of them), so a batch that starts drafting at once (a burst clearing)
catches up over several steps, not in one that stalls every request. When blocks run out, the
newest running request is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

from dynaspec.engine.kv_cache import BlockAllocator
from dynaspec.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from dynaspec.engine.types import (
    DraftCandidate,
    KPolicy,
    PrefillChunk,
    SchedulePlan,
    StepResult,
    TokenLogprob,
)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        unseen_tokens: Callable[[Request], int] = lambda request: 0,
        catchup_tokens: Callable[[int], int] = lambda context_tokens: context_tokens,
        free_rates: Callable[[Request], tuple[float, ...]] = lambda request: (),
        matches_only: bool = False,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # tokens the proposer must catch up on before it can draft for a request (0 for ngram)
        self.unseen_tokens = unseen_tokens
        # what catching up on a new request's prompt of n tokens would make it read (its window)
        self.catchup_tokens = catchup_tokens
        # a draft a decode may take at no drafter pass, its tokens' estimated probabilities (a
        # suffix match beside a draft model; () for every other proposer)
        self.free_rates = free_rates
        self.matches_only = matches_only  # ... and where those matches are all it drafts (the n-gram)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._released: list[str] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit_computed(self, request: Request, num_tokens: int) -> bool:
        """Run a waiting request as if its first ``num_tokens`` prompt tokens were computed (their
        K/V is whatever their blocks hold; the caller fills it): the profiler times steps over long
        contexts without prefilling them. False (nothing changed) where the blocks are not free."""
        if request not in self.waiting or not 0 <= num_tokens < request.num_tokens:
            raise ValueError("admit_computed: a waiting request and fewer tokens than its prompt")
        if not self.allocator.grow(request.block_ids, num_tokens):
            return False
        self.waiting.remove(request)
        request.cacheable = False  # its K/V is the caller's, not its tokens'
        request.num_computed_tokens = num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    self._finish(r, FinishReason.ABORT)
                    return r
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, k_policy: KPolicy | None) -> SchedulePlan:
        """Plan one step; ``k_policy`` (None: no speculation) chooses K for the decodes."""
        decodes = [r for r in self.running if r.is_decoding]
        chosen_k, wanted, min_confidence, free = 0, [0] * len(decodes), 0.0, []
        if k_policy is not None and decodes:
            pending = self._pending()
            load = self._load(decodes + pending)
            chosen_k, wanted = k_policy.choose(load)
            free_rows = getattr(k_policy, "free_rows", None)  # optional: a policy without it takes none
            if free_rows is not None and any(c.free_rates for c in load):  # decodes taking their match
                free = free_rows()[: len(decodes)]
            wanted = [min(w, max(0, r.tokens_left - 1)) for r, w in zip(decodes, wanted)]  # room to grow
            backlog = sum(r.num_tokens - r.num_computed_tokens for r in pending)  # prompt tokens to prefill
            wanted = fit_drafts(wanted, self.max_num_batched_tokens - len(decodes) - backlog)
            # the decodes come first; one drafting its match feeds the drafter nothing
            owed = [0 if f else c.unseen_tokens for c, f in itertools.zip_longest(load[: len(decodes)], free)]
            wanted = fit_catchup(wanted, owed, self.max_num_batched_tokens)
            min_confidence = k_policy.min_draft_confidence()
        free_of = dict(zip((r.request_id for r in decodes), free))
        k_caps: dict[str, int] = {}
        for r, want in zip(list(decodes), wanted):
            if r.status is not RequestStatus.RUNNING:  # preempted to make room for an older one
                continue
            if not self._reserve(r, r.num_tokens + want):
                continue
            k_caps[r.request_id] = want
        decodes = [r for r in decodes if r.request_id in k_caps]
        budget = self.max_num_batched_tokens - sum(1 + c for c in k_caps.values())

        prefills = []
        for r in [r for r in self.running if not r.is_decoding]:
            if budget <= 0:
                break
            chunk = min(r.num_tokens - r.num_computed_tokens, budget)
            if self._reserve(r, r.num_computed_tokens + chunk, allow_preempt=False):
                prefills.append(PrefillChunk(r, chunk))
                budget -= chunk
        held: list[Request] = []  # waiting for a prefix another request is computing
        in_flight = self._prefixes_in_flight()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            keys = self._prompt_keys(r)
            cached = self.allocator.cached_prefix(keys)
            if cached < len(keys) and keys[cached] in in_flight:
                held.append(r)
                continue
            r.block_ids = self.allocator.acquire(keys[:cached])
            r.num_computed_tokens = r.num_cached_tokens = cached * self.allocator.block_size
            chunk = min(r.num_tokens - r.num_computed_tokens, budget)
            end = r.num_computed_tokens + chunk
            # admit only with a block of headroom per running request, so decodes can grow
            if self.allocator.blocks_needed(r.block_ids, end) + len(self.running) > self.allocator.num_free:
                self.allocator.free(r.block_ids)
                r.num_computed_tokens = r.num_cached_tokens = 0
                self.waiting.appendleft(r)
                break
            self.allocator.grow(r.block_ids, end)
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            prefills.append(PrefillChunk(r, chunk))
            budget -= chunk
            in_flight.update(keys[cached:])
        self.waiting.extendleft(reversed(held))

        released, self._released = self._released, []
        return SchedulePlan(
            decodes=decodes,
            k_caps=[k_caps[r.request_id] for r in decodes],
            prefills=prefills,
            chosen_k=chosen_k,
            min_draft_confidence=min_confidence,
            released=released,
            free_rows=[free_of.get(r.request_id, False) for r in decodes] if free_of else [],
        )

    def _prompt_keys(self, r: Request) -> list[bytes]:
        """The keys of the full blocks a request about to prefill may take from the prefix cache:
        all but its last token's (whose logits it needs; a preempted request's output tokens
        count too), none where its blocks may not be shared or it asks for the prompt's logprobs
        (every prompt position's logits)."""
        if not (self.allocator.prefix_caching and r.cacheable) or r.prompt_logprobs is not None:
            return []
        size = self.allocator.block_size
        return r.keys_upto((r.num_tokens - 1) // size, size)

    def _prefixes_in_flight(self) -> set[bytes]:
        """The prompt blocks that requests prefilling now will register: a waiting request whose
        next uncached block is one of them waits (``held``) and takes it once computed, so the n
        samples of one prompt (or one prompt sent n times at once) compute it once."""
        if not (self.allocator.prefix_caching and self.waiting):
            return set()
        return {key for r in self.running if not r.is_decoding for key in self._prompt_keys(r)}

    def _register(self, r: Request) -> None:
        """Register ``r``'s full blocks whose K/V and tokens are now all known (``prefix_caching``)."""
        if not (self.allocator.prefix_caching and r.cacheable):
            return
        size = self.allocator.block_size
        full = min(r.num_computed_tokens, r.num_tokens) // size
        done = r.num_registered_blocks
        if full > done:
            for block, key in zip(r.block_ids[done:full], r.keys_upto(full, size)[done:]):
                self.allocator.register(block, key)
            r.num_registered_blocks = full

    def _pending(self) -> list[Request]:
        """Requests whose prompts await prefill: those prefilling, and waiting ones up to max_num_seqs."""
        room = max(0, self.max_num_seqs - len(self.running))
        prefilling = [r for r in self.running if not r.is_decoding]
        return prefilling + list(itertools.islice(self.waiting, room))  # no copy of the whole queue

    def _load(self, load: list[Request]) -> list[DraftCandidate]:
        """The load K is chosen for: the decodes first, then the requests that will share their steps
        before they can draft (``_pending``)."""
        return [
            DraftCandidate(
                unseen_tokens=self.unseen_tokens(r),
                tokens_left=r.tokens_left,
                prompt_tokens=self.catchup_tokens(len(r.prompt_token_ids)),
                max_tokens=r.params.max_tokens,
                decoding=r.is_decoding,
                request_id=r.request_id,
                context_tokens=r.num_tokens,
                free_rates=self.free_rates(r) if r.is_decoding else (),
                match_only=self.matches_only,
            )
            for r in load
        ]

    def update(self, plan: SchedulePlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's tokens: advance computed counts, append, finish and free."""
        for chunk in plan.prefills:
            r = chunk.request
            r.num_computed_tokens += chunk.num_tokens
            self._register(r)
            if r.prompt_logprobs is not None:
                r.prompt_logprobs.extend(result.prompt_logprobs.get(r.request_id, []))
        outputs = []
        logprobs = result.logprobs or [None] * len(result.token_ids)
        for r, tokens, token_logprobs in zip(plan.sampled, result.token_ids, logprobs):
            if r.status is not RequestStatus.RUNNING:
                continue
            if r.is_decoding:  # the last token and the accepted drafts now have valid K/V
                r.num_computed_tokens += len(tokens)
            emitted = []
            finished = r.tokens_left == 0  # max_tokens 0: the prompt was only scored
            if finished:
                r.finish_reason = FinishReason.LENGTH
            for t in [] if finished else tokens:
                emitted.append(t)
                if r.append(t):
                    finished = True
                    break
            self._register(r)  # the accepted drafts' blocks (K/V past an emitted stop is not)
            new_logprobs = None
            if token_logprobs is not None:
                new_logprobs = token_logprobs[: len(emitted)]
                r.output_logprobs.extend(new_logprobs)
            if finished:
                self.running.remove(r)
                self._finish(r, r.finish_reason)
            outputs.append(_output(r, emitted, new_logprobs))
        return outputs

    def _finish(self, r: Request, reason: FinishReason | None) -> None:
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        self.allocator.free(r.block_ids)
        self._released.append(r.request_id)

    def _reserve(self, r: Request, num_tokens: int, allow_preempt: bool = True) -> bool:
        """Blocks for ``num_tokens`` tokens of ``r``, preempting newer requests if needed."""
        while not self.allocator.grow(r.block_ids, num_tokens):
            if not allow_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.allocator.free(r.block_ids)
        r.num_computed_tokens = r.num_registered_blocks = 0
        r.status = RequestStatus.WAITING
        self.waiting.appendleft(r)
        self._released.append(r.request_id)
        self.num_preemptions += 1


def _output(
    r: Request, new_token_ids: list[int], new_logprobs: list[TokenLogprob] | None = None
) -> RequestOutput:
    finished = r.status is RequestStatus.FINISHED
    return RequestOutput(
        request_id=r.request_id,
        new_token_ids=new_token_ids,
        finished=finished,
        finish_reason=r.finish_reason,
        output_token_ids=list(r.output_token_ids),
        text=r.output_text,
        num_prompt_tokens=len(r.prompt_token_ids),
        num_cached_tokens=r.num_cached_tokens,
        new_logprobs=new_logprobs,
        prompt_logprobs=r.prompt_logprobs if finished else None,
    )


def fit_drafts(wanted: list[int], room: int) -> list[int]:
    """Draft lengths cut to at most ``room`` tokens in all, the deepest first (each request keeps
    as many as it can of what it wanted; ties: the earlier first); unchanged when they fit.

    Cutting the deepest one token at a time levels the lengths down to a water level L (the
    highest with sum(min(wanted, L)) <= room); the tokens left over go one each to the requests
    that wanted more than L, the later first (a tie cut the earlier)."""
    room = max(0, room)
    if sum(wanted) <= room:
        return list(wanted)
    level = 0
    while sum(min(w, level + 1) for w in wanted) <= room:
        level += 1
    caps = [min(w, level) for w in wanted]
    spare = room - sum(caps)
    for i in reversed(range(len(caps))):
        if spare == 0:
            break
        if wanted[i] > level:
            caps[i] += 1
            spare -= 1
    return caps


def fit_catchup(wanted: list[int], owed: list[int], room: int) -> list[int]:
    """Drafts kept where the drafter's catch-up fits: a request that drafts first feeds the
    drafter the ``owed`` tokens it has not seen (its whole prompt when it starts drafting; 1 when
    caught up, 0 for a proposer without a model: a row like the target's, never held back), and
    those catch-ups, like the target's pass, hold at most ``room`` tokens. Requests are taken in
    order (the oldest first); one whose catch-up does not fit what is left drafts nothing this step
    and catches up in a later one, except the first such, so the oldest waiting catch-up always
    proceeds, however long its prompt."""
    caps, used, over = list(wanted), 0, False
    for i, (w, o) in enumerate(zip(wanted, owed)):
        if not w or o <= 1:
            continue
        if used + o > room:
            if over:
                caps[i] = 0
                continue
            over = True
        used += o
    return caps
