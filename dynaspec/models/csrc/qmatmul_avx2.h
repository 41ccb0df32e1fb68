// qmatmul.cpp's ISA-specific half for CPUs without AVX-512BW: AVX2 with FMA and F16C (every
// x86-64 CPU since 2013-2015: Haswell, Zen). Included by qmatmul.cpp inside its namespace, after
// the shared definitions (ScaleTable, tile_slot, tile_bytes, xq_at, prefetch_group, int16_steps).
//
// Same packed layout, same arithmetic, same bits as the AVX-512 half: a tile's 16 columns are two
// 256-bit halves of 8 (each step's 64 bytes are [column][4 codes], so bytes 0-31 are columns 0-7),
// and each half's integer dot product is the same exact int32 sum per column, followed by the same
// float epilogue in the same group order. Without VNNI the dot product is vpmaddubsw (unsigned
// code x signed activation, pairs added into int16) then vpmaddwd by ones (pairs into int32).
// vpmaddubsw saturates at 2^15, so int16 partial sums gather only as many steps as cannot reach
// it: 2 x (2^bits - 1) x 127 per step (4-bit codes: 8 steps; 5-bit: 4; 6-bit: 2), and 8-bit codes
// go as two nibbles (16 hi + lo). With AVX-VNNI (vpdpbusd on 256 bits: Alder Lake and later) the
// sums go straight to int32.
//
// The activation codes are stored broadcast (each step's 4 codes repeated over 32 bytes), so every
// vpmaddubsw reads its activations straight from memory; with several rows a group's decoded codes
// stay in registers while every row passes (parts outer, rows inner).

constexpr int kHalf = 8;  // columns (int32 or float lanes) per 256-bit half of a tile
constexpr int kXqBytes = 8;  // bytes of xq per activation code: each step's 4 codes, 8 times

// Offset of row r, group g in the broadcast activation codes, blocked as xq_at's: [rows / 16, groups,
// 16, G / 4 steps, 32 bytes], so a group's rows lie together (rows [rows, groups, ...] apart, a
// multiple of 4 KiB for 1536 inputs, fell in the same L1 sets).
template <int G>
inline int64_t xb_at(int64_t r, int64_t g, int64_t groups) {
  return xq_at<G>(r, g, groups) * kXqBytes;
}

// The activation codes of step s of a group (xr: the group's first), one int32 of 4 codes per lane.
inline __m256i xstep(const int8_t* xr, int s) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * s));
}

// x [rows, in] float32 -> xq (broadcast int8 codes, see xb_at), xs [rows, groups] (the group's
// scale), xc [rows, groups] (scale * sum of the group's codes, which the offsets multiply).
template <int G>
void quantize_rows(const float* x, int64_t rows, int64_t n_in, int8_t* xq, float* xs, float* xc) {
  const int64_t groups = n_in / G;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* p = x + r * n_in + g * G;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < G; i += kHalf) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(p + i), magnitude));
        alignas(32) float lanes[kHalf];
        _mm256_store_ps(lanes, amax);
        float m = lanes[0];
        for (int l = 1; l < kHalf; ++l) m = lanes[l] > m ? lanes[l] : m;
        const float scale = m / 127.0f;
        const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
        __m256i sum = _mm256_setzero_si256();
        int8_t* dst = xq + xb_at<G>(r, g, groups);
        for (int i = 0; i < G; i += kHalf) {  // two steps of 4 codes
          const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + i), inv));
          const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
          const __m128i b8 = _mm_packs_epi16(w16, w16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i), _mm256_set1_epi32(_mm_cvtsi128_si32(b8)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i + 32), _mm256_set1_epi32(_mm_extract_epi32(b8, 1)));
          sum = _mm256_add_epi32(sum, q);
        }
        alignas(32) int32_t parts[kHalf];
        _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
        int32_t total = 0;
        for (int l = 0; l < kHalf; ++l) total += parts[l];
        xs[r * groups + g] = scale;
        xc[r * groups + g] = scale * static_cast<float>(total);
      }
    }
  });
}

