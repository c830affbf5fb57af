//! Rotary position embeddings inside the layers (`AttentionConfig::with_rope`):
//! the forward against the manual path (project, `apply_rope` on q and k,
//! the functional attention, the output projection) in f64 and f32;
//! prefill then token-by-token `step` against the full causal forward, with
//! a growing and a ring cache; the backward against central finite
//! differences in f64; and the errors (a bad rotary dim when the layer is
//! built, a position past the table when it runs).

use crate::common;

use common::Rng;
use ndarray::{Array1, Array2, Array3, Array4, Axis, s};
use sdpa::{
    Attention, AttentionConfig, AttentionOptions, CausalAttention, Element, ErrorKind,
    LayerParameters, RopeConfig, RopeLayout, RopePositions, RopeTable, apply_rope,
    scaled_dot_product_attention,
};

/// Four query heads of 8 over `d_model = 16`, two key/value heads, biases
/// and an output projection: every part of the data path.
fn config(rope: RopeConfig) -> AttentionConfig {
    AttentionConfig::new(16, 4)
        .with_head_dim(8)
        .with_kv_heads(2)
        .with_output_projection(12)
        .with_bias(true)
        .with_rope(rope)
}

/// The ropes the tests run over: full and partial rotary, both layouts.
fn ropes() -> Vec<RopeConfig> {
    vec![
        RopeConfig::new(10_000.0, 64),
        RopeConfig::new(500.0, 64).with_rotary_dim(6),
        RopeConfig::new(10_000.0, 64).with_layout(RopeLayout::Interleaved),
        RopeConfig::new(50.0, 64)
            .with_rotary_dim(4)
            .with_layout(RopeLayout::Interleaved),
    ]
}

fn random_parameters<F: Element>(config: &AttentionConfig, seed: u64) -> LayerParameters<F> {
    let mut rng = Rng::new(seed);
    let c = config;
    let mut w = |rows: usize, cols: usize| {
        Array2::from_shape_simple_fn((rows, cols), || common::cast::<F>(rng.uniform(-0.8, 0.8)))
    };
    let (w_q, w_k, w_v) = (
        w(c.d_model, c.heads * c.d_k()),
        w(c.d_model, c.kv_heads * c.d_k()),
        w(c.d_model, c.kv_heads * c.d_v()),
    );
    let w_o = w(c.heads * c.d_v(), c.output_width());
    let mut b =
        |n: usize| Array1::from_shape_simple_fn(n, || common::cast::<F>(rng.uniform(-0.5, 0.5)));
    let biases = (
        b(c.heads * c.d_k()),
        b(c.kv_heads * c.d_k()),
        b(c.kv_heads * c.d_v()),
    );
    let b_o = b(c.output_width());
    LayerParameters::new(w_q, w_k, w_v)
        .with_output(w_o)
        .with_biases(biases.0, biases.1, biases.2)
        .with_output_bias(b_o)
}

fn random_input<F: Element>(shape: (usize, usize, usize), seed: u64) -> Array3<F> {
    let mut rng = Rng::new(seed);
    Array3::from_shape_simple_fn(shape, || common::cast::<F>(rng.uniform(-1.0, 1.0)))
}

/// `x · w + b` over `[batch, len, width]`.
fn linear<F: Element>(x: &Array3<F>, w: &Array2<F>, b: &Array1<F>) -> Array3<F> {
    let (batch, len, width) = x.dim();
    let rows = x.to_shape((batch * len, width)).unwrap();
    let out = rows.dot(w) + b;
    out.into_shape_with_order((batch, len, w.ncols())).unwrap()
}

/// `[batch, len, heads·d]` → `[batch, heads, len, d]`.
fn split<F: Element>(x: Array3<F>, heads: usize) -> Array4<F> {
    let (batch, len, width) = x.dim();
    x.into_shape_with_order((batch, len, heads, width / heads))
        .unwrap()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned()
}

