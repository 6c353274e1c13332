// The few-rows product and the dequantization of affine-quantized matrices held as 16-output
// panels (qpanel_cpu.h).
//
// Per panel, per group, per row of x: two FMA chains of 16 outputs take the group's values in
// turn (field i of a word goes to chain i mod 2; the same chains at every row count), then
//   out += s · (c0 + c1) + b · sum_{k in group} x_k.
// Up to eight rows share each unpacked value; one or two rows take four or two panels at a
// time, so that the core has enough independent chains and streams to keep reading memory.
// A 4-bit field becomes a float by one permute of a 16-entry table indexed by the word shifted
// (vpermps reads an index's low 4 bits), an 8-bit one by a shift, a mask and a conversion, so a
// value costs two or three instructions beside one FMA per row of x.

#include "mlx-sys/src/qpanel_cpu.h"
#include "mlx-sys/src/cpu_common.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

// GCC 12's AVX-512 intrinsics give their undefined operands themselves as a value
// (`__Y = __Y`), which its own -Wuninitialized then reports wherever they are inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace mlxr {

namespace {

// AVX-512's foundation only (has_avx512()): no instruction here needs DQ, BW or VL.
#define QPANEL_TARGET __attribute__((target("avx512f,fma,avx2")))

// Field i of each of the 16 words as floats.
template <int BITS>
QPANEL_TARGET inline __m512 field(__m512i words, int i) {
  if constexpr (BITS == 4) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(i == 0 ? words : _mm512_srli_epi32(words, 4 * i), values);
  } else {
    const __m512i shifted = i == 0 ? words : _mm512_srli_epi32(words, 8 * i);
    return _mm512_cvtepi32_ps(i == 3 ? shifted : _mm512_and_si512(shifted, _mm512_set1_epi32(0xff)));
  }
}

// Panels [p, p + PN) for R (1..8) rows of x. Several panels at once (for few rows) are
// independent chains and streams for the core to overlap; each output's arithmetic is the same
// whatever PN and R are.
template <int BITS, int R, int PN>
QPANEL_TARGET void panel_rows(
    const float* x,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    int N,
    int K,
    int group,
    int p) {
  constexpr int P = 32 / BITS;
  const int words = K / P, groups = K / group, per_group = group / P;
  const size_t panel_words = (size_t)words * QPANEL, panel_groups = (size_t)groups * QPANEL;
  const uint32_t* wp = w + (size_t)p * panel_words;
  const float* sp = sc + (size_t)p * panel_groups;
  const float* bp = bi + (size_t)p * panel_groups;
  __m512 tot[PN][R];
  #pragma GCC unroll 4
  for (int n = 0; n < PN; ++n)
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) tot[n][r] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m512 c[PN][R][2];
    #pragma GCC unroll 4
    for (int n = 0; n < PN; ++n)
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) c[n][r][0] = c[n][r][1] = _mm512_setzero_ps();
    const uint32_t* wg = wp + (size_t)g * per_group * QPANEL;
    const float* xg = x + (size_t)g * group;
    for (int j = 0; j < per_group; ++j) {
      __m512i word[PN];
      #pragma GCC unroll 4
      for (int n = 0; n < PN; ++n) word[n] = _mm512_loadu_si512(wg + n * panel_words + (size_t)j * QPANEL);
      #pragma GCC unroll 8
      for (int i = 0; i < P; ++i) {
        #pragma GCC unroll 4
        for (int n = 0; n < PN; ++n) {
          const __m512 q = field<BITS>(word[n], i);
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            c[n][r][i & 1] = _mm512_fmadd_ps(q, _mm512_set1_ps(xg[(size_t)r * K + j * P + i]), c[n][r][i & 1]);
        }
      }
    }
    #pragma GCC unroll 4
    for (int n = 0; n < PN; ++n) {
      const size_t at = n * panel_groups + (size_t)g * QPANEL;
      const __m512 s = _mm512_loadu_ps(sp + at), b = _mm512_loadu_ps(bp + at);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        tot[n][r] = _mm512_fmadd_ps(s, _mm512_add_ps(c[n][r][0], c[n][r][1]), tot[n][r]);
        tot[n][r] = _mm512_fmadd_ps(b, _mm512_set1_ps(xsum[(size_t)r * groups + g]), tot[n][r]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int n = 0; n < PN; ++n)
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (size_t)r * N + (size_t)(p + n) * QPANEL, tot[n][r]);
}

// Panels [p0, p1) for rows [0, M) of x: one or two rows take four or two panels at once where
// they remain, more rows one panel in blocks of up to eight rows (the panel's words stay in L1).
template <int BITS>
void rows_of(
    const float* x,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    int M,
    int N,
    int K,
    int group,
    int p0,
    int p1) {
  const int groups = K / group;
  int p = p0;
  // Panels side by side while qpanel_batch(M) of them remain.
  constexpr int P1 = qpanel_batch(1), P2 = qpanel_batch(2), P3 = qpanel_batch(3), P4 = qpanel_batch(4);
  if (M == 1) {
    for (; p + P1 <= p1; p += P1) panel_rows<BITS, 1, P1>(x, xsum, w, sc, bi, out, N, K, group, p);
  } else if (M == 2) {
    for (; p + P2 <= p1; p += P2) panel_rows<BITS, 2, P2>(x, xsum, w, sc, bi, out, N, K, group, p);
  } else if (M == 3) {
    for (; p + P3 <= p1; p += P3) panel_rows<BITS, 3, P3>(x, xsum, w, sc, bi, out, N, K, group, p);
  } else if (M == 4) {
    for (; p + P4 <= p1; p += P4) panel_rows<BITS, 4, P4>(x, xsum, w, sc, bi, out, N, K, group, p);
  }
  for (; p < p1; ++p)
    for (int m = 0; m < M; m += 8) {
      const float* xm = x + (size_t)m * K;
      const float* sm = xsum + (size_t)m * groups;
      float* om = out + (size_t)m * N;
      switch (std::min(8, M - m)) {
        case 1: panel_rows<BITS, 1, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        case 2: panel_rows<BITS, 2, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        case 3: panel_rows<BITS, 3, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        case 4: panel_rows<BITS, 4, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        case 5: panel_rows<BITS, 5, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        case 6: panel_rows<BITS, 6, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        case 7: panel_rows<BITS, 7, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
        default: panel_rows<BITS, 8, 1>(xm, sm, w, sc, bi, om, N, K, group, p); break;
      }
    }
}

