"""K policies and the profile file: pure functions, no model."""

import itertools
import json

import pytest
from support.kpolicy import step_record

from dynaspec.kpolicy.acceptance import AcceptanceEstimate
from dynaspec.kpolicy.config import SpeculativeConfig, table_lookup
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.hysteresis import Hysteresis
from dynaspec.kpolicy.policy import FixedK, TableK, make_policy
from dynaspec.kpolicy.profile import (
    Profile,
    acceptance_length,
    best_k,
    derive_table,
    extra_request_ms,
    interpolate_itl,
    load_profile,
    save_profile,
    smooth_itl,
)

# verification is cheap at small batch sizes and expensive at large ones, as on a real machine
STATS = {
    1: {0: 100.0, 1: 104.0, 2: 108.0, 3: 112.0, 4: 118.0},
    8: {0: 120.0, 1: 150.0, 2: 185.0, 3: 220.0, 4: 260.0},
    32: {0: 200.0, 1: 400.0, 2: 560.0, 3: 700.0, 4: 850.0},
}
ALPHA = [0.8, 0.65, 0.5, 0.4]
COST_NO_DRAFTER = {"target_ms": [90.0, 4.0, 4.0], "draft_pass_ms": [0.0, 0.0, 0.0]}
COST_DRAFTER = {"target_ms": [90.0, 4.0, 4.0], "draft_pass_ms": [3.0, 0.5, 0.2]}


def profile(alpha=ALPHA, stats=STATS, max_k=4) -> Profile:
    return Profile(max_k, list(alpha), {bs: dict(row) for bs, row in stats.items()})


def test_itl_interpolates_between_extends_above_and_clamps_below():
    assert interpolate_itl(STATS, 1, 2) == 108.0
    assert interpolate_itl(STATS, 4, 0) == pytest.approx(100 + 20 * 3 / 7)
    assert interpolate_itl(STATS, 20, 4) == pytest.approx(260 + 590 * 12 / 24)
    assert interpolate_itl(STATS, 64, 1) == pytest.approx(400 + 250 / 24 * 32)  # the last segment's slope
    assert interpolate_itl({8: {0: 90.0}, 16: {0: 80.0}}, 32, 0) == 80.0  # never downwards
    assert interpolate_itl({16: {0: 80.0}}, 32, 0) == 80.0  # one size: held
    assert interpolate_itl({2: {0: 50.0}}, 1, 0) == 50.0  # clamped below
    assert interpolate_itl(STATS, 4, 9) is None  # K never profiled


def test_past_the_grid_a_drafting_column_rises_at_least_k_plus_1_times_as_fast():
    """A low cell at the grid's edge (zen3's suffix auto profile ended at 12 requests with K=5 ahead
    there) no longer decides every larger batch: per extra request K=5 verifies 6 tokens, so its
    column rises at least 6 times as fast as the plain one past the grid."""
    edge = {  # a compute-bound CPU: 20 ms a verified row; K=5's last cell came out low
        8: {0: 200.0, 5: 1000.0},
        12: {0: 280.0, 5: 1050.0},
    }
    assert extra_request_ms(edge, 0) == pytest.approx(20.0)
    assert extra_request_ms(edge, 5) == pytest.approx(6 * 20.0)  # its own slope (12.5) was lower
    assert interpolate_itl(edge, 32, 5) == pytest.approx(1050 + 120 * 20)
    assert interpolate_itl(edge, 32, 0) == pytest.approx(280 + 20 * 20)
    alpha = [0.9, 0.8, 0.7, 0.6, 0.5]  # AL(5) = 4.5 tokens a step
    assert best_k(alpha, edge, 12, 5) == 5  # inside the grid, as measured
    table = derive_table(alpha, edge, 5, up_to=64)
    assert table[-1] == [table[-1][0], 64, 0]  # past the grid the plain step wins again
    # a column that rises faster on its own keeps its slope
    steep = {8: {0: 200.0, 1: 300.0}, 12: {0: 280.0, 1: 500.0}}
    assert extra_request_ms(steep, 1) == pytest.approx(50.0)


