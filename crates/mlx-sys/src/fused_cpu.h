// Fused CPU kernels for the ops MLX's CPU backend builds out of many small ops (fused_cpu.cc).
#pragma once

#include <cstdint>
#include <optional>

#include "mlx/mlx.h"

namespace mlxr {

// The kinds, for the counters tests read.
enum class FusedKind : uint8_t {
  RmsNorm = 0,
  Rope = 1,
  Sdpa = 2,
  GeluTanh = 3,
  Matmul = 4,
  Softcap = 5,
  SiluMul = 6,
  HeadsNormRope = 7,
  // Cache writes that had to copy their buffer (something else still held it).
  SdpaWriteCopy = 8,
  Softmax = 9,
  PanelMatmul = 10,
};

// Each returns the fused primitive's output, or nullopt when it does not apply (not the CPU, not
// float32, a shape it does not take): the caller then builds MLX's own graph.
std::optional<mlx::core::array> cpu_rms_norm(
    const mlx::core::array& x,
    const std::optional<mlx::core::array>& w,
    float eps);

// (residual + rms_norm(x, w, eps)) · scale, residual of x's shape, scale one element (only with
// a residual).
std::optional<mlx::core::array> cpu_rms_norm_residual(
    const mlx::core::array& x,
    const std::optional<mlx::core::array>& w,
    float eps,
    const std::optional<mlx::core::array>& residual,
    const std::optional<mlx::core::array>& scale);

// The residual update above, and its result RMS-normalised again by next_w: {sum, its norm}.
std::optional<std::vector<mlx::core::array>> cpu_rms_norm_residual_norm(
    const mlx::core::array& x,
    const std::optional<mlx::core::array>& w,
    float eps,
    const mlx::core::array& residual,
    const std::optional<mlx::core::array>& scale,
    const mlx::core::array& next_w);

// A post-norm block's residual update of one row of d values, as the RMS-norm kernel computes it:
// orow = (res + rms_norm(x, w, eps)) · scale (res may be null, scale only if `scaled`), then,
// with next_w, next = rms_norm(orow, next_w, eps) (next may be null). Kernels that end in this
// update (a quantized product's epilogue) give the norm op's bits.
struct NormUpdate {
  const float* w;
  float eps;
  bool scaled;
  float scale;
  const float* next_w;
  int d;
};
void norm_update_row(const NormUpdate& u, const float* x, const float* res, float* orow, float* next);

// Whether the fused kernels are on and the update above takes rows of `shape` with these
// operands (float32 norm weights of the last axis' size, a residual of the shape, a one-element
// scale).
bool cpu_norm_update_applies(
    const mlx::core::Shape& shape,
    const std::optional<mlx::core::array>& w,
    const std::optional<mlx::core::array>& residual,
    const std::optional<mlx::core::array>& scale,
    const std::optional<mlx::core::array>& next_w);

std::optional<mlx::core::array> cpu_rope(
    const mlx::core::array& x,
    int dims,
    bool traditional,
    std::optional<float> base,
    float scale,
    const mlx::core::array& offset,
    const std::optional<mlx::core::array>& freqs);

// y [1, T, heads·d] → [T, heads, 1, d]: each token row's heads RMS-normalised over d (w
// optional), then, with `rope`, rotated at position offsets[t] (offsets int32, one or T).
struct HeadsRope {
  int dims;
  bool traditional;
  std::optional<float> base;
  float scale;
  std::optional<mlx::core::array> freqs;
};
std::optional<mlx::core::array> cpu_heads_norm_rope(
    const mlx::core::array& y,
    int heads,
    const std::optional<mlx::core::array>& w,
    float eps,
    const std::optional<HeadsRope>& rope,
    const mlx::core::array& offsets);

// One layer's decode-step queries, keys and values (q [1, T, q_heads·d], k and v
// [1, T, kv_heads·d]) as cpu_heads_norm_rope gives them in three calls: queries with q_norm and
// rotated, keys with k_norm and rotated, values without a weight or rotation; one op.
std::optional<std::vector<mlx::core::array>> cpu_qkv_heads(
    const mlx::core::array& q,
    const mlx::core::array& k,
    const mlx::core::array& v,
    int q_heads,
    int kv_heads,
    const mlx::core::array& q_norm,
    const mlx::core::array& k_norm,
    float eps,
    const HeadsRope& rope,
    const mlx::core::array& offsets);

// x @ dequantize(w_i)ᵀ for q, k and (unless ws has two: k_eq_v, the values are the keys) v, then
// cpu_qkv_heads of them, one op; nullopt where the kernels do not take these operands.
std::optional<std::vector<mlx::core::array>> cpu_quantized_qkv_heads(
    const mlx::core::array& x,
    const std::vector<mlx::core::array>& ws,
    const std::vector<mlx::core::array>& scales,
    const std::vector<mlx::core::array>& biases,
    int group_size,
    int bits,
    int mode,
    bool panels,
    int q_heads,
    int kv_heads,
    const mlx::core::array& q_norm,
    const mlx::core::array& k_norm,
    float eps,
    const HeadsRope& rope,
    const mlx::core::array& offsets);

// softmax(q kᵀ · scale + mask) v over the first `keys` slots of k and v ([B, Hk, S, D]), each
// one dense array, or with `bits` three (MLX's affine quantization along D: packed words,
// scales, biases, `group` values per scale). With k_new and v_new (rows [B, Hk, L, D] in the
// same form), their rows are first written at slots write_at.. of k and v: {attention, k's
// arrays with them, v's arrays with them}, the buffers taken over where nothing else holds
// them. Without: {attention}. The attention is [B, Hq, L, Dv], or with `tokens` [B, L, Hq·Dv].
std::optional<std::vector<mlx::core::array>> cpu_sdpa_slots(
    const mlx::core::array& q,
    const std::vector<mlx::core::array>& k,
    const std::vector<mlx::core::array>& v,
    int keys,
    const std::vector<mlx::core::array>& k_new,
    const std::vector<mlx::core::array>& v_new,
    int write_at,
    int group,
    int bits,
    float scale,
    bool causal,
    const std::optional<mlx::core::array>& mask,
    const std::optional<mlx::core::array>& sinks,
    bool tokens);

std::optional<mlx::core::array> cpu_gelu_tanh(const mlx::core::array& x);

// softmax over the last axis (float32).
std::optional<mlx::core::array> cpu_softmax(const mlx::core::array& x);

// cap · tanh(x / cap): logit soft-capping.
std::optional<mlx::core::array> cpu_softcap(const mlx::core::array& x, float cap);

// silu(g) ⊙ u for g and u of one shape.
std::optional<mlx::core::array> cpu_silu_mul(
    const mlx::core::array& g, const mlx::core::array& u, bool silu = true);

// x [..., K] @ w [K, N] for a few rows of x and a loaded (evaluated, row-major) float32 w.
std::optional<mlx::core::array> cpu_matmul(const mlx::core::array& x, const mlx::core::array& w);

// x [.., K] @ W for W held as column panels [N / 32, K, 32] (panel p: W[:, 32p : 32p + 32], row
// by row): float32 on the CPU, any number of rows.
std::optional<mlx::core::array> cpu_panel_matmul(const mlx::core::array& x, const mlx::core::array& panels);

// Turns the fused kernels on (the default) or off (MLX's own graphs everywhere).
void set_fused_cpu_enabled(bool on);

// The widest vectors of the kernels whose bits do not depend on it (the panel product: 512, 256
// or 0 for scalar; a quantized cache's values pass: 512 or 256); the CPU caps it.
void set_cpu_vector_width(int bits);

// Whether the fused kernels are on.
bool fused_cpu_enabled();

// Evaluations of each kind so far.
uint64_t fused_cpu_count(FusedKind kind);

}  // namespace mlxr
