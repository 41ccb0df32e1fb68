"""A profile's cost model against its own ITL grid (issue 37): the constrained fit, the check,
the fallback to pricing from the grid, and the K the goodput policy settles on when live steps
cost what the profile says. Pure functions, no model."""

import functools
import itertools
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.kpolicy import step_record

from dynaspec.engine.types import StepTiming
from dynaspec.kpolicy.config import table_lookup
from dynaspec.kpolicy.cost import (
    FIT_TOLERANCE_MS,
    GridBounds,
    fit_bounded,
    fit_timings,
    grid_misfit,
    prior_from_grid,
)
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import (
    Profile,
    acceptance_length,
    checked_cost_model,
    derive_table,
    interpolate_itl,
    load_profile,
    smooth_itl,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
DEGENERATE = FIXTURES / "profile_auto_draft_pair_degenerate.json"
HAND_MADE = FIXTURES / "profile_qwen_pair_humaneval_zen4.json"  # = results/zen4/..._7.json


def test_fit_bounded_is_least_squares_inside_the_box_and_the_box_optimum_outside():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.uniform(1, 30, 40), rng.uniform(0, 5, 40)])
    inside = x @ np.array([4.0, 2.0, 0.5]) + rng.normal(0, 0.1, 40)
    free = np.linalg.lstsq(x, inside, rcond=None)[0]
    assert fit_bounded(x.tolist(), inside.tolist(), [0] * 3, [10, np.inf, np.inf]) == pytest.approx(
        free, abs=1e-4
    )
    # a negative slope and an intercept above its bound: held at the bounds, and no point of the
    # box fits better
    outside = x @ np.array([20.0, -1.0, 0.5]) + rng.normal(0, 0.1, 40)
    lo, hi = [0.0, 0.0, 0.0], [10.0, np.inf, np.inf]
    coef = np.array(fit_bounded(x.tolist(), outside.tolist(), lo, hi))
    assert coef[0] <= 10.0 and coef[1] >= 0.0 and coef[2] >= 0.0
    loss = np.sum((x @ coef - outside) ** 2)
    for _ in range(2000):
        other = np.clip(coef + rng.normal(0, 0.5, 3), lo, hi)
        assert np.sum((x @ other - outside) ** 2) >= loss - 1e-6
    assert fit_bounded([], [], [], []) == []


def test_fit_timings_keeps_the_drafter_pass_within_what_the_grid_allows():
    """Drafter passes whose few small-row samples are slow (first passes of a shape) fit a large
    intercept and a negative slope per row by plain least squares; within the grid's bounds the
    intercept is at most the cheapest increment per pass and the slope is not negative."""
    grid = {bs: {k: 20.0 + 3.0 * bs * (k + 1) + k * (8.0 + 1.0 * bs) for k in range(4)} for bs in (1, 4, 16)}
    passes = [(1, 0, 70.0), (1, 0, 75.0), (2, 0, 60.0), (16, 0, 20.0), (16, 0, 22.0), (8, 0, 40.0)]
    timings = [StepTiming(bs, 0, 20.0 + 3.0 * bs, [p]) for bs, p in zip((1, 1, 2, 16, 16, 8), passes)]
    plain = fit_timings(timings)["draft_pass_ms"]
    assert plain[1] == 0.0 and plain[0] > 40  # non-negative, but nothing bounds the intercept
    bounded = fit_timings(timings, grid)
    bounds = GridBounds.of(grid)
    assert bounded["draft_pass_ms"][0] <= bounds.pass_ms and bounded["draft_pass_ms"][1] >= 0.0
    assert bounded["target_ms"][0] <= bounds.plain_ms
    assert bounds.pass_ms == pytest.approx(min(3.0 * bs + 8.0 + bs for bs in (1, 4, 16)) + FIT_TOLERANCE_MS)


