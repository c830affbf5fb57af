//! The fused backward pass for `f32`: the gradients of the fused forward,
//! in FlashAttention-2 order on the same kernels, with no `len_q × len_kv`
//! buffer (but for `d_bias`, which has that shape itself).
//!
//! One work item per `(batch, kv_head)` owns that head's `d_k` and `d_v`
//! and the `d_q` of the query heads sharing it, so nothing is shared
//! between threads and the result is bitwise the same for any thread
//! count. Within an item, key tiles are the outer loop, so a tile's `dK_j`
//! and `dV_j` accumulate in cache; for each query tile `i` that sees it:
//!
//! ```text
//! P    = exp(S − lse)            S = cap((scale·Q_i)·K_jᵀ) (+ bias, ALiBi), masked = −inf
//! dV_j += Pᵀ · dO_i
//! dP   = dO_i · V_jᵀ
//! dS   = P ∘ (dP − D_i)          D_i = rowsum(dO_i ∘ O_i); 0 wherever P = 0
//!                                (the bias's gradient; with a softcap, then dS ∘= 1 − tanh²)
//! dK_j += dSᵀ · (scale·Q_i)
//! dQ_i += dS · K_j               (times scale at the end)
//! ```
//!
//! Every product runs on the forward's two kernels: `scores` (rows against
//! packed panels: `S` with keys packed, `dP` with values packed the same way)
//! and `accumulate_values` (rows of weights times rows: `Pᵀ` and `dSᵀ`, read
//! from the same tiles with their strides swapped, for `dV` and `dK`; `dS`
//! for `dQ`).
//!
//! Masked entries are selected out as in the forward: `P = 0` there, `dS`
//! is set to 0 rather than computed as `0·(dP − D)` (a masked value may be
//! NaN), key tiles holding a NaN or infinity go through the zero-skipping
//! product for `dQ`, and the query rows that see no key are zeroed before
//! they take part in `dK` and `dV`.

use ndarray::{Array2, ArrayView2, ArrayViewMut2, ArrayViewMut3, Axis, Zip, s};

use super::pack::{PackedHead, QueryRows};
use super::scratch::Scratch;
use super::tile::{TilePosition, TileSpan, add_alibi, add_bias, mask};
use super::{KEY_TILE, QUERY_TILE};
use crate::alloc::{element_count, try_zeros};
use crate::call::{AttentionShape, BackwardCall, head};
use crate::error::AttentionError;
use crate::gradients::GradientsViewMut;
use crate::mask::broadcast;
use crate::parallel::{map_with, split_into_chunks};
use crate::simd::{Kernel, ValueRows, WithKernel, ZeroWeights};

/// One backward call, waiting for its kernel.
pub(super) struct Backward<'c, 'a, 'g> {
    pub(super) call: &'c BackwardCall<'a, f32>,
    pub(super) gradients: GradientsViewMut<'g, f32>,
}

/// One `(batch, kv_head)` work item and the gradients it writes.
struct HeadJob<'g> {
    b: usize,
    kv_h: usize,
    /// `[group, len_q, d_k]`: the query heads sharing the kv head.
    d_q: ArrayViewMut3<'g, f32>,
    /// `[len_kv, d_k]` and `[len_kv, d_v]`, summed over the group's heads.
    d_k: ArrayViewMut2<'g, f32>,
    d_v: ArrayViewMut2<'g, f32>,
}

/// What a work item returns besides what it writes: per query head of
/// the group, `dS` `[len_q, len_kv]` when the call has a bias.
type HeadScores = Vec<Option<Array2<f32>>>;

