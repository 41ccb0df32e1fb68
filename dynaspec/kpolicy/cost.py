"""What a step costs, learned from the engine's own timings.

The profile's ITL(bs, K) grid is measured on pure decode steps, on the machine as it was then.
Live steps differ: the machine drifts (2-3x over hours on a shared VM), and a draft model must
first catch up on every new request's prompt before it can draft for it. The profile's
``cost_model`` gives the shape of a step's cost, fitted on every profiled step:

- target pass:  ms = a + b * verify_tokens + c * prefill_tokens
- drafter pass: ms = d + e * rows + f * extra_tokens   (extra: catch-up tokens beyond one per row)

Live traffic only rescales it: one factor for target passes, one for drafter passes, each the
decayed geometric mean of observed / predicted time per pass, starting from 1 as
``prior_weight`` pseudo-observations that fade like old steps, each ratio clipped to
[1/MAX_DRIFT, MAX_DRIFT]. Scales rather than a live regression: live steps sit near one operating
point, where a regression cannot tell an intercept from a slope and puts step noise on the
slopes (the results diary, "live step costs"). Until the drafter has run, it is assumed to drift
like the target (both share the machine).

A profile's model must agree with its own grid (``grid_misfit``): it is fitted with non-negative
slopes and intercepts the grid allows (``fit_bounded``, ``GridBounds``), and one that still
contradicts the grid is replaced by a model fitted on the grid itself (``prior_from_grid``, see
``kpolicy.profile.checked_cost_model``). A quick profile's noisy steps once fitted a 75 ms drafter
pass with a negative slope per row where the grid showed ~10 ms, and the policy never drafted
(issue 37).

The goodput policy uses this two ways: the profile's ITL(bs, K) is multiplied by
``drift(bs, K)``, and ``f`` times the drafter's scale prices a request's catch-up.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dynaspec.engine.types import StepTiming

if TYPE_CHECKING:
    from dynaspec.kpolicy.context import ContextCost

TARGET_FEATURES = ("step", "verify_tokens", "prefill_tokens")
DRAFT_FEATURES = ("pass", "rows", "extra_tokens")
MAX_DRIFT = 3.0


class LiveScale:
    """Observed / predicted time of one kind of pass: a decayed geometric mean, starting at 1."""

    def __init__(self, prior_weight: float = 8.0, decay: float = 0.98) -> None:
        self.decay = decay
        # the prior enters as prior_weight observations of ratio 1, which fade like any old step
        self.log_sum = 0.0
        self.prior = prior_weight  # decayed weight of the prior pseudo-observations
        self.weight = 0.0  # decayed count of live observations
        self.num_observations = 0

    def observe(self, observed_ms: float, predicted_ms: float) -> None:
        if not (_positive(observed_ms) and _positive(predicted_ms)):
            return
        ratio = min(MAX_DRIFT, max(1.0 / MAX_DRIFT, observed_ms / predicted_ms))
        self.log_sum = self.decay * self.log_sum + math.log(ratio)
        self.prior *= self.decay
        self.weight = self.decay * self.weight + 1.0
        self.num_observations += 1

    @property
    def value(self) -> float:
        return math.exp(self.log_sum / (self.weight + self.prior))


class StepCostModel:
    """The profile's pass-cost model, rescaled live; predicts pure-decode ITL(bs, K) and catch-up cost."""

    def __init__(
        self,
        target_prior: Sequence[float],
        draft_prior: Sequence[float],
        prior_weight: float = 8.0,
        decay: float = 0.98,
        shared_scale: bool = False,
        context: ContextCost | None = None,
    ) -> None:
        # plain floats: a choice prices a few dozen steps, and numpy's dot of three numbers was a
        # noticeable share of its host time (with the pricer's pass list, a choice 17-22% faster:
        # results/zen5/le40/choose_ab.sh)
        self.target_coef = tuple(float(c) for c in target_prior)
        self.draft_coef = tuple(float(c) for c in draft_prior)
        self.target_scale = LiveScale(prior_weight, decay)
        self.draft_scale = LiveScale(prior_weight, decay)
        # one scale for every pass, of the step's passes together (a model priced from the grid)
        self.shared_scale = shared_scale
        # the profile's context axis: what a step's contexts add, beyond the grid's, to its target
        # pass (all of it, the drafter's attention included), so that long contexts read as
        # longer contexts, not as a slower machine
        self.context = context

    def observe(self, timing: StepTiming, wall_ms: float = 0.0) -> None:
        """One step's passes against the model; with ``shared_scale`` (a model fitted on the grid's
        whole steps) the step's wall time ``wall_ms`` where given, which holds the step's overhead
        as the grid's cells do (the passes alone read a few percent under them, and the policy
        then took every cell the live steps had not timed for that much cheaper)."""
        target_ms = _predict(self.target_coef, (1.0, timing.verify_tokens, timing.prefill_tokens))
        if self.context is not None and timing.decode_rows:
            rows = timing.decode_rows
            drafts = (timing.verify_tokens - rows) / rows
            target_ms = self.context.itl(target_ms, rows, timing.context_tokens / rows, drafts)
        passes = [
            (ms, _predict(self.draft_coef, (1.0, rows, extra))) for rows, extra, ms in timing.draft_passes
        ]
        if self.shared_scale:
            if all(_positive(ms) for ms in (timing.target_ms, *(ms for ms, _ in passes))):
                observed = timing.target_ms + sum(ms for ms, _ in passes)
                observed = wall_ms if _positive(wall_ms) and wall_ms >= observed else observed
                self.target_scale.observe(observed, target_ms + sum(p for _, p in passes))
            return
        self.target_scale.observe(timing.target_ms, target_ms)
        for ms, predicted in passes:
            self.draft_scale.observe(ms, predicted)

    def scales(self) -> tuple[float, float]:
        """(target, drafter) live / profiled; the drafter follows the target until it has run, and
        always with ``shared_scale``."""
        target = self.target_scale.value
        if self.shared_scale:
            return target, target
        return target, (self.draft_scale.value if self.draft_scale.weight >= 1.0 else target)

    def itl(self, batch_size: int, k: int, prior: bool = False) -> float:
        """Pure decode step: the target verifies bs*(K+1) tokens after K drafter passes over bs rows."""
        target_scale, draft_scale = (1.0, 1.0) if prior else self.scales()
        target = _predict(self.target_coef, (1.0, batch_size * (k + 1), 0.0))
        draft = _predict(self.draft_coef, (1.0, batch_size, 0.0)) if k else 0.0
        return target * target_scale + k * draft * draft_scale

    def drift(self, batch_size: int, k: int) -> float:
        """Live / profiled ITL(bs, K): how much slower (> 1) or faster the machine runs that step now."""
        before = self.itl(batch_size, k, prior=True)
        now = self.itl(batch_size, k)
        if before <= 0 or now <= 0:
            return 1.0
        return min(MAX_DRIFT, max(1.0 / MAX_DRIFT, now / before))

    def draft_pass_ms(self, rows: int, prior: bool = False) -> float:
        """One drafter pass over ``rows`` caught-up requests, now (``prior``: as profiled; 0 for a
        proposer with no drafter)."""
        scale = 1.0 if prior else self.scales()[1]
        return _predict(self.draft_coef, (1.0, rows, 0.0)) * scale if rows else 0.0

    def verify_ms_per_token(self) -> float:
        """What one more verified token adds to a target pass, now."""
        return max(0.0, float(self.target_coef[1])) * self.scales()[0]

    def catchup_ms_per_token(self) -> float:
        return max(0.0, float(self.draft_coef[2])) * self.scales()[1]

    def snapshot(self) -> dict:
        target_scale, draft_scale = self.scales()
        return {
            "target_ms": dict(zip(TARGET_FEATURES, (round(float(c), 4) for c in self.target_coef))),
            "draft_pass_ms": dict(zip(DRAFT_FEATURES, (round(float(c), 4) for c in self.draft_coef))),
            "live_scale": {"target": round(target_scale, 4), "draft": round(draft_scale, 4)},
            "shared_scale": self.shared_scale,
            "observations": {
                "target": self.target_scale.num_observations,
                "draft_passes": self.draft_scale.num_observations,
            },
        }