def test_acceptance_length_holds_each_rate_to_the_one_before():
    """A model-free drafter's rates are per token proposed and may rise with the position (it
    proposes long drafts only on long matches); unconditional rates cannot, as the live estimate
    holds them, so the derived table prices what the policy will."""
    suffix = [0.41, 0.8, 0.94, 0.96, 0.96]  # zen3's suffix auto profile
    assert acceptance_length(suffix, 5) == pytest.approx(1 + 5 * 0.41)
    assert acceptance_length(ALPHA, 4) == pytest.approx(1 + sum(ALPHA))  # already non-increasing
    assert acceptance_length(suffix, 0) == 1.0
    estimate = AcceptanceEstimate(suffix, 5)
    assert acceptance_length(estimate.rates(), 5) == pytest.approx(acceptance_length(suffix, 5))


def test_big_k_when_verification_is_cheap_and_k0_when_expensive():
    assert best_k(ALPHA, STATS, 1, 4) == 4
    assert best_k(ALPHA, STATS, 32, 4) == 0
    assert 0 < best_k(ALPHA, STATS, 8, 4) < 4


def test_no_crash_on_empty_or_zero_data():
    assert best_k([], {}, 4, 5) == 0
    assert best_k(ALPHA, {1: {0: 0.0, 1: 0.0}}, 1, 4) == 0
    assert derive_table(ALPHA, {}, 4) == [[1, 1, 0]]
    policy = GoodputK(Profile(3, [], {}), 3)
    policy.observe(step_record([], []))
    policy.observe(step_record([3, 0], [0, 0]))
    assert policy.k_for_batch(0) == 0 and policy.k_for_batch(5) == 0
    assert policy.snapshot()["policy"] == "goodput"
    assert AcceptanceEstimate([], 0).rates() == []


def test_goodput_k_moves_with_live_acceptance():
    policy = GoodputK(profile(), 4, hysteresis_steps=1)
    assert policy.k_for_batch(8) == best_k(ALPHA, STATS, 8, 4)
    start = policy.k_for_batch(8)
    for _ in range(200):  # the drafter turns useless: nothing accepted
        policy.observe(step_record([start or 1] * 8, [0] * 8))
    assert policy.k_for_batch(8) == 0
    assert policy.k_for_batch(1) <= 1
    for _ in range(400):  # now everything drafted at K=1 is accepted: positions above follow
        policy.observe(step_record([1] * 8, [1] * 8))
    rates = policy.acceptance.rates()
    assert rates[0] > 0.95 and rates[1] > 0.6
    assert policy.k_for_batch(1) == 4


def test_acceptance_estimate_scales_the_profile_decline_above_observed_positions():
    # with no traffic yet: the profile as it is
    assert AcceptanceEstimate([0.8, 0.4, 0.2], 3).rates() == pytest.approx([0.8, 0.4, 0.2])
    est = AcceptanceEstimate([0.8, 0.4, 0.2], 3, prior_weight=0.0)
    est.observe([1] * 10, [0] * 5 + [1] * 5)  # only position 0 drafted: half accepted, not 0.8
    s = 0.5 / 0.8  # each of the profile's chances of i given i-1 (0.5) scaled as position 0 was
    assert est.rates() == pytest.approx([0.5, 0.5 * 0.5 * s, 0.5 * (0.5 * s) ** 2])
    # a chat-shaped profile (0.6, then 0.7 a position) serving code that accepts 0.9 at position 0:
    # the positions not drafted yet expect 0.7 * 0.9 / 0.6 (capped at 1) a position, not 0.7
    chat = [0.6, 0.42, 0.294, 0.2058]
    est = AcceptanceEstimate(chat, 4, prior_weight=0.0)
    est.observe([1] * 10, [1] * 9 + [0])
    assert est.rates() == pytest.approx([0.9, 0.9, 0.9, 0.9])
    est.observe([2] * 10, [2] * 6 + [1] * 3 + [0])  # position 1 measured: 0.6, 2/3 of position 0
    r = est.rates()
    s1 = (0.6 / 0.9) / 0.7  # its chance given position 0, against the profile's
    assert r[:2] == pytest.approx([0.9, 0.6]) and r[2] == pytest.approx(0.6 * s1 * 0.7)
    assert r[3] == pytest.approx(r[2] * s1 * 0.7)
    # guards: nothing accepted, an all-zero profile
    zero = AcceptanceEstimate([0.5, 0.2], 2, prior_weight=0.0)
    zero.observe([1] * 4, [0] * 4)
    assert zero.rates() == [0.0, 0.0]
    assert AcceptanceEstimate([0.0, 0.0], 2).rates() == [0.0, 0.0]


