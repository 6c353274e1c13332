//! Element-wise math, reductions, scans, sorting, matmul and quantization.
//! Transcendental constants are Python's `math` module values (e.g. `math.erf(0.5)`), written
//! out as Python printed them.
#![allow(clippy::approx_constant)]

mod common;
use common::*;
use mlx::{where_, Array, Dtype};

#[test]
fn elementwise_binary() {
    let a = arr(&[1., -2., 3., 4.], &[4]);
    let b = arr(&[2., 2., -1., 0.5], &[4]);
    assert_eq!(f32s(&a.add(&b).unwrap()), vec![3., 0., 2., 4.5]);
    assert_eq!(f32s(&a.subtract(&b).unwrap()), vec![-1., -4., 4., 3.5]);
    assert_eq!(f32s(&a.multiply(&b).unwrap()), vec![2., -4., -3., 2.]);
    assert_eq!(f32s(&a.divide(&b).unwrap()), vec![0.5, -1., -3., 8.]);
    assert_eq!(f32s(&a.maximum(&b).unwrap()), vec![2., 2., 3., 4.]);
    assert_eq!(f32s(&a.minimum(&b).unwrap()), vec![1., -2., -1., 0.5]);
    assert_eq!(
        f32s(&arr(&[2., 9.], &[2]).power(&arr(&[3., 0.5], &[2])).unwrap()),
        vec![8., 3.]
    );
    assert_eq!(
        f32s(&arr(&[7., -7.], &[2]).floor_divide_scalar(2.0).unwrap()),
        vec![3., -4.]
    );
    assert_eq!(
        f32s(&arr(&[7., -7.], &[2]).remainder_scalar(3.0).unwrap()),
        vec![1., 2.]
    );
    // Broadcasting [2,1] against [3].
    let c = arr(&[10., 20.], &[2, 1])
        .add(&arr(&[1., 2., 3.], &[3]))
        .unwrap();
    assert_eq!(c.shape(), vec![2, 3]);
    assert_eq!(f32s(&c), vec![11., 12., 13., 21., 22., 23.]);
    // math.log(math.exp(1) + math.exp(2)) = 2.3132616875182226
    let l = arr(&[1.], &[1]).logaddexp(&arr(&[2.], &[1])).unwrap();
    assert_close(&f32s(&l), &[2.3132616875182226], 1e-6);
}

#[test]
fn comparisons_and_where() {
    let a = arr(&[1., 2., 3.], &[3]);
    let b = arr(&[3., 2., 1.], &[3]);
    let bools = |x: Array| x.to_vec::<bool>().unwrap();
    assert_eq!(bools(a.equal(&b).unwrap()), vec![false, true, false]);
    assert_eq!(bools(a.not_equal(&b).unwrap()), vec![true, false, true]);
    assert_eq!(bools(a.less(&b).unwrap()), vec![true, false, false]);
    assert_eq!(bools(a.less_equal(&b).unwrap()), vec![true, true, false]);
    assert_eq!(bools(a.greater(&b).unwrap()), vec![false, false, true]);
    assert_eq!(bools(a.greater_equal(&b).unwrap()), vec![false, true, true]);
    let lt = a.less(&b).unwrap();
    let gt = a.greater(&b).unwrap();
    assert_eq!(bools(lt.logical_or(&gt).unwrap()), vec![true, false, true]);
    assert_eq!(
        bools(lt.logical_and(&gt).unwrap()),
        vec![false, false, false]
    );
    assert_eq!(bools(lt.logical_not().unwrap()), vec![false, true, true]);
    assert_eq!(f32s(&where_(&lt, &a, &b).unwrap()), vec![1., 2., 1.]);
    let n = arr(&[f32::NAN, f32::INFINITY, 1.], &[3]);
    assert_eq!(bools(n.isnan().unwrap()), vec![true, false, false]);
    assert_eq!(bools(n.isinf().unwrap()), vec![false, true, false]);
}

