//! The reference backward pass, `sdpa::core::scaled_dot_product_attention_backward`,
//! against central finite differences of the reference forward in `f64`, for
//! every option and their combinations, on small random shapes (MHA, GQA,
//! MQA, `len_q ≠ len_kv`, empty lengths).
//!
//! The loss is `L = Σ out ∘ W` for a fixed random `W`, so `d_out = W`. Each
//! entry of `q`, `k`, `v` and the bias is perturbed in turn and `∂L/∂x` taken
//! with the five-point central stencil
//! `(8·(L(x+h) − L(x−h)) − (L(x+2h) − L(x−2h))) / 12h` (truncation error
//! O(h⁴), so `h` can be large enough that rounding stays near 1e-12).
//!
//! Beyond the numbers: masked pairs give exactly 0, NaN and ±inf in masked
//! keys, values, bias entries and in dead query rows never reach a gradient,
//! shards of the keys sum to the unsplit gradients, GQA equals repeated
//! heads, strides do not matter, `f32` agrees with `f64`, and bad shapes are
//! errors.

use crate::common;

use common::{
    Dims, Extras, Inputs, OptionSpec, Rng, alignment, assert_close, broadcast_shape, config,
    option_spec, prop_close,
};
use ndarray::{Array3, Array4, ArrayView4, Axis, s};
use proptest::prelude::*;
use sdpa::core::scaled_dot_product_attention_backward;
use sdpa::simd::available_kernel_sets;
use sdpa::{
    AttentionError, AttentionGradients, AttentionOptions, AttentionPartial, CausalAlignment,
    Element, ErrorKind, scaled_dot_product_attention_partial,
};

/// The bound on the relative error of each gradient entry against the
/// finite difference: `|g − fd| ≤ MAX_RELATIVE_ERROR · max(|g|, |fd|, FLOOR)`.
const MAX_RELATIVE_ERROR: f64 = 1e-6;
/// Below this magnitude the error is measured against `FLOOR` instead, so
/// entries that are 0 up to rounding need `|g − fd| ≤ 1e-8`.
const FLOOR: f64 = 1e-2;
/// The finite-difference step.
const STEP: f64 = 1e-3;

/// Forward (keeping the log-sum-exp) then backward with `d_out = w`.
fn gradients<F: Element>(
    inputs: &Inputs<F>,
    opts: &AttentionOptions<'_, F>,
    w: &Array4<F>,
) -> AttentionGradients<F> {
    let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    let forward = scaled_dot_product_attention_partial(q, k, v, opts).expect("valid forward");
    scaled_dot_product_attention_backward(q, k, v, opts, &forward, w.view())
        .expect("valid backward")
}

/// `L = Σ out ∘ w` on the reference forward.
fn loss(inputs: &Inputs<f64>, extras: &Extras<f64>, w: &Array4<f64>) -> f64 {
    let out = sdpa::core::scaled_dot_product_attention(
        inputs.q.view(),
        inputs.k.view(),
        inputs.v.view(),
        &extras.options(),
    )
    .expect("valid forward");
    (&out * w).sum()
}

/// Which array a finite difference perturbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wrt {
    Q,
    K,
    V,
    Bias,
}

fn target<'a>(
    inputs: &'a mut Inputs<f64>,
    extras: &'a mut Extras<f64>,
    wrt: Wrt,
) -> &'a mut Array4<f64> {
    match wrt {
        Wrt::Q => &mut inputs.q,
        Wrt::K => &mut inputs.k,
        Wrt::V => &mut inputs.v,
        Wrt::Bias => extras.bias.as_mut().expect("a bias"),
    }
}

/// `∂L/∂x` for every entry `x` of the array `wrt`, by finite differences.
fn numeric_gradient(
    inputs: &Inputs<f64>,
    extras: &Extras<f64>,
    w: &Array4<f64>,
    wrt: Wrt,
) -> Array4<f64> {
    let (mut inputs, mut extras) = (inputs.clone(), extras.clone());
    let shape = target(&mut inputs, &mut extras, wrt).raw_dim();
    let mut numeric = Array4::zeros(shape);
    for (index, slot) in numeric.indexed_iter_mut() {
        let at = |inputs: &mut Inputs<f64>, extras: &mut Extras<f64>, delta: f64| {
            let x = target(inputs, extras, wrt)[index];
            target(inputs, extras, wrt)[index] = x + delta;
            let l = loss(inputs, extras, w);
            target(inputs, extras, wrt)[index] = x;
            l
        };
        let (m2, m1) = (
            at(&mut inputs, &mut extras, -2.0 * STEP),
            at(&mut inputs, &mut extras, -STEP),
        );
        let (p1, p2) = (
            at(&mut inputs, &mut extras, STEP),
            at(&mut inputs, &mut extras, 2.0 * STEP),
        );
        *slot = (8.0 * (p1 - m1) - (p2 - m2)) / (12.0 * STEP);
    }
    numeric
}