/// The layer's forward written out by hand with the functional API.
fn manual<F: Element>(
    config: &AttentionConfig,
    p: &LayerParameters<F>,
    x: &Array3<F>,
    causal: bool,
) -> Array3<F> {
    let rope = config.rope.unwrap();
    let table = RopeTable::<F>::new(
        rope.rotary_dim.unwrap_or(config.d_k()),
        rope.theta,
        rope.max_positions,
    )
    .unwrap()
    .with_layout(rope.layout);
    let q = split(linear(x, &p.w_q, p.b_q.as_ref().unwrap()), config.heads);
    let k = split(linear(x, &p.w_k, p.b_k.as_ref().unwrap()), config.kv_heads);
    let v = split(linear(x, &p.w_v, p.b_v.as_ref().unwrap()), config.kv_heads);
    let q = apply_rope(q.view(), &table, RopePositions::Start(0)).unwrap();
    let k = apply_rope(k.view(), &table, RopePositions::Start(0)).unwrap();
    let opts = if causal {
        AttentionOptions::new().causal()
    } else {
        AttentionOptions::new()
    };
    let heads = scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap();
    let (batch, h, len, d_v) = heads.dim();
    let merged = heads
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order((batch, len, h * d_v))
        .unwrap();
    linear(&merged, p.w_o.as_ref().unwrap(), p.b_o.as_ref().unwrap())
}

fn max_difference<F: Element>(a: &Array3<F>, b: &Array3<F>) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (common::to_f64(x) - common::to_f64(y)).abs())
        .fold(0.0, f64::max)
}

fn forward_equals_manual<F: Element>(tolerance: f64) {
    for (i, rope) in ropes().into_iter().enumerate() {
        let config = config(rope);
        let p = random_parameters::<F>(&config, 10 + i as u64);
        let x = random_input::<F>((2, 7, 16), 20 + i as u64);
        let bidirectional = Attention::new(config, p.clone()).unwrap();
        let causal = CausalAttention::new(config, p.clone()).unwrap();
        let d = max_difference(
            &bidirectional.forward_batch(x.view()).unwrap(),
            &manual(&config, &p, &x, false),
        );
        assert!(d < tolerance, "{rope:?}: bidirectional off by {d}");
        let d = max_difference(
            &causal.forward_batch(x.view()).unwrap(),
            &manual(&config, &p, &x, true),
        );
        assert!(d < tolerance, "{rope:?}: causal off by {d}");
        // One sequence: the batch of one.
        let one = causal.forward(x.index_axis(Axis(0), 1)).unwrap();
        let manual_one = manual(&config, &p, &x.slice(s![1..2, .., ..]).to_owned(), true);
        let d = max_difference(&one.insert_axis(Axis(0)), &manual_one);
        assert!(d < tolerance, "{rope:?}: one sequence off by {d}");
    }
}

#[test]
fn forward_equals_the_manual_path_f64() {
    forward_equals_manual::<f64>(1e-12);
}

#[test]
fn forward_equals_the_manual_path_f32() {
    forward_equals_manual::<f32>(2e-5);
}

#[test]
fn rope_changes_the_output_and_position_zero_alone_is_not_rotated() {
    let rope = RopeConfig::new(10_000.0, 64);
    let with = config(rope);
    let mut without = with;
    without.rope = None;
    let p = random_parameters::<f64>(&with, 1);
    let x = random_input::<f64>((1, 5, 16), 2);
    let a = CausalAttention::new(with, p.clone())
        .unwrap()
        .forward_batch(x.view())
        .unwrap();
    let b = CausalAttention::new(without, p)
        .unwrap()
        .forward_batch(x.view())
        .unwrap();
    // Row 0 attends only to itself (q and k both at position 0: no rotation).
    assert!(
        max_difference(
            &a.slice(s![.., ..1, ..]).to_owned(),
            &b.slice(s![.., ..1, ..]).to_owned()
        ) < 1e-14
    );
    assert!(max_difference(&a, &b) > 1e-3);
    assert_ne!(with, without);
}

fn decode_equals_forward<F: Element>(window: Option<usize>, tolerance: f64) {
    for (i, rope) in ropes().into_iter().enumerate() {
        let config = config(rope);
        let layer =
            CausalAttention::new(config, random_parameters::<F>(&config, 30 + i as u64)).unwrap();
        let (batch, len, prompt) = (2, 13, 5);
        let x = random_input::<F>((batch, len, 16), 40 + i as u64);
        let opts = match window {
            Some(w) => AttentionOptions::new().window(w),
            None => AttentionOptions::new(),
        };
        let full = layer.forward_batch_with(x.view(), &opts).unwrap();
        let mut cache = match window {
            Some(w) => layer.new_window_cache(batch, w).unwrap(),
            None => layer.new_cache(batch, 2).unwrap(),
        };
        let out = layer
            .prefill(x.slice(s![.., ..prompt, ..]), &mut cache)
            .unwrap();
        let d = max_difference(&out, &full.slice(s![.., ..prompt, ..]).to_owned());
        assert!(
            d < tolerance,
            "{rope:?}, window {window:?}: prefill off by {d}"
        );
        // One token at a time, then two at once.
        let mut t = prompt;
        while t < len {
            let n = if t + 2 == len { 2 } else { 1 };
            let out = layer
                .step(x.slice(s![.., t..t + n, ..]), &mut cache)
                .unwrap();
            let d = max_difference(&out, &full.slice(s![.., t..t + n, ..]).to_owned());
            assert!(
                d < tolerance,
                "{rope:?}, window {window:?}: step at {t} off by {d}"
            );
            t += n;
        }
        assert_eq!(cache.total_len(), len);
    }
}

