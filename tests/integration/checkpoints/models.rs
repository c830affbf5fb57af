//! Attentions of whole Hugging Face models (`scripts/make_model_fixtures.py`),
//! observed inside the model so that its own rotary embeddings, masks,
//! ALiBi and KV cache were used: Mistral (sliding window, decoded with a
//! cache), GPT-NeoX (per-head fused `query_key_value`, partial RoPE,
//! decoded), Gemma 2 (softcap and `query_pre_attn_scalar`), gpt-oss (sinks,
//! YaRN) and BLOOM (ALiBi with 6 heads, padding).
//!
//! Rotary models are checked twice: through the layer (`with_rope`,
//! `prefill`, `step`) and written out with the functional API (the
//! projections by hand, [`apply_rope`] at explicit positions,
//! [`KvCache::attend`] for the decode steps). The configs repeat those in
//! the script.

use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, Axis, Ix1, s};
use sdpa::{
    AttentionConfig, AttentionOptions, CausalAttention, Checkpoint, KvCache, LayerParameters,
    RopeConfig, RopePositions, RopeTable, alibi_slopes, apply_rope, scaled_dot_product_attention,
};

use super::{F32_TOLERANCE, fixture, max_difference, tensor};

/// The tokens a decode fixture prefills before its single-token steps.
const PROMPT: usize = 6;

/// Positions the layers' rotary tables hold (the fixtures have 9 tokens).
const MAX_POSITIONS: usize = 64;

fn assert_close(got: &Array3<f32>, checkpoint: &Checkpoint, name: &str, what: &str) {
    let difference = max_difference(got, &checkpoint.tensor(name).unwrap());
    assert!(
        difference < F32_TOLERANCE,
        "{what} against `{name}`: {difference}"
    );
}

/// `x·W + b` over the last axis of `x` `[batch, len, in]`, `W` `[in, out]`.
fn linear(x: ArrayView3<'_, f32>, w: &Array2<f32>, b: Option<&Array1<f32>>) -> Array3<f32> {
    let (batch, len, _) = x.dim();
    let mut y = Array3::zeros((batch, len, w.ncols()));
    for (mut y, x) in y.outer_iter_mut().zip(x.outer_iter()) {
        y.assign(&x.dot(w));
    }
    if let Some(b) = b {
        y += b;
    }
    y
}

/// `[batch, len, heads·d]` as `[batch, heads, len, d]`, Hugging Face's
/// `view(..., heads, d).transpose(1, 2)`.
fn split_heads(x: Array3<f32>, heads: usize) -> Array4<f32> {
    let (batch, len, width) = x.dim();
    let x = x.into_shape_with_order((batch, len, heads, width / heads));
    x.unwrap()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned()
}

/// `[batch, heads, len, d]` back to `[batch, len, heads·d]`.
fn merge_heads(x: Array4<f32>) -> Array3<f32> {
    let (batch, heads, len, d) = x.dim();
    let x = x
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned();
    x.into_shape_with_order((batch, len, heads * d)).unwrap()
}

/// Steps' outputs `[batch, n, width]` side by side along the tokens.
fn tokens(steps: &[Array3<f32>]) -> Array3<f32> {
    let views: Vec<_> = steps.iter().map(|step| step.view()).collect();
    ndarray::concatenate(Axis(1), &views).unwrap()
}

/// A model's attention written out with the functional API: the
/// projections of `parameters`, the head split, `apply_rope` with `rope` at
/// the positions given, then (by the caller) attention, then the output
/// projection.
struct Functional {
    parameters: LayerParameters<f32>,
    heads: usize,
    kv_heads: usize,
    rope: RopeTable<f32>,
}

impl Functional {
    /// The rotary table a layer with `config` builds.
    fn new(config: &AttentionConfig, parameters: LayerParameters<f32>) -> Self {
        let rope = config.rope.expect("a rotary config");
        let rotary_dim = rope.rotary_dim.unwrap_or(config.d_k());
        let table = RopeTable::new(rotary_dim, rope.theta, rope.max_positions).unwrap();
        Self::with_table(config, parameters, table.with_layout(rope.layout))
    }

