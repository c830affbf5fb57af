//! The fused `f32` backward pass against the `f64` reference, on every
//! kernel set, odd shapes, every option and masked garbage.

use ndarray::{Array4, ShapeBuilder, s};
use proptest::prelude::*;

use crate::common;
use common::{nan_filled, option_case, seeded};
use sdpa::simd::available_kernel_sets;
use sdpa::{
    AttentionGradients, AttentionOptions, AttentionPartial, scaled_dot_product_attention_backward,
    scaled_dot_product_attention_backward_into, scaled_dot_product_attention_partial,
    scaled_dot_product_attention_partial_into,
};

#[allow(clippy::too_many_arguments)]
fn check(
    batch: usize,
    heads: usize,
    kv_heads: usize,
    len_q: usize,
    len_kv: usize,
    d_k: usize,
    d_v: usize,
    case: usize,
    seed: u64,
    poison_masked: bool,
) {
    let q = seeded((batch, heads, len_q, d_k), seed, 1.0);
    let mut k = seeded((batch, kv_heads, len_kv, d_k), seed ^ 1, 1.0);
    let mut v = seeded((batch, kv_heads, len_kv, d_v), seed ^ 2, 1.0);
    let keep = seeded((batch, 1, len_q, len_kv), seed ^ 3, 1.0).mapv(|x| x > -0.6);
    // Bias broadcast over the batch: its gradient sums over it.
    let bias = seeded((1, heads, len_q, len_kv), seed ^ 4, 1.0);
    let d_out = seeded((batch, heads, len_q, d_v), seed ^ 5, 1.0);
    let lengths: Vec<usize> = (0..batch).map(|b| len_kv * (b + 1) / (batch + 1)).collect();
    if poison_masked && case == 3 && batch > 0 {
        // Keys past item 0's length are padding: fill them with garbage.
        k.slice_mut(s![0, .., lengths[0].., ..]).fill(f64::NAN);
        v.slice_mut(s![0, .., lengths[0].., ..]).fill(f64::INFINITY);
    }
    let opts = option_case(case, &keep, &bias, &lengths);
    let forward =
        scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts).unwrap();
    let expected = sdpa::core::scaled_dot_product_attention_backward(
        q.view(),
        k.view(),
        v.view(),
        &opts,
        &forward,
        d_out.view(),
    )
    .unwrap();
    let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
    let (q32, k32, v32, bias32, d_out32) =
        (f32s(&q), f32s(&k), f32s(&v), f32s(&bias), f32s(&d_out));
    for set in available_kernel_sets() {
        let opts = option_case(case, &keep, &bias32, &lengths);
        let forward = sdpa::simd::with_kernel_set(set, || {
            scaled_dot_product_attention_partial(q32.view(), k32.view(), v32.view(), &opts)
        })
        .unwrap()
        .unwrap();
        let (got, reused) = sdpa::simd::with_kernel_set(set, || {
            let (q, k, v) = (q32.view(), k32.view(), v32.view());
            let got =
                scaled_dot_product_attention_backward(q, k, v, &opts, &forward, d_out32.view())
                    .unwrap();
            // The same call into a caller's arrays, column-major and full
            // of NaN: every element is overwritten, in the same bits.
            let mut reused = poisoned_column_major(&got);
            scaled_dot_product_attention_backward_into(
                q,
                k,
                v,
                &opts,
                &forward,
                d_out32.view(),
                &mut reused,
            )
            .unwrap();
            (got, reused)
        })
        .unwrap();
        assert_same_bits(&reused, &got, &format!("{set}, case {case}, _into"));
        let close = |name: &str, got: &Array4<f32>, expected: &Array4<f64>| {
            let scale = 1.0 + expected.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            for ((index, &g), &e) in got.indexed_iter().zip(expected.iter()) {
                assert!(
                    g.is_finite() && (g as f64 - e).abs() <= 2e-5 * scale,
                    "{set}, case {case}, q {:?} k {:?} v {:?}: {name}{index:?} = {g}, reference {e}",
                    q.shape(),
                    k.shape(),
                    v.shape()
                );
            }
        };
        close("d_q", &got.d_q, &expected.d_q);
        close("d_k", &got.d_k, &expected.d_k);
        close("d_v", &got.d_v, &expected.d_v);
        match (&got.d_bias, &expected.d_bias) {
            (Some(g), Some(e)) => close("d_bias", g, e),
            (None, None) => {}
            _ => panic!("d_bias present in one result only"),
        }
    }
}

