//! mlx-runner's CPU kernel for affine-quantized matmuls (crates/mlx-sys/src/qmm_cpu.cc) against
//! MLX's own `quantized_matmul` and against the dense product with the dequantized matrix: every
//! supported bit width and group size, odd row counts on both sides of the kernel's
//! sgemm threshold, odd output widths, non-contiguous inputs.

use mlx::{random, Array, Dtype};

thread_local! {
    static KERNEL_RUNS: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// The kernel's counters are per process: the tests take turns so each sees its own.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `(mode, bits, group)`: the affine formats given, then each of MLX's microscaling modes.
fn with_modes(affine: &[(i32, i32)]) -> Vec<(mlx::QuantMode, i32, i32)> {
    use mlx::QuantMode;
    affine
        .iter()
        .map(|&(bits, group)| (QuantMode::Affine, bits, group))
        .chain([
            (QuantMode::Mxfp4, 4, 32),
            (QuantMode::Nvfp4, 4, 16),
            (QuantMode::Mxfp8, 8, 32),
        ])
        .collect()
}

/// An affine table's biases (every table these tests build is affine).
fn b(q: &mlx::Quantized) -> &Array {
    q.biases.as_ref().expect("affine quantization has biases")
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
    // MLX's own dequantization, not the kernel's.
    let dense = x.matmul(&q.dequantize().unwrap().t().unwrap()).unwrap();
    dense.eval().unwrap();
    mlx::set_quantized_kernel(true);
    (ours, theirs, dense)
}

#[test]
fn the_kernel_matches_mlx_on_every_supported_shape() {
    let _one = serial();
    let mut case = 0u64;
    let before = mlx::quantized_kernel_counts();
    for bits in [2, 3, 4, 5, 6, 8] {
        let width_before = mlx::quantized_kernel_counts();
        for group in [32, 64, 128] {
            for (rows, n, k) in [
                (1, 5, 256),
                (1, 33, 512),
                (3, 17, 768),
                (4, 64, 384),
                (7, 31, 256),
                (16, 40, 512),
                (37, 19, 1024),
                // An odd number of 8-word units (3 and 5 at 4 bits, 3 at 8 bits): the 16-lane
                // kernel takes units in pairs, so these rows take the 8-lane one.
                (2, 9, 192),
                (3, 11, 320),
                (1, 7, 96),
                // Inputs past the sgemm path's K tile: tiles accumulate.
                (20, 24, 4608),
                // Rows of x too long to stay in L1 together: the 16-lane kernel takes the
                // output rows once for each span of the input and carries their sums.
                (4, 21, 3072),
                (3, 13, 2048),
                (6, 9, 3072),
            ] {
                if k % group != 0 {
                    continue;
                }
                let x = normal(&[rows, k], 1.0, case);
                let w = normal(&[n, k], 0.05, case + 1);
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
        // Every width has both of the kernel's paths.
        let width_after = KERNEL_RUNS.with(|c| c.get());
        assert!(
            width_after.0 > width_before.0,
            "{bits}-bit: packed rows never ran"
        );
        assert!(
            width_after.1 > width_before.1,
            "{bits}-bit: sgemm path never ran"
        );
    }
    // Both of the kernel's paths answered.
    let after = KERNEL_RUNS.with(|c| c.get());
    assert!(after.0 > before.0, "the packed-rows path never ran");
    assert!(after.1 > before.1, "the sgemm path never ran");
}

/// Rows [from, to) of a quantized matrix: its words, scales and biases alike.
fn rows_of(q: &mlx::Quantized, from: i32, to: i32) -> mlx::Quantized {
    let rows = |a: &Array| a.slice_axis(0, from, Some(to)).unwrap();
    mlx::Quantized {
        weight: rows(&q.weight),
        scales: rows(&q.scales),
        biases: q.biases.as_ref().map(rows),
        ..q.clone()
    }
}

/// An output row is the same bits whichever rows it is computed with: one row of x takes the
/// matrix's rows in pairs from the two halves of each chunk, so a row's partner (or none) moves
/// with the matrix's height; a decode step must not change with it.
#[test]
fn an_output_row_does_not_depend_on_its_neighbours() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    for bits in [2, 3, 4, 5, 6, 8] {
        let x = random::normal(
            &[1, 256],
            Dtype::F32,
            0.0,
            1.0,
            Some(&random::key(31).unwrap()),
        )
        .unwrap();
        let w = random::normal(
            &[301, 256],
            Dtype::F32,
            0.0,
            1.0,
            Some(&random::key(32).unwrap()),
        )
        .unwrap();
        let q = w.quantize(64, bits).unwrap();
        let all = x
            .quantized_matmul(&q, true)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for (from, to) in [(0, 1), (37, 90), (100, 301), (5, 6)] {
            let part = rows_of(&q, from, to);
            let some = x
                .quantized_matmul(&part, true)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            assert_eq!(
                some,
                all[from as usize..to as usize],
                "{bits}-bit rows {from}..{to}"
            );
        }
    }
}

/// A row of x gives the same bits whichever rows of x are computed beside it, at input lengths
/// the kernel takes whole and in spans (rows of 3072 values: one row whole, four in spans):
/// a decode row's result does not depend on the batch it is in.
#[test]
fn a_row_of_x_does_not_depend_on_the_rows_beside_it() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    for (seed, bits) in (70u64..).step_by(2).zip([2, 3, 4, 5, 6, 8]) {
        for k in [768, 2048, 3072] {
            let x = normal(&[8, k], 1.0, seed);
            let q = normal(&[37, k], 0.05, seed + 1).quantize(64, bits).unwrap();
            let all = x
                .quantized_matmul(&q, true)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            for (from, to) in [(0, 1), (3, 4), (1, 3), (4, 8), (0, 4), (5, 8)] {
                let some = x
                    .slice_axis(0, from, Some(to))
                    .unwrap()
                    .quantized_matmul(&q, true)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                assert_eq!(
                    some,
                    all[from as usize * 37..to as usize * 37],
                    "{bits}-bit, K {k}: rows {from}..{to} of x"
                );
            }
        }
    }
}

/// The microscaling kernels too: an output row is the same bits whichever slice of the matrix
/// and whichever rows of x it is computed with, on rows of whole 128-value blocks (FP4 in lane
/// order with AVX-512) and of other lengths (word order), E8M0 scale 0 included.
#[test]
fn a_microscaling_output_row_does_not_depend_on_its_neighbours() {
    use mlx::QuantMode;
    let _one = serial();
    mlx::set_quantized_kernel(true);
    for (seed, (mode, group, bits)) in (50u64..).zip([
        (QuantMode::Mxfp4, 32, 4),
        (QuantMode::Nvfp4, 16, 4),
        (QuantMode::Mxfp8, 32, 8),
    ]) {
        for k in [384, 128, 96, 64, 32] {
            let x = normal(&[7, k], 1.0, seed);
            let w = normal(&[301, k], 0.05, seed + 1)
                .multiply(&normal(&[301, 1], 2.0, seed + 2).exp().unwrap())
                .unwrap();
            let mut q = w.quantize_as(mode, group, bits).unwrap();
            if mode == QuantMode::Mxfp4 {
                // A group at the smallest E8M0 scale, 2^-127 (a subnormal).
                let mut sc = q.scales.to_vec::<u8>().unwrap();
                sc[5] = 0;
                q.scales = Array::from_slice(&sc, &q.scales.shape()).unwrap();
            }
            let ours = x.quantized_matmul(&q, true).unwrap();
            mlx::set_quantized_kernel(false);
            let theirs = x
                .quantized_matmul(&q, true)
                .unwrap()
                .astype(Dtype::F32)
                .unwrap();
            theirs.eval().unwrap();
            mlx::set_quantized_kernel(true);
            let tol = 2e-5 * scale_of(&theirs) * (k as f32).sqrt();
            assert!(
                max_diff(&ours, &theirs) < tol,
                "{}, K {k}: {} against MLX's (tolerance {tol})",
                mode.name(),
                max_diff(&ours, &theirs)
            );
            let all = ours.to_vec::<f32>().unwrap();
            let n = 301usize;
            for rows in [1, 2, 3, 5] {
                let xs = x.slice_axis(0, 0, Some(rows)).unwrap();
                let got = xs
                    .quantized_matmul(&q, true)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                assert_eq!(
                    got,
                    all[..rows as usize * n],
                    "{}, K {k}, {rows} rows",
                    mode.name()
                );
            }
            for (from, to) in [(0, 1), (37, 90), (100, 301), (5, 6)] {
                let part = rows_of(&q, from, to);
                let some = x
                    .quantized_matmul(&part, true)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                for r in 0..7usize {
                    let width = (to - from) as usize;
                    assert_eq!(
                        some[r * width..(r + 1) * width],
                        all[r * n + from as usize..r * n + to as usize],
                        "{}, K {k}: rows {from}..{to}, row {r} of x",
                        mode.name()
                    );
                }
            }
        }
    }
}

#[test]
fn batched_and_strided_inputs_go_through_the_kernel_too() {
    let _one = serial();
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
    let _one = serial();
    let before = mlx::quantized_kernel_counts();
    // A k that is not a whole number of 4-bit packed units: MLX's path, same answer.
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
    let (ours, theirs, _) = products(&x, &w, 32, 4);
    assert!(max_diff(&ours, &theirs) < 1e-5);
    // More dimensions than the kernels' views of an array hold (8).
    let deep = x.reshape(&[1, 1, 1, 1, 1, 1, 1, 2, 96]).unwrap();
    let (ours, theirs, _) = products(&deep, &w, 32, 4);
    assert_eq!(ours.shape(), vec![1, 1, 1, 1, 1, 1, 1, 2, 8]);
    assert!(max_diff(&ours, &theirs) < 1e-5);
    assert_eq!(
        mlx::quantized_kernel_counts(),
        before,
        "the kernel took a shape it does not cover"
    );
}

/// (ours, MLX's) gather_qmm of x against the quantized stack w [E, N, K] with expert ids idx.
fn gathered(
    x: &Array,
    w: &Array,
    idx: &Array,
    group: i32,
    bits: i32,
    sorted: bool,
) -> (Array, Array) {
    let q = w.quantize(group, bits).unwrap();
    mlx::eval(&[&q.weight, &q.scales, b(&q)]).unwrap();
    mlx::set_quantized_kernel(true);
    let ours = x.gather_qmm(&q, None, Some(idx), true, sorted).unwrap();
    ours.eval().unwrap();
    mlx::set_quantized_kernel(false);
    let theirs = x.gather_qmm(&q, None, Some(idx), true, sorted).unwrap();
    theirs.eval().unwrap();
    mlx::set_quantized_kernel(true);
    (ours, theirs)
}

#[test]
fn expert_gathers_match_mlx() {
    let _one = serial();
    let before = mlx::quantized_kernel_counts();
    let (e, n, k) = (6, 40, 256);
    let w = random::normal(
        &[e, n, k],
        Dtype::F32,
        0.0,
        0.05,
        Some(&random::key(11).unwrap()),
    )
    .unwrap();
    for (bits, group) in [
        (4, 64),
        (8, 32),
        (4, 128),
        (3, 64),
        (6, 32),
        (5, 128),
        (2, 64),
    ] {
        // Decode-like: one token, top-3 experts, x broadcast over them ([T, 1, 1, K], ids [T, k]).
        let x = random::normal(
            &[1, 1, 1, k],
            Dtype::F32,
            0.0,
            1.0,
            Some(&random::key(12).unwrap()),
        )
        .unwrap();
        let idx = Array::from_slice(&[4u32, 0, 5], &[1, 3]).unwrap();
        let (ours, theirs) = gathered(&x, &w, &idx, group, bits, false);
        assert_eq!(ours.shape(), vec![1, 3, 1, n]);
        assert!(max_diff(&ours, &theirs) < 1e-3, "bits {bits} group {group}");
        // Prefill-like: 48 rows sorted by expert (runs long enough for the sgemm path), one row
        // each ([B, 1, K], ids [B]); and the same ids unsorted.
        let ids: Vec<u32> = (0..48).map(|i| [0u32, 0, 2, 2, 2, 5][i % 6]).collect();
        let mut sorted_ids = ids.clone();
        sorted_ids.sort();
        let x = random::normal(
            &[48, 1, k],
            Dtype::F32,
            0.0,
            1.0,
            Some(&random::key(13).unwrap()),
        )
        .unwrap();
        for (list, sorted) in [(&sorted_ids, true), (&ids, false)] {
            let idx = Array::from_slice(list, &[48]).unwrap();
            let (ours, theirs) = gathered(&x, &w, &idx, group, bits, sorted);
            assert_eq!(ours.shape(), vec![48, 1, n]);
            assert!(
                max_diff(&ours, &theirs) < 1e-3,
                "bits {bits} group {group} sorted {sorted}"
            );
        }
        // Two rows per block.
        let x = random::normal(
            &[3, 2, k],
            Dtype::F32,
            0.0,
            1.0,
            Some(&random::key(14).unwrap()),
        )
        .unwrap();
        let idx = Array::from_slice(&[1i32, 1, 3], &[3]).unwrap();
        let (ours, theirs) = gathered(&x, &w, &idx, group, bits, false);
        assert!(max_diff(&ours, &theirs) < 1e-3);
    }
    let after = mlx::quantized_kernel_counts();
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "the kernel did not answer: {before:?} -> {after:?}"
    );
}

