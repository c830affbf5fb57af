//! Every kernel set this CPU has, against plain scalar arithmetic in f64.

use ndarray::ArrayView2;

use super::exp::{EXP_MIN_INPUT, exp, exp_for_half_results, exp_of_nonpositive};
use super::kernel::KernelOp;
use super::vector::Vector;
use super::{
    Kernel, KernelSet, SoftmaxRows, ValueRows, WeightPrecision, WithKernel, ZeroWeights,
    available_kernel_sets, current_kernel_set, selected_kernel_set, with_kernel, with_kernel_set,
};

/// Runs `job` once per available kernel set.
fn for_each_kernel_set<J: WithKernel + Clone>(job: J) -> Vec<(KernelSet, J::Output)> {
    available_kernel_sets()
        .into_iter()
        .map(|set| (set, with_kernel(set, job.clone()).expect("available set")))
        .collect()
}

/// The error of `got` against the exact `expected`, in units of the last
/// place of `expected` rounded to `f32`.
fn ulp_error(got: f32, expected: f64) -> f64 {
    let rounded = expected as f32;
    let ulp = (f32::from_bits(rounded.to_bits() + 1) - rounded) as f64;
    (got as f64 - expected).abs() / ulp
}

/// Which of the `exp` functions a test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExpKind {
    /// [`exp`], for any input.
    General,
    /// [`exp_of_nonpositive`], the softmax's.
    Nonpositive,
    /// [`exp_for_half_results`].
    ForHalf,
}

/// `e^x` in place, `V::LANES` at a time (the last few through a padded
/// vector): one of the `exp` functions as a kernel of its own.
struct ExpInPlace<'a>(&'a mut [f32], ExpKind);

impl ExpInPlace<'_> {
    /// # Safety
    /// The CPU has `V`'s instruction set.
    #[inline(always)]
    unsafe fn exp<V: Vector>(kind: ExpKind, x: V) -> V {
        // SAFETY: the caller's.
        unsafe {
            match kind {
                ExpKind::General => exp(x),
                ExpKind::Nonpositive => exp_of_nonpositive(x),
                ExpKind::ForHalf => exp_for_half_results(x),
            }
        }
    }
}

impl KernelOp for ExpInPlace<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) {
        let kind = self.1;
        let mut chunks = self.0.chunks_exact_mut(V::LANES);
        for chunk in &mut chunks {
            // SAFETY: the caller guarantees V's instruction set; the chunk
            // has `V::LANES` elements.
            unsafe { Self::exp(kind, V::load(chunk.as_ptr())).store(chunk.as_mut_ptr()) };
        }
        let tail = chunks.into_remainder();
        let mut padded = [0.0f32; 64];
        assert!(V::LANES <= padded.len());
        padded[..tail.len()].copy_from_slice(tail);
        // SAFETY: the caller guarantees V's instruction set; `padded` has at
        // least `V::LANES` elements.
        unsafe { Self::exp(kind, V::load(padded.as_ptr())).store(padded.as_mut_ptr()) };
        let n = tail.len();
        tail.copy_from_slice(&padded[..n]);
    }
}

/// `e^x` over the inputs, on one kernel set; returns (set, outputs).
#[derive(Clone)]
struct Exp(Vec<f32>, ExpKind);

impl Exp {
    fn general(x: Vec<f32>) -> Self {
        Exp(x, ExpKind::General)
    }
}

impl WithKernel for Exp {
    type Output = (KernelSet, Vec<f32>);
    fn run<K: Kernel>(mut self, kernel: K) -> Self::Output {
        kernel.run(ExpInPlace(&mut self.0, self.1));
        (K::SET, self.0)
    }
}

/// The largest ulp error of `exp` over the `f32`s whose bits run from
/// `first` to `last` (negative numbers: −0 up to larger magnitudes), every
/// `step`-th one.
fn max_exp_ulp_error(set: KernelSet, first: u32, last: u32, step: usize) -> (f64, f32) {
    let mut worst = (0.0, 0.0);
    let inputs: Vec<u32> = (first..=last).step_by(step).collect();
    for chunk in inputs.chunks(1 << 16) {
        let x: Vec<f32> = chunk.iter().map(|&bits| f32::from_bits(bits)).collect();
        let (ran, y) = with_kernel(set, Exp::general(x.clone())).unwrap();
        assert_eq!(ran, set);
        for (&x, &y) in x.iter().zip(&y) {
            let error = ulp_error(y, (x as f64).exp());
            if error > worst.0 {
                worst = (error, x);
            }
        }
    }
    worst
}

/// −0 and −87.3 as bit patterns: the negative floats in between are the
/// bits in between.
const MINUS_ZERO: u32 = 0x8000_0000;
fn bits_of_minus_87_3() -> u32 {
    (-87.3f32).to_bits()
}

#[test]
fn exp_is_within_two_ulp_on_a_sample() {
    for set in available_kernel_sets() {
        let (error, at) = max_exp_ulp_error(set, MINUS_ZERO, bits_of_minus_87_3(), 997);
        assert!(error <= 2.0, "{set}: {error} ulp at {at}");
    }
}

