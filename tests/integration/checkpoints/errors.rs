//! Every mismatch between a checkpoint and a config is an error naming the
//! tensor (with its prefix) and both shapes, never a panic or a silently
//! wrong layer: a wrong prefix, wrong head counts, an element type not read,
//! biases or an output projection the config does not expect (or misses),
//! grouped heads in a projection fused per head, a tensor of the wrong
//! rank, and files that are not safetensors.

use sdpa::{AttentionConfig, Checkpoint, ErrorKind, LayerParameters};

use super::fixture;

fn llama() -> AttentionConfig {
    AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_output_projection(32)
}

fn assert_error<T: std::fmt::Debug>(
    result: Result<T, sdpa::AttentionError>,
    kind: ErrorKind,
    needles: &[&str],
) {
    let err = result.unwrap_err();
    assert_eq!(err.kind(), kind, "{err}");
    for needle in needles {
        assert!(err.to_string().contains(needle), "{needle:?} not in: {err}");
    }
}

/// The bytes of a safetensors file (8-byte header length, JSON header,
/// data), written out here to make files torch would not.
fn safetensors_bytes(tensors: &[(&str, &[usize], &[f32])]) -> Vec<u8> {
    let mut header = Vec::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.push(format!(
            "\"{name}\":{{\"dtype\":\"F32\",\"shape\":{shape:?},\"data_offsets\":[{start},{}]}}",
            data.len()
        ));
    }
    let mut header = format!("{{{}}}", header.join(",")).into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend(data);
    bytes
}

#[test]
fn a_wrong_prefix_names_the_tensor_and_lists_those_there() {
    let checkpoint = fixture("hf_llama.safetensors");
    let result =
        LayerParameters::<f32>::load_hf_llama(&checkpoint, "model.layers.0.self_attn", &llama());
    assert_error(
        result,
        ErrorKind::MissingTensor,
        &[
            "`model.layers.0.self_attn.q_proj.weight`",
            "attn.q_proj.weight",
        ],
    );
}

#[test]
fn wrong_head_counts_name_the_tensor_and_both_shapes() {
    let checkpoint = fixture("torch_mha.safetensors");
    let config = AttentionConfig::new(8, 2)
        .with_output_projection(8)
        .with_bias(true);
    let result =
        LayerParameters::<f32>::load_torch_multihead_attention(&checkpoint, "mha", &config);
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["`mha.in_proj_weight`", "[48, 16]", "[24, 8]"],
    );
    // GPT-2 with 8 heads of 4 instead of 4 heads of 4.
    let checkpoint = fixture("hf_gpt2.safetensors");
    let config = AttentionConfig::new(16, 8)
        .with_head_dim(4)
        .with_kv_heads(8);
    let config = config.with_output_projection(16).with_bias(true);
    let result = LayerParameters::<f64>::load_gpt2_attention(&checkpoint, "attn", &config);
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["`attn.c_attn.weight`", "[16, 48]", "[16, 96]"],
    );
}

/// BLOOM's `query_key_value` is fused per head: it has no room for grouped
/// key/value heads, and its rows must be `3·heads·d_k`.
#[test]
fn a_per_head_fused_projection_checks_its_heads() {
    let checkpoint = fixture("hf_bloom.safetensors");
    let prefix = "transformer.h.0.self_attention";
    let bloom = AttentionConfig::new(24, 6)
        .with_output_projection(24)
        .with_bias(true);
    let grouped =
        LayerParameters::<f32>::load_bloom_attention(&checkpoint, prefix, &bloom.with_kv_heads(2));
    assert_error(
        grouped,
        ErrorKind::ShapeMismatch,
        &[
            "`transformer.h.0.self_attention.query_key_value.weight`",
            "grouped",
        ],
    );
    let wide =
        LayerParameters::<f32>::load_bloom_attention(&checkpoint, prefix, &bloom.with_head_dim(8));
    assert_error(
        wide,
        ErrorKind::ShapeMismatch,
        &[
            "`transformer.h.0.self_attention.query_key_value.weight`",
            "[72, 24]",
            "[144, 24]",
        ],
    );
}

#[test]
#[cfg(feature = "half")]
fn a_half_precision_tensor_loads_exactly() {
    // `half.weight` is `q.weight.to(torch.bfloat16)`.
    let checkpoint = fixture("torch_linear.safetensors");
    let half = checkpoint.tensor::<f32>("half.weight").unwrap();
    let full = checkpoint.tensor::<f32>("q.weight").unwrap();
    let rounded = full.mapv(|x| f32::from(sdpa::half::bf16::from_f32(x)));
    assert_eq!(half, rounded);
    let config = AttentionConfig::new(8, 1);
    let parameters = LayerParameters::<f32>::load_torch_linear(
        &checkpoint,
        "",
        ["half", "k", "v"],
        None,
        &config,
    )
    .unwrap();
    assert_eq!(
        parameters.w_q,
        rounded.into_dimensionality::<ndarray::Ix2>().unwrap().t()
    );
}

