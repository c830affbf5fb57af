//! Shared helpers for the integration tests: a seeded generator for random
//! arrays, proptest strategies for attention shapes, an independent naive
//! oracle written from the definition, and tolerant comparisons.
//!
//! Each test file pulls this in with `mod common;` and uses only part of it.
#![allow(dead_code)]

use ndarray::{Array, Array4, ArrayView4, Dimension, ShapeBuilder};
use proptest::prelude::*;
use sdpa::simd::KernelSet;
use sdpa::{AttentionOptions, CausalAlignment, Element};

/// A kernel set, and what [`sdpa::simd::with_amx`] says on the calling
/// thread: `Some(true)` puts `f32` prefills on AMX tiles wherever they
/// can run (`d_k` a multiple of 32), `Some(false)` keeps them off, `None`
/// leaves it to the rule (tiles where they pay).
#[derive(Clone, Copy, Debug)]
pub struct Engine {
    pub set: KernelSet,
    pub amx: Option<bool>,
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let amx = match self.amx {
            Some(true) => "+amx",
            Some(false) => "-amx",
            None => "",
        };
        write!(f, "{}{amx}", self.set)
    }
}

impl From<KernelSet> for Engine {
    fn from(set: KernelSet) -> Self {
        Engine { set, amx: None }
    }
}

impl Engine {
    /// `f` with every call it makes on this thread on this engine.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> Result<R, sdpa::AttentionError> {
        sdpa::simd::with_kernel_set(self.set, || match self.amx {
            Some(enabled) => sdpa::simd::with_amx(enabled, f),
            None => f(),
        })
    }
}

/// Every engine this CPU has: each kernel set as chosen by default, and
/// on a CPU with AMX the AVX-512 set with the tiles forced on and off.
pub fn engines() -> Vec<Engine> {
    let mut engines = Vec::new();
    for set in sdpa::simd::available_kernel_sets() {
        engines.push(Engine { set, amx: None });
        if sdpa::simd::amx_runs_on(set) {
            engines.push(Engine {
                set,
                amx: Some(true),
            });
            engines.push(Engine {
                set,
                amx: Some(false),
            });
        }
    }
    engines
}

/// How far a native `bf16` forward's form of each weight in `P·V` may be
/// from the `f32` weight, relative to it: 2⁻⁸ rounded once on AMX tiles,
/// 2⁻¹⁵ in two parts on `vdpbf16ps`.
#[cfg(feature = "half")]
pub fn native_weights_error(amx: bool) -> f64 {
    if amx { 2f64.powi(-8) } else { 2f64.powi(-15) }
}

/// A column-major array of NaN: a caller's buffer that an `_into` call
/// must overwrite entry by entry, whatever its layout.
pub fn nan_filled<F: Element, D: Dimension>(dim: D) -> Array<F, D> {
    Array::from_elem(dim.f(), cast::<F>(f64::NAN))
}

/// `x` as `F` (every `f64` converts to `f32`/`f64`, possibly rounded).
pub fn cast<F: Element>(x: f64) -> F {
    num_traits::cast(x).expect("an f64 converts to every Element")
}

/// `x` as `f64` (exact for `f32` and `f64`).
pub fn to_f64<F: Element>(x: F) -> f64 {
    num_traits::cast(x).expect("every Element converts to f64")
}

/// A whole array converted to `f64`.
pub fn array_to_f64<F: Element>(a: &ArrayView4<'_, F>) -> Array4<f64> {
    a.mapv(to_f64)
}

/// A whole `f64` array converted to `F`.
pub fn array_from_f64<F: Element>(a: &Array4<f64>) -> Array4<F> {
    a.mapv(cast)
}

