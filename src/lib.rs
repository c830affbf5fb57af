#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The data path, top to bottom: layers (`layer`, `kv_cache`, `sequence`)
// → the functional entry points below → `call` (one check) → `element`
// (which path a type runs) → `fused` over `simd`, or `core`. `options`,
// `mask`, `gradients`, `partial`, `alloc`, `parallel` and `error` sit below
// both paths. `varlen` (packed batches) sits beside the entry points: one
// checked 4-D call per sequence.
mod alloc;
mod call;
#[cfg(feature = "safetensors")]
mod checkpoint;
pub mod core;
mod element;
mod error;
mod fused;
mod gradients;
mod kv_cache;
mod layer;
mod mask;
mod modifiers;
mod options;
mod parallel;
mod partial;
mod rope;
mod sequence;
#[allow(unsafe_code)]
pub mod simd;
pub mod varlen;

use ndarray::{Array4, ArrayView4, ArrayViewMut4};

use element::sealed::Sealed;
use gradients::GradientsViewMut;

#[cfg(feature = "safetensors")]
pub use checkpoint::Checkpoint;
pub use element::{Element, Storage};
pub use error::{AttentionError, ErrorKind};
pub use gradients::AttentionGradients;
/// The `half` crate, whose `bf16` and `f16` are [`Storage`] types.
#[cfg(feature = "half")]
pub use half;
pub use kv_cache::KvCache;
pub use layer::{
    Attention, AttentionConfig, CausalAttention, ForwardCache, LayerGradients, LayerParameters,
    RopeConfig, TorchLinear,
};
pub use modifiers::alibi_slopes;
pub use options::{AttentionOptions, CausalAlignment};
pub use partial::AttentionPartial;
pub use rope::{
    RopeLayout, RopePositions, RopeTable, apply_rope, apply_rope_backward,
    apply_rope_backward_inplace, apply_rope_backward_into, apply_rope_inplace, apply_rope_into,
};
pub use sequence::{simple_self_attention, single_sequence_attention};
pub use varlen::{
    VarlenGradients, VarlenPartial, scaled_dot_product_attention_varlen,
    scaled_dot_product_attention_varlen_backward,
    scaled_dot_product_attention_varlen_backward_into, scaled_dot_product_attention_varlen_into,
    scaled_dot_product_attention_varlen_partial, scaled_dot_product_attention_varlen_partial_into,
};

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
/// path; `f64` runs [`core`], the reference; `half::bf16` and `half::f16`
/// (feature `half`) are converted to `f32` and run the fused path, with
/// `f32` options and the output rounded to the input type (see
/// [`Storage`]). See [`AttentionOptions`] for masks, scale and bias.
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
pub fn scaled_dot_product_attention<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
) -> Result<Array4<F>, AttentionError> {
    // The queries and the output stay in `F` too: a half call widens the
    // queries a query tile at a time and rounds each output row once.
    let call = call::check(&q, &k, &v, opts)?;
    let mut out = alloc::try_zeros("the output", call.shape.output_dim())?;
    F::forward_all_stored(&call, out.view_mut(), None)?;
    Ok(out)
}

/// [`scaled_dot_product_attention`] writing into a caller's buffer `out`
/// (`[batch, heads, len_q, d_v]`, any strides); allocates no output (a
/// `bf16` or `f16` call finishes each row in `f32` and rounds it into
/// `out`). On an error `out` may be partly written.
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
pub fn scaled_dot_product_attention_into<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
    out: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    let call = call::check(&q, &k, &v, opts)?;
    call::check_output("out", &call.shape, out.shape())?;
    F::forward_all_stored(&call, out, None)
}

