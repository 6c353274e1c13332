//! Array operations as methods. Each builds graph nodes; nothing is computed until evaluation.
//!
//! Scalar variants (`add_scalar`, `mul_scalar`, ...) follow MLX's Python rule for Python numbers:
//! the scalar takes the array's dtype, so `x_bf16 * 0.5` stays bf16 (a "weak" scalar), and an
//! integer array meeting a non-integral scalar becomes float32.

use crate::array::{pack, unpack};
use crate::{Array, Dtype, Error, Result};
use mlx_sys::ffi::{self, BinaryOp, ReduceOp, UnaryOp};

/// A nullable pointer for an optional array argument of the bridge.
pub(crate) fn ptr(a: Option<&Array>) -> *const ffi::Arr {
    a.map_or(std::ptr::null(), |a| a.arr() as *const ffi::Arr)
}

macro_rules! unary {
    ($($(#[$m:meta])* $name:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$m])*
                pub fn $name(&self) -> Result<Array> {
                    Ok(Array::from_raw(ffi::unary(UnaryOp::$op, self.arr())?))
                }
            )*
        }
    };
}

macro_rules! binary {
    ($($(#[$m:meta])* $name:ident, $scalar:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$m])*
                pub fn $name(&self, other: &Array) -> Result<Array> {
                    Ok(Array::from_raw(ffi::binary(BinaryOp::$op, self.arr(), other.arr())?))
                }

                /// The same with a weakly typed scalar on the right (see the module docs).
                pub fn $scalar(&self, v: f64) -> Result<Array> {
                    let s = self.weak_scalar(v)?;
                    Ok(Array::from_raw(ffi::binary(BinaryOp::$op, self.arr(), s.arr())?))
                }
            )*
        }
    };
}

macro_rules! reduce {
    ($($(#[$m:meta])* $name:ident, $all:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$m])*
                pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
                    Ok(Array::from_raw(ffi::reduce(ReduceOp::$op, self.arr(), axes, keepdims)?))
                }

                /// The same over every element.
                pub fn $all(&self, keepdims: bool) -> Result<Array> {
                    Ok(Array::from_raw(ffi::reduce_all(ReduceOp::$op, self.arr(), keepdims)?))
                }
            )*
        }
    };
}

unary! {
    abs => Abs;
    negative => Negative;
    sign => Sign;
    exp => Exp;
    log => Log;
    log1p => Log1p;
    sqrt => Sqrt;
    rsqrt => Rsqrt;
    square => Square;
    reciprocal => Reciprocal;
    tanh => Tanh;
    sigmoid => Sigmoid;
    erf => Erf;
    sin => Sin;
    cos => Cos;
    floor => Floor;
    ceil => Ceil;
    round => Round;
    logical_not => LogicalNot;
    isnan => IsNan;
    isinf => IsInf;
    stop_gradient => StopGradient;
    /// A new array over the same data: MLX's `copy` shares its input's buffer, so a copy of a
    /// slice keeps the whole sliced buffer alive. For bytes of its own, use [`Array::contiguous`].
    copy => Copy;
    /// The same values laid out row-contiguously, in a buffer of their own unless the input's
    /// is already that layout and at most 16 KB larger (MLX's rule): a slice's own copy.
    contiguous => Contiguous;
}

binary! {
    add, add_scalar => Add;
    subtract, subtract_scalar => Subtract;
    multiply, multiply_scalar => Multiply;
    divide, divide_scalar => Divide;
    floor_divide, floor_divide_scalar => FloorDivide;
    remainder, remainder_scalar => Remainder;
    power, power_scalar => Power;
    maximum, maximum_scalar => Maximum;
    minimum, minimum_scalar => Minimum;
    equal, equal_scalar => Equal;
    not_equal, not_equal_scalar => NotEqual;
    less, less_scalar => Less;
    less_equal, less_equal_scalar => LessEqual;
    greater, greater_scalar => Greater;
    greater_equal, greater_equal_scalar => GreaterEqual;
    logical_and, logical_and_scalar => LogicalAnd;
    logical_or, logical_or_scalar => LogicalOr;
    logaddexp, logaddexp_scalar => LogAddExp;
}

