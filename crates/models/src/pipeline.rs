//! Micro-batches down the stages of a model split by layers (docs/DISTRIBUTED.md, "Micro-batches").
//!
//! A pass whole leaves every stage but one waiting. Cut into micro-batches that follow each
//! other down the stages, the first stage computes the next micro-batch while the later ones
//! compute the previous. A pass is cut along its packed tokens into pieces of about equal
//! tokens: between rows where it can, inside a row where it must (the row's caches take the
//! first piece before the second reads them, as chunked prefill does), never inside a media
//! item, whose tokens may attend to each other both ways. Every rank cuts a pass the same way
//! from what it knows of it (the rows' lengths and media), so the ranks agree on the pieces
//! without a message.

use crate::packed::{MediaSpan, PackedRow};
use crate::parallel::Stage;
use crate::Result;
use mlx::{Array, Ix};
use std::ops::Range;

/// Part of one row in a micro-batch: `len` of its tokens from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub row: usize,
    pub start: usize,
    pub len: usize,
}

/// `rows` (their lengths, and in `whole` the token ranges of each that must not be cut) cut
/// into at most `parts` micro-batches of about equal tokens, in packed order. Fewer where
/// cuts would fall inside the same media item.
pub fn cut(lens: &[usize], whole: &[Vec<Range<usize>>], parts: usize) -> Vec<Vec<Piece>> {
    let total: usize = lens.iter().sum();
    let parts = parts.clamp(1, total.max(1));
    // Cut points in packed tokens, each moved past a media item it would split.
    let mut cuts = Vec::with_capacity(parts + 1);
    cuts.push(0);
    for k in 1..parts {
        let mut at = total * k / parts;
        let (mut row_start, mut row) = (0, 0);
        while row < lens.len() && row_start + lens[row] <= at {
            row_start += lens[row];
            row += 1;
        }
        if let Some(spans) = whole.get(row) {
            for s in spans {
                let (a, b) = (row_start + s.start, row_start + s.end);
                if a < at && at < b {
                    at = b;
                }
            }
        }
        if at > *cuts.last().unwrap_or(&0) && at < total {
            cuts.push(at);
        }
    }
    cuts.push(total);
    cuts.windows(2)
        .map(|w| {
            let (a, b) = (w[0], w[1]);
            let mut pieces = Vec::new();
            let mut row_start = 0;
            for (row, &len) in lens.iter().enumerate() {
                let (s, e) = (a.max(row_start), b.min(row_start + len));
                if s < e {
                    pieces.push(Piece {
                        row,
                        start: s - row_start,
                        len: e - s,
                    });
                }
                row_start += len;
            }
            pieces
        })
        .collect()
}

