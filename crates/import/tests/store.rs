//! The store: names, content addressing, removal, integrity checks, and what create refuses.

mod common;
use common::*;
use models::DtypeChoice;
use std::collections::BTreeSet;
use std::path::Path;
use store::{CreateOptions, ModelName, QuantType, StoreError};

#[test]
fn names_follow_ollama() {
    let n: ModelName = "gemma".parse().unwrap();
    assert_eq!(
        (
            n.host.as_str(),
            n.namespace.as_str(),
            n.model.as_str(),
            n.tag.as_str()
        ),
        ("registry.ollama.ai", "library", "gemma", "latest")
    );
    assert_eq!(n.to_string(), "gemma:latest");
    assert_eq!(
        n.manifest_path(),
        Path::new("registry.ollama.ai/library/gemma/latest")
    );
    let n: ModelName = "me/gemma:e2b-q4".parse().unwrap();
    assert_eq!(n.to_string(), "me/gemma:e2b-q4");
    let n: ModelName = "localhost:5000/me/gemma".parse().unwrap();
    assert_eq!(
        (n.host.as_str(), n.tag.as_str()),
        ("localhost:5000", "latest")
    );
    assert_eq!(n.to_string(), "localhost:5000/me/gemma:latest");
    for bad in [
        "", "a/b/c/d", "bad name", "x:", ":tag", "../x", "a/../b", "-x", "x:t/g",
    ] {
        assert!(bad.parse::<ModelName>().is_err(), "{bad:?} parsed");
    }
}

#[test]
fn identical_blobs_are_stored_once_and_rm_keeps_shared_ones() {
    let s = Scratch::new();
    let a = s
        .create(
            "a",
            &with_draft("gemma4_e2b_like", "gemma4_assistant"),
            &CreateOptions::default(),
        )
        .unwrap();
    let after_a = s.blobs();
    // The same target without the draft: every blob it needs is already there.
    let b = s
        .create("b", &from("gemma4_e2b_like"), &CreateOptions::default())
        .unwrap();
    let after_b = s.blobs();
    assert_eq!(
        after_b.len(),
        after_a.len() + 1,
        "only b's config blob is new"
    );
    assert!(a.layers > b.layers);
    // Creating a again changes nothing.
    let again = s
        .create(
            "a",
            &with_draft("gemma4_e2b_like", "gemma4_assistant"),
            &CreateOptions::default(),
        )
        .unwrap();
    assert_eq!(again.digest, a.digest);
    assert_eq!(s.blobs(), after_b);

    let (removed, bytes) = s.store.remove(&name("a")).unwrap();
    assert!(removed > 0 && bytes > 0);
    assert!(s.store.check().unwrap().is_empty());
    let r = s.store.resolve(&name("b")).unwrap();
    let in_b: BTreeSet<String> = r
        .manifest
        .all_layers()
        .map(|l| l.digest.replace("sha256:", "sha256-"))
        .collect();
    assert_eq!(s.blobs(), in_b, "exactly b's blobs are left");
    models::load_files(&r.target, DtypeChoice::Auto).unwrap();
    assert!(matches!(
        s.store.resolve(&name("a")),
        Err(StoreError::NotFound(_))
    ));
    s.store.remove(&name("b")).unwrap();
    assert!(s.blobs().is_empty());
    assert!(s.store.list().unwrap().is_empty());
    assert!(matches!(
        s.store.remove(&name("b")),
        Err(StoreError::NotFound(_))
    ));
}

#[test]
fn replacing_a_model_removes_the_blobs_only_it_used() {
    let s = Scratch::new();
    s.create("m", &from("glm4_moe_lite"), &CreateOptions::default())
        .unwrap();
    let q = CreateOptions {
        quantize: Some(QuantType::Q4),
        quantize_draft: None,
    };
    let r = s.create("m", &from("glm4_moe_lite"), &q).unwrap();
    assert!(r.removed_blobs > 0);
    assert_eq!(s.blobs().len(), r.layers + 1);
    let listed = s.store.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].name.to_string(), "m:latest");
    assert_eq!(listed[0].digest, r.digest);
}

