// A CPU kernel for MLX's affine-quantized matmul (x @ dequantize(w)ᵀ), registered as an MLX
// primitive. MLX's own CPU path dequantizes element by element at ~0.6 GB/s; a decode step
// reads every weight once, so its speed is the speed of reading weights.
//
// - Few rows (decode, small batches): each output row reads its packed weights once, unpacks
//   8 lanes at a time with AVX2 and multiplies them into up to four rows of x. x is permuted
//   once per call so that lane l of a packed 256-bit word meets the x values it holds:
//   sum_k x_k (s_g q_k + b_g) = sum_g s_g (sum_{k in g} x_k q_k) + sum_g b_g (sum_{k in g} x_k).
// - Many rows (prefill): blocks of weight rows are dequantized to float32 and multiplied with
//   the process's sgemm (OpenBLAS), which is compute-bound there anyway.
// - The other widths (2, 3, 5 and 6 bits: a row is one bit stream, fields straddle words but
//   at 2 bits) take kernels of the same two shapes: with AVX-512 VNNI integer dot products of
//   the unpacked bytes with x written as integers (qmv_rows_vnni), else with AVX-512 a packed
//   word a lane, masked per lane type (WordLanes), with AVX2 alone 8 values a load
//   (StreamUnpack).
// Output rows are split across a small persistent thread pool. Only float32 activations,
// 2- to 8-bit weights (not 7), group sizes 32/64/128, on the CPU stream; everything else stays
// MLX's.

#include "mlx-sys/src/qmm_cpu.h"
#include "mlx-sys/src/fpq_cpu.h"
#include "mlx-sys/src/cpu_common.h"
#include "mlx-sys/src/fused_cpu.h"
#include "mlx-sys/src/qpanel_cpu.h"

#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

// GCC 12's AVX-512 intrinsics give their undefined operands themselves as a value
// (`__Y = __Y`), which its own -Wuninitialized then reports wherever they are inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace mx = mlx::core;

namespace mlxr {

namespace {

std::atomic<bool> g_enabled{true};
// Products computed by each path (tests check that the kernel, not MLX, answered).
std::atomic<uint64_t> g_rows_path{0}, g_sgemm_path{0};

// The subnormal unpacking (permute_x): -1 follow subnormal_fields_fast(), 0 off, 1 on.
std::atomic<int> g_subnormal{-1};

// Whether FMAs with subnormal operands run at the speed of normal ones on this CPU: 8
// independent chains of 256 FMAs each way, the faster of three tries. Where a CPU takes a
// microcode assist on a subnormal operand it is tens of times slower, far outside any noise.
__attribute__((target("avx2,fma"), noinline)) double fma_chains_seconds(float operand) {
  volatile float in = operand;
  const __m256 a = _mm256_set1_ps(in);
  __m256 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_set1_ps(1.0f + c);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 256; ++i)
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(a, _mm256_set1_ps(1e-3f), acc[c]);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink[8];
  _mm256_storeu_ps(sink, _mm256_add_ps(acc[0], acc[7]));
  volatile float keep = sink[0];
  (void)keep;
  return t;
}

bool subnormal_fields_fast() {
  static const bool fast = [] {
    double normal = 1e9, sub = 1e9;
    for (int i = 0; i < 3; ++i) {
      normal = std::min(normal, fma_chains_seconds(1.5f));
      sub = std::min(sub, fma_chains_seconds(3e-40f));
    }
    return sub < 2 * normal + 2e-6;
  }();
  return fast;
}

// Whether this call may use the subnormal unpacking: on, and subnormal operands read as such
// on this thread (DAZ, MXCSR bit 6, reads them as zero; the pool's workers clear it).
bool subnormal_fields() {
  const int mode = g_subnormal.load(std::memory_order_relaxed);
  if (mode == 0 || (_mm_getcsr() & 0x40)) return false;
  return mode == 1 || subnormal_fields_fast();
}

// ---- the kernels ----------------------------------------------------------------------------

struct Shape {
  int M, N, K, bits, group;
  // MLX's quantization mode (0 affine; the microscaling modes go to fpq_cpu.cc's kernels).
  int mode = 0;
  // Affine words, scales and biases held as 16-output panels (qpanel_cpu.h).
  bool panels = false;
};

// Rows of x from which a product goes through dequantized tiles and sgemm. The panel kernel
// keeps ~60 GMAC/s at every row count (each unpacked value serves up to eight rows while the
// panel is in L1), which dequantizing the matrix then sgemm only passes from ~80 rows on (Ice
// Lake VM, 24 matrices of 3072×768 at 4 bits: panels 2.8x as fast at 16 rows, 1.7x at 32,
// 1.16x at 64, even at 80, 0.93x at 96); the row kernels hand over at SGEMM_ROWS.
constexpr int PANEL_SGEMM_ROWS = 80;
int sgemm_rows(const Shape& s) { return s.panels ? PANEL_SGEMM_ROWS : SGEMM_ROWS; }

// Runs f(n0, n1) over output rows [0, s.N) as for_rows does; where s.panels, in pieces of as
// many whole panels as the kernel takes at once for s.M rows (the last piece may hold fewer).
// Cut into single panels, a one-row decode step's down projection (768 outputs, 3072 inputs,
// pieces of three panels) ran wholly in the one-panel kernel: 17-20% of a 4-bit bench model's
// step went there (perf, Ice Lake VM).
template <class F>
void for_outputs(const Shape& s, size_t min_per_chunk, const F& f) {
  const size_t unit = s.panels ? (size_t)QPANEL * qpanel_batch(s.M) : 1;
  const size_t n = s.N;
  for_rows((n + unit - 1) / unit, std::max<size_t>(1, min_per_chunk / unit),
           [&](size_t a, size_t b) { f(a * unit, std::min(b * unit, n)); });
}

// Values per packed uint32, and per 8-lane unit (8 uint32), for the widths that divide a word.
inline int per_word(int bits) { return 32 / bits; }

// The widths whose fields never straddle a word (4 and 8) take the permuted-x kernels below;
// the others (2, 3, 5, 6) take the bit-stream kernels ("any width").
inline bool word_aligned(int bits) { return bits == 4 || bits == 8; }

// uint32 words a row of K values takes: a row is one little-endian bit stream, value k at bit
// k·bits, so K·bits/32 words for K a multiple of 32.
inline size_t row_words(int K, int bits) { return (size_t)K * bits / 32; }

// Values in a row of `words` packed words (whole values: the checks below ask for it).
inline int row_values(int64_t words, int bits) { return (int)(words * 32 / bits); }

// Value k of a packed row, for any width: its field may straddle two words (3, 5, 6 bits).
inline uint32_t field_at(const uint32_t* row, int k, int bits) {
  const int bit = k * bits, word = bit >> 5, off = bit & 31;
  uint32_t v = row[word] >> off;
  if (off + bits > 32) v |= row[word + 1] << (32 - off);
  return v & ((1u << bits) - 1);
}

// Where field j of a packed word sits when the kernel multiplies it, and as what.
//
// The conversion unpacking (CVT = true) reads field j as (word & (mask << bits·j)), i.e.
// q·2^(bits·j), converts it to float and meets x scaled by 2^(-bits·j): q·x exactly (powers of
// two, and q·2^(bits·j) has at most 8 significant bits), without shifting the field down. The
// top field is shifted down instead (as an int32 it would read negative).
//
// The subnormal unpacking (CVT = false) skips the conversion: an integer v < 2^24, read as the
// bits of a float, is v·2^-149 (a subnormal, or with bit 23 set the smallest normal binade,
// which continues it). So a field at bit position p, masked in place, already is the float
// q·2^(p-149); x is scaled by 2^(149-p-kSubShift) so that the FMA forms q·x·2^-kSubShift
// exactly, and the row's total is scaled back at the end. Fields above bit 23 are shifted to
// bit 0 first. One integer op and one FMA per 8 weights instead of three ops, which is what
// bounds the kernel on a 2-core Zen 4 VM: one core on cache-resident 4-bit rows, 19-23 against
// 16-18 GB/s; the 4-bit bench model's decode 1.13x as fast (medians of 8 interleaved runs of
// `generate -n 300` at a 607-token prompt). It needs subnormal operands read as such (no DAZ)
// and at full speed (some CPUs take a microcode assist on them; subnormal_fields_fast()
// measures it), and x's largest magnitude within 2^±40 (prepare_x checks).
constexpr int kSubShift = 64;
constexpr float kSubBack = 18446744073709551616.0f;  // 2^kSubShift

// Whether the subnormal unpacking multiplies field j where it lies (it ends by bit 23).
constexpr bool field_in_place(int bits, int j) { return bits * (j + 1) <= 24; }

// The bit position field j is multiplied at: in place, or shifted down to bit 0.
inline int field_position(int bits, int j, bool cvt) {
  if (cvt) return j + 1 == per_word(bits) ? 0 : bits * j;
  return field_in_place(bits, j) ? bits * j : 0;
}

// x in the order the kernel meets it: xt[(u·P + j)·8 + l] = x[u·8P + l·P + j] · scale_j, i.e.
// each unit of 8·P values transposed from 8 rows of P fields to P rows of 8 lanes. In
// registers (an 8×8 or two 4×4 transposes a unit) with the maximum and the group sums below:
// this preparation runs on the calling thread alone before each product's pool job, and the
// scalar loops took 6.7 µs a call at K = 3072 and 1.7 µs at K = 768 in a 4-bit decode (timers
// around it, `generate -n 300` on the 4-bit bench model), 3.0 and 0.9 µs this way.
// With `raw`, x is only permuted (the FP4 kernels look their fields up rather than convert them).
__attribute__((target("avx2,fma"))) void permute_x(const float* x, float* xt, const Shape& s, bool cvt, bool raw = false) {
  const int P = per_word(s.bits), unit = 8 * P, units = s.K / unit;
  __m256 scale[8];
  for (int j = 0; j < P; ++j) {
    const int p = field_position(s.bits, j, cvt);
    scale[j] = raw ? _mm256_set1_ps(1.0f)
                   : _mm256_set1_ps(cvt ? std::ldexp(1.0f, -p) : std::ldexp(1.0f, 149 - p - kSubShift));
  }
  for (int u = 0; u < units; ++u) {
    const float* a = x + (size_t)u * unit;
    float* o = xt + (size_t)u * unit;
    if (P == 8) {
      __m256 r[8], t[8];
      for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_ps(a + l * 8);
      for (int l = 0; l < 8; l += 2) {
        t[l] = _mm256_unpacklo_ps(r[l], r[l + 1]);
        t[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]);
      }
      for (int l = 0; l < 8; l += 4) {
        r[l] = _mm256_shuffle_ps(t[l], t[l + 2], 0x44);
        r[l + 1] = _mm256_shuffle_ps(t[l], t[l + 2], 0xEE);
        r[l + 2] = _mm256_shuffle_ps(t[l + 1], t[l + 3], 0x44);
        r[l + 3] = _mm256_shuffle_ps(t[l + 1], t[l + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(o + j * 8, _mm256_mul_ps(_mm256_permute2f128_ps(r[j], r[j + 4], 0x20), scale[j]));
        _mm256_storeu_ps(o + (j + 4) * 8, _mm256_mul_ps(_mm256_permute2f128_ps(r[j], r[j + 4], 0x31), scale[j + 4]));
      }
    } else {
      // Rows l and l + 4 side by side, then a 4×4 transpose in each 128-bit half.
      __m256 r[4], t[4];
      for (int l = 0; l < 4; ++l)
        r[l] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(a + l * 4)), _mm_loadu_ps(a + (l + 4) * 4), 1);
      t[0] = _mm256_unpacklo_ps(r[0], r[1]);
      t[1] = _mm256_unpackhi_ps(r[0], r[1]);
      t[2] = _mm256_unpacklo_ps(r[2], r[3]);
      t[3] = _mm256_unpackhi_ps(r[2], r[3]);
      _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_shuffle_ps(t[0], t[2], 0x44), scale[0]));
      _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_shuffle_ps(t[0], t[2], 0xEE), scale[1]));
      _mm256_storeu_ps(o + 16, _mm256_mul_ps(_mm256_shuffle_ps(t[1], t[3], 0x44), scale[2]));
      _mm256_storeu_ps(o + 24, _mm256_mul_ps(_mm256_shuffle_ps(t[1], t[3], 0xEE), scale[3]));
    }
  }
}