CELL_PRIOR = (
    0.5  # pseudo-observations of ratio 1 behind a cell's live correction (one step: 71% of its ratio)
)
CELL_DECAY = 0.8  # per observation of that cell: a cell timed every step follows about 5 of them


class CellCorrection:
    """The profile's (smoothed) ITL grid as live steps find it: one drift for the whole grid, and
    each cell's own correction on top.

    The drift (``scale``) is the wall time of whole decode steps (nothing prefilled, the drafter
    caught up) against the grid read at the step's rows, drafts and context: the grid's own
    measure. The cost model's live scales (``StepCostModel``) are no such measure of the grid:
    they compare passes with a linear model fitted over every batch size, which can miss one
    operating point by a third. On zen5 the pair's model put a one-row target pass at 14.6 ms
    where it took 19-25, so its drift read the grid 1.3-1.44x slow while the steps took what the
    grid said, and less so the more a step drafted (the drafter's model fitted better), which
    tilted the choice towards deeper drafts (issue 37, the results diary).

    One drift moves every cell alike, so the grid's cells keep their relative errors: a quick
    profile times a batch-1 cell in a few steps, and on a shared CPU such a cell can be 10-15%
    off. On zen5 an auto profile put ITL(1, 1) at 35.0 ms where fixed K=1 steps in the next
    process took 30.6 (K=2's cell was right, 43.8 against 43.9), so a clear K=1 win (55.4
    against 48.0 tok/s) looked like a tie and the policy drafted K=2. So a step that is one cell
    of the grid (``cell_of``: exactly a profiled batch size decoding, nothing prefilled, every
    request drafting the same K, its drafter caught up) also teaches that cell: the ratio of its
    wall time to the cell's figure at the step's context times the drift, a decayed geometric
    mean per cell starting from 1 (``LiveScale`` with CELL_PRIOR and CELL_DECAY), and the policy
    reads the grid times those ratios (``grid``) times the drift. A cell the policy does not
    choose is seen only when it explores it (``GoodputK``: a neighbouring K close in goodput,
    now and then)."""

    def __init__(self, grid: dict[int, dict[int, float]]) -> None:
        self.base = grid
        self.grid = {bs: dict(row) for bs, row in grid.items()}
        self.max_k = max((k for row in grid.values() for k in row), default=0)
        # whole steps' wall time / the grid's: a whole step is a fair measure, so its prior fades
        # within a few steps (8 steps: 80% live)
        self.scale = LiveScale(prior_weight=2.0)
        self.ratios: dict[tuple[int, int], LiveScale] = {}
        self.steps = 0  # steps observed, cells or not
        self.last_seen: dict[tuple[int, int], int] = {}  # cell -> the step that last timed or tried it

    def whole(self, timing: StepTiming) -> bool:
        """Whether the step was timed whole and only decoded, its drafter caught up: what the
        grid's cells time. A draft model in steady state reads, with its first pass, the tokens
        the last step accepted (up to K a row beyond its one): the profiler's fixed-K cells
        did too, so up to the grid's largest K a row counts as caught up. Requiring none kept
        every drafting step of the pair from its cells (issue 37: only its K=0 steps taught)."""
        passes, rows = timing.draft_passes, timing.decode_rows
        decoded = rows and not timing.prefill_tokens
        caught_up = sum(extra for _, extra, _ in passes) <= rows * self.max_k
        return bool(_positive(timing.step_ms) and decoded and caught_up)

    def cell_of(self, timing: StepTiming, lens: Sequence[int]) -> tuple[int, int] | None:
        """(bs, K) when the step was one cell of the grid, else None."""
        bs = timing.decode_rows
        if not (self.whole(timing) and bs in self.base and len(lens) == bs):
            return None
        k = lens[0]
        if any(n != k for n in lens) or k not in self.base[bs]:
            return None
        passes = timing.draft_passes
        if passes and (len(passes) != k or any(rows != bs for rows, _, _ in passes)):
            return None
        return bs, k

    def drift(self) -> float | None:
        """Live / profiled time of a whole step (None until a step has been timed)."""
        return self.scale.value if self.scale.weight >= 1.0 else None

    def observe_step(self, observed_ms: float, predicted_ms: float) -> None:
        """A whole decode step against the (uncorrected) grid's figure for it."""
        self.scale.observe(observed_ms, predicted_ms)

    def observe(self, cell: tuple[int, int], observed_ms: float, predicted_ms: float) -> None:
        """One step of ``cell``: ``predicted_ms`` is the uncorrected cell at the step's context,
        times the drift."""
        ratio = self.ratios.setdefault(cell, LiveScale(CELL_PRIOR, CELL_DECAY))
        ratio.observe(observed_ms, predicted_ms)
        bs, k = cell
        self.grid[bs][k] = self.base[bs][k] * ratio.value
        self.last_seen[cell] = self.steps

    def due(self, cell: tuple[int, int], every: int) -> bool:
        """Whether ``cell`` has gone ``every`` steps without being timed or tried."""
        return self.steps - self.last_seen.get(cell, -every) >= every

    def tried(self, cell: tuple[int, int]) -> None:
        self.last_seen[cell] = self.steps

    def snapshot(self) -> dict:
        """bs -> K -> [live / profiled, steps seen] for every cell a step has taught."""
        out: dict[str, dict[str, list]] = {}
        for (bs, k), ratio in sorted(self.ratios.items()):
            out.setdefault(str(bs), {})[str(k)] = [round(ratio.value, 4), ratio.num_observations]
        return out


