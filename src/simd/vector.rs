//! [`Vector`]: the few operations on a register of `f32` lanes that the
//! kernels need, implemented once per instruction set (in `scalar.rs`,
//! `avx2.rs`, `avx512.rs`, `neon.rs`). The kernels are written against this
//! trait only.

/// A register of `LANES` `f32` values.
///
/// Every method is an `unsafe fn` whose caller promises that the CPU has the
/// implementing type's instruction set; the pointer methods also need
/// `LANES` readable (or writable) `f32`s at the pointer, with no alignment
/// required. A [`Kernel`](super::kernel::Kernel) value is what proves the
/// first: the kernels call these methods only inside its `run`.
///
/// # Safety
/// An implementer promises that each method is sound when called as its
/// `# Safety` section says, and that the loads and `store` touch no memory
/// beyond the `LANES` elements at the pointer (the kernels check their
/// buffer sizes in units of `LANES`).
pub(crate) unsafe trait Vector: Copy {
    /// Number of `f32` lanes.
    const LANES: usize;

    /// Every lane set to `x`.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn splat(x: f32) -> Self;
    /// `LANES` values read from `ptr`.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; `LANES` `f32`s are
    /// readable at `ptr`.
    unsafe fn load(ptr: *const f32) -> Self;
    /// Lane `i` read from `ptr + i·stride`: a column of a row-major
    /// matrix. By default one lane at a time; a set with a gather
    /// instruction overrides it.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; the `LANES` `f32`s are
    /// readable; `|stride|·15` fits in `i32` (the gathers' offsets).
    #[inline(always)]
    unsafe fn gather(ptr: *const f32, stride: isize) -> Self {
        let mut lanes = [0.0f32; 16];
        // SAFETY: the lanes are readable (the caller's), and LANES ≤ 16
        // (every set's, checked where the kernels are compiled).
        unsafe {
            for (i, lane) in lanes.iter_mut().take(Self::LANES).enumerate() {
                *lane = *ptr.offset(i as isize * stride);
            }
            Self::load(lanes.as_ptr())
        }
    }
    /// `LANES` `bf16`s (their bits) read from `ptr`, widened to `f32`
    /// exactly: a `bf16` is the top half of an `f32`. A NaN keeps its bits
    /// (a signaling NaN is quieted by the first arithmetic on it).
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; `LANES` `u16`s are
    /// readable at `ptr`.
    #[cfg(feature = "half")]
    unsafe fn load_bf16(ptr: *const u16) -> Self;
    /// `LANES` `f16`s (their bits) read from `ptr`, widened to `f32`
    /// exactly (every `f16` is an `f32`, subnormals included).
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; `LANES` `u16`s are
    /// readable at `ptr`.
    #[cfg(feature = "half")]
    unsafe fn load_f16(ptr: *const u16) -> Self;
    /// Writes the lanes to `ptr`.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; `LANES` `f32`s are
    /// writable at `ptr`.
    unsafe fn store(self, ptr: *mut f32);
    /// Lane-wise `self + other`.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn add(self, other: Self) -> Self;
    /// Lane-wise `self - other`.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn sub(self, other: Self) -> Self;
    /// Lane-wise `self * other`.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn mul(self, other: Self) -> Self;
    /// Lane-wise `self / other`, correctly rounded.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn div(self, other: Self) -> Self;
    /// Lane-wise `self * b + c`, rounded once (the scalar set computes it
    /// in f64, which rounds the same but for rare double roundings).
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// Lane-wise `if self > other { self } else { other }`: a NaN in `other`
    /// is kept, as x86's `maxps` does.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn max(self, other: Self) -> Self;
    /// Lane-wise `if self < other { self } else { other }`: a NaN in
    /// `other` is kept, as x86's `minps` does.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn min(self, other: Self) -> Self;
    /// Lane-wise `if self < threshold { 0 } else { value }` (false for NaN).
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self;
    /// Whether every lane is less than the same lane of `threshold` (false
    /// when a lane is NaN): lets a kernel skip work no lane needs.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn all_less(self, threshold: Self) -> bool;
    /// `2^n` for lanes holding whole numbers `n` in `[-126, 128]` (`2^128`
    /// is the bit pattern of `+inf`). Any other lane below 128 (NaN, `−inf`,
    /// a huge negative number) gives some number and nothing worse: `exp`
    /// discards those lanes.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn exp2_int(self) -> Self;
    /// `self·2^n` for lanes of `n` holding whole numbers in `[-126, 128]`:
    /// by default `self·exp2_int(n)`, one rounding, so a product past
    /// `f32::MAX` is `+inf` and one below `2^-126` subnormal. A set with
    /// an instruction for it overrides this (AVX-512's `vscalefps`: one
    /// instruction instead of four in the softmax's `exp`); it may give a
    /// finite product where `2^128` itself would be `+inf`, the only
    /// difference.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    #[inline(always)]
    unsafe fn scale_by_exp2(self, n: Self) -> Self {
        // SAFETY: the caller guarantees the instruction set.
        unsafe { self.mul(n.exp2_int()) }
    }
    /// The largest lane (NaN lanes may be ignored).
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn reduce_max(self) -> f32;
    /// The sum of the lanes.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn reduce_sum(self) -> f32;
    /// Lane `r` of the result is the sum of `rows[r]`'s lanes, for
    /// `LANES` rows at once: a transposing reduction, which shares its
    /// shuffles between rows where [`reduce_sum`](Self::reduce_sum) pays
    /// a chain of them per row. The order of the additions may differ
    /// from `reduce_sum`'s.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; `rows.len() == LANES`.
    #[inline(always)]
    unsafe fn reduce_sums(rows: &[Self]) -> Self {
        let mut sums = [0.0f32; 16];
        for (sum, row) in sums.iter_mut().zip(rows) {
            // SAFETY: the caller's instruction set.
            *sum = unsafe { row.reduce_sum() };
        }
        // SAFETY: LANES ≤ 16 (every set's), so `sums` holds a vector.
        unsafe { Self::load(sums.as_ptr()) }
    }
    /// Lane `r` of the result is the largest lane of `rows[r]` (NaN lanes
    /// may be ignored), for `LANES` rows at once, as
    /// [`reduce_sums`](Self::reduce_sums).
    ///
    /// # Safety
    /// As [`reduce_sums`](Self::reduce_sums).
    #[inline(always)]
    unsafe fn reduce_maxes(rows: &[Self]) -> Self {
        let mut maxes = [f32::NEG_INFINITY; 16];
        for (max, row) in maxes.iter_mut().zip(rows) {
            // SAFETY: the caller's instruction set.
            *max = unsafe { row.reduce_max() };
        }
        // SAFETY: as in `reduce_sums`.
        unsafe { Self::load(maxes.as_ptr()) }
    }
    /// Whether [`transpose`](Self::transpose) runs in registers (then a
    /// transposing copy loads rows and transposes them), or goes through
    /// memory (then it gathers columns instead).
    const TRANSPOSES_IN_REGISTERS: bool = false;
    /// Transposes the `LANES × LANES` block whose rows are `rows`: lane
    /// `j` of row `i` becomes lane `i` of row `j`. By default through
    /// memory; a set with a shuffle sequence for it overrides it.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`; `rows.len() == LANES`.
    #[inline(always)]
    unsafe fn transpose(rows: &mut [Self]) {
        assert_eq!(rows.len(), Self::LANES);
        let mut block = [[0.0f32; 16]; 16];
        // SAFETY: the caller's instruction set; each row of `block` holds
        // a vector (LANES ≤ 16, every set's), as does `column`.
        unsafe {
            for (row, stored) in rows.iter().zip(&mut block) {
                row.store(stored.as_mut_ptr());
            }
            for (j, row) in rows.iter_mut().enumerate() {
                let mut column = [0.0f32; 16];
                for (i, x) in column.iter_mut().take(Self::LANES).enumerate() {
                    *x = block[i][j];
                }
                *row = Self::load(column.as_ptr());
            }
        }
    }
    /// Asks the CPU to start loading the cache line at `ptr` into L2 (a
    /// hint: any address is allowed, nothing is read). L2, not L1: a core
    /// tracks about 16 misses into L1 but 48 or more into L2, and a stream
    /// needs that many lines in flight to reach the memory read rate.
    ///
    /// # Safety
    /// The CPU has the instruction set of `Self`.
    unsafe fn prefetch(ptr: *const u8);
}