/// Normal values of standard deviation `sd`, the same for the same seed.
fn normal(shape: &[i32], sd: f64, seed: u64) -> Array {
    random::normal(
        shape,
        Dtype::F32,
        0.0,
        sd,
        Some(&random::key(seed).unwrap()),
    )
    .unwrap()
}

fn ops_of(a: &Array) -> Vec<String> {
    mlx::graph_ops(&[a])
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

#[test]
fn dequantization_matches_mlx() {
    let _one = serial();
    let mut case = 100u64;
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            // A matrix, an expert stack, and rows gathered from a table (an embedding lookup).
            for shape in [vec![7, 256], vec![3, 5, 384], vec![40, 128]] {
                let k = *shape.last().unwrap();
                if k % group != 0 {
                    continue;
                }
                let w = random::normal(
                    &shape,
                    Dtype::F32,
                    0.0,
                    0.05,
                    Some(&random::key(case).unwrap()),
                )
                .unwrap();
                case += 1;
                let q = w.quantize(group, bits).unwrap();
                let ids = Array::from_slice(&[2i32, 0, 2, 1], &[2, 2]).unwrap();
                let rows = |q: &mlx::Quantized| mlx::Quantized {
                    weight: q.weight.take(&ids, 0).unwrap(),
                    scales: q.scales.take(&ids, 0).unwrap(),
                    biases: Some(b(q).take(&ids, 0).unwrap()),
                    ..q.clone()
                };
                for table in [q.clone(), rows(&q)] {
                    mlx::set_quantized_kernel(true);
                    let ours = table.dequantize().unwrap();
                    assert!(ops_of(&ours).contains(&"MlxrCpuDequantize".to_string()));
                    ours.eval().unwrap();
                    mlx::set_quantized_kernel(false);
                    let theirs = table.dequantize().unwrap();
                    assert!(!ops_of(&theirs).contains(&"MlxrCpuDequantize".to_string()));
                    theirs.eval().unwrap();
                    mlx::set_quantized_kernel(true);
                    assert_eq!(ours.shape(), theirs.shape());
                    // scale·q + bias as one FMA against MLX's product then sum: an ulp apart.
                    let d = max_diff(&ours, &theirs);
                    assert!(
                        d <= 1e-6 * scale_of(&theirs),
                        "bits {bits} group {group} {shape:?}: {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn gated_mlps_are_the_ops_they_fuse() {
    let _one = serial();
    // (fused, unfused): gemma4's GeGLU and GLM's SwiGLU.
    let geglu = |x: &Array, g: &mlx::Quantized, u: &mlx::Quantized| {
        mlx::fast::gelu_tanh(&x.quantized_matmul(g, true).unwrap())
            .unwrap()
            .multiply(&x.quantized_matmul(u, true).unwrap())
            .unwrap()
    };
    let swiglu = |x: &Array, g: &mlx::Quantized, u: &mlx::Quantized| {
        mlx::fast::silu_mul(
            &x.quantized_matmul(g, true).unwrap(),
            &x.quantized_matmul(u, true).unwrap(),
        )
        .unwrap()
    };
    type Fused = fn(&Array, &mlx::Quantized, &mlx::Quantized) -> mlx::Result<Array>;
    type Unfused<'a> = &'a dyn Fn(&Array, &mlx::Quantized, &mlx::Quantized) -> Array;
    let kinds: [(&str, Fused, Unfused); 2] = [
        ("geglu", Array::quantized_geglu, &geglu),
        ("swiglu", Array::quantized_swiglu, &swiglu),
    ];
    let mut case = 300u64;
    for (kind, fused_op, unfused_op) in kinds {
        for (mode, bits, group) in
            with_modes(&[(4, 64), (8, 32), (4, 32), (8, 128), (3, 64), (6, 32)])
        {
            for (rows, n, k) in [(1, 96, 256), (3, 33, 512), (16, 40, 256), (37, 24, 384)] {
                if k % group != 0 {
                    continue;
                }
                let x = normal(&[1, rows, k], 1.0, case);
                let g = normal(&[n, k], 0.05, case + 1)
                    .quantize_as(mode, group, bits)
                    .unwrap();
                let u = normal(&[n, k], 0.05, case + 2)
                    .quantize_as(mode, group, bits)
                    .unwrap();
                case += 3;
                let what = format!("{kind} {mode:?} bits {bits} group {group} {rows}x{k} @ {n}");
                let fused = fused_op(&x, &g, &u).unwrap();
                assert_eq!(
                    ops_of(&fused)
                        .iter()
                        .filter(|o| o.starts_with("Mlxr"))
                        .count(),
                    1,
                    "one op: {what}"
                );
                assert_eq!(fused.shape(), vec![1, rows, n]);
                // With the kernels on, the unfused ops compute the very same values.
                assert_eq!(
                    fused.to_vec::<f32>().unwrap(),
                    unfused_op(&x, &g, &u).to_vec::<f32>().unwrap(),
                    "{what}"
                );
                // And MLX's own ops, kernels off, within float tolerance.
                mlx::set_quantized_kernel(false);
                mlx::fast::set_fused_kernels(false);
                let off = fused_op(&x, &g, &u).unwrap();
                let theirs = unfused_op(&x, &g, &u);
                let off_ops = ops_of(&off);
                mlx::set_quantized_kernel(true);
                mlx::fast::set_fused_kernels(true);
                assert!(
                    !off_ops.iter().any(|o| o.starts_with("Mlxr")),
                    "{off_ops:?}"
                );
                assert_eq!(max_diff(&off, &theirs), 0.0, "{what}");
                let tol = 2e-5 * scale_of(&theirs) * (k as f32).sqrt();
                let d = max_diff(&fused, &theirs);
                assert!(d <= tol, "{what}: {d} > {tol}");
            }
        }
    }
    // Gate and up of different formats are refused with a clear error.
    let w = random::normal(&[8, 256], Dtype::F32, 0.0, 0.05, None).unwrap();
    let x = random::normal(&[1, 256], Dtype::F32, 0.0, 1.0, None).unwrap();
    let err = x
        .quantized_geglu(&w.quantize(64, 4).unwrap(), &w.quantize(64, 8).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("differ"), "{err}");
}

#[test]
fn projections_of_one_input_are_the_products_they_fuse() {
    let _one = serial();
    let mut case = 500u64;
    for (mode, bits, group) in with_modes(&[
        (4, 64),
        (8, 32),
        (4, 32),
        (8, 128),
        (4, 128),
        (3, 64),
        (5, 32),
        (2, 128),
    ]) {
        // Decode rows, a verify block, a prefill past the sgemm threshold; output widths of a
        // query, key and value projection, odd ones among them.
        for (rows, k, ns) in [
            (1, 256, vec![64, 16, 16]),
            (1, 512, vec![96, 33, 7]),
            (3, 256, vec![40, 8]),
            (4, 384, vec![24, 24, 24]),
            (20, 256, vec![48, 16, 16]),
        ] {
            if k % group != 0 {
                continue;
            }
            let x = normal(&[1, rows, k], 1.0, case);
            let qs: Vec<mlx::Quantized> = ns
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    normal(&[n, k], 0.05, case + 1 + i as u64)
                        .quantize_as(mode, group, bits)
                        .unwrap()
                })
                .collect();
            case += 8;
            let mut inputs = vec![&x];
            inputs.extend(
                qs.iter()
                    .flat_map(|q| [&q.weight, &q.scales].into_iter().chain(&q.biases)),
            );
            mlx::eval(&inputs).unwrap();
            let what = format!("{mode:?} bits {bits} group {group} {rows}x{k} @ {ns:?}");
            let refs: Vec<&mlx::Quantized> = qs.iter().collect();
            let fused = x.quantized_matmuls(&refs).unwrap();
            assert_eq!(fused.len(), ns.len(), "{what}");
            let fused_ops: Vec<String> = mlx::graph_ops(&fused.iter().collect::<Vec<_>>())
                .into_iter()
                .map(|(name, _)| name)
                .collect();
            assert_eq!(fused_ops, vec!["MlxrCpuQuantizedMatmuls"], "one op: {what}");
            for ((out, q), &n) in fused.iter().zip(&qs).zip(&ns) {
                assert_eq!(out.shape(), vec![1, rows, n], "{what}");
                // The very values of the single product, whichever rows shared its chunks.
                let single = x.quantized_matmul(q, true).unwrap();
                assert_eq!(
                    out.to_vec::<f32>().unwrap(),
                    single.to_vec::<f32>().unwrap(),
                    "{what}"
                );
                // And MLX's own, kernels off, within float tolerance.
                mlx::set_quantized_kernel(false);
                let theirs = x.quantized_matmul(q, true).unwrap();
                theirs.eval().unwrap();
                mlx::set_quantized_kernel(true);
                let tol = 2e-5 * scale_of(&theirs) * (k as f32).sqrt();
                let d = max_diff(out, &theirs);
                assert!(d <= tol, "{what}: {d} > {tol}");
            }
            // Fused kernels off: one product each, the same values.
            mlx::fast::set_fused_kernels(false);
            let apart = x.quantized_matmuls(&refs).unwrap();
            mlx::fast::set_fused_kernels(true);
            let apart_ops = mlx::graph_ops(&apart.iter().collect::<Vec<_>>());
            assert!(
                apart_ops
                    .iter()
                    .all(|(name, _)| name != "MlxrCpuQuantizedMatmuls"),
                "{apart_ops:?}"
            );
            for (a, f) in apart.iter().zip(&fused) {
                assert_eq!(
                    a.to_vec::<f32>().unwrap(),
                    f.to_vec::<f32>().unwrap(),
                    "{what}"
                );
            }
        }
    }
    // Matrices of different formats are refused with a clear error; none is no output.
    let w = random::normal(&[8, 256], Dtype::F32, 0.0, 0.05, None).unwrap();
    let x = random::normal(&[1, 256], Dtype::F32, 0.0, 1.0, None).unwrap();
    let (a, b) = (w.quantize(64, 4).unwrap(), w.quantize(64, 8).unwrap());
    let err = x.quantized_matmuls(&[&a, &b]).unwrap_err().to_string();
    assert!(
        err.contains("affine 8 bits, group 64 beside affine 4 bits"),
        "{err}"
    );
    assert!(x.quantized_matmuls(&[]).unwrap().is_empty());
}

/// The kernel's two ways of unpacking fields, by integer-to-float conversion and read in place
/// as subnormal floats, give the same bits on every format and row count; inputs outside the
/// subnormal unpacking's range (largest magnitude past 2^±40, 2^36 for the word-lane kernel of
/// the widths that straddle words) are left to the conversion, and every result is MLX's within
/// float tolerance.
#[test]
fn both_ways_of_unpacking_give_the_same_bits() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    let mut case = 500u64;
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            for (rows, n, k) in [(1, 37, 384), (2, 16, 256), (3, 9, 512), (5, 20, 128)] {
                // In range for the subnormal unpacking: 1, 1e-9, 1e9; past it: 1e-14, 2e13;
                // 2e11 (largest magnitude near 2^39) between the two kernels' bounds.
                for scale in [1.0f32, 1e-9, 1e9, 1e-14, 2e13, 2e11] {
                    case += 2;
                    let x = normal(&[rows, k], scale as f64, case);
                    let q = normal(&[n, k], 0.05, case + 1)
                        .quantize(group, bits)
                        .unwrap();
                    let with = |subnormal| {
                        mlx::set_quantized_unpacking(Some(subnormal));
                        let y = x.quantized_matmul(&q, true).unwrap().to_vec::<f32>();
                        mlx::set_quantized_unpacking(None);
                        y.unwrap()
                    };
                    let (converted, subnormal) = (with(false), with(true));
                    let what = format!("bits {bits} group {group} {rows}x{k} @ {n}, |x| ~ {scale}");
                    assert_eq!(converted, subnormal, "{what}");
                    mlx::set_quantized_kernel(false);
                    let theirs = x.quantized_matmul(&q, true).unwrap();
                    mlx::set_quantized_kernel(true);
                    let ours = Array::from_slice(&subnormal, &[rows, n]).unwrap();
                    let most = theirs
                        .to_vec::<f32>()
                        .unwrap()
                        .iter()
                        .fold(0f32, |m, y| m.max(y.abs()));
                    let tol = 2e-5 * most * (k as f32).sqrt();
                    let d = max_diff(&ours, &theirs);
                    assert!(d <= tol, "{what}: |ours - mlx| = {d} > {tol}");
                }
            }
        }
    }
}

