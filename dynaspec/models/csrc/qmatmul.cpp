// Weight-only quantized matmul with int8 activations and AVX-512 (VNNI) integer dot products.
//
// Weights stay in their group-wise integer form (w = scale * code + offset, unsigned codes: 4-bit
// as nibbles, 5/6-bit as nibbles plus a plane of top bits, others one byte per code), laid out by
// the Python packer in tiles of 16 output columns: [tile][group][bytes], so one 512-bit register
// holds 4 consecutive codes of each of the 16 columns, which is what vpdpbusd consumes. Each activation row is quantized to int8 per group
// (scale = max|x| / 127). A group's weight tile is unpacked into registers once and then serves
// every row of the call, so the cost per extra row is a few integer dot products, not a re-read
// and re-unpack of the weights.
//
// With AMX (amx_int8), blocks of 16 rows go through tile dot products instead (tdpbsud: int8
// activations x uint8 codes, one group per tile product); both paths produce the same exact int32
// sum per group and apply the same float epilogue, so which one runs never changes a result.
//
// Batch invariance: a row's result depends only on that row (its own quantization, integer sums
// that are exact, then a float epilogue per group in a fixed group order), never on how many rows
// share the call or how columns are split between threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DYNASPEC_AVX512 1
#else
#define DYNASPEC_AVX512 0
#endif
#if DYNASPEC_AVX512 && defined(__AVX512VNNI__)
#define DYNASPEC_AVX512_VNNI 1
#else
#define DYNASPEC_AVX512_VNNI 0
#endif
#if DYNASPEC_AVX512_VNNI && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define DYNASPEC_AMX 1
#else
#define DYNASPEC_AMX 0
#endif

