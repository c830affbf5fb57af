//! The softmax kernels over a tile of scores, row by row, in place:
//!
//! - [`SoftmaxRows`]: the forward's online-softmax pass (running max, `exp`,
//!   running sum, and the factor `α` that rescales what was accumulated);
//! - [`ExpRowsShifted`]: the backward's weights, recomputed from the
//!   forward's log-sum-exp;
//! - [`SoftmaxGradient`]: the backward's `dS = P ∘ (dP − D)`.
//!
//! Masked scores are `−inf` on entry and leave as exactly 0; a row that has
//! seen no key yet becomes 0, never NaN.

use super::exp::{exp, exp_for_half_results, exp_of_nonpositive};
use super::kernel::KernelOp;
use super::vector::Vector;

/// The online-softmax pass over the first `keys` columns (a multiple of
/// `LANES`) of the `max.len()` rows of `s` (row stride `s_stride`), whose
/// scores are `c·s[j]` for the positive factor `c = scale`:
///
/// ```text
/// m' = max(m, c·max_j s[j]);  α = e^(m − m');  s[j] ← e^(c·s[j] − m');  ℓ' = α·ℓ + Σ_j s[j]
/// ```
///
/// `max`, `sum` and `alpha` hold `m`, `ℓ` and `α` per row. A row whose `m'`
/// is `−inf` (nothing visible yet) gets `s = 0` and `α = 1`, never NaN.
/// `precision` says how exact the weights must be.
///
/// `scale` is 1 where `s` is scaled already (the same bits as a pass
/// without it: `c·s − m'` is one fused multiply-add, exact in its
/// product). A positive `c` keeps each row's maximum where it was, and
/// `c·(−inf) = −inf` keeps a masked score masked.
pub(crate) struct SoftmaxRows<'a> {
    pub s: &'a mut [f32],
    pub keys: usize,
    pub s_stride: usize,
    pub max: &'a mut [f32],
    pub sum: &'a mut [f32],
    pub alpha: &'a mut [f32],
    pub precision: WeightPrecision,
    pub scale: f32,
}

/// How exact a softmax's weights must be: as exact as what is made of
/// them keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WeightPrecision {
    /// For an `f32` result: within 2 ulp of `e^x` ([`exp_of_nonpositive`]).
    Full,
    /// For a result rounded to a half type next: `bf16` weights in `P·V`
    /// (the native bf16 prefill), or a `bf16`/`f16` output. Within 6e-6 of
    /// `e^x` ([`exp_for_half_results`]), three instructions a vector
    /// cheaper, against a rounding of 2⁻⁹ (`bf16`) or 2⁻¹² (`f16`).
    #[cfg_attr(not(feature = "half"), allow(dead_code))]
    Half,
}

impl WeightPrecision {
    /// The looser of the two: a result rounded to half precision anywhere
    /// needs no more than `Half`.
    pub(crate) fn looser(self, other: Self) -> Self {
        if self == Self::Half || other == Self::Half {
            Self::Half
        } else {
            Self::Full
        }
    }
}

