//! The sampler against a plain f64 reference written here, statistical tests of what it draws,
//! and the slot, seed, ring and speculation contracts.

use mlx::{Array, Dtype};
use sample::{Distribution, Options, Sampler, Strategy};

// ---------------------------------------------------------------------------------------------
// An independent f64 reference of the whole pipeline.
// ---------------------------------------------------------------------------------------------

fn reference(logits: &[f32], history: &[u32], o: &Options) -> Vec<f64> {
    let mut x: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
    let window: Vec<u32> = if o.repeat_last_n > 0 {
        history[history.len().saturating_sub(o.repeat_last_n as usize)..].to_vec()
    } else {
        vec![]
    };
    let mut distinct = window.clone();
    distinct.sort();
    distinct.dedup();
    for &t in &distinct {
        let v = &mut x[t as usize];
        let rp = f64::from(o.repeat_penalty);
        *v = if *v < 0.0 { *v * rp } else { *v / rp };
        *v -= f64::from(o.presence_penalty);
    }
    for &t in &window {
        x[t as usize] -= f64::from(o.frequency_penalty);
    }
    let n = x.len();
    if o.temperature <= 0.0 {
        let best = (0..n).max_by(|&a, &b| x[a].total_cmp(&x[b])).unwrap();
        let mut p = vec![0.0; n];
        p[best] = 1.0;
        return p;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
    let keep = if o.top_k > 0 && (o.top_k as usize) < n {
        o.top_k as usize
    } else {
        n
    };
    let cand = &order[..keep];
    let m = cand.iter().map(|&i| x[i]).fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = cand
        .iter()
        .map(|&i| ((x[i] - m) / f64::from(o.temperature)).exp())
        .collect();
    let z: f64 = e.iter().sum();
    let mut p: Vec<f64> = e.iter().map(|v| v / z).collect();
    if o.top_p > 0.0 && o.top_p < 1.0 {
        let mut before = 0.0;
        for v in p.iter_mut() {
            let keep = before < f64::from(o.top_p);
            before += *v;
            if !keep {
                *v = 0.0;
            }
        }
    }
    if o.min_p > 0.0 {
        let floor = p.iter().cloned().fold(0.0, f64::max) * f64::from(o.min_p);
        for v in p.iter_mut() {
            if *v < floor {
                *v = 0.0;
            }
        }
    }
    let z: f64 = p.iter().sum();
    let mut out = vec![0.0; n];
    for (j, &i) in cand.iter().enumerate() {
        out[i] = p[j] / z;
    }
    out
}

fn pseudo_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f64 / (1u64 << 24) as f64 * 6.0 - 3.0) as f32
        })
        .collect()
}

fn row(logits: &[f32]) -> Array {
    Array::from_slice(logits, &[1, logits.len() as i32]).unwrap()
}

fn dense(d: &Distribution) -> Vec<f32> {
    d.dense().unwrap().to_vec::<f32>().unwrap()
}

fn mixes() -> Vec<Options> {
    let base = Options {
        seed: 1,
        ..Options::default()
    };
    vec![
        Options {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            repeat_penalty: 1.0,
            ..base.clone()
        },
        Options {
            temperature: 1.0,
            top_k: 8,
            top_p: 1.0,
            repeat_penalty: 1.0,
            ..base.clone()
        },
        Options {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            repeat_penalty: 1.0,
            ..base.clone()
        },
        Options {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.1,
            repeat_penalty: 1.0,
            ..base.clone()
        },
        Options {
            temperature: 0.7,
            top_k: 8,
            top_p: 0.9,
            min_p: 0.1,
            repeat_last_n: 6,
            repeat_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.3,
            ..base.clone()
        },
        Options {
            temperature: 0.0,
            repeat_last_n: 6,
            repeat_penalty: 1.8,
            frequency_penalty: 0.5,
            ..base.clone()
        },
    ]
}

const HISTORY: [u32; 9] = [3, 5, 5, 9, 1, 3, 3, 12, 5];

