//! Training a layer: the forward that keeps what the backward needs
//! ([`ForwardCache`]), the backward that turns `∂L/∂Y` into the gradients
//! of the loss with respect to the inputs and every parameter
//! ([`LayerGradients`]), and the hooks an optimiser needs to update the
//! parameters in place (`parameters_mut`, `apply_gradients`, `sgd_step`).
//!
//! The backward is the chain rule back through the data path of `layer`,
//! with the attention itself differentiated by
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
//! keeps `X_q` (and `X_kv`), the projections `Q`, `K`, `V`, the
//! concatenated heads `C` and each row's log-sum-exp; the attention weights
//! are recomputed from the log-sum-exp, never stored.

use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array, Array1, Array2, Array3, Array4, ArrayView3, ArrayViewD, ArrayViewMutD, Axis, CowArray,
    Ix2,
};

use super::config::{AttentionConfig, AttentionWeights, describe_config};
use super::layer::{Heads, Layer, Projected, project, reshape_error, split_heads};
use super::{Attention, CausalAttention};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::options::AttentionOptions;

/// What a training forward keeps for the backward: from
/// [`Attention::forward_train`], [`Attention::forward_cross_train`] or
/// [`CausalAttention::forward_train`], for the same layer's `backward`.
///
/// It holds copies of the inputs, the projected queries, keys and values,
/// the concatenated attention output of the heads and each query row's
/// log-sum-exp (`[batch, heads, len_q]`), and the options of the call (so
/// the backward applies exactly the forward's masks, which is why it
/// borrows what the options borrow, `'a`). It does not hold the
/// `len_q × len_kv` attention weights: the backward recomputes them.
///
/// The gradients are those of the layer's parameters *as they were during
/// the forward*: call `backward` before updating the layer.
#[derive(Debug, Clone)]
pub struct ForwardCache<'a, F> {
    config: AttentionConfig,
    options: AttentionOptions<'a, F>,
    /// The query-side input `[batch, len_q, d_model]`.
    x_q: Array3<F>,
    /// The key/value-side input `[batch, len_kv, d_model_kv]` of
    /// cross-attention; `None` in self-attention, where it is `x_q`.
    x_kv: Option<Array3<F>>,
    projected: Projected<F>,
    /// The heads' outputs concatenated, `[batch, len_q, heads·d_v]`: the
    /// input of `W^O`, and the attention output the backward needs.
    concatenated: Array3<F>,
    log_sum_exp: Array3<F>,
}

impl<F> ForwardCache<'_, F> {
    /// The config of the layer whose forward this is.
    pub fn config(&self) -> AttentionConfig {
        self.config
    }

    /// `(batch, len_q, len_kv)` of the forward call.
    pub fn lengths(&self) -> (usize, usize, usize) {
        let (batch, len_q, _) = self.x_q.dim();
        let len_kv = self.x_kv.as_ref().unwrap_or(&self.x_q).len_of(Axis(1));
        (batch, len_q, len_kv)
    }
}

