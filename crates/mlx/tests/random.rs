//! Random numbers from explicit keys: reproducible, independent, and distributed as asked.

mod common;
use common::*;
use mlx::{random, Array, Dtype};

#[test]
fn keys_make_draws_reproducible() {
    let k = random::key(7).unwrap();
    let a = f32s(&random::uniform(&[16], Dtype::F32, 0.0, 1.0, Some(&k)).unwrap());
    let b = f32s(
        &random::uniform(&[16], Dtype::F32, 0.0, 1.0, Some(&random::key(7).unwrap())).unwrap(),
    );
    assert_eq!(a, b);
    let c = f32s(
        &random::uniform(&[16], Dtype::F32, 0.0, 1.0, Some(&random::key(8).unwrap())).unwrap(),
    );
    assert_ne!(a, c);
    assert!(a.iter().all(|&v| (0.0..1.0).contains(&v)));

    let keys = random::split(&k, 3).unwrap();
    assert_eq!(keys.shape(), vec![3, 2]);
    let k0 = keys.index(&mlx::ix![0]).unwrap();
    let k1 = keys.index(&mlx::ix![1]).unwrap();
    let d0 = f32s(&random::normal(&[8], Dtype::F32, 0.0, 1.0, Some(&k0)).unwrap());
    let d1 = f32s(&random::normal(&[8], Dtype::F32, 0.0, 1.0, Some(&k1)).unwrap());
    assert_ne!(d0, d1);
}

#[test]
fn distributions_have_the_right_moments() {
    let k = random::key(1).unwrap();
    let n = 20000;
    let x = random::normal(&[n], Dtype::F32, 2.0, 3.0, Some(&k)).unwrap();
    let mean = x.mean_all(false).unwrap().item::<f32>().unwrap();
    let var = x
        .add_scalar(-2.0)
        .unwrap()
        .square()
        .unwrap()
        .mean_all(false)
        .unwrap()
        .item::<f32>()
        .unwrap();
    // Standard errors: 3/sqrt(20000) ≈ 0.021 for the mean; ≈ 0.09 for the variance.
    assert!((mean - 2.0).abs() < 0.1, "mean {mean}");
    assert!((var - 9.0).abs() < 0.5, "var {var}");

    let r = i32s(&random::randint(&[1000], Dtype::I32, -3, 4, Some(&k)).unwrap());
    assert!(r.iter().all(|&v| (-3..4).contains(&v)));
    assert!((-3..4).all(|v| r.contains(&v)));

    let p = arr(&[0.0, 1.0, 0.5], &[3]);
    let b = random::bernoulli(&p, Some(&[4000, 3]), Some(&k)).unwrap();
    let freq = f32s(&b.astype(Dtype::F32).unwrap().mean(&[0], false).unwrap());
    assert_eq!(freq[0], 0.0);
    assert_eq!(freq[1], 1.0);
    assert!((freq[2] - 0.5).abs() < 0.05, "{freq:?}");

    let g = random::gumbel(&[10000], Dtype::F32, Some(&k)).unwrap();
    // The Gumbel mean is the Euler–Mascheroni constant 0.5772.
    let gm = g.mean_all(false).unwrap().item::<f32>().unwrap();
    assert!((gm - 0.5772).abs() < 0.05, "{gm}");
}

#[test]
fn categorical_follows_the_logits() {
    let k = random::key(3).unwrap();
    // Only index 2 is possible.
    let logits = arr(
        &[f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY],
        &[1, 4],
    );
    let s = random::categorical(&logits, -1, Some(50), Some(&k)).unwrap();
    assert_eq!(s.shape(), vec![1, 50]);
    assert!(i32s(&s).iter().all(|&v| v == 2));
    // p = [0.2, 0.8]
    let logits = arr(&[0.2f32.ln(), 0.8f32.ln()], &[2]);
    let s = random::categorical(&logits, 0, Some(10000), Some(&k)).unwrap();
    let ones = i32s(&s).iter().filter(|&&v| v == 1).count() as f64 / 10000.0;
    assert!((ones - 0.8).abs() < 0.02, "{ones}");
    let one = random::categorical(&arr(&[0.0, 0.0], &[1, 2]), -1, None, Some(&k)).unwrap();
    assert_eq!(one.shape(), vec![1]);
    let _ = Array::scalar(0i32).unwrap();
}
