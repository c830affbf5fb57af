//! The value kernel, `O ← α·O + P·V` for a tile of query rows: register
//! tiles of `ROWS` rows × `VALUE_VECTORS` vectors of value columns, with
//! shorter and narrower tiles for the last few rows and columns (decoding
//! has one to a few rows) rather than padding that would cost as much as
//! real work.

use std::mem::MaybeUninit;
use std::ops::Range;

use ndarray::ArrayView2;

use super::kernel::KernelOp;
use super::layout::{Rows, Weights, prefetch_row, prefetch_rows_ahead};
use super::vector::{Load, Vector};

/// What a zero weight contributes to `P·V`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ZeroWeights {
    /// Multiplied like any weight: the fast kernel, for value rows known
    /// to be finite (then `0·v` adds exactly nothing).
    Multiply,
    /// Skipped, for value rows that may hold NaN or `±inf`: a masked key's
    /// NaN value must not become `0·NaN`. The sums keep the order and the
    /// rounding of [`ZeroWeights::Multiply`], so where the values are
    /// finite the two give the same bits.
    Skip,
}

/// Where the value rows live, which decides whether the kernel prefetches
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ValueRows {
    /// A tile the driver packed or widened, read over and over from L1/L2,
    /// which the hardware prefetcher follows: software prefetches there
    /// only take issue slots (they were 17% of the P·V kernel's samples at
    /// N = 4096 on a Sapphire Rapids Xeon).
    Packed,
    /// Rows in the caller's arrays, read once from memory (decoding):
    /// prefetched [`prefetch_rows_ahead`] rows ahead.
    InPlace,
}

/// `o[r] ← alpha[r]·o[r] + Σ_j p[r][j]·v[j]` for the `alpha.len()` rows of
/// `p` (any strides: `p.t()` of a tile is its transpose, with no copy), the
/// keys that are `v`'s rows (contiguous; `f32`, or half precision widened
/// as loaded, [`Load`]), and the first `value_width` columns (a multiple
/// of `LANES`) of `v` and of row-major `o`.
pub(crate) struct AccumulateValues<'a, E> {
    pub p: ArrayView2<'a, f32>,
    pub v: ArrayView2<'a, E>,
    pub value_width: usize,
    pub alpha: &'a [f32],
    pub o: &'a mut [f32],
    pub zero_weights: ZeroWeights,
    pub value_rows: ValueRows,
}

impl<E: Load> KernelOp for AccumulateValues<'_, E> {
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
        const {
            assert!(
                ROWS <= 6 && VALUE_VECTORS <= 4,
                "see the remainder tiles below"
            )
        };
        let AccumulateValues {
            p,
            v,
            value_width,
            alpha,
            o,
            zero_weights,
            value_rows,
        } = self;
        let (rows, keys) = (alpha.len(), v.nrows());
        assert!(
            value_width > 0 && value_width.is_multiple_of(V::LANES) && v.ncols() >= value_width
        );
        assert!(p.nrows() == rows && p.ncols() >= keys);
        assert!(o.len() == rows * value_width);
        let (p, v, alpha, o) = (
            Weights::of(&p),
            Rows::of(&v),
            alpha.as_ptr(),
            o.as_mut_ptr(),
        );
        let vectors = value_width / V::LANES;
        let rows_ahead = prefetch_rows_ahead(value_width * size_of::<E>());
        // SAFETY: the caller guarantees V's instruction set; `p` and `v`
        // are those of valid views, and each block covers rows r0..r0+ROWS
        // (or the last few rows) inside the sizes checked above.
        unsafe {
            let block = |r0: usize| ValueBlock {
                p: p.starting_at_row(r0),
                keys,
                v,
                value_width,
                rows_ahead,
                alpha: alpha.add(r0),
                o: o.add(r0 * value_width),
            };
            use {ValueRows::*, ZeroWeights::*};
            match (zero_weights, value_rows) {
                (Multiply, Packed) => {
                    run_rows::<V, E, ROWS, VALUE_VECTORS, false, false>(block, rows, vectors)
                }
                (Skip, Packed) => {
                    run_rows::<V, E, ROWS, VALUE_VECTORS, true, false>(block, rows, vectors)
                }
                (Multiply, InPlace) => {
                    run_rows::<V, E, ROWS, VALUE_VECTORS, false, true>(block, rows, vectors)
                }
                (Skip, InPlace) => {
                    run_rows::<V, E, ROWS, VALUE_VECTORS, true, true>(block, rows, vectors)
                }
            }
        }
    }
}

