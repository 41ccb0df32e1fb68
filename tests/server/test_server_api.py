"""What everyday clients send, over a real server with the official openai client: logprobs (the
same with and without speculation), echo scoring, n, prompt lists, penalties."""

import math

import httpx
import openai
import pytest
from support.server import running_server
from support.tiny import dynaspec_logits, load_hf_dir

SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": "target",  # the target as its own drafter: drafts are accepted
}


@pytest.fixture(scope="module")
def servers(target_dir):
    """One client per kind of server, all up at once."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        out = {}
        for name, spec in SPECS.items():
            if spec == "target":
                spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
            base, _ = stack.enter_context(running_server(target_dir, speculative_config=spec))
            out[name] = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        yield out


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _completion_logprobs(client, **kw):
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, logprobs=3, **GREEDY, **kw)
    return r.choices[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_completion_logprobs_equal_with_and_without_speculation(servers, method):
    plain = _completion_logprobs(servers["plain"])
    spec = _completion_logprobs(servers[method])
    assert spec.text == plain.text and spec.logprobs.tokens == plain.logprobs.tokens
    assert spec.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    for a, b in zip(plain.logprobs.top_logprobs, spec.logprobs.top_logprobs):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    # greedy: each token is its position's most likely one
    for lp, top in zip(plain.logprobs.token_logprobs, plain.logprobs.top_logprobs):
        assert lp == pytest.approx(max(top.values()))
        assert 1 <= len(top) <= 4  # tokens that decode to the same text share a key


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chat_logprobs_equal_with_and_without_speculation(servers, method):
    def ask(client):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=10,
            logprobs=True,
            top_logprobs=2,
            **GREEDY,
        )
        return r.choices[0].logprobs.content

    plain, spec = ask(servers["plain"]), ask(servers[method])
    assert [t.token for t in plain] == [t.token for t in spec] and len(plain) == 10
    for a, b in zip(plain, spec):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and len(a.top_logprobs) == 2
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert bytes(a.bytes).decode() == a.token


def test_streamed_logprobs_equal_non_streamed(servers):
    client = servers["draft_model"]
    full = _completion_logprobs(client)
    stream = client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=12, logprobs=3, stream=True, **GREEDY
    )
    tokens, lps = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            lps += chunk.choices[0].logprobs.token_logprobs
    assert tokens == full.logprobs.tokens and lps == pytest.approx(full.logprobs.token_logprobs, abs=1e-6)


@pytest.mark.parametrize("name", ["plain", "draft_model"])
def test_echo_scores_the_prompt_like_the_model_forward(servers, target_dir, name):
    client = servers[name]
    config, weights, tokenizer = load_hf_dir(target_dir)
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(prompt)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    logp = dynaspec_logits(config, weights, ids).log_softmax(-1)
    want = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    # with one generated token (what lm-evaluation-harness sends): the prompt's part is unchanged
    r1 = client.completions.create(
        model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0
    ).choices[0]
    assert r1.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    assert len(r1.logprobs.tokens) == len(ids) + 1


def test_n_samples_are_seeded_and_reproducible(servers):
    client = servers["ngram"]

    def sample(seed):
        return client.completions.create(
            model="tiny",
            prompt="import os",
            max_tokens=8,
            n=3,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )

    a, b = sample(11), sample(11)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # independent samples
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == len(
        client_tokens(servers, "import os")
    )
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2, temperature=0.8, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]


def client_tokens(servers, text):
    r = servers["plain"].completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=0)
    return r.choices[0].logprobs.tokens


def test_prompt_lists_of_strings_and_token_ids(servers, target_dir):
    client = servers["draft_model"]
    _, _, tokenizer = load_hf_dir(target_dir)
    prompts = ["def f(x):", "The quick brown", "class A:"]
    kw = dict(model="tiny", max_tokens=6, stop=["\n\n"], **GREEDY)
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    singles = [client.completions.create(prompt=p, **kw).choices[0] for p in prompts]
    for i, single in enumerate(singles):
        for j in range(2):  # greedy: both samples equal the prompt's own completion
            choice = batch.choices[2 * i + j]
            assert choice.text == single.text and choice.finish_reason == single.finish_reason
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [s.text for s in singles]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    assert batch.usage.prompt_tokens == sum(map(len, ids))  # each prompt counted once, not once per sample
    assert batch.usage.completion_tokens == 2 * sum(
        client.completions.create(prompt=p, **kw).usage.completion_tokens for p in prompts
    )


def test_streamed_prompt_list_ends_every_choice(servers):
    base = str(servers["plain"].base_url).rstrip("/")
    payload = {
        "model": "tiny",
        "prompt": ["a", "b"],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0.5,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: dict[int, str] = {}
    reasons = {}
    usage = None
    with httpx.stream("POST", f"{base}/completions", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            for c in chunk["choices"]:
                text[c["index"]] = text.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    reasons[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
    assert reasons == dict.fromkeys(range(4), "length") and usage["completion_tokens"] == 20
    full = httpx.post(f"{base}/completions", json={**payload, "stream": False}, timeout=60).json()
    assert [c["text"] for c in full["choices"]] == [text[i] for i in range(4)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_penalties_lossless_over_the_api(servers, method):
    kw = dict(
        model="tiny",
        prompt="def f(x):",
        max_tokens=16,
        presence_penalty=0.5,
        frequency_penalty=0.8,
        logit_bias={"7": 4.0},
        logprobs=1,
        temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )
    plain = servers["plain"].completions.create(**kw).choices[0]
    spec = servers[method].completions.create(**kw).choices[0]
    assert spec.text == plain.text
    unpenalized = servers["plain"].completions.create(
        model="tiny", prompt="def f(x):", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert unpenalized.choices[0].text != plain.text
    assert all(math.isfinite(x) for x in spec.logprobs.token_logprobs)


def test_a_conversation_s_second_turn_reports_its_cached_prompt_tokens(servers):
    """usage.prompt_tokens_details.cached_tokens: the first turn's blocks come from the prefix
    cache, on by default, a draft model's server included."""
    first = [{"role": "user", "content": "Write a function that adds two numbers, with a docstring."}]
    for name in ("plain", "draft_model"):
        client = servers[name]
        a = client.chat.completions.create(model="tiny", messages=first, max_tokens=16, **GREEDY)
        turn2 = [*first, {"role": "assistant", "content": a.choices[0].message.content}]
        turn2.append({"role": "user", "content": "Now make it subtract."})
        b = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4, **GREEDY)
        cached = b.usage.prompt_tokens_details.cached_tokens
        assert cached >= a.usage.prompt_tokens // 16 * 16 - 16 and cached > 0
        assert cached < b.usage.prompt_tokens
