// Weight-only quantized matmul with int8 activations and AVX-512 VNNI integer dot products.
//
// Weights stay in their group-wise integer form (w = scale * code + offset, unsigned codes, 4-bit
// packed two per byte or one byte per code), laid out by the Python packer in tiles of 16 output
// columns: [tile][group][bytes], so one 512-bit register holds 4 consecutive codes of each of the
// 16 columns, which is what vpdpbusd consumes. Each activation row is quantized to int8 per group
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

namespace {

constexpr int kLanes = 16;      // output columns per tile: one register of int32 or float
constexpr int kTilesPerStep = 2;  // tiles computed together (the packer pads columns to a multiple)

constexpr int kRowBlock = 16;  // activation codes are stored in blocks of 16 rows (one AMX tile)

// Offset of row r, group g in the blocked activation codes [rows / 16, groups, 16, G]: an AMX
// activation tile is then 16 * G contiguous bytes.
template <int G>
inline int64_t xq_at(int64_t r, int64_t g, int64_t groups) {
  return ((r / kRowBlock) * groups + g) * kRowBlock * G + (r % kRowBlock) * G;
}

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

// One group's contribution to a row's 16 outputs: acc + scale * (dot * xs) + offset * xc. Every
// path ends each group with exactly these operations, in this order.
inline __m512 epilogue(__m512 acc, __m512i dot, __m512 scale, __m512 offset, float xs, float xc) {
  acc = _mm512_fmadd_ps(scale, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs)), acc);
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(xc), acc);
}

// The codes of one tile and group as vpdpbusd/tdpbsud operands: [kSteps][16 columns][4 codes].
template <int BITS, int G>
inline void unpack_group(const uint8_t* wp, uint8_t* dst) {
  constexpr int kSteps = G / 4;
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < kSteps / 2; ++v) {
      const __m512i raw = _mm512_loadu_si512(wp + 64 * v);
      _mm512_store_si512(dst + 64 * v, _mm512_and_si512(raw, low));
      _mm512_store_si512(dst + 64 * (v + kSteps / 2), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
  } else {
    std::memcpy(dst, wp, 64 * kSteps);
  }
}

// Columns of tiles [tile, tile + kTilesPerStep) for all rows: acc [rows, kTilesPerStep * 16].
template <int BITS, int G>
void tile_step(const uint8_t* w, const float* sc, const float* of, int64_t tile, int64_t groups,
               const int8_t* xq, const float* xs, const float* xc, int64_t rows, int64_t n_in, float* acc) {
  constexpr int kSteps = G / 4;  // vpdpbusd steps per group: 4 codes of each column per step
  constexpr int kTileBytes = BITS == 4 ? kLanes * G / 2 : kLanes * G;
  constexpr int kWidth = kTilesPerStep * kLanes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  std::memset(acc, 0, sizeof(float) * rows * kWidth);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[kTilesPerStep][kSteps];
    __m512 vs[kTilesPerStep], vo[kTilesPerStep];
    for (int n = 0; n < kTilesPerStep; ++n) {
      const int64_t at = (tile + n) * groups + g;
      const uint8_t* wp = w + at * kTileBytes;
      if constexpr (BITS == 4) {
        for (int v = 0; v < kSteps / 2; ++v) {  // low nibbles: step v, high nibbles: step v + kSteps / 2
          const __m512i raw = _mm512_loadu_si512(wp + 64 * v);
          wv[n][v] = _mm512_and_si512(raw, low);
          wv[n][v + kSteps / 2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
      } else {
        for (int s = 0; s < kSteps; ++s) wv[n][s] = _mm512_loadu_si512(wp + 64 * s);
      }
      vs[n] = _mm512_loadu_ps(sc + at * kLanes);
      vo[n] = _mm512_loadu_ps(of + at * kLanes);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* xr = xq + xq_at<G>(r, g, groups);
      __m512i dot[kTilesPerStep];
      for (int n = 0; n < kTilesPerStep; ++n) dot[n] = _mm512_setzero_si512();
      for (int s = 0; s < kSteps; ++s) {
        int32_t four;
        std::memcpy(&four, xr + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int n = 0; n < kTilesPerStep; ++n) dot[n] = _mm512_dpbusd_epi32(dot[n], wv[n][s], xb);
      }
      float* ar = acc + r * kWidth;
      for (int n = 0; n < kTilesPerStep; ++n) {
        const __m512 a = _mm512_loadu_ps(ar + n * kLanes);
        _mm512_storeu_ps(ar + n * kLanes, epilogue(a, dot[n], vs[n], vo[n], xs[r * groups + g], xc[r * groups + g]));
      }
    }
  }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
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
template <int BITS, int G>
void amx_block(const uint8_t* w, const float* sc, const float* of, int64_t tile, int64_t groups, const int8_t* xq,
               const float* xs, const float* xc, int64_t r0, int64_t n_in, uint8_t* codes, int32_t* sums, float* acc) {
  constexpr int kTileBytes = BITS == 4 ? kLanes * G / 2 : kLanes * G;
  constexpr int kCodeBytes = 64 * (G / 4);
  constexpr int kChunk = 4;
  __m512 a[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) a[r] = _mm512_setzero_ps();
  const int8_t* xb = xq + xq_at<G>(r0, 0, groups);
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int chunk = static_cast<int>(std::min<int64_t>(kChunk, groups - g0));
    for (int j = 0; j < chunk; ++j) unpack_group<BITS, G>(w + (tile * groups + g0 + j) * kTileBytes, codes + j * kCodeBytes);
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
      const int64_t at = tile * groups + g0 + j;
      const __m512 vs = _mm512_loadu_ps(sc + at * kLanes);
      const __m512 vo = _mm512_loadu_ps(of + at * kLanes);
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

template <int BITS, int G>
void run_amx(const int8_t* xq, const float* xs, const float* xc, int64_t rows, int64_t padded_rows, int64_t n_in,
             const uint8_t* w, const float* sc, const float* of, int64_t tiles, int64_t n_out, float* out) {
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
      for (int64_t r0 = 0; r0 < padded_rows; r0 += kAmxRows) {
        amx_block<BITS, G>(w, sc, of, t, groups, xq, xs, xc, r0, n_in, codes, sums, acc);
        for (int64_t r = r0; r < std::min(rows, r0 + kAmxRows); ++r)
          std::memcpy(out + r * n_out + col0, acc + (r - r0) * kLanes, sizeof(float) * width);
      }
    }
    _tile_release();
  });
}
#endif

