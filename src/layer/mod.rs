//! The attention layers: learned projections `W^Q`, `W^K`, `W^V` (and an
//! optional output projection `W^O`) around scaled dot-product attention,
//! with any number of heads, as [`Attention`] (bidirectional, takes masks,
//! does cross-attention) and [`CausalAttention`] (always causal).
//!
//! Both wrap one private multi-head implementation, [`Layer`], that owns
//! the config and the parameters; the seed's single-head layer is its case
//! `heads = 1` without an output projection, not a copy. The attention
//! itself is [`crate::scaled_dot_product_attention`] (or its backward, or
//! the [`KvCache`]'s incremental form), so the layers hold no attention
//! math of their own. Each public method is a thin delegation to `Layer`,
//! written out on both types, in the file of its concern:
//!
//! - `mod.rs`: the two layer types and `Layer`; their constructors
//!   (`new`, `from_projections`, `new_seeded`) and accessors (`config`,
//!   `parameters`, `parameters_mut`);
//! - `config`: [`AttentionConfig`], the shape of a layer;
//! - `params`: [`LayerParameters`] and the parameter table (names, shapes,
//!   order) that everything touching parameters reads;
//! - `init`: building a `Layer` — checked against its config, from three
//!   projection matrices, or seeded (Xavier);
//! - `project`: the data path every pass shares — the projections, the
//!   head split, the attention call and the output projection;
//! - `forward`: the `forward*` methods;
//! - `decode`: `CausalAttention`'s incremental decoding with a [`KvCache`];
//! - `backward`: the training forward and the chain rule back through the
//!   data path;
//! - `train`: the training API — [`ForwardCache`], [`LayerGradients`],
//!   `forward_train`, `backward`, `apply_gradients`, `sgd_step`.

mod backward;
mod config;
mod decode;
mod forward;
mod init;
mod layouts;
#[cfg(feature = "safetensors")]
mod load;
mod params;
mod project;
mod train;

use ndarray::{Array2, ArrayViewMutD};

pub use config::{AttentionConfig, RopeConfig};
pub use layouts::TorchLinear;
pub use params::LayerParameters;
pub use train::{ForwardCache, LayerGradients};

use crate::element::Element;
use crate::error::AttentionError;
#[cfg(doc)]
use crate::kv_cache::KvCache;
#[cfg(doc)]
use crate::options::AttentionOptions;
use crate::rope::RopeTable;

/// An attention layer, bidirectional unless its options say otherwise:
/// `Q = X_q·W^Q + b_q`, `K = X_kv·W^K + b_k`, `V = X_kv·W^V + b_v`, split
/// into heads, `softmax(Q_h·K_hᵀ/√d_k + mask)·V_h` per head, the heads
/// concatenated, then `·W^O + b_o` if the layer has an output projection.
///
/// The shape of the layer is an [`AttentionConfig`]: the seed's layer
/// ([`AttentionConfig::new`]) has one head, no output projection and no
/// biases, so its parameters are `W^Q` `[d_model, d_k]`, `W^K`
/// `[d_model, d_k]`, `W^V` `[d_model, d_v]` and its output is `d_v` wide.
/// With more heads, grouped-query attention, an output projection or
/// biases, see [`LayerParameters`] for the shapes.
///
/// Inputs are `[len, d_model]` (one sequence) or `[batch, len, d_model]`;
/// outputs are `[len, output_width]` or `[batch, len, output_width]`, where
/// the output width is `d_model_out` with an output projection and
/// `heads·d_v` without ([`AttentionConfig::output_width`]).
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
/// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(8, 1).with_head_dim(4).with_value_dim(6), 42)?;
/// let x = Array2::<f32>::from_shape_fn((5, 8), |(i, j)| (i as f32 - j as f32) * 0.1);
/// let y = layer.forward(x.view())?;
/// assert_eq!(y.shape(), &[5, 6]);
///
/// // Four heads of 16 over d_model = 64, with an output projection back to 64.
/// let config = AttentionConfig::new(64, 4).with_output_projection(64);
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
/// let layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 1), 7)?;
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

