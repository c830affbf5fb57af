//! One query tile against a run of key tiles: the online softmax of the
//! forward (`QueryTile::attend`, written once for every key source), and
//! the pieces the forward and backward share per score tile: which key
//! tiles a query tile sees (`TileSpan`), the bias and the element-wise
//! mask.

use std::ops::Range;

use ndarray::{ArrayView2, ArrayViewMut1, ArrayViewMut2, s};
use num_traits::Float;

use super::pack::{scaled_row, scaled_rows};
use super::scratch::Scratch;
use super::{KEY_TILE, Output, Query};
use crate::alloc::{element_count, try_filled};
use crate::call::{AttentionShape, Call};
use crate::error::AttentionError;
use crate::mask::{biased, broadcast};
use crate::modifiers::apply_sink;
use crate::simd::{Kernel, Load, SoftmaxRows, ValueRows, WeightPrecision, ZeroWeights};

/// Where a query tile sits: batch item, head, first row and row count;
/// and how many consecutive query heads it stacks, `rows / heads` rows
/// each (the heads of a group when decoding, so that each key and value
/// is loaded once for all of them), 1 elsewhere.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TilePosition {
    pub(crate) b: usize,
    pub(crate) h: usize,
    pub(crate) i0: usize,
    pub(crate) rows: usize,
    pub(crate) heads: usize,
}

impl TilePosition {
    /// Tile row `r`'s query head and query position.
    pub(crate) fn row(&self, r: usize) -> (usize, usize) {
        let per_head = self.rows / self.heads;
        (self.h + r / per_head, self.i0 + r % per_head)
    }
}

/// The visible key ranges of a query tile's rows, summed up: the key tiles
/// any row can see, and the span every row sees (tiles inside it need no
/// element-wise mask).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileSpan {
    pub(crate) min_start: usize,
    pub(crate) max_start: usize,
    pub(crate) min_end: usize,
    pub(crate) max_end: usize,
}

impl TileSpan {
    pub(crate) fn of<KV, Q>(at: &TilePosition, call: &Call<'_, f32, KV, Q>) -> Self {
        let mut span = TileSpan {
            min_start: usize::MAX,
            max_start: 0,
            min_end: usize::MAX,
            max_end: 0,
        };
        for r in 0..at.rows {
            let range = call.visible_range(at.b, at.row(r).1);
            span.min_start = span.min_start.min(range.start);
            span.max_start = span.max_start.max(range.start);
            span.min_end = span.min_end.min(range.end);
            span.max_end = span.max_end.max(range.end);
        }
        span
    }

    /// Whether some row sees some key of the tile starting at `j0`.
    pub(crate) fn sees_tile(&self, j0: usize) -> bool {
        self.max_end > j0 && self.min_start < j0 + KEY_TILE
    }

    /// Whether the key tile at `j0` needs the element-wise mask: a keep
    /// mask, or a row's range (or the end of the keys) cutting through it.
    pub(crate) fn needs_mask<KV, Q>(&self, j0: usize, call: &Call<'_, f32, KV, Q>) -> bool {
        call.opts.keep_mask.is_some() || j0 + KEY_TILE > self.min_end || j0 < self.max_start
    }
}

/// Makes NaN the scores (row stride `KEY_TILE`) of the tile's real rows
/// and keys whose product overflowed ([`Call::mark_overflowed_scores`]).
/// Finite scores, the common case even when a bound said they might not
/// be, cost one pass.
fn mark_overflowed_scores<KV: Float, Q: Float>(
    scores: &mut [f32],
    at: &TilePosition,
    j0: usize,
    call: &Call<'_, f32, KV, Q>,
) {
    let keys = KEY_TILE.min(call.shape.len_kv - j0);
    for (r, row) in scores.chunks_exact_mut(KEY_TILE).take(at.rows).enumerate() {
        let row = &mut row[..keys];
        // Not `all`: without an early exit the check vectorizes.
        if !row.iter().fold(true, |finite, x| finite & x.is_finite()) {
            let (h, i) = at.row(r);
            call.mark_overflowed_scores(at.b, h, i, j0, row.into());
        }
    }
}

