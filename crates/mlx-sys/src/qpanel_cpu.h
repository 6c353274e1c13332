// Affine-quantized matrices held as panels of 16 output rows (qpanel_cpu.cc), the layout the
// CPU's few-rows product reads at the same pace whatever the number of rows it multiplies:
//
//   words  [N/16, K·bits/32, 16]  lane l of a panel's word j is word j of output row 16p + l
//   scales [N/16, K/group, 16]    and biases alike
//
// A panel's packed values for one input position are one 512-bit load, so each value is
// unpacked once and multiplied into every row of x by a broadcast (lanes are outputs), where
// MLX's row layout makes each output a dot product whose unpacking is repeated per row of x.
// Made at load (mlx::Quantized's `panels`), only with AVX-512, for 4- and 8-bit matrices whose
// output count is a multiple of 16; the shim puts them back in MLX's layout wherever these
// kernels do not apply (docs/MODELS.md, "Quantized weights on the CPU").
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlxr {

// Output rows per panel.
constexpr int QPANEL = 16;

// Panels the few-rows kernel takes side by side for M rows of x (one or two rows read four or
// two panels at once, for enough independent chains and streams to keep reading memory): a
// caller splitting the outputs over threads cuts them in multiples of it, or the rest of each
// piece takes the one-panel kernel, which reads memory slower.
constexpr int qpanel_batch(int M) { return M == 1 ? 4 : M <= 4 ? 2 : 1; }

// Whether panels of `bits`-bit values in groups of `group` run here: AVX-512, 4 or 8 bits.
bool qpanel_applies(int bits, int group);

// out[m, 16·p0 .. 16·p1) for rows m < M of x [M, K] (row-major, rows K apart) with their
// per-group sums xsum [M, K/group]; out's rows N apart. Each output element's arithmetic is
// the same whatever M is (a row does not depend on those computed beside it).
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
    int p1);

// Panels [p0, p1) and columns [k0, k1) (whole groups) dequantized, row-major as the row
// layout's tiles are: dst[(n - 16·p0)·ld + (k - k0)] = s·q + b, the row layout's values.
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
    int k1);

// Output row n, columns [0, K), dequantized into dst (an embedding lookup's row).
void qpanel_row(const uint32_t* w, const float* sc, const float* bi, float* dst, int n, int K, int bits, int group);

}  // namespace mlxr