/// A projection and the residual update after it (`quantized_matmul_residual_norm`) are one op
/// with the bits of the two it stands for (the kernel's product, then the RMS-norm kernel's
/// update) on the packed-rows and sgemm paths, with and without a norm weight, a scale and a
/// next norm; within float tolerance of MLX's own ops; and operands the kernels do not take
/// go to the ops it stands for (a residual of another shape: MLX's error, no crash).
#[test]
fn a_projection_and_its_residual_update_are_one_op() {
    use mlx::fast;
    let _one = serial();
    mlx::set_quantized_kernel(true);
    let mut case = 1300u64;
    for (mode, bits, group) in with_modes(&[(4, 64), (8, 32), (4, 128), (3, 64), (6, 128)]) {
        for (rows, n, k) in [(1, 96, 256), (3, 40, 512), (20, 64, 384)] {
            case += 10;
            let x = normal(&[1, rows, k], 1.0, case);
            let q = normal(&[n, k], 0.05, case + 1)
                .quantize_as(mode, group, bits)
                .unwrap();
            let h = normal(&[1, rows, n], 1.0, case + 2);
            let w = normal(&[n], 1.0, case + 3);
            let next = normal(&[n], 1.0, case + 4);
            let s = Array::from_slice(&[0.75f32], &[1]).unwrap();
            mlx::eval(&[&x, &q.weight, &q.scales, &h, &w, &next, &s]).unwrap();
            for (weight, scale, then) in [
                (Some(&w), None, Some(&next)),
                (None, Some(&s), Some(&next)),
                (Some(&w), Some(&s), None),
            ] {
                let what = format!(
                    "{bits}-bit g{group} {rows}x{k} @ {n}, weight {}, scale {}, next {}",
                    weight.is_some(),
                    scale.is_some(),
                    then.is_some()
                );
                let fused = || {
                    fast::quantized_matmul_residual_norm(&x, &q, weight, 1e-6, &h, scale, then)
                        .unwrap()
                };
                let (sum, normed) = fused();
                assert_eq!(
                    ops_of(&sum),
                    vec!["MlxrCpuQuantizedMatmulNorm".to_string()],
                    "{what}"
                );
                assert_eq!(normed.is_some(), then.is_some(), "{what}");
                assert_eq!(sum.shape(), vec![1, rows, n]);
                // The two ops it stands for, each through mlx-runner's kernel.
                let y = x.quantized_matmul(&q, true).unwrap();
                let alone = fast::rms_norm_residual(&y, weight, 1e-6, &h, scale).unwrap();
                assert_eq!(
                    sum.to_vec::<f32>().unwrap(),
                    alone.to_vec::<f32>().unwrap(),
                    "{what}: the sum"
                );
                if let (Some(normed), Some(next)) = (&normed, then) {
                    let renormed = fast::rms_norm(&alone, Some(next), 1e-6).unwrap();
                    assert_eq!(
                        normed.to_vec::<f32>().unwrap(),
                        renormed.to_vec::<f32>().unwrap(),
                        "{what}: its norm"
                    );
                }
                // MLX's own, every kernel off.
                mlx::set_quantized_kernel(false);
                fast::set_fused_kernels(false);
                let (mlx_sum, mlx_normed) = fused();
                let theirs = mlx_sum.to_vec::<f32>().unwrap();
                let theirs_normed = mlx_normed.map(|a| a.to_vec::<f32>().unwrap());
                fast::set_fused_kernels(true);
                mlx::set_quantized_kernel(true);
                let close = |a: &[f32], b: &[f32], part: &str| {
                    let most = b.iter().fold(1f32, |m, v| m.max(v.abs()));
                    let d = a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                    assert!(d <= 1e-4 * most, "{what}, {part}: |ours - mlx| = {d}");
                };
                close(&sum.to_vec::<f32>().unwrap(), &theirs, "sum");
                if let (Some(a), Some(b)) = (normed, theirs_normed) {
                    close(&a.to_vec::<f32>().unwrap(), &b, "norm");
                }
            }
        }
    }
    // A residual of another shape: not the kernel's; MLX's broadcasting refuses it.
    let x = normal(&[1, 2, 256], 1.0, 1400);
    let q = normal(&[32, 256], 0.05, 1401).quantize(64, 4).unwrap();
    let bad = normal(&[1, 2, 16], 1.0, 1402);
    let r = fast::quantized_matmul_residual_norm(&x, &q, None, 1e-6, &bad, None, None)
        .and_then(|(a, _)| a.eval());
    assert!(r.is_err(), "a residual of the wrong shape");
}

