//! Evaluation, memory counters, safetensors loading, and the engine-thread pattern (docs/ARCHITECTURE.md, D3).

mod common;
use common::*;
use mlx::{io, memory, Array, Dtype};
use std::sync::mpsc;

#[test]
fn library_reports_itself() {
    assert_eq!(mlx::version(), "0.32.4");
    assert!(!mlx::blas_library().is_empty());
    assert_eq!(mlx::default_device(), mlx::Device::Cpu);
}

#[test]
fn eval_and_async_eval_compute() {
    let a = arr(&[1., 2.], &[2]);
    let b = a.multiply_scalar(3.0).unwrap();
    let c = b.add_scalar(1.0).unwrap();
    mlx::async_eval(&[&b, &c]).unwrap();
    mlx::eval(&[&c]).unwrap();
    c.eval().unwrap();
    assert_eq!(f32s(&c), vec![4., 7.]);
    mlx::synchronize().unwrap();
}

#[test]
fn reads_wait_for_arrays_in_flight_and_any_layout() {
    // In flight: read once its own evaluation is done, while later work may still be queued.
    let a = arr(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let token = a.multiply_scalar(2.0).unwrap();
    mlx::async_eval(&[&token]).unwrap();
    let later = token.matmul(&token.t().unwrap()).unwrap();
    mlx::async_eval(&[&later]).unwrap();
    assert_eq!(f32s(&token), vec![2., 4., 6., 8., 10., 12.]);
    // Evaluated views that are not row-contiguous still read in row-major order.
    let t = token.t().unwrap();
    t.eval().unwrap();
    assert_eq!(f32s(&t), vec![2., 8., 4., 10., 6., 12.]);
    let b = arr(&[1., 2.], &[2, 1]).broadcast_to(&[2, 2]).unwrap();
    b.eval().unwrap();
    assert_eq!(f32s(&b), vec![1., 1., 2., 2.]);
    assert_eq!(f32s(&later), vec![56., 128., 128., 308.]);
}

#[test]
fn memory_counters_move() {
    let before = memory::active();
    let x = Array::zeros(&[1 << 20], Dtype::F32).unwrap();
    x.eval().unwrap();
    assert!(memory::active() >= before + (4 << 20) || memory::peak() >= 4 << 20);
    assert!(memory::peak() >= 4 << 20);
    let old = memory::set_cache_limit(0);
    memory::set_cache_limit(old);
    memory::clear_cache();
    assert!(memory::limit() > 0);
    let _ = memory::cache();
}

fn write_safetensors(
    path: &std::path::Path,
    tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)],
) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn safetensors_load_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let big = pseudo_random(1 << 20, 9);
    let small: Vec<u8> = [1i32, -2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
    let h: Vec<u8> = [1.5f32, -0.25]
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    write_safetensors(
        &path,
        &[
            (
                "big",
                safetensors::Dtype::F32,
                vec![1024, 1024],
                bytes_of(&big),
            ),
            ("ids", safetensors::Dtype::I32, vec![3], small),
            ("h", safetensors::Dtype::BF16, vec![2], h),
        ],
    );
    let t = io::load_safetensors(&path).unwrap();
    let a = &t.arrays["big"];
    assert_eq!(a.shape(), vec![1024, 1024]);
    assert_eq!(a.to_vec::<f32>().unwrap(), big);
    assert_eq!(t.arrays["ids"].to_vec::<i32>().unwrap(), vec![1, -2, 3]);
    assert_eq!(f32s(&t.arrays["h"]), vec![1.5, -0.25]);
    // Loaded tensors compute like any other array.
    let s = a.sum_all(false).unwrap().item::<f32>().unwrap();
    let want: f64 = big.iter().map(|&v| f64::from(v)).sum();
    assert!((f64::from(s) - want).abs() < 1e-1);
    drop(t);

    // The other two loaders give the same values.
    let m = io::load_safetensors_mlx(&path).unwrap();
    assert_eq!(m["big"].to_vec::<f32>().unwrap(), big);
    let m = io::load_safetensors_mmap(&path).unwrap();
    assert_eq!(m.arrays["big"].to_vec::<f32>().unwrap(), big);
    assert_eq!(f32s(&m.arrays["h"]), vec![1.5, -0.25]);

    // And MLX's writer round-trips through our reader.
    let out = dir.path().join("out.safetensors");
    let x = arr(&[1., 2., 3.], &[3]);
    io::save_safetensors(&out, &[("x", &x)]).unwrap();
    assert_eq!(
        f32s(&io::load_safetensors(&out).unwrap().arrays["x"]),
        vec![1., 2., 3.]
    );
}

