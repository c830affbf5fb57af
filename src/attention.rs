//! The seed's attention layer: learned projections `W^Q`, `W^K`, `W^V`
//! followed by scaled dot-product attention, as [`Attention`]
//! (bidirectional, takes masks) and [`CausalAttention`] (always causal).
//!
//! Both wrap one private [`Layer`] that owns the weights and does the
//! projections; the attention itself is [`crate::scaled_dot_product_attention`],
//! so the layers hold no attention math of their own.
//!
//! Room to grow: the shape of a layer is an [`AttentionConfig`]
//! (`#[non_exhaustive]`, built by a constructor and setters), so fields such
//! as a head count or an output projection can be added later with defaults
//! that keep today's single-head behaviour, without breaking callers. The
//! projected `Q`, `K`, `V` already go to the functional API as
//! `[batch, heads, len, d]` views with `heads = 1`; several heads become a
//! reshape of the `[batch, len, heads·d_k]` projection and a permuted view.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3, ArrayView4, Axis, ShapeError};

use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};
use crate::options::AttentionOptions;

/// The dimensions of an attention layer.
///
/// - `d_model`: the width of each input vector (a row of `X`);
/// - `d_k`: the width of queries and keys (columns of `W^Q` and `W^K`);
/// - `d_v`: the width of values and of the output (columns of `W^V`).
///
/// The seed's single-head layer takes `d_k = d_v = d_model`, but any positive
/// sizes are allowed. The struct is `#[non_exhaustive]`: build it with
/// [`AttentionConfig::new`] and the `with_*` setters, so that fields added
/// later (a head count, an output projection, each defaulting to today's
/// behaviour) do not break your code.
///
/// ```
/// use sdpa::AttentionConfig;
///
/// let config = AttentionConfig::new(16, 8, 8).with_d_v(4);
/// assert_eq!((config.d_model, config.d_k, config.d_v), (16, 8, 4));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct AttentionConfig {
    /// Width of each input vector.
    pub d_model: usize,
    /// Width of queries and keys.
    pub d_k: usize,
    /// Width of values and of the layer's output.
    pub d_v: usize,
}

impl AttentionConfig {
    /// A single-head layer mapping `d_model`-wide inputs to `d_k`-wide
    /// queries and keys and `d_v`-wide values.
    ///
    /// The sizes are checked (all positive) when a layer is built from it.
    pub fn new(d_model: usize, d_k: usize, d_v: usize) -> Self {
        Self { d_model, d_k, d_v }
    }

    /// Sets the input width `d_model`.
    pub fn with_d_model(mut self, d_model: usize) -> Self {
        self.d_model = d_model;
        self
    }

    /// Sets the query/key width `d_k`.
    pub fn with_d_k(mut self, d_k: usize) -> Self {
        self.d_k = d_k;
        self
    }

    /// Sets the value/output width `d_v`.
    pub fn with_d_v(mut self, d_v: usize) -> Self {
        self.d_v = d_v;
        self
    }

    fn check(&self) -> Result<(), AttentionError> {
        if self.d_model == 0 || self.d_k == 0 || self.d_v == 0 {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "d_model, d_k and d_v must be positive, got d_model = {}, d_k = {}, d_v = {}",
                    self.d_model, self.d_k, self.d_v
                ),
            ));
        }
        Ok(())
    }
}

/// An attention layer, bidirectional unless its options say otherwise:
/// `Q = X·W^Q`, `K = X·W^K`, `V = X·W^V`, then
/// `softmax(Q·Kᵀ/√d_k + mask)·V`.
///
/// Weights: `W^Q` is `[d_model, d_k]`, `W^K` is `[d_model, d_k]`, `W^V` is
/// `[d_model, d_v]`. Inputs are `[len, d_model]` (one sequence) or
/// `[batch, len, d_model]`; outputs are `[len, d_v]` or `[batch, len, d_v]`.
///
/// [`forward`](Self::forward) lets every position attend to every position.
/// The `_with` methods take the same [`AttentionOptions`] as
/// [`crate::scaled_dot_product_attention`] (keep mask, bias, key lengths,
/// scale, even `causal`), applied with `heads = 1`: see
/// [`forward_batch_with`](Self::forward_batch_with) for the shapes. For a
/// layer that is always causal, use [`CausalAttention`].
///
/// ```
/// use ndarray::Array2;
/// use sdpa::{Attention, AttentionConfig};
///
/// let layer = Attention::<f32>::new_seeded(AttentionConfig::new(8, 4, 6), 42)?;
/// let x = Array2::<f32>::from_shape_fn((5, 8), |(i, j)| (i as f32 - j as f32) * 0.1);
/// let y = layer.forward(x.view())?;
/// assert_eq!(y.shape(), &[5, 6]);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Attention<F> {
    layer: Layer<F>,
}

