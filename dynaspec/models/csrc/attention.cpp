// Paged attention for a flat varlen batch, one query row at a time, read in place from the cache.
//
// Each query row t (a new token at position p of its sequence) attends to keys 0..p of its own
// sequence, found through the sequence's slot table. The computation for a row, two passes per
// head (scores, then max / exp / sum / weighted values, every loop in key order 0..p), depends only
// on that row's query and its sequence's cached K/V: not on how many rows share the call, on other
// sequences' lengths, or on how work is split between threads. So a token's attention output is the
// same whether it is decoded alone, verified among K drafts, or prefilled in any chunking, which is
// what keeps greedy speculative decoding token-for-token identical to plain decoding.
//
// The K/V cache is float32 or bfloat16; queries and outputs are float32. Work items are (row, KV
// head) pairs; the heads of one KV group share each key and value read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
void attend(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t table_width,
            const int64_t* row_seq, const int64_t* row_len, float* out, int64_t rows, int64_t heads,
            int64_t kv_heads, int64_t d, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, h = item % kv_heads, n = row_len[t];
      const int64_t* slots = table + row_seq[t] * table_width;
      const float* qt = q + (t * heads + h * group) * d;
      scores.resize(group * n);
      for (int64_t j = 0; j < n; ++j) {
        const T* kp = kc + (slots[j] * kv_heads + h) * d;
        for (int64_t g = 0; g < group; ++g) scores[g * n + j] = dot(qt + g * d, kp, d) * scale;
      }
      std::vector<float> inv(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < n; ++j) s[j] -= m;
        exp_nonpositive(s, n);
        float sum[kLanes] = {0};
        for (int64_t j = 0; j < n; ++j) sum[j % kLanes] += s[j];
        for (int w = kLanes / 2; w > 0; w /= 2)
          for (int l = 0; l < w; ++l) sum[l] += sum[l + w];
        inv[g] = 1.0f / sum[0];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const T* vp = vc + (slots[j] * kv_heads + h) * d;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j];
          float* a = acc.data() + g * d;
          for (int64_t i = 0; i < d; ++i) a[i] += p * load(vp, i);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (t * heads + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = acc[g * d + i] * inv[g];
      }
    }
  });
}

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(dynaspec, m) {
  m.def("paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_table, Tensor row_seq, "
        "Tensor row_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) { m.impl("paged_attention_rows", &paged_attention_rows); }
