//! AVX-512 BF16 kernels for `bf16` inputs: `vdpbf16ps` reads pairs of
//! `bf16` and adds both products to an `f32` lane, 32 multiply-adds per
//! instruction, twice the `f32` FMA's 16.
//!
//! Operands are "pairs": a `u32` holding two `bf16` bit patterns, the first
//! in the low half (what `vdpbf16ps` multiplies lane by lane):
//!
//! - `S = Q·Kᵀ` ([`Bf16Dot::scores`]): a query row is `[d/2]` pairs along
//!   `d`, one broadcast per step; a key tile of [`PAIR_KEYS`] keys is
//!   `[d/2][PAIR_KEYS]` pairs (key fastest), so one vector holds 16 keys ×
//!   2 dims. The products are exact in `f32` and summed in `f32`; the
//!   scale multiplies the `f32` scores (scaling `q` first would round it
//!   to `bf16` a second time).
//! - `O ← α·O + P·V` ([`Bf16Dot::accumulate_values`]): the `f32` weights
//!   are split per tile into two `bf16` parts, `hi + mid`, within 2⁻¹⁵ of
//!   each weight (the one rounding this path adds), and broadcast as pairs
//!   along keys, two `vdpbf16ps` per pair of keys; a value tile is
//!   `[PAIR_KEYS/2][width]` pairs (two keys of one column), so one vector
//!   holds 16 columns × 2 keys. Weights rounded to `bf16` once (2⁻⁸ each)
//!   would run `P·V` twice as fast, but put a `bf16` output's error above
//!   its own rounding (`docs/PERFORMANCE.md`, Zen 4: the whole forward
//!   1.4× faster, its max error up to 1.13× the output's rounding and
//!   its norm error up to 1.34×; with two parts both at that floor).
//!
//! Both instructions treat `bf16` subnormal inputs as zero and flush
//! subnormal results (they ignore MXCSR), which moves a result by less
//! than `2⁻¹²⁶` per product.
//!
//! [`Bf16Dot`] can only be built by `new()`, which checks the CPU: holding
//! one proves its kernels may run, as with the `f32` kernel sets.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::time::Instant;

/// Keys per packed key tile (the driver's key tile): 4 vectors of 16.
pub(crate) const PAIR_KEYS: usize = 64;
/// Query rows per register tile of both kernels: 6 rows × 4 vectors is 24
/// accumulators, plus 4 loaded vectors and a broadcast, of 32 registers.
const ROWS: usize = 6;
/// `f32` lanes of a vector.
const LANES: usize = 16;
/// Vectors of keys per score tile.
const KEY_VECTORS: usize = PAIR_KEYS / LANES;
/// Vectors of value columns per register tile of `P·V`.
const VALUE_VECTORS: usize = 4;

/// The AVX-512 BF16 kernels; built only on a CPU with AVX-512F, AVX-512BW
/// and AVX-512 BF16.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bf16Dot {
    _cpu_has_avx512_bf16: (),
}

