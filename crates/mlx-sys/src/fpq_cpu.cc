// CPU kernels for MLX's microscaling quantization modes, registered as MLX primitives beside
// the affine ones (qmm_cpu.cc), in the same two shapes:
//
// - Few rows (decode): each output row reads its packed weights once; 8 values at a time are
//   decoded in registers, multiplied by their group's scale and taken into up to four rows of x.
// - Many rows (prefill): tiles of weight rows are decoded to float32 for sgemm (tiled_product).
//
// The formats (MLX's `QuantizationMode`): values are FP4 E2M1 (mxfp4, nvfp4) or FP8 E4M3
// (mxfp8), packed little-endian in uint32 words (value k of a row at bit k·bits, as affine
// 4- and 8-bit); each group of 32 (16 for nvfp4) has one uint8 scale, a power of two 2^(s−127)
// (E8M0; mxfp4, mxfp8) or an E4M3 float (nvfp4). A value is code × scale, with no bias. Every
// decoded weight is MLX's exactly (a product of a few-bit code and a power of two or an E4M3
// number is exact in float32), so only the order of the sums differs from MLX's kernels.
//
// Decoding, 8 values per step with AVX2 and 16 with AVX-512:
// - E2M1: the word shifted per lane (srlv) leaves each code in a lane's low bits; a lane
//   permute looks it up: AVX-512's reads 4 index bits, the sign included; AVX2's reads 3 (the
//   magnitudes {0, ½, 1, 1½, 2, 3, 4, 6}) and the code's bit 3, shifted to bit 31, is the sign.
// - E4M3: the byte moved into a half float's bits and converted (F16C), see fp8_to_float.
// A group's codes are summed against x first and the sum scaled once. With AVX-512, FP4 rows
// of whole 128-value blocks read x in lane order instead (qmv_lanes): 16 words side by side,
// field j of each a shift away, so a block costs one load, 7 shifts, 8 lookups and 8 FMAs a
// row of x, and its 16 lanes are scaled once by their words' group scales.

#include "mlx-sys/src/fpq_cpu.h"
#include "mlx-sys/src/cpu_common.h"
#include "mlx-sys/src/qmm_cpu.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// GCC 12's AVX-512 intrinsics give their undefined operands themselves as a value
// (`__Y = __Y`), which its own -Wuninitialized then reports wherever they are inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace mx = mlx::core;

namespace mlxr {

namespace {

enum class Mode : int { Mxfp4 = 1, Nvfp4 = 2, Mxfp8 = 3 };

// A mode's value width and group size, MLX's only ones for it.
struct Format {
  int bits, group;
};

std::optional<Format> format_of(int mode) {
  switch (mode) {
    case (int)Mode::Mxfp4: return Format{4, 32};
    case (int)Mode::Nvfp4: return Format{4, 16};
    case (int)Mode::Mxfp8: return Format{8, 32};
    default: return std::nullopt;
  }
}

// An E4M3 (fn: no infinities, 0x7f NaN) number.
float e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7)
    v = std::numeric_limits<float>::quiet_NaN();
  else
    v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

// Every code of each format, decoded once.
struct Tables {
  float e2m1[16];
  float e4m3[256];
  // 2^(s − 127): s = 0 is 2^−127, s = 255 infinity, as MLX reads E8M0 scales.
  float e8m0[256];
};

const Tables& tables() {
  static const Tables t = [] {
    Tables t{};
    const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int i = 0; i < 16; ++i) t.e2m1[i] = i < 8 ? mags[i] : -mags[i - 8];
    for (int i = 0; i < 256; ++i) {
      t.e4m3[i] = e4m3((uint8_t)i);
      t.e8m0[i] = std::ldexp(1.0f, i - 127);
    }
    return t;
  }();
  return t;
}

// One product's sizes: x [M, K], w [N, K] in `mode`.
struct Shape {
  int M, N, K;
  Mode mode;
  int bits() const { return mode == Mode::Mxfp8 ? 8 : 4; }
  int group() const { return mode == Mode::Nvfp4 ? 16 : 32; }
  int groups() const { return K / group(); }
  size_t row_words() const { return (size_t)K * bits() / 32; }
  // The decoded scale of each uint8 code.
  const float* scale_table() const { return mode == Mode::Nvfp4 ? tables().e4m3 : tables().e8m0; }
};

