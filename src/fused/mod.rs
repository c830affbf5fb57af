//! The fast path for `f32`: FlashAttention-2 loop order over tiles, on the
//! hand-vectorized kernels of [`crate::simd`]. No `len_q × len_kv` buffer is
//! ever formed.
//!
//! For each `(batch, kv_head)` the keys and values are packed once (keys in
//! panels for the Q·Kᵀ microkernel, values with rows padded to the vector
//! width), then every query head that shares them and every tile of query
//! rows (its height chosen by [`forward_query_tile`]) streams the key tiles
//! through:
//!
//! ```text
//! S  = (scale·Q_tile) · K_jᵀ   (+ bias; masked entries = −inf)
//! m' = max(m, rowmax S);  P = exp(S − m');  α = exp(m − m')   (α = 0 when m = −inf)
//! ℓ' = α·ℓ + rowsum P;    O' = α·O + P · V_j
//! end: O / ℓ   (rows with ℓ = 0 → 0)
//! ```
//!
//! Causal, window and key-length masks bound the key tiles a query tile visits;
//! only tiles that straddle a boundary (or every tile, with a keep mask) are
//! masked element by element. Masked scores become `−inf` by selection, so
//! whatever a masked key holds never reaches the output; value tiles that
//! hold a NaN or infinity take a path that skips zero weights, so `0·NaN`
//! never happens either.
//!
//! The files, in the order data flows through them:
//! - `mod.rs`: the entry points, the kernel set, the tile sizes;
//! - `forward.rs`: the prefill driver (packed keys and values);
//! - `decode.rs`: the decode driver (few queries, keys read in place, key
//!   chunks merged);
//! - `tile.rs`: one query tile's online softmax, shared by both drivers,
//!   and the per-tile bias and mask the backward uses too;
//! - `pack.rs`: the packed layouts the kernels read;
//! - `pairs.rs`: a `bf16` call's keys and values packed as `bf16` pairs for
//!   AVX-512 BF16, a key source for the same prefill driver;
//! - `split.rs`: an `f32` call's keys and values split into three `bf16`
//!   parts for AMX tiles, another key source for it (`f32` accuracy);
//! - `scratch.rs`: aligned working buffers, kept per thread across calls
//!   (a half-precision call's converted copies come from the same pool);
//! - `backward.rs`: the gradients, on the same kernels.

mod backward;
mod decode;
mod forward;
mod pack;
#[cfg(feature = "half")]
mod pairs;
pub(crate) mod scratch;
#[cfg(all(target_arch = "x86_64", feature = "half"))]
mod split;
mod tile;

use ndarray::{ArrayView4, ArrayViewMut3, ArrayViewMut4};

use crate::call::{BackwardCall, Call};
use crate::error::AttentionError;
use crate::gradients::GradientsViewMut;
use crate::simd::{self, WeightPrecision};

/// Query rows per work item. With 64 keys per tile, the score tile is
/// 96 × 64 × 4 B = 24 KiB, and a key or value tile at d = 64 is 16 KiB: the
/// working set of one step sits in L1/L2. The backward always uses it; the
/// forward uses it unless [`forward_query_tile`] picks the causal or the
/// long one.
pub(crate) const QUERY_TILE: usize = 96;
/// Query rows per forward work item when a causal rule bounds the keys: a
/// query tile on the diagonal computes up to the end of the key tile that
/// holds its last row's diagonal, so its masked-off triangle grows with its
/// height. Halving the tile halves that waste (at N = 256, a sixth fewer
/// score entries) for more passes over each key tile, which sit in L2.
pub(crate) const CAUSAL_QUERY_TILE: usize = 48;

/// [`CAUSAL_QUERY_TILE`] on AMX tiles (`bf16` pairs and the `f32` split),
/// which compute rows in blocks of 32: 48 leaves a half block per tile.
/// Measured on Sapphire Rapids (one thread, `bf16`, d = 64, against 48):
/// 64 rows ran 7% faster at N = 256 causal and 2% at 1024 (N = 4096
/// within noise), 32 rows slower; on Emerald Rapids (one thread, the
/// `f32` split, `d_k = 128`, against 96 and 128 rows) 5–11% faster at N =
/// 512 and 1024 causal. Like every query tile, chosen without the thread
/// count.
#[cfg(feature = "half")]
pub(crate) const AMX_CAUSAL_QUERY_TILE: usize = 64;