/// Attention over the keys and values given, as a mergeable
/// [`AttentionPartial`]. With all the keys, its output is the attention
/// output and its log-sum-exp the normaliser the backward pass needs.
///
/// Use [`AttentionOptions::key_shard`] when `k` and `v` are a shard of a
/// longer key sequence.
///
/// For `bf16` and `f16` the output is in the input type and the
/// log-sum-exp in `f32`.
///
/// # Errors
/// As [`scaled_dot_product_attention`].
///
/// ```
/// use ndarray::{Array4, s};
/// use sdpa::{scaled_dot_product_attention_partial, AttentionOptions, AttentionPartial};
///
/// let q = Array4::<f64>::from_shape_fn((1, 2, 5, 4), |(_, h, i, d)| (h + i * d) as f64 * 0.1);
/// let kv = Array4::<f64>::from_shape_fn((1, 2, 9, 4), |(_, h, j, d)| ((h * j + d) % 5) as f64 * 0.2);
/// // The whole call, and the same keys in two shards of 4 and 5.
/// let whole = sdpa::core::scaled_dot_product_attention(q.view(), kv.view(), kv.view(), &AttentionOptions::new().causal())?;
/// let first = scaled_dot_product_attention_partial(
///     q.view(), kv.slice(s![.., .., ..4, ..]), kv.slice(s![.., .., ..4, ..]),
///     &AttentionOptions::new().causal().key_shard(0, 9))?;
/// let second = scaled_dot_product_attention_partial(
///     q.view(), kv.slice(s![.., .., 4.., ..]), kv.slice(s![.., .., 4.., ..]),
///     &AttentionOptions::new().causal().key_shard(4, 9))?;
/// let merged = AttentionPartial::merge_all([first, second])?.into_output();
/// assert!(merged.iter().zip(&whole).all(|(a, b)| (a - b).abs() < 1e-12));
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_partial<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
) -> Result<AttentionPartial<F>, AttentionError> {
    let call = call::check(&q, &k, &v, opts)?;
    let mut partial = AttentionPartial::<F>::zeros(call.shape.output_dim())?;
    scaled_dot_product_attention_partial_into(q, k, v, opts, &mut partial)?;
    Ok(partial)
}

/// [`scaled_dot_product_attention_partial`] writing into a caller's
/// `partial` of the call's shape, which it overwrites: a training loop
/// that keeps one allocates no output or log-sum-exp per step. Fresh
/// arrays of 128 KiB or more are mapped by the allocator and faulted in
/// page by page on every call (see [`scaled_dot_product_attention_backward_into`]).
///
/// # Errors
/// As [`scaled_dot_product_attention`], and when `partial`'s output does
/// not have the call's output shape. A shape error leaves `partial` as it
/// was; another error may leave it partly written.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention_partial, scaled_dot_product_attention_partial_into, AttentionOptions};
///
/// let x = Array4::<f32>::from_shape_fn((1, 2, 6, 8), |(_, h, i, d)| ((h + i * d) % 5) as f32 * 0.1);
/// let opts = AttentionOptions::new().causal();
/// let mut partial = scaled_dot_product_attention_partial(x.view(), x.view(), x.view(), &opts)?;
/// let first = partial.clone();
/// // The next step reuses the arrays.
/// scaled_dot_product_attention_partial_into(x.view(), x.view(), x.view(), &opts, &mut partial)?;
/// assert_eq!(partial, first);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_partial_into<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
    partial: &mut AttentionPartial<F>,
) -> Result<(), AttentionError> {
    let call = call::check(&q, &k, &v, opts)?;
    call::check_output("partial's output", &call.shape, partial.output().shape())?;
    let (output, log_sum_exp) = partial.parts_mut();
    F::forward_all_stored(&call, output, Some(log_sum_exp))
}

/// The gradients of a scalar loss with respect to `q`, `k`, `v` and the
/// bias of an attention call, given the call's result `forward` (from
/// [`scaled_dot_product_attention_partial`]: the output and each row's
/// log-sum-exp) and `d_out`, the gradient of the loss with respect to the
/// output. `forward` has a type of its own, so it cannot be passed where
/// `d_out` goes.
///
/// `f32` runs the fused backward pass (FlashAttention-2 order, the `P` tiles
/// recomputed from the log-sum-exp, no `len_q × len_kv` buffer unless a bias
/// gradient is asked for, bitwise the same for any thread count); `f64` runs
/// [`core::scaled_dot_product_attention_backward`], the reference. `bf16`
/// and `f16` convert `q`, `k`, `v`, the forward's output and `d_out` to
/// `f32` and run the fused backward; `d_q`, `d_k` and `d_v` are rounded to
/// the input type, `d_bias` and `d_sinks` stay `f32`. Every
/// option of the forward is supported; masked entries and rows with no
/// visible key get exactly zero gradients, and NaN in masked data never
/// reaches a gradient.
///
/// # Errors
/// As the forward, and when the forward's output or `d_out` does not have
/// the call's output shape.
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
///     q.view(), k.view(), v.view(), &opts, &forward, d_out.view())?;
/// assert_eq!(grads.d_k.shape(), k.shape());
/// // Each output row is a weighted mean of values: the weights of a row sum
/// // to 1, so the gradients with respect to v sum to the number of rows.
/// assert!((grads.d_v.sum() - 2.0 * 5.0 * 8.0).abs() < 1e-3);
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
    let mut gradients = AttentionGradients::zeros(&call::check(&q, &k, &v, opts)?)?;
    scaled_dot_product_attention_backward_into(q, k, v, opts, forward, d_out, &mut gradients)?;
    Ok(gradients)
}