#[test]
#[cfg(not(feature = "half"))]
fn a_half_precision_tensor_names_its_dtype() {
    let checkpoint = fixture("torch_linear.safetensors");
    assert_error(
        checkpoint.tensor::<f32>("half.weight"),
        ErrorKind::UnsupportedDtype,
        &["`half.weight`", "BF16", "[8, 8]"],
    );
    let config = AttentionConfig::new(8, 1);
    let result = LayerParameters::<f32>::load_torch_linear(
        &checkpoint,
        "",
        ["half", "k", "v"],
        None,
        &config,
    );
    assert_error(result, ErrorKind::UnsupportedDtype, &["half.weight"]);
}

#[test]
fn biases_the_config_does_not_have_are_an_error() {
    let checkpoint = fixture("hf_qwen2.safetensors");
    let result = LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &llama());
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["attn.q_proj.bias", "with_bias(true)"],
    );
    // And a config with biases for a file with none.
    let checkpoint = fixture("hf_llama.safetensors");
    let result =
        LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &llama().with_bias(true));
    assert_error(result, ErrorKind::MissingTensor, &["bias"]);
}

#[test]
fn an_output_projection_the_config_does_not_have_is_an_error() {
    let checkpoint = fixture("hf_llama.safetensors");
    let config = AttentionConfig::new(32, 4).with_kv_heads(2);
    let result = LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &config);
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["attn.o_proj.weight", "with_output_projection(32)"],
    );
    let checkpoint = fixture("torch_mha.safetensors");
    let config = AttentionConfig::new(16, 4).with_bias(true);
    let result =
        LayerParameters::<f32>::load_torch_multihead_attention(&checkpoint, "mha", &config);
    assert_error(result, ErrorKind::ShapeMismatch, &["mha.out_proj.weight"]);
    // A config with one where the file has none.
    let checkpoint = fixture("torch_linear.safetensors");
    let config = AttentionConfig::new(8, 1).with_output_projection(8);
    let result = LayerParameters::<f32>::load_torch_linear(
        &checkpoint,
        "",
        ["q", "k", "v"],
        Some("o"),
        &config,
    );
    assert_error(result, ErrorKind::MissingTensor, &["`o.weight`"]);
}

#[test]
fn a_config_that_is_not_a_layer_is_an_error() {
    let checkpoint = fixture("hf_llama.safetensors");
    let result =
        LayerParameters::<f32>::load_hf_llama(&checkpoint, "attn", &AttentionConfig::new(30, 4));
    assert_error(result, ErrorKind::HeadsNotDivisible, &["with_head_dim"]);
}

#[test]
fn a_tensor_of_the_wrong_rank_is_named() {
    let bytes = safetensors_bytes(&[
        ("q.weight", &[4], &[1.0; 4]),
        ("k.weight", &[2, 2], &[1.0; 4]),
        ("v.weight", &[2, 2], &[1.0; 4]),
    ]);
    let checkpoint = Checkpoint::from_bytes(bytes).unwrap();
    assert_eq!(checkpoint.names(), ["k.weight", "q.weight", "v.weight"]);
    let config = AttentionConfig::new(2, 1);
    let result =
        LayerParameters::<f32>::load_torch_linear(&checkpoint, "", ["q", "k", "v"], None, &config);
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["`q.weight`", "[4]", "rank 2"],
    );
}

#[test]
fn files_that_are_not_safetensors_are_an_error() {
    let result = Checkpoint::from_file("tests/fixtures/no-such-file.safetensors");
    assert_error(result, ErrorKind::Checkpoint, &["no-such-file.safetensors"]);
    assert_error(
        Checkpoint::from_bytes(Vec::new()),
        ErrorKind::Checkpoint,
        &["not a valid"],
    );
    let path = format!(
        "{}/tests/fixtures/hf_llama.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let bytes = std::fs::read(path).unwrap();
    for cut in [1, 8, 100, bytes.len() - 1] {
        let result = Checkpoint::from_bytes(&bytes[..cut]);
        assert_error(result, ErrorKind::Checkpoint, &["not a valid"]);
    }
    // A header claiming more data than there is.
    let mut bytes = safetensors_bytes(&[("w", &[2, 2], &[1.0; 4])]);
    bytes.truncate(bytes.len() - 4);
    assert_error(
        Checkpoint::from_bytes(bytes),
        ErrorKind::Checkpoint,
        &["not a valid"],
    );
}
