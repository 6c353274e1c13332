//! Construction, read-back, dtypes, shape operations and indexing.
//! Expected values are worked out by hand (or, where noted, with NumPy 2.x).

mod common;
use common::*;
use half::{bf16, f16};
use mlx::{concatenate, ix, stack, Array, Dtype, Error, Ix};

#[test]
fn round_trips_every_dtype() {
    let f = Array::from_slice(&[1.5f32, -2.0, 3.25], &[3]).unwrap();
    assert_eq!(f.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.25]);
    assert_eq!(f.dtype(), Dtype::F32);

    let h: Vec<f16> = [0.5f32, -1.0].iter().map(|&v| f16::from_f32(v)).collect();
    assert_eq!(
        Array::from_slice(&h, &[2])
            .unwrap()
            .to_vec::<f16>()
            .unwrap(),
        h
    );
    let b: Vec<bf16> = [0.5f32, 3.0].iter().map(|&v| bf16::from_f32(v)).collect();
    let ba = Array::from_slice(&b, &[2]).unwrap();
    assert_eq!(ba.dtype(), Dtype::Bf16);
    assert_eq!(ba.to_vec::<bf16>().unwrap(), b);

    let i = Array::from_slice(&[-7i32, 9], &[2]).unwrap();
    assert_eq!(i.to_vec::<i32>().unwrap(), vec![-7, 9]);
    let u = Array::from_slice(&[7u32, u32::MAX], &[2]).unwrap();
    assert_eq!(u.to_vec::<u32>().unwrap(), vec![7, u32::MAX]);
    let l = Array::from_slice(&[i64::MIN, 1 << 40], &[2]).unwrap();
    assert_eq!(l.to_vec::<i64>().unwrap(), vec![i64::MIN, 1 << 40]);
    let by = Array::from_slice(&[0u8, 255], &[2]).unwrap();
    assert_eq!(by.to_vec::<u8>().unwrap(), vec![0, 255]);
    let bo = Array::from_slice(&[true, false, true], &[3]).unwrap();
    assert_eq!(bo.to_vec::<bool>().unwrap(), vec![true, false, true]);
    assert_eq!(bo.dtype(), Dtype::Bool);
}

