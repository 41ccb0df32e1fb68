"""Weights in 2 MiB pages: one anonymous mapping, advised as transparent huge pages, that holds a
model's large tensors (Linux CPUs).

A decode step streams every weight once (a gigabyte for the 1.5B target in Q4_K). In 4 KiB pages
that is some 250,000 pages a step, each a TLB miss and a page walk, which in a virtual machine walks
the guest's and the host's tables both. PyTorch's CPU allocator asks for no huge pages (unless
THP_MEM_ALLOC_ENABLE is set before its first allocation), and with the kernel's default
``transparent_hugepage/enabled = madvise`` memory gets them only where it is advised. So the
loader (``build.build_model``) reserves an ``Arena``, one mapping advised MADV_HUGEPAGE whose data
starts on a 2 MiB boundary, and as each layer (and the head) is built copies its tensors of at least
``MIN_BYTES`` there and points them at their copies (``Tensor.set_``: modules, and the C++ decoder
stack that holds the same tensors, keep working on the same objects). The layer's own allocations
are freed while the next is built, but the arena's pages are faulted in on top of them: the 1.5B's
start to first token took about 1 s more on the xeon (`bench footprint`), peak RSS 0.03-0.1 GiB
more. Packing each weight straight into the arena (``pack_tiles`` writing into a slice of it) would
remove that; it is not done.
``place_on_huge_pages`` moves modules already built (an EAGLE head; the A/B probe). The bits are
the same; only the pages change. On the 2-core AMX xeon, streamed quantized matmuls ran 2-7%
faster, in one process against the same weights in 4 KiB pages (results record, "Weights in 2 MiB
pages"); whole decode steps gain less than that VM's noise.

It is skipped off Linux, off the CPU, where the kernel's setting is ``never``, and with
DYNASPEC_HUGE_PAGES=0 in the environment. ``Placement.huge_bytes`` says how much of the mapping the
kernel did back with huge pages (it may give fewer when physical memory is fragmented).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dynaspec.heap import libc, release_freed_memory

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 16  # smaller tensors (norms, biases) stay where they are
ALIGN = 64  # each copy starts on a cache line, as PyTorch's allocator places tensors
GUARD = mmap.PAGESIZE
RELEASE_EVERY = 64 << 20  # bytes copied between giving the old pages back
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # an arena's unused capacity commits nothing
OPT_OUT = "DYNASPEC_HUGE_PAGES"  # set to 0: leave the weights in the allocator's pages
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True, slots=True)
class Placement:
    tensors: int  # tensors moved
    bytes: int  # their storages' bytes
    huge_bytes: int | None  # of the mapping, resident in huge pages (None: not readable)
    arena: torch.Tensor = field(repr=False)  # uint8 over the mapping (the tensors' storage)

    def to_dict(self) -> dict:
        return {"tensors": self.tensors, "bytes": self.bytes, "huge_bytes": self.huge_bytes}


def unavailable(device: torch.device) -> str | None:
    """Why weights on ``device`` cannot go to huge pages here, or None."""
    if device.type != "cpu":
        return f"the weights are on {device.type}"
    if os.environ.get(OPT_OUT, "") in ("0", "false", "off"):
        return f"{OPT_OUT}={os.environ[OPT_OUT]}"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    try:
        if "[never]" in THP_SETTING.read_text():
            return f"{THP_SETTING} is never"
    except OSError:
        return f"{THP_SETTING} is not readable"
    return None


@dataclass(slots=True)
class _Span:
    """The bytes [lo, hi) of one storage that some of the tensors to move cover, and those tensors."""

    storage: torch.UntypedStorage | None
    tensors: list[torch.Tensor]
    lo: int = 0
    hi: int = 0


def _spans(modules: list[nn.Module]) -> list[_Span]:
    """The CPU parameters and buffers of at least MIN_BYTES, by the storage they are on (a packed
    buffer and its views move together), each storage's span from its first tensor's first byte
    (rounded down to ALIGN) to its last tensor's end. A span far larger than its tensors (views into
    a mapped file) stays where it is."""
    by_storage: dict[int, _Span] = {}
    seen: set[int] = set()
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen or t.device.type != "cpu" or t.nbytes < MIN_BYTES:
                continue
            seen.add(id(t))
            storage = t.untyped_storage()
            by_storage.setdefault(storage.data_ptr(), _Span(storage, [])).tensors.append(t)
    spans = []
    for span in by_storage.values():
        starts = [t.storage_offset() * t.element_size() for t in span.tensors]
        ends = [
            start + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
            for start, t in zip(starts, span.tensors)
        ]
        span.lo, span.hi = min(starts) // ALIGN * ALIGN, max(ends)
        if span.hi - span.lo <= 2 * sum(t.nbytes for t in span.tensors):
            spans.append(span)
    return spans


class Arena:
    """One anonymous mapping advised for huge pages (or, ``huge`` False, against them), filled front
    to back by ``place``: ``capacity`` bytes from a 2 MiB boundary, then an inaccessible guard page,
    so the kernel cannot merge it with a neighbouring mapping (another model's) and /proc/self/smaps
    reports this one's huge pages alone. Pages cost memory only once a copy touches them, so the
    capacity may be a generous bound. Thread-safe (the loader places layers from its pool)."""

    def __init__(self, capacity: int, huge: bool = True) -> None:
        self.huge = huge
        size = -(-(capacity + HUGE_PAGE) // GUARD) * GUARD + GUARD  # whole pages, the last the guard
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        # before any page is touched: each fault takes a 2 MiB page
        mapping.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        # over all but the guard page; it holds the mapping while tensors use it
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=size - GUARD)
        _protect_none(self.buffer.data_ptr() + self.buffer.numel(), GUARD)
        self.start = -self.buffer.data_ptr() % HUGE_PAGE
        self.capacity = capacity
        self.used = 0
        self.tensors = 0
        self._lock = threading.Lock()

    def _take(self, nbytes: int) -> int | None:
        """The offset (in ``buffer``) of ``nbytes`` of free space, or None when it is full."""
        with self._lock:
            if self.used + nbytes > self.capacity:
                return None
            at, self.used = self.start + self.used, self.used + -(-nbytes // ALIGN) * ALIGN
            return at

    def place(self, modules: Iterable[nn.Module]) -> int:
        """Copy the modules' large CPU tensors not yet here into the arena and point them at their
        copies; returns how many moved (a span that no longer fits stays where it is)."""
        whole = self.buffer.untyped_storage()
        spans = [s for s in _spans(list(modules)) if s.storage.data_ptr() != whole.data_ptr()]
        moved = unreleased = 0
        with torch.no_grad():
            for span in spans:
                at = self._take(span.hi - span.lo)
                if at is None:
                    log.warning(
                        "weight arena full: %d bytes stay in the allocator's pages", span.hi - span.lo
                    )
                    continue
                source = torch.tensor([], dtype=torch.uint8).set_(span.storage)[span.lo : span.hi]
                self.buffer[at : at + span.hi - span.lo].copy_(source)
                for t in span.tensors:
                    byte = at + t.storage_offset() * t.element_size() - span.lo
                    t.set_(whole, byte // t.element_size(), t.size(), t.stride())
                    moved += 1
                # the old storage goes with its last references; its pages go back as the copy
                # goes on, so a whole model's move peaks at the model plus RELEASE_EVERY
                del source
                span.storage, span.tensors = None, []
                unreleased += span.hi - span.lo
                if unreleased >= RELEASE_EVERY:
                    release_freed_memory()
                    unreleased = 0
        with self._lock:
            self.tensors += moved
        return moved

    def finish(self) -> Placement:
        """What the arena holds, logged; the heap's freed pages go back to the system."""
        release_freed_memory()
        placement = Placement(
            self.tensors, self.used, huge_resident_bytes(self.buffer.data_ptr()), self.buffer
        )
        log.info(
            "%d weight tensors (%.2f GB) moved to a mapping %s huge pages: %s of it in huge pages",
            placement.tensors,
            placement.bytes / 1e9,
            "advised" if self.huge else "advised against",
            "?" if placement.huge_bytes is None else f"{placement.huge_bytes / 1e9:.2f} GB",
        )
        return placement


def weight_arena(capacity: int, device: torch.device, huge: bool = True) -> Arena | None:
    """An arena of at most ``capacity`` bytes for weights on ``device`` (``huge`` False: advised
    against huge pages), or None where huge pages do not apply (``unavailable``) or the mapping is
    refused."""
    why = unavailable(device)
    if why is not None:
        log.debug("weights stay in the allocator's pages: %s", why)
        return None
    try:
        return Arena(capacity, huge)
    except OSError as e:  # e.g. strict overcommit refusing the reservation
        log.warning(
            "weights stay in the allocator's pages: a %.1f GB mapping was refused (%s)", capacity / 1e9, e
        )
        return None


def place_on_huge_pages(
    modules: Iterable[nn.Module], device: torch.device, huge: bool = True
) -> Placement | None:
    """Move built modules' large CPU tensors into an arena of their size (see the module
    docstring); None where that cannot be done (``weight_arena``) or nothing is large enough. With
    ``huge`` False the mapping is advised against huge pages (4 KiB pages, the same layout: the
    control of an A/B, benchmarks/probes/huge_pages_ab.py)."""
    modules = list(modules)
    size = sum(-(-(s.hi - s.lo) // ALIGN) * ALIGN for s in _spans(modules))
    arena = weight_arena(size, device, huge) if size else None
    if arena is None:
        return None
    arena.place(modules)
    return arena.finish()


def _protect_none(address: int, size: int) -> None:
    """mprotect(PROT_NONE) on a page-aligned range (a no-op where libc cannot be loaded)."""
    c = libc()
    if c is not None:
        c.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(size), 0)  # 0: PROT_NONE


def huge_resident_bytes(address: int) -> int | None:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps), or None."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None
