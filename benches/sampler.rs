//! Sampler cost: `cargo bench --bench sampler`.
//!
//! Microseconds per sampled token at vocab 262144 (gemma4's), B = 1 and B = 8, for greedy,
//! top_k 40 + top_p 0.9, and the same with penalties on; fused against per-slot, and one sort
//! serving top-k and top-p against separate transforms. Each timing includes evaluating the
//! tokens. Medians over several runs; nothing here asserts a time.

mod common;
use common::median;

use mlx::Dtype;
use sample::{Options, Sampler, Strategy};
use std::time::Instant;

const V: i32 = 262_144;

fn time(b: i32, opts: &Options, fused: bool, strategy: Strategy) -> mlx::Result<f64> {
    let mut s = Sampler::new(4096);
    s.set_allow_fused(fused);
    s.set_strategy(strategy);
    let prompt: Vec<u32> = (0..64).map(|i| (i * 977) % V as u32).collect();
    for slot in 0..b as usize {
        s.add(
            slot,
            &Options {
                seed: slot as i64,
                ..opts.clone()
            },
            &prompt,
        )
        .map_err(|e| mlx::Error::Invalid(e.to_string()))?;
    }
    let slots: Vec<usize> = (0..b as usize).collect();
    let logits = mlx::random::normal(&[b, V], Dtype::F32, 0.0, 3.0, Some(&mlx::random::key(0)?))?;
    logits.eval()?;
    let mut t = Vec::new();
    for i in 0..12 {
        let start = Instant::now();
        let out = s
            .sample(&slots, &logits)
            .map_err(|e| mlx::Error::Invalid(e.to_string()))?;
        out.tokens.eval()?;
        if i >= 2 {
            t.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(median(t) / f64::from(b))
}

fn main() -> mlx::Result<()> {
    let greedy = Options::greedy();
    let trunc = Options {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        repeat_penalty: 1.0,
        ..Options::default()
    };
    let pen = Options {
        repeat_penalty: 1.1,
        presence_penalty: 0.2,
        frequency_penalty: 0.2,
        repeat_last_n: 64,
        ..trunc.clone()
    };
    let dense_p = Options {
        top_k: 0,
        ..trunc.clone()
    };
    println!("vocab {V}; µs per sampled token (median of 10)\n");
    println!("| options | B | fused | per-slot |");
    println!("|---|---|---|---|");
    for (name, o) in [
        ("greedy", &greedy),
        ("top_k 40 + top_p 0.9", &trunc),
        ("+ penalties (64)", &pen),
    ] {
        for b in [1, 8] {
            let f = time(b, o, true, Strategy::OneSort)?;
            let p = time(b, o, false, Strategy::OneSort)?;
            println!("| {name} | {b} | {f:.0} | {p:.0} |");
        }
    }
    println!("\n| top-k + top-p | B | one sort (partition K, sort K) | separate (mask, sort V) |");
    println!("|---|---|---|---|");
    for b in [1, 8] {
        let one = time(b, &trunc, true, Strategy::OneSort)?;
        let sep = time(b, &trunc, true, Strategy::Separate)?;
        println!("| top_k 40 + top_p 0.9 | {b} | {one:.0} | {sep:.0} |");
    }
    let d = time(1, &dense_p, true, Strategy::OneSort)?;
    println!("\n(top_p 0.9 alone, which must sort the whole vocabulary: {d:.0} µs at B = 1)");
    Ok(())
}
