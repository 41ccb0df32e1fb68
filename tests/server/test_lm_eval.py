"""A client no one here wrote: lm-evaluation-harness drives `generate_until` and `loglikelihood`
tasks (from a local dataset file) against a real server, with and without speculation; the scores
and every sample's output are identical."""

import json

import pytest
from support.server import running_server

lm_eval = pytest.importorskip("lm_eval")

ROWS = [
    ("def fibonacci(n):", ["    return n", "    pass", "print(n)"], 0),
    ("The quick brown fox", [" jumps over the lazy dog.", " sleeps.", " is red."], 0),
    ("Hello, world! How are", [" you today?", " they?", " we?"], 0),
    ("import torch\nx = torch.", ["zeros(4, 8)", "ones(2)", "randn(3)"], 0),
    ("for i in range(10):\n", ["    print(i, i * i)", "    pass", "    break"], 0),
    ("class Request:\n    def", [" __init__(self, prompt):", " run(self):", " go(self):"], 0),
]

GENERATE = """task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""

CHOICE = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "data.jsonl"
    with data.open("w") as f:
        for q, choices, label in ROWS:
            f.write(
                json.dumps({"question": q, "answer": choices[0], "choices": choices, "label": label}) + "\n"
            )
    (root / "tiny_generate.yaml").write_text(GENERATE.format(data=data))
    (root / "tiny_choice.yaml").write_text(CHOICE.format(data=data))
    return root


def evaluate(target_dir, tasks, spec):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with running_server(target_dir, speculative_config=spec) as (base, loop):
        out = simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{base}/v1/completions",
                "model": "tiny",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(target_dir),
                "max_length": 256,
                "max_retries": 1,
            },
            tasks=["tiny_generate", "tiny_choice"],
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
        )
        stats = loop.engine.stats()
    return out, stats


def samples(out, task):
    return [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in out["samples"][task]]


def test_lm_eval_scores_and_samples_identical_with_speculation(target_dir, tasks, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plain, _ = evaluate(target_dir, tasks, None)
    spec, stats = evaluate(
        target_dir, tasks, {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3}
    )
    assert stats["spec"]["num_accepted_tokens"] > 0  # speculation really ran
    for task in ("tiny_generate", "tiny_choice"):
        assert samples(spec, task) == samples(plain, task)
        assert len(samples(plain, task)) == len(ROWS)
        assert spec["results"][task] == plain["results"][task]
    generated = [s[1][0][0] for s in samples(plain, "tiny_generate")]
    assert any(generated)  # the server generated text for lm-eval to score
