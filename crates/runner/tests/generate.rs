//! The generation pipeline against the references' greedy decoding, and its limits.

use mlx::{Array, Dtype, Ix};
use models::{load, DtypeChoice, LoadedModel};
use runner::protocol::DoneReason;
use runner::{Ctx, Event, Generation, GenerationParams};
use sample::{Options, Sampler};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn model(name: &str) -> LoadedModel {
    load(&fixture(name), DtypeChoice::Fixed(Dtype::F32)).unwrap()
}

fn golden(name: &str, key: &str) -> Array {
    mlx::io::load_safetensors(fixture(name).join("golden.safetensors"))
        .unwrap()
        .arrays
        .remove(key)
        .unwrap()
}

fn params(prompt: Vec<u32>, n: Option<usize>) -> GenerationParams {
    GenerationParams {
        prompt,
        options: Options::greedy(),
        num_predict: n,
        num_ctx: 512,
        stop: vec![],
        prefill_chunk: 512,
    }
}

/// Runs to the end; returns the generated ids, the full text and the final event.
fn run(m: &LoadedModel, p: GenerationParams) -> (Vec<u32>, String, DoneReason) {
    let mut sampler = Sampler::new(p.num_ctx);
    let mut ctx = Ctx {
        model: &*m.model,
        tokenizer: &m.tokenizer,
        sampler: &mut sampler,
    };
    let mut g = Generation::start(&mut ctx, 7, p).unwrap();
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match g.step(&mut ctx).unwrap().unwrap() {
            Event::Token { id, text: t, .. } => {
                ids.push(id);
                text.push_str(&t);
            }
            Event::Done {
                reason,
                text: t,
                stats,
            } => {
                text.push_str(&t);
                // EOS counts as an evaluated token but is not emitted.
                assert!(stats.eval_count == ids.len() || stats.eval_count == ids.len() + 1);
                assert!(!ctx.sampler.contains(7), "the slot is released at the end");
                return (ids, text, reason);
            }
        }
    }
}

fn greedy_matches_reference(name: &str) {
    let m = model(name);
    let prompt: Vec<u32> = golden(name, "input_ids")
        .to_vec::<i32>()
        .unwrap()
        .iter()
        .map(|&t| t as u32)
        .collect();
    let want: Vec<u32> = golden(name, "greedy_continuation")
        .to_vec::<i32>()
        .unwrap()
        .iter()
        .map(|&t| t as u32)
        .collect();
    let eos = m.tokenizer.eos_ids().to_vec();
    for chunk in [512, 5] {
        let mut p = params(prompt.clone(), Some(want.len()));
        p.prefill_chunk = chunk;
        let mut sampler = Sampler::new(512);
        let mut ctx = Ctx {
            model: &*m.model,
            tokenizer: &m.tokenizer,
            sampler: &mut sampler,
        };
        let mut g = Generation::start(&mut ctx, 0, p).unwrap();
        let mut got = Vec::new();
        while let Some(e) = g.step(&mut ctx).unwrap() {
            match e {
                Event::Token { id, .. } => got.push(id),
                Event::Done { reason, .. } => {
                    // The reference stops at EOS and includes it.
                    if reason == DoneReason::Stop {
                        got.push(*want.last().unwrap());
                        assert!(eos.contains(want.last().unwrap()));
                    }
                }
            }
        }
        assert_eq!(got, want, "{name} (prefill chunk {chunk})");
    }
}

#[test]
fn gemma4_e2b_like_greedy() {
    greedy_matches_reference("gemma4_e2b_like");
}

#[test]
fn gemma4_31b_like_greedy() {
    greedy_matches_reference("gemma4_31b_like");
}

#[test]
fn gemma4_26b_a4b_like_greedy() {
    greedy_matches_reference("gemma4_26b_a4b_like");
}

#[test]
fn glm4_moe_lite_greedy() {
    greedy_matches_reference("glm4_moe_lite");
}

