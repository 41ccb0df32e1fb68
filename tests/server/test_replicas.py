"""Engine replicas on Ray Serve behind one ingress: a real local Ray instance with two replicas of
the tiny model, real HTTP on loopback, the official openai client. Slow (Ray starts once per
module, ~20 s); everything is torn down at the end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from support.server import free_port

pytest.importorskip("ray.serve")

from dynaspec.engine.engine import EngineConfig
from dynaspec.replicas.launch import ReplicaOptions, build_client, shutdown
from dynaspec.server.app import REPLICA_HEADER, build_app

pytestmark = pytest.mark.slow

# K depends on the decode batch: 4 for one or two requests, 0 from three on
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 256, 0]],
}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def poll(check, timeout: float = 60.0, interval: float = 0.1):
    """check() until it returns something truthy; fails after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def metrics(base: str) -> dict[str, dict[str, float]]:
    """{sample name: {replica (or ''): value}}"""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[s.labels.get("replica", "")] = s.value
    return out


@pytest.fixture(scope="module")
def ingress(target_dir):
    config = EngineConfig(
        model=str(target_dir),
        dtype="float32",
        kv_cache_memory_gb=0.02,
        max_num_seqs=16,
        speculative_config=SPEC,
        progress=False,
    )
    options = ReplicaOptions(num_replicas=2, cpus_per_replica=1, max_waiting=256, stats_interval=0)
    client = build_client(config, options)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(client, "tiny"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: _healthy(base), timeout=30)
        poll(lambda: len(client.board.reports) == 2, timeout=30)  # both replicas have reported
        yield base, client
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        shutdown()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_openai_client_streams_and_not(ingress):
    base, _ = ingress
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1
    pieces, reasons = [], []
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == full.choices[0].text  # greedy: the same text, streamed or not
    assert reasons[-1] == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:  # validation runs at the ingress as for one engine
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100_000)
    assert "max_tokens" in str(e.value)


def test_hundred_concurrent_requests_spread_over_both_replicas(ingress):
    base, _ = ingress
    before = metrics(base)

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=110)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(100)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 100
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)

    def served() -> dict[str, float] | None:
        now = metrics(base)["dynaspec:replica_requests_served_total"]
        delta = {
            r: v - before.get("dynaspec:replica_requests_served_total", {}).get(r, 0) for r, v in now.items()
        }
        return delta if sum(delta.values()) >= 100 else None

    delta = poll(served, timeout=20)
    # the router counts each request from its choice: a burst splits about evenly
    assert len(delta) == 2 and min(delta.values()) >= 30, delta
    choices = metrics(base)["dynaspec:router_choices_total"]
    assert len(choices) >= 2 and all(v > 0 for v in choices.values())
    assert metrics(base)["dynaspec:num_replicas"][""] == 2


def test_each_replica_chooses_its_own_k(ingress):
    """One replica serves a long tail (one request: K=4), the other a burst (12 at once: K=0)."""
    base, _ = ingress
    tail, burst = sorted(metrics(base)["dynaspec:replica_num_requests_running"])

    async def run() -> tuple[list[httpx.Response], dict]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:

            def post(replica: str, max_tokens: int):
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
                return http.post("/v1/completions", json=body, headers={REPLICA_HEADER: replica})

            requests = [asyncio.ensure_future(post(tail, 450))]
            requests += [asyncio.ensure_future(post(burst, 400)) for _ in range(12)]
            seen = await asyncio.to_thread(poll, lambda: _both_k(base, tail, burst), 60, 0.05)
            return await asyncio.gather(*requests), seen

    responses, seen = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    assert seen[tail] == 4 and seen[burst] == 0


def _both_k(base: str, tail: str, burst: str) -> dict | None:
    m = metrics(base)
    k, running = m["dynaspec:replica_spec_decode_k"], m["dynaspec:replica_num_requests_running"]
    if running.get(burst, 0) >= 3 and k.get(tail) == 4 and k.get(burst) == 0:
        return dict(k)
    return None


def test_replicas_run_with_one_malloc_arena(ingress):
    """Ray's workers start threads before they import dynaspec, so `one_arena` cannot apply there:
    each replica's process gets MALLOC_ARENA_MAX=1 in its environment (dynaspec/heap.py)."""
    _, client = ingress
    for report in client.board.reports.values():
        environ = Path(f"/proc/{report.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_ARENA_MAX=1" in environ, report.pid


def test_killed_replica_fails_only_its_requests_and_comes_back(ingress):
    base, client = ingress
    victim, survivor = sorted(client.board.reports)
    pid = client.board.reports[victim].pid

    async def stream(http: httpx.AsyncClient, replica: str) -> tuple[str, str]:
        """(last finish reason or 'error', error message) of one pinned streamed completion."""
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
        reason, message = "", ""
        async with http.stream("POST", "/v1/completions", json=body, headers={REPLICA_HEADER: replica}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    return "error", payload["error"]["message"]
                reason = payload["choices"][0]["finish_reason"] or reason
        return reason, message

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            on_victim = [asyncio.ensure_future(stream(http, victim)) for _ in range(4)]
            on_survivor = [asyncio.ensure_future(stream(http, survivor)) for _ in range(4)]
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
            blocking = asyncio.ensure_future(
                http.post("/v1/completions", json=body, headers={REPLICA_HEADER: victim})
            )
            # kill the victim once it is decoding all five of its requests
            await asyncio.to_thread(
                poll, lambda: metrics(base)["dynaspec:replica_num_requests_running"].get(victim, 0) >= 5, 30
            )
            os.kill(pid, signal.SIGKILL)
            # requests sent after the kill are served by the other replica
            later = [
                asyncio.ensure_future(http.post("/v1/completions", json={**body, "max_tokens": 8}))
                for _ in range(6)
            ]
            return (
                await asyncio.gather(*on_victim),
                await asyncio.gather(*on_survivor),
                await blocking,
                await asyncio.gather(*later),
            )

    victims, survivors, blocked, later = asyncio.run(asyncio.wait_for(run(), 120))
    assert all(reason == "error" and "replica" in message for reason, message in victims), victims
    assert survivors == [("length", "")] * 4
    assert blocked.status_code == 503
    assert (
        blocked.json()["error"]["type"] == "server_error" and "replica" in blocked.json()["error"]["message"]
    )
    assert [r.status_code for r in later] == [200] * 6

    # Serve replaces the dead replica; the new one takes traffic
    fresh = poll(
        lambda: next((r for r in client.board.reports if r not in (victim, survivor)), None), timeout=120
    )
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4},
        headers={REPLICA_HEADER: fresh},
        timeout=60,
    )
    assert r.status_code == 200
    served = poll(lambda: metrics(base)["dynaspec:replica_requests_served_total"].get(fresh), timeout=20)
    assert served >= 1
    assert victim not in metrics(base)["dynaspec:replica_num_requests_running"]
