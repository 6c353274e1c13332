//! Fused kernels: RMS norm, rotary embeddings, scaled dot-product attention, tanh-GELU.
//!
//! On the GPU these are MLX's own. MLX's CPU backend has none: it builds each from a graph of
//! small ops. There, for float32, mlx-runner's kernels (`crates/mlx-sys/src/fused_cpu.cc`) run
//! each as one op computing the same formula; [`set_fused_kernels`] switches back to MLX's graphs.
//! The same switch covers the CPU kernel behind [`Array::matmul`] for a few rows of float32
//! activations times a loaded weight (a decode step's products).

use crate::array::pack;
use crate::ops::ptr;
use crate::rows::Rows;
use crate::{Array, Result};
use mlx_sys::ffi;

/// `x · (mean(x²) + eps)^-½ · w` over the last axis, accumulated in float32. `w = None` is the
/// no-scale variant.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::rms_norm(x.arr(), ptr(weight), eps)?
    }))
}

/// `(residual + rms_norm(x, weight, eps)) · scale` (a post-norm block's residual update, and
/// gemma4's layer scalar): one op on the CPU with the same values as the ops it stands for.
/// `residual` has `x`'s shape; `scale` is one element.
pub fn rms_norm_residual(
    x: &Array,
    weight: Option<&Array>,
    eps: f32,
    residual: &Array,
    scale: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    Ok(Array::from_raw(unsafe {
        ffi::rms_norm_residual(x.arr(), ptr(weight), eps, residual.arr(), ptr(scale))?
    }))
}

/// [`rms_norm_residual`], and its result RMS-normalised again by `next_weight`: a block's
/// residual update and the next block's input norm, `(sum, norm(sum))`, one op on the CPU
/// with the values of the two.
pub fn rms_norm_residual_norm(
    x: &Array,
    weight: Option<&Array>,
    eps: f32,
    residual: &Array,
    scale: Option<&Array>,
    next_weight: &Array,
) -> Result<(Array, Array)> {
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    let outs = crate::array::unpack(unsafe {
        ffi::rms_norm_residual_norm(
            x.arr(),
            ptr(weight),
            eps,
            residual.arr(),
            ptr(scale),
            next_weight.arr(),
        )?
    })?;
    let mut it = outs.into_iter();
    match (it.next(), it.next()) {
        (Some(sum), Some(normed)) => Ok((sum, normed)),
        _ => Err(crate::Error::Mlx(
            "rms_norm_residual_norm: expected two outputs".into(),
        )),
    }
}

/// [`qkv_heads`] of `x`'s quantized projections `mats` (q, k and v, one format; two matrices:
/// the values are the keys): a decode step's queries, keys and values from the layer's normed
/// input in one op on the CPU, with the bits of `quantized_matmuls` and [`qkv_heads`].
pub fn quantized_qkv_heads(
    x: &Array,
    mats: &[&crate::Quantized],
    norms: QkvNorms<'_>,
    rotation: Rotation<'_>,
    offsets: &Array,
) -> Result<(Array, Array, Array)> {
    let first = mats
        .first()
        .ok_or_else(|| crate::Error::Mlx("quantized_qkv_heads: no matrices".into()))?;
    if mats.iter().any(|q| !q.same_format(first)) {
        return Err(crate::Error::Mlx(
            "quantized_qkv_heads: matrices of different formats".into(),
        ));
    }
    let (r, f) = rotation.ffi();
    let pack = |f: fn(&crate::Quantized) -> &Array| crate::array::pack(mats.iter().map(|q| f(q)));
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    let outs = crate::array::unpack(unsafe {
        ffi::quantized_qkv_heads(
            x.arr(),
            &pack(|q| &q.weight),
            &pack(|q| &q.scales),
            // One format: every matrix has biases (affine) or none does.
            &crate::array::pack(mats.iter().filter_map(|q| q.biases.as_ref())),
            first.group_size,
            first.bits,
            first.code(),
            &norms.ffi(),
            norms.q_norm.arr(),
            norms.k_norm.arr(),
            &r,
            offsets.arr(),
            f,
        )?
    })?;
    three(outs, "quantized_qkv_heads")
}

