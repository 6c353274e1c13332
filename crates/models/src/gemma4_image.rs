//! gemma4's image processor: encoded image bytes in, the tower's patches out, as transformers'
//! `Gemma4ImageProcessorPil` makes them (docs/MODELS.md §1.5):
//!
//! 1. decode (PNG, JPEG, WebP, GIF's first frame) and convert to RGB, transparency composited
//!    onto white with Pillow's integer arithmetic; JPEG through libjpeg-turbo's decoder, as
//!    Pillow decodes it;
//! 2. resize, keeping the aspect ratio, to the largest size whose patch grid fits the budget
//!    (`max_soft_tokens · pooling_kernel_size²` patches) with sides that pool evenly, with
//!    Pillow's resampling (separable, fixed-point coefficients, 8-bit between the passes);
//! 3. rescale (and normalize, where the config asks) in float32 and cut into patches, each
//!    patch's rows of pixels with the channels last, the patches row by row.

use crate::config::JsonFile;
use crate::gemma4_vision::ImagePatches;
use crate::{ModelError, Result};
use image::{DynamicImage, ImageReader, Limits};
use serde::Deserialize;
use std::io::Cursor;

/// The largest image we decode, a side: larger ones are refused before their pixels are
/// allocated (docs/MODELS.md §1.5).
pub const MAX_IMAGE_SIDE: u32 = 16_384;
/// The most memory one image's decoding may take.
pub const MAX_IMAGE_BYTES: u64 = 512 << 20;

/// The soft-token budgets transformers' gemma4 processor accepts.
const SOFT_TOKEN_BUDGETS: [i32; 5] = [70, 140, 280, 560, 1120];

/// `preprocessor_config.json` of a gemma4 checkpoint (the fields the processor reads).
#[derive(Debug, Clone, Deserialize)]
pub struct ImageProcessorConfig {
    #[serde(default = "default_patch")]
    pub patch_size: i32,
    #[serde(default = "default_soft_tokens")]
    pub max_soft_tokens: i32,
    #[serde(default = "default_pooling")]
    pub pooling_kernel_size: i32,
    #[serde(default = "yes")]
    pub do_resize: bool,
    #[serde(default = "yes")]
    pub do_rescale: bool,
    #[serde(default = "default_rescale")]
    pub rescale_factor: f64,
    #[serde(default)]
    pub do_normalize: bool,
    #[serde(default = "default_mean")]
    pub image_mean: [f32; 3],
    #[serde(default = "default_std")]
    pub image_std: [f32; 3],
    #[serde(default = "yes")]
    pub do_convert_rgb: bool,
    /// Pillow's resampling filter number (3: bicubic).
    #[serde(default = "default_resample")]
    pub resample: u32,
}

fn default_patch() -> i32 {
    16
}
fn default_soft_tokens() -> i32 {
    280
}
fn default_pooling() -> i32 {
    3
}
fn yes() -> bool {
    true
}
fn default_rescale() -> f64 {
    1.0 / 255.0
}
fn default_mean() -> [f32; 3] {
    [0.0; 3]
}
fn default_std() -> [f32; 3] {
    [1.0; 3]
}
fn default_resample() -> u32 {
    3
}

impl ImageProcessorConfig {
    /// The image processor's config in the model directory `dir` (see
    /// [`ImageProcessorConfig::load_files`]).
    pub fn load(dir: &std::path::Path) -> Result<Option<ImageProcessorConfig>> {
        Self::load_files(&crate::ModelFiles::dir(dir)?)
    }

    /// The image processor's config among a model's files: `preprocessor_config.json`, or the
    /// `image_processor` part of `processor_config.json`; `None` where neither exists.
    pub fn load_files(files: &crate::ModelFiles) -> Result<Option<ImageProcessorConfig>> {
        if let Some(path) = files.file("preprocessor_config.json") {
            let file = JsonFile::read(path)?;
            return Self::from_value(&file, &file.value).map(Some);
        }
        let Some(path) = files.file("processor_config.json") else {
            return Ok(None);
        };
        let file = JsonFile::read(path)?;
        match file.value.get("image_processor") {
            Some(v) => Self::from_value(&file, v).map(Some),
            None => Ok(None),
        }
    }

