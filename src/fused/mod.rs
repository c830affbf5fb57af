//! The fast path for `f32`: FlashAttention-2 loop order over tiles, on the
//! hand-vectorized kernels of [`crate::simd`]. No `len_q × len_kv` buffer is
//! ever formed.
//!
//! For each `(batch, kv_head)` the keys and values are packed once (keys in
//! panels for the Q·Kᵀ microkernel, values with rows padded to the vector
//! width), then every query head that shares them and every tile of
//! `QUERY_TILE` query rows streams the key tiles through:
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

pub(crate) mod backward;

use std::ops::Range;

use ndarray::{
    Array1, Array2, ArrayView2, ArrayView4, ArrayViewMut, ArrayViewMut1, ArrayViewMut2,
    ArrayViewMut3, ArrayViewMut4, Axis, Dimension, RemoveAxis, s,
};

use crate::core::{head, head_mut};
use crate::error::AttentionError;
use crate::options::{AttentionOptions, broadcast, broadcast_row};
use crate::parallel::{map_with, split_into_chunks};
use crate::partial::merge_row;
use crate::shape::AttentionShape;
use crate::simd::{self, Kernel, WithKernel};

/// Query rows per work item. With 64 keys per tile, the score tile is
/// 96 × 64 × 4 B = 24 KiB, and a key or value tile at d = 64 is 16 KiB: the
/// working set of one step sits in L1/L2.
pub(crate) const QUERY_TILE: usize = 96;
/// Keys per tile: a multiple of every kernel set's key panel.
pub(crate) const KEY_TILE: usize = 64;
/// Calls with at most this many query rows per head are decoding steps:
/// keys and values are read in place, once, rather than packed.
pub(crate) const DECODE_MAX_QUERIES: usize = 8;
/// Keys per work item when decoding: long caches are split into chunks of
/// this many keys whose partial results are merged. Fixed, so the result
/// does not depend on the thread count.
pub(crate) const DECODE_CHUNK: usize = 1024;

/// The kernel set a call runs on: the options', else the one chosen at
/// run time.
pub(crate) fn kernel_set(
    opts: &AttentionOptions<'_, f32>,
) -> Result<simd::KernelSet, AttentionError> {
    match opts.kernel_set {
        Some(set) => simd::check_available(set),
        None => simd::current_kernel_set(),
    }
}

/// Attention on the fused path, with the kernel set the options or the
/// environment choose.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_into(
    q: &ArrayView4<'_, f32>,
    k: &ArrayView4<'_, f32>,
    v: &ArrayView4<'_, f32>,
    opts: &AttentionOptions<'_, f32>,
    shape: &AttentionShape,
    scale: f32,
    out: ArrayViewMut4<'_, f32>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    simd::with_kernel(
        kernel_set(opts)?,
        FusedAttention {
            q,
            k,
            v,
            opts,
            shape,
            scale,
            out,
            log_sum_exp,
        },
    )
}

/// One fused attention call, waiting for its kernel.
struct FusedAttention<'c, 'q, 'k, 'v, 'o> {
    q: &'c ArrayView4<'q, f32>,
    k: &'c ArrayView4<'k, f32>,
    v: &'c ArrayView4<'v, f32>,
    opts: &'c AttentionOptions<'o, f32>,
    shape: &'c AttentionShape,
    scale: f32,
    out: ArrayViewMut4<'c, f32>,
    log_sum_exp: Option<ArrayViewMut3<'c, f32>>,
}