/// Every `f32` in [−87.3, 0]: about 1.1e9 inputs per kernel set. Run it in
/// release: `cargo test --release --lib -- --ignored exp_is_within_two_ulp_exhaustively`.
#[test]
#[ignore = "exhaustive: run in release (CI does)"]
fn exp_is_within_two_ulp_exhaustively() {
    let worst: Vec<_> = available_kernel_sets()
        .into_iter()
        .map(|set| {
            let (error, at) = max_exp_ulp_error(set, MINUS_ZERO, bits_of_minus_87_3(), 1);
            println!("{set}: max error {error:.3} ulp at {at:e}");
            (set, error, at)
        })
        .collect();
    for (set, error, at) in worst {
        assert!(error <= 2.0, "{set}: {error} ulp at {at}");
    }
}

#[test]
fn exp_special_values() {
    let x = vec![
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        EXP_MIN_INPUT - 1e-3,
        -1e30,
        -200.0,
        1.0,
        10.0,
    ];
    for (set, (_, y)) in for_each_kernel_set(Exp::general(x)) {
        assert_eq!(y[0], 0.0, "{set}: exp(-inf)");
        assert!(y[1].is_nan(), "{set}: exp(NaN)");
        assert!(
            (y[2] - 1.0).abs() <= f32::EPSILON && (y[3] - 1.0).abs() <= f32::EPSILON,
            "{set}: exp(0)"
        );
        assert_eq!(&y[4..7], &[0.0, 0.0, 0.0], "{set}: below the normal range");
        assert!(
            ulp_error(y[7], 1f64.exp()) <= 2.0 && ulp_error(y[8], 10f64.exp()) <= 2.0,
            "{set}"
        );
    }
}

#[test]
fn exp_saturates_to_infinity_above_the_f32_range() {
    // 2^n is built in the exponent bits: an unclamped n overflowed the
    // integer add (a debug panic on the scalar set, garbage on the others).
    let x = vec![
        88.0,
        88.8,
        89.0,
        1e3,
        1e30,
        f32::MAX,
        f32::INFINITY,
        1e30,
        88.0,
    ];
    for (set, (_, y)) in for_each_kernel_set(Exp::general(x)) {
        assert!(
            ulp_error(y[0], 88f64.exp()) <= 2.0,
            "{set}: exp(88) = {}",
            y[0]
        );
        assert!(y[1..8].iter().all(|&y| y == f32::INFINITY), "{set}: {y:?}");
    }
}

