//! Which matrices `create` quantizes, and how (MLX affine quantization, as mlx-lm does it).

use mlx::Array;

/// The group size of every quantized matrix (mlx-lm's default).
pub const GROUP_SIZE: i32 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Q4,
    Q8,
}

impl QuantType {
    pub fn bits(self) -> i32 {
        match self {
            QuantType::Q4 => 4,
            QuantType::Q8 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4 => "q4",
            QuantType::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for QuantType {
    type Err = String;
    fn from_str(s: &str) -> Result<QuantType, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4" | "int4" => Ok(QuantType::Q4),
            "q8" | "int8" => Ok(QuantType::Q8),
            _ => Err(format!(
                "unknown quantization {s:?} (expected q4 or q8; int4 and int8 are aliases)"
            )),
        }
    }
}

/// What happens to one tensor of a model being quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Quantize,
    /// A matrix the model would quantize, but whose input dimension is not a multiple of the
    /// group size: it stays as it is (mlx-lm's rule), and `show` lists it.
    KeepShape,
    /// Not a matrix the model quantizes: norms, routers, biases, scalars, integer tables, the
    /// towers of other modalities.
    Keep,
}

/// Whether the tensor `name` (a `.weight` of a linear, embedding or stacked-expert module)
/// is quantized. Routers stay in full precision: their top-k choice is where 4-bit error hurts
/// most, and they are tiny.
pub fn decide(name: &str, a: &Array) -> Decision {
    let Some(module) = name.strip_suffix(".weight") else {
        return Decision::Keep;
    };
    let last = module.rsplit('.').next().unwrap_or(module);
    let router = module.contains(".router.") || module.ends_with(".router") || last == "gate";
    let other_modality = ["vision", "audio", "multi_modal_projector", "embed_vision"]
        .iter()
        .any(|m| module.contains(m));
    if router || other_modality || last.contains("norm") || a.ndim() < 2 || !a.dtype().is_float() {
        return Decision::Keep;
    }
    if a.shape().last().copied().unwrap_or(0) % GROUP_SIZE != 0 {
        return Decision::KeepShape;
    }
    Decision::Quantize
}