/// SplitMix64: a small, seeded, reproducible generator, so a failing case
/// can be replayed from its seed alone.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// A random permutation of `0..n` (Fisher–Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }

    /// An array of the given shape, entries uniform in `[-1, 1)`.
    pub fn array<F: Element>(&mut self, shape: [usize; 4]) -> Array4<F> {
        Array4::from_shape_simple_fn(shape, || cast(self.uniform(-1.0, 1.0)))
    }

    /// A keep mask of the given shape, each entry `true` with probability `p`.
    pub fn mask(&mut self, shape: [usize; 4], p: f64) -> Array4<bool> {
        Array4::from_shape_simple_fn(shape, || self.chance(p))
    }
}

/// The dimensions of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub len_q: usize,
    pub len_kv: usize,
    pub d_k: usize,
    pub d_v: usize,
}

impl Dims {
    pub fn q(&self) -> [usize; 4] {
        [self.batch, self.heads, self.len_q, self.d_k]
    }
    pub fn k(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.len_kv, self.d_k]
    }
    pub fn v(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.len_kv, self.d_v]
    }
    pub fn out(&self) -> [usize; 4] {
        [self.batch, self.heads, self.len_q, self.d_v]
    }
    /// `[batch, heads, len_q, len_kv]`: weights, keep mask and bias.
    pub fn scores(&self) -> [usize; 4] {
        [self.batch, self.heads, self.len_q, self.len_kv]
    }
    /// The same call with one key/value head per query head.
    pub fn as_multi_head(&self) -> Self {
        Self {
            kv_heads: self.heads,
            ..*self
        }
    }
}

/// A sequence length: mostly small (0 and 1 included), sometimes past one
/// or two of the 64- or 96-row tiles a fused kernel is likely to use.
pub fn length() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 0usize..=9, 2 => 10usize..=70, 1 => 71usize..=200]
}

/// A positive sequence length.
pub fn positive_length() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 1usize..=9, 2 => 10usize..=70, 1 => 71usize..=200]
}

/// The proptest configuration with `cases` cases, unless the
/// `PROPTEST_CASES` environment variable asks for another number (a long
/// hunt: `PROPTEST_CASES=5000 cargo test --test properties`).
pub fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// A head dimension: mostly small and odd-sized, sometimes around 64.
pub fn head_dim() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 1usize..=17, 1 => 30usize..=70]
}

fn dims_from(
    lengths: (usize, usize),
    (batch, kv_heads, group): (usize, usize, usize),
    (d_k, d_v): (usize, usize),
) -> Dims {
    Dims {
        batch,
        heads: kv_heads * group,
        kv_heads,
        len_q: lengths.0,
        len_kv: lengths.1,
        d_k,
        d_v,
    }
}

/// Random valid dimensions: batch 1..=3, kv_heads 1..=3, 1..=3 query heads
/// per key/value head (so MHA, GQA and MQA), lengths 0..=70, head dims 1..=70.
pub fn dims() -> impl Strategy<Value = Dims> {
    (
        (length(), length()),
        (1usize..=3, 1usize..=3, 1usize..=3),
        (head_dim(), head_dim()),
    )
        .prop_map(|(l, h, d)| dims_from(l, h, d))
}

/// As [`dims`], with `len_q, len_kv ≥ 1`.
pub fn nonempty_dims() -> impl Strategy<Value = Dims> {
    (
        (positive_length(), positive_length()),
        (1usize..=3, 1usize..=3, 1usize..=3),
        (head_dim(), head_dim()),
    )
        .prop_map(|(l, h, d)| dims_from(l, h, d))
}

/// Random `q`, `k`, `v` of one call.
#[derive(Debug, Clone)]
pub struct Inputs<F> {
    pub q: Array4<F>,
    pub k: Array4<F>,
    pub v: Array4<F>,
}

impl<F: Element> Inputs<F> {
    /// Entries uniform in `[-1, 1)`.
    pub fn random(dims: &Dims, rng: &mut Rng) -> Self {
        Self {
            q: rng.array(dims.q()),
            k: rng.array(dims.k()),
            v: rng.array(dims.v()),
        }
    }

