// See shim.h. Kept deliberately thin: argument translation only, no policy.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/lib.rs.h"
#include "mlx-sys/src/qmm_cpu.h"
#include "mlx-sys/src/fpq_cpu.h"
#include "mlx-sys/src/fused_cpu.h"
#include "mlx-sys/src/qpanel_cpu.h"

#include <dlfcn.h>

#include "mlx/primitives.h"

#include <cstring>
#include <map>
#include <unordered_set>
#include <optional>
#include <stdexcept>
#include <string>

#ifdef MLXR_OPENBLAS_WHEEL
extern "C" const char* mlxr_blas_config(void);

namespace {
// As below, for the forwarder to the wheel's OpenBLAS (crates/mlx-sys/src/blas_forward.c).
[[maybe_unused]] const char* const openblas_anchor = mlxr_blas_config();
}  // namespace
#endif

#ifdef MLXR_OPENBLAS
extern "C" char* openblas_get_config(void);

namespace {
// Referenced from a static initializer so that the linker keeps libopenblas among the NEEDED
// entries of every binary that links this shim, even under --as-needed and --gc-sections: the
// loader then binds MLX's cblas_sgemm to OpenBLAS rather than the bundled reference BLAS.
[[maybe_unused]] const char* const openblas_anchor = openblas_get_config();
}  // namespace
#endif

namespace mx = mlx::core;

namespace mlxr {

namespace {

mx::Dtype to_dtype(uint8_t code) {
  using V = mx::Dtype::Val;
  switch (static_cast<V>(code)) {
    case V::bool_: return mx::bool_;
    case V::uint8: return mx::uint8;
    case V::uint16: return mx::uint16;
    case V::uint32: return mx::uint32;
    case V::uint64: return mx::uint64;
    case V::int8: return mx::int8;
    case V::int16: return mx::int16;
    case V::int32: return mx::int32;
    case V::int64: return mx::int64;
    case V::float16: return mx::float16;
    case V::float32: return mx::float32;
    case V::float64: return mx::float64;
    case V::bfloat16: return mx::bfloat16;
    case V::complex64: return mx::complex64;
  }
  throw std::invalid_argument("[mlx-runner] unknown dtype code " + std::to_string(code));
}

mx::Shape to_shape(I32s s) {
  return mx::Shape(s.begin(), s.end());
}

std::vector<int> to_ints(I32s s) {
  return std::vector<int>(s.begin(), s.end());
}

ArrPtr wrap(mx::array a) {
  return std::make_unique<Arr>(std::move(a));
}

std::unique_ptr<ArrVec> wrap_vec(std::vector<mx::array> v) {
  auto out = std::make_unique<ArrVec>();
  out->v = std::move(v);
  return out;
}

// A scalar converted to `dt` on the host: a constant, not an astype node in the graph.
mx::array host_scalar(double v, mx::Dtype dt) {
  return mx::array(v, dt);
}

std::optional<mx::array> opt(const Arr* p) {
  if (p == nullptr) {
    return std::nullopt;
  }
  return p->a;
}

}  // namespace

// --- library ---------------------------------------------------------------------------------

rust::String version() {
  return rust::String(mx::version());
}

rust::String blas_library() {
  // Which shared object the dynamic loader binds `cblas_sgemm` to: libmlx resolves it through
  // the same global search order, so this is the BLAS that serves MLX's float32 matmuls.
  void* sym = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  if (sym == nullptr) {
    return rust::String("none (cblas_sgemm not found)");
  }
  Dl_info info;
  if (dladdr(sym, &info) == 0 || info.dli_fname == nullptr) {
    return rust::String("unknown");
  }
  std::string name(info.dli_fname);
  if (name.size() >= 15 && name.compare(name.size() - 15, 15, "libmlxr_blas.so") == 0) {
    // Our forwarder: say what it forwards to.
    name += " -> libscipy_openblas.so";
  }
  return rust::String(name);
}

rust::String openblas_config() {
#if defined(MLXR_OPENBLAS)
  const char* c = openblas_get_config();
  return rust::String(c ? c : "");
#elif defined(MLXR_OPENBLAS_WHEEL)
  const char* c = mlxr_blas_config();
  return rust::String(std::string(c ? c : "") + " (scipy-openblas wheel)");
#else
  return rust::String("");
#endif
}

void set_blas_threads(int n) {
  // Looked up rather than linked: the system's OpenBLAS and the scipy-openblas wheel name it
  // differently, and the wheel's forwarder library is shared between checkouts (one built
  // before this call existed must still serve). A BLAS with neither has no threads to set.
  for (const char* name : {"openblas_set_num_threads", "scipy_openblas_set_num_threads"}) {
    if (auto set = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, name))) {
      set(n);
      return;
    }
  }
}

bool gpu_available() {
  return mx::is_available(mx::Device::gpu);
}

void set_default_device(bool gpu) {
  mx::set_default_device(gpu ? mx::Device::gpu : mx::Device::cpu);
}

bool default_device_is_gpu() {
  return mx::default_device() == mx::Device::gpu;
}

void init_thread() {
  // MLX keeps default streams per thread; a thread that did not create MLX's first stream must
  // make its own before it builds any array (docs/BUILD.md §5, "Threads").
  auto dev = mx::default_device();
  if (!mx::peek_default_stream(dev).has_value()) {
    mx::set_default_stream(mx::new_stream(dev));
  }
}

void synchronize() {
  mx::synchronize();
}

rust::String graph_ops(const ArrVec& v) {
  std::map<std::string, size_t> counts;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<mx::array> todo(v.v.begin(), v.v.end());
  while (!todo.empty()) {
    auto a = std::move(todo.back());
    todo.pop_back();
    if (a.is_available() || !a.has_primitive() || !seen.insert(a.id()).second) continue;
    // Siblings (outputs of one multi-output primitive) are one run of it.
    for (auto& s : a.siblings()) seen.insert(s.id());
    counts[a.primitive().name()] += 1;
    for (auto& in : a.inputs()) todo.push_back(in);
  }
  std::string out;
  for (auto& [name, n] : counts) out += name + " " + std::to_string(n) + "\n";
  return rust::String(out);
}

// --- memory ----------------------------------------------------------------------------------

