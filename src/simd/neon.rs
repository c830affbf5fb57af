//! The aarch64 NEON kernel set: 4 `f32` lanes in a `float32x4_t`, 32 registers.
//!
//! Register tiles: Q·Kᵀ 6 rows × 4 vectors (16 keys) = 24 accumulators;
//! P·V 6 rows × 4 vectors (16 value columns) = 24 accumulators.

use std::arch::aarch64::*;

use super::kernels::impl_kernel;
use super::vector::Vector;

/// The NEON kernels; built only on a CPU that has NEON (every aarch64 Linux
/// CPU does, but it is checked all the same).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Neon {
    _cpu_has_neon: (),
}

impl Neon {
    /// The kernels, if this CPU has NEON.
    pub(crate) fn new() -> Option<Self> {
        std::arch::is_aarch64_feature_detected!("neon").then_some(Self { _cpu_has_neon: () })
    }
}

// SAFETY (every method): the trait's contract is that the CPU has NEON, and
// pointers are valid for 4 `f32`s.
impl Vector for float32x4_t {
    const LANES: usize = 4;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { vdupq_n_f32(x) }
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        unsafe { vld1q_f32(ptr) }
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        unsafe { vst1q_f32(ptr, self) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        unsafe { vaddq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        unsafe { vsubq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        unsafe { vmulq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe { vfmaq_f32(c, self, b) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // `fmax` returns NaN when either lane is NaN, which keeps a NaN in
        // `other` as the trait asks (and one in `self` too).
        unsafe { vmaxq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self {
        unsafe {
            let less = vcltq_f32(self, threshold);
            vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(value), less))
        }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        unsafe {
            let n = vcvtq_s32_f32(self);
            vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(n, vdupq_n_s32(127))))
        }
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        unsafe { vmaxvq_f32(self) }
    }
    #[inline(always)]
    unsafe fn reduce_sum(self) -> f32 {
        unsafe { vaddvq_f32(self) }
    }
    #[inline(always)]
    unsafe fn prefetch(_ptr: *const f32) {
        // The hardware prefetcher follows the row streams; stable Rust has
        // no aarch64 prefetch intrinsic.
    }
}

impl_kernel!(
    Neon, crate::simd::KernelSet::Neon, float32x4_t,
    score_tile: 6 x 4, value_tile: 6 x 4,
    #[target_feature(enable = "neon")]
);
