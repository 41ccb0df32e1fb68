"""The ingress's replica board: requests count on a replica from the router's choice, before Serve
confirms them, so a burst chosen in one go spreads over the replicas (pure Python, no Ray)."""

from __future__ import annotations

import random
import time

from dynaspec.kpolicy.routing import proxy_curve, rank, sample
from dynaspec.replicas import board as board_module
from dynaspec.replicas.board import ReplicaBoard, ReplicaReport


def report(replica: str, load: int, at: float) -> ReplicaReport:
    curve = proxy_curve(load)
    return ReplicaReport(replica, at, 1, load, 0, 10, 0.0, 0, None, curve, True, 0, 0, 0)


def route(board: ReplicaBoard, rng: random.Random, request: str) -> str:
    """What LoadAwareRouter.choose_replicas does for one request: the best of two, counted."""
    ranked = rank([board.candidate(r) for r in sample(["a", "b"], rng)])
    board.chose(ranked[0], request)
    return ranked[0]


def test_a_burst_chosen_before_any_confirmation_spreads_evenly():
    board = ReplicaBoard()
    now = time.time()
    board.update(report("a", 0, now))
    board.update(report("b", 0, now))
    rng = random.Random(0)
    picks = [route(board, rng, f"r{i}") for i in range(100)]  # Serve confirms none of them yet
    assert picks.count("a") == picks.count("b") == 50
    assert board.candidate("a").routed_since == 50


def test_a_report_drops_only_the_routes_it_counted():
    board = ReplicaBoard()
    board.update(report("a", 0, time.time() - 10))
    board.chose("a", "early")
    board.routed("a", "early")  # confirmed: the replica has it
    board.chose("a", "in_flight")  # chosen, not yet confirmed
    board.update(report("a", 1, time.time()))  # counts "early" (load 1), not "in_flight"
    assert board.candidate("a").routed_since == 1
    board.routed("a", "in_flight")
    assert board.choices == {"a": 2}
    board.update(report("a", 2, time.time() + 1))
    assert board.candidate("a").routed_since == 0


def test_a_request_sent_to_its_second_rank_moves_there():
    board = ReplicaBoard()
    board.chose("a", "r")
    board.chose("b", "r")  # chosen again (the first try failed): one count, on b
    assert (board.candidate("a").routed_since, board.candidate("b").routed_since) == (0, 1)
    board.routed("a", "r")  # Serve sent it to a after all (b's queue was full)
    assert (board.candidate("a").routed_since, board.candidate("b").routed_since) == (1, 0)


def test_unconfirmed_choices_expire_and_dead_replicas_are_forgotten(monkeypatch):
    board = ReplicaBoard()
    board.chose("a", "cancelled")
    board.chose("b", "r")
    monkeypatch.setattr(board_module, "UNCONFIRMED_ROUTE_S", -1.0)
    board.update(report("a", 0, time.time()))
    assert board.candidate("a").routed_since == 0
    board.keep_only({"a"})
    assert board.candidate("b").routed_since == 0
    board.chose("a", "r")  # the request dropped with b can be chosen again
    assert board.candidate("a").routed_since == 1
