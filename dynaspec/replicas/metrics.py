"""/metrics on the ingress: every replica's series under a ``replica`` label, the router's choices,
and the single-engine server's series summed over replicas (so `dynaspec bench serve` reads the
same names). Read from the board at scrape time, so as fresh as the replicas' last reports.

Summed counters include the last report of replicas that went away, so they never go back.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dynaspec.replicas.board import ReplicaBoard


class ReplicaCollector:
    def __init__(self, board: ReplicaBoard) -> None:
        self.board = board

    def collect(self):
        live, retired, choices = self.board.snapshot()
        everyone = list(live.values()) + list(retired.values())

        def per_replica(kind, name: str, doc: str, value) -> object:
            family = kind(f"dynaspec:replica_{name}", doc, labels=["replica"])
            for replica, report in sorted(live.items()):
                v = value(report)
                if v is not None:
                    family.add_metric([replica], v)
            return family

        yield GaugeMetricFamily("dynaspec:num_replicas", "Engine replicas running", value=len(live))
        yield per_replica(GaugeMetricFamily, "num_requests_running", "Requests running", lambda r: r.running)
        yield per_replica(GaugeMetricFamily, "num_requests_waiting", "Requests waiting", lambda r: r.waiting)
        yield per_replica(
            GaugeMetricFamily,
            "kv_cache_usage_perc",
            "Fraction of KV blocks in use",
            lambda r: r.kv_cache_usage,
        )
        yield per_replica(GaugeMetricFamily, "kv_free_blocks", "Free KV blocks", lambda r: r.free_kv_blocks)
        yield per_replica(
            GaugeMetricFamily, "spec_decode_k", "K chosen for the load at the last decode step", lambda r: r.k
        )
        yield per_replica(
            GaugeMetricFamily,
            "spec_decode_acceptance_rate",
            "Accepted / drafted tokens since the replica started",
            lambda r: r.acceptance,
        )
        yield per_replica(
            GaugeMetricFamily,
            "predicted_ms_per_token",
            "Predicted ms per token for one more request (a unitless proxy without a goodput profile)",
            lambda r: r.ms_per_token[0] if r.ms_per_token else None,
        )
        yield per_replica(
            CounterMetricFamily, "requests_served", "Requests finished", lambda r: r.requests_served
        )
        yield per_replica(
            CounterMetricFamily, "generation_tokens", "Tokens generated", lambda r: r.generation_tokens
        )
        routed = CounterMetricFamily(
            "dynaspec:router_choices", "Requests the router sent to each replica", labels=["replica"]
        )
        for replica, n in sorted(choices.items()):
            routed.add_metric([replica], n)
        yield routed

        # the single-engine names, summed over replicas
        yield GaugeMetricFamily(
            "dynaspec:num_requests_running", "Requests running", value=sum(r.running for r in live.values())
        )
        yield GaugeMetricFamily(
            "dynaspec:num_requests_waiting", "Requests waiting", value=sum(r.waiting for r in live.values())
        )
        usage = [r.kv_cache_usage for r in live.values()]
        yield GaugeMetricFamily(
            "dynaspec:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use, mean over replicas",
            value=sum(usage) / len(usage) if usage else 0.0,
        )
        if not any(r.acceptance is not None or r.num_drafts for r in everyone):
            return
        for name, doc in (
            ("num_drafts", "Decode request-steps that verified drafts"),
            ("num_draft_tokens", "Draft tokens verified"),
            ("num_accepted_tokens", "Draft tokens accepted"),
        ):
            yield CounterMetricFamily(
                f"dynaspec:spec_decode_{name}", doc, value=sum(getattr(r, name) for r in everyone)
            )
        per_pos = CounterMetricFamily(
            "dynaspec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by position",
            labels=["position"],
        )
        for i, n in enumerate(_sum_lists(r.accepted_per_pos for r in everyone)):
            per_pos.add_metric([str(i)], n)
        yield per_pos


def _sum_lists(lists) -> list[int]:
    out: list[int] = []
    for values in lists:
        for i, v in enumerate(values):
            if i == len(out):
                out.append(0)
            out[i] += v
    return out
