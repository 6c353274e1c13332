//! Cutting a loaded layer down to the part one rank holds where a model is split by tensors
//! (tensor parallel, [`crate::parallel::Shard`]).
//!
//! A layer is loaded as usual, then cut: rows (output features) for the projections whose
//! outputs split (queries, keys, values, gate and up, a head's vocabulary), columns (input
//! features) for those whose inputs do (the output projection, down), whose partial products
//! the ranks then sum. A quantized matrix cut by rows keeps its packing (quantization groups
//! run along the input); cut by columns it keeps it where the cut falls between groups, and is
//! otherwise held dequantized (only tiny test models cut a group: real widths split into
//! whole groups, [`crate::parallel::Shard::part`]).
//!
//! Every part is a copy of its own, made now: a view would keep the whole tensor's memory
//! alive, and the rank would hold the whole model after all.

use crate::nn::{Embedding, Experts, GatedMlp, Linear};
use crate::parallel::Shard;
use crate::weights::Weights;
use crate::{ModelError, Result};
use mlx::fast::PANEL;
use mlx::{Array, Quantized};
use std::ops::Range;

/// Which part of a matrix `[out, in]` (or of each matrix of a stack `[E, out, in]`) a rank
/// holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Output features.
    Rows(Range<i32>),
    /// Input features.
    Cols(Range<i32>),
}

/// `a` evaluated into a buffer of its own.
fn detached(a: &Array) -> Result<Array> {
    Ok(Array::from_bytes(&a.to_bytes()?, &a.shape(), a.dtype())?)
}

/// `a[.., range, ..]` along `axis`, detached and kept for loading.
fn cut(w: &Weights, a: &Array, axis: i32, range: &Range<i32>) -> Result<Array> {
    Ok(w.keep(detached(&a.slice_axis(
        axis,
        range.start,
        Some(range.end),
    )?)?))
}

/// The part of a quantized matrix (or stack): `None` where a column cut would split
/// quantization groups.
fn quantized(w: &Weights, q: &Quantized, part: &Part) -> Result<Option<Quantized>> {
    if q.panels {
        // Cut in MLX's rows, then paneled again.
        return quantized(w, &q.rows()?, part)?
            .map(|c| w.paneled(c))
            .transpose();
    }
    let (axis, words, groups) = match part {
        Part::Rows(r) => (-2, r.clone(), r.clone()),
        Part::Cols(r) => {
            let (g, bits) = (q.group_size, q.bits);
            if r.start % g != 0 || r.end % g != 0 || (r.start * bits) % 32 != 0 {
                return Ok(None);
            }
            (
                -1,
                r.start * bits / 32..r.end * bits / 32,
                r.start / g..r.end / g,
            )
        }
    };
    Ok(Some(Quantized {
        weight: cut(w, &q.weight, axis, &words)?,
        scales: cut(w, &q.scales, axis, &groups)?,
        biases: q
            .biases
            .as_ref()
            .map(|b| cut(w, b, axis, &groups))
            .transpose()?,
        ..*q
    }))
}

/// The values of `q` (times `global`, per row or for all) in the compute dtype, cut.
fn dequantized(w: &Weights, q: &Quantized, global: Option<&Array>, part: &Part) -> Result<Array> {
    let mut v = q.dequantize()?;
    if let Some(g) = global {
        v = if g.ndim() == 0 {
            v.multiply(g)?
        } else {
            // One per row of a matrix, or one per expert of a stack.
            let mut shape = vec![1; v.ndim()];
            let axis = if v.ndim() == 2 { 0 } else { v.ndim() - 3 };
            shape[axis] = g.size() as i32;
            v.multiply(&g.reshape(&shape)?)?
        };
    }
    let v = v.astype(w.dtype())?;
    let (axis, r) = match part {
        Part::Rows(r) => (-2, r),
        Part::Cols(r) => (-1, r),
    };
    detached(&v.slice_axis(axis, r.start, Some(r.end))?)
}

/// This rank's part of `Wᵀ` (`[in, out]`): a range of its outputs (columns) or inputs (rows).
fn cut_wt(w: &Weights, wt: &Array, part: &Part) -> Result<Array> {
    match part {
        Part::Rows(r) => cut(w, wt, 1, r),
        Part::Cols(r) => cut(w, wt, 0, r),
    }
}

