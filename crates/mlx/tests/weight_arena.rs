//! Weights moved into huge pages (crates/mlx-sys/src/weight_arena.cc): the arrays keep their
//! values and work in every op, arrays that share a buffer or are not evaluated stay where
//! they are, and the region is counted as active memory until its last array is dropped.
//! One test in its own process: it reads the process-wide memory counter.

use mlx::{memory, random, Array, Dtype};

fn values(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

#[test]
fn weights_move_into_huge_pages_and_keep_working() {
    let big = random::normal(&[1024, 1024], Dtype::F32, 0.0, 1.0, None).unwrap();
    let small = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let shared = random::normal(&[64, 64], Dtype::F32, 0.0, 1.0, None).unwrap();
    let view = shared.slice_axis(0, 0, Some(8)).unwrap();
    mlx::eval(&[&big, &small, &shared, &view]).unwrap();
    let lazy = small.multiply_scalar(2.0).unwrap();
    let (big_before, shared_before) = (values(&big), values(&shared));
    let before = memory::active();

    // A clone is the same array: moving it moves the one buffer.
    let handle = big.clone();
    let moved = memory::move_to_huge_pages([&big, &handle, &small, &shared, &lazy]).unwrap();
    assert_eq!(
        moved,
        big.nbytes() + small.nbytes(),
        "only the evaluated arrays that own their buffer move"
    );
    assert!(
        memory::active() >= before,
        "the region is counted where the old buffers were"
    );

    assert_eq!(values(&big), big_before);
    assert_eq!(values(&handle), big_before);
    assert_eq!(values(&small), vec![1.0, 2.0, 3.0]);
    assert_eq!(values(&shared), shared_before);
    assert_eq!(values(&view), shared_before[..8 * 64].to_vec());
    assert_eq!(values(&lazy), vec![2.0, 4.0, 6.0]);
    // Moved arrays are ordinary inputs: an op reads them and its output is MLX's own buffer.
    let doubled = big.multiply_scalar(2.0).unwrap();
    let want: Vec<f32> = big_before.iter().map(|v| v * 2.0).collect();
    assert_eq!(values(&doubled), want);
    let row = big
        .slice_axis(0, 3, Some(4))
        .unwrap()
        .matmul(&big.t().unwrap())
        .unwrap();
    assert_eq!(row.shape(), vec![1, 1024]);
    row.eval().unwrap();

    // A tensor over the 64 MB slabs the copy releases its source in: every slab arrives.
    let large = random::normal(&[5000, 4200], Dtype::F32, 0.0, 1.0, None).unwrap();
    large.eval().unwrap();
    let sum = |a: &Array| a.sum_all(false).unwrap().to_vec::<f32>().unwrap()[0];
    let (large_sum, large_tail) = (
        sum(&large),
        values(&large.slice_axis(0, 4999, None).unwrap()),
    );
    assert_eq!(
        memory::move_to_huge_pages([&large]).unwrap(),
        large.nbytes()
    );
    assert_eq!(sum(&large), large_sum);
    assert_eq!(
        values(&large.slice_axis(0, 4999, None).unwrap()),
        large_tail
    );
    drop(large);

    // Moving again finds nothing left to move (the moved arrays own a region's slice, not an
    // MLX buffer).
    assert_eq!(memory::move_to_huge_pages([&big, &small]).unwrap(), 0);

    // Dropping every array of the region unmaps it.
    let with_region = memory::active();
    drop((big, handle, small));
    assert!(
        memory::active() + (4 << 20) <= with_region,
        "the region was released: {} then {}",
        with_region,
        memory::active()
    );
}
