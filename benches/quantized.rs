//! Quantized models on the CPU: `cargo bench --bench quantized`.
//!
//! The benchmark model (target/bench-model, ~120M float32, tied embeddings) quantized by
//! `mlx_lm convert -q` (MLX affine, 4 and 8 bits, group 64; and 4-bit with groups 32 and 128),
//! run by `mlx-runner generate` and `mlx_lm generate` one after the other (same MLX, same
//! machine, OpenBLAS preloaded into the peer): prefill and decode tokens/s, medians, ratio. Ours
//! goes through mlx-runner's CPU kernel for quantized matmuls (crates/mlx-sys/src/qmm_cpu.cc);
//! `MLX_RUNNER_KERNELS=mlx` runs ours with MLX's own kernels instead, for comparison;
//! `BENCH_QUANT_ALL=1` adds 4-bit with groups 32 and 128.
//!
//! The memory roofline: the bytes a decode step must read (every weight file byte: each
//! quantized matrix is read once per token, the tied embedding as the output head) over the
//! read bandwidth, measured here by summing a 1 GiB buffer with all cores.
//!
//! `BENCH_QUANT_BREAKDOWN=1` instead prints where a decode step of the 4-bit model goes.

mod common;
use common::{bench_model, corpus_prompt, median, ours_generate, peer_generate, peer_python, root};

use std::path::Path;
use std::process::Command;

const ROUNDS: usize = 3;
const TOKENS: &str = "64";

/// Read bandwidth in bytes/s: the best of a few passes summing a 1 GiB buffer, split across
/// the cores.
fn read_bandwidth() -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut best = 0f64;
    for _ in 0..5 {
        let start = std::time::Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let chunk = n.div_ceil(threads);
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((n * 8) as f64 / start.elapsed().as_secs_f64());
    }
    best
}

fn weight_bytes(model: &Path) -> u64 {
    std::fs::read_dir(model)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

fn quantized(python: &Path, base: &Path, bits: u32, group: u32) -> Option<std::path::PathBuf> {
    let dir = root().join(format!("target/bench-model-q{bits}-g{group}"));
    if !dir.join("config.json").exists() {
        let ok = Command::new(python)
            .args(["-m", "mlx_lm", "convert", "--hf-path"])
            .arg(base)
            .arg("--mlx-path")
            .arg(&dir)
            .args([
                "-q",
                "--q-bits",
                &bits.to_string(),
                "--q-group-size",
                &group.to_string(),
            ])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            eprintln!("mlx_lm convert failed for {bits}-bit group {group}");
            return None;
        }
    }
    Some(dir)
}

