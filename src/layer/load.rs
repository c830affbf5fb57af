//! [`LayerParameters`] read from a [`Checkpoint`] (feature `safetensors`),
//! one constructor per source layout: each reads the tensors under a
//! prefix by their names in that framework, and hands them to the layout
//! constructors of `layouts`, which check them (naming the full tensor
//! name) and transpose what needs it.

use ndarray::{Array1, Array2, ArrayD, Ix1, Ix2};

use super::config::{AttentionConfig, describe_config};
use super::layouts::{
    Part, TorchLinear, assemble, conv1d_part, linear_part, split_fused, split_fused_per_head,
};
use super::params::LayerParameters;
use crate::checkpoint::{Checkpoint, join};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};

/// A tensor of rank `D`, or the error naming it and its shape.
fn rank<F, D: ndarray::Dimension>(
    name: &str,
    tensor: ArrayD<F>,
    what: &str,
    config: &AttentionConfig,
) -> Result<ndarray::Array<F, D>, AttentionError> {
    let shape = tensor.shape().to_vec();
    tensor.into_dimensionality::<D>().map_err(|_| {
        shape_error(format!(
            "tensor `{name}` has shape {shape:?}, expected {what} (rank {}) for {}",
            D::NDIM.unwrap_or(0),
            describe_config(config)
        ))
    })
}

/// The matrix `name`, if the checkpoint has it.
fn matrix<F: Element>(
    checkpoint: &Checkpoint,
    name: &str,
    config: &AttentionConfig,
) -> Result<Option<Array2<F>>, AttentionError> {
    checkpoint
        .get(name)?
        .map(|t| rank::<F, Ix2>(name, t, "a weight matrix", config))
        .transpose()
}

/// The vector `name`, if the checkpoint has it.
fn vector<F: Element>(
    checkpoint: &Checkpoint,
    name: &str,
    config: &AttentionConfig,
) -> Result<Option<Array1<F>>, AttentionError> {
    checkpoint
        .get(name)?
        .map(|t| rank::<F, Ix1>(name, t, "a bias vector", config))
        .transpose()
}

/// The matrix `name`, which must be there.
fn required<F: Element>(
    checkpoint: &Checkpoint,
    name: &str,
    config: &AttentionConfig,
) -> Result<Array2<F>, AttentionError> {
    matrix(checkpoint, name, config)?.ok_or_else(|| checkpoint.missing(name))
}

/// The output projection, an `nn.Linear` `{module}.weight` (and optional
/// `.bias`), with the weight's full name: `None` when the checkpoint has no
/// such weight and the config no output projection (a weight there without
/// one in the config is read, for `assemble` to report).
fn output_linear<F: Element>(
    checkpoint: &Checkpoint,
    module: &str,
    config: &AttentionConfig,
) -> Result<(String, Option<Part<F>>), AttentionError> {
    let module = join(module, "");
    let o_weight = format!("{module}weight");
    let o = match matrix::<F>(checkpoint, &o_weight, config)? {
        Some(weight) => {
            let bias = vector::<F>(checkpoint, &format!("{module}bias"), config)?;
            let mut linear = TorchLinear::new(weight.view());
            if let Some(bias) = &bias {
                linear = linear.with_bias(bias.view());
            }
            Some(linear_part(3, &module, &linear, config)?)
        }
        None if config.d_model_out.is_some() => return Err(checkpoint.missing(&o_weight)),
        None => None,
    };
    Ok((o_weight, o))
}

