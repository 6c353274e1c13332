// What the CPU kernels (qmm_cpu.cc, fpq_cpu.cc, fused_cpu.cc) share: one persistent thread pool, the
// AVX2 check, a horizontal sum, reading a strided array densely, and the MLX primitive that
// runs a kernel on the CPU stream.
#pragma once

#include <dlfcn.h>
#include <sched.h>
#include <immintrin.h>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mlxr {

// An allocator of 64-byte-aligned storage, for the scratch rows kernels read 64 bytes at a
// time: a 64-byte load that straddles two cache lines costs two, and a kernel re-reading a
// misaligned row of x from L1 ran 30% slower (the 16-lane 4-bit kernel at four rows, one core).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};

// The CPUs this process may run on: its affinity where it has one (a rank that rank 0 gave its
// own share of the machine), else every core. std::thread::hardware_concurrency counts the
// machine's, and a pool of that many threads on a share of one core made them take turns.
inline unsigned usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return (unsigned)n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// The caller and (cores - 1) workers, sharing each job's chunks through an atomic counter.
//
// A job's chunks are claimed one at a time by whoever is running, so a worker that wakes late
// (or loses its core to the engine's main thread for a while) only does fewer of them; the
// caller never waits for a worker that has not joined, only for one still inside a chunk. On
// this project's 2-core machines the engine's main thread, MLX's stream thread and the worker
// share two cores, and a static half each made the stream thread wait in sched_yield for the
// preempted worker's half (4-5% of a 4-bit decode's samples, `perf record`).
class Pool {
 public:
  Pool() {
    const unsigned n = usable_cpus();
    for (unsigned i = 1; i < n; ++i) {
      workers_.emplace_back([this] { work(); });
    }
  }

  ~Pool() {
    stop_.store(true);
    bump();
    for (auto& t : workers_) t.join();
  }

  size_t size() const { return workers_.size() + 1; }

  // Runs f(chunk) for every chunk in [0, chunks), on the caller and whichever workers join;
  // returns when all are done.
  void run(size_t chunks, const std::function<void(size_t)>& f) {
    if (workers_.empty() || chunks <= 1) {
      for (size_t c = 0; c < chunks; ++c) f(c);
      return;
    }
    std::lock_guard<std::mutex> one(run_m_);
    task_ = &f;
    chunks_ = chunks;
    next_.store(0, std::memory_order_relaxed);
    // Open, no one inside. Release: a worker whose join reads it sees the job above.
    state_.store(0, std::memory_order_release);
    bump();
    drain();
    // Close the job to late joiners, then wait for those inside (each finishing one chunk).
    state_.fetch_or(kClosed, std::memory_order_acq_rel);
    for (int spin = 0; (state_.load(std::memory_order_acquire) & ~kClosed) != 0; ++spin) {
      if (spin > 1000) std::this_thread::yield();
    }
    task_ = nullptr;
  }

 private:
  static constexpr uint32_t kClosed = 1u << 30;

  void drain() {
    for (size_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) (*task_)(c);
  }

