// Fused CPU kernels for RMS norm, RoPE, attention and tanh-GELU, and a few-row float32 matmul,
// registered as MLX primitives.
//
// MLX's CPU backend has no kernels for its `fast` ops: each falls back to a graph of small ops
// (an RMS norm is ~10, a RoPE ~20, attention ~15, and every scalar operand adds a Broadcast).
// A one-token decode step of a small model is ~2000 such ops at a few microseconds of dispatch
// each, which is more than its matrix products cost. Each kernel here is one op that reads its
// inputs once. They take float32 on the CPU stream and compute what MLX's fallback graphs
// compute (same formulas, float32 throughout); anything else is left to MLX.

#include "mlx-sys/src/fused_cpu.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "mlx-sys/src/cpu_common.h"
#include "mlx-sys/src/qmm_cpu.h"
#include "mlx-sys/src/qpanel_cpu.h"

// GCC 12's AVX-512 intrinsics give their undefined operands themselves as a value
// (`__Y = __Y`), which its own -Wuninitialized then reports wherever they are inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace mx = mlx::core;

namespace mlxr {

namespace {

std::atomic<bool> g_enabled{true};
constexpr int kKinds = 16;
std::atomic<uint64_t> g_counts[kKinds] = {};

void count(FusedKind k) { g_counts[static_cast<int>(k)].fetch_add(1, std::memory_order_relaxed); }

bool on_cpu() { return g_enabled.load() && mx::default_device() == mx::Device::cpu; }

// Each kernel's runs are counted: tests check that the kernel, not MLX, answered.
template <class Op>
struct Counted {
  using Params = typename Op::Params;
  static constexpr const char* name = Op::name;
  static int donor(const Params& p, size_t out)
    requires requires { Op::donor(p, out); }
  {
    return Op::donor(p, out);
  }
  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    if constexpr (requires { Op::run_many(p, in, outs); }) {
      Op::run_many(p, in, outs);
    } else {
      Op::run(p, in, outs[0]);
    }
    count(Op::kind);
  }
};

template <class Op>
std::optional<mx::array> fused(const mx::Shape& shape, typename Op::Params p, std::vector<mx::array> inputs) {
  return make<Counted<Op>>(shape, p, std::move(inputs));
}

template <class Op>
std::optional<std::vector<mx::array>> fused_many(
    std::vector<mx::Shape> shapes, typename Op::Params p, std::vector<mx::array> inputs,
    std::vector<mx::Dtype> dtypes = {}) {
  return make_many<Counted<Op>>(std::move(shapes), p, std::move(inputs), std::move(dtypes));
}

// ---- vector helpers ---------------------------------------------------------------------------

__attribute__((target("avx2,fma"))) float dot_avx(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

__attribute__((target("avx2,fma"))) void axpy_avx(float a, const float* x, float* y, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

float dot(const float* a, const float* b, int n) {
  if (has_avx2()) return dot_avx(a, b, n);
  float s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* x, float* y, int n) {
  if (has_avx2()) return axpy_avx(a, x, y, n);
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// ---- RMS norm: x · rsqrt(mean(x²) + eps) · w over the last axis ------------------------------

// One row of d values (w may be null), as every kernel here that normalises computes it.
void rms_norm_row(const float* xr, const float* w, float eps, int d, float* orow) {
  // MLX: mean as the sum times 1/d, plus eps, then rsqrt, all in float32.
  const float inv = 1.0f / std::sqrt(dot(xr, xr, d) * (1.0f / d) + eps);
  if (w) {
    for (int i = 0; i < d; ++i) orow[i] = (xr[i] * inv) * w[i];
  } else {
    for (int i = 0; i < d; ++i) orow[i] = xr[i] * inv;
  }
}

}  // namespace

void norm_update_row(const NormUpdate& u, const float* x, const float* res, float* orow, float* next) {
  rms_norm_row(x, u.w, u.eps, u.d, orow);
  if (res)
    for (int i = 0; i < u.d; ++i) orow[i] = res[i] + orow[i];
  if (u.scaled)
    for (int i = 0; i < u.d; ++i) orow[i] = orow[i] * u.scale;
  if (next) rms_norm_row(orow, u.next_w, u.eps, u.d, next);
}

namespace {

struct RmsNormOp {
  struct Params {
    float eps;
    bool has_w;
    // Adds a residual of x's shape to the normalised x (a post-norm block's `h + norm(a)`),
    // saving the Add op: the same float32 sum, computed after the same rounded product; and
    // then multiplies by a one-element scale (gemma4's layer scalar), saving a Broadcast and
    // a Multiply.
    bool has_residual;
    bool has_scale;
    // A second output: the result RMS-normalised again by a second weight (the next block's
    // input norm after a residual update), saving that norm's op.
    bool has_next;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuRmsNorm";
  static constexpr FusedKind kind = FusedKind::RmsNorm;

  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    std::vector<float> xt, wt, rt, st, nt;
    size_t at = 0;
    const float* x = dense(in[at++], xt);
    const float* w = p.has_w ? dense(in[at++], wt) : nullptr;
    const float* res = p.has_residual ? dense(in[at++], rt) : nullptr;
    const float scale = p.has_scale ? dense(in[at++], st)[0] : 1.0f;
    const float* next_w = p.has_next ? dense(in[at++], nt) : nullptr;
    const int d = in[0].shape(-1);
    const size_t rows = in[0].size() / d;
    float* o = outs[0].data<float>();
    float* next = p.has_next ? outs[1].data<float>() : nullptr;
    const NormUpdate u{w, p.eps, p.has_scale, scale, next_w, d};
    for_rows(rows, 64, [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r)
        norm_update_row(u, x + r * d, res ? res + r * d : nullptr, o + r * d, next ? next + r * d : nullptr);
    });
  }
};

// ---- RoPE over x [B, ..., T, D] at positions offset[b] + t ------------------------------------

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool has_freqs;
  bool operator==(const RopeParams&) const = default;
};

// One rotation's cosines and sines at a position, and the rotation of a row of D values (in
// place or not), as every kernel here that rotates computes them.
class RopeAngles {
 public:
  RopeAngles(const RopeParams& p, const View* freqs)
      : dims_(p.dims), half_(p.dims / 2), traditional_(p.traditional), inv_(half_), cs_(half_), sn_(half_) {
    // The inverse wavelengths exactly as MLX's fallback forms them, in float32.
    if (freqs) {
      std::vector<float> ft;
      const float* f = dense(*freqs, ft);
      for (int i = 0; i < half_; ++i) inv_[i] = 1.0f / f[i];
    } else {
      const float c = std::log(p.base) / half_;
      for (int i = 0; i < half_; ++i) inv_[i] = std::exp(static_cast<float>(-i) * c);
    }
  }

  void at(float pos) const {
    for (int i = 0; i < half_; ++i) {
      const float theta = pos * inv_[i];
      cs_[i] = std::cos(theta);
      sn_[i] = std::sin(theta);
    }
  }

  void rotate(const float* xr, float* orow, int D) const {
    const float* cs = cs_.data();
    const float* sn = sn_.data();
    if (traditional_) {
      for (int i = 0; i < half_; ++i) {
        const float x1 = xr[2 * i], x2 = xr[2 * i + 1];
        orow[2 * i] = x1 * cs[i] - x2 * sn[i];
        orow[2 * i + 1] = x1 * sn[i] + x2 * cs[i];
      }
    } else {
      for (int i = 0; i < half_; ++i) {
        const float x1 = xr[i], x2 = xr[i + half_];
        orow[i] = x1 * cs[i] - x2 * sn[i];
        orow[i + half_] = x1 * sn[i] + x2 * cs[i];
      }
    }
    if (orow != xr) std::memcpy(orow + dims_, xr + dims_, sizeof(float) * (D - dims_));
  }

 private:
  int dims_, half_;
  bool traditional_;
  std::vector<float> inv_;
  mutable std::vector<float> cs_, sn_;
};

// A rotation's position offsets: int32, one for every row or one per row (a batched decode
// step's sequences each at their own position).
class Offsets {
 public:
  explicit Offsets(const View& v)
      : off_(v.data<int32_t>()), stride_(v.ndim() == 1 ? v.strides()[0] : 0), per_row_(v.size() > 1) {}
  float operator[](size_t r) const { return static_cast<float>(per_row_ ? off_[r * stride_] : off_[0]); }

 private:
  const int32_t* off_;
  int64_t stride_;
  bool per_row_;
};

struct RopeOp {
  using Params = RopeParams;
  static constexpr const char* name = "MlxrCpuRope";
  static constexpr FusedKind kind = FusedKind::Rope;

  static void run(const Params& p, std::vector<View>& in, View& out) {
    const View& xa = in[0];
    const int B = xa.shape(0), T = xa.shape(-2), D = xa.shape(-1);
    const int N = (int)(xa.size() / ((size_t)B * T * D));
    // 3-D and 4-D inputs are read through their strides (a transposed [B, T, N, D] is the
    // usual case); others, or a strided last axis, are copied first.
    std::vector<float> xt;
    const float* x;
    int64_t sb, sh, stt;
    if ((xa.ndim() == 3 || xa.ndim() == 4) && xa.strides().back() == 1) {
      x = xa.data<float>();
      sb = xa.strides()[0];
      sh = xa.ndim() == 4 ? xa.strides()[1] : 0;
      stt = xa.strides()[xa.ndim() - 2];
    } else {
      x = dense(xa, xt);
      sb = (int64_t)N * T * D;
      sh = (int64_t)T * D;
      stt = D;
    }
    const Offsets offsets(in[1]);
    const RopeAngles angles(p, p.has_freqs ? &in[2] : nullptr);
    float* o = out.data<float>();
    for (int b = 0; b < B; ++b) {
      const float offset = offsets[b];
      for (int t = 0; t < T; ++t) {
        angles.at((static_cast<float>(t) + offset) * p.scale);
        for (int n = 0; n < N; ++n)
          angles.rotate(x + b * sb + n * sh + t * stt, o + (((size_t)b * N + n) * T + t) * D, D);
      }
    }
  }
};

// ---- per-head RMS norm, then RoPE, of a decode step's token rows -----------------------------
//
// y [1, T, n·d] (a projection's output, one token per sequence) → [T, n, 1, d]: each token row
// split into n heads, each head RMS-normalised over d (with w, or without), then rotated at
// position offsets[t] (or not rotated). One op for what is otherwise a reshape, a norm and a
// rotation (gemma4's queries and keys; its values without the rotation), each value computed as
// the RmsNorm and Rope kernels compute it.

// Token row t's heads of y (heads rows of d floats from row t·heads) into o's same rows: each
// RMS-normalised (w optional), then rotated where angles are given (already at t's position).
// HeadsNormRopeOp and QkvHeadsOp both compute through it, so that the fused q/k/v op's parts
// are the one-part op's bits.
void norm_heads(const float* y, const float* w, float eps, int d, int heads, size_t t, float* o,
                const RopeAngles* angles) {
  for (int h = 0; h < heads; ++h) {
    const size_t r = t * heads + h;
    rms_norm_row(y + r * d, w, eps, d, o + r * d);
    if (angles) angles->rotate(o + r * d, o + r * d, d);
  }
}

struct HeadsNormRopeOp {
  struct Params {
    int heads;
    float eps;
    bool has_w;
    bool has_rope;
    RopeOp::Params rope;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuHeadsNormRope";
  static constexpr FusedKind kind = FusedKind::HeadsNormRope;

  static void run(const Params& p, std::vector<View>& in, View& out) {
    std::vector<float> yt, wt;
    size_t at = 0;
    const float* y = dense(in[at++], yt);
    const float* w = p.has_w ? dense(in[at++], wt) : nullptr;
    const int d = in[0].shape(-1) / p.heads;
    const size_t rows = in[0].size() / ((size_t)p.heads * d);
    float* o = out.data<float>();
    if (!p.has_rope) {
      for (size_t t = 0; t < rows; ++t) norm_heads(y, w, p.eps, d, p.heads, t, o, nullptr);
      return;
    }
    const Offsets offsets(in[at++]);
    const RopeAngles angles(p.rope, p.rope.has_freqs ? &in[at] : nullptr);
    for (size_t t = 0; t < rows; ++t) {
      angles.at((0.0f + offsets[t]) * p.rope.scale);
      norm_heads(y, w, p.eps, d, p.heads, t, o, &angles);
    }
  }
};

// ---- a decode step's queries, keys and values in one op ---------------------------------------
//
// gemma4's three HeadsNormRope ops of one layer's decode step as one op with three outputs:
// queries normalised with q_norm and rotated, keys with k_norm and rotated, values normalised
// without a weight and not rotated, all of one head width d. Each token row's angles are worked
// out once for its queries and keys; every value is the one the HeadsNormRope kernel gives for
// its part (both go through norm_heads).

struct QkvHeadsOp {
  struct Params {
    int q_heads;
    int kv_heads;
    float eps;
    RopeOp::Params rope;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQkvHeads";
  static constexpr FusedKind kind = FusedKind::HeadsNormRope;

  // in: q [1, T, q_heads·d], k and v [1, T, kv_heads·d], q_norm [d], k_norm [d], offsets
  // (int32, one or T), then the wavelengths where the rotation has them.
  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    std::vector<float> qt, kt, vt;
    const float* y[3] = {dense(in[0], qt), dense(in[1], kt), dense(in[2], vt)};
    heads(p, y, in[0].shape(-1) / p.q_heads, in[0].size() / in[0].shape(-1), in.data() + 3, outs);
  }

  // The three parts' heads from row-major q, k and v rows (y), each head d wide; rest: q_norm,
  // k_norm, offsets and the wavelengths where the rotation has them.
  static void heads(const Params& p, const float* const y[3], int d, size_t rows, const View* rest,
                    std::vector<View>& outs) {
    std::vector<float> wqt, wkt;
    const float* w[3] = {dense(rest[0], wqt), dense(rest[1], wkt), nullptr};
    const int counts[3] = {p.q_heads, p.kv_heads, p.kv_heads};
    const Offsets offsets(rest[2]);
    const RopeAngles angles(p.rope, p.rope.has_freqs ? &rest[3] : nullptr);
    for (size_t t = 0; t < rows; ++t) {
      angles.at((0.0f + offsets[t]) * p.rope.scale);
      for (int part = 0; part < 3; ++part)
        norm_heads(y[part], w[part], p.eps, d, counts[part], t, outs[part].data<float>(), part < 2 ? &angles : nullptr);
    }
  }
};

// The q, k and v projections of x (quantized, one format) and then QkvHeadsOp of them: a decode
// step's attention input in one op instead of two. With two matrices the keys are the values
// (k_eq_v). The values are the two ops' own (the same products, the same heads).
struct QuantizedQkvHeadsOp {
  struct Params {
    QkvHeadsOp::Params heads;
    int group, bits, matrices, mode;
    bool panels;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuQuantizedQkvHeads";
  static constexpr FusedKind kind = FusedKind::HeadsNormRope;

  // in: x [..., K], (w, scales and, for affine, biases) per matrix, then QkvHeadsOp's q_norm,
  // k_norm, offsets and wavelengths.
  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    const View& x = in[0];
    const size_t rows = x.size() / x.shape(-1);
    const int n = p.matrices, per = p.mode == 0 ? 3 : 2;
    // The raw projections end to end, reused between calls (the stream's thread makes them one
    // at a time).
    thread_local std::vector<float> raw;
    size_t total = 0;
    // A matrix's outputs: its rows, or 16 a panel.
    auto outputs = [&](int i) { return (size_t)in[1 + per * i].shape(0) * (p.panels ? QPANEL : 1); };
    for (int i = 0; i < n; ++i) total += outputs(i);
    raw.resize(rows * total);
    float* parts[3] = {raw.data(), nullptr, nullptr};
    for (int i = 1; i < n; ++i) parts[i] = parts[i - 1] + rows * outputs(i - 1);
    quantized_products(x, in.data() + 1, n, p.group, p.bits, p.mode, p.panels, parts);
    const float* y[3] = {parts[0], parts[1], n == 3 ? parts[2] : parts[1]};
    QkvHeadsOp::heads(p.heads, y, (int)(outputs(0) / p.heads.q_heads), rows, in.data() + 1 + per * n, outs);
  }
};

// ---- attention for a few queries: softmax(q kᵀ · scale + mask) v -----------------------------
//
// One work item is a key range of one (batch, kv head): every query head of its group and every
// query row is computed against each key block while it is in cache, so K and V are read once
// per step. The keys are split into parts of kPartKeys at fixed positions and the partial
// softmax states merged (each part keeps its running max, sum and weighted V sum): enough items
// for whichever thread is running to take the next (a decode step has one or two kv heads, and
// a thread that loses its core to the engine's main thread for a while would hold up a whole
// head), and the same parts whatever the key count, so that a verify step's rows, whose extra
// keys are hidden (weight 0, or parts of weight 0), are the one-row decode steps' bits.

// The most query rows (per batch and head) the kernel takes: decode and draft verification.
// Longer prompts are compute-bound, where MLX's matmul-based graph (BLAS) is faster.
constexpr int kMaxQueries = 16;
constexpr int kKeyBlock = 64;
constexpr int kPartKeys = 4 * kKeyBlock;
// Query rows computed together against a key block: each key and value row is loaded once for
// all of them, and their dot products are independent FMA chains.
constexpr int kTile = 4;

// Key and value rows are asked for ahead of use. A decode step's cache rows come from memory
// (the step's weights have pushed them out of cache since the last step) and a head's rows are
// only a few hundred KB: too short a stream for the hardware prefetcher to reach full speed.
// Key rows are fetched this many rows ahead; a block's value rows are fetched while its scores
// are computed, as the values pass reads them a column chunk at a time. Both are fetched into
// L2 (T1), not L1: L1's few miss buffers, shared with the loads of the arithmetic, capped how
// many lines were on their way. Standalone copy of this kernel, the bench model's ten layers
// (8 query heads on 2 kv heads, 8 sliding layers of at most 512 keys × 128, 2 full ones × 256)
// in 8 sets taken in turn so that every step reads from memory, both cores: 17-22 GB/s into
// L2 against 10-15 into L1 (K into L2 and V into L1: 13-19; no prefetching: 10-13); a plain
// sum over the same rows reads 25-32. End to end, `generate -n 300` at a 607-token prompt on
// the 4-bit bench model, interleaved with the L1 build: 1.07x decode (6 rounds, each ≥ 1.03).
// The quantized kernel's weight prefetches stay in L1 (into L2 there: 1.00x). A prefetch past
// the end of the cache is harmless (it never faults); its address is worked out as an
// integer, not as a pointer past the array.
constexpr int kAhead = 16;

// The widest vectors of the kernels whose bits do not depend on their width (the panel product:
// 512, 256 or 0 for scalar; a quantized cache's values pass: 512 or 256), capped by the CPU.
// Tests set it to check that every width gives the same bits.
std::atomic<int> g_vector_width{512};

// Key and value rows may be stored as float32, float16 or bfloat16 (a cache of a smaller type
// halves what a decode step reads); the arithmetic is float32 throughout, each element widened
// exactly as it is loaded.
using f16 = mx::float16_t;
using bf16 = mx::bfloat16_t;

inline bool has_f16c() {
  static const bool yes = has_avx2() && __builtin_cpu_supports("f16c");
  return yes;
}

// Whether the AVX2 paths take rows of T (float16's need the F16C conversions too).
template <class T>
bool vector_rows() {
  if constexpr (std::is_same_v<T, f16>) return has_f16c();
  return has_avx2();
}

// Eight elements of T from p, as floats.
template <class T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, f16>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

template <class T>
inline float widen(T x) {
  return static_cast<float>(x);
}

template <class T>
inline void prefetch_row(const T* row, int64_t ahead, int d) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(row) + (uintptr_t)(ahead * (int64_t)sizeof(T));
  const int line = 64 / (int)sizeof(T);
  for (int i = 0; i < d; i += line) _mm_prefetch(reinterpret_cast<const char*>(at + i * sizeof(T)), _MM_HINT_T1);
}

// The chains a[i][t] (key i of a pair, query row t of a tile) reduced to sums[i][t] by one
// fixed tree of horizontal adds in which each result lane depends on its own chain only.
__attribute__((target("avx2,fma"))) inline void reduce_tile(const __m256 (&a)[2][kTile], float (&sums)[2][4]) {
  #pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    _mm_store_ps(sums[i], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// One 8-lane step of the dot-product chains of a key pair: a[i][t] += q_t[d..d+8] · k_i for the
// R query rows of a tile (rows of D floats from q). The dense and the packed scores both step
// through it, so their chains are the same whatever the keys are stored as.
template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void fma_pair(const float* q, int D, int d, __m256 k0,
                                                                        __m256 k1, __m256 (&a)[2][kTile]) {
  #pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const __m256 qv = _mm256_loadu_ps(q + t * D + d);
    a[0][t] = _mm256_fmadd_ps(qv, k0, a[0][t]);
    a[1][t] = _mm256_fmadd_ps(qv, k1, a[1][t]);
  }
}

// One key's step of the values' sums over a 16-column chunk: a[t] += e[t][c] · (x0, x1) for the
// R rows of a tile (weights kKeyBlock apart in e). The dense and the packed values both step
// through it, so each output element is the same sequence of FMAs whatever the values are
// stored as.
template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void fma_columns(const float* e, int c, __m256 x0,
                                                                           __m256 x1, __m256 (&a)[R][2]) {
  #pragma GCC unroll 4
  for (int t = 0; t < R; ++t) {
    const __m256 w = _mm256_broadcast_ss(e + t * kKeyBlock + c);
    a[t][0] = _mm256_fmadd_ps(w, x0, a[t][0]);
    a[t][1] = _mm256_fmadd_ps(w, x1, a[t][1]);
  }
}

// sc[t][c] = q_t · k_c for the R (1..kTile) query rows of a tile (rows of D floats from q) and
// the n keys of a block (rows kstep apart from k), two keys at a time: each (row, key) dot
// product is one FMA chain over 8-lane chunks (eight chains in flight, as many as the FMA units
// keep busy), the chains reduced together by one fixed tree of horizontal adds in which each
// result lane depends on its own chain only, then the scalar tail. So a score does not depend
// on which rows share its tile or which key it is paired with (a verify step's rows equal
// one-row decode steps). Each value row of the block (v, vstep, Dv) is fetched too.
template <int R, class T>
__attribute__((target("avx2,fma,f16c"))) void scores_avx(
    const float* q, int D, const T* k, int64_t kstep, int n, float* sc,
    const T* v, int64_t vstep, int Dv) {
  const int d8 = D / 8 * 8;
  for (int c = 0; c < n; c += 2) {
    const int keys = std::min(2, n - c);
    const T* kc[2] = {k + c * kstep, k + (c + keys - 1) * kstep};
    #pragma GCC unroll 2
    for (int i = 0; i < keys; ++i) {
      prefetch_row(kc[i], kAhead * kstep, D);
      prefetch_row(v + (c + i) * vstep, 0, Dv);
    }
    __m256 a[2][kTile];
    #pragma GCC unroll 4
    for (int t = 0; t < kTile; ++t) a[0][t] = a[1][t] = _mm256_setzero_ps();
    for (int d = 0; d < d8; d += 8) {
      fma_pair<R>(q, D, d, load8(kc[0] + d), load8(kc[1] + d), a);
    }
    alignas(16) float sums[2][4];
    reduce_tile(a, sums);
    for (int i = 0; i < keys; ++i) {
      #pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        float x = sums[i][t];
        for (int d = d8; d < D; ++d) x = std::fma(q[t * D + d], widen(kc[i][d]), x);
        sc[t * kKeyBlock + c + i] = x;
      }
    }
  }
}

// acc_t += Σ_c e[t][c] · v_c for the R rows of a tile, a 16-column chunk at a time: the
// chunk's sums for every row stay in registers across the block's keys (the rows' sums would
// otherwise be loaded and stored for every key), and each value row segment is loaded once for
// all the rows. Each output element is the sequence fma(e_c, v_c[d], acc) in key order,
// whatever R is.
template <int R, class T>
__attribute__((target("avx2,fma,f16c"))) void values_avx(
    const float* e, const T* v, int64_t vstep, int n, int Dv, float* const* acc) {
  const int d16 = Dv / 16 * 16, d8 = Dv / 8 * 8;
  int d = 0;
  for (; d < d16; d += 16) {
    __m256 a[R][2];
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      a[t][0] = _mm256_loadu_ps(acc[t] + d);
      a[t][1] = _mm256_loadu_ps(acc[t] + d + 8);
    }
    for (int c = 0; c < n; ++c) {
      const T* vc = v + c * vstep + d;
      fma_columns<R>(e, c, load8(vc), load8(vc + 8), a);
    }
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      _mm256_storeu_ps(acc[t] + d, a[t][0]);
      _mm256_storeu_ps(acc[t] + d + 8, a[t][1]);
    }
  }
  if (d < d8) {
    __m256 a[R];
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) a[t] = _mm256_loadu_ps(acc[t] + d);
    for (int c = 0; c < n; ++c) {
      const __m256 x = load8(v + c * vstep + d);
      #pragma GCC unroll 4
      for (int t = 0; t < R; ++t)
        a[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(e + t * kKeyBlock + c), x, a[t]);
    }
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) _mm256_storeu_ps(acc[t] + d, a[t]);
  }
  for (d = d8; d < Dv; ++d)
    for (int c = 0; c < n; ++c)
      for (int t = 0; t < R; ++t) acc[t][d] = std::fma(e[t * kKeyBlock + c], widen(v[c * vstep + d]), acc[t][d]);
}

