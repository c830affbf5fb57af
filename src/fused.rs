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

use ndarray::{
    ArrayView2, ArrayView4, ArrayViewMut, ArrayViewMut1, ArrayViewMut2, ArrayViewMut3,
    ArrayViewMut4, Axis, Dimension, RemoveAxis,
};

use crate::core::head;
use crate::error::AttentionError;
use crate::options::{AttentionOptions, broadcast, broadcast_row};
use crate::parallel::{for_each_with, split_into_chunks};
use crate::shape::AttentionShape;
use crate::simd::{self, Kernel, WithKernel};

/// Query rows per work item. With 64 keys per tile, the score tile is
/// 96 × 64 × 4 B = 24 KiB, and a key or value tile at d = 64 is 16 KiB: the
/// working set of one step sits in L1/L2.
pub(crate) const QUERY_TILE: usize = 96;
/// Keys per tile: a multiple of every kernel set's key panel.
pub(crate) const KEY_TILE: usize = 64;

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
    let set = match opts.kernel_set {
        Some(set) => simd::check_available(set)?,
        None => simd::selected_kernel_set()?,
    };
    simd::with_kernel(
        set,
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
        for_each_with(
            jobs,
            || (),
            |_, (b, kv_h, job_heads)| {
                let mut packed = PackedKeysValues::new::<K>(&shape);
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
                for_each_with(
                    tiles,
                    || TileScratch::new::<K>(&shape),
                    |tile, (at, mut out_tile, lse_tile)| {
                        tile.attend(kernel, &at, head(q, b, at.h), &packed, opts, &shape, scale);
                        tile.write_output(&at, &mut out_tile, lse_tile);
                    },
                );
            },
        );
    }
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
struct PackedKeysValues {
    /// Keys in panels of `K::KEY_PANEL`, each `[d_k][KEY_PANEL]`.
    key_panels: Vec<f32>,
    /// Values `[len_kv padded][value_width]`.
    values: Vec<f32>,
    /// Columns of `values`: `d_v` rounded up to the vector width.
    value_width: usize,
    /// Per key tile: does it hold a NaN or infinite value?
    tile_has_nonfinite_values: Vec<bool>,
}

impl PackedKeysValues {
    fn new<K: Kernel>(shape: &AttentionShape) -> Self {
        let padded_keys = shape.len_kv.div_ceil(KEY_TILE) * KEY_TILE;
        let value_width = shape.d_v.div_ceil(K::LANES) * K::LANES;
        Self {
            key_panels: vec![0.0; padded_keys * shape.d_k],
            values: vec![0.0; padded_keys * value_width],
            value_width,
            tile_has_nonfinite_values: vec![false; padded_keys / KEY_TILE],
        }
    }

    /// Packs one head's `k` `[len_kv, d_k]` and `v` `[len_kv, d_v]`; padding
    /// stays zero from `new`, since every head writes the same places.
    fn pack<K: Kernel>(&mut self, k: ArrayView2<'_, f32>, v: ArrayView2<'_, f32>) {
        let d_k = k.ncols();
        let panel = K::KEY_PANEL;
        for (j, key) in k.rows().into_iter().enumerate() {
            let base = (j / panel) * panel * d_k + j % panel;
            for (dd, &x) in key.iter().enumerate() {
                self.key_panels[base + dd * panel] = x;
            }
        }
        self.tile_has_nonfinite_values.fill(false);
        for (j, value) in v.rows().into_iter().enumerate() {
            let row = &mut self.values[j * self.value_width..][..value.len()];
            for (packed, &x) in row.iter_mut().zip(value.iter()) {
                *packed = x;
            }
            if !row.iter().all(|x| x.is_finite()) {
                self.tile_has_nonfinite_values[j / KEY_TILE] = true;
            }
        }
    }
}

/// Where a query tile sits: batch item, head, first row and row count.
struct TilePosition {
    b: usize,
    h: usize,
    i0: usize,
    rows: usize,
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
    /// Rows rounded up to the kernel's register tile.
    padded_rows: usize,
    value_width: usize,
}

impl TileScratch {
    fn new<K: Kernel>(shape: &AttentionShape) -> Self {
        let rows = QUERY_TILE.div_ceil(K::ROWS) * K::ROWS;
        let value_width = shape.d_v.div_ceil(K::LANES) * K::LANES;
        Self {
            q: vec![0.0; rows * shape.d_k],
            scores: vec![0.0; rows * KEY_TILE],
            o: vec![0.0; rows * value_width],
            max: vec![0.0; rows],
            sum: vec![0.0; rows],
            alpha: vec![0.0; rows],
            padded_rows: rows,
            value_width,
        }
    }

