//! `f32` numbers as three `bf16` parts, so that AMX tiles, which multiply
//! `bf16` only, can compute `f32` products to `f32` accuracy
//! (`fused/split.rs`).
//!
//! `x = hi + mid + lo`: `hi` is `x` rounded to `bf16` (to nearest even),
//! `mid` what is left rounded again, `lo` the rest. Rounding to nearest
//! leaves at most half a unit of 8 bits each time, so `|mid| ≤ 2⁻⁸|x|`,
//! `|lo| ≤ 2⁻¹⁶|x|`, and for a normal `x` whose parts are normal the three
//! add up to `x` exactly (24 significant bits in three of 8). A product
//! `a·b` is then summed from the six partial products of order ≥ 2⁻¹⁶
//! ([`SPLIT_PRODUCTS`]); the three left out are at most about
//! 2⁻²³·|a·b| together (`2·2⁻⁸·2⁻¹⁶ + 2⁻³²`), at `f32`'s rounding of the
//! sum. Measured over 256 000 dot
//! products of length 64 and 128 (`docs/experiments/amx_split`): 0.5–1.07
//! times the error of a sequential `f32` FMA sum, relative to `Σ|aᵢbᵢ|`.
//!
//! What the split does not keep, the callers treat apart: a part below
//! `f32`'s normal range is flushed to zero (by `vcvtneps2bf16` and by
//! `tdpbf16ps`, as for every `bf16` operand), an absolute error below
//! 2⁻¹²⁶ per element, far under what reaches a score; NaN, infinities and
//! numbers whose `hi` rounds past `bf16`'s largest finite value split into
//! NaN or infinite parts, so the callers flag them ([`Amx::split`]
//! says where) and compute what they touch in `f32`.

use std::arch::x86_64::*;

#[cfg(feature = "half")]
use half::bf16;

use super::amx::Amx;

/// The partial products `part_a · part_b` (0 = `hi`, 1 = `mid`, 2 = `lo`)
/// of a three-way split whose order is at least 2⁻¹⁶, grouped by the first
/// part so that a kernel loads each of its tiles once.
pub(crate) const SPLIT_PRODUCTS: [(usize, usize); 6] =
    [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)];

/// `f32` lanes of a vector.
const LANES: usize = 16;

impl Amx {
    /// Splits `x` into `parts` (`hi`, `mid`, `lo`, each `x.len()` long);
    /// returns whether some `|x|` is not below `bound` (NaN included): where
    /// the caller must not trust the parts.
    ///
    /// # Panics
    /// When a part's length is not `x.len()` (a bug in the driver).
    #[cfg(feature = "half")]
    pub(crate) fn split(self, x: &[f32], bound: f32, parts: [&mut [bf16]; 3]) -> bool {
        assert!(parts.iter().all(|part| part.len() == x.len()));
        // SAFETY: `self` exists, so the CPU has AVX-512F, BW, VL and BF16
        // (every AMX CPU does); each part holds `x.len()` `u16`s, checked
        // above.
        unsafe { split(x, bound, parts.map(|part| part.as_mut_ptr().cast::<u16>())) }
    }

    /// [`split`](Self::split) into `bf16` pairs (`x[2p]` in the low half
    /// of pair `p`, the layout the tiles read), for an `x` of even length.
    ///
    /// # Panics
    /// When `x.len()` is odd or a part's length is not `x.len() / 2`.
    pub(crate) fn split_pairs(self, x: &[f32], bound: f32, parts: [&mut [u32]; 3]) -> bool {
        assert!(x.len().is_multiple_of(2));
        assert!(parts.iter().all(|part| 2 * part.len() == x.len()));
        // SAFETY: as in `split`: each part holds `x.len()` `u16`s (pairs
        // are two, the first in the low half on this little-endian CPU).
        unsafe { split(x, bound, parts.map(|part| part.as_mut_ptr().cast::<u16>())) }
    }
}

/// [`Amx::split`].
///
/// # Safety
/// The CPU has the features; each part has room for `x.len()` `u16`s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn split(x: &[f32], bound: f32, parts: [*mut u16; 3]) -> bool {
    let bound = _mm512_set1_ps(bound);
    let mut beyond = 0;
    let [hi, mid, lo] = parts;
    for i in (0..x.len()).step_by(LANES) {
        // The last vector is masked to the elements left.
        let mask: __mmask16 = if x.len() - i >= LANES {
            !0
        } else {
            (1 << (x.len() - i)) - 1
        };
        // SAFETY: lanes `i..i + 16` inside `x` and the parts, masked.
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i));
            // Not below the bound, or unordered (NaN).
            beyond |= _mm512_mask_cmp_ps_mask(mask, _mm512_abs_ps(v), bound, _CMP_NLT_UQ);
            let [h, m, l] = split16(v);
            _mm256_mask_storeu_epi16(hi.add(i).cast(), mask, h);
            _mm256_mask_storeu_epi16(mid.add(i).cast(), mask, m);
            _mm256_mask_storeu_epi16(lo.add(i).cast(), mask, l);
        }
    }
    beyond != 0
}

/// 16 `f32` as their three `bf16` parts, 16 each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) fn split16(x: __m512) -> [__m256i; 3] {
    let hi = round(x);
    let rest = _mm512_sub_ps(x, widen(hi));
    let mid = round(rest);
    let lo = round(_mm512_sub_ps(rest, widen(mid)));
    [hi, mid, lo]
}

/// `x` rounded to `bf16` (to nearest even), as 16 `u16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn round(x: __m512) -> __m256i {
    // SAFETY: 32 bytes of plain bits either way.
    unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)) }
}

/// 16 `bf16` (as `u16`) widened to `f32` exactly: their bits in the high
/// half of each lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn widen(x: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(x)))
}

#[cfg(all(test, feature = "half"))]
mod tests {
    use super::*;

    #[test]
    fn parts_add_up_to_x_and_flag_what_they_cannot_hold() {
        let Some(amx) = Amx::new() else { return };
        // Irregular normal numbers over many binades, both signs, and an
        // odd length for the masked tail.
        let x: Vec<f32> = (0..1001)
            .map(|i| {
                let m = ((i as f32) * 0.618_034).fract() + 0.5;
                let e = (i % 61) - 30;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * m * 2f32.powi(e)
            })
            .collect();
        let mut parts = [
            vec![bf16::ZERO; x.len()],
            vec![bf16::ZERO; x.len()],
            vec![bf16::ZERO; x.len()],
        ];
        let [hi, mid, lo] = &mut parts;
        assert!(!amx.split(&x, 1e30, [hi, mid, lo]));
        for (i, &x) in x.iter().enumerate() {
            let [hi, mid, lo] = [parts[0][i], parts[1][i], parts[2][i]].map(f64::from);
            assert_eq!(hi + mid + lo, f64::from(x), "element {i}");
            assert!(mid.abs() <= f64::from(x).abs() / 256.0);
            assert!(lo.abs() <= f64::from(x).abs() / 65536.0);
            assert_eq!(parts[0][i], bf16::from_f32(x), "hi rounds to nearest");
        }
        for flagged in [f32::NAN, f32::INFINITY, -f32::INFINITY, 1e31, -1e31] {
            let mut x = x.clone();
            x[997] = flagged;
            let [hi, mid, lo] = &mut parts;
            assert!(amx.split(&x, 1e30, [hi, mid, lo]), "{flagged}");
        }
    }
}
