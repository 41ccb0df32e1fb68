// Paged attention for a flat varlen batch, each query row on its own, read in place from the cache.
//
// Each query row t (a new token at position p of its sequence) attends to keys 0..p of its own
// sequence, found through the sequence's slot table. The computation for a row, two passes per
// head (scores, then max / exp / sum / weighted values, every loop in key order 0..p), depends only
// on that row's query and its sequence's cached K/V: not on how many rows share the call, on other
// sequences' lengths, or on how work is split between threads. So a token's attention output is the
// same whether it is decoded alone, verified among K drafts, or prefilled in any chunking, which is
// what keeps greedy speculative decoding token-for-token identical to plain decoding.
//
// The K/V cache is float32 or bfloat16; queries and outputs are float32. Work items are (block, KV
// head) pairs, a block being up to kBlockRows consecutive rows of one sequence (a request's
// verified window, or a slice of its prefill chunk), whose queries are its rows times the heads of
// one KV group. With head sizes a multiple of 16 (AVX-512; with AVX2, 8 and 8 keys): scores go 16 keys at a time, every
// query of the block against a tile of keys while it is in L1, each query's 16 dot products added
// up by one fixed tree; values are accumulated in registers for as many heads of a row as fit (a
// whole KV group's, up to 8), over the row's keys in order, so a row reads its values once. Other
// head sizes take scalar loops in the same shape. Either way a row's arithmetic is the same as it
// would be alone (its keys 0..p in order, its own partial sums), so the blocking changes no result.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

constexpr int kLanes = 16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// q . k over d elements in kLanes independent partial sums, then a fixed pairwise reduction.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += q[i + l] * load(k, i + l);
  for (; i < d; ++i) acc[i % kLanes] += q[i] * load(k, i);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// exp(x) for x <= 0 (scores minus their maximum); below -87 the weight is exactly 0.
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] < -87.0f ? 0.0f : dynaspec_math::fast_exp(x[i]);
}

constexpr int64_t kBlockRows = 16;  // rows of one sequence that share each key and value read

// The blocks: runs of up to kBlockRows consecutive rows of one sequence; their first rows, then rows.
inline std::vector<int64_t> block_starts(const int64_t* row_seq, int64_t rows) {
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < rows; ++t)
    if (t == 0 || row_seq[t] != row_seq[t - 1] || t - starts.back() == kBlockRows) starts.push_back(t);
  starts.push_back(rows);
  return starts;
}

// The largest of s[0..len) (-inf for none); a maximum is exact in any order.
inline float max_of(const float* s, int64_t len) {
  int64_t j = 0;
  float m = -INFINITY;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= len; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
  m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__)
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= len; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float v : lanes) m = v > m ? v : m;
#endif
  for (; j < len; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

// sum[l] = the sum of s[j] over j = l (mod kLanes), j < len, in order of j: kLanes running sums,
// whatever the vector width (the scalar loop it replaces added them one at a time through memory).
inline void lane_sums(const float* s, int64_t len, float* sum) {
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= len; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(s + j));
  _mm512_storeu_ps(sum, acc);
#elif defined(__AVX2__)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (; j + 16 <= len; j += 16) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(s + j));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(s + j + 8));
  }
  _mm256_storeu_ps(sum, lo);
  _mm256_storeu_ps(sum + 8, hi);
#else
  for (int l = 0; l < kLanes; ++l) sum[l] = 0.0f;
#endif
  for (; j < len; ++j) sum[j % kLanes] += s[j];
}

// Softmax of each query's scores over its own keys, in place; inv[x] = 1 / the sum of its weights.
inline void softmax_rows(float* scores, int64_t stride, const int64_t* lens, int64_t group, int64_t nq,
                         float* inv) {
  for (int64_t x = 0; x < nq; ++x) {
    const int64_t len = lens[x / group];
    float* s = scores + x * stride;
    const float m = max_of(s, len);
    for (int64_t j = 0; j < len; ++j) s[j] -= m;
    exp_nonpositive(s, len);
    float sum[kLanes];
    lane_sums(s, len, sum);
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) sum[l] += sum[l + w];
    inv[x] = 1.0f / sum[0];
  }
}

// --- any head size: scalar loops the compiler vectorizes -------------------------------------------

