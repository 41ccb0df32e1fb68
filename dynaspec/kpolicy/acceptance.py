"""Acceptance estimators: how much of the drafts the target accepts, learnt from the steps.

- ``AcceptanceEstimate``: the batch's α_i, starting from the profile and moving to live traffic.
- ``RequestAcceptance`` and ``request_rates``: each request's α_i, the batch's scaled by its own record.
- ``per_token_acceptance``: β, accepted draft tokens per verified trial.
- ``ConfidenceCalibration``: acceptance by the drafter's confidence, for the confidence stops.

Plain Python over sequences of numbers; every division is guarded.
"""

from __future__ import annotations

from collections.abc import Sequence


def held_non_increasing(rates: Sequence[float]) -> list[float]:
    """Unconditional α_i, each held to at most the one before (accepting i needs 1..i-1 accepted)."""
    out = list(rates)
    for i in range(1, len(out)):
        out[i] = min(out[i], out[i - 1])
    return out


class AcceptanceEstimate:
    """α_i from the profile (a prior), moving to live traffic.

    Update rule: per position i, decayed counts d_i (drafts that reached i) and a_i (accepted at
    i) are multiplied by ``decay`` each step before the step's counts are added, so traffic older
    than ~1/(1-decay) steps fades. The estimate blends in the prior as ``prior_weight``
    pseudo-drafts: α_i = (a_i + w·p_i) / (d_i + w), where p_i carries the traffic's estimate forward
    with the profile's chance of accepting i given i-1, scaled by how the traffic's chance compared
    with the profile's at the position before: p_0 = prior_0, and with g_i = min(1, prior_i /
    prior_{i-1}) (the profile's chance of i given i-1), p_i = α_{i-1} · min(1, s_{i-1} · g_i),
    s_i = (α_i / α_{i-1}) / g_i (s_0 = α_0 / prior_0). A profile taken on chat (about 0.7 a
    position), serving code that accepts 0.9 at position 0, then expects more than chat's 0.7 a
    position at the positions K has not reached yet; K is not held too low to ever measure them.
    With no traffic, α = the profile, each rate held to at most the one before.
    The result is made non-increasing in i (accepting i needs 1..i-1 accepted).
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
        """One step: each decode's draft length and accepted draft tokens (α_i is per position
        proposed: a proposer that proposes nothing for a request, as an n-gram without a match,
        costs that request no verification either)."""
        self.drafted = [d * self.decay for d in self.drafted]
        self.accepted = [a * self.decay for a in self.accepted]
        for n, acc in zip(draft_lens, num_accepted):
            for i in range(min(n, len(self.drafted))):
                self.drafted[i] += 1
                self.accepted[i] += i < acc

    def evidence(self) -> float:
        """Live drafts behind the estimate at position 0 (decayed): 0 while it is the profile's."""
        return self.drafted[0] if self.drafted else 0.0

    def rates(self) -> list[float]:
        w, prior = self.prior_weight, self.prior
        out: list[float] = []
        scale = 1.0  # the traffic's chance of accepting i given i-1, over the profile's
        for i, (d, a) in enumerate(zip(self.drafted, self.accepted)):
            before, prior_before = (out[i - 1], prior[i - 1]) if i else (1.0, 1.0)  # position -1: certain
            # the profile's chance of i given i-1, at most 1: a model-free drafter's per-proposed
            # rates may rise with the position, and a ratio above 1 carried on as a scale below 1
            # held every later position below the profile's own with no traffic at all
            given = min(1.0, prior[i] / prior_before) if prior_before > 0 else 0.0
            p = before * min(1.0, scale * given)
            out.append(min(1.0, max(0.0, (a + w * p) / (d + w) if d + w > 0 else p)))
            if given > 0 and before > 0:
                scale = out[i] / before / given
        return held_non_increasing(out)


def request_rates(
    accepted: float, trials: float, batch_alpha: Sequence[float], weight: float = 4.0
) -> list[float]:
    """One request's α_i: the batch's, scaled by how the request's own drafts fare.

    A draft token is a trial when verification reaches it (every draft before it was accepted);
    ``accepted`` of ``trials`` were accepted (decayed counts of this request's steps). The
    request's per-token acceptance β_r = (accepted + w·β) / (trials + w) is shrunk towards the
    batch's β (the same ratio implied by ``batch_alpha``) with ``weight`` pseudo-trials, so a new
    request starts at the batch's rates and its own record takes over within a few steps. Then
    α_i = batch α_i · (β_r / β)^(i+1), clipped to [0, 1] and non-increasing: the batch's shape,
    raised or lowered as a request accepting more or less per token would be.
    """
    beta = per_token_acceptance(batch_alpha)
    if beta <= 0.0:
        return [0.0] * len(batch_alpha)
    own = (accepted + weight * beta) / (trials + weight) if trials + weight > 0 else beta
    ratio = own / beta
    return held_non_increasing([min(1.0, max(0.0, a * ratio ** (i + 1))) for i, a in enumerate(batch_alpha)])


