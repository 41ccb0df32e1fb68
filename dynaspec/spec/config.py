"""`--speculative-config`: the reference engine's JSON schema, validated once before anything loads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

METHODS = ("draft_model", "ngram")
QUANTIZATIONS = ("int8",)


def _err(field: str, message: str) -> ValueError:
    return ValueError(f"speculative_config.{field}: {message}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None  # the maximum K
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    dynamic_config_path: str | None = None
    hysteresis_steps: int = 3
    draft_quantization: str | None = None  # "int8": weight-only int8 drafter (lossless: drafts only)
    draft_vocab_size: int | None = None  # keep only the first N rows of the drafter's LM head

    @classmethod
    def parse(cls, arg: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string, or ``@path/to/file.json``; None stays None."""
        if arg is None or isinstance(arg, SpeculativeConfig):
            return arg
        if isinstance(arg, str):
            text = arg
            if arg.startswith("@"):
                path = Path(arg[1:])
                if not path.is_file():
                    raise ValueError(f"speculative_config: file not found: {path}")
                text = path.read_text()
            try:
                arg = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: invalid JSON: {e}") from None
        if not isinstance(arg, dict):
            raise ValueError("speculative_config: must be a JSON object")
        return cls.from_dict(arg)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise _err(key, f"unknown field (known: {', '.join(sorted(known))})")
        if "method" not in d:
            raise _err("method", f"required: one of {', '.join(METHODS)}")
        table = d.get("num_speculative_tokens_per_batch_size")
        if table is not None:
            if not isinstance(table, list) or not all(isinstance(r, (list, tuple)) for r in table):
                raise _err("num_speculative_tokens_per_batch_size", "must be a list of [lo, hi, K] ranges")
            d = {**d, "num_speculative_tokens_per_batch_size": tuple(tuple(r) for r in table)}
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _err("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise _err("model", "required for method draft_model: a pack name, HF directory or .gguf file")
        elif self.model is not None:
            raise _err("model", "only applies to method draft_model")
        k = self.num_speculative_tokens
        if k is None and self.dynamic_config_path is None:
            raise _err("num_speculative_tokens", "required (an integer >= 1)")
        if k is not None and (not _is_int(k) or k < 1 or k > 32):
            raise _err("num_speculative_tokens", f"must be an integer in [1, 32], got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "hysteresis_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _err(name, f"must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _err("prompt_lookup_min", "must not exceed prompt_lookup_max")
        if self.num_speculative_tokens_per_batch_size is not None:
            if self.dynamic_config_path is not None:
                raise _err("num_speculative_tokens_per_batch_size", "give either this table or dynamic_config_path")
            _check_table(self.num_speculative_tokens_per_batch_size)
        if self.dynamic_config_path is not None and not isinstance(self.dynamic_config_path, str):
            raise _err("dynamic_config_path", "must be a path string")
        if self.draft_quantization is not None and self.draft_quantization not in QUANTIZATIONS:
            raise _err("draft_quantization", f"must be one of {', '.join(QUANTIZATIONS)} or null")
        if self.draft_vocab_size is not None and (not _is_int(self.draft_vocab_size) or self.draft_vocab_size < 1):
            raise _err("draft_vocab_size", f"must be an integer >= 1, got {self.draft_vocab_size!r}")
        if self.method != "draft_model" and (self.draft_quantization or self.draft_vocab_size):
            raise _err("draft_quantization" if self.draft_quantization else "draft_vocab_size",
                       "only applies to method draft_model")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["num_speculative_tokens_per_batch_size"] is not None:
            d["num_speculative_tokens_per_batch_size"] = [list(r) for r in d["num_speculative_tokens_per_batch_size"]]
        return {k: v for k, v in d.items() if v is not None}


def _check_table(table: tuple) -> None:
    name = "num_speculative_tokens_per_batch_size"
    if not table:
        raise _err(name, "must not be empty")
    prev_hi = 0
    for i, r in enumerate(table):
        if len(r) != 3 or not all(_is_int(x) for x in r):
            raise _err(name, f"range {i} must be [lo, hi, K] integers, got {list(r)!r}")
        lo, hi, k = r
        if i == 0 and lo != 1:
            raise _err(name, f"the first range must start at batch size 1, got {lo}")
        if lo > hi:
            raise _err(name, f"range {i} has lo {lo} > hi {hi}")
        if lo <= prev_hi:
            raise _err(name, f"range {i} [{lo}, {hi}] overlaps or is out of order")
        if k < 0:
            raise _err(name, f"range {i} has K {k} < 0")
        prev_hi = hi


def table_lookup(table: tuple[tuple[int, int, int], ...], batch_size: int) -> int:
    """K for a batch size: its range's K; in a gap, the range before; above the last, the last K."""
    k = table[0][2]
    for lo, _, range_k in table:
        if batch_size < lo:
            break
        k = range_k
    return k