#[test]
fn altered_blobs_are_caught_on_load() {
    let s = Scratch::new();
    s.create(
        "m",
        &with_draft("gemma4_e2b_like", "gemma4_assistant"),
        &CreateOptions::default(),
    )
    .unwrap();
    let r = s.store.resolve(&name("m")).unwrap();
    let victim = r.draft.as_ref().unwrap().tensors[0].clone();
    let mut bytes = std::fs::read(&victim).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x55;
    std::fs::write(&victim, &bytes).unwrap();
    let problems = s.store.check().unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("is altered"));
    let mut target = models::load_files(&r.target, DtypeChoice::Auto).unwrap();
    let e = models::load_draft_files(r.draft.as_ref().unwrap(), &mut target, draft_options())
        .err()
        .expect("an altered blob loaded");
    assert!(e.to_string().contains("does not match its digest"), "{e}");
    // A missing blob is named too.
    std::fs::remove_file(&r.target.tensors[0]).unwrap();
    let e = models::load_files(&r.target, DtypeChoice::Auto)
        .err()
        .unwrap();
    assert!(e.to_string().contains("No such file"), "{e}");
}

#[test]
fn create_refuses_bad_input_before_touching_the_store() {
    let s = Scratch::new();
    let none = CreateOptions::default();
    let q4 = CreateOptions {
        quantize: Some(QuantType::Q4),
        quantize_draft: None,
    };
    let draft_q8 = CreateOptions {
        quantize: None,
        quantize_draft: Some(QuantType::Q8),
    };
    let unknown = s.dir.path().join("unknown");
    std::fs::create_dir(&unknown).unwrap();
    std::fs::write(unknown.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    std::fs::write(unknown.join("model.safetensors"), b"").unwrap();
    // A checkpoint whose weights end early.
    let truncated = s.dir.path().join("truncated");
    std::fs::create_dir(&truncated).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture("gemma4_e2b_like").join(f), truncated.join(f)).unwrap();
    }
    let w = std::fs::read(fixture("gemma4_e2b_like").join("model.safetensors")).unwrap();
    std::fs::write(truncated.join("model.safetensors"), &w[..w.len() / 2]).unwrap();
    let cases: Vec<(String, &CreateOptions, &str)> = vec![
        (
            with_draft("gemma4_e2b_like", "gemma4_e2b_like"),
            &none,
            "line 2: DRAFT is the same model as FROM",
        ),
        (
            from("gemma4_e2b_like"),
            &draft_q8,
            "--quantize-draft needs a DRAFT line",
        ),
        ("FROM ./no-such-dir\n".into(), &none, "line 1: FROM "),
        (
            "FROM no-such-model\n".into(),
            &none,
            "no such directory, and no stored model of that name",
        ),
        (
            format!("FROM {}\n", unknown.display()),
            &none,
            "unknown architecture \"llama\"",
        ),
        (
            with_draft("glm4_moe_lite", "gemma4_assistant"),
            &none,
            "a gemma4_assistant drafts for gemma4 targets",
        ),
        (from("glm4_moe_lite_q4"), &q4, "is already quantized (int4)"),
        (
            with_draft("gemma4_26b_a4b_like", "gemma4_26b_a4b_like_q4"),
            &draft_q8,
            "is already quantized (int4); create it without --quantize-draft int8",
        ),
        (
            "FROM x\nPARAMETER top_k x\n".into(),
            &none,
            "line 2: parameter top_k expects an integer",
        ),
    ];
    for (text, opts, want) in cases {
        let e = s
            .create("m", &text, opts)
            .err()
            .unwrap_or_else(|| panic!("{text} was accepted"));
        assert!(e.to_string().contains(want), "{text}: {e}");
    }
    assert!(s.blobs().is_empty(), "a refused create wrote blobs");
    assert!(s.store.list().unwrap().is_empty());
}

#[test]
fn from_a_stored_model_reuses_its_blobs() {
    let s = Scratch::new();
    s.create("base", &from("gemma4_e2b_like"), &CreateOptions::default())
        .unwrap();
    let before = s.blobs();
    let r = s
        .create(
            "derived",
            &format!(
                "FROM base\nDRAFT {}\nPARAMETER temperature 0.2\n",
                fixture("gemma4_assistant").display()
            ),
            &CreateOptions::default(),
        )
        .unwrap();
    let added = s.blobs().len() - before.len();
    let draft_layers = r
        .config
        .draft
        .as_ref()
        .map(|_| {
            s.store
                .resolve(&name("derived"))
                .unwrap()
                .manifest
                .layers
                .iter()
                .filter(|l| l.name.as_deref().is_some_and(|n| n.starts_with("draft")))
                .count()
        })
        .unwrap();
    // New: the draft's blobs, the parameters and the config; the target's are shared.
    assert!(added <= draft_layers + 2, "{added} new blobs");
    let text =
        store::show::describe(&s.store, &s.store.resolve(&name("derived")).unwrap()).unwrap();
    assert!(text.contains("gemma4_assistant"), "{text}");
    assert!(text.contains("PARAMETER temperature 0.2"), "{text}");
}