def test_grid_misfit_allows_a_step_overhead_and_catches_a_contradiction():
    target, draft = [20.0, 3.0, 3.0], [8.0, 1.0, 0.5]
    truth = {bs: {k: 20.0 + 3.0 * bs * (k + 1) + k * (8.0 + bs) for k in range(6)} for bs in (1, 2, 4, 8)}
    assert grid_misfit(target, draft, truth) == []
    overhead = {bs: {k: ms + 6.0 for k, ms in row.items()} for bs, row in truth.items()}
    assert grid_misfit(target, draft, overhead) == []  # sampling and scheduling are not timed passes
    bad = grid_misfit([90.0, 2.8, 3.0], [74.8, 0.0, 0.7], truth)  # the model, clamped
    assert bad and all(predicted > measured for _, _, predicted, measured in bad)
    assert grid_misfit(target, draft, {}) == []


def test_the_hand_made_profile_keeps_its_cost_model(caplog):
    with caplog.at_level(logging.WARNING):
        profile = load_profile(HAND_MADE)
    assert profile.cost_model == {
        "target_ms": [17.183778, 3.1557, 2.519249],
        "draft_pass_ms": [5.601689, 0.981856, 0.752463],
    }
    assert not caplog.records
    assert not GoodputK(profile, 5).costs.shared_scale


def test_a_degenerate_cost_model_is_dropped_on_load_with_a_notice_naming_the_file(tmp_path, caplog):
    path = tmp_path / "auto.json"
    shutil.copy(DEGENERATE, path)
    with caplog.at_level(logging.WARNING):
        profile = load_profile(path)
    assert profile.cost_model is None
    assert any(
        str(path) in r.getMessage() and "pricing passes from the grid" in r.getMessage()
        for r in caplog.records
    )
    # the same model given in memory is dropped by the policy itself
    raw = Profile(
        **{
            **profile.to_json(),
            "cost_model": {"target_ms": [90.53, 2.85, 3.07], "draft_pass_ms": [74.84, -3.39, 0.716]},
        }
    )
    assert GoodputK(raw, 5).costs.shared_scale
    target, draft = prior_from_grid(smooth_itl(profile.batch_stats))
    bounds = GridBounds.of(smooth_itl(profile.batch_stats))
    assert 0 <= draft[0] <= bounds.pass_ms and 0 <= target[0] <= bounds.plain_ms
    assert min(target[1:] + draft[1:]) >= 0


def step_timing(grid, bs, k, target_share):
    """A live step that costs what the profile's grid says: ``target_share`` of ITL(bs, K) is the
    target pass, the rest of the drafting part K equal drafter passes over bs rows, and what is
    left of ITL(bs, 0) a step overhead the passes do not time."""
    step = interpolate_itl(grid, bs, k)
    plain = interpolate_itl(grid, bs, 0)
    target = target_share * plain + (step - plain) * target_share
    passes = [(bs, 0, (step - plain) * (1 - target_share) / k)] * k if k else []
    return StepTiming(bs * (k + 1), 0, target, passes)


def steady_k(policy, bs, timing, steps=40):
    """K at load ``bs`` after ``steps`` steps timed by ``timing(bs, K)`` (acceptance as profiled)."""
    for _ in range(steps):
        k = policy.k_for_batch(bs)
        policy.observe(step_record([], [], timing(bs, k)))
    return policy.k_for_batch(bs)


@pytest.mark.parametrize("target_share", [0.6, 0.8, 1.0])
def test_the_degenerate_auto_profile_drafts_the_grids_k(target_share):
    """The issue's profile: its grid says K=4 at batch 1 (and its table K=3 at 2, 1 at 3-4, 0 from
    5); its cost model priced a drafter pass at 71 ms and the policy never drafted."""
    profile = load_profile(DEGENERATE)
    assert profile.num_speculative_tokens_per_batch_size[0] == [1, 1, 4]
    grid = smooth_itl(profile.batch_stats)
    policy = GoodputK(profile, 5)
    assert policy.k_for_batch(1) == 4
    for bs in (1, 2, 4, 8, 16, 1):
        timing = functools.partial(step_timing, grid, target_share=target_share)
        assert steady_k(policy, bs, timing) == table_lookup(profile.num_speculative_tokens_per_batch_size, bs)


