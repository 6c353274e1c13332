//! Affine-quantized matrices held as 16-output panels (`mlx::Quantized::paneled`,
//! crates/mlx-sys/src/qpanel_cpu.cc): their products against MLX's own `quantized_matmul` on
//! the row layout and against the dense product, on both sides of the sgemm threshold (80 rows
//! for panels); a row's bits independent of the rows beside it below it; every fused op and
//! lookup taking panels with the values it gives for rows; MLX's own ops (kernels off) on
//! panels put back in rows.

use mlx::{random, Array, Dtype, Quantized};

/// The kernel switches and counters are per process: the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn normal(shape: &[i32], sd: f64, seed: u64) -> Array {
    let a = random::normal(
        shape,
        Dtype::F32,
        0.0,
        sd,
        Some(&random::key(seed).unwrap()),
    )
    .unwrap();
    a.eval().unwrap();
    a
}

fn values(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (values(a), values(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn scale_of(a: &Array) -> f32 {
    values(a).iter().map(|x| x.abs()).fold(1.0, f32::max)
}

fn ops_of(a: &Array) -> Vec<String> {
    mlx::graph_ops(&[a])
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

/// `w` quantized, and the same matrix paneled. Every CPU these tests run on has AVX-512 (CI's
/// does); where one has not, panels are never made and there is nothing to test.
fn both(w: &Array, group: i32, bits: i32) -> Option<(Quantized, Quantized)> {
    let q = w.quantize(group, bits).unwrap();
    let p = q.paneled().unwrap()?;
    for a in [&q, &p] {
        let parts = [&a.weight, &a.scales, a.biases.as_ref().unwrap()];
        mlx::eval(&parts).unwrap();
    }
    assert!(p.panels && !q.panels);
    let n = w.shape()[0];
    assert_eq!(p.weight.shape(), vec![n / 16, q.weight.shape()[1], 16]);
    assert_eq!(p.scales.shape(), vec![n / 16, q.scales.shape()[1], 16]);
    assert_eq!(p.outputs(), n);
    Some((q, p))
}

const FORMATS: [(i32, i32); 6] = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)];

#[test]
fn paneled_products_match_mlx_on_both_paths() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    let mut case = 0u64;
    let before = mlx::quantized_kernel_counts();
    for (bits, group) in FORMATS {
        for (rows, n, k) in [
            (1, 16, 256),
            // Outputs split over the pool in pieces of four panels (one row) or two (two to
            // four rows), the last piece a single panel.
            (1, 592, 1536),
            (3, 592, 1536),
            (2, 48, 512),
            (4, 64, 384),
            (5, 32, 768),
            (8, 32, 3072),
            (15, 48, 256),
            (16, 32, 512),
            (37, 16, 1024),
            (79, 32, 256),
            // The sgemm path, and inputs past its K tile: tiles accumulate.
            (80, 48, 512),
            (97, 32, 4608),
        ] {
            if k % group != 0 {
                continue;
            }
            case += 2;
            let x = normal(&[rows, k], 1.0, case);
            let w = normal(&[n, k], 0.05, case + 1);
            let Some((q, p)) = both(&w, group, bits) else {
                return;
            };
            let what = format!("{bits}-bit g{group} {rows}x{k} @ {n}");
            let ours = x.quantized_matmul(&p, true).unwrap();
            assert_eq!(ours.shape(), vec![rows, n], "{what}");
            assert_eq!(ops_of(&ours), vec!["MlxrCpuQuantizedMatmul"], "{what}");
            mlx::set_quantized_kernel(false);
            let theirs = x.quantized_matmul(&q, true).unwrap();
            // Panels with the kernel off: MLX's op on the rows put back, the same values.
            let off = x.quantized_matmul(&p, true).unwrap();
            let (theirs_v, off_v) = (values(&theirs), values(&off));
            mlx::set_quantized_kernel(true);
            assert_eq!(off_v, theirs_v, "{what}: panels through MLX");
            let dense = x.matmul(&q.dequantize().unwrap().t().unwrap()).unwrap();
            let tol = 2e-5 * scale_of(&dense) * (k as f32).sqrt();
            for (name, other) in [("mlx", &theirs), ("dense", &dense)] {
                let d = max_diff(&ours, other);
                assert!(d <= tol, "{what}: |panels - {name}| = {d} > {tol}");
            }
        }
    }
    let after = mlx::quantized_kernel_counts();
    assert!(after.0 > before.0, "the few-rows panel kernel never ran");
    assert!(after.1 > before.1, "the panels' sgemm path never ran");
}

#[test]
fn a_paneled_row_does_not_depend_on_the_rows_beside_it() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    for (bits, group) in FORMATS {
        // The second is split over the pool, in pieces that depend on the row count.
        for (n, k) in [(48, 512), (592, 1536)] {
            let w = normal(&[n, k], 0.05, 100 + bits as u64);
            let Some((_, p)) = both(&w, group, bits) else {
                return;
            };
            let x = normal(&[79, k], 1.0, 200 + group as u64);
            let alone: Vec<Vec<f32>> = (0..79)
                .map(|r| {
                    let row = x.slice_axis(0, r, Some(r + 1)).unwrap();
                    values(&row.quantized_matmul(&p, true).unwrap())
                })
                .collect();
            // Row counts the panel kernel takes (the sgemm path starts at 80): every one up to 17,
            // blocks of eight and their remainders beyond.
            for m in (2..=17).chain([24, 31, 64, 79]) {
                let together = values(
                    &x.slice_axis(0, 0, Some(m))
                        .unwrap()
                        .quantized_matmul(&p, true)
                        .unwrap(),
                );
                for r in 0..m as usize {
                    assert_eq!(
                        together[r * n as usize..(r + 1) * n as usize],
                        alone[r][..],
                        "{bits}-bit g{group} n{n}: row {r} of {m}"
                    );
                }
            }
        }
    }
}

