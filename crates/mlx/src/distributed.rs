//! MLX's distributed backends: a group of processes (ranks) and the collectives between them.
//!
//! The collectives are lazy operations like any other: they run when an array that depends on
//! them is evaluated, on the thread that owns MLX. Every rank must evaluate the same collectives
//! in the same order, or the ranks wait on each other for ever; a peer whose connection drops
//! makes the waiting evaluation fail with MLX's message instead (docs/DISTRIBUTED.md).

use crate::array::Array;
use crate::{Dtype, Result};
use cxx::UniquePtr;
use mlx_sys::ffi;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once this process has joined a group (see [`joined`]).
static JOINED: AtomicBool = AtomicBool::new(false);

/// Whether this process joined a group. MLX keeps every group it forms in a static registry,
/// destroyed by the C++ static destructors at `exit`; the ring backend's destructor stops each
/// socket's thread by setting a plain flag and notifying its condition variable without taking
/// the thread's lock, a lost wake-up: now and then the thread has just found nothing to do and
/// sleeps through the notice, and the destructor's `join` waits for ever. A process that joined
/// must therefore end with `_exit` (after flushing what it wrote), never by returning from
/// `main`.
pub fn joined() -> bool {
    JOINED.load(Ordering::Relaxed)
}

/// The ranks this process joined.
pub struct Group {
    raw: UniquePtr<ffi::DistGroup>,
}

/// Whether MLX was built with `backend` (`ring`, `mpi`, `nccl`, `jaccl`).
pub fn is_available(backend: &str) -> bool {
    ffi::distributed_available(backend)
}

impl Group {
    /// Joins the group `backend` describes. The ring backend reads the rank's place from
    /// `MLX_HOSTFILE` (a JSON list, per rank, of the `ip:port` addresses it listens on) and
    /// `MLX_RANK`; it returns once this rank is connected to both of its neighbours, and waits
    /// for them as long as it takes.
    pub fn init(backend: &str) -> Result<Group> {
        let raw = ffi::distributed_init(backend)?;
        JOINED.store(true, Ordering::Relaxed);
        Ok(Group { raw })
    }

    pub fn rank(&self) -> usize {
        ffi::group_rank(&self.raw) as usize
    }

    pub fn size(&self) -> usize {
        ffi::group_size(&self.raw) as usize
    }

    /// The element-wise sum of `x` over every rank, on every rank.
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        Ok(Array::from_raw(ffi::dist_all_sum(x.arr(), &self.raw)?))
    }

    /// Every rank's `x` concatenated along the first axis, in rank order, on every rank.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        Ok(Array::from_raw(ffi::dist_all_gather(x.arr(), &self.raw)?))
    }

    /// Sends `x` to rank `dst` when the returned array is evaluated.
    pub fn send(&self, x: &Array, dst: usize) -> Result<Array> {
        Ok(Array::from_raw(ffi::dist_send(
            x.arr(),
            dst as i32,
            &self.raw,
        )?))
    }

    /// An array of `shape` and `dtype` received from rank `src` when it is evaluated.
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: usize) -> Result<Array> {
        Ok(Array::from_raw(ffi::dist_recv(
            shape,
            dtype.code(),
            src as i32,
            &self.raw,
        )?))
    }

    /// `x` of rank `root` on every rank (every rank passes an array of the same shape and
    /// dtype; the others' values are ignored). Exact: the others add zeros.
    pub fn broadcast(&self, x: &Array, root: usize) -> Result<Array> {
        if self.size() == 1 {
            return Ok(x.clone());
        }
        let mine = if self.rank() == root {
            x.clone()
        } else {
            x.zeros_like()?
        };
        self.all_sum(&mine)
    }
}
