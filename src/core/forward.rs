//! The reference forward pass: per `(batch, head)`, the scores as one
//! matrix product, a softmax per row by selection, and the weighted sum of
//! the values as a second product.

use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array2, ArrayView2, ArrayViewMut1, ArrayViewMut2, ArrayViewMut3, ArrayViewMut4, Axis,
};

use crate::call::{Call, head, head_mut};
use crate::element::Element;
use crate::mask::{VisibleKeys, broadcast};

/// The reference computation on a checked call; also writes each row's
/// log-sum-exp of its scaled, biased, visible scores into `log_sum_exp`
/// (`[batch, heads, len_q]`) when given.
pub(crate) fn forward<F: Element>(
    call: &Call<'_, F>,
    mut out: ArrayViewMut4<'_, F>,
    mut log_sum_exp: Option<ArrayViewMut3<'_, F>>,
) {
    let shape = call.shape;
    let mut weights = Array2::zeros((shape.len_q, shape.len_kv));
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let lse = log_sum_exp
                .as_mut()
                .map(|lse| lse.index_axis_mut(Axis(0), b).index_axis_move(Axis(0), h));
            head_weights(call, b, h, weights.view_mut(), lse);
            let vh = head(&call.v, b, shape.kv_head(h));
            weighted_values(weights.view(), vh, head_mut(&mut out, b, h));
        }
    }
}

/// The weights `[len_q, len_kv]` of batch item `b`, head `h` into
/// `weights`, and each row's log-sum-exp into `log_sum_exp` when given.
pub(crate) fn head_weights<F: Element>(
    call: &Call<'_, F>,
    b: usize,
    h: usize,
    mut weights: ArrayViewMut2<'_, F>,
    mut log_sum_exp: Option<ArrayViewMut1<'_, F>>,
) {
    let qh = head(&call.q, b, h);
    let kh = head(&call.k, b, call.shape.kv_head(h));
    // Scores of masked keys are computed too (a matrix product cannot skip
    // them); `softmax_row` then discards them by selection, so NaN or inf
    // there does no harm.
    general_mat_mul(call.scale, &qh, &kh.t(), F::zero(), &mut weights);
    for (i, row) in weights.rows_mut().into_iter().enumerate() {
        let visible = call.visible_keys(b, h, i);
        let bias = call.bias_row(b, h, i);
        let lse = softmax_row(row, &visible, bias.as_ref());
        if let Some(log_sum_exp) = log_sum_exp.as_mut() {
            log_sum_exp[i] = lse;
        }
    }
}

/// Turns one row of scaled scores into weights in place: bias added, masked
/// keys set to exactly 0, the maximum subtracted before `exp`.
/// A row with no visible key, or only `-inf` scores, becomes all 0.
/// Returns the log-sum-exp of the visible scores (`-inf` for such a row).
fn softmax_row<F: Element>(
    mut row: ArrayViewMut1<'_, F>,
    visible: &VisibleKeys<'_>,
    bias: Option<&ndarray::ArrayView1<'_, F>>,
) -> F {
    let mut max = F::neg_infinity();
    for (j, score) in row.iter_mut().enumerate() {
        if visible.contains(j) {
            if let Some(bias) = bias {
                *score = *score + bias[broadcast(bias.len(), visible.key_offset + j)];
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