// The int8 sub-scales of 8 columns, widened to float32.
inline __m256 sub_scales(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 f16_scales(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The scales (vs) and offsets (vo) of one tile and group, half h (columns 8h..8h+7), as float32.
template <int MODE>
inline void load_scales(const ScaleTable& t, int64_t tile, int64_t g, int64_t sup, int h, __m256& vs, __m256& vo) {
  constexpr int64_t kFields = scale_fields(MODE);
  const int64_t at = tile_slot(tile, g, t.groups) * kFields * kLanes + h * kHalf;
  const int64_t at_super = tile_slot(tile, sup, t.supers) * kFields * kLanes + h * kHalf;
  if constexpr (MODE == kScaleF32) {
    vs = _mm256_loadu_ps(t.f32 + at);
    vo = _mm256_loadu_ps(t.f32 + at + kLanes);
  } else if constexpr (MODE == kScaleF16) {
    vs = f16_scales(t.f16 + at);
    vo = f16_scales(t.f16 + at + kLanes);
  } else if constexpr (MODE == kScaleSuper) {
    vs = _mm256_mul_ps(_mm256_loadu_ps(t.f32 + at_super), sub_scales(t.sub + at));
    vo = _mm256_mul_ps(_mm256_loadu_ps(t.f32 + at_super + kLanes), sub_scales(t.sub + at + kLanes));
  } else {  // symmetric: the offset is the scale times -2^(b-1), exactly
    if constexpr (MODE == kScaleF16Sym) {
      vs = f16_scales(t.f16 + at);
    } else {
      vs = _mm256_mul_ps(_mm256_loadu_ps(t.f32 + at_super), sub_scales(t.sub + at));
    }
    vo = _mm256_mul_ps(vs, _mm256_set1_ps(t.neg_shift));
  }
}

// One group's contribution to 8 outputs of a row: acc + scale * (dot * xs) + offset * xc.
inline __m256 epilogue(__m256 acc, __m256i dot, __m256 scale, __m256 offset, float xs, float xc) {
  acc = _mm256_fmadd_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xs)), acc);
  return _mm256_fmadd_ps(offset, _mm256_set1_ps(xc), acc);
}

// Step s of half h of one tile and group (base: the group's codes + 32 h): [8 columns][4 codes].
// 4 bits: step s's nibbles (low for the first half of the steps, high for the second); 5 and 6
// bits: with its top bits from the group's last 64-byte plane.
template <int BITS, int G>
inline __m256i decode_step(const uint8_t* base, int s) {
  constexpr int kSteps = G / 4;
  static_assert(BITS == 4 || (BITS == 5 && kSteps <= 8) || (BITS == 6 && kSteps <= 4), "unsupported packing");
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64 * (s % (kSteps / 2))));
  const __m256i v = s < kSteps / 2 ? _mm256_and_si256(raw, low) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  if constexpr (BITS == 4) {
    return v;
  } else {
    constexpr int kWidthBits = BITS - 4;
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32 * kSteps));
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << kWidthBits) - 1) << 4));
    const int pos = kWidthBits * s;
    const __m256i moved = pos <= 4 ? _mm256_slli_epi16(plane, 4 - pos) : _mm256_srli_epi16(plane, pos - 4);
    return _mm256_or_si256(v, _mm256_and_si256(moved, mask));
  }
}

// The codes of half h of one tile and group: v[step] = [8 columns][4 codes] (bytes 32h.. of each
// step's 64).
template <int BITS, int G>
inline void decode_half(const uint8_t* wp, int h, __m256i (&v)[G / 4]) {
  constexpr int kSteps = G / 4;
  const uint8_t* base = wp + 32 * h;
#pragma GCC unroll 16
  for (int s = 0; s < kSteps; ++s) {
    if constexpr (BITS == 8) v[s] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64 * s));
    else v[s] = decode_step<BITS, G>(base, s);
  }
}

// The scales of tile `tile`, group g, towards L1 (kPrefetchGroups ahead, as the codes): without
// it a one-row call waited on them (14.8 GB/s on a Q4_K layer, against 33 for a plain read).
template <int MODE>
inline void prefetch_scales(const ScaleTable& t, int64_t tile, int64_t g) {
  if (g >= t.groups) return;
  constexpr int64_t kFields = scale_fields(MODE);
  const int64_t at = tile_slot(tile, g, t.groups) * kFields * kLanes;
  if constexpr (MODE == kScaleF32) {
    _mm_prefetch(reinterpret_cast<const char*>(t.f32 + at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t.f32 + at + kLanes), _MM_HINT_T0);
  } else if constexpr (MODE == kScaleF16 || MODE == kScaleF16Sym) {
    _mm_prefetch(reinterpret_cast<const char*>(t.f16 + at), _MM_HINT_T0);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(t.sub + at), _MM_HINT_T0);
    const int64_t sup = tile_slot(tile, super_of(t, g), t.supers) * kFields * kLanes;
    _mm_prefetch(reinterpret_cast<const char*>(t.f32 + sup), _MM_HINT_T0);
    if constexpr (kFields == 2) _mm_prefetch(reinterpret_cast<const char*>(t.f32 + sup + kLanes), _MM_HINT_T0);
  }
}

