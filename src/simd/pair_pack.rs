//! Keys and values packed into the `bf16` pairs both native kernels read
//! ([`Bf16Dot`] and [`super::amx::Amx`]), 16 at a time with AVX-512 (every
//! CPU with AVX-512 BF16 has it), straight from the call's `bf16` rows:
//! a key's two neighbouring dims are already a pair in memory, and a value
//! pair is two rows' numbers side by side.
//!
//! Why kernels: as loops in the driver, packing stored one `u32` at a time
//! (a key's pairs are a tile row apart) and checked finiteness element by
//! element: 11–13% of a 256-token `bf16` forward on Sapphire Rapids.

use std::arch::x86_64::*;

use half::bf16;

use super::bf16::{Bf16Dot, PAIR_KEYS};
use super::vector::Vector;

/// `u32` lanes of a vector.
const LANES: usize = 16;

impl Bf16Dot {
    /// Packs the key rows `keys` (`[len][d_k]`, row-major) into key tiles
    /// of [`PAIR_KEYS`] keys, `[d_pairs][PAIR_KEYS]` each (`d_pairs =
    /// ⌈d_k/2⌉`): key `j`'s dims `2p`, `2p + 1` as `bf16` in the low and
    /// high half of entry `[j / PAIR_KEYS][p][j % PAIR_KEYS]`. Padding keys
    /// and an odd `d_k`'s missing dim are zero.
    ///
    /// # Panics
    /// When the sizes do not fit (a bug in the driver, never user input).
    pub(crate) fn pack_keys(self, keys: &[bf16], d_k: usize, out: &mut [u32]) {
        assert!(d_k > 0 && keys.len().is_multiple_of(d_k));
        let (len, d_pairs) = (keys.len() / d_k, d_k.div_ceil(2));
        assert!(out.len().is_multiple_of(d_pairs * PAIR_KEYS));
        assert!(out.len() / d_pairs >= len, "room for every key");
        // The gathers' offsets, `j·d_k` for 16 keys, are `i32`.
        assert!(d_k <= i32::MAX as usize / LANES);
        // SAFETY: `self` exists, so the CPU has AVX-512F and BW; the sizes
        // are checked above.
        unsafe { pack_keys(keys, d_k, out) }
    }

    /// Packs the value rows `values` (`[len][d_v]`, row-major) into value
    /// tiles of [`PAIR_KEYS`] keys, `[PAIR_KEYS/2][width]` each: keys `2i`,
    /// `2i + 1` of column `c` as `bf16` in the low and high half of entry
    /// `[i][c]`. Padding keys and columns `d_v..width` are zero. Sets
    /// `nonfinite[t]` when tile `t` holds a NaN or an infinity, and clears
    /// it otherwise.
    ///
    /// # Panics
    /// When the sizes do not fit (a bug in the driver, never user input).
    pub(crate) fn pack_values(
        self,
        values: &[bf16],
        d_v: usize,
        width: usize,
        out: &mut [u32],
        nonfinite: &mut [bool],
    ) {
        assert!(d_v > 0 && values.len().is_multiple_of(d_v));
        assert!(width >= d_v && width.is_multiple_of(LANES));
        let len = values.len() / d_v;
        assert!(out.len() == nonfinite.len() * PAIR_KEYS / 2 * width);
        assert!(nonfinite.len() * PAIR_KEYS >= len, "room for every key");
        // SAFETY: as in `pack_keys`.
        unsafe { pack_values(values, d_v, width, out, nonfinite) }
    }
}

