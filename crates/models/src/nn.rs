//! The building blocks both model families share: linear layers and embeddings (dense or
//! mlx-lm quantized), stacked experts for mixture-of-experts layers, activations, RoPE.

use crate::weights::{Vb, Weights};
use crate::Result;
use mlx::fast::{rms_norm, rope, QkvNorms, RopeFreqs, Rotation};
use mlx::{Array, Quantized};

/// `y = x Wᵀ`, with `W` stored `[out, in]` as in the checkpoints.
#[derive(Clone)]
pub enum Linear {
    /// Holds `Wᵀ` (`[in, out]`), laid out by [`weight_layout`].
    Dense {
        wt: Array,
    },
    /// A float32 `W` on the CPU as column panels of `Wᵀ`, `[out / 32, in, 32]`
    /// ([`mlx::fast::pack_panels`]): the layout the CPU's product streams at memory speed
    /// however many rows a step multiplies (a decode step over eight rows took twice the
    /// one-row time with a row-major `Wᵀ`), prefill chunks included (docs/MODELS.md, "Float32
    /// weights on the CPU").
    Paneled {
        panels: Array,
    },
    Quantized(Quantized),
    /// A quantized matrix times a float32 global scale, `[]` (per tensor) or `[out]` (per
    /// row): NVIDIA's nvfp4 checkpoints (crate::prequant). The products are MLX's nvfp4 ones,
    /// then one multiply; the fused ops take plain tables only.
    Scaled {
        q: Quantized,
        global: Array,
    },
    /// This rank's columns (input features) of a matrix split by tensors: its products are
    /// partial, and summed over the ranks (crate::parallel::Shard). The fused ops take
    /// the other forms only: the sum comes between the product and what follows it.
    Summed {
        part: Box<Linear>,
        shard: crate::parallel::Shard,
    },
}

/// Rows `ids` of a quantized table, dequantized: only those rows are decoded.
fn quantized_rows(q: &Quantized, ids: &Array) -> Result<Array> {
    if q.panels {
        // A panel holds 16 rows interleaved: the lookup op reads one row's words from it.
        return Ok(q.lookup(ids, None)?);
    }
    let part = |a: &Array| a.take(ids, 0);
    Ok(Quantized {
        weight: part(&q.weight)?,
        scales: part(&q.scales)?,
        biases: q.biases.as_ref().map(part).transpose()?,
        ..*q
    }
    .dequantize()?)
}

/// `y · g` in `y`'s dtype (`g` float32, broadcast over `y`'s last axis or scalar).
fn times_global(y: Array, global: &Array) -> Result<Array> {
    let dtype = y.dtype();
    Ok(y.multiply(global)?.astype(dtype)?)
}

/// `Wᵀ` in the layout this device multiplies fastest. On the CPU, `[in, out]` row-major:
/// OpenBLAS's matrix-vector kernel streams that layout at ~13 GB/s here against ~10 GB/s for
/// the checkpoint's `[out, in]` read transposed, and decoding is bound by reading the weights
/// once per token (measured with `x @ W` against `x @ W.T` on a 476 MB matrix). So on the CPU
/// the weights are transposed once at load; elsewhere a transposed view costs nothing.
pub fn weight_layout(weights: &Weights, w: &Array) -> Result<Array> {
    let t = w.t()?;
    Ok(if mlx::default_device() == mlx::Device::Cpu {
        weights.keep_instead(w, t.contiguous()?)
    } else {
        t
    })
}

/// `w` (`[out, in]`) as column panels where the CPU multiplies them ([`Linear::Paneled`]):
/// float32, on the CPU, `out` a multiple of 32.
fn panels_of(w: &Array) -> Result<Option<Array>> {
    if mlx::default_device() != mlx::Device::Cpu || w.dtype() != mlx::Dtype::F32 {
        return Ok(None);
    }
    Ok(mlx::fast::pack_panels(w)?)
}

impl Linear {
    pub fn dense(weights: &Weights, w: Array) -> Result<Linear> {
        if let Some(panels) = panels_of(&w)? {
            return Ok(Linear::Paneled {
                panels: weights.keep_instead(&w, panels),
            });
        }
        Ok(Linear::Dense {
            wt: weight_layout(weights, &w)?,
        })
    }

