//! Where a one-token decode step goes, part by part: `cargo bench --bench step`.
//!
//! In-process, on the bench model in float32 and quantized to 4 bits (group 64): the whole
//! step (forward, output head, greedy pick, evaluated and read back), building its graph, the
//! ops it dispatches, every matrix product of the model alone, and the rest. Each is measured
//! with mlx-runner's CPU kernels (quantized matmul, fused RMS norm / RoPE / attention / GELU)
//! and with MLX's own kernels and op graphs (on the weights in MLX's own row layout),
//! alternating step by step, medians of 10. Then every product of the model at 1, 2, 3, 4 and 8
//! rows, in milliseconds and GMAC/s, beside one matrix of the model whose weights stay in cache:
//! where the two rates are alike, the products are bound by arithmetic at that row count, not
//! by reading weights. Where the model's quantized matrices are 16-output panels, the same
//! products with MLX's row layout are taken in turn with them and compared.
//! `BENCH_STEP_MODEL=dir` measures another model directory instead.

mod common;
use common::{affine_matrix, bench_model, median, peer_python, quantized_model};

use mlx::Array;
use std::path::{Path, PathBuf};
use std::time::Instant;

const STEPS: usize = 10;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn kernels(on: bool) {
    mlx::set_quantized_kernel(on);
    mlx::fast::set_fused_kernels(on);
}

/// The model's matrices, laid out as the model holds them on the CPU (dense ones through
/// `models::nn::Linear::dense`: float32 column panels where the rows are whole panels).
enum Mat {
    Quantized(mlx::Quantized),
    /// A float32 matrix with its input and output widths.
    Dense(models::nn::Linear, i32, i32),
    /// An expert stack `[E, out, in]` of which a token reads `k` experts.
    Experts(mlx::Quantized, i32),
    /// A stack of per-head matrices `[H, out, in]` (MLA's split `kv_b_proj`), all read.
    Heads(mlx::Quantized),
}

/// The input width of a packed matrix: its rows are bit streams of `bits`-bit values, so 3-,
/// 5- and 6-bit rows hold a fraction of a value per word (K·bits/32 words).
fn in_width(q: &mlx::Quantized) -> i32 {
    // A paneled matrix's words are `[N/16, words, 16]`.
    let axis = if q.panels { 1 } else { q.weight.ndim() - 1 };
    q.weight.shape()[axis] * 32 / q.bits
}

impl Mat {
    /// The input of `rows` tokens (a batch of decode rows).
    fn input(&self, rows: i32) -> Array {
        let normal =
            |shape: &[i32]| mlx::random::normal(shape, mlx::Dtype::F32, 0.0, 1.0, None).unwrap();
        match self {
            Mat::Quantized(q) | Mat::Experts(q, _) => normal(&[rows, in_width(q)]),
            Mat::Heads(q) => normal(&[q.weight.shape()[0], rows, in_width(q)]),
            Mat::Dense(_, inputs, _) => normal(&[rows, *inputs]),
        }
    }
    /// Multiply-accumulates of a product over `rows` rows.
    fn macs(&self, rows: i32) -> f64 {
        let dims = |q: &mlx::Quantized| {
            let s = q.weight.shape();
            // Matrices of a stack times each one's outputs.
            let stacked: f64 = s[..s.len().saturating_sub(2)]
                .iter()
                .map(|&d| d as f64)
                .product();
            let stacked = if q.panels { 1.0 } else { stacked };
            (stacked * q.outputs() as f64, in_width(q) as f64)
        };
        let rows = rows as f64;
        match self {
            Mat::Quantized(q) | Mat::Heads(q) => {
                let (out, inp) = dims(q);
                rows * out * inp
            }
            Mat::Experts(q, k) => {
                let (out, inp) = dims(q);
                rows * (*k as f64) * out * inp / q.weight.shape()[0] as f64
            }
            Mat::Dense(_, inputs, outputs) => rows * (*inputs as f64) * (*outputs as f64),
        }
    }
    /// Bytes of weights a product reads.
    fn bytes(&self) -> usize {
        match self {
            Mat::Quantized(q) | Mat::Heads(q) | Mat::Experts(q, _) => {
                q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, |b| b.nbytes())
            }
            Mat::Dense(_, inputs, outputs) => 4 * *inputs as usize * *outputs as usize,
        }
    }
    /// This matrix in the layout MLX's own kernels are written for (a paneled one put back in
    /// rows, a copy): what the MLX column of the step multiplies.
    fn as_rows(&self) -> Mat {
        match self {
            Mat::Quantized(q) if q.panels => {
                let r = q.rows().unwrap();
                let copy = |a: &Array| a.contiguous().unwrap();
                let r = mlx::Quantized {
                    weight: copy(&r.weight),
                    scales: copy(&r.scales),
                    biases: r.biases.as_ref().map(copy),
                    ..r
                };
                mlx::eval(&[&r.weight, &r.scales]).unwrap();
                Mat::Quantized(r)
            }
            Mat::Quantized(q) => Mat::Quantized(q.clone()),
            Mat::Dense(l, i, o) => Mat::Dense(l.clone(), *i, *o),
            Mat::Experts(q, k) => Mat::Experts(q.clone(), *k),
            Mat::Heads(q) => Mat::Heads(q.clone()),
        }
    }
    fn apply(&self, x: &Array) -> Array {
        match self {
            Mat::Quantized(q) | Mat::Heads(q) => x.quantized_matmul(q, true).unwrap(),
            Mat::Dense(l, _, _) => l.forward(x).unwrap(),
            Mat::Experts(q, k) => {
                // Every row reads the same k experts: the rows share each expert's matrix.
                let rows = x.shape()[0];
                let ids: Vec<u32> = (0..rows * k).map(|i| (i % k) as u32).collect();
                let idx = Array::from_slice(&ids, &[rows, *k]).unwrap();
                x.reshape(&[rows, 1, -1])
                    .unwrap()
                    .gather_qmm(q, None, Some(&idx), true, false)
                    .unwrap()
            }
        }
    }
}

