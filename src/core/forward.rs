//! The reference forward pass: per `(batch, head)`, the scores as one
//! matrix product, a softmax per row by selection, and the weighted sum of
//! the values as a second product.

use std::ops::Range;

// Slices by `slice_axis`: `s!` expands to an `#[allow(unsafe_code)]`, which
// `core`'s `#![forbid(unsafe_code)]` rejects.
use ndarray::linalg::general_mat_mul;
use ndarray::{
    ArrayView2, ArrayViewMut1, ArrayViewMut2, ArrayViewMut3, ArrayViewMut4, Axis, Slice,
};

use crate::alloc::try_zeros;
use crate::call::{Call, head, head_mut};
use crate::element::Element;
use crate::error::AttentionError;
use crate::mask::{VisibleKeys, biased, broadcast};
use crate::modifiers::{AlibiRow, apply_sink, softcapped};

/// Weights held at once per head, in elements: the reference computes a
/// block of query rows at a time, so its memory is bounded (8 MiB in `f64`)
/// whatever the sequence length.
const WEIGHT_BLOCK_ELEMENTS: usize = 1 << 20;

/// The reference computation on a checked call; also writes each row's
/// log-sum-exp of its scaled, biased, visible scores into `log_sum_exp`
/// (`[batch, heads, len_q]`) when given.
///
/// # Errors
/// When a block of weights cannot be allocated.
pub(crate) fn forward<F: Element>(
    call: &Call<'_, F>,
    mut out: ArrayViewMut4<'_, F>,
    mut log_sum_exp: Option<ArrayViewMut3<'_, F>>,
) -> Result<(), AttentionError> {
    let shape = call.shape;
    let block_rows = (WEIGHT_BLOCK_ELEMENTS / shape.len_kv.max(1)).clamp(1, shape.len_q.max(1));
    let mut block = try_zeros("a block of attention weights", (block_rows, shape.len_kv))?;
    let mut block_lse = try_zeros("a block of log-sum-exps", block_rows)?;
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let vh = head(&call.v, b, shape.kv_head(h));
            let mut out_h = head_mut(&mut out, b, h);
            for i0 in (0..shape.len_q).step_by(block_rows) {
                let rows = i0..(i0 + block_rows).min(shape.len_q);
                let mut weights = block.slice_axis_mut(Axis(0), Slice::from(..rows.len()));
                let mut lse = block_lse.slice_axis_mut(Axis(0), Slice::from(..rows.len()));
                rows_weights(call, b, h, rows.clone(), weights.view_mut(), lse.view_mut())?;
                let mut out_rows = out_h.slice_axis_mut(Axis(0), Slice::from(rows.clone()));
                weighted_values(weights.view(), vh, out_rows.view_mut());
                // The sink scales each output row, after the values, as on
                // the fused path: its share scaled into the weights first
                // could round a visible key's weight to exactly 0 (a sink
                // of 100 over scores near 10 leaves `f32` weights of e^−90
                // and less), and a NaN value there would be skipped.
                if let Some(sink) = call.sink(h) {
                    for (row, lse) in out_rows.rows_mut().into_iter().zip(lse.iter_mut()) {
                        apply_sink(row, lse, sink);
                    }
                }
                if let Some(log_sum_exp) = log_sum_exp.as_mut() {
                    log_sum_exp
                        .index_axis_mut(Axis(0), b)
                        .index_axis_mut(Axis(0), h)
                        .slice_axis_mut(Axis(0), Slice::from(rows))
                        .assign(&lse);
                }
            }
        }
    }
    Ok(())
}

