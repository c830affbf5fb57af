//! [`Kernel`], what the fused driver sees: one instruction set's kernels
//! with its register tile sizes, as safe methods. And [`KernelOp`], the
//! shape every kernel has: an operation generic over the [`Vector`] type
//! and the tile sizes, run by [`Kernel::run`].
//!
//! Each instruction set implements `Kernel` with one `#[target_feature]`
//! trampoline around `KernelOp::run` (the rten-simd dispatch pattern): the
//! kernels and every `Vector` method are `#[inline(always)]`, so they are
//! all compiled into the trampoline with the set's features. The operation
//! checks its own buffer sizes against the tile sizes it runs with, so its
//! only `unsafe` precondition is the instruction set, which a `Kernel` value
//! proves.
//!
//! Adding a kernel: a file with its operation (a struct and a `KernelOp`
//! impl), its `mod` line, and a one-line safe method here if the driver
//! should call it by name (else the driver calls `kernel.run(op)`).

use ndarray::ArrayView2;

use super::layout::PrefetchLines;
use super::panels::PackPanels;
use super::rows::{Dot, MaxAbs, ScaledCopy};
use super::scores::{RowScores, Scores};
use super::softmax::{ExpRowsShifted, SoftmaxGradient, SoftmaxRows};
use super::tanh::SoftcapScores;
use super::values::{AccumulateValues, ValueRows, ZeroWeights};
use super::vector::{Load, Vector};

/// A kernel: an operation written once, generic over the vector type `V`
/// and the register tiles (`ROWS` query rows; `KEY_VECTORS` vectors of keys
/// in Q·Kᵀ, so a key panel is `KEY_VECTORS·V::LANES` keys; `VALUE_VECTORS`
/// vectors of value columns in P·V). An operation uses the sizes it needs.
pub(crate) trait KernelOp {
    /// What the operation returns.
    type Output;

    /// Runs the operation. Implementations are `#[inline(always)]`, so they
    /// compile into the instruction set's trampoline; they check every
    /// buffer size they rely on (a wrong size panics: a bug in the driver,
    /// never bad user input).
    ///
    /// # Safety
    /// The CPU has `V`'s instruction set.
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) -> Self::Output;
}

