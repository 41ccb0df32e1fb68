"""Per-request sampling parameters, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # alternatives per token a request may ask for


@dataclass(slots=True)
class SamplingParams:
    """What to generate and how. Penalties and logit bias act on the target's logits (and the
    drafter's alike) before temperature, top-k and top-p; log-probabilities are of the raw
    distribution: the model's log-softmax before any of them."""

    max_tokens: int = 64  # 0 only scores the prompt (with prompt_logprobs)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the tokens generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; n: each output token's log-probability and the top n
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.max_tokens, int)
            and not isinstance(self.max_tokens, bool)
            and (self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None)),
            "max_tokens",
            f"must be an integer >= 1 (0 only with prompt_logprobs), got {self.max_tokens!r}",
        )
        _check(
            _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be a number in [0, 100], got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be a number in (0, 1], got {self.top_p!r}",
        )
        if self.top_k == -1:
            self.top_k = 0
        _check(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
            "top_k",
            f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            "seed",
            f"must be an integer, got {self.seed!r}",
        )
        _check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of them",
        )
        _check(
            isinstance(self.stop_token_ids, list) and all(isinstance(t, int) for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of integers",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value!r}")
        _check(
            _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
            "repetition_penalty",
            f"must be a number in (0, 100], got {self.repetition_penalty!r}",
        )
        _check(
            isinstance(self.logit_bias, dict)
            and all(
                _is_int(t) and t >= 0 and _is_number(b) and -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()
            ),
            "logit_bias",
            "must map token ids (integers >= 0) to biases in [-100, 100]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty or logit bias changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