    /// A dense layer from `Wᵀ` (`[in, out]`, kept for loading), in the layout [`Linear::dense`]
    /// gives it.
    pub(crate) fn from_wt(weights: &Weights, wt: Array) -> Result<Linear> {
        if let Some(panels) = panels_of(&wt.t()?)? {
            return Ok(Linear::Paneled {
                panels: weights.keep_instead(&wt, panels),
            });
        }
        Ok(Linear::Dense { wt })
    }

    /// Withdraws this layer's tensors from those evaluated at load ([`Weights::withdraw`]):
    /// for a layer used only to make other tensors at load.
    pub(crate) fn withdraw(&self, weights: &Weights) {
        match self {
            Linear::Dense { wt } => weights.withdraw(wt),
            Linear::Paneled { panels } => weights.withdraw(panels),
            Linear::Quantized(q) => weights.withdraw_quantized(q),
            Linear::Scaled { q, global } => {
                weights.withdraw_quantized(q);
                weights.withdraw(global);
            }
            Linear::Summed { part, .. } => part.withdraw(weights),
        }
    }

    /// Output features (of a part summed over ranks: the whole's).
    pub fn outputs(&self) -> usize {
        match self {
            Linear::Dense { wt } => wt.shape().last().copied().unwrap_or(0) as usize,
            Linear::Paneled { panels } => (panels.shape()[0] * mlx::fast::PANEL) as usize,
            Linear::Quantized(q) | Linear::Scaled { q, .. } => q.outputs().max(0) as usize,
            Linear::Summed { part, .. } => part.outputs(),
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Linear::Dense { wt } => x.matmul(wt)?,
            Linear::Paneled { panels } => mlx::fast::panel_matmul(x, panels)?,
            Linear::Quantized(q) => x.quantized_matmul(q, true)?,
            Linear::Scaled { q, global } => times_global(x.quantized_matmul(q, true)?, global)?,
            Linear::Summed { part, shard } => shard.sum(&part.forward(x)?)?,
        })
    }

    /// [`add_norm`] of this layer's output: `(residual + norm(x Wᵀ, w)) · scale`, a post-norm
    /// block's output projection and residual update; one op where W is quantized on the CPU.
    pub fn forward_add_norm(
        &self,
        x: &Array,
        residual: &Array,
        w: Option<&Array>,
        eps: f32,
        scale: Option<&Array>,
    ) -> Result<Array> {
        Ok(match self {
            Linear::Quantized(q) => {
                mlx::fast::quantized_matmul_residual_norm(x, q, w, eps, residual, scale, None)?.0
            }
            Linear::Dense { .. }
            | Linear::Paneled { .. }
            | Linear::Scaled { .. }
            | Linear::Summed { .. } => add_norm(residual, &self.forward(x)?, w, eps, scale)?,
        })
    }

    /// [`Linear::forward_add_norm`], and its result normalised again by `next` (the next
    /// block's input norm): `(sum, norm(sum, next))`, as [`add_norm_then_norm`] gives them.
    pub fn forward_add_norm_then_norm(
        &self,
        x: &Array,
        residual: &Array,
        w: Option<&Array>,
        eps: f32,
        scale: Option<&Array>,
        next: &Array,
    ) -> Result<(Array, Array)> {
        match self {
            Linear::Quantized(q) => {
                match mlx::fast::quantized_matmul_residual_norm(
                    x,
                    q,
                    w,
                    eps,
                    residual,
                    scale,
                    Some(next),
                )? {
                    (sum, Some(normed)) => Ok((sum, normed)),
                    (_, None) => Err(crate::ModelError::Invalid(
                        "a projection's residual update returned no next norm".into(),
                    )),
                }
            }
            Linear::Dense { .. }
            | Linear::Paneled { .. }
            | Linear::Scaled { .. }
            | Linear::Summed { .. } => {
                add_norm_then_norm(residual, &self.forward(x)?, w, eps, scale, next)
            }
        }
    }
}

/// `x Wᵢᵀ` for several layers that read the same `x` (an attention block's q, k and v): one op
/// when all are quantized in one format ([`Array::quantized_matmuls`]), else one product each.
pub fn forward_all(x: &Array, layers: &[&Linear]) -> Result<Vec<Array>> {
    match quantized_alike(layers) {
        Some(qs) if qs.len() > 1 => Ok(x.quantized_matmuls(&qs)?),
        _ => layers.iter().map(|l| l.forward(x)).collect(),
    }
}

