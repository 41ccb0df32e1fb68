// The operators of qmatmul.cpp, attention.cpp and fused.cpp as plain C++ functions, so that
// layer.cpp can chain them without a trip through Python and the dispatcher for each.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace dynaspec_ops {

at::Tensor qmm_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& f32, const at::Tensor& sub,
                    int64_t n_out, int64_t group, int64_t bits, int64_t mode, int64_t super_groups,
                    int64_t amx_min_rows);

at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& slot_table, const at::Tensor& row_seq,
                                const at::Tensor& row_len, double scale);

void kv_write_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps);
void rope_qk_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

}  // namespace dynaspec_ops
