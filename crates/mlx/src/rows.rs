//! A cache buffer's rows: logically `[B, H, T, D]` with time on axis 2, stored either as one
//! dense array or as MLX's affine quantization along `D` (packed words, scales and biases, each
//! `[B, H, T, ·]`, so that every time operation is the same operation on each of the three).

use crate::{Array, Dtype, Ix, Quantized, Result};

/// How a cache stores the rows it is given (`--kv-cache-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowFormat {
    /// As computed.
    #[default]
    AsComputed,
    /// Cast to a float type.
    Float(Dtype),
    /// MLX's affine quantization with `bits` per value, groups of [`RowFormat::group_for`]
    /// values along `D`. Rows of a width no group size divides (only tiny test models have
    /// them) are stored as float16 instead.
    Affine { bits: i32 },
}

impl RowFormat {
    /// The group size affine rows of width `d` use: 64 (mlx-lm's quantized cache) where it
    /// divides `d`, else 32, the smallest MLX has; `None` where neither does.
    pub fn group_for(d: usize) -> Option<i32> {
        Self::group_for_parts(d, d)
    }

    /// The same for rows whose first `part` values are read apart (MLA's values, the latent
    /// part of its rows): the group divides both.
    pub fn group_for_parts(d: usize, part: usize) -> Option<i32> {
        [64, 32]
            .into_iter()
            .find(|g| d.is_multiple_of(*g as usize) && part.is_multiple_of(*g as usize))
    }

    /// A short name (`f32`, `q8`, ...) for logs and file keys.
    pub fn name(&self) -> String {
        match self {
            RowFormat::AsComputed => "computed".into(),
            RowFormat::Float(d) => format!("{d:?}").to_lowercase(),
            RowFormat::Affine { bits } => format!("q{bits}"),
        }
    }
}

/// A buffer's rows (see the module docs).
#[derive(Debug, Clone)]
pub enum Rows {
    Dense(Array),
    Affine(Quantized),
}

fn time_of(a: &Array, start: usize, end: usize) -> Result<Array> {
    a.index(&[
        Ix::full(),
        Ix::full(),
        Ix::slice(Some(start as i32), Some(end as i32), 1),
    ])
}

impl Rows {
    /// `x` (`[B, H, L, D]`) stored as `format` says.
    pub fn encode(x: &Array, format: RowFormat) -> Result<Rows> {
        let d = x.shape().last().copied().unwrap_or(0).max(0) as usize;
        Self::encode_parts(x, format, d)
    }

    /// As [`Rows::encode`], for rows whose first `part` values are read apart
    /// ([`Rows::first_values`]): a quantization group never straddles the two parts.
    pub fn encode_parts(x: &Array, format: RowFormat, part: usize) -> Result<Rows> {
        Ok(match format {
            RowFormat::AsComputed => Rows::Dense(x.clone()),
            RowFormat::Float(d) if x.dtype() == d => Rows::Dense(x.clone()),
            RowFormat::Float(d) => Rows::Dense(x.astype(d)?),
            RowFormat::Affine { bits } => {
                let d = x.shape().last().copied().unwrap_or(0).max(0) as usize;
                match RowFormat::group_for_parts(d, part) {
                    // Quantized from float32, so that scales and biases are float32 whatever
                    // the model computes in (what the CPU attention kernel reads).
                    Some(g) => Rows::Affine(x.astype(Dtype::F32)?.quantize(g, bits)?),
                    None => Rows::Dense(x.astype(Dtype::F16)?),
                }
            }
        })
    }

