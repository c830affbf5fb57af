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
//! P    = exp(S − lse)            S = (scale·Q_i)·K_jᵀ (+ bias), masked = −inf
//! dV_j += Pᵀ · dO_i
//! dP   = dO_i · V_jᵀ
//! dS   = P ∘ (dP − D_i)          D_i = rowsum(dO_i ∘ O_i); 0 wherever P = 0
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

use ndarray::{Array2, ArrayView1, ArrayView2, ArrayView3, ArrayView4, Axis, s};

use super::{
    KEY_TILE, PackedKeysValues, QUERY_TILE, TilePosition, TileSpan,
    accumulate_skipping_zero_weights, add_bias, kernel_set, mask,
};
use crate::core::backward::GradientsViewMut;
use crate::core::{head, head_mut};
use crate::error::AttentionError;
use crate::options::{AttentionOptions, broadcast};
use crate::parallel::map_with;
use crate::shape::AttentionShape;
use crate::simd::{self, Kernel, WithKernel};

/// The backward pass on the fused path, with the kernel set the options or
/// the environment choose. Arguments checked by `check_backward`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_into(
    q: &ArrayView4<'_, f32>,
    k: &ArrayView4<'_, f32>,
    v: &ArrayView4<'_, f32>,
    opts: &AttentionOptions<'_, f32>,
    shape: &AttentionShape,
    scale: f32,
    out: &ArrayView4<'_, f32>,
    log_sum_exp: &ArrayView3<'_, f32>,
    d_out: &ArrayView4<'_, f32>,
    gradients: GradientsViewMut<'_, f32>,
) -> Result<(), AttentionError> {
    let inputs = BackwardInputs {
        q,
        k,
        v,
        opts,
        shape,
        scale,
        out,
        log_sum_exp,
        d_out,
    };
    simd::with_kernel(kernel_set(opts)?, FusedBackward { inputs, gradients })
}

/// The inputs of one backward call.
#[derive(Clone, Copy)]
struct BackwardInputs<'c, 'a, 'o> {
    q: &'c ArrayView4<'a, f32>,
    k: &'c ArrayView4<'a, f32>,
    v: &'c ArrayView4<'a, f32>,
    opts: &'c AttentionOptions<'o, f32>,
    shape: &'c AttentionShape,
    scale: f32,
    out: &'c ArrayView4<'a, f32>,
    log_sum_exp: &'c ArrayView3<'a, f32>,
    d_out: &'c ArrayView4<'a, f32>,
}

/// One backward call, waiting for its kernel.
struct FusedBackward<'c, 'a, 'o, 'g> {
    inputs: BackwardInputs<'c, 'a, 'o>,
    gradients: GradientsViewMut<'g, f32>,
}

/// What one `(batch, kv_head)` work item computes.
struct HeadGradients {
    /// `[len_kv, d_k]` and `[len_kv, d_v]`, summed over the group's heads.
    d_k: Array2<f32>,
    d_v: Array2<f32>,
    /// Per query head of the group, `[len_q, d_k]`.
    d_q: Vec<Array2<f32>>,
    /// Per query head of the group, `dS` `[len_q, len_kv]`, when a bias was given.
    d_scores: Vec<Option<Array2<f32>>>,
}

impl WithKernel for FusedBackward<'_, '_, '_, '_> {
    type Output = ();