// The largest magnitude among n floats, NaNs passed over.
__attribute__((target("avx2,fma"))) float max_abs(const float* x, size_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 most = _mm256_setzero_ps();
  size_t i = 0;
  // max_ps returns its second operand where either is NaN: the running maximum.
  for (; i + 8 <= n; i += 8) most = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), most);
  float lanes[8];
  _mm256_storeu_ps(lanes, most);
  float m = 0;
  for (float v : lanes) m = std::max(m, v);
  for (; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// The sum of each group of x (groups are whole 8-lane vectors: 32, 64 or 128 values).
__attribute__((target("avx2,fma"))) void group_sums(const float* x, float* xsum, int K, int group) {
  for (int g = 0; g < K / group; ++g) {
    __m256 t = _mm256_loadu_ps(x + (size_t)g * group);
    for (int k = 8; k < group; k += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(x + (size_t)g * group + k));
    xsum[g] = hsum(t);
  }
}

// sum_g b_g · (sum of x over group g): the biases' share of an output row.
__attribute__((target("avx2,fma"))) inline float bias_sum(const float* b, const float* xs, int groups) {
  __m256 bv = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= groups; g += 8) bv = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(xs + g), bv);
  float bias = hsum(bv);
  for (; g < groups; ++g) bias += b[g] * xs[g];
  return bias;
}

// Output rows n[0..W) for R (1..4) rows of x starting at m0. W = 2 (one row of x: decode)
// reads two weight rows at once, each from its own half of a chunk: two streams the hardware
// prefetcher follows side by side, and one load of x for both (a decode step's 71 matrices
// from 2 MB pages, two cores: 21.3 against 20.2 GB/s in a standalone microbenchmark). Each
// output row's arithmetic is the same whichever W computes it.
template <int BITS, int R, int W, bool CVT>
__attribute__((target("avx2,fma"))) void qmv_rows(
    const float* xt,      // R permuted rows, each K floats
    const float* xsum,    // R rows of per-group sums of x
    const uint32_t* w,
    const float* scales,
    const float* biases,
    float* out,  // row m0 of the output
    const Shape& s,
    const int* rows,
    int u0 = 0,
    int u1 = -1,
    float* carry = nullptr) {
  constexpr int P = 32 / BITS;
  constexpr int UNIT = 8 * P;
  const int units = s.K / UNIT, words = s.K / P, groups = s.K / s.group;
  if (u1 < 0) u1 = units;
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  // Units per group as a shift (groups and units are powers of two; no division per unit).
  const int unit_shift = s.group >= UNIT ? __builtin_ctz(s.group / UNIT) : 0;
  const uint32_t* wr[W];
  const float* sr[W];
  const float* br[W];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i) {
    wr[i] = w + (size_t)rows[i] * words;
    sr[i] = scales + (size_t)rows[i] * groups;
    br[i] = biases + (size_t)rows[i] * groups;
    // The scales and biases are two more streams beside the packed words; a few rows ahead
    // of use they arrive before they are needed.
    _mm_prefetch(reinterpret_cast<const char*>(sr[i] + 4 * groups), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(br[i] + 4 * groups), _MM_HINT_T0);
  }
  __m256 tot[W][R];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) tot[i][r] = u0 > 0 ? _mm256_load_ps(carry + (i * R + r) * 8) : _mm256_setzero_ps();
  for (int u = u0; u < u1; ++u) {
    __m256i q[W];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[i] + u * 8) + 2048, _MM_HINT_T0);
      q[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[i] + u * 8));
    }
    // Independent chains per row: one FMA chain would wait on its own latency every step;
    // more than two per row cost more in the adds that join them than they gain (one row
    // over a decode step's matrices: 21.7 GB/s with two, 21.0 with four, 20.5 with one). Two
    // at every row count, so that a row's sums are the same operations whichever rows of x are
    // beside it (a verify block's rows equal one-row decode steps): at four rows, where the
    // sixteen registers then run short, that costs 6% (one core, 3072 × 768: 35 GMAC/s
    // against 37 with one chain a row).
    constexpr int A = 2;
    __m256 acc[W][R][A];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < A; ++c) acc[i][r][c] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      __m256 xj[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xj[r] = _mm256_loadu_ps(xt + (size_t)r * s.K + (size_t)(u * P + j) * 8);
      #pragma GCC unroll 4
      for (int i = 0; i < W; ++i) {
        // Field j where field_position() puts it (see permute_x).
        __m256 qj;
        if (CVT) {
          const __m256i field = j + 1 == P
                                    ? _mm256_srli_epi32(q[i], BITS * j)
                                    : _mm256_and_si256(q[i], _mm256_slli_epi32(mask, BITS * j));
          qj = _mm256_cvtepi32_ps(field);
        } else if (field_in_place(BITS, j)) {
          qj = _mm256_castsi256_ps(_mm256_and_si256(q[i], _mm256_slli_epi32(mask, BITS * j)));
        } else if (j + 1 == P) {
          qj = _mm256_castsi256_ps(_mm256_srli_epi32(q[i], BITS * j));
        } else {
          qj = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srli_epi32(q[i], BITS * j), mask));
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[i][r][j % A] = _mm256_fmadd_ps(qj, xj[r], acc[i][r][j % A]);
      }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      // The scale of each lane's group.
      __m256 sv;
      if (s.group >= UNIT) {
        sv = _mm256_set1_ps(sr[i][u >> unit_shift]);
      } else {
        // group == 32 with 4-bit: lanes 0-3 and 4-7 are two groups.
        const float a = sr[i][2 * u], b = sr[i][2 * u + 1];
        sv = _mm256_setr_ps(a, a, a, a, b, b, b, b);
      }
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        #pragma GCC unroll 4
        for (int c = 1; c < A; ++c) acc[i][r][0] = _mm256_add_ps(acc[i][r][0], acc[i][r][c]);
        tot[i][r] = _mm256_fmadd_ps(acc[i][r][0], sv, tot[i][r]);
      }
    }
  }
  if (u1 < units) {
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm256_store_ps(carry + (i * R + r) * 8, tot[i][r]);
    return;
  }
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float dot = CVT ? hsum(tot[i][r]) : hsum(tot[i][r]) * kSubBack;
      out[(size_t)r * s.N + rows[i]] = dot + bias_sum(br[i], xsum + (size_t)r * groups, groups);
    }
}

// qmv_rows with 16 lanes (AVX-512): two consecutive 8-word units side by side in one register,
// x laid out to match (xt16: unit pairs interleaved, see pair_units). Each lane's arithmetic is
// the 8-lane kernel's; the lanes hold units 2U and 2U + 1, so the row's total adds the same
// products in another order. Every row count takes this kernel where it applies, so a row's
// result does not depend on the batch around it.
//
// It may take unit pairs [p0, p1) of the rows only (see by_spans): the running totals come from
// `carry` (W·R registers) where p0 > 0 and go back to it where p1 is not the last pair, so a
// row's sums are the same operations in the same order however its pairs are split.
template <int BITS, int R, int W, bool CVT>
__attribute__((target("avx512f,avx2,fma"))) void qmv_rows512(
    const float* xt16,    // R rows of x in unit-pair order, each K floats
    const float* xsum,    // R rows of per-group sums of x
    const uint32_t* w,
    const float* scales,
    const float* biases,
    float* out,  // row m0 of the output
    const Shape& s,
    const int* rows,
    int p0 = 0,
    int p1 = -1,
    float* carry = nullptr) {
  constexpr int P = 32 / BITS;
  constexpr int UNIT = 8 * P;
  const int pairs = s.K / UNIT / 2, words = s.K / P, groups = s.K / s.group;
  if (p1 < 0) p1 = pairs;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  const int unit_shift = s.group >= UNIT ? __builtin_ctz(s.group / UNIT) : 0;
  const uint32_t* wr[W];
  const float* sr[W];
  const float* br[W];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i) {
    wr[i] = w + (size_t)rows[i] * words;
    sr[i] = scales + (size_t)rows[i] * groups;
    br[i] = biases + (size_t)rows[i] * groups;
    _mm_prefetch(reinterpret_cast<const char*>(sr[i] + 4 * groups), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(br[i] + 4 * groups), _MM_HINT_T0);
  }
  __m512 tot[W][R];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) tot[i][r] = p0 > 0 ? _mm512_load_ps(carry + (i * R + r) * 16) : _mm512_setzero_ps();
  for (int u = p0; u < p1; ++u) {
    __m512i q[W];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[i] + u * 16) + 2048, _MM_HINT_T0);
      q[i] = _mm512_loadu_si512(reinterpret_cast<const void*>(wr[i] + u * 16));
    }
    // Two chains per row at every row count, as the 8-lane kernel: a row's bits do not depend
    // on the rows beside it. Four rows cost the same with one chain a row (one core, 3072 ×
    // 768: 36-38 GMAC/s with two, 37-39 with one).
    constexpr int A = 2;
    __m512 acc[W][R][A];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < A; ++c) acc[i][r][c] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      __m512 xj[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        xj[r] = _mm512_loadu_ps(xt16 + (size_t)r * s.K + (size_t)(u * P + j) * 16);
      #pragma GCC unroll 4
      for (int i = 0; i < W; ++i) {
        __m512 qj;
        if (CVT) {
          const __m512i field = j + 1 == P
                                    ? _mm512_srli_epi32(q[i], BITS * j)
                                    : _mm512_and_si512(q[i], _mm512_slli_epi32(mask, BITS * j));
          qj = _mm512_cvtepi32_ps(field);
        } else if (field_in_place(BITS, j)) {
          qj = _mm512_castsi512_ps(_mm512_and_si512(q[i], _mm512_slli_epi32(mask, BITS * j)));
        } else if (j + 1 == P) {
          qj = _mm512_castsi512_ps(_mm512_srli_epi32(q[i], BITS * j));
        } else {
          qj = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srli_epi32(q[i], BITS * j), mask));
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[i][r][j % A] = _mm512_fmadd_ps(qj, xj[r], acc[i][r][j % A]);
      }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      // Each lane's group scale: units 2u (lanes 0-7) and 2u + 1 (lanes 8-15).
      __m512 sv;
      if (s.group >= UNIT) {
        sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sr[i][(2 * u) >> unit_shift]),
                                  _mm512_set1_ps(sr[i][(2 * u + 1) >> unit_shift]));
      } else {
        // group == 32 with 4-bit: each unit's lanes 0-3 and 4-7 are two groups.
        const float* g = sr[i] + 4 * u;
        sv = _mm512_setr_ps(g[0], g[0], g[0], g[0], g[1], g[1], g[1], g[1], g[2], g[2], g[2], g[2], g[3],
                            g[3], g[3], g[3]);
      }
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        #pragma GCC unroll 4
        for (int c = 1; c < A; ++c) acc[i][r][0] = _mm512_add_ps(acc[i][r][0], acc[i][r][c]);
        tot[i][r] = _mm512_fmadd_ps(acc[i][r][0], sv, tot[i][r]);
      }
    }
  }
  if (p1 < pairs) {
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm512_store_ps(carry + (i * R + r) * 16, tot[i][r]);
    return;
  }
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xs = xsum + (size_t)r * groups;
      __m256 bv = _mm256_setzero_ps();
      int g = 0;
      for (; g + 8 <= groups; g += 8)
        bv = _mm256_fmadd_ps(_mm256_loadu_ps(br[i] + g), _mm256_loadu_ps(xs + g), bv);
      float bias = hsum(bv);
      for (; g < groups; ++g) bias += br[i][g] * xs[g];
      const float t = _mm512_reduce_add_ps(tot[i][r]);
      const float dot = CVT ? t : t * kSubBack;
      out[(size_t)r * s.N + rows[i]] = dot + bias;
    }
}

// The same, one value at a time (no AVX2).
void qmv_scalar(
    const float* x,
    const uint32_t* w,
    const float* scales,
    const float* biases,
    float* out,
    const Shape& s,
    int m,
    int n0,
    int n1) {
  const size_t words = row_words(s.K, s.bits);
  const int groups = s.K / s.group;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * words;
    float acc = 0;
    for (int g = 0; g < groups; ++g) {
      float dot = 0, sum = 0;
      for (int k = g * s.group; k < (g + 1) * s.group; ++k) {
        float q = (float)field_at(wr, k, s.bits);
        dot += x[(size_t)m * s.K + k] * q;
        sum += x[(size_t)m * s.K + k];
      }
      acc += scales[(size_t)n * groups + g] * dot + biases[(size_t)n * groups + g] * sum;
    }
    out[(size_t)m * s.N + n] = acc;
  }
}