/// `x @ dequantize(q)ᵀ`, then [`rms_norm_residual`] of the product (an attention block's
/// output projection or an MLP's down projection and the residual update after it), and with
/// `next` the update's result RMS-normalised again ([`rms_norm_residual_norm`]):
/// `(sum, Some(norm(sum)))` or `(sum, None)`. One op on the CPU, with the bits of the product
/// and the norm op it stands for.
pub fn quantized_matmul_residual_norm(
    x: &Array,
    q: &crate::Quantized,
    weight: Option<&Array>,
    eps: f32,
    residual: &Array,
    scale: Option<&Array>,
    next: Option<&Array>,
) -> Result<(Array, Option<Array>)> {
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    let outs = crate::array::unpack(unsafe {
        ffi::quantized_matmul_norm(
            x.arr(),
            q.weight.arr(),
            q.scales.arr(),
            ptr(q.biases.as_ref()),
            q.group_size,
            q.bits,
            q.code(),
            ptr(weight),
            eps,
            residual.arr(),
            ptr(scale),
            ptr(next),
        )?
    })?;
    let mut it = outs.into_iter();
    match (it.next(), it.next(), next.is_some()) {
        (Some(sum), normed, true) if normed.is_some() => Ok((sum, normed)),
        (Some(sum), None, false) => Ok((sum, None)),
        _ => Err(crate::Error::Mlx(
            "quantized_matmul_residual_norm: unexpected number of outputs".into(),
        )),
    }
}

pub fn layer_norm(
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    Ok(Array::from_raw(unsafe {
        ffi::layer_norm(x.arr(), ptr(weight), ptr(bias), eps)?
    }))
}

/// How the rotation frequencies of [`rope`] are given.
#[derive(Debug, Clone, Copy)]
pub enum RopeFreqs<'a> {
    /// `θ_j = base^(-2j/dims)`.
    Base(f32),
    /// Explicit wavelengths: the angle of pair `j` at position `p` is `p / freqs[j]`
    /// (an infinite wavelength leaves its pair unrotated).
    Custom(&'a Array),
}

/// A rotation (RoPE): the first `dims` features of each head turn, in adjacent pairs
/// `(2j, 2j+1)` when `traditional`, else in rotate-half pairs `(j, j + dims/2)`, at `freqs`,
/// positions scaled by `scale`.
#[derive(Debug, Clone, Copy)]
pub struct Rotation<'a> {
    pub dims: i32,
    pub traditional: bool,
    pub freqs: RopeFreqs<'a>,
    pub scale: f32,
}

impl Rotation<'_> {
    /// The bridge's form: the plain settings, and the wavelengths' array (null for a base).
    fn ffi(&self) -> (ffi::Rotation, *const ffi::Arr) {
        let (base, has_base, freqs) = match self.freqs {
            RopeFreqs::Base(b) => (b, true, std::ptr::null()),
            RopeFreqs::Custom(a) => (0.0, false, ptr(Some(a))),
        };
        let r = ffi::Rotation {
            dims: self.dims,
            traditional: self.traditional,
            base,
            has_base,
            scale: self.scale,
        };
        (r, freqs)
    }
}

/// What a decode step's q/k/v op normalises its heads with: the query and key/value heads
/// (`d` each: the projections' widths over the heads), `q_norm` and `k_norm` (`[d]`) and their
/// epsilon (the values are normalised without a weight).
#[derive(Debug, Clone, Copy)]
pub struct QkvNorms<'a> {
    pub q_heads: i32,
    pub kv_heads: i32,
    pub q_norm: &'a Array,
    pub k_norm: &'a Array,
    pub eps: f32,
}

impl QkvNorms<'_> {
    fn ffi(&self) -> ffi::QkvHeads {
        ffi::QkvHeads {
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            eps: self.eps,
        }
    }
}

/// Rotary position embedding of the last axis of `x` (`[B, H, L, D]`) for positions
/// `offset .. offset + L`.
pub fn rope(x: &Array, rotation: Rotation<'_>, offset: i32) -> Result<Array> {
    let (r, f) = rotation.ffi();
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::rope(x.arr(), &r, offset, f)?
    }))
}

/// [`rope`] with the offset held in an array: a scalar, or one offset per batch row.
pub fn rope_dynamic(x: &Array, rotation: Rotation<'_>, offset: &Array) -> Result<Array> {
    let (r, f) = rotation.ffi();
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::rope_dynamic(x.arr(), &r, offset.arr(), f)?
    }))
}

/// `y: [1, T, heads·d]` (a projection of `T` tokens, each its own sequence) as `[T, heads, 1, d]`
/// heads, each RMS-normalised over `d` (by `weight`, or without one), then, with `rotation`,
/// rotated at position `offsets[t]` (`offsets`: int32, one per token or one for all). The values
/// of a reshape, [`rms_norm`] and [`rope_dynamic`]; on the CPU one op instead of three.
pub fn heads_norm_rope(
    y: &Array,
    heads: i32,
    weight: Option<&Array>,
    eps: f32,
    rotation: Option<Rotation<'_>>,
    offsets: &Array,
) -> Result<Array> {
    let none = Rotation {
        dims: 0,
        traditional: false,
        freqs: RopeFreqs::Base(1.0),
        scale: 1.0,
    };
    let (r, f) = rotation.unwrap_or(none).ffi();
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    Ok(Array::from_raw(unsafe {
        ffi::heads_norm_rope(
            y.arr(),
            heads,
            ptr(weight),
            eps,
            rotation.is_some(),
            &r,
            offsets.arr(),
            f,
        )?
    }))
}