    fn run<K: Kernel>(self, kernel: K) {
        let FusedBackward { inputs, gradients } = self;
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
        let shape = *inputs.shape;
        // With no value columns the output is empty and every gradient 0.
        if shape.d_v == 0 || shape.len_q == 0 || shape.len_kv == 0 {
            d_q.fill(0.0);
            d_k.fill(0.0);
            d_v.fill(0.0);
            return;
        }
        let jobs: Vec<_> = (0..shape.batch)
            .flat_map(|b| (0..shape.kv_heads).map(move |kv_h| (b, kv_h)))
            .collect();
        let results = map_with(
            jobs.clone(),
            || BackwardScratch::new::<K>(&shape),
            |scratch, (b, kv_h)| head_gradients(kernel, &inputs, scratch, b, kv_h),
        );
        // Written in job order, so sums over broadcast bias dimensions are
        // the same for any thread count.
        let group = shape.heads / shape.kv_heads;
        for ((b, kv_h), result) in jobs.into_iter().zip(results) {
            head_mut(&mut d_k, b, kv_h).assign(&result.d_k);
            head_mut(&mut d_v, b, kv_h).assign(&result.d_v);
            for (g, (d_q_h, d_scores)) in result.d_q.iter().zip(&result.d_scores).enumerate() {
                let h = kv_h * group + g;
                head_mut(&mut d_q, b, h).assign(d_q_h);
                if let (Some(d_bias), Some(d_scores)) = (d_bias.as_mut(), d_scores) {
                    let shape_bias = d_bias.shape().to_vec();
                    let mut d_bias_bh = d_bias
                        .index_axis_mut(Axis(0), broadcast(shape_bias[0], b))
                        .index_axis_move(Axis(0), broadcast(shape_bias[1], h));
                    for ((i, j), &ds) in d_scores.indexed_iter() {
                        d_bias_bh[[broadcast(shape_bias[2], i), broadcast(shape_bias[3], j)]] += ds;
                    }
                }
            }
        }
    }
}

/// The gradients of one `(batch, kv_head)` and the query heads sharing it.
fn head_gradients<K: Kernel>(
    kernel: K,
    inputs: &BackwardInputs<'_, '_, '_>,
    buffers: &mut BackwardScratch,
    b: usize,
    kv_h: usize,
) -> HeadGradients {
    let shape = *inputs.shape;
    let (len_q, len_kv, d_k, d_v) = (shape.len_q, shape.len_kv, shape.d_k, shape.d_v);
    let (k_head, v_head) = (head(inputs.k, b, kv_h), head(inputs.v, b, kv_h));
    let BackwardScratch {
        keys_first,
        values_first,
        rows,
        tiles: scratch,
    } = buffers;
    keys_first.pack::<K>(k_head, v_head);
    values_first.pack::<K>(v_head, k_head);
    let k_width = d_k.div_ceil(K::LANES) * K::LANES;
    let v_width = d_v.div_ceil(K::LANES) * K::LANES;
    let padded_keys = len_kv.div_ceil(KEY_TILE) * KEY_TILE;
    let mut d_k_acc = Array2::<f32>::zeros((padded_keys, k_width));
    let mut d_v_acc = Array2::<f32>::zeros((padded_keys, v_width));

    let group = shape.heads / shape.kv_heads;
    let mut d_q = Vec::with_capacity(group);
    let mut d_scores = Vec::with_capacity(group);
    for h in kv_h * group..(kv_h + 1) * group {
        rows.fill(inputs, b, h);
        let mut d_q_acc = Array2::<f32>::zeros((rows.padded, k_width));
        let mut d_scores_h = inputs
            .opts
            .bias
            .as_ref()
            .map(|_| Array2::<f32>::zeros((len_q, len_kv)));
        let tiles: Vec<(TilePosition, TileSpan)> = (0..len_q)
            .step_by(QUERY_TILE)
            .map(|i0| {
                let at = TilePosition {
                    b,
                    h,
                    i0,
                    rows: QUERY_TILE.min(len_q - i0),
                };
                let span = TileSpan::of(&at, inputs.opts, &shape);
                (at, span)
            })
            .collect();
        for t in 0..padded_keys / KEY_TILE {
            let j0 = t * KEY_TILE;
            for (at, span) in tiles.iter().filter(|(_, span)| span.sees_tile(j0)) {
                let step = TileStep { at, span, j0, t };
                scratch.step(
                    kernel,
                    inputs,
                    &step,
                    rows,
                    keys_first,
                    values_first,
                    &mut d_k_acc,
                    &mut d_v_acc,
                    &mut d_q_acc,
                    d_scores_h.as_mut(),
                );
            }
        }
        d_q.push(d_q_acc.slice(s![..len_q, ..d_k]).mapv(|x| x * inputs.scale));
        d_scores.push(d_scores_h);
    }
    HeadGradients {
        d_k: d_k_acc.slice(s![..len_kv, ..d_k]).to_owned(),
        d_v: d_v_acc.slice(s![..len_kv, ..d_v]).to_owned(),
        d_q,
        d_scores,
    }
}