/// Gradients shaped like `like`, stored column-major and full of NaN.
fn poisoned_column_major(like: &AttentionGradients<f32>) -> AttentionGradients<f32> {
    let nan = |x: &Array4<f32>| nan_filled(x.raw_dim());
    AttentionGradients {
        d_q: nan(&like.d_q),
        d_k: nan(&like.d_k),
        d_v: nan(&like.d_v),
        d_bias: like.d_bias.as_ref().map(nan),
        d_sinks: like.d_sinks.as_ref().map(|d| d.mapv(|_| f32::NAN)),
    }
}

/// Every gradient of `got` has the bits of `expected`'s.
fn assert_same_bits(got: &AttentionGradients<f32>, expected: &AttentionGradients<f32>, what: &str) {
    let bits = |x: &Array4<f32>| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got.d_q), bits(&expected.d_q), "{what}: d_q");
    assert_eq!(bits(&got.d_k), bits(&expected.d_k), "{what}: d_k");
    assert_eq!(bits(&got.d_v), bits(&expected.d_v), "{what}: d_v");
    assert_eq!(
        got.d_bias.as_ref().map(bits),
        expected.d_bias.as_ref().map(bits),
        "{what}: d_bias"
    );
    let sink_bits = |x: &ndarray::Array1<f32>| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        got.d_sinks.as_ref().map(sink_bits),
        expected.d_sinks.as_ref().map(sink_bits),
        "{what}: d_sinks"
    );
}

#[test]
fn every_kernel_set_matches_the_reference_on_odd_shapes_and_every_option() {
    let dims = [1, 3, 8, 16, 17, 33, 64, 65];
    let lengths = [
        (0, 5),
        (5, 0),
        (1, 1),
        (7, 13),
        (13, 7),
        (64, 64),
        (70, 130),
        (97, 97),
    ];
    for case in 0..8 {
        for (n, &(len_q, len_kv)) in lengths.iter().enumerate() {
            let (d_k, d_v) = (
                dims[(n + case) % dims.len()],
                dims[(n * 3 + case) % dims.len()],
            );
            check(
                2,
                4,
                2,
                len_q,
                len_kv,
                d_k,
                d_v,
                case,
                (case * 31 + n) as u64,
                false,
            );
        }
    }
}

#[test]
fn masked_nan_and_infinity_never_reach_a_gradient() {
    for (len_q, len_kv) in [(9, 70), (70, 130)] {
        check(2, 2, 1, len_q, len_kv, 16, 8, 3, 11, true);
    }
}

