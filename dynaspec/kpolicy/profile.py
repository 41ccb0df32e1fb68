"""The profile file written by `dynaspec profile` and read by the goodput policy.

```json
{"max_num_speculative_tokens": 5,
 "acceptance_rate_per_pos": [0.82, 0.66, 0.53, 0.42, 0.33],
 "batch_stats": {"1": {"0": 205.1, "1": 260.3, ...}, "2": {...}},
 "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 8, 2], [9, 32, 0]],
 "cost_model": {"target_ms": [a, b, c], "draft_pass_ms": [d, e, f]},
 "context_tokens": 310.5,
 "context_stats": {"4096": {"1": {"0": 31.0, "5": 80.2}, "8": {...}}},
 "context_cost": [u, v],
 "context_cost_by_batch": {"1": [u1, v1], "4": [u4, v4], "8": [u8, v8]},
 "meta": {"model": ..., "cpu": ..., "torch": ..., "date": ...}}
```
``batch_stats`` holds ITL(bs, K), the median engine step time in milliseconds. ``cost_model``
(optional) holds the pass-time coefficients fitted on every step the profiler timed (see
``dynaspec.kpolicy.cost``): target ms = a + b*verify_tokens + c*prefill_tokens, drafter pass ms =
d + e*rows + f*catch-up tokens. A model that contradicts the grid it came with is repaired or
dropped on load (``checked_cost_model``): the grid is what was measured.

The context axis (optional, ``kpolicy.context``): ``context_tokens`` is the grid's mean context per
request, ``context_stats`` ITL(bs, K) cells timed over longer contexts (context -> bs -> K -> ms),
and ``context_cost`` = [u, v] what context adds to a step, fitted on them on load when absent;
``context_cost_by_batch`` the same fitted on each batch size's cells alone (where they hold two Ks),
read at a step's batch size in their stead.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from dynaspec.kpolicy.acceptance import held_non_increasing
from dynaspec.kpolicy.context import ContextCost, fit_context_cost, fit_context_cost_by_batch
from dynaspec.kpolicy.cost import FIT_TOLERANCE, FIT_TOLERANCE_MS, OUTLIER_ROWS_FROM, GridBounds, grid_misfit

log = logging.getLogger(__name__)
COST_MODEL_KEYS = ("target_ms", "draft_pass_ms")
CONTEXT_COST_SHAPE = "must be [ms per row, ms per row per draft token], per 1,000 context tokens"


@dataclass(config=ConfigDict(extra="ignore"))
class Profile:
    max_num_speculative_tokens: Annotated[int, Field(ge=0, strict=True)]
    acceptance_rate_per_pos: list[Annotated[float, Field(ge=0, le=1)]]  # [max K] unconditional α_i
    batch_stats: dict[
        Annotated[int, Field(ge=1)], dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=0)]]
    ]
    num_speculative_tokens_per_batch_size: list[list[int]] = field(default_factory=list)
    cost_model: dict[str, list[float]] | None = None  # {"target_ms": [a, b, c], "draft_pass_ms": [d, e, f]}
    context_tokens: Annotated[float, Field(gt=0)] | None = None  # the grid's mean context per request
    context_stats: dict[
        Annotated[int, Field(ge=1)],
        dict[Annotated[int, Field(ge=1)], dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=0)]]],
    ] = field(default_factory=dict)
    context_cost: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = None  # [u, v]
    context_cost_by_batch: (
        dict[Annotated[int, Field(ge=1)], list[Annotated[float, Field(ge=0, allow_inf_nan=False)]]] | None
    ) = None  # bs -> [u, v]
    # the drafter's catch-up per prompt token (ms), timed over whole prompts (None: not timed);
    # kept apart from ``cost_model`` because it prices the grid-priced fallback too
    catchup_ms_per_token: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @field_validator("context_cost")
    @classmethod
    def _context_cost(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and len(value) != 2:
            raise ValueError(CONTEXT_COST_SHAPE)
        return value

    @field_validator("context_cost_by_batch")
    @classmethod
    def _context_cost_by_batch(cls, value: dict[int, list[float]] | None) -> dict[int, list[float]] | None:
        if value is not None and any(len(uv) != 2 for uv in value.values()):
            raise ValueError(f"each batch size's {CONTEXT_COST_SHAPE}")
        return value

    @field_validator("cost_model")
    @classmethod
    def _cost_model(cls, value: dict[str, list[float]] | None) -> dict[str, list[float]] | None:
        if value is None:
            return None
        ok = set(value) == set(COST_MODEL_KEYS) and all(
            len(v) == 3 and all(math.isfinite(c) for c in v) for v in value.values()
        )
        if not ok:
            raise ValueError('must be {"target_ms": [3 numbers], "draft_pass_ms": [3 numbers]}')
        return value

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["batch_stats"] = {
            str(bs): {str(k): t for k, t in sorted(row.items())}
            for bs, row in sorted(self.batch_stats.items())
        }
        d["context_stats"] = {
            str(c): {str(bs): {str(k): t for k, t in sorted(row.items())} for bs, row in sorted(grid.items())}
            for c, grid in sorted(self.context_stats.items())
        }
        if d["context_cost_by_batch"] is not None:
            d["context_cost_by_batch"] = {
                str(bs): uv for bs, uv in sorted(d["context_cost_by_batch"].items())
            }
        for key in ("cost_model", "context_tokens", "context_cost", "context_cost_by_batch"):
            if d[key] is None:
                del d[key]
        if not d["context_stats"]:
            del d["context_stats"]
        return d


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n")


def load_profile(path: str | Path) -> Profile:
    """Read and validate; a malformed file raises ValueError naming the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"profile {path}: file not found")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"profile {path}: invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"profile {path}: (top level): must be a JSON object")
    try:
        profile = Profile(**{"acceptance_rate_per_pos": [], "batch_stats": {}, **d})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"profile {path}: {where}: {message}") from None
    except TypeError as e:  # a required field missing
        raise ValueError(f"profile {path}: {e}") from None
    profile.cost_model = checked_cost_model(profile, str(path))
    if profile.context_cost is None:
        profile.context_cost = context_cost_of(profile)
    if profile.context_cost_by_batch is None:
        profile.context_cost_by_batch = context_cost_by_batch_of(profile)
    return profile


