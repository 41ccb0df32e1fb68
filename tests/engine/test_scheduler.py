"""The scheduler asks the K policy about the load: decodes, then requests still prefilling or waiting."""

import random

import torch

from dynaspec.engine.kv_cache import BlockAllocator
from dynaspec.engine.request import Request
from dynaspec.engine.scheduler import Scheduler, fit_catchup, fit_drafts
from dynaspec.sampling_params import SamplingParams


class Recorder:
    """A K policy that drafts ``k`` (2) for every candidate it may and remembers what it was shown."""

    def __init__(self, k=2):
        self.seen = []
        self.k = k

    def choose(self, candidates):
        self.seen.append([c.decoding for c in candidates])
        return self.k, [self.k if c.decoding else 0 for c in candidates]

    def observe(self, record):
        pass

    def min_draft_confidence(self):
        return 0.0


class NoText:
    def add(self, new_ids):
        return ""


def request(i, prompt_len=100):
    return Request(
        f"r{i}",
        list(range(prompt_len)),
        SamplingParams(max_tokens=20),
        frozenset(),
        4096,
        NoText(),
        torch.Generator(),
    )


def test_k_is_asked_for_the_load_while_arrivals_are_admitted_a_budget_at_a_time():
    recorder = Recorder()
    scheduler = Scheduler(BlockAllocator(1024, 16), max_num_seqs=6, max_num_batched_tokens=250)
    for i in range(8):
        scheduler.add(request(i))
    first = scheduler.schedule(recorder)  # two whole prompts fit the 250-token budget, and half a third
    assert first.decodes == [] and [c.num_tokens for c in first.prefills] == [100, 100, 50]
    assert recorder.seen == []  # nobody decodes yet: the policy is not asked
    for chunk in first.prefills:  # the prefill step ran; its complete prefills sampled a token
        chunk.request.num_computed_tokens += chunk.num_tokens
        if chunk.completes:
            chunk.request.output_token_ids.append(7)
    second = scheduler.schedule(recorder)
    # 350 prompt tokens pending (r2's 50, 3 admissible waiting ones) exceed the 248 the decodes
    # leave: drafts would take budget from prefill, so none are run
    assert len(second.decodes) == 2 and second.k_caps == [0, 0]
    # shown: 2 decoding, then 1 still prefilling and 3 of the 5 waiting (6 = max_num_seqs in all)
    assert recorder.seen == [[True, True, False, False, False, False]]
    assert second.prefills[0].request.request_id == "r2"


def two_decoding():
    """A scheduler with a 120-token budget whose two 50-token prompts are prefilled: both decode."""
    scheduler = Scheduler(BlockAllocator(1024, 16), max_num_seqs=8, max_num_batched_tokens=120)
    for i in range(2):
        scheduler.add(request(i, prompt_len=50))
    for chunk in scheduler.schedule(None).prefills:
        chunk.request.num_computed_tokens += chunk.num_tokens
        chunk.request.output_token_ids.append(7)
    return scheduler


def test_drafts_yield_the_budget_to_pending_prefill_deepest_first():
    assert fit_drafts([5, 2, 5, 0], 20) == [5, 2, 5, 0]  # they fit: unchanged
    assert fit_drafts([5, 2, 5, 0], 7) == [2, 2, 3, 0]  # cut deepest first (ties: the earlier)
    assert fit_drafts([3, 3], 0) == [0, 0] and fit_drafts([3], -5) == [0] and fit_drafts([], 4) == []
    recorder = Recorder()
    scheduler = two_decoding()
    scheduler.add(request(2, prompt_len=115))  # 115 pending: the 2 decodes' tokens leave 3 for drafts
    plan = scheduler.schedule(recorder)
    assert plan.k_caps == [1, 2] and plan.prefills[0].num_tokens == 115
    scheduler.add(request(3, prompt_len=400))  # a burst: more pending than the budget holds
    plan = scheduler.schedule(recorder)
    assert plan.k_caps == [0, 0] and sum(c.num_tokens for c in plan.prefills) == 120 - 2


def test_a_request_near_its_end_leaves_the_draft_room_it_cannot_use_to_the_others():
    scheduler = two_decoding()
    near_end = scheduler.running[1]
    near_end.output_token_ids.extend([7] * 17)  # r1: 2 of its 20 tokens left, room for 1 draft
    near_end.num_computed_tokens += 17
    scheduler.add(request(2, prompt_len=115))  # 115 pending: the 2 decodes' tokens leave 3 for drafts
    plan = scheduler.schedule(Recorder(k=3))
    # r1's 1 is taken out before the room is shared (sharing [3, 3] first gave [1, 2], then [1, 1])
    assert plan.k_caps == [2, 1] and plan.prefills[0].num_tokens == 115


def test_fit_drafts_equals_cutting_the_deepest_one_token_at_a_time():
    def one_at_a_time(wanted, room):  # the rule as stated: cut the deepest (the earlier on ties)
        caps = list(wanted)
        for _ in range(sum(caps) - max(0, room)):
            deepest = max(range(len(caps)), key=caps.__getitem__)
            caps[deepest] -= 1
        return caps

    rng = random.Random(0)
    for _ in range(2000):
        wanted = [rng.randint(0, 6) for _ in range(rng.randint(0, 12))]
        room = rng.randint(-3, sum(wanted) + 3)
        assert fit_drafts(wanted, room) == one_at_a_time(wanted, room), (wanted, room)


def test_drafter_catchup_obeys_the_token_budget_oldest_first():
    assert fit_catchup([3, 3, 3], [1, 1, 1], 0) == [3, 3, 3]  # caught-up requests always draft
    assert fit_catchup([5, 5], [0, 0], 0) == [5, 5] and fit_catchup([], [], 10) == []  # n-gram: nothing owed
    # 200 + 90 fit 300; the first that does not fit goes anyway (the oldest waiting catch-up always
    # proceeds, however long its prompt); the next waits
    assert fit_catchup([3, 3, 3, 3, 3], [200, 90, 50, 40, 1], 300) == [3, 3, 3, 0, 3]
    assert fit_catchup([0, 2, 2, 2], [900, 2, 600, 5], 100) == [0, 2, 2, 0]
    seen = {}  # request id -> tokens the drafter has seen
    scheduler = Scheduler(
        BlockAllocator(1024, 16),
        max_num_seqs=8,
        max_num_batched_tokens=300,
        unseen_tokens=lambda r: r.num_tokens - seen.get(r.request_id, 0),
    )
    for i in range(4):
        scheduler.add(request(i, prompt_len=150))
    while any(not r.is_decoding for r in scheduler.running) or scheduler.waiting:  # prefill, no drafts
        for chunk in scheduler.schedule(None).prefills:
            chunk.request.num_computed_tokens += chunk.num_tokens
            if chunk.completes:
                chunk.request.output_token_ids.append(7)
    plan = scheduler.schedule(Recorder())  # the backlog clears and all four would start drafting
    assert plan.k_caps == [2, 2, 0, 0]  # 151 fits 300, 302 goes as the first over, the rest wait
    for r in plan.decodes[:2]:  # the drafter caught up on the first two
        seen[r.request_id] = r.num_tokens
    assert scheduler.schedule(Recorder()).k_caps == [2, 2, 2, 2]  # the other two catch up now