namespace {

constexpr int kLanes = 16;      // output columns per tile: one register of int32 or float
constexpr int kTilesPerStep = 2;  // tiles computed together (the packer pads columns to a multiple)

constexpr int kRowBlock = 16;  // activation codes are stored in blocks of 16 rows (one AMX tile)

// Slot of tile `tile`, group g (or super-block) among a weight's [tiles, groups] codes or scales.
// Tiles are stored in pairs (kTilesPerStep: what the kernels compute together), the pair's tiles
// interleaved group by group: codes [tiles / 2, groups, 2, bytes], scales [tiles / 2, groups, 2,
// fields, 16]. A thread's share of the columns is then one sequential stream of codes and one of
// scales. Stored one tile after the other, a pair was two streams 12 KB apart (the 1.5B's 1,536
// inputs), which the hardware prefetchers followed at half the rate of one (zen5, one core,
// benchmarks/probes/read_streams.py: 16.5 GB/s against 33.8).
inline int64_t tile_slot(int64_t tile, int64_t g, int64_t groups) {
  return ((tile / kTilesPerStep) * groups + g) * kTilesPerStep + tile % kTilesPerStep;
}

// Offset of row r, group g in the blocked activation codes [rows / 16, groups, 16, G]: an AMX
// activation tile is then 16 * G contiguous bytes.
template <int G>
inline int64_t xq_at(int64_t r, int64_t g, int64_t groups) {
  return ((r / kRowBlock) * groups + g) * kRowBlock * G + (r % kRowBlock) * G;
}

// How a tile's per-group scales and offsets are stored (the packer picks the smallest exact one):
// float32 per group; float16 per group (the legacy GGUF types, whose d and m are f16); or the
// K-quants' two levels, float32 (d, dmin) per super-block times int8 (sc, m) per group. The
// symmetric types (Q4_0, Q5_0, Q8_0, Q6_K: codes centred on zero) store no offsets: theirs is
// the scale times -2^(bits-1), which the kernel computes, exactly (a power of two), so a weight
// streams a third or half fewer scale bytes and gives the same bits.
enum ScaleMode : int64_t { kScaleF32 = 0, kScaleF16 = 1, kScaleSuper = 2, kScaleF16Sym = 3, kScaleSuperSym = 4 };

constexpr int64_t scale_fields(int64_t mode) { return mode == kScaleF16Sym || mode == kScaleSuperSym ? 1 : 2; }

struct ScaleTable {
  const float* f32;     // kScaleF32: [tiles, groups, 2, 16]; kScaleSuper(Sym): [tiles, supers, 2 (1), 16]
  const uint16_t* f16;  // kScaleF16(Sym): [tiles, groups, 2 (1), 16]
  const int8_t* sub;    // kScaleSuper(Sym): [tiles, groups, 2 (1), 16]
  int64_t groups;
  int64_t super_groups;  // groups per super-block (kScaleSuper)
  int64_t supers;        // super-blocks per tile (kScaleSuper)
  float neg_shift;       // the symmetric modes' offset per unit of scale: -2^(bits-1)
  int64_t super_shift;   // log2(super_groups) when a power of two (every K-quant), else -1
};

// The super-block of group g: a shift, not a 64-bit division, in the loops that ask per group and
// tile (the division cost 3-8% of a 1-16 row AVX2 call on zen3, in a standalone loop).
inline int64_t super_of(const ScaleTable& t, int64_t g) {
  return t.super_shift >= 0 ? g >> t.super_shift : g / t.super_groups;
}

// Bytes of one tile and group of packed codes. 4 bits: two steps per byte (step s in the low
// nibble, step s + steps / 2 in the high one); 5 and 6 bits: those nibbles, then one 64-byte plane
// holding each step's top bits (5 bits: bit s of each byte is step s's fifth bit; 6 bits: bits
// 2s..2s+1 are step s's top two bits); 8 bits: one byte per code.
template <int BITS, int G>
constexpr int tile_bytes() {
  return BITS == 8 ? kLanes * G : BITS == 4 ? kLanes * G / 2 : kLanes * G / 2 + 64;
}

// Weights stream from memory once per call, so each tile's codes are prefetched this many groups
// ahead: a single core's loop otherwise waited on memory (rows=1 over 98 MB of Q4_K layers, 2
// threads: 32 GB/s without, 42 with, against 46 for a plain sum over memory; 4 and 16 groups
// ahead gave 39-41, 32 gave 35).
constexpr int kPrefetchGroups = 8;

// The same distance in bytes of a pair's stream (tile_slot), which runs on into the next pair's.
template <int kTileBytes>
constexpr int64_t kPrefetchBytes = int64_t{kPrefetchGroups} * kTilesPerStep * kTileBytes;

template <int kBytes>
inline void prefetch_group(const uint8_t* p) {
  for (int line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// A tile pair's loop (tile_step) takes a call's rows this many at a time (run): each group's
// decoded codes then serve a chunk whose sums (64 x 32 floats, 8 KiB) and activation codes stay in
// L1, where all 512 rows of a prefill chunk sent both through L2 once per group. A tile pair's
// codes (29 KiB at 1,536 inputs) are read again per chunk from cache. The same operations per row
// in the same order: the same bits.
constexpr int64_t kRowChunk = 64;

// Each tile pair reads every row's activation codes once per group. Where all rows' codes outgrow
// the L3 (AVX2's broadcast form holds 8 bytes a code: 36 MB for a prefill chunk of 512 rows of the
// 1.5B's 8,960-input down projection), every tile pair read them from memory: the down projection
// took 1.2x the time of gate/up, which has twice its weights. So a call's rows go in parts whose
// codes fit this many bytes, each part over every tile pair (the weights read once per part).
// With 1-byte codes (AVX-512) a prefill chunk is one part.
constexpr int64_t kXqPartBytes = int64_t{16} << 20;

// Without VNNI (the AVX2 half, AVX-512 without VNNI) dot products go through vpmaddubsw: the steps
// whose int16 partial sums cannot saturate, each adding at most 2 x (2^bits - 1) x 127 (8-bit codes
// go as two nibbles, so as 4-bit ones).
constexpr int int16_steps(int bits) { return bits == 5 ? 4 : bits == 6 ? 2 : 8; }

// The ISA-specific half: AVX-512 (with VNNI and AMX where the compiler targets them) else AVX2
// (qmatmul_avx2.h). Both read the same packed layout and give the same bits. AVX-512 without VNNI
// (Skylake-SP/X: AVX-512BW) forms each dot product as the AVX2 half does, on 512 bits (group_dot).
#if DYNASPEC_AVX512

constexpr int kXqBytes = 1;  // bytes of xq per activation code (see xq_at)

// x [rows, in] float32 -> xq (blocked int8 codes, see xq_at), xs [rows, groups] (the group's
// scale), xc [rows, groups] (scale * sum of the group's codes, which the offsets multiply).
template <int G>
void quantize_rows(const float* x, int64_t rows, int64_t n_in, int8_t* xq, float* xs, float* xc) {
  const int64_t groups = n_in / G;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* p = x + r * n_in + g * G;
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < G; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(p + i)));
        const float m = _mm512_reduce_max_ps(amax);
        const float scale = m / 127.0f;
        const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
        int32_t sum = 0;
        for (int i = 0; i < G; i += 16) {
          const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + i), inv));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + xq_at<G>(r, g, groups) + i), _mm512_cvtsepi32_epi8(q));
          sum += _mm512_reduce_add_epi32(q);
        }
        xs[r * groups + g] = scale;
        xc[r * groups + g] = scale * static_cast<float>(sum);
      }
    }
  });
}

