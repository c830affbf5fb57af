//! The shape of a layer, [`AttentionConfig`], and the check that its sizes
//! make a layer. The shape of each parameter under a config is in the
//! parameter table (`params`).

use crate::error::{AttentionError, ErrorKind};

/// The dimensions of an attention layer.
///
/// - `d_model`: the width of each query-side input vector (a row of `X`);
/// - `d_k`: the width of each head's queries and keys;
/// - `d_v`: the width of each head's values;
/// - `heads`: the number of query heads (default 1);
/// - `kv_heads`: the number of key/value heads (default: as many as `heads`);
///   fewer is grouped-query attention, 1 is multi-query attention, and
///   `heads` must be a multiple of it;
/// - `d_model_kv`: the width of the key/value-side input in
///   cross-attention (`None`, the default: the same as `d_model`);
/// - `d_model_out`: the width of the output projection `W^O`
///   `[heads·d_v, d_model_out]` (`None`, the default: no output projection, the
///   output is the `heads·d_v` concatenated heads);
/// - `bias`: whether every projection adds a bias vector (default `false`).
///
/// [`AttentionConfig::new`] gives the seed's single-head layer, with no
/// output projection and no biases; the `with_*` setters add the rest. The
/// struct is `#[non_exhaustive]`, so fields added later, each defaulting to
/// today's behaviour, do not break your code.
///
/// ```
/// use sdpa::AttentionConfig;
///
/// // The seed's layer: one head, d_k = d_v = d_model.
/// let seed = AttentionConfig::new(16, 16, 16);
/// assert_eq!((seed.heads, seed.kv_heads, seed.d_model_out), (1, 1, None));
///
/// // A GPT-style block: 8 heads of 64 over d_model = 512, 2 key/value heads
/// // (grouped-query attention), output projection back to 512, biases.
/// let gpt = AttentionConfig::new(512, 64, 64)
///     .with_heads(8)
///     .with_kv_heads(2)
///     .with_output_projection(512)
///     .with_bias(true);
/// assert_eq!(gpt.output_width(), 512);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct AttentionConfig {
    /// Width of each query-side input vector.
    pub d_model: usize,
    /// Width of each head's queries and keys.
    pub d_k: usize,
    /// Width of each head's values.
    pub d_v: usize,
    /// Number of query heads.
    pub heads: usize,
    /// Number of key/value heads; `heads` must be a multiple of it.
    pub kv_heads: usize,
    /// Width of the key/value-side input, when it differs from `d_model`
    /// (cross-attention); `None` means `d_model`.
    pub d_model_kv: Option<usize>,
    /// Width of the output projection `W^O`; `None` means no output
    /// projection.
    pub d_model_out: Option<usize>,
    /// Whether every projection (`W^Q`, `W^K`, `W^V` and `W^O` if present)
    /// adds a bias vector.
    pub bias: bool,
}

impl AttentionConfig {
    /// A single-head layer mapping `d_model`-wide inputs to `d_k`-wide
    /// queries and keys and `d_v`-wide values, with no output projection and
    /// no biases: the seed's layer.
    ///
    /// The sizes are checked (all positive) when a layer is built from it.
    pub fn new(d_model: usize, d_k: usize, d_v: usize) -> Self {
        Self {
            d_model,
            d_k,
            d_v,
            heads: 1,
            kv_heads: 1,
            d_model_kv: None,
            d_model_out: None,
            bias: false,
        }
    }

    /// Sets the input width `d_model`.
    pub fn with_d_model(mut self, d_model: usize) -> Self {
        self.d_model = d_model;
        self
    }

    /// Sets the per-head query/key width `d_k`.
    pub fn with_d_k(mut self, d_k: usize) -> Self {
        self.d_k = d_k;
        self
    }

    /// Sets the per-head value width `d_v`.
    pub fn with_d_v(mut self, d_v: usize) -> Self {
        self.d_v = d_v;
        self
    }

    /// Sets the number of query heads **and** of key/value heads to `heads`
    /// (ordinary multi-head attention). For grouped-query or multi-query
    /// attention, call [`with_kv_heads`](Self::with_kv_heads) afterwards.
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
            .unwrap_or(self.heads.saturating_mul(self.d_v))
    }

    /// Checks that every size is positive, the heads divide, and the
    /// widths of all heads together (`heads·d_k` and so on, the parameters'
    /// sizes) can be computed; whether the parameters fit in memory is
    /// checked where they are allocated.
    pub(super) fn check(&self) -> Result<(), AttentionError> {
        if self.d_model == 0 || self.d_k == 0 || self.d_v == 0 {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "d_model, d_k and d_v must be positive, got d_model = {}, d_k = {}, d_v = {}",
                    self.d_model, self.d_k, self.d_v
                ),
            ));
        }
        if self.heads == 0 || self.kv_heads == 0 {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "heads and kv_heads must be positive, got heads = {}, kv_heads = {}",
                    self.heads, self.kv_heads
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
            ("heads·d_k", self.heads, self.d_k),
            ("heads·d_v", self.heads, self.d_v),
            ("kv_heads·d_k", self.kv_heads, self.d_k),
            ("kv_heads·d_v", self.kv_heads, self.d_v),
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
        Ok(())
    }
}

/// A config in one line, for error messages.
pub(super) fn describe_config(config: &AttentionConfig) -> String {
    format!(
        "the config d_model = {}, d_model_kv = {}, heads = {}, kv_heads = {}, d_k = {}, d_v = {}, \
         d_model_out = {:?}, bias = {}",
        config.d_model,
        config.kv_input_width(),
        config.heads,
        config.kv_heads,
        config.d_k,
        config.d_v,
        config.d_model_out,
        config.bias
    )
}