def test_statistics_tell_acceptance_per_proposed_and_per_asked_position():
    # an n-gram proposer asked for 2 tokens proposes for one request of two
    from dynaspec.spec_decode.stats import SpecStats

    stats = SpecStats()
    stats.observe(step_record([2, 0], [1, 0], asked=[2, 2]))
    assert stats.acceptance_rate_per_pos == [1.0, 0.0]
    assert stats.acceptance_rate_per_asked_pos == [0.5, 0.0]
    assert stats.to_dict()["acceptance_rate_per_asked_pos"] == [0.5, 0.0]
    stats.observe(step_record([0], [0], asked=[3]))  # a position asked for and never proposed counts
    assert stats.acceptance_rate_per_pos == [1.0, 0.0]
    assert stats.acceptance_rate_per_asked_pos == [1 / 3, 0.0, 0.0]


def test_hysteresis_holds_k_across_a_boundary_flip():
    h = Hysteresis(3)
    assert h.update(4) == 4
    assert [h.update(k) for k in (2, 4, 2, 2)] == [4, 4, 4, 4]
    assert h.update(2) == 2


def test_table_semantics_gap_above_and_clamp():
    table = ((1, 4, 5), (8, 16, 2), (17, 64, 0))
    assert [table_lookup(table, bs) for bs in (1, 4, 5, 7, 8, 16, 17, 500)] == [5, 5, 5, 5, 2, 2, 0, 0]
    policy = TableK(table, max_k=3, hysteresis_steps=1)
    assert policy.k_for_batch(1) == 3  # clamped to num_speculative_tokens
    assert policy.k_for_batch(10) == 2 and policy.k_for_batch(0) == 0
    assert FixedK(3).k_for_batch(7) == 3 and FixedK(3).k_for_batch(0) == 0


def test_a_derived_table_goes_past_the_grid_along_its_slopes():
    """Drafting pays at the largest profiled batch size, but each request costs a drafting step
    twice what it costs a plain one, so past the grid K=1 stops paying (holding the last row's
    times would keep K=1 forever)."""
    grid = {8: {0: 100.0, 1: 110.0}, 16: {0: 120.0, 1: 150.0}}
    assert derive_table([0.5], grid, 1)[-1] == [1, 16, 1]
    table = derive_table([0.5], grid, 1, up_to=64)
    assert table[0] == [1, table[0][1], 1] and table[-1][1:] == [64, 0]
    # K=1 pays while 1.5 bs / (150 + 5 (bs - 16)) > bs / (120 + 2.5 (bs - 16)): below bs 40 (a tie)
    assert table[-1][0] == 40


def test_profile_round_trip_and_derived_table(tmp_path):
    p = profile()
    p.num_speculative_tokens_per_batch_size = derive_table(ALPHA, STATS, 4)
    table = p.num_speculative_tokens_per_batch_size
    assert table[0][0] == 1 and table[0][2] == 4 and table[-1][2] == 0 and table[-1][1] == 32
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(table))
    path = tmp_path / "profile.json"
    save_profile(p, path)
    loaded = load_profile(path)
    assert loaded.batch_stats == p.batch_stats and loaded.acceptance_rate_per_pos == ALPHA
    config = SpeculativeConfig.parse({"method": "ngram", "dynamic_config_path": str(path)})
    policy = make_policy(config)
    assert isinstance(policy, GoodputK) and policy.k_for_batch(1) == 4