/// The largest relative error (as [`MAX_RELATIVE_ERROR`] measures it) of
/// `analytic` against `numeric`, and where; NaN counts as infinite.
fn worst_relative_error(analytic: &Array4<f64>, numeric: &Array4<f64>) -> (f64, Vec<usize>) {
    let mut worst = (0.0, vec![]);
    for ((index, &g), &fd) in analytic.indexed_iter().zip(numeric) {
        let error = (g - fd).abs() / g.abs().max(fd.abs()).max(FLOOR);
        let error = if error.is_nan() { f64::INFINITY } else { error };
        if error > worst.0 {
            worst = (error, vec![index.0, index.1, index.2, index.3]);
        }
    }
    worst
}

/// Checks the gradients of one call against finite differences, and that
/// they are exactly 0 wherever no live query–key pair reaches them.
/// Returns the largest relative error seen.
fn check_against_finite_differences(
    dims: &Dims,
    spec: &OptionSpec,
    seed: u64,
) -> Result<f64, String> {
    let mut rng = Rng::new(seed);
    let inputs = Inputs::<f64>::random(dims, &mut rng);
    let extras = Extras::<f64>::random(spec, dims, &mut rng);
    let w: Array4<f64> = rng.array(dims.out());
    let grads = gradients(&inputs, &extras.options(), &w);

    let context = || format!("dims {dims:?}, spec {spec:?}, seed {seed}");
    if grads.d_bias.is_some() != extras.bias.is_some() {
        return Err(format!(
            "d_bias present iff a bias was given: {}",
            context()
        ));
    }
    let mut worst = 0.0f64;
    let mut pairs = vec![
        (Wrt::Q, &grads.d_q),
        (Wrt::K, &grads.d_k),
        (Wrt::V, &grads.d_v),
    ];
    if let Some(d_bias) = &grads.d_bias {
        pairs.push((Wrt::Bias, d_bias));
    }
    for (wrt, analytic) in pairs {
        let numeric = numeric_gradient(&inputs, &extras, &w, wrt);
        if analytic.shape() != numeric.shape() {
            return Err(format!(
                "{wrt:?}: gradient shape {:?}, input shape {:?}: {}",
                analytic.shape(),
                numeric.shape(),
                context()
            ));
        }
        let (error, index) = worst_relative_error(analytic, &numeric);
        if error > MAX_RELATIVE_ERROR {
            return Err(format!(
                "d{wrt:?} at {index:?}: analytic {}, numeric {}, relative error {error:e}: {}",
                analytic[[index[0], index[1], index[2], index[3]]],
                numeric[[index[0], index[1], index[2], index[3]]],
                context()
            ));
        }
        worst = worst.max(error);
    }
    check_exact_zeros(&extras, &grads).map_err(|e| format!("{e}: {}", context()))?;
    Ok(worst)
}

/// Gradients no live (visible, bias not `−inf`) query–key pair reaches are
/// exactly 0: `d_q` rows of queries with no live key, `d_k`/`d_v` rows of
/// keys no query of their group sees, `d_bias` entries every pair they
/// broadcast to is dead.
fn check_exact_zeros<F: Element>(
    extras: &Extras<F>,
    grads: &AttentionGradients<F>,
) -> Result<(), String> {
    let dims = extras.dims;
    let group = dims.heads / dims.kv_heads;
    let all_zero = |row: ndarray::ArrayView1<'_, F>| row.iter().all(|&x| x == F::zero());
    for b in 0..dims.batch {
        for h in 0..dims.heads {
            for i in 0..dims.len_q {
                let dead = (0..dims.len_kv).all(|j| !extras.live(b, h, i, j));
                if dead && !all_zero(grads.d_q.slice(s![b, h, i, ..])) {
                    return Err(format!(
                        "d_q[{b}, {h}, {i}] of a query with no live key is not 0"
                    ));
                }
            }
        }
        for kv in 0..dims.kv_heads {
            for j in 0..dims.len_kv {
                let seen = (kv * group..(kv + 1) * group)
                    .any(|h| (0..dims.len_q).any(|i| extras.live(b, h, i, j)));
                let zero = all_zero(grads.d_k.slice(s![b, kv, j, ..]))
                    && all_zero(grads.d_v.slice(s![b, kv, j, ..]));
                if !seen && !zero {
                    return Err(format!(
                        "d_k/d_v[{b}, {kv}, {j}] of a key no query sees is not 0"
                    ));
                }
            }
        }
    }
    if let Some(d_bias) = &grads.d_bias {
        let shape = d_bias.shape().to_vec();
        let range = |axis: usize, index: usize, full: usize| {
            if shape[axis] == 1 {
                0..full
            } else {
                index..index + 1
            }
        };
        for ((bb, hh, ii, jj), &g) in d_bias.indexed_iter() {
            let live = range(0, bb, dims.batch).any(|b| {
                range(1, hh, dims.heads).any(|h| {
                    range(2, ii, dims.len_q)
                        .any(|i| range(3, jj, dims.len_kv).any(|j| extras.live(b, h, i, j)))
                })
            });
            if !live && g != F::zero() {
                return Err(format!(
                    "d_bias[{bb}, {hh}, {ii}, {jj}] = {g} reaches no live pair"
                ));
            }
        }
    }
    Ok(())
}

