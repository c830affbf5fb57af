//! [`LayerParameters`] from the layouts other frameworks store them in, so
//! that a transpose cannot be skipped by accident: PyTorch `nn.Linear`
//! (`[out, in]`, also Hugging Face's Llama, Mistral and Qwen2 projections),
//! `nn.MultiheadAttention`'s fused `in_proj_weight`, GPT-2's `Conv1D`
//! (`[in, out]`, fused `c_attn`), and BLOOM's and GPT-NeoX's
//! `query_key_value` (fused per head). Each tensor is checked in its *source*
//! layout, so a message names the tensor and shows the shape as the
//! checkpoint has it next to the shape the config asks for.
//!
//! Every constructor ends in [`assemble`], which applies the rules on
//! biases and the output projection and checks the result against the
//! config. The safetensors loaders (`load`) read tensors by name and come
//! here.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, s};

use super::config::{AttentionConfig, describe_config};
use super::params::LayerParameters;
use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};

/// A PyTorch `nn.Linear`'s tensors as its `state_dict` holds them:
/// `weight` `[out, in]` (`y = x·weightᵀ + bias`) and an optional `bias`
/// `[out]`. Hugging Face's `q_proj`, `k_proj`, `v_proj` and `o_proj` are
/// `nn.Linear`s.
///
/// ```
/// use ndarray::{Array1, Array2};
/// use sdpa::TorchLinear;
///
/// let weight = Array2::<f32>::zeros((6, 4)); // 6 outputs, 4 inputs
/// let bias = Array1::<f32>::zeros(6);
/// let linear = TorchLinear::new(weight.view()).with_bias(bias.view());
/// assert_eq!(linear.weight.dim(), (6, 4));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TorchLinear<'a, F> {
    /// The weight, `[out, in]`.
    pub weight: ArrayView2<'a, F>,
    /// The bias, `[out]`, if the module has one.
    pub bias: Option<ArrayView1<'a, F>>,
}

impl<'a, F> TorchLinear<'a, F> {
    /// A linear map without a bias, from its `[out, in]` weight.
    pub fn new(weight: ArrayView2<'a, F>) -> Self {
        Self { weight, bias: None }
    }

    /// Adds the bias, `[out]`.
    pub fn with_bias(mut self, bias: ArrayView1<'a, F>) -> Self {
        self.bias = Some(bias);
        self
    }
}

/// One projection read from a checkpoint, already `[in, out]`, with the
/// names of the tensors it came from for messages.
pub(super) struct Part<F> {
    pub(super) weight: Array2<F>,
    pub(super) bias: Option<Array1<F>>,
    /// What the bias is called in the source (a tensor, or a part of one).
    pub(super) bias_name: String,
}

/// The shapes a config gives the four projections, `[in, out]`:
/// `(rows, columns)` of `W^Q`, `W^K`, `W^V` and `W^O` (if any).
fn shapes(config: &AttentionConfig) -> [Option<(usize, usize)>; 4] {
    let (q, k, v) = (
        config.heads * config.d_k(),
        config.kv_heads * config.d_k(),
        config.kv_heads * config.d_v(),
    );
    let kv_in = config.kv_input_width();
    [
        Some((config.d_model, q)),
        Some((kv_in, k)),
        Some((kv_in, v)),
        config
            .d_model_out
            .map(|out| (config.heads * config.d_v(), out)),
    ]
}

/// Checks one tensor's shape, in its source layout.
pub(super) fn expect_shape(
    name: &str,
    got: &[usize],
    expected: &[usize],
    layout: &str,
    config: &AttentionConfig,
) -> Result<(), AttentionError> {
    if got == expected {
        return Ok(());
    }
    Err(shape_error(format!(
        "tensor `{name}` has shape {got:?}, expected {expected:?} ({layout}) for {}",
        describe_config(config)
    )))
}

/// The `[in, out]` copy of an `[out, in]` weight, in standard layout.
fn transposed<F: Element>(weight: ArrayView2<'_, F>) -> Array2<F> {
    weight.t().as_standard_layout().into_owned()
}