// Output rows [n0, n1) for `rows` rows of x through `kernel`, a generic lambda
// `<int R, int W>(const int* output_rows)`: one row of x (decode) takes the output rows in pairs
// from the two halves of the range, two weight streams side by side with one load of x for both,
// an odd one alone; more rows of x take them one at a time. Each output row's arithmetic is the
// same whichever way it is taken.
template <class Kernel>
void by_rows(int rows, int n0, int n1, const Kernel& kernel) {
  if (rows == 1) {
    const int half = (n1 - n0) / 2;
    for (int i = 0; i < half; ++i) {
      const int pair[2] = {n0 + i, n0 + half + i};
      kernel.template operator()<1, 2>(pair);
    }
    if (n0 + 2 * half < n1) {
      const int last = n1 - 1;
      kernel.template operator()<1, 1>(&last);
    }
    return;
  }
  for (int n = n0; n < n1; ++n) {
    switch (rows) {
      case 2: kernel.template operator()<2, 1>(&n); break;
      case 3: kernel.template operator()<3, 1>(&n); break;
      default: kernel.template operator()<4, 1>(&n); break;
    }
  }
}

// Bytes of x (all its rows) that a pass over the output rows keeps in L1 beside the weights
// streaming through.
constexpr int kXBytes = 24 << 10;

// Output rows [n0, n1) for `rows` rows of x through `kernel`, a generic lambda
// `<int R, int W>(const int* output_rows, int s0, int s1, float* carry)` that takes steps
// [s0, s1) of the input (`steps` of `step_values` values each: a kernel's units or unit pairs)
// and carries its running totals (`carry_floats` a row) between calls. Where the rows of x
// outgrow kXBytes (four rows of a down projection's 3072 values are 48 KiB, more than L1),
// each FMA reloaded x from L2: the output rows are then taken once for each span of steps
// whose x fits, their totals carried between spans: the same operations in the same order, so
// the unsplit kernel's bits. One core, 4 bits, four rows, 768 output rows × 3072 input: 27.0
// GMAC/s unsplit, 38.9 in spans, as fast as 3072 × 768 (38.4), with the 16-lane kernel; spans
// at 16 KiB of x cost two rows of 3072 (which fit) 5%.
template <class Kernel>
void by_spans(int rows, int n0, int n1, int steps, int step_values, int carry_floats, const Kernel& kernel) {
  const int span = std::max(1, kXBytes / (rows * 4 * step_values));
  if (rows == 1 || span >= steps) {
    by_rows(rows, n0, n1, [&]<int R, int W>(const int* r) { kernel.template operator()<R, W>(r, 0, steps, nullptr); });
    return;
  }
  // Rows of x beyond one take the output rows one at a time (W = 1): a slot each.
  thread_local std::vector<float, Aligned64<float>> carry;
  carry.resize((size_t)(n1 - n0) * carry_floats);
  for (int s0 = 0; s0 < steps; s0 += span) {
    const int s1 = std::min(steps, s0 + span);
    by_rows(rows, n0, n1, [&]<int R, int W>(const int* r) {
      kernel.template operator()<R, W>(r, s0, s1, carry.data() + (size_t)(r[0] - n0) * carry_floats);
    });
  }
}

template <int BITS, bool CVT>
void qmv_block(
    const float* xt,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  constexpr int UNIT = 8 * (32 / BITS);
  by_spans(rows, n0, n1, s.K / UNIT, UNIT, 4 * 8, [&]<int R, int W>(const int* r, int u0, int u1, float* carry) {
    qmv_rows<BITS, R, W, CVT>(xt, xsum, w, sc, bi, out, s, r, u0, u1, carry);
  });
}

// qmv_block with the 16-lane kernel.
template <int BITS, bool CVT>
void qmv_block512(
    const float* xt16,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  constexpr int PAIR = 2 * 8 * (32 / BITS);
  by_spans(rows, n0, n1, s.K / PAIR, PAIR, 4 * 16, [&]<int R, int W>(const int* r, int p0, int p1, float* carry) {
    qmv_rows512<BITS, R, W, CVT>(xt16, xsum, w, sc, bi, out, s, r, p0, p1, carry);
  });
}

// ---- any width: rows as bit streams ---------------------------------------------------------
//
// Eight values of BITS bits are BITS bytes, and one 8-byte load holds them all. Broadcast to
// every 64-bit lane, a byte shuffle gives lane j the two bytes its field starts in (a field of
// at most 6 bits starting at bit (j·BITS) mod 8 ends within them), a per-lane shift and the mask
// leave the value. Fields are multiplied with x in its own order (no permuted copy), groups are
// whole units (8 values), and each output row's sums are the same whichever rows of x are
// computed beside it (two FMA chains per row at every row count).
template <int BITS>
struct StreamUnpack {
  __m256i ctrl, shifts, mask;

  __attribute__((target("avx2"))) StreamUnpack() {
    alignas(32) int8_t c[32];
    alignas(32) int32_t sh[8];
    for (int j = 0; j < 8; ++j) {
      const int bit = j * BITS;
      // Lanes 4-7 index the upper 128-bit half, which holds the same 8 bytes.
      c[4 * j] = (int8_t)(bit / 8);
      c[4 * j + 1] = (int8_t)(bit / 8 + 1);
      c[4 * j + 2] = c[4 * j + 3] = (int8_t)0x80;  // zero
      sh[j] = bit % 8;
    }
    ctrl = _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
    shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(sh));
    mask = _mm256_set1_epi32((1 << BITS) - 1);
  }

  // The 8 values of the unit at p, as int32 lanes; p + 8 must be inside the buffer.
  __attribute__((target("avx2"))) __m256i operator()(const uint8_t* p) const {
    const __m256i b = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(b, ctrl), shifts), mask);
  }
};

// A row whose last load (8 bytes) would pass the packed buffer's end is read from a copy with
// room after it (only the matrix's last rows are).
struct PaddedRow {
  std::vector<uint8_t> copy;
  const uint8_t* at(const uint32_t* w, const Shape& s, int n) {
    const size_t bytes = row_words(s.K, s.bits) * 4;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w) + (size_t)n * bytes;
    const uint8_t* end = reinterpret_cast<const uint8_t*>(w) + (size_t)s.N * bytes;
    if (row + bytes + 16 <= end) return row;
    copy.assign(bytes + 16, 0);
    std::memcpy(copy.data(), row, bytes);
    return copy.data();
  }
};

// Output row n for R (1..4) rows of x (x in its own order, rows K apart), G values a group.
template <int BITS, int R, int G>
__attribute__((target("avx2,fma"))) void qmv_rows_any(
    const float* x,
    const float* xsum,
    const uint32_t* w,
    const float* scales,
    const float* biases,
    float* out,
    const Shape& s,
    int n,
    PaddedRow& pad) {
  const StreamUnpack<BITS> unpack;
  const int groups = s.K / G;
  const uint8_t* wr = pad.at(w, s, n);
  const float* sr = scales + (size_t)n * groups;
  const float* br = biases + (size_t)n * groups;
  __m256 tot[R];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) tot[r] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const uint8_t* pg = wr + (size_t)g * G / 8 * BITS;
    const float* xg = x + (size_t)g * G;
    _mm_prefetch(reinterpret_cast<const char*>(pg) + 1024, _MM_HINT_T0);
    __m256 acc[R][2];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    #pragma GCC unroll 16
    for (int u = 0; u < G / 8; ++u) {
      const __m256 q = _mm256_cvtepi32_ps(unpack(pg + u * BITS));
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r][u & 1] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xg + (size_t)r * s.K + u * 8), acc[r][u & 1]);
    }
    const __m256 sv = _mm256_set1_ps(sr[g]);
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) tot[r] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][0], acc[r][1]), sv, tot[r]);
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    out[(size_t)r * s.N + n] = hsum(tot[r]) + bias_sum(br, xsum + (size_t)r * groups, groups);
}

template <int BITS, int G>
void qmv_block_any(
    const float* x,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  PaddedRow pad;
  for (int n = n0; n < n1; ++n) {
    switch (rows) {
      case 1: qmv_rows_any<BITS, 1, G>(x, xsum, w, sc, bi, out, s, n, pad); break;
      case 2: qmv_rows_any<BITS, 2, G>(x, xsum, w, sc, bi, out, s, n, pad); break;
      case 3: qmv_rows_any<BITS, 3, G>(x, xsum, w, sc, bi, out, s, n, pad); break;
      default: qmv_rows_any<BITS, 4, G>(x, xsum, w, sc, bi, out, s, n, pad); break;
    }
  }
}

template <int BITS>
void qmv_block_any(
    const float* x,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  switch (s.group) {
    case 32: return qmv_block_any<BITS, 32>(x, xsum, w, sc, bi, out, s, rows, n0, n1);
    case 64: return qmv_block_any<BITS, 64>(x, xsum, w, sc, bi, out, s, rows, n0, n1);
    default: return qmv_block_any<BITS, 128>(x, xsum, w, sc, bi, out, s, rows, n0, n1);
  }
}

// ---- any width, 16 lanes: one packed word a lane ----------------------------------------------
//
// With AVX-512, rows of 2, 3, 5 and 6 bits are read 16 consecutive words at a time, one word a
// lane, as the 4- and 8-bit kernels read theirs, instead of one 8-value unit a load. A width's
// fields repeat their layout every PW = BITS / gcd(BITS, 32) words (3-bit: 32 values in 3 words),
// so a lane's word is one of PW types. Type t starts its stream at bit 32t: its whole fields
// begin o_t bits into the word, and it may hold the upper part of a value begun in the word
// before (its low "extra", o_t bits) and the lower part of one that ends in the word after (its
// high extra). One variable shift by o_t puts every lane's whole fields at bits BITS·k, where
// the same masks serve all lanes (fields that would end past bit 24 are shifted down once more,
// as the 4-bit kernel's top fields are); the extras take a mask and a variable shift. Each field
// is multiplied where it lies: x is prepared once a call in the kernel's order (lane_x), each
// value scaled by 2^-position (or for the subnormal unpacking 2^(149-position-kSubShift)) and
// each extra by its part's weight, zero where a lane has no such field. A 3-bit word thus costs
// 12 masks or shifts and 12 FMAs for 10.7 values where the bit-stream kernel spends 6 operations
// on every 16; a lane's sum is scaled by its word's group scale (groups are whole periods, so
// no value straddles two groups) once a register.
template <int BITS>
struct WordLanes {
  static constexpr int PW = BITS / std::gcd(BITS, 32);  // words a period
  static constexpr int V = 32 * PW / BITS;               // values a period
  // Whole fields in the word of type t, and the first one's value index in the period.
  static constexpr int first(int t) { return (32 * t + BITS - 1) / BITS; }
  static constexpr int fields(int t) { return 32 * (t + 1) / BITS - first(t); }
  static constexpr int offset(int t) { return BITS * first(t) - 32 * t; }
  static constexpr int max_fields() {
    int f = 0;
    for (int t = 0; t < PW; ++t) f = std::max(f, fields(t));
    return f;
  }
  static constexpr int F = max_fields();
  // Whether values straddle words at all (2 bits: never).
  static constexpr bool EXTRAS = 32 % BITS != 0;
  // x's slots a lane: the fields, then the low and the high extra.
  static constexpr int S = F + (EXTRAS ? 2 : 0);
  // Fields from k0 on are shifted down by SH before masking (they would end past bit 24).
  static constexpr int k0 = std::min(F, 24 / BITS);
  static constexpr int SH = BITS * k0;

  // The bit position field slot k is multiplied at.
  static constexpr int position(int k) { return k < k0 ? BITS * k : BITS * (k - k0); }

  // Lane type of lane l in a register whose first word is register r's: (16r + l) mod PW.
  static int type(int r, int l) { return (16 * (r % PW) + l) % PW; }
};

// Registers (16 words) a row of K values takes, and x's floats a prepared row.
template <int BITS>
inline int lane_registers(int K) { return (int)((row_words(K, BITS) + 15) / 16); }

inline int lane_x_floats(int K, int bits) {
  switch (bits) {
    case 2: return lane_registers<2>(K) * WordLanes<2>::S * 16;
    case 3: return lane_registers<3>(K) * WordLanes<3>::S * 16;
    case 5: return lane_registers<5>(K) * WordLanes<5>::S * 16;
    default: return lane_registers<6>(K) * WordLanes<6>::S * 16;
  }
}