def per_token_acceptance(alpha: Sequence[float]) -> float:
    """β: accepted draft tokens per verified trial when every position is drafted,
    sum(α_i) / (1 + sum(α_i for i < K-1)), 0 for an empty or zero estimate."""
    if not alpha:
        return 0.0
    trials = 1.0 + sum(alpha[:-1])
    return min(1.0, sum(alpha) / trials) if trials > 0 else 0.0


class RequestAcceptance:
    """Each running request's own record of trials and acceptances (decayed per step it drafts)."""

    def __init__(self, decay: float = 0.9, weight: float = 4.0) -> None:
        self.decay = decay
        self.weight = weight
        self.counts: dict[str, tuple[float, float]] = {}  # request id -> (accepted, trials)

    def observe(
        self, request_ids: Sequence[str], draft_lens: Sequence[int], num_accepted: Sequence[int]
    ) -> None:
        """One step. A request that drafted gains trials: the positions verification reached
        (accepted ones and the first rejected). A request that did not draft decays too, so one
        withheld for a poor record drifts back to the batch's rates and is tried again (its record
        would otherwise never change)."""
        for rid, n, acc in zip(request_ids, draft_lens, num_accepted):
            if n == 0:
                if rid in self.counts:
                    accepted, trials = self.counts[rid]
                    self.counts[rid] = (self.decay * accepted, self.decay * trials)
                continue
            accepted, trials = self.counts.get(rid, (0.0, 0.0))
            self.counts[rid] = (self.decay * accepted + acc, self.decay * trials + min(n, acc + 1))

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.counts.pop(rid, None)

    def rates(self, request_id: str, batch_alpha: Sequence[float]) -> list[float]:
        accepted, trials = self.counts.get(request_id, (0.0, 0.0))
        return request_rates(accepted, trials, batch_alpha, self.weight)


class ConfidenceCalibration:
    """How often the target accepts a draft token, by the drafter's confidence in it.

    The drafter's top probability at a position is binned (tenths); each bin keeps decayed counts
    of draft tokens verification reached and of those accepted, starting from the prior that the
    drafter is calibrated (``prior_weight`` pseudo-tokens at the bin's centre). ``threshold``
    returns the confidence below which drafting stops: the top of the run of lowest bins whose
    acceptance is below the break-even rate (capped at ``MAX_THRESHOLD``).

    ``positions`` > 1 keeps the bins apart by draft position (the last standing for it and every
    later one): a match's confidence is the same at every position, but the target keeps its
    first token less often than a later one it reaches (the n-gram on MT-Bench, two tokens
    matched: 0.43 at the first, 0.61 at the second, 0.74 beyond), so bins pooled over positions
    price the first token, which every drafting row pays for, too high.
    """

    BINS = 10
    MAX_THRESHOLD = 0.8

    def __init__(self, decay: float = 0.995, prior_weight: float = 4.0, positions: int = 1) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self.positions = max(1, positions)
        self.reached = [[0.0] * self.BINS for _ in range(self.positions)]
        self.accepted = [[0.0] * self.BINS for _ in range(self.positions)]

    def observe(
        self, confidence: Sequence[Sequence[float]], draft_lens: Sequence[int], num_accepted: Sequence[int]
    ) -> None:
        self.reached = [[r * self.decay for r in row] for row in self.reached]
        self.accepted = [[a * self.decay for a in row] for row in self.accepted]
        for row, n, acc in zip(confidence, draft_lens, num_accepted):
            for j, p in enumerate(row[: min(n, acc + 1)]):  # positions verification reached
                at, b = min(j, self.positions - 1), self._bin(p)
                self.reached[at][b] += 1
                self.accepted[at][b] += j < acc

    def _bin(self, confidence: float) -> int:
        return min(self.BINS - 1, max(0, int(confidence * self.BINS)))

    def rate(self, b: int, position: int = 0) -> float:
        """What the target kept of bin ``b``'s tokens that verification reached at draft position
        ``position``."""
        at = min(position, self.positions - 1)
        centre = (b + 0.5) / self.BINS
        w = self.prior_weight
        return (self.accepted[at][b] + w * centre) / (self.reached[at][b] + w)

    def expected(self, confidence: Sequence[float]) -> list[float]:
        """Unconditional α_i of a draft whose tokens have these confidences: the product of the
        acceptance of each bin up to i (a token is reached only if the ones before it are kept)."""
        out, run = [], 1.0
        for j, p in enumerate(confidence):
            run *= self.rate(self._bin(p), j)
            out.append(run)
        return out

    def threshold(self, break_even: float) -> float:
        """The confidence stop, from the first position's bins (every drafting row reaches it)."""
        t = 0.0
        for b in range(self.BINS):
            if self.rate(b) >= break_even:
                break
            t = (b + 1) / self.BINS
        return min(t, self.MAX_THRESHOLD)

    def snapshot(self) -> list[list[float]]:
        """Each position's bins' acceptance (one list where positions are pooled)."""
        return [[round(self.rate(b, j), 3) for b in range(self.BINS)] for j in range(self.positions)]
