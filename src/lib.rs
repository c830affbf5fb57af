#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod core;
mod element;
mod error;
mod fused;
mod kv_cache;
mod layer;
mod options;
mod parallel;
mod partial;
mod sequence;
mod shape;
pub mod simd;

use ndarray::{Array4, ArrayView3, ArrayView4, ArrayViewMut4};

pub use crate::core::AttentionGradients;
pub use element::Element;
pub use error::{AttentionError, ErrorKind};
pub use kv_cache::KvCache;
pub use layer::{
    Attention, AttentionConfig, CausalAttention, ForwardCache, LayerGradients, LayerParameters,
};
pub use options::{AttentionOptions, CausalAlignment};
pub use partial::{AttentionPartial, scaled_dot_product_attention_partial};
pub use sequence::{simple_self_attention, single_sequence_attention};

/// Scaled dot-product attention, `softmax(Q·Kᵀ·scale + bias, masked)·V`.
///
/// - `q`: `[batch, heads, len_q, d_k]`
/// - `k`: `[batch, kv_heads, len_kv, d_k]`
/// - `v`: `[batch, kv_heads, len_kv, d_v]`, with `heads % kv_heads == 0`
///   (grouped-query and multi-query attention share each key/value head
///   among `heads / kv_heads` consecutive query heads, without copying)
/// - returns `[batch, heads, len_q, d_v]`
///
/// Views of any strides are accepted. `f32` runs the fused, hand-vectorized
/// path; `f64` runs [`core`], the reference. See [`AttentionOptions`] for
/// masks, scale and bias.
///
/// # Errors
/// An [`AttentionError`] naming the argument and shapes when batch sizes,
/// head counts, `d_k` or `len_kv` disagree, `d_k == 0`, `heads` is not a
/// multiple of `kv_heads`, a mask or bias does not broadcast, a key length is
/// past `len_kv`, or the scale is not finite.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention, AttentionOptions};
///
/// let q = Array4::<f32>::from_shape_fn((1, 8, 16, 64), |(_, h, i, d)| ((h + i * d) % 7) as f32 * 0.1);
/// let k = q.clone();
/// let v = q.clone();
/// let out = scaled_dot_product_attention(q.view(), k.view(), v.view(), &AttentionOptions::new().causal())?;
/// assert_eq!(out.shape(), &[1, 8, 16, 64]);
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
    F::attention_into_checked(&q, &k, &v, opts, &shape, scale, out.view_mut(), None)?;
    Ok(out)
}

/// [`scaled_dot_product_attention`] writing into a caller's buffer `out`
/// (`[batch, heads, len_q, d_v]`, any strides); allocates no output.
///
/// # Errors
/// As [`scaled_dot_product_attention`], and when `out` does not have the
/// output's shape.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention_into, AttentionOptions};
///
/// let x = Array4::<f32>::ones((2, 4, 5, 8));
/// let mut out = Array4::<f32>::zeros((2, 4, 5, 8));
/// scaled_dot_product_attention_into(x.view(), x.view(), x.view(), &AttentionOptions::new(), out.view_mut())?;
/// assert!((out[[1, 3, 4, 7]] - 1.0).abs() < 1e-6);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_into<F: Element>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
    out: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    let (shape, scale) = shape::check(&q, &k, &v, opts)?;
    shape::check_output(&shape, out.shape())?;
    F::attention_into_checked(&q, &k, &v, opts, &shape, scale, out, None)
}

/// The gradients of a scalar loss with respect to `q`, `k`, `v` and the
/// bias of an attention call, given the call's output `out`, its per-row
/// log-sum-exp (both from [`scaled_dot_product_attention_partial`]) and
/// `d_out`, the gradient of the loss with respect to the output.
///
/// `f32` runs the fused backward pass (FlashAttention-2 order, the `P` tiles
/// recomputed from the log-sum-exp, no `len_q × len_kv` buffer unless a bias
/// gradient is asked for, bitwise the same for any thread count); `f64` runs
/// [`core::scaled_dot_product_attention_backward`], the reference. Every
/// option of the forward is supported; masked entries and rows with no
/// visible key get exactly zero gradients, and NaN in masked data never
/// reaches a gradient.
///
/// # Errors
/// As the forward, and when `out`, `log_sum_exp` or `d_out` do not have the
/// forward's shapes.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention_backward, scaled_dot_product_attention_partial, AttentionOptions};
///
/// let q = Array4::<f32>::from_shape_fn((1, 2, 5, 8), |(_, h, i, d)| ((h + 3 * i + d) % 7) as f32 * 0.2 - 0.5);
/// let (k, v) = (q.mapv(|x| x * 0.5), q.mapv(|x| 1.0 - x));
/// let opts = AttentionOptions::new().causal();
/// let forward = scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)?;
/// // The loss is the sum of the outputs, so its gradient is all ones.
/// let d_out = Array4::<f32>::ones(forward.output().raw_dim());
/// let grads = scaled_dot_product_attention_backward(
///     q.view(), k.view(), v.view(), &opts, forward.output(), forward.log_sum_exp(), d_out.view())?;
/// assert_eq!(grads.d_k.shape(), k.shape());
/// // Each output row is a weighted mean of values: the weights of a row sum
/// // to 1, so the gradients with respect to v sum to the number of rows.
/// assert!((grads.d_v.sum() - 2.0 * 5.0 * 8.0).abs() < 1e-3);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn scaled_dot_product_attention_backward<F: Element>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
    out: ArrayView4<'_, F>,
    log_sum_exp: ArrayView3<'_, F>,
    d_out: ArrayView4<'_, F>,
) -> Result<AttentionGradients<F>, AttentionError> {
    let (shape, scale) =
        core::backward::check_backward(&q, &k, &v, opts, &out, &log_sum_exp, &d_out)?;
    let mut gradients = AttentionGradients::zeros(&q, &k, &v, opts);
    F::backward_into_checked(
        &q,
        &k,
        &v,
        opts,
        &shape,
        scale,
        &out,
        &log_sum_exp,
        &d_out,
        gradients.view_mut(),
    )?;
    Ok(gradients)
}