/// One layer's decode-step queries, keys and values in one op: `q: [1, T, q_heads·d]`,
/// `k, v: [1, T, kv_heads·d]` → `[T, q_heads, 1, d]`, `[T, kv_heads, 1, d]` twice, exactly
/// what [`heads_norm_rope`] gives for `(q, q_norm, rotated)`, `(k, k_norm, rotated)` and
/// `(v, no weight, not rotated)`.
pub fn qkv_heads(
    q: &Array,
    k: &Array,
    v: &Array,
    norms: QkvNorms<'_>,
    rotation: Rotation<'_>,
    offsets: &Array,
) -> Result<(Array, Array, Array)> {
    let (r, f) = rotation.ffi();
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    let outs = crate::array::unpack(unsafe {
        ffi::qkv_heads(
            q.arr(),
            k.arr(),
            v.arr(),
            &norms.ffi(),
            norms.q_norm.arr(),
            norms.k_norm.arr(),
            &r,
            offsets.arr(),
            f,
        )?
    })?;
    three(outs, "qkv_heads")
}

/// A q/k/v op's three outputs.
fn three(outs: Vec<Array>, op: &str) -> Result<(Array, Array, Array)> {
    let mut it = outs.into_iter();
    match (it.next(), it.next(), it.next()) {
        (Some(q), Some(k), Some(v)) => Ok((q, k, v)),
        _ => Err(crate::Error::Mlx(format!("{op}: expected three outputs"))),
    }
}

/// The mask of [`scaled_dot_product_attention`].
#[derive(Debug, Clone, Copy)]
pub enum SdpaMask<'a> {
    None,
    /// Lower-right aligned causal mask (the last query sees every key).
    Causal,
    /// A boolean mask (true = attend) or an additive float mask, broadcast to `[B, H, Lq, Lk]`.
    Array(&'a Array),
}

/// `softmax(q kᵀ · scale + mask) v` with `q: [B, Hq, Lq, D]`, `k, v: [B, Hkv, Lk, D]`;
/// grouped-query attention when `Hq` is a multiple of `Hkv`.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: SdpaMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let kv = KvSlots::all(k.clone(), v.clone());
    let attn = Attention {
        scale,
        mask,
        sinks,
        layout: SdpaLayout::Heads,
    };
    sdpa_slots(q, &kv, attn)
}

/// The first `len` time slots of a cache's key and value buffers (`[B, Hkv, S, D]`, `len ≤ S`,
/// dense or quantized): what attention over the cache reads, without a view op per buffer.
#[derive(Debug, Clone)]
pub struct KvSlots {
    pub keys: Rows,
    pub values: Rows,
    pub len: usize,
}

impl KvSlots {
    /// Every slot of dense `keys` and `values`.
    pub fn all(keys: Array, values: Array) -> KvSlots {
        KvSlots::of(Rows::Dense(keys), Rows::Dense(values))
    }

    /// Every slot of `keys` and `values`.
    pub fn of(keys: Rows, values: Rows) -> KvSlots {
        let len = keys.time_len();
        KvSlots { keys, values, len }
    }

    /// The slots as values of exactly `len` positions (views of dense buffers, quantized ones
    /// dequantized).
    pub fn view(&self) -> Result<(Array, Array)> {
        let first = |r: &Rows| -> Result<Array> {
            if r.time_len() == self.len {
                return r.dense();
            }
            r.time(0, self.len)?.dense()
        };
        Ok((first(&self.keys)?, first(&self.values)?))
    }
}

/// How attention's output is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SdpaLayout {
    /// `[B, Hq, L, Dv]`, as the queries.
    Heads,
    /// `[B, L, Hq·Dv]`: each token's heads side by side, what an output projection reads (no
    /// transpose or reshape op after attention).
    Tokens,
}

/// What [`sdpa_slots`] and [`sdpa_write`] compute besides their inputs.
#[derive(Debug, Clone, Copy)]
pub struct Attention<'a> {
    pub scale: f32,
    /// If an array, it covers exactly the slots read.
    pub mask: SdpaMask<'a>,
    pub sinks: Option<&'a Array>,
    pub layout: SdpaLayout,
}