/// The gradients of a scalar loss `L` with respect to an attention layer's
/// input(s) and parameters, from the layer's `backward` (see
/// [`Attention::backward`]).
///
/// Each array has the shape of what it is the gradient of (see
/// [`AttentionWeights`] for the parameters); a parameter the layer does not
/// have (`W^O` without an output projection, the biases without `bias`)
/// has `None`. [`iter`](Self::iter) walks the parameter gradients in the
/// order of the layer's `parameters_mut`, each named as in
/// [`AttentionWeights`], so an optimiser can pair them up; the layer's
/// `apply_gradients` does the pairing and checks it.
///
/// ```
/// use ndarray::Array3;
/// use sdpa::{AttentionConfig, AttentionOptions, CausalAttention};
///
/// // Two heads of 4 over d_model = 8, output projection back to 8, biases.
/// let config = AttentionConfig::new(8, 4, 4).with_heads(2).with_output_projection(8).with_bias(true);
/// let mut layer = CausalAttention::<f32>::new_seeded(config, 1)?;
/// let x = Array3::<f32>::from_shape_fn((2, 5, 8), |(b, i, j)| ((b + 3 * i + j) % 7) as f32 * 0.2 - 0.6);
///
/// // Forward, keeping what the backward needs; the loss is L = ½·Σ y².
/// let (y, cache) = layer.forward_train(x.view(), &AttentionOptions::new())?;
/// let loss = |y: &Array3<f32>| 0.5 * y.iter().map(|v| v * v).sum::<f32>();
/// let before = loss(&y);
///
/// // Backward: ∂L/∂y = y.
/// let grads = layer.backward(&cache, y.view())?;
/// assert_eq!(grads.d_x.shape(), x.shape());
/// assert_eq!(grads.d_w_q.shape(), layer.w_q().shape());
/// assert!(grads.d_w_o.is_some() && grads.d_b_o.is_some());
/// for (name, gradient) in grads.iter() {
///     println!("{name}: {:?}", gradient.shape()); // w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o
/// }
///
/// // One step of gradient descent lowers the loss.
/// layer.sgd_step(&grads, 0.1)?;
/// let after = loss(&layer.forward_batch(x.view())?);
/// assert!(after < before);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LayerGradients<F> {
    /// `∂L/∂x`: in self-attention, of the input `[batch, len, d_model]`; in
    /// cross-attention, of the query-side input `x_q` `[batch, len_q, d_model]`.
    pub d_x: Array3<F>,
    /// `∂L/∂x_kv` of cross-attention's key/value-side input
    /// `[batch, len_kv, d_model_kv]`; `None` in self-attention, where the
    /// keys' and values' part is in `d_x`.
    pub d_x_kv: Option<Array3<F>>,
    /// `∂L/∂W^Q`, `[d_model, heads·d_k]`.
    pub d_w_q: Array2<F>,
    /// `∂L/∂W^K`, `[d_model_kv, kv_heads·d_k]`.
    pub d_w_k: Array2<F>,
    /// `∂L/∂W^V`, `[d_model_kv, kv_heads·d_v]`.
    pub d_w_v: Array2<F>,
    /// `∂L/∂W^O`, `[heads·d_v, d_out]`, when the layer has an output projection.
    pub d_w_o: Option<Array2<F>>,
    /// `∂L/∂b_q`, `[heads·d_k]`, when the layer has biases.
    pub d_b_q: Option<Array1<F>>,
    /// `∂L/∂b_k`, `[kv_heads·d_k]`, when the layer has biases. It is zero up
    /// to rounding: a key bias adds the same `q·b_k` to every score of a
    /// row, which the softmax cancels.
    pub d_b_k: Option<Array1<F>>,
    /// `∂L/∂b_v`, `[kv_heads·d_v]`, when the layer has biases.
    pub d_b_v: Option<Array1<F>>,
    /// `∂L/∂b_o`, `[d_out]`, when the layer has biases and an output projection.
    pub d_b_o: Option<Array1<F>>,
    /// `∂L/∂bias` of the attention-score bias given in the options
    /// ([`AttentionOptions::bias`]), in the shape it was given in (summed
    /// over the dimensions it broadcasts in): for a learned relative-position
    /// bias. `None` when the options had no bias.
    pub d_attention_bias: Option<Array4<F>>,
}

impl<F: Element> LayerGradients<F> {
    /// The gradients of the parameters the layer has, each with its name
    /// (`"w_q"`, `"w_k"`, `"w_v"`, `"w_o"`, `"b_q"`, `"b_k"`, `"b_v"`,
    /// `"b_o"`, as the fields of [`AttentionWeights`]), in that order,
    /// skipping those the layer does not have: the order of the layer's
    /// `parameters` and `parameters_mut`.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, ArrayViewD<'_, F>)> {
        [
            ("w_q", Some(self.d_w_q.view().into_dyn())),
            ("w_k", Some(self.d_w_k.view().into_dyn())),
            ("w_v", Some(self.d_w_v.view().into_dyn())),
            ("w_o", self.d_w_o.as_ref().map(|g| g.view().into_dyn())),
            ("b_q", self.d_b_q.as_ref().map(|g| g.view().into_dyn())),
            ("b_k", self.d_b_k.as_ref().map(|g| g.view().into_dyn())),
            ("b_v", self.d_b_v.as_ref().map(|g| g.view().into_dyn())),
            ("b_o", self.d_b_o.as_ref().map(|g| g.view().into_dyn())),
        ]
        .into_iter()
        .filter_map(|(name, gradient)| gradient.map(|g| (name, g)))
    }
}

