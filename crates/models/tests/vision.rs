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

/// Each fixture image file through our image processor against transformers' (Pillow backend):
/// every format and mode bit for bit (resizing, compositing, rescaling and patching), JPEG within
/// its decoder's rounding.
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
                // The image crate's JPEG decoder (zune-jpeg) rounds its inverse DCT and chroma
                // upsampling differently from Pillow's libjpeg-turbo: up to 6 levels at the
                // image's edge, 0.38 on average.
                ("photo.jpg", 8.0 / 255.0),
            ]
            .map(|(f, tol)| (f.to_string(), format!("processed.{f}"), tol)),
        );
    for (file, key, tol) in cases {
        let bytes = std::fs::read(fixture().join("images").join(&file)).unwrap();
        let p = proc
            .preprocess(&bytes)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = &g[&format!("{key}.pixel_values")];
        let d = max_diff(&p.pixels, want);
        assert!(d <= tol + 1e-6, "{file}: pixels differ by {d}");
        let pos: Vec<i32> = p.positions.iter().flatten().copied().collect();
        assert_eq!(
            pos,
            g[&format!("{key}.positions")].to_vec::<i32>().unwrap(),
            "{file}: positions"
        );
    }
}
