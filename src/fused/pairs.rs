//! The prefill of a `bf16` call read natively: the keys and values of
//! each `(batch, kv_head)` packed once as `bf16` pairs, and both products
//! of every tile on AMX tiles or `vdpbf16ps` ([`PairKernels`], whichever
//! the CPU runs faster; the packed layouts are both's). Everything
//! else, jobs, tiles, masks, modifiers, softmax, log-sum-exp and sinks, is
//! the `f32` prefill's (`forward.rs`, `tile.rs`): this file is only a
//! [`TileSource`] with its packing.
//!
//! A `bf16` call's keys and values reach here as the caller's `bf16`,
//! packed straight from them, and its queries widened to `f32` exactly a
//! query tile at a time. Only queries that are `bf16` values come here
//! (`Query::all_bf16`: a `bf16` call's, or a `bf16` cache's widened ones;
//! never `f32` projections), so taking their `bf16` bits back when
//! `tile.rs` pairs them (unscaled) is exact too:
//! the scores are the `f32` sums of exact products, scaled in `f32`. The
//! one rounding this path adds over the `f32` path is the weights `P` in
//! `bf16` for `P·V`, per tile: in two parts on `vdpbf16ps` (each weight
//! within a relative 2⁻¹⁵), rounded once on AMX tiles (2⁻⁸, where the
//! second product would cost the tiles their lead over torch), so an
//! output moves by at most `ε·Σ_j p_j·|v_j|/Σ_j p_j ≤ ε·max|v|` beyond
//! the `f32` path's error, `ε` 2⁻¹⁵ or 2⁻⁸.

use half::bf16;
use ndarray::{ArrayView, ArrayView2, ArrayViewMut3, ArrayViewMut4, Dimension};

use super::forward::{self, forward_or_decode, prefill_with};
use super::scratch::Scratch;
use super::tile::{TileQueries, TileSource};
use super::{AMX_CAUSAL_QUERY_TILE, KEY_TILE, Output, Query, forward_query_tile};
use crate::alloc::{element_count, try_filled};
use crate::call::{Call, head};
use crate::error::AttentionError;
use crate::simd::{
    BF16_INFINITY_BITS, BF16_MAGNITUDE_BITS, Kernel, Load, PAIR_KEYS, PairKernels, WeightPrecision,
    WithKernel, max_bf16_magnitude_bits,
};

const _: () = assert!(PAIR_KEYS == KEY_TILE, "a packed tile is a key tile");

/// `f32` lanes of the AVX-512 set, the only one this path runs with: the
/// value rows the tile keeps are padded to it, as `Bf16Dot` needs.
const LANES: usize = 16;

/// One `bf16` forward call read natively, waiting for its kernel set.
pub(super) struct Bf16Forward<'c, 'a, Q, O> {
    pub(super) call: &'c Call<'a, f32, bf16, Q>,
    pub(super) out: ArrayViewMut4<'c, O>,
    pub(super) log_sum_exp: Option<ArrayViewMut3<'c, f32>>,
    pub(super) kernels: PairKernels,
}

impl<Q: Query, O: Output> WithKernel for Bf16Forward<'_, '_, Q, O> {
    type Output = Result<(), AttentionError>;

    /// The pairs prefill, unless the call is empty or a decoding step
    /// (their own paths), or its unscaled products could overflow `f32`
    /// where the `f32` path's scaled ones would not: that path decides
    /// what an overflow gives, so such calls take its prefill (which widens
    /// the keys and values as it packs them).
    fn run<K: Kernel>(self, kernel: K) -> Self::Output {
        let Bf16Forward {
            call,
            out,
            log_sum_exp,
            kernels,
        } = self;
        forward_or_decode(kernel, call, out, log_sum_exp, |kernel, call, out, lse| {
            let magnitudes = key_magnitudes(call)?;
            if K::LANES != LANES || products_may_overflow(kernel, call, &magnitudes) {
                return forward::prefill(kernel, call, out, lse);
            }
            prefill(kernel, kernels, call, &magnitudes, out, lse)
        })
    }
}

/// The magnitudes of some `bf16` numbers (a head's keys, a call's
/// queries), from their bits.
#[derive(Clone, Copy, Default)]
struct Magnitude {
    /// The largest magnitude bits among the finite numbers: those of the
    /// largest finite `|x|`.
    max_bits: u16,
    /// Whether a number is NaN or an infinity.
    has_nonfinite: bool,
}