    /// Runs the query tile `at` over every key tile it can see, leaving the
    /// unnormalised output in `o` and the row sums in `sum`.
    #[allow(clippy::too_many_arguments)]
    fn attend<K: Kernel>(
        &mut self,
        kernel: K,
        at: &TilePosition,
        q_head: ArrayView2<'_, f32>,
        packed: &PackedKeysValues,
        opts: &AttentionOptions<'_, f32>,
        shape: &AttentionShape,
        scale: f32,
    ) {
        let d_k = shape.d_k;
        let rows = at.rows.div_ceil(K::ROWS) * K::ROWS;
        self.padded_rows = rows;
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
        // The key tiles any row can see, and the span every row sees: tiles
        // inside that span need no element-wise mask.
        let (mut min_start, mut max_start) = (usize::MAX, 0);
        let (mut min_end, mut max_end) = (usize::MAX, 0);
        for i in at.i0..at.i0 + at.rows {
            let range = opts.visible_range(at.b, i, shape.len_q, shape.len_kv);
            (min_start, max_start) = (min_start.min(range.start), max_start.max(range.start));
            (min_end, max_end) = (min_end.min(range.end), max_end.max(range.end));
        }

        self.max[..rows].fill(f32::NEG_INFINITY);
        self.sum[..rows].fill(0.0);
        self.o[..rows * self.value_width].fill(0.0);
        let width = self.value_width;
        for t in min_start / KEY_TILE..max_end.div_ceil(KEY_TILE) {
            let j0 = t * KEY_TILE;
            kernel.scores(
                &self.q[..rows * d_k],
                d_k,
                &packed.key_panels[j0 * d_k..(j0 + KEY_TILE) * d_k],
                &mut self.scores[..rows * KEY_TILE],
                KEY_TILE,
            );
            if opts.bias.is_some() {
                self.add_bias(at, j0, opts, shape);
            }
            if opts.keep_mask.is_some() || j0 + KEY_TILE > min_end || j0 < max_start {
                self.mask(at, j0, opts, shape);
            }
            kernel.softmax_rows(
                &mut self.scores[..rows * KEY_TILE],
                KEY_TILE,
                KEY_TILE,
                &mut self.max[..rows],
                &mut self.sum[..rows],
                &mut self.alpha[..rows],
            );
            let values = &packed.values[j0 * width..(j0 + KEY_TILE) * width];
            if packed.tile_has_nonfinite_values[t] {
                self.accumulate_values_skipping_zero_weights(values);
            } else {
                kernel.accumulate_values(
                    &self.scores[..rows * KEY_TILE],
                    KEY_TILE,
                    values,
                    width,
                    &self.alpha[..rows],
                    &mut self.o[..rows * width],
                );
            }
        }
    }

    /// Adds the bias to the scores of the tile's real rows and keys.
    fn add_bias(
        &mut self,
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
            let scores = &mut self.scores[r * KEY_TILE..][..j1 - j0];
            for (j, score) in (j0..j1).zip(scores) {
                *score += bias_row[broadcast(bias_row.len(), offset + j)];
            }
        }
    }

    /// Sets the scores of keys a row may not see (and of padding keys) to `−inf`.
    fn mask(
        &mut self,
        at: &TilePosition,
        j0: usize,
        opts: &AttentionOptions<'_, f32>,
        shape: &AttentionShape,
    ) {
        for r in 0..at.rows {
            let visible = opts.visible_keys(at.b, at.h, at.i0 + r, shape.len_q, shape.len_kv);
            let scores = &mut self.scores[r * KEY_TILE..][..KEY_TILE];
            for (j, score) in (j0..).zip(scores) {
                if !visible.contains(j) {
                    *score = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// `O = α·O + P·V` term by term, skipping zero weights so that a NaN or
    /// infinite value of a masked key cannot turn into `0·NaN`.
    fn accumulate_values_skipping_zero_weights(&mut self, values: &[f32]) {
        let width = self.value_width;
        for r in 0..self.padded_rows {
            let o = &mut self.o[r * width..(r + 1) * width];
            let alpha = self.alpha[r];
            o.iter_mut().for_each(|x| *x *= alpha);
            for (j, value) in values.chunks_exact(width).enumerate() {
                let weight = self.scores[r * KEY_TILE + j];
                if weight != 0.0 {
                    for (x, &v) in o.iter_mut().zip(value) {
                        *x += weight * v;
                    }
                }
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
