"""`dynaspec bench replicas-sim`: many engine replicas behind the router, simulated over a profile.

A discrete-event simulation (no model runs): each replica steps its running requests, a step at
batch bs and K costing the profile's smoothed ITL(bs, K) and giving each request 1 + (drafts
accepted) tokens, drafts accepted at position i with the profile's unconditional α_i. Requests
wait in a replica's queue beyond ``max_num_seqs``; prefill is not modelled. The router is the
real one (``kpolicy.routing``: two sampled replicas, lower predicted ms per token, corrected by
requests routed since the report), fed reports refreshed every ``--report-period-ms`` and at each
finished request, as on Ray Serve. K configurations:

- ``dynamic``: each replica its own K* for its own load (``GoodputK`` over the profile, with its
  hysteresis), what independent replicas can do;
- ``shared``: one K for every replica, chosen by goodput for one load of the whole deployment
  (ranks that must agree on K, the reference engine's data-parallel constraint, made dynamic):
  ``shared-mean`` at the mean load over replicas, ``shared-max`` at the busiest replica's load
  (ranks stepping in lockstep are paced by the busiest one);
- ``fixed``: one fixed K for all, the best of K = 1..max per scenario (reported with its K);
- ``none``: no speculation.

Traffic: ``bursty`` (Poisson arrivals at a base rate with periodic bursts above capacity,
log-normal output lengths) and ``rollout`` (16 requests per replica at t=0, long-tailed lengths:
the makespan is set by the tail). Each figure is the mean over ``--seeds`` traffic draws.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from dynaspec.bench.common import format_table, save_plot, write_result
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.hysteresis import Hysteresis
from dynaspec.kpolicy.profile import interpolate_itl, load_profile, smooth_itl
from dynaspec.kpolicy.routing import Candidate, choose, prediction_curve


def add_parser(sub) -> None:
    p = sub.add_parser(
        "replicas-sim", help="simulated replicas behind the router: per-replica K vs one K vs none"
    )
    p.add_argument("--profile", default="results/profile_qwen_pair_humaneval.json")
    p.add_argument("--replicas", default="8,16,32,64", help="replica counts")
    p.add_argument("--traffic", default="bursty,rollout")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=300.0, help="bursty: seconds of arrivals")
    p.add_argument("--load", type=float, default=0.5, help="bursty: mean arrival rate / capacity")
    p.add_argument("--report-period-ms", type=float, default=500.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=3, help="traffic draws averaged per figure")
    p.add_argument(
        "--result-file",
        default="bench-results/replicas_sim.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.add_argument(
        "--plot",
        default="bench-results/replicas_sim.png",
        help="PNG of latency against replicas (default %(default)s; the record's is docs/replicas_sim.png)",
    )
    p.set_defaults(func=run)


@dataclass(slots=True)
class SimRequest:
    arrival: float  # s
    length: int  # output tokens
    done: int = 0
    finished: float | None = None


@dataclass
class Replica:
    index: int
    running: list[SimRequest] = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    busy: bool = False  # a step is under way
    hysteresis: Hysteresis = field(default_factory=lambda: Hysteresis(3))
    curve: list[float] | None = None  # the last report's prediction
    report_time: float = -math.inf
    routed_since: int = 0
    k_steps: list[int] = field(default_factory=list)  # K of every step with decodes

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


class Model:
    """The profile as the simulation reads it, with every lookup cached."""

    def __init__(self, profile, max_num_seqs: int) -> None:
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.grid = smooth_itl(profile.batch_stats)
        self.alpha = list(profile.acceptance_rate_per_pos)
        self.max_k = profile.max_num_speculative_tokens
        goodput = GoodputK(profile, self.max_k, hysteresis_steps=1)
        self.wanted_k = [0] + [goodput.k_for_batch(bs) for bs in range(1, 4 * max_num_seqs + 1)]
        self._itl: dict[tuple[int, int], float] = {}
        self._curves: dict[tuple[int, int | None], list[float]] = {}

    def itl_ms(self, bs: int, k: int) -> float:
        key = (bs, k)
        if key not in self._itl:
            self._itl[key] = interpolate_itl(self.grid, bs, k) or 0.0
        return self._itl[key]

    def k_for_load(self, load: int) -> int:
        return self.wanted_k[min(load, len(self.wanted_k) - 1)] if load else 0

    def curve(self, load: int, fixed_k: int | None) -> list[float]:
        """The replica's prediction curve: its goodput model, restricted to one K when K is fixed."""
        key = (load, fixed_k)
        if key not in self._curves:

            def itl(bs: int, k: int) -> float | None:
                return None if fixed_k is not None and k != fixed_k else self.itl_ms(bs, k)

            max_k = self.max_k if fixed_k is None else fixed_k
            self._curves[key] = prediction_curve(itl, self.alpha, max_k, load, self.max_num_seqs)
        return self._curves[key]

    def accepted(self, k: int, rng: random.Random) -> int:
        """Drafts accepted of k: position i is reached with probability α_i (unconditional)."""
        u = rng.random()
        n = 0
        while n < k and self.alpha[n] > u:
            n += 1
        return n