/// The softmax's inputs, `s − max`: every sampled `f32` in [−87.3, 0], the
/// ends of the range, below it, `−inf` and NaN.
fn shifted_scores() -> Vec<f32> {
    let mut x: Vec<f32> = (MINUS_ZERO..=bits_of_minus_87_3())
        .step_by(331)
        .map(f32::from_bits)
        .collect();
    x.extend([
        0.0,
        EXP_MIN_INPUT,
        EXP_MIN_INPUT - 1e-3,
        -100.0,
        -1e30,
        f32::MIN,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    x
}

#[test]
fn exp_of_nonpositive_gives_the_bits_of_exp() {
    let x = shifted_scores();
    let general = for_each_kernel_set(Exp::general(x.clone()));
    let nonpositive = for_each_kernel_set(Exp(x.clone(), ExpKind::Nonpositive));
    for ((set, (_, a)), (_, (_, b))) in general.into_iter().zip(nonpositive) {
        for ((&x, &a), &b) in x.iter().zip(&a).zip(&b) {
            assert_eq!(a.to_bits(), b.to_bits(), "{set}: exp({x}) = {a}, {b}");
        }
    }
}

#[test]
fn exp_for_half_results_is_within_its_bound() {
    let x = shifted_scores();
    for (set, (_, y)) in for_each_kernel_set(Exp(x.clone(), ExpKind::ForHalf)) {
        let mut worst = 0.0f64;
        for (&x, &y) in x.iter().zip(&y) {
            if x.is_nan() {
                assert!(y.is_nan(), "{set}: exp(NaN) = {y}");
            } else if x < EXP_MIN_INPUT {
                assert_eq!(y, 0.0, "{set}: exp({x})");
            } else {
                let exact = f64::from(x).exp();
                worst = worst.max((f64::from(y) - exact).abs() / exact);
            }
        }
        // The polynomial's 2.7e-6 and `ln 2`'s rounding in one constant
        // (up to 3e-6 at the bottom of the range).
        assert!(worst <= 6e-6, "{set}: relative error {worst:e}");
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// One tile through the three kernels against the textbook formulas.
#[derive(Clone)]
struct TileCheck {
    d: usize,
    value_columns: usize,
}

impl WithKernel for TileCheck {
    type Output = ();
    fn run<K: Kernel>(self, kernel: K) {
        let (d, rows, keys) = (self.d, 2 * K::ROWS, 2 * K::KEY_PANEL);
        let width = self.value_columns.div_ceil(K::LANES) * K::LANES;
        let q = values(rows * d, 1);
        let k = values(keys * d, 2);
        let v = values(keys * width, 3);
        // Pack k into panels of KEY_PANEL keys, each [d][KEY_PANEL].
        let mut panels = vec![0.0; keys * d];
        for j in 0..keys {
            for dd in 0..d {
                panels[(j / K::KEY_PANEL) * K::KEY_PANEL * d
                    + dd * K::KEY_PANEL
                    + j % K::KEY_PANEL] = k[j * d + dd];
            }
        }
        let stride = keys + 3;
        let mut s = vec![f32::NAN; rows * stride];
        kernel.scores(&q, d, &panels, &mut s, stride);
        for r in 0..rows {
            for j in 0..keys {
                let exact: f64 = (0..d)
                    .map(|dd| q[r * d + dd] as f64 * k[j * d + dd] as f64)
                    .sum();
                assert!(
                    (s[r * stride + j] as f64 - exact).abs() < 1e-5 * d as f64,
                    "{}: s[{r}][{j}]",
                    K::SET
                );
            }
        }
        // Keys read in place from their rows give the same scores.
        if d.is_multiple_of(K::LANES) {
            let k_rows = ArrayView2::from_shape((keys, d), &k).unwrap();
            let mut in_place = vec![f32::NAN; rows * stride];
            kernel.row_scores(&q, d, k_rows, &mut in_place, stride);
            for r in 0..rows {
                for j in 0..keys {
                    let (a, b) = (in_place[r * stride + j], s[r * stride + j]);
                    assert!(
                        (a - b).abs() <= 1e-5 * d as f32,
                        "{}: row_scores[{r}][{j}]",
                        K::SET
                    );
                }
            }
            // However many rows and keys a call has (the blocks of rows
            // and keys it takes them in), each score is the bits of that
            // row's and key's dot product.
            for some_rows in [1, 2, 3, 5] {
                for some_keys in [1, 3, 4, 6, 7] {
                    let mut s = vec![f32::NAN; some_rows * stride];
                    let k_rows = k_rows.slice(ndarray::s![..some_keys, ..]);
                    kernel.row_scores(&q[..some_rows * d], d, k_rows, &mut s, stride);
                    for r in 0..some_rows {
                        for j in 0..some_keys {
                            let dot = kernel.dot(&q[r * d..(r + 1) * d], &k[j * d..(j + 1) * d]);
                            assert_eq!(
                                s[r * stride + j].to_bits(),
                                dot.to_bits(),
                                "{}: {some_rows} × {some_keys} row_scores[{r}][{j}]",
                                K::SET
                            );
                        }
                    }
                }
            }
        }
        // Mask one key per row, then the softmax pass from a running state.
        let original = s.clone();
        for r in 0..rows {
            s[r * stride + r % keys] = f32::NEG_INFINITY;
        }
        let mut max = vec![0.5f32; rows];
        let mut sum = vec![2.0f32; rows];
        let mut alpha = vec![f32::NAN; rows];
        // The weights for a half result too, from the same state, checked to their
        // own bound below.
        let mut coarse = s.clone();
        let (mut coarse_max, mut coarse_sum, mut coarse_alpha) =
            (max.clone(), sum.clone(), alpha.clone());
        kernel.softmax_rows(SoftmaxRows {
            s: &mut coarse,
            keys,
            s_stride: stride,
            max: &mut coarse_max,
            sum: &mut coarse_sum,
            alpha: &mut coarse_alpha,
            precision: WeightPrecision::Half,
            scale: 1.0,
        });
        // And with the scale applied by the pass, to scores not yet scaled
        // by it (by 8, exactly: the same scores).
        let mut unscaled: Vec<f32> = s.iter().map(|&x| x * 8.0).collect();
        let (mut unscaled_max, mut unscaled_sum, mut unscaled_alpha) =
            (max.clone(), sum.clone(), alpha.clone());
        kernel.softmax_rows(SoftmaxRows {
            s: &mut unscaled,
            keys,
            s_stride: stride,
            max: &mut unscaled_max,
            sum: &mut unscaled_sum,
            alpha: &mut unscaled_alpha,
            precision: WeightPrecision::Full,
            scale: 0.125,
        });
        kernel.softmax_rows(SoftmaxRows {
            s: &mut s,
            keys,
            s_stride: stride,
            max: &mut max,
            sum: &mut sum,
            alpha: &mut alpha,
            precision: WeightPrecision::Full,
            scale: 1.0,
        });
        // A power of two scales exactly, so the fused multiply-add gives
        // the bits of the subtraction.
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (a, b) in [
            (&unscaled, &s),
            (&unscaled_max, &max),
            (&unscaled_sum, &sum),
            (&unscaled_alpha, &alpha),
        ] {
            assert_eq!(bits(a), bits(b), "{}: the scale in the pass", K::SET);
        }
        assert_eq!((&coarse_max, &coarse_alpha), (&max, &alpha), "{}", K::SET);
        for r in 0..rows {
            for j in 0..keys {
                let (coarse, exact) = (coarse[r * stride + j], s[r * stride + j]);
                assert!(
                    (coarse - exact).abs() <= 7e-6 * exact,
                    "{}: half-result weight [{r}][{j}] {coarse} against {exact}",
                    K::SET
                );
            }
            assert!((coarse_sum[r] - sum[r]).abs() <= 7e-6 * sum[r]);
        }
        for r in 0..rows {
            let row = &original[r * stride..r * stride + keys];
            let visible = |j: usize| j != r % keys;
            let m = (0..keys)
                .filter(|&j| visible(j))
                .map(|j| row[j] as f64)
                .fold(0.5, f64::max);
            let expected_alpha = (0.5 - m).exp();
            assert!(
                (alpha[r] as f64 - expected_alpha).abs() < 1e-6,
                "{}: alpha",
                K::SET
            );
            assert!((max[r] as f64 - m).abs() < 1e-6);
            let mut total = 2.0 * expected_alpha;
            for j in 0..keys {
                let p = if visible(j) {
                    (row[j] as f64 - m).exp()
                } else {
                    0.0
                };
                total += p;
                assert!(
                    (s[r * stride + j] as f64 - p).abs() < 1e-6,
                    "{}: p[{r}][{j}]",
                    K::SET
                );
            }
            assert!(
                (sum[r] as f64 - total).abs() < 1e-5 * total,
                "{}: sum",
                K::SET
            );
        }
        // O ← α·O + P·V, for every row count (decoding has a few).
        let o_start = values(rows * width, 4);
        let v_rows = ArrayView2::from_shape((keys, width), &v).unwrap();
        for some in [1, 2, K::ROWS - 1, K::ROWS + 1, rows] {
            let p = ArrayView2::from_shape((rows, stride), &s).unwrap();
            let accumulate = |value_rows| {
                let mut o = o_start[..some * width].to_vec();
                kernel.accumulate_values(
                    p.slice(ndarray::s![..some, ..]),
                    v_rows,
                    width,
                    &alpha[..some],
                    &mut o,
                    ZeroWeights::Multiply,
                    value_rows,
                );
                o
            };
            let o = accumulate(ValueRows::Packed);
            // Prefetching rows in place changes nothing but the timing.
            assert_eq!(
                o,
                accumulate(ValueRows::InPlace),
                "{}: rows in place",
                K::SET
            );
            let p = p.slice(ndarray::s![..some, ..keys]);
            check_accumulated::<K>(&o, &o_start, p, v_rows, &alpha[..some]);
            check_skipping_zero_weights(kernel, p, v_rows, &alpha[..some], &o_start, &o);
        }
        // The weights read transposed (the backward's Pᵀ·dO): keys × rows.
        let p = ArrayView2::from_shape((rows, stride), &s).unwrap();
        let p_t = p.slice(ndarray::s![.., ..keys]).reversed_axes();
        let rows_as_values = values(rows * width, 5);
        let mut o = vec![0.0; keys * width];
        let ones = vec![1.0; keys];
        kernel.accumulate_values(
            p_t,
            ArrayView2::from_shape((rows, width), &rows_as_values).unwrap(),
            width,
            &ones,
            &mut o,
            ZeroWeights::Multiply,
            ValueRows::Packed,
        );
        for j in 0..keys {
            for c in 0..width {
                let exact: f64 = (0..rows)
                    .map(|r| s[r * stride + j] as f64 * rows_as_values[r * width + c] as f64)
                    .sum();
                assert!(
                    (o[j * width + c] as f64 - exact).abs() < 1e-5 * rows as f64,
                    "{}: transposed o[{j}][{c}]",
                    K::SET
                );
            }
        }
    }
}

/// `o` against `alpha·o_start + p·v` in f64, for the `alpha.len()` rows.
fn check_accumulated<K: Kernel>(
    o: &[f32],
    o_start: &[f32],
    p: ArrayView2<'_, f32>,
    v: ArrayView2<'_, f32>,
    alpha: &[f32],
) {
    let (keys, width) = v.dim();
    for (r, &a) in alpha.iter().enumerate() {
        for c in 0..width {
            let exact: f64 = a as f64 * o_start[r * width + c] as f64
                + (0..keys)
                    .map(|j| p[(r, j)] as f64 * v[(j, c)] as f64)
                    .sum::<f64>();
            assert!(
                (o[r * width + c] as f64 - exact).abs() < 1e-5 * keys as f64,
                "{}: o[{r}][{c}]",
                K::SET
            );
        }
    }
}

/// [`ZeroWeights::Skip`] against [`ZeroWeights::Multiply`] (which gave
/// `o_multiplied`): the same bits on finite values; and with every other
/// key's weights zeroed and its value row made NaN or `±inf`, the bits of
/// multiplying those zero weights with the finite values.
fn check_skipping_zero_weights<K: Kernel>(
    kernel: K,
    p: ArrayView2<'_, f32>,
    v: ArrayView2<'_, f32>,
    alpha: &[f32],
    o_start: &[f32],
    o_multiplied: &[f32],
) {
    let width = v.ncols();
    let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (mut p_holes, mut v_poisoned) = (p.to_owned(), v.to_owned());
    for j in (0..v.nrows()).step_by(2) {
        p_holes.column_mut(j).fill(0.0);
        let poison = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j / 2 % 3];
        v_poisoned.row_mut(j).fill(poison);
    }
    // Rows read in place (decoding) take their own register tiles.
    for value_rows in [ValueRows::Packed, ValueRows::InPlace] {
        let accumulate = |p: ArrayView2<'_, f32>, v: ArrayView2<'_, f32>, zero_weights| {
            let mut o = o_start[..alpha.len() * width].to_vec();
            kernel.accumulate_values(p, v, width, alpha, &mut o, zero_weights, value_rows);
            o
        };
        assert_eq!(
            bits(&accumulate(p, v, ZeroWeights::Skip)),
            bits(o_multiplied),
            "{}, {value_rows:?}: skipping changed finite sums",
            K::SET
        );
        assert_eq!(
            bits(&accumulate(
                p_holes.view(),
                v_poisoned.view(),
                ZeroWeights::Skip
            )),
            bits(&accumulate(p_holes.view(), v, ZeroWeights::Multiply)),
            "{}, {value_rows:?}: a skipped NaN/inf value row changed the sums",
            K::SET
        );
    }
}

#[test]
fn tile_kernels_match_the_formulas() {
    for d in [1, 3, 16, 17, 64, 65] {
        // One row read in place takes up to 16 vectors a pass: 200 columns
        // are 16 + 8 + 1 vectors on AVX2, 272 are 16 + 1 on AVX-512.
        for value_columns in [1, 5, 16, 48, 64, 65, 100, 128, 200, 272] {
            for_each_kernel_set(TileCheck { d, value_columns });
        }
    }
}

/// [`Vector::reduce_sums`] and [`Vector::reduce_maxes`] of `LANES` rows
/// of `LANES` lanes (the rows of `x`, row-major), on one kernel set.
struct ReduceRows<'a> {
    x: &'a [f32],
    sums: &'a mut [f32],
    maxes: &'a mut [f32],
}

impl KernelOp for ReduceRows<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) {
        assert!(self.x.len() >= V::LANES * V::LANES && self.sums.len() >= V::LANES);
        assert!(self.maxes.len() >= V::LANES);
        // SAFETY: the caller guarantees V's instruction set; `x` holds
        // LANES rows of LANES, the outputs a vector each.
        unsafe {
            let rows: Vec<V> = (0..V::LANES)
                .map(|r| V::load(self.x.as_ptr().add(r * V::LANES)))
                .collect();
            V::reduce_sums(&rows).store(self.sums.as_mut_ptr());
            V::reduce_maxes(&rows).store(self.maxes.as_mut_ptr());
        }
    }
}

