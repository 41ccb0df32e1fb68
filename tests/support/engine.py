"""Driving a tiny engine in tests: the prompts, greedy params, and each prompt alone or staggered."""

from dynaspec import SamplingParams
from dynaspec.engine.engine import Engine, EngineConfig

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "Hello, world! How are you today? I am fine, thank you. And you?",
    "import torch\nx = torch.zeros(4, 8)\n",
    "class Request:",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory_gb", 0.01)
    kw.setdefault("progress", False)
    return Engine(EngineConfig(model=str(path), **kw))


def run_alone(path, prompts, params=GREEDY, **kw):
    outs = []
    for p in prompts:
        engine = make_engine(path, **kw)
        r = engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
        outs.append(r.output_token_ids)
    return outs


def run_staggered(engine, prompts, params=GREEDY, arrive_every=2):
    """Add one prompt every `arrive_every` steps, so requests join a running batch."""
    requests = []
    pending = list(prompts)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            requests.append(engine.add_request(pending.pop(0), params))
        engine.step()
        step += 1
    return [r.output_token_ids for r in requests]