/// A quantized embedding lookup (`Quantized::lookup`) is one op with the bits of the gathers,
/// the kernel's dequantization and the float32 multiply it stands for, within float tolerance
/// of MLX's own ops; ids of any shape, int32 or uint32, negative ids counted from the end as
/// in MLX's take, ids past the table zeros.
#[test]
fn a_quantized_embedding_lookup_is_one_op() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    let mut case = 1500u64;
    for (bits, group) in [
        (4, 32),
        (4, 64),
        (8, 64),
        (8, 128),
        (3, 64),
        (5, 32),
        (6, 128),
        (2, 64),
    ] {
        case += 1;
        let q = normal(&[50, 256], 0.05, case)
            .quantize(group, bits)
            .unwrap();
        mlx::eval(&[&q.weight, &q.scales, b(&q)]).unwrap();
        let int = |v: &[i32], shape: &[i32]| Array::from_slice(v, shape).unwrap();
        let uint = Array::from_slice(&[3u32, 49, 0], &[3]).unwrap();
        for (ids, scale) in [
            (int(&[7], &[1, 1]), Some(16.0f32)),
            (int(&[1, 0, 49, 7, 7, 20], &[2, 3]), Some(27.712_812)),
            (int(&[-1, -50, 5], &[3]), None),
            (uint.clone(), Some(0.5)),
        ] {
            let what = format!("{bits}-bit g{group} ids {:?}", ids.to_vec::<i32>().ok());
            let ours = q.lookup(&ids, scale).unwrap();
            assert_eq!(
                ops_of(&ours),
                vec!["MlxrCpuQuantizedEmbedding".to_string()],
                "{what}"
            );
            let mut shape = ids.shape();
            shape.push(256);
            assert_eq!(ours.shape(), shape, "{what}");
            // The ops it stands for: negative ids wrapped as take wraps them.
            let wrapped = ids
                .astype(Dtype::I32)
                .unwrap()
                .add_scalar(50.0)
                .unwrap()
                .remainder_scalar(50.0)
                .unwrap();
            let part = |a: &Array| a.take(&wrapped, 0).unwrap();
            let table = mlx::Quantized {
                weight: part(&q.weight),
                scales: part(&q.scales),
                biases: Some(part(b(&q))),
                ..q.clone()
            };
            let apart = |table: &mlx::Quantized| {
                let rows = table.dequantize().unwrap();
                match scale {
                    Some(s) => rows.multiply_scalar(f64::from(s)).unwrap(),
                    None => rows,
                }
            };
            let got = ours.to_vec::<f32>().unwrap();
            assert_eq!(got, apart(&table).to_vec::<f32>().unwrap(), "{what}");
            mlx::set_quantized_kernel(false);
            let theirs = apart(&table);
            // With the kernel off the lookup is those ops.
            let fallback = q.lookup(&ids, scale).unwrap().to_vec::<f32>().unwrap();
            mlx::set_quantized_kernel(true);
            assert_eq!(
                fallback,
                theirs.to_vec::<f32>().unwrap(),
                "{what}: kernel off"
            );
            let d = max_diff(&ours, &theirs);
            assert!(d <= 1e-6 * scale_of(&theirs), "{what}: |ours - mlx| = {d}");
        }
        // Past the table: zeros, not a read outside it.
        let past = q.lookup(&int(&[50, 1000], &[2]), None).unwrap();
        assert!(past.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    }
}