#[test]
fn long_sequences_cross_many_tiles() {
    for case in [0, 1, 6] {
        check(1, 2, 2, 300, 260, 64, 64, case, 12, false);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_shapes_match_the_reference(
        batch in 1usize..3,
        group in 1usize..3,
        kv_heads in 1usize..3,
        len_q in 0usize..40,
        len_kv in 0usize..80,
        d_k in 1usize..40,
        d_v in 1usize..40,
        case in 0usize..8,
        seed in any::<u64>(),
    ) {
        check(batch, group * kv_heads, kv_heads, len_q, len_kv, d_k, d_v, case, seed, false);
    }
}

/// A forward output stored in column-major order (its rows strided) gives
/// the bits of a standard-layout one, on every kernel set: the fused
/// backward copies such a row before its dot product with `d_out`, and
/// sums both the same way. GQA, odd lengths and widths (`d_v` = 19 leaves
/// a remainder after the vectors).
#[test]
fn a_column_major_forward_output_gives_the_same_gradients() {
    // batch 2, 4 query heads on 2 kv heads, 37 queries, 70 keys, d_k 24.
    let f32_of = |x: Array4<f64>| x.mapv(|x| x as f32);
    let q = f32_of(seeded((2, 4, 37, 24), 11, 1.0));
    let k = f32_of(seeded((2, 2, 70, 24), 12, 1.0));
    let v = f32_of(seeded((2, 2, 70, 19), 13, 1.0));
    let w = f32_of(seeded((2, 4, 37, 19), 14, 1.0));
    let opts = AttentionOptions::new().causal();
    let (q, k, v) = (q.view(), k.view(), v.view());
    for set in available_kernel_sets() {
        sdpa::simd::with_kernel_set(set, || {
            let forward = scaled_dot_product_attention_partial(q, k, v, &opts).unwrap();
            let (output, log_sum_exp) = forward.clone().into_parts();
            let mut column_major = Array4::zeros(ShapeBuilder::f(output.raw_dim()));
            column_major.assign(&output);
            assert_ne!(column_major.strides()[3], 1);
            let relaid = AttentionPartial::from_parts(column_major, log_sum_exp).unwrap();
            let expected =
                scaled_dot_product_attention_backward(q, k, v, &opts, &forward, w.view());
            let actual = scaled_dot_product_attention_backward(q, k, v, &opts, &relaid, w.view());
            assert_same_bits(&actual.unwrap(), &expected.unwrap(), &format!("{set:?}"));
        })
        .expect("an available kernel set");
    }
}

/// `_into` with the reference's type (`f64`, through `core`) and every
/// gradient a caller can pass: with a bias and sinks, into arrays holding
/// another call's gradients, it gives the allocating call's; and arrays of
/// the wrong shapes, or a `d_bias` present without a bias (or missing with
/// one), are a shape error that names the gradient. The same for the
/// forward's `partial_into`.
#[test]
fn into_calls_overwrite_a_callers_arrays_and_refuse_wrong_shapes() {
    let q = seeded((1, 4, 9, 6), 21, 1.0);
    let k = seeded((1, 2, 11, 6), 22, 1.0);
    let v = seeded((1, 2, 11, 5), 23, 1.0);
    let w = seeded((1, 4, 9, 5), 24, 1.0);
    let bias = seeded((1, 4, 1, 11), 25, 1.0);
    let sinks = [0.5, -1.0, 0.25, 2.0];
    let opts = AttentionOptions::new()
        .causal()
        .bias(bias.view())
        .sinks(&sinks);
    let (q, k, v) = (q.view(), k.view(), v.view());
    let forward = scaled_dot_product_attention_partial(q, k, v, &opts).unwrap();
    let expected = scaled_dot_product_attention_backward(q, k, v, &opts, &forward, w.view());
    let expected = expected.unwrap();
    assert!(expected.d_bias.is_some() && expected.d_sinks.is_some());

    // Another call's gradients (another d_out), reused.
    let other =
        scaled_dot_product_attention_backward(q, k, v, &opts, &forward, w.mapv(|x| 3.0 - x).view());
    let mut reused = other.unwrap();
    reused.d_sinks = None;
    scaled_dot_product_attention_backward_into(q, k, v, &opts, &forward, w.view(), &mut reused)
        .unwrap();
    assert_eq!(reused, expected);

    // Another call's forward (bidirectional, no bias), reused.
    let mut partial =
        scaled_dot_product_attention_partial(q, k, v, &AttentionOptions::new()).unwrap();
    assert_ne!(partial, forward);
    scaled_dot_product_attention_partial_into(q, k, v, &opts, &mut partial).unwrap();
    assert_eq!(partial, forward);

    let shape_error = |result: Result<(), sdpa::AttentionError>, names: &str| {
        let error = result.expect_err("a shape error");
        assert_eq!(error.kind(), sdpa::ErrorKind::ShapeMismatch, "{error}");
        assert!(error.to_string().contains(names), "{error}");
    };
    type Spoil = fn(&mut AttentionGradients<f64>);
    let wrong: [(&str, Spoil); 5] = [
        ("d_q", |g| g.d_q = Array4::zeros((1, 4, 9, 5))),
        ("d_k", |g| g.d_k = Array4::zeros((1, 4, 11, 6))),
        ("d_v", |g| g.d_v = Array4::zeros((1, 2, 10, 5))),
        ("d_bias", |g| g.d_bias = None),
        ("d_bias", |g| g.d_bias = Some(Array4::zeros((1, 4, 9, 11)))),
    ];
    for (names, spoil) in wrong {
        let mut gradients = expected.clone();
        spoil(&mut gradients);
        let result = scaled_dot_product_attention_backward_into(
            q,
            k,
            v,
            &opts,
            &forward,
            w.view(),
            &mut gradients,
        );
        shape_error(result, names);
    }
    // A d_bias where the options have no bias.
    let no_bias = AttentionOptions::new().causal();
    let forward = scaled_dot_product_attention_partial(q, k, v, &no_bias).unwrap();
    let mut gradients = expected.clone();
    let result = scaled_dot_product_attention_backward_into(
        q,
        k,
        v,
        &no_bias,
        &forward,
        w.view(),
        &mut gradients,
    );
    shape_error(result, "d_bias");
    let mut partial =
        scaled_dot_product_attention_partial(q, k, v.slice(s![.., .., .., ..4]), &no_bias).unwrap();
    shape_error(
        scaled_dot_product_attention_partial_into(q, k, v, &no_bias, &mut partial),
        "partial's output",
    );
}
