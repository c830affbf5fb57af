//! The prefill of an `f32` call on AMX tiles: every query, key, value and
//! weight split into three `bf16` parts (`simd/split.rs`), both products
//! of every tile summed from the six partial products of order ≥ 2⁻¹⁶ on
//! `tdpbf16ps`. That is `f32` accuracy (0.5–1.07 times the error of an
//! `f32` FMA sum, measured), and on an Emerald Rapids Xeon, whose FMAs
//! peak at 247 GFLOP/s a core and share their two ports with the softmax,
//! it runs at up to 245 GFLOP/s at `d_k = 128` (275 at 256) where the FMA
//! prefill stays near 205 (`docs/PERFORMANCE.md`).
//!
//! Everything else, jobs, tiles, masks, modifiers, softmax, log-sum-exp
//! and sinks, is the `f32` prefill's (`forward.rs`, `tile.rs`): this file
//! is a [`TileSource`] with its packing, like `pairs.rs` for `bf16`.
//!
//! What a split cannot hold is computed in `f32` from the caller's rows,
//! element by element, so that results mean what the `f32` path's mean
//! (but where a score overflows: the queries carry the scale here, the
//! keys there):
//! - a query row (scaled) or a key with a NaN, an infinity, or a magnitude
//!   of [`split_bound`] or more (whose products might overflow where the
//!   `f32` path's would not, or whose `hi` part rounds past `bf16`'s
//!   range) has its scores computed so, a row or a key column at a time;
//! - a value row with a NaN, an infinity or a magnitude of
//!   [`UNSPLIT_VALUE`] or more is added in `f32`, skipping zero weights.
//!
//! Unsplit keys and value rows have zero parts, so the tiles add nothing
//! for them, and a tile's products never mix rows or keys, so no other
//! score's or output's bits depend on them.
//!
//! Which path a call takes ([`tiles_for`]) depends on the CPU, the kernel
//! set, `with_amx`, the keys' type, the head dims and how many scores a
//! head has unmasked (the shape and options), never on the data nor the
//! thread count.

use half::bf16;
use ndarray::{ArrayView2, ArrayViewMut3, ArrayViewMut4, CowArray, Ix2};

use super::forward::prefill_with;
use super::scratch::Scratch;
use super::tile::{TileQueries, TileSource};
use super::{
    AMX_CAUSAL_QUERY_TILE, KEY_TILE, LONG_QUERY_TILE, Output, QUERY_TILE, Query,
    forward_query_tile, visible_scores,
};
use crate::alloc::element_count;
use crate::call::{Call, head};
use crate::error::AttentionError;
use crate::simd::{Amx, Kernel, Load, PAIR_KEYS, amx_override};

const _: () = assert!(PAIR_KEYS == KEY_TILE, "a packed tile is a key tile");

/// Bytes of one number of the packed keys and values: three `bf16`.
const PACKED_BYTES: usize = 3 * size_of::<bf16>();

/// The magnitude from which a value is left out of the split and added in
/// `f32` instead: far enough below `bf16`'s largest finite number
/// (`≈ 2¹²⁸`) that its `hi` part never rounds to infinity.
const UNSPLIT_VALUE: f32 = 1.7014118e38; // 2¹²⁷

/// `f32` lanes of the AVX-512 set, the only one this path runs with.
const LANES: usize = 16;

/// The magnitude below which a scaled query's and a key's numbers split
/// safely: `d_k·T²` a quarter of `f32::MAX`, so that no partial sum of
/// the split's products, each at most `(1 + 2⁻⁸)²` times its exact
/// product, can overflow, nor can the `f32` path's sum of the same
/// products. (`T` is far below `bf16`'s largest finite number.)
pub(super) fn split_bound(d_k: usize) -> f32 {
    (f64::from(f32::MAX) / (4.0 * d_k as f64)).sqrt() as f32
}

