//! The prefill of a `bf16` call read natively: the keys and values of
//! each `(batch, kv_head)` packed once as `bf16` pairs, and both products
//! of every tile on AMX tiles or `vdpbf16ps` ([`PairKernels`], whichever
//! the CPU runs faster; the packed layouts are both's). Everything
//! else, jobs, tiles, masks, modifiers, softmax, log-sum-exp and sinks, is
//! the `f32` prefill's (`forward.rs`, `tile.rs`): this file is only a
//! [`TileSource`] with its packing.
//!
//! A `bf16` call's keys and values reach here as the caller's `bf16`,
//! packed straight from them, and its queries converted to `f32` exactly,
//! so taking their `bf16` bits back (unscaled, in `tile.rs`) is exact too:
//! the scores are the `f32` sums of exact products, scaled in `f32`. The one rounding this path adds over the
//! `f32` path is the weights `P`, rounded to `bf16` per tile for `P·V`:
//! each by a relative 2⁻⁸ at most, so an output moves by at most
//! `2⁻⁸·Σ_j p_j·|v_j|/Σ_j p_j ≤ 2⁻⁸·max|v|` beyond the `f32` path's error.

use half::bf16;
use ndarray::{ArrayView2, ArrayViewMut3, ArrayViewMut4};

use super::decode;
use super::forward::prefill_with;
use super::scratch::Scratch;
use super::tile::{TileQueries, TileSource};
use super::{KEY_TILE, forward_query_tile, forward_stored};
use crate::alloc::{element_count, try_filled};
use crate::call::{Call, head};
use crate::error::AttentionError;
use crate::simd::{Kernel, PAIR_KEYS, PairKernels, WithKernel};

const _: () = assert!(PAIR_KEYS == KEY_TILE, "a packed tile is a key tile");

/// Query rows per work item of a causal call on AMX tiles, which compute
/// rows in blocks of 32: the `f32` path's 48 leaves a half block per tile.
/// Measured on Sapphire Rapids (one thread, bf16, d = 64, against 48):
/// 64 rows ran 7% faster at N = 256 causal and 2% at 1024 (N = 4096
/// within noise), 32 rows slower. Like every query tile, chosen without
/// the thread count.
const AMX_CAUSAL_QUERY_TILE: usize = 64;

/// `f32` lanes of the AVX-512 set, the only one this path runs with: the
/// value rows the tile keeps are padded to it, as `Bf16Dot` needs.
const LANES: usize = 16;

/// One `bf16` forward call read natively, waiting for its kernel set.
pub(super) struct Bf16Forward<'c, 'a> {
    pub(super) call: &'c Call<'a, f32, bf16>,
    pub(super) out: ArrayViewMut4<'c, f32>,
    pub(super) log_sum_exp: Option<ArrayViewMut3<'c, f32>>,
    pub(super) kernels: PairKernels,
}

impl WithKernel for Bf16Forward<'_, '_> {
    type Output = Result<(), AttentionError>;

    /// The pairs prefill, unless the path for keys and values stored in
    /// `bf16` ([`forward_stored`]: decoding in place, else the `f32` path)
    /// gives the answer: empty outputs and decoding steps (its own paths),
    /// and calls whose unscaled products could overflow `f32` where the
    /// `f32` path's scaled ones would not (it decides what an overflow
    /// gives).
    fn run<K: Kernel>(self, kernel: K) -> Self::Output {
        let Bf16Forward {
            call,
            out,
            log_sum_exp,
            kernels,
        } = self;
        let empty = out.is_empty() && log_sum_exp.as_ref().is_none_or(|lse| lse.is_empty());
        if empty
            || K::LANES != LANES
            || decode::reads_keys_in_place::<K>(call)
            || products_may_overflow(kernel, call)
        {
            return forward_stored(call, out, log_sum_exp);
        }
        prefill(kernel, kernels, call, out, log_sum_exp)
    }
}

/// Whether `|q·k|`, unscaled or scaled, may come near `f32::MAX` for some
/// query and key: `d_k·max|q|·max|k|·max(|scale|, 1)` past half of it.
fn products_may_overflow<K: Kernel>(kernel: K, call: &Call<'_, f32, bf16>) -> bool {
    // NaN ignored (a NaN product is not an overflow). The kernel's vector
    // pass first (the converted queries are contiguous); it says `+inf`
    // for NaN as for infinities, and then the element-wise fold decides.
    let max_abs_q = match call.q.as_slice().map(|q| kernel.max_abs(q)) {
        Some(max) if max.is_finite() => max,
        _ => call.q.fold(0.0f32, |max, x| max.max(x.abs())),
    };
    let max_abs_k = match call.k.as_slice_memory_order() {
        // By slice where it is one (it vectorizes); the order does not matter.
        Some(k) => max_abs_bits(k.iter()),
        None => max_abs_bits(call.k.iter()),
    };
    let max_abs_k = match max_abs_k {
        bits if bits > INFINITY_BITS => {
            // A NaN: the largest magnitude among the rest.
            let bits = call.k.fold(0, |max, x| match x.to_bits() & MAGNITUDE {
                nan if nan > INFINITY_BITS => max,
                bits => max.max(bits),
            });
            bf16::from_bits(bits).to_f32()
        }
        bits => bf16::from_bits(bits).to_f32(),
    };
    let bound = f64::from(max_abs_q)
        * f64::from(max_abs_k)
        * call.shape.d_k as f64
        * f64::from(call.scale.abs().max(1.0));
    bound > f64::from(f32::MAX) / 2.0
}

/// The magnitude bits of a `bf16` (all but the sign).
const MAGNITUDE: u16 = 0x7fff;
/// The magnitude bits of `±inf`: larger ones are NaN, smaller ones finite.
const INFINITY_BITS: u16 = 0x7f80;

/// The largest magnitude bits in `x`: those of its largest `|x|` when all
/// are finite, `INFINITY_BITS` with an infinity, more with a NaN.
fn max_abs_bits<'x>(x: impl Iterator<Item = &'x bf16>) -> u16 {
    x.fold(0, |max, x| max.max(x.to_bits() & MAGNITUDE))
}

/// The prefill with each `(batch, kv_head)` packed into [`PairedKeys`].
fn prefill<K: Kernel>(
    kernel: K,
    kernels: PairKernels,
    call: &Call<'_, f32, bf16>,
    out: ArrayViewMut4<'_, f32>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    let query_tile = if kernels.on_tiles() && call.opts.causal.is_some() {
        AMX_CAUSAL_QUERY_TILE
    } else {
        forward_query_tile(call)
    };
    prefill_with(kernel, call, query_tile, out, log_sum_exp, |b, kv_h| {
        PairedKeys::pack(kernels, call, b, kv_h)
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
    fn pack(
        kernels: PairKernels,
        call: &Call<'_, f32, bf16>,
        b: usize,
        kv_h: usize,
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
            // `+inf` when a key holds NaN or an infinity, as the f32 path's.
            max_abs_key: match max_abs_bits(k.iter()) {
                bits if bits >= INFINITY_BITS => f32::INFINITY,
                bits => bf16::from_bits(bits).to_f32(),
            },
            tile_has_nonfinite_values,
        })
    }
}

impl TileSource for PairedKeys {
    const PAIRED_QUERIES: bool = true;

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