/// An element type the in-place kernels read as `f32` lanes: `f32`, and
/// `bf16` and `f16` widened by the load itself, so a half-precision KV
/// cache is read once, in its own bytes, with no widened copy.
pub(crate) trait Load: Copy + Send + Sync + 'static {
    /// Whether [`Load::load`] converts (half precision) rather than reads
    /// `f32` as it is: a widened vector needs a register of its own before
    /// it is used, where an `f32` one can be an FMA's memory operand.
    const WIDENS: bool;

    /// `V::LANES` elements read from `ptr`, as `f32` (exactly: every
    /// element of these types is an `f32`).
    ///
    /// # Safety
    /// The CPU has `V`'s instruction set; `V::LANES` elements are readable
    /// at `ptr`.
    unsafe fn load<V: Vector>(ptr: *const Self) -> V;

    /// This element as `f32` (exactly), one at a time.
    fn to_f32(self) -> f32;

    /// `x` itself when the elements are `f32` already, so that packing
    /// copies them as they are; `None` for the types it widens.
    fn as_f32<'a>(x: ndarray::ArrayView2<'a, Self>) -> Option<ndarray::ArrayView2<'a, f32>>;
}

impl Load for f32 {
    const WIDENS: bool = false;

    #[inline(always)]
    unsafe fn load<V: Vector>(ptr: *const f32) -> V {
        // SAFETY: the caller's guarantees are `V::load`'s.
        unsafe { V::load(ptr) }
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn as_f32<'a>(x: ndarray::ArrayView2<'a, f32>) -> Option<ndarray::ArrayView2<'a, f32>> {
        Some(x)
    }
}

#[cfg(feature = "half")]
impl Load for half::bf16 {
    const WIDENS: bool = true;

    #[inline(always)]
    unsafe fn load<V: Vector>(ptr: *const half::bf16) -> V {
        // SAFETY: the caller's guarantees are `V::load_bf16`'s; a `bf16` is
        // its 16 bits.
        unsafe { V::load_bf16(ptr.cast()) }
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }

    fn as_f32<'a>(_: ndarray::ArrayView2<'a, Self>) -> Option<ndarray::ArrayView2<'a, f32>> {
        None
    }
}

#[cfg(feature = "half")]
impl Load for half::f16 {
    const WIDENS: bool = true;

    #[inline(always)]
    unsafe fn load<V: Vector>(ptr: *const half::f16) -> V {
        // SAFETY: the caller's guarantees are `V::load_f16`'s; an `f16` is
        // its 16 bits.
        unsafe { V::load_f16(ptr.cast()) }
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }

    fn as_f32<'a>(_: ndarray::ArrayView2<'a, Self>) -> Option<ndarray::ArrayView2<'a, f32>> {
        None
    }
}