// One row's softmax step over a block of n scores (srow, hidden keys already at lowest): the
// running max m and the weights e_c = exp(s_c - m) written over the scores; returns their sum.
// A hidden key (s = lowest) weighs 0 once any key is visible and 1 when none is (so m is
// lowest too), as in MLX's softmax over the masked scores (uniform where every key is hidden);
// weights under exp(-87.3) are 0, so a hidden key counts for nothing. Lane l of the sum takes
// the keys c ≡ l (mod 8) in order: a key past n adds nothing, like a hidden one.
__attribute__((target("avx2,fma"))) float block_weights_avx(float* srow, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m), floor = _mm256_set1_ps(-87.3f);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int c = 0; c < n; c += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(srow + c), mv);
    const __m256 under = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
    const __m256 e = _mm256_andnot_ps(under, exp_avx(x));
    _mm256_storeu_ps(srow + c, e);
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - c), lanes));
    sum = _mm256_add_ps(sum, _mm256_and_ps(e, valid));
  }
  return hsum(sum);
}

__attribute__((target("avx2,fma"))) float block_max_avx(const float* srow, int n) {
  __m256 m = _mm256_set1_ps(std::numeric_limits<float>::lowest());
  int c = 0;
  for (; c + 8 <= n; c += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(srow + c));
  alignas(32) float l[8];
  _mm256_store_ps(l, m);
  float r = l[0];
  for (int i = 1; i < 8; ++i) r = std::max(r, l[i]);
  for (; c < n; ++c) r = std::max(r, srow[c]);
  return r;
}

