//! Element-wise passes over the rows that the fused drivers copy around the
//! products: the queries scaled as they are copied, the largest magnitude
//! of keys and queries (which bounds the scores, and finds NaN and
//! infinities in packed values), the output divided by the softmax
//! sums, and the backward's row dot products.
//!
//! They are kernels only to run under a kernel set's `#[target_feature]`:
//! written as plain loops in the drivers, they compiled for the x86-64
//! baseline (SSE2, four lanes, `f32::max` as a compare-and-blend chain) and
//! took 12–16% of a 256-token forward on a Sapphire Rapids Xeon. Each gives
//! the bits the plain loop gives.

use super::kernel::KernelOp;
use super::vector::{Load, Vector};

/// `dst[i] = src[i]·factor`, or `src[i]/factor` with `divide`, for the
/// `src.len()` entries (`dst` at least as long), `src` widened to `f32`
/// (exactly) as it is read.
pub(crate) struct ScaledCopy<'a, E> {
    pub src: &'a [E],
    pub dst: &'a mut [f32],
    pub factor: f32,
    pub divide: bool,
}

impl<E: Load> KernelOp for ScaledCopy<'_, E> {
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
        let ScaledCopy {
            src,
            dst,
            factor,
            divide,
        } = self;
        let dst = &mut dst[..src.len()];
        let whole = src.len() - src.len() % V::LANES;
        // SAFETY: the caller guarantees V's instruction set; each vector
        // lies below `whole`, inside both slices.
        unsafe {
            let f = V::splat(factor);
            for i in (0..whole).step_by(V::LANES) {
                let x: V = E::load(src.as_ptr().add(i));
                let y = if divide { x.div(f) } else { x.mul(f) };
                y.store(dst.as_mut_ptr().add(i));
            }
        }
        for (y, &x) in dst[whole..].iter_mut().zip(&src[whole..]) {
            let x = x.to_f32();
            *y = if divide { x / factor } else { x * factor };
        }
    }
}

/// A bound on the magnitudes of `x`: the largest `|x|` (0 for none), or
/// `+inf` when an entry is NaN or infinite. The drivers use it to tell
/// when no score can overflow, for which `+inf` is the safe answer.
/// `x` is widened to `f32` (exactly) as it is read.
pub(crate) struct MaxAbs<'a, E> {
    pub x: &'a [E],
}

impl<E: Load> KernelOp for MaxAbs<'_, E> {
    type Output = f32;

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) -> f32 {
        let x = self.x;
        let whole = x.len() - x.len() % V::LANES;
        // SAFETY: the caller guarantees V's instruction set; each vector
        // lies below `whole`, inside `x`.
        unsafe {
            let mut bound = MagnitudeBound::<V>::new();
            for i in (0..whole).step_by(V::LANES) {
                bound.add(E::load(x.as_ptr().add(i)));
            }
            x[whole..].iter().for_each(|&x| bound.add_one(x.to_f32()));
            bound.finish()
        }
    }
}

/// `Σ_i a[i]·b[i]` over the `a.len()` entries (`b` at least as long):
/// the backward's `D = rowsum(dO ∘ O)`. A plain loop summed one product
/// at a time, a chain of dependent adds four cycles each, a few percent
/// of a 256-token backward; two vector accumulators take the chain to
/// `2·LANES` partial sums, added up at the end in a fixed order.
pub(crate) struct Dot<'a> {
    pub a: &'a [f32],
    pub b: &'a [f32],
}

impl KernelOp for Dot<'_> {
    type Output = f32;

    #[inline(always)]
    unsafe fn run<
        V: Vector,
        const ROWS: usize,
        const KEY_VECTORS: usize,
        const VALUE_VECTORS: usize,
    >(
        self,
    ) -> f32 {
        let Dot { a, b } = self;
        let b = &b[..a.len()];
        let whole = a.len() - a.len() % V::LANES;
        // SAFETY: the caller guarantees V's instruction set; `whole` entries
        // of both slices are readable and a multiple of LANES.
        let vectors = unsafe { dot_lanes::<V, f32>(a.as_ptr(), b.as_ptr(), whole).reduce_sum() };
        a[whole..]
            .iter()
            .zip(&b[whole..])
            .fold(vectors, |sum, (&a, &b)| sum + a * b)
    }
}

