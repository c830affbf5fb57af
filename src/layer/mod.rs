//! The attention layers: learned projections `W^Q`, `W^K`, `W^V` (and an
//! optional output projection `W^O`) around scaled dot-product attention,
//! with any number of heads, as [`Attention`] (bidirectional, takes masks,
//! does cross-attention) and [`CausalAttention`] (always causal).
//!
//! Both wrap one private multi-head implementation, `layer::Layer`, that
//! owns the weights and does the projections and the head split; the seed's
//! single-head layer is its case `heads = 1` without an output projection,
//! not a copy. The attention itself is
//! [`crate::scaled_dot_product_attention`], so the layers hold no attention
//! math of their own.
//!
//! - `config`: [`AttentionConfig`] (the shape of a layer) and
//!   [`AttentionWeights`] (its parameters), and the check that they agree;
//! - `init`: the seeded Xavier initialisation;
//! - `layer`: the implementation;
//! - `gradients`: training — the forward that keeps what the backward
//!   needs, the backward, and the parameter access an optimiser needs.

mod config;
mod gradients;
mod init;
mod layer;

use ndarray::{Array2, Array3, Array4, ArrayView1, ArrayView2, ArrayView3, Axis};

pub use config::{AttentionConfig, AttentionWeights};
pub use gradients::{ForwardCache, LayerGradients};

use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::kv_cache::KvCache;
use crate::options::AttentionOptions;
use layer::Layer;

/// An attention layer, bidirectional unless its options say otherwise:
/// `Q = X_q·W^Q + b_q`, `K = X_kv·W^K + b_k`, `V = X_kv·W^V + b_v`, split
/// into heads, `softmax(Q_h·K_hᵀ/√d_k + mask)·V_h` per head, the heads
/// concatenated, then `·W^O + b_o` if the layer has an output projection.
///
/// The shape of the layer is an [`AttentionConfig`]: the seed's layer
/// ([`AttentionConfig::new`]) has one head, no output projection and no
/// biases, so its weights are `W^Q` `[d_model, d_k]`, `W^K` `[d_model, d_k]`,
/// `W^V` `[d_model, d_v]` and its output is `d_v` wide. With more heads,
/// grouped-query attention, an output projection or biases, see
/// [`AttentionWeights`] for the shapes.
///
/// Inputs are `[len, d_model]` (one sequence) or `[batch, len, d_model]`;
/// outputs are `[len, output_width]` or `[batch, len, output_width]`, where
/// the output width is `d_out` with an output projection and `heads·d_v`
/// without ([`AttentionConfig::output_width`]).
///
/// [`forward`](Self::forward) lets every position attend to every position.
/// The `_with` methods take the same [`AttentionOptions`] as
/// [`crate::scaled_dot_product_attention`] (keep mask, bias, key lengths,
/// scale, window, even `causal`), applied to the projected heads: see
/// [`forward_batch_with`](Self::forward_batch_with) for the shapes.
/// [`forward_cross`](Self::forward_cross) takes keys and values from a
/// second sequence. The `_with_weights` methods also return each head's
/// attention weights, for inspection and pictures. For a layer that is
/// always causal, and for incremental decoding with a [`KvCache`], use
/// [`CausalAttention`].
///
/// To train the layer, [`forward_train`](Self::forward_train) (or
/// [`forward_cross_train`](Self::forward_cross_train)) keeps what
/// [`backward`](Self::backward) needs to return the gradients with respect
/// to the input(s) and every parameter ([`LayerGradients`]), and
/// [`apply_gradients`](Self::apply_gradients) or
/// [`sgd_step`](Self::sgd_step) updates the parameters.
///
/// ```
/// use ndarray::Array2;
/// use sdpa::{Attention, AttentionConfig};
///
/// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(8, 4, 6), 42)?;
/// let x = Array2::<f32>::from_shape_fn((5, 8), |(i, j)| (i as f32 - j as f32) * 0.1);
/// let y = layer.forward(x.view())?;
/// assert_eq!(y.shape(), &[5, 6]);
///
/// // Four heads of 16 over d_model = 64, with an output projection back to 64.
/// let config = AttentionConfig::new(64, 16, 16).with_heads(4).with_output_projection(64);
/// let layer = Attention::<f32>::new_seeded(config, 42)?;
/// let x = ndarray::Array3::<f32>::from_shape_fn((2, 10, 64), |(b, i, j)| ((b + i * j) % 5) as f32 * 0.1);
/// assert_eq!(layer.forward_batch(x.view())?.shape(), &[2, 10, 64]);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Attention<F> {
    layer: Layer<F>,
}