/// [`Vector::transpose`] of the `LANES × LANES` block `x` (row-major),
/// stored back row by row, on one kernel set.
struct TransposeBlock<'a>(&'a mut [f32]);

impl KernelOp for TransposeBlock<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) {
        let x = self.0;
        assert!(x.len() >= V::LANES * V::LANES);
        // SAFETY: the caller guarantees V's instruction set; `x` holds
        // LANES rows of LANES.
        unsafe {
            let mut rows: Vec<V> = (0..V::LANES)
                .map(|r| V::load(x.as_ptr().add(r * V::LANES)))
                .collect();
            V::transpose(&mut rows);
            for (r, row) in rows.iter().enumerate() {
                row.store(x.as_mut_ptr().add(r * V::LANES));
            }
        }
    }
}

#[test]
fn transpose_moves_every_lane_to_its_mirror_on_every_set() {
    #[derive(Clone)]
    struct Check;
    impl WithKernel for Check {
        type Output = ();
        fn run<K: Kernel>(self, kernel: K) {
            let lanes = K::LANES;
            // Every entry distinct, with a NaN payload and a −0 among them:
            // a transpose moves bits, it does no arithmetic.
            let mut x: Vec<f32> = (0..lanes * lanes).map(|i| i as f32 + 0.5).collect();
            x[lanes * lanes - 1] = f32::from_bits(0x7fc0_1234);
            x[0] = -0.0;
            let before = x.clone();
            kernel.run(TransposeBlock(&mut x));
            for i in 0..lanes {
                for j in 0..lanes {
                    assert_eq!(
                        x[j * lanes + i].to_bits(),
                        before[i * lanes + j].to_bits(),
                        "{}: ({i}, {j})",
                        K::SET
                    );
                }
            }
        }
    }
    for_each_kernel_set(Check);
}

