//! The semantics of attention on small, hand-checked cases: the seed's
//! numeric trace, mask polarity, both causal alignments, zero rows, masked
//! NaN, bias, scale, broadcasting and GQA, on `sdpa::` and `sdpa::core::`
//! in `f32` and `f64`.

use crate::common;

use approx::assert_abs_diff_eq;
use common::{Inputs, Rng, assert_close, both_paths, cast, to_f64, tolerance};
use ndarray::{Array1, Array4, arr2, s};
use sdpa::{AttentionOptions, CausalAlignment, Element};

/// A `[1, 1, len, d]` array from rows.
fn rows<F: Element>(rows: &[&[f64]]) -> Array4<F> {
    let d = rows.first().map_or(0, |r| r.len());
    Array4::from_shape_fn((1, 1, rows.len(), d), |(_, _, i, j)| cast(rows[i][j]))
}

/// Runs `check` for `f32` and `f64`.
macro_rules! for_both_types {
    ($check:ident) => {
        $check::<f32>();
        $check::<f64>();
    };
}

/// The seed's trace: three tokens, `d_k = d_v = 2`, the third query
/// `q₃ = (1, 1)` against keys `(1, 0), (0, 1), (1, 1)` gives scores 1, 1, 2,
/// scaled by `1/√2` to 0.707, 0.707, 1.414, and weights 0.248, 0.248, 0.503.
/// Causal: the first query sees only the first key, the second the first two.
fn seed_trace<F: Element>() {
    let q = rows::<F>(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 1.0]]);
    let k = rows::<F>(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 1.0]]);
    let v = rows::<F>(&[&[1.0, 2.0], &[3.0, 5.0], &[-1.0, 0.5]]);
    let opts = AttentionOptions::new().causal();
    let w = sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap();
    let w = w.slice(s![0, 0, .., ..]).mapv(to_f64);

    // The seed's rounded numbers.
    assert_abs_diff_eq!(w[[2, 0]], 0.248, epsilon = 5e-4);
    assert_abs_diff_eq!(w[[2, 1]], 0.248, epsilon = 5e-4);
    assert_abs_diff_eq!(w[[2, 2]], 0.503, epsilon = 5e-4);
    // Exactly: softmax(1/√2, 1/√2, 2/√2).
    let s = std::f64::consts::FRAC_1_SQRT_2;
    let total = 2.0 * s.exp() + (2.0 * s).exp();
    let third = [s.exp() / total, s.exp() / total, (2.0 * s).exp() / total];
    // Query 2 (`(0, 1)`) sees keys 0 and 1 with scores 0 and 1/√2.
    let second = [1.0 / (1.0 + s.exp()), s.exp() / (1.0 + s.exp()), 0.0];
    let expected = arr2(&[[1.0, 0.0, 0.0], second, third]);
    assert_close(&w.view(), &expected.view(), tolerance::<F>());

    // y₃ = Σ αⱼ vⱼ, and the other rows likewise.
    let v64 = v.slice(s![0, 0, .., ..]).mapv(to_f64);
    let y_expected: ndarray::Array2<f64> = expected.dot(&v64);
    for (path, out) in both_paths(&Inputs { q, k, v }, &opts) {
        let y = out.slice(s![0, 0, .., ..]).mapv(to_f64);
        common::close(&y.view(), &y_expected.view(), tolerance::<F>())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

#[test]
fn seed_numeric_trace() {
    for_both_types!(seed_trace);
}

/// Without the `1/√d_k` scaling the same scores 1, 1, 2 give the seed's
/// sharper 0.212, 0.212, 0.576.
fn seed_trace_unscaled<F: Element>() {
    let q = rows::<F>(&[&[1.0, 1.0]]);
    let k = rows::<F>(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 1.0]]);
    let w = sdpa::core::attention_weights(
        q.view(),
        k.view(),
        &AttentionOptions::new().scale(cast(1.0)),
    )
    .unwrap();
    let w = w.slice(s![0, 0, 0, ..]).mapv(to_f64);
    assert_abs_diff_eq!(w, Array1::from(vec![0.212, 0.212, 0.576]), epsilon = 5e-4);
    let total = 2.0 * 1f64.exp() + 2f64.exp();
    let exact = Array1::from(vec![
        1f64.exp() / total,
        1f64.exp() / total,
        2f64.exp() / total,
    ]);
    assert_abs_diff_eq!(w, exact, epsilon = tolerance::<F>());
}