/// A causal attention layer: like [`Attention`], but position `i` only
/// attends to positions `j ≤ i` of its own sequence, always; and it decodes
/// incrementally with a [`KvCache`] ([`prefill`](Self::prefill) a prompt,
/// then [`step`](Self::step) one or a few tokens at a time).
///
/// The causal rule is bottom-right aligned
/// ([`CausalAlignment::BottomRight`](crate::CausalAlignment::BottomRight));
/// in self-attention `len_q == len_kv`, where both alignments give the same
/// lower triangle. Output row `i` depends only on input rows `0..=i`.
///
/// A causal layer is self-attention: its config may not give the
/// key/value side its own width (`d_model_kv`).
///
/// It trains as [`Attention`] does: [`forward_train`](Self::forward_train),
/// [`backward`](Self::backward), then [`apply_gradients`](Self::apply_gradients)
/// or [`sgd_step`](Self::sgd_step); see [`LayerGradients`].
///
/// ```
/// use ndarray::Array2;
/// use sdpa::{AttentionConfig, CausalAttention};
///
/// let layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 4, 4), 7)?;
/// let mut x = Array2::<f64>::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f64 * 0.1);
/// let before = layer.forward(x.view())?;
/// x.row_mut(2).fill(100.0); // change the last position
/// let after = layer.forward(x.view())?;
/// assert_eq!(before.row(0), after.row(0)); // earlier outputs do not see it
/// assert_eq!(before.row(1), after.row(1));
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CausalAttention<F> {
    layer: Layer<F>,
}

