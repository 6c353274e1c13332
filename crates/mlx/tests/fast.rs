//! The fused kernels against straightforward f64 implementations written here.

mod common;
use common::*;
use mlx::fast::{rms_norm, rope, scaled_dot_product_attention, RopeFreqs, Rotation, SdpaMask};
use mlx::Array;

#[test]
fn rms_norm_matches_definition() {
    let (rows, d) = (3, 8);
    let x = pseudo_random(rows * d, 3);
    let w = pseudo_random(d, 4);
    let eps = 1e-6;
    let got = f32s(
        &rms_norm(
            &arr(&x, &[rows as i32, d as i32]),
            Some(&arr(&w, &[d as i32])),
            eps,
        )
        .unwrap(),
    );
    let got_noscale = f32s(&rms_norm(&arr(&x, &[rows as i32, d as i32]), None, eps).unwrap());
    let mut want = Vec::new();
    let mut want_noscale = Vec::new();
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms: f64 = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        for j in 0..d {
            want.push(f64::from(row[j]) * inv * f64::from(w[j]));
            want_noscale.push(f64::from(row[j]) * inv);
        }
    }
    assert_close(&got, &want, 1e-5);
    assert_close(&got_noscale, &want_noscale, 1e-5);
}

/// Rotate-half (`traditional = false`) or adjacent-pair RoPE of `x: [L, D]` at positions
/// `offset..offset+L`, with the angle of pair j equal to `pos * inv_freq[j]`.
fn rope_ref(
    x: &[f32],
    l: usize,
    d: usize,
    offset: usize,
    inv_freq: &[f64],
    traditional: bool,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for p in 0..l {
        let pos = (offset + p) as f64;
        for (j, &f) in inv_freq.iter().enumerate() {
            let (a, b) = if traditional {
                (2 * j, 2 * j + 1)
            } else {
                (j, j + d / 2)
            };
            let (xa, xb) = (f64::from(x[p * d + a]), f64::from(x[p * d + b]));
            let (s, c) = (pos * f).sin_cos();
            out[p * d + a] = xa * c - xb * s;
            out[p * d + b] = xb * c + xa * s;
        }
    }
    out
}

#[test]
fn rope_matches_definition() {
    let (l, d) = (5, 8);
    let x = pseudo_random(l * d, 5);
    let xa = arr(&x, &[1, 1, l as i32, d as i32]);
    let base = 10000.0f64;
    let inv: Vec<f64> = (0..d / 2)
        .map(|j| base.powf(-2.0 * j as f64 / d as f64))
        .collect();
    for traditional in [false, true] {
        let got = f32s(
            &rope(
                &xa,
                Rotation {
                    dims: d as i32,
                    traditional,
                    freqs: RopeFreqs::Base(base as f32),
                    scale: 1.0,
                },
                3,
            )
            .unwrap(),
        );
        assert_close(&got, &rope_ref(&x, l, d, 3, &inv, traditional), 1e-4);
    }
    // Custom wavelengths, with an infinite one leaving its pair unrotated (gemma4's
    // proportional RoPE does this).
    let wl = [1.0f32, 7.0, 50.0, f32::INFINITY];
    let inv: Vec<f64> = wl.iter().map(|&w| 1.0 / f64::from(w)).collect();
    let got = f32s(
        &rope(
            &xa,
            Rotation {
                dims: d as i32,
                traditional: false,
                freqs: RopeFreqs::Custom(&arr(&wl, &[4])),
                scale: 1.0,
            },
            2,
        )
        .unwrap(),
    );
    assert_close(&got, &rope_ref(&x, l, d, 2, &inv, false), 1e-4);
    // A dynamic offset equals the static one.
    let off = Array::scalar(2i32).unwrap();
    let dyn_ = f32s(
        &mlx::fast::rope_dynamic(
            &xa,
            Rotation {
                dims: d as i32,
                traditional: false,
                freqs: RopeFreqs::Custom(&arr(&wl, &[4])),
                scale: 1.0,
            },
            &off,
        )
        .unwrap(),
    );
    assert_eq!(dyn_, got);
}

/// softmax(q kᵀ · scale + mask) v for one batch, with GQA.
#[allow(clippy::too_many_arguments)]
fn sdpa_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    hq: usize,
    hk: usize,
    lq: usize,
    lk: usize,
    d: usize,
    scale: f64,
    allowed: &dyn Fn(usize, usize) -> bool,
) -> Vec<f64> {
    let mut out = vec![0.0; hq * lq * d];
    for h in 0..hq {
        let kh = h / (hq / hk);
        for i in 0..lq {
            let scores: Vec<f64> = (0..lk)
                .map(|j| {
                    if !allowed(i, j) {
                        return f64::NEG_INFINITY;
                    }
                    (0..d)
                        .map(|t| {
                            f64::from(q[(h * lq + i) * d + t]) * f64::from(k[(kh * lk + j) * d + t])
                        })
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for t in 0..d {
                out[(h * lq + i) * d + t] = (0..lk)
                    .map(|j| e[j] / z * f64::from(v[(kh * lk + j) * d + t]))
                    .sum();
            }
        }
    }
    out
}

#[test]
fn sdpa_matches_definition() {
    let (hq, hk, lq, lk, d) = (4, 2, 3, 5, 8);
    let q = pseudo_random(hq * lq * d, 6);
    let k = pseudo_random(hk * lk * d, 7);
    let v = pseudo_random(hk * lk * d, 8);
    let qa = arr(&q, &[1, hq as i32, lq as i32, d as i32]);
    let ka = arr(&k, &[1, hk as i32, lk as i32, d as i32]);
    let va = arr(&v, &[1, hk as i32, lk as i32, d as i32]);
    let scale = 0.35;

    let got =
        f32s(&scaled_dot_product_attention(&qa, &ka, &va, scale, SdpaMask::None, None).unwrap());
    let want = sdpa_ref(&q, &k, &v, hq, hk, lq, lk, d, scale as f64, &|_, _| true);
    assert_close(&got, &want, 1e-5);

    // Causal is aligned to the lower right: query i sits at position lk - lq + i.
    let got =
        f32s(&scaled_dot_product_attention(&qa, &ka, &va, scale, SdpaMask::Causal, None).unwrap());
    let want = sdpa_ref(&q, &k, &v, hq, hk, lq, lk, d, scale as f64, &|i, j| {
        j <= lk - lq + i
    });
    assert_close(&got, &want, 1e-5);

    // An explicit boolean mask: a sliding window of 2 keys.
    let allowed = |i: usize, j: usize| j <= lk - lq + i && lk - lq + i - j < 2;
    let mask: Vec<bool> = (0..lq)
        .flat_map(|i| (0..lk).map(move |j| allowed(i, j)))
        .collect();
    let m = Array::from_slice(&mask, &[lq as i32, lk as i32]).unwrap();
    let got = f32s(
        &scaled_dot_product_attention(&qa, &ka, &va, scale, SdpaMask::Array(&m), None).unwrap(),
    );
    let want = sdpa_ref(&q, &k, &v, hq, hk, lq, lk, d, scale as f64, &allowed);
    assert_close(&got, &want, 1e-5);

    // The same window as an additive float mask.
    let add: Vec<f32> = mask
        .iter()
        .map(|&ok| if ok { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    let m = arr(&add, &[lq as i32, lk as i32]);
    let got = f32s(
        &scaled_dot_product_attention(&qa, &ka, &va, scale, SdpaMask::Array(&m), None).unwrap(),
    );
    assert_close(&got, &want, 1e-5);
}