// Row n's scales, decoded.
inline float scale_at(const uint8_t* sc, const Shape& s, int n, int g) {
  return s.scale_table()[sc[(size_t)n * s.groups() + g]];
}

// Value k of a packed row, its code decoded (without the scale).
inline float value_at(const uint32_t* row, int k, const Shape& s) {
  if (s.bits() == 4) return tables().e2m1[(row[k / 8] >> (4 * (k % 8))) & 15];
  return tables().e4m3[(row[k / 4] >> (8 * (k % 4))) & 255];
}

// Rows [n0, n1) and columns [k0, k1) (whole groups) of w as float32, row-major.
void dequantize_rows_scalar(
    const uint32_t* w, const uint8_t* sc, float* dst, const Shape& s, int n0, int n1, int k0, int k1) {
  const int G = s.group();
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * s.row_words();
    float* d = dst + (size_t)(n - n0) * (k1 - k0) - k0;
    for (int g = k0 / G; g < k1 / G; ++g) {
      const float a = scale_at(sc, s, n, g);
      for (int k = g * G; k < (g + 1) * G; ++k) d[k] = value_at(wr, k, s) * a;
    }
  }
}

// Rows [n0, n1) of out [M, N] = x · dequantize(w)ᵀ, one product at a time.
void qmv_scalar(const float* x, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int n0, int n1) {
  const int G = s.group();
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * s.row_words();
    for (int m = 0; m < s.M; ++m) {
      const float* xr = x + (size_t)m * s.K;
      float acc = 0.0f;
      for (int g = 0; g < s.groups(); ++g) {
        const float a = scale_at(sc, s, n, g);
        for (int k = g * G; k < (g + 1) * G; ++k) acc += xr[k] * (value_at(wr, k, s) * a);
      }
      out[(size_t)m * s.N + n] = acc;
    }
  }
}

// E4M3's bits are a half float's shifted: sign at bit 15 and the 7 magnitude bits at bits 7-13
// give a float16 of exactly the value · 2^−8 (normal and subnormal numbers alike, the exponent
// bias 15 against 7), which F16C converts to float32. So a code costs a widening, three
// integer ops and the conversion; the 2^8 goes into the group's scale (kFp8Rebase). The NaN
// codes (magnitude 0x7f) would read as ±480 and are set apart.
constexpr float kFp8Rebase = 256.0f;

// 8 codes of E4M3 as half floats (8 × 16 bits).
__attribute__((target("avx2,fma,f16c"))) inline __m256 fp8_to_float(__m128i bytes8) {
  const __m128i u = _mm_cvtepu8_epi16(bytes8);
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(u, 8), 1), _mm_set1_epi16((short)0xBFFF));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
  // An all-ones half is a NaN, and stays one through the conversion.
  return _mm256_cvtph_ps(_mm_or_si128(h, nan));
}

// 16 codes of E4M3 the same way.
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 fp8x16_to_float(__m128i bytes16) {
  const __m256i u = _mm256_cvtepu8_epi16(bytes16);
  const __m256i h =
      _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(u, 8), 1), _mm256_set1_epi16((short)0xBFFF));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
  return _mm512_cvtph_ps(_mm256_or_si256(h, nan));
}

// Values [8i, 8i + 8) of a packed row: E2M1 codes decoded, E4M3 codes decoded · 2^−8.
template <int BITS>
__attribute__((target("avx2,fma,f16c"))) inline __m256 decode8(const uint32_t* row, int i) {
  if constexpr (BITS == 4) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256 mags = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32((int)row[i]), shifts);
    const __m256 mag = _mm256_permutevar8x32_ps(mags, codes);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
  } else {
    return fp8_to_float(_mm_loadl_epi64((const __m128i*)(row + 2 * i)));
  }
}

