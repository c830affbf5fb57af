//! `f32` numbers as three `bf16` parts, so that AMX tiles, which multiply
//! `bf16` only, can compute `f32` products to `f32` accuracy
//! (`fused/split.rs`).
//!
//! `x = hi + mid + lo`: `hi` is `x` rounded to `bf16` (to nearest even),
//! `mid` what is left rounded again, `lo` the rest. Rounding to nearest
//! leaves at most half a unit of 8 bits each time, so `|mid| ≤ 2⁻⁸|x|`,
//! `|lo| ≤ 2⁻¹⁶|x|`, and for a normal `x` whose parts are normal the three
//! add up to `x` exactly (24 significant bits in three of 8). A product
//! `a·b` is then summed from the six partial products of order ≥ 2⁻¹⁶
//! ([`SPLIT_PRODUCTS`]); the three left out are at most about
//! 2⁻²³·|a·b| together (`2·2⁻⁸·2⁻¹⁶ + 2⁻³²`), at `f32`'s rounding of the
//! sum. Measured over 256 000 dot
//! products of length 64 and 128 (`docs/experiments/amx_split`): 0.5–1.07
//! times the error of a sequential `f32` FMA sum, relative to `Σ|aᵢbᵢ|`.
//!
//! What the split does not keep, the callers treat apart: a part below
//! `f32`'s normal range is flushed to zero (by `vcvtneps2bf16` and by
//! `tdpbf16ps`, as for every `bf16` operand), an absolute error below
//! 2⁻¹²⁶ per element, far under what reaches a score; NaN, infinities and
//! numbers whose `hi` rounds past `bf16`'s largest finite value split into
//! NaN or infinite parts, so the callers flag them ([`Amx::split_pairs`]
//! and the packing splits say where) and compute what they touch in
//! `f32`.

use std::arch::x86_64::*;

use super::amx::Amx;
use super::bf16::PAIR_KEYS;
use super::vector::Vector;

/// The partial products `part_a · part_b` (0 = `hi`, 1 = `mid`, 2 = `lo`)
/// of a three-way split whose order is at least 2⁻¹⁶, grouped by the first
/// part so that a kernel loads each of its tiles once.
pub(crate) const SPLIT_PRODUCTS: [(usize, usize); 6] =
    [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)];

/// `f32` lanes of a vector.
const LANES: usize = 16;

impl Amx {
    /// Splits `x` into `parts` (`hi`, `mid`, `lo`) as `bf16` pairs (`x[2p]`
    /// in the low half of pair `p`, the layout the tiles read), for an `x`
    /// of even length; returns whether some `|x|` is not below `bound`
    /// (NaN included): where the caller must not trust the parts.
    ///
    /// # Panics
    /// When `x.len()` is odd or a part's length is not `x.len() / 2`.
    pub(crate) fn split_pairs(self, x: &[f32], bound: f32, parts: [&mut [u32]; 3]) -> bool {
        assert!(x.len().is_multiple_of(2));
        assert!(parts.iter().all(|part| 2 * part.len() == x.len()));
        // SAFETY: `self` exists, so the CPU has AVX-512F, BW, VL and BF16
        // (every AMX CPU does); each part holds `x.len()` `u16`s (pairs are
        // two, the first in the low half on this little-endian CPU).
        unsafe { split(x, bound, parts.map(|part| part.as_mut_ptr().cast::<u16>())) }
    }

    /// Splits up to [`PAIR_KEYS`] key rows (`keys`, `[rows][d_k]`, `d_k`
    /// a multiple of 32) and packs each part as a key tile `[d_k/2][64]`
    /// of `bf16` pairs (dims `2p`, `2p + 1` of key `j` at `[p][j]`, the
    /// layout the tiles read), keys past `rows` zero. Returns the rows with
    /// a magnitude not below `bound` (or NaN), bit `j` for row `j`: their
    /// parts are not to be trusted.
    ///
    /// # Panics
    /// When the sizes do not fit (a bug in the driver).
    pub(crate) fn split_pack_keys(
        self,
        keys: &[f32],
        d_k: usize,
        bound: f32,
        tiles: [&mut [u32]; 3],
    ) -> u64 {
        assert!(d_k > 0 && d_k.is_multiple_of(2 * LANES));
        assert!(keys.len().is_multiple_of(d_k) && keys.len() / d_k <= PAIR_KEYS);
        assert!(tiles.iter().all(|tile| tile.len() == d_k / 2 * PAIR_KEYS));
        // SAFETY: `self` exists, so the CPU has AVX-512F, BW, VL and BF16;
        // the sizes are checked above.
        unsafe { split_pack_keys(keys, d_k, bound, tiles.map(<[u32]>::as_mut_ptr)) }
    }

