use half::{bf16, f16};

/// MLX element types. The discriminants are the values of `mlx::core::Dtype::Val`, which is how
/// dtypes cross the bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    Bool = 0,
    U8 = 1,
    U16 = 2,
    U32 = 3,
    U64 = 4,
    I8 = 5,
    I16 = 6,
    I32 = 7,
    I64 = 8,
    F16 = 9,
    F32 = 10,
    F64 = 11,
    Bf16 = 12,
    Complex64 = 13,
}

impl Dtype {
    pub(crate) fn from_code(code: u8) -> Dtype {
        use Dtype::*;
        const ALL: [Dtype; 14] = [
            Bool, U8, U16, U32, U64, I8, I16, I32, I64, F16, F32, F64, Bf16, Complex64,
        ];
        // MLX only hands back codes it defined; the table covers all of them.
        ALL.get(code as usize).copied().unwrap_or(Complex64)
    }

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | U8 | I8 => 1,
            U16 | I16 | F16 | Bf16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | Complex64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::F32 | Dtype::F64 | Dtype::Bf16)
    }

    pub fn is_integer(self) -> bool {
        use Dtype::*;
        matches!(self, U8 | U16 | U32 | U64 | I8 | I16 | I32 | I64)
    }

    /// The dtype named the way safetensors and config files write it.
    pub fn from_name(name: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match name.to_ascii_lowercase().as_str() {
            "bool" => Bool,
            "u8" | "uint8" => U8,
            "u16" | "uint16" => U16,
            "u32" | "uint32" => U32,
            "u64" | "uint64" => U64,
            "i8" | "int8" => I8,
            "i16" | "int16" => I16,
            "i32" | "int32" => I32,
            "i64" | "int64" => I64,
            "f16" | "float16" | "half" => F16,
            "f32" | "float32" | "float" => F32,
            "f64" | "float64" | "double" => F64,
            "bf16" | "bfloat16" => Bf16,
            _ => return None,
        })
    }
}

/// A Rust type that can be copied in and out of an MLX array bit for bit.
///
/// # Safety
/// `Self` must have exactly the size and bit layout of `DTYPE`'s elements.
pub unsafe trait Element: Copy + Default + 'static {
    const DTYPE: Dtype;
    /// Lossy conversion used for scalars; exact for every value that fits.
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($t:ty, $d:ident, $conv:expr) => {
        unsafe impl Element for $t {
            const DTYPE: Dtype = Dtype::$d;
            fn to_f64(self) -> f64 {
                let f: fn($t) -> f64 = $conv;
                f(self)
            }
        }
    };
}

element!(bool, Bool, |v| f64::from(u8::from(v)));
element!(u8, U8, f64::from);
element!(u16, U16, f64::from);
element!(u32, U32, f64::from);
element!(u64, U64, |v| v as f64);
element!(i8, I8, f64::from);
element!(i16, I16, f64::from);
element!(i32, I32, f64::from);
element!(i64, I64, |v| v as f64);
element!(f16, F16, f64::from);
element!(f32, F32, f64::from);
element!(f64, F64, |v| v);
element!(bf16, Bf16, f64::from);
