//! The shape of a layer, [`AttentionConfig`], and the check that its sizes
//! make a layer. The shape of each parameter under a config is in the
//! parameter table (`params`).

use std::hash::{Hash, Hasher};

use crate::error::{AttentionError, ErrorKind, shape_error};
use crate::rope::RopeLayout;

/// Rotary position embeddings applied by a layer to its queries and keys,
/// after the projections and the head split and before the attention: set
/// with [`AttentionConfig::with_rope`].
///
/// - `theta`: the base of the frequencies, `inv_freq[i] = 1 / theta^(2i /
///   rotary_dim)` (Hugging Face's default; 10000 in most models, 500000 in
///   Llama 3);
/// - `rotary_dim`: how many leading features of each query/key head rotate
///   (`None`, the default: all `d_k` of them; even, `≤ d_k`);
/// - `layout`: which features pair up ([`RopeLayout::HalfSplit`], the
///   default, or [`RopeLayout::Interleaved`]);
/// - `max_positions`: the layer builds one [`RopeTable`](crate::RopeTable)
///   for positions `0..max_positions` when it is built; a token at or past
///   it is an error.
///
/// A forward rotates the tokens of each sequence at positions `0..len`
/// (queries and keys alike, also in cross-attention); a decode step at the
/// cache's [`total_len`](crate::KvCache::total_len) onward, and the cache
/// keeps the keys rotated, as Hugging Face's does.
///
/// ```
/// use sdpa::{AttentionConfig, CausalAttention, RopeConfig, RopeLayout};
///
/// let rope = RopeConfig::new(10_000.0, 2048).with_rotary_dim(8).with_layout(RopeLayout::Interleaved);
/// let config = AttentionConfig::new(64, 4).with_rope(rope);
/// let layer = CausalAttention::<f32>::new_seeded(config, 0)?;
/// assert_eq!(layer.config().rope, Some(rope));
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct RopeConfig {
    /// The base of the frequencies.
    pub theta: f64,
    /// How many leading features of each head rotate; `None` means all
    /// `d_k`.
    pub rotary_dim: Option<usize>,
    /// Which features pair up.
    pub layout: RopeLayout,
    /// One past the last position the layer's table holds.
    pub max_positions: usize,
}

impl RopeConfig {
    /// Rotary embeddings with base `theta` over all of each head's `d_k`
    /// features, in the [`RopeLayout::HalfSplit`] layout, for positions
    /// `0..max_positions`.
    pub fn new(theta: f64, max_positions: usize) -> Self {
        Self {
            theta,
            rotary_dim: None,
            layout: RopeLayout::HalfSplit,
            max_positions,
        }
    }

    /// Rotates only the first `rotary_dim` features of each head (partial
    /// rotary: GPT-NeoX's `rotary_pct`, GPT-J's `rotary_dim`).
    pub fn with_rotary_dim(mut self, rotary_dim: usize) -> Self {
        self.rotary_dim = Some(rotary_dim);
        self
    }

    /// Pairs the features as `layout` says.
    pub fn with_layout(mut self, layout: RopeLayout) -> Self {
        self.layout = layout;
        self
    }

    /// What equality and hashing compare (`theta` by its bits).
    fn key(&self) -> (u64, Option<usize>, RopeLayout, usize) {
        (
            self.theta.to_bits(),
            self.rotary_dim,
            self.layout,
            self.max_positions,
        )
    }
}

