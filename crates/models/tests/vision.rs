//! gemma4's vision tower against transformers (tests/fixtures/models/gemma4_vision_like, made by
//! tests/fixtures/generate.py): each fixture image's patches, as transformers' image processor
//! made them, through the tower and the embedder, within 1e-4 in float32.

use mlx::{Array, Dtype};
use models::gemma4_vision::{Gemma4Vision, ImagePatches};
use models::{load_vision, DtypeChoice, MediaKind, MediaSpan, PackedRow};
use std::collections::HashMap;
use std::path::PathBuf;

mod common;
use common::{argmax_rows, mm_logits};

const IMAGES: [&str; 4] = ["wide", "tall", "small", "large"];

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/gemma4_vision_like")
}

fn golden() -> HashMap<String, Array> {
    mlx::io::load_safetensors(fixture().join("golden.safetensors"))
        .unwrap()
        .arrays
}

fn tower() -> Gemma4Vision {
    load_vision(&fixture(), DtypeChoice::Fixed(Dtype::F32))
        .unwrap()
        .expect("the fixture has a vision tower")
}

/// The processor's patches of image `name`, from the golden file.
fn patches(g: &HashMap<String, Array>, name: &str) -> ImagePatches {
    let pos = g[&format!("image.{name}.positions")]
        .to_vec::<i32>()
        .unwrap();
    let positions: Vec<[i32; 2]> = pos.chunks(2).map(|p| [p[0], p[1]]).collect();
    let gw = positions.iter().map(|p| p[0]).max().unwrap() + 1;
    let gh = positions.iter().map(|p| p[1]).max().unwrap() + 1;
    ImagePatches {
        pixels: g[&format!("image.{name}.pixel_values")]
            .to_vec::<f32>()
            .unwrap(),
        positions,
        grid: (gw, gh),
    }
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn images_encode_as_transformers_encodes_them() {
    let (v, g) = (tower(), golden());
    for name in IMAGES {
        let p = patches(&g, name);
        let tower_out = v.tower(&p).unwrap();
        let d = max_diff(&tower_out, &g[&format!("image.{name}.tower")]);
        assert!(d <= 1e-4, "{name}: tower output differs by {d}");
        let soft = v.encode(&p).unwrap();
        assert_eq!(soft.dim(0).unwrap(), p.soft_tokens(&v.cfg), "{name}");
        let d = max_diff(&soft, &g[&format!("image.{name}.features")]);
        assert!(d <= 1e-4, "{name}: soft tokens differ by {d}");
    }
}

#[test]
fn patches_that_do_not_fit_the_tower_are_refused() {
    let (v, g) = (tower(), golden());
    let mut p = patches(&g, "wide");
    // A grid whose sides do not pool by the kernel.
    p.grid = (p.grid.0 + 1, p.grid.1);
    let e = v.encode(&p).unwrap_err().to_string();
    assert!(e.contains("does not pool"), "{e}");
    // Patches of the wrong width.
    let p = patches(&g, "wide");
    let n = p.positions.len() as i32;
    let bad = ImagePatches {
        pixels: vec![0.0; n as usize * 12],
        ..p
    };
    let e = v.encode(&bad).unwrap_err().to_string();
    assert!(e.contains("image patches of"), "{e}");
}

#[test]
fn a_text_only_checkpoint_has_no_tower() {
    let dir = fixture().join("../gemma4_e2b_like");
    assert!(load_vision(&dir, DtypeChoice::Fixed(Dtype::F32))
        .unwrap()
        .is_none());
}

/// Each fixture image file through our image processor against transformers' (Pillow backend):
/// every format and mode bit for bit (decoding, resizing, compositing, rescaling and patching).
#[test]
fn images_are_cut_into_patches_as_transformers_cuts_them() {
    use models::gemma4_image::ImageProcessorConfig;
    let g = golden();
    let proc = ImageProcessorConfig::load(&fixture())
        .unwrap()
        .expect("the fixture has a processor config");
    let cases = IMAGES
        .iter()
        .map(|n| (format!("{n}.png"), format!("image.{n}"), 0.0))
        .chain(
            [
                ("alpha.png", 0.0),
                ("gray_alpha.png", 0.0),
                ("palette.png", 0.0),
                ("frames.gif", 0.0),
                ("lossless.webp", 0.0),
                ("lossy.webp", 0.0),
                ("photo.jpg", 0.0),
            ]
            .map(|(f, tol)| (f.to_string(), format!("processed.{f}"), tol)),
        );
    for (file, key, tol) in cases {
        let bytes = std::fs::read(fixture().join("images").join(&file)).unwrap();
        let p = proc
            .preprocess(&bytes)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = &g[&format!("{key}.pixel_values")];
        let n = p.positions.len() as i32;
        let d = max_diff(&Array::from_slice(&p.pixels, &[n, 48]).unwrap(), want);
        assert!(d <= tol + 1e-6, "{file}: pixels differ by {d}");
        let pos: Vec<i32> = p.positions.iter().flatten().copied().collect();
        assert_eq!(
            pos,
            g[&format!("{key}.positions")].to_vec::<i32>().unwrap(),
            "{file}: positions"
        );
    }
}

/// The fixture's model with the smaller gemma4s' rule (media attend causally), in a temporary
/// copy of its directory.
fn causal_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    cfg["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("use_bidirectional_attention");
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// A prompt with two images through the whole model against transformers'
/// `Gemma4ForConditionalGeneration`: with the larger gemma4s' rule (an image's tokens see each
/// other both ways in the sliding layers, within the window) and the smaller ones' (causal),
/// in one pass and in passes that cut between the images, from transformers' own soft tokens
/// and from ours. This prompt is sensitive to rounding (transformers' float32 logits are 1.3e-4
/// and 4.1e-4 from its float64 ones), so each result is held to the float64 logits: no further
/// from them than three times transformers' float32 (1.1 to 1.9 times seen), and the same
/// argmax everywhere.
#[test]
fn a_prompt_with_two_images_gives_transformers_logits() {
    let (v, g) = (tower(), golden());
    let theirs = [
        g["image.wide.features"].clone(),
        g["image.small.features"].clone(),
    ];
    let ours = [
        v.encode(&patches(&g, "wide")).unwrap(),
        v.encode(&patches(&g, "small")).unwrap(),
    ];
    let ids = g["mm.input_ids"].to_vec::<i32>().unwrap();
    let t = ids.len();
    let causal = causal_copy();
    let image_token = serde_json::from_slice::<serde_json::Value>(
        &std::fs::read(fixture().join("config.json")).unwrap(),
    )
    .unwrap()["image_token_id"]
        .as_i64()
        .unwrap() as i32;
    let worst = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    for (dir, key) in [
        (fixture(), "mm.logits"),
        (causal.path().to_path_buf(), "mm.logits_causal"),
    ] {
        let exact: Vec<f32> = g[&format!("{key}_f64")]
            .astype(Dtype::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let reference = worst(&g[key].to_vec::<f32>().unwrap(), &exact);
        let vocab = exact.len() / t;
        // Whole; cut after the first image; cut before each image.
        for passes in [vec![t], vec![70, t - 70], vec![5, 65, t - 70]] {
            for (images, whose) in [(&theirs, "theirs"), (&ours, "ours")] {
                let items: Vec<(Array, MediaKind)> = images
                    .iter()
                    .map(|e| (e.clone(), MediaKind::Image))
                    .collect();
                let got = mm_logits(&dir, &ids, &items, &passes, |t| t == image_token);
                let what = format!("{key}, passes {passes:?}, {whose} soft tokens");
                let d = worst(&got, &exact);
                assert!(
                    d <= 3.0 * reference.max(5e-5),
                    "{what}: {d} from float64 (transformers' float32: {reference})"
                );
                assert_eq!(
                    argmax_rows(&got, vocab),
                    argmax_rows(&exact, vocab),
                    "{what}: argmax"
                );
            }
        }
    }
}

/// Media that does not fit the pass is refused by name, before anything runs; a model without
/// images refuses media.
#[test]
fn media_that_does_not_fit_its_row_is_refused() {
    let m = models::load(&fixture(), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let mut caches = m.model.make_caches();
    let embeds = Array::zeros(&[4, 64], Dtype::F32).unwrap();
    let tokens = Array::from_slice(&[2, 17, 200, 45, 3, 9], &[1, 6]).unwrap();
    for (at, what) in [(3, "past the row's end"), (0, "overlapping the next")] {
        let media = if at == 3 {
            vec![MediaSpan {
                at,
                embeds: embeds.clone(),
                kind: MediaKind::Image,
            }]
        } else {
            vec![
                MediaSpan {
                    at: 0,
                    embeds: embeds.clone(),
                    kind: MediaKind::Image,
                },
                MediaSpan {
                    at: 2,
                    embeds: embeds.slice_axis(0, 0, Some(2)).unwrap(),
                    kind: MediaKind::Image,
                },
            ]
        };
        let e = m
            .model
            .forward_packed(
                &tokens,
                &mut [PackedRow {
                    seq: 0,
                    len: 6,
                    caches: &mut caches,
                    media: &media,
                }],
            )
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"))
            .to_string();
        assert!(e.contains("media of"), "{what}: {e}");
    }
    let glm = models::load(
        &fixture().join("../glm4_moe_lite"),
        DtypeChoice::Fixed(Dtype::F32),
    )
    .unwrap();
    let mut caches = glm.model.make_caches();
    let media = [MediaSpan {
        at: 0,
        embeds: Array::zeros(&[1, 8], Dtype::F32).unwrap(),
        kind: MediaKind::Image,
    }];
    let e = glm
        .model
        .forward_packed(
            &Array::from_slice(&[2, 17], &[1, 2]).unwrap(),
            &mut [PackedRow {
                seq: 0,
                len: 2,
                caches: &mut caches,
                media: &media,
            }],
        )
        .expect_err("GLM refuses media")
        .to_string();
    assert!(e.contains("no images"), "{e}");
}
