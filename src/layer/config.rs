//! The shape of a layer ([`AttentionConfig`]) and its learned parameters
//! ([`AttentionWeights`]), and the check that the two agree.

use ndarray::{Array1, Array2};

use crate::error::{AttentionError, ErrorKind, shape_error};

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
/// - `d_out`: the width of the output projection `W^O`
///   `[heads·d_v, d_out]` (`None`, the default: no output projection, the
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
/// assert_eq!((seed.heads, seed.kv_heads, seed.d_out), (1, 1, None));
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
    pub d_out: Option<usize>,
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
            d_out: None,
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

    /// Adds an output projection `W^O` `[heads·d_v, d_out]` after the heads
    /// are concatenated.
    pub fn with_output_projection(mut self, d_out: usize) -> Self {
        self.d_out = Some(d_out);
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

    /// The width of the layer's output: `d_out` with an output projection,
    /// `heads·d_v` without.
    pub fn output_width(&self) -> usize {
        self.d_out.unwrap_or(self.heads * self.d_v)
    }

    /// `[d_model, heads·d_k]`, the shape of `W^Q`.
    pub(crate) fn w_q_dim(&self) -> (usize, usize) {
        (self.d_model, self.heads * self.d_k)
    }

    /// `[d_model_kv, kv_heads·d_k]`, the shape of `W^K`.
    pub(crate) fn w_k_dim(&self) -> (usize, usize) {
        (self.kv_input_width(), self.kv_heads * self.d_k)
    }

    /// `[d_model_kv, kv_heads·d_v]`, the shape of `W^V`.
    pub(crate) fn w_v_dim(&self) -> (usize, usize) {
        (self.kv_input_width(), self.kv_heads * self.d_v)
    }

    /// `[heads·d_v, d_out]`, the shape of `W^O`, if there is one.
    pub(crate) fn w_o_dim(&self) -> Option<(usize, usize)> {
        self.d_out.map(|d_out| (self.heads * self.d_v, d_out))
    }

    /// Checks that every size is positive and the heads divide.
    pub(crate) fn check(&self) -> Result<(), AttentionError> {
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
        if self.d_model_kv == Some(0) || self.d_out == Some(0) {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!(
                    "d_model_kv and d_out must be positive when given, got d_model_kv = {:?}, \
                     d_out = {:?}",
                    self.d_model_kv, self.d_out
                ),
            ));
        }
        Ok(())
    }
}

/// The learned parameters of an attention layer, for
/// [`Attention::new`](crate::Attention::new) and
/// [`CausalAttention::new`](crate::CausalAttention::new).
///
/// For a config with `heads`, `kv_heads`, `d_k`, `d_v` (see
/// [`AttentionConfig`]), the shapes are:
///
/// | parameter | shape | present |
/// |---|---|---|
/// | `w_q` | `[d_model, heads·d_k]` | always |
/// | `w_k` | `[d_model_kv, kv_heads·d_k]` | always |
/// | `w_v` | `[d_model_kv, kv_heads·d_v]` | always |
/// | `w_o` | `[heads·d_v, d_out]` | with an output projection |
/// | `b_q`, `b_k`, `b_v` | `[heads·d_k]`, `[kv_heads·d_k]`, `[kv_heads·d_v]` | with `bias` |
/// | `b_o` | `[d_out]` | with `bias` and an output projection |
///
/// Head `h` owns columns `h·d_k .. (h+1)·d_k` of `W^Q` (and likewise for
/// the others), the layout of PyTorch's and most checkpoints' fused
/// projections. A model without a bias on one projection (Whisper's keys)
/// gives a zero bias there.
///
/// ```
/// use ndarray::{Array1, Array2};
/// use sdpa::AttentionWeights;
///
/// let weights = AttentionWeights::new(Array2::<f32>::zeros((8, 8)), Array2::zeros((8, 8)), Array2::zeros((8, 8)))
///     .with_output(Array2::zeros((8, 8)))
///     .with_biases(Array1::zeros(8), Array1::zeros(8), Array1::zeros(8))
///     .with_output_bias(Array1::zeros(8));
/// assert!(weights.b_o.is_some());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AttentionWeights<F> {
    /// The query projection `W^Q`, `[d_model, heads·d_k]`.
    pub w_q: Array2<F>,
    /// The key projection `W^K`, `[d_model_kv, kv_heads·d_k]`.
    pub w_k: Array2<F>,
    /// The value projection `W^V`, `[d_model_kv, kv_heads·d_v]`.
    pub w_v: Array2<F>,
    /// The output projection `W^O`, `[heads·d_v, d_out]`, if any.
    pub w_o: Option<Array2<F>>,
    /// The query bias, `[heads·d_k]`, if any.
    pub b_q: Option<Array1<F>>,
    /// The key bias, `[kv_heads·d_k]`, if any.
    pub b_k: Option<Array1<F>>,
    /// The value bias, `[kv_heads·d_v]`, if any.
    pub b_v: Option<Array1<F>>,
    /// The output bias, `[d_out]`, if any.
    pub b_o: Option<Array1<F>>,
}