/// The dimensions of an attention layer.
///
/// [`AttentionConfig::new`]`(d_model, heads)` is the usual multi-head layer:
/// `heads` heads of `d_model / heads` each, as PyTorch's
/// `nn.MultiheadAttention(embed_dim, num_heads)` and Hugging Face configs
/// (`hidden_size`, `num_attention_heads`) state it. The sizes are:
///
/// - `d_model`: the width of each query-side input vector (a row of `X`);
/// - `heads`: the number of query heads;
/// - `kv_heads`: the number of key/value heads (default: as many as `heads`);
///   fewer is grouped-query attention, 1 is multi-query attention, and
///   `heads` must be a multiple of it ([`with_kv_heads`](Self::with_kv_heads));
/// - `head_dim`: the width of each head's queries and keys, [`d_k`](Self::d_k)
///   (`None`, the default: `d_model / heads`, which must then divide
///   exactly; [`with_head_dim`](Self::with_head_dim) sets it, as Llama-style
///   configs with an explicit `head_dim` do);
/// - `value_dim`: the width of each head's values, [`d_v`](Self::d_v)
///   (`None`, the default: the same as `d_k`);
/// - `d_model_kv`: the width of the key/value-side input in
///   cross-attention (`None`, the default: the same as `d_model`);
/// - `d_model_out`: the width of the output projection `W^O`
///   `[heads·d_v, d_model_out]` (`None`, the default: no output projection, the
///   output is the `heads·d_v` concatenated heads);
/// - `bias`: whether every projection adds a bias vector (default `false`);
/// - `rope`: rotary position embeddings applied to the queries and keys
///   (`None`, the default: none; [`with_rope`](Self::with_rope)).
///
/// The sizes are checked when a layer is built from the config (or
/// parameters are loaded for it): a zero size, `heads` not dividing
/// `d_model` without an explicit `head_dim`, or `heads` not a multiple of
/// `kv_heads` is an [`AttentionError`], never a panic. Because the head
/// width is worked out then, the setters may come in any order. The struct
/// is `#[non_exhaustive]`, so fields added later, each defaulting to today's
/// behaviour, do not break your code. Two configs are equal when they
/// describe the same layer (`new(64, 4)` equals `new(64, 4).with_head_dim(16)`).
///
/// With the feature `serde`, the config is `Serialize` and `Deserialize`.
///
/// ```
/// use sdpa::AttentionConfig;
///
/// // The seed's layer: one head, d_k = d_v = d_model.
/// let seed = AttentionConfig::new(16, 1);
/// assert_eq!((seed.heads, seed.kv_heads, seed.d_k(), seed.d_model_out), (1, 1, 16, None));
///
/// // A GPT-style block: 8 heads of 64 over d_model = 512, 2 key/value heads
/// // (grouped-query attention), output projection back to 512, biases.
/// let gpt = AttentionConfig::new(512, 8)
///     .with_kv_heads(2)
///     .with_output_projection(512)
///     .with_bias(true);
/// assert_eq!((gpt.d_k(), gpt.d_v(), gpt.output_width()), (64, 64, 512));
///
/// // Heads wider than d_model / heads, as some Qwen and Gemma models have.
/// let wide = AttentionConfig::new(64, 4).with_head_dim(32);
/// assert_eq!(wide.d_k(), 32);
/// ```
///
/// A width the heads do not divide is an error when the layer is built:
///
/// ```
/// use sdpa::{Attention, AttentionConfig, ErrorKind};
///
/// let err = Attention::<f32>::new_seeded(AttentionConfig::new(10, 4), 0).unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::HeadsNotDivisible);
/// assert!(err.to_string().contains("with_head_dim"));
/// ```
#[derive(Debug, Clone, Copy)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct AttentionConfig {
    /// Width of each query-side input vector.
    pub d_model: usize,
    /// Number of query heads.
    pub heads: usize,
    /// Number of key/value heads; `heads` must be a multiple of it.
    pub kv_heads: usize,
    /// Width of each head's queries and keys, when set explicitly; `None`
    /// means `d_model / heads`. Read the width with [`d_k`](Self::d_k).
    pub head_dim: Option<usize>,
    /// Width of each head's values, when it differs from `d_k`; `None`
    /// means `d_k`. Read the width with [`d_v`](Self::d_v).
    pub value_dim: Option<usize>,
    /// Width of the key/value-side input, when it differs from `d_model`
    /// (cross-attention); `None` means `d_model`.
    pub d_model_kv: Option<usize>,
    /// Width of the output projection `W^O`; `None` means no output
    /// projection.
    pub d_model_out: Option<usize>,
    /// Whether every projection (`W^Q`, `W^K`, `W^V` and `W^O` if present)
    /// adds a bias vector.
    pub bias: bool,
    /// Rotary position embeddings applied to the queries and keys, if any.
    #[cfg_attr(feature = "serde", serde(default))]
    pub rope: Option<RopeConfig>,
}