template <typename T>
void attend_block_scalar(const float* q, const T* kc, const T* vc, const int64_t* slots, const int64_t* lens,
                         int64_t t0, int64_t nr, int64_t h, int64_t heads, int64_t kv_heads, int64_t d,
                         float scale, std::vector<float>& scores, std::vector<float>& acc,
                         std::vector<float>& inv, float* out) {
  const int64_t group = heads / kv_heads, nq = nr * group;
  int64_t n = 0;
  for (int64_t r = 0; r < nr; ++r) n = lens[r] > n ? lens[r] : n;
  scores.resize(nq * n);
  for (int64_t j = 0; j < n; ++j) {
    const T* kp = kc + (slots[j] * kv_heads + h) * d;
    for (int64_t r = 0; r < nr; ++r) {
      if (j >= lens[r]) continue;
      const float* qt = q + ((t0 + r) * heads + h * group) * d;
      for (int64_t g = 0; g < group; ++g) scores[(r * group + g) * n + j] = dot(qt + g * d, kp, d) * scale;
    }
  }
  inv.resize(nq);
  softmax_rows(scores.data(), n, lens, group, nq, inv.data());
  acc.assign(nq * d, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const T* vp = vc + (slots[j] * kv_heads + h) * d;
    for (int64_t x = 0; x < nq; ++x) {
      if (j >= lens[x / group]) continue;
      const float p = scores[x * n + j];
      float* a = acc.data() + x * d;
      for (int64_t i = 0; i < d; ++i) a[i] += p * load(vp, i);
    }
  }
  for (int64_t x = 0; x < nq; ++x) {
    float* o = out + ((t0 + x / group) * heads + h * group + x % group) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = acc[x * d + i] * inv[x];
  }
}

// Pulls ``bytes`` from ``p`` towards L1 ahead of use: the cache is read through the slot table, a
// key at a time, which the hardware's prefetchers follow poorly.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

constexpr int64_t kValuesAhead = 32;  // keys ahead at which the values loop prefetches
constexpr int64_t kKeysAhead = 64;    // keys ahead at which the scores loop prefetches

