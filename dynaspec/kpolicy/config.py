"""`--speculative-config`: the reference engine's JSON schema, validated once before anything loads.

A pydantic dataclass: types are checked strictly (``"5"`` is not an integer), unknown fields are
refused, and every error names its field as ``speculative_config.<field>: ...``.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

METHODS = ("draft_model", "ngram", "suffix", "eagle", "eagle3")
# methods whose drafter is a head reading the target's hidden states; `model` names its checkpoint
EAGLE_METHODS = ("eagle", "eagle3")
MODEL_DRAFTERS = ("draft_model", *EAGLE_METHODS)  # drafters that run passes: suffix drafts may join them
TABLE = "num_speculative_tokens_per_batch_size"
SYNTHETIC = "synthetic_acceptance_rate"
# a draft model's window when the config names none: acceptance on long code outputs 0.788 against
# the whole context's 0.801, for a drafter pass that no longer grows with the context
DEFAULT_DRAFT_CONTEXT_WINDOW = 256
# a draft model's --quantization on the CPU when the config names none: round to nearest in 4 bits
# at load (4.5 bits a weight): the pair's drafter pass streams 22% fewer bytes (8.5 -> 6.9 ms at one
# row), for drafts kept 0.831 against 0.844 with the file's own Q5_0/Q8_0 (long sampled code)
DEFAULT_DRAFT_QUANTIZATION = "int4"
# an EAGLE head's linears on the CPU when the config names none: 8-bit groups through the C++
# kernel; a head pass of the real target's head took 8.2 ms against 24.7 as stored (zen3, K=3, the
# same drafts accepted)
DEFAULT_HEAD_QUANTIZATION = "int8"
AUTO_MAX_K = 5  # the largest K an auto profile measures unless num_speculative_tokens says otherwise
SUFFIX_FIELDS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_cached_tokens",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)


class SuffixSettings(NamedTuple):
    """The suffix drafter's options with their defaults (vLLM's, and a token budget of our own)."""

    max_tree_depth: int = 24  # match + draft tokens
    max_cached_requests: int = 10000  # finished outputs kept (0: none)
    # tokens of finished outputs kept: the cache's memory bound (a branch node per repeated
    # substring, a leaf per token)
    max_cached_tokens: int = 1 << 17
    max_spec_factor: float = 1.0  # draft tokens at most this times the match length
    min_token_prob: float = 0.1  # a draft token's estimated probability (its frequency) at least this


@dataclass(frozen=True, config=ConfigDict(extra="forbid", strict=True))
class SpeculativeConfig:
    method: Literal["draft_model", "ngram", "suffix", "eagle", "eagle3"]
    # draft_model: a pack name, HF directory or .gguf file; eagle, eagle3: the head's checkpoint
    # directory (config.json + model.safetensors, as vLLM and SpecForge lay them out)
    model: str | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=32)  # the maximum K
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = (
        None  # [lo, hi, K] ranges
    )
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)
    dynamic_config_path: str | None = None  # a profile: K chosen by goodput; "auto": profile on first use
    hysteresis_steps: int = Field(default=3, ge=1)
    per_request_k: bool = True  # goodput policy: a K per request from its own acceptance (else one K)
    # a decode stops drafting where the drafter's top probability is below this; "auto" (the default
    # with a profile): tuned from what the target accepted; without a profile the default is 0 (never)
    draft_confidence_threshold: float | Literal["auto"] | None = None
    # the drafter's --quantization (default: int4 on the CPU, else the target's; an EAGLE head's
    # linears: int8 on the CPU, else as stored); drafts only, so any choice stays lossless
    draft_quantization: Literal["auto", "none", "int8", "int4"] | None = None
    draft_vocab_size: int | None = Field(
        default=None, ge=1
    )  # keep only the first N rows of the drafter's head
    # the drafter sees a request's first 4 tokens and its last N (a sliding window): what it reads
    # to catch up and what each of its tokens attends to stay flat as the request grows; default
    # DEFAULT_DRAFT_CONTEXT_WINDOW, 0 for the whole context
    draft_context_window: int | None = Field(default=None, ge=0)
    # the drafter's weights (`--load-format`): "dummy" makes random ones of its shape and reads no
    # weight file; default: the target's
    load_format: Literal["auto", "dummy"] | None = None
    # not lossless: verification accepts drafts at these rates whatever the tokens (α_1 >= α_2 >= ...
    # in (0, 1], unconditional as the profile's; or one number a: α_i = a^i), so that the cost of every
    # K can be profiled and swept with dummy weights; `serve` refuses it
    synthetic_acceptance_rate: float | tuple[float, ...] | None = None
    # suffix: see SuffixSettings for what each does and its default
    suffix_decoding_max_tree_depth: int | None = Field(default=None, ge=2)
    suffix_decoding_max_cached_requests: int | None = Field(default=None, ge=0)
    suffix_decoding_max_cached_tokens: int | None = Field(default=None, ge=0)
    suffix_decoding_max_spec_factor: float | None = Field(default=None, gt=0.0)
    suffix_decoding_min_token_prob: float | None = Field(default=None, ge=0.0, le=1.0)
    # draft_model, eagle, eagle3: suffix drafts too (Arctic Inference's option): a request whose
    # own and sibling outputs hold a match drafts from it at no drafter pass where the goodput
    # policy finds that pays, the drafter elsewhere (spec_decode/hybrid.py); the
    # suffix_decoding_* options apply
    enable_suffix_decoding: bool = False

    @property
    def max_k(self) -> int:
        """The largest K: num_speculative_tokens, else what an auto profile measures."""
        return self.num_speculative_tokens or AUTO_MAX_K

    @property
    def label(self) -> str:
        """The drafter in a few words: its method, with "+suffix" for a drafter with suffix
        decoding."""
        return self.method + ("+suffix" if self.enable_suffix_decoding else "")

    @property
    def uses_suffix(self) -> bool:
        """Whether suffix trees draft: method suffix, or a drafter with enable_suffix_decoding."""
        return self.method == "suffix" or self.enable_suffix_decoding

    @property
    def suffix(self) -> SuffixSettings:
        """The suffix drafter's options, defaults filled in."""
        given = {name.removeprefix("suffix_decoding_"): getattr(self, name) for name in SUFFIX_FIELDS}
        return SuffixSettings(**{k: v for k, v in given.items() if v is not None})

    @property
    def context_window(self) -> int | None:
        """The drafter's window in tokens; None: the whole context (or no drafter)."""
        if self.method != "draft_model":
            return None
        window = self.draft_context_window
        return DEFAULT_DRAFT_CONTEXT_WINDOW if window is None else (window or None)

    def drafter_quantization(self, device_type: str, target: str) -> str | None:
        """The drafter's --quantization: draft_quantization; else int4 on the CPU (drafts need only
        be likely, and a 4-bit drafter's passes are cheaper); else the target's (``target``). An
        EAGLE head's linears: draft_quantization where given (int8, int4, none: as stored), else
        int8 on the CPU and as stored elsewhere. None without a drafter."""
        if self.method in EAGLE_METHODS:
            if self.draft_quantization is not None:
                return self.draft_quantization
            return DEFAULT_HEAD_QUANTIZATION if device_type == "cpu" else None
        if self.method != "draft_model":
            return None
        if self.draft_quantization is not None:
            return self.draft_quantization
        return DEFAULT_DRAFT_QUANTIZATION if device_type == "cpu" else target

    def for_target(self, load_format: str) -> SpeculativeConfig:
        """This config with the target's ``load_format`` as the drafter's where it names none."""
        if self.method != "draft_model" or self.load_format is not None:
            return self
        return replace(self, load_format=load_format)

    @field_validator("synthetic_acceptance_rate")
    @classmethod
    def _synthetic(cls, rates: float | tuple[float, ...] | None) -> float | tuple[float, ...] | None:
        if rates is None:
            return None
        values = rates if isinstance(rates, tuple) else (rates,)
        if not values:
            raise ValueError("must be a number in (0, 1] or a non-empty list of them")
        bad = next((a for a in values if not 0.0 < a <= 1.0), None)
        if bad is not None:
            raise ValueError(f"rates must be in (0, 1], got {bad!r}")
        if any(later > earlier for earlier, later in itertools.pairwise(values)):
            raise ValueError(
                f"per-position rates must not increase (alpha_1 >= alpha_2 >= ...), got {list(values)}"
            )
        return rates

    @field_validator(TABLE)
    @classmethod
    def _table(
        cls, table: tuple[tuple[int, int, int], ...] | None
    ) -> tuple[tuple[int, int, int], ...] | None:
        if table is not None:
            _check_table(table)
        return table

    @model_validator(mode="after")
    def _rules(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                "model: required for method draft_model: a pack name, HF directory or .gguf file"
            )
        if self.method in EAGLE_METHODS and not self.model:
            raise ValueError(f"model: required for method {self.method}: the head's checkpoint directory")
        if self.method != "draft_model":
            eagle = self.method in EAGLE_METHODS
            if not eagle and self.model is not None:
                raise ValueError("model: only applies to method draft_model")
            if not eagle and self.draft_quantization is not None:
                raise ValueError("draft_quantization: only applies to methods draft_model, eagle and eagle3")
            for name in ("draft_vocab_size", "draft_context_window", "load_format"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only applies to method draft_model")
            if eagle and self.draft_quantization not in (None, "none", "int8", "int4"):
                raise ValueError(
                    f"draft_quantization: an EAGLE head takes none, int8 or int4, "
                    f"not {self.draft_quantization!r}"
                )
        if self.enable_suffix_decoding and self.method not in MODEL_DRAFTERS:
            raise ValueError(
                "enable_suffix_decoding: only applies to methods draft_model, eagle and eagle3 "
                '(method "suffix" drafts from suffix trees alone)'
            )
        if not self.uses_suffix:
            for name in SUFFIX_FIELDS:
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}: only applies to method suffix, or a drafter with enable_suffix_decoding"
                    )
        if self.num_speculative_tokens is None and self.dynamic_config_path is None:
            raise ValueError("num_speculative_tokens: required (an integer >= 1)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min: must not exceed prompt_lookup_max")
        if self.num_speculative_tokens_per_batch_size is not None and self.dynamic_config_path is not None:
            raise ValueError(f"{TABLE}: give either this table or dynamic_config_path")
        threshold = self.draft_confidence_threshold
        if isinstance(threshold, float) and not 0.0 <= threshold < 1.0:
            raise ValueError(f"draft_confidence_threshold: must be in [0, 1) or 'auto', got {threshold!r}")
        if threshold == "auto" and self.dynamic_config_path is None:
            raise ValueError("draft_confidence_threshold: 'auto' needs dynamic_config_path (the costs)")
        return self

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
        for key in d:  # named before pydantic's own message, with the known fields listed
            if key not in known:
                raise _err(key, f"unknown field (known: {', '.join(sorted(known))})")
        if "method" not in d:
            raise _err("method", f"required: one of {', '.join(METHODS)}")
        table = d.get(TABLE)
        if table is not None:
            if not isinstance(table, list) or not all(isinstance(r, (list, tuple)) for r in table):
                raise _err(TABLE, "must be a list of [lo, hi, K] ranges")
            bad = next((r for r in table if len(r) != 3 or not all(_is_int(x) for x in r)), None)
            if bad is not None:
                raise _err(TABLE, f"range {table.index(bad)} must be [lo, hi, K] integers, got {list(bad)!r}")
            d = {**d, TABLE: tuple(tuple(r) for r in table)}
        rates = d.get(SYNTHETIC)
        if isinstance(rates, list):  # JSON's array, as the strict tuple field takes it
            d = {**d, SYNTHETIC: tuple(rates)}
        try:
            return cls(**d)
        except ValidationError as e:
            raise _from_validation_error(e) from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d[TABLE] is not None:
            d[TABLE] = [list(r) for r in d[TABLE]]
        if isinstance(d[SYNTHETIC], tuple):
            d[SYNTHETIC] = list(d[SYNTHETIC])
        return {k: v for k, v in d.items() if v is not None}