  // Joins the open job, if any, and takes chunks until none are left.
  void join() {
    uint32_t s = state_.load(std::memory_order_acquire);
    do {
      if (s & kClosed) return;
    } while (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel));
    drain();
    state_.fetch_sub(1, std::memory_order_release);
  }

  void work() {
    // Subnormal operands read as such (DAZ off), whatever the creating thread had: the
    // quantized kernel's subnormal unpacking relies on it (it checks its caller's own).
    _mm_setcsr(_mm_getcsr() & ~0x40u);
    // The generation the pool started at, not whatever it is by the time this thread runs: a
    // first call may already have been handed out.
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      for (int spin = 0;; ++spin) {
        g = generation_.load(std::memory_order_acquire);
        if (g != seen) break;
        // Long enough to span the few small ops between two products of a decode step, short
        // enough not to take a core from MLX's stream thread and the caller for long: on a
        // 2-core Zen 4 machine 2000 pauses gave a 4-bit decode step of 6.0-6.3 ms against
        // 7.0-7.4 ms with 20000 and 7.6-9.1 ms with 200-500 (`cargo bench --bench step`).
        // Past the first pauses the wait yields: the engine's main thread (building and
        // encoding the next step, ~20% of a core in a 4-bit decode) then runs in these gaps
        // instead of taking a core from the two threads inside a product later. `generate -n
        // 200-300` on the 4-bit bench model at a 607-token prompt, interleaved with 2000
        // pauses: medians of the per-round ratios 1.07, 1.07, 1.05 (8, 8, 16 rounds); 64
        // pauses then 40 yields 1.06, 1.00; 256 then 200 yields 1.00.
        if (spin < 256) {
          _mm_pause();
        } else if (spin < 256 + 40) {
          std::this_thread::yield();
        } else {
          // Asleep until the next call: the predicate is read under the mutex that bump()
          // takes after changing it, so no wake-up is lost.
          std::unique_lock<std::mutex> l(sleep_m_);
          sleep_cv_.wait(l, [&] { return generation_.load() != seen; });
          spin = 0;
        }
      }
      seen = g;
      if (stop_.load()) return;
      join();
    }
  }

  void bump() {
    generation_.fetch_add(1, std::memory_order_release);
    { std::lock_guard<std::mutex> l(sleep_m_); }
    sleep_cv_.notify_all();
  }

  std::vector<std::thread> workers_;
  std::mutex run_m_, sleep_m_;
  std::condition_variable sleep_cv_;
  const std::function<void(size_t)>* task_ = nullptr;
  size_t chunks_ = 0;
  std::atomic<size_t> next_{0};
  // kClosed once the caller has finished, plus the number of workers inside the job.
  std::atomic<uint32_t> state_{kClosed};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

inline Pool& pool() {
  static Pool p;
  return p;
}

// Runs f(r0, r1) over rows [0, n) in chunks of at least `min_per_chunk` rows, up to a few per
// thread so that whoever is running takes the next one; small jobs stay on the calling thread.
// Where there is room for more chunks than threads their count is a multiple of the threads,
// so that equal chunks still split evenly when every thread runs throughout. Kernels whose
// chunks are strided slices (column ranges) ask for one chunk per thread.
template <class F>
void for_rows(size_t n, size_t min_per_chunk, const F& f, size_t chunks_per_thread = 8) {
  auto& p = pool();
  const size_t most = n / std::max<size_t>(1, min_per_chunk);
  if (most < 2 || p.size() == 1) {
    f(0, n);
    return;
  }
  const size_t chunks =
      most < p.size() ? most : p.size() * std::min(chunks_per_thread, most / p.size());
  p.run(chunks, [&](size_t c) { f(n * c / chunks, n * (c + 1) / chunks); });
}

// AVX2 with FMA; MLXR_NO_AVX2 set in the environment turns it off, and AVX-512 with it (the
// scalar paths, which CPUs without AVX2 take, tested on one that has it).
inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          std::getenv("MLXR_NO_AVX2") == nullptr;
  return yes;
}

// AVX-512 (its foundation: 16-lane float and int32 arithmetic), beside AVX2; MLXR_NO_AVX512
// set in the environment turns it off (to compare the two paths on one machine).
inline bool has_avx512() {
  static const bool yes =
      has_avx2() && __builtin_cpu_supports("avx512f") && std::getenv("MLXR_NO_AVX512") == nullptr;
  return yes;
}

// AVX-512 with its byte and word instructions (a 64-byte byte shuffle), where has_avx512().
inline bool has_avx512bw() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bw");
  return yes;
}