fn ms(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Where a one-row decode step of the quantized model goes, in-process: the whole step
/// (forward, head, argmax, evaluated), building its graph, and every quantized matmul of the
/// model alone (through our kernel and through MLX's), medians of 10 steps.
fn breakdown(dir: &Path) {
    mlx::init_thread().unwrap();
    let m = models::load(dir, models::DtypeChoice::Auto).unwrap();
    let model = &*m.model;
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let (group, bits) = (
        cfg["quantization"]["group_size"].as_i64().unwrap_or(64) as i32,
        cfg["quantization"]["bits"].as_i64().unwrap_or(4) as i32,
    );
    let mut arrays = mlx::io::load_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .arrays;
    let names: Vec<String> = arrays
        .keys()
        .filter(|k| k.ends_with(".scales"))
        .cloned()
        .collect();
    let mats: Vec<mlx::Quantized> = names
        .iter()
        .filter_map(|s| {
            let base = s.trim_end_matches(".scales");
            Some(mlx::Quantized {
                weight: arrays.remove(&format!("{base}.weight"))?,
                scales: arrays.remove(s)?,
                biases: arrays.remove(&format!("{base}.biases"))?,
                group_size: group,
                bits,
            })
        })
        .collect();
    let all: Vec<&mlx::Array> = mats
        .iter()
        .flat_map(|q| [&q.weight, &q.scales, &q.biases])
        .collect();
    mlx::eval(&all).unwrap();
    let mut caches = model.make_caches();
    let ids: Vec<i32> = (0..64).map(|i| (i * 13 % 30000) + 10).collect();
    model
        .forward(
            &mlx::Array::from_slice(&ids, &[1, 64]).unwrap(),
            &mut caches,
        )
        .unwrap()
        .eval()
        .unwrap();
    let mut next = mlx::Array::from_slice(&[42i32], &[1, 1]).unwrap();
    let inputs: Vec<mlx::Array> = mats
        .iter()
        .map(|q| {
            let k = q.weight.shape()[1] * (32 / q.bits);
            mlx::random::normal(&[1, k], mlx::Dtype::F32, 0.0, 1.0, None).unwrap()
        })
        .collect();
    mlx::eval(&inputs.iter().collect::<Vec<_>>()).unwrap();
    let floor = |kernel: bool| {
        mlx::set_quantized_kernel(kernel);
        let start = std::time::Instant::now();
        let outs: Vec<mlx::Array> = mats
            .iter()
            .zip(&inputs)
            .map(|(q, x)| x.quantized_matmul(q, true).unwrap())
            .collect();
        mlx::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
        let t = ms(start);
        mlx::set_quantized_kernel(true);
        t
    };
    let (mut steps, mut builds, mut ours, mut theirs) = (vec![], vec![], vec![], vec![]);
    let mut ops = vec![];
    for i in 0..14 {
        let start = std::time::Instant::now();
        let h = model.forward(&next, &mut caches).unwrap();
        let picked = model.logits(&h).unwrap().argmax(-1, false).unwrap();
        let built = ms(start);
        if i == 5 {
            ops = mlx::graph_ops(&[&picked]);
        }
        picked.eval().unwrap();
        let step = ms(start);
        next = picked
            .astype(mlx::Dtype::I32)
            .unwrap()
            .reshape(&[1, 1])
            .unwrap();
        let (o, t) = (floor(true), floor(false));
        if i >= 4 {
            steps.push(step);
            builds.push(built);
            ours.push(o);
            theirs.push(t);
        }
    }
    let (step, build, ours, theirs) = (median(steps), median(builds), median(ours), median(theirs));
    // The largest matrix alone, many times: the kernel's own read rate.
    let big = mats
        .iter()
        .max_by_key(|q| q.weight.shape()[0] * q.weight.shape()[1])
        .unwrap();
    let k = big.weight.shape()[1] * (32 / big.bits);
    let x = mlx::random::normal(&[1, k], mlx::Dtype::F32, 0.0, 1.0, None).unwrap();
    x.eval().unwrap();
    let bytes = [&big.weight, &big.scales, &big.biases]
        .iter()
        .map(|a| a.nbytes())
        .sum::<usize>();
    let mut rates = vec![];
    for _ in 0..20 {
        let start = std::time::Instant::now();
        x.quantized_matmul(big, true).unwrap().eval().unwrap();
        rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    println!(
        "largest matrix {:?}: {:.1} GB/s read by the kernel (median of 20)",
        big.weight.shape(),
        median(rates)
    );
    println!(
        "\nOps one decode step dispatches: {} ({})",
        ops.iter().map(|(_, n)| n).sum::<usize>(),
        ops.iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("\nWhere a one-row decode step of {} goes ({} quantized matrices; in-process, medians of 10)\n", dir.display(), mats.len());
    println!("| part | ms |");
    println!("|---|---|");
    println!("| whole step (forward, head, argmax) | {step:.2} |");
    println!("| of which building the graph | {build:.2} |");
    println!("| every quantized matmul alone, our kernel | {ours:.2} |");
    println!("| every quantized matmul alone, MLX's kernel | {theirs:.2} |");
    println!(
        "| the rest: attention, norms, rope, elementwise ops, op dispatch, sync | {:.2} |",
        step - ours
    );
}

fn main() {
    let Some(python) = peer_python() else {
        return;
    };
    let Some(base) = bench_model(&python) else {
        return;
    };
    if std::env::var_os("BENCH_QUANT_BREAKDOWN").is_some() {
        if let Some(q4) = quantized(&python, &base, 4, 64) {
            breakdown(&q4);
        }
        return;
    }
    let prompt = corpus_prompt(1300);
    let bandwidth = read_bandwidth();
    println!(
        "read bandwidth: {:.1} GB/s (1 GiB summed on all cores, best of 5)\n",
        bandwidth / 1e9
    );
    println!("~120M gemma4-shaped model quantized by mlx_lm convert, ~300-token prompt, {TOKENS} new tokens; medians of {ROUNDS}\n");
    println!("| quantization | weights MB | ours prefill | mlx-lm prefill | ratio | ours decode | mlx-lm decode | ratio | roofline tok/s | decode / roofline |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut configs = vec![(4, 64), (8, 64)];
    if std::env::var_os("BENCH_QUANT_ALL").is_some() {
        configs.extend([(4, 32), (4, 128)]);
    }
    for (bits, group) in configs {
        let Some(model) = quantized(&python, &base, bits, group) else {
            continue;
        };
        let (mut op, mut od, mut pp, mut pd) = (vec![], vec![], vec![], vec![]);
        for _ in 0..ROUNDS {
            let (p, d) = ours_generate(&model, &prompt, TOKENS);
            op.push(p);
            od.push(d);
            let (p, d) = peer_generate(&python, &model, &prompt, TOKENS);
            pp.push(p);
            pd.push(d);
        }
        let (op, od, pp, pd) = (median(op), median(od), median(pp), median(pd));
        let bytes = weight_bytes(&model);
        let roof = bandwidth / bytes as f64;
        println!(
            "| {bits}-bit, group {group} | {:.0} | {op:.1} | {pp:.1} | {:.1}x | {od:.1} | {pd:.1} | {:.1}x | {roof:.0} | {:.0}% |",
            bytes as f64 / 1e6,
            op / pp,
            od / pd,
            100.0 * od / roof
        );
    }
}
