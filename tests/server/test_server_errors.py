"""Each kind of bad input gets a 4xx with an OpenAI-style error body, and the server keeps serving."""

import gc

import httpx
import pytest
from support.server import running_server

from dynaspec.server.protocol import MAX_IGNORED_NAMES, CompletionRequest, IgnoredFields


@pytest.fixture(scope="module")
def base(target_dir):
    with running_server(target_dir, max_model_len=64) as (url, _):
        yield url


GOOD = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "temperature": [1]}, 400, "temperature"),
        ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "prompt": "word " * 200}, 400, "prompt"),
        ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
        ("/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {**GOOD, "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {**GOOD, "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {**GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
        ("/v1/completions", {**GOOD, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {**GOOD, "prompt": ["a", ""]}, 400, "prompt"),
        # echo decodes a token-id prompt: only once the engine has found its ids in the vocabulary
        (
            "/v1/completions",
            {**GOOD, "prompt": [1000, 6227020799, -5], "echo": True, "logprobs": 1},
            400,
            "prompt",
        ),
        ("/v1/completions", {**GOOD, "top_p": 7}, 400, "top_p"),
        ("/v1/completions", {k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ],
)
def test_bad_input_then_good_request(base, path, body, status, param):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(base + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    good = httpx.post(f"{base}/v1/completions", json=GOOD, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_harmless_fields_are_accepted_and_ignored(base, caplog):
    extra = {
        "user": "u1",
        "metadata": {"a": "b"},
        "store": False,
        "parallel_tool_calls": True,
        "service_tier": "auto",
        "stream_options": {"include_usage": True},
        "frobnicate": True,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "temperature": None,  # null means the default
        "n": None,
        "logit_bias": None,
    }
    with caplog.at_level("INFO", logger="dynaspec.server.protocol"):
        for _ in range(2):
            r = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
            assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records if "ignoring request field" in rec.getMessage()]
    assert sorted(logged) == sorted(  # once per field name, however many requests send it
        f"ignoring request field {name!r} (not used by this server)"
        for name in ("user", "metadata", "store", "parallel_tool_calls", "service_tier", "frobnicate")
    )


def test_unknown_route_is_404_json(base):
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_a_request_too_large_to_ever_wait_is_a_400_naming_n(target_dir):
    """8 prompts x n=4 can never fit a bound of 16 waiting requests: retrying (503) cannot help."""
    with running_server(target_dir, max_waiting=16) as (url, loop):
        r = httpx.post(f"{url}/v1/completions", json={**GOOD, "prompt": ["x"] * 8, "n": 4}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "n" and "16" in error["message"] and "32" in error["message"]
        fits = httpx.post(f"{url}/v1/completions", json={**GOOD, "prompt": ["x"] * 4, "n": 4}, timeout=60)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 16
        assert not loop.busy and loop.engine.allocator.usage == 0.0


def test_bad_token_ids_in_every_sub_request_log_no_traceback_and_leave_nothing(target_dir, caplog):
    """Each of 2 prompts x n=3 sub-requests fails validation: one 400, no 'Future exception was
    never retrieved' ERROR, no sub-request admitted and left behind."""
    with running_server(target_dir) as (url, loop), caplog.at_level("WARNING"):
        body = {**GOOD, "prompt": [[10**6, 5], [7, 10**6]], "n": 3}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        mixed = {**GOOD, "prompt": [[7, 8, 9], [7, 10**6]], "n": 2}  # the first prompt is valid
        assert httpx.post(f"{url}/v1/completions", json=mixed, timeout=30).status_code == 400
        good = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=60)
        assert good.status_code == 200
        assert not loop.busy and loop.engine.allocator.usage == 0.0
        assert not loop.engine.has_unfinished()
    gc.collect()  # a future whose exception nobody retrieved logs when it is collected
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert not errors, [rec.getMessage() for rec in errors]


def test_ignored_field_names_are_remembered_and_logged_up_to_a_bound(caplog):
    """A fuzzer sends a new field name in every request: the set of names (and the log) stay bounded."""
    ignored = IgnoredFields()
    with caplog.at_level("INFO", logger="dynaspec.server.protocol"):
        for i in range(3):
            names = {f"field_{i}_{j}": 1 for j in range(MAX_IGNORED_NAMES)}
            ignored.note(CompletionRequest(**GOOD, **names))
    logged = [rec.getMessage() for rec in caplog.records]
    assert len(logged) == MAX_IGNORED_NAMES + 1 and f"the first {MAX_IGNORED_NAMES} were" in logged[-1]
    assert len(ignored._seen) == MAX_IGNORED_NAMES