/// `Σ a[i]·b[i]` over `len` entries (a multiple of `LANES`), lane by
/// lane: two accumulators, even and odd vectors, so the chain of dependent
/// fused multiply-adds is half as long; their sum is returned unreduced.
/// `b` is `f32`, or half precision widened as it is loaded ([`Load`]). The
/// decode scores ([`RowScores`](super::scores::RowScores)) and [`Dot`]
/// share it.
///
/// # Safety
/// The CPU has `V`'s instruction set; `len` entries are readable at `a`
/// and at `b`, and `len` is a multiple of `V::LANES`.
#[inline(always)]
pub(crate) unsafe fn dot_lanes<V: Vector, E: Load>(a: *const f32, b: *const E, len: usize) -> V {
    // SAFETY: the caller's.
    let [[sum]] = unsafe { dot_lanes_block::<V, E, 1, 1>([a], [b], len) };
    sum
}

/// [`dot_lanes`] of `R` rows `a` against `K` rows `b` at once: entry
/// `[r][k]` is `dot_lanes(a[r], b[k], len)`, the same operations in the
/// same order, so the same bits; each vector loaded serves `K` (or `R`)
/// products instead of one. Decoding stacks a few query rows against many
/// keys, and one product per two loads left its scores bound by the load
/// ports, not the FMA pipes.
///
/// # Safety
/// As [`dot_lanes`], for every row of `a` and of `b`.
#[inline(always)]
pub(crate) unsafe fn dot_lanes_block<V: Vector, E: Load, const R: usize, const K: usize>(
    a: [*const f32; R],
    b: [*const E; K],
    len: usize,
) -> [[V; K]; R] {
    debug_assert!(len.is_multiple_of(V::LANES));
    // SAFETY: the caller's; each vector read lies below `len`.
    unsafe {
        let mut even = [[V::splat(0.0); K]; R];
        let mut odd = even;
        let step = |sums: &mut [[V; K]; R], c: usize| {
            let b: [V; K] = std::array::from_fn(|k| E::load(b[k].add(c)));
            for (row, &a) in sums.iter_mut().zip(&a) {
                let a = V::load(a.add(c));
                for (sum, &b) in row.iter_mut().zip(&b) {
                    *sum = a.mul_add(b, *sum);
                }
            }
        };
        let mut c = 0;
        while c + 2 * V::LANES <= len {
            step(&mut even, c);
            step(&mut odd, c + V::LANES);
            c += 2 * V::LANES;
        }
        if c < len {
            step(&mut even, c);
        }
        std::array::from_fn(|r| std::array::from_fn(|k| even[r][k].add(odd[r][k])))
    }
}

/// [`MaxAbs`] accumulated a vector (or a number) at a time, for kernels
/// that see the numbers on their way elsewhere (`panels.rs`).
pub(crate) struct MagnitudeBound<V> {
    max: V,
    /// The sum of `x − x`: 0, or NaN once an entry is not finite. What
    /// `max` does with a NaN differs between instruction sets; this decides
    /// those inputs instead.
    poison: V,
    /// The bound of the numbers taken one at a time.
    single: f32,
}

impl<V: Vector> MagnitudeBound<V> {
    /// The bound of no numbers, 0.
    ///
    /// # Safety
    /// The CPU has `V`'s instruction set.
    #[inline(always)]
    pub(crate) unsafe fn new() -> Self {
        // SAFETY: the caller's.
        unsafe {
            Self {
                max: V::splat(0.0),
                poison: V::splat(0.0),
                single: 0.0,
            }
        }
    }

    /// Takes in the lanes of `v`.
    ///
    /// # Safety
    /// As [`new`](Self::new).
    #[inline(always)]
    pub(crate) unsafe fn add(&mut self, v: V) {
        // SAFETY: the caller's.
        unsafe {
            self.max = v.max(V::splat(0.0).sub(v)).max(self.max);
            self.poison = self.poison.add(v.sub(v));
        }
    }

    /// Takes in `x`.
    #[inline(always)]
    pub(crate) fn add_one(&mut self, x: f32) {
        self.single = if x.is_finite() {
            self.single.max(x.abs())
        } else {
            f32::INFINITY
        };
    }

