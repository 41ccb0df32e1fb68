"""KV cache memory: a budget split into fixed-size blocks, handed out to requests on demand.

Every model (target and draft) keeps one flat K and one flat V tensor per layer of
``num_blocks * block_size`` slots; a request's block table names its blocks, and the same table
addresses its K/V in every model's cache. Tokens past ``num_computed_tokens`` (e.g. rejected
drafts) are simply overwritten later: discarding them costs nothing.
"""

from __future__ import annotations

import torch

from dynaspec.models.config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(block_ids))

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_tokens`` tokens; False (nothing taken) if it can't."""
        need = self.blocks_needed(block_ids, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block_ids.append(self._free.pop())
        return True

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
        block_ids.clear()


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token_per_dtype_byte * torch.finfo(dtype).bits // 8


def allocate_kv_cache(
    config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per layer: k, v [num_slots, kv_heads, head_dim]
    shape = (num_slots, config.num_key_value_heads, config.head_dim)
    return [
        (_cache(shape, dtype, device), _cache(shape, dtype, device)) for _ in range(config.num_hidden_layers)
    ]


def _cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V cache. On the CPU its pages stay unwritten (not resident) until tokens
    fill them, so the budget costs memory only as it is used; slots are always written before they
    are read, except slot 0, which the grouped attention reads as padding: it starts at zero."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    cache = torch.empty(shape, dtype=dtype, device=device)
    cache[0].zero_()
    return cache


def fill_kv_noise(caches: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor) -> None:
    """Write small random K/V at ``slots`` of every layer: context the profiler times attention over
    without computing it. Never-written CPU pages read as one shared zero page, all in cache, so
    they would time as free (``_cache``); noise costs what real K/V costs."""
    generator = torch.Generator(device=caches[0][0].device).manual_seed(0)
    for k, v in caches:
        for cache in (k, v):
            shape = (len(slots), *cache.shape[1:])
            noise = torch.randn(shape, generator=generator, device=cache.device) * 0.5
            cache[slots] = noise.to(cache.dtype)