#[test]
fn row_reductions_give_each_rows_sum_and_max_in_its_lane() {
    #[derive(Clone)]
    struct Reduce;
    impl WithKernel for Reduce {
        type Output = ();
        fn run<K: Kernel>(self, kernel: K) {
            let lanes = K::LANES;
            // Rows of different magnitudes, so a lane mix-up shows.
            let x: Vec<f32> = values(lanes * lanes, 11)
                .iter()
                .enumerate()
                .map(|(i, &x)| x + (i / lanes) as f32 * 4.0)
                .collect();
            let (mut sums, mut maxes) = (vec![f32::NAN; lanes], vec![f32::NAN; lanes]);
            kernel.run(ReduceRows {
                x: &x,
                sums: &mut sums,
                maxes: &mut maxes,
            });
            for (r, row) in x.chunks_exact(lanes).enumerate() {
                let sum: f64 = row.iter().map(|&x| f64::from(x)).sum();
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let bound = 1e-6 * row.iter().map(|x| f64::from(x.abs())).sum::<f64>();
                assert!(
                    (f64::from(sums[r]) - sum).abs() <= bound,
                    "{}: sum of row {r}",
                    K::SET
                );
                assert_eq!(maxes[r], max, "{}: max of row {r}", K::SET);
            }
        }
    }
    for_each_kernel_set(Reduce);
}

