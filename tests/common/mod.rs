//! Shared helpers for the integration tests: a seeded generator for random
//! arrays, proptest strategies for attention shapes, an independent naive
//! oracle written from the definition, and tolerant comparisons.
//!
//! Each test file pulls this in with `mod common;` and uses only part of it.
#![allow(dead_code)]

use ndarray::{Array4, ArrayView4, Dimension};
use proptest::prelude::*;
use sdpa::Element;

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

/// A sequence length: mostly small (0 and 1 included), sometimes past the
/// 64-wide tiles a fused kernel is likely to use.
pub fn length() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0usize..=9, 1 => 10usize..=70]
}

/// A positive sequence length.
pub fn positive_length() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 1usize..=9, 1 => 10usize..=70]
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
