//! PyTorch modules: three square `nn.Linear`s (the transpose trap) and
//! `nn.MultiheadAttention` (fused `in_proj_weight`, `out_proj`), plain,
//! causal and with a key padding mask.

use ndarray::{Array2, Array3, Ix2, Ix3};
use sdpa::{
    Attention, AttentionConfig, AttentionOptions, CausalAttention, LayerParameters, TorchLinear,
};

use super::{F32_TOLERANCE, fixture, max_difference, tensor};

/// Square `[out, in]` weights pass every shape check either way: loaded as
/// `nn.Linear` they give torch's output, passed raw as `[in, out]` they do not.
#[test]
fn square_linear_weights_need_the_named_layout() {
    let checkpoint = fixture("torch_linear.safetensors");
    let [q, k, v] =
        ["q.weight", "k.weight", "v.weight"].map(|n| tensor::<f32, Ix2>(&checkpoint, n));
    let x: Array2<f32> = tensor(&checkpoint, "input");
    let expected = checkpoint.tensor::<f32>("output").unwrap();
    let config = AttentionConfig::new(8, 1);

    let parameters =
        LayerParameters::from_torch_linear(&config, linear(&q), linear(&k), linear(&v), None)
            .unwrap();
    let layer = Attention::new(config, parameters).unwrap();
    let loaded = max_difference(&layer.forward(x.view()).unwrap(), &expected);
    assert!(loaded < F32_TOLERANCE, "nn.Linear layout: {loaded}");

    // The same through the checkpoint loader.
    let parameters =
        LayerParameters::load_torch_linear(&checkpoint, "", ["q", "k", "v"], None, &config)
            .unwrap();
    assert_eq!(&parameters, layer.parameters());

    // The trap: the raw [out, in] weights are square, so they are accepted
    // as [in, out], and the answer is wrong.
    let raw = Attention::new(config, LayerParameters::new(q, k, v)).unwrap();
    let wrong = max_difference(&raw.forward(x.view()).unwrap(), &expected);
    assert!(
        wrong > 0.05,
        "raw weights should not give torch's answer: {wrong}"
    );
}

fn mha() -> (sdpa::Checkpoint, AttentionConfig, LayerParameters<f32>) {
    let checkpoint = fixture("torch_mha.safetensors");
    // nn.MultiheadAttention(16, 4): 4 heads of 4, out_proj, biases.
    let config = AttentionConfig::new(16, 4)
        .with_output_projection(16)
        .with_bias(true);
    let parameters =
        LayerParameters::load_torch_multihead_attention(&checkpoint, "mha", &config).unwrap();
    (checkpoint, config, parameters)
}

#[test]
fn multihead_attention_matches_torch() {
    let (checkpoint, config, parameters) = mha();
    let x: Array3<f32> = tensor(&checkpoint, "input");
    let layer = Attention::new(config, parameters).unwrap();
    let got = layer.forward_batch(x.view()).unwrap();
    let difference = max_difference(&got, &checkpoint.tensor("output").unwrap());
    assert!(difference < F32_TOLERANCE, "{difference}");
}

#[test]
fn multihead_attention_with_a_causal_mask_matches_torch() {
    let (checkpoint, config, parameters) = mha();
    let x: Array3<f32> = tensor(&checkpoint, "input");
    let layer = CausalAttention::new(config, parameters).unwrap();
    let got = layer.forward_batch(x.view()).unwrap();
    let difference = max_difference(&got, &checkpoint.tensor("output_causal").unwrap());
    assert!(difference < F32_TOLERANCE, "{difference}");
}

/// torch's `key_padding_mask` (`true` = ignore) is the crate's key lengths.
#[test]
fn multihead_attention_with_key_padding_matches_torch() {
    let (checkpoint, config, parameters) = mha();
    let x: Array3<f32> = tensor(&checkpoint, "input");
    let layer = Attention::new(config, parameters).unwrap();
    let options = AttentionOptions::new().key_lengths(&[5, 3]);
    let got = layer.forward_batch_with(x.view(), &options).unwrap();
    let difference = max_difference(&got, &checkpoint.tensor("output_padded").unwrap());
    assert!(difference < F32_TOLERANCE, "{difference}");
}

/// The array constructor and the checkpoint loader agree, and the fused
/// weight is split into rows 0..16, 16..32, 32..48.
#[test]
fn multihead_attention_from_arrays_is_the_same() {
    let (checkpoint, config, parameters) = mha();
    let in_proj: Array2<f32> = tensor(&checkpoint, "mha.in_proj_weight");
    let in_bias = tensor::<f32, ndarray::Ix1>(&checkpoint, "mha.in_proj_bias");
    let out: Array2<f32> = tensor(&checkpoint, "mha.out_proj.weight");
    let out_bias = tensor::<f32, ndarray::Ix1>(&checkpoint, "mha.out_proj.bias");
    let from_arrays = LayerParameters::from_torch_multihead_attention(
        &config,
        in_proj.view(),
        Some(in_bias.view()),
        Some(TorchLinear::new(out.view()).with_bias(out_bias.view())),
    )
    .unwrap();
    assert_eq!(from_arrays, parameters);
    assert_eq!(parameters.w_v, in_proj.slice(ndarray::s![32..48, ..]).t());
    assert_eq!(
        parameters.b_k.as_ref().unwrap(),
        &in_bias.slice(ndarray::s![16..32])
    );
    assert_eq!(parameters.w_o.as_ref().unwrap(), &out.t());
    let _: Array3<f32> = tensor::<f32, Ix3>(&checkpoint, "output");
}

fn linear(w: &Array2<f32>) -> TorchLinear<'_, f32> {
    TorchLinear::new(w.view())
}