impl WithKernel for FusedAttention<'_, '_, '_, '_, '_> {
    type Output = ();

    fn run<K: Kernel>(self, kernel: K) {
        let shape = *self.shape;
        if self.out.is_empty() {
            return;
        }
        if reads_keys_in_place::<K>(&shape, self.k, self.v) {
            return self.decode(kernel);
        }
        // One job per (batch, kv_head): pack its keys and values once, then
        // run every query tile of every head that shares them. Jobs and
        // tiles run in parallel; each tile writes its own rows of `out`
        // (and of `log_sum_exp`).
        let group = shape.heads / shape.kv_heads;
        let mut heads = heads_of(self.out)
            .into_iter()
            .zip(match self.log_sum_exp {
                Some(lse) => heads_of(lse).into_iter().map(Some).collect::<Vec<_>>(),
                None => (0..shape.batch * shape.heads)
                    .map(|_| None)
                    .collect::<Vec<_>>(),
            })
            .enumerate();
        let mut jobs = Vec::with_capacity(shape.batch * shape.kv_heads);
        for b in 0..shape.batch {
            for kv_h in 0..shape.kv_heads {
                let job_heads: Vec<_> = heads
                    .by_ref()
                    .take(group)
                    .map(|(bh, views)| (bh % shape.heads, views))
                    .collect();
                jobs.push((b, kv_h, job_heads));
            }
        }
        let (q, k, v, opts, scale) = (self.q, self.k, self.v, self.opts, self.scale);
        map_with(
            jobs,
            || (),
            |_, (b, kv_h, job_heads)| {
                // Fresh per job: reusing one per rayon piece (as the backward
                // does) measured 3–4% slower at N = 256, one thread.
                let mut packed = PackedKeysValues::new::<K>(shape.len_kv, shape.d_k, shape.d_v);
                packed.pack::<K>(head(k, b, kv_h), head(v, b, kv_h));
                let mut tiles = Vec::new();
                for (h, (out_head, lse_head)) in job_heads {
                    let out_tiles = split_into_chunks(out_head, Axis(0), QUERY_TILE);
                    let mut lse_tiles =
                        lse_head.map(|lse| split_into_chunks(lse, Axis(0), QUERY_TILE).into_iter());
                    for (t, out_tile) in out_tiles.into_iter().enumerate() {
                        let at = TilePosition {
                            b,
                            h,
                            i0: t * QUERY_TILE,
                            rows: out_tile.nrows(),
                        };
                        let lse_tile = lse_tiles.as_mut().and_then(Iterator::next);
                        tiles.push((at, out_tile, lse_tile));
                    }
                }
                let source = KeysValues::Packed(&packed);
                map_with(
                    tiles,
                    || TileScratch::new::<K>(&shape, QUERY_TILE),
                    |tile, (at, mut out_tile, lse_tile)| {
                        let keys = 0..shape.len_kv;
                        tile.attend(
                            kernel,
                            &at,
                            head(q, b, at.h),
                            &source,
                            keys,
                            opts,
                            &shape,
                            scale,
                        );
                        tile.write_output(&at, &mut out_tile, lse_tile);
                    },
                );
            },
        );
    }
}