/// The `rows` rows of [`AccumulateValues`], `ROWS` at a time; with
/// `PREFETCH`, value rows ahead are prefetched ([`ValueRows::InPlace`]).
/// A constant, not a flag tested per key: the flag measured 2–3% slower
/// across the forward grid on a Xeon (the prefetch loop stays in the
/// packed kernel's body).
///
/// # Safety
/// As [`ValueBlock::run_columns`], for every block `block(r0)` gives.
#[inline(always)]
unsafe fn run_rows<
    V: Vector,
    E: Load,
    const ROWS: usize,
    const NV: usize,
    const SKIP: bool,
    const PREFETCH: bool,
>(
    block: impl Fn(usize) -> ValueBlock<E>,
    rows: usize,
    vectors: usize,
) {
    // SAFETY: the caller guarantees the instruction set and the sizes.
    unsafe {
        let whole = rows - rows % ROWS;
        for r0 in (0..whole).step_by(ROWS) {
            block(r0).run_columns::<V, ROWS, NV, SKIP, PREFETCH>(vectors);
        }
        // The last few rows, with a shorter register tile.
        match rows - whole {
            0 => {}
            1 => block(whole).run_columns::<V, 1, NV, SKIP, PREFETCH>(vectors),
            2 => block(whole).run_columns::<V, 2, NV, SKIP, PREFETCH>(vectors),
            3 => block(whole).run_columns::<V, 3, NV, SKIP, PREFETCH>(vectors),
            4 => block(whole).run_columns::<V, 4, NV, SKIP, PREFETCH>(vectors),
            5 => block(whole).run_columns::<V, 5, NV, SKIP, PREFETCH>(vectors),
            _ => unreachable!("ROWS is at most 6"),
        }
    }
}

/// `MR` rows of [`AccumulateValues`], starting at their first row.
#[derive(Clone, Copy)]
struct ValueBlock<E> {
    p: Weights,
    keys: usize,
    v: Rows<E>,
    value_width: usize,
    /// How far ahead rows read in place are prefetched.
    rows_ahead: usize,
    alpha: *const f32,
    o: *mut f32,
}

impl<E: Load> ValueBlock<E> {
    /// All `vectors` value vectors of the block's `MR` rows, `NV` at a time;
    /// with `SKIP`, zero weights are skipped ([`ZeroWeights::Skip`]).
    ///
    /// Rows read in place (`PREFETCH`, decoding) that take more than one
    /// pass over the keys go [`CHUNK_BYTES`] of value rows at a time, every
    /// pass over one chunk before the next: a pass over a whole 64-key tile
    /// of `d = 128` rows (32 KiB) left the later passes reading L2, not L1
    /// (grouped-query decoding stacks 4–8 rows, two value vectors a pass
    /// on AVX2: eight passes). The sums carry from chunk to chunk in
    /// [`Carry`], so every row's bits are those of one pass.
    ///
    /// # Safety
    /// The CPU has `V`'s instruction set; the block's `MR` rows and
    /// `vectors` value vectors are inside the matrices, as
    /// [`AccumulateValues`] checks.
    #[inline(always)]
    unsafe fn run_columns<
        V: Vector,
        const MR: usize,
        const NV: usize,
        const SKIP: bool,
        const PREFETCH: bool,
    >(
        self,
        vectors: usize,
    ) {
        // SAFETY: the caller's; the carry holds `MR · value_width` numbers.
        unsafe {
            let row_bytes = self.value_width * size_of::<E>();
            let chunk = (CHUNK_BYTES / row_bytes).max(1);
            let passes = column_passes::<E>(MR == 1 && PREFETCH, vectors, NV);
            let fits = MR * self.value_width <= CARRY_NUMBERS;
            if !(PREFETCH && passes > 1 && fits && self.keys > chunk) {
                self.columns::<V, MR, NV, SKIP, PREFETCH>(vectors, Pass::Whole);
                return;
            }
            let mut carry = Carry::new();
            let mut start = 0;
            while start < self.keys {
                let end = (start + chunk).min(self.keys);
                let keys = start..end;
                self.columns::<V, MR, NV, SKIP, PREFETCH>(vectors, Pass::Chunk(keys, &mut carry));
                start = end;
            }
            self.columns::<V, MR, NV, SKIP, PREFETCH>(vectors, Pass::Finish(&carry));
        }
    }

