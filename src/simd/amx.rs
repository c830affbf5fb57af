//! AMX-BF16 tile kernels for `bf16` calls: the same two products as
//! [`Bf16Dot`] (`S = Q·Kᵀ` and `O ← α·O + P·V`), on the same packed pairs,
//! with `tdpbf16ps`, which multiplies a 16 × 32 `bf16` tile by a 32 × 16
//! one into a 16 × 16 `f32` tile: 8192 multiply-adds an instruction, on
//! Sapphire Rapids about 16 times the `f32` FMA rate of a core.
//!
//! The packed layouts of `fused/pairs.rs` are already the tiles' own: a
//! row of query pairs, or of `bf16` weights, is a row of an `A` tile (32
//! `bf16` along the sum); a packed key tile `[d_pairs][64 keys]` and a
//! packed value tile `[32 key pairs][width]` are rows of `B` tiles (16
//! pairs of the sum, 16 outputs each), read with a stride. So the kernels
//! only load, multiply and store tiles; the scale and `α` stay `f32`
//! vector passes, as the weights' rounding to `bf16` (`vcvtne2ps2bf16`)
//! does.
//!
//! Every tile is 16 rows × 64 bytes, so the kernels need rows in whole
//! tiles (the driver pads them) and `d_k` in whole tiles of the sum
//! (multiples of 32: [`Amx::takes`]); the value width is padded to 16
//! columns by the driver. A value tile that may hold NaN or an infinity
//! goes to [`Bf16Dot`], whose kernel skips zero weights: a tile computes
//! `0·NaN` like any product.
//!
//! `tdpbf16ps` rounds and flushes as `vdpbf16ps` does (subnormal inputs
//! read as zero, results flushed, round to nearest even; MXCSR ignored),
//! but sums in its own order, so its bits differ from [`Bf16Dot`]'s.
//! Which of the two runs depends on the CPU and the call's shape, never on
//! the thread count.
//!
//! Stable Rust has no AMX intrinsics, so the tile instructions are inline
//! `asm!`, one instruction a block, tile registers named in the template
//! (the compiler never allocates them, so nothing else touches them).
//! Linux hands a process the tile state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`Amx::new`] asks once. A thread's
//! tile configuration is set on a kernel's entry when it is not already
//! ours (`sttilecfg` costs ~5 ns, `ldtilecfg` ~50 ns on Sapphire Rapids,
//! so the check pays) and released by [`Amx::release`] when the driver
//! is done with a query tile.

use std::arch::asm;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;
use std::time::Instant;

use super::bf16::{Bf16Dot, PAIR_KEYS};
use super::split::{SPLIT_PRODUCTS, split16};

/// Rows of every tile.
const TILE_ROWS: usize = 16;
/// Pairs (`u32`, 64 bytes) in a row of every tile: the sum's depth of one
/// `tdpbf16ps` is twice this.
const TILE_PAIRS: usize = 16;
/// `f32` lanes of a vector, and `f32` columns of an output tile.
const LANES: usize = 16;
/// Bytes of a `u32` pair or an `f32`.
const BYTES: usize = 4;

/// A tile configuration (`ldtilecfg`'s 64-byte operand): palette 1, all
/// eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

/// The one configuration every kernel here runs with.
static CONFIG: TileConfig = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1; // palette 1
    let mut t = 0;
    while t < 8 {
        // Bytes 16..32: each tile's row width in bytes (u16, little end);
        // bytes 48..56: each tile's rows.
        bytes[16 + 2 * t] = (TILE_PAIRS * BYTES) as u8;
        bytes[48 + t] = TILE_ROWS as u8;
        t += 1;
    }
    TileConfig(bytes)
};

/// The AMX-BF16 kernels; built only where the CPU has AMX-TILE and
/// AMX-BF16 with a palette of eight 16 × 64-byte tiles, and the OS has
/// granted this process the tile state. Also holds the [`Bf16Dot`]
/// kernels (every AMX CPU has AVX-512 BF16), for value tiles with NaN.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Amx {
    dot: Bf16Dot,
}

impl Amx {
    /// The kernels, if this CPU and OS let this process use AMX tiles.
    /// The first call asks the OS for the tile state (once a process).
    pub(crate) fn new() -> Option<Self> {
        static GRANTED: OnceLock<bool> = OnceLock::new();
        let dot = Bf16Dot::new()?;
        // The split (`split.rs`) and the weights' stores use 256-bit
        // AVX-512 forms: every AMX CPU has VL, but a VM may hide it.
        if !std::arch::is_x86_feature_detected!("avx512vl") {
            return None;
        }
        GRANTED.get_or_init(request_tiles).then_some(Self { dot })
    }

    /// The AVX-512 BF16 kernels (and packing) every AMX CPU has.
    pub(crate) fn dot(self) -> Bf16Dot {
        self.dot
    }

    /// Whether the kernels take a head dim `d_k`: whole tiles of the sum.
    pub(crate) fn takes(d_k: usize) -> bool {
        d_k > 0 && d_k.is_multiple_of(2 * TILE_PAIRS)
    }

    /// Rows the kernels compute for `rows` real ones: whole tiles.
    pub(crate) fn computed_rows(rows: usize) -> usize {
        rows.div_ceil(TILE_ROWS) * TILE_ROWS
    }