impl WithKernel for Backward<'_, '_, '_> {
    type Output = Result<(), AttentionError>;

    fn run<K: Kernel>(self, kernel: K) -> Self::Output {
        let Backward { call, gradients } = self;
        let GradientsViewMut {
            mut d_q,
            mut d_k,
            mut d_v,
            mut d_bias,
        } = gradients;
        // The bias gradient is a sum over work items; every other gradient
        // is written whole by the item that owns it.
        if let Some(d_bias) = d_bias.as_mut() {
            d_bias.fill(0.0);
        }
        let shape = call.forward.shape;
        // With no value columns the output is empty and every gradient 0.
        if shape.d_v == 0 || shape.len_q == 0 || shape.len_kv == 0 {
            d_q.fill(0.0);
            d_k.fill(0.0);
            d_v.fill(0.0);
            return Ok(());
        }
        // Each work item gets the gradient views it alone writes: `d_k` and
        // `d_v` of its kv head, `d_q` of the query heads sharing it.
        let group = shape.group();
        let mut jobs = Vec::with_capacity(shape.batch * shape.kv_heads);
        for (b, ((d_q_b, d_k_b), d_v_b)) in d_q
            .outer_iter_mut()
            .zip(d_k.outer_iter_mut())
            .zip(d_v.outer_iter_mut())
            .enumerate()
        {
            let d_q_groups = split_into_chunks(d_q_b, Axis(0), group);
            for (kv_h, ((d_q, d_k), d_v)) in d_q_groups
                .into_iter()
                .zip(d_k_b.into_outer_iter_mut())
                .zip(d_v_b.into_outer_iter_mut())
                .enumerate()
            {
                jobs.push(HeadJob {
                    b,
                    kv_h,
                    d_q,
                    d_k,
                    d_v,
                });
            }
        }
        let results = map_with(
            jobs,
            || BackwardScratch::new::<K>(&shape, call.forward.opts.softcap.is_some()),
            |scratch, job| {
                let scratch = scratch.as_mut().map_err(|error| error.clone())?;
                let (b, kv_h) = (job.b, job.kv_h);
                Ok::<_, AttentionError>(((b, kv_h), head_gradients(kernel, call, scratch, job)?))
            },
        );
        let results = results.into_iter().collect::<Result<Vec<_>, _>>()?;
        let Some(d_bias) = d_bias.as_mut() else {
            return Ok(());
        };
        // The bias has the whole sequence's columns; this call's key j is
        // column key_offset + j. Summed in job order, so sums over
        // broadcast bias dimensions are the same for any thread count.
        let key_offset = call.forward.key_offset();
        let shape_bias = d_bias.shape().to_vec();
        for ((b, kv_h), d_scores) in results {
            for (g, d_scores) in d_scores.iter().enumerate() {
                let h = kv_h * group + g;
                let Some(d_scores) = d_scores else { continue };
                let mut d_bias_bh = d_bias
                    .index_axis_mut(Axis(0), broadcast(shape_bias[0], b))
                    .index_axis_move(Axis(0), broadcast(shape_bias[1], h));
                for ((i, j), &ds) in d_scores.indexed_iter() {
                    let column = broadcast(shape_bias[3], key_offset + j);
                    d_bias_bh[[broadcast(shape_bias[2], i), column]] += ds;
                }
            }
        }
        Ok(())
    }
}

