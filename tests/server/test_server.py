"""A real server on loopback: both endpoints, streaming and not, the openai client, /metrics."""

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server import running_server


@pytest.fixture(scope="module", params=["plain", "speculative"])
def server(request, target_dir):
    spec = None
    if request.param == "speculative":
        spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
    with running_server(target_dir, speculative_config=spec) as (base, loop):
        yield base, loop, request.param


def metrics(base: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out


def test_completions_non_streaming(server):
    base, _, _ = server
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7 and body["usage"]["prompt_tokens"] > 0
    assert isinstance(body["choices"][0]["text"], str)


def test_chat_streaming_matches_non_streaming(server):
    base, _, _ = server
    payload = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = httpx.post(f"{base}/v1/chat/completions", json=payload, timeout=60).json()
    text, usage, reasons = "", None, []
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        timeout=60,
        json={**payload, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        assert chunk["object"] == "chat.completion.chunk"
        if chunk["choices"]:
            text += chunk["choices"][0]["delta"].get("content", "")
            reasons.append(chunk["choices"][0]["finish_reason"])
        else:
            usage = chunk["usage"]
    assert text == full["choices"][0]["message"]["content"]
    assert reasons[-1] == "length" and usage["completion_tokens"] == 9


def test_openai_client_both_endpoints(server):
    base, _, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    stream = client.completions.create(
        model="tiny",
        prompt="class A:",
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    full = client.completions.create(
        model="tiny", prompt="class A:", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert "".join(pieces) == full.choices[0].text


def test_metrics_move(server):
    base, _, kind = server
    before = metrics(base)
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "import os", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200
    after = metrics(base)
    assert after["dynaspec:generation_tokens_total"] - before.get("dynaspec:generation_tokens_total", 0) == 12
    assert after["dynaspec:time_to_first_token_seconds_count"] > before.get(
        "dynaspec:time_to_first_token_seconds_count", 0
    )
    assert after["dynaspec:num_requests_running"] == 0 and after["dynaspec:kv_cache_usage_perc"] == 0
    if kind == "speculative":
        assert after["dynaspec:spec_decode_num_draft_tokens_total"] > before.get(
            "dynaspec:spec_decode_num_draft_tokens_total", 0
        )
        assert after['dynaspec:spec_decode_num_accepted_tokens_per_pos_total{"position": "0"}'] > 0


def test_health(server):
    base, _, _ = server
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_goodput_policy_state_in_metrics(tmp_path, target_dir):
    """A goodput server whose profile prices drafter catch-up out of reach: /metrics shows the K it
    chose (0: no prompt is worth catching up on), the withheld counter and the acceptance estimates."""
    from dynaspec.kpolicy.profile import Profile, save_profile

    # drafts cost nothing a step (the grid and the cost model agree), catching up costs 1e6 ms a token
    stats = {bs: {0: 100.0, 1: 100.01, 2: 100.02} for bs in (1, 8)}
    save_profile(
        Profile(
            2,
            [0.9, 0.8],
            stats,
            cost_model={"target_ms": [100.0, 0.0, 0.0], "draft_pass_ms": [0.01, 0.0, 1e6]},
        ),
        tmp_path / "p.json",
    )
    spec = {
        "method": "draft_model",
        "model": str(target_dir),
        "num_speculative_tokens": 2,
        "dynamic_config_path": str(tmp_path / "p.json"),
    }
    with running_server(target_dir, speculative_config=spec) as (base, _):
        r = httpx.post(
            f"{base}/v1/completions",
            json={
                "model": "tiny",
                "prompt": "import os",
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200
        m = metrics(base)
    assert m["dynaspec:spec_decode_requests_withheld_total"] == 0
    assert m['dynaspec:spec_decode_k{"batch_size": "1"}'] == 0
    assert m["dynaspec:spec_decode_num_draft_tokens_total"] == 0  # the drafter never ran
    assert m['dynaspec:spec_decode_acceptance_estimate{"position": "0"}'] == pytest.approx(0.9)
    # plain steps of one request taught the grid's (1, 0) cell; no K next to it was close enough to try
    assert m['dynaspec:spec_decode_live_cell_ratio{"batch_size": "1", "k": "0"}'] > 0
    assert m["dynaspec:spec_decode_explored_steps_total"] == 0
    assert m["dynaspec:spec_decode_grid_drift"] > 0
