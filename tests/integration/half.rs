//! Half-precision element types (`bf16`, `f16`): every kernel set against
//! the reference in `f64` on the same rounded inputs, on odd shapes and
//! every option; the reference's own half path against a widened `f64`
//! call; partials, `_into`, the backward, errors, and NaN in masked data.
//!
//! The error bound asserted, per output entry, against `r`, the `f64`
//! reference on the rounded inputs:
//!
//! ```text
//! |out − r| ≤ u·|r| + 2e-5·(1 + max|v|)
//! ```
//!
//! where `u` is the storage type's unit roundoff (`2⁻⁸` for bf16, `2⁻¹¹`
//! for f16): the output is rounded once from an `f32` result, whose own
//! error against `r` is the second term.

use half::{bf16, f16};
use ndarray::{Array1, Array3, Array4, ArrayView4, Axis, s};
use sdpa::simd::{KernelSet, available_kernel_sets, with_kernel_set};
use sdpa::{
    AttentionOptions, CausalAlignment, ErrorKind, Storage, alibi_slopes,
    scaled_dot_product_attention, scaled_dot_product_attention_backward,
    scaled_dot_product_attention_backward_into, scaled_dot_product_attention_into,
    scaled_dot_product_attention_partial,
};

use crate::common::Rng;

/// The half-precision types under test, with what the test needs of them.
trait Half: Storage<Compute = f32> + PartialEq {
    /// Unit roundoff: half the distance from 1 to the next number.
    const UNIT_ROUNDOFF: f64;
    /// Whether the forward may read the inputs in this type natively
    /// (bf16 on AVX-512 BF16), rounding the weights to it for `P·V`.
    const NATIVE_DOT: bool;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Half for bf16 {
    const UNIT_ROUNDOFF: f64 = 1.0 / 256.0;
    const NATIVE_DOT: bool = true;
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

impl Half for f16 {
    const UNIT_ROUNDOFF: f64 = 1.0 / 2048.0;
    const NATIVE_DOT: bool = false;
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}

/// `[batch, heads, kv_heads, len_q, len_kv, d_k, d_v]`: decode-sized and
/// prefill-sized query counts, ragged tiles, GQA, empty sequences.
const SHAPES: [[usize; 7]; 8] = [
    [1, 1, 1, 1, 1, 1, 1],
    [2, 4, 2, 5, 37, 3, 5],
    [1, 2, 1, 100, 130, 17, 9],
    [1, 3, 3, 70, 70, 64, 64],
    [1, 2, 2, 33, 0, 8, 8],
    [1, 2, 1, 0, 10, 8, 8],
    [1, 1, 1, 129, 200, 96, 96],
    [2, 2, 1, 9, 1030, 32, 16],
];

/// One call's inputs, rounded to `H`, and its options' data, in `f32` and
/// (the same numbers) `f64`.
struct Case<H> {
    q: Array4<H>,
    k: Array4<H>,
    v: Array4<H>,
    causal: Option<CausalAlignment>,
    window: Option<usize>,
    scale: Option<f32>,
    keep: Option<Array4<bool>>,
    key_lengths: Option<Vec<usize>>,
    bias: Option<(Array4<f32>, Array4<f64>)>,
    alibi: Option<(Vec<f32>, Vec<f64>)>,
    sinks: Option<(Vec<f32>, Vec<f64>)>,
    softcap: Option<f32>,
}

/// Which options a case has.
#[derive(Debug, Clone, Copy, Default)]
struct Spec {
    causal: Option<CausalAlignment>,
    window: Option<usize>,
    scale: bool,
    keep: bool,
    key_lengths: bool,
    bias: bool,
    alibi: bool,
    sinks: bool,
    softcap: bool,
}

fn specs() -> Vec<Spec> {
    let bottom_right = Some(CausalAlignment::BottomRight);
    vec![
        Spec::default(),
        Spec {
            causal: bottom_right,
            ..Spec::default()
        },
        Spec {
            causal: Some(CausalAlignment::TopLeft),
            scale: true,
            ..Spec::default()
        },
        Spec {
            window: Some(7),
            key_lengths: true,
            ..Spec::default()
        },
        Spec {
            keep: true,
            bias: true,
            ..Spec::default()
        },
        Spec {
            causal: bottom_right,
            alibi: true,
            sinks: true,
            softcap: true,
            ..Spec::default()
        },
        Spec {
            causal: bottom_right,
            window: Some(20),
            scale: true,
            keep: true,
            key_lengths: true,
            bias: true,
            alibi: true,
            sinks: true,
            softcap: true,
        },
    ]
}

fn random_array<H: Half>(rng: &mut Rng, shape: [usize; 4], spread: f64) -> Array4<H> {
    Array4::from_shape_simple_fn(shape, || H::from_f64(rng.uniform(-spread, spread)))
}

impl<H: Half> Case<H> {
    fn new(shape: [usize; 7], spec: Spec, seed: u64) -> Self {
        let [batch, heads, kv_heads, len_q, len_kv, d_k, d_v] = shape;
        let mut rng = Rng::new(seed);
        let per_head = |rng: &mut Rng, lo: f64, hi: f64| {
            let f32s: Vec<f32> = (0..heads).map(|_| rng.uniform(lo, hi) as f32).collect();
            let f64s = f32s.iter().map(|&x| f64::from(x)).collect();
            (f32s, f64s)
        };
        let bias = spec.bias.then(|| {
            let bias = Array4::from_shape_simple_fn([batch, 1, len_q, len_kv], || {
                rng.uniform(-1.0, 1.0) as f32
            });
            let wide = bias.mapv(f64::from);
            (bias, wide)
        });
        let alibi = spec.alibi.then(|| {
            let slopes: Vec<f32> = alibi_slopes(heads).iter().map(|&s| s as f32).collect();
            let wide = slopes.iter().map(|&x| f64::from(x)).collect();
            (slopes, wide)
        });
        Case {
            q: random_array(&mut rng, [batch, heads, len_q, d_k], 2.0),
            k: random_array(&mut rng, [batch, kv_heads, len_kv, d_k], 2.0),
            v: random_array(&mut rng, [batch, kv_heads, len_kv, d_v], 3.0),
            causal: spec.causal,
            window: spec.window,
            // Not a power of two, so it is not exact in bf16: the options
            // of a half call are f32, and it must not be rounded.
            scale: spec.scale.then_some(0.3),
            keep: spec.keep.then(|| {
                Array4::from_shape_simple_fn([1, heads, len_q, len_kv], || rng.chance(0.7))
            }),
            key_lengths: spec
                .key_lengths
                .then(|| (0..batch).map(|_| rng.below(len_kv + 1)).collect()),
            bias,
            alibi,
            sinks: spec.sinks.then(|| per_head(&mut rng, -1.0, 2.0)),
            softcap: spec.softcap.then_some(5.0),
        }
    }

    /// The options in `T`, from the per-type data.
    fn options<'a, T: Copy>(
        &'a self,
        bias: Option<&'a Array4<T>>,
        alibi: Option<&'a [T]>,
        sinks: Option<&'a [T]>,
        widen: impl Fn(f32) -> T,
    ) -> AttentionOptions<'a, T> {
        let mut opts = AttentionOptions::new();
        if let Some(alignment) = self.causal {
            opts = opts.causal_aligned(alignment);
        }
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(widen(scale));
        }
        if let Some(keep) = &self.keep {
            opts = opts.keep_mask(keep.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some(bias) = bias {
            opts = opts.bias(bias.view());
        }
        if let Some(alibi) = alibi {
            opts = opts.alibi(alibi);
        }
        if let Some(sinks) = sinks {
            opts = opts.sinks(sinks);
        }
        if let Some(cap) = self.softcap {
            opts = opts.softcap(widen(cap));
        }
        opts
    }

    /// The options of the half call: `f32`.
    fn half_options(&self) -> AttentionOptions<'_, f32> {
        self.options(
            self.bias.as_ref().map(|b| &b.0),
            self.alibi.as_ref().map(|a| &a.0[..]),
            self.sinks.as_ref().map(|s| &s.0[..]),
            |x| x,
        )
    }