    fn with_table(
        config: &AttentionConfig,
        parameters: LayerParameters<f32>,
        rope: RopeTable<f32>,
    ) -> Self {
        Self {
            parameters,
            heads: config.heads,
            kv_heads: config.kv_heads,
            rope,
        }
    }

    /// The query, key and value heads of `x` `[batch, n, d_model]`, its
    /// tokens at positions `start..start + n`, queries and keys rotated.
    fn heads(&self, x: ArrayView3<'_, f32>, start: usize) -> [Array4<f32>; 3] {
        let p = &self.parameters;
        let q = split_heads(linear(x, &p.w_q, p.b_q.as_ref()), self.heads);
        let k = split_heads(linear(x, &p.w_k, p.b_k.as_ref()), self.kv_heads);
        let v = split_heads(linear(x, &p.w_v, p.b_v.as_ref()), self.kv_heads);
        let rotate = |x: Array4<f32>| apply_rope(x.view(), &self.rope, RopePositions::Start(start));
        [rotate(q).unwrap(), rotate(k).unwrap(), v]
    }

    /// The heads' attention `[batch, heads, n, d_v]` merged and projected.
    fn output(&self, attention: Array4<f32>) -> Array3<f32> {
        let p = &self.parameters;
        let w_o = p.w_o.as_ref().expect("an output projection");
        linear(merge_heads(attention).view(), w_o, p.b_o.as_ref())
    }
}

/// A decode fixture (`decode_outputs` in `scripts/make_fixtures.py`): the
/// tensors `{prefix}input`, `{prefix}output` (the whole sequence),
/// `{prefix}prefill_output` (the first [`PROMPT`] tokens with a fresh
/// cache) and `{prefix}step_output` (each later token alone against it).
/// `config` has the model's rotary embeddings; `window` is its sliding
/// window, if any.
pub fn check_rotary_decoding(
    checkpoint: &Checkpoint,
    prefix: &str,
    config: AttentionConfig,
    parameters: LayerParameters<f32>,
    window: Option<usize>,
) {
    let name = |n: &str| format!("{prefix}{n}");
    let x: Array3<f32> = tensor(checkpoint, &name("input"));
    let (batch, len, _) = x.dim();
    assert!(len > PROMPT);
    let opts = window.map_or(AttentionOptions::new().causal(), |w| {
        AttentionOptions::new().window(w)
    });
    let (kv_heads, d_k, d_v) = (config.kv_heads, config.d_k(), config.d_v());
    // A growing cache starts small enough to grow during the steps.
    let new_cache = || match window {
        Some(w) => KvCache::<f32>::with_window(w, batch, kv_heads, d_k, d_v).unwrap(),
        None => KvCache::<f32>::new(batch, kv_heads, d_k, d_v, PROMPT).unwrap(),
    };

    // The layer.
    let layer = CausalAttention::new(config, parameters.clone()).unwrap();
    let got = layer.forward_batch_with(x.view(), &opts).unwrap();
    assert_close(&got, checkpoint, &name("output"), "layer forward");
    let mut cache = new_cache();
    let prompt = layer
        .prefill(x.slice(s![.., ..PROMPT, ..]), &mut cache)
        .unwrap();
    assert_close(
        &prompt,
        checkpoint,
        &name("prefill_output"),
        "layer prefill",
    );
    let steps: Vec<Array3<f32>> = (PROMPT..len)
        .map(|t| {
            layer
                .step(x.slice(s![.., t..t + 1, ..]), &mut cache)
                .unwrap()
        })
        .collect();
    assert_close(
        &tokens(&steps),
        checkpoint,
        &name("step_output"),
        "layer steps",
    );

    // The functional API.
    let functional = Functional::new(&config, parameters);
    let [q, k, v] = functional.heads(x.view(), 0);
    let heads = scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap();
    let got = functional.output(heads);
    assert_close(&got, checkpoint, &name("output"), "functional forward");
    let mut cache = new_cache();
    let [q, k, v] = functional.heads(x.slice(s![.., ..PROMPT, ..]), 0);
    let prompt = functional.output(cache.attend(q.view(), k.view(), v.view()).unwrap());
    assert_close(
        &prompt,
        checkpoint,
        &name("prefill_output"),
        "KvCache prefill",
    );
    let mut steps = Vec::new();
    for t in PROMPT..len {
        assert_eq!(cache.total_len(), t);
        let [q, k, v] = functional.heads(x.slice(s![.., t..t + 1, ..]), t);
        steps.push(functional.output(cache.attend(q.view(), k.view(), v.view()).unwrap()));
    }
    if let Some(w) = window {
        assert_eq!(cache.len(), w, "the ring holds the window");
    }
    assert_close(
        &tokens(&steps),
        checkpoint,
        &name("step_output"),
        "KvCache steps",
    );
}