    /// The same inputs in `f64` (exact).
    pub fn to_f64(&self) -> Inputs<f64> {
        Inputs {
            q: array_to_f64(&self.q.view()),
            k: array_to_f64(&self.k.view()),
            v: array_to_f64(&self.v.view()),
        }
    }
}

/// Causal, bottom-right: query `i` sees key `j` when `j ≤ i + len_kv − len_q`
/// (written without subtraction so it cannot underflow).
pub fn bottom_right_visible(i: usize, j: usize, len_q: usize, len_kv: usize) -> bool {
    j + len_q <= i + len_kv
}

/// Causal, top-left: query `i` sees key `j` when `j ≤ i`.
pub fn top_left_visible(i: usize, j: usize) -> bool {
    j <= i
}

/// Sliding window of `w` keys, bottom-right: with the diagonal position
/// `p = i + len_kv − len_q`, key `j` is in the window when `j > p − w`.
pub fn bottom_right_in_window(i: usize, j: usize, len_q: usize, len_kv: usize, w: usize) -> bool {
    j + w + len_q > i + len_kv
}

/// Sliding window of `w` keys, top-left: key `j` is in the window of query
/// `i` when `j > i − w`.
pub fn top_left_in_window(i: usize, j: usize, w: usize) -> bool {
    j + w > i
}

/// The keep mask `[batch, heads, len_q, len_kv]` given by a rule.
pub fn mask_from(dims: &Dims, rule: impl Fn(usize, usize, usize, usize) -> bool) -> Array4<bool> {
    Array4::from_shape_fn(dims.scores(), |(b, h, i, j)| rule(b, h, i, j))
}

/// Attention straight from its definition, in `f64`, with loops: an oracle
/// that shares no code with the crate.
///
/// `visible(b, h, i, j)` says whether query `i` may see key `j`; `bias`
/// gives the additive bias. Invisible keys are skipped entirely, a row with
/// no visible key (or only `-inf` scores) is zero.
pub fn naive_attention(
    inputs: &Inputs<f64>,
    scale: f64,
    visible: impl Fn(usize, usize, usize, usize) -> bool,
    bias: impl Fn(usize, usize, usize, usize) -> f64,
) -> Array4<f64> {
    let [batch, heads, len_q, _] = inputs.q.shape().try_into().unwrap();
    let [_, kv_heads, len_kv, d_v] = inputs.v.shape().try_into().unwrap();
    let group = heads / kv_heads;
    let mut out = Array4::zeros((batch, heads, len_q, d_v));
    for b in 0..batch {
        for h in 0..heads {
            let kv = h / group;
            for i in 0..len_q {
                let scores: Vec<Option<f64>> = (0..len_kv)
                    .map(|j| {
                        visible(b, h, i, j).then(|| {
                            let dot: f64 = inputs
                                .q
                                .slice(ndarray::s![b, h, i, ..])
                                .iter()
                                .zip(inputs.k.slice(ndarray::s![b, kv, j, ..]))
                                .map(|(a, c)| a * c)
                                .sum();
                            dot * scale + bias(b, h, i, j)
                        })
                    })
                    .collect();
                let max = scores
                    .iter()
                    .flatten()
                    .fold(f64::NEG_INFINITY, |m, &s| m.max(s));
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let exps: Vec<Option<f64>> =
                    scores.iter().map(|s| s.map(|s| (s - max).exp())).collect();
                let sum: f64 = exps.iter().flatten().sum();
                for (j, e) in exps.iter().enumerate() {
                    if let Some(e) = e {
                        let w = e / sum;
                        for d in 0..d_v {
                            out[[b, h, i, d]] += w * inputs.v[[b, kv, j, d]];
                        }
                    }
                }
            }
        }
    }
    out
}

/// The tolerance to compare results of type `F` computed along different
/// paths (summation orders), on inputs of magnitude about 1:
/// `|actual − expected| ≤ tol` or `≤ tol·max(|actual|, |expected|)`.
pub fn tolerance<F: Element>() -> f64 {
    if F::epsilon() > cast(1e-10) {
        2e-5
    } else {
        1e-12
    }
}