/// A causal attention layer: like [`Attention`], but position `i` only
/// attends to positions `j ≤ i` of its own sequence, always.
///
/// The causal rule is bottom-right aligned
/// ([`CausalAlignment::BottomRight`](crate::CausalAlignment::BottomRight));
/// in self-attention `len_q == len_kv`, where both alignments give the same
/// lower triangle. Output row `i` depends only on input rows `0..=i`.
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
// writes them once so their docs cannot drift apart.
macro_rules! layer_constructors {
    ($layer:ident) => {
        impl<F: Element> $layer<F> {
            /// A layer from given weights: `w_q` `[d_model, d_k]`, `w_k`
            /// `[d_model, d_k]`, `w_v` `[d_model, d_v]`. The config is read
            /// off their shapes.
            ///
            /// # Errors
            /// [`ErrorKind::ShapeMismatch`] when the three do not have the same
            /// number of rows (`d_model`) or `w_q` and `w_k` not the same number
            /// of columns (`d_k`); [`ErrorKind::ZeroDimension`] when `d_model`,
            /// `d_k` or `d_v` is zero. The message names the three shapes.
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
                Layer::from_weights(w_q, w_k, w_v).map(|layer| Self { layer })
            }

            /// A layer with deterministic Xavier/Glorot-uniform weights drawn
            /// from `seed`.
            ///
            /// Each weight matrix `[fan_in, fan_out]` is drawn from
            /// `U(−a, a)` with `a = √(6 / (fan_in + fan_out))`: `W^Q` and
            /// `W^K` with `a = √(6 / (d_model + d_k))`, `W^V` with
            /// `a = √(6 / (d_model + d_v))`. The draws come from one
            /// SplitMix64 stream seeded with `seed`, filling `W^Q`, then
            /// `W^K`, then `W^V`, each row by row. They are made in `f64`
            /// (an `f32` layer gets them rounded), so the same config and
            /// seed give the same weights on every platform, for both
            /// element types.
            ///
            /// # Errors
            /// [`ErrorKind::ZeroDimension`] when `d_model`, `d_k` or `d_v` is zero.
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
                Layer::new_seeded(config, seed).map(|layer| Self { layer })
            }

            /// The layer's dimensions.
            pub fn config(&self) -> AttentionConfig {
                self.layer.config
            }

            /// The query projection `W^Q`, `[d_model, d_k]`.
            pub fn w_q(&self) -> ArrayView2<'_, F> {
                self.layer.w_q.view()
            }

            /// The key projection `W^K`, `[d_model, d_k]`.
            pub fn w_k(&self) -> ArrayView2<'_, F> {
                self.layer.w_k.view()
            }

            /// The value projection `W^V`, `[d_model, d_v]`.
            pub fn w_v(&self) -> ArrayView2<'_, F> {
                self.layer.w_v.view()
            }
        }
    };
}

layer_constructors!(Attention);
layer_constructors!(CausalAttention);

impl<F: Element> Attention<F> {
    /// Bidirectional attention over one sequence `x`, `[len, d_model]`;
    /// returns `[len, d_v]`. Every position attends to every position.
    ///
    /// An empty sequence gives an empty `[0, d_v]` output.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`] when `x` is not `d_model` wide; the
    /// message names `x`'s shape and the layer's.
    pub fn forward(&self, x: ArrayView2<'_, F>) -> Result<Array2<F>, AttentionError> {
        self.forward_with(x, &AttentionOptions::new())
    }

