//! Quantized caches (`--kv-cache-type q8|q4`) against the definition: attention over what a
//! cache of MLX's affine quantization holds must equal attention over the full history of
//! rows quantized and dequantized by MLX itself (each row on its own: quantization is per row
//! and group), with a causal (and window) mask, for any sequence of batched writes, single
//! writes and rewinds; snapshots and restores keep the quantized bits.

use cache::{KvCache, LatentCache, RotatingKvCache};
use mlx::fast::{scaled_dot_product_attention, sdpa_slots, Attention, SdpaLayout};
use mlx::{random, Array, Dtype, RowFormat, Rows, SdpaMask};
use proptest::prelude::*;

const D: i32 = 64;

/// Row `p` of kind `salt` in `version` (a rewritten position gets new contents).
fn row(p: usize, salt: u64, version: u64, width: i32) -> Array {
    let key = random::key(p as u64 * 1_000 + salt * 100 + version).unwrap();
    random::normal(&[1, 1, 1, width], Dtype::F32, 0.0, 1.0, Some(&key)).unwrap()
}

fn join(parts: &[Array]) -> Array {
    let refs: Vec<&Array> = parts.iter().collect();
    mlx::concatenate(&refs, 2).unwrap()
}

/// `x` as MLX's quantization gives it back.
fn roundtrip(x: &Array, bits: i32) -> Array {
    Rows::encode(x, RowFormat::Affine { bits })
        .unwrap()
        .dense()
        .unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec().unwrap()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-4 * y.abs().max(1.0))
}

#[derive(Default)]
struct History {
    versions: Vec<u64>,
    epoch: u64,
}

impl History {
    fn write(&mut self, start: usize, l: usize) -> (Array, Array, Array) {
        self.versions.truncate(start);
        self.versions.extend(std::iter::repeat_n(self.epoch, l));
        (
            self.data(start, start + l, 1),
            self.data(start, start + l, 2),
            self.data(start, start + l, 3),
        )
    }

    fn data(&self, start: usize, end: usize, salt: u64) -> Array {
        join(
            &(start..end)
                .map(|p| row(p, salt, self.versions[p], D))
                .collect::<Vec<_>>(),
        )
    }