#[test]
fn each_option_mix_matches_the_reference() {
    let logits = pseudo_logits(32, 7);
    for (i, o) in mixes().into_iter().enumerate() {
        for strategy in [Strategy::OneSort, Strategy::Separate] {
            let mut s = Sampler::new(4096);
            s.set_strategy(strategy);
            s.add(0, &o, &HISTORY).unwrap();
            let got = dense(&s.distribution(0, &row(&logits), None).unwrap());
            let want = reference(&logits, &HISTORY, &o);
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (f64::from(*g) - w).abs() < 1e-5,
                    "mix {i} {strategy:?} token {j}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn greedy_is_the_argmax_of_the_penalised_logits() {
    let logits = pseudo_logits(64, 3);
    let o = Options {
        temperature: 0.0,
        repeat_last_n: 4,
        repeat_penalty: 2.0,
        presence_penalty: 1.5,
        ..Options::default()
    };
    let mut s = Sampler::new(1024);
    let best = (0..64)
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap() as u32;
    s.add(0, &o, &[best]).unwrap();
    let tok = s
        .sample(&[0], &row(&logits))
        .unwrap()
        .tokens
        .to_vec::<i32>()
        .unwrap()[0] as u32;
    let want = reference(&logits, &[best], &o)
        .iter()
        .position(|&p| p == 1.0)
        .unwrap() as u32;
    assert_eq!(tok, want);
    assert_ne!(tok, best, "the penalty moved the argmax in this case");
}

/// Chi-square goodness of fit at p > 0.001 (Wilson–Hilferty critical value), pooling bins with
/// expected counts under 5.
fn chi_square_ok(counts: &[usize], probs: &[f64], n: usize) -> (bool, f64, f64) {
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let (mut eo, mut ee) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            assert_eq!(c, 0, "drew a token of probability 0");
            continue;
        }
        let e = p * n as f64;
        if e < 5.0 {
            eo += c as f64;
            ee += e;
        } else {
            bins.push((c as f64, e));
        }
    }
    if ee > 0.0 {
        bins.push((eo, ee));
    }
    let chi: f64 = bins.iter().map(|(o, e)| (o - e).powi(2) / e).sum();
    let df = (bins.len() - 1).max(1) as f64;
    let z = 3.090_232; // upper 0.001 quantile of N(0, 1)
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (chi <= crit, chi, crit)
}

#[test]
fn sampled_frequencies_match_the_distribution() {
    let v = 24;
    let logits = pseudo_logits(v, 11);
    let n = 3000usize;
    for (i, o) in mixes()
        .into_iter()
        .enumerate()
        .filter(|(_, o)| o.temperature > 0.0)
    {
        let mut s = Sampler::new(4096);
        let slots: Vec<usize> = (0..n).collect();
        for &id in &slots {
            s.add(
                id,
                &Options {
                    seed: id as i64,
                    ..o.clone()
                },
                &HISTORY,
            )
            .unwrap();
        }
        let batch = Array::from_slice(&logits, &[1, v as i32])
            .unwrap()
            .broadcast_to(&[n as i32, v as i32])
            .unwrap();
        let toks = s
            .sample(&slots, &batch)
            .unwrap()
            .tokens
            .to_vec::<i32>()
            .unwrap();
        let mut counts = vec![0usize; v];
        for t in toks {
            counts[t as usize] += 1;
        }
        let want = reference(&logits, &HISTORY, &o);
        let (ok, chi, crit) = chi_square_ok(&counts, &want, n);
        assert!(
            ok,
            "mix {i}: chi² {chi:.1} > {crit:.1}\ncounts {counts:?}\nprobs {want:?}"
        );
    }
}

#[test]
fn fused_and_per_slot_paths_agree() {
    let v = 40;
    let o = mixes()[4].clone();
    let other = Options {
        temperature: 1.3,
        top_k: 3,
        seed: 99,
        ..Options::default()
    };
    let logits: Vec<f32> = (0..3).flat_map(|i| pseudo_logits(v, 20 + i)).collect();
    let mut fused = Sampler::new(1024);
    let mut mixed = Sampler::new(1024);
    for s in [&mut fused, &mut mixed] {
        s.add(
            0,
            &Options {
                seed: 5,
                ..o.clone()
            },
            &HISTORY,
        )
        .unwrap();
        s.add(
            1,
            &Options {
                seed: 6,
                ..o.clone()
            },
            &[7, 7, 2],
        )
        .unwrap();
    }
    mixed.add(2, &other, &[]).unwrap();
    for step in 0..6 {
        let two = Array::from_slice(&logits[..2 * v], &[2, v as i32]).unwrap();
        let three = Array::from_slice(&logits, &[3, v as i32]).unwrap();
        let a = fused
            .sample(&[0, 1], &two)
            .unwrap()
            .tokens
            .to_vec::<i32>()
            .unwrap();
        let b = mixed
            .sample(&[0, 1, 2], &three)
            .unwrap()
            .tokens
            .to_vec::<i32>()
            .unwrap();
        assert_eq!(a[..], b[..2], "step {step}");
    }
    assert_eq!(fused.history(0).unwrap(), mixed.history(0).unwrap());
}

