//! The AVX-512F kernel set: 16 `f32` lanes in a `__m512`, 32 registers.
//!
//! Register tiles: Q·Kᵀ 6 rows × 4 vectors (64 keys) and P·V 6 rows × 4
//! vectors (64 value columns), 24 accumulators each, plus 4 loaded key or
//! value vectors and one broadcast: 29 of the 32 registers. On a Sapphire
//! Rapids Xeon the 6 × 4 Q·Kᵀ tile ran at 82% of the FMA peak in L1 where
//! 6 × 2 ran at 72% (half the loads per FMA), and the forward gained 3–5%.

use std::arch::x86_64::*;

use super::kernel::{Kernel, KernelOp};
use super::vector::Vector;

/// Query rows per register tile.
const ROWS: usize = 6;
/// Vectors of keys per Q·Kᵀ register tile.
const KEY_VECTORS: usize = 4;
/// Vectors of value columns per P·V register tile.
const VALUE_VECTORS: usize = 4;

/// The AVX-512F kernels; built only on a CPU that has AVX-512F.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512 {
    _cpu_has_avx512f: (),
}

impl Avx512 {
    /// The kernels, if this CPU has AVX-512F.
    pub(crate) fn new() -> Option<Self> {
        is_x86_feature_detected!("avx512f").then_some(Self {
            _cpu_has_avx512f: (),
        })
    }
}

// SAFETY: `Avx512` is built only by `new`, which checks AVX-512F, the one
// feature `run_unchecked` enables; it runs the operation with `__m512` and
// the tile sizes of the constants.
unsafe impl Kernel for Avx512 {
    type Vector = __m512;
    const SET: super::KernelSet = super::KernelSet::Avx512;
    const ROWS: usize = ROWS;
    const KEY_PANEL: usize = KEY_VECTORS * <__m512 as Vector>::LANES;

    #[inline(always)]
    unsafe fn run_unchecked<Op: KernelOp>(op: Op) -> Op::Output {
        #[target_feature(enable = "avx512f")]
        fn trampoline<Op: KernelOp>(op: Op) -> Op::Output {
            // SAFETY: this function is compiled for AVX-512F, `__m512`'s
            // instruction set, and runs only where the CPU has it.
            unsafe { op.run::<__m512, ROWS, KEY_VECTORS, VALUE_VECTORS>() }
        }
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { trampoline(op) }
    }
}