/// The prefill on split tiles, with each `(batch, kv_head)` packed into
/// [`SplitKeys`]; the call's keys and values are `f32` (`KV::as_f32`), and
/// `d_k` a multiple of 32 ([`Amx::takes`]).
///
/// # Errors
/// When a buffer cannot be allocated.
pub(super) fn prefill<K: Kernel, KV: Load + num_traits::Float + Sync, Q: Query, O: Output>(
    kernel: K,
    amx: Amx,
    call: &Call<'_, f32, KV, Q>,
    out: ArrayViewMut4<'_, O>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    // Streamed keys and values: the long tile, as the FMA prefill (10%
    // faster than 64 rows at N = 4096 bidirectional, 6% causal). Else
    // whole blocks of 32 rows: 96 bidirectional, which is taller than the
    // causal tile because each block of 32 rows after the first has its
    // weights split while the block before it is on the tiles, two of
    // three so against one of two at 64 rows (measured, Emerald Rapids,
    // one thread, N = 512–2048: `d_k = 64` 2–4% faster, `d_k = 128` 0–4%;
    // causal 3–8% slower, the diagonal's waste).
    let query_tile = match forward_query_tile(call, PACKED_BYTES) {
        LONG_QUERY_TILE => LONG_QUERY_TILE,
        _ if call.opts.causal.is_some() => AMX_CAUSAL_QUERY_TILE,
        _ => QUERY_TILE,
    };
    prefill_with(kernel, call, query_tile, out, log_sum_exp, |b, kv_h| {
        SplitKeys::pack(amx, call, b, kv_h)
    })
}

/// The fewest unmasked scores per head ([`visible_scores`]) this prefill
/// takes by default at `d_k`, `None` below the smallest `d_k` it takes.
/// Measured on an Emerald Rapids Xeon (one thread, H = 8, against the FMA
/// prefill): at `d_k` 96 and 128, N = 256 (65 536 scores) 3–6% faster, N =
/// 256 causal (32 896) 1–3% slower, N = 384 causal (73 920) 4–6% faster;
/// at `d_k = 64`, N = 384 (147 456) level, 384 causal 4% slower, N = 512
/// (262 144) 4% faster, N = 1024 9–10%. Below that the split of each
/// head's keys and values (`len_kv·(d_k + d_v)` numbers) and the tiles'
/// fixed costs (a block's 4 output tiles loaded, stored and waited for,
/// paid per `d_k/32` steps of a sum) are not paid back; at `d_k = 32` they
/// never are. Only CPUs with AMX run it, so the constants are theirs.
fn min_scores(d_k: usize) -> Option<usize> {
    match d_k {
        ..64 => None,
        64..96 => Some(1 << 18),
        _ => Some(1 << 16),
    }
}

/// The AMX tiles for this call, if the prefill takes it: the AVX-512 set's
/// kernel (`K`), `f32` keys and values, `d_k` a multiple of 32, tiles the
/// CPU and OS allow and `with_amx` does not turn off; and, unless
/// `with_amx(true, ..)` forces the tiles, at least [`min_scores`] scores a
/// head. The cheap checks come first: the tiles are asked of the OS only
/// for a call that would use them.
pub(super) fn tiles_for<K: Kernel, KV: Load, Q>(call: &Call<'_, f32, KV, Q>) -> Option<Amx> {
    let forced = match amx_override() {
        Some(false) => return None,
        forced => forced == Some(true),
    };
    let shape = call.shape;
    let takes = K::LANES == LANES
        && Amx::takes(shape.d_k)
        && shape.len_kv > 0
        && KV::as_f32(head(&call.k, 0, 0)).is_some()
        && (forced || min_scores(shape.d_k).is_some_and(|min| visible_scores(call) >= min));
    takes.then(Amx::new).flatten()
}

/// One head's keys and values as three `bf16` parts each, in the packed
/// layouts of the `bf16` kernels, padded to whole key tiles with zeros.
struct SplitKeys<'a> {
    amx: Amx,
    /// Per part, per key tile `[d_pairs][KEY_TILE]`.
    keys: [Scratch<u32>; 3],
    d_pairs: usize,
    /// Per part, per key tile `[KEY_TILE/2][width]`.
    values: [Scratch<u32>; 3],
    /// `d_v` rounded up to whole vectors, as the query tile's output rows.
    width: usize,
    /// The head's keys in `f32`, for the scores the split cannot hold.
    f32_keys: CowArray<'a, f32, Ix2>,
    /// The keys the split cannot hold ([`split_bound`]), in order; their
    /// parts are zero.
    unsplit_keys: Vec<usize>,
    /// The head's values in `f32`, for the value rows the split cannot hold.
    f32_values: CowArray<'a, f32, Ix2>,
    /// The value rows the split cannot hold ([`UNSPLIT_VALUE`]), in order;
    /// their parts are zero.
    unsplit_values: Vec<usize>,
}