def _err(field: str, message: str) -> ValueError:
    return ValueError(f"speculative_config.{field}: {message}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _from_validation_error(e: ValidationError) -> ValueError:
    """The first error, as ``speculative_config.<field>: <message>``."""
    first = e.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    loc = [str(x) for x in first["loc"] if not isinstance(x, int)]
    if loc and first["type"] != "value_error":  # pydantic's own message: say what was given
        message = f"{message}, got {first.get('input')!r}"
    if loc:
        return _err(loc[0], message)
    return ValueError(f"speculative_config.{message}")  # a rule across fields names its field first


def _check_table(table: tuple) -> None:
    if not table:
        raise ValueError("must not be empty")
    prev_hi = 0
    for i, (lo, hi, k) in enumerate(table):
        if i == 0 and lo != 1:
            raise ValueError(f"the first range must start at batch size 1, got {lo}")
        if lo > hi:
            raise ValueError(f"range {i} has lo {lo} > hi {hi}")
        if lo <= prev_hi:
            raise ValueError(f"range {i} [{lo}, {hi}] overlaps or is out of order")
        if k < 0:
            raise ValueError(f"range {i} has K {k} < 0")
        prev_hi = hi


def table_lookup(table: tuple[tuple[int, int, int], ...], batch_size: int) -> int:
    """K for a batch size: its range's K; in a gap, the range before; above the last, the last K."""
    k = table[0][2]
    for lo, _, range_k in table:
        if batch_size < lo:
            break
        k = range_k
    return k
