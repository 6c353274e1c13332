//! mlx-runner's CPU kernel for affine-quantized matmuls (crates/mlx-sys/src/qmm_cpu.cc) against
//! MLX's own `quantized_matmul` and against the dense product with the dequantized matrix: every
//! supported bit width and group size, odd row counts on both sides of the kernel's
//! sgemm threshold, odd output widths, non-contiguous inputs.

use mlx::{random, Array, Dtype};

thread_local! {
    static KERNEL_RUNS: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn scale_of(a: &Array) -> f32 {
    a.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.abs())
        .fold(0.0, f32::max)
        .max(1.0)
}

/// (ours, MLX's, dense) for x [rows.., k] and w [n, k].
fn products(x: &Array, w: &Array, group: i32, bits: i32) -> (Array, Array, Array) {
    let q = w.quantize(group, bits).unwrap();
    mlx::set_quantized_kernel(true);
    let ours = x.quantized_matmul(&q, true).unwrap();
    ours.eval().unwrap();
    KERNEL_RUNS.with(|c| c.set(mlx::quantized_kernel_counts()));
    mlx::set_quantized_kernel(false);
    let theirs = x.quantized_matmul(&q, true).unwrap();
    theirs.eval().unwrap();
    mlx::set_quantized_kernel(true);
    let dense = x.matmul(&q.dequantize().unwrap().t().unwrap()).unwrap();
    dense.eval().unwrap();
    (ours, theirs, dense)
}

#[test]
fn the_kernel_matches_mlx_on_every_supported_shape() {
    let mut case = 0u64;
    let before = mlx::quantized_kernel_counts();
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            for (rows, n, k) in [
                (1, 5, 256),
                (1, 33, 512),
                (3, 17, 768),
                (4, 64, 384),
                (7, 31, 256),
                (16, 40, 512),
                (37, 19, 1024),
            ] {
                if k % group != 0 {
                    continue;
                }
                let x = random::normal(
                    &[rows, k],
                    Dtype::F32,
                    0.0,
                    1.0,
                    Some(&random::key(case).unwrap()),
                )
                .unwrap();
                let w = random::normal(
                    &[n, k],
                    Dtype::F32,
                    0.0,
                    0.05,
                    Some(&random::key(case + 1).unwrap()),
                )
                .unwrap();
                case += 2;
                let (ours, theirs, dense) = products(&x, &w, group, bits);
                assert_eq!(ours.shape(), vec![rows, n]);
                let tol = 2e-5 * scale_of(&dense) * (k as f32).sqrt();
                let d = max_diff(&ours, &theirs);
                assert!(
                    d <= tol,
                    "bits {bits} group {group} {rows}x{k} @ {n}: |ours - mlx| = {d} > {tol}"
                );
                let d = max_diff(&ours, &dense);
                assert!(
                    d <= tol,
                    "bits {bits} group {group} {rows}x{k} @ {n}: |ours - dense| = {d} > {tol}"
                );
            }
        }
    }
    // Both of the kernel's paths answered (the counts are per process; tests run in threads,
    // so only growth is checked).
    let after = KERNEL_RUNS.with(|c| c.get());
    assert!(after.0 > before.0, "the packed-rows path never ran");
    assert!(after.1 > before.1, "the sgemm path never ran");
}

#[test]
fn batched_and_strided_inputs_go_through_the_kernel_too() {
    let x = random::normal(
        &[2, 3, 256],
        Dtype::F32,
        0.0,
        1.0,
        Some(&random::key(1).unwrap()),
    )
    .unwrap();
    // A transposed view: not row-contiguous.
    let xt = random::normal(
        &[256, 5],
        Dtype::F32,
        0.0,
        1.0,
        Some(&random::key(2).unwrap()),
    )
    .unwrap()
    .t()
    .unwrap();
    let w = random::normal(
        &[24, 256],
        Dtype::F32,
        0.0,
        0.1,
        Some(&random::key(3).unwrap()),
    )
    .unwrap();
    for input in [&x, &xt] {
        let (ours, theirs, _) = products(input, &w, 64, 4);
        let mut shape = input.shape();
        *shape.last_mut().unwrap() = 24;
        assert_eq!(ours.shape(), shape);
        assert!(max_diff(&ours, &theirs) < 1e-3);
    }
}

#[test]
fn shapes_it_does_not_cover_fall_back_to_mlx() {
    // 2-bit, and a k that is not a whole number of packed units: MLX's path, same answer.
    let x = random::normal(
        &[2, 96],
        Dtype::F32,
        0.0,
        1.0,
        Some(&random::key(4).unwrap()),
    )
    .unwrap();
    let w = random::normal(
        &[8, 96],
        Dtype::F32,
        0.0,
        0.1,
        Some(&random::key(5).unwrap()),
    )
    .unwrap();
    for (group, bits) in [(32, 2), (32, 4)] {
        let (ours, theirs, _) = products(&x, &w, group, bits);
        assert!(max_diff(&ours, &theirs) < 1e-5);
    }
}