// The int8 sub-scales of one group, widened to float32.
inline __m512 sub_scales(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The scales (vs) and offsets (vo) of one tile and group, as float32; the same values in every mode.
// sup: the group's super-block, g / super_groups (kScaleSuper), which a loop over g can count
// instead of dividing.
template <int MODE>
inline void load_scales(const ScaleTable& t, int64_t tile, int64_t g, int64_t sup, __m512& vs, __m512& vo) {
  constexpr int64_t kFields = scale_fields(MODE);
  const int64_t at = tile_slot(tile, g, t.groups) * kFields * kLanes;  // this group's first field
  const int64_t at_super = tile_slot(tile, sup, t.supers) * kFields * kLanes;  // the K-quants' super-block
  if constexpr (MODE == kScaleF32) {
    vs = _mm512_loadu_ps(t.f32 + at);
    vo = _mm512_loadu_ps(t.f32 + at + kLanes);
  } else if constexpr (MODE == kScaleF16) {
    vs = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.f16 + at)));
    vo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.f16 + at + kLanes)));
  } else if constexpr (MODE == kScaleSuper) {
    vs = _mm512_mul_ps(_mm512_loadu_ps(t.f32 + at_super), sub_scales(t.sub + at));
    vo = _mm512_mul_ps(_mm512_loadu_ps(t.f32 + at_super + kLanes), sub_scales(t.sub + at + kLanes));
  } else {  // symmetric: the offset is the scale times -2^(b-1), exactly; for a K-quant,
            // (d * -2^(b-1)) * sc, as the two-field form has it, is (d * sc) * -2^(b-1) to the bit
    if constexpr (MODE == kScaleF16Sym) {
      vs = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.f16 + at)));
    } else {
      vs = _mm512_mul_ps(_mm512_loadu_ps(t.f32 + at_super), sub_scales(t.sub + at));
    }
    vo = _mm512_mul_ps(vs, _mm512_set1_ps(t.neg_shift));
  }
}

// One group's contribution to a row's 16 outputs: acc + scale * (dot * xs) + offset * xc. Every
// path ends each group with exactly these operations, in this order.
inline __m512 epilogue(__m512 acc, __m512i dot, __m512 scale, __m512 offset, float xs, float xc) {
  acc = _mm512_fmadd_ps(scale, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs)), acc);
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(xc), acc);
}

// The codes of one tile and group as vpdpbusd/tdpbsud operands: v[step] = [16 columns][4 codes].
template <int BITS, int G>
inline void decode_codes(const uint8_t* wp, __m512i (&v)[G / 4]) {
  constexpr int kSteps = G / 4;
  static_assert(BITS == 4 || BITS == 8 || (BITS == 5 && kSteps <= 8) || (BITS == 6 && kSteps <= 4), "unsupported packing");
  if constexpr (BITS == 8) {
    for (int s = 0; s < kSteps; ++s) v[s] = _mm512_loadu_si512(wp + 64 * s);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < kSteps / 2; ++i) {
      const __m512i raw = _mm512_loadu_si512(wp + 64 * i);
      v[i] = _mm512_and_si512(raw, low);
      v[i + kSteps / 2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    if constexpr (BITS > 4) {
      constexpr int kWidthBits = BITS - 4;
      const __m512i plane = _mm512_loadu_si512(wp + 32 * kSteps);
      const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << kWidthBits) - 1) << 4));
      for (int s = 0; s < kSteps; ++s) {  // move the field at bit pos to bit 4 (16-bit shifts, then mask)
        const int pos = kWidthBits * s;
        const __m512i moved = pos <= 4 ? _mm512_slli_epi16(plane, 4 - pos) : _mm512_srli_epi16(plane, pos - 4);
        v[s] = _mm512_or_si512(v[s], _mm512_and_si512(moved, mask));
      }
    }
  }
}

// The same, stored for a tile load: [kSteps][64] bytes.
template <int BITS, int G>
inline void unpack_group(const uint8_t* wp, uint8_t* dst) {
  __m512i v[G / 4];
  decode_codes<BITS, G>(wp, v);
  for (int s = 0; s < G / 4; ++s) _mm512_store_si512(dst + 64 * s, v[s]);
}

// The 4 activation codes of step s of a group (xr: the group's first), in every int32 lane.
inline __m512i xstep(const int8_t* xr, int s) {
  int32_t four;
  std::memcpy(&four, xr + 4 * s, 4);
  return _mm512_set1_epi32(four);
}

#if !DYNASPEC_AVX512_VNNI
// The int16 products of steps [c0, c0 + n) of codes v with the row's activation codes, added pairwise
// (a tree, not a chain of adds); f: the codes of a step as vpmaddubsw's unsigned operand.
template <int N, typename F>
inline __m512i int16_sum(const int8_t* xr, int c0, F f) {
  __m512i p[N];
  for (int s = 0; s < N; ++s) p[s] = _mm512_maddubs_epi16(f(c0 + s), xstep(xr, c0 + s));
  for (int width = N / 2; width > 0; width /= 2)
    for (int s = 0; s < width; ++s) p[s] = _mm512_add_epi16(p[s], p[s + width]);
  return p[0];
}
#endif

