//! mlx-runner's fused CPU kernels (crates/mlx-sys/src/fused_cpu.cc) against the op graphs MLX
//! builds for the same calls: RMS norm, RoPE (both layouts, partial rotation, base or explicit
//! wavelengths, scalar and per-batch offsets), attention (grouped heads, causal, boolean and
//! additive masks, sinks, strided cache views, key splits across threads) and tanh-GELU, on
//! contiguous and transposed inputs; a decode step's per-head norm and rotation as one op. Each
//! case also checks that the kernel, not MLX, answered.

use mlx::fast::{
    self, Attention, FusedCounts, KvSlots, QkvNorms, RopeFreqs, Rotation, SdpaLayout, SdpaMask,
};
use mlx::{random, Array, Dtype, Rows};

/// The switch and counters are per process: the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(
        shape,
        Dtype::F32,
        0.0,
        1.0,
        Some(&random::key(seed).unwrap()),
    )
    .unwrap()
}

/// Runs `f` with the kernels on and off; returns (ours, MLX's) and how many kernel runs each
/// kind gained with them on.
fn both(f: impl Fn() -> Array) -> (Vec<f32>, Vec<f32>, Vec<i32>, FusedCounts) {
    let before = fast::fused_kernel_counts();
    fast::set_fused_kernels(true);
    let ours = f();
    ours.eval().unwrap();
    let after = fast::fused_kernel_counts();
    fast::set_fused_kernels(false);
    let theirs = f();
    theirs.eval().unwrap();
    fast::set_fused_kernels(true);
    assert_eq!(
        fast::fused_kernel_counts(),
        after,
        "switched off, MLX answers"
    );
    assert_eq!(ours.shape(), theirs.shape());
    let gained = FusedCounts {
        rms_norm: after.rms_norm - before.rms_norm,
        rope: after.rope - before.rope,
        sdpa: after.sdpa - before.sdpa,
        gelu_tanh: after.gelu_tanh - before.gelu_tanh,
        matmul: after.matmul - before.matmul,
        softcap: after.softcap - before.softcap,
        silu_mul: after.silu_mul - before.silu_mul,
        heads_norm_rope: after.heads_norm_rope - before.heads_norm_rope,
        sdpa_write_copies: after.sdpa_write_copies - before.sdpa_write_copies,
        softmax: after.softmax - before.softmax,
        panel_matmul: after.panel_matmul - before.panel_matmul,
    };
    (
        ours.to_vec::<f32>().unwrap(),
        theirs.to_vec::<f32>().unwrap(),
        ours.shape(),
        gained,
    )
}

fn assert_close(ours: &[f32], theirs: &[f32], tol: f32, what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}: element {i}: ours {a}, MLX {b}"
        );
    }
}

#[test]
fn rms_norm_matches_mlx() {
    let _one = serial();
    for (case, shape) in [vec![1, 768], vec![3, 5, 17], vec![130, 64], vec![2, 1, 7]]
        .into_iter()
        .enumerate()
    {
        let d = *shape.last().unwrap();
        let x = normal(&shape, case as u64);
        let w = normal(&[d], 100 + case as u64);
        for weight in [Some(&w), None] {
            let (ours, theirs, _, ran) = both(|| fast::rms_norm(&x, weight, 1e-6).unwrap());
            assert_close(&ours, &theirs, 1e-5, &format!("rms_norm {shape:?}"));
            assert_eq!(ran.rms_norm, 1, "the kernel ran for {shape:?}");
        }
    }
    // A transposed (non-contiguous) input.
    let x = normal(&[16, 9], 7).t().unwrap();
    let w = normal(&[16], 8);
    let (ours, theirs, _, ran) = both(|| fast::rms_norm(&x, Some(&w), 1e-5).unwrap());
    assert_close(&ours, &theirs, 1e-5, "rms_norm of a transposed input");
    assert_eq!(ran.rms_norm, 1);
}

#[test]
fn rope_matches_mlx() {
    let _one = serial();
    let wavelengths = Array::from_slice(
        &[
            1.0f32,
            10.0,
            1e4,
            f32::INFINITY,
            f32::INFINITY,
            3.5,
            700.0,
            2.0,
        ],
        &[8],
    )
    .unwrap();
    let mut case = 0;
    for traditional in [false, true] {
        for (shape, dims) in [
            (vec![1, 4, 1, 32], 32),
            (vec![2, 3, 5, 16], 8),
            (vec![1, 2, 9, 24], 16),
            (vec![3, 7, 32], 32),
        ] {
            for custom in [false, true] {
                let half = dims / 2;
                let freqs = if custom {
                    RopeFreqs::Custom(&wavelengths)
                } else {
                    RopeFreqs::Base(10000.0)
                };
                if custom && half != 8 {
                    continue;
                }
                case += 1;
                let x = normal(&shape, case);
                for (offset, scale) in [(0, 1.0), (37, 1.0), (1000, 0.25)] {
                    let (ours, theirs, _, ran) = both(|| {
                        fast::rope(
                            &x,
                            Rotation {
                                dims,
                                traditional,
                                freqs,
                                scale,
                            },
                            offset,
                        )
                        .unwrap()
                    });
                    let what = format!("rope {shape:?} dims {dims} traditional {traditional} custom {custom} offset {offset}");
                    assert_close(&ours, &theirs, 2e-5, &what);
                    assert_eq!(ran.rope, 1, "{what}");
                }
            }
        }
    }
    // [B, L, H, D] transposed to [B, H, L, D], as attention feeds it; per-batch offsets.
    let x = normal(&[2, 6, 3, 16], 99).transpose(&[0, 2, 1, 3]).unwrap();
    let offsets = Array::from_slice(&[5i32, 120], &[2]).unwrap();
    let (ours, theirs, _, ran) = both(|| {
        fast::rope_dynamic(
            &x,
            Rotation {
                dims: 16,
                traditional: false,
                freqs: RopeFreqs::Base(500.0),
                scale: 1.0,
            },
            &offsets,
        )
        .unwrap()
    });
    assert_close(
        &ours,
        &theirs,
        2e-5,
        "rope of a transposed input, per-batch offsets",
    );
    assert_eq!(ran.rope, 1);
}

fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: SdpaMask<'_>,
    sinks: Option<&Array>,
) -> (Vec<f32>, Vec<f32>, FusedCounts) {
    let (ours, theirs, _, ran) =
        both(|| fast::scaled_dot_product_attention(q, k, v, scale, mask, sinks).unwrap());
    (ours, theirs, ran)
}

#[test]
fn attention_matches_mlx() {
    let _one = serial();
    let mut seed = 1000;
    let mut next = || {
        seed += 1;
        seed
    };
    // (batch, query heads, kv heads, queries, keys, head dim, value dim)
    for (b, hq, hk, l, s, d, dv) in [
        (1, 4, 4, 1, 1, 16, 16),
        (1, 8, 2, 1, 37, 32, 32),
        (1, 8, 1, 3, 300, 64, 64),
        (2, 4, 2, 16, 40, 24, 24),
        (1, 6, 1, 2, 513, 40, 32),
        (3, 2, 2, 5, 9, 8, 12),
    ] {
        let q = normal(&[b, hq, l, d], next());
        let k = normal(&[b, hk, s, d], next());
        let v = normal(&[b, hk, s, dv], next());
        let what = format!("sdpa B{b} Hq{hq} Hk{hk} L{l} S{s} D{d} Dv{dv}");
        for (name, mask) in [("none", SdpaMask::None), ("causal", SdpaMask::Causal)] {
            let (ours, theirs, ran) = attention(&q, &k, &v, 0.125, mask, None);
            assert_close(&ours, &theirs, 1e-5, &format!("{what} mask {name}"));
            assert_eq!(ran.sdpa, 1, "{what} mask {name}");
        }
        // A boolean window mask [L, S] broadcast over batch and heads: keys more than 4 behind
        // each query are hidden.
        let allowed: Vec<bool> = (0..l)
            .flat_map(|i| (0..s).map(move |j| j <= s - l + i && j + 4 >= s - l + i))
            .collect();
        let window = Array::from_slice(&allowed, &[l, s]).unwrap();
        let (ours, theirs, ran) = attention(&q, &k, &v, 1.0, SdpaMask::Array(&window), None);
        assert_close(&ours, &theirs, 1e-5, &format!("{what} bool mask"));
        assert_eq!(ran.sdpa, 1);
        // An additive mask per batch and head.
        let additive = normal(&[b, hq, l, s], next());
        let (ours, theirs, ran) = attention(&q, &k, &v, 0.3, SdpaMask::Array(&additive), None);
        assert_close(&ours, &theirs, 1e-5, &format!("{what} additive mask"));
        assert_eq!(ran.sdpa, 1);
        // Sinks.
        let sinks = normal(&[hq], next());
        let (ours, theirs, ran) = attention(&q, &k, &v, 0.5, SdpaMask::Causal, Some(&sinks));
        assert_close(&ours, &theirs, 1e-5, &format!("{what} sinks"));
        assert_eq!(ran.sdpa, 1);
    }
}

