//! `bf16` ↔ `f32` over slices, bit for bit the `half` crate's
//! conversions (`bf16::to_f32`, `bf16::from_f32`: NaN kept and quieted,
//! rounding to nearest even), 16 at a time with AVX-512 where the CPU has
//! it. A `bf16` call converts its inputs to `f32` and its output back with
//! these; `half`'s own slice conversions run element by element for `bf16`
//! (128-bit at best, with its NaN checks), which measured 12–15% of a
//! short (N = 256) `bf16` forward.
//!
//! Also the largest magnitude among `bf16` numbers, read from their bits
//! ([`max_bf16_magnitude_bits`]): the `bf16` prefill's bound on its
//! queries and keys, 32 numbers an instruction where widening them to
//! `f32` took 16 in three.

use half::bf16;

/// `y[i] = f32::from(x[i])`, exactly as [`bf16::to_f32`].
///
/// # Panics
/// When the lengths differ.
pub(crate) fn widen_bf16(x: &[bf16], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "one f32 per bf16");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F and BW; the lengths are equal.
        unsafe { avx512::widen(x, y) };
        return;
    }
    y.iter_mut().zip(x).for_each(|(y, x)| *y = x.to_f32());
}

/// `y[i] = bf16::from_f32(x[i])`, exactly as [`bf16::from_f32`].
///
/// # Panics
/// When the lengths differ.
pub(crate) fn narrow_bf16(x: &[f32], y: &mut [bf16]) {
    assert_eq!(x.len(), y.len(), "one bf16 per f32");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F and BW; the lengths are equal.
        unsafe { avx512::narrow(x, y) };
        return;
    }
    y.iter_mut()
        .zip(x)
        .for_each(|(y, &x)| *y = bf16::from_f32(x));
}

/// The largest of the magnitude bits (all but the sign) of the numbers in
/// `x`, 0 for none. A `bf16`'s magnitude bits order its magnitude: below
/// `0x7f80` (`inf`) they are those of a finite `|x|`, the largest finite
/// one `0x7f7f`; above it, NaN.
pub(crate) fn max_bf16_magnitude_bits(x: &[bf16]) -> u16 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F and BW.
        return unsafe { avx512::max_magnitude_bits(x) };
    }
    x.iter()
        .map(|x| x.to_bits() & BF16_MAGNITUDE_BITS)
        .fold(0, u16::max)
}

/// A bound on the magnitudes of `x`: the largest `|x|` (0 for none), or
/// `+inf` when one is NaN or infinite, as `Kernel::max_abs` gives for
/// the same numbers widened.
pub(crate) fn bf16_magnitude_bound(x: &[bf16]) -> f32 {
    let bits = max_bf16_magnitude_bits(x);
    if bits >= BF16_INFINITY_BITS {
        f32::INFINITY
    } else {
        bf16::from_bits(bits).to_f32()
    }
}

