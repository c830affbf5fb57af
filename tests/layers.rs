//! The layer types `Attention` and `CausalAttention`: output against a
//! hand-projected reference on `sdpa::core`, f32 against f64, batch against
//! per-item, causality, seeded initialisation, and one test per bad shape.

use approx::assert_abs_diff_eq;
use ndarray::{Array2, Array3, Array4, ArrayView2, ArrayView3, Axis, s};
use proptest::prelude::*;
use sdpa::{
    Attention, AttentionConfig, AttentionError, AttentionOptions, CausalAlignment, CausalAttention,
    ErrorKind,
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
                Just(AttentionConfig::new(d_model, d_k, d_v)),
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
        let expected = reference(layer.w_q(), layer.w_k(), layer.w_v(), x.view(), &AttentionOptions::new());
        prop_assert_eq!(y.dim(), (x.dim().0, x.dim().1, config.d_v));
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn causal_attention_matches_the_causal_reference((config, x) in config_and_input(), seed in any::<u64>()) {
        let layer = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        let y = layer.forward_batch(x.view()).unwrap();
        let expected = reference(layer.w_q(), layer.w_k(), layer.w_v(), x.view(), &AttentionOptions::new().causal());
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
        let expected = reference(layer.w_q(), layer.w_k(), layer.w_v(), x.view(), &opts);
        assert_abs_diff_eq!(y, expected, epsilon = 1e-12);
    }

    #[test]
    fn causal_options_add_to_the_causal_rule((config, x) in config_and_input(), seed in any::<u64>()) {
        let (batch, len, _) = x.dim();
        let layer = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        let lengths: Vec<usize> = (0..batch).map(|b| (b * 5 + seed as usize) % (len + 1)).collect();
        let opts = AttentionOptions::new().key_lengths(&lengths);
        let y = layer.forward_batch_with(x.view(), &opts).unwrap();
        let expected = reference(layer.w_q(), layer.w_k(), layer.w_v(), x.view(), &opts.clone().causal());
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
        let config = AttentionConfig::new(d_model, d_k, d_v);
        let a = Attention::<f64>::new_seeded(config, seed).unwrap();
        let b = Attention::<f64>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(a.config(), config);
        prop_assert_eq!(a.w_q().dim(), (d_model, d_k));
        prop_assert_eq!(a.w_k().dim(), (d_model, d_k));
        prop_assert_eq!(a.w_v().dim(), (d_model, d_v));
        let bound_qk = (6.0 / (d_model + d_k) as f64).sqrt();
        let bound_v = (6.0 / (d_model + d_v) as f64).sqrt();
        prop_assert!(a.w_q().iter().chain(a.w_k().iter()).all(|w| w.abs() <= bound_qk));
        prop_assert!(a.w_v().iter().all(|w| w.abs() <= bound_v));
        // The same draws, rounded, for f32; and the causal layer gets them too.
        let a32 = Attention::<f32>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(a32.w_q(), a.w_q().mapv(|w| w as f32));
        prop_assert_eq!(a32.w_v(), a.w_v().mapv(|w| w as f32));
        let causal = CausalAttention::<f64>::new_seeded(config, seed).unwrap();
        prop_assert_eq!(causal.w_k(), a.w_k());
    }
}

#[test]
fn seeded_weights_fill_the_xavier_interval() {
    let config = AttentionConfig::new(64, 64, 32);
    let layer = Attention::<f64>::new_seeded(config, 2024).unwrap();
    let bound = (6.0_f64 / 128.0).sqrt();
    let w = layer.w_q();
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
    let config = AttentionConfig::new(8, 4, 4);
    let a = Attention::<f32>::new_seeded(config, 1).unwrap();
    let b = Attention::<f32>::new_seeded(config, 2).unwrap();
    assert_ne!(a.w_q(), b.w_q());
    // W^Q, W^K and W^V are different draws from one stream.
    assert_ne!(a.w_q(), a.w_k());
}