reduce! {
    sum, sum_all => Sum;
    mean, mean_all => Mean;
    max, max_all => Max;
    min, min_all => Min;
    prod, prod_all => Prod;
    all, all_all => All;
    any, any_all => Any;
    logsumexp, logsumexp_all => LogSumExp;
}

impl Array {
    /// A scalar for `v` typed the way MLX types a Python number next to this array.
    fn weak_scalar(&self, v: f64) -> Result<Array> {
        let dt = self.dtype();
        let integral = v.fract() == 0.0;
        let dtype = match dt {
            _ if dt.is_float() || dt == Dtype::Complex64 => dt,
            _ if dt.is_integer() && integral => dt,
            Dtype::Bool if integral => Dtype::I32,
            _ => Dtype::F32,
        };
        Array::scalar_as(v, dtype)
    }

    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        Ok(Array::from_raw(ffi::astype(self.arr(), dtype.code())?))
    }

    /// Reads uint8 codes as E4M3 float8 values (sign, 4 exponent bits of bias 7, 3 mantissa
    /// bits; no infinities, S.1111.111 is NaN) in `dtype`.
    pub fn from_fp8(&self, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_raw(ffi::from_fp8(self.arr(), dtype.code())?))
    }

    /// The same bytes read as `dtype`: the last axis scales by the ratio of the sizes (four
    /// uint8 become one uint32).
    pub fn view(&self, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_raw(ffi::view(self.arr(), dtype.code())?))
    }

    /// Limits values to `[lo, hi]`; either bound may be absent.
    pub fn clip(&self, lo: Option<&Array>, hi: Option<&Array>) -> Result<Array> {
        // SAFETY: the pointers are null or point at arrays that outlive the call.
        Ok(Array::from_raw(unsafe {
            ffi::clip(self.arr(), ptr(lo), ptr(hi))?
        }))
    }

    // --- shape -------------------------------------------------------------------------------

    /// A view with a new shape; one dimension may be -1.
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::reshape(self.arr(), shape)?))
    }

    /// Permutes the axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::transpose(self.arr(), axes)?))
    }

    /// Reverses the order of all axes (`a.T`).
    pub fn t(&self) -> Result<Array> {
        let n = self.ndim() as i32;
        let axes: Vec<i32> = (0..n).rev().collect();
        self.transpose(&axes)
    }

    pub fn swapaxes(&self, a: i32, b: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::swapaxes(self.arr(), a, b)?))
    }

    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        self.expand_dims_axes(&[axis])
    }

    pub fn expand_dims_axes(&self, axes: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::expand_dims(self.arr(), axes)?))
    }

    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        self.squeeze_axes(&[axis])
    }

    pub fn squeeze_axes(&self, axes: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::squeeze(self.arr(), axes)?))
    }

    /// Merges axes `start..=end` into one.
    pub fn flatten(&self, start: i32, end: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::flatten(self.arr(), start, end)?))
    }

    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::broadcast_to(self.arr(), shape)?))
    }

    /// Splits into `n` equal parts along `axis`.
    pub fn split(&self, n: i32, axis: i32) -> Result<Vec<Array>> {
        unpack(ffi::split_sections(self.arr(), n, axis)?)
    }

    /// Splits before each of `indices` along `axis`.
    pub fn split_at(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        unpack(ffi::split_indices(self.arr(), indices, axis)?)
    }

    pub fn repeat(&self, repeats: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::repeat(self.arr(), repeats, axis)?))
    }

    pub fn tile(&self, reps: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::tile(self.arr(), reps)?))
    }

    /// Pads `axes[i]` with `lo[i]` entries before and `hi[i]` after, filled with `value`.
    pub fn pad(&self, axes: &[i32], lo: &[i32], hi: &[i32], value: f64) -> Result<Array> {
        Ok(Array::from_raw(ffi::pad(self.arr(), axes, lo, hi, value)?))
    }

    /// Reverses the order of elements along `axis`.
    pub fn flip(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::flip(self.arr(), axis)?))
    }

    // --- gathers and scatters --------------------------------------------------------------

    /// Slices of size `sizes` along `axes` starting at the positions held in `start` (an
    /// integer array evaluated on the device, so the graph does not change with the offset).
    pub fn slice_dynamic(&self, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
        Ok(Array::from_raw(ffi::slice_dynamic(
            self.arr(),
            start.arr(),
            axes,
            sizes,
        )?))
    }

    /// Writes `update` at the positions held in `start` along `axes`.
    pub fn slice_update_dynamic(
        &self,
        update: &Array,
        start: &Array,
        axes: &[i32],
    ) -> Result<Array> {
        Ok(Array::from_raw(ffi::slice_update_dynamic(
            self.arr(),
            update.arr(),
            start.arr(),
            axes,
        )?))
    }

    /// Gathers entries along `axis` at `indices` (NumPy `take`).
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::take(self.arr(), indices.arr(), axis)?))
    }

    /// Gathers from the flattened array.
    pub fn take_flat(&self, indices: &Array) -> Result<Array> {
        Ok(Array::from_raw(ffi::take_flat(self.arr(), indices.arr())?))
    }

    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::take_along_axis(
            self.arr(),
            indices.arr(),
            axis,
        )?))
    }

    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::put_along_axis(
            self.arr(),
            indices.arr(),
            values.arr(),
            axis,
        )?))
    }

    /// Adds `values` at `indices` along `axis`; repeated indices accumulate.
    pub fn scatter_add_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::scatter_add_axis(
            self.arr(),
            indices.arr(),
            values.arr(),
            axis,
        )?))
    }

    /// General scatter-add: one index array per entry of `axes` (MLX `scatter_add`).
    pub fn scatter_add(&self, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
        let idx = pack(indices.iter().copied());
        Ok(Array::from_raw(ffi::scatter_add(
            self.arr(),
            &idx,
            updates.arr(),
            axes,
        )?))
    }

    /// General scatter (assignment): one index array per entry of `axes`.
    pub fn scatter(&self, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
        let idx = pack(indices.iter().copied());
        Ok(Array::from_raw(ffi::scatter(
            self.arr(),
            &idx,
            updates.arr(),
            axes,
        )?))
    }

    // --- reductions, scans, sorting --------------------------------------------------------

    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Ok(Array::from_raw(ffi::argmax(self.arr(), axis, keepdims)?))
    }

    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Ok(Array::from_raw(ffi::argmin(self.arr(), axis, keepdims)?))
    }

    /// Softmax over `axes`; `precise` accumulates in float32 for half-precision inputs.
    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        Ok(Array::from_raw(ffi::softmax(self.arr(), axes, precise)?))
    }

    /// `x - logsumexp(x)` along `axis`.
    pub fn log_softmax(&self, axis: i32) -> Result<Array> {
        self.subtract(&self.logsumexp(&[axis], true)?)
    }

    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        Ok(Array::from_raw(ffi::cumsum(
            self.arr(),
            axis,
            reverse,
            inclusive,
        )?))
    }

    pub fn cummax(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        Ok(Array::from_raw(ffi::cummax(
            self.arr(),
            axis,
            reverse,
            inclusive,
        )?))
    }

    /// Ascending sort along `axis`.
    pub fn sort(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::sort(self.arr(), axis)?))
    }

    pub fn argsort(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::argsort(self.arr(), axis)?))
    }

    /// Reorders so that position `kth` holds the value it would have after sorting, smaller
    /// values before it and larger after (in no particular order).
    pub fn partition(&self, kth: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::partition(self.arr(), kth, axis)?))
    }

    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::argpartition(self.arr(), kth, axis)?))
    }

    /// The `k` largest values along `axis` (unordered).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_raw(ffi::topk(self.arr(), k, axis)?))
    }

    // --- linear algebra and quantization ---------------------------------------------------

    pub fn matmul(&self, other: &Array) -> Result<Array> {
        Ok(Array::from_raw(ffi::matmul(self.arr(), other.arr())?))
    }

    /// `beta * self + alpha * (a @ b)`.
    pub fn addmm(&self, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
        Ok(Array::from_raw(ffi::addmm(
            self.arr(),
            a.arr(),
            b.arr(),
            alpha,
            beta,
        )?))
    }

    /// Matrix products with matrix-level gathers: the `rhs[i]`-th matrix of `b` for each row
    /// block (MLX `gather_mm`, the mixture-of-experts kernel).
    pub fn gather_mm(
        &self,
        b: &Array,
        lhs_indices: Option<&Array>,
        rhs_indices: Option<&Array>,
        sorted: bool,
    ) -> Result<Array> {
        // SAFETY: the pointers are null or point at arrays that outlive the call.
        Ok(Array::from_raw(unsafe {
            ffi::gather_mm(
                self.arr(),
                b.arr(),
                ptr(lhs_indices),
                ptr(rhs_indices),
                sorted,
            )?
        }))
    }
}