/// The magnitude bits of a `bf16`: all but the sign.
pub(crate) const BF16_MAGNITUDE_BITS: u16 = 0x7fff;
/// The magnitude bits of `±inf`: larger ones are NaN, smaller ones finite.
pub(crate) const BF16_INFINITY_BITS: u16 = 0x7f80;

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::bf16;

    const LANES: usize = 16;

    /// [`super::max_bf16_magnitude_bits`], 32 numbers a vector: the
    /// sign cleared, an unsigned 16-bit maximum. Four running maxima, so
    /// that four loads go at once rather than one per maximum's latency.
    ///
    /// # Safety
    /// The CPU has AVX-512F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn max_magnitude_bits(x: &[bf16]) -> u16 {
        const HALVES: usize = 32;
        const BLOCK: usize = 4 * HALVES;
        let magnitude = _mm512_set1_epi16(super::BF16_MAGNITUDE_BITS as i16);
        let at = |i: usize| {
            // SAFETY: the callers below read 32 numbers from `i` only where
            // they are inside `x`; AVX-512BW is the caller's.
            unsafe { _mm512_and_si512(_mm512_loadu_si512(x.as_ptr().add(i).cast()), magnitude) }
        };
        let mut max = [_mm512_setzero_si512(); 4];
        let blocks = x.len() / BLOCK * BLOCK;
        for i in (0..blocks).step_by(BLOCK) {
            for (m, max) in max.iter_mut().enumerate() {
                *max = _mm512_max_epu16(*max, at(i + m * HALVES));
            }
        }
        let whole = x.len() / HALVES * HALVES;
        for i in (blocks..whole).step_by(HALVES) {
            max[0] = _mm512_max_epu16(max[0], at(i));
        }
        let max = _mm512_max_epu16(
            _mm512_max_epu16(max[0], max[1]),
            _mm512_max_epu16(max[2], max[3]),
        );
        let mut lanes = [0u16; HALVES];
        // SAFETY: `lanes` holds one vector.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), max) };
        x[whole..]
            .iter()
            .map(|x| x.to_bits() & super::BF16_MAGNITUDE_BITS)
            .chain(lanes)
            .fold(0, u16::max)
    }

    /// [`super::widen_bf16`], 16 at a time: zero-extend, set the quiet bit
    /// of NaNs, shift into the top half.
    ///
    /// # Safety
    /// The CPU has AVX-512F and BW; `x` and `y` have the same length.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn widen(x: &[bf16], y: &mut [f32]) {
        let whole = x.len() / LANES * LANES;
        let (magnitude, infinity, quiet) = (
            _mm512_set1_epi32(0x7fff),
            _mm512_set1_epi32(0x7f80),
            _mm512_set1_epi32(0x0040),
        );
        for i in (0..whole).step_by(LANES) {
            // SAFETY: elements i..i + 16 are inside both slices.
            unsafe {
                let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(x.as_ptr().add(i).cast()));
                let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), infinity);
                let bits = _mm512_mask_or_epi32(bits, nan, bits, quiet);
                _mm512_storeu_si512(y.as_mut_ptr().add(i).cast(), _mm512_slli_epi32(bits, 16));
            }
        }
        y[whole..]
            .iter_mut()
            .zip(&x[whole..])
            .for_each(|(y, x)| *y = x.to_f32());
    }

    /// [`super::narrow_bf16`], 16 at a time: round to nearest even by
    /// adding `0x7fff` plus the kept part's lowest bit, NaNs truncated
    /// with their quiet bit set.
    ///
    /// # Safety
    /// The CPU has AVX-512F and BW; `x` and `y` have the same length.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn narrow(x: &[f32], y: &mut [bf16]) {
        let whole = x.len() / LANES * LANES;
        let (magnitude, infinity) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(0x7f80_0000),
        );
        let (half_ulp, one, quiet) = (
            _mm512_set1_epi32(0x7fff),
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(0x0040),
        );
        for i in (0..whole).step_by(LANES) {
            // SAFETY: elements i..i + 16 are inside both slices.
            unsafe {
                let bits = _mm512_loadu_si512(x.as_ptr().add(i).cast());
                let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), infinity);
                let high = _mm512_srli_epi32(bits, 16);
                let even = _mm512_add_epi32(half_ulp, _mm512_and_si512(high, one));
                let rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, even), 16);
                let rounded = _mm512_mask_or_epi32(rounded, nan, high, quiet);
                _mm256_storeu_si256(y.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi16(rounded));
            }
        }
        y[whole..]
            .iter_mut()
            .zip(&x[whole..])
            .for_each(|(y, &x)| *y = bf16::from_f32(x));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_magnitude_bits_are_found_wherever_they_are() {
        let every: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        // The vector blocks, the single vectors and the tail, each holding
        // the largest: every bf16 once, then small runs around one large
        // number placed at every position.
        for start in [0, 3] {
            let x = &every[start..];
            assert_eq!(max_bf16_magnitude_bits(x), 0x7fff, "{start}");
        }
        for len in [0, 1, 31, 32, 33, 127, 128, 129, 200] {
            for at in 0..len {
                let mut x = vec![bf16::from_f32(-0.5); len];
                x[at] = bf16::from_f32(-3.0e38);
                let want = bf16::from_f32(3.0e38).to_bits();
                assert_eq!(max_bf16_magnitude_bits(&x), want, "{len} {at}");
                // The smallest subnormal, below every −0.5 around it.
                x[at] = bf16::from_bits(0x8001);
                let want = if len == 1 { 0x0001 } else { 0x3f00 };
                assert_eq!(max_bf16_magnitude_bits(&x), want, "{len} {at}");
            }
            let zeros = vec![bf16::NEG_ZERO; len];
            assert_eq!(max_bf16_magnitude_bits(&zeros), 0, "{len}");
        }
        // The bound: the largest |x| while every number is finite.
        let mut x: Vec<bf16> = (0..100).map(|i| bf16::from_f32(i as f32 - 60.0)).collect();
        assert_eq!(bf16_magnitude_bound(&x), 60.0);
        assert_eq!(bf16_magnitude_bound(&[]), 0.0);
        for nonfinite in [bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY] {
            x[77] = nonfinite;
            assert_eq!(bf16_magnitude_bound(&x), f32::INFINITY);
        }
    }

    #[test]
    fn widening_matches_half_for_every_bf16() {
        let x: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        // Odd offsets and lengths: the vector body and the scalar tail.
        for start in [0, 3] {
            let x = &x[start..];
            let mut y = vec![0.0f32; x.len()];
            widen_bf16(x, &mut y);
            for (x, y) in x.iter().zip(&y) {
                assert_eq!(y.to_bits(), x.to_f32().to_bits(), "{:#06x}", x.to_bits());
            }
        }
    }

    #[test]
    fn narrowing_matches_half_on_ties_nans_and_overflow() {
        // Every low half with a few high halves: ties to even and odd,
        // subnormals, the largest finite values, infinities and NaNs (quiet
        // and signalling, both signs), then a stride through all of f32.
        let highs = [
            0x0000, 0x0001, 0x3f80, 0x3f81, 0x7f7f, 0x7f80, 0x7fc0, 0x7f81, 0x8000, 0xbf80, 0xff7f,
            0xff80, 0xff81,
        ];
        let mut x: Vec<f32> = highs
            .iter()
            .flat_map(|&h: &u32| (0..=0xffffu32).map(move |l| f32::from_bits(h << 16 | l)))
            .collect();
        x.extend(
            (0..1u64 << 32)
                .step_by(65_537)
                .map(|b| f32::from_bits(b as u32)),
        );
        for start in [0, 5] {
            let x = &x[start..];
            let mut y = vec![bf16::ZERO; x.len()];
            narrow_bf16(x, &mut y);
            for (x, y) in x.iter().zip(&y) {
                assert_eq!(
                    y.to_bits(),
                    bf16::from_f32(*x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
    }
}
