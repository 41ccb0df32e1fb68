"""The replica router's pure functions: predicted ms per token and the power-of-two choice."""

from __future__ import annotations

import random

import pytest

from dynaspec.kpolicy.profile import acceptance_length
from dynaspec.kpolicy.routing import (
    Candidate,
    choose,
    ms_per_token,
    predicted_at,
    prediction_curve,
    proxy_curve,
    rank,
)

# ITL(bs, K) = 5 + 10 bs (K + 1) ms: speculation pays at small batches only
ALPHA = [0.9, 0.8, 0.7, 0.6]


def itl(bs: int, k: int) -> float:
    return 5.0 + 10.0 * bs * (k + 1)


def test_ms_per_token_is_the_goodput_models_best_step_over_its_acceptance_length():
    # one request alone: every K from 0 to 4 scored, the best is the prediction
    best = min(itl(1, k) / acceptance_length(ALPHA, k) for k in range(5))
    assert best < itl(1, 0)  # speculation pays for one request
    assert ms_per_token(itl, ALPHA, 4, load=0, max_num_seqs=8) == pytest.approx(best)
    # at a large batch speculation does not pay: K=0, one token per step
    assert ms_per_token(itl, ALPHA, 4, load=7, max_num_seqs=8) == pytest.approx(itl(8, 0))


def test_beyond_max_num_seqs_a_request_waits_and_shares_the_throughput():
    at_capacity = ms_per_token(itl, ALPHA, 4, load=7, max_num_seqs=8)
    assert ms_per_token(itl, ALPHA, 4, load=15, max_num_seqs=8) == pytest.approx(2 * at_capacity)


def test_curve_grows_with_load_and_unknown_times_stop_it():
    curve = prediction_curve(itl, ALPHA, 4, load=0, max_num_seqs=32)
    assert len(curve) == 8 and curve == sorted(curve)
    assert prediction_curve(lambda bs, k: None, ALPHA, 4, 0, 8) == []
    assert ms_per_token(lambda bs, k: 0.0, ALPHA, 4, 0, 8) is None  # zero times never divide


def test_proxy_curve_counts_the_requests_sharing_the_replica():
    assert proxy_curve(load=1, horizon=3) == [2.0, 3.0, 4.0]
    assert proxy_curve(load=0, horizon=1) == [1.0]
    # an idle replica always ranks before a busy one (whatever K either ran last)
    idle = Candidate("idle", proxy_curve(0), routed_since=0)
    busy = Candidate("busy", proxy_curve(5), routed_since=0)
    assert rank([busy, idle]) == ["idle", "busy"]


def test_predicted_at_extrapolates_past_the_reported_curve():
    assert predicted_at([10.0, 12.0, 15.0], 1) == 12.0
    assert predicted_at([10.0, 12.0, 15.0], 4) == 15.0 + 3.0 * 2
    assert predicted_at([10.0], 3) == 40.0
    assert predicted_at([], 0) == float("inf")


def test_rank_prefers_lower_prediction_corrected_by_requests_routed_since_the_report():
    fast = Candidate("a", [10.0, 20.0, 30.0], routed_since=0)
    slow = Candidate("b", [15.0, 16.0, 17.0], routed_since=0)
    assert rank([fast, slow]) == ["a", "b"]
    # two requests went to "a" since its report: its prediction for the next one is 30 ms
    assert rank([Candidate("a", [10.0, 20.0, 30.0], routed_since=2), slow]) == ["b", "a"]


def test_rank_puts_replicas_without_kv_room_last_and_unreported_ones_first():
    full = Candidate("full", [1.0], 0, has_kv_room=False)
    busy = Candidate("busy", [50.0], 0)
    new = Candidate("new", None, routed_since=3)
    newer = Candidate("newer", None, routed_since=0)
    assert rank([full, busy, new, newer]) == ["newer", "new", "busy", "full"]


def test_choose_samples_two_and_ranks_them():
    rng = random.Random(0)
    candidates = [Candidate(str(i), [float(i)], 0) for i in range(8)]
    seen = set()
    for _ in range(200):
        picked = choose(candidates, rng)
        assert len(picked) == 2 and float(picked[0]) < float(picked[1])
        seen.add(picked[0])
    assert "7" not in seen  # the worst replica never wins a pair
    assert len(seen) == 7  # every other replica wins sometimes: power of two, not the global best
    assert choose(candidates[:1], rng) == ["0"]


def test_replicas_simulation_runs_on_the_profile(tmp_path, capsys):
    import json
    from pathlib import Path

    from dynaspec.cli import main

    profile = Path(__file__).parents[2] / "results" / "profile_qwen_pair_humaneval.json"
    out = tmp_path / "sim.json"
    argv = ["bench", "replicas-sim", "--profile", str(profile), "--replicas", "2", "--duration-s", "30"]
    argv += ["--seeds", "1", "--result-file", str(out), "--plot", str(tmp_path / "sim.png")]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    configs = {(r["traffic"], r["config"]) for r in results}
    assert ("rollout", "dynamic") in configs and ("bursty", "none") in configs
    rollout = {r["config"]: r for r in results if r["traffic"] == "rollout"}
    assert rollout["none"]["mean_k"] == 0 and rollout["dynamic"]["mean_k"] > 0
    assert all(r["requests"] == 32 for r in rollout.values())  # 16 per replica, all finished
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert "vs none" in capsys.readouterr().out
