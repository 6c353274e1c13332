//! MLX's allocator counters and limits, in bytes.

use mlx_sys::ffi;

/// Bytes held by live arrays.
pub fn active() -> usize {
    ffi::active_memory()
}

/// The high-water mark of [`active`] since start or [`reset_peak`].
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