/// Adds the bias, if any, to the scores (row stride `KEY_TILE`) of the
/// tile's real rows and keys.
pub(crate) fn add_bias<KV, Q>(
    scores: &mut [f32],
    at: &TilePosition,
    j0: usize,
    call: &Call<'_, f32, KV, Q>,
) {
    if call.opts.bias.is_none() {
        return;
    }
    let j1 = (j0 + KEY_TILE).min(call.shape.len_kv);
    let offset = call.key_offset();
    for r in 0..at.rows {
        let (h, i) = at.row(r);
        let Some(bias_row) = call.bias_row(at.b, h, i) else {
            return;
        };
        let scores = &mut scores[r * KEY_TILE..][..j1 - j0];
        if bias_row.len() == 1 {
            let bias = bias_row[0];
            scores
                .iter_mut()
                .for_each(|score| *score = biased(*score, bias));
            continue;
        }
        let bias_row = bias_row.slice_move(s![offset + j0..offset + j1]);
        match bias_row.as_slice() {
            Some(bias) => {
                for (score, &bias) in scores.iter_mut().zip(bias) {
                    *score = biased(*score, bias);
                }
            }
            None => {
                for (score, &bias) in scores.iter_mut().zip(&bias_row) {
                    *score = biased(*score, bias);
                }
            }
        }
    }
}

/// `0, 1, …, KEY_TILE − 1` as `f32`: a key's column in its tile, for
/// ALiBi's distances. A table, not `c as f32`: x86 has no packed
/// conversion from `usize` below AVX-512, and with it the loop converted
/// one column at a time (7 instructions a score instead of under 2).
const KEY_COLUMNS: [f32; KEY_TILE] = {
    let mut columns = [0.0; KEY_TILE];
    let mut c = 0;
    while c < KEY_TILE {
        columns[c] = c as f32;
        c += 1;
    }
    columns
};

/// Adds ALiBi's `slope·(j − p_i)`, if the call has ALiBi, to the scores
/// (row stride `KEY_TILE`) of the tile's real rows and keys. Distances are
/// exact in `f32` below 2²⁴ positions.
pub(crate) fn add_alibi<KV, Q>(
    scores: &mut [f32],
    at: &TilePosition,
    j0: usize,
    call: &Call<'_, f32, KV, Q>,
) {
    if call.opts.alibi.is_none() {
        return;
    }
    let keys = KEY_TILE.min(call.shape.len_kv - j0);
    for r in 0..at.rows {
        let (h, i) = at.row(r);
        let Some(alibi) = call.alibi(h, i) else {
            return;
        };
        let (slope, distance_0) = (alibi.slope, (alibi.key_0_distance + j0 as i64) as f32);
        let scores = &mut scores[r * KEY_TILE..][..keys];
        for (score, &column) in scores.iter_mut().zip(&KEY_COLUMNS) {
            *score += slope * (distance_0 + column);
        }
    }
}