#[test]
fn prefill_then_step_equals_the_causal_forward() {
    decode_equals_forward::<f64>(None, 1e-12);
    decode_equals_forward::<f32>(None, 2e-5);
}

#[test]
fn a_ring_cache_rotates_by_the_absolute_position() {
    // A window of 4 < the 13 tokens: slots wrap, positions do not.
    decode_equals_forward::<f64>(Some(4), 1e-12);
    decode_equals_forward::<f32>(Some(4), 2e-5);
}

#[test]
fn the_cache_holds_the_keys_rotated() {
    let rope = RopeConfig::new(100.0, 64);
    let config = AttentionConfig::new(8, 2).with_rope(rope);
    let p = random_parameters::<f64>(&config.with_output_projection(8).with_bias(true), 3);
    let p = LayerParameters::new(p.w_q, p.w_k, p.w_v);
    let layer = CausalAttention::new(config, p.clone()).unwrap();
    let x = random_input::<f64>((1, 6, 8), 4);
    let mut cache = layer.new_cache(1, 8).unwrap();
    layer.prefill(x.view(), &mut cache).unwrap();
    let table = RopeTable::<f64>::new(4, 100.0, 64).unwrap();
    let k = split(linear(&x, &p.w_k, &Array1::zeros(8)), 2);
    let expected = apply_rope(k.view(), &table, RopePositions::Start(0)).unwrap();
    let keys = cache.keys();
    assert!(
        keys.iter()
            .zip(&expected)
            .all(|(a, b)| (a - b).abs() < 1e-12)
    );
}

/// `L = Σ R ∘ Y`: the layer's gradients against central differences.
fn check_gradients(
    layer: &mut CausalAttention<f64>,
    bidirectional: Option<&mut Attention<f64>>,
    x: &Array3<f64>,
) {
    let mut rng = Rng::new(99);
    let (y, _) = layer
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap();
    let r = Array3::from_shape_simple_fn(y.dim(), || rng.uniform(-1.0, 1.0));
    let h = 1e-6;
    let relative = |analytic: f64, numeric: f64| (analytic - numeric).abs() / (1.0 + numeric.abs());

    // Causal layer.
    let (_, cache) = layer
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap();
    let grads = layer.backward(&cache, r.view()).unwrap();
    let loss = |layer: &CausalAttention<f64>, x: &Array3<f64>| {
        (&layer.forward_batch(x.view()).unwrap() * &r).sum()
    };
    let mut worst: f64 = 0.0;
    for (index, &g) in grads.d_x.indexed_iter() {
        let (mut plus, mut minus) = (x.clone(), x.clone());
        plus[index] += h;
        minus[index] -= h;
        let numeric = (loss(layer, &plus) - loss(layer, &minus)) / (2.0 * h);
        worst = worst.max(relative(g, numeric));
    }
    let analytic: Vec<Vec<f64>> = grads
        .d_parameters
        .iter()
        .map(|(_, g)| g.iter().copied().collect())
        .collect();
    for (which, parameter) in analytic.iter().enumerate() {
        for (e, &g) in parameter.iter().enumerate() {
            let perturb = |layer: &mut CausalAttention<f64>, delta: f64| {
                let (_, mut p) = layer.parameters_mut().nth(which).unwrap();
                let v = p.iter_mut().nth(e).unwrap();
                *v += delta;
            };
            perturb(layer, h);
            let up = loss(layer, x);
            perturb(layer, -2.0 * h);
            let down = loss(layer, x);
            perturb(layer, h);
            worst = worst.max(relative(g, (up - down) / (2.0 * h)));
        }
    }
    assert!(worst < 1e-6, "causal: worst relative error {worst}");

    // Bidirectional layer: d_x only (the parameters share the code path).
    if let Some(layer) = bidirectional {
        let (_, cache) = layer
            .forward_train(x.view(), &AttentionOptions::new())
            .unwrap();
        let grads = layer.backward(&cache, r.view()).unwrap();
        let loss = |x: &Array3<f64>| (&layer.forward_batch(x.view()).unwrap() * &r).sum();
        let mut worst: f64 = 0.0;
        for (index, &g) in grads.d_x.indexed_iter() {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus[index] += h;
            minus[index] -= h;
            worst = worst.max(relative(g, (loss(&plus) - loss(&minus)) / (2.0 * h)));
        }
        assert!(worst < 1e-6, "bidirectional: worst relative error {worst}");
    }
}