impl Magnitude {
    /// The magnitudes of `x`, in any order: one pass (the vector kernel's,
    /// where `x` is one block of memory), and a second only when the first
    /// met NaN or an infinity.
    fn of<D: Dimension>(x: ArrayView<'_, bf16, D>) -> Self {
        let magnitude = |x: &bf16| x.to_bits() & BF16_MAGNITUDE_BITS;
        let max_bits = match x.as_slice_memory_order() {
            Some(x) => max_bf16_magnitude_bits(x),
            None => x.iter().map(magnitude).fold(0, u16::max),
        };
        if max_bits < BF16_INFINITY_BITS {
            return Self {
                max_bits,
                has_nonfinite: false,
            };
        }
        let finite = x
            .iter()
            .map(magnitude)
            .filter(|&bits| bits < BF16_INFINITY_BITS);
        Self {
            max_bits: finite.fold(0, u16::max),
            has_nonfinite: true,
        }
    }

    /// The largest finite `|x|`.
    fn max_abs(self) -> f32 {
        bf16::from_bits(self.max_bits).to_f32()
    }

    /// The bound the tiles mask with: `+inf` when a key holds NaN or an
    /// infinity, as the `f32` path's.
    fn max_abs_key(self) -> f32 {
        if self.has_nonfinite {
            f32::INFINITY
        } else {
            self.max_abs()
        }
    }
}

/// Each `(batch, kv_head)`'s key [`Magnitude`], in job order.
///
/// # Errors
/// When the list cannot be allocated.
fn key_magnitudes<Q>(call: &Call<'_, f32, bf16, Q>) -> Result<Vec<Magnitude>, AttentionError> {
    let shape = call.shape;
    let what = "key magnitudes";
    let mut magnitudes = try_filled(
        what,
        element_count::<Magnitude>(what, &[shape.batch, shape.kv_heads])?,
        Magnitude::default(),
    )?;
    let heads = (0..shape.batch).flat_map(|b| (0..shape.kv_heads).map(move |h| (b, h)));
    for (magnitude, (b, kv_h)) in magnitudes.iter_mut().zip(heads) {
        *magnitude = Magnitude::of(head(&call.k, b, kv_h));
    }
    Ok(magnitudes)
}

/// Whether `|q·k|`, unscaled or scaled, may come near `f32::MAX` for some
/// finite query and key: `d_k·max|q|·max|k|·max(|scale|, 1)` past half
/// of it, over the finite numbers. NaN and infinities are left out: their
/// products are NaN or infinite on either path, in any order of the sum,
/// and a path chosen by them would make every row's bits depend on a key
/// no row sees or on another row's query.
fn products_may_overflow<K: Kernel, Q: Query>(
    kernel: K,
    call: &Call<'_, f32, bf16, Q>,
    magnitudes: &[Magnitude],
) -> bool {
    // `bf16` queries by their bits. Else (a `bf16` cache's queries,
    // widened) the kernel's vector pass first, over the queries' memory in
    // any order where it is one block; it says `+inf` for NaN as for
    // infinities, and then the element-wise fold decides.
    let max_abs_q = match Q::as_bf16(&call.q) {
        Some(q) => Magnitude::of(q).max_abs(),
        None => match call.q.as_slice_memory_order().map(|q| kernel.max_abs(q)) {
            Some(max) if max.is_finite() => max,
            _ => call.q.fold(0.0f32, |max, x| {
                let x = Load::to_f32(*x).abs();
                if x.is_finite() { max.max(x) } else { max }
            }),
        },
    };
    let max_abs_k = magnitudes
        .iter()
        .fold(0.0f32, |max, head| max.max(head.max_abs()));
    let bound = f64::from(max_abs_q)
        * f64::from(max_abs_k)
        * call.shape.d_k as f64
        * f64::from(call.scale.abs().max(1.0));
    bound > f64::from(f32::MAX) / 2.0
}

/// The prefill with each `(batch, kv_head)` packed into [`PairedKeys`].
fn prefill<K: Kernel, Q: Query, O: Output>(
    kernel: K,
    kernels: PairKernels,
    call: &Call<'_, f32, bf16, Q>,
    magnitudes: &[Magnitude],
    out: ArrayViewMut4<'_, O>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    let query_tile = if kernels.on_tiles() && call.opts.causal.is_some() {
        AMX_CAUSAL_QUERY_TILE
    } else {
        // Keys and values packed as `bf16`.
        forward_query_tile(call, size_of::<bf16>())
    };
    prefill_with(kernel, call, query_tile, out, log_sum_exp, |b, kv_h| {
        let magnitude = magnitudes[b * call.shape.kv_heads + kv_h];
        PairedKeys::pack(kernels, call, b, kv_h, magnitude)
    })
}