template <int BITS, int G>
void run(const at::Tensor& xf, const at::Tensor& w, const at::Tensor& sc, const at::Tensor& of, at::Tensor& out,
         int64_t amx_min_rows) {
  const int64_t rows = xf.size(0), n_in = xf.size(1), n_out = out.size(1);
  const int64_t groups = n_in / G;
  const int64_t tiles = sc.size(0);
  // rows padded (with zeros) to whole AMX blocks; the padding rows are computed and dropped
  const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::vector<int8_t> xq(padded_rows * n_in, 0);
  std::vector<float> xs(padded_rows * groups, 0.0f), xc(padded_rows * groups, 0.0f);
  quantize_rows<G>(xf.data_ptr<float>(), rows, n_in, xq.data(), xs.data(), xc.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* scp = sc.data_ptr<float>();
  const float* ofp = of.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if (rows >= amx_min_rows && amx_ready()) {
    run_amx<BITS, G>(xq.data(), xs.data(), xc.data(), rows, padded_rows, n_in, wp, scp, ofp, tiles, n_out, op);
    return;
  }
#endif
  constexpr int kWidth = kTilesPerStep * kLanes;
  at::parallel_for(0, tiles / kTilesPerStep, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(rows * kWidth);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t tile = p * kTilesPerStep;
      tile_step<BITS, G>(wp, scp, ofp, tile, groups, xq.data(), xs.data(), xc.data(), rows, n_in, acc.data());
      const int64_t col0 = tile * kLanes;
      const int64_t width = std::min<int64_t>(kWidth, n_out - col0);
      if (width <= 0) continue;
      for (int64_t r = 0; r < rows; ++r) std::memcpy(op + r * n_out + col0, acc.data() + r * kWidth, sizeof(float) * width);
    }
  });
}

// x [rows, in] (float32/bfloat16/float16); w [tiles, groups, tile bytes] uint8; scales and offsets
// [tiles, groups, 16] float32 -> [rows, n_out] float32.
// amx_min_rows: calls with at least this many rows use AMX tiles where available (same results).
at::Tensor qmm_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                    int64_t n_out, int64_t group, int64_t bits, int64_t amx_min_rows) {
  TORCH_CHECK(x.dim() == 2, "qmm_vnni: x must be [rows, in]");
  TORCH_CHECK(w.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kFloat,
              "qmm_vnni: w must be uint8, scales and offsets float32");
  TORCH_CHECK(w.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous(), "qmm_vnni: packed tensors must be contiguous");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kLanes && scales.size(0) % kTilesPerStep == 0, "qmm_vnni: bad scales");
  TORCH_CHECK(scales.size(0) * kLanes >= n_out, "qmm_vnni: fewer packed columns than n_out");
  TORCH_CHECK(x.size(1) == scales.size(1) * group, "qmm_vnni: x's width does not match the packed weight");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n_out}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return out;
  if (bits == 4 && group == 32) run<4, 32>(xf, w, scales, offsets, out, amx_min_rows);
  else if (bits == 4 && group == 16) run<4, 16>(xf, w, scales, offsets, out, amx_min_rows);
  else if (bits == 8 && group == 32) run<8, 32>(xf, w, scales, offsets, out, amx_min_rows);
  else if (bits == 8 && group == 16) run<8, 16>(xf, w, scales, offsets, out, amx_min_rows);
  else TORCH_CHECK(false, "qmm_vnni: unsupported bits/group ", bits, "/", group);
  return out;
}

}  // namespace

TORCH_LIBRARY(dynaspec, m) {
  m.def("qmm_vnni(Tensor x, Tensor w, Tensor scales, Tensor offsets, int n_out, int group, int bits, int amx_min_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) { m.impl("qmm_vnni", &qmm_vnni); }