/// MistralConfig(hidden_size=32, heads 4, kv heads 2, head_dim 8,
/// rope_theta 1e6, sliding_window 4): the window is shorter than the
/// 6-token prompt, so the ring cache drops keys during the prefill and
/// every step.
#[test]
fn mistral_sliding_window_attention_decodes_as_transformers() {
    let checkpoint = fixture("hf_mistral.safetensors");
    let config = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_head_dim(8)
        .with_output_projection(32)
        .with_rope(RopeConfig::new(1e6, MAX_POSITIONS));
    let prefix = "model.layers.0.self_attn";
    let parameters = LayerParameters::load_hf_llama(&checkpoint, prefix, &config).unwrap();
    check_rotary_decoding(&checkpoint, "", config, parameters, Some(4));
}

/// GPTNeoXConfig(hidden_size=32, heads 4, partial_rotary_factor 0.5): the
/// per-head fused `query_key_value` through `load_bloom_attention`, RoPE on
/// the first 4 of each head's 8 features.
#[test]
fn gpt_neox_partial_rotary_attention_decodes_as_transformers() {
    let checkpoint = fixture("hf_gpt_neox.safetensors");
    let rope = RopeConfig::new(10_000.0, MAX_POSITIONS).with_rotary_dim(4);
    let config = AttentionConfig::new(32, 4)
        .with_output_projection(32)
        .with_bias(true)
        .with_rope(rope);
    let prefix = "gpt_neox.layers.0.attention";
    let parameters = LayerParameters::load_bloom_attention(&checkpoint, prefix, &config).unwrap();
    check_rotary_decoding(&checkpoint, "", config, parameters, None);
}

/// Gemma2Config(hidden_size=32, heads 4, kv heads 2, head_dim 8,
/// query_pre_attn_scalar 16, attn_logit_softcapping 3, sliding_window 4):
/// layer 0 slides, layer 1 is global. Gemma 2 scales by
/// `query_pre_attn_scalar^-1/2 = 1/4` (not `1/√8`), caps the scaled
/// scores, then masks: `.scale(0.25).softcap(3.0)`.
const GEMMA2_SCALE: f32 = 0.25;
const GEMMA2_CAP: f32 = 3.0;

/// One layer of a fixture model: its number, its sliding window (`None`
/// for a global layer) and the input the fixture fed it.
struct FixtureLayer<L> {
    i: usize,
    window: Option<usize>,
    layer: L,
    x: Array3<f32>,
}

impl<L> FixtureLayer<L> {
    /// The name of the layer's output in the fixture.
    fn output(&self) -> String {
        format!("layer{}.output", self.i)
    }
}

/// The Gemma 2 fixture's two layers, as `CausalAttention` layers.
fn gemma2_layers(checkpoint: &Checkpoint) -> Vec<FixtureLayer<CausalAttention<f32>>> {
    let config = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_head_dim(8)
        .with_output_projection(32)
        .with_rope(RopeConfig::new(10_000.0, MAX_POSITIONS));
    [(0, Some(4)), (1, None)]
        .into_iter()
        .map(|(i, window)| {
            let prefix = format!("model.layers.{i}.self_attn");
            let parameters = LayerParameters::load_hf_llama(checkpoint, &prefix, &config).unwrap();
            FixtureLayer {
                i,
                window,
                layer: CausalAttention::new(config, parameters).unwrap(),
                x: tensor(checkpoint, &format!("layer{i}.input")),
            }
        })
        .collect()
}

