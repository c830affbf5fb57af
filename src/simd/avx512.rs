//! The AVX-512F kernel set: 16 `f32` lanes in a `__m512`, 32 registers.
//!
//! Register tiles: Q·Kᵀ 6 rows × 2 vectors (32 keys) = 12 accumulators;
//! P·V 6 rows × 4 vectors (64 value columns) = 24 accumulators, plus 4
//! loaded value vectors and one broadcast.

use std::arch::x86_64::*;

use super::kernels::impl_kernel;
use super::vector::Vector;

/// The AVX-512F kernels; built only on a CPU that has AVX-512F.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512 {
    _cpu_has_avx512f: (),
}

impl Avx512 {
    /// The kernels, if this CPU has AVX-512F.
    pub(crate) fn new() -> Option<Self> {
        is_x86_feature_detected!("avx512f").then_some(Self {
            _cpu_has_avx512f: (),
        })
    }
}

// SAFETY (every method): the trait's contract is that the CPU has AVX-512F,
// and pointers are valid for 16 `f32`s.
impl Vector for __m512 {
    const LANES: usize = 16;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        unsafe { _mm512_loadu_ps(ptr) }
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        unsafe { _mm512_storeu_ps(ptr, self) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        unsafe { _mm512_add_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        unsafe { _mm512_sub_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        unsafe { _mm512_mul_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // `vmaxps` is exactly `self > other ? self : other`.
        unsafe { _mm512_max_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self {
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(self, threshold), value) }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        unsafe {
            let n = _mm512_cvtps_epi32(self);
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                n,
                _mm512_set1_epi32(127),
            )))
        }
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        unsafe { _mm512_reduce_max_ps(self) }
    }
    #[inline(always)]
    unsafe fn reduce_sum(self) -> f32 {
        unsafe { _mm512_reduce_add_ps(self) }
    }
    #[inline(always)]
    unsafe fn prefetch(ptr: *const f32) {
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.cast()) }
    }
}

impl_kernel!(
    Avx512, crate::simd::KernelSet::Avx512, __m512,
    score_tile: 6 x 2, value_tile: 6 x 4,
    #[target_feature(enable = "avx512f")]
);
