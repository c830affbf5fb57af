//! Hugging Face `transformers` attentions: `GPT2Attention` (`Conv1D`, in
//! `f64`), `LlamaAttention` and `Qwen2Attention` (grouped-query, `nn.Linear`
//! projections; Qwen2 with biases on q, k, v only). The Llama-family
//! fixtures' `output` was run with cos = 1, sin = 0 position embeddings,
//! so its rotary embedding is the identity and the projections and grouped
//! attention compare alone; their `rope.` tensors are the same attention
//! inside a one-layer model with real rotary embeddings, whole and decoded
//! with a cache.

use ndarray::{Array3, Ix3};
use sdpa::{AttentionConfig, CausalAttention, LayerParameters, RopeConfig};

use super::models::check_rotary_decoding;
use super::{F32_TOLERANCE, fixture, max_difference, tensor};

/// GPT2Config(n_embd=16, n_head=4).
fn gpt2_config() -> AttentionConfig {
    AttentionConfig::new(16, 4)
        .with_output_projection(16)
        .with_bias(true)
}

#[test]
fn gpt2_attention_matches_transformers_in_f64() {
    let checkpoint = fixture("hf_gpt2.safetensors");
    let parameters =
        LayerParameters::<f64>::load_gpt2_attention(&checkpoint, "attn", &gpt2_config()).unwrap();
    let layer = CausalAttention::new(gpt2_config(), parameters).unwrap();
    let x: Array3<f64> = tensor(&checkpoint, "input");
    let got = layer.forward_batch(x.view()).unwrap();
    let difference = max_difference(&got, &checkpoint.tensor("output").unwrap());
    assert!(difference < 1e-12, "{difference}");
}

/// F64 tensors load into an `f32` layer too, rounded.
#[test]
fn gpt2_attention_in_f32_from_f64_tensors() {
    let checkpoint = fixture("hf_gpt2.safetensors");
    let parameters =
        LayerParameters::<f32>::load_gpt2_attention(&checkpoint, "attn.", &gpt2_config()).unwrap();
    let layer = CausalAttention::new(gpt2_config(), parameters).unwrap();
    let x: Array3<f32> = tensor(&checkpoint, "input");
    let got = layer.forward_batch(x.view()).unwrap();
    let difference = max_difference(&got, &checkpoint.tensor("output").unwrap());
    // Inputs and outputs of order 1-10 rounded to f32.
    assert!(difference < 1e-4, "{difference}");
}

/// LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8).
fn llama_config() -> AttentionConfig {
    AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_head_dim(8)
        .with_output_projection(32)
}

fn check_llama_family(file: &str, config: AttentionConfig) {
    let checkpoint = fixture(file);
    let parameters = LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &config).unwrap();
    let x: Array3<f32> = tensor(&checkpoint, "input");
    // Each projection alone: x·W + b against q_proj(x), k_proj(x), v_proj(x), o_proj(x).
    let project = |w: &ndarray::Array2<f32>, b: Option<&ndarray::Array1<f32>>| {
        let mut y = Array3::zeros((1, 5, w.ncols()));
        y.index_axis_mut(ndarray::Axis(0), 0)
            .assign(&x.index_axis(ndarray::Axis(0), 0).dot(w));
        if let Some(b) = b {
            y += b;
        }
        y
    };
    let p = &parameters;
    let cases = [
        ("q", project(&p.w_q, p.b_q.as_ref())),
        ("k", project(&p.w_k, p.b_k.as_ref())),
        ("v", project(&p.w_v, p.b_v.as_ref())),
        ("o", project(p.w_o.as_ref().unwrap(), p.b_o.as_ref())),
    ];
    for (name, got) in cases {
        let difference = max_difference(&got, &checkpoint.tensor(name).unwrap());
        assert!(
            difference < F32_TOLERANCE,
            "{file} {name}_proj: {difference}"
        );
    }
    // The whole layer: grouped-query causal attention and o_proj.
    let layer = CausalAttention::new(config, parameters).unwrap();
    let got = layer.forward_batch(x.view()).unwrap();
    let difference = max_difference(&got, &checkpoint.tensor("output").unwrap());
    assert!(difference < F32_TOLERANCE, "{file} forward: {difference}");
    let _ = tensor::<f32, Ix3>(&checkpoint, "output");
}

#[test]
fn llama_attention_with_grouped_heads_matches_transformers() {
    check_llama_family("hf_llama.safetensors", llama_config());
}

/// Qwen2: biases on q_proj, k_proj, v_proj; its o_proj has none and loads
/// with a zero bias.
#[test]
fn qwen2_attention_with_biases_matches_transformers() {
    check_llama_family("hf_qwen2.safetensors", llama_config().with_bias(true));
    let checkpoint = fixture("hf_qwen2.safetensors");
    let config = llama_config().with_bias(true);
    let parameters = LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &config).unwrap();
    assert!(parameters.b_o.unwrap().iter().all(|&b| b == 0.0));
}

/// LlamaModel with rope_theta 500000 (Llama 3's) over the whole head: 2
/// sequences of 9 tokens, whole, then 6 prefilled and 3 decode steps.
#[test]
fn llama_attention_with_rope_decodes_as_transformers() {
    let checkpoint = fixture("hf_llama.safetensors");
    let config = llama_config().with_rope(RopeConfig::new(500_000.0, 64));
    let parameters = LayerParameters::load_hf_llama(&checkpoint, "attn", &config).unwrap();
    check_rotary_decoding(&checkpoint, "rope.", config, parameters, None);
}

/// Qwen2Model with rope_theta 1e6, its q, k, v biases rotated with the rest.
#[test]
fn qwen2_attention_with_rope_decodes_as_transformers() {
    let checkpoint = fixture("hf_qwen2.safetensors");
    let config = llama_config()
        .with_bias(true)
        .with_rope(RopeConfig::new(1e6, 64));
    let parameters = LayerParameters::load_hf_llama(&checkpoint, "attn", &config).unwrap();
    check_rotary_decoding(&checkpoint, "rope.", config, parameters, None);
}
