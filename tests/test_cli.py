"""`dynaspec generate` and `dynaspec models`: output format and one-line errors without tracebacks."""

import json
import subprocess
import sys

import pytest


def dynaspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dynaspec", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_lines_in_input_order(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def f(x):"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + "plain text line\n"
    )
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    r = dynaspec(
        "generate",
        "--model",
        str(target_dir),
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--kv-cache-memory-gb",
        "0.01",
        "--speculative-config",
        spec,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["index"] for line in lines[:-1]] == [0, 1, 2]
    for line in lines[:-1]:
        assert line["num_output_tokens"] == len(line["token_ids"]) <= 8 and isinstance(line["text"], str)
    summary = lines[-1]["summary"]
    assert summary["output_tokens_per_s"] > 0 and summary["wall_time_s"] > 0
    assert "acceptance_rate_per_pos" in summary["spec"] and "steps_by_batch_size" in summary["spec"]


def test_generate_human_output_shows_k_by_batch_size(target_dir):
    spec = json.dumps(
        {
            "method": "draft_model",
            "model": str(target_dir),
            "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 1]],
        }
    )
    r = dynaspec(
        "generate",
        "--model",
        str(target_dir),
        "--prompt",
        "a",
        "--prompt",
        "bb",
        "--prompt",
        "ccc",
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
        "--kv-cache-memory-gb",
        "0.01",
        "--speculative-config",
        spec,
    )
    assert r.returncode == 0, r.stderr
    assert "steps at each K by decode batch size" in r.stdout and "bs   3: K=1" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--temperature", "-1"], "temperature:"),
        (["--max-tokens", "0"], "max_tokens:"),
        (["--speculative-config", "{bad json"], "speculative_config: invalid JSON"),
        (
            ["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
            "speculative_config.method:",
        ),
        (["--prompts-file", "/nonexistent.jsonl"], "dataset:"),
    ],
)
def test_errors_are_one_line_without_traceback(target_dir, args, message):
    base = {"--model": str(target_dir), "--prompt": "hi"}
    if "--prompts-file" in args:
        base.pop("--prompt")
    for flag in args[::2]:
        base.pop(flag, None)
    full = [x for kv in base.items() for x in kv] + args
    r = dynaspec("generate", *full, "--kv-cache-memory-gb", "0.01")
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1


def test_models_list_names_the_packs():
    r = dynaspec("models", "list")
    assert r.returncode == 0, r.stderr
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in r.stdout
