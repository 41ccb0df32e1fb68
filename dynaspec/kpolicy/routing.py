"""Routing over engine replicas by predicted time per token (pure functions, plain Python).

Each replica predicts, from its own goodput model, how many milliseconds per output token one more
request would get there: with load L (running + waiting requests), the request joins a decode
batch of bs = min(L + 1, max_num_seqs), the replica would run it at K* = argmax_K AL(K)/ITL(bs, K),
and each step gives every request AL(K*) tokens, so

    ms per token = ITL(bs, K*) / AL(K*) x max(1, (L + 1) / max_num_seqs)

(the last factor: beyond max_num_seqs a request waits for a slot, sharing the replica's throughput).
A replica reports this for L, L+1, ..., L+PREDICTION_HORIZON-1 (a curve), so the router can correct
a stale report by the requests it has routed there since, without the replica's ITL grid.

The router samples two replicas (power of two choices) and sends the request to the lower
prediction at (requests routed there since its report); a replica with no free KV block comes
last, and one that has not reported yet comes first (it just started, so it is idle), ordered by
how many requests it was sent.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynaspec.kpolicy.profile import acceptance_length, argmax_goodput

PREDICTION_HORIZON = 8  # loads L .. L+7 reported per replica


def ms_per_token(
    itl: Callable[[int, int], float | None],
    alpha: Sequence[float],
    max_k: int,
    load: int,
    max_num_seqs: int,
) -> float | None:
    """Predicted ms per output token for one more request on a replica serving ``load`` requests;
    ``itl(bs, K)`` in ms (None: unknown). None when the model knows no time at that batch size."""
    bs = max(1, min(load + 1, max_num_seqs))
    k = argmax_goodput(list(alpha), lambda k: itl(bs, k), max_k)
    step = itl(bs, k)
    if step is None or step <= 0:
        return None
    share = max(1.0, (load + 1) / max(1, max_num_seqs))
    return step / acceptance_length(list(alpha), k) * share


def prediction_curve(
    itl: Callable[[int, int], float | None],
    alpha: Sequence[float],
    max_k: int,
    load: int,
    max_num_seqs: int,
    horizon: int = PREDICTION_HORIZON,
) -> list[float]:
    """ms_per_token at loads load .. load + horizon - 1, unknown points left out at the end."""
    out = []
    for extra in range(horizon):
        value = ms_per_token(itl, alpha, max_k, load + extra, max_num_seqs)
        if value is None:
            break
        out.append(value)
    return out


def proxy_curve(load: int, horizon: int = PREDICTION_HORIZON) -> list[float]:
    """Without a goodput model (fixed K, a table, no speculation): a unitless proxy, the requests
    one more would share the replica with, L + 1. Comparable between replicas of one deployment
    (they share one configuration), not a time. (The last step's K is no part of it: an idle
    replica's K is stale, and under a table K falls as load rises, which would rank a busy replica
    above an idle one.)"""
    return [float(load + 1 + extra) for extra in range(horizon)]


def predicted_at(curve: Sequence[float], extra: int) -> float:
    """The curve at ``extra`` requests beyond the report, extrapolated linearly past its end."""
    if not curve:
        return math.inf
    if extra < len(curve):
        return curve[extra]
    slope = curve[-1] - curve[-2] if len(curve) >= 2 else curve[-1]
    return curve[-1] + max(0.0, slope) * (extra - len(curve) + 1)


@dataclass(slots=True, frozen=True)
class Candidate:
    replica: str
    curve: Sequence[float] | None  # the replica's last reported prediction curve; None: no report yet
    routed_since: int  # requests routed there since that report
    has_kv_room: bool = True  # free KV blocks in the last report


def rank(candidates: Sequence[Candidate]) -> list[str]:
    """Replica ids, best first: room in the KV cache, then unreported (idle) ones by requests sent,
    then the lowest predicted ms per token corrected by the requests routed since the report."""

    def key(c: Candidate) -> tuple:
        if c.curve is None:
            return (not c.has_kv_room, 0, float(c.routed_since))
        return (not c.has_kv_room, 1, predicted_at(c.curve, c.routed_since))

    return [c.replica for c in sorted(candidates, key=key)]


def sample(replicas: Sequence[str], rng: random.Random, d: int = 2) -> list[str]:
    """d distinct replicas drawn uniformly (all of them when there are at most d), in random
    order: the first of two equal ones is either."""
    return rng.sample(list(replicas), min(d, len(replicas)))


def choose(candidates: Sequence[Candidate], rng: random.Random, d: int = 2) -> list[str]:
    """Power of d choices over the prediction: d sampled replicas, best first."""
    by_id = {c.replica: c for c in candidates}
    return rank([by_id[r] for r in sample(list(by_id), rng, d)])
