use crate::{Dtype, Element, Error, Result};
use cxx::UniquePtr;
use mlx_sys::ffi;

/// An MLX array: a lazily evaluated, reference-counted n-dimensional buffer.
///
/// Cloning is cheap (the buffer is shared, as in MLX). Operations build a graph; data is
/// computed when it is read ([`Array::to_vec`], [`Array::item`]) or evaluated ([`crate::eval`]).
/// Not `Send`: MLX streams are per thread (docs/ARCHITECTURE.md, D3).
pub struct Array {
    pub(crate) raw: UniquePtr<ffi::Arr>,
}

impl Array {
    pub(crate) fn from_raw(raw: UniquePtr<ffi::Arr>) -> Array {
        Array { raw }
    }

    pub(crate) fn arr(&self) -> &ffi::Arr {
        // A null pointer is never stored: every constructor goes through a successful ffi call.
        self.raw.as_ref().expect("Array holds a null pointer")
    }

    /// Copies `data` into a new array of the given shape.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        // SAFETY: `Element` guarantees T is plain data of `size_of::<T>()` bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        Self::from_bytes(bytes, shape, T::DTYPE)
    }

    /// Copies raw little-endian bytes into a new array of `dtype`.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        Ok(Self::from_raw(ffi::from_bytes(bytes, shape, dtype.code())?))
    }

    /// A zero-dimensional array holding `v`, exactly.
    pub fn scalar<T: Element>(v: T) -> Result<Array> {
        Self::from_slice(&[v], &[])
    }

    /// A zero-dimensional array of `dtype` holding `v` converted to it.
    pub fn scalar_as(v: f64, dtype: Dtype) -> Result<Array> {
        Ok(Self::from_raw(ffi::scalar(v, dtype.code())?))
    }

    pub fn full(shape: &[i32], v: f64, dtype: Dtype) -> Result<Array> {
        Ok(Self::from_raw(ffi::full(shape, v, dtype.code())?))
    }

    pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::full(shape, 0.0, dtype)
    }

    pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::full(shape, 1.0, dtype)
    }

    /// An array of this one's shape and dtype filled with `v`.
    pub fn full_like(&self, v: f64) -> Result<Array> {
        Ok(Self::from_raw(ffi::full_like(self.arr(), v)?))
    }

    pub fn zeros_like(&self) -> Result<Array> {
        self.full_like(0.0)
    }

    /// `[start, stop)` in steps of `step`, as NumPy's `arange`.
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        Ok(Self::from_raw(ffi::arange(
            start,
            stop,
            step,
            dtype.code(),
        )?))
    }

    /// An `n × m` array with ones at and below the `k`-th diagonal.
    pub fn tri(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<Array> {
        Ok(Self::from_raw(ffi::tri(n, m, k, dtype.code())?))
    }

    pub fn shape(&self) -> Vec<i32> {
        ffi::shape(self.arr())
    }

    /// The size of `axis` (negative counts from the end).
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let a = if axis < 0 { axis + n } else { axis };
        if a < 0 || a >= n {
            return Err(Error::Invalid(format!(
                "axis {axis} is out of range for an array of {n} dimensions"
            )));
        }
        Ok(shape[a as usize])
    }

    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(ffi::dtype(self.arr()))
    }

    pub fn ndim(&self) -> usize {
        ffi::ndim(self.arr())
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        ffi::size(self.arr())
    }

    pub fn nbytes(&self) -> usize {
        ffi::nbytes(self.arr())
    }

    /// Which array this is: equal for every handle of one array (clones share it), different
    /// for any other array, even one made from it.
    pub fn id(&self) -> usize {
        ffi::id(self.arr())
    }

    /// Computes this array now.
    pub fn eval(&self) -> Result<()> {
        Ok(ffi::eval(self.arr())?)
    }

    /// Evaluates and copies the elements out in row-major order. `T` must be the array's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let got = self.dtype();
        if got != T::DTYPE {
            return Err(Error::Dtype {
                expected: T::DTYPE,
                got,
            });
        }
        let mut out = vec![T::default(); self.size()];
        // SAFETY: `Element` guarantees T is plain data with the dtype's layout, so any bytes MLX
        // writes form valid values (bool arrays hold only 0 or 1).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                out.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(out.as_slice()),
            )
        };
        ffi::copy_to(self.arr(), bytes)?;
        Ok(out)
    }

    /// Evaluates and copies the raw elements out in row-major order, whatever the dtype.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.nbytes()];
        ffi::copy_to(self.arr(), &mut out)?;
        Ok(out)
    }

    /// The single element of a one-element array.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::Invalid(format!(
                "item() needs an array of one element, this one has shape {:?}",
                self.shape()
            )));
        }
        Ok(self.to_vec::<T>()?[0])
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        Self::from_raw(ffi::clone(self.arr()))
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Array({:?}, {:?})", self.shape(), self.dtype())
    }
}

/// Packs arrays for a call that takes a `std::vector<array>`.
pub(crate) fn pack<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> UniquePtr<ffi::ArrVec> {
    let mut v = ffi::vec_new();
    for a in arrays {
        ffi::vec_push(v.pin_mut(), a.arr());
    }
    v
}

/// Unpacks a `std::vector<array>` returned by MLX.
pub(crate) fn unpack(v: UniquePtr<ffi::ArrVec>) -> Result<Vec<Array>> {
    let v = v
        .as_ref()
        .ok_or_else(|| Error::Mlx("MLX returned no array list".into()))?;
    (0..ffi::vec_len(v))
        .map(|i| Ok(Array::from_raw(ffi::vec_get(v, i)?)))
        .collect()
}
