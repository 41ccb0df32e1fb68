"""K policies: asked for K once per step (by the scheduler, for the load), told what each step did.

- ``FixedK``: always ``num_speculative_tokens``.
- ``TableK``: the per-batch-size table (``num_speculative_tokens_per_batch_size``).
- ``GoodputK``: K* = argmax_K AL(K) / ITL(bs, K) from a profile, with acceptance and step costs
  that follow live traffic, choosing K together with which requests draft (drafter catch-up);
  by default then a K per request, from each request's own acceptance, and draft confidence stops
  tuned from what the target accepted.

Table and goodput policies switch K only after the new choice has won ``hysteresis_steps``
consecutive steps (the first choice is immediate), so K does not flip at a batch-size boundary.
Every division is guarded: empty or zero data never crashes a policy.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence

from dynaspec.engine.types import DraftCandidate, KPolicy, StepRecord
from dynaspec.kpolicy.config import SpeculativeConfig, table_lookup
from dynaspec.kpolicy.cost import StepCostModel, prior_from_grid
from dynaspec.kpolicy.profile import (
    Profile,
    acceptance_length,
    checked_cost_model,
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
    pseudo-drafts: α_i = (a_i + w·p_i) / (d_i + w), where p_i carries the traffic's estimate forward
    with the profile's chance of accepting i given i-1, scaled by how the traffic's chance compared
    with the profile's at the position before: p_0 = prior_0, and
    p_i = α_{i-1} · min(1, s_{i-1} · prior_i / prior_{i-1}), s_i = (α_i / α_{i-1}) / (prior_i / prior_{i-1})
    (s_0 = α_0 / prior_0). A profile taken on chat (about 0.7 a position), serving code that accepts
    0.9 at position 0, then expects more than chat's 0.7 a position at the positions K has not
    reached yet; K is not held too low to ever measure them. With no traffic, α = the profile.
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
            given = prior[i] / prior_before if prior_before > 0 else 0.0
            p = before * min(1.0, scale * given)
            out.append(min(1.0, max(0.0, (a + w * p) / (d + w) if d + w > 0 else p)))
            if given > 0 and before > 0:
                scale = out[i] / before / given
        for i in range(1, len(out)):
            out[i] = min(out[i], out[i - 1])
        return out


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
    out = [min(1.0, max(0.0, a * ratio ** (i + 1))) for i, a in enumerate(batch_alpha)]
    for i in range(1, len(out)):
        out[i] = min(out[i], out[i - 1])
    return out


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
    """

    BINS = 10
    MAX_THRESHOLD = 0.8

    def __init__(self, decay: float = 0.995, prior_weight: float = 4.0) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self.reached = [0.0] * self.BINS
        self.accepted = [0.0] * self.BINS

    def observe(
        self, confidence: Sequence[Sequence[float]], draft_lens: Sequence[int], num_accepted: Sequence[int]
    ) -> None:
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for row, n, acc in zip(confidence, draft_lens, num_accepted):
            for j, p in enumerate(row[: min(n, acc + 1)]):  # positions verification reached
                b = min(self.BINS - 1, max(0, int(p * self.BINS)))
                self.reached[b] += 1
                self.accepted[b] += j < acc

    def rate(self, b: int) -> float:
        centre = (b + 0.5) / self.BINS
        w = self.prior_weight
        return (self.accepted[b] + w * centre) / (self.reached[b] + w)

    def threshold(self, break_even: float) -> float:
        t = 0.0
        for b in range(self.BINS):
            if self.rate(b) >= break_even:
                break
            t = (b + 1) / self.BINS
        return min(t, self.MAX_THRESHOLD)

    def snapshot(self) -> list[float]:
        return [round(self.rate(b), 3) for b in range(self.BINS)]


EVERY_N_UP_TO = 32  # loads up to this many requests price every count of drafting requests
# loads up to this many requests get a K each (refine_drafts); a larger one, where one request's K
# moves the step's goodput little and the search's host time grows with the load, the uniform K
PER_REQUEST_UP_TO = 64


