"""The profile's context axis: long-context cells timed without their prefill, a cost fitted on
them, and a goodput policy whose K falls where long contexts make verified rows dear."""

import math

import pytest
from support.engine import GREEDY, PROMPTS, make_engine, run_alone, run_staggered

from dynaspec.bench.common import without_context_axis
from dynaspec.engine.profiler import ProfileSettings, measure_context_itl, measure_itl
from dynaspec.engine.types import DraftCandidate, StepTiming
from dynaspec.kpolicy.context import FLOOR, ContextCost, fit_context_cost, fit_context_cost_by_batch
from dynaspec.kpolicy.cost import StepCostModel
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import (
    Profile,
    context_cost_by_batch_of,
    context_cost_of,
    context_model,
    load_profile,
    save_profile,
)

ALPHA = [0.8, 0.64, 0.51, 0.41, 0.33]
REFERENCE = 300.0
U, V = 0.9, 0.6  # ms per row per 1,000 context tokens, and per draft position


def true_itl(bs: int, k: int, context: float = REFERENCE) -> float:
    """A CPU-like step: 20 ms of weights, 1.5 ms a verified row, 4 ms a drafter pass, plus context."""
    return 20.0 + 1.5 * bs * (k + 1) + 4.0 * k + bs * (context - REFERENCE) / 1000 * (U + V * k)


def profile_of(contexts=(4096,), sizes=(1, 2, 4, 8, 16)) -> Profile:
    return Profile(
        max_num_speculative_tokens=5,
        acceptance_rate_per_pos=ALPHA,
        batch_stats={bs: {k: true_itl(bs, k) for k in range(6)} for bs in sizes},
        context_tokens=REFERENCE,
        context_stats={
            c: {bs: {k: true_itl(bs, k, c) for k in (0, 3, 5)} for bs in (1, 4, 8)} for c in contexts
        },
    )


def test_the_fit_recovers_what_context_adds_per_row_and_per_draft():
    profile = profile_of()
    u, v = context_cost_of(profile)
    assert u == pytest.approx(U, rel=1e-3) and v == pytest.approx(V, rel=1e-3)
    # no cell beyond the grid's context: nothing to fit
    assert fit_context_cost(lambda bs, k: 1.0, {200: {1: {0: 5.0}}}, REFERENCE) is None
    # a cell cheaper than the grid (noise) cannot make context free or negative
    u, v = fit_context_cost(lambda bs, k: 50.0, {4096: {1: {0: 40.0, 5: 45.0}}}, REFERENCE)
    assert u == 0.0 and v == 0.0


def test_context_cost_moves_a_step_along_the_line_and_never_below_the_floor():
    cost = ContextCost(REFERENCE, U, V)
    assert cost.itl(40.0, 4, REFERENCE, 3) == 40.0
    assert cost.itl(40.0, 4, None, 3) == 40.0  # unknown context: the grid's
    assert cost.itl(40.0, 4, 2300.0, 3) == pytest.approx(40.0 + 4 * 2.0 * (U + 3 * V))
    assert cost.itl(40.0, 64, 0.0, 3) == FLOOR * 40.0


def test_the_profile_keeps_its_context_axis_through_a_file(tmp_path):
    profile = profile_of(contexts=(2048, 4096))
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded.context_tokens == REFERENCE and loaded.context_stats == profile.context_stats
    assert loaded.context_cost == pytest.approx([U, V], rel=1e-3)  # fitted on load
    # a profile without the axis stays as it was
    plain = Profile(
        max_num_speculative_tokens=1, acceptance_rate_per_pos=[0.5], batch_stats={1: {0: 5.0, 1: 7.0}}
    )
    save_profile(plain, path)
    assert "context" not in path.read_text() and load_profile(path).context_cost is None
    path.write_text(path.read_text().replace('"meta"', '"context_cost": [1.0], "meta"'))
    with pytest.raises(ValueError, match="context_cost"):
        load_profile(path)


# what a draft row adds per 1,000 context tokens, by batch size: falling with it, as the xeon's
# cells at 4,096 tokens did (11.6, 7.9 and 5 ms a draft row at 1, 4 and 8 requests)
V_BY_BATCH = {1: 3.0, 2: 2.6, 4: 2.0, 8: 1.3, 16: 1.3}