    /// The same options in `f64`, for the widened reference call.
    fn wide_options(&self) -> AttentionOptions<'_, f64> {
        self.options(
            self.bias.as_ref().map(|b| &b.1),
            self.alibi.as_ref().map(|a| &a.1[..]),
            self.sinks.as_ref().map(|s| &s.1[..]),
            f64::from,
        )
    }

    fn wide(&self) -> [Array4<f64>; 3] {
        [
            widen(&self.q.view()),
            widen(&self.k.view()),
            widen(&self.v.view()),
        ]
    }

    /// The reference in `f64` on the rounded inputs.
    fn reference(&self) -> Array4<f64> {
        let [q, k, v] = self.wide();
        sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &self.wide_options())
            .expect("the reference runs")
    }

    /// The `f32` part of the error bound.
    fn f32_error(&self) -> f64 {
        2e-5 * (1.0 + self.max_abs_v())
    }

    fn max_abs_v(&self) -> f64 {
        self.v.iter().fold(0.0, |m: f64, x| m.max(x.to_f64().abs()))
    }

    /// The absolute error bound on kernel set `set`: the `f32` part, and
    /// where bf16 runs natively, the weights' bf16 form in `P·V` (each
    /// within a relative 2⁻⁸ on AMX tiles, 2⁻¹⁵ in two parts on
    /// `vdpbf16ps`, so an output, a weighted mean of values, within that
    /// times max|v|).
    fn error_on(&self, set: KernelSet) -> f64 {
        let weights = if H::NATIVE_DOT && sdpa::simd::bf16_dot_runs_on(set) {
            crate::common::native_weights_error(sdpa::simd::amx_runs_on(set))
        } else {
            0.0
        };
        self.f32_error() + weights * self.max_abs_v()
    }
}