fn dims(
    batch: usize,
    heads: usize,
    kv_heads: usize,
    len_q: usize,
    len_kv: usize,
    d_k: usize,
    d_v: usize,
) -> Dims {
    Dims {
        batch,
        heads,
        kv_heads,
        len_q,
        len_kv,
        d_k,
        d_v,
    }
}

/// Shapes for the named cases: MHA, GQA, MQA, `len_q` below, equal to and
/// above `len_kv`, head dims 1..5.
fn case_dims() -> Vec<Dims> {
    vec![
        dims(1, 1, 1, 4, 4, 3, 2),
        dims(2, 2, 2, 3, 5, 2, 3),
        dims(1, 4, 2, 5, 3, 4, 1),
        dims(2, 3, 1, 6, 6, 1, 5),
        dims(1, 2, 1, 1, 6, 5, 4),
    ]
}

/// Every option alone and in combination; bias and keep mask in several
/// broadcast shapes (`true` = that dimension is 1).
fn named_specs() -> Vec<(&'static str, OptionSpec)> {
    let none = OptionSpec::default();
    let full = [false; 4];
    let bottom_right = Some(CausalAlignment::BottomRight);
    let top_left = Some(CausalAlignment::TopLeft);
    vec![
        ("none", none),
        (
            "causal bottom-right",
            OptionSpec {
                causal: bottom_right,
                ..none
            },
        ),
        (
            "causal top-left",
            OptionSpec {
                causal: top_left,
                ..none
            },
        ),
        (
            "scale",
            OptionSpec {
                scale: Some(0.7),
                ..none
            },
        ),
        (
            "scale 0",
            OptionSpec {
                scale: Some(0.0),
                ..none
            },
        ),
        (
            "negative scale",
            OptionSpec {
                scale: Some(-1.3),
                ..none
            },
        ),
        (
            "keep mask",
            OptionSpec {
                keep_mask: Some(full),
                ..none
            },
        ),
        (
            "keep mask [b,1,1,kv]",
            OptionSpec {
                keep_mask: Some([false, true, true, false]),
                ..none
            },
        ),
        (
            "keep mask [1,h,q,kv]",
            OptionSpec {
                keep_mask: Some([true, false, false, false]),
                ..none
            },
        ),
        (
            "bias",
            OptionSpec {
                bias: Some(full),
                ..none
            },
        ),
        (
            "bias [1,1,q,kv]",
            OptionSpec {
                bias: Some([true, true, false, false]),
                ..none
            },
        ),
        (
            "bias [1,h,1,kv]",
            OptionSpec {
                bias: Some([true, false, true, false]),
                ..none
            },
        ),
        (
            "bias [b,1,1,kv]",
            OptionSpec {
                bias: Some([false, true, true, false]),
                ..none
            },
        ),
        (
            "bias [1,h,q,1]",
            OptionSpec {
                bias: Some([true, false, false, true]),
                ..none
            },
        ),
        (
            "bias [1,1,1,1]",
            OptionSpec {
                bias: Some([true; 4]),
                ..none
            },
        ),
        (
            "key lengths",
            OptionSpec {
                key_lengths: true,
                ..none
            },
        ),
        (
            "window 2",
            OptionSpec {
                window: Some(2),
                ..none
            },
        ),
        (
            "window 1 top-left",
            OptionSpec {
                window: Some(1),
                causal: top_left,
                ..none
            },
        ),
        (
            "window 3 top-left",
            OptionSpec {
                window: Some(3),
                causal: top_left,
                ..none
            },
        ),
        (
            "causal + keep mask + bias + key lengths + scale",
            OptionSpec {
                causal: bottom_right,
                scale: Some(0.9),
                keep_mask: Some(full),
                bias: Some([true, false, false, false]),
                key_lengths: true,
                window: None,
            },
        ),
        (
            "top-left + window + broadcast bias + keep mask",
            OptionSpec {
                causal: top_left,
                scale: None,
                keep_mask: Some([false, true, false, false]),
                bias: Some([false, true, true, false]),
                key_lengths: false,
                window: Some(2),
            },
        ),
        (
            "everything",
            OptionSpec {
                causal: bottom_right,
                scale: Some(1.2),
                keep_mask: Some([true, false, false, false]),
                bias: Some(full),
                key_lengths: true,
                window: Some(3),
            },
        ),
    ]
}

