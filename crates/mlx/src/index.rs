//! Indexing with Python's semantics: `a[1:-1]`, `a[::-2]`, `a[-1]`, `a[None]`, `a[..., 0]`.
//!
//! Every bound is resolved on the Rust side exactly as Python's `slice.indices(n)` does
//! (negative values count from the end, out-of-range values clamp, `stop = None` is the end
//! sentinel, `slice(0, 0)` is empty) and MLX only ever sees non-negative, in-range bounds with a
//! positive stride. A negative step becomes a positive-step slice followed by a flip.

use crate::{Array, Error, Result};
use mlx_sys::ffi;
use std::ops::{Range, RangeFrom, RangeFull, RangeTo};

/// One entry of an index expression.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ix {
    /// `start:stop:step`; `None` bounds take Python's defaults for the sign of `step`.
    Slice {
        start: Option<i32>,
        stop: Option<i32>,
        step: i32,
    },
    /// A single position; removes the axis.
    At(i32),
    /// `None` / `np.newaxis`: inserts an axis of size 1.
    NewAxis,
    /// `...`: as many full slices as the other entries leave.
    Ellipsis,
}

impl Ix {
    /// `start:stop:step` with optional bounds.
    pub fn slice(start: Option<i32>, stop: Option<i32>, step: i32) -> Ix {
        Ix::Slice { start, stop, step }
    }

    /// `:` — the whole axis.
    pub fn full() -> Ix {
        Ix::slice(None, None, 1)
    }
}

impl From<i32> for Ix {
    fn from(i: i32) -> Ix {
        Ix::At(i)
    }
}
impl From<Range<i32>> for Ix {
    fn from(r: Range<i32>) -> Ix {
        Ix::slice(Some(r.start), Some(r.end), 1)
    }
}
impl From<RangeFrom<i32>> for Ix {
    fn from(r: RangeFrom<i32>) -> Ix {
        Ix::slice(Some(r.start), None, 1)
    }
}
impl From<RangeTo<i32>> for Ix {
    fn from(r: RangeTo<i32>) -> Ix {
        Ix::slice(None, Some(r.end), 1)
    }
}
impl From<RangeFull> for Ix {
    fn from(_: RangeFull) -> Ix {
        Ix::full()
    }
}

/// `ix![.., 0, 1..3]` builds a `[Ix; N]` from anything convertible to [`Ix`].
#[macro_export]
macro_rules! ix {
    ($($e:expr),* $(,)?) => { [$($crate::Ix::from($e)),*] };
}

/// A slice resolved against a dimension of size `n`: the first index, the count and the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub start: i64,
    pub len: i64,
    pub step: i64,
}

/// Python's `slice(start, stop, step).indices(n)` followed by the length computation.
pub(crate) fn resolve(
    start: Option<i32>,
    stop: Option<i32>,
    step: i32,
    n: i32,
) -> Result<Resolved> {
    if step == 0 {
        return Err(Error::Invalid("slice step cannot be zero".into()));
    }
    let (n, step) = (i64::from(n), i64::from(step));
    let norm = |v: i32, lo: i64, hi: i64| {
        let v = i64::from(v);
        let v = if v < 0 { v + n } else { v };
        v.clamp(lo, hi)
    };
    let (start, stop) = if step > 0 {
        (
            start.map_or(0, |v| norm(v, 0, n)),
            stop.map_or(n, |v| norm(v, 0, n)),
        )
    } else {
        (
            start.map_or(n - 1, |v| norm(v, -1, n - 1)),
            stop.map_or(-1, |v| norm(v, -1, n - 1)),
        )
    };
    let len = if step > 0 {
        (stop - start + step - 1).div_euclid(step).max(0)
    } else {
        (start - stop - step - 1).div_euclid(-step).max(0)
    };
    Ok(Resolved { start, len, step })
}

fn resolve_at(i: i32, n: i32, axis: usize) -> Result<i32> {
    let j = if i < 0 { i + n } else { i };
    if j < 0 || j >= n {
        return Err(Error::Invalid(format!(
            "index {i} is out of bounds for axis {axis} with size {n}"
        )));
    }
    Ok(j)
}

