#![allow(dead_code)]

use mlx::{Array, Dtype};

pub fn arr(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

pub fn iarr(data: &[i32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

/// Reads any numeric array back as f32.
pub fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap()
}

pub fn i32s(a: &Array) -> Vec<i32> {
    a.astype(Dtype::I32).unwrap().to_vec::<i32>().unwrap()
}

pub fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "length: got {got:?}, want {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (f64::from(g) - w).abs() <= tol || (g.is_infinite() && f64::from(g) == w);
        assert!(
            ok,
            "element {i}: got {g}, want {w} (tol {tol})\n got {got:?}\nwant {want:?}"
        );
    }
}

/// A deterministic pseudo-random vector in [-1, 1) (xorshift), for tests that compare two
/// computations of the same thing.
pub fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}