/// MLX's quantization modes: affine (a float scale and bias per group of integer codes) and the
/// microscaling float formats (FP4 E2M1 or FP8 E4M3 values with a shared 8-bit scale per group:
/// a power of two (E8M0) for the MX formats, an FP8 E4M3 number for NVFP4; no biases).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QuantMode {
    #[default]
    Affine,
    Mxfp4,
    Nvfp4,
    Mxfp8,
}

impl QuantMode {
    pub const ALL: [QuantMode; 4] = [
        QuantMode::Affine,
        QuantMode::Mxfp4,
        QuantMode::Nvfp4,
        QuantMode::Mxfp8,
    ];

    /// The mode's name in MLX, mlx-lm's configs and ollama's stores.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Nvfp4 => "nvfp4",
            QuantMode::Mxfp8 => "mxfp8",
        }
    }

    pub fn parse(name: &str) -> Option<QuantMode> {
        QuantMode::ALL.into_iter().find(|m| m.name() == name)
    }

    /// `(bits, group_size)` a microscaling mode has; affine's are chosen per model.
    pub fn fixed_format(self) -> Option<(i32, i32)> {
        match self {
            QuantMode::Affine => None,
            QuantMode::Mxfp4 => Some((4, 32)),
            QuantMode::Nvfp4 => Some((4, 16)),
            QuantMode::Mxfp8 => Some((8, 32)),
        }
    }

    /// Whether a group has a bias beside its scale.
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }

    pub(crate) fn code(self) -> i32 {
        self as i32
    }
}

