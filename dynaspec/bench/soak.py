"""`dynaspec bench soak`: a bounded load against a server on loopback for a set time, to show that it
keeps working: memory that does not grow, KV blocks that all come back, latency that does not drift.

A closed loop of ``--concurrency`` clients sends a fixed-seed mix of the traffic real clients send
(soak_traffic.py): greedy and sampled completions and chats, streaming or not, ``n`` > 1, prompt
lists, logprobs and echo scoring, penalties, stop strings, streams dropped mid-way, and bad requests
from the schema fuzzer's families. Every greedy answer is compared with the same request's answer
recorded alone on the idle server before the load. Every few seconds the server's RSS, KV usage,
running and waiting requests and K (from /metrics) and the latency percentiles are sampled; at the
end the checks (zero 5xx, greedy answers identical, KV and queues back to 0, RSS growth, latency
drift, no traceback in the server's log) print as a table, and the command exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dynaspec.bench.common import command_args, format_table, free_port, save_plot, write_result
from dynaspec.bench.soak_traffic import (
    CHAT_VARIANTS,
    FALLBACK_CONTEXT,
    LATENCY_KINDS,
    SERVE_MAX_BODY_BYTES,
    VARIANTS,
    Greedy,
    Outcome,
    StreamError,
    Traffic,
    one_request,
    outcome,
    record_references,
)

DEFAULT_RESULT = "bench-results/soak.json"
RSS_GROWTH_BOUND = 0.03  # RSS after the load within 3% of RSS after warm-up
# the KV budget's pages become resident as blocks are first written (a prefix cache keeps blocks, so
# it fills the budget over time): that growth is the budget's, not a leak, and is not counted
RSS_CHECK = f"RSS growth after warm-up, less KV blocks written for the first time, < {RSS_GROWTH_BOUND:.0%}"
P99_DRIFT_BOUND = 0.10  # p99 latency of the last tenth at most 10% above the first tenth's
LOG_PROBLEMS = ("Traceback", "never retrieved", " ERROR ")  # server log lines that fail the run


def add_parser(sub) -> None:
    p = sub.add_parser(
        "soak",
        help="a bounded mixed load for a set time against a server: RSS, KV, latency drift, errors",
        description=__doc__.splitlines()[0],
    )
    where = p.add_argument_group("the server (one of --url, --model)")
    where.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--model", default=None, help="start `dynaspec serve --model MODEL` on a free loopback port"
    )
    where.add_argument("--speculative-config", default=None, help="passed to the started server")
    where.add_argument(
        "--server-args",
        default="",
        help='more flags for the started server, one string (e.g. "--dtype float32 --max-model-len 512")',
    )
    where.add_argument(
        "--server-log",
        default=None,
        help="the server's log to check for tracebacks (default: the started server's, "
        "<result stem>_server.log; none with --url)",
    )
    where.add_argument("--start-timeout-s", type=float, default=900.0, help="seconds for the server to start")
    where.add_argument(
        "--max-body-bytes",
        type=int,
        default=SERVE_MAX_BODY_BYTES,
        help="the server's --max-body-bytes: oversized bodies are 1 KiB above it",
    )
    load = p.add_argument_group("the load")
    load.add_argument("--duration-s", type=float, default=60.0, help="seconds of load")
    load.add_argument("--concurrency", type=int, default=8, help="clients in the closed loop")
    load.add_argument(
        "--warmup-s", type=float, default=None, help="excluded from RSS and latency drift (default: a tenth)"
    )
    load.add_argument("--sample-every-s", type=float, default=5.0, help="seconds between samples of /metrics")
    load.add_argument("--max-tokens", type=int, default=32, help="output tokens of each generating request")
    load.add_argument("--prompt-chars", type=int, default=400, help="prompts are cut to this many characters")
    load.add_argument(
        "--greedy-prompts", type=int, default=3, help="prompts recorded alone for the greedy check"
    )
    load.add_argument("--dataset", default="mixed", help="where the prompts come from")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout-s", type=float, default=600.0)
    load.add_argument(
        "--settle-s", type=float, default=60.0, help="seconds for the server to drain after the load"
    )
    out = p.add_argument_group("output")
    out.add_argument("--result-file", default=DEFAULT_RESULT)
    out.add_argument("--plot", default=None, help="the plot's path (default: the result file's, .png)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


@dataclass(slots=True)
class Sample:
    t_s: float  # seconds from the load's start
    rss_bytes: float | None
    kv_cache_usage: float
    running: int
    waiting: int
    k_by_batch_size: dict[str, float]
    requests: int  # answered since the load started
    p50_ms: float | None  # of the requests answered since the previous sample
    p99_ms: float | None
    kv_touched_bytes: float = 0.0  # of the KV budget, written at least once (resident from then on)


@dataclass(slots=True)
class Check:
    name: str
    passed: bool | None  # None: not measurable here (e.g. no server log with --url)
    figure: str


# ---- the server ------------------------------------------------------------------------------


def start_server(
    model: str, speculative_config: str | None, server_args: str, log_path: Path, timeout_s: float
) -> tuple[subprocess.Popen, str]:
    """`dynaspec serve` on a free loopback port, its output in log_path; returns (process, base URL)
    once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "dynaspec", "serve", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--stats-interval", "10"]
    if speculative_config:
        cmd += ["--speculative-config", speculative_config]
    cmd += shlex.split(server_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {_tail(log_path)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s: {_tail(log_path)}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (the graceful shutdown), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def parse_metrics(text: str) -> dict[str, Any]:
    """What a sample reads from /metrics: RSS, KV usage, running, waiting, K per batch size."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"rss_bytes": None, "k_by_batch_size": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "process_resident_memory_bytes":
                out["rss_bytes"] = s.value
            elif s.name == "dynaspec:kv_cache_usage_perc":
                out["kv_cache_usage"] = s.value
            elif s.name == "dynaspec:kv_cache_touched_bytes":
                out["kv_touched_bytes"] = s.value
            elif s.name == "dynaspec:num_requests_running":
                out["running"] = int(s.value)
            elif s.name == "dynaspec:num_requests_waiting":
                out["waiting"] = int(s.value)
            elif s.name == "dynaspec:spec_decode_k":
                out["k_by_batch_size"][s.labels["batch_size"]] = s.value
    return out


# ---- the run ---------------------------------------------------------------------------------


async def soak(base: str, args: argparse.Namespace) -> dict:
    import httpx
    from tqdm import tqdm

    from dynaspec.datasets import load_prompts

    limits = httpx.Limits(
        max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4
    )
    timeout = httpx.Timeout(args.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        served = (await client.get("/v1/models")).json()["data"][0]
        model = served["id"]
        prompts = [p[: args.prompt_chars] for p in load_prompts(args.dataset, chat=False)]
        greedy = [
            Greedy(chat, prompts[i], variant)
            for i in range(args.greedy_prompts)
            for chat in (False, True)
            for variant in (CHAT_VARIANTS if chat else VARIANTS)
        ]
        traffic = Traffic(
            model,
            prompts,
            greedy,
            max_tokens=args.max_tokens,
            max_body_bytes=args.max_body_bytes,
            max_model_len=served.get("max_model_len", FALLBACK_CONTEXT),
        )
        await record_references(client, traffic)

        outcomes: list[Outcome] = []
        samples: list[Sample] = []
        start = time.monotonic()
        deadline = start + args.duration_s

        async def worker(index: int) -> None:
            rng = random.Random(args.seed * 100_003 + index)
            while time.monotonic() < deadline:
                began = time.monotonic()
                try:
                    out = await one_request(client, traffic, rng)
                except StreamError as e:
                    out = outcome("stream_error", None, False, str(e)[:300])
                except Exception as e:  # no answer: a transport error or a timeout
                    out = outcome("transport", None, False, f"{type(e).__name__}: {e}"[:300])
                out.latency_s = time.monotonic() - began
                out.done_s = time.monotonic() - start
                outcomes.append(out)

        async def sample(seen: int) -> int:
            m = parse_metrics((await client.get("/metrics")).text)
            window = [o.latency_s for o in outcomes[seen:] if o.kind in LATENCY_KINDS and o.ok]
            samples.append(
                Sample(
                    round(time.monotonic() - start, 2),
                    m["rss_bytes"],
                    m["kv_cache_usage"],
                    m["running"],
                    m["waiting"],
                    m["k_by_batch_size"],
                    len(outcomes),
                    _percentile(window, 50),
                    _percentile(window, 99),
                    m.get("kv_touched_bytes", 0.0),
                )
            )
            return len(outcomes)

        workers = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
        bar = tqdm(total=round(args.duration_s), unit="s", disable=args.no_progress, desc="soak")
        seen = await sample(0)
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.sample_every_s, max(0.0, deadline - time.monotonic())))
            seen = await sample(seen)
            bar.n = min(round(time.monotonic() - start), bar.total)
            last = samples[-1]
            bar.set_postfix(req=last.requests, kv=f"{last.kv_cache_usage:.0%}", p99=_ms(last.p99_ms))
        bar.close()
        await asyncio.gather(*workers)
        settle_deadline = time.monotonic() + args.settle_s
        while True:  # the load is over: wait for the server to finish, abort and free everything
            seen = await sample(seen)
            last = samples[-1]
            idle = last.running == 0 and last.waiting == 0 and last.kv_cache_usage == 0
            if idle or time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.5)
    return {"model": model, "outcomes": outcomes, "samples": samples, "references": traffic.references}


def _percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile in ms (nearest rank), None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}ms"


def checks(
    outcomes: list[Outcome], samples: list[Sample], warmup_s: float, end_s: float, server_log: Path | None
) -> list[Check]:
    five = sum(1 for o in outcomes if (o.status is not None and o.status >= 500) or o.kind == "stream_error")
    unanswered = sum(1 for o in outcomes if o.kind == "transport")
    good = [o for o in outcomes if not o.kind.startswith("bad:")]
    wrong = [o for o in good if not o.ok]
    bad = [o for o in outcomes if o.kind.startswith("bad:")]
    compared = sum(o.greedy_compared for o in outcomes)
    mismatched = sum(o.greedy_mismatched for o in outcomes)
    final = samples[-1]
    out = [
        Check(
            "no 5xx or error event, all answered",
            five == 0 and unanswered == 0,
            f"{five} 5xx, {unanswered} unanswered",
        ),
        Check("requests answered correctly", not wrong, f"{len(good) - len(wrong)}/{len(good)}"),
        Check(
            "greedy answers identical to alone",
            compared > 0 and mismatched == 0,
            f"{compared - mismatched}/{compared}",
        ),
        Check("bad requests refused (4xx)", all(o.ok for o in bad), f"{sum(o.ok for o in bad)}/{len(bad)}"),
        Check(
            "KV blocks all free after the load",
            final.kv_cache_usage == 0,
            f"{100 * final.kv_cache_usage:.2f}% in use",
        ),
        Check(
            "nothing running or waiting",
            final.running == 0 and final.waiting == 0,
            f"{final.running} running, {final.waiting} waiting",
        ),
    ]
    after_warmup = [s for s in samples if s.t_s >= warmup_s and s.rss_bytes is not None]
    if len(after_warmup) >= 2:
        first, last = after_warmup[0], after_warmup[-1]
        before, after = first.rss_bytes, last.rss_bytes
        kv = last.kv_touched_bytes - first.kv_touched_bytes  # KV blocks written for the first time
        growth = (after - before - kv) / before
        figure = (
            f"{100 * growth:+.2f}% ({before / 2**20:.0f} -> {after / 2**20:.0f} MiB, "
            f"{kv / 2**20:.1f} MiB of it KV blocks written for the first time)"
        )
        out.append(Check(RSS_CHECK, growth < RSS_GROWTH_BOUND, figure))
    else:
        out.append(Check(RSS_CHECK, None, "no RSS samples"))
    tenth = (end_s - warmup_s) / 10
    latencies = [(o.done_s, o.latency_s) for o in outcomes if o.kind in LATENCY_KINDS and o.ok]
    first = _percentile([lat for t, lat in latencies if warmup_s <= t < warmup_s + tenth], 99)
    last = _percentile([lat for t, lat in latencies if t >= end_s - tenth], 99)
    name = f"p99 last tenth <= first tenth + {P99_DRIFT_BOUND:.0%}"
    if first is None or last is None:
        out.append(Check(name, None, "too few requests in a tenth"))
    else:
        drift = last / first - 1
        out.append(
            Check(name, drift <= P99_DRIFT_BOUND, f"{first:.0f} -> {last:.0f} ms ({100 * drift:+.1f}%)")
        )
    if server_log is None or not server_log.is_file():
        out.append(Check("no traceback or ERROR in the server log", None, "no server log"))
    else:
        problems = [
            line
            for line in server_log.read_text(errors="replace").splitlines()
            if any(p in line for p in LOG_PROBLEMS)
        ]
        out.append(Check("no traceback or ERROR in the server log", not problems, f"{len(problems)} lines"))
    return out


def plot(samples: list[Sample], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(t, [(s.rss_bytes or 0) / 2**20 for s in samples], marker=".")
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [100 * s.kv_cache_usage for s in samples], marker=".", label="KV blocks in use")
    axes[1].plot(t, [s.running for s in samples], marker=".", label="running requests")
    axes[1].set_ylabel("% KV blocks / requests")
    axes[1].legend(loc="upper right")
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
        points = [(s.t_s, getattr(s, key)) for s in samples if getattr(s, key) is not None]
        axes[2].plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
    axes[2].set_ylabel("request latency (ms)")
    axes[2].set_xlabel("seconds from the load's start")
    axes[2].legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_plot(fig, path, dpi=100)
    print(f"plot written to {path}")


def run(args: argparse.Namespace) -> int:
    if (args.url is None) == (args.model is None):
        raise ValueError("--url or --model: give exactly one (a running server, or a model to serve)")
    if args.duration_s <= 0 or args.concurrency < 1 or args.sample_every_s <= 0:
        raise ValueError("--duration-s, --concurrency, --sample-every-s: must be > 0")
    if args.greedy_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--greedy-prompts, --max-tokens: must be >= 1")
    result = Path(args.result_file)
    server_log = Path(args.server_log) if args.server_log else None
    proc = None
    if args.url is None:
        server_log = server_log or result.with_name(result.stem + "_server.log")
        proc, base = start_server(
            args.model, args.speculative_config, args.server_args, server_log, args.start_timeout_s
        )
    else:
        base = args.url.rstrip("/")
    try:
        data = asyncio.run(soak(base, args))
    finally:
        if proc is not None:
            stop_server(proc)
    outcomes, samples = data["outcomes"], data["samples"]
    warmup_s = args.warmup_s if args.warmup_s is not None else args.duration_s / 10
    report = checks(outcomes, samples, warmup_s, args.duration_s, server_log)
    kinds = Counter(o.kind for o in outcomes)
    statuses = Counter(str(o.status) for o in outcomes)
    failures = [f"{o.kind}: {o.status} {o.detail}" for o in outcomes if not o.ok][:10]
    print(
        f"{len(outcomes)} requests in {args.duration_s:.0f} s at concurrency {args.concurrency}, "
        f"by status: {dict(statuses)}"
    )
    for line in failures:
        print(f"  failed: {line}")
    print(
        format_table(["check", "result", "figure"], [(c.name, _verdict(c.passed), c.figure) for c in report])
    )
    write_result(
        str(result),
        {
            "benchmark": "soak",
            "args": command_args(args),
            "model": data["model"],
            "requests": len(outcomes),
            "kinds": dict(kinds),
            "statuses": dict(statuses),
            "failures": failures,
            "references": len(data["references"]),
            "checks": [asdict(c) for c in report],
            "samples": [asdict(s) for s in samples],
            "latency_ms": {
                "p50": _percentile([o.latency_s for o in outcomes if o.kind in LATENCY_KINDS and o.ok], 50),
                "p99": _percentile([o.latency_s for o in outcomes if o.kind in LATENCY_KINDS and o.ok], 99),
            },
        },
    )
    plot(samples, Path(args.plot) if args.plot else result.with_suffix(".png"), f"soak: {data['model']}")
    return 1 if any(c.passed is False for c in report) else 0


def _verdict(passed: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "n/a"}[passed]