#[test]
fn seeded_draws_do_not_depend_on_the_batch() {
    let v = 50;
    let o = Options {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        repeat_penalty: 1.0,
        seed: 42,
        ..Options::default()
    };
    let logits = pseudo_logits(v, 5);
    let run = |company: usize| -> Vec<i32> {
        let mut s = Sampler::new(512);
        s.add(0, &o, &[]).unwrap();
        for c in 0..company {
            s.add(
                c + 1,
                &Options {
                    seed: -1,
                    temperature: 0.5,
                    ..o.clone()
                },
                &[],
            )
            .unwrap();
        }
        let ids: Vec<usize> = (0..=company).collect();
        let batch = Array::from_slice(&logits, &[1, v as i32])
            .unwrap()
            .broadcast_to(&[ids.len() as i32, v as i32])
            .unwrap();
        (0..8)
            .map(|_| {
                s.sample(&ids, &batch)
                    .unwrap()
                    .tokens
                    .to_vec::<i32>()
                    .unwrap()[0]
            })
            .collect()
    };
    let alone = run(0);
    assert_eq!(alone, run(3));
    assert_eq!(alone, run(7));
    // A different seed gives a different stream.
    let mut s = Sampler::new(512);
    s.add(
        0,
        &Options {
            seed: 43,
            ..o.clone()
        },
        &[],
    )
    .unwrap();
    let other: Vec<i32> = (0..8)
        .map(|_| {
            s.sample(&[0], &row(&logits))
                .unwrap()
                .tokens
                .to_vec::<i32>()
                .unwrap()[0]
        })
        .collect();
    assert_ne!(alone, other);
}

#[test]
fn history_ring_keeps_its_shape_and_wraps() {
    let o = Options {
        repeat_last_n: 4,
        repeat_penalty: 1.2,
        temperature: 0.0,
        ..Options::default()
    };
    let mut s = Sampler::new(512);
    s.add(0, &o, &[10, 11, 12, 13, 14, 15]).unwrap();
    let mut h = s.history(0).unwrap();
    h.sort();
    assert_eq!(
        h,
        vec![12, 13, 14, 15],
        "the last repeat_last_n prompt tokens"
    );
    let shape = s.pool_shape();
    // Greedy on a one-hot row: the token is known, so the ring contents are predictable.
    for t in [20, 21, 22, 23, 24] {
        let mut l = vec![0.0f32; 32];
        l[t] = 100.0;
        s.sample(&[0], &row(&l)).unwrap();
        assert_eq!(s.pool_shape(), shape, "the ring never changes shape");
    }
    let mut h = s.history(0).unwrap();
    h.sort();
    assert_eq!(h, vec![21, 22, 23, 24]);
    // A short prompt leaves empty entries, which penalise nothing.
    let mut s2 = Sampler::new(512);
    s2.add(0, &o, &[3]).unwrap();
    assert_eq!(
        s2.history(0).unwrap().iter().filter(|&&t| t == -1).count(),
        3
    );
}

#[test]
fn logprobs_match_a_reference_log_softmax() {
    let v = 30;
    let logits = pseudo_logits(v, 8);
    let o = Options {
        logprobs: true,
        top_logprobs: 5,
        temperature: 0.0,
        repeat_penalty: 3.0,
        repeat_last_n: 4,
        ..Options::default()
    };
    let mut s = Sampler::new(512);
    s.add(0, &o, &[2, 4]).unwrap();
    let out = s.sample(&[0], &row(&logits)).unwrap();
    let tok = out.tokens.to_vec::<i32>().unwrap()[0] as usize;
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + logits
        .iter()
        .map(|&x| (f64::from(x) - m).exp())
        .sum::<f64>()
        .ln();
    let lp = |i: usize| f64::from(logits[i]) - lse;
    let chosen = out.logprobs.unwrap().to_vec::<f32>().unwrap()[0];
    assert!(
        (f64::from(chosen) - lp(tok)).abs() < 1e-5,
        "raw logits, before penalties"
    );
    let top = out.top.unwrap();
    let ids = top.ids.to_vec::<i32>().unwrap();
    let vals = top.logprobs.to_vec::<f32>().unwrap();
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let mut got = ids.clone();
    got.sort();
    let mut want: Vec<i32> = order[..5].iter().map(|&i| i as i32).collect();
    want.sort();
    assert_eq!(got, want);
    for (i, val) in ids.iter().zip(vals) {
        assert!((f64::from(val) - lp(*i as usize)).abs() < 1e-5);
    }
    // No slot asked: nothing computed.
    let mut s = Sampler::new(512);
    s.add(0, &Options::greedy(), &[]).unwrap();
    assert!(s.sample(&[0], &row(&logits)).unwrap().logprobs.is_none());
}