#[test]
fn attention_reads_strided_cache_views() {
    let _one = serial();
    // A cache buffer [B, Hk, 64, D] of which 23 steps are filled, and queries transposed from
    // [B, L, H, D]: the way a decode step reads them.
    let buf_k = normal(&[1, 2, 64, 32], 1);
    let buf_v = normal(&[1, 2, 64, 32], 2);
    let k = buf_k.slice_axis(2, 0, Some(23)).unwrap();
    let v = buf_v.slice_axis(2, 0, Some(23)).unwrap();
    let q = normal(&[1, 2, 4, 32], 3).transpose(&[0, 2, 1, 3]).unwrap();
    let (ours, theirs, ran) = attention(&q, &k, &v, 0.2, SdpaMask::Causal, None);
    assert_close(&ours, &theirs, 1e-5, "strided views");
    assert_eq!(ran.sdpa, 1);
    // A transposed key layout (last axis strided) is copied, not misread.
    let kt = normal(&[1, 2, 32, 23], 4).transpose(&[0, 1, 3, 2]).unwrap();
    let (ours, theirs, ran) = attention(&q, &kt, &v, 0.2, SdpaMask::None, None);
    assert_close(&ours, &theirs, 1e-5, "keys with a strided last axis");
    assert_eq!(ran.sdpa, 1);
}