#[test]
fn from_weights_keeps_the_weights_and_reads_the_config() {
    let w_q = Array2::from_shape_fn((3, 2), |(i, j)| (i * 2 + j) as f64);
    let w_k = Array2::from_shape_fn((3, 2), |(i, j)| (i + j) as f64 * 0.5);
    let w_v = Array2::from_shape_fn((3, 5), |(i, j)| (i * j) as f64 - 1.0);
    let layer = Attention::from_weights(w_q.clone(), w_k.clone(), w_v.clone()).unwrap();
    assert_eq!(layer.config(), AttentionConfig::new(3, 2, 5));
    assert_eq!(layer.w_q(), w_q);
    assert_eq!(layer.w_k(), w_k);
    assert_eq!(layer.w_v(), w_v);
    let causal = CausalAttention::from_weights(w_q, w_k, w_v).unwrap();
    assert_eq!(causal.config(), layer.config());
}

#[test]
fn hand_computed_single_position_is_its_value() {
    // One position attends only to itself: y = x·W^V whatever W^Q and W^K are.
    let w_q = Array2::from_elem((2, 2), 3.0_f64);
    let w_k = Array2::from_elem((2, 2), -1.0_f64);
    let w_v = ndarray::array![[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]];
    let layer = Attention::from_weights(w_q, w_k, w_v).unwrap();
    let x = ndarray::array![[1.0, -1.0]];
    assert_eq!(
        layer.forward(x.view()).unwrap(),
        ndarray::array![[-3.0, -3.0, -3.0]]
    );
}

#[test]
fn attention_with_causal_options_equals_causal_attention() {
    let config = AttentionConfig::new(5, 3, 4);
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
    let config = AttentionConfig::new(1, 2, 3)
        .with_d_model(10)
        .with_d_k(20)
        .with_d_v(30);
    assert_eq!((config.d_model, config.d_k, config.d_v), (10, 20, 30));
}

#[test]
fn empty_sequence_and_empty_batch_are_valid() {
    let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(4, 3, 2), 0).unwrap();
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
fn from_weights_w_k_rows_differ() {
    let result = Attention::from_weights(
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
fn from_weights_w_v_rows_differ() {
    let result = CausalAttention::from_weights(
        Array2::<f64>::zeros((4, 2)),
        Array2::zeros((4, 2)),
        Array2::zeros((5, 3)),
    );
    assert_error(result, ErrorKind::ShapeMismatch, &["d_model", "[5, 3]"]);
}

#[test]
fn from_weights_d_k_columns_differ() {
    let result = Attention::from_weights(
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
fn from_weights_zero_d_model() {
    let result = Attention::from_weights(
        Array2::<f64>::zeros((0, 2)),
        Array2::zeros((0, 2)),
        Array2::zeros((0, 2)),
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_model", "[0, 2]"]);
}

#[test]
fn from_weights_zero_d_k() {
    let result = Attention::from_weights(
        Array2::<f64>::zeros((3, 0)),
        Array2::zeros((3, 0)),
        Array2::zeros((3, 2)),
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_k", "[3, 0]"]);
}

#[test]
fn from_weights_zero_d_v() {
    let result = CausalAttention::from_weights(
        Array2::<f64>::zeros((3, 2)),
        Array2::zeros((3, 2)),
        Array2::zeros((3, 0)),
    );
    assert_error(result, ErrorKind::ZeroDimension, &["d_v", "[3, 0]"]);
}

#[test]
fn new_seeded_zero_d_model() {
    let result = Attention::<f32>::new_seeded(AttentionConfig::new(0, 2, 2), 0);
    assert_error(result, ErrorKind::ZeroDimension, &["d_model = 0"]);
}

#[test]
fn new_seeded_zero_d_k() {
    let result = CausalAttention::<f32>::new_seeded(AttentionConfig::new(2, 0, 2), 0);
    assert_error(result, ErrorKind::ZeroDimension, &["d_k = 0"]);
}

#[test]
fn new_seeded_zero_d_v() {
    let result = Attention::<f64>::new_seeded(AttentionConfig::new(2, 2, 0), 0);
    assert_error(result, ErrorKind::ZeroDimension, &["d_v = 0"]);
}

fn layer() -> Attention<f64> {
    Attention::new_seeded(AttentionConfig::new(4, 3, 2), 5).unwrap()
}

fn causal_layer() -> CausalAttention<f64> {
    CausalAttention::new_seeded(AttentionConfig::new(4, 3, 2), 5).unwrap()
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