/// A matrix quantized along its last axis (MLX's `quantize`): packed uint32 words, a scale per
/// group (float for affine, uint8 for the microscaling modes) and, for affine, a bias per group.
#[derive(Debug, Clone)]
pub struct Quantized {
    /// Packed uint32 words.
    pub weight: Array,
    pub scales: Array,
    /// Affine's biases; `None` in the microscaling modes.
    pub biases: Option<Array>,
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
    /// The words, scales and biases are held as panels of [`QUANT_PANEL`] output rows
    /// (`[N/16, words, 16]`, `[N/16, groups, 16]`; [`Quantized::paneled`]) rather than MLX's
    /// rows (`[N, words]`, `[N, groups]`). Every op here takes either; MLX's own ops see rows.
    pub panels: bool,
}

/// Output rows per panel of a paneled quantized matrix ([`Quantized::panels`]).
pub const QUANT_PANEL: i32 = 16;

/// The bit of a mode code that says the matrix is paneled (the shim's `kPanelsBit`).
const PANELS_BIT: i32 = 0x100;

static PANELS_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether this CPU multiplies affine matrices of `bits` in groups of `group_size` from panels
/// ([`Quantized::paneled`]; AVX-512, 4 or 8 bits, groups of 32, 64 or 128).
pub fn quantized_panels_apply(bits: i32, group_size: i32) -> bool {
    ffi::quantized_panels_apply(bits, group_size)
}

