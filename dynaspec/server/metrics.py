"""Prometheus metrics, one registry per server.

Latency histograms and token counters are recorded as requests progress; engine state (running,
waiting, KV usage) and the speculative counters (named like the reference engine's) are read from
the engine loop's latest snapshot when /metrics is scraped. The standard ``process_*`` series
(resident memory, CPU seconds, open files) describe the server's own process.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dynaspec.engine.request import FinishReason, Request

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and the like (Linux /proc)
        self.ttft = Histogram(
            "dynaspec:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "dynaspec:time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dynaspec:e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("dynaspec:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("dynaspec:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(
            "dynaspec:request_success", "Requests finished", ["finished_reason"], registry=r
        )

    def attach(self, snapshot: Callable[[], object]) -> None:
        """Read engine state from ``snapshot()`` at scrape time."""
        self.registry.register(_EngineCollector(snapshot))

    def request_started(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens_generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def request_aborted(self) -> None:
        self.success.labels(finished_reason=FinishReason.ABORT.value).inc()

    def request_finished(self, request: Request, now: float) -> None:
        reason = request.finish_reason.value if request.finish_reason else "unknown"
        self.observe_request(
            reason, request.arrival_time, request.first_token_time, now, len(request.output_token_ids)
        )

    def observe_request(
        self, reason: str, arrival: float, first_token: float | None, now: float, num_output_tokens: int
    ) -> None:
        """One finished request: its finish reason and latencies (monotonic seconds)."""
        self.success.labels(finished_reason=reason).inc()
        self.e2e.observe(now - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((now - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], object]) -> None:
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        yield _gauge("dynaspec:num_requests_running", "Requests running", s.running)
        yield _gauge("dynaspec:num_requests_waiting", "Requests waiting", s.waiting)
        yield _gauge("dynaspec:kv_cache_usage_perc", "Fraction of KV cache blocks in use", s.kv_cache_usage)
        yield _gauge(
            "dynaspec:kv_cache_touched_bytes",
            "KV cache bytes written at least once (resident on the CPU; a prefix cache fills the budget)",
            s.stats.get("kv_cache_touched_bytes", 0),  # Engine.stats(): one place computes it
        )
        spec = s.stats.get("spec")
        if spec is None:
            return
        for name, key, doc in (
            ("num_drafts", "num_drafts", "Decode request-steps that verified drafts"),
            ("num_draft_tokens", "num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted"),
        ):
            c = CounterMetricFamily(f"dynaspec:spec_decode_{name}", doc)
            c.add_metric([], spec[key])
            yield c
        per_pos = CounterMetricFamily(
            "dynaspec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by position",
            labels=["position"],
        )
        for i, n in enumerate(spec["accepted_per_pos"]):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        k = GaugeMetricFamily(
            "dynaspec:spec_decode_k",
            "K last chosen at each batch size: the load (running + waiting requests) for the goodput "
            "policy, the decode batch for the table policy",
            labels=["batch_size"],
        )
        for bs, value in spec.get("policy", {}).get("k_by_batch_size", {}).items():
            k.add_metric([str(bs)], value)
        yield k
        policy = spec.get("policy", {})
        if "requests_withheld" in policy:
            withheld = CounterMetricFamily(
                "dynaspec:spec_decode_requests_withheld",
                "Request-steps kept from drafting because drafter catch-up would not pay",
            )
            withheld.add_metric([], policy["requests_withheld"])
            yield withheld
            alpha = GaugeMetricFamily(
                "dynaspec:spec_decode_acceptance_estimate",
                "Live acceptance estimate per position",
                labels=["position"],
            )
            for i, a in enumerate(policy.get("acceptance_rate_per_pos", [])):
                alpha.add_metric([str(i)], a)
            yield alpha
            cells = GaugeMetricFamily(
                "dynaspec:spec_decode_live_cell_ratio",
                "Live / profiled time of each grid cell (batch size, K) that live steps have timed",
                labels=["batch_size", "k"],
            )
            for bs, row in policy.get("live_cells", {}).items():
                for k, (ratio, _) in row.items():
                    cells.add_metric([bs, k], ratio)
            yield cells
            if policy.get("grid_drift") is not None:
                yield _gauge(
                    "dynaspec:spec_decode_grid_drift",
                    "Live / profiled wall time of whole decode steps against the profile's grid",
                    policy["grid_drift"],
                )
            explored = CounterMetricFamily(
                "dynaspec:spec_decode_explored_steps",
                "Steps run at a K next to the chosen one to time its grid cell",
            )
            explored.add_metric([], policy.get("explored", 0))
            yield explored


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
