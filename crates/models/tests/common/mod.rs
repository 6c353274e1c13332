//! What the multimodal model tests share: a prompt's logits with media in place.
#![allow(dead_code)]

use mlx::{Array, Dtype};
use models::{DtypeChoice, MediaKind, MediaSpan, PackedRow};

/// Logits `[T, V]` (flattened) of `ids` through the model in `dir`, fed in passes of the given
/// lengths, each run of placeholder tokens (`placeholder`) replaced by the next item's soft
/// tokens; a pass holds an item whole.
pub fn mm_logits(
    dir: &std::path::Path,
    ids: &[i32],
    items: &[(Array, MediaKind)],
    passes: &[usize],
    placeholder: impl Fn(i32) -> bool,
) -> Vec<f32> {
    let m = models::load(dir, DtypeChoice::Fixed(Dtype::F32)).unwrap();
    // Each run of one placeholder token, in order: (start, len).
    let mut runs = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if placeholder(ids[i]) {
            let s = i;
            while i < ids.len() && ids[i] == ids[s] {
                i += 1;
            }
            runs.push((s, i - s));
        } else {
            i += 1;
        }
    }
    assert_eq!(runs.len(), items.len());
    let mut caches = m.model.make_caches();
    let (mut out, mut at) = (Vec::new(), 0);
    for &n in passes {
        let media: Vec<MediaSpan> = runs
            .iter()
            .zip(items)
            .filter(|((s, l), _)| *s >= at && s + l <= at + n)
            .map(|((s, l), (e, kind))| {
                assert_eq!(e.dim(0).unwrap() as usize, *l);
                MediaSpan {
                    at: s - at,
                    embeds: e.clone(),
                    kind: *kind,
                }
            })
            .collect();
        let tokens = Array::from_slice(&ids[at..at + n], &[1, n as i32]).unwrap();
        let h = m
            .model
            .forward_packed(
                &tokens,
                &mut [PackedRow {
                    seq: 0,
                    len: n,
                    caches: &mut caches,
                    media: &media,
                }],
            )
            .unwrap();
        out.extend(m.model.logits(&h).unwrap().to_vec::<f32>().unwrap());
        at += n;
    }
    assert_eq!(at, ids.len());
    out
}

/// Each row's argmax of `[T, vocab]` logits.
pub fn argmax_rows(v: &[f32], vocab: usize) -> Vec<usize> {
    v.chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        })
        .collect()
}
