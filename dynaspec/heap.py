"""glibc malloc settings that keep a step's large temporaries in reused memory (plain ctypes, no torch).

- `one_arena` (at `import dynaspec`): every thread allocates from the main arena. glibc gives each
  new thread an arena of its own, whose heaps hold at most 64 MiB; anything larger is mapped
  fresh and unmapped at free, whatever the thresholds below say. The server's engine loop is such
  a thread: an 88 MB buffer written there took 13.3 ms and 10,683 page faults every time, and
  1.6 ms with no faults on the main arena once a model was loaded (through a real server,
  fixed K=5 n-gram at 24 concurrent requests: 3-5% more output tok/s,
  benchmarks/probes/engine_thread_memory.py). glibc fixes its arena limit when the second arena is
  made, so this must run before any other thread allocates: `dynaspec/__init__.py` calls it
  first thing. (Ray's worker processes start threads before they import dynaspec; replicas get
  MALLOC_ARENA_MAX=1 in their environment instead.)
- `reuse_freed_memory` (the CPU runner, once its KV cache is allocated): allocations up to 1 GiB
  come from the heap and up to 1 GiB freed stays there for reuse. Whether the next step's
  logits reuse the last step's depends on the heap's layout: PyTorch allocates with 64-byte
  alignment, for which malloc asks a little more than the size, so a freed block pinned by a
  small allocation after it is just too small for the same request. In a fresh process with
  nothing else allocated, most 88 MB allocations still took fresh pages; in the README's main
  command the reuse gave 1.22x (the results diary, "Reused logits memory").

Both are no-ops off glibc (musl has no mallopt; macOS and Windows have neither) and with
DYNASPEC_MALLOC_DEFAULTS=1 in the environment, which leaves malloc as glibc sets it: for someone
short of memory (reuse keeps freed memory, +5% peak RSS on the README's main command)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

HEAP_BYTES = 1 << 30  # allocations up to this size come from malloc's heap, and this much freed stays
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
OPT_OUT = "DYNASPEC_MALLOC_DEFAULTS"  # set to 1: leave malloc as glibc sets it
ARENA_ENV = {"MALLOC_ARENA_MAX": "1"}  # the same as one_arena, read by glibc when a process starts


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded once (``find_library`` runs ldconfig: not something to repeat); None
    off Linux or where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def _mallopt_fn():
    """glibc's mallopt; None off glibc or with the opt-out set."""
    if os.environ.get(OPT_OUT, "") not in ("", "0"):
        return None
    return getattr(libc(), "mallopt", None)  # musl has none


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Apply (parameter, value) pairs with glibc's mallopt; whether all applied."""
    mallopt = _mallopt_fn()
    return mallopt is not None and all(mallopt(param, value) == 1 for param, value in settings)


@functools.cache
def one_arena() -> bool:
    """Every thread allocates from the main arena (see the module docstring). Returns whether it
    applied."""
    return _mallopt((M_ARENA_MAX, 1))


@functools.cache
def reuse_freed_memory() -> bool:
    """Have glibc's malloc serve allocations up to 1 GiB from its heap and keep up to 1 GiB freed
    there, for the whole process. By default it maps fresh pages for every allocation over 32 MiB
    (its ceiling for the threshold it adapts) and unmaps them at free, so a step's logits (rows x
    vocab x 4 bytes: 88 MB at 24 x 6 rows of a 151,936-token vocabulary) and the temporaries made
    from them faulted in 21,000 new pages each, every step: writing 88 MB took 24 ms, and 1 ms in
    reused memory (benchmarks/probes/logits_memory.py). The price: memory a step freed stays the
    process's (the README's main command peaked at 2095 MiB of RSS where it peaked at 1990). What
    PyTorch's CPU guides get from tcmalloc or jemalloc, without preloading a library. Returns
    whether it applied (glibc on Linux only)."""
    applied = _mallopt((M_MMAP_THRESHOLD, HEAP_BYTES), (M_TRIM_THRESHOLD, HEAP_BYTES))
    if not applied and _mallopt_fn() is not None:  # glibc, asked for, and it refused
        log.warning("mallopt refused the heap thresholds: large allocations keep mapping fresh pages")
    return applied


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the system now (glibc's malloc_trim): after a large
    allocation has moved elsewhere (the weights, to huge pages), whatever threshold is set. Returns
    whether it ran (glibc on Linux only, without the opt-out)."""
    trim = getattr(libc(), "malloc_trim", None) if _mallopt_fn() is not None else None
    if trim is None:
        return False
    trim(0)
    return True