    /// Rows from their arrays as [`Rows::arrays`] lists them (one dense array, or packed words,
    /// scales and biases of `bits` per value).
    pub fn from_arrays(mut arrays: Vec<Array>, bits: Option<i32>) -> Result<Rows> {
        let bad = |why: String| crate::Error::Mlx(format!("cache rows: {why}"));
        match (bits, arrays.len()) {
            (None, 1) => Ok(Rows::Dense(arrays.remove(0))),
            (Some(bits), 3) => {
                let (biases, scales, weight) =
                    (arrays.remove(2), arrays.remove(1), arrays.remove(0));
                let (ws, ss) = (weight.shape(), scales.shape());
                let words = *ws.last().unwrap_or(&0) as i64;
                let groups = *ss.last().unwrap_or(&0) as i64;
                let ok = bits > 0
                    && bits <= 8
                    && groups > 0
                    && ws.len() == 4
                    && ss.len() == 4
                    && biases.shape() == ss
                    && ws[..3] == ss[..3]
                    && (words * 32 / bits as i64) % groups == 0
                    && weight.dtype() == Dtype::U32;
                if !ok {
                    return Err(bad(format!(
                        "packed words {ws:?} ({:?}), scales {ss:?} and biases {:?} do not fit \
                         {bits}-bit rows",
                        weight.dtype(),
                        biases.shape()
                    )));
                }
                let group_size = (words * 32 / bits as i64 / groups) as i32;
                Ok(Rows::Affine(Quantized {
                    weight,
                    scales,
                    biases: Some(biases),
                    group_size,
                    bits,
                    mode: crate::QuantMode::Affine,
                    panels: false,
                }))
            }
            (b, n) => Err(bad(format!("{n} arrays for rows of {b:?} bits"))),
        }
    }

