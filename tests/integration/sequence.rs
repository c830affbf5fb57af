//! The single-sequence forms: `simple_self_attention` against an explicit
//! loop over the seed's formula, and `single_sequence_attention` against the
//! 4-D functional API it wraps.

use approx::assert_abs_diff_eq;
use ndarray::{Array2, Array4, ArrayView2, Axis, array};
use proptest::prelude::*;
use sdpa::{
    AttentionOptions, CausalAlignment, ErrorKind, scaled_dot_product_attention,
    simple_self_attention, single_sequence_attention,
};

/// The seed's simplest self-attention written out as sums:
/// `y_i = Σ_{j visible} softmax_j(x_i · x_j) x_j`, visible `j ≤ i` when causal.
fn simple_by_loops(x: ArrayView2<'_, f64>, causal: bool) -> Array2<f64> {
    let (len, d) = x.dim();
    let mut y = Array2::zeros((len, d));
    for i in 0..len {
        let visible = if causal { i + 1 } else { len };
        let scores: Vec<f64> = (0..visible)
            .map(|j| (0..d).map(|c| x[[i, c]] * x[[j, c]]).sum())
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        for (j, e) in exps.iter().enumerate() {
            for c in 0..d {
                y[[i, c]] += e / sum * x[[j, c]];
            }
        }
    }
    y
}

fn matrix(rows: usize, cols: usize) -> impl Strategy<Value = Array2<f64>> {
    prop::collection::vec(-2.0..2.0_f64, rows * cols)
        .prop_map(move |data| Array2::from_shape_vec((rows, cols), data).unwrap())
}

fn sequence() -> impl Strategy<Value = Array2<f64>> {
    (0..9_usize, 1..7_usize).prop_flat_map(|(len, d)| matrix(len, d))
}

/// `q [len_q, d_k]`, `k [len_kv, d_k]`, `v [len_kv, d_v]`.
fn qkv() -> impl Strategy<Value = (Array2<f64>, Array2<f64>, Array2<f64>)> {
    (0..7_usize, 0..7_usize, 1..6_usize, 1..6_usize).prop_flat_map(|(len_q, len_kv, d_k, d_v)| {
        (matrix(len_q, d_k), matrix(len_kv, d_k), matrix(len_kv, d_v))
    })
}

fn to_4d(x: &Array2<f64>) -> Array4<f64> {
    x.clone().insert_axis(Axis(0)).insert_axis(Axis(0))
}

