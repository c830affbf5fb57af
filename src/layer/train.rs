//! Training a layer, the public side: the forward that keeps what the
//! backward needs ([`ForwardCache`]), the backward that turns `∂L/∂Y` into
//! the gradients of the loss with respect to the inputs and every
//! parameter ([`LayerGradients`]), and the updates an optimiser makes
//! (`apply_gradients`, `sgd_step`). The chain rule itself is in `backward`.

use ndarray::{Array3, Array4, ArrayView3, ArrayViewD, ArrayViewMutD, Axis};

use super::config::AttentionConfig;
use super::params::LayerParameters;
use super::project::Projected;
use super::{Attention, CausalAttention, Layer};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::options::AttentionOptions;
use crate::partial::AttentionPartial;

/// What a training forward keeps for the backward: from
/// [`Attention::forward_train`], [`Attention::forward_cross_train`] or
/// [`CausalAttention::forward_train`], for the same layer's `backward`.
///
/// It holds copies of the inputs, the projected queries, keys and values,
/// the attention's result as an [`AttentionPartial`] (the heads' output and
/// each query row's log-sum-exp, `[batch, heads, len_q]`), and the options
/// of the call (so the backward applies exactly the forward's masks, which
/// is why it borrows what the options borrow, `'a`). It does not hold the
/// `len_q × len_kv` attention weights: the backward recomputes them.
///
/// The gradients are those of the layer's parameters *as they were during
/// the forward*: call `backward` before updating the layer.
#[derive(Debug, Clone)]
pub struct ForwardCache<'a, F: Element> {
    pub(super) config: AttentionConfig,
    pub(super) options: AttentionOptions<'a, F>,
    /// The query-side input `[batch, len_q, d_model]`.
    pub(super) x_q: Array3<F>,
    /// The key/value-side input `[batch, len_kv, d_model_kv]` of
    /// cross-attention; `None` in self-attention, where it is `x_q`.
    pub(super) x_kv: Option<Array3<F>>,
    pub(super) projected: Projected<F>,
    /// The attention over the projected heads, `[batch, heads, len_q, d_v]`,
    /// with its log-sum-exp: what the attention's backward takes.
    pub(super) attention: AttentionPartial<F>,
}

impl<F: Element> ForwardCache<'_, F> {
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
/// Each array has the shape of what it is the gradient of. The parameters'
/// gradients are a [`LayerParameters`], `d_parameters`, with exactly the
/// layer's parameters (`None` where the layer has none, such as `w_o`
/// without an output projection); [`LayerParameters::iter`] walks them by
/// name in the order of the layer's `parameters_mut`, so an optimiser can
/// pair them up, and the layer's `apply_gradients` does the pairing and
/// checks it.
///
/// ```
/// use ndarray::Array3;
/// use sdpa::{AttentionConfig, AttentionOptions, CausalAttention};
///
/// // Two heads of 4 over d_model = 8, output projection back to 8, biases.
/// let config = AttentionConfig::new(8, 2).with_output_projection(8).with_bias(true);
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
/// assert_eq!(grads.d_parameters.w_q.shape(), layer.parameters().w_q.shape());
/// assert!(grads.d_parameters.w_o.is_some() && grads.d_parameters.b_o.is_some());
/// for (name, gradient) in grads.d_parameters.iter() {
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
    /// `∂L/∂θ` for every parameter `θ` of the layer, each in its shape:
    /// `d_parameters.w_q` is `∂L/∂W^Q`, and so on. `d_parameters.b_k` is
    /// zero up to rounding: a key bias adds the same `q·b_k` to every score
    /// of a row, which the softmax cancels.
    pub d_parameters: LayerParameters<F>,
    /// `∂L/∂bias` of the attention-score bias given in the options
    /// ([`AttentionOptions::bias`]), in the shape it was given in (summed
    /// over the dimensions it broadcasts in): for a learned relative-position
    /// bias. `None` when the options had no bias.
    pub d_attention_bias: Option<Array4<F>>,
}

impl<F: Element> Layer<F> {
    /// Checks that `gradients` has exactly this layer's parameters, each of
    /// its shape, then calls `update` on every (parameter, gradient) pair.
    fn apply_gradients(
        &mut self,
        gradients: &LayerGradients<F>,
        mut update: impl FnMut(&'static str, ArrayViewMutD<'_, F>, ArrayViewD<'_, F>),
    ) -> Result<(), AttentionError> {
        // The layer's parameters fit its config, so gradients that fit it
        // pair up with them one to one.
        gradients.d_parameters.check(&self.config).map_err(|err| {
            shape_error(format!(
                "the gradients do not fit this layer: {}",
                err.message()
            ))
        })?;
        for ((name, parameter), (_, gradient)) in self
            .parameters
            .iter_mut()
            .zip(gradients.d_parameters.iter())
        {
            update(name, parameter, gradient);
        }
        Ok(())
    }

    /// `θ ← θ − learning_rate · ∂L/∂θ` for every parameter.
    fn sgd_step(
        &mut self,
        gradients: &LayerGradients<F>,
        learning_rate: F,
    ) -> Result<(), AttentionError> {
        self.apply_gradients(gradients, |_, mut parameter, gradient| {
            parameter.scaled_add(-learning_rate, &gradient)
        })
    }
}

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
    /// let config = AttentionConfig::new(4, 2).with_output_projection(4);
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
    /// let config = AttentionConfig::new(4, 2).with_d_model_kv(6);
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

