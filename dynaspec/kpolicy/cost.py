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
slopes (results/RESULTS.md, "live step costs"). Until the drafter has run, it is assumed to drift
like the target (both share the machine).

The goodput policy uses this two ways: the profile's ITL(bs, K) is multiplied by
``drift(bs, K)``, and ``f`` times the drafter's scale prices a request's catch-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dynaspec.engine.types import StepTiming

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
        ok = all(
            isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (observed_ms, predicted_ms)
        )
        if not ok:
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
    ) -> None:
        self.target_coef = np.asarray(target_prior, dtype=np.float64)
        self.draft_coef = np.asarray(draft_prior, dtype=np.float64)
        self.target_scale = LiveScale(prior_weight, decay)
        self.draft_scale = LiveScale(prior_weight, decay)

    def observe(self, timing: StepTiming) -> None:
        self.target_scale.observe(
            timing.target_ms, _predict(self.target_coef, (1.0, timing.verify_tokens, timing.prefill_tokens))
        )
        for rows, extra, ms in timing.draft_passes:
            self.draft_scale.observe(ms, _predict(self.draft_coef, (1.0, rows, extra)))

    def scales(self) -> tuple[float, float]:
        """(target, drafter) live / profiled; the drafter follows the target until it has run."""
        target = self.target_scale.value
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

    def draft_pass_ms(self, rows: int) -> float:
        """One drafter pass over ``rows`` caught-up requests, now (0 for a proposer with no drafter)."""
        return _predict(self.draft_coef, (1.0, rows, 0.0)) * self.scales()[1] if rows else 0.0

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
            "observations": {
                "target": self.target_scale.num_observations,
                "draft_passes": self.draft_scale.num_observations,
            },
        }


def _predict(coef: np.ndarray, x: Sequence[float]) -> float:
    return max(0.0, float(np.dot(coef, np.asarray(x, dtype=np.float64))))


def fit_linear(xs: Sequence[Sequence[float]], ys: Sequence[float], ridge: float = 1e-6) -> list[float]:
    """Least squares with a whisper of ridge (so a feature that never varied gets 0, not NaN)."""
    if not xs:
        return []
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    coef = np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)
    return [round(float(c), 6) for c in coef]


def fit_timings(timings: Sequence[StepTiming]) -> dict[str, list[float]]:
    """The profile's ``cost_model`` section from the steps it timed."""
    tx = [(1.0, t.verify_tokens, t.prefill_tokens) for t in timings if t.target_ms > 0]
    ty = [t.target_ms for t in timings if t.target_ms > 0]
    passes = [p for t in timings for p in t.draft_passes if p[2] > 0]
    return {
        "target_ms": fit_linear(tx, ty),
        "draft_pass_ms": fit_linear([(1.0, r, e) for r, e, _ in passes], [ms for _, _, ms in passes])
        if passes
        else [0.0, 0.0, 0.0],
    }


def prior_from_grid(batch_stats: dict[int, dict[int, float]]) -> tuple[list[float], list[float]]:
    """A prior for profiles without a ``cost_model``: fit ITL = a + b*bs*(K+1) + K*(d + e*bs) on the grid.

    The grid has no prefill or catch-up, so their slopes are guessed from the decode ones
    (prefill token = verify token, catch-up token = half a drafter row).
    """
    xs, ys = [], []
    for bs, row in batch_stats.items():
        for k, ms in row.items():
            if ms > 0:
                xs.append((1.0, bs * (k + 1), k, k * bs))
                ys.append(ms)
    if len(xs) < 4:
        return [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    a, b, d, e = (max(0.0, c) for c in fit_linear(xs, ys))
    return [a, b, b], [d, e, e / 2]