// AVX-512's integer dot products (VNNI: vpdpbusd) and byte permutes (VBMI: vpermb,
// vpmultishiftqb), where has_avx512bw(); MLXR_NO_VNNI set in the environment turns them off
// (the float word-lane kernels then take those widths, as on CPUs without them).
inline bool has_vnni() {
  static const bool yes = has_avx512bw() && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vbmi") && std::getenv("MLXR_NO_VNNI") == nullptr;
  return yes;
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// A 512-bit vector's upper eight floats, and one vector of two 8-float halves (lo in lanes 0-7):
// AVX-512's foundation only, as has_avx512() checks (the 8-float forms of these moves need DQ).
__attribute__((target("avx512f"))) inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

__attribute__((target("avx512f"))) inline __m512 halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// tanh-approximated GELU: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), shared by the GELU op and
// the fused quantized GeGLU so that both give the same values.
//
// Computed as x · sigmoid(2y) = x / (1 + exp(−2y)), the same function: one exponential, no
// cancellation in 1 + tanh(y) for very negative x. The AVX2 exponential is the usual range
// reduction to 2^n · e^r with a degree-6 polynomial (relative error ~1e-7); libm's tanhf was
// a twentieth of a 4-bit decode step.

inline constexpr float kGeluC = 0.7978845608028654f;

__attribute__((target("avx2,fma"))) inline __m256 exp_avx(__m256 x) {
  // Clamped with x as the second operand, which min and max return when it is NaN: NaN in,
  // NaN out.
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
  const __m256 n = _mm256_round_ps(
      _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline void gelu_scalar(const float* x, float* o, size_t i0, size_t i1) {
  for (size_t i = i0; i < i1; ++i) {
    const float v = x[i];
    o[i] = v / (1.0f + std::exp(-2.0f * kGeluC * (v + 0.044715f * v * v * v)));
  }
}

// Every element goes through the vector code, the last few in a padded block: the value of an
// element does not depend on where a call's range starts or ends (the fused GeGLU's column
// chunks get what one GELU over the whole array gives).
__attribute__((target("avx2,fma"))) inline __m256 gelu_v(__m256 v) {
  const __m256 c = _mm256_set1_ps(-2.0f * kGeluC), k = _mm256_set1_ps(0.044715f);
  const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(v, v), v), k, v);
  const __m256 e = exp_avx(_mm256_mul_ps(inner, c));
  return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

__attribute__((target("avx2,fma"))) inline void gelu_avx(const float* x, float* o, size_t i0, size_t i1) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(o + i, gelu_v(_mm256_loadu_ps(x + i)));
  if (i < i1) {
    float in[8] = {}, res[8];
    std::copy(x + i, x + i1, in);
    _mm256_storeu_ps(res, gelu_v(_mm256_loadu_ps(in)));
    std::copy(res, res + (i1 - i), o + i);
  }
}

// silu(g) ⊙ u = g / (1 + exp(-g)) · u, a SwiGLU's gate times its up projection, with the same
// exponential as the GELU and, like it, every element through the vector code; without the
// gate's own factor (`Silu` false), σ(g) ⊙ u = u / (1 + exp(-g)), a GLU's.
template <bool Silu>
__attribute__((target("avx2,fma"))) inline __m256 gate_mul_v(__m256 g, __m256 u) {
  const __m256 e = exp_avx(_mm256_sub_ps(_mm256_setzero_ps(), g));
  const __m256 num = Silu ? _mm256_mul_ps(g, u) : u;
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

template <bool Silu>
__attribute__((target("avx2,fma"))) inline void gate_mul_avx(
    const float* g, const float* u, float* o, size_t i0, size_t i1) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8)
    _mm256_storeu_ps(o + i, gate_mul_v<Silu>(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < i1) {
    float gi[8] = {}, ui[8] = {}, res[8];
    std::copy(g + i, g + i1, gi);
    std::copy(u + i, u + i1, ui);
    _mm256_storeu_ps(res, gate_mul_v<Silu>(_mm256_loadu_ps(gi), _mm256_loadu_ps(ui)));
    std::copy(res, res + (i1 - i), o + i);
  }
}

template <bool Silu>
inline void gate_mul_scalar(const float* g, const float* u, float* o, size_t i0, size_t i1) {
  for (size_t i = i0; i < i1; ++i) o[i] = (Silu ? g[i] * u[i] : u[i]) / (1.0f + std::exp(-g[i]));
}

// GELU and silu(g) ⊙ u over [i0, i1), with AVX2 where the CPU has it.
inline void gelu_range(const float* x, float* o, size_t i0, size_t i1) {
  if (has_avx2()) {
    gelu_avx(x, o, i0, i1);
  } else {
    gelu_scalar(x, o, i0, i1);
  }
}

template <bool Silu>
inline void gate_mul_range(const float* g, const float* u, float* o, size_t i0, size_t i1) {
  if (has_avx2()) {
    gate_mul_avx<Silu>(g, u, o, i0, i1);
  } else {
    gate_mul_scalar<Silu>(g, u, o, i0, i1);
  }
}

inline void silu_mul_range(const float* g, const float* u, float* o, size_t i0, size_t i1) {
  gate_mul_range<true>(g, u, o, i0, i1);
}

// What a kernel reads of an array: its data pointer, dtype, shape, strides and layout flags,
// taken when the op is encoded on the engine's thread (where MLX has already placed every
// input's and output's buffer). The kernel, on the stream's thread, then holds no array objects:
// an `unsafe_weak_copy` per input and output allocated a descriptor and its shape and strides
// on the engine's thread and freed them on the stream's, a sixth of the engine thread's samples
// in a 4-bit decode (`perf record -t`).
class View {
 public:
  static constexpr int kMaxDims = 8;

  // A shape's or strides' values, indexable like the vectors MLX returns.
  template <class T>
  struct Dims {
    const T* p;
    int n;
    T operator[](int i) const { return p[i]; }
    T back() const { return p[n - 1]; }
    int size() const { return n; }
    const T* begin() const { return p; }
    const T* end() const { return p + n; }
  };

  explicit View(const mlx::core::array& a)
      : ptr_(const_cast<void*>(static_cast<const void*>(a.data<char>()))),
        dtype_(a.dtype()),
        size_(a.size()),
        nbytes_(a.nbytes()),
        nd_((int)a.ndim()),
        flags_(a.flags()) {
    // make() leaves arrays of more dimensions to MLX; this only guards that promise.
    if (nd_ > kMaxDims)
      throw std::invalid_argument("[mlx-runner] a CPU kernel was given an array of more than 8 dimensions");
    for (int d = 0; d < nd_; ++d) {
      shape_[d] = a.shape(d);
      strides_[d] = a.strides()[d];
    }
  }

  template <class T>
  T* data() const {
    return static_cast<T*>(ptr_);
  }
  int ndim() const { return nd_; }
  int shape(int d) const { return shape_[d < 0 ? d + nd_ : d]; }
  Dims<int32_t> shape() const { return {shape_, nd_}; }
  Dims<int64_t> strides() const { return {strides_, nd_}; }
  size_t size() const { return size_; }
  size_t nbytes() const { return nbytes_; }
  mlx::core::Dtype dtype() const { return dtype_; }
  const mlx::core::array::Flags& flags() const { return flags_; }

 private:
  void* ptr_;
  mlx::core::Dtype dtype_;
  size_t size_, nbytes_;
  int nd_;
  int32_t shape_[kMaxDims] = {};
  int64_t strides_[kMaxDims] = {};
  mlx::core::array::Flags flags_;
};

// `a`'s elements in row-major order into `dst` (a.size() of them).
template <typename T>
void copy_dense(const View& a, T* dst) {
  const T* src = a.data<T>();
  if (a.flags().row_contiguous) {
    std::copy(src, src + a.size(), dst);
    return;
  }
  const int nd = a.ndim();
  int idx[View::kMaxDims] = {};
  int64_t off = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dst[i] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      off += a.strides()[d];
      if (++idx[d] < a.shape(d)) break;
      off -= a.strides()[d] * a.shape(d);
      idx[d] = 0;
    }
  }
}

