//! A two-layer Llama-style decoder on `sdpa`'s layers: loads Hugging Face
//! `LlamaForCausalLM` weights from a safetensors file, prefills a prompt and
//! greedily decodes with one `KvCache` per layer, checks every token and
//! logit against what Hugging Face's `generate` made of the same prompt
//! (saved in the file by `scripts/make_decoder_fixture.py`), then times a
//! longer greedy run and prints tokens per second.
//!
//! ```text
//! cargo run --release --features safetensors --example decoder [-- FILE [TOKENS]]
//! ```
//!
//! Attention (projections, GQA, RoPE, the cache) is the crate's; the rest of
//! the model (embedding, RMSNorm, the SwiGLU MLP, the LM head) is written
//! here in a few lines of ndarray, as a downstream crate would.

use std::process::ExitCode;
use std::time::Instant;

use ndarray::{Array1, Array2, Array3, ArrayView2, Axis, Ix1, Ix2, s};
use sdpa::{
    AttentionConfig, AttentionError, CausalAttention, Checkpoint, KvCache, LayerParameters,
    RopeConfig,
};

#[path = "support/machine.rs"]
mod machine;

/// The fixture's model: `LlamaConfig` of `scripts/make_decoder_fixture.py`.
const LAYERS: usize = 2;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const ROPE_THETA: f64 = 10_000.0;
const RMS_NORM_EPS: f32 = 1e-5;
/// How far the rotary table reaches (the model's `max_position_embeddings`).
const MAX_POSITIONS: usize = 256;

/// One decoder layer: attention and MLP, each after an RMSNorm, each added
/// to the residual stream.
struct DecoderLayer {
    input_norm: Array1<f32>,
    attention: CausalAttention<f32>,
    post_attention_norm: Array1<f32>,
    /// `[hidden, intermediate]`: the transposes of `nn.Linear`'s weights.
    gate: Array2<f32>,
    up: Array2<f32>,
    /// `[intermediate, hidden]`.
    down: Array2<f32>,
}

struct Decoder {
    embedding: Array2<f32>,
    layers: Vec<DecoderLayer>,
    norm: Array1<f32>,
    /// `[hidden, vocab]`.
    lm_head: Array2<f32>,
}

fn vector(checkpoint: &Checkpoint, name: &str) -> Result<Array1<f32>, AttentionError> {
    let tensor = checkpoint.tensor::<f32>(name)?;
    tensor
        .into_dimensionality::<Ix1>()
        .map_err(|e| shape(name, e))
}

/// An `nn.Linear` weight `[out, in]`, as the `[in, out]` matrix `x · W`.
fn linear(checkpoint: &Checkpoint, name: &str) -> Result<Array2<f32>, AttentionError> {
    let tensor = checkpoint.tensor::<f32>(name)?;
    let weight = tensor
        .into_dimensionality::<Ix2>()
        .map_err(|e| shape(name, e))?;
    Ok(weight.reversed_axes().as_standard_layout().into_owned())
}

fn shape(name: &str, error: ndarray::ShapeError) -> AttentionError {
    AttentionError::new(sdpa::ErrorKind::ShapeMismatch, format!("`{name}`: {error}"))
}

impl Decoder {
    fn load(checkpoint: &Checkpoint) -> Result<Self, AttentionError> {
        let config = AttentionConfig::new(HIDDEN, HEADS)
            .with_kv_heads(KV_HEADS)
            .with_head_dim(HEAD_DIM)
            .with_output_projection(HIDDEN)
            .with_rope(RopeConfig::new(ROPE_THETA, MAX_POSITIONS));
        let layers = (0..LAYERS)
            .map(|l| {
                let prefix = format!("model.layers.{l}");
                let attention = LayerParameters::load_hf_llama(
                    checkpoint,
                    &format!("{prefix}.self_attn"),
                    &config,
                )?;
                Ok(DecoderLayer {
                    input_norm: vector(checkpoint, &format!("{prefix}.input_layernorm.weight"))?,
                    attention: CausalAttention::new(config, attention)?,
                    post_attention_norm: vector(
                        checkpoint,
                        &format!("{prefix}.post_attention_layernorm.weight"),
                    )?,
                    gate: linear(checkpoint, &format!("{prefix}.mlp.gate_proj.weight"))?,
                    up: linear(checkpoint, &format!("{prefix}.mlp.up_proj.weight"))?,
                    down: linear(checkpoint, &format!("{prefix}.mlp.down_proj.weight"))?,
                })
            })
            .collect::<Result<_, AttentionError>>()?;
        let embedding = checkpoint.tensor::<f32>("model.embed_tokens.weight")?;
        Ok(Self {
            embedding: embedding
                .into_dimensionality::<Ix2>()
                .map_err(|e| shape("model.embed_tokens.weight", e))?,
            layers,
            norm: vector(checkpoint, "model.norm.weight")?,
            lm_head: linear(checkpoint, "lm_head.weight")?,
        })
    }

    fn new_caches(&self, capacity: usize) -> Result<Vec<KvCache<f32>>, AttentionError> {
        self.layers
            .iter()
            .map(|layer| layer.attention.new_cache(1, capacity))
            .collect()
    }

