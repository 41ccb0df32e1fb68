"""What the ingress knows about each replica: its last report, and what the router did since.

Reports arrive two ways: Ray Serve's controller polls every replica's ``record_routing_stats``
(every ``request_routing_stats_period_s``) and hands them to the router with the replica list;
and every finished request's stream ends with its replica's report, so a busy replica's is
never older than its last finished request. The newer report (by the replica's clock) wins.

Between reports the router counts the requests it sent each replica (``routed_since``), from the
moment it chooses one: Serve confirms a route (``on_request_routed``) only once the replica has
accepted it, a round trip later, and a burst of requests is chosen for before the first
confirmation comes back. A report drops the routes to its replica that were confirmed before it
was measured; a choice never confirmed (its request was cancelled) is dropped after
``UNCONFIRMED_ROUTE_S``.

The router (Ray instantiates it from its class, inside the deployment handle) and the ingress's
/metrics share one board per deployment through ``board_for(name)``: the one process-wide
registry here, because Ray gives the router no other way in.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, fields

from dynaspec.kpolicy.routing import Candidate


@dataclass(slots=True)
class ReplicaReport:
    """One replica's state, measured by the replica (``record_routing_stats`` returns it as a dict)."""

    replica: str  # Ray Serve's replica id
    time: float  # when measured, the replica's wall clock (s)
    pid: int
    running: int  # requests decoding or prefilling
    waiting: int  # requests waiting for a slot (or not yet admitted by the engine thread)
    free_kv_blocks: int
    kv_cache_usage: float  # fraction of blocks in use
    k: int  # K chosen for the load at the last step with decodes
    acceptance: float | None  # accepted / drafted tokens since start; None without speculation
    ms_per_token: list[float]  # predicted ms per token for one more request, then one more, ...
    ms_per_token_is_proxy: bool  # no goodput model: a unitless proxy (kpolicy.routing.proxy_curve)
    requests_served: int  # requests finished since start
    generation_tokens: int
    prompt_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaReport | None:
        """A report from routing stats; None when the dict is not one (e.g. before the first poll)."""
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError:
            return None


COUNTERS = ("requests_served", "generation_tokens", "prompt_tokens", "num_drafts", "num_draft_tokens")


UNCONFIRMED_ROUTE_S = 30.0  # a choice Serve never confirmed is forgotten after this long


@dataclass(slots=True)
class _Route:
    replica: str
    chosen: float  # ingress clock
    confirmed: float | None = None  # when Serve said the replica accepted it


class ReplicaBoard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reports: dict[str, ReplicaReport] = {}  # live replicas' latest reports
        self._routes: dict[str, dict[str, _Route]] = {}  # replica -> {request: route} since its report
        self._where: dict[str, str] = {}  # request -> the replica it was last chosen for
        self.choices: dict[str, int] = {}  # requests routed per replica, ever
        self.retired: dict[str, ReplicaReport] = {}  # last reports of replicas that went away

    def update(self, report: ReplicaReport) -> None:
        with self._lock:
            old = self.reports.get(report.replica)
            if old is not None and old.time >= report.time:
                return
            if report.replica in self.retired:
                return
            self.reports[report.replica] = report
            routes = self._routes.get(report.replica, {})
            stale = time.time() - UNCONFIRMED_ROUTE_S
            for request, route in list(routes.items()):
                counted = route.confirmed is not None and route.confirmed <= report.time
                if counted or (route.confirmed is None and route.chosen < stale):
                    self._drop(request)

    def chose(self, replica: str, request: str) -> None:
        """The router ranked ``replica`` first for ``request`` (not yet sent: Serve may still
        send it to the next rank, or choose again)."""
        with self._lock:
            self._place(request, _Route(replica, time.time()))

    def routed(self, replica: str, request: str) -> None:
        """Serve sent ``request`` to ``replica`` and the replica accepted it."""
        now = time.time()
        with self._lock:
            route = self._routes.get(replica, {}).get(request)
            if route is None:  # chosen elsewhere first (that rank was full), or never recorded
                route = _Route(replica, now)
                self._place(request, route)
            route.confirmed = now
            self.choices[replica] = self.choices.get(replica, 0) + 1

    def _place(self, request: str, route: _Route) -> None:
        """The request's one route from now on (an earlier one, on any replica, is dropped)."""
        self._drop(request)
        self._routes.setdefault(route.replica, {})[request] = route
        self._where[request] = route.replica

    def _drop(self, request: str) -> None:
        replica = self._where.pop(request, None)
        if replica is not None:
            self._routes.get(replica, {}).pop(request, None)

    def keep_only(self, live: set[str]) -> None:
        """Forget replicas no longer running (their counters stay in the aggregates)."""
        with self._lock:
            for replica in [r for r in self.reports if r not in live]:
                self.retired[replica] = self.reports.pop(replica)
            for replica in [r for r in self._routes if r not in live]:
                for request in self._routes.pop(replica):
                    self._where.pop(request, None)

    def candidate(self, replica: str) -> Candidate:
        with self._lock:
            report = self.reports.get(replica)
            routed_since = len(self._routes.get(replica, ()))
        if report is None:
            return Candidate(replica, None, routed_since)
        return Candidate(replica, report.ms_per_token, routed_since, report.free_kv_blocks > 0)

    def snapshot(self) -> tuple[dict[str, ReplicaReport], dict[str, ReplicaReport], dict[str, int]]:
        """(live reports, retired reports, router choices), copied."""
        with self._lock:
            return dict(self.reports), dict(self.retired), dict(self.choices)


_BOARDS: dict[str, ReplicaBoard] = {}
_BOARDS_LOCK = threading.Lock()


def board_for(name: str) -> ReplicaBoard:
    """The board of deployment ``name`` in this process (created on first use)."""
    with _BOARDS_LOCK:
        return _BOARDS.setdefault(name, ReplicaBoard())