def context_model(profile: Profile) -> ContextCost | None:
    """The profile's context axis as the policy prices it (its ``context_cost``, or one fitted on
    its long-context cells); None without one."""
    coefficients = profile.context_cost if profile.context_cost is not None else context_cost_of(profile)
    if profile.context_tokens is None or coefficients is None:
        return None
    by_batch = profile.context_cost_by_batch
    if by_batch is None:
        by_batch = context_cost_by_batch_of(profile) or {}
    u, v = map(float, coefficients)
    rows = tuple((bs, float(ub), float(vb)) for bs, (ub, vb) in sorted(by_batch.items()))
    return ContextCost(float(profile.context_tokens), u, v, rows)


def context_cost_of(profile: Profile) -> list[float] | None:
    """[u, v] fitted on the profile's long-context cells against its smoothed grid
    (``kpolicy.context``); None without a context axis."""
    return _fit_context(profile, fit_context_cost)


def context_cost_by_batch_of(profile: Profile) -> dict[int, list[float]] | None:
    """{bs: [u, v]} fitted on each batch size's long-context cells alone (``kpolicy.context``);
    None without a context axis."""
    return _fit_context(profile, fit_context_cost_by_batch)


def _fit_context(profile: Profile, fit: Callable) -> Any:
    """``fit`` over the profile's long-context cells against its smoothed grid; None without a
    context axis."""
    if profile.context_tokens is None or not profile.context_stats or not profile.batch_stats:
        return None
    grid = smooth_itl(profile.batch_stats)
    return fit(lambda bs, k: interpolate_itl(grid, bs, k), profile.context_stats, profile.context_tokens)