def true_itl_by_batch(bs: int, k: int, context: float = REFERENCE) -> float:
    return 20.0 + 1.5 * bs * (k + 1) + 4.0 * k + bs * (context - REFERENCE) / 1000 * (U + V_BY_BATCH[bs] * k)


def profile_by_batch(cell_sizes=(1, 2, 4, 8)) -> Profile:
    return Profile(
        max_num_speculative_tokens=5,
        acceptance_rate_per_pos=ALPHA,
        batch_stats={bs: {k: true_itl_by_batch(bs, k) for k in range(6)} for bs in (1, 2, 4, 8, 16)},
        context_tokens=REFERENCE,
        context_stats={
            4096: {bs: {k: true_itl_by_batch(bs, k, 4096) for k in (0, 3, 5)} for bs in cell_sizes}
        },
    )


def test_the_context_cost_is_fitted_per_batch_size_and_read_at_the_step_s():
    profile = profile_by_batch()
    fitted = context_cost_by_batch_of(profile)
    assert sorted(fitted) == [1, 2, 4, 8]
    for bs, (u, v) in fitted.items():
        assert u == pytest.approx(U, rel=1e-3) and v == pytest.approx(V_BY_BATCH[bs], rel=1e-3)
    cost = context_model(profile)
    assert cost.coefficients(1) == pytest.approx((U, 3.0), rel=1e-3)
    assert cost.coefficients(6) == pytest.approx((U, 1.65), rel=1e-3)  # halfway between 4 and 8
    assert cost.coefficients(32) == pytest.approx((U, 1.3), rel=1e-3)  # held beyond the last
    assert cost.extra_ms(2, 2300.0, 3) == pytest.approx(2 * 2.0 * (U + 3 * 2.6), rel=1e-3)
    # a batch size with cells at one K only is left to the one line; none at all: the one line
    one_k = {4096: {1: {0: 30.0}, 4: {0: 60.0, 5: 200.0}}}
    assert sorted(fit_context_cost_by_batch(lambda bs, k: 20.0, one_k, REFERENCE)) == [4]
    assert ContextCost(REFERENCE, U, V).coefficients(3) == (U, V)


def test_k_by_batch_size_equals_the_best_k_of_the_true_costs_where_one_line_does_not():
    """With the per-batch-size fit the policy's K at long contexts is the argmax of goodput over the
    true step costs at every batch size the cells cover; the one line over all of them gets some
    wrong."""
    profile = profile_by_batch()
    one_line = Profile(**{**profile.__dict__, "context_cost_by_batch": {}})
    wrong = 0
    for bs in (1, 2, 4, 8):
        for context in (300, 2000, 4096, 8000):
            best = max(range(6), key=lambda k: (1 + sum(ALPHA[:k])) / true_itl_by_batch(bs, k, context))
            aware = GoodputK(profile, 5, hysteresis_steps=1, per_request=False)
            assert aware.k_for_batch(bs, context) == best, (bs, context)
            line = GoodputK(one_line, 5, hysteresis_steps=1, per_request=False)
            wrong += line.k_for_batch(bs, context) != best
    assert wrong


def test_the_per_batch_context_cost_goes_through_a_file(tmp_path):
    profile = profile_by_batch()
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert "context_cost_by_batch" not in path.read_text()  # fitted on load
    loaded = load_profile(path)
    assert sorted(loaded.context_cost_by_batch) == [1, 2, 4, 8]
    save_profile(loaded, path)
    assert '"context_cost_by_batch": {' in path.read_text()
    assert load_profile(path).context_cost_by_batch == loaded.context_cost_by_batch
    path.write_text(
        path.read_text().replace('"context_cost_by_batch": {', '"context_cost_by_batch": {"64": [1.0],')
    )
    with pytest.raises(ValueError, match="context_cost_by_batch"):
        load_profile(path)


def candidates(bs: int, context: int) -> list[DraftCandidate]:
    return [DraftCandidate(1, 1 << 30, context_tokens=context, request_id=str(i)) for i in range(bs)]