#[test]
fn softmax_gradient_is_the_plain_formula_and_exactly_zero_where_p_is() {
    #[derive(Clone)]
    struct Gradient;
    impl WithKernel for Gradient {
        type Output = ();
        fn run<K: Kernel>(self, kernel: K) {
            let (rows, keys) = (3, 2 * K::KEY_PANEL);
            let weights = values(rows * keys, 7);
            let d_p = values(rows * keys, 8);
            // Every third weight masked (0), under a non-finite `dP` on
            // alternate masked ones; the smallest normal weight kept.
            let p: Vec<f32> = (0..rows * keys)
                .map(|i| match i % 6 {
                    0 | 3 => 0.0,
                    4 => f32::MIN_POSITIVE,
                    _ => weights[i].abs(),
                })
                .collect();
            let mut d_s: Vec<f32> = (0..rows * keys)
                .map(|i| match i % 6 {
                    0 => f32::NAN,
                    3 => f32::INFINITY,
                    _ => d_p[i],
                })
                .collect();
            let delta = [0.25, -1.5, 0.0];
            let expected: Vec<f32> = (0..rows * keys)
                .map(|i| match p[i] {
                    0.0 => 0.0,
                    w => w * (d_s[i] - delta[i / keys]),
                })
                .collect();
            kernel.softmax_gradient(&p, &mut d_s, keys, &delta);
            for (i, (got, want)) in d_s.iter().zip(&expected).enumerate() {
                assert_eq!(got.to_bits(), want.to_bits(), "{}: entry {i}", K::SET);
            }
        }
    }
    for_each_kernel_set(Gradient);
}

#[test]
fn a_row_that_sees_nothing_gives_zeros_and_alpha_one() {
    #[derive(Clone)]
    struct AllMasked;
    impl WithKernel for AllMasked {
        type Output = ();
        fn run<K: Kernel>(self, kernel: K) {
            let keys = K::KEY_PANEL;
            for precision in [WeightPrecision::Full, WeightPrecision::Half] {
                let mut s = vec![f32::NEG_INFINITY; keys];
                let (mut max, mut sum, mut alpha) =
                    (vec![f32::NEG_INFINITY], vec![0.0], vec![f32::NAN]);
                kernel.softmax_rows(SoftmaxRows {
                    s: &mut s,
                    keys,
                    s_stride: keys,
                    max: &mut max,
                    sum: &mut sum,
                    alpha: &mut alpha,
                    precision,
                    scale: 0.5,
                });
                assert!(s.iter().all(|&p| p == 0.0), "{} {precision:?}", K::SET);
                assert_eq!(
                    (max[0], sum[0], alpha[0]),
                    (f32::NEG_INFINITY, 0.0, 1.0),
                    "{} {precision:?}",
                    K::SET
                );
            }
        }
    }
    for_each_kernel_set(AllMasked);
}

#[test]
fn kernel_sets_list_and_parse_themselves() {
    let all = KernelSet::all();
    assert!(
        all.windows(2).all(|pair| pair[0] < pair[1]),
        "slowest first"
    );
    for &set in all {
        assert_eq!(set.name().parse::<KernelSet>(), Ok(set));
        assert_eq!(
            format!(" {} ", set.name().to_uppercase()).parse::<KernelSet>(),
            Ok(set)
        );
    }
    let error = "sse9".parse::<KernelSet>().unwrap_err();
    assert!(
        error.to_string().contains("scalar, avx2, avx512, neon"),
        "{error}"
    );
    let available = available_kernel_sets();
    assert!(
        available
            .iter()
            .all(|set| all.contains(set) && set.is_available())
    );
    assert_eq!(available[0], KernelSet::Scalar);
}

#[test]
fn with_kernel_set_forces_a_set_on_this_thread_and_restores_it() {
    let selected = selected_kernel_set().unwrap();
    assert_eq!(current_kernel_set(), Ok(selected));
    for set in available_kernel_sets() {
        let seen = with_kernel_set(set, || {
            let inner = with_kernel_set(KernelSet::Scalar, current_kernel_set).unwrap();
            assert_eq!(inner, Ok(KernelSet::Scalar), "nested");
            // Other threads keep their own choice.
            let elsewhere = std::thread::spawn(current_kernel_set).join().unwrap();
            assert_eq!(elsewhere, Ok(selected));
            current_kernel_set()
        });
        assert_eq!(seen, Ok(Ok(set)));
        assert_eq!(current_kernel_set(), Ok(selected), "restored");
    }
    // Restored when the closure panics, too.
    let unwound = std::panic::catch_unwind(|| {
        with_kernel_set(KernelSet::Scalar, || panic!("in the closure"))
    });
    assert!(unwound.is_err());
    assert_eq!(current_kernel_set(), Ok(selected), "restored after a panic");
}

#[test]
fn with_kernel_set_refuses_a_set_this_cpu_lacks() {
    // Every CPU lacks one architecture's sets.
    let missing = *KernelSet::all()
        .iter()
        .find(|set| !set.is_available())
        .expect("x86-64 and aarch64 sets are never all available");
    let mut ran = false;
    let result = with_kernel_set(missing, || ran = true);
    assert_eq!(
        result.unwrap_err().kind(),
        crate::error::ErrorKind::UnsupportedKernel
    );
    assert!(!ran);
    assert_eq!(current_kernel_set(), selected_kernel_set());
}

/// `tanh` in place over whole vectors (the tail is left as it is).
struct TanhInPlace<'a>(&'a mut [f32]);

impl KernelOp for TanhInPlace<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) {
        for chunk in self.0.chunks_exact_mut(V::LANES) {
            // SAFETY: the caller guarantees V's instruction set; the chunk
            // holds LANES f32s.
            unsafe { super::tanh::tanh(V::load(chunk.as_ptr())).store(chunk.as_mut_ptr()) }
        }
    }
}

#[derive(Clone)]
struct Tanh(Vec<f32>);

impl WithKernel for Tanh {
    type Output = (KernelSet, Vec<f32>);
    fn run<K: Kernel>(mut self, kernel: K) -> Self::Output {
        kernel.run(TanhInPlace(&mut self.0));
        (K::SET, self.0)
    }
}