#[test]
fn elementwise_unary() {
    let x = arr(&[0.5, 1.0, 2.0], &[3]);
    assert_close(
        &f32s(&x.exp().unwrap()),
        &[1.6487212707001282, 2.718281828459045, 7.38905609893065],
        1e-5,
    );
    assert_close(
        &f32s(&x.log().unwrap()),
        &[-0.6931471805599453, 0.0, 0.6931471805599453],
        1e-6,
    );
    assert_close(
        &f32s(&x.tanh().unwrap()),
        &[0.46211715726000974, 0.7615941559557649, 0.9640275800758169],
        1e-6,
    );
    assert_close(
        &f32s(&x.sigmoid().unwrap()),
        &[0.6224593312018546, 0.7310585786300049, 0.8807970779778823],
        1e-6,
    );
    assert_close(
        &f32s(&x.erf().unwrap()),
        &[0.5204998778130465, 0.8427007929497149, 0.9953222650189527],
        1e-6,
    );
    assert_close(
        &f32s(&x.sqrt().unwrap()),
        &[0.7071067811865476, 1.0, 1.4142135623730951],
        1e-6,
    );
    assert_close(
        &f32s(&x.rsqrt().unwrap()),
        &[1.4142135623730951, 1.0, 0.7071067811865476],
        1e-6,
    );
    assert_close(
        &f32s(&x.log1p().unwrap()),
        &[0.4054651081081644, 0.6931471805599453, 1.0986122886681098],
        1e-6,
    );
    assert_close(
        &f32s(&x.sin().unwrap()),
        &[0.479425538604203, 0.8414709848078965, 0.9092974268256817],
        1e-6,
    );
    let y = arr(&[-1.5, 2.5, -0.0], &[3]);
    assert_eq!(f32s(&y.abs().unwrap()), vec![1.5, 2.5, 0.0]);
    assert_eq!(f32s(&y.negative().unwrap()), vec![1.5, -2.5, 0.0]);
    assert_eq!(f32s(&y.square().unwrap()), vec![2.25, 6.25, 0.0]);
    assert_eq!(f32s(&y.floor().unwrap()), vec![-2., 2., 0.]);
    assert_eq!(f32s(&y.ceil().unwrap()), vec![-1., 3., 0.]);
    assert_eq!(f32s(&y.sign().unwrap()), vec![-1., 1., 0.]);
    assert_eq!(f32s(&arr(&[4.], &[1]).reciprocal().unwrap()), vec![0.25]);
    let lo = Array::scalar(-1.0f32).unwrap();
    let hi = Array::scalar(1.0f32).unwrap();
    assert_eq!(
        f32s(&y.clip(Some(&lo), Some(&hi)).unwrap()),
        vec![-1., 1., 0.]
    );
    assert_eq!(
        f32s(&y.clip(None, Some(&lo)).unwrap()),
        vec![-1.5, -1., -1.]
    );
}

#[test]
fn scalars_are_weakly_typed() {
    let h = arr(&[1., 2.], &[2]).astype(Dtype::Bf16).unwrap();
    assert_eq!(h.multiply_scalar(0.5).unwrap().dtype(), Dtype::Bf16);
    let i = iarr(&[1, 2], &[2]);
    assert_eq!(i.add_scalar(3.0).unwrap().dtype(), Dtype::I32);
    assert_eq!(i.add_scalar(0.5).unwrap().dtype(), Dtype::F32);
    assert_eq!(f32s(&i.add_scalar(0.5).unwrap()), vec![1.5, 2.5]);
}

#[test]
fn astype_converts() {
    let x = arr(&[1.7, -2.2], &[2]);
    assert_eq!(
        x.astype(Dtype::I32).unwrap().to_vec::<i32>().unwrap(),
        vec![1, -2]
    );
    let b = x.astype(Dtype::Bf16).unwrap();
    assert_eq!(b.dtype(), Dtype::Bf16);
    // bf16 keeps 8 mantissa bits: 1.7 -> 1.703125, -2.2 -> -2.203125.
    assert_eq!(f32s(&b), vec![1.703125, -2.203125]);
    assert_eq!(
        x.astype(Dtype::Bool).unwrap().to_vec::<bool>().unwrap(),
        vec![true, true]
    );
}