#[test]
fn bad_options_and_calls_are_rejected() {
    let mut s = Sampler::new(512);
    let bad = [
        (
            Options {
                temperature: f32::NAN,
                ..Options::default()
            },
            "temperature",
        ),
        (
            Options {
                top_logprobs: 21,
                ..Options::default()
            },
            "top_logprobs",
        ),
        (
            Options {
                frequency_penalty: f32::INFINITY,
                ..Options::default()
            },
            "frequency_penalty",
        ),
    ];
    for (o, name) in bad {
        let e = s.add(0, &o, &[]).unwrap_err().to_string();
        assert!(e.contains(name), "{e}");
        assert!(!s.contains(0), "a rejected slot is not registered");
    }
    s.add(0, &Options::default(), &[]).unwrap();
    assert!(s.add(0, &Options::default(), &[]).is_err());
    assert!(s
        .sample(&[1], &row(&[0.0, 1.0]))
        .unwrap_err()
        .to_string()
        .contains("slot 1"));
    assert!(s
        .sample(&[0, 0], &Array::zeros(&[2, 2], Dtype::F32).unwrap())
        .is_err());
    assert!(s
        .sample(&[0], &Array::zeros(&[2, 2], Dtype::F32).unwrap())
        .is_err());
    s.remove(0).unwrap();
    assert!(s.remove(0).is_err());
}

#[test]
fn out_of_range_options_are_normalised_as_ollama_does() {
    let n = |o: Options| o.normalized(512);
    let base = Options {
        temperature: 0.7,
        ..Options::default()
    };
    // Filters outside their range are off.
    assert_eq!(
        n(Options {
            top_k: -1,
            ..base.clone()
        })
        .top_k,
        0
    );
    assert_eq!(
        n(Options {
            top_p: 1.5,
            ..base.clone()
        })
        .top_p,
        1.0
    );
    assert_eq!(
        n(Options {
            top_p: -0.1,
            ..base.clone()
        })
        .top_p,
        1.0
    );
    assert_eq!(
        n(Options {
            top_p: 0.0,
            ..base.clone()
        })
        .top_p,
        1.0
    );
    assert_eq!(
        n(Options {
            min_p: 2.0,
            ..base.clone()
        })
        .min_p,
        0.0
    );
    assert_eq!(
        n(Options {
            min_p: -0.5,
            ..base.clone()
        })
        .min_p,
        0.0
    );
    // A negative repeat_last_n is the whole context, and no window is wider than it.
    for w in [-1, -2, 513, i32::MAX] {
        let o = n(Options {
            repeat_last_n: w,
            repeat_penalty: 1.5,
            ..base.clone()
        });
        assert_eq!(o.repeat_last_n, 512, "repeat_last_n {w}");
    }
    // A non-positive repeat penalty is neutral; neutral penalties need no history.
    let o = n(Options {
        repeat_penalty: 0.0,
        repeat_last_n: 64,
        ..base.clone()
    });
    assert_eq!((o.repeat_penalty, o.repeat_last_n), (1.0, 0));
    // A negative temperature is greedy.
    assert_eq!(
        n(Options {
            temperature: -1.0,
            ..base.clone()
        })
        .temperature,
        0.0
    );
}

#[test]
fn a_huge_penalty_window_costs_at_most_the_context_and_is_given_back() {
    let mut s = Sampler::new(512);
    let wide = Options {
        repeat_last_n: i32::MAX,
        repeat_penalty: 1.5,
        ..Options::greedy()
    };
    let narrow = Options {
        repeat_last_n: 8,
        repeat_penalty: 3.0,
        ..Options::greedy()
    };
    s.add(0, &wide, &[1, 2, 3]).unwrap();
    s.add(1, &narrow, &[1, 2, 3]).unwrap();
    assert_eq!(s.pool_shape().1, 512, "clamped to the context");
    let t = s
        .sample(&[0, 1], &Array::zeros(&[2, 16], Dtype::F32).unwrap())
        .unwrap();
    assert_eq!(t.tokens.to_vec::<i32>().unwrap().len(), 2);
    s.remove(0).unwrap();
    assert_eq!(s.pool_shape().1, 8, "narrowed to the widest slot left");
    // The narrow slot's history survived the narrowing: its penalties still apply.
    let penalised = s.sample(&[1], &row(&[0.0, 1.0, 1.0, 1.0, 0.5])).unwrap();
    assert_eq!(penalised.tokens.to_vec::<i32>().unwrap(), vec![4]);
    s.remove(1).unwrap();
    assert_eq!(s.pool_shape(), (0, 0), "nothing held once every slot left");
}

