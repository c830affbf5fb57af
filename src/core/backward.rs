//! The reference backward pass: the gradients of a loss with respect to
//! `q`, `k`, `v` and the bias, given the forward's output, its per-row
//! log-sum-exp and the gradient of the loss with respect to the output.
//!
//! Per `(batch, head)`, with `S = Q·Kᵀ·scale + bias` and `lse` the forward's
//! log-sum-exp of each row's visible scores:
//!
//! ```text
//! P_ij  = exp(S_ij − lse_i)   for visible keys, exactly 0 for masked ones
//! D_i   = Σ_c dO_ic · O_ic     (= Σ_j P_ij · dP_ij)
//! dV    = Pᵀ · dO              (summed over the query heads sharing a kv head)
//! dP    = dO · Vᵀ
//! dS_ij = P_ij · (dP_ij − D_i)  where P_ij ≠ 0, else exactly 0
//! dQ    = scale · dS · K
//! dK    = scale · dSᵀ · Q       (summed over the query heads sharing a kv head)
//! dbias = dS                    (summed over the bias's broadcast dimensions)
//! ```
//!
//! `P` is recomputed from the log-sum-exp instead of being stored by the
//! forward, as a fused backward does tile by tile; here each head's
//! `len_q × len_kv` matrices are materialised, as in the forward reference.
//!
//! Masking is by selection throughout, as in the forward: a masked entry's
//! `P` and `dS` are set to 0, never computed as a product with 0, and the
//! matrix products skip zero entries whenever the other factor holds a
//! non-finite number, so NaN or ±inf in masked keys, values, bias entries,
//! or in the queries and `d_out` rows of queries that see no key, never
//! reaches a gradient.
//!
//! Like the rest of `core`, this never calls into `simd`.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2, ArrayView4, ArrayViewMut2, ArrayViewMut4};

use crate::alloc::try_zeros;
use crate::call::{self, BackwardCall, head, head_mut};
use crate::element::{Element, Storage};
use crate::error::AttentionError;
use crate::gradients::{AttentionGradients, GradientsViewMut};
use crate::mask::{biased, broadcast};
use crate::modifiers::softcapped;
use crate::options::AttentionOptions;
use crate::partial::AttentionPartial;

/// The backward pass of scaled dot-product attention on the reference path:
/// the gradients of a scalar loss `L` with respect to `q`, `k`, `v` and the
/// bias, given `d_out = ∂L/∂out`.
///
/// - `q`, `k`, `v`, `opts`: the forward call's arguments, unchanged.
/// - `forward`: the forward's result from
///   [`scaled_dot_product_attention_partial`](crate::scaled_dot_product_attention_partial):
///   its output `[batch, heads, len_q, d_v]` and the log-sum-exp of each
///   row's visible scaled (and biased) scores, `[batch, heads, len_q]`
///   (`−inf` for a row that sees no key). A type of its own, so it cannot
///   be swapped with `d_out`.
/// - `d_out`: `∂L/∂out`, `[batch, heads, len_q, d_v]`.
///
/// The weights are recomputed from the log-sum-exp, so `forward` must come
/// from a forward with the same arguments (on any path); otherwise the
/// result is not a gradient of anything. Views of any strides are accepted.
///
/// Every option is supported. A masked query–key pair contributes exactly 0
/// to every gradient, and NaN or ±inf in masked keys, values or bias entries
/// never reaches one; a query row with no visible key gets a zero `d_q` row
/// and contributes nothing. Keys no query sees get zero `d_k` and `d_v`
/// rows.
///
/// **Key shards.** With [`AttentionOptions::key_shard`], `k` and `v` are one
/// shard of the keys, while `forward` and `d_out` are those of the whole
/// (merged) call. The result is then the shard's part: `d_k` and
/// `d_v` of the shard's keys, and the shard's contributions to `d_q` and
/// `d_bias` (the bias has the whole sequence's columns; those of other
/// shards get 0). Summing `d_q` and `d_bias` over all shards gives the
/// gradients of the unsplit call.
///
/// # Errors
/// As [`scaled_dot_product_attention`](super::scaled_dot_product_attention)
/// for `q`, `k`, `v` and the options, and an [`AttentionError`] naming the
/// shapes when the forward's output or `d_out` is not
/// `[batch, heads, len_q, d_v]`.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention_partial, AttentionOptions};
///
/// let q = Array4::<f64>::from_shape_fn((1, 2, 4, 3), |(_, h, i, c)| ((h + 2 * i + c) % 5) as f64 * 0.3 - 0.5);
/// let k = Array4::<f64>::from_shape_fn((1, 1, 4, 3), |(_, _, j, c)| ((j * c + 1) % 4) as f64 * 0.4 - 0.6);
/// let v = Array4::<f64>::from_shape_fn((1, 1, 4, 2), |(_, _, j, c)| (j as f64 - c as f64) * 0.25);
/// let opts = AttentionOptions::new().causal();
///
/// // Forward, keeping the log-sum-exp.
/// let forward = scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)?;
/// // The loss L = sum(out), so dL/dout is all ones.
/// let d_out = Array4::<f64>::ones(forward.output().raw_dim());
/// let grads = sdpa::core::scaled_dot_product_attention_backward(
///     q.view(), k.view(), v.view(), &opts, &forward, d_out.view(),
/// )?;
/// assert_eq!(grads.d_q.shape(), q.shape());
/// assert_eq!(grads.d_k.shape(), k.shape()); // summed over the 2 query heads
/// assert_eq!(grads.d_v.shape(), v.shape());
/// assert!(grads.d_bias.is_none());
///
/// // Query 0 sees only key 0 (causal): its output is v[0] whatever q[0] is.
/// assert!(grads.d_q.slice(ndarray::s![.., .., 0, ..]).iter().all(|&g| g.abs() < 1e-12));
///
/// // Against a finite difference of the loss in one entry of k.
/// let loss = |k: &Array4<f64>| -> Result<f64, sdpa::AttentionError> {
///     Ok(sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)?.sum())
/// };
/// let h = 1e-6;
/// let (mut up, mut down) = (k.clone(), k.clone());
/// up[[0, 0, 1, 2]] += h;
/// down[[0, 0, 1, 2]] -= h;
/// let numeric = (loss(&up)? - loss(&down)?) / (2.0 * h);
/// assert!((grads.d_k[[0, 0, 1, 2]] - numeric).abs() < 1e-8);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_backward<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
    forward: &AttentionPartial<F>,
    d_out: ArrayView4<'_, F>,
) -> Result<AttentionGradients<F>, AttentionError> {
    let (q, k, v) = (
        F::to_reference(q)?,
        F::to_reference(k)?,
        F::to_reference(v)?,
    );
    let (out, d_out) = (F::to_reference(forward.output())?, F::to_reference(d_out)?);
    let log_sum_exp = F::compute_to_reference(forward.log_sum_exp())?;
    let (q, k, v) = (q.view(), k.view(), v.view());
    let (out, d_out, log_sum_exp) = (out.view(), d_out.view(), log_sum_exp.view());
    F::with_reference_options(opts, |opts| {
        let call =
            call::check_backward(call::check(&q, &k, &v, opts)?, &out, &log_sum_exp, &d_out)?;
        let mut gradients = AttentionGradients::zeros(&call.forward)?;
        backward(&call, gradients.view_mut())?;
        let d_sinks = crate::modifiers::sink_gradients(&call)?;
        Ok(AttentionGradients {
            d_q: F::from_reference(gradients.d_q)?,
            d_k: F::from_reference(gradients.d_k)?,
            d_v: F::from_reference(gradients.d_v)?,
            d_bias: gradients.d_bias.map(F::reference_to_compute).transpose()?,
            d_sinks: d_sinks.map(F::reference_to_compute).transpose()?,
        })
    })
}