/// A layer's q/k/v projections and their heads' norms and rotation (`quantized_qkv_heads`) are
/// one op with the bits of `quantized_matmuls` followed by `qkv_heads` (three matrices, and two
/// where the values are the keys), one row or several at their own positions, base or explicit
/// wavelengths; within float tolerance of MLX's own ops with every kernel off (then the call is
/// the ops it stands for); matrices of two formats, or other than two or three, a clear error.
#[test]
fn a_layers_projections_and_their_heads_are_one_op() {
    use mlx::fast::{self, QkvNorms, RopeFreqs, Rotation};
    let _one = serial();
    mlx::set_quantized_kernel(true);
    let mut case = 1700u64;
    let inv: Vec<f32> = (0..16).map(|j| 1.0 + j as f32 * 7.5).collect();
    let wavelengths = Array::from_slice(&inv, &[16]).unwrap();
    for (mode, bits, group) in with_modes(&[(4, 64), (8, 32), (3, 64), (6, 32)]) {
        for (t, k_eq_v, custom) in [(1, false, false), (3, true, true), (2, false, true)] {
            case += 10;
            let (hq, hk, d, k) = (4, 2, 32, 256);
            let x = normal(&[1, t, k], 1.0, case);
            let mat = |n: i32, seed| {
                normal(&[n, k], 0.05, seed)
                    .quantize_as(mode, group, bits)
                    .unwrap()
            };
            let (wq, wk, wv) = (
                mat(hq * d, case + 1),
                mat(hk * d, case + 2),
                mat(hk * d, case + 3),
            );
            let (nq, nk) = (normal(&[d], 1.0, case + 4), normal(&[d], 1.0, case + 5));
            let positions: Vec<i32> = (0..t).map(|i| 3 + 97 * i).collect();
            let offsets = Array::from_slice(&positions, &[t]).unwrap();
            let rotation = Rotation {
                dims: d,
                traditional: false,
                freqs: if custom {
                    RopeFreqs::Custom(&wavelengths)
                } else {
                    RopeFreqs::Base(10000.0)
                },
                scale: 1.0,
            };
            let mats: Vec<&mlx::Quantized> = if k_eq_v {
                vec![&wq, &wk]
            } else {
                vec![&wq, &wk, &wv]
            };
            let held: Vec<&Array> = mats
                .iter()
                .flat_map(|q| [&q.weight, &q.scales].into_iter().chain(&q.biases))
                .chain([&x, &nq, &nk, &offsets, &wavelengths])
                .collect();
            mlx::eval(&held).unwrap();
            let what = format!("{bits}-bit g{group} t {t} k_eq_v {k_eq_v} custom {custom}");
            let fused = || {
                fast::quantized_qkv_heads(
                    &x,
                    &mats,
                    QkvNorms {
                        q_heads: hq,
                        kv_heads: hk,
                        q_norm: &nq,
                        k_norm: &nk,
                        eps: 1e-6,
                    },
                    rotation,
                    &offsets,
                )
                .unwrap()
            };
            let (q, kk, v) = fused();
            assert_eq!(
                ops_of(&q),
                vec!["MlxrCpuQuantizedQkvHeads".to_string()],
                "{what}"
            );
            // The two ops it stands for, each through mlx-runner's kernels.
            let raw = x.quantized_matmuls(&mats).unwrap();
            let rv = if k_eq_v { &raw[1] } else { &raw[2] };
            let apart = fast::qkv_heads(
                &raw[0],
                &raw[1],
                rv,
                QkvNorms {
                    q_heads: hq,
                    kv_heads: hk,
                    q_norm: &nq,
                    k_norm: &nk,
                    eps: 1e-6,
                },
                rotation,
                &offsets,
            )
            .unwrap();
            for (i, (got, alone)) in [(&q, &apart.0), (&kk, &apart.1), (&v, &apart.2)]
                .into_iter()
                .enumerate()
            {
                assert_eq!(got.shape(), alone.shape(), "{what}: part {i}");
                assert_eq!(
                    got.to_vec::<f32>().unwrap(),
                    alone.to_vec::<f32>().unwrap(),
                    "{what}: part {i}"
                );
            }
            // MLX's own ops, every kernel off.
            mlx::set_quantized_kernel(false);
            fast::set_fused_kernels(false);
            let theirs = fused();
            let theirs = [&theirs.0, &theirs.1, &theirs.2].map(|a| a.to_vec::<f32>().unwrap());
            fast::set_fused_kernels(true);
            mlx::set_quantized_kernel(true);
            for (i, (ours, theirs)) in [&q, &kk, &v].into_iter().zip(theirs).enumerate() {
                let ours = ours.to_vec::<f32>().unwrap();
                let most = theirs.iter().fold(1f32, |m, y| m.max(y.abs()));
                let diff = ours
                    .iter()
                    .zip(&theirs)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    diff <= 1e-4 * most,
                    "{what}: part {i}: |ours - mlx| = {diff}"
                );
            }
        }
    }
    // Two formats in one call: refused with a clear error.
    let x = normal(&[1, 1, 256], 1.0, 1800);
    let a = normal(&[64, 256], 0.05, 1801).quantize(64, 4).unwrap();
    let b = normal(&[32, 256], 0.05, 1802).quantize(64, 8).unwrap();
    let n = normal(&[16], 1.0, 1803);
    let one = Array::from_slice(&[0i32], &[1]).unwrap();
    let rotation = Rotation {
        dims: 16,
        traditional: false,
        freqs: RopeFreqs::Base(10000.0),
        scale: 1.0,
    };
    let norms = QkvNorms {
        q_heads: 4,
        kv_heads: 2,
        q_norm: &n,
        k_norm: &n,
        eps: 1e-6,
    };
    let err = fast::quantized_qkv_heads(
        &x,
        &[&a, &b],
        QkvNorms {
            q_heads: 4,
            kv_heads: 2,
            q_norm: &n,
            k_norm: &n,
            eps: 1e-6,
        },
        rotation,
        &one,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("different formats"), "{err}");
    // One matrix, or four: refused with a clear error, no crash.
    for mats in [vec![&a], vec![&a, &a, &a, &a]] {
        let err = fast::quantized_qkv_heads(&x, &mats, norms, rotation, &one)
            .unwrap_err()
            .to_string();
        assert!(err.contains("two or three matrices"), "{err}");
    }
}

