"""A proposer whose only drafts are its matches (the n-gram, ``DraftCandidate.match_only``): the
goodput policy prices each request by its match's tokens, as the target kept tokens of their
confidence, rather than by the request's acceptance so far."""

from support.kpolicy import step_record

from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import Profile


def grid(bs: int, k: int) -> float:  # no drafter pass: a verified row costs 4 ms
    return 40.0 + 4.0 * bs + 4.0 * bs * k


STATS = {bs: {k: grid(bs, k) for k in range(4)} for bs in (1, 2, 4, 8, 16)}


def policy(alpha=(0.9, 0.85, 0.8), **kwargs) -> GoodputK:
    return GoodputK(Profile(3, list(alpha), STATS), 3, hysteresis_steps=1, **kwargs)


def load(n: int, matches: dict[int, tuple[float, ...]]) -> list[DraftCandidate]:
    return [
        DraftCandidate(
            1, 100, request_id=f"r{i}", context_tokens=200, free_rates=matches.get(i, ()), match_only=True
        )
        for i in range(n)
    ]


MATCHES = {0: (0.95, 0.95, 0.95), 3: (0.95,), 7: (0.15, 0.15, 0.15)}


def test_each_request_drafts_what_its_match_is_worth():
    rule = policy()
    _, drafts = rule.choose(load(16, MATCHES))  # a verified token costs 4 ms, a plain token 6.5
    assert drafts[0] == 3 and drafts[3] == 1  # as far as its match goes
    assert drafts[7] == 0  # a weak match is not worth its verified rows
    assert all(d == 0 for i, d in enumerate(drafts) if i not in MATCHES)  # nothing to draft
    assert rule.free_rows() == [] and rule.min_draft_confidence() == 0.0  # the lengths are the stops


def test_without_pricing_matches_a_request_is_priced_by_the_batch_s_acceptance():
    rule = policy(price_matches=False)
    _, drafts = rule.choose(load(16, MATCHES))
    assert drafts[7] == 3 and sum(d > 0 for d in drafts) == 16  # every request, match or not


def test_what_the_target_keeps_of_a_confidence_prices_the_next_match():
    rule = policy()
    rule.choose(load(1, {0: (0.75,)}))
    record = step_record([1], [0])
    record.draft_confidence = [[0.75]]
    for _ in range(40):  # the target keeps none of the 0.75 tokens
        rule.observe(record)
    assert rule.match_calibration.rate(7) < 0.1
    _, drafts = rule.choose(load(16, {0: (0.75, 0.75, 0.75)}))
    assert drafts == [0] * 16