/// One axis of a plan: positive-step bounds for MLX plus what to do afterwards.
struct AxisPlan {
    start: i32,
    stop: i32,
    step: i32,
    flip: bool,
    squeeze: bool,
}

struct Plan {
    axes: Vec<AxisPlan>,
    /// Positions in the *result* where a new axis of size 1 goes.
    new_axes: Vec<i32>,
}

impl Plan {
    /// The (start, stop, stride) vectors MLX's slice and slice_update take.
    fn bounds(&self) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        (
            self.axes.iter().map(|a| a.start).collect(),
            self.axes.iter().map(|a| a.stop).collect(),
            self.axes.iter().map(|a| a.step).collect(),
        )
    }

    /// Axes indexed by a single position.
    fn squeezed(&self) -> Vec<i32> {
        (0..self.axes.len() as i32)
            .filter(|&i| self.axes[i as usize].squeeze)
            .collect()
    }

    /// Reverses the axes that a negative step selected back to front.
    fn flip(&self, mut a: Array) -> Result<Array> {
        for (axis, p) in self.axes.iter().enumerate() {
            if p.flip {
                a = a.flip(axis as i32)?;
            }
        }
        Ok(a)
    }
}

fn plan(shape: &[i32], index: &[Ix]) -> Result<Plan> {
    let consumed = index
        .iter()
        .filter(|i| matches!(i, Ix::Slice { .. } | Ix::At(_)))
        .count();
    if index.iter().filter(|i| matches!(i, Ix::Ellipsis)).count() > 1 {
        return Err(Error::Invalid("an index can have only one ellipsis".into()));
    }
    if consumed > shape.len() {
        return Err(Error::Invalid(format!(
            "too many indices: {consumed} for an array of {} dimensions",
            shape.len()
        )));
    }
    let mut expanded: Vec<Ix> = Vec::with_capacity(index.len() + shape.len());
    for ix in index {
        if let Ix::Ellipsis = ix {
            expanded.extend(std::iter::repeat_n(Ix::full(), shape.len() - consumed));
        } else {
            expanded.push(*ix);
        }
    }
    let mut axes = Vec::with_capacity(shape.len());
    let mut new_axes = Vec::new();
    let mut out_pos = 0i32;
    for ix in expanded {
        let axis = axes.len();
        match ix {
            Ix::NewAxis => {
                new_axes.push(out_pos);
                out_pos += 1;
            }
            Ix::At(i) => {
                let j = resolve_at(i, shape[axis], axis)?;
                axes.push(AxisPlan {
                    start: j,
                    stop: j + 1,
                    step: 1,
                    flip: false,
                    squeeze: true,
                });
            }
            Ix::Slice { start, stop, step } => {
                axes.push(positive(resolve(start, stop, step, shape[axis])?));
                out_pos += 1;
            }
            Ix::Ellipsis => unreachable!("ellipsis was expanded above"),
        }
    }
    // Axes the index does not mention are taken whole, as in NumPy.
    for &n in &shape[axes.len()..] {
        axes.push(positive(resolve(None, None, 1, n)?));
    }
    Ok(Plan { axes, new_axes })
}

/// The positive-step bounds covering the same elements as `r`, and whether to flip afterwards.
fn positive(r: Resolved) -> AxisPlan {
    if r.len == 0 {
        return AxisPlan {
            start: 0,
            stop: 0,
            step: 1,
            flip: false,
            squeeze: false,
        };
    }
    if r.step > 0 {
        return AxisPlan {
            start: r.start as i32,
            stop: (r.start + (r.len - 1) * r.step + 1) as i32,
            step: r.step as i32,
            flip: false,
            squeeze: false,
        };
    }
    let last = r.start + (r.len - 1) * r.step;
    AxisPlan {
        start: last as i32,
        stop: (r.start + 1) as i32,
        step: (-r.step) as i32,
        flip: true,
        squeeze: false,
    }
}

