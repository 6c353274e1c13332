//! Safetensors files in and out of MLX.
//!
//! [`load_safetensors`] first validates the file on our side: it memory-maps it, parses the
//! header with the `safetensors` crate, and checks every tensor's dtype and extent against the
//! file size, so a truncated or malformed file is an error naming the file and the tensor before
//! MLX sees any of it. The data then comes through MLX's own reader, which is lazy: a tensor is
//! read (with `pread`, straight into its MLX buffer) only when first evaluated, so tensors a
//! model never uses (vision towers, MTP layers it does not run) cost nothing.
//!
//! [`load_safetensors_mmap`] instead hands MLX pointers into a private mapping. That is
//! zero-copy where the allocator can adopt foreign memory (Metal); MLX's CPU allocator cannot
//! (its buffers carry a size header), so there it copies eagerly from the page cache, which
//! `benches/binding.rs` measures as slower than MLX's reader. Hence the default above.

use crate::array::{pack, unpack};
use crate::{Array, Dtype, Error, Result};
use memmap2::{MmapMut, MmapOptions};
use mlx_sys::ffi;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// The tensors of one safetensors file, by name, and its `__metadata__` strings.
#[derive(Debug, Default)]
pub struct Tensors {
    pub arrays: HashMap<String, Array>,
    pub metadata: HashMap<String, String>,
    /// The tensors stored as E4M3 float8 (`F8_E4M3`), which MLX has no dtype for: their arrays
    /// hold the uint8 codes ([`Array::from_fp8`] reads them).
    pub float8: Vec<String>,
}