// `a` as row-major data: its own buffer when it is one, else a copy into `tmp`.
template <typename T>
const T* dense(const View& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) return a.data<T>();
  tmp.resize(a.size());
  copy_dense(a, tmp.data());
  return tmp.data();
}

// Whether `out` may be written in `in`'s buffer: MLX's rule for donation (nothing else holds
// the array or its buffer: no other op still to read it, no handle outside the graph) for an
// input of the output's shape, dtype and row-major layout. An op that updates a buffer (a
// cache write) then costs the rows it writes, not a copy of the buffer.
inline bool can_take_over(const mlx::core::array& in, const mlx::core::array& out) {
  return in.is_donatable() && in.flags().row_contiguous && in.dtype() == out.dtype() &&
      in.shape() == out.shape();
}

// An MLX primitive for a CPU kernel `Op` (a `Params` struct with ==, a `name` and a static
// `run(params, inputs, output)`, or `run_many(params, inputs, outputs)` for several outputs,
// and optionally `donor(params, output)`, the input whose buffer that output may take over, or
// -1): allocates the float32 outputs, registers the buffers with the CPU stream's encoder and runs
// the kernel there, in stream order, as MLX's own CPU ops do.
template <class Op>
class CpuPrimitive : public mlx::core::Primitive {
 public:
  CpuPrimitive(mlx::core::Stream s, typename Op::Params p) : mlx::core::Primitive(s), p_(p) {}