#[test]
fn gemma2_softcapped_attention_matches_transformers() {
    let checkpoint = fixture("hf_gemma2.safetensors");
    for fixture in gemma2_layers(&checkpoint) {
        let FixtureLayer { i, window, .. } = fixture;
        let with_window = |opts: AttentionOptions<'static, f32>| match window {
            Some(w) => opts.window(w),
            None => opts,
        };
        let layer = &fixture.layer;
        let opts = with_window(
            AttentionOptions::new()
                .scale(GEMMA2_SCALE)
                .softcap(GEMMA2_CAP),
        );
        let got = layer.forward_batch_with(fixture.x.view(), &opts).unwrap();
        assert_close(
            &got,
            &checkpoint,
            &fixture.output(),
            &format!("Gemma 2 layer {i}"),
        );

        // The fixture tells the orders apart: capping before scaling,
        // scale·cap·tanh(q·k/cap), is the scale-then-cap of a cap scale·cap.
        let capped_first = with_window(
            AttentionOptions::new()
                .scale(GEMMA2_SCALE)
                .softcap(GEMMA2_SCALE * GEMMA2_CAP),
        );
        let wrong = layer
            .forward_batch_with(fixture.x.view(), &capped_first)
            .unwrap();
        let difference = max_difference(&wrong, &checkpoint.tensor(&fixture.output()).unwrap());
        assert!(
            difference > 0.1,
            "layer {i}: cap then scale is off by only {difference}"
        );
    }
}

/// Softcap when decoding, through the layer: the whole-sequence output
/// equals a prefill of the first [`PROMPT`] tokens and one `step_with` per
/// token. The sliding layer runs both on a ring of its window and on a
/// growing cache with `.window()`.
#[test]
fn gemma2_softcapped_attention_decodes_as_transformers() {
    let checkpoint = fixture("hf_gemma2.safetensors");
    for fixture in gemma2_layers(&checkpoint) {
        let (layer, x) = (&fixture.layer, &fixture.x);
        let opts = AttentionOptions::new()
            .scale(GEMMA2_SCALE)
            .softcap(GEMMA2_CAP);
        let batch = x.dim().0;
        let runs = match fixture.window {
            Some(w) => vec![
                (layer.new_window_cache(batch, w).unwrap(), opts.clone()),
                (layer.new_cache(batch, 2).unwrap(), opts.clone().window(w)),
            ],
            None => vec![(layer.new_cache(batch, 2).unwrap(), opts.clone())],
        };
        for (mut cache, opts) in runs {
            let mut steps = vec![
                layer
                    .prefill_with(x.slice(s![.., ..PROMPT, ..]), &opts, &mut cache)
                    .unwrap(),
            ];
            for t in PROMPT..x.dim().1 {
                steps.push(
                    layer
                        .step_with(x.slice(s![.., t..=t, ..]), &opts, &mut cache)
                        .unwrap(),
                );
            }
            let what = format!(
                "Gemma 2 layer {} decoded, ring {:?}",
                fixture.i,
                cache.window()
            );
            assert_close(&tokens(&steps), &checkpoint, &fixture.output(), &what);
        }
    }
}

/// A gpt-oss layer written out with the functional API, its sink logits
/// and its scale.
struct GptOss {
    functional: Functional,
    sinks: Array1<f32>,
    scale: f32,
}

impl GptOss {
    /// The options every call of this layer takes.
    fn opts(&self) -> AttentionOptions<'_, f32> {
        AttentionOptions::new()
            .scale(self.scale)
            .sinks(self.sinks.as_slice().unwrap())
    }
}