def _positive(ms: object) -> bool:
    return isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0


def _predict(coef: Sequence[float], x: Sequence[float]) -> float:
    """max(0, coef . x) for the models' three features, in plain Python."""
    c0, c1, c2 = coef
    x0, x1, x2 = x
    return max(0.0, float(c0 * x0 + c1 * x1 + c2 * x2))


def fit_linear(xs: Sequence[Sequence[float]], ys: Sequence[float], ridge: float = 1e-6) -> list[float]:
    """Least squares with a whisper of ridge (so a feature that never varied gets 0, not NaN)."""
    if not xs:
        return []
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    coef = np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)
    return [round(float(c), 6) for c in coef]


def fit_bounded(
    xs: Sequence[Sequence[float]],
    ys: Sequence[float],
    lower: Sequence[float],
    upper: Sequence[float],
    ridge: float = 1e-6,
) -> list[float]:
    """Least squares (with ``fit_linear``'s whisper of ridge) with each coefficient held in
    [lower[i], upper[i]] (upper may be ``math.inf``).

    The cost models have 3 or 4 coefficients, so the exact optimum is found by trying every
    active set: each coefficient free, at its lower bound or at its finite upper bound, the free
    ones solved by least squares with the others fixed; the best fit whose free coefficients
    land inside their bounds wins (the optimum of a convex problem over a box is one of them).
    """
    if not xs:
        return []
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    lo = np.asarray(lower, dtype=np.float64)
    hi = np.asarray(upper, dtype=np.float64)
    n = x.shape[1]
    choices = [("free", "lower", "upper") if math.isfinite(hi[i]) else ("free", "lower") for i in range(n)]
    best, best_loss = np.clip(np.zeros(n), lo, hi), math.inf
    for pattern in itertools.product(*choices):
        coef = np.where(np.array([p == "upper" for p in pattern]), hi, lo).astype(np.float64)
        free = [i for i, p in enumerate(pattern) if p == "free"]
        if free:
            xf = x[:, free]
            rest = y - np.delete(x, free, axis=1) @ np.delete(coef, free)
            coef[free] = np.linalg.solve(xf.T @ xf + ridge * np.eye(len(free)), xf.T @ rest)
            if np.any(coef[free] < lo[free] - 1e-9) or np.any(coef[free] > hi[free] + 1e-9):
                continue
        loss = float(np.sum((x @ coef - y) ** 2) + ridge * np.sum(coef**2))
        if loss < best_loss - 1e-12:
            best, best_loss = coef, loss
    return [round(float(c), 6) for c in np.clip(best, lo, hi)]