/// Runs a packed pass (`pass`: the model's forward over some rows) through `stage` in
/// micro-batches, one per stage, and returns the final hidden states of the whole pass as
/// the pass whole would. `None` where the pass goes whole (see [`Stage::micro_batches`]).
pub(crate) fn micro_batched(
    stage: &Stage,
    tokens: &Array,
    rows: &mut [PackedRow<'_>],
    mut pass: impl FnMut(&Array, &mut [PackedRow<'_>]) -> Result<Array>,
) -> Result<Option<Array>> {
    let lens: Vec<usize> = rows.iter().map(|r| r.len).collect();
    let parts = stage.micro_batches(lens.iter().sum());
    if parts < 2 {
        return Ok(None);
    }
    let whole: Vec<Vec<Range<usize>>> = rows
        .iter()
        .map(|r| r.media.iter().map(|m| m.at..m.at + m.len()).collect())
        .collect();
    let groups = cut(&lens, &whole, parts);
    if groups.len() < 2 {
        return Ok(None);
    }
    let flight = InFlight::take_off(stage);
    let outs = run_groups(tokens, rows, &groups, &mut pass)?;
    let outs = stage.land()?.unwrap_or(outs);
    drop(flight);
    let refs: Vec<&Array> = outs.iter().collect();
    Ok(Some(mlx::concatenate(&refs, 1)?))
}

/// A pass in micro-batches on `stage`, ended however the pass ends (an error or a panic part
/// way must not leave later passes thinking they fly).
struct InFlight<'s>(&'s Stage);

impl<'s> InFlight<'s> {
    fn take_off(stage: &'s Stage) -> InFlight<'s> {
        stage.take_off();
        InFlight(stage)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.abort_flight();
    }
}

/// Each group's pass in turn, over its pieces of the rows.
fn run_groups(
    tokens: &Array,
    rows: &mut [PackedRow<'_>],
    groups: &[Vec<Piece>],
    pass: &mut impl FnMut(&Array, &mut [PackedRow<'_>]) -> Result<Array>,
) -> Result<Vec<Array>> {
    let starts: Vec<usize> = rows
        .iter()
        .scan(0, |at, r| {
            let s = *at;
            *at += r.len;
            Some(s)
        })
        .collect();
    let mut outs = Vec::with_capacity(groups.len());
    for pieces in groups {
        let (Some(first), Some(last)) = (pieces.first(), pieces.last()) else {
            continue;
        };
        let a = starts[first.row] + first.start;
        let b = starts[last.row] + last.start + last.len;
        let toks = tokens.index(&[Ix::full(), Ix::slice(Some(a as i32), Some(b as i32), 1)])?;
        // A piece's media, at their places in the piece.
        let media: Vec<Vec<MediaSpan>> = pieces
            .iter()
            .map(|p| {
                rows[p.row]
                    .media
                    .iter()
                    .filter(|m| m.at >= p.start && m.at + m.len() <= p.start + p.len)
                    .map(|m| MediaSpan {
                        at: m.at - p.start,
                        ..m.clone()
                    })
                    .collect()
            })
            .collect();
        let mut sub: Vec<PackedRow<'_>> = rows[first.row..=last.row]
            .iter_mut()
            .zip(pieces)
            .zip(&media)
            .map(|((r, p), media)| PackedRow {
                seq: r.seq,
                len: p.len,
                caches: &mut *r.caches,
                media,
            })
            .collect();
        outs.push(pass(&toks, &mut sub)?);
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(groups: &[Vec<Piece>]) -> Vec<Vec<(usize, usize, usize)>> {
        groups
            .iter()
            .map(|g| g.iter().map(|p| (p.row, p.start, p.len)).collect())
            .collect()
    }

    #[test]
    fn rows_are_cut_into_equal_parts_in_packed_order() {
        // Four decode rows over two stages: two rows each.
        assert_eq!(
            spans(&cut(&[1, 1, 1, 1], &vec![vec![]; 4], 2)),
            vec![vec![(0, 0, 1), (1, 0, 1)], vec![(2, 0, 1), (3, 0, 1)]]
        );
        // One long row (a prefill chunk) is cut inside.
        assert_eq!(
            spans(&cut(&[10], &[vec![]], 3)),
            vec![vec![(0, 0, 3)], vec![(0, 3, 3)], vec![(0, 6, 4)]]
        );
        // Rows of unequal lengths: a cut falls inside the long one.
        assert_eq!(
            spans(&cut(&[2, 6], &[vec![], vec![]], 2)),
            vec![vec![(0, 0, 2), (1, 0, 2)], vec![(1, 2, 4)]]
        );
    }

    #[test]
    fn every_token_is_in_exactly_one_piece() {
        for lens in [vec![1], vec![3, 1, 4, 1, 5], vec![7, 7], vec![1; 9]] {
            let whole = vec![vec![]; lens.len()];
            for parts in 1..6 {
                let groups = cut(&lens, &whole, parts);
                let total: usize = lens.iter().sum();
                assert_eq!(groups.len(), parts.min(total));
                let mut seen = vec![0; lens.len()];
                for p in groups.iter().flatten() {
                    assert_eq!(p.start, seen[p.row], "{lens:?} in {parts}");
                    seen[p.row] += p.len;
                }
                assert_eq!(seen, lens);
            }
        }
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one media item per row
    fn media_items_stay_whole() {
        // A cut at 5 would split the image at 3..9: it moves to 9.
        assert_eq!(
            spans(&cut(&[10], &[vec![3..9]], 2)),
            vec![vec![(0, 0, 9)], vec![(0, 9, 1)]]
        );
        // An image to the row's end leaves no cut: the pass goes whole.
        assert_eq!(
            spans(&cut(&[10], &[vec![2..10]], 2)),
            vec![vec![(0, 0, 10)]]
        );
        // Two cuts moved to the same place make one.
        assert_eq!(
            spans(&cut(&[12], &[vec![1..11]], 3)),
            vec![vec![(0, 0, 11)], vec![(0, 11, 1)]]
        );
    }
}
