"""A server that defends itself: API key, body limit, waiting bound, graceful shutdown, logs."""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.server import free_port, running_server

from dynaspec.server.middleware import GuardConfig

GOOD = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed(target_dir):
    guard = GuardConfig(api_key=KEY, protect_metrics=True, max_body_bytes=4096)
    with running_server(target_dir, guard=guard) as (base, _):
        yield base


def test_api_key_required_on_v1_only(keyed):
    r = httpx.post(f"{keyed}/v1/completions", json=GOOD)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(f"{keyed}/v1/completions", json=GOOD, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = httpx.post(f"{keyed}/v1/completions", json=GOOD, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{keyed}/v1/models").status_code == 401
    assert httpx.get(f"{keyed}/health").status_code == 200  # open for load balancers
    assert httpx.get(f"{keyed}/metrics").status_code == 401  # protect_metrics
    assert httpx.get(f"{keyed}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_body_limit_is_413(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {**GOOD, "prompt": "x" * 5000}
    r = httpx.post(f"{keyed}/v1/completions", json=big, headers=auth)
    assert r.status_code == 413 and "exceeds 4096 bytes" in r.json()["error"]["message"]

    def chunked():  # no content-length: the body is counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = httpx.post(
        f"{keyed}/v1/completions", content=chunked(), headers={**auth, "content-type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert httpx.post(f"{keyed}/v1/completions", json=GOOD, headers=auth).status_code == 200


def test_access_log_line_per_request(keyed, caplog):
    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "dynaspec.access"]

    with caplog.at_level(logging.INFO, logger="dynaspec.access"):
        httpx.post(f"{keyed}/v1/completions", json=GOOD, headers={"Authorization": f"Bearer {KEY}"})
        httpx.post(f"{keyed}/v1/completions", json=GOOD)
        deadline = time.monotonic() + 10  # the line is written just after the response is sent
        while len(lines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    ok = [x for x in lines() if '"POST /v1/completions" 200 tokens in' in x]
    assert ok and " out 4 " in ok[0] and ok[0].endswith(" ms"), lines()
    assert any('"POST /v1/completions" 401 tokens in - out -' in x for x in lines()), lines()


def test_waiting_bound_gives_503_with_retry_after(target_dir):
    with running_server(target_dir, max_num_seqs=1, max_waiting=1) as (base, _):

        async def burst():
            payload = {**GOOD, "max_tokens": 200, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=payload) for _ in range(8)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 503 in codes, codes
        assert set(codes) == {200, 503}
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and "--max-waiting" in refused.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/completions", json=GOOD, timeout=60).status_code == 200  # recovered


def test_unexpected_error_is_a_logged_500(target_dir, caplog, monkeypatch):
    with running_server(target_dir) as (base, loop):

        def boom(prompt):
            raise RuntimeError("tokenizer exploded")

        monkeypatch.setattr(loop.engine, "prompt_token_ids", boom)
        with caplog.at_level(logging.ERROR, logger="dynaspec.server.middleware"):
            r = httpx.post(f"{base}/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        record = next(r for r in caplog.records if r.name == "dynaspec.server.middleware")
        assert record.exc_info and "tokenizer exploded" in str(record.exc_info[1])


def _serve(target_dir, port, *extra):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "dynaspec", "serve", "--model", str(target_dir), "--port", str(port)]
    cmd += ["--dtype", "float32", "--kv-cache-memory-gb", "0.02", "--served-model-name", "tiny", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(proc.communicate()[0])


async def _streams_then_sigterm(base, proc, n, max_tokens):
    """n streams; SIGTERM once each has its first token; returns (finish reasons, status of a new request)."""
    started = asyncio.Event()
    count = 0

    async def one(client, i):
        nonlocal count
        payload = {
            **GOOD,
            "prompt": f"{i}: def f(x):",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        reason, first = None, True
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    reason = choice["finish_reason"] or reason
                    if first:
                        first = False
                        count += 1
                        if count == n:
                            started.set()
        return reason

    limits = httpx.Limits(max_connections=n + 5, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
        await asyncio.wait_for(started.wait(), 60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (await client.get("/health")).status_code == 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the signal is handled between two of the server's bytecodes
        late = await client.post("/v1/completions", json=GOOD)
        return await asyncio.gather(*tasks), late


def test_sigterm_lets_20_streams_finish_and_exits_0(target_dir):
    proc, base = _serve(target_dir, free_port(), "--shutdown-timeout", "60", "--stats-interval", "0.2")
    try:
        reasons, late = asyncio.run(_streams_then_sigterm(base, proc, 20, 150))
        assert reasons == ["length"] * 20
        assert late.status_code == 503 and late.headers["retry-after"]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    log = proc.stdout.read()
    assert "SIGTERM: draining" in log and "aborting" not in log
    assert "generation" in log and "tok/s" in log  # the periodic stats line
    assert '"POST /v1/completions" 200' in log  # access log


def test_shutdown_timeout_aborts_the_rest_and_exits_0(tiny_dir):
    # the tiny model writes 480 tokens in 0.2 s here: a long context makes the streams outlast the timeout
    long_dir = tiny_dir(arch="qwen2", seed=0, num_layers=2, max_position_embeddings=8192)
    proc, base = _serve(long_dir, free_port(), "--shutdown-timeout", "0.3", "--max-num-seqs", "2")
    try:
        reasons, _ = asyncio.run(_streams_then_sigterm(base, proc, 2, 8000))
        assert reasons == ["abort", "abort"]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert "shutdown timeout: aborting" in proc.stdout.read()
