//! Keys and values packed into the `bf16` pairs both native kernels read
//! ([`Bf16Dot`] and [`super::amx::Amx`]), 16 at a time with AVX-512 (every
//! CPU with AVX-512 BF16 has it). The inputs are `f32` widened from `bf16`,
//! so a number's `bf16` is its top half, exactly (NaN payloads included).
//!
//! Why kernels: as loops in the driver, packing stored one `u32` at a time
//! (a key's pairs are a tile row apart) and checked finiteness element by
//! element: 11–13% of a 256-token `bf16` forward on Sapphire Rapids.

use std::arch::x86_64::*;

use super::bf16::{Bf16Dot, PAIR_KEYS};

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
    pub(crate) fn pack_keys(self, keys: &[f32], d_k: usize, out: &mut [u32]) {
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
        values: &[f32],
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

/// [`Bf16Dot::pack_keys`]: per 16 keys and pair, two masked gathers (the
/// pair's two dims of 16 key rows) merged into 16 pairs.
///
/// # Safety
/// The CPU has AVX-512F and BW; the sizes are as `pack_keys` checks.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_keys(keys: &[f32], d_k: usize, out: &mut [u32]) {
    let (len, d_pairs) = (keys.len() / d_k, d_k.div_ceil(2));
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(d_k as i32),
    );
    let (zero, top) = (
        _mm512_setzero_si512(),
        _mm512_set1_epi32(0xffff_0000u32 as i32),
    );
    let padded = out.len() / d_pairs;
    for j0 in (0..padded).step_by(LANES) {
        let at = (j0 / PAIR_KEYS * d_pairs) * PAIR_KEYS + j0 % PAIR_KEYS;
        let present = len.saturating_sub(j0).min(LANES);
        let mask = ((1u32 << present) - 1) as u16;
        for p in 0..d_pairs {
            // SAFETY: lanes below `present` read dims 2p and 2p + 1 (when
            // below d_k) of keys j0.., all inside `keys`; masked-off lanes
            // read nothing. The 16 entries stored lie in one tile row
            // (`j0` is a multiple of 16, as is `PAIR_KEYS`), inside `out`.
            unsafe {
                let pair = if present == 0 {
                    zero
                } else {
                    let row = keys.as_ptr().add(j0 * d_k + 2 * p);
                    let low = _mm512_mask_i32gather_epi32::<4>(zero, mask, offsets, row.cast());
                    let high = if 2 * p + 1 < d_k {
                        _mm512_mask_i32gather_epi32::<4>(zero, mask, offsets, row.add(1).cast())
                    } else {
                        zero
                    };
                    _mm512_or_si512(_mm512_srli_epi32(low, 16), _mm512_and_si512(high, top))
                };
                _mm512_storeu_si512(out.as_mut_ptr().add(at + p * PAIR_KEYS).cast(), pair);
            }
        }
    }
}

/// [`Bf16Dot::pack_values`]: two value rows, 16 columns at a time, merged
/// into 16 pairs; a number is non-finite when its exponent bits are all
/// set.
///
/// # Safety
/// The CPU has AVX-512F and BW; the sizes are as `pack_values` checks.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_values(
    values: &[f32],
    d_v: usize,
    width: usize,
    out: &mut [u32],
    nonfinite: &mut [bool],
) {
    let len = values.len() / d_v;
    let (zero, top) = (
        _mm512_setzero_si512(),
        _mm512_set1_epi32(0xffff_0000u32 as i32),
    );
    let exponent = _mm512_set1_epi32(0x7f80_0000);
    // Row `j`'s columns c..c + 16 that exist, zero past `d_v` and `len`.
    let load = |j: usize, c: usize| {
        if j >= len || c >= d_v {
            return zero;
        }
        // SAFETY: the CPU has AVX-512F (this function's promise); the lanes
        // of the mask are columns below d_v of row j < len.
        unsafe { row_part(values, j * d_v + c, (d_v - c).min(LANES)) }
    };
    for (t, flag) in nonfinite.iter_mut().enumerate() {
        let mut special = 0u16;
        for i in t * PAIR_KEYS / 2..(t + 1) * PAIR_KEYS / 2 {
            for c in (0..width).step_by(LANES) {
                let (even, odd) = (load(2 * i, c), load(2 * i + 1, c));
                special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(even, exponent), exponent)
                    | _mm512_cmpeq_epi32_mask(_mm512_and_si512(odd, exponent), exponent);
                let pair = _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_and_si512(odd, top));
                // SAFETY: entry [i][c..c + 16] is inside `out` (checked by
                // the caller: `out` holds every tile's PAIR_KEYS/2 rows).
                unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(i * width + c).cast(), pair) };
            }
        }
        *flag = special != 0;
    }
}

/// `n ≤ 16` numbers of `x` from `at`, zero in the other lanes.
///
/// # Safety
/// The CPU has AVX-512F; `x[at..at + n]` exists.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn row_part(x: &[f32], at: usize, n: usize) -> __m512i {
    let mask = ((1u32 << n) - 1) as u16;
    // SAFETY: the caller's promise; masked-off lanes read nothing.
    unsafe { _mm512_maskz_loadu_epi32(mask, x.as_ptr().add(at).cast()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number widened from `bf16` (its low half zero), irregular.
    fn number(i: usize) -> f32 {
        let x = ((i as f32) * 0.618_034).fract() * 8.0 - 4.0;
        f32::from_bits(x.to_bits() & 0xffff_0000)
    }

    fn top(x: f32) -> u32 {
        x.to_bits() >> 16
    }

    #[test]
    fn keys_land_where_the_kernels_read_them() {
        let Some(dot) = Bf16Dot::new() else { return };
        for (len, d_k) in [(1, 1), (17, 3), (64, 64), (100, 33), (130, 128)] {
            let keys: Vec<f32> = (0..len * d_k).map(number).collect();
            let d_pairs = d_k.div_ceil(2);
            let tiles = len.div_ceil(PAIR_KEYS);
            let mut out = vec![u32::MAX; tiles * d_pairs * PAIR_KEYS];
            dot.pack_keys(&keys, d_k, &mut out);
            for j in 0..tiles * PAIR_KEYS {
                for p in 0..d_pairs {
                    let dim = |d: usize| {
                        if j < len && d < d_k {
                            top(keys[j * d_k + d])
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
            let mut values: Vec<f32> = (0..len * d_v).map(number).collect();
            // NaN in the last key, an infinity in key 70 (tile 1) if any.
            values[len * d_v - 1] = f32::NAN;
            if len > 70 {
                values[70 * d_v] = f32::INFINITY;
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
                            top(values[j * d_v + c])
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