    /// The logits `[len, vocab]` of the positions `tokens` (one sequence),
    /// which follow those the caches hold; `prefill` starts them afresh.
    fn forward(
        &self,
        tokens: &[usize],
        caches: &mut [KvCache<f32>],
        prefill: bool,
    ) -> Result<Array2<f32>, AttentionError> {
        let rows: Vec<_> = tokens.iter().map(|&t| self.embedding.row(t)).collect();
        let mut x: Array3<f32> = ndarray::stack(Axis(0), &rows)
            .expect("embedding rows share a width")
            .insert_axis(Axis(0));
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let normed = rms_norm(x.index_axis(Axis(0), 0), &layer.input_norm).insert_axis(Axis(0));
            let attended = if prefill {
                layer.attention.prefill(normed.view(), cache)?
            } else {
                layer.attention.step(normed.view(), cache)?
            };
            x += &attended;
            let normed = rms_norm(x.index_axis(Axis(0), 0), &layer.post_attention_norm);
            let gate = normed.dot(&layer.gate).mapv(|g| g / (1.0 + (-g).exp()));
            let hidden = gate * normed.dot(&layer.up);
            x += &hidden.dot(&layer.down).insert_axis(Axis(0));
        }
        Ok(rms_norm(x.index_axis(Axis(0), 0), &self.norm).dot(&self.lm_head))
    }

    /// Greedy decoding of `new_tokens` after `prompt`: the tokens and each
    /// step's logits (the logits that chose it).
    fn generate(
        &self,
        prompt: &[usize],
        new_tokens: usize,
    ) -> Result<(Vec<usize>, Vec<Array1<f32>>), AttentionError> {
        let mut caches = self.new_caches(prompt.len() + new_tokens)?;
        let mut logits = self
            .forward(prompt, &mut caches, true)?
            .row(prompt.len() - 1)
            .to_owned();
        let (mut tokens, mut all_logits) = (Vec::new(), Vec::new());
        for step in 0..new_tokens {
            let next = argmax(&logits);
            tokens.push(next);
            all_logits.push(logits);
            if step + 1 < new_tokens {
                logits = self.forward(&[next], &mut caches, false)?.row(0).to_owned();
            } else {
                logits = Array1::zeros(0);
            }
        }
        Ok((tokens, all_logits))
    }
}

/// Llama's RMSNorm of each row: `x / √(mean(x²) + ε) · weight`.
fn rms_norm(x: ArrayView2<'_, f32>, weight: &Array1<f32>) -> Array2<f32> {
    let mut out = x.to_owned();
    for mut row in out.rows_mut() {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let inverse = 1.0 / (mean_square + RMS_NORM_EPS).sqrt();
        row.zip_mut_with(weight, |v, w| *v *= inverse * w);
    }
    out
}

fn argmax(logits: &Array1<f32>) -> usize {
    let mut best = 0;
    for (i, &logit) in logits.iter().enumerate() {
        if logit > logits[best] {
            best = i;
        }
    }
    best
}

fn ids(checkpoint: &Checkpoint, name: &str) -> Result<Vec<usize>, AttentionError> {
    Ok(vector(checkpoint, name)?
        .iter()
        .map(|&id| id as usize)
        .collect())
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, AttentionError> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .unwrap_or_else(|| "tests/fixtures/tiny_llama_decoder.safetensors".into());
    let timed_tokens: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(200);
    let (set, peak) = machine::selected_set_and_peak();
    println!(
        "sdpa decoder example: {} | kernel set {set:?} | FMA peak {peak:.0} GFLOP/s (one thread)",
        machine::cpu_model()
    );
    let checkpoint = Checkpoint::from_file(&path)?;
    let decoder = Decoder::load(&checkpoint)?;
    let prompt = ids(&checkpoint, "prompt_ids")?;
    let expected = ids(&checkpoint, "generated_ids")?;
    let expected_logits = checkpoint
        .tensor::<f32>("generated_logits")?
        .into_dimensionality::<Ix2>()
        .map_err(|e| shape("generated_logits", e))?;

    // Against Hugging Face: the same tokens, and logits within 1e-4.
    let (tokens, logits) = decoder.generate(&prompt, expected.len())?;
    let worst = logits
        .iter()
        .enumerate()
        .map(|(step, row)| {
            let hf = expected_logits.slice(s![step, ..]);
            row.iter()
                .zip(hf)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0_f32, f32::max)
        })
        .fold(0.0_f32, f32::max);
    println!("prompt    {prompt:?}");
    println!("sdpa      {tokens:?}");
    println!("HF        {expected:?}");
    println!("largest logit difference from Hugging Face: {worst:.2e}");
    let matches = tokens == expected && worst < 1e-4;
    if !matches {
        eprintln!("MISMATCH with Hugging Face's greedy generate");
        return Ok(false);
    }

    // Timing: prefill, then greedy steps; the tokens past the fixture's are
    // the model's own (random weights: not language).
    let start = Instant::now();
    let (tokens, _) = decoder.generate(&prompt, timed_tokens)?;
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "{} tokens in {:.1} ms: {:.0} tokens/s (prefill of {} included; {} layers, d_model {HIDDEN})",
        tokens.len(),
        seconds * 1e3,
        tokens.len() as f64 / seconds,
        prompt.len(),
        LAYERS
    );
    Ok(true)
}