#[test]
fn every_option_matches_finite_differences() {
    let mut worst = 0.0f64;
    let mut checked = 0;
    for (name, spec) in named_specs() {
        for (n, dims) in case_dims().iter().enumerate() {
            for seed in [11, 12] {
                let seed = seed * 1000 + n as u64;
                match check_against_finite_differences(dims, &spec, seed) {
                    Ok(error) => worst = worst.max(error),
                    Err(e) => panic!("{name}: {e}"),
                }
                checked += 1;
            }
        }
    }
    eprintln!("{checked} calls, worst relative error against finite differences {worst:e}");
}

/// Small shapes for the property: batch 1..=2, kv_heads 1..=2, 1..=3 query
/// heads per key/value head, lengths 0..=6, head dims 1..=5.
fn small_dims() -> impl Strategy<Value = Dims> {
    (
        0usize..=6,
        0usize..=6,
        1usize..=2,
        1usize..=2,
        1usize..=3,
        1usize..=5,
        1usize..=5,
    )
        .prop_map(|(len_q, len_kv, batch, kv_heads, group, d_k, d_v)| {
            dims(batch, kv_heads * group, kv_heads, len_q, len_kv, d_k, d_v)
        })
}

proptest! {
    #![proptest_config(config(96))]

    #[test]
    fn random_shapes_and_options_match_finite_differences(
        dims in small_dims(),
        spec in option_spec(),
        seed in any::<u64>(),
    ) {
        check_against_finite_differences(&dims, &spec, seed).map_err(TestCaseError::fail)?;
    }

    /// GQA: the gradients equal those of multi-head attention on keys and
    /// values repeated per query head, with `d_k`/`d_v` summed over each group.
    #[test]
    fn grouped_query_gradients_are_repeated_head_gradients_summed(
        dims in small_dims(),
        spec in option_spec(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let inputs = Inputs::<f64>::random(&dims, &mut rng);
        let extras = Extras::<f64>::random(&spec, &dims, &mut rng);
        let w: Array4<f64> = rng.array(dims.out());
        let grouped = gradients(&inputs, &extras.options(), &w);

        let group = dims.heads / dims.kv_heads;
        let repeat = |x: &Array4<f64>| {
            Array4::from_shape_fn((dims.batch, dims.heads, x.shape()[2], x.shape()[3]), |(b, h, j, c)| x[[b, h / group, j, c]])
        };
        let repeated = Inputs { q: inputs.q.clone(), k: repeat(&inputs.k), v: repeat(&inputs.v) };
        let multi_head = gradients(&repeated, &extras.options(), &w);
        let fold = |x: &Array4<f64>| {
            let mut sum = Array4::zeros((dims.batch, dims.kv_heads, x.shape()[2], x.shape()[3]));
            for h in 0..dims.heads {
                let mut slot = sum.index_axis_mut(Axis(1), h / group);
                slot += &x.index_axis(Axis(1), h);
            }
            sum
        };
        prop_close(&grouped.d_q.view(), &multi_head.d_q.view(), 1e-12)?;
        prop_close(&grouped.d_k.view(), &fold(&multi_head.d_k).view(), 1e-12)?;
        prop_close(&grouped.d_v.view(), &fold(&multi_head.d_v).view(), 1e-12)?;
        if let (Some(a), Some(b)) = (&grouped.d_bias, &multi_head.d_bias) {
            prop_close(&a.view(), &b.view(), 1e-12)?;
        }
    }

    /// Keys split into shards, each shard's backward given the whole call's
    /// output and log-sum-exp: `d_k`/`d_v` concatenate and `d_q`/`d_bias`
    /// sum to the unsplit gradients.
    #[test]
    fn key_shard_gradients_sum_to_the_unsplit_gradients(
        dims in small_dims(),
        spec in option_spec(),
        cuts in proptest::collection::vec(0usize..=6, 0..3),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let inputs = Inputs::<f64>::random(&dims, &mut rng);
        let extras = Extras::<f64>::random(&spec, &dims, &mut rng);
        let w: Array4<f64> = rng.array(dims.out());
        let opts = extras.options();
        let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
        let whole = scaled_dot_product_attention_partial(q, k, v, &opts).unwrap();
        let unsplit = gradients(&inputs, &opts, &w);

        let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| c <= dims.len_kv).collect();
        bounds.extend([0, dims.len_kv]);
        bounds.sort_unstable();
        let mut d_q = Array4::zeros(unsplit.d_q.raw_dim());
        let mut d_k = Array4::zeros(unsplit.d_k.raw_dim());
        let mut d_v = Array4::zeros(unsplit.d_v.raw_dim());
        let mut d_bias = unsplit.d_bias.as_ref().map(|d| Array4::zeros(d.raw_dim()));
        for shard in bounds.windows(2) {
            let keys = s![.., .., shard[0]..shard[1], ..];
            let part = scaled_dot_product_attention_backward(
                q,
                k.slice(keys),
                v.slice(keys),
                &opts.clone().key_shard(shard[0], dims.len_kv),
                &whole,
                w.view(),
            )
            .unwrap();
            d_q += &part.d_q;
            d_k.slice_mut(keys).assign(&part.d_k);
            d_v.slice_mut(keys).assign(&part.d_v);
            if let (Some(sum), Some(part)) = (d_bias.as_mut(), &part.d_bias) {
                *sum += part;
            }
        }
        prop_close(&d_q.view(), &unsplit.d_q.view(), 1e-12)?;
        prop_close(&d_k.view(), &unsplit.d_k.view(), 1e-12)?;
        prop_close(&d_v.view(), &unsplit.d_v.view(), 1e-12)?;
        if let (Some(a), Some(b)) = (&d_bias, &unsplit.d_bias) {
            prop_close(&a.view(), &b.view(), 1e-12)?;
        }
    }

    /// `f32` inputs, forward on the fast path with every kernel set, backward
    /// on the reference in `f32`, agree with the `f64` gradients.
    #[test]
    fn f32_gradients_agree_with_f64(
        dims in small_dims(),
        spec in option_spec(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let inputs = Inputs::<f32>::random(&dims, &mut rng);
        let extras = Extras::<f32>::random(&spec, &dims, &mut rng);
        let w: Array4<f32> = rng.array(dims.out());
        let extras64 = extras.to_f64();
        let expected = gradients(&inputs.to_f64(), &extras64.options(), &w.mapv(f64::from));
        for set in available_kernel_sets() {
            let actual = sdpa::simd::with_kernel_set(set, || gradients(&inputs, &extras.options(), &w))
                .expect("an available kernel set");
            let tol = 1e-4;
            prop_close(&actual.d_q.view(), &expected.d_q.view(), tol)?;
            prop_close(&actual.d_k.view(), &expected.d_k.view(), tol)?;
            prop_close(&actual.d_v.view(), &expected.d_v.view(), tol)?;
            if let (Some(a), Some(b)) = (&actual.d_bias, &expected.d_bias) {
                prop_close(&a.view(), &b.view(), tol)?;
            }
            check_exact_zeros(&extras, &actual).map_err(TestCaseError::fail)?;
        }
    }

    /// Views of any strides give the gradients of standard-layout arrays.
    #[test]
    fn strided_views_give_the_same_gradients(
        dims in small_dims(),
        causal in alignment(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let inputs = Inputs::<f64>::random(&dims, &mut rng);
        let bias: Array4<f64> = rng.array(dims.scores());
        let w: Array4<f64> = rng.array(dims.out());
        let mut opts = AttentionOptions::new().bias(bias.view());
        if let Some(alignment) = causal {
            opts = opts.causal_aligned(alignment);
        }
        let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
        let forward = scaled_dot_product_attention_partial(q, k, v, &opts).unwrap();
        let expected = scaled_dot_product_attention_backward(
            q, k, v, &opts, &forward, w.view(),
        ).unwrap();

        // Each array stored as [len, heads, batch, d] (or reversed bias) and
        // read through permuted views.
        let relaid = |x: &Array4<f64>| x.view().permuted_axes([2, 1, 0, 3]).to_owned();
        fn view(x: &Array4<f64>) -> ArrayView4<'_, f64> {
            x.view().permuted_axes([2, 1, 0, 3])
        }
        let (q2, k2, v2, w2) = (
            relaid(&inputs.q), relaid(&inputs.k), relaid(&inputs.v), relaid(&w),
        );
        let bias2 = bias.view().reversed_axes().to_owned();
        let opts2 = {
            let mut opts = AttentionOptions::new().bias(bias2.view().reversed_axes());
            if let Some(alignment) = causal {
                opts = opts.causal_aligned(alignment);
            }
            opts
        };
        let actual = scaled_dot_product_attention_backward(
            view(&q2), view(&k2), view(&v2), &opts2, &forward, view(&w2),
        ).unwrap();
        prop_close(&actual.d_q.view(), &expected.d_q.view(), 1e-12)?;
        prop_close(&actual.d_k.view(), &expected.d_k.view(), 1e-12)?;
        prop_close(&actual.d_v.view(), &expected.d_v.view(), 1e-12)?;
        prop_close(&actual.d_bias.unwrap().view(), &expected.d_bias.unwrap().view(), 1e-12)?;
    }
}

/// A call where some keys are seen by no query and some queries see no key:
/// batch 2, 4 query heads on 2 kv heads, 3 queries, 7 keys, causal
/// top-left (keys 3.. are past every query), key lengths [5, 2], a keep
/// mask hiding key 1 from batch item 0 and key 0 from query 0 of head 3.
struct Poison {
    dims: Dims,
    keep: Array4<bool>,
    lengths: [usize; 2],
}

impl Poison {
    fn new() -> Self {
        let dims = dims(2, 4, 2, 3, 7, 3, 2);
        let keep = Array4::from_shape_fn(dims.scores(), |(b, h, i, j)| {
            let hidden = (b == 0 && j == 1) || (h == 3 && i == 0 && j == 0);
            !hidden
        });
        Self {
            dims,
            keep,
            lengths: [5, 2],
        }
    }

    fn options<'a, F: Element>(&'a self, bias: &'a Array4<F>) -> AttentionOptions<'a, F> {
        AttentionOptions::new()
            .causal_aligned(CausalAlignment::TopLeft)
            .key_lengths(&self.lengths)
            .keep_mask(self.keep.view())
            .bias(bias.view())
    }

    fn extras<F: Element>(&self, bias: &Array4<F>) -> Extras<F> {
        Extras {
            causal: Some(CausalAlignment::TopLeft),
            keep_mask: Some(self.keep.clone()),
            bias: Some(bias.clone()),
            key_lengths: Some(self.lengths.to_vec()),
            ..Extras::none(&self.dims)
        }
    }

    /// Puts NaN and ±inf into every key, value and bias entry no live pair
    /// uses, into the queries and `d_out` rows of queries with no live key.
    fn poison<F: Element>(
        &self,
        inputs: &mut Inputs<F>,
        bias: &mut Array4<F>,
        d_out: &mut Array4<F>,
    ) {
        let extras = self.extras(bias);
        let dims = self.dims;
        let group = dims.heads / dims.kv_heads;
        let bad = [F::nan(), F::infinity(), F::neg_infinity()];
        let mut n = 0;
        let mut next = || {
            n += 1;
            bad[n % 3]
        };
        for b in 0..dims.batch {
            for kv in 0..dims.kv_heads {
                for j in 0..dims.len_kv {
                    let seen = (kv * group..(kv + 1) * group)
                        .any(|h| (0..dims.len_q).any(|i| extras.visible(b, h, i, j)));
                    if !seen {
                        inputs
                            .k
                            .slice_mut(s![b, kv, j, ..])
                            .mapv_inplace(|_| next());
                        inputs
                            .v
                            .slice_mut(s![b, kv, j, ..])
                            .mapv_inplace(|_| next());
                    }
                }
            }
            for h in 0..dims.heads {
                for i in 0..dims.len_q {
                    let mut any = false;
                    for j in 0..dims.len_kv {
                        if extras.visible(b, h, i, j) {
                            any = true;
                        } else {
                            bias[[b, h, i, j]] = next();
                        }
                    }
                    if !any {
                        inputs.q.slice_mut(s![b, h, i, ..]).mapv_inplace(|_| next());
                        d_out.slice_mut(s![b, h, i, ..]).mapv_inplace(|_| next());
                    }
                }
            }
        }
    }
}

fn masked_nan_and_inf_never_reach_a_gradient<F: Element>(tol: f64) {
    let poison = Poison::new();
    let dims = poison.dims;
    for seed in 0..20 {
        let mut rng = Rng::new(seed);
        let clean = Inputs::<F>::random(&dims, &mut rng);
        let clean_bias: Array4<F> = rng.array(dims.scores());
        let clean_w: Array4<F> = rng.array(dims.out());
        let (mut dirty, mut dirty_bias, mut dirty_w) =
            (clean.clone(), clean_bias.clone(), clean_w.clone());
        poison.poison(&mut dirty, &mut dirty_bias, &mut dirty_w);
        assert!(dirty.k.iter().any(|x| x.is_nan()) && dirty.q.iter().any(|x| !x.is_finite()));

        let expected = gradients(&clean, &poison.options(&clean_bias), &clean_w);
        let actual = gradients(&dirty, &poison.options(&dirty_bias), &dirty_w);
        let all = [
            &actual.d_q,
            &actual.d_k,
            &actual.d_v,
            actual.d_bias.as_ref().unwrap(),
        ];
        assert!(
            all.iter().all(|g| g.iter().all(|x| x.is_finite())),
            "seed {seed}: a non-finite gradient"
        );
        check_exact_zeros(&poison.extras(&dirty_bias), &actual).unwrap();
        // Exactly 0 at every masked bias entry, not just summed ones.
        let extras = poison.extras(&dirty_bias);
        for ((b, h, i, j), &g) in actual.d_bias.as_ref().unwrap().indexed_iter() {
            if !extras.visible(b, h, i, j) {
                assert_eq!(g, F::zero());
            }
        }
        assert_close(&actual.d_q.view(), &expected.d_q.view(), tol);
        assert_close(&actual.d_k.view(), &expected.d_k.view(), tol);
        assert_close(&actual.d_v.view(), &expected.d_v.view(), tol);
        assert_close(
            &actual.d_bias.unwrap().view(),
            &expected.d_bias.unwrap().view(),
            tol,
        );
    }
}

#[test]
fn masked_nan_and_inf_never_reach_a_gradient_f64() {
    masked_nan_and_inf_never_reach_a_gradient::<f64>(1e-12);
}

#[test]
fn masked_nan_and_inf_never_reach_a_gradient_f32() {
    masked_nan_and_inf_never_reach_a_gradient::<f32>(1e-5);
}

/// Rows with no visible key, and empty key or query sequences, give zero
/// gradients, never NaN.
#[test]
fn queries_that_see_nothing_get_zero_gradients() {
    let mut rng = Rng::new(7);
    let check = |inputs: &Inputs<f64>, opts: &AttentionOptions<'_, f64>, w: &Array4<f64>| {
        let grads = gradients(inputs, opts, w);
        for g in [&grads.d_q, &grads.d_k, &grads.d_v] {
            assert!(g.iter().all(|&x| x == 0.0), "{g:?}");
        }
        grads
    };
    // Nothing visible: an all-false keep mask, zero key lengths, a −inf bias.
    let d = dims(2, 2, 1, 3, 4, 3, 2);
    let inputs = Inputs::<f64>::random(&d, &mut rng);
    let w: Array4<f64> = rng.array(d.out());
    let nothing = Array4::from_elem((1, 1, 1, 1), false);
    check(
        &inputs,
        &AttentionOptions::new().keep_mask(nothing.view()),
        &w,
    );
    check(
        &inputs,
        &AttentionOptions::new().causal().key_lengths(&[0, 0]),
        &w,
    );
    let minus_infinity = Array4::from_elem((1, 1, 3, 1), f64::NEG_INFINITY);
    let grads = check(
        &inputs,
        &AttentionOptions::new().bias(minus_infinity.view()),
        &w,
    );
    assert!(grads.d_bias.unwrap().iter().all(|&x| x == 0.0));
    // Top-left causal with more queries than keys: queries 4.. see keys
    // 0..4, and bottom-right: queries 0..2 see nothing.
    let d = dims(1, 1, 1, 6, 4, 2, 2);
    let inputs = Inputs::<f64>::random(&d, &mut rng);
    let w: Array4<f64> = rng.array(d.out());
    let grads = gradients(&inputs, &AttentionOptions::new().causal(), &w);
    assert!(
        grads
            .d_q
            .slice(s![.., .., ..2, ..])
            .iter()
            .all(|&x| x == 0.0)
    );
    assert!(
        grads
            .d_q
            .slice(s![.., .., 2.., ..])
            .iter()
            .any(|&x| x != 0.0)
    );
    // Empty sequences.
    for (len_q, len_kv) in [(0, 3), (3, 0), (0, 0)] {
        let d = dims(1, 2, 2, len_q, len_kv, 2, 3);
        let inputs = Inputs::<f64>::random(&d, &mut rng);
        let w: Array4<f64> = rng.array(d.out());
        let grads = check(&inputs, &AttentionOptions::new().causal(), &w);
        assert_eq!(grads.d_q.shape(), d.q());
        assert_eq!(grads.d_k.shape(), d.k());
        assert_eq!(grads.d_v.shape(), d.v());
    }
}

