//! Probability distributions over the vocabulary, row by row, kept on the device: dense
//! `[R, V]`, or sparse `[R, K]` probabilities with their token ids (after top-k, or the point
//! mass of greedy decoding). Everything here is lazy; nothing reads back to the host.

use crate::error::Result;
use mlx::{Array, Dtype};

#[derive(Debug, Clone)]
pub struct Distribution {
    /// `[R, K]` token ids of the columns of `probs`; `None` for a dense distribution.
    pub(crate) ids: Option<Array>,
    /// `[R, K]` or `[R, V]` probabilities, float32, each row summing to 1.
    pub(crate) probs: Array,
    pub(crate) vocab: i32,
}

impl Distribution {
    pub fn rows(&self) -> i32 {
        self.probs.shape()[0]
    }

    pub fn vocab(&self) -> i32 {
        self.vocab
    }

    /// Draws one token per row by inverse CDF with one uniform number per row (`u: [R]` in
    /// [0, 1)). A zero-probability token is never chosen.
    pub fn sample_with(&self, u: &Array) -> Result<Array> {
        let c = self.probs.cumsum(-1, false, true)?;
        let last = c.slice_axis(-1, -1, None)?; // [R, 1] total mass (1 up to rounding)
        let target = u.reshape(&[-1, 1])?.multiply(&last)?;
        let k = self.probs.shape()[1];
        let idx = c
            .less_equal(&target)?
            .astype(Dtype::I32)?
            .sum(&[-1], true)?
            .minimum_scalar(f64::from(k - 1))?; // [R, 1]
        let tok = match &self.ids {
            Some(ids) => ids.take_along_axis(&idx, -1)?,
            None => idx,
        };
        Ok(tok.reshape(&[-1])?.astype(Dtype::I32)?)
    }

    /// `p(token_r)` for one token per row (`tokens: [R]` int32) → `[R]`.
    pub fn prob_of(&self, tokens: &Array) -> Result<Array> {
        let t = tokens.astype(Dtype::I32)?.reshape(&[-1, 1])?;
        Ok(match &self.ids {
            None => self.probs.take_along_axis(&t, -1)?.reshape(&[-1])?,
            Some(ids) => {
                let zero = Array::scalar(0.0f32)?;
                mlx::where_(&ids.equal(&t)?, &self.probs, &zero)?.sum(&[-1], false)?
            }
        })
    }

    /// The dense `[R, V]` probabilities.
    pub fn dense(&self) -> Result<Array> {
        Ok(match &self.ids {
            None => self.probs.clone(),
            Some(ids) => {
                let zeros = Array::zeros(&[self.rows(), self.vocab], Dtype::F32)?;
                zeros.put_along_axis(ids, &self.probs, -1)?
            }
        })
    }

    /// Rows `start..end`.
    pub fn slice_rows(&self, start: i32, end: i32) -> Result<Distribution> {
        Ok(Distribution {
            ids: match &self.ids {
                Some(i) => Some(i.slice_axis(0, start, Some(end))?),
                None => None,
            },
            probs: self.probs.slice_axis(0, start, Some(end))?,
            vocab: self.vocab,
        })
    }

    /// `normalise(max(p − q, 0))` row by row, the distribution a rejected draft position is
    /// resampled from (Leviathan et al.). Where `p ≤ q` everywhere (possible only through
    /// rounding) the result falls back to `p`.
    pub fn residual(p: &Distribution, q: &Distribution) -> Result<Distribution> {
        let pd = p.dense()?;
        let r = pd.subtract(&q.dense()?)?.maximum_scalar(0.0)?;
        let z = r.sum(&[-1], true)?;
        let has_mass = z.greater_scalar(1e-12)?;
        let r = mlx::where_(&has_mass, &r.divide(&z.maximum_scalar(1e-20)?)?, &pd)?;
        Ok(Distribution {
            ids: None,
            probs: r,
            vocab: p.vocab,
        })
    }

    /// Point masses on `tokens` (`[R]` int32), one per row: the distribution of a drafter that
    /// proposes a token for certain.
    pub fn point(tokens: &Array, vocab: i32) -> Result<Distribution> {
        let ids = tokens.astype(Dtype::I32)?.reshape(&[-1, 1])?;
        let probs = Array::full(&ids.shape(), 1.0, Dtype::F32)?;
        Ok(Distribution {
            ids: Some(ids),
            probs,
            vocab,
        })
    }

    /// Row-wise concatenation.
    pub fn concat(parts: &[&Distribution]) -> Result<Distribution> {
        let vocab = parts.first().map_or(0, |d| d.vocab);
        let same_sparse = parts.iter().all(|d| d.ids.is_some())
            && parts
                .windows(2)
                .all(|w| w[0].probs.shape()[1] == w[1].probs.shape()[1]);
        if same_sparse {
            let ids: Vec<&Array> = parts.iter().filter_map(|d| d.ids.as_ref()).collect();
            let probs: Vec<&Array> = parts.iter().map(|d| &d.probs).collect();
            return Ok(Distribution {
                ids: Some(mlx::concatenate(&ids, 0)?),
                probs: mlx::concatenate(&probs, 0)?,
                vocab,
            });
        }
        let dense: Vec<Array> = parts.iter().map(|d| d.dense()).collect::<Result<_>>()?;
        let refs: Vec<&Array> = dense.iter().collect();
        Ok(Distribution {
            ids: None,
            probs: mlx::concatenate(&refs, 0)?,
            vocab,
        })
    }
}