/// MLX's microscaling modes (crates/mlx-sys/src/fpq_cpu.cc) against MLX's own ops in the same
/// mode: dequantization bit for bit, products at decode row counts and past the sgemm threshold,
/// expert gathers at decode and prefill shapes.
#[test]
fn microscaling_modes_match_mlx() {
    use mlx::QuantMode;
    let _one = serial();
    let before = mlx::quantized_kernel_counts();
    let modes = [
        (QuantMode::Mxfp4, 32, 4),
        (QuantMode::Nvfp4, 16, 4),
        (QuantMode::Mxfp8, 32, 8),
    ];
    let both = |f: &dyn Fn() -> Array| {
        mlx::set_quantized_kernel(true);
        let ours = f();
        let ours_ops = ops_of(&ours);
        ours.eval().unwrap();
        mlx::set_quantized_kernel(false);
        let theirs = f().astype(Dtype::F32).unwrap();
        theirs.eval().unwrap();
        mlx::set_quantized_kernel(true);
        (ours, ours_ops, theirs)
    };
    for (seed, (mode, group, bits)) in (30u64..).zip(modes) {
        let what = mode.name();
        // Weights of a few orders of magnitude, so that scales differ from group to group.
        let w = normal(&[67, 384], 0.05, seed)
            .multiply(&normal(&[67, 1], 2.0, seed + 100).exp().unwrap())
            .unwrap();
        let q = w.quantize_as(mode, group, bits).unwrap();
        mlx::eval(&[&q.weight, &q.scales]).unwrap();
        assert!(q.biases.is_none(), "{what}");

        let (ours, ops, theirs) = both(&|| q.dequantize().unwrap());
        assert!(
            ops.contains(&"MlxrCpuFpDequantize".to_string()),
            "{what}: {ops:?}"
        );
        assert_eq!(ours.dtype(), Dtype::F32);
        assert_eq!(
            ours.to_vec::<f32>().unwrap(),
            theirs.to_vec::<f32>().unwrap(),
            "{what}: dequantize"
        );
        let dense_w = theirs.t().unwrap();

        for (i, rows) in [1, 2, 3, 4, 5, 9, 16, 40].into_iter().enumerate() {
            let x = normal(&[rows, 384], 1.0, seed * 10 + i as u64);
            let (ours, ops, theirs) = both(&|| x.quantized_matmul(&q, true).unwrap());
            assert!(
                ops.contains(&"MlxrCpuFpQuantizedMatmul".to_string()),
                "{what}: {ops:?}"
            );
            let dense = x.matmul(&dense_w).unwrap();
            let tol = 2e-5 * scale_of(&dense) * 384f32.sqrt();
            assert!(
                max_diff(&ours, &theirs) < tol && max_diff(&ours, &dense) < tol,
                "{what}, {rows} rows: {} / {} (tolerance {tol})",
                max_diff(&ours, &theirs),
                max_diff(&ours, &dense)
            );
        }

        // Expert stacks: decode (one token, top-3 of 5, x broadcast over them) and prefill-like
        // (40 single rows sorted by expert, runs past the sgemm threshold, and unsorted).
        let (e, n, k) = (5, 24, 128);
        let stack = normal(&[e, n, k], 0.05, seed + 200);
        let qs = stack.quantize_as(mode, group, bits).unwrap();
        mlx::eval(&[&qs.weight, &qs.scales]).unwrap();
        let x = normal(&[1, 1, 1, k], 1.0, seed + 300);
        let idx = Array::from_slice(&[4u32, 0, 2], &[1, 3]).unwrap();
        let (ours, ops, theirs) =
            both(&|| x.gather_qmm(&qs, None, Some(&idx), true, false).unwrap());
        assert!(
            ops.contains(&"MlxrCpuFpGatherQuantizedMatmul".to_string()),
            "{what}: {ops:?}"
        );
        assert_eq!(ours.shape(), vec![1, 3, 1, n]);
        assert!(max_diff(&ours, &theirs) < 1e-4, "{what}: decode gather");
        let ids: Vec<u32> = (0..40)
            .map(|i| [0u32, 0, 3, 3, 3, 1, 4, 4][i % 8])
            .collect();
        let mut sorted_ids = ids.clone();
        sorted_ids.sort();
        let x = normal(&[40, 1, k], 1.0, seed + 400);
        for (list, sorted) in [(&sorted_ids, true), (&ids, false)] {
            let idx = Array::from_slice(list, &[40]).unwrap();
            let (ours, _, theirs) =
                both(&|| x.gather_qmm(&qs, None, Some(&idx), true, sorted).unwrap());
            assert_eq!(ours.shape(), vec![40, 1, n]);
            assert!(
                max_diff(&ours, &theirs) < 1e-4,
                "{what}: prefill gather, sorted {sorted}"
            );
        }
    }
    let after = mlx::quantized_kernel_counts();
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "the kernel did not answer on both paths: {before:?} -> {after:?}"
    );
}