// The same without AVX2, one row at a time.
template <class T>
void scores_scalar(int R, const float* q, int D, const T* k, int64_t kstep, int n, float* sc) {
  for (int t = 0; t < R; ++t)
    for (int c = 0; c < n; ++c) {
      float x = 0;
      for (int d = 0; d < D; ++d) x = std::fma(q[t * D + d], widen(k[c * kstep + d]), x);
      sc[t * kKeyBlock + c] = x;
    }
}

template <class T>
void values_scalar(int R, const float* e, const T* v, int64_t vstep, int n, int Dv, float* const* acc) {
  for (int t = 0; t < R; ++t)
    for (int c = 0; c < n; ++c)
      for (int d = 0; d < Dv; ++d) acc[t][d] = std::fma(e[t * kKeyBlock + c], widen(v[c * vstep + d]), acc[t][d]);
}

template <class T>
void block_scores(int R, const float* q, int D, const T* k, int64_t kstep, int n, float* sc,
                  const T* v, int64_t vstep, int Dv) {
  if (!vector_rows<T>()) return scores_scalar(R, q, D, k, kstep, n, sc);
  switch (R) {
    case 1: return scores_avx<1>(q, D, k, kstep, n, sc, v, vstep, Dv);
    case 2: return scores_avx<2>(q, D, k, kstep, n, sc, v, vstep, Dv);
    case 3: return scores_avx<3>(q, D, k, kstep, n, sc, v, vstep, Dv);
    default: return scores_avx<4>(q, D, k, kstep, n, sc, v, vstep, Dv);
  }
}

// One row's softmax step over a block (see block_weights_avx; without AVX2 one key at a time).
float block_weights(float* srow, int n, float m) {
  if (has_avx2()) return block_weights_avx(srow, n, m);
  float sum = 0;
  for (int c = 0; c < n; ++c) {
    const float e = std::exp(srow[c] - m);
    srow[c] = e;
    sum += e;
  }
  return sum;
}

// x[0..n) *= c: a row's weighted sums rescaled when its running max rises, a softmax row by
// its sum's reciprocal.
__attribute__((target("avx2,fma"))) void scale_row_avx(float* x, int n, float c) {
  const __m256 cv = _mm256_set1_ps(c);
  int d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(x + d, _mm256_mul_ps(_mm256_loadu_ps(x + d), cv));
  for (; d < n; ++d) x[d] *= c;
}

void scale_row(float* x, int n, float c) {
  if (has_avx2()) return scale_row_avx(x, n, c);
  for (int d = 0; d < n; ++d) x[d] *= c;
}

// The largest of a block's n scores.
float block_max(const float* srow, int n) {
  if (has_avx2()) return block_max_avx(srow, n);
  float m = std::numeric_limits<float>::lowest();
  for (int c = 0; c < n; ++c) m = std::max(m, srow[c]);
  return m;
}

template <class T>
void block_values(int R, const float* e, const T* v, int64_t vstep, int n, int Dv, float* const* acc) {
  if (!vector_rows<T>()) return values_scalar(R, e, v, vstep, n, Dv, acc);
  switch (R) {
    case 1: return values_avx<1>(e, v, vstep, n, Dv, acc);
    case 2: return values_avx<2>(e, v, vstep, n, Dv, acc);
    case 3: return values_avx<3>(e, v, vstep, n, Dv, acc);
    default: return values_avx<4>(e, v, vstep, n, Dv, acc);
  }
}

// `rows` ([B, H, L, D], any strides) written over slots at..at+L of `buf` ([B, H, S, D]) into
// `out` (row-major, `buf`'s shape), all of T (the cache's type: the rows were cast or quantized
// to it). `out` is `buf`'s own buffer when MLX let the op take it over (the cache's only
// reference was the op's input); otherwise `buf` is copied first.
template <class T>
void write_slots(const View& buf, const View& rows, int at, View& out) {
  T* o = out.data<T>();
  if (o != buf.data<T>()) {
    copy_dense(buf, o);
    count(FusedKind::SdpaWriteCopy);
  }
  const int B = rows.shape(0), H = rows.shape(1), L = rows.shape(2), D = rows.shape(3);
  const int S = buf.shape(2);
  const auto& rs = rows.strides();
  const T* r = rows.data<T>();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < L; ++i) {
        const T* src = r + b * rs[0] + h * rs[1] + i * rs[2];
        T* dst = o + (((size_t)b * H + h) * S + at + i) * D;
        if (rs[3] == 1) {
          std::memcpy(dst, src, sizeof(T) * D);
        } else {
          for (int d = 0; d < D; ++d) dst[d] = src[d * rs[3]];
        }
      }
}

// The same for any element type, by its size (a quantized cache's packed words and float
// scales are 4 bytes, half-precision rows 2).
void write_any(const View& buf, const View& rows, int at, View& out) {
  if (mx::size_of(buf.dtype()) == 2) return write_slots<uint16_t>(buf, rows, at, out);
  write_slots<uint32_t>(buf, rows, at, out);
}

// Rows of a dense cache, read in place.
template <class T>
struct DenseRows {
  const T* base;
  int64_t bs, hs, ts;
  // The n rows from slot j of (b, h), and in `step` the distance between them.
  const T* rows(int b, int h, int j, int, float*, int64_t& step) const {
    step = ts;
    return base + b * bs + h * hs + j * ts;
  }
};

// Consecutive rows of an affine-quantized cache: packed words, scales and biases, each with
// its distance between rows.
struct AffineBlock {
  const uint32_t* w;
  int64_t wstep;
  const float* s;
  int64_t sstep;
  const float* b;
  int64_t bstep;
};

// Eight values of a packed row from value d (a multiple of 8), as floats, unscaled.
template <int BITS>
__attribute__((target("avx2,fma"))) inline __m256 packed8(const uint32_t* row, int d) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(row) + d))));
  } else {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)row[d / 8]), shifts), _mm256_set1_epi32(0xF)));
  }
}

// A packed key row fetched kAhead rows ahead of `row`, and value row `row` (used once the
// block's scores are done), into L2 (see kAhead).
template <int BITS>
__attribute__((always_inline)) inline void fetch_rows(const AffineBlock& k, const AffineBlock& v, int row, int D, int Dv) {
  const int64_t line = 64 / 4;
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(k.w + (row + kAhead) * k.wstep);
  for (int64_t x = 0; x < D * BITS / 32; x += line) _mm_prefetch(reinterpret_cast<const char*>(ahead + x * 4), _MM_HINT_T1);
  const uintptr_t vrow = reinterpret_cast<uintptr_t>(v.w + row * v.wstep);
  for (int64_t x = 0; x < Dv * BITS / 32; x += line) _mm_prefetch(reinterpret_cast<const char*>(vrow + x * 4), _MM_HINT_T1);
}

// The biases' term of a block's n scores, added once the block's products are in sc[t][c]:
// each score plus its key's groups' biases times the rows' group sums (qsum, R rows of G),
// in group order. Eight keys at a time: a lane forms what one key's scalar chain forms.
template <int R>
__attribute__((target("avx2,fma"))) void add_biases(const AffineBlock& k, int n, const float* qsum, int G, float* sc) {
  const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)k.bstep));
  int c = 0;
  for (; c + 8 <= n; c += 8) {
    const float* b = k.b + c * k.bstep;
    __m256 x[R];
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) x[t] = _mm256_loadu_ps(sc + t * kKeyBlock + c);
    for (int g = 0; g < G; ++g) {
      const __m256 bg = _mm256_i32gather_ps(b + g, lanes, 4);
      #pragma GCC unroll 4
      for (int t = 0; t < R; ++t) x[t] = _mm256_fmadd_ps(bg, _mm256_set1_ps(qsum[t * G + g]), x[t]);
    }
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) _mm256_storeu_ps(sc + t * kKeyBlock + c, x[t]);
  }
  for (; c < n; ++c) {
    const float* b = k.b + c * k.bstep;
    for (int t = 0; t < R; ++t) {
      float x = sc[t * kKeyBlock + c];
      for (int g = 0; g < G; ++g) x = std::fma(b[g], qsum[t * G + g], x);
      sc[t * kKeyBlock + c] = x;
    }
  }
}

// scores_avx for keys stored packed, read in place: with k = s·u + b over each group,
// q · k = Σ_g s_g (q_g · u_g) + Σ_g b_g (Σ q_g), so each group's integers u are widened and
// scaled (two operations for eight values beside the FMAs, where dequantizing a block into a
// scratch tile and reading it back took five and a tile's round trip through L2), and the
// biases meet the query rows' group sums (`qsum`, R rows of D / group). The same chains and
// the same reduction as scores_avx, so a score does not depend on its tile either.
template <int R, int BITS>
__attribute__((target("avx2,fma"))) void affine_scores(
    const float* q, const float* qsum, int D, int group, const AffineBlock& k, int n, float* sc,
    const AffineBlock& v, int Dv) {
  const int G = D / group;
  for (int c = 0; c < n; c += 2) {
    const int keys = std::min(2, n - c);
    const int rows[2] = {c, c + keys - 1};
    #pragma GCC unroll 2
    for (int i = 0; i < keys; ++i) {
      fetch_rows<BITS>(k, v, rows[i], D, Dv);
    }
    __m256 a[2][kTile];
    #pragma GCC unroll 4
    for (int t = 0; t < kTile; ++t) a[0][t] = a[1][t] = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
      const __m256 s0 = _mm256_set1_ps(k.s[rows[0] * k.sstep + g]);
      const __m256 s1 = _mm256_set1_ps(k.s[rows[1] * k.sstep + g]);
      const uint32_t* w0 = k.w + rows[0] * k.wstep;
      const uint32_t* w1 = k.w + rows[1] * k.wstep;
      for (int d = g * group; d < (g + 1) * group; d += 8) {
        fma_pair<R>(q, D, d, _mm256_mul_ps(packed8<BITS>(w0, d), s0), _mm256_mul_ps(packed8<BITS>(w1, d), s1), a);
      }
    }
    alignas(16) float sums[2][4];
    reduce_tile(a, sums);
    for (int i = 0; i < keys; ++i)
      #pragma GCC unroll 4
      for (int t = 0; t < R; ++t) sc[t * kKeyBlock + c + i] = sums[i][t];
  }
  add_biases<R>(k, n, qsum, G, sc);
}

// A group's part of the values' weights for the R rows of a tile and the n keys of a block: each
// weight times its key's scale for group g (into ew, rows kKeyBlock apart) and the weights'
// sum with the keys' biases (into bias), shared by both widths of the values' pass.
template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void group_weights(const float* e, const AffineBlock& v, int n,
                                                                          int g, float* ew, float* bias) {
  for (int t = 0; t < R; ++t) bias[t] = 0.0f;
  for (int c = 0; c < n; ++c) {
    const float sc = v.s[c * v.sstep + g], bi = v.b[c * v.bstep + g];
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      ew[t * kKeyBlock + c] = e[t * kKeyBlock + c] * sc;
      bias[t] = std::fma(e[t * kKeyBlock + c], bi, bias[t]);
    }
  }
}

// values_avx for values stored packed, read in place: acc_t += Σ_c e_tc (s_c u_c + b_c) is
// Σ_c (e_tc s_c) u_c, a 16-column chunk at a time with the rows' sums in registers across the
// block's keys (the weights e·s worked out once a group, in `ew`), plus Σ_c e_tc b_c added to
// each group's columns once a block.
template <int R, int BITS>
__attribute__((target("avx2,fma"))) void affine_values(
    const float* e, const AffineBlock& v, int n, int Dv, int group, float* const* acc) {
  alignas(32) float ew[kTile * kKeyBlock];
  for (int g = 0; g < Dv / group; ++g) {
    float bias[kTile];
    group_weights<R>(e, v, n, g, ew, bias);
    for (int d = g * group; d < (g + 1) * group; d += 16) {
      __m256 a[R][2];
      #pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        a[t][0] = _mm256_add_ps(_mm256_loadu_ps(acc[t] + d), _mm256_set1_ps(bias[t]));
        a[t][1] = _mm256_add_ps(_mm256_loadu_ps(acc[t] + d + 8), _mm256_set1_ps(bias[t]));
      }
      for (int c = 0; c < n; ++c) {
        const uint32_t* row = v.w + c * v.wstep;
        fma_columns<R>(ew, c, packed8<BITS>(row, d), packed8<BITS>(row, d + 8), a);
      }
      #pragma GCC unroll 4
      for (int t = 0; t < R; ++t) {
        _mm256_storeu_ps(acc[t] + d, a[t][0]);
        _mm256_storeu_ps(acc[t] + d + 8, a[t][1]);
      }
    }
  }
}

// Sixteen values of a packed row from value d (a multiple of 16), as floats, unscaled.
template <int BITS>
__attribute__((target("avx512f,avx2,fma"))) inline __m512 packed16(const uint32_t* row, int d) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(row) + d))));
  } else {
    // Lanes 0-7 read word d / 8, lanes 8-15 the next, each at its own nibble.
    const __m512i words = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i two = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 8)));
    return _mm512_cvtepi32_ps(
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(words, two), shifts), _mm512_set1_epi32(0xF)));
  }
}