/// The layers' quantized matrices, where every layer is quantized and all in one format (bits
/// and group size): what one op over several of them takes.
pub fn quantized_alike<'a>(layers: &[&'a Linear]) -> Option<Vec<&'a Quantized>> {
    let qs: Vec<&Quantized> = layers
        .iter()
        .map(|l| match l {
            Linear::Quantized(q) => Some(q),
            Linear::Dense { .. }
            | Linear::Paneled { .. }
            | Linear::Scaled { .. }
            | Linear::Summed { .. } => None,
        })
        .collect::<Option<_>>()?;
    let first = *qs.first()?;
    qs.iter().all(|q| q.same_format(first)).then_some(qs)
}

/// Expert matrices `[E, out, in]` applied per token to its selected experts in one
/// `gather_mm` / `gather_qmm` call (no loop over experts).
pub enum Experts {
    /// Holds `[E, in, out]`, transposed and made contiguous once at load.
    Dense {
        wt: Array,
    },
    Quantized(Quantized),
    /// Quantized experts times a float32 global scale per expert (`[E]`) or for all (`[]`).
    Scaled {
        q: Quantized,
        global: Array,
    },
}

impl Experts {
    pub fn dense(weights: &Weights, w: Array) -> Result<Experts> {
        let wt = weights.keep_instead(&w, w.swapaxes(-1, -2)?.contiguous()?);
        Ok(Experts::Dense { wt })
    }

    /// Withdraws these matrices from those evaluated at load ([`Weights::withdraw`]).
    pub(crate) fn withdraw(&self, weights: &Weights) {
        match self {
            Experts::Dense { wt } => weights.withdraw(wt),
            Experts::Quantized(q) => weights.withdraw_quantized(q),
            Experts::Scaled { q, global } => {
                weights.withdraw_quantized(q);
                weights.withdraw(global);
            }
        }
    }

    /// The two halves (along the output rows) of a fused, quantized `[E, 2·out, in]` stack, as
    /// ollama stores transformers' `experts.gate_up_proj`: quantization groups run along the
    /// input dimension, so splitting rows splits the packed words, scales and biases alike.
    pub fn quantized_halves(weights: &Weights, q: Quantized) -> Result<(Experts, Experts)> {
        let w = q.weight.split(2, 1)?;
        let s = q.scales.split(2, 1)?;
        let b = q.biases.as_ref().map(|b| b.split(2, 1)).transpose()?;
        let half = |i: usize| -> Result<Experts> {
            Ok(Experts::Quantized(Quantized {
                weight: weights.keep(w[i].contiguous()?),
                scales: weights.keep(s[i].contiguous()?),
                biases: match &b {
                    Some(b) => Some(weights.keep(b[i].contiguous()?)),
                    None => None,
                },
                ..q
            }))
        };
        Ok((half(0)?, half(1)?))
    }

    /// `x: [..., 1, in]` (one row per token and selected expert), `idx: [..., k]` expert ids;
    /// returns `[..., k, 1, out]`.
    pub fn forward(&self, x: &Array, idx: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            Experts::Dense { wt } => x.gather_mm(wt, None, Some(idx), sorted)?,
            Experts::Quantized(q) => x.gather_qmm(q, None, Some(idx), true, sorted)?,
            Experts::Scaled { q, global } => {
                let y = x.gather_qmm(q, None, Some(idx), true, sorted)?;
                let g = if global.ndim() == 0 {
                    global.clone()
                } else {
                    // [..., k] → [..., k, 1, 1] against y's [..., k, 1, out].
                    global.take(idx, 0)?.expand_dims_axes(&[-1, -2])?
                };
                times_global(y, &g)?
            }
        })
    }
}

/// Columns `ids` (any shape) of `Wᵀ` held as panels `[N / 32, K, 32]`: `[..ids, K]`. Column
/// `n` is element `n % 32` of each row of panel `n / 32`, so each id reads its K values alone.
fn panel_columns(panels: &Array, ids: &Array) -> Result<Array> {
    let s = panels.shape();
    let (k, width) = (f64::from(s[1]), f64::from(s[2]));
    let ids = ids.astype(mlx::Dtype::I32)?;
    // Offset of (id, row 0) in the flat panels, then one row of `width` per k.
    let first = ids
        .floor_divide_scalar(width)?
        .multiply_scalar(k * width)?
        .add(&ids.remainder_scalar(width)?)?;
    let rows = Array::arange(0.0, k, 1.0, mlx::Dtype::I32)?.multiply_scalar(width)?;
    let at = first.expand_dims(-1)?.add(&rows)?;
    Ok(panels.reshape(&[-1])?.take(&at, 0)?)
}