    /// The processor config in `file`, checked.
    pub fn from_file(file: &JsonFile) -> Result<ImageProcessorConfig> {
        Self::from_value(file, &file.value)
    }

    fn from_value(file: &JsonFile, value: &serde_json::Value) -> Result<ImageProcessorConfig> {
        let cfg: ImageProcessorConfig = file.parse(value)?;
        cfg.validate().map_err(|m| file.error(m))?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.patch_size <= 0 || self.pooling_kernel_size <= 0 {
            return Err(format!(
                "patch_size ({}) and pooling_kernel_size ({}) must be positive",
                self.patch_size, self.pooling_kernel_size
            ));
        }
        if !SOFT_TOKEN_BUDGETS.contains(&self.max_soft_tokens) {
            return Err(format!(
                "max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS:?}, got {}",
                self.max_soft_tokens
            ));
        }
        Filter::of(self.resample)?;
        if self.image_std.contains(&0.0) {
            return Err("image_std holds a zero".into());
        }
        Ok(())
    }

    /// Patches an image may have: the soft-token budget times the pooling kernel's area.
    pub fn max_patches(&self) -> i32 {
        self.max_soft_tokens * self.pooling_kernel_size * self.pooling_kernel_size
    }

    /// The size (height, width) an image of `height × width` is resized to: the largest with
    /// the same aspect ratio whose patches fit the budget, both sides multiples of
    /// `pooling_kernel_size · patch_size` (transformers' `get_aspect_ratio_preserving_size`).
    pub fn target_size(&self, height: u32, width: u32) -> Result<(u32, u32)> {
        let (h, w) = (height as f64, width as f64);
        let patch = self.patch_size as f64;
        let target_px = self.max_patches() as f64 * patch * patch;
        let factor = (target_px / (h * w)).sqrt();
        let side = (self.pooling_kernel_size * self.patch_size) as i64;
        let mut th = ((factor * h) / side as f64).floor() as i64 * side;
        let mut tw = ((factor * w) / side as f64).floor() as i64 * side;
        if th == 0 && tw == 0 {
            return Err(ModelError::Invalid(format!(
                "an image of {width}x{height} pixels is too small to cut into patches"
            )));
        }
        let longest = (self.max_patches() / (self.pooling_kernel_size * self.pooling_kernel_size))
            as i64
            * side;
        if th == 0 {
            th = side;
            tw = ((w / h).floor() as i64 * side).min(longest);
        } else if tw == 0 {
            tw = side;
            th = ((h / w).floor() as i64 * side).min(longest);
        }
        if (th * tw) as f64 > target_px {
            return Err(ModelError::Invalid(format!(
                "an image of {width}x{height} pixels has too extreme an aspect ratio \
                 (resized to {tw}x{th}, past {} patches)",
                self.max_patches()
            )));
        }
        Ok((th as u32, tw as u32))
    }

    /// The patches of the encoded image `bytes`.
    pub fn preprocess(&self, bytes: &[u8]) -> Result<ImagePatches> {
        let rgb = decode_rgb(bytes)?;
        let (mut w, mut h) = (rgb.width, rgb.height);
        let mut pixels = rgb.pixels;
        if self.do_resize {
            let (th, tw) = self.target_size(h, w)?;
            if (th, tw) != (h, w) {
                let filter = Filter::of(self.resample).map_err(ModelError::Invalid)?;
                pixels = resize(
                    &pixels,
                    w as usize,
                    h as usize,
                    tw as usize,
                    th as usize,
                    filter,
                );
                (w, h) = (tw, th);
            }
        }
        let ps = self.patch_size as usize;
        let (w, h) = (w as usize, h as usize);
        if w % ps != 0 || h % ps != 0 {
            return Err(ModelError::Invalid(format!(
                "an image of {w}x{h} pixels does not cut into {ps}-pixel patches"
            )));
        }
        let value = |v: u8, c: usize| -> f32 {
            let mut x = if self.do_rescale {
                (v as f64 * self.rescale_factor) as f32
            } else {
                v as f32
            };
            if self.do_normalize {
                x = (x - self.image_mean[c]) / self.image_std[c];
            }
            x
        };
        let (gw, gh) = (w / ps, h / ps);
        let per = 3 * ps * ps;
        let mut out = Vec::with_capacity(gw * gh * per);
        let mut positions = Vec::with_capacity(gw * gh);
        for py in 0..gh {
            for px in 0..gw {
                for y in py * ps..(py + 1) * ps {
                    for x in px * ps..(px + 1) * ps {
                        let at = (y * w + x) * 3;
                        for c in 0..3 {
                            out.push(value(pixels[at + c], c));
                        }
                    }
                }
                positions.push([px as i32, py as i32]);
            }
        }
        Ok(ImagePatches {
            pixels: out,
            positions,
            grid: (gw as i32, gh as i32),
        })
    }
}