/// Sets the scores (row stride `KEY_TILE`) of keys a row may not see, and
/// of padding keys, to `−inf`.
pub(crate) fn mask<KV, Q>(
    scores: &mut [f32],
    at: &TilePosition,
    j0: usize,
    call: &Call<'_, f32, KV, Q>,
) {
    for r in 0..at.rows {
        let (h, i) = at.row(r);
        let visible = call.visible_keys(at.b, h, i);
        let scores = &mut scores[r * KEY_TILE..][..KEY_TILE];
        // The visible range as columns of the tile: what lies outside it
        // (including padding keys past len_kv) is filled whole.
        let start = visible.start.saturating_sub(j0).min(KEY_TILE);
        let end = visible.end.saturating_sub(j0).clamp(start, KEY_TILE);
        scores[..start].fill(f32::NEG_INFINITY);
        scores[end..].fill(f32::NEG_INFINITY);
        if let Some(keep) = &visible.keep {
            for (c, score) in scores.iter_mut().enumerate().take(end).skip(start) {
                if !keep[broadcast(keep.len(), visible.key_offset + j0 + c)] {
                    *score = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Where a query tile's key and value tiles come from: one head packed for
/// the register-tiled kernels (prefill, `forward.rs`), or its rows read in
/// place (decode, `decode.rs`). The online softmax is the same for both.
pub(crate) trait KeySource {
    /// Where [`values`](Self::values) come from: a packed tile (the
    /// default), or rows read in place, which `P·V` prefetches.
    const VALUE_ROWS: ValueRows = ValueRows::Packed;

    /// The element type of the value rows: `f32`, or half precision that
    /// the `P·V` kernel widens as it loads it.
    type Value: Load;

    /// Whether the keys carry the call's scale ([`TileSource::SCALED_KEYS`]).
    const SCALED_KEYS: bool = false;

    /// Rows the scores kernel computes for a tile of `rows` real rows.
    fn computed_rows<K: Kernel>(rows: usize) -> usize;

    /// `S = q·K_tᵀ` for the key tile starting at `j0`, into `scores`
    /// (row stride `KEY_TILE`); `q` holds the computed rows, `d_k` each.
    fn scores<K: Kernel>(&self, kernel: K, q: &[f32], d_k: usize, j0: usize, scores: &mut [f32]);

    /// The largest `|k|` of the source's keys (NaN ignored), or `+inf` when
    /// not known.
    fn max_abs_key(&self) -> f32;

    /// The value rows of the key tile starting at `j0` (whole tiles but at
    /// the end of a source read in place), and whether `P·V` must skip the
    /// zero weights of `p` (the tile's weights) because a value row is not
    /// finite: a zero weight, masked or underflowed, contributes exactly
    /// nothing, never `0·NaN`.
    fn values(&self, j0: usize, p: ArrayView2<'_, f32>) -> (ArrayView2<'_, Self::Value>, bool);
}

/// A query tile's queries as the score kernels take them.
pub(crate) struct TileQueries<'q> {
    /// `scale·q`, `[computed rows][d_k]`: unscaled `q` for a source with
    /// [`TileSource::SCALED_KEYS`] (the caller's rows, where they lie, when
    /// they can be), or when the source takes [`pairs`](Self::pairs)
    /// instead.
    pub(crate) rows: &'q [f32],
    /// Unscaled `q` rounded to `bf16` pairs along `d_k`, `[computed
    /// rows][⌈d_k/2⌉]`, filled only for a source with
    /// [`TileSource::PAIRED_QUERIES`].
    #[cfg_attr(not(feature = "half"), allow(dead_code))]
    pub(crate) pairs: &'q [u32],
    /// `rows` split into three `bf16` parts, each `[max rows][d_k/2]`
    /// pairs, one after the other, filled only for a source with
    /// [`TileSource::SPLIT_QUERIES`] (by its
    /// [`split_queries`](TileSource::split_queries)).
    #[cfg_attr(not(all(target_arch = "x86_64", feature = "half")), allow(dead_code))]
    pub(crate) split: &'q [u32],
    /// Per computed row, whether its split cannot be used (see
    /// [`TileSource::split_queries`]).
    #[cfg_attr(not(all(target_arch = "x86_64", feature = "half")), allow(dead_code))]
    pub(crate) unsplit: &'q [bool],
    pub(crate) d_k: usize,
    /// The factor a source that applies the scale to the scores applies:
    /// the call's scale, or 1 where the softmax applies it.
    #[cfg_attr(not(feature = "half"), allow(dead_code))]
    pub(crate) scale: f32,
}

/// What [`QueryTile::attend`] runs a query tile against: the two products
/// of each key tile, on whatever layout the source keeps. Every
/// [`KeySource`] (`f32` keys and values, packed or in place) is one; the
/// `bf16` source of `pairs.rs` implements it directly, with its own
/// kernels for both products. Masks, modifiers and the softmax stay in
/// `attend`, shared by all.
pub(crate) trait TileSource {
    /// Whether the scores read [`TileQueries::pairs`], unscaled `q` in
    /// `bf16` pairs, and apply the scale to the `f32` scores themselves;
    /// else they read the scaled rows.
    const PAIRED_QUERIES: bool = false;

    /// Whether the scores read [`TileQueries::split`] (and the scaled
    /// `rows`, where a row is unsplit), which the source fills from the
    /// scaled rows with [`split_queries`](Self::split_queries).
    const SPLIT_QUERIES: bool = false;

    /// Whether the source's keys carry the call's scale, so that the
    /// scores kernel reads unscaled queries: `scale·q·kᵀ` as `q·(scale·k)ᵀ`,
    /// the scale applied once per key where the keys are copied anyway
    /// (packed), and no query copied where the rows can be read in place.
    const SCALED_KEYS: bool = false;

    /// How exact the softmax's weights must be for
    /// [`tile_values`](Self::tile_values): `Half` where it rounds them to
    /// `bf16`.
    const WEIGHT_PRECISION: WeightPrecision = WeightPrecision::Full;

    /// Rows the scores kernel computes for a tile of `rows` real rows.
    fn computed_rows<K: Kernel>(rows: usize) -> usize;

    /// A bound on the magnitude of the source's keys (NaN ignored), or
    /// `+inf` when not known.
    fn max_abs_key(&self) -> f32;

    /// `S = scale·q·K_tᵀ` for the key tile starting at `j0`, into `scores`
    /// (row stride `KEY_TILE`, the computed rows).
    fn tile_scores<K: Kernel>(&self, kernel: K, q: &TileQueries<'_>, j0: usize, scores: &mut [f32]);

    /// `o ← alpha·o + p·V_t` for the key tile starting at `j0`, with `p`
    /// its weights (the computed rows) and `o` rows of `width`. A zero
    /// weight contributes exactly nothing, never `0·NaN`.
    fn tile_values<K: Kernel>(
        &self,
        kernel: K,
        j0: usize,
        p: ArrayView2<'_, f32>,
        alpha: &[f32],
        o: &mut [f32],
        width: usize,
    );

    /// For a source with [`SPLIT_QUERIES`](Self::SPLIT_QUERIES): splits
    /// the scaled query rows `q` (`[computed rows][d_k]`) into `parts` (as
    /// [`TileQueries::split`]), and sets `unsplit[r]` where row `r`'s
    /// split cannot be used. Other sources are never asked.
    fn split_queries(&self, q: &[f32], d_k: usize, parts: &mut [u32], unsplit: &mut [bool]) {
        let _ = (q, d_k, parts, unsplit);
    }

    /// Called on the thread that ran a query tile when it is done with
    /// its key tiles: for kernels that hold per-thread state (AMX tiles).
    fn finish_query_tile(&self) {}
}

impl<S: KeySource> TileSource for S {
    const SCALED_KEYS: bool = S::SCALED_KEYS;

    fn computed_rows<K: Kernel>(rows: usize) -> usize {
        S::computed_rows::<K>(rows)
    }

    fn max_abs_key(&self) -> f32 {
        KeySource::max_abs_key(self)
    }

    fn tile_scores<K: Kernel>(
        &self,
        kernel: K,
        q: &TileQueries<'_>,
        j0: usize,
        scores: &mut [f32],
    ) {
        self.scores(kernel, q.rows, q.d_k, j0, scores);
    }

    fn tile_values<K: Kernel>(
        &self,
        kernel: K,
        j0: usize,
        p: ArrayView2<'_, f32>,
        alpha: &[f32],
        o: &mut [f32],
        width: usize,
    ) {
        let (values, nonfinite) = self.values(j0, p);
        let zero_weights = if nonfinite {
            ZeroWeights::Skip
        } else {
            ZeroWeights::Multiply
        };
        kernel.accumulate_values(p, values, width, alpha, o, zero_weights, S::VALUE_ROWS);
    }
}

/// The buffers of one query tile, reused from tile to tile.
pub(crate) struct QueryTile {
    /// Scaled query rows `[computed rows][d_k]` (unscaled for a source
    /// with paired queries).
    q: Scratch,
    /// The unscaled query rows in `bf16` pairs, `[computed rows][⌈d_k/2⌉]`,
    /// for a source with paired queries; else empty.
    q_pairs: Scratch<u32>,
    /// The scaled query rows split into three `bf16` parts, for a source
    /// with split queries; else empty.
    q_split: Scratch<u32>,
    /// Per computed row, whether its split cannot be used; empty unless
    /// the source splits queries.
    unsplit: Vec<bool>,
    /// Scores, then weights, `[computed rows][KEY_TILE]`.
    scores: Scratch,
    /// Unnormalised output `[computed rows][value_width]`.
    o: Scratch,
    /// One output row, finished in `f32` before it is stored.
    row: Scratch,
    /// Running row max `m`, running sum `ℓ`, and this step's rescale `α`.
    max: Scratch,
    sum: Scratch,
    alpha: Scratch,
    value_width: usize,
    /// The largest `|x|` of the scaled query rows, or `+inf` when one is
    /// NaN or infinite (a bound on the scores, see `attend`).
    q_max_abs: f32,
}

impl QueryTile {
    /// Buffers for tiles of up to `rows` query rows.
    ///
    /// # Errors
    /// When they cannot be allocated (a huge `d_k` or `d_v`).
    pub(crate) fn new<K: Kernel, S: TileSource>(
        shape: &AttentionShape,
        rows: usize,
    ) -> Result<Self, AttentionError> {
        // The rows `source`'s kernels compute for a tile of `rows`, and with
        // room for the queries in `bf16` pairs when it reads them so.
        let rows = S::computed_rows::<K>(rows);
        // Aligned like every buffer here: AMX tile loads of rows that
        // straddle cache lines run at half speed.
        let pair_rows = if S::PAIRED_QUERIES { rows } else { 0 };
        let len = element_count::<u32>("a query tile", &[pair_rows, shape.d_k.div_ceil(2)])?;
        let q_pairs = Scratch::filled("a query tile", len, 0)?;
        let split_rows = if S::SPLIT_QUERIES { rows } else { 0 };
        let len = element_count::<u32>("a query tile", &[3, split_rows, shape.d_k.div_ceil(2)])?;
        let q_split = Scratch::for_writing("a query tile", len)?;
        let unsplit = try_filled("a query tile", split_rows, false)?;
        let value_width = shape.d_v.div_ceil(K::LANES) * K::LANES;
        // Every buffer is written before it is read: `attend` loads the
        // queries (zeroing padding rows) and fills `o`, `max` and `sum`;
        // the kernels and masks write every score of the computed rows.
        let buffer =
            |len: Option<usize>| Scratch::for_writing("a query tile", len.unwrap_or(usize::MAX));
        Ok(Self {
            q: buffer(rows.checked_mul(shape.d_k))?,
            q_pairs,
            q_split,
            unsplit,
            scores: buffer(Some(rows * KEY_TILE))?,
            o: buffer(rows.checked_mul(value_width))?,
            row: buffer(Some(value_width))?,
            max: buffer(Some(rows))?,
            sum: buffer(Some(rows))?,
            alpha: buffer(Some(rows))?,
            value_width,
            q_max_abs: 0.0,
        })
    }

    /// Runs the query tile `at` over every key tile in `keys` (whole tiles
    /// but at `len_kv`) it can see, leaving the unnormalised output in `o`,
    /// the row maxima in `max` and the row sums in `sum`. `result` is how
    /// exact the weights must be for what the caller makes of them (a half
    /// output needs no more than `Half`).
    pub(crate) fn attend<K: Kernel, S: TileSource, KV: Float, Q: Query>(
        &mut self,
        kernel: K,
        call: &Call<'_, f32, KV, Q>,
        at: &TilePosition,
        source: &S,
        keys: Range<usize>,
        result: WeightPrecision,
    ) {
        let d_k = call.shape.d_k;
        let rows = S::computed_rows::<K>(at.rows);
        let in_place = self.load_queries::<K, S, KV, Q>(kernel, call, at, rows);
        if S::SPLIT_QUERIES {
            // The split reads the copied, scaled rows.
            const { assert!(!(S::SPLIT_QUERIES && S::SCALED_KEYS)) };
            let q = &self.q[..rows * d_k];
            source.split_queries(q, d_k, &mut self.q_split, &mut self.unsplit);
        }
        let span = TileSpan::of(at, call);
        // |scale·q·k| ≤ d_k·max|q'|·max|k'| (the scale in q' = scale·q or
        // in k' = scale·k, or outside both): below half of `f32::MAX`
        // (the margin covers rounding) no score can overflow, and the
        // scores need no check.
        let may_overflow = f64::from(self.q_max_abs) * f64::from(source.max_abs_key()) * d_k as f64
            > f64::from(f32::MAX) / 2.0;

        self.max[..rows].fill(f32::NEG_INFINITY);
        self.sum[..rows].fill(0.0);
        self.o[..rows * self.value_width].fill(0.0);
        let width = self.value_width;
        // A source that scales the scores itself (paired queries) leaves
        // the scale to the softmax, which multiplies as it subtracts the
        // maximum (one pass less over the scores), when nothing between
        // reads scaled scores and a positive scale keeps each row's
        // maximum where it is. Not when the scores may overflow: a paired
        // call's products, scaled or not, cannot (its prefill is taken
        // only then, `pairs.rs`), so there the bound is past `f32::MAX`
        // only for a NaN among the inputs, which scaling keeps NaN, and
        // checking the unscaled scores marks what checking scaled ones
        // would. A choice made from the bound would make the bits depend
        // on NaN in keys no row sees.
        let scale_in_softmax = S::PAIRED_QUERIES
            && call.scale > 0.0
            && call.opts.softcap.is_none()
            && call.opts.bias.is_none()
            && call.opts.alibi.is_none();
        let (score_scale, softmax_scale) = if scale_in_softmax {
            (1.0, call.scale)
        } else {
            (call.scale, 1.0)
        };
        let first_tile = span.min_start.max(keys.start) / KEY_TILE;
        let end_tile = span.max_end.min(keys.end).div_ceil(KEY_TILE);
        // The next query tile's rows (the tile this thread most likely runs
        // next), a share per key tile: their first read, often from
        // memory, then overlaps this tile's products instead of stalling
        // the next tile's start (its bound was 1.4% of a 1024-token
        // forward on Zen 4, at a sixth of the L2 read rate).
        let upcoming = upcoming_queries(call, at);
        let share = upcoming
            .len()
            .div_ceil(end_tile.saturating_sub(first_tile).max(1));
        let mut upcoming = upcoming.chunks(share.max(1));
        for t in first_tile..end_tile {
            if let Some(rows) = upcoming.next() {
                kernel.prefetch(rows);
            }
            let j0 = t * KEY_TILE;
            let scores = &mut self.scores[..rows * KEY_TILE];
            let queries = TileQueries {
                rows: in_place.unwrap_or(&self.q[..rows * d_k]),
                pairs: &self.q_pairs,
                split: &self.q_split,
                unsplit: &self.unsplit,
                d_k,
                scale: score_scale,
            };
            source.tile_scores(kernel, &queries, j0, scores);
            if may_overflow {
                mark_overflowed_scores(scores, at, j0, call);
            }
            if let Some(cap) = call.opts.softcap {
                kernel.softcap(scores, cap);
            }
            add_bias(scores, at, j0, call);
            add_alibi(scores, at, j0, call);
            let masked = span.needs_mask(j0, call);
            if masked {
                mask(scores, at, j0, call);
            }
            kernel.softmax_rows(SoftmaxRows {
                s: scores,
                keys: KEY_TILE,
                s_stride: KEY_TILE,
                max: &mut self.max[..rows],
                sum: &mut self.sum[..rows],
                alpha: &mut self.alpha[..rows],
                precision: S::WEIGHT_PRECISION.looser(result),
                scale: softmax_scale,
            });
            if width == 0 {
                continue; // `d_v = 0`: only the log-sum-exp is wanted.
            }
            let p = ArrayView2::from_shape((rows, KEY_TILE), &self.scores[..rows * KEY_TILE])
                .expect("a whole tile");
            let (alpha, o) = (&self.alpha[..rows], &mut self.o[..rows * width]);
            source.tile_values(kernel, j0, p, alpha, o, width);
        }
        source.finish_query_tile();
    }

    /// Copies the tile's query rows, times the scale, into `q`; padding
    /// rows up to `rows` are zero. Scaling Q once costs `len_q·d_k`
    /// multiplies instead of `len_q·len_kv`.
    ///
    /// For a source with [`TileSource::SCALED_KEYS`], the rows are
    /// unscaled, and returned where they lie instead of copied when they
    /// are `f32`, back to back and as many as the kernel computes (every
    /// tile but a last ragged one): `q_max_abs` is then their bound.
    ///
    /// With `paired`, the rows go into `q_pairs` instead, unscaled, as
    /// `bf16` pairs (exact: [`Query::all_bf16`] held), straight from the
    /// caller's rows where they are contiguous; the scores kernel applies
    /// the scale. `q_max_abs` is then `max|q|·max(|scale|, 1)`, which
    /// bounds the unscaled products the kernel sums as well as the scaled
    /// scores.
    fn load_queries<'c, K: Kernel, S: TileSource, KV, Q: Query>(
        &mut self,
        kernel: K,
        call: &'c Call<'_, f32, KV, Q>,
        at: &TilePosition,
        rows: usize,
    ) -> Option<&'c [f32]> {
        let d_k = call.shape.d_k;
        let q_head = crate::call::head(&call.q, at.b, at.h);
        if S::PAIRED_QUERIES {
            let end = (at.i0 + at.rows).min(q_head.nrows());
            let tile = q_head.slice_move(s![at.i0..end, ..]);
            let d_pairs = d_k.div_ceil(2);
            // Padding rows are zero: their scores are computed and dropped.
            self.q_pairs[at.rows.min(rows) * d_pairs..rows * d_pairs].fill(0);
            // The tile's bound in one pass where its rows are one block: a
            // pass a row paid a reduction across lanes for every few vectors.
            let whole = tile.as_slice().map(|tile| Q::magnitude_bound(kernel, tile));
            let mut max_abs = whole.unwrap_or(0.0);
            for (query, pairs) in tile
                .rows()
                .into_iter()
                .zip(self.q_pairs.chunks_exact_mut(d_pairs))
            {
                let row_max = match query.as_slice() {
                    Some(row) => {
                        Q::bf16_pairs(row, pairs);
                        match whole {
                            Some(_) => 0.0,
                            None => Q::magnitude_bound(kernel, row),
                        }
                    }
                    None => {
                        let widened = &mut self.q[..d_k];
                        scaled_row(kernel, query, widened, 1.0);
                        bf16_pairs(widened, pairs);
                        kernel.max_abs(widened)
                    }
                };
                max_abs = max_abs.max(row_max);
            }
            self.q_max_abs = max_abs * call.scale.abs().max(1.0);
            return None;
        }
        let real = at.rows.min(rows);
        let scale = if S::SCALED_KEYS { 1.0 } else { call.scale };
        if at.heads == 1 {
            let tile = q_head.slice_move(ndarray::s![at.i0..at.i0 + real, ..]);
            if S::SCALED_KEYS
                && real == rows
                && let Some(in_place) = Q::as_f32(tile).and_then(|tile| tile.to_slice())
            {
                self.q_max_abs = kernel.max_abs(in_place);
                return Some(in_place);
            }
            scaled_rows(kernel, tile, &mut self.q, d_k, scale);
        } else {
            // A stack of heads (grouped decoding): each head's rows in turn.
            let per_head = at.rows / at.heads;
            for (g, to) in self
                .q
                .chunks_mut((per_head * d_k).max(1))
                .take(at.heads)
                .enumerate()
            {
                let from = crate::call::head(&call.q, at.b, at.h + g);
                let from = from.slice_move(ndarray::s![at.i0..at.i0 + per_head, ..]);
                scaled_rows(kernel, from, to, d_k, scale);
            }
        }
        // Padding rows are zero: their scores are computed and dropped.
        self.q[real * d_k..rows * d_k].fill(0.0);
        self.q_max_abs = kernel.max_abs(&self.q[..rows * d_k]);
        None
    }

    /// Writes `O / ℓ` for the tile's rows into `out_tile`, and `m + ln ℓ`
    /// into `log_sum_exp`, after [`attend`](Self::attend) over `keys`; then
    /// merges in `sink`, when given (the caller passes it only where the
    /// tile's keys are the row's whole result, see `modifiers.rs`).
    ///
    /// A NaN `ℓ` (a NaN or `+inf` visible score, or an overflowed product)
    /// gives NaN. `ℓ = 0` means every visible score was `−inf`: a row that
    /// saw nothing (no visible key, or all hidden by a `−inf` bias) gets
    /// zeros and `−inf`; a row with an unhidden visible key got there by a
    /// non-finite input, and gets NaN with log-sum-exp `−inf` (see
    /// `mask.rs`).
    ///
    /// Each row is finished in `f32` and then stored in the output's type
    /// `O` (rounded once, for a half call's output).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_output<K: Kernel, KV, Q, O: Output>(
        &mut self,
        kernel: K,
        call: &Call<'_, f32, KV, Q>,
        at: &TilePosition,
        keys: Range<usize>,
        out_tile: &mut ArrayViewMut2<'_, O>,
        log_sum_exp: Option<ArrayViewMut1<'_, f32>>,
        sink: Option<f32>,
    ) {
        let mut log_sum_exp = log_sum_exp;
        // A row's log-sum-exp costs a `ln`: only for a caller or a sink
        // that reads it (else the value below is never read).
        let lse_read = log_sum_exp.is_some() || sink.is_some();
        let d_v = out_tile.ncols();
        for r in 0..at.rows {
            let sum = self.sum[r];
            let o = &self.o[r * self.value_width..][..d_v];
            let row = &mut self.row[..d_v];
            let mut lse = if sum != 0.0 {
                // A NaN sum gives NaN in both.
                kernel.divided_copy(o, row, sum);
                if lse_read {
                    self.max[r] + sum.ln()
                } else {
                    f32::NAN
                }
            } else if call.has_unhidden_key(at.b, at.row(r).0, at.row(r).1, keys.clone()) {
                row.fill(f32::NAN);
                f32::NEG_INFINITY
            } else {
                row.fill(0.0);
                f32::NEG_INFINITY
            };
            if let Some(sink) = sink {
                apply_sink(row.iter_mut(), &mut lse, sink);
            }
            let mut out_row = out_tile.row_mut(r);
            match out_row.as_slice_mut() {
                Some(out) => O::store(row, out),
                None => {
                    (out_row.iter_mut().zip(row.iter())).for_each(|(y, &x)| *y = O::from_f32(x))
                }
            }
            if let Some(log_sum_exp) = log_sum_exp.as_mut() {
                log_sum_exp[r] = lse;
            }
        }
    }
}

/// The `f32` query rows of the tile after `at` in its head, as many as
/// `at` has, where they are back to back; else none. (The first rows of
/// the next head too measured no faster at N = 256 on Zen 4.)
fn upcoming_queries<'c, KV, Q: Query>(
    call: &'c Call<'_, f32, KV, Q>,
    at: &TilePosition,
) -> &'c [f32] {
    if at.heads > 1 {
        return &[];
    }
    let q_head = crate::call::head(&call.q, at.b, at.h);
    let start = (at.i0 + at.rows).min(q_head.nrows());
    let end = (start + at.rows).min(q_head.nrows());
    Q::as_f32(q_head.slice_move(ndarray::s![start..end, ..]))
        .and_then(|rows| rows.to_slice())
        .unwrap_or(&[])
}

/// The `bf16` bits of `x`, an `f32` widened from a `bf16` (as every input
/// of a `bf16` call is): its top half, exactly, NaN payloads included.
/// Inputs that were not `bf16` would be truncated, not rounded; only the
/// `bf16` prefill (`pairs.rs`) calls this, on its call's inputs.
#[inline]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}

/// `x` in `bf16` pairs: pair `p` holds `x[2p]` in its low half and
/// `x[2p + 1]` (zero past the end) in its high half.
pub(crate) fn bf16_pairs(x: &[f32], pairs: &mut [u32]) {
    let mut two = x.chunks_exact(2);
    for (pair, two) in pairs.iter_mut().zip(&mut two) {
        *pair = u32::from(bf16_bits(two[0])) | (u32::from(bf16_bits(two[1])) << 16);
    }
    if let [last] = two.remainder() {
        pairs[x.len() / 2] = u32::from(bf16_bits(*last));
    }
}