/// A query row's output is the same bits whichever rows it is computed with: the kernel takes
/// query rows in tiles, and a verify step's rows must equal the one-row decode steps they
/// replace (speculative decoding's greedy output is the plain one).
#[test]
fn attention_rows_do_not_depend_on_their_neighbours() {
    let _one = serial();
    fast::set_fused_kernels(true);
    // 8 query heads on 2 kv heads, 5 query positions: 20 rows per kv head, tiles of mixed
    // heads and positions; head dims with 16-, 8- and 1-lane tails; 3 key blocks.
    let before = fast::fused_kernel_counts().sdpa;
    for (d, dv) in [(128, 128), (40, 24), (19, 13)] {
        let q = normal(&[1, 8, 5, d], 7);
        let k = normal(&[1, 2, 150, d], 8);
        let v = normal(&[1, 2, 150, dv], 9);
        let all = fast::scaled_dot_product_attention(&q, &k, &v, 0.1, SdpaMask::None, None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for i in 0..5 {
            let qi = q.slice_axis(2, i, Some(i + 1)).unwrap();
            let one = fast::scaled_dot_product_attention(&qi, &k, &v, 0.1, SdpaMask::None, None)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            for h in 0..8 {
                let row =
                    |x: &[f32], at: usize| x[at * dv as usize..(at + 1) * dv as usize].to_vec();
                assert_eq!(
                    row(&one, h),
                    row(&all, h * 5 + i as usize),
                    "head {h}, position {i}, D {d}"
                );
            }
        }
    }
    assert_eq!(
        fast::fused_kernel_counts().sdpa - before,
        18,
        "the kernel answered"
    );
}

/// A causal row of a verify step (L queries at the end of S keys) is the same bits as the
/// one-query decode step at its position, which sees only the keys up to its own: the keys it
/// must not see weigh exactly nothing, wherever they fall (inside a key block, a block of their
/// own, a part of their own), so speculative decoding's greedy output is the plain one.
#[test]
fn a_verify_row_is_the_decode_step_at_its_position() {
    let _one = serial();
    fast::set_fused_kernels(true);
    let before = fast::fused_kernel_counts().sdpa;
    let mut runs = 0;
    // Key counts whose last rows straddle a key block (64) and a part (256) boundary.
    for (hk, s, d) in [
        (1, 258, 64),
        (2, 131, 128),
        (2, 600, 32),
        (1, 70, 24),
        (1, 1030, 16),
    ] {
        let l = 5;
        let q = normal(&[1, 4, l, d], 11);
        let k = normal(&[1, hk, s, d], 12);
        let v = normal(&[1, hk, s, d], 13);
        let all = fast::scaled_dot_product_attention(&q, &k, &v, 0.2, SdpaMask::Causal, None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        runs += 1;
        for i in 0..l {
            let seen = s - l + i + 1;
            let qi = q.slice_axis(2, i, Some(i + 1)).unwrap();
            let ki = k.slice_axis(2, 0, Some(seen)).unwrap();
            let vi = v.slice_axis(2, 0, Some(seen)).unwrap();
            let one = fast::scaled_dot_product_attention(&qi, &ki, &vi, 0.2, SdpaMask::None, None)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            runs += 1;
            for h in 0..4 {
                let du = d as usize;
                assert_eq!(
                    one[h * du..(h + 1) * du],
                    all[(h * l as usize + i as usize) * du..(h * l as usize + i as usize + 1) * du],
                    "kv heads {hk}, {s} keys, head {h}, query {i}"
                );
            }
        }
    }
    assert_eq!(
        fast::fused_kernel_counts().sdpa - before,
        runs,
        "the kernel answered"
    );
}

/// The same over quantized caches read packed (q8 and q4, groups of 32 and 64): each row of a
/// causal verify step (L queries at the end of S keys) is the bits of the one-query step over the
/// first keys up to its own, whichever rows share its tile and key blocks; and the values' pass
/// gives the same bits with 512- and 256-bit vectors.
#[test]
fn a_verify_row_over_a_quantized_cache_is_the_decode_step_at_its_position() {
    let _one = serial();
    fast::set_fused_kernels(true);
    let before = fast::fused_kernel_counts().sdpa;
    let mut runs = 0;
    for bits in [8, 4] {
        for (hq, hk, s, d, group) in [
            (4, 1, 258, 64, 64),
            (8, 2, 131, 128, 32),
            (4, 2, 600, 32, 32),
        ] {
            let l = 5;
            let q = normal(&[1, hq, l, d], 21);
            let quant = |a: Array| Rows::Affine(a.quantize(group, bits).unwrap());
            let kv = KvSlots::of(
                quant(normal(&[1, hk, s, d], 22)),
                quant(normal(&[1, hk, s, d], 23)),
            );
            let verify = || {
                fast::sdpa_slots(&q, &kv, Attention::new(0.2, SdpaMask::Causal))
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap()
            };
            let all = verify();
            fast::set_vector_width(256);
            let narrow = verify();
            fast::set_vector_width(512);
            runs += 2;
            assert!(
                all.iter()
                    .zip(&narrow)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "q{bits} g{group}: 256-bit vectors give other bits"
            );
            for i in 0..l {
                let qi = q.slice_axis(2, i, Some(i + 1)).unwrap();
                let seen = KvSlots {
                    len: (s - l + i + 1) as usize,
                    ..kv.clone()
                };
                let one = fast::sdpa_slots(&qi, &seen, Attention::new(0.2, SdpaMask::None))
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                runs += 1;
                let (du, lu) = (d as usize, l as usize);
                for h in 0..hq as usize {
                    let at = (h * lu + i as usize) * du;
                    assert_eq!(
                        one[h * du..(h + 1) * du],
                        all[at..at + du],
                        "q{bits} g{group}: {s} keys, head {h}, query {i}"
                    );
                }
            }
        }
    }
    assert_eq!(
        fast::fused_kernel_counts().sdpa - before,
        runs,
        "the kernel answered"
    );
}

/// A cache write and the attention that reads it as one op (`sdpa_write`): the buffers come back
/// with exactly the new rows in their slots and attention over their first `len` slots is what
/// MLX's slice_update, slice and attention give; attention over a buffer's first slots
/// (`sdpa_slots`) is the kernel's own bits over a view of them.
#[test]
fn a_cache_write_and_its_attention_are_one_op() {
    let _one = serial();
    let mut seed = 7000;
    let mut next = || {
        seed += 1;
        seed
    };
    // (batch, query heads, kv heads, new rows, buffer slots, write at, slots read, dims, mask)
    let window: Vec<bool> = (0..32).map(|j| j % 3 != 1).collect();
    let window = Array::from_slice(&window, &[1, 32]).unwrap();
    for (b, hq, hk, l, slots, at, len, d, dv, mask) in [
        // A decode step into a growing buffer.
        (1, 8, 2, 1, 256, 37, 38, 32, 32, SdpaMask::None),
        // A full ring: the write lands mid-buffer and attention reads every slot.
        (1, 8, 2, 1, 16, 5, 16, 16, 16, SdpaMask::None),
        // A verify step's rows.
        (2, 4, 1, 3, 64, 10, 13, 24, 12, SdpaMask::Causal),
        // A window mask over the slots read.
        (1, 4, 2, 1, 40, 31, 32, 8, 8, SdpaMask::Array(&window)),
    ] {
        let what = format!("write {l} rows at {at} of {slots}, read {len}, B{b} Hq{hq} Hk{hk}");
        let q = normal(&[b, hq, l, d], next());
        let (kn, vn) = (
            normal(&[b, hk, l, d], next()),
            normal(&[b, hk, l, dv], next()),
        );
        let (kb, vb) = (
            normal(&[b, hk, slots, d], next()),
            normal(&[b, hk, slots, dv], next()),
        );
        let flat = |a: &Array| a.reshape(&[-1]).unwrap();
        let (kb_was, vb_was) = (kb.to_vec::<f32>().unwrap(), vb.to_vec::<f32>().unwrap());
        let (ours, theirs, _, ran) = both(|| {
            let into = KvSlots {
                keys: Rows::Dense(kb.clone()),
                values: Rows::Dense(vb.clone()),
                len,
            };
            let (out, kv) = fast::sdpa_write(
                &q,
                (&Rows::Dense(kn.clone()), &Rows::Dense(vn.clone())),
                &into,
                at,
                Attention::new(0.3, mask),
            )
            .unwrap();
            mlx::concatenate(
                &[
                    &flat(&out),
                    &flat(&kv.keys.dense().unwrap()),
                    &flat(&kv.values.dense().unwrap()),
                ],
                0,
            )
            .unwrap()
        });
        assert_eq!(ran.sdpa, 1, "{what}: one op");
        // The test holds the buffers, so the op wrote into copies of them.
        assert_eq!(ran.sdpa_write_copies, 2, "{what}");
        let n_out = (b * hq * l * dv) as usize;
        assert_close(&ours[..n_out], &theirs[..n_out], 1e-5, &what);
        assert_eq!(
            ours[n_out..],
            theirs[n_out..],
            "{what}: the buffers are slice_update's"
        );
        // The buffers the test holds are as they were.
        assert_eq!(kb.to_vec::<f32>().unwrap(), kb_was, "{what}");
        assert_eq!(vb.to_vec::<f32>().unwrap(), vb_was, "{what}");
        // The attention is the kernel's bits over views of the written slots.
        let into = KvSlots {
            keys: Rows::Dense(kb.clone()),
            values: Rows::Dense(vb.clone()),
            len,
        };
        let (out, kv) = fast::sdpa_write(
            &q,
            (&Rows::Dense(kn.clone()), &Rows::Dense(vn.clone())),
            &into,
            at,
            Attention::new(0.3, mask),
        )
        .unwrap();
        let (kview, vview) = kv.view().unwrap();
        let plain =
            fast::scaled_dot_product_attention(&q, &kview, &vview, 0.3, mask, None).unwrap();
        let over_slots = fast::sdpa_slots(&q, &kv, Attention::new(0.3, mask)).unwrap();
        assert_eq!(
            out.to_vec::<f32>().unwrap(),
            plain.to_vec::<f32>().unwrap(),
            "{what}"
        );
        assert_eq!(
            over_slots.to_vec::<f32>().unwrap(),
            plain.to_vec::<f32>().unwrap(),
            "{what}"
        );
        // Laid out by token, it is the same values with the heads joined, from the kernel and
        // from MLX's graph.
        let by_token = Attention::new(0.3, mask).with_layout(SdpaLayout::Tokens);
        let (ours, theirs, shape, ran) = both(|| fast::sdpa_slots(&q, &kv, by_token).unwrap());
        assert_eq!(ran.sdpa, 1, "{what}");
        assert_eq!(shape, vec![b, l, hq * dv], "{what}");
        let sh = plain.shape();
        let joined = plain
            .transpose(&[0, 2, 1, 3])
            .unwrap()
            .reshape(&[sh[0], sh[2], sh[1] * sh[3]])
            .unwrap();
        assert_eq!(
            ours,
            joined.to_vec::<f32>().unwrap(),
            "{what}: tokens layout"
        );
        assert_close(&ours, &theirs, 1e-5, &format!("{what}: tokens layout, MLX"));
    }
}

/// A buffer nothing else holds is written in place, over many steps, and a buffer that something
/// still reads (a snapshot, the previous step's view) is copied, never changed under its reader.
#[test]
fn a_cache_write_takes_over_a_buffer_only_when_nothing_else_holds_it() {
    let _one = serial();
    let copies = || fast::fused_kernel_counts().sdpa_write_copies;
    let mut kv = KvSlots {
        keys: Rows::Dense(normal(&[1, 2, 64, 16], 1).copy().unwrap()),
        values: Rows::Dense(normal(&[1, 2, 64, 16], 2).copy().unwrap()),
        len: 0,
    };
    mlx::eval(&[kv.keys.arrays(), kv.values.arrays()].concat()).unwrap();
    let before = copies();
    let mut snapshot = None;
    for at in 0..40 {
        let q = normal(&[1, 4, 1, 16], 100 + at as u64);
        let (k, v) = (
            Rows::Dense(normal(&[1, 2, 1, 16], 200 + at as u64)),
            Rows::Dense(normal(&[1, 2, 1, 16], 300 + at as u64)),
        );
        let into = KvSlots { len: at + 1, ..kv };
        let (out, next) =
            fast::sdpa_write(&q, (&k, &v), &into, at, Attention::new(1.0, SdpaMask::None)).unwrap();
        drop(into);
        kv = next;
        if at == 20 {
            // Something reads step 20's keys later: step 21 must not write into them.
            let keys = kv.keys.dense().unwrap();
            snapshot = Some((keys.clone(), keys.to_vec::<f32>().unwrap()));
        }
        out.eval().unwrap();
    }
    assert_eq!(
        copies() - before,
        1,
        "only the write after the snapshot copied, and only the keys"
    );
    let (held, was) = snapshot.unwrap();
    assert_eq!(
        held.to_vec::<f32>().unwrap(),
        was,
        "the snapshot did not change"
    );
    // The live buffer holds every step's rows.
    let keys = kv.keys.dense().unwrap().to_vec::<f32>().unwrap();
    for at in [0usize, 20, 21, 39] {
        let row = normal(&[1, 2, 1, 16], 200 + at as u64)
            .to_vec::<f32>()
            .unwrap();
        for h in 0..2 {
            let got = &keys[(h * 64 + at) * 16..(h * 64 + at + 1) * 16];
            assert_eq!(got, &row[h * 16..(h + 1) * 16], "step {at} head {h}");
        }
    }
}

#[test]
fn attention_over_slots_refuses_slots_the_buffer_does_not_have() {
    let _one = serial();
    let q = normal(&[1, 2, 1, 8], 1);
    let kv = KvSlots {
        keys: Rows::Dense(normal(&[1, 1, 16, 8], 2)),
        values: Rows::Dense(normal(&[1, 1, 16, 8], 3)),
        len: 17,
    };
    let err = fast::sdpa_slots(&q, &kv, Attention::new(1.0, SdpaMask::None)).unwrap_err();
    assert!(
        err.to_string()
            .contains("attention over 17 slots of a buffer of 16"),
        "{err}"
    );
    let row = Rows::Dense(normal(&[1, 1, 1, 8], 4));
    let into = KvSlots { len: 16, ..kv };
    let err = fast::sdpa_write(
        &q,
        (&row, &row),
        &into,
        16,
        Attention::new(1.0, SdpaMask::None),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("writing rows at slot 16 of a buffer of 16"),
        "{err}"
    );
    let wide = Rows::Dense(normal(&[1, 1, 1, 9], 5));
    let err = fast::sdpa_write(
        &q,
        (&wide, &wide),
        &into,
        3,
        Attention::new(1.0, SdpaMask::None),
    )
    .and_then(|(o, _)| o.eval())
    .unwrap_err();
    assert!(!err.to_string().is_empty());
}

/// Caches of float16 or bfloat16 (`--kv-cache-type`) are read in their type by the kernel, each
/// element widened exactly, and agree with MLX's graph (which widens the whole cache first);
/// a write into such buffers stores the rows' bits.
#[test]
fn attention_reads_half_precision_caches_in_their_type() {
    let _one = serial();
    let mut seed = 9000;
    let mut next = || {
        seed += 1;
        seed
    };
    for dtype in [Dtype::F16, Dtype::Bf16] {
        for (b, hq, hk, l, s, d, dv) in [
            (1, 8, 2, 1, 37, 32, 32),
            (1, 8, 1, 3, 300, 64, 64),
            (2, 4, 2, 16, 40, 24, 24),
            (1, 6, 1, 2, 513, 40, 36),
            // Head dims past the last 8-wide chunk: the scalar tails.
            (1, 4, 2, 3, 70, 20, 13),
        ] {
            let q = normal(&[b, hq, l, d], next());
            let k = normal(&[b, hk, s, d], next()).astype(dtype).unwrap();
            let v = normal(&[b, hk, s, dv], next()).astype(dtype).unwrap();
            let what = format!("{dtype:?} sdpa B{b} Hq{hq} Hk{hk} L{l} S{s} D{d} Dv{dv}");
            for (name, mask) in [("none", SdpaMask::None), ("causal", SdpaMask::Causal)] {
                let (ours, theirs, ran) = attention(&q, &k, &v, 0.125, mask, None);
                assert_close(&ours, &theirs, 1e-5, &format!("{what} mask {name}"));
                assert_eq!(ran.sdpa, 1, "{what} mask {name}: the kernel ran");
            }
        }
        // A decode step's write into half-precision buffers, and its attention.
        let (b, hq, hk, slots, at, len, d) = (1, 8, 2, 64, 20, 21, 32);
        let q = normal(&[b, hq, 1, d], next());
        let kn = normal(&[b, hk, 1, d], next()).astype(dtype).unwrap();
        let vn = normal(&[b, hk, 1, d], next()).astype(dtype).unwrap();
        let kb = normal(&[b, hk, slots, d], next()).astype(dtype).unwrap();
        let vb = normal(&[b, hk, slots, d], next()).astype(dtype).unwrap();
        let flat = |a: &Array| a.astype(Dtype::F32).unwrap().reshape(&[-1]).unwrap();
        let (ours, theirs, _, ran) = both(|| {
            let into = KvSlots {
                keys: Rows::Dense(kb.clone()),
                values: Rows::Dense(vb.clone()),
                len,
            };
            let (out, kv) = fast::sdpa_write(
                &q,
                (&Rows::Dense(kn.clone()), &Rows::Dense(vn.clone())),
                &into,
                at,
                Attention::new(0.3, SdpaMask::None),
            )
            .unwrap();
            assert_eq!(
                kv.keys.format(),
                mlx::RowFormat::Float(dtype),
                "the buffers keep their type"
            );
            mlx::concatenate(
                &[
                    &flat(&out),
                    &flat(&kv.keys.dense().unwrap()),
                    &flat(&kv.values.dense().unwrap()),
                ],
                0,
            )
            .unwrap()
        });
        assert_eq!(ran.sdpa, 1, "{dtype:?} write: one op");
        let n_out = (b * hq * d) as usize;
        assert_close(
            &ours[..n_out],
            &theirs[..n_out],
            1e-5,
            &format!("{dtype:?} write"),
        );
        assert_eq!(
            ours[n_out..],
            theirs[n_out..],
            "{dtype:?}: the buffers are slice_update's"
        );
    }
}

/// Caches of MLX's affine quantization (`--kv-cache-type q8|q4`) are read packed by the
/// kernel, a key block at a time, and agree with MLX's graph (its `dequantize`, then
/// attention); MLA's values as the first columns of the quantized key rows too; a write into
/// such buffers stores the quantized rows' bits.
#[test]
fn attention_reads_quantized_caches_packed() {
    let _one = serial();
    let mut seed = 9500;
    let mut next = || {
        seed += 1;
        seed
    };
    let quant = |a: Array, group: i32, bits: i32| Rows::Affine(a.quantize(group, bits).unwrap());
    for bits in [8, 4] {
        // (batch, query heads, kv heads, queries, slots, dims, value dims, group)
        for (b, hq, hk, l, s, d, dv, group) in [
            (1, 8, 2, 1, 37, 64, 64, 64),
            (1, 8, 1, 3, 300, 128, 128, 64),
            (2, 4, 2, 16, 40, 32, 32, 32),
            (1, 6, 1, 2, 513, 96, 64, 32),
        ] {
            let q = normal(&[b, hq, l, d], next());
            let k = quant(normal(&[b, hk, s, d], next()), group, bits);
            let v = quant(normal(&[b, hk, s, dv], next()), group, bits);
            let kv = KvSlots::of(k, v);
            let what = format!("q{bits} sdpa B{b} Hq{hq} Hk{hk} L{l} S{s} D{d} Dv{dv} g{group}");
            for (name, mask) in [("none", SdpaMask::None), ("causal", SdpaMask::Causal)] {
                let (ours, theirs, _, ran) =
                    both(|| fast::sdpa_slots(&q, &kv, Attention::new(0.125, mask)).unwrap());
                assert_close(&ours, &theirs, 1e-5, &format!("{what} mask {name}"));
                assert_eq!(ran.sdpa, 1, "{what} mask {name}: the kernel ran");
            }
            // Over the first slots only, as a cache reads its buffer.
            let part = KvSlots {
                len: (s / 2 + l) as usize,
                ..kv.clone()
            };
            let (ours, theirs, _, ran) = both(|| {
                fast::sdpa_slots(&q, &part, Attention::new(0.125, SdpaMask::Causal)).unwrap()
            });
            assert_close(&ours, &theirs, 1e-5, &format!("{what}: first slots"));
            assert_eq!(ran.sdpa, 1, "{what}: first slots");
        }
        // MLA: one quantized row per token ([latent | rope key]), the values its latent part.
        let (r, dr, s) = (512, 64, 70);
        let rows = quant(normal(&[1, 1, s, r + dr], next()), 64, bits);
        let kv = KvSlots::of(rows.clone(), rows.first_values(r as usize).unwrap());
        let q = normal(&[1, 4, 1, r + dr], next());
        let (ours, theirs, shape, ran) =
            both(|| fast::sdpa_slots(&q, &kv, Attention::new(0.1, SdpaMask::None)).unwrap());
        assert_eq!(shape, vec![1, 4, 1, r]);
        assert_close(&ours, &theirs, 1e-5, &format!("q{bits} MLA values"));
        assert_eq!(ran.sdpa, 1, "q{bits} MLA values: the kernel ran");

        // A decode step's write into quantized buffers, and its attention.
        let (b, hq, hk, slots, at, len, d) = (1, 8, 2, 64, 20, 21, 64);
        let q = normal(&[b, hq, 1, d], next());
        let kn = quant(normal(&[b, hk, 1, d], next()), 64, bits);
        let vn = quant(normal(&[b, hk, 1, d], next()), 64, bits);
        let kb = quant(normal(&[b, hk, slots, d], next()), 64, bits);
        let vb = quant(normal(&[b, hk, slots, d], next()), 64, bits);
        let flat = |r: &Rows| -> Array {
            let parts: Vec<Array> = r
                .arrays()
                .iter()
                .map(|a| a.astype(Dtype::F32).unwrap().reshape(&[-1]).unwrap())
                .collect();
            let refs: Vec<&Array> = parts.iter().collect();
            mlx::concatenate(&refs, 0).unwrap()
        };
        let (ours, theirs, _, ran) = both(|| {
            let into = KvSlots {
                keys: kb.clone(),
                values: vb.clone(),
                len,
            };
            let (out, kv) = fast::sdpa_write(
                &q,
                (&kn, &vn),
                &into,
                at,
                Attention::new(0.3, SdpaMask::None),
            )
            .unwrap();
            assert_eq!(kv.keys.bits(), Some(bits), "the buffers stay quantized");
            let o = out.reshape(&[-1]).unwrap();
            mlx::concatenate(&[&o, &flat(&kv.keys), &flat(&kv.values)], 0).unwrap()
        });
        assert_eq!(ran.sdpa, 1, "q{bits} write: one op");
        let n_out = (b * hq * d) as usize;
        assert_close(
            &ours[..n_out],
            &theirs[..n_out],
            1e-5,
            &format!("q{bits} write"),
        );
        assert_eq!(
            ours[n_out..],
            theirs[n_out..],
            "q{bits}: the buffers are slice_update's"
        );
    }
}

#[test]
fn attention_leaves_long_prompts_and_other_dtypes_to_mlx() {
    let _one = serial();
    let q = normal(&[1, 2, 17, 16], 1);
    let k = normal(&[1, 2, 17, 16], 2);
    let (ours, theirs, ran) = attention(&q, &k, &k, 1.0, SdpaMask::Causal, None);
    assert_close(&ours, &theirs, 0.0, "17 queries");
    assert_eq!(ran.sdpa, 0, "17 queries go to MLX's graph");
    let h = q
        .astype(Dtype::F16)
        .unwrap()
        .slice_axis(2, 0, Some(1))
        .unwrap();
    let kh = k.astype(Dtype::F16).unwrap();
    let before = fast::fused_kernel_counts();
    fast::scaled_dot_product_attention(&h, &kh, &kh, 1.0, SdpaMask::None, None)
        .unwrap()
        .eval()
        .unwrap();
    fast::rms_norm(&kh, None, 1e-6).unwrap().eval().unwrap();
    assert_eq!(fast::fused_kernel_counts(), before, "float16 goes to MLX");
    // Shapes MLX refuses are still refused, with MLX's message.
    let bad = normal(&[1, 3, 1, 16], 5);
    let err = fast::scaled_dot_product_attention(&bad, &k, &k, 1.0, SdpaMask::None, None)
        .map(|a| a.eval())
        .unwrap_err();
    assert!(err.to_string().contains("n_heads"), "{err}");
}

#[test]
fn gelu_matches_mlx() {
    let _one = serial();
    for (case, shape) in [vec![1, 7], vec![3, 2048], vec![64, 1000]]
        .into_iter()
        .enumerate()
    {
        let x = normal(&shape, case as u64).multiply_scalar(3.0).unwrap();
        let (ours, theirs, _, ran) = both(|| fast::gelu_tanh(&x).unwrap());
        assert_close(&ours, &theirs, 1e-5, &format!("gelu {shape:?}"));
        assert_eq!(ran.gelu_tanh, 1);
    }
    // The tails, zero, tiny values and both vector and scalar lanes (19 values).
    let tails = [
        -100.0f32, -50.0, -10.0, -5.0, -3.0, -1e-6, 0.0, 1e-6, 0.5, 1.0, 3.0, 5.0, 10.0, 50.0,
        100.0, -0.7, 0.7, -2.5, 2.5,
    ];
    let x = Array::from_slice(&tails, &[19]).unwrap();
    let (ours, theirs, _, ran) = both(|| fast::gelu_tanh(&x).unwrap());
    assert_close(&ours, &theirs, 1e-5, "gelu tails");
    assert_eq!(ran.gelu_tanh, 1);
    let x = normal(&[40, 30], 9).t().unwrap();
    let (ours, theirs, _, ran) = both(|| fast::gelu_tanh(&x).unwrap());
    assert_close(&ours, &theirs, 1e-5, "gelu of a transposed input");
    assert_eq!(ran.gelu_tanh, 1);
}

#[test]
fn few_row_matmul_matches_mlx() {
    let _one = serial();
    for (case, (rows, k, n)) in [
        (vec![1], 768, 3072),
        (vec![1, 1], 64, 5),
        (vec![3], 37, 1000),
        (vec![1, 4], 256, 513),
        (vec![2, 3], 130, 2048),
        (vec![8], 96, 40),
    ]
    .into_iter()
    .enumerate()
    {
        let mut xs = rows.clone();
        xs.push(k);
        let x = normal(&xs, case as u64);
        // A weight as a model holds it: evaluated, row-major.
        let w = normal(&[k, n], 50 + case as u64);
        w.eval().unwrap();
        let (ours, theirs, shape, ran) = both(|| x.matmul(&w).unwrap());
        let mut want = rows.clone();
        want.push(n);
        assert_eq!(shape, want);
        assert_close(&ours, &theirs, 1e-4, &format!("matmul {xs:?} x [{k}, {n}]"));
        assert_eq!(ran.matmul, 1, "{xs:?}");
    }
    // A transposed x is read through a copy; nine rows, an unevaluated or transposed weight go
    // to MLX.
    let w = normal(&[24, 33], 9);
    w.eval().unwrap();
    let x = normal(&[24, 2], 10).t().unwrap();
    let (ours, theirs, _, ran) = both(|| x.matmul(&w).unwrap());
    assert_close(&ours, &theirs, 1e-4, "transposed x");
    assert_eq!(ran.matmul, 1);
    let nine = normal(&[9, 24], 11);
    let (_, _, _, ran) = both(|| nine.matmul(&w).unwrap());
    assert_eq!(ran.matmul, 0, "nine rows");
    let wt = normal(&[33, 24], 12).t().unwrap();
    let (_, _, _, ran) = both(|| x.matmul(&wt).unwrap());
    assert_eq!(ran.matmul, 0, "a transposed view");
}

/// A row of x gets the same bits from the few-row product whichever rows it is computed with:
/// one row, two and three (where the widest vectors take over) and eight, so a request's greedy
/// tokens do not depend on the batch beside it.
#[test]
fn few_row_matmul_rows_do_not_depend_on_their_neighbours() {
    let _one = serial();
    let (k, n) = (130, 1000);
    let w = normal(&[k, n], 60);
    w.eval().unwrap();
    let xs = normal(&[8, k], 61).to_vec::<f32>().unwrap();
    let product = |rows: i32| {
        let x = Array::from_slice(&xs[..(rows * k) as usize], &[rows, k]).unwrap();
        let (ours, _, _, ran) = both(|| x.matmul(&w).unwrap());
        assert_eq!(ran.matmul, 1, "{rows} rows");
        ours
    };
    let all = product(8);
    for rows in [1, 2, 3, 5] {
        let y = product(rows);
        assert!(
            y.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits()),
            "the first {rows} rows alone differ from the same rows among eight"
        );
    }
}

/// A weight held as column panels (`fast::pack_panels`, how a model holds float32 weights on the
/// CPU) multiplies as MLX's product with the weight, for one row of x to hundreds (eight at a
/// time over each panel), x of any leading shape or strides.
#[test]
fn panel_matmul_matches_mlx() {
    let _one = serial();
    for (case, (rows, k, n)) in [
        (vec![1], 768, 3072),
        (vec![1, 1], 64, 32),
        (vec![3], 37, 1024),
        (vec![1, 4], 256, 544),
        (vec![2, 3], 130, 2048),
        (vec![8], 96, 64),
        (vec![11], 200, 96),
        (vec![64], 130, 320),
        (vec![2, 50], 300, 3072),
    ]
    .into_iter()
    .enumerate()
    {
        let mut xs = rows.clone();
        xs.push(k);
        let x = normal(&xs, 300 + case as u64);
        // `[out, in]` as a checkpoint holds it.
        let w = normal(&[n, k], 350 + case as u64);
        let panels = fast::pack_panels(&w).unwrap().expect("n is whole panels");
        assert_eq!(panels.shape(), vec![n / 32, k, 32]);
        panels.eval().unwrap();
        let (ours, theirs, shape, ran) = both(|| fast::panel_matmul(&x, &panels).unwrap());
        let want_shape: Vec<i32> = rows.iter().copied().chain([n]).collect();
        assert_eq!(shape, want_shape);
        assert_close(&ours, &theirs, 1e-4, &format!("panels {xs:?} x [{k}, {n}]"));
        assert_eq!(ran.panel_matmul, 1, "{xs:?}");
        // And MLX's product with the weight itself.
        let direct = x.matmul(&w.t().unwrap()).unwrap().to_vec::<f32>().unwrap();
        assert_close(&ours, &direct, 1e-4, &format!("x Wᵀ {xs:?} x [{k}, {n}]"));
        // The panels put back are Wᵀ.
        let back = fast::unpack_panels(&panels).unwrap();
        assert_eq!(
            back.to_vec::<f32>().unwrap(),
            w.t()
                .unwrap()
                .contiguous()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        );
    }
    // A transposed x is read through a copy.
    let w = normal(&[64, 24], 390);
    let panels = fast::pack_panels(&w).unwrap().unwrap();
    let x = normal(&[24, 2], 391).t().unwrap();
    let (ours, theirs, _, ran) = both(|| fast::panel_matmul(&x, &panels).unwrap());
    assert_close(&ours, &theirs, 1e-4, "transposed x");
    assert_eq!(ran.panel_matmul, 1);
    // Only whole panels.
    assert!(fast::pack_panels(&normal(&[40, 24], 392))
        .unwrap()
        .is_none());
}

/// A row of x gets the same bits from the panel product whichever rows share its call (eight
/// at a time, the last group shorter; a decode step's row and a prefill chunk's alike) and
/// whichever kernel width computed it (AVX-512, AVX2 or scalar): a request's greedy tokens do
/// not depend on the batch beside it, nor on the CPU's vector width.
#[test]
fn panel_matmul_rows_do_not_depend_on_their_neighbours_or_the_vector_width() {
    let _one = serial();
    fast::set_fused_kernels(true);
    let (k, n) = (130, 1024);
    let panels = fast::pack_panels(&normal(&[n, k], 400)).unwrap().unwrap();
    panels.eval().unwrap();
    let xs = normal(&[150, k], 401).to_vec::<f32>().unwrap();
    let product = |rows: i32| {
        let x = Array::from_slice(&xs[..(rows * k) as usize], &[rows, k]).unwrap();
        fast::panel_matmul(&x, &panels)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    };
    let all = product(150);
    for width in [512, 256, 0] {
        fast::set_vector_width(width);
        for rows in [1, 2, 3, 5, 8, 9, 17, 63, 150] {
            let y = product(rows);
            assert!(
                y.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{width}-bit kernel: the first {rows} rows differ from the same rows among 150"
            );
        }
    }
    fast::set_vector_width(512);
}

#[test]
fn rms_norm_with_a_residual_matches_mlx() {
    let _one = serial();
    for (case, shape) in [vec![1, 1, 768], vec![3, 5, 17], vec![130, 64]]
        .into_iter()
        .enumerate()
    {
        let d = *shape.last().unwrap();
        let x = normal(&shape, 200 + case as u64);
        let h = normal(&shape, 210 + case as u64);
        let w = normal(&[d], 220 + case as u64);
        let scalar = Array::from_slice(&[0.37f32], &[1]).unwrap();
        for weight in [Some(&w), None] {
            for scale in [None, Some(&scalar)] {
                let what = format!("rms_norm_residual {shape:?} scale {}", scale.is_some());
                let (ours, theirs, got, ran) =
                    both(|| fast::rms_norm_residual(&x, weight, 1e-6, &h, scale).unwrap());
                assert_eq!(got, shape);
                assert_close(&ours, &theirs, 1e-5, &what);
                assert_eq!(ran.rms_norm, 1, "one op: {what}");
                // The unfused kernel, an add and a multiply: the same float32 operations in the
                // same order, so equal, not just close.
                let mut unfused = h.add(&fast::rms_norm(&x, weight, 1e-6).unwrap()).unwrap();
                if let Some(s) = scale {
                    unfused = unfused.multiply(s).unwrap();
                }
                assert!(
                    ours == unfused.to_vec::<f32>().unwrap(),
                    "{what}: not norm + add"
                );
            }
        }
    }
    // A residual of another shape is MLX's broadcasting add after the kernel's norm.
    let x = normal(&[4, 32], 230);
    let row = normal(&[32], 231);
    let (ours, theirs, got, _) =
        both(|| fast::rms_norm_residual(&x, None, 1e-6, &row, None).unwrap());
    assert_eq!(got, vec![4, 32]);
    assert_close(&ours, &theirs, 1e-6, "broadcast residual");
}

#[test]
fn heads_norm_and_rotation_are_the_ops_they_fuse() {
    let _one = serial();
    let wavelengths = Array::from_slice(
        &[1.0f32, 10.0, 1e4, f32::INFINITY, 3.5, 700.0, 2.0, 9.0],
        &[8],
    )
    .unwrap();
    let mut case = 0;
    // (tokens, heads, head dim, rotated dims): a batched decode step of several rows, one row,
    // partial rotation.
    for (t, n, d, dims) in [
        (3, 4, 16, 16),
        (1, 8, 32, 32),
        (2, 2, 24, 16),
        (5, 1, 16, 16),
    ] {
        for traditional in [false, true] {
            for custom in [false, true] {
                if custom && dims / 2 != 8 {
                    continue;
                }
                case += 1;
                let freqs = if custom {
                    RopeFreqs::Custom(&wavelengths)
                } else {
                    RopeFreqs::Base(10000.0)
                };
                let y = normal(&[1, t, n * d], 300 + case);
                let w = normal(&[d], 400 + case);
                let positions: Vec<i32> = (0..t).map(|i| 7 + 113 * i).collect();
                let per_row = Array::from_slice(&positions, &[t]).unwrap();
                let one = Array::from_slice(&[42i32], &[1]).unwrap();
                for offsets in [&per_row, &one] {
                    for weight in [Some(&w), None] {
                        let rotation = Rotation {
                            dims,
                            traditional,
                            freqs,
                            scale: 1.0,
                        };
                        let what = format!(
                            "[1, {t}, {n}x{d}] dims {dims} traditional {traditional} custom \
                             {custom} offsets {} weight {}",
                            offsets.size(),
                            weight.is_some()
                        );
                        for rotate in [Some(rotation), None] {
                            let (ours, theirs, got, ran) = both(|| {
                                fast::heads_norm_rope(&y, n, weight, 1e-6, rotate, offsets).unwrap()
                            });
                            assert_eq!(got, vec![t, n, 1, d], "{what}");
                            assert_close(&ours, &theirs, 2e-5, &what);
                            assert_eq!(ran.heads_norm_rope, 1, "one op: {what}");
                            assert_eq!(ran.rms_norm + ran.rope, 0, "{what}");
                            // The kernels it stands for, one after the other: the same float32
                            // operations in the same order, so equal, not just close.
                            let normed =
                                fast::rms_norm(&y.reshape(&[t, n, 1, d]).unwrap(), weight, 1e-6)
                                    .unwrap();
                            let unfused = match rotate {
                                Some(r) => fast::rope_dynamic(
                                    &normed,
                                    Rotation {
                                        dims: r.dims,
                                        traditional: r.traditional,
                                        freqs: r.freqs,
                                        scale: r.scale,
                                    },
                                    offsets,
                                )
                                .unwrap(),
                                None => normed,
                            };
                            assert!(
                                ours == unfused.to_vec::<f32>().unwrap(),
                                "{what} rotated {}: not norm then rope",
                                rotate.is_some()
                            );
                        }
                    }
                }
            }
        }
    }
    // An odd head width (the norm's tail past whole vectors).
    let y = normal(&[1, 2, 30], 500);
    let offsets = Array::from_slice(&[3i32, 4], &[2]).unwrap();
    let (ours, theirs, got, ran) =
        both(|| fast::heads_norm_rope(&y, 2, None, 1e-6, None, &offsets).unwrap());
    assert_eq!((got, ran.heads_norm_rope), (vec![2, 2, 1, 15], 1));
    assert_close(&ours, &theirs, 2e-5, "odd head width");
    // Heads that do not divide the width: an error, not a crash.
    assert!(fast::heads_norm_rope(&y, 4, None, 1e-6, None, &offsets)
        .and_then(|a| a.eval())
        .is_err());
    // float16 is left to MLX's ops.
    let before = fast::fused_kernel_counts();
    let half = fast::heads_norm_rope(
        &y.astype(Dtype::F16).unwrap(),
        3,
        None,
        1e-6,
        None,
        &offsets,
    )
    .unwrap();
    half.eval().unwrap();
    assert_eq!(
        (half.shape(), half.dtype()),
        (vec![2, 3, 1, 10], Dtype::F16)
    );
    assert_eq!(
        fast::fused_kernel_counts().heads_norm_rope,
        before.heads_norm_rope
    );
}

#[test]
fn a_layers_queries_keys_and_values_are_one_op_with_the_same_bits() {
    let _one = serial();
    let wavelengths = Array::from_slice(&[1.0f32, 10.0, 1e4, f32::INFINITY], &[4]).unwrap();
    let mut case = 0;
    // (tokens, query heads, kv heads, head dim, rotated dims): a batched decode step, one row
    // with one kv head (E2B's shape), partial rotation, k_eq_v (the keys double as values).
    for (t, hq, hk, d, dims, k_eq_v) in [
        (3, 4, 2, 16, 16, false),
        (1, 8, 1, 32, 32, false),
        (2, 2, 2, 24, 16, false),
        (2, 4, 1, 8, 8, true),
    ] {
        for custom in [false, true] {
            if custom && dims / 2 != 4 {
                continue;
            }
            case += 1;
            let freqs = if custom {
                RopeFreqs::Custom(&wavelengths)
            } else {
                RopeFreqs::Base(10000.0)
            };
            let rotation = Rotation {
                dims,
                traditional: false,
                freqs,
                scale: 1.0,
            };
            let q = normal(&[1, t, hq * d], 600 + case);
            let k = normal(&[1, t, hk * d], 700 + case);
            let v = if k_eq_v {
                k.clone()
            } else {
                normal(&[1, t, hk * d], 800 + case)
            };
            let (wq, wk) = (normal(&[d], 900 + case), normal(&[d], 1000 + case));
            let positions: Vec<i32> = (0..t).map(|i| 5 + 301 * i).collect();
            let per_row = Array::from_slice(&positions, &[t]).unwrap();
            let one = Array::from_slice(&[9i32], &[1]).unwrap();
            for offsets in [&per_row, &one] {
                let what = format!(
                    "t {t} heads {hq}/{hk} d {d} dims {dims} custom {custom} k_eq_v {k_eq_v} \
                     offsets {}",
                    offsets.size()
                );
                let norms = QkvNorms {
                    q_heads: hq,
                    kv_heads: hk,
                    q_norm: &wq,
                    k_norm: &wk,
                    eps: 1e-6,
                };
                let before = fast::fused_kernel_counts();
                let (qo, ko, vo) = fast::qkv_heads(&q, &k, &v, norms, rotation, offsets).unwrap();
                mlx::eval(&[&qo, &ko, &vo]).unwrap();
                let ran = fast::fused_kernel_counts().heads_norm_rope - before.heads_norm_rope;
                assert_eq!(ran, 1, "one op: {what}");
                let shapes = [qo.shape(), ko.shape(), vo.shape()];
                assert_eq!(
                    shapes,
                    [vec![t, hq, 1, d], vec![t, hk, 1, d], vec![t, hk, 1, d]],
                    "{what}"
                );
                // Each part is the one-part kernel's bits.
                let parts = [
                    (&q, &qo, hq, Some(&wq), Some(rotation)),
                    (&k, &ko, hk, Some(&wk), Some(rotation)),
                    (&v, &vo, hk, None, None),
                ];
                for (i, (y, got, n, w, r)) in parts.into_iter().enumerate() {
                    let alone = fast::heads_norm_rope(y, n, w, 1e-6, r, offsets).unwrap();
                    assert!(
                        got.to_vec::<f32>().unwrap() == alone.to_vec::<f32>().unwrap(),
                        "{what}: part {i} differs from its own op"
                    );
                }
                // And MLX's own graphs for the same call agree within float tolerance.
                fast::set_fused_kernels(false);
                let (mq, mk, mv) = fast::qkv_heads(&q, &k, &v, norms, rotation, offsets).unwrap();
                mlx::eval(&[&mq, &mk, &mv]).unwrap();
                fast::set_fused_kernels(true);
                for (ours, theirs) in [(&qo, &mq), (&ko, &mk), (&vo, &mv)] {
                    assert_close(
                        &ours.to_vec::<f32>().unwrap(),
                        &theirs.to_vec::<f32>().unwrap(),
                        2e-5,
                        &what,
                    );
                }
            }
        }
    }
    // A head width that differs between the queries and the keys: an error, not a crash.
    let q = normal(&[1, 1, 4 * 16], 1);
    let k = normal(&[1, 1, 2 * 8], 2);
    let w16 = normal(&[16], 3);
    let one = Array::from_slice(&[0i32], &[1]).unwrap();
    let rotation = Rotation {
        dims: 16,
        traditional: false,
        freqs: RopeFreqs::Base(10000.0),
        scale: 1.0,
    };
    let r = fast::qkv_heads(
        &q,
        &k,
        &k,
        QkvNorms {
            q_heads: 4,
            kv_heads: 2,
            q_norm: &w16,
            k_norm: &w16,
            eps: 1e-6,
        },
        rotation,
        &one,
    )
    .and_then(|(a, b, c)| mlx::eval(&[&a, &b, &c]));
    assert!(
        r.is_err(),
        "a key width that is not kv_heads x d is an error"
    );
}

#[test]
fn a_residual_update_and_the_next_norm_are_one_op() {
    let _one = serial();
    for (case, shape) in [vec![1, 1, 768], vec![3, 5, 17], vec![130, 64]]
        .into_iter()
        .enumerate()
    {
        let d = *shape.last().unwrap();
        let x = normal(&shape, 600 + case as u64);
        let h = normal(&shape, 610 + case as u64);
        let w = normal(&[d], 620 + case as u64);
        let next = normal(&[d], 630 + case as u64);
        let scalar = Array::from_slice(&[0.37f32], &[1]).unwrap();
        for weight in [Some(&w), None] {
            for scale in [None, Some(&scalar)] {
                let what = format!(
                    "{shape:?} weight {} scale {}",
                    weight.is_some(),
                    scale.is_some()
                );
                let pair =
                    || fast::rms_norm_residual_norm(&x, weight, 1e-6, &h, scale, &next).unwrap();
                let before = fast::fused_kernel_counts();
                let (sum, normed) = pair();
                mlx::eval(&[&sum, &normed]).unwrap();
                assert_eq!(
                    fast::fused_kernel_counts().rms_norm - before.rms_norm,
                    1,
                    "one op: {what}"
                );
                assert_eq!(
                    (sum.shape(), normed.shape()),
                    (shape.clone(), shape.clone())
                );
                // The two kernels it stands for: the same float32 operations, so equal.
                let alone = fast::rms_norm_residual(&x, weight, 1e-6, &h, scale).unwrap();
                let renormed = fast::rms_norm(&alone, Some(&next), 1e-6).unwrap();
                assert!(
                    sum.to_vec::<f32>().unwrap() == alone.to_vec::<f32>().unwrap(),
                    "{what}: the sum"
                );
                assert!(
                    normed.to_vec::<f32>().unwrap() == renormed.to_vec::<f32>().unwrap(),
                    "{what}: its norm"
                );
                // And MLX's ops, with the kernels off.
                fast::set_fused_kernels(false);
                let (mlx_sum, mlx_normed) = pair();
                fast::set_fused_kernels(true);
                let got = sum.to_vec::<f32>().unwrap();
                assert_close(&got, &mlx_sum.to_vec::<f32>().unwrap(), 1e-5, &what);
                let got = normed.to_vec::<f32>().unwrap();
                assert_close(&got, &mlx_normed.to_vec::<f32>().unwrap(), 1e-5, &what);
            }
        }
    }
    // A next weight of the wrong width: MLX's broadcasting rules decide (an error here).
    let x = normal(&[2, 16], 640);
    let bad = normal(&[8], 641);
    let r = fast::rms_norm_residual_norm(&x, None, 1e-6, &x, None, &bad)
        .and_then(|(a, b)| mlx::eval(&[&a, &b]));
    assert!(r.is_err());
}

#[test]
fn arrays_of_more_dimensions_than_a_view_holds_are_left_to_mlx() {
    let _one = serial();
    let x = normal(&[1, 1, 1, 1, 1, 1, 1, 2, 16], 700);
    let w = normal(&[16], 701);
    let (ours, theirs, got, ran) = both(|| fast::rms_norm(&x, Some(&w), 1e-6).unwrap());
    assert_eq!((got, ran.rms_norm), (x.shape(), 0));
    assert_close(&ours, &theirs, 1e-6, "rms_norm of 9 dimensions");
    let (ours, theirs, _, ran) = both(|| fast::gelu_tanh(&x).unwrap());
    assert_eq!(ran.gelu_tanh, 0);
    assert_close(&ours, &theirs, 1e-6, "gelu of 9 dimensions");
}

#[test]
fn softmax_matches_mlx() {
    let _one = serial();
    // Rows of attention-score-like values of lengths around the vector width, one with a huge
    // spread (most weights underflow to 0), a transposed batch read through a copy.
    for (shape, scale, seed) in [
        (vec![3, 5], 1.0, 1),
        (vec![2, 7, 8], 4.0, 2),
        (vec![4, 2394], 8.0, 3),
        (vec![1, 12, 17, 33], 200.0, 4),
    ] {
        let x = normal(&shape, seed).multiply_scalar(scale).unwrap();
        let (ours, theirs, got, ran) = both(|| fast::softmax(&x).unwrap());
        assert_eq!(got, shape);
        // Probabilities in [0, 1]: a few float32 ulps of 1 (the sum of a row is in another order).
        assert_close(
            &ours,
            &theirs,
            4e-6,
            &format!("softmax {shape:?} x {scale}"),
        );
        assert_eq!(ran.softmax, 1);
    }
    let x = normal(&[40, 6], 5).t().unwrap();
    let (ours, theirs, _, ran) = both(|| fast::softmax(&x).unwrap());
    assert_close(&ours, &theirs, 1e-6, "transposed softmax");
    assert_eq!(ran.softmax, 1);
}

#[test]
fn softcap_matches_mlx() {
    let _one = serial();
    // Logit-like values, plus the far tails where tanh is ±1 in float32.
    let mut v: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) * 0.037).collect();
    v.extend([0.0, -0.0, 1e-7, -3e-5, 1e4, -1e4, 600.0, -600.0]);
    let x = Array::from_slice(&v, &[v.len() as i32]).unwrap();
    for cap in [30.0f32, 15.0, 1.0] {
        let (ours, theirs, got, ran) = both(|| fast::softcap(&x, cap).unwrap());
        assert_eq!(got, vec![v.len() as i32]);
        assert_close(&ours, &theirs, 1e-6, &format!("softcap {cap}"));
        assert_eq!(ran.softcap, 1);
        assert!(ours.iter().all(|y| y.abs() <= cap), "within ±cap");
    }
    // A batch of rows, transposed: read through a copy.
    let x = normal(&[64, 3], 240)
        .multiply_scalar(20.0)
        .unwrap()
        .t()
        .unwrap();
    let (ours, theirs, _, ran) = both(|| fast::softcap(&x, 30.0).unwrap());
    assert_close(&ours, &theirs, 1e-6, "transposed softcap");
    assert_eq!(ran.softcap, 1);
}