def checked_cost_model(profile: Profile, name: str) -> dict[str, list[float]] | None:
    """The profile's ``cost_model`` made to agree with its (smoothed) grid, or None where it
    cannot: then the policy prices passes from the grid itself (``cost.prior_from_grid``).

    Negative slopes are set to 0 and intercepts put within what the grid allows
    (``cost.GridBounds``); the result must then predict every cell of the grid within
    ``cost.FIT_TOLERANCE`` (or ``FIT_TOLERANCE_MS``) after one constant step overhead
    (``cost.grid_misfit``), but for one row of a grid of ``cost.OUTLIER_ROWS_FROM`` rows or more,
    which then is the row out of line (as ``cost.without_outlying_row`` leaves it out of a fit
    from the grid). A repair, a row let off or a fallback is logged as a warning naming the profile.
    A profile without a grid keeps its model as it is.
    """
    model = profile.cost_model
    if model is None or not profile.batch_stats:
        return model
    grid = smooth_itl(profile.batch_stats)
    target, draft = GridBounds.of(grid).clamp(model["target_ms"], model["draft_pass_ms"])
    misfit = grid_misfit(target, draft, grid)
    rows = {cell[0] for cell in misfit}
    if len(rows) == 1 and len(grid) >= OUTLIER_ROWS_FROM:  # the row every other row contradicts
        log.warning(
            "dynaspec: profile %s: its cost model agrees with every row of its ITL grid but batch "
            "size %d's (%d cells off), taken as timed while something else held the cores",
            name,
            rows.pop(),
            len(misfit),
        )
        misfit = []
    if misfit:
        bs, k, predicted, measured = max(misfit, key=lambda c: abs(c[2] - c[3]) / c[3])
        log.warning(
            "dynaspec: profile %s: its cost model (target %s, drafter pass %s ms) contradicts its ITL "
            "grid at %d cells (worst ITL(%d, %d): %.1f ms predicted, %.1f measured; tolerance %.0f%% "
            "or %.0f ms); pricing passes from the grid instead",
            name,
            model["target_ms"],
            model["draft_pass_ms"],
            len(misfit),
            bs,
            k,
            predicted,
            measured,
            100 * FIT_TOLERANCE,
            FIT_TOLERANCE_MS,
        )
        return None
    repaired = {"target_ms": target, "draft_pass_ms": draft}
    if repaired != model:
        log.warning(
            "dynaspec: profile %s: cost model repaired to agree with its ITL grid (slopes >= 0, "
            "intercepts the grid allows): %s",
            name,
            repaired,
        )
    return repaired


CHEAPER_BATCH = 0.7  # a larger batch's step below this fraction of a smaller one's: impossible
DEARER_BATCH = 1.5  # a step dearer than this times its rows run one batch at a time: impossible
IMPLAUSIBLE_MARGIN_MS = 10.0  # and by more than this: a tiny model's steps of a few ms jitter freely


def implausible_steps(batch_stats: dict[int, dict[int, float]]) -> list[str]:
    """Steps of a grid that no quiet machine measures, each described; empty when none.

    In each column K, between two profiled batch sizes a < b a step can neither get much cheaper
    (ITL(b, K) < ``CHEAPER_BATCH`` x ITL(a, K)) nor cost more than running the batch as b / a steps
    of a, with slack (ITL(b, K) > ``DEARER_BATCH`` x b / a x ITL(a, K)), each by more than
    ``IMPLAUSIBLE_MARGIN_MS``. Either is a step timed while something else held the cores (a test
    suite, another process): such a profile misprices every K. The drafting columns are judged as
    the plain one is: zen4's auto profile of the pair timed ITL(24, 1..2) at 1,069-1,092 ms beside
    ITL(16, 1..2) = 310-430 with ITL(24, 0) plausible, and was cached (the results diary, "The
    long-tailed code rollout on a slower zen4 host")."""
    return [why for _, _, why in _implausible_pairs(batch_stats)]


def rows_out_of_line(batch_stats: dict[int, dict[int, float]]) -> list[int]:
    """The batch sizes whose rows to time again, given the implausible pairs of steps: a batch
    size named by two pairs (its neighbours on both sides agree against it, in any column), else
    both of each pair's. A quick profile of the suffix drafter on the xeon timed ITL(24, 0) at
    369.8 ms between 16's 55.2 and 32's 246.6, with nothing else running (the VM's neighbours): 24
    is named; timed again, if 16 too is off, the pair names both."""
    pairs = _implausible_pairs(batch_stats)
    named = collections.Counter(bs for a, b in {(a, b) for a, b, _ in pairs} for bs in (a, b))
    twice = sorted(bs for bs, n in named.items() if n >= 2)
    return twice or sorted(named)


