//! Speculative decoding never changes what the target produces: token for token under greedy
//! decoding for every drafter kind and depth, and the same distribution under sampling.

use mlx::Dtype;
use models::draft::ngram::Ngram;
use models::gemma4_assistant::QueryPosition;
use models::Drafter;
use models::{load_files, DtypeChoice, LoadedModel, ModelFiles};
use runner::depth::DepthController;
use runner::engine::{load_drafter, DraftSource, EngineConfig};
use runner::protocol::DoneReason;
use runner::{Ctx, Event, Generation, GenerationParams, RawLogprob};
use sample::{Options, Sampler};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn config(
    target: &str,
    draft: Option<&str>,
    depth: Option<usize>,
    position: QueryPosition,
) -> EngineConfig {
    EngineConfig {
        model: ModelFiles::dir(&fixture(target)).unwrap(),
        dtype: DtypeChoice::Fixed(Dtype::F32),
        ctx_size: None,
        parallel: 1,
        prefill_chunk: 512,
        cache_budget: None,
        memory_limit: None,
        cache_interval: 256,
        cache_disk: None,
        kv_cache: models::KvCacheType::default(),
        draft: draft.map(|d| match d {
            "ngram" => DraftSource::Ngram,
            d => DraftSource::Model(ModelFiles::dir(&fixture(d)).unwrap()),
        }),
        draft_depth: depth,
        max_draft_depth: 4,
        draft_position: position,
        cluster: None,
    }
}

struct Setup {
    target: LoadedModel,
    draft: Option<Box<dyn Drafter>>,
    controller: DepthController,
    /// Structured output for every generation: the vocabulary and the format.
    format: Option<(grammar::Vocabulary, grammar::Format)>,
}

fn setup(
    target: &str,
    draft: Option<&str>,
    depth: Option<usize>,
    position: QueryPosition,
) -> Setup {
    let cfg = config(target, draft, depth, position);
    let mut t = load_files(&cfg.model, cfg.dtype).unwrap();
    let d = load_drafter(&cfg, &mut t).unwrap();
    Setup {
        target: t,
        draft: d,
        controller: DepthController::new(cfg.max_draft_depth, cfg.draft_depth),
        format: None,
    }
}

/// Constrains `s`'s generations to `format`.
fn constrain(s: &mut Setup, format: grammar::Format) {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.target.tokenizer.path()).unwrap()).unwrap();
    let v = grammar::Vocabulary::new(
        &json,
        s.target.model.vocab_size(),
        s.target.tokenizer.eos_ids(),
    )
    .unwrap();
    s.format = Some((v, format));
}

/// Generated ids, the end reason, and (drafted, accepted).
fn generate(
    s: &mut Setup,
    prompt: &[u32],
    options: Options,
    n: usize,
) -> (Vec<u32>, DoneReason, (usize, usize)) {
    generate_in(s, prompt, options, Some(n), 512)
}

/// As [`generate`], in a context of `num_ctx` positions; `n: None` runs until EOS or the
/// context is full.
fn generate_in(
    s: &mut Setup,
    prompt: &[u32],
    options: Options,
    n: Option<usize>,
    num_ctx: usize,
) -> (Vec<u32>, DoneReason, (usize, usize)) {
    let r = run(s, prompt, options, n, num_ctx);
    (r.ids, r.reason, (r.drafted, r.accepted))
}

/// One generation's tokens, their logprobs, how it ended and what it drafted.
struct Run {
    ids: Vec<u32>,
    logprobs: Vec<Option<RawLogprob>>,
    reason: DoneReason,
    drafted: usize,
    accepted: usize,
}

fn run(s: &mut Setup, prompt: &[u32], options: Options, n: Option<usize>, num_ctx: usize) -> Run {
    let mut sampler = Sampler::new(num_ctx);
    let mut ctx = Ctx {
        model: &*s.target.model,
        sampler: &mut sampler,
        draft: s.draft.as_deref().map(|d| (d, &mut s.controller)),
        towers: None,
    };
    let params = GenerationParams {
        prompt: prompt.to_vec(),
        options,
        num_predict: n,
        num_ctx,
        prefill_chunk: 512,
        eos: s.target.tokenizer.eos_ids().to_vec(),
        checkpoints: vec![],
        snapshot_every: None,
        constraint: s
            .format
            .as_ref()
            .map(|(v, f)| Box::new(v.constrain(f).unwrap())),
        media: Vec::new(),
    };
    let mut g = Generation::new(&mut ctx, 0, params).unwrap();
    let (mut ids, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        match g.step(&mut ctx).unwrap() {
            None => continue,
            Some(Event::Token { id, logprob }) => {
                ids.push(id);
                logprobs.push(logprob);
            }
            Some(Event::Done { reason, stats }) => {
                let n = n.unwrap_or(usize::MAX);
                assert!(ids.len() <= n, "overshot num_predict: {} > {n}", ids.len());
                assert!(
                    prompt.len() + ids.len() <= num_ctx,
                    "overran the context: {} + {} > {num_ctx}",
                    prompt.len(),
                    ids.len()
                );
                return Run {
                    ids,
                    logprobs,
                    reason,
                    drafted: stats.draft_tokens,
                    accepted: stats.draft_accepted,
                };
            }
            Some(e) => panic!("{e:?}"),
        }
    }
}