/// The largest ulp error of `tanh` over the `f32`s of one sign whose bits
/// run from `first` to `last`, every `step`-th one.
fn max_tanh_ulp_error(set: KernelSet, first: u32, last: u32, step: usize) -> (f64, f32) {
    let mut worst = (0.0, 0.0);
    let inputs: Vec<u32> = (first..=last).step_by(step).collect();
    for chunk in inputs.chunks(1 << 16) {
        let mut x: Vec<f32> = chunk.iter().map(|&bits| f32::from_bits(bits)).collect();
        // Whole vectors only: pad with zeros.
        x.resize(x.len().div_ceil(16) * 16, 0.0);
        let (ran, y) = with_kernel(set, Tanh(x.clone())).unwrap();
        assert_eq!(ran, set);
        for (&x, &y) in x.iter().zip(&y) {
            let error = ulp_error(y, (x as f64).tanh());
            if error > worst.0 {
                worst = (error, x);
            }
        }
    }
    worst
}

/// Every `step`-th `f32` of both signs up to 10 in magnitude (beyond, tanh
/// is ±1 in `f32` and the formula gives exactly that).
fn max_tanh_error_both_signs(set: KernelSet, step: usize) -> (f64, f32) {
    let ten = 10f32.to_bits();
    let positive = max_tanh_ulp_error(set, 0, ten, step);
    let negative = max_tanh_ulp_error(set, MINUS_ZERO, MINUS_ZERO | ten, step);
    if positive.0 >= negative.0 {
        positive
    } else {
        negative
    }
}

#[test]
fn tanh_is_within_three_ulp() {
    for set in available_kernel_sets() {
        let (error, at) = max_tanh_error_both_signs(set, 1009);
        assert!(error <= 3.0, "{set}: {error} ulp at {at}");
    }
}

/// Every `f32` in [−10, 10]: about 2.2e9 inputs per kernel set. Run it in
/// release: `cargo test --release --lib -- --ignored tanh_is_within_three_ulp_exhaustively`.
#[test]
#[ignore = "exhaustive: run in release"]
fn tanh_is_within_three_ulp_exhaustively() {
    for set in available_kernel_sets() {
        let (error, at) = max_tanh_error_both_signs(set, 1);
        println!("{set}: max tanh error {error:.3} ulp at {at:e}");
        assert!(error <= 3.0, "{set}: {error} ulp at {at}");
    }
}

#[test]
fn tanh_special_values() {
    let mut x = vec![
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        1e30,
        -1e30,
        10.0,
        -10.0,
        0.6,
        f32::from_bits(1),
        -0.599_999_9,
    ];
    x.resize(16, 0.0);
    for (set, (_, y)) in for_each_kernel_set(Tanh(x.clone())) {
        assert_eq!((y[0], y[1]), (1.0, -1.0), "{set}: tanh(±inf)");
        assert!(y[2].is_nan(), "{set}: tanh(NaN)");
        assert_eq!((y[3], y[4]), (0.0, 0.0), "{set}: tanh(±0)");
        assert_eq!((y[5], y[6]), (1.0, -1.0), "{set}: saturates");
        for i in 7..12 {
            let error = ulp_error(y[i], (x[i] as f64).tanh());
            assert!(
                error <= 3.0,
                "{set}: tanh({}) = {} ({error} ulp)",
                x[i],
                y[i]
            );
        }
    }
}

/// The half-precision loads and the kernels that read half-precision rows
/// in place (a `bf16`/`f16` KV cache's decoding step).
#[cfg(feature = "half")]
mod half_rows {
    use half::{bf16, f16};
    use ndarray::{Array2, ArrayView2};

    use super::{for_each_kernel_set, values};
    use crate::simd::kernel::KernelOp;
    use crate::simd::vector::{Load, Vector};
    use crate::simd::{Kernel, ValueRows, WithKernel, ZeroWeights};

    /// `dst = src` as `f32`, through [`Load::load`], `V::LANES` at a time
    /// (`src.len()` a multiple of every set's lanes).
    struct LoadAll<'a, E>(&'a [E], &'a mut [f32]);

    impl<E: Load> KernelOp for LoadAll<'_, E> {
        type Output = ();