// Where each of a prepared row's floats comes from: x[src] · factor, or 0 where src < 0. Built
// once for each (width, K, unpacking) a thread meets, then reused.
struct LaneMap {
  int bits, K;
  bool cvt;
  std::vector<int32_t> src;
  std::vector<float> factor;
};

template <int BITS>
void build_lane_map(LaneMap& m) {
  using L = WordLanes<BITS>;
  const int regs = lane_registers<BITS>(m.K);
  const int64_t words = row_words(m.K, BITS);
  m.src.assign((size_t)regs * L::S * 16, -1);
  m.factor.assign(m.src.size(), 0.0f);
  const auto scale = [&](int position) {
    return m.cvt ? std::ldexp(1.0f, -position) : std::ldexp(1.0f, 149 - position - kSubShift);
  };
  for (int r = 0; r < regs; ++r)
    for (int l = 0; l < 16; ++l) {
      const int64_t word = (int64_t)r * 16 + l;
      if (word >= words) continue;
      const int t = (int)(word % L::PW);
      const int base = (int)(word / L::PW) * L::V + L::first(t);
      const auto put = [&](int slot, int value, float f) {
        const size_t i = ((size_t)r * L::S + slot) * 16 + l;
        m.src[i] = value;
        m.factor[i] = f;
      };
      for (int k = 0; k < L::fields(t); ++k) put(k, base + k, scale(L::position(k)));
      if (!L::EXTRAS) continue;
      // The low extra is value base - 1's upper o_t bits: worth 2^(BITS - o_t) each.
      if (L::offset(t) > 0) put(L::F, base - 1, scale(0) * (float)(1 << (BITS - L::offset(t))));
      // The high extra is value base + fields's lower bits, from bit o_t + BITS·fields on.
      if (L::offset(t) + BITS * L::fields(t) < 32) put(L::F + 1, base + L::fields(t), scale(0));
    }
}

// x (M rows of K) in the word-lane kernel's order, rows lane_x_floats(K) apart.
void lane_x(const float* x, float* xw, const Shape& s, bool cvt) {
  thread_local std::vector<LaneMap> maps;
  LaneMap* map = nullptr;
  for (auto& m : maps)
    if (m.bits == s.bits && m.K == s.K && m.cvt == cvt) map = &m;
  if (map == nullptr) {
    maps.push_back(LaneMap{s.bits, s.K, cvt, {}, {}});
    map = &maps.back();
    switch (s.bits) {
      case 2: build_lane_map<2>(*map); break;
      case 3: build_lane_map<3>(*map); break;
      case 5: build_lane_map<5>(*map); break;
      default: build_lane_map<6>(*map); break;
    }
  }
  const size_t n = map->src.size();
  for (int m = 0; m < s.M; ++m) {
    const float* xr = x + (size_t)m * s.K;
    float* o = xw + (size_t)m * n;
    for (size_t i = 0; i < n; ++i) o[i] = map->src[i] < 0 ? 0.0f : xr[map->src[i]] * map->factor[i];
  }
}

// The word-lane kernel's per-lane constants, by register phase (its first word's place in a
// period): the shift to the whole fields, the low extra's mask, the high extra's shift (32 where
// there is none: AVX-512's variable shifts give 0 past 31); and each lane's group among those a
// register spans, by where the register starts in its first group. Made once for each width and group.
struct LaneTables {
  alignas(64) int32_t fshift[5][16], lomask[5][16], hishift[5][16], sidx[8][16];
  // From a register starting at sidx's case c, the next register's case and how many groups on
  // its first group is (divisions kept out of the loop).
  int next[8], advance[8];

  template <int BITS>
  static LaneTables of(int group) {
    using L = WordLanes<BITS>;
    LaneTables t;
    for (int ph = 0; ph < L::PW; ++ph)
      for (int l = 0; l < 16; ++l) {
        const int type = L::type(ph, l), o = L::offset(type), end = o + BITS * L::fields(type);
        t.fshift[ph][l] = o;
        t.lomask[ph][l] = (1 << o) - 1;
        t.hishift[ph][l] = end < 32 ? end : 32;
      }
    const int wpg = BITS * group / 32, g16 = std::gcd(16, wpg);
    for (int c = 0; c < wpg / g16; ++c) {
      for (int l = 0; l < 16; ++l) t.sidx[c][l] = (c * g16 + l) / wpg;
      t.next[c] = (c * g16 + 16) % wpg / g16;
      t.advance[c] = (c * g16 + 16) / wpg;
    }
    return t;
  }
};

template <int BITS>
const LaneTables& lane_tables(int group) {
  static const LaneTables g32 = LaneTables::of<BITS>(32), g64 = LaneTables::of<BITS>(64),
                          g128 = LaneTables::of<BITS>(128);
  return group == 32 ? g32 : group == 64 ? g64 : g128;
}

// Output rows rows[0..W) for R rows of x (prepared by lane_x), 16 words a step.
template <int BITS, int R, int W, bool CVT>
__attribute__((target("avx512f,avx2,fma"))) void qmv_rows_lanes(
    const float* xw,
    const float* xsum,
    const uint32_t* w,
    const float* scales,
    const float* biases,
    float* out,
    const Shape& s,
    const LaneTables& t,
    const int* rows) {
  using L = WordLanes<BITS>;
  const int64_t words = row_words(s.K, BITS);
  const int regs = lane_registers<BITS>(s.K), groups = s.K / s.group;
  const size_t xstride = (size_t)regs * L::S * 16;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);

  const uint32_t* wr[W];
  const float* sr[W];
  const float* br[W];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i) {
    wr[i] = w + (size_t)rows[i] * words;
    sr[i] = scales + (size_t)rows[i] * groups;
    br[i] = biases + (size_t)rows[i] * groups;
  }
  __m512 tot[W][R];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) tot[i][r] = _mm512_setzero_ps();
  // The register's phase in the period, its first group, and where it starts in that group.
  int ph = 0, first_group = 0, gc = 0;
  for (int g = 0; g < regs; ++g) {
    const int64_t left = words - (int64_t)g * 16;
    const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512i fs = _mm512_load_si512(t.fshift[ph]);
    __m512i fw[W], fw2[W], q[W];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[i] + g * 16) + 2048, _MM_HINT_T0);
      q[i] = _mm512_maskz_loadu_epi32(live, wr[i] + (size_t)g * 16);
      fw[i] = _mm512_srlv_epi32(q[i], fs);
      fw2[i] = _mm512_srli_epi32(fw[i], L::SH);
    }
    const float* xg = xw + (size_t)g * L::S * 16;
    // Two chains per row at every row count, as qmv_rows512: a row's bits do not depend on the
    // rows beside it.
    constexpr int A = 2;
    __m512 acc[W][R][A];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < A; ++c) acc[i][r][c] = _mm512_setzero_ps();
    #pragma GCC unroll 18
    for (int k = 0; k < L::S; ++k) {
      __m512 xk[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xk[r] = _mm512_loadu_ps(xg + (size_t)r * xstride + (size_t)k * 16);
      #pragma GCC unroll 4
      for (int i = 0; i < W; ++i) {
        __m512i field;
        if (k < L::k0)
          field = _mm512_and_si512(fw[i], _mm512_slli_epi32(mask, BITS * k));
        else if (k < L::F)
          field = _mm512_and_si512(fw2[i], _mm512_slli_epi32(mask, BITS * (k - L::k0)));
        else if (k == L::F)
          field = _mm512_and_si512(q[i], _mm512_load_si512(t.lomask[ph]));
        else
          field = _mm512_srlv_epi32(q[i], _mm512_load_si512(t.hishift[ph]));
        const __m512 qk = CVT ? _mm512_cvtepi32_ps(field) : _mm512_castsi512_ps(field);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[i][r][k % A] = _mm512_fmadd_ps(qk, xk[r], acc[i][r][k % A]);
      }
    }
    const __m512i idx = _mm512_load_si512(t.sidx[gc]);
    const int have = std::min(16, groups - first_group);
    const __mmask16 gmask = (__mmask16)((1u << have) - 1);
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      const __m512 sv = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(gmask, sr[i] + first_group));
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        #pragma GCC unroll 4
        for (int c = 1; c < A; ++c) acc[i][r][0] = _mm512_add_ps(acc[i][r][0], acc[i][r][c]);
        tot[i][r] = _mm512_fmadd_ps(acc[i][r][0], sv, tot[i][r]);
      }
    }
    ph = ph + 1 == L::PW ? 0 : ph + 1;
    first_group += t.advance[gc];
    gc = t.next[gc];
  }
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(tot[i][r]);
      out[(size_t)r * s.N + rows[i]] = (CVT ? sum : sum * kSubBack) + bias_sum(br[i], xsum + (size_t)r * groups, groups);
    }
}

template <int BITS, bool CVT>
void qmv_block_lanes(
    const float* xw,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  const LaneTables& t = lane_tables<BITS>(s.group);
  by_rows(rows, n0, n1, [&]<int R, int W>(const int* r) {
    qmv_rows_lanes<BITS, R, W, CVT>(xw, xsum, w, sc, bi, out, s, t, r);
  });
}

template <bool CVT>
void qmv_block_lanes(
    const float* xw,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  switch (s.bits) {
    case 2: return qmv_block_lanes<2, CVT>(xw, xsum, w, sc, bi, out, s, rows, n0, n1);
    case 3: return qmv_block_lanes<3, CVT>(xw, xsum, w, sc, bi, out, s, rows, n0, n1);
    case 5: return qmv_block_lanes<5, CVT>(xw, xsum, w, sc, bi, out, s, rows, n0, n1);
    default: return qmv_block_lanes<6, CVT>(xw, xsum, w, sc, bi, out, s, rows, n0, n1);
  }
}

// ---- 2, 3, 5 and 6 bits with integer dot products (AVX-512 VNNI) ------------------------------
//
// The float kernels above spend three operations on every 16 values (isolate a field, convert
// it, multiply it in), and the widths whose fields straddle words more (the extras); where
// subnormal operands are slow that bounds a 3-bit decode below the 4-bit one's speed although
// it reads a fifth fewer bytes. VNNI multiplies 64 unsigned bytes by 64 signed bytes and adds
// them in fours into 16 int32 lanes in one operation, as fast as one FMA. So:
//
// - x becomes integers: each block of 64 values is scaled by a power of two that puts its
//   largest magnitude just under 2^22, rounded to an integer v, and v is written as three
//   signed bytes, v = l0·2^16 + l1·2^8 + l2 (l0 within ±64). That keeps 23 bits of each block
//   (float32 keeps 24 of each value): a value far smaller than its block's largest keeps fewer,
//   an error of at most 2^-23 of the block's largest magnitude, below what float32's own
//   rounding of the row's sum adds. Done once a call (limb_x), beside the group sums.
// - 64 packed values of any width up to 6 bits are 8·BITS consecutive bytes of the row (no
//   straddling at this size); one byte permute places BITS bytes in each 64-bit lane, one
//   multishift takes each value's bits to its own byte, and a mask clears the rest: 64 values
//   in three operations, each in the byte of its position.
// - Three dot products with the limbs, joined as Horner's scheme joins digits (shift by 8, add
//   the next), give each lane's exact integer sum of q·v over its four values: within ±2^31 for
//   up to 6 bits (4 · 63 · 2^22). Converted to float and multiplied in with the lane's group
//   scale times the block's power of two; the biases' share joins the lanes before the one
//   reduction.
//
// Eleven vector operations for 64 values and one row of x (the three that unpack are shared by
// every row of x), where the float kernels take 12 (4 bits) and 14 (3 bits, its extras
// counted). On a 2-core Sapphire Rapids VM the 3-bit bench model decodes at 228 tok/s, as fast
// as 4-bit (it was 183, 0.82×), 5 and 6 bits ~1.4× faster than before; the kernels are bound by
// issuing those operations there, not by the bytes. Not for 8 bits (the lane sums would
// overflow) nor 4 (its float kernel already reads at the memory's speed on one core).
//
// On a Zen 4 VM (measured with eight independent chains of each instruction) the 512-bit
// dpbusd, multishift, multiply and FMA all issue at one a cycle from the same units, while
// shifts, conversions and adds go to others: six of the eleven share that one-a-cycle port,
// against about four and a half for the 4-bit float kernel's 64 values. So there a 3-bit
// product runs at ~0.75x the values a second of a 4-bit one (one core, in cache, 768 inputs:
// 23-24 against 31-33 Gval/s), and 3-bit decode is not faster than 4-bit although it reads a
// fifth fewer bytes (docs/BUILD.md §6). Four output rows at a time for one row of x (more
// chains in flight) gained 10% on one core in isolation and nothing in a decode step
// (`cargo bench --bench step`, 3 bits: 3.83 ms for every product either way); not kept.

