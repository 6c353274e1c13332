use mlx::{Array, SdpaMask};

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
    /// most `window` keys including itself, i.e. `q - k < window`). Worked out on the host
    /// (the positions are host values), so it is a constant, not a graph of comparisons.
    pub fn from_positions(
        key_pos: &[i32],
        q_start: i32,
        l: i32,
        window: Option<i32>,
    ) -> mlx::Result<AttnMask> {
        let mut m = Vec::with_capacity(key_pos.len() * l.max(0) as usize);
        for q in q_start..q_start + l {
            m.extend(key_pos.iter().map(|&k| {
                k >= 0
                    && k <= q
                    && window.is_none_or(|w| i64::from(q) - i64::from(k) < i64::from(w))
            }));
        }
        Ok(AttnMask::Array(Array::from_slice(
            &m,
            &[l, key_pos.len() as i32],
        )?))
    }
}