/// Query rows per forward work item when a query tile streams at least
/// [`STREAMED_BYTES`] of packed keys and values: each key and value tile
/// is then read from beyond L2 for every query tile, and a taller tile
/// reads it for twice the rows. Measured on an Emerald Rapids Xeon (2 MiB
/// L2, one thread, H = 8): `d = 128`, N = 4096 +4% (causal +6%), N = 8192
/// +5% (causal +10%); `d = 64`, N = 8192 +3% (causal +5%); 240 and 288
/// rows gained nothing more bidirectional and lost causal.
pub(crate) const LONG_QUERY_TILE: usize = 192;
/// Bytes of packed keys and values a query row sees, on average, from
/// which [`LONG_QUERY_TILE`] pays: at 1 MiB (`d = 64`, N = 2048; causal
/// `d = 128`, N = 2048, whose rows see half the keys) the taller tile
/// measured level or up to 3% slower, at 2 MiB 1.4–1.9% faster. A shape
/// rule, the same on every CPU (not tuned on one with a smaller L2).
const STREAMED_BYTES: usize = 2 << 20;
/// Keys a query row must see, on average, for [`LONG_QUERY_TILE`]: every
/// call it was measured faster on sees 2048 or more, and a huge `d` alone
/// (a few keys of 2 MiB) gains nothing from it.
const LONG_TILE_MIN_KEYS: usize = 16 * KEY_TILE;

/// The forward's query tile for a call whose packed keys and values take
/// `packed_bytes` per element: chosen by the call's shape and options only
/// (never the thread count or CPU), so results stay bitwise identical for
/// any number of threads. A row's result does not depend on the tile
/// height either, up to the sign of a zero: rows are computed
/// independently, and a key tile a taller tile visits that the row sees
/// none of leaves its maximum and sum exact (`α = 1`, weights 0), though
/// adding its `+0` turns an accumulated `−0` into `+0`.
pub(crate) fn forward_query_tile<KV, Q>(call: &Call<'_, f32, KV, Q>, packed_bytes: usize) -> usize {
    let shape = call.shape;
    let keys = mean_visible_keys(call);
    let streamed = (shape.d_k + shape.d_v)
        .saturating_mul(packed_bytes)
        .saturating_mul(keys);
    if keys >= LONG_TILE_MIN_KEYS && streamed >= STREAMED_BYTES {
        LONG_QUERY_TILE
    } else if call.opts.causal.is_some() {
        CAUSAL_QUERY_TILE
    } else {
        QUERY_TILE
    }
}

/// The keys a query row sees, on average over the rows of the first batch
/// item: `len_kv` bidirectional, about half of them under a causal rule on
/// a square call (nearly all for the last few queries of many keys,
/// bottom-right aligned), at most a window's. One visible range a row:
/// cheap beside the row's products.
fn mean_visible_keys<KV, Q>(call: &Call<'_, f32, KV, Q>) -> usize {
    visible_scores(call)
        .checked_div(call.shape.len_q)
        .unwrap_or(0)
}

/// The scores a head of the first batch item computes that are not
/// masked by a causal rule, a window or key lengths: the sum of its rows'
/// visible ranges.
pub(crate) fn visible_scores<KV, Q>(call: &Call<'_, f32, KV, Q>) -> usize {
    if call.shape.batch == 0 {
        return 0;
    }
    (0..call.shape.len_q)
        .map(|i| call.visible_range(0, i).len())
        .sum()
}