    /// Splits up to [`PAIR_KEYS`] value rows (`values`, `[rows][d_v]`)
    /// and packs each part as a value tile `[32][width]` of `bf16` pairs
    /// (rows `2i`, `2i + 1` of column `c` at `[i][c]`), rows past `rows`
    /// and columns past `d_v` zero. Returns the rows to distrust as
    /// [`split_pack_keys`](Self::split_pack_keys) does.
    ///
    /// # Panics
    /// When the sizes do not fit (a bug in the driver).
    pub(crate) fn split_pack_values(
        self,
        values: &[f32],
        d_v: usize,
        width: usize,
        bound: f32,
        tiles: [&mut [u32]; 3],
    ) -> u64 {
        assert!(d_v > 0 && width >= d_v && width.is_multiple_of(LANES));
        assert!(values.len().is_multiple_of(d_v) && values.len() / d_v <= PAIR_KEYS);
        assert!(tiles.iter().all(|tile| tile.len() == PAIR_KEYS / 2 * width));
        // SAFETY: as in `split_pack_keys`.
        unsafe { split_pack_values(values, d_v, width, bound, tiles.map(<[u32]>::as_mut_ptr)) }
    }
}

/// [`Amx::split_pack_keys`]: per 16 keys and 16 pairs of dims, each key's
/// 32 dims split (two vectors, whose parts are 8 pairs each), and each
/// part's 16 × 16 pairs transposed in registers into 16 tile rows.
///
/// # Safety
/// The CPU has the features; the sizes are as `split_pack_keys` checks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn split_pack_keys(keys: &[f32], d_k: usize, bound: f32, tiles: [*mut u32; 3]) -> u64 {
    let rows = keys.len() / d_k;
    let bound = _mm512_set1_ps(bound);
    let mut beyond = 0u64;
    for j0 in (0..PAIR_KEYS).step_by(LANES) {
        for p0 in (0..d_k / 2).step_by(LANES) {
            let mut blocks = [[_mm512_setzero_ps(); LANES]; 3];
            for i in (0..LANES).take_while(|i| j0 + i < rows) {
                // SAFETY: key j0 + i < rows, dims 2·p0..2·p0 + 32 ≤ d_k.
                let x = unsafe { keys.as_ptr().add((j0 + i) * d_k + 2 * p0) };
                let halves = [0, LANES].map(|h| unsafe { _mm512_loadu_ps(x.add(h)) });
                for half in halves {
                    if _mm512_cmp_ps_mask(_mm512_abs_ps(half), bound, _CMP_NLT_UQ) != 0 {
                        beyond |= 1 << (j0 + i);
                    }
                }
                let [low, high] = halves.map(|half| split16(half));
                for a in 0..3 {
                    let pairs = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low[a]), high[a]);
                    blocks[a][i] = _mm512_castsi512_ps(pairs);
                }
            }
            for (a, block) in blocks.iter_mut().enumerate() {
                // SAFETY: AVX-512F; tile rows p0.. of 16 entries from j0
                // are inside the tile (d_k/2 rows of 64).
                unsafe {
                    <__m512 as Vector>::transpose(block);
                    for (p, row) in block.iter().enumerate() {
                        let at = tiles[a].add((p0 + p) * PAIR_KEYS + j0);
                        _mm512_storeu_ps(at.cast(), *row);
                    }
                }
            }
        }
    }
    beyond
}