// SAFETY: each method is one AVX-512F instruction sequence on registers,
// and the pointer methods touch the 16 elements at the pointer only.
unsafe impl Vector for __m512 {
    const LANES: usize = 16;

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: AVX-512F, and 16 readable `f32`s at `ptr` (the caller's).
        unsafe { _mm512_loadu_ps(ptr) }
    }
    #[inline(always)]
    unsafe fn gather(ptr: *const f32, stride: isize) -> Self {
        // SAFETY: AVX-512F; the 16 lanes are readable and their offsets
        // `i·stride` fit in `i32` (the caller's).
        unsafe {
            let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(stride as i32));
            _mm512_i32gather_ps::<4>(offsets, ptr)
        }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_bf16(ptr: *const u16) -> Self {
        // SAFETY: AVX-512F, and 16 readable `u16`s at `ptr` (the caller's).
        unsafe {
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(ptr.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
        }
    }
    #[cfg(feature = "half")]
    #[inline(always)]
    unsafe fn load_f16(ptr: *const u16) -> Self {
        // SAFETY: AVX-512F, which has the 512-bit `vcvtph2ps`, and 16
        // readable `u16`s at `ptr` (the caller's).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(ptr.cast())) }
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: AVX-512F, and 16 writable `f32`s at `ptr` (the caller's).
        unsafe { _mm512_storeu_ps(ptr, self) }
    }
    #[inline(always)]
    unsafe fn add(self, other: Self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_add_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn sub(self, other: Self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_sub_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul(self, other: Self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_mul_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn div(self, other: Self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_div_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn max(self, other: Self) -> Self {
        // `vmaxps` is exactly `self > other ? self : other`.
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_max_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn min(self, other: Self) -> Self {
        // `vminps` is exactly `self < other ? self : other`.
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_min_ps(self, other) }
    }
    #[inline(always)]
    unsafe fn zero_where_less(self, threshold: Self, value: Self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NLT_UQ>(self, threshold), value) }
    }
    #[inline(always)]
    unsafe fn all_less(self, threshold: Self) -> bool {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self, threshold) == 0xffff }
    }
    #[inline(always)]
    unsafe fn exp2_int(self) -> Self {
        // SAFETY: AVX-512F (the caller's).
        unsafe {
            let n = _mm512_cvtps_epi32(self);
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                n,
                _mm512_set1_epi32(127),
            )))
        }
    }
    #[inline(always)]
    unsafe fn scale_by_exp2(self, n: Self) -> Self {
        // `vscalefps` is `self·2^floor(n)`, rounded once: the same bits as
        // `self·exp2_int(n)` wherever that is finite.
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_scalef_ps(self, n) }
    }
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_reduce_max_ps(self) }
    }
    #[inline(always)]
    unsafe fn reduce_sum(self) -> f32 {
        // SAFETY: AVX-512F (the caller's).
        unsafe { _mm512_reduce_add_ps(self) }
    }
    #[inline(always)]
    unsafe fn reduce_sums(rows: &[Self]) -> Self {
        // SAFETY: AVX-512F (the caller's); 16 rows (the caller's).
        unsafe { transposed_reduce(rows, |a, b| _mm512_add_ps(a, b)) }
    }
    #[inline(always)]
    unsafe fn reduce_maxes(rows: &[Self]) -> Self {
        // SAFETY: as in `reduce_sums`.
        unsafe { transposed_reduce(rows, |a, b| _mm512_max_ps(a, b)) }
    }
    const TRANSPOSES_IN_REGISTERS: bool = true;
    /// 64 shuffles in four rounds, as [`transposed_reduce`]'s, keeping
    /// both halves of each pairing where that folds them.
    #[inline(always)]
    unsafe fn transpose(rows: &mut [Self]) {
        assert_eq!(rows.len(), 16);
        // SAFETY: AVX-512F (the caller's).
        unsafe {
            // Round 1: per 128-bit lane k, [a(4k), b(4k), a(4k+1),
            // b(4k+1)] and [a(4k+2), b(4k+2), a(4k+3), b(4k+3)].
            let mut two = [_mm512_setzero_ps(); 16];
            for i in 0..8 {
                let (a, b) = (rows[2 * i], rows[2 * i + 1]);
                two[2 * i] = _mm512_unpacklo_ps(a, b);
                two[2 * i + 1] = _mm512_unpackhi_ps(a, b);
            }
            // Round 2: `four[4g + c]` holds column 4k + c of rows
            // 4g..4g + 4 in its 128-bit lane k.
            let mut four = [_mm512_setzero_ps(); 16];
            for g in 0..4 {
                let pair = |i: usize| _mm512_castps_pd(two[4 * g + i]);
                let (ab_low, ab_high, cd_low, cd_high) = (pair(0), pair(1), pair(2), pair(3));
                four[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(ab_low, cd_low));
                four[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(ab_low, cd_low));
                four[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(ab_high, cd_high));
                four[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(ab_high, cd_high));
            }
            // Rounds 3 and 4: column 4k + c is lane k of four[c],
            // four[4 + c], four[8 + c], four[12 + c], in that order.
            for c in 0..4 {
                let (w, x, y, z) = (four[c], four[4 + c], four[8 + c], four[12 + c]);
                let wx_low = _mm512_shuffle_f32x4::<0b01_00_01_00>(w, x);
                let yz_low = _mm512_shuffle_f32x4::<0b01_00_01_00>(y, z);
                let wx_high = _mm512_shuffle_f32x4::<0b11_10_11_10>(w, x);
                let yz_high = _mm512_shuffle_f32x4::<0b11_10_11_10>(y, z);
                rows[c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(wx_low, yz_low);
                rows[4 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(wx_low, yz_low);
                rows[8 + c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(wx_high, yz_high);
                rows[12 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(wx_high, yz_high);
            }
        }
    }
    #[inline(always)]
    unsafe fn prefetch(ptr: *const u8) {
        // SAFETY: SSE (part of x86-64); a prefetch never faults, whatever
        // the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.cast()) }
    }
}

/// Lane `r` of the result is `op` folded over the lanes of `rows[r]`, for
/// 16 rows: four rounds, each pairing vectors and halving their count
/// while doubling the rows a vector holds (45 operations in all, where a
/// reduction per row takes 8 or 9 each).
///
/// # Safety
/// AVX-512F; `rows.len() == 16`.
#[inline(always)]
unsafe fn transposed_reduce(rows: &[__m512], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    assert_eq!(rows.len(), 16);
    // SAFETY: AVX-512F (the caller's).
    unsafe {
        // Round 1: rows a, b → per 128-bit lane k, [a(4k)∘a(4k+2),
        // b(4k)∘b(4k+2), a(4k+1)∘a(4k+3), b(4k+1)∘b(4k+3)].
        let mut two = [_mm512_setzero_ps(); 8];
        for (i, two) in two.iter_mut().enumerate() {
            let (a, b) = (rows[2 * i], rows[2 * i + 1]);
            *two = op(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // Round 2: per 128-bit lane k, [a, b, c, d] each folded over the
        // four lanes of its lane k.
        let mut four = [_mm512_setzero_ps(); 4];
        for (i, four) in four.iter_mut().enumerate() {
            let (ab, cd) = (
                _mm512_castps_pd(two[2 * i]),
                _mm512_castps_pd(two[2 * i + 1]),
            );
            *four = op(
                _mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)),
            );
        }
        // Round 3: 128-bit lanes [x0∘x1, x2∘x3, y0∘y1, y2∘y3] of the
        // four-row groups x, y.
        let mut eight = [_mm512_setzero_ps(); 2];
        for (i, eight) in eight.iter_mut().enumerate() {
            let (x, y) = (four[2 * i], four[2 * i + 1]);
            *eight = op(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            );
        }
        // Round 4: rows 0–3, 4–7, 8–11, 12–15 in lanes 0–3.
        let (x, y) = (eight[0], eight[1]);
        op(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    }
}