impl KernelOp for SoftmaxRows<'_> {
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
        let SoftmaxRows {
            s,
            keys,
            s_stride,
            max,
            sum,
            alpha,
            precision,
            scale,
        } = self;
        let rows = max.len();
        assert!(sum.len() == rows && alpha.len() == rows);
        assert!(scale > 0.0, "a positive factor keeps the maxima");
        assert!(keys.is_multiple_of(V::LANES) && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        let s = s.as_mut_ptr();
        const { assert!(V::LANES <= 16, "the arrays below hold one vector") };
        // Rows go `LANES` at a time, so that their maxima and sums are
        // reduced across lanes together ([`Vector::reduce_maxes`]), and
        // `α`, `m` and `ℓ` are updated as vectors: a reduction and a
        // scalar `exp` per row were chains of dependent operations that
        // dominated the pass when a row is only a few vectors long.
        for first in (0..rows).step_by(V::LANES) {
            let n = V::LANES.min(rows - first);
            // SAFETY (all): the caller guarantees V's instruction set (and
            // `f32`'s needs none); rows `first..first + n` have `keys`
            // entries inside `s`, as checked above; each array holds a
            // whole vector (LANES ≤ 16).
            unsafe {
                // Pass 1: each row's new maximum m' and α = e^(m − m').
                let mut row_maxima = [V::splat(f32::NEG_INFINITY); 16];
                for (r, row_max) in row_maxima.iter_mut().enumerate().take(n) {
                    let row = s.add((first + r) * s_stride);
                    for j in (0..keys).step_by(V::LANES) {
                        *row_max = V::load(row.add(j)).max(*row_max);
                    }
                }
                let mut old = [f32::NEG_INFINITY; 16];
                old[..n].copy_from_slice(&max[first..first + n]);
                let old = V::load(old.as_ptr());
                let c = V::splat(scale);
                let new = V::reduce_maxes(&row_maxima[..V::LANES]).mul(c).max(old);
                let (mut new_max, mut factor) = ([0.0f32; 16], [0.0f32; 16]);
                new.store(new_max.as_mut_ptr());
                exp(old.sub(new)).store(factor.as_mut_ptr());
                max[first..first + n].copy_from_slice(&new_max[..n]);
                alpha[first..first + n].copy_from_slice(&factor[..n]);

                // Pass 2: the weights and the running sums.
                let mut row_sums = [V::splat(0.0); 16];
                for (r, row_sum) in row_sums.iter_mut().enumerate().take(n) {
                    let row = s.add((first + r) * s_stride);
                    if new_max[r] == f32::NEG_INFINITY {
                        // Nothing finite here, but a NaN score must stick:
                        // the sum of the lanes is NaN exactly when one is
                        // NaN (the rest are −inf), and a NaN ℓ stays NaN
                        // through every later tile (α·NaN), so the row
                        // ends NaN, as in `core`. Else ℓ stays: α = 1
                        // ((−inf) − (−inf) made it NaN above) and the row
                        // adds 0.
                        let mut poison = V::splat(0.0);
                        for j in (0..keys).step_by(V::LANES) {
                            poison = poison.add(V::load(row.add(j)));
                            V::splat(0.0).store(row.add(j));
                        }
                        if poison.reduce_sum().is_nan() {
                            *row_sum = V::splat(f32::NAN);
                        }
                        alpha[first + r] = 1.0;
                        continue;
                    }
                    let shift = V::splat(-new_max[r]);
                    // `1·s + shift` is `s + shift` to the bit: an add, not
                    // a multiply-add, when the scores come scaled. On Zen 4
                    // adds run beside the two FMA pipes, which the `exp`
                    // keeps busy.
                    *row_sum = match (precision, scale == 1.0) {
                        (WeightPrecision::Full, true) => {
                            weights_row::<V, false, false>(row, keys, c, shift)
                        }
                        (WeightPrecision::Full, false) => {
                            weights_row::<V, false, true>(row, keys, c, shift)
                        }
                        (WeightPrecision::Half, true) => {
                            weights_row::<V, true, false>(row, keys, c, shift)
                        }
                        (WeightPrecision::Half, false) => {
                            weights_row::<V, true, true>(row, keys, c, shift)
                        }
                    };
                }
                // ℓ' = α·ℓ + Σ_j s[j]; α = e^(−inf) = 0 on a row's first
                // visible tile.
                let (mut scale, mut sums) = ([0.0f32; 16], [0.0f32; 16]);
                scale[..n].copy_from_slice(&alpha[first..first + n]);
                sums[..n].copy_from_slice(&sum[first..first + n]);
                let sums_v = V::load(scale.as_ptr())
                    .mul(V::load(sums.as_ptr()))
                    .add(V::reduce_sums(&row_sums[..V::LANES]));
                sums_v.store(sums.as_mut_ptr());
                sum[first..first + n].copy_from_slice(&sums[..n]);
            }
        }
    }
}

/// `row[j] ← e^(c·row[j] + shift)` for the `keys` entries of `row` (a
/// multiple of `LANES`, every exponent ≤ 0, or above it by the rounding
/// of `m = fl(c·max)`, or NaN), with the `exp` that
/// `FOR_HALF` asks for; returns the weights' sum in each lane. Without
/// `SCALED`, `c` is 1 and is not multiplied in.
///
/// # Safety
/// The CPU has `V`'s instruction set; `row` has `keys` entries.
#[inline(always)]
unsafe fn weights_row<V: Vector, const FOR_HALF: bool, const SCALED: bool>(
    row: *mut f32,
    keys: usize,
    c: V,
    shift: V,
) -> V {
    // SAFETY: the caller's; each vector lies inside the row's `keys`.
    unsafe {
        let mut sum = V::splat(0.0);
        for j in (0..keys).step_by(V::LANES) {
            let s = V::load(row.add(j));
            let x = if SCALED {
                s.mul_add(c, shift)
            } else {
                s.add(shift)
            };
            let p = if FOR_HALF {
                exp_for_half_results(x)
            } else {
                exp_of_nonpositive(x)
            };
            p.store(row.add(j));
            sum = sum.add(p);
        }
        sum
    }
}

