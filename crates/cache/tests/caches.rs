//! Caches against the definition: attention over what a cache returns, with its mask, must equal
//! attention over the full history with a causal (and window) mask, for any sequence of batched
//! writes, single writes and rewinds. Positions rewritten after a rewind get new contents, so a
//! cache that kept any trace of the rewound (rejected) tokens would disagree with the reference,
//! which never saw them.

use cache::{AttnMask, KvCache, LatentCache, RotatingKvCache};
use mlx::fast::{scaled_dot_product_attention, Attention, SdpaLayout};
use mlx::{Array, Dtype, Ix};
use proptest::prelude::*;

const D: i32 = 4;

/// Deterministic keys/values/queries for positions `start..start+l`, `[1, 1, l, D]`.
fn rows(start: usize, l: usize, salt: u32) -> Array {
    let v: Vec<f32> = (0..l * D as usize)
        .map(|i| {
            let p = (start * D as usize + i) as u32;
            let h = p
                .wrapping_mul(2654435761)
                .wrapping_add(salt.wrapping_mul(40503));
            (h % 1000) as f32 / 500.0 - 1.0
        })
        .collect();
    Array::from_slice(&v, &[1, 1, l as i32, D]).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec().unwrap()
}

/// The contents each position holds now: rewriting a position after a rewind changes them.
#[derive(Default)]
struct History {
    versions: Vec<u32>,
    epoch: u32,
}

impl History {
    /// Records a write of `l` positions at `start`; returns (keys, values, queries) for them.
    fn write(&mut self, start: usize, l: usize) -> (Array, Array, Array) {
        self.versions.truncate(start);
        self.versions.extend(std::iter::repeat_n(self.epoch, l));
        (
            self.data(start, start + l, 1),
            self.data(start, start + l, 2),
            self.data(start, start + l, 3),
        )
    }

    fn rewound(&mut self) {
        self.epoch += 1;
    }

    fn data(&self, start: usize, end: usize, salt: u32) -> Array {
        let parts: Vec<Array> = (start..end)
            .map(|p| rows(p, 1, salt + 7 * self.versions[p]))
            .collect();
        let refs: Vec<&Array> = parts.iter().collect();
        mlx::concatenate(&refs, 2).unwrap()
    }

    /// Attention of the queries at `start..end` over exactly the history `0..end`.
    fn reference(&self, start: usize, end: usize, window: Option<usize>) -> Vec<f32> {
        let (k, v, q) = (
            self.data(0, end, 1),
            self.data(0, end, 2),
            self.data(start, end, 3),
        );
        let pos: Vec<i32> = (0..end as i32).collect();
        let m = AttnMask::from_positions(
            &pos,
            start as i32,
            (end - start) as i32,
            window.map(|w| w as i32),
        )
        .unwrap();
        f32s(&scaled_dot_product_attention(&q, &k, &v, 0.5, m.as_sdpa(), None).unwrap())
    }
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
}

#[derive(Debug, Clone)]
enum Op {
    /// `update`, then attention over what it returned with the cache's mask.
    Write(usize),
    /// `update_attend`: the write and attention in one call (one op for a single token).
    Attend(usize),
    Rewind(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => Just(Op::Write(1)),
            3 => Just(Op::Attend(1)),
            2 => (2usize..12).prop_map(Op::Write),
            1 => (2usize..12).prop_map(Op::Attend),
            1 => (1usize..4).prop_map(Op::Rewind),
        ],
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn rotating_cache_equals_full_history(window in 1usize..7, slack in 0usize..4, ops in ops()) {
        let mut c = RotatingKvCache::with_slack(window, slack);
        let mut h = History::default();
        for op in ops {
            match op {
                Op::Write(l) => {
                    let start = c.offset();
                    let (wk, wv, q) = h.write(start, l);
                    let (k, v) = c.update(&wk, &wv).unwrap();
                    let m = c.mask(l).unwrap();
                    let got = f32s(&scaled_dot_product_attention(&q, &k, &v, 0.5, m.as_sdpa(), None).unwrap());
                    prop_assert!(close(&got, &h.reference(start, start + l, Some(window))), "write {l} at {start}");
                }
                Op::Attend(l) => {
                    let start = c.offset();
                    let (wk, wv, q) = h.write(start, l);
                    let a = c.update_attend(&q, &wk, &wv, 0.5, SdpaLayout::Heads).unwrap();
                    prop_assert_eq!(c.offset(), start + l);
                    prop_assert!(close(&f32s(&a.out), &h.reference(start, start + l, Some(window))), "attend {l} at {start}");
                    // The slots it read, with its mask, are the same attention (a KV-shared layer's).
                    let again = f32s(&mlx::fast::sdpa_slots(&q, &a.kv, Attention::new(0.5, a.mask.as_sdpa())).unwrap());
                    prop_assert!(close(&again, &f32s(&a.out)));
                }
                Op::Rewind(n) => {
                    let before = c.offset();
                    if c.rewind(n).is_ok() {
                        prop_assert_eq!(c.offset(), before - n);
                        h.rewound();
                    } else {
                        // A refused rewind changes nothing.
                        prop_assert_eq!(c.offset(), before);
                    }
                }
            }
        }
    }