/// [`scaled_dot_product_attention_backward`] writing into a caller's
/// `gradients` (from an earlier call of the same shapes), which it
/// overwrites; `d_sinks` is replaced. A training loop that keeps its
/// gradients, and its forward result (with
/// [`scaled_dot_product_attention_partial_into`]), allocates nothing of
/// the call's size per step: fresh arrays of 128 KiB or more are mapped by
/// the allocator and faulted in page by page on every call. Keeping them
/// made a forward+backward 16–22% faster at N = 256 and 5–7.5% at N = 1024
/// (one thread, 8 heads of 64, on an Emerald Rapids Xeon;
/// `docs/PERFORMANCE.md`).
///
/// # Errors
/// As [`scaled_dot_product_attention_backward`], and when a gradient does
/// not have its input's shape or `d_bias` is not there (in the bias's
/// shape) exactly when the options have a bias. A shape error leaves
/// `gradients` as they were; another error may leave them partly written.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{
///     scaled_dot_product_attention_backward, scaled_dot_product_attention_backward_into,
///     scaled_dot_product_attention_partial, AttentionOptions,
/// };
///
/// let q = Array4::<f32>::from_shape_fn((1, 2, 5, 8), |(_, h, i, d)| ((h + 3 * i + d) % 7) as f32 * 0.2 - 0.5);
/// let (k, v) = (q.mapv(|x| x * 0.5), q.mapv(|x| 1.0 - x));
/// let opts = AttentionOptions::new().causal();
/// let forward = scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)?;
/// let d_out = Array4::<f32>::ones(forward.output().raw_dim());
/// let mut grads = scaled_dot_product_attention_backward(
///     q.view(), k.view(), v.view(), &opts, &forward, d_out.view())?;
/// let first = grads.clone();
/// // The next step reuses the arrays.
/// scaled_dot_product_attention_backward_into(
///     q.view(), k.view(), v.view(), &opts, &forward, d_out.view(), &mut grads)?;
/// assert_eq!(grads, first);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_backward_into<F: Storage>(
    q: ArrayView4<'_, F>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
    forward: &AttentionPartial<F>,
    d_out: ArrayView4<'_, F>,
    gradients: &mut AttentionGradients<F>,
) -> Result<(), AttentionError> {
    let (q, k, v) = (F::to_compute(q)?, F::to_compute(k)?, F::to_compute(v)?);
    let (out, d_out) = (F::to_compute(forward.output())?, F::to_compute(d_out)?);
    let (q, k, v) = (q.view(), k.view(), v.view());
    let (out, d_out, log_sum_exp) = (out.view(), d_out.view(), forward.log_sum_exp());
    let call = call::check_backward(call::check(&q, &k, &v, opts)?, &out, &log_sum_exp, &d_out)?;
    let input = &call.forward;
    call::check_gradient_shapes([
        ("d_q", gradients.d_q.shape(), "q", input.q.shape()),
        ("d_k", gradients.d_k.shape(), "k", input.k.shape()),
        ("d_v", gradients.d_v.shape(), "v", input.v.shape()),
    ])?;
    call::check_bias_gradient(
        gradients.d_bias.as_ref().map(|d_bias| d_bias.shape()),
        input.opts.bias.as_ref().map(|bias| bias.shape()),
    )?;
    let AttentionGradients {
        d_q,
        d_k,
        d_v,
        d_bias,
        d_sinks,
    } = gradients;
    // A half type's gradients are computed in `f32` buffers and rounded
    // into the caller's arrays; an `Element`'s are written in place.
    F::write_compute(d_q.view_mut(), |d_q| {
        F::write_compute(d_k.view_mut(), |d_k| {
            F::write_compute(d_v.view_mut(), |d_v| {
                let d_bias = d_bias.as_mut().map(|d_bias| d_bias.view_mut());
                F::Compute::backward(
                    &call,
                    GradientsViewMut {
                        d_q,
                        d_k,
                        d_v,
                        d_bias,
                    },
                )
            })
        })
    })?;
    *d_sinks = modifiers::sink_gradients(&call)?;
    Ok(())
}
