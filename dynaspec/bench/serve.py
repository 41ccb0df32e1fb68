"""`dynaspec bench serve`: a streaming client against a running server, reported like the common
serving benchmark (throughput, TTFT / TPOT / ITL / E2EL) plus a speculative block taken from the
server's /metrics before and after the run."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from dynaspec.bench.common import command_args, write_result


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="streaming load against a dynaspec (or any OpenAI-compatible) server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (inf: all at once)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=run)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client, model: str, messages: list[dict], args) -> RequestResult:
    payload = {
        "model": model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2el = time.perf_counter() - start
        result.ok = True
    except Exception as e:  # a failed request is reported, not fatal to the benchmark
        result.error = f"{type(e).__name__}: {e}"
    return result


def spec_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("dynaspec:spec_decode_num"):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = s.value
    return out


async def _bench(args) -> dict:
    import httpx

    from dynaspec.datasets import load_prompts

    prompts = load_prompts(args.dataset, chat=True)
    rng = random.Random(args.seed)
    chosen = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    limits = httpx.Limits(max_connections=(args.max_concurrency or args.num_prompts) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        before = spec_metrics((await client.get("/metrics")).text)
        gate = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(messages):
            async with gate:
                return await _one(client, model, messages, args)

        tasks = []
        start = time.perf_counter()
        for messages in chosen:
            tasks.append(asyncio.create_task(limited(messages)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.timeout)
        duration = time.perf_counter() - start
        after = spec_metrics((await client.get("/metrics")).text)
    return _report(args, model, results, duration, before, after)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "mean": statistics.fmean(values) * scale,
        "median": statistics.median(values) * scale,
        "p99": p99 * scale,
    }


def _report(
    args, model: str, results: list[RequestResult], duration: float, before: dict, after: dict
) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report = {
        "model": model,
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2el for r in ok]),
    }
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("dynaspec:spec_decode_num_drafts_total", 0.0)
    if drafts > 0:
        draft_tokens = delta.get("dynaspec:spec_decode_num_draft_tokens_total", 0.0)
        accepted = delta.get("dynaspec:spec_decode_num_accepted_tokens_total", 0.0)
        per_pos = [
            delta[k] / drafts
            for k in sorted((k for k in delta if "per_pos" in k), key=lambda k: int(k.split("[")[1][:-1]))
        ]
        report["speculative"] = {
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "acceptance_length": 1 + accepted / drafts,
            "acceptance_rate_per_pos": per_pos,
        }
    return report


def format_report(r: dict) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value, fmt: str = "{:<10}") -> None:
        lines.append(f"{label:<40} {fmt.format(value)}")

    row("Successful requests:", r["successful_requests"])
    row("Failed requests:", r["failed_requests"])
    row("Maximum request concurrency:", r["max_concurrency"] if r["max_concurrency"] else "unlimited")
    row("Benchmark duration (s):", r["duration_s"], "{:<10.2f}")
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", r["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", r["total_token_throughput"], "{:<10.2f}")
    for title, key, name in (
        ("Time to First Token", "ttft_ms", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
        ("Inter-token Latency", "itl_ms", "ITL"),
        ("End-to-end Latency", "e2el_ms", "E2EL"),
    ):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {name} (ms):", r[key]["mean"], "{:<10.2f}")
        row(f"Median {name} (ms):", r[key]["median"], "{:<10.2f}")
        row(f"P99 {name} (ms):", r[key]["p99"], "{:<10.2f}")
    spec = r.get("speculative")
    if spec:
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=w, c="-"))
        row("Acceptance rate (%):", spec["acceptance_rate"] * 100, "{:<10.2f}")
        row("Acceptance length:", spec["acceptance_length"], "{:<10.2f}")
        row("Drafts:", int(spec["drafts"]))
        row("Draft tokens:", int(spec["draft_tokens"]))
        row("Accepted tokens:", int(spec["accepted_tokens"]))
        lines.append("Per-position acceptance rate (%):")
        for i, a in enumerate(spec["acceptance_rate_per_pos"]):
            row(f"  Position {i}:", a * 100, "{:<10.2f}")
    if r["errors"]:
        lines.append("Errors: " + "; ".join(r["errors"]))
    lines.append("=" * w)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts: must be >= 1")
    report = asyncio.run(_bench(args))
    print(format_report(report))
    settings = {k: (str(v) if v == float("inf") else v) for k, v in command_args(args).items()}
    write_result(args.result_file, {"benchmark": "serve", "args": settings, "result": report})
    return 0 if report["successful_requests"] else 1