/// The gradients of one `(batch, kv_head)` and the query heads sharing
/// it, written into the job's views of `d_q`, `d_k` and `d_v`; returns
/// each query head's `dS` when the call has a bias. On an error some views
/// may have been written (a caller's arrays are then partly written, as
/// `scaled_dot_product_attention_backward_into` documents).
fn head_gradients<'c, K: Kernel>(
    kernel: K,
    call: &'c BackwardCall<'_, f32>,
    buffers: &mut BackwardScratch<'c>,
    job: HeadJob<'_>,
) -> Result<HeadScores, AttentionError> {
    let HeadJob {
        b,
        kv_h,
        d_q: mut d_q_out,
        d_k: mut d_k_out,
        d_v: mut d_v_out,
    } = job;
    let forward = &call.forward;
    let shape = forward.shape;
    let (len_q, len_kv, d_k, d_v) = (shape.len_q, shape.len_kv, shape.d_k, shape.d_v);
    let (k_head, v_head) = (head(&forward.k, b, kv_h), head(&forward.v, b, kv_h));
    let BackwardScratch {
        keys_first,
        values_first,
        rows,
        tiles: scratch,
    } = buffers;
    // The backward scales its query rows (`QueryRows`), not the keys.
    keys_first.pack(kernel, k_head, 1.0, None)?;
    values_first.pack(kernel, v_head, 1.0, Some(k_head))?;
    let k_width = d_k.div_ceil(K::LANES) * K::LANES;
    let v_width = d_v.div_ceil(K::LANES) * K::LANES;
    let padded_keys = len_kv.div_ceil(KEY_TILE) * KEY_TILE;
    let accumulator = |what, rows, width| {
        let len = element_count::<f32>(what, &[rows, width])?;
        Ok::<_, AttentionError>((Scratch::zeroed(what, len)?, (rows, width)))
    };
    let (mut d_k_buffer, d_k_dim) = accumulator("d_k", padded_keys, k_width)?;
    let (mut d_v_buffer, d_v_dim) = accumulator("d_v", padded_keys, v_width)?;
    let mut d_k_acc = ArrayViewMut2::from_shape(d_k_dim, &mut d_k_buffer[..]).expect("its size");
    let mut d_v_acc = ArrayViewMut2::from_shape(d_v_dim, &mut d_v_buffer[..]).expect("its size");

    let group = shape.group();
    let mut d_scores = Vec::with_capacity(group);
    for (g, mut d_q_out) in d_q_out.outer_iter_mut().enumerate() {
        let h = kv_h * group + g;
        rows.fill(kernel, call, b, h);
        let (mut d_q_buffer, d_q_dim) = accumulator("d_q", rows.padded, k_width)?;
        let mut d_q_acc =
            ArrayViewMut2::from_shape(d_q_dim, &mut d_q_buffer[..]).expect("its size");
        let mut d_scores_h: Option<Array2<f32>> = match forward.opts.bias {
            Some(_) => Some(try_zeros("the bias gradient", (len_q, len_kv))?),
            None => None,
        };
        let tiles: Vec<(TilePosition, TileSpan)> = (0..len_q)
            .step_by(QUERY_TILE)
            .map(|i0| {
                let at = TilePosition {
                    b,
                    h,
                    i0,
                    rows: QUERY_TILE.min(len_q - i0),
                    heads: 1,
                };
                let span = TileSpan::of(&at, forward);
                (at, span)
            })
            .collect();
        for t in 0..padded_keys / KEY_TILE {
            let j0 = t * KEY_TILE;
            for (at, span) in tiles.iter().filter(|(_, span)| span.sees_tile(j0)) {
                let step = TileStep { at, span, j0, t };
                let packed = PackedInputs {
                    rows,
                    keys_first,
                    values_first,
                };
                let sums = GradientSums {
                    d_k: d_k_acc.view_mut(),
                    d_v: d_v_acc.view_mut(),
                    d_q: d_q_acc.view_mut(),
                    d_scores: d_scores_h.as_mut(),
                };
                scratch.step(kernel, forward, &step, &packed, sums);
            }
        }
        let scale = forward.scale;
        Zip::from(&mut d_q_out)
            .and(d_q_acc.slice(s![..len_q, ..d_k]))
            .for_each(|out, &sum| *out = sum * scale);
        d_scores.push(d_scores_h);
    }
    d_k_out.assign(&d_k_acc.slice(s![..len_kv, ..d_k]));
    d_v_out.assign(&d_v_acc.slice(s![..len_kv, ..d_v]));
    Ok(d_scores)
}

/// The buffers of a thread's work items, reused from item to item (every
/// item of a call has the same shapes, and packing rewrites all but the
/// padding, which stays zero).
struct BackwardScratch<'a> {
    /// Keys packed as panels (for `S`); no rows.
    keys_first: PackedHead<'a>,
    /// Values packed as panels (for `dP`) with keys as rows (for `dQ`),
    /// packed or read in place.
    values_first: PackedHead<'a>,
    rows: QueryRows,
    tiles: TileBuffers,
}

