"""How fast one core reads memory in the access patterns of the quantized matmul's weight layouts
(issue 43: on zen5 a batch-1 Q4_K call streamed at 0.5-0.7x a plain read while the same loop on
weights held in cache ran 2x faster than memory). A small C++ loop, compiled here with g++ for this
CPU, reads 128 MiB a thread in 256-byte chunks (a Q4_K group of one 16-column tile):

- `one stream`: the chunks in address order (the layout since tiles are interleaved in pairs);
- `two streams`: a pair of tiles stored one after the other, 48 groups each (1,536 inputs), read a
  group of each in turn: two streams 12 KiB apart (the layout before);
- `two streams, prefetch D`: the same with a software prefetch D groups ahead in each stream;
- `one stream + scales`: one stream and a second, slow one of 32 bytes a chunk (scales apart).

GB/s of the best of 5 passes, 1 and 2 threads; JSON with --out.

    .venv/bin/python benchmarks/probes/read_streams.py [--threads 1,2] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

constexpr int64_t kGroups = 48, kChunk = 256, kPerThread = int64_t{128} << 20;

// pattern: 0 one stream, 1 two streams, 2 one stream + scales, >= 10: two streams, prefetch (p - 10)
int64_t read(const uint8_t* base, int pattern) {
  __m256i acc = _mm256_setzero_si256();
  auto eat = [&](const uint8_t* p) {
    for (int l = 0; l < kChunk; l += 32)
      acc = _mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i*)(p + l)));
  };
  const int64_t chunks = kPerThread / kChunk, tile = kGroups * kChunk;
  if (pattern == 0 || pattern == 2) {
    const uint8_t* scales = base + kPerThread;
    for (int64_t c = 0; c < chunks; ++c) {
      eat(base + c * kChunk);
      if (pattern == 2) acc = _mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i*)(scales + c * 32)));
    }
  } else {
    const int64_t ahead = pattern >= 10 ? pattern - 10 : 0;
    for (int64_t pair = 0; pair < kPerThread / (2 * tile); ++pair)
      for (int64_t g = 0; g < kGroups; ++g)
        for (int n = 0; n < 2; ++n) {
          const uint8_t* p = base + (2 * pair + n) * tile + g * kChunk;
          if (ahead > 0) {  // past the tile's end: the same tile of the next pair
            const uint8_t* f = g + ahead < kGroups ? p + ahead * kChunk : p + (ahead + kGroups) * kChunk;
            for (int l = 0; l < kChunk; l += 64) _mm_prefetch((const char*)f + l, _MM_HINT_T0);
          }
          eat(p);
        }
  }
  alignas(32) int32_t out[8];
  _mm256_store_si256((__m256i*)out, acc);
  return out[0];
}

int main(int argc, char** argv) {
  const int threads = atoi(argv[1]), pattern = atoi(argv[2]);
  std::vector<uint8_t*> buffers(threads);
  const int64_t bytes = kPerThread + kPerThread / 8 + 4096;
  for (auto& b : buffers) {
    b = static_cast<uint8_t*>(aligned_alloc(4096, bytes));
    memset(b, 1, bytes);
  }
  volatile int64_t sink = 0;
  double best = 0;
  for (int pass = 0; pass < 6; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) workers.emplace_back([&, t] { sink += read(buffers[t], pattern); });
    for (auto& w : workers) w.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (pass > 0 && threads * kPerThread / s / 1e9 > best) best = threads * kPerThread / s / 1e9;
  }
  printf("%.2f\n", best);
}
"""

PATTERNS = [
    ("one stream", 0),
    ("two streams", 1),
    ("two streams, prefetch 8", 18),
    ("two streams, prefetch 16", 26),
    ("one stream + scales", 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "streams.cpp", Path(tmp) / "streams"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", "-pthread", str(src), "-o", str(exe)], check=True)
        rows = []
        for name, code in PATTERNS:
            rates = [
                float(
                    subprocess.run(
                        [str(exe), str(t), str(code)], capture_output=True, text=True, check=True
                    ).stdout
                )
                for t in threads
            ]
            rows.append({"pattern": name, **{f"threads_{t}_gbs": r for t, r in zip(threads, rates)}})
    print(f"{'pattern':<28}" + "".join(f"{f'{t} thread(s) GB/s':>20}" for t in threads))
    for row in rows:
        print(f"{row['pattern']:<28}" + "".join(f"{row[f'threads_{t}_gbs']:>20.1f}" for t in threads))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "threads": threads}, indent=2))


if __name__ == "__main__":
    main()
