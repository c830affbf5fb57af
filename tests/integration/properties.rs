//! Properties of attention over random shapes (lengths 0, 1, odd, and past
//! 64; MHA, GQA and MQA) and random combinations of options, in `f32` and
//! `f64`, for the top-level functions (`sdpa::`, where `f32` takes the fast
//! path) and the reference (`sdpa::core`).
//!
//! Each property is a generic function run for both element types; the
//! arrays come from a seed that proptest draws, so a failure is reproducible.

use crate::common;

use common::{
    Dims, Extras, Inputs, OptionSpec, Rng, alignment, both_paths, broadcast_shape, dims,
    nonempty_dims, option_spec, prop_close, tolerance,
};
use ndarray::{Array4, ArrayView2, Axis, s};
use proptest::prelude::*;
use sdpa::{AttentionOptions, CausalAlignment, Element};

type Check = Result<(), TestCaseError>;

fn setup<F: Element>(dims: &Dims, spec: &OptionSpec, seed: u64) -> (Inputs<F>, Extras<F>) {
    let mut rng = Rng::new(seed);
    let inputs = Inputs::random(dims, &mut rng);
    let extras = Extras::random(spec, dims, &mut rng);
    (inputs, extras)
}

fn matches_the_definition<F: Element>(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let expected = extras.naive(&inputs);
    for (path, out) in both_paths(&inputs, &extras.options()) {
        prop_close(&out.view(), &expected.view(), tolerance::<F>())
            .map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
    }
    Ok(())
}

