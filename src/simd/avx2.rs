//! The AVX2 + FMA kernel set: 8 `f32` lanes in a `__m256`, 16 registers.
//! It also needs F16C (`f16` loads), which every CPU with AVX2 has (Intel
//! since Ivy Bridge, AMD since Piledriver, both before AVX2).
//!
//! Register tiles: Q·Kᵀ 6 rows × 2 vectors (16 keys) = 12 accumulators;
//! P·V 6 rows × 2 vectors (16 value columns) = 12 accumulators, plus the
//! loaded vectors and one broadcast.

use std::arch::x86_64::*;

use super::kernel::{Kernel, KernelOp};
use super::vector::Vector;

/// Query rows per register tile.
const ROWS: usize = 6;
/// Vectors of keys per Q·Kᵀ register tile.
const KEY_VECTORS: usize = 2;
/// Vectors of value columns per P·V register tile.
const VALUE_VECTORS: usize = 2;

/// The AVX2 + FMA (+ F16C) kernels; built only on a CPU that has them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2 {
    _cpu_has_avx2_fma_and_f16c: (),
}

impl Avx2 {
    /// The kernels, if this CPU has AVX2, FMA and F16C.
    pub(crate) fn new() -> Option<Self> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Self {
            _cpu_has_avx2_fma_and_f16c: (),
        })
    }
}

// SAFETY: `Avx2` is built only by `new`, which checks AVX2, FMA and F16C,
// the features `run_unchecked` enables; it runs the operation with `__m256` and
// the tile sizes of the constants.
unsafe impl Kernel for Avx2 {
    type Vector = __m256;
    const SET: super::KernelSet = super::KernelSet::Avx2;
    const ROWS: usize = ROWS;
    const KEY_PANEL: usize = KEY_VECTORS * <__m256 as Vector>::LANES;

    #[inline(always)]
    unsafe fn run_unchecked<Op: KernelOp>(op: Op) -> Op::Output {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn trampoline<Op: KernelOp>(op: Op) -> Op::Output {
            // SAFETY: this function is compiled for AVX2, FMA and F16C,
            // `__m256`'s instruction set, and runs only where the CPU has
            // them.
            unsafe { op.run::<__m256, ROWS, KEY_VECTORS, VALUE_VECTORS>() }
        }
        // SAFETY: the caller guarantees AVX2, FMA and F16C.
        unsafe { trampoline(op) }
    }
}

// SAFETY: each method is one AVX2/FMA/F16C instruction sequence on
// registers, and the pointer methods touch the 8 elements at the pointer
// only.
unsafe impl Vector for __m256 {
    const LANES: usize = 8;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: AVX2 and FMA, and 8 readable `f32`s at `ptr` (the caller's).
        unsafe { _mm256_loadu_ps(ptr) }
    }
    #[inline(always)]
    unsafe fn gather(ptr: *const f32, stride: isize) -> Self {
        // SAFETY: AVX2; the 8 lanes are readable and their offsets
        // `i·stride` fit in `i32` (the caller's).
        unsafe {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let offsets = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(stride as i32));
            _mm256_i32gather_ps::<4>(ptr, offsets)
        }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_bf16(ptr: *const u16) -> Self {
        // SAFETY: AVX2, and 8 readable `u16`s at `ptr` (the caller's).
        unsafe {
            let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(ptr.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
        }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        // SAFETY: F16C (part of this set), and 8 readable `u16`s at `ptr`
        // (the caller's).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(ptr.cast())) }
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: AVX2 and FMA, and 8 writable `f32`s at `ptr` (the caller's).
        unsafe { _mm256_storeu_ps(ptr, self) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_add_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_sub_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_mul_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn div(self, other: Self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_div_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // `maxps` is exactly `self > other ? self : other`.
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_max_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        // `minps` is exactly `self < other ? self : other`.
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_min_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(self, threshold), value) }
    }
    #[inline(always)]
    unsafe fn all_less(self, threshold: Self) -> bool {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe { _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(self, threshold)) == 0xff }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: AVX2 and FMA (the caller's).
        unsafe {
            let n = _mm256_cvtps_epi32(self);
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                n,
                _mm256_set1_epi32(127),
            )))
        }
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        // SAFETY: AVX2 and FMA (the caller's), which imply SSE3.
        unsafe {
            let x = _mm_max_ps(
                _mm256_castps256_ps128(self),
                _mm256_extractf128_ps::<1>(self),
            );
            let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
            _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)))
        }
    }
    #[inline(always)]
    unsafe fn reduce_sum(self) -> f32 {
        // SAFETY: AVX2 and FMA (the caller's), which imply SSE3.
        unsafe {
            let x = _mm_add_ps(
                _mm256_castps256_ps128(self),
                _mm256_extractf128_ps::<1>(self),
            );
            let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
            _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
        }
    }
    const TRANSPOSES_IN_REGISTERS: bool = true;
    /// 24 shuffles in three rounds: pairs of rows interleaved, then
    /// pairs of pairs, then the 128-bit halves exchanged.
    #[inline(always)]
    unsafe fn transpose(rows: &mut [Self]) {
        assert_eq!(rows.len(), 8);
        // SAFETY: AVX (the caller's AVX2 includes it).
        unsafe {
            // Round 1: per 128-bit half k, [a(4k), b(4k), a(4k+1), b(4k+1)]
            // and [a(4k+2), b(4k+2), a(4k+3), b(4k+3)].
            let mut two = [_mm256_setzero_ps(); 8];
            for i in 0..4 {
                let (a, b) = (rows[2 * i], rows[2 * i + 1]);
                two[2 * i] = _mm256_unpacklo_ps(a, b);
                two[2 * i + 1] = _mm256_unpackhi_ps(a, b);
            }
            // Round 2: `four[4g + c]` holds column 4k + c of rows
            // 4g..4g + 4 in its half k.
            let mut four = [_mm256_setzero_ps(); 8];
            for g in 0..2 {
                let (ab_low, ab_high) = (two[4 * g], two[4 * g + 1]);
                let (cd_low, cd_high) = (two[4 * g + 2], two[4 * g + 3]);
                four[4 * g] = _mm256_shuffle_ps::<0b01_00_01_00>(ab_low, cd_low);
                four[4 * g + 1] = _mm256_shuffle_ps::<0b11_10_11_10>(ab_low, cd_low);
                four[4 * g + 2] = _mm256_shuffle_ps::<0b01_00_01_00>(ab_high, cd_high);
                four[4 * g + 3] = _mm256_shuffle_ps::<0b11_10_11_10>(ab_high, cd_high);
            }
            // Round 3: column c from the low halves of four[c] and
            // four[4 + c], column 4 + c from their high halves.
            for c in 0..4 {
                let (top, bottom) = (four[c], four[4 + c]);
                rows[c] = _mm256_permute2f128_ps::<0x20>(top, bottom);
                rows[4 + c] = _mm256_permute2f128_ps::<0x31>(top, bottom);
            }
        }
    }
    #[inline(always)]
    unsafe fn prefetch(ptr: *const u8) {
        // SAFETY: SSE (part of x86-64); a prefetch never faults, whatever
        // the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.cast()) }
    }
}
