//! The layer types `Attention` and `CausalAttention`: output against a
//! hand-projected reference on `sdpa::core` (single-head, then multi-head
//! with grouped key/value heads, cross-attention, biases and an output
//! projection), f32 against f64, batch against per-item, causality, seeded
//! initialisation, and one test per bad shape.

use approx::assert_abs_diff_eq;
use ndarray::{Array2, Array3, Array4, ArrayView2, ArrayView3, Axis, s};
use proptest::prelude::*;
use sdpa::{
    Attention, AttentionConfig, AttentionError, AttentionOptions, CausalAlignment, CausalAttention,
    ErrorKind, LayerParameters,
};

/// The layer written out: project each position with `.dot`, then the
/// reference attention on `[batch, 1, len, d]`.
fn reference(
    w_q: ArrayView2<'_, f64>,
    w_k: ArrayView2<'_, f64>,
    w_v: ArrayView2<'_, f64>,
    x: ArrayView3<'_, f64>,
    opts: &AttentionOptions<'_, f64>,
) -> Array3<f64> {
    let (batch, len, _) = x.dim();
    let project = |w: ArrayView2<'_, f64>| {
        Array4::from_shape_fn((batch, 1, len, w.ncols()), |(b, _, i, c)| {
            x.slice(s![b, i, ..]).dot(&w.column(c))
        })
    };
    let out = sdpa::core::scaled_dot_product_attention(
        project(w_q).view(),
        project(w_k).view(),
        project(w_v).view(),
        opts,
    )
    .unwrap();
    out.index_axis_move(Axis(1), 0)
}

fn array3(shape: (usize, usize, usize)) -> impl Strategy<Value = Array3<f64>> {
    prop::collection::vec(-1.5..1.5_f64, shape.0 * shape.1 * shape.2)
        .prop_map(move |data| Array3::from_shape_vec(shape, data).unwrap())
}

/// A config (sizes 1 to 6) and a batch of inputs for it (batch 1 to 3, len 0 to 6).
fn config_and_input() -> impl Strategy<Value = (AttentionConfig, Array3<f64>)> {
    (1..7_usize, 1..7_usize, 1..7_usize, 1..4_usize, 0..7_usize).prop_flat_map(
        |(d_model, d_k, d_v, batch, len)| {
            (
                Just(
                    AttentionConfig::new(d_model, 1)
                        .with_head_dim(d_k)
                        .with_value_dim(d_v),
                ),
                array3((batch, len, d_model)),
            )
        },
    )
}