/// The parameters in [`LayerGradients::iter`]'s order.
fn parameters<F>(
    weights: &AttentionWeights<F>,
) -> impl Iterator<Item = (&'static str, ArrayViewD<'_, F>)> {
    [
        ("w_q", Some(weights.w_q.view().into_dyn())),
        ("w_k", Some(weights.w_k.view().into_dyn())),
        ("w_v", Some(weights.w_v.view().into_dyn())),
        ("w_o", weights.w_o.as_ref().map(|w| w.view().into_dyn())),
        ("b_q", weights.b_q.as_ref().map(|b| b.view().into_dyn())),
        ("b_k", weights.b_k.as_ref().map(|b| b.view().into_dyn())),
        ("b_v", weights.b_v.as_ref().map(|b| b.view().into_dyn())),
        ("b_o", weights.b_o.as_ref().map(|b| b.view().into_dyn())),
    ]
    .into_iter()
    .filter_map(|(name, parameter)| parameter.map(|p| (name, p)))
}

/// [`parameters`], writable. The views cannot change a parameter's shape,
/// so the layer's weights still fit its config afterwards.
fn parameters_mut<F>(
    weights: &mut AttentionWeights<F>,
) -> impl Iterator<Item = (&'static str, ArrayViewMutD<'_, F>)> {
    let AttentionWeights {
        w_q,
        w_k,
        w_v,
        w_o,
        b_q,
        b_k,
        b_v,
        b_o,
    } = weights;
    [
        ("w_q", Some(w_q.view_mut().into_dyn())),
        ("w_k", Some(w_k.view_mut().into_dyn())),
        ("w_v", Some(w_v.view_mut().into_dyn())),
        ("w_o", w_o.as_mut().map(|w| w.view_mut().into_dyn())),
        ("b_q", b_q.as_mut().map(|b| b.view_mut().into_dyn())),
        ("b_k", b_k.as_mut().map(|b| b.view_mut().into_dyn())),
        ("b_v", b_v.as_mut().map(|b| b.view_mut().into_dyn())),
        ("b_o", b_o.as_mut().map(|b| b.view_mut().into_dyn())),
    ]
    .into_iter()
    .filter_map(|(name, parameter)| parameter.map(|p| (name, p)))
}

/// `name [shape], …` of a parameter list, for error messages.
fn describe<'v, F: 'v>(list: impl Iterator<Item = (&'static str, ArrayViewD<'v, F>)>) -> String {
    list.map(|(name, a)| format!("{name} {:?}", a.shape()))
        .collect::<Vec<_>>()
        .join(", ")
}