impl<'a> SplitKeys<'a> {
    /// Splits and packs the keys and values of `(b, kv_h)`.
    ///
    /// # Errors
    /// When the buffers are too large to address or cannot be allocated.
    fn pack<KV: Load, Q>(
        amx: Amx,
        call: &'a Call<'_, f32, KV, Q>,
        b: usize,
        kv_h: usize,
    ) -> Result<Self, AttentionError> {
        let shape = call.shape;
        let (d_k, d_v) = (shape.d_k, shape.d_v);
        let tiles = shape.len_kv.div_ceil(KEY_TILE);
        let padded = tiles * KEY_TILE;
        let d_pairs = d_k.div_ceil(2);
        let width = d_v.div_ceil(LANES) * LANES;
        let what = "split keys and values";
        let key_len = element_count::<u32>(what, &[padded, d_pairs])?;
        let value_len = element_count::<u32>(what, &[padded / 2, width])?;
        let part = |len| Scratch::<u32>::for_writing(what, len);
        let keys = [part(key_len)?, part(key_len)?, part(key_len)?];
        let values = [part(value_len)?, part(value_len)?, part(value_len)?];
        let (f32_keys, f32_values) = (f32_rows(&call.k, b, kv_h), f32_rows(&call.v, b, kv_h));
        let mut source = Self {
            amx,
            keys,
            d_pairs,
            values,
            width,
            f32_keys,
            unsplit_keys: Vec::new(),
            f32_values,
            unsplit_values: Vec::new(),
        };
        let bound = split_bound(d_k);
        let keys = source.f32_keys.as_slice().expect("standard layout");
        let values = source.f32_values.as_slice().expect("standard layout");
        for t in 0..tiles {
            let rows = t * KEY_TILE..((t + 1) * KEY_TILE).min(shape.len_kv);
            // `d_k` is a positive multiple of 32 (`tiles_for`).
            let mut tile = source
                .keys
                .each_mut()
                .map(|part| &mut part[t * KEY_TILE * d_pairs..][..KEY_TILE * d_pairs]);
            let x = &keys[rows.start * d_k..rows.end * d_k];
            let beyond =
                amx.split_pack_keys(x, d_k, bound, tile.each_mut().map(|part| &mut **part));
            for r in set_bits(beyond) {
                source.unsplit_keys.push(rows.start + r);
                for part in &mut tile {
                    part.iter_mut()
                        .skip(r)
                        .step_by(KEY_TILE)
                        .for_each(|pair| *pair = 0);
                }
            }
            if d_v > 0 {
                let len = KEY_TILE / 2 * width;
                let mut tile = source
                    .values
                    .each_mut()
                    .map(|part| &mut part[t * KEY_TILE / 2 * width..][..len]);
                let x = &values[rows.start * d_v..rows.end * d_v];
                let split = tile.each_mut().map(|part| &mut **part);
                let beyond = amx.split_pack_values(x, d_v, width, UNSPLIT_VALUE, split);
                for r in set_bits(beyond) {
                    source.unsplit_values.push(rows.start + r);
                    // Row r is the low half of pair row r/2 if even.
                    let keep = if r % 2 == 0 { 0xffff_0000 } else { 0x0000_ffff };
                    for part in &mut tile {
                        part[r / 2 * width..][..width]
                            .iter_mut()
                            .for_each(|pair| *pair &= keep);
                    }
                }
            }
        }
        Ok(source)
    }

    /// The packed parts of the key tile starting at `j0`.
    fn key_tile(&self, j0: usize) -> [&[u32]; 3] {
        let len = KEY_TILE * self.d_pairs;
        [0, 1, 2].map(|a| &self.keys[a][j0 * self.d_pairs..][..len])
    }
}

/// The `[len][d]` rows of `x[b, h]` as one block of `f32`: the caller's
/// where they are one already.
fn f32_rows<'a, KV: Load>(
    x: &'a ndarray::ArrayView4<'_, KV>,
    b: usize,
    h: usize,
) -> CowArray<'a, f32, Ix2> {
    let rows = KV::as_f32(head(x, b, h)).expect("`takes` checked the type");
    if rows.is_standard_layout() {
        CowArray::from(rows)
    } else {
        CowArray::from(rows.as_standard_layout().into_owned())
    }
}

/// The indices of the set bits of `bits`, lowest first.
fn set_bits(mut bits: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (bits != 0).then(|| {
            let at = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            at
        })
    })
}

/// A split buffer holds its three parts (`hi`, `mid`, `lo`) one after
/// another, each a third of it.
fn thirds<T>(parts: &[T]) -> [&[T]; 3] {
    debug_assert!(parts.len().is_multiple_of(3));
    let (hi, rest) = parts.split_at(parts.len() / 3);
    let (mid, lo) = rest.split_at(hi.len());
    [hi, mid, lo]
}