// The factor decode8's values take besides their group's scale.
template <int BITS>
constexpr float decode_factor() {
  return BITS == 8 ? kFp8Rebase : 1.0f;
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void dequantize_rows_avx(
    const uint32_t* w, const uint8_t* sc, float* dst, const Shape& s, int n0, int n1, int k0, int k1) {
  const int G = s.group();
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * s.row_words();
    float* d = dst + (size_t)(n - n0) * (k1 - k0) - k0;
    for (int g = k0 / G; g < k1 / G; ++g) {
      // Exact: a power of two times a code, or (nvfp4) an E4M3 scale times an E2M1 code.
      const __m256 a = _mm256_set1_ps(scale_at(sc, s, n, g) * decode_factor<BITS>());
      for (int i = g * G / 8; i < (g + 1) * G / 8; ++i)
        _mm256_storeu_ps(d + (size_t)i * 8, _mm256_mul_ps(decode8<BITS>(wr, i), a));
    }
  }
}

void dequantize_rows(
    const uint32_t* w, const uint8_t* sc, float* dst, const Shape& s, int n0, int n1, int k0, int k1) {
  if (!has_avx2()) return dequantize_rows_scalar(w, sc, dst, s, n0, n1, k0, k1);
  if (s.bits() == 4) return dequantize_rows_avx<4>(w, sc, dst, s, n0, n1, k0, k1);
  dequantize_rows_avx<8>(w, sc, dst, s, n0, n1, k0, k1);
}

// Rows [n0, n1) of out for R rows of x: a group's decoded codes go into each row's group sum,
// which then goes into the row's total times the group's scale (one FMA per group, not a
// multiply per 8 codes). A row's result does not depend on the rows beside it.
template <int BITS, int R>
__attribute__((target("avx2,fma,f16c"))) void qmv_rows(
    const float* x, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int n0, int n1) {
  const int G = s.group(), steps = G / 8;
  const float* table = s.scale_table();
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * s.row_words();
    const uint8_t* sr = sc + (size_t)n * s.groups();
    __m256 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm256_setzero_ps();
    for (int g = 0; g < s.groups(); ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + (size_t)g * G * BITS / 32) + 2048, _MM_HINT_T0);
      __m256 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
      for (int j = 0; j < steps; ++j) {
        const int i = g * steps + j;
        const __m256 v = decode8<BITS>(wr, i);
        for (int r = 0; r < R; ++r)
          part[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)r * s.K + 8 * i), v, part[r]);
      }
      const __m256 a = _mm256_set1_ps(table[sr[g]] * decode_factor<BITS>());
      for (int r = 0; r < R; ++r) tot[r] = _mm256_fmadd_ps(part[r], a, tot[r]);
    }
    for (int r = 0; r < R; ++r) out[(size_t)r * s.N + n] = hsum(tot[r]);
  }
}

// The same 16 codes at a time with AVX-512: E2M1 codes are looked up with their sign in one
// 16-entry permute (of two packed words, lanes 8-15 reading the second), E4M3 as above.
template <int BITS, int R>
__attribute__((target("avx512f,avx2,fma,f16c"))) void qmv_rows512(
    const float* x, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int n0, int n1) {
  const int G = s.group(), steps = G / 16;
  const float* table = s.scale_table();
  const __m512 lut = _mm512_loadu_ps(tables().e2m1);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * s.row_words();
    const uint8_t* sr = sc + (size_t)n * s.groups();
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    for (int g = 0; g < s.groups(); ++g) {
      // Two kilobytes ahead: the hardware prefetcher alone left these rows at a third of the
      // read bandwidth on an Intel Xeon (the affine kernels prefetch the same way).
      _mm_prefetch(reinterpret_cast<const char*>(wr + (size_t)g * G * BITS / 32) + 2048, _MM_HINT_T0);
      __m512 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
      for (int j = 0; j < steps; ++j) {
        const int i = g * steps + j;
        __m512 v;
        if constexpr (BITS == 4) {
          const __m512i two = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)(wr + 2 * i)));
          const __m512i codes = _mm512_srlv_epi32(_mm512_permutexvar_epi32(halves, two), shifts);
          v = _mm512_permutexvar_ps(codes, lut);
        } else {
          v = fp8x16_to_float(_mm_loadu_si128((const __m128i*)(wr + 4 * i)));
        }
        for (int r = 0; r < R; ++r)
          part[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)r * s.K + 16 * i), v, part[r]);
      }
      const __m512 a = _mm512_set1_ps(table[sr[g]] * decode_factor<BITS>());
      for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(part[r], a, tot[r]);
    }
    for (int r = 0; r < R; ++r) out[(size_t)r * s.N + n] = _mm512_reduce_add_ps(tot[r]);
  }
}

