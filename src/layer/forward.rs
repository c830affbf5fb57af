//! The `forward*` methods of both layer types: self-attention over one
//! sequence (`[len, d_model]`) or a batch (`[batch, len, d_model]`), and
//! `Attention`'s cross-attention; each with options (`_with`) and with the
//! attention weights (`_with_weights`). Every one projects the input
//! (`project`) and attends; the weights, when asked for, are computed on
//! the same projections by a second call.

use ndarray::{Array, Array2, Array3, Array4, ArrayView2, ArrayView3, Axis, Dimension, RemoveAxis};

use super::project::Projected;
use super::{Attention, CausalAttention, Layer};
use crate::element::Element;
use crate::error::AttentionError;
use crate::options::AttentionOptions;

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
    /// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(4, 1), 3)?;
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
        self.layer.forward_sequence(x, opts)
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
    /// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(8, 2), 1)?;
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
        self.layer.forward_sequence_with_weights(x, opts)
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
    /// let layer = Attention::<f64>::new_seeded(AttentionConfig::new(8, 1).with_head_dim(4), 0)?;
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
    /// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(4, 1).with_head_dim(2).with_value_dim(3), 5)?;
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
        self.layer.forward_batch(x, opts)
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
        self.layer.forward_batch_with_weights(x, opts)
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
    /// let config = AttentionConfig::new(8, 2).with_d_model_kv(12).with_output_projection(8);
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
        self.layer.forward_cross(x_q, x_kv, opts)
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
        self.layer.forward_cross_with_weights(x_q, x_kv, opts)
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
        self.layer.forward_sequence(x, &opts.clone().causal())
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
    /// let layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 2), 3)?;
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
        self.layer
            .forward_sequence_with_weights(x, &opts.clone().causal())
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
    /// let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(4, 1), 9)?;
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
        self.layer.forward_batch(x, &opts.clone().causal())
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
        self.layer
            .forward_batch_with_weights(x, &opts.clone().causal())
    }
}

// Each projects once and attends; a `_with_weights` form also computes
// the weights from the same projections.
impl<F: Element> Layer<F> {
    fn forward_sequence(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array2<F>, AttentionError> {
        let projected = self.project_sequence(x)?;
        Ok(one_sequence(self.attend(&projected, opts)?))
    }

    /// The weights are `[heads, len, len]`.
    fn forward_sequence_with_weights(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array2<F>, Array3<F>), AttentionError> {
        let projected = self.project_sequence(x)?;
        let (out, weights) = self.attend_with_weights(&projected, opts)?;
        Ok((one_sequence(out), one_sequence(weights)))
    }

    fn forward_batch(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        let projected = self.project_batch(x)?;
        self.attend(&projected, opts)
    }

    fn forward_batch_with_weights(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array3<F>, Array4<F>), AttentionError> {
        let projected = self.project_batch(x)?;
        self.attend_with_weights(&projected, opts)
    }

    fn forward_cross(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        let projected = self.project_cross(x_q, x_kv)?;
        self.attend(&projected, opts)
    }

    fn forward_cross_with_weights(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array3<F>, Array4<F>), AttentionError> {
        let projected = self.project_cross(x_q, x_kv)?;
        self.attend_with_weights(&projected, opts)
    }

    fn attend_with_weights(
        &self,
        projected: &Projected<F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<(Array3<F>, Array4<F>), AttentionError> {
        let out = self.attend(projected, opts)?;
        let weights = self.attention_weights(projected, opts)?;
        Ok((out, weights))
    }
}

/// The result for batch item 0 of a batch of 1, the one sequence given.
fn one_sequence<F, D: Dimension + RemoveAxis>(x: Array<F, D>) -> Array<F, D::Smaller> {
    x.index_axis_move(Axis(0), 0)
}
