//! The reliability issue's findings, one test each, on every kernel set:
//! non-finite data in what a query sees propagates (never a silent zero),
//! hidden data never leaks (masks and `−inf` biases alike, on the packed and
//! the decode path), shard gradients land in the right bias columns, and
//! shapes too large for memory are errors, not panics or aborts.

use ndarray::{Array4, Axis, s};
use sdpa::simd::{KernelSet, available_kernel_sets};
use sdpa::{AttentionOptions, AttentionPartial, ErrorKind};

fn on<R>(set: KernelSet, f: impl FnOnce() -> R) -> R {
    sdpa::simd::with_kernel_set(set, f).expect("an available kernel set")
}

/// Deterministic numbers in [-1, 1).
fn data(dim: (usize, usize, usize, usize), seed: usize) -> Array4<f64> {
    Array4::from_shape_fn(dim, |(b, h, i, c)| {
        let x = (b * 7919 + h * 104_729 + i * 131 + c * 31 + seed * 977) % 1999;
        x as f64 / 999.5 - 1.0
    })
}

fn f32s(x: &Array4<f64>) -> Array4<f32> {
    x.mapv(|x| x as f32)
}

/// The f32 output on every kernel set, and core's in f32 and f64.
fn every_path(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    opts32: &AttentionOptions<'_, f32>,
    opts64: &AttentionOptions<'_, f64>,
) -> Vec<(String, Array4<f64>)> {
    let (q32, k32, v32) = (f32s(q), f32s(k), f32s(v));
    let mut outs = Vec::new();
    for set in available_kernel_sets() {
        let out = on(set, || {
            sdpa::scaled_dot_product_attention(q32.view(), k32.view(), v32.view(), opts32)
        })
        .expect("a valid call");
        outs.push((format!("fused {set}"), out.mapv(f64::from)));
    }
    let core32 =
        sdpa::core::scaled_dot_product_attention(q32.view(), k32.view(), v32.view(), opts32)
            .expect("a valid call");
    outs.push(("core f32".into(), core32.mapv(f64::from)));
    let core64 = sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), opts64)
        .expect("a valid call");
    outs.push(("core f64".into(), core64));
    outs
}

#[test]
fn nan_in_a_visible_key_makes_the_rows_that_see_it_nan_on_every_path() {
    // Decode (2 rows) and packed (100 rows) shapes; the NaN key is key 3.
    for len_q in [2, 100] {
        let (q, mut k, v) = (
            data((1, 2, len_q, 16), 1),
            data((1, 2, 70, 16), 2),
            data((1, 2, 70, 16), 3),
        );
        k[[0, 1, 3, 5]] = f64::NAN;
        let (o32, o64) = (AttentionOptions::new(), AttentionOptions::new());
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            assert!(
                out.slice(s![0, 1, .., ..]).iter().all(|x| x.is_nan()),
                "{path}: head 1 must be NaN"
            );
            assert!(
                out.slice(s![0, 0, .., ..]).iter().all(|x| x.is_finite()),
                "{path}: head 0 is clean"
            );
        }
    }
}

#[test]
fn an_infinite_or_nan_bias_on_a_visible_key_gives_nan() {
    for bad in [f64::INFINITY, f64::NAN] {
        let (q, k, v) = (
            data((1, 1, 3, 8), 1),
            data((1, 1, 5, 8), 2),
            data((1, 1, 5, 8), 3),
        );
        let mut bias = Array4::<f64>::zeros((1, 1, 3, 5));
        bias[[0, 0, 1, 2]] = bad;
        let bias32 = f32s(&bias);
        let o32 = AttentionOptions::new().bias(bias32.view());
        let o64 = AttentionOptions::new().bias(bias.view());
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            assert!(
                out.slice(s![0, 0, 1, ..]).iter().all(|x| x.is_nan()),
                "{path}: {bad}"
            );
            assert!(
                out.slice(s![0, 0, 0, ..]).iter().all(|x| x.is_finite()),
                "{path}: {bad}"
            );
        }
    }
}