fn widen<H: Half>(x: &ArrayView4<'_, H>) -> Array4<f64> {
    x.mapv(H::to_f64)
}

/// `|got − want| ≤ u·|want| + absolute` entry by entry, NaN only where the
/// reference has NaN.
fn assert_within<H: Half, D: ndarray::Dimension>(
    got: &ndarray::Array<H, D>,
    want: &ndarray::Array<f64, D>,
    absolute: f64,
    what: &str,
) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes");
    for ((index, &g), &w) in got.indexed_iter().zip(want.iter()) {
        let g = g.to_f64();
        if w.is_nan() {
            assert!(g.is_nan(), "{what} at {index:?}: got {g}, reference NaN");
            continue;
        }
        let bound = H::UNIT_ROUNDOFF * w.abs() + absolute;
        assert!(
            (g - w).abs() <= bound,
            "{what} at {index:?}: got {g}, reference {w}, error {} > bound {bound}",
            (g - w).abs()
        );
    }
}

fn forward_every_kernel<H: Half>(seed: u64) {
    for (s, shape) in SHAPES.iter().enumerate() {
        for (o, spec) in specs().into_iter().enumerate() {
            let case = Case::<H>::new(*shape, spec, seed + (s * 100 + o) as u64);
            let want = case.reference();
            let opts = case.half_options();
            // The reference's own half path: the same f64 computation,
            // rounded once.
            let core: Array4<H> = sdpa::core::scaled_dot_product_attention(
                case.q.view(),
                case.k.view(),
                case.v.view(),
                &opts,
            )
            .expect("core runs on half inputs");
            let rounded = want.mapv(H::from_f64);
            assert!(
                core.iter()
                    .zip(&rounded)
                    .all(|(a, b)| a == b || (a.to_f64().is_nan() && b.to_f64().is_nan())),
                "core's half path is the widened f64 call rounded, {shape:?} {spec:?}"
            );
            for set in available_kernel_sets() {
                let what = format!("{} {shape:?} {spec:?}", set.name());
                let got: Array4<H> = with_kernel_set(set, || {
                    scaled_dot_product_attention(case.q.view(), case.k.view(), case.v.view(), &opts)
                })
                .expect("the set runs here")
                .expect("the call runs");
                assert_within(&got, &want, case.error_on(set), &what);
            }
        }
    }
}

