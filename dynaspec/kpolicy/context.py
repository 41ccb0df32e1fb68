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
"""

from __future__ import annotations

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

    def extra_ms(self, rows: float, context: float | None, k: float) -> float:
        """What ``rows`` requests of mean context ``context`` drafting ``k`` tokens each add to a
        grid step (negative below the grid's context); 0 for an unknown context."""
        if context is None or rows <= 0:
            return 0.0
        return rows * (context - self.reference) / PER_TOKENS * (self.per_row + self.per_draft * k)

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
    xs, ys = [], []
    for context, grid in context_stats.items():
        span = (context - reference) / PER_TOKENS
        if span <= 0:
            continue
        for bs, row in grid.items():
            for k, ms in row.items():
                base = itl(bs, k)
                if base is None or ms <= 0:
                    continue
                xs.append((bs * span, bs * span * k))
                ys.append(ms - base)
    if not xs:
        return None
    return fit_bounded(xs, ys, [0.0, 0.0], [float("inf"), float("inf")])