  void eval_cpu(const std::vector<mlx::core::array>& inputs, std::vector<mlx::core::array>& outputs) override {
    auto& enc = mlx::core::cpu::get_command_encoder(stream());
    std::vector<View> ins, outs;
    ins.reserve(inputs.size());
    outs.reserve(outputs.size());
    for (auto& a : inputs) {
      enc.set_input_array(a);
      ins.emplace_back(a);
    }
    if constexpr (kDonates) {
      // Each output of a several-output op holds its own copy of the op's input list
      // (array::make_arrays), so by MLX's count (is_donatable) an input of such an op is never
      // free to give its buffer away. The other outputs' copies are dropped here, as MLX's
      // detach() does right after this evaluation; the list `inputs` refers to is kept. Not
      // under a graph transformation, which keeps the graph.
      bool traced = false;
      for (auto& out : outputs) traced |= out.is_tracer();
      if (!traced)
        for (auto& out : outputs)
          if (&out.inputs() != &inputs) out.inputs().clear();
    }
    for (size_t o = 0; o < outputs.size(); ++o) {
      auto& out = outputs[o];
      int donor = -1;
      if constexpr (kDonates) donor = Op::donor(p_, o);
      if (donor >= 0 && can_take_over(inputs[donor], out)) {
        out.copy_shared_buffer(inputs[donor]);
      } else {
        out.set_data(mlx::core::allocator::malloc(out.nbytes()));
      }
      enc.set_output_array(out);
      outs.emplace_back(out);
    }
    enc.dispatch([ins = std::move(ins), outs = std::move(outs), p = p_]() mutable {
      if constexpr (requires { Op::run_many(p, ins, outs); }) {
        Op::run_many(p, ins, outs);
      } else {
        Op::run(p, ins, outs[0]);
      }
    });
  }

  void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string("[mlx-runner] ") + Op::name + " has no GPU path");
  }

  const char* name() const override { return Op::name; }

  // Whether some output may take over an input's buffer (`Op::donor`).
  static constexpr bool kDonates = requires(const typename Op::Params& p) { Op::donor(p, size_t{0}); };

  bool is_equivalent(const mlx::core::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuPrimitive*>(&other);
    return o && o->p_ == p_;
  }

 private:
  typename Op::Params p_;
};

// Whether every input and output has few enough dimensions for a View (arrays of more are left
// to MLX's own ops).
inline bool views_fit(const std::vector<mlx::core::Shape>& shapes, const std::vector<mlx::core::array>& inputs) {
  for (const auto& s : shapes)
    if (s.size() > (size_t)View::kMaxDims) return false;
  for (const auto& a : inputs)
    if (a.ndim() > (size_t)View::kMaxDims) return false;
  return true;
}

// The output of `Op` on `inputs`, on the CPU stream; nullopt where a View cannot hold them.
template <class Op>
std::optional<mlx::core::array> make(
    const mlx::core::Shape& shape, typename Op::Params p, std::vector<mlx::core::array> inputs) {
  if (!views_fit({shape}, inputs)) return std::nullopt;
  auto stream = mlx::core::default_stream(mlx::core::Device::cpu);
  return mlx::core::array(shape, mlx::core::float32, std::make_shared<CpuPrimitive<Op>>(stream, p), std::move(inputs));
}

// The outputs of a several-output `Op` on `inputs` (siblings of one node), on the CPU stream;
// nullopt where a View cannot hold them.
template <class Op>
std::optional<std::vector<mlx::core::array>> make_many(
    std::vector<mlx::core::Shape> shapes, typename Op::Params p, std::vector<mlx::core::array> inputs,
    std::vector<mlx::core::Dtype> dtypes = {}) {
  if (!views_fit(shapes, inputs)) return std::nullopt;
  auto stream = mlx::core::default_stream(mlx::core::Device::cpu);
  // Float32 unless said otherwise (a cache write's buffers keep the cache's type).
  dtypes.resize(shapes.size(), mlx::core::float32);
  return mlx::core::array::make_arrays(
      std::move(shapes), dtypes, std::make_shared<CpuPrimitive<Op>>(stream, p), std::move(inputs));
}

using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                       float, float*, int);