/// The config and the parameters every layer type shares, and the
/// computation on them; a checked pair (the parameters fit the config).
#[derive(Debug, Clone, PartialEq)]
struct Layer<F> {
    config: AttentionConfig,
    parameters: LayerParameters<F>,
    /// The cosines and sines of `config.rope`, built with the layer.
    rope: Option<RopeTable<F>>,
}

impl<F: Element> Attention<F> {
    /// A layer of the given shape from given parameters; see
    /// [`LayerParameters`] for the shape of each.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroDimension`](crate::ErrorKind::ZeroDimension) when a
    /// size in `config` is zero,
    /// [`ErrorKind::HeadsNotDivisible`](crate::ErrorKind::HeadsNotDivisible)
    /// when `heads` is not a multiple of `kv_heads`, and
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when a
    /// weight or bias does not have the shape the config asks for, or is
    /// given where the config has none (or missing where it has one). The
    /// message names the parameter, the expected shape, the config and
    /// every shape given.
    ///
    /// ```
    /// use ndarray::{Array1, Array2};
    /// use sdpa::{Attention, AttentionConfig, ErrorKind, LayerParameters};
    ///
    /// // Two heads of width 2 over d_model = 4, an output projection to 4, biases.
    /// let config = AttentionConfig::new(4, 2).with_output_projection(4).with_bias(true);
    /// let parameters = LayerParameters::new(Array2::<f32>::eye(4), Array2::eye(4), Array2::eye(4))
    ///     .with_output(Array2::eye(4))
    ///     .with_biases(Array1::zeros(4), Array1::zeros(4), Array1::ones(4))
    ///     .with_output_bias(Array1::zeros(4));
    /// let layer = Attention::new(config, parameters.clone())?;
    /// assert_eq!(layer.config().heads, 2);
    ///
    /// // The same parameters do not fit three heads of width 2.
    /// let err = Attention::new(config.with_heads(3).with_head_dim(2), parameters).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    /// assert!(err.to_string().contains("w_q"));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn new(
        config: AttentionConfig,
        parameters: LayerParameters<F>,
    ) -> Result<Self, AttentionError> {
        Layer::new(config, parameters).map(|layer| Self { layer })
    }

    /// The seed's single-head layer from its three projection matrices:
    /// `w_q` `[d_model, d_k]`, `w_k` `[d_model, d_k]`, `w_v`
    /// `[d_model, d_v]`, with no output projection and no biases. The
    /// config is read off their shapes.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// the three do not have the same number of rows (`d_model`) or `w_q`
    /// and `w_k` not the same number of columns (`d_k`);
    /// [`ErrorKind::ZeroDimension`](crate::ErrorKind::ZeroDimension) when
    /// `d_model`, `d_k` or `d_v` is zero. The message names the three
    /// shapes.
    ///
    /// ```
    /// use ndarray::Array2;
    /// use sdpa::{Attention, ErrorKind};
    ///
    /// let w_q = Array2::<f64>::eye(3);
    /// let w_k = Array2::<f64>::eye(3);
    /// let w_v = Array2::<f64>::ones((3, 2));
    /// let layer = Attention::from_projections(w_q.clone(), w_k.clone(), w_v)?;
    /// assert_eq!(layer.config().d_v(), 2);
    ///
    /// let too_few_rows = Array2::<f64>::ones((2, 2));
    /// let err = Attention::from_projections(w_q, w_k, too_few_rows).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn from_projections(
        w_q: Array2<F>,
        w_k: Array2<F>,
        w_v: Array2<F>,
    ) -> Result<Self, AttentionError> {
        Layer::from_projections(w_q, w_k, w_v).map(|layer| Self { layer })
    }

    /// A layer with deterministic Xavier/Glorot-uniform weights drawn from
    /// `seed`.
    ///
    /// Each weight matrix `[fan_in, fan_out]` (shapes as in
    /// [`LayerParameters`]) is drawn from `U(−a, a)` with
    /// `a = √(6 / (fan_in + fan_out))`, over the whole matrix (all heads):
    /// for the seed's single-head layer, `W^Q` and `W^K` with
    /// `a = √(6 / (d_model + d_k))` and `W^V` with
    /// `a = √(6 / (d_model + d_v))`. The draws come from one SplitMix64
    /// stream seeded with `seed`, filling `W^Q`, then `W^K`, then `W^V`,
    /// then `W^O` if there is one, each row by row. They are made in `f64`
    /// (an `f32` layer gets them rounded), so the same config and seed give
    /// the same weights on every platform, for both element types. Biases,
    /// if the config asks for them, start at zero (as in PyTorch's
    /// `MultiheadAttention`), so they do not change the draws.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroDimension`](crate::ErrorKind::ZeroDimension) when a
    /// size in `config` is zero;
    /// [`ErrorKind::HeadsNotDivisible`](crate::ErrorKind::HeadsNotDivisible)
    /// when `heads` is not a multiple of `kv_heads`.
    ///
    /// ```
    /// use sdpa::{Attention, AttentionConfig};
    ///
    /// let config = AttentionConfig::new(8, 1).with_head_dim(4);
    /// let a = Attention::<f32>::new_seeded(config, 1)?;
    /// let b = Attention::<f32>::new_seeded(config, 1)?;
    /// assert_eq!(a, b);
    /// let bound = (6.0_f32 / (8.0 + 4.0)).sqrt();
    /// assert!(a.parameters().w_q.iter().all(|w| w.abs() <= bound));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn new_seeded(config: AttentionConfig, seed: u64) -> Result<Self, AttentionError> {
        Layer::new_seeded(config, seed).map(|layer| Self { layer })
    }

    /// The layer's dimensions.
    pub fn config(&self) -> AttentionConfig {
        self.layer.config
    }
}