// Eight vectors v[i] (value i of eight consecutive inputs, lanes the panel's 16 outputs) stored
// as 16 rows of 8: d[l·ld + i] = v[i][l]. In-lane unpacks and shuffles give each 128-bit lane
// four values of four outputs; two-source permutes pair the lanes into rows.
QPANEL_TARGET inline void store_rows(const __m512 v[8], float* d, size_t ld) {
  const __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
  const __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
  const __m512 t4 = _mm512_unpacklo_ps(v[4], v[5]), t5 = _mm512_unpackhi_ps(v[4], v[5]);
  const __m512 t6 = _mm512_unpacklo_ps(v[6], v[7]), t7 = _mm512_unpackhi_ps(v[6], v[7]);
  // u[m] (m < 4): 128-bit lane q holds values 0-3 of output 4q + m; u[m + 4] its values 4-7.
  const __m512 u[8] = {
      _mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
      _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE),
      _mm512_shuffle_ps(t4, t6, 0x44), _mm512_shuffle_ps(t4, t6, 0xEE),
      _mm512_shuffle_ps(t5, t7, 0x44), _mm512_shuffle_ps(t5, t7, 0xEE),
  };
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  #pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512 a = _mm512_permutex2var_ps(u[m], lo, u[m + 4]);  // outputs m, 4 + m
    const __m512 b = _mm512_permutex2var_ps(u[m], hi, u[m + 4]);  // outputs 8 + m, 12 + m
    _mm256_storeu_ps(d + (size_t)m * ld, _mm512_castps512_ps256(a));
    _mm256_storeu_ps(d + (size_t)(4 + m) * ld, upper_half(a));
    _mm256_storeu_ps(d + (size_t)(8 + m) * ld, _mm512_castps512_ps256(b));
    _mm256_storeu_ps(d + (size_t)(12 + m) * ld, upper_half(b));
  }
}

template <int BITS>
QPANEL_TARGET void tile_of(
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* dst,
    size_t ld,
    int K,
    int group,
    int p0,
    int p1,
    int k0,
    int k1) {
  constexpr int P = 32 / BITS;
  const int words = K / P, groups = K / group;
  for (int p = p0; p < p1; ++p) {
    const uint32_t* wp = w + (size_t)p * words * QPANEL;
    float* d = dst + (size_t)(p - p0) * QPANEL * ld - k0;
    for (int g = k0 / group; g < k1 / group; ++g) {
      const __m512 s = _mm512_loadu_ps(sc + ((size_t)p * groups + g) * QPANEL);
      const __m512 b = _mm512_loadu_ps(bi + ((size_t)p * groups + g) * QPANEL);
      for (int k = g * group; k < (g + 1) * group; k += 8) {
        __m512 v[8];
        #pragma GCC unroll 2
        for (int h = 0; h < 8 / P; ++h) {
          const __m512i word = _mm512_loadu_si512(wp + (size_t)(k / P + h) * QPANEL);
          #pragma GCC unroll 8
          for (int i = 0; i < P; ++i) v[h * P + i] = _mm512_fmadd_ps(s, field<BITS>(word, i), b);
        }
        store_rows(v, d + k, ld);
      }
    }
  }
}

}  // namespace

bool qpanel_applies(int bits, int group) {
  return has_avx512() && (bits == 4 || bits == 8) && (group == 32 || group == 64 || group == 128);
}

void qpanel_rows(
    const float* x,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    int M,
    int N,
    int K,
    int bits,
    int group,
    int p0,
    int p1) {
  if (bits == 4)
    rows_of<4>(x, xsum, w, sc, bi, out, M, N, K, group, p0, p1);
  else
    rows_of<8>(x, xsum, w, sc, bi, out, M, N, K, group, p0, p1);
}

void qpanel_tile(
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* dst,
    size_t ld,
    int K,
    int bits,
    int group,
    int p0,
    int p1,
    int k0,
    int k1) {
  if (bits == 4)
    tile_of<4>(w, sc, bi, dst, ld, K, group, p0, p1, k0, k1);
  else
    tile_of<8>(w, sc, bi, dst, ld, K, group, p0, p1, k0, k1);
}

void qpanel_row(const uint32_t* w, const float* sc, const float* bi, float* dst, int n, int K, int bits, int group) {
  const int P = 32 / bits, words = K / P, groups = K / group, p = n / QPANEL, l = n % QPANEL;
  const uint32_t* wp = w + (size_t)p * words * QPANEL + l;
  const uint32_t mask = (1u << bits) - 1;
  for (int k = 0; k < K; ++k) {
    const uint32_t q = (wp[(size_t)(k / P) * QPANEL] >> (bits * (k % P))) & mask;
    const size_t at = ((size_t)p * groups + k / group) * QPANEL + l;
    dst[k] = std::fma(sc[at], (float)q, bi[at]);
  }
}

}  // namespace mlxr