// Exact int32 sums, per column of a half, of the group's codes times the row's activation codes
// (xr: the row's broadcast codes of the group).
template <int BITS, int G>
inline __m256i dot_half(const __m256i (&v)[G / 4], const int8_t* xr) {
  constexpr int kSteps = G / 4;
#if defined(__AVXVNNI__)
  __m256i acc = _mm256_setzero_si256();
  for (int s = 0; s < kSteps; ++s) acc = _mm256_dpbusd_avx_epi32(acc, v[s], xstep(xr, s));
  return acc;
#else
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  if constexpr (BITS == 8) {  // u = 16 * (u >> 4) + (u & 15): two 4-bit dot products
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int c0 = 0; c0 < kSteps; c0 += int16_steps(4)) {
      __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256();
      for (int s = c0; s < c0 + int16_steps(4) && s < kSteps; ++s) {
        const __m256i xb = xstep(xr, s);
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v[s], 4), low), xb));
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(v[s], low), xb));
      }
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, ones));
    }
  } else {
    constexpr int kChunk = int16_steps(BITS) < kSteps ? int16_steps(BITS) : kSteps;
    for (int c0 = 0; c0 < kSteps; c0 += kChunk) {
      __m256i p[kChunk];  // the chunk's products, added pairwise (a tree, not a chain of adds)
      for (int s = 0; s < kChunk; ++s) p[s] = _mm256_maddubs_epi16(v[c0 + s], xstep(xr, c0 + s));
      for (int width = kChunk / 2; width > 0; width /= 2)
        for (int s = 0; s < width; ++s) p[s] = _mm256_add_epi16(p[s], p[s + width]);
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p[0], ones));
    }
  }
  return acc;
#endif
}

// A tile's codes and scales kPrefetchGroups groups ahead of group g (wg: its codes), towards L1.
template <int BITS, int G, int MODE>
inline void prefetch_ahead(const uint8_t* wg, const ScaleTable& st, int64_t tile, int64_t g, int64_t groups) {
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  if (g + kPrefetchGroups < groups) prefetch_group<kTileBytes>(wg + kPrefetchBytes<kTileBytes>);
  prefetch_scales<MODE>(st, tile, g + kPrefetchGroups);
}

// Prefetching for a sweep of one (tile, half) over its groups, at group g (wg: its codes): the first
// half streams this tile from memory, kPrefetchGroups ahead; the second reads it again from cache,
// while the next tile comes from memory.
template <int BITS, int G, int MODE>
inline void prefetch_sweep(const uint8_t* w, const ScaleTable& st, int64_t tile, int h, int64_t g, int64_t groups) {
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  if (h == 0) {
    prefetch_ahead<BITS, G, MODE>(w + tile_slot(tile, g, groups) * kTileBytes, st, tile, g, groups);
  } else {
    prefetch_group<kTileBytes>(w + tile_slot(tile + 1, g, groups) * kTileBytes);
    prefetch_scales<MODE>(st, tile + 1, g);
  }
}

// Half h of one tile and group (wg: its codes): the codes decoded, its scales and offsets.
template <int BITS, int G, int MODE>
inline void load_half(const uint8_t* wg, const ScaleTable& st, int64_t tile, int64_t g, int64_t sup, int h,
                      __m256i (&wv)[G / 4], __m256& vs, __m256& vo) {
  decode_half<BITS, G>(wg, h, wv);
  load_scales<MODE>(st, tile, g, sup, h, vs, vo);
}