/// How each projection's weight is laid out, `[in, out]`, for messages.
const LAYOUTS: [&str; 4] = [
    "[d_model, heads·d_k]",
    "[d_model_kv, kv_heads·d_k]",
    "[d_model_kv, kv_heads·d_v]",
    "[heads·d_v, d_model_out]",
];

/// Projection `i` (`Q`, `K`, `V`, `O`) from an `nn.Linear` whose tensors
/// are `{name}weight` and `{name}bias`: checked in its `[out, in]` layout,
/// then transposed. The config was checked.
pub(super) fn linear_part<F: Element>(
    i: usize,
    name: &str,
    linear: &TorchLinear<'_, F>,
    config: &AttentionConfig,
) -> Result<Part<F>, AttentionError> {
    let bias_name = format!("{name}bias");
    // Without an output projection in the config, `assemble` reports the
    // tensor; its shape is not what is wrong.
    if let Some((rows, columns)) = shapes(config)[i] {
        let layout = format!("nn.Linear [out, in], the transpose of {}", LAYOUTS[i]);
        let weight_name = format!("{name}weight");
        expect_shape(
            &weight_name,
            linear.weight.shape(),
            &[columns, rows],
            &layout,
            config,
        )?;
        if let Some(bias) = &linear.bias {
            expect_shape(&bias_name, bias.shape(), &[columns], "[out]", config)?;
        }
    }
    Ok(Part {
        weight: transposed(linear.weight.view()),
        bias: linear.bias.map(|b| b.to_owned()),
        bias_name,
    })
}

/// Projection `i` from a GPT-2 `Conv1D` (already `[in, out]`) whose tensors
/// are `{name}weight` and `{name}bias`. The config was checked.
pub(super) fn conv1d_part<F: Element>(
    i: usize,
    name: &str,
    (weight, bias): (ArrayView2<'_, F>, Option<ArrayView1<'_, F>>),
    config: &AttentionConfig,
) -> Result<Part<F>, AttentionError> {
    let bias_name = format!("{name}bias");
    if let Some((rows, columns)) = shapes(config)[i] {
        let layout = format!("Conv1D [in, out] = {}", LAYOUTS[i]);
        let weight_name = format!("{name}weight");
        expect_shape(
            &weight_name,
            weight.shape(),
            &[rows, columns],
            &layout,
            config,
        )?;
        if let Some(bias) = &bias {
            expect_shape(&bias_name, bias.shape(), &[columns], "[out]", config)?;
        }
    }
    Ok(Part {
        weight: weight.as_standard_layout().into_owned(),
        bias: bias.map(|b| b.to_owned()),
        bias_name,
    })
}