#[test]
fn glm4_moe_lite_grouped_greedy() {
    greedy_matches_reference("glm4_moe_lite_grouped");
}

#[test]
fn quantized_greedy_matches_mlx_lm() {
    greedy_matches_reference("gemma4_26b_a4b_like_q4");
    greedy_matches_reference("glm4_moe_lite_q4");
}

#[test]
fn first_logprobs_match_the_reference_log_softmax() {
    let name = "gemma4_31b_like";
    let m = model(name);
    let prompt: Vec<u32> = golden(name, "input_ids")
        .to_vec::<i32>()
        .unwrap()
        .iter()
        .map(|&t| t as u32)
        .collect();
    let logits = golden(name, "logits");
    let last = logits
        .index(&[Ix::At(-1)])
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mx = last.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = mx
        + last
            .iter()
            .map(|&x| (f64::from(x) - mx).exp())
            .sum::<f64>()
            .ln();
    let mut p = params(prompt, Some(1));
    p.options = Options {
        logprobs: true,
        top_logprobs: 3,
        ..Options::greedy()
    };
    let mut sampler = Sampler::new(512);
    let mut ctx = Ctx {
        model: &*m.model,
        tokenizer: &m.tokenizer,
        sampler: &mut sampler,
    };
    let mut g = Generation::start(&mut ctx, 0, p).unwrap();
    let Some(Event::Token {
        id,
        logprob: Some(lp),
        ..
    }) = g.step(&mut ctx).unwrap()
    else {
        panic!("no token")
    };
    assert!((f64::from(lp.logprob) - (f64::from(last[id as usize]) - lse)).abs() < 1e-4);
    assert_eq!(lp.top_logprobs.len(), 3);
    assert_eq!(
        lp.top_logprobs[0].token,
        m.tokenizer.token_text(id),
        "greedy picks the top entry"
    );
    assert!(
        lp.top_logprobs
            .windows(2)
            .all(|w| w[0].logprob >= w[1].logprob),
        "ranked by probability"
    );
}

#[test]
fn limits_and_stops() {
    let m = model("gemma4_31b_like");
    let prompt = m.tokenizer.encode("The quick brown fox").unwrap();
    // num_predict.
    let (ids, _, reason) = run(&m, params(prompt.clone(), Some(3)));
    assert!(ids.len() <= 3);
    if ids.len() == 3 {
        assert_eq!(reason, DoneReason::Length);
    }
    // Context limit: the prompt plus generated tokens never exceed num_ctx.
    let mut p = params(prompt.clone(), None);
    p.num_ctx = prompt.len() + 4;
    let (ids, _, reason) = run(&m, p);
    assert!(ids.len() <= 4, "{}", ids.len());
    if ids.len() == 4 {
        assert_eq!(reason, DoneReason::Length);
    }
    // A prompt that does not fit is refused up front.
    let mut p = params(prompt.clone(), Some(1));
    p.num_ctx = prompt.len();
    let mut sampler = Sampler::new(512);
    let mut ctx = Ctx {
        model: &*m.model,
        tokenizer: &m.tokenizer,
        sampler: &mut sampler,
    };
    let e = Generation::start(&mut ctx, 0, p).err().unwrap().to_string();
    assert!(e.contains("does not fit the context"), "{e}");
    assert!(!sampler.contains(0));

    // Stop strings: take the unconstrained output and stop on a piece of it, split anywhere.
    let (_, full, _) = run(&m, params(prompt.clone(), Some(12)));
    let chars: Vec<char> = full.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[2..4].iter().collect();
        let mut p = params(prompt.clone(), Some(12));
        p.stop = vec![stop.clone()];
        let (_, text, reason) = run(&m, p);
        assert_eq!(reason, DoneReason::Stop);
        assert!(!text.contains(&stop), "{text:?} contains {stop:?}");
        assert_eq!(text, full[..full.find(&stop).unwrap()]);
    }
}
