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
// Batch invariance: a row's result depends only on that row (its own quantization, integer sums
// that are exact, then a float epilogue per group in a fixed group order), never on how many rows
// share the call or how columns are split between threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;      // output columns per tile: one register of int32 or float
constexpr int kTilesPerStep = 2;  // tiles computed together (the packer pads columns to a multiple)

// x [rows, in] float32 -> xq [rows, in] int8, xs [rows, groups] (the group's scale),
// xc [rows, groups] (scale * sum of the group's codes, which the offsets multiply).
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
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * n_in + g * G + i), _mm512_cvtsepi32_epi8(q));
          sum += _mm512_reduce_add_epi32(q);
        }
        xs[r * groups + g] = scale;
        xc[r * groups + g] = scale * static_cast<float>(sum);
      }
    }
  });
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
      const int8_t* xr = xq + r * n_in + g * G;
      __m512i dot[kTilesPerStep];
      for (int n = 0; n < kTilesPerStep; ++n) dot[n] = _mm512_setzero_si512();
      for (int s = 0; s < kSteps; ++s) {
        int32_t four;
        std::memcpy(&four, xr + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int n = 0; n < kTilesPerStep; ++n) dot[n] = _mm512_dpbusd_epi32(dot[n], wv[n][s], xb);
      }
      const __m512 d = _mm512_set1_ps(xs[r * groups + g]);
      const __m512 c = _mm512_set1_ps(xc[r * groups + g]);
      float* ar = acc + r * kWidth;
      for (int n = 0; n < kTilesPerStep; ++n) {
        __m512 a = _mm512_loadu_ps(ar + n * kLanes);
        a = _mm512_fmadd_ps(vs[n], _mm512_mul_ps(_mm512_cvtepi32_ps(dot[n]), d), a);
        a = _mm512_fmadd_ps(vo[n], c, a);
        _mm512_storeu_ps(ar + n * kLanes, a);
      }
    }
  }
}

template <int BITS, int G>
void run(const at::Tensor& xf, const at::Tensor& w, const at::Tensor& sc, const at::Tensor& of, at::Tensor& out) {
  const int64_t rows = xf.size(0), n_in = xf.size(1), n_out = out.size(1);
  const int64_t groups = n_in / G;
  const int64_t tiles = sc.size(0);
  std::vector<int8_t> xq(rows * n_in);
  std::vector<float> xs(rows * groups), xc(rows * groups);
  quantize_rows<G>(xf.data_ptr<float>(), rows, n_in, xq.data(), xs.data(), xc.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* scp = sc.data_ptr<float>();
  const float* ofp = of.data_ptr<float>();
  float* op = out.data_ptr<float>();
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
at::Tensor qmm_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& offsets,
                    int64_t n_out, int64_t group, int64_t bits) {
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
  if (bits == 4 && group == 32) run<4, 32>(xf, w, scales, offsets, out);
  else if (bits == 4 && group == 16) run<4, 16>(xf, w, scales, offsets, out);
  else if (bits == 8 && group == 32) run<8, 32>(xf, w, scales, offsets, out);
  else if (bits == 8 && group == 16) run<8, 16>(xf, w, scales, offsets, out);
  else TORCH_CHECK(false, "qmm_vnni: unsupported bits/group ", bits, "/", group);
  return out;
}

}  // namespace

TORCH_LIBRARY(dynaspec, m) {
  m.def("qmm_vnni(Tensor x, Tensor w, Tensor scales, Tensor offsets, int n_out, int group, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) { m.impl("qmm_vnni", &qmm_vnni); }