impl<F: Element> Layer<F> {
    /// The forward of `forward_batch`/`forward_cross` (`x_kv = None` for
    /// self-attention), keeping what [`backward`](Self::backward) needs.
    pub(super) fn forward_train<'a>(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: Option<ArrayView3<'_, F>>,
        options: AttentionOptions<'a, F>,
    ) -> Result<(Array3<F>, ForwardCache<'a, F>), AttentionError> {
        match x_kv {
            None => {
                self.check_query_width("x", x_q.shape(), "[batch, len, d_model]")?;
                self.check_self_attention()?;
            }
            Some(x_kv) => {
                self.check_query_width("x_q", x_q.shape(), "[batch, len_q, d_model]")?;
                self.check_kv_width("x_kv", x_kv.shape(), "[batch, len_kv, d_model_kv]")?;
                if x_q.len_of(Axis(0)) != x_kv.len_of(Axis(0)) {
                    return Err(shape_error(format!(
                        "batch sizes differ: x_q {:?} = [batch, len_q, d_model], \
                         x_kv {:?} = [batch, len_kv, d_model_kv]",
                        x_q.shape(),
                        x_kv.shape()
                    )));
                }
            }
        }
        let projected = self.project_all(x_q, x_kv.unwrap_or(x_q))?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        let (out, log_sum_exp) =
            crate::scaled_dot_product_attention_partial(q, k, v, &options)?.into_parts();
        let concatenated = merge_heads(out)?;
        let y = match &self.weights.w_o {
            None => concatenated.clone(),
            Some(w_o) => project(concatenated.view(), w_o, self.weights.b_o.as_ref())?,
        };
        let cache = ForwardCache {
            config: self.config,
            options,
            x_q: x_q.to_owned(),
            x_kv: x_kv.map(|x| x.to_owned()),
            projected,
            concatenated,
            log_sum_exp,
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
        let weights = &self.weights;
        let rows_q = batch * len_q;
        let rows_kv = batch * len_kv;

        // Through the output projection: dC = dY·W^Oᵀ.
        let d_y = rows(d_output, rows_q)?;
        let (d_concatenated, d_w_o, d_b_o) = match &weights.w_o {
            None => (d_y.into_owned(), None, None),
            Some(w_o) => {
                let concatenated = rows(cache.concatenated.view(), rows_q)?;
                let d_w_o = standard_layout(concatenated.t().dot(&d_y));
                let d_b_o = weights.b_o.as_ref().map(|_| d_y.sum_axis(Axis(0)));
                (d_y.dot(&w_o.t()), Some(d_w_o), d_b_o)
            }
        };

        // Through the attention, on the heads as the forward split them.
        let Heads { q, k, v } = self.split_all(&cache.projected)?;
        let d_concatenated = unrows(d_concatenated, batch, len_q)?;
        let out = split_heads(&cache.concatenated, c.heads)?;
        let d_out = split_heads(&d_concatenated, c.heads)?;
        let attention = crate::scaled_dot_product_attention_backward(
            q,
            k,
            v,
            &cache.options,
            out,
            cache.log_sum_exp.view(),
            d_out,
        )?;
        let d_q = merge_heads_rows(attention.d_q)?;
        let d_k = merge_heads_rows(attention.d_k)?;
        let d_v = merge_heads_rows(attention.d_v)?;

        // Through the input projections.
        let x_q = rows(cache.x_q.view(), rows_q)?;
        let x_kv = match &cache.x_kv {
            Some(x_kv) => rows(x_kv.view(), rows_kv)?,
            None => x_q.view().into(),
        };
        let bias_of = |d: &Array2<F>| c.bias.then(|| d.sum_axis(Axis(0)));
        let mut d_x_q = d_q.dot(&weights.w_q.t());
        // In self-attention the keys' and values' part adds to d_x.
        let mut d_x_kv = cache
            .x_kv
            .as_ref()
            .map(|_| Array2::zeros((rows_kv, c.kv_input_width())));
        let into = d_x_kv.as_mut().unwrap_or(&mut d_x_q);
        general_mat_mul(F::one(), &d_k, &weights.w_k.t(), F::one(), into);
        general_mat_mul(F::one(), &d_v, &weights.w_v.t(), F::one(), into);
        let d_x_kv = match d_x_kv {
            None => None,
            Some(d_x_kv) => Some(unrows(d_x_kv, batch, len_kv)?),
        };
        Ok(LayerGradients {
            d_x: unrows(d_x_q, batch, len_q)?,
            d_x_kv,
            d_w_q: standard_layout(x_q.t().dot(&d_q)),
            d_w_k: standard_layout(x_kv.t().dot(&d_k)),
            d_w_v: standard_layout(x_kv.t().dot(&d_v)),
            d_w_o,
            d_b_q: bias_of(&d_q),
            d_b_k: bias_of(&d_k),
            d_b_v: bias_of(&d_v),
            d_b_o,
            d_attention_bias: attention.d_bias,
        })
    }

    /// Checks that `gradients` has exactly this layer's parameters, each of
    /// its shape, then calls `update` on every (parameter, gradient) pair.
    fn apply_gradients(
        &mut self,
        gradients: &LayerGradients<F>,
        mut update: impl FnMut(&'static str, ArrayViewMutD<'_, F>, ArrayViewD<'_, F>),
    ) -> Result<(), AttentionError> {
        let fits = parameters(&self.weights).count() == gradients.iter().count()
            && parameters(&self.weights)
                .zip(gradients.iter())
                .all(|((p_name, p), (g_name, g))| p_name == g_name && p.shape() == g.shape());
        if !fits {
            return Err(shape_error(format!(
                "the gradients ({}) do not fit the layer's parameters ({}) of {}",
                describe(gradients.iter()),
                describe(parameters(&self.weights)),
                describe_config(&self.config)
            )));
        }
        for ((name, parameter), (_, gradient)) in
            parameters_mut(&mut self.weights).zip(gradients.iter())
        {
            update(name, parameter, gradient);
        }
        Ok(())
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
fn merge_heads<F: Element>(x: Array4<F>) -> Result<Array3<F>, AttentionError> {
    let (batch, heads, len, d) = x.dim();
    let merged = x
        .view()
        .permuted_axes([0, 2, 1, 3])
        .to_shape((batch, len, heads * d))
        .map_err(reshape_error)?
        .into_owned();
    Ok(standard_layout(merged))
}

/// [`merge_heads`], then all positions of all batch items as rows:
/// `[batch·len, heads·d]`.
fn merge_heads_rows<F: Element>(x: Array4<F>) -> Result<Array2<F>, AttentionError> {
    let merged = merge_heads(x)?;
    let (batch, len, width) = merged.dim();
    standard_layout(merged)
        .into_shape_with_order((batch * len, width))
        .map_err(reshape_error)
}

// The backward and the parameter access are the same for both layer types;
// a macro writes them once so their docs cannot drift apart.
macro_rules! layer_training {
    ($layer:ident) => {
        impl<F: Element> $layer<F> {
            /// The backward pass: given the [`ForwardCache`] of a
            /// `forward_train` call of this layer and `d_output = ∂L/∂Y`
            /// (`[batch, len_q, output_width]`, any strides), the gradients
            /// of the loss `L` with respect to the input(s), every weight
            /// and bias, and the options' attention bias if there was one.
            ///
            /// The attention's part is
            /// [`scaled_dot_product_attention_backward`](crate::scaled_dot_product_attention_backward):
            /// fused for `f32`, the reference for `f64`. Every option of
            /// the forward is honoured (it is kept in the cache): a masked
            /// key or a padding position past a key length gets no
            /// gradient through the attention. The gradients are of the
            /// parameters as they were during the forward, so call this
            /// before updating the layer.
            ///
            /// # Errors
            /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch)
            /// when `d_output` does not have the forward output's shape, or
            /// the cache comes from a layer with another config; the
            /// message names the shapes.
            pub fn backward(
                &self,
                cache: &ForwardCache<'_, F>,
                d_output: ArrayView3<'_, F>,
            ) -> Result<LayerGradients<F>, AttentionError> {
                self.layer.backward(cache, d_output)
            }

            /// The layer's parameters, each with its name (`"w_q"`, `"w_k"`,
            /// `"w_v"`, then `"w_o"`, `"b_q"`, `"b_k"`, `"b_v"`, `"b_o"`
            /// when the layer has them): the order of
            /// [`LayerGradients::iter`] and of
            /// [`parameters_mut`](Self::parameters_mut).
            ///
            /// ```
            #[doc = concat!("use sdpa::{", stringify!($layer), ", AttentionConfig};")]
            ///
            /// let config = AttentionConfig::new(8, 4, 4).with_heads(2).with_output_projection(8);
            #[doc = concat!("let layer = ", stringify!($layer), "::<f32>::new_seeded(config, 0)?;")]
            /// let count: usize = layer.parameters().map(|(_, p)| p.len()).sum();
            /// assert_eq!(count, 4 * 8 * 8);
            /// # Ok::<(), sdpa::AttentionError>(())
            /// ```
            pub fn parameters(&self) -> impl Iterator<Item = (&'static str, ArrayViewD<'_, F>)> {
                parameters(&self.layer.weights)
            }

            /// The layer's parameters, writable, in the order and with the
            /// names of [`parameters`](Self::parameters). The views cannot
            /// change a parameter's shape, so the layer stays valid.
            ///
            /// ```
            #[doc = concat!("use sdpa::{", stringify!($layer), ", AttentionConfig};")]
            ///
            #[doc = concat!("let mut layer = ", stringify!($layer), "::<f64>::new_seeded(AttentionConfig::new(4, 4, 4), 0)?;")]
            /// // Weight decay, outside any optimiser.
            /// for (_, mut parameter) in layer.parameters_mut() {
            ///     parameter *= 0.99;
            /// }
            /// # Ok::<(), sdpa::AttentionError>(())
            /// ```
            pub fn parameters_mut(
                &mut self,
            ) -> impl Iterator<Item = (&'static str, ArrayViewMutD<'_, F>)> {
                parameters_mut(&mut self.layer.weights)
            }

            /// Calls `update(name, parameter, gradient)` on every parameter
            /// of the layer with its gradient from `gradients`, in the order
            /// of [`parameters`](Self::parameters): the hook for an
            /// optimiser (Adam, momentum, clipping) written outside the
            /// crate, which keys its state by the name or the call's index.
            ///
            /// # Errors
            /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch),
            /// before anything is updated, when `gradients` does not have
            /// exactly this layer's parameters in their shapes (they come
            /// from a layer with another config); the message lists both.
            ///
            /// ```
            /// use ndarray::{Array3, ArrayD};
            #[doc = concat!("use sdpa::{", stringify!($layer), ", AttentionConfig, AttentionOptions};")]
            ///
            /// let config = AttentionConfig::new(6, 3, 3).with_heads(2).with_output_projection(6);
            #[doc = concat!("let mut layer = ", stringify!($layer), "::<f32>::new_seeded(config, 3)?;")]
            /// let x = Array3::<f32>::from_shape_fn((1, 4, 6), |(_, i, j)| (i as f32 - j as f32) * 0.1);
            ///
            /// // SGD with momentum: one velocity per parameter, in parameter order.
            /// let mut velocity: Vec<ArrayD<f32>> =
            ///     layer.parameters().map(|(_, p)| ArrayD::zeros(p.raw_dim())).collect();
            /// for _ in 0..3 {
            ///     let (y, cache) = layer.forward_train(x.view(), &AttentionOptions::new())?;
            ///     let grads = layer.backward(&cache, y.view())?; // L = ½·Σ y²
            ///     let mut slot = 0;
            ///     layer.apply_gradients(&grads, |_name, mut parameter, gradient| {
            ///         let v = &mut velocity[slot];
            ///         *v = &*v * 0.9 + &gradient;
            ///         parameter.scaled_add(-0.05, v);
            ///         slot += 1;
            ///     })?;
            /// }
            /// # Ok::<(), sdpa::AttentionError>(())
            /// ```
            pub fn apply_gradients(
                &mut self,
                gradients: &LayerGradients<F>,
                update: impl FnMut(&'static str, ArrayViewMutD<'_, F>, ArrayViewD<'_, F>),
            ) -> Result<(), AttentionError> {
                self.layer.apply_gradients(gradients, update)
            }

            /// One step of plain gradient descent: every parameter `θ`
            /// becomes `θ − learning_rate · ∂L/∂θ`.
            ///
            /// # Errors
            /// As [`apply_gradients`](Self::apply_gradients).
            pub fn sgd_step(
                &mut self,
                gradients: &LayerGradients<F>,
                learning_rate: F,
            ) -> Result<(), AttentionError> {
                self.layer
                    .apply_gradients(gradients, |_, mut parameter, gradient| {
                        parameter.scaled_add(-learning_rate, &gradient)
                    })
            }
        }
    };
}

layer_training!(Attention);
layer_training!(CausalAttention);

impl<F: Element> Attention<F> {
    /// [`forward_batch_with`](Self::forward_batch_with), keeping what
    /// [`backward`](Self::backward) needs: returns the output
    /// `[batch, len, output_width]` (the same as `forward_batch_with`'s, up
    /// to rounding) and a [`ForwardCache`].
    ///
    /// The input is a batch `[batch, len, d_model]`; for one sequence, pass
    /// `x.insert_axis(Axis(0))`. The options are those of
    /// `forward_batch_with` (masks, bias, key lengths, scale, window,
    /// causal) and are kept in the cache for the backward.
    ///
    /// # Errors
    /// As [`forward_batch_with`](Self::forward_batch_with).
    ///
    /// ```
    /// use ndarray::{Array3, s};
    /// use sdpa::{Attention, AttentionConfig, AttentionOptions};
    ///
    /// let config = AttentionConfig::new(4, 2, 2).with_heads(2).with_output_projection(4);
    /// let layer = Attention::<f64>::new_seeded(config, 5)?;
    /// // Two sequences padded to 5 positions; the first is 3 long.
    /// let x = Array3::<f64>::from_shape_fn((2, 5, 4), |(b, i, j)| ((b + i * j) % 5) as f64 * 0.3);
    /// let lengths = [3, 5];
    /// let (y, cache) = layer.forward_train(x.view(), &AttentionOptions::new().key_lengths(&lengths))?;
    ///
    /// // The loss reads the first sequence's real positions only.
    /// let mut d_y = Array3::<f64>::zeros(y.raw_dim());
    /// d_y.slice_mut(s![0, ..3, ..]).fill(1.0);
    /// let grads = layer.backward(&cache, d_y.view())?;
    /// // Nothing reaches the padding, or the other sequence.
    /// assert!(grads.d_x.slice(s![0, 3.., ..]).iter().all(|&g| g == 0.0));
    /// assert!(grads.d_x.slice(s![1, .., ..]).iter().all(|&g| g == 0.0));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_train<'a>(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'a, F>,
    ) -> Result<(Array3<F>, ForwardCache<'a, F>), AttentionError> {
        self.layer.forward_train(x, None, opts.clone())
    }

    /// [`forward_cross_with`](Self::forward_cross_with), keeping what
    /// [`backward`](Self::backward) needs: queries from `x_q`
    /// `[batch, len_q, d_model]`, keys and values from `x_kv`
    /// `[batch, len_kv, d_model_kv]`. The backward then gives
    /// [`LayerGradients::d_x`] for `x_q` and [`LayerGradients::d_x_kv`]
    /// for `x_kv`.
    ///
    /// # Errors
    /// As [`forward_cross_with`](Self::forward_cross_with).
    ///
    /// ```
    /// use ndarray::Array3;
    /// use sdpa::{Attention, AttentionConfig, AttentionOptions};
    ///
    /// let config = AttentionConfig::new(4, 2, 2).with_heads(2).with_d_model_kv(6);
    /// let layer = Attention::<f32>::new_seeded(config, 2)?;
    /// let decoder = Array3::<f32>::from_shape_fn((1, 3, 4), |(_, i, j)| (i + j) as f32 * 0.1);
    /// let encoder = Array3::<f32>::from_shape_fn((1, 7, 6), |(_, i, j)| (i * j % 5) as f32 * 0.1);
    /// let (y, cache) = layer.forward_cross_train(decoder.view(), encoder.view(), &AttentionOptions::new())?;
    /// let grads = layer.backward(&cache, Array3::ones(y.raw_dim()).view())?;
    /// assert_eq!(grads.d_x.shape(), decoder.shape());
    /// assert_eq!(grads.d_x_kv.unwrap().shape(), encoder.shape());
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_cross_train<'a>(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        opts: &AttentionOptions<'a, F>,
    ) -> Result<(Array3<F>, ForwardCache<'a, F>), AttentionError> {
        self.layer.forward_train(x_q, Some(x_kv), opts.clone())
    }
}

impl<F: Element> CausalAttention<F> {
    /// [`forward_batch_with`](Self::forward_batch_with), keeping what
    /// [`backward`](Self::backward) needs: returns the output
    /// `[batch, len, output_width]` (the same as `forward_batch_with`'s, up
    /// to rounding) and a [`ForwardCache`]. The causal rule is applied on
    /// top of `opts`, as in `forward_batch_with`, and kept for the
    /// backward; for one sequence, pass `x.insert_axis(Axis(0))`.
    ///
    /// See [`LayerGradients`] for a forward, backward and update.
    ///
    /// # Errors
    /// As [`forward_batch_with`](Self::forward_batch_with).
    pub fn forward_train<'a>(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'a, F>,
    ) -> Result<(Array3<F>, ForwardCache<'a, F>), AttentionError> {
        self.layer.forward_train(x, None, opts.clone().causal())
    }
}