/// [`Amx::split_pack_values`]: per pair of rows and 16 columns, both rows
/// split with their parts kept as `f32` (low halves zero), the even row's
/// shifted into the low half of each pair.
///
/// # Safety
/// The CPU has the features; the sizes are as `split_pack_values` checks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn split_pack_values(
    values: &[f32],
    d_v: usize,
    width: usize,
    bound: f32,
    tiles: [*mut u32; 3],
) -> u64 {
    let rows = values.len() / d_v;
    let bound = _mm512_set1_ps(bound);
    let mut beyond = 0u64;
    for i in 0..PAIR_KEYS / 2 {
        for c in (0..width).step_by(LANES) {
            let mask: __mmask16 = if c >= d_v {
                0
            } else {
                ((1u32 << (d_v - c).min(LANES)) - 1) as u16
            };
            let [even, odd] = [2 * i, 2 * i + 1].map(|j| {
                if j >= rows {
                    return [_mm512_setzero_si512(); 3];
                }
                // SAFETY: row j < rows; the mask's lanes are columns below
                // d_v; masked-off lanes read nothing.
                let x = unsafe { _mm512_maskz_loadu_ps(mask, values.as_ptr().add(j * d_v + c)) };
                if _mm512_cmp_ps_mask(_mm512_abs_ps(x), bound, _CMP_NLT_UQ) != 0 {
                    beyond |= 1 << j;
                }
                split16(x).map(|part| _mm512_cvtepu16_epi32(part))
            });
            for a in 0..3 {
                let pairs = _mm512_or_si512(even[a], _mm512_slli_epi32::<16>(odd[a]));
                // SAFETY: entry [i][c..c + 16] is inside the tile.
                unsafe { _mm512_storeu_si512(tiles[a].add(i * width + c).cast(), pairs) };
            }
        }
    }
    beyond
}

/// [`Amx::split_pairs`].
///
/// # Safety
/// The CPU has the features; each part has room for `x.len()` `u16`s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn split(x: &[f32], bound: f32, parts: [*mut u16; 3]) -> bool {
    let bound = _mm512_set1_ps(bound);
    let mut beyond = 0;
    let [hi, mid, lo] = parts;
    for i in (0..x.len()).step_by(LANES) {
        // The last vector is masked to the elements left.
        let mask: __mmask16 = if x.len() - i >= LANES {
            !0
        } else {
            (1 << (x.len() - i)) - 1
        };
        // SAFETY: lanes `i..i + 16` inside `x` and the parts, masked.
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i));
            // Not below the bound, or unordered (NaN).
            beyond |= _mm512_mask_cmp_ps_mask(mask, _mm512_abs_ps(v), bound, _CMP_NLT_UQ);
            let [h, m, l] = split16(v);
            _mm256_mask_storeu_epi16(hi.add(i).cast(), mask, h);
            _mm256_mask_storeu_epi16(mid.add(i).cast(), mask, m);
            _mm256_mask_storeu_epi16(lo.add(i).cast(), mask, l);
        }
    }
    beyond != 0
}

/// 16 `f32` as their three `bf16` parts, 16 each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) fn split16(x: __m512) -> [__m256i; 3] {
    let hi = round(x);
    let rest = _mm512_sub_ps(x, widen(hi));
    let mid = round(rest);
    let lo = round(_mm512_sub_ps(rest, widen(mid)));
    [hi, mid, lo]
}

/// `x` rounded to `bf16` (to nearest even), as 16 `u16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn round(x: __m512) -> __m256i {
    // SAFETY: 32 bytes of plain bits either way.
    unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x)) }
}

/// 16 `bf16` (as `u16`) widened to `f32` exactly: their bits in the high
/// half of each lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn widen(x: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(x)))
}

#[cfg(all(test, feature = "half"))]
mod tests {
    use half::bf16;

    use super::*;

    /// Part `a` of element `i` from pairs.
    fn part(parts: &[Vec<u32>; 3], a: usize, i: usize) -> bf16 {
        bf16::from_bits((parts[a][i / 2] >> (16 * (i % 2))) as u16)
    }

    /// Splits `x` (even length) into pairs.
    fn split_pairs(amx: Amx, x: &[f32], bound: f32) -> ([Vec<u32>; 3], bool) {
        let mut parts = [0; 3].map(|_| vec![0u32; x.len() / 2]);
        let [hi, mid, lo] = &mut parts;
        let beyond = amx.split_pairs(x, bound, [hi, mid, lo]);
        (parts, beyond)
    }