// Exact int32 sums, per column of a tile, of one group's codes (v, decode_codes) times one row's
// activation codes (xr). With VNNI: vpdpbusd in two chains. Without: vpmaddubsw (pairs into int16,
// in chunks that cannot saturate) then vpmaddwd (pairs into int32), as the AVX2 half on 512 bits.
// The sums are the same integers either way.
template <int BITS, int G>
inline __m512i group_dot(const __m512i (&v)[G / 4], const int8_t* xr) {
  constexpr int kSteps = G / 4;
#if DYNASPEC_AVX512_VNNI
  static_assert(kSteps % 2 == 0, "two chains take the steps in pairs");
  __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
  for (int s = 0; s < kSteps; s += 2) {
    d0 = _mm512_dpbusd_epi32(d0, v[s], xstep(xr, s));
    d1 = _mm512_dpbusd_epi32(d1, v[s + 1], xstep(xr, s + 1));
  }
  return _mm512_add_epi32(d0, d1);
#else
  constexpr int kChunk = int16_steps(BITS) < kSteps ? int16_steps(BITS) : kSteps;
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i acc = _mm512_setzero_si512();
  if constexpr (BITS == 8) {  // u = 16 * (u >> 4) + (u & 15): two 4-bit dot products
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c0 = 0; c0 < kSteps; c0 += kChunk) {
      const __m512i hi = int16_sum<kChunk>(xr, c0, [&](int s) { return _mm512_and_si512(_mm512_srli_epi16(v[s], 4), low); });
      const __m512i lo = int16_sum<kChunk>(xr, c0, [&](int s) { return _mm512_and_si512(v[s], low); });
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(hi, _mm512_set1_epi16(16)));
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(lo, ones));
    }
  } else {
    for (int c0 = 0; c0 < kSteps; c0 += kChunk)
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(int16_sum<kChunk>(xr, c0, [&](int s) { return v[s]; }), ones));
  }
  return acc;
#endif
}

// R rows (1-3: a batch-1 decode, a speculative verify of a few positions): tile_step's operations
// for r_end = r0 + R, with the accumulators in registers instead of memory and each group's dot
// product from group_dot (with VNNI two chains of vpdpbusd; the int32 sums are exact, so the result
// is the same to the bit). With VNNI a single row's loop was bound by those dependency chains, not
// by memory, and so were two rows through tile_step's general loop (1.15-1.2x the time they take
// here); the limit of 3 rows was measured there, not on a CPU without VNNI.
template <int BITS, int G, int MODE, int R>
void tile_step_rows(const uint8_t* w, const ScaleTable& st, int64_t tile, int64_t groups, const int8_t* xq,
                    const float* xs, const float* xc, int64_t r0, float* acc) {
  constexpr int kSteps = G / 4;
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  constexpr int kWidth = kTilesPerStep * kLanes;
  static_assert(R >= 1 && R <= 3, "the accumulators of up to three rows stay in registers");
  __m512 a[kTilesPerStep][R];
  for (int n = 0; n < kTilesPerStep; ++n)
    for (int r = 0; r < R; ++r) a[n][r] = _mm512_setzero_ps();
  for (int64_t g = 0, sup = 0, in_sup = 0; g < groups; ++g) {
    for (int n = 0; n < kTilesPerStep; ++n) {
      const uint8_t* wg = w + tile_slot(tile + n, g, groups) * kTileBytes;
      prefetch_group<kTileBytes>(wg + kPrefetchBytes<kTileBytes>);
      __m512i wv[kSteps];
      decode_codes<BITS, G>(wg, wv);
      __m512 vs, vo;
      load_scales<MODE>(st, tile + n, g, sup, vs, vo);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * groups + g;
        a[n][r] = epilogue(a[n][r], group_dot<BITS, G>(wv, xq + xq_at<G>(r0 + r, g, groups)), vs, vo, xs[rg], xc[rg]);
      }
    }
    if (++in_sup == st.super_groups) in_sup = 0, ++sup;
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < kTilesPerStep; ++n) _mm512_storeu_ps(acc + r * kWidth + n * kLanes, a[n][r]);
}

// One row (a batch-1 decode).
template <int BITS, int G, int MODE>
void tile_step_row(const uint8_t* w, const ScaleTable& st, int64_t tile, int64_t groups, const int8_t* xq,
                   const float* xs, const float* xc, int64_t r, float* acc) {
  tile_step_rows<BITS, G, MODE, 1>(w, st, tile, groups, xq, xs, xc, r, acc);
}

// Up to this many rows go through tile_step_rows as one block (batch 1 verifying K = 1 or 2
// drafts); more take the general loop, which decodes each tile once for all its rows. On the xeon
// (2 threads, the 1.5B's shapes) 2 rows took 0.83-0.87x the general loop's time. Blocks of three
// and two for 4-8 rows looked faster on weights held in cache (qmm_rows.py) but were slower on
// weights streamed from memory, as in a model's pass, each block decoding the tiles again
// (qmm_stream.py, 4 rounds alternating: Q6_K 8 rows 1,795 against 2,103 us a layer, Q6_K 4 rows
// 1,522 against 1,667), and engine decode at batch 8 ran 81.5 tok/s with this limit against 70.5.
constexpr int64_t kRegisterRowsMax = 3;