impl<F: Element> CausalAttention<F> {
    /// A causal layer of the given shape from given parameters, as
    /// [`Attention::new`].
    ///
    /// # Errors
    /// As [`Attention::new`], and
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// the config gives the key/value side its own width (`d_model_kv`
    /// other than `d_model`).
    ///
    /// ```
    /// use ndarray::{Array1, Array2};
    /// use sdpa::{AttentionConfig, CausalAttention, ErrorKind, LayerParameters};
    ///
    /// let config = AttentionConfig::new(4, 2).with_output_projection(4).with_bias(true);
    /// let parameters = LayerParameters::new(Array2::<f32>::eye(4), Array2::eye(4), Array2::eye(4))
    ///     .with_output(Array2::eye(4))
    ///     .with_biases(Array1::zeros(4), Array1::zeros(4), Array1::ones(4))
    ///     .with_output_bias(Array1::zeros(4));
    /// let layer = CausalAttention::new(config, parameters.clone())?;
    /// assert_eq!(layer.config().heads, 2);
    ///
    /// let err = CausalAttention::new(config.with_heads(3).with_head_dim(2), parameters).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    /// assert!(err.to_string().contains("w_q"));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn new(
        config: AttentionConfig,
        parameters: LayerParameters<F>,
    ) -> Result<Self, AttentionError> {
        let layer = Layer::new(config, parameters)?.check_causal()?;
        Ok(Self { layer })
    }

    /// The seed's single-head causal layer from its three projection
    /// matrices, as [`Attention::from_projections`].
    ///
    /// # Errors
    /// As [`Attention::from_projections`].
    ///
    /// ```
    /// use ndarray::Array2;
    /// use sdpa::{CausalAttention, ErrorKind};
    ///
    /// let (w_q, w_k, w_v) = (Array2::<f64>::eye(3), Array2::<f64>::eye(3), Array2::<f64>::ones((3, 2)));
    /// let layer = CausalAttention::from_projections(w_q.clone(), w_k.clone(), w_v)?;
    /// assert_eq!(layer.config().d_v(), 2);
    ///
    /// let too_few_rows = Array2::<f64>::ones((2, 2));
    /// let err = CausalAttention::from_projections(w_q, w_k, too_few_rows).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn from_projections(
        w_q: Array2<F>,
        w_k: Array2<F>,
        w_v: Array2<F>,
    ) -> Result<Self, AttentionError> {
        // A single-head config read off the shapes has no `d_model_kv`.
        Layer::from_projections(w_q, w_k, w_v).map(|layer| Self { layer })
    }

    /// A causal layer with deterministic Xavier/Glorot-uniform weights
    /// drawn from `seed`, exactly as [`Attention::new_seeded`] draws them.
    ///
    /// # Errors
    /// As [`Attention::new_seeded`], and as [`new`](Self::new) when the
    /// config gives the key/value side its own width.
    ///
    /// ```
    /// use sdpa::{Attention, AttentionConfig, CausalAttention};
    ///
    /// let config = AttentionConfig::new(8, 2);
    /// let causal = CausalAttention::<f32>::new_seeded(config, 1)?;
    /// assert_eq!(causal.parameters(), Attention::<f32>::new_seeded(config, 1)?.parameters());
    /// assert!(CausalAttention::<f32>::new_seeded(config.with_d_model_kv(6), 1).is_err());
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn new_seeded(config: AttentionConfig, seed: u64) -> Result<Self, AttentionError> {
        let layer = Layer::new_seeded(config, seed)?.check_causal()?;
        Ok(Self { layer })
    }

    /// The layer's dimensions.
    pub fn config(&self) -> AttentionConfig {
        self.layer.config
    }
}

