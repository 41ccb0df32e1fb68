"""Load: 200 concurrent streaming requests, a fifth disconnecting mid-stream (loopback, bounded)."""

import asyncio
import json
import time

import httpx
from support.server import running_server

N, MAX_TOKENS = 200, 16


async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int | None]:
    """Returns (index, completion tokens) or (index, None) for a request that hung up."""
    payload = {
        "model": "tiny",
        "prompt": f"request {i}: def f(x):",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.7,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    disconnect = i % 5 == 0
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                return i, chunk["usage"]["completion_tokens"]
            chunks += 1
            if disconnect and chunks == 2:
                return i, None  # leaving the context closes the connection mid-stream
    raise AssertionError(f"request {i} ended without usage")


async def load(base: str) -> list[tuple[int, int | None]]:
    limits = httpx.Limits(max_connections=N + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(N))), timeout=240)


def test_200_streams_with_disconnects(target_dir):
    with running_server(target_dir, max_num_seqs=32) as (base, loop):
        results = asyncio.run(load(base))
        done = [n for i, n in results if i % 5]
        assert len(done) == N - N // 5 and all(n == MAX_TOKENS for n in done)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snap = loop.snapshot
            if snap.running == 0 and snap.waiting == 0:
                break
            time.sleep(0.1)
        assert loop.snapshot.running == 0 and loop.snapshot.waiting == 0
        assert loop.snapshot.kv_cache_usage == 0.0
        text = httpx.get(f"{base}/metrics").text
        assert 'dynaspec:request_success_total{finished_reason="abort"}' in text
        # the server still serves after the storm
        r = httpx.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout=30
        )
        assert r.status_code == 200