// Columns of tiles [tile, tile + kTilesPerStep) for rows [r_begin, r_end): acc [r_end - r_begin, 32].
template <int BITS, int G, int MODE>
void tile_step(const uint8_t* w, const ScaleTable& st, int64_t tile, int64_t groups,
               const int8_t* xq, const float* xs, const float* xc, int64_t r_begin, int64_t r_end, float* acc) {
  constexpr int kSteps = G / 4;  // vpdpbusd steps per group: 4 codes of each column per step
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  constexpr int kWidth = kTilesPerStep * kLanes;
  if (r_end - r_begin <= kRegisterRowsMax) {
    for (int64_t r = r_begin; r < r_end;) {
      float* ar = acc + (r - r_begin) * kWidth;
      const int64_t left = r_end - r;
      if (left >= 3) {
        tile_step_rows<BITS, G, MODE, 3>(w, st, tile, groups, xq, xs, xc, r, ar);
        r += 3;
      } else if (left >= 2) {
        tile_step_rows<BITS, G, MODE, 2>(w, st, tile, groups, xq, xs, xc, r, ar);
        r += 2;
      } else {
        tile_step_rows<BITS, G, MODE, 1>(w, st, tile, groups, xq, xs, xc, r, ar);
        r += 1;
      }
    }
    return;
  }
  std::memset(acc, 0, sizeof(float) * (r_end - r_begin) * kWidth);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[kTilesPerStep][kSteps];
    __m512 vs[kTilesPerStep], vo[kTilesPerStep];
    for (int n = 0; n < kTilesPerStep; ++n) {
      const uint8_t* wg = w + tile_slot(tile + n, g, groups) * kTileBytes;
      prefetch_group<kTileBytes>(wg + kPrefetchBytes<kTileBytes>);
      decode_codes<BITS, G>(wg, wv[n]);
      load_scales<MODE>(st, tile + n, g, super_of(st, g), vs[n], vo[n]);
    }
    for (int64_t r = r_begin; r < r_end; ++r) {
      const int8_t* xr = xq + xq_at<G>(r, g, groups);
      __m512i dot[kTilesPerStep];
#if DYNASPEC_AVX512_VNNI  // the tiles' chains side by side, each step's activations broadcast once
      for (int n = 0; n < kTilesPerStep; ++n) dot[n] = _mm512_setzero_si512();
      for (int s = 0; s < kSteps; ++s) {
        const __m512i xb = xstep(xr, s);
        for (int n = 0; n < kTilesPerStep; ++n) dot[n] = _mm512_dpbusd_epi32(dot[n], wv[n][s], xb);
      }
#else
      for (int n = 0; n < kTilesPerStep; ++n) dot[n] = group_dot<BITS, G>(wv[n], xr);
#endif
      float* ar = acc + (r - r_begin) * kWidth;
      for (int n = 0; n < kTilesPerStep; ++n) {
        const __m512 a = _mm512_loadu_ps(ar + n * kLanes);
        _mm512_storeu_ps(ar + n * kLanes, epilogue(a, dot[n], vs[n], vo[n], xs[r * groups + g], xc[r * groups + g]));
      }
    }
  }
}