impl Bf16Dot {
    /// The kernels, if this CPU has AVX-512F, AVX-512BW and AVX-512 BF16.
    pub(crate) fn new() -> Option<Self> {
        (is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16"))
        .then_some(Self {
            _cpu_has_avx512_bf16: (),
        })
    }

    /// Whether this CPU's `vdpbf16ps` outruns its `f32` FMAs, so that
    /// reading `bf16` natively pays. Measured with `examples/peak`, one
    /// thread: AMD Zen 4 232 GFLOP/s against 115 for FMAs (2.0×); Intel
    /// Sapphire Rapids (family 6 model 167) 107 against 214 and Emerald
    /// Rapids (model 207) 80–85 against 168–175 (0.5×), where the native
    /// `bf16` forward ran 0.45–0.7× the path that converts to `f32`
    /// (`docs/PERFORMANCE.md`). So: every CPU but Intel's. Decided from
    /// the vendor (`cpuid`), not by timing at run time, so that which path
    /// a call takes, and so its bits, never depends on a measurement.
    pub(crate) fn outruns_fma() -> bool {
        !super::cpu::is_intel()
    }

    /// `s[r][j] = scale · Σ_p q_pairs[r][p] · k_pairs[p][j]` for the
    /// `q_pairs.len() / d_pairs` rows (any number) and the [`PAIR_KEYS`]
    /// keys of one packed key tile `k_pairs` (`[d_pairs][PAIR_KEYS]`); `s`
    /// has row stride `s_stride`.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    pub(crate) fn scores(
        self,
        q_pairs: &[u32],
        d_pairs: usize,
        k_pairs: &[u32],
        scale: f32,
        s: &mut [f32],
        s_stride: usize,
    ) {
        assert!(d_pairs > 0 && q_pairs.len().is_multiple_of(d_pairs));
        assert!(k_pairs.len() == d_pairs * PAIR_KEYS && s_stride >= PAIR_KEYS);
        let rows = q_pairs.len() / d_pairs;
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + PAIR_KEYS);
        // SAFETY: `self` exists, so the CPU has the features `scores_tile`
        // is compiled for; the sizes it reads and writes are checked above.
        unsafe { scores_tile(q_pairs, d_pairs, k_pairs, scale, s, s_stride) }
    }

    /// `o[r] ← alpha[r]·o[r] + Σ_j (hi + mid)(p[r][j])·v[j]`, the weights
    /// in two `bf16` parts (within 2⁻¹⁵ of each), for the
    /// `alpha.len()` rows of `p` (row stride `p_stride`, [`PAIR_KEYS`]
    /// weights a row), the packed value tile `v_pairs`
    /// (`[PAIR_KEYS/2][width]`) and row-major `o` (`[rows][width]`, `width`
    /// a multiple of 16). With `skip_zero_weights`, a weight whose `hi` is
    /// zero contributes exactly nothing (for value tiles that may hold NaN
    /// or `±inf`: never `0·NaN`).
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn accumulate_values(
        self,
        p: &[f32],
        p_stride: usize,
        v_pairs: &[u32],
        width: usize,
        alpha: &[f32],
        o: &mut [f32],
        skip_zero_weights: bool,
    ) {
        let rows = alpha.len();
        assert!(width > 0 && width.is_multiple_of(LANES));
        assert!(v_pairs.len() == PAIR_KEYS / 2 * width && o.len() == rows * width);
        assert!(
            p_stride >= PAIR_KEYS && (rows == 0 || p.len() >= (rows - 1) * p_stride + PAIR_KEYS)
        );
        // SAFETY: `self` exists, so the CPU has the features `values_tile`
        // is compiled for; the sizes it reads and writes are checked above.
        unsafe { values_tile(p, p_stride, v_pairs, width, alpha, o, skip_zero_weights) }
    }
}

/// [`Bf16Dot::scores`], whose checks it relies on.
///
/// # Safety
/// The CPU has the features; the sizes are as `Bf16Dot::scores` checks.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn scores_tile(
    q_pairs: &[u32],
    d_pairs: usize,
    k_pairs: &[u32],
    scale: f32,
    s: &mut [f32],
    s_stride: usize,
) {
    let rows = q_pairs.len() / d_pairs;
    let (q, k, s) = (q_pairs.as_ptr(), k_pairs.as_ptr(), s.as_mut_ptr());
    let mut r0 = 0;
    // SAFETY (each block): rows r0..r0 + R are inside `rows`, and the
    // caller's sizes cover every offset a block touches.
    unsafe {
        while r0 + ROWS <= rows {
            scores_block::<ROWS>(
                q.add(r0 * d_pairs),
                d_pairs,
                k,
                scale,
                s.add(r0 * s_stride),
                s_stride,
            );
            r0 += ROWS;
        }
        let (q, s) = (q.add(r0 * d_pairs), s.add(r0 * s_stride));
        match rows - r0 {
            0 => {}
            1 => scores_block::<1>(q, d_pairs, k, scale, s, s_stride),
            2 => scores_block::<2>(q, d_pairs, k, scale, s, s_stride),
            3 => scores_block::<3>(q, d_pairs, k, scale, s, s_stride),
            4 => scores_block::<4>(q, d_pairs, k, scale, s, s_stride),
            _ => scores_block::<5>(q, d_pairs, k, scale, s, s_stride),
        }
    }
}