#[test]
fn reductions() {
    let m = arr(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    assert_eq!(f32s(&m.sum(&[1], false).unwrap()), vec![6., 15.]);
    assert_eq!(f32s(&m.sum(&[0], true).unwrap()), vec![5., 7., 9.]);
    assert_eq!(m.sum(&[0], true).unwrap().shape(), vec![1, 3]);
    assert_eq!(m.sum_all(false).unwrap().item::<f32>().unwrap(), 21.);
    assert_eq!(f32s(&m.mean(&[1], false).unwrap()), vec![2., 5.]);
    assert_eq!(f32s(&m.max(&[0], false).unwrap()), vec![4., 5., 6.]);
    assert_eq!(f32s(&m.min(&[1], false).unwrap()), vec![1., 4.]);
    assert_eq!(f32s(&m.prod(&[1], false).unwrap()), vec![6., 120.]);
    assert_eq!(m.max_all(false).unwrap().item::<f32>().unwrap(), 6.);
    let am = arr(&[3., 9., 1., 9.], &[4]).argmax(0, false).unwrap();
    // Ties go to the first occurrence, as in NumPy.
    assert_eq!(i32s(&am), vec![1]);
    assert_eq!(i32s(&m.argmax(1, false).unwrap()), vec![2, 2]);
    assert_eq!(i32s(&m.argmin(0, false).unwrap()), vec![0, 0, 0]);
    let b = arr(&[0., 1.], &[2]).astype(Dtype::Bool).unwrap();
    assert!(b.any_all(false).unwrap().item::<bool>().unwrap());
    assert!(!b.all_all(false).unwrap().item::<bool>().unwrap());
    // math.log(math.exp(1) + math.exp(2) + math.exp(3)) = 3.40760596444438
    let v = arr(&[1., 2., 3.], &[3]);
    assert_close(
        &f32s(&v.logsumexp(&[0], false).unwrap()),
        &[3.40760596444438],
        1e-6,
    );
    // Large values must not overflow.
    let big = arr(&[1000., 1000.], &[2]);
    assert_close(
        &f32s(&big.logsumexp_all(false).unwrap()),
        &[1000.6931471805599],
        1e-3,
    );
    // softmax([1,2,3]) = exp(v - 3.40760596444438)
    let want = [0.09003057317038046, 0.24472847105479764, 0.6652409557748219];
    assert_close(&f32s(&v.softmax(&[0], true).unwrap()), &want, 1e-6);
    let ls = v.log_softmax(0).unwrap();
    assert_close(&f32s(&ls), &want.map(f64::ln), 1e-6);
}

#[test]
fn scans() {
    let v = arr(&[1., 2., 3., 4.], &[4]);
    assert_eq!(
        f32s(&v.cumsum(0, false, true).unwrap()),
        vec![1., 3., 6., 10.]
    );
    assert_eq!(
        f32s(&v.cumsum(0, false, false).unwrap()),
        vec![0., 1., 3., 6.]
    );
    assert_eq!(
        f32s(&v.cumsum(0, true, true).unwrap()),
        vec![10., 9., 7., 4.]
    );
    let w = arr(&[1., 3., 2., 5.], &[4]);
    assert_eq!(
        f32s(&w.cummax(0, false, true).unwrap()),
        vec![1., 3., 3., 5.]
    );
}

#[test]
fn sorting() {
    let v = arr(&[3., 1., 4., 1.5, 9., 2.], &[6]);
    assert_eq!(f32s(&v.sort(0).unwrap()), vec![1., 1.5, 2., 3., 4., 9.]);
    assert_eq!(i32s(&v.argsort(0).unwrap()), vec![1, 3, 5, 0, 2, 4]);
    let p = f32s(&v.partition(2, 0).unwrap());
    assert_eq!(p[2], 2.0);
    assert!(p[..2].iter().all(|&x| x <= 2.0) && p[3..].iter().all(|&x| x >= 2.0));
    let ap = i32s(&v.argpartition(3, 0).unwrap());
    let vals = [3., 1., 4., 1.5, 9., 2.];
    let mut top: Vec<f32> = ap[3..].iter().map(|&i| vals[i as usize]).collect();
    top.sort_by(f32::total_cmp);
    assert_eq!(top, vec![3., 4., 9.]);
    let mut t = f32s(&v.topk(2, 0).unwrap());
    t.sort_by(f32::total_cmp);
    assert_eq!(t, vec![4., 9.]);
    let m = arr(&[3., 1., 2., 0., 5., 4.], &[2, 3]);
    assert_eq!(f32s(&m.sort(-1).unwrap()), vec![1., 2., 3., 0., 4., 5.]);
}

#[test]
fn matmul_and_addmm() {
    let a = arr(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let b = arr(&[7., 8., 9., 10., 11., 12.], &[3, 2]);
    // [[58, 64], [139, 154]]
    assert_eq!(f32s(&a.matmul(&b).unwrap()), vec![58., 64., 139., 154.]);
    let c = arr(&[1., 1., 1., 1.], &[2, 2]);
    assert_eq!(
        f32s(&c.addmm(&a, &b, 2.0, 3.0).unwrap()),
        vec![119., 131., 281., 311.]
    );
    // Batched: [2, 2, 3] @ [3, 2].
    let s = mlx::stack(&[&a, &a], 0).unwrap();
    assert_eq!(s.matmul(&b).unwrap().shape(), vec![2, 2, 2]);
}

#[test]
fn gather_mm_selects_matrices() {
    // Three 2x2 "experts"; rows pick experts 2 and 0.
    let w = Array::arange(0.0, 12.0, 1.0, Dtype::F32)
        .unwrap()
        .reshape(&[3, 2, 2])
        .unwrap();
    let x = arr(&[1., 1., 1., -1.], &[2, 1, 2]);
    let idx = iarr(&[2, 0], &[2]);
    let got = x.gather_mm(&w, None, Some(&idx), false).unwrap();
    assert_eq!(got.shape(), vec![2, 1, 2]);
    // [1,1] @ [[8,9],[10,11]] = [18, 20];  [1,-1] @ [[0,1],[2,3]] = [-2, -2]
    assert_eq!(f32s(&got), vec![18., 20., -2., -2.]);
}

#[test]
fn quantization_round_trip_and_matmuls() {
    let (out, inp) = (32, 128);
    let w = arr(&pseudo_random(out * inp, 1), &[out as i32, inp as i32]);
    for bits in [4, 8] {
        let q = w.quantize(64, bits).unwrap();
        assert_eq!(q.weight.dtype(), Dtype::U32);
        assert_eq!(
            q.weight.shape(),
            vec![out as i32, (inp * bits as usize / 32) as i32]
        );
        assert_eq!(q.scales.shape(), vec![out as i32, (inp / 64) as i32]);
        let dq = q.dequantize().unwrap();
        let err = dq
            .subtract(&w)
            .unwrap()
            .abs()
            .unwrap()
            .max_all(false)
            .unwrap();
        // Within one step of the affine grid over the [-1, 1) range, 2 / (2^bits - 1): MLX
        // snaps each group's bias so that zero is exactly representable, which can cost up to a
        // full step rather than half of one.
        let bound = 2.0 / ((1 << bits) - 1) as f32 + 1e-3;
        let err = err.item::<f32>().unwrap();
        assert!(err <= bound, "bits {bits}: max error {err} > {bound}");

        let x = arr(&pseudo_random(3 * inp, 2), &[3, inp as i32]);
        let want = f32s(&x.matmul(&dq.t().unwrap()).unwrap());
        let got = f32s(&x.quantized_matmul(&q, true).unwrap());
        let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        assert_close(&got, &want, 1e-3);

        // gather_qmm over a stack of two quantized experts equals per-row quantized matmul.
        let w2 = mlx::stack(&[&w, &w.negative().unwrap()], 0).unwrap();
        let q2 = w2.quantize(64, bits).unwrap();
        let xs = x.reshape(&[3, 1, inp as i32]).unwrap();
        let idx = iarr(&[1, 0, 1], &[3]);
        let got = f32s(&xs.gather_qmm(&q2, None, Some(&idx), true, false).unwrap());
        let dq2 = q2.dequantize().unwrap();
        for (row, &e) in [1, 0, 1].iter().enumerate() {
            let xr = x.slice_axis(0, row as i32, Some(row as i32 + 1)).unwrap();
            let we = dq2.index(&mlx::ix![e]).unwrap();
            let want = f32s(&xr.matmul(&we.t().unwrap()).unwrap());
            let want: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            assert_close(&got[row * out..(row + 1) * out], &want, 1e-3);
        }
    }
}
