"""Ray Serve request router: power of two choices over each replica's predicted ms per token.

Ray Serve calls ``choose_replicas`` for each request with the running replicas (their routing
stats attached: our ``ReplicaReport``s); the choice itself is ``kpolicy.routing.choose``, a pure
function. We return each sampled replica as its own rank, best first, so Serve sends the request
to the best one unless its queue is full (``max_ongoing_requests``), then the next. The board
counts the request on the best one at once (see ``board``: a burst is chosen for before Serve
confirms any of it). A request
pinned to a replica (``replica=`` argument, from the ``X-Dynaspec-Replica`` header) goes there
while that replica runs.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from dynaspec.kpolicy.routing import rank, sample
from dynaspec.replicas.board import ReplicaBoard, ReplicaReport, board_for


class LoadAwareRouter(RequestRouter):
    def initialize_state(self, board: str = "dynaspec", choices: int = 2, seed: int | None = None) -> None:
        self.board: ReplicaBoard = board_for(board)
        self.num_choices = choices
        self.rng = random.Random(seed)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = pending_request.kwargs.get("replica") if pending_request is not None else None
        if pinned in by_id:
            return [[by_id[pinned]]]
        sampled = sample(list(by_id), self.rng, self.num_choices)  # O(1) work past this point
        self._read_reports([by_id[i] for i in sampled])
        ranked = rank([self.board.candidate(i) for i in sampled])
        if pending_request is not None:  # counted at once: the next request's choice sees it
            self.board.chose(ranked[0], pending_request.metadata.internal_request_id)
        return [[by_id[i]] for i in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.board.routed(replica_id.unique_id, pending_request.metadata.internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica list (after a start, a death, or new routing stats)."""
        super().update_replicas(replicas)
        self.board.keep_only({r.replica_id.unique_id for r in replicas})
        self._read_reports(replicas)

    def _read_reports(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            report = ReplicaReport.from_dict(r.routing_stats or {})
            if report is not None and report.replica == r.replica_id.unique_id:
                self.board.update(report)