#[test]
fn gradients_through_rope_match_finite_differences() {
    for (i, rope) in ropes().into_iter().enumerate() {
        let config = config(rope);
        let p = random_parameters::<f64>(&config, 50 + i as u64);
        let mut causal = CausalAttention::new(config, p.clone()).unwrap();
        let mut bidirectional = Attention::new(config, p).unwrap();
        let x = random_input::<f64>((2, 5, 16), 60 + i as u64);
        check_gradients(&mut causal, Some(&mut bidirectional), &x);
    }
}

#[test]
fn gradients_differ_from_the_layer_without_rope() {
    // Guards against a backward that ignores the rotation.
    let with = config(RopeConfig::new(10.0, 64));
    let mut without = with;
    without.rope = None;
    let p = random_parameters::<f64>(&with, 5);
    let x = random_input::<f64>((1, 6, 16), 6);
    let r = random_input::<f64>((1, 6, 12), 7);
    let gradient = |config| {
        let layer = CausalAttention::new(config, p.clone()).unwrap();
        let (_, cache) = layer
            .forward_train(x.view(), &AttentionOptions::new())
            .unwrap();
        layer.backward(&cache, r.view()).unwrap().d_x
    };
    assert!(max_difference(&gradient(with), &gradient(without)) > 1e-3);
}

#[test]
fn a_bad_rope_is_an_error_when_the_layer_is_built() {
    let base = AttentionConfig::new(16, 2)
        .with_output_projection(12)
        .with_bias(true); // d_k = 8
    let cases = [
        (
            RopeConfig::new(10_000.0, 8).with_rotary_dim(5),
            ErrorKind::InvalidOption,
            "even",
        ),
        (
            RopeConfig::new(10_000.0, 8).with_rotary_dim(10),
            ErrorKind::ShapeMismatch,
            "rotary_dim = 10",
        ),
        (RopeConfig::new(-1.0, 8), ErrorKind::InvalidOption, "theta"),
        (
            RopeConfig::new(f64::NAN, 8),
            ErrorKind::InvalidOption,
            "theta",
        ),
    ];
    for (rope, kind, words) in cases {
        let config = base.with_rope(rope);
        for err in [
            Attention::<f32>::new_seeded(config, 0).unwrap_err(),
            CausalAttention::<f64>::new_seeded(config, 0).unwrap_err(),
            Attention::<f64>::new(config, random_parameters(&config, 0)).unwrap_err(),
        ] {
            assert_eq!(err.kind(), kind, "{rope:?}: {err}");
            assert!(err.to_string().contains(words), "{rope:?}: {err}");
        }
    }
    // An odd head width with all of it rotary.
    let err = Attention::<f32>::new_seeded(
        AttentionConfig::new(6, 2).with_rope(RopeConfig::new(10.0, 8)),
        0,
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidOption);
    // Partial rotary of an odd head width is fine.
    Attention::<f32>::new_seeded(
        AttentionConfig::new(6, 2).with_rope(RopeConfig::new(10.0, 8).with_rotary_dim(2)),
        0,
    )
    .unwrap();
}

#[test]
fn a_position_past_the_table_is_an_error_naming_max_positions() {
    let config = AttentionConfig::new(8, 2).with_rope(RopeConfig::new(10_000.0, 6));
    let layer = CausalAttention::<f32>::new_seeded(config, 0).unwrap();
    let x = random_input::<f32>((1, 7, 8), 1);
    let err = layer.forward_batch(x.view()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Positions);
    assert!(err.to_string().contains("max_positions = 6"), "{err}");
    let err = layer
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Positions);
    // Six tokens fit; the seventh, in a step, does not, and the cache is kept.
    let mut cache = layer.new_window_cache(1, 3).unwrap();
    layer.prefill(x.slice(s![.., ..6, ..]), &mut cache).unwrap();
    let err = layer
        .step(x.slice(s![.., 6.., ..]), &mut cache)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Positions);
    assert!(err.to_string().contains("max_positions = 6"), "{err}");
    assert_eq!(cache.total_len(), 6);
}