    /// Attention of the queries at `start..end` over the quantized history (each query over
    /// its window, one at a time).
    fn reference(&self, start: usize, end: usize, window: Option<usize>, bits: i32) -> Vec<f32> {
        let mut out = Vec::new();
        let q = self.data(start, end, 3);
        for p in start..end {
            let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
            let k = roundtrip(&self.data(first, p + 1, 1), bits);
            let v = roundtrip(&self.data(first, p + 1, 2), bits);
            let qi = q
                .slice_axis(2, (p - start) as i32, Some((p - start + 1) as i32))
                .unwrap();
            let o = scaled_dot_product_attention(&qi, &k, &v, 0.125, SdpaMask::None, None).unwrap();
            out.push(f32s(&o));
        }
        // [1, 1, L, D] in query order.
        out.concat()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Attend(usize),
    Rewind(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            5 => Just(Op::Attend(1)),
            2 => (2usize..7).prop_map(Op::Attend),
            1 => (1usize..3).prop_map(Op::Rewind),
        ],
        1..16,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn a_quantized_kv_cache_equals_the_quantized_history(bits in prop_oneof![Just(8), Just(4)], ops in ops()) {
        let mut c = KvCache::with_format(RowFormat::Affine { bits });
        let mut h = History::default();
        for op in ops {
            match op {
                Op::Attend(l) => {
                    let start = c.offset();
                    let (wk, wv, q) = h.write(start, l);
                    let a = c.update_attend(&q, &wk, &wv, 0.125, SdpaLayout::Heads).unwrap();
                    prop_assert_eq!(a.kv.keys.bits(), Some(bits));
                    prop_assert!(close(&f32s(&a.out), &h.reference(start, start + l, None, bits)), "q{bits} attend {l} at {start}");
                    // The slots it read are what a KV-shared layer reads.
                    let again = f32s(&sdpa_slots(&q, &a.kv, Attention::new(0.125, a.mask.as_sdpa())).unwrap());
                    prop_assert!(close(&again, &f32s(&a.out)));
                }
                Op::Rewind(n) => {
                    let n = n.min(c.offset());
                    c.rewind(n).unwrap();
                    h.epoch += 1;
                }
            }
        }
    }

    #[test]
    fn a_quantized_sliding_window_equals_the_quantized_history(
        bits in prop_oneof![Just(8), Just(4)],
        window in 1usize..6,
        slack in 0usize..3,
        ops in ops(),
    ) {
        let mut c = RotatingKvCache::with_slack(window, slack).with_format(RowFormat::Affine { bits });
        let mut h = History::default();
        for op in ops {
            match op {
                Op::Attend(l) => {
                    let start = c.offset();
                    let (wk, wv, q) = h.write(start, l);
                    let a = c.update_attend(&q, &wk, &wv, 0.125, SdpaLayout::Heads).unwrap();
                    prop_assert_eq!(a.kv.keys.bits(), Some(bits));
                    prop_assert!(close(&f32s(&a.out), &h.reference(start, start + l, Some(window), bits)), "q{bits} window {window} attend {l} at {start}");
                }
                Op::Rewind(n) => {
                    if c.rewind(n).is_ok() {
                        h.epoch += 1;
                    }
                }
            }
        }
        // Its state restores to a cache that attends alike.
        if let Some((k, v)) = c.linear_state().unwrap() {
            prop_assert_eq!(k.bits(), Some(bits));
            let mut back = c.with_linear_state(k, v, c.offset()).unwrap();
            let start = c.offset();
            let (wk, wv, q) = h.write(start, 1);
            let a = back.update_attend(&q, &wk, &wv, 0.125, SdpaLayout::Heads).unwrap();
            prop_assert!(close(&f32s(&a.out), &h.reference(start, start + 1, Some(window), bits)), "restored");
        }
    }
}

/// MLA's rows quantized ([latent | rope key], the values the latent part read in place), as
/// GLM's decode step reads them; restoring from range copies keeps the packed bits.
#[test]
fn a_quantized_latent_cache_reads_its_values_in_place() {
    let (r, dr) = (128usize, 64usize);
    let width = (r + dr) as i32;
    for bits in [8, 4] {
        let mut c = LatentCache::with_format(RowFormat::Affine { bits }).with_values(r);
        let all: Vec<Array> = (0..20).map(|p| row(p, 1, 0, width)).collect();
        c.update(&join(&all[..12])).unwrap();
        let mut rows = None;
        for x in &all[12..] {
            rows = Some(c.update(x).unwrap());
        }
        let rows = rows.unwrap();
        assert_eq!(rows.bits(), Some(bits));
        assert_eq!(rows.time_len(), 20);
        let q = random::normal(
            &[1, 4, 1, width],
            Dtype::F32,
            0.0,
            1.0,
            Some(&random::key(9).unwrap()),
        )
        .unwrap();
        let kv = mlx::fast::KvSlots::of(rows.clone(), rows.first_values(r).unwrap());
        let got = f32s(&sdpa_slots(&q, &kv, Attention::new(0.1, SdpaMask::None)).unwrap());
        let deq = roundtrip(&join(&all), bits);
        let v = deq.slice_axis(3, 0, Some(r as i32)).unwrap();
        let want =
            f32s(&scaled_dot_product_attention(&q, &deq, &v, 0.1, SdpaMask::None, None).unwrap());
        assert!(close(&got, &want), "q{bits}: latent attention");
        // Range copies are the packed bits, and restore to the same rows.
        let (a, b) = (c.copy_range(0, 7).unwrap(), c.copy_range(7, 20).unwrap());
        assert_eq!(a.bits(), Some(bits));
        let back = LatentCache::from_runs(&[&a, &b], &c).unwrap();
        let again = back.copy_range(0, 20).unwrap();
        for (x, y) in again
            .arrays()
            .iter()
            .zip(c.copy_range(0, 20).unwrap().arrays())
        {
            assert_eq!(f32s(x), f32s(y), "q{bits}: restored bits");
        }
        // A quarter (q8) or under a sixth (q4) of float32's bytes per position.
        let f32_bytes = (r + dr) * 4;
        let ratio = c.bytes_per_position() as f64 / f32_bytes as f64;
        let bound = if bits == 8 { 0.3 } else { 0.17 };
        assert!(ratio < bound, "q{bits}: {ratio} of float32's bytes");
    }
}

/// Rows no MLX group size divides (tiny test models' heads) are stored as float16, and rows
/// that fit use groups of 64, or 32 where 64 does not divide them.
#[test]
fn the_group_follows_the_row_width() {
    assert_eq!(RowFormat::group_for(576), Some(64));
    assert_eq!(RowFormat::group_for(96), Some(32));
    assert_eq!(RowFormat::group_for(40), None);
    let x = row(0, 1, 0, 40);
    let r = Rows::encode(&x, RowFormat::Affine { bits: 8 }).unwrap();
    assert_eq!(r.format(), RowFormat::Float(Dtype::F16));
    let x = row(0, 1, 0, 96);
    match Rows::encode(&x, RowFormat::Affine { bits: 4 }).unwrap() {
        Rows::Affine(q) => assert_eq!((q.group_size, q.bits), (32, 4)),
        other => panic!("{other:?}"),
    }
}