#[test]
fn seed_numeric_trace_without_scaling() {
    for_both_types!(seed_trace_unscaled);
}

/// The seed's one-sigma table: two keys whose raw scores differ by `√d_k`.
/// Unscaled, the winner's probability climbs with `d_k` (0.88, 0.9997,
/// 1.0000); with the default `1/√d_k` it stays at 0.73.
fn one_sigma_gap<F: Element>() {
    for (d_k, unscaled) in [(4, 0.88), (64, 0.9997), (1024, 1.0000)] {
        let mut q = Array4::<F>::zeros((1, 1, 1, d_k));
        q[[0, 0, 0, 0]] = cast((d_k as f64).sqrt());
        let mut k = Array4::<F>::zeros((1, 1, 2, d_k));
        k[[0, 0, 0, 0]] = F::one();
        let winner = |opts: AttentionOptions<'_, F>| {
            to_f64(sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap()[[0, 0, 0, 0]])
        };
        let raw = winner(AttentionOptions::new().scale(F::one()));
        assert_abs_diff_eq!(raw, unscaled, epsilon = if d_k == 4 { 5e-3 } else { 5e-5 });
        let scaled = winner(AttentionOptions::new());
        assert_abs_diff_eq!(scaled, 0.73, epsilon = 5e-3);
        assert_abs_diff_eq!(
            scaled,
            1.0 / (1.0 + (-1f64).exp()),
            epsilon = tolerance::<F>()
        );
    }
}

#[test]
fn seed_one_sigma_table() {
    for_both_types!(one_sigma_gap);
}

/// The zero pattern of the causal weights for `len_q × len_kv`, as 0/1.
fn causal_pattern(alignment: CausalAlignment, len_q: usize, len_kv: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng::new(7);
    let q = rng.array::<f64>([1, 1, len_q, 3]);
    let k = rng.array::<f64>([1, 1, len_kv, 3]);
    let w = sdpa::core::attention_weights(
        q.view(),
        k.view(),
        &AttentionOptions::new().causal_aligned(alignment),
    )
    .unwrap();
    w.slice(s![0, 0, .., ..])
        .rows()
        .into_iter()
        .map(|r| r.iter().map(|&x| u8::from(x != 0.0)).collect())
        .collect()
}

#[test]
fn causal_bottom_right_by_hand() {
    use CausalAlignment::BottomRight;
    // 2 new queries against a 4-key cache: the last query sees every key.
    assert_eq!(
        causal_pattern(BottomRight, 2, 4),
        [[1, 1, 1, 0], [1, 1, 1, 1]]
    );
    // More queries than keys: the first queries see nothing (zero rows).
    assert_eq!(
        causal_pattern(BottomRight, 4, 2),
        [[0, 0], [0, 0], [1, 0], [1, 1]]
    );
    assert_eq!(
        causal_pattern(BottomRight, 3, 3),
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    );
    // Decoding one token sees the whole cache.
    assert_eq!(causal_pattern(BottomRight, 1, 5), [[1, 1, 1, 1, 1]]);
}

#[test]
fn causal_top_left_by_hand() {
    use CausalAlignment::TopLeft;
    assert_eq!(causal_pattern(TopLeft, 2, 4), [[1, 0, 0, 0], [1, 1, 0, 0]]);
    assert_eq!(
        causal_pattern(TopLeft, 4, 2),
        [[1, 0], [1, 1], [1, 1], [1, 1]]
    );
    assert_eq!(
        causal_pattern(TopLeft, 3, 3),
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    );
    assert_eq!(causal_pattern(TopLeft, 1, 5), [[1, 0, 0, 0, 0]]);
}