    /// [`forward`](Self::forward) with options: `x` is one sequence
    /// `[len, d_model]`, so it is batch item 0 of a batch of 1, and a keep
    /// mask or bias has shape `[1, 1, len, len]` (the last two may be 1 to
    /// broadcast: `[1, 1, 1, len]` hides keys from every query), and
    /// `key_lengths` takes exactly one length.
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
        self.layer.forward(x, opts)
    }

    /// Bidirectional attention over a batch `x`, `[batch, len, d_model]`;
    /// returns `[batch, len, d_v]`. Each batch item attends only within itself.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`] when `x` is not `d_model` wide.
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
    /// functional API takes them with `heads = 1`: a keep mask or bias has
    /// shape `[batch, 1, len, len]`, where any dimension may be 1 to
    /// broadcast (`[batch, 1, 1, len]` is a key-padding mask), and
    /// `key_lengths` has one length per batch item. A `.causal()` option
    /// makes the call causal.
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
        self.layer.forward_batch(x, opts)
    }
}

impl<F: Element> CausalAttention<F> {
    /// Causal attention over one sequence `x`, `[len, d_model]`; returns
    /// `[len, d_v]`, where row `i` depends only on rows `0..=i` of `x`.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`] when `x` is not `d_model` wide.
    pub fn forward(&self, x: ArrayView2<'_, F>) -> Result<Array2<F>, AttentionError> {
        self.forward_with(x, &AttentionOptions::new())
    }

    /// [`forward`](Self::forward) with further masks, bias or scale, shaped
    /// as for [`Attention::forward_with`]. The causal rule is always applied
    /// on top of them; any alignment set in `opts` is replaced by
    /// bottom-right, which in self-attention is the same triangle.
    ///
    /// # Errors
    /// As [`forward`](Self::forward), and when the options do not fit the shapes.
    pub fn forward_with(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array2<F>, AttentionError> {
        self.layer.forward(x, &opts.clone().causal())
    }

    /// Causal attention over a batch `x`, `[batch, len, d_model]`; returns
    /// `[batch, len, d_v]`.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`] when `x` is not `d_model` wide.
    pub fn forward_batch(&self, x: ArrayView3<'_, F>) -> Result<Array3<F>, AttentionError> {
        self.forward_batch_with(x, &AttentionOptions::new())
    }

    /// [`forward_batch`](Self::forward_batch) with further masks, bias or
    /// scale, shaped as for [`Attention::forward_batch_with`]; the causal
    /// rule is always applied on top of them.
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
        self.layer.forward_batch(x, &opts.clone().causal())
    }
}

/// The weights and projections both layer types share.
#[derive(Debug, Clone, PartialEq)]
struct Layer<F> {
    config: AttentionConfig,
    w_q: Array2<F>,
    w_k: Array2<F>,
    w_v: Array2<F>,
}

impl<F: Element> Layer<F> {
    fn from_weights(
        w_q: Array2<F>,
        w_k: Array2<F>,
        w_v: Array2<F>,
    ) -> Result<Self, AttentionError> {
        let (qs, ks, vs) = (w_q.shape(), w_k.shape(), w_v.shape());
        let layouts = || {
            format!(
                "w_q {qs:?} = [d_model, d_k], w_k {ks:?} = [d_model, d_k], \
                 w_v {vs:?} = [d_model, d_v]"
            )
        };
        if ks[0] != qs[0] || vs[0] != qs[0] {
            return Err(shape_error(format!(
                "the weights disagree on d_model (rows): {}",
                layouts()
            )));
        }
        if ks[1] != qs[1] {
            return Err(shape_error(format!(
                "w_q and w_k disagree on d_k (columns): {}",
                layouts()
            )));
        }
        let config = AttentionConfig::new(qs[0], qs[1], vs[1]);
        config
            .check()
            .map_err(|err| AttentionError::new(err.kind(), format!("{}: {}", err, layouts())))?;
        Ok(Self {
            config,
            w_q,
            w_k,
            w_v,
        })
    }