impl BackwardScratch<'_> {
    fn new<K: Kernel>(shape: &AttentionShape, softcap: bool) -> Result<Self, AttentionError> {
        Ok(BackwardScratch {
            keys_first: PackedHead::new::<K>(shape.len_kv, shape.d_k, 0)?,
            values_first: PackedHead::new::<K>(shape.len_kv, shape.d_v, shape.d_k)?,
            rows: QueryRows::new::<K>(shape)?,
            tiles: TileBuffers::new::<K>(softcap),
        })
    }
}

/// The packed operands of one `(batch, kv_head)` and query head.
struct PackedInputs<'p, 'a> {
    rows: &'p QueryRows,
    keys_first: &'p PackedHead<'a>,
    values_first: &'p PackedHead<'a>,
}

/// The accumulators one step adds to: `dK`, `dV` of the key/value head and
/// `dQ` of the query head, padded; `dS` `[len_q, len_kv]` with a bias.
struct GradientSums<'s> {
    d_k: ArrayViewMut2<'s, f32>,
    d_v: ArrayViewMut2<'s, f32>,
    d_q: ArrayViewMut2<'s, f32>,
    d_scores: Option<&'s mut Array2<f32>>,
}

/// Which query tile meets which key tile.
struct TileStep<'s> {
    at: &'s TilePosition,
    span: &'s TileSpan,
    /// First key of the key tile, and its index.
    j0: usize,
    t: usize,
}

/// The per-step buffers, reused from step to step.
struct TileBuffers {
    /// `S`, then `P`, `[QUERY_TILE][KEY_TILE]`.
    p: Vec<f32>,
    /// `dP`, then `dS`, `[QUERY_TILE][KEY_TILE]`.
    d_s: Vec<f32>,
    /// All ones: the `α` of accumulations that only add.
    ones: Vec<f32>,
    /// With a softcap, `1 − tanh²(s/cap)` of each score, `[QUERY_TILE][KEY_TILE]`;
    /// empty without one.
    softcap_slopes: Vec<f32>,
}

impl TileBuffers {
    fn new<K: Kernel>(softcap: bool) -> Self {
        let rows = QUERY_TILE.div_ceil(K::ROWS) * K::ROWS;
        TileBuffers {
            p: vec![0.0; rows * KEY_TILE],
            d_s: vec![0.0; rows * KEY_TILE],
            ones: vec![1.0; rows.max(KEY_TILE)],
            softcap_slopes: vec![0.0; if softcap { rows * KEY_TILE } else { 0 }],
        }
    }