def bursty_traffic(
    num_replicas: int, model: Model, duration_s: float, load: float, rng: random.Random
) -> list[SimRequest]:
    """Poisson arrivals: a base rate, with a 15 s burst at 3x the mean every 60 s; mean rate =
    load x the replicas' capacity at max_num_seqs without speculation."""
    median = 128
    mean_len = median * math.exp(0.5**2 / 2)
    capacity = num_replicas * model.max_num_seqs / (model.itl_ms(model.max_num_seqs, 0) / 1000) / mean_len
    mean_rate = load * capacity
    burst_rate, burst_share = 3 * mean_rate, 15 / 60
    base_rate = max(0.0, (mean_rate - burst_share * burst_rate) / (1 - burst_share))
    out, t = [], 0.0
    while True:
        in_burst = (t % 60.0) < 15.0
        rate = burst_rate if in_burst else base_rate
        t += rng.expovariate(rate) if rate > 0 else 1.0
        if t >= duration_s:
            return out
        length = max(8, min(1024, round(rng.lognormvariate(math.log(median), 0.5))))
        out.append(SimRequest(t, length))


def rollout_traffic(num_replicas: int, rng: random.Random) -> list[SimRequest]:
    """16 requests per replica at t=0, log-normal lengths (median 128, sigma 1): a long tail."""
    return [
        SimRequest(0.0, max(8, min(2048, round(rng.lognormvariate(math.log(128), 1.0)))))
        for _ in range(16 * num_replicas)
    ]