fn matrices(dir: &Path) -> Vec<Mat> {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let (group, bits) = (
        cfg["quantization"]["group_size"].as_i64().unwrap_or(64) as i32,
        cfg["quantization"]["bits"].as_i64().unwrap_or(4) as i32,
    );
    let text = cfg.get("text_config").unwrap_or(&cfg);
    let top_k = ["num_experts_per_tok", "top_k_experts"]
        .iter()
        .find_map(|k| text[k].as_i64())
        .unwrap_or(1) as i32;
    let mut arrays = std::collections::HashMap::new();
    for f in std::fs::read_dir(dir).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "safetensors") {
            arrays.extend(mlx::io::load_safetensors(&f).unwrap().arrays);
        }
    }
    let names: Vec<String> = arrays.keys().cloned().collect();
    let untied = names.iter().any(|n| n.ends_with("lm_head.weight"));
    let dense = models::weights::Weights::from_arrays(Default::default(), mlx::Dtype::F32, None);
    let mut mats = vec![];
    for name in names {
        let Some(base) = name.strip_suffix(".weight") else {
            continue;
        };
        // Embedding tables are looked up, one row per token, unless one is the tied head.
        if base.ends_with("embed_tokens_per_layer") || (untied && base.ends_with("embed_tokens")) {
            continue;
        }
        if let Some(q) = affine_matrix(&arrays, base, group, bits) {
            mats.push(match q.weight.ndim() {
                // Paneled where the model's loader panels it (models::Weights::paneled).
                2 => Mat::Quantized(q.paneled().unwrap().unwrap_or(q)),
                _ if base.contains("switch") || base.contains("experts") => Mat::Experts(q, top_k),
                _ => Mat::Heads(q),
            });
        } else {
            let w = &arrays[&name];
            // Matrices only (norm scales are vectors); the embedding is the tied output head.
            if w.ndim() == 2 && w.shape().iter().all(|&d| d > 1) {
                let (outputs, inputs) = (w.shape()[0], w.shape()[1]);
                let w = w.astype(mlx::Dtype::F32).unwrap();
                let l = models::nn::Linear::dense(&dense, w).unwrap();
                mats.push(Mat::Dense(l, inputs, outputs));
            }
        }
    }
    // Where the model's own weights live after loading (models::Weights::materialize).
    dense.materialize().unwrap();
    let held: Vec<&Array> = mats
        .iter()
        .flat_map(|m| match m {
            Mat::Quantized(q) | Mat::Experts(q, _) | Mat::Heads(q) => [&q.weight, &q.scales]
                .into_iter()
                .chain(&q.biases)
                .collect(),
            Mat::Dense(..) => vec![],
        })
        .collect();
    mlx::eval(&held).unwrap();
    mlx::memory::move_to_huge_pages(held).unwrap();
    mats
}