/// What the fused forward reads queries as: `f32`, or a half call's
/// `bf16`/`f16`, widened as a query tile loads them.
pub(crate) trait Query: simd::Load + num_traits::Float {
    /// Whether every query in `q` is a `bf16` value exactly, so that the
    /// `bf16` products may take its bits as they are (`tile.rs` pairs them
    /// by their top halves): `bf16` queries always; `f32` ones when each
    /// one's low 16 bits are zero (a `bf16` `KvCache`'s queries, widened),
    /// never `f32` projections, which are never rounded.
    #[cfg_attr(not(feature = "half"), allow(dead_code))]
    fn all_bf16(q: &ArrayView4<'_, Self>) -> bool;

    /// Writes `row` as `bf16` pairs along `d_k` (`pairs.len() =
    /// ⌈row.len()/2⌉`, the first of each pair in its low half, an odd
    /// row's last pair padded with 0): the `bf16` prefill's queries, taken
    /// where [`all_bf16`](Self::all_bf16) held, so the bits are exact.
    #[cfg_attr(not(feature = "half"), allow(dead_code))]
    fn bf16_pairs(row: &[Self], pairs: &mut [u32]);

    /// The queries as `bf16` where they are stored so, for passes that
    /// read their bits (the `bf16` prefill's magnitude bound); `None` for
    /// other types.
    #[cfg(feature = "half")]
    fn as_bf16<'v>(q: &ArrayView4<'v, Self>) -> Option<ArrayView4<'v, half::bf16>>;

    /// A bound on the magnitudes of `x`: the largest `|x|`, or `+inf` when
    /// one is NaN or infinite ([`Kernel::max_abs`](simd::Kernel)). `bf16`
    /// reads it from the bits, 32 numbers an instruction.
    fn magnitude_bound<K: simd::Kernel>(kernel: K, x: &[Self]) -> f32 {
        kernel.max_abs(x)
    }
}
impl Query for f32 {
    fn bf16_pairs(row: &[f32], pairs: &mut [u32]) {
        tile::bf16_pairs(row, pairs);
    }

    #[cfg(feature = "half")]
    fn as_bf16<'v>(_: &ArrayView4<'v, f32>) -> Option<ArrayView4<'v, half::bf16>> {
        None
    }

    fn all_bf16(q: &ArrayView4<'_, f32>) -> bool {
        // One pass without an early exit: an OR of the bits vectorizes.
        let low_bits = |x: &f32| x.to_bits() & 0xffff;
        let any_low = match q.as_slice_memory_order() {
            Some(q) => q.iter().map(low_bits).fold(0, |a, b| a | b),
            None => q.iter().map(low_bits).fold(0, |a, b| a | b),
        };
        any_low == 0
    }
}
#[cfg(feature = "half")]
impl Query for half::bf16 {
    fn all_bf16(_: &ArrayView4<'_, half::bf16>) -> bool {
        true
    }

    fn bf16_pairs(row: &[half::bf16], pairs: &mut [u32]) {
        // A copy of the bits: on a little-endian CPU (every one with the
        // `bf16` products) the first `u16` of a `u32` is its low half.
        let halves: &mut [u16] = bytemuck::cast_slice_mut(pairs);
        if cfg!(target_endian = "little") {
            halves[..row.len()].copy_from_slice(bytemuck::cast_slice(row));
            halves[row.len()..].fill(0);
        } else {
            let widened: Vec<f32> = row.iter().map(|x| x.to_f32()).collect();
            tile::bf16_pairs(&widened, pairs);
        }
    }

    fn as_bf16<'v>(q: &ArrayView4<'v, half::bf16>) -> Option<ArrayView4<'v, half::bf16>> {
        Some(*q)
    }

    fn magnitude_bound<K: simd::Kernel>(_: K, x: &[half::bf16]) -> f32 {
        simd::bf16_magnitude_bound(x)
    }
}
#[cfg(feature = "half")]
impl Query for half::f16 {
    fn all_bf16(_: &ArrayView4<'_, half::f16>) -> bool {
        false
    }

    fn bf16_pairs(row: &[half::f16], pairs: &mut [u32]) {
        // Never called (`all_bf16` is false); rounded, to be a right
        // answer all the same.
        let rounded: Vec<f32> = row
            .iter()
            .map(|x| half::bf16::from_f32(x.to_f32()).to_f32())
            .collect();
        tile::bf16_pairs(&rounded, pairs);
    }

    fn as_bf16<'v>(_: &ArrayView4<'v, half::f16>) -> Option<ArrayView4<'v, half::bf16>> {
        None
    }
}