#[test]
fn a_row_whose_every_visible_score_is_nan_is_nan_not_zero() {
    // Query row 0 is NaN: every score it has is NaN.
    for len_q in [1, 40] {
        let (mut q, k, v) = (
            data((1, 1, len_q, 16), 1),
            data((1, 1, 9, 16), 2),
            data((1, 1, 9, 16), 3),
        );
        q.slice_mut(s![0, 0, 0, ..]).fill(f64::NAN);
        let (o32, o64) = (AttentionOptions::new(), AttentionOptions::new());
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            assert!(
                out.slice(s![0, 0, 0, ..]).iter().all(|x| x.is_nan()),
                "{path}"
            );
        }
    }
}

#[test]
fn scores_that_overflow_f32_give_non_finite_rows_not_zeros() {
    // Every score is −1e40: −inf in f32, finite in f64.
    let q = Array4::<f64>::from_elem((1, 1, 3, 16), 1e20);
    let k = Array4::<f64>::from_elem((1, 1, 70, 16), -1e20 / 16.0);
    let v = data((1, 1, 70, 16), 3);
    let (o32, o64) = (
        AttentionOptions::new().scale(1.0),
        AttentionOptions::new().scale(1.0),
    );
    for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
        if path == "core f64" {
            // Equal scores: the mean of the values.
            let mean = v.mean_axis(Axis(2)).unwrap();
            for i in 0..3 {
                for c in 0..16 {
                    assert!((out[[0, 0, i, c]] - mean[[0, 0, c]]).abs() < 1e-12);
                }
            }
        } else {
            assert!(out.iter().all(|x| !x.is_finite()), "{path}: {out}");
        }
    }
    // And a huge scale: +inf scores, NaN rows.
    // q·k = 16 everywhere: 1.6e39 after scaling, past f32::MAX.
    let (q, k) = (
        Array4::<f64>::ones((1, 1, 2, 16)),
        Array4::<f64>::ones((1, 1, 5, 16)),
    );
    let (o32, o64) = (
        AttentionOptions::new().scale(1e38),
        AttentionOptions::new().scale(1e300),
    );
    for (path, out) in every_path(&q, &k, &v.slice(s![.., .., ..5, ..]).to_owned(), &o32, &o64) {
        if path != "core f64" {
            assert!(out.iter().all(|x| !x.is_finite()), "{path}: {out}");
        }
    }
}

#[test]
fn a_product_that_overflows_towards_minus_infinity_beside_finite_scores_gives_nan() {
    // Key 0's score is 1e20·(−2e19) + 1e20·3e19 = +1e39 exactly, but a sum
    // in f32 that takes the first term first overflows to −inf, which would
    // silently give key 0 weight 0 and the row the other keys' average.
    // Decode (1 row) and packed (40 rows) shapes.
    for len_q in [1, 40] {
        let mut q = Array4::<f64>::zeros((1, 1, len_q, 16));
        q.slice_mut(s![.., .., .., ..2]).fill(1e20);
        let mut k = data((1, 1, 70, 16), 2).mapv(|x| x * 1e-20);
        k[[0, 0, 0, 0]] = -2e19;
        k[[0, 0, 0, 1]] = 3e19;
        let v = data((1, 1, 70, 16), 3);
        let (o32, o64) = (
            AttentionOptions::new().scale(1.0),
            AttentionOptions::new().scale(1.0),
        );
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            if path == "core f64" {
                // Key 0 outweighs the rest entirely: its values.
                for i in 0..len_q {
                    for c in 0..16 {
                        assert_eq!(out[[0, 0, i, c]], v[[0, 0, 0, c]], "{path}");
                    }
                }
            } else {
                assert!(
                    out.iter().all(|x| x.is_nan()),
                    "{path} (len_q {len_q}): {out}"
                );
            }
        }
    }
}