impl<'a> Attention<'a> {
    /// No sinks, heads apart.
    pub fn new(scale: f32, mask: SdpaMask<'a>) -> Self {
        Attention {
            scale,
            mask,
            sinks: None,
            layout: SdpaLayout::Heads,
        }
    }

    pub fn with_layout(self, layout: SdpaLayout) -> Self {
        Attention { layout, ..self }
    }
}

fn mask_parts<'a>(mask: SdpaMask<'a>) -> (&'static str, Option<&'a Array>) {
    match mask {
        SdpaMask::None => ("", None),
        SdpaMask::Causal => ("causal", None),
        SdpaMask::Array(a) => ("array", Some(a)),
    }
}

fn slot_count(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| crate::Error::Mlx(format!("sdpa: {n} slots is too many")))
}

/// The one FFI call behind [`sdpa_slots`] (no `new` rows) and [`sdpa_write`].
fn sdpa_ffi(
    q: &Array,
    kv: &KvSlots,
    new: Option<((&Rows, &Rows), usize)>,
    attn: Attention<'_>,
) -> Result<Vec<Array>> {
    let (mode, arr) = mask_parts(attn.mask);
    let (group, bits) = match &kv.keys {
        Rows::Dense(_) => (0, 0),
        Rows::Affine(q) => (q.group_size, q.bits),
    };
    let (rows, at) = match new {
        Some(((k, v), at)) => ((pack(k.arrays()), pack(v.arrays())), slot_count(at)?),
        None => ((pack([]), pack([])), -1),
    };
    // SAFETY: the pointers are null or point at arrays that outlive the call.
    crate::array::unpack(unsafe {
        ffi::sdpa_slots(
            q.arr(),
            &pack(kv.keys.arrays()),
            &pack(kv.values.arrays()),
            slot_count(kv.len)?,
            &rows.0,
            &rows.1,
            at,
            group,
            bits,
            attn.scale,
            mode,
            ptr(arr),
            ptr(attn.sinks),
            attn.layout == SdpaLayout::Tokens,
        )?
    })
}

/// [`scaled_dot_product_attention`] over the slots `kv` names.
pub fn sdpa_slots(q: &Array, kv: &KvSlots, attn: Attention<'_>) -> Result<Array> {
    sdpa_ffi(q, kv, None, attn)?
        .into_iter()
        .next()
        .ok_or_else(|| crate::Error::Mlx("sdpa: expected an output".into()))
}

/// A cache write and the attention that reads it, in one op: the rows of `new` (keys and values,
/// `[B, Hkv, L, D]`) are written into the buffers `into.keys` and `into.values` at slots
/// `at..at + L`, then `q` attends over their first `into.len` slots. Returns the attention and
/// the buffers with the rows (the same slots). A buffer nothing else holds is updated in place,
/// as MLX's `slice_update` does; otherwise it is copied first.
pub fn sdpa_write(
    q: &Array,
    new: (&Rows, &Rows),
    into: &KvSlots,
    at: usize,
    attn: Attention<'_>,
) -> Result<(Array, KvSlots)> {
    if new.0.bits() != into.keys.bits() || new.1.bits() != into.values.bits() {
        return Err(crate::Error::Mlx(
            "sdpa_write: new rows stored unlike the buffers".into(),
        ));
    }
    let mut it = sdpa_ffi(q, into, Some((new, at)), attn)?.into_iter();
    let out = it
        .next()
        .ok_or_else(|| crate::Error::Mlx("sdpa_write: no attention output".into()))?;
    let n = into.keys.arrays().len();
    let k: Vec<Array> = it.by_ref().take(n).collect();
    let v: Vec<Array> = it.collect();
    if k.len() != n || v.len() != n {
        return Err(crate::Error::Mlx(
            "sdpa_write: expected the written buffers back".into(),
        ));
    }
    Ok((
        out,
        KvSlots {
            keys: Rows::from_arrays(k, into.keys.bits())?,
            values: Rows::from_arrays(v, into.values.bits())?,
            len: into.len,
        },
    ))
}

/// Columns per panel of [`pack_panels`].
pub const PANEL: i32 = 32;

/// `w` (`[N, K]`, a checkpoint's `[out, in]`) as column panels of `x @ wᵀ`: `[N / 32, K, 32]`,
/// panel `p` holding `wᵀ[:, 32p .. 32p + 32]` row by row in one block, the layout the CPU's
/// product streams ([`panel_matmul`]). `None` where `N` is not a multiple of 32.
pub fn pack_panels(w: &Array) -> Result<Option<Array>> {
    let shape = w.shape();
    if shape.len() != 2 || shape[0] % PANEL != 0 || shape[0] == 0 || shape[1] == 0 {
        return Ok(None);
    }
    Ok(Some(w.row_panels(PANEL)?))
}