/// A hand-checked case: one query, two keys, scale 1, no mask.
/// `p = softmax(q·k)`, `out = p₀v₀ + p₁v₁`, `L = out` (d_v = 1, w = 1).
#[test]
fn two_keys_by_hand() {
    let q = Array4::from_shape_vec((1, 1, 1, 1), vec![1.0f64]).unwrap();
    let k = Array4::from_shape_vec((1, 1, 2, 1), vec![0.5, -0.5]).unwrap();
    let v = Array4::from_shape_vec((1, 1, 2, 1), vec![2.0, -1.0]).unwrap();
    let w = Array4::from_elem((1, 1, 1, 1), 1.0);
    let opts = AttentionOptions::new().scale(1.0);
    let grads = gradients(&Inputs { q, k, v }, &opts, &w);
    let (p0, p1) = (1.0 / (1.0 + (-1.0f64).exp()), 1.0 / (1.0 + 1.0f64.exp()));
    // dL/ds₀ = p₀(v₀ − out) = p₀p₁(v₀ − v₁), dL/ds₁ = −dL/ds₀.
    let ds0 = p0 * p1 * 3.0;
    let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-15, "{a} vs {b}");
    close(grads.d_q[[0, 0, 0, 0]], ds0 * 0.5 - ds0 * -0.5);
    close(grads.d_k[[0, 0, 0, 0]], ds0);
    close(grads.d_k[[0, 0, 1, 0]], -ds0);
    close(grads.d_v[[0, 0, 0, 0]], p0);
    close(grads.d_v[[0, 0, 1, 0]], p1);
}