#[test]
fn fused_ops_take_panels_with_the_values_of_the_ops_they_fuse() {
    use mlx::fast;
    let _one = serial();
    mlx::set_quantized_kernel(true);
    mlx::fast::set_fused_kernels(true);
    let mut case = 1000u64;
    for (bits, group) in FORMATS {
        for rows in [1, 3, 20, 90] {
            case += 10;
            let k = 256;
            let x = normal(&[1, rows, k], 1.0, case);
            let mats: Vec<(Quantized, Quantized)> = [64, 32, 32]
                .iter()
                .enumerate()
                .map(|(i, &n)| both(&normal(&[n, k], 0.05, case + 1 + i as u64), group, bits))
                .collect::<Option<_>>()
                .unwrap_or_default();
            if mats.is_empty() {
                return;
            }
            let what = format!("{bits}-bit g{group}, {rows} rows");
            let single = |q: &Quantized| values(&x.quantized_matmul(q, true).unwrap());
            // q, k and v: one op, each output the single product's bits.
            let paneled: Vec<&Quantized> = mats.iter().map(|(_, p)| p).collect();
            let outs = x.quantized_matmuls(&paneled).unwrap();
            assert_eq!(ops_of(&outs[0]), vec!["MlxrCpuQuantizedMatmuls"], "{what}");
            for (o, p) in outs.iter().zip(&paneled) {
                assert_eq!(values(o), single(p), "{what}: matmuls");
            }
            // Panels beside rows are two formats.
            let mixed = x.quantized_matmuls(&[&mats[0].1, &mats[1].0]).unwrap_err();
            assert!(mixed.to_string().contains("beside"), "{mixed}");
            // A gated MLP (gate and up of one shape).
            let (g, u) = (&mats[1].1, &mats[2].1);
            let fused = x.quantized_geglu(g, u).unwrap();
            assert_eq!(ops_of(&fused), vec!["MlxrCpuQuantizedGlu"], "{what}");
            let unfused = fast::gelu_tanh(&x.quantized_matmul(g, true).unwrap())
                .unwrap()
                .multiply(&x.quantized_matmul(u, true).unwrap())
                .unwrap();
            assert_eq!(values(&fused), values(&unfused), "{what}: geglu");
            // An output projection and its residual update.
            let (q, p) = &mats[0];
            let h = normal(&[1, rows, 64], 1.0, case + 7);
            let nw = normal(&[64], 1.0, case + 8);
            let (sum, _) =
                fast::quantized_matmul_residual_norm(&x, p, Some(&nw), 1e-6, &h, None, None)
                    .unwrap();
            assert_eq!(ops_of(&sum), vec!["MlxrCpuQuantizedMatmulNorm"], "{what}");
            let y = x.quantized_matmul(p, true).unwrap();
            let unfused = fast::rms_norm_residual(&y, Some(&nw), 1e-6, &h, None).unwrap();
            assert_eq!(values(&sum), values(&unfused), "{what}: residual norm");
            // Through MLX (kernels off) the fused ops on panels are the row layout's.
            mlx::set_quantized_kernel(false);
            mlx::fast::set_fused_kernels(false);
            let off = (
                values(&x.quantized_matmuls(&paneled).unwrap()[1]),
                values(&x.quantized_matmul(&mats[1].0, true).unwrap()),
                values(&x.quantized_geglu(g, u).unwrap()),
                values(&x.quantized_geglu(&mats[1].0, &mats[2].0).unwrap()),
                values(
                    &fast::quantized_matmul_residual_norm(&x, p, Some(&nw), 1e-6, &h, None, None)
                        .unwrap()
                        .0,
                ),
                values(
                    &fast::quantized_matmul_residual_norm(&x, q, Some(&nw), 1e-6, &h, None, None)
                        .unwrap()
                        .0,
                ),
            );
            mlx::set_quantized_kernel(true);
            mlx::fast::set_fused_kernels(true);
            assert_eq!(off.0, off.1, "{what}: matmuls off");
            assert_eq!(off.2, off.3, "{what}: geglu off");
            assert_eq!(off.4, off.5, "{what}: residual norm off");
        }
    }
}

