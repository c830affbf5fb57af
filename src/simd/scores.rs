//! The score kernels, `S = Q·Kᵀ` for a tile of query rows:
//!
//! - [`Scores`]: against a packed key tile, register-tiled `ROWS` rows ×
//!   `KEY_VECTORS` vectors of keys (the prefill and backward passes);
//! - [`RowScores`]: against keys read in place from their rows, vectorised
//!   along `d` with the next rows prefetched (decoding, where a few queries
//!   meet many keys and reading each key once matters more than tiling).

use ndarray::ArrayView2;

use super::kernel::KernelOp;
use super::layout::{Rows, prefetch_row, prefetch_rows_ahead};
use super::rows::dot_lanes_block;
use super::vector::{Load, Vector};

/// `s[r][j] = Σ_d q[r][d] · k[j][d]` for the rows of `q` (a multiple of
/// `ROWS`) and the keys of `k_panels` (a multiple of the key panel,
/// `KEY_VECTORS·LANES`).
///
/// `q` is row-major `[rows][d]`; `k_panels` holds the keys in panels of
/// `KEY_VECTORS·LANES` keys, each panel `[d][KEY_VECTORS·LANES]` (key index
/// fastest), so one step of `d` loads `KEY_VECTORS` vectors of keys and
/// broadcasts one value per row. `s` has row stride `s_stride`.
pub(crate) struct Scores<'a> {
    pub q: &'a [f32],
    pub d: usize,
    pub k_panels: &'a [f32],
    pub s: &'a mut [f32],
    pub s_stride: usize,
}

impl KernelOp for Scores<'_> {
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
        let Scores {
            q,
            d,
            k_panels,
            s,
            s_stride,
        } = self;
        let panel = KEY_VECTORS * V::LANES;
        assert!(d > 0);
        let (rows, keys) = (q.len() / d, k_panels.len() / d);
        assert!(rows * d == q.len() && rows.is_multiple_of(ROWS));
        assert!(keys * d == k_panels.len() && keys.is_multiple_of(panel) && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        let (q, k_panels, s) = (q.as_ptr(), k_panels.as_ptr(), s.as_mut_ptr());
        // SAFETY: the caller guarantees V's instruction set; every offset
        // stays inside the sizes checked above, as the loop bounds show.
        unsafe {
            for r0 in (0..rows).step_by(ROWS) {
                let q_rows = q.add(r0 * d);
                for p in 0..keys / panel {
                    let k = k_panels.add(p * panel * d);
                    let mut acc = [[V::splat(0.0); KEY_VECTORS]; ROWS];
                    for dd in 0..d {
                        let k_vectors: [V; KEY_VECTORS] =
                            std::array::from_fn(|c| V::load(k.add(dd * panel + c * V::LANES)));
                        for (r, acc_row) in acc.iter_mut().enumerate() {
                            let q_value = V::splat(*q_rows.add(r * d + dd));
                            for (a, &kv) in acc_row.iter_mut().zip(&k_vectors) {
                                *a = q_value.mul_add(kv, *a);
                            }
                        }
                    }
                    for (r, acc_row) in acc.iter().enumerate() {
                        let out = s.add((r0 + r) * s_stride + p * panel);
                        for (c, a) in acc_row.iter().enumerate() {
                            a.store(out.add(c * V::LANES));
                        }
                    }
                }
            }
        }
    }
}

/// `s[r][j] = Σ_d q[r][d] · k[j][d]` for the rows of `q` (`[rows][d]`, `d` a
/// multiple of `LANES`) and the keys that are the rows of `k` (`[keys][d]`,
/// rows contiguous), read in place, in `f32` or widened from half
/// precision as they are loaded ([`Load`]). `s` has row stride `s_stride`.
pub(crate) struct RowScores<'a, E> {
    pub q: &'a [f32],
    pub d: usize,
    pub k: ArrayView2<'a, E>,
    pub s: &'a mut [f32],
    pub s_stride: usize,
}