/// `R` rows of [`scores_tile`]: `R × 4` accumulators over the tile's keys.
///
/// # Safety
/// The CPU has the features; `q` holds `R·d_pairs` pairs, `k` one packed
/// key tile, and `s` `R` rows of `PAIR_KEYS` at stride `s_stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn scores_block<const R: usize>(
    q: *const u32,
    d_pairs: usize,
    k: *const u32,
    scale: f32,
    s: *mut f32,
    s_stride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); KEY_VECTORS]; R];
    for p in 0..d_pairs {
        // SAFETY: pair p of the key tile is PAIR_KEYS u32s at p·PAIR_KEYS.
        let keys: [__m512bh; KEY_VECTORS] = std::array::from_fn(|c| unsafe {
            pairs(_mm512_loadu_si512(k.add(p * PAIR_KEYS + c * LANES).cast()))
        });
        for (r, acc_row) in acc.iter_mut().enumerate() {
            // SAFETY: row r's pair p is inside the R·d_pairs of `q`.
            let query = pairs(_mm512_set1_epi32(unsafe { *q.add(r * d_pairs + p) } as i32));
            for (a, &key) in acc_row.iter_mut().zip(&keys) {
                *a = _mm512_dpbf16_ps(*a, query, key);
            }
        }
    }
    let scale = _mm512_set1_ps(scale);
    for (r, acc_row) in acc.iter().enumerate() {
        for (c, &a) in acc_row.iter().enumerate() {
            // SAFETY: row r's 64 scores are inside `s`.
            unsafe { _mm512_storeu_ps(s.add(r * s_stride + c * LANES), _mm512_mul_ps(a, scale)) };
        }
    }
}

/// [`Bf16Dot::accumulate_values`], whose checks it relies on.
///
/// # Safety
/// The CPU has the features; the sizes are as
/// `Bf16Dot::accumulate_values` checks.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn values_tile(
    p: &[f32],
    p_stride: usize,
    v_pairs: &[u32],
    width: usize,
    alpha: &[f32],
    o: &mut [f32],
    skip: bool,
) {
    let rows = alpha.len();
    let (p, v, alpha, o) = (p.as_ptr(), v_pairs.as_ptr(), alpha.as_ptr(), o.as_mut_ptr());
    let block = |r0: usize, n: usize| {
        // SAFETY: rows r0..r0 + n are inside `rows`, and the caller's
        // sizes cover every offset the block touches.
        unsafe {
            let (p, alpha, o) = (p.add(r0 * p_stride), alpha.add(r0), o.add(r0 * width));
            match (n, skip) {
                (6, false) => values_rows::<6, false>(p, p_stride, v, width, alpha, o),
                (6, true) => values_rows::<6, true>(p, p_stride, v, width, alpha, o),
                (5, false) => values_rows::<5, false>(p, p_stride, v, width, alpha, o),
                (5, true) => values_rows::<5, true>(p, p_stride, v, width, alpha, o),
                (4, false) => values_rows::<4, false>(p, p_stride, v, width, alpha, o),
                (4, true) => values_rows::<4, true>(p, p_stride, v, width, alpha, o),
                (3, false) => values_rows::<3, false>(p, p_stride, v, width, alpha, o),
                (3, true) => values_rows::<3, true>(p, p_stride, v, width, alpha, o),
                (2, false) => values_rows::<2, false>(p, p_stride, v, width, alpha, o),
                (2, true) => values_rows::<2, true>(p, p_stride, v, width, alpha, o),
                (_, false) => values_rows::<1, false>(p, p_stride, v, width, alpha, o),
                (_, true) => values_rows::<1, true>(p, p_stride, v, width, alpha, o),
            }
        }
    };
    let mut r0 = 0;
    while r0 < rows {
        let n = ROWS.min(rows - r0);
        block(r0, n);
        r0 += n;
    }
}