/// One head's keys and values as `bf16` pairs, padded to whole key tiles
/// with zeros.
struct PairedKeys {
    kernels: PairKernels,
    /// Per key tile `[d_pairs][KEY_TILE]`: key `j`'s dims `2p, 2p + 1` at
    /// `[p][j]`.
    keys: Scratch<u32>,
    d_pairs: usize,
    /// Per key tile `[KEY_TILE/2][width]`: keys `2i, 2i + 1` of column `c`
    /// at `[i][c]`.
    values: Scratch<u32>,
    /// `d_v` rounded up to whole vectors, as the query tile's output rows.
    width: usize,
    max_abs_key: f32,
    /// Per key tile: does a value there hold NaN or an infinity?
    tile_has_nonfinite_values: Vec<bool>,
}

impl PairedKeys {
    /// Packs the keys and values of `(b, kv_h)`.
    ///
    /// # Errors
    /// When the buffers are too large to address or cannot be allocated.
    fn pack<Q>(
        kernels: PairKernels,
        call: &Call<'_, f32, bf16, Q>,
        b: usize,
        kv_h: usize,
        magnitude: Magnitude,
    ) -> Result<Self, AttentionError> {
        let shape = call.shape;
        let tiles = shape.len_kv.div_ceil(KEY_TILE);
        let padded = tiles * KEY_TILE;
        let d_pairs = shape.d_k.div_ceil(2);
        let width = shape.d_v.div_ceil(LANES) * LANES;
        let what = "packed bf16 keys and values";
        let mut keys = Scratch::for_writing(what, element_count::<u32>(what, &[padded, d_pairs])?)?;
        let mut values =
            Scratch::for_writing(what, element_count::<u32>(what, &[padded / 2, width])?)?;
        let mut tile_has_nonfinite_values = try_filled(what, tiles, false)?;
        // Copied only where a head's rows are not one block already.
        let (k, v) = (head(&call.k, b, kv_h), head(&call.v, b, kv_h));
        let (k, v) = (k.as_standard_layout(), v.as_standard_layout());
        let (k, v) = (
            k.as_slice().expect("standard layout"),
            v.as_slice().expect("standard layout"),
        );
        if shape.d_k > 0 {
            kernels.pack_keys(k, shape.d_k, &mut keys);
        }
        if shape.d_v > 0 {
            kernels.pack_values(
                v,
                shape.d_v,
                width,
                &mut values,
                &mut tile_has_nonfinite_values,
            );
        }
        Ok(Self {
            kernels,
            keys,
            d_pairs,
            values,
            width,
            max_abs_key: magnitude.max_abs_key(),
            tile_has_nonfinite_values,
        })
    }
}

impl TileSource for PairedKeys {
    const PAIRED_QUERIES: bool = true;
    // The AMX tiles round the weights to `bf16`; `vdpbf16ps` takes them in
    // two `bf16` parts (within 2⁻¹⁵), and the output is `bf16` (2⁻⁹).
    const WEIGHT_PRECISION: WeightPrecision = WeightPrecision::Half;

    fn computed_rows<K: Kernel>(rows: usize) -> usize {
        PairKernels::computed_rows(rows)
    }

    fn max_abs_key(&self) -> f32 {
        self.max_abs_key
    }

    fn tile_scores<K: Kernel>(&self, _: K, q: &TileQueries<'_>, j0: usize, scores: &mut [f32]) {
        let rows = scores.len() / KEY_TILE;
        let tile = &self.keys[j0 * self.d_pairs..][..self.d_pairs * KEY_TILE];
        let q_pairs = &q.pairs[..rows * self.d_pairs];
        self.kernels
            .scores(q_pairs, self.d_pairs, tile, q.scale, scores, KEY_TILE);
    }

    fn tile_values<K: Kernel>(
        &self,
        _: K,
        j0: usize,
        p: ArrayView2<'_, f32>,
        alpha: &[f32],
        o: &mut [f32],
        width: usize,
    ) {
        assert_eq!(width, self.width, "the query tile's rows are padded alike");
        let p = p.as_slice().expect("a query tile's weights are one block");
        let tile = &self.values[j0 / 2 * self.width..][..KEY_TILE / 2 * self.width];
        let skip = self.tile_has_nonfinite_values[j0 / KEY_TILE];
        self.kernels
            .accumulate_values(p, KEY_TILE, tile, width, alpha, o, skip);
    }

    fn finish_query_tile(&self) {
        self.kernels.finish();
    }
}