#[test]
fn from_a_stored_model_inherits_its_draft_and_settings() {
    let s = Scratch::new();
    s.create(
        "base",
        &format!(
            "{}PARAMETER temperature 0.3\nPARAMETER top_k 20\nSYSTEM be brief\n",
            with_draft("gemma4_e2b_like", "gemma4_assistant")
        ),
        &CreateOptions::default(),
    )
    .unwrap();
    // No DRAFT: the base's comes along, quantized as asked; a PARAMETER here wins over the
    // base's, the others are kept.
    let q = CreateOptions {
        quantize: None,
        quantize_draft: Some(QuantType::Q8),
    };
    let r = s
        .create("child", "FROM base\nPARAMETER temperature 0.9\n", &q)
        .unwrap();
    let d = r.draft.as_ref().expect("the draft was not inherited");
    assert_eq!(d.architecture, "Gemma4AssistantForCausalLM");
    assert!(d.precisions.contains_key("int8"), "{d:?}");
    assert!(!d.precisions.contains_key("int4"), "{d:?}");
    let child = s.store.resolve(&name("child")).unwrap();
    assert_eq!(child.parameters["temperature"], serde_json::json!(0.9));
    assert_eq!(child.parameters["top_k"], serde_json::json!(20));
    let mf = store::show::modelfile(&s.store, &child).unwrap();
    assert_eq!(mf.system.as_deref(), Some("be brief"));
    let mut target = models::load_files(&child.target, DtypeChoice::Auto).unwrap();
    models::load_draft_files(child.draft.as_ref().unwrap(), &mut target, draft_options()).unwrap();
    // An explicit DRAFT replaces it.
    let r = s
        .create(
            "other",
            &format!(
                "FROM base\nDRAFT {}\n",
                fixture("gemma4_assistant_dense").display()
            ),
            &CreateOptions::default(),
        )
        .unwrap();
    assert!(r.config.draft.is_some());
    let other = s.store.resolve(&name("other")).unwrap();
    let stored = std::fs::read(other.draft.unwrap().config().unwrap()).unwrap();
    let want = std::fs::read(fixture("gemma4_assistant_dense").join("config.json")).unwrap();
    assert_eq!(
        stored, want,
        "the explicit DRAFT's config.json, byte for byte"
    );
}

#[test]
fn damaged_blobs_are_rewritten_by_the_next_create() {
    let s = Scratch::new();
    let text = from("glm4_moe_lite");
    s.create("m", &text, &CreateOptions::default()).unwrap();
    let r = s.store.resolve(&name("m")).unwrap();
    let victim = r.target.tensors[3].clone();
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[20] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();
    assert_eq!(s.store.check().unwrap().len(), 1);
    s.create("m", &text, &CreateOptions::default()).unwrap();
    assert!(s.store.check().unwrap().is_empty());
}

#[test]
fn an_unreadable_manifest_is_reported_and_deletes_nothing() {
    let s = Scratch::new();
    s.create("good", &from("glm4_moe_lite"), &CreateOptions::default())
        .unwrap();
    let bad = s
        .store
        .root()
        .join("manifests/registry.ollama.ai/library/bad/latest");
    std::fs::create_dir_all(bad.parent().unwrap()).unwrap();
    std::fs::write(&bad, b"{not json").unwrap();
    let listed = s.store.list().unwrap();
    assert_eq!(listed.len(), 1, "the good model is still listed");
    let problems = s.store.check().unwrap();
    assert!(
        problems.iter().any(|p| p.contains("not a valid manifest")),
        "{problems:?}"
    );
    let e = s.store.resolve(&name("bad")).err().unwrap();
    assert!(e.to_string().contains("not a valid manifest"), "{e}");
    // Removing the good model keeps every blob: the bad manifest might need them.
    let before = s.blobs();
    let (removed, _) = s.store.remove(&name("good")).unwrap();
    assert_eq!(removed, 0);
    assert_eq!(s.blobs(), before);
}

/// How these tests load a stored draft.
fn draft_options() -> models::DraftOptions {
    models::DraftOptions {
        dtype: DtypeChoice::Auto,
        cache_format: mlx::RowFormat::AsComputed,
        slack: 4,
        position: models::gemma4_assistant::QueryPosition::LastCommitted,
    }
}
