"""What a step costs, learned from the engine's own timings.

The profile's ITL(bs, K) grid is measured on pure decode steps. Live steps differ: prefill chunks
ride along, the machine drifts, and a draft model must first catch up on every new request's
prompt before it can draft for it. Two small linear models, fitted online from every step's
timings, capture this:

- target pass:  ms = a + b * verify_tokens + c * prefill_tokens
- drafter pass: ms = d + e * rows + f * extra_tokens   (extra: catch-up tokens beyond one per row)

Each is a ridge regression pulled towards a prior (from the profile) and forgetting old steps:
``theta = (A0 + S)^-1 (A0 theta0 + s)`` with ``S <- decay * S + x x^T`` and ``s <- decay * s + x y``
per observation. ``A0`` pins each coefficient with the weight of ``prior_weight`` observations at a
typical feature scale, so a few live steps move the estimate and thousands dominate it.

The goodput policy uses the models two ways: the profile's ITL(bs, K) is scaled by
live/prior model predictions (drift), and ``f`` prices a request's drafter catch-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

TARGET_FEATURES = ("step", "verify_tokens", "prefill_tokens")
DRAFT_FEATURES = ("pass", "rows", "extra_tokens")
_TARGET_SCALE = (1.0, 32.0, 128.0)  # typical feature magnitudes: the prior's weight is set in these units
_DRAFT_SCALE = (1.0, 8.0, 128.0)
MAX_DRIFT = 3.0


@dataclass(slots=True)
class StepTiming:
    """Wall times of one engine step's passes (milliseconds)."""

    verify_tokens: int  # decode tokens verified by the target: sum over decodes of 1 + drafts
    prefill_tokens: int
    target_ms: float
    draft_passes: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, extra tokens, ms)


class OnlineLinear:
    """Decayed ridge regression towards a prior; every input is guarded (no NaN, no crash)."""

    def __init__(self, prior: Sequence[float], scale: Sequence[float], prior_weight: float = 2.0, decay: float = 0.99) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.a0 = np.diag([prior_weight / (s * s) for s in scale])  # precision of the prior
        self.decay = decay
        self.s_xx = np.zeros((len(prior), len(prior)))
        self.s_xy = np.zeros(len(prior))
        self.num_observations = 0
        self.coef = self.prior.copy()

    def observe(self, x: Sequence[float], y: float) -> None:
        if not (isinstance(y, (int, float)) and math.isfinite(y) and y > 0):
            return
        xv = np.asarray(x, dtype=np.float64)
        self.s_xx = self.decay * self.s_xx + np.outer(xv, xv)
        self.s_xy = self.decay * self.s_xy + xv * y
        self.num_observations += 1
        try:  # costs are never negative: a slope pushed below 0 by a few noisy steps is held at 0
            self.coef = np.maximum(np.linalg.solve(self.a0 + self.s_xx, self.a0 @ self.prior + self.s_xy), 0.0)
        except np.linalg.LinAlgError:
            pass

    def predict(self, x: Sequence[float], coef: np.ndarray | None = None) -> float:
        c = self.coef if coef is None else coef
        return max(0.0, float(np.dot(c, np.asarray(x, dtype=np.float64))))


class StepCostModel:
    """Target and drafter pass models; predicts pure-decode ITL(bs, K) and catch-up cost."""

    def __init__(self, target_prior: Sequence[float], draft_prior: Sequence[float], prior_weight: float = 2.0, decay: float = 0.99) -> None:
        self.target = OnlineLinear(target_prior, _TARGET_SCALE, prior_weight, decay)
        self.draft = OnlineLinear(draft_prior, _DRAFT_SCALE, prior_weight, decay)

    def observe(self, timing: StepTiming) -> None:
        self.target.observe((1.0, timing.verify_tokens, timing.prefill_tokens), timing.target_ms)
        for rows, extra, ms in timing.draft_passes:
            self.draft.observe((1.0, rows, extra), ms)

    def itl(self, batch_size: int, k: int, prior: bool = False) -> float:
        """Pure decode step: the target verifies bs*(K+1) tokens after K drafter passes over bs rows."""
        t_coef = self.target.prior if prior else None
        d_coef = self.draft.prior if prior else None
        target = self.target.predict((1.0, batch_size * (k + 1), 0.0), t_coef)
        draft = self.draft.predict((1.0, batch_size, 0.0), d_coef) if k else 0.0
        return target + k * draft

    def drift(self, batch_size: int, k: int) -> float:
        """Live / prior prediction of ITL(bs, K): how much slower (> 1) or faster the machine runs now.

        Bounded to [1/MAX_DRIFT, MAX_DRIFT] so that a model fitted on a few odd steps cannot swing K
        arbitrarily far from the profile."""
        before = self.itl(batch_size, k, prior=True)
        now = self.itl(batch_size, k)
        if before <= 0 or now <= 0:
            return 1.0
        return min(MAX_DRIFT, max(1.0 / MAX_DRIFT, now / before))

    def catchup_ms_per_token(self) -> float:
        return max(0.0, float(self.draft.coef[2]))

    def snapshot(self) -> dict:
        return {
            "target_ms": dict(zip(TARGET_FEATURES, (round(float(c), 4) for c in self.target.coef))),
            "draft_pass_ms": dict(zip(DRAFT_FEATURES, (round(float(c), 4) for c in self.draft.coef))),
            "observations": {"target": self.target.num_observations, "draft_passes": self.draft.num_observations},
        }


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
        "draft_pass_ms": fit_linear([(1.0, r, e) for r, e, _ in passes], [ms for _, _, ms in passes]) if passes else [0.0, 0.0, 0.0],
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