/// Whether [`Quantized::paneled`] makes panels (the default) or leaves every matrix in MLX's
/// rows: for measuring MLX's own kernels on the layout they are written for.
/// `MLXR_NO_QUANT_PANELS` set in the environment leaves them in rows too (to compare the two
/// layouts through the whole runner).
pub fn set_quantized_panels(on: bool) {
    PANELS_ON.store(on, std::sync::atomic::Ordering::Relaxed);
}

impl Array {
    /// A `[N, K]` matrix as panels of `width` rows, `[N / width, K, width]` (a copy): element
    /// `[p, k, l]` is row `width·p + l`'s element `k`, so a panel's `width` rows are one
    /// contiguous run per column. The caller checks that `width` divides `N`. The float32
    /// panels of [`crate::fast::pack_panels`] and the quantized ones of
    /// [`Quantized::paneled`] are both this.
    pub fn row_panels(&self, width: i32) -> Result<Array> {
        let s = self.shape();
        self.reshape(&[s[0] / width, width, s[1]])?
            .transpose(&[0, 2, 1])?
            .contiguous()
    }

    /// Affine quantization (`quantize_as` for the other modes).
    pub fn quantize(&self, group_size: i32, bits: i32) -> Result<Quantized> {
        self.quantize_as(QuantMode::Affine, group_size, bits)
    }

    pub fn quantize_as(&self, mode: QuantMode, group_size: i32, bits: i32) -> Result<Quantized> {
        let mut parts = unpack(ffi::quantize(self.arr(), group_size, bits, mode.code())?)?;
        let want = if mode.has_biases() { 3 } else { 2 };
        if parts.len() != want {
            return Err(Error::Mlx(format!(
                "quantize ({}) returned {} arrays, expected {want}",
                mode.name(),
                parts.len()
            )));
        }
        let biases = if mode.has_biases() { parts.pop() } else { None };
        let scales = parts.pop().ok_or_else(|| Error::Mlx("no scales".into()))?;
        let weight = parts.pop().ok_or_else(|| Error::Mlx("no weight".into()))?;
        Ok(Quantized {
            weight,
            scales,
            biases,
            group_size,
            bits,
            mode,
            panels: false,
        })
    }

    /// `self @ Wᵀ` (or `self @ W` when `transpose` is false) with a quantized `W`.
    pub fn quantized_matmul(&self, w: &Quantized, transpose: bool) -> Result<Array> {
        // SAFETY: the pointer points at an array that outlives the call.
        Ok(Array::from_raw(unsafe {
            ffi::quantized_matmul(
                self.arr(),
                w.weight.arr(),
                w.scales.arr(),
                ptr(w.biases.as_ref()),
                transpose,
                w.group_size,
                w.bits,
                w.code(),
            )?
        }))
    }

    /// `self @ wᵀ` for each of several quantized matrices of one format (bits and group size)
    /// that read this same input, such as an attention block's q, k and v projections: one op
    /// on the CPU (the input prepared once, one pass of the thread pool over all their rows),
    /// the same values as one [`Array::quantized_matmul`] each.
    pub fn quantized_matmuls(&self, ws: &[&Quantized]) -> Result<Vec<Array>> {
        let Some(first) = ws.first() else {
            return Ok(Vec::new());
        };
        if let Some(q) = ws.iter().find(|q| !q.same_format(first)) {
            return Err(Error::Mlx(format!(
                "quantized_matmuls: {} beside {}",
                q.format(),
                first.format()
            )));
        }
        // One format: every matrix has biases (affine) or none does.
        unpack(ffi::quantized_matmuls(
            self.arr(),
            &pack(ws.iter().map(|q| &q.weight)),
            &pack(ws.iter().map(|q| &q.scales)),
            &pack(ws.iter().filter_map(|q| q.biases.as_ref())),
            first.group_size,
            first.bits,
            first.code(),
        )?)
    }