/// What the fused forward writes its output as: `f32`, or a half call's
/// `bf16`/`f16`, rounded (to nearest-even) from the `f32` result a row at
/// a time as a query tile finishes it, never through a whole `f32` copy.
pub(crate) trait Output: Copy + Send + Sync + 'static {
    /// How exact the softmax's weights must be for an output rounded to
    /// this type.
    const WEIGHT_PRECISION: WeightPrecision;
    /// Writes `x` rounded to this type into `y`, of the same length.
    fn store(x: &[f32], y: &mut [Self]);
    /// `x` rounded to this type.
    fn from_f32(x: f32) -> Self;
}
impl Output for f32 {
    const WEIGHT_PRECISION: WeightPrecision = WeightPrecision::Full;
    fn store(x: &[f32], y: &mut [f32]) {
        y.copy_from_slice(x);
    }
    fn from_f32(x: f32) -> f32 {
        x
    }
}
// The half types' impls are `element.rs`'s, beside their other
// conversions, with the same rounding by slice.

/// Keys per tile: a multiple of every kernel set's key panel.
pub(crate) const KEY_TILE: usize = 64;
/// Calls with at most this many query rows per head are decoding steps:
/// keys and values are read in place, once, rather than packed.
pub(crate) const DECODE_MAX_QUERIES: usize = 8;
/// Keys per work item when decoding: long caches are split into chunks of
/// this many keys whose partial results are merged. Fixed, so the result
/// does not depend on the thread count.
pub(crate) const DECODE_CHUNK: usize = 1024;

/// Attention on the fused path: `out` (the output's shape) and, when given,
/// each row's log-sum-exp. Keys and values are stored in `KV` (`f32`, or a
/// half call's or half `KvCache`'s `bf16`/`f16`) and queries in `Q`: a
/// decoding step reads half rows in place, widening each vector as it
/// loads it (half the bytes of an `f32` cache's step); a prefill widens
/// them as it packs them, a key tile at a time, and the queries a query
/// tile at a time.
///
/// # Errors
/// When the kernel set forced for this call cannot run on this CPU, or a
/// working buffer cannot be allocated.
pub(crate) fn forward<KV: simd::Load + num_traits::Float, Q: Query, O: Output>(
    call: &Call<'_, f32, KV, Q>,
    out: ArrayViewMut4<'_, O>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    let job = forward::Forward {
        call,
        out,
        log_sum_exp,
    };
    simd::with_kernel(simd::current_kernel_set()?, job)?
}

/// Attention on the fused path for a `bf16` call: keys and values read as
/// the caller's `bf16`, queries as they come (`bf16`, or `f32` from a
/// `KvCache`'s layer), widened a query tile at a time. Where
/// [`simd::bf16_dot_runs_on`] says so for the kernel set chosen (by the
/// CPU, `SDPA_KERNEL` or [`simd::with_kernel_set`]), the prefill packs
/// them as `bf16` pairs for AMX tiles or `vdpbf16ps` (`pairs.rs`) when the
/// queries are `bf16` values too ([`Query::all_bf16`]); else it is
/// [`forward`]. Decoding steps run the decode driver on the `bf16` rows
/// either way.
///
/// # Errors
/// As [`forward`].
#[cfg(feature = "half")]
pub(crate) fn forward_bf16<Q: Query, O: Output>(
    call: &Call<'_, f32, half::bf16, Q>,
    out: ArrayViewMut4<'_, O>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    let set = simd::current_kernel_set()?;
    match simd::pair_kernels(set, call.shape.d_k).filter(|_| Q::all_bf16(&call.q)) {
        Some(kernels) => {
            let job = pairs::Bf16Forward {
                call,
                out,
                log_sum_exp,
                kernels,
            };
            simd::with_kernel(set, job)?
        }
        None => forward(call, out, log_sum_exp),
    }
}

/// The backward pass on the fused path, into `gradients`.
///
/// # Errors
/// When the kernel set forced for this call cannot run on this CPU, or a
/// working buffer cannot be allocated.
pub(crate) fn backward(
    call: &BackwardCall<'_, f32>,
    gradients: GradientsViewMut<'_, f32>,
) -> Result<(), AttentionError> {
    let job = backward::Backward { call, gradients };
    simd::with_kernel(simd::current_kernel_set()?, job)?
}

#[cfg(all(test, feature = "half"))]
mod tests {
    use half::{bf16, f16};

    use super::Query;