#[test]
fn sigmoid_mul_matches_mlx() {
    let _one = serial();
    for (case, shape) in [vec![1, 1, 3072], vec![2, 3, 4, 1, 37], vec![5000]]
        .into_iter()
        .enumerate()
    {
        let g = normal(&shape, 280 + case as u64)
            .multiply_scalar(4.0)
            .unwrap();
        let u = normal(&shape, 290 + case as u64);
        let (ours, theirs, got, ran) = both(|| fast::sigmoid_mul(&g, &u).unwrap());
        assert_eq!(got, shape);
        assert_close(&ours, &theirs, 1e-6, &format!("sigmoid_mul {shape:?}"));
        assert_eq!(ran.silu_mul, 1);
    }
    // The tails: σ(g) → 0 for very negative g, → 1 for large g.
    let g = Array::from_slice(&[-1e4f32, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4], &[7]).unwrap();
    let u = Array::from_slice(&[2.0f32; 7], &[7]).unwrap();
    let (ours, theirs, _, _) = both(|| fast::sigmoid_mul(&g, &u).unwrap());
    assert_close(&ours, &theirs, 1e-6, "sigmoid_mul tails");
    // Views (a GLU's halves) are read through their strides.
    let x = normal(&[6, 74], 300);
    let halves = x.split(2, 1).unwrap();
    let (ours, theirs, _, ran) = both(|| fast::sigmoid_mul(&halves[1], &halves[0]).unwrap());
    assert_close(&ours, &theirs, 1e-6, "halves");
    assert_eq!(ran.silu_mul, 1);
}