FIT_TOLERANCE = 0.25  # a cost model's ITL(bs, K) may be this far (relative) off the profile's grid ...
FIT_TOLERANCE_MS = 3.0  # ... or this many ms, whichever is larger


@dataclass(slots=True, frozen=True)
class GridBounds:
    """What a profile's (smoothed) grid allows its cost model.

    A target pass runs inside every step, so its intercept is at most the cheapest plain step,
    ``plain_ms``; K drafter passes run inside ITL(bs, K) and not in ITL(bs, 0), so a pass's
    intercept is at most the cheapest (ITL(bs, K) - ITL(bs, 0)) / K, ``pass_ms``. Both allow the
    grid check's FIT_TOLERANCE_MS on top (a drafter pass the grid shows as free still costs
    something).
    """

    plain_ms: float = math.inf
    pass_ms: float = math.inf

    @classmethod
    def of(cls, grid: dict[int, dict[int, float]]) -> GridBounds:
        plain = [row[0] for row in grid.values() if row.get(0, 0) > 0]
        passes = [
            max(0.0, (ms - row[0]) / k)
            for row in grid.values()
            if row.get(0, 0) > 0
            for k, ms in row.items()
            if k >= 1 and ms > 0
        ]
        return cls(
            min(plain, default=math.inf) + FIT_TOLERANCE_MS, min(passes, default=math.inf) + FIT_TOLERANCE_MS
        )

    def clamp(self, target: Sequence[float], draft: Sequence[float]) -> tuple[list[float], list[float]]:
        """Slopes made non-negative, intercepts put in [0, their bound]."""
        a, *target_slopes = target
        d, *draft_slopes = draft
        return (
            [min(max(0.0, a), self.plain_ms), *(max(0.0, c) for c in target_slopes)],
            [min(max(0.0, d), self.pass_ms), *(max(0.0, c) for c in draft_slopes)],
        )