@pytest.mark.parametrize(
    "content, field",
    [
        ("{not json", "invalid JSON"),
        ("[]", "top level"),
        (json.dumps({"acceptance_rate_per_pos": []}), "max_num_speculative_tokens"),
        (
            json.dumps({"max_num_speculative_tokens": 2, "acceptance_rate_per_pos": [1.5]}),
            "acceptance_rate_per_pos",
        ),
        (json.dumps({"max_num_speculative_tokens": 2, "batch_stats": {"x": {}}}), "batch_stats"),
        (json.dumps({"max_num_speculative_tokens": 2, "batch_stats": {"1": {"0": -3}}}), "batch_stats"),
    ],
)
def test_malformed_profile_is_refused(tmp_path, content, field):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"profile .*bad.json: .*{field}"):
        load_profile(path)
    with pytest.raises(ValueError, match="profile .*"):
        make_policy(SpeculativeConfig.parse({"method": "ngram", "dynamic_config_path": str(path)}))


def test_smoothing_removes_a_noisy_dip_that_would_flip_k():
    # the real pair's bs=1 row: K=3 measured 14 ms above K=2 and 90 ms below K=4
    noisy = {1: {0: 198.9, 1: 248.2, 2: 275.4, 3: 289.6, 4: 379.5, 5: 419.5}}
    alpha = [0.89, 0.85, 0.80, 0.76, 0.74]
    assert best_k(alpha, noisy, 1, 5) == 3  # the dip wins on the raw grid
    smooth = smooth_itl(noisy)
    steps = [smooth[1][k + 1] - smooth[1][k] for k in range(1, 5)]
    assert max(steps) - min(steps) < 1e-2  # K >= 1 on one line
    assert smooth[1][0] == noisy[1][0]  # K=0 (no drafter) kept as measured
    assert best_k(alpha, smooth, 1, 5) == 5


def test_smoothing_makes_each_k_non_decreasing_in_batch_size_and_keeps_clean_grids():
    noisy = {1: {0: 199.0}, 2: {0: 185.0}, 4: {0: 202.0}, 8: {0: 244.0}}
    smooth = smooth_itl(noisy)
    assert [smooth[bs][0] for bs in (1, 2, 4, 8)] == [
        192.0,
        192.0,
        202.0,
        244.0,
    ]  # the dip pooled with its neighbour
    clean = {bs: {k: 100.0 + 5 * bs * (k + 1) + k * (10 + 2 * bs) for k in range(5)} for bs in (1, 4, 16)}
    smoothed = smooth_itl(clean)
    assert all(smoothed[bs] == pytest.approx(clean[bs]) for bs in clean)
    assert smooth_itl({}) == {}
    assert smooth_itl({1: {0: 0.0, 1: -3.0}, 2: {}}) == {1: {}, 2: {}}  # unknown cells stay unknown


def test_goodput_policy_and_derived_table_use_the_smoothed_grid():
    noisy = {1: {0: 198.9, 1: 248.2, 2: 275.4, 3: 289.6, 4: 379.5, 5: 419.5}}
    alpha = [0.89, 0.85, 0.80, 0.76, 0.74]
    assert GoodputK(Profile(5, alpha, noisy), 5, 1).k_for_batch(1) == 5
    assert derive_table(alpha, noisy, 5) == [[1, 1, 5]]