// Bytes of limbs a prepared row of x takes: three bytes a value, whole blocks of 64.
inline size_t limb_row_bytes(int K) { return (size_t)((K + 63) / 64) * 192; }

// x (M rows of K) as limbs (each block: 64 bytes of l0, 64 of l1, 64 of l2; zeros past K) and
// each block's power of two (2^(e-22) for a block whose largest magnitude is below 2^e).
// False where x holds an infinity or a NaN (the float kernels carry those as MLX does).
__attribute__((target("avx512f,avx512bw,avx2,fma"))) bool limb_x(const float* x, int8_t* limbs, float* pow2, int M, int K) {
  const int blocks = (K + 63) / 64;
  const __m512i expo = _mm512_set1_epi32(0x7F800000);
  for (int m = 0; m < M; ++m) {
    const float* xr = x + (size_t)m * K;
    int8_t* lr = limbs + (size_t)m * limb_row_bytes(K);
    for (int b = 0; b < blocks; ++b) {
      const int left = std::min(64, K - 64 * b);
      __m512 v[4];
      __m512 most = _mm512_setzero_ps();
      __mmask16 odd = 0;
      for (int j = 0; j < 4; ++j) {
        const int n = std::clamp(left - 16 * j, 0, 16);
        v[j] = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), xr + 64 * b + 16 * j);
        const __m512i bits = _mm512_castps_si512(v[j]);
        odd |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, expo), expo);
        most = _mm512_max_ps(most, _mm512_abs_ps(v[j]));
      }
      if (odd) return false;
      int e = 0;
      std::frexp(_mm512_reduce_max_ps(most), &e);
      // Below 2^-100 a block is scaled as if its largest were 2^-100: the scale stays finite.
      e = std::max(e, -100);
      const __m512 f = _mm512_set1_ps(std::ldexp(1.0f, 22 - e));
      pow2[(size_t)m * blocks + b] = std::ldexp(1.0f, e - 22);
      int8_t* out = lr + (size_t)b * 192;
      for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], f));
        const __m512i l2 = _mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24);
        const __m512i q1 = _mm512_srai_epi32(_mm512_sub_epi32(q, l2), 8);
        const __m512i l1 = _mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24);
        const __m512i l0 = _mm512_srai_epi32(_mm512_sub_epi32(q1, l1), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * j), _mm512_cvtepi32_epi8(l0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 + 16 * j), _mm512_cvtepi32_epi8(l1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 128 + 16 * j), _mm512_cvtepi32_epi8(l2));
      }
    }
  }
  return true;
}

// The byte permute and multishift controls that take 64 BITS-bit values (8·BITS bytes) to one
// byte each: 64-bit lane m gets bytes BITS·m .. BITS·m + BITS - 1, and byte j of it value 8m + j
// from bit BITS·j.
template <int BITS>
struct ByteUnpack {
  alignas(64) uint8_t place[64], shift[64];
  constexpr ByteUnpack() : place{}, shift{} {
    for (int m = 0; m < 8; ++m)
      for (int j = 0; j < 8; ++j) {
        place[8 * m + j] = (uint8_t)(BITS * m + std::min(j, BITS - 1));
        shift[8 * m + j] = (uint8_t)(BITS * j);
      }
  }
};

// Output rows rows[0..W) for R rows of x (limbs and block powers from limb_x).
template <int BITS, int R, int W>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma"))) void qmv_rows_vnni(
    const int8_t* limbs,
    const float* pow2,
    const float* xsum,
    const uint32_t* w,
    const float* scales,
    const float* biases,
    float* out,
    const Shape& s,
    const int* rows) {
  static constexpr ByteUnpack<BITS> unpack{};
  const int blocks = (s.K + 63) / 64, groups = s.K / s.group;
  const size_t row_bytes = (size_t)s.K * BITS / 8, lstride = limb_row_bytes(s.K);
  const __m512i place = _mm512_load_si512(unpack.place), shift = _mm512_load_si512(unpack.shift);
  const __m512i mask = _mm512_set1_epi8((1 << BITS) - 1);
  const int group_shift = __builtin_ctz(s.group);
  const uint8_t* wr[W];
  const float* sr[W];
  const float* br[W];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i) {
    wr[i] = reinterpret_cast<const uint8_t*>(w) + (size_t)rows[i] * row_bytes;
    sr[i] = scales + (size_t)rows[i] * groups;
    br[i] = biases + (size_t)rows[i] * groups;
    // The scales and biases are streams of their own beside the packed rows (see qmv_rows).
    _mm_prefetch(reinterpret_cast<const char*>(sr[i] + 4 * groups), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(br[i] + 4 * groups), _MM_HINT_T0);
  }
  __m512 tot[W][R];
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) tot[i][r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    // A last block of 32 values (K an odd multiple of 32) reads its 4·BITS bytes alone.
    const bool whole = 64 * (b + 1) <= s.K;
    const __mmask64 live = whole ? (__mmask64)((1ull << (8 * BITS)) - 1) : (__mmask64)((1ull << (4 * BITS)) - 1);
    __m512i q[W];
    __m512 sv[W];
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      const uint8_t* at = wr[i] + (size_t)b * 8 * BITS;
      _mm_prefetch(reinterpret_cast<const char*>(at) + 2048, _MM_HINT_T0);
      const __m512i raw = _mm512_maskz_loadu_epi8(live, at);
      q[i] = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(place, raw)), mask);
      // Each lane's group scale: one group for the block (64 and 128), or two halves (32).
      if (s.group == 32) {
        const float lo = sr[i][2 * b], hi = whole ? sr[i][2 * b + 1] : 0.0f;
        sv[i] = halves(_mm256_set1_ps(lo), _mm256_set1_ps(hi));
      } else {
        sv[i] = _mm512_set1_ps(sr[i][(64 * b) >> group_shift]);
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* l = limbs + (size_t)r * lstride + (size_t)b * 192;
      const __m512i l0 = _mm512_loadu_si512(l), l1 = _mm512_loadu_si512(l + 64), l2 = _mm512_loadu_si512(l + 128);
      const __m512 p = _mm512_set1_ps(pow2[(size_t)r * blocks + b]);
      #pragma GCC unroll 4
      for (int i = 0; i < W; ++i) {
        __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[i], l0);
        a = _mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), q[i], l1);
        a = _mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), q[i], l2);
        tot[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sv[i], p), tot[i][r]);
      }
    }
  }
  // The biases' share, sum_g b_g · (sum of x over group g), joins the lanes before the one
  // reduction.
  for (int g = 0; g < groups; g += 16) {
    const __mmask16 have = (__mmask16)(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
    #pragma GCC unroll 4
    for (int i = 0; i < W; ++i) {
      const __m512 bv = _mm512_maskz_loadu_ps(have, br[i] + g);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        tot[i][r] = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(have, xsum + (size_t)r * groups + g), tot[i][r]);
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < W; ++i)
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[(size_t)r * s.N + rows[i]] = _mm512_reduce_add_ps(tot[i][r]);
}

void qmv_block_vnni(
    const int8_t* limbs,
    const float* pow2,
    const float* xsum,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int rows,
    int n0,
    int n1) {
  const auto block = [&]<int BITS>() {
    by_rows(rows, n0, n1, [&]<int R, int W>(const int* r) {
      qmv_rows_vnni<BITS, R, W>(limbs, pow2, xsum, w, sc, bi, out, s, r);
    });
  };
  switch (s.bits) {
    case 2: return block.template operator()<2>();
    case 3: return block.template operator()<3>();
    case 5: return block.template operator()<5>();
    default: return block.template operator()<6>();
  }
}

// Rows [n0, n1) and columns [k0, k1) (whole groups) of w as float32: each unit's values times
// the group's scale plus its bias, one FMA, as MLX's dequantize computes them.
template <int BITS>
__attribute__((target("avx2,fma"))) void dequantize_rows_any(
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* dst,
    const Shape& s,
    int n0,
    int n1,
    int k0,
    int k1) {
  const StreamUnpack<BITS> unpack;
  const int groups = s.K / s.group;
  PaddedRow pad;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = pad.at(w, s, n);
    float* d = dst + (size_t)(n - n0) * (k1 - k0) - k0;
    for (int g = k0 / s.group; g < k1 / s.group; ++g) {
      const __m256 a = _mm256_set1_ps(sc[(size_t)n * groups + g]);
      const __m256 b = _mm256_set1_ps(bi[(size_t)n * groups + g]);
      for (int k = g * s.group; k < (g + 1) * s.group; k += 8)
        _mm256_storeu_ps(d + k, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(unpack(wr + k / 8 * BITS)), b));
    }
  }
}

// Whether the 16-lane kernel takes rows of K values: AVX-512, and whole pairs of 8-word units.
bool wide_rows(const Shape& s) {
  return has_avx512() && word_aligned(s.bits) && s.K > 0 && s.K % (16 * per_word(s.bits)) == 0;
}

// x's permuted rows (xt) in unit-pair order for the 16-lane kernel: xt16[(U·P + j)·16 + h·8 + l]
// = xt[((2U + h)·P + j)·8 + l], so one load gives field j of units 2U and 2U + 1.
void pair_units(const float* xt, float* xt16, const Shape& s) {
  const int P = per_word(s.bits), pairs = s.K / (8 * P) / 2;
  for (int u = 0; u < pairs; ++u)
    for (int j = 0; j < P; ++j)
      for (int h = 0; h < 2; ++h)
        std::memcpy(xt16 + ((size_t)(u * P + j) * 16 + h * 8), xt + ((size_t)((2 * u + h) * P + j) * 8),
                    8 * sizeof(float));
}

// Output rows per pool chunk: enough that a chunk reads ~32 KB of packed weights, so that
// claiming it (an atomic both cores contend for) is small beside the work.
int rows_per_chunk(const Shape& s) {
  const size_t row_bytes = (size_t)s.K * s.bits / 8 + (size_t)(s.K / s.group) * 8;
  return (int)std::max<size_t>(1, (32u << 10) / row_bytes);
}

// x permuted for the packed layout (permute_x) and its per-group sums, shared by every product
// of one call with the same x.
struct PreparedX {
  const float* xt;
  // x in the 16-lane kernel's order where it takes these rows, else null: xt in unit-pair order
  // (4 and 8 bits), or word-lane order (lane_x: 2, 3, 5 and 6 bits).
  const float* xt16;
  const float* xsum;
  // The unpacking xt is scaled for (see permute_x).
  bool cvt;
  // x as limbs and block powers of two (limb_x) where the integer kernel takes these rows
  // (2, 3, 5 and 6 bits with VNNI), else null.
  const int8_t* limbs = nullptr;
  const float* pow2 = nullptr;
};

}  // namespace

const float* fp4_lanes(const float* x, int M, int K) {
  const Shape s{M, 0, K, 4, 32};
  if (!wide_rows(s) || !has_avx2()) return nullptr;
  thread_local std::vector<float, Aligned64<float>> xt_buf, lanes_buf;
  xt_buf.resize((size_t)M * K);
  lanes_buf.resize((size_t)M * K);
  for (int m = 0; m < M; ++m) {
    permute_x(x + (size_t)m * K, xt_buf.data() + (size_t)m * K, s, true, true);
    pair_units(xt_buf.data() + (size_t)m * K, lanes_buf.data() + (size_t)m * K, s);
  }
  return lanes_buf.data();
}

