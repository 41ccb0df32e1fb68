"""A request's state as it moves waiting -> running -> finished."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dynaspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dynaspec.engine.types import TokenLogprob


class Detokenizer(Protocol):
    def add(self, new_ids: list[int]) -> str: ...


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The content key of a full block: its tokens and, through ``parent`` (the previous block's
    key, b"" for the first), every token before them. A 128-bit BLAKE2 digest, so one request's
    prompt can not be made to collide with another's (vLLM's CVE-2025-25183 was a weak hash)."""
    data = parent + b"".join(t.to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not exceed this (the model's context)
    detokenizer: Detokenizer
    seed: int  # the sampling seed: draws are a function of (seed, output position) (sampler.py)
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    # tokens (prompt + output) whose K/V are in the cache; a decoding request has all but its last
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.logprobs set
    # with params.prompt_logprobs set: one per prompt token scored so far (the first token's is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # prefix caching (kv_cache.BlockAllocator): whether its blocks may be shared (not when their K/V
    # is made up: the profiler's long contexts), the content keys of its full blocks computed so far
    # (``block_keys``), how many of its blocks are registered, and the prompt tokens it took cached
    cacheable: bool = True
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def keys_upto(self, num_blocks: int, block_size: int) -> list[bytes]:
        """The content keys of its first ``num_blocks`` full blocks (``block_key``),
        computed once each."""
        keys = self.block_keys
        while len(keys) < num_blocks:
            i = len(keys)
            tokens = self.token_at(i * block_size, (i + 1) * block_size)
            keys.append(block_key(keys[-1] if keys else b"", tokens))
        return keys[:num_blocks]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def prompt_offsets_to_score(self, start: int, num_tokens: int) -> range:
        """Offsets within the run of tokens [start, start + num_tokens) whose logits predict a prompt
        token not yet scored (the logits at position j predict token j + 1)."""
        if self.prompt_logprobs is None:
            return range(0)
        first = max(0, len(self.prompt_logprobs) - 1 - start)
        return range(first, max(first, min(num_tokens, len(self.prompt_token_ids) - 1 - start)))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_decoding(self) -> bool:
        """Prefill done: every token but the last has its K/V in the cache."""
        return self.status is RequestStatus.RUNNING and self.num_computed_tokens == self.num_tokens - 1

    @property
    def tokens_left(self) -> int:
        """Tokens it may still generate: max_tokens or the model's context, whichever ends first."""
        by_params = self.params.max_tokens - len(self.output_token_ids)
        by_context = self.max_total_tokens - self.num_tokens
        return max(0, min(by_params, by_context))

    def append(self, token_id: int) -> bool:
        """Append one generated token and apply the stop rules; True if the request finished."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        new_text = self.detokenizer.add([token_id])
        params = self.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish_reason = FinishReason.STOP
            return True
        if new_text:
            tail_from = max(0, len(self.output_text) - max((len(s) for s in params.stop), default=0))
            self.output_text += new_text
            for stop in params.stop:
                at = self.output_text.find(stop, tail_from)
                if at != -1:
                    self.output_text = self.output_text[:at]
                    self.finish_reason = FinishReason.STOP
                    return True
        if self.tokens_left == 0:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    output_token_ids: list[int]  # all generated so far
    text: str  # all generated text so far (stop strings cut)
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    new_logprobs: list[TokenLogprob] | None = None  # [len(new_token_ids)] with params.logprobs set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once finished, with params.prompt_logprobs
