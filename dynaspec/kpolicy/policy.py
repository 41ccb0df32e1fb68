"""K policies: asked for K once per step (by the scheduler, for the load), told what each step did.

- ``FixedK``: always ``num_speculative_tokens``.
- ``TableK``: the per-batch-size table (``num_speculative_tokens_per_batch_size``).
- ``GoodputK``: K* = argmax_K AL(K) / ITL(bs, K) from a profile, with acceptance and step costs
  that follow live traffic, choosing K together with which requests draft (drafter catch-up).

Table and goodput policies switch K only after the new choice has won ``hysteresis_steps``
consecutive steps (the first choice is immediate), so K does not flip at a batch-size boundary.
Every division is guarded: empty or zero data never crashes a policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dynaspec.engine.types import DraftCandidate, KPolicy, StepRecord
from dynaspec.kpolicy.config import SpeculativeConfig, table_lookup
from dynaspec.kpolicy.cost import StepCostModel, prior_from_grid
from dynaspec.kpolicy.profile import (
    Profile,
    acceptance_length,
    interpolate_itl,
    load_profile,
    smooth_itl,
)

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
            self.current = candidate
            self._candidate, self._wins = None, 0
            return candidate
        if candidate == self._candidate:
            self._wins += 1
        else:
            self._candidate, self._wins = candidate, 1
        if self._wins >= self.steps:
            self.current = candidate
            self._candidate, self._wins = None, 0
        return self.current


class _SameKForAll:
    """Policies that learn nothing live: one K per step for the decode batch, every decode drafts it."""

    def k_for_batch(self, batch_size: int) -> int:
        raise NotImplementedError

    def choose(self, candidates: Sequence[DraftCandidate]) -> tuple[int, list[int]]:
        k = self.k_for_batch(sum(c.decoding for c in candidates))
        return k, [k if c.decoding else 0 for c in candidates]

    def observe(self, record: StepRecord) -> None:
        pass


class FixedK(_SameKForAll):
    def __init__(self, k: int) -> None:
        self.k = k

    def k_for_batch(self, batch_size: int) -> int:
        return self.k if batch_size else 0

    def snapshot(self) -> dict:
        return {"policy": "fixed", "k": self.k}


class TableK(_SameKForAll):
    def __init__(self, table: Sequence[Sequence[int]], max_k: int, hysteresis_steps: int = 3) -> None:
        self.table = tuple(tuple(r) for r in table)
        self.max_k = max_k
        self.hysteresis = Hysteresis(hysteresis_steps)
        self.k_by_batch_size: dict[int, int] = {}

    def k_for_batch(self, batch_size: int) -> int:
        if batch_size == 0:
            return 0
        wanted = min(table_lookup(self.table, batch_size), self.max_k)
        k = self.hysteresis.update(wanted)
        _log_change(self.k_by_batch_size, batch_size, k, "table")
        return k

    def snapshot(self) -> dict:
        return {
            "policy": "table",
            "k": self.hysteresis.current,
            "k_by_batch_size": dict(sorted(self.k_by_batch_size.items())),
        }


class AcceptanceEstimate:
    """α_i from the profile (a prior), moving to live traffic.

    Update rule: per position i, decayed counts d_i (drafts that reached i) and a_i (accepted at
    i) are multiplied by ``decay`` each step before the step's counts are added, so traffic older
    than ~1/(1-decay) steps fades. The estimate blends in the prior as ``prior_weight``
    pseudo-drafts: α_i = (a_i + w·prior_i) / (d_i + w). Positions beyond the last one with live
    data keep the prior's shape, scaled: α_j = α_m · prior_j / prior_m. The result is made
    non-increasing in i (accepting i needs 1..i-1 accepted).
    """

    def __init__(
        self, prior: Sequence[float], max_k: int, decay: float = 0.98, prior_weight: float = 16.0
    ) -> None:
        self.prior = [float(prior[i]) if i < len(prior) else 0.0 for i in range(max_k)]
        self.decay = decay
        self.prior_weight = prior_weight
        self.drafted = [0.0] * max_k
        self.accepted = [0.0] * max_k

    def observe(self, draft_lens: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step: each decode's draft length and accepted draft tokens."""
        self.drafted = [d * self.decay for d in self.drafted]
        self.accepted = [a * self.decay for a in self.accepted]
        for n, acc in zip(draft_lens, num_accepted):
            for i in range(min(n, len(self.drafted))):
                self.drafted[i] += 1
                self.accepted[i] += i < acc

    def rates(self) -> list[float]:
        w = self.prior_weight
        out: list[float] = []
        last = -1  # last position with live data
        for i, (p, d, a) in enumerate(zip(self.prior, self.drafted, self.accepted)):
            if d >= 1.0:
                last = i
            out.append((a + w * p) / (d + w) if d + w > 0 else p)
        if last >= 0:
            for j in range(last + 1, len(out)):
                base = self.prior[last]
                out[j] = out[last] * self.prior[j] / base if base > 0 else 0.0
        for i in range(1, len(out)):
            out[i] = min(out[i], out[i - 1])
        return [min(1.0, max(0.0, a)) for a in out]