    /// The arrays that hold the rows.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Rows::Dense(a) => vec![a],
            Rows::Affine(q) => [Some(&q.weight), Some(&q.scales), q.biases.as_ref()]
                .into_iter()
                .flatten()
                .collect(),
        }
    }

    /// Bits per value of quantized rows (`None`: dense).
    pub fn bits(&self) -> Option<i32> {
        match self {
            Rows::Dense(_) => None,
            Rows::Affine(q) => Some(q.bits),
        }
    }

    /// How the rows are stored.
    pub fn format(&self) -> RowFormat {
        match self {
            Rows::Dense(a) => RowFormat::Float(a.dtype()),
            Rows::Affine(q) => RowFormat::Affine { bits: q.bits },
        }
    }

    fn first(&self) -> &Array {
        match self {
            Rows::Dense(a) => a,
            Rows::Affine(q) => &q.weight,
        }
    }

    /// `[B, H, T]`.
    pub fn lead(&self) -> [i32; 3] {
        let s = self.first().shape();
        [s[0], s[1], s[2]]
    }

    /// Positions held (`T`).
    pub fn time_len(&self) -> usize {
        self.first()
            .shape()
            .get(2)
            .map_or(0, |&n| n.max(0) as usize)
    }

    /// Values per row (`D`).
    pub fn width(&self) -> usize {
        match self {
            Rows::Dense(a) => a.shape().get(3).map_or(0, |&n| n.max(0) as usize),
            Rows::Affine(q) => {
                q.scales.shape().get(3).map_or(0, |&n| n.max(0) as usize) * q.group_size as usize
            }
        }
    }

    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    fn map(&self, f: impl Fn(&Array) -> Result<Array>) -> Result<Rows> {
        Ok(match self {
            Rows::Dense(a) => Rows::Dense(f(a)?),
            Rows::Affine(q) => Rows::Affine(Quantized {
                weight: f(&q.weight)?,
                scales: f(&q.scales)?,
                biases: q.biases.as_ref().map(&f).transpose()?,
                ..*q
            }),
        })
    }

    /// Positions `start..end` (views).
    pub fn time(&self, start: usize, end: usize) -> Result<Rows> {
        self.map(|a| time_of(a, start, end))
    }

    /// Fresh arrays of exactly these rows (a snapshot that keeps no larger buffer alive:
    /// MLX's `copy` would share it).
    pub fn contiguous(&self) -> Result<Rows> {
        self.map(Array::contiguous)
    }

    /// `t` empty (zero) positions stored like these rows.
    pub fn zeros(&self, t: usize) -> Result<Rows> {
        let [b, h, _] = self.lead();
        self.map(|a| Array::zeros(&[b, h, t as i32, a.shape()[3]], a.dtype()))
    }

    /// The first `n` values of each row (MLA's values, the latent part of its rows); quantized
    /// rows only at a group boundary.
    pub fn first_values(&self, n: usize) -> Result<Rows> {
        let cut =
            |a: &Array, m: usize| a.index(&[Ix::Ellipsis, Ix::slice(None, Some(m as i32), 1)]);
        match self {
            Rows::Dense(a) => Ok(Rows::Dense(cut(a, n)?)),
            Rows::Affine(q) if n.is_multiple_of(q.group_size as usize) => {
                Ok(Rows::Affine(Quantized {
                    weight: cut(&q.weight, n * q.bits as usize / 32)?,
                    scales: cut(&q.scales, n / q.group_size as usize)?,
                    biases: (q.biases.as_ref())
                        .map(|b| cut(b, n / q.group_size as usize))
                        .transpose()?,
                    ..*q
                }))
            }
            Rows::Affine(q) => Err(crate::Error::Mlx(format!(
                "the first {n} values of quantized rows split a group of {}",
                q.group_size
            ))),
        }
    }

    /// These rows with `new`'s (stored alike) written over positions `at..at + L`.
    pub fn slice_update(&self, new: &Rows, at: usize) -> Result<Rows> {
        let end = at + new.time_len();
        let ix = [
            Ix::full(),
            Ix::full(),
            Ix::slice(Some(at as i32), Some(end as i32), 1),
        ];
        match (self, new) {
            (Rows::Dense(a), Rows::Dense(n)) => Ok(Rows::Dense(a.slice_update(n, &ix)?)),
            (Rows::Affine(a), Rows::Affine(n)) => Ok(Rows::Affine(Quantized {
                weight: a.weight.slice_update(&n.weight, &ix)?,
                scales: a.scales.slice_update(&n.scales, &ix)?,
                biases: match (&a.biases, &n.biases) {
                    (Some(a), Some(n)) => Some(a.slice_update(n, &ix)?),
                    (None, None) => None,
                    _ => return Err(mixed()),
                },
                ..*a
            })),
            _ => Err(mixed()),
        }
    }

    /// Runs of rows (stored alike) joined along time.
    pub fn concat(parts: &[&Rows]) -> Result<Rows> {
        let Some(first) = parts.first() else {
            return Err(crate::Error::Mlx("cache rows: nothing to join".into()));
        };
        if parts.len() == 1 {
            return Ok((*first).clone());
        }
        let n = first.arrays().len();
        if parts
            .iter()
            .any(|p| p.arrays().len() != n || p.bits() != first.bits())
        {
            return Err(mixed());
        }
        let joined: Vec<Array> = (0..n)
            .map(|i| {
                let col: Vec<&Array> = parts.iter().map(|p| p.arrays()[i]).collect();
                crate::concatenate(&col, 2)
            })
            .collect::<Result<_>>()?;
        Rows::from_arrays(joined, first.bits())
    }

    /// The rows as values (dequantized where they are quantized).
    pub fn dense(&self) -> Result<Array> {
        match self {
            Rows::Dense(a) => Ok(a.clone()),
            Rows::Affine(q) => q.dequantize(),
        }
    }

    /// Dense rows as `dtype` (quantized rows as they are).
    pub fn cast(&self, dtype: Dtype) -> Result<Rows> {
        match self {
            Rows::Dense(a) if a.dtype() != dtype => Ok(Rows::Dense(a.astype(dtype)?)),
            other => Ok(other.clone()),
        }
    }
}

fn mixed() -> crate::Error {
    crate::Error::Mlx("cache rows stored in different forms".into())
}
