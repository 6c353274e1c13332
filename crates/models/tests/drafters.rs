//! The drafters against transformers: the gemma4 assistant's draft steps (both query-position
//! conventions, centroid and dense heads) and GLM's MTP layer.

use mlx::{Array, Dtype, Ix};
use models::gemma4::Gemma4;
use models::gemma4_assistant::QueryPosition;
use models::glm4_moe_lite::Glm4MoeLite;
use models::{load, load_assistant, load_draft, CausalLm, DtypeChoice, LayerCache};
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn golden(name: &str) -> HashMap<String, Array> {
    mlx::io::load_safetensors(fixture(name).join("golden.safetensors"))
        .unwrap()
        .arrays
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// How the tests load drafters: the checkpoint's dtype choice left to the loader.
fn opts() -> models::DraftOptions {
    models::DraftOptions {
        dtype: DtypeChoice::Auto,
        cache_format: mlx::RowFormat::AsComputed,
        slack: 4,
        position: models::gemma4_assistant::QueryPosition::LastCommitted,
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

#[test]
fn glm_mtp_matches_the_reference() {
    let m = load(&fixture("glm4_moe_lite"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let glm = m.model.as_any().downcast_ref::<Glm4MoeLite>().unwrap();
    let mtp = glm.mtp().expect("the fixture carries an MTP layer");
    let g = golden("glm4_moe_lite");
    let ids = g["input_ids"].to_vec::<i32>().unwrap();
    let t = ids.len() as i32;
    let last = (0..)
        .find(|i| !g.contains_key(&format!("hidden_states.{}", i + 1)))
        .unwrap();
    let hidden = g[&format!("hidden_states.{last}")]
        .index(&[Ix::slice(None, Some(t - 1), 1)])
        .unwrap();
    let next = Array::from_slice(&ids[1..], &[1, t - 1]).unwrap();
    let want = f32s(&g["mtp.logits"]);
    let v = 512;
    // All pairs at once.
    let mut cache = cache::LatentCache::new();
    let (_, logits) = mtp
        .forward(&next, &hidden.expand_dims(0).unwrap(), &mut cache)
        .unwrap();
    let got = f32s(&logits);
    assert!(max_diff(&got, &want) < 1e-4, "{}", max_diff(&got, &want));
    for r in 0..(t - 1) as usize {
        assert_eq!(
            argmax(&got[r * v..(r + 1) * v]),
            argmax(&want[r * v..(r + 1) * v]),
            "row {r}"
        );
    }
    // Fed incrementally through the cache, as speculation does.
    let mut cache = cache::LatentCache::new();
    let mut rows = Vec::new();
    let split = 7;
    let (_, l) = mtp
        .forward(
            &next.slice_axis(1, 0, Some(split)).unwrap(),
            &hidden
                .slice_axis(0, 0, Some(split))
                .unwrap()
                .expand_dims(0)
                .unwrap(),
            &mut cache,
        )
        .unwrap();
    rows.extend(f32s(&l));
    for i in split..t - 1 {
        let (_, l) = mtp
            .forward(
                &next.slice_axis(1, i, Some(i + 1)).unwrap(),
                &hidden
                    .slice_axis(0, i, Some(i + 1))
                    .unwrap()
                    .expand_dims(0)
                    .unwrap(),
                &mut cache,
            )
            .unwrap();
        rows.extend(f32s(&l));
    }
    assert!(max_diff(&rows, &want) < 1e-4);
}

fn assistant_matches(name: &str, ordered: bool) {
    let mut target = load(&fixture("gemma4_e2b_like"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    // transformers' assistant reads W + 1 sliding keys: keep one token past the window.
    target.model.set_cache_slack(1);
    let mut a = load_assistant(&fixture(name), &target, DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let g = golden(name);
    let prompt = g["prompt_ids"].to_vec::<i32>().unwrap();
    let gemma = target.model.as_any().downcast_ref::<Gemma4>().unwrap();
    let mut caches: Vec<LayerCache> = gemma.make_caches();
    let hidden = gemma
        .forward(
            &Array::from_slice(&prompt, &[1, prompt.len() as i32]).unwrap(),
            &mut caches,
        )
        .unwrap();
    let h_last = hidden
        .index(&[Ix::full(), Ix::slice(Some(-1), None, 1)])
        .unwrap();
    assert!(max_diff(&f32s(&h_last), &f32s(&g["target_hidden_last_postnorm"])) < 1e-4);
    let kv = gemma.shared_kv(&caches).unwrap();
    // The store layers' K/V equal transformers' shared_kv_states.
    let (sk, _) = kv.sliding.as_ref().unwrap();
    let sk = sk.keys.dense().unwrap();
    assert!(
        max_diff(
            &f32s(&sk.index(&[Ix::At(0)]).unwrap()),
            &f32s(&g["shared_kv.sliding_attention.keys"])
        ) < 1e-4
    );
    for (conv, position) in [
        ("hf", QueryPosition::Bonus),
        ("anchor_minus1", QueryPosition::LastCommitted),
    ] {
        a.set_position(position);
        let mut tok = g["bonus_token"].to_vec::<i32>().unwrap()[0];
        let mut h = h_last.clone();
        for step in 0..3 {
            let pre = format!("draft.{conv}.step{step}");
            assert_eq!(
                tok,
                g[&format!("{pre}.input_token")].to_vec::<i32>().unwrap()[0],
                "{name} {pre}"
            );
            let out = a
                .step(&Array::from_slice(&[tok], &[1, 1]).unwrap(), &h, &kv)
                .unwrap();
            assert!(
                max_diff(
                    &f32s(&out.normed),
                    &f32s(&g[&format!("{pre}.normed_hidden")])
                ) < 1e-4,
                "{name} {pre} normed"
            );
            assert!(
                max_diff(
                    &f32s(&out.hidden),
                    &f32s(&g[&format!("{pre}.projected_hidden")])
                ) < 1e-4,
                "{name} {pre} hidden"
            );
            let got = f32s(&out.logits);
            let want = f32s(&g[&format!("{pre}.logits")]);
            if ordered {
                // transformers fills the tokens outside the chosen centroids with (min − 1);
                // here they are -inf. The chosen candidates must agree.
                let fill = want.iter().cloned().fold(f32::INFINITY, f32::min);
                for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                    if *y == fill {
                        assert!(
                            x.is_infinite() && *x < 0.0,
                            "{name} {pre} token {i}: {x} outside the candidates"
                        );
                    } else {
                        assert!((x - y).abs() < 1e-4, "{name} {pre} token {i}: {x} vs {y}");
                    }
                }
                let dense = f32s(&g[&format!("{pre}.dense_logits")]);
                assert!(dense
                    .iter()
                    .zip(&want)
                    .all(|(d, w)| *w == fill || (d - w).abs() < 1e-4));
            } else {
                assert!(max_diff(&got, &want) < 1e-4, "{name} {pre}");
            }
            assert_eq!(argmax(&got), argmax(&want));
            tok = argmax(&got) as i32;
            h = out.hidden;
        }
    }
}

#[test]
fn assistant_with_centroid_head_matches_transformers() {
    assistant_matches("gemma4_assistant", true);
}

#[test]
fn assistant_with_dense_head_matches_transformers() {
    assistant_matches("gemma4_assistant_dense", false);
}

#[test]
fn mismatched_drafts_are_refused() {
    let mut glm = load(&fixture("glm4_moe_lite"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let e = load_draft(&fixture("gemma4_assistant"), &mut glm, opts())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("drafts for gemma4 targets"), "{e}");
    let mut gemma31 = load(&fixture("gemma4_31b_like"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let e = load_draft(&fixture("gemma4_assistant"), &mut gemma31, opts())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("head_dim") || e.contains("KV heads"), "{e}");
    // A separate model with a different vocabulary.
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture("gemma4_31b_like")).unwrap() {
        let p = f.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    c["vocab_size"] = serde_json::json!(256);
    std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
    let e = load_draft(dir.path(), &mut gemma31, opts())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("vocabulary") || e.contains("shape"), "{e}");
}

/// A draft whose tokenizer has the target's size but not its tokens (two ids swapped, a special
/// token that is not special) is refused, naming the first difference.
#[test]
fn a_draft_with_another_tokenizer_of_the_same_size_is_refused() {
    let mut target = load(&fixture("gemma4_31b_like"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let mut with_tokenizer = |edit: &dyn Fn(&mut serde_json::Value)| {
        let dir = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(fixture("gemma4_31b_like")).unwrap() {
            let p = f.unwrap().path();
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
        let path = dir.path().join("tokenizer.json");
        let mut t: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut t);
        std::fs::write(&path, t.to_string()).unwrap();
        let r = load_draft(dir.path(), &mut target, opts());
        r.err().map(|e| e.to_string())
    };
    // The fixture itself is accepted as its own draft.
    assert_eq!(with_tokenizer(&|_| {}), None);
    let e = with_tokenizer(&|t| {
        let vocab = t["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = ("<0x61>".to_string(), "<0x62>".to_string());
        let (ia, ib) = (vocab[&a].clone(), vocab[&b].clone());
        vocab.insert(a, ib);
        vocab.insert(b, ia);
    })
    .expect("swapped ids are refused");
    assert!(
        e.contains("maps id") && e.contains("not the same tokenizer"),
        "{e}"
    );
    let e = with_tokenizer(&|t| {
        t["added_tokens"][1]["special"] = serde_json::json!(false);
    })
    .expect("a special token that is not special is refused");
    assert!(e.contains("as special"), "{e}");
}

/// The assistant's batched step gives each row what its single step gives: three sequences of
/// different lengths (one past the sliding window), each over its own target caches, both
/// heads.
#[test]
fn assistant_rows_step_as_each_row_alone() {
    for name in ["gemma4_assistant", "gemma4_assistant_dense"] {
        let target = load(&fixture("gemma4_e2b_like"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
        let a = load_assistant(&fixture(name), &target, DtypeChoice::Fixed(Dtype::F32)).unwrap();
        let gemma = target.model.as_any().downcast_ref::<Gemma4>().unwrap();
        let prompts: [&[i32]; 3] = [&[5, 9, 2], &[7, 1, 4, 4, 8, 30, 11, 3, 12, 6, 2, 19], &[3]];
        let mut kvs = Vec::new();
        let mut hiddens = Vec::new();
        for p in prompts {
            let mut caches = gemma.make_caches();
            let h = gemma
                .forward(
                    &Array::from_slice(p, &[1, p.len() as i32]).unwrap(),
                    &mut caches,
                )
                .unwrap();
            hiddens.push(
                h.index(&[Ix::full(), Ix::slice(Some(-1), None, 1)])
                    .unwrap(),
            );
            kvs.push(gemma.shared_kv(&caches).unwrap());
        }
        let tokens = [21, 0, 17];
        let alone: Vec<_> = (0..3)
            .map(|r| {
                a.step(
                    &Array::from_slice(&[tokens[r]], &[1, 1]).unwrap(),
                    &hiddens[r],
                    &kvs[r],
                )
                .unwrap()
            })
            .collect();
        let refs: Vec<&Array> = hiddens.iter().collect();
        let together = a
            .step_rows(
                &Array::from_slice(&tokens, &[1, 3]).unwrap(),
                &mlx::concatenate(&refs, 1).unwrap(),
                &kvs.iter().collect::<Vec<_>>(),
            )
            .unwrap();
        for (r, one) in alone.iter().enumerate() {
            let r = r as i32;
            let logits = together.logits.slice_axis(0, r, Some(r + 1)).unwrap();
            let hidden = together.hidden.slice_axis(1, r, Some(r + 1)).unwrap();
            // Candidates outside a centroid head are -inf in both: compare where finite.
            let (x, y) = (f32s(&logits), f32s(&one.logits));
            assert_eq!(
                x.iter().map(|v| v.is_finite()).collect::<Vec<_>>(),
                y.iter().map(|v| v.is_finite()).collect::<Vec<_>>(),
                "{name} row {r}: candidates"
            );
            let fin = |v: &[f32]| {
                v.iter()
                    .map(|&t| if t.is_finite() { t } else { 0.0 })
                    .collect::<Vec<_>>()
            };
            assert!(max_diff(&fin(&x), &fin(&y)) < 1e-5, "{name} row {r} logits");
            assert!(
                max_diff(&f32s(&hidden), &f32s(&one.hidden)) < 1e-5,
                "{name} row {r} hidden"
            );
        }
    }
}