/// The zero pattern of the weights with a sliding window of `window` keys.
fn window_pattern(
    alignment: Option<CausalAlignment>,
    window: usize,
    len_q: usize,
    len_kv: usize,
) -> Vec<Vec<u8>> {
    let mut rng = Rng::new(8);
    let q = rng.array::<f64>([1, 1, len_q, 3]);
    let k = rng.array::<f64>([1, 1, len_kv, 3]);
    let mut opts = AttentionOptions::new().window(window);
    if let Some(alignment) = alignment {
        opts = opts.causal_aligned(alignment);
    }
    let w = sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap();
    w.slice(s![0, 0, .., ..])
        .rows()
        .into_iter()
        .map(|r| r.iter().map(|&x| u8::from(x != 0.0)).collect())
        .collect()
}

#[test]
fn sliding_window_by_hand() {
    use CausalAlignment::{BottomRight, TopLeft};
    let bottom_right = [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]];
    // A window alone is causal, bottom-right.
    assert_eq!(window_pattern(None, 2, 3, 5), bottom_right);
    assert_eq!(window_pattern(Some(BottomRight), 2, 3, 5), bottom_right);
    assert_eq!(
        window_pattern(Some(TopLeft), 2, 3, 5),
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0]]
    );
    // A window of 1 is the diagonal; one at least len_kv is plain causal.
    assert_eq!(
        window_pattern(None, 1, 3, 3),
        [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    );
    assert_eq!(
        window_pattern(None, 3, 3, 3),
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    );
}

#[test]
fn causal_is_bottom_right() {
    assert_eq!(CausalAlignment::default(), CausalAlignment::BottomRight);
    let mut rng = Rng::new(11);
    let inputs = Inputs::<f64>::random(&dims(2, 5), &mut rng);
    let causal = both_paths(&inputs, &AttentionOptions::new().causal());
    let bottom_right = both_paths(
        &inputs,
        &AttentionOptions::new().causal_aligned(CausalAlignment::BottomRight),
    );
    for ((path, a), (_, b)) in causal.iter().zip(&bottom_right) {
        assert_eq!(a, b, "{path}");
    }
}

/// Small dims: batch 2, heads 4 over kv_heads 2, d_k 3, d_v 5.
fn dims(len_q: usize, len_kv: usize) -> common::Dims {
    common::Dims {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        len_q,
        len_kv,
        d_k: 3,
        d_v: 5,
    }
}

/// A query with no visible key outputs zeros (PyTorch gives NaN), whatever
/// hides the keys, in every path.
fn zero_rows<F: Element>() {
    let mut rng = Rng::new(3);
    let d = dims(4, 2);
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let all_false = Array4::from_elem((1, 1, 1, 2), false);
    let neg_inf_bias = Array4::from_elem((1, 1, 1, 1), F::neg_infinity());
    let no_key = [
        (
            "keep_mask all false",
            AttentionOptions::new().keep_mask(all_false.view()),
        ),
        (
            "key_lengths 0",
            AttentionOptions::new().key_lengths(&[0, 0]),
        ),
        (
            "bias all -inf",
            AttentionOptions::new().bias(neg_inf_bias.view()),
        ),
    ];
    for (what, opts) in no_key {
        for (path, out) in both_paths(&inputs, &opts) {
            assert!(out.iter().all(|&x| x == F::zero()), "{path}, {what}: {out}");
        }
        let w = sdpa::core::attention_weights(inputs.q.view(), inputs.k.view(), &opts).unwrap();
        assert!(w.iter().all(|&x| x == F::zero()), "weights, {what}");
    }
    // Bottom-right with len_q > len_kv: queries 0 and 1 see no key.
    for (path, out) in both_paths(&inputs, &AttentionOptions::new().causal()) {
        assert!(
            out.slice(s![.., .., ..2, ..])
                .iter()
                .all(|&x| x == F::zero()),
            "{path}"
        );
        assert!(
            out.slice(s![.., .., 2.., ..])
                .iter()
                .all(|&x| x != F::zero()),
            "{path}"
        );
    }
}

#[test]
fn rows_with_no_visible_key_are_zero() {
    for_both_types!(zero_rows);
}

