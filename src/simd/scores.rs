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
use super::rows::dot_lanes;
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
        // SAFETY: the caller guarantees V's instruction set; `k` holds the
        // contiguous rows of a view of `keys` rows of `d`, and every offset
        // stays inside the sizes checked above.
        unsafe {
            for j in 0..keys {
                let key = k.row(j);
                prefetch_row::<V, _>(k, j + rows_ahead, d);
                for r in 0..rows {
                    let score = dot_lanes::<V, E>(q.add(r * d), key, d);
                    *s.add(r * s_stride + j) = score.reduce_sum();
                }
            }
        }
    }
}