namespace {

PreparedX prepare_x(const float* x, const Shape& s) {
  // The microscaling kernels read x as it is, and FP4 rows also in lane order (xt16).
  if (s.mode != 0) return {x, s.bits == 4 ? fp4_lanes(x, s.M, s.K) : nullptr, nullptr, true};
  const int groups = s.K / s.group;
  // Reused between calls (the stream's thread makes them one at a time).
  thread_local std::vector<float, Aligned64<float>> xt_buf, xt16_buf, xsum_buf;
  xsum_buf.resize((size_t)s.M * groups);
  if (s.panels) {
    // The panel kernel broadcasts x's values in their own order.
    for (int m = 0; m < s.M; ++m)
      group_sums(x + (size_t)m * s.K, xsum_buf.data() + (size_t)m * groups, s.K, s.group);
    return {x, nullptr, xsum_buf.data(), true};
  }
  if (!word_aligned(s.bits)) {
    for (int m = 0; m < s.M; ++m)
      group_sums(x + (size_t)m * s.K, xsum_buf.data() + (size_t)m * groups, s.K, s.group);
    // The 8-lane bit-stream kernels read x in its own order.
    if (!has_avx512()) return {x, nullptr, xsum_buf.data(), true};
    if (has_vnni()) {
      thread_local std::vector<int8_t, Aligned64<int8_t>> limb_buf;
      thread_local std::vector<float, Aligned64<float>> pow2_buf;
      limb_buf.resize((size_t)s.M * limb_row_bytes(s.K));
      pow2_buf.resize((size_t)s.M * ((s.K + 63) / 64));
      if (limb_x(x, limb_buf.data(), pow2_buf.data(), s.M, s.K))
        return {x, nullptr, xsum_buf.data(), true, limb_buf.data(), pow2_buf.data()};
    }
    // The word-lane kernel scales x by up to 2^89 (an extra's weight on top of the subnormal
    // unpacking's 2^85, see below): it takes the subnormal unpacking within 2^±36.
    bool cvt = !subnormal_fields();
    if (!cvt) {
      const float most = max_abs(x, (size_t)s.M * s.K);
      cvt = !(most < 0x1p36f && most >= 0x1p-40f);
    }
    xt16_buf.resize((size_t)s.M * lane_x_floats(s.K, s.bits));
    lane_x(x, xt16_buf.data(), s, cvt);
    return {x, xt16_buf.data(), xsum_buf.data(), cvt};
  }
  xt_buf.resize((size_t)s.M * s.K);
  // The subnormal unpacking scales x by up to 2^85 and forms products 2^-64 of their size: it
  // takes inputs whose largest magnitude is within 2^±40, so that the scaled copy is finite and
  // the products that matter are normal floats (exact, as the conversion's are).
  bool cvt = !subnormal_fields();
  if (!cvt) {
    const float most = max_abs(x, (size_t)s.M * s.K);
    cvt = !(most < 0x1p40f && most >= 0x1p-40f);
  }
  for (int m = 0; m < s.M; ++m) {
    permute_x(x + (size_t)m * s.K, xt_buf.data() + (size_t)m * s.K, s, cvt);
    group_sums(x + (size_t)m * s.K, xsum_buf.data() + (size_t)m * groups, s.K, s.group);
  }
  const bool wide = wide_rows(s);
  if (wide) {
    xt16_buf.resize((size_t)s.M * s.K);
    for (int m = 0; m < s.M; ++m)
      pair_units(xt_buf.data() + (size_t)m * s.K, xt16_buf.data() + (size_t)m * s.K, s);
  }
  // Plain pointers: inside a pool job a thread-local would name the worker's own copy.
  return {xt_buf.data(), wide ? xt16_buf.data() : nullptr, xsum_buf.data(), cvt};
}

// Output rows [n0, n1) of every row of x (AVX2 only).
void qmv_range(
    const PreparedX& px,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s,
    int n0,
    int n1) {
  if (s.panels)
    return qpanel_rows(px.xt, px.xsum, w, sc, bi, out, s.M, s.N, s.K, s.bits, s.group, n0 / QPANEL, n1 / QPANEL);
  const int groups = s.K / s.group;
  for (int m = 0; m < s.M; m += 4) {
    int rows = std::min(4, s.M - m);
    const float* xr = px.xt + (size_t)m * s.K;
    const float* xs = px.xsum + (size_t)m * groups;
    float* o = out + (size_t)m * s.N;
    if (px.limbs) {
      qmv_block_vnni(px.limbs + (size_t)m * limb_row_bytes(s.K), px.pow2 + (size_t)m * ((s.K + 63) / 64), xs, w,
                     sc, bi, o, s, rows, n0, n1);
      continue;
    }
    if (!word_aligned(s.bits) && px.xt16) {
      const float* xw = px.xt16 + (size_t)m * lane_x_floats(s.K, s.bits);
      px.cvt ? qmv_block_lanes<true>(xw, xs, w, sc, bi, o, s, rows, n0, n1)
             : qmv_block_lanes<false>(xw, xs, w, sc, bi, o, s, rows, n0, n1);
      continue;
    }
    switch (s.bits) {
      case 2: qmv_block_any<2>(xr, xs, w, sc, bi, o, s, rows, n0, n1); continue;
      case 3: qmv_block_any<3>(xr, xs, w, sc, bi, o, s, rows, n0, n1); continue;
      case 5: qmv_block_any<5>(xr, xs, w, sc, bi, o, s, rows, n0, n1); continue;
      case 6: qmv_block_any<6>(xr, xs, w, sc, bi, o, s, rows, n0, n1); continue;
      default: break;
    }
    if (px.xt16) {
      const float* x16 = px.xt16 + (size_t)m * s.K;
      if (s.bits == 4)
        px.cvt ? qmv_block512<4, true>(x16, xs, w, sc, bi, o, s, rows, n0, n1)
               : qmv_block512<4, false>(x16, xs, w, sc, bi, o, s, rows, n0, n1);
      else
        px.cvt ? qmv_block512<8, true>(x16, xs, w, sc, bi, o, s, rows, n0, n1)
               : qmv_block512<8, false>(x16, xs, w, sc, bi, o, s, rows, n0, n1);
      continue;
    }
    if (s.bits == 4)
      px.cvt ? qmv_block<4, true>(xr, xs, w, sc, bi, o, s, rows, n0, n1)
             : qmv_block<4, false>(xr, xs, w, sc, bi, o, s, rows, n0, n1);
    else
      px.cvt ? qmv_block<8, true>(xr, xs, w, sc, bi, o, s, rows, n0, n1)
             : qmv_block<8, false>(xr, xs, w, sc, bi, o, s, rows, n0, n1);
  }
}

void qmv(
    const float* x,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s) {
  if (!has_avx2()) {
    for_rows(s.N, 1, [&](size_t n0, size_t n1) {
      for (int m = 0; m < s.M; ++m) qmv_scalar(x, w, sc, bi, out, s, m, (int)n0, (int)n1);
    });
    return;
  }
  const PreparedX px = prepare_x(x, s);
  for_outputs(s, rows_per_chunk(s), [&](size_t n0, size_t n1) {
    qmv_range(px, w, sc, bi, out, s, (int)n0, (int)n1);
  });
}

// Rows [n0, n1) and columns [k0, k1) of w as float32, row-major [n1 - n0, k1 - k0]; k0 and k1
// are whole groups.
void dequantize_rows_scalar(
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* dst,
    const Shape& s,
    int n0,
    int n1,
    int k0,
    int k1) {
  const size_t words = row_words(s.K, s.bits);
  const int groups = s.K / s.group;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * words;
    float* d = dst + (size_t)(n - n0) * (k1 - k0) - k0;
    for (int g = k0 / s.group; g < k1 / s.group; ++g) {
      const float a = sc[(size_t)n * groups + g], b = bi[(size_t)n * groups + g];
      for (int k = g * s.group; k < (g + 1) * s.group; ++k)
        d[k] = a * (float)field_at(wr, k, s.bits) + b;
    }
  }
}

// The same with AVX2: one packed word (4-bit) or two (8-bit) become 8 consecutive floats by a
// per-lane variable shift, a mask and one FMA with the group's scale and bias.
__attribute__((target("avx2,fma"))) void dequantize_rows_avx(
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* dst,
    const Shape& s,
    int n0,
    int n1,
    int k0,
    int k1) {
  const int P = per_word(s.bits), words = s.K / P, groups = s.K / s.group;
  const int words_per_group = s.group / P;
  const bool four = s.bits == 4;
  const __m256i shifts =
      four ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28) : _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24);
  const __m256i mask = _mm256_set1_epi32(four ? 15 : 255);
  const __m256i pairs = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = w + (size_t)n * words;
    // d[k] for k in [k0, k1): word i holds k = i·P ...
    float* d = dst + (size_t)(n - n0) * (k1 - k0) - k0;
    for (int g = k0 / s.group; g < k1 / s.group; ++g) {
      const __m256 a = _mm256_set1_ps(sc[(size_t)n * groups + g]);
      const __m256 b = _mm256_set1_ps(bi[(size_t)n * groups + g]);
      const int i0 = g * words_per_group, i1 = i0 + words_per_group;
      if (four) {
        for (int i = i0; i < i1; ++i) {
          __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)wr[i]), shifts);
          v = _mm256_and_si256(v, mask);
          _mm256_storeu_ps(d + (size_t)i * 8, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(v), b));
        }
      } else {
        for (int i = i0; i < i1; i += 2) {
          const __m256i two = _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i*)(wr + i)));
          __m256i v = _mm256_permutevar8x32_epi32(two, pairs);
          v = _mm256_and_si256(_mm256_srlv_epi32(v, shifts), mask);
          _mm256_storeu_ps(d + (size_t)i * 4, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(v), b));
        }
      }
    }
  }
}

// dequantize_rows_avx where the CPU has AVX2, else dequantize_rows_scalar.
void dequantize_rows(
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* dst,
    const Shape& s,
    int n0,
    int n1,
    int k0,
    int k1) {
  if (has_avx2()) {
    switch (s.bits) {
      case 2: return dequantize_rows_any<2>(w, sc, bi, dst, s, n0, n1, k0, k1);
      case 3: return dequantize_rows_any<3>(w, sc, bi, dst, s, n0, n1, k0, k1);
      case 5: return dequantize_rows_any<5>(w, sc, bi, dst, s, n0, n1, k0, k1);
      case 6: return dequantize_rows_any<6>(w, sc, bi, dst, s, n0, n1, k0, k1);
      default: dequantize_rows_avx(w, sc, bi, dst, s, n0, n1, k0, k1);
    }
  } else {
    dequantize_rows_scalar(w, sc, bi, dst, s, n0, n1, k0, k1);
  }
}

// Many rows: tiles of dequantized weights through sgemm (tiled_product).
void qmm(
    const float* x,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s) {
  if (s.panels) {
    // Tiles of whole panels, dequantized row-major as the rows' tiles are.
    tiled_product(
        x, out, s.M, s.N, s.K,
        [&](float* dst, int n0, int n1, int k0, int k1) {
          qpanel_tile(w, sc, bi, dst, k1 - k0, s.K, s.bits, s.group, n0 / QPANEL, n1 / QPANEL, k0, k1);
        },
        QPANEL);
    return;
  }
  tiled_product(x, out, s.M, s.N, s.K, [&](float* dst, int n0, int n1, int k0, int k1) {
    dequantize_rows(w, sc, bi, dst, s, n0, n1, k0, k1);
  });
}

// One product x [M, K] · dequantize(w)ᵀ by whichever path suits its rows, counted.
void product(
    const float* x,
    const uint32_t* w,
    const float* sc,
    const float* bi,
    float* out,
    const Shape& s) {
  if (s.M >= sgemm_rows(s) && sgemm() != nullptr) {
    qmm(x, w, sc, bi, out, s);
    g_sgemm_path.fetch_add(1);
  } else {
    qmv(x, w, sc, bi, out, s);
    g_rows_path.fetch_add(1);
  }
}

// A quantized matrix's packed words, scales and biases as row-major data. Weights are
// row-contiguous as loaded; a view that is not is copied here rather than by a Contiguous op in
// the graph, which would cost a dispatch every time.
struct DensePacked {
  std::vector<uint32_t> wc;
  std::vector<float> sc, bc;
  std::vector<uint8_t> s8c;
  const uint32_t* w;
  // Float scales and biases (affine), or uint8 scales and no biases (the microscaling modes).
  const float* s = nullptr;
  const float* b = nullptr;
  const uint8_t* s8 = nullptr;
  DensePacked(const View& w_, const View& s_, const View* b_) : w(dense(w_, wc)) {
    if (s_.dtype() == mx::uint8)
      s8 = dense(s_, s8c);
    else
      s = dense(s_, sc);
    if (b_) b = dense(*b_, bc);
  }
  DensePacked(const View& w_, const View& s_, const View& b_) : DensePacked(w_, s_, &b_) {}
  DensePacked(const DensePacked&) = delete;
};