proptest! {
    #[test]
    fn simple_self_attention_is_the_seed_formula(x in sequence(), causal in any::<bool>()) {
        let y = simple_self_attention(x.view(), causal).unwrap();
        let expected = simple_by_loops(x.view(), causal);
        prop_assert_eq!(y.dim(), x.dim());
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn simple_self_attention_f32_agrees_with_f64(x in sequence(), causal in any::<bool>()) {
        let x32 = x.mapv(|v| v as f32);
        let y32 = simple_self_attention(x32.view(), causal).unwrap();
        let y64 = simple_self_attention(x.view(), causal).unwrap();
        assert_abs_diff_eq!(y32.mapv(f64::from), y64, epsilon = 1e-4);
    }

    #[test]
    fn simple_causal_rows_ignore_later_positions(x in sequence(), noise in -3.0..3.0_f64) {
        let len = x.nrows();
        if len < 2 {
            return Ok(());
        }
        let y = simple_self_attention(x.view(), true).unwrap();
        let mut changed = x.clone();
        changed.row_mut(len - 1).mapv_inplace(|v| v + noise);
        let y_changed = simple_self_attention(changed.view(), true).unwrap();
        prop_assert_eq!(y.slice(ndarray::s![..len - 1, ..]), y_changed.slice(ndarray::s![..len - 1, ..]));
    }

    #[test]
    fn single_sequence_equals_the_4d_call((q, k, v) in qkv(), variant in 0..7_usize, seed in 0..1000_u64) {
        let (len_q, len_kv) = (q.nrows(), k.nrows());
        let keep = Array4::from_shape_fn((1, 1, len_q, len_kv), |(_, _, i, j)| !(i * 7 + j * 3 + seed as usize).is_multiple_of(4));
        let bias = Array4::from_shape_fn((1, 1, 1, len_kv), |(_, _, _, j)| (j as f64 - seed as f64 % 5.0) * 0.3);
        let lengths = [(seed as usize) % (len_kv + 1)];
        let opts = match variant {
            0 => AttentionOptions::new(),
            1 => AttentionOptions::new().causal(),
            2 => AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft),
            3 => AttentionOptions::new().scale(0.37),
            4 => AttentionOptions::new().keep_mask(keep.view()),
            5 => AttentionOptions::new().bias(bias.view()),
            _ => AttentionOptions::new().key_lengths(&lengths).causal(),
        };
        let y = single_sequence_attention(q.view(), k.view(), v.view(), &opts).unwrap();
        let expected = scaled_dot_product_attention(to_4d(&q).view(), to_4d(&k).view(), to_4d(&v).view(), &opts).unwrap();
        prop_assert_eq!(y.dim(), (len_q, v.ncols()));
        assert_abs_diff_eq!(y, expected.index_axis(Axis(0), 0).index_axis(Axis(0), 0), epsilon = 1e-12);
    }

    #[test]
    fn single_sequence_f32_equals_the_4d_call((q, k, v) in qkv(), causal in any::<bool>()) {
        let (q, k, v) = (q.mapv(|x| x as f32), k.mapv(|x| x as f32), v.mapv(|x| x as f32));
        let opts = if causal { AttentionOptions::new().causal() } else { AttentionOptions::new() };
        let y = single_sequence_attention(q.view(), k.view(), v.view(), &opts).unwrap();
        let as_4d = |x: &Array2<f32>| x.clone().insert_axis(Axis(0)).insert_axis(Axis(0));
        let expected = scaled_dot_product_attention(as_4d(&q).view(), as_4d(&k).view(), as_4d(&v).view(), &opts).unwrap();
        assert_abs_diff_eq!(y, expected.index_axis(Axis(0), 0).index_axis(Axis(0), 0), epsilon = 1e-6);
    }

    #[test]
    fn strided_views_equal_contiguous((q, k, v) in qkv()) {
        // The same matrices stored transposed and read through `.t()`.
        let (qt, kt, vt) = (q.t().to_owned(), k.t().to_owned(), v.t().to_owned());
        let opts = AttentionOptions::new().causal();
        let strided = single_sequence_attention(qt.t(), kt.t(), vt.t(), &opts).unwrap();
        let contiguous = single_sequence_attention(q.view(), k.view(), v.view(), &opts).unwrap();
        assert_abs_diff_eq!(strided, contiguous, epsilon = 1e-12);
    }
}

#[test]
fn simple_self_attention_uses_raw_dot_products() {
    // Scores for the last row are 1, 1, 2: unscaled weights 0.212, 0.212, 0.576.
    let x = array![[1.0_f64, 0.0], [0.0, 1.0], [1.0, 1.0]];
    let y = simple_self_attention(x.view(), true).unwrap();
    let e = 1.0_f64.exp();
    let weights = [e, e, e * e].map(|w| w / (2.0 * e + e * e));
    assert_abs_diff_eq!(weights[2], 0.576, epsilon = 5e-4);
    assert_abs_diff_eq!(
        y.row(2),
        array![weights[0] + weights[2], weights[1] + weights[2]],
        epsilon = 1e-15
    );
}

#[test]
fn simple_bidirectional_first_row_sees_the_future() {
    let x = array![[1.0_f64, 0.0], [5.0, 0.0]];
    let causal = simple_self_attention(x.view(), true).unwrap();
    let bidirectional = simple_self_attention(x.view(), false).unwrap();
    assert_eq!(causal.row(0), x.row(0));
    assert!(bidirectional[[0, 0]] > 4.0);
}

#[test]
fn simple_empty_sequence_is_empty() {
    let x = Array2::<f32>::zeros((0, 3));
    let y = simple_self_attention(x.view(), true).unwrap();
    assert_eq!(y.dim(), (0, 3));
}