impl<F> AttentionWeights<F> {
    /// The three input projections, with no output projection and no biases.
    pub fn new(w_q: Array2<F>, w_k: Array2<F>, w_v: Array2<F>) -> Self {
        Self {
            w_q,
            w_k,
            w_v,
            w_o: None,
            b_q: None,
            b_k: None,
            b_v: None,
            b_o: None,
        }
    }

    /// Adds the output projection `W^O`, `[heads·d_v, d_out]`.
    pub fn with_output(mut self, w_o: Array2<F>) -> Self {
        self.w_o = Some(w_o);
        self
    }

    /// Adds the biases of the three input projections.
    pub fn with_biases(mut self, b_q: Array1<F>, b_k: Array1<F>, b_v: Array1<F>) -> Self {
        self.b_q = Some(b_q);
        self.b_k = Some(b_k);
        self.b_v = Some(b_v);
        self
    }

    /// Adds the bias of the output projection, `[d_out]`.
    pub fn with_output_bias(mut self, b_o: Array1<F>) -> Self {
        self.b_o = Some(b_o);
        self
    }

    /// The shapes of every parameter, for error messages.
    fn describe(&self) -> String {
        let matrix = |name: &str, w: &Array2<F>| format!("{name} {:?}", w.shape());
        let optional_matrix = |name: &str, w: &Option<Array2<F>>| match w {
            Some(w) => format!(", {name} {:?}", w.shape()),
            None => String::new(),
        };
        let optional_vector = |name: &str, b: &Option<Array1<F>>| match b {
            Some(b) => format!(", {name} {:?}", b.shape()),
            None => String::new(),
        };
        format!(
            "{}, {}, {}{}{}{}{}{}",
            matrix("w_q", &self.w_q),
            matrix("w_k", &self.w_k),
            matrix("w_v", &self.w_v),
            optional_matrix("w_o", &self.w_o),
            optional_vector("b_q", &self.b_q),
            optional_vector("b_k", &self.b_k),
            optional_vector("b_v", &self.b_v),
            optional_vector("b_o", &self.b_o),
        )
    }

    /// Checks every parameter's shape against `config`, which was checked.
    pub(crate) fn check(&self, config: &AttentionConfig) -> Result<(), AttentionError> {
        let expected = |what: &str, expected: String| {
            shape_error(format!(
                "{what}, expected {expected} for {}; got {}",
                describe_config(config),
                self.describe()
            ))
        };
        let dims = |name: &str, w: &Array2<F>, (rows, cols): (usize, usize), layout: &str| {
            if w.dim() == (rows, cols) {
                Ok(())
            } else {
                Err(expected(
                    &format!("{name} has shape {:?}", w.shape()),
                    format!("{layout} = [{rows}, {cols}]"),
                ))
            }
        };
        dims("w_q", &self.w_q, config.w_q_dim(), "[d_model, heads·d_k]")?;
        dims(
            "w_k",
            &self.w_k,
            config.w_k_dim(),
            "[d_model_kv, kv_heads·d_k]",
        )?;
        dims(
            "w_v",
            &self.w_v,
            config.w_v_dim(),
            "[d_model_kv, kv_heads·d_v]",
        )?;
        match (&self.w_o, config.w_o_dim()) {
            (Some(w_o), Some(dim)) => dims("w_o", w_o, dim, "[heads·d_v, d_out]")?,
            (None, None) => {}
            (Some(w_o), None) => {
                return Err(expected(
                    &format!("w_o {:?} was given", w_o.shape()),
                    "no output projection (d_out = None)".to_owned(),
                ));
            }
            (None, Some(dim)) => {
                return Err(expected(
                    "w_o is missing",
                    format!("w_o [heads·d_v, d_out] = {:?}", [dim.0, dim.1]),
                ));
            }
        }
        let biases = [
            ("b_q", &self.b_q, Some(config.heads * config.d_k)),
            ("b_k", &self.b_k, Some(config.kv_heads * config.d_k)),
            ("b_v", &self.b_v, Some(config.kv_heads * config.d_v)),
            ("b_o", &self.b_o, config.d_out),
        ];
        for (name, bias, len) in biases {
            // A bias belongs to every projection there is, when `bias` is set.
            let len = len.filter(|_| config.bias);
            match (bias, len) {
                (Some(b), Some(len)) if b.len() == len => {}
                (Some(b), Some(len)) => {
                    return Err(expected(
                        &format!("{name} has shape {:?}", b.shape()),
                        format!("[{len}]"),
                    ));
                }
                (None, None) => {}
                (Some(b), None) => {
                    return Err(expected(
                        &format!("{name} {:?} was given", b.shape()),
                        "no bias there (bias = false, or no output projection)".to_owned(),
                    ));
                }
                (None, Some(len)) => {
                    return Err(expected(
                        &format!("{name} is missing"),
                        format!("{name} [{len}] (bias = true)"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A config in one line, for error messages.
pub(crate) fn describe_config(config: &AttentionConfig) -> String {
    format!(
        "the config d_model = {}, d_model_kv = {}, heads = {}, kv_heads = {}, d_k = {}, d_v = {}, \
         d_out = {:?}, bias = {}",
        config.d_model,
        config.kv_input_width(),
        config.heads,
        config.kv_heads,
        config.d_k,
        config.d_v,
        config.d_out,
        config.bias
    )
}
