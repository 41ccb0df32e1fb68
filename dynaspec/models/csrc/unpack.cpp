// GGUF K-quant codes straight from the file's bytes, in parallel: the bulk of loading a Q4_K_M
// model (Q4_K and Q6_K hold ~95% of its weights). Gives exactly what gguf_blocks.py's numpy
// decoders give for the codes (Q4_K: unsigned 4-bit, Q6_K: signed 6-bit, code - 32); the scales,
// a few percent of the bytes, are still decoded in numpy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kQK = 256;           // weights per super-block
constexpr int64_t kQ4KBytes = 144;     // d, dmin (4), scales (12), qs (128)
constexpr int64_t kQ6KBytes = 210;     // ql (128), qh (64), scales (16), d (2)
constexpr int64_t kQ4K = 12, kQ6K = 14;  // GGMLQuantizationType values

// raw [out, bytes per row] uint8 -> codes [out, n_in]: uint8 for Q4_K, int8 for Q6_K.
at::Tensor gguf_codes(const at::Tensor& raw, int64_t qtype, int64_t out, int64_t n_in) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous(), "gguf_codes: raw must be contiguous uint8");
  TORCH_CHECK(qtype == kQ4K || qtype == kQ6K, "gguf_codes: only Q4_K and Q6_K");
  TORCH_CHECK(n_in % kQK == 0, "gguf_codes: in_features must be a multiple of 256");
  const int64_t blocks = n_in / kQK, block_bytes = qtype == kQ4K ? kQ4KBytes : kQ6KBytes;
  TORCH_CHECK(raw.numel() == out * blocks * block_bytes, "gguf_codes: byte count does not match the shape");
  at::Tensor codes = at::empty({out, n_in}, raw.options().dtype(qtype == kQ4K ? at::kByte : at::kChar));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(codes.data_ptr());
  at::parallel_for(0, out * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* blk = src + b * block_bytes;
      uint8_t* o = dst + b * kQK;
      if (qtype == kQ4K) {
        const uint8_t* qs = blk + 16;
        for (int64_t chunk = 0; chunk < 4; ++chunk)  // 64 weights from 32 bytes: low nibbles, then high
          for (int64_t i = 0; i < 32; ++i) {
            const uint8_t v = qs[chunk * 32 + i];
            o[chunk * 64 + i] = v & 0x0F;
            o[chunk * 64 + 32 + i] = v >> 4;
          }
      } else {
        for (int64_t h = 0; h < 2; ++h) {  // two halves of 128 weights
          const uint8_t* ql = blk + h * 64;
          const uint8_t* qh = blk + 128 + h * 32;
          for (int64_t jj = 0; jj < 128; ++jj) {
            const uint8_t low = jj < 64 ? (ql[jj] & 0x0F) : (ql[jj - 64] >> 4);
            const uint8_t high = (qh[jj % 32] >> (2 * (jj / 32))) & 3;
            o[h * 128 + jj] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
          }
        }
      }
    }
  });
  return codes;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dynaspec, m) { m.def("gguf_codes(Tensor raw, int qtype, int out, int n_in) -> Tensor"); }

TORCH_LIBRARY_IMPL(dynaspec, CPU, m) { m.impl("gguf_codes", &gguf_codes); }