/// `s[r][j] ← e^(s[r][j] − shift[r])` over the first `keys` columns (a
/// multiple of `LANES`) of the `shift.len()` rows of `s` (row stride
/// `s_stride`): the weights recomputed from the forward's log-sum-exp in
/// the backward pass. A row whose shift is `−inf` saw no key and becomes 0.
pub(crate) struct ExpRowsShifted<'a> {
    pub s: &'a mut [f32],
    pub keys: usize,
    pub s_stride: usize,
    pub shift: &'a [f32],
}

impl KernelOp for ExpRowsShifted<'_> {
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
        let ExpRowsShifted {
            s,
            keys,
            s_stride,
            shift,
        } = self;
        let rows = shift.len();
        assert!(keys.is_multiple_of(V::LANES) && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        let s = s.as_mut_ptr();
        for (r, &shift) in shift.iter().enumerate() {
            // SAFETY: the caller guarantees V's instruction set; row `r`'s
            // `keys` entries are inside `s`, as checked above.
            unsafe {
                let row = s.add(r * s_stride);
                for j in (0..keys).step_by(V::LANES) {
                    let p = if shift == f32::NEG_INFINITY {
                        V::splat(0.0)
                    } else {
                        exp(V::load(row.add(j)).sub(V::splat(shift)))
                    };
                    p.store(row.add(j));
                }
            }
        }
    }
}

/// `d_s[r][j] ← p[r][j]·(d_s[r][j] − delta[r])` over the `delta.len()`
/// rows of `keys` columns (a multiple of `LANES`) of `p` and `d_s`: the
/// softmax's gradient `dS = P ∘ (dP − D)` from `dP` (in `d_s` on entry) and
/// `D = rowsum(dO ∘ O)`. Where `p` is 0 (a masked or vanished weight) the
/// result is exactly 0, whatever `dP` is: a NaN or `±inf` there (a masked
/// key's non-finite value row) must not reach `dQ` and `dK`. So is a
/// weight below the smallest normal number (see the threshold below),
/// whose term would be below 10⁻³⁷.
pub(crate) struct SoftmaxGradient<'a> {
    pub p: &'a [f32],
    pub d_s: &'a mut [f32],
    pub keys: usize,
    pub delta: &'a [f32],
}

impl KernelOp for SoftmaxGradient<'_> {
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
        let SoftmaxGradient {
            p,
            d_s,
            keys,
            delta,
        } = self;
        let len = delta.len() * keys;
        assert!(keys.is_multiple_of(V::LANES) && p.len() >= len && d_s.len() >= len);
        // Weights are 0 or at least about 2^-127 (`exp` returns 0 below the
        // normal range, and its smallest results are barely subnormal), so
        // "below the smallest normal" finds the zeros; comparing with 0
        // itself would miss them where the caller's thread treats the
        // subnormal threshold as 0 (DAZ), and 0·NaN is NaN.
        let threshold = f32::MIN_POSITIVE;
        let (p, d_s) = (p.as_ptr(), d_s.as_mut_ptr());
        for (r, &delta) in delta.iter().enumerate() {
            // SAFETY: the caller guarantees V's instruction set; row `r`'s
            // `keys` entries are inside `p` and `d_s`, as checked above.
            unsafe {
                let delta = V::splat(delta);
                let (p, d_s) = (p.add(r * keys), d_s.add(r * keys));
                for j in (0..keys).step_by(V::LANES) {
                    let weight = V::load(p.add(j));
                    let gradient = weight.mul(V::load(d_s.add(j)).sub(delta));
                    weight
                        .zero_where_less(V::splat(threshold), gradient)
                        .store(d_s.add(j));
                }
            }
        }
    }
}
