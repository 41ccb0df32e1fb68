"""Passes of fixed shape over persistent buffers, replayed as CUDA graphs.

A decode step's shapes depend only on (b, width): b requests padded up to a batch bucket, each
verifying its last token and up to ``width - 1`` drafts (the drafter: a catch-up pass then single
tokens). ``StaticInputs`` holds a pass's integer inputs (token ids, positions, cache slots, block
tables, context lengths) in one device buffer, filled from a pinned host buffer by one
asynchronous copy a step; ``PassGraphs`` captures the pass once per key into one memory pool and
replays it. On the CPU, with ``enforce_eager``, or for a key not captured, the same function runs
eagerly on the same buffers, so the CPU tests exercise the very code the graphs replay.

Padding: a padded row (or a padded position of a row) has slot -1 (its K/V is not written) and a
context over block 0, whose keys exist and are finite; its outputs are never read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from dynaspec.models.fused_ops import capture_graph

log = logging.getLogger(__name__)

NO_SLOT = -1  # a position whose K/V is not written (padding, positions beyond a row's drafts)
# batch buckets: a step of b requests runs as the smallest bucket >= b (nano-vllm's scheme)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The buckets a batch of up to ``max_num_seqs`` requests runs in (the last one is max_num_seqs)."""
    out = [b for b in BUCKETS if b < max_num_seqs]
    return out + [max_num_seqs]


def bucket_of(b: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``b`` rows (``b`` itself beyond the last)."""
    for size in buckets:
        if size >= b:
            return size
    return b


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    shape: tuple[int, ...]


class StaticInputs:
    """A pass's integer inputs: one int32 device buffer and its pinned host twin, laid out per key
    as consecutive fields (the layout is fixed per key, so a graph captured for it reads the same
    addresses every replay)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=pin)  # [capacity]
        self.device_buffer = torch.zeros(capacity, dtype=torch.int32, device=device)  # [capacity]
        self._host_np = self.host.numpy()

    def views(self, fields: Iterable[Field]) -> dict[str, torch.Tensor]:
        """Device views of the fields, back to back from the start of the buffer."""
        out, at = {}, 0
        for f in fields:
            n = int(np.prod(f.shape))
            out[f.name] = self.device_buffer[at : at + n].view(f.shape)
            at += n
        return out

    def load(self, fields: Iterable[Field], arrays: dict[str, np.ndarray]) -> None:
        """Write the fields' values into the pinned buffer, then one asynchronous copy to the device.
        The step's one wait on its results comes after this copy, so the next step's write into the
        pinned buffer never races it."""
        at = 0
        for f in fields:
            n = int(np.prod(f.shape))
            self._host_np[at : at + n] = np.asarray(arrays[f.name]).reshape(-1)
            at += n
        self.device_buffer[:at].copy_(self.host[:at], non_blocking=True)


class PassGraphs:
    """CUDA graphs of one model's pass function, one per key, sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_s = 0.0

    def run(self, key: tuple, fn: Callable[[], object]) -> object:
        """Replay the key's graph (its outputs are static tensors), or run ``fn`` eagerly."""
        graph = self.graphs.get(key)
        if graph is None:
            return fn()
        graph[0].replay()
        return graph[1]

    def capture(self, key: tuple, fn: Callable[[], object], pool) -> None:
        """Record ``fn`` as the key's graph, its memory from ``pool``
        (``torch.cuda.graph_pool_handle()``, shared by all graphs)."""
        start = time.perf_counter()
        self.graphs[key] = capture_graph(fn, pool)
        self.capture_s += time.perf_counter() - start


def slots_of(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position ([rows, n] positions over [rows, max_blocks] block tables)."""
    blocks = np.take_along_axis(block_table, np.clip(positions // block_size, 0, None), axis=1)
    return blocks * block_size + positions % block_size


def block_table_rows(block_ids: list[list[int]], rows: int, width: int) -> np.ndarray:
    """[rows, width] int32 block tables (padding rows and columns: block 0)."""
    table = np.zeros((rows, width), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table


class StepClock:
    """Marks on the step's timeline: CUDA events on a GPU (read after the step's one wait), the
    host clock elsewhere; never a synchronize of its own."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        if self.cuda:
            end.synchronize()  # already complete after the step's wait: returns at once
            return start.elapsed_time(end)
        return (end - start) * 1000
