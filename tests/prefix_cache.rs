//! The prefix cache through the real runner: hits on multi-turn conversations, interleaved
//! conversations and branches, outputs identical to a cold runner, and a bounded budget.

mod common;
use common::turn::{ask_with, metric, same, Turn};
use common::*;

fn ask(r: &Runner, prompt: &str, n: i64) -> Turn {
    ask_with(r, prompt, n, true)
}

/// Each turn's prompt extends the last prompt and its answer; every turn after the first hits,
/// and gives exactly what a runner without a cache gives.
fn multi_turn(model: &str) {
    let warm = Runner::start(model, &[]);
    let cold = Runner::start(model, &["--cache-budget", "0"]);
    let mut prompt = String::from("You are a helpful assistant. Tell me a story about a fox.");
    for turn in 0..4 {
        let w = ask(&warm, &prompt, 12);
        let c = ask(&cold, &prompt, 12);
        same(&w, &c, &format!("{model} turn {turn}"));
        assert_eq!(c.cached, 0, "the cold runner caches nothing");
        if turn > 0 {
            assert!(w.cached > 0, "{model} turn {turn}: no cache hit");
            // Everything up to (about) the previous prompt is reused, well past the window of 8.
            assert!(
                w.cached >= 16,
                "{model} turn {turn}: only {} cached of {}",
                w.cached,
                w.prompt_tokens
            );
        }
        prompt = format!("{prompt}{} Please go on, turn {turn}.", w.text);
    }
    assert!(metric(&warm, "mlx_runner_cache_hits_total") >= 3.0);
    assert!(metric(&warm, "mlx_runner_cached_tokens_total") > 0.0);
    assert!(metric(&warm, "mlx_runner_prefix_cache_bytes") > 0.0);
}

#[test]
fn gemma4_multi_turn_hits_and_matches_cold() {
    multi_turn("gemma4_e2b_like");
}

#[test]
fn glm_multi_turn_hits_and_matches_cold() {
    multi_turn("glm4_moe_lite");
}

#[test]
fn interleaved_conversations_keep_their_entries() {
    let r = Runner::start("gemma4_31b_like", &[]);
    let a1 = "Conversation A: the weather in Paris is mild in spring and";
    let b1 = "Conversation B: a completely different topic about numbers 1 2 3 4 5";
    let ta = ask(&r, a1, 6);
    let tb = ask(&r, b1, 6);
    let a2 = format!("{a1}{} and then what?", ta.text);
    let b2 = format!("{b1}{} and then what?", tb.text);
    let ta2 = ask(&r, &a2, 6);
    let tb2 = ask(&r, &b2, 6);
    assert!(
        ta2.cached >= ta.prompt_tokens - 1,
        "A resumed: {} of {}",
        ta2.cached,
        ta.prompt_tokens
    );
    assert!(
        tb2.cached >= tb.prompt_tokens - 1,
        "B resumed: {} of {}",
        tb2.cached,
        tb.prompt_tokens
    );
}

#[test]
fn branches_share_the_system_prompt() {
    // GLM restores to any position; gemma needs a sliding-window snapshot, which the second
    // branch leaves at the branch point for the third.
    for (model, extra) in [
        ("glm4_moe_lite", vec![]),
        ("gemma4_e2b_like", vec!["--cache-interval", "1000"]),
    ] {
        let r = Runner::start(model, &extra);
        let system = "System: you are terse and precise. Answer in one line. ";
        let t1 = ask(&r, &format!("{system}User: what is two plus two?"), 4);
        let t2 = ask(&r, &format!("{system}User: name a colour."), 4);
        let t3 = ask(&r, &format!("{system}User: and a number?"), 4);
        assert_eq!(t1.cached, 0);
        let tok = models::Tokenizer::load(&fixture(model)).unwrap();
        let a = tok.encode(&format!("{system}User: what")).unwrap();
        let b = tok.encode(&format!("{system}User: name")).unwrap();
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count() as u64;
        if model == "glm4_moe_lite" {
            // All of it but the last position, whose MTP row paired it with the first
            // branch's next token.
            assert_eq!(
                t2.cached,
                shared - 1,
                "{model}: the second branch reuses the shared prefix"
            );
        }
        assert!(
            t3.cached >= shared - 1,
            "{model}: third branch cached {} of a shared {shared}",
            t3.cached
        );
        let cold = Runner::start(model, &["--cache-budget", "0"]);
        same(
            &t3,
            &ask(&cold, &format!("{system}User: and a number?"), 4),
            model,
        );
    }
}

#[test]
fn a_small_budget_bounds_memory_and_keeps_outputs_right() {
    // One document's caches (about 130 positions of four latent layers, the MTP layer's
    // included: 83 KB) fit, two do not.
    let budget = 96 * 1024;
    let r = Runner::start("glm4_moe_lite", &["--cache-budget", &budget.to_string()]);
    let cold = Runner::start("glm4_moe_lite", &["--cache-budget", "0"]);
    for i in 0..6 {
        let p = format!("Document {i}: {}", "lorem ipsum dolor sit amet ".repeat(6));
        let w = ask(&r, &p, 8);
        same(&w, &ask(&cold, &p, 8), &format!("document {i}"));
        let held = metric(&r, "mlx_runner_prefix_cache_bytes");
        assert!(
            held <= budget as f64,
            "prefix cache holds {held} bytes, over the budget {budget}"
        );
    }
    // Repeats still hit when they fit.
    let p = format!("Document 5: {}", "lorem ipsum dolor sit amet ".repeat(6));
    assert!(ask(&r, &p, 8).cached > 0);
}

/// A request for logprobs drafts too (the verify pass gives the target's distribution at every
/// drafted position), so with a drafter of its own caches (GLM's MTP layer) it stores and
/// reuses prefixes with the drafter's caches like any other request: each kind reuses the
/// other's, and gives what a cold runner gives, logprobs within 1e-4.
#[test]
fn logprob_requests_draft_and_share_prefixes_with_the_others() {
    let r = Runner::start("glm4_moe_lite", &[]);
    let cold = Runner::start("glm4_moe_lite", &["--cache-budget", "0"]);
    let p = "The harbor bells rang twice for the travellers who came over the hills at dusk";
    let drafted = ask_with(&r, p, 8, false);
    assert!(drafted.draft_tokens > 0, "the first request drafts");
    let q = format!("{p} and then");
    let with_logprobs = ask_with(&r, &q, 8, true);
    assert!(with_logprobs.draft_tokens > 0, "a logprobs request drafts");
    assert_eq!(with_logprobs.logprobs.len(), 8);
    // The first prompt's positions but its last two (the last may join the next word; the
    // MTP row before it paired it with the first answer's next token).
    assert!(
        with_logprobs.cached + 2 >= drafted.prompt_tokens,
        "{} of {} cached",
        with_logprobs.cached,
        drafted.prompt_tokens
    );
    same(
        &with_logprobs,
        &ask_with(&cold, &q, 8, true),
        "with logprobs",
    );
    let again = format!("{q} once more");
    let drafted_again = ask_with(&r, &again, 8, false);
    assert!(
        drafted_again.cached + 2 >= with_logprobs.prompt_tokens,
        "the logprobs request's prefix serves a plain one: {} of {} cached",
        drafted_again.cached,
        with_logprobs.prompt_tokens
    );
    assert_eq!(drafted_again.text, ask_with(&cold, &again, 8, false).text);
}