// A block's 16 group scales, lane l holding the scale of word l's group: 4 E8M0 codes (mxfp4,
// 4 words a group) as 2^(s − 127), built in the float's exponent bits (s = 0, a subnormal, set
// apart); or 8 E4M3 codes (nvfp4, 2 words a group) · 2^−8, as fp8_to_float gives them.
template <bool NV>
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 block_scales(const uint8_t* sr, int b) {
  if constexpr (NV) {
    const __m512 eight = _mm512_castps256_ps512(fp8_to_float(_mm_loadl_epi64((const __m128i*)(sr + 8 * b))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), eight);
  } else {
    int32_t four;
    std::memcpy(&four, sr + 4 * b, 4);
    const __m512i codes = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_cvtepu8_epi32(_mm_cvtsi32_si128(four)));
    const __m512i bits = _mm512_mask_mov_epi32(
        _mm512_slli_epi32(codes, 23), _mm512_cmpeq_epi32_mask(codes, _mm512_setzero_si512()),
        _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(bits);
  }
}

// FP4 rows with x in lane order (fp4_lanes): one 64-byte load holds a 128-value block, 16 words;
// field j of every word is a shift away (the permute reads an index's low 4 bits, so no mask)
// and is looked up with its sign against field j's 16 values of x. A word's 8 values share a
// group, so each lane's sum is scaled once a block by its word's group scale (block_scales),
// not once a group. W weight rows at a time (two for one row of x: more independent sums in
// flight), two sums per row (even and odd fields): a row's arithmetic is the same whichever
// rows are beside it.
template <int R, int W, bool NV>
__attribute__((target("avx512f,avx2,fma,f16c"))) void qmv_lanes(
    const float* xl, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int n) {
  const __m512 lut = _mm512_loadu_ps(tables().e2m1);
  const int blocks = s.K / 128;
  const uint32_t* wr[W];
  const uint8_t* sr[W];
  for (int v = 0; v < W; ++v) {
    wr[v] = w + (size_t)(n + v) * s.row_words();
    sr[v] = sc + (size_t)(n + v) * s.groups();
  }
  __m512 tot[W][R];
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r) tot[v][r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    __m512i words[W];
    for (int v = 0; v < W; ++v) {
      words[v] = _mm512_loadu_si512(wr[v] + 16 * b);
      _mm_prefetch(reinterpret_cast<const char*>(wr[v] + 16 * b) + 1024, _MM_HINT_T0);
    }
    __m512 part[W][R][2];
    for (int v = 0; v < W; ++v)
      for (int r = 0; r < R; ++r) part[v][r][0] = part[v][r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      for (int v = 0; v < W; ++v) {
        const __m512i codes = j == 0 ? words[v] : _mm512_srli_epi32(words[v], 4 * j);
        const __m512 val = _mm512_permutexvar_ps(codes, lut);
        for (int r = 0; r < R; ++r)
          part[v][r][j & 1] = _mm512_fmadd_ps(
              _mm512_loadu_ps(xl + (size_t)r * s.K + 128 * b + 16 * j), val, part[v][r][j & 1]);
      }
    }
    for (int v = 0; v < W; ++v) {
      const __m512 scale = block_scales<NV>(sr[v], b);
      for (int r = 0; r < R; ++r)
        tot[v][r] = _mm512_fmadd_ps(_mm512_add_ps(part[v][r][0], part[v][r][1]), scale, tot[v][r]);
    }
  }
  // nvfp4's scales came · 2^−8 (exact, as any power of two).
  const float rebase = NV ? kFp8Rebase : 1.0f;
  for (int v = 0; v < W; ++v)
    for (int r = 0; r < R; ++r) out[(size_t)r * s.N + n + v] = _mm512_reduce_add_ps(tot[v][r]) * rebase;
}

