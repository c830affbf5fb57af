//! The reference: scaled dot-product attention in its matrix form,
//! `softmax(Q·Kᵀ·scale + bias, masked)·V`, one `(batch, head)` at a time,
//! generic over [`Element`] and free of `unsafe`.
//!
//! This is the oracle every fast path is tested against, and the path `f64`
//! calls take. It materialises each head's `len_q × len_kv` weights, so its
//! memory grows with the square of the sequence; the fused `f32` path does not.
//!
//! It never calls into `simd`.
#![forbid(unsafe_code)]

pub(crate) mod backward;

pub use backward::{AttentionGradients, scaled_dot_product_attention_backward};

use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array2, Array4, ArrayBase, ArrayView2, ArrayView4, ArrayViewMut1, ArrayViewMut2, ArrayViewMut3,
    ArrayViewMut4, Axis, Data, DataMut, Ix4,
};

use crate::element::Element;
use crate::error::AttentionError;
use crate::options::{AttentionOptions, VisibleKeys, broadcast, broadcast_row};
use crate::shape::{self, AttentionShape};

/// Scaled dot-product attention on the reference path.
///
/// Same contract as [`crate::scaled_dot_product_attention`]: `q` is
/// `[batch, heads, len_q, d_k]`, `k` is `[batch, kv_heads, len_kv, d_k]`, `v`
/// is `[batch, kv_heads, len_kv, d_v]`, the result `[batch, heads, len_q, d_v]`.
///
/// # Errors
/// An [`AttentionError`] when the shapes or options disagree.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::AttentionOptions;
///
/// let q = Array4::<f64>::ones((1, 2, 3, 4));
/// let out = sdpa::core::scaled_dot_product_attention(q.view(), q.view(), q.view(), &AttentionOptions::new())?;
/// assert_eq!(out.shape(), &[1, 2, 3, 4]);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention<F: Element>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
) -> Result<Array4<F>, AttentionError> {
    let (shape, scale) = shape::check(&q, &k, &v, opts)?;
    let mut out = Array4::zeros(shape.output_dim());
    attention_into_checked(&q, &k, &v, opts, &shape, scale, out.view_mut(), None);
    Ok(out)
}

/// [`scaled_dot_product_attention`] writing into `out`
/// (`[batch, heads, len_q, d_v]`, any strides).
///
/// # Errors
/// An [`AttentionError`] when the shapes or options disagree, or `out` does
/// not have the output's shape.
pub fn scaled_dot_product_attention_into<F: Element>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
    out: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    let (shape, scale) = shape::check(&q, &k, &v, opts)?;
    shape::check_output(&shape, out.shape())?;
    attention_into_checked(&q, &k, &v, opts, &shape, scale, out, None);
    Ok(())
}

/// The attention weights `softmax(Q·Kᵀ·scale + bias, masked)`,
/// `[batch, heads, len_q, len_kv]`: each row sums to 1, or is all 0 for a
/// query with no visible key. For inspection and pictures.
///
/// # Errors
/// An [`AttentionError`] when the shapes or options disagree. `k` stands in
/// for `v` in the checks, so `d_v` is not checked.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::AttentionOptions;
///
/// let x = Array4::<f64>::ones((1, 1, 3, 2));
/// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().causal())?;
/// assert_eq!(w[[0, 0, 0, 1]], 0.0); // query 0 does not see key 1
/// assert!((w[[0, 0, 2, 1]] - 1.0 / 3.0).abs() < 1e-15);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn attention_weights<F: Element>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
) -> Result<Array4<F>, AttentionError> {
    let (shape, scale) = shape::check(&q, &k, &k, opts)?;
    let mut weights = Array4::zeros((shape.batch, shape.heads, shape.len_q, shape.len_kv));
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let kh = head(&k, b, shape.kv_head(h));
            let qh = head(&q, b, h);
            head_weights(
                qh,
                kh,
                opts,
                &shape,
                scale,
                b,
                h,
                head_mut(&mut weights, b, h),
                None,
            );
        }
    }
    Ok(weights)
}

/// The reference computation on checked arguments; also writes each row's
/// log-sum-exp of its scaled, biased, visible scores into `log_sum_exp`
/// (`[batch, heads, len_q]`) when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_into_checked<F: Element>(
    q: &ArrayView4<'_, F>,
    k: &ArrayView4<'_, F>,
    v: &ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
    shape: &AttentionShape,
    scale: F,
    mut out: ArrayViewMut4<'_, F>,
    mut log_sum_exp: Option<ArrayViewMut3<'_, F>>,
) {
    let mut weights = Array2::zeros((shape.len_q, shape.len_kv));
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let kv_h = shape.kv_head(h);
            let kh = head(k, b, kv_h);
            let vh = head(v, b, kv_h);
            let qh = head(q, b, h);
            let lse = log_sum_exp
                .as_mut()
                .map(|lse| lse.index_axis_mut(Axis(0), b).index_axis_move(Axis(0), h));
            head_weights(qh, kh, opts, shape, scale, b, h, weights.view_mut(), lse);
            weighted_values(weights.view(), vh, head_mut(&mut out, b, h));
        }
    }
}

/// One head's weights `[len_q, len_kv]` into `weights`, and each row's
/// log-sum-exp into `log_sum_exp` when given.
#[allow(clippy::too_many_arguments)]
fn head_weights<F: Element>(
    qh: ArrayView2<'_, F>,
    kh: ArrayView2<'_, F>,
    opts: &AttentionOptions<'_, F>,
    shape: &AttentionShape,
    scale: F,
    b: usize,
    h: usize,
    mut weights: ArrayViewMut2<'_, F>,
    mut log_sum_exp: Option<ArrayViewMut1<'_, F>>,
) {
    // Scores of masked keys are computed too (a matrix product cannot skip
    // them); `softmax_row` then discards them by selection, so NaN or inf
    // there does no harm.
    general_mat_mul(scale, &qh, &kh.t(), F::zero(), &mut weights);
    for (i, row) in weights.rows_mut().into_iter().enumerate() {
        let visible = opts.visible_keys(b, h, i, shape.len_q, shape.len_kv);
        let bias = opts.bias.as_ref().map(|bias| broadcast_row(bias, b, h, i));
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
/// The `[len, d]` matrix of batch item `b`, head `h`.
pub(crate) fn head<'v, F, S: Data<Elem = F>>(
    x: &'v ArrayBase<S, Ix4>,
    b: usize,
    h: usize,
) -> ArrayView2<'v, F> {
    x.index_axis(Axis(0), b).index_axis_move(Axis(0), h)
}

/// The mutable `[len, d]` matrix of batch item `b`, head `h`.
pub(crate) fn head_mut<'v, F, S: DataMut<Elem = F>>(
    x: &'v mut ArrayBase<S, Ix4>,
    b: usize,
    h: usize,
) -> ArrayViewMut2<'v, F> {
    x.index_axis_mut(Axis(0), b).index_axis_move(Axis(0), h)
}