#if DYNASPEC_AMX
constexpr int kAmxRows = kRowBlock;  // rows per tile product (the activation tile's height)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Asks the kernel for the AMX tile state once per process (Linux arch_prctl); false if refused.
bool amx_ready() {
  static bool ready = false;
  static std::once_flag once;
  std::call_once(once, [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    ready = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return ready;
}

// Tile `tile` (16 columns) for rows [r0, r0 + 16) of the zero-padded xq: acc [16, 16] float32.
// Tiles 0-3: int32 sums [16 rows, 16 columns] of four consecutive groups; 4-5: activations
// [16 rows, G]; 6-7: codes [G / 4, 64]. Four groups are in flight at once so the tile unit's
// latency overlaps; each group's sums still get the shared epilogue, in group order.
template <int BITS, int G, int MODE>
void amx_block(const uint8_t* w, const ScaleTable& st, int64_t tile, int64_t groups, const int8_t* xq,
               const float* xs, const float* xc, int64_t r0, uint8_t* codes, int32_t* sums, float* acc) {
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  constexpr int kCodeBytes = 64 * (G / 4);
  constexpr int kChunk = 4;
  __m512 a[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) a[r] = _mm512_setzero_ps();
  const int8_t* xb = xq + xq_at<G>(r0, 0, groups);
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int chunk = static_cast<int>(std::min<int64_t>(kChunk, groups - g0));
    for (int j = 0; j < chunk; ++j)
      unpack_group<BITS, G>(w + tile_slot(tile, g0 + j, groups) * kTileBytes, codes + j * kCodeBytes);
    if (chunk == kChunk) {
      _tile_loadd(4, xb + (g0 + 0) * kRowBlock * G, G);
      _tile_loadd(6, codes + 0 * kCodeBytes, 64);
      _tile_zero(0);
      _tile_dpbsud(0, 4, 6);
      _tile_loadd(5, xb + (g0 + 1) * kRowBlock * G, G);
      _tile_loadd(7, codes + 1 * kCodeBytes, 64);
      _tile_zero(1);
      _tile_dpbsud(1, 5, 7);
      _tile_loadd(4, xb + (g0 + 2) * kRowBlock * G, G);
      _tile_loadd(6, codes + 2 * kCodeBytes, 64);
      _tile_zero(2);
      _tile_dpbsud(2, 4, 6);
      _tile_loadd(5, xb + (g0 + 3) * kRowBlock * G, G);
      _tile_loadd(7, codes + 3 * kCodeBytes, 64);
      _tile_zero(3);
      _tile_dpbsud(3, 5, 7);
      _tile_stored(0, sums + 0 * kAmxRows * kLanes, 64);
      _tile_stored(1, sums + 1 * kAmxRows * kLanes, 64);
      _tile_stored(2, sums + 2 * kAmxRows * kLanes, 64);
      _tile_stored(3, sums + 3 * kAmxRows * kLanes, 64);
    } else {
      for (int j = 0; j < chunk; ++j) {
        _tile_loadd(4, xb + (g0 + j) * kRowBlock * G, G);
        _tile_loadd(6, codes + j * kCodeBytes, 64);
        _tile_zero(0);
        _tile_dpbsud(0, 4, 6);
        _tile_stored(0, sums + j * kAmxRows * kLanes, 64);
      }
    }
    for (int j = 0; j < chunk; ++j) {
      __m512 vs, vo;
      load_scales<MODE>(st, tile, g0 + j, super_of(st, g0 + j), vs, vo);
      const int32_t* sj = sums + j * kAmxRows * kLanes;
#pragma GCC unroll 16
      for (int r = 0; r < kAmxRows; ++r) {
        const int64_t rg = (r0 + r) * groups + g0 + j;
        a[r] = epilogue(a[r], _mm512_load_si512(sj + r * kLanes), vs, vo, xs[rg], xc[rg]);
      }
    }
  }
  for (int r = 0; r < kAmxRows; ++r) _mm512_storeu_ps(acc + r * kLanes, a[r]);
}

template <int BITS, int G, int MODE>
void run_amx(const int8_t* xq, const float* xs, const float* xc, int64_t rows, int64_t amx_rows, int64_t n_in,
             const uint8_t* w, const ScaleTable& st, int64_t tiles, int64_t n_out, float* out) {
  const int64_t groups = n_in / G;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    TileConfig cfg;
    for (int i = 0; i < 4; ++i) cfg.rows[i] = kAmxRows, cfg.colsb[i] = 64;
    for (int i = 4; i < 6; ++i) cfg.rows[i] = kAmxRows, cfg.colsb[i] = G;
    for (int i = 6; i < 8; ++i) cfg.rows[i] = G / 4, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) uint8_t codes[4 * 64 * (G / 4)];
    alignas(64) int32_t sums[4 * kAmxRows * kLanes];
    alignas(64) float acc[kAmxRows * kLanes];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t col0 = t * kLanes;
      const int64_t width = std::min<int64_t>(kLanes, n_out - col0);
      if (width <= 0) continue;
      for (int64_t r0 = 0; r0 < amx_rows; r0 += kAmxRows) {
        amx_block<BITS, G, MODE>(w, st, t, groups, xq, xs, xc, r0, codes, sums, acc);
        for (int64_t r = r0; r < std::min(rows, r0 + kAmxRows); ++r)
          std::memcpy(out + r * n_out + col0, acc + (r - r0) * kLanes, sizeof(float) * width);
      }
    }
    _tile_release();
  });
}
#endif  // DYNASPEC_AMX

#else
#include "qmatmul_avx2.h"
#endif  // DYNASPEC_AVX512

template <int BITS, int G, int MODE>
void run(const at::Tensor& xf, const at::Tensor& w, const ScaleTable& st, int64_t tiles, at::Tensor& out,
         int64_t amx_min_rows) {
  const int64_t rows = xf.size(0), n_in = xf.size(1), n_out = out.size(1);
  const int64_t groups = n_in / G;
  // rows padded (with zeros) to whole AMX blocks; the padding rows are computed and dropped
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<int8_t> xq(padded_rows * n_in * kXqBytes, 0);
  std::vector<float> xs(padded_rows * groups, 0.0f), xc(padded_rows * groups, 0.0f);
  quantize_rows<G>(xf.data_ptr<float>(), rows, n_in, xq.data(), xs.data(), xc.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  // Rows [0, amx_rows) go through AMX tiles in blocks of 16, the rest through the VNNI loop: whole
  // blocks where the remainder is too short to be worth a padded block.
  int64_t amx_rows = 0;
#if DYNASPEC_AMX
  if (rows >= amx_min_rows && amx_ready()) {
    const int64_t full = rows / kRowBlock * kRowBlock;
    amx_rows = rows - full >= amx_min_rows ? padded_rows : full;
    run_amx<BITS, G, MODE>(xq.data(), xs.data(), xc.data(), rows, amx_rows, n_in, wp, st, tiles, n_out, op);
  }
#endif
  if (amx_rows >= rows) return;
  constexpr int kWidth = kTilesPerStep * kLanes;
  // rows in parts whose activation codes fit kXqPartBytes, each part over every tile pair, and
  // each tile pair's call over a part in chunks of kRowChunk rows
  const int64_t part = std::max<int64_t>(kRowChunk, kXqPartBytes / (n_in * kXqBytes) / kRowChunk * kRowChunk);
  for (int64_t c0 = amx_rows; c0 < rows; c0 += part) {
    const int64_t c1 = std::min(c0 + part, rows);
    at::parallel_for(0, tiles / kTilesPerStep, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> acc((c1 - c0) * kWidth);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t tile = p * kTilesPerStep;
        for (int64_t r = c0; r < c1; r += kRowChunk) {
          const int64_t r1 = std::min(r + kRowChunk, c1);
          float* ar = acc.data() + (r - c0) * kWidth;
          if (r1 - r == 1)
            tile_step_row<BITS, G, MODE>(wp, st, tile, groups, xq.data(), xs.data(), xc.data(), r, ar);
          else
            tile_step<BITS, G, MODE>(wp, st, tile, groups, xq.data(), xs.data(), xc.data(), r, r1, ar);
        }
        const int64_t col0 = tile * kLanes;
        const int64_t width = std::min<int64_t>(kWidth, n_out - col0);
        if (width <= 0) continue;
        for (int64_t r = c0; r < c1; ++r)
          std::memcpy(op + r * n_out + col0, acc.data() + (r - c0) * kWidth, sizeof(float) * width);
      }
    });
  }
}