/// The buffers of a thread's work items, reused from item to item (every
/// item of a call has the same shapes, and packing rewrites all but the
/// padding, which stays zero).
struct BackwardScratch {
    /// Keys packed as panels (for `S`) with values as rows.
    keys_first: PackedKeysValues,
    /// Values packed as panels (for `dP`) with keys as rows (for `dQ`).
    values_first: PackedKeysValues,
    rows: QueryRows,
    tiles: TileBuffers,
}

impl BackwardScratch {
    fn new<K: Kernel>(shape: &AttentionShape) -> Self {
        BackwardScratch {
            keys_first: PackedKeysValues::new::<K>(shape.len_kv, shape.d_k, shape.d_v),
            values_first: PackedKeysValues::new::<K>(shape.len_kv, shape.d_v, shape.d_k),
            rows: QueryRows::new::<K>(shape),
            tiles: TileBuffers::new::<K>(),
        }
    }
}

/// One query head's rows, packed for the kernels; rows padded to whole
/// query tiles. Rows that see no key (log-sum-exp `−inf`) and
/// padding rows are zero, and their log-sum-exp is `−inf`, so they add
/// nothing anywhere.
struct QueryRows {
    /// `scale·q`, `[padded][d_k]` for `scores`, and `[padded][k_width]` as rows.
    q_scaled: Vec<f32>,
    q_scaled_rows: Array2<f32>,
    /// `d_out`, `[padded][d_v]` for `scores`, and `[padded][v_width]` as rows.
    d_out: Vec<f32>,
    d_out_rows: Array2<f32>,
    /// `D_i = Σ_c dO_ic · O_ic`.
    delta: Vec<f32>,
    log_sum_exp: Vec<f32>,
    padded: usize,
}

impl QueryRows {
    /// Zeroed buffers for one query head of `shape`.
    fn new<K: Kernel>(shape: &AttentionShape) -> Self {
        let (d_k, d_v) = (shape.d_k, shape.d_v);
        let padded = shape.len_q.div_ceil(QUERY_TILE) * QUERY_TILE;
        let (k_width, v_width) = (
            d_k.div_ceil(K::LANES) * K::LANES,
            d_v.div_ceil(K::LANES) * K::LANES,
        );
        QueryRows {
            q_scaled: vec![0.0; padded * d_k],
            q_scaled_rows: Array2::zeros((padded, k_width)),
            d_out: vec![0.0; padded * d_v],
            d_out_rows: Array2::zeros((padded, v_width)),
            delta: vec![0.0; padded],
            log_sum_exp: vec![f32::NEG_INFINITY; padded],
            padded,
        }
    }

    /// Packs query head `h` of batch item `b`. Every real row is written
    /// (zeros for rows that see no key); padding rows stay as `new` made
    /// them, so the buffers serve head after head.
    fn fill(&mut self, inputs: &BackwardInputs<'_, '_, '_>, b: usize, h: usize) {
        let (d_k, d_v) = (inputs.shape.d_k, inputs.shape.d_v);
        let (q, out, d_out) = (
            head(inputs.q, b, h),
            head(inputs.out, b, h),
            head(inputs.d_out, b, h),
        );
        let lse = inputs
            .log_sum_exp
            .index_axis(Axis(0), b)
            .index_axis_move(Axis(0), h);
        let rows = q
            .rows()
            .into_iter()
            .zip(out.rows())
            .zip(d_out.rows())
            .zip(&lse)
            .zip(self.q_scaled.chunks_exact_mut(d_k))
            .zip(self.q_scaled_rows.rows_mut())
            .zip(self.d_out.chunks_exact_mut(d_v))
            .zip(self.d_out_rows.rows_mut())
            .zip(self.delta.iter_mut().zip(self.log_sum_exp.iter_mut()));
        for (
            (((((((q, out), d_out), &lse), q_scaled), mut q_row), d_out_packed), mut d_out_row),
            (delta, lse_packed),
        ) in rows
        {
            // Rows that see no key are zero, whatever q and d_out hold there.
            let sees_keys = lse != f32::NEG_INFINITY;
            *lse_packed = lse;
            copy_scaled(q_scaled, q, if sees_keys { inputs.scale } else { 0.0 });
            copy_scaled(d_out_packed, d_out, if sees_keys { 1.0 } else { 0.0 });
            q_row.as_slice_mut().expect("contiguous")[..d_k].copy_from_slice(q_scaled);
            d_out_row.as_slice_mut().expect("contiguous")[..d_v].copy_from_slice(d_out_packed);
            *delta = if sees_keys {
                d_out_packed
                    .iter()
                    .zip(out.iter())
                    .map(|(&g, &o)| g * o)
                    .sum()
            } else {
                0.0
            };
        }
    }
}