// The matrix of an op's inputs at `at` (words, scales, and for affine biases), and the index
// after it.
size_t per_matrix(int mode) { return mode == 0 ? 3 : 2; }

DensePacked* matrix_at(std::vector<View>& in, size_t at, int mode, std::unique_ptr<DensePacked>& keep) {
  keep = std::make_unique<DensePacked>(in[at], in[at + 1], mode == 0 ? &in[at + 2] : nullptr);
  return keep.get();
}

// The fused ops' products of one table in any mode: the whole product by the path its rows
// suit; output rows [n0, n1) of the few-rows kernel on this thread; rows of the table as float32.
void table_product(const float* x, const DensePacked& q, float* out, const Shape& s) {
  if (s.mode != 0) return fp_product(x, q.w, q.s8, out, s.M, s.N, s.K, s.mode);
  product(x, q.w, q.s, q.b, out, s);
}

void table_rows(const PreparedX& px, const DensePacked& q, float* out, const Shape& s, int n0, int n1) {
  if (s.mode != 0) return fp_rows(px.xt, px.xt16, q.w, q.s8, out, s.M, s.N, s.K, s.mode, n0, n1);
  qmv_range(px, q.w, q.s, q.b, out, s, n0, n1);
}

// Output rows of a 2-D matrix's words: its rows, or 16 a panel.
int outputs(const View& w, bool panels) { return (int)w.shape(0) * (panels ? QPANEL : 1); }
int outputs(const mx::array& w, bool panels) { return w.shape(0) * (panels ? QPANEL : 1); }

// x [..., K] @ dequantize(w)ᵀ, w [N, K·bits/32], scales and biases [N, K/group] (or panels).
struct QuantizedMatmulOp {
  struct Params {
    int group, bits;
    bool panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQuantizedMatmul";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto &x = in[0], &w = in[1];
    const Shape s{(int)(x.size() / x.shape(-1)), outputs(w, p.panels), (int)x.shape(-1), p.bits, p.group, 0, p.panels};
    std::vector<float> xc;
    const DensePacked q(w, in[2], in[3]);
    product(dense(x, xc), q.w, q.s, q.b, out.data<float>(), s);
  }
};

// x @ dequantize(w)ᵀ followed by a post-norm block's residual update of the product (an
// attention block's o_proj, an MLP's down_proj, then norm_update_row: (residual +
// rms_norm(product, norm_w)) · scale and the next block's input norm of that): one op instead of
// two, the product's rows still in cache when they are normalised. The values are the two ops'
// own (the same product, the same row update).
struct QuantizedMatmulNormOp {
  struct Params {
    int group, bits, mode;
    float eps;
    bool has_w, has_scale, has_next, panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQuantizedMatmulNorm";

  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    const auto &x = in[0], &w = in[1];
    const Shape s{(int)(x.size() / x.shape(-1)), outputs(w, p.panels), (int)x.shape(-1), p.bits, p.group, p.mode, p.panels};
    std::vector<float> xc, wt, rt, st, nt;
    std::unique_ptr<DensePacked> keep;
    const DensePacked& q = *matrix_at(in, 1, p.mode, keep);
    // The product, reused between calls (the stream's thread makes them one at a time).
    thread_local std::vector<float> y;
    y.resize((size_t)s.M * s.N);
    table_product(dense(x, xc), q, y.data(), s);
    size_t at = 1 + per_matrix(p.mode);
    const float* nw = p.has_w ? dense(in[at++], wt) : nullptr;
    const float* res = dense(in[at++], rt);
    const float scale = p.has_scale ? dense(in[at++], st)[0] : 1.0f;
    const float* next_w = p.has_next ? dense(in[at++], nt) : nullptr;
    const NormUpdate u{nw, p.eps, p.has_scale, scale, next_w, s.N};
    float* o = outs[0].data<float>();
    float* next = p.has_next ? outs[1].data<float>() : nullptr;
    const float* yp = y.data();
    for_rows(s.M, 64, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r)
        norm_update_row(u, yp + r * s.N, res + r * s.N, o + r * s.N, next ? next + r * s.N : nullptr);
    });
  }
};

// x @ dequantize(w_i)ᵀ for several matrices of one format that read the same x (an attention
// block's q, k and v projections): one op instead of one each, x prepared once, and for few
// rows one pass over the pool across all of their rows, so the small k and v matrices do not
// each pay a round of the pool and its tail. Each output row's arithmetic is the single
// product's (a row does not depend on the rows it is computed beside).
struct QuantizedMatmulsOp {
  struct Params {
    int group, bits, mode;
    bool panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQuantizedMatmuls";

  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    std::vector<float*> o;
    for (auto& out : outs) o.push_back(out.data<float>());
    quantized_products(in[0], in.data() + 1, outs.size(), p.group, p.bits, p.mode, p.panels, o.data());
  }
};

}  // namespace

void quantized_products(
    const View& x, const View* mats, size_t n, int group, int bits, int mode, bool panels, float* const* outs) {
  const int M = (int)(x.size() / x.shape(-1)), K = (int)x.shape(-1);
  std::vector<float> xc;
  const float* xp = dense(x, xc);
  std::vector<std::unique_ptr<DensePacked>> qs;
  std::vector<Shape> shapes;
  const size_t per = per_matrix(mode);
  for (size_t i = 0; i < n; ++i) {
    const View* m = mats + per * i;
    qs.push_back(std::make_unique<DensePacked>(m[0], m[1], mode == 0 ? &m[2] : nullptr));
    shapes.push_back(Shape{M, outputs(m[0], panels), K, bits, group, mode, panels});
  }
  if (M >= sgemm_rows(shapes[0]) || !has_avx2()) {
    for (size_t i = 0; i < n; ++i) table_product(xp, *qs[i], outs[i], shapes[i]);
    return;
  }
  const PreparedX px = prepare_x(xp, shapes[0]);
  // The matrices' rows end to end; a chunk of that joint range computes its part of each
  // (whole panels of each where they are panels: every matrix's rows are).
  std::vector<int> start(n + 1, 0);
  for (size_t i = 0; i < n; ++i) start[i + 1] = start[i] + shapes[i].N;
  Shape joint = shapes[0];
  joint.N = start[n];
  for_outputs(joint, rows_per_chunk(shapes[0]), [&](size_t n0, size_t n1) {
    for (size_t i = 0; i < n; ++i) {
      const int a = std::max((int)n0, start[i]), b = std::min((int)n1, start[i + 1]);
      if (a < b) table_rows(px, *qs[i], outs[i], shapes[i], a - start[i], b - start[i]);
    }
  });
  g_rows_path.fetch_add(n);
}

namespace {

// act(x @ dequantize(gate)ᵀ) ⊙ (x @ dequantize(up)ᵀ) with act gelu_tanh (gemma4's GeGLU) or
// silu (GLM's SwiGLU): an MLP before its down projection, in one op instead of four or five (two
// products, the activation, the products with up), and for few rows one pass over the pool:
// each chunk of output columns computes its gate and up values and combines them while they
// are in cache. The values are the unfused kernels' own (the same products, the same
// activation kernel).
struct QuantizedGluOp {
  struct Params {
    int group, bits, mode;
    GluAct act;
    bool panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQuantizedGlu";

  static void combine(GluAct act, const float* g, const float* u, float* o, size_t n) {
    if (act == GluAct::Silu) return silu_mul_range(g, u, o, 0, n);
    gelu_range(g, o, 0, n);
    for (size_t i = 0; i < n; ++i) o[i] *= u[i];
  }

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto& x = in[0];
    const Shape s{(int)(x.size() / x.shape(-1)), outputs(in[1], p.panels), (int)x.shape(-1), p.bits, p.group, p.mode, p.panels};
    std::vector<float> xc;
    const float* xp = dense(x, xc);
    std::unique_ptr<DensePacked> gk, uk;
    const DensePacked& g = *matrix_at(in, 1, p.mode, gk);
    const DensePacked& u = *matrix_at(in, 1 + per_matrix(p.mode), p.mode, uk);
    float* o = out.data<float>();
    const size_t total = (size_t)s.M * s.N;
    std::vector<float> gate(total), up(total);
    if (s.M >= sgemm_rows(s) || !has_avx2()) {
      table_product(xp, g, gate.data(), s);
      table_product(xp, u, up.data(), s);
      for_rows(total, 1 << 14, [&](size_t i0, size_t i1) {
        combine(p.act, gate.data() + i0, up.data() + i0, o + i0, i1 - i0);
      });
      return;
    }
    const PreparedX px = prepare_x(xp, s);
    for_outputs(s, rows_per_chunk(s), [&](size_t n0, size_t n1) {
      table_rows(px, g, gate.data(), s, (int)n0, (int)n1);
      table_rows(px, u, up.data(), s, (int)n0, (int)n1);
      for (int m = 0; m < s.M; ++m) {
        const size_t at = (size_t)m * s.N + n0;
        combine(p.act, gate.data() + at, up.data() + at, o + at, n1 - n0);
      }
    });
    g_rows_path.fetch_add(2);
  }
};

// x [B, M, K], w [E, N, K·bits/32], scales and biases [E, N, K/group],
// idx [B] (uint32) → out [B, M, N]: row block b times expert idx[b]. With one row per block,
// consecutive blocks of the same expert (MLX sorts them for prefill) are one matrix product,
// so an expert's weights are read once per run rather than once per token.
struct GatherQuantizedMatmulOp {
  struct Params {
    int group, bits;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuGatherQuantizedMatmul";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto &x = in[0], &w = in[1], &idx = in[4];
    const int B = (int)idx.size(), M = (int)x.shape(-2), K = (int)x.shape(-1);
    const int E = (int)w.shape(0), N = (int)w.shape(1);
    const int group = p.group, bits = p.bits;
    std::vector<float> xd;
    std::vector<uint32_t> id;
    const float* xp = dense(x, xd);
    const uint32_t* ip = dense(idx, id);
    float* op = out.data<float>();
    const size_t words = (size_t)N * row_words(K, bits), groups = (size_t)N * (K / group);
    const DensePacked q(w, in[2], in[3]);
    expert_runs(ip, B, M, N, E, op, [&](int e, int b, int run) {
      const Shape s{run * M, N, K, bits, group};
      product(xp + (size_t)b * M * K, q.w + e * words, q.s + e * groups, q.b + e * groups,
              op + (size_t)b * M * N, s);
    });
  }
};

// dequantize(w): w [..., N, K·bits/32], scales and biases [..., N, K/group] → [..., N, K]. A
// quantized embedding lookup (a gather of rows, then this) is one op here where MLX's CPU
// graph for it is ~20 (shifts, masks, broadcasts, a concatenation) every decode step.
struct DequantizeOp {
  struct Params {
    int group, bits;
    bool panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuDequantize";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto& w = in[0];
    // Panels [N/16, words, 16] hold rows of words.shape(1) words.
    const int K = row_values(w.shape(p.panels ? 1 : -1), p.bits);
    const int N = (int)(w.size() * 32 / p.bits / K);
    const Shape s{1, N, K, p.bits, p.group};
    const DensePacked q(w, in[1], in[2]);
    float* o = out.data<float>();
    // Rows of at least 16 KB of output per chunk: a lookup of a few rows stays on this thread.
    for_rows(N, std::max(1, 4096 / K), [&](size_t n0, size_t n1) {
      if (p.panels)
        for (size_t n = n0; n < n1; ++n) qpanel_row(q.w, q.s, q.b, o + n * K, (int)n, K, p.bits, p.group);
      else
        dequantize_rows(q.w, q.s, q.b, o + n0 * K, s, (int)n0, (int)n1, 0, K);
    });
  }
};

// dequantize(w[ids]) · scale: w [V, K·bits/32], scales and biases [V, K/group], ids int32 or
// uint32 of any shape → [..ids, K]. A quantized embedding lookup is MLX's three gathers (and
// their squeezes), the dequantization and the scaling, ten ops every decode step; here one.
// Each row is dequantize_rows' and then one float32 multiply, so the values are those ops'. A
// negative id counts from the end, as in MLX's take; an id outside [-V, V) gives zeros.
struct QuantizedEmbeddingOp {
  struct Params {
    int group, bits;
    bool has_scale;
    float scale;
    bool panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQuantizedEmbedding";

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const auto& w = in[1];
    const int V = outputs(w, p.panels), K = row_values(w.shape(1), p.bits);
    const Shape s{1, V, K, p.bits, p.group};
    std::vector<int32_t> it;
    const int32_t* ids = dense(in[0], it);
    const bool unsigned_ids = in[0].dtype() == mx::uint32;
    const DensePacked q(w, in[2], in[3]);
    float* o = out.data<float>();
    for_rows(in[0].size(), std::max(1, 4096 / K), [&](size_t t0, size_t t1) {
      for (size_t t = t0; t < t1; ++t) {
        int64_t id = unsigned_ids ? (int64_t)(uint32_t)ids[t] : (int64_t)ids[t];
        if (id < 0) id += V;
        float* row = o + t * K;
        if (id < 0 || id >= V) {
          std::fill(row, row + K, 0.0f);
          continue;
        }
        if (p.panels)
          qpanel_row(q.w, q.s, q.b, row, (int)id, K, p.bits, p.group);
        else
          dequantize_rows(q.w, q.s, q.b, row, s, (int)id, (int)id + 1, 0, K);
        if (p.has_scale)
          for (int k = 0; k < K; ++k) row[k] = row[k] * p.scale;
      }
    });
  }
};

// The checks both products share: the CPU, float32 activations, supported bits and groups,
// packed sizes that agree.
// What every kernel here reads: the kernels on, the CPU, supported bits and groups, uint32
// words with float32 scales and biases of one shape and rank.
bool packed_format_applies(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    int mode = 0) {
  if (mode != 0)
    // A microscaling mode at its own width and group: uint8 scales, no biases.
    return g_enabled.load() && mx::default_device() == mx::Device::cpu && !biases &&
           fp_format(mode, bits, group_size) && w.dtype() == mx::uint32 &&
           scales.dtype() == mx::uint8 && scales.ndim() == w.ndim();
  return g_enabled.load() && mx::default_device() == mx::Device::cpu && biases &&
         (bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8) &&
         (group_size == 32 || group_size == 64 || group_size == 128) &&
         w.dtype() == mx::uint32 && scales.dtype() == mx::float32 &&
         biases->dtype() == mx::float32 && scales.ndim() == w.ndim() &&
         biases->shape() == scales.shape();
}

bool kernel_applies(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    bool transpose,
    int group_size,
    int bits,
    int mode = 0) {
  const int K = x.ndim() >= 1 ? x.shape(-1) : 0;
  return packed_format_applies(w, scales, biases, group_size, bits, mode) && transpose &&
         x.dtype() == mx::float32 && x.ndim() >= 1 && x.size() > 0 && w.ndim() >= 2 &&
         (int64_t)K * bits == (int64_t)w.shape(-1) * 32 && K % group_size == 0 &&
         (mode != 0 || !word_aligned(bits) || K % (256 / bits) == 0) &&
         scales.shape(-2) == w.shape(-2) && scales.shape(-1) == K / group_size;
}

// What the panel kernels read: affine panels (qpanel_cpu.h) at a width and group they take,
// words [N/16, K·bits/32, 16] with float32 scales and biases [N/16, K/group, 16].
bool panels_format_applies(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits) {
  return g_enabled.load() && mx::default_device() == mx::Device::cpu && biases && qpanel_applies(bits, group_size) &&
         w.dtype() == mx::uint32 && scales.dtype() == mx::float32 && biases->dtype() == mx::float32 &&
         w.ndim() == 3 && w.shape(2) == QPANEL && w.shape(0) > 0 && scales.ndim() == 3 &&
         scales.shape(0) == w.shape(0) && scales.shape(2) == QPANEL && biases->shape() == scales.shape() &&
         (int64_t)w.shape(1) * 32 == (int64_t)scales.shape(1) * group_size * bits;
}

}  // namespace