/// A token embedding table `[V, H]`, also usable as a tied output head.
#[derive(Clone)]
pub enum Embedding {
    /// `[V, H]`.
    Dense(Array),
    /// `Eᵀ`, `[H, V]`: a tied head in the CPU's fast layout ([`weight_layout`]); lookups
    /// gather columns, which costs little next to the head reading the whole table per token.
    DenseTransposed(Array),
    /// A float32 tied head on the CPU as column panels of `Eᵀ`, `[V / 32, H, 32]`
    /// ([`Linear::Paneled`]); a lookup gathers each token's column out of its panel.
    Paneled(Array),
    Quantized(Quantized),
    /// A quantized table times a float32 global scale (`[]`).
    Scaled {
        q: Quantized,
        global: Array,
    },
}

impl Embedding {
    /// The same table, laid out for use as a tied output head on this device.
    pub fn for_tied_head(self, weights: &Weights) -> Result<Embedding> {
        Ok(match self {
            Embedding::Dense(w) if mlx::default_device() == mlx::Device::Cpu => {
                // A lookup indexes the flat panels with int32.
                let fits = w.size() <= i32::MAX as usize;
                match panels_of(&w)?.filter(|_| fits) {
                    Some(panels) => Embedding::Paneled(weights.keep_instead(&w, panels)),
                    None => Embedding::DenseTransposed(weight_layout(weights, &w)?),
                }
            }
            // Panels serve the head's product; a lookup reads a row's words 16 apart in its
            // panel, so tables only looked up (per-layer embeddings) keep MLX's rows.
            Embedding::Quantized(q) => Embedding::Quantized(weights.paneled(q)?),
            other => other,
        })
    }

    /// Rows for `ids` (any shape): `[..ids, H]`.
    pub fn lookup(&self, ids: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(w) => w.take(ids, 0)?,
            Embedding::DenseTransposed(wt) => {
                // [H, ..ids] -> [..ids, H]
                let cols = wt.take(ids, 1)?;
                let n = cols.ndim() as i32;
                let axes: Vec<i32> = (1..n).chain(std::iter::once(0)).collect();
                cols.transpose(&axes)?
            }
            Embedding::Paneled(panels) => panel_columns(panels, ids)?,
            Embedding::Quantized(q) => quantized_rows(q, ids)?,
            Embedding::Scaled { q, global } => times_global(quantized_rows(q, ids)?, global)?,
        })
    }

    /// [`Embedding::lookup`] times `scale` (gemma4's √H): one op where the table is quantized
    /// on the CPU, with the values of the lookup and the float32 multiply.
    pub fn lookup_scaled(&self, ids: &Array, scale: f32) -> Result<Array> {
        Ok(match self {
            Embedding::Quantized(q) => q.lookup(ids, Some(scale))?,
            _ => self.lookup(ids)?.multiply_scalar(f64::from(scale))?,
        })
    }

    /// `h Eᵀ`: the tied head.
    pub fn as_linear(&self, h: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(w) => h.matmul(&w.t()?)?,
            Embedding::DenseTransposed(wt) => h.matmul(wt)?,
            Embedding::Paneled(panels) => mlx::fast::panel_matmul(h, panels)?,
            Embedding::Quantized(q) => h.quantized_matmul(q, true)?,
            Embedding::Scaled { q, global } => times_global(h.quantized_matmul(q, true)?, global)?,
        })
    }
}

/// The activation of a gated MLP's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// gelu_pytorch_tanh: GeGLU (gemma4).
    GeluTanh,
    /// SiLU: SwiGLU (GLM).
    Silu,
}

impl Activation {
    /// `act(g) ⊙ u`.
    pub fn gated(self, g: &Array, u: &Array) -> Result<Array> {
        match self {
            Activation::GeluTanh => Ok(gelu_tanh(g)?.multiply(u)?),
            Activation::Silu => silu_mul(g, u),
        }
    }
}