fn format_err(path: &Path, message: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The MLX dtype of a safetensors dtype (`None`: one MLX has no equal of).
pub fn dtype_of(d: safetensors::Dtype) -> Option<Dtype> {
    use safetensors::Dtype as S;
    Some(match d {
        S::BOOL => Dtype::Bool,
        S::U8 => Dtype::U8,
        S::I8 => Dtype::I8,
        S::U16 => Dtype::U16,
        S::I16 => Dtype::I16,
        S::F16 => Dtype::F16,
        S::BF16 => Dtype::Bf16,
        S::U32 => Dtype::U32,
        S::I32 => Dtype::I32,
        S::F32 => Dtype::F32,
        S::U64 => Dtype::U64,
        S::I64 => Dtype::I64,
        S::F64 => Dtype::F64,
        _ => return None,
    })
}

/// Called by MLX (possibly on another thread) when it no longer needs a mapped buffer.
fn release_mapping(ctx: usize) {
    // SAFETY: `ctx` came from `Box::into_raw` in `load_safetensors` and MLX calls the deleter
    // exactly once.
    drop(unsafe { Box::from_raw(ctx as *mut Arc<MmapMut>) });
}

/// A tensor's entry in a validated header.
struct Entry {
    name: String,
    dtype: Dtype,
    /// Stored as `F8_E4M3` (held as uint8 codes).
    e4m3: bool,
    shape: Vec<i32>,
    /// Byte range within the file.
    range: std::ops::Range<usize>,
}

/// Maps `path` and checks its header and every tensor extent (see the module docs).
fn validate(path: &Path) -> Result<(MmapMut, Vec<Entry>, HashMap<String, String>)> {
    let io_err = |source| Error::Io {
        path: path.to_path_buf(),
        cause: source,
    };
    let file = File::open(path).map_err(io_err)?;
    let len = file.metadata().map_err(io_err)?.len() as usize;
    if len < 8 {
        return Err(format_err(
            path,
            format!("{len} bytes is too short for a safetensors file"),
        ));
    }
    // SAFETY: the mapping is private copy-on-write; a file changed underneath us by another
    // process would alter tensor values but cannot break memory safety of the mapping itself.
    let map = unsafe { MmapOptions::new().map_copy(&file) }.map_err(io_err)?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
        .map_err(|e| format_err(path, format!("not a valid safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    let mut entries = Vec::new();
    for (name, info) in meta.tensors() {
        let e4m3 = info.dtype == safetensors::Dtype::F8_E4M3;
        let dtype = match info.dtype {
            // MLX reads E4M3 codes as uint8 and decodes them with `from_fp8`.
            _ if e4m3 => Dtype::U8,
            safetensors::Dtype::F8_E5M2 => {
                return Err(format_err(
                    path,
                    format!(
                        "tensor {name} is F8_E5M2; only F8_E4M3 float8 checkpoints are supported"
                    ),
                ))
            }
            d => dtype_of(d).ok_or_else(|| {
                format_err(path, format!("tensor {name}: dtype {d:?} is not supported"))
            })?,
        };
        let (begin, end) = info.data_offsets;
        if data_start + end > len {
            return Err(format_err(
                path,
                format!(
                    "tensor {name} ends at byte {} but the file has {len} bytes (truncated?)",
                    data_start + end
                ),
            ));
        }
        let numel: usize = info.shape.iter().product();
        if numel * dtype.size() != end - begin {
            return Err(format_err(
                path,
                format!(
                    "tensor {name}: {} bytes do not hold shape {:?} of {dtype:?}",
                    end - begin,
                    info.shape
                ),
            ));
        }
        let shape = info
            .shape
            .iter()
            .map(|&d| i32::try_from(d))
            .collect::<std::result::Result<Vec<i32>, _>>()
            .map_err(|_| format_err(path, format!("tensor {name}: dimension too large")))?;
        entries.push(Entry {
            name: name.to_string(),
            dtype,
            e4m3,
            shape,
            range: data_start + begin..data_start + end,
        });
    }
    let metadata = meta.metadata().clone().unwrap_or_default();
    Ok((map, entries, metadata))
}

/// One tensor of a safetensors header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<i32>,
    pub nbytes: usize,
}

/// The validated header of a safetensors file, without reading any tensor data: its tensors
/// (sorted by name) and its `__metadata__` strings.
pub fn read_header(path: impl AsRef<Path>) -> Result<(Vec<TensorInfo>, HashMap<String, String>)> {
    let (_, entries, metadata) = validate(path.as_ref())?;
    let mut tensors: Vec<TensorInfo> = entries
        .into_iter()
        .map(|e| TensorInfo {
            nbytes: e.range.len(),
            name: e.name,
            dtype: e.dtype,
            shape: e.shape,
        })
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tensors, metadata))
}

/// Loads every tensor of a safetensors file, validated first, read lazily by MLX.
///
/// A truncated file, a header that does not parse, offsets past the end of the file or a dtype
/// MLX cannot hold are errors naming the file (and the tensor).
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Tensors> {
    let path = path.as_ref();
    let (map, entries, metadata) = validate(path)?;
    drop(map);
    let mut arrays = load_safetensors_mlx(path)?;
    for e in &entries {
        let ok = arrays
            .get(&e.name)
            .is_some_and(|a| a.shape() == e.shape && a.dtype() == e.dtype);
        if !ok {
            return Err(format_err(
                path,
                format!("MLX read tensor {} differently from its header", e.name),
            ));
        }
    }
    arrays.retain(|name, _| entries.iter().any(|e| &e.name == name));
    let float8 = float8_names(&entries);
    Ok(Tensors {
        arrays,
        metadata,
        float8,
    })
}

/// Loads every tensor through a private memory mapping (see the module docs).
pub fn load_safetensors_mmap(path: impl AsRef<Path>) -> Result<Tensors> {
    let path = path.as_ref();
    let (map, entries, metadata) = validate(path)?;
    let map = Arc::new(map);
    let mut arrays = HashMap::new();
    let float8 = float8_names(&entries);
    for e in entries {
        let bytes = &map[e.range.clone()];
        let array = if bytes.is_empty() || !(bytes.as_ptr() as usize).is_multiple_of(e.dtype.size())
        {
            // Empty or misaligned for its element type: copy rather than hand MLX a pointer its
            // kernels may not expect.
            Array::from_bytes(bytes, &e.shape, e.dtype)?
        } else {
            let ctx = Box::into_raw(Box::new(Arc::clone(&map))) as usize;
            Array::from_raw(ffi::from_external(
                bytes.as_ptr() as usize,
                &e.shape,
                e.dtype.code(),
                ctx,
                release_mapping,
            )?)
        };
        arrays.insert(e.name, array);
    }
    Ok(Tensors {
        arrays,
        metadata,
        float8,
    })
}

fn float8_names(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .filter(|e| e.e4m3)
        .map(|e| e.name.clone())
        .collect()
}

/// Loads a safetensors file with MLX's own reader alone, without our validation.
pub fn load_safetensors_mlx(path: impl AsRef<Path>) -> Result<HashMap<String, Array>> {
    let path = path.as_ref();
    let s = path
        .to_str()
        .ok_or_else(|| format_err(path, "path is not valid UTF-8"))?;
    let mut names = Vec::new();
    let arrays = unpack(ffi::load_safetensors(s, &mut names)?)?;
    Ok(names.into_iter().zip(arrays).collect())
}

/// The safetensors dtype of an MLX dtype (`None`: one safetensors cannot hold).
pub fn safetensors_dtype(d: Dtype) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Some(match d {
        Dtype::Bool => S::BOOL,
        Dtype::U8 => S::U8,
        Dtype::I8 => S::I8,
        Dtype::U16 => S::U16,
        Dtype::I16 => S::I16,
        Dtype::F16 => S::F16,
        Dtype::Bf16 => S::BF16,
        Dtype::U32 => S::U32,
        Dtype::I32 => S::I32,
        Dtype::F32 => S::F32,
        Dtype::U64 => S::U64,
        Dtype::I64 => S::I64,
        Dtype::F64 => S::F64,
        _ => return None,
    })
}

/// A safetensors file's bytes for `tensors` (evaluated here). The same tensors and metadata
/// always give the same bytes: the header is ordered by the `safetensors` crate, not by a hash
/// map, so content-addressed stores deduplicate them.
pub fn serialize_safetensors(
    tensors: &[(&str, &Array)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut data = Vec::with_capacity(tensors.len());
    for (name, a) in tensors {
        let dtype = safetensors_dtype(a.dtype()).ok_or_else(|| {
            Error::Invalid(format!(
                "tensor {name}: dtype {:?} cannot be written to safetensors",
                a.dtype()
            ))
        })?;
        let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
        data.push((name.to_string(), dtype, shape, a.to_bytes()?));
    }
    let views = data
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Invalid(format!("tensor {n}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, &metadata)
        .map_err(|e| Error::Invalid(format!("serializing safetensors: {e}")))
}

/// Writes `tensors` to a safetensors file with MLX's writer.
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Array)]) -> Result<()> {
    let path = path.as_ref();
    let s = path
        .to_str()
        .ok_or_else(|| format_err(path, "path is not valid UTF-8"))?;
    let names: Vec<String> = tensors.iter().map(|(n, _)| n.to_string()).collect();
    let arrays = pack(tensors.iter().map(|(_, a)| *a));
    Ok(ffi::save_safetensors(s, &names, &arrays)?)
}