/// The weights of query rows `rows` of batch item `b`, head `h` against
/// every key, `[rows, len_kv]`, into `weights`, and each row's log-sum-exp
/// into `log_sum_exp`: of the keys alone, without the head's sink, which
/// the caller applies to what it makes of them ([`apply_sink`]).
///
/// # Errors
/// When the block of scaled queries cannot be allocated.
pub(crate) fn rows_weights<F: Element>(
    call: &Call<'_, F>,
    b: usize,
    h: usize,
    rows: Range<usize>,
    mut weights: ArrayViewMut2<'_, F>,
    mut log_sum_exp: ArrayViewMut1<'_, F>,
) -> Result<(), AttentionError> {
    let qh = head(&call.q, b, h);
    let kh = head(&call.k, b, call.shape.kv_head(h));
    // The scale multiplies Q before the product, as on the fused path: a
    // scale of 0 then gives scores of 0, never 0·inf.
    let mut q_scaled = try_zeros("a block of scaled queries", (rows.len(), call.shape.d_k))?;
    q_scaled.zip_mut_with(
        &qh.slice_axis(Axis(0), Slice::from(rows.clone())),
        |y, &x| *y = call.scale * x,
    );
    // Scores of masked keys are computed too (a matrix product cannot skip
    // them); `softmax_row` then discards them by selection, so NaN or inf
    // there does no harm.
    general_mat_mul(F::one(), &q_scaled, &kh.t(), F::zero(), &mut weights);
    for (r, mut row) in weights.rows_mut().into_iter().enumerate() {
        let i = rows.start + r;
        if !row.iter().all(|s| s.is_finite()) {
            call.mark_overflowed_scores(b, h, i, 0, row.view_mut());
        }
        let visible = call.visible_keys(b, h, i);
        let bias = call.bias_row(b, h, i);
        let modifiers = RowModifiers {
            softcap: call.opts.softcap,
            alibi: call.alibi(h, i),
        };
        let lse = softmax_row(row.view_mut(), &visible, bias.as_ref(), modifiers);
        // Every visible score −inf: a row that saw nothing, unless a key the
        // bias does not hide is among them (the shared rule of `mask.rs`):
        // then its output is NaN, and its log-sum-exp stays −inf.
        if lse == F::neg_infinity() && call.has_unhidden_key(b, h, i, 0..call.shape.len_kv) {
            row.fill(F::nan());
        }
        log_sum_exp[r] = lse;
    }
    Ok(())
}

/// The score modifiers of one row that `softmax_row` applies.
#[derive(Clone, Copy)]
struct RowModifiers<F> {
    softcap: Option<F>,
    alibi: Option<AlibiRow<F>>,
}

/// Turns one row of scaled scores into weights in place: bias added,
/// masked keys (and keys a `−inf` bias hides) set to exactly 0, the maximum
/// subtracted before `exp`. Returns the log-sum-exp of the visible scores.
///
/// A NaN or `+inf` visible score makes the row NaN (and its log-sum-exp).
/// A row whose visible scores are all `−inf` (or that has none) becomes
/// all 0 with log-sum-exp `−inf`; the caller tells a row that saw nothing
/// from one whose keys all scored `−inf`.
fn softmax_row<F: Element>(
    mut row: ArrayViewMut1<'_, F>,
    visible: &VisibleKeys<'_>,
    bias: Option<&ndarray::ArrayView1<'_, F>>,
    modifiers: RowModifiers<F>,
) -> F {
    let mut max = F::neg_infinity();
    for (j, score) in row.iter_mut().enumerate() {
        if visible.contains(j) {
            if let Some(cap) = modifiers.softcap {
                *score = softcapped(*score, cap).0;
            }
            if let Some(bias) = bias {
                *score = biased(*score, bias[broadcast(bias.len(), visible.key_offset + j)]);
            }
            if let Some(alibi) = modifiers.alibi {
                *score = *score + alibi.bias(j);
            }
            if score.is_nan() {
                row.fill(F::nan());
                return F::nan();
            }
            max = max.max(*score);
        }
    }
    if max == F::neg_infinity() {
        row.fill(F::zero());
        return max;
    }
    let mut sum = F::zero();
    for (j, score) in row.iter_mut().enumerate() {
        *score = if visible.contains(j) {
            (*score - max).exp()
        } else {
            F::zero()
        };
        sum = sum + *score;
    }
    row.mapv_inplace(|w| w / sum);
    max + sum.ln()
}

/// `out = weights · vh` for one head, where keys of weight 0 (masked ones)
/// contribute nothing even if their values are NaN or infinite.
fn weighted_values<F: Element>(
    weights: ArrayView2<'_, F>,
    vh: ArrayView2<'_, F>,
    mut out: ArrayViewMut2<'_, F>,
) {
    if vh.iter().all(|x| x.is_finite()) {
        general_mat_mul(F::one(), &weights, &vh, F::zero(), &mut out);
        return;
    }
    // A product would give 0·NaN = NaN: sum only the keys with weight.
    for (weights_row, mut out_row) in weights.rows().into_iter().zip(out.rows_mut()) {
        out_row.fill(F::zero());
        for (&weight, v_row) in weights_row.iter().zip(vh.rows()) {
            if weight != F::zero() {
                out_row.scaled_add(weight, &v_row);
            }
        }
    }
}