    /// One pass of the block's `MR` rows over all `vectors` value vectors,
    /// `NV` at a time.
    ///
    /// # Safety
    /// As [`ValueBlock::run_columns`].
    #[inline(always)]
    unsafe fn columns<
        V: Vector,
        const MR: usize,
        const NV: usize,
        const SKIP: bool,
        const PREFETCH: bool,
    >(
        self,
        vectors: usize,
        mut pass: Pass<'_>,
    ) {
        // SAFETY: the caller guarantees the instruction set and the sizes;
        // `c0 + W <= vectors` for every run below.
        unsafe {
            let mut c0 = 0;
            // One row read in place (decoding): all its value vectors in
            // one pass over the keys, up to `one_row_vectors`, so each row
            // is read once rather than once per `NV` vectors.
            if MR == 1 && PREFETCH {
                // `one_row_vectors` picks the width; a const generic needs
                // it spelled as the constant.
                while one_row_vectors::<E>() == ONE_ROW_VECTORS && c0 + ONE_ROW_VECTORS <= vectors {
                    self.run::<V, 1, ONE_ROW_VECTORS, SKIP, PREFETCH>(c0, pass.reborrow());
                    c0 += ONE_ROW_VECTORS;
                }
                while c0 + 8 <= vectors {
                    self.run::<V, 1, 8, SKIP, PREFETCH>(c0, pass.reborrow());
                    c0 += 8;
                }
            }
            while c0 + NV <= vectors {
                self.run::<V, MR, NV, SKIP, PREFETCH>(c0, pass.reborrow());
                c0 += NV;
            }
            // The last few value vectors, with a narrower register tile.
            match vectors - c0 {
                0 => {}
                1 => self.run::<V, MR, 1, SKIP, PREFETCH>(c0, pass),
                2 => self.run::<V, MR, 2, SKIP, PREFETCH>(c0, pass),
                3 => self.run::<V, MR, 3, SKIP, PREFETCH>(c0, pass),
                _ => unreachable!("NV is at most 4"),
            }
        }
    }

