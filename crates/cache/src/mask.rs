use mlx::{Array, Dtype, SdpaMask};

/// The attention mask a cache asks for after an update.
#[derive(Debug, Clone)]
pub enum AttnMask {
    /// Every returned key is visible to every query.
    None,
    /// Keys are positions `0..T` in order and the queries are the last `L` of them.
    Causal,
    /// An explicit `[L, S]` boolean mask (true = attend).
    Array(Array),
}

impl AttnMask {
    pub fn as_sdpa(&self) -> SdpaMask<'_> {
        match self {
            AttnMask::None => SdpaMask::None,
            AttnMask::Causal => SdpaMask::Causal,
            AttnMask::Array(a) => SdpaMask::Array(a),
        }
    }

    /// The explicit mask for queries at `q_start..q_start+l` over keys at `key_pos` (`-1` marks
    /// an empty slot): causal, and within `window` positions when given (each query sees at
    /// most `window` keys including itself, i.e. `q - k < window`).
    pub fn from_positions(
        key_pos: &[i32],
        q_start: i32,
        l: i32,
        window: Option<i32>,
    ) -> mlx::Result<AttnMask> {
        let k = Array::from_slice(key_pos, &[1, key_pos.len() as i32])?;
        let q = Array::arange(f64::from(q_start), f64::from(q_start + l), 1.0, Dtype::I32)?
            .reshape(&[l, 1])?;
        let mut m = k
            .less_equal(&q)?
            .logical_and(&k.greater_equal_scalar(0.0)?)?;
        if let Some(w) = window {
            m = m.logical_and(&q.subtract(&k)?.less_scalar(f64::from(w))?)?;
        }
        Ok(AttnMask::Array(m))
    }
}