#[test]
fn bf16_forward_matches_the_f64_reference_on_every_kernel_set() {
    forward_every_kernel::<bf16>(1000);
}

#[test]
fn f16_forward_matches_the_f64_reference_on_every_kernel_set() {
    forward_every_kernel::<f16>(2000);
}

fn partial_and_into<H: Half>() {
    let shape = [2, 4, 2, 50, 77, 24, 40];
    for spec in specs() {
        let case = Case::<H>::new(shape, spec, 77);
        let opts = case.half_options();
        let [q, k, v] = case.wide();
        let want = scaled_dot_product_attention_partial(
            q.view(),
            k.view(),
            v.view(),
            &case.wide_options(),
        )
        .expect("the f64 partial runs");
        let got = scaled_dot_product_attention_partial(
            case.q.view(),
            case.k.view(),
            case.v.view(),
            &opts,
        )
        .expect("the half partial runs");
        let what = format!("partial {spec:?}");
        let set = sdpa::simd::selected_kernel_set().expect("the selected set runs");
        assert_within(
            &got.output().to_owned(),
            &want.output().to_owned(),
            case.error_on(set),
            &what,
        );
        // The log-sum-exp is f32.
        let lse: Array3<f32> = got.log_sum_exp().to_owned();
        for (&g, &w) in lse.iter().zip(want.log_sum_exp()) {
            assert!(
                (f64::from(g) - w).abs() <= 1e-5 * (1.0 + w.abs())
                    || (g == f32::NEG_INFINITY && w == f64::NEG_INFINITY),
                "{what}: log-sum-exp {g} against {w}"
            );
        }
        // `_into` writes the same output into a transposed buffer.
        let mut out = Array4::from_elem([shape[0], shape[1], shape[6], shape[3]], H::from_f64(7.0));
        let mut transposed = out.view_mut().permuted_axes([0, 1, 3, 2]);
        assert!(transposed.as_slice().is_none());
        scaled_dot_product_attention_into(
            case.q.view(),
            case.k.view(),
            case.v.view(),
            &opts,
            transposed.view_mut(),
        )
        .expect("the half _into runs");
        assert!(
            transposed.iter().zip(got.output()).all(|(a, b)| a == b),
            "{what}: _into equals the partial's output"
        );
    }
}

#[test]
fn bf16_partial_and_into() {
    partial_and_into::<bf16>();
}

#[test]
fn f16_partial_and_into() {
    partial_and_into::<f16>();
}

/// Half partials merge in `f32`: `merge_all` gives the bits of merging
/// the widened partials in `f32` and rounding once, `merge` rounds after
/// each merge, and a mismatched shape is an error.
fn partials_merge_in_f32<H: Half>() {
    let mut rng = Rng::new(91);
    let (q, k, v) = (
        random_array::<H>(&mut rng, [2, 3, 20, 16], 2.0),
        random_array::<H>(&mut rng, [2, 3, 90, 16], 2.0),
        random_array::<H>(&mut rng, [2, 3, 90, 8], 1.0),
    );
    let shards = [0..30, 30..64, 64..90];
    let partial = |keys: &std::ops::Range<usize>| {
        let opts = AttentionOptions::new().causal().key_shard(keys.start, 90);
        let keys = ndarray::s![.., .., keys.clone(), ..];
        scaled_dot_product_attention_partial(q.view(), k.slice(keys), v.slice(keys), &opts)
            .expect("a shard's partial")
    };
    let halves: Vec<_> = shards.iter().map(partial).collect();
    let widened = |p: &sdpa::AttentionPartial<H>| {
        let output = p.output().mapv(|x| H::to_f64(x) as f32);
        sdpa::AttentionPartial::from_parts(output, p.log_sum_exp().to_owned()).unwrap()
    };
    let rounded =
        |p: sdpa::AttentionPartial<f32>| p.into_output().mapv(|x| H::from_f64(f64::from(x)));

    let all = sdpa::AttentionPartial::merge_all(halves.clone()).expect("merge_all");
    let all_in_f32 = sdpa::AttentionPartial::merge_all(halves.iter().map(widened)).unwrap();
    assert_eq!(all.log_sum_exp(), all_in_f32.log_sum_exp());
    assert!(
        all.output()
            .iter()
            .zip(&rounded(all_in_f32))
            .all(|(a, b)| H::to_f64(*a).to_bits() == H::to_f64(*b).to_bits())
    );

    let mut one_by_one = halves[0].clone();
    let mut in_f32 = widened(&halves[0]);
    for half in &halves[1..] {
        one_by_one.merge(half).expect("merge");
        in_f32.merge(&widened(half)).unwrap();
        in_f32 = widened(
            &sdpa::AttentionPartial::from_parts(
                rounded(in_f32.clone()),
                in_f32.log_sum_exp().to_owned(),
            )
            .unwrap(),
        );
    }
    assert!(
        one_by_one
            .output()
            .iter()
            .zip(in_f32.output())
            .all(|(a, b)| H::to_f64(*a) as f32 == *b)
    );

    let short = scaled_dot_product_attention_partial(
        q.slice(s![.., .., ..5, ..]),
        k.view(),
        v.view(),
        &AttentionOptions::new(),
    )
    .unwrap();
    let error = one_by_one.merge(&short).expect_err("shapes differ");
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
}

