//! Raw bridge to our C++ shim over MLX (docs/ARCHITECTURE.md, D2). Use the safe `mlx` crate instead.
//!
//! Every fallible function returns `Result`: cxx catches the C++ exception MLX throws and hands
//! back its message. Optional arrays are nullable `*const Arr`; dtypes cross as the numeric value
//! of `mlx::core::Dtype::Val`.
#![allow(clippy::too_many_arguments)]
// The unsafe functions take nullable `*const Arr`: each must be null or point at a live `Arr`
// for the duration of the call. The safe `mlx` crate is the only caller and guarantees it.
#![allow(clippy::missing_safety_doc)]

#[cxx::bridge(namespace = "mlxr")]
pub mod ffi {
    #[repr(u8)]
    #[derive(Debug, Clone, Copy)]
    enum UnaryOp {
        Abs,
        Negative,
        Sign,
        Exp,
        Log,
        Log1p,
        Sqrt,
        Rsqrt,
        Square,
        Reciprocal,
        Tanh,
        Sigmoid,
        Erf,
        Sin,
        Cos,
        Floor,
        Ceil,
        Round,
        LogicalNot,
        IsNan,
        IsInf,
        StopGradient,
        Copy,
        Contiguous,
    }

    #[repr(u8)]
    #[derive(Debug, Clone, Copy)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        FloorDivide,
        Remainder,
        Power,
        Maximum,
        Minimum,
        Equal,
        NotEqual,
        Less,
        LessEqual,
        Greater,
        GreaterEqual,
        LogicalAnd,
        LogicalOr,
        LogAddExp,
    }

    #[repr(u8)]
    #[derive(Debug, Clone, Copy)]
    enum ReduceOp {
        Sum,
        Mean,
        Max,
        Min,
        Prod,
        All,
        Any,
        LogSumExp,
    }

    /// A rotation (RoPE) of a head's first `dims` features: adjacent pairs `(2j, 2j+1)` when
    /// `traditional`, else the rotate-half pairs `(j, j + dims/2)`; pair `j`'s wavelength
    /// `base^(2j/dims)` when `has_base`, else the array the call passes; positions times `scale`.
    #[derive(Debug, Clone, Copy)]
    struct Rotation {
        dims: i32,
        traditional: bool,
        base: f32,
        has_base: bool,
        scale: f32,
    }

    /// The heads of a decode step's q/k/v op: query and key/value heads, and the epsilon of
    /// their RMS norms.
    #[derive(Debug, Clone, Copy)]
    struct QkvHeads {
        q_heads: i32,
        kv_heads: i32,
        eps: f32,
    }

    unsafe extern "C++" {
        include!("mlx-sys/src/shim.h");

        type Arr;
        type ArrVec;
        type DistGroup;

        // library
        fn version() -> String;
        fn blas_library() -> String;
        fn openblas_config() -> String;
        fn set_blas_threads(n: i32);
        fn gpu_available() -> bool;
        fn set_default_device(gpu: bool) -> Result<()>;
        fn default_device_is_gpu() -> bool;
        fn init_thread() -> Result<()>;
        fn synchronize() -> Result<()>;

        // memory
        fn active_memory() -> usize;
        fn peak_memory() -> usize;
        fn cache_memory() -> usize;
        fn reset_peak_memory();
        fn memory_limit() -> usize;
        fn set_memory_limit(bytes: usize) -> usize;
        fn set_cache_limit(bytes: usize) -> usize;
        fn clear_cache();
        fn move_to_huge_pages(v: &ArrVec) -> Result<usize>;
        fn huge_page_bytes() -> usize;

        // construction and read-back
        fn from_bytes(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<Arr>>;
        fn from_external(
            ptr: usize,
            shape: &[i32],
            dtype: u8,
            ctx: usize,
            release: fn(usize),
        ) -> Result<UniquePtr<Arr>>;
        fn scalar(v: f64, dtype: u8) -> Result<UniquePtr<Arr>>;
        fn full(shape: &[i32], v: f64, dtype: u8) -> Result<UniquePtr<Arr>>;
        fn full_like(a: &Arr, v: f64) -> Result<UniquePtr<Arr>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8) -> Result<UniquePtr<Arr>>;
        fn tri(n: i32, m: i32, k: i32, dtype: u8) -> Result<UniquePtr<Arr>>;
        fn clone(a: &Arr) -> UniquePtr<Arr>;
        fn shape(a: &Arr) -> Vec<i32>;
        fn dtype(a: &Arr) -> u8;
        fn ndim(a: &Arr) -> usize;
        fn size(a: &Arr) -> usize;
        fn nbytes(a: &Arr) -> usize;
        fn id(a: &Arr) -> usize;
        fn eval(a: &Arr) -> Result<()>;
        fn eval_all(v: &ArrVec) -> Result<()>;
        fn async_eval_all(v: &ArrVec) -> Result<()>;
        fn copy_to(a: &Arr, out: &mut [u8]) -> Result<()>;
        fn vec_new() -> UniquePtr<ArrVec>;
        fn vec_push(v: Pin<&mut ArrVec>, a: &Arr);
        fn vec_len(v: &ArrVec) -> usize;
        fn vec_get(v: &ArrVec, i: usize) -> Result<UniquePtr<Arr>>;

        // element-wise
        fn unary(op: UnaryOp, a: &Arr) -> Result<UniquePtr<Arr>>;
        fn binary(op: BinaryOp, a: &Arr, b: &Arr) -> Result<UniquePtr<Arr>>;
        fn where_(cond: &Arr, x: &Arr, y: &Arr) -> Result<UniquePtr<Arr>>;
        fn astype(a: &Arr, dtype: u8) -> Result<UniquePtr<Arr>>;
        fn from_fp8(a: &Arr, dtype: u8) -> Result<UniquePtr<Arr>>;
        fn view(a: &Arr, dtype: u8) -> Result<UniquePtr<Arr>>;
        unsafe fn clip(a: &Arr, lo: *const Arr, hi: *const Arr) -> Result<UniquePtr<Arr>>;

        // shape
        fn reshape(a: &Arr, shape: &[i32]) -> Result<UniquePtr<Arr>>;
        fn transpose(a: &Arr, axes: &[i32]) -> Result<UniquePtr<Arr>>;
        fn swapaxes(a: &Arr, a1: i32, a2: i32) -> Result<UniquePtr<Arr>>;
        fn expand_dims(a: &Arr, axes: &[i32]) -> Result<UniquePtr<Arr>>;
        fn squeeze(a: &Arr, axes: &[i32]) -> Result<UniquePtr<Arr>>;
        fn flatten(a: &Arr, start: i32, end: i32) -> Result<UniquePtr<Arr>>;
        fn broadcast_to(a: &Arr, shape: &[i32]) -> Result<UniquePtr<Arr>>;
        fn concatenate(v: &ArrVec, axis: i32) -> Result<UniquePtr<Arr>>;
        fn stack(v: &ArrVec, axis: i32) -> Result<UniquePtr<Arr>>;
        fn split_sections(a: &Arr, n: i32, axis: i32) -> Result<UniquePtr<ArrVec>>;
        fn split_indices(a: &Arr, indices: &[i32], axis: i32) -> Result<UniquePtr<ArrVec>>;
        fn repeat(a: &Arr, repeats: i32, axis: i32) -> Result<UniquePtr<Arr>>;
        fn tile(a: &Arr, reps: &[i32]) -> Result<UniquePtr<Arr>>;
        fn pad(a: &Arr, axes: &[i32], lo: &[i32], hi: &[i32], value: f64)
            -> Result<UniquePtr<Arr>>;
        fn flip(a: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;

        // indexing
        fn slice(a: &Arr, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<UniquePtr<Arr>>;
        fn slice_dynamic(
            a: &Arr,
            start: &Arr,
            axes: &[i32],
            sizes: &[i32],
        ) -> Result<UniquePtr<Arr>>;
        fn slice_update(
            src: &Arr,
            upd: &Arr,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Arr>>;
        fn slice_update_dynamic(
            src: &Arr,
            upd: &Arr,
            start: &Arr,
            axes: &[i32],
        ) -> Result<UniquePtr<Arr>>;
        fn take(a: &Arr, idx: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;
        fn take_flat(a: &Arr, idx: &Arr) -> Result<UniquePtr<Arr>>;
        fn take_along_axis(a: &Arr, idx: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;
        fn put_along_axis(a: &Arr, idx: &Arr, vals: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;
        fn scatter_add_axis(a: &Arr, idx: &Arr, vals: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;
        fn scatter_add(a: &Arr, idx: &ArrVec, upd: &Arr, axes: &[i32]) -> Result<UniquePtr<Arr>>;
        fn scatter(a: &Arr, idx: &ArrVec, upd: &Arr, axes: &[i32]) -> Result<UniquePtr<Arr>>;

        // reductions, scans, sorting
        fn reduce(op: ReduceOp, a: &Arr, axes: &[i32], keepdims: bool) -> Result<UniquePtr<Arr>>;
        fn reduce_all(op: ReduceOp, a: &Arr, keepdims: bool) -> Result<UniquePtr<Arr>>;
        fn argmax(a: &Arr, axis: i32, keepdims: bool) -> Result<UniquePtr<Arr>>;
        fn argmin(a: &Arr, axis: i32, keepdims: bool) -> Result<UniquePtr<Arr>>;
        fn softmax(a: &Arr, axes: &[i32], precise: bool) -> Result<UniquePtr<Arr>>;
        fn cumsum(a: &Arr, axis: i32, reverse: bool, inclusive: bool) -> Result<UniquePtr<Arr>>;
        fn cummax(a: &Arr, axis: i32, reverse: bool, inclusive: bool) -> Result<UniquePtr<Arr>>;
        fn sort(a: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;
        fn argsort(a: &Arr, axis: i32) -> Result<UniquePtr<Arr>>;
        fn partition(a: &Arr, kth: i32, axis: i32) -> Result<UniquePtr<Arr>>;
        fn argpartition(a: &Arr, kth: i32, axis: i32) -> Result<UniquePtr<Arr>>;
        fn topk(a: &Arr, k: i32, axis: i32) -> Result<UniquePtr<Arr>>;

        // linear algebra and quantization
        fn matmul(a: &Arr, b: &Arr) -> Result<UniquePtr<Arr>>;
        /// `x @ W` for `W` held as column panels `[N / 32, K, 32]` (mlx::fast::pack_panels).
        fn panel_matmul(x: &Arr, panels: &Arr) -> Result<UniquePtr<Arr>>;
        fn addmm(c: &Arr, a: &Arr, b: &Arr, alpha: f32, beta: f32) -> Result<UniquePtr<Arr>>;
        unsafe fn gather_mm(
            a: &Arr,
            b: &Arr,
            lhs: *const Arr,
            rhs: *const Arr,
            sorted: bool,
        ) -> Result<UniquePtr<Arr>>;
        /// `mode`: 0 affine, 1 mxfp4, 2 nvfp4, 3 mxfp8; biases are affine's only.
        fn quantize(w: &Arr, group_size: i32, bits: i32, mode: i32) -> Result<UniquePtr<ArrVec>>;
        unsafe fn dequantize(
            w: &Arr,
            scales: &Arr,
            biases: *const Arr,
            group_size: i32,
            bits: i32,
            mode: i32,
        ) -> Result<UniquePtr<Arr>>;
        #[allow(clippy::too_many_arguments)]
        unsafe fn quantized_matmul(
            x: &Arr,
            w: &Arr,
            scales: &Arr,
            biases: *const Arr,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: i32,
        ) -> Result<UniquePtr<Arr>>;
        /// `x @ dequantize(w[i])ᵀ` for every matrix of one format; one op on the CPU.
        fn quantized_matmuls(
            x: &Arr,
            w: &ArrVec,
            scales: &ArrVec,
            biases: &ArrVec,
            group_size: i32,
            bits: i32,
            mode: i32,
        ) -> Result<UniquePtr<ArrVec>>;
        /// `act(x @ dequantize(gate)ᵀ) * (x @ dequantize(up)ᵀ)`, act 0 gelu_tanh, 1 silu; one
        /// op on the CPU.
        #[allow(clippy::too_many_arguments)]
        unsafe fn quantized_glu(
            x: &Arr,
            gate_w: &Arr,
            gate_scales: &Arr,
            gate_biases: *const Arr,
            up_w: &Arr,
            up_scales: &Arr,
            up_biases: *const Arr,
            group_size: i32,
            bits: i32,
            act: u8,
            mode: i32,
        ) -> Result<UniquePtr<Arr>>;
        /// Turns mlx-runner's CPU quantized-matmul kernel on (the default) or off.
        /// Primitives still to run in the graphs behind `v`, one `name count` line per kind.
        fn graph_ops(v: &ArrVec) -> String;
        fn set_quantized_kernel(on: bool);
        /// Whether affine matrices of `bits` in groups of `group_size` are multiplied from
        /// 16-output panels here (mlx::Quantized::paneled): AVX-512, 4 or 8 bits.
        fn quantized_panels_apply(bits: i32, group_size: i32) -> bool;
        fn set_quantized_unpacking(mode: i32);
        fn quantized_unpacking() -> i32;
        /// Products the kernel computed, by path (dequantize + sgemm when true).
        fn quantized_kernel_count(sgemm_path: bool) -> u64;
        unsafe fn gather_qmm(
            x: &Arr,
            w: &Arr,
            scales: &Arr,
            biases: *const Arr,
            lhs: *const Arr,
            rhs: *const Arr,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: i32,
            sorted: bool,
        ) -> Result<UniquePtr<Arr>>;

        // fast
        unsafe fn rms_norm(x: &Arr, w: *const Arr, eps: f32) -> Result<UniquePtr<Arr>>;
        /// `(residual + rms_norm(x, w, eps)) · scale`, one op on the CPU.
        unsafe fn rms_norm_residual(
            x: &Arr,
            w: *const Arr,
            eps: f32,
            residual: &Arr,
            scale: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn rms_norm_residual_norm(
            x: &Arr,
            w: *const Arr,
            eps: f32,
            residual: &Arr,
            scale: *const Arr,
            next_w: &Arr,
        ) -> Result<UniquePtr<ArrVec>>;
        /// `dequantize(w[ids]) · scale` (with `has_scale`): a quantized embedding lookup, one
        /// op on the CPU.
        #[allow(clippy::too_many_arguments)]
        fn quantized_embedding(
            ids: &Arr,
            w: &Arr,
            scales: &Arr,
            biases: &Arr,
            group_size: i32,
            bits: i32,
            mode: i32,
            scale: f32,
            has_scale: bool,
        ) -> Result<UniquePtr<Arr>>;
        /// `x @ dequantize(w)ᵀ`, then the residual update of `rms_norm_residual` (and with
        /// `next_w` the next norm) of the product: one op on the CPU.
        unsafe fn quantized_matmul_norm(
            x: &Arr,
            w: &Arr,
            scales: &Arr,
            biases: *const Arr,
            group_size: i32,
            bits: i32,
            mode: i32,
            norm_w: *const Arr,
            eps: f32,
            residual: &Arr,
            scale: *const Arr,
            next_w: *const Arr,
        ) -> Result<UniquePtr<ArrVec>>;
        unsafe fn layer_norm(
            x: &Arr,
            w: *const Arr,
            b: *const Arr,
            eps: f32,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn rope(
            x: &Arr,
            rotation: &Rotation,
            offset: i32,
            freqs: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn rope_dynamic(
            x: &Arr,
            rotation: &Rotation,
            offset: &Arr,
            freqs: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn heads_norm_rope(
            y: &Arr,
            heads: i32,
            w: *const Arr,
            eps: f32,
            rotate: bool,
            rotation: &Rotation,
            offsets: &Arr,
            freqs: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn qkv_heads(
            q: &Arr,
            k: &Arr,
            v: &Arr,
            heads: &QkvHeads,
            q_norm: &Arr,
            k_norm: &Arr,
            rotation: &Rotation,
            offsets: &Arr,
            freqs: *const Arr,
        ) -> Result<UniquePtr<ArrVec>>;
        /// `quantized_matmuls` of `x` (q, k and with three matrices v; with two the values are
        /// the keys), then `qkv_heads` of them: one op on the CPU.
        unsafe fn quantized_qkv_heads(
            x: &Arr,
            w: &ArrVec,
            scales: &ArrVec,
            biases: &ArrVec,
            group_size: i32,
            bits: i32,
            mode: i32,
            heads: &QkvHeads,
            q_norm: &Arr,
            k_norm: &Arr,
            rotation: &Rotation,
            offsets: &Arr,
            freqs: *const Arr,
        ) -> Result<UniquePtr<ArrVec>>;
        /// Attention over the first `keys` slots of `k` and `v`; with `k_new` and `v_new`,
        /// their rows written at slot `write_at` first: [out] or [out, k', v']; `out` is
        /// [B, Hq, L, Dv], or with `tokens` [B, L, Hq·Dv].
        unsafe fn sdpa_slots(
            q: &Arr,
            k: &ArrVec,
            v: &ArrVec,
            keys: i32,
            k_new: &ArrVec,
            v_new: &ArrVec,
            write_at: i32,
            group: i32,
            bits: i32,
            scale: f32,
            mask_mode: &str,
            mask: *const Arr,
            sinks: *const Arr,
            tokens: bool,
        ) -> Result<UniquePtr<ArrVec>>;
        fn gelu_tanh(x: &Arr) -> Result<UniquePtr<Arr>>;
        /// Softmax over the last axis (a vectorized kernel on the CPU for float32).
        fn softmax_last(x: &Arr) -> Result<UniquePtr<Arr>>;
        /// `cap · tanh(x / cap)`.
        fn softcap(x: &Arr, cap: f32) -> Result<UniquePtr<Arr>>;
        /// `silu(g) * u`.
        fn silu_mul(g: &Arr, u: &Arr) -> Result<UniquePtr<Arr>>;
        fn sigmoid_mul(g: &Arr, u: &Arr) -> Result<UniquePtr<Arr>>;
        /// Turns mlx-runner's fused CPU kernels (RMS norm, RoPE, attention, GELU) on or off.
        fn set_fused_kernels(on: bool);
        fn set_vector_width(bits: i32);
        /// Evaluations of one fused kernel: 0 RMS norm, 1 RoPE, 2 attention, 3 GELU, 4 few-row matmul,
        /// 5 soft-capping, 6 silu(g) · u, 7 heads' norm and rotation, 9 softmax, 10 panel matmul;
        /// 8 counts attention's cache writes that had to copy their buffer.
        fn fused_kernel_count(kind: u8) -> u64;

        // random
        fn random_key(seed: u64) -> Result<UniquePtr<Arr>>;
        fn random_split(key: &Arr, num: i32) -> Result<UniquePtr<Arr>>;
        unsafe fn random_uniform(
            shape: &[i32],
            dtype: u8,
            low: f64,
            high: f64,
            key: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn random_normal(
            shape: &[i32],
            dtype: u8,
            loc: f64,
            scale: f64,
            key: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn random_randint(
            shape: &[i32],
            dtype: u8,
            low: i64,
            high: i64,
            key: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn random_categorical(
            logits: &Arr,
            axis: i32,
            num_samples: i32,
            key: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn random_bernoulli(
            p: &Arr,
            shape: &[i32],
            has_shape: bool,
            key: *const Arr,
        ) -> Result<UniquePtr<Arr>>;
        unsafe fn random_gumbel(
            shape: &[i32],
            dtype: u8,
            key: *const Arr,
        ) -> Result<UniquePtr<Arr>>;

        // io
        // distributed
        fn distributed_available(backend: &str) -> bool;
        fn distributed_init(backend: &str) -> Result<UniquePtr<DistGroup>>;
        fn group_rank(g: &DistGroup) -> i32;
        fn group_size(g: &DistGroup) -> i32;
        fn dist_all_sum(x: &Arr, g: &DistGroup) -> Result<UniquePtr<Arr>>;
        fn dist_all_gather(x: &Arr, g: &DistGroup) -> Result<UniquePtr<Arr>>;
        fn dist_send(x: &Arr, dst: i32, g: &DistGroup) -> Result<UniquePtr<Arr>>;
        fn dist_recv(shape: &[i32], dtype: u8, src: i32, g: &DistGroup) -> Result<UniquePtr<Arr>>;

        fn load_safetensors(path: &str, names: &mut Vec<String>) -> Result<UniquePtr<ArrVec>>;
        fn save_safetensors(path: &str, names: &[String], arrays: &ArrVec) -> Result<()>;
    }
}

pub use ffi::*;