    /// One query tile against one key tile: adds to `dK_j`, `dV_j`, `dQ_i`
    /// and, with a bias, stores `dS`.
    fn step<K: Kernel>(
        &mut self,
        kernel: K,
        forward: &crate::call::Call<'_, f32>,
        step: &TileStep<'_>,
        packed: &PackedInputs<'_, '_>,
        sums: GradientSums<'_>,
    ) {
        let shape = &forward.shape;
        let PackedInputs {
            rows,
            keys_first,
            values_first,
        } = *packed;
        let GradientSums {
            d_k: mut d_k_acc,
            d_v: mut d_v_acc,
            d_q: mut d_q_acc,
            d_scores,
        } = sums;
        let (d_k, d_v) = (shape.d_k, shape.d_v);
        let TileStep { at, span, j0, t } = *step;
        let (i0, n) = (at.i0, at.rows.div_ceil(K::ROWS) * K::ROWS);
        let (k_width, v_width) = (d_k_acc.ncols(), d_v_acc.ncols());
        let p = &mut self.p[..n * KEY_TILE];
        let d_s = &mut self.d_s[..n * KEY_TILE];

        // P = exp(S − lse), masked entries exactly 0.
        kernel.scores(
            &rows.q_scaled[i0 * d_k..(i0 + n) * d_k],
            d_k,
            keys_first.tile_panels(j0, d_k),
            p,
            KEY_TILE,
        );
        let softcap = forward.opts.softcap;
        if let Some(cap) = softcap {
            // The cap comes before the bias; its derivative from the
            // capped score c·t is 1 − t².
            kernel.softcap(p, cap);
            for (slope, &capped) in self.softcap_slopes.iter_mut().zip(p.iter()) {
                let t = capped / cap;
                *slope = 1.0 - t * t;
            }
        }
        add_bias(p, at, j0, forward);
        add_alibi(p, at, j0, forward);
        if span.needs_mask(j0, forward) {
            mask(p, at, j0, forward);
        }
        kernel.exp_rows_shifted(p, KEY_TILE, KEY_TILE, &rows.log_sum_exp[i0..i0 + n]);

        // dV_j += Pᵀ · dO_i (Pᵀ is P read with its strides swapped).
        let p_tile = ArrayView2::from_shape((n, KEY_TILE), &*p).expect("a whole tile");
        let d_v_tile = d_v_acc
            .slice_mut(s![j0..j0 + KEY_TILE, ..])
            .into_slice()
            .expect("a standard-layout tile");
        kernel.accumulate_values(
            p_tile.t(),
            rows.d_out_rows(i0, n),
            v_width,
            &self.ones[..KEY_TILE],
            d_v_tile,
            ZeroWeights::Multiply,
            ValueRows::Packed,
        );

        // dS = P ∘ (dP − D), with dP = dO_i · V_jᵀ; 0 wherever P is.
        kernel.scores(
            &rows.d_out[i0 * d_v..(i0 + n) * d_v],
            d_v,
            values_first.tile_panels(j0, d_v),
            d_s,
            KEY_TILE,
        );
        kernel.softmax_gradient(p, d_s, KEY_TILE, &rows.delta[i0..i0 + n]);
        if let Some(d_scores) = d_scores {
            let keys = KEY_TILE.min(shape.len_kv - j0);
            for r in 0..at.rows {
                for (j, &ds) in d_s[r * KEY_TILE..][..keys].iter().enumerate() {
                    d_scores[[i0 + r, j0 + j]] = ds;
                }
            }
        }

        // The bias gradient is the capped score's (above); the product's
        // is dS·(1 − tanh²).
        if softcap.is_some() {
            for (ds, &slope) in d_s.iter_mut().zip(&self.softcap_slopes) {
                if *ds != 0.0 {
                    *ds *= slope;
                }
            }
        }

        // dK_j += dSᵀ · (scale·Q_i).
        let d_s_tile = ArrayView2::from_shape((n, KEY_TILE), &*d_s).expect("a whole tile");
        let d_k_tile = d_k_acc
            .slice_mut(s![j0..j0 + KEY_TILE, ..])
            .into_slice()
            .expect("a standard-layout tile");
        kernel.accumulate_values(
            d_s_tile.t(),
            rows.q_scaled_rows(i0, n),
            k_width,
            &self.ones[..KEY_TILE],
            d_k_tile,
            ZeroWeights::Multiply,
            ValueRows::Packed,
        );

        // dQ_i += dS · K_j (scaled at the end).
        let k_rows = values_first.tile_rows(j0);
        let d_q_tile = d_q_acc
            .slice_mut(s![i0..i0 + n, ..])
            .into_slice()
            .expect("a standard-layout tile");
        let zero_weights = if values_first.tile_has_nonfinite_rows[t] {
            ZeroWeights::Skip
        } else {
            ZeroWeights::Multiply
        };
        kernel.accumulate_values(
            d_s_tile,
            k_rows,
            k_width,
            &self.ones[..n],
            d_q_tile,
            zero_weights,
            ValueRows::Packed,
        );
    }
}