/// This rank's part of `l`, which is let go.
pub(crate) fn linear(w: &Weights, l: Linear, part: &Part) -> Result<Linear> {
    l.withdraw(w);
    Ok(match (&l, part) {
        // Panels cut along their input rows, or into whole panels, stay panels.
        (Linear::Paneled { panels }, Part::Cols(r)) => Linear::Paneled {
            panels: cut(w, panels, 1, r)?,
        },
        (Linear::Paneled { panels }, Part::Rows(r))
            if r.start % PANEL == 0 && r.end % PANEL == 0 =>
        {
            Linear::Paneled {
                panels: cut(w, panels, 0, &(r.start / PANEL..r.end / PANEL))?,
            }
        }
        // `Wᵀ`, `[in, out]`; another range of a paneled matrix's outputs from its panels put
        // back.
        (Linear::Dense { wt }, _) => Linear::from_wt(w, cut_wt(w, wt, part)?)?,
        (Linear::Paneled { panels }, _) => {
            Linear::from_wt(w, cut_wt(w, &mlx::fast::unpack_panels(panels)?, part)?)?
        }
        (Linear::Quantized(q), _) => match quantized(w, q, part)? {
            Some(q) => Linear::Quantized(q),
            None => Linear::dense(w, dequantized(w, q, None, part)?)?,
        },
        (Linear::Scaled { q, global }, _) => match quantized(w, q, part)? {
            Some(q) => Linear::Scaled {
                q,
                global: match part {
                    Part::Rows(r) if global.ndim() == 1 => cut(w, global, 0, r)?,
                    _ => w.keep(global.clone()),
                },
            },
            None => Linear::dense(w, dequantized(w, q, Some(global), part)?)?,
        },
        (Linear::Summed { .. }, _) => {
            return Err(ModelError::Invalid(
                "a projection summed over ranks cut again".into(),
            ))
        }
    })
}

/// This rank's part of each expert's matrix in `e`, which is let go.
pub(crate) fn experts(w: &Weights, e: Experts, part: &Part) -> Result<Experts> {
    e.withdraw(w);
    Ok(match (&e, part) {
        // `[E, in, out]`.
        (Experts::Dense { wt }, Part::Rows(r)) => Experts::Dense {
            wt: cut(w, wt, 2, r)?,
        },
        (Experts::Dense { wt }, Part::Cols(r)) => Experts::Dense {
            wt: cut(w, wt, 1, r)?,
        },
        (Experts::Quantized(q), _) => match quantized(w, q, part)? {
            Some(q) => Experts::Quantized(q),
            None => Experts::dense(w, dequantized(w, q, None, part)?)?,
        },
        (Experts::Scaled { q, global }, _) => match quantized(w, q, part)? {
            Some(q) => Experts::Scaled {
                q,
                global: w.keep(global.clone()),
            },
            None => Experts::dense(w, dequantized(w, q, Some(global), part)?)?,
        },
    })
}

/// Rows `vocab` of a quantized table, as a view of it.
fn quantized_rows_view(q: &Quantized, vocab: &Range<i32>) -> Result<Quantized> {
    let panel = mlx::QUANT_PANEL;
    if q.panels && vocab.start % panel == 0 && vocab.end % panel == 0 {
        let panels = vocab.start / panel..vocab.end / panel;
        let part = |a: &Array| a.slice_axis(0, panels.start, Some(panels.end));
        return Ok(Quantized {
            weight: part(&q.weight)?,
            scales: part(&q.scales)?,
            biases: q.biases.as_ref().map(part).transpose()?,
            ..*q
        });
    }
    // A range inside a panel: a view of the rows (they are read as MLX's layout then).
    let q = &q.rows()?;
    let rows = |a: &Array| a.slice_axis(0, vocab.start, Some(vocab.end));
    Ok(Quantized {
        weight: rows(&q.weight)?,
        scales: rows(&q.scales)?,
        biases: q.biases.as_ref().map(rows).transpose()?,
        ..*q
    })
}

