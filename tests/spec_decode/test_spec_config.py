"""--speculative-config: every malformed field is named, before anything loads."""

import json

import pytest

from dynaspec.kpolicy.config import SpeculativeConfig

GOOD = {
    "method": "draft_model",
    "model": "qwen2.5-coder-0.5b-instruct",
    "num_speculative_tokens": 5,
    "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 16, 2], [17, 256, 0]],
}


def test_json_string_dict_and_file(tmp_path):
    a = SpeculativeConfig.parse(json.dumps(GOOD))
    b = SpeculativeConfig.parse(GOOD)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(GOOD))
    c = SpeculativeConfig.parse(f"@{path}")
    assert a == b == c
    assert a.num_speculative_tokens_per_batch_size == ((1, 4, 5), (5, 16, 2), (17, 256, 0))
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_max == 4
    assert SpeculativeConfig.parse(a.to_dict()) == a


@pytest.mark.parametrize(
    "change, field",
    [
        ({"method": "medusa"}, "method"),
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": "5"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": None}, "num_speculative_tokens"),
        ({"num_speculative_tokens_per_batch_size": [[2, 4, 5]]}, "num_speculative_tokens_per_batch_size"),
        (
            {"num_speculative_tokens_per_batch_size": [[1, 4, 5], [3, 8, 2]]},
            "num_speculative_tokens_per_batch_size",
        ),
        ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": [[4, 1, 2]]}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": "x"}, "num_speculative_tokens_per_batch_size"),
        ({"num_speculative_tokens_per_batch_size": []}, "num_speculative_tokens_per_batch_size"),
        ({"dynamic_config_path": "p.json"}, "num_speculative_tokens_per_batch_size"),
        ({"hysteresis_steps": 0}, "hysteresis_steps"),
        ({"draft_quantization": "int3"}, "draft_quantization"),
        ({"draft_vocab_size": 0}, "draft_vocab_size"),
        ({"draft_context_window": -1}, "draft_context_window"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_malformed_field_is_named(change, field):
    with pytest.raises(ValueError, match=f"^speculative_config.{field}:"):
        SpeculativeConfig.parse({**GOOD, **change})


def test_a_draft_model_sees_a_256_token_window_unless_told_otherwise():
    assert SpeculativeConfig.parse(GOOD).context_window == 256
    assert SpeculativeConfig.parse({**GOOD, "draft_context_window": 64}).context_window == 64
    assert SpeculativeConfig.parse({**GOOD, "draft_context_window": 0}).context_window is None
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).context_window is None


def test_ngram_rules():
    with pytest.raises(ValueError, match="^speculative_config.model:"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="^speculative_config.draft_context_window: only applies"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "draft_context_window": 64})
    with pytest.raises(ValueError, match="^speculative_config.prompt_lookup_min:"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="^speculative_config.method:"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2})


def test_bad_json_and_missing_file():
    with pytest.raises(ValueError, match="^speculative_config: invalid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="^speculative_config: file not found"):
        SpeculativeConfig.parse("@/nonexistent/spec.json")
    with pytest.raises(ValueError, match="^speculative_config: must be a JSON object"):
        SpeculativeConfig.parse("[1, 2]")
