// Fused per-row float32 ops around the quantized layers: one call instead of five to ten small torch
// ops each, which at one decode row cost more in dispatch than in arithmetic.
//
// Every op works on each row (token) on its own in a fixed order (sums in 16 lane-partial sums, then
// a fixed pairwise reduction), so a row's result never depends on how many rows share the call:
// the batch invariance greedy speculation relies on.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "ops.h"
#include "vec_math.h"

namespace {

constexpr int kLanes = 16;

inline float sum_squares(const float* x, int64_t d) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  for (; i < d; ++i) acc[i % kLanes] += x[i] * x[i];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1, name, ": x must be contiguous float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(-1), name, ": weight");
}

void norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * d;
      const float inv = 1.0f / std::sqrt(sum_squares(xr, d) / static_cast<float>(d) + eps);
      float* yr = y + r * d;
      for (int64_t i = 0; i < d; ++i) yr[i] = w[i] * (xr[i] * inv);
    }
  });
}

// Rotate-half RoPE in place on x [rows, heads, d] with cos, sin [rows, d] (or [rows, 1, d]):
// x[i] = x[i] * cos[i] + (i < d/2 ? -x[i + d/2] : x[i - d/2]) * sin[i].
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "rope_: x must be contiguous float32 [rows, heads, d]");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d && sin.numel() == rows * d,
              "rope_: cos/sin must be [rows, d]");
  float* p = x.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  at::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    float tmp[1024];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads;
      float* v = p + item * d;
      const float *cr = c + r * d, *sr = s + r * d;
      for (int64_t i = 0; i < half; ++i) tmp[i] = v[i] * cr[i] - v[i + half] * sr[i];
      for (int64_t i = half; i < d; ++i) tmp[i] = v[i] * cr[i] + v[i - half] * sr[i];
      for (int64_t i = 0; i < d; ++i) v[i] = tmp[i];
    }
  });
}

}  // namespace

namespace dynaspec_ops {

// RMSNorm over the last dimension: y = w * x / sqrt(mean(x^2) + eps).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  at::Tensor y = at::empty_like(x);
  const int64_t d = x.size(-1);
  norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.numel() / d, d, float(eps));
  return y;
}

// (x + residual, rms_norm(x + residual)): a layer's residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "add_rms_norm: residual");
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const float *a = x.data_ptr<float>(), *b = residual.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  at::parallel_for(0, rows * d, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) s[i] = a[i] + b[i];
  });
  norm_rows(s, w.data_ptr<float>(), y.data_ptr<float>(), rows, d, float(eps));
  return {sum, y};
}

void rope_qk_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.size(2) <= 1024, "rope: head_dim above 1024");
  rope_(q, cos, sin);
  rope_(k, cos, sin);
}

// silu(gate) * up for gate_up [rows, 2 * n] (gate first) -> [rows, n].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.dim() == 2, "silu_mul: gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = src + r * 2 * n, *u = g + n;
      float* o = dst + r * n;
      for (int64_t j = 0; j < n; ++j) o[j] = g[j] / (1.0f + dynaspec_math::fast_exp(-g[j])) * u[j];
    }
  });
  return out;
}

}  // namespace dynaspec_ops

TORCH_LIBRARY_FRAGMENT(dynaspec, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) {
  m.impl("rms_norm", &dynaspec_ops::rms_norm);
  m.impl("add_rms_norm", &dynaspec_ops::add_rms_norm);
  m.impl("rope_qk_", &dynaspec_ops::rope_qk_);
  m.impl("silu_mul", &dynaspec_ops::silu_mul);
}