#[test]
fn scalars_fills_and_ranges() {
    assert_eq!(Array::scalar(42i64).unwrap().item::<i64>().unwrap(), 42);
    assert_eq!(Array::scalar(2.5f32).unwrap().shape(), Vec::<i32>::new());
    assert_eq!(
        Array::scalar_as(3.7, Dtype::I32)
            .unwrap()
            .item::<i32>()
            .unwrap(),
        3
    );
    let z = Array::zeros(&[2, 3], Dtype::F32).unwrap();
    assert_eq!(z.shape(), vec![2, 3]);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 6]);
    assert_eq!(
        Array::ones(&[2], Dtype::I32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        vec![1, 1]
    );
    assert_eq!(
        Array::full(&[2], 7.0, Dtype::U8)
            .unwrap()
            .to_vec::<u8>()
            .unwrap(),
        vec![7, 7]
    );
    assert_eq!(
        Array::arange(0.0, 5.0, 2.0, Dtype::I32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        vec![0, 2, 4]
    );
    // np.tri(3, 3, 0)
    assert_eq!(
        i32s(&Array::tri(3, 3, 0, Dtype::I32).unwrap()),
        vec![1, 0, 0, 1, 1, 0, 1, 1, 1]
    );
    let x = arr(&[1.0, 2.0], &[2]);
    assert_eq!(f32s(&x.full_like(9.0).unwrap()), vec![9.0, 9.0]);
    assert_eq!(x.size(), 2);
    assert_eq!(x.nbytes(), 8);
    assert_eq!(x.ndim(), 1);
}

#[test]
fn read_back_checks_dtype_and_size() {
    let x = arr(&[1.0, 2.0], &[2]);
    match x.to_vec::<i32>() {
        Err(Error::Dtype { expected, got }) => {
            assert_eq!((expected, got), (Dtype::I32, Dtype::F32));
        }
        other => panic!("expected a dtype error, got {other:?}"),
    }
    let e = x.item::<f32>().unwrap_err().to_string();
    assert!(e.contains("one element"), "{e}");
    let e = Array::from_slice(&[1.0f32, 2.0, 3.0], &[2, 2]).unwrap_err();
    assert!(e.to_string().contains("do not fill"), "{e}");
}

#[test]
fn shape_operations() {
    let x = arr(&[0., 1., 2., 3., 4., 5.], &[2, 3]);
    assert_eq!(x.reshape(&[3, -1]).unwrap().shape(), vec![3, 2]);
    let t = x.transpose(&[1, 0]).unwrap();
    assert_eq!(t.shape(), vec![3, 2]);
    assert_eq!(f32s(&t), vec![0., 3., 1., 4., 2., 5.]);
    assert_eq!(f32s(&x.t().unwrap()), f32s(&t));
    let y = Array::zeros(&[2, 3, 4], Dtype::F32).unwrap();
    assert_eq!(y.swapaxes(0, 2).unwrap().shape(), vec![4, 3, 2]);
    assert_eq!(x.expand_dims(1).unwrap().shape(), vec![2, 1, 3]);
    assert_eq!(x.expand_dims(-1).unwrap().shape(), vec![2, 3, 1]);
    assert_eq!(
        x.expand_dims(0).unwrap().squeeze(0).unwrap().shape(),
        vec![2, 3]
    );
    assert_eq!(y.flatten(1, 2).unwrap().shape(), vec![2, 12]);
    let b = arr(&[1., 2., 3.], &[3]).broadcast_to(&[2, 3]).unwrap();
    assert_eq!(f32s(&b), vec![1., 2., 3., 1., 2., 3.]);

    let c = concatenate(&[&x, &x], 0).unwrap();
    assert_eq!(c.shape(), vec![4, 3]);
    let c = concatenate(&[&x, &x], 1).unwrap();
    assert_eq!(
        f32s(&c),
        vec![0., 1., 2., 0., 1., 2., 3., 4., 5., 3., 4., 5.]
    );
    let s = stack(&[&x, &x], 1).unwrap();
    assert_eq!(s.shape(), vec![2, 2, 3]);

    let parts = x.split(3, 1).unwrap();
    assert_eq!(parts.len(), 3);
    assert_eq!(f32s(&parts[1]), vec![1., 4.]);
    let parts = x.split_at(&[1], 1).unwrap();
    assert_eq!(parts[0].shape(), vec![2, 1]);
    assert_eq!(parts[1].shape(), vec![2, 2]);
    assert_eq!(f32s(&parts[1]), vec![1., 2., 4., 5.]);

    assert_eq!(
        f32s(&arr(&[1., 2.], &[2]).repeat(2, 0).unwrap()),
        vec![1., 1., 2., 2.]
    );
    assert_eq!(
        f32s(&arr(&[1., 2.], &[2]).tile(&[2]).unwrap()),
        vec![1., 2., 1., 2.]
    );
    let p = arr(&[1., 2.], &[2]).pad(&[0], &[1], &[2], -1.0).unwrap();
    assert_eq!(f32s(&p), vec![-1., 1., 2., -1., -1.]);
    assert_eq!(
        f32s(&arr(&[1., 2., 3.], &[3]).flip(0).unwrap()),
        vec![3., 2., 1.]
    );
}

/// Expected values are Python's `list(range(10))[...]` / NumPy indexing of `arange(12).reshape(3, 4)`.
#[test]
fn slicing_follows_python() {
    let v = Array::arange(0.0, 10.0, 1.0, Dtype::I32).unwrap();
    let s = |i: Ix| i32s(&v.index(&[i]).unwrap());
    assert_eq!(s((2..5).into()), vec![2, 3, 4]);
    assert_eq!(s((-3..).into()), vec![7, 8, 9]);
    assert_eq!(s((..-7).into()), vec![0, 1, 2]);
    assert_eq!(s((0..0).into()), Vec::<i32>::new());
    assert_eq!(s(Ix::slice(Some(5), Some(2), 1)), Vec::<i32>::new());
    assert_eq!(s((-100..100).into()), (0..10).collect::<Vec<_>>());
    assert_eq!(s(Ix::slice(None, None, 3)), vec![0, 3, 6, 9]);
    assert_eq!(s(Ix::slice(Some(1), Some(8), 3)), vec![1, 4, 7]);
    assert_eq!(
        s(Ix::slice(None, None, -1)),
        vec![9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    );
    assert_eq!(s(Ix::slice(None, None, -4)), vec![9, 5, 1]);
    assert_eq!(s(Ix::slice(Some(-2), Some(2), -3)), vec![8, 5]);
    assert_eq!(s(Ix::slice(Some(2), Some(5), -1)), Vec::<i32>::new());
    assert_eq!(s(Ix::slice(Some(3), None, 1)), vec![3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(v.index(&[Ix::At(-1)]).unwrap().item::<i32>().unwrap(), 9);
    assert_eq!(v.index(&[Ix::At(-1)]).unwrap().ndim(), 0);

    let m = Array::arange(0.0, 12.0, 1.0, Dtype::I32)
        .unwrap()
        .reshape(&[3, 4])
        .unwrap();
    assert_eq!(i32s(&m.index(&ix![1]).unwrap()), vec![4, 5, 6, 7]);
    assert_eq!(i32s(&m.index(&ix![.., -1]).unwrap()), vec![3, 7, 11]);
    assert_eq!(i32s(&m.index(&ix![1.., 1..3]).unwrap()), vec![5, 6, 9, 10]);
    let r = m.index(&[Ix::Ellipsis, Ix::slice(None, None, -2)]).unwrap();
    assert_eq!(r.shape(), vec![3, 2]);
    assert_eq!(i32s(&r), vec![3, 1, 7, 5, 11, 9]);
    let r = m.index(&[Ix::NewAxis, Ix::At(0), Ix::NewAxis]).unwrap();
    assert_eq!(r.shape(), vec![1, 1, 4]);
    let r = m.index(&[Ix::Ellipsis, Ix::NewAxis]).unwrap();
    assert_eq!(r.shape(), vec![3, 4, 1]);
    let r = m
        .index(&[Ix::full(), Ix::slice(Some(0), Some(0), 1)])
        .unwrap();
    assert_eq!(r.shape(), vec![3, 0]);
    assert_eq!(m.slice_axis(-1, 1, None).unwrap().shape(), vec![3, 3]);
    assert_eq!(
        i32s(&m.slice_axis(0, -1, None).unwrap()),
        vec![8, 9, 10, 11]
    );
}

#[test]
fn bad_indices_are_errors() {
    let m = Array::zeros(&[3, 4], Dtype::F32).unwrap();
    let e = m.index(&ix![3]).unwrap_err().to_string();
    assert!(e.contains("out of bounds for axis 0 with size 3"), "{e}");
    let e = m.index(&ix![0, -5]).unwrap_err().to_string();
    assert!(e.contains("index -5 is out of bounds for axis 1"), "{e}");
    let e = m.index(&ix![0, 0, 0]).unwrap_err().to_string();
    assert!(e.contains("too many indices"), "{e}");
    let e = m
        .index(&[Ix::slice(None, None, 0)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("step cannot be zero"), "{e}");
    let e = m
        .index(&[Ix::Ellipsis, Ix::Ellipsis])
        .unwrap_err()
        .to_string();
    assert!(e.contains("one ellipsis"), "{e}");
    let e = m.slice_axis(2, 0, None).unwrap_err().to_string();
    assert!(e.contains("axis 2 is out of range"), "{e}");
}

/// NumPy: `a = np.arange(10); a[1:7:2] = [10, 20, 30]` etc.
#[test]
fn slice_update_follows_numpy_assignment() {
    let v = Array::arange(0.0, 10.0, 1.0, Dtype::I32).unwrap();
    let u = iarr(&[10, 20, 30], &[3]);
    let r = v
        .slice_update(&u, &[Ix::slice(Some(1), Some(7), 2)])
        .unwrap();
    assert_eq!(i32s(&r), vec![0, 10, 2, 20, 4, 30, 6, 7, 8, 9]);
    let r = v
        .slice_update(&u, &[Ix::slice(None, Some(-8), -3)])
        .unwrap();
    // a[:-8:-3] selects 9, 6, 3 in that order.
    assert_eq!(i32s(&r), vec![0, 1, 2, 30, 4, 5, 20, 7, 8, 10]);
    let r = v
        .slice_update(&Array::scalar(-1i32).unwrap(), &ix![-1])
        .unwrap();
    assert_eq!(i32s(&r)[9], -1);
    let r = v.slice_update(&u, &[Ix::slice(Some(4), Some(4), 1)]);
    // An empty target with a 3-element update does not broadcast, as in NumPy.
    assert!(r.is_err());

    let m = Array::zeros(&[2, 3], Dtype::F32).unwrap();
    let r = m.slice_update(&arr(&[1., 2., 3.], &[3]), &ix![1]).unwrap();
    assert_eq!(f32s(&r), vec![0., 0., 0., 1., 2., 3.]);
    let r = m.slice_update(&arr(&[5., 6.], &[2]), &ix![.., -1]).unwrap();
    assert_eq!(f32s(&r), vec![0., 0., 5., 0., 0., 6.]);
    let e = m
        .slice_update(&arr(&[5.], &[1]), &[Ix::NewAxis])
        .unwrap_err();
    assert!(e.to_string().contains("NewAxis"));
}

#[test]
fn gathers_and_scatters() {
    let m = arr(&[0., 1., 2., 3., 4., 5.], &[3, 2]);
    assert_eq!(
        f32s(&m.take(&iarr(&[2, 0], &[2]), 0).unwrap()),
        vec![4., 5., 0., 1.]
    );
    assert_eq!(
        f32s(&m.take(&iarr(&[1], &[1]), 1).unwrap()),
        vec![1., 3., 5.]
    );
    assert_eq!(
        f32s(&m.take_flat(&iarr(&[5, 0], &[2])).unwrap()),
        vec![5., 0.]
    );
    let idx = iarr(&[1, 0, 1], &[3, 1]);
    assert_eq!(f32s(&m.take_along_axis(&idx, 1).unwrap()), vec![1., 2., 5.]);
    let put = m.put_along_axis(&idx, &arr(&[9.], &[1, 1]), 1).unwrap();
    assert_eq!(f32s(&put), vec![0., 9., 9., 3., 4., 9.]);
    // Repeated indices accumulate: np.add.at(zeros(4), [1, 1, 3], [1, 2, 5]).
    let z = Array::zeros(&[4], Dtype::F32).unwrap();
    let r = z
        .scatter_add_axis(&iarr(&[1, 1, 3], &[3]), &arr(&[1., 2., 5.], &[3]), 0)
        .unwrap();
    assert_eq!(f32s(&r), vec![0., 3., 0., 5.]);
    let upd = arr(&[1., 2., 5.], &[3, 1]);
    let r = z
        .scatter_add(&[&iarr(&[1, 1, 3], &[3])], &upd, &[0])
        .unwrap();
    assert_eq!(f32s(&r), vec![0., 3., 0., 5.]);
    let r = z
        .scatter(&[&iarr(&[2], &[1])], &arr(&[7.], &[1, 1]), &[0])
        .unwrap();
    assert_eq!(f32s(&r), vec![0., 0., 7., 0.]);

    // Dynamic slices: the offset is data, not part of the graph.
    let v = Array::arange(0.0, 8.0, 1.0, Dtype::F32).unwrap();
    let start = iarr(&[3], &[1]);
    assert_eq!(
        f32s(&v.slice_dynamic(&start, &[0], &[2]).unwrap()),
        vec![3., 4.]
    );
    let w = v
        .slice_update_dynamic(&arr(&[-1., -2.], &[2]), &start, &[0])
        .unwrap();
    assert_eq!(f32s(&w), vec![0., 1., 2., -1., -2., 5., 6., 7.]);
}