// Rows [r0, r0 + R) of one (tile, half): their 8 outputs accumulated in registers over every group.
template <int BITS, int G, int MODE, int R>
inline void half_rows(const uint8_t* w, const ScaleTable& st, int64_t tile, int h, int64_t groups, const int8_t* xq,
                      const float* xs, const float* xc, int64_t r0, float* acc, int64_t acc_stride) {
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  __m256 a[R];
  for (int i = 0; i < R; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t g = 0, sup = 0, in_sup = 0; g < groups; ++g) {
    const uint8_t* wg = w + tile_slot(tile, g, groups) * kTileBytes;
    prefetch_sweep<BITS, G, MODE>(w, st, tile, h, g, groups);
    __m256i wv[G / 4];
    __m256 vs, vo;
    load_half<BITS, G, MODE>(wg, st, tile, g, sup, h, wv, vs, vo);
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      a[i] = epilogue(a[i], dot_half<BITS, G>(wv, xq + xb_at<G>(r, g, groups)), vs, vo, xs[r * groups + g],
                      xc[r * groups + g]);
    }
    if (++in_sup == st.super_groups) in_sup = 0, ++sup;
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + i * acc_stride, a[i]);
}

// Rows [r0, r0 + R) of one (tile, half), steps outer and rows inner: each step's codes are decoded
// once into one register and serve every row, whose int16 partial sums and float outputs stay in
// registers (2R + 5 of AVX2's 16), so no decoded group has to wait in registers for every row.
template <int BITS, int G, int MODE, int R>
inline void half_rows_steps(const uint8_t* w, const ScaleTable& st, int64_t tile, int h, int64_t groups,
                            const int8_t* xq, const float* xs, const float* xc, int64_t r0, float* acc,
                            int64_t acc_stride) {
  static_assert(BITS != 8, "8-bit codes take two products a step: half_rows");
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  constexpr int kSteps = G / 4;
  constexpr int kChunk = int16_steps(BITS) < kSteps ? int16_steps(BITS) : kSteps;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t g = 0, sup = 0, in_sup = 0; g < groups; ++g) {
    const uint8_t* wg = w + tile_slot(tile, g, groups) * kTileBytes;
    prefetch_sweep<BITS, G, MODE>(w, st, tile, h, g, groups);
    const int8_t* xr[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) xr[i] = xq + xb_at<G>(r0 + i, g, groups);
    __m256i d[R];
#pragma GCC unroll 16
    for (int c0 = 0; c0 < kSteps; c0 += kChunk) {
      __m256i p[R];
#pragma GCC unroll 16
      for (int s = c0; s < c0 + kChunk; ++s) {
        const __m256i v = decode_step<BITS, G>(wg + 32 * h, s);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          const __m256i prod = _mm256_maddubs_epi16(v, xstep(xr[i], s));
          p[i] = s == c0 ? prod : _mm256_add_epi16(p[i], prod);
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m256i wide = _mm256_madd_epi16(p[i], ones);
        d[i] = c0 == 0 ? wide : _mm256_add_epi32(d[i], wide);
      }
    }
    __m256 vs, vo;
    load_scales<MODE>(st, tile, g, sup, h, vs, vo);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      a[i] = epilogue(a[i], d[i], vs, vo, xs[r * groups + g], xc[r * groups + g]);
    }
    if (++in_sup == st.super_groups) in_sup = 0, ++sup;
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + i * acc_stride, a[i]);
}

// Up to this many rows of 4-6 bit codes go through half_rows_steps. On zen3 (2 threads, the 1.5B's
// gate/up, down and head shapes, best of 3-5 processes alternating with the loops before) 2-4 rows
// took 1.1-1.5x less time; at 5 rows it was even, and from 6 rows tile_step's general loop (each
// group decoded once for every row) is as fast or faster.
constexpr int kRowSteps = 4;
constexpr int kRowRegs = 3;  // up to this many rows of 8-bit codes keep their sums in registers (half_rows)

// Rows [r0, r0 + R) of one (tile, half) with their sums in registers: 8-bit codes (two products a
// step) through half_rows, narrower ones through half_rows_steps.
template <int BITS, int G, int MODE, int R>
inline void half_in_registers(const uint8_t* w, const ScaleTable& st, int64_t tile, int h, int64_t groups,
                              const int8_t* xq, const float* xs, const float* xc, int64_t r0, float* acc,
                              int64_t acc_stride) {
  if constexpr (BITS == 8) half_rows<BITS, G, MODE, R>(w, st, tile, h, groups, xq, xs, xc, r0, acc, acc_stride);
  else half_rows_steps<BITS, G, MODE, R>(w, st, tile, h, groups, xq, xs, xc, r0, acc, acc_stride);
}