    #[test]
    fn kv_cache_equals_full_history(ops in ops()) {
        let mut c = KvCache::new();
        let mut h = History::default();
        for op in ops {
            match op {
                Op::Write(l) => {
                    let start = c.offset();
                    let (wk, wv, q) = h.write(start, l);
                    let (k, v) = c.update(&wk, &wv).unwrap();
                    let got = f32s(&scaled_dot_product_attention(&q, &k, &v, 0.5, c.mask(l).as_sdpa(), None).unwrap());
                    prop_assert!(close(&got, &h.reference(start, start + l, None)));
                }
                Op::Attend(l) => {
                    let start = c.offset();
                    let (wk, wv, q) = h.write(start, l);
                    let a = c.update_attend(&q, &wk, &wv, 0.5, SdpaLayout::Heads).unwrap();
                    prop_assert_eq!(c.offset(), start + l);
                    prop_assert!(close(&f32s(&a.out), &h.reference(start, start + l, None)), "attend {l} at {start}");
                    let again = f32s(&mlx::fast::sdpa_slots(&q, &a.kv, Attention::new(0.5, a.mask.as_sdpa())).unwrap());
                    prop_assert!(close(&again, &f32s(&a.out)));
                }
                Op::Rewind(n) => {
                    let n = n.min(c.offset());
                    let before = c.offset();
                    c.rewind(n).unwrap();
                    prop_assert_eq!(c.offset(), before - n);
                    h.rewound();
                }
            }
        }
    }
}

#[test]
fn batched_write_equals_single_steps() {
    let (window, total) = (4, 11);
    let mut batched = RotatingKvCache::new(window);
    let mut single = RotatingKvCache::new(window);
    batched.update(&rows(0, 3, 1), &rows(0, 3, 2)).unwrap();
    for p in 0..3 {
        single.update(&rows(p, 1, 1), &rows(p, 1, 2)).unwrap();
    }
    let (k, v) = batched
        .update(&rows(3, total - 3, 1), &rows(3, total - 3, 2))
        .unwrap();
    let m = batched.mask(total - 3).unwrap();
    let got = f32s(
        &scaled_dot_product_attention(&rows(3, total - 3, 3), &k, &v, 0.5, m.as_sdpa(), None)
            .unwrap(),
    );
    let mut want = Vec::new();
    for p in 3..total {
        let (k, v) = single.update(&rows(p, 1, 1), &rows(p, 1, 2)).unwrap();
        let m = single.mask(1).unwrap();
        want.extend(f32s(
            &scaled_dot_product_attention(&rows(p, 1, 3), &k, &v, 0.5, m.as_sdpa(), None).unwrap(),
        ));
    }
    assert!(close(&got, &want));
    // The ring never holds more than the window once single steps run.
    assert!(single.key_positions().len() <= window);
}