def test_k_falls_as_contexts_grow_and_equals_the_best_k_of_the_true_costs():
    """With live timings equal to the profile's, the policy's K at each (batch size, context) is the
    argmax of goodput over the true step costs at that context; a context-blind policy keeps the
    short-context K and loses goodput where contexts are long."""
    profile = profile_of()
    blind = without_context_axis(profile)
    wrong = 0
    chosen = {}
    for bs in (1, 2, 4, 8):
        for context in (300, 2000, 8000, 16000):
            aware = GoodputK(profile, 5, hysteresis_steps=1, per_request=False)
            k = aware.k_for_batch(bs, context)
            best = max(range(6), key=lambda k: (1 + sum(ALPHA[:k])) / true_itl(bs, k, context))
            assert k == best, (bs, context)
            chosen[bs, context] = k
            wrong += (
                GoodputK(blind, 5, hysteresis_steps=1, per_request=False).k_for_batch(bs, context) != best
            )
    assert all(chosen[bs, 16000] <= chosen[bs, 300] for bs in (1, 2, 4, 8))
    assert chosen[8, 16000] < chosen[8, 300]  # long contexts at a wide batch: K falls
    assert wrong  # and the blind policy gets some of them wrong


def test_live_steps_at_long_contexts_read_as_context_not_as_a_slower_machine():
    """The live cost model predicts a long-context target pass with the context's cost, so a machine
    running exactly as profiled keeps a scale of 1 (a blind one would drift up and misprice short
    contexts later)."""
    context = ContextCost(REFERENCE, U, V)
    for cost in (
        StepCostModel([20.0, 1.5, 1.5], [4.0, 0.0, 0.0], context=context),
        StepCostModel([20.0, 1.5, 1.5], [4.0, 0.0, 0.0]),
    ):
        for _ in range(50):
            bs, k, ctx = 8, 2, 4300
            target = 20.0 + 1.5 * bs * (k + 1) + bs * (ctx - REFERENCE) / 1000 * (U + V * k)
            cost.observe(StepTiming(bs * (k + 1), 0, target, [(bs, 0, 4.0)] * k, bs, bs * ctx))
        scale = cost.scales()[0]
        assert math.isclose(scale, 1.0, rel_tol=1e-6) if cost.context else scale > 1.5


def test_long_context_cells_are_timed_without_their_prefill(target_dir, draft_dir):
    """The profiler's long contexts: every cell timed, the prompts' K/V filled rather than
    prefilled (the drafter catches up on a few tokens, not the whole context), blocks given back,
    and a context that does not fit the model is left out with a notice."""
    engine = make_engine(
        target_dir,
        speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2},
    )
    settings = ProfileSettings(
        batch_sizes=[1, 2],
        max_k=2,
        warmup_steps=1,
        measured_steps=1,
        rounds=1,
        revisits=0,
        context_lengths=(300, 5000),
        context_batch_sizes=(1, 2),
    )
    free = engine.allocator.num_free
    contexts = []
    measure_itl(engine, PROMPTS, settings, progress=False, contexts=contexts)
    assert contexts and max(contexts) < 100
    with engine.recording() as run:
        cells = measure_context_itl(engine, PROMPTS, settings, progress=False)
    assert list(cells) == [300] and sorted(cells[300]) == [1, 2]
    assert all(sorted(row) == [0, 1, 2] and min(row.values()) > 0 for row in cells[300].values())
    prefilled = sum(t.prefill_tokens for t in run.timings)
    assert prefilled <= 3 * 16 + 3  # the last 16 tokens of each long prompt, not 300
    caught_up = sum(extra for t in run.timings for _, extra, _ in t.draft_passes)
    assert caught_up < 3 * 40  # the drafter took the skipped tokens as read
    assert engine.allocator.num_free == free


def test_a_profile_with_a_context_axis_keeps_outputs_lossless(target_dir, tmp_path):
    profile = profile_of()
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "dynamic_config_path": str(path)}
    engine = make_engine(target_dir, speculative_config=spec)
    assert run_staggered(engine, PROMPTS, GREEDY) == run_alone(target_dir, PROMPTS)
    snapshot = engine.stats()["spec"]["policy"]
    assert snapshot["context_tokens"] > 0 and snapshot["context_cost"]["reference_tokens"] == REFERENCE