class GoodputK:
    """K* = argmax AL(K) / ITL(bs, K), with live acceptance, live step costs, and who drafts.

    ITL(bs, K) is the profile's grid (smoothed, interpolated) times the drift the live cost model
    (``kpolicy.cost``) has seen since the profile. A draft model must first catch up on the tokens
    it has not seen (a new request's whole prompt), so request i costs
    c_i = catch-up ms per token x ``DraftCandidate.catchup_per_token()`` per generated token. With
    requests sorted by c_i, for every K and every n the step's goodput is

        (bs + n (AL(K) - 1)) / (ITL(bs, 0) + ITL(n, K) - ITL(n, 0) + AL(K) * sum_{i<n} c_i)

    (n drafting rows add their verification and drafter passes to a plain step of the whole load);
    the best (K, n) wins, with hysteresis on K. bs is the load (every running request, prefilling
    ones included, and waiting ones up to max_num_seqs): the decode batch dips whenever arrivals
    are prefilled, so it would mislead. Only decoding candidates draft.
    """

    def __init__(
        self,
        profile: Profile,
        max_k: int,
        hysteresis_steps: int = 3,
        cost_model: StepCostModel | None = None,
        **estimate_kwargs,
    ) -> None:
        self.profile = profile
        self.itl_grid = smooth_itl(
            profile.batch_stats
        )  # the profiled ITL(bs, K), measurement noise taken out
        self.max_k = max(0, min(max_k, profile.max_num_speculative_tokens))
        self.acceptance = AcceptanceEstimate(profile.acceptance_rate_per_pos, self.max_k, **estimate_kwargs)
        self.hysteresis = Hysteresis(hysteresis_steps)
        self.k_by_batch_size: dict[int, int] = {}
        if cost_model is None:
            if profile.cost_model is not None:
                cost_model = StepCostModel(
                    profile.cost_model["target_ms"], profile.cost_model["draft_pass_ms"]
                )
            else:
                cost_model = StepCostModel(*prior_from_grid(profile.batch_stats))
        self.costs = cost_model
        self.num_withheld = 0  # request-steps kept from drafting because their catch-up would not pay

    def itl(self, batch_size: int, k: int) -> float | None:
        """ITL(bs, K) in ms: the profile's, times the live drift; the cost model's alone off the grid."""
        base = interpolate_itl(self.itl_grid, batch_size, k)
        if base is None:
            model = self.costs.itl(batch_size, k)
            return model if model > 0 else None
        return base * self.costs.drift(batch_size, k)

    def k_for_batch(self, batch_size: int) -> int:
        """K for a batch whose drafter is caught up everywhere."""
        return self.choose([DraftCandidate(1, 1)] * batch_size)[0]

    def choose(self, candidates: Sequence[DraftCandidate]) -> tuple[int, list[int]]:
        bs = len(candidates)
        if bs == 0:
            return 0, []
        alpha = self.acceptance.rates()
        per_token = self.costs.catchup_ms_per_token()
        cost = [per_token * c.catchup_per_token() for c in candidates]
        order = sorted(range(bs), key=lambda i: (cost[i], not candidates[i].decoding))
        prefix = [0.0]
        for i in order:
            prefix.append(prefix[-1] + cost[i])
        scores = self._scores(bs, alpha, prefix)  # {(k, n): goodput}
        wanted = max(scores, key=lambda kn: (scores[kn], -kn[0], kn[1]))[0] if scores else 0
        k = self.hysteresis.update(wanted)
        n = (
            max((kn for kn in scores if kn[0] == k), key=lambda kn: (scores[kn], kn[1]), default=(k, 0))[1]
            if k
            else 0
        )
        drafts = [0] * bs
        for i in order[:n]:
            drafts[i] = k if candidates[i].decoding else 0
        num_decoding = sum(c.decoding for c in candidates)
        self.num_withheld += num_decoding - sum(d > 0 for d in drafts) if k else 0
        if _log_change(self.k_by_batch_size, bs, k, "goodput"):
            log.info("acceptance estimate per position: %s", " ".join(f"{a:.2f}" for a in alpha))
        return k, drafts

    def _scores(self, bs: int, alpha: list[float], prefix: list[float]) -> dict[tuple[int, int], float]:
        plain = self.itl(bs, 0)
        if plain is None:
            return {}
        scores = {(0, 0): bs / plain}
        row_plain = {n: self.itl(n, 0) for n in range(1, bs + 1)}
        for k in range(1, self.max_k + 1):
            al = acceptance_length(alpha, k)
            for n in range(1, bs + 1):
                spec, base = self.itl(n, k), row_plain[n]
                if spec is None or base is None:
                    continue
                step = plain + max(0.0, spec - base) + al * prefix[n]
                scores[(k, n)] = (bs + n * (al - 1)) / step
        return scores

    def observe(self, record: StepRecord) -> None:
        if record.result.draft_lens:
            self.acceptance.observe(record.result.draft_lens, record.result.num_accepted)
        self.costs.observe(record.timing)

    def snapshot(self) -> dict:
        return {
            "policy": "goodput",
            "k": self.hysteresis.current,
            "k_by_batch_size": dict(sorted(self.k_by_batch_size.items())),
            "acceptance_rate_per_pos": [round(a, 4) for a in self.acceptance.rates()],
            "requests_withheld": self.num_withheld,
            "cost_model": self.costs.snapshot(),
        }


def _log_change(k_by_batch_size: dict[int, int], batch_size: int, k: int, name: str) -> bool:
    if k_by_batch_size.get(batch_size) == k:
        return False
    k_by_batch_size[batch_size] = k
    log.info("%s policy: K=%d at batch size %d", name, k, batch_size)
    return True


def make_policy(config: SpeculativeConfig, profile: Profile | None = None) -> KPolicy:
    if config.dynamic_config_path is not None or profile is not None:
        profile = profile or load_profile(config.dynamic_config_path)
        max_k = config.num_speculative_tokens or profile.max_num_speculative_tokens
        return GoodputK(profile, max_k, config.hysteresis_steps)
    if config.num_speculative_tokens_per_batch_size is not None:
        return TableK(
            config.num_speculative_tokens_per_batch_size,
            config.num_speculative_tokens,
            config.hysteresis_steps,
        )
    return FixedK(config.num_speculative_tokens)
