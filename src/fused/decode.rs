//! The decode driver: one or a few query rows per head against many keys,
//! a bandwidth-bound regime. Keys and values are read in place, once per
//! key/value head (the rows of the query heads that share it stacked in
//! one tile), in chunks of `DECODE_CHUNK` keys that run in parallel; each
//! chunk's partial `(O, log-sum-exp)` is merged in chunk order, so the
//! result does not depend on the thread count.

use ndarray::{Array1, Array2, ArrayView2, ArrayView4, ArrayViewMut3, ArrayViewMut4, Axis, s};

use super::tile::{KeySource, QueryTile, TilePosition};
use super::{DECODE_CHUNK, DECODE_MAX_QUERIES, KEY_TILE, Output, Query};
use crate::alloc::{element_count, try_with_capacity, try_zeros};
use crate::call::{Call, head, head_mut};
use crate::error::AttentionError;
use crate::modifiers::apply_sink;
use crate::parallel::map_with;
use crate::partial::merge_row;
use crate::simd::{Kernel, Load, ValueRows, WeightPrecision};
use num_traits::Float;

/// Whether the call is a decoding step whose keys and values the kernels
/// can read in place: few queries, rows contiguous, and head dims that are
/// whole vectors (so no row is read past its end).
pub(super) fn reads_keys_in_place<K: Kernel, KV, Q>(call: &Call<'_, f32, KV, Q>) -> bool {
    fn contiguous_rows<KV>(x: &ArrayView4<'_, KV>) -> bool {
        x.shape()[3] <= 1 || x.strides()[3] == 1
    }
    let shape = call.shape;
    shape.len_q <= DECODE_MAX_QUERIES
        && shape.d_k.is_multiple_of(K::LANES)
        && shape.d_v.is_multiple_of(K::LANES)
        && contiguous_rows(&call.k)
        && contiguous_rows(&call.v)
}

/// Runs a decoding step (see the module header) on keys and values read
/// in place: `f32`, or `bf16`/`f16` (a half-precision `KvCache`), which the
/// kernels widen as they load them, so the step reads the cache's own
/// bytes once, half as many as an `f32` cache's.
///
/// # Errors
/// When a tile or partial-result buffer cannot be allocated.
pub(super) fn decode<K: Kernel, KV: Load + Float, Q: Query, O: Output>(
    kernel: K,
    call: &Call<'_, f32, KV, Q>,
    mut out: ArrayViewMut4<'_, O>,
    mut log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    let shape = call.shape;
    let group = shape.group();
    let chunks = shape.len_kv.div_ceil(DECODE_CHUNK).max(1);
    // Broadcast keys can make the list longer than memory allows.
    let what = "the decode work list";
    let count =
        element_count::<(usize, usize, usize)>(what, &[shape.batch, shape.kv_heads, chunks])?;
    let mut jobs = try_with_capacity(what, count)?;
    jobs.extend((0..shape.batch).flat_map(|b| {
        (0..shape.kv_heads).flat_map(move |kv_h| (0..chunks).map(move |c| (b, kv_h, c)))
    }));
    // The group's query heads share the chunk's keys and values: their
    // rows are stacked in one tile, so each key and value row is loaded
    // once for all of them (a grouped step read them once per head, and
    // ran at 30–36% of the read rate on Zen 4, bound by per-row work).
    let rows = group * shape.len_q;
    let partials = map_with(
        jobs,
        || QueryTile::new::<K, KeyRows<'_, KV>>(&shape, rows),
        |tile, (b, kv_h, c)| {
            let tile = tile.as_mut().map_err(|error| error.clone())?;
            let source = KeyRows {
                k: head(&call.k, b, kv_h),
                v: head(&call.v, b, kv_h),
            };
            let keys = c * DECODE_CHUNK..((c + 1) * DECODE_CHUNK).min(shape.len_kv);
            let at = TilePosition {
                b,
                h: kv_h * group,
                i0: 0,
                rows,
                heads: group,
            };
            // The partials stay `f32` until they are merged.
            let result = WeightPrecision::Full;
            tile.attend(kernel, call, &at, &source, keys.clone(), result);
            let mut out: Array2<f32> = try_zeros("a decode partial", (rows, shape.d_v))?;
            let mut lse = Array1::zeros(rows);
            let (out_view, lse_view) = (&mut out.view_mut(), Some(lse.view_mut()));
            // The sink joins once, after the chunks merge.
            tile.write_output(kernel, call, &at, keys, out_view, lse_view, None);
            // One partial per query head of the group.
            let head_rows = |g: usize| g * shape.len_q..(g + 1) * shape.len_q;
            Ok((0..group)
                .map(|g| {
                    (
                        out.slice(s![head_rows(g), ..]).to_owned(),
                        lse.slice(s![head_rows(g)]).to_owned(),
                    )
                })
                .collect::<Vec<_>>())
        },
    );
    let partials = partials.into_iter().collect::<Result<Vec<_>, _>>()?;
    // Jobs came out in (b, kv_h, chunk) order: merge each head's chunks.
    for (job, chunk_heads) in partials.chunks(chunks).enumerate() {
        let (b, kv_h) = (job / shape.kv_heads, job % shape.kv_heads);
        for g in 0..group {
            let h = kv_h * group + g;
            let (mut merged, mut merged_lse) = chunk_heads[0][g].clone();
            for later in &chunk_heads[1..] {
                let (other, other_lse) = &later[g];
                for i in 0..shape.len_q {
                    merge_row(
                        merged.row_mut(i),
                        &mut merged_lse[i],
                        other.row(i).iter().copied(),
                        other_lse[i],
                    );
                }
            }
            if let Some(sink) = call.sink(h) {
                for (row, lse) in merged.rows_mut().into_iter().zip(merged_lse.iter_mut()) {
                    apply_sink(row, lse, sink);
                }
            }
            ndarray::Zip::from(head_mut(&mut out, b, h))
                .and(&merged)
                .for_each(|out, &x| *out = O::from_f32(x));
            if let Some(log_sum_exp) = log_sum_exp.as_mut() {
                log_sum_exp
                    .index_axis_mut(Axis(0), b)
                    .index_axis_mut(Axis(0), h)
                    .assign(&merged_lse);
            }
        }
    }
    Ok(())
}