impl AttentionConfig {
    /// A layer of `heads` heads over `d_model`-wide inputs, each head
    /// `d_model / heads` wide (queries, keys and values), as many key/value
    /// heads as query heads, with no output projection and no biases.
    /// `new(d_model, 1)` is the seed's single-head layer.
    ///
    /// The sizes are checked when a layer is built from it: `heads` must
    /// divide `d_model` unless [`with_head_dim`](Self::with_head_dim) gives
    /// the head width.
    ///
    /// ```
    /// use sdpa::AttentionConfig;
    ///
    /// let config = AttentionConfig::new(64, 4);
    /// assert_eq!((config.heads, config.d_k(), config.d_v()), (4, 16, 16));
    /// ```
    pub fn new(d_model: usize, heads: usize) -> Self {
        Self {
            d_model,
            heads,
            kv_heads: heads,
            head_dim: None,
            value_dim: None,
            d_model_kv: None,
            d_model_out: None,
            bias: false,
            rope: None,
        }
    }

    /// Sets the input width `d_model`.
    pub fn with_d_model(mut self, d_model: usize) -> Self {
        self.d_model = d_model;
        self
    }

    /// Sets the number of query heads **and** of key/value heads to `heads`
    /// (ordinary multi-head attention). For grouped-query or multi-query
    /// attention, call [`with_kv_heads`](Self::with_kv_heads) afterwards.
    /// Without an explicit [`head_dim`](Self::with_head_dim), each head is
    /// `d_model / heads` wide.
    pub fn with_heads(mut self, heads: usize) -> Self {
        self.heads = heads;
        self.kv_heads = heads;
        self
    }

    /// Sets the number of key/value heads: `heads / kv_heads` consecutive
    /// query heads share each one (1 is multi-query attention).
    pub fn with_kv_heads(mut self, kv_heads: usize) -> Self {
        self.kv_heads = kv_heads;
        self
    }

    /// Sets each head's query/key width `d_k` (and its value width, unless
    /// [`with_value_dim`](Self::with_value_dim) sets that), instead of
    /// `d_model / heads`.
    pub fn with_head_dim(mut self, head_dim: usize) -> Self {
        self.head_dim = Some(head_dim);
        self
    }

    /// Sets each head's value width `d_v`, when it differs from `d_k`.
    pub fn with_value_dim(mut self, value_dim: usize) -> Self {
        self.value_dim = Some(value_dim);
        self
    }

    /// Sets the width of the key/value-side input, for cross-attention
    /// between sequences of different widths (such as a decoder attending
    /// to an encoder's output).
    pub fn with_d_model_kv(mut self, d_model_kv: usize) -> Self {
        self.d_model_kv = Some(d_model_kv);
        self
    }

    /// Adds an output projection `W^O` `[heads·d_v, d_model_out]` after the
    /// heads are concatenated.
    pub fn with_output_projection(mut self, d_model_out: usize) -> Self {
        self.d_model_out = Some(d_model_out);
        self
    }

    /// Sets whether every projection adds a bias vector.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Applies rotary position embeddings to the queries and keys (see
    /// [`RopeConfig`]). Checked when the layer is built: an odd
    /// `rotary_dim`, one larger than `d_k`, or a `theta` that is not finite
    /// and positive is an error.
    pub fn with_rope(mut self, rope: RopeConfig) -> Self {
        self.rope = Some(rope);
        self
    }

    /// The width of each head's queries and keys: `head_dim` if set, else
    /// `d_model / heads` (rounded down, and 0 when `heads` is 0: a layer
    /// rejects both a width the heads do not divide and zero heads).
    pub fn d_k(&self) -> usize {
        self.head_dim
            .unwrap_or_else(|| self.d_model.checked_div(self.heads).unwrap_or(0))
    }

    /// The width of each head's values: `value_dim` if set, else
    /// [`d_k`](Self::d_k).
    pub fn d_v(&self) -> usize {
        self.value_dim.unwrap_or_else(|| self.d_k())
    }

    /// `d_k` when it is well defined (explicit, or `heads` divides
    /// `d_model`): what equality compares.
    fn exact_d_k(&self) -> Option<usize> {
        self.head_dim.or_else(|| {
            (self.heads != 0 && self.d_model.is_multiple_of(self.heads))
                .then(|| self.d_model / self.heads)
        })
    }

    /// Everything that makes the layer, with the head widths resolved.
    #[allow(clippy::type_complexity)]
    fn key(
        &self,
    ) -> (
        [usize; 3],
        [Option<usize>; 4],
        bool,
        Option<(u64, Option<usize>, RopeLayout, usize)>,
    ) {
        let d_k = self.exact_d_k();
        (
            [self.d_model, self.heads, self.kv_heads],
            [
                d_k,
                self.value_dim.or(d_k),
                self.d_model_kv,
                self.d_model_out,
            ],
            self.bias,
            self.rope.as_ref().map(RopeConfig::key),
        )
    }

