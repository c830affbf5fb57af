//! The kernels of the fused path, written once, generic over [`Vector`]:
//!
//! - [`exp`]: `e^x` for `x ≤ 0` in every lane;
//! - [`scores`]: `S = Q·Kᵀ` for a query tile against a packed key tile,
//!   register-tiled `MR` rows × `NV` vectors of keys;
//! - [`softmax_rows`]: the online-softmax row pass: running max, `exp`,
//!   running sum, and the factor `α` that rescales what was accumulated;
//! - [`accumulate_values`]: `O = α·O + P·V`, register-tiled `MR` rows ×
//!   `NV` vectors of value columns.
//!
//! Tiles are padded by the driver (rows to a multiple of `MR`, keys to a
//! multiple of the key panel, value columns to a multiple of the lanes), so
//! the kernels have no ragged edges: padding is computed and thrown away.
//!
//! The [`Kernel`] trait is what the driver sees: safe methods that check
//! every buffer length, then call an instruction set's `#[target_feature]`
//! instantiation of these functions.

use ndarray::ArrayView2;

use super::vector::Vector;

/// Rows of a matrix in memory: row `j` starts at `ptr + j·stride`.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub ptr: *const f32,
    pub stride: isize,
}

impl Rows {
    /// The rows of `view`, whose last axis must be contiguous.
    fn of(view: &ArrayView2<'_, f32>) -> Self {
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
    unsafe fn row(self, j: usize) -> *const f32 {
        // SAFETY: the caller guarantees row `j` is in the matrix.
        unsafe { self.ptr.offset(j as isize * self.stride) }
    }
}

// e^x = 2^n · e^r with n = round(x / ln 2) and r = x − n·ln 2 in
// [−ln2/2, ln2/2]; e^r is a degree-6 polynomial, 2^n is built in the exponent
// bits. Measured maximum error on [−87.3, 0]: see `tests::exp_max_ulp_error`
// and the doc of `exp`.

/// Below `ln(2^-126)`, e^x is subnormal in `f32`; `exp` returns 0 there, so
/// `2^n` never leaves the normal range and `−inf` gives 0 without a NaN.
pub(crate) const EXP_MIN_INPUT: f32 = -87.336_55;
/// log2(e): x·LOG2_E rounded is `n`.
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cody and Waite): LN2_HI has only 9 significant bits, so
/// `n·LN2_HI` is exact for every `n` here, with or without a fused
/// multiply-add, and `x − n·LN2_HI` loses nothing.
const LN2_HI: f32 = 0.693_359_4;
/// ln 2 − LN2_HI, the rest of ln 2.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding 1.5·2^23 rounds a float of magnitude < 2^22 to a whole number
/// (round-half-even in the default rounding mode); subtracting it back gives
/// that whole number as a float.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Polynomial for e^r on [−ln2/2, ln2/2], coefficients of r^0 … r^6: the
/// constant is exactly 1 (so `exp(0) = 1`), the rest minimise the largest
/// error in ulps (Lawson's algorithm in f64; 0.16 ulp once rounded to f32).
///
/// Degree 6, not 5: the best degree-5 fit, coefficients tuned after rounding,
/// still measured 2.015 ulp over every input, past the 2 ulp bound. The
/// sixth degree costs one fused multiply-add per vector.
const EXP_POLY: [f32; 7] = [
    1.0,
    1.0,
    0.499_999_9,
    0.166_664_48,
    0.041_668_534,
    0.008_373_16,
    0.001_381_587,
];

