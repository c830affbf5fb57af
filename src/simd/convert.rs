//! Widening `bf16` and `f16` to `f32`, exactly, per kernel set: what a
//! half-precision key or value tile goes through before the `f32` kernels
//! read it (the decode path of a half-precision `KvCache`).
//!
//! Every set gives the bits `half`'s own `to_f32` gives, NaN included: a
//! NaN comes out quiet (its top mantissa bit set), with its payload and
//! sign kept. So a result never depends on the kernel set.
//!
//! | set | `bf16` | `f16` |
//! |---|---|---|
//! | scalar | `half::bf16::to_f32` | `half::f16::to_f32` |
//! | AVX2 | `vpmovzxwd` + `vpslld 16`, 8 lanes | F16C `vcvtph2ps`, 8 lanes (scalar when the CPU lacks F16C) |
//! | AVX-512 | `vpmovzxwd` + `vpslld 16`, 16 lanes | `vcvtph2ps` (AVX-512F), 16 lanes |
//! | NEON | `ushll #16` (`vshll_n_u16`), 4 lanes | scalar: `float16x4_t` is unstable in Rust 1.89 |
//!
//! `bf16` is the top half of an `f32`, so widening it is a 16-bit shift;
//! the only other work is quieting a signaling NaN, as `half` does
//! (a compare and an OR, which cost nothing next to the store).
//!
//! The kernel set is known from the `Kernel` value's [`Kernel::SET`],
//! which its type's contract ties to the instruction set it proves.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::KernelSet;
use super::kernel::Kernel;

/// A half-precision type the kernels can widen to `f32`.
pub(crate) trait Widen: Copy + Send + Sync + 'static {
    /// `dst[i] = src[i]` as `f32`, for `i < src.len()`, bit for bit what
    /// `half`'s `to_f32` gives.
    ///
    /// # Panics
    /// When `dst` is shorter than `src` (a bug in the caller).
    fn widen<K: Kernel>(kernel: K, src: &[Self], dst: &mut [f32]);
}