impl<E: Load> KernelOp for RowScores<'_, E> {
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
        let RowScores {
            q,
            d,
            k,
            s,
            s_stride,
        } = self;
        assert!(d > 0 && d.is_multiple_of(V::LANES) && k.ncols() == d);
        let (rows, keys) = (q.len() / d, k.nrows());
        assert!(rows * d == q.len() && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        let (q, k, s) = (q.as_ptr(), Rows::of(&k), s.as_mut_ptr());
        let rows_ahead = prefetch_rows_ahead(d * size_of::<E>());
        let block = RowScoreBlock {
            q,
            d,
            k,
            s,
            s_stride,
            rows,
            rows_ahead,
        };
        // SAFETY: the caller guarantees V's instruction set; `k` holds the
        // contiguous rows of a view of `keys` rows of `d`, and every offset
        // stays inside the sizes checked above.
        unsafe {
            // Keys outer, rows inner: each key row comes from memory once
            // and serves every query row while it is in L1. Two keys by
            // two rows at a time: four keys for one row measured 6–8%
            // slower on an `f32` decode (Zen 3), two the same as one.
            let mut j = 0;
            while j + 2 <= keys {
                block.keys::<V, 2>(j);
                j += 2;
            }
            for j in j..keys {
                block.keys::<V, 1>(j);
            }
        }
    }
}

/// The sizes and pointers of a [`RowScores`] call.
#[derive(Clone, Copy)]
struct RowScoreBlock<E> {
    q: *const f32,
    d: usize,
    k: Rows<E>,
    s: *mut f32,
    s_stride: usize,
    rows: usize,
    rows_ahead: usize,
}

impl<E: Load> RowScoreBlock<E> {
    /// The scores of keys `j0..j0 + K` for every query row, two rows at a
    /// time; the rows `rows_ahead` keys on are prefetched.
    ///
    /// # Safety
    /// The CPU has `V`'s instruction set; the keys are inside `k`, as
    /// [`RowScores`] checks.
    #[inline(always)]
    unsafe fn keys<V: Vector, const K: usize>(self, j0: usize) {
        // SAFETY: the caller's; rows `r < rows` and keys `j0 + c < keys`.
        unsafe {
            let keys: [*const E; K] = std::array::from_fn(|c| self.k.row(j0 + c));
            for c in 0..K {
                prefetch_row::<V, _>(self.k, j0 + c + self.rows_ahead, self.d);
            }
            let mut r = 0;
            while r + 2 <= self.rows {
                self.store(
                    r,
                    j0,
                    dot_lanes_block::<V, E, 2, K>(self.q_rows(r), keys, self.d),
                );
                r += 2;
            }
            if r < self.rows {
                self.store(
                    r,
                    j0,
                    dot_lanes_block::<V, E, 1, K>(self.q_rows(r), keys, self.d),
                );
            }
        }
    }

    /// The `R` query rows from row `r` on.
    ///
    /// # Safety
    /// Those rows are inside `q`.
    #[inline(always)]
    unsafe fn q_rows<const R: usize>(self, r: usize) -> [*const f32; R] {
        // SAFETY: the caller's.
        std::array::from_fn(|i| unsafe { self.q.add((r + i) * self.d) })
    }

    /// Stores the reduced sums of rows `r..r + R`, keys `j0..j0 + K`.
    ///
    /// # Safety
    /// Those scores are inside `s`.
    #[inline(always)]
    unsafe fn store<V: Vector, const R: usize, const K: usize>(
        self,
        r: usize,
        j0: usize,
        sums: [[V; K]; R],
    ) {
        for (i, row) in sums.iter().enumerate() {
            for (c, sum) in row.iter().enumerate() {
                // SAFETY: the caller's.
                unsafe { *self.s.add((r + i) * self.s_stride + j0 + c) = sum.reduce_sum() };
            }
        }
    }
}