    /// Value vectors `c0..c0 + W` of the block's `MR` rows, for `pass`.
    ///
    /// # Safety
    /// As [`ValueBlock::run_columns`], for these rows and vectors.
    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const MR: usize,
        const W: usize,
        const SKIP: bool,
        const PREFETCH: bool,
    >(
        self,
        c0: usize,
        pass: Pass<'_>,
    ) {
        // SAFETY: the caller guarantees the instruction set, and that these
        // rows, keys and value vectors are inside the matrices (and the
        // carry, which holds `MR` rows of `value_width`).
        unsafe {
            let column = c0 * V::LANES;
            // Where sum `(r, c)` of this block is carried.
            let carried = |r: usize, c: usize| r * self.value_width + column + c * V::LANES;
            // This tile's P·V is summed from zero and only then added to the
            // rescaled O: 64 terms per sum instead of len_kv, which keeps
            // the rounding error of long rows at the blocked-sum level.
            let mut acc = [[V::splat(0.0); W]; MR];
            match pass {
                Pass::Whole => {
                    self.accumulate::<V, MR, W, SKIP, PREFETCH>(c0, 0..self.keys, &mut acc);
                }
                Pass::Chunk(keys, carry) => {
                    if keys.start > 0 {
                        for (r, acc_row) in acc.iter_mut().enumerate() {
                            for (c, x) in acc_row.iter_mut().enumerate() {
                                *x = V::load(carry.as_ptr().add(carried(r, c)));
                            }
                        }
                    }
                    self.accumulate::<V, MR, W, SKIP, PREFETCH>(c0, keys, &mut acc);
                    for (r, acc_row) in acc.iter().enumerate() {
                        for (c, x) in acc_row.iter().enumerate() {
                            x.store(carry.as_mut_ptr().add(carried(r, c)));
                        }
                    }
                    return;
                }
                Pass::Finish(carry) => {
                    for (r, acc_row) in acc.iter_mut().enumerate() {
                        for (c, x) in acc_row.iter_mut().enumerate() {
                            *x = V::load(carry.as_ptr().add(carried(r, c)));
                        }
                    }
                }
            }
            // O ← α·O + acc, or O + acc where every α is 1 (no row's
            // maximum moved: most tiles once a row has seen a few), the
            // same bits (`1·o` is exact) with an add, which Zen 4 runs
            // beside its two FMA pipes.
            let alphas: [f32; MR] = std::array::from_fn(|r| *self.alpha.add(r));
            let unscaled = alphas.iter().all(|&a| a == 1.0);
            for (r, acc_row) in acc.iter().enumerate() {
                let a = V::splat(alphas[r]);
                for (c, x) in acc_row.iter().enumerate() {
                    let o = self.o.add(r * self.value_width + column + c * V::LANES);
                    let o_new = if unscaled {
                        V::load(o).add(*x)
                    } else {
                        V::load(o).mul_add(a, *x)
                    };
                    o_new.store(o);
                }
            }
        }
    }

    /// `acc[r] += Σ_j p[r][j]·v[j]` over `keys`, in key order, for value
    /// vectors `c0..c0 + W` of the block's `MR` rows.
    ///
    /// # Safety
    /// As [`ValueBlock::run`], for these keys.
    #[inline(always)]
    unsafe fn accumulate<
        V: Vector,
        const MR: usize,
        const W: usize,
        const SKIP: bool,
        const PREFETCH: bool,
    >(
        self,
        c0: usize,
        keys: Range<usize>,
        acc: &mut [[V; W]; MR],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let column = c0 * V::LANES;
            // Each row's weights are walked with a pointer: `Weights::at`
            // multiplied the strides out for every weight.
            let mut weights: [*const f32; MR] = std::array::from_fn(|r| {
                let row = self.p.starting_at_row(r).ptr;
                row.wrapping_offset(keys.start as isize * self.p.key_stride)
            });
            for j in keys {
                let v_row = self.v.row(j).add(column);
                if PREFETCH && c0 == 0 {
                    // Later column blocks find the rows in L1.
                    prefetch_row::<V, _>(self.v, j + self.rows_ahead, self.value_width);
                }
                let v_vectors: [V; W] = std::array::from_fn(|c| E::load(v_row.add(c * V::LANES)));
                for (acc_row, weight) in acc.iter_mut().zip(&mut weights) {
                    let here = *weight;
                    // The pointer past the last key is never read.
                    *weight = here.wrapping_offset(self.p.key_stride);
                    let weight = *here;
                    // Skipping adds what `0·v` would for a finite `v`:
                    // nothing (the sum starts at +0 and never becomes −0).
                    if SKIP && weight == 0.0 {
                        continue;
                    }
                    let weight = V::splat(weight);
                    for (x, &vv) in acc_row.iter_mut().zip(&v_vectors) {
                        *x = weight.mul_add(vv, *x);
                    }
                }
            }
        }
    }
}

/// The most `f32` value vectors one row read in place (decoding) sums in
/// one pass over the keys: 16, a `d = 128` row in one pass on AVX2 (16
/// accumulators and the weight: LLVM keeps one accumulator on the stack,
/// the rows stay FMA memory operands). Two passes of 8 over 8 KiB chunks
/// measured slower on an AMD Zen 3 (see `docs/PERFORMANCE.md`). The
/// other sets reach 16 vectors at `d ≥ 256` (AVX-512) and `d ≥ 64`
/// (NEON), with 32 registers, and the scalar set at `d ≥ 16`.
const ONE_ROW_VECTORS: usize = 16;