impl<F: Element> LayerParameters<F> {
    /// Parameters from PyTorch `nn.Linear` modules in a checkpoint: the
    /// modules `{prefix}.{names[0]}` (queries), `names[1]` (keys),
    /// `names[2]` (values) and, when `config` has an output projection,
    /// `output`, each a `weight` `[out, in]` and an optional `bias`, as
    /// [`from_torch_linear`](Self::from_torch_linear) reads them.
    /// [`load_hf_llama`](Self::load_hf_llama) is this with Hugging Face's
    /// names.
    ///
    /// # Errors
    /// As [`from_torch_linear`](Self::from_torch_linear), naming the full
    /// tensor name; [`ErrorKind::MissingTensor`](crate::ErrorKind::MissingTensor)
    /// when a weight is not in the checkpoint; as [`Checkpoint::tensor`]
    /// for a tensor of another element type.
    ///
    /// ```
    /// use sdpa::{AttentionConfig, Checkpoint, LayerParameters};
    ///
    /// let checkpoint = Checkpoint::from_file("tests/fixtures/hf_llama.safetensors")?;
    /// // 4 query heads of 8 over 32, 2 key/value heads, o_proj back to 32.
    /// let config = AttentionConfig::new(32, 4).with_kv_heads(2).with_output_projection(32);
    /// let names = ["q_proj", "k_proj", "v_proj"];
    /// let parameters: LayerParameters<f32> =
    ///     LayerParameters::load_torch_linear(&checkpoint, "attn", names, Some("o_proj"), &config)?;
    /// assert_eq!(parameters.w_k.dim(), (32, 2 * 8)); // [in, out]
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn load_torch_linear(
        checkpoint: &Checkpoint,
        prefix: &str,
        names: [&str; 3],
        output: Option<&str>,
        config: &AttentionConfig,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let read = |i: usize, module: &str| -> Result<_, AttentionError> {
            let name = join(&join(prefix, module), "");
            let weight = required::<F>(checkpoint, &format!("{name}weight"), config)?;
            let bias = vector::<F>(checkpoint, &format!("{name}bias"), config)?;
            let mut linear = TorchLinear::new(weight.view());
            if let Some(bias) = &bias {
                linear = linear.with_bias(bias.view());
            }
            linear_part(i, &name, &linear, config)
        };
        let [q, k, v] = [read(0, names[0])?, read(1, names[1])?, read(2, names[2])?];
        let o_name = output.map(|module| (module, join(&join(prefix, module), "weight")));
        let o = match &o_name {
            // Read when the config has one, or when the file does (to say so).
            Some((module, name)) if config.d_model_out.is_some() || checkpoint.contains(name) => {
                Some((name.as_str(), read(3, module)?))
            }
            _ => None,
        };
        assemble(config, [q, k, v], o)
    }

