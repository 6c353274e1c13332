//! The MLX library itself: version, devices, streams, evaluation, which BLAS serves it.

use crate::array::pack;
use crate::{Array, Result};
use mlx_sys::ffi;

/// MLX's version string ("0.32.4").
pub fn version() -> String {
    ffi::version()
}

/// The shared object that `cblas_sgemm` resolves to, i.e. the BLAS behind float32 matmuls on
/// the CPU (OpenBLAS when the build found it, otherwise the reference BLAS bundled with MLX).
pub fn blas_library() -> String {
    ffi::blas_library()
}

/// OpenBLAS's build configuration when the binary links it, else `None`.
pub fn openblas_config() -> Option<String> {
    Some(ffi::openblas_config()).filter(|s| !s.is_empty())
}

/// How many threads OpenBLAS runs a product on (it counts the CPUs once, when it loads: a
/// process whose CPUs are cut down later says so here). No effect without OpenBLAS.
pub fn set_blas_threads(n: usize) {
    ffi::set_blas_threads(n.clamp(1, i32::MAX as usize) as i32)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        })
    }
}

pub fn gpu_available() -> bool {
    ffi::gpu_available()
}

pub fn default_device() -> Device {
    if ffi::default_device_is_gpu() {
        Device::Gpu
    } else {
        Device::Cpu
    }
}

pub fn set_default_device(d: Device) -> Result<()> {
    Ok(ffi::set_default_device(d == Device::Gpu)?)
}

/// Gives the calling thread its own default stream if it has none yet. Call once at the start
/// of a thread that will own MLX work (the engine thread, docs/ARCHITECTURE.md D3).
pub fn init_thread() -> Result<()> {
    Ok(ffi::init_thread()?)
}

/// Waits for everything queued on the default stream.
pub fn synchronize() -> Result<()> {
    Ok(ffi::synchronize()?)
}

/// Computes all of `arrays`, sharing their common subgraphs.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    Ok(ffi::eval_all(&pack(arrays.iter().copied()))?)
}

/// Starts computing `arrays` and returns at once; reading them later waits for the result.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    Ok(ffi::async_eval_all(&pack(arrays.iter().copied()))?)
}

/// The primitives still to run in the graphs behind `arrays`, by kind, most frequent first:
/// what an evaluation of them will dispatch (for benchmarks and step breakdowns).
pub fn graph_ops(arrays: &[&Array]) -> Vec<(String, usize)> {
    let mut ops: Vec<(String, usize)> = ffi::graph_ops(&pack(arrays.iter().copied()))
        .lines()
        .filter_map(|l| {
            let (name, n) = l.rsplit_once(' ')?;
            Some((name.to_string(), n.parse().ok()?))
        })
        .collect();
    ops.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    ops
}

/// Turns mlx-runner's CPU kernel for affine-quantized matmuls on (the default) or off: off,
/// every quantized matmul is MLX's own (for comparisons and the kernel's exactness tests).
/// Applies to graphs built after the call.
pub fn set_quantized_kernel(on: bool) {
    ffi::set_quantized_kernel(on)
}

/// How the quantized kernel unpacks its 4- and 8-bit fields: `None` as this CPU runs fastest
/// (the default), `Some(false)` by integer-to-float conversion, `Some(true)` read as subnormal
/// floats. Both give the same bits; tests run each.
pub fn set_quantized_unpacking(subnormal: Option<bool>) {
    ffi::set_quantized_unpacking(match subnormal {
        None => -1,
        Some(false) => 0,
        Some(true) => 1,
    })
}

/// How the quantized kernel unpacks fields on this CPU, in words (`mlx-runner info`).
pub fn quantized_kernel_description() -> String {
    // The low bits say how fields become floats, bit 2 whether the odd widths take VNNI.
    let code = ffi::quantized_unpacking();
    let fields = match code & 3 {
        2 => "AVX2, fields read as subnormal floats (this CPU multiplies them at full speed)",
        1 => "AVX2, fields converted to float",
        _ => return "none (no AVX2 and FMA: MLX's own quantized matmul)".into(),
    };
    if code & 4 != 0 {
        format!("{fields}; 2, 3, 5 and 6 bits by integer dot products (AVX-512 VNNI)")
    } else {
        fields.into()
    }
}

/// Quantized products the kernel has computed in this process: `(packed rows, dequantize +
/// sgemm)`.
pub fn quantized_kernel_counts() -> (u64, u64) {
    (
        ffi::quantized_kernel_count(false),
        ffi::quantized_kernel_count(true),
    )
}