/// `e^x` in every lane, for `x ≤ 0` (and up to 88.7).
///
/// Measured maximum error 1.02 ulp against `e^x` computed in f64, over every
/// `f32` in [−87.3, 0], on every kernel set (the exhaustive test
/// `exp_is_within_two_ulp_exhaustively`, which asserts ≤ 2 ulp). Below [`EXP_MIN_INPUT`] the result is 0, so
/// `exp(−inf) = 0` with no intermediate NaN; NaN gives NaN.
#[inline(always)]
pub(crate) unsafe fn exp<V: Vector>(x: V) -> V {
    // SAFETY (for the whole body): the caller runs on a CPU with V's
    // instruction set, and only register operations follow.
    unsafe {
        // `max` keeps a NaN in its second operand, so NaN goes through.
        let clamped = V::splat(EXP_MIN_INPUT).max(x);
        let magic = V::splat(ROUND_MAGIC);
        let n = clamped.mul_add(V::splat(LOG2_E), magic).sub(magic);
        let r = n.mul_add(V::splat(-LN2_HI), clamped);
        let r = n.mul_add(V::splat(-LN2_LO), r);
        let mut p = V::splat(EXP_POLY[6]);
        for &c in EXP_POLY[..6].iter().rev() {
            p = p.mul_add(r, V::splat(c));
        }
        x.zero_where_less(V::splat(EXP_MIN_INPUT), p.mul(n.exp2_int()))
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
    fn of(view: &ArrayView2<'_, f32>) -> Self {
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
    unsafe fn starting_at_row(self, r: usize) -> Self {
        // SAFETY: the caller guarantees row `r` is in the matrix.
        Self {
            ptr: unsafe { self.ptr.offset(r as isize * self.row_stride) },
            ..self
        }
    }

    /// Entry `(r, j)`.
    ///
    /// # Safety
    /// The entry exists in the matrix.
    #[inline(always)]
    unsafe fn at(self, r: usize, j: usize) -> f32 {
        // SAFETY: the caller guarantees the entry is in the matrix.
        unsafe {
            *self
                .ptr
                .offset(r as isize * self.row_stride + j as isize * self.key_stride)
        }
    }
}

/// `s[r][j] = Σ_d q[r][d] · k[j][d]` for `rows` query rows (a multiple of
/// `MR`) and `keys` keys (a multiple of `NV·LANES`).
///
/// `q` is row-major `[rows][d]`; `k_panels` holds the keys in panels of
/// `NV·LANES` keys, each panel `[d][NV·LANES]` (key index fastest), so one
/// step of `d` loads `NV` vectors of keys and broadcasts one value per row.
///
/// # Safety
/// V's instruction set is available; `q` has `rows·d`, `k_panels` has
/// `keys·d`, and `s` has `(rows − 1)·s_stride + keys` elements.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn scores<V: Vector, const MR: usize, const NV: usize>(
    q: *const f32,
    rows: usize,
    d: usize,
    k_panels: *const f32,
    keys: usize,
    s: *mut f32,
    s_stride: usize,
) {
    let panel = NV * V::LANES;
    // SAFETY (for the whole body): every offset below stays inside the
    // buffer sizes the caller guarantees, as the loop bounds show.
    unsafe {
        for r0 in (0..rows).step_by(MR) {
            let q_rows = q.add(r0 * d);
            for p in 0..keys / panel {
                let k = k_panels.add(p * panel * d);
                let mut acc = [[V::splat(0.0); NV]; MR];
                for dd in 0..d {
                    let k_vectors: [V; NV] =
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

/// How many rows ahead the in-place kernels ask for: at d = 128, 8 rows are
/// 4 KiB, enough to cover memory latency at full bandwidth.
const PREFETCH_ROWS_AHEAD: usize = 8;

/// Prefetches the `len` values at the start of row `j` (a hint: the row
/// need not exist, since prefetching reads nothing).
#[inline(always)]
unsafe fn prefetch_row<V: Vector>(rows: Rows, j: usize, len: usize) {
    // SAFETY: prefetching is a hint that never faults; the address is
    // computed with wrapping arithmetic, so it may lie past the matrix.
    unsafe {
        let start = rows.ptr.wrapping_offset(j as isize * rows.stride);
        for c in (0..len).step_by(16) {
            V::prefetch(start.wrapping_add(c));
        }
    }
}

/// `s[r][j] = Σ_d q[r][d] · k[j][d]` for `rows` query rows and `keys` keys
/// read straight from their rows, vectorised along `d` (a multiple of
/// `V::LANES`): the decoding kernel, where a few queries meet many keys and
/// reading each key once matters more than register tiling.
///
/// # Safety
/// V's instruction set is available; `q` has `rows·d` elements, `k` has
/// `keys` rows of at least `d`, and `s` has `(rows − 1)·s_stride + keys`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn row_scores<V: Vector>(
    q: *const f32,
    rows: usize,
    d: usize,
    k: Rows,
    keys: usize,
    s: *mut f32,
    s_stride: usize,
) {
    // SAFETY (for the whole body): offsets stay inside the sizes above.
    unsafe {
        for j in 0..keys {
            let key = k.row(j);
            prefetch_row::<V>(k, j + PREFETCH_ROWS_AHEAD, d);
            for r in 0..rows {
                let query = q.add(r * d);
                // Two accumulators halve the chain of dependent FMAs.
                let (mut even, mut odd) = (V::splat(0.0), V::splat(0.0));
                let mut c = 0;
                while c + 2 * V::LANES <= d {
                    even = V::load(query.add(c)).mul_add(V::load(key.add(c)), even);
                    odd = V::load(query.add(c + V::LANES))
                        .mul_add(V::load(key.add(c + V::LANES)), odd);
                    c += 2 * V::LANES;
                }
                if c < d {
                    even = V::load(query.add(c)).mul_add(V::load(key.add(c)), even);
                }
                *s.add(r * s_stride + j) = even.add(odd).reduce_sum();
            }
        }
    }
}

/// The online-softmax pass over one tile of scores, row by row:
///
/// ```text
/// m' = max(m, max_j s[j]);  α = e^(m − m');  s[j] ← e^(s[j] − m');  ℓ' = α·ℓ + Σ_j s[j]
/// ```
///
/// `max`, `sum` and `alpha` hold `m`, `ℓ` and `α` per row. A row whose `m'`
/// is `−inf` (nothing visible yet) gets `s = 0` and `α = 1`, never NaN.
/// Masked scores must be `−inf` on entry; they leave as exactly 0.
///
/// # Safety
/// V's instruction set is available; `keys` is a multiple of `V::LANES`; `s`
/// has `(rows − 1)·s_stride + keys` elements; `max`, `sum`, `alpha` have `rows`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn softmax_rows<V: Vector>(
    s: *mut f32,
    rows: usize,
    keys: usize,
    s_stride: usize,
    max: *mut f32,
    sum: *mut f32,
    alpha: *mut f32,
) {
    // SAFETY (for the whole body): offsets stay within the sizes above.
    unsafe {
        for r in 0..rows {
            let row = s.add(r * s_stride);
            let mut row_max = V::splat(f32::NEG_INFINITY);
            for j in (0..keys).step_by(V::LANES) {
                row_max = V::load(row.add(j)).max(row_max);
            }
            let old_max = *max.add(r);
            let new_max = row_max.reduce_max().max(old_max);
            if new_max == f32::NEG_INFINITY {
                for j in (0..keys).step_by(V::LANES) {
                    V::splat(0.0).store(row.add(j));
                }
                *alpha.add(r) = 1.0;
                continue;
            }
            let shift = V::splat(new_max);
            let mut row_sum = V::splat(0.0);
            for j in (0..keys).step_by(V::LANES) {
                let p = exp(V::load(row.add(j)).sub(shift));
                p.store(row.add(j));
                row_sum = row_sum.add(p);
            }
            // The same exp, one lane: e^(−inf) = 0 on the first visible tile.
            let a = exp::<f32>(old_max - new_max);
            *alpha.add(r) = a;
            *sum.add(r) = a * *sum.add(r) + row_sum.reduce_sum();
            *max.add(r) = new_max;
        }
    }
}

/// `s[r][j] ← e^(s[r][j] − shift[r])` for `rows` rows of `keys` scores (a
/// multiple of `V::LANES`): the weights recomputed from the forward's
/// log-sum-exp in the backward pass. A row whose shift is `−inf` saw no key
/// and becomes 0; masked scores (`−inf`) become exactly 0.
///
/// # Safety
/// V's instruction set is available; `s` has `(rows − 1)·s_stride + keys`
/// elements and `shift` has `rows`.
#[inline(always)]
pub(crate) unsafe fn exp_rows_shifted<V: Vector>(
    s: *mut f32,
    rows: usize,
    keys: usize,
    s_stride: usize,
    shift: *const f32,
) {
    // SAFETY (for the whole body): offsets stay within the sizes above.
    unsafe {
        for r in 0..rows {
            let row = s.add(r * s_stride);
            let shift = *shift.add(r);
            for j in (0..keys).step_by(V::LANES) {
                let p = if shift == f32::NEG_INFINITY {
                    V::splat(0.0)
                } else {
                    exp(V::load(row.add(j)).sub(V::splat(shift)))
                };
                p.store(row.add(j));
            }
        }
    }
}

/// `o[r] ← α[r]·o[r] + Σ_j p[r][j]·v[j]` for `rows` rows and `keys` keys; the first `value_width` columns (a multiple of
/// `V::LANES`) of `v`'s rows and of row-major `o`, `NV` vectors at a time.
///
/// # Safety
/// V's instruction set is available; `p` has `rows` rows of `keys`
/// entries, `v` has `keys` rows of at least `value_width`, `o` has
/// `rows·value_width` and `alpha` has `rows` elements.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn accumulate_values<V: Vector, const MR: usize, const NV: usize>(
    p: Weights,
    rows: usize,
    keys: usize,
    v: Rows,
    value_width: usize,
    alpha: *const f32,
    o: *mut f32,
) {
    let vectors = value_width / V::LANES;
    // SAFETY (for the whole body): each block covers rows r0..r0+MR (or the
    // last few rows) inside the sizes the caller guarantees.
    unsafe {
        let block = |r0: usize| ValueBlock {
            p: p.starting_at_row(r0),
            keys,
            v,
            value_width,
            alpha: alpha.add(r0),
            o: o.add(r0 * value_width),
        };
        let whole = rows - rows % MR;
        for r0 in (0..whole).step_by(MR) {
            block(r0).run_columns::<V, MR, NV>(vectors);
        }
        // The last few rows (decoding has one to a few), with a shorter
        // register tile rather than padding rows that would cost as much
        // as real ones.
        match rows - whole {
            0 => {}
            1 => block(whole).run_columns::<V, 1, NV>(vectors),
            2 => block(whole).run_columns::<V, 2, NV>(vectors),
            3 => block(whole).run_columns::<V, 3, NV>(vectors),
            4 => block(whole).run_columns::<V, 4, NV>(vectors),
            5 => block(whole).run_columns::<V, 5, NV>(vectors),
            _ => unreachable!("MR is at most 6"),
        }
    }
}

/// `MR` rows of [`accumulate_values`], starting at their first row.
#[derive(Clone, Copy)]
struct ValueBlock {
    p: Weights,
    keys: usize,
    v: Rows,
    value_width: usize,
    alpha: *const f32,
    o: *mut f32,
}

impl ValueBlock {
    /// All `vectors` value vectors of the block's `MR` rows, `NV` at a time.
    ///
    /// # Safety
    /// As [`accumulate_values`], for these rows.
    #[inline(always)]
    unsafe fn run_columns<V: Vector, const MR: usize, const NV: usize>(self, vectors: usize) {
        // SAFETY (for the whole body): as the function's contract.
        unsafe {
            let mut c0 = 0;
            while c0 + NV <= vectors {
                self.run::<V, MR, NV>(c0);
                c0 += NV;
            }
            // The last few value vectors, with a narrower register tile.
            match vectors - c0 {
                0 => {}
                1 => self.run::<V, MR, 1>(c0),
                2 => self.run::<V, MR, 2>(c0),
                3 => self.run::<V, MR, 3>(c0),
                _ => unreachable!("NV is at most 4"),
            }
        }
    }

    /// Value vectors `c0..c0 + W` of the block's `MR` rows.
    ///
    /// # Safety
    /// As [`accumulate_values`], for these rows and vectors.
    #[inline(always)]
    unsafe fn run<V: Vector, const MR: usize, const W: usize>(self, c0: usize) {
        // SAFETY (for the whole body): as the function's contract.
        unsafe {
            let column = c0 * V::LANES;
            // This tile's P·V is summed from zero and only then added to the
            // rescaled O: 64 terms per sum instead of len_kv, which keeps
            // the rounding error of long rows at the blocked-sum level.
            let mut acc = [[V::splat(0.0); W]; MR];
            for j in 0..self.keys {
                let v_row = self.v.row(j).add(column);
                if c0 == 0 {
                    // Later column blocks find the rows in L1.
                    prefetch_row::<V>(self.v, j + PREFETCH_ROWS_AHEAD, self.value_width);
                }
                let v_vectors: [V; W] = std::array::from_fn(|c| V::load(v_row.add(c * V::LANES)));
                for (r, acc_row) in acc.iter_mut().enumerate() {
                    let weight = V::splat(self.p.at(r, j));
                    for (x, &vv) in acc_row.iter_mut().zip(&v_vectors) {
                        *x = weight.mul_add(vv, *x);
                    }
                }
            }
            for (r, acc_row) in acc.iter().enumerate() {
                let a = V::splat(*self.alpha.add(r));
                for (c, x) in acc_row.iter().enumerate() {
                    let o = self.o.add(r * self.value_width + column + c * V::LANES);
                    V::load(o).mul_add(a, *x).store(o);
                }
            }
        }
    }
}

/// One instruction set's kernels with its register tile sizes: what the
/// fused driver calls. The provided methods check every buffer size and then
/// call the `*_unchecked` ones.
pub(crate) trait Kernel: Copy + Send + Sync + 'static {
    /// The kernel set this is.
    #[cfg(test)]
    const SET: super::KernelSet;
    /// Query rows per register tile: tiles have a multiple of this many rows.
    const ROWS: usize;
    /// Keys per packed key panel: tiles have a multiple of this many keys.
    const KEY_PANEL: usize;
    /// Lanes of a vector: value rows are padded to a multiple of this.
    const LANES: usize;

    /// [`scores`] with this set's tile sizes.
    ///
    /// # Safety
    /// As [`scores`], but for the instruction set, which `self` proves.
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_unchecked(
        self,
        q: *const f32,
        rows: usize,
        d: usize,
        k_panels: *const f32,
        keys: usize,
        s: *mut f32,
        s_stride: usize,
    );

    /// [`softmax_rows`] with this set's vectors.
    ///
    /// # Safety
    /// As [`softmax_rows`], but for the instruction set, which `self` proves.
    #[allow(clippy::too_many_arguments)]
    unsafe fn softmax_rows_unchecked(
        self,
        s: *mut f32,
        rows: usize,
        keys: usize,
        s_stride: usize,
        max: *mut f32,
        sum: *mut f32,
        alpha: *mut f32,
    );

    /// [`accumulate_values`] with this set's tile sizes.
    ///
    /// # Safety
    /// As [`accumulate_values`], but for the instruction set, which `self` proves.
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate_values_unchecked(
        self,
        p: Weights,
        rows: usize,
        keys: usize,
        v: Rows,
        value_width: usize,
        alpha: *const f32,
        o: *mut f32,
    );

    /// [`exp_rows_shifted`] with this set's vectors.
    ///
    /// # Safety
    /// As [`exp_rows_shifted`], but for the instruction set, which `self` proves.
    unsafe fn exp_rows_shifted_unchecked(
        self,
        s: *mut f32,
        rows: usize,
        keys: usize,
        s_stride: usize,
        shift: *const f32,
    );

    /// [`row_scores`] with this set's vectors.
    ///
    /// # Safety
    /// As [`row_scores`], but for the instruction set, which `self` proves.
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_scores_unchecked(
        self,
        q: *const f32,
        rows: usize,
        d: usize,
        k: Rows,
        keys: usize,
        s: *mut f32,
        s_stride: usize,
    );

    /// [`exp`] over `len` values (a multiple of `LANES`) in place.
    #[cfg(test)]
    ///
    /// # Safety
    /// `x` has `len` elements.
    unsafe fn exp_unchecked(self, x: *mut f32, len: usize);

    /// `s[r][j] = q[r]·k[j]` for a tile: `q` is `[rows][d]`, `k_panels` the
    /// tile's keys packed in panels of `KEY_PANEL` (see [`scores`]), `s` has
    /// row stride `s_stride`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn scores(self, q: &[f32], d: usize, k_panels: &[f32], s: &mut [f32], s_stride: usize) {
        assert!(d > 0);
        let (rows, keys) = (q.len() / d, k_panels.len() / d);
        assert!(rows * d == q.len() && rows.is_multiple_of(Self::ROWS));
        assert!(
            keys * d == k_panels.len() && keys.is_multiple_of(Self::KEY_PANEL) && keys <= s_stride
        );
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        // SAFETY: the sizes were checked above; `self` proves the CPU.
        unsafe {
            self.scores_unchecked(
                q.as_ptr(),
                rows,
                d,
                k_panels.as_ptr(),
                keys,
                s.as_mut_ptr(),
                s_stride,
            )
        }
    }

    /// The online-softmax pass ([`softmax_rows`]) over the first `keys`
    /// columns of the `max.len()` rows of `s`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn softmax_rows(
        self,
        s: &mut [f32],
        keys: usize,
        s_stride: usize,
        max: &mut [f32],
        sum: &mut [f32],
        alpha: &mut [f32],
    ) {
        let rows = max.len();
        assert!(sum.len() == rows && alpha.len() == rows);
        assert!(keys.is_multiple_of(Self::LANES) && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        // SAFETY: the sizes were checked above; `self` proves the CPU.
        unsafe {
            self.softmax_rows_unchecked(
                s.as_mut_ptr(),
                rows,
                keys,
                s_stride,
                max.as_mut_ptr(),
                sum.as_mut_ptr(),
                alpha.as_mut_ptr(),
            )
        }
    }

    /// `o[r] ← alpha[r]·o[r] + Σ_j p[r][j]·v[j]` ([`accumulate_values`]) for
    /// the `alpha.len()` rows of `p` (any strides: `p.t()` of a tile is its
    /// transpose, with no copy), the keys that are `v`'s rows, and the first
    /// `value_width` columns of `v` and `o`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn accumulate_values(
        self,
        p: ArrayView2<'_, f32>,
        v: ArrayView2<'_, f32>,
        value_width: usize,
        alpha: &[f32],
        o: &mut [f32],
    ) {
        let (rows, keys) = (alpha.len(), v.nrows());
        assert!(
            value_width > 0 && value_width.is_multiple_of(Self::LANES) && v.ncols() >= value_width
        );
        assert!(p.nrows() == rows && p.ncols() >= keys);
        assert!(o.len() == rows * value_width);
        let (p, v) = (Weights::of(&p), Rows::of(&v));
        // SAFETY: the sizes were checked above, `p` and `v` are those of
        // valid views; `self` proves the CPU.
        unsafe {
            self.accumulate_values_unchecked(
                p,
                rows,
                keys,
                v,
                value_width,
                alpha.as_ptr(),
                o.as_mut_ptr(),
            )
        }
    }

    /// `s[r][j] ← e^(s[r][j] − shift[r])` ([`exp_rows_shifted`]) over the
    /// first `keys` columns of the `shift.len()` rows of `s`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn exp_rows_shifted(self, s: &mut [f32], keys: usize, s_stride: usize, shift: &[f32]) {
        let rows = shift.len();
        assert!(keys.is_multiple_of(Self::LANES) && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        // SAFETY: the sizes were checked above; `self` proves the CPU.
        unsafe {
            self.exp_rows_shifted_unchecked(s.as_mut_ptr(), rows, keys, s_stride, shift.as_ptr())
        }
    }

    /// `s[r][j] = q[r]·k[j]` ([`row_scores`]) for the rows of `q` (`[rows][d]`)
    /// and the keys that are `k`'s rows, read in place.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn row_scores(
        self,
        q: &[f32],
        d: usize,
        k: ArrayView2<'_, f32>,
        s: &mut [f32],
        s_stride: usize,
    ) {
        assert!(d > 0 && d.is_multiple_of(Self::LANES) && k.ncols() == d);
        let (rows, keys) = (q.len() / d, k.nrows());
        assert!(rows * d == q.len() && keys <= s_stride);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + keys);
        let k = Rows::of(&k);
        // SAFETY: the sizes were checked above, `k`'s rows are those of a
        // valid view; `self` proves the CPU.
        unsafe { self.row_scores_unchecked(q.as_ptr(), rows, d, k, keys, s.as_mut_ptr(), s_stride) }
    }

    /// `e^x` in place over `x`, with this set's [`exp`].
    #[cfg(test)]
    fn exp_in_place(self, x: &mut [f32]) {
        let whole = x.len() - x.len() % Self::LANES;
        let (body, tail) = x.split_at_mut(whole);
        // SAFETY: `body` has `whole` elements, a multiple of LANES.
        unsafe { self.exp_unchecked(body.as_mut_ptr(), whole) };
        let mut padded = [0.0f32; 64];
        padded[..tail.len()].copy_from_slice(tail);
        // SAFETY: `padded` has 64 elements, a multiple of every LANES.
        unsafe { self.exp_unchecked(padded.as_mut_ptr(), Self::LANES) };
        let n = tail.len();
        tail.copy_from_slice(&padded[..n]);
    }
}