    /// Parameters of a Hugging Face Llama, Mistral or Qwen2 attention
    /// (`LlamaAttention` and its kin) from its checkpoint: `{prefix}.q_proj`,
    /// `k_proj`, `v_proj` and `o_proj`, each `.weight` `[out, in]` and an
    /// optional `.bias` (Qwen2 has them on `q_proj`, `k_proj`, `v_proj`).
    /// The prefix is the module's, such as `model.layers.0.self_attn`.
    ///
    /// The head counts and width are not in the file; take them from the
    /// model's `config.json`: `AttentionConfig::new(hidden_size,
    /// num_attention_heads).with_kv_heads(num_key_value_heads)
    /// .with_output_projection(hidden_size)`, with
    /// `.with_head_dim(head_dim)` when the config gives one, and
    /// `.with_bias(true)` for Qwen2 (its `o_proj` gets a zero bias).
    /// Rotary position embeddings are not part of the parameters.
    ///
    /// # Errors
    /// As [`load_torch_linear`](Self::load_torch_linear).
    ///
    /// ```
    /// use sdpa::{AttentionConfig, Checkpoint, ErrorKind, LayerParameters};
    ///
    /// let checkpoint = Checkpoint::from_file("tests/fixtures/hf_llama.safetensors")?;
    /// let config = AttentionConfig::new(32, 4).with_kv_heads(2).with_output_projection(32);
    /// let parameters = LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &config)?;
    /// assert_eq!(parameters.w_o.map(|w| w.dim()), Some((32, 32)));
    ///
    /// // Forgetting the grouped key/value heads is caught, with both shapes.
    /// let err = LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &config.with_kv_heads(4))
    ///     .unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    /// assert!(err.to_string().contains("`attn.k_proj.weight` has shape [16, 32], expected [32, 32]"));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn load_hf_llama(
        checkpoint: &Checkpoint,
        prefix: &str,
        config: &AttentionConfig,
    ) -> Result<Self, AttentionError> {
        let names = ["q_proj", "k_proj", "v_proj"];
        Self::load_torch_linear(checkpoint, prefix, names, Some("o_proj"), config)
    }

    /// Parameters of a PyTorch `nn.MultiheadAttention` from its
    /// `state_dict` in a checkpoint: `{prefix}.in_proj_weight`,
    /// `in_proj_bias`, `out_proj.weight` and `out_proj.bias`, as
    /// [`from_torch_multihead_attention`](Self::from_torch_multihead_attention)
    /// reads them (the heads come from `config`).
    ///
    /// # Errors
    /// As [`from_torch_multihead_attention`](Self::from_torch_multihead_attention)
    /// and [`load_torch_linear`](Self::load_torch_linear).
    ///
    /// ```
    /// use sdpa::{Attention, AttentionConfig, Checkpoint, LayerParameters};
    ///
    /// let checkpoint = Checkpoint::from_file("tests/fixtures/torch_mha.safetensors")?;
    /// // nn.MultiheadAttention(16, 4)
    /// let config = AttentionConfig::new(16, 4).with_output_projection(16).with_bias(true);
    /// let parameters = LayerParameters::load_torch_multihead_attention(&checkpoint, "mha", &config)?;
    /// let layer = Attention::<f32>::new(config, parameters)?;
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn load_torch_multihead_attention(
        checkpoint: &Checkpoint,
        prefix: &str,
        config: &AttentionConfig,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let name = |n: &str| join(prefix, n);
        let (w_name, b_name) = (name("in_proj_weight"), name("in_proj_bias"));
        let weight = required::<F>(checkpoint, &w_name, config)?;
        let bias = vector::<F>(checkpoint, &b_name, config)?;
        let bias = bias.as_ref().map(|b| (b_name.as_str(), b.view()));
        let parts = split_fused((&w_name, weight.view()), bias, ndarray::Axis(0), config)?;
        let (o_weight, o) = output_linear(checkpoint, &name("out_proj"), config)?;
        assemble(config, parts, o.map(|o| (o_weight.as_str(), o)))
    }

    /// Parameters of a Hugging Face GPT-2 attention (`GPT2Attention`) from
    /// its checkpoint: `{prefix}.c_attn.weight` `[d_model, 3·d_model]`,
    /// `c_attn.bias`, `c_proj.weight` and `c_proj.bias`, as
    /// [`from_gpt2_conv1d`](Self::from_gpt2_conv1d) reads them (already
    /// `[in, out]`: no transpose). The prefix is the module's, such as
    /// `h.0.attn` (or `transformer.h.0.attn`).
    ///
    /// # Errors
    /// As [`from_gpt2_conv1d`](Self::from_gpt2_conv1d) and
    /// [`load_torch_linear`](Self::load_torch_linear).
    ///
    /// ```
    /// use sdpa::{AttentionConfig, Checkpoint, LayerParameters};
    ///
    /// let checkpoint = Checkpoint::from_file("tests/fixtures/hf_gpt2.safetensors")?;
    /// // GPT2Config(n_embd=16, n_head=4)
    /// let config = AttentionConfig::new(16, 4).with_output_projection(16).with_bias(true);
    /// let parameters = LayerParameters::<f64>::load_gpt2_attention(&checkpoint, "attn", &config)?;
    /// assert_eq!(parameters.w_q.dim(), (16, 16));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn load_gpt2_attention(
        checkpoint: &Checkpoint,
        prefix: &str,
        config: &AttentionConfig,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let name = |n: &str| join(prefix, n);
        let (w_name, b_name) = (name("c_attn.weight"), name("c_attn.bias"));
        let weight = required::<F>(checkpoint, &w_name, config)?;
        let bias = vector::<F>(checkpoint, &b_name, config)?;
        let bias = bias.as_ref().map(|b| (b_name.as_str(), b.view()));
        let parts = split_fused((&w_name, weight.view()), bias, ndarray::Axis(1), config)?;
        let proj = name("c_proj.");
        let o_weight = format!("{proj}weight");
        let o = match matrix::<F>(checkpoint, &o_weight, config)? {
            Some(weight) => {
                let bias = vector::<F>(checkpoint, &format!("{proj}bias"), config)?;
                let source = (weight.view(), bias.as_ref().map(|b| b.view()));
                Some(conv1d_part(3, &proj, source, config)?)
            }
            None if config.d_model_out.is_some() => return Err(checkpoint.missing(&o_weight)),
            None => None,
        };
        assemble(config, parts, o.map(|o| (o_weight.as_str(), o)))
    }

    /// Parameters of a Hugging Face BLOOM attention (`BloomAttention`) from
    /// its checkpoint: `{prefix}.query_key_value.weight`
    /// `[3·hidden, hidden]` with its `.bias`, and `{prefix}.dense.weight`
    /// `[hidden, hidden]` with its `.bias` (`nn.Linear`s, `[out, in]`), as
    /// [`from_bloom_query_key_value`](Self::from_bloom_query_key_value)
    /// reads them. The fused projection is laid out per head,
    /// `[heads, 3, head_dim]` on its output axis (each head's query, key and
    /// value rows in turn), not as three stacked blocks. GPT-NeoX (Pythia) stores its `GPTNeoXAttention`
    /// the same way, under the same names (prefix such as
    /// `gpt_neox.layers.0.attention`). The prefix is the module's, such as
    /// `transformer.h.0.self_attention` (or `h.0.self_attention`).
    ///
    /// The heads come from the model's config: `AttentionConfig::new(hidden_size,
    /// n_head).with_output_projection(hidden_size).with_bias(true)`. BLOOM's
    /// ALiBi is an attention option, `.alibi(&alibi_slopes(n_head))`;
    /// GPT-NeoX's partial rotary embeddings a layer option,
    /// `with_rope(RopeConfig::new(rotary_emb_base, max_positions)
    /// .with_rotary_dim(head_dim · partial_rotary_factor))`.
    ///
    /// # Errors
    /// As [`from_bloom_query_key_value`](Self::from_bloom_query_key_value)
    /// and [`load_torch_linear`](Self::load_torch_linear), naming the
    /// tensors with the prefix.
    ///
    /// ```
    /// use sdpa::{AttentionConfig, Checkpoint, LayerParameters};
    ///
    /// let checkpoint = Checkpoint::from_file("tests/fixtures/hf_bloom.safetensors")?;
    /// // BloomConfig(hidden_size=24, n_head=6)
    /// let config = AttentionConfig::new(24, 6).with_output_projection(24).with_bias(true);
    /// let prefix = "transformer.h.0.self_attention";
    /// let parameters = LayerParameters::<f32>::load_bloom_attention(&checkpoint, prefix, &config)?;
    /// // Head 1's key is rows 1·12 + 4 .. 1·12 + 8 of the fused weight: W^K's columns 4..8.
    /// let fused = checkpoint.tensor::<f32>("transformer.h.0.self_attention.query_key_value.weight")?;
    /// assert_eq!(parameters.w_k[[3, 4]], fused[[16, 3]]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn load_bloom_attention(
        checkpoint: &Checkpoint,
        prefix: &str,
        config: &AttentionConfig,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        let name = |n: &str| join(prefix, n);
        let (w_name, b_name) = (name("query_key_value.weight"), name("query_key_value.bias"));
        let weight = required::<F>(checkpoint, &w_name, config)?;
        let bias = vector::<F>(checkpoint, &b_name, config)?;
        let bias = bias.as_ref().map(|b| (b_name.as_str(), b.view()));
        let parts = split_fused_per_head((&w_name, weight.view()), bias, config)?;
        let (o_weight, o) = output_linear(checkpoint, &name("dense"), config)?;
        assemble(config, parts, o.map(|o| (o_weight.as_str(), o)))
    }
}