/// `Wᵀ` (`[K, N]`) from its panels ([`pack_panels`]), as a new array.
pub fn unpack_panels(panels: &Array) -> Result<Array> {
    let s = panels.shape();
    panels
        .transpose(&[1, 0, 2])?
        .reshape(&[s[1], s[0] * s[2]])?
        .contiguous()
}

/// The widest vectors of the CPU kernels whose bits do not depend on their width: 512, 256 or 0
/// bits (scalar), capped by the CPU (default 512). [`panel_matmul`] takes all three; attention
/// over a quantized cache reads its values with 512 or 256 (0 acts as 256). Every width gives
/// the same bits; tests check that.
pub fn set_vector_width(bits: i32) {
    ffi::set_vector_width(bits)
}

/// `x @ Wᵀ` for `W` held as panels ([`pack_panels`]): one op on the CPU, which reads each panel
/// once and multiplies it into every row of `x`, eight rows at a time; elsewhere MLX's product
/// of `x` with every panel, the output laid out as `[.., N]`.
pub fn panel_matmul(x: &Array, panels: &Array) -> Result<Array> {
    Ok(Array::from_raw(ffi::panel_matmul(x.arr(), panels.arr())?))
}

/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`, the tanh approximation of GELU.
pub fn gelu_tanh(x: &Array) -> Result<Array> {
    Ok(Array::from_raw(ffi::gelu_tanh(x.arr())?))
}

/// `cap · tanh(x / cap)`: soft-capping (gemma4's final logits).
/// Softmax over the last axis: one op with a vectorized exponential on the CPU (MLX's CPU
/// softmax calls libm once per value), MLX's softmax elsewhere.
pub fn softmax(x: &Array) -> Result<Array> {
    Ok(Array::from_raw(ffi::softmax_last(x.arr())?))
}

pub fn softcap(x: &Array, cap: f32) -> Result<Array> {
    Ok(Array::from_raw(ffi::softcap(x.arr(), cap)?))
}

/// `silu(g) · u` (`g · sigmoid(g) · u`) for `g` and `u` of one shape: a SwiGLU's gate times its
/// up projection.
pub fn silu_mul(g: &Array, u: &Array) -> Result<Array> {
    Ok(Array::from_raw(ffi::silu_mul(g.arr(), u.arr())?))
}

/// `σ(g) · u` (a GLU's gate), one vectorized op on the CPU (MLX's sigmoid calls libm per value).
pub fn sigmoid_mul(g: &Array, u: &Array) -> Result<Array> {
    Ok(Array::from_raw(ffi::sigmoid_mul(g.arr(), u.arr())?))
}

/// Turns mlx-runner's fused CPU kernels on (the default) or off: off, RMS norm, RoPE, attention
/// and GELU are MLX's op graphs and few-row matmuls MLX's own (for comparisons and the kernels'
/// exactness tests). Applies to graphs built after the call.
pub fn set_fused_kernels(on: bool) {
    ffi::set_fused_kernels(on)
}

/// How many times each fused CPU kernel has run in this process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FusedCounts {
    pub rms_norm: u64,
    pub rope: u64,
    pub sdpa: u64,
    pub gelu_tanh: u64,
    /// Few-row float32 matmuls against a loaded weight (`x @ W`, `Array::matmul`).
    pub matmul: u64,
    pub softcap: u64,
    pub silu_mul: u64,
    /// [`heads_norm_rope`]'s one op.
    pub heads_norm_rope: u64,
    /// [`sdpa_write`]s that had to copy their buffers (another array or op still held them).
    pub sdpa_write_copies: u64,
    pub softmax: u64,
    /// [`panel_matmul`]s.
    pub panel_matmul: u64,
}

pub fn fused_kernel_counts() -> FusedCounts {
    FusedCounts {
        rms_norm: ffi::fused_kernel_count(0),
        rope: ffi::fused_kernel_count(1),
        sdpa: ffi::fused_kernel_count(2),
        gelu_tanh: ffi::fused_kernel_count(3),
        matmul: ffi::fused_kernel_count(4),
        softcap: ffi::fused_kernel_count(5),
        silu_mul: ffi::fused_kernel_count(6),
        heads_norm_rope: ffi::fused_kernel_count(7),
        sdpa_write_copies: ffi::fused_kernel_count(8),
        softmax: ffi::fused_kernel_count(9),
        panel_matmul: ffi::fused_kernel_count(10),
    }
}