impl Array {
    /// `a[index]` with Python semantics. See [`Ix`] and the [`ix!`](crate::ix) macro.
    pub fn index(&self, index: &[Ix]) -> Result<Array> {
        let shape = self.shape();
        let plan = plan(&shape, index)?;
        let (start, stop, step) = plan.bounds();
        let mut out = plan.flip(Array::from_raw(ffi::slice(
            self.arr(),
            &start,
            &stop,
            &step,
        )?))?;
        let squeeze = plan.squeezed();
        if !squeeze.is_empty() {
            out = out.squeeze_axes(&squeeze)?;
        }
        if !plan.new_axes.is_empty() {
            out = out.expand_dims_axes(&plan.new_axes)?;
        }
        Ok(out)
    }

    /// `a[start:stop]` along one axis with Python semantics (`stop = None` is the end).
    pub fn slice_axis(&self, axis: i32, start: i32, stop: Option<i32>) -> Result<Array> {
        let nd = self.ndim() as i32;
        let ax = if axis < 0 { axis + nd } else { axis };
        if ax < 0 || ax >= nd {
            return Err(Error::Invalid(format!(
                "axis {axis} is out of range for an array of {nd} dimensions"
            )));
        }
        let mut index = vec![Ix::full(); ax as usize];
        index.push(Ix::slice(Some(start), stop, 1));
        self.index(&index)
    }

    /// A copy of `self` with `self[index] = update` (NumPy assignment; `update` broadcasts).
    /// `NewAxis` is not allowed here.
    pub fn slice_update(&self, update: &Array, index: &[Ix]) -> Result<Array> {
        if index.iter().any(|i| matches!(i, Ix::NewAxis)) {
            return Err(Error::Invalid(
                "slice_update does not take NewAxis entries".into(),
            ));
        }
        let shape = self.shape();
        let plan = plan(&shape, index)?;
        // The selected region's shape, with squeezed axes kept as size 1.
        let region: Vec<i32> = plan
            .axes
            .iter()
            .map(|a| {
                if a.stop <= a.start {
                    0
                } else {
                    (a.stop - a.start + a.step - 1) / a.step
                }
            })
            .collect();
        let kept: Vec<i32> = plan
            .axes
            .iter()
            .zip(&region)
            .filter(|(a, _)| !a.squeeze)
            .map(|(_, &n)| n)
            .collect();
        let mut upd = update.broadcast_to(&kept)?;
        let squeezed = plan.squeezed();
        if !squeezed.is_empty() {
            upd = upd.expand_dims_axes(&squeezed)?;
        }
        let upd = plan.flip(upd)?.astype(self.dtype())?;
        let (start, stop, step) = plan.bounds();
        Ok(Array::from_raw(ffi::slice_update(
            self.arr(),
            upd.arr(),
            &start,
            &stop,
            &step,
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python's own answer, computed as `len(range(*slice(a, b, c).indices(n)))` and
    /// `slice(a, b, c).indices(n)[0]` for each case.
    #[test]
    fn resolve_matches_python() {
        type Case = (Option<i32>, Option<i32>, i32, i32, i64, i64);
        let cases: &[Case] = &[
            (None, None, 1, 5, 0, 5),
            (Some(0), Some(0), 1, 5, 0, 0),
            (Some(-2), None, 1, 5, 3, 2),
            (Some(1), Some(-1), 1, 5, 1, 3),
            (Some(-10), Some(10), 1, 5, 0, 5),
            (Some(4), Some(1), 1, 5, 4, 0),
            (None, None, 2, 5, 0, 3),
            (None, None, -1, 5, 4, 5),
            (None, None, -2, 5, 4, 3),
            (Some(3), Some(0), -1, 5, 3, 3),
            (Some(-1), Some(-6), -1, 5, 4, 5),
            (Some(10), None, -3, 5, 4, 2),
            (None, None, 1, 0, 0, 0),
            (None, None, -1, 0, -1, 0),
        ];
        for &(a, b, c, n, start, len) in cases {
            let r = resolve(a, b, c, n).unwrap();
            assert_eq!(
                (r.start, r.len),
                (start, len),
                "slice({a:?}, {b:?}, {c}) of {n}"
            );
        }
        assert!(resolve(None, None, 0, 3).is_err());
    }
}