def grid_misfit(
    target: Sequence[float], draft: Sequence[float], grid: dict[int, dict[int, float]]
) -> list[tuple[int, int, float, float]]:
    """The grid's cells that a cost model contradicts: (bs, K, predicted ms, measured ms).

    The model predicts the passes, bs*(K+1) verified tokens after K drafter passes over bs rows;
    a step also samples, verifies and schedules, which the passes do not time. So the model may
    sit below the grid by one constant step overhead (the median gap, never negative: passes
    cannot take longer than the steps that hold them), and beyond that every known cell must be
    within FIT_TOLERANCE or FIT_TOLERANCE_MS of the grid.
    """
    cells = [(bs, k, ms) for bs, row in grid.items() for k, ms in row.items() if ms > 0]
    if not cells:
        return []
    predicted = [
        _predict(target, (1.0, bs * (k + 1), 0.0)) + (k * _predict(draft, (1.0, bs, 0.0)) if k else 0.0)
        for bs, k, _ in cells
    ]
    overhead = max(0.0, float(np.median([ms - p for (_, _, ms), p in zip(cells, predicted)])))
    return [
        (bs, k, round(p + overhead, 3), ms)
        for (bs, k, ms), p in zip(cells, predicted)
        if abs(p + overhead - ms) > max(FIT_TOLERANCE * ms, FIT_TOLERANCE_MS)
    ]


def fit_timings(
    timings: Sequence[StepTiming], grid: dict[int, dict[int, float]] | None = None
) -> dict[str, list[float]]:
    """The profile's ``cost_model`` section from the steps it timed: slopes non-negative,
    intercepts non-negative and, given the profile's (smoothed) grid, within its ``GridBounds``."""
    bounds = GridBounds.of(grid) if grid else GridBounds()
    tx = [(1.0, t.verify_tokens, t.prefill_tokens) for t in timings if t.target_ms > 0]
    ty = [t.target_ms for t in timings if t.target_ms > 0]
    passes = [p for t in timings for p in t.draft_passes if p[2] > 0]
    return {
        "target_ms": fit_bounded(tx, ty, [0.0] * 3, [bounds.plain_ms, math.inf, math.inf]),
        "draft_pass_ms": fit_bounded(
            [(1.0, r, e) for r, e, _ in passes],
            [ms for _, _, ms in passes],
            [0.0] * 3,
            [bounds.pass_ms, math.inf, math.inf],
        )
        if passes
        else [0.0, 0.0, 0.0],
    }