/// An 8-bit RGB image, rows top to bottom.
pub struct Rgb {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

/// Decodes `bytes` (PNG, JPEG, WebP or GIF: its first frame) to RGB, compositing any
/// transparency onto white as transformers' `convert_to_rgb` does (Pillow's `alpha_composite`
/// onto an opaque white image: the same integer arithmetic).
pub fn decode_rgb(bytes: &[u8]) -> Result<Rgb> {
    let invalid = |m: String| ModelError::Invalid(m);
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| invalid(format!("cannot read the image: {e}")))?;
    let Some(format) = reader.format() else {
        return Err(invalid(
            "the image is in no format we decode (PNG, JPEG, WebP, GIF)".into(),
        ));
    };
    if format == image::ImageFormat::Jpeg {
        if let Some(rgb) = decode_jpeg(bytes)? {
            return Ok(rgb);
        }
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_BYTES);
    reader.limits(limits);
    let img = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(_) => invalid(format!(
            "the {format:?} image is larger than {MAX_IMAGE_SIDE} pixels a side or \
             {} MiB decoded",
            MAX_IMAGE_BYTES >> 20
        )),
        e => invalid(format!("cannot decode the {format:?} image: {e}")),
    })?;
    let (width, height) = (img.width(), img.height());
    let pixels = if img.color().has_alpha() {
        let rgba = img.into_rgba8();
        let mut out = Vec::with_capacity(width as usize * height as usize * 3);
        for p in rgba.pixels() {
            let a = p[3] as u32;
            for c in 0..3 {
                out.push(over_white(p[c], a));
            }
        }
        out
    } else {
        match img {
            DynamicImage::ImageRgb8(rgb) => rgb.into_raw(),
            other => other.into_rgb8().into_raw(),
        }
    };
    Ok(Rgb {
        width,
        height,
        pixels,
    })
}

/// A JPEG through libjpeg-turbo's decoder (mozjpeg's): the integer inverse DCT and the fancy
/// chroma upsampling Pillow's libjpeg-turbo applies, so the pixels are Pillow's. `None` for a
/// colour space it does not turn into RGB (CMYK), which the image crate then decodes.
fn decode_jpeg(bytes: &[u8]) -> Result<Option<Rgb>> {
    let invalid = |m: String| ModelError::Invalid(format!("cannot decode the Jpeg image: {m}"));
    // libjpeg fills the rest of a truncated image with grey and only warns; Pillow refuses it.
    // Its entropy-coded data never holds 0xFF 0xD9, so an image whose last scan (0xFF 0xDA) is
    // not followed by the end-of-image marker was cut short.
    let last = |m: [u8; 2]| bytes.windows(2).rposition(|w| w == m);
    match (last([0xFF, 0xDA]), last([0xFF, 0xD9])) {
        (Some(sos), Some(eoi)) if eoi > sos => {}
        (Some(_), _) => {
            return Err(invalid(
                "the image is truncated (it ends inside its data)".into(),
            ))
        }
        _ => {}
    }
    // libjpeg reports errors by unwinding out of its callbacks.
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let d = mozjpeg::Decompress::new_mem(bytes)?;
        let (w, h) = (d.width(), d.height());
        if w as u64 > MAX_IMAGE_SIDE as u64
            || h as u64 > MAX_IMAGE_SIDE as u64
            || (w as u64) * (h as u64) * 3 > MAX_IMAGE_BYTES
        {
            return Ok(Err(format!(
                "the Jpeg image is larger than {MAX_IMAGE_SIDE} pixels a side or {} MiB decoded",
                MAX_IMAGE_BYTES >> 20
            )));
        }
        if matches!(
            d.color_space(),
            mozjpeg::ColorSpace::JCS_CMYK | mozjpeg::ColorSpace::JCS_YCCK
        ) {
            return Ok(Ok(None));
        }
        let mut started = d.rgb()?;
        let pixels: Vec<u8> = started.read_scanlines()?;
        started.finish()?;
        Ok::<_, std::io::Error>(Ok(Some(Rgb {
            width: w as u32,
            height: h as u32,
            pixels,
        })))
    }));
    match decoded {
        Ok(Ok(Ok(rgb))) => Ok(rgb),
        Ok(Ok(Err(limit))) => Err(ModelError::Invalid(limit)),
        Ok(Err(e)) => Err(invalid(e.to_string())),
        Err(panic) => Err(invalid(
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "corrupt data".into()),
        )),
    }
}