/// "Name count, ..." for an op census.
fn op_list(ops: &[(String, usize)]) -> String {
    ops.iter()
        .map(|(name, n)| format!("{name} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

struct Row {
    step: f64,
    build: f64,
    products: f64,
    ops: usize,
}

/// `mats` as the model holds them; `rows_mats` in MLX's row layout, which MLX's kernels take.
fn measure(dir: &Path, mats: &[Mat], rows_mats: &[Mat]) -> (Row, Row, String) {
    let m = models::load(dir, models::DtypeChoice::Auto).unwrap();
    // MLX's kernels run on a copy in MLX's own row layout (no quantized panels).
    mlx::set_quantized_panels(false);
    let m_rows = models::load(dir, models::DtypeChoice::Auto).unwrap();
    mlx::set_quantized_panels(true);
    let model = &*m.model;
    let inputs: Vec<Array> = mats.iter().map(|m| m.input(1)).collect();
    mlx::eval(&inputs.iter().collect::<Vec<_>>()).unwrap();
    let mut caches = model.make_caches();
    let ids: Vec<i32> = (0..64).map(|i| (i * 13 % 30000) + 10).collect();
    let start = Instant::now();
    let h = model
        .forward(&Array::from_slice(&ids, &[1, 64]).unwrap(), &mut caches)
        .unwrap();
    let build = ms(start);
    // Counted outside the timed spans: walking the graph is the bench's work, not the model's.
    let prefill_ops = mlx::graph_ops(&[&h]);
    let start = Instant::now();
    h.eval().unwrap();
    eprintln!(
        "prefill of 64 tokens: {:.1} ms; ops: {}",
        build + ms(start),
        op_list(&prefill_ops)
    );
    let mut next = Array::from_slice(&[42i32], &[1, 1]).unwrap();
    let mut rows: [Vec<(f64, f64, f64)>; 2] = [vec![], vec![]];
    let mut ops = [0usize; 2];
    let mut ours_ops = String::new();
    for i in 0..(STEPS + 2) * 2 {
        let on = i % 2 == 0;
        kernels(on);
        let (model, mats) = if on {
            (model, mats)
        } else {
            (&*m_rows.model, rows_mats)
        };
        let start = Instant::now();
        let h = model.forward(&next, &mut caches).unwrap();
        let picked = model.logits(&h).unwrap().argmax(-1, false).unwrap();
        let build = ms(start);
        let graph = mlx::graph_ops(&[&picked]);
        let start = Instant::now();
        let token = picked.to_vec::<u32>().unwrap()[0];
        let step = ms(start) + build;
        ops[on as usize] = graph.iter().map(|(_, n)| n).sum();
        if on {
            ours_ops = op_list(&graph);
        }
        next = Array::from_slice(&[token as i32], &[1, 1]).unwrap();
        let start = Instant::now();
        let outs: Vec<Array> = mats.iter().zip(&inputs).map(|(m, x)| m.apply(x)).collect();
        mlx::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
        let products = ms(start);
        if i >= 4 {
            rows[on as usize].push((step, build, products));
        }
    }
    kernels(true);
    let row = |r: &Vec<(f64, f64, f64)>, ops| Row {
        step: median(r.iter().map(|x| x.0).collect()),
        build: median(r.iter().map(|x| x.1).collect()),
        products: median(r.iter().map(|x| x.2).collect()),
        ops,
    };
    (row(&rows[1], ops[1]), row(&rows[0], ops[0]), ours_ops)
}

/// Medians of every matrix product of the model at each row count of `ROW_COUNTS`, with the
/// CPU kernels, the row counts taken in turn: what a batch of decode rows costs against one.
const ROW_COUNTS: [i32; 5] = [1, 2, 3, 4, 8];

/// Each of `layouts` (the model's matrices in different layouts) in turn at every row count:
/// medians per layout, per row count.
fn products_by_rows(layouts: &[&[Mat]]) -> Vec<Vec<f64>> {
    kernels(true);
    let inputs: Vec<Vec<Array>> = ROW_COUNTS
        .iter()
        .map(|&r| layouts[0].iter().map(|m| m.input(r)).collect())
        .collect();
    for x in &inputs {
        mlx::eval(&x.iter().collect::<Vec<_>>()).unwrap();
    }
    let mut times = vec![vec![vec![]; ROW_COUNTS.len()]; layouts.len()];
    for i in 0..STEPS + 2 {
        for (j, x) in inputs.iter().enumerate() {
            for (l, mats) in layouts.iter().enumerate() {
                let start = Instant::now();
                let outs: Vec<Array> = mats.iter().zip(x).map(|(m, x)| m.apply(x)).collect();
                mlx::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
                if i >= 2 {
                    times[l][j].push(ms(start));
                }
            }
        }
    }
    times
        .into_iter()
        .map(|t| t.into_iter().map(median).collect())
        .collect()
}

/// GMAC/s of the largest plain matrix of the model whose weights fit in L2 (at most 1 MiB),
/// multiplied `REPEATS` times in one evaluation at each row count of `ROW_COUNTS`: the kernel's
/// arithmetic rate with its weights in cache, beside the whole model's from memory. Where the two
/// are alike at some row count, the step is bound by arithmetic there, not by reading weights.
fn in_cache_by_rows(mats: &[Mat]) -> Option<(Vec<f64>, String)> {
    const REPEATS: usize = 64;
    kernels(true);
    let m = mats
        .iter()
        .filter(|m| matches!(m, Mat::Quantized(_) | Mat::Dense(..)) && m.bytes() <= 1 << 20)
        .max_by_key(|m| m.bytes())?;
    let shape = match m {
        Mat::Quantized(q) => format!("{} × {}", q.outputs(), in_width(q)),
        Mat::Dense(_, inputs, outputs) => format!("{outputs} × {inputs}"),
        _ => unreachable!("filtered to plain matrices"),
    };
    let rates = ROW_COUNTS
        .iter()
        .map(|&r| {
            let x = m.input(r);
            x.eval().unwrap();
            let times: Vec<f64> = (0..STEPS + 2)
                .map(|_| {
                    let start = Instant::now();
                    let outs: Vec<Array> = (0..REPEATS).map(|_| m.apply(&x)).collect();
                    mlx::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
                    ms(start)
                })
                .skip(2)
                .collect();
            m.macs(r) * REPEATS as f64 / median(times) / 1e6
        })
        .collect();
    Some((rates, shape))
}

fn main() {
    mlx::init_thread().unwrap();
    let dirs: Vec<PathBuf> = match std::env::var_os("BENCH_STEP_MODEL") {
        Some(d) => vec![d.into()],
        None => {
            let Some(python) = peer_python() else {
                return;
            };
            let Some(base) = bench_model(&python) else {
                return;
            };
            let q4 = quantized_model(&python, &base, 4, 64);
            std::iter::once(base).chain(q4).collect()
        }
    };
    for dir in dirs {
        let mats = matrices(&dir);
        let rows_mats: Vec<Mat> = mats.iter().map(Mat::as_rows).collect();
        let paneled = mats
            .iter()
            .any(|m| matches!(m, Mat::Quantized(q) if q.panels));
        let (ours, mlx, ours_ops) = measure(&dir, &mats, &rows_mats);
        println!(
            "\nA one-token decode step of {} after a 64-token prompt (in-process, medians of {STEPS})\n",
            dir.display()
        );
        println!("| part (ms) | mlx-runner's kernels | MLX's kernels and op graphs |");
        println!("|---|---|---|");
        println!(
            "| whole step: forward, head, greedy pick, read back | {:.2} | {:.2} |",
            ours.step, mlx.step
        );
        println!(
            "| of which building the graph | {:.2} | {:.2} |",
            ours.build, mlx.build
        );
        println!(
            "| every matrix product of the model alone | {:.2} | {:.2} |",
            ours.products, mlx.products
        );
        println!(
            "| the rest: attention, norms, RoPE, elementwise, dispatch, sync | {:.2} | {:.2} |",
            ours.step - ours.build - ours.products,
            mlx.step - mlx.build - mlx.products
        );
        println!("| ops dispatched | {} | {} |", ours.ops, mlx.ops);
        println!(
            "| decode tok/s | {:.1} | {:.1} |",
            1e3 / ours.step,
            1e3 / mlx.step
        );
        println!("\nOps with mlx-runner's kernels: {ours_ops}");
        let layouts: Vec<&[Mat]> = if paneled {
            vec![&mats, &rows_mats]
        } else {
            vec![&mats]
        };
        let timed = products_by_rows(&layouts);
        let by_rows = &timed[0];
        let model_macs: f64 = mats.iter().map(|m| m.macs(1)).sum();
        let cached = in_cache_by_rows(&mats);
        println!("\nEvery matrix product at R rows (mlx-runner's kernels, medians of {STEPS})\n");
        match &cached {
            Some((_, shape)) => println!(
                "The last column: one {shape} matrix of the model, its weights in cache, many times over.\n"
            ),
            None => println!("(no matrix of the model fits in cache alone)\n"),
        }
        if paneled {
            println!(
                "The quantized matrices are 16-output panels (docs/MODELS.md, \"Quantized weights on \
                 the CPU\"); the last two columns are the same products with MLX's row layout, \
                 taken in turn with them.\n"
            );
        }
        let header = if paneled {
            " ms, row layout | row layout ÷ panels |"
        } else {
            ""
        };
        println!("| rows | ms | rows a second, ÷ one row's | GMAC/s | GMAC/s in cache |{header}");
        println!(
            "|---|---|---|---|---|{}",
            if paneled { "---|---|" } else { "" }
        );
        for (i, (r, t)) in ROW_COUNTS.iter().zip(by_rows).enumerate() {
            let in_cache = cached
                .as_ref()
                .map_or("—".to_string(), |(g, _)| format!("{:.1}", g[i]));
            let rows_layout = timed.get(1).map_or(String::new(), |t2| {
                format!(" {:.2} | {:.2} |", t2[i], t2[i] / t)
            });
            println!(
                "| {r} | {t:.2} | {:.2} | {:.1} | {in_cache} |{rows_layout}",
                *r as f64 * by_rows[0] / t,
                model_macs * *r as f64 / t / 1e6
            );
        }
    }
}