fn prompts(s: &Setup) -> Vec<Vec<u32>> {
    [
        "The quick brown fox",
        "Hello, world! How are you today?",
        "Numbers: 0 1 2 3 4 5",
    ]
    .iter()
    .map(|p| s.target.tokenizer.encode(p).unwrap())
    .collect()
}

/// Greedy with drafting (depths 1..4 and adaptive) equals greedy without, far past the window.
fn greedy_unchanged(target: &str, draft: Option<&str>, position: QueryPosition) -> (usize, usize) {
    let mut plain = setup(target, None, Some(0), position);
    assert!(plain.draft.is_none());
    let cases: Vec<_> = prompts(&plain)
        .into_iter()
        .map(|p| {
            let want = generate(&mut plain, &p, Options::greedy(), 40);
            (p, want)
        })
        .collect();
    let mut totals = (0, 0);
    for depth in [Some(1), Some(2), Some(3), Some(4), None] {
        let mut spec = setup(target, draft, depth, position);
        assert!(spec.draft.is_some(), "{target}: no drafter");
        for (p, want) in &cases {
            let got = generate(&mut spec, p, Options::greedy(), 40);
            assert_eq!(got.0, want.0, "{target} + {draft:?} at depth {depth:?}");
            assert_eq!(got.1, want.1);
            totals.0 += got.2 .0;
            totals.1 += got.2 .1;
        }
    }
    assert!(totals.0 > 0, "{target}: nothing was drafted");
    totals
}

#[test]
fn glm_mtp_greedy_is_unchanged() {
    greedy_unchanged("glm4_moe_lite", None, QueryPosition::LastCommitted);
}

#[test]
fn gemma4_assistant_greedy_is_unchanged_in_both_positions() {
    greedy_unchanged(
        "gemma4_e2b_like",
        Some("gemma4_assistant"),
        QueryPosition::LastCommitted,
    );
    greedy_unchanged(
        "gemma4_e2b_like",
        Some("gemma4_assistant"),
        QueryPosition::Bonus,
    );
    greedy_unchanged(
        "gemma4_e2b_like",
        Some("gemma4_assistant_dense"),
        QueryPosition::LastCommitted,
    );
}

#[test]
fn separate_drafters_greedy_is_unchanged() {
    // A random drafter (rejections), the target itself (every draft accepted: bonus tokens and a
    // trailing drafter), and the target's 4-bit twin (mostly accepted, some rejected).
    greedy_unchanged(
        "gemma4_26b_a4b_like",
        Some("gemma4_31b_like"),
        QueryPosition::LastCommitted,
    );
    let (d, a) = greedy_unchanged(
        "gemma4_31b_like",
        Some("gemma4_31b_like"),
        QueryPosition::LastCommitted,
    );
    assert_eq!(
        d, a,
        "a model drafting for itself is always right under greedy"
    );
    let (d, a) = greedy_unchanged(
        "gemma4_26b_a4b_like",
        Some("gemma4_26b_a4b_like_q4"),
        QueryPosition::LastCommitted,
    );
    assert!(
        a > 0 && a < d,
        "the quantized twin should be partly right: {a} of {d}"
    );
    greedy_unchanged(
        "glm4_moe_lite",
        Some("glm4_moe_lite_q4"),
        QueryPosition::LastCommitted,
    );
}

#[test]
fn num_predict_is_never_overshot() {
    let mut s = setup(
        "gemma4_31b_like",
        Some("gemma4_31b_like"),
        Some(4),
        QueryPosition::LastCommitted,
    );
    let p = prompts(&s)[0].clone();
    for n in 1..12 {
        let (ids, reason, _) = generate(&mut s, &p, Options::greedy(), n);
        assert!(
            ids.len() == n || reason == DoneReason::Stop,
            "n = {n}: {} tokens",
            ids.len()
        );
    }
}