// W 16-column chunks from column d of the values' sums of a tile's R rows, over the block's n
// keys: the sums stay in registers across the keys, each key's chunks widened once for all the
// rows. Two chunks give each row two chains, so that a tile of four rows has eight in flight
// (one chunk's four FMA chains waited on each other's latency); each output element's FMAs
// are the same whatever W is.
template <int R, int BITS, int W>
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline void values_chunks512(
    const float* ew, const AffineBlock& v, int n, int d, const float* bias, float* const* acc) {
  __m512 a[R][W];
  #pragma GCC unroll 4
  for (int t = 0; t < R; ++t)
    #pragma GCC unroll 2
    for (int j = 0; j < W; ++j) a[t][j] = _mm512_add_ps(_mm512_loadu_ps(acc[t] + d + 16 * j), _mm512_set1_ps(bias[t]));
  for (int c = 0; c < n; ++c) {
    __m512 x[W];
    #pragma GCC unroll 2
    for (int j = 0; j < W; ++j) x[j] = packed16<BITS>(v.w + c * v.wstep, d + 16 * j);
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) {
      const __m512 e = _mm512_set1_ps(ew[t * kKeyBlock + c]);
      #pragma GCC unroll 2
      for (int j = 0; j < W; ++j) a[t][j] = _mm512_fmadd_ps(e, x[j], a[t][j]);
    }
  }
  #pragma GCC unroll 4
  for (int t = 0; t < R; ++t)
    #pragma GCC unroll 2
    for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc[t] + d + 16 * j, a[t][j]);
}

// group_weights' sums Σ_c e_tc b_c for every group of the block at once (G <= 16), a group a
// lane: each lane is the scalar chain over the keys in order, so the bits are the same; one
// FMA a key and row for all the groups, where the scalar chains took one a key, row and group,
// each waiting on the last (28% of the values pass's time in a 4k-token decode step of the
// 4-bit bench model with a q8 cache, perf, before this and group_scales512).
template <int R>
__attribute__((target("avx512f"))) void block_biases512(const float* e, const AffineBlock& v, int n, int G,
                                                        float (&bias)[kTile][16]) {
  const __mmask16 groups = (__mmask16)((1u << G) - 1);
  __m512 b[R];
  #pragma GCC unroll 4
  for (int t = 0; t < R; ++t) b[t] = _mm512_setzero_ps();
  for (int c = 0; c < n; ++c) {
    const __m512 bc = _mm512_maskz_loadu_ps(groups, v.b + c * v.bstep);
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) b[t] = _mm512_fmadd_ps(_mm512_set1_ps(e[t * kKeyBlock + c]), bc, b[t]);
  }
  #pragma GCC unroll 4
  for (int t = 0; t < R; ++t) _mm512_store_ps(bias[t], b[t]);
}

// group_weights' ew for group g, sixteen keys at a time (each product the same single rounding).
template <int R>
__attribute__((target("avx512f"))) void group_scales512(const float* e, const AffineBlock& v, int n, int g,
                                                        float* ew) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)v.sstep));
  for (int c = 0; c < n; c += 16) {
    // Keys past n are neither read nor written.
    const __mmask16 keys = (__mmask16)(n - c >= 16 ? 0xFFFF : (1u << (n - c)) - 1);
    const __m512 sc = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keys, lanes, v.s + c * v.sstep + g, 4);
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t)
      _mm512_mask_storeu_ps(ew + t * kKeyBlock + c, keys,
                            _mm512_mul_ps(_mm512_maskz_loadu_ps(keys, e + t * kKeyBlock + c), sc));
  }
}

// affine_values with 16 lanes (AVX-512): one 16-column chunk a register, its sixteen values of
// each key widened at once. Each output element is the same sequence of FMAs as in
// affine_values (the bias, then every key in order), so the two give the same bits. In a
// 4k-token decode step of the 4-bit bench model with a q8 cache on a 2-core Ice Lake VM, the
// values' share of the step went from 10.0-10.1% to 6.7-7.1% of it (perf, two runs each against
// the 8-lane kernel, beside the weights' kernel's 43-46%). The keys' 16-lane kernel is
// affine_scores512 (two keys' 8-lane chains a register, so the scores' rounding stays). Both,
// on one 4k-token head of 256-value keys read from memory (4 query rows; the old and new
// kernels alternated, medians of 95): the scores' kernel alone 1.08x (q8) and 1.17x (q4), the
// values' two chunks a pass alone 1.05x and 1.01x, both 1.12-1.19x and 1.19-1.26x.
template <int R, int BITS>
__attribute__((target("avx512f,avx2,fma"))) void affine_values512(
    const float* e, const AffineBlock& v, int n, int Dv, int group, float* const* acc) {
  alignas(64) float ew[kTile * kKeyBlock];
  const int G = Dv / group;
  alignas(64) float biases[kTile][16];
  if (G <= 16) block_biases512<R>(e, v, n, G, biases);
  for (int g = 0; g < G; ++g) {
    float bias[kTile];
    if (G <= 16) {
      group_scales512<R>(e, v, n, g, ew);
      for (int t = 0; t < R; ++t) bias[t] = biases[t][g];
    } else {
      group_weights<R>(e, v, n, g, ew, bias);
    }
    const int end = (g + 1) * group;
    int d = g * group;
    for (; d + 32 <= end; d += 32) values_chunks512<R, BITS, 2>(ew, v, n, d, bias, acc);
    for (; d < end; d += 16) values_chunks512<R, BITS, 1>(ew, v, n, d, bias, acc);
  }
}

// Eight values of each of two packed rows from value d (a multiple of 8), unscaled, as one
// vector: row a's in lanes 0-7, row b's in lanes 8-15 (each lane what packed8 gives it).
template <int BITS>
__attribute__((target("avx512f,avx2,fma"))) inline __m512 packed8x2(const uint32_t* a, const uint32_t* b, int d) {
  if constexpr (BITS == 8) {
    const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(a) + d));
    const __m128i both = _mm_castpd_si128(
        _mm_loadh_pd(_mm_castsi128_pd(lo), reinterpret_cast<const double*>(reinterpret_cast<const uint8_t*>(b) + d)));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
  } else {
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i words = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)a[d / 8]), 0xFF00, (int)b[d / 8]);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(0xF)));
  }
}

// _mm256_hadd_ps within each 128-bit lane of two 512-bit vectors: [x0+x1, x2+x3, y0+y1, y2+y3].
__attribute__((target("avx512f"))) inline __m512 hadd512(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// affine_scores with 512-bit vectors: each vector holds two keys' 8-lane chains (lanes 0-7 one
// key, 8-15 the next) against a query chunk repeated in both halves, and four keys are taken at
// a time, so that a tile of four query rows has eight chains in flight, as the 8-lane kernel
// has with two keys, at twice the lanes per instruction (the widening and scaling too). Every
// lane forms what the 8-lane kernel's lane forms, in the same order, and the halves go through
// the same reduction, so both give the same bits. A 4k-token head of 256-value keys (4 query
// rows, q8 and q4 caches): the 8-lane kernel spent its time in that arithmetic, not waiting on
// memory, where the float32 cache's kernel waits on memory.
template <int R, int BITS>
__attribute__((target("avx512f,avx2,fma"))) void affine_scores512(
    const float* q, const float* qsum, int D, int group, const AffineBlock& k, int n, float* sc,
    const AffineBlock& v, int Dv) {
  const int G = D / group;
  for (int c = 0; c < n; c += 4) {
    const int keys = std::min(4, n - c);
    // Past the block's end the last key is computed again and its result not kept.
    const int rows[4] = {c, c + std::min(1, keys - 1), c + std::min(2, keys - 1), c + keys - 1};
    #pragma GCC unroll 4
    for (int i = 0; i < keys; ++i) {
      fetch_rows<BITS>(k, v, rows[i], D, Dv);
    }
    const uint32_t* w[4];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = k.w + rows[i] * k.wstep;
    // a[p][t]: keys 2p and 2p + 1 against query row t.
    __m512 a[2][kTile];
    #pragma GCC unroll 4
    for (int t = 0; t < kTile; ++t) a[0][t] = a[1][t] = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g) {
      const __m512 s01 = halves(_mm256_set1_ps(k.s[rows[0] * k.sstep + g]), _mm256_set1_ps(k.s[rows[1] * k.sstep + g]));
      const __m512 s23 = halves(_mm256_set1_ps(k.s[rows[2] * k.sstep + g]), _mm256_set1_ps(k.s[rows[3] * k.sstep + g]));
      for (int d = g * group; d < (g + 1) * group; d += 8) {
        const __m512 k01 = _mm512_mul_ps(packed8x2<BITS>(w[0], w[1], d), s01);
        const __m512 k23 = _mm512_mul_ps(packed8x2<BITS>(w[2], w[3], d), s23);
        #pragma GCC unroll 4
        for (int t = 0; t < R; ++t) {
          const __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(q + t * D + d))));
          a[0][t] = _mm512_fmadd_ps(qv, k01, a[0][t]);
          a[1][t] = _mm512_fmadd_ps(qv, k23, a[1][t]);
        }
      }
    }
    // reduce_tile's tree on both pairs at once: per 128-bit lane, hadd512 is _mm256_hadd_ps's
    // sum of neighbours, so after three of them lane 0 of h[p] holds key 2p's lanes 0-3 part
    // of every row, lane 1 its lanes 4-7 part, lanes 2 and 3 key 2p + 1's; one add of those
    // parts is reduce_tile's last step.
    __m512 h[2];
    #pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) h[p] = hadd512(hadd512(a[p][0], a[p][1]), hadd512(a[p][2], a[p][3]));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // [key][row] to [row][key]; a row's four scores go out together (past the block's end
    // into the tile's own room, c + 4 <= kKeyBlock, where nothing reads them).
    alignas(64) float by_row[16];
    _mm512_store_ps(by_row, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums));
    #pragma GCC unroll 4
    for (int t = 0; t < R; ++t) _mm_storeu_ps(sc + t * kKeyBlock + c, _mm_load_ps(by_row + 4 * t));
  }
  add_biases<R>(k, n, qsum, G, sc);
}

template <int BITS>
void affine_block_scores(int R, const float* q, const float* qsum, int D, int group, const AffineBlock& k, int n,
                         float* sc, const AffineBlock& v, int Dv) {
  if (g_vector_width.load(std::memory_order_relaxed) >= 512 && has_avx512()) {
    switch (R) {
      case 1: return affine_scores512<1, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
      case 2: return affine_scores512<2, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
      case 3: return affine_scores512<3, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
      default: return affine_scores512<4, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
    }
  }
  switch (R) {
    case 1: return affine_scores<1, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
    case 2: return affine_scores<2, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
    case 3: return affine_scores<3, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
    default: return affine_scores<4, BITS>(q, qsum, D, group, k, n, sc, v, Dv);
  }
}

template <int BITS>
void affine_block_values(int R, const float* e, const AffineBlock& v, int n, int Dv, int group, float* const* acc) {
  if (g_vector_width.load(std::memory_order_relaxed) >= 512 && has_avx512()) {
    switch (R) {
      case 1: return affine_values512<1, BITS>(e, v, n, Dv, group, acc);
      case 2: return affine_values512<2, BITS>(e, v, n, Dv, group, acc);
      case 3: return affine_values512<3, BITS>(e, v, n, Dv, group, acc);
      default: return affine_values512<4, BITS>(e, v, n, Dv, group, acc);
    }
  }
  switch (R) {
    case 1: return affine_values<1, BITS>(e, v, n, Dv, group, acc);
    case 2: return affine_values<2, BITS>(e, v, n, Dv, group, acc);
    case 3: return affine_values<3, BITS>(e, v, n, Dv, group, acc);
    default: return affine_values<4, BITS>(e, v, n, Dv, group, acc);
  }
}

// Rows of an affine-quantized cache (MLX's format: per row D·bits/32 words, value i of a word
// at bits·i from its low end; one scale and bias per `group` values, w = scale·q + bias),
// read packed where affine_scores and affine_values take them (4 and 8 bits with AVX2), else
// dequantized a key block at a time into a scratch tile: attention never makes a float copy
// of the cache. Through the tile, q8 and q4 caches decoded the 4-bit bench model slower than a
// float32 cache (`cargo bench --bench kv_cache`, 4k tokens: 0.91x and 0.82x; 16k: 0.99x and
// 0.93x); read in place, faster (4k: 1.07x both; 16k: 1.13x and 1.36x). The block's value
// rows are fetched into L2 while its scores are computed, as the dense kernel's are: without
// that, affine_values waited on memory at each row's first load, and a q8 cache's attention
// took 0.53 of the time the weights' kernel takes in a 4k-token decode step of the 4-bit bench
// model (perf, two runs each), 0.43 with it (q4: 0.46, 0.44).
struct AffineRows {
  const uint32_t* w;
  const float* s;
  const float* b;
  int64_t ws[3], ss[3], bstr[3];
  int bits, group, D;

  const float* rows(int bb, int h, int j, int n, float* scratch, int64_t& step) const {
    step = D;
    for (int c = 0; c < n; ++c)
      dequant_row(w + bb * ws[0] + h * ws[1] + (j + c) * ws[2], s + bb * ss[0] + h * ss[1] + (j + c) * ss[2],
                  b + bb * bstr[0] + h * bstr[1] + (j + c) * bstr[2], scratch + (size_t)c * D);
    return scratch;
  }

  void dequant_row(const uint32_t* q, const float* sc, const float* bi, float* out) const {
    if (has_avx2() && (bits == 4 || bits == 8)) return dequant_row_avx(q, sc, bi, out);
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    for (int d = 0; d < D; ++d) {
      const uint32_t v = (q[d / per] >> (bits * (d % per))) & mask;
      out[d] = std::fma(sc[d / group], (float)v, bi[d / group]);
    }
  }

  // Whether attention reads these rows packed (affine_scores / affine_values): 4 or 8 bits
  // with AVX2, groups of whole 16-value chunks.
  bool packed() const { return has_avx2() && (bits == 4 || bits == 8) && group % 16 == 0 && D % group == 0; }