/// `keep_mask` true means "may attend": a row that keeps only key `j`
/// outputs `v[j]`.
fn mask_polarity<F: Element>() {
    let mut rng = Rng::new(5);
    let d = dims(3, 4);
    let inputs = Inputs::<F>::random(&d, &mut rng);
    // Query i keeps key i + 1 only.
    let keep = Array4::from_shape_fn((1, 1, 3, 4), |(_, _, i, j)| j == i + 1);
    for (path, out) in both_paths(&inputs, &AttentionOptions::new().keep_mask(keep.view())) {
        for b in 0..2 {
            for h in 0..4 {
                for i in 0..3 {
                    let expected = inputs.v.slice(s![b, h / 2, i + 1, ..]);
                    common::close(&out.slice(s![b, h, i, ..]), &expected, tolerance::<F>())
                        .unwrap_or_else(|e| panic!("{path}, row {:?}: {e}", (b, h, i)));
                }
            }
        }
    }
}

#[test]
fn keep_mask_true_means_may_attend() {
    for_both_types!(mask_polarity);
}

/// NaN and ±inf in keys and values hidden by each kind of mask (causal
/// future, key-length padding, keep mask false) never reach the output.
fn masked_non_finite<F: Element>() {
    let mut rng = Rng::new(9);
    let d = dims(3, 5);
    let clean = Inputs::<F>::random(&d, &mut rng);
    let mut poisoned = clean.clone();
    // Keys 3 and 4 of every batch item: the causal future of query 0 (under
    // bottom-right, query i sees j ≤ i + 2), the padding past length 3, and
    // hidden by the keep mask below.
    poisoned.k.slice_mut(s![.., .., 3, ..]).fill(F::nan());
    poisoned.v.slice_mut(s![.., .., 3, ..]).fill(F::infinity());
    poisoned
        .k
        .slice_mut(s![.., .., 4, ..])
        .fill(F::neg_infinity());
    poisoned.v.slice_mut(s![.., .., 4, ..]).fill(F::nan());
    let lengths = [3, 3];
    let keep = Array4::from_shape_fn((1, 1, 1, 5), |(_, _, _, j)| j < 3);
    let cases = [
        ("key_lengths", AttentionOptions::new().key_lengths(&lengths)),
        ("keep_mask", AttentionOptions::new().keep_mask(keep.view())),
        (
            "causal top-left",
            AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft),
        ),
    ];
    for (what, opts) in cases {
        for ((path, out), (_, expected)) in both_paths(&poisoned, &opts)
            .iter()
            .zip(&both_paths(&clean, &opts))
        {
            assert!(out.iter().all(|x| x.is_finite()), "{path}, {what}: {out}");
            common::close(&out.view(), &expected.view(), tolerance::<F>())
                .unwrap_or_else(|e| panic!("{path}, {what}: {e}"));
        }
    }
    // Bottom-right: query 0 sees keys 0..=2 only, so its row stays finite.
    for (path, out) in both_paths(&poisoned, &AttentionOptions::new().causal()) {
        assert!(
            out.slice(s![.., .., 0, ..]).iter().all(|x| x.is_finite()),
            "{path}"
        );
    }
}

#[test]
fn nan_and_inf_in_masked_keys_and_values_never_leak() {
    for_both_types!(masked_non_finite);
}