/// Rows `vocab` of an embedding table the rank also holds whole, as a view of it (no memory);
/// only a paneled table's range that starts or ends inside a panel is a copy, kept for loading.
fn embedding_view(w: &Weights, e: &Embedding, vocab: &Range<i32>) -> Result<Embedding> {
    Ok(match e {
        Embedding::Dense(t) => Embedding::Dense(t.slice_axis(0, vocab.start, Some(vocab.end))?),
        Embedding::DenseTransposed(t) => {
            Embedding::DenseTransposed(t.slice_axis(1, vocab.start, Some(vocab.end))?)
        }
        // Whole panels are a view; a range inside one is copied out of the columns.
        Embedding::Paneled(p) if vocab.start % PANEL == 0 && vocab.end % PANEL == 0 => {
            Embedding::Paneled(p.slice_axis(0, vocab.start / PANEL, Some(vocab.end / PANEL))?)
        }
        Embedding::Paneled(p) => Embedding::DenseTransposed(
            w.keep(
                mlx::fast::unpack_panels(p)?
                    .slice_axis(1, vocab.start, Some(vocab.end))?
                    .contiguous()?,
            ),
        ),
        Embedding::Quantized(q) => Embedding::Quantized(quantized_rows_view(q, vocab)?),
        Embedding::Scaled { q, global } => Embedding::Scaled {
            q: quantized_rows_view(q, vocab)?,
            global: global.clone(),
        },
    })
}

/// Rows `vocab` of an embedding table, copied (the whole table is let go): a rank's share of a
/// table split by vocabulary ([`Shard::embed`]).
pub(crate) fn embedding_rows(w: &Weights, e: Embedding, vocab: &Range<i32>) -> Result<Embedding> {
    let cut_rows = |q: &Quantized| -> Result<Quantized> {
        w.withdraw_quantized(q);
        quantized(w, q, &Part::Rows(vocab.clone()))?
            .ok_or_else(|| ModelError::Invalid("a row cut of a quantized table".into()))
    };
    Ok(match &e {
        Embedding::Dense(table) => {
            w.withdraw(table);
            Embedding::Dense(cut(w, table, 0, vocab)?)
        }
        Embedding::DenseTransposed(wt) => {
            w.withdraw(wt);
            Embedding::DenseTransposed(cut(w, wt, 1, vocab)?)
        }
        Embedding::Paneled(p) => {
            w.withdraw(p);
            let rows = cut(w, &mlx::fast::unpack_panels(p)?, 1, vocab)?;
            // `Eᵀ`'s columns are the table's rows: panel them again as a tied head.
            match mlx::fast::pack_panels(&rows.t()?)? {
                Some(panels) => Embedding::Paneled(w.keep_instead(&rows, panels)),
                None => Embedding::DenseTransposed(rows),
            }
        }
        Embedding::Quantized(q) => Embedding::Quantized(cut_rows(q)?),
        Embedding::Scaled { q, global } => Embedding::Scaled {
            q: cut_rows(q)?,
            global: global.clone(),
        },
    })
}

/// This rank's rows of a token embedding table split by vocabulary ([`Shard::embed`]): a view of
/// `whole` where the rank holds the table whole (rank 0 leading), else copied out of `table()`.
pub(crate) fn vocab_rows(
    w: &Weights,
    shard: &Shard,
    vocab: i32,
    whole: Option<&Embedding>,
    table: impl FnOnce() -> Result<Embedding>,
) -> Result<Embedding> {
    let rows = shard.vocab_part(vocab);
    match whole {
        Some(e) => embedding_view(w, e, &rows),
        None => embedding_rows(w, table()?, &rows),
    }
}

/// The head over `vocab` tokens as this rank holds it: split by tensors where every rank
/// computes logits, its rows of `head`; else `head` as it is.
pub(crate) fn head_part(
    w: &Weights,
    shard: Option<&Shard>,
    vocab: i32,
    head: Option<Linear>,
) -> Result<Option<Linear>> {
    match (shard, head) {
        (Some(sh), Some(head)) if sh.splits_head() => {
            Ok(Some(linear(w, head, &Part::Rows(sh.vocab_part(vocab)))?))
        }
        (_, head) => Ok(head),
    }
}

/// `a` cut to `range` along `axis` (a per-head table of MLA), `a` let go.
pub(crate) fn along(w: &Weights, a: &Array, axis: i32, range: &Range<i32>) -> Result<Array> {
    w.withdraw(a);
    cut(w, a, axis, range)
}

/// Columns `cols` of `l`, whose products the ranks of `shard` sum.
pub(crate) fn summed(w: &Weights, l: Linear, cols: Range<i32>, shard: &Shard) -> Result<Linear> {
    Ok(Linear::Summed {
        part: Box::new(linear(w, l, &Part::Cols(cols))?),
        shard: shard.clone(),
    })
}

