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
        Self::from_positions_blocks(key_pos, q_start, l, window, &[])
    }

    /// [`AttnMask::from_positions`] where a query also sees the later keys of its own block
    /// (`[start, end)` position ranges: a media item whose tokens attend both ways), still
    /// within the window: `q - k < window` and (`k ≤ q` or both in one block).
    pub fn from_positions_blocks(
        key_pos: &[i32],
        q_start: i32,
        l: i32,
        window: Option<i32>,
        blocks: &[(i32, i32)],
    ) -> mlx::Result<AttnMask> {
        let block_of = |p: i32| blocks.iter().position(|&(s, e)| s <= p && p < e);
        let mut m = Vec::with_capacity(key_pos.len() * l.max(0) as usize);
        for q in q_start..q_start + l {
            let qb = block_of(q);
            m.extend(key_pos.iter().map(|&k| {
                k >= 0
                    && (k <= q || (qb.is_some() && block_of(k) == qb))
                    && window.is_none_or(|w| i64::from(q) - i64::from(k) < i64::from(w))
            }));
        }
        Ok(AttnMask::Array(Array::from_slice(
            &m,
            &[l, key_pos.len() as i32],
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(m: &AttnMask) -> Vec<Vec<bool>> {
        let AttnMask::Array(a) = m else {
            panic!("an explicit mask")
        };
        let s = a.shape();
        let v = a.to_vec::<bool>().unwrap();
        v.chunks(s[1] as usize).map(<[bool]>::to_vec).collect()
    }

    #[test]
    fn a_block_sees_its_later_keys_within_the_window() {
        // Keys 0..6, queries 2..6, one block [2, 5), window 3.
        let keys: Vec<i32> = (0..6).collect();
        let m = AttnMask::from_positions_blocks(&keys, 2, 4, Some(3), &[(2, 5)]).unwrap();
        let t = true;
        let f = false;
        assert_eq!(
            rows(&m),
            vec![
                vec![t, t, t, t, t, f], // q2: causal 0..2, then its block 3, 4
                vec![f, t, t, t, t, f], // q3: window drops 0
                vec![f, f, t, t, t, f], // q4
                vec![f, f, f, t, t, t], // q5: outside the block, causal in its window
            ]
        );
        // No blocks: the plain windowed causal mask.
        let plain = AttnMask::from_positions(&keys, 2, 4, Some(3)).unwrap();
        assert_eq!(
            rows(&plain),
            rows(&AttnMask::from_positions_blocks(&keys, 2, 4, Some(3), &[]).unwrap())
        );
    }
}