def test_a_plain_cell_above_the_drafting_line_is_capped_before_it_pools_its_neighbours():
    # measured: ITL(2, 0) = 764 ms between 331 at batch 1 and 390 at batch 4 (a hiccup)
    grid = {
        1: {0: 331.5, 1: 397.7, 2: 480.5, 3: 530.8, 4: 595.3, 5: 709.9},
        2: {0: 763.8, 1: 521.0, 2: 611.7, 3: 712.1, 4: 806.4, 5: 882.5},
        4: {0: 389.6, 1: 552.3, 2: 651.7, 3: 742.5, 4: 988.0, 5: 1044.8},
    }
    smooth = smooth_itl(grid)
    assert smooth[2][0] < 450  # put back on the drafting line at K=0 (~432)
    assert smooth[4][0] < 420  # and batch 4 is no longer pooled up with it
    assert smooth[1][0] == pytest.approx(331.5)  # a plain cell below the line stays as measured


def test_request_rates_start_at_the_batch_and_follow_the_request():
    from dynaspec.kpolicy.acceptance import RequestAcceptance, per_token_acceptance, request_rates

    batch = [0.9, 0.85, 0.8, 0.75]
    assert request_rates(0.0, 0.0, batch) == pytest.approx(batch)  # no history: the batch's rates
    beta = per_token_acceptance(batch)
    assert beta == pytest.approx(sum(batch) / (1 + 0.9 + 0.85 + 0.8))
    # 2 accepted of 10 trials, shrunk with 4 pseudo-trials at beta: (2 + 4 beta) / 14 per token
    own = (2 + 4 * beta) / 14
    low = request_rates(2.0, 10.0, batch)
    assert low == pytest.approx([min(1.0, a * (own / beta) ** (i + 1)) for i, a in enumerate(batch)])
    high = request_rates(40.0, 40.0, batch)
    assert all(h >= b for h, b in zip(high, batch)) and all(x <= 1.0 for x in high)
    for rates in (high, low):  # non-increasing
        assert all(x >= y for x, y in itertools.pairwise(rates))
    assert request_rates(1.0, 1.0, []) == [] and request_rates(0.0, 0.0, [0.0, 0.0]) == [0.0, 0.0]
    # the update: trials are the positions verification reached; old steps decay by 0.9
    est = RequestAcceptance(decay=0.9, weight=4.0)
    est.observe(["a", "b", "c"], [4, 4, 0], [4, 1, 0])
    assert est.counts == {"a": (4.0, 4.0), "b": (1.0, 2.0)}  # c drafted nothing: no record
    est.observe(["a"], [3, 0][:1], [0])
    assert est.counts["a"] == pytest.approx((3.6, 4.6))
    # a request that drafts nothing in a step decays towards the batch's rates
    est.observe(["a", "b"], [0, 0], [0, 0])
    assert est.counts["a"] == pytest.approx((3.24, 4.14)) and est.counts["b"] == pytest.approx((0.9, 1.8))
    est.release(["a"])
    assert "a" not in est.counts and est.rates("a", batch) == pytest.approx(batch)


def test_a_position_cut_by_a_paid_confidence_stop_counts_as_not_accepted():
    """With a drafter that pays a pass for a stopped position acceptance is per position asked: a
    stopped one added no token. A model-free proposer's unfilled positions cost nothing and are not
    counted, with confidences (suffix) or without (n-gram)."""
    from dynaspec.engine.types import StepRecord

    # decode 0 asked for 3, stopped after 1 (accepted); decode 1 proposed all 3, accepted 2
    plain = step_record([1, 3], [1, 2], asked=[3, 3])
    confidences = [[0.9, 0.1], [0.9, 0.8, 0.7]]
    suffix = StepRecord(plain.plan, plain.result, plain.timing, confidences)
    drafter = StepRecord(plain.plan, plain.result, plain.timing, confidences, unfilled_positions_paid=True)
    counted = {}
    for name, record in (("ngram", plain), ("suffix", suffix), ("drafter", drafter)):
        policy = GoodputK(profile(), 3, hysteresis_steps=1)
        policy.acceptance.decay = 1.0
        policy.observe(record)
        counted[name] = (policy.acceptance.drafted, policy.acceptance.accepted)
    assert counted["ngram"] == counted["suffix"] == ([2, 1, 1], [2, 1, 0])
    assert counted["drafter"] == ([2, 2, 2], [2, 1, 0])