#[test]
fn a_scale_of_zero_gives_the_average_of_the_values_even_when_q_k_overflows() {
    // q·k = 16·1e40 overflows f32, but the scale multiplies q first on
    // every path: the scores are 0, never 0·inf.
    for len_q in [1, 40] {
        let q = Array4::<f64>::from_elem((1, 1, len_q, 16), 1e20);
        let k = Array4::<f64>::from_elem((1, 1, 7, 16), 1e20);
        let v = data((1, 1, 7, 16), 3);
        let (o32, o64) = (
            AttentionOptions::new().scale(0.0),
            AttentionOptions::new().scale(0.0),
        );
        let mean = v.mean_axis(Axis(2)).unwrap();
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            for i in 0..len_q {
                for c in 0..16 {
                    let (got, want) = (out[[0, 0, i, c]], mean[[0, 0, c]]);
                    assert!((got - want).abs() < 1e-6, "{path}: {got} vs {want}");
                }
            }
        }
    }
}

#[test]
fn keys_that_all_score_minus_infinity_give_nan_with_lse_minus_infinity_and_merge_as_nothing() {
    // Keys 0..5 hold −inf where every query holds 0.5: their scores are
    // −inf (from the data, not a bias); keys 5..9 score finitely. Keys
    // 0..5 alone: NaN output, log-sum-exp −inf (no weight at all). All
    // nine: weight 0 for the first five. So a shard holding only the −inf
    // keys merges as nothing, and the merge equals the unsplit call.
    for len_q in [1, 40] {
        let mut q = data((1, 1, len_q, 16), 1);
        q.slice_mut(s![.., .., .., 0]).fill(0.5);
        let mut k = data((1, 1, 9, 16), 2);
        k.slice_mut(s![.., .., ..5, 0]).fill(f64::NEG_INFINITY);
        let v = data((1, 1, 9, 16), 3);
        let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
        let mut paths: Vec<(String, PartialFn)> = available_kernel_sets()
            .into_iter()
            .map(|set| {
                let (q, k, v) = (q32.clone(), k32.clone(), v32.clone());
                let call: PartialFn = Box::new(move |keys, shard| {
                    let opts = AttentionOptions::new();
                    let opts = match shard {
                        Some(offset) => opts.key_shard(offset, 9),
                        None => opts,
                    };
                    let keys = s![.., .., keys, ..];
                    let partial = on(set, || {
                        sdpa::scaled_dot_product_attention_partial(
                            q.view(),
                            k.slice(keys),
                            v.slice(keys),
                            &opts,
                        )
                    })
                    .expect("a valid call");
                    AttentionPartial::from_parts(
                        partial.output().mapv(f64::from),
                        partial.log_sum_exp().mapv(f64::from),
                    )
                    .unwrap()
                });
                (format!("fused {set}"), call)
            })
            .collect();
        let (q64, k64, v64) = (q.clone(), k.clone(), v.clone());
        paths.push((
            "core f64".into(),
            Box::new(move |keys, shard| {
                let opts = AttentionOptions::new();
                let opts = match shard {
                    Some(offset) => opts.key_shard(offset, 9),
                    None => opts,
                };
                let keys = s![.., .., keys, ..];
                sdpa::scaled_dot_product_attention_partial(
                    q64.view(),
                    k64.slice(keys),
                    v64.slice(keys),
                    &opts,
                )
                .expect("a valid call")
            }),
        ));
        for (path, partial) in &paths {
            let alone = partial(0..5, None);
            assert!(alone.output().iter().all(|x| x.is_nan()), "{path}");
            assert!(
                alone.log_sum_exp().iter().all(|&x| x == f64::NEG_INFINITY),
                "{path}"
            );
            let whole = partial(0..9, None);
            assert!(whole.output().iter().all(|x| x.is_finite()), "{path}");
            for order in [[0, 1], [1, 0]] {
                let shards = [partial(0..5, Some(0)), partial(5..9, Some(5))];
                let merged = AttentionPartial::merge_all(order.map(|n| shards[n].clone())).unwrap();
                for (a, b) in merged.output().iter().zip(whole.output()) {
                    assert!((a - b).abs() < 1e-6, "{path}: merged {a}, unsplit {b}");
                }
            }
        }
    }
}

/// A partial call over keys `keys` (with `Some(offset)`: as a shard of
/// all nine), its result in `f64`.
type PartialFn = Box<dyn Fn(std::ops::Range<usize>, Option<usize>) -> AttentionPartial<f64>>;