template <int BITS, int G>
void dispatch_mode(const at::Tensor& xf, const at::Tensor& w, const ScaleTable& st, int64_t mode, int64_t tiles,
                   at::Tensor& out, int64_t amx_min_rows) {
  if (mode == kScaleF32) run<BITS, G, kScaleF32>(xf, w, st, tiles, out, amx_min_rows);
  else if (mode == kScaleF16) run<BITS, G, kScaleF16>(xf, w, st, tiles, out, amx_min_rows);
  else if (mode == kScaleSuper) run<BITS, G, kScaleSuper>(xf, w, st, tiles, out, amx_min_rows);
  else if (mode == kScaleF16Sym) run<BITS, G, kScaleF16Sym>(xf, w, st, tiles, out, amx_min_rows);
  else run<BITS, G, kScaleSuperSym>(xf, w, st, tiles, out, amx_min_rows);
}

}  // namespace

namespace dynaspec_ops {

// x [rows, in] (float32/bfloat16/float16); w [tiles / 2, groups, 2, tile bytes] uint8 (pack_tiles)
// -> [rows, n_out] float32. Scales by mode, each [tiles / 2, groups or supers, 2, fields, 16] (the
// pairs interleaved as the codes, tile_slot): kScaleF32: f32 (scale, offset), sub empty; kScaleF16:
// f32 empty, sub int16 (f16 bits); kScaleSuper: f32 per super-block (d, dmin), sub int8 per group
// (sc, m); kScaleF16Sym and kScaleSuperSym: the same with the second field (the offset) left out.
// amx_min_rows: calls with at least this many rows use AMX tiles where available (same results).
at::Tensor qmm_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& f32, const at::Tensor& sub,
                    int64_t n_out, int64_t group, int64_t bits, int64_t mode, int64_t super_groups,
                    int64_t amx_min_rows) {
  TORCH_CHECK(x.dim() == 2, "qmm_vnni: x must be [rows, in]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == kTilesPerStep && w.scalar_type() == at::kByte && w.is_contiguous(),
              "qmm_vnni: w must be contiguous uint8 [tiles / 2, groups, 2, bytes]");
  TORCH_CHECK(f32.scalar_type() == at::kFloat && f32.is_contiguous() && sub.is_contiguous(), "qmm_vnni: bad scale tensors");
  const int64_t tiles = w.size(0) * kTilesPerStep, groups = w.size(1);
  TORCH_CHECK(tiles % kTilesPerStep == 0 && tiles * kLanes >= n_out, "qmm_vnni: bad tile count");
  TORCH_CHECK(x.size(1) == groups * group, "qmm_vnni: x's width does not match the packed weight");
  ScaleTable st{nullptr, nullptr, nullptr, groups, std::max<int64_t>(super_groups, 1), 0,
                -static_cast<float>(int64_t{1} << (bits - 1)), -1};
  st.supers = (groups + st.super_groups - 1) / st.super_groups;
  if ((st.super_groups & (st.super_groups - 1)) == 0) st.super_shift = __builtin_ctzll(st.super_groups);
  TORCH_CHECK(mode >= kScaleF32 && mode <= kScaleSuperSym, "qmm_vnni: unknown scale mode ", mode);
  const int64_t fields = scale_fields(mode);
  if (mode == kScaleF32) {
    TORCH_CHECK(f32.numel() == tiles * groups * 2 * kLanes, "qmm_vnni: bad f32 scales");
    st.f32 = f32.data_ptr<float>();
  } else if (mode == kScaleF16 || mode == kScaleF16Sym) {
    TORCH_CHECK(sub.scalar_type() == at::kShort && sub.numel() == tiles * groups * fields * kLanes, "qmm_vnni: bad f16 scales");
    st.f16 = reinterpret_cast<const uint16_t*>(sub.data_ptr<int16_t>());
  } else {
    TORCH_CHECK(f32.numel() == tiles * st.supers * fields * kLanes, "qmm_vnni: bad super-block scales");
    TORCH_CHECK(sub.scalar_type() == at::kChar && sub.numel() == tiles * groups * fields * kLanes, "qmm_vnni: bad sub-scales");
    st.f32 = f32.data_ptr<float>();
    st.sub = sub.data_ptr<int8_t>();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n_out}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return out;
  if (bits == 4 && group == 32) dispatch_mode<4, 32>(xf, w, st, mode, tiles, out, amx_min_rows);
  else if (bits == 4 && group == 16) dispatch_mode<4, 16>(xf, w, st, mode, tiles, out, amx_min_rows);
  else if (bits == 8 && group == 32) dispatch_mode<8, 32>(xf, w, st, mode, tiles, out, amx_min_rows);
  else if (bits == 8 && group == 16) dispatch_mode<8, 16>(xf, w, st, mode, tiles, out, amx_min_rows);
  else if (bits == 5 && group == 32) dispatch_mode<5, 32>(xf, w, st, mode, tiles, out, amx_min_rows);
  else if (bits == 6 && group == 16) dispatch_mode<6, 16>(xf, w, st, mode, tiles, out, amx_min_rows);
  else TORCH_CHECK(false, "qmm_vnni: unsupported bits/group ", bits, "/", group);
  return out;
}