fn backward_error(
    q: ArrayView4<'_, f64>,
    k: ArrayView4<'_, f64>,
    v: ArrayView4<'_, f64>,
    opts: &AttentionOptions<'_, f64>,
    forward: &AttentionPartial<f64>,
    d_out: ArrayView4<'_, f64>,
) -> AttentionError {
    scaled_dot_product_attention_backward(q, k, v, opts, forward, d_out)
        .expect_err("a bad call must be an error")
}

/// A forward result of output shape `dim`, all zeros.
fn zero_forward(dim: (usize, usize, usize, usize)) -> AttentionPartial<f64> {
    AttentionPartial::from_parts(Array4::zeros(dim), Array3::zeros((dim.0, dim.1, dim.2)))
        .expect("consistent parts")
}

#[test]
fn bad_shapes_are_errors_naming_the_shapes() {
    let q = Array4::<f64>::zeros((2, 4, 3, 5));
    let k = Array4::<f64>::zeros((2, 2, 6, 5));
    let v = Array4::<f64>::zeros((2, 2, 6, 7));
    let forward = zero_forward((2, 4, 3, 7));
    let fw = &forward;
    let opts = AttentionOptions::new();
    let (qv, kv, vv, ov) = (q.view(), k.view(), v.view(), forward.output());

    // The backward's own arrays.
    for bad in [(2, 4, 3, 5), (2, 4, 2, 7), (1, 4, 3, 7), (2, 2, 3, 7)] {
        let bad_forward = zero_forward(bad);
        let e = backward_error(qv, kv, vv, &opts, &bad_forward, ov);
        assert_eq!(e.kind(), ErrorKind::ShapeMismatch);
        assert!(
            e.message().starts_with("the forward's output has shape"),
            "{e}"
        );
        assert!(
            e.message()
                .contains(&format!("{:?}", bad_forward.output().shape()))
                && e.message().contains("[2, 4, 3, 7]"),
            "{e}"
        );
        let bad = Array4::<f64>::zeros(bad);
        let e = backward_error(qv, kv, vv, &opts, fw, bad.view());
        assert_eq!(e.kind(), ErrorKind::ShapeMismatch);
        assert!(e.message().starts_with("d_out has shape"), "{e}");
    }
    // A forward result's log-sum-exp always fits its output: a mismatched
    // pair cannot even be built.
    for bad in [(2, 4, 4), (2, 2, 3), (1, 4, 3)] {
        let e =
            AttentionPartial::from_parts(Array4::<f64>::zeros((2, 4, 3, 7)), Array3::zeros(bad))
                .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ShapeMismatch);
        assert!(
            e.message().contains("log_sum_exp") && e.message().contains("[2, 4, 3]"),
            "{e}"
        );
    }

    // The forward's checks apply too.
    let k_bad = Array4::<f64>::zeros((2, 2, 6, 4));
    let e = backward_error(qv, k_bad.view(), vv, &opts, fw, ov);
    assert_eq!(e.kind(), ErrorKind::ShapeMismatch);
    assert!(e.message().contains("d_k"), "{e}");
    let k3 = Array4::<f64>::zeros((2, 3, 6, 5));
    let v3 = Array4::<f64>::zeros((2, 3, 6, 7));
    let e = backward_error(qv, k3.view(), v3.view(), &opts, fw, ov);
    assert_eq!(e.kind(), ErrorKind::HeadsNotDivisible);
    let bias = Array4::<f64>::zeros((2, 3, 3, 6));
    let e = backward_error(
        qv,
        kv,
        vv,
        &AttentionOptions::new().bias(bias.view()),
        fw,
        ov,
    );
    assert_eq!(e.kind(), ErrorKind::NotBroadcastable);
    let e = backward_error(
        qv,
        kv,
        vv,
        &AttentionOptions::new().key_lengths(&[6, 7]),
        fw,
        ov,
    );
    assert_eq!(e.kind(), ErrorKind::KeyLengths);
    let e = backward_error(qv, kv, vv, &AttentionOptions::new().window(0), fw, ov);
    assert_eq!(e.kind(), ErrorKind::InvalidOption);
    let e = backward_error(qv, kv, vv, &AttentionOptions::new().scale(f64::NAN), fw, ov);
    assert_eq!(e.kind(), ErrorKind::InvalidOption);
    let e = backward_error(qv, kv, vv, &AttentionOptions::new().key_shard(2, 7), fw, ov);
    assert_eq!(e.kind(), ErrorKind::InvalidOption);

    // And a valid call with these shapes works.
    assert!(scaled_dot_product_attention_backward(qv, kv, vv, &opts, fw, ov).is_ok());
}

#[test]
fn gradients_have_the_input_shapes_and_d_bias_the_bias_shape() {
    let d = dims(2, 6, 3, 4, 5, 3, 2);
    let mut rng = Rng::new(3);
    let inputs = Inputs::<f64>::random(&d, &mut rng);
    let w: Array4<f64> = rng.array(d.out());
    for ones in [
        [false; 4],
        [true; 4],
        [true, false, true, false],
        [false, true, true, false],
    ] {
        let bias: Array4<f64> = rng.array(broadcast_shape(d.scores(), ones));
        let grads = gradients(&inputs, &AttentionOptions::new().bias(bias.view()), &w);
        assert_eq!(grads.d_q.shape(), d.q());
        assert_eq!(grads.d_k.shape(), d.k());
        assert_eq!(grads.d_v.shape(), d.v());
        assert_eq!(grads.d_bias.unwrap().shape(), bias.shape());
    }
    assert!(
        gradients(&inputs, &AttentionOptions::new(), &w)
            .d_bias
            .is_none()
    );
}