  // The n rows from slot j of (bb, h), read where they lie.
  AffineBlock block(int bb, int h, int j) const {
    return {w + bb * ws[0] + h * ws[1] + j * ws[2], ws[2],
            s + bb * ss[0] + h * ss[1] + j * ss[2], ss[2],
            b + bb * bstr[0] + h * bstr[1] + j * bstr[2], bstr[2]};
  }

  __attribute__((target("avx2,fma"))) void dequant_row_avx(const uint32_t* q, const float* sc, const float* bi,
                                                           float* out) const {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i nib = _mm256_set1_epi32(0xF);
    // 8 values at a time: a group (32 values or more) never splits a chunk of 8.
    for (int d = 0; d < D; d += 8) {
      __m256i v;
      if (bits == 8) {
        v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(q) + d)));
      } else {
        v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)q[d / 8]), shifts), nib);
      }
      const int g = d / group;
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(sc[g]), _mm256_set1_ps(bi[g])));
    }
  }
};

// Attention over the first `keys` slots of K and V. With `write_at` ≥ 0, the last two inputs
// are new key and value rows, written at slots write_at.. of K and V first: the op's second and
// third outputs are the buffers with them, and attention reads those. A decode step's cache
// write, view and attention are one op instead of five (two SliceUpdates, two Slices).
struct SdpaOp {
  struct Params {
    float scale;
    bool causal;
    bool has_mask;
    bool bool_mask;
    bool has_sinks;
    int keys;
    int write_at;
    // The output as [B, L, Hq·Dv] (each token's heads side by side, what the output projection
    // reads) instead of [B, Hq, L, Dv]: no transpose or reshape op after it.
    bool tokens;
    // 0: K and V are one dense array each; 4 or 8: each is three (packed words, scales,
    // biases) of MLX's affine quantization with `group` values per scale.
    int bits;
    int group;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuSdpa";
  static constexpr FusedKind kind = FusedKind::Sdpa;

  // Arrays per K or V: the dense rows, or the packed words, scales and biases.
  static int parts(const Params& p) { return p.bits ? 3 : 1; }

  // The updated K and V (each of their arrays) may take over the buffers they update.
  static int donor(const Params& p, size_t out) {
    return p.write_at >= 0 && out >= 1 && (int)out <= 2 * parts(p) ? (int)out : -1;
  }

  // Inputs: q, K's arrays, V's arrays, [mask], [sinks], then with `write_at` the new rows'
  // arrays in the same order as K's and V's.
  static void run_many(const Params& p, std::vector<View>& in, std::vector<View>& outs) {
    const int np = parts(p);
    const View* kv = &in[1];
    if (p.write_at >= 0) {
      const size_t rows = in.size() - 2 * np;
      for (int i = 0; i < 2 * np; ++i) write_any(in[1 + i], in[rows + i], p.write_at, outs[1 + i]);
      kv = &outs[1];
    }
    if (p.bits) {
      std::vector<uint32_t> t0, t3;
      std::vector<float> t1, t2, t4, t5;
      const AffineRows k = affine(p, kv[0], kv[1], kv[2], t0, t1, t2);
      const AffineRows v = affine(p, kv[3], kv[4], kv[5], t3, t4, t5);
      return attend(p, in, k, v, v.D, outs[0]);
    }
    switch (kv[0].dtype()) {
      case mx::float16: return attend_dense<f16>(p, in, kv, outs[0]);
      case mx::bfloat16: return attend_dense<bf16>(p, in, kv, outs[0]);
      default: return attend_dense<float>(p, in, kv, outs[0]);
    }
  }

  template <class T>
  static void attend_dense(const Params& p, std::vector<View>& in, const View* kv, View& out) {
    std::vector<T> kt, vt;
    int64_t ks[3], vs[3];
    const T* k = rows_of(kv[0], kt, ks);
    const T* v = rows_of(kv[1], vt, vs);
    attend(p, in, DenseRows<T>{k, ks[0], ks[1], ks[2]}, DenseRows<T>{v, vs[0], vs[1], vs[2]}, kv[1].shape(3), out);
  }

  // `a`'s rows read in place (cache views are strided along batch, heads and time), or copied
  // densely into `tmp` where its last axis is strided; `st` gets the first three strides.
  template <class T>
  static const T* rows_of(const View& a, std::vector<T>& tmp, int64_t* st) {
    if (a.strides()[3] == 1) {
      for (int d = 0; d < 3; ++d) st[d] = a.strides()[d];
      return a.data<T>();
    }
    st[2] = a.shape(3);
    st[1] = st[2] * a.shape(2);
    st[0] = st[1] * a.shape(1);
    return dense(a, tmp);
  }

  static AffineRows affine(const Params& p, const View& w, const View& s, const View& b, std::vector<uint32_t>& wt,
                           std::vector<float>& st, std::vector<float>& bt) {
    AffineRows r{nullptr, nullptr, nullptr, {}, {}, {}, p.bits, p.group, s.shape(3) * p.group};
    r.w = rows_of(w, wt, r.ws);
    r.s = rows_of(s, st, r.ss);
    r.b = rows_of(b, bt, r.bstr);
    return r;
  }

  template <class KR, class VR>
  static void attend(const Params& p, std::vector<View>& in, const KR& kr, const VR& vr, int Dv, View& out) {
    const View& q = in[0];
    const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int Hk = in[1].shape(1), S = p.keys;
    const int rep = Hq / Hk, nq = rep * L;
    const int np = parts(p);
    const View* mask = p.has_mask ? &in[1 + 2 * np] : nullptr;
    std::vector<float> sink_t;
    const float* sinks = p.has_sinks ? dense(in[1 + 2 * np + (p.has_mask ? 1 : 0)], sink_t) : nullptr;

    // Queries scaled first, as MLX does, grouped by kv head: [B, Hk, rep·L, D].
    std::vector<float> qs((size_t)B * Hq * L * D);
    {
      const float* qp = q.data<float>();
      const auto& st = q.strides();
      size_t at = 0;
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h)
          for (int i = 0; i < L; ++i)
            for (int d = 0; d < D; ++d)
              qs[at++] = p.scale * qp[b * st[0] + h * st[1] + i * st[2] + d * st[3]];
    }

    const int groups = B * Hk;
    // Packed keys and values are read in place (affine_scores); other quantized rows are
    // dequantized a block at a time (unused for dense rows).
    constexpr bool affine = std::is_same_v<KR, AffineRows> && std::is_same_v<VR, AffineRows>;
    bool packed = false;
    // Each query row's sums over the key groups, which the keys' biases multiply: worked out
    // once per kv head here, not once per part of its keys (at 4k keys, sixteen times).
    std::vector<float> qsum;
    if constexpr (affine) {
      packed = kr.packed() && vr.packed() && kr.group == vr.group && kr.bits == vr.bits;
      if (packed) {
        const int G = D / kr.group;
        qsum.resize((size_t)groups * nq * G);
        for (size_t r = 0; r < (size_t)groups * nq; ++r)
          for (int gi = 0; gi < G; ++gi) {
            const float* x = qs.data() + r * D + (size_t)gi * kr.group;
            float s = 0.0f;
            for (int d = 0; d < kr.group; ++d) s += x[d];
            qsum[r * G + gi] = s;
          }
      }
    }
    const int parts = std::max(1, (S + kPartKeys - 1) / kPartKeys);
    const int items = groups * parts;
    // Per item and query row: running max, running sum, then the weighted sum of V rows.
    const size_t state = 2 + Dv;
    std::vector<float> st((size_t)items * nq * state);
    const float lowest = std::numeric_limits<float>::lowest();

    auto work = [&](int item) {
      const int g = item / parts, part = item % parts;
      const int b = g / Hk, hk = g % Hk;
      const int j0 = part * kPartKeys, j1 = std::min(S, j0 + kPartKeys);
      float* my = st.data() + (size_t)item * nq * state;
      for (int r = 0; r < nq; ++r) {
        const int h = hk * rep + r / L;
        my[r * state] = (sinks && part == 0) ? sinks[h] : -std::numeric_limits<float>::infinity();
        my[r * state + 1] = (sinks && part == 0) ? 1.0f : 0.0f;
        std::fill(my + r * state + 2, my + (r + 1) * state, 0.0f);
      }
      const float* qg = qs.data() + (size_t)(b * Hq + hk * rep) * L * D;
      // Scores, then weights, of one tile of query rows against one key block.
      alignas(32) float sc[kTile * kKeyBlock];
      std::vector<float> kscr, vscr;
      if (affine && !packed) {
        kscr.resize((size_t)kKeyBlock * D);
        vscr.resize((size_t)kKeyBlock * Dv);
      }
      for (int j = j0; j < j1; j += kKeyBlock) {
        const int n = std::min(kKeyBlock, j1 - j);
        int64_t kst = 0, vst = 0;
        const auto* kb = packed ? nullptr : kr.rows(b, hk, j, n, kscr.data(), kst);
        const auto* vb = packed ? nullptr : vr.rows(b, hk, j, n, vscr.data(), vst);
        for (int r0 = 0; r0 < nq; r0 += kTile) {
          const int R = std::min(kTile, nq - r0);
          if constexpr (affine) {
            if (packed) {
              const int G = D / kr.group;
              const AffineBlock kblk = kr.block(b, hk, j), vblk = vr.block(b, hk, j);
              const float* qr = qg + (size_t)r0 * D;
              // The block's value rows are fetched while the first tile's scores are computed.
              const int vpf = r0 == 0 ? Dv : 0;
              const float* qs_r = qsum.data() + ((size_t)g * nq + r0) * G;
              if (kr.bits == 8)
                affine_block_scores<8>(R, qr, qs_r, D, kr.group, kblk, n, sc, vblk, vpf);
              else
                affine_block_scores<4>(R, qr, qs_r, D, kr.group, kblk, n, sc, vblk, vpf);
            }
          }
          // The block's value rows are fetched while the first tile's scores are computed.
          if (!packed) block_scores(R, qg + (size_t)r0 * D, D, kb, kst, n, sc, vb, vst, r0 == 0 ? Dv : 0);
          float* acc[kTile];
          for (int t = 0; t < R; ++t) {
            const int r = r0 + t, h = hk * rep + r / L, i = r % L;
            float* srow = sc + t * kKeyBlock;
            // Lower-right aligned: query i sees keys up to S - L + i.
            const int last = p.causal ? S - L + i : S - 1;
            // The masks, where any key of the block is hidden or shifted.
            if (mask || j + n - 1 > last) {
              for (int c = 0; c < n; ++c) {
                const int jj = j + c;
                if (jj > last) {
                  srow[c] = lowest;
                } else if (mask) {
                  const auto& ms = mask->strides();
                  const int64_t mo = b * ms[0] + h * ms[1] + i * ms[2] + jj * ms[3];
                  if (p.bool_mask) {
                    if (!mask->data<bool>()[mo]) srow[c] = lowest;
                  } else {
                    srow[c] += mask->data<float>()[mo];
                  }
                }
              }
            }
            float* sr = my + r * state;
            const float m = std::max(sr[0], block_max(srow, n));
            const float corr = std::exp(sr[0] - m);
            acc[t] = sr + 2;
            if (corr != 1.0f) scale_row(acc[t], Dv, corr);
            const float sum = sr[1] * corr + block_weights(srow, n, m);
            sr[0] = m;
            sr[1] = sum;
          }
          if constexpr (affine) {
            if (packed) {
              const AffineBlock vblk = vr.block(b, hk, j);
              if (vr.bits == 8)
                affine_block_values<8>(R, sc, vblk, n, Dv, vr.group, acc);
              else
                affine_block_values<4>(R, sc, vblk, n, Dv, vr.group, acc);
            }
          }
          if (!packed) block_values(R, sc, vb, vst, n, Dv, acc);
        }
      }
    };
    for_rows(items, 1, [&](size_t i0, size_t i1) {
      for (size_t it = i0; it < i1; ++it) work((int)it);
    });

    // Merge the parts of each (batch, kv head) and write [B, Hq, L, Dv].
    float* o = out.data<float>();
    std::vector<float> acc(Dv);
    for (int g = 0; g < groups; ++g) {
      const int b = g / Hk, hk = g % Hk;
      for (int r = 0; r < nq; ++r) {
        const int h = hk * rep + r / L, i = r % L;
        float m = -std::numeric_limits<float>::infinity();
        for (int part = 0; part < parts; ++part)
          m = std::max(m, st[((size_t)(g * parts + part) * nq + r) * state]);
        float sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int part = 0; part < parts; ++part) {
          const float* sr = st.data() + ((size_t)(g * parts + part) * nq + r) * state;
          if (sr[1] == 0.0f) continue;
          const float c = std::exp(sr[0] - m);
          sum += sr[1] * c;
          axpy(c, sr + 2, acc.data(), Dv);
        }
        float* orow = o + (p.tokens ? ((size_t)b * L + i) * Hq + h : ((size_t)b * Hq + h) * L + i) * Dv;
        const float inv = 1.0f / sum;
        for (int d = 0; d < Dv; ++d) orow[d] = acc[d] * inv;
      }
    }
  }
};

// An element-wise kernel f(x, o, i0, i1) over `in`'s elements into `out`, split over the pool
// in ranges of at least 16K elements.
template <class F>
void elementwise(const View& in, View& out, const F& f) {
  std::vector<float> xt;
  const float* x = dense(in, xt);
  float* o = out.data<float>();
  for_rows(in.size(), 1 << 14, [&](size_t i0, size_t i1) { f(x, o, i0, i1); });
}

// ---- tanh-approximated GELU (gelu_avx / gelu_scalar in cpu_common.h) ---------------------

struct GeluTanhOp {
  struct Params {
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuGeluTanh";
  static constexpr FusedKind kind = FusedKind::GeluTanh;