def prior_from_grid(
    batch_stats: dict[int, dict[int, float]], catchup_ms_per_token: float | None = None
) -> tuple[list[float], list[float]]:
    """A cost model priced from the grid itself (profiles without a ``cost_model``, or whose
    model contradicts their grid): fit ITL = a + b*bs*(K+1) + K*(d + e*bs) on the grid, slopes
    non-negative, intercepts within ``GridBounds`` (pass the smoothed grid).

    The grid has no prefill or catch-up. The prefill slope is guessed from the decode one (prefill
    token = verify token); the catch-up slope is ``catchup_ms_per_token``, the profile's timing of
    the drafter over whole prompts, where it has one, else guessed as half a drafter row. That
    guess rests on e, which the grid pins poorly (its columns K*bs and bs*(K+1) move together):
    two quick profiles of the pair on xeon guessed 0.33 and 3.9 ms a token where both timed 2.6-2.7,
    and the dearer guess kept 2 HumanEval requests from ever drafting (issue 37). The intercept a holds
    the step's overhead too, which live target passes do not time: a model from the grid is
    rescaled live by one scale for all passes (``StepCostModel(shared_scale=True)``).

    A row that every other row contradicts is left out (``without_outlying_row``): a zen4 auto
    profile of the pair timed ITL(24, 1..4) at 1,046-1,160 ms (a second profile minutes later:
    440 ms at K=1) beside 310 ms at ITL(16, 1), and the fit over every row put the whole drafter pass into
    the verified token (drafter pass 0 + 0 ms a row, 9.3 ms a token, against 14.0 + 1.7 and 6.6
    without that row), so a drafter layer of one row was priced at a quarter of its cost and the
    per-request policy drafted ragged, deep rows at four requests at 0.82x none's speed (the
    results diary, "The long-tailed code rollout on a slower zen4 host").
    """
    return without_outlying_row(batch_stats, catchup_ms_per_token)


def _fit_grid(
    batch_stats: dict[int, dict[int, float]], catchup_ms_per_token: float | None
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for bs, row in batch_stats.items():
        for k, ms in row.items():
            if ms > 0:
                xs.append((1.0, bs * (k + 1), k, k * bs))
                ys.append(ms)
    if len(xs) < 4:
        return [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    bounds = GridBounds.of(batch_stats)
    a, b, d, e = fit_bounded(xs, ys, [0.0] * 4, [bounds.plain_ms, math.inf, bounds.pass_ms, math.inf])
    catchup = e / 2 if catchup_ms_per_token is None else catchup_ms_per_token
    return [a, b, b], [d, e, round(catchup, 6)]


OUTLIER_ROWS_FROM = 5  # rows a grid needs before one of them may be left out of its fit


def without_outlying_row(
    batch_stats: dict[int, dict[int, float]], catchup_ms_per_token: float | None
) -> tuple[list[float], list[float]]:
    """The grid's fit (``_fit_grid``), or, where that misprices a cell (``grid_misfit``) and a fit over
    the grid less one batch size's row prices every other cell, that fit: the left-out row was
    timed while something else held the cores. Of several such rows, the one its fit misses by
    the most. Grids of fewer than ``OUTLIER_ROWS_FROM`` rows are fitted whole: without one of 4
    rows, a zen3 profile's 3 left an intercept above its batch-1 step."""
    whole = _fit_grid(batch_stats, catchup_ms_per_token)
    if len(batch_stats) < OUTLIER_ROWS_FROM or not grid_misfit(*whole, batch_stats):
        return whole
    best, best_miss = whole, 0.0
    for bs in sorted(batch_stats):
        rest = {b: row for b, row in batch_stats.items() if b != bs}
        candidate = _fit_grid(rest, catchup_ms_per_token)
        if grid_misfit(*candidate, rest):
            continue
        # the left-out row against the fit without it (the step overhead read from the whole grid)
        miss = max(
            (abs(p - ms) / ms for row, _, p, ms in grid_misfit(*candidate, batch_stats) if row == bs),
            default=0.0,
        )
        if miss > best_miss:
            best, best_miss = candidate, miss
    return best