def test_confidence_calibration_stops_below_break_even():
    from dynaspec.kpolicy.acceptance import ConfidenceCalibration

    cal = ConfidenceCalibration(decay=1.0, prior_weight=4.0)
    assert cal.threshold(0.0) == 0.0  # verification is free: never stop
    assert cal.threshold(0.32) == pytest.approx(0.3)  # the prior: bins accept at their centre
    assert cal.threshold(1.0) == cal.MAX_THRESHOLD
    # the target accepts the drafter's 0.6-0.7 tokens rarely: that bin joins the stop once the run
    # of bins below it does too
    for _ in range(200):
        cal.observe([[0.65, 0.05]], [2], [0])  # reached 0.65 (rejected); 0.05 never reached
        cal.observe([[0.15, 0.25, 0.35, 0.45, 0.55]], [5], [5])
    assert cal.rate(6) < 0.05 and cal.rate(0) == pytest.approx(0.05)  # unreached: the prior only
    assert cal.threshold(0.32) == pytest.approx(0.1)  # bins 1..5 now accept everything
    cal.observe([], [], [])  # empty steps never crash


def test_calibration_by_position_prices_the_first_token_apart():
    """Matches whose first token the target keeps 40% of the time and later ones 80% (the n-gram on
    chat): bins pooled over positions expect the first too high; bins by position learn both."""
    import random

    from dynaspec.kpolicy.acceptance import ConfidenceCalibration

    rng = random.Random(0)
    pooled, by_position = ConfidenceCalibration(decay=1.0), ConfidenceCalibration(decay=1.0, positions=3)
    for _ in range(2000):
        accepted = 0
        while accepted < 4 and rng.random() < (0.4 if accepted == 0 else 0.8):
            accepted += 1
        for cal in (pooled, by_position):
            cal.observe([[0.45] * 4], [4], [accepted])
    first = by_position.expected([0.45] * 3)
    assert first[0] == pytest.approx(0.4, abs=0.03)
    assert first[1] == pytest.approx(0.4 * 0.8, abs=0.03) and first[2] == pytest.approx(0.4 * 0.64, abs=0.03)
    assert pooled.expected([0.45])[0] > 0.5  # first and later tokens in one bin
    assert len(by_position.snapshot()) == 3 and by_position.snapshot()[0][4] == pytest.approx(0.4, abs=0.03)
    assert by_position.threshold(0.5) == pytest.approx(0.5)  # the first position's bins set the stop


def test_refine_drafts_gives_k_to_the_requests_that_accept():
    from dynaspec.kpolicy.goodput import refine_drafts

    def layer(rows, j):  # a drafter pass of 10 ms plus 4 ms per verified token
        return 10.0 + 4.0 * rows

    good, poor = [0.95, 0.9, 0.85, 0.8], [0.3, 0.1, 0.05, 0.02]

    def drafted(m, free=0):  # a free request's draft tokens are verified only: 4 ms each
        return sum(layer(c, j) for j, c in enumerate(m) if c) + 4.0 * free

    def goodput(ks, rates):
        m = [sum(k > j for k in ks) for j in range(4)]
        tokens = len(ks) + sum(sum(r[:k]) for r, k in zip(rates, ks))
        return tokens / (50.0 + drafted(m))

    rates = [good, poor, good, poor]
    start = [2, 2, 2, 2]  # a uniform K
    ks, expected = refine_drafts(start, rates, [0.0] * 4, [4] * 4, drafted, 50.0, 4)
    assert ks[0] > ks[1] and ks[2] > ks[3]
    assert goodput(ks, rates) > goodput(start, rates) and expected == pytest.approx(goodput(ks, rates))
    # caps hold (tokens left, prefilling requests), charges withhold a request, empty is fine
    assert refine_drafts([4, 4], [good, good], [0.0, 0.0], [1, 0], drafted, 50.0, 2)[0] == [1, 0]
    assert refine_drafts([0, 0], [good, good], [0.0, 1e6], [4, 4], drafted, 50.0, 2)[0][1] == 0
    assert refine_drafts([], [], [], [], drafted, 50.0, 0)[0] == []
    # a request with a free draft (a suffix match) pays no drafter pass: it drafts all of a good
    # one where the same rates through the drafter pay for fewer
    through_drafter = refine_drafts([0], [good], [0.0], [4], drafted, 20.0, 1)[0]
    assert refine_drafts([0], [good], [0.0], [4], drafted, 20.0, 1, free=[True])[0] == [4] != through_drafter


