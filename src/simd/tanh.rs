//! The vectorised `tanh` of logit softcapping, and the softcap kernel.
//!
//! ```text
//! |x| < 0.6:  tanh x = x + x·u·P(u),  u = x²,  P of degree 5 (odd Taylor-like, fitted)
//! otherwise:  tanh x = 1 − 2/(e^(2x) + 1)
//! ```
//!
//! Near 0 the second form loses bits to cancellation (`1 − 2/(e^(2x)+1)`
//! subtracts two numbers close to 1), hence the polynomial there. Above
//! `|x| ≈ 9` the second form is exactly ±1; `±inf` gives ±1 and NaN gives
//! NaN. Measured maximum error: see [`tanh`] and the tests
//! `tanh_is_within_three_ulp` (sampled, every run) and
//! `tanh_is_within_three_ulp_exhaustively` (every `f32` in [−10, 10]).

use super::exp::exp;
use super::kernel::KernelOp;
use super::vector::Vector;

/// Below this `x²` the polynomial is used (`0.6²`).
const SMALL_SQUARED: f32 = 0.36;
/// The polynomial's input is clamped to `±SMALL_CLAMP`, a little above
/// `0.6` (so rounding of `x²` near the threshold never clamps an input the
/// polynomial should see), where the fit still holds; lanes of the other
/// form are then finite on both sides and the blend cannot make a NaN.
const SMALL_CLAMP: f32 = 0.625;
/// `P(u)`'s coefficients of `u^0 … u^5`: a least-squares fit in relative
/// error of `(tanh x / x − 1)/u` on `|x| ≤ 0.625` (0.72 ulp in an f32
/// simulation; the constant is −1/3 rounded).
const TANH_POLY: [f32; 6] = [
    -0.333_333_3,
    0.133_332_04,
    -0.053_946_678,
    0.021_700_382,
    -0.008_176_825,
    0.002_142_576_5,
];

/// `tanh x` in every lane.
///
/// Measured maximum error 1.43 ulp against `tanh` in f64 over every
/// `f32` in [−10, 10] (2.2e9 inputs), on the scalar, AVX2 and AVX-512
/// sets, at x = 0.6021 just above the switch, where `2/(e^(2x)+1)` is
/// about 0.46 (the exhaustive test asserts ≤ 3 ulp; the polynomial
/// region simulated at 0.72 ulp).
///
/// Costs: a vector whose lanes are all below the switch point, as softcapped
/// scores mostly are (Gemma 2 caps at 50, so `|s| < 30`), takes the
/// polynomial alone, about 10 instructions. Any lane at or past the switch
/// (or NaN) makes the vector compute both forms and blend them, about 30:
/// a second shortcut for vectors wholly past it measured slower on the mixed
/// vectors it does not help, and whole vectors past `0.6·cap` mean a cap
/// that flattens nearly every score. The result of every lane is the same
/// either way.
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
pub(crate) unsafe fn tanh<V: Vector>(x: V) -> V {
    // SAFETY: the caller guarantees V's instruction set, and only register
    // operations follow.
    unsafe {
        let x2 = x.mul(x);
        let threshold = V::splat(SMALL_SQUARED);
        if x2.all_less(threshold) {
            // Every |x| < 0.6 (to rounding of x², within the fit's 0.625):
            // the clamp below would leave x as it is.
            return small(x, x2);
        }
        let small_x = V::splat(SMALL_CLAMP).min(V::splat(-SMALL_CLAMP).max(x));
        let small = small(small_x, small_x.mul(small_x));
        let one = V::splat(1.0);
        let large = one.sub(V::splat(2.0).div(exp(x.add(x)).add(one)));
        // Where x² < 0.36: `small`, else `large` (NaN: `large`, NaN).
        let large_part = x2.zero_where_less(threshold, large);
        let small_part = small.sub(x2.zero_where_less(threshold, small));
        large_part.add(small_part)
    }
}

/// `x + x·u·P(u)` with `u = x²`: `tanh x` for `|x| ≤ SMALL_CLAMP`.
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
unsafe fn small<V: Vector>(x: V, u: V) -> V {
    // SAFETY: the caller guarantees V's instruction set, and only register
    // operations follow.
    unsafe {
        let mut p = V::splat(TANH_POLY[5]);
        for &c in TANH_POLY[..5].iter().rev() {
            p = p.mul_add(u, V::splat(c));
        }
        x.mul(u).mul_add(p, x)
    }
}

/// `s ← cap·tanh(s/cap)` over all of `s`, whose length is a multiple of
/// `LANES`: logit softcapping of a score tile. `±inf` becomes `±cap`, NaN
/// stays NaN.
pub(crate) struct SoftcapScores<'a> {
    pub s: &'a mut [f32],
    pub cap: f32,
}

impl KernelOp for SoftcapScores<'_> {
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
        let SoftcapScores { s, cap } = self;
        assert!(s.len().is_multiple_of(V::LANES));
        // A multiply by 1/cap, not a divide per vector: the divide is the
        // slowest instruction here, and s·(1/cap) differs from s/cap by at
        // most an ulp before a function whose slope is at most 1.
        let inverse_cap = 1.0 / cap;
        for chunk in s.chunks_exact_mut(V::LANES) {
            // SAFETY: the caller guarantees V's instruction set; the chunk
            // holds exactly LANES f32s.
            unsafe {
                let x = V::load(chunk.as_ptr()).mul(V::splat(inverse_cap));
                V::splat(cap).mul(tanh(x)).store(chunk.as_mut_ptr());
            }
        }
    }
}
