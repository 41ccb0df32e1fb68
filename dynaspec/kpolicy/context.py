"""What a step's context length adds to its cost: the profile's context axis.

The ITL(bs, K) grid is timed on short contexts (chat prompts and their first hundred-odd tokens).
Attention reads every context token's K/V for every row, and verifies K+1 query tokens a row, so a
step over long contexts costs more, and more so the more it drafts: the rollout tail's requests,
whose contexts are longest, were where K=2 rows turned out to be "mostly attention over a context
the target must keep" (issue 40). The profile also times a few (bs, K) cells over long contexts
(``context_stats``, e.g. 4,096 tokens a request), and from them and the grid this fits

    extra ms = bs x (C - C0) / 1,000 x (u + v K)

with C the step's mean context per request and C0 the grid's (``context_tokens``): u per row per
thousand context tokens (the K/V a row's attention reads, the plain step's share), v what each
draft position adds (one more query token over that context in the target, and a drafter pass's
attention over its own copy). Linear in C, as attention's cost is, so the policy interpolates
between the profiled contexts and goes on along the same line beyond them; u, v >= 0, and a step
never costs less than ``FLOOR`` of its grid value (shorter contexts than the grid's).

u and v are also fitted per batch size (``fit_context_cost_by_batch``) where the cells hold two Ks
or more at that size, and read at a step's batch size (linear between sizes, held beyond): what a
draft row adds over a long context is not one figure across batch sizes. On the xeon the cells at
4,096 tokens put it at 11.6 ms a step at one request, 7.9 at four and 5 at eight, and the single
line over all of them said 0.99 ms a row per 1,000 tokens where a timed batch-1 step showed 3.0
(issue 40, the results diary, "The long-context sweep again").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from dynaspec.kpolicy.cost import fit_bounded

PER_TOKENS = 1000.0  # u and v are ms per row per this many context tokens
FLOOR = 0.5  # a step over contexts shorter than the grid's costs at least this much of its grid value


@dataclass(slots=True, frozen=True)
class ContextCost:
    """``extra_ms`` of a step at a mean context per request, against the grid's ``reference``."""

    reference: float  # C0: the grid's mean context per request (tokens)
    per_row: float  # u: ms per row per PER_TOKENS context tokens
    per_draft: float  # v: ms per row per draft position per PER_TOKENS context tokens
    # (batch size, u, v) where fitted per batch size, ascending; empty: u and v at every size
    by_batch: tuple[tuple[int, float, float], ...] = ()

    def coefficients(self, rows: float) -> tuple[float, float]:
        """(u, v) at a batch of ``rows`` requests: linear between the sizes fitted on their own,
        held beyond them; the one line's without any."""
        points = self.by_batch
        if not points:
            return self.per_row, self.per_draft
        if rows <= points[0][0]:
            return points[0][1], points[0][2]
        for (b0, u0, v0), (b1, u1, v1) in itertools.pairwise(points):
            if rows <= b1:
                f = (rows - b0) / (b1 - b0)
                return u0 + f * (u1 - u0), v0 + f * (v1 - v0)
        return points[-1][1], points[-1][2]

    def extra_ms(self, rows: float, context: float | None, k: float) -> float:
        """What ``rows`` requests of mean context ``context`` drafting ``k`` tokens each add to a
        grid step (negative below the grid's context); 0 for an unknown context."""
        if context is None or rows <= 0:
            return 0.0
        u, v = self.coefficients(rows)
        return rows * (context - self.reference) / PER_TOKENS * (u + v * k)

    def itl(self, grid_ms: float, rows: float, context: float | None, k: float) -> float:
        """A grid step's time moved to ``context``: never below FLOOR of the grid's."""
        return max(FLOOR * grid_ms, grid_ms + self.extra_ms(rows, context, k))


def fit_context_cost(
    itl: Callable[[int, int], float | None],
    context_stats: dict[int, dict[int, dict[int, float]]],
    reference: float,
) -> list[float] | None:
    """[u, v] from the long-context cells: each cell (C, bs, K) says ITL_C(bs, K) - ITL(bs, K) =
    bs (C - C0) / 1,000 (u + v K), with ITL(bs, K) read off the (smoothed) grid by ``itl(bs, k)``.
    Least squares with u, v >= 0; None when no cell lies beyond the grid's context."""
    cells = [(k, x, y) for _, k, x, y in _cells(itl, context_stats, reference)]
    return _fit_uv(cells) if cells else None


def fit_context_cost_by_batch(
    itl: Callable[[int, int], float | None],
    context_stats: dict[int, dict[int, dict[int, float]]],
    reference: float,
) -> dict[int, list[float]]:
    """[u, v] for each batch size whose long-context cells hold two Ks or more, fitted on those
    cells alone as ``fit_context_cost`` fits all of them."""
    by_bs: dict[int, list[tuple[int, float, float]]] = {}
    for bs, k, x, y in _cells(itl, context_stats, reference):
        by_bs.setdefault(bs, []).append((k, x, y))
    return {bs: _fit_uv(cells) for bs, cells in sorted(by_bs.items()) if len({k for k, _, _ in cells}) >= 2}


def _fit_uv(cells: list[tuple[int, float, float]]) -> list[float]:
    """[u, v] >= 0 by least squares over cells (K, bs x (C - C0) / 1,000, extra ms): y = x (u + v K)."""
    return fit_bounded(
        [(x, x * k) for k, x, _ in cells], [y for _, _, y in cells], [0.0, 0.0], [math.inf] * 2
    )


def _cells(
    itl: Callable[[int, int], float | None],
    context_stats: dict[int, dict[int, dict[int, float]]],
    reference: float,
) -> list[tuple[int, int, float, float]]:
    """(bs, K, bs x (C - C0) / 1,000, ITL_C(bs, K) - ITL(bs, K)) for each cell beyond the grid's context."""
    out = []
    for context, grid in context_stats.items():
        span = (context - reference) / PER_TOKENS
        if span <= 0:
            continue
        for bs, row in grid.items():
            for k, ms in row.items():
                base = itl(bs, k)
                if base is not None and ms > 0:
                    out.append((bs, k, bs * span, ms - base))
    return out
