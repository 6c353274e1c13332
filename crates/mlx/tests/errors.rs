//! Every class of bad argument comes back as an `Err` carrying MLX's message; nothing aborts.

mod common;
use common::*;
use mlx::fast::{rms_norm, rope, scaled_dot_product_attention, RopeFreqs, Rotation, SdpaMask};
use mlx::{concatenate, random, Array, Dtype, Error};

fn mlx_err<T: std::fmt::Debug>(r: mlx::Result<T>) -> String {
    match r {
        Err(Error::Mlx(m)) => m,
        other => panic!("expected an MLX error, got {other:?}"),
    }
}

#[test]
fn shape_mismatches() {
    let a = Array::zeros(&[1024, 1024], Dtype::F32).unwrap();
    let b = Array::zeros(&[512, 512], Dtype::F32).unwrap();
    let m = mlx_err(a.matmul(&b));
    assert!(
        m.contains("[matmul]") && m.contains("(1024,1024)") && m.contains("(512,512)"),
        "{m}"
    );
    let m = mlx_err(arr(&[1., 2., 3.], &[3]).add(&arr(&[1., 2.], &[2])));
    assert!(m.contains("broadcast"), "{m}");
    let m = mlx_err(arr(&[1., 2., 3.], &[3]).reshape(&[2, 2]));
    assert!(m.contains("[reshape]"), "{m}");
    let m = mlx_err(concatenate(&[&a, &b], 0));
    assert!(m.contains("[concatenate]"), "{m}");
    assert!(mlx_err(arr(&[1., 2., 3.], &[3]).split(2, 0)).contains("equal size"));
    assert!(mlx_err(arr(&[1., 2.], &[2]).broadcast_to(&[3])).contains("broadcast"));
}

#[test]
fn axes_out_of_range() {
    let x = Array::zeros(&[2, 3], Dtype::F32).unwrap();
    assert!(mlx_err(x.sum(&[2], false)).contains("axis"));
    assert!(mlx_err(x.transpose(&[0, 0])).contains("[transpose]"));
    assert!(mlx_err(x.swapaxes(0, 5)).contains("[swapaxes]"));
    assert!(mlx_err(x.argmax(3, false)).contains("Invalid axis 3"));
    assert!(mlx_err(x.squeeze(0)).contains("[squeeze]"));
    assert!(mlx_err(x.softmax(&[4], false))
        .to_lowercase()
        .contains("axis"));
    assert!(mlx_err(x.take(&iarr(&[0], &[1]), 7)).contains("axis"));
    assert!(mlx_err(x.topk(10, 1)).contains("[topk]"));
}

#[test]
fn bad_dtypes_and_arguments() {
    let x = Array::zeros(&[2, 3], Dtype::F32).unwrap();
    // Float indices.
    assert!(mlx_err(x.take(&arr(&[0.], &[1]), 0)).contains("must be integral"));
    // Quantize needs a group size that divides the last axis and a supported bit width.
    assert!(
        mlx_err(Array::zeros(&[4, 100], Dtype::F32).unwrap().quantize(64, 4))
            .contains("[quantize]")
    );
    assert!(
        mlx_err(Array::zeros(&[4, 128], Dtype::F32).unwrap().quantize(64, 7))
            .contains("[quantize]")
    );
    // rms_norm weight of the wrong size.
    let m = mlx_err(rms_norm(&x, Some(&arr(&[1., 1.], &[2])), 1e-6));
    assert!(m.contains("rms_norm"), "{m}");
    // RoPE on a 1-d input.
    assert!(mlx_err(rope(
        &arr(&[1., 2.], &[2]),
        Rotation {
            dims: 2,
            traditional: false,
            freqs: RopeFreqs::Base(1e4),
            scale: 1.0
        },
        0
    ))
    .contains("rope"));
    // Attention with mismatched head dims.
    let q = Array::zeros(&[1, 2, 3, 8], Dtype::F32).unwrap();
    let k = Array::zeros(&[1, 2, 3, 4], Dtype::F32).unwrap();
    let m = mlx_err(scaled_dot_product_attention(
        &q,
        &k,
        &k,
        1.0,
        SdpaMask::None,
        None,
    ));
    assert!(m.contains("scaled_dot_product_attention"), "{m}");
    // A negative dimension in a fill.
    assert!(Array::zeros(&[-1], Dtype::F32).is_err());
    // Bernoulli needs a shape its probabilities broadcast to.
    assert!(random::bernoulli(&arr(&[0.5, 0.5], &[2]), Some(&[3]), None).is_err());
    // Bad random keys.
    assert!(random::uniform(&[2], Dtype::F32, 0.0, 1.0, Some(&arr(&[1.], &[1]))).is_err());
    // Reading back complex data as f32 is a dtype error, not garbage.
    assert!(matches!(
        iarr(&[1], &[1]).to_vec::<f32>(),
        Err(Error::Dtype { .. })
    ));
}

/// After an error the library keeps working normally.
#[test]
fn errors_leave_mlx_usable() {
    for _ in 0..100 {
        let _ = Array::zeros(&[2, 3], Dtype::F32)
            .unwrap()
            .matmul(&Array::zeros(&[2, 3], Dtype::F32).unwrap());
    }
    assert_eq!(
        f32s(&arr(&[1., 2.], &[2]).add_scalar(1.0).unwrap()),
        vec![2., 3.]
    );
}