    /// The bound of everything taken in.
    ///
    /// # Safety
    /// As [`new`](Self::new).
    #[inline(always)]
    pub(crate) unsafe fn finish(self) -> f32 {
        // SAFETY: the caller's.
        let (max, poison) = unsafe { (self.max.reduce_max(), self.poison.reduce_sum()) };
        if poison.is_nan() {
            f32::INFINITY
        } else {
            max.max(self.single)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::simd::{Kernel, WithKernel, available_kernel_sets, with_kernel};

    /// Every pass against its plain loop, for every length around the
    /// vector widths and every start offset within a vector.
    #[derive(Clone, Copy)]
    struct EveryLength;

    impl WithKernel for EveryLength {
        type Output = ();

        fn run<K: Kernel>(self, kernel: K) {
            let data: Vec<f32> = (0..80)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
                .collect();
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for start in 0..16 {
                for len in 0..=(data.len() - start) {
                    let x = &data[start..start + len];
                    let mut dst = vec![7.0; len + 1];
                    kernel.scaled_copy(x, &mut dst, 0.125_3);
                    let expected: Vec<f32> = x.iter().map(|&x| x * 0.125_3).collect();
                    assert_eq!(bits(&dst[..len]), bits(&expected), "{}: scaled", K::SET);
                    assert_eq!(dst[len], 7.0, "{}: wrote past the end", K::SET);
                    kernel.divided_copy(x, &mut dst, 3.3);
                    let expected: Vec<f32> = x.iter().map(|&x| x / 3.3).collect();
                    assert_eq!(bits(&dst[..len]), bits(&expected), "{}: divided", K::SET);
                    let max = x.iter().fold(0.0f32, |max, x| max.max(x.abs()));
                    assert_eq!(kernel.max_abs(x), max, "{}: max_abs", K::SET);
                    assert!(kernel.all_finite(x), "{}: finite", K::SET);
                    // One entry not finite, at every position.
                    for at in 0..len {
                        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                            let mut x = x.to_vec();
                            x[at] = bad;
                            assert!(!kernel.all_finite(&x), "{}: {bad} at {at}", K::SET);
                            assert_eq!(kernel.max_abs(&x), f32::INFINITY, "{}: bound", K::SET);
                        }
                    }
                }
            }
            // The dot product, summed in another order than a plain loop:
            // within a few roundings of the exact sum.
            for len in 0..=data.len() {
                let (a, b) = (&data[..len], &data[data.len() - len..]);
                let exact: f64 = a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum();
                let bound: f64 = a
                    .iter()
                    .zip(b)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let got = kernel.dot(a, b) as f64;
                assert!(
                    (got - exact).abs() <= 1e-6 * bound,
                    "{}: dot of {len}: {got} against {exact}",
                    K::SET
                );
            }
            assert_eq!(kernel.dot(&[], &[]), 0.0);
            // `b` longer than `a`: only `a.len()` products.
            assert_eq!(kernel.dot(&[2.0; 19], &[1.0; 40]), 38.0);
            assert!(kernel.dot(&[1.0, f32::NAN], &[1.0, 0.0]).is_nan());
            assert_eq!(kernel.max_abs::<f32>(&[]), 0.0);
            assert_eq!(kernel.max_abs(&[-0.0; 40]).to_bits(), 0);
            #[cfg(feature = "half")]
            {
                halves::<K, half::bf16>(kernel, &data);
                halves::<K, half::f16>(kernel, &data);
            }
        }
    }

    /// The passes that read half-precision queries: widened exactly, then
    /// as the `f32` passes, for every length and start.
    #[cfg(feature = "half")]
    fn halves<K: Kernel, H: crate::simd::Load + num_traits::Float>(kernel: K, data: &[f32]) {
        use crate::simd::Load;
        let data: Vec<H> = data.iter().map(|&x| H::from(x).unwrap()).collect();
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for start in 0..16 {
            for len in 0..=(data.len() - start) {
                let x = &data[start..start + len];
                let wide: Vec<f32> = x.iter().map(|&x| Load::to_f32(x)).collect();
                let mut dst = vec![7.0; len + 1];
                kernel.scaled_copy(x, &mut dst, 0.125_3);
                let expected: Vec<f32> = wide.iter().map(|&x| x * 0.125_3).collect();
                assert_eq!(bits(&dst[..len]), bits(&expected), "{}: scaled", K::SET);
                assert_eq!(dst[len], 7.0, "{}: wrote past the end", K::SET);
                assert_eq!(
                    kernel.max_abs(x),
                    kernel.max_abs(&wide),
                    "{}: max_abs",
                    K::SET
                );
                for at in 0..len.min(3) {
                    let mut x = x.to_vec();
                    x[at] = H::nan();
                    assert_eq!(kernel.max_abs(&x), f32::INFINITY, "{}: NaN bound", K::SET);
                }
            }
        }
    }

    #[test]
    fn row_passes_match_their_plain_loops_on_every_set() {
        for set in available_kernel_sets() {
            with_kernel(set, EveryLength).unwrap();
        }
    }
}