  static void run(const Params&, std::vector<View>& in, View& out) {
    elementwise(in[0], out, gelu_range);
  }
};

// ---- softmax over the last axis -----------------------------------------------------------------
//
// MLX's CPU softmax takes its exponentials one value at a time (a libm call each on x86): over
// an image's attention scores in the vision tower (heads × patches² of them per layer) it was
// over a third of the encoder's time. Here a row's maximum, then exp(x − max) with exp_avx (the
// polynomial the GELU uses, ~1e-7 relative), their sum, and one multiply by its reciprocal.

__attribute__((target("avx2,fma"))) void softmax_rows_avx(const float* x, float* o, int n, size_t r0, size_t r1) {
  for (size_t r = r0; r < r1; ++r) {
    const float* xr = x + r * (size_t)n;
    float* orow = o + r * (size_t)n;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int c = 0;
    for (; c + 8 <= n; c += 8) mv = _mm256_max_ps(_mm256_loadu_ps(xr + c), mv);
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    float m = -std::numeric_limits<float>::infinity();
    for (float v : lanes) m = std::max(m, v);
    for (int t = c; t < n; ++t) m = std::max(m, xr[t]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    c = 0;
    for (; c + 8 <= n; c += 8) {
      const __m256 e = exp_avx(_mm256_sub_ps(_mm256_loadu_ps(xr + c), mb));
      _mm256_storeu_ps(orow + c, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (int t = c; t < n; ++t) {
      orow[t] = std::exp(xr[t] - m);
      sum += orow[t];
    }
    scale_row_avx(orow, n, 1.0f / sum);
  }
}

void softmax_rows_scalar(const float* x, float* o, int n, size_t r0, size_t r1) {
  for (size_t r = r0; r < r1; ++r) {
    const float* xr = x + r * (size_t)n;
    float* orow = o + r * (size_t)n;
    float m = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) m = std::max(m, xr[t]);
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) sum += (orow[t] = std::exp(xr[t] - m));
    for (int t = 0; t < n; ++t) orow[t] *= 1.0f / sum;
  }
}

struct SoftmaxOp {
  struct Params {
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuSoftmax";
  static constexpr FusedKind kind = FusedKind::Softmax;

  static void run(const Params&, std::vector<View>& in, View& out) {
    std::vector<float> xt;
    const float* x = dense(in[0], xt);
    float* o = out.data<float>();
    const int n = (int)in[0].shape(in[0].ndim() - 1);
    const size_t rows = n == 0 ? 0 : in[0].size() / (size_t)n;
    // Chunks of at least ~16K values, as the element-wise kernels take.
    const size_t per = std::max<size_t>(1, (1u << 14) / std::max(n, 1));
    for_rows(rows, per, [&](size_t r0, size_t r1) {
      if (has_avx2())
        softmax_rows_avx(x, o, n, r0, r1);
      else
        softmax_rows_scalar(x, o, n, r0, r1);
    });
  }
};

// ---- soft-capping: cap · tanh(x / cap) ---------------------------------------------------------
//
// Over the whole vocabulary every decode step (gemma4's final logits). MLX's graph is three ops
// and libm's tanhf one value at a time; here tanh is a rational function (a degree-13 odd
// numerator over a degree-6 even denominator in x, clamped where tanh is 1 in float32) whose
// error is under 4e-7 relative (3 ulp) everywhere, checked against a double tanh on a
// 1e-5 grid over [-12, 12]. The division by cap and the product are MLX's own roundings.

inline constexpr float kTanhClamp = 7.90531110763549805f;
inline constexpr float kTanhP[7] = {-2.76076847742355e-16f, 2.00018790482477e-13f,
                                    -8.60467152213735e-11f, 5.12229709037114e-08f,
                                    1.48572235717979e-05f,  6.37261928875436e-04f,
                                    4.89352455891786e-03f};
inline constexpr float kTanhQ[4] = {1.19825839466702e-06f, 1.18534705686654e-04f,
                                    2.26843463243900e-03f, 4.89352518554385e-03f};

float tanh_scalar(float x) {
  x = std::min(std::max(x, -kTanhClamp), kTanhClamp);
  const float x2 = x * x;
  float p = kTanhP[0];
  for (int i = 1; i < 7; ++i) p = p * x2 + kTanhP[i];
  float q = kTanhQ[0];
  for (int i = 1; i < 4; ++i) q = q * x2 + kTanhQ[i];
  return (p * x) / q;
}

__attribute__((target("avx2,fma"))) __m256 tanh_avx(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-kTanhClamp)), _mm256_set1_ps(kTanhClamp));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(kTanhP[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(kTanhP[i]));
  __m256 q = _mm256_set1_ps(kTanhQ[0]);
  for (int i = 1; i < 4; ++i) q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(kTanhQ[i]));
  return _mm256_div_ps(_mm256_mul_ps(p, x), q);
}

__attribute__((target("avx2,fma"))) inline __m256 softcap_v(__m256 v, __m256 c) {
  return _mm256_mul_ps(tanh_avx(_mm256_div_ps(v, c)), c);
}

__attribute__((target("avx2,fma"))) void softcap_avx(const float* x, float* o, float cap, size_t i0, size_t i1) {
  const __m256 c = _mm256_set1_ps(cap);
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(o + i, softcap_v(_mm256_loadu_ps(x + i), c));
  if (i < i1) {
    // The last few through the same vector code (see gelu_avx).
    float in[8] = {}, res[8];
    std::copy(x + i, x + i1, in);
    _mm256_storeu_ps(res, softcap_v(_mm256_loadu_ps(in), c));
    std::copy(res, res + (i1 - i), o + i);
  }
}

struct SoftcapOp {
  struct Params {
    float cap;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuSoftcap";
  static constexpr FusedKind kind = FusedKind::Softcap;

  static void run(const Params& p, std::vector<View>& in, View& out) {
    elementwise(in[0], out, [cap = p.cap](const float* x, float* o, size_t i0, size_t i1) {
      if (has_avx2()) {
        softcap_avx(x, o, cap, i0, i1);
      } else {
        for (size_t i = i0; i < i1; ++i) o[i] = tanh_scalar(x[i] / cap) * cap;
      }
    });
  }
};

// ---- SwiGLU's product: silu(g) ⊙ u -----------------------------------------------------------
//
// GLM's MLPs and experts; MLX's graph is a sigmoid and two products.

struct SiluMulOp {
  struct Params {
    // silu(g) ⊙ u; false: σ(g) ⊙ u.
    bool silu;
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuSiluMul";
  static constexpr FusedKind kind = FusedKind::SiluMul;

  static void run(const Params& p, std::vector<View>& in, View& out) {
    std::vector<float> gt, ut;
    const float* g = dense(in[0], gt);
    const float* u = dense(in[1], ut);
    float* o = out.data<float>();
    for_rows(in[0].size(), 1 << 14, [&](size_t i0, size_t i1) {
      if (p.silu) {
        gate_mul_range<true>(g, u, o, i0, i1);
      } else {
        gate_mul_range<false>(g, u, o, i0, i1);
      }
    });
  }
};

// ---- few rows times a float32 weight matrix: x [M, K] @ W [K, N] -----------------------------
//
// A decode step reads every weight once, so this is a read of W at memory speed. Each thread
// owns a column range; four rows of W stream at a time into that range of the (L1/L2-resident)
// output rows, so W is read exactly once whatever M is (up to kMaxRows; MLX's sgemm, which is
// compute-bound there anyway, takes more).

constexpr int kMaxRows = 8;

template <int R>
__attribute__((target("avx2,fma"))) void gemv_rows_avx(
    const float* x, int K, const float* w, int N, float* y, int n0, int n1) {
  // y[r, n0:n1] = sum_k x[r, k] w[k, n0:n1]
  for (int r = 0; r < R; ++r) std::fill(y + (size_t)r * N + n0, y + (size_t)r * N + n1, 0.0f);
  const int nv = n0 + (n1 - n0) / 8 * 8;
  int k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* w0 = w + (size_t)k * N;
    const float* w1 = w0 + N;
    const float* w2 = w1 + N;
    const float* w3 = w2 + N;
    __m256 b[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) b[r][j] = _mm256_set1_ps(x[(size_t)r * K + k + j]);
    for (int n = n0; n < nv; n += 8) {
      const __m256 v0 = _mm256_loadu_ps(w0 + n), v1 = _mm256_loadu_ps(w1 + n);
      const __m256 v2 = _mm256_loadu_ps(w2 + n), v3 = _mm256_loadu_ps(w3 + n);
      for (int r = 0; r < R; ++r) {
        float* yr = y + (size_t)r * N + n;
        __m256 acc = _mm256_loadu_ps(yr);
        acc = _mm256_fmadd_ps(b[r][0], v0, acc);
        acc = _mm256_fmadd_ps(b[r][1], v1, acc);
        acc = _mm256_fmadd_ps(b[r][2], v2, acc);
        acc = _mm256_fmadd_ps(b[r][3], v3, acc);
        _mm256_storeu_ps(yr, acc);
      }
    }
    for (int n = nv; n < n1; ++n)
      for (int r = 0; r < R; ++r) {
        const float* xr = x + (size_t)r * K + k;
        y[(size_t)r * N + n] += xr[0] * w0[n] + xr[1] * w1[n] + xr[2] * w2[n] + xr[3] * w3[n];
      }
  }
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int n = n0; n < n1; ++n) y[(size_t)r * N + n] += x[(size_t)r * K + k] * w[(size_t)k * N + n];
}

// y[r, n0:n1] += sum over k in [k0, k0 + G) of x[r, k] w[k, n0:n1], for R rows, with 16 lanes
// (AVX-512; n1 - n0 a multiple of 16): G of W's rows stream at a time, so each output vector is
// loaded and stored once per G rows of W. Its x values are broadcast from memory (AVX-512 folds
// that into the FMA), so G can outgrow the registers.
template <int R, int G>
__attribute__((target("avx512f"))) inline void gemv_pass512(
    const float* x, int K, const float* w, int N, float* y, int n0, int n1, int k0) {
  const float* wk = w + (size_t)k0 * N;
  for (int n = n0; n < n1; n += 16) {
    __m512 v[G];
    #pragma GCC unroll 16
    for (int j = 0; j < G; ++j) v[j] = _mm512_loadu_ps(wk + (size_t)j * N + n);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* yr = y + (size_t)r * N + n;
      const float* xr = x + (size_t)r * K + k0;
      __m512 acc = _mm512_loadu_ps(yr);
      #pragma GCC unroll 16
      for (int j = 0; j < G; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(xr[j]), v[j], acc);
      _mm512_storeu_ps(yr, acc);
    }
  }
}

// gemv_rows_avx with 16 lanes: every output is the same chain of FMAs over k in order, so the
// same bits; W's rows stream 12 at a time, which keeps the outputs' loads
// and stores few (the bench model through the runner, interleaved A/B: 4 clients 1.11x and 8
// clients 1.22x the aggregate tokens/s of four at a time, one client alike). The pass is
// unrolled whole (12 rows of W in registers, each x value broadcast into its FMA): left as
// loops, GCC kept W's vectors and the broadcasts on the stack, and a decode step of the float32
// bench model took 32.7 ms at 4 rows and 48.8 at 8, now 28.0 and 38.5 (1 row 20.5; in-process,
// medians of 5 interleaved runs, `BATCH_ONLY_BREAKDOWN=1 cargo bench --bench batch`); one and two
// rows take it too (2 rows 24.2 -> 22.6 ms).
template <int R>
__attribute__((target("avx512f"))) void gemv_rows_avx512(
    const float* x, int K, const float* w, int N, float* y, int n0, int n1) {
  constexpr int G = 12;
  for (int r = 0; r < R; ++r) std::fill(y + (size_t)r * N + n0, y + (size_t)r * N + n1, 0.0f);
  int k = 0;
  for (; k + G <= K; k += G) gemv_pass512<R, G>(x, K, w, N, y, n0, n1, k);
  for (; k + 4 <= K; k += 4) gemv_pass512<R, 4>(x, K, w, N, y, n0, n1, k);
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int n = n0; n < n1; ++n) y[(size_t)r * N + n] += x[(size_t)r * K + k] * w[(size_t)k * N + n];
}

void gemv_rows_scalar(const float* x, int M, int K, const float* w, int N, float* y, int n0, int n1) {
  for (int r = 0; r < M; ++r) {
    float* yr = y + (size_t)r * N;
    std::fill(yr + n0, yr + n1, 0.0f);
    for (int k = 0; k < K; ++k) {
      const float xv = x[(size_t)r * K + k];
      const float* wk = w + (size_t)k * N;
      for (int n = n0; n < n1; ++n) yr[n] += xv * wk[n];
    }
  }
}

