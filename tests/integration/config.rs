//! `AttentionConfig`: heads and the model width give the head width unless
//! it is set; a width the heads do not divide is an error when a layer is
//! built; equality is over the resolved widths; serde round trips.

use sdpa::{Attention, AttentionConfig, CausalAttention, ErrorKind};

#[test]
fn heads_divide_the_model_width() {
    let config = AttentionConfig::new(64, 4);
    assert_eq!((config.d_k(), config.d_v(), config.kv_heads), (16, 16, 4));
    let layer = Attention::<f32>::new_seeded(config, 0).unwrap();
    assert_eq!(layer.parameters().w_q.dim(), (64, 64));
    // The head width follows later changes to heads or width.
    assert_eq!(config.with_heads(8).d_k(), 8);
    assert_eq!(config.with_d_model(128).d_k(), 32);
    // Unless it is explicit.
    let wide = config.with_head_dim(32);
    assert_eq!((wide.with_heads(8).d_k(), wide.d_v()), (32, 32));
    assert_eq!(wide.with_value_dim(5).d_v(), 5);
}

#[test]
fn a_width_the_heads_do_not_divide_is_an_error() {
    for config in [AttentionConfig::new(10, 4), AttentionConfig::new(64, 3)] {
        let err = Attention::<f32>::new_seeded(config, 0).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::HeadsNotDivisible, "{err}");
        assert!(err.to_string().contains("with_head_dim"), "{err}");
        let err = CausalAttention::<f64>::new_seeded(config, 0).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::HeadsNotDivisible, "{err}");
    }
    // With an explicit head width, it builds.
    Attention::<f32>::new_seeded(AttentionConfig::new(10, 4).with_head_dim(3), 0).unwrap();
    // Zero heads is an error, not a division by zero.
    let config = AttentionConfig::new(8, 0);
    assert_eq!(config.d_k(), 0);
    let err = Attention::<f32>::new_seeded(config, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ZeroDimension);
}

#[test]
fn configs_of_the_same_layer_are_equal() {
    use std::collections::HashSet;
    let implicit = AttentionConfig::new(64, 4);
    let explicit = AttentionConfig::new(64, 4)
        .with_head_dim(16)
        .with_value_dim(16);
    assert_eq!(implicit, explicit);
    let set: HashSet<_> = [implicit, explicit].into_iter().collect();
    assert_eq!(set.len(), 1);
    assert_ne!(implicit, implicit.with_head_dim(8));
    assert_ne!(
        AttentionConfig::new(10, 4),
        AttentionConfig::new(10, 4).with_head_dim(2)
    );
}

#[cfg(feature = "serde")]
#[test]
fn configs_round_trip_through_serde() {
    let config = AttentionConfig::new(512, 8)
        .with_kv_heads(2)
        .with_head_dim(128)
        .with_output_projection(512)
        .with_bias(true);
    let json = serde_json::to_string(&config).unwrap();
    assert!(json.contains("\"head_dim\":128"), "{json}");
    let back: AttentionConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, config);
    assert_eq!(back.d_k(), 128);
}
