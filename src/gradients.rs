//! [`AttentionGradients`], what a backward pass returns, and the mutable
//! views a backward path writes them through.

use ndarray::{Array1, Array4, ArrayViewMut4};

use crate::alloc::try_zeros;
use crate::call::Call;
use crate::element::{Element, Storage};
use crate::error::AttentionError;

/// The gradients of a scalar loss `L` with respect to the inputs of an
/// attention call, from
/// [`scaled_dot_product_attention_backward`](crate::scaled_dot_product_attention_backward).
///
/// Each array has the shape of the input it is the gradient of. With
/// grouped-query attention, `d_k` and `d_v` of a key/value head are summed
/// over the query heads that share it; `d_bias` is summed over the
/// dimensions in which the bias broadcasts.
#[derive(Debug, Clone, PartialEq)]
///
/// For a `bf16` or `f16` call, `d_q`, `d_k` and `d_v` are in the input type
/// and `d_bias` and `d_sinks` in the options' type, `f32`
/// ([`Storage::Compute`]).
pub struct AttentionGradients<F: Storage> {
    /// `∂L/∂q`, `[batch, heads, len_q, d_k]`.
    pub d_q: Array4<F>,
    /// `∂L/∂k`, `[batch, kv_heads, len_kv, d_k]`.
    pub d_k: Array4<F>,
    /// `∂L/∂v`, `[batch, kv_heads, len_kv, d_v]`.
    pub d_v: Array4<F>,
    /// `∂L/∂bias`, in the shape the bias was given in (each dimension the
    /// full size or 1), when the options had a bias; `None` otherwise.
    pub d_bias: Option<Array4<F::Compute>>,
    /// `∂L/∂sinks`, one per query head, when the options had
    /// [`sinks`](crate::AttentionOptions::sinks); `None` otherwise. With a
    /// key shard, that of the shard holding key 0 (the others get zeros), so the
    /// sum over shards is the unsplit call's.
    pub d_sinks: Option<Array1<F::Compute>>,
}

impl<F: Storage> AttentionGradients<F> {
    /// Zero gradients shaped like the call's `q`, `k`, `v` and bias.
    pub(crate) fn zeros(call: &Call<'_, F::Compute, F, F>) -> Result<Self, AttentionError> {
        Ok(AttentionGradients {
            d_q: try_zeros("d_q", call.q.raw_dim())?,
            d_k: try_zeros("d_k", call.k.raw_dim())?,
            d_v: try_zeros("d_v", call.v.raw_dim())?,
            d_bias: match &call.opts.bias {
                Some(bias) => Some(try_zeros("d_bias", bias.raw_dim())?),
                None => None,
            },
            d_sinks: None,
        })
    }
}

impl<F: Element> AttentionGradients<F> {
    /// Views to write every gradient through.
    pub(crate) fn view_mut(&mut self) -> GradientsViewMut<'_, F> {
        GradientsViewMut {
            d_q: self.d_q.view_mut(),
            d_k: self.d_k.view_mut(),
            d_v: self.d_v.view_mut(),
            d_bias: self.d_bias.as_mut().map(|d_bias| d_bias.view_mut()),
        }
    }
}

/// Mutable views of the gradients a backward pass writes; `d_bias` has the
/// bias's own (broadcast) shape.
pub(crate) struct GradientsViewMut<'a, F> {
    pub d_q: ArrayViewMut4<'a, F>,
    pub d_k: ArrayViewMut4<'a, F>,
    pub d_v: ArrayViewMut4<'a, F>,
    pub d_bias: Option<ArrayViewMut4<'a, F>>,
}