/// Drafting never emits a token past the context, whatever room is left for a round (a round
/// feeds its drafts and leaves one more token pending, which is emitted too).
#[test]
fn the_context_is_never_overrun() {
    let mut s = setup(
        "gemma4_31b_like",
        Some("gemma4_31b_like"),
        Some(4),
        QueryPosition::LastCommitted,
    );
    let p = prompts(&s)[0].clone();
    for room in 1..16 {
        let (ids, reason, (drafted, _)) =
            generate_in(&mut s, &p, Options::greedy(), None, p.len() + room);
        if reason != DoneReason::Stop {
            assert_eq!(ids.len(), room, "room {room}: the context is filled");
        }
        if room > 6 {
            assert!(drafted > 0, "room {room}: no round ran");
        }
    }
}

/// Two-sample chi-square homogeneity at p > 0.001 (Wilson–Hilferty critical value), bins with
/// fewer than 10 observations in total pooled.
fn same_distribution(a: &[u32], b: &[u32]) -> (bool, f64, f64) {
    let mut counts: std::collections::BTreeMap<u32, (f64, f64)> = Default::default();
    for &x in a {
        counts.entry(x).or_default().0 += 1.0;
    }
    for &x in b {
        counts.entry(x).or_default().1 += 1.0;
    }
    let (mut bins, mut pool) = (Vec::new(), (0.0, 0.0));
    for (_, (x, y)) in counts {
        if x + y < 10.0 {
            pool.0 += x;
            pool.1 += y;
        } else {
            bins.push((x, y));
        }
    }
    if pool.0 + pool.1 > 0.0 {
        bins.push(pool);
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let chi: f64 = bins
        .iter()
        .map(|&(x, y)| {
            let t = x + y;
            let (ea, eb) = (t * na / (na + nb), t * nb / (na + nb));
            (x - ea).powi(2) / ea + (y - eb).powi(2) / eb
        })
        .sum();
    let df = (bins.len() - 1).max(1) as f64;
    let z = 3.090_232;
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (chi <= crit, chi, crit)
}

/// Draws 300 samples of the first four tokens with and without drafting (the 4-bit twin
/// drafts, at depth 3: acceptance and residual resampling both happen often; different seeds on
/// the two sides, so the samples are independent), both under `format` if given, and checks
/// each position's distribution is the same.
fn sampling_matches_plain(format: Option<grammar::Format>) {
    let mut plain = setup(
        "gemma4_26b_a4b_like",
        None,
        Some(0),
        QueryPosition::LastCommitted,
    );
    let mut spec = setup(
        "gemma4_26b_a4b_like",
        Some("gemma4_26b_a4b_like_q4"),
        Some(3),
        QueryPosition::LastCommitted,
    );
    if let Some(f) = format {
        constrain(&mut plain, f.clone());
        constrain(&mut spec, f);
    }
    let p = prompts(&plain)[1].clone();
    same_samples(&mut plain, &mut spec, &p);
}

fn sampling(seed: i64) -> Options {
    sampling_top(6, seed)
}

fn sampling_top(top_k: i32, seed: i64) -> Options {
    Options {
        temperature: 1.0,
        top_k,
        top_p: 1.0,
        repeat_penalty: 1.0,
        seed,
        ..Options::default()
    }
}

/// 300 samples of the first four tokens after `p` from each setup (different seeds on the two
/// sides, so the samples are independent): each position's distribution is the same, and the
/// drafting side accepted enough drafts to exercise acceptance.
fn same_samples(plain: &mut Setup, spec: &mut Setup, p: &[u32]) {
    same_samples_with(plain, spec, p, sampling);
}

fn same_samples_with(
    plain: &mut Setup,
    spec: &mut Setup,
    p: &[u32],
    sampling: impl Fn(i64) -> Options,
) {
    let n = 300;
    let (mut a, mut b) = (vec![Vec::new(); 4], vec![Vec::new(); 4]);
    let mut accepted = 0;
    for seed in 0..n {
        let x = generate(plain, p, sampling(seed), 4).0;
        let (y, _, (_, acc)) = generate(spec, p, sampling(seed + 1_000_000), 4);
        accepted += acc;
        for i in 0..4 {
            if let (Some(&u), Some(&v)) = (x.get(i), y.get(i)) {
                a[i].push(u);
                b[i].push(v);
            }
        }
    }
    assert!(
        accepted > n as usize / 4,
        "too few drafts accepted ({accepted}) to exercise acceptance"
    );
    for i in 0..4 {
        let (ok, chi, crit) = same_distribution(&a[i], &b[i]);
        assert!(ok, "token {i}: chi² {chi:.1} > {crit:.1}");
    }
}

/// Prompt lookup's drafts are certain (a point mass): accepted with the target's probability,
/// a rejection resampled from the target without the draft. Over a context of the model's own
/// samples, lookups of single tokens find what it tends to write next, so both happen often.
#[test]
fn prompt_lookup_sampling_distribution_is_unchanged() {
    let target = "gemma4_26b_a4b_like";
    let mut plain = setup(target, None, Some(0), QueryPosition::LastCommitted);
    let mut spec = setup(target, Some("ngram"), Some(3), QueryPosition::LastCommitted);
    spec.draft = Some(Box::new(Ngram { min: 1, max: 4 }));
    let mut p = prompts(&plain)[1].clone();
    let top3 = |seed| sampling_top(3, seed);
    let context = generate(&mut plain, &p, top3(7), 300).0;
    p.extend(context);
    same_samples_with(&mut plain, &mut spec, &p, top3);
}

#[test]
fn sampling_distribution_is_unchanged() {
    sampling_matches_plain(None);
}

/// Under a grammar, speculative sampling still draws from the (masked) target distribution:
/// drafts from the masked drafter, verification against the masked target.
#[test]
fn sampling_distribution_is_unchanged_under_a_grammar() {
    // Text of lower-case letters and spaces: about a tenth of the fixture's vocabulary.
    sampling_matches_plain(Some(grammar::Format::Lark("start: /[a-z ]+/".into())));
}

#[test]
fn prompt_lookup_greedy_is_unchanged() {
    for target in ["gemma4_e2b_like", "glm4_moe_lite", "gemma4_26b_a4b_like"] {
        greedy_unchanged(target, Some("ngram"), QueryPosition::LastCommitted);
    }
}

/// Where every op gives a row the same bits beside any rows (the quantized products; GLM4-MoE-
/// Lite has no rotating window), a verify block's logprobs are one-row decode steps' bit for
/// bit (prompt lookup drafting; the 4-bit fixture has no MTP layer).
#[test]
fn verify_logprobs_are_decode_logprobs_bit_for_bit() {
    let options = Options {
        logprobs: true,
        top_logprobs: 4,
        ..Options::greedy()
    };
    let target = "glm4_moe_lite_q4";
    let mut plain = setup(target, None, Some(0), QueryPosition::LastCommitted);
    let mut spec = setup(target, Some("ngram"), None, QueryPosition::LastCommitted);
    let bits = |r: &Run| -> Vec<(u32, Vec<(u32, u32)>)> {
        r.logprobs
            .iter()
            .map(|l| {
                let l = l.as_ref().unwrap();
                let top = l.top.iter().map(|(t, v)| (*t, v.to_bits())).collect();
                (l.logprob.to_bits(), top)
            })
            .collect()
    };
    let mut drafted = 0;
    for p in prompts(&plain) {
        let want = run(&mut plain, &p, options.clone(), Some(24), 512);
        let got = run(&mut spec, &p, options.clone(), Some(24), 512);
        assert_eq!(got.ids, want.ids);
        drafted += got.drafted;
        assert_eq!(bits(&got), bits(&want));
    }
    assert!(drafted > 0, "nothing was drafted");
}

/// Logprobs come from the verify pass when drafting: every drafter kind reports, for every
/// token, the logprob and the top alternatives a run without drafting reports, within 1e-4,
/// and drafts while doing so.
#[test]
fn logprobs_with_drafting_equal_those_without() {
    let cases = [
        ("gemma4_e2b_like", "gemma4_assistant"),
        ("glm4_moe_lite", "mtp"),
        ("gemma4_26b_a4b_like", "gemma4_26b_a4b_like_q4"),
        ("gemma4_31b_like", "ngram"),
    ];
    let options = Options {
        logprobs: true,
        top_logprobs: 4,
        ..Options::greedy()
    };
    for (target, draft) in cases {
        let mut plain = setup(target, None, Some(0), QueryPosition::LastCommitted);
        let draft = (draft != "mtp").then_some(draft);
        let mut spec = setup(target, draft, None, QueryPosition::LastCommitted);
        let mut drafted = 0;
        for p in prompts(&plain) {
            let want = run(&mut plain, &p, options.clone(), Some(24), 512);
            let got = run(&mut spec, &p, options.clone(), Some(24), 512);
            assert_eq!(got.ids, want.ids, "{target} + {draft:?}");
            drafted += got.drafted;
            for (i, (a, b)) in got.logprobs.iter().zip(&want.logprobs).enumerate() {
                let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
                let what = format!("{target} + {draft:?}, token {i}");
                assert!(
                    (a.logprob - b.logprob).abs() < 1e-4,
                    "{what}: {a:?} vs {b:?}"
                );
                assert_eq!(a.top.len(), 4, "{what}");
                for (x, y) in a.top.iter().zip(&b.top) {
                    assert!((x.1 - y.1).abs() < 1e-4, "{what}: {a:?} vs {b:?}");
                    // Ties may order alike-valued alternatives either way.
                    assert!(
                        x.0 == y.0 || (x.1 - y.1).abs() < 1e-6,
                        "{what}: {a:?} vs {b:?}"
                    );
                }
            }
        }
        assert!(drafted > 0, "{target} + {draft:?}: nothing was drafted");
    }
}