def random_profile(rng: random.Random) -> tuple[Profile, list[int], Callable[[int, int], StepTiming]]:
    """A sound grid (a linear machine with a step overhead and a few percent of noise per cell)
    with a noisy cost model: near the machine's, or degenerate as the issue's, or none. Also the
    machine's live steps: its target pass and drafter passes, scaled so that with the overhead
    they add up to the (smoothed, interpolated) grid."""
    max_k = rng.randint(1, 5)
    a, b = rng.uniform(5, 40), rng.uniform(0.3, 5)
    d, e = rng.uniform(0, 12), rng.uniform(0, 2)
    overhead = rng.uniform(0, 10)
    sizes = sorted(rng.sample([1, 2, 3, 4, 6, 8, 12, 16, 24, 32], rng.randint(2, 6)))
    grid = {
        bs: {
            k: round((overhead + a + b * bs * (k + 1) + k * (d + e * bs)) * rng.uniform(0.97, 1.03), 3)
            for k in range(max_k + 1)
        }
        for bs in sizes
    }
    alpha = sorted((rng.uniform(0.2, 0.99) for _ in range(max_k)), reverse=True)
    kind = rng.choice(["near", "degenerate", "none"])
    if kind == "near":
        noise = [rng.uniform(0.95, 1.05) for _ in range(6)]
        cost = [a * noise[0], b * noise[1], b * noise[2]], [d * noise[3], e * noise[4], e / 2 * noise[5]]
    elif kind == "degenerate":  # the intercepts take the slopes' share, the slopes turn negative
        cost = [a + 5 * b * max(sizes), -b, b], [d + 5 * e * max(sizes) + 50, -rng.uniform(0, 5), e]
    cost_model = None if kind == "none" else {"target_ms": cost[0], "draft_pass_ms": cost[1]}
    profile = Profile(max_k, [round(x, 4) for x in alpha], grid, cost_model=cost_model)
    profile.num_speculative_tokens_per_batch_size = derive_table(alpha, grid, max_k)
    smoothed = smooth_itl(grid)

    def timing(bs: int, k: int) -> StepTiming:
        target, one_pass = a + b * bs * (k + 1), d + e * bs
        scale = (interpolate_itl(smoothed, bs, k) - overhead) / (target + k * one_pass)
        return StepTiming(bs * (k + 1), 0, target * scale, [(bs, 0, one_pass * scale)] * k)

    return profile, sizes, timing


def clear_choice(profile: Profile, grid, bs: int, margin: float) -> bool:
    """Whether the best K's goodput at bs beats every other K's by ``margin`` (relative)."""
    scores = sorted(
        (
            acceptance_length(profile.acceptance_rate_per_pos, k) / interpolate_itl(grid, bs, k)
            for k in range(profile.max_num_speculative_tokens + 1)
        ),
        reverse=True,
    )
    return len(scores) < 2 or scores[0] > scores[1] * (1 + margin)


def test_steady_state_k_equals_the_derived_table_over_random_profiles():
    """Live steps that cost what the profile's grid says (split between target and drafter as
    the machine splits them) settle on the profile's derived table, whatever the cost model the
    profile came with: a sound one (within 5% of the machine) is kept and rescales to ~1, a
    degenerate one or none prices passes from the grid. Batch sizes where two Ks' goodputs are
    within 10% are left out: a kept model 5% off the machine may tilt those."""
    rng = random.Random(37)
    checked = 0
    for _ in range(60):
        profile, sizes, timing = random_profile(rng)
        grid = smooth_itl(profile.batch_stats)
        policy = GoodputK(profile, profile.max_num_speculative_tokens)
        for bs in itertools.chain(sizes, [max(sizes) + 3]):
            wanted = table_lookup(profile.num_speculative_tokens_per_batch_size, bs)
            if bs > max(sizes):
                wanted = derive_table(
                    profile.acceptance_rate_per_pos,
                    profile.batch_stats,
                    profile.max_num_speculative_tokens,
                    bs,
                )[-1][2]
            if not clear_choice(profile, grid, bs, 0.10):
                continue
            assert steady_k(policy, bs, timing) == wanted, (profile, bs)
            checked += 1
    assert checked > 100


