//! The transform pipeline, applied to `R` rows that share options: penalties on the raw
//! logits, then top-k, temperature, top-p, min-p and renormalisation (this project's order,
//! docs/PROTOCOL.md).

use crate::distribution::Distribution;
use crate::error::Result;
use base::options::Options;
use mlx::{Array, Dtype};

/// How top-k and top-p share work. `OneSort` (the default) partitions out the top `K`
/// candidates and sorts only those, which then serves top-p and min-p; `Separate` masks the
/// dense logits to the top `K` and sorts the whole vocabulary for top-p, as a naive chain of
/// independent transforms would. Kept for the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    #[default]
    OneSort,
    Separate,
}

/// Repeat, presence and frequency penalties from a history `[R, W]` (`-1` = empty entry).
///
/// Sparse: only the `W` history positions are touched (gather, rewrite, scatter), never a dense
/// `[R, V]` count. The repeat and presence rewrite is a put, so a token present several times is
/// penalised once; the frequency term is a scatter-add, so it counts every occurrence.
pub(crate) fn apply_penalties(logits: &Array, hist: &Array, o: &Options) -> Result<Array> {
    let s = logits.shape();
    let (r, v) = (s[0], s[1]);
    // Empty entries point at a scratch column past the vocabulary.
    let valid = hist.greater_equal_scalar(0.0)?;
    let scratch = Array::full(&[1], f64::from(v), Dtype::I32)?;
    let idx = mlx::where_(&valid, hist, &scratch)?;
    let padded = mlx::concatenate(&[logits, &Array::zeros(&[r, 1], Dtype::F32)?], 1)?;
    let g = padded.take_along_axis(&idx, 1)?;
    let rp = f64::from(o.repeat_penalty);
    let penalised = mlx::where_(
        &g.less_scalar(0.0)?,
        &g.multiply_scalar(rp)?,
        &g.divide_scalar(rp)?,
    )?
    .subtract_scalar(f64::from(o.presence_penalty))?;
    let mut out = padded.put_along_axis(&idx, &penalised, 1)?;
    if o.frequency_penalty != 0.0 {
        let each = valid
            .astype(Dtype::F32)?
            .multiply_scalar(-f64::from(o.frequency_penalty))?;
        out = out.scatter_add_axis(&idx, &each, 1)?;
    }
    Ok(out.slice_axis(1, 0, Some(v))?)
}

/// The distribution `R` rows of `logits` (`[R, V]`) sample from under `o` (normalized), given
/// their penalty histories (`[R, W]`, or `None` when penalties are off).
pub(crate) fn distribution(
    logits: &Array,
    hist: Option<&Array>,
    o: &Options,
    strategy: Strategy,
) -> Result<Distribution> {
    let mut x = logits.astype(Dtype::F32)?;
    let v = x.shape()[1];
    if let Some(h) = hist {
        x = apply_penalties(&x, h, o)?;
    }
    if o.temperature <= 0.0 {
        // Greedy: a point mass on the argmax of the penalised logits.
        let ids = x.argmax(-1, true)?;
        let probs = Array::ones(&ids.shape(), Dtype::F32)?;
        return Ok(Distribution {
            ids: Some(ids),
            probs,
            vocab: v,
        });
    }
    let top_k = o.top_k > 0 && o.top_k < v;
    let top_p = o.top_p < 1.0;
    // Candidates, sorted by logit descending whenever a later step needs the order.
    let (ids, vals) = match (top_k, strategy) {
        (true, Strategy::OneSort) => {
            let k = o.top_k;
            let ids = x
                .negative()?
                .argpartition(k - 1, -1)?
                .slice_axis(-1, 0, Some(k))?;
            let vals = x.take_along_axis(&ids, -1)?;
            let order = vals.negative()?.argsort(-1)?;
            (
                Some(ids.take_along_axis(&order, -1)?),
                vals.take_along_axis(&order, -1)?,
            )
        }
        (true, Strategy::Separate) => {
            let k = o.top_k;
            let kth = x
                .negative()?
                .partition(k - 1, -1)?
                .slice_axis(-1, k - 1, Some(k))?
                .negative()?;
            let ninf = Array::scalar(f32::NEG_INFINITY)?;
            let masked = mlx::where_(&x.less(&kth)?, &ninf, &x)?;
            if top_p {
                let order = masked.negative()?.argsort(-1)?;
                (Some(order.clone()), masked.take_along_axis(&order, -1)?)
            } else {
                (None, masked)
            }
        }
        (false, _) if top_p => {
            let order = x.negative()?.argsort(-1)?;
            (Some(order.clone()), x.take_along_axis(&order, -1)?)
        }
        (false, _) => (None, x),
    };
    let mut p = vals
        .divide_scalar(f64::from(o.temperature))?
        .softmax(&[-1], true)?;
    let zero = Array::scalar(0.0f32)?;
    if top_p {
        // Keep while the mass strictly before a token is below top_p: the top token always
        // survives.
        let before = p.cumsum(-1, false, false)?;
        p = mlx::where_(&before.less_scalar(f64::from(o.top_p))?, &p, &zero)?;
    }
    if o.min_p > 0.0 {
        let floor = p.max(&[-1], true)?.multiply_scalar(f64::from(o.min_p))?;
        p = mlx::where_(&p.less(&floor)?, &zero, &p)?;
    }
    let p = p.divide(&p.sum(&[-1], true)?.maximum_scalar(1e-20)?)?;
    Ok(Distribution {
        ids,
        probs: p,
        vocab: v,
    })
}

/// Full-vocabulary log-softmax of raw logits (before penalties and temperature), float32.
pub(crate) fn log_softmax(logits: &Array) -> Result<Array> {
    Ok(logits.astype(Dtype::F32)?.log_softmax(-1)?)
}