/// A gated MLP: `down(act(gate x) ⊙ up x)`.
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub act: Activation,
}

impl GatedMlp {
    /// `gate_proj`, `up_proj` and `down_proj` under `vb`, for hidden size `h` and intermediate
    /// size `i`.
    pub(crate) fn load(
        vb: &crate::weights::Vb,
        h: i32,
        i: i32,
        act: Activation,
    ) -> Result<GatedMlp> {
        Ok(GatedMlp {
            gate: vb.pp("gate_proj").linear(i, h)?,
            up: vb.pp("up_proj").linear(i, h)?,
            down: vb.pp("down_proj").linear(h, i)?,
            act,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.down.forward(&self.hidden(x)?)
    }

    /// `act(x Gᵀ) ⊙ x Uᵀ`, what the down projection reads: one op for the two products and the
    /// gate where the two are quantized alike.
    pub fn hidden(&self, x: &Array) -> Result<Array> {
        if let (Linear::Quantized(g), Linear::Quantized(u)) = (&self.gate, &self.up) {
            if g.same_format(u) {
                return Ok(match self.act {
                    Activation::GeluTanh => x.quantized_geglu(g, u)?,
                    Activation::Silu => x.quantized_swiglu(g, u)?,
                });
            }
        }
        self.act.gated(&self.gate.forward(x)?, &self.up.forward(x)?)
    }
}

/// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` (gelu_pytorch_tanh).
pub fn gelu_tanh(x: &Array) -> Result<Array> {
    Ok(mlx::fast::gelu_tanh(x)?)
}

/// `silu(g) · u`, one op on the CPU.
pub fn silu_mul(g: &Array, u: &Array) -> Result<Array> {
    Ok(mlx::fast::silu_mul(g, u)?)
}

/// RMS norm with a learned scale (`None`: the no-scale variant).
pub fn norm(x: &Array, w: Option<&Array>, eps: f32) -> Result<Array> {
    Ok(rms_norm(x, w, eps)?)
}

/// `(residual + norm(x, w, eps)) · scale`: a post-norm block's residual update, times a
/// one-element scale if given (gemma4's layer scalar), one op.
pub fn add_norm(
    residual: &Array,
    x: &Array,
    w: Option<&Array>,
    eps: f32,
    scale: Option<&Array>,
) -> Result<Array> {
    Ok(mlx::fast::rms_norm_residual(x, w, eps, residual, scale)?)
}

/// [`add_norm`], and its result normalised again by `next` (the next block's input norm):
/// `(sum, norm(sum, next))`, one op.
pub fn add_norm_then_norm(
    residual: &Array,
    x: &Array,
    w: Option<&Array>,
    eps: f32,
    scale: Option<&Array>,
    next: &Array,
) -> Result<(Array, Array)> {
    Ok(mlx::fast::rms_norm_residual_norm(
        x, w, eps, residual, scale, next,
    )?)
}

/// How one kind of layer rotates its queries and keys.
#[derive(Clone)]
pub struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    /// Explicit wavelengths (gemma4's proportional RoPE) instead of `base`.
    freqs: Option<Array>,
}

impl Rope {
    /// Standard RoPE over the first `dims` features with `θ_j = base^(-2j/dims)`.
    pub fn standard(dims: i32, base: f32, traditional: bool) -> Rope {
        Rope {
            dims,
            traditional,
            base,
            freqs: None,
        }
    }

    /// Rotate-half over all `head_dim` features where only the first `rotated` frequency pairs
    /// turn: pair `j < rotated` has wavelength `base^(2j/head_dim) · factor`, the rest infinite
    /// (docs/MODELS.md §1.3, "proportional").
    pub fn proportional(head_dim: i32, rotated: i32, base: f32, factor: f32) -> Result<Rope> {
        let half = head_dim / 2;
        let f: Vec<f32> = (0..half)
            .map(|j| {
                if j < rotated {
                    (f64::from(base).powf(2.0 * f64::from(j) / f64::from(head_dim))
                        * f64::from(factor)) as f32
                } else {
                    f32::INFINITY
                }
            })
            .collect();
        Ok(Rope {
            dims: head_dim,
            traditional: false,
            base,
            freqs: Some(Array::from_slice(&f, &[half])?),
        })
    }

