// CPU kernels for MLX's microscaling quantization modes (fpq_cpu.cc): the mode codes are the
// shim's (1 mxfp4, 2 nvfp4, 3 mxfp8); each returns nullopt where it does not apply, and the
// caller then builds MLX's own op.
#pragma once

#include <cstdint>
#include <optional>

#include "mlx/mlx.h"

namespace mlxr {

// x [..., K] @ dequantize(w)ᵀ, w [N, K·bits/32] uint32, scales [N, K/group] uint8.
std::optional<mlx::core::array> cpu_fp_quantized_matmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    bool transpose,
    int group_size,
    int bits,
    int mode);

// MLX's gather_qmm with rhs indices only (an MoE's expert stacks), w [E, N, K·bits/32].
std::optional<mlx::core::array> cpu_fp_gather_qmm(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const std::optional<mlx::core::array>& lhs_indices,
    const std::optional<mlx::core::array>& rhs_indices,
    bool transpose,
    int group_size,
    int bits,
    int mode);

// dequantize(w) as float32, w [..., N, K·bits/32].
std::optional<mlx::core::array> cpu_fp_dequantize(
    const mlx::core::array& w,
    const mlx::core::array& scales,
    int group_size,
    int bits,
    int mode);

// For the fused ops of qmm_cpu.cc, which read microscaling matrices through these: whether
// (mode, bits, group) is a microscaling format; x [M, K] · dequantize(w)ᵀ by the path that suits
// M (counted as cpu_qmm_count counts); output rows [n0, n1) by the few-rows kernel on this
// thread (`lanes`: x in FP4 lane order, fp4_lanes, or null); rows [n0, n1), columns [k0, k1)
// (whole groups) of w as float32.
bool fp_format(int mode, int bits, int group);
void fp_product(const float* x, const uint32_t* w, const uint8_t* sc, float* out, int M, int N, int K, int mode);
void fp_rows(
    const float* x, const float* lanes, const uint32_t* w, const uint8_t* sc, float* out, int M, int N, int K, int mode, int n0, int n1);

// x [M, K] in the FP4 kernels' lane order (each 128-value block's field j of word l, value 8l + j,
// at 16j + l), in a buffer of the calling thread reused by its next call; null where those
// kernels do not run (no AVX-512, rows not whole blocks). Defined in qmm_cpu.cc, beside the
// affine kernels' permutation it shares.
const float* fp4_lanes(const float* x, int M, int K);
void fp_dequantize_rows(const uint32_t* w, const uint8_t* sc, float* dst, int N, int K, int mode, int n0, int n1, int k0, int k1);

}  // namespace mlxr