fn weight_rows_sum_to_one_or_are_zero<F: Element>(
    dims: Dims,
    spec: OptionSpec,
    seed: u64,
) -> Check {
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let weights =
        sdpa::core::attention_weights(inputs.q.view(), inputs.k.view(), &extras.options())
            .expect("valid call");
    prop_assert_eq!(weights.shape(), &dims.scores());
    for b in 0..dims.batch {
        for h in 0..dims.heads {
            for i in 0..dims.len_q {
                let row = weights.slice(s![b, h, i, ..]);
                let any_live = (0..dims.len_kv).any(|j| extras.live(b, h, i, j));
                for (j, &w) in row.iter().enumerate() {
                    prop_assert!(
                        w >= F::zero() && w <= F::one(),
                        "weight {w} at {:?}",
                        (b, h, i, j)
                    );
                    if !extras.live(b, h, i, j) {
                        prop_assert!(
                            w == F::zero(),
                            "masked or -inf key {j} of row {:?} has weight {w}",
                            (b, h, i)
                        );
                    }
                }
                let sum = common::to_f64(row.sum());
                if any_live {
                    prop_assert!(
                        (sum - 1.0).abs() <= tolerance::<F>(),
                        "row {:?} sums to {sum}",
                        (b, h, i)
                    );
                } else {
                    prop_assert!(
                        sum == 0.0,
                        "row {:?} has no visible finite-bias key but sums to {sum}",
                        (b, h, i)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Keys and values at `cut..` replaced with `replace(rng)`.
fn with_keys_from<F: Element>(
    inputs: &Inputs<F>,
    cut: usize,
    rng: &mut Rng,
    replace: impl Fn(&mut Rng) -> F,
) -> Inputs<F> {
    let mut changed = inputs.clone();
    changed
        .k
        .slice_mut(s![.., .., cut.., ..])
        .mapv_inplace(|_| replace(rng));
    changed
        .v
        .slice_mut(s![.., .., cut.., ..])
        .mapv_inplace(|_| replace(rng));
    changed
}

/// Changing keys and values at `cut..` leaves every output row that sees no
/// key at `cut` or later bit for bit the same (for finite replacements), or
/// within tolerance (NaN and ±inf in the masked keys never reach it).
fn causal_rows_ignore_the_future<F: Element>(
    dims: Dims,
    alignment: CausalAlignment,
    spec: OptionSpec,
    cut: prop::sample::Index,
    seed: u64,
) -> Check {
    let spec = OptionSpec {
        causal: Some(alignment),
        ..spec
    };
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let cut = cut.index(dims.len_kv + 1);
    let opts = extras.options();
    let before = both_paths(&inputs, &opts);
    let mut rng = Rng::new(seed ^ 0x5eed);
    let finite = with_keys_from(&inputs, cut, &mut rng, |r| {
        common::cast(r.uniform(-3.0, 3.0))
    });
    let poisons = [F::nan(), F::infinity(), F::neg_infinity()];
    let poisoned = with_keys_from(&inputs, cut, &mut rng, |r| poisons[r.below(3)]);
    for (changed, exact) in [(finite, true), (poisoned, false)] {
        let after = both_paths(&changed, &opts);
        for ((path, before), (_, after)) in before.iter().zip(&after) {
            for b in 0..dims.batch {
                for h in 0..dims.heads {
                    for i in 0..dims.len_q {
                        let sees_the_change =
                            (cut..dims.len_kv).any(|j| extras.visible(b, h, i, j));
                        if sees_the_change {
                            continue;
                        }
                        let (x, y) = (before.slice(s![b, h, i, ..]), after.slice(s![b, h, i, ..]));
                        if exact {
                            prop_assert_eq!(x, y, "{}: row {:?} changed", path, (b, h, i));
                        } else {
                            prop_close(&y, &x, tolerance::<F>()).map_err(|e| {
                                TestCaseError::fail(format!("{path}: row {:?}: {e}", (b, h, i)))
                            })?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Bidirectional attention: permuting the keys and values (and the key
/// axis of the mask and bias) together changes nothing; permuting the
/// queries (and the query axis of the mask and bias) permutes the output.
fn permutation_equivariant<F: Element>(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let spec = OptionSpec {
        causal: None,
        key_lengths: false,
        window: None,
        ..spec
    };
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let expected = both_paths(&inputs, &extras.options());
    let mut rng = Rng::new(seed ^ 0xbeef);

    let permute = |a: &Array4<F>, axis: usize, p: &[usize]| {
        if a.len_of(Axis(axis)) == 1 {
            a.clone()
        } else {
            a.select(Axis(axis), p)
        }
    };
    let permute_mask = |a: &Array4<bool>, axis: usize, p: &[usize]| {
        if a.len_of(Axis(axis)) == 1 {
            a.clone()
        } else {
            a.select(Axis(axis), p)
        }
    };

    let keys = rng.permutation(dims.len_kv);
    let permuted = Inputs {
        q: inputs.q.clone(),
        k: inputs.k.select(Axis(2), &keys),
        v: inputs.v.select(Axis(2), &keys),
    };
    let permuted_extras = Extras {
        keep_mask: extras.keep_mask.as_ref().map(|m| permute_mask(m, 3, &keys)),
        bias: extras.bias.as_ref().map(|b| permute(b, 3, &keys)),
        ..extras.clone()
    };
    for ((path, out), (_, expected)) in both_paths(&permuted, &permuted_extras.options())
        .iter()
        .zip(&expected)
    {
        prop_close(&out.view(), &expected.view(), tolerance::<F>())
            .map_err(|e| TestCaseError::fail(format!("{path}, keys permuted {keys:?}: {e}")))?;
    }

    let queries = rng.permutation(dims.len_q);
    let permuted = Inputs {
        q: inputs.q.select(Axis(2), &queries),
        ..inputs.clone()
    };
    let permuted_extras = Extras {
        keep_mask: extras
            .keep_mask
            .as_ref()
            .map(|m| permute_mask(m, 2, &queries)),
        bias: extras.bias.as_ref().map(|b| permute(b, 2, &queries)),
        ..extras.clone()
    };
    for ((path, out), (_, expected)) in both_paths(&permuted, &permuted_extras.options())
        .iter()
        .zip(&expected)
    {
        let expected = expected.select(Axis(2), &queries);
        prop_close(&out.view(), &expected.view(), tolerance::<F>()).map_err(|e| {
            TestCaseError::fail(format!("{path}, queries permuted {queries:?}: {e}"))
        })?;
    }
    Ok(())
}

/// Grouped-query attention equals multi-head attention on K/V repeated
/// per query head.
fn grouped_query_equals_multi_head<F: Element>(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let group = dims.heads / dims.kv_heads;
    let repeat = |a: &Array4<F>| {
        let [b, _, l, d] = [a.shape()[0], a.shape()[1], a.shape()[2], a.shape()[3]];
        Array4::from_shape_fn((b, dims.heads, l, d), |(b, h, j, d)| {
            a[[b, h / group, j, d]]
        })
    };
    let repeated = Inputs {
        q: inputs.q.clone(),
        k: repeat(&inputs.k),
        v: repeat(&inputs.v),
    };
    let multi_head = Extras {
        dims: dims.as_multi_head(),
        ..extras.clone()
    };
    let opts = extras.options();
    let mha_opts = multi_head.options();
    for ((path, gqa), (_, mha)) in both_paths(&inputs, &opts)
        .iter()
        .zip(&both_paths(&repeated, &mha_opts))
    {
        prop_close(&gqa.view(), &mha.view(), tolerance::<F>())
            .map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
    }
    let gqa = sdpa::core::attention_weights(inputs.q.view(), inputs.k.view(), &opts).unwrap();
    let mha =
        sdpa::core::attention_weights(repeated.q.view(), repeated.k.view(), &mha_opts).unwrap();
    prop_close(&gqa.view(), &mha.view(), tolerance::<F>())
}

/// `.causal_aligned(a)` equals an explicit keep mask built from the
/// definition of `a` (`.causal()` is bottom-right).
fn alignment_matches_its_definition<F: Element>(
    dims: Dims,
    alignment: CausalAlignment,
    seed: u64,
) -> Check {
    let (inputs, _) = setup::<F>(&dims, &OptionSpec::default(), seed);
    let definition = common::mask_from(&dims, |_, _, i, j| match alignment {
        CausalAlignment::BottomRight => common::bottom_right_visible(i, j, dims.len_q, dims.len_kv),
        CausalAlignment::TopLeft => common::top_left_visible(i, j),
    });
    let explicit = both_paths(
        &inputs,
        &AttentionOptions::new().keep_mask(definition.view()),
    );
    let mut aligned = vec![both_paths(
        &inputs,
        &AttentionOptions::new().causal_aligned(alignment),
    )];
    if alignment == CausalAlignment::BottomRight {
        aligned.push(both_paths(&inputs, &AttentionOptions::new().causal()));
    }
    for outputs in aligned {
        for ((path, out), (_, expected)) in outputs.iter().zip(&explicit) {
            prop_close(&out.view(), &expected.view(), tolerance::<F>())
                .map_err(|e| TestCaseError::fail(format!("{path}, {alignment:?}: {e}")))?;
        }
    }
    let weights = sdpa::core::attention_weights(
        inputs.q.view(),
        inputs.k.view(),
        &AttentionOptions::new().causal_aligned(alignment),
    )
    .unwrap();
    for ((_, _, i, j), &w) in weights.indexed_iter() {
        prop_assert_eq!(
            w == F::zero(),
            !definition[[0, 0, i, j]],
            "{:?} weight at ({}, {})",
            alignment,
            i,
            j
        );
    }
    Ok(())
}

/// `.window(w)` (alone, so bottom-right, or with either alignment) equals
/// an explicit keep mask built from the definitions of the causal rule and
/// the window.
fn window_matches_its_definition<F: Element>(
    dims: Dims,
    alignment: Option<CausalAlignment>,
    window: usize,
    seed: u64,
) -> Check {
    let (inputs, _) = setup::<F>(&dims, &OptionSpec::default(), seed);
    let (len_q, len_kv) = (dims.len_q, dims.len_kv);
    let definition = common::mask_from(&dims, |_, _, i, j| match alignment {
        Some(CausalAlignment::TopLeft) => {
            common::top_left_visible(i, j) && common::top_left_in_window(i, j, window)
        }
        _ => {
            common::bottom_right_visible(i, j, len_q, len_kv)
                && common::bottom_right_in_window(i, j, len_q, len_kv, window)
        }
    });
    let explicit = both_paths(
        &inputs,
        &AttentionOptions::new().keep_mask(definition.view()),
    );
    let mut opts = AttentionOptions::new().window(window);
    if let Some(alignment) = alignment {
        opts = opts.causal_aligned(alignment);
    }
    for ((path, out), (_, expected)) in both_paths(&inputs, &opts).iter().zip(&explicit) {
        prop_close(&out.view(), &expected.view(), tolerance::<F>()).map_err(|e| {
            TestCaseError::fail(format!("{path}, {alignment:?}, window {window}: {e}"))
        })?;
    }
    Ok(())
}

/// NaN and ±inf in keys, values and bias entries that no query may see
/// never reach the output: it equals the output on clean data.
fn masked_poison_never_leaks<F: Element>(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let (inputs, mut extras) = setup::<F>(&dims, &spec, seed);
    // A full-shaped bias, so each masked position can be poisoned alone.
    let bias = extras
        .bias
        .take()
        .map(|b| b.broadcast(dims.scores()).unwrap().to_owned())
        .unwrap_or_else(|| Array4::zeros(dims.scores()));
    extras.bias = Some(bias);
    let clean = both_paths(&inputs, &extras.options());

    let mut rng = Rng::new(seed ^ 0xdead);
    let poisons = [F::nan(), F::infinity(), F::neg_infinity()];
    let mut poisoned = inputs.clone();
    let mut poisoned_extras = extras.clone();
    let group = dims.heads / dims.kv_heads;
    for b in 0..dims.batch {
        for kv in 0..dims.kv_heads {
            for j in 0..dims.len_kv {
                let seen = (kv * group..(kv + 1) * group)
                    .any(|h| (0..dims.len_q).any(|i| extras.visible(b, h, i, j)));
                if !seen {
                    poisoned
                        .k
                        .slice_mut(s![b, kv, j, ..])
                        .mapv_inplace(|_| poisons[rng.below(3)]);
                    poisoned
                        .v
                        .slice_mut(s![b, kv, j, ..])
                        .mapv_inplace(|_| poisons[rng.below(3)]);
                }
            }
        }
    }
    let bias = poisoned_extras.bias.as_mut().unwrap();
    for ((b, h, i, j), x) in bias.indexed_iter_mut() {
        if !extras.visible(b, h, i, j) {
            *x = poisons[rng.below(3)];
        }
    }
    for ((path, out), (_, clean)) in both_paths(&poisoned, &poisoned_extras.options())
        .iter()
        .zip(&clean)
    {
        prop_assert!(
            out.iter().all(|x| x.is_finite()),
            "{}: non-finite output",
            path
        );
        prop_close(&out.view(), &clean.view(), tolerance::<F>())
            .map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
    }
    Ok(())
}

/// `attention_weights · V`, head by head, equals the output.
fn weights_times_values_is_the_output<F: Element>(
    dims: Dims,
    spec: OptionSpec,
    seed: u64,
) -> Check {
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let opts = extras.options();
    let weights = sdpa::core::attention_weights(inputs.q.view(), inputs.k.view(), &opts).unwrap();
    let group = dims.heads / dims.kv_heads;
    let mut expected = Array4::<F>::zeros(dims.out());
    for b in 0..dims.batch {
        for h in 0..dims.heads {
            let w: ArrayView2<'_, F> = weights.slice(s![b, h, .., ..]);
            let v: ArrayView2<'_, F> = inputs.v.slice(s![b, h / group, .., ..]);
            expected.slice_mut(s![b, h, .., ..]).assign(&w.dot(&v));
        }
    }
    for (path, out) in both_paths(&inputs, &opts) {
        prop_close(&out.view(), &expected.view(), tolerance::<F>())
            .map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
    }
    Ok(())
}

/// Strided inputs (permuted axes, a step-2 slice, reversed axes), strided
/// mask and bias, and a strided `out` give the contiguous result.
fn strided_views_equal_contiguous<F: Element>(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let expected = both_paths(&inputs, &extras.options());

    // q stored as [batch, len_q, heads, d_k], viewed with axes permuted.
    let q_stored = inputs
        .q
        .view()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned();
    let q = q_stored.view().permuted_axes([0, 2, 1, 3]);
    // k inside a larger array, every other row and column.
    let [b, kh, lkv, dk] = dims.k();
    let mut k_stored = Array4::from_elem((b, kh, 2 * lkv + 1, 2 * dk + 1), F::nan());
    k_stored
        .slice_mut(s![.., .., 1..;2, 1..;2])
        .assign(&inputs.k);
    let k = k_stored.slice(s![.., .., 1..;2, 1..;2]);
    // v stored reversed along len_kv and d_v, viewed reversed back.
    let v_stored = inputs
        .v
        .slice(s![.., .., ..;-1, ..;-1])
        .as_standard_layout()
        .into_owned();
    let v = v_stored.slice(s![.., .., ..;-1, ..;-1]);
    prop_assert!(
        v.strides()[2] < 0 || lkv <= 1 || v.is_empty(),
        "v is viewed reversed"
    );
    // The mask stored reversed along len_q, the bias stored transposed.
    let mask_stored = extras.keep_mask.as_ref().map(|m| {
        m.slice(s![.., .., ..;-1, ..])
            .as_standard_layout()
            .into_owned()
    });
    let bias_stored = extras.bias.as_ref().map(|m| {
        m.view()
            .permuted_axes([3, 2, 1, 0])
            .as_standard_layout()
            .into_owned()
    });
    let mut opts = AttentionOptions::new();
    if let Some(window) = extras.window {
        opts = opts.window(window);
    }
    if let Some(a) = extras.causal {
        opts = opts.causal_aligned(a);
    }
    if let Some(scale) = extras.scale {
        opts = opts.scale(scale);
    }
    if let Some(m) = &mask_stored {
        opts = opts.keep_mask(m.slice(s![.., .., ..;-1, ..]));
    }
    if let Some(bias) = &bias_stored {
        opts = opts.bias(bias.view().permuted_axes([3, 2, 1, 0]));
    }
    if let Some(lengths) = &extras.key_lengths {
        opts = opts.key_lengths(lengths);
    }
    let strided = [
        (
            "sdpa",
            sdpa::scaled_dot_product_attention(q, k, v, &opts).unwrap(),
        ),
        (
            "sdpa::core",
            sdpa::core::scaled_dot_product_attention(q, k, v, &opts).unwrap(),
        ),
    ];
    for ((path, out), (_, expected)) in strided.iter().zip(&expected) {
        prop_close(&out.view(), &expected.view(), tolerance::<F>())
            .map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
    }

    // `out` stored as [len_q, d_v, batch, heads] with a gap, viewed permuted.
    let [ob, oh, ol, od] = dims.out();
    let mut stored = Array4::from_elem((ol, od + 1, ob, oh), F::nan());
    {
        let out = stored
            .slice_mut(s![.., 1.., .., ..])
            .permuted_axes([2, 3, 0, 1]);
        sdpa::scaled_dot_product_attention_into(q, k, v, &opts, out).unwrap();
    }
    let out = stored
        .slice(s![.., 1.., .., ..])
        .permuted_axes([2, 3, 0, 1]);
    prop_close(&out, &expected[0].1.view(), tolerance::<F>())?;
    prop_assert!(
        stored.slice(s![.., 0, .., ..]).iter().all(|x| x.is_nan()),
        "_into wrote outside out"
    );
    Ok(())
}

/// A keep mask and bias with broadcast dimensions (length-1 arrays, and
/// stride-0 `broadcast` views) equal their full-shape versions.
fn broadcasting_equals_full_shape<F: Element>(
    dims: Dims,
    mask_ones: [bool; 4],
    bias_ones: [bool; 4],
    spec: OptionSpec,
    seed: u64,
) -> Check {
    let spec = OptionSpec {
        keep_mask: Some(mask_ones),
        bias: Some(bias_ones),
        ..spec
    };
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let mask = extras.keep_mask.as_ref().unwrap();
    let bias = extras.bias.as_ref().unwrap();
    prop_assert_eq!(mask.shape(), &broadcast_shape(dims.scores(), mask_ones));
    let full = dims.scores();
    let full_mask = mask.broadcast(full).unwrap().to_owned();
    let full_bias = bias.broadcast(full).unwrap().to_owned();
    let full_extras = Extras {
        keep_mask: Some(full_mask),
        bias: Some(full_bias),
        ..extras.clone()
    };
    let expected = both_paths(&inputs, &full_extras.options());
    let broadcast_views = extras
        .options()
        .keep_mask(mask.broadcast(full).unwrap())
        .bias(bias.broadcast(full).unwrap());
    for outputs in [
        both_paths(&inputs, &extras.options()),
        both_paths(&inputs, &broadcast_views),
    ] {
        for ((path, out), (_, expected)) in outputs.iter().zip(&expected) {
            prop_close(&out.view(), &expected.view(), tolerance::<F>())
                .map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
        }
    }
    Ok(())
}

/// `_into` with a non-contiguous `out` full of NaN equals the allocating call.
fn into_equals_allocating<F: Element>(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let (inputs, extras) = setup::<F>(&dims, &spec, seed);
    let opts = extras.options();
    let expected = both_paths(&inputs, &opts);
    let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    let [b, h, l, d] = dims.out();
    let mut sdpa_buffer = Array4::from_elem((b, l, h, 2 * d), F::nan());
    let mut core_buffer = sdpa_buffer.clone();
    sdpa::scaled_dot_product_attention_into(
        q,
        k,
        v,
        &opts,
        sdpa_buffer
            .slice_mut(s![.., .., .., ..;2])
            .permuted_axes([0, 2, 1, 3]),
    )
    .unwrap();
    sdpa::core::scaled_dot_product_attention_into(
        q,
        k,
        v,
        &opts,
        core_buffer
            .slice_mut(s![.., .., .., ..;2])
            .permuted_axes([0, 2, 1, 3]),
    )
    .unwrap();
    for ((path, buffer), (_, expected)) in [("sdpa", &sdpa_buffer), ("sdpa::core", &core_buffer)]
        .iter()
        .zip(&expected)
    {
        let out = buffer
            .slice(s![.., .., .., ..;2])
            .permuted_axes([0, 2, 1, 3]);
        // Same operations on the same data: the result must not depend on
        // where it is written.
        prop_assert_eq!(
            out,
            expected.view(),
            "{}: _into differs from the allocating call",
            path
        );
        prop_assert!(
            buffer
                .slice(s![.., .., .., 1..;2])
                .iter()
                .all(|x| x.is_nan()),
            "{}: wrote outside out",
            path
        );
    }
    Ok(())
}

/// `sdpa::scaled_dot_product_attention` in `f32` (the fast path once it
/// exists) agrees with the `f64` reference on the same inputs.
fn f32_agrees_with_f64_reference(dims: Dims, spec: OptionSpec, seed: u64) -> Check {
    let (inputs, extras) = setup::<f32>(&dims, &spec, seed);
    let out = sdpa::scaled_dot_product_attention(
        inputs.q.view(),
        inputs.k.view(),
        inputs.v.view(),
        &extras.options(),
    )
    .unwrap();
    let (inputs64, extras64) = (inputs.to_f64(), extras.to_f64());
    let reference = sdpa::core::scaled_dot_product_attention(
        inputs64.q.view(),
        inputs64.k.view(),
        inputs64.v.view(),
        &extras64.options(),
    )
    .unwrap();
    prop_close(&out.view(), &reference.view(), 1e-5)?;
    // And the reference itself agrees with the definition.
    prop_close(&reference.view(), &extras64.naive(&inputs64).view(), 1e-12)?;
    Ok(())
}

proptest! {
    #![proptest_config(common::config(96))]

    #[test]
    fn output_matches_the_definition(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        matches_the_definition::<f32>(dims, spec, seed)?;
        matches_the_definition::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn rows_of_weights_sum_to_one_or_are_all_zero(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        weight_rows_sum_to_one_or_are_zero::<f32>(dims, spec, seed)?;
        weight_rows_sum_to_one_or_are_zero::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn causal_output_rows_ignore_later_keys_and_values(
        dims in nonempty_dims(),
        alignment in alignment().prop_filter_map("causal", |a| a),
        spec in option_spec(),
        cut in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        causal_rows_ignore_the_future::<f32>(dims, alignment, spec, cut, seed)?;
        causal_rows_ignore_the_future::<f64>(dims, alignment, spec, cut, seed)?;
    }

    #[test]
    fn bidirectional_attention_is_permutation_equivariant(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        permutation_equivariant::<f32>(dims, spec, seed)?;
        permutation_equivariant::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn grouped_query_attention_equals_multi_head_on_repeated_kv(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        grouped_query_equals_multi_head::<f32>(dims, spec, seed)?;
        grouped_query_equals_multi_head::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn causal_alignments_match_their_definitions(
        dims in dims(),
        alignment in alignment().prop_filter_map("causal", |a| a),
        seed in any::<u64>(),
    ) {
        alignment_matches_its_definition::<f32>(dims, alignment, seed)?;
        alignment_matches_its_definition::<f64>(dims, alignment, seed)?;
    }

    #[test]
    fn sliding_window_matches_its_definition(
        dims in dims(),
        alignment in alignment(),
        window in prop_oneof![1usize..=12, 13usize..=100],
        seed in any::<u64>(),
    ) {
        window_matches_its_definition::<f32>(dims, alignment, window, seed)?;
        window_matches_its_definition::<f64>(dims, alignment, window, seed)?;
    }

    #[test]
    fn nan_and_inf_in_masked_positions_never_reach_the_output(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        masked_poison_never_leaks::<f32>(dims, spec, seed)?;
        masked_poison_never_leaks::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn attention_weights_times_values_equals_the_output(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        weights_times_values_is_the_output::<f32>(dims, spec, seed)?;
        weights_times_values_is_the_output::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn strided_views_equal_contiguous_arrays(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        strided_views_equal_contiguous::<f32>(dims, spec, seed)?;
        strided_views_equal_contiguous::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn broadcast_mask_and_bias_equal_full_shape(
        dims in dims(),
        mask_ones in any::<[bool; 4]>(),
        bias_ones in any::<[bool; 4]>(),
        spec in option_spec(),
        seed in any::<u64>(),
    ) {
        broadcasting_equals_full_shape::<f32>(dims, mask_ones, bias_ones, spec, seed)?;
        broadcasting_equals_full_shape::<f64>(dims, mask_ones, bias_ones, spec, seed)?;
    }

    #[test]
    fn into_with_strided_out_equals_the_allocating_call(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        into_equals_allocating::<f32>(dims, spec, seed)?;
        into_equals_allocating::<f64>(dims, spec, seed)?;
    }

    #[test]
    fn f32_agrees_with_the_f64_reference(dims in dims(), spec in option_spec(), seed in any::<u64>()) {
        f32_agrees_with_f64_reference(dims, spec, seed)?;
    }
}