    /// [`Bf16Dot::scores`] on tiles: `s[r][j] = scale · Σ_p q_pairs[r][p] ·
    /// k_pairs[p][j]`, for rows in whole tiles and `d_pairs` a multiple of
    /// 16.
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
        assert!(d_pairs > 0 && d_pairs.is_multiple_of(TILE_PAIRS));
        assert!(q_pairs.len().is_multiple_of(d_pairs * TILE_ROWS));
        assert!(k_pairs.len() == d_pairs * PAIR_KEYS && s_stride >= PAIR_KEYS);
        let rows = q_pairs.len() / d_pairs;
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + PAIR_KEYS);
        // SAFETY: `self` exists, so the CPU has the tile and AVX-512
        // features and the OS granted the tile state; the sizes every
        // tile load and store covers are checked above.
        unsafe {
            configure();
            let (q, k) = ([q_pairs.as_ptr()], [k_pairs.as_ptr()]);
            scores_tiles(&q, rows, d_pairs, &k, &[(0, 0)], scale, s, s_stride);
        }
    }

    /// [`scores`](Self::scores) of `f32` queries and keys split into three
    /// `bf16` parts each (`split.rs`): `s[r][j] = scale · Σ` of the
    /// [`SPLIT_PRODUCTS`] `q_parts[a][r]·k_parts[b][j]`, each part laid out
    /// as `scores` takes its one.
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    pub(crate) fn split_scores(
        self,
        q_parts: [&[u32]; 3],
        d_pairs: usize,
        k_parts: [&[u32]; 3],
        scale: f32,
        s: &mut [f32],
        s_stride: usize,
    ) {
        assert!(d_pairs > 0 && d_pairs.is_multiple_of(TILE_PAIRS));
        let rows = q_parts[0].len() / d_pairs;
        assert!(rows.is_multiple_of(TILE_ROWS));
        assert!(q_parts.iter().all(|q| q.len() == rows * d_pairs));
        assert!(k_parts.iter().all(|k| k.len() == d_pairs * PAIR_KEYS));
        assert!(s_stride >= PAIR_KEYS);
        assert!(rows == 0 || s.len() >= (rows - 1) * s_stride + PAIR_KEYS);
        // SAFETY: as in `scores`, for the sizes checked above.
        unsafe {
            configure();
            let (q, k) = (q_parts.map(<[u32]>::as_ptr), k_parts.map(<[u32]>::as_ptr));
            scores_tiles(&q, rows, d_pairs, &k, &SPLIT_PRODUCTS, scale, s, s_stride);
        }
    }

    /// [`Bf16Dot::accumulate_values`] on tiles: `o[r] ← alpha[r]·o[r] +
    /// Σ_j bf16(p[r][j])·v[j]`, rows in whole tiles. With
    /// `skip_zero_weights` (a value tile that may hold NaN or `±inf`), the
    /// [`Bf16Dot`] kernel runs instead, which never computes `0·NaN`.
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
        if skip_zero_weights {
            let dot = self.dot;
            dot.accumulate_values(p, p_stride, v_pairs, width, alpha, o, true);
            return;
        }
        let rows = alpha.len();
        assert!(rows.is_multiple_of(TILE_ROWS));
        assert!(width > 0 && width.is_multiple_of(LANES));
        assert!(v_pairs.len() == PAIR_KEYS / 2 * width && o.len() == rows * width);
        assert!(
            p_stride >= PAIR_KEYS && (rows == 0 || p.len() >= (rows - 1) * p_stride + PAIR_KEYS)
        );
        // SAFETY: as in `scores`, for the sizes checked above.
        unsafe {
            configure();
            values_tiles::<1>(p, p_stride, [v_pairs.as_ptr()], width, alpha, o);
        }
    }

    /// [`accumulate_values`](Self::accumulate_values) of `f32` weights and
    /// values split into three `bf16` parts each (`split.rs`): `o[r] ←
    /// alpha[r]·o[r] + Σ_j p[r][j]·v[j]` from the [`SPLIT_PRODUCTS`], the
    /// weights split here, the values' parts packed as `accumulate_values`
    /// takes its one. Never skips zero weights: the caller keeps value
    /// rows with NaN or an infinity out of the parts (zero there).
    ///
    /// # Panics
    /// When a size does not fit (a bug in the driver, never bad user input).
    pub(crate) fn split_accumulate_values(
        self,
        p: &[f32],
        p_stride: usize,
        v_parts: [&[u32]; 3],
        width: usize,
        alpha: &[f32],
        o: &mut [f32],
    ) {
        let rows = alpha.len();
        assert!(rows.is_multiple_of(TILE_ROWS));
        assert!(width > 0 && width.is_multiple_of(LANES));
        assert!(v_parts.iter().all(|v| v.len() == PAIR_KEYS / 2 * width));
        assert!(o.len() == rows * width);
        assert!(
            p_stride >= PAIR_KEYS && (rows == 0 || p.len() >= (rows - 1) * p_stride + PAIR_KEYS)
        );
        // SAFETY: as in `scores`, for the sizes checked above.
        unsafe {
            configure();
            values_tiles::<3>(p, p_stride, v_parts.map(<[u32]>::as_ptr), width, alpha, o);
        }
    }

    /// Returns this thread's tiles to their initial state, so the OS need
    /// not save them on a context switch and the core may sleep deeper.
    pub(crate) fn release(self) {
        // SAFETY: `self` exists, so the CPU has AMX-TILE and the OS granted
        // the state; `tilerelease` touches only the tile registers.
        unsafe { asm!("tilerelease", options(nomem, nostack, preserves_flags)) }
    }
}

