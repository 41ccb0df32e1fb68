// Small vectorizable float helpers shared by the C++ operators.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dynaspec_math {

// exp(x), vectorizable (no library call): x = n ln2 + r, exp(r) by a degree-6 polynomial (relative
// error ~2e-7), 2^n from the exponent bits; x clamped to [-87, 88].
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace dynaspec_math