/// [`thirds`], to write.
fn thirds_mut<T>(parts: &mut [T]) -> [&mut [T]; 3] {
    debug_assert!(parts.len().is_multiple_of(3));
    let (hi, rest) = parts.split_at_mut(parts.len() / 3);
    let (mid, lo) = rest.split_at_mut(hi.len());
    [hi, mid, lo]
}

/// `Σ q[x]·k[x]` in `f32`, for the scores the split cannot hold.
fn f32_score(q: &[f32], k: &[f32]) -> f32 {
    q.iter().zip(k).fold(0.0, |sum, (q, k)| q.mul_add(*k, sum))
}

impl TileSource for SplitKeys<'_> {
    const SPLIT_QUERIES: bool = true;

    fn computed_rows<K: Kernel>(rows: usize) -> usize {
        Amx::computed_rows(rows)
    }

    /// The keys the split holds are below [`split_bound`]; any other
    /// makes the bound unknown.
    fn max_abs_key(&self) -> f32 {
        if self.unsplit_keys.is_empty() {
            split_bound(self.f32_keys.ncols())
        } else {
            f32::INFINITY
        }
    }

    fn split_queries(&self, q: &[f32], d_k: usize, parts: &mut [u32], unsplit: &mut [bool]) {
        let bound = split_bound(d_k);
        let d_pairs = d_k / 2;
        let [hi, mid, lo] = thirds_mut(parts);
        for (r, (row, flag)) in q.chunks_exact(d_k).zip(unsplit.iter_mut()).enumerate() {
            let at = r * d_pairs..(r + 1) * d_pairs;
            *flag = self.amx.split_pairs(
                row,
                bound,
                [&mut hi[at.clone()], &mut mid[at.clone()], &mut lo[at]],
            );
        }
    }

    fn tile_scores<K: Kernel>(&self, _: K, q: &TileQueries<'_>, j0: usize, scores: &mut [f32]) {
        let d_k = q.d_k;
        let rows = scores.len() / KEY_TILE;
        let q_parts = thirds(q.split).map(|part| &part[..rows * self.d_pairs]);
        // The queries carry the scale.
        self.amx.split_scores(
            q_parts,
            self.d_pairs,
            self.key_tile(j0),
            1.0,
            scores,
            KEY_TILE,
        );
        // What the split cannot hold, in `f32`: rows, then key columns.
        let keys = self.f32_keys.as_slice().expect("standard layout");
        let len_kv = self.f32_keys.nrows();
        let key = |j: usize| (j < len_kv).then(|| &keys[j * d_k..(j + 1) * d_k]);
        for r in (0..rows).filter(|&r| q.unsplit[r]) {
            let row = &q.rows[r * d_k..(r + 1) * d_k];
            for (j, score) in (j0..).zip(&mut scores[r * KEY_TILE..(r + 1) * KEY_TILE]) {
                *score = key(j).map_or(0.0, |k| f32_score(row, k));
            }
        }
        let first = self.unsplit_keys.partition_point(|&j| j < j0);
        for &j in self.unsplit_keys[first..]
            .iter()
            .take_while(|&&j| j < j0 + KEY_TILE)
        {
            let k = key(j).expect("a real key");
            for (r, row) in q.rows.chunks_exact(d_k).take(rows).enumerate() {
                scores[r * KEY_TILE + j - j0] = f32_score(row, k);
            }
        }
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
        let p_rows = p;
        let p = p.as_slice().expect("a query tile's weights are one block");
        let len = KEY_TILE / 2 * self.width;
        let tile = [0, 1, 2].map(|a| &self.values[a][j0 / 2 * self.width..][..len]);
        self.amx
            .split_accumulate_values(p, KEY_TILE, tile, width, alpha, o);
        // The rows the split cannot hold, in `f32`, skipping zero weights
        // so that a NaN or infinity no row sees never reaches an output.
        let d_v = self.f32_values.ncols();
        let values = self.f32_values.as_slice().expect("standard layout");
        let first = self.unsplit_values.partition_point(|&j| j < j0);
        for &j in self.unsplit_values[first..]
            .iter()
            .take_while(|&&j| j < j0 + KEY_TILE)
        {
            let value = &values[j * d_v..(j + 1) * d_v];
            for (weight, o) in p_rows.column(j - j0).iter().zip(o.chunks_exact_mut(width)) {
                if *weight != 0.0 {
                    for (o, v) in o.iter_mut().zip(value) {
                        *o = weight.mul_add(*v, *o);
                    }
                }
            }
        }
    }

    fn finish_query_tile(&self) {
        self.amx.release();
    }
}