void gemv_rows(const float* x, int M, int K, const float* w, int N, float* y, int n0, int n1) {
  if (!has_avx2()) return gemv_rows_scalar(x, M, K, w, N, y, n0, n1);
  // Rows in groups of up to eight share each pass over W's columns [n0, n1): whole 16-column
  // vectors with AVX-512 where the CPU has it, the rest with AVX2. The two give every column
  // the same FMA chain, so a row's result does not depend on the rows beside it.
  if (has_avx512()) {
    const int n16 = n0 + (n1 - n0) / 16 * 16;
    for (int m = 0; m < M;) {
      const int r = std::min(8, M - m);
      const float* xm = x + (size_t)m * K;
      float* ym = y + (size_t)m * N;
      switch (r) {
        case 1: gemv_rows_avx512<1>(xm, K, w, N, ym, n0, n16); break;
        case 2: gemv_rows_avx512<2>(xm, K, w, N, ym, n0, n16); break;
        case 3: gemv_rows_avx512<3>(xm, K, w, N, ym, n0, n16); break;
        case 4: gemv_rows_avx512<4>(xm, K, w, N, ym, n0, n16); break;
        case 5: gemv_rows_avx512<5>(xm, K, w, N, ym, n0, n16); break;
        case 6: gemv_rows_avx512<6>(xm, K, w, N, ym, n0, n16); break;
        case 7: gemv_rows_avx512<7>(xm, K, w, N, ym, n0, n16); break;
        default: gemv_rows_avx512<8>(xm, K, w, N, ym, n0, n16); break;
      }
      m += r;
    }
    n0 = n16;
    if (n0 == n1) return;
  }
  for (int m = 0; m < M;) {
    const int r = std::min(8, M - m);
    const float* xm = x + (size_t)m * K;
    float* ym = y + (size_t)m * N;
    switch (r) {
      case 1: gemv_rows_avx<1>(xm, K, w, N, ym, n0, n1); break;
      case 2: gemv_rows_avx<2>(xm, K, w, N, ym, n0, n1); break;
      case 3: gemv_rows_avx<3>(xm, K, w, N, ym, n0, n1); break;
      case 4: gemv_rows_avx<4>(xm, K, w, N, ym, n0, n1); break;
      case 5: gemv_rows_avx<5>(xm, K, w, N, ym, n0, n1); break;
      case 6: gemv_rows_avx<6>(xm, K, w, N, ym, n0, n1); break;
      case 7: gemv_rows_avx<7>(xm, K, w, N, ym, n0, n1); break;
      default: gemv_rows_avx<8>(xm, K, w, N, ym, n0, n1); break;
    }
    m += r;
  }
}

struct MatmulOp {
  struct Params {
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuMatmul";
  static constexpr FusedKind kind = FusedKind::Matmul;

  static void run(const Params&, std::vector<View>& in, View& out) {
    std::vector<float> xt, wt;
    const float* x = dense(in[0], xt);
    const float* w = dense(in[1], wt);
    const int K = in[1].shape(0), N = in[1].shape(1);
    const int M = (int)(in[0].size() / K);
    float* y = out.data<float>();
    // Column ranges in whole 8-lane vectors, at least 32 of them (256 columns) per thread, one
    // range per thread: each reads a strided slice of W, and narrower slices stream worse.
    for_rows(
        (N + 7) / 8, 32,
        [&](size_t v0, size_t v1) { gemv_rows(x, M, K, w, N, y, (int)v0 * 8, std::min(N, (int)v1 * 8)); },
        1);
  }
};

// ---- a float32 weight matrix held in column panels: x [M, K] @ W, W as [N / 32, K, 32] -------
//
// Row-major W [K, N] streams badly once a pass does more than one row's work per weight: the
// few-row kernel above reads twelve rows of W at a time (twelve short streams, a stride of N
// floats apart), and at 4 and 8 rows the float32 bench model's products took 1.3x and 2x the
// one-row time though the FMAs fit in the read several times over. Held as panels of 32 columns
// (panel p is W[:, 32p : 32p + 32] row by row, one contiguous block), a thread walks its panels
// in memory order, and each output element's sum stays in a register for the whole of K: on the
// bench model's shapes (standalone, two threads) one row took 17-19 ms against 22-24, four 17-19
// against 28-30, eight 18-21 against 41-45.

constexpr int kPanel = 32;

// Up to 8 rows of x transposed ([K][R]): the kernels broadcast x[r][k] from one row of it.
std::vector<float> rows_by_k(const float* x, int R, int K) {
  std::vector<float> xt((size_t)K * R);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) xt[(size_t)k * R + r] = x[(size_t)r * K + k];
  return xt;
}

// y[r, 0:32] = Σ_k xt[k][r] · panel[k][0:32] for R rows of y (N apart): each output element is
// one FMA chain over k in order from zero, as in panel_rows_avx2 and panel_rows_scalar, so a row
// gets the same bits whatever kernel, and whichever rows beside it, computed it.
template <int R>
__attribute__((target("avx512f"))) void panel_rows512(const float* xt, int K, const float* panel, float* y, int N) {
  __m512 acc[R][2];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k, panel += kPanel, xt += R) {
    const __m512 v0 = _mm512_loadu_ps(panel), v1 = _mm512_loadu_ps(panel + 16);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(xt[r]);
      acc[r][0] = _mm512_fmadd_ps(b, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, v1, acc[r][1]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + (size_t)r * N, acc[r][0]);
    _mm512_storeu_ps(y + (size_t)r * N + 16, acc[r][1]);
  }
}

// The same sums with AVX2 (16 registers): the panel in two halves of 16 columns, rows four at a
// time.
template <int R>
__attribute__((target("avx2,fma"))) void panel_half_avx2(const float* xt, int stride, int K, const float* half,
                                                         float* y, int N) {
  __m256 acc[R][2];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int k = 0; k < K; ++k, half += kPanel, xt += stride) {
    const __m256 v0 = _mm256_loadu_ps(half), v1 = _mm256_loadu_ps(half + 8);
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(xt + r);
      acc[r][0] = _mm256_fmadd_ps(b, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, v1, acc[r][1]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + (size_t)r * N, acc[r][0]);
    _mm256_storeu_ps(y + (size_t)r * N + 8, acc[r][1]);
  }
}

template <int R>
void panel_rows_avx2(const float* xt, int K, const float* panel, float* y, int N) {
  for (int h = 0; h < kPanel; h += 16)
    for (int r0 = 0; r0 < R; r0 += 4) {
      const float* x0 = xt + r0;
      float* y0 = y + (size_t)r0 * N + h;
      switch (std::min(4, R - r0)) {
        case 1: panel_half_avx2<1>(x0, R, K, panel + h, y0, N); break;
        case 2: panel_half_avx2<2>(x0, R, K, panel + h, y0, N); break;
        case 3: panel_half_avx2<3>(x0, R, K, panel + h, y0, N); break;
        default: panel_half_avx2<4>(x0, R, K, panel + h, y0, N); break;
      }
    }
}

void panel_rows_scalar(const float* xt, int R, int K, const float* panel, float* y, int N) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanel; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc = std::fma(xt[(size_t)k * R + r], panel[(size_t)k * kPanel + c], acc);
      y[(size_t)r * N + c] = acc;
    }
}

template <int R>
void panel_rows(const float* xt, int K, const float* panel, float* y, int N) {
  const int width = g_vector_width.load(std::memory_order_relaxed);
  if (width >= 512 && has_avx512()) return panel_rows512<R>(xt, K, panel, y, N);
  if (width >= 256 && has_avx2()) return panel_rows_avx2<R>(xt, K, panel, y, N);
  panel_rows_scalar(xt, R, K, panel, y, N);
}

// y [M, N] = x [M, K] @ W, W as panels [N / 32, K, 32]. Each thread takes a run of whole
// panels and multiplies each panel into every row of x, eight rows at a time: a panel (K × 128
// bytes) is read from memory once and stays in L2 while the rows' groups pass over it, so
// however many rows there are the weights are read once, as in a GEMM whose packed operand
// the panels already are. Against MLX's product on the row-major matrix (OpenBLAS's sgemm), the
// bench model's products standalone: 64 rows 85-93 ms against 116-121, 340 rows 440-466
// against 451-462, 512 rows 670-687 against 658-695; tiles copied out of the panels for sgemm
// took 1.25x sgemm's time.
void panel_product(const float* x, int M, int K, const float* panels, int N, float* y) {
  const int P = N / kPanel, groups = (M + kMaxRows - 1) / kMaxRows;
  std::vector<std::vector<float>> xts(groups);
  for (int g = 0; g < groups; ++g)
    xts[g] = rows_by_k(x + (size_t)g * kMaxRows * K, std::min(kMaxRows, M - g * kMaxRows), K);
  // One run of panels a thread, each read as one block of memory; at least 8 panels (256
  // columns) where a panel is little work (one group of rows).
  for_rows(P, groups > 1 ? 1 : 8, [&](size_t p0, size_t p1) {
    for (size_t p = p0; p < p1; ++p) {
      const float* panel = panels + p * (size_t)K * kPanel;
      for (int g = 0; g < groups; ++g) {
        const float* xt = xts[g].data();
        float* yp = y + (size_t)g * kMaxRows * N + p * kPanel;
        switch (std::min(kMaxRows, M - g * kMaxRows)) {
          case 1: panel_rows<1>(xt, K, panel, yp, N); break;
          case 2: panel_rows<2>(xt, K, panel, yp, N); break;
          case 3: panel_rows<3>(xt, K, panel, yp, N); break;
          case 4: panel_rows<4>(xt, K, panel, yp, N); break;
          case 5: panel_rows<5>(xt, K, panel, yp, N); break;
          case 6: panel_rows<6>(xt, K, panel, yp, N); break;
          case 7: panel_rows<7>(xt, K, panel, yp, N); break;
          default: panel_rows<8>(xt, K, panel, yp, N); break;
        }
      }
    }
  }, 1);
}

struct PanelMatmulOp {
  struct Params {
    bool operator==(const Params&) const = default;
  };
  static constexpr const char* name = "MlxrCpuPanelMatmul";
  static constexpr FusedKind kind = FusedKind::PanelMatmul;

  static void run(const Params&, std::vector<View>& in, View& out) {
    std::vector<float> xt, pt;
    const float* x = dense(in[0], xt);
    const float* panels = dense(in[1], pt);
    const int K = in[1].shape(1), N = in[1].shape(0) * kPanel;
    const int M = (int)(in[0].size() / K);
    panel_product(x, M, K, panels, N, out.data<float>());
  }
};

bool is_f32(const mx::array& a) { return a.dtype() == mx::float32; }

// A norm's weight the kernels take for rows of d values: float32, [d].
bool norm_weight_fits(const mx::array& w, int d) {
  return is_f32(w) && w.ndim() == 1 && w.size() == (size_t)d;
}

// A rotation the kernels take for rows of `width` values: even dims within the row, a base or
// float32 wavelengths [dims / 2], and int32 offsets, one or one per batch row (`rows`).
bool rope_applies(
    int dims,
    int width,
    bool has_base,
    const std::optional<mx::array>& freqs,
    const mx::array& offsets,
    size_t rows) {
  if (dims <= 0 || dims % 2 != 0 || dims > width || has_base == freqs.has_value()) return false;
  if (offsets.dtype() != mx::int32 || offsets.ndim() > 1 ||
      (offsets.size() != 1 && offsets.size() != rows))
    return false;
  return !freqs || (is_f32(*freqs) && freqs->ndim() == 1 && freqs->shape(0) == dims / 2);
}

bool cpu_applies_rms_norm_residual(
    const mx::array& x,
    const std::optional<mx::array>& w,
    const std::optional<mx::array>& residual,
    const std::optional<mx::array>& scale) {
  return is_f32(x) && cpu_norm_update_applies(x.shape(), w, residual, scale, std::nullopt);
}

}  // namespace

bool cpu_norm_update_applies(
    const mx::Shape& shape,
    const std::optional<mx::array>& w,
    const std::optional<mx::array>& residual,
    const std::optional<mx::array>& scale,
    const std::optional<mx::array>& next_w) {
  if (!on_cpu() || shape.empty() || shape.back() == 0) return false;
  if (w && !norm_weight_fits(*w, shape.back())) return false;
  if (residual && (!is_f32(*residual) || residual->shape() != shape)) return false;
  if (scale && (!residual || !is_f32(*scale) || scale->size() != 1)) return false;
  return !next_w || norm_weight_fits(*next_w, shape.back());
}

void set_fused_cpu_enabled(bool on) { g_enabled.store(on); }

void set_cpu_vector_width(int bits) { g_vector_width.store(bits); }

bool fused_cpu_enabled() { return g_enabled.load(); }

uint64_t fused_cpu_count(FusedKind kind) {
  const int i = static_cast<int>(kind);
  return i < kKinds ? g_counts[i].load() : 0;
}

std::optional<mx::array> cpu_rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& w,
    float eps) {
  return cpu_rms_norm_residual(x, w, eps, std::nullopt, std::nullopt);
}

std::optional<mx::array> cpu_rms_norm_residual(
    const mx::array& x,
    const std::optional<mx::array>& w,
    float eps,
    const std::optional<mx::array>& residual,
    const std::optional<mx::array>& scale) {
  if (!cpu_applies_rms_norm_residual(x, w, residual, scale)) return std::nullopt;
  std::vector<mx::array> in{x};
  for (const auto* a : {&w, &residual, &scale})
    if (*a) in.push_back(**a);
  return fused<RmsNormOp>(
      x.shape(), {eps, w.has_value(), residual.has_value(), scale.has_value(), false}, std::move(in));
}

std::optional<std::vector<mx::array>> cpu_rms_norm_residual_norm(
    const mx::array& x,
    const std::optional<mx::array>& w,
    float eps,
    const mx::array& residual,
    const std::optional<mx::array>& scale,
    const mx::array& next_w) {
  // What the one-output kernel takes, and a weight for the second norm.
  if (!cpu_applies_rms_norm_residual(x, w, residual, scale)) return std::nullopt;
  if (!norm_weight_fits(next_w, x.shape(-1))) return std::nullopt;
  std::vector<mx::array> in{x};
  if (w) in.push_back(*w);
  in.push_back(residual);
  if (scale) in.push_back(*scale);
  in.push_back(next_w);
  return fused_many<RmsNormOp>(
      {x.shape(), x.shape()}, {eps, w.has_value(), true, scale.has_value(), true}, std::move(in));
}