/// `R` rows of [`values_tile`]: their weights split into two `bf16` parts
/// once, then the value columns in blocks of up to 4 vectors.
///
/// # Safety
/// The CPU has the features; `p` holds `R` rows of `PAIR_KEYS` weights at
/// stride `p_stride`, `v` one packed value tile of `width`, `alpha` `R`
/// factors and `o` `R` rows of `width`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn values_rows<const R: usize, const SKIP: bool>(
    p: *const f32,
    p_stride: usize,
    v: *const u32,
    width: usize,
    alpha: *const f32,
    o: *mut f32,
) {
    // Each weight `w` in two `bf16` parts: `hi`, `w` with its low 16 bits
    // cleared, and `mid`, the rest `w − hi` (exact in f32, below 2⁻⁷|w|)
    // rounded to nearest, so `|w − hi − mid| ≤ 2⁻¹⁵|w|`. Truncating for
    // `hi` rather than rounding saves widening it back to take the rest
    // (the conversion of `hi` is exact): 2% of the forward on Zen 4.
    //
    // Part `a` of row r's weights, key j at element j: pair jp is keys 2jp
    // and 2jp + 1; `_mm512_cvtne2ps_pbh(a, b)` puts `b`'s 16 in the low
    // half. Not zeroed first: zeroing 1.5 KiB (`R` = 6) is a `memset` call
    // every 6 rows, 1–2% of the forward on Zen 4.
    let mut weights = MaybeUninit::<[[[u32; PAIR_KEYS / 2]; R]; 2]>::uninit();
    let first = weights.as_mut_ptr().cast::<u32>();
    let top = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    for r in 0..R {
        for h in 0..PAIR_KEYS / (2 * LANES) {
            // SAFETY: row r's PAIR_KEYS weights are inside `p`; 32 weights
            // are 16 pairs, a vector of each part, at pair 16h of row r of
            // the part: the loops write every element of `weights`.
            unsafe {
                let at = |a: usize| first.add((a * R + r) * PAIR_KEYS / 2 + h * LANES);
                let low = _mm512_loadu_ps(p.add(r * p_stride + 2 * h * LANES));
                let high = _mm512_loadu_ps(p.add(r * p_stride + (2 * h + 1) * LANES));
                let cut =
                    |x: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), top));
                let (low_hi, high_hi) = (cut(low), cut(high));
                let hi: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(high_hi, low_hi));
                let mid: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(
                    _mm512_sub_ps(high, high_hi),
                    _mm512_sub_ps(low, low_hi),
                ));
                _mm512_storeu_si512(at(0).cast(), hi);
                _mm512_storeu_si512(at(1).cast(), mid);
            }
        }
    }
    // SAFETY: every element is written above.
    let weights = unsafe { weights.assume_init() };
    let vectors = width / LANES;
    let mut c0 = 0;
    // SAFETY (each block): vectors c0.. of the columns are inside `width`.
    unsafe {
        while c0 + VALUE_VECTORS <= vectors {
            values_block::<R, VALUE_VECTORS, SKIP>(&weights, v, width, c0, alpha, o);
            c0 += VALUE_VECTORS;
        }
        match vectors - c0 {
            0 => {}
            1 => values_block::<R, 1, SKIP>(&weights, v, width, c0, alpha, o),
            2 => values_block::<R, 2, SKIP>(&weights, v, width, c0, alpha, o),
            _ => values_block::<R, 3, SKIP>(&weights, v, width, c0, alpha, o),
        }
    }
}

/// `R` rows × `C` vectors of columns from vector `c0` of [`values_rows`].
///
/// # Safety
/// As `values_rows`, and vectors `c0..c0 + C` are inside `width`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn values_block<const R: usize, const C: usize, const SKIP: bool>(
    weights: &[[[u32; PAIR_KEYS / 2]; R]; 2],
    v: *const u32,
    width: usize,
    c0: usize,
    alpha: *const f32,
    o: *mut f32,
) {
    let column = |c: usize| (c0 + c) * LANES;
    // SAFETY: alpha holds R factors and o R rows of width.
    let mut acc: [[__m512; C]; R] = std::array::from_fn(|r| {
        let a = _mm512_set1_ps(unsafe { *alpha.add(r) });
        std::array::from_fn(|c| {
            _mm512_mul_ps(a, unsafe { _mm512_loadu_ps(o.add(r * width + column(c))) })
        })
    });
    let zero = _mm512_setzero_si512();
    let [hi_parts, mid_parts] = weights;
    // `jp` indexes the value tile's pointer as well as `weights`.
    #[allow(clippy::needless_range_loop)]
    for jp in 0..PAIR_KEYS / 2 {
        // SAFETY: key pair jp of the value tile is `width` u32s at jp·width.
        let values: [__m512i; C] = std::array::from_fn(|c| unsafe {
            _mm512_loadu_si512(v.add(jp * width + column(c)).cast())
        });
        for (r, acc_row) in acc.iter_mut().enumerate() {
            let (hi, mid) = (
                _mm512_set1_epi32(hi_parts[r][jp] as i32),
                _mm512_set1_epi32(mid_parts[r][jp] as i32),
            );
            // A zero weight (its `hi` bits are 0: weights are never −0,
            // and then `mid` is 0 too) selects a zero value, so 0·NaN
            // never happens.
            let nonzero = if SKIP {
                _mm512_cmpneq_epi16_mask(hi, zero)
            } else {
                u32::MAX
            };
            let (hi, mid) = (pairs(hi), pairs(mid));
            for (a, &value) in acc_row.iter_mut().zip(&values) {
                let value = pairs(if SKIP {
                    _mm512_maskz_mov_epi16(nonzero, value)
                } else {
                    value
                });
                *a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(*a, hi, value), mid, value);
            }
        }
    }
    for (r, acc_row) in acc.iter().enumerate() {
        for (c, &a) in acc_row.iter().enumerate() {
            // SAFETY: row r's columns are inside `o`.
            unsafe { _mm512_storeu_ps(o.add(r * width + column(c)), a) };
        }
    }
}