    fn new_seeded(config: AttentionConfig, seed: u64) -> Result<Self, AttentionError> {
        config.check()?;
        let mut rng = SplitMix64::new(seed);
        let AttentionConfig { d_model, d_k, d_v } = config;
        let w_q = xavier_uniform(&mut rng, d_model, d_k);
        let w_k = xavier_uniform(&mut rng, d_model, d_k);
        let w_v = xavier_uniform(&mut rng, d_model, d_v);
        Ok(Self {
            config,
            w_q,
            w_k,
            w_v,
        })
    }

    /// One sequence `[len, d_model]` as batch item 0 of a batch of 1.
    fn forward(
        &self,
        x: ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array2<F>, AttentionError> {
        // Checked here so the message speaks of the caller's 2-D shape.
        self.check_width(x.shape(), "[len, d_model]")?;
        let out = self.forward_batch(x.insert_axis(Axis(0)), opts)?;
        Ok(out.remove_axis(Axis(0)))
    }

    fn forward_batch(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_width(x.shape(), "[batch, len, d_model]")?;
        let (batch, len, d_model) = x.dim();
        // All positions of all batch items are projected by one matrix
        // product each; `to_shape` is a view when the layout allows it.
        let rows = x.to_shape((batch * len, d_model)).map_err(reshape_error)?;
        let project = |w: &Array2<F>| {
            rows.dot(w)
                .into_shape_with_order((batch, len, w.ncols()))
                .map_err(reshape_error)
        };
        let (q, k, v) = (
            project(&self.w_q)?,
            project(&self.w_k)?,
            project(&self.w_v)?,
        );
        // [batch, len, d] → [batch, heads = 1, len, d]. Several heads will
        // reshape [batch, len, heads·d] to [batch, len, heads, d] and permute
        // to [batch, heads, len, d], a view as well.
        let out =
            crate::scaled_dot_product_attention(one_head(&q), one_head(&k), one_head(&v), opts)?;
        Ok(out.remove_axis(Axis(1)))
    }

    fn check_width(&self, shape: &[usize], layout: &str) -> Result<(), AttentionError> {
        let width = shape[shape.len() - 1];
        if width != self.config.d_model {
            return Err(shape_error(format!(
                "x has shape {shape:?} = {layout} but the layer's d_model is {} \
                 (w_q {:?}, w_k {:?}, w_v {:?})",
                self.config.d_model,
                self.w_q.shape(),
                self.w_k.shape(),
                self.w_v.shape()
            )));
        }
        Ok(())
    }
}

/// `[batch, len, d]` as `[batch, heads = 1, len, d]`, a view of the same data.
fn one_head<F>(x: &Array3<F>) -> ArrayView4<'_, F> {
    x.view().insert_axis(Axis(1))
}

/// The element counts always agree, so a reshape cannot fail; report it as
/// an error rather than panic should that ever change.
fn reshape_error(err: ShapeError) -> AttentionError {
    shape_error(format!("internal reshape of x failed: {err}"))
}

/// A `[fan_in, fan_out]` matrix drawn from `U(−a, a)`,
/// `a = √(6 / (fan_in + fan_out))`, row by row.
fn xavier_uniform<F: Element>(rng: &mut SplitMix64, fan_in: usize, fan_out: usize) -> Array2<F> {
    let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
    Array2::from_shape_simple_fn((fan_in, fan_out), || {
        let w = (2.0 * rng.next_unit() - 1.0) * bound;
        F::from(w).unwrap_or_else(F::zero)
    })
}

/// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit state advanced by a
/// fixed odd constant and mixed by two multiply-xorshift rounds. Tiny,
/// fast, passes BigCrush, and fully specified, so the weights a seed gives
/// never depend on a dependency's version.
struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`: the top 53 bits as an `f64` mantissa.
    fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1_u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs of the reference C implementation for seed 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let expected = [
            6_457_827_717_110_365_317_u64,
            3_203_168_211_198_807_973,
            9_817_491_932_198_370_423,
            4_593_380_528_125_082_431,
            16_408_922_859_458_223_821,
        ];
        for e in expected {
            assert_eq!(rng.next_u64(), e);
        }
    }

    #[test]
    fn unit_draws_stay_in_the_half_open_interval() {
        let mut rng = SplitMix64::new(0);
        for _ in 0..10_000 {
            let u = rng.next_unit();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
