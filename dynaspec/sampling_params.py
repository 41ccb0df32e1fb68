"""Per-request sampling parameters, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.max_tokens, int)
            and not isinstance(self.max_tokens, bool)
            and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