    /// `gelu_tanh(self @ gateᵀ) * (self @ upᵀ)` for two quantized matrices of one shape and
    /// format (a GeGLU's gate and up projections): one op on the CPU, the same values as the
    /// three ops it stands for.
    pub fn quantized_geglu(&self, gate: &Quantized, up: &Quantized) -> Result<Array> {
        self.quantized_glu(gate, up, 0, "quantized_geglu")
    }

    /// `silu(self @ gateᵀ) * (self @ upᵀ)` (a SwiGLU's gate and up projections), likewise.
    pub fn quantized_swiglu(&self, gate: &Quantized, up: &Quantized) -> Result<Array> {
        self.quantized_glu(gate, up, 1, "quantized_swiglu")
    }

    fn quantized_glu(
        &self,
        gate: &Quantized,
        up: &Quantized,
        act: u8,
        what: &str,
    ) -> Result<Array> {
        if !gate.same_format(up) {
            return Err(Error::Mlx(format!(
                "{what}: gate ({}) and up ({}) differ",
                gate.format(),
                up.format()
            )));
        }
        // SAFETY: the pointers are null or point at arrays that outlive the call.
        Ok(Array::from_raw(unsafe {
            ffi::quantized_glu(
                self.arr(),
                gate.weight.arr(),
                gate.scales.arr(),
                ptr(gate.biases.as_ref()),
                up.weight.arr(),
                up.scales.arr(),
                ptr(up.biases.as_ref()),
                gate.group_size,
                gate.bits,
                act,
                gate.code(),
            )?
        }))
    }

    /// [`Array::gather_mm`] with quantized matrices.
    pub fn gather_qmm(
        &self,
        w: &Quantized,
        lhs_indices: Option<&Array>,
        rhs_indices: Option<&Array>,
        transpose: bool,
        sorted: bool,
    ) -> Result<Array> {
        // SAFETY: the pointers are null or point at arrays that outlive the call.
        Ok(Array::from_raw(unsafe {
            ffi::gather_qmm(
                self.arr(),
                w.weight.arr(),
                w.scales.arr(),
                ptr(w.biases.as_ref()),
                ptr(lhs_indices),
                ptr(rhs_indices),
                transpose,
                w.group_size,
                w.bits,
                w.code(),
                sorted,
            )?
        }))
    }
}

impl Quantized {
    /// Whether `other` has this matrix's mode, bits and group size (what a fused op over
    /// several matrices needs).
    pub fn same_format(&self, other: &Quantized) -> bool {
        (self.mode, self.bits, self.group_size, self.panels)
            == (other.mode, other.bits, other.group_size, other.panels)
    }

    /// The mode's code for the shim, with [`PANELS_BIT`] where the matrix is paneled.
    pub(crate) fn code(&self) -> i32 {
        self.mode.code() | if self.panels { PANELS_BIT } else { 0 }
    }

    /// Output rows (of a stack, of each matrix).
    pub fn outputs(&self) -> i32 {
        let shape = self.weight.shape();
        if self.panels {
            shape[0] * QUANT_PANEL
        } else {
            shape[shape.len().saturating_sub(2)]
        }
    }

    /// This matrix as panels of [`QUANT_PANEL`] output rows, where the CPU multiplies it from
    /// them (docs/MODELS.md, "Quantized weights on the CPU"): an affine 2-D matrix with float32
    /// scales, 4 or 8 bits, on a CPU with AVX-512, its rows a multiple of 16. `None` elsewhere.
    /// A copy (evaluated with the model), the same size as the rows.
    pub fn paneled(&self) -> Result<Option<Quantized>> {
        let shape = self.weight.shape();
        let fits = !self.panels
            && PANELS_ON.load(std::sync::atomic::Ordering::Relaxed)
            && std::env::var_os("MLXR_NO_QUANT_PANELS").is_none()
            && self.mode == QuantMode::Affine
            && crate::default_device() == crate::Device::Cpu
            && shape.len() == 2
            && shape[0] > 0
            && shape[0] % QUANT_PANEL == 0
            && self.scales.dtype() == crate::Dtype::F32
            && self.biases.as_ref().map(|b| b.dtype()) == Some(crate::Dtype::F32)
            && quantized_panels_apply(self.bits, self.group_size);
        let Some(biases) = self.biases.as_ref().filter(|_| fits) else {
            return Ok(None);
        };
        Ok(Some(Quantized {
            weight: self.weight.row_panels(QUANT_PANEL)?,
            scales: self.scales.row_panels(QUANT_PANEL)?,
            biases: Some(biases.row_panels(QUANT_PANEL)?),
            panels: true,
            ..*self
        }))
    }