// The constructors and accessors are the same for both layer types; a macro
// writes them once so their docs cannot drift apart. `$check` is run on the
// built layer (the causal layer refuses cross-attention configs).
macro_rules! layer_constructors {
    ($layer:ident, $check:expr) => {
        impl<F: Element> $layer<F> {
            /// A layer of the given shape from given weights; see
            /// [`AttentionWeights`] for the shape of each parameter.
            ///
            /// # Errors
            /// [`ErrorKind::ZeroDimension`](crate::ErrorKind::ZeroDimension)
            /// when a size in `config` is zero,
            /// [`ErrorKind::HeadsNotDivisible`](crate::ErrorKind::HeadsNotDivisible)
            /// when `heads` is not a multiple of `kv_heads`, and
            /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch)
            /// when a weight or bias does not have the shape the config
            /// asks for, or is given where the config has none (or missing
            /// where it has one). The message names the parameter, the
            /// expected shape, the config and every shape given.
            ///
            /// ```
            /// use ndarray::{Array1, Array2};
            #[doc = concat!("use sdpa::{", stringify!($layer), ", AttentionConfig, AttentionWeights, ErrorKind};")]
            ///
            /// // Two heads of width 2 over d_model = 4, an output projection to 4, biases.
            /// let config = AttentionConfig::new(4, 2, 2).with_heads(2).with_output_projection(4).with_bias(true);
            /// let weights = AttentionWeights::new(Array2::<f32>::eye(4), Array2::eye(4), Array2::eye(4))
            ///     .with_output(Array2::eye(4))
            ///     .with_biases(Array1::zeros(4), Array1::zeros(4), Array1::ones(4))
            ///     .with_output_bias(Array1::zeros(4));
            #[doc = concat!("let layer = ", stringify!($layer), "::new(config, weights.clone())?;")]
            /// assert_eq!(layer.config().heads, 2);
            ///
            /// // The same weights do not fit three heads of width 2.
            #[doc = concat!("let err = ", stringify!($layer), "::new(config.with_heads(3), weights).unwrap_err();")]
            /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
            /// assert!(err.to_string().contains("w_q"));
            /// # Ok::<(), sdpa::AttentionError>(())
            /// ```
            pub fn new(
                config: AttentionConfig,
                weights: AttentionWeights<F>,
            ) -> Result<Self, AttentionError> {
                let layer = Layer::new(config, weights)?;
                $check(&layer)?;
                Ok(Self { layer })
            }

            /// The seed's single-head layer from given weights: `w_q`
            /// `[d_model, d_k]`, `w_k` `[d_model, d_k]`, `w_v`
            /// `[d_model, d_v]`, with no output projection and no biases.
            /// The config is read off their shapes.
            ///
            /// # Errors
            /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch)
            /// when the three do not have the same number of rows
            /// (`d_model`) or `w_q` and `w_k` not the same number of columns
            /// (`d_k`);
            /// [`ErrorKind::ZeroDimension`](crate::ErrorKind::ZeroDimension)
            /// when `d_model`, `d_k` or `d_v` is zero. The message names the
            /// three shapes.
            ///
            /// ```
            /// use ndarray::Array2;
            #[doc = concat!("use sdpa::{", stringify!($layer), ", ErrorKind};")]
            ///
            /// let w_q = Array2::<f64>::eye(3);
            /// let w_k = Array2::<f64>::eye(3);
            /// let w_v = Array2::<f64>::ones((3, 2));
            #[doc = concat!("let layer = ", stringify!($layer), "::from_weights(w_q.clone(), w_k.clone(), w_v)?;")]
            /// assert_eq!(layer.config().d_v, 2);
            ///
            /// let too_few_rows = Array2::<f64>::ones((2, 2));
            #[doc = concat!("let err = ", stringify!($layer), "::from_weights(w_q, w_k, too_few_rows).unwrap_err();")]
            /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
            /// # Ok::<(), sdpa::AttentionError>(())
            /// ```
            pub fn from_weights(
                w_q: Array2<F>,
                w_k: Array2<F>,
                w_v: Array2<F>,
            ) -> Result<Self, AttentionError> {
                Layer::from_single_head_weights(w_q, w_k, w_v).map(|layer| Self { layer })
            }

            /// A layer with deterministic Xavier/Glorot-uniform weights drawn
            /// from `seed`.
            ///
            /// Each weight matrix `[fan_in, fan_out]` (shapes as in
            /// [`AttentionWeights`]) is drawn from `U(−a, a)` with
            /// `a = √(6 / (fan_in + fan_out))`, over the whole matrix (all
            /// heads): for the seed's single-head layer, `W^Q` and `W^K`
            /// with `a = √(6 / (d_model + d_k))` and `W^V` with
            /// `a = √(6 / (d_model + d_v))`. The draws come from one
            /// SplitMix64 stream seeded with `seed`, filling `W^Q`, then
            /// `W^K`, then `W^V`, then `W^O` if there is one, each row by
            /// row. They are made in `f64` (an `f32` layer gets them
            /// rounded), so the same config and seed give the same weights
            /// on every platform, for both element types. Biases, if the
            /// config asks for them, start at zero (as in PyTorch's
            /// `MultiheadAttention`), so they do not change the draws.
            ///
            /// # Errors
            /// [`ErrorKind::ZeroDimension`](crate::ErrorKind::ZeroDimension)
            /// when a size in `config` is zero;
            /// [`ErrorKind::HeadsNotDivisible`](crate::ErrorKind::HeadsNotDivisible)
            /// when `heads` is not a multiple of `kv_heads`.
            ///
            /// ```
            #[doc = concat!("use sdpa::{", stringify!($layer), ", AttentionConfig};")]
            ///
            /// let config = AttentionConfig::new(8, 4, 4);
            #[doc = concat!("let a = ", stringify!($layer), "::<f32>::new_seeded(config, 1)?;")]
            #[doc = concat!("let b = ", stringify!($layer), "::<f32>::new_seeded(config, 1)?;")]
            /// assert_eq!(a, b);
            /// let bound = (6.0_f32 / (8.0 + 4.0)).sqrt();
            /// assert!(a.w_q().iter().all(|w| w.abs() <= bound));
            /// # Ok::<(), sdpa::AttentionError>(())
            /// ```
            pub fn new_seeded(config: AttentionConfig, seed: u64) -> Result<Self, AttentionError> {
                let layer = Layer::new_seeded(config, seed)?;
                $check(&layer)?;
                Ok(Self { layer })
            }

            /// The layer's dimensions.
            pub fn config(&self) -> AttentionConfig {
                self.layer.config
            }

            /// All of the layer's parameters.
            pub fn weights(&self) -> &AttentionWeights<F> {
                &self.layer.weights
            }

            /// The query projection `W^Q`, `[d_model, heads·d_k]`.
            pub fn w_q(&self) -> ArrayView2<'_, F> {
                self.layer.weights.w_q.view()
            }

            /// The key projection `W^K`, `[d_model_kv, kv_heads·d_k]`.
            pub fn w_k(&self) -> ArrayView2<'_, F> {
                self.layer.weights.w_k.view()
            }

            /// The value projection `W^V`, `[d_model_kv, kv_heads·d_v]`.
            pub fn w_v(&self) -> ArrayView2<'_, F> {
                self.layer.weights.w_v.view()
            }

            /// The output projection `W^O`, `[heads·d_v, d_out]`, if the
            /// layer has one.
            pub fn w_o(&self) -> Option<ArrayView2<'_, F>> {
                self.layer.weights.w_o.as_ref().map(|w| w.view())
            }

            /// The query bias `[heads·d_k]`, if the layer has biases.
            pub fn b_q(&self) -> Option<ArrayView1<'_, F>> {
                self.layer.weights.b_q.as_ref().map(|b| b.view())
            }

            /// The key bias `[kv_heads·d_k]`, if the layer has biases.
            pub fn b_k(&self) -> Option<ArrayView1<'_, F>> {
                self.layer.weights.b_k.as_ref().map(|b| b.view())
            }

            /// The value bias `[kv_heads·d_v]`, if the layer has biases.
            pub fn b_v(&self) -> Option<ArrayView1<'_, F>> {
                self.layer.weights.b_v.as_ref().map(|b| b.view())
            }

            /// The output bias `[d_out]`, if the layer has biases and an
            /// output projection.
            pub fn b_o(&self) -> Option<ArrayView1<'_, F>> {
                self.layer.weights.b_o.as_ref().map(|b| b.view())
            }
        }
    };
}