/// Every code of each microscaling format, NaN codes and subnormals included, decodes to what
/// MLX's dequantize gives (NaN where it gives NaN).
#[test]
fn every_microscaling_code_decodes_as_mlx_does() {
    use mlx::QuantMode;
    let _one = serial();
    // 256 FP8 codes (64 words) or 16 FP4 codes repeated (8 words of 0x76543210 / 0xfedcba98),
    // under scales around 2^0 (E8M0 127, E4M3 0x38 = 1.0) and some far from it.
    let fp8_words: Vec<u32> = (0..64u32)
        .map(|i| (4 * i) | ((4 * i + 1) << 8) | ((4 * i + 2) << 16) | ((4 * i + 3) << 24))
        .collect();
    let fp4_words: Vec<u32> = (0..64)
        .map(|i| if i % 2 == 0 { 0x7654_3210 } else { 0xfedc_ba98 })
        .collect();
    for (mode, group, bits, words, scales) in [
        (
            QuantMode::Mxfp8,
            32,
            8,
            &fp8_words,
            vec![127u8, 1, 100, 140, 127, 200, 127, 60],
        ),
        (
            QuantMode::Mxfp4,
            32,
            4,
            &fp4_words,
            [127u8, 0, 1, 126, 128, 200, 90, 160].repeat(2),
        ),
        (
            QuantMode::Nvfp4,
            16,
            4,
            &fp4_words,
            [0x38u8, 0x01, 0x7e, 0xb8, 0x30, 0x40, 0x08, 0x55].repeat(4),
        ),
    ] {
        let q = mlx::Quantized {
            weight: Array::from_slice(words, &[1, 64]).unwrap(),
            scales: Array::from_slice(&scales, &[1, scales.len() as i32]).unwrap(),
            biases: None,
            group_size: group,
            bits,
            mode,
            panels: false,
        };
        mlx::set_quantized_kernel(true);
        let ours = q.dequantize().unwrap().to_vec::<f32>().unwrap();
        mlx::set_quantized_kernel(false);
        let theirs = q
            .dequantize()
            .unwrap()
            .astype(Dtype::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        mlx::set_quantized_kernel(true);
        assert_eq!(ours.len(), theirs.len());
        for (k, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{}: value {k}: ours {a:e}, MLX's {b:e}",
                mode.name()
            );
        }
        // The products' decode paths (few rows and tiles) read the same values.
        let k = 64 * 32 / bits;
        let x = Array::from_slice(&vec![1.0f32; k as usize], &[1, k]).unwrap();
        let one = x
            .quantized_matmul(&q, true)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()[0];
        let sum: f32 = ours.iter().sum();
        assert!(
            (one.is_nan() && sum.is_nan()) || (one - sum).abs() <= 1e-5 * sum.abs().max(1.0),
            "{}: {one} vs {sum}",
            mode.name()
        );
    }
}