/// Whether the CPU has AMX-TILE and AMX-BF16 with the palette the kernels
/// configure, the OS enables the tile state, and it granted it to this
/// process.
fn request_tiles() -> bool {
    if cfg!(miri) || !cfg!(target_os = "linux") {
        return false;
    }
    // Leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    if __cpuid(0).eax < 0x1d || __cpuid_count(7, 0).edx & (1 << 22 | 1 << 24) != 1 << 22 | 1 << 24 {
        return false;
    }
    // Leaf 0x1d, palette 1: EBX bits 0..16 the bytes of a row, 16..32
    // the tiles; ECX bits 0..16 the rows.
    let palette = __cpuid_count(0x1d, 1);
    let (row_bytes, tiles, rows) = (
        palette.ebx & 0xffff,
        palette.ebx >> 16,
        palette.ecx & 0xffff,
    );
    if (row_bytes as usize) < TILE_PAIRS * BYTES || tiles < 8 || (rows as usize) < TILE_ROWS {
        return false;
    }
    // Leaf 1 ECX bit 27: the OS uses XSAVE (so `xgetbv` runs); XCR0 bits
    // 17 and 18: it enables the tile configuration and data.
    if __cpuid(1).ecx & (1 << 27) == 0 {
        return false;
    }
    let xcr0_low: u32;
    // SAFETY: OSXSAVE is set, so `xgetbv` with ECX = 0 reads XCR0.
    unsafe {
        asm!("xgetbv", in("ecx") 0, out("eax") xcr0_low, out("edx") _,
            options(nomem, nostack, preserves_flags));
    }
    if xcr0_low & (1 << 17 | 1 << 18) != 1 << 17 | 1 << 18 {
        return false;
    }
    request_tile_data()
}

