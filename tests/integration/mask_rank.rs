//! Keep masks and biases of rank below 4 broadcast from the right, as
//! PyTorch broadcasts `attn_mask`: `[len_q, len_kv]`, `[heads, len_q,
//! len_kv]` (and ranks 0 and 1) give exactly what the same mask with
//! leading axes of length 1 gives, on `core` and on every kernel set of
//! the fused path, forward and backward; a rank above 4 or a shape that
//! does not broadcast is an error naming the shape as given.

use ndarray::{Array, Array4, ArrayD, Axis, Dimension, IxDyn};
use sdpa::simd::available_kernel_sets;
use sdpa::{AttentionOptions, ErrorKind, scaled_dot_product_attention_backward};

use crate::common::Rng;

/// `x` with axes of length 1 added on the left up to rank 4.
fn padded<T: Clone, D: Dimension>(x: &Array<T, D>) -> Array4<T> {
    let mut x = x.view().into_dyn();
    while x.ndim() < 4 {
        x.insert_axis_inplace(Axis(0));
    }
    x.into_dimensionality().expect("rank 4").to_owned()
}

const BATCH: usize = 2;
const HEADS: usize = 3;
const LEN_Q: usize = 5;
const LEN_KV: usize = 7;
const D: usize = 8;

/// Masks and biases of each lower rank, and shapes broadcasting within a rank.
fn lower_rank_shapes() -> Vec<Vec<usize>> {
    vec![
        vec![],
        vec![LEN_KV],
        vec![1],
        vec![LEN_Q, LEN_KV],
        vec![1, LEN_KV],
        vec![LEN_Q, 1],
        vec![HEADS, LEN_Q, LEN_KV],
        vec![1, LEN_Q, LEN_KV],
        vec![HEADS, 1, LEN_KV],
    ]
}

fn random_mask(rng: &mut Rng, shape: &[usize]) -> ArrayD<bool> {
    // Keep key 0 visible so most rows see something; the rest at random.
    let mut mask = ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.chance(0.6));
    if shape.last() == Some(&LEN_KV) {
        mask.index_axis_mut(Axis(shape.len() - 1), 0).fill(true);
    }
    mask
}

fn random_bias(rng: &mut Rng, shape: &[usize]) -> ArrayD<f64> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.uniform(-2.0, 2.0))
}

#[test]
fn lower_rank_masks_and_biases_equal_their_rank_4_forms_on_core() {
    let mut rng = Rng::new(11);
    let q: Array4<f64> = rng.array([BATCH, HEADS, LEN_Q, D]);
    let k: Array4<f64> = rng.array([BATCH, HEADS, LEN_KV, D]);
    let v: Array4<f64> = rng.array([BATCH, HEADS, LEN_KV, D]);
    for shape in lower_rank_shapes() {
        let mask = random_mask(&mut rng, &shape);
        let bias = random_bias(&mut rng, &shape);
        let (mask4, bias4) = (padded(&mask), padded(&bias));
        let low = AttentionOptions::new()
            .keep_mask(mask.view())
            .bias(bias.view());
        let full = AttentionOptions::new()
            .keep_mask(mask4.view())
            .bias(bias4.view());
        let got = sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &low)
            .unwrap_or_else(|e| panic!("shape {shape:?}: {e}"));
        let want =
            sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &full).unwrap();
        assert_eq!(got, want, "shape {shape:?}");
        let weights = sdpa::core::attention_weights(q.view(), k.view(), &low).unwrap();
        assert_eq!(
            weights,
            sdpa::core::attention_weights(q.view(), k.view(), &full).unwrap()
        );
    }
}

#[test]
fn a_rank_2_mask_means_the_same_for_every_batch_item_and_head() {
    // The torch idiom: attn_mask of shape [L, S].
    let mut rng = Rng::new(12);
    let q: Array4<f64> = rng.array([BATCH, HEADS, LEN_Q, D]);
    let k: Array4<f64> = rng.array([BATCH, HEADS, LEN_KV, D]);
    let mask = random_mask(&mut rng, &[LEN_Q, LEN_KV]);
    let mask2 = mask.clone().into_dimensionality::<ndarray::Ix2>().unwrap();
    let w = sdpa::core::attention_weights(
        q.view(),
        k.view(),
        &AttentionOptions::new().keep_mask(mask2.view()),
    )
    .unwrap();
    for ((b, h, i, j), &weight) in w.indexed_iter() {
        if !mask2[[i, j]] {
            assert_eq!(weight, 0.0, "[{b}, {h}, {i}, {j}]");
        }
    }
}