std::optional<mx::array> cpu_rope(
    const mx::array& x,
    int dims,
    bool traditional,
    std::optional<float> base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs) {
  if (!on_cpu() || !is_f32(x) || x.ndim() < 3 || x.size() == 0) return std::nullopt;
  if (!rope_applies(dims, x.shape(-1), base.has_value(), freqs, offset, (size_t)x.shape(0)))
    return std::nullopt;
  std::vector<mx::array> in{x, offset};
  if (freqs) in.push_back(*freqs);
  return fused<RopeOp>(
      x.shape(), {dims, traditional, base.value_or(1.0f), scale, freqs.has_value()}, std::move(in));
}

std::optional<mx::array> cpu_heads_norm_rope(
    const mx::array& y,
    int heads,
    const std::optional<mx::array>& w,
    float eps,
    const std::optional<HeadsRope>& rope,
    const mx::array& offsets) {
  if (!on_cpu() || !is_f32(y) || y.ndim() == 0 || y.size() == 0 || heads <= 0) return std::nullopt;
  if (y.shape(-1) % heads != 0) return std::nullopt;
  const int d = y.shape(-1) / heads;
  const int T = (int)(y.size() / y.shape(-1));
  if (w && !norm_weight_fits(*w, d)) return std::nullopt;
  std::vector<mx::array> in{y};
  if (w) in.push_back(*w);
  RopeParams rp{0, false, 1.0f, 1.0f, false};
  if (rope) {
    const auto& r = *rope;
    if (!rope_applies(r.dims, d, r.base.has_value(), r.freqs, offsets, (size_t)T)) return std::nullopt;
    rp = {r.dims, r.traditional, r.base.value_or(1.0f), r.scale, r.freqs.has_value()};
    in.push_back(offsets);
    if (r.freqs) in.push_back(*r.freqs);
  }
  return fused<HeadsNormRopeOp>(
      {T, heads, 1, d}, {heads, eps, w.has_value(), rope.has_value(), rp}, std::move(in));
}

namespace {

// The heads of a q/k/v op over T rows of heads d wide: its params where the norms and the
// rotation apply (their inputs appended to `in`: q_norm, k_norm, offsets, the wavelengths),
// else nullopt.
std::optional<QkvHeadsOp::Params> qkv_heads_part(
    int q_heads,
    int kv_heads,
    const mx::array& q_norm,
    const mx::array& k_norm,
    float eps,
    const HeadsRope& rope,
    const mx::array& offsets,
    int d,
    int T,
    std::vector<mx::array>& in) {
  if (!norm_weight_fits(q_norm, d) || !norm_weight_fits(k_norm, d)) return std::nullopt;
  if (!rope_applies(rope.dims, d, rope.base.has_value(), rope.freqs, offsets, (size_t)T)) return std::nullopt;
  in.insert(in.end(), {q_norm, k_norm, offsets});
  if (rope.freqs) in.push_back(*rope.freqs);
  const RopeParams rp{rope.dims, rope.traditional, rope.base.value_or(1.0f), rope.scale, rope.freqs.has_value()};
  return QkvHeadsOp::Params{q_heads, kv_heads, eps, rp};
}

// The op's outputs: [T, heads, 1, d] queries, keys and values.
std::vector<mx::Shape> qkv_heads_shapes(const QkvHeadsOp::Params& p, int d, int T) {
  return {{T, p.q_heads, 1, d}, {T, p.kv_heads, 1, d}, {T, p.kv_heads, 1, d}};
}

}  // namespace

std::optional<std::vector<mx::array>> cpu_qkv_heads(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    int q_heads,
    int kv_heads,
    const mx::array& q_norm,
    const mx::array& k_norm,
    float eps,
    const HeadsRope& rope,
    const mx::array& offsets) {
  if (!on_cpu() || q_heads <= 0 || kv_heads <= 0) return std::nullopt;
  for (const auto* y : {&q, &k, &v})
    if (!is_f32(*y) || y->ndim() == 0 || y->size() == 0) return std::nullopt;
  if (q.shape(-1) % q_heads != 0) return std::nullopt;
  const int d = q.shape(-1) / q_heads;
  const int T = (int)(q.size() / q.shape(-1));
  for (const auto* y : {&k, &v})
    if (y->shape(-1) != kv_heads * d || (int)(y->size() / y->shape(-1)) != T) return std::nullopt;
  std::vector<mx::array> in{q, k, v};
  const auto p = qkv_heads_part(q_heads, kv_heads, q_norm, k_norm, eps, rope, offsets, d, T, in);
  if (!p) return std::nullopt;
  return fused_many<QkvHeadsOp>(qkv_heads_shapes(*p, d, T), *p, std::move(in));
}

std::optional<std::vector<mx::array>> cpu_quantized_qkv_heads(
    const mx::array& x,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int group_size,
    int bits,
    int mode,
    bool panels,
    int q_heads,
    int kv_heads,
    const mx::array& q_norm,
    const mx::array& k_norm,
    float eps,
    const HeadsRope& rope,
    const mx::array& offsets) {
  const size_t n = ws.size();
  // Affine matrices have biases, the microscaling modes none.
  const size_t with_biases = mode == 0 ? n : 0;
  if (!on_cpu() || (n != 2 && n != 3) || scales.size() != n || biases.size() != with_biases ||
      q_heads <= 0 || kv_heads <= 0)
    return std::nullopt;
  auto bias = [&](size_t i) { return mode == 0 ? std::optional<mx::array>(biases[i]) : std::nullopt; };
  for (size_t i = 0; i < n; ++i)
    if (!cpu_qmm_applies(x, ws[i], scales[i], bias(i), group_size, bits, mode, panels)) return std::nullopt;
  const int unit = panels ? QPANEL : 1;
  if (ws[0].shape(0) * unit % q_heads != 0) return std::nullopt;
  const int d = ws[0].shape(0) * unit / q_heads;
  for (size_t i = 1; i < n; ++i)
    if (ws[i].shape(0) * unit != kv_heads * d) return std::nullopt;
  const int T = (int)(x.size() / x.shape(-1));
  std::vector<mx::array> in{x};
  for (size_t i = 0; i < n; ++i) {
    in.insert(in.end(), {ws[i], scales[i]});
    if (mode == 0) in.push_back(biases[i]);
  }
  const auto p = qkv_heads_part(q_heads, kv_heads, q_norm, k_norm, eps, rope, offsets, d, T, in);
  if (!p) return std::nullopt;
  return fused_many<QuantizedQkvHeadsOp>(qkv_heads_shapes(*p, d, T), {*p, group_size, bits, (int)n, mode, panels}, std::move(in));
}

std::optional<std::vector<mx::array>> cpu_sdpa_slots(
    const mx::array& q,
    const std::vector<mx::array>& k,
    const std::vector<mx::array>& v,
    int keys,
    const std::vector<mx::array>& k_new,
    const std::vector<mx::array>& v_new,
    int write_at,
    int group,
    int bits,
    float scale,
    bool causal,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    bool tokens) {
  // Queries in float32; keys and values in float32, float16 or bfloat16, both of one type, or
  // both 4- or 8-bit affine with float32 scales and biases.
  const size_t np = bits ? 3 : 1;
  if (!on_cpu() || !is_f32(q) || k.size() != np || v.size() != np) return std::nullopt;
  const bool write = !k_new.empty();
  if (write && (k_new.size() != np || v_new.size() != np)) return std::nullopt;
  if (bits) {
    if ((bits != 4 && bits != 8) || group % 8 != 0 || group <= 0) return std::nullopt;
    for (const auto* side : {&k, &v})
      if ((*side)[0].dtype() != mx::uint32 || !is_f32((*side)[1]) || !is_f32((*side)[2])) return std::nullopt;
  } else {
    const auto t = k[0].dtype();
    if ((t != mx::float32 && t != mx::float16 && t != mx::bfloat16) || v[0].dtype() != t) return std::nullopt;
  }
  for (const auto* side : {&k, &v, &k_new, &v_new})
    for (const auto& a : *side)
      if (a.ndim() != 4) return std::nullopt;
  if (q.ndim() != 4) return std::nullopt;
  // Logical widths: a packed row of D values is D·bits/32 words and D/group scales.
  const auto width = [&](const std::vector<mx::array>& side) {
    return bits ? (int)side[1].shape(3) * group : (int)side[0].shape(3);
  };
  if (bits)
    for (const auto* side : {&k, &v, &k_new, &v_new})
      if (!side->empty() && (int)(*side)[0].shape(3) * 32 / bits != (int)(*side)[1].shape(3) * group)
        return std::nullopt;
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hk = k[0].shape(1), S = k[0].shape(2), Dv = width(v);
  if (L == 0 || L > kMaxQueries || keys < L || keys > S || Hk == 0 || Hq % Hk != 0 || width(k) != D)
    return std::nullopt;
  for (const auto* side : {&k, &v})
    for (const auto& a : *side)
      if (a.shape(0) != B || a.shape(1) != Hk || a.shape(2) != S) return std::nullopt;
  if (causal && mask) return std::nullopt;
  if (write) {
    const int Ln = k_new[0].shape(2);
    for (size_t i = 0; i < np; ++i) {
      const auto& kn = k_new[i];
      const auto& vn = v_new[i];
      if (kn.dtype() != k[i].dtype() || vn.dtype() != v[i].dtype() ||
          kn.shape() != mx::Shape{B, Hk, Ln, (int)k[i].shape(3)} || vn.shape() != mx::Shape{B, Hk, Ln, (int)v[i].shape(3)})
        return std::nullopt;
    }
    if (write_at < 0 || write_at + Ln > S) return std::nullopt;
  }
  std::vector<mx::array> in{q};
  in.insert(in.end(), k.begin(), k.end());
  in.insert(in.end(), v.begin(), v.end());
  bool bool_mask = false;
  if (mask) {
    if (mask->ndim() > 4) return std::nullopt;
    bool_mask = mask->dtype() == mx::bool_;
    if (!bool_mask && !is_f32(*mask)) return std::nullopt;
    mx::Shape full{B, Hq, L, keys};
    for (int d = 1; d <= (int)mask->ndim(); ++d) {
      const int m = mask->shape(-d);
      if (m != 1 && m != full[4 - d]) return std::nullopt;
    }
    in.push_back(mx::broadcast_to(*mask, full));
  }
  if (sinks) {
    if (!is_f32(*sinks) || sinks->ndim() != 1 || sinks->shape(0) != Hq) return std::nullopt;
    in.push_back(*sinks);
  }
  const SdpaOp::Params p{scale,  causal, mask.has_value(), bool_mask, sinks.has_value(), keys, write ? write_at : -1,
                         tokens, bits,   bits ? group : 0};
  const mx::Shape out = tokens ? mx::Shape{B, L, Hq * Dv} : mx::Shape{B, Hq, L, Dv};
  if (!write) {
    auto o = fused<SdpaOp>(out, p, std::move(in));
    if (!o) return std::nullopt;
    return std::vector<mx::array>{std::move(*o)};
  }
  std::vector<mx::Shape> shapes{out};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (const auto* side : {&k, &v})
    for (const auto& a : *side) {
      shapes.push_back(a.shape());
      dtypes.push_back(a.dtype());
    }
  in.insert(in.end(), k_new.begin(), k_new.end());
  in.insert(in.end(), v_new.begin(), v_new.end());
  return fused_many<SdpaOp>(std::move(shapes), p, std::move(in), std::move(dtypes));
}

std::optional<mx::array> cpu_matmul(const mx::array& x, const mx::array& w) {
  if (!on_cpu() || !is_f32(x) || !is_f32(w) || x.ndim() < 1 || w.ndim() != 2 || x.size() == 0 ||
      w.size() == 0)
    return std::nullopt;
  // Only a weight as loaded (evaluated, row-major) and a few rows of x.
  if (!w.is_available() || !w.flags().row_contiguous || x.shape(-1) != w.shape(0) ||
      x.size() / x.shape(-1) > (size_t)kMaxRows)
    return std::nullopt;
  auto shape = x.shape();
  shape.back() = w.shape(1);
  return fused<MatmulOp>(shape, {}, {x, w});
}

std::optional<mx::array> cpu_panel_matmul(const mx::array& x, const mx::array& panels) {
  if (!on_cpu() || !is_f32(x) || !is_f32(panels) || x.ndim() < 1 || panels.ndim() != 3 ||
      panels.shape(2) != kPanel || x.shape(-1) != panels.shape(1) || x.size() == 0 || panels.size() == 0)
    return std::nullopt;
  auto shape = x.shape();
  shape.back() = panels.shape(0) * kPanel;
  return fused<PanelMatmulOp>(shape, {}, {x, panels});
}

std::optional<mx::array> cpu_gelu_tanh(const mx::array& x) {
  if (!on_cpu() || !is_f32(x) || x.size() == 0) return std::nullopt;
  return fused<GeluTanhOp>(x.shape(), {}, {x});
}

std::optional<mx::array> cpu_softmax(const mx::array& x) {
  if (!on_cpu() || !is_f32(x) || x.ndim() < 1 || x.size() == 0 || x.shape(-1) == 0)
    return std::nullopt;
  return fused<SoftmaxOp>(x.shape(), {}, {x});
}

std::optional<mx::array> cpu_silu_mul(const mx::array& g, const mx::array& u, bool silu) {
  if (!on_cpu() || !is_f32(g) || !is_f32(u) || g.size() == 0 || g.shape() != u.shape()) {
    return std::nullopt;
  }
  return fused<SiluMulOp>(g.shape(), {silu}, {g, u});
}

std::optional<mx::array> cpu_softcap(const mx::array& x, float cap) {
  if (!on_cpu() || !is_f32(x) || x.size() == 0 || !(cap > 0.0f)) return std::nullopt;
  return fused<SoftcapOp>(x.shape(), {cap}, {x});
}

}  // namespace mlxr
