// The CPU quantized matmul kernel (qmm_cpu.cc).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mlx/mlx.h"

namespace mlxr {

// Every function here with a `panels` flag takes affine matrices either in MLX's row layout or
// (panels) as 16-output panels, qpanel_cpu.h; a caller whose panels are refused (nullopt) puts
// them back in rows for MLX's ops.

// x @ dequantize(w)ᵀ through the kernel, or nullopt when it does not apply (not the CPU, not
// float32, not 4/8 bits, ...): the caller then uses MLX's quantized_matmul.
std::optional<mlx::core::array> cpu_quantized_matmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const std::optional<mlx::core::array>& biases,
    bool transpose,
    int group_size,
    int bits,
    bool panels);

// x @ dequantize(w)ᵀ (w 2-D, transposed) and then the residual update norm_update_row computes
// (fused_cpu.h) of the product: {sum} or, with next_w, {sum, its norm}; nullopt where the
// kernel or the update does not take these operands.
std::optional<std::vector<mlx::core::array>> cpu_quantized_matmul_norm(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const std::optional<mlx::core::array>& biases,
    int group_size,
    int bits,
    int mode,
    const std::optional<mlx::core::array>& norm_w,
    float eps,
    const mlx::core::array& residual,
    const std::optional<mlx::core::array>& scale,
    const std::optional<mlx::core::array>& next_w,
    bool panels);

// dequantize(w[ids]) · scale (a quantized embedding lookup: w, scales, biases 2-D, ids int32
// or uint32 of any shape) through the kernel, or nullopt.
std::optional<mlx::core::array> cpu_quantized_embedding(
    const mlx::core::array& ids,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits,
    std::optional<float> scale,
    bool panels);

// Whether the kernel takes x @ dequantize(w)ᵀ for this x and 2-D packed matrix (and is on).
bool cpu_qmm_applies(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const std::optional<mlx::core::array>& biases,
    int group_size,
    int bits,
    int mode = 0,
    bool panels = false);

// gather_qmm (expert stacks w [E, N, ·], per-row expert ids) through the kernel, or nullopt.
std::optional<mlx::core::array> cpu_gather_qmm(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const std::optional<mlx::core::array>& biases,
    const std::optional<mlx::core::array>& lhs_indices,
    const std::optional<mlx::core::array>& rhs_indices,
    bool transpose,
    int group_size,
    int bits);

// dequantize(w, scales, biases) through the kernel, or nullopt (then MLX's dequantize).
std::optional<mlx::core::array> cpu_dequantize(
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const std::optional<mlx::core::array>& biases,
    int group_size,
    int bits,
    bool panels);

// x @ dequantize(w_i)ᵀ for matrices of one format that share x, as one op with one output each,
// or nullopt (the caller then multiplies them one by one). Needs the quantized and the fused
// kernels on.
std::optional<std::vector<mlx::core::array>> cpu_quantized_matmuls(
    const mlx::core::array& x,
    const std::vector<mlx::core::array>& ws,
    const std::vector<mlx::core::array>& scales,
    const std::vector<mlx::core::array>& biases,
    int group_size,
    int bits,
    int mode,
    bool panels);

// The activation of a gated MLP.
enum class GluAct : uint8_t { Gelu = 0, Silu = 1 };

// act(x @ dequantize(gate)ᵀ) ⊙ (x @ dequantize(up)ᵀ) in one op, or nullopt (the caller then
// composes it from the unfused ops). Needs both the quantized and the fused kernels on.
std::optional<mlx::core::array> cpu_quantized_glu(
    const mlx::core::array& x,
    const mlx::core::array& gate_w,
    const mlx::core::array& gate_scales,
    const std::optional<mlx::core::array>& gate_biases,
    const mlx::core::array& up_w,
    const mlx::core::array& up_scales,
    const std::optional<mlx::core::array>& up_biases,
    int group_size,
    int bits,
    GluAct act,
    int mode,
    bool panels);

// Turns the kernel on (the default) or off (MLX's own path everywhere), for comparisons.
void set_cpu_qmm_enabled(bool on);

// Whether the quantized kernels are on (set_cpu_qmm_enabled), for the microscaling ones too.
bool cpu_qmm_enabled();

// Counts a product computed by the packed-rows (false) or sgemm (true) path, as
// cpu_qmm_count reports them.
void count_qmm_path(bool sgemm_path);

// How the kernel unpacks 4- and 8-bit fields: -1 as this CPU runs fastest (the default), 0 by
// integer-to-float conversion, 1 as subnormal floats (see qmm_cpu.cc). Both give the same bits.
void set_cpu_qmm_unpacking(int mode);

// How the kernel unpacks on this thread now: 2 as subnormal floats, 1 by conversion, 0 not at
// all (no AVX2: MLX's own quantized matmul everywhere).
int cpu_qmm_unpacking();

// Products the kernel computed so far, by path (dequantize + sgemm, or packed rows).
uint64_t cpu_qmm_count(bool sgemm_path);

}  // namespace mlxr