/// A `-inf` bias entry acts like a `false` in the keep mask.
fn negative_infinite_bias<F: Element>() {
    let mut rng = Rng::new(13);
    let d = dims(6, 7);
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let keep = rng.mask(d.scores(), 0.6);
    let bias = keep.mapv(|k| if k { F::zero() } else { F::neg_infinity() });
    let by_mask = both_paths(&inputs, &AttentionOptions::new().keep_mask(keep.view()));
    let by_bias = both_paths(&inputs, &AttentionOptions::new().bias(bias.view()));
    for ((path, a), (_, b)) in by_bias.iter().zip(&by_mask) {
        common::close(&a.view(), &b.view(), tolerance::<F>())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

#[test]
fn negative_infinite_bias_acts_like_a_mask() {
    for_both_types!(negative_infinite_bias);
}

/// The bias is added to the scaled scores, unscaled: with `q = 0` the
/// weights are `softmax(bias)`.
fn bias_after_scaling<F: Element>() {
    let q = Array4::<F>::zeros((1, 1, 1, 4));
    let k = Array4::<F>::ones((1, 1, 4, 4));
    let bias = Array4::from_shape_fn((1, 1, 1, 4), |(_, _, _, j)| {
        cast::<F>(((j + 1) as f64).ln())
    });
    for scale in [None, Some(3.0)] {
        let mut opts = AttentionOptions::new().bias(bias.view());
        if let Some(s) = scale {
            opts = opts.scale(cast(s));
        }
        let w = sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap();
        assert_abs_diff_eq!(
            w.slice(s![0, 0, 0, ..]).mapv(to_f64),
            Array1::from(vec![0.1, 0.2, 0.3, 0.4]),
            epsilon = tolerance::<F>()
        );
    }
}

#[test]
fn bias_is_added_to_the_scaled_scores() {
    for_both_types!(bias_after_scaling);
}

/// `.scale(s)` replaces `1/√d_k`: it equals the default on `q·s·√d_k`, and
/// `.scale(0)` averages the visible values uniformly.
fn scale_option<F: Element>() {
    let mut rng = Rng::new(17);
    let d = common::Dims {
        d_k: 4,
        ..dims(3, 6)
    };
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let s = 0.37;
    let rescaled = Inputs {
        q: inputs.q.mapv(|x| x * cast(s * 2.0)),
        ..inputs.clone()
    };
    let with_scale = both_paths(&inputs, &AttentionOptions::new().scale(cast(s)));
    let default = both_paths(&rescaled, &AttentionOptions::new());
    for ((path, a), (_, b)) in with_scale.iter().zip(&default) {
        common::close(&a.view(), &b.view(), tolerance::<F>())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
    // The default is 1/√d_k = 1/2 here (d_k = 4, d_v = 5): d_v plays no part.
    let half = both_paths(&inputs, &AttentionOptions::new().scale(cast(0.5)));
    for ((path, a), (_, b)) in half
        .iter()
        .zip(&both_paths(&inputs, &AttentionOptions::new()))
    {
        common::close(&a.view(), &b.view(), tolerance::<F>())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
    // Scale 0, causal: query i averages values 0..=i + 3.
    for (path, out) in both_paths(&inputs, &AttentionOptions::new().scale(F::zero()).causal()) {
        for b in 0..2 {
            for h in 0..4 {
                for i in 0..3 {
                    let mean = inputs
                        .v
                        .slice(s![b, h / 2, ..i + 4, ..])
                        .mapv(to_f64)
                        .mean_axis(ndarray::Axis(0))
                        .unwrap();
                    common::close(&out.slice(s![b, h, i, ..]), &mean.view(), tolerance::<F>())
                        .unwrap_or_else(|e| panic!("{path}: {e}"));
                }
            }
        }
    }
}

#[test]
fn scale_replaces_one_over_sqrt_d_k() {
    for_both_types!(scale_option);
}

/// Scores far beyond `exp`'s range are fine: the maximum is subtracted
/// before `exp`, so scores 1000 and 999 weigh like 1 and 0.
fn large_scores<F: Element>() {
    for offset in [1000.0, -1000.0, 80.0, 1.0e4] {
        let q = rows::<F>(&[&[offset + 1.0]]);
        let k = rows::<F>(&[&[1.0], &[offset / (offset + 1.0)]]);
        let v = rows::<F>(&[&[1.0, 0.0], &[0.0, 1.0]]);
        let opts = AttentionOptions::new().scale(F::one());
        let w = sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap();
        let winner = 1.0 / (1.0 + (-1f64).exp());
        // Scores offset + 1 and offset carry relative rounding error.
        let tol = tolerance::<F>() * offset.abs();
        assert_abs_diff_eq!(to_f64(w[[0, 0, 0, 0]]), winner, epsilon = tol);
        for (path, out) in both_paths(
            &Inputs {
                q: q.clone(),
                k: k.clone(),
                v,
            },
            &opts,
        ) {
            assert!(
                out.iter().all(|x| x.is_finite()),
                "{path}, offset {offset}: {out}"
            );
            assert_abs_diff_eq!(to_f64(out[[0, 0, 0, 0]]), winner, epsilon = tol);
        }
    }
}

#[test]
fn large_scores_do_not_overflow() {
    for_both_types!(large_scores);
}

/// A key-padding keep mask `[batch, 1, 1, len_kv]` equals `key_lengths`.
fn padding_mask_equals_key_lengths<F: Element>() {
    let mut rng = Rng::new(19);
    let d = dims(4, 6);
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let lengths = [2, 6];
    let keep = Array4::from_shape_fn((2, 1, 1, 6), |(b, _, _, j)| j < lengths[b]);
    for causal in [false, true] {
        let (mut by_mask, mut by_lengths) = (
            AttentionOptions::new().keep_mask(keep.view()),
            AttentionOptions::new().key_lengths(&lengths),
        );
        if causal {
            by_mask = by_mask.causal();
            by_lengths = by_lengths.causal();
        }
        for ((path, a), (_, b)) in both_paths(&inputs, &by_mask)
            .iter()
            .zip(&both_paths(&inputs, &by_lengths))
        {
            common::close(&a.view(), &b.view(), tolerance::<F>())
                .unwrap_or_else(|e| panic!("{path}: {e}"));
        }
    }
}

#[test]
fn key_padding_mask_equals_key_lengths() {
    for_both_types!(padding_mask_equals_key_lengths);
}

/// Multi-query attention (one key/value head): query head `h` gives what a
/// single-head call with that head's queries gives.
fn multi_query<F: Element>() {
    let mut rng = Rng::new(23);
    let d = common::Dims {
        kv_heads: 1,
        ..dims(5, 7)
    };
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let opts = AttentionOptions::new().causal();
    for (path, out) in both_paths(&inputs, &opts) {
        for h in 0..d.heads {
            let single = Inputs {
                q: inputs.q.slice(s![.., h..h + 1, .., ..]).to_owned(),
                ..inputs.clone()
            };
            let expected = sdpa::core::scaled_dot_product_attention(
                single.q.view(),
                single.k.view(),
                single.v.view(),
                &opts,
            )
            .unwrap();
            common::close(
                &out.slice(s![.., h..h + 1, .., ..]),
                &expected.view(),
                tolerance::<F>(),
            )
            .unwrap_or_else(|e| panic!("{path}, head {h}: {e}"));
        }
    }
}

#[test]
fn multi_query_attention_shares_the_one_kv_head() {
    for_both_types!(multi_query);
}

/// Bias and keep mask of shapes `[1, 1, L, S]`, `[B, 1, 1, S]`,
/// `[1, H, L, 1]`, `[1, 1, 1, 1]` equal their full-shape versions.
fn broadcast_shapes<F: Element>() {
    let mut rng = Rng::new(29);
    let d = dims(3, 4);
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let full = d.scores();
    for shape in [
        [1, 1, 3, 4],
        [2, 1, 1, 4],
        [1, 4, 3, 1],
        [1, 1, 1, 1],
        [2, 4, 1, 4],
    ] {
        let bias = rng.array::<F>(shape);
        let keep = rng.mask(shape, 0.7);
        let opts = AttentionOptions::new()
            .causal()
            .bias(bias.view())
            .keep_mask(keep.view());
        let full_bias = bias.broadcast(full).unwrap().to_owned();
        let full_keep = keep.broadcast(full).unwrap().to_owned();
        let full_opts = AttentionOptions::new()
            .causal()
            .bias(full_bias.view())
            .keep_mask(full_keep.view());
        for ((path, a), (_, b)) in both_paths(&inputs, &opts)
            .iter()
            .zip(&both_paths(&inputs, &full_opts))
        {
            common::close(&a.view(), &b.view(), tolerance::<F>())
                .unwrap_or_else(|e| panic!("{path}, shape {shape:?}: {e}"));
        }
    }
}

#[test]
fn broadcast_bias_and_mask_shapes() {
    for_both_types!(broadcast_shapes);
}

/// Inputs given as slices with steps, reversed and transposed views, and a
/// transposed `out`, give the contiguous result.
fn strided<F: Element>() {
    let mut rng = Rng::new(31);
    let d = dims(5, 6);
    let inputs = Inputs::<F>::random(&d, &mut rng);
    let opts = AttentionOptions::new().causal();
    let expected = both_paths(&inputs, &opts);
    // Every third query row of a taller array.
    let mut tall = rng.array::<F>([2, 4, 15, 3]);
    tall.slice_mut(s![.., .., ..;3, ..]).assign(&inputs.q);
    let q = tall.slice(s![.., .., ..;3, ..]);
    // Keys stored in reverse order and with the head dimension reversed.
    let reversed = inputs
        .k
        .slice(s![.., .., ..;-1, ..;-1])
        .as_standard_layout()
        .into_owned();
    let k = reversed.slice(s![.., .., ..;-1, ..;-1]);
    // Values stored as [d_v, len_kv, kv_heads, batch].
    let transposed = inputs
        .v
        .view()
        .reversed_axes()
        .as_standard_layout()
        .into_owned();
    let v = transposed.view().reversed_axes();
    assert!(!q.is_standard_layout() && !k.is_standard_layout() && !v.is_standard_layout());
    let mut out_sdpa = Array4::<F>::zeros((5, 5, 4, 2));
    let mut out_core = Array4::<F>::zeros((5, 5, 4, 2));
    sdpa::scaled_dot_product_attention_into(q, k, v, &opts, out_sdpa.view_mut().reversed_axes())
        .unwrap();
    sdpa::core::scaled_dot_product_attention_into(
        q,
        k,
        v,
        &opts,
        out_core.view_mut().reversed_axes(),
    )
    .unwrap();
    let strided = [
        sdpa::scaled_dot_product_attention(q, k, v, &opts).unwrap(),
        sdpa::core::scaled_dot_product_attention(q, k, v, &opts).unwrap(),
    ];
    for ((out, into), (path, expected)) in strided.iter().zip([&out_sdpa, &out_core]).zip(&expected)
    {
        common::close(&out.view(), &expected.view(), tolerance::<F>())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        common::close(
            &into.view().reversed_axes(),
            &expected.view(),
            tolerance::<F>(),
        )
        .unwrap_or_else(|e| panic!("{path} _into: {e}"));
    }
}

#[test]
fn strided_views_equal_contiguous() {
    for_both_types!(strided);
}

/// Longer sequences than the property tests draw, crossing many tiles of
/// a fused kernel, and decoding (one query against a long cache):
/// `sdpa::` in `f32` against `sdpa::core` in `f64`, with each kind of option.
#[test]
fn f32_agrees_with_f64_reference_on_long_sequences() {
    use common::{Extras, OptionSpec};
    let specs = [
        OptionSpec::default(),
        OptionSpec {
            causal: Some(CausalAlignment::BottomRight),
            ..OptionSpec::default()
        },
        OptionSpec {
            causal: Some(CausalAlignment::TopLeft),
            key_lengths: true,
            ..OptionSpec::default()
        },
        OptionSpec {
            keep_mask: Some([false, true, true, false]),
            bias: Some([true, false, false, false]),
            scale: Some(0.3),
            ..OptionSpec::default()
        },
    ];
    let mut rng = Rng::new(37);
    for (len_q, len_kv, d_k) in [
        (200, 200, 64),
        (129, 257, 128),
        (67, 33, 17),
        (1, 300, 64),
        (1, 5000, 64),
        (3, 4097, 128),
    ] {
        let d = common::Dims {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            len_q,
            len_kv,
            d_k,
            d_v: d_k,
        };
        let inputs = Inputs::<f32>::random(&d, &mut rng);
        let wide = inputs.to_f64();
        for spec in &specs {
            let extras = Extras::<f32>::random(spec, &d, &mut rng);
            let out = sdpa::scaled_dot_product_attention(
                inputs.q.view(),
                inputs.k.view(),
                inputs.v.view(),
                &extras.options(),
            )
            .unwrap();
            let extras64 = extras.to_f64();
            let reference = sdpa::core::scaled_dot_product_attention(
                wide.q.view(),
                wide.k.view(),
                wide.v.view(),
                &extras64.options(),
            )
            .unwrap();
            common::close(&out.view(), &reference.view(), 1e-5).unwrap_or_else(|e| {
                panic!("len_q {len_q}, len_kv {len_kv}, d_k {d_k}, {spec:?}: {e}")
            });
        }
    }
}