size_t active_memory() { return mx::get_active_memory(); }
size_t peak_memory() { return mx::get_peak_memory(); }
size_t cache_memory() { return mx::get_cache_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t memory_limit() { return mx::get_memory_limit(); }
size_t set_memory_limit(size_t bytes) { return mx::set_memory_limit(bytes); }
size_t set_cache_limit(size_t bytes) { return mx::set_cache_limit(bytes); }
void clear_cache() { mx::clear_cache(); }

// --- construction and read-back --------------------------------------------------------------

ArrPtr from_bytes(rust::Slice<const uint8_t> data, I32s shape, uint8_t dtype) {
  auto dt = to_dtype(dtype);
  auto sh = to_shape(shape);
  size_t n = 1;
  for (auto d : sh) {
    if (d < 0) {
      throw std::invalid_argument("[from_bytes] negative dimension in shape");
    }
    n *= static_cast<size_t>(d);
  }
  if (n * dt.size() != data.size()) {
    throw std::invalid_argument(
        "[from_bytes] " + std::to_string(data.size()) + " bytes do not fill a shape of " +
        std::to_string(n) + " elements of " + std::to_string(dt.size()) + " bytes");
  }
  auto buf = mx::allocator::malloc(data.size());
  if (data.size() > 0) {
    std::memcpy(buf.buffer().raw_ptr(), data.data(), data.size());
  }
  return wrap(mx::array(std::move(buf), std::move(sh), dt));
}

ArrPtr from_external(
    size_t ptr,
    I32s shape,
    uint8_t dtype,
    size_t ctx,
    rust::Fn<void(size_t)> release) {
  // MLX uses the memory in place where the allocator can (the CPU one can) and calls `release`
  // once it no longer needs it; the Rust side keeps the mapping alive until then.
  return wrap(mx::array(
      reinterpret_cast<void*>(ptr), to_shape(shape), to_dtype(dtype),
      [ctx, release](void*) { release(ctx); }));
}

ArrPtr scalar(double v, uint8_t dtype) {
  return wrap(host_scalar(v, to_dtype(dtype)));
}

ArrPtr full(I32s shape, double v, uint8_t dtype) {
  auto dt = to_dtype(dtype);
  // Build the fill value in the target dtype so that integer and bool fills are exact.
  return wrap(mx::full(to_shape(shape), host_scalar(v, dt), dt));
}

ArrPtr full_like(const Arr& a, double v) {
  return wrap(mx::full_like(a.a, host_scalar(v, a.a.dtype())));
}

ArrPtr arange(double start, double stop, double step, uint8_t dtype) {
  return wrap(mx::arange(start, stop, step, to_dtype(dtype)));
}

ArrPtr tri(int32_t n, int32_t m, int32_t k, uint8_t dtype) {
  return wrap(mx::tri(n, m, k, to_dtype(dtype)));
}

ArrPtr clone(const Arr& a) {
  return wrap(a.a);
}

rust::Vec<int32_t> shape(const Arr& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.a.shape()) {
    out.push_back(d);
  }
  return out;
}

uint8_t dtype(const Arr& a) {
  return static_cast<uint8_t>(a.a.dtype().val());
}

size_t ndim(const Arr& a) { return a.a.ndim(); }
size_t size(const Arr& a) { return a.a.size(); }
size_t nbytes(const Arr& a) { return a.a.nbytes(); }
size_t id(const Arr& a) { return a.a.id(); }

void eval(const Arr& a) {
  mx::eval({a.a});
}

void eval_all(const ArrVec& v) {
  mx::eval(v.v);
}

void async_eval_all(const ArrVec& v) {
  mx::async_eval(v.v);
}

void copy_to(const Arr& a, rust::Slice<uint8_t> out) {
  if (out.size() != a.a.nbytes()) {
    throw std::invalid_argument("[copy_to] output buffer has the wrong size");
  }
  // Evaluated (or waited for, when an async evaluation already has it) before anything is
  // added to the graph: a Contiguous op on an array in flight would queue behind everything
  // the stream was given since, so reading a token would wait for the next step's forward.
  mx::array c = a.a;
  c.eval();
  if (!c.flags().row_contiguous) {
    c = mx::contiguous(c);
    c.eval();
  }
  if (out.size() > 0) {
    std::memcpy(out.data(), c.data<uint8_t>(), out.size());
  }
}

std::unique_ptr<ArrVec> vec_new() {
  return std::make_unique<ArrVec>();
}

void vec_push(ArrVec& v, const Arr& a) {
  v.v.push_back(a.a);
}

size_t vec_len(const ArrVec& v) {
  return v.v.size();
}

ArrPtr vec_get(const ArrVec& v, size_t i) {
  return wrap(v.v.at(i));
}

// --- element-wise ----------------------------------------------------------------------------

ArrPtr unary(UnaryOp op, const Arr& x) {
  const auto& a = x.a;
  switch (op) {
    case UnaryOp::Abs: return wrap(mx::abs(a));
    case UnaryOp::Negative: return wrap(mx::negative(a));
    case UnaryOp::Sign: return wrap(mx::sign(a));
    case UnaryOp::Exp: return wrap(mx::exp(a));
    case UnaryOp::Log: return wrap(mx::log(a));
    case UnaryOp::Log1p: return wrap(mx::log1p(a));
    case UnaryOp::Sqrt: return wrap(mx::sqrt(a));
    case UnaryOp::Rsqrt: return wrap(mx::rsqrt(a));
    case UnaryOp::Square: return wrap(mx::square(a));
    case UnaryOp::Reciprocal: return wrap(mx::reciprocal(a));
    case UnaryOp::Tanh: return wrap(mx::tanh(a));
    case UnaryOp::Sigmoid: return wrap(mx::sigmoid(a));
    case UnaryOp::Erf: return wrap(mx::erf(a));
    case UnaryOp::Sin: return wrap(mx::sin(a));
    case UnaryOp::Cos: return wrap(mx::cos(a));
    case UnaryOp::Floor: return wrap(mx::floor(a));
    case UnaryOp::Ceil: return wrap(mx::ceil(a));
    case UnaryOp::Round: return wrap(mx::round(a));
    case UnaryOp::LogicalNot: return wrap(mx::logical_not(a));
    case UnaryOp::IsNan: return wrap(mx::isnan(a));
    case UnaryOp::IsInf: return wrap(mx::isinf(a));
    case UnaryOp::StopGradient: return wrap(mx::stop_gradient(a));
    case UnaryOp::Copy: return wrap(mx::copy(a));
    case UnaryOp::Contiguous: return wrap(mx::contiguous(a));
  }
  throw std::invalid_argument("[unary] unknown op");
}

