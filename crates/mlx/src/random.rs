//! Random numbers from explicit keys (MLX's counter-based PRNG), so that a seeded request draws
//! the same numbers whatever else runs beside it. `key = None` uses MLX's global key sequence.

use crate::ops::ptr;
use crate::{Array, Dtype, Result};
use mlx_sys::ffi;

/// A PRNG key from a seed.
pub fn key(seed: u64) -> Result<Array> {
    Ok(Array::from_raw(ffi::random_key(seed)?))
}

/// `num` independent keys derived from `key`, stacked as `[num, 2]`.
pub fn split(key: &Array, num: i32) -> Result<Array> {
    Ok(Array::from_raw(ffi::random_split(key.arr(), num)?))
}

/// Uniform in `[low, high)`.
pub fn uniform(
    shape: &[i32],
    dtype: Dtype,
    low: f64,
    high: f64,
    key: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::random_uniform(shape, dtype.code(), low, high, ptr(key))?
    }))
}

pub fn normal(
    shape: &[i32],
    dtype: Dtype,
    loc: f64,
    scale: f64,
    key: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::random_normal(shape, dtype.code(), loc, scale, ptr(key))?
    }))
}

/// Integers in `[low, high)`.
pub fn randint(
    shape: &[i32],
    dtype: Dtype,
    low: i64,
    high: i64,
    key: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::random_randint(shape, dtype.code(), low, high, ptr(key))?
    }))
}

/// Samples indices from the unnormalised log-probabilities `logits` along `axis`; with
/// `num_samples` a new trailing axis holds that many draws.
pub fn categorical(
    logits: &Array,
    axis: i32,
    num_samples: Option<i32>,
    key: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::random_categorical(logits.arr(), axis, num_samples.unwrap_or(0), ptr(key))?
    }))
}

/// True with probability `p` (broadcast to `shape` when given).
pub fn bernoulli(p: &Array, shape: Option<&[i32]>, key: Option<&Array>) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::random_bernoulli(p.arr(), shape.unwrap_or(&[]), shape.is_some(), ptr(key))?
    }))
}

/// Standard Gumbel noise.
pub fn gumbel(shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    // SAFETY: the pointer is null or points at an array that outlives the call.
    Ok(Array::from_raw(unsafe {
        ffi::random_gumbel(shape, dtype.code(), ptr(key))?
    }))
}
