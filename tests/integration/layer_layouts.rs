//! `LayerParameters` from other frameworks' layouts, from arrays (no
//! feature needed): `nn.Linear` weights are transposed, fused
//! `in_proj_weight` (rows) and GPT-2 `c_attn` (columns) are split at the
//! config's widths, grouped-query heads included, and biases follow the
//! config.

use ndarray::{Array1, Array2, s};
use sdpa::{Attention, AttentionConfig, ErrorKind, LayerParameters, TorchLinear};

fn counting(rows: usize, columns: usize) -> Array2<f64> {
    Array2::from_shape_fn((rows, columns), |(i, j)| (i * columns + j) as f64)
}

#[test]
fn torch_linear_weights_are_transposed() {
    // 4 heads of 2 over 8, 2 key/value heads, W^O back to 6.
    let config = AttentionConfig::new(8, 4)
        .with_kv_heads(2)
        .with_output_projection(6);
    let (q, k, v, o) = (
        counting(8, 8),
        counting(4, 8),
        counting(4, 8),
        counting(6, 8),
    );
    let parameters = LayerParameters::from_torch_linear(
        &config,
        linear(&q),
        linear(&k),
        linear(&v),
        Some(linear(&o)),
    )
    .unwrap();
    assert_eq!(parameters.w_q, q.t());
    assert_eq!(parameters.w_k, k.t());
    assert_eq!(parameters.w_v, v.t());
    assert_eq!(parameters.w_o.as_ref().unwrap(), &o.t());
    assert!(parameters.w_q.is_standard_layout());
    Attention::new(config, parameters).unwrap();
}

#[test]
fn a_transposed_linear_weight_is_named_with_both_shapes() {
    let config = AttentionConfig::new(8, 4).with_kv_heads(2);
    let (q, k) = (counting(8, 8), counting(4, 8));
    let k_t = k.t();
    let result = LayerParameters::from_torch_linear(
        &config,
        TorchLinear::new(q.view()),
        TorchLinear::new(k_t),
        TorchLinear::new(k.view()),
        None,
    );
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    let message = err.to_string();
    assert!(
        message.contains("`k.weight` has shape [8, 4], expected [4, 8]"),
        "{message}"
    );
    assert!(message.contains("[out, in]"), "{message}");
}

#[test]
fn a_fused_grouped_query_projection_is_split_at_the_config_widths() {
    // 4 query heads of 2, 1 key/value head: q 8 rows, k 2, v 2.
    let config = AttentionConfig::new(8, 4).with_kv_heads(1).with_bias(true);
    let (weight, bias) = (counting(12, 8), Array1::from_iter((0..12).map(f64::from)));
    let parameters = LayerParameters::from_torch_multihead_attention(
        &config,
        weight.view(),
        Some(bias.view()),
        None,
    )
    .unwrap();
    assert_eq!(parameters.w_q, weight.slice(s![0..8, ..]).t());
    assert_eq!(parameters.w_k, weight.slice(s![8..10, ..]).t());
    assert_eq!(parameters.w_v, weight.slice(s![10..12, ..]).t());
    assert_eq!(parameters.b_v.unwrap(), bias.slice(s![10..12]));
    // GPT-2's Conv1D stacks the same along columns, already [in, out].
    let c_attn = weight.t().to_owned();
    let gpt2 = LayerParameters::from_gpt2_conv1d(&config, (c_attn.view(), Some(bias.view())), None)
        .unwrap();
    assert_eq!(gpt2.w_k, c_attn.slice(s![.., 8..10]));
    assert_eq!(gpt2.w_q, parameters.w_q);
}

#[test]
fn missing_biases_are_zero_when_the_config_has_biases() {
    let config = AttentionConfig::new(4, 2).with_bias(true);
    let w = Array2::<f32>::eye(4);
    let b_q = Array1::<f32>::ones(4);
    let q = TorchLinear::new(w.view()).with_bias(b_q.view());
    let parameters = LayerParameters::from_torch_linear(
        &config,
        q,
        TorchLinear::new(w.view()),
        TorchLinear::new(w.view()),
        None,
    )
    .unwrap();
    assert_eq!(parameters.b_q.unwrap(), b_q);
    assert_eq!(parameters.b_k.unwrap(), Array1::<f32>::zeros(4));
    // Without biases in the config, a given bias is an error naming it.
    let q = TorchLinear::new(w.view()).with_bias(b_q.view());
    let err = LayerParameters::from_torch_linear(
        &config.with_bias(false),
        q,
        TorchLinear::new(w.view()),
        TorchLinear::new(w.view()),
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("`q.bias`"), "{err}");
}

#[test]
fn a_fused_projection_needs_one_input_width() {
    let config = AttentionConfig::new(4, 2).with_d_model_kv(6);
    let weight = counting(12, 4);
    let err = LayerParameters::from_torch_multihead_attention(&config, weight.view(), None, None)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    assert!(err.to_string().contains("in_proj_weight"), "{err}");
}

fn linear(w: &Array2<f64>) -> TorchLinear<'_, f64> {
    TorchLinear::new(w.view())
}
