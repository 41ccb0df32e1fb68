"""Synthetic acceptance: drafts accepted at given rates whatever their tokens (not lossless).

With dummy weights a drafter's tokens say nothing of a real pair's acceptance, so the cost of each
K cannot be profiled or swept on them. ``speculative_config.synthetic_acceptance_rate`` gives the
rates to produce instead, unconditional as the profile measures them: α_i is the fraction of drafts
whose token i is accepted (tokens 1..i-1 too). Position i is then accepted with the conditional
probability α_i / α_{i-1} (α_0 = 1); positions beyond the given rates repeat the last ratio, so one
number a means α_i = a^i. A row emits its accepted drafts and then the target's own token at the
next window position, as a real rejection would.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence

log = logging.getLogger(__name__)


class SyntheticAcceptance:
    """Draws how many drafts each row accepts, at fixed per-position rates."""

    def __init__(self, rates: float | Sequence[float], seed: int = 0) -> None:
        alphas = [float(rates)] if isinstance(rates, (int, float)) else [float(a) for a in rates]
        if not alphas or not all(0.0 < a <= 1.0 for a in alphas):
            raise ValueError(f"synthetic_acceptance_rate: rates must be in (0, 1], got {rates!r}")
        if any(later > earlier for earlier, later in itertools.pairwise(alphas)):
            raise ValueError(f"synthetic_acceptance_rate: per-position rates must not increase, got {alphas}")
        # [len(alphas)] P(position i accepted | positions before it accepted)
        self.conditional = [a / before for a, before in zip(alphas, [1.0, *alphas], strict=False)]
        self._random = random.Random(seed)
        log.warning(
            "speculative_config.synthetic_acceptance_rate: drafts are accepted at %s whatever their tokens; "
            "outputs are not the target's",
            rates,
        )

    def rate(self, position: int) -> float:
        """α_position (1-based): the unconditional rate this produces."""
        alpha = 1.0
        for i in range(position):
            alpha *= self._ratio(i)
        return alpha

    def accepted(self, draft_lens: list[int]) -> list[int]:  # [batch] drafts accepted per row
        """For each row of ``draft_lens[b]`` drafts, how many it accepts (a prefix: 0..n)."""
        out = []
        for n in draft_lens:
            accepted = 0
            while accepted < n and self._random.random() < self._ratio(accepted):
                accepted += 1
            out.append(accepted)
        return out

    def _ratio(self, index: int) -> float:  # 0-based position
        return self.conditional[min(index, len(self.conditional) - 1)]


def synthetic_emitted(drafts: list[int], accepted: int, target_token: int) -> list[int]:
    """A row's emitted tokens: its first ``accepted`` drafts, then the target's token at window
    position ``accepted`` (a recovered token, or the bonus after all drafts)."""
    return [*drafts[:accepted], target_token]