/// Checks that two arrays have the same shape and agree within `tol`
/// (absolute or relative, like `approx::relative_eq!`); NaN never agrees.
/// The error names the worst index.
pub fn close<F: Element, G: Element, D: Dimension>(
    actual: &ndarray::ArrayView<'_, F, D>,
    expected: &ndarray::ArrayView<'_, G, D>,
    tol: f64,
) -> Result<(), String> {
    if actual.shape() != expected.shape() {
        return Err(format!(
            "shapes differ: actual {:?}, expected {:?}",
            actual.shape(),
            expected.shape()
        ));
    }
    let mut worst: Option<(D::Pattern, f64, f64)> = None;
    let mut worst_excess = 0.0;
    for ((index, &a), &e) in actual.indexed_iter().zip(expected.iter()) {
        let (a, e) = (to_f64(a), to_f64(e));
        if approx::relative_eq!(a, e, epsilon = tol, max_relative = tol) {
            continue;
        }
        let excess = if a.is_nan() || e.is_nan() {
            f64::INFINITY
        } else {
            (a - e).abs()
        };
        if worst.is_none() || excess > worst_excess {
            worst_excess = excess;
            worst = Some((index, a, e));
        }
    }
    match worst {
        None => Ok(()),
        Some((index, a, e)) => Err(format!(
            "arrays of shape {:?} differ beyond {tol:e}; worst at {index:?}: actual {a}, expected {e}",
            actual.shape()
        )),
    }
}

/// [`close`] that panics with its message.
#[track_caller]
pub fn assert_close<F: Element, G: Element, D: Dimension>(
    actual: &ndarray::ArrayView<'_, F, D>,
    expected: &ndarray::ArrayView<'_, G, D>,
    tol: f64,
) {
    if let Err(message) = close(actual, expected, tol) {
        panic!("{message}");
    }
}

/// [`close`] as a proptest assertion.
pub fn prop_close<F: Element, G: Element, D: Dimension>(
    actual: &ndarray::ArrayView<'_, F, D>,
    expected: &ndarray::ArrayView<'_, G, D>,
    tol: f64,
) -> Result<(), TestCaseError> {
    close(actual, expected, tol).map_err(TestCaseError::fail)
}

/// Which options a call uses; the arrays are drawn from a seed later.
/// `keep_mask` / `bias` give, per dimension of `[batch, heads, len_q,
/// len_kv]`, whether it is broadcast (length 1).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OptionSpec {
    pub causal: Option<CausalAlignment>,
    pub scale: Option<f64>,
    pub keep_mask: Option<[bool; 4]>,
    pub bias: Option<[bool; 4]>,
    pub key_lengths: bool,
    /// A sliding window of this many keys (implies causal).
    pub window: Option<usize>,
}

pub fn alignment() -> impl Strategy<Value = Option<CausalAlignment>> {
    prop_oneof![
        Just(None),
        Just(Some(CausalAlignment::BottomRight)),
        Just(Some(CausalAlignment::TopLeft)),
    ]
}

/// Any combination of options.
pub fn option_spec() -> impl Strategy<Value = OptionSpec> {
    (
        alignment(),
        prop::option::of(prop_oneof![-1.5..1.5f64, Just(0.0)]),
        prop::option::of(any::<[bool; 4]>()),
        prop::option::of(any::<[bool; 4]>()),
        any::<bool>(),
        prop_oneof![3 => Just(None), 1 => (1usize..=12).prop_map(Some)],
    )
        .prop_map(
            |(causal, scale, keep_mask, bias, key_lengths, window)| OptionSpec {
                causal,
                scale,
                keep_mask,
                bias,
                key_lengths,
                window,
            },
        )
}