ArrPtr binary(BinaryOp op, const Arr& x, const Arr& y) {
  const auto& a = x.a;
  const auto& b = y.a;
  switch (op) {
    case BinaryOp::Add: return wrap(mx::add(a, b));
    case BinaryOp::Subtract: return wrap(mx::subtract(a, b));
    case BinaryOp::Multiply: return wrap(mx::multiply(a, b));
    case BinaryOp::Divide: return wrap(mx::divide(a, b));
    case BinaryOp::FloorDivide: return wrap(mx::floor_divide(a, b));
    case BinaryOp::Remainder: return wrap(mx::remainder(a, b));
    case BinaryOp::Power: return wrap(mx::power(a, b));
    case BinaryOp::Maximum: return wrap(mx::maximum(a, b));
    case BinaryOp::Minimum: return wrap(mx::minimum(a, b));
    case BinaryOp::Equal: return wrap(mx::equal(a, b));
    case BinaryOp::NotEqual: return wrap(mx::not_equal(a, b));
    case BinaryOp::Less: return wrap(mx::less(a, b));
    case BinaryOp::LessEqual: return wrap(mx::less_equal(a, b));
    case BinaryOp::Greater: return wrap(mx::greater(a, b));
    case BinaryOp::GreaterEqual: return wrap(mx::greater_equal(a, b));
    case BinaryOp::LogicalAnd: return wrap(mx::logical_and(a, b));
    case BinaryOp::LogicalOr: return wrap(mx::logical_or(a, b));
    case BinaryOp::LogAddExp: return wrap(mx::logaddexp(a, b));
  }
  throw std::invalid_argument("[binary] unknown op");
}

ArrPtr where_(const Arr& cond, const Arr& x, const Arr& y) {
  return wrap(mx::where(cond.a, x.a, y.a));
}

ArrPtr astype(const Arr& a, uint8_t dtype) {
  return wrap(mx::astype(a.a, to_dtype(dtype)));
}

ArrPtr from_fp8(const Arr& a, uint8_t dtype) {
  return wrap(mx::from_fp8(a.a, to_dtype(dtype)));
}

ArrPtr view(const Arr& a, uint8_t dtype) {
  return wrap(mx::view(a.a, to_dtype(dtype)));
}

ArrPtr clip(const Arr& a, const Arr* lo, const Arr* hi) {
  return wrap(mx::clip(a.a, opt(lo), opt(hi)));
}

// --- shape -----------------------------------------------------------------------------------

ArrPtr reshape(const Arr& a, I32s shape) { return wrap(mx::reshape(a.a, to_shape(shape))); }
ArrPtr transpose(const Arr& a, I32s axes) { return wrap(mx::transpose(a.a, to_ints(axes))); }
ArrPtr swapaxes(const Arr& a, int32_t a1, int32_t a2) { return wrap(mx::swapaxes(a.a, a1, a2)); }
ArrPtr expand_dims(const Arr& a, I32s axes) { return wrap(mx::expand_dims(a.a, to_ints(axes))); }
ArrPtr squeeze(const Arr& a, I32s axes) { return wrap(mx::squeeze(a.a, to_ints(axes))); }
ArrPtr flatten(const Arr& a, int32_t start, int32_t end) {
  return wrap(mx::flatten(a.a, start, end));
}
ArrPtr broadcast_to(const Arr& a, I32s shape) {
  return wrap(mx::broadcast_to(a.a, to_shape(shape)));
}
ArrPtr concatenate(const ArrVec& v, int32_t axis) { return wrap(mx::concatenate(v.v, axis)); }
ArrPtr stack(const ArrVec& v, int32_t axis) { return wrap(mx::stack(v.v, axis)); }
std::unique_ptr<ArrVec> split_sections(const Arr& a, int32_t n, int32_t axis) {
  return wrap_vec(mx::split(a.a, n, axis));
}
std::unique_ptr<ArrVec> split_indices(const Arr& a, I32s indices, int32_t axis) {
  return wrap_vec(mx::split(a.a, to_shape(indices), axis));
}
ArrPtr repeat(const Arr& a, int32_t repeats, int32_t axis) {
  return wrap(mx::repeat(a.a, repeats, axis));
}
ArrPtr tile(const Arr& a, I32s reps) { return wrap(mx::tile(a.a, to_ints(reps))); }
ArrPtr pad(const Arr& a, I32s axes, I32s lo, I32s hi, double value) {
  return wrap(mx::pad(
      a.a, to_ints(axes), to_shape(lo), to_shape(hi),
      host_scalar(value, a.a.dtype())));
}

ArrPtr flip(const Arr& a, int32_t axis) { return wrap(mx::flip(a.a, axis)); }

// --- indexing --------------------------------------------------------------------------------