        #[inline(always)]
        unsafe fn run<
            V: Vector,
            const ROWS: usize,
            const KEY_VECTORS: usize,
            const VALUE_VECTORS: usize,
        >(
            self,
        ) {
            let LoadAll(src, dst) = self;
            assert!(src.len() == dst.len() && src.len().is_multiple_of(V::LANES));
            for i in (0..src.len()).step_by(V::LANES) {
                // SAFETY: the caller guarantees V's instruction set, and
                // `i + LANES ≤ len` for both slices.
                unsafe { E::load::<V>(src.as_ptr().add(i)).store(dst.as_mut_ptr().add(i)) };
            }
        }
    }

    #[derive(Clone)]
    struct Widened<'a, E>(&'a [E]);

    impl<E: Load> WithKernel for Widened<'_, E> {
        type Output = Vec<f32>;
        fn run<K: Kernel>(self, kernel: K) -> Vec<f32> {
            let mut dst = vec![0.0; self.0.len()];
            kernel.run(LoadAll(self.0, &mut dst));
            dst
        }
    }

    /// Every bit pattern, widened by every set, against `half`'s `to_f32`:
    /// the same bits, but that a signaling NaN may stay signaling (the
    /// first arithmetic on it quiets it).
    fn check_every_bit_pattern<E: Load>(from_bits: fn(u16) -> E, to_f32: fn(E) -> f32) {
        let all: Vec<E> = (0..=u16::MAX).map(from_bits).collect();
        for (set, got) in for_each_kernel_set(Widened(&all)) {
            for (bits, (&x, got)) in (0..=u16::MAX).zip(all.iter().zip(got)) {
                let expected = to_f32(x);
                assert!(
                    got.to_bits() == expected.to_bits() || (got.is_nan() && expected.is_nan()),
                    "{set}: {bits:#06x} widened to {got:e}, half gives {expected:e}"
                );
            }
        }
    }

    #[test]
    fn bf16_loads_widen_every_bit_pattern_exactly() {
        check_every_bit_pattern(bf16::from_bits, bf16::to_f32);
    }

    #[test]
    fn f16_loads_widen_every_bit_pattern_exactly() {
        // Subnormals, both infinities and both NaN kinds are all in there.
        check_every_bit_pattern(f16::from_bits, f16::to_f32);
    }

    /// Q·Kᵀ and P·V on half-precision rows read in place, against the same
    /// kernels on the rows widened to `f32` first: the loads are exact and
    /// the sums run in the same order, so the bits must match.
    #[derive(Clone)]
    struct SameAsWidened<E> {
        d: usize,
        width: usize,
        from_f32: fn(f32) -> E,
        to_f32: fn(E) -> f32,
    }

    impl<E: Load + num_traits::Float> WithKernel for SameAsWidened<E> {
        type Output = ();
        fn run<K: Kernel>(self, kernel: K) {
            let (d, width) = (self.d, self.width);
            let (rows, keys) = (3, 2 * K::KEY_PANEL + 5);
            let half = |x: Vec<f32>| x.into_iter().map(self.from_f32).collect::<Vec<E>>();
            let q = values(rows * d, 11);
            let k = half(values(keys * d, 12));
            let mut v = Array2::from_shape_vec((keys, width), half(values(keys * width, 13)))
                .expect("keys × width values");
            let k = ArrayView2::from_shape((keys, d), &k).expect("keys × d");
            assert_eq!(
                score_bits(kernel, &q, k),
                score_bits(kernel, &q, k.mapv(self.to_f32).view()),
                "{}: scores",
                K::SET
            );

            // Weights with holes, over value rows with NaN and infinities
            // behind the holes (skipped) or finite ones (multiplied).
            let mut p =
                Array2::from_shape_vec((rows, keys), values(rows * keys, 14)).expect("rows × keys");
            p.column_mut(1).fill(0.0);
            p.column_mut(keys - 2).fill(0.0);
            let o_start = values(rows * width, 15);
            for poisoned in [false, true] {
                if poisoned {
                    v.row_mut(1).fill(E::nan());
                    v.row_mut(keys - 2).fill(E::infinity());
                }
                let zero = if poisoned {
                    ZeroWeights::Skip
                } else {
                    ZeroWeights::Multiply
                };
                for rows_at in [ValueRows::Packed, ValueRows::InPlace] {
                    let run = Accumulate {
                        p: p.view(),
                        o_start: &o_start,
                        zero,
                        rows_at,
                    };
                    assert_eq!(
                        run.bits(kernel, v.view()),
                        run.bits(kernel, v.mapv(self.to_f32).view()),
                        "{}: values ({zero:?}, {rows_at:?})",
                        K::SET
                    );
                }
            }
        }
    }

    /// The bits of `q·kᵀ` by `row_scores`, for keys `k` of any row type.
    fn score_bits<K: Kernel, E: Load>(kernel: K, q: &[f32], k: ArrayView2<'_, E>) -> Vec<u32> {
        let (keys, d) = k.dim();
        let mut s = vec![f32::NAN; q.len() / d * keys];
        kernel.row_scores(q, d, k, &mut s, keys);
        s.iter().map(|x| x.to_bits()).collect()
    }

    /// One `accumulate_values` call but for the value rows and their type.
    struct Accumulate<'a> {
        p: ArrayView2<'a, f32>,
        o_start: &'a [f32],
        zero: ZeroWeights,
        rows_at: ValueRows,
    }

    impl Accumulate<'_> {
        /// The bits of `O` after the call on value rows `v`.
        fn bits<K: Kernel, E: Load>(&self, kernel: K, v: ArrayView2<'_, E>) -> Vec<u32> {
            const ALPHA: [f32; 3] = [0.5, 1.0, 0.25];
            let mut o = self.o_start.to_vec();
            let (p, width) = (self.p, v.ncols());
            kernel.accumulate_values(p, v, width, &ALPHA, &mut o, self.zero, self.rows_at);
            o.iter().map(|x| x.to_bits()).collect()
        }
    }

    #[test]
    fn kernels_read_half_rows_as_their_widened_f32() {
        for d in [16, 64, 128] {
            for width in [16, 48, 128] {
                for_each_kernel_set(SameAsWidened {
                    d,
                    width,
                    from_f32: bf16::from_f32,
                    to_f32: bf16::to_f32,
                });
                for_each_kernel_set(SameAsWidened {
                    d,
                    width,
                    from_f32: f16::from_f32,
                    to_f32: f16::to_f32,
                });
            }
        }
    }
}