/// Asks Linux for this process's permission to use the tile data (XSAVE
/// feature 18); `false` on a kernel that refuses or predates the request.
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl` with this code only changes which XSAVE states
    // the process may use; it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// Loads [`CONFIG`] unless it is this thread's configuration already.
///
/// # Safety
/// The CPU has AMX-TILE and the OS granted the tile state.
#[inline]
unsafe fn configure() {
    let mut current = TileConfig([0; 64]);
    // SAFETY: the caller's promise; each writes or reads 64 bytes.
    unsafe {
        asm!("sttilecfg [{}]", in(reg) current.0.as_mut_ptr(), options(nostack, preserves_flags));
        if current.0 != CONFIG.0 {
            asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly, preserves_flags));
        }
    }
}

/// Loads tile `T` from 16 rows of 64 bytes at `base`, `stride` bytes
/// apart.
///
/// # Safety
/// The tiles are configured, and the 16 rows are readable.
#[inline(always)]
unsafe fn load<const T: u8, E>(base: *const E, stride: usize) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!("tileloadd tmm{t}, [{base} + {stride}*1]", t = const T,
            base = in(reg) base, stride = in(reg) stride,
            options(nostack, readonly, preserves_flags));
    }
}

/// Stores tile `T` to 16 rows of 64 bytes at `base`, `stride` bytes apart.
///
/// # Safety
/// The tiles are configured, and the 16 rows are writable.
#[inline(always)]
unsafe fn store<const T: u8>(base: *mut f32, stride: usize) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!("tilestored [{base} + {stride}*1], tmm{t}", t = const T,
            base = in(reg) base, stride = in(reg) stride,
            options(nostack, preserves_flags));
    }
}

/// Zeroes tile `T`.
///
/// # Safety
/// The tiles are configured.
#[inline(always)]
unsafe fn zero<const T: u8>() {
    // SAFETY: the caller's promise.
    unsafe { asm!("tilezero tmm{t}", t = const T, options(nomem, nostack, preserves_flags)) }
}

/// Tile `C` += tile `A` (16 rows of 16 `bf16` pairs) × tile `B` (16 pairs
/// of 16 columns), in `f32`.
///
/// # Safety
/// The tiles are configured.
#[inline(always)]
unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: the caller's promise.
    unsafe {
        asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
            options(nomem, nostack, preserves_flags));
    }
}

/// [`Amx::scores`] and [`Amx::split_scores`], whose checks it relies on:
/// the sum of `products`, each `(a, b)` the product of query part `q[a]`
/// and key part `k[b]` (one part of each for `bf16` pairs). Output tiles
/// 0–3 hold up to 32 rows × 32 keys (tiles 4–5 their query rows, 6–7
/// their keys), so each product loads its two key tiles, and its two query
/// tiles where its query part is not the one loaded, for four `tdpbf16ps`;
/// a key tile is two such blocks; then all rows are scaled.
///
/// # Safety
/// As the callers check, with the tiles configured.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn scores_tiles(
    q: &[*const u32],
    rows: usize,
    d_pairs: usize,
    k: &[*const u32],
    products: &[(usize, usize)],
    scale: f32,
    s: &mut [f32],
    s_stride: usize,
) {
    let s = s.as_mut_ptr();
    let (q_bytes, k_bytes, s_bytes) = (d_pairs * BYTES, PAIR_KEYS * BYTES, s_stride * BYTES);
    let mut r0 = 0;
    // SAFETY (all): rows r0..r0 + n are inside `rows`, pairs t·16.. inside
    // `d_pairs`, keys h..h + 32 inside the tile, for every part, as the
    // callers checked.
    unsafe {
        while r0 < rows {
            let two = rows - r0 >= 2 * TILE_ROWS;
            for h in [0, 2 * LANES] {
                zero::<0>();
                zero::<1>();
                if two {
                    zero::<2>();
                    zero::<3>();
                }
                for t in 0..d_pairs / TILE_PAIRS {
                    let mut loaded = usize::MAX;
                    for &(a, b) in products {
                        let q_tile = q[a].add(r0 * d_pairs + t * TILE_PAIRS);
                        let k_tile = k[b].add(t * TILE_PAIRS * PAIR_KEYS + h);
                        let new_rows = a != loaded;
                        if new_rows {
                            load::<4, _>(q_tile, q_bytes);
                        }
                        load::<6, _>(k_tile, k_bytes);
                        load::<7, _>(k_tile.add(LANES), k_bytes);
                        dot::<0, 4, 6>();
                        dot::<1, 4, 7>();
                        if two {
                            if new_rows {
                                load::<5, _>(q_tile.add(TILE_ROWS * d_pairs), q_bytes);
                            }
                            dot::<2, 5, 6>();
                            dot::<3, 5, 7>();
                        }
                        loaded = a;
                    }
                }
                let s_tile = s.add(r0 * s_stride + h);
                store::<0>(s_tile, s_bytes);
                store::<1>(s_tile.add(LANES), s_bytes);
                if two {
                    store::<2>(s_tile.add(TILE_ROWS * s_stride), s_bytes);
                    store::<3>(s_tile.add(TILE_ROWS * s_stride + LANES), s_bytes);
                }
            }
            r0 += if two { 2 * TILE_ROWS } else { TILE_ROWS };
        }
        // Scaled after every tile is stored, not block by block: vector
        // loads right behind a tile store to the same lines wait for it
        // (measured: the scale pass took a third of the kernel so). A
        // scale of 1 (the softmax applies the call's) needs no pass.
        if scale == 1.0 {
            return;
        }
        let factor = _mm512_set1_ps(scale);
        for r in 0..rows {
            for c in (0..PAIR_KEYS).step_by(LANES) {
                let at = s.add(r * s_stride + c);
                _mm512_storeu_ps(at, _mm512_mul_ps(factor, _mm512_loadu_ps(at)));
            }
        }
    }
}

/// Rows of weights [`values_tiles`] holds in a set (a chunk), rounded to
/// `bf16` or split: one block of output tiles. A whole query tile's (96)
/// rounded at once, which leaves more
/// time between the scaling of an output row and its tile load, measured
/// 3–5% slower (Sapphire Rapids, one thread): its weights take a quarter
/// of L1.
const WEIGHT_ROWS: usize = 2 * TILE_ROWS;

/// [`Amx::accumulate_values`] without skipping (`PARTS = 1`: the
/// weights rounded to `bf16`, `v` one part) and
/// [`Amx::split_accumulate_values`] (`PARTS = 3`: the weights split, the
/// [`SPLIT_PRODUCTS`] of weight and value parts), whose checks it relies
/// on. Per chunk of up to 32 rows ([`WEIGHT_ROWS`]), the vector work (the
/// weights rounded or split into a set of `weights`, the output rows
/// scaled by `α`) and the tiles, per up to 32 columns: output tiles 0–3
/// loaded, each product's two 32-key halves of the value tile (tiles 6–7,
/// weights in 4–5, loaded where their part is not the one loaded) added,
/// and stored back. The next chunk's vector work runs between this
/// chunk's tile products (a split), or in one block before them (rounding).
///
/// # Safety
/// As the callers check, with the tiles configured.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn values_tiles<const PARTS: usize>(
    p: &[f32],
    p_stride: usize,
    v: [*const u32; PARTS],
    width: usize,
    alpha: &[f32],
    o: &mut [f32],
) {
    /// Up to `WEIGHT_ROWS` rows of weights as `bf16` pairs along keys, per
    /// part.
    #[repr(C, align(64))]
    struct Weights<const PARTS: usize>([[[u32; PAIR_KEYS / 2]; WEIGHT_ROWS]; PARTS]);

    const { assert!(PARTS == 1 || PARTS == 3, "one part, or a three-way split") };
    let products: &[(usize, usize)] = if PARTS == 1 {
        &[(0, 0)]
    } else {
        &SPLIT_PRODUCTS
    };
    let rows = alpha.len();
    let (p, o) = (p.as_ptr(), o.as_mut_ptr());
    let (w_bytes, o_bytes) = (PAIR_KEYS / 2 * BYTES, width * BYTES);
    // Two sets of weights: a chunk's are rounded or split, and its output
    // rows scaled, before or while the tiles of the chunk before it run,
    // so that the tile loads of its weights and output rows come well
    // after the vector stores to them (a tile load right behind them
    // waits for them: measured, `f32` split, d = 64, the first product of
    // a chunk took a fifth of the kernel's time).
    // Left uninitialised (zeroing them cost about 1% of a call): the
    // tiles read only the rows `prepare` wrote.
    let mut weights = [const { MaybeUninit::<Weights<PARTS>>::uninit() }; 2];
    let sets: [[*mut u32; PARTS]; 2] = [0, 1].map(|n| {
        let set = weights[n]
            .as_mut_ptr()
            .cast::<[[u32; PAIR_KEYS / 2]; WEIGHT_ROWS]>();
        // SAFETY: part `a` of a set is inside it (a pointer, nothing read).
        std::array::from_fn(|a| unsafe { set.add(a) }.cast::<u32>())
    });
    // The vector work of row `r` of the chunk of rows from `chunk`, into
    // `w`.
    let prepare = |chunk: usize, r: usize, w: [*mut u32; PARTS]| {
        // SAFETY: row chunk + r is inside `rows`, as the callers checked
        // and the loops below keep; `w` holds WEIGHT_ROWS rows of 32 pairs
        // a part, and r < WEIGHT_ROWS.
        unsafe {
            let o_row = o.add((chunk + r) * width);
            prepare_row(
                p.add((chunk + r) * p_stride),
                r,
                w,
                alpha[chunk + r],
                o_row,
                width,
            );
        }
    };
    let chunk_rows = |chunk: usize| WEIGHT_ROWS.min(rows.saturating_sub(chunk));
    let (tile_steps, width_blocks) = (
        PAIR_KEYS / 2 / TILE_PAIRS * products.len(),
        width.div_ceil(2 * LANES),
    );
    // SAFETY (all): rows r0.. are inside `rows`, columns c0..c0 + 32
    // inside `width`, key pairs t·16.. inside each value tile, as the
    // callers checked; each set of weights holds WEIGHT_ROWS rows of 32
    // pairs a part.
    unsafe {
        for r in 0..chunk_rows(0) {
            prepare(0, r, sets[0]);
        }
        for (n, chunk) in (0..rows).step_by(WEIGHT_ROWS).enumerate() {
            let w = sets[n % 2];
            // The next chunk's split runs a row at a time between this
            // chunk's products, done by three quarters of them, so that it
            // overlaps the tiles (run as one block it mostly waited for
            // them: a core retires in order, and a few hundred
            // instructions behind the queued tile products fill its
            // reorder buffer) and is done well before the next chunk's
            // tiles load what it wrote. Measured (Emerald Rapids, one
            // thread, `f32` split, against the block): `d_k = 64` N = 1024
            // +1–3%, N = 4096 +12%; `d_k = 128` +3–5%, +7%.
            let this_rows = chunk_rows(chunk);
            let (next, next_rows) = (chunk + WEIGHT_ROWS, chunk_rows(chunk + WEIGHT_ROWS));
            let steps = this_rows.div_ceil(2 * TILE_ROWS) * width_blocks * tile_steps;
            let spread = (steps * 3 / 4).max(1);
            let next_set = sets[(n + 1) % 2];
            let (mut step, mut prepared) = (0, 0);
            if PARTS == 1 {
                // Rounding is one instruction per 32 weights, too little
                // to be worth spreading.
                for r in 0..next_rows {
                    prepare(next, r, next_set);
                }
                prepared = next_rows;
            }
            let mut r0 = 0;
            while r0 < this_rows {
                let two = this_rows - r0 >= 2 * TILE_ROWS;
                let mut c0 = 0;
                while c0 < width {
                    let wide = width - c0 >= 2 * LANES;
                    let o_tile = o.add((chunk + r0) * width + c0);
                    let o_below = o_tile.add(TILE_ROWS * width);
                    load::<0, _>(o_tile, o_bytes);
                    if wide {
                        load::<1, _>(o_tile.add(LANES), o_bytes);
                    }
                    if two {
                        load::<2, _>(o_below, o_bytes);
                        if wide {
                            load::<3, _>(o_below.add(LANES), o_bytes);
                        }
                    }
                    for t in 0..PAIR_KEYS / 2 / TILE_PAIRS {
                        let mut loaded = usize::MAX;
                        for &(a, b) in products {
                            let w_tile = w[a].add(r0 * PAIR_KEYS / 2 + t * TILE_PAIRS);
                            let v_tile = v[b].add(t * TILE_PAIRS * width + c0);
                            let new_rows = a != loaded;
                            if new_rows {
                                load::<4, _>(w_tile, w_bytes);
                            }
                            load::<6, _>(v_tile, o_bytes);
                            dot::<0, 4, 6>();
                            if wide {
                                load::<7, _>(v_tile.add(LANES), o_bytes);
                                dot::<1, 4, 7>();
                            }
                            if two {
                                if new_rows {
                                    load::<5, _>(w_tile.add(TILE_ROWS * PAIR_KEYS / 2), w_bytes);
                                }
                                dot::<2, 5, 6>();
                                if wide {
                                    dot::<3, 5, 7>();
                                }
                            }
                            loaded = a;
                            if PARTS > 1 {
                                // Rows due after `step` products: the
                                // next chunk's `step / spread`.
                                step += 1;
                                while prepared < next_rows && prepared * spread < next_rows * step {
                                    prepare(next, prepared, next_set);
                                    prepared += 1;
                                }
                            }
                        }
                    }
                    store::<0>(o_tile, o_bytes);
                    if wide {
                        store::<1>(o_tile.add(LANES), o_bytes);
                    }
                    if two {
                        store::<2>(o_below, o_bytes);
                        if wide {
                            store::<3>(o_below.add(LANES), o_bytes);
                        }
                    }
                    c0 += if wide { 2 * LANES } else { LANES };
                }
                r0 += if two { 2 * TILE_ROWS } else { TILE_ROWS };
            }
            for r in prepared..next_rows {
                prepare(next, r, next_set);
            }
        }
    }
}

/// [`values_tiles`]' vector work for one row: its `PAIR_KEYS` weights
/// from `p_row` rounded (`PARTS = 1`) or split (3) into row `r` of each
/// part of `w`, and the output row `o_row` (`width` numbers) scaled by
/// `alpha` unless it is 1 (once a row's maximum settles, most key tiles
/// leave it so).
///
/// # Safety
/// `p_row` holds `PAIR_KEYS` numbers, `o_row` `width`, a multiple of 16,
/// each part of `w` row `r` of 32 pairs (64-byte aligned); the CPU has the
/// features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn prepare_row<const PARTS: usize>(
    p_row: *const f32,
    r: usize,
    w: [*mut u32; PARTS],
    alpha: f32,
    o_row: *mut f32,
    width: usize,
) {
    // SAFETY: the caller's promise.
    unsafe {
        if PARTS == 1 {
            for h in 0..PAIR_KEYS / (2 * LANES) {
                // `_mm512_cvtne2ps_pbh(a, b)` puts `b`'s 16 in the low
                // half: keys 2i, 2i + 1 of the row are pair i.
                let low = _mm512_loadu_ps(p_row.add(2 * h * LANES));
                let high = _mm512_loadu_ps(p_row.add((2 * h + 1) * LANES));
                let rounded: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(high, low));
                _mm512_store_si512(w[0].add(r * PAIR_KEYS / 2 + h * LANES).cast(), rounded);
            }
        } else {
            // 16 weights are 8 pairs: half a vector of each part.
            for h in 0..PAIR_KEYS / LANES {
                let parts = split16(_mm512_loadu_ps(p_row.add(h * LANES)));
                for (a, part) in parts.into_iter().enumerate().take(PARTS) {
                    let at = w[a].add(r * PAIR_KEYS / 2 + h * LANES / 2);
                    _mm256_store_si256(at.cast(), part);
                }
            }
        }
        if alpha != 1.0 {
            let a = _mm512_set1_ps(alpha);
            for c in (0..width).step_by(LANES) {
                let at = o_row.add(c);
                _mm512_storeu_ps(at, _mm512_mul_ps(a, _mm512_loadu_ps(at)));
            }
        }
    }
}

/// Output tiles 0–3 fed from tiles 4–5 and 6–7 for `rounds` rounds: four
/// independent chains, as the kernels run.
///
/// # Safety
/// The tiles are configured.
unsafe fn tile_chains(rounds: usize, operands: &[u32; TILE_ROWS * TILE_PAIRS], out: &mut [f32]) {
    let bytes = TILE_PAIRS * BYTES;
    // SAFETY: the caller's promise; `operands` and `out` are one tile each.
    unsafe {
        load::<4, _>(operands.as_ptr(), bytes);
        load::<5, _>(operands.as_ptr(), bytes);
        load::<6, _>(operands.as_ptr(), bytes);
        load::<7, _>(operands.as_ptr(), bytes);
        zero::<0>();
        zero::<1>();
        zero::<2>();
        zero::<3>();
        for _ in 0..rounds {
            dot::<0, 4, 6>();
            dot::<1, 4, 7>();
            dot::<2, 5, 6>();
            dot::<3, 5, 7>();
        }
        store::<0>(out.as_mut_ptr(), LANES * BYTES);
    }
}

/// This core's `tdpbf16ps` peak in GFLOP/s (16 × 16 × 32 multiply-adds,
/// 16384 FLOPs an instruction), the best of several runs of about 20 ms
/// on the calling thread; `None` where [`Amx::new`] is.
pub(crate) fn tile_peak() -> Option<f64> {
    let amx = Amx::new()?;
    // Pairs of 2⁻⁸: each product adds 2⁻¹⁶, so the sums stay finite.
    let small = u32::from(half_bits(1.0 / 256.0)) * 0x1_0001;
    let operands = [small; TILE_ROWS * TILE_PAIRS];
    let mut out = [0.0f32; TILE_ROWS * LANES];
    let mut run = |rounds: usize| {
        let start = Instant::now();
        // SAFETY: `amx` exists, so the CPU and OS allow the tiles, which
        // `configure` sets for this thread.
        unsafe {
            configure();
            tile_chains(rounds, &operands, &mut out);
        }
        std::hint::black_box(&out);
        start.elapsed().as_secs_f64()
    };
    let mut rounds = 1 << 10;
    while run(rounds) < 0.02 && rounds < 1 << 30 {
        rounds *= 2;
    }
    let best = (0..5).map(|_| run(rounds)).fold(f64::INFINITY, f64::min);
    amx.release();
    let flops = 2.0 * (TILE_ROWS * LANES * 2 * TILE_PAIRS) as f64;
    Some((rounds * 4) as f64 * flops / best / 1e9)
}

/// The `bf16` bits of `x`, truncated (exact for the powers of two used).
fn half_bits(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(i: usize) -> f32 {
        // A fixed, irregular sequence in (−2, 2), exact in bf16 after
        // truncation below.
        let x = ((i as f32) * 0.618_034).fract() * 4.0 - 2.0;
        f32::from_bits(x.to_bits() & 0xffff_0000)
    }

    /// `x` rounded to `bf16` (to nearest even; `x` finite), widened.
    fn rounded(x: f32) -> f64 {
        let bits = x.to_bits();
        let bits = bits + 0x7fff + ((bits >> 16) & 1);
        f64::from(f32::from_bits(bits & 0xffff_0000))
    }

    fn pair(a: f32, b: f32) -> u32 {
        u32::from(half_bits(a)) | (u32::from(half_bits(b)) << 16)
    }

    #[test]
    fn scores_match_f64_products_of_the_same_bf16_inputs() {
        let Some(amx) = Amx::new() else { return };
        for d_pairs in [16, 32, 48, 64] {
            for rows in [16, 32, 48, 96] {
                let q: Vec<f32> = (0..rows * 2 * d_pairs).map(noise).collect();
                let k: Vec<f32> = (0..PAIR_KEYS * 2 * d_pairs)
                    .map(|i| noise(i + 7919))
                    .collect();
                let q_pairs: Vec<u32> = q.chunks_exact(2).map(|x| pair(x[0], x[1])).collect();
                // Key j's dims 2p, 2p + 1 at [p][j].
                let mut k_pairs = vec![0u32; d_pairs * PAIR_KEYS];
                for j in 0..PAIR_KEYS {
                    for p in 0..d_pairs {
                        let key = &k[j * 2 * d_pairs..];
                        k_pairs[p * PAIR_KEYS + j] = pair(key[2 * p], key[2 * p + 1]);
                    }
                }
                let stride = PAIR_KEYS + 16;
                let mut s = vec![f32::NAN; rows * stride];
                let scale = 0.125;
                amx.scores(&q_pairs, d_pairs, &k_pairs, scale, &mut s, stride);
                amx.release();
                for r in 0..rows {
                    for j in 0..PAIR_KEYS {
                        let want: f64 = (0..2 * d_pairs)
                            .map(|x| {
                                f64::from(q[r * 2 * d_pairs + x])
                                    * f64::from(k[j * 2 * d_pairs + x])
                            })
                            .sum::<f64>()
                            * f64::from(scale);
                        let got = f64::from(s[r * stride + j]);
                        // f32 sums of 2·d_pairs exact products of |x| < 4.
                        let bound = 2.0 * d_pairs as f64 * 4.0 * f64::from(f32::EPSILON);
                        assert!(
                            (got - want).abs() <= bound,
                            "{rows}×{d_pairs} [{r}][{j}]: {got} vs {want}"
                        );
                    }
                    assert!(
                        s[r * stride + PAIR_KEYS].is_nan(),
                        "the stride's gap is untouched"
                    );
                }
            }
        }
    }

    /// Rescale factors for `rows` output rows: 1 for every third row (the
    /// kernels skip scaling those), others below and above 1.
    fn alphas(rows: usize) -> Vec<f32> {
        (0..rows)
            .map(|r| {
                if r % 3 == 0 {
                    1.0
                } else {
                    0.5 + r as f32 / 256.0
                }
            })
            .collect()
    }

    /// Output rows the value kernels are tested with: one or two tile
    /// rows, and one to seven chunks of 32 with a last half chunk.
    const VALUE_ROWS: [usize; 6] = [16, 32, 48, 80, 96, 208];

    #[test]
    fn values_match_f64_with_weights_rounded_to_bf16() {
        let Some(amx) = Amx::new() else { return };
        for width in [16, 32, 48, 64, 128] {
            for rows in VALUE_ROWS {
                let p: Vec<f32> = (0..rows * PAIR_KEYS)
                    .map(|i| noise(i).abs() / 2.0 + 0.001)
                    .collect();
                let v: Vec<f32> = (0..PAIR_KEYS * width).map(|i| noise(i + 104_729)).collect();
                let mut v_pairs = vec![0u32; PAIR_KEYS / 2 * width];
                for i in 0..PAIR_KEYS / 2 {
                    for c in 0..width {
                        v_pairs[i * width + c] =
                            pair(v[2 * i * width + c], v[(2 * i + 1) * width + c]);
                    }
                }
                let alpha = alphas(rows);
                let o0: Vec<f32> = (0..rows * width).map(|i| noise(i + 31)).collect();
                let mut o = o0.clone();
                amx.accumulate_values(&p, PAIR_KEYS, &v_pairs, width, &alpha, &mut o, false);
                amx.release();
                for r in 0..rows {
                    for c in 0..width {
                        let mut want = f64::from(alpha[r]) * f64::from(o0[r * width + c]);
                        for j in 0..PAIR_KEYS {
                            let weight = rounded(p[r * PAIR_KEYS + j]);
                            want += weight * f64::from(v[j * width + c]);
                        }
                        let got = f64::from(o[r * width + c]);
                        let bound = 1e-5 * (1.0 + want.abs()) * PAIR_KEYS as f64;
                        assert!(
                            (got - want).abs() <= bound,
                            "{rows}×{width} [{r}][{c}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// `x` (even length) split into its three parts as `bf16` pairs.
    fn split_pairs(amx: Amx, x: &[f32]) -> [Vec<u32>; 3] {
        let mut parts = [(); 3].map(|()| vec![0u32; x.len() / 2]);
        let [hi, mid, lo] = &mut parts;
        assert!(!amx.split_pairs(x, 1e30, [hi, mid, lo]));
        parts
    }

    /// An `f32` with all 24 bits of its significand irregular, in (−2, 2).
    fn full_noise(i: usize) -> f32 {
        ((i as f32) * 0.618_034 + (i as f32) * (i as f32) * 1e-7).fract() * 4.0 - 2.0
    }

    #[test]
    fn split_scores_are_f32_accurate() {
        let Some(amx) = Amx::new() else { return };
        for d_pairs in [16, 32, 64] {
            for rows in [16, 48, 96] {
                let d = 2 * d_pairs;
                let q: Vec<f32> = (0..rows * d).map(full_noise).collect();
                let k: Vec<f32> = (0..PAIR_KEYS * d).map(|i| full_noise(i + 7919)).collect();
                let q_parts = split_pairs(amx, &q);
                // Key j's dims 2p, 2p + 1 at [p][j], per part.
                let k_parts = split_pairs(amx, &k).map(|part| {
                    let mut packed = vec![0u32; d_pairs * PAIR_KEYS];
                    for j in 0..PAIR_KEYS {
                        for p in 0..d_pairs {
                            packed[p * PAIR_KEYS + j] = part[j * d_pairs + p];
                        }
                    }
                    packed
                });
                let stride = PAIR_KEYS + 16;
                let mut s = vec![f32::NAN; rows * stride];
                let [qh, qm, ql] = &q_parts;
                let [kh, km, kl] = &k_parts;
                amx.split_scores([qh, qm, ql], d_pairs, [kh, km, kl], 0.5, &mut s, stride);
                amx.release();
                for r in 0..rows {
                    for j in 0..PAIR_KEYS {
                        let (q, k) = (&q[r * d..(r + 1) * d], &k[j * d..(j + 1) * d]);
                        let want: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum();
                        let size: f64 = q.iter().zip(k).map(|(a, b)| f64::from(a * b).abs()).sum();
                        let got = f64::from(s[r * stride + j]) * 2.0;
                        // What a sequential `f32` sum may be off by.
                        let bound = d as f64 * f64::from(f32::EPSILON) / 2.0 * size;
                        assert!(
                            (got - want).abs() <= bound,
                            "{rows}×{d} [{r}][{j}]: {got} vs {want}"
                        );
                    }
                    assert!(s[r * stride + PAIR_KEYS].is_nan(), "the gap is untouched");
                }
            }
        }
    }

    #[test]
    fn split_values_are_f32_accurate() {
        let Some(amx) = Amx::new() else { return };
        for width in [16, 48, 128] {
            for rows in VALUE_ROWS {
                let p: Vec<f32> = (0..rows * PAIR_KEYS)
                    .map(|i| full_noise(i).abs() / 2.0)
                    .collect();
                let v: Vec<f32> = (0..PAIR_KEYS * width)
                    .map(|i| full_noise(i + 104_729))
                    .collect();
                // Keys 2i, 2i + 1 of column c at [i][c]: split the
                // transposed rows, then lay the pairs out.
                let mut by_column = vec![0.0f32; PAIR_KEYS * width];
                for j in 0..PAIR_KEYS {
                    for c in 0..width {
                        by_column[c * PAIR_KEYS + j] = v[j * width + c];
                    }
                }
                let v_parts = split_pairs(amx, &by_column).map(|part| {
                    let mut packed = vec![0u32; PAIR_KEYS / 2 * width];
                    for i in 0..PAIR_KEYS / 2 {
                        for c in 0..width {
                            packed[i * width + c] = part[c * PAIR_KEYS / 2 + i];
                        }
                    }
                    packed
                });
                let alpha = alphas(rows);
                let o0: Vec<f32> = (0..rows * width).map(|i| full_noise(i + 31)).collect();
                let mut o = o0.clone();
                let [vh, vm, vl] = &v_parts;
                amx.split_accumulate_values(&p, PAIR_KEYS, [vh, vm, vl], width, &alpha, &mut o);
                amx.release();
                for r in 0..rows {
                    for c in 0..width {
                        let scaled = f64::from(alpha[r] * o0[r * width + c]);
                        let terms = (0..PAIR_KEYS)
                            .map(|j| f64::from(p[r * PAIR_KEYS + j]) * f64::from(v[j * width + c]));
                        let want = scaled + terms.clone().sum::<f64>();
                        let size = scaled.abs() + terms.map(f64::abs).sum::<f64>();
                        let got = f64::from(o[r * width + c]);
                        let bound = PAIR_KEYS as f64 * f64::from(f32::EPSILON) / 2.0 * size;
                        assert!(
                            (got - want).abs() <= bound,
                            "{rows}×{width} [{r}][{c}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_value_tile_with_nan_skips_zero_weights() {
        let Some(amx) = Amx::new() else { return };
        let width = 16;
        let mut p = vec![0.0f32; TILE_ROWS * PAIR_KEYS];
        p.iter_mut().step_by(2).for_each(|w| *w = 0.5);
        // Odd keys (zero weight) hold NaN.
        let v_pairs = vec![pair(1.0, f32::NAN); PAIR_KEYS / 2 * width];
        let mut o = vec![0.0f32; TILE_ROWS * width];
        amx.accumulate_values(
            &p,
            PAIR_KEYS,
            &v_pairs,
            width,
            &[1.0; TILE_ROWS],
            &mut o,
            true,
        );
        assert!(o.iter().all(|&x| x == 16.0), "{o:?}");
    }

    #[test]
    fn the_peak_is_positive_where_the_cpu_has_tiles() {
        if let Some(peak) = tile_peak() {
            assert!(peak > 0.0 && peak.is_finite());
        }
    }
}