impl FusedAttention<'_, '_, '_, '_, '_> {
    /// A decoding step: few queries per head against many keys. Keys and
    /// values are read in place, once per head, in chunks of `DECODE_CHUNK`
    /// keys that run in parallel; each chunk's partial `(O, log-sum-exp)` is
    /// merged in chunk order.
    fn decode<K: Kernel>(self, kernel: K) {
        let shape = *self.shape;
        let (q, k, v, opts, scale) = (self.q, self.k, self.v, self.opts, self.scale);
        let group = shape.heads / shape.kv_heads;
        let chunks = shape.len_kv.div_ceil(DECODE_CHUNK).max(1);
        let jobs: Vec<_> = (0..shape.batch)
            .flat_map(|b| {
                (0..shape.kv_heads).flat_map(move |kv_h| (0..chunks).map(move |c| (b, kv_h, c)))
            })
            .collect();
        let partials = map_with(
            jobs,
            || TileScratch::new::<K>(&shape, shape.len_q),
            |tile, (b, kv_h, c)| {
                let source = KeysValues::Rows {
                    k: head(k, b, kv_h),
                    v: head(v, b, kv_h),
                };
                let keys = c * DECODE_CHUNK..((c + 1) * DECODE_CHUNK).min(shape.len_kv);
                (kv_h * group..(kv_h + 1) * group)
                    .map(|h| {
                        let at = TilePosition {
                            b,
                            h,
                            i0: 0,
                            rows: shape.len_q,
                        };
                        tile.attend(
                            kernel,
                            &at,
                            head(q, b, h),
                            &source,
                            keys.clone(),
                            opts,
                            &shape,
                            scale,
                        );
                        let mut out = Array2::zeros((shape.len_q, shape.d_v));
                        let mut lse = Array1::zeros(shape.len_q);
                        tile.write_output(&at, &mut out.view_mut(), Some(lse.view_mut()));
                        (out, lse)
                    })
                    .collect::<Vec<_>>()
            },
        );
        // Jobs came out in (b, kv_h, chunk) order: merge each head's chunks.
        let (mut out, mut log_sum_exp) = (self.out, self.log_sum_exp);
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
                head_mut(&mut out, b, h).assign(&merged);
                if let Some(log_sum_exp) = log_sum_exp.as_mut() {
                    log_sum_exp
                        .index_axis_mut(Axis(0), b)
                        .index_axis_mut(Axis(0), h)
                        .assign(&merged_lse);
                }
            }
        }
    }
}

/// Whether the call is a decoding step whose keys and values the kernels
/// can read in place: few queries, rows contiguous, and head dims that are
/// whole vectors (so no row is read past its end).
fn reads_keys_in_place<K: Kernel>(
    shape: &AttentionShape,
    k: &ArrayView4<'_, f32>,
    v: &ArrayView4<'_, f32>,
) -> bool {
    let contiguous_rows = |x: &ArrayView4<'_, f32>| x.shape()[3] <= 1 || x.strides()[3] == 1;
    shape.len_q <= DECODE_MAX_QUERIES
        && shape.d_k.is_multiple_of(K::LANES)
        && shape.d_v.is_multiple_of(K::LANES)
        && contiguous_rows(k)
        && contiguous_rows(v)
}

/// The `[batch·heads]` views `x[b, h]` of a `[batch, heads, …]` view, in
/// order, each free to go to another thread.
fn heads_of<'a, D>(
    x: ArrayViewMut<'a, f32, D>,
) -> Vec<ArrayViewMut<'a, f32, <D::Smaller as Dimension>::Smaller>>
where
    D: RemoveAxis,
    D::Smaller: RemoveAxis,
{
    split_into_chunks(x, Axis(0), 1)
        .into_iter()
        .flat_map(|x_b| split_into_chunks(x_b.index_axis_move(Axis(0), 0), Axis(0), 1))
        .map(|x_bh| x_bh.index_axis_move(Axis(0), 0))
        .collect()
}

/// One key/value head packed for the kernels, padded to whole key tiles.
/// (The backward pass also packs values as "keys" and keys as "values".)
pub(crate) struct PackedKeysValues {
    /// Keys in panels of `K::KEY_PANEL`, each `[d_k][KEY_PANEL]`.
    pub(crate) key_panels: Vec<f32>,
    /// Values `[len_kv padded][d_v rounded up to the vector width]`.
    pub(crate) values: Array2<f32>,
    /// Per key tile: does it hold a NaN or infinite value?
    pub(crate) tile_has_nonfinite_values: Vec<bool>,
}

impl PackedKeysValues {
    /// Buffers for `len_kv` keys of `d_k` and values of `d_v` numbers.
    pub(crate) fn new<K: Kernel>(len_kv: usize, d_k: usize, d_v: usize) -> Self {
        let padded_keys = len_kv.div_ceil(KEY_TILE) * KEY_TILE;
        let value_width = d_v.div_ceil(K::LANES) * K::LANES;
        Self {
            key_panels: vec![0.0; padded_keys * d_k],
            values: Array2::zeros((padded_keys, value_width)),
            tile_has_nonfinite_values: vec![false; padded_keys / KEY_TILE],
        }
    }