/// The integer kernel (2, 3, 5 and 6 bits with VNNI) writes each block of 64 activations as
/// integers under the block's largest magnitude: activations far apart in size within a block
/// (an outlier channel), blocks far apart in size, zeros, huge and tiny values stay within
/// float32's own error of MLX's product, and a NaN comes out as MLX's does.
#[test]
fn the_integer_kernel_keeps_float_accuracy_on_uneven_activations() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    let mut case = 900u64;
    for bits in [2, 3, 5, 6] {
        for group in [32, 64, 128] {
            for k in [320, 768] {
                if k % group != 0 {
                    continue;
                }
                let n = 24usize;
                let base = normal(&[4, k], 1.0, case).to_vec::<f32>().unwrap();
                let w = normal(&[n as i32, k], 0.05, case + 1);
                case += 2;
                let ku = k as usize;
                let mut x = base.clone();
                for (i, v) in x.iter_mut().enumerate() {
                    let (row, col) = (i / ku, i % ku);
                    *v = match row {
                        // One outlier channel a block, at a different place in each.
                        0 if col % 64 == (col / 64 * 7) % 64 => *v * 3e4,
                        0 => *v,
                        // Blocks of 1e-30 between blocks of 1.
                        1 if (col / 64) % 2 == 1 => *v * 1e-30,
                        1 => *v,
                        2 => 0.0,
                        _ => *v * 1e20,
                    };
                }
                let x = Array::from_slice(&x, &[4, k]).unwrap();
                let q = w.quantize(group, bits).unwrap();
                let (ours, theirs) = ours_and_mlx(&x, &q);
                // Σ |x_k| · (|s| q_k + |b|): the scale float32's own rounding works at in a
                // product formed as s · Σ x·q + b · Σ x, as every kernel here forms it (MLX's
                // own dequantization and product).
                mlx::set_quantized_kernel(false);
                let magnitudes = mlx::Quantized {
                    scales: q.scales.abs().unwrap(),
                    biases: Some(b(&q).abs().unwrap()),
                    ..q.clone()
                };
                let bound = x
                    .abs()
                    .unwrap()
                    .matmul(&magnitudes.dequantize().unwrap().t().unwrap())
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                mlx::set_quantized_kernel(true);
                for (i, ((a, b), s)) in ours.iter().zip(&theirs).zip(&bound).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * s,
                        "bits {bits} group {group} K {k}, row {} col {}: ours {a} MLX {b} (Σ|x|·(|s|q+|b|) {s})",
                        i / n,
                        i % n
                    );
                }
                assert!(
                    ours[2 * n..3 * n].iter().all(|&v| v == 0.0),
                    "a zero row is zero"
                );

                // A NaN in x: the rows take the float kernel and the NaN reaches the outputs, as
                // in MLX's product. (An infinity becomes NaN in every kernel here, as the product
                // is formed as scale · Σ x·q + bias · Σ x, where MLX gives ±inf.)
                let mut y = base.clone();
                y[ku + 5] = f32::NAN;
                let (ours, theirs) = ours_and_mlx(&Array::from_slice(&y, &[4, k]).unwrap(), &q);
                for (a, b) in ours.iter().zip(&theirs) {
                    assert!(
                        (a.is_nan() && b.is_nan())
                            || (a - b).abs() <= 2e-5 * b.abs().max(1.0) * (k as f32).sqrt(),
                        "bits {bits} group {group} K {k} with a NaN in x: ours {a} MLX {b}"
                    );
                }
            }
        }
    }
}

/// `x @ dequantize(q)ᵀ` by the kernel and by MLX's own product, as values.
fn ours_and_mlx(x: &Array, q: &mlx::Quantized) -> (Vec<f32>, Vec<f32>) {
    let product = || {
        x.quantized_matmul(q, true)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    };
    mlx::set_quantized_kernel(true);
    let ours = product();
    mlx::set_quantized_kernel(false);
    let theirs = product();
    mlx::set_quantized_kernel(true);
    (ours, theirs)
}
