// What the CPU kernels (qmm_cpu.cc, fused_cpu.cc) share: one persistent thread pool, the
// AVX2 check, a horizontal sum, reading a strided array densely, and the MLX primitive that
// runs a kernel on the CPU stream.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mlxr {

// The caller and (cores - 1) workers.
class Pool {
 public:
  Pool() {
    unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 1; i < n; ++i) {
      workers_.emplace_back([this, i] { work(i); });
    }
  }

  ~Pool() {
    stop_.store(true);
    bump();
    for (auto& t : workers_) t.join();
  }

  size_t size() const { return workers_.size() + 1; }

  // Runs f(part) for part in [0, size()), the caller taking part 0; returns when all are done.
  // A decode step makes ~100 calls of tens of microseconds each: workers spin briefly on the
  // generation counter before sleeping, so handing out work costs far less than a wake-up.
  void run(const std::function<void(size_t)>& f) {
    if (workers_.empty()) {
      f(0);
      return;
    }
    std::lock_guard<std::mutex> one(run_m_);
    task_ = &f;
    pending_.store(workers_.size());
    bump();
    f(0);
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin > 1000) std::this_thread::yield();
    }
    task_ = nullptr;
  }

 private:
  void work(size_t part) {
    // The generation the pool started at, not whatever it is by the time this thread runs: a
    // first call may already have been handed out.
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      for (int spin = 0;; ++spin) {
        g = generation_.load(std::memory_order_acquire);
        if (g != seen) break;
        // Long enough to span the few small ops between two products of a decode step, short
        // enough not to take a core from MLX's stream thread and the caller for long: on this
        // 2-core machine 2000 pauses gave a 4-bit decode step of 6.0-6.3 ms against 7.0-7.4 ms
        // with 20000 and 7.6-9.1 ms with 200-500 (`cargo bench --bench step`).
        if (spin < 2000) {
          _mm_pause();
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
      (*task_)(part);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
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
  std::atomic<size_t> pending_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

inline Pool& pool() {
  static Pool p;
  return p;
}


// Runs f(r0, r1) over rows [0, n) split across the pool, in at most one part per
// `min_per_part` rows: small jobs stay on the calling thread.
template <class F>
void for_rows(size_t n, size_t min_per_part, const F& f) {
  auto& p = pool();
  const size_t parts = std::min(p.size(), std::max<size_t>(1, n / min_per_part));
  if (parts == 1) {
    f(0, n);
    return;
  }
  p.run([&](size_t part) {
    if (part >= parts) return;
    f(n * part / parts, n * (part + 1) / parts);
  });
}

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// `a` as row-major data: its own buffer when it is one, else a copy into `tmp`.
template <typename T>
const T* dense(const mlx::core::array& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) return a.data<T>();
  tmp.resize(a.size());
  const int nd = a.ndim();
  const T* src = a.data<T>();
  std::vector<int> idx(nd, 0);
  int64_t off = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    tmp[i] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      off += a.strides()[d];
      if (++idx[d] < a.shape(d)) break;
      off -= a.strides()[d] * a.shape(d);
      idx[d] = 0;
    }
  }
  return tmp.data();
}

// An MLX primitive for a CPU kernel `Op` (a `Params` struct with ==, a `name` and a static
// `run(params, inputs, output)`): allocates the float32 output, registers the buffers with the
// CPU stream's encoder and runs `Op::run` there, in stream order, as MLX's own CPU ops do.
template <class Op>
class CpuPrimitive : public mlx::core::Primitive {
 public:
  CpuPrimitive(mlx::core::Stream s, typename Op::Params p) : mlx::core::Primitive(s), p_(p) {}

  void eval_cpu(const std::vector<mlx::core::array>& inputs, std::vector<mlx::core::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    auto& enc = mlx::core::cpu::get_command_encoder(stream());
    std::vector<mlx::core::array> ins;
    for (auto& a : inputs) {
      enc.set_input_array(a);
      ins.push_back(mlx::core::array::unsafe_weak_copy(a));
    }
    enc.set_output_array(out);
    enc.dispatch([ins = std::move(ins), out = mlx::core::array::unsafe_weak_copy(out), p = p_]() mutable {
      Op::run(p, ins, out);
    });
  }

  void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
    throw std::runtime_error(std::string("[mlx-runner] ") + Op::name + " has no GPU path");
  }

  const char* name() const override { return Op::name; }

  bool is_equivalent(const mlx::core::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuPrimitive*>(&other);
    return o && o->p_ == p_;
  }

 private:
  typename Op::Params p_;
};

// The output of `Op` on `inputs`, on the CPU stream.
template <class Op>
mlx::core::array make(const mlx::core::Shape& shape, typename Op::Params p, std::vector<mlx::core::array> inputs) {
  auto stream = mlx::core::default_stream(mlx::core::Device::cpu);
  return mlx::core::array(shape, mlx::core::float32, std::make_shared<CpuPrimitive<Op>>(stream, p), std::move(inputs));
}

}  // namespace mlxr