impl<F: Element> Attention<F> {
    /// The layer's parameters; see [`LayerParameters`] for their shapes,
    /// and [`LayerParameters::iter`] to walk them by name.
    ///
    /// ```
    /// use sdpa::{Attention, AttentionConfig};
    ///
    /// let seeded = Attention::<f64>::new_seeded(AttentionConfig::new(4, 1).with_head_dim(2).with_value_dim(3), 1)?;
    /// assert_eq!(seeded.parameters().w_v.dim(), (4, 3));
    /// // The same layer again, from its parameters.
    /// let copy = Attention::new(seeded.config(), seeded.parameters().clone())?;
    /// assert_eq!(copy, seeded);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn parameters(&self) -> &LayerParameters<F> {
        &self.layer.parameters
    }

    /// The layer's parameters, writable, as [`LayerParameters::iter`] names
    /// and orders them. Views rather than `&mut LayerParameters`, so that
    /// no parameter can change shape and the layer stays valid.
    ///
    /// ```
    /// use sdpa::{Attention, AttentionConfig};
    ///
    /// let mut layer = Attention::<f64>::new_seeded(AttentionConfig::new(4, 1), 0)?;
    /// // Weight decay, outside any optimiser.
    /// for (_, mut parameter) in layer.parameters_mut() {
    ///     parameter *= 0.99;
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn parameters_mut(&mut self) -> impl Iterator<Item = (&'static str, ArrayViewMutD<'_, F>)> {
        self.layer.parameters.iter_mut()
    }
}

impl<F: Element> CausalAttention<F> {
    /// The layer's parameters, as [`Attention::parameters`].
    ///
    /// ```
    /// use sdpa::{AttentionConfig, CausalAttention};
    ///
    /// let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(8, 1).with_head_dim(4), 1)?;
    /// let bound = (6.0_f32 / (8.0 + 4.0)).sqrt();
    /// assert!(layer.parameters().w_q.iter().all(|w| w.abs() <= bound));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn parameters(&self) -> &LayerParameters<F> {
        &self.layer.parameters
    }

    /// The layer's parameters, writable, as [`Attention::parameters_mut`].
    ///
    /// ```
    /// use sdpa::{AttentionConfig, CausalAttention};
    ///
    /// let mut layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 1), 0)?;
    /// for (_, mut parameter) in layer.parameters_mut() {
    ///     parameter *= 0.99;
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn parameters_mut(&mut self) -> impl Iterator<Item = (&'static str, ArrayViewMutD<'_, F>)> {
        self.layer.parameters.iter_mut()
    }
}