#if defined(__AVX512F__)
// --- head sizes a multiple of 16: AVX-512 ------------------------------------------------------------

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The sums of 16 vectors, in order, in one vector: each is added up by the same fixed tree (lanes
// 0+2 and 1+3 of each 128-bit quarter, those two, then the quarters pairwise) whatever its place.
inline __m512 sum16(const __m512* a) {
  __m512 c[8], f[4], hh[2];
  for (int k = 0; k < 8; ++k)
    c[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    f[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  for (int k = 0; k < 2; ++k)
    hh[k] = _mm512_add_ps(_mm512_shuffle_f32x4(f[2 * k], f[2 * k + 1], 0x88),
                          _mm512_shuffle_f32x4(f[2 * k], f[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(hh[0], hh[1], 0x88), _mm512_shuffle_f32x4(hh[0], hh[1], 0xDD));
}

// The 16 scores of NX queries against a tile of 16 keys, kKeyTile keys at a time: each key's chunk
// is widened once for all NX queries. Each score is its query's and key's 16 lane sums over the
// head in chunk order, added up by sum16 with the tile's other keys: as if the query were alone.
constexpr int kQueryTile = 6;
constexpr int kKeyTile = 4;  // kQueryTile x kKeyTile accumulators, kKeyTile keys and a query: 29 registers

template <typename T, int NX>
void tile_scores(const float* const* qx, const T* const* kp, int64_t d, __m512 vscale, float* const* dst) {
  alignas(64) __m512 part[NX][16];
  for (int k0 = 0; k0 < 16; k0 += kKeyTile) {
    __m512 acc[NX][kKeyTile];
    for (int t = 0; t < NX; ++t)
      for (int k = 0; k < kKeyTile; ++k) acc[t][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      __m512 kv[kKeyTile];
      for (int k = 0; k < kKeyTile; ++k) kv[k] = load16(kp[k0 + k] + i);
      for (int t = 0; t < NX; ++t) {
        const __m512 qv = _mm512_loadu_ps(qx[t] + i);
        for (int k = 0; k < kKeyTile; ++k) acc[t][k] = _mm512_fmadd_ps(qv, kv[k], acc[t][k]);
      }
    }
    for (int t = 0; t < NX; ++t)
      for (int k = 0; k < kKeyTile; ++k) part[t][k0 + k] = acc[t][k];
  }
  for (int t = 0; t < NX; ++t) _mm512_storeu_ps(dst[t], _mm512_mul_ps(sum16(part[t]), vscale));
}

template <typename T>
void tile_scores_nx(int nx, const float* const* qx, const T* const* kp, int64_t d, __m512 vscale,
                    float* const* dst) {
  switch (nx) {
    case 6: tile_scores<T, 6>(qx, kp, d, vscale, dst); break;
    case 5: tile_scores<T, 5>(qx, kp, d, vscale, dst); break;
    case 4: tile_scores<T, 4>(qx, kp, d, vscale, dst); break;
    case 3: tile_scores<T, 3>(qx, kp, d, vscale, dst); break;
    case 2: tile_scores<T, 2>(qx, kp, d, vscale, dst); break;
    default: tile_scores<T, 1>(qx, kp, d, vscale, dst);
  }
}

// acc[t] += p[t][j] * v_j over keys j < len for NT queries, ND 16-float chunks of the head from chunk c0.
template <typename T, int NT, int ND>
void weighted_values(const float* const* p, int64_t len, const T* vc, const int64_t* slots, int64_t kv_heads,
                     int64_t h, int64_t d, int64_t c0, float* const* out, const float* inv) {
  __m512 acc[NT][ND];
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < ND; ++c) acc[t][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (j + kValuesAhead < len)
      prefetch(vc + (slots[j + kValuesAhead] * kv_heads + h) * d + c0 * 16, ND * 16 * sizeof(T));
    const T* vp = vc + (slots[j] * kv_heads + h) * d + c0 * 16;
    __m512 v[ND];
    for (int c = 0; c < ND; ++c) v[c] = load16(vp + c * 16);
    for (int t = 0; t < NT; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t][j]);
      for (int c = 0; c < ND; ++c) acc[t][c] = _mm512_fmadd_ps(pt, v[c], acc[t][c]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < ND; ++c)
      _mm512_storeu_ps(out[t] + (c0 + c) * 16, _mm512_mul_ps(acc[t][c], _mm512_set1_ps(inv[t])));
}

// Up to kMaxHeads heads of one row at a time, ND chunks of 16 floats each: (heads + 1) x ND of the 32
// vector registers (the weights come broadcast from memory).
constexpr int kMaxHeads = 8;

template <typename T, int ND>
void weighted_values_nt(int nt, const float* const* p, int64_t len, const T* vc, const int64_t* slots,
                        int64_t kv_heads, int64_t h, int64_t d, int64_t c0, float* const* out, const float* inv) {
  switch (nt) {
#define DYNASPEC_NT(N)                                                              \
  case N:                                                                         \
    if constexpr ((N + 1) * ND <= 32)                                             \
      weighted_values<T, N, ND>(p, len, vc, slots, kv_heads, h, d, c0, out, inv); \
    else                                                                          \
      TORCH_CHECK(false, "weighted_values: a tiling that does not fit the registers"); \
    break;
    DYNASPEC_NT(8) DYNASPEC_NT(7) DYNASPEC_NT(6) DYNASPEC_NT(5) DYNASPEC_NT(4) DYNASPEC_NT(3) DYNASPEC_NT(2)
#undef DYNASPEC_NT
    default: weighted_values<T, 1, ND>(p, len, vc, slots, kv_heads, h, d, c0, out, inv);
  }
}

// The values' tiling for a KV group of ``group`` heads and ``chunks`` chunks of 16: as many heads of a
// row as fit (all of them up to kMaxHeads), then the widest chunk count that fits with them, so a
// row reads each value once per group of heads (once in all for groups up to 7 with heads of 64 or
// 128). Each output element's sum is the same whatever the tiling: its own keys in order.
inline void values_tiling(int64_t group, int64_t chunks, int* nt_max, int* nd) {
  *nt_max = static_cast<int>(std::min<int64_t>(group, kMaxHeads));
  for (int w : {8, 4, 2, 1})
    if (chunks % w == 0 && (*nt_max + 1) * w <= 32) {
      *nd = w;
      return;
    }
  *nd = 1;
}

template <typename T>
void attend_block_avx512(const float* q, const T* kc, const T* vc, const int64_t* slots, const int64_t* lens,
                         int64_t t0, int64_t nr, int64_t h, int64_t heads, int64_t kv_heads, int64_t d,
                         float scale, std::vector<float>& scores, std::vector<float>& inv, float* out) {
  const int64_t group = heads / kv_heads, nq = nr * group;
  int64_t n = 0;
  for (int64_t r = 0; r < nr; ++r) n = lens[r] > n ? lens[r] : n;
  const int64_t stride = (n + 15) / 16 * 16;
  scores.resize(nq * stride);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {  // 16 keys at a time, each query's 16 scores at once
    const T* kp[16];
    for (int k = 0; k < 16; ++k) kp[k] = kc + (slots[j0 + k < n ? j0 + k : 0] * kv_heads + h) * d;
    for (int64_t k = j0 + kKeysAhead; k < std::min(j0 + kKeysAhead + 16, n); ++k)
      prefetch(kc + (slots[k] * kv_heads + h) * d, d * sizeof(T));
    for (int64_t x0 = 0; x0 < nq; x0 += kQueryTile) {
      const int nx = static_cast<int>(std::min<int64_t>(kQueryTile, nq - x0));
      const float* qx[kQueryTile];
      float* dst[kQueryTile];
      for (int t = 0; t < nx; ++t) {
        const int64_t x = x0 + t;
        qx[t] = q + ((t0 + x / group) * heads + h * group + x % group) * d;
        dst[t] = scores.data() + x * stride + j0;
      }
      tile_scores_nx(nx, qx, kp, d, vscale, dst);
    }
  }
  inv.resize(nq);
  softmax_rows(scores.data(), stride, lens, group, nq, inv.data());
  const int64_t chunks = d / 16;
  int nt_max, nd;
  values_tiling(group, chunks, &nt_max, &nd);
  for (int64_t x0 = 0; x0 < nq;) {  // up to nt_max heads of one row at a time
    const int nt = static_cast<int>(std::min<int64_t>(nt_max, group - x0 % group));
    const float* p[kMaxHeads];
    float* o[kMaxHeads];
    for (int t = 0; t < nt; ++t) {
      const int64_t x = x0 + t;
      p[t] = scores.data() + x * stride;
      o[t] = out + ((t0 + x / group) * heads + h * group + x % group) * d;
    }
    const int64_t len = lens[x0 / group];
    for (int64_t c0 = 0; c0 < chunks; c0 += nd) {
      if (nd == 8) weighted_values_nt<T, 8>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
      else if (nd == 4) weighted_values_nt<T, 4>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
      else if (nd == 2) weighted_values_nt<T, 2>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
      else weighted_values_nt<T, 1>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
    }
    x0 += nt;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// --- head sizes a multiple of 8: AVX2 ------------------------------------------------------------------
// The AVX-512 section's algorithm on 256-bit registers (16 of them): scores 8 keys at a time, each
// query's 8 lane sums added up by one fixed tree; values in registers for as many heads of a row as fit.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The sums of 8 vectors, in order, in one vector: each is added up by the same fixed tree (lanes
// 0+2 and 1+3 of each 128-bit half, those two, then the halves) whatever its place.
inline __m256 sum8(const __m256* a) {
  __m256 c[4], f[2];
  for (int k = 0; k < 4; ++k)
    c[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 2; ++k)
    f[k] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44),
                         _mm256_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(f[0], f[1], 0x20), _mm256_permute2f128_ps(f[0], f[1], 0x31));
}

// The 8 scores of NX queries against a tile of 8 keys, kKeyTile8 keys at a time (NX x kKeyTile8
// accumulators, the keys and a query: at most 15 registers).
constexpr int kQueryTile8 = 6;
constexpr int kKeyTile8 = 2;

template <typename T, int NX>
void tile_scores8(const float* const* qx, const T* const* kp, int64_t d, __m256 vscale, float* const* dst) {
  __m256 part[NX][8];
  for (int k0 = 0; k0 < 8; k0 += kKeyTile8) {
    __m256 acc[NX][kKeyTile8];
    for (int t = 0; t < NX; ++t)
      for (int k = 0; k < kKeyTile8; ++k) acc[t][k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      __m256 kv[kKeyTile8];
      for (int k = 0; k < kKeyTile8; ++k) kv[k] = load8(kp[k0 + k] + i);
      for (int t = 0; t < NX; ++t) {
        const __m256 qv = _mm256_loadu_ps(qx[t] + i);
        for (int k = 0; k < kKeyTile8; ++k) acc[t][k] = _mm256_fmadd_ps(qv, kv[k], acc[t][k]);
      }
    }
    for (int t = 0; t < NX; ++t)
      for (int k = 0; k < kKeyTile8; ++k) part[t][k0 + k] = acc[t][k];
  }
  for (int t = 0; t < NX; ++t) _mm256_storeu_ps(dst[t], _mm256_mul_ps(sum8(part[t]), vscale));
}

template <typename T>
void tile_scores8_nx(int nx, const float* const* qx, const T* const* kp, int64_t d, __m256 vscale,
                     float* const* dst) {
  switch (nx) {
    case 6: tile_scores8<T, 6>(qx, kp, d, vscale, dst); break;
    case 5: tile_scores8<T, 5>(qx, kp, d, vscale, dst); break;
    case 4: tile_scores8<T, 4>(qx, kp, d, vscale, dst); break;
    case 3: tile_scores8<T, 3>(qx, kp, d, vscale, dst); break;
    case 2: tile_scores8<T, 2>(qx, kp, d, vscale, dst); break;
    default: tile_scores8<T, 1>(qx, kp, d, vscale, dst);
  }
}

// acc[t] += p[t][j] * v_j over keys j < len for NT queries, ND 8-float chunks of the head from chunk c0.
template <typename T, int NT, int ND>
void weighted_values8(const float* const* p, int64_t len, const T* vc, const int64_t* slots, int64_t kv_heads,
                      int64_t h, int64_t d, int64_t c0, float* const* out, const float* inv) {
  __m256 acc[NT][ND];
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < ND; ++c) acc[t][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (j + kValuesAhead < len)
      prefetch(vc + (slots[j + kValuesAhead] * kv_heads + h) * d + c0 * 8, ND * 8 * sizeof(T));
    const T* vp = vc + (slots[j] * kv_heads + h) * d + c0 * 8;
    __m256 v[ND];
    for (int c = 0; c < ND; ++c) v[c] = load8(vp + c * 8);
    for (int t = 0; t < NT; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t][j]);
      for (int c = 0; c < ND; ++c) acc[t][c] = _mm256_fmadd_ps(pt, v[c], acc[t][c]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < ND; ++c)
      _mm256_storeu_ps(out[t] + (c0 + c) * 8, _mm256_mul_ps(acc[t][c], _mm256_set1_ps(inv[t])));
}

constexpr int kMaxHeads8 = 7;  // heads of a row at a time: (heads + 1) x ND of the 16 registers

template <typename T, int ND>
void weighted_values8_nt(int nt, const float* const* p, int64_t len, const T* vc, const int64_t* slots,
                         int64_t kv_heads, int64_t h, int64_t d, int64_t c0, float* const* out, const float* inv) {
  switch (nt) {
#define DYNASPEC_NT8(N)                                                              \
  case N:                                                                            \
    if constexpr ((N + 1) * ND <= 16)                                                \
      weighted_values8<T, N, ND>(p, len, vc, slots, kv_heads, h, d, c0, out, inv);   \
    else                                                                             \
      TORCH_CHECK(false, "weighted_values8: a tiling that does not fit the registers"); \
    break;
    DYNASPEC_NT8(7) DYNASPEC_NT8(6) DYNASPEC_NT8(5) DYNASPEC_NT8(4) DYNASPEC_NT8(3) DYNASPEC_NT8(2)
#undef DYNASPEC_NT8
    default: weighted_values8<T, 1, ND>(p, len, vc, slots, kv_heads, h, d, c0, out, inv);
  }
}

template <typename T>
void attend_block_avx2(const float* q, const T* kc, const T* vc, const int64_t* slots, const int64_t* lens,
                       int64_t t0, int64_t nr, int64_t h, int64_t heads, int64_t kv_heads, int64_t d,
                       float scale, std::vector<float>& scores, std::vector<float>& inv, float* out) {
  const int64_t group = heads / kv_heads, nq = nr * group;
  int64_t n = 0;
  for (int64_t r = 0; r < nr; ++r) n = lens[r] > n ? lens[r] : n;
  const int64_t stride = (n + 7) / 8 * 8;
  scores.resize(nq * stride);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {  // 8 keys at a time, each query's 8 scores at once
    const T* kp[8];
    for (int k = 0; k < 8; ++k) kp[k] = kc + (slots[j0 + k < n ? j0 + k : 0] * kv_heads + h) * d;
    for (int64_t k = j0 + kKeysAhead; k < std::min(j0 + kKeysAhead + 8, n); ++k)
      prefetch(kc + (slots[k] * kv_heads + h) * d, d * sizeof(T));
    for (int64_t x0 = 0; x0 < nq; x0 += kQueryTile8) {
      const int nx = static_cast<int>(std::min<int64_t>(kQueryTile8, nq - x0));
      const float* qx[kQueryTile8];
      float* dst[kQueryTile8];
      for (int t = 0; t < nx; ++t) {
        const int64_t x = x0 + t;
        qx[t] = q + ((t0 + x / group) * heads + h * group + x % group) * d;
        dst[t] = scores.data() + x * stride + j0;
      }
      tile_scores8_nx(nx, qx, kp, d, vscale, dst);
    }
  }
  inv.resize(nq);
  softmax_rows(scores.data(), stride, lens, group, nq, inv.data());
  const int64_t chunks = d / 8;
  // as many heads of a row as fit, then the widest chunk count that fits with them
  const int nt_max = static_cast<int>(std::min<int64_t>(group, kMaxHeads8));
  int nd = 1;
  for (int w : {4, 2, 1})
    if (chunks % w == 0 && (nt_max + 1) * w <= 16) {
      nd = w;
      break;
    }
  for (int64_t x0 = 0; x0 < nq;) {
    const int nt = static_cast<int>(std::min<int64_t>(nt_max, group - x0 % group));
    const float* p[kMaxHeads8];
    float* o[kMaxHeads8];
    for (int t = 0; t < nt; ++t) {
      const int64_t x = x0 + t;
      p[t] = scores.data() + x * stride;
      o[t] = out + ((t0 + x / group) * heads + h * group + x % group) * d;
    }
    const int64_t len = lens[x0 / group];
    for (int64_t c0 = 0; c0 < chunks; c0 += nd) {
      if (nd == 4) weighted_values8_nt<T, 4>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
      else if (nd == 2) weighted_values8_nt<T, 2>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
      else weighted_values8_nt<T, 1>(nt, p, len, vc, slots, kv_heads, h, d, c0, o, inv.data() + x0);
    }
    x0 += nt;
  }
}
#endif  // __AVX512F__, __AVX2__

template <typename T>
void attend(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t table_width,
            const int64_t* row_seq, const int64_t* row_len, float* out, int64_t rows, int64_t heads,
            int64_t kv_heads, int64_t d, float scale) {
  const std::vector<int64_t> starts = block_starts(row_seq, rows);
  const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, inv;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, t0 = starts[b], nr = starts[b + 1] - t0;
      const int64_t* slots = table + row_seq[t0] * table_width;
#if defined(__AVX512F__)
      if (d % 16 == 0) {
        attend_block_avx512(q, kc, vc, slots, row_len + t0, t0, nr, h, heads, kv_heads, d, scale, scores, inv, out);
        continue;
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if (d % 8 == 0) {
        attend_block_avx2(q, kc, vc, slots, row_len + t0, t0, nr, h, heads, kv_heads, d, scale, scores, inv, out);
        continue;
      }
#endif
      attend_block_scalar(q, kc, vc, slots, row_len + t0, t0, nr, h, heads, kv_heads, d, scale, scores, acc, inv,
                            out);
    }
  });
}

}  // namespace