#[test]
fn a_row_hidden_entirely_by_a_minus_infinity_bias_is_zero() {
    let (q, k, v) = (
        data((1, 1, 2, 16), 1),
        data((1, 1, 5, 16), 2),
        data((1, 1, 5, 16), 3),
    );
    let mut bias = Array4::<f64>::zeros((1, 1, 2, 5));
    bias.slice_mut(s![0, 0, 0, ..]).fill(f64::NEG_INFINITY);
    let bias32 = f32s(&bias);
    let o32 = AttentionOptions::new().bias(bias32.view());
    let o64 = AttentionOptions::new().bias(bias.view());
    for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
        assert!(
            out.slice(s![0, 0, 0, ..]).iter().all(|&x| x == 0.0),
            "{path}"
        );
    }
}

#[test]
fn a_key_hidden_by_a_minus_infinity_bias_never_leaks_on_any_path() {
    // Few query rows with whole 64-key tiles and head dims of whole
    // vectors: the decode path, which reads values in place; and 100 rows:
    // the packed path.
    for len_q in [1, 3, 8, 100] {
        let (q, mut k, mut v) = (
            data((1, 2, len_q, 16), 1),
            data((1, 2, 128, 16), 2),
            data((1, 2, 128, 16), 3),
        );
        let mut bias = Array4::<f64>::zeros((1, 1, 1, 128));
        bias[[0, 0, 0, 5]] = f64::NEG_INFINITY;
        let mut clean = AttentionOptions::new();
        let expected = {
            let keep = Array4::from_shape_fn((1, 1, 1, 128), |(_, _, _, j)| j != 5);
            let out = sdpa::core::scaled_dot_product_attention(
                q.view(),
                k.view(),
                v.view(),
                &clean.clone().keep_mask(keep.view()),
            )
            .unwrap();
            clean = AttentionOptions::new();
            out
        };
        let _ = clean;
        v.slice_mut(s![0, .., 5, ..]).fill(f64::NAN);
        k.slice_mut(s![0, .., 5, ..]).fill(f64::INFINITY);
        let bias32 = f32s(&bias);
        let o32 = AttentionOptions::new().bias(bias32.view());
        let o64 = AttentionOptions::new().bias(bias.view());
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            for (&got, &want) in out.iter().zip(&expected) {
                assert!(
                    (got - want).abs() < 1e-5,
                    "{path} (len_q {len_q}): {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn a_visible_nan_value_whose_weight_underflows_to_zero_is_skipped_on_every_f32_path() {
    // Key 0's score is far below the others: its weight is exactly 0 in
    // f32, so its NaN value contributes nothing (as in core f32).
    for len_q in [1, 100] {
        let q = Array4::<f64>::from_elem((1, 1, len_q, 16), 1.0);
        let mut k = Array4::<f64>::from_elem((1, 1, 70, 16), 0.5);
        k.slice_mut(s![0, 0, 0, ..]).fill(-100.0);
        let mut v = data((1, 1, 70, 16), 3);
        v.slice_mut(s![0, 0, 0, ..]).fill(f64::NAN);
        let o32 = AttentionOptions::new().scale(1.0);
        let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
        let reference =
            sdpa::core::scaled_dot_product_attention(q32.view(), k32.view(), v32.view(), &o32)
                .unwrap();
        assert!(reference.iter().all(|x| x.is_finite()));
        for set in available_kernel_sets() {
            let out = on(set, || {
                sdpa::scaled_dot_product_attention(q32.view(), k32.view(), v32.view(), &o32)
            })
            .unwrap();
            for (&got, &want) in out.iter().zip(&reference) {
                assert!(
                    (got - want).abs() < 1e-5,
                    "{set} (len_q {len_q}): {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn shard_bias_gradients_land_in_the_shards_columns_on_every_kernel_set() {
    let (q, k, v) = (
        data((1, 2, 5, 8), 1),
        data((1, 2, 130, 8), 2),
        data((1, 2, 130, 8), 3),
    );
    let bias = data((1, 2, 5, 130), 4);
    let w = data((1, 2, 5, 8), 5);
    let o64 = AttentionOptions::new().bias(bias.view());
    let whole =
        sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &o64).unwrap();
    let keys = s![.., .., 64..130, ..];
    let shard64 = o64.clone().key_shard(64, 130);
    let expected = sdpa::scaled_dot_product_attention_backward(
        q.view(),
        k.slice(keys),
        v.slice(keys),
        &shard64,
        &whole,
        w.view(),
    )
    .unwrap()
    .d_bias
    .unwrap();
    assert!(
        expected
            .slice(s![.., .., .., ..64])
            .iter()
            .all(|&x| x == 0.0)
    );
    let (q32, k32, v32, bias32, w32) = (f32s(&q), f32s(&k), f32s(&v), f32s(&bias), f32s(&w));
    let (out, lse) = whole.clone().into_parts();
    let whole32 =
        AttentionPartial::from_parts(out.mapv(|x| x as f32), lse.mapv(|x: f64| x as f32)).unwrap();
    let shard32 = AttentionOptions::new()
        .bias(bias32.view())
        .key_shard(64, 130);
    for set in available_kernel_sets() {
        let got = on(set, || {
            sdpa::scaled_dot_product_attention_backward(
                q32.view(),
                k32.slice(keys),
                v32.slice(keys),
                &shard32,
                &whole32,
                w32.view(),
            )
        })
        .unwrap()
        .d_bias
        .unwrap();
        for ((index, &g), &e) in got.indexed_iter().zip(&expected) {
            assert!(
                (g as f64 - e).abs() < 1e-5,
                "{set}: d_bias{index:?} = {g}, expected {e}"
            );
        }
    }
}

#[test]
fn outputs_too_large_to_address_are_errors() {
    let small = Array4::<f32>::zeros((1, 1, 1, 4));
    let huge_q = small.broadcast((1, 1, 1usize << 60, 4)).unwrap();
    let err = sdpa::scaled_dot_product_attention(
        huge_q,
        small.view(),
        small.view(),
        &AttentionOptions::new(),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(
        err.to_string().contains(&(1usize << 60).to_string()),
        "{err}"
    );
    let small64 = small.mapv(f64::from);
    let huge_q64 = small64.broadcast((1, 1, 1usize << 60, 4)).unwrap();
    let err = sdpa::core::attention_weights(huge_q64, small64.view(), &AttentionOptions::new())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
}

#[test]
fn buffers_larger_than_memory_are_errors_not_aborts() {
    // 200,000 queries against 200,000 keys of one dimension, broadcast
    // from a single number: the weights would be 160 GB.
    let one = Array4::<f32>::ones((1, 1, 1, 1));
    let long = one.broadcast((1, 1, 200_000, 1)).unwrap();
    let err = sdpa::core::attention_weights(long, long, &AttentionOptions::new()).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::OutOfMemory | ErrorKind::TooLarge),
        "{err}"
    );
    // Keys broadcast to 2^56: packing them, or listing their decode chunks,
    // cannot fit.
    let q = Array4::<f32>::ones((1, 1, 9, 16));
    let k = Array4::<f32>::ones((1, 1, 1, 16));
    let k = k.broadcast((1, 1, 1usize << 56, 16)).unwrap();
    for set in available_kernel_sets() {
        for len_q in [1, 9] {
            let q = q.slice(s![.., .., ..len_q, ..]);
            let err = on(set, || {
                sdpa::scaled_dot_product_attention(q, k, k, &AttentionOptions::new())
            })
            .unwrap_err();
            assert!(
                matches!(err.kind(), ErrorKind::OutOfMemory | ErrorKind::TooLarge),
                "{set}: {err}"
            );
        }
    }
}

#[test]
fn the_f64_reference_works_in_blocks_of_rows_with_bounded_memory() {
    // 300,000 keys: the reference holds a few query rows' weights at a
    // time, so 7 rows take three blocks; the result matches the fused path.
    let (q, k, v) = (
        data((1, 1, 7, 2), 1),
        data((1, 1, 300_000, 2), 2),
        data((1, 1, 300_000, 2), 3),
    );
    let opts = AttentionOptions::new().causal_aligned(sdpa::CausalAlignment::TopLeft);
    let reference =
        sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap();
    let partial =
        sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts).unwrap();
    assert_eq!(partial.output(), reference.view());
    // Row i sees keys 0..=i: check against the definition.
    for i in 0..7 {
        let scores: Vec<f64> = (0..=i)
            .map(|j| {
                (q[[0, 0, i, 0]] * k[[0, 0, j, 0]] + q[[0, 0, i, 1]] * k[[0, 0, j, 1]])
                    / 2f64.sqrt()
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for c in 0..2 {
            let want: f64 = weights
                .iter()
                .enumerate()
                .map(|(j, w)| w * v[[0, 0, j, c]])
                .sum::<f64>()
                / total;
            assert!((reference[[0, 0, i, c]] - want).abs() < 1e-12);
        }
        assert!((partial.log_sum_exp()[[0, 0, i]] - (max + total.ln())).abs() < 1e-12);
    }
}

#[test]
fn key_shards_past_the_addressable_range_are_errors() {
    let x = Array4::<f32>::ones((1, 1, 2, 4));
    let k = Array4::<f32>::ones((1, 1, 5, 4));
    for opts in [
        AttentionOptions::new().key_shard(usize::MAX, 5),
        AttentionOptions::new().key_shard(usize::MAX - 2, usize::MAX),
        AttentionOptions::new().key_shard(0, usize::MAX).causal(),
    ] {
        let err =
            sdpa::scaled_dot_product_attention(x.view(), k.view(), k.view(), &opts).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidOption, "{err}");
    }
    // A valid but huge total: the causal diagonal must not wrap around.
    let total = 1usize << 60;
    let causal = AttentionOptions::new().causal().key_shard(0, total);
    let all = AttentionOptions::new().key_shard(0, total);
    let q = Array4::from_shape_fn((1, 1, 2, 4), |(_, _, i, c)| (i + c) as f32 * 0.3);
    let v = Array4::from_shape_fn((1, 1, 5, 4), |(_, _, j, c)| (j * c) as f32 * 0.1);
    let a =
        sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &causal).unwrap();
    let b = sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &all).unwrap();
    assert_eq!(a, b);
    let expected =
        sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &AttentionOptions::new())
            .unwrap();
    for (x, y) in a.output().iter().zip(&expected) {
        assert!((x - y).abs() < 1e-6);
    }
}

#[test]
fn a_nan_in_an_early_key_tile_sticks_through_later_finite_tiles() {
    // Keys 0..64 (the first key tile) give NaN scores, keys 64..130 finite
    // ones: the first tile alone sees nothing finite, yet the row is NaN.
    for len_q in [2, 100] {
        let (q, mut k, v) = (
            data((1, 1, len_q, 16), 1),
            data((1, 1, 130, 16), 2),
            data((1, 1, 130, 16), 3),
        );
        k.slice_mut(s![0, 0, ..64, 0]).fill(f64::NAN);
        let (o32, o64) = (AttentionOptions::new(), AttentionOptions::new());
        for (path, out) in every_path(&q, &k, &v, &o32, &o64) {
            assert!(out.iter().all(|x| x.is_nan()), "{path} (len_q {len_q})");
        }
    }
}

#[test]
fn a_huge_user_log_sum_exp_in_the_backward_does_not_panic() {
    // A forward result received from elsewhere with a log-sum-exp of −1e30:
    // exp(s − lse) overflows to +inf, which must not overflow an integer.
    let (q, k, v) = (
        data((1, 1, 3, 16), 1),
        data((1, 1, 70, 16), 2),
        data((1, 1, 70, 16), 3),
    );
    let (q, k, v) = (f32s(&q), f32s(&k), f32s(&v));
    let forward = AttentionPartial::from_parts(
        Array4::<f32>::zeros((1, 1, 3, 16)),
        ndarray::Array3::from_elem((1, 1, 3), -1e30f32),
    )
    .unwrap();
    for set in available_kernel_sets() {
        let grads = on(set, || {
            sdpa::scaled_dot_product_attention_backward(
                q.view(),
                k.view(),
                v.view(),
                &AttentionOptions::new(),
                &forward,
                q.view(),
            )
        })
        .unwrap();
        assert!(grads.d_v.iter().any(|x| !x.is_finite()), "{set}");
    }
}
