//! How the kernels address matrices they read in place (rather than from
//! packed buffers): [`Rows`] of keys or values, [`Weights`] with any
//! strides, and the software prefetch of rows ahead of use.

use ndarray::ArrayView2;

use super::kernel::KernelOp;
use super::vector::Vector;

/// Rows of a matrix of `E` in memory: row `j` starts at `ptr + j·stride`.
pub(crate) struct Rows<E = f32> {
    pub ptr: *const E,
    pub stride: isize,
}

// By hand: a derive would ask `E: Copy`, which a pointer does not need.
impl<E> Clone for Rows<E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Rows<E> {}

impl<E> Rows<E> {
    /// The rows of `view`.
    ///
    /// # Panics
    /// When a row of `view` is not contiguous.
    pub(crate) fn of(view: &ArrayView2<'_, E>) -> Self {
        assert!(
            view.ncols() <= 1 || view.strides()[1] == 1,
            "rows must be contiguous"
        );
        Self {
            ptr: view.as_ptr(),
            stride: view.strides()[0],
        }
    }

    /// The start of row `j`.
    ///
    /// # Safety
    /// Row `j` exists in the matrix these rows describe.
    #[inline(always)]
    pub(crate) unsafe fn row(self, j: usize) -> *const E {
        // SAFETY: the caller guarantees row `j` is in the matrix.
        unsafe { self.ptr.offset(j as isize * self.stride) }
    }
}

/// A matrix of weights in memory with any strides: entry `(r, j)` is at
/// `ptr + r·row_stride + j·key_stride` (so a transposed tile is the same
/// memory with the strides swapped).
#[derive(Clone, Copy)]
pub(crate) struct Weights {
    pub ptr: *const f32,
    pub row_stride: isize,
    pub key_stride: isize,
}

impl Weights {
    /// The entries of `view`.
    pub(crate) fn of(view: &ArrayView2<'_, f32>) -> Self {
        let strides = view.strides();
        Self {
            ptr: view.as_ptr(),
            row_stride: strides[0],
            key_stride: strides[1],
        }
    }

    /// The same matrix from row `r` on.
    ///
    /// # Safety
    /// Row `r` exists in the matrix.
    #[inline(always)]
    pub(crate) unsafe fn starting_at_row(self, r: usize) -> Self {
        Self {
            // SAFETY: the caller guarantees row `r` is in the matrix.
            ptr: unsafe { self.ptr.offset(r as isize * self.row_stride) },
            ..self
        }
    }
}

/// How many rows of `row_bytes` ahead the in-place kernels ask for: at
/// least 16 rows, and on a CPU other than Intel's at least 8 KiB.
///
/// Chosen by vendor because the two measured differently (H = 32 decode,
/// one thread, `docs/PERFORMANCE.md`): on an Intel Xeon (family 6 model
/// 167, hint into L2) 16, 24 and 32 rows of `f32` at d = 128 ran alike
/// (S = 16384: 46.5–47.2 ms; 8 rows into L1 53.5–54.0), and 8 KiB ahead
/// for a `bf16` cache (32 rows) 4% slower than 16 rows. On an AMD Zen 4
/// (family 25 model 17) 16 rows of `bf16` (4 KiB) left the cache step
/// at 0.58–0.60× the `f32` step's time, 24 to 48 rows (6–12 KiB) at
/// 0.47–0.50×; at d = 64, 16 `bf16` rows (2 KiB) 0.74×, 12 KiB 0.53×.
pub(crate) fn prefetch_rows_ahead(row_bytes: usize) -> usize {
    const ROWS: usize = 16;
    const BYTES_OFF_INTEL: usize = 8 * 1024;
    if super::cpu::is_intel() {
        ROWS
    } else {
        ROWS.max(BYTES_OFF_INTEL.div_ceil(row_bytes.max(1)))
    }
}

/// Prefetches the `len` elements at the start of row `j`, a cache line
/// (64 bytes) at a time (a hint: the row need not exist, since
/// prefetching reads nothing).
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
pub(crate) unsafe fn prefetch_row<V: Vector, E>(rows: Rows<E>, j: usize, len: usize) {
    const LINE: usize = 64;
    // The address is computed with wrapping arithmetic, so it may lie past
    // the matrix: prefetching is a hint that never faults.
    let start = rows
        .ptr
        .wrapping_offset(j as isize * rows.stride)
        .cast::<u8>();
    for byte in (0..len * size_of::<E>()).step_by(LINE) {
        // SAFETY: the caller guarantees V's instruction set; `prefetch`
        // accepts any address.
        unsafe { V::prefetch(start.wrapping_add(byte)) };
    }
}

/// Prefetches every cache line of `x` into L2: for numbers a driver will
/// read soon and would otherwise first touch in memory, with a stall
/// (the next query tile's rows, while this one runs).
pub(crate) struct PrefetchLines<'a> {
    pub x: &'a [f32],
}

impl KernelOp for PrefetchLines<'_> {
    type Output = ();

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) {
        let rows = Rows::of(&ArrayView2::from_shape((1, self.x.len()), self.x).expect("one row"));
        // SAFETY: the caller guarantees V's instruction set.
        unsafe { prefetch_row::<V, f32>(rows, 0, self.x.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetching_looks_16_rows_ahead_on_intel_and_8_kib_elsewhere() {
        for row_bytes in [1, 128, 256, 512, 1024, 4096] {
            let rows = prefetch_rows_ahead(row_bytes);
            if crate::simd::cpu::is_intel() {
                assert_eq!(rows, 16, "{row_bytes}-byte rows");
            } else {
                assert!(
                    rows >= 16 && rows * row_bytes >= 8 * 1024,
                    "{row_bytes}: {rows}"
                );
                assert!(
                    rows == 16 || (rows - 1) * row_bytes < 8 * 1024,
                    "{row_bytes}: {rows}"
                );
            }
        }
    }
}