def simulate(
    model: Model,
    num_replicas: int,
    requests: list[SimRequest],
    policy: str,
    fixed_k: int | None,
    report_period_s: float,
    seed: int,
    router: str = "prediction",
) -> dict:
    rng = random.Random(seed)
    route_rng = random.Random(seed + 1)
    replicas = [Replica(i) for i in range(num_replicas)]
    shared = Hysteresis(3)
    events: list[tuple[float, int, int, int]] = []  # (time, order, kind, index): 0 arrival, 1 step done
    order = 0
    for i, r in enumerate(sorted(requests, key=lambda r: r.arrival)):
        heapq.heappush(events, (r.arrival, order, 0, i))
        order += 1
    requests = sorted(requests, key=lambda r: r.arrival)
    pending_k: dict[int, int] = {}
    routing_s = 0.0
    round_robin = 0
    now = 0.0

    def report(rep: Replica) -> None:
        rep.curve = model.curve(rep.load, None if policy == "dynamic" else current_fixed(rep))
        rep.report_time = now
        rep.routed_since = 0

    def current_fixed(rep: Replica) -> int | None:
        if policy == "none":
            return 0
        if policy == "fixed":
            return fixed_k
        return shared.current if shared.current is not None else 0

    def start_step(rep: Replica) -> None:
        nonlocal order
        while rep.waiting and len(rep.running) < model.max_num_seqs:
            rep.running.append(rep.waiting.popleft())
        if not rep.running:
            rep.busy = False
            return
        bs = len(rep.running)
        if policy == "dynamic":
            k = rep.hysteresis.update(model.k_for_load(rep.load))
        elif policy == "shared-mean":
            mean_load = round(sum(r.load for r in replicas) / num_replicas)
            k = shared.update(model.k_for_load(max(1, mean_load)))
        elif policy == "shared-max":
            k = shared.update(model.k_for_load(max(r.load for r in replicas)))
        else:
            k = current_fixed(rep) or 0
        rep.k_steps.append(k)
        pending_k[rep.index] = k
        rep.busy = True
        heapq.heappush(events, (now + model.itl_ms(bs, k) / 1000, order, 1, rep.index))
        order += 1

    finished_count = 0
    while events:
        now, _, kind, index = heapq.heappop(events)
        if kind == 0:
            request = requests[index]
            start = time.perf_counter()
            if router == "prediction":
                candidates = [Candidate(str(r.index), r.curve, r.routed_since, True) for r in replicas]
                chosen = replicas[int(choose(candidates, route_rng)[0])]
            else:
                chosen = replicas[round_robin % num_replicas]
                round_robin += 1
            routing_s += time.perf_counter() - start
            chosen.routed_since += 1
            chosen.waiting.append(request)
            if not chosen.busy:
                start_step(chosen)
            continue
        rep = replicas[index]
        k = pending_k.pop(index)
        finished_any = False
        for request in rep.running:
            request.done = min(request.length, request.done + 1 + model.accepted(k, rng))
            if request.done >= request.length:
                request.finished = now
                finished_any = True
                finished_count += 1
        rep.running = [r for r in rep.running if r.finished is None]
        if finished_any or now - rep.report_time >= report_period_s:
            report(rep)
        start_step(rep)

    e2e = [r.finished - r.arrival for r in requests]
    tokens = sum(r.length for r in requests)
    makespan = max(r.finished for r in requests)
    ks = [k for rep in replicas for k in rep.k_steps]
    per_replica_mean_k = [statistics.fmean(rep.k_steps) for rep in replicas if rep.k_steps]
    return {
        "requests": len(requests),
        "makespan_s": round(makespan, 2),
        "mean_e2e_s": round(statistics.fmean(e2e), 2),
        "p99_e2e_s": round(_quantile(e2e, 0.99), 2),
        "p90_done_s": round(_quantile([r.finished for r in requests], 0.9), 2),
        "tokens_per_s": round(tokens / makespan, 1),
        "mean_k": round(statistics.fmean(ks), 2) if ks else 0.0,
        "k_spread": round(max(per_replica_mean_k) - min(per_replica_mean_k), 2) if per_replica_mean_k else 0,
        "router_us_per_request": round(1e6 * routing_s / max(1, len(requests)), 1),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    model = Model(profile, args.max_num_seqs)
    counts = [int(x) for x in args.replicas.split(",")]
    traffics = args.traffic.split(",")
    for t in traffics:
        if t not in ("bursty", "rollout"):
            raise ValueError(f"--traffic: unknown traffic {t!r} (bursty, rollout)")
    period = args.report_period_ms / 1000
    results = []
    rows = []
    for traffic in traffics:
        for n in counts:
            draws = []
            for seed in range(args.seed, args.seed + args.seeds):
                rng = random.Random(seed * 1000 + n)
                if traffic == "bursty":
                    draws.append((seed, bursty_traffic(n, model, args.duration_s, args.load, rng)))
                else:
                    draws.append((seed, rollout_traffic(n, rng)))

            def run_one(policy: str, k: int | None = None, router: str = "prediction", draws=draws, n=n):
                runs = [
                    simulate(
                        model,
                        n,
                        [SimRequest(r.arrival, r.length) for r in base],
                        policy,
                        k,
                        period,
                        seed,
                        router,
                    )
                    for seed, base in draws
                ]
                return {key: round(statistics.fmean(r[key] for r in runs), 2) for key in runs[0]}

            configs = {
                "none": run_one("none"),
                "dynamic": run_one("dynamic"),
                "shared-mean": run_one("shared-mean"),
                "shared-max": run_one("shared-max"),
                "dynamic, round-robin": run_one("dynamic", router="round-robin"),
            }
            key = "mean_e2e_s" if traffic == "bursty" else "makespan_s"
            fixed = {k: run_one("fixed", k) for k in range(1, model.max_k + 1)}
            best_k = min(fixed, key=lambda k: fixed[k][key])
            configs[f"fixed K={best_k}"] = fixed[best_k]
            for name, r in configs.items():
                results.append({"traffic": traffic, "replicas": n, "config": name, **r})
                rows.append(
                    [
                        traffic,
                        n,
                        name,
                        r["requests"],
                        r["makespan_s"],
                        r["mean_e2e_s"],
                        r["p99_e2e_s"],
                        r["tokens_per_s"],
                        r["mean_k"],
                        r["k_spread"],
                        round(r[key] / configs["none"][key], 3),
                    ]
                )
    headers = [
        "traffic",
        "replicas",
        "config",
        "requests",
        "makespan s",
        "mean E2E s",
        "p99 E2E s",
        "tok/s",
        "mean K",
        "K spread",
        "vs none",
    ]
    print(format_table(headers, rows))
    print("vs none: mean E2E (bursty) or makespan (rollout) relative to no speculation; lower is better")
    data = {"profile": args.profile, "args": vars(args) | {"func": None}, "results": results}
    write_result(args.result_file, data)
    if args.plot:
        _plot(results, counts, traffics, args.plot)
    return 0


def _plot(results: list[dict], counts: list[int], traffics: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traffics), figsize=(6 * len(traffics), 4), squeeze=False)
    for ax, traffic in zip(axes[0], traffics):
        key = "mean_e2e_s" if traffic == "bursty" else "makespan_s"
        names = [r["config"] for r in results if r["traffic"] == traffic and r["replicas"] == counts[0]]
        order = ["none", "dynamic", "shared-mean", "shared-max", "dynamic, round-robin"]
        names = order + [n for n in names if n.startswith("fixed")]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            values = []
            for n in counts:
                rows = [r for r in results if r["traffic"] == traffic and r["replicas"] == n]
                none = next(r for r in rows if r["config"] == "none")[key]
                match = [
                    r
                    for r in rows
                    if r["config"] == name or (name.startswith("fixed") and r["config"].startswith("fixed"))
                ]
                values.append(match[0][key] / none if match else float("nan"))
            label = "best fixed K" if name.startswith("fixed") else name
            ax.bar([i + j * width for i in range(len(counts))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(counts))], [str(n) for n in counts])
        ax.set_xlabel("replicas")
        ax.set_ylabel(("mean E2E latency" if traffic == "bursty" else "makespan") + " / no speculation")
        ax.set_title(traffic)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path)
