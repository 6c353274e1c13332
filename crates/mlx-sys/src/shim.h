// Our C++ shim over MLX's C++ API (docs/ARCHITECTURE.md, D2). Every function here is called through the cxx
// bridge in lib.rs; any C++ exception thrown inside becomes a Rust `Err` carrying MLX's message.
// Optional arrays cross as nullable raw pointers; shapes and axes as slices of i32.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <mlx/mlx.h>

#include "rust/cxx.h"

namespace mlxr {

// Shared with Rust; defined in the bridge's generated header.
struct Rotation;
struct QkvHeads;

struct Arr {
  mlx::core::array a;
  explicit Arr(mlx::core::array x) : a(std::move(x)) {}
};

struct ArrVec {
  std::vector<mlx::core::array> v;
};

enum class UnaryOp : uint8_t;
enum class BinaryOp : uint8_t;
enum class ReduceOp : uint8_t;

using ArrPtr = std::unique_ptr<Arr>;
using I32s = rust::Slice<const int32_t>;

// --- library ---------------------------------------------------------------------------------
rust::String version();
rust::String blas_library();
rust::String openblas_config();
void set_blas_threads(int n);
bool gpu_available();
void set_default_device(bool gpu);
bool default_device_is_gpu();
void init_thread();
void synchronize();
// Primitives still to run in the graphs behind `v`, one line per kind: "name count".
rust::String graph_ops(const ArrVec& v);

// --- memory ----------------------------------------------------------------------------------
size_t active_memory();
size_t peak_memory();
size_t cache_memory();
void reset_peak_memory();
size_t memory_limit();
size_t set_memory_limit(size_t bytes);
size_t set_cache_limit(size_t bytes);
void clear_cache();
// Moves evaluated arrays into one huge-page region (weight_arena.cc); returns the bytes moved.
size_t move_to_huge_pages(const ArrVec& v);
// Bytes of those regions still mapped.
size_t huge_page_bytes();

// --- construction and read-back --------------------------------------------------------------
ArrPtr from_bytes(rust::Slice<const uint8_t> data, I32s shape, uint8_t dtype);
ArrPtr from_external(
    size_t ptr,
    I32s shape,
    uint8_t dtype,
    size_t ctx,
    rust::Fn<void(size_t)> release);
ArrPtr scalar(double v, uint8_t dtype);
ArrPtr full(I32s shape, double v, uint8_t dtype);
ArrPtr full_like(const Arr& a, double v);
ArrPtr arange(double start, double stop, double step, uint8_t dtype);
ArrPtr tri(int32_t n, int32_t m, int32_t k, uint8_t dtype);
ArrPtr clone(const Arr& a);

rust::Vec<int32_t> shape(const Arr& a);
uint8_t dtype(const Arr& a);
size_t ndim(const Arr& a);
size_t size(const Arr& a);
size_t nbytes(const Arr& a);
size_t id(const Arr& a);
void eval(const Arr& a);
void eval_all(const ArrVec& v);
void async_eval_all(const ArrVec& v);
void copy_to(const Arr& a, rust::Slice<uint8_t> out);

std::unique_ptr<ArrVec> vec_new();
void vec_push(ArrVec& v, const Arr& a);
size_t vec_len(const ArrVec& v);
ArrPtr vec_get(const ArrVec& v, size_t i);

// --- element-wise ----------------------------------------------------------------------------
ArrPtr unary(UnaryOp op, const Arr& a);
ArrPtr binary(BinaryOp op, const Arr& a, const Arr& b);
ArrPtr where_(const Arr& cond, const Arr& x, const Arr& y);
ArrPtr astype(const Arr& a, uint8_t dtype);
ArrPtr from_fp8(const Arr& a, uint8_t dtype);
ArrPtr view(const Arr& a, uint8_t dtype);
ArrPtr clip(const Arr& a, const Arr* lo, const Arr* hi);

// --- shape -----------------------------------------------------------------------------------
ArrPtr reshape(const Arr& a, I32s shape);
ArrPtr transpose(const Arr& a, I32s axes);
ArrPtr swapaxes(const Arr& a, int32_t a1, int32_t a2);
ArrPtr expand_dims(const Arr& a, I32s axes);
ArrPtr squeeze(const Arr& a, I32s axes);
ArrPtr flatten(const Arr& a, int32_t start, int32_t end);
ArrPtr broadcast_to(const Arr& a, I32s shape);
ArrPtr concatenate(const ArrVec& v, int32_t axis);
ArrPtr stack(const ArrVec& v, int32_t axis);
std::unique_ptr<ArrVec> split_sections(const Arr& a, int32_t n, int32_t axis);
std::unique_ptr<ArrVec> split_indices(const Arr& a, I32s indices, int32_t axis);
ArrPtr repeat(const Arr& a, int32_t repeats, int32_t axis);
ArrPtr tile(const Arr& a, I32s reps);
ArrPtr pad(const Arr& a, I32s axes, I32s lo, I32s hi, double value);
ArrPtr flip(const Arr& a, int32_t axis);

// --- indexing --------------------------------------------------------------------------------
ArrPtr slice(const Arr& a, I32s start, I32s stop, I32s strides);
ArrPtr slice_dynamic(const Arr& a, const Arr& start, I32s axes, I32s sizes);
ArrPtr slice_update(const Arr& src, const Arr& upd, I32s start, I32s stop, I32s strides);
ArrPtr slice_update_dynamic(const Arr& src, const Arr& upd, const Arr& start, I32s axes);
ArrPtr take(const Arr& a, const Arr& idx, int32_t axis);
ArrPtr take_flat(const Arr& a, const Arr& idx);
ArrPtr take_along_axis(const Arr& a, const Arr& idx, int32_t axis);
ArrPtr put_along_axis(const Arr& a, const Arr& idx, const Arr& vals, int32_t axis);
ArrPtr scatter_add_axis(const Arr& a, const Arr& idx, const Arr& vals, int32_t axis);
ArrPtr scatter_add(const Arr& a, const ArrVec& idx, const Arr& upd, I32s axes);
ArrPtr scatter(const Arr& a, const ArrVec& idx, const Arr& upd, I32s axes);

// --- reductions, scans, sorting --------------------------------------------------------------
ArrPtr reduce(ReduceOp op, const Arr& a, I32s axes, bool keepdims);
ArrPtr reduce_all(ReduceOp op, const Arr& a, bool keepdims);
ArrPtr argmax(const Arr& a, int32_t axis, bool keepdims);
ArrPtr argmin(const Arr& a, int32_t axis, bool keepdims);
ArrPtr softmax(const Arr& a, I32s axes, bool precise);
ArrPtr cumsum(const Arr& a, int32_t axis, bool reverse, bool inclusive);
ArrPtr cummax(const Arr& a, int32_t axis, bool reverse, bool inclusive);
ArrPtr sort(const Arr& a, int32_t axis);
ArrPtr argsort(const Arr& a, int32_t axis);
ArrPtr partition(const Arr& a, int32_t kth, int32_t axis);
ArrPtr argpartition(const Arr& a, int32_t kth, int32_t axis);
ArrPtr topk(const Arr& a, int32_t k, int32_t axis);

// --- linear algebra and quantization ---------------------------------------------------------
ArrPtr matmul(const Arr& a, const Arr& b);
ArrPtr panel_matmul(const Arr& x, const Arr& panels);
ArrPtr addmm(const Arr& c, const Arr& a, const Arr& b, float alpha, float beta);
ArrPtr gather_mm(const Arr& a, const Arr& b, const Arr* lhs, const Arr* rhs, bool sorted);
// `mode`: 0 affine, 1 mxfp4, 2 nvfp4, 3 mxfp8 (MLX's names, in that order); biases affine's only.
std::unique_ptr<ArrVec> quantize(const Arr& w, int32_t group_size, int32_t bits, int32_t mode);
ArrPtr dequantize(
    const Arr& w, const Arr& scales, const Arr* biases, int32_t group_size, int32_t bits, int32_t mode);
ArrPtr quantized_matmul(
    const Arr& x,
    const Arr& w,
    const Arr& scales,
    const Arr* biases,
    bool transpose,
    int32_t group_size,
    int32_t bits,
    int32_t mode);
std::unique_ptr<ArrVec> quantized_matmuls(
    const Arr& x,
    const ArrVec& w,
    const ArrVec& scales,
    const ArrVec& biases,
    int32_t group_size,
    int32_t bits,
    int32_t mode);
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
    int32_t mode);