template <int R, bool NV>
void qmv_lanes_rows(const float* xl, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int n0, int n1) {
  int n = n0;
  if constexpr (R == 1)
    for (; n + 2 <= n1; n += 2) qmv_lanes<1, 2, NV>(xl, w, sc, out, s, n);
  for (; n < n1; ++n) qmv_lanes<R, 1, NV>(xl, w, sc, out, s, n);
}

template <bool NV>
void qmv_lanes_block(const float* xl, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int rows, int n0, int n1) {
  switch (rows) {
    case 1: return qmv_lanes_rows<1, NV>(xl, w, sc, out, s, n0, n1);
    case 2: return qmv_lanes_rows<2, NV>(xl, w, sc, out, s, n0, n1);
    case 3: return qmv_lanes_rows<3, NV>(xl, w, sc, out, s, n0, n1);
    default: return qmv_lanes_rows<4, NV>(xl, w, sc, out, s, n0, n1);
  }
}

template <int BITS>
void qmv_block(const float* x, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int rows, int n0, int n1) {
  // nvfp4's groups of 16 are one 16-lane step; mxfp's of 32, two.
  if (has_avx512()) {
    switch (rows) {
      case 1: return qmv_rows512<BITS, 1>(x, w, sc, out, s, n0, n1);
      case 2: return qmv_rows512<BITS, 2>(x, w, sc, out, s, n0, n1);
      case 3: return qmv_rows512<BITS, 3>(x, w, sc, out, s, n0, n1);
      default: return qmv_rows512<BITS, 4>(x, w, sc, out, s, n0, n1);
    }
  }
  switch (rows) {
    case 1: return qmv_rows<BITS, 1>(x, w, sc, out, s, n0, n1);
    case 2: return qmv_rows<BITS, 2>(x, w, sc, out, s, n0, n1);
    case 3: return qmv_rows<BITS, 3>(x, w, sc, out, s, n0, n1);
    default: return qmv_rows<BITS, 4>(x, w, sc, out, s, n0, n1);
  }
}

// Output rows per pool chunk: ~32 KB of packed weights and scales each.
int rows_per_chunk(const Shape& s) {
  const size_t row_bytes = s.row_words() * 4 + s.groups();
  return (int)std::max<size_t>(1, (32u << 10) / row_bytes);
}

// Output rows [n0, n1) of every row of x, on this thread (`lanes`: x in FP4 lane order, or null).
void qmv_range(
    const float* x, const float* lanes, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s, int n0, int n1) {
  if (!has_avx2()) return qmv_scalar(x, w, sc, out, s, n0, n1);
  for (int m = 0; m < s.M; m += 4) {
    const int rows = std::min(4, s.M - m);
    const Shape part{rows, s.N, s.K, s.mode};
    const float* xr = x + (size_t)m * s.K;
    float* o = out + (size_t)m * s.N;
    if (lanes && s.bits() == 4) {
      const float* xl = lanes + (size_t)m * s.K;
      if (s.mode == Mode::Nvfp4)
        qmv_lanes_block<true>(xl, w, sc, o, part, rows, n0, n1);
      else
        qmv_lanes_block<false>(xl, w, sc, o, part, rows, n0, n1);
    } else if (s.bits() == 4)
      qmv_block<4>(xr, w, sc, o, part, rows, n0, n1);
    else
      qmv_block<8>(xr, w, sc, o, part, rows, n0, n1);
  }
}

void qmv(const float* x, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s) {
  // Once a call, on the calling thread: the workers read it.
  const float* lanes = s.bits() == 4 ? fp4_lanes(x, s.M, s.K) : nullptr;
  for_rows(s.N, rows_per_chunk(s), [&](size_t a, size_t b) { qmv_range(x, lanes, w, sc, out, s, (int)a, (int)b); });
}