/// `e^x` in place over `len` values, `V::LANES` at a time (for tests).
#[cfg(test)]
///
/// # Safety
/// V's instruction set is available; `x` has `len` elements, a multiple of
/// `V::LANES`.
#[inline(always)]
pub(crate) unsafe fn exp_in_place<V: Vector>(x: *mut f32, len: usize) {
    // SAFETY: offsets stay below `len`.
    unsafe {
        for i in (0..len).step_by(V::LANES) {
            exp(V::load(x.add(i))).store(x.add(i));
        }
    }
}

/// Implements [`Kernel`] for a kernel type: each method calls the generic
/// kernel instantiated with the set's vector type and tile sizes inside a
/// function compiled for the set's target features.
///
/// `$kernel`: the type; `$set`: its [`KernelSet`]; `$vector`: its [`Vector`];
/// the register tiles of Q·Kᵀ and of P·V as rows × vectors (the Q·Kᵀ rows
/// a multiple of the P·V rows); then the attributes of the instantiations
/// (`#[target_feature(enable = "…")]`).
macro_rules! impl_kernel {
    (
        $kernel:ty, $set:expr, $vector:ty,
        score_tile: $score_rows:literal x $score_vectors:literal, value_tile: $rows:literal x $value_vectors:literal,
        $(#[$feature:meta])*
    ) => {
        impl $crate::simd::kernels::Kernel for $kernel {
            #[cfg(test)]
            const SET: $crate::simd::KernelSet = $set;
            // Q·Kᵀ tiles are the taller ones, and a multiple of P·V's.
            const ROWS: usize = $score_rows;
            const KEY_PANEL: usize = $score_vectors * <$vector as $crate::simd::vector::Vector>::LANES;
            const LANES: usize = <$vector as $crate::simd::vector::Vector>::LANES;

            unsafe fn scores_unchecked(
                self, q: *const f32, rows: usize, d: usize, k_panels: *const f32, keys: usize, s: *mut f32, s_stride: usize,
            ) {
                $(#[$feature])*
                unsafe fn instance(q: *const f32, rows: usize, d: usize, k_panels: *const f32, keys: usize, s: *mut f32, s_stride: usize) {
                    // SAFETY: forwarded contract.
                    unsafe { $crate::simd::kernels::scores::<$vector, $score_rows, $score_vectors>(q, rows, d, k_panels, keys, s, s_stride) }
                }
                // SAFETY: `self` exists only on a CPU with the set's features
                // (its constructor checked); the caller upholds the sizes.
                unsafe { instance(q, rows, d, k_panels, keys, s, s_stride) }
            }

            unsafe fn softmax_rows_unchecked(
                self, s: *mut f32, rows: usize, keys: usize, s_stride: usize, max: *mut f32, sum: *mut f32, alpha: *mut f32,
            ) {
                $(#[$feature])*
                unsafe fn instance(s: *mut f32, rows: usize, keys: usize, s_stride: usize, max: *mut f32, sum: *mut f32, alpha: *mut f32) {
                    // SAFETY: forwarded contract.
                    unsafe { $crate::simd::kernels::softmax_rows::<$vector>(s, rows, keys, s_stride, max, sum, alpha) }
                }
                // SAFETY: as in `scores_unchecked`.
                unsafe { instance(s, rows, keys, s_stride, max, sum, alpha) }
            }

            unsafe fn accumulate_values_unchecked(
                self, p: $crate::simd::kernels::Weights, rows: usize, keys: usize, v: $crate::simd::kernels::Rows, value_width: usize, alpha: *const f32, o: *mut f32,
            ) {
                $(#[$feature])*
                #[allow(clippy::too_many_arguments)]
                unsafe fn instance(p: $crate::simd::kernels::Weights, rows: usize, keys: usize, v: $crate::simd::kernels::Rows, value_width: usize, alpha: *const f32, o: *mut f32) {
                    // SAFETY: forwarded contract.
                    unsafe { $crate::simd::kernels::accumulate_values::<$vector, $rows, $value_vectors>(p, rows, keys, v, value_width, alpha, o) }
                }
                // SAFETY: as in `scores_unchecked`.
                unsafe { instance(p, rows, keys, v, value_width, alpha, o) }
            }

            unsafe fn exp_rows_shifted_unchecked(self, s: *mut f32, rows: usize, keys: usize, s_stride: usize, shift: *const f32) {
                $(#[$feature])*
                unsafe fn instance(s: *mut f32, rows: usize, keys: usize, s_stride: usize, shift: *const f32) {
                    // SAFETY: forwarded contract.
                    unsafe { $crate::simd::kernels::exp_rows_shifted::<$vector>(s, rows, keys, s_stride, shift) }
                }
                // SAFETY: as in `scores_unchecked`.
                unsafe { instance(s, rows, keys, s_stride, shift) }
            }

            unsafe fn row_scores_unchecked(
                self, q: *const f32, rows: usize, d: usize, k: $crate::simd::kernels::Rows, keys: usize, s: *mut f32, s_stride: usize,
            ) {
                $(#[$feature])*
                unsafe fn instance(q: *const f32, rows: usize, d: usize, k: $crate::simd::kernels::Rows, keys: usize, s: *mut f32, s_stride: usize) {
                    // SAFETY: forwarded contract.
                    unsafe { $crate::simd::kernels::row_scores::<$vector>(q, rows, d, k, keys, s, s_stride) }
                }
                // SAFETY: as in `scores_unchecked`.
                unsafe { instance(q, rows, d, k, keys, s, s_stride) }
            }

            #[cfg(test)]
            unsafe fn exp_unchecked(self, x: *mut f32, len: usize) {
                $(#[$feature])*
                unsafe fn instance(x: *mut f32, len: usize) {
                    // SAFETY: forwarded contract.
                    unsafe { $crate::simd::kernels::exp_in_place::<$vector>(x, len) }
                }
                // SAFETY: as in `scores_unchecked`.
                unsafe { instance(x, len) }
            }
        }
    };
}
pub(crate) use impl_kernel;
