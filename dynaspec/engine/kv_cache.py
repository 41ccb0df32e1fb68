"""KV cache memory: a budget split into fixed-size blocks, handed out to requests on demand.

Every model (target and draft) keeps one flat K and one flat V tensor per layer of
``num_blocks * block_size`` slots; a request's block table names its blocks, and the same table
addresses its K/V in every model's cache. Tokens past ``num_computed_tokens`` (e.g. rejected
drafts) are simply overwritten later: discarding them costs nothing. With prefix caching, full
blocks are also kept by content and shared between requests whose tokens start alike; a request
only ever writes past its computed tokens, so the target never writes a shared (full, computed)
block. A drafter keeps its own K/V at indices of its own (``draft_context_window`` shifts them), so
before it writes into a block other requests share, the request takes a copy of it (``unshare``).
"""

from __future__ import annotations

import collections

import torch

from dynaspec.models.config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockAllocator:
    """Blocks handed out to requests, and with ``prefix_caching`` a cache of full blocks by
    content: a block whose tokens (and every token before them) a request computed is registered
    under its content key (``request.block_key``); a later request whose prompt starts with the
    same blocks takes them (``acquire``: shared, reference-counted) instead of computing them. A
    registered block no request holds stays cached until a new block is needed and no plain free
    block is left; then the least recently released goes first (a request's last blocks before
    its first)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # no request holds them, nothing cached
        self._refs = [0] * num_blocks
        self.num_shared = 0  # blocks more than one request holds
        self.num_unshared = 0  # copies taken of shared blocks (``unshare``)
        self._key_of: dict[int, bytes] = {}  # registered block -> its content key
        self._block_of: dict[bytes, int] = {}  # content key -> block
        # registered blocks no request holds, the least recently released first
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_evicted = 0
        # blocks handed out at least once: on the CPU their pages are resident from then on (a cache
        # that keeps blocks fills the budget over time; without one, the peak in use bounds it)
        self._touched = bytearray(num_blocks)
        self.num_touched = 0

    @property
    def num_free(self) -> int:
        """Blocks a request can take: the plain free ones and the cached ones no request holds."""
        return len(self._free) + len(self._idle)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def blocks_needed(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(block_ids))

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_tokens`` tokens; False (nothing taken) if it can't."""
        need = self.blocks_needed(block_ids, num_tokens)
        if need > self.num_free:
            return False
        for _ in range(need):
            block_ids.append(self._take())
        return True

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently released cached block
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.num_evicted += 1
        if not self._touched[block]:
            self._touched[block] = 1
            self.num_touched += 1
        self._refs[block] = 1
        return block

    def free(self, block_ids: list[int]) -> None:
        """Release a request's hold on its blocks (a shared block stays with its other holders)."""
        for block in reversed(block_ids):  # the last blocks first: they are evicted first
            self._drop(block)
        block_ids.clear()

    def _drop(self, block: int) -> None:
        """One holder of ``block`` lets it go."""
        self._refs[block] -= 1
        if self._refs[block] == 1:
            self.num_shared -= 1
        elif self._refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def is_shared(self, block: int) -> bool:
        return self._refs[block] > 1

    def unshare(self, block: int) -> int | None:
        """A fresh block to stand for ``block``, which other requests share, in one holder's table:
        that holder's hold on ``block`` is dropped and it copies the K/V over; None (nothing
        changed) when no block is free."""
        if not self.num_free:
            return None
        self._drop(block)
        self.num_unshared += 1
        return self._take()

    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many of ``keys`` (a prompt's leading full blocks, in order) are cached."""
        n = 0
        if self.prefix_caching:
            for key in keys:
                if key not in self._block_of:
                    break
                n += 1
        return n

    def acquire(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of ``keys`` (all cached: ``cached_prefix``), now also held by the caller."""
        blocks = []
        for key in keys:
            block = self._block_of[key]
            if self._refs[block] == 0:
                del self._idle[block]
            elif self._refs[block] == 1:
                self.num_shared += 1
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """``block`` now holds the computed K/V of the tokens ``key`` names. A key already cached
        under another block (two requests computed the same tokens at once) keeps that one."""
        if self.prefix_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (held ones stay with their requests, no longer shareable)."""
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._key_of.clear()
        self._block_of.clear()


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