void set_cpu_qmm_enabled(bool on) { g_enabled.store(on); }

bool cpu_qmm_enabled() { return g_enabled.load(); }

void count_qmm_path(bool sgemm_path) { (sgemm_path ? g_sgemm_path : g_rows_path).fetch_add(1); }

void set_cpu_qmm_unpacking(int mode) { g_subnormal.store(mode); }

// 0 none, 1 conversion, 2 subnormal fields; plus 4 where 2, 3, 5 and 6 bits take VNNI.
int cpu_qmm_unpacking() { return !has_avx2() ? 0 : (subnormal_fields() ? 2 : 1) | (has_vnni() ? 4 : 0); }

uint64_t cpu_qmm_count(bool sgemm_path) {
  return sgemm_path ? g_sgemm_path.load() : g_rows_path.load();
}

std::optional<mx::array> cpu_quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    bool transpose,
    int group_size,
    int bits,
    bool panels) {
  if (!transpose || !cpu_qmm_applies(x, w, scales, biases, group_size, bits, 0, panels)) return std::nullopt;
  auto shape = x.shape();
  shape.back() = outputs(w, panels);
  return make<QuantizedMatmulOp>(shape, {group_size, bits, panels}, {x, w, scales, *biases});
}

std::optional<std::vector<mx::array>> cpu_quantized_matmul_norm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    int mode,
    const std::optional<mx::array>& norm_w,
    float eps,
    const mx::array& residual,
    const std::optional<mx::array>& scale,
    const std::optional<mx::array>& next_w,
    bool panels) {
  if (!cpu_qmm_applies(x, w, scales, biases, group_size, bits, mode, panels)) return std::nullopt;
  auto shape = x.shape();
  shape.back() = outputs(w, panels);
  if (!cpu_norm_update_applies(shape, norm_w, residual, scale, next_w)) return std::nullopt;
  std::vector<mx::array> in{x, w, scales};
  if (biases) in.push_back(*biases);
  if (norm_w) in.push_back(*norm_w);
  in.push_back(residual);
  if (scale) in.push_back(*scale);
  if (next_w) in.push_back(*next_w);
  std::vector<mx::Shape> shapes(next_w ? 2 : 1, shape);
  return make_many<QuantizedMatmulNormOp>(
      std::move(shapes),
      {group_size, bits, mode, eps, norm_w.has_value(), scale.has_value(), next_w.has_value(), panels},
      std::move(in));
}

std::optional<mx::array> cpu_gather_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    const std::optional<mx::array>& lhs_indices,
    const std::optional<mx::array>& rhs_indices,
    bool transpose,
    int group_size,
    int bits) {
  const bool fits = kernel_applies(x, w, scales, biases, transpose, group_size, bits) &&
                    w.ndim() == 3 && x.ndim() >= 2 && !lhs_indices && rhs_indices &&
                    mx::issubdtype(rhs_indices->dtype(), mx::integer);
  if (!fits) return std::nullopt;
  auto stream = mx::default_stream(mx::Device::cpu);
  const int M = x.shape(-2), K = x.shape(-1);
  mx::Shape xb(x.shape().begin(), x.shape().end() - 2);
  mx::Shape batch = mx::broadcast_shapes(xb, rhs_indices->shape());
  mx::Shape xs = batch;
  xs.push_back(M);
  xs.push_back(K);
  // Broadcast views; the kernel reads them densely itself (a Contiguous op each would cost a
  // dispatch every call). Ids are uint32 already when they come from argpartition/argsort.
  auto xc = mx::broadcast_to(x, xs, stream);
  auto ids = rhs_indices->dtype() == mx::uint32 ? *rhs_indices
                                                : mx::astype(*rhs_indices, mx::uint32, stream);
  auto ic = mx::broadcast_to(ids, batch, stream);
  mx::Shape os = batch;
  os.push_back(M);
  os.push_back(w.shape(1));
  return make<GatherQuantizedMatmulOp>(os, {group_size, bits}, {xc, w, scales, *biases, ic});
}

std::optional<mx::array> cpu_dequantize(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    bool panels) {
  if (panels) {
    if (!panels_format_applies(w, scales, biases, group_size, bits)) return std::nullopt;
    const int K = row_values(w.shape(1), bits);
    return make<DequantizeOp>({w.shape(0) * QPANEL, K}, {group_size, bits, true}, {w, scales, *biases});
  }
  const bool fits = packed_format_applies(w, scales, biases, group_size, bits) &&
                    w.ndim() >= 1 && w.size() > 0 &&
                    std::equal(w.shape().begin(), w.shape().end() - 1, scales.shape().begin()) &&
                    (size_t)w.shape(-1) * 32 == (size_t)scales.shape(-1) * group_size * bits;
  if (!fits) return std::nullopt;
  auto shape = w.shape();
  shape.back() = row_values(w.shape(-1), bits);
  return make<DequantizeOp>(shape, {group_size, bits, false}, {w, scales, *biases});
}

std::optional<mx::array> cpu_quantized_embedding(
    const mx::array& ids,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    std::optional<float> scale,
    bool panels) {
  const bool table = panels ? panels_format_applies(w, scales, biases, group_size, bits)
                            : packed_format_applies(w, scales, biases, group_size, bits) && w.ndim() == 2 &&
                                  scales.ndim() == 2 && w.shape(0) == scales.shape(0) && w.shape(0) > 0 &&
                                  (size_t)w.shape(1) * 32 == (size_t)scales.shape(1) * group_size * bits;
  const bool fits = table && (ids.dtype() == mx::int32 || ids.dtype() == mx::uint32) && ids.size() > 0;
  if (!fits) return std::nullopt;
  auto shape = ids.shape();
  shape.push_back(row_values(w.shape(1), bits));
  return make<QuantizedEmbeddingOp>(
      shape, {group_size, bits, scale.has_value(), scale.value_or(1.0f), panels}, {ids, w, scales, biases});
}

bool cpu_qmm_applies(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    int mode,
    bool panels) {
  if (panels)
    return mode == 0 && panels_format_applies(w, scales, biases, group_size, bits) && x.dtype() == mx::float32 &&
           x.ndim() >= 1 && x.size() > 0 && (int64_t)x.shape(-1) * bits == (int64_t)w.shape(1) * 32;
  return kernel_applies(x, w, scales, biases, true, group_size, bits, mode) && w.ndim() == 2 &&
         scales.ndim() == 2;
}

std::optional<std::vector<mx::array>> cpu_quantized_matmuls(
    const mx::array& x,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int group_size,
    int bits,
    int mode,
    bool panels) {
  // Affine matrices have biases, the microscaling modes none.
  const size_t with_biases = mode == 0 ? ws.size() : 0;
  if (ws.empty() || scales.size() != ws.size() || biases.size() != with_biases || !fused_cpu_enabled())
    return std::nullopt;
  std::vector<mx::Shape> shapes;
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto b = mode == 0 ? std::optional<mx::array>(biases[i]) : std::nullopt;
    if (!cpu_qmm_applies(x, ws[i], scales[i], b, group_size, bits, mode, panels)) return std::nullopt;
    auto shape = x.shape();
    shape.back() = outputs(ws[i], panels);
    shapes.push_back(std::move(shape));
    inputs.insert(inputs.end(), {ws[i], scales[i]});
    if (b) inputs.push_back(*b);
  }
  return make_many<QuantizedMatmulsOp>(std::move(shapes), {group_size, bits, mode, panels}, std::move(inputs));
}

std::optional<mx::array> cpu_quantized_glu(
    const mx::array& x,
    const mx::array& gate_w,
    const mx::array& gate_scales,
    const std::optional<mx::array>& gate_biases,
    const mx::array& up_w,
    const mx::array& up_scales,
    const std::optional<mx::array>& up_biases,
    int group_size,
    int bits,
    GluAct act,
    int mode,
    bool panels) {
  const bool fits = fused_cpu_enabled() &&
                    cpu_qmm_applies(x, gate_w, gate_scales, gate_biases, group_size, bits, mode, panels) &&
                    cpu_qmm_applies(x, up_w, up_scales, up_biases, group_size, bits, mode, panels) &&
                    up_w.shape() == gate_w.shape() && up_scales.shape() == gate_scales.shape();
  if (!fits) return std::nullopt;
  auto shape = x.shape();
  shape.back() = outputs(gate_w, panels);
  std::vector<mx::array> in{x, gate_w, gate_scales};
  if (gate_biases) in.push_back(*gate_biases);
  in.insert(in.end(), {up_w, up_scales});
  if (up_biases) in.push_back(*up_biases);
  return make<QuantizedGluOp>(shape, {group_size, bits, mode, act, panels}, std::move(in));
}

}  // namespace mlxr
