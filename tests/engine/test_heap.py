"""One malloc arena and the heap thresholds (dynaspec/heap.py), in fresh processes: a thread of its
own gets an 88 MB buffer (a 24 x 6-row verify pass's logits) from the main heap, whose freed memory
stays for reuse, where with glibc's defaults it gets fresh pages mapped for it and unmapped at free.
Whether a later allocation reuses those pages depends on the heap's layout (measured, not asserted:
benchmarks/probes/engine_thread_memory.py)."""

import os
import subprocess
import sys

import pytest

CHILD = """
import threading
import dynaspec  # one_arena, before any thread allocates
from dynaspec.heap import reuse_freed_memory
import torch

reuse_freed_memory()
where = []

def allocate():
    buf = torch.empty(24 * 6, 151936).fill_(1.0)
    heap = next(line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
    start, end = (int(x, 16) for x in heap.split("-"))
    where.append("heap" if start <= buf.data_ptr() < end else "mapped")

thread = threading.Thread(target=allocate)
thread.start()
thread.join()
print(where[0])
"""


def thread_allocates_from(**env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.split()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_engine_thread_allocates_from_the_main_heap_unless_opted_out():
    assert thread_allocates_from() == "heap"
    assert thread_allocates_from(DYNASPEC_MALLOC_DEFAULTS="1") == "mapped"