#[test]
fn bad_safetensors_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    write_safetensors(
        &path,
        &[(
            "w",
            safetensors::Dtype::F32,
            vec![64, 64],
            bytes_of(&pseudo_random(4096, 1)),
        )],
    );
    let full = std::fs::read(&path).unwrap();

    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &full[..full.len() - 100]).unwrap();
    let e = io::load_safetensors(&cut).unwrap_err().to_string();
    assert!(e.contains("cut.safetensors"), "{e}");
    assert!(io::load_safetensors_mmap(&cut).is_err());
    assert!(e.contains("truncated") || e.contains("not a valid"), "{e}");

    let tiny = dir.path().join("tiny.safetensors");
    std::fs::write(&tiny, b"abc").unwrap();
    let e = io::load_safetensors(&tiny).unwrap_err().to_string();
    assert!(e.contains("too short"), "{e}");

    let junk = dir.path().join("junk.safetensors");
    let mut bytes = 16u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{not json at all");
    std::fs::write(&junk, bytes).unwrap();
    let e = io::load_safetensors(&junk).unwrap_err().to_string();
    assert!(e.contains("not a valid safetensors file"), "{e}");

    let e = io::load_safetensors(dir.path().join("missing.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.safetensors"), "{e}");

    // MLX's own reader reports a truncated file as an error too, never an abort.
    assert!(io::load_safetensors_mlx(&cut)
        .and_then(|m| m["w"].eval())
        .is_err());
}

/// Decision D3: one thread owns MLX; other threads talk to it through channels.
#[test]
fn engine_thread_pattern() {
    enum Cmd {
        MatSum(Vec<f32>, mpsc::Sender<Result<f32, String>>),
        Bad(mpsc::Sender<Result<f32, String>>),
    }
    let (tx, rx) = mpsc::channel::<Cmd>();
    let engine = std::thread::spawn(move || {
        mlx::init_thread().unwrap();
        for cmd in rx {
            match cmd {
                Cmd::MatSum(v, reply) => {
                    let r = (|| -> mlx::Result<f32> {
                        let a = Array::from_slice(&v, &[2, 2])?;
                        a.matmul(&a)?.sum_all(false)?.item::<f32>()
                    })();
                    reply.send(r.map_err(|e| e.to_string())).unwrap();
                }
                Cmd::Bad(reply) => {
                    let r = (|| -> mlx::Result<f32> {
                        let a = Array::zeros(&[2, 3], Dtype::F32)?;
                        a.matmul(&a)?.item::<f32>()
                    })();
                    reply.send(r.map_err(|e| e.to_string())).unwrap();
                }
            }
        }
    });
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let (rtx, rrx) = mpsc::channel();
                let x = i as f32;
                tx.send(Cmd::MatSum(vec![x, 1., 1., x], rtx)).unwrap();
                // [[x,1],[1,x]]² = [[x²+1, 2x], [2x, x²+1]] sums to 2x² + 4x + 2.
                assert_eq!(rrx.recv().unwrap().unwrap(), 2. * x * x + 4. * x + 2.);
                let (rtx, rrx) = mpsc::channel();
                tx.send(Cmd::Bad(rtx)).unwrap();
                assert!(rrx.recv().unwrap().unwrap_err().contains("[matmul]"));
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    drop(tx);
    engine.join().unwrap();
}