/// `to[c] = factor · from[c]`, on slices when `from` is contiguous. A zero
/// factor writes zeros even where `from` holds NaN.
fn copy_scaled(to: &mut [f32], from: ArrayView1<'_, f32>, factor: f32) {
    if factor == 0.0 {
        to.fill(0.0);
        return;
    }
    match from.as_slice() {
        Some(from) => to.iter_mut().zip(from).for_each(|(t, &x)| *t = factor * x),
        None => to
            .iter_mut()
            .zip(from.iter())
            .for_each(|(t, &x)| *t = factor * x),
    }
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
}

impl TileBuffers {
    fn new<K: Kernel>() -> Self {
        let rows = QUERY_TILE.div_ceil(K::ROWS) * K::ROWS;
        TileBuffers {
            p: vec![0.0; rows * KEY_TILE],
            d_s: vec![0.0; rows * KEY_TILE],
            ones: vec![1.0; rows.max(KEY_TILE)],
        }
    }

    /// One query tile against one key tile: adds to `dK_j`, `dV_j`, `dQ_i`
    /// and, with a bias, stores `dS`.
    #[allow(clippy::too_many_arguments)]
    fn step<K: Kernel>(
        &mut self,
        kernel: K,
        inputs: &BackwardInputs<'_, '_, '_>,
        step: &TileStep<'_>,
        rows: &QueryRows,
        keys_first: &PackedKeysValues,
        values_first: &PackedKeysValues,
        d_k_acc: &mut Array2<f32>,
        d_v_acc: &mut Array2<f32>,
        d_q_acc: &mut Array2<f32>,
        d_scores: Option<&mut Array2<f32>>,
    ) {
        let shape = inputs.shape;
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
            &keys_first.key_panels[j0 * d_k..(j0 + KEY_TILE) * d_k],
            p,
            KEY_TILE,
        );
        add_bias(p, at, j0, inputs.opts, shape);
        if span.needs_mask(j0, inputs.opts) {
            mask(p, at, j0, inputs.opts, shape);
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
            rows.d_out_rows.slice(s![i0..i0 + n, ..]),
            v_width,
            &self.ones[..KEY_TILE],
            d_v_tile,
        );

        // dS = P ∘ (dP − D), with dP = dO_i · V_jᵀ; 0 wherever P is.
        kernel.scores(
            &rows.d_out[i0 * d_v..(i0 + n) * d_v],
            d_v,
            &values_first.key_panels[j0 * d_v..(j0 + KEY_TILE) * d_v],
            d_s,
            KEY_TILE,
        );
        for r in 0..n {
            let delta = rows.delta[i0 + r];
            let (p_row, d_s_row) = (
                &p[r * KEY_TILE..][..KEY_TILE],
                &mut d_s[r * KEY_TILE..][..KEY_TILE],
            );
            for (ds, &pr) in d_s_row.iter_mut().zip(p_row) {
                *ds = if pr == 0.0 { 0.0 } else { pr * (*ds - delta) };
            }
        }
        if let Some(d_scores) = d_scores {
            let keys = KEY_TILE.min(shape.len_kv - j0);
            for r in 0..at.rows {
                for (j, &ds) in d_s[r * KEY_TILE..][..keys].iter().enumerate() {
                    d_scores[[i0 + r, j0 + j]] = ds;
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
            rows.q_scaled_rows.slice(s![i0..i0 + n, ..]),
            k_width,
            &self.ones[..KEY_TILE],
            d_k_tile,
        );

        // dQ_i += dS · K_j (scaled at the end).
        let k_rows = values_first.values.slice(s![j0..j0 + KEY_TILE, ..]);
        let d_q_tile = d_q_acc
            .slice_mut(s![i0..i0 + n, ..])
            .into_slice()
            .expect("a standard-layout tile");
        if values_first.tile_has_nonfinite_values[t] {
            accumulate_skipping_zero_weights(d_s_tile, k_rows, &self.ones[..n], d_q_tile);
        } else {
            kernel.accumulate_values(d_s_tile, k_rows, k_width, &self.ones[..n], d_q_tile);
        }
    }
}