    /// The width of the key/value-side input: `d_model_kv`, or `d_model`
    /// when that is `None`.
    pub fn kv_input_width(&self) -> usize {
        self.d_model_kv.unwrap_or(self.d_model)
    }

    /// The width of the layer's output: `d_model_out` with an output
    /// projection, `heads·d_v` without (`usize::MAX` if that overflows, in
    /// a config too large for a layer).
    pub fn output_width(&self) -> usize {
        self.d_model_out
            .unwrap_or(self.heads.saturating_mul(self.d_v()))
    }

    /// Checks that every size is positive, the heads divide (`d_model` by
    /// `heads` when no head width is given, `heads` by `kv_heads`), and the
    /// widths of all heads together (`heads·d_k` and so on, the parameters'
    /// sizes) can be computed; whether the parameters fit in memory is
    /// checked where they are allocated.
    pub(crate) fn check(&self) -> Result<(), AttentionError> {
        if self.heads == 0 || self.kv_heads == 0 {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "heads and kv_heads must be positive, got heads = {}, kv_heads = {}",
                    self.heads, self.kv_heads
                ),
            ));
        }
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.heads) {
            return Err(AttentionError::new(
                ErrorKind::HeadsNotDivisible,
                format!(
                    "d_model ({}) is not a multiple of heads ({}), so the head width \
                     d_model / heads is not whole; give it with with_head_dim",
                    self.d_model, self.heads
                ),
            ));
        }
        let (d_k, d_v) = (self.d_k(), self.d_v());
        if self.d_model == 0 || d_k == 0 || d_v == 0 {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "d_model, d_k and d_v must be positive, got d_model = {}, d_k = {d_k}, d_v = {d_v}",
                    self.d_model
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(AttentionError::new(
                ErrorKind::HeadsNotDivisible,
                format!(
                    "heads ({}) must be a multiple of kv_heads ({})",
                    self.heads, self.kv_heads
                ),
            ));
        }
        if self.d_model_kv == Some(0) || self.d_model_out == Some(0) {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "d_model_kv and d_model_out must be positive when given, got d_model_kv = \
                     {:?}, d_model_out = {:?}",
                    self.d_model_kv, self.d_model_out
                ),
            ));
        }
        let widths = [
            ("heads·d_k", self.heads, d_k),
            ("heads·d_v", self.heads, d_v),
            ("kv_heads·d_k", self.kv_heads, d_k),
            ("kv_heads·d_v", self.kv_heads, d_v),
        ];
        for (name, heads, width) in widths {
            if heads.checked_mul(width).is_none() {
                return Err(AttentionError::new(
                    ErrorKind::TooLarge,
                    format!(
                        "{name} = {heads}·{width} overflows usize in {}",
                        describe_config(self)
                    ),
                ));
            }
        }
        if let Some(rope) = &self.rope {
            if !(rope.theta.is_finite() && rope.theta > 0.0) {
                return Err(AttentionError::new(
                    ErrorKind::InvalidOption,
                    format!(
                        "the rope's theta must be finite and positive, got {}",
                        rope.theta
                    ),
                ));
            }
            let rotary_dim = rope.rotary_dim.unwrap_or(d_k);
            if !rotary_dim.is_multiple_of(2) {
                return Err(AttentionError::new(
                    ErrorKind::InvalidOption,
                    format!(
                        "the rope's rotary_dim must be even (the features rotate in pairs), got \
                         rotary_dim = {rotary_dim} (d_k = {d_k})"
                    ),
                ));
            }
            if rotary_dim > d_k {
                return Err(shape_error(format!(
                    "the rope's rotary_dim = {rotary_dim} is larger than the head width d_k = {d_k}"
                )));
            }
        }
        Ok(())
    }
}

impl PartialEq for AttentionConfig {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for AttentionConfig {}

impl Hash for AttentionConfig {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

/// A config in one line, for error messages.
pub(crate) fn describe_config(config: &AttentionConfig) -> String {
    format!(
        "the config d_model = {}, d_model_kv = {}, heads = {}, kv_heads = {}, d_k = {}, d_v = {}, \
         d_model_out = {:?}, bias = {}, rope = {:?}",
        config.d_model,
        config.kv_input_width(),
        config.heads,
        config.kv_heads,
        config.d_k(),
        config.d_v(),
        config.d_model_out,
        config.bias,
        config.rope
    )
}
