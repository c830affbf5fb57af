#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod attention;
pub mod core;
mod element;
mod error;
mod fused;
mod kv_cache;
mod options;
mod parallel;
mod partial;
mod sequence;
mod shape;
pub mod simd;

use ndarray::{Array4, ArrayView4, ArrayViewMut4};

pub use crate::core::AttentionGradients;
pub use attention::{Attention, AttentionConfig, AttentionWeights, CausalAttention};
pub use element::Element;
pub use error::{AttentionError, ErrorKind};
pub use kv_cache::KvCache;
pub use options::{AttentionOptions, CausalAlignment};
pub use partial::{AttentionPartial, scaled_dot_product_attention_partial};
pub use sequence::{Masking, simple_self_attention, single_sequence_attention};

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
