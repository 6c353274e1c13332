//! A safe, method-based Rust API over MLX (docs/ARCHITECTURE.md, D2).
//!
//! This crate owns the boundary between Rust and MLX: [`Array`] and its operations, dtypes,
//! devices and streams, evaluation, memory counters, random keys, the `fast` kernels,
//! quantization and safetensors loading. Every MLX error — C++ exceptions included — comes back
//! as [`Error`]; nothing here panics or aborts on bad arguments.
//!
//! MLX streams are per thread and arrays are not `Send`: everything MLX lives on one thread
//! (docs/ARCHITECTURE.md, D3). A thread other than the one that first touched MLX calls [`init_thread`] once.

mod array;
pub mod distributed;
mod dtype;
mod error;
pub mod fast;
mod index;
pub mod io;
pub mod memory;
mod ops;
pub mod random;
pub mod rows;
mod runtime;

pub use array::Array;
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use fast::SdpaMask;
pub use index::Ix;
pub use ops::{
    concatenate, quantized_panels_apply, set_quantized_panels, stack, where_, QuantMode, Quantized,
    QUANT_PANEL,
};
pub use rows::{RowFormat, Rows};
pub use runtime::{
    async_eval, blas_library, default_device, eval, gpu_available, graph_ops, init_thread,
    openblas_config, quantized_kernel_counts, quantized_kernel_description, set_blas_threads,
    set_default_device, set_quantized_kernel, set_quantized_unpacking, synchronize, version,
    Device,
};