// codes [out, in] (uint8, or int8 shifted up by `shift` to unsigned) -> the tile layout qmm_vnni
// reads, [tiles / 2, groups, 2, bytes] uint8 (tile_slot), tiles = (out + pad) / 16 with the pad rows
// zero. Per tile and group, step s (4 consecutive codes of each of 16 columns) is 64 bytes
// [lane * 4 + code]; for bits < 8 the low nibbles of steps s and s + steps/2 share a byte (low,
// high), and for 5/6 bits a last 64-byte plane holds each step's top bits at bit s * (bits - 4).
at::Tensor pack_tiles(const at::Tensor& codes, int64_t shift, int64_t bits, int64_t group, int64_t pad) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "pack_tiles: codes must be contiguous [out, in]");
  TORCH_CHECK(codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar, "pack_tiles: codes must be 8-bit");
  const int64_t out = codes.size(0), n_in = codes.size(1);
  TORCH_CHECK(group % 8 == 0 && n_in % group == 0 && (out + pad) % (kLanes * kTilesPerStep) == 0, "pack_tiles: shapes");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "pack_tiles: bits");
  const int64_t tiles = (out + pad) / kLanes, groups = n_in / group, steps = group / 4;
  const int64_t bytes = bits == 8 ? steps * 64 : steps / 2 * 64 + (bits > 4 ? 64 : 0);
  at::Tensor packed = at::zeros({tiles / kTilesPerStep, groups, kTilesPerStep, bytes}, codes.options().dtype(at::kByte));
  const uint8_t* src = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int width = static_cast<int>(bits) - 4;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    uint8_t u[64 * 64];  // [step][lane * 4 + code] of one group (steps <= 64)
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          const int64_t row = t * kLanes + lane;
          uint8_t* ul = u + lane * 4;
          if (row >= out) {
            for (int64_t s = 0; s < steps; ++s) std::memset(ul + s * 64, 0, 4);
            continue;
          }
          const uint8_t* in = src + row * n_in + g * group;
          const uint8_t sh = static_cast<uint8_t>(shift);
          for (int64_t s = 0; s < steps; ++s)  // 4 consecutive codes of this column per 64-byte step
            for (int c = 0; c < 4; ++c) ul[s * 64 + c] = static_cast<uint8_t>(in[s * 4 + c] + sh);
        }
        uint8_t* o = dst + tile_slot(t, g, groups) * bytes;
        if (bits == 8) {
          std::memcpy(o, u, steps * 64);
          continue;
        }
        const int64_t half = steps / 2;
        for (int64_t s = 0; s < half; ++s)
          for (int j = 0; j < 64; ++j) o[s * 64 + j] = (u[s * 64 + j] & 0x0F) | ((u[(s + half) * 64 + j] & 0x0F) << 4);
        if (bits > 4) {
          uint8_t* plane = o + half * 64;
          for (int64_t s = 0; s < steps; ++s)
            for (int j = 0; j < 64; ++j) plane[j] |= static_cast<uint8_t>((u[s * 64 + j] >> 4) << (width * s));
        }
      }
    }
  });
  return packed;
}

}  // namespace dynaspec_ops

TORCH_LIBRARY(dynaspec, m) {
  m.def("pack_tiles(Tensor codes, int shift, int bits, int group, int pad) -> Tensor");
  m.def("qmm_vnni(Tensor x, Tensor w, Tensor f32, Tensor sub, int n_out, int group, int bits, int mode, int super_groups, "
        "int amx_min_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) {
  m.impl("qmm_vnni", &dynaspec_ops::qmm_vnni);
  m.impl("pack_tiles", &dynaspec_ops::pack_tiles);
}