/// One instruction set's kernels with its register tile sizes.
///
/// # Safety
/// An implementer promises that a value of the type exists only on a CPU
/// that can run [`Kernel::run_unchecked`] (its constructor checks the CPU,
/// and its fields are private), so that holding one proves the CPU; and
/// that [`Kernel::SET`] names the set whose instruction set that is; and
/// that `run_unchecked` runs the operation with `Self::Vector` and the tile
/// sizes these constants describe (`ROWS`, `KEY_PANEL / LANES` key vectors,
/// `LANES == Self::Vector::LANES`).
pub(crate) unsafe trait Kernel: Copy + Send + Sync + 'static {
    /// The vector the kernels run on.
    type Vector: Vector;
    /// The kernel set this is: its instruction set, which a value of the
    /// type proves (the tests name it in their messages).
    #[cfg_attr(not(test), allow(dead_code))]
    const SET: super::KernelSet;
    /// Query rows per register tile: tiles have a multiple of this many rows.
    const ROWS: usize;
    /// Keys per packed key panel: tiles have a multiple of this many keys.
    #[cfg_attr(not(test), allow(dead_code))]
    const KEY_PANEL: usize;
    /// Lanes of a vector: value rows are padded to a multiple of this.
    const LANES: usize = <Self::Vector as Vector>::LANES;

    /// Runs `op` with this set's vector and tile sizes, compiled for this
    /// set's target features.
    ///
    /// # Safety
    /// The CPU has this set's instruction set.
    unsafe fn run_unchecked<Op: KernelOp>(op: Op) -> Op::Output;

    /// Runs `op` with this set's vector and tile sizes.
    #[inline(always)]
    fn run<Op: KernelOp>(self, op: Op) -> Op::Output {
        // SAFETY: `self` exists, which by the trait's contract proves the
        // CPU has the instruction set.
        unsafe { Self::run_unchecked(op) }
    }

    /// `s[r][j] = q[r]·k[j]` for a tile: `q` is `[rows][d]`, `k_panels` the
    /// tile's keys packed in panels of `KEY_PANEL` (see [`Scores`]), `s` has
    /// row stride `s_stride`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn scores(self, q: &[f32], d: usize, k_panels: &[f32], s: &mut [f32], s_stride: usize) {
        self.run(Scores {
            q,
            d,
            k_panels,
            s,
            s_stride,
        })
    }

    /// `s[r][j] = q[r]·k[j]` ([`RowScores`]) for the rows of `q` (`[rows][d]`)
    /// and the keys that are `k`'s rows, read in place (`f32` or half
    /// precision).
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn row_scores<E: Load>(
        self,
        q: &[f32],
        d: usize,
        k: ArrayView2<'_, E>,
        s: &mut [f32],
        s_stride: usize,
    ) {
        self.run(RowScores {
            q,
            d,
            k,
            s,
            s_stride,
        })
    }

    /// The online-softmax pass over a tile of scores ([`SoftmaxRows`]).
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn softmax_rows(self, pass: SoftmaxRows<'_>) {
        self.run(pass)
    }

    /// `s[r][j] ← e^(s[r][j] − shift[r])` ([`ExpRowsShifted`]) over the
    /// first `keys` columns of the `shift.len()` rows of `s`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn exp_rows_shifted(self, s: &mut [f32], keys: usize, s_stride: usize, shift: &[f32]) {
        self.run(ExpRowsShifted {
            s,
            keys,
            s_stride,
            shift,
        })
    }

    /// `d_s[r][j] ← p[r][j]·(d_s[r][j] − delta[r])` ([`SoftmaxGradient`])
    /// over the `delta.len()` rows of `keys` columns of `p` and `d_s`;
    /// exactly 0 where `p` is 0 (or below the smallest normal number,
    /// which `exp`'s weights are only when they round just under it).
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    fn softmax_gradient(self, p: &[f32], d_s: &mut [f32], keys: usize, delta: &[f32]) {
        self.run(SoftmaxGradient {
            p,
            d_s,
            keys,
            delta,
        })
    }

    /// `s ← cap·tanh(s/cap)` over all of `s` ([`SoftcapScores`]), whose
    /// length is a multiple of `LANES`.
    ///
    /// # Panics
    /// When it is not (a bug in the driver, never bad user input).
    fn softcap(self, s: &mut [f32], cap: f32) {
        self.run(SoftcapScores { s, cap })
    }

    /// `o[r] ← alpha[r]·o[r] + Σ_j p[r][j]·v[j]` ([`AccumulateValues`]) for
    /// the `alpha.len()` rows of `p` (any strides: `p.t()` of a tile is its
    /// transpose, with no copy), the keys that are `v`'s rows, and the first
    /// `value_width` columns of `v` and `o`; `zero_weights` says whether
    /// `v` may hold non-finite rows a zero weight must skip, `value_rows`
    /// where `v` lives (whether to prefetch it).
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    #[allow(clippy::too_many_arguments)]
    fn accumulate_values<E: Load>(
        self,
        p: ArrayView2<'_, f32>,
        v: ArrayView2<'_, E>,
        value_width: usize,
        alpha: &[f32],
        o: &mut [f32],
        zero_weights: ZeroWeights,
        value_rows: ValueRows,
    ) {
        self.run(AccumulateValues {
            p,
            v,
            value_width,
            alpha,
            o,
            zero_weights,
            value_rows,
        })
    }

    /// `dst[i] = src[i]·factor` for the entries of `src` ([`ScaledCopy`]),
    /// widened to `f32` as they are read.
    ///
    /// # Panics
    /// When `dst` is shorter than `src` (a bug in the driver).
    fn scaled_copy<E: Load>(self, src: &[E], dst: &mut [f32], factor: f32) {
        self.run(ScaledCopy {
            src,
            dst,
            factor,
            divide: false,
        })
    }

    /// `dst[i] = src[i]/divisor` for the entries of `src` ([`ScaledCopy`]).
    ///
    /// # Panics
    /// When `dst` is shorter than `src` (a bug in the driver).
    fn divided_copy(self, src: &[f32], dst: &mut [f32], divisor: f32) {
        self.run(ScaledCopy {
            src,
            dst,
            factor: divisor,
            divide: true,
        })
    }

    /// `Σ_i a[i]·b[i]` ([`Dot`]), summed in vectors: not the bits of a
    /// plain loop, the same bits on every call with the same set.
    ///
    /// # Panics
    /// When `b` is shorter than `a` (a bug in the driver).
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        self.run(Dot { a, b })
    }

    /// Packs `scale·keys` into the score kernel's panels, padding with
    /// zeros, and returns their [`MaxAbs`] bound ([`PackPanels`]).
    fn pack_panels(self, keys: ArrayView2<'_, f32>, panels: &mut [f32], scale: f32) -> f32 {
        self.run(PackPanels {
            keys,
            panels,
            scale,
        })
    }

    /// Prefetches `x` into L2 ([`PrefetchLines`]).
    fn prefetch(self, x: &[f32]) {
        self.run(PrefetchLines { x })
    }

    /// The largest `|x|`, or `+inf` when `x` holds a NaN or an infinity
    /// ([`MaxAbs`]).
    fn max_abs<E: Load>(self, x: &[E]) -> f32 {
        self.run(MaxAbs { x })
    }

    /// Whether every entry of `x` is finite: [`MaxAbs`] is `+inf` exactly
    /// when one is not.
    fn all_finite(self, x: &[f32]) -> bool {
        self.max_abs(x).is_finite()
    }
}