// The process's cblas_sgemm (OpenBLAS, loaded ahead of MLX's reference BLAS), or null.
inline Sgemm sgemm() {
  static const Sgemm f = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return f;
}

// Rows of x from which dequantizing tiles for sgemm beats reading packed weights per row.
constexpr int SGEMM_ROWS = 16;

// x [M, K] · Wᵀ into out [M, N] for a packed W [N, K] that `fill(dst, n0, n1, k0, k1)` writes
// as float32 tiles (rows [n0, n1), columns [k0, k1), row-major): tiles of up to K_TILE inputs
// by as many weight rows as fit TILE_BYTES, big enough that sgemm's per-call cost (packing its
// operands) is spread thin, small enough to stay in cache between the dequantization and the
// product; tiles along K accumulate into the output (beta = 1). Measured on E2B's and GLM's
// shapes at 64 and 512 rows against sgemm on the float32 matrix. K_TILE is a multiple of every
// group size and packing unit, so a tile's columns are whole groups.
constexpr int K_TILE = 2048;
constexpr size_t TILE_BYTES = 8 << 20;

// The calling thread's buffer for dequantized tiles, at least n floats, kept between calls and
// not initialised (every element a product reads is written first): a zeroed vector of up to
// TILE_BYTES each call cost up to a third of a 64-row product. Tiled products do not nest.
inline float* tile_buffer(size_t n) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local size_t size = 0;
  if (n > size) {
    buf.reset(new float[n]);
    size = n;
  }
  return buf.get();
}

// `unit`: the rows fill takes at a time (a matrix's rows come in panels of that many, N a
// multiple of it); tiles and the threads' shares of them are whole units.
template <class Fill>
void tiled_product(const float* x, float* out, int M, int N, int K, const Fill& fill, int unit = 1) {
  const int kt = std::min(K, K_TILE);
  const int fit = std::max(16, std::min(N, (int)(TILE_BYTES / (sizeof(float) * kt))));
  const int block = std::max(unit, fit / unit * unit);
  float* const buf = tile_buffer((size_t)block * kt);
  for (int n0 = 0; n0 < N; n0 += block) {
    const int n1 = std::min(N, n0 + block), rows = n1 - n0;
    for (int k0 = 0; k0 < K; k0 += kt) {
      const int k1 = std::min(K, k0 + kt), cols = k1 - k0;
      for_rows(rows / unit, 1, [&](size_t u0, size_t u1) {
        fill(buf + u0 * unit * cols, n0 + (int)u0 * unit, n0 + (int)u1 * unit, k0, k1);
      });
      // Row-major (101), x[:, k0:k1] · tileᵀ (NoTrans 111, Trans 112) into out[:, n0:n1].
      sgemm()(101, 111, 112, M, rows, cols, 1.0f, x + k0, K, buf, cols, k0 == 0 ? 0.0f : 1.0f,
              out + n0, N);
    }
  }
}

// A gathered product's row blocks by expert: block b of x (M rows) times expert ids[b] of E
// into out's block b (M rows of N). With one row per block, consecutive blocks of the same
// expert (MLX sorts them for prefill) are one call `f(e, b, run)` covering `run` blocks, so an
// expert's weights are read once per run rather than once per token. An id past the stack
// gives zeros, as no expert contributes.
template <class F>
void expert_runs(const uint32_t* ids, int B, int M, int N, int E, float* out, const F& f) {
  int b = 0;
  while (b < B) {
    const uint32_t e = ids[b];
    int run = 1;
    if (M == 1)
      while (b + run < B && ids[b + run] == e) ++run;
    if (e >= (uint32_t)E)
      std::memset(out + (size_t)b * M * N, 0, sizeof(float) * (size_t)run * M * N);
    else
      f((int)e, b, run);
    b += run;
  }
}

// x [..., K] (row-major) times each of n packed matrices (mats: w, scales and, in MLX's affine
// mode (0), biases per matrix, 2-D or all as panels, one format) into outs[i] [..., N_i],
// row-major: the quantized kernels' products of one x, prepared once and, for few rows,
// computed in one pass over the pool (qmm_cpu.cc).
void quantized_products(
    const View& x, const View* mats, size_t n, int group, int bits, int mode, bool panels, float* const* outs);

}  // namespace mlxr