/// GptOssConfig(hidden_size=32, heads 4, kv heads 2, head_dim 8,
/// sliding_window 4, its default YaRN rope): a sink logit per head, biases
/// on every projection, layer 0 sliding, layer 1 global.
///
/// YaRN's frequencies are not the default ones, so the layer's
/// `RopeConfig` cannot state them: the functional API takes the model's
/// `inv_freq` through [`RopeTable::from_inverse_frequencies`]. YaRN also
/// multiplies cos and sin by `attention_scaling` `m`, which scales every
/// `q·k` by `m²`: that goes into the scale, `m²/√d_k`.
fn gpt_oss_layers(checkpoint: &Checkpoint) -> Vec<FixtureLayer<GptOss>> {
    let config = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_head_dim(8)
        .with_output_projection(32)
        .with_bias(true);
    let inverse_frequencies: Array1<f64> = tensor(checkpoint, "rope.inv_freq");
    let m: Array1<f64> = tensor(checkpoint, "rope.attention_scaling");
    let table = RopeTable::from_inverse_frequencies(inverse_frequencies.as_slice().unwrap(), 64);
    let scale = (m[0] * m[0] / 8f64.sqrt()) as f32;
    [(0, Some(4)), (1, None)]
        .into_iter()
        .map(|(i, window)| {
            let prefix = format!("model.layers.{i}.self_attn");
            let parameters = LayerParameters::load_hf_llama(checkpoint, &prefix, &config).unwrap();
            FixtureLayer {
                i,
                window,
                layer: GptOss {
                    functional: Functional::with_table(&config, parameters, table.clone().unwrap()),
                    sinks: tensor::<f32, Ix1>(checkpoint, &format!("{prefix}.sinks")),
                    scale,
                },
                x: tensor(checkpoint, &format!("layer{i}.input")),
            }
        })
        .collect()
}

#[test]
fn gpt_oss_attention_with_sinks_matches_transformers() {
    let checkpoint = fixture("hf_gpt_oss.safetensors");
    for fixture in gpt_oss_layers(&checkpoint) {
        let GptOss { functional, .. } = &fixture.layer;
        let [q, k, v] = functional.heads(fixture.x.view(), 0);
        let opts = fixture.layer.opts();
        let opts = match fixture.window {
            Some(w) => opts.window(w),
            None => opts.causal(),
        };
        let heads = scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap();
        let what = format!("gpt-oss layer {}", fixture.i);
        assert_close(
            &functional.output(heads),
            &checkpoint,
            &fixture.output(),
            &what,
        );
    }
}

/// Sinks when decoding, through the functional form: `KvCache::prefill`
/// of the first [`PROMPT`] tokens, then one `attend_with` per token (a ring
/// of the window for the sliding layer).
#[test]
fn gpt_oss_attention_with_sinks_decodes_as_transformers() {
    let checkpoint = fixture("hf_gpt_oss.safetensors");
    for fixture in gpt_oss_layers(&checkpoint) {
        let functional = &fixture.layer.functional;
        let [q, k, v] = functional.heads(fixture.x.view(), 0);
        let opts = fixture.layer.opts();
        let (batch, kv_heads) = (k.dim().0, k.dim().1);
        let mut cache = match fixture.window {
            Some(w) => KvCache::with_window(w, batch, kv_heads, 8, 8).unwrap(),
            None => KvCache::new(batch, kv_heads, 8, 8, 2).unwrap(),
        };
        let prompt = s![.., .., ..PROMPT, ..];
        let mut heads = vec![
            cache
                .prefill(q.slice(prompt), k.slice(prompt), v.slice(prompt), &opts)
                .unwrap(),
        ];
        for t in PROMPT..fixture.x.dim().1 {
            let new = s![.., .., t..=t, ..];
            heads.push(
                cache
                    .attend_with(q.slice(new), k.slice(new), v.slice(new), &opts)
                    .unwrap(),
            );
        }
        let views: Vec<_> = heads.iter().map(|h| h.view()).collect();
        let got = functional.output(ndarray::concatenate(Axis(2), &views).unwrap());
        let what = format!("gpt-oss layer {} decoded", fixture.i);
        assert_close(&got, &checkpoint, &fixture.output(), &what);
    }
}

