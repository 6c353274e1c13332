//! The generation pipeline against the references' greedy decoding, and its limits.

use mlx::{Array, Dtype, Ix};
use models::{load, DtypeChoice, LoadedModel};
use runner::protocol::DoneReason;
use runner::text::TextStream;
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

fn params(prompt: Vec<u32>, n: Option<usize>, eos: &[u32]) -> GenerationParams {
    GenerationParams {
        prompt,
        options: Options::greedy(),
        num_predict: n,
        num_ctx: 512,
        prefill_chunk: 512,
        eos: eos.to_vec(),
        checkpoints: Vec::new(),
        snapshot_every: None,
        constraint: None,
        media: Vec::new(),
    }
}

/// Runs to the end through the text layer; returns the generated ids, the text and the reason.
fn run(m: &LoadedModel, p: GenerationParams, stops: &[String]) -> (Vec<u32>, String, DoneReason) {
    let mut sampler = Sampler::new(p.num_ctx);
    let mut ctx = Ctx::new(&*m.model, &mut sampler);
    let mut g = Generation::new(&mut ctx, 7, p).unwrap();
    let mut stream = TextStream::new(stops);
    let (mut ids, mut text) = (Vec::new(), String::new());
    loop {
        match g.step(&mut ctx).unwrap() {
            None => continue,
            Some(Event::Token { id, logprob }) => {
                ids.push(id);
                let piece = stream.push(&m.tokenizer, id, logprob.as_ref()).unwrap();
                text.push_str(&piece.text);
                if piece.stopped {
                    g.cancel(&mut ctx);
                    assert!(!ctx.sampler.contains(7));
                    return (ids, text, DoneReason::Stop);
                }
            }
            Some(Event::Done { reason, stats }) => {
                text.push_str(&stream.finish(&m.tokenizer).unwrap().text);
                // EOS counts as an evaluated token but is not emitted.
                assert!(stats.eval_count == ids.len() || stats.eval_count == ids.len() + 1);
                assert!(!ctx.sampler.contains(7), "the slot is released at the end");
                return (ids, text, reason);
            }
            Some(e) => panic!("{e:?}"),
        }
    }
}

fn greedy_matches_reference(name: &str) {
    let m = model(name);
    let ids = |k: &str| -> Vec<u32> {
        golden(name, k)
            .to_vec::<i32>()
            .unwrap()
            .iter()
            .map(|&t| t as u32)
            .collect()
    };
    let (prompt, want) = (ids("input_ids"), ids("greedy_continuation"));
    let eos = m.tokenizer.eos_ids().to_vec();
    for chunk in [512, 5] {
        let mut p = params(prompt.clone(), Some(want.len()), &eos);
        p.prefill_chunk = chunk;
        let (mut got, _, reason) = run(&m, p, &[]);
        // The reference stops at EOS and includes it.
        if reason == DoneReason::Stop {
            assert!(eos.contains(want.last().unwrap()));
            got.push(*want.last().unwrap());
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
    greedy_matches_reference("glm4_moe_lite_q3");
    greedy_matches_reference("gemma4_26b_a4b_like_mixed");
    greedy_matches_reference("gemma4_26b_a4b_like_mxfp4");
    greedy_matches_reference("glm4_moe_lite_nvfp4");
    greedy_matches_reference("gemma4_26b_a4b_like_mxfp8");
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
    let mut p = params(prompt, Some(1), &[]);
    p.options = Options {
        logprobs: true,
        top_logprobs: 3,
        ..Options::greedy()
    };
    let mut sampler = Sampler::new(512);
    let mut ctx = Ctx::new(&*m.model, &mut sampler);
    let mut g = Generation::new(&mut ctx, 0, p).unwrap();
    let ev = loop {
        if let Some(e) = g.step(&mut ctx).unwrap() {
            break e;
        }
    };
    let Event::Token {
        id,
        logprob: Some(raw),
    } = ev
    else {
        panic!("no token")
    };
    // The entry travels with the token's text: from the push, or from the end of the stream
    // when the text was still an incomplete character.
    let mut stream = TextStream::new(&[]);
    let mut entries = stream.push(&m.tokenizer, id, Some(&raw)).unwrap().logprobs;
    entries.extend(stream.finish(&m.tokenizer).unwrap().logprobs);
    assert_eq!(entries.len(), 1, "one entry for one token with text");
    let lp = entries.pop().unwrap();
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
    let eos = m.tokenizer.eos_ids().to_vec();
    let params = |p: Vec<u32>, n: Option<usize>| params(p, n, &eos);
    // num_predict.
    let (ids, _, reason) = run(&m, params(prompt.clone(), Some(3)), &[]);
    assert!(ids.len() <= 3);
    if ids.len() == 3 {
        assert_eq!(reason, DoneReason::Length);
    }
    // Context limit: the prompt plus generated tokens never exceed num_ctx.
    let mut p = params(prompt.clone(), None);
    p.num_ctx = prompt.len() + 4;
    let (ids, _, reason) = run(&m, p, &[]);
    assert!(ids.len() <= 4, "{}", ids.len());
    if ids.len() == 4 {
        assert_eq!(reason, DoneReason::Length);
    }
    // A prompt that does not fit is refused up front.
    let mut p = params(prompt.clone(), Some(1));
    p.num_ctx = prompt.len();
    let mut sampler = Sampler::new(512);
    let mut ctx = Ctx::new(&*m.model, &mut sampler);
    let e = Generation::new(&mut ctx, 0, p).err().unwrap().to_string();
    assert!(e.contains("does not fit the context"), "{e}");
    assert!(!sampler.contains(0));

    // Stop strings: take the unconstrained output and stop on a piece of it.
    let (_, full, _) = run(&m, params(prompt.clone(), Some(12)), &[]);
    let chars: Vec<char> = full.chars().collect();
    assert!(
        chars.len() >= 4,
        "the fixture model writes at least 4 characters here: {full:?}"
    );
    let stop: String = chars[2..4].iter().collect();
    let (_, text, reason) = run(
        &m,
        params(prompt.clone(), Some(12)),
        std::slice::from_ref(&stop),
    );
    assert_eq!(reason, DoneReason::Stop);
    assert!(!text.contains(&stop), "{text:?} contains {stop:?}");
    assert_eq!(text, full[..full.find(&stop).unwrap()]);
}
