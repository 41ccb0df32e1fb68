"""The goodput policy: K* = argmax_K AL(K) / ITL(bs, K), chosen together with which requests draft.

``GoodputK`` prices each (K, n drafting requests) from a profile, with acceptance
(``kpolicy.acceptance``) and step costs (``kpolicy.cost``) that follow live traffic; by default it
then gives each request its own K and tunes draft confidence stops from what the target accepted.
Its helpers: ``peak_counts`` (the counts of drafting requests worth pricing on a wide load),
``refine_drafts`` (per-request K by local search), ``asked_positions`` (what a step's acceptance
counts) and the loads up to which each search runs (``EVERY_N_UP_TO``, ``PER_REQUEST_UP_TO``).
Every division is guarded: empty or zero data never crashes it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence

from dynaspec.engine.types import DraftCandidate, StepRecord
from dynaspec.kpolicy.acceptance import AcceptanceEstimate, ConfidenceCalibration, RequestAcceptance
from dynaspec.kpolicy.cost import CellCorrection, StepCostModel, prior_from_grid
from dynaspec.kpolicy.hysteresis import Hysteresis, log_change
from dynaspec.kpolicy.profile import (
    Profile,
    acceptance_length,
    checked_cost_model,
    context_model,
    interpolate_itl,
    smooth_itl,
)

log = logging.getLogger(__name__)


EVERY_N_UP_TO = 32  # loads up to this many requests price every count of drafting requests
# loads up to this many requests get a K each (refine_drafts); a larger one, where one request's K
# moves the step's goodput little and the search's host time grows with the load, the uniform K
PER_REQUEST_UP_TO = 64
# steps a choice is kept while the load is the same requests, all decoding and caught up: between
# two choices only the acceptance estimates move (a few percent a step), and a choice's host time
# (0.2-3 ms in Python at 1-64 requests) stalls a GPU whose step is 5-15 ms
REDECIDE_EVERY = 4
# ... but only where the last choice took at least this share of the last step's time (a GPU):
# on a CPU, whose steps take 30-300 ms, every step decides
KEEP_ABOVE_SHARE = 0.01
# exploring the grid's cells (``CellCorrection``): where every request drafts the same K at a
# profiled batch size, a neighbouring K whose goodput is within EXPLORE_MARGIN of the best runs
# one step once its cell has gone EXPLORE_EVERY steps untimed (and K=0, the step every drafting K is
# weighed against, likewise); at most 3 steps in EXPLORE_EVERY,
# each at most EXPLORE_MARGIN worse by the estimate: under 1% of goodput when the estimate is right
EXPLORE_MARGIN = 0.08
EXPLORE_EVERY = 24
# ... once the grid's drift rests on this many whole steps (decayed): a cell is corrected relative
# to the drift, so one timed against a drift still settling would keep the difference
EXPLORE_AFTER = 8.0
# the hysteresis holds a K only while its goodput by the step's scores is within this share of the
# best K's: a near tie at a batch-size boundary, not a K left over from another load
HOLD_WITHIN = 0.10


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
    drafted_cost: Callable[[tuple[int, ...], int], float],
    plain_ms: float,
    batch_size: int,
    free: Sequence[bool] = (),
) -> tuple[list[int], float]:
    """Per-request K by local search on the step's expected goodput, from ``start`` (e.g. the best
    uniform K).

    Request i drafting k_i tokens adds its expected accepted tokens sum(rates[i][:k_i]); the
    step's draft positions form layers, layer j holding the m_j drafter rows with k_i > j, and
    ``drafted_cost(m, f)`` is what the drafts add to a plain step in ms (drafter passes and
    verified tokens) given m = (m_0, m_1, ...) and f, the draft tokens of the ``free`` requests,
    which draft at no drafter pass (a suffix match: verified tokens only); a drafting request also
    pays ``charges[i]`` ms per token it generates (drafter catch-up). Goodput is

        (batch_size + sum_i sum(rates[i][:k_i])) / (plain_ms + drafted_cost(m, f) + catch-up)

    and each request's k_i (0..caps[i]) moves up or down by one while that raises it. Returns the
    k_i and that goodput (tokens per ms).
    """
    free = list(free) or [False] * len(start)
    ks = [min(k, cap) for k, cap in zip(start, caps)]
    max_k = max(caps, default=0)
    m = [sum(k > j for k, f in zip(ks, free) if not f) for j in range(max_k)]
    f_tokens = sum(k for k, f in zip(ks, free) if f)

    cumulative = [list(itertools.accumulate(r, initial=0.0)) for r in rates]

    def tokens_of(i: int, k: int) -> float:
        return cumulative[i][min(k, len(rates[i]))]

    def charge_of(i: int, k: int) -> float:
        return charges[i] * (1.0 + tokens_of(i, k)) if k else 0.0

    def drafted(layers: list[int], f: int) -> float:
        return drafted_cost(tuple(c for c in layers if c), f) if any(layers) or f else 0.0

    tokens = batch_size + sum(tokens_of(i, k) for i, k in enumerate(ks))
    time = plain_ms + drafted(m, f_tokens) + sum(charge_of(i, k) for i, k in enumerate(ks))
    if time <= 0:
        return ks, 0.0
    for _ in range(2 * max_k + 2):
        improved = False
        for i in range(len(ks)):
            for new in (ks[i] + 1, ks[i] - 1):
                if not 0 <= new <= caps[i]:
                    continue
                step = 1 if new > ks[i] else -1
                moved, f_moved = m, f_tokens + step
                if not free[i]:
                    j = min(new, ks[i])  # the layer the request joins or leaves
                    moved, f_moved = m[:j] + [m[j] + step] + m[j + 1 :], f_tokens
                d_time = (
                    drafted(moved, f_moved) - drafted(m, f_tokens) + charge_of(i, new) - charge_of(i, ks[i])
                )
                d_tokens = tokens_of(i, new) - tokens_of(i, ks[i])
                if time + d_time > 0 and (tokens + d_tokens) / (time + d_time) > tokens / time * (1 + 1e-9):
                    tokens, time = tokens + d_tokens, time + d_time
                    m, f_tokens = moved, f_moved
                    ks[i] = new
                    improved = True
                    break
        if not improved:
            break
    return ks, tokens / time


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
    corrected at all (the results diary, "A probe's price").

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
        redecide_every: int = REDECIDE_EVERY,
        explore_every: int = EXPLORE_EVERY,
        live_cells: bool = True,
        price_matches: bool = True,
        hold_within: float = HOLD_WITHIN,
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
        # the profile's context axis (None without one): steps over longer contexts than the
        # grid's cost more, the more so the more they draft
        self.context_cost = context_model(profile)
        self.context: float | None = None  # the mean context per request of the last choice's load
        if cost_model is None:
            checked = checked_cost_model(profile, source)
            if checked is not None:
                cost_model = StepCostModel(
                    checked["target_ms"], checked["draft_pass_ms"], context=self.context_cost
                )
            else:  # priced from the grid: its intercept holds the step overhead, so one live scale
                cost_model = StepCostModel(
                    *prior_from_grid(self.itl_grid, profile.catchup_ms_per_token),
                    shared_scale=True,
                    context=self.context_cost,
                )
        self.costs = cost_model
        self.per_request = per_request
        self.requests = RequestAcceptance()
        self.fixed_confidence = min_confidence
        self.calibration = ConfidenceCalibration()
        # acceptance of matches' tokens by their frequency and position (first, second, later): the
        # n-gram's, and a draft model's with suffix decoding
        self.match_calibration = ConfidenceCalibration(positions=3)
        self._free: list[bool] = []  # the last choice's candidates that take their free match
        self.load = 0  # the load of the last choice (for the confidence stop's break-even)
        self.explore_below = explore_below
        self.num_probes = 0  # steps where one request drafted only to measure acceptance
        self.num_withheld = 0  # request-steps kept from drafting because their catch-up would not pay
        self.redecide_every = max(1, redecide_every)
        self.num_reused = 0  # steps that kept the last choice (``REDECIDE_EVERY``)
        self._kept: tuple[tuple, list[int], int] | None = None  # (load, drafts, steps kept)
        self._step_ms = 0.0  # the last step's passes (target and drafter)
        # the grid's cells as live steps of each found them (``itl`` reads this grid)
        self.cells = CellCorrection(self.itl_grid)
        self.live_cells = live_cells  # False: the grid read through the cost model's drift alone
        self.explore_every = explore_every if live_cells else 0  # 0: never run a step only to time a cell
        self.num_explored = 0  # steps run at a neighbouring K to time its cell
        self._choice_ms = 0.0  # the host time of the last choice (a step's time less it is a cell's)
        # per request, a proposer whose only drafts are its matches (the n-gram) has each row priced
        # by its own match (``_match_drafts``); False: by the request's acceptance, as a drafter's
        self.price_matches = price_matches
        self.hold_within = hold_within  # 1.0: the hysteresis holds its K at any gap (an A/B)
        self._matches_only = False  # the last choice priced rows by their matches

    def itl(self, batch_size: int, k: int) -> float | None:
        """ITL(bs, K) in ms over the load's mean context (``self.context``): the profile's grid with
        its live cells' corrections, moved along its context axis, times the grid's drift (the cost
        model's until a whole step has been timed, and always without live cells); the cost
        model's alone off the grid."""
        base = interpolate_itl(self.cells.grid, batch_size, k)
        if base is None:
            model = self._at_context(self.costs.itl(batch_size, k), batch_size, k)
            return model if model > 0 else None
        drift = self.cells.drift() if self.live_cells else None
        return self._at_context(base, batch_size, k) * (drift or self.costs.drift(batch_size, k))

    def _at_context(self, ms: float, batch_size: int, k: int) -> float:
        if self.context_cost is None or ms <= 0:
            return ms
        return self.context_cost.itl(ms, batch_size, self.context, k)

    def k_for_batch(self, batch_size: int, context: int = 0) -> int:
        """K for a batch whose drafter is caught up everywhere (each request's context ``context``
        tokens; 0: the profile's grid's)."""
        load = [DraftCandidate(1, 1 << 30, context_tokens=context)] * batch_size
        return self._choose(load, explore=False)[0]

    def choose(self, candidates: Sequence[DraftCandidate]) -> tuple[int, list[int]]:
        """The step's K and each request's drafts. Where a choice's host time is a noticeable share
        of a step (``KEEP_ABOVE_SHARE``: a GPU), a choice is kept for up to ``redecide_every``
        steps while the load is the same requests, all decoding and caught up (each request's kept
        K cut to what it may still draft); any other load, a probe, or the last kept step decides
        afresh."""
        load = tuple((c.request_id, c.prompt_tokens, c.max_tokens) for c in candidates)
        # (free matches change every step: a load offering any is decided afresh)
        steady = all(c.decoding and self._caught_up(c) and not c.free_rates for c in candidates)
        kept = self._kept
        if steady and kept is not None and kept[0] == load and kept[2] < self.redecide_every:
            drafts = [min(d, max(0, c.tokens_left - 1)) for d, c in zip(kept[1], candidates)]
            self._kept = (load, kept[1], kept[2] + 1)
            self.num_reused += 1
            self._choice_ms = 0.0
            return max(drafts, default=0), drafts
        probes, explored, start = self.num_probes, self.num_explored, time.perf_counter()
        k, drafts = self._choose(candidates, explore=True)
        self._choice_ms = (time.perf_counter() - start) * 1000
        worth = self._choice_ms >= KEEP_ABOVE_SHARE * self._step_ms
        usual = self.num_probes == probes and self.num_explored == explored
        self._kept = (load, drafts, 1) if steady and worth and usual else None
        return k, drafts

    def _choose(self, candidates: Sequence[DraftCandidate], explore: bool) -> tuple[int, list[int]]:
        bs = self.load = len(candidates)
        if bs == 0:
            return 0, []
        context = sum(c.context_tokens for c in candidates)
        self.context = context / bs if context > 0 else None
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
        k = self._held(wanted, scores)
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
        self._free = []
        self._matches_only = False
        matches_only = self.price_matches and any(c.match_only and c.decoding for c in candidates)
        if matches_only and self.per_request and self.max_k and plain and bs <= PER_REQUEST_UP_TO:
            drafts = self._match_drafts(candidates, drafts, caps, drafted_cost, plain)
            k, self._matches_only = max(drafts), True
        elif self.per_request and self.max_k and plain and bs <= PER_REQUEST_UP_TO:
            rates = [self.requests.rates(c.request_id, alpha) for c in candidates]
            drafts, best = refine_drafts(drafts, rates, cost, caps, drafted_cost, plain, bs)
            if any(c.free_rates for c in candidates):
                drafts = self._take_matches(candidates, drafts, best, rates, cost, caps, drafted_cost, plain)
            k = max(drafts)
        num_decoding = sum(c.decoding for c in candidates)
        self.num_withheld += num_decoding - sum(d > 0 for d in drafts) if k else 0
        if log_change(self.k_by_batch_size, bs, k, "goodput"):
            log.info("acceptance estimate per position: %s", " ".join(f"{a:.2f}" for a in alpha))
        probe = not self._matches_only and self.acceptance.evidence() < self.explore_below
        if explore and not k and plain and any(caps) and probe:
            hopeful = self._scores(bs, plain, [a + (1.0 - a) / 2 for a in alpha], prefix, drafted_cost, runs)
            if max(hopeful, key=hopeful.get)[0]:  # the probe: the request owing the drafter least
                drafts[min((i for i in range(bs) if caps[i]), key=cost.__getitem__)], k = 1, 1
                self.num_probes += 1
        elif explore and self.explore_every:
            neighbour = self._neighbour_to_time(candidates, drafts, caps, scores)
            if neighbour is not None:
                k, drafts = neighbour, [neighbour] * bs
        return k, drafts

    def _held(self, wanted: int, scores: dict[tuple[int, int], float]) -> int:
        """The step's K through the hysteresis, which holds the last K against a near tie only:
        where the held K's best goodput is more than ``hold_within`` (``HOLD_WITHIN``) below the
        wanted K's, the wanted K is taken at once. A K held from another load could be far from
        right: one kept from the long tail at one request made eight new requests on 2,900-token
        prompts each catch their drafter up on 260 tokens to draft five, where K=0 was about a
        quarter better by the profile's prices (issue 40, the pair on longedit with warm
        policies: 0.79 of none)."""
        held = self.hysteresis.current
        if held is not None and held != wanted and scores:
            best = max(scores.values())
            kept = max((v for (k, _), v in scores.items() if k == held), default=0.0)
            if kept < best * (1 - self.hold_within):
                return self.hysteresis.take(wanted)
        return self.hysteresis.update(wanted)

    def _caught_up(self, candidate: DraftCandidate) -> bool:
        """Whether its drafter owes no more than what the last step accepted (a draft model reads
        those tokens with its next first pass, as the profile's steps did), not a prompt."""
        return candidate.unseen_tokens <= 1 + self.max_k

    def _neighbour_to_time(
        self,
        candidates: Sequence[DraftCandidate],
        drafts: list[int],
        caps: list[int],
        scores: dict[tuple[int, int], float],
    ) -> int | None:
        """A K next to the step's to run instead, to time its cell of the grid (``CellCorrection``),
        or None: where the step is one cell (a profiled batch size, every request decoding, caught
        up and drafting the same K), the K one above or below it, or K=0, whose uniform goodput by
        the estimate is within EXPLORE_MARGIN of the best, once its cell has gone EXPLORE_EVERY steps
        untimed, and once the grid's drift rests on EXPLORE_AFTER steps. A cell the policy never
        chose was otherwise never corrected: on zen5 one read 13% high and hid a clear win (issue
        37)."""
        bs = len(candidates)
        row = self.cells.base.get(bs)
        if row is None or not scores or any(d != drafts[0] for d in drafts):
            return None
        if self.cells.scale.weight < EXPLORE_AFTER:
            return None
        if not all(c.decoding and self._caught_up(c) and not c.free_rates for c in candidates):
            return None
        best = max(scores.values())
        # the plain step too: every drafting K is weighed against it, and a drafting policy never
        # timed it (issue 40's pair at four long-context requests: priced 7% dear, a tie lost)
        for k in (drafts[0] + 1, drafts[0] - 1, *((0,) if drafts[0] > 1 else ())):
            score = scores.get((k, bs) if k else (0, 0))
            if not 0 <= k <= min(caps) or k not in row or score is None:
                continue
            if score >= best * (1 - EXPLORE_MARGIN) and self.cells.due((bs, k), self.explore_every):
                self.cells.tried((bs, k))
                self.num_explored += 1
                return k
        return None

    def _take_matches(
        self,
        candidates: Sequence[DraftCandidate],
        drafts: list[int],
        best: float,
        rates: list[list[float]],
        cost: list[float],
        caps: list[int],
        drafted_cost: Callable[[tuple[int, ...], int], float],
        plain: float,
    ) -> list[int]:
        """Which requests take their free match (``DraftCandidate.free_rates``: no drafter pass, no
        catch-up) and their drafts: each match's rates from how often the target kept matched
        tokens of its frequency (``match_calibration``), the other requests' from the drafter.
        Three ways are searched from ``drafts`` (the drafter's alone, of goodput ``best``): every
        match taken, and the matches that expect at least the drafter's tokens over as many
        positions; the best of the three is kept (``free_rows``)."""
        bs = len(candidates)
        matched = [self.match_calibration.expected(c.free_rates[: caps[i]]) for i, c in enumerate(candidates)]
        at_least = [bool(m) and sum(m) >= sum(rates[i][: len(m)]) for i, m in enumerate(matched)]
        every = [bool(m) for m in matched]
        for free in (every, at_least) if at_least != every else (every,):
            if not any(free):
                continue
            ks, goodput = refine_drafts(
                [min(d, len(m)) if f else d for d, f, m in zip(drafts, free, matched)],
                [m if f else r for f, m, r in zip(free, matched, rates)],
                [0.0 if f else c for f, c in zip(free, cost)],
                [len(m) if f else cap for f, m, cap in zip(free, matched, caps)],
                drafted_cost,
                plain,
                bs,
                free,
            )
            if goodput > best * (1 + 1e-9):
                drafts, best, self._free = ks, goodput, free
        return drafts

    def _match_drafts(
        self,
        candidates: Sequence[DraftCandidate],
        start: list[int],
        caps: list[int],
        drafted_cost: Callable[[tuple[int, ...], int], float],
        plain: float,
    ) -> list[int]:
        """Each request's drafts where its match is all the proposer can draft (``match_only``: the
        n-gram): the rates of its match's tokens by their confidence, as the target kept such
        tokens (``match_calibration``), up to the match's length; no drafter pass, no catch-up.
        The search starts from ``start`` (the uniform choice) and from no drafts, the better kept:
        a request's acceptance says little of its next match (the n-gram at eight MT-Bench requests
        accepted 1.28 of rows of three tokens where the request's rates expected 2.22)."""
        bs = len(candidates)
        caps = [min(cap, len(c.free_rates)) for cap, c in zip(caps, candidates)]
        rates = [self.match_calibration.expected(c.free_rates[:cap]) for c, cap in zip(candidates, caps)]
        free, charges = [True] * bs, [0.0] * bs
        ks, goodput = refine_drafts(
            [min(d, cap) for d, cap in zip(start, caps)], rates, charges, caps, drafted_cost, plain, bs, free
        )
        from_none, other = refine_drafts([0] * bs, rates, charges, caps, drafted_cost, plain, bs, free)
        return from_none if other > goodput * (1 + 1e-9) else ks

    def free_rows(self) -> list[bool]:
        return self._free

    def drafted_cost(self, bs: int, layers: tuple[int, ...], free_tokens: int = 0) -> float:
        """What drafts add to a plain step of ``bs`` requests, ``layers[j]`` of them drafting
        position j from the drafter and ``free_tokens`` more drafted at no drafter pass (suffix
        matches): the target's share of ITL(bs, K) at K = (drafted tokens) / bs, read between
        the grid's columns (a step's cost follows the rows it verifies, and the grid's row at this
        bs has them at this bs's prices: on this CPU whole 16-row blocks), less that K's drafter
        passes over bs rows, plus the drafter passes actually run, one per layer of its rows
        (``StepCostModel.draft_pass_ms``: none for n-gram). A free token costs at least the
        cheapest verified token of the row's other cells (else the cost model's
        ``verify_ms_per_token``): a cell timed cheaper than its plain step and drafter passes
        together reads 0 a token, and would make every match pay at that load."""
        return self._drafted_pricer(bs)(layers, free_tokens)

    def _drafted_pricer(self, bs: int) -> Callable[[tuple[int, ...], int], float]:
        """``drafted_cost`` at one load, memoized: the grid's row at bs and the drafter's passes
        read once, for the many sets of layers one choice prices."""
        row = [self.itl(bs, k) for k in range(self.max_k + 1)] if bs > 0 else []
        draft_pass = functools.cache(self._pass_pricer(bs, row))
        shares = [
            (t - row[0] - k * draft_pass(bs)) / (k * bs)
            for k, t in enumerate(row)
            if k and t is not None and row[0] is not None
        ]
        verify_floor = min((x for x in shares if x > 0), default=self.costs.verify_ms_per_token())
        pass_ms = [draft_pass(rows) for rows in range(max(0, bs) + 1)]  # a layer holds at most bs rows

        @functools.cache
        def cost(layers: tuple[int, ...], free_tokens: int = 0) -> float:
            rows_drafted = sum(layers)
            drafted = rows_drafted + free_tokens
            if not drafted or bs <= 0:
                return 0.0
            k = min(drafted / bs, float(self.max_k))
            lo = int(k)
            low, plain = row[lo], row[0]
            high = row[lo + 1] if k > lo else low
            if low is None or high is None or plain is None:
                return float("inf")
            spec = low + (high - low) * (k - lo)
            per_token = max(0.0, spec - plain - k * draft_pass(bs)) / drafted
            free = free_tokens * max(per_token, verify_floor) if free_tokens else 0.0
            passes = 0
            for rows in layers:
                if rows:
                    passes += pass_ms[rows] if rows <= bs else draft_pass(rows)
            return per_token * rows_drafted + free + passes

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
        if self._matches_only:  # each row's length was chosen by its tokens' confidence already
            return 0.0
        bs = max(1, self.load)
        plain = self.itl(bs, 0)
        if not plain or plain <= 0:
            return 0.0
        return self.calibration.threshold(min(1.0, self.costs.verify_ms_per_token() * bs / plain))

    def observe(self, record: StepRecord) -> None:
        result = record.result
        self.requests.release(record.plan.released)
        if result.draft_lens:
            lens, accepted = asked_positions(record), result.num_accepted
            ids = [r.request_id for r in record.plan.decodes]
            confidence, draft_lens = record.draft_confidence, result.draft_lens
            free = record.plan.free_rows
            if any(free):  # matches' rows teach their calibration, the drafter's rows the rest
                if confidence is not None:
                    self.match_calibration.observe(*_rows(free, confidence, draft_lens, accepted))
                drafter = [not f for f in free]
                lens, ids, accepted, draft_lens = _rows(drafter, lens, ids, accepted, draft_lens)
                confidence = None if confidence is None else _rows(drafter, confidence)[0]
            if self._matches_only and confidence is not None:  # every row drafted its match
                self.match_calibration.observe(confidence, draft_lens, accepted)
            self.acceptance.observe(lens, accepted)
            self.requests.observe(ids, lens, accepted)
            if confidence is not None:
                self.calibration.observe(confidence, draft_lens, accepted)
        timing = record.timing
        self._observe_cell(record)
        self.costs.observe(timing, timing.step_ms - self._choice_ms)
        self._step_ms = timing.target_ms + sum(p[2] for p in timing.draft_passes)  # DraftPass.ms

    def _observe_cell(self, record: StepRecord) -> None:
        """A whole decode step (nothing prefilled, the drafter caught up, no free matches) moves the
        grid's drift, and one that was one cell of the grid teaches that cell (``CellCorrection``):
        its wall time less the policy's own choice, against the grid read at the step's rows, mean
        drafts and context, plus drafter passes beyond those drafts (a confidence stop's, or a
        ragged K's) at the profile's price; a cell against its figure times the drift as it was
        before this step."""
        cells, timing = self.cells, record.timing
        cells.steps += 1
        if not (self.live_cells and cells.whole(timing)) or any(record.plan.free_rows):
            return
        rows = timing.decode_rows
        k = (timing.verify_tokens - rows) / rows
        predicted = interpolate_itl(cells.base, rows, k)
        if predicted is None:
            return
        context = timing.context_tokens / rows if timing.context_tokens else None
        if self.context_cost is not None:
            predicted = self.context_cost.itl(predicted, rows, context, k)
        predicted += max(0.0, len(timing.draft_passes) - k) * self.costs.draft_pass_ms(rows, prior=True)
        wall = timing.step_ms - self._choice_ms
        cell = cells.cell_of(timing, record.result.draft_lens)
        if cell is not None:
            cells.observe(cell, wall, predicted * cells.scale.value)
        cells.observe_step(wall, predicted)

    def snapshot(self) -> dict:
        return {
            "policy": "goodput",
            "per_request": self.per_request,
            "k": self.hysteresis.current,
            "k_by_batch_size": dict(sorted(self.k_by_batch_size.items())),
            "acceptance_rate_per_pos": [round(a, 4) for a in self.acceptance.rates()],
            "requests_withheld": self.num_withheld,
            "probes": self.num_probes,
            "choices_kept": self.num_reused,
            "explored": self.num_explored,
            "live_cells": self.cells.snapshot(),
            "grid_drift": None if self.cells.drift() is None else round(self.cells.drift(), 4),
            "min_draft_confidence": round(self.min_draft_confidence(), 3),
            "acceptance_by_confidence": self.calibration.snapshot()[0],
            "match_acceptance_by_frequency": self.match_calibration.snapshot(),
            "cost_model": self.costs.snapshot(),
            "context_tokens": None if self.context is None else round(self.context, 1),
            "context_cost": None
            if self.context_cost is None
            else {
                "reference_tokens": self.context_cost.reference,
                "ms_per_row_per_1k_tokens": self.context_cost.per_row,
                "ms_per_row_per_draft_per_1k_tokens": self.context_cost.per_draft,
                "by_batch_size": {str(bs): [u, v] for bs, u, v in self.context_cost.by_batch},
            },
        }


def _rows(keep: Sequence[bool], *columns: Sequence) -> list[list]:
    """Each column cut to the rows ``keep`` marks."""
    return [[v for v, k in zip(column, keep) if k] for column in columns]


def asked_positions(record: StepRecord) -> list[int]:
    """The draft positions the acceptance estimates count for each decode of a step.

    A draft model runs a pass for every position it was asked for until a confidence stop; a
    position cut by the stop adds no token but its pass was paid. So with a drafter that pays for
    them (``StepRecord.unfilled_positions_paid``) acceptance is counted per position asked
    (``k_caps``), a stopped one counting as not accepted, and the expected tokens the policy weighs
    against the passes it buys are those it gets: at temperature 1.0 stops cut 20-40% of asked
    positions at 2-6 requests, where the rate per proposed token was 0.75-0.89 and per asked
    0.45-0.65 (the results diary, "The decoder stack as one call"). A model-free proposer (n-gram,
    suffix) pays nothing for a position it does not fill (no pass, no verification), so it counts
    what it proposed."""
    lens = record.result.draft_lens
    if not record.unfilled_positions_paid:
        return list(lens)
    return [max(d, k) for d, k in zip(lens, record.plan.k_caps)]
