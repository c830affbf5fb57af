//! The training forward, which keeps what the backward needs in a
//! [`ForwardCache`], and the backward: the chain rule back through the
//! data path of `project`, with the attention itself differentiated by
//! [`crate::scaled_dot_product_attention_backward`] (the fused pass for
//! `f32`, the reference for `f64`). Rows are all positions of all batch
//! items; the heads are split and merged as in the forward:
//!
//! ```text
//! forward                               backward, given dY = ∂L/∂Y
//! Q = X_q ·W^Q + b_q                    dW^Q = X_qᵀ·dQ    db_q = Σ_rows dQ   dX_q = dQ·W^Qᵀ
//! K = X_kv·W^K + b_k                    dW^K = X_kvᵀ·dK   db_k = Σ_rows dK
//! V = X_kv·W^V + b_v                    dW^V = X_kvᵀ·dV   db_v = Σ_rows dV
//!                                       dX_kv = dK·W^Kᵀ + dV·W^Vᵀ
//! C = concat_h attention(Q_h, K_h, V_h) (dQ, dK, dV, dbias) = attention backward(dC)
//! Y = C·W^O + b_o                       dW^O = Cᵀ·dY      db_o = Σ_rows dY   dC = dY·W^Oᵀ
//! ```
//!
//! In self-attention `X_q = X_kv = X`, so `dX = dX_q + dX_kv`. The forward
//! keeps `X_q` (and `X_kv`), the projections `Q`, `K`, `V` and the
//! attention's [`AttentionPartial`](crate::AttentionPartial) (the heads'
//! output, `C` before concatenation, and each row's log-sum-exp); the
//! attention weights are recomputed from the log-sum-exp, never stored.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array, Array2, Array3, ArrayView3, ArrayView4, Axis, CowArray, Ix2};

use super::Layer;
use super::config::describe_config;
use super::params::LayerParameters;
use super::project::{Heads, copied, project, reshape_error, split_heads};
use super::train::{ForwardCache, LayerGradients};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::options::AttentionOptions;
use crate::rope::RopePositions;

impl<F: Element> Layer<F> {
    /// The forward of `forward_batch`/`forward_cross` (`x_kv = None` for
    /// self-attention), keeping what [`backward`](Self::backward) needs.
    pub(super) fn forward_train<'a>(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: Option<ArrayView3<'_, F>>,
        options: AttentionOptions<'a, F>,
    ) -> Result<(Array3<F>, ForwardCache<'a, F>), AttentionError> {
        let projected = match x_kv {
            None => self.project_batch(x_q)?,
            Some(x_kv) => self.project_cross(x_q, x_kv)?,
        };
        let Heads { q, k, v } = self.split_all(&projected)?;
        let attention = crate::scaled_dot_product_attention_partial(q, k, v, &options)?;
        let concatenated = merge_heads(attention.output())?;
        let y = match &self.parameters.w_o {
            None => concatenated,
            Some(w_o) => project(concatenated.view(), w_o, self.parameters.b_o.as_ref())?,
        };
        let cache = ForwardCache {
            config: self.config,
            options,
            x_q: copied("the forward cache's x_q", x_q)?,
            x_kv: x_kv
                .map(|x| copied("the forward cache's x_kv", x))
                .transpose()?,
            projected,
            attention,
        };
        Ok((y, cache))
    }

    /// The gradients of the loss given `d_output = ∂L/∂Y` of the forward
    /// `cache` was kept from.
    pub(super) fn backward(
        &self,
        cache: &ForwardCache<'_, F>,
        d_output: ArrayView3<'_, F>,
    ) -> Result<LayerGradients<F>, AttentionError> {
        let c = &self.config;
        if cache.config != *c {
            return Err(shape_error(format!(
                "the forward cache comes from a layer with {}, but this layer has {}",
                describe_config(&cache.config),
                describe_config(c)
            )));
        }
        let (batch, len_q, len_kv) = cache.lengths();
        let expected = (batch, len_q, c.output_width());
        if d_output.dim() != expected {
            return Err(shape_error(format!(
                "d_output has shape {:?} but the forward's output is \
                 [batch, len_q, output_width] = {:?}",
                d_output.shape(),
                [expected.0, expected.1, expected.2]
            )));
        }
        let parameters = &self.parameters;
        let rows_q = batch * len_q;
        let rows_kv = batch * len_kv;

        // Through the output projection: dC = dY·W^Oᵀ.
        let d_y = rows(d_output, rows_q)?;
        let (d_concatenated, d_w_o, d_b_o) = match &parameters.w_o {
            None => (d_y.into_owned(), None, None),
            Some(w_o) => {
                // The input of W^O, the heads' output concatenated again.
                let concatenated = merge_heads_rows(cache.attention.output())?;
                let d_w_o = standard_layout(concatenated.t().dot(&d_y));
                let d_b_o = parameters.b_o.as_ref().map(|_| d_y.sum_axis(Axis(0)));
                (d_y.dot(&w_o.t()), Some(d_w_o), d_b_o)
            }
        };

        // Through the attention, on the heads as the forward split them.
        let Heads { q, k, v } = self.split_all(&cache.projected)?;
        let d_concatenated = unrows(d_concatenated, batch, len_q)?;
        let d_out = split_heads(&d_concatenated, c.heads)?;
        // The one call of the attention's backward.
        let mut attention: crate::AttentionGradients<F> =
            crate::scaled_dot_product_attention_backward(
                q,
                k,
                v,
                &cache.options,
                &cache.attention,
                d_out,
            )?;
        // Through the rotation of the queries and keys (positions 0..len,
        // as the forward rotated them), to the projections' outputs.
        if let Some(table) = &self.rope {
            for d in [&mut attention.d_q, &mut attention.d_k] {
                crate::rope::apply_rope_backward_inplace(
                    d.view_mut(),
                    table,
                    RopePositions::Start(0),
                )
                .map_err(|err| self.rope_error(err))?;
            }
        }
        let d_q = merge_heads_rows(attention.d_q.view())?;
        let d_k = merge_heads_rows(attention.d_k.view())?;
        let d_v = merge_heads_rows(attention.d_v.view())?;

        // Through the input projections.
        let x_q = rows(cache.x_q.view(), rows_q)?;
        let x_kv = match &cache.x_kv {
            Some(x_kv) => rows(x_kv.view(), rows_kv)?,
            None => x_q.view().into(),
        };
        let bias_of = |d: &Array2<F>| c.bias.then(|| d.sum_axis(Axis(0)));
        let mut d_x_q = d_q.dot(&parameters.w_q.t());
        // In self-attention the keys' and values' part adds to d_x.
        let mut d_x_kv = cache
            .x_kv
            .as_ref()
            .map(|_| Array2::zeros((rows_kv, c.kv_input_width())));
        let into = d_x_kv.as_mut().unwrap_or(&mut d_x_q);
        general_mat_mul(F::one(), &d_k, &parameters.w_k.t(), F::one(), into);
        general_mat_mul(F::one(), &d_v, &parameters.w_v.t(), F::one(), into);
        let d_x_kv = match d_x_kv {
            None => None,
            Some(d_x_kv) => Some(unrows(d_x_kv, batch, len_kv)?),
        };
        Ok(LayerGradients {
            d_x: unrows(d_x_q, batch, len_q)?,
            d_x_kv,
            d_parameters: LayerParameters {
                w_q: standard_layout(x_q.t().dot(&d_q)),
                w_k: standard_layout(x_kv.t().dot(&d_k)),
                w_v: standard_layout(x_kv.t().dot(&d_v)),
                w_o: d_w_o,
                b_q: bias_of(&d_q),
                b_k: bias_of(&d_k),
                b_v: bias_of(&d_v),
                b_o: d_b_o,
            },
            d_attention_bias: attention.d_bias,
        })
    }
}