def _implausible_pairs(batch_stats: dict[int, dict[int, float]]) -> list[tuple[int, int, str]]:
    found = []
    for k in sorted({k for row in batch_stats.values() for k in row}):
        for (a, ta), (b, tb) in itertools.pairwise(_column(batch_stats, k)):
            if tb < CHEAPER_BATCH * ta - IMPLAUSIBLE_MARGIN_MS:
                bound = f"{CHEAPER_BATCH:g} x ITL({a}, {k}) = {ta:.1f} ms"
                found.append((a, b, f"ITL({b}, {k}) = {tb:.1f} ms < {bound}"))
            elif tb > DEARER_BATCH * b / a * ta + IMPLAUSIBLE_MARGIN_MS:
                bound = f"{DEARER_BATCH:g} x {b}/{a} x ITL({a}, {k}) = {ta:.1f} ms"
                found.append((a, b, f"ITL({b}, {k}) = {tb:.1f} ms > {bound}"))
    return found


def interpolate_itl(batch_stats: dict[int, dict[int, float]], batch_size: int, k: float) -> float | None:
    """ITL(bs, K) in ms, linear between profiled batch sizes; None if unknown. A K between two
    columns (a ragged step's mean drafts a request) is read linearly between them.

    Below the smallest profiled batch size it is that size's time. Above the largest it goes on
    along the last segment's slope (never downwards): a step of 32 requests costs more than one of
    16, and holding it at 16's time made K=5 look nearly free there, where it cost 1.9x a plain
    step (the results diary, "The n-gram grid"). A drafting column's slope is at least K+1 times
    the plain column's (``extra_request_ms``). One profiled size alone is held. Zero or negative
    times are treated as unknown.
    """
    lo = int(k)
    if k > lo:
        low, high = (
            interpolate_itl(batch_stats, batch_size, lo),
            interpolate_itl(batch_stats, batch_size, lo + 1),
        )
        return None if low is None or high is None else low + (high - low) * (k - lo)
    points = _column(batch_stats, k)
    if not points:
        return None
    if batch_size <= points[0][0]:
        return points[0][1]
    if batch_size >= points[-1][0]:
        return points[-1][1] + extra_request_ms(batch_stats, k) * (batch_size - points[-1][0])
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if b0 <= batch_size <= b1:
            return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
    return points[-1][1]


def _column(batch_stats: dict[int, dict[int, float]], k: int) -> list[tuple[int, float]]:
    return sorted((bs, row[k]) for bs, row in batch_stats.items() if row.get(k, 0) > 0)


def _last_slope(points: list[tuple[int, float]]) -> float:
    if len(points) < 2:
        return 0.0
    (b0, t0), (b1, t1) = points[-2:]
    return max(0.0, (t1 - t0) / (b1 - b0))


def extra_request_ms(batch_stats: dict[int, dict[int, float]], k: int) -> float:
    """What one more request adds to ITL(bs, K) past the largest profiled batch size: the last
    segment's slope of K's column, and never less than K+1 times the plain column's. An extra
    request verifies K+1 tokens where a plain one verifies one, and a step's cost per verified
    token does not fall as its rows grow, so past the grid a drafting column rises at least K+1
    times as fast as the plain one. Without that floor one low cell at the grid's edge decided
    every larger batch: an auto profile of the suffix drafter on zen3 ended at 12 requests with
    K=5 ahead there, and its table drafted K=5 from 12 to 64 requests, where a GRPO rollout of 32
    ran 1.3-1.5x slower at K=3 than without speculation."""
    own = _last_slope(_column(batch_stats, k))
    if k == 0:
        return own
    return max(own, (k + 1) * _last_slope(_column(batch_stats, 0)))


