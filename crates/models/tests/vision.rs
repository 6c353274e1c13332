//! gemma4's vision tower against transformers (tests/fixtures/models/gemma4_vision_like, made by
//! tests/fixtures/generate.py): each fixture image's patches, as transformers' image processor
//! made them, through the tower and the embedder, within 1e-4 in float32.

use mlx::{Array, Dtype};
use models::gemma4_vision::{Gemma4Vision, ImagePatches};
use models::{load_vision, DtypeChoice};
use std::collections::HashMap;
use std::path::PathBuf;

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
        pixels: g[&format!("image.{name}.pixel_values")].clone(),
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
        pixels: Array::zeros(&[n, 12], Dtype::F32).unwrap(),
        ..p
    };
    let e = v.encode(&bad).unwrap_err().to_string();
    assert!(e.contains("image patches of shape"), "{e}");
}

#[test]
fn a_text_only_checkpoint_has_no_tower() {
    let dir = fixture().join("../gemma4_e2b_like");
    assert!(load_vision(&dir, DtypeChoice::Fixed(Dtype::F32))
        .unwrap()
        .is_none());
}