impl Widen for bf16 {
    #[inline]
    fn widen<K: Kernel>(_kernel: K, src: &[bf16], dst: &mut [f32]) {
        let dst = &mut dst[..src.len()];
        let bits = src.reinterpret_cast();
        let done = match K::SET {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `K` with `SET == Avx512` exists only on a CPU with
            // AVX-512F (the `Kernel` contract).
            KernelSet::Avx512 => unsafe { x86::bf16_avx512(bits, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `K` with `SET == Avx2` exists only on a CPU with AVX2.
            KernelSet::Avx2 => unsafe { x86::bf16_avx2(bits, dst) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: a `K` with `SET == Neon` exists only on a CPU with NEON.
            KernelSet::Neon => unsafe { neon::bf16_neon(bits, dst) },
            _ => 0,
        };
        scalar(&src[done..], &mut dst[done..], bf16::to_f32);
    }
}

impl Widen for f16 {
    #[inline]
    fn widen<K: Kernel>(_kernel: K, src: &[f16], dst: &mut [f32]) {
        let dst = &mut dst[..src.len()];
        let done = match K::SET {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `K` with `SET == Avx512` exists only on a CPU with
            // AVX-512F, which has the 512-bit `vcvtph2ps`.
            KernelSet::Avx512 => unsafe { x86::f16_avx512(src.reinterpret_cast(), dst) },
            #[cfg(target_arch = "x86_64")]
            // std caches the detection: one relaxed load per tile.
            KernelSet::Avx2 if std::arch::is_x86_feature_detected!("f16c") => {
                // SAFETY: a `K` with `SET == Avx2` exists only on a CPU with
                // AVX2, and F16C was just detected.
                unsafe { x86::f16_avx2(src.reinterpret_cast(), dst) }
            }
            _ => 0,
        };
        scalar(&src[done..], &mut dst[done..], f16::to_f32);
    }
}

/// The scalar conversion, through `half`.
#[inline]
fn scalar<H: Copy>(src: &[H], dst: &mut [f32], to_f32: fn(H) -> f32) {
    for (y, &x) in dst.iter_mut().zip(src) {
        *y = to_f32(x);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The x86-64 conversions. Each returns how many leading elements it
    //! converted (whole vectors); the caller converts the rest.

    use std::arch::x86_64::*;

    /// Prefetches element `i` of the run that follows `src` in memory (into
    /// L2): a decoding step widens a head's keys (and values) one key tile
    /// at a time, each tile right after the last, with the kernels' work in
    /// between, so without this every tile starts with the hardware
    /// prefetcher cold (measured: the widening took 68% of a bf16 step, at
    /// a third of the read rate). A prefetch never faults, so past the end
    /// of the buffer it is only wasted.
    #[inline(always)]
    fn prefetch_next_run(src: &[u16], i: usize) {
        // Once per 64-byte line (32 elements).
        if i.is_multiple_of(32) {
            let ahead = src.as_ptr().wrapping_add(src.len() + i);
            // SAFETY: a prefetch reads nothing the program can observe and
            // cannot fault; `wrapping_add` makes no claim about the pointer.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead.cast()) };
        }
    }

    /// `bf16` bits to `f32`, 16 at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `dst.len() == src.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_avx512(src: &[u16], dst: &mut [f32]) -> usize {
        debug_assert_eq!(src.len(), dst.len());
        let whole = src.len() / 16 * 16;
        let (magnitude, infinity, quiet) = (
            _mm512_set1_epi32(0x7FFF_FFFF),
            _mm512_set1_epi32(0x7F80_0000),
            _mm512_set1_epi32(0x0040_0000),
        );
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 ≤ whole ≤ len` for both slices, and the loads
            // and stores are unaligned.
            unsafe {
                prefetch_next_run(src, i);
                let x = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                let bits = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(x));
                // A NaN (magnitude above infinity's) gets its quiet bit.
                let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, magnitude), infinity);
                let bits = _mm512_mask_or_epi32(bits, nan, bits, quiet);
                _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), bits);
            }
        }
        whole
    }

    /// `bf16` bits to `f32`, 8 at a time.
    ///
    /// # Safety
    /// The CPU has AVX2; `dst.len() == src.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_avx2(src: &[u16], dst: &mut [f32]) -> usize {
        debug_assert_eq!(src.len(), dst.len());
        let whole = src.len() / 8 * 8;
        let (magnitude, infinity, quiet) = (
            _mm256_set1_epi32(0x7FFF_FFFF),
            _mm256_set1_epi32(0x7F80_0000),
            _mm256_set1_epi32(0x0040_0000),
        );
        for i in (0..whole).step_by(8) {
            // SAFETY: `i + 8 ≤ whole ≤ len` for both slices, and the loads
            // and stores are unaligned.
            unsafe {
                prefetch_next_run(src, i);
                let x = _mm_loadu_si128(src.as_ptr().add(i).cast());
                let bits = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(x));
                // A NaN (magnitude above infinity's, a signed compare of
                // values below 2³¹) gets its quiet bit.
                let nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), infinity);
                let bits = _mm256_or_si256(bits, _mm256_and_si256(nan, quiet));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), bits);
            }
        }
        whole
    }

    /// `f16` bits to `f32`, 16 at a time (`vcvtph2ps` quiets NaNs as
    /// `half` does, and widens subnormals exactly).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `dst.len() == src.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_avx512(src: &[u16], dst: &mut [f32]) -> usize {
        debug_assert_eq!(src.len(), dst.len());
        let whole = src.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: `i + 16 ≤ whole ≤ len` for both slices, and the loads
            // and stores are unaligned.
            unsafe {
                prefetch_next_run(src, i);
                let x = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(x));
            }
        }
        whole
    }

    /// `f16` bits to `f32`, 8 at a time.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `dst.len() == src.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_avx2(src: &[u16], dst: &mut [f32]) -> usize {
        debug_assert_eq!(src.len(), dst.len());
        let whole = src.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: `i + 8 ≤ whole ≤ len` for both slices, and the loads
            // and stores are unaligned.
            unsafe {
                prefetch_next_run(src, i);
                let x = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(x));
            }
        }
        whole
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    //! The NEON conversion of `bf16`; `f16` goes through `half` (see the
    //! module header).

    use std::arch::aarch64::*;

    /// `bf16` bits to `f32`, 4 at a time; returns how many it converted.
    ///
    /// # Safety
    /// The CPU has NEON; `dst.len() == src.len()`.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn bf16_neon(src: &[u16], dst: &mut [f32]) -> usize {
        debug_assert_eq!(src.len(), dst.len());
        let whole = src.len() / 4 * 4;
        let (magnitude, infinity, quiet) = (
            vdupq_n_u32(0x7FFF_FFFF),
            vdupq_n_u32(0x7F80_0000),
            vdupq_n_u32(0x0040_0000),
        );
        for i in (0..whole).step_by(4) {
            // SAFETY: `i + 4 ≤ whole ≤ len` for both slices; NEON loads and
            // stores need no alignment beyond the element's.
            unsafe {
                let bits = vshll_n_u16::<16>(vld1_u16(src.as_ptr().add(i)));
                // A NaN (magnitude above infinity's) gets its quiet bit.
                let nan = vcgtq_u32(vandq_u32(bits, magnitude), infinity);
                let bits = vorrq_u32(bits, vandq_u32(nan, quiet));
                vst1q_f32(dst.as_mut_ptr().add(i), vreinterpretq_f32_u32(bits));
            }
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    //! Every kernel set's widening against `half`'s, bit for bit, over
    //! every `bf16` and `f16` bit pattern (NaNs, infinities, subnormals,
    //! both zeros), at lengths that leave every possible tail.

    use half::{bf16, f16};

    use super::Widen;
    use crate::simd::{WithKernel, available_kernel_sets, kernel::Kernel, with_kernel};

    /// Widens `src` with kernel set `K`, at each offset 0..17 so that the
    /// vector loop and the scalar tail both see every value.
    struct Check<'a, H>(&'a [H]);

    impl<H: Widen + std::fmt::Debug> WithKernel for Check<'_, H> {
        type Output = Vec<Vec<u32>>;
        fn run<K: Kernel>(self, kernel: K) -> Vec<Vec<u32>> {
            (0..=self.0.len().min(16))
                .map(|skip| {
                    let src = &self.0[skip..];
                    // One more slot than needed: it must stay untouched.
                    let mut dst = vec![1.5f32; src.len() + 1];
                    H::widen(kernel, src, &mut dst);
                    assert_eq!(dst[src.len()], 1.5, "{:?}: wrote past the end", K::SET);
                    dst[..src.len()].iter().map(|x| x.to_bits()).collect()
                })
                .collect()
        }
    }

    fn check<H: Widen + std::fmt::Debug>(all: &[H], to_f32: fn(H) -> f32, name: &str) {
        for set in available_kernel_sets() {
            let got = with_kernel(set, Check(all)).unwrap();
            for (skip, got) in got.iter().enumerate() {
                for (i, (&bits, &x)) in got.iter().zip(&all[skip..]).enumerate() {
                    let expected = to_f32(x).to_bits();
                    assert_eq!(
                        bits,
                        expected,
                        "{name} {set}: element {} ({x:?}): got {bits:#010x}, half gives {expected:#010x}",
                        skip + i
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_widens_as_half_does_for_every_bit_pattern() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        check(&all, bf16::to_f32, "bf16");
    }

    #[test]
    fn f16_widens_as_half_does_for_every_bit_pattern() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        // Subnormals, both infinities and both NaN kinds are all in here.
        assert!(
            all.iter()
                .any(|x| x.to_f32() != 0.0 && x.to_f32().abs() < 6.1e-5)
        );
        check(&all, f16::to_f32, "f16");
    }

    #[test]
    fn short_slices_convert_in_the_tail() {
        for len in 0..40 {
            let src: Vec<f16> = (0..len)
                .map(|i| f16::from_f32(i as f32 * 0.25 - 3.0))
                .collect();
            let src_bf: Vec<bf16> = src.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
            check(&src, f16::to_f32, "f16 short");
            check(&src_bf, bf16::to_f32, "bf16 short");
        }
    }
}