namespace dynaspec_ops {

// q [rows, heads, d] float32; k_cache, v_cache [slots, kv_heads, d] float32 or bfloat16;
// slot_table [sequences, width] int64 (the cache slot of each position of each sequence);
// row_seq [rows] int64 (the sequence of each row); row_len [rows] int64 (keys the row sees:
// its position + 1, at most width) -> [rows, heads, d] float32.
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& slot_table, const at::Tensor& row_seq,
                                const at::Tensor& row_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "paged_attention_rows: q");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_rows: cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention_rows: k/v dtypes differ");
  TORCH_CHECK(slot_table.scalar_type() == at::kLong && slot_table.is_contiguous() && slot_table.dim() == 2,
              "paged_attention_rows: slot_table");
  TORCH_CHECK(row_seq.scalar_type() == at::kLong && row_len.scalar_type() == at::kLong &&
                  row_seq.numel() == q.size(0) && row_len.numel() == q.size(0),
              "paged_attention_rows: row_seq/row_len");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && heads % kv_heads == 0, "paged_attention_rows: head shapes");
  const at::Tensor seq = row_seq.contiguous(), len = row_len.contiguous();
  const int64_t width = slot_table.size(1);
  const int64_t* lens = len.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(lens[t] >= 1 && lens[t] <= width, "paged_attention_rows: row_len");
  at::Tensor out = at::empty_like(q);
  if (k_cache.scalar_type() == at::kFloat) {
    attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slot_table.data_ptr<int64_t>(),
           width, seq.data_ptr<int64_t>(), lens, out.data_ptr<float>(), rows, heads, kv_heads, d, float(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "paged_attention_rows: cache must be float32 or bfloat16");
    attend(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
           slot_table.data_ptr<int64_t>(), width, seq.data_ptr<int64_t>(), lens, out.data_ptr<float>(), rows, heads,
           kv_heads, d, float(scale));
  }
  return out;
}