void set_quantized_kernel(bool on);
bool quantized_panels_apply(int32_t bits, int32_t group_size);
void set_quantized_unpacking(int32_t mode);
int32_t quantized_unpacking();
uint64_t quantized_kernel_count(bool sgemm_path);
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
    bool sorted);

// --- fast --------------------------------------------------------------------------------------
ArrPtr rms_norm(const Arr& x, const Arr* w, float eps);
ArrPtr rms_norm_residual(const Arr& x, const Arr* w, float eps, const Arr& residual, const Arr* scale);
// {(residual + rms_norm(x, w)) · scale, rms_norm(that, next_w)}: a residual update and the next
// block's input norm, one op on the CPU.
std::unique_ptr<ArrVec> rms_norm_residual_norm(
    const Arr& x, const Arr* w, float eps, const Arr& residual, const Arr* scale, const Arr& next_w);
// dequantize(w[ids]) · scale (with has_scale): a quantized embedding lookup, one op on the CPU.
ArrPtr quantized_embedding(
    const Arr& ids,
    const Arr& w,
    const Arr& scales,
    const Arr& biases,
    int32_t group_size,
    int32_t bits,
    int32_t mode,
    float scale,
    bool has_scale);
// x @ dequantize(w)ᵀ, then the residual update above of the product: {sum} or, with next_w,
// {sum, rms_norm(sum, next_w)}; one op on the CPU.
std::unique_ptr<ArrVec> quantized_matmul_norm(
    const Arr& x,
    const Arr& w,
    const Arr& scales,
    const Arr* biases,
    int32_t group_size,
    int32_t bits,
    int32_t mode,
    const Arr* norm_w,
    float eps,
    const Arr& residual,
    const Arr* scale,
    const Arr* next_w);