/// Splits a fused `[in, q + k + v]` weight (and its bias) into three parts
/// at the config's widths. `axis` is the axis the three are stacked on in
/// the source (0 for PyTorch's `[3·out, in]`, 1 for GPT-2's `[in, 3·out]`).
pub(super) fn split_fused<F: Element>(
    (weight_name, weight): (&str, ArrayView2<'_, F>),
    bias: Option<(&str, ArrayView1<'_, F>)>,
    axis: Axis,
    config: &AttentionConfig,
) -> Result<[Part<F>; 3], AttentionError> {
    if config.kv_input_width() != config.d_model {
        return Err(shape_error(format!(
            "tensor `{weight_name}` fuses the query, key and value projections of one input, \
             but {} gives the key/value side its own width",
            describe_config(config)
        )));
    }
    let widths = [
        config.heads * config.d_k(),
        config.kv_heads * config.d_k(),
        config.kv_heads * config.d_v(),
    ];
    let total = widths[0] + widths[1] + widths[2];
    let (expected, layout) = if axis == Axis(0) {
        ([total, config.d_model], "[q + k + v, d_model] = [out, in]")
    } else {
        ([config.d_model, total], "[d_model, q + k + v] = [in, out]")
    };
    let layout = format!("{layout}, q = heads·d_k, k = kv_heads·d_k, v = kv_heads·d_v");
    expect_shape(weight_name, weight.shape(), &expected, &layout, config)?;
    if let Some((name, bias)) = bias {
        expect_shape(name, bias.shape(), &[total], "[q + k + v]", config)?;
    }
    let mut start = 0;
    Ok(widths.map(|width| {
        let range = start..start + width;
        start += width;
        let part = weight.slice_axis(axis, range.clone().into());
        let part = if axis == Axis(0) {
            transposed(part)
        } else {
            part.as_standard_layout().into_owned()
        };
        let bias_name = bias.map_or_else(String::new, |(name, _)| {
            format!("{name}[{}..{}]", range.start, range.end)
        });
        Part {
            weight: part,
            bias: bias.map(|(_, b)| b.slice(s![range]).to_owned()),
            bias_name,
        }
    }))
}

/// Splits a `[heads·3·d_k, d_model]` weight (`[out, in]`) fused *per head*,
/// and its bias: the rows of head `h` are its query, key and value in turn,
/// row `(3h + t)·d_k + e` being feature `e` of part `t` (0 query, 1 key,
/// 2 value). BLOOM's and GPT-NeoX's `query_key_value`, a
/// `view(..., heads, 3, head_dim)` of the projection. Each head has its own
/// key and value, so the config must have `kv_heads = heads` and `d_v = d_k`.
pub(super) fn split_fused_per_head<F: Element>(
    (weight_name, weight): (&str, ArrayView2<'_, F>),
    bias: Option<(&str, ArrayView1<'_, F>)>,
    config: &AttentionConfig,
) -> Result<[Part<F>; 3], AttentionError> {
    let (heads, d) = (config.heads, config.d_k());
    if config.kv_input_width() != config.d_model || config.kv_heads != heads || config.d_v() != d {
        return Err(shape_error(format!(
            "tensor `{weight_name}` fuses a query, key and value of width d_k per head, for heads \
             of one input, but {} has grouped key/value heads, d_v != d_k or its own key/value \
             width",
            describe_config(config)
        )));
    }
    let layout = "[heads·3·d_k, d_model] = [out, in], each head's query, key and value in turn";
    expect_shape(
        weight_name,
        weight.shape(),
        &[3 * heads * d, config.d_model],
        layout,
        config,
    )?;
    if let Some((name, bias)) = bias {
        expect_shape(
            name,
            bias.shape(),
            &[3 * heads * d],
            "[heads·3·d_k]",
            config,
        )?;
    }
    // Column `c` of part `t` (head c / d, feature c % d) is this source row.
    let row = |t: usize, c: usize| (3 * (c / d) + t) * d + c % d;
    Ok([0, 1, 2].map(|t| Part {
        weight: Array2::from_shape_fn((config.d_model, heads * d), |(i, c)| weight[[row(t, c), i]]),
        bias: bias.map(|(_, b)| Array1::from_shape_fn(heads * d, |c| b[row(t, c)])),
        bias_name: bias.map_or_else(String::new, |(name, _)| {
            let part = ["query", "key", "value"][t];
            format!("{name} (the {part} rows of each head)")
        }),
    }))
}

/// The parameters from four parts (`W^O`'s optional), with the rules on
/// biases: with `config.bias`, a missing bias is zero (Qwen2's `o_proj`,
/// Whisper's `k_proj`) but at least one must be there; without it, none
/// may be. An output projection is loaded exactly when the config has one.
pub(super) fn assemble<F: Element>(
    config: &AttentionConfig,
    [q, k, v]: [Part<F>; 3],
    o: Option<(&str, Part<F>)>,
) -> Result<LayerParameters<F>, AttentionError> {
    let describe = describe_config(config);
    let o = match (o, config.d_model_out) {
        (Some(o), Some(_)) => Some(o.1),
        (None, None) => None,
        (Some((name, o)), None) => {
            return Err(shape_error(format!(
                "tensor `{name}` (an output projection to {}) was given, but {describe} has \
                 none; add with_output_projection({})",
                o.weight.ncols(),
                o.weight.ncols()
            )));
        }
        (None, Some(out)) => {
            return Err(AttentionError::new(
                ErrorKind::MissingTensor,
                format!("no output projection was given, but {describe} has one to {out}"),
            ));
        }
    };
    let given: Vec<&str> = [Some(&q), Some(&k), Some(&v), o.as_ref()]
        .into_iter()
        .flatten()
        .filter(|p| p.bias.is_some())
        .map(|p| p.bias_name.as_str())
        .collect();
    if !config.bias && !given.is_empty() {
        return Err(shape_error(format!(
            "bias `{}` was given, but {describe} has no biases; use with_bias(true)",
            given.join("`, `")
        )));
    }
    if config.bias && given.is_empty() {
        return Err(AttentionError::new(
            ErrorKind::MissingTensor,
            format!("{describe} has biases, but no bias was given (for none of q, k, v, o)"),
        ));
    }
    let bias = |part: Part<F>| -> (Array2<F>, Option<Array1<F>>) {
        let missing = config.bias && part.bias.is_none();
        let zeros = missing.then(|| Array1::zeros(part.weight.ncols()));
        (part.weight, part.bias.or(zeros))
    };
    let [(w_q, b_q), (w_k, b_k), (w_v, b_v)] = [q, k, v].map(bias);
    let mut parameters = LayerParameters::new(w_q, w_k, w_v);
    if let (Some(b_q), Some(b_k), Some(b_v)) = (b_q, b_k, b_v) {
        parameters = parameters.with_biases(b_q, b_k, b_v);
    }
    if let Some((w_o, b_o)) = o.map(bias) {
        parameters = parameters.with_output(w_o);
        if let Some(b_o) = b_o {
            parameters = parameters.with_output_bias(b_o);
        }
    }
    parameters.check(config)?;
    Ok(parameters)
}

impl<F: Element> LayerParameters<F> {
    /// Parameters from PyTorch `nn.Linear` modules, `weight` `[out, in]`:
    /// `q`, `k`, `v` and, when `config` has an output projection, `o`. This
    /// is the layout of Hugging Face's Llama, Mistral and Qwen2 `q_proj`,
    /// `k_proj`, `v_proj` and `o_proj`, and of `nn.MultiheadAttention` with
    /// `kdim`/`vdim` (`q_proj_weight` and so on). Each weight is checked
    /// `[out, in]` and then transposed to the crate's `[in, out]`
    /// ([`LayerParameters::new`]).
    ///
    /// Biases follow the config: with `bias`, a module without one gets a
    /// zero bias (Qwen2's `o_proj`), but at least one must have a bias;
    /// without it, none may.
    ///
    /// # Errors
    /// As [`AttentionConfig`]'s check when the config is not a layer;
    /// [`ErrorKind::ShapeMismatch`] naming the tensor (`q.weight`,
    /// `o.bias`, ...) with its shape and the shape the config asks for;
    /// [`ErrorKind::MissingTensor`] when the config has an output projection
    /// and `o` is `None`, or biases and no module has one.
    ///
    /// ```
    /// use ndarray::{array, Array2};
    /// use sdpa::{Attention, AttentionConfig, LayerParameters, TorchLinear};
    ///
    /// // torch: q = nn.Linear(2, 2), whose weight [out, in] maps x to x·weightᵀ.
    /// let q_weight = array![[1.0_f32, 2.0], [0.0, 1.0]];
    /// let identity = Array2::<f32>::eye(2);
    /// let config = AttentionConfig::new(2, 1);
    /// let parameters = LayerParameters::from_torch_linear(
    ///     &config,
    ///     TorchLinear::new(q_weight.view()),
    ///     TorchLinear::new(identity.view()),
    ///     TorchLinear::new(identity.view()),
    ///     None,
    /// )?;
    /// assert_eq!(parameters.w_q, q_weight.t()); // [in, out]
    /// let layer = Attention::new(config, parameters)?;
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn from_torch_linear(
        config: &AttentionConfig,
        q: TorchLinear<'_, F>,
        k: TorchLinear<'_, F>,
        v: TorchLinear<'_, F>,
        o: Option<TorchLinear<'_, F>>,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let q = linear_part(0, "q.", &q, config)?;
        let k = linear_part(1, "k.", &k, config)?;
        let v = linear_part(2, "v.", &v, config)?;
        let o = o.map(|o| linear_part(3, "o.", &o, config)).transpose()?;
        assemble(config, [q, k, v], o.map(|o| ("o.weight", o)))
    }

    /// Parameters from PyTorch `nn.MultiheadAttention`'s `state_dict`:
    /// `in_proj_weight` `[3·embed_dim, embed_dim]` (the query, key and value
    /// weights stacked, each `[out, in]`), `in_proj_bias` `[3·embed_dim]`
    /// if the module has biases, and `out_proj` (`out_proj.weight`,
    /// `out_proj.bias`). The head count is not in the tensors; it comes
    /// from `config` (`AttentionConfig::new(embed_dim, num_heads)` with an
    /// output projection to `embed_dim`, and biases unless the module was
    /// built with `bias=False`).
    ///
    /// The stacked weight is split at the config's widths, so a fused
    /// grouped-query projection (`q + k + v` rows with fewer key/value
    /// heads) loads too.
    ///
    /// # Errors
    /// As [`from_torch_linear`](Self::from_torch_linear), naming
    /// `in_proj_weight`, `in_proj_bias`, `out_proj.weight` or
    /// `out_proj.bias`; [`ErrorKind::ShapeMismatch`] also when the config
    /// gives the key/value side its own width (a module with `kdim`/`vdim`
    /// stores separate weights: use [`from_torch_linear`](Self::from_torch_linear)).
    ///
    /// ```
    /// use ndarray::{Array1, Array2};
    /// use sdpa::{AttentionConfig, ErrorKind, LayerParameters, TorchLinear};
    ///
    /// // nn.MultiheadAttention(embed_dim=4, num_heads=2)
    /// let config = AttentionConfig::new(4, 2).with_output_projection(4).with_bias(true);
    /// let in_proj_weight = Array2::<f32>::from_shape_fn((12, 4), |(i, j)| (i * 4 + j) as f32);
    /// let in_proj_bias = Array1::<f32>::zeros(12);
    /// let (out_weight, out_bias) = (Array2::<f32>::eye(4), Array1::<f32>::zeros(4));
    /// let out_proj = TorchLinear::new(out_weight.view()).with_bias(out_bias.view());
    /// let parameters = LayerParameters::from_torch_multihead_attention(
    ///     &config, in_proj_weight.view(), Some(in_proj_bias.view()), Some(out_proj.clone()))?;
    /// // Rows 4..8 are the key weight [out, in]; W^K is its transpose.
    /// assert_eq!(parameters.w_k[[1, 0]], in_proj_weight[[4, 1]]);
    ///
    /// // A transposed in_proj_weight is caught, named, with both shapes.
    /// let transposed = in_proj_weight.t();
    /// let err = LayerParameters::from_torch_multihead_attention(
    ///     &config, transposed, Some(in_proj_bias.view()), Some(out_proj)).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    /// assert!(err.to_string().contains("`in_proj_weight` has shape [4, 12], expected [12, 4]"));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn from_torch_multihead_attention(
        config: &AttentionConfig,
        in_proj_weight: ArrayView2<'_, F>,
        in_proj_bias: Option<ArrayView1<'_, F>>,
        out_proj: Option<TorchLinear<'_, F>>,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let bias = in_proj_bias.map(|b| ("in_proj_bias", b));
        let parts = split_fused(("in_proj_weight", in_proj_weight), bias, Axis(0), config)?;
        let o = out_proj
            .map(|o| linear_part(3, "out_proj.", &o, config))
            .transpose()?;
        assemble(config, parts, o.map(|o| ("out_proj.weight", o)))
    }

    /// Parameters from a projection fused per head, BLOOM's and GPT-NeoX's
    /// `query_key_value` (`nn.Linear`): `weight` `[3·hidden, hidden]`
    /// (`[out, in]`) whose output rows are `[heads, 3, head_dim]`, each
    /// head's query, key and value rows in turn, and its `bias`; `dense`,
    /// the output projection. Heads come from `config`
    /// (`AttentionConfig::new(hidden_size, n_head)
    /// .with_output_projection(hidden_size).with_bias(true)`).
    /// `load_bloom_attention` (feature `safetensors`) reads them from
    /// a checkpoint.
    ///
    /// # Errors
    /// As [`from_torch_linear`](Self::from_torch_linear), naming
    /// `query_key_value.weight`, `query_key_value.bias`, `dense.weight` or
    /// `dense.bias`; [`ErrorKind::ShapeMismatch`] also when the config has
    /// grouped key/value heads, `d_v != d_k` or a key/value width of its
    /// own (the layout has none of these).
    ///
    /// ```
    /// use ndarray::{Array1, Array2};
    /// use sdpa::{AttentionConfig, LayerParameters};
    ///
    /// // 2 heads of 2: rows 0..2 head 0's query, 2..4 its key, 4..6 its value, 6..8 head 1's query...
    /// let config = AttentionConfig::new(4, 2);
    /// let weight = Array2::<f32>::from_shape_fn((12, 4), |(row, i)| (row * 4 + i) as f32);
    /// let parameters = LayerParameters::from_bloom_query_key_value(&config, weight.view(), None, None)?;
    /// // Head 1's query (rows 6..8) is W^Q's columns 2..4, transposed to [in, out].
    /// assert_eq!(parameters.w_q[[0, 2]], weight[[6, 0]]);
    /// assert_eq!(parameters.w_v[[3, 1]], weight[[5, 3]]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn from_bloom_query_key_value(
        config: &AttentionConfig,
        weight: ArrayView2<'_, F>,
        bias: Option<ArrayView1<'_, F>>,
        dense: Option<TorchLinear<'_, F>>,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let bias = bias.map(|b| ("query_key_value.bias", b));
        let parts = split_fused_per_head(("query_key_value.weight", weight), bias, config)?;
        let o = dense
            .map(|o| linear_part(3, "dense.", &o, config))
            .transpose()?;
        assemble(config, parts, o.map(|o| ("dense.weight", o)))
    }

    /// Parameters from GPT-2's attention (`transformers`' `GPT2Attention`),
    /// whose `Conv1D` modules store weights `[in, out]`, the crate's own
    /// layout: `c_attn.weight` `[d_model, 3·d_model]` (query, key and value
    /// side by side), `c_attn.bias` `[3·d_model]`, and the output projection
    /// `c_proj.weight` `[d_model, d_model]`, `c_proj.bias`. Heads come from
    /// `config` (`AttentionConfig::new(n_embd, n_head)
    /// .with_output_projection(n_embd).with_bias(true)`).
    ///
    /// # Errors
    /// As [`from_torch_multihead_attention`](Self::from_torch_multihead_attention),
    /// naming `c_attn.weight`, `c_attn.bias`, `c_proj.weight` or `c_proj.bias`.
    ///
    /// ```
    /// use ndarray::{Array1, Array2};
    /// use sdpa::{AttentionConfig, LayerParameters};
    ///
    /// let config = AttentionConfig::new(4, 2).with_output_projection(4).with_bias(true);
    /// let c_attn = Array2::<f64>::from_shape_fn((4, 12), |(i, j)| (i * 12 + j) as f64);
    /// let c_attn_bias = Array1::<f64>::zeros(12);
    /// let (c_proj, c_proj_bias) = (Array2::<f64>::eye(4), Array1::<f64>::zeros(4));
    /// let parameters = LayerParameters::from_gpt2_conv1d(
    ///     &config,
    ///     (c_attn.view(), Some(c_attn_bias.view())),
    ///     Some((c_proj.view(), Some(c_proj_bias.view()))),
    /// )?;
    /// assert_eq!(parameters.w_v[[0, 0]], c_attn[[0, 8]]); // columns 8..12 are the values
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    #[allow(clippy::type_complexity)]
    pub fn from_gpt2_conv1d(
        config: &AttentionConfig,
        (c_attn_weight, c_attn_bias): (ArrayView2<'_, F>, Option<ArrayView1<'_, F>>),
        c_proj: Option<(ArrayView2<'_, F>, Option<ArrayView1<'_, F>>)>,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let bias = c_attn_bias.map(|b| ("c_attn.bias", b));
        let parts = split_fused(("c_attn.weight", c_attn_weight), bias, Axis(1), config)?;
        let o = c_proj
            .map(|o| conv1d_part(3, "c_proj.", o, config))
            .transpose()?;
        assemble(config, parts, o.map(|o| ("c_proj.weight", o)))
    }
}