#[test]
fn silu_mul_matches_mlx() {
    let _one = serial();
    for (case, shape) in [vec![1, 1, 3072], vec![2, 3, 4, 1, 37], vec![5000]]
        .into_iter()
        .enumerate()
    {
        let g = normal(&shape, 250 + case as u64)
            .multiply_scalar(4.0)
            .unwrap();
        let u = normal(&shape, 260 + case as u64);
        let (ours, theirs, got, ran) = both(|| fast::silu_mul(&g, &u).unwrap());
        assert_eq!(got, shape);
        assert_close(&ours, &theirs, 1e-6, &format!("silu_mul {shape:?}"));
        assert_eq!(ran.silu_mul, 1);
    }
    // The tails: silu(g) → 0 for very negative g, → g for large g.
    let g = Array::from_slice(&[-1e4f32, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4], &[7]).unwrap();
    let u = Array::from_slice(&[2.0f32; 7], &[7]).unwrap();
    let (ours, theirs, _, _) = both(|| fast::silu_mul(&g, &u).unwrap());
    assert_close(&ours, &theirs, 1e-6, "silu_mul tails");
    // Shapes that differ are MLX's broadcasting graph.
    let row = normal(&[37], 270);
    let g = normal(&[4, 37], 271);
    let (ours, theirs, got, ran) = both(|| fast::silu_mul(&g, &row).unwrap());
    assert_eq!(got, vec![4, 37]);
    assert_close(&ours, &theirs, 1e-6, "broadcast");
    assert_eq!(ran.silu_mul, 0);
}