// Columns of tiles [tile, tile + kTilesPerStep) for rows [r_begin, r_end): acc [r_end - r_begin, 32].
// Up to kRowSteps rows of 4-6 bit codes (kRowRegs of 8-bit ones): each (tile, half) sweeps every
// group with the rows' sums in registers. More: each (tile, half) of a group is decoded into
// registers once and serves every row, whose sums wait in acc (decoding a group again per few rows
// cost more than the sums' trips to L1).
template <int BITS, int G, int MODE>
void tile_step(const uint8_t* w, const ScaleTable& st, int64_t tile, int64_t groups,
               const int8_t* xq, const float* xs, const float* xc, int64_t r_begin, int64_t r_end, float* acc) {
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  constexpr int kWidth = kTilesPerStep * kLanes;
  const int64_t rows = r_end - r_begin;
  if (rows <= (BITS == 8 ? kRowRegs : kRowSteps)) {
    for (int n = 0; n < kTilesPerStep; ++n)
      for (int h = 0; h < 2; ++h) {
        float* a = acc + (2 * n + h) * kHalf;
        if (rows == 4) half_in_registers<BITS, G, MODE, 4>(w, st, tile + n, h, groups, xq, xs, xc, r_begin, a, kWidth);
        else if (rows == 3) half_in_registers<BITS, G, MODE, 3>(w, st, tile + n, h, groups, xq, xs, xc, r_begin, a, kWidth);
        else if (rows == 2) half_in_registers<BITS, G, MODE, 2>(w, st, tile + n, h, groups, xq, xs, xc, r_begin, a, kWidth);
        else half_in_registers<BITS, G, MODE, 1>(w, st, tile + n, h, groups, xq, xs, xc, r_begin, a, kWidth);
      }
    return;
  }
  std::memset(acc, 0, sizeof(float) * rows * kWidth);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t sup = super_of(st, g);
    for (int n = 0; n < kTilesPerStep; ++n) {
      const uint8_t* wg = w + tile_slot(tile + n, g, groups) * kTileBytes;
      prefetch_ahead<BITS, G, MODE>(wg, st, tile + n, g, groups);
      for (int h = 0; h < 2; ++h) {
        __m256i wv[G / 4];
        __m256 vs, vo;
        load_half<BITS, G, MODE>(wg, st, tile + n, g, sup, h, wv, vs, vo);
        float* a = acc + (2 * n + h) * kHalf;
        for (int64_t r = r_begin; r < r_end; ++r, a += kWidth) {
          const __m256i dot = dot_half<BITS, G>(wv, xq + xb_at<G>(r, g, groups));
          _mm256_storeu_ps(a, epilogue(_mm256_loadu_ps(a), dot, vs, vo, xs[r * groups + g], xc[r * groups + g]));
        }
      }
    }
  }
}

// One row (a batch-1 decode): tile_step's operations for r_end = r + 1, the accumulators in
// registers and each half decoded just before its dot product.
template <int BITS, int G, int MODE>
void tile_step_row(const uint8_t* w, const ScaleTable& st, int64_t tile, int64_t groups, const int8_t* xq,
                   const float* xs, const float* xc, int64_t r, float* acc) {
  constexpr int kTileBytes = tile_bytes<BITS, G>();
  constexpr int kParts = kTilesPerStep * 2;
  __m256 a[kParts];
  for (int part = 0; part < kParts; ++part) a[part] = _mm256_setzero_ps();
  for (int64_t g = 0, sup = 0, in_sup = 0; g < groups; ++g) {
    const int8_t* xr = xq + xb_at<G>(r, g, groups);
    const float xsg = xs[r * groups + g], xcg = xc[r * groups + g];
    for (int n = 0; n < kTilesPerStep; ++n) {
      const uint8_t* wg = w + tile_slot(tile + n, g, groups) * kTileBytes;
      prefetch_ahead<BITS, G, MODE>(wg, st, tile + n, g, groups);
      for (int h = 0; h < 2; ++h) {
        __m256i wv[G / 4];
        __m256 vs, vo;
        load_half<BITS, G, MODE>(wg, st, tile + n, g, sup, h, wv, vs, vo);
        a[2 * n + h] = epilogue(a[2 * n + h], dot_half<BITS, G>(wv, xr), vs, vo, xsg, xcg);
      }
    }
    if (++in_sup == st.super_groups) in_sup = 0, ++sup;
  }
  for (int part = 0; part < kParts; ++part) _mm256_storeu_ps(acc + part * kHalf, a[part]);
}
