//! MLX's allocator counters and limits, in bytes.

use crate::array::pack;
use crate::{Array, Result};
use mlx_sys::ffi;

/// Bytes held by live arrays: MLX's allocator's, plus the huge-page regions weights were
/// moved into ([`move_to_huge_pages`]).
pub fn active() -> usize {
    ffi::active_memory() + ffi::huge_page_bytes()
}

/// The high-water mark of MLX's allocator's part of [`active`] since start or [`reset_peak`].
pub fn peak() -> usize {
    ffi::peak_memory()
}

/// Bytes kept by MLX's buffer cache for reuse.
pub fn cache() -> usize {
    ffi::cache_memory()
}

pub fn reset_peak() {
    ffi::reset_peak_memory()
}

pub fn limit() -> usize {
    ffi::memory_limit()
}

/// Sets the allocation limit and returns the previous one.
pub fn set_limit(bytes: usize) -> usize {
    ffi::set_memory_limit(bytes)
}

/// Sets the buffer-cache limit and returns the previous one.
pub fn set_cache_limit(bytes: usize) -> usize {
    ffi::set_cache_limit(bytes)
}

/// Frees the buffer cache.
pub fn clear_cache() {
    ffi::clear_cache()
}

/// Copies evaluated arrays (a model's weights) into one region of transparent huge pages and
/// points each at its copy, returning the bytes moved.
///
/// A CPU decode step streams every weight once; from 2 MB pages that stream runs ~15% faster
/// than from malloc's 4 KB ones (crates/mlx-sys/src/weight_arena.cc). Arrays that share their
/// buffer with another, views and unevaluated arrays stay where they are, as does everything
/// when MLX runs on a GPU. Moved arrays leave MLX's allocator; [`active`] counts their region
/// instead, until the last of them is dropped and it is unmapped.
pub fn move_to_huge_pages<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<usize> {
    Ok(ffi::move_to_huge_pages(&pack(arrays))?)
}