/// One channel of a pixel with alpha `a` over opaque white, as Pillow's `alpha_composite`
/// computes it (7 fractional bits, its rounded division by 255).
fn over_white(v: u8, a: u32) -> u8 {
    if a == 0 {
        return 255;
    }
    const BITS: u32 = 7;
    let div255 = |x: u32| ((x >> 8) + x) >> 8;
    let coef1 = a << BITS;
    let coef2 = (255 << BITS) - coef1;
    let t = v as u32 * coef1 + 255 * coef2;
    (div255(t + (0x80 << BITS)) >> BITS) as u8
}

/// Pillow's resampling filters, by its numbering.
#[derive(Debug, Clone, Copy)]
enum Filter {
    Lanczos,
    Bilinear,
    Bicubic,
    Box,
    Hamming,
}

impl Filter {
    fn of(n: u32) -> std::result::Result<Filter, String> {
        Ok(match n {
            1 => Filter::Lanczos,
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            4 => Filter::Box,
            5 => Filter::Hamming,
            0 => return Err("resample 0 (nearest) is not supported".into()),
            n => return Err(format!("unknown resample filter {n}")),
        })
    }

    fn support(self) -> f64 {
        match self {
            Filter::Box => 0.5,
            Filter::Bilinear | Filter::Hamming => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let sinc = |x: f64| {
            if x == 0.0 {
                1.0
            } else {
                let x = x * std::f64::consts::PI;
                x.sin() / x
            }
        };
        match self {
            Filter::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Filter::Bilinear => (1.0 - x.abs()).max(0.0),
            Filter::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    // Pillow writes the constants as C floats.
                    x.sin() / x * (0.54f32 as f64 + 0.46f32 as f64 * x.cos())
                }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fractional bits of Pillow's 8-bit resampling coefficients.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// For each output position along one axis, the first input it reads and its fixed-point
/// weights (Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc`).
fn coefficients(in_size: usize, out_size: usize, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's truncating casts, then the clamps.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (xmin..xmax.max(xmin))
                .map(|x| filter.weight((x as f64 - center + 0.5) / filterscale))
                .collect();
            let total: f64 = w.iter().sum();
            let fixed = w
                .iter()
                .map(|&k| {
                    let k = if total != 0.0 { k / total } else { k };
                    let scaled = k * (1u32 << PRECISION_BITS) as f64;
                    if k < 0.0 {
                        (scaled - 0.5) as i32
                    } else {
                        (scaled + 0.5) as i32
                    }
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes RGB `pixels` (`w × h`) to `tw × th` as Pillow does: the horizontal pass first (only
/// where the width changes), rounded to 8 bits, then the vertical pass.
fn resize(pixels: &[u8], w: usize, h: usize, tw: usize, th: usize, filter: Filter) -> Vec<u8> {
    let half = 1i32 << (PRECISION_BITS - 1);
    let mut src = pixels.to_vec();
    let mut width = w;
    if tw != w {
        let cols = coefficients(w, tw, filter);
        let mut out = vec![0u8; tw * h * 3];
        for y in 0..h {
            let row = &src[y * w * 3..(y + 1) * w * 3];
            for (xx, (xmin, k)) in cols.iter().enumerate() {
                for c in 0..3 {
                    let mut s = half;
                    for (i, &kw) in k.iter().enumerate() {
                        s += row[(xmin + i) * 3 + c] as i32 * kw;
                    }
                    out[(y * tw + xx) * 3 + c] = clip8(s);
                }
            }
        }
        src = out;
        width = tw;
    }
    if th != h {
        let rows = coefficients(h, th, filter);
        let mut out = vec![0u8; width * th * 3];
        for (yy, (ymin, k)) in rows.iter().enumerate() {
            for x in 0..width {
                for c in 0..3 {
                    let mut s = half;
                    for (i, &kw) in k.iter().enumerate() {
                        s += src[((ymin + i) * width + x) * 3 + c] as i32 * kw;
                    }
                    out[(yy * width + x) * 3 + c] = clip8(s);
                }
            }
        }
        src = out;
    }
    src
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ImageProcessorConfig {
        serde_json::from_str("{}").unwrap()
    }

    #[test]
    fn target_sizes_follow_transformers() {
        // 280 soft tokens, 16-pixel patches, 3x3 pooling: 2520 patches, sides multiples of 48.
        let c = cfg();
        assert_eq!(c.target_size(480, 640).unwrap(), (672, 912));
        assert_eq!(c.target_size(1000, 1000).unwrap(), (768, 768));
        // Extreme aspect ratios take the one-row fallback, capped at the longest side.
        assert_eq!(c.target_size(10, 4000).unwrap(), (48, 13440));
        assert_eq!(c.target_size(4000, 10).unwrap(), (13440, 48));
        // Tiny images are scaled up to the budget.
        assert_eq!(c.target_size(1, 1).unwrap(), (768, 768));
        assert_eq!(c.target_size(3, 2).unwrap(), (960, 624));
    }

    #[test]
    fn processor_configs_it_cannot_follow_are_refused_by_name() {
        let check = |json: &str| {
            serde_json::from_str::<ImageProcessorConfig>(json)
                .unwrap()
                .validate()
                .unwrap_err()
        };
        assert!(check(r#"{"max_soft_tokens": 100}"#).contains("max_soft_tokens must be one of"));
        assert!(check(r#"{"resample": 0}"#).contains("nearest"));
        assert!(check(r#"{"resample": 9}"#).contains("unknown resample filter 9"));
        assert!(check(r#"{"patch_size": 0}"#).contains("must be positive"));
        assert!(check(r#"{"image_std": [1.0, 0.0, 1.0]}"#).contains("image_std"));
    }

    #[test]
    fn broken_jpegs_are_refused_not_guessed() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/gemma4_vision_like/images/photo.jpg");
        let whole = std::fs::read(path).unwrap();
        assert!(decode_rgb(&whole).is_ok());
        for cut in [whole.len() - 2, whole.len() / 2, 40] {
            let e = decode_rgb(&whole[..cut]).err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains("Jpeg")),
                "cut at {cut}: {e:?}"
            );
        }
        // A corrupt header: an error, not a panic out of libjpeg.
        let mut bad = whole.clone();
        for b in &mut bad[20..60] {
            *b = 0xFF;
        }
        assert!(decode_rgb(&bad).is_err());
    }

    #[test]
    fn compositing_matches_pillows_arithmetic() {
        assert_eq!(over_white(0, 0), 255);
        assert_eq!(over_white(0, 255), 0);
        assert_eq!(over_white(200, 255), 200);
        // Pillow 13's alpha_composite onto white, read back.
        assert_eq!(over_white(0, 128), 127);
        assert_eq!(over_white(200, 100), 233);
        assert_eq!(over_white(13, 1), 254);
        assert_eq!(over_white(255, 254), 255);
    }
}
