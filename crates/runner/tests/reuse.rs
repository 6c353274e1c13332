//! What a later request reuses of an earlier one's answer. Prompts are token ids handed to the
//! engine (the HTTP side only adds tokenization), so that a next turn can leave the previous
//! answer at any token, which text cannot do with a random model's bytes.

use mlx::Dtype;
use models::{DtypeChoice, ModelFiles, Tokenizer};
use runner::engine::{spawn, CompletionJob, DraftSource, EngineConfig, EngineHandle, Job};
use runner::protocol::Stats;
use runner::{Event, GenerationParams};
use sample::Options;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

struct Engine {
    handle: EngineHandle,
    tok: Tokenizer,
}

fn engine(target: &str, draft: Option<&str>, drafting: bool, interval: usize) -> Engine {
    let cfg = EngineConfig {
        model: ModelFiles::dir(&fixture(target)).unwrap(),
        dtype: DtypeChoice::Fixed(Dtype::F32),
        ctx_size: None,
        parallel: 1,
        prefill_chunk: 512,
        cache_budget: Some(1 << 30),
        memory_limit: None,
        cache_interval: interval,
        cache_disk: None,
        kv_cache: models::KvCacheType::default(),
        draft: draft.map(|d| DraftSource::Model(ModelFiles::dir(&fixture(d)).unwrap())),
        draft_depth: if drafting { None } else { Some(0) },
        max_draft_depth: 4,
        draft_position: models::gemma4_assistant::QueryPosition::LastCommitted,
        cluster: None,
    };
    let mut handle = spawn(cfg).unwrap();
    let loaded = std::mem::replace(&mut handle.loaded, tokio::sync::oneshot::channel().1);
    loaded.blocking_recv().unwrap().unwrap();
    Engine {
        handle,
        tok: Tokenizer::load(&fixture(target)).unwrap(),
    }
}

impl Engine {
    /// Greedy generation of up to `n` tokens; the emitted ids and the final statistics.
    fn complete(&self, prompt: &[u32], n: usize) -> (Vec<u32>, Stats) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let job = CompletionJob {
            params: GenerationParams {
                prompt: prompt.to_vec(),
                options: Options::greedy(),
                num_predict: Some(n),
                num_ctx: 512,
                prefill_chunk: 512,
                eos: self.tok.eos_ids().to_vec(),
                checkpoints: Vec::new(),
                snapshot_every: None,
                constraint: None,
                media: Vec::new(),
            },
            events: tx,
            cancel: Arc::new(AtomicBool::new(false)),
            received: Instant::now(),
        };
        self.handle.jobs.send(Job::Complete(Box::new(job))).unwrap();
        let mut ids = Vec::new();
        loop {
            match rx.blocking_recv().expect("the engine answered") {
                Event::Token { id, .. } => ids.push(id),
                Event::Done { stats, .. } => return (ids, stats),
                e => panic!("{e:?}"),
            }
        }
    }
}

impl Drop for Engine {
    /// Joins the engine thread: a test process that exits while that thread still frees MLX
    /// arrays races MLX's static destructors (heap corruption at exit).
    fn drop(&mut self) {
        let _ = self.handle.jobs.send(Job::Shutdown);
        let thread = std::mem::replace(&mut self.handle.thread, std::thread::spawn(|| {}));
        let _ = thread.join();
    }
}

/// A first turn, then next turns that keep `keep` tokens of its answer and then go elsewhere;
/// returns (prompt length, [(divergence point, cached tokens)], cached tokens of an exact
/// continuation).
fn turns(e: &Engine, keeps: &[usize]) -> (usize, Vec<(usize, usize)>, usize) {
    let prompt = e
        .tok
        .encode("The quick brown fox jumps over the lazy dog.")
        .unwrap();
    let (answer, first) = e.complete(&prompt, 24);
    assert_eq!(first.cached_tokens, 0);
    assert!(answer.len() > *keeps.iter().max().unwrap(), "{answer:?}");
    // A token the answer does not continue with, for the point where the next turn leaves it.
    let other = |t: u32| (t + 1) % e.tok.vocab_size() as u32;
    let mut out = Vec::new();
    for &keep in keeps {
        let mut next = prompt.clone();
        next.extend_from_slice(&answer[..keep]);
        next.push(other(answer[keep]));
        next.extend(e.tok.encode(" and then?").unwrap());
        let (_, s) = e.complete(&next, 1);
        out.push((prompt.len() + keep, s.cached_tokens));
        // Bring the cache back to the first turn's state for the next case: the first turn
        // again (it is served from the cache, and stores the same sequence).
        e.complete(&prompt, 24);
    }
    let mut exact = prompt.clone();
    exact.extend_from_slice(&answer);
    exact.extend(e.tok.encode(" and then?").unwrap());
    let (_, s) = e.complete(&exact, 1);
    (prompt.len(), out, s.cached_tokens)
}

/// GLM keeps every position (MLA latents): a next turn reuses the previous answer up to where
/// it leaves it; with its MTP drafter, one position less (the MTP row of the last restored
/// position pairs it with the stored answer's next token, which the new turn does not share).
#[test]
fn glm_reuse_reaches_the_divergence_point_drafting_or_not() {
    let keeps = [1, 4, 9];
    let on = turns(&engine("glm4_moe_lite", None, true, 256), &keeps);
    let off = turns(&engine("glm4_moe_lite", None, false, 256), &keeps);
    for &(d, cached) in &off.1 {
        assert_eq!(cached, d, "not drafting: divergence at {d}");
    }
    for &(d, cached) in &on.1 {
        assert_eq!(cached + 1, d, "drafting: divergence at {d}");
    }
    // An exact continuation: everything the caches hold; the MTP layer's entry for the last
    // position needs the token after it, and the restore keeps one position less again.
    assert!(off.2 > on.1.last().unwrap().0, "{off:?}");
    assert!(on.2 + 2 >= off.2, "drafting kept {} of {}", on.2, off.2);
}

/// gemma4's sliding-window layers keep only their window, so they are snapshotted while
/// generating too, every `--cache-interval` positions: a next turn resumes at the last snapshot
/// at or before its divergence point, with the assistant drafting or not.
#[test]
fn gemma4_reuse_reaches_the_last_snapshot_before_the_divergence() {
    let keeps = [3, 6, 10];
    for (draft, drafting) in [(None, false), (Some("gemma4_assistant"), true)] {
        for interval in [1, 4] {
            let e = engine("gemma4_e2b_like", draft, drafting, interval);
            let (prompt_len, runs, _) = turns(&e, &keeps);
            assert!(
                runs.iter().any(|&(_, cached)| cached > prompt_len),
                "{draft:?}/{interval}: nothing of the answer was reused: {runs:?}"
            );
            for (d, cached) in runs {
                // Without drafting every position is fed one at a time, so each multiple of
                // the interval holds a snapshot; a speculative round can step over one, and
                // then the snapshot is taken at the first position past it.
                let want = d / interval * interval;
                if drafting {
                    assert!(
                        cached <= d && cached + 2 * interval + 4 > d,
                        "{cached} for {d}"
                    );
                } else {
                    assert_eq!(cached, want, "interval {interval}: divergence at {d}");
                }
            }
        }
    }
}