/// The entry of a broadcastable `[batch, heads, len_q, len_kv]` array.
pub fn broadcast_at<T: Copy>(a: &Array4<T>, b: usize, h: usize, i: usize, j: usize) -> T {
    let s = a.shape();
    let pick = |len: usize, index: usize| if len == 1 { 0 } else { index };
    a[[pick(s[0], b), pick(s[1], h), pick(s[2], i), pick(s[3], j)]]
}

/// The shape `full` with the dimensions marked in `ones` set to 1.
pub fn broadcast_shape(full: [usize; 4], ones: [bool; 4]) -> [usize; 4] {
    std::array::from_fn(|d| if ones[d] { 1 } else { full[d] })
}

/// The option arrays of one call, drawn for a [`OptionSpec`].
#[derive(Debug, Clone)]
pub struct Extras<F> {
    pub dims: Dims,
    pub causal: Option<CausalAlignment>,
    pub scale: Option<F>,
    pub keep_mask: Option<Array4<bool>>,
    pub bias: Option<Array4<F>>,
    pub key_lengths: Option<Vec<usize>>,
    pub window: Option<usize>,
}

impl<F: Element> Extras<F> {
    /// No options: bidirectional, default scale.
    pub fn none(dims: &Dims) -> Self {
        Self {
            dims: *dims,
            causal: None,
            scale: None,
            keep_mask: None,
            bias: None,
            key_lengths: None,
            window: None,
        }
    }

    /// Arrays for `spec`: keep-mask entries `true` with probability 0.7,
    /// bias uniform in `[-1, 1)` or, one time in ten, `-inf` (which hides a
    /// key like the mask does), key lengths uniform in `0..=len_kv`.
    pub fn random(spec: &OptionSpec, dims: &Dims, rng: &mut Rng) -> Self {
        Self {
            dims: *dims,
            causal: spec.causal,
            scale: spec.scale.map(cast),
            keep_mask: spec
                .keep_mask
                .map(|ones| rng.mask(broadcast_shape(dims.scores(), ones), 0.7)),
            bias: spec.bias.map(|ones| {
                rng.array(broadcast_shape(dims.scores(), ones))
                    .mapv(|x: F| {
                        if rng.chance(0.1) {
                            F::neg_infinity()
                        } else {
                            x
                        }
                    })
            }),
            key_lengths: spec.key_lengths.then(|| {
                (0..dims.batch)
                    .map(|_| rng.below(dims.len_kv + 1))
                    .collect()
            }),
            window: spec.window,
        }
    }

    /// The options for the crate.
    pub fn options(&self) -> AttentionOptions<'_, F> {
        let mut opts = AttentionOptions::new();
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        if let Some(alignment) = self.causal {
            opts = opts.causal_aligned(alignment);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(scale);
        }
        if let Some(mask) = &self.keep_mask {
            opts = opts.keep_mask(mask.view());
        }
        if let Some(bias) = &self.bias {
            opts = opts.bias(bias.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        opts
    }

    /// Whether query `i` of `(b, h)` may see key `j`, from the definitions.
    pub fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (len_q, len_kv) = (self.dims.len_q, self.dims.len_kv);
        // A window implies causal, bottom-right unless aligned otherwise.
        let alignment = self
            .causal
            .or(self.window.map(|_| CausalAlignment::BottomRight));
        let causal = match alignment {
            None => true,
            Some(CausalAlignment::BottomRight) => bottom_right_visible(i, j, len_q, len_kv),
            Some(CausalAlignment::TopLeft) => top_left_visible(i, j),
        };
        let in_window = self.window.is_none_or(|w| match alignment {
            Some(CausalAlignment::TopLeft) => top_left_in_window(i, j, w),
            _ => bottom_right_in_window(i, j, len_q, len_kv, w),
        });
        causal
            && in_window
            && self.key_lengths.as_ref().is_none_or(|l| j < l[b])
            && self
                .keep_mask
                .as_ref()
                .is_none_or(|m| broadcast_at(m, b, h, i, j))
    }