#[test]
fn bf16_partials_merge_in_f32() {
    partials_merge_in_f32::<bf16>();
}

#[test]
fn f16_partials_merge_in_f32() {
    partials_merge_in_f32::<f16>();
}

fn backward_matches<H: Half>() {
    for shape in [[1, 2, 1, 9, 13, 5, 7], [2, 4, 2, 100, 70, 16, 24]] {
        for spec in specs() {
            let case = Case::<H>::new(shape, spec, 5);
            let opts = case.half_options();
            let forward = scaled_dot_product_attention_partial(
                case.q.view(),
                case.k.view(),
                case.v.view(),
                &opts,
            )
            .expect("the half forward runs");
            let mut rng = Rng::new(9);
            let d_out: Array4<H> =
                random_array(&mut rng, [shape[0], shape[1], shape[3], shape[6]], 1.0);
            let got = scaled_dot_product_attention_backward(
                case.q.view(),
                case.k.view(),
                case.v.view(),
                &opts,
                &forward,
                d_out.view(),
            )
            .expect("the half backward runs");
            // Into a caller's arrays full of NaN, without `d_sinks`: every
            // gradient is written, the same as the allocating call's.
            let mut reused = got.clone();
            let nan = H::from_f64(f64::NAN);
            for d in [&mut reused.d_q, &mut reused.d_k, &mut reused.d_v] {
                d.fill(nan);
            }
            if let Some(d_bias) = &mut reused.d_bias {
                d_bias.fill(f32::NAN);
            }
            reused.d_sinks = None;
            scaled_dot_product_attention_backward_into(
                case.q.view(),
                case.k.view(),
                case.v.view(),
                &opts,
                &forward,
                d_out.view(),
                &mut reused,
            )
            .expect("the half backward runs into a caller's arrays");
            assert_eq!(reused, got, "_into {shape:?} {spec:?}");
            // The reference in f64, given the same (rounded) forward.
            let [q, k, v] = case.wide();
            let wide_forward = sdpa::AttentionPartial::from_parts(
                widen(&forward.output()),
                forward.log_sum_exp().mapv(f64::from),
            )
            .expect("consistent parts");
            let wide_opts = case.wide_options();
            let want = sdpa::core::scaled_dot_product_attention_backward(
                q.view(),
                k.view(),
                v.view(),
                &wide_opts,
                &wide_forward,
                widen(&d_out.view()).view(),
            )
            .expect("the reference backward runs");
            // core's half path is that call, rounded.
            let core = sdpa::core::scaled_dot_product_attention_backward(
                case.q.view(),
                case.k.view(),
                case.v.view(),
                &opts,
                &forward,
                d_out.view(),
            )
            .expect("core's half backward runs");
            assert_eq!(core.d_q, want.d_q.mapv(H::from_f64), "core d_q {spec:?}");
            let what = format!("backward {shape:?} {spec:?}");
            let grads = [
                (&got.d_q, &want.d_q, "d_q"),
                (&got.d_k, &want.d_k, "d_k"),
                (&got.d_v, &want.d_v, "d_v"),
            ];
            for (got, want, name) in grads {
                let largest = want.iter().fold(0.0, |m: f64, x| m.max(x.abs()));
                assert_within(got, want, 1e-4 * (1.0 + largest), &format!("{what} {name}"));
            }
            if let (Some(got), Some(want)) = (&got.d_bias, &want.d_bias) {
                let got: &Array4<f32> = got;
                let largest = want.iter().fold(0.0, |m: f64, x| m.max(x.abs()));
                for (&g, &w) in got.iter().zip(want) {
                    assert!(
                        (f64::from(g) - w).abs() <= 1e-4 * (1.0 + largest),
                        "{what} d_bias"
                    );
                }
            }
            assert_eq!(got.d_sinks.is_some(), spec.sinks);
            if let (Some(got), Some(want)) = (&got.d_sinks, &want.d_sinks) {
                let got: &Array1<f32> = got;
                for (&g, &w) in got.iter().zip(want) {
                    assert!(
                        (f64::from(g) - w).abs() <= 1e-3 * (1.0 + w.abs()),
                        "{what} d_sinks {g} {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_backward_matches_the_f64_reference() {
    backward_matches::<bf16>();
}

#[test]
fn f16_backward_matches_the_f64_reference() {
    backward_matches::<f16>();
}

fn nan_in_masked_data_never_leaks<H: Half>() {
    // Keys past each key length, and future keys under the causal mask,
    // hold NaN and infinities; every visible one is finite.
    let [batch, heads, len_q, len_kv, d] = [2, 2, 40, 90, 16];
    let mut rng = Rng::new(3);
    let q: Array4<H> = random_array(&mut rng, [batch, heads, len_q, d], 1.0);
    let mut k: Array4<H> = random_array(&mut rng, [batch, 1, len_kv, d], 1.0);
    let mut v: Array4<H> = random_array(&mut rng, [batch, 1, len_kv, d], 1.0);
    let lengths = [60, 90];
    for (b, &length) in lengths.iter().enumerate() {
        for j in 0..len_kv {
            let hidden = j >= length;
            if hidden {
                k.index_axis_mut(Axis(0), b)
                    .index_axis_mut(Axis(1), j)
                    .fill(H::from_f64(f64::NAN));
                v.index_axis_mut(Axis(0), b)
                    .index_axis_mut(Axis(1), j)
                    .fill(H::from_f64(f64::INFINITY));
            }
        }
    }
    // Each query's last key past the diagonal is NaN too (the causal mask hides it).
    let opts = AttentionOptions::new().causal().key_lengths(&lengths);
    let mut future_k = k.clone();
    let first_hidden = len_kv - len_q + 1;
    future_k
        .index_axis_mut(Axis(0), 1)
        .index_axis_mut(Axis(1), first_hidden + 5)
        .fill(H::from_f64(f64::NAN));
    for set in available_kernel_sets() {
        let out: Array4<H> = with_kernel_set(set, || {
            scaled_dot_product_attention(q.view(), future_k.view(), v.view(), &opts)
        })
        .expect("the set runs")
        .expect("the call runs");
        // Rows of batch item 1 before the NaN key's diagonal never see it.
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..len_q {
                    let row_sees_nan_key = b == 1 && i + (len_kv - len_q) >= first_hidden + 5;
                    let row = out.index_axis(Axis(0), b);
                    let row = row.index_axis(Axis(0), h);
                    let finite = row.row(i).iter().all(|x| x.to_f64().is_finite());
                    assert_eq!(
                        finite,
                        !row_sees_nan_key,
                        "{}: row ({b}, {h}, {i}) finite = {finite}",
                        set.name()
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_nan_in_masked_data_never_leaks() {
    nan_in_masked_data_never_leaks::<bf16>();
}

#[test]
fn f16_nan_in_masked_data_never_leaks() {
    nan_in_masked_data_never_leaks::<f16>();
}

/// Queries are read in the caller's layout and widened a query tile at a
/// time: a permuted `[batch, len, heads, d]` array, rows strided along
/// `d`, and reversed rows give what a standard-layout copy gives, bit for
/// bit, on every kernel set, for prefills and decoding steps (and bf16's
/// native path, where the CPU has it).
fn queries_in_any_layout<H: Half>() {
    let mut rng = Rng::new(77);
    for &(len_q, d) in &[(100, 64), (3, 32), (37, 17)] {
        let shape = [2, 4, len_q, d];
        // Stored [batch, len, heads, 2d]: every other column is the query.
        let stored: Array4<H> = random_array(&mut rng, [2, len_q, 4, 2 * d], 2.0);
        let k: Array4<H> = random_array(&mut rng, [2, 2, 150, d], 2.0);
        let v: Array4<H> = random_array(&mut rng, [2, 2, 150, 24], 2.0);
        let permuted = stored
            .slice(s![.., .., .., ..d])
            .permuted_axes([0, 2, 1, 3]);
        let strided = stored
            .slice(s![.., .., .., ..;2])
            .permuted_axes([0, 2, 1, 3]);
        let reversed = stored
            .slice(s![.., ..;-1, .., ..d])
            .permuted_axes([0, 2, 1, 3]);
        for opts in [AttentionOptions::new(), AttentionOptions::new().causal()] {
            for set in available_kernel_sets() {
                let run = |q: ArrayView4<'_, H>| {
                    with_kernel_set(set, || {
                        scaled_dot_product_attention(q, k.view(), v.view(), &opts)
                    })
                    .expect("the set runs here")
                    .expect("the call runs")
                };
                for (name, q) in [
                    ("permuted", permuted),
                    ("strided", strided),
                    ("reversed", reversed),
                ] {
                    assert_eq!(q.shape(), shape);
                    let standard = q.as_standard_layout().to_owned();
                    let (got, want) = (run(q), run(standard.view()));
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_f64().to_bits() == b.to_f64().to_bits()),
                        "{} {name} {shape:?}",
                        set.name()
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_queries_in_any_layout() {
    queries_in_any_layout::<bf16>();
}

#[test]
fn f16_queries_in_any_layout() {
    queries_in_any_layout::<f16>();
}

#[test]
fn half_calls_report_errors_not_panics() {
    let q = Array4::from_elem((1, 2, 3, 4), bf16::ONE);
    let k = Array4::from_elem((1, 2, 5, 3), bf16::ONE);
    let error =
        scaled_dot_product_attention(q.view(), k.view(), k.view(), &AttentionOptions::new())
            .expect_err("d_k differs");
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    let k = Array4::from_elem((1, 2, 5, 4), f16::ONE);
    let q16 = q.mapv(|x| f16::from_f32(x.to_f32()));
    let mut small = Array4::from_elem((1, 2, 3, 3), f16::ZERO);
    let error = scaled_dot_product_attention_into(
        q16.view(),
        k.view(),
        k.view(),
        &AttentionOptions::new(),
        small.view_mut(),
    )
    .expect_err("out is too small");
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    let error = scaled_dot_product_attention(
        q16.view(),
        k.view(),
        k.view(),
        &AttentionOptions::new().scale(f32::INFINITY),
    )
    .expect_err("an infinite scale");
    assert_eq!(error.kind(), ErrorKind::InvalidOption);
}

#[test]
fn the_default_scale_is_not_rounded_to_the_storage_type() {
    // 1/√96 rounded to bf16 is off by 0.2%; the default scale is f32.
    let mut rng = Rng::new(11);
    let q: Array4<bf16> = random_array(&mut rng, [1, 1, 4, 96], 3.0);
    let k: Array4<bf16> = random_array(&mut rng, [1, 1, 6, 96], 3.0);
    let v: Array4<bf16> = random_array(&mut rng, [1, 1, 6, 8], 1.0);
    let default =
        scaled_dot_product_attention(q.view(), k.view(), v.view(), &AttentionOptions::new())
            .expect("runs");
    let exact = scaled_dot_product_attention(
        q.view(),
        k.view(),
        v.view(),
        &AttentionOptions::new().scale(1.0 / 96f32.sqrt()),
    )
    .expect("runs");
    assert_eq!(default, exact);
}
