"""K policies: asked for K once per step (by the scheduler, for the load), told what each step did.

- ``FixedK``: always ``num_speculative_tokens``.
- ``TableK``: the per-batch-size table (``num_speculative_tokens_per_batch_size``).
- ``GoodputK`` (``kpolicy.goodput``): K* = argmax_K AL(K) / ITL(bs, K) from a profile, with
  acceptance and step costs that follow live traffic, choosing K together with which requests
  draft (drafter catch-up); by default then a K per request, from each request's own acceptance,
  and draft confidence stops tuned from what the target accepted.

``make_policy`` builds the one a speculative config asks for. Table and goodput policies switch K
only after the new choice has won ``hysteresis_steps`` consecutive steps (``kpolicy.hysteresis``;
the first choice is immediate), so K does not flip at a batch-size boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynaspec.engine.types import DraftCandidate, KPolicy, StepRecord
from dynaspec.kpolicy.config import SpeculativeConfig, table_lookup
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.hysteresis import Hysteresis, log_change
from dynaspec.kpolicy.profile import Profile, load_profile


class _SameKForAll:
    """Policies that learn nothing live: one K per step for the decode batch, every decode drafts it."""

    min_confidence = 0.0  # a fixed confidence stop (0: none)

    def k_for_batch(self, batch_size: int) -> int:
        raise NotImplementedError

    def choose(self, candidates: Sequence[DraftCandidate]) -> tuple[int, list[int]]:
        k = self.k_for_batch(sum(c.decoding for c in candidates))
        return k, [k if c.decoding else 0 for c in candidates]

    def observe(self, record: StepRecord) -> None:
        pass

    def min_draft_confidence(self) -> float:
        return self.min_confidence

    def free_rows(self) -> list[bool]:
        return []  # every decode drafts from the drafter


class FixedK(_SameKForAll):
    def __init__(self, k: int, min_confidence: float = 0.0) -> None:
        self.k = k
        self.min_confidence = min_confidence

    def k_for_batch(self, batch_size: int) -> int:
        return self.k if batch_size else 0

    def snapshot(self) -> dict:
        return {"policy": "fixed", "k": self.k}


class TableK(_SameKForAll):
    def __init__(
        self,
        table: Sequence[Sequence[int]],
        max_k: int,
        hysteresis_steps: int = 3,
        min_confidence: float = 0.0,
    ) -> None:
        self.min_confidence = min_confidence
        self.table = tuple(tuple(r) for r in table)
        self.max_k = max_k
        self.hysteresis = Hysteresis(hysteresis_steps)
        self.k_by_batch_size: dict[int, int] = {}

    def k_for_batch(self, batch_size: int) -> int:
        if batch_size == 0:
            return 0
        wanted = min(table_lookup(self.table, batch_size), self.max_k)
        k = self.hysteresis.update(wanted)
        log_change(self.k_by_batch_size, batch_size, k, "table")
        return k

    def snapshot(self) -> dict:
        return {
            "policy": "table",
            "k": self.hysteresis.current,
            "k_by_batch_size": dict(sorted(self.k_by_batch_size.items())),
        }


def make_policy(config: SpeculativeConfig, profile: Profile | None = None) -> KPolicy:
    confidence = config.draft_confidence_threshold
    if config.dynamic_config_path is not None or profile is not None:
        profile = profile or load_profile(config.dynamic_config_path)
        max_k = config.num_speculative_tokens or profile.max_num_speculative_tokens
        return GoodputK(
            profile,
            max_k,
            config.hysteresis_steps,
            per_request=config.per_request_k,
            min_confidence=None if confidence in (None, "auto") else confidence,
            source=str(config.dynamic_config_path or "(given in memory)"),
        )
    fixed = confidence if isinstance(confidence, float) else 0.0
    if config.num_speculative_tokens_per_batch_size is not None:
        return TableK(
            config.num_speculative_tokens_per_batch_size,
            config.num_speculative_tokens,
            config.hysteresis_steps,
            fixed,
        )
    return FixedK(config.num_speculative_tokens, fixed)