#[test]
fn lower_rank_masks_and_biases_equal_their_rank_4_forms_on_every_kernel_set() {
    let mut rng = Rng::new(13);
    let q: Array4<f32> = rng.array([BATCH, HEADS, LEN_Q, D]);
    let k: Array4<f32> = rng.array([BATCH, HEADS, LEN_KV, D]);
    let v: Array4<f32> = rng.array([BATCH, HEADS, LEN_KV, D]);
    let d_out: Array4<f32> = rng.array([BATCH, HEADS, LEN_Q, D]);
    for shape in lower_rank_shapes() {
        let mask = random_mask(&mut rng, &shape);
        let bias = random_bias(&mut rng, &shape).mapv(|x| x as f32);
        let (mask4, bias4) = (padded(&mask), padded(&bias));
        let low = AttentionOptions::new()
            .causal()
            .keep_mask(mask.view())
            .bias(bias.view());
        let full = AttentionOptions::new()
            .causal()
            .keep_mask(mask4.view())
            .bias(bias4.view());
        for set in available_kernel_sets() {
            sdpa::simd::with_kernel_set(set, || {
                let partial = |opts| {
                    sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), opts)
                        .unwrap_or_else(|e| panic!("{set:?}, shape {shape:?}: {e}"))
                };
                let (got, want) = (partial(&low), partial(&full));
                assert_eq!(got.output(), want.output(), "{set:?}, shape {shape:?}");
                let grads = |opts, forward| {
                    scaled_dot_product_attention_backward(
                        q.view(),
                        k.view(),
                        v.view(),
                        opts,
                        forward,
                        d_out.view(),
                    )
                    .unwrap()
                };
                let (got, want) = (grads(&low, &got), grads(&full, &want));
                assert_eq!(got.d_q, want.d_q, "{set:?}, shape {shape:?}");
                assert_eq!(got.d_k, want.d_k);
                assert_eq!(got.d_v, want.d_v);
                // The bias gradient comes in the padded rank-4 shape.
                assert_eq!(got.d_bias.as_ref().unwrap().shape(), bias4.shape());
                assert_eq!(got.d_bias, want.d_bias);
            })
            .expect("an available kernel set");
        }
    }
}

#[test]
fn a_rank_above_4_is_an_error_naming_the_shape() {
    let q = Array4::<f32>::ones((1, 2, 3, 4));
    let mask = ArrayD::from_elem(IxDyn(&[1, 1, 2, 3, 3]), true);
    let err = sdpa::scaled_dot_product_attention(
        q.view(),
        q.view(),
        q.view(),
        &AttentionOptions::new().keep_mask(mask.view()),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotBroadcastable);
    assert!(err.to_string().contains("[1, 1, 2, 3, 3]"), "{err}");
    assert!(err.to_string().contains("rank 5"), "{err}");
    let bias = ndarray::Array5::<f64>::zeros((1, 1, 1, 3, 3));
    let q = q.mapv(f64::from);
    let err = sdpa::core::scaled_dot_product_attention(
        q.view(),
        q.view(),
        q.view(),
        &AttentionOptions::new().bias(bias.view()),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotBroadcastable);
    // A later valid bias replaces the bad one.
    let good = ndarray::Array2::<f64>::zeros((3, 3));
    let fixed = AttentionOptions::new().bias(bias.view()).bias(good.view());
    sdpa::core::scaled_dot_product_attention(q.view(), q.view(), q.view(), &fixed).unwrap();
}

#[test]
fn a_lower_rank_shape_that_does_not_broadcast_is_an_error_naming_it_as_given() {
    let q = Array4::<f32>::ones((2, 3, 5, 4));
    let k = Array4::<f32>::ones((2, 3, 7, 4));
    for (shape, mentions) in [
        (vec![5, 6], "[5, 6]"),
        (vec![4, 7], "[4, 7]"),
        (vec![2, 5, 7], "[2, 5, 7]"),
        (vec![6], "[6]"),
    ] {
        let mask = ArrayD::from_elem(IxDyn(&shape), true);
        let bias = ArrayD::<f32>::zeros(IxDyn(&shape));
        for opts in [
            AttentionOptions::new().keep_mask(mask.view()),
            AttentionOptions::new().bias(bias.view()),
        ] {
            let err = sdpa::scaled_dot_product_attention(q.view(), k.view(), k.view(), &opts)
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::NotBroadcastable, "{shape:?}");
            let message = err.to_string();
            assert!(message.contains(mentions), "{message}");
            assert!(message.contains("broadcast from the right"), "{message}");
            assert!(message.contains("[2, 3, 5, 7]"), "{message}");
        }
    }
}