/// [`ONE_ROW_VECTORS`] for rows of `f32`; 8 for rows widened from half
/// precision, whose widened vectors need registers of their own: 16 of
/// them spilled to the stack and made a `bf16` cache step 3.7–4.1× slower
/// on Zen 3.
const fn one_row_vectors<E: Load>() -> usize {
    if E::WIDENS { 8 } else { ONE_ROW_VECTORS }
}

/// How many passes over the keys [`ValueBlock::columns`] makes for
/// `vectors` value vectors, `nv` a pass, or for one row read in place
/// (`one_row`) [`one_row_vectors`], then 8, then `nv` at a time; a last
/// narrower tile is one more pass. It decides whether the keys are
/// chunked, so it counts exactly what `columns` does.
const fn column_passes<E: Load>(one_row: bool, vectors: usize, nv: usize) -> usize {
    let (mut passes, mut rest) = (0, vectors);
    if one_row {
        let wide = one_row_vectors::<E>();
        passes += rest / wide;
        rest %= wide;
        if wide > 8 {
            passes += rest / 8;
            rest %= 8;
        }
    }
    passes += rest / nv;
    rest %= nv;
    passes + (rest > 0) as usize
}

/// How many bytes of value rows read in place one chunk of
/// [`ValueBlock::run_columns`] covers: a quarter of the smallest L1d of
/// the CPUs it runs on (32 KiB, Zen 3 and 4), room for the weights, the
/// output rows and the next rows' prefetches beside it.
const CHUNK_BYTES: usize = 8 * 1024;

/// The most numbers (`MR` rows × `value_width`) the sums of a chunked
/// block carry between chunks: 12 KiB of stack; wider blocks are not
/// chunked.
const CARRY_NUMBERS: usize = 3 * 1024;

/// The sums of a chunked block between its chunks: row `r`'s sums at
/// `r · value_width`.
struct Carry([MaybeUninit<f32>; CARRY_NUMBERS]);

impl Carry {
    fn new() -> Self {
        Self([const { MaybeUninit::uninit() }; CARRY_NUMBERS])
    }

    fn as_ptr(&self) -> *const f32 {
        self.0.as_ptr().cast()
    }

    fn as_mut_ptr(&mut self) -> *mut f32 {
        self.0.as_mut_ptr().cast()
    }
}

/// What one pass of [`ValueBlock::columns`] does.
enum Pass<'a> {
    /// All the keys: `O ← α·O + P·V`.
    Whole,
    /// The keys of one chunk, their sums added to those carried (stored
    /// there; the first chunk starts from zero).
    Chunk(Range<usize>, &'a mut Carry),
    /// `O ← α·O + P·V` from the carried sums.
    Finish(&'a Carry),
}

impl Pass<'_> {
    /// The same pass again, for the next column block.
    fn reborrow(&mut self) -> Pass<'_> {
        match self {
            Pass::Whole => Pass::Whole,
            Pass::Chunk(keys, carry) => Pass::Chunk(keys.clone(), carry),
            Pass::Finish(carry) => Pass::Finish(carry),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::column_passes;

    /// The count that decides chunking walks the tiles `columns` runs.
    #[test]
    fn column_passes_counts_the_passes_columns_makes() {
        // One f32 row in place on AVX2 (`NV` = 2): d = 128, 96, 200, 48.
        assert_eq!(column_passes::<f32>(true, 16, 2), 1);
        assert_eq!(column_passes::<f32>(true, 12, 2), 3); // 8 + 2 + 2
        assert_eq!(column_passes::<f32>(true, 25, 2), 3); // 16 + 8 + 1
        assert_eq!(column_passes::<f32>(true, 6, 2), 3);
        // Widened rows keep 8 vectors a pass.
        #[cfg(feature = "half")]
        {
            assert_eq!(column_passes::<half::bf16>(true, 16, 2), 2);
            assert_eq!(column_passes::<half::f16>(true, 12, 2), 3);
        }
        // Stacked rows: `NV` at a time and one narrower tile.
        assert_eq!(column_passes::<f32>(false, 16, 4), 4);
        assert_eq!(column_passes::<f32>(false, 17, 4), 5);
    }
}