ArrPtr layer_norm(const Arr& x, const Arr* w, const Arr* b, float eps);
ArrPtr rope(const Arr& x, const Rotation& rotation, int32_t offset, const Arr* freqs);
ArrPtr rope_dynamic(const Arr& x, const Rotation& rotation, const Arr& offset, const Arr* freqs);
// y [1, T, heads·d] → [T, heads, 1, d], each head RMS-normalised (w may be null), then, with
// `rotate`, rotated at offsets[t]: the reshape, norm and RoPE of a decode step's heads, one op on
// the CPU.
ArrPtr heads_norm_rope(
    const Arr& y,
    int32_t heads,
    const Arr* w,
    float eps,
    bool rotate,
    const Rotation& rotation,
    const Arr& offsets,
    const Arr* freqs);
std::unique_ptr<ArrVec> qkv_heads(
    const Arr& q,
    const Arr& k,
    const Arr& v,
    const QkvHeads& heads,
    const Arr& q_norm,
    const Arr& k_norm,
    const Rotation& rotation,
    const Arr& offsets,
    const Arr* freqs);
// quantized_matmuls of x (q, k and, with three matrices, v; with two the values are the keys)
// and then qkv_heads of them: one op on the CPU.
std::unique_ptr<ArrVec> quantized_qkv_heads(
    const Arr& x,
    const ArrVec& w,
    const ArrVec& scales,
    const ArrVec& biases,
    int32_t group_size,
    int32_t bits,
    int32_t mode,
    const QkvHeads& heads,
    const Arr& q_norm,
    const Arr& k_norm,
    const Rotation& rotation,
    const Arr& offsets,
    const Arr* freqs);
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
    bool tokens);

// 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))).
ArrPtr gelu_tanh(const Arr& x);
ArrPtr softmax_last(const Arr& x);
ArrPtr softcap(const Arr& x, float cap);
ArrPtr silu_mul(const Arr& g, const Arr& u);
ArrPtr sigmoid_mul(const Arr& g, const Arr& u);
void set_fused_kernels(bool on);
void set_vector_width(int32_t bits);
uint64_t fused_kernel_count(uint8_t kind);

// --- random ------------------------------------------------------------------------------------
ArrPtr random_key(uint64_t seed);
ArrPtr random_split(const Arr& key, int32_t num);
ArrPtr random_uniform(I32s shape, uint8_t dtype, double low, double high, const Arr* key);
ArrPtr random_normal(I32s shape, uint8_t dtype, double loc, double scale, const Arr* key);
ArrPtr random_randint(I32s shape, uint8_t dtype, int64_t low, int64_t high, const Arr* key);
ArrPtr random_categorical(const Arr& logits, int32_t axis, int32_t num_samples, const Arr* key);
ArrPtr random_bernoulli(const Arr& p, I32s shape, bool has_shape, const Arr* key);
ArrPtr random_gumbel(I32s shape, uint8_t dtype, const Arr* key);

// --- distributed (MLX's backends; docs/DISTRIBUTED.md) -----------------------------------------
struct DistGroup {
  mlx::core::distributed::Group g;
  explicit DistGroup(mlx::core::distributed::Group x) : g(std::move(x)) {}
};
bool distributed_available(rust::Str backend);
// Joins the group `backend` describes (the ring backend: MLX_HOSTFILE and MLX_RANK in the
// environment); blocks until every rank has connected.
std::unique_ptr<DistGroup> distributed_init(rust::Str backend);
int32_t group_rank(const DistGroup& g);
int32_t group_size(const DistGroup& g);
ArrPtr dist_all_sum(const Arr& x, const DistGroup& g);
ArrPtr dist_all_gather(const Arr& x, const DistGroup& g);
ArrPtr dist_send(const Arr& x, int32_t dst, const DistGroup& g);
ArrPtr dist_recv(I32s shape, uint8_t dtype, int32_t src, const DistGroup& g);

// --- io ----------------------------------------------------------------------------------------
std::unique_ptr<ArrVec> load_safetensors(rust::Str path, rust::Vec<rust::String>& names);
void save_safetensors(rust::Str path, rust::Slice<const rust::String> names, const ArrVec& arrays);

} // namespace mlxr
