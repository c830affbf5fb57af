//! The key panels the score kernel reads ([`super::scores::Scores`]),
//! packed from key rows: a transposing copy, a column of `LANES` keys at a
//! time, by row loads and an in-register transpose where the set has one
//! (AVX2, AVX-512), else gathered.
//!
//! Why a kernel: written as a loop in the driver, the copy stored one
//! number at a time to a new cache line each (a key's numbers are a panel
//! apart) and took 5% of a 256-token forward on an Emerald Rapids Xeon;
//! the bound on the keys' magnitudes was a second pass over the panels.

use ndarray::ArrayView2;

use super::kernel::KernelOp;
use super::rows::MagnitudeBound;
use super::vector::Vector;

/// Writes the rows of `keys` (`[len, width]`, any strides), times
/// `scale`, into `panels`: key `j`'s number `d` at `(j / panel)·panel·width + d·panel + j % panel`,
/// `panel` the set's `KEY_VECTORS·LANES`, and zeros for the padding keys up
/// to `panels.len() / width`. Returns the packed numbers'
/// [`MaxAbs`](super::rows::MaxAbs) bound: the largest `|x|`, or `+inf`
/// when one is NaN or infinite.
///
/// The forward's keys carry the call's scale this way, so that its query
/// rows can be read where they lie rather than copied scaled (a copy of
/// every query, where this multiply rides on a copy made anyway).
pub(crate) struct PackPanels<'a> {
    pub keys: ArrayView2<'a, f32>,
    pub panels: &'a mut [f32],
    pub scale: f32,
}