#[test]
fn rotating_rewind_limits() {
    // No slack: after the ring wraps, one token can be rewound, not two.
    let mut c = RotatingKvCache::new(4);
    for p in 0..10 {
        c.update(&rows(p, 1, 1), &rows(p, 1, 2)).unwrap();
    }
    let e = c.rewind(2).unwrap_err().to_string();
    assert!(e.contains("cannot rewind 2 tokens"), "{e}");
    assert_eq!(c.offset(), 10);
    c.rewind(1).unwrap();
    assert_eq!(c.offset(), 9);
    // With slack 3, up to 4 ring-written tokens can go.
    let mut c = RotatingKvCache::with_slack(4, 3);
    for p in 0..20 {
        c.update(&rows(p, 1, 1), &rows(p, 1, 2)).unwrap();
    }
    c.rewind(4).unwrap();
    assert!(c.rewind(1).is_err());
    // Early on, everything is held and any rewind within the offset works.
    let mut c = RotatingKvCache::new(8);
    c.update(&rows(0, 5, 1), &rows(0, 5, 2)).unwrap();
    c.rewind(5).unwrap();
    assert_eq!(c.offset(), 0);
    assert!(c.rewind(1).is_err());
}

#[test]
fn kv_cache_grows_past_a_step_and_rewinds() {
    let mut c = KvCache::new();
    c.update(&rows(0, 300, 1), &rows(0, 300, 2)).unwrap();
    let (k, _) = c.update(&rows(300, 1, 1), &rows(300, 1, 2)).unwrap();
    assert_eq!(k.shape(), vec![1, 1, 301, D]);
    assert_eq!(f32s(&k), f32s(&rows(0, 301, 1)));
    c.rewind(101).unwrap();
    let (k, _) = c.update(&rows(200, 2, 1), &rows(200, 2, 2)).unwrap();
    assert_eq!(f32s(&k), f32s(&rows(0, 202, 1)));
    assert!(c.rewind(500).is_err());
    assert!(c.nbytes() >= 512 * 4 * 4);
}

#[test]
fn latent_cache_appends_rows() {
    let mut c = LatentCache::new();
    c.update(&rows(0, 3, 1)).unwrap();
    let all = c.update(&rows(3, 1, 1)).unwrap();
    assert_eq!(f32s(&all.dense().unwrap()), f32s(&rows(0, 4, 1)));
    c.rewind(2).unwrap();
    assert_eq!(c.offset(), 2);
    assert!(matches!(c.mask(1), AttnMask::None));
    assert!(matches!(c.mask(3), AttnMask::Causal));
    let _ = Ix::full();
}

/// A decode step's write goes into the cache's own buffers (nothing else holds them once the
/// step is evaluated), and a clone of the cache (a snapshot) keeps what it saw.
#[test]
fn a_decode_steps_cache_write_updates_its_buffers_in_place() {
    let copies = || mlx::fast::fused_kernel_counts().sdpa_write_copies;
    let mut c = KvCache::new();
    let mut r = RotatingKvCache::new(4);
    c.update(&rows(0, 5, 1), &rows(0, 5, 2)).unwrap();
    r.update(&rows(0, 5, 1), &rows(0, 5, 2)).unwrap();
    let before = copies();
    let step = |c: &mut KvCache, r: &mut RotatingKvCache, p: usize| {
        let (k, v, q) = (rows(p, 1, 1), rows(p, 1, 2), rows(p, 1, 3));
        let a = c.update_attend(&q, &k, &v, 0.5, SdpaLayout::Heads).unwrap();
        let b = r.update_attend(&q, &k, &v, 0.5, SdpaLayout::Heads).unwrap();
        mlx::eval(&[&a.out, &b.out]).unwrap();
    };
    for p in 5..40 {
        step(&mut c, &mut r, p);
    }
    assert_eq!(copies(), before, "35 steps, no copies");
    let (snap_c, snap_r) = (c.clone(), r.clone());
    step(&mut c, &mut r, 40);
    assert_eq!(
        copies(),
        before + 4,
        "a snapshot's buffers are copied, not written"
    );
    let (k, _) = snap_c.state().unwrap().unwrap();
    assert_eq!(
        f32s(&k),
        f32s(&rows(0, 40, 1)),
        "the snapshot holds positions 0..40"
    );
    let (k, _, pos) = snap_r.state().unwrap().unwrap();
    let k = f32s(&k);
    assert_eq!(pos.len(), 4);
    for (slot, &p) in pos.iter().enumerate() {
        assert!(
            (36..40).contains(&p),
            "the snapshot's ring holds 36..40, not {p}"
        );
        let want = f32s(&rows(p as usize, 1, 1));
        assert_eq!(&k[slot * D as usize..(slot + 1) * D as usize], &want[..]);
    }
    let (k, _) = c.state().unwrap().unwrap();
    assert_eq!(f32s(&k), f32s(&rows(0, 41, 1)));
}
