//! Attention split over key shards and merged equals the unsplit call, for
//! every option, every grouping, the reference and every kernel set.

use ndarray::{Array4, ArrayView4, Axis, s};
use proptest::prelude::*;

use crate::common;
use common::{option_case, seeded};
use sdpa::simd::available_kernel_sets;
use sdpa::{AttentionOptions, AttentionPartial, scaled_dot_product_attention_partial};

/// Splits the keys at `cuts` and merges the partials, left to right or
/// right to left.
fn split_and_merge<F: sdpa::Element>(
    q: ArrayView4<F>,
    k: ArrayView4<F>,
    v: ArrayView4<F>,
    cuts: &[usize],
    opts: &AttentionOptions<F>,
    right_to_left: bool,
) -> Array4<F> {
    let len_kv = k.len_of(Axis(2));
    let mut bounds = vec![0];
    bounds.extend(cuts.iter().copied().filter(|&c| c <= len_kv));
    bounds.push(len_kv);
    bounds.sort_unstable();
    let mut partials: Vec<AttentionPartial<F>> = bounds
        .windows(2)
        .map(|w| {
            let (a, b) = (w[0], w[1]);
            scaled_dot_product_attention_partial(
                q,
                k.slice(s![.., .., a..b, ..]),
                v.slice(s![.., .., a..b, ..]),
                &opts.clone().key_shard(a, len_kv),
            )
            .expect("shard call")
        })
        .collect();
    if right_to_left {
        partials.reverse();
    }
    AttentionPartial::merge_all(partials).unwrap().into_output()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_split_of_the_keys_merges_to_the_unsplit_call(
        len_q in 0usize..12,
        len_kv in 0usize..40,
        cuts in proptest::collection::vec(0usize..40, 0..4),
        case in 0usize..8,
        right_to_left in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let q = seeded((2, 2, len_q, 5), seed, 2.0);
        let k = seeded((2, 1, len_kv, 5), seed ^ 1, 2.0);
        let v = seeded((2, 1, len_kv, 3), seed ^ 2, 2.0);
        let keep = seeded((2, 1, len_q, len_kv), seed ^ 3, 2.0).mapv(|x| x > -1.2);
        let bias = seeded((1, 2, len_q, len_kv), seed ^ 4, 2.0);
        let lengths = [len_kv, len_kv * 2 / 3];
        let opts = option_case(case, &keep, &bias, &lengths);
        let whole = sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap();
        let merged = split_and_merge(q.view(), k.view(), v.view(), &cuts, &opts, right_to_left);
        for (a, b) in merged.iter().zip(&whole) {
            prop_assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }

        // The fast path, on every kernel set, to f32 rounding.
        let (q32, k32, v32) = (q.mapv(|x| x as f32), k.mapv(|x| x as f32), v.mapv(|x| x as f32));
        let bias32 = bias.mapv(|x| x as f32);
        for set in available_kernel_sets() {
            let opts = option_case(case, &keep, &bias32, &lengths);
            let merged = sdpa::simd::with_kernel_set(set, || {
                split_and_merge(q32.view(), k32.view(), v32.view(), &cuts, &opts, right_to_left)
            })
            .unwrap();
            for (a, b) in merged.iter().zip(&whole) {
                prop_assert!((*a as f64 - b).abs() < 1e-5, "{set}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn log_sum_exp_is_that_of_the_visible_scaled_scores() {
    let (q, k, v) = (
        seeded((1, 1, 6, 4), 1, 2.0),
        seeded((1, 1, 6, 4), 2, 2.0),
        seeded((1, 1, 6, 2), 3, 2.0),
    );
    let opts = AttentionOptions::new().causal();
    let partial =
        scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts).unwrap();
    for i in 0..6 {
        let direct = (0..=i)
            .map(|j| {
                (0..4)
                    .map(|c| q[[0, 0, i, c]] * k[[0, 0, j, c]])
                    .sum::<f64>()
                    / 2.0
            })
            .map(f64::exp)
            .sum::<f64>()
            .ln();
        assert!((partial.log_sum_exp()[[0, 0, i]] - direct).abs() < 1e-12);
    }
    for set in available_kernel_sets() {
        let (q, k, v) = (
            q.mapv(|x| x as f32),
            k.mapv(|x| x as f32),
            v.mapv(|x| x as f32),
        );
        let fast = sdpa::simd::with_kernel_set(set, || {
            scaled_dot_product_attention_partial(
                q.view(),
                k.view(),
                v.view(),
                &AttentionOptions::new().causal(),
            )
        })
        .unwrap()
        .unwrap();
        for (a, b) in fast.log_sum_exp().iter().zip(partial.log_sum_exp()) {
            assert!((*a as f64 - b).abs() < 1e-5, "{set}");
        }
    }
}

#[test]
fn a_shard_a_row_cannot_see_has_minus_infinity_and_merges_as_nothing() {
    let (q, k) = (seeded((1, 1, 3, 2), 5, 2.0), seeded((1, 1, 6, 2), 6, 2.0));
    // Causal, bottom-right over 6 keys with 3 queries: query 0 sees keys 0..=3.
    let late = scaled_dot_product_attention_partial(
        q.view(),
        k.slice(s![.., .., 4.., ..]),
        k.slice(s![.., .., 4.., ..]),
        &AttentionOptions::new().causal().key_shard(4, 6),
    )
    .unwrap();
    assert_eq!(late.log_sum_exp()[[0, 0, 0]], f64::NEG_INFINITY);
    assert!(
        late.output()
            .slice(s![0, 0, 0, ..])
            .iter()
            .all(|&x| x == 0.0)
    );
}

#[test]
fn bad_shards_and_parts_are_errors() {
    let x = Array4::<f64>::zeros((1, 1, 2, 2));
    let too_far = AttentionOptions::new().key_shard(1, 2);
    assert!(scaled_dot_product_attention_partial(x.view(), x.view(), x.view(), &too_far).is_err());
    assert!(AttentionPartial::from_parts(x.clone(), ndarray::Array3::zeros((1, 1, 3))).is_err());
    let mut a = AttentionPartial::from_parts(x.clone(), ndarray::Array3::zeros((1, 1, 2))).unwrap();
    let b = AttentionPartial::from_parts(
        Array4::zeros((1, 1, 2, 3)),
        ndarray::Array3::zeros((1, 1, 2)),
    )
    .unwrap();
    assert!(a.merge(&b).is_err());
    assert!(AttentionPartial::<f64>::merge_all([]).is_err());
}