def smooth_itl(batch_stats: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """The profiled grid with its measurement noise taken out and its shape kept.

    A median of a few steps jitters by tens of milliseconds on a shared CPU, enough to flip the
    argmax between neighbouring K. Two facts of the step's cost hold the grid together:

    - within a batch size, each extra draft token adds one drafter pass and bs verified tokens, so
      ITL(bs, K) for K >= 1 lies on a line in K (fitted by least squares, slope >= 0, never below
      K=0). K=0, where the drafter does not run at all, stays as measured unless it lies above
      that line's value at K=1: a plain step cannot cost more than a drafting one, so such a
      cell is a hiccup and is put back on the line (its value at K=0) before it can pool its
      neighbours up below;
    - a step never gets cheaper with more requests: each K's column is made non-decreasing in bs
      (isotonic regression, pool adjacent violators), which averages a dip with its neighbours
      rather than lifting it to the maximum.

    Unknown (missing or non-positive) cells stay unknown. A grid that already obeys both is
    returned unchanged.
    """
    smoothed: dict[int, dict[int, float]] = {}
    for bs, row in batch_stats.items():
        known = {k: t for k, t in row.items() if t > 0}
        out = dict(known)
        spec = sorted((k, t) for k, t in known.items() if k >= 1)
        if len(spec) >= 3:
            n = len(spec)
            mean_k = sum(k for k, _ in spec) / n
            mean_t = sum(t for _, t in spec) / n
            var = sum((k - mean_k) ** 2 for k, _ in spec)
            slope = max(0.0, sum((k - mean_k) * (t - mean_t) for k, t in spec) / var) if var else 0.0
            intercept = mean_t - slope * mean_k
            if 0 in known and known[0] > intercept + slope and intercept > 0:
                out[0] = intercept  # dearer than drafting one token: a hiccup, put back on the line
            for k, _ in spec:
                out[k] = max(out.get(0, 0.0), mean_t + slope * (k - mean_k))
        smoothed[bs] = out
    sizes = sorted(smoothed)
    for k in {k for row in smoothed.values() for k in row}:
        column = [bs for bs in sizes if k in smoothed[bs]]
        for bs, value in zip(column, _isotonic([smoothed[bs][k] for bs in column])):
            smoothed[bs][k] = round(value, 3)
    return smoothed


def _isotonic(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def best_k(alpha: list[float], batch_stats: dict[int, dict[int, float]], batch_size: int, max_k: int) -> int:
    """argmax_K AL(K) / ITL(bs, K) over the profiled grid; ties go to the smaller K; 0 when nothing known."""
    return argmax_goodput(alpha, lambda k: interpolate_itl(batch_stats, batch_size, k), max_k)


def acceptance_length(alpha: list[float], k: int) -> float:
    """Expected tokens per step with K drafts: 1 + sum of the unconditional α_1..α_K, each held to
    at most the one before (accepting i needs 1..i-1 accepted). A model-free drafter's profiled
    rates are per token proposed, and it proposes long drafts only where its match is long: the
    suffix drafter's auto profile on zen3 read 0.41, 0.80, 0.94, 0.96, 0.96, which summed as they
    are promise 5.1 tokens a step at K=5 where the goodput policy's live estimate (held the same
    way) expects 3.1, so the derived table drafted K=5 where the policy would not."""
    return 1.0 + sum(held_non_increasing(alpha[:k]))


def argmax_goodput(alpha: list[float], itl: Callable[[int], float | None], max_k: int) -> int:
    """argmax_K AL(K) / itl(K) for K in 0..max_k; unknown (None) or non-positive times are skipped."""
    best, best_score = 0, None
    for k in range(max_k + 1):
        t = itl(k)
        if t is None or t <= 0:
            continue
        score = acceptance_length(alpha, k) / t
        if best_score is None or score > best_score * (1 + 1e-9):
            best, best_score = k, score
    return best


def derive_table(
    alpha: list[float], batch_stats: dict[int, dict[int, float]], max_k: int, up_to: int = 0
) -> list[list[int]]:
    """`num_speculative_tokens_per_batch_size` ranges from goodput on the smoothed grid, for
    1..the largest profiled bs or ``up_to`` if larger (the grid extended along its last slope):
    the same choice the goodput policy makes before live data."""
    if not batch_stats:
        return [[1, 1, 0]]
    batch_stats = smooth_itl(batch_stats)
    top = max(max(batch_stats), up_to)
    table: list[list[int]] = []
    for bs in range(1, top + 1):
        k = best_k(alpha, batch_stats, bs, max_k)
        if table and table[-1][2] == k:
            table[-1][1] = bs
        else:
            table.append([bs, bs, k])
    return table
