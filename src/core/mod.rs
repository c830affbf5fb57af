//! The reference: scaled dot-product attention in its matrix form,
//! `softmax(Q·Kᵀ·scale + bias, masked)·V`, one `(batch, head)` at a time,
//! generic over [`Element`] and free of `unsafe`.
//!
//! This is the oracle every fast path is tested against, and the path `f64`
//! calls take. Its forward functions take every [`Storage`] type and
//! compute in its [`Reference`](Storage::Reference) type: `bf16` and `f16`
//! inputs (and their `f32` options) are widened to `f64`, exactly, and the
//! result rounded once (the backward's `d_bias` and `d_sinks` to `f32`). It materialises each head's `len_q × len_kv` weights, so its
//! memory grows with the square of the sequence; the fused `f32` path does not.
//!
//! - `forward`: the weights and the output;
//! - `backward`: the gradients.
//!
//! It imports only the pieces below both paths (the call check, the mask
//! geometry, the gradient buffers, the partial result type), never the
//! fused driver, `simd` or the layers.
#![forbid(unsafe_code)]

pub(crate) mod backward;
pub(crate) mod forward;

pub use backward::scaled_dot_product_attention_backward;

use ndarray::{Array4, ArrayView4, ArrayViewMut4};

use crate::alloc::try_zeros;
use crate::call::{self, head_mut};
use crate::element::{Element, Storage};
use crate::error::AttentionError;
use crate::options::AttentionOptions;

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
pub fn scaled_dot_product_attention<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
) -> Result<Array4<F>, AttentionError> {
    let (q, k, v) = (
        F::to_reference(q)?,
        F::to_reference(k)?,
        F::to_reference(v)?,
    );
    let (q, k, v) = (q.view(), k.view(), v.view());
    F::with_reference_options(opts, |opts| {
        let call = call::check(&q, &k, &v, opts)?;
        let mut out = try_zeros("the output", call.shape.output_dim())?;
        forward::forward(&call, out.view_mut(), None)?;
        F::from_reference(out)
    })
}

/// [`scaled_dot_product_attention`] writing into `out`
/// (`[batch, heads, len_q, d_v]`, any strides).
///
/// # Errors
/// An [`AttentionError`] when the shapes or options disagree, or `out` does
/// not have the output's shape.
pub fn scaled_dot_product_attention_into<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
    out: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    let (q, k, v) = (
        F::to_reference(q)?,
        F::to_reference(k)?,
        F::to_reference(v)?,
    );
    let (q, k, v) = (q.view(), k.view(), v.view());
    F::with_reference_options(opts, |opts| {
        let call = call::check(&q, &k, &v, opts)?;
        call::check_output("out", &call.shape, out.shape())?;
        F::write_reference(out, |out| forward::forward(&call, out, None))
    })
}

/// The attention weights `softmax(Q·Kᵀ·scale + bias, masked)`,
/// `[batch, heads, len_q, len_kv]`: each row sums to 1, or is all 0 for a
/// query with no visible key. For inspection and pictures.
///
/// # Errors
/// An [`AttentionError`] when the shapes or options disagree (`k` stands
/// in for `v` in the checks, so `d_v` is not checked), and
/// [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge) or
/// [`ErrorKind::OutOfMemory`](crate::ErrorKind::OutOfMemory) when the
/// `[batch, heads, len_q, len_kv]` weights do not fit in memory. (The
/// outputs of the other functions never need them whole.)
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
pub fn attention_weights<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
) -> Result<Array4<F>, AttentionError> {
    let (q, k) = (F::to_reference(q)?, F::to_reference(k)?);
    F::with_reference_options(opts, |opts| {
        F::from_reference(reference_weights(&q.view(), &k.view(), opts)?)
    })
}

/// [`attention_weights`] in a type that computes in itself.
fn reference_weights<F: Element>(
    q: &ArrayView4<'_, F>,
    k: &ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
) -> Result<Array4<F>, AttentionError> {
    let call = call::check(q, k, k, opts)?;
    let shape = call.shape;
    let dim = (shape.batch, shape.heads, shape.len_q, shape.len_kv);
    let mut weights = try_zeros("the attention weights", dim)?;
    let mut lse = try_zeros("a head's log-sum-exps", shape.len_q)?;
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let rows = 0..shape.len_q;
            let mut weights = head_mut(&mut weights, b, h);
            forward::rows_weights(&call, b, h, rows, weights.view_mut(), lse.view_mut())?;
            if let Some(sink) = call.sink(h) {
                for (row, lse) in weights.rows_mut().into_iter().zip(lse.iter_mut()) {
                    crate::modifiers::apply_sink(row, lse, sink);
                }
            }
        }
    }
    Ok(weights)
}