#[test]
fn single_sequence_empty_queries_give_empty_output() {
    let q = Array2::<f64>::zeros((0, 2));
    let kv = Array2::<f64>::ones((3, 2));
    let y = single_sequence_attention(q.view(), kv.view(), kv.view(), &AttentionOptions::new())
        .unwrap();
    assert_eq!(y.dim(), (0, 2));
}

#[test]
fn single_sequence_empty_keys_give_zeros() {
    let q = Array2::<f64>::ones((3, 2));
    let k = Array2::<f64>::zeros((0, 2));
    let v = Array2::<f64>::zeros((0, 4));
    let y =
        single_sequence_attention(q.view(), k.view(), v.view(), &AttentionOptions::new()).unwrap();
    assert_eq!(y, Array2::<f64>::zeros((3, 4)));
}

// --- errors, one test per case ----------------------------------------------

#[test]
fn simple_zero_width_is_an_error() {
    let x = Array2::<f64>::zeros((3, 0));
    let err = simple_self_attention(x.view(), false).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ZeroDimension);
    assert!(err.to_string().contains("[3, 0]"), "{err}");
}

#[test]
fn single_sequence_zero_d_k_is_an_error() {
    let q = Array2::<f64>::zeros((2, 0));
    let v = Array2::<f64>::zeros((2, 3));
    let err = single_sequence_attention(q.view(), q.view(), v.view(), &AttentionOptions::new())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ZeroDimension);
    assert!(err.to_string().contains("d_k"), "{err}");
}

#[test]
fn single_sequence_d_k_mismatch_is_an_error() {
    let q = Array2::<f64>::zeros((2, 4));
    let k = Array2::<f64>::zeros((3, 5));
    let v = Array2::<f64>::zeros((3, 4));
    let err = single_sequence_attention(q.view(), k.view(), v.view(), &AttentionOptions::new())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    let message = err.to_string();
    assert!(
        message.contains("d_k") && message.contains("[2, 4]") && message.contains("[3, 5]"),
        "{message}"
    );
}

#[test]
fn single_sequence_len_kv_mismatch_is_an_error() {
    let q = Array2::<f64>::zeros((2, 4));
    let k = Array2::<f64>::zeros((3, 4));
    let v = Array2::<f64>::zeros((5, 4));
    let err = single_sequence_attention(q.view(), k.view(), v.view(), &AttentionOptions::new())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    let message = err.to_string();
    assert!(
        message.contains("len_kv") && message.contains("[5, 4]"),
        "{message}"
    );
}

#[test]
fn single_sequence_mask_that_does_not_broadcast_is_an_error() {
    let x = Array2::<f32>::zeros((3, 2));
    let keep = Array4::from_elem((1, 1, 3, 2), true);
    let opts = AttentionOptions::new().keep_mask(keep.view());
    let err = single_sequence_attention(x.view(), x.view(), x.view(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotBroadcastable);
    assert!(err.to_string().contains("keep_mask"), "{err}");
}

#[test]
fn single_sequence_bias_with_batch_2_is_an_error() {
    let x = Array2::<f32>::zeros((3, 2));
    let bias = Array4::<f32>::zeros((2, 1, 3, 3));
    let opts = AttentionOptions::new().bias(bias.view());
    let err = single_sequence_attention(x.view(), x.view(), x.view(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotBroadcastable);
    assert!(err.to_string().contains("bias"), "{err}");
}

#[test]
fn single_sequence_two_key_lengths_is_an_error() {
    let x = Array2::<f32>::zeros((3, 2));
    let opts = AttentionOptions::new().key_lengths(&[3, 3]);
    let err = single_sequence_attention(x.view(), x.view(), x.view(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::KeyLengths);
}

#[test]
fn single_sequence_key_length_past_len_kv_is_an_error() {
    let x = Array2::<f32>::zeros((3, 2));
    let opts = AttentionOptions::new().key_lengths(&[4]);
    let err = single_sequence_attention(x.view(), x.view(), x.view(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::KeyLengths);
}

#[test]
fn single_sequence_non_finite_scale_is_an_error() {
    let x = Array2::<f64>::zeros((3, 2));
    let opts = AttentionOptions::new().scale(f64::NAN);
    let err = single_sequence_attention(x.view(), x.view(), x.view(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidOption);
}
