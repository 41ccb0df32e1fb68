// The whole decoder stack in one call, for the CPU float32 path whose projections all run the VNNI
// kernel: models/llama.py's modules, operator for operator and in the same order (the same C++
// functions: ops.h), so the hidden states are bitwise those of the module path. What goes is the
// Python and dispatch around the ~11 operators of each layer, which at one decode row cost as much as
// the arithmetic of the small ones (benchmarks/draft_pass.py).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

// One QuantLinear on the VNNI path: its kernel arguments and bias (undefined when it has none).
struct QLinear {
  at::Tensor w, f32, sub, bias;
  int64_t n_out, group, bits, mode, super_groups, amx_min_rows;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = dynaspec_ops::qmm_vnni(x, w, f32, sub, n_out, group, bits, mode, super_groups, amx_min_rows);
    return bias.defined() ? y.add_(bias) : y;
  }
};

// A projection: one QLinear, or several over the same input whose outputs are concatenated
// (build.py's ConcatLinear, for q/k/v parts stored in different quantization types).
struct Projection {
  std::vector<QLinear> parts;

  at::Tensor operator()(const at::Tensor& x) const {
    if (parts.size() == 1) return parts[0](x);
    std::vector<at::Tensor> outs;
    for (const QLinear& p : parts) outs.push_back(p(x));
    return at::cat(outs, -1);
  }
};

struct Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // q_norm, k_norm undefined without QK norm
  Projection qkv, o, gate_up, down;
};

at::Tensor optional(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }

struct DecoderStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double eps;
  at::Tensor final_norm;
  std::vector<Layer> layers;

  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps), final_norm(std::move(final_norm)) {}

  // tensors: in_norm, post_norm, q_norm, k_norm (empty when none), then each part of qkv, o, gate_up
  // and down as (packed, f32 scales, sub scales, bias or empty); ints: for each of the four
  // projections its number of parts, then each part's n_out, group, bits, mode, super_groups,
  // amx_min_rows.
  void add_layer(std::vector<at::Tensor> t, std::vector<int64_t> i) {
    TORCH_CHECK(t.size() >= 4, "DecoderStack.add_layer: norms");
    size_t ti = 4, ii = 0;
    auto projection = [&]() {
      TORCH_CHECK(ii < i.size() && i[ii] >= 1, "DecoderStack.add_layer: part count");
      Projection p;
      for (int64_t k = i[ii++]; k > 0; --k) {
        TORCH_CHECK(ti + 4 <= t.size() && ii + 6 <= i.size(), "DecoderStack.add_layer: arity");
        const at::Tensor* a = t.data() + ti;
        const int64_t* n = i.data() + ii;
        p.parts.push_back(QLinear{a[0], a[1], a[2], optional(a[3]), n[0], n[1], n[2], n[3], n[4], n[5]});
        ti += 4;
        ii += 6;
      }
      return p;
    };
    Layer L{t[0], t[1], optional(t[2]), optional(t[3]), {}, {}, {}, {}};
    L.qkv = projection();
    L.o = projection();
    L.gate_up = projection();
    L.down = projection();
    TORCH_CHECK(ti == t.size() && ii == i.size(), "DecoderStack.add_layer: arity");
    layers.push_back(std::move(L));
  }

  // x [tokens, hidden] float32 (the embeddings); cos, sin [tokens, 1, head_dim]; one K and one V
  // cache per layer; the slot mapping and row-wise plan of models/attention.py -> the final norm's
  // output [tokens, hidden].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, at::Tensor slot_mapping, at::Tensor slot_table,
                     at::Tensor row_seq, at::Tensor row_len) {
    return run(x, cos, sin, k_caches, v_caches, slot_mapping, slot_table, row_seq, row_len, {}, nullptr);
  }

  // forward, also returning the hidden states entering each layer of `layer_ids` (the residual
  // stream: the embeddings for layer 0; layer_ids may hold the same layer twice) -> [the final
  // norm's output, then one [tokens, hidden] tensor per entry of layer_ids].
  std::vector<at::Tensor> forward_capture(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                          std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                          at::Tensor slot_mapping, at::Tensor slot_table, at::Tensor row_seq,
                                          at::Tensor row_len, std::vector<int64_t> layer_ids) {
    std::vector<at::Tensor> captured(layer_ids.size());
    at::Tensor out =
        run(x, cos, sin, k_caches, v_caches, slot_mapping, slot_table, row_seq, row_len, layer_ids, &captured);
    captured.insert(captured.begin(), out);
    return captured;
  }

 private:
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor>& k_caches,
                 std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping, const at::Tensor& slot_table,
                 const at::Tensor& row_seq, const at::Tensor& row_len, const std::vector<int64_t>& layer_ids,
                 std::vector<at::Tensor>* captured) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "DecoderStack: one cache a layer");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "DecoderStack: x must be float32 [tokens, hidden]");
    const int64_t n = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const double scale = std::pow(static_cast<double>(head_dim), -0.5);  // as Python's head_dim ** -0.5
    at::Tensor residual, h;
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& L = layers[l];
      if (l == 0) {
        residual = x;
        h = dynaspec_ops::rms_norm(x.contiguous(), L.in_norm, eps);
      } else {
        std::tie(residual, h) = dynaspec_ops::add_rms_norm(x.contiguous(), residual.contiguous(), L.in_norm, eps);
      }
      if (captured != nullptr) {
        for (size_t c = 0; c < layer_ids.size(); ++c) {
          if (layer_ids[c] == static_cast<int64_t>(l)) (*captured)[c] = residual;
        }
      }
      // attention (llama.py Attention.forward and attention.paged_attention)
      const at::Tensor qkv = L.qkv(h);
      at::Tensor q = qkv.narrow(1, 0, q_size).reshape({n, heads, head_dim});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).reshape({n, kv_heads, head_dim});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({n, kv_heads, head_dim});
      if (L.q_norm.defined()) {
        q = dynaspec_ops::rms_norm(q.contiguous(), L.q_norm, eps);
        k = dynaspec_ops::rms_norm(k.contiguous(), L.k_norm, eps);
      }
      q = q.contiguous();
      k = k.contiguous();
      dynaspec_ops::rope_qk_(q, k, cos, sin);
      at::Tensor& kc = k_caches[l];
      at::Tensor& vc = v_caches[l];
      dynaspec_ops::kv_write_(kc, vc, k, v, slot_mapping);
      const at::Tensor attn = dynaspec_ops::paged_attention_rows(q, kc, vc, slot_table, row_seq, row_len, scale);
      const at::Tensor o = L.o(attn.reshape({n, q_size}));
      std::tie(residual, h) = dynaspec_ops::add_rms_norm(o, residual.contiguous(), L.post_norm, eps);
      // MLP
      x = L.down(dynaspec_ops::silu_mul(L.gate_up(h).contiguous()));
    }
    return std::get<1>(dynaspec_ops::add_rms_norm(x.contiguous(), residual.contiguous(), final_norm, eps));
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(dynaspec, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward)
      .def("forward_capture", &DecoderStack::forward_capture);
}