OUTLIER_ROW = FIXTURES / "profile_auto_pair_zen4_outlier_row.json"  # = results/zen4/longtail40/


def test_a_grid_fit_leaves_out_the_row_every_other_row_contradicts():
    """The zen4 auto profile timed ITL(24, 1..4) at 1,046-1,160 ms beside ITL(16, 1) 310 ms: fitted
    with that row the drafter pass came out free (all of it in the verified token), so a drafter
    layer of one row was priced at a quarter of its cost. Without the row the fit agrees with the
    profile's own timed passes (13.7 ms + 1.7 a row in its notice)."""
    profile = load_profile(OUTLIER_ROW)
    grid = smooth_itl(profile.batch_stats)
    target, draft = prior_from_grid(grid, profile.catchup_ms_per_token)
    assert draft[0] == pytest.approx(14.0, abs=1.0) and draft[1] == pytest.approx(1.7, abs=0.3)
    rest = {bs: row for bs, row in grid.items() if bs != 24}
    assert grid_misfit(target, draft, rest) == []
    assert {cell[0] for cell in grid_misfit(target, draft, grid)} == {24}
    # the policy then prices a drafter layer of one row at about one pass
    policy = GoodputK(profile, 5)
    lone_layer = policy.drafted_cost(4, (4, 1)) - policy.drafted_cost(4, (4,))
    assert lone_layer > 0.8 * (draft[0] + draft[1])


# a grid of 5 rows that obeys target 20 + 3 ms a verified token and a drafter pass of 8 + 1 ms a row
TRUTH = {bs: {k: 20.0 + 3.0 * bs * (k + 1) + k * (8.0 + bs) for k in range(6)} for bs in (1, 2, 4, 8, 16)}


def drafting_rows_off(grid: dict, sizes: tuple[int, ...]) -> dict:
    """The grid with the drafting cells (K >= 1) of the rows ``sizes`` three times their cost."""
    return {
        bs: {k: ms * (3.0 if bs in sizes and k else 1.0) for k, ms in row.items()} for bs, row in grid.items()
    }


def test_a_grid_of_few_rows_or_two_rows_out_of_line_is_fitted_whole():
    assert prior_from_grid(TRUTH)[1][:2] == pytest.approx([8.0, 1.0], abs=1e-3)
    one_off = drafting_rows_off(TRUTH, (16,))
    assert prior_from_grid(one_off)[1][:2] == pytest.approx([8.0, 1.0], abs=1e-3)  # fitted without bs 16
    four_rows = {bs: row for bs, row in one_off.items() if bs != 1}
    assert prior_from_grid(four_rows)[1][:2] != pytest.approx([8.0, 1.0], abs=0.5)
    two_off = drafting_rows_off(TRUTH, (8, 16))
    assert prior_from_grid(two_off)[1][:2] != pytest.approx([8.0, 1.0], abs=0.5)


def test_a_cost_model_only_one_row_contradicts_is_kept(caplog):
    """The check reads the smoothed grid, whose columns rise with bs: a row out of line below the
    top one is pooled with the rows above it, and two rows contradict the model (a fallback)."""
    model = {"target_ms": [20.0, 3.0, 3.0], "draft_pass_ms": [8.0, 1.0, 0.5]}

    def with_grid(grid):
        return Profile(
            max_num_speculative_tokens=5,
            acceptance_rate_per_pos=[0.8, 0.7, 0.6, 0.5, 0.4],
            batch_stats=grid,
            num_speculative_tokens_per_batch_size=[[1, 16, 1]],
            cost_model=model,
        )

    one_off = drafting_rows_off(TRUTH, (16,))
    with caplog.at_level(logging.WARNING):
        assert checked_cost_model(with_grid(one_off), "one_off") == model
    assert any("batch size 16" in r.getMessage() for r in caplog.records)
    two_off = drafting_rows_off(TRUTH, (8, 16))
    assert checked_cost_model(with_grid(two_off), "two_off") is None
    few = {bs: row for bs, row in one_off.items() if bs != 1}
    assert checked_cost_model(with_grid(few), "few") is None