impl KernelOp for PackPanels<'_> {
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
        let PackPanels {
            keys,
            panels,
            scale,
        } = self;
        let panel = KEY_VECTORS * V::LANES;
        let (len, width) = keys.dim();
        if width == 0 {
            return 0.0;
        }
        let padded = panels.len() / width;
        assert!(padded * width == panels.len() && padded.is_multiple_of(panel) && padded >= len);
        let (row_stride, column_stride) = (keys.strides()[0], keys.strides()[1]);
        // A gather's offsets are `i32`: a wider stride goes one by one.
        let gathers = row_stride.unsigned_abs() <= i32::MAX as usize / 16;
        let whole = if gathers { len - len % V::LANES } else { 0 };
        // Where key `j`'s first number goes.
        let column = |j: usize| (j / panel) * panel * width + j % panel;
        let (from, to) = (keys.as_ptr(), panels.as_mut_ptr());
        // Rows of contiguous numbers are loaded `LANES` at a time and
        // transposed in registers where the set can: a gather costs one
        // load per lane (on Zen 4 the gathers were four fifths of this
        // copy, itself 4% of a 256-token forward).
        let by_blocks = V::TRANSPOSES_IN_REGISTERS && column_stride == 1;
        // SAFETY: the caller guarantees V's instruction set. Keys
        // `j..j + LANES` are below `whole ≤ len`, so every lane read is an
        // entry of `keys` (`from` offset by its strides) and fits the
        // gather's offsets (checked above); key `j`'s column and the
        // `LANES` after it lie in one panel (`j` is a multiple of `LANES`,
        // as is `panel`), inside `panels` (`j < padded`, checked above).
        // A block's row i holds key j + i's numbers d..d + LANES, inside
        // its row (`d + LANES ≤ width`, the numbers contiguous). Prefetch
        // addresses are computed with wrapping arithmetic and may lie past
        // the keys: a prefetch is a hint that never faults.
        let mut bound = unsafe {
            let mut bound = MagnitudeBound::<V>::new();
            let factor = V::splat(scale);
            // Keys are read once, often from memory or L3 (the call's
            // first touch of them), `LANES` rows at a time across the
            // whole width: two blocks of keys ahead are prefetched.
            let ahead = 2 * V::LANES as isize * row_stride;
            for j in (0..whole).step_by(V::LANES) {
                let first = from.offset(j as isize * row_stride);
                let out = to.add(column(j));
                let mut d = 0;
                while by_blocks && d + V::LANES <= width {
                    // Row i of the block: key j + i's numbers d.. (LANES of
                    // them, inside its row); after the transpose, row dd
                    // is number d + dd of the LANES keys.
                    let mut block = [V::splat(0.0); 16];
                    for (i, row) in block.iter_mut().take(V::LANES).enumerate() {
                        let at = first.offset(i as isize * row_stride).add(d);
                        *row = V::load(at);
                        // The same numbers of the keys two blocks on.
                        V::prefetch(at.wrapping_offset(ahead).cast());
                    }
                    V::transpose(&mut block[..V::LANES]);
                    for (dd, &numbers) in block.iter().take(V::LANES).enumerate() {
                        let numbers = numbers.mul(factor);
                        numbers.store(out.add((d + dd) * panel));
                        bound.add(numbers);
                    }
                    d += V::LANES;
                }
                for d in d..width {
                    let numbers =
                        V::gather(first.offset(d as isize * column_stride), row_stride).mul(factor);
                    numbers.store(out.add(d * panel));
                    bound.add(numbers);
                }
            }
            bound
        };
        // The last keys one by one, then zeros for the padding.
        for j in whole..padded {
            let out = &mut panels[column(j)..];
            for (d, packed) in out.iter_mut().step_by(panel).take(width).enumerate() {
                *packed = if j < len { keys[[j, d]] * scale } else { 0.0 };
                bound.add_one(*packed);
            }
        }
        // SAFETY: V's instruction set, the caller's.
        unsafe { bound.finish() }
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, ArrayView2, s};

    use crate::simd::{Kernel, WithKernel, available_kernel_sets, with_kernel};

    /// The packing and the bound against a plain loop, for key counts
    /// around the vector width and the panel, narrow and wide rows, and
    /// views with every kind of stride.
    struct EveryShape;

    impl WithKernel for EveryShape {
        type Output = ();

        fn run<K: Kernel>(self, kernel: K) {
            let panel = K::KEY_PANEL;
            let check = |keys: ArrayView2<'_, f32>, what: &str| {
                for scale in [1.0, 0.37] {
                    let (len, width) = keys.dim();
                    let padded = len.div_ceil(panel).max(1) * panel;
                    let mut packed = vec![f32::NAN; padded * width];
                    let bound = kernel.pack_panels(keys, &mut packed, scale);
                    let mut expected = vec![0.0f32; padded * width];
                    for ((j, d), &x) in keys.indexed_iter() {
                        expected[(j / panel) * panel * width + d * panel + j % panel] = x * scale;
                    }
                    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&packed),
                        bits(&expected),
                        "{}: {what} {len}×{width}",
                        K::SET
                    );
                    let max = keys
                        .iter()
                        .fold(0.0f32, |max, x| max.max((x * scale).abs()));
                    let max = if keys.iter().all(|x| x.is_finite()) {
                        max
                    } else {
                        f32::INFINITY
                    };
                    assert_eq!(bound, max, "{}: {what} bound {len}×{width}", K::SET);
                }
            };
            for len in [
                0,
                1,
                K::LANES - 1,
                K::LANES,
                K::LANES + 1,
                panel - 1,
                panel,
                panel + 3,
                2 * panel + K::LANES,
            ] {
                for width in [1, 3, 16, 17, 33, 64] {
                    let keys = Array2::from_shape_fn((len, width), |(j, d)| {
                        ((j * 31 + d * 7) % 19) as f32 * 0.25 - 2.0
                    });
                    check(keys.view(), "rows");
                    // A column-major copy, a reversed one, a strided slice.
                    let transposed = keys.t().to_owned();
                    check(transposed.t(), "columns");
                    check(keys.slice(s![..;-1, ..]), "reversed");
                    let wide = Array2::from_shape_fn((len, 2 * width + 1), |(j, d)| (j + d) as f32);
                    check(wide.slice(s![.., 1..;2]), "strided");
                    // A NaN or infinity anywhere makes the bound +inf.
                    for bad in [f32::NAN, f32::NEG_INFINITY] {
                        for at in [0, len / 2, len.saturating_sub(1)] {
                            if len > 0 {
                                for column in [0, width - 1] {
                                    let mut keys = keys.clone();
                                    keys[[at, column]] = bad;
                                    check(keys.view(), "not finite");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn panels_match_a_plain_transpose_on_every_set() {
        for set in available_kernel_sets() {
            with_kernel(set, EveryShape).unwrap();
        }
    }
}