def peak_counts(bs: int, k: int, runs: list[int]) -> list[int]:
    """The counts n of drafting requests (1..bs) at which the goodput of K=k can peak. Between two
    of them the time of a step is linear in n (the requests added owe the drafter alike, and the
    grid is read linearly between its columns, at n*k/bs), so the goodput, a ratio of two linear
    functions of n, is monotone there and peaks at an end: the ends of the runs of alike requests
    (``runs``: n where the n-th and the next differ), the grid's columns (n*k/bs whole), 1 and bs."""
    out = {1, bs, *runs, *(n + 1 for n in runs if n < bs)}
    for j in range(1, k):
        out.update((bs * j // k, -(-bs * j // k)))
    return sorted(n for n in out if 1 <= n <= bs)


def _key(candidates: Sequence[DraftCandidate], cost: list[float], i: int) -> tuple[float, bool]:
    return cost[i], not candidates[i].decoding


def refine_drafts(
    start: Sequence[int],
    rates: Sequence[Sequence[float]],
    charges: Sequence[float],
    caps: Sequence[int],
    drafted_cost: Callable[[tuple[int, ...]], float],
    plain_ms: float,
    batch_size: int,
) -> list[int]:
    """Per-request K by local search on the step's expected goodput, from ``start`` (e.g. the best
    uniform K).

    Request i drafting k_i tokens adds its expected accepted tokens sum(rates[i][:k_i]); the
    step's draft positions form layers, layer j holding the m_j requests with k_i > j, and
    ``drafted_cost(m)`` is what the drafts add to a plain step in ms (drafter passes and verified
    tokens) given m = (m_0, m_1, ...); a drafting request also pays ``charges[i]`` ms per token it
    generates (drafter catch-up). Goodput is

        (batch_size + sum_i sum(rates[i][:k_i])) / (plain_ms + drafted_cost(m) + catch-up)

    and each request's k_i (0..caps[i]) moves up or down by one while that raises it.
    """
    ks = [min(k, cap) for k, cap in zip(start, caps)]
    max_k = max(caps, default=0)
    m = [sum(k > j for k in ks) for j in range(max_k)]

    cumulative = [list(itertools.accumulate(r, initial=0.0)) for r in rates]

    def tokens_of(i: int, k: int) -> float:
        return cumulative[i][min(k, len(rates[i]))]

    def charge_of(i: int, k: int) -> float:
        return charges[i] * (1.0 + tokens_of(i, k)) if k else 0.0

    def drafted(layers: list[int]) -> float:
        return drafted_cost(tuple(c for c in layers if c)) if any(layers) else 0.0

    tokens = batch_size + sum(tokens_of(i, k) for i, k in enumerate(ks))
    time = plain_ms + drafted(m) + sum(charge_of(i, k) for i, k in enumerate(ks))
    if time <= 0:
        return ks
    for _ in range(2 * max_k + 2):
        improved = False
        for i in range(len(ks)):
            for new in (ks[i] + 1, ks[i] - 1):
                if not 0 <= new <= caps[i]:
                    continue
                j = min(new, ks[i])  # the layer the request joins or leaves
                step = 1 if new > ks[i] else -1
                moved = m[:j] + [m[j] + step] + m[j + 1 :]
                d_time = drafted(moved) - drafted(m) + charge_of(i, new) - charge_of(i, ks[i])
                d_tokens = tokens_of(i, new) - tokens_of(i, ks[i])
                if time + d_time > 0 and (tokens + d_tokens) / (time + d_time) > tokens / time * (1 + 1e-9):
                    tokens, time = tokens + d_tokens, time + d_time
                    m = moved
                    ks[i] = new
                    improved = True
                    break
        if not improved:
            break
    return ks


class GoodputK:
    """K* = argmax AL(K) / ITL(bs, K), with live acceptance, live step costs, and who drafts; then,
    with ``per_request``, a K for each request.

    ITL(bs, K) is the profile's grid (smoothed, interpolated) times the drift the live cost model
    (``kpolicy.cost``) has seen since the profile. Drafts are priced by one function,
    D(bs; m) = ``drafted_cost``: m = (m_0, m_1, ...) rows drafting positions 0, 1, ... add the rows
    they verify at the prices of the grid's row for the whole load (ITL(bs, K) read at K = drafted
    tokens / bs: rows join a step of bs requests, so they cost what rows cost there, not what they
    would cost alone), and the drafter passes they run. A draft model must first catch up on the
    tokens it has not seen (a new request's whole prompt), so request i costs c_i = catch-up ms per
    token x the tokens it owes per generated token. With requests sorted by c_i, for every K and
    every n the step's goodput is

        (bs + n (AL(K) - 1)) / (ITL(bs, 0) + D(bs; n, ..., n [K times]) + AL(K) * sum_{i<n} c_i)

    and the best (K, n) wins, with hysteresis on K. bs is the load (every running request,
    prefilling ones included, and waiting ones up to max_num_seqs): the decode batch dips whenever
    arrivals are prefilled, so it would mislead. Only decoding candidates draft.

    Per request (the default), that uniform choice is the start of ``refine_drafts``: each
    request's K moves by one while the step's expected goodput rises, with the request's own
    acceptance (``request_rates``) and the same D, so the search never leaves its start for a
    worse step. Without per-request K, a drafting slot is also charged the steady-state catch-up
    of the request that will replace it (one prompt per output budget); per request, each
    request pays what it owes when it drafts, and a replacement pays its own.

    Exploration: K=0 measures nothing, so a profile that underrates the traffic would never be
    corrected (one that overrates it is, by the drafts it wastes). When no request would draft,
    fewer than ``explore_below`` live drafts (decayed) stand behind the acceptance estimate, and
    drafting would pay were every α_i halfway from the estimate to 1, the request owing the drafter
    least drafts one token. Where even that hope would not draft (a wide batch), nothing is
    probed; where it would, the estimate keeps about ``explore_below`` drafts of evidence: a probe
    each time it fades from explore_below + 1 back under it, every ln(1 + 1/explore_below)/(1-decay)
    steps (11 by default) while K=0 stays right, one row of one draft token, a few percent of such
    a step, plus, with a draft model, the catch-up on what that request has not read. That can be
    its whole context (0.53 s after 170 steps of K=0 at 5 requests in the pair's rollout), and it
    is still paid: skipping such probes stopped a profile that underrates the traffic from being
    corrected at all (results/RESULTS.md, "A probe's price").

    Confidence stops: a decode stops drafting at a position whose drafter top probability is below
    ``min_draft_confidence()``, fixed by ``min_confidence`` or, when that is None, the top of the
    confidence bins whose measured acceptance is below break-even, V * bs / ITL(bs, 0) (V: what a
    verified token adds to a target pass; an accepted token is worth a plain step's time per token).
    """

    def __init__(
        self,
        profile: Profile,
        max_k: int,
        hysteresis_steps: int = 3,
        cost_model: StepCostModel | None = None,
        per_request: bool = True,
        min_confidence: float | None = None,
        explore_below: float = 4.0,
        source: str = "(given in memory)",
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
            checked = checked_cost_model(profile, source)
            if checked is not None:
                cost_model = StepCostModel(checked["target_ms"], checked["draft_pass_ms"])
            else:  # priced from the grid: its intercept holds the step overhead, so one live scale
                cost_model = StepCostModel(*prior_from_grid(self.itl_grid), shared_scale=True)
        self.costs = cost_model
        self.per_request = per_request
        self.requests = RequestAcceptance()
        self.fixed_confidence = min_confidence
        self.calibration = ConfidenceCalibration()
        self.load = 0  # the load of the last choice (for the confidence stop's break-even)
        self.explore_below = explore_below
        self.num_probes = 0  # steps where one request drafted only to measure acceptance
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
        return self._choose([DraftCandidate(1, 1 << 30)] * batch_size, explore=False)[0]

    def choose(self, candidates: Sequence[DraftCandidate]) -> tuple[int, list[int]]:
        return self._choose(candidates, explore=True)

    def _choose(self, candidates: Sequence[DraftCandidate], explore: bool) -> tuple[int, list[int]]:
        bs = self.load = len(candidates)
        if bs == 0:
            return 0, []
        alpha = self.acceptance.rates()
        per_token = self.costs.catchup_ms_per_token()
        if self.per_request:
            cost = [per_token * c.catchup_owed() for c in candidates]
        else:
            cost = [per_token * c.catchup_per_token() for c in candidates]
        order = sorted(range(bs), key=lambda i: (cost[i], not candidates[i].decoding))
        prefix = [0.0]
        for i in order:
            prefix.append(prefix[-1] + cost[i])
        plain = self.itl(bs, 0)
        drafted_cost = self._drafted_pricer(bs)
        runs = [
            n
            for n in range(1, bs)
            if _key(candidates, cost, order[n - 1]) != _key(candidates, cost, order[n])
        ]
        scores = self._scores(bs, plain, alpha, prefix, drafted_cost, runs)  # {(k, n): goodput}
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
        # what each request may draft: decoding ones, up to one token fewer than they have left
        caps = [min(self.max_k, max(0, c.tokens_left - 1)) if c.decoding else 0 for c in candidates]
        if self.per_request and self.max_k and plain and bs <= PER_REQUEST_UP_TO:
            drafts = refine_drafts(
                drafts,
                [self.requests.rates(c.request_id, alpha) for c in candidates],
                cost,
                caps,
                drafted_cost,
                plain,
                bs,
            )
            k = max(drafts)
        num_decoding = sum(c.decoding for c in candidates)
        self.num_withheld += num_decoding - sum(d > 0 for d in drafts) if k else 0
        if _log_change(self.k_by_batch_size, bs, k, "goodput"):
            log.info("acceptance estimate per position: %s", " ".join(f"{a:.2f}" for a in alpha))
        if explore and not k and plain and any(caps) and self.acceptance.evidence() < self.explore_below:
            hopeful = self._scores(bs, plain, [a + (1.0 - a) / 2 for a in alpha], prefix, drafted_cost, runs)
            if max(hopeful, key=hopeful.get)[0]:  # the probe: the request owing the drafter least
                drafts[min((i for i in range(bs) if caps[i]), key=cost.__getitem__)], k = 1, 1
                self.num_probes += 1
        return k, drafts

    def drafted_cost(self, bs: int, layers: tuple[int, ...]) -> float:
        """What drafts add to a plain step of ``bs`` requests, ``layers[j]`` of them drafting
        position j: the target's share of ITL(bs, K) at K = (drafted tokens) / bs, read between
        the grid's columns (a step's cost follows the rows it verifies, and the grid's row at this
        bs has them at this bs's prices: on this CPU whole 16-row blocks), less that K's drafter
        passes over bs rows, plus the drafter passes actually run, one per layer of its rows
        (``StepCostModel.draft_pass_ms``: none for n-gram)."""
        return self._drafted_pricer(bs)(layers)

    def _drafted_pricer(self, bs: int) -> Callable[[tuple[int, ...]], float]:
        """``drafted_cost`` at one load, memoized: the grid's row at bs and the drafter's passes
        read once, for the many sets of layers one choice prices."""
        row = [self.itl(bs, k) for k in range(self.max_k + 1)] if bs > 0 else []
        draft_pass = functools.cache(self._pass_pricer(bs, row))

        @functools.cache
        def cost(layers: tuple[int, ...]) -> float:
            drafted = sum(layers)
            if not drafted or bs <= 0:
                return 0.0
            k = min(drafted / bs, float(self.max_k))
            lo = int(k)
            low, plain = row[lo], row[0]
            high = row[lo + 1] if k > lo else low
            if low is None or high is None or plain is None:
                return float("inf")
            spec = low + (high - low) * (k - lo)
            target = max(0.0, spec - plain - k * draft_pass(bs))
            return target + sum(draft_pass(rows) for rows in layers if rows)

        return cost

    def _pass_pricer(self, bs: int, row: list[float | None]) -> Callable[[int], float]:
        """``StepCostModel.draft_pass_ms`` at a load of bs, scaled down where K passes over bs rows
        would cost more than the grid's row lets them: (ITL(bs, K) - ITL(bs, 0)) / K for every K
        (a drafter pass runs inside that difference). A cost model that agrees with the grid is
        left as it is; one that does not cannot price a uniform K above the grid's own step."""
        full = self.costs.draft_pass_ms(bs)
        room = [(t - row[0]) / k for k, t in enumerate(row) if k and t is not None and row[0] is not None]
        ceiling = max(0.0, min(room, default=full))
        factor = ceiling / full if full > ceiling else 1.0
        return lambda rows: self.costs.draft_pass_ms(rows) * factor

    def _scores(
        self,
        bs: int,
        plain: float | None,
        alpha: list[float],
        prefix: list[float],
        drafted_cost: Callable[[tuple[int, ...]], float],
        runs: list[int],
    ) -> dict[tuple[int, int], float]:
        """Goodput of (K, n first requests) over a plain step of ``plain`` ms (None: unknown), the n
        rows' K positions priced by ``drafted_cost`` (that of refine_drafts), for every n up to
        ``EVERY_N_UP_TO`` requests; beyond, for the n where the goodput can peak (``peak_counts``):
        the host time of a choice must stay small beside a GPU step of a few milliseconds."""
        if plain is None:
            return {}
        scores = {(0, 0): bs / plain}
        for k in range(1, self.max_k + 1):
            al = acceptance_length(alpha, k)
            for n in range(1, bs + 1) if bs <= EVERY_N_UP_TO else peak_counts(bs, k, runs):
                drafted = drafted_cost((n,) * k)
                if drafted != float("inf"):
                    scores[(k, n)] = (bs + n * (al - 1)) / (plain + drafted + al * prefix[n])
        return scores

    def min_draft_confidence(self) -> float:
        if self.fixed_confidence is not None:
            return self.fixed_confidence
        bs = max(1, self.load)
        plain = self.itl(bs, 0)
        if not plain or plain <= 0:
            return 0.0
        return self.calibration.threshold(min(1.0, self.costs.verify_ms_per_token() * bs / plain))

    def observe(self, record: StepRecord) -> None:
        result = record.result
        self.requests.release(record.plan.released)
        if result.draft_lens:
            lens = asked_positions(record)
            self.acceptance.observe(lens, result.num_accepted)
            ids = [r.request_id for r in record.plan.decodes]
            self.requests.observe(ids, lens, result.num_accepted)
            if record.draft_confidence is not None:
                self.calibration.observe(record.draft_confidence, result.draft_lens, result.num_accepted)
        self.costs.observe(record.timing)

    def snapshot(self) -> dict:
        return {
            "policy": "goodput",
            "per_request": self.per_request,
            "k": self.hysteresis.current,
            "k_by_batch_size": dict(sorted(self.k_by_batch_size.items())),
            "acceptance_rate_per_pos": [round(a, 4) for a in self.acceptance.rates()],
            "requests_withheld": self.num_withheld,
            "probes": self.num_probes,
            "min_draft_confidence": round(self.min_draft_confidence(), 3),
            "acceptance_by_confidence": self.calibration.snapshot(),
            "cost_model": self.costs.snapshot(),
        }


def asked_positions(record: StepRecord) -> list[int]:
    """The draft positions the acceptance estimates count for each decode of a step.

    A draft model runs a pass for every position it was asked for until a confidence stop; a
    position cut by the stop adds no token but its pass was paid. So with a drafter (the step
    carries draft confidences) acceptance is counted per position asked (``k_caps``), a stopped one
    counting as not accepted, and the expected tokens the policy weighs against the passes it buys
    are those it gets: at temperature 1.0 stops cut 20-40% of asked positions at 2-6 requests,
    where the rate per proposed token was 0.75-0.89 and per asked 0.45-0.65 (results/RESULTS.md,
    "The decoder stack as one call"). An n-gram proposer pays nothing for a position it cannot
    fill (no match costs no pass and no verification), so it counts what it proposed."""
    lens = record.result.draft_lens
    if record.draft_confidence is None:
        return list(lens)
    return [max(d, k) for d, k in zip(lens, record.plan.k_caps)]


def _log_change(k_by_batch_size: dict[int, int], batch_size: int, k: int, name: str) -> bool:
    if k_by_batch_size.get(batch_size) == k:
        return False
    k_by_batch_size[batch_size] = k
    log.info("%s policy: K=%d at batch size %d", name, k, batch_size)
    return True


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