/// `x` `[batch, len, width]` as `[batch·len, width]` (`count = batch·len`
/// rows), a view when the layout allows.
fn rows<'v, F: Element>(
    x: ArrayView3<'v, F>,
    count: usize,
) -> Result<CowArray<'v, F, Ix2>, AttentionError> {
    let width = x.len_of(Axis(2));
    match x.into_shape_with_order((count, width)) {
        Ok(view) => Ok(view.into()),
        // Not contiguous in row-major order: copy, in that order.
        Err(_) => Array2::from_shape_vec((count, width), x.iter().copied().collect())
            .map(CowArray::from)
            .map_err(reshape_error),
    }
}

/// `[batch·len, width]` back to `[batch, len, width]`.
fn unrows<F: Element>(x: Array2<F>, batch: usize, len: usize) -> Result<Array3<F>, AttentionError> {
    let width = x.ncols();
    standard_layout(x)
        .into_shape_with_order((batch, len, width))
        .map_err(reshape_error)
}

/// `x` in row-major order, copied only when it is not: `dot` returns a
/// column-major product when both factors have unit row strides (a single
/// column, or a transposed matrix), which a row-major reshape refuses; and
/// gradients handed to users are row-major, like the parameters.
fn standard_layout<F: Element, D: ndarray::Dimension>(x: Array<F, D>) -> Array<F, D> {
    if x.is_standard_layout() {
        x
    } else {
        x.as_standard_layout().into_owned()
    }
}

/// `[batch, heads, len, d]` → `[batch, len, heads·d]`, head `h` in columns
/// `h·d .. (h+1)·d`, as the projections lay them out.
fn merge_heads<F: Element>(x: ArrayView4<'_, F>) -> Result<Array3<F>, AttentionError> {
    let (batch, heads, len, d) = x.dim();
    let merged = x
        .permuted_axes([0, 2, 1, 3])
        .to_shape((batch, len, heads * d))
        .map_err(reshape_error)?
        .into_owned();
    Ok(standard_layout(merged))
}

/// [`merge_heads`], then all positions of all batch items as rows:
/// `[batch·len, heads·d]`.
fn merge_heads_rows<F: Element>(x: ArrayView4<'_, F>) -> Result<Array2<F>, AttentionError> {
    let merged = merge_heads(x)?;
    let (batch, len, width) = merged.dim();
    standard_layout(merged)
        .into_shape_with_order((batch * len, width))
        .map_err(reshape_error)
}