/// [`Bf16Dot::pack_keys`]: 16 whole keys, 16 pairs at a time, by 16 row
/// loads and an in-register transpose of their 32-bit pairs
/// ([`Vector::transpose`]: shuffles move bits, they do no arithmetic);
/// the pairs and keys left over by one masked gather per pair (a gather
/// costs a load per lane: on Zen 4 the transposes made the f32 key
/// panels' copy several times faster). An odd `d_k`'s last dim has no
/// neighbour to read with it, so it goes alone, key by key.
///
/// # Safety
/// The CPU has AVX-512F and BW; the sizes are as `pack_keys` checks.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_keys(keys: &[bf16], d_k: usize, out: &mut [u32]) {
    let (len, d_pairs, whole_pairs) = (keys.len() / d_k, d_k.div_ceil(2), d_k / 2);
    // Offsets in `bf16`s (the gathers scale them by 2).
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(d_k as i32),
    );
    let zero = _mm512_setzero_si512();
    let padded = out.len() / d_pairs;
    for j0 in (0..padded).step_by(LANES) {
        let at = (j0 / PAIR_KEYS * d_pairs) * PAIR_KEYS + j0 % PAIR_KEYS;
        let present = len.saturating_sub(j0).min(LANES);
        let mask = ((1u32 << present) - 1) as u16;
        // Pairs `p0..` are left to the gathers below.
        let mut p0 = 0;
        while present == LANES && p0 + LANES <= whole_pairs {
            // SAFETY: keys j0..j0 + 16 exist (`present`); row i's 16 pairs
            // from p0 are its dims 2·p0.. 2·p0 + 32 ≤ d_k. The 16 vectors
            // stored are tile rows p0.. of 16 entries from `at`, inside
            // `out` as the gathers' below.
            unsafe {
                let mut block = [_mm512_setzero_ps(); LANES];
                for (i, row) in block.iter_mut().enumerate() {
                    *row = _mm512_loadu_ps(keys.as_ptr().add((j0 + i) * d_k + 2 * p0).cast());
                }
                <__m512 as Vector>::transpose(&mut block);
                for (p, pairs) in block.iter().enumerate() {
                    let to = out.as_mut_ptr().add(at + (p0 + p) * PAIR_KEYS);
                    _mm512_storeu_ps(to.cast(), *pairs);
                }
            }
            p0 += LANES;
        }
        for p in p0..whole_pairs {
            // SAFETY: lanes below `present` read dims 2p and 2p + 1 < d_k
            // of keys j0.., all inside `keys`; masked-off lanes read
            // nothing. The 16 entries stored lie in one tile row (`j0` is
            // a multiple of 16, as is `PAIR_KEYS`), inside `out`.
            unsafe {
                let pair = if present == 0 {
                    zero
                } else {
                    let row = keys.as_ptr().add(j0 * d_k + 2 * p);
                    _mm512_mask_i32gather_epi32::<2>(zero, mask, offsets, row.cast())
                };
                _mm512_storeu_si512(out.as_mut_ptr().add(at + p * PAIR_KEYS).cast(), pair);
            }
        }
        if whole_pairs < d_pairs {
            let p = whole_pairs;
            let entries = &mut out[at + p * PAIR_KEYS..][..LANES];
            for (lane, entry) in entries.iter_mut().enumerate() {
                let j = j0 + lane;
                *entry = if j < len {
                    u32::from(keys[j * d_k + 2 * p].to_bits())
                } else {
                    0
                };
            }
        }
    }
}

/// [`Bf16Dot::pack_values`]: two value rows, 16 columns at a time, widened
/// to 32-bit lanes and merged into 16 pairs; a number is non-finite when
/// its exponent bits are all set.
///
/// # Safety
/// The CPU has AVX-512F and BW; the sizes are as `pack_values` checks.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_values(
    values: &[bf16],
    d_v: usize,
    width: usize,
    out: &mut [u32],
    nonfinite: &mut [bool],
) {
    let len = values.len() / d_v;
    let zero = _mm512_setzero_si512();
    let exponent = _mm512_set1_epi32(0x7f80);
    // Row `j`'s columns c..c + 16 that exist, each in the low half of a
    // lane; zero past `d_v` and `len`.
    let load = |j: usize, c: usize| {
        if j >= len || c >= d_v {
            return zero;
        }
        // SAFETY: the CPU has AVX-512F and BW (this function's promise);
        // the lanes of the mask are columns below d_v of row j < len.
        unsafe { row_part(values, j * d_v + c, (d_v - c).min(LANES)) }
    };
    for (t, flag) in nonfinite.iter_mut().enumerate() {
        let mut special = 0u16;
        for i in t * PAIR_KEYS / 2..(t + 1) * PAIR_KEYS / 2 {
            for c in (0..width).step_by(LANES) {
                let (even, odd) = (load(2 * i, c), load(2 * i + 1, c));
                special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(even, exponent), exponent)
                    | _mm512_cmpeq_epi32_mask(_mm512_and_si512(odd, exponent), exponent);
                let pair = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
                // SAFETY: entry [i][c..c + 16] is inside `out` (checked by
                // the caller: `out` holds every tile's PAIR_KEYS/2 rows).
                unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(i * width + c).cast(), pair) };
            }
        }
        *flag = special != 0;
    }
}

