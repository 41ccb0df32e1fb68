"""K switching shared by the table and goodput policies.

``Hysteresis`` holds K until a different choice has won ``steps`` consecutive steps (the first
choice is immediate), so K does not flip at a batch-size boundary; ``log_change`` logs the K a
batch size gets whenever it changes.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Hysteresis:
    """Holds the current K; a different candidate takes over after ``steps`` consecutive wins."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.current: int | None = None
        self._candidate: int | None = None
        self._wins = 0

    def update(self, candidate: int) -> int:
        if self.current is None or candidate == self.current:
            return self.take(candidate)
        if candidate == self._candidate:
            self._wins += 1
        else:
            self._candidate, self._wins = candidate, 1
        return self.take(candidate) if self._wins >= self.steps else self.current

    def take(self, candidate: int) -> int:
        """Switch to ``candidate`` now (the first choice, a win streak, or a caller that found the
        held K clearly worse, not a near tie)."""
        self.current = candidate
        self._candidate, self._wins = None, 0
        return candidate


def log_change(k_by_batch_size: dict[int, int], batch_size: int, k: int, name: str) -> bool:
    if k_by_batch_size.get(batch_size) == k:
        return False
    k_by_batch_size[batch_size] = k
    log.info("%s policy: K=%d at batch size %d", name, k, batch_size)
    return True