    fn freqs(&self) -> RopeFreqs<'_> {
        match &self.freqs {
            Some(f) => RopeFreqs::Custom(f),
            None => RopeFreqs::Base(self.base),
        }
    }

    fn rotation(&self) -> Rotation<'_> {
        Rotation {
            dims: self.dims,
            traditional: self.traditional,
            freqs: self.freqs(),
            scale: 1.0,
        }
    }

    /// A decode step's queries or keys from their projection `y: [1, T, heads·d]` (token `t`
    /// its own sequence, at position `offsets[t]`): `[T, heads, 1, d]`, each head
    /// RMS-normalised by `weight`, then rotated. One op on the CPU where a reshape, a norm and
    /// a rotation would be three; the same values.
    pub fn heads_rows(
        &self,
        y: &Array,
        heads: i32,
        weight: Option<&Array>,
        eps: f32,
        offsets: &Array,
    ) -> Result<Array> {
        Ok(mlx::fast::heads_norm_rope(
            y,
            heads,
            weight,
            eps,
            Some(self.rotation()),
            offsets,
        )?)
    }

    /// A decode step's queries, keys and values from their projections (`[1, T, heads·d]`,
    /// `[1, T, kv_heads·d]` twice), in one op: the queries and keys as [`Rope::heads_rows`]
    /// gives them with their norms, the values normalised without a weight and not rotated.
    /// The same values as three calls, one op where they would be three.
    pub fn qkv_rows(
        &self,
        (q, k, v): (&Array, &Array, &Array),
        norms: QkvNorms<'_>,
        offsets: &Array,
    ) -> Result<(Array, Array, Array)> {
        Ok(mlx::fast::qkv_heads(
            q,
            k,
            v,
            norms,
            self.rotation(),
            offsets,
        )?)
    }

    /// [`Rope::qkv_rows`] of `x`'s quantized projections `mats` (q, k and v; two when the
    /// values are the keys): one op on the CPU, the projections' and the heads' bits.
    pub fn quantized_qkv_rows(
        &self,
        x: &Array,
        mats: &[&Quantized],
        norms: QkvNorms<'_>,
        offsets: &Array,
    ) -> Result<(Array, Array, Array)> {
        Ok(mlx::fast::quantized_qkv_heads(
            x,
            mats,
            norms,
            self.rotation(),
            offsets,
        )?)
    }

    /// Rotates `x: [B, H, L, D]`, row `b` for positions `offsets[b]..offsets[b]+L`, in one
    /// operation (a decode step of several sequences).
    pub fn apply_rows(&self, x: &Array, offsets: &[usize]) -> Result<Array> {
        let o: Vec<i32> = offsets.iter().map(|&o| o as i32).collect();
        let o = Array::from_slice(&o, &[o.len() as i32])?;
        Ok(mlx::fast::rope_dynamic(x, self.rotation(), &o)?)
    }

    /// Rotates `x: [B, H, L, D]` for positions `offset..offset+L`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array> {
        Ok(rope(x, self.rotation(), offset as i32)?)
    }
}

/// A linear layer whose input and output may be clamped to stored bounds
/// (`use_clipped_linears`: `<m>.input_min/max`, `<m>.output_min/max`, the weight under
/// `<m>.linear`).
pub(crate) struct ClippedLinear {
    linear: Linear,
    input: Option<(Array, Array)>,
    output: Option<(Array, Array)>,
}

impl ClippedLinear {
    pub(crate) fn load(vb: &Vb, clipped: bool, out: i32, inp: i32) -> Result<ClippedLinear> {
        let linear = vb.pp("linear").linear(out, inp)?;
        if !clipped {
            return Ok(ClippedLinear {
                linear,
                input: None,
                output: None,
            });
        }
        let bound = |leaf: &str| vb.get_f32(leaf, &[]);
        Ok(ClippedLinear {
            linear,
            input: Some((bound("input_min")?, bound("input_max")?)),
            output: Some((bound("output_min")?, bound("output_max")?)),
        })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let clip = |x: &Array, b: &Option<(Array, Array)>| -> Result<Array> {
            Ok(match b {
                Some((lo, hi)) => x.clip(Some(lo), Some(hi))?.astype(x.dtype())?,
                None => x.clone(),
            })
        };
        clip(&self.linear.forward(&clip(x, &self.input)?)?, &self.output)
    }
}