/// `n ≤ 16` numbers of `x` from `at`, each zero-extended to a 32-bit lane;
/// zero in the other lanes.
///
/// # Safety
/// The CPU has AVX-512F and BW; `x[at..at + n]` exists.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn row_part(x: &[bf16], at: usize, n: usize) -> __m512i {
    let mask = (1u32 << n) - 1;
    // SAFETY: the caller's promise; masked-off lanes read nothing.
    unsafe {
        let halves = _mm512_maskz_loadu_epi16(mask, x.as_ptr().add(at).cast());
        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(halves))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `bf16`, irregular.
    fn number(i: usize) -> bf16 {
        bf16::from_f32(((i as f32) * 0.618_034).fract() * 8.0 - 4.0)
    }

    fn bits(x: bf16) -> u32 {
        u32::from(x.to_bits())
    }

    #[test]
    fn keys_land_where_the_kernels_read_them() {
        let Some(dot) = Bf16Dot::new() else { return };
        for (len, d_k) in [(1, 1), (17, 3), (64, 64), (100, 33), (48, 81), (130, 128)] {
            let keys: Vec<bf16> = (0..len * d_k).map(number).collect();
            let d_pairs = d_k.div_ceil(2);
            let tiles = len.div_ceil(PAIR_KEYS);
            let mut out = vec![u32::MAX; tiles * d_pairs * PAIR_KEYS];
            dot.pack_keys(&keys, d_k, &mut out);
            for j in 0..tiles * PAIR_KEYS {
                for p in 0..d_pairs {
                    let dim = |d: usize| {
                        if j < len && d < d_k {
                            bits(keys[j * d_k + d])
                        } else {
                            0
                        }
                    };
                    let want = dim(2 * p) | dim(2 * p + 1) << 16;
                    let at = (j / PAIR_KEYS * d_pairs + p) * PAIR_KEYS + j % PAIR_KEYS;
                    assert_eq!(out[at], want, "{len}×{d_k}: key {j} pair {p}");
                }
            }
        }
    }

    #[test]
    fn values_land_where_the_kernels_read_them_and_tiles_note_nan() {
        let Some(dot) = Bf16Dot::new() else { return };
        for (len, d_v) in [(1, 1), (17, 16), (65, 40), (130, 64)] {
            let mut values: Vec<bf16> = (0..len * d_v).map(number).collect();
            // NaN in the last key, an infinity in key 70 (tile 1) if any.
            values[len * d_v - 1] = bf16::NAN;
            if len > 70 {
                values[70 * d_v] = bf16::INFINITY;
            }
            let width = d_v.div_ceil(LANES) * LANES;
            let tiles = len.div_ceil(PAIR_KEYS);
            let mut out = vec![u32::MAX; tiles * PAIR_KEYS / 2 * width];
            let mut nonfinite = vec![true; tiles];
            dot.pack_values(&values, d_v, width, &mut out, &mut nonfinite);
            for i in 0..tiles * PAIR_KEYS / 2 {
                for c in 0..width {
                    let key = |j: usize| {
                        if j < len && c < d_v {
                            bits(values[j * d_v + c])
                        } else {
                            0
                        }
                    };
                    assert_eq!(out[i * width + c], key(2 * i) | key(2 * i + 1) << 16);
                }
            }
            let last = (len - 1) / PAIR_KEYS;
            for (t, &flag) in nonfinite.iter().enumerate() {
                assert_eq!(
                    flag,
                    t == last || (len > 70 && t == 1),
                    "{len}×{d_v} tile {t}"
                );
            }
        }
    }
}