/// BloomConfig(hidden_size=24, n_head=6): 6 heads, not a power of two, so
/// `alibi_slopes` takes the odd terms of the 8-head sequence for the last
/// two. Sequence 1 is padded after 5 tokens.
const BLOOM_HEADS: usize = 6;
const BLOOM_LENGTHS: [usize; 2] = [7, 5];

/// The BLOOM fixture's layer and its ALiBi slopes.
fn bloom_layer(checkpoint: &Checkpoint) -> (CausalAttention<f32>, Vec<f32>) {
    let slopes = alibi_slopes(BLOOM_HEADS)
        .into_iter()
        .map(|s| s as f32)
        .collect();
    let config = AttentionConfig::new(24, BLOOM_HEADS)
        .with_output_projection(24)
        .with_bias(true);
    let prefix = "transformer.h.0.self_attention";
    let parameters = LayerParameters::load_bloom_attention(checkpoint, prefix, &config).unwrap();
    (CausalAttention::new(config, parameters).unwrap(), slopes)
}

#[test]
fn bloom_alibi_attention_matches_transformers() {
    let checkpoint = fixture("hf_bloom.safetensors");
    let (layer, slopes) = bloom_layer(&checkpoint);
    // build_alibi_tensor: [batch·heads, 1, len], slope_h · (position of key j),
    // position 0 at padding. The slopes are powers of two: exact.
    let alibi: Array3<f32> = tensor(&checkpoint, "alibi");
    for (b, &length) in BLOOM_LENGTHS.iter().enumerate() {
        for (h, &slope) in slopes.iter().enumerate() {
            for j in 0..alibi.dim().2 {
                let position = if j < length { j as f32 } else { 0.0 };
                assert_eq!(
                    alibi[[b * BLOOM_HEADS + h, 0, j]],
                    slope * position,
                    "{b} {h} {j}"
                );
            }
        }
    }
    let x: Array3<f32> = tensor(&checkpoint, "input");
    let opts = AttentionOptions::new()
        .alibi(&slopes)
        .key_lengths(&BLOOM_LENGTHS);
    let got = layer.forward_batch_with(x.view(), &opts).unwrap();
    assert_close(&got, &checkpoint, "output", "BLOOM");
}

/// ALiBi when decoding: sequence 0 (all 7 tokens real) prefilled then
/// stepped, and the right-padded batch as a padded prompt (stored
/// left-padded).
#[test]
fn bloom_alibi_attention_decodes_as_transformers() {
    let checkpoint = fixture("hf_bloom.safetensors");
    let (layer, slopes) = bloom_layer(&checkpoint);
    let x: Array3<f32> = tensor(&checkpoint, "input");
    let expected: Array3<f32> = tensor(&checkpoint, "output");
    let opts = AttentionOptions::new().alibi(&slopes);
    let mut cache = layer.new_cache(2, 2).unwrap();
    let mut steps = vec![
        layer
            .prefill_with(x.slice(s![.., ..4, ..]), &opts, &mut cache)
            .unwrap(),
    ];
    for t in 4..7 {
        steps.push(
            layer
                .step_with(x.slice(s![.., t..=t, ..]), &opts, &mut cache)
                .unwrap(),
        );
    }
    let decoded = tokens(&steps);
    let difference = max_difference(
        &decoded.slice(s![..1, .., ..]).to_owned(),
        &expected.slice(s![..1, .., ..]).to_owned().into_dyn(),
    );
    assert!(
        difference <= F32_TOLERANCE,
        "BLOOM decoded: off by {difference}"
    );
    let padded = layer
        .prefill_with(
            x.view(),
            &opts.clone().key_lengths(&BLOOM_LENGTHS),
            &mut cache,
        )
        .unwrap();
    assert_eq!(cache.key_starts(), Some(&[0, 2][..]));
    let difference = max_difference(
        &padded.slice(s![1..2, ..5, ..]).to_owned(),
        &expected.slice(s![1..2, ..5, ..]).to_owned().into_dyn(),
    );
    assert!(
        difference <= F32_TOLERANCE,
        "BLOOM right-padded prefill: off by {difference}"
    );
}