    /// The pairs of `bf16` queries (their bits copied) are those of the
    /// same numbers in `f32` (their top halves), for even and odd rows;
    /// `f16` queries (never paired) round to the same.
    #[test]
    fn query_pairs_agree_across_types() {
        for d in [1usize, 2, 7, 64, 65] {
            let row: Vec<bf16> = (0..d)
                .map(|i| bf16::from_f32((i as f32 - 3.3) * 0.37))
                .collect();
            let widened: Vec<f32> = row.iter().map(|x| x.to_f32()).collect();
            let halves: Vec<f16> = widened.iter().map(|&x| f16::from_f32(x)).collect();
            let pairs = |write: &dyn Fn(&mut [u32])| {
                let mut pairs = vec![u32::MAX; d.div_ceil(2)];
                write(&mut pairs);
                pairs
            };
            let from_f32 = pairs(&|p| f32::bf16_pairs(&widened, p));
            assert_eq!(pairs(&|p| bf16::bf16_pairs(&row, p)), from_f32, "d {d}");
            assert_eq!(pairs(&|p| f16::bf16_pairs(&halves, p)), from_f32, "d {d}");
            if d % 2 == 1 {
                assert_eq!(from_f32[d / 2] >> 16, 0, "an odd row's padding");
            }
        }
    }
}

#[cfg(test)]
mod query_tile_tests {
    use ndarray::Array4;

    use super::{CAUSAL_QUERY_TILE, LONG_QUERY_TILE, QUERY_TILE, forward_query_tile};
    use crate::call::check;
    use crate::options::{AttentionOptions, CausalAlignment};

    /// The forward's query tile for `len_q` queries against `len_kv` keys
    /// of `d_k` and `d_v` (one head), packed in `f32`.
    fn tile(len_q: usize, len_kv: usize, d: (usize, usize), opts: &AttentionOptions<f32>) -> usize {
        let q = Array4::<f32>::zeros((1, 1, len_q, d.0));
        let k = Array4::<f32>::zeros((1, 1, len_kv, d.0));
        let v = Array4::<f32>::zeros((1, 1, len_kv, d.1));
        let (q, k, v) = (q.view(), k.view(), v.view());
        let call = check(&q, &k, &v, opts).expect("a valid call");
        forward_query_tile(&call, size_of::<f32>())
    }

    /// Tall tiles from 2 MiB of keys and values a row sees on average
    /// (half the keys of a square causal call, nearly all for a chunk of
    /// queries at the end of many keys, at most a window's), and only past
    /// a thousand keys.
    #[test]
    fn tall_query_tiles_where_a_row_sees_2_mib_of_keys_and_values() {
        let bidirectional = AttentionOptions::new();
        let causal = AttentionOptions::new().causal();
        let top_left = AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft);
        let window = AttentionOptions::new().window(256);
        let cases = [
            // 4096 keys of d = 64 + 64: 2 MiB.
            (4096, 4096, (64, 64), &bidirectional, LONG_QUERY_TILE),
            (4095, 4095, (64, 64), &bidirectional, QUERY_TILE),
            (4096, 4096, (64, 64), &causal, CAUSAL_QUERY_TILE),
            (4096, 4096, (128, 128), &causal, LONG_QUERY_TILE),
            (4096, 4096, (128, 128), &top_left, LONG_QUERY_TILE),
            (4094, 4094, (128, 128), &causal, CAUSAL_QUERY_TILE),
            // The last 256 queries of 4352 keys see 4097 to 4352 of them.
            (256, 4352, (64, 64), &causal, LONG_QUERY_TILE),
            (256, 4352, (64, 64), &top_left, CAUSAL_QUERY_TILE),
            // A window of 256 keys reads them from L2 for any length.
            (32768, 32768, (128, 128), &window, CAUSAL_QUERY_TILE),
            // The tests' shape (`fast_path.rs`): 4 MB, and 1953 keys on average.
            (200, 2053, (257, 255), &bidirectional, LONG_QUERY_TILE),
            (200, 2053, (257, 255), &causal, LONG_QUERY_TILE),
            // Huge rows, few keys.
            (64, 8, (65536, 65536), &bidirectional, QUERY_TILE),
        ];
        for (len_q, len_kv, d, opts, expected) in cases {
            let got = tile(len_q, len_kv, d, opts);
            assert_eq!(got, expected, "{len_q} × {len_kv}, d {d:?}, {opts:?}");
        }
    }
}