#[test]
fn paneled_tables_look_up_and_dequantize_as_rows_do() {
    let _one = serial();
    mlx::set_quantized_kernel(true);
    for (bits, group) in FORMATS {
        let (v, k) = (80, 256);
        let w = normal(&[v, k], 0.05, 3000 + bits as u64 + group as u64);
        let Some((q, p)) = both(&w, group, bits) else {
            return;
        };
        let what = format!("{bits}-bit g{group}");
        assert_eq!(
            values(&p.dequantize().unwrap()),
            values(&q.dequantize().unwrap()),
            "{what}: dequantize"
        );
        assert_eq!(p.dequantize().unwrap().shape(), vec![v, k]);
        // Ids anywhere in a panel, from the end (negative), and past the table (zeros).
        let ids = Array::from_slice(&[0i32, 17, 79, 31, -1, 45, 80, 63], &[2, 4]).unwrap();
        for scale in [None, Some(0.5f32)] {
            let ours = p.lookup(&ids, scale).unwrap();
            assert_eq!(ops_of(&ours), vec!["MlxrCpuQuantizedEmbedding"], "{what}");
            assert_eq!(ours.shape(), vec![2, 4, k]);
            assert_eq!(
                values(&ours),
                values(&q.lookup(&ids, scale).unwrap()),
                "{what}: lookup, scale {scale:?}"
            );
        }
        // Put back in rows, the arrays are the original ones.
        let r = p.rows().unwrap();
        assert!(!r.panels);
        for (a, b) in [(&r.weight, &q.weight), (&r.scales, &q.scales)] {
            assert_eq!((a.shape(), a.dtype()), (b.shape(), b.dtype()));
            assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{what}");
        }
    }
}

#[test]
fn matrices_the_panel_kernels_do_not_take_stay_rows() {
    let _one = serial();
    // Rows not a multiple of 16; widths the panels do not take; microscaling modes; a stack.
    let cases: [(&[i32], i32, i32, mlx::QuantMode); 5] = [
        (&[24, 256], 64, 4, mlx::QuantMode::Affine),
        (&[32, 256], 64, 3, mlx::QuantMode::Affine),
        (&[32, 256], 64, 6, mlx::QuantMode::Affine),
        (&[32, 256], 32, 4, mlx::QuantMode::Mxfp4),
        (&[2, 32, 256], 64, 4, mlx::QuantMode::Affine),
    ];
    for (shape, group, bits, mode) in cases {
        let q = normal(shape, 0.05, 7)
            .quantize_as(mode, group, bits)
            .unwrap();
        assert!(
            q.paneled().unwrap().is_none(),
            "{shape:?} {mode:?} {bits}-bit"
        );
    }
}