    /// Irregular normal numbers over many binades, both signs.
    fn numbers(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let m = ((i as f32) * 0.618_034).fract() + 0.5;
                let e = (i % 61) as i32 - 30;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * m * 2f32.powi(e)
            })
            .collect()
    }

    #[test]
    fn parts_add_up_to_x_and_flag_what_they_cannot_hold() {
        let Some(amx) = Amx::new() else { return };
        // A length that leaves a masked tail.
        let x = numbers(1000);
        let (parts, beyond) = split_pairs(amx, &x, 1e30);
        assert!(!beyond);
        for (i, &x) in x.iter().enumerate() {
            let [hi, mid, lo] = [0, 1, 2].map(|a| f64::from(part(&parts, a, i)));
            assert_eq!(hi + mid + lo, f64::from(x), "element {i}");
            assert!(mid.abs() <= f64::from(x).abs() / 256.0);
            assert!(lo.abs() <= f64::from(x).abs() / 65536.0);
            assert_eq!(
                part(&parts, 0, i),
                bf16::from_f32(x),
                "hi rounds to nearest"
            );
        }
        for flagged in [f32::NAN, f32::INFINITY, -f32::INFINITY, 1e31, -1e31] {
            let mut x = x.clone();
            x[997] = flagged;
            assert!(split_pairs(amx, &x, 1e30).1, "{flagged}");
        }
    }

    /// Rows of `d` numbers, row `r` flagged (a number past 1e30) where
    /// `flagged` says.
    fn rows(rows: usize, d: usize, flagged: &[usize]) -> Vec<f32> {
        let mut x = numbers(rows * d);
        for &r in flagged.iter().filter(|&&r| r < rows) {
            x[r * d + (r * 7) % d] = if r % 2 == 0 { 1e31 } else { f32::NAN };
        }
        x
    }

    #[test]
    fn keys_split_into_the_tiles_layout() {
        let Some(amx) = Amx::new() else { return };
        for (len, d_k) in [(64, 32), (1, 64), (37, 128), (64, 96)] {
            let flagged = [3, 36];
            let keys = rows(len, d_k, &flagged);
            let mut tiles = [0; 3].map(|_| vec![u32::MAX; d_k / 2 * PAIR_KEYS]);
            let [hi, mid, lo] = &mut tiles;
            let beyond = amx.split_pack_keys(&keys, d_k, 1e30, [hi, mid, lo]);
            let want: u64 = flagged.iter().filter(|&&r| r < len).map(|r| 1 << r).sum();
            assert_eq!(beyond, want, "{len} × {d_k}");
            for j in 0..PAIR_KEYS {
                let row = (j < len).then(|| split_pairs(amx, &keys[j * d_k..][..d_k], 1e30).0);
                for a in 0..3 {
                    for p in 0..d_k / 2 {
                        let want = row.as_ref().map_or(0, |row| row[a][p]);
                        let got = tiles[a][p * PAIR_KEYS + j];
                        assert_eq!(got, want, "{len} × {d_k}: part {a}, key {j}, pair {p}");
                    }
                }
            }
        }
    }

    #[test]
    fn values_split_into_the_tiles_layout() {
        let Some(amx) = Amx::new() else { return };
        for (len, d_v, width) in [(64, 16, 16), (1, 64, 64), (37, 40, 48), (63, 130, 144)] {
            let flagged = [4, 36, 61];
            let values = rows(len, d_v, &flagged);
            let mut tiles = [0; 3].map(|_| vec![u32::MAX; PAIR_KEYS / 2 * width]);
            let [hi, mid, lo] = &mut tiles;
            let beyond = amx.split_pack_values(&values, d_v, width, 1e30, [hi, mid, lo]);
            let want: u64 = flagged.iter().filter(|&&r| r < len).map(|r| 1 << r).sum();
            assert_eq!(beyond, want, "{len} × {d_v}");
            let split: Vec<_> = (0..len)
                .map(|j| split_pairs(amx, &values[j * d_v..][..d_v], 1e30).0)
                .collect();
            let bits = |j: usize, a: usize, c: usize| {
                if j < len && c < d_v {
                    u32::from(part(&split[j], a, c).to_bits())
                } else {
                    0
                }
            };
            for i in 0..PAIR_KEYS / 2 {
                for (a, tile) in tiles.iter().enumerate() {
                    for c in 0..width {
                        let want = bits(2 * i, a, c) | bits(2 * i + 1, a, c) << 16;
                        let got = tile[i * width + c];
                        assert_eq!(
                            got, want,
                            "{len} × {d_v}: part {a}, pair row {i}, column {c}"
                        );
                    }
                }
            }
        }
    }
}