/// The reference backward on a checked call; overwrites every gradient in
/// `gradients`, which have the shapes of `q`, `k`, `v` and the bias.
///
/// # Errors
/// When the per-head `[len_q, len_kv]` matrices cannot be allocated.
pub(crate) fn backward<F: Element>(
    call: &BackwardCall<'_, F>,
    gradients: GradientsViewMut<'_, F>,
) -> Result<(), AttentionError> {
    let BackwardCall {
        forward,
        out,
        log_sum_exp,
        d_out,
    } = call;
    let (shape, scale) = (forward.shape, forward.scale);
    let (q, k, v) = (&forward.q, &forward.k, &forward.v);
    let GradientsViewMut {
        mut d_q,
        mut d_k,
        mut d_v,
        mut d_bias,
    } = gradients;
    // d_k, d_v and d_bias are sums over query heads (and rows); d_q is
    // overwritten head by head but cleared too, for empty key sequences.
    d_q.fill(F::zero());
    d_k.fill(F::zero());
    d_v.fill(F::zero());
    if let Some(d_bias) = d_bias.as_mut() {
        d_bias.fill(F::zero());
    }
    let scores_dim = (shape.len_q, shape.len_kv);
    let mut probabilities: Array2<F> = try_zeros("the backward's weights", scores_dim)?;
    let mut d_scores: Array2<F> = try_zeros("the backward's score gradients", scores_dim)?;
    // With a softcap, each score's `1 − tanh²(s/cap)`.
    let mut softcap_slopes: Option<Array2<F>> = match forward.opts.softcap {
        Some(_) => Some(try_zeros("the softcap's derivatives", scores_dim)?),
        None => None,
    };
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let kv_h = shape.kv_head(h);
            let (qh, kh, vh) = (head(q, b, h), head(k, b, kv_h), head(v, b, kv_h));
            let (out_h, d_out_h) = (head(out, b, h), head(d_out, b, h));

            // S = Q·Kᵀ·scale with exactly the forward's product, then P.
            general_mat_mul(scale, &qh, &kh.t(), F::zero(), &mut probabilities);
            // dP = dO·Vᵀ; entries of masked keys may be NaN and are
            // discarded by selection below.
            general_mat_mul(F::one(), &d_out_h, &vh.t(), F::zero(), &mut d_scores);
            for i in 0..shape.len_q {
                let visible = forward.visible_keys(b, h, i);
                let bias = forward.bias_row(b, h, i);
                let alibi = forward.alibi(h, i);
                let lse = log_sum_exp[[b, h, i]];
                let mut p_row = probabilities.row_mut(i);
                let mut ds_row = d_scores.row_mut(i);
                if lse == F::neg_infinity() {
                    // No visible key (or only −inf scores): P and dS are 0.
                    p_row.fill(F::zero());
                    ds_row.fill(F::zero());
                    continue;
                }
                // D_i = Σ_c dO_ic·O_ic, the row's Σ_j P_ij·dP_ij.
                let d_i = out_h
                    .row(i)
                    .iter()
                    .zip(d_out_h.row(i))
                    .fold(F::zero(), |sum, (&o, &d_o)| sum + o * d_o);
                for (j, (p, ds)) in p_row.iter_mut().zip(ds_row.iter_mut()).enumerate() {
                    *p = if visible.contains(j) {
                        if let (Some(cap), Some(slopes)) =
                            (forward.opts.softcap, softcap_slopes.as_mut())
                        {
                            let (capped, slope) = softcapped(*p, cap);
                            *p = capped;
                            slopes[[i, j]] = slope;
                        }
                        let score = match &bias {
                            Some(bias) => {
                                biased(*p, bias[broadcast(bias.len(), visible.key_offset + j)])
                            }
                            None => *p,
                        };
                        let score = match alibi {
                            Some(alibi) => score + alibi.bias(j),
                            None => score,
                        };
                        (score - lse).exp()
                    } else {
                        F::zero()
                    };
                    // Selection: a zero weight has zero gradient even where
                    // dP is NaN or infinite.
                    *ds = if *p != F::zero() {
                        *p * (*ds - d_i)
                    } else {
                        F::zero()
                    };
                }
            }

            // The bias is added after the cap: its gradient is dS itself,
            // the capped score's; the product's gradient is dS·(1 − tanh²).
            if let Some(d_bias) = d_bias.as_mut() {
                accumulate_bias_gradient(d_bias, d_scores.view(), b, h, forward.key_offset());
            }
            if let Some(slopes) = &softcap_slopes {
                d_scores.zip_mut_with(slopes, |ds, &slope| {
                    if *ds != F::zero() {
                        *ds = *ds * slope;
                    }
                });
            }

            // dV += Pᵀ·dO and dK += scale·dSᵀ·Q over the heads sharing kv_h.
            mat_mul_selecting(
                F::one(),
                probabilities.t(),
                d_out_h,
                F::one(),
                head_mut(&mut d_v, b, kv_h),
            );
            mat_mul_selecting(
                scale,
                d_scores.t(),
                qh,
                F::one(),
                head_mut(&mut d_k, b, kv_h),
            );
            // dQ = scale·dS·K.
            mat_mul_selecting(
                scale,
                d_scores.view(),
                kh,
                F::zero(),
                head_mut(&mut d_q, b, h),
            );
        }
    }
    Ok(())
}