/// The quantization group along the input of `l` (1 if dense): a cut of its columns in whole
/// groups keeps it packed.
fn group(l: &Linear) -> i32 {
    match l {
        Linear::Quantized(q) | Linear::Scaled { q, .. } => q.group_size,
        Linear::Dense { .. } | Linear::Paneled { .. } => 1,
        Linear::Summed { part, .. } => group(part),
    }
}

/// This rank's hidden units of a gated MLP: gate and up rows, down columns. With `sum`, the
/// down projection's partial products are summed over the ranks; without, the caller sums
/// them with others (one sum for a MoE block's experts and shared expert).
pub(crate) fn mlp(w: &Weights, shard: &Shard, m: GatedMlp, sum: bool) -> Result<GatedMlp> {
    let hidden = m.gate.outputs() as i32;
    let units = shard.part(hidden, group(&m.down), "MLP hidden units")?;
    let rows = Part::Rows(units.clone());
    Ok(GatedMlp {
        gate: linear(w, m.gate, &rows)?,
        up: linear(w, m.up, &rows)?,
        down: if sum {
            summed(w, m.down, units, shard)?
        } else {
            linear(w, m.down, &Part::Cols(units))?
        },
        act: m.act,
    })
}

/// This rank's hidden units of every expert (`hidden` each): gate and up rows, down columns;
/// the caller sums the down projection's partial products over the ranks.
pub(crate) fn expert_mlp(
    w: &Weights,
    shard: &Shard,
    [gate, up, down]: [Experts; 3],
    hidden: i32,
) -> Result<[Experts; 3]> {
    let unit = match &down {
        Experts::Quantized(q) | Experts::Scaled { q, .. } => q.group_size,
        Experts::Dense { .. } => 1,
    };
    let units = shard.part(hidden, unit, "expert hidden units")?;
    let rows = Part::Rows(units.clone());
    Ok([
        experts(w, gate, &rows)?,
        experts(w, up, &rows)?,
        experts(w, down, &Part::Cols(units))?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx::{random, Dtype, QuantMode};
    use std::collections::HashMap;

    fn weights() -> Weights {
        Weights::from_arrays(HashMap::new(), Dtype::F32, None)
    }

    fn normal(shape: &[i32], seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal(shape, Dtype::F32, 0.0, 1.0, Some(&key)).unwrap()
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The rows an embedding's lookup gives for `ids`.
    fn looked_up(e: &Embedding, ids: &[i32]) -> Vec<f32> {
        let ids = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
        e.lookup(&ids).unwrap().to_vec::<f32>().unwrap()
    }

    /// Rows `ids` of a dense table.
    fn table_rows(table: &Array, ids: &[i32]) -> Vec<f32> {
        let ids = Array::from_slice(ids, &[ids.len() as i32]).unwrap();
        table.take(&ids, 0).unwrap().to_vec::<f32>().unwrap()
    }

    /// `[x Wᵀ]` from each part of `W` cut by `parts`: rows joined, columns summed.
    fn from_parts(w: &Weights, l: &Linear, x: &Array, parts: &[Part]) -> Array {
        let outs: Vec<Array> = parts
            .iter()
            .map(|p| {
                let part = linear(w, l.clone(), p).unwrap();
                let input = match p {
                    Part::Rows(_) => x.clone(),
                    Part::Cols(r) => x.slice_axis(-1, r.start, Some(r.end)).unwrap(),
                };
                part.forward(&input).unwrap()
            })
            .collect();
        match parts[0] {
            Part::Rows(_) => {
                let refs: Vec<&Array> = outs.iter().collect();
                mlx::concatenate(&refs, -1).unwrap()
            }
            Part::Cols(_) => outs[1..]
                .iter()
                .fold(outs[0].clone(), |acc, o| acc.add(o).unwrap()),
        }
    }

    /// Every part of a matrix, dense or quantized (whole groups or not), gives the whole
    /// matrix's products, joined by rows or summed by columns, within float rounding.
    #[test]
    fn parts_multiply_as_the_whole_does() {
        let w = weights();
        let m = normal(&[12, 128], 3);
        let x = normal(&[1, 3, 128], 4);
        let mut layers = vec![("dense", Linear::dense(&w, m.clone()).unwrap())];
        for (name, mode, group, bits) in [
            ("affine q4", QuantMode::Affine, 32, 4),
            ("affine q3", QuantMode::Affine, 64, 3),
            ("mxfp4", QuantMode::Mxfp4, 32, 4),
        ] {
            layers.push((
                name,
                Linear::Quantized(m.quantize_as(mode, group, bits).unwrap()),
            ));
        }
        for (name, l) in &layers {
            let whole = l.forward(&x).unwrap();
            // Products of 128 terms reach ~30: float32 rounding of such sums is ~1e-6 each.
            let scale = whole
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .fold(1.0f32, |m, v| m.max(v.abs()));
            let rows = from_parts(&w, l, &x, &[Part::Rows(0..5), Part::Rows(5..12)]);
            // A narrower product may block its sums differently (BLAS): rounding only.
            let d = max_diff(&rows, &whole);
            assert!(
                d < 1e-6 * scale,
                "{name}: rows: {d} (largest value {scale})"
            );
            for cut in [64, 40] {
                let cols = from_parts(&w, l, &x, &[Part::Cols(0..cut), Part::Cols(cut..128)]);
                let d = max_diff(&cols, &whole);
                assert!(d < 1e-4, "{name}: columns cut at {cut}: {d}");
            }
        }
        // A cut between groups keeps the packing; one inside a group holds the part dense.
        let q = &layers[1].1;
        assert!(matches!(
            linear(&w, q.clone(), &Part::Cols(0..64)).unwrap(),
            Linear::Quantized(_)
        ));
        assert!(matches!(
            linear(&w, q.clone(), &Part::Cols(0..40)).unwrap(),
            Linear::Dense { .. } | Linear::Paneled { .. }
        ));
    }

    /// A float32 matrix whose rows are whole panels is held as panels on the CPU; its products,
    /// its parts' products and a tied head's lookups and logits are the plain matrix's.
    #[test]
    fn paneled_layers_and_their_parts_are_the_plain_matrix() {
        let w = weights();
        let m = normal(&[64, 96], 20);
        let x = normal(&[2, 96], 21);
        let l = Linear::dense(&w, m.clone()).unwrap();
        assert!(matches!(l, Linear::Paneled { .. }));
        assert_eq!(l.outputs(), 64);
        let whole = l.forward(&x).unwrap();
        let plain = x.matmul(&m.t().unwrap()).unwrap();
        assert!(max_diff(&whole, &plain) < 1e-4);
        for parts in [
            vec![Part::Rows(0..32), Part::Rows(32..64)],
            vec![Part::Rows(0..20), Part::Rows(20..64)],
            vec![Part::Cols(0..48), Part::Cols(48..96)],
        ] {
            let d = max_diff(&from_parts(&w, &l, &x, &parts), &whole);
            assert!(d < 1e-4, "{:?}: {d}", parts[0]);
        }
        assert!(matches!(
            linear(&w, l.clone(), &Part::Rows(0..32)).unwrap(),
            Linear::Paneled { .. }
        ));
        assert!(matches!(
            linear(&w, l.clone(), &Part::Rows(0..20)).unwrap(),
            Linear::Dense { .. }
        ));
        assert!(matches!(
            linear(&w, l.clone(), &Part::Cols(0..48)).unwrap(),
            Linear::Paneled { .. }
        ));

        // A tied head of 64 tokens.
        let table = normal(&[64, 96], 22);
        let e = Embedding::Dense(table.clone()).for_tied_head(&w).unwrap();
        assert!(matches!(e, Embedding::Paneled(_)));
        let rows_of = looked_up;
        let want = |ids: &[i32]| table_rows(&table, ids);
        assert_eq!(rows_of(&e, &[3, 40, 63, 0]), want(&[3, 40, 63, 0]));
        let logits = e.as_linear(&x).unwrap();
        assert!(max_diff(&logits, &x.matmul(&table.t().unwrap()).unwrap()) < 1e-4);
        // A rank's share of the vocabulary, as a view (whole panels or not) and cut.
        let aligned = embedding_view(&w, &e, &(32..64)).unwrap();
        assert!(matches!(aligned, Embedding::Paneled(_)));
        assert_eq!(rows_of(&aligned, &[0, 5]), want(&[32, 37]));
        let inside = embedding_view(&w, &e, &(10..50)).unwrap();
        assert_eq!(rows_of(&inside, &[0, 39]), want(&[10, 49]));
        let cut = embedding_rows(&w, e.clone(), &(32..64)).unwrap();
        assert!(matches!(cut, Embedding::Paneled(_)));
        assert_eq!(rows_of(&cut, &[31, 1]), want(&[63, 33]));
    }

    /// A quantized matrix held as 16-output panels (where the CPU takes them): its parts'
    /// products are the whole's, and a part stays paneled where its rows allow; a quantized
    /// tied head's vocabulary share looks up and multiplies as the table does.
    #[test]
    fn paneled_quantized_layers_and_their_parts_are_the_whole() {
        if !mlx::quantized_panels_apply(4, 32) {
            return;
        }
        let w = weights();
        let m = normal(&[64, 128], 30);
        let x = normal(&[3, 128], 31);
        let q = w.paneled(m.quantize(32, 4).unwrap()).unwrap();
        assert!(q.panels);
        let l = Linear::Quantized(q.clone());
        assert_eq!(l.outputs(), 64);
        let whole = l.forward(&x).unwrap();
        let rows = Linear::Quantized(q.rows().unwrap()).forward(&x).unwrap();
        assert!(max_diff(&whole, &rows) < 1e-4);
        for parts in [
            vec![Part::Rows(0..32), Part::Rows(32..64)],
            vec![Part::Rows(0..20), Part::Rows(20..64)],
            vec![Part::Cols(0..64), Part::Cols(64..128)],
        ] {
            let d = max_diff(&from_parts(&w, &l, &x, &parts), &whole);
            assert!(d < 1e-4, "{:?}: {d}", parts[0]);
        }
        let held = |part: Part| match linear(&w, l.clone(), &part).unwrap() {
            Linear::Quantized(q) => q.panels,
            _ => panic!("{part:?}: not quantized"),
        };
        assert!(held(Part::Rows(0..32)));
        assert!(held(Part::Cols(0..64)));
        assert!(!held(Part::Rows(0..20)));

        let e = Embedding::Quantized(q.clone());
        let table = q.dequantize().unwrap();
        let rows_of = looked_up;
        let want = |ids: &[i32]| table_rows(&table, ids);
        assert_eq!(rows_of(&e, &[3, 40, 63, 0]), want(&[3, 40, 63, 0]));
        let aligned = embedding_view(&w, &e, &(32..64)).unwrap();
        assert!(matches!(&aligned, Embedding::Quantized(q) if q.panels));
        assert_eq!(rows_of(&aligned, &[0, 5]), want(&[32, 37]));
        let inside = embedding_view(&w, &e, &(10..50)).unwrap();
        assert_eq!(rows_of(&inside, &[0, 39]), want(&[10, 49]));
        let logits = inside.as_linear(&x).unwrap();
        let plain = x
            .matmul(&table.slice_axis(0, 10, Some(50)).unwrap().t().unwrap())
            .unwrap();
        assert!(max_diff(&logits, &plain) < 1e-4);
        let cut = embedding_rows(&w, e.clone(), &(32..64)).unwrap();
        assert!(matches!(&cut, Embedding::Quantized(q) if q.panels));
        assert_eq!(rows_of(&cut, &[31, 1]), want(&[63, 33]));
    }

    /// Each expert's part: the experts' products from the parts, summed over column parts, are
    /// the whole stack's.
    #[test]
    fn expert_parts_multiply_as_the_whole_does() {
        let w = weights();
        let m = normal(&[4, 16, 128], 5);
        let x = normal(&[2, 1, 1, 128], 6);
        let idx = Array::from_slice(&[3i32, 1, 0, 2], &[2, 2]).unwrap();
        for e in [
            Experts::dense(&w, m.clone()).unwrap(),
            Experts::Quantized(m.quantize(64, 4).unwrap()),
        ] {
            let whole = e.forward(&x, &idx, false).unwrap();
            let half = |r: Range<i32>| {
                let part = experts(&w, clone_experts(&e), &Part::Cols(r.clone())).unwrap();
                part.forward(
                    &x.slice_axis(-1, r.start, Some(r.end)).unwrap(),
                    &idx,
                    false,
                )
                .unwrap()
            };
            let sum = half(0..64).add(&half(64..128)).unwrap();
            assert!(max_diff(&sum, &whole) < 1e-4);
        }
    }

    fn clone_experts(e: &Experts) -> Experts {
        match e {
            Experts::Dense { wt } => Experts::Dense { wt: wt.clone() },
            Experts::Quantized(q) => Experts::Quantized(q.clone()),
            Experts::Scaled { q, global } => Experts::Scaled {
                q: q.clone(),
                global: global.clone(),
            },
        }
    }
}