// One product x [M, K] · dequantize(w)ᵀ by whichever path suits its rows, counted.
void product(const float* x, const uint32_t* w, const uint8_t* sc, float* out, const Shape& s) {
  const bool tiles = s.M >= SGEMM_ROWS && sgemm() != nullptr;
  if (tiles)
    tiled_product(x, out, s.M, s.N, s.K, [&](float* dst, int n0, int n1, int k0, int k1) {
      dequantize_rows(w, sc, dst, s, n0, n1, k0, k1);
    });
  else
    qmv(x, w, sc, out, s);
  count_qmm_path(tiles);
}

struct ModeParams {
  int mode;
  bool operator==(const ModeParams&) const = default;
};

// x [..., K] @ dequantize(w)ᵀ, w [N, K·bits/32], scales [N, K/group].
struct FpQuantizedMatmulOp {
  using Params = ModeParams;
  static constexpr const char* name = "MlxrCpuFpQuantizedMatmul";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto &x = in[0], &w = in[1];
    const Shape s{(int)(x.size() / x.shape(-1)), (int)w.shape(0), (int)x.shape(-1), (Mode)p.mode};
    std::vector<float> xc;
    std::vector<uint32_t> wc;
    std::vector<uint8_t> sc;
    product(dense(x, xc), dense(w, wc), dense(in[2], sc), out.data<float>(), s);
  }
};

// x [B, M, K], w [E, N, K·bits/32], scales [E, N, K/group], idx [B] (uint32) → out [B, M, N]:
// row block b times expert idx[b] (expert_runs).
struct FpGatherQuantizedMatmulOp {
  using Params = ModeParams;
  static constexpr const char* name = "MlxrCpuFpGatherQuantizedMatmul";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto &x = in[0], &w = in[1], &idx = in[3];
    const int B = (int)idx.size(), M = (int)x.shape(-2), K = (int)x.shape(-1);
    const int E = (int)w.shape(0), N = (int)w.shape(1);
    std::vector<float> xd;
    std::vector<uint32_t> id, wc;
    std::vector<uint8_t> sd;
    const float* xp = dense(x, xd);
    const uint32_t* ip = dense(idx, id);
    const uint32_t* wp = dense(w, wc);
    const uint8_t* sp = dense(in[2], sd);
    float* op = out.data<float>();
    const Shape one{1, N, K, (Mode)p.mode};
    const size_t words = (size_t)N * one.row_words(), groups = (size_t)N * one.groups();
    expert_runs(ip, B, M, N, E, op, [&](int e, int b, int run) {
      const Shape s{run * M, N, K, (Mode)p.mode};
      product(xp + (size_t)b * M * K, wp + e * words, sp + e * groups, op + (size_t)b * M * N, s);
    });
  }
};

// dequantize(w): w [..., N, K·bits/32], scales [..., N, K/group] → [..., N, K] float32.
struct FpDequantizeOp {
  using Params = ModeParams;
  static constexpr const char* name = "MlxrCpuFpDequantize";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto& w = in[0];
    const Mode mode = (Mode)p.mode;
    const int K = (int)(w.shape(-1) * 32 / (mode == Mode::Mxfp8 ? 8 : 4));
    const Shape s{1, (int)(w.size() / w.shape(-1)), K, mode};
    std::vector<uint32_t> wc;
    std::vector<uint8_t> sc;
    const uint32_t* wp = dense(w, wc);
    const uint8_t* sp = dense(in[1], sc);
    float* o = out.data<float>();
    // Rows of at least 16 KB of output per chunk: a lookup of a few rows stays on this thread.
    for_rows(s.N, std::max(1, 4096 / K), [&](size_t n0, size_t n1) {
      dequantize_rows(wp, sp, o + n0 * K, s, (int)n0, (int)n1, 0, K);
    });
  }
};