// Write the new tokens' keys and values into the cache: k_cache[slot_mapping[t]] = k[t] (and v),
// converted to the cache's dtype as Tensor.to converts them (bfloat16: round to nearest even), so
// the cache holds the same bits as after index_copy_(0, slot_mapping, k.to(dtype)) (a NaN stays a
// NaN, though not always with the bits torch's vectorized conversion gives it). One call for
// what took four ATen calls and two temporaries (called from Python at one decode row: 17 against
// 2.6 us a layer; from layer.cpp about 0.2 ms of a batch-1 step of the 1.5B). k, v [tokens,
// kv_heads, d] float32, any row strides (views of the q/k/v projection), each head's d values contiguous; caches [slots, kv_heads, d] float32 or bfloat16, contiguous.
void kv_write_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "kv_write_: caches");
  const int64_t n = slot_mapping.numel(), slots = k_cache.size(0), kv_heads = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "kv_write_: slot_mapping");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == n && t->size(1) == kv_heads &&
                    t->size(2) == d && t->stride(2) == 1,
                "kv_write_: k and v must be float32 [tokens, kv_heads, d] with contiguous heads");
  }
  const at::Tensor slot_t = slot_mapping.contiguous();
  const int64_t* slot = slot_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "kv_write_: slot out of range");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "kv_write_: cache must be float32 or bfloat16");
  for (int c = 0; c < 2; ++c) {
    const at::Tensor& src = c == 0 ? k : v;
    at::Tensor& dst = c == 0 ? k_cache : v_cache;
    const float* base = src.data_ptr<float>();
    const int64_t s0 = src.stride(0), s1 = src.stride(1), row = kv_heads * d;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* from = base + t * s0 + h * s1;
        if (bf16) {
          at::BFloat16* to = dst.data_ptr<at::BFloat16>() + slot[t] * row + h * d;
          for (int64_t i = 0; i < d; ++i) to[i] = at::BFloat16(from[i]);
        } else {
          float* to = dst.data_ptr<float>() + slot[t] * row + h * d;
          std::memcpy(to, from, sizeof(float) * d);
        }
      }
    }
  }
}

}  // namespace dynaspec_ops

TORCH_LIBRARY_FRAGMENT(dynaspec, m) {
  m.def("paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_table, Tensor row_seq, "
        "Tensor row_len, float scale) -> Tensor");
  m.def("kv_write_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) {
  m.impl("paged_attention_rows", &dynaspec_ops::paged_attention_rows);
  m.impl("kv_write_", &dynaspec_ops::kv_write_);
}