    /// Packs one head's `k` `[len_kv, d_k]` and `v` `[len_kv, d_v]`; padding
    /// stays zero from `new`, since every head writes the same places.
    pub(crate) fn pack<K: Kernel>(&mut self, k: ArrayView2<'_, f32>, v: ArrayView2<'_, f32>) {
        let d_k = k.ncols();
        let panel = K::KEY_PANEL;
        // Key j is column j % panel of panel j / panel, a `[d_k][panel]` block.
        for (j, key) in k.rows().into_iter().enumerate() {
            let column = &mut self.key_panels[(j / panel) * panel * d_k + j % panel..];
            for (packed, &x) in column.iter_mut().step_by(panel).zip(key.iter()) {
                *packed = x;
            }
        }
        self.tile_has_nonfinite_values.fill(false);
        for (j, (value, mut packed)) in v.rows().into_iter().zip(self.values.rows_mut()).enumerate()
        {
            let packed = packed.as_slice_mut().expect("packed rows are contiguous");
            match value.as_slice() {
                Some(value) => packed[..value.len()].copy_from_slice(value),
                None => packed
                    .iter_mut()
                    .zip(value.iter())
                    .for_each(|(packed, &x)| *packed = x),
            }
            if !packed.iter().all(|x| x.is_finite()) {
                self.tile_has_nonfinite_values[j / KEY_TILE] = true;
            }
        }
    }
}