ArrPtr slice(const Arr& a, I32s start, I32s stop, I32s strides) {
  return wrap(mx::slice(a.a, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrPtr slice_dynamic(const Arr& a, const Arr& start, I32s axes, I32s sizes) {
  return wrap(mx::slice(a.a, start.a, to_ints(axes), to_shape(sizes)));
}
ArrPtr slice_update(const Arr& src, const Arr& upd, I32s start, I32s stop, I32s strides) {
  return wrap(mx::slice_update(src.a, upd.a, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrPtr slice_update_dynamic(const Arr& src, const Arr& upd, const Arr& start, I32s axes) {
  return wrap(mx::slice_update(src.a, upd.a, start.a, to_ints(axes)));
}
ArrPtr take(const Arr& a, const Arr& idx, int32_t axis) { return wrap(mx::take(a.a, idx.a, axis)); }
ArrPtr take_flat(const Arr& a, const Arr& idx) { return wrap(mx::take(a.a, idx.a)); }
ArrPtr take_along_axis(const Arr& a, const Arr& idx, int32_t axis) {
  return wrap(mx::take_along_axis(a.a, idx.a, axis));
}
ArrPtr put_along_axis(const Arr& a, const Arr& idx, const Arr& vals, int32_t axis) {
  return wrap(mx::put_along_axis(a.a, idx.a, vals.a, axis));
}
ArrPtr scatter_add_axis(const Arr& a, const Arr& idx, const Arr& vals, int32_t axis) {
  return wrap(mx::scatter_add_axis(a.a, idx.a, vals.a, axis));
}
ArrPtr scatter_add(const Arr& a, const ArrVec& idx, const Arr& upd, I32s axes) {
  return wrap(mx::scatter_add(a.a, idx.v, upd.a, to_ints(axes)));
}
ArrPtr scatter(const Arr& a, const ArrVec& idx, const Arr& upd, I32s axes) {
  return wrap(mx::scatter(a.a, idx.v, upd.a, to_ints(axes)));
}

// --- reductions, scans, sorting --------------------------------------------------------------

ArrPtr reduce(ReduceOp op, const Arr& x, I32s axes_, bool keepdims) {
  const auto& a = x.a;
  auto axes = to_ints(axes_);
  switch (op) {
    case ReduceOp::Sum: return wrap(mx::sum(a, axes, keepdims));
    case ReduceOp::Mean: return wrap(mx::mean(a, axes, keepdims));
    case ReduceOp::Max: return wrap(mx::max(a, axes, keepdims));
    case ReduceOp::Min: return wrap(mx::min(a, axes, keepdims));
    case ReduceOp::Prod: return wrap(mx::prod(a, axes, keepdims));
    case ReduceOp::All: return wrap(mx::all(a, axes, keepdims));
    case ReduceOp::Any: return wrap(mx::any(a, axes, keepdims));
    case ReduceOp::LogSumExp: return wrap(mx::logsumexp(a, axes, keepdims));
  }
  throw std::invalid_argument("[reduce] unknown op");
}

ArrPtr reduce_all(ReduceOp op, const Arr& x, bool keepdims) {
  const auto& a = x.a;
  switch (op) {
    case ReduceOp::Sum: return wrap(mx::sum(a, keepdims));
    case ReduceOp::Mean: return wrap(mx::mean(a, keepdims));
    case ReduceOp::Max: return wrap(mx::max(a, keepdims));
    case ReduceOp::Min: return wrap(mx::min(a, keepdims));
    case ReduceOp::Prod: return wrap(mx::prod(a, keepdims));
    case ReduceOp::All: return wrap(mx::all(a, keepdims));
    case ReduceOp::Any: return wrap(mx::any(a, keepdims));
    case ReduceOp::LogSumExp: return wrap(mx::logsumexp(a, keepdims));
  }
  throw std::invalid_argument("[reduce_all] unknown op");
}

ArrPtr argmax(const Arr& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmax(a.a, axis, keepdims));
}
ArrPtr argmin(const Arr& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmin(a.a, axis, keepdims));
}
ArrPtr softmax(const Arr& a, I32s axes, bool precise) {
  return wrap(mx::softmax(a.a, to_ints(axes), precise));
}
ArrPtr cumsum(const Arr& a, int32_t axis, bool reverse, bool inclusive) {
  return wrap(mx::cumsum(a.a, axis, reverse, inclusive));
}
ArrPtr cummax(const Arr& a, int32_t axis, bool reverse, bool inclusive) {
  return wrap(mx::cummax(a.a, axis, reverse, inclusive));
}
ArrPtr sort(const Arr& a, int32_t axis) { return wrap(mx::sort(a.a, axis)); }
ArrPtr argsort(const Arr& a, int32_t axis) { return wrap(mx::argsort(a.a, axis)); }
ArrPtr partition(const Arr& a, int32_t kth, int32_t axis) {
  return wrap(mx::partition(a.a, kth, axis));
}
ArrPtr argpartition(const Arr& a, int32_t kth, int32_t axis) {
  return wrap(mx::argpartition(a.a, kth, axis));
}
ArrPtr topk(const Arr& a, int32_t k, int32_t axis) { return wrap(mx::topk(a.a, k, axis)); }

// --- linear algebra and quantization ---------------------------------------------------------

ArrPtr matmul(const Arr& a, const Arr& b) {
  if (auto out = cpu_matmul(a.a, b.a)) return wrap(std::move(*out));
  return wrap(mx::matmul(a.a, b.a));
}

// x @ W for W held as column panels [N / 32, K, 32]; without the kernel, MLX's product of x's
// rows with every panel ([P, M, 32]), laid out as [.., N]: only the output is rearranged, never
// the weight.
ArrPtr panel_matmul(const Arr& x, const Arr& panels) {
  if (auto out = cpu_panel_matmul(x.a, panels.a)) return wrap(std::move(*out));
  const auto& p = panels.a;
  const int K = p.shape(1), N = p.shape(0) * p.shape(2);
  auto rows = mx::reshape(x.a, {-1, K});
  auto y = mx::transpose(mx::matmul(rows, p), {1, 0, 2});
  auto shape = x.a.shape();
  shape.back() = N;
  return wrap(mx::reshape(y, shape));
}

ArrPtr addmm(const Arr& c, const Arr& a, const Arr& b, float alpha, float beta) {
  return wrap(mx::addmm(c.a, a.a, b.a, alpha, beta));
}

ArrPtr gather_mm(const Arr& a, const Arr& b, const Arr* lhs, const Arr* rhs, bool sorted) {
  return wrap(mx::gather_mm(a.a, b.a, opt(lhs), opt(rhs), sorted));
}

namespace {
// MLX's name of a mode code (QuantMode's order on the Rust side).
std::string mode_name(int32_t mode) {
  switch (mode) {
    case 0: return "affine";
    case 1: return "mxfp4";
    case 2: return "nvfp4";
    case 3: return "mxfp8";
    default: throw std::invalid_argument("unknown quantization mode " + std::to_string(mode));
  }
}

// A mode code with this bit set is an affine matrix held as 16-output panels (qpanel_cpu.h,
// mlx::Quantized's `panels`). The ops below take the code as it comes, split it for the
// kernels, and hand it on whole to the unfused ops they stand for.
constexpr int32_t kPanelsBit = 0x100;
struct ModeCode {
  int32_t mode;  // MLX's quantization mode
  bool panels;
};
ModeCode split_mode(int32_t code) {
  return {code & ~kPanelsBit, (code & kPanelsBit) != 0};
}

// A paneled matrix's words, scales or biases ([N/16, ·, 16]) in MLX's row layout ([N, ·]), for
// MLX's own ops where the panel kernels do not apply.
Arr panel_rows(const mx::array& a) {
  return Arr{mx::reshape(mx::transpose(a, {0, 2, 1}), {a.shape(0) * a.shape(2), a.shape(1)})};
}
}  // namespace

std::unique_ptr<ArrVec> quantize(const Arr& w, int32_t group_size, int32_t bits, int32_t mode) {
  return wrap_vec(mx::quantize(w.a, group_size, bits, mode_name(mode)));
}

ArrPtr dequantize(
    const Arr& w,
    const Arr& scales,
    const Arr* biases,
    int32_t group_size,
    int32_t bits,
    int32_t code) {
  const auto [mode, panels] = split_mode(code);
  if (auto out = mode == 0 ? cpu_dequantize(w.a, scales.a, opt(biases), group_size, bits, panels)
                           : cpu_fp_dequantize(w.a, scales.a, group_size, bits, mode)) {
    return wrap(std::move(*out));
  }
  if (panels && biases) {
    const Arr rb = panel_rows(biases->a);
    return dequantize(panel_rows(w.a), panel_rows(scales.a), &rb, group_size, bits, mode);
  }
  return wrap(mx::dequantize(w.a, scales.a, opt(biases), group_size, bits, mode_name(mode)));
}

ArrPtr quantized_matmul(
    const Arr& x,
    const Arr& w,
    const Arr& scales,
    const Arr* biases,
    bool transpose,
    int32_t group_size,
    int32_t bits,
    int32_t code) {
  const auto [mode, panels] = split_mode(code);
  if (auto out = mode == 0
                     ? cpu_quantized_matmul(x.a, w.a, scales.a, opt(biases), transpose, group_size, bits, panels)
                     : cpu_fp_quantized_matmul(x.a, w.a, scales.a, transpose, group_size, bits, mode)) {
    return wrap(std::move(*out));
  }
  if (panels && biases) {
    const Arr rb = panel_rows(biases->a);
    return quantized_matmul(x, panel_rows(w.a), panel_rows(scales.a), &rb, transpose, group_size, bits, mode);
  }
  return wrap(mx::quantized_matmul(
      x.a, w.a, scales.a, opt(biases), transpose, group_size, bits, mode_name(mode)));
}

std::unique_ptr<ArrVec> quantized_matmuls(
    const Arr& x,
    const ArrVec& w,
    const ArrVec& scales,
    const ArrVec& biases,
    int32_t group_size,
    int32_t bits,
    int32_t code) {
  const auto [mode, panels] = split_mode(code);
  // Affine matrices have biases, the microscaling modes none.
  const size_t with_biases = mode == 0 ? w.v.size() : 0;
  if (w.v.size() != scales.v.size() || biases.v.size() != with_biases) {
    throw std::invalid_argument("quantized_matmuls: weights, scales and biases differ in number");
  }
  if (auto outs = cpu_quantized_matmuls(x.a, w.v, scales.v, biases.v, group_size, bits, mode, panels)) {
    return wrap_vec(std::move(*outs));
  }
  std::vector<mx::array> outs;
  for (size_t i = 0; i < w.v.size(); ++i) {
    Arr wi{w.v[i]}, si{scales.v[i]};
    std::optional<Arr> bi;
    if (mode == 0) bi.emplace(Arr{biases.v[i]});
    // Each through quantized_matmul, which takes the panels' code.
    outs.push_back(quantized_matmul(x, wi, si, bi ? &*bi : nullptr, true, group_size, bits, code)->a);
  }
  return wrap_vec(std::move(outs));
}

ArrPtr silu_mul(const Arr& g, const Arr& u) {
  if (auto out = cpu_silu_mul(g.a, u.a)) return wrap(std::move(*out));
  return wrap(mx::multiply(mx::multiply(g.a, mx::sigmoid(g.a)), u.a));
}

ArrPtr sigmoid_mul(const Arr& g, const Arr& u) {
  if (auto out = cpu_silu_mul(g.a, u.a, false)) return wrap(std::move(*out));
  return wrap(mx::multiply(mx::sigmoid(g.a), u.a));
}

ArrPtr quantized_glu(
    const Arr& x,
    const Arr& gate_w,
    const Arr& gate_scales,
    const Arr* gate_biases,
    const Arr& up_w,
    const Arr& up_scales,
    const Arr* up_biases,
    int32_t group_size,
    int32_t bits,
    uint8_t act,
    int32_t code) {
  if (act > 1) throw std::invalid_argument("quantized_glu: unknown activation");
  const auto a = static_cast<GluAct>(act);
  const auto [mode, panels] = split_mode(code);
  if (auto out = cpu_quantized_glu(x.a, gate_w.a, gate_scales.a, opt(gate_biases), up_w.a,
                                   up_scales.a, opt(up_biases), group_size, bits, a, mode, panels)) {
    return wrap(std::move(*out));
  }
  // The ops the fused kernel stands for, each through its own kernel where that applies.
  auto gate = quantized_matmul(x, gate_w, gate_scales, gate_biases, true, group_size, bits, code);
  auto up = quantized_matmul(x, up_w, up_scales, up_biases, true, group_size, bits, code);
  if (a == GluAct::Silu) return silu_mul(*gate, *up);
  return wrap(mx::multiply(gelu_tanh(*gate)->a, up->a));
}

void set_quantized_kernel(bool on) {
  set_cpu_qmm_enabled(on);
}

bool quantized_panels_apply(int32_t bits, int32_t group_size) {
  return qpanel_applies(bits, group_size);
}

void set_quantized_unpacking(int32_t mode) {
  set_cpu_qmm_unpacking(mode);
}

int32_t quantized_unpacking() {
  return cpu_qmm_unpacking();
}

uint64_t quantized_kernel_count(bool sgemm_path) {
  return cpu_qmm_count(sgemm_path);
}

ArrPtr gather_qmm(
    const Arr& x,
    const Arr& w,
    const Arr& scales,
    const Arr* biases,
    const Arr* lhs,
    const Arr* rhs,
    bool transpose,
    int32_t group_size,
    int32_t bits,
    int32_t mode,
    bool sorted) {
  if (auto out = mode == 0 ? cpu_gather_qmm(x.a, w.a, scales.a, opt(biases), opt(lhs), opt(rhs),
                                            transpose, group_size, bits)
                           : cpu_fp_gather_qmm(x.a, w.a, scales.a, opt(lhs), opt(rhs), transpose,
                                               group_size, bits, mode)) {
    return wrap(std::move(*out));
  }
  return wrap(mx::gather_qmm(
      x.a, w.a, scales.a, opt(biases), opt(lhs), opt(rhs), transpose, group_size, bits,
      mode_name(mode), std::nullopt, sorted));
}

// --- fast --------------------------------------------------------------------------------------

ArrPtr rms_norm(const Arr& x, const Arr* w, float eps) {
  if (auto out = cpu_rms_norm(x.a, opt(w), eps)) return wrap(std::move(*out));
  return wrap(mx::fast::rms_norm(x.a, opt(w), eps));
}

ArrPtr rms_norm_residual(const Arr& x, const Arr* w, float eps, const Arr& residual, const Arr* scale) {
  if (auto out = cpu_rms_norm_residual(x.a, opt(w), eps, residual.a, opt(scale))) {
    return wrap(std::move(*out));
  }
  auto sum = mx::add(residual.a, rms_norm(x, w, eps)->a);
  return wrap(scale ? mx::multiply(sum, scale->a) : sum);
}

ArrPtr quantized_embedding(
    const Arr& ids,
    const Arr& w,
    const Arr& scales,
    const Arr& biases,
    int32_t group_size,
    int32_t bits,
    int32_t code,
    float scale,
    bool has_scale) {
  const std::optional<float> s = has_scale ? std::optional<float>(scale) : std::nullopt;
  const auto [mode, panels] = split_mode(code);
  if (auto out = cpu_quantized_embedding(ids.a, w.a, scales.a, biases.a, group_size, bits, s, panels)) {
    return wrap(std::move(*out));
  }
  if (panels)
    return quantized_embedding(ids, panel_rows(w.a), panel_rows(scales.a), panel_rows(biases.a), group_size, bits,
                               mode, scale, has_scale);
  const Arr rw{mx::take(w.a, ids.a, 0)}, rs{mx::take(scales.a, ids.a, 0)}, rb{mx::take(biases.a, ids.a, 0)};
  auto rows = dequantize(rw, rs, &rb, group_size, bits, 0);
  return has_scale ? wrap(mx::multiply(rows->a, mx::array(scale, mx::float32))) : std::move(rows);
}

std::unique_ptr<ArrVec> quantized_matmul_norm(
    const Arr& x,
    const Arr& w,
    const Arr& scales,
    const Arr* biases,
    int32_t group_size,
    int32_t bits,
    int32_t code,
    const Arr* norm_w,
    float eps,
    const Arr& residual,
    const Arr* scale,
    const Arr* next_w) {
  const auto [mode, panels] = split_mode(code);
  if (auto outs = cpu_quantized_matmul_norm(x.a, w.a, scales.a, opt(biases), group_size, bits, mode,
                                            opt(norm_w), eps, residual.a, opt(scale), opt(next_w), panels)) {
    return wrap_vec(std::move(*outs));
  }
  auto y = quantized_matmul(x, w, scales, biases, true, group_size, bits, code);
  if (!next_w) return wrap_vec({rms_norm_residual(*y, norm_w, eps, residual, scale)->a});
  return rms_norm_residual_norm(*y, norm_w, eps, residual, scale, *next_w);
}

std::unique_ptr<ArrVec> rms_norm_residual_norm(
    const Arr& x, const Arr* w, float eps, const Arr& residual, const Arr* scale, const Arr& next_w) {
  if (auto outs = cpu_rms_norm_residual_norm(x.a, opt(w), eps, residual.a, opt(scale), next_w.a)) {
    return wrap_vec(std::move(*outs));
  }
  auto sum = rms_norm_residual(x, w, eps, residual, scale);
  auto normed = rms_norm(*sum, &next_w, eps);
  return wrap_vec({sum->a, normed->a});
}

ArrPtr layer_norm(const Arr& x, const Arr* w, const Arr* b, float eps) {
  return wrap(mx::fast::layer_norm(x.a, opt(w), opt(b), eps));
}

namespace {
// RoPE at an array offset (MLX's integer-offset overload wraps its offset the same way).
ArrPtr rope_at(const mx::array& x, const Rotation& r, const mx::array& offset, const Arr* freqs) {
  std::optional<float> b = r.has_base ? std::optional<float>(r.base) : std::nullopt;
  if (auto out = cpu_rope(x, r.dims, r.traditional, b, r.scale, offset, opt(freqs)))
    return wrap(std::move(*out));
  return wrap(mx::fast::rope(x, r.dims, r.traditional, b, r.scale, offset, opt(freqs)));
}

// The rotation of the heads kernels (a base only with has_base).
HeadsRope heads_rope(const Rotation& r, const Arr* freqs) {
  return {r.dims, r.traditional, r.has_base ? std::optional<float>(r.base) : std::nullopt, r.scale, opt(freqs)};
}
}  // namespace

ArrPtr rope(const Arr& x, const Rotation& rotation, int32_t offset, const Arr* freqs) {
  return rope_at(x.a, rotation, mx::array(offset, mx::int32), freqs);
}

ArrPtr rope_dynamic(const Arr& x, const Rotation& rotation, const Arr& offset, const Arr* freqs) {
  return rope_at(x.a, rotation, offset.a, freqs);
}

ArrPtr heads_norm_rope(
    const Arr& y,
    int32_t heads,
    const Arr* w,
    float eps,
    bool rotate,
    const Rotation& rotation,
    const Arr& offsets,
    const Arr* freqs) {
  std::optional<HeadsRope> rope;
  if (rotate) rope = heads_rope(rotation, freqs);
  if (auto out = cpu_heads_norm_rope(y.a, heads, opt(w), eps, rope, offsets.a)) return wrap(std::move(*out));
  // The ops it stands for.
  const int d = y.a.shape(-1) / std::max(1, heads);
  const int T = (int)(y.a.size() / std::max(1, y.a.shape(-1)));
  auto normed = rms_norm(Arr{mx::reshape(y.a, {T, heads, 1, d})}, w, eps);
  if (!rotate) return normed;
  return rope_at(normed->a, rotation, offsets.a, freqs);
}

std::unique_ptr<ArrVec> qkv_heads(
    const Arr& q,
    const Arr& k,
    const Arr& v,
    const QkvHeads& heads,
    const Arr& q_norm,
    const Arr& k_norm,
    const Rotation& rotation,
    const Arr& offsets,
    const Arr* freqs) {
  const HeadsRope rope = heads_rope(rotation, freqs);
  if (auto outs = cpu_qkv_heads(
          q.a, k.a, v.a, heads.q_heads, heads.kv_heads, q_norm.a, k_norm.a, heads.eps, rope, offsets.a)) {
    return wrap_vec(std::move(*outs));
  }
  // The three ops it stands for.
  auto qo = heads_norm_rope(q, heads.q_heads, &q_norm, heads.eps, true, rotation, offsets, freqs);
  auto ko = heads_norm_rope(k, heads.kv_heads, &k_norm, heads.eps, true, rotation, offsets, freqs);
  auto vo = heads_norm_rope(v, heads.kv_heads, nullptr, heads.eps, false, rotation, offsets, freqs);
  return wrap_vec({qo->a, ko->a, vo->a});
}

std::unique_ptr<ArrVec> quantized_qkv_heads(
    const Arr& x,
    const ArrVec& w,
    const ArrVec& scales,
    const ArrVec& biases,
    int32_t group_size,
    int32_t bits,
    int32_t code,
    const QkvHeads& heads,
    const Arr& q_norm,
    const Arr& k_norm,
    const Rotation& rotation,
    const Arr& offsets,
    const Arr* freqs) {
  const size_t n = w.v.size();
  const auto [mode, panels] = split_mode(code);
  if ((n != 2 && n != 3) || scales.v.size() != n || biases.v.size() != (mode == 0 ? n : 0)) {
    throw std::invalid_argument(
        "quantized_qkv_heads: takes two or three matrices, each with scales (and biases in affine mode)");
  }
  const HeadsRope rope = heads_rope(rotation, freqs);
  if (auto outs = cpu_quantized_qkv_heads(x.a, w.v, scales.v, biases.v, group_size, bits, mode, panels,
                                          heads.q_heads, heads.kv_heads, q_norm.a, k_norm.a, heads.eps, rope,
                                          offsets.a)) {
    return wrap_vec(std::move(*outs));
  }
  // The two ops it stands for.
  auto raw = quantized_matmuls(x, w, scales, biases, group_size, bits, code);
  const Arr q{raw->v[0]}, k{raw->v[1]}, v{raw->v[n == 3 ? 2 : 1]};
  return qkv_heads(q, k, v, heads, q_norm, k_norm, rotation, offsets, freqs);
}

std::unique_ptr<ArrVec> sdpa_slots(
    const Arr& q,
    const ArrVec& k,
    const ArrVec& v,
    int32_t keys,
    const ArrVec& k_new,
    const ArrVec& v_new,
    int32_t write_at,
    int32_t group,
    int32_t bits,
    float scale,
    rust::Str mask_mode,
    const Arr* mask,
    const Arr* sinks,
    bool tokens) {
  const size_t np = bits ? 3 : 1;
  if (k.v.size() != np || v.v.size() != np)
    throw std::invalid_argument("[sdpa_slots] keys and values must each be " + std::to_string(np) + " arrays");
  for (const auto* side : {&k.v, &v.v})
    for (const auto& a : *side)
      if (a.ndim() != 4 || a.shape(2) != k.v[0].shape(2))
        throw std::invalid_argument("[sdpa_slots] keys and values must be [B, H, S, D] buffers of one length");
  const int S = k.v[0].shape(2);
  if (keys < 1 || keys > S)
    throw std::invalid_argument(
        "[sdpa_slots] attention over " + std::to_string(keys) + " slots of a buffer of " + std::to_string(S));
  const bool write = !k_new.v.empty() || !v_new.v.empty();
  if (write && (k_new.v.size() != np || v_new.v.size() != np))
    throw std::invalid_argument("[sdpa_slots] new keys and new values come together, in the buffers' form");
  if (write)
    for (const auto* side : {&k_new.v, &v_new.v})
      for (const auto& a : *side)
        if (a.ndim() != 4 || write_at < 0 || write_at + a.shape(2) > S)
          throw std::invalid_argument(
              "[sdpa_slots] writing rows at slot " + std::to_string(write_at) + " of a buffer of " + std::to_string(S));
  const bool causal = mask_mode == "causal";
  if ((causal && !mask) || (mask_mode == "array" && mask) || (mask_mode.empty() && !mask)) {
    if (auto outs = cpu_sdpa_slots(q.a, k.v, v.v, keys, k_new.v, v_new.v, write_at, group, bits, scale, causal,
                                   opt(mask), opt(sinks), tokens))
      return wrap_vec(std::move(*outs));
  }
  // The graph the kernel stands for: the writes, the views of the slots read, (the
  // dequantization,) attention.
  std::vector<mx::array> kw = k.v, vw = v.v;
  if (write) {
    const int n = k_new.v[0].shape(2);
    auto at = [&](const mx::array& buf, const mx::array& rows) {
      mx::Shape start{0, 0, write_at, 0}, stop = buf.shape();
      stop[2] = write_at + n;
      return mx::slice_update(buf, rows, start, stop);
    };
    for (size_t i = 0; i < np; ++i) {
      kw[i] = at(k.v[i], k_new.v[i]);
      vw[i] = at(v.v[i], v_new.v[i]);
    }
  }
  auto first = [&](const mx::array& buf) {
    if (keys == S) return buf;
    auto stop = buf.shape();
    stop[2] = keys;
    return mx::slice(buf, mx::Shape{0, 0, 0, 0}, stop);
  };
  auto rows = [&](const std::vector<mx::array>& side) {
    if (!bits) return first(side[0]);
    return mx::dequantize(first(side[0]), first(side[1]), std::optional<mx::array>(first(side[2])), group, bits, "affine");
  };
  auto out = mx::fast::scaled_dot_product_attention(
      q.a, rows(kw), rows(vw), scale, std::string(mask_mode), opt(mask), opt(sinks));
  if (tokens) {
    // For one position the two layouts are the same memory: a reshape, no transpose.
    const auto s = out.shape();
    const auto t = s[2] == 1 ? out : mx::transpose(out, {0, 2, 1, 3});
    out = mx::reshape(t, {s[0], s[2], s[1] * s[3]});
  }
  std::vector<mx::array> outs{out};
  if (!write) return wrap_vec(std::move(outs));
  outs.insert(outs.end(), kw.begin(), kw.end());
  outs.insert(outs.end(), vw.begin(), vw.end());
  return wrap_vec(std::move(outs));
}

ArrPtr gelu_tanh(const Arr& x) {
  if (auto out = cpu_gelu_tanh(x.a)) return wrap(std::move(*out));
  // The graph the kernel stands for, in the input's dtype.
  auto t = x.a.dtype();
  const auto& a = x.a;
  auto inner = mx::multiply(
      mx::add(a, mx::multiply(mx::power(a, mx::array(3.0f, t)), mx::array(0.044715f, t))),
      mx::array(0.7978845608028654f, t));
  return wrap(mx::multiply(
      mx::multiply(a, mx::array(0.5f, t)), mx::add(mx::tanh(inner), mx::array(1.0f, t))));
}

ArrPtr softmax_last(const Arr& x) {
  if (auto out = cpu_softmax(x.a)) return wrap(std::move(*out));
  return wrap(mx::softmax(x.a, -1));
}

ArrPtr softcap(const Arr& x, float cap) {
  if (auto out = cpu_softcap(x.a, cap)) return wrap(std::move(*out));
  // The graph the kernel stands for, in the input's dtype.
  auto c = mx::array(cap, x.a.dtype());
  return wrap(mx::multiply(mx::tanh(mx::divide(x.a, c)), c));
}

void set_fused_kernels(bool on) {
  set_fused_cpu_enabled(on);
}

void set_vector_width(int32_t bits) { set_cpu_vector_width(bits); }

uint64_t fused_kernel_count(uint8_t kind) {
  return fused_cpu_count(static_cast<FusedKind>(kind));
}

// --- random ------------------------------------------------------------------------------------

ArrPtr random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }

ArrPtr random_split(const Arr& key, int32_t num) {
  return wrap(mx::random::split(key.a, num));
}

ArrPtr random_uniform(I32s shape, uint8_t dtype, double low, double high, const Arr* key) {
  auto dt = to_dtype(dtype);
  return wrap(mx::random::uniform(
      host_scalar(low, dt), host_scalar(high, dt),
      to_shape(shape), dt, opt(key)));
}

ArrPtr random_normal(I32s shape, uint8_t dtype, double loc, double scale, const Arr* key) {
  auto dt = to_dtype(dtype);
  return wrap(mx::random::normal(
      to_shape(shape), dt, host_scalar(loc, dt),
      host_scalar(scale, dt), opt(key)));
}

ArrPtr random_randint(I32s shape, uint8_t dtype, int64_t low, int64_t high, const Arr* key) {
  return wrap(mx::random::randint(
      mx::array(low, mx::int64), mx::array(high, mx::int64), to_shape(shape), to_dtype(dtype),
      opt(key)));
}

ArrPtr random_categorical(const Arr& logits, int32_t axis, int32_t num_samples, const Arr* key) {
  if (num_samples <= 0) {
    return wrap(mx::random::categorical(logits.a, axis, opt(key)));
  }
  return wrap(mx::random::categorical(logits.a, axis, num_samples, opt(key)));
}

ArrPtr random_bernoulli(const Arr& p, I32s shape, bool has_shape, const Arr* key) {
  if (has_shape) {
    return wrap(mx::random::bernoulli(p.a, to_shape(shape), opt(key)));
  }
  return wrap(mx::random::bernoulli(p.a, opt(key)));
}

ArrPtr random_gumbel(I32s shape, uint8_t dtype, const Arr* key) {
  return wrap(mx::random::gumbel(to_shape(shape), to_dtype(dtype), opt(key)));
}

// --- io ----------------------------------------------------------------------------------------

std::unique_ptr<ArrVec> load_safetensors(rust::Str path, rust::Vec<rust::String>& names) {
  auto [arrays, meta] = mx::load_safetensors(std::string(path));
  auto out = std::make_unique<ArrVec>();
  for (auto& [name, arr] : arrays) {
    names.push_back(rust::String(name));
    out->v.push_back(arr);
  }
  return out;
}

void save_safetensors(
    rust::Str path,
    rust::Slice<const rust::String> names,
    const ArrVec& arrays) {
  if (names.size() != arrays.v.size()) {
    throw std::invalid_argument("[save_safetensors] names and arrays differ in length");
  }
  std::unordered_map<std::string, mx::array> m;
  for (size_t i = 0; i < names.size(); ++i) {
    m.insert_or_assign(std::string(names[i]), arrays.v[i]);
  }
  mx::save_safetensors(std::string(path), std::move(m));
}

// --- distributed -------------------------------------------------------------------------------

namespace dist = mx::distributed;

bool distributed_available(rust::Str backend) {
  return dist::is_available(std::string(backend));
}

std::unique_ptr<DistGroup> distributed_init(rust::Str backend) {
  return std::make_unique<DistGroup>(dist::init(true, std::string(backend)));
}

int32_t group_rank(const DistGroup& g) { return g.g.rank(); }
int32_t group_size(const DistGroup& g) { return g.g.size(); }

ArrPtr dist_all_sum(const Arr& x, const DistGroup& g) { return wrap(dist::all_sum(x.a, g.g)); }
ArrPtr dist_all_gather(const Arr& x, const DistGroup& g) {
  return wrap(dist::all_gather(x.a, g.g));
}
ArrPtr dist_send(const Arr& x, int32_t dst, const DistGroup& g) {
  return wrap(dist::send(x.a, dst, g.g));
}
ArrPtr dist_recv(I32s shape, uint8_t dtype, int32_t src, const DistGroup& g) {
  return wrap(dist::recv(to_shape(shape), to_dtype(dtype), src, g.g));
}

}  // namespace mlxr