// ---------------------------------------------------------------------------------------------
// Speculation support.
// ---------------------------------------------------------------------------------------------

#[test]
fn draft_prefix_acts_like_committed_history() {
    let v = 20;
    let o = Options {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        repeat_last_n: 5,
        repeat_penalty: 1.5,
        frequency_penalty: 0.3,
        ..Options::default()
    };
    let logits: Vec<f32> = (0..3).flat_map(|i| pseudo_logits(v, 40 + i)).collect();
    let rows = Array::from_slice(&logits, &[3, v as i32]).unwrap();
    let drafts = [4u32, 9];
    let prefix = Array::from_slice(&drafts.map(|d| d as i32), &[2]).unwrap();
    let prior = [1u32, 2, 3, 4];
    let mut s = Sampler::new(512);
    s.add(0, &o, &prior).unwrap();
    let before = s.history(0).unwrap();
    let d = s.distribution(0, &rows, Some(&prefix)).unwrap();
    assert_eq!(
        s.history(0).unwrap(),
        before,
        "distribution does not mutate history"
    );
    for r in 0..3usize {
        let mut h = prior.to_vec();
        h.extend_from_slice(&drafts[..r]);
        let want = reference(&logits[r * v..(r + 1) * v], &h, &o);
        let got = dense(&d.slice_rows(r as i32, r as i32 + 1).unwrap());
        for (g, w) in got.iter().zip(&want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "row {r}");
        }
    }
    // One row sees the whole chain (proposing).
    let one = s
        .distribution(0, &rows.slice_axis(0, 2, Some(3)).unwrap(), Some(&prefix))
        .unwrap();
    let want = reference(&logits[2 * v..], &[1, 2, 3, 4, 4, 9], &o);
    for (g, w) in dense(&one).iter().zip(&want) {
        assert!((f64::from(*g) - w).abs() < 1e-5);
    }
    // Committing the drafts gives the same history the prefix simulated.
    s.commit(0, &drafts).unwrap();
    let after = s
        .distribution(0, &rows.slice_axis(0, 2, Some(3)).unwrap(), None)
        .unwrap();
    assert_eq!(dense(&after), dense(&one));
}

#[test]
fn residual_bernoulli_and_distribution_sampling() {
    let v = 6;
    let mut s = Sampler::new(512);
    let o = Options {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        repeat_penalty: 1.0,
        seed: 3,
        ..Options::default()
    };
    s.add(0, &o, &[]).unwrap();
    let p = s
        .distribution(0, &row(&[1.0, 2.0, 0.5, -1.0, 0.0, 1.5]), None)
        .unwrap();
    let q = s
        .distribution(0, &row(&[2.0, 0.0, 0.5, 1.0, 0.0, -2.0]), None)
        .unwrap();
    let (pd, qd) = (dense(&p), dense(&q));
    let r = dense(&Distribution::residual(&p, &q).unwrap());
    let raw: Vec<f64> = pd
        .iter()
        .zip(&qd)
        .map(|(a, b)| f64::from(a - b).max(0.0))
        .collect();
    let z: f64 = raw.iter().sum();
    for (g, w) in r.iter().zip(raw.iter().map(|x| x / z)) {
        assert!((f64::from(*g) - w).abs() < 1e-6);
    }
    let tok = Array::from_slice(&[1i32], &[1]).unwrap();
    assert!((p.prob_of(&tok).unwrap().to_vec::<f32>().unwrap()[0] - pd[1]).abs() < 1e-7);

    // Bernoulli frequencies.
    let n = 4000;
    let probs = Array::full(&[n], 0.3, Dtype::F32).unwrap();
    let hits = s
        .bernoulli(0, &probs)
        .unwrap()
        .astype(Dtype::F32)
        .unwrap()
        .sum_all(false)
        .unwrap()
        .item::<f32>()
        .unwrap();
    assert!((hits / n as f32 - 0.3).abs() < 0.03, "{hits}");

    // Sampling from a distribution follows it.
    let many = Distribution::concat(&vec![&p; 3000]).unwrap();
    let toks = s
        .sample_distribution(0, &many)
        .unwrap()
        .to_vec::<i32>()
        .unwrap();
    let mut counts = vec![0usize; v];
    for t in toks {
        counts[t as usize] += 1;
    }
    let probs: Vec<f64> = pd.iter().map(|&x| f64::from(x)).collect();
    let (ok, chi, crit) = chi_square_ok(&counts, &probs, 3000);
    assert!(ok, "chi² {chi} > {crit}");
}