    /// This matrix in MLX's row layout: itself, or a paneled one's arrays put back (views, for
    /// cutting and slicing by rows; [`Quantized::paneled`] panels a result again).
    pub fn rows(&self) -> Result<Quantized> {
        if !self.panels {
            return Ok(self.clone());
        }
        let unpanel = |a: &Array| -> Result<Array> {
            let s = a.shape();
            a.transpose(&[0, 2, 1])?.reshape(&[s[0] * s[2], s[1]])
        };
        Ok(Quantized {
            weight: unpanel(&self.weight)?,
            scales: unpanel(&self.scales)?,
            biases: self.biases.as_ref().map(unpanel).transpose()?,
            panels: false,
            ..*self
        })
    }

    /// "affine 4 bits, group 64", "mxfp4", ...: for messages.
    pub fn format(&self) -> String {
        match self.mode {
            QuantMode::Affine => format!("affine {} bits, group {}", self.bits, self.group_size),
            m => m.name().to_string(),
        }
    }

    /// Rows `ids` (int32 or uint32, any shape) of the matrix, dequantized and times `scale`:
    /// `[..ids, K]`, a quantized embedding lookup. One op on the CPU, with the values of the
    /// gathers, [`Quantized::dequantize`] and the float32 multiply it stands for.
    pub fn lookup(&self, ids: &Array, scale: Option<f32>) -> Result<Array> {
        let Some(biases) = &self.biases else {
            if self.panels {
                return self.rows()?.lookup(ids, scale);
            }
            // The fused op is affine's; the other modes take the rows, then dequantize them.
            let rows = Quantized {
                weight: self.weight.take(ids, 0)?,
                scales: self.scales.take(ids, 0)?,
                biases: None,
                ..self.clone()
            };
            let dense = rows.dequantize()?;
            return match scale {
                Some(s) => dense.multiply(&Array::scalar(s)?),
                None => Ok(dense),
            };
        };
        Ok(Array::from_raw(ffi::quantized_embedding(
            ids.arr(),
            self.weight.arr(),
            self.scales.arr(),
            biases.arr(),
            self.group_size,
            self.bits,
            self.code(),
            scale.unwrap_or(1.0),
            scale.is_some(),
        )?))
    }

    /// Back to a dense matrix.
    pub fn dequantize(&self) -> Result<Array> {
        // SAFETY: the pointer points at an array that outlives the call.
        Ok(Array::from_raw(unsafe {
            ffi::dequantize(
                self.weight.arr(),
                self.scales.arr(),
                ptr(self.biases.as_ref()),
                self.group_size,
                self.bits,
                self.code(),
            )?
        }))
    }
}

/// Joins arrays along an existing axis.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    Ok(Array::from_raw(ffi::concatenate(
        &pack(arrays.iter().copied()),
        axis,
    )?))
}

/// Joins arrays along a new axis.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    Ok(Array::from_raw(ffi::stack(
        &pack(arrays.iter().copied()),
        axis,
    )?))
}

/// `cond ? x : y`, element-wise with broadcasting.
pub fn where_(cond: &Array, x: &Array, y: &Array) -> Result<Array> {
    Ok(Array::from_raw(ffi::where_(cond.arr(), x.arr(), y.arr())?))
}