// What every kernel here reads: the kernels on, the CPU, a microscaling mode at its own width
// and group, uint32 words with uint8 scales of the same rank, rows of whole groups.
bool format_applies(const mx::array& w, const mx::array& scales, int group_size, int bits, int mode) {
  const auto f = format_of(mode);
  return f && f->bits == bits && f->group == group_size && cpu_qmm_enabled() &&
         mx::default_device() == mx::Device::cpu && w.dtype() == mx::uint32 &&
         scales.dtype() == mx::uint8 && w.ndim() >= 1 && scales.ndim() == w.ndim() &&
         std::equal(w.shape().begin(), w.shape().end() - 1, scales.shape().begin()) &&
         (int64_t)w.shape(-1) * 32 == (int64_t)scales.shape(-1) * group_size * bits;
}

bool product_applies(
    const mx::array& x, const mx::array& w, const mx::array& scales, bool transpose, int group_size, int bits, int mode) {
  return transpose && format_applies(w, scales, group_size, bits, mode) && x.dtype() == mx::float32 &&
         x.ndim() >= 1 && x.size() > 0 && w.ndim() >= 2 &&
         (int64_t)x.shape(-1) * bits == (int64_t)w.shape(-1) * 32;
}

}  // namespace

bool fp_format(int mode, int bits, int group) {
  const auto f = format_of(mode);
  return f && f->bits == bits && f->group == group;
}

void fp_product(const float* x, const uint32_t* w, const uint8_t* sc, float* out, int M, int N, int K, int mode) {
  product(x, w, sc, out, Shape{M, N, K, (Mode)mode});
}

void fp_rows(
    const float* x, const float* lanes, const uint32_t* w, const uint8_t* sc, float* out, int M, int N, int K, int mode, int n0, int n1) {
  qmv_range(x, lanes, w, sc, out, Shape{M, N, K, (Mode)mode}, n0, n1);
}

void fp_dequantize_rows(const uint32_t* w, const uint8_t* sc, float* dst, int N, int K, int mode, int n0, int n1, int k0, int k1) {
  dequantize_rows(w, sc, dst, Shape{1, N, K, (Mode)mode}, n0, n1, k0, k1);
}

std::optional<mx::array> cpu_fp_quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales, bool transpose, int group_size, int bits, int mode) {
  if (!product_applies(x, w, scales, transpose, group_size, bits, mode) || w.ndim() != 2) return std::nullopt;
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return make<FpQuantizedMatmulOp>(shape, {mode}, {x, w, scales});
}

std::optional<mx::array> cpu_fp_gather_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& lhs_indices,
    const std::optional<mx::array>& rhs_indices,
    bool transpose,
    int group_size,
    int bits,
    int mode) {
  const bool fits = product_applies(x, w, scales, transpose, group_size, bits, mode) && w.ndim() == 3 &&
                    x.ndim() >= 2 && !lhs_indices && rhs_indices &&
                    mx::issubdtype(rhs_indices->dtype(), mx::integer);
  if (!fits) return std::nullopt;
  auto stream = mx::default_stream(mx::Device::cpu);
  const int M = x.shape(-2), K = x.shape(-1);
  mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
  mx::Shape batch = mx::broadcast_shapes(xb, rhs_indices->shape());
  mx::Shape xs = batch;
  xs.push_back(M);
  xs.push_back(K);
  // Broadcast views, read densely by the kernel itself.
  auto xc = mx::broadcast_to(x, xs, stream);
  auto ids = rhs_indices->dtype() == mx::uint32 ? *rhs_indices : mx::astype(*rhs_indices, mx::uint32, stream);
  auto ic = mx::broadcast_to(ids, batch, stream);
  mx::Shape os = batch;
  os.push_back(M);
  os.push_back(w.shape(1));
  return make<FpGatherQuantizedMatmulOp>(os, {mode}, {xc, w, scales, ic});
}

std::optional<mx::array> cpu_fp_dequantize(
    const mx::array& w, const mx::array& scales, int group_size, int bits, int mode) {
  if (!format_applies(w, scales, group_size, bits, mode) || w.size() == 0) return std::nullopt;
  auto shape = w.shape();
  shape.back() = (int)((int64_t)w.shape(-1) * 32 / bits);
  return make<FpDequantizeOp>(shape, {mode}, {w, scales});
}

}  // namespace mlxr