/// A vector of 32-bit lanes as 32 `bf16` (the same bits).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
fn pairs(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain bits, every pattern valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

/// Independent chains of `vdpbf16ps` for the peak probe.
const CHAINS: usize = 12;

/// `CHAINS` chains of `rounds` dependent `vdpbf16ps`, their lanes summed.
///
/// # Safety
/// The CPU has the features.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_chains(rounds: usize, one: f32) -> f32 {
    // Products of (2⁻⁸·one, 2⁻⁸·one) pairs: each step adds 2·2⁻¹⁶, so the
    // chains stay finite and the loop cannot be folded (`one` is hidden).
    let small = _mm512_cvtne2ps_pbh(_mm512_set1_ps(one / 256.0), _mm512_set1_ps(one / 256.0));
    let mut acc = [_mm512_set1_ps(one); CHAINS];
    for _ in 0..rounds {
        for a in &mut acc {
            *a = _mm512_dpbf16_ps(*a, small, small);
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

/// This core's `vdpbf16ps` peak in GFLOP/s (an instruction is 32
/// multiply-adds, 64 FLOPs), the best of several runs of about 20 ms on
/// the calling thread; `None` without AVX-512 BF16.
pub(crate) fn dot_peak() -> Option<f64> {
    let dot = Bf16Dot::new()?;
    let run = |rounds: usize| {
        let start = Instant::now();
        // SAFETY: `dot` exists, so the CPU has the features.
        let _ = dot;
        std::hint::black_box(unsafe { dot_chains(rounds, std::hint::black_box(1.0)) });
        start.elapsed().as_secs_f64()
    };
    let mut rounds = 1 << 12;
    while run(rounds) < 0.02 && rounds < 1 << 30 {
        rounds *= 2;
    }
    let best = (0..5).map(|_| run(rounds)).fold(f64::INFINITY, f64::min);
    Some((rounds * CHAINS) as f64 * 64.0 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x` rounded to bf16 bits, to nearest even (inputs here are finite).
    fn bits(x: f32) -> u16 {
        let b = x.to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
    fn value(bits: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(bits) << 16))
    }
    fn pair(a: u16, b: u16) -> u32 {
        u32::from(a) | (u32::from(b) << 16)
    }
    /// A deterministic spread of values in about (−2, 2).
    fn noise(i: usize) -> f32 {
        let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        (x as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    }

    #[test]
    fn scores_match_f64_products_of_the_same_bf16_inputs() {
        let Some(dot) = Bf16Dot::new() else {
            return;
        };
        for (rows, d) in [(1, 2usize), (5, 6), (6, 64), (13, 34), (7, 1)] {
            let d_pairs = d.div_ceil(2);
            let q: Vec<u16> = (0..rows * d).map(|i| bits(noise(i))).collect();
            let k: Vec<u16> = (0..PAIR_KEYS * d).map(|i| bits(noise(i + 7777))).collect();
            let at = |x: &[u16], row: usize, c: usize| if c < d { x[row * d + c] } else { 0 };
            let q_pairs: Vec<u32> = (0..rows * d_pairs)
                .map(|i| {
                    pair(
                        at(&q, i / d_pairs, 2 * (i % d_pairs)),
                        at(&q, i / d_pairs, 2 * (i % d_pairs) + 1),
                    )
                })
                .collect();
            let k_pairs: Vec<u32> = (0..d_pairs * PAIR_KEYS)
                .map(|i| {
                    pair(
                        at(&k, i % PAIR_KEYS, 2 * (i / PAIR_KEYS)),
                        at(&k, i % PAIR_KEYS, 2 * (i / PAIR_KEYS) + 1),
                    )
                })
                .collect();
            let stride = PAIR_KEYS + 3;
            let mut s = vec![f32::NAN; rows * stride];
            dot.scores(&q_pairs, d_pairs, &k_pairs, 0.5, &mut s, stride);
            for r in 0..rows {
                for j in 0..PAIR_KEYS {
                    let (exact, magnitude) = (0..d).fold((0.0, 0.0), |(e, m), c| {
                        let x = value(q[r * d + c]) * value(k[j * d + c]);
                        (e + x, m + x.abs())
                    });
                    let got = f64::from(s[r * stride + j]);
                    // Each product is exact in f32; d sums and the scale
                    // round, each by at most 2⁻²⁴ of the running magnitude.
                    let bound = 0.5 * magnitude * (d as f64 + 1.0) * 2f64.powi(-24) + 1e-30;
                    assert!(
                        (got - 0.5 * exact).abs() <= bound,
                        "{rows}×{d} [{r}][{j}]: {got} vs {}",
                        0.5 * exact
                    );
                }
            }
        }
    }

    #[test]
    fn values_match_f64_with_weights_in_two_bf16_parts() {
        let Some(dot) = Bf16Dot::new() else {
            return;
        };
        for (rows, width) in [(1, 16), (6, 64), (11, 80), (4, 48)] {
            let p: Vec<f32> = (0..rows * PAIR_KEYS)
                .map(|i| noise(i).abs() / 2.0)
                .collect();
            let v: Vec<u16> = (0..PAIR_KEYS * width)
                .map(|i| bits(noise(i + 99)))
                .collect();
            let v_pairs: Vec<u32> = (0..PAIR_KEYS / 2 * width)
                .map(|i| {
                    let (jp, c) = (i / width, i % width);
                    pair(v[2 * jp * width + c], v[(2 * jp + 1) * width + c])
                })
                .collect();
            let alpha: Vec<f32> = (0..rows).map(|r| 0.25 * r as f32).collect();
            let o0: Vec<f32> = (0..rows * width).map(|i| noise(i + 5)).collect();
            let mut o = o0.clone();
            dot.accumulate_values(&p, PAIR_KEYS, &v_pairs, width, &alpha, &mut o, false);
            let mut skipped = o0.clone();
            dot.accumulate_values(&p, PAIR_KEYS, &v_pairs, width, &alpha, &mut skipped, true);
            assert_eq!(o, skipped, "finite values: skipping gives the same bits");
            for r in 0..rows {
                for c in 0..width {
                    let (mut exact, mut split, mut magnitude) =
                        (f64::from(alpha[r] * o0[r * width + c]), 0.0, 0.0);
                    split += exact;
                    magnitude += exact.abs();
                    for j in 0..PAIR_KEYS {
                        let w = p[r * PAIR_KEYS + j];
                        let x = value(v[j * width + c]);
                        let hi = f32::from_bits(w.to_bits() & 0xffff_0000);
                        let mid = value(bits(w - hi));
                        let hi = f64::from(hi);
                        exact += f64::from(w) * x;
                        split += (hi + mid) * x;
                        magnitude += (f64::from(w) * x).abs();
                    }
                    let got = f64::from(o[r * width + c]);
                    // The f32 sums: 2⁻²⁴ of the magnitude per step, two
                    // steps a key (weights rounded once would be about
                    // 2⁻⁹ of the magnitude away).
                    let sums = magnitude * (2.0 * PAIR_KEYS as f64 + 2.0) * 2f64.powi(-24);
                    assert!((got - split).abs() <= sums, "[{r}][{c}]: {got} vs {split}");
                    // And what the two parts leave out: 2⁻¹⁵ of each product.
                    assert!((got - exact).abs() <= sums + magnitude * 2f64.powi(-15));
                }
            }
        }
    }

    #[test]
    fn a_zero_weight_skips_a_nan_value() {
        let Some(dot) = Bf16Dot::new() else {
            return;
        };
        let width = 16;
        let mut p = vec![0.5f32; PAIR_KEYS];
        p[3] = 0.0;
        let mut v_pairs = vec![pair(bits(1.0), bits(1.0)); PAIR_KEYS / 2 * width];
        // Key 3 is the high half of pair 1; NaN there, in every column.
        for c in 0..width {
            v_pairs[width + c] = pair(bits(1.0), 0x7fc0);
        }
        let mut o = vec![0.0; width];
        dot.accumulate_values(&p, PAIR_KEYS, &v_pairs, width, &[1.0], &mut o, true);
        assert!(o.iter().all(|&x| x == 31.5), "{o:?}");
        let mut o = vec![0.0; width];
        dot.accumulate_values(&p, PAIR_KEYS, &v_pairs, width, &[1.0], &mut o, false);
        assert!(o.iter().all(|x| x.is_nan()), "multiplying gives 0·NaN");
    }

    #[test]
    fn the_peak_is_positive_where_the_cpu_has_bf16() {
        if Bf16Dot::new().is_some() {
            assert!(dot_peak().unwrap() > 0.0);
        } else {
            assert!(dot_peak().is_none());
        }
    }
}