proptest! {
    #[test]
    fn attention_matches_the_reference((config, x) in config_and_input(), seed in any::<u64>()) {
        let layer = Attention::<f64>::new_seeded(config, seed).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let expected = reference(layer.parameters().w_q.view(), layer.parameters().w_k.view(), layer.parameters().w_v.view(), x.view(), &AttentionOptions::new());
        prop_assert_eq!(y.dim(), (x.dim().0, x.dim().1, config.d_v()));
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn causal_attention_matches_the_causal_reference((config, x) in config_and_input(), seed in any::<u64>()) {
        let layer = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let expected = reference(layer.parameters().w_q.view(), layer.parameters().w_k.view(), layer.parameters().w_v.view(), x.view(), &AttentionOptions::new().causal());
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn options_reach_the_attention((config, x) in config_and_input(), seed in any::<u64>(), variant in 0..4_usize) {
        let (batch, len, _) = x.dim();
        let layer = Attention::<f64>::new_seeded(config, seed).unwrap();
        let keep = Array4::from_shape_fn((batch, 1, len, len), |(b, _, i, j)| !(b + 2 * i + 3 * j + seed as usize).is_multiple_of(3));
        let bias = Array4::from_shape_fn((1, 1, len, len), |(_, _, i, j)| -0.5 * (i as f64 - j as f64).abs());
        let lengths: Vec<usize> = (0..batch).map(|b| (b + seed as usize) % (len + 1)).collect();
        let opts = match variant {
            0 => AttentionOptions::new().keep_mask(keep.view()),
            1 => AttentionOptions::new().bias(bias.view()).scale(0.25),
            2 => AttentionOptions::new().key_lengths(&lengths),
            _ => AttentionOptions::new().causal().bias(bias.view()),
        };
        let y = layer.forward_batch_with(x.view(), &opts).unwrap();
        let expected = reference(layer.parameters().w_q.view(), layer.parameters().w_k.view(), layer.parameters().w_v.view(), x.view(), &opts);
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn causal_options_add_to_the_causal_rule((config, x) in config_and_input(), seed in any::<u64>()) {
        let (batch, len, _) = x.dim();
        let layer = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        let lengths: Vec<usize> = (0..batch).map(|b| (b * 5 + seed as usize) % (len + 1)).collect();
        let opts = AttentionOptions::new().key_lengths(&lengths);
        let y = layer.forward_batch_with(x.view(), &opts).unwrap();
        let expected = reference(layer.parameters().w_q.view(), layer.parameters().w_k.view(), layer.parameters().w_v.view(), x.view(), &opts.clone().causal());
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn f32_agrees_with_f64((config, x) in config_and_input(), seed in any::<u64>(), causal in any::<bool>()) {
        let x32 = x.mapv(|v| v as f32);
        let (y32, y64) = if causal {
            let l32 = CausalAttention::<f32>::new_seeded(config, seed).unwrap();
            let l64 = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
            (l32.forward_batch(x32.view()).unwrap(), l64.forward_batch(x.view()).unwrap())
        } else {
            let l32 = Attention::<f32>::new_seeded(config, seed).unwrap();
            let l64 = Attention::<f64>::new_seeded(config, seed).unwrap();
            (l32.forward_batch(x32.view()).unwrap(), l64.forward_batch(x.view()).unwrap())
        };
        assert_abs_diff_eq!(y32.mapv(f64::from), y64, epsilon = 2e-4);
    }

    #[test]
    fn batch_forward_equals_per_item_forward((config, x) in config_and_input(), seed in any::<u64>()) {
        let bidirectional = Attention::<f64>::new_seeded(config, seed).unwrap();
        let causal = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        let y = bidirectional.forward_batch(x.view()).unwrap();
        let y_causal = causal.forward_batch(x.view()).unwrap();
        for (b, item) in x.outer_iter().enumerate() {
            assert_abs_diff_eq!(y.index_axis(Axis(0), b), bidirectional.forward(item).unwrap(), epsilon = 1e-14);
            assert_abs_diff_eq!(y_causal.index_axis(Axis(0), b), causal.forward(item).unwrap(), epsilon = 1e-14);
        }
    }

    #[test]
    fn causal_rows_ignore_later_inputs(
        (config, x) in config_and_input(),
        seed in any::<u64>(),
        cut in any::<prop::sample::Index>(),
        noise in prop_oneof![Just(f64::NAN), Just(f64::INFINITY), -50.0..50.0_f64],
    ) {
        let len = x.dim().1;
        if len == 0 {
            return Ok(());
        }
        // Outputs 0..=cut must not see inputs cut+1.. .
        let cut = cut.index(len);
        let layer = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let mut changed = x.clone();
        changed.slice_mut(s![.., cut + 1.., ..]).fill(noise);
        let y_changed = layer.forward_batch(changed.view()).unwrap();
        // Not bitwise: with a non-finite value anywhere, `core` sums the
        // visible values one by one instead of by a matrix product.
        assert_abs_diff_eq!(y.slice(s![.., ..=cut, ..]), y_changed.slice(s![.., ..=cut, ..]), epsilon = 1e-12);
    }

    #[test]
    fn bidirectional_is_permutation_equivariant((config, x) in config_and_input(), seed in any::<u64>(), shift in 0..6_usize) {
        let len = x.dim().1;
        if len == 0 {
            return Ok(());
        }
        let layer = Attention::<f64>::new_seeded(config, seed).unwrap();
        let order: Vec<usize> = (0..len).map(|i| (i + shift) % len).collect();
        let y = layer.forward_batch(x.view()).unwrap();
        let y_permuted = layer.forward_batch(x.select(Axis(1), &order).view()).unwrap();
        assert_abs_diff_eq!(y.select(Axis(1), &order), y_permuted, epsilon = 1e-12);
    }

    #[test]
    fn strided_input_equals_contiguous((config, x) in config_and_input(), seed in any::<u64>()) {
        let layer = Attention::<f64>::new_seeded(config, seed).unwrap();
        // The same input stored as [d_model, len, batch], read through a permuted view.
        let stored = x.view().permuted_axes([2, 1, 0]).to_owned();
        let strided = stored.view().permuted_axes([2, 1, 0]);
        assert_eq!(strided, x.view());
        let y = layer.forward_batch(strided).unwrap();
        assert_abs_diff_eq!(y, layer.forward_batch(x.view()).unwrap(), epsilon = 1e-12);
        // Every other position of a longer sequence: a sliced, non-contiguous view.
        let item = x.index_axis(Axis(0), 0);
        let doubled = Array2::from_shape_fn((2 * item.nrows(), item.ncols()), |(i, c)| if i % 2 == 0 { item[[i / 2, c]] } else { f64::NAN });
        let y_sliced = layer.forward(doubled.slice(s![..;2, ..])).unwrap();
        assert_abs_diff_eq!(y_sliced, layer.forward(item).unwrap(), epsilon = 1e-12);
    }

    #[test]
    fn seeded_weights_are_deterministic_and_within_the_xavier_bound(
        d_model in 1..40_usize, d_k in 1..40_usize, d_v in 1..40_usize, seed in any::<u64>(),
    ) {
        let config = AttentionConfig::new(d_model, 1).with_head_dim(d_k).with_value_dim(d_v);
        let a = Attention::<f64>::new_seeded(config, seed).unwrap();
        let b = Attention::<f64>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(a.config(), config);
        prop_assert_eq!(a.parameters().w_q.view().dim(), (d_model, d_k));
        prop_assert_eq!(a.parameters().w_k.view().dim(), (d_model, d_k));
        prop_assert_eq!(a.parameters().w_v.view().dim(), (d_model, d_v));
        let bound_qk = (6.0 / (d_model + d_k) as f64).sqrt();
        let bound_v = (6.0 / (d_model + d_v) as f64).sqrt();
        prop_assert!(a.parameters().w_q.view().iter().chain(a.parameters().w_k.view().iter()).all(|w| w.abs() <= bound_qk));
        prop_assert!(a.parameters().w_v.view().iter().all(|w| w.abs() <= bound_v));
        // The same draws, rounded, for f32; and the causal layer gets them too.
        let a32 = Attention::<f32>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(a32.parameters().w_q.view(), a.parameters().w_q.view().mapv(|w| w as f32));
        prop_assert_eq!(a32.parameters().w_v.view(), a.parameters().w_v.view().mapv(|w| w as f32));
        let causal = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(causal.parameters().w_k.view(), a.parameters().w_k.view());
    }
}

#[test]
fn seeded_weights_fill_the_xavier_interval() {
    let config = AttentionConfig::new(64, 1).with_value_dim(32);
    let layer = Attention::<f64>::new_seeded(config, 2024).unwrap();
    let bound = (6.0_f64 / 128.0).sqrt();
    let w = layer.parameters().w_q.view();
    let n = w.len() as f64;
    let mean = w.sum() / n;
    let variance = w.mapv(|x| (x - mean).powi(2)).sum() / n;
    // U(−a, a) has mean 0 and variance a²/3; 4096 draws pin both down well.
    assert!(mean.abs() < 0.05 * bound, "mean {mean}");
    assert_abs_diff_eq!(
        variance,
        bound * bound / 3.0,
        epsilon = 0.05 * bound * bound
    );
    assert!(w.iter().any(|&x| x > 0.95 * bound) && w.iter().any(|&x| x < -0.95 * bound));
}

#[test]
fn different_seeds_give_different_weights() {
    let config = AttentionConfig::new(8, 1).with_head_dim(4);
    let a = Attention::<f32>::new_seeded(config, 1).unwrap();
    let b = Attention::<f32>::new_seeded(config, 2).unwrap();
    assert_ne!(a.parameters().w_q.view(), b.parameters().w_q.view());
    // W^Q, W^K and W^V are different draws from one stream.
    assert_ne!(a.parameters().w_q.view(), a.parameters().w_k.view());
}

#[test]
fn from_projections_keeps_the_weights_and_reads_the_config() {
    let w_q = Array2::from_shape_fn((3, 2), |(i, j)| (i * 2 + j) as f64);
    let w_k = Array2::from_shape_fn((3, 2), |(i, j)| (i + j) as f64 * 0.5);
    let w_v = Array2::from_shape_fn((3, 5), |(i, j)| (i * j) as f64 - 1.0);
    let layer = Attention::from_projections(w_q.clone(), w_k.clone(), w_v.clone()).unwrap();
    assert_eq!(
        layer.config(),
        AttentionConfig::new(3, 1)
            .with_head_dim(2)
            .with_value_dim(5)
    );
    assert_eq!(layer.parameters().w_q.view(), w_q);
    assert_eq!(layer.parameters().w_k.view(), w_k);
    assert_eq!(layer.parameters().w_v.view(), w_v);
    let causal = CausalAttention::from_projections(w_q, w_k, w_v).unwrap();
    assert_eq!(causal.config(), layer.config());
}

#[test]
fn hand_computed_single_position_is_its_value() {
    // One position attends only to itself: y = x·W^V whatever W^Q and W^K are.
    let w_q = Array2::from_elem((2, 2), 3.0_f64);
    let w_k = Array2::from_elem((2, 2), -1.0_f64);
    let w_v = ndarray::array![[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]];
    let layer = Attention::from_projections(w_q, w_k, w_v).unwrap();
    let x = ndarray::array![[1.0, -1.0]];
    assert_eq!(
        layer.forward(x.view()).unwrap(),
        ndarray::array![[-3.0, -3.0, -3.0]]
    );
}

#[test]
fn attention_with_causal_options_equals_causal_attention() {
    let config = AttentionConfig::new(5, 1)
        .with_head_dim(3)
        .with_value_dim(4);
    let bidirectional = Attention::<f64>::new_seeded(config, 11).unwrap();
    let causal = CausalAttention::<f64>::new_seeded(config, 11).unwrap();
    let x = Array2::from_shape_fn((6, 5), |(i, j)| ((i * 5 + j) % 7) as f64 * 0.3 - 1.0);
    let y_causal = causal.forward(x.view()).unwrap();
    assert_eq!(
        bidirectional
            .forward_with(x.view(), &AttentionOptions::new().causal())
            .unwrap(),
        y_causal
    );
    assert_ne!(bidirectional.forward(x.view()).unwrap(), y_causal);
    // An alignment asked of a causal layer changes nothing in self-attention.
    let top_left = AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft);
    assert_eq!(causal.forward_with(x.view(), &top_left).unwrap(), y_causal);
}

#[test]
fn config_setters_replace_one_field() {
    let config = AttentionConfig::new(1, 1)
        .with_head_dim(2)
        .with_value_dim(3)
        .with_d_model(10)
        .with_head_dim(20)
        .with_value_dim(30);
    assert_eq!((config.d_model, config.d_k(), config.d_v()), (10, 20, 30));
}

#[test]
fn empty_sequence_and_empty_batch_are_valid() {
    let layer = CausalAttention::<f32>::new_seeded(
        AttentionConfig::new(4, 1)
            .with_head_dim(3)
            .with_value_dim(2),
        0,
    )
    .unwrap();
    let empty_sequence = Array2::<f32>::zeros((0, 4));
    assert_eq!(layer.forward(empty_sequence.view()).unwrap().dim(), (0, 2));
    let empty_batch = Array3::<f32>::zeros((0, 5, 4));
    assert_eq!(
        layer.forward_batch(empty_batch.view()).unwrap().dim(),
        (0, 5, 2)
    );
    let empty_items = Array3::<f32>::zeros((3, 0, 4));
    assert_eq!(
        layer.forward_batch(empty_items.view()).unwrap().dim(),
        (3, 0, 2)
    );
}

// --- errors, one test per case ----------------------------------------------

fn assert_error(
    result: Result<impl std::fmt::Debug, AttentionError>,
    kind: ErrorKind,
    parts: &[&str],
) {
    let err = result.unwrap_err();
    assert_eq!(err.kind(), kind, "{err}");
    let message = err.to_string();
    for part in parts {
        assert!(message.contains(part), "{message:?} does not name {part:?}");
    }
}

#[test]
fn from_projections_w_k_rows_differ() {
    let result = Attention::from_projections(
        Array2::<f64>::zeros((4, 2)),
        Array2::zeros((3, 2)),
        Array2::zeros((4, 2)),
    );
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["d_model", "[4, 2]", "[3, 2]"],
    );
}

#[test]
fn from_projections_w_v_rows_differ() {
    let result = CausalAttention::from_projections(
        Array2::<f64>::zeros((4, 2)),
        Array2::zeros((4, 2)),
        Array2::zeros((5, 3)),
    );
    assert_error(result, ErrorKind::ShapeMismatch, &["d_model", "[5, 3]"]);
}

#[test]
fn from_projections_d_k_columns_differ() {
    let result = Attention::from_projections(
        Array2::<f32>::zeros((4, 2)),
        Array2::zeros((4, 3)),
        Array2::zeros((4, 2)),
    );
    assert_error(
        result,
        ErrorKind::ShapeMismatch,
        &["d_k", "[4, 2]", "[4, 3]"],
    );
}

#[test]
fn from_projections_zero_d_model() {
    let result = Attention::from_projections(
        Array2::<f64>::zeros((0, 2)),
        Array2::zeros((0, 2)),
        Array2::zeros((0, 2)),
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_model", "[0, 2]"]);
}

#[test]
fn from_projections_zero_d_k() {
    let result = Attention::from_projections(
        Array2::<f64>::zeros((3, 0)),
        Array2::zeros((3, 0)),
        Array2::zeros((3, 2)),
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_k", "[3, 0]"]);
}

#[test]
fn from_projections_zero_d_v() {
    let result = CausalAttention::from_projections(
        Array2::<f64>::zeros((3, 2)),
        Array2::zeros((3, 2)),
        Array2::zeros((3, 0)),
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_v", "[3, 0]"]);
}

#[test]
fn new_seeded_zero_d_model() {
    let result = Attention::<f32>::new_seeded(AttentionConfig::new(0, 1).with_head_dim(2), 0);
    assert_error(result, ErrorKind::ZeroDimension, &["d_model = 0"]);
}

#[test]
fn new_seeded_zero_d_k() {
    let result = CausalAttention::<f32>::new_seeded(
        AttentionConfig::new(2, 1)
            .with_head_dim(0)
            .with_value_dim(2),
        0,
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_k = 0"]);
}

#[test]
fn new_seeded_zero_d_v() {
    let result = Attention::<f64>::new_seeded(AttentionConfig::new(2, 1).with_value_dim(0), 0);
    assert_error(result, ErrorKind::ZeroDimension, &["d_v = 0"]);
}

#[test]
fn new_seeded_with_d_k_too_large_to_address() {
    // W^Q [8, usize::MAX / 2]: more elements than can be addressed.
    let config = AttentionConfig::new(8, 1)
        .with_head_dim(usize::MAX / 2)
        .with_value_dim(4);
    let result = Attention::<f32>::new_seeded(config, 0);
    assert_error(
        result,
        ErrorKind::TooLarge,
        &["w_q", &(usize::MAX / 2).to_string()],
    );
    let result = CausalAttention::<f64>::new_seeded(config, 0);
    assert_error(result, ErrorKind::TooLarge, &["w_q"]);
    // With four heads, heads·d_k overflows before any shape is formed.
    let result = CausalAttention::<f32>::new_seeded(config.with_heads(4), 0);
    assert_error(result, ErrorKind::TooLarge, &["heads·d_k", "overflows"]);
    let result = Attention::<f32>::new_seeded(
        config
            .with_head_dim(4)
            .with_value_dim(usize::MAX / 2)
            .with_heads(4),
        0,
    );
    assert_error(result, ErrorKind::TooLarge, &["heads·d_v", "overflows"]);
}

#[test]
fn new_seeded_past_memory() {
    // W^Q [2^40, 4] in f32: 16 TiB.
    let result = Attention::<f32>::new_seeded(AttentionConfig::new(1 << 40, 1).with_head_dim(4), 0);
    assert_error(
        result,
        ErrorKind::OutOfMemory,
        &["w_q", "17592186044416 bytes"],
    );
}

#[test]
fn forward_of_an_input_past_memory_or_too_large() {
    let (layer, causal) = (layer(), causal_layer());
    let row = Array3::<f64>::zeros((1, 1, 4));
    // 2^40 positions broadcast from one: their projections need 32 TiB;
    // 2^59, more bytes than can be addressed.
    for (len, kind) in [
        (1 << 40, ErrorKind::OutOfMemory),
        (1 << 59, ErrorKind::TooLarge),
    ] {
        let x = row.broadcast((1, len, 4)).unwrap();
        let opts = AttentionOptions::new();
        assert_error(layer.forward_batch(x), kind, &[]);
        assert_error(causal.forward_batch(x), kind, &[]);
        assert_error(layer.forward(x.index_axis(Axis(0), 0)), kind, &[]);
        assert_error(layer.forward_cross(x, x), kind, &[]);
        assert_error(layer.forward_batch_with_weights(x, &opts), kind, &[]);
        assert_error(layer.forward_train(x, &opts).map(drop), kind, &[]);
        assert_error(causal.forward_train(x, &opts).map(drop), kind, &[]);
    }
}

fn layer() -> Attention<f64> {
    Attention::new_seeded(
        AttentionConfig::new(4, 1)
            .with_head_dim(3)
            .with_value_dim(2),
        5,
    )
    .unwrap()
}

fn causal_layer() -> CausalAttention<f64> {
    CausalAttention::new_seeded(
        AttentionConfig::new(4, 1)
            .with_head_dim(3)
            .with_value_dim(2),
        5,
    )
    .unwrap()
}

#[test]
fn forward_wrong_width() {
    let x = Array2::zeros((3, 5));
    assert_error(
        layer().forward(x.view()),
        ErrorKind::ShapeMismatch,
        &["x", "[3, 5]", "[len, d_model]", "d_model is 4"],
    );
}

#[test]
fn forward_batch_wrong_width() {
    let x = Array3::zeros((2, 3, 3));
    assert_error(
        layer().forward_batch(x.view()),
        ErrorKind::ShapeMismatch,
        &["[2, 3, 3]", "[batch, len, d_model]", "d_model is 4"],
    );
}

#[test]
fn causal_forward_wrong_width() {
    let x = Array2::zeros((3, 1));
    assert_error(
        causal_layer().forward(x.view()),
        ErrorKind::ShapeMismatch,
        &["[3, 1]", "d_model is 4"],
    );
}

#[test]
fn causal_forward_batch_wrong_width() {
    let x = Array3::zeros((1, 3, 8));
    assert_error(
        causal_layer().forward_batch(x.view()),
        ErrorKind::ShapeMismatch,
        &["[1, 3, 8]", "d_model is 4"],
    );
}

#[test]
fn forward_with_mask_that_does_not_broadcast() {
    let x = Array2::zeros((3, 4));
    let keep = Array4::from_elem((1, 1, 3, 4), true);
    assert_error(
        layer().forward_with(x.view(), &AttentionOptions::new().keep_mask(keep.view())),
        ErrorKind::NotBroadcastable,
        &["keep_mask", "[1, 1, 3, 4]"],
    );
}

#[test]
fn forward_batch_with_bias_for_another_batch() {
    let x = Array3::zeros((2, 3, 4));
    let bias = Array4::zeros((3, 1, 3, 3));
    assert_error(
        causal_layer().forward_batch_with(x.view(), &AttentionOptions::new().bias(bias.view())),
        ErrorKind::NotBroadcastable,
        &["bias", "[3, 1, 3, 3]"],
    );
}

#[test]
fn forward_batch_with_wrong_number_of_key_lengths() {
    let x = Array3::zeros((2, 3, 4));
    assert_error(
        layer().forward_batch_with(x.view(), &AttentionOptions::new().key_lengths(&[3])),
        ErrorKind::KeyLengths,
        &["key_lengths"],
    );
}

#[test]
fn forward_with_key_length_past_len() {
    let x = Array2::zeros((3, 4));
    assert_error(
        causal_layer().forward_with(x.view(), &AttentionOptions::new().key_lengths(&[4])),
        ErrorKind::KeyLengths,
        &["key_lengths[0] = 4"],
    );
}

// --- multi-head layers --------------------------------------------------------

/// A deterministic array filler for weights and biases (SplitMix64, entries
/// uniform in [-1, 1)), so a proptest case is replayed from its seed.
fn filled<D: ndarray::Dimension, Sh: ndarray::ShapeBuilder<Dim = D>>(
    seed: u64,
    shape: Sh,
) -> ndarray::Array<f64, D> {
    let mut state = seed;
    ndarray::Array::from_shape_simple_fn(shape, || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1_u64 << 53) as f64 * 2.0 - 1.0
    })
}

/// Random weights (and biases, if the config has them) for `config`.
fn random_parameters(config: &AttentionConfig, seed: u64) -> LayerParameters<f64> {
    let mut weights = Attention::<f64>::new_seeded(*config, seed)
        .unwrap()
        .parameters()
        .clone();
    if config.bias {
        // Seeded biases are zero; these are not, so the tests see them.
        weights.b_q = weights.b_q.map(|b| filled(seed ^ 1, b.len()));
        weights.b_k = weights.b_k.map(|b| filled(seed ^ 2, b.len()));
        weights.b_v = weights.b_v.map(|b| filled(seed ^ 3, b.len()));
        weights.b_o = weights.b_o.map(|b| filled(seed ^ 4, b.len()));
    }
    weights
}

/// The multi-head layer written out from its definition: every projection
/// by explicit dot products, the heads copied into `[batch, heads, len, d]`
/// arrays (key/value heads repeated for each query head that shares them),
/// the reference attention on those, the heads concatenated by index, then
/// the output projection.
fn multi_head_reference(
    config: &AttentionConfig,
    weights: &LayerParameters<f64>,
    x_q: ArrayView3<'_, f64>,
    x_kv: ArrayView3<'_, f64>,
    opts: &AttentionOptions<'_, f64>,
) -> Array3<f64> {
    let project = |x: ArrayView3<'_, f64>, w: &Array2<f64>, b: &Option<ndarray::Array1<f64>>| {
        let (batch, len, _) = x.dim();
        Array3::from_shape_fn((batch, len, w.ncols()), |(n, i, c)| {
            x.slice(s![n, i, ..]).dot(&w.column(c)) + b.as_ref().map_or(0.0, |b| b[c])
        })
    };
    let q = project(x_q, &weights.w_q, &weights.b_q);
    let k = project(x_kv, &weights.w_k, &weights.b_k);
    let v = project(x_kv, &weights.w_v, &weights.b_v);
    let (batch, len_q, len_kv) = (x_q.dim().0, x_q.dim().1, x_kv.dim().1);
    let (heads, d_k, d_v) = (config.heads, config.d_k(), config.d_v());
    let group = heads / config.kv_heads;
    let q4 = Array4::from_shape_fn((batch, heads, len_q, d_k), |(n, h, i, c)| {
        q[[n, i, h * d_k + c]]
    });
    let k4 = Array4::from_shape_fn((batch, heads, len_kv, d_k), |(n, h, j, c)| {
        k[[n, j, (h / group) * d_k + c]]
    });
    let v4 = Array4::from_shape_fn((batch, heads, len_kv, d_v), |(n, h, j, c)| {
        v[[n, j, (h / group) * d_v + c]]
    });
    let out =
        sdpa::core::scaled_dot_product_attention(q4.view(), k4.view(), v4.view(), opts).unwrap();
    let concatenated = Array3::from_shape_fn((batch, len_q, heads * d_v), |(n, i, c)| {
        out[[n, c / d_v, i, c % d_v]]
    });
    match &weights.w_o {
        Some(w_o) => project(concatenated.view(), w_o, &weights.b_o),
        None => concatenated,
    }
}

/// A multi-head config (1 to 3 key/value heads, 1 to 3 query heads per
/// group, each optional part on or off; a key/value width of its own when
/// `cross`), its random weights, a batch of query-side inputs and one of
/// key/value-side inputs.
fn multi_head_case(
    cross: bool,
) -> impl Strategy<
    Value = (
        AttentionConfig,
        LayerParameters<f64>,
        Array3<f64>,
        Array3<f64>,
    ),
> {
    let d_model_kv = if cross {
        prop::option::of(1..6_usize).boxed()
    } else {
        Just(None).boxed()
    };
    (
        (1..6_usize, 1..4_usize, 1..4_usize, 1..4_usize, 1..4_usize),
        (d_model_kv, prop::option::of(1..6_usize), any::<bool>()),
        (1..3_usize, 0..6_usize, 0..6_usize, any::<u64>()),
    )
        .prop_flat_map(
            |(
                (d_model, d_k, d_v, kv_heads, group),
                (d_model_kv, d_model_out, bias),
                (batch, len_q, len_kv, seed),
            )| {
                let mut config = AttentionConfig::new(d_model, kv_heads * group)
                    .with_head_dim(d_k)
                    .with_value_dim(d_v)
                    .with_kv_heads(kv_heads)
                    .with_bias(bias);
                config.d_model_kv = d_model_kv;
                config.d_model_out = d_model_out;
                let weights = random_parameters(&config, seed);
                (
                    Just(config),
                    Just(weights),
                    array3((batch, len_q, d_model)),
                    array3((batch, len_kv, config.kv_input_width())),
                )
            },
        )
}

/// [`multi_head_case`] for self-attention: a config, weights and inputs.
fn self_attention_case()
-> impl Strategy<Value = (AttentionConfig, LayerParameters<f64>, Array3<f64>)> {
    multi_head_case(false).prop_map(|(config, weights, x, _)| (config, weights, x))
}

proptest! {
    #[test]
    fn multi_head_attention_matches_the_reference((config, weights, x) in self_attention_case()) {
        let layer = Attention::new(config, weights.clone()).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let expected = multi_head_reference(&config, &weights, x.view(), x.view(), &AttentionOptions::new());
        prop_assert_eq!(y.dim(), (x.dim().0, x.dim().1, config.output_width()));
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn multi_head_causal_attention_matches_the_reference((config, weights, x) in self_attention_case()) {
        let layer = CausalAttention::new(config, weights.clone()).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let expected = multi_head_reference(&config, &weights, x.view(), x.view(), &AttentionOptions::new().causal());
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
        // One sequence at a time gives the same rows.
        for (b, item) in x.outer_iter().enumerate() {
            assert_abs_diff_eq!(y.index_axis(Axis(0), b), layer.forward(item).unwrap(), epsilon = 1e-14);
        }
    }

    #[test]
    fn cross_attention_matches_the_reference((config, weights, x_q, x_kv) in multi_head_case(true)) {
        let layer = Attention::new(config, weights.clone()).unwrap();
        let y = layer.forward_cross(x_q.view(), x_kv.view()).unwrap();
        let expected = multi_head_reference(&config, &weights, x_q.view(), x_kv.view(), &AttentionOptions::new());
        prop_assert_eq!(y.dim(), (x_q.dim().0, x_q.dim().1, config.output_width()));
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn per_head_masks_and_key_lengths_reach_each_head(
        (config, weights, x_q, x_kv) in multi_head_case(true),
        variant in 0..3_usize,
    ) {
        let (batch, len_q, len_kv) = (x_q.dim().0, x_q.dim().1, x_kv.dim().1);
        let heads = config.heads;
        let layer = Attention::new(config, weights.clone()).unwrap();
        // A different pattern in every head.
        let keep = Array4::from_shape_fn((batch, heads, len_q, len_kv), |(b, h, i, j)| !(b + h + 2 * i + 3 * j).is_multiple_of(heads + 2));
        let bias = Array4::from_shape_fn((1, heads, len_q, len_kv), |(_, h, i, j)| -0.3 * (h + 1) as f64 * (i as f64 - j as f64).abs());
        let lengths: Vec<usize> = (0..batch).map(|b| (b * 3 + 1) % (len_kv + 1)).collect();
        let opts = match variant {
            0 => AttentionOptions::new().keep_mask(keep.view()),
            1 => AttentionOptions::new().bias(bias.view()).scale(0.5),
            _ => AttentionOptions::new().key_lengths(&lengths),
        };
        let y = layer.forward_cross_with(x_q.view(), x_kv.view(), &opts).unwrap();
        let expected = multi_head_reference(&config, &weights, x_q.view(), x_kv.view(), &opts);
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn grouped_query_attention_equals_repeated_key_value_heads((config, weights, x) in self_attention_case()) {
        // Copy each key/value head's columns once per query head that shares
        // it: an ordinary multi-head layer that must give the same output.
        let group = config.heads / config.kv_heads;
        let repeat = |w: &Array2<f64>, d: usize| {
            Array2::from_shape_fn((w.nrows(), config.heads * d), |(r, c)| w[[r, (c / d / group) * d + c % d]])
        };
        let repeat_bias = |b: &ndarray::Array1<f64>, d: usize| {
            ndarray::Array1::from_shape_fn(config.heads * d, |c| b[(c / d / group) * d + c % d])
        };
        let mut expanded = weights.clone();
        expanded.w_k = repeat(&weights.w_k, config.d_k());
        expanded.w_v = repeat(&weights.w_v, config.d_v());
        expanded.b_k = weights.b_k.as_ref().map(|b| repeat_bias(b, config.d_k()));
        expanded.b_v = weights.b_v.as_ref().map(|b| repeat_bias(b, config.d_v()));
        let grouped = CausalAttention::new(config, weights).unwrap();
        let full = CausalAttention::new(config.with_kv_heads(config.heads), expanded).unwrap();
        assert_abs_diff_eq!(
            grouped.forward_batch(x.view()).unwrap(),
            full.forward_batch(x.view()).unwrap(),
            epsilon = 1e-12
        );
    }

    #[test]
    fn output_projection_is_applied_to_the_concatenated_heads((config, weights, x) in self_attention_case()) {
        let Some(w_o) = weights.w_o.clone() else { return Ok(()) };
        let with_output = Attention::new(config, weights.clone()).unwrap();
        let mut without_config = config;
        without_config.d_model_out = None;
        let mut without_weights = weights.clone();
        without_weights.w_o = None;
        without_weights.b_o = None;
        let without_output = Attention::new(without_config, without_weights).unwrap();
        let heads = without_output.forward_batch(x.view()).unwrap();
        let (batch, len, width) = heads.dim();
        let mut expected = heads.into_shape_with_order((batch * len, width)).unwrap().dot(&w_o);
        if let Some(b_o) = &weights.b_o {
            expected += b_o;
        }
        let expected = expected.into_shape_with_order((batch, len, config.output_width())).unwrap();
        assert_abs_diff_eq!(with_output.forward_batch(x.view()).unwrap(), expected, epsilon = 1e-12);
    }

    #[test]
    fn cross_attention_of_a_sequence_with_itself_is_self_attention((config, weights, x) in self_attention_case()) {
        let layer = Attention::new(config, weights).unwrap();
        assert_eq!(layer.forward_cross(x.view(), x.view()).unwrap(), layer.forward_batch(x.view()).unwrap());
    }

    #[test]
    fn multi_head_f32_agrees_with_f64((config, weights, x) in self_attention_case(), causal in any::<bool>()) {
        let weights32 = {
            let mut w = LayerParameters::new(weights.w_q.mapv(|v| v as f32), weights.w_k.mapv(|v| v as f32), weights.w_v.mapv(|v| v as f32));
            w.w_o = weights.w_o.as_ref().map(|m| m.mapv(|v| v as f32));
            w.b_q = weights.b_q.as_ref().map(|b| b.mapv(|v| v as f32));
            w.b_k = weights.b_k.as_ref().map(|b| b.mapv(|v| v as f32));
            w.b_v = weights.b_v.as_ref().map(|b| b.mapv(|v| v as f32));
            w.b_o = weights.b_o.as_ref().map(|b| b.mapv(|v| v as f32));
            w
        };
        let x32 = x.mapv(|v| v as f32);
        let (y32, y64) = if causal {
            (CausalAttention::new(config, weights32).unwrap().forward_batch(x32.view()).unwrap(),
             CausalAttention::new(config, weights).unwrap().forward_batch(x.view()).unwrap())
        } else {
            (Attention::new(config, weights32).unwrap().forward_batch(x32.view()).unwrap(),
             Attention::new(config, weights).unwrap().forward_batch(x.view()).unwrap())
        };
        assert_abs_diff_eq!(y32.mapv(f64::from), y64, epsilon = 1e-4);
    }

    #[test]
    fn multi_head_causal_rows_ignore_later_inputs(
        (config, weights, x) in self_attention_case(),
        cut in any::<prop::sample::Index>(),
        noise in prop_oneof![Just(f64::NAN), Just(f64::INFINITY), -50.0..50.0_f64],
    ) {
        let len = x.dim().1;
        if len == 0 {
            return Ok(());
        }
        let cut = cut.index(len);
        let layer = CausalAttention::new(config, weights).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let mut changed = x.clone();
        changed.slice_mut(s![.., cut + 1.., ..]).fill(noise);
        let y_changed = layer.forward_batch(changed.view()).unwrap();
        assert_abs_diff_eq!(y.slice(s![.., ..=cut, ..]), y_changed.slice(s![.., ..=cut, ..]), epsilon = 1e-12);
    }

    #[test]
    fn multi_head_seeded_weights_are_deterministic_and_within_the_xavier_bound(
        (config, _, _) in self_attention_case(), seed in any::<u64>(),
    ) {
        let a = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(&a, &CausalAttention::<f64>::new_seeded(config, seed).unwrap());
        let within = |w: ArrayView2<'_, f64>, dim: (usize, usize)| {
            let bound = (6.0 / (dim.0 + dim.1) as f64).sqrt();
            w.dim() == dim && w.iter().all(|x| x.abs() <= bound)
        };
        let (d_model, heads, kv_heads) = (config.d_model, config.heads, config.kv_heads);
        prop_assert!(within(a.parameters().w_q.view(), (d_model, heads * config.d_k())));
        prop_assert!(within(a.parameters().w_k.view(), (d_model, kv_heads * config.d_k())));
        prop_assert!(within(a.parameters().w_v.view(), (d_model, kv_heads * config.d_v())));
        let p = a.parameters();
        prop_assert_eq!(p.w_o.is_some(), config.d_model_out.is_some());
        if let (Some(w_o), Some(d_model_out)) = (&p.w_o, config.d_model_out) {
            prop_assert!(within(w_o.view(), (heads * config.d_v(), d_model_out)));
        }
        // Biases start at zero and do not change the draws.
        prop_assert_eq!(p.b_q.is_some(), config.bias);
        prop_assert_eq!(p.b_o.is_some(), config.bias && config.d_model_out.is_some());
        for b in [&p.b_q, &p.b_k, &p.b_v, &p.b_o].into_iter().flatten() {
            prop_assert!(b.iter().all(|&x| x == 0.0));
        }
        let without_bias = CausalAttention::<f64>::new_seeded(config.with_bias(!config.bias), seed).unwrap();
        prop_assert_eq!(without_bias.parameters().w_q.view(), a.parameters().w_q.view());
        prop_assert_eq!(&without_bias.parameters().w_o, &p.w_o);
    }
}

#[test]
fn a_single_head_config_is_the_seed_layer() {
    let config = AttentionConfig::new(5, 1)
        .with_head_dim(3)
        .with_value_dim(4);
    assert_eq!((config.heads, config.kv_heads), (1, 1));
    assert_eq!(
        (config.d_model_kv, config.d_model_out, config.bias),
        (None, None, false)
    );
    assert_eq!(config.output_width(), 4);
    assert_eq!(config.kv_input_width(), 5);
    let seeded = Attention::<f64>::new_seeded(config, 3).unwrap();
    let rebuilt = Attention::new(config, seeded.parameters().clone()).unwrap();
    let from_projections = Attention::from_projections(
        seeded.parameters().w_q.view().to_owned(),
        seeded.parameters().w_k.view().to_owned(),
        seeded.parameters().w_v.view().to_owned(),
    )
    .unwrap();
    assert_eq!(rebuilt, seeded);
    assert_eq!(from_projections, seeded);
    assert!(seeded.parameters().w_o.is_none() && seeded.parameters().b_q.is_none());
}

#[test]
fn multi_head_config_setters() {
    let config = AttentionConfig::new(512, 8)
        .with_value_dim(32)
        .with_kv_heads(2)
        .with_d_model_kv(256)
        .with_output_projection(384)
        .with_bias(true);
    assert_eq!((config.heads, config.kv_heads), (8, 2));
    assert_eq!(config.kv_input_width(), 256);
    assert_eq!(config.output_width(), 384);
    assert!(config.bias);
    // `with_heads` sets both head counts: plain multi-head attention.
    assert_eq!(config.with_heads(4).kv_heads, 4);
    assert_eq!(
        AttentionConfig::new(8, 4).with_value_dim(3).output_width(),
        12
    );
}

#[test]
fn hand_computed_two_heads() {
    // d_model = 2, two heads of d_k = d_v = 1: head 0 reads input column 0,
    // head 1 column 1; W^O swaps the heads.
    let config = AttentionConfig::new(2, 2).with_output_projection(2);
    let eye = Array2::<f64>::eye(2);
    let swap = ndarray::array![[0.0, 1.0], [1.0, 0.0]];
    let weights = LayerParameters::new(eye.clone(), eye.clone(), eye).with_output(swap);
    let layer = Attention::new(config, weights).unwrap();
    // Two positions: head 0 sees scores x0_i·x0_j, head 1 x1_i·x1_j.
    let x = ndarray::array![[1.0, 0.0], [0.0, 2.0]];
    let y = layer.forward(x.view()).unwrap();
    // Head 0 (column 0 values 1, 0): query 0 scores [1, 0] → weights ∝ [e, 1];
    // query 1 scores [0, 0] → [½, ½].
    let e = 1.0_f64.exp();
    let head0 = [e / (e + 1.0), 0.5];
    // Head 1 (column 1 values 0, 2): query 0 scores [0, 0] → ½·2 = 1;
    // query 1 scores [0, 4] → 2·e⁴/(1 + e⁴).
    let e4 = 4.0_f64.exp();
    let head1 = [1.0, 2.0 * e4 / (1.0 + e4)];
    // W^O swaps: output column 0 is head 1, column 1 is head 0.
    let expected = ndarray::array![[head1[0], head0[0]], [head1[1], head0[1]]];
    assert_abs_diff_eq!(y, expected, epsilon = 1e-15);
}

#[test]
fn biases_are_added_to_each_projection() {
    // Zero weights: queries and keys are their biases, so every score is
    // equal and each output is the mean of the value biases (b_v), then
    // projected: b_v·W^O + b_o.
    let config = AttentionConfig::new(3, 1)
        .with_head_dim(2)
        .with_output_projection(1)
        .with_bias(true);
    let weights = LayerParameters::new(
        Array2::<f64>::zeros((3, 2)),
        Array2::zeros((3, 2)),
        Array2::zeros((3, 2)),
    )
    .with_output(ndarray::array![[1.0], [10.0]])
    .with_biases(
        ndarray::array![1.0, 2.0],
        ndarray::array![3.0, 4.0],
        ndarray::array![0.5, -1.0],
    )
    .with_output_bias(ndarray::array![100.0]);
    let layer = CausalAttention::new(config, weights).unwrap();
    let x = Array2::from_shape_fn((4, 3), |(i, j)| (i * 3 + j) as f64);
    let y = layer.forward(x.view()).unwrap();
    assert_abs_diff_eq!(
        y,
        Array2::from_elem((4, 1), 0.5 - 10.0 + 100.0),
        epsilon = 1e-12
    );
}

#[test]
fn multi_head_empty_inputs_are_valid() {
    let config = AttentionConfig::new(4, 2)
        .with_value_dim(3)
        .with_d_model_kv(5)
        .with_output_projection(6);
    let layer = Attention::<f32>::new_seeded(config, 0).unwrap();
    let x_q = Array3::<f32>::zeros((2, 0, 4));
    let x_kv = Array3::<f32>::zeros((2, 3, 5));
    assert_eq!(
        layer.forward_cross(x_q.view(), x_kv.view()).unwrap().dim(),
        (2, 0, 6)
    );
    // No keys: every query outputs zeros before W^O, so zeros after it.
    let x_q = Array3::<f32>::ones((2, 3, 4));
    let no_keys = Array3::<f32>::zeros((2, 0, 5));
    let y = layer.forward_cross(x_q.view(), no_keys.view()).unwrap();
    assert_eq!(y, Array3::<f32>::zeros((2, 3, 6)));
}

// --- multi-head errors, one test per case -----------------------------------

/// Two heads of d_k = 3, d_v = 2 over d_model = 4, with an output
/// projection to 5 and biases: `W^Q` [4, 6], `W^K` [4, 6], `W^V` [4, 4],
/// `W^O` [4, 5], `b_q` [6], `b_k` [6], `b_v` [4], `b_o` [5].
fn two_head_config() -> AttentionConfig {
    AttentionConfig::new(4, 2)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_output_projection(5)
        .with_bias(true)
}

fn two_head_parameters() -> LayerParameters<f64> {
    random_parameters(&two_head_config(), 9)
}

#[test]
fn new_zero_heads() {
    let config = AttentionConfig::new(4, 0).with_head_dim(2);
    assert_error(
        Attention::<f64>::new_seeded(config, 0),
        ErrorKind::ZeroDimension,
        &["heads = 0"],
    );
}

#[test]
fn new_zero_kv_heads() {
    let config = AttentionConfig::new(4, 2).with_kv_heads(0);
    assert_error(
        CausalAttention::<f32>::new_seeded(config, 0),
        ErrorKind::ZeroDimension,
        &["kv_heads = 0"],
    );
}

#[test]
fn new_heads_not_a_multiple_of_kv_heads() {
    let config = AttentionConfig::new(4, 6).with_head_dim(2).with_kv_heads(4);
    assert_error(
        Attention::<f64>::new_seeded(config, 0),
        ErrorKind::HeadsNotDivisible,
        &["heads (6)", "kv_heads (4)"],
    );
}

#[test]
fn new_zero_d_model_out() {
    let config = AttentionConfig::new(4, 1)
        .with_head_dim(2)
        .with_output_projection(0);
    assert_error(
        Attention::<f64>::new_seeded(config, 0),
        ErrorKind::ZeroDimension,
        &["d_model_out = Some(0)"],
    );
}

#[test]
fn new_zero_d_model_kv() {
    let config = AttentionConfig::new(4, 1)
        .with_head_dim(2)
        .with_d_model_kv(0);
    assert_error(
        Attention::<f64>::new_seeded(config, 0),
        ErrorKind::ZeroDimension,
        &["d_model_kv = Some(0)"],
    );
}

#[test]
fn new_w_q_for_another_head_count() {
    let mut weights = two_head_parameters();
    weights.w_q = Array2::zeros((4, 3));
    assert_error(
        Attention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &[
            "w_q has shape [4, 3]",
            "[d_model, heads·d_k] = [4, 6]",
            "heads = 2",
        ],
    );
}

#[test]
fn new_w_k_wrong_rows() {
    let mut weights = two_head_parameters();
    weights.w_k = Array2::zeros((3, 6));
    assert_error(
        CausalAttention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &[
            "w_k has shape [3, 6]",
            "[d_model_kv, kv_heads·d_k] = [4, 6]",
        ],
    );
}

#[test]
fn new_w_k_for_grouped_query_heads() {
    // One key/value head needs w_k [4, 3], not the [4, 6] of two.
    let config = two_head_config().with_kv_heads(1);
    assert_error(
        Attention::new(config, two_head_parameters()),
        ErrorKind::ShapeMismatch,
        &["w_k has shape [4, 6]", "= [4, 3]", "kv_heads = 1"],
    );
}

#[test]
fn new_w_v_wrong_columns() {
    let mut weights = two_head_parameters();
    weights.w_v = Array2::zeros((4, 5));
    assert_error(
        Attention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &[
            "w_v has shape [4, 5]",
            "[d_model_kv, kv_heads·d_v] = [4, 4]",
        ],
    );
}

#[test]
fn new_w_o_wrong_shape() {
    let mut weights = two_head_parameters();
    weights.w_o = Some(Array2::zeros((5, 4)));
    assert_error(
        Attention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &["w_o has shape [5, 4]", "[heads·d_v, d_model_out] = [4, 5]"],
    );
}

#[test]
fn new_w_o_missing() {
    let mut weights = two_head_parameters();
    weights.w_o = None;
    weights.b_o = None;
    assert_error(
        Attention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &["w_o is missing", "[4, 5]"],
    );
}

#[test]
fn new_w_o_given_without_an_output_projection() {
    let mut config = two_head_config();
    config.d_model_out = None;
    let mut weights = two_head_parameters();
    weights.b_o = None;
    assert_error(
        CausalAttention::new(config, weights),
        ErrorKind::ShapeMismatch,
        &["w_o [4, 5] was given", "d_model_out = None"],
    );
}

#[test]
fn new_bias_wrong_length() {
    let mut weights = two_head_parameters();
    weights.b_v = Some(ndarray::Array1::zeros(6));
    assert_error(
        Attention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &["b_v has shape [6]", "expected [4]"],
    );
}

#[test]
fn new_bias_missing() {
    let mut weights = two_head_parameters();
    weights.b_k = None;
    assert_error(
        Attention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &["b_k is missing", "bias = true"],
    );
}

#[test]
fn new_bias_given_without_bias_in_the_config() {
    let weights = two_head_parameters();
    assert_error(
        Attention::new(two_head_config().with_bias(false), weights),
        ErrorKind::ShapeMismatch,
        &["b_q [6] was given", "bias = false"],
    );
}

#[test]
fn new_output_bias_wrong_length() {
    let mut weights = two_head_parameters();
    weights.b_o = Some(ndarray::Array1::zeros(4));
    assert_error(
        CausalAttention::new(two_head_config(), weights),
        ErrorKind::ShapeMismatch,
        &["b_o has shape [4]", "expected [5]"],
    );
}

#[test]
fn causal_layer_with_its_own_key_value_width() {
    let config = AttentionConfig::new(4, 1)
        .with_head_dim(2)
        .with_d_model_kv(6);
    assert_error(
        CausalAttention::<f64>::new_seeded(config, 0),
        ErrorKind::ShapeMismatch,
        &["d_model_kv (6)", "d_model (4)"],
    );
}

#[test]
fn self_attention_on_a_cross_attention_layer() {
    let config = AttentionConfig::new(4, 1)
        .with_head_dim(2)
        .with_d_model_kv(6);
    let layer = Attention::<f64>::new_seeded(config, 0).unwrap();
    let x = Array3::zeros((1, 3, 4));
    assert_error(
        layer.forward_batch(x.view()),
        ErrorKind::ShapeMismatch,
        &["d_model_kv = 6", "forward_cross"],
    );
}

#[test]
fn forward_cross_query_width() {
    let layer = Attention::new(two_head_config(), two_head_parameters()).unwrap();
    let (x_q, x_kv) = (Array3::zeros((1, 2, 5)), Array3::zeros((1, 3, 4)));
    assert_error(
        layer.forward_cross(x_q.view(), x_kv.view()),
        ErrorKind::ShapeMismatch,
        &["x_q has shape [1, 2, 5]", "d_model is 4"],
    );
}

#[test]
fn forward_cross_key_value_width() {
    let config = AttentionConfig::new(4, 1)
        .with_head_dim(2)
        .with_d_model_kv(6);
    let layer = Attention::<f64>::new_seeded(config, 0).unwrap();
    let (x_q, x_kv) = (Array3::zeros((1, 2, 4)), Array3::zeros((1, 3, 4)));
    assert_error(
        layer.forward_cross(x_q.view(), x_kv.view()),
        ErrorKind::ShapeMismatch,
        &["x_kv has shape [1, 3, 4]", "d_model_kv is 6"],
    );
}

#[test]
fn forward_cross_batch_sizes_differ() {
    let layer = Attention::new(two_head_config(), two_head_parameters()).unwrap();
    let (x_q, x_kv) = (Array3::zeros((2, 2, 4)), Array3::zeros((3, 3, 4)));
    assert_error(
        layer.forward_cross(x_q.view(), x_kv.view()),
        ErrorKind::ShapeMismatch,
        &["batch sizes differ", "[2, 2, 4]", "[3, 3, 4]"],
    );
}

#[test]
fn forward_with_a_mask_for_another_head_count() {
    let layer = CausalAttention::new(two_head_config(), two_head_parameters()).unwrap();
    let x = Array3::zeros((1, 3, 4));
    let keep = Array4::from_elem((1, 3, 3, 3), true);
    assert_error(
        layer.forward_batch_with(x.view(), &AttentionOptions::new().keep_mask(keep.view())),
        ErrorKind::NotBroadcastable,
        &["keep_mask", "[1, 3, 3, 3]", "[1, 2, 3, 3]"],
    );
}

// --- attention weights on request ------------------------------------------

/// The reference weights: the heads copied out as in
/// [`multi_head_reference`], then `sdpa::core::attention_weights`.
fn weights_reference(
    config: &AttentionConfig,
    weights: &LayerParameters<f64>,
    x_q: ArrayView3<'_, f64>,
    x_kv: ArrayView3<'_, f64>,
    opts: &AttentionOptions<'_, f64>,
) -> Array4<f64> {
    let project = |x: ArrayView3<'_, f64>, w: &Array2<f64>, b: &Option<ndarray::Array1<f64>>| {
        let (batch, len, _) = x.dim();
        Array3::from_shape_fn((batch, len, w.ncols()), |(n, i, c)| {
            x.slice(s![n, i, ..]).dot(&w.column(c)) + b.as_ref().map_or(0.0, |b| b[c])
        })
    };
    let q = project(x_q, &weights.w_q, &weights.b_q);
    let k = project(x_kv, &weights.w_k, &weights.b_k);
    let (batch, len_q, len_kv) = (x_q.dim().0, x_q.dim().1, x_kv.dim().1);
    let (heads, d_k) = (config.heads, config.d_k());
    let group = heads / config.kv_heads;
    let q4 = Array4::from_shape_fn((batch, heads, len_q, d_k), |(n, h, i, c)| {
        q[[n, i, h * d_k + c]]
    });
    let k4 = Array4::from_shape_fn((batch, heads, len_kv, d_k), |(n, h, j, c)| {
        k[[n, j, (h / group) * d_k + c]]
    });
    sdpa::core::attention_weights(q4.view(), k4.view(), opts).unwrap()
}

proptest! {
    #[test]
    fn weights_match_the_reference_and_the_output_is_unchanged(
        (config, weights, x_q, x_kv) in multi_head_case(true),
        masked in any::<bool>(),
    ) {
        let (batch, len_kv) = (x_q.dim().0, x_kv.dim().1);
        let lengths: Vec<usize> = (0..batch).map(|b| (b + 2) % (len_kv + 1)).collect();
        let opts = if masked { AttentionOptions::new().key_lengths(&lengths) } else { AttentionOptions::new() };
        let layer = Attention::new(config, weights.clone()).unwrap();
        let (y, w) = layer.forward_cross_with_weights(x_q.view(), x_kv.view(), &opts).unwrap();
        prop_assert_eq!(y, layer.forward_cross_with(x_q.view(), x_kv.view(), &opts).unwrap());
        prop_assert_eq!(w.dim(), (batch, config.heads, x_q.dim().1, len_kv));
        let expected = weights_reference(&config, &weights, x_q.view(), x_kv.view(), &opts);
        assert_abs_diff_eq!(w, expected, epsilon = 1e-12);
        // Each row sums to 1, or is all 0 when it sees no key.
        for row in w.rows() {
            let sum = row.sum();
            prop_assert!((sum - 1.0).abs() < 1e-12 || row.iter().all(|&x| x == 0.0), "row sums to {}", sum);
        }
    }

    #[test]
    fn self_attention_weights_for_both_layers((config, weights, x) in self_attention_case()) {
        let bidirectional = Attention::new(config, weights.clone()).unwrap();
        let causal = CausalAttention::new(config, weights.clone()).unwrap();
        let opts = AttentionOptions::new();
        let (y, w) = bidirectional.forward_batch_with_weights(x.view(), &opts).unwrap();
        prop_assert_eq!(y, bidirectional.forward_batch(x.view()).unwrap());
        assert_abs_diff_eq!(w, weights_reference(&config, &weights, x.view(), x.view(), &opts), epsilon = 1e-12);
        let (y_causal, w_causal) = causal.forward_batch_with_weights(x.view(), &opts).unwrap();
        prop_assert_eq!(y_causal, causal.forward_batch(x.view()).unwrap());
        let causal_opts = AttentionOptions::new().causal();
        assert_abs_diff_eq!(w_causal, weights_reference(&config, &weights, x.view(), x.view(), &causal_opts), epsilon = 1e-12);
        // Nothing above the diagonal.
        for ((_, _, i, j), &weight) in w_causal.indexed_iter() {
            prop_assert!(j <= i || weight == 0.0);
        }
        // One sequence at a time: the same weights, without the batch axis.
        for (b, item) in x.outer_iter().enumerate() {
            let (y_item, w_item) = causal.forward_with_weights(item, &opts).unwrap();
            prop_assert_eq!(y_item, causal.forward(item).unwrap());
            // Not bitwise: a few rows are projected by a different summation.
            assert_abs_diff_eq!(w_item, w_causal.index_axis(Axis(0), b), epsilon = 1e-14);
            let (_, w_item) = bidirectional.forward_with_weights(item, &opts).unwrap();
            assert_abs_diff_eq!(w_item, w.index_axis(Axis(0), b), epsilon = 1e-14);
        }
    }

    #[test]
    fn weights_times_values_is_the_output_without_an_output_projection((config, weights, x) in self_attention_case()) {
        let mut config = config;
        config.d_model_out = None;
        let mut weights = weights;
        weights.w_o = None;
        weights.b_o = None;
        let layer = CausalAttention::new(config, weights.clone()).unwrap();
        let (y, w) = layer.forward_batch_with_weights(x.view(), &AttentionOptions::new()).unwrap();
        let (batch, len, _) = x.dim();
        let group = config.heads / config.kv_heads;
        let d_v = config.d_v();
        let v = x.to_shape((batch * len, config.d_model)).unwrap().dot(&weights.w_v)
            + weights.b_v.clone().unwrap_or_else(|| ndarray::Array1::zeros(config.kv_heads * d_v));
        let v = v.into_shape_with_order((batch, len, config.kv_heads * d_v)).unwrap();
        let expected = Array3::from_shape_fn((batch, len, config.heads * d_v), |(n, i, c)| {
            let (h, dv) = (c / d_v, c % d_v);
            (0..len).map(|j| w[[n, h, i, j]] * v[[n, j, (h / group) * d_v + dv]]).sum::<f64>()
        });
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }
}

#[test]
fn f32_weights_agree_with_f64() {
    let config = AttentionConfig::new(6, 4)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_kv_heads(2);
    let l32 = CausalAttention::<f32>::new_seeded(config, 5).unwrap();
    let l64 = CausalAttention::<f64>::new_seeded(config, 5).unwrap();
    let x = Array2::from_shape_fn((7, 6), |(i, j)| ((i * 7 + j * 3) % 11) as f64 * 0.2 - 1.0);
    let (_, w32) = l32
        .forward_with_weights(x.mapv(|v| v as f32).view(), &AttentionOptions::new())
        .unwrap();
    let (_, w64) = l64
        .forward_with_weights(x.view(), &AttentionOptions::new())
        .unwrap();
    assert_eq!(w32.dim(), (4, 7, 7));
    assert_abs_diff_eq!(w32.mapv(f64::from), w64, epsilon = 1e-5);
}

#[test]
fn weights_follow_the_window_option() {
    let layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 2), 8).unwrap();
    let x = Array2::from_shape_fn((6, 4), |(i, j)| (i + j) as f64 * 0.1);
    let (_, w) = layer
        .forward_with_weights(x.view(), &AttentionOptions::new().window(2))
        .unwrap();
    for ((_, i, j), &weight) in w.indexed_iter() {
        let visible = j <= i && i < j + 2;
        assert_eq!(weight > 0.0, visible, "query {i}, key {j}: {weight}");
    }
}

#[test]
fn weights_methods_report_bad_shapes() {
    let layer = Attention::new(two_head_config(), two_head_parameters()).unwrap();
    let causal = CausalAttention::new(two_head_config(), two_head_parameters()).unwrap();
    let opts = AttentionOptions::new();
    let wide = Array2::zeros((3, 5));
    assert_error(
        layer.forward_with_weights(wide.view(), &opts),
        ErrorKind::ShapeMismatch,
        &["[3, 5]", "d_model is 4"],
    );
    assert_error(
        causal.forward_with_weights(wide.view(), &opts),
        ErrorKind::ShapeMismatch,
        &["[3, 5]", "d_model is 4"],
    );
    let wide3 = Array3::zeros((2, 3, 5));
    assert_error(
        layer.forward_batch_with_weights(wide3.view(), &opts),
        ErrorKind::ShapeMismatch,
        &["[2, 3, 5]", "d_model is 4"],
    );
    assert_error(
        causal.forward_batch_with_weights(wide3.view(), &opts),
        ErrorKind::ShapeMismatch,
        &["[2, 3, 5]", "d_model is 4"],
    );
    let x = Array3::zeros((2, 3, 4));
    assert_error(
        layer.forward_cross_with_weights(x.view(), wide3.view(), &opts),
        ErrorKind::ShapeMismatch,
        &["x_kv has shape [2, 3, 5]"],
    );
    assert_error(
        layer.forward_batch_with_weights(x.view(), &AttentionOptions::new().key_lengths(&[1])),
        ErrorKind::KeyLengths,
        &["key_lengths"],
    );
}

#[test]
fn an_empty_batch_of_huge_inputs_is_empty_or_too_large() {
    let layer =
        Attention::<f32>::new_seeded(AttentionConfig::new(4, 2).with_value_dim(8), 1).unwrap();
    let empty = Array3::<f32>::zeros((0, 1, 4));
    let x = empty.broadcast((0, 1 << 20, 4)).unwrap();
    assert_eq!(layer.forward_batch(x).unwrap().shape(), &[0, 1 << 20, 16]);
    // The values' projection [0, 2^58, 16] holds nothing, but its nonzero
    // lengths would need 2^64 bytes: ndarray could not address it.
    let x = empty.broadcast((0, 1 << 58, 4)).unwrap();
    assert_error(
        layer.forward_batch(x),
        ErrorKind::TooLarge,
        &["nonzero lengths"],
    );
}