/// One head's `k` `[len_kv, d_k]` and `v` `[len_kv, d_v]`, read in place
/// from contiguous rows.
struct KeyRows<'p, KV> {
    k: ArrayView2<'p, KV>,
    v: ArrayView2<'p, KV>,
}

impl<KV> KeyRows<'_, KV> {
    /// The keys of the tile starting at `j0`: a whole tile but at the end.
    fn tile(&self, j0: usize) -> std::ops::Range<usize> {
        j0..(j0 + KEY_TILE).min(self.k.nrows())
    }
}

impl<KV: Load + Float> KeySource for KeyRows<'_, KV> {
    const VALUE_ROWS: ValueRows = ValueRows::InPlace;
    type Value = KV;

    /// Reading keys in place works on the real rows only.
    fn computed_rows<K: Kernel>(rows: usize) -> usize {
        rows
    }

    fn scores<K: Kernel>(&self, kernel: K, q: &[f32], d_k: usize, j0: usize, scores: &mut [f32]) {
        let k_tile = self.k.slice(s![self.tile(j0), ..]);
        kernel.row_scores(q, d_k, k_tile, scores, KEY_TILE);
    }

    /// Unknown without reading every key again, which would double what
    /// decoding reads: every tile's scores are checked instead.
    fn max_abs_key(&self) -> f32 {
        f32::INFINITY
    }

    /// The values are scanned for non-finite entries only when a weight is
    /// 0: only a weight of exactly 0 (masked or underflowed) can meet a
    /// non-finite value as `0·NaN`, and decoding over unmasked keys seldom
    /// has one.
    fn values(&self, j0: usize, p: ArrayView2<'_, f32>) -> (ArrayView2<'_, KV>, bool) {
        let values = self.v.slice(s![self.tile(j0), ..]);
        let keys = values.nrows();
        // The tile's weights are rows of one buffer: slices, not ndarray's
        // element iterator (3–6% of a decode step in cache).
        let zero_weight = p.rows().into_iter().any(|row| match row.as_slice() {
            Some(row) => row[..keys].iter().fold(false, |zero, &w| zero | (w == 0.0)),
            None => row.iter().take(keys).any(|&w| w == 0.0),
        });
        let nonfinite = zero_weight && !values.iter().all(|x| x.is_finite());
        (values, nonfinite)
    }
}
