//! [`Vector`]: the few operations on a register of `f32` lanes that the
//! kernels need, implemented once per instruction set.

/// A register of `LANES` `f32` values.
///
/// # Safety
/// Every method may only be called on a CPU that has the instruction set of
/// the implementing type, which the kernel types' constructors check. The
/// pointer methods also need `LANES` readable (or writable) `f32`s at the
/// pointer; no alignment is required.
pub(crate) trait Vector: Copy {
    /// Number of `f32` lanes.
    const LANES: usize;

    /// Every lane set to `x`.
    unsafe fn splat(x: f32) -> Self;
    /// `LANES` values read from `ptr`.
    unsafe fn load(ptr: *const f32) -> Self;
    /// Writes the lanes to `ptr`.
    unsafe fn store(self, ptr: *mut f32);
    /// Lane-wise `self + other`.
    unsafe fn add(self, other: Self) -> Self;
    /// Lane-wise `self - other`.
    unsafe fn sub(self, other: Self) -> Self;
    /// Lane-wise `self * other`.
    unsafe fn mul(self, other: Self) -> Self;
    /// Lane-wise `self * b + c`, rounded once (the scalar set computes it
    /// in f64, which rounds the same but for rare double roundings).
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// Lane-wise `if self > other { self } else { other }`: a NaN in `other`
    /// is kept, as x86's `maxps` does.
    unsafe fn max(self, other: Self) -> Self;
    /// Lane-wise `if self < threshold { 0 } else { value }` (false for NaN).
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self;
    /// `2^n` for lanes holding whole numbers `n` in `[-126, 127]`.
    unsafe fn exp2_int(self) -> Self;
    /// The largest lane (NaN lanes may be ignored).
    unsafe fn reduce_max(self) -> f32;
    /// The sum of the lanes.
    unsafe fn reduce_sum(self) -> f32;
    /// Asks the CPU to start loading the cache line at `ptr` (a hint: any
    /// address is allowed, nothing is read).
    unsafe fn prefetch(ptr: *const f32);
}