/// Where a tile's keys and values come from.
enum KeysValues<'p> {
    /// One head packed for the register-tiled kernels (prefill).
    Packed(&'p PackedKeysValues),
    /// One head's `k` `[len_kv, d_k]` and `v` `[len_kv, d_v]`, read in place
    /// from contiguous rows (decode).
    Rows {
        k: ArrayView2<'p, f32>,
        v: ArrayView2<'p, f32>,
    },
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
    pub(crate) fn of(
        at: &TilePosition,
        opts: &AttentionOptions<'_, f32>,
        shape: &AttentionShape,
    ) -> Self {
        let mut span = TileSpan {
            min_start: usize::MAX,
            max_start: 0,
            min_end: usize::MAX,
            max_end: 0,
        };
        for i in at.i0..at.i0 + at.rows {
            let range = opts.visible_range(at.b, i, shape.len_q, shape.len_kv);
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
    pub(crate) fn needs_mask(&self, j0: usize, opts: &AttentionOptions<'_, f32>) -> bool {
        opts.keep_mask.is_some() || j0 + KEY_TILE > self.min_end || j0 < self.max_start
    }
}

/// Adds the bias, if any, to the scores (row stride `KEY_TILE`) of the
/// tile's real rows and keys.
pub(crate) fn add_bias(
    scores: &mut [f32],
    at: &TilePosition,
    j0: usize,
    opts: &AttentionOptions<'_, f32>,
    shape: &AttentionShape,
) {
    let Some(bias) = &opts.bias else { return };
    let j1 = (j0 + KEY_TILE).min(shape.len_kv);
    let offset = opts.key_offset();
    for r in 0..at.rows {
        let bias_row = broadcast_row(bias, at.b, at.h, at.i0 + r);
        let scores = &mut scores[r * KEY_TILE..][..j1 - j0];
        for (j, score) in (j0..j1).zip(scores) {
            *score += bias_row[broadcast(bias_row.len(), offset + j)];
        }
    }
}

/// Sets the scores (row stride `KEY_TILE`) of keys a row may not see, and
/// of padding keys, to `−inf`.
pub(crate) fn mask(
    scores: &mut [f32],
    at: &TilePosition,
    j0: usize,
    opts: &AttentionOptions<'_, f32>,
    shape: &AttentionShape,
) {
    for r in 0..at.rows {
        let visible = opts.visible_keys(at.b, at.h, at.i0 + r, shape.len_q, shape.len_kv);
        let scores = &mut scores[r * KEY_TILE..][..KEY_TILE];
        for (j, score) in (j0..).zip(scores) {
            if !visible.contains(j) {
                *score = f32::NEG_INFINITY;
            }
        }
    }
}

/// `o[r] ← alpha[r]·o[r] + Σ_j p[r][j]·v[j]` term by term for the
/// `alpha.len()` rows, skipping zero weights so that a NaN or infinite
/// value of a masked key cannot turn into `0·NaN`. `o` has rows of
/// `o.len() / rows` numbers.
pub(crate) fn accumulate_skipping_zero_weights(
    p: ArrayView2<'_, f32>,
    values: ArrayView2<'_, f32>,
    alpha: &[f32],
    o: &mut [f32],
) {
    if alpha.is_empty() {
        return;
    }
    let width = o.len() / alpha.len();
    for (r, o) in o.chunks_exact_mut(width).enumerate() {
        o.iter_mut().for_each(|x| *x *= alpha[r]);
        for (j, value) in values.rows().into_iter().enumerate() {
            let weight = p[[r, j]];
            if weight != 0.0 {
                for (x, &v) in o.iter_mut().zip(value) {
                    *x += weight * v;
                }
            }
        }
    }
}

/// Where a query tile sits: batch item, head, first row and row count.
pub(crate) struct TilePosition {
    pub(crate) b: usize,
    pub(crate) h: usize,
    pub(crate) i0: usize,
    pub(crate) rows: usize,
}

/// The buffers of one query tile, reused from tile to tile.
struct TileScratch {
    /// Scaled query rows `[padded rows][d_k]`.
    q: Vec<f32>,
    /// Scores, then weights, `[padded rows][KEY_TILE]`.
    scores: Vec<f32>,
    /// Unnormalised output `[padded rows][value_width]`.
    o: Vec<f32>,
    /// Running row max `m`, running sum `ℓ`, and this step's rescale `α`.
    max: Vec<f32>,
    sum: Vec<f32>,
    alpha: Vec<f32>,
    value_width: usize,
}

impl TileScratch {
    /// Buffers for tiles of up to `rows` query rows.
    fn new<K: Kernel>(shape: &AttentionShape, rows: usize) -> Self {
        let rows = rows.div_ceil(K::ROWS) * K::ROWS;
        let value_width = shape.d_v.div_ceil(K::LANES) * K::LANES;
        Self {
            q: vec![0.0; rows * shape.d_k],
            scores: vec![0.0; rows * KEY_TILE],
            o: vec![0.0; rows * value_width],
            max: vec![0.0; rows],
            sum: vec![0.0; rows],
            alpha: vec![0.0; rows],
            value_width,
        }
    }

    /// Runs the query tile `at` over every key tile in `keys` (whole tiles
    /// but at `len_kv`) it can see, leaving the unnormalised output in `o`,
    /// the row maxima in `max` and the row sums in `sum`.
    #[allow(clippy::too_many_arguments)]
    fn attend<K: Kernel>(
        &mut self,
        kernel: K,
        at: &TilePosition,
        q_head: ArrayView2<'_, f32>,
        source: &KeysValues<'_>,
        keys: Range<usize>,
        opts: &AttentionOptions<'_, f32>,
        shape: &AttentionShape,
        scale: f32,
    ) {
        let d_k = shape.d_k;
        // The register-tiled Q·Kᵀ kernel needs whole register tiles of rows
        // (padding rows are computed and dropped); reading keys in place
        // works on the real rows only.
        let rows = match source {
            KeysValues::Packed(_) => at.rows.div_ceil(K::ROWS) * K::ROWS,
            KeysValues::Rows { .. } => at.rows,
        };
        // Scaling Q once costs len_q·d_k multiplies instead of len_q·len_kv.
        self.q[..rows * d_k].fill(0.0);
        for (r, query) in q_head
            .rows()
            .into_iter()
            .skip(at.i0)
            .take(at.rows)
            .enumerate()
        {
            for (packed_q, &x) in self.q[r * d_k..(r + 1) * d_k].iter_mut().zip(query.iter()) {
                *packed_q = scale * x;
            }
        }
        let span = TileSpan::of(at, opts, shape);

        self.max[..rows].fill(f32::NEG_INFINITY);
        self.sum[..rows].fill(0.0);
        self.o[..rows * self.value_width].fill(0.0);
        let width = self.value_width;
        let first_tile = span.min_start.max(keys.start) / KEY_TILE;
        let end_tile = span.max_end.min(keys.end).div_ceil(KEY_TILE);
        for t in first_tile..end_tile {
            let j0 = t * KEY_TILE;
            let n = KEY_TILE.min(shape.len_kv - j0);
            let scores = &mut self.scores[..rows * KEY_TILE];
            match source {
                KeysValues::Packed(packed) => {
                    let panels = &packed.key_panels[j0 * d_k..(j0 + KEY_TILE) * d_k];
                    kernel.scores(&self.q[..rows * d_k], d_k, panels, scores, KEY_TILE);
                }
                KeysValues::Rows { k, .. } => {
                    let k_tile = k.slice(s![j0..j0 + n, ..]);
                    kernel.row_scores(&self.q[..rows * d_k], d_k, k_tile, scores, KEY_TILE);
                }
            }
            let scores = &mut self.scores[..rows * KEY_TILE];
            add_bias(scores, at, j0, opts, shape);
            let masked = span.needs_mask(j0, opts);
            if masked {
                mask(scores, at, j0, opts, shape);
            }
            kernel.softmax_rows(
                &mut self.scores[..rows * KEY_TILE],
                KEY_TILE,
                KEY_TILE,
                &mut self.max[..rows],
                &mut self.sum[..rows],
                &mut self.alpha[..rows],
            );
            let (values, nonfinite) = match source {
                KeysValues::Packed(packed) => (
                    packed.values.slice(s![j0..j0 + KEY_TILE, ..]),
                    packed.tile_has_nonfinite_values[t],
                ),
                // Only a masked tile can multiply a hidden value by 0.
                KeysValues::Rows { v, .. } => {
                    let values = v.slice(s![j0..j0 + n, ..]);
                    (values, masked && !values.iter().all(|x| x.is_finite()))
                }
            };
            let p = ArrayView2::from_shape((rows, KEY_TILE), &self.scores[..rows * KEY_TILE])
                .expect("a whole tile");
            let (alpha, o) = (&self.alpha[..rows], &mut self.o[..rows * width]);
            if nonfinite {
                accumulate_skipping_zero_weights(p, values, alpha, o);
            } else {
                kernel.accumulate_values(p, values, width, alpha, o);
            }
        }
    }

    /// Writes `O / ℓ` for the tile's rows into `out_tile`, and `m + ln ℓ`
    /// into `log_sum_exp`; rows that saw no key (ℓ = 0) get zeros and `−inf`.
    fn write_output(
        &self,
        at: &TilePosition,
        out_tile: &mut ArrayViewMut2<'_, f32>,
        log_sum_exp: Option<ArrayViewMut1<'_, f32>>,
    ) {
        if let Some(mut log_sum_exp) = log_sum_exp {
            for (r, lse) in log_sum_exp.iter_mut().enumerate() {
                *lse = if self.sum[r] > 0.0 {
                    self.max[r] + self.sum[r].ln()
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        for r in 0..at.rows {
            let sum = self.sum[r];
            let o = &self.o[r * self.value_width..];
            let mut out_row = out_tile.row_mut(r);
            for (y, &x) in out_row.iter_mut().zip(o) {
                *y = if sum > 0.0 { x / sum } else { 0.0 };
            }
        }
    }
}
