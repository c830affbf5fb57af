//! The vectorised `e^x` of the softmax, and its constants.
//!
//! e^x = 2^n · e^r with n = round(x / ln 2) and r = x − n·ln 2 in
//! [−ln2/2, ln2/2]; e^r is a degree-6 polynomial, scaled by 2^n in the
//! exponent bits (`Vector::scale_by_exp2`). Measured maximum error on [−87.3, 0]: see the doc of
//! [`exp`] and the test `exp_is_within_two_ulp_exhaustively`.
//!
//! The softmax's inputs are never positive (but for a rounding when it
//! applies the scale itself), so it calls
//! [`exp_of_nonpositive`] (the same bits without the clamp), or, where
//! its result is rounded to a half type next, [`exp_for_half_results`]
//! (a degree-4 polynomial, to 6e-6).

use super::vector::Vector;

/// Below `ln(2^-126)`, e^x is subnormal in `f32`; `exp` returns 0 there, so
/// `2^n` never leaves the normal range and `−inf` gives 0 without a NaN.
pub(crate) const EXP_MIN_INPUT: f32 = -87.336_55;
/// Above `ln(f32::MAX) ≈ 88.72`, e^x is `+inf`. Inputs are clamped here, so
/// `n ≤ 128` and `2^n` is built without integer overflow: `2^128` is the
/// bit pattern of `+inf`, and the result is `+inf` for any larger input
/// (a backward's log-sum-exp of −1e30 from a user, say).
const EXP_MAX_INPUT: f32 = 88.75;
/// log2(e): x·LOG2_E rounded is `n`.
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cody and Waite): LN2_HI has only 9 significant bits, so
/// `n·LN2_HI` is exact for every `n` here, with or without a fused
/// multiply-add, and `x − n·LN2_HI` loses nothing.
const LN2_HI: f32 = 0.693_359_4;
/// ln 2 − LN2_HI, the rest of ln 2.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding 1.5·2^23 rounds a float of magnitude < 2^22 to a whole number
/// (round-half-even in the default rounding mode); subtracting it back gives
/// that whole number as a float.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Polynomial for e^r on [−ln2/2, ln2/2], coefficients of r^0 … r^6: the
/// constant is exactly 1 (so `exp(0) = 1`), the rest minimise the largest
/// error in ulps (Lawson's algorithm in f64; 0.16 ulp once rounded to f32).
///
/// Degree 6, not 5: the best degree-5 fit, coefficients tuned after rounding,
/// still measured 2.015 ulp over every input, past the 2 ulp bound. The
/// sixth degree costs one fused multiply-add per vector.
const EXP_POLY: [f32; 7] = [
    1.0,
    1.0,
    0.499_999_9,
    0.166_664_48,
    0.041_668_534,
    0.008_373_16,
    0.001_381_587,
];

/// `e^x` in every lane, for `x ≤ 0` (and up to 88.7; `+inf` above).
///
/// Measured maximum error 1.02 ulp against `e^x` computed in f64, over every
/// `f32` in [−87.3, 0], on every kernel set (the exhaustive test
/// `exp_is_within_two_ulp_exhaustively`, which asserts ≤ 2 ulp). Below
/// [`EXP_MIN_INPUT`] the result is 0, so `exp(−inf) = 0` with no
/// intermediate NaN; NaN gives NaN.
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
pub(crate) unsafe fn exp<V: Vector>(x: V) -> V {
    // SAFETY: the caller guarantees V's instruction set. `min` keeps a NaN
    // in its second operand, so NaN goes through.
    unsafe { exp_of_nonpositive(V::splat(EXP_MAX_INPUT).min(x)) }
}

/// [`exp`] without its clamp from above, for inputs known to be at most
/// [`EXP_MAX_INPUT`] (or NaN): the softmax's shifted scores `c·s − m`,
/// never positive but for a rounding. The same bits as [`exp`] for every
/// such input; two instructions fewer a vector.
///
/// Lanes below [`EXP_MIN_INPUT`] (`−inf` among them) reduce to numbers
/// that mean nothing, even NaN, and the last step replaces them with 0:
/// nothing clamps them first.
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
pub(crate) unsafe fn exp_of_nonpositive<V: Vector>(x: V) -> V {
    // SAFETY: the caller guarantees V's instruction set, and only register
    // operations follow.
    unsafe {
        let magic = V::splat(ROUND_MAGIC);
        let n = x.mul_add(V::splat(LOG2_E), magic).sub(magic);
        let r = n.mul_add(V::splat(-LN2_HI), x);
        let r = n.mul_add(V::splat(-LN2_LO), r);
        let mut p = V::splat(EXP_POLY[6]);
        for &c in EXP_POLY[..6].iter().rev() {
            p = p.mul_add(r, V::splat(c));
        }
        x.zero_where_less(V::splat(EXP_MIN_INPUT), p.scale_by_exp2(n))
    }
}

/// Polynomial for e^r on [−ln2/2, ln2/2] to a relative error of 2.7e-6
/// once rounded to `f32` (Lawson's algorithm in f64, as [`EXP_POLY`]):
/// for results rounded to a half type (a relative step of 2⁻⁸ or 2⁻¹¹).
const EXP_POLY_FOR_HALF: [f32; 5] = [
    0.999_999_3,
    0.999_963_4,
    0.500_043_6,
    0.167_909_07,
    0.041_458_607,
];

/// `e^x` for `x ≤ 0` (or NaN; a rounding above 0 is as good), to a
/// relative error of 6e-6 (measured by
/// `exp_for_half_results_is_within_its_bound`): for softmax weights whose
/// result is rounded to a half type next (`bf16` weights, or a `bf16` or
/// `f16` output), a rounding of up to 2⁻⁹ or 2⁻¹² (2e-3, 2.4e-4) that
/// this error is lost in. [`exp_of_nonpositive`] with a
/// degree-4 polynomial and `ln 2` in one constant (its rounding,
/// `|n|·2.4e-8`, is at most 3e-6 for `n ≥ −126`): three instructions
/// fewer a vector. `−inf` gives 0 and NaN gives NaN, as there.
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
pub(crate) unsafe fn exp_for_half_results<V: Vector>(x: V) -> V {
    // SAFETY: the caller guarantees V's instruction set, and only register
    // operations follow.
    unsafe {
        let magic = V::splat(ROUND_MAGIC);
        let n = x.mul_add(V::splat(LOG2_E), magic).sub(magic);
        let r = n.mul_add(V::splat(-std::f32::consts::LN_2), x);
        let mut p = V::splat(EXP_POLY_FOR_HALF[4]);
        for &c in EXP_POLY_FOR_HALF[..4].iter().rev() {
            p = p.mul_add(r, V::splat(c));
        }
        x.zero_where_less(V::splat(EXP_MIN_INPUT), p.scale_by_exp2(n))
    }
}