layer_constructors!(Attention, |_: &Layer<F>| Ok::<(), AttentionError>(()));
layer_constructors!(CausalAttention, check_self_attention::<F>);

/// A causal layer attends within one sequence, so both sides have one width.
fn check_self_attention<F: Element>(layer: &Layer<F>) -> Result<(), AttentionError> {
    let config = &layer.config;
    if config.kv_input_width() != config.d_model {
        return Err(shape_error(format!(
            "a causal layer is self-attention: d_model_kv ({}) must equal d_model ({})",
            config.kv_input_width(),
            config.d_model
        )));
    }
    Ok(())
}

impl<F: Element> Attention<F> {
    /// Bidirectional attention over one sequence `x`, `[len, d_model]`;
    /// returns `[len, output_width]`. Every position attends to every
    /// position.
    ///
    /// An empty sequence gives an empty `[0, output_width]` output.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x` is not `d_model` wide (the message names `x`'s shape and the
    /// layer's), or the layer is a cross-attention layer (`d_model_kv`
    /// differs from `d_model`).
    pub fn forward(&self, x: ArrayView2<'_, F>) -> Result<Array2<F>, AttentionError> {
        self.forward_with(x, &AttentionOptions::new())
    }

    /// [`forward`](Self::forward) with options: `x` is one sequence
    /// `[len, d_model]`, so it is batch item 0 of a batch of 1, and a keep
    /// mask or bias has shape `[1, heads, len, len]` (any of the last three
    /// may be 1 to broadcast: `[1, 1, 1, len]` hides keys from every query
    /// of every head), and `key_lengths` takes exactly one length.
    ///
    /// # Errors
    /// As [`forward`](Self::forward), and when the options do not fit the
    /// shapes (see [`crate::scaled_dot_product_attention`]).
    ///
    /// ```
    /// use ndarray::Array2;
    /// use sdpa::{Attention, AttentionConfig, AttentionOptions};
    ///
    /// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(4, 4, 4), 3)?;
    /// let x = Array2::<f32>::from_shape_fn((6, 4), |(i, j)| ((i + j) % 3) as f32);
    /// // The last two positions are padding: no query may attend to them.
    /// let y = layer.forward_with(x.view(), &AttentionOptions::new().key_lengths(&[4]))?;
    /// let mut changed = x.clone();
    /// changed.slice_mut(ndarray::s![4.., ..]).fill(9.0);
    /// let y_changed = layer.forward_with(changed.view(), &AttentionOptions::new().key_lengths(&[4]))?;
    /// assert_eq!(y.slice(ndarray::s![..4, ..]), y_changed.slice(ndarray::s![..4, ..]));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_with(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array2<F>, AttentionError> {
        Ok(self.layer.forward(x, opts, false)?.0)
    }

    /// [`forward_with`](Self::forward_with), also returning each head's
    /// attention weights `[heads, len, len]`: row `i` of head `h` is how
    /// much position `i` attends to each position (summing to 1, or all 0
    /// for a query that sees no key).
    ///
    /// The weights are computed only by the `_with_weights` methods, by
    /// [`crate::core::attention_weights`] on the projected queries and keys,
    /// which materialises `len × len` per head; the output is the one
    /// [`forward_with`](Self::forward_with) gives, bit for bit.
    ///
    /// # Errors
    /// As [`forward_with`](Self::forward_with).
    ///
    /// ```
    /// use ndarray::Array2;
    /// use sdpa::{Attention, AttentionConfig, AttentionOptions};
    ///
    /// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(8, 4, 4).with_heads(2), 1)?;
    /// let x = Array2::<f32>::from_shape_fn((5, 8), |(i, j)| ((i * j) % 3) as f32 - 1.0);
    /// let (y, weights) = layer.forward_with_weights(x.view(), &AttentionOptions::new())?;
    /// assert_eq!(y, layer.forward(x.view())?);
    /// assert_eq!(weights.shape(), &[2, 5, 5]);
    /// for row in weights.rows() {
    ///     assert!((row.sum() - 1.0).abs() < 1e-5);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_with_weights(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array2<F>, Array3<F>), AttentionError> {
        with_weights_of_one_sequence(self.layer.forward(x, opts, true)?)
    }

    /// Bidirectional attention over a batch `x`, `[batch, len, d_model]`;
    /// returns `[batch, len, output_width]`. Each batch item attends only
    /// within itself.
    ///
    /// # Errors
    /// As [`forward`](Self::forward).
    ///
    /// ```
    /// use ndarray::Array3;
    /// use sdpa::{Attention, AttentionConfig};
    ///
    /// let layer = Attention::<f64>::new_seeded(AttentionConfig::new(8, 4, 4), 0)?;
    /// let x = Array3::<f64>::from_shape_fn((2, 5, 8), |(b, i, j)| (b + i * j) as f64 * 0.01);
    /// let y = layer.forward_batch(x.view())?;
    /// assert_eq!(y.shape(), &[2, 5, 4]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_batch(&self, x: ArrayView3<'_, F>) -> Result<Array3<F>, AttentionError> {
        self.forward_batch_with(x, &AttentionOptions::new())
    }

    /// [`forward_batch`](Self::forward_batch) with options, exactly as the
    /// functional API takes them for the projected heads: a keep mask or
    /// bias has shape `[batch, heads, len, len]`, where any dimension may be
    /// 1 to broadcast (`[batch, 1, 1, len]` is a key-padding mask), and
    /// `key_lengths` has one length per batch item (keys at or past it are
    /// padding). A `.causal()` or `.window(w)` option makes the call causal.
    ///
    /// # Errors
    /// As [`forward_batch`](Self::forward_batch), and when the options do not
    /// fit the shapes (see [`crate::scaled_dot_product_attention`]).
    ///
    /// ```
    /// use ndarray::{Array3, Array4};
    /// use sdpa::{Attention, AttentionConfig, AttentionOptions};
    ///
    /// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(4, 2, 3), 5)?;
    /// let x = Array3::<f32>::from_shape_fn((2, 3, 4), |(b, i, j)| (b + i + j) as f32 * 0.1);
    /// // A relative-position bias shared by the whole batch.
    /// let bias = Array4::<f32>::from_shape_fn((1, 1, 3, 3), |(_, _, i, j)| -((i as f32 - j as f32).abs()));
    /// let y = layer.forward_batch_with(x.view(), &AttentionOptions::new().bias(bias.view()))?;
    /// assert_eq!(y.shape(), &[2, 3, 3]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_batch_with(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        Ok(self.layer.forward_batch(x, opts, false)?.0)
    }

    /// [`forward_batch_with`](Self::forward_batch_with), also returning the
    /// attention weights `[batch, heads, len, len]`, computed only when
    /// asked for (see [`forward_with_weights`](Self::forward_with_weights)).
    ///
    /// # Errors
    /// As [`forward_batch_with`](Self::forward_batch_with).
    pub fn forward_batch_with_weights(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array3<F>, Array4<F>), AttentionError> {
        with_weights(self.layer.forward_batch(x, opts, true)?)
    }

    /// Cross-attention: queries from `x_q` `[batch, len_q, d_model]`, keys
    /// and values from `x_kv` `[batch, len_kv, d_model_kv]` (a decoder
    /// attending to an encoder's output); returns
    /// `[batch, len_q, output_width]`. Every query sees every key.
    ///
    /// # Errors
    /// As [`forward_cross_with`](Self::forward_cross_with).
    ///
    /// ```
    /// use ndarray::Array3;
    /// use sdpa::{Attention, AttentionConfig};
    ///
    /// // Queries 8 wide, keys and values from a 12-wide encoder output.
    /// let config = AttentionConfig::new(8, 4, 4).with_heads(2).with_d_model_kv(12).with_output_projection(8);
    /// let layer = Attention::<f32>::new_seeded(config, 1)?;
    /// let decoder = Array3::<f32>::from_shape_fn((1, 3, 8), |(_, i, j)| (i + j) as f32 * 0.1);
    /// let encoder = Array3::<f32>::from_shape_fn((1, 7, 12), |(_, i, j)| (i * j % 5) as f32 * 0.1);
    /// let y = layer.forward_cross(decoder.view(), encoder.view())?;
    /// assert_eq!(y.shape(), &[1, 3, 8]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_cross(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.forward_cross_with(x_q, x_kv, &AttentionOptions::new())
    }

    /// [`forward_cross`](Self::forward_cross) with options: a keep mask or
    /// bias has shape `[batch, heads, len_q, len_kv]` (each dimension may be
    /// 1 to broadcast), and `key_lengths` gives each batch item's `x_kv`
    /// length (the rest is padding).
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x_q` is not `d_model` wide, `x_kv` not `d_model_kv` wide, or the two
    /// have different batch sizes; and when the options do not fit the
    /// shapes (see [`crate::scaled_dot_product_attention`]).
    pub fn forward_cross_with(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        Ok(self.layer.forward_cross(x_q, x_kv, opts, false)?.0)
    }

    /// [`forward_cross_with`](Self::forward_cross_with), also returning the
    /// attention weights `[batch, heads, len_q, len_kv]`, computed only when
    /// asked for (see [`forward_with_weights`](Self::forward_with_weights)).
    ///
    /// # Errors
    /// As [`forward_cross_with`](Self::forward_cross_with).
    pub fn forward_cross_with_weights(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array3<F>, Array4<F>), AttentionError> {
        with_weights(self.layer.forward_cross(x_q, x_kv, opts, true)?)
    }
}

impl<F: Element> CausalAttention<F> {
    /// Causal attention over one sequence `x`, `[len, d_model]`; returns
    /// `[len, output_width]`, where row `i` depends only on rows `0..=i` of `x`.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x` is not `d_model` wide.
    pub fn forward(&self, x: ArrayView2<'_, F>) -> Result<Array2<F>, AttentionError> {
        self.forward_with(x, &AttentionOptions::new())
    }

    /// [`forward`](Self::forward) with further masks, bias, scale or
    /// window, shaped as for [`Attention::forward_with`]. The causal rule is
    /// always applied on top of them; any alignment set in `opts` is
    /// replaced by bottom-right, which in self-attention is the same
    /// triangle.
    ///
    /// # Errors
    /// As [`forward`](Self::forward), and when the options do not fit the shapes.
    pub fn forward_with(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array2<F>, AttentionError> {
        Ok(self.layer.forward(x, &opts.clone().causal(), false)?.0)
    }

    /// [`forward_with`](Self::forward_with), also returning each head's
    /// attention weights `[heads, len, len]`, zero above the diagonal. As
    /// for [`Attention::forward_with_weights`], the weights are computed
    /// only when asked for, and the output is the one
    /// [`forward_with`](Self::forward_with) gives.
    ///
    /// # Errors
    /// As [`forward_with`](Self::forward_with).
    ///
    /// ```
    /// use ndarray::Array2;
    /// use sdpa::{AttentionConfig, AttentionOptions, CausalAttention};
    ///
    /// let layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 2, 2).with_heads(2), 3)?;
    /// let x = Array2::<f64>::from_shape_fn((3, 4), |(i, j)| (i + 2 * j) as f64 * 0.1);
    /// let (_, weights) = layer.forward_with_weights(x.view(), &AttentionOptions::new())?;
    /// assert_eq!(weights[[1, 0, 0]], 1.0); // the first position sees only itself
    /// assert_eq!(weights[[0, 1, 2]], 0.0); // nor does any see the future
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_with_weights(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array2<F>, Array3<F>), AttentionError> {
        with_weights_of_one_sequence(self.layer.forward(x, &opts.clone().causal(), true)?)
    }

    /// Causal attention over a batch `x`, `[batch, len, d_model]`; returns
    /// `[batch, len, output_width]`.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x` is not `d_model` wide.
    pub fn forward_batch(&self, x: ArrayView3<'_, F>) -> Result<Array3<F>, AttentionError> {
        self.forward_batch_with(x, &AttentionOptions::new())
    }

    /// [`forward_batch`](Self::forward_batch) with further masks, bias,
    /// scale or window, shaped as for [`Attention::forward_batch_with`]; the
    /// causal rule is always applied on top of them.
    ///
    /// # Errors
    /// As [`forward_batch`](Self::forward_batch), and when the options do not
    /// fit the shapes.
    ///
    /// ```
    /// use ndarray::Array3;
    /// use sdpa::{AttentionConfig, AttentionOptions, CausalAttention};
    ///
    /// let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(4, 4, 4), 9)?;
    /// // Two sequences padded to length 5; the first is 3 long.
    /// let x = Array3::<f32>::from_shape_fn((2, 5, 4), |(b, i, j)| (b * 5 + i + j) as f32 * 0.1);
    /// let y = layer.forward_batch_with(x.view(), &AttentionOptions::new().key_lengths(&[3, 5]))?;
    /// assert_eq!(y.shape(), &[2, 5, 4]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn forward_batch_with(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        Ok(self
            .layer
            .forward_batch(x, &opts.clone().causal(), false)?
            .0)
    }

    /// [`forward_batch_with`](Self::forward_batch_with), also returning the
    /// attention weights `[batch, heads, len, len]`, computed only when
    /// asked for.
    ///
    /// # Errors
    /// As [`forward_batch_with`](Self::forward_batch_with).
    pub fn forward_batch_with_weights(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array3<F>, Array4<F>), AttentionError> {
        with_weights(self.layer.forward_batch(x, &opts.clone().causal(), true)?)
    }

    /// An empty growing [`KvCache`] shaped for this layer (its `kv_heads`,
    /// `d_k`, `d_v`), for `batch` sequences, with room for `capacity`
    /// positions before it first grows.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> KvCache<F> {
        self.layer.new_cache(batch, capacity, None)
    }

    /// An empty ring-buffer [`KvCache`] shaped for this layer, for
    /// sliding-window attention: with it, [`prefill`](Self::prefill) and
    /// [`step`](Self::step) give what
    /// [`forward_batch_with`](Self::forward_batch_with) with
    /// [`AttentionOptions::window`]`(window)` gives, keeping only the last
    /// `window` positions.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidOption`](crate::ErrorKind::InvalidOption) when
    /// `window` is 0.
    pub fn new_window_cache(
        &self,
        batch: usize,
        window: usize,
    ) -> Result<KvCache<F>, AttentionError> {
        let c = self.layer.config;
        KvCache::with_window(window, batch, c.kv_heads, c.d_k, c.d_v)
    }

    /// Starts decoding: clears `cache`, then runs [`step`](Self::step) on
    /// the prompt `x` `[batch, len, d_model]`, returning its
    /// `[batch, len, output_width]` output (the same as
    /// [`forward_batch`](Self::forward_batch)) and leaving its keys and
    /// values in the cache.
    ///
    /// # Errors
    /// As [`step`](Self::step); the cache is not cleared then.
    ///
    /// ```
    /// use ndarray::{s, Array3};
    /// use sdpa::{AttentionConfig, CausalAttention};
    ///
    /// let config = AttentionConfig::new(16, 4, 4).with_heads(4).with_kv_heads(2).with_output_projection(16);
    /// let layer = CausalAttention::<f32>::new_seeded(config, 7)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 12, 16), |(_, i, j)| ((i * 5 + j) % 9) as f32 * 0.1 - 0.4);
    ///
    /// let mut cache = layer.new_cache(1, 8);
    /// let prompt = layer.prefill(x.slice(s![.., ..8, ..]), &mut cache)?;
    /// let mut last = prompt;
    /// for t in 8..12 {
    ///     // In a model, x_new would come from the token just generated.
    ///     last = layer.step(x.slice(s![.., t..t + 1, ..]), &mut cache)?;
    /// }
    /// assert_eq!((cache.len(), cache.capacity()), (12, 16)); // grew once, by doubling
    ///
    /// let full = layer.forward_batch(x.view())?;
    /// for (a, b) in last.iter().zip(full.slice(s![.., 11.., ..]).iter()) {
    ///     assert!((a - b).abs() < 1e-5);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn prefill(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.prefill(x, cache)
    }

    /// One decoding step: `x_new` `[batch, n, d_model]` are the next `n`
    /// positions of the sequences in `cache` (usually `n = 1`). Their keys
    /// and values are appended to the cache, and only their `n` query rows
    /// are computed, against everything cached, bottom-right causal (the
    /// new rows are the newest positions; in a ring-buffer cache, each sees
    /// only the last `window` positions). Returns
    /// `[batch, n, output_width]`: rows `total_len .. total_len + n` of what
    /// [`forward_batch`](Self::forward_batch) gives on the whole sequence.
    ///
    /// The scale is `1/√d_k`; other options (masks, bias) are not taken,
    /// as their shapes would depend on the cache.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x_new` is not `d_model` wide, or the cache was not made for this
    /// layer and batch (its `batch`, `kv_heads`, `d_k` or `d_v` differ);
    /// the cache is unchanged then.
    pub fn step(
        &self,
        x_new: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.step(x_new, cache)
    }
}

/// The output and the weights of a call that asked for them.
fn with_weights<F, D>(
    (out, weights): layer::Forward<F, D>,
) -> Result<(ndarray::Array<F, D>, Array4<F>), AttentionError> {
    match weights {
        Some(weights) => Ok((out, weights)),
        // `Layer` computes them whenever asked; this is never reached.
        None => Err(shape_error("the attention weights were not computed")),
    }
}

/// [`with_weights`] for one sequence: weights `[1, heads, len, len]` →
/// `[heads, len, len]`.
fn with_weights_of_one_sequence<F>(
    forward: layer::Forward<F, ndarray::Ix2>,
) -> Result<(Array2<F>, Array3<F>), AttentionError> {
    let (out, weights) = with_weights(forward)?;
    Ok((out, weights.index_axis_move(Axis(0), 0)))
}