    /// The backward pass: given the [`ForwardCache`] of a `forward_train`
    /// call of this layer and `d_output = ∂L/∂Y`
    /// (`[batch, len_q, output_width]`, any strides), the gradients of the
    /// loss `L` with respect to the input(s), every weight and bias, and
    /// the options' attention bias if there was one.
    ///
    /// The attention's part is
    /// [`scaled_dot_product_attention_backward`](crate::scaled_dot_product_attention_backward):
    /// fused for `f32`, the reference for `f64`. Every option of the
    /// forward is honoured (it is kept in the cache): a masked key or a
    /// padding position past a key length gets no gradient through the
    /// attention. The gradients are of the parameters as they were during
    /// the forward, so call this before updating the layer.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `d_output` does not have the forward output's shape, or the cache
    /// comes from a layer with another config; the message names the
    /// shapes.
    pub fn backward(
        &self,
        cache: &ForwardCache<'_, F>,
        d_output: ArrayView3<'_, F>,
    ) -> Result<LayerGradients<F>, AttentionError> {
        self.layer.backward(cache, d_output)
    }

    /// Calls `update(name, parameter, gradient)` on every parameter of the
    /// layer with its gradient from `gradients`, in the order of
    /// [`LayerParameters::iter`]: the hook for an optimiser (Adam,
    /// momentum, clipping) written outside the crate, which keys its state
    /// by the name or the call's index.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch),
    /// before anything is updated, when `gradients` does not have exactly
    /// this layer's parameters in their shapes (they come from a layer
    /// with another config); the message names the first that differs, the
    /// config and every gradient's shape.
    ///
    /// ```
    /// use ndarray::{Array3, ArrayD};
    /// use sdpa::{Attention, AttentionConfig, AttentionOptions};
    ///
    /// let config = AttentionConfig::new(6, 2).with_output_projection(6);
    /// let mut layer = Attention::<f32>::new_seeded(config, 3)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 4, 6), |(_, i, j)| (i as f32 - j as f32) * 0.1);
    ///
    /// // SGD with momentum: one velocity per parameter, in parameter order.
    /// let mut velocity: Vec<ArrayD<f32>> =
    ///     layer.parameters().iter().map(|(_, p)| ArrayD::zeros(p.raw_dim())).collect();
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

    /// One step of plain gradient descent: every parameter `θ` becomes
    /// `θ − learning_rate · ∂L/∂θ`.
    ///
    /// # Errors
    /// As [`apply_gradients`](Self::apply_gradients).
    pub fn sgd_step(
        &mut self,
        gradients: &LayerGradients<F>,
        learning_rate: F,
    ) -> Result<(), AttentionError> {
        self.layer.sgd_step(gradients, learning_rate)
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

    /// The backward pass, as [`Attention::backward`]: the gradients of the
    /// loss with respect to the input, every parameter, and the options'
    /// attention bias if there was one, given the cache of a
    /// [`forward_train`](Self::forward_train) call of this layer and
    /// `d_output = ∂L/∂Y`.
    ///
    /// # Errors
    /// As [`Attention::backward`].
    pub fn backward(
        &self,
        cache: &ForwardCache<'_, F>,
        d_output: ArrayView3<'_, F>,
    ) -> Result<LayerGradients<F>, AttentionError> {
        self.layer.backward(cache, d_output)
    }

    /// Calls `update(name, parameter, gradient)` on every parameter with
    /// its gradient, as [`Attention::apply_gradients`].
    ///
    /// # Errors
    /// As [`Attention::apply_gradients`].
    ///
    /// ```
    /// use ndarray::Array3;
    /// use sdpa::{AttentionConfig, AttentionOptions, CausalAttention};
    ///
    /// let config = AttentionConfig::new(6, 2).with_output_projection(6);
    /// let mut layer = CausalAttention::<f32>::new_seeded(config, 3)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 4, 6), |(_, i, j)| (i as f32 - j as f32) * 0.1);
    /// let (y, cache) = layer.forward_train(x.view(), &AttentionOptions::new())?;
    /// let grads = layer.backward(&cache, y.view())?;
    /// let mut names = Vec::new();
    /// layer.apply_gradients(&grads, |name, mut parameter, gradient| {
    ///     parameter.scaled_add(-0.05, &gradient);
    ///     names.push(name);
    /// })?;
    /// assert_eq!(names, ["w_q", "w_k", "w_v", "w_o"]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn apply_gradients(
        &mut self,
        gradients: &LayerGradients<F>,
        update: impl FnMut(&'static str, ArrayViewMutD<'_, F>, ArrayViewD<'_, F>),
    ) -> Result<(), AttentionError> {
        self.layer.apply_gradients(gradients, update)
    }

    /// One step of plain gradient descent, as [`Attention::sgd_step`].
    ///
    /// # Errors
    /// As [`Attention::apply_gradients`].
    pub fn sgd_step(
        &mut self,
        gradients: &LayerGradients<F>,
        learning_rate: F,
    ) -> Result<(), AttentionError> {
        self.layer.sgd_step(gradients, learning_rate)
    }
}