    /// Whether key `j` takes part in query `i`'s softmax: visible, and
    /// its bias is not `-inf`.
    pub fn live(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        self.visible(b, h, i, j) && self.bias_at(b, h, i, j) > f64::NEG_INFINITY
    }

    pub fn bias_at(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        self.bias
            .as_ref()
            .map_or(0.0, |bias| to_f64(broadcast_at(bias, b, h, i, j)))
    }

    /// The scale in `f64`: the option, or `1/√d_k` computed in `F`.
    pub fn scale_f64(&self) -> f64 {
        let default = F::one() / cast::<F>(self.dims.d_k as f64).sqrt();
        to_f64(self.scale.unwrap_or(default))
    }

    /// The same options in `f64` (exact).
    pub fn to_f64(&self) -> Extras<f64> {
        Extras {
            dims: self.dims,
            causal: self.causal,
            scale: self.scale.map(to_f64),
            keep_mask: self.keep_mask.clone(),
            bias: self.bias.as_ref().map(|b| array_to_f64(&b.view())),
            key_lengths: self.key_lengths.clone(),
            window: self.window,
        }
    }

    /// [`naive_attention`] of `inputs` with these options.
    pub fn naive(&self, inputs: &Inputs<F>) -> Array4<f64> {
        naive_attention(
            &inputs.to_f64(),
            self.scale_f64(),
            |b, h, i, j| self.visible(b, h, i, j),
            |b, h, i, j| self.bias_at(b, h, i, j),
        )
    }
}

/// The output of both paths on a valid call: `sdpa::` (the fast path for
/// `f32`, once it exists) then `sdpa::core::`.
pub fn both_paths<F: Element>(
    inputs: &Inputs<F>,
    opts: &AttentionOptions<'_, F>,
) -> [(&'static str, Array4<F>); 2] {
    let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    [
        (
            "sdpa",
            sdpa::scaled_dot_product_attention(q, k, v, opts).expect("valid call"),
        ),
        (
            "sdpa::core",
            sdpa::core::scaled_dot_product_attention(q, k, v, opts).expect("valid call"),
        ),
    ]
}

/// An `f64` array of the given shape, uniform in `[-scale, scale)`, from its
/// own seed: for tests that build several arrays from one case seed.
pub fn seeded(dim: (usize, usize, usize, usize), seed: u64, scale: f64) -> Array4<f64> {
    let mut rng = Rng::new(seed);
    Array4::from_shape_simple_fn(dim, || rng.uniform(-scale, scale))
}

/// Eight fixed option combinations, `case` 0..8, over the given keep mask,
/// bias and key lengths: none; causal; top-left causal with a keep mask;
/// bias with key lengths; a window of 3 with bias; causal with keep mask and
/// key lengths; scale 0.3 with bias, causal; keep mask with bias.
pub fn option_case<'a, F: Copy + From<f32>>(
    case: usize,
    keep: &'a Array4<bool>,
    bias: &'a Array4<F>,
    lengths: &'a [usize],
) -> AttentionOptions<'a, F> {
    match case % 8 {
        0 => AttentionOptions::new(),
        1 => AttentionOptions::new().causal(),
        2 => AttentionOptions::new()
            .causal_aligned(CausalAlignment::TopLeft)
            .keep_mask(keep.view()),
        3 => AttentionOptions::new()
            .bias(bias.view())
            .key_lengths(lengths),
        4 => AttentionOptions::new().window(3).bias(bias.view()),
        5 => AttentionOptions::new()
            .causal()
            .keep_mask(keep.view())
            .key_lengths(lengths),
        6 => AttentionOptions::new()
            .scale(F::from(0.3))
            .bias(bias.view())
            .causal(),
        _ => AttentionOptions::new()
            .keep_mask(keep.view())
            .bias(bias.view()),
    }
}

/// Runs `f` on a rayon pool of `threads` threads (results must not depend
/// on how many).
pub fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool")
        .install(f)
}