def test_drafts_are_priced_at_the_whole_loads_row_of_the_grid():
    """What drafts add to a step of bs requests comes from the grid's row at bs, read between its
    K columns by the rows drafted, less those K's drafter passes over bs rows plus the passes run:
    a uniform K over the load costs ITL(bs, K) - ITL(bs, 0), and 4 rows on a step of 8 cost half
    of ITL(8, 1) - ITL(8, 0), not ITL(4, 1) - ITL(4, 0) as if they ran alone."""
    ngram = Profile(4, list(ALPHA), {bs: dict(r) for bs, r in STATS.items()}, cost_model=COST_NO_DRAFTER)
    rule = GoodputK(ngram, 4)
    itl = {k: rule.itl(8, k) for k in range(5)}  # the smoothed grid's row at 8
    assert rule.drafted_cost(8, (8, 8)) == pytest.approx(itl[2] - itl[0])
    assert rule.drafted_cost(8, (4,)) == pytest.approx((itl[1] - itl[0]) / 2)
    assert rule.drafted_cost(8, (8, 4)) == pytest.approx((itl[1] + itl[2]) / 2 - itl[0])
    assert rule.drafted_cost(8, ()) == 0.0
    pair = Profile(4, list(ALPHA), {bs: dict(r) for bs, r in STATS.items()}, cost_model=COST_DRAFTER)
    rule = GoodputK(pair, 4)
    itl = {k: rule.itl(8, k) for k in range(5)}
    one_pass = rule.costs.draft_pass_ms
    assert one_pass(8) == pytest.approx(3.0 + 0.5 * 8) and one_pass(0) == 0.0
    assert rule.drafted_cost(8, (8, 8, 8)) == pytest.approx(itl[3] - itl[0])
    # 2 rows drafting 3 positions: 6 of the load's rows (K = 0.75) and three passes over 2 rows
    expected = 0.75 * (itl[1] - itl[0]) - 0.75 * one_pass(8) + 3 * one_pass(2)
    assert rule.drafted_cost(8, (2, 2, 2)) == pytest.approx(expected)


def test_the_uniform_choice_prices_its_drafting_rows_as_per_request_k_does():
    """One row drafting on a step of 8 costs an eighth of ITL(8, 1) - ITL(8, 0) (35 ms here), not
    ITL(1, 1) - ITL(1, 0) (1 ms, as if it ran alone): one accepted token in 0.8 is not worth that
    where a plain token costs 15 ms, so neither rule drafts; where the load's row is cheap, both do."""
    from dynaspec.engine.types import DraftCandidate

    def chosen(stats, per_request):
        grid = Profile(1, [0.8], stats, cost_model=COST_NO_DRAFTER)
        rule = GoodputK(grid, 1, hysteresis_steps=1, per_request=per_request, explore_below=0.0)
        return rule.choose([DraftCandidate(1, 100, request_id=str(i)) for i in range(8)])

    dear = {1: {0: 100.0, 1: 101.0}, 8: {0: 120.0, 1: 400.0}}
    cheap = {1: {0: 100.0, 1: 101.0}, 8: {0: 120.0, 1: 125.0}}
    for per_request in (False, True):
        assert chosen(dear, per_request) == (0, [0] * 8)
        assert chosen(cheap, per_request) == (1, [1] * 8)