/// `c = alpha·a·b + beta·c` (`beta` is 0 or 1), where a zero entry of `a`
/// contributes nothing even if the row of `b` it meets holds NaN or ±inf:
/// those rows belong to masked keys or to queries that see no key.
fn mat_mul_selecting<F: Element>(
    alpha: F,
    a: ArrayView2<'_, F>,
    b: ArrayView2<'_, F>,
    beta: F,
    mut c: ArrayViewMut2<'_, F>,
) {
    if b.iter().all(|x| x.is_finite()) {
        general_mat_mul(alpha, &a, &b, beta, &mut c);
        return;
    }
    for (a_row, mut c_row) in a.rows().into_iter().zip(c.rows_mut()) {
        if beta == F::zero() {
            c_row.fill(F::zero());
        } else if beta != F::one() {
            c_row.mapv_inplace(|x| x * beta);
        }
        for (&x, b_row) in a_row.iter().zip(b.rows()) {
            if x != F::zero() {
                c_row.scaled_add(alpha * x, &b_row);
            }
        }
    }
}

/// Adds one head's `dS` (`[len_q, len_kv]`) into `d_bias` at the entries
/// the bias broadcast to it from: the bias has `total_len_kv` columns (or
/// 1), and this call's key `j` is column `key_offset + j`.
fn accumulate_bias_gradient<F: Element>(
    d_bias: &mut ArrayViewMut4<'_, F>,
    d_scores: ArrayView2<'_, F>,
    b: usize,
    h: usize,
    key_offset: usize,
) {
    let shape = d_bias.shape();
    let (batch, heads, len_q, columns) = (shape[0], shape[1], shape[2], shape[3]);
    let (b, h) = (broadcast(batch, b), broadcast(heads, h));
    for (i, ds_row) in d_scores.rows().into_iter().enumerate() {
        let i = broadcast(len_q, i);
        for (j, &ds) in ds_row.iter().enumerate() {
            let column = broadcast(columns, key_offset + j);
            d_bias[[b, h, i, column]] = d_bias[[b, h, i, column]] + ds;
        }
    }
}
