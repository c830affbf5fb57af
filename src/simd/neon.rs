//! The aarch64 NEON kernel set: 4 `f32` lanes in a `float32x4_t`, 32 registers.
//!
//! Register tiles: Q·Kᵀ 6 rows × 4 vectors (16 keys) = 24 accumulators;
//! P·V 6 rows × 4 vectors (16 value columns) = 24 accumulators.

use std::arch::aarch64::*;

use super::kernel::{Kernel, KernelOp};
use super::vector::Vector;

/// Query rows per register tile.
const ROWS: usize = 6;
/// Vectors of keys per Q·Kᵀ register tile.
const KEY_VECTORS: usize = 4;
/// Vectors of value columns per P·V register tile.
const VALUE_VECTORS: usize = 4;

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

// SAFETY: `Neon` is built only by `new`, which checks NEON, the one feature
// `run_unchecked` enables; it runs the operation with `float32x4_t` and the
// tile sizes of the constants.
unsafe impl Kernel for Neon {
    type Vector = float32x4_t;
    const SET: super::KernelSet = super::KernelSet::Neon;
    const ROWS: usize = ROWS;
    const KEY_PANEL: usize = KEY_VECTORS * <float32x4_t as Vector>::LANES;

    #[inline(always)]
    unsafe fn run_unchecked<Op: KernelOp>(op: Op) -> Op::Output {
        #[target_feature(enable = "neon")]
        fn trampoline<Op: KernelOp>(op: Op) -> Op::Output {
            // SAFETY: this function is compiled for NEON, `float32x4_t`'s
            // instruction set, and runs only where the CPU has it.
            unsafe { op.run::<float32x4_t, ROWS, KEY_VECTORS, VALUE_VECTORS>() }
        }
        // SAFETY: the caller guarantees NEON.
        unsafe { trampoline(op) }
    }
}

// SAFETY: each method is one NEON instruction sequence on registers, and
// the pointer methods touch the 4 elements at the pointer only.
unsafe impl Vector for float32x4_t {
    const LANES: usize = 4;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe { vdupq_n_f32(x) }
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: NEON, and 4 readable `f32`s at `ptr` (the caller's).
        unsafe { vld1q_f32(ptr) }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_bf16(ptr: *const u16) -> Self {
        // SAFETY: NEON, and 4 readable `u16`s at `ptr` (the caller's).
        unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(ptr))) }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        // Through `half`: NEON's `float16x4_t` is unstable in Rust.
        // SAFETY: 4 readable `u16`s at `ptr` (the caller's), and NEON.
        unsafe {
            let lanes: [f32; 4] =
                std::array::from_fn(|i| half::f16::from_bits(ptr.add(i).read_unaligned()).to_f32());
            vld1q_f32(lanes.as_ptr())
        }
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: NEON, and 4 writable `f32`s at `ptr` (the caller's).
        unsafe { vst1q_f32(ptr, self) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe { vaddq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe { vsubq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe { vmulq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn div(self, other: Self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe { vdivq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe { vfmaq_f32(c, self, b) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // `fmax` returns NaN when either lane is NaN, which keeps a NaN in
        // `other` as the trait asks (and one in `self` too).
        // SAFETY: NEON (the caller's).
        unsafe { vmaxq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        // `fmin` returns NaN when either lane is NaN, which keeps a NaN in
        // `other` as the trait asks (and one in `self` too).
        // SAFETY: NEON (the caller's).
        unsafe { vminq_f32(self, other) }
    }
    #[inline(always)]
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe {
            let less = vcltq_f32(self, threshold);
            vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(value), less))
        }
    }
    #[inline(always)]
    unsafe fn all_less(self, threshold: Self) -> bool {
        // SAFETY: NEON (the caller's).
        unsafe { vminvq_u32(vcltq_f32(self, threshold)) == u32::MAX }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: NEON (the caller's).
        unsafe {
            let n = vcvtq_s32_f32(self);
            vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(n, vdupq_n_s32(127))))
        }
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        // SAFETY: NEON (the caller's).
        unsafe { vmaxvq_f32(self) }
    }
    #[inline(always)]
    unsafe fn reduce_sum(self) -> f32 {
        // SAFETY: NEON (the caller's).
        unsafe { vaddvq_f32(self) }
    }
    #[inline(always)]
    unsafe fn prefetch(_ptr: *const u8) {
        // The hardware prefetcher follows the row streams; stable Rust has
        // no aarch64 prefetch intrinsic.
    }
}
