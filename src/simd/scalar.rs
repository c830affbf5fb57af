//! The portable kernel set: one `f32` lane at a time, no target features.
//! Always built; the fallback on any CPU and the baseline in tests.

use super::kernel::{Kernel, KernelOp};
use super::vector::Vector;

/// Query rows per register tile.
const ROWS: usize = 6;
/// Values (one-lane vectors) of keys per Q·Kᵀ register tile.
const KEY_VECTORS: usize = 4;
/// Values of value columns per P·V register tile.
const VALUE_VECTORS: usize = 4;

/// The portable kernels. Every CPU can run them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scalar;

// SAFETY: `run_unchecked` runs the operation with `f32`, which needs no
// instruction set, so every CPU can run it; and with the tile sizes of the
// constants.
unsafe impl Kernel for Scalar {
    type Vector = f32;
    const SET: super::KernelSet = super::KernelSet::Scalar;
    const ROWS: usize = ROWS;
    const KEY_PANEL: usize = KEY_VECTORS;

    #[inline(always)]
    unsafe fn run_unchecked<Op: KernelOp>(op: Op) -> Op::Output {
        // SAFETY: `f32`'s vector methods need no instruction set.
        unsafe { op.run::<f32, ROWS, KEY_VECTORS, VALUE_VECTORS>() }
    }
}

// SAFETY: the methods are plain `f32` arithmetic, but for the loads and
// `store`, which touch the one element at the pointer.
unsafe impl Vector for f32 {
    const LANES: usize = 1;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        x
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: the caller guarantees one readable f32 at `ptr`.
        unsafe { ptr.read_unaligned() }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_bf16(ptr: *const u16) -> Self {
        // SAFETY: the caller guarantees one readable u16 at `ptr`.
        half::bf16::from_bits(unsafe { ptr.read_unaligned() }).to_f32()
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        // SAFETY: the caller guarantees one readable u16 at `ptr`.
        half::f16::from_bits(unsafe { ptr.read_unaligned() }).to_f32()
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: the caller guarantees one writable f32 at `ptr`.
        unsafe { ptr.write_unaligned(self) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        self + other
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        self - other
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        self * other
    }
    #[inline(always)]
    unsafe fn div(self, other: Self) -> Self {
        self / other
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        // In f64 the product of two f32 is exact, so this rounds like a
        // fused multiply-add (but for rare double roundings), without the
        // slow library call `f32::mul_add` is on CPUs that lack FMA.
        (self as f64 * b as f64 + c as f64) as f32
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        if self > other { self } else { other }
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        if self < other { self } else { other }
    }
    #[inline(always)]
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self {
        if self < threshold { 0.0 } else { value }
    }
    #[inline(always)]
    unsafe fn all_less(self, threshold: Self) -> bool {
        self < threshold
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // A NaN `self` casts to 0; the NaN survives in the other factor.
        f32::from_bits(((self as i32 + 127) as u32) << 23)
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn reduce_sum(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn prefetch(_ptr: *const u8) {}
}
