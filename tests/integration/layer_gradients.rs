//! Layer gradients: `forward_train` + `backward` of `Attention` and
//! `CausalAttention` against central finite differences in f64 (every
//! input, weight and bias entry, and the options' attention bias) for every
//! layer configuration — the seed's single head, multi-head, grouped and
//! multi-query heads, `W^O` with and without biases, cross-attention,
//! causal, key lengths, keep masks, windows, scale — with relative error
//! ≤ 1e-6; the f32 layer (fused backward) against the f64 layer (reference
//! backward); random shapes and options by proptest; the parameter
//! access an optimiser uses; and one test per bad shape.
//!
//! The loss is `L = Σ R ∘ Y` for a fixed random `R`, so `∂L/∂Y = R`.

use crate::common;

use common::Rng;
use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, Axis, s};
use proptest::prelude::*;
use sdpa::{
    Attention, AttentionConfig, AttentionError, AttentionOptions, CausalAlignment, CausalAttention,
    Element, ErrorKind, ForwardCache, LayerGradients, LayerParameters,
};

fn cast<F: Element>(x: f64) -> F {
    common::cast(x)
}

fn to_f64<F: Element>(x: F) -> f64 {
    common::to_f64(x)
}

/// Which layer and which forward a case runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// `Attention::forward_train`.
    SelfAttention,
    /// `Attention::forward_cross_train`.
    Cross,
    /// `CausalAttention::forward_train`.
    Causal,
}

/// Either layer type, so one harness drives both.
enum Layer<F> {
    Bidirectional(Attention<F>),
    Causal(CausalAttention<F>),
}

impl<F: Element> Layer<F> {
    fn parameters_mut(&mut self) -> Vec<(&'static str, ndarray::ArrayViewMutD<'_, F>)> {
        match self {
            Layer::Bidirectional(layer) => layer.parameters_mut().collect(),
            Layer::Causal(layer) => layer.parameters_mut().collect(),
        }
    }

    fn parameter_names(&self) -> Vec<&'static str> {
        match self {
            Layer::Bidirectional(layer) => {
                layer.parameters().iter().map(|(name, _)| name).collect()
            }
            Layer::Causal(layer) => layer.parameters().iter().map(|(name, _)| name).collect(),
        }
    }

    fn backward(
        &self,
        cache: &ForwardCache<'_, F>,
        d_output: ArrayView3<'_, F>,
    ) -> Result<LayerGradients<F>, AttentionError> {
        match self {
            Layer::Bidirectional(layer) => layer.backward(cache, d_output),
            Layer::Causal(layer) => layer.backward(cache, d_output),
        }
    }
}

/// A layer configuration, its weights, its inputs, the options of the
/// call (owned, so they can be cast and perturbed) and `R = ∂L/∂Y`.
#[derive(Debug, Clone)]
struct Case<F> {
    kind: Kind,
    config: AttentionConfig,
    weights: LayerParameters<F>,
    x: Array3<F>,
    x_kv: Option<Array3<F>>,
    keep_mask: Option<Array4<bool>>,
    attention_bias: Option<Array4<F>>,
    key_lengths: Option<Vec<usize>>,
    causal: Option<CausalAlignment>,
    window: Option<usize>,
    scale: Option<F>,
    d_y: Array3<F>,
}

fn random2(rng: &mut Rng, (rows, cols): (usize, usize), bound: f64) -> Array2<f64> {
    Array2::from_shape_simple_fn((rows, cols), || rng.uniform(-bound, bound))
}

fn random3(rng: &mut Rng, shape: (usize, usize, usize)) -> Array3<f64> {
    Array3::from_shape_simple_fn(shape, || rng.uniform(-1.0, 1.0))
}

impl Case<f64> {
    /// Random weights (biases too, so none is zero) and inputs:
    /// `len_kv` is used by cross-attention only.
    fn new(
        kind: Kind,
        config: AttentionConfig,
        batch: usize,
        len_q: usize,
        len_kv: usize,
        seed: u64,
    ) -> Self {
        let mut rng = Rng::new(seed);
        let c = &config;
        let width_kv = c.kv_input_width();
        // Weights a little larger than Xavier, so the attention is not flat.
        let w = |rng: &mut Rng, rows: usize, cols: usize| random2(rng, (rows, cols), 1.0);
        let mut weights = LayerParameters::new(
            w(&mut rng, c.d_model, c.heads * c.d_k()),
            w(&mut rng, width_kv, c.kv_heads * c.d_k()),
            w(&mut rng, width_kv, c.kv_heads * c.d_v()),
        );
        if let Some(d_model_out) = c.d_model_out {
            weights = weights.with_output(w(&mut rng, c.heads * c.d_v(), d_model_out));
        }
        if c.bias {
            let b = |rng: &mut Rng, len: usize| {
                Array1::from_shape_simple_fn(len, || rng.uniform(-0.5, 0.5))
            };
            weights = weights.with_biases(
                b(&mut rng, c.heads * c.d_k()),
                b(&mut rng, c.kv_heads * c.d_k()),
                b(&mut rng, c.kv_heads * c.d_v()),
            );
            if let Some(d_model_out) = c.d_model_out {
                weights = weights.with_output_bias(b(&mut rng, d_model_out));
            }
        }
        let x = random3(&mut rng, (batch, len_q, c.d_model));
        let x_kv = (kind == Kind::Cross).then(|| random3(&mut rng, (batch, len_kv, width_kv)));
        let d_y = random3(&mut rng, (batch, len_q, c.output_width()));
        Case {
            kind,
            config,
            weights,
            x,
            x_kv,
            keep_mask: None,
            attention_bias: None,
            key_lengths: None,
            causal: None,
            window: None,
            scale: None,
            d_y,
        }
    }

    fn with_key_lengths(mut self, lengths: &[usize]) -> Self {
        self.key_lengths = Some(lengths.to_vec());
        self
    }

    /// A random keep mask of `shape` (`[b|1, h|1, len_q, len_kv]`).
    fn with_keep_mask(mut self, shape: [usize; 4], seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        self.keep_mask = Some(Array4::from_shape_simple_fn(shape, || rng.chance(0.7)));
        self
    }

    /// A random attention bias of `shape` (`[b|1, h|1, len_q, len_kv]`).
    fn with_attention_bias(mut self, shape: [usize; 4], seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        self.attention_bias = Some(Array4::from_shape_simple_fn(shape, || {
            rng.uniform(-1.0, 1.0)
        }));
        self
    }

    fn with_causal(mut self, alignment: CausalAlignment) -> Self {
        self.causal = Some(alignment);
        self
    }

    fn with_window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }

    fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
}

fn cast3<F: Element, G: Element>(a: &Array3<F>) -> Array3<G> {
    a.mapv(|x| cast(to_f64(x)))
}

impl<F: Element> Case<F> {
    /// The same case in another element type (rounded when narrower).
    fn cast<G: Element>(&self) -> Case<G> {
        let m2 = |a: &Array2<F>| a.mapv(|x| cast::<G>(to_f64(x)));
        let m1 = |a: &Array1<F>| a.mapv(|x| cast::<G>(to_f64(x)));
        let w = &self.weights;
        let mut weights = LayerParameters::new(m2(&w.w_q), m2(&w.w_k), m2(&w.w_v));
        weights.w_o = w.w_o.as_ref().map(m2);
        weights.b_q = w.b_q.as_ref().map(m1);
        weights.b_k = w.b_k.as_ref().map(m1);
        weights.b_v = w.b_v.as_ref().map(m1);
        weights.b_o = w.b_o.as_ref().map(m1);
        Case {
            kind: self.kind,
            config: self.config,
            weights,
            x: cast3(&self.x),
            x_kv: self.x_kv.as_ref().map(cast3),
            keep_mask: self.keep_mask.clone(),
            attention_bias: self
                .attention_bias
                .as_ref()
                .map(|b| b.mapv(|x| cast(to_f64(x)))),
            key_lengths: self.key_lengths.clone(),
            causal: self.causal,
            window: self.window,
            scale: self.scale.map(|s| cast(to_f64(s))),
            d_y: cast3(&self.d_y),
        }
    }

    fn options(&self) -> AttentionOptions<'_, F> {
        let mut opts = AttentionOptions::new();
        if let Some(mask) = &self.keep_mask {
            opts = opts.keep_mask(mask.view());
        }
        if let Some(bias) = &self.attention_bias {
            opts = opts.bias(bias.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some(alignment) = self.causal {
            opts = opts.causal_aligned(alignment);
        }
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(scale);
        }
        opts
    }

    fn layer(&self) -> Layer<F> {
        match self.kind {
            Kind::SelfAttention | Kind::Cross => Layer::Bidirectional(
                Attention::new(self.config, self.weights.clone()).expect("a valid case"),
            ),
            Kind::Causal => Layer::Causal(
                CausalAttention::new(self.config, self.weights.clone()).expect("a valid case"),
            ),
        }
    }

    fn forward_train(
        &self,
        layer: &Layer<F>,
    ) -> Result<(Array3<F>, ForwardCache<'_, F>), AttentionError> {
        let opts = self.options();
        match (layer, self.kind) {
            (Layer::Bidirectional(layer), Kind::Cross) => layer.forward_cross_train(
                self.x.view(),
                self.x_kv.as_ref().expect("cross").view(),
                &opts,
            ),
            (Layer::Bidirectional(layer), _) => layer.forward_train(self.x.view(), &opts),
            (Layer::Causal(layer), _) => layer.forward_train(self.x.view(), &opts),
        }
    }

    /// The plain forward of the same call, for comparison.
    fn forward(&self, layer: &Layer<F>) -> Array3<F> {
        let opts = self.options();
        match (layer, self.kind) {
            (Layer::Bidirectional(layer), Kind::Cross) => layer.forward_cross_with(
                self.x.view(),
                self.x_kv.as_ref().expect("cross").view(),
                &opts,
            ),
            (Layer::Bidirectional(layer), _) => layer.forward_batch_with(self.x.view(), &opts),
            (Layer::Causal(layer), _) => layer.forward_batch_with(self.x.view(), &opts),
        }
        .expect("a valid case")
    }

    /// `L = Σ R ∘ Y`, in f64.
    fn loss(&self, layer: &Layer<F>) -> f64 {
        let y = self.forward(layer);
        y.iter()
            .zip(&self.d_y)
            .map(|(&y, &r)| to_f64(y) * to_f64(r))
            .sum()
    }

    fn gradients(&self) -> LayerGradients<F> {
        let layer = self.layer();
        let (_, cache) = self.forward_train(&layer).expect("a valid case");
        layer
            .backward(&cache, self.d_y.view())
            .expect("a valid case")
    }
}

/// What a finite difference perturbs.
#[derive(Debug, Clone, Copy)]
enum Target {
    X,
    XKv,
    /// The layer's parameter at this index of `parameters_mut`.
    Parameter(usize),
    AttentionBias,
}

impl Case<f64> {
    /// The loss with entry `index` (in logical order) of `target` moved by `delta`.
    fn loss_at(&self, target: Target, index: usize, delta: f64) -> f64 {
        let mut case = self.clone();
        let mut layer = self.layer();
        let entry: &mut f64 = match target {
            Target::X => case.x.iter_mut().nth(index).unwrap(),
            Target::XKv => case.x_kv.as_mut().unwrap().iter_mut().nth(index).unwrap(),
            Target::AttentionBias => case
                .attention_bias
                .as_mut()
                .unwrap()
                .iter_mut()
                .nth(index)
                .unwrap(),
            Target::Parameter(p) => {
                let mut parameters = layer.parameters_mut();
                *parameters[p].1.iter_mut().nth(index).unwrap() += delta;
                drop(parameters);
                return case.loss(&layer);
            }
        };
        *entry += delta;
        case.loss(&layer)
    }

    /// `∂L/∂target[index]` by the fourth-order central difference
    /// `(−L(2h) + 8·L(h) − 8·L(−h) + L(−2h)) / 12h`: its truncation error
    /// is O(h⁴), far below the 1e-6 checked.
    fn finite_difference(&self, target: Target, index: usize) -> f64 {
        const H: f64 = 1e-3;
        let l = |delta| self.loss_at(target, index, delta);
        (-l(2.0 * H) + 8.0 * l(H) - 8.0 * l(-H) + l(-2.0 * H)) / (12.0 * H)
    }

    /// Compares every gradient to finite differences: all entries, or
    /// `sample` random entries of each tensor. Returns the largest relative
    /// error, after checking it against 1e-6. An error is relative to the
    /// tensor's largest gradient, or to 1% of the largest gradient of the
    /// whole case when the tensor's are all near zero (the key bias's
    /// gradient is zero up to rounding).
    fn check_gradients(&self, sample: Option<(usize, u64)>) -> Result<f64, String> {
        let grads = self.gradients();
        let layer = self.layer();
        let names = layer.parameter_names();
        let grad_names: Vec<_> = grads.d_parameters.iter().map(|(name, _)| name).collect();
        if names != grad_names {
            return Err(format!("parameters {names:?} but gradients {grad_names:?}"));
        }
        if !grads.d_x.is_standard_layout()
            || grads
                .d_parameters
                .iter()
                .any(|(_, g)| !g.is_standard_layout())
        {
            return Err("a gradient is not in row-major order".into());
        }
        let mut tensors: Vec<(String, Target, Vec<f64>)> =
            vec![("d_x".into(), Target::X, grads.d_x.iter().copied().collect())];
        match (&grads.d_x_kv, self.kind) {
            (Some(d), Kind::Cross) => {
                tensors.push(("d_x_kv".into(), Target::XKv, d.iter().copied().collect()))
            }
            (None, Kind::Cross) => return Err("cross-attention without d_x_kv".into()),
            (Some(_), _) => return Err("self-attention with d_x_kv".into()),
            (None, _) => {}
        }
        for (p, (name, g)) in grads.d_parameters.iter().enumerate() {
            tensors.push((
                format!("d_{name}"),
                Target::Parameter(p),
                g.iter().copied().collect(),
            ));
        }
        match (&grads.d_attention_bias, &self.attention_bias) {
            (Some(d), Some(_)) => tensors.push((
                "d_attention_bias".into(),
                Target::AttentionBias,
                d.iter().copied().collect(),
            )),
            (None, None) => {}
            _ => return Err("d_attention_bias present without a bias, or missing with one".into()),
        }
        let global = tensors
            .iter()
            .flat_map(|(_, _, g)| g.iter())
            .fold(0.0_f64, |m, g| m.max(g.abs()));
        let mut rng = sample.map(|(_, seed)| Rng::new(seed));
        let mut worst: f64 = 0.0;
        for (name, target, analytic) in &tensors {
            if analytic.iter().any(|g| !g.is_finite()) {
                return Err(format!("{name} is not finite: {analytic:?}"));
            }
            let indices: Vec<usize> = match (&mut rng, sample) {
                (Some(rng), Some((n, _))) if analytic.len() > n => {
                    (0..n).map(|_| rng.below(analytic.len())).collect()
                }
                _ => (0..analytic.len()).collect(),
            };
            let scale = analytic
                .iter()
                .fold(0.0_f64, |m, g| m.max(g.abs()))
                .max(1e-2 * global)
                .max(1e-12);
            for i in indices {
                let numeric = self.finite_difference(*target, i);
                let error = (numeric - analytic[i]).abs() / scale;
                worst = worst.max(error);
                if error > 1e-6 {
                    return Err(format!(
                        "{name}[{i}]: analytic {} vs finite difference {numeric} \
                         (relative error {error:.2e}, scale {scale:.3e})",
                        analytic[i]
                    ));
                }
            }
        }
        Ok(worst)
    }
}

fn assert_gradients_match_finite_differences(case: &Case<f64>) {
    match case.check_gradients(None) {
        Ok(worst) => assert!(worst <= 1e-6),
        Err(message) => panic!("{message}\n{case:#?}"),
    }
}

// ---------------------------------------------------------------------------
// Finite differences, one test per layer configuration.

#[test]
fn seed_single_head_layer() {
    let case = Case::new(
        Kind::SelfAttention,
        AttentionConfig::new(5, 1)
            .with_head_dim(3)
            .with_value_dim(4),
        2,
        4,
        0,
        1,
    );
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn seed_single_head_causal_layer() {
    let case = Case::new(Kind::Causal, AttentionConfig::new(4, 1), 1, 5, 0, 2);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn multi_head_without_output_projection() {
    let config = AttentionConfig::new(6, 3).with_value_dim(3);
    assert_gradients_match_finite_differences(&Case::new(Kind::SelfAttention, config, 2, 4, 0, 3));
}

#[test]
fn output_projection_without_biases() {
    let config = AttentionConfig::new(5, 2)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_output_projection(4);
    assert_gradients_match_finite_differences(&Case::new(Kind::SelfAttention, config, 2, 4, 0, 4));
}

#[test]
fn output_projection_with_biases() {
    let config = AttentionConfig::new(5, 2)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_output_projection(4)
        .with_bias(true);
    assert_gradients_match_finite_differences(&Case::new(Kind::SelfAttention, config, 2, 4, 0, 5));
}

#[test]
fn biases_without_output_projection() {
    let config = AttentionConfig::new(4, 2).with_value_dim(3).with_bias(true);
    assert_gradients_match_finite_differences(&Case::new(Kind::SelfAttention, config, 2, 3, 0, 6));
}

#[test]
fn grouped_query_heads() {
    let config = AttentionConfig::new(6, 4)
        .with_head_dim(2)
        .with_kv_heads(2)
        .with_output_projection(6)
        .with_bias(true);
    assert_gradients_match_finite_differences(&Case::new(Kind::SelfAttention, config, 2, 4, 0, 7));
}

#[test]
fn multi_query_heads() {
    let config = AttentionConfig::new(4, 3)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_kv_heads(1)
        .with_output_projection(3);
    assert_gradients_match_finite_differences(&Case::new(Kind::SelfAttention, config, 1, 5, 0, 8));
}

#[test]
fn cross_attention() {
    let config = AttentionConfig::new(4, 2)
        .with_value_dim(3)
        .with_kv_heads(1)
        .with_d_model_kv(6)
        .with_output_projection(5)
        .with_bias(true);
    assert_gradients_match_finite_differences(&Case::new(Kind::Cross, config, 2, 3, 5, 9));
}

#[test]
fn cross_attention_with_key_lengths() {
    let config = AttentionConfig::new(3, 2)
        .with_head_dim(2)
        .with_d_model_kv(5)
        .with_output_projection(3);
    let case = Case::new(Kind::Cross, config, 3, 4, 5, 10).with_key_lengths(&[5, 2, 0]);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn cross_attention_causal_both_alignments() {
    let config = AttentionConfig::new(4, 2)
        .with_d_model_kv(3)
        .with_bias(true);
    for alignment in [CausalAlignment::BottomRight, CausalAlignment::TopLeft] {
        let case = Case::new(Kind::Cross, config, 2, 3, 5, 11).with_causal(alignment);
        assert_gradients_match_finite_differences(&case);
    }
}

#[test]
fn causal_multi_head_layer() {
    let config = AttentionConfig::new(6, 4)
        .with_head_dim(2)
        .with_value_dim(3)
        .with_kv_heads(2)
        .with_output_projection(5)
        .with_bias(true);
    assert_gradients_match_finite_differences(&Case::new(Kind::Causal, config, 2, 5, 0, 12));
}

#[test]
fn causal_layer_with_key_lengths() {
    let config = AttentionConfig::new(4, 2).with_output_projection(4);
    let case = Case::new(Kind::Causal, config, 3, 5, 0, 13).with_key_lengths(&[5, 3, 1]);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn bidirectional_layer_with_key_lengths() {
    // Length 0: every query of that item sees nothing and outputs zeros.
    let config = AttentionConfig::new(4, 2)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_bias(true)
        .with_output_projection(4);
    let case = Case::new(Kind::SelfAttention, config, 3, 4, 0, 14).with_key_lengths(&[4, 2, 0]);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn keep_mask_and_learned_attention_bias() {
    let config = AttentionConfig::new(4, 2).with_output_projection(3);
    // A per-item key mask, and a per-head bias shared by the batch (so its
    // gradient sums over the batch).
    let case = Case::new(Kind::SelfAttention, config, 2, 4, 0, 15)
        .with_keep_mask([2, 1, 4, 4], 16)
        .with_attention_bias([1, 2, 4, 4], 17);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn causal_window_and_scale() {
    let config = AttentionConfig::new(4, 2).with_kv_heads(1).with_bias(true);
    let case = Case::new(Kind::Causal, config, 2, 6, 0, 18)
        .with_window(2)
        .with_scale(0.8);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn causal_layer_with_attention_bias_broadcast_over_heads() {
    let config = AttentionConfig::new(4, 2).with_output_projection(4);
    let case = Case::new(Kind::Causal, config, 2, 4, 0, 19).with_attention_bias([1, 1, 4, 4], 20);
    assert_gradients_match_finite_differences(&case);
}

#[test]
fn empty_sequences_give_zero_gradients() {
    let config = AttentionConfig::new(4, 2)
        .with_output_projection(3)
        .with_bias(true);
    let grads = Case::new(Kind::SelfAttention, config, 2, 0, 0, 21).gradients();
    assert_eq!(grads.d_x.shape(), &[2, 0, 4]);
    assert!(
        grads
            .d_parameters
            .iter()
            .all(|(_, g)| g.iter().all(|&g| g == 0.0))
    );

    // No keys: every query outputs zeros, so nothing has a gradient but b_o.
    let config = config.with_d_model_kv(5);
    let grads = Case::new(Kind::Cross, config, 2, 3, 0, 22).gradients();
    assert_eq!(grads.d_x_kv.as_ref().unwrap().shape(), &[2, 0, 5]);
    assert!(grads.d_x.iter().all(|&g| g == 0.0));
    for (name, g) in grads.d_parameters.iter() {
        assert_eq!(g.iter().all(|&g| g == 0.0), name != "b_o", "{name}");
    }
}

// ---------------------------------------------------------------------------
// Properties of the gradients and the API.

#[test]
fn forward_train_gives_the_forward_output() {
    let config = AttentionConfig::new(6, 4)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_kv_heads(2)
        .with_output_projection(5)
        .with_bias(true);
    let f64_case = Case::new(Kind::Causal, config, 2, 7, 0, 23).with_key_lengths(&[7, 4]);
    let f32_case = f64_case.cast::<f32>();
    let layer = f64_case.layer();
    let (y, _) = f64_case.forward_train(&layer).unwrap();
    assert_eq!(y, f64_case.forward(&layer));
    let layer = f32_case.layer();
    let (y, _) = f32_case.forward_train(&layer).unwrap();
    assert_eq!(y, f32_case.forward(&layer));
}

#[test]
fn key_bias_gradient_is_zero_up_to_rounding() {
    let config = AttentionConfig::new(5, 2)
        .with_head_dim(3)
        .with_value_dim(2)
        .with_output_projection(4)
        .with_bias(true);
    let grads = Case::new(Kind::Causal, config, 2, 6, 0, 24)
        .with_key_lengths(&[6, 3])
        .gradients();
    let d_b_k = grads.d_parameters.b_k.unwrap();
    let d_b_q = grads.d_parameters.b_q.unwrap();
    let largest = d_b_q.iter().fold(0.0_f64, |m, g| m.max(g.abs()));
    assert!(
        d_b_k.iter().all(|g| g.abs() <= 1e-13 * largest.max(1.0)),
        "{d_b_k}"
    );
}

#[test]
fn padding_and_other_items_get_nothing() {
    let config = AttentionConfig::new(4, 2).with_output_projection(4);
    let mut case = Case::new(Kind::SelfAttention, config, 2, 5, 0, 25).with_key_lengths(&[3, 5]);
    // The loss reads item 0's real positions only.
    case.d_y.slice_mut(s![0, 3.., ..]).fill(0.0);
    case.d_y.slice_mut(s![1, .., ..]).fill(0.0);
    let grads = case.gradients();
    assert!(grads.d_x.slice(s![0, 3.., ..]).iter().all(|&g| g == 0.0));
    assert!(grads.d_x.slice(s![1, .., ..]).iter().all(|&g| g == 0.0));
    assert!(grads.d_x.slice(s![0, ..3, ..]).iter().any(|&g| g != 0.0));
}

#[test]
fn strided_inputs_and_d_output_give_the_same_gradients() {
    let config = AttentionConfig::new(4, 2)
        .with_value_dim(3)
        .with_d_model_kv(5)
        .with_output_projection(3);
    let case = Case::new(Kind::Cross, config, 2, 3, 4, 26);
    let layer = match case.layer() {
        Layer::Bidirectional(layer) => layer,
        Layer::Causal(_) => unreachable!(),
    };
    let expected = case.gradients();
    // The same data in column-major layout, seen through reversed axes.
    let x = case.x.t().as_standard_layout().into_owned();
    let x_kv = case
        .x_kv
        .as_ref()
        .unwrap()
        .t()
        .as_standard_layout()
        .into_owned();
    let d_y = case.d_y.t().as_standard_layout().into_owned();
    let opts = case.options();
    let (_, cache) = layer.forward_cross_train(x.t(), x_kv.t(), &opts).unwrap();
    let grads = layer.backward(&cache, d_y.t()).unwrap();
    assert_eq!(grads, expected);
}

#[test]
fn sgd_step_lowers_the_loss_and_apply_gradients_pairs_parameters() {
    let config = AttentionConfig::new(6, 2)
        .with_output_projection(6)
        .with_bias(true);
    let case = Case::new(Kind::Causal, config, 2, 5, 0, 27);
    let grads = case.gradients();
    let Layer::Causal(mut layer) = case.layer() else {
        unreachable!()
    };
    let before = case.loss(&Layer::Causal(layer.clone()));
    layer.sgd_step(&grads, 1e-3).unwrap();
    let after = case.loss(&Layer::Causal(layer.clone()));
    let squared_norm: f64 = grads
        .d_parameters
        .iter()
        .map(|(_, g)| g.iter().map(|g| g * g).sum::<f64>())
        .sum();
    // A small step: the loss falls by about lr·‖∇‖².
    assert!(after < before);
    assert!(((before - after) / (1e-3 * squared_norm) - 1.0).abs() < 0.05);

    // apply_gradients hands each parameter its own gradient, by name.
    let mut seen = Vec::new();
    layer
        .apply_gradients(&grads, |name, parameter, gradient| {
            assert_eq!(parameter.shape(), gradient.shape(), "{name}");
            seen.push(name);
        })
        .unwrap();
    assert_eq!(
        seen,
        ["w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"]
    );
}

// ---------------------------------------------------------------------------
// f32 (fused backward) against f64 (reference backward).

/// The f32 gradients against the f64 gradients of the same (rounded) case:
/// within `tol` relative to each tensor's largest gradient, or to 10% of
/// the case's largest, or to the layer's terms (`max|d_y|·max(1, max|x|)·
/// max|W, b|`: a bias's gradient has no `x` in it), whichever is most: a
/// tensor that is zero up to rounding, such as `d_b_k` (a sum of terms
/// that cancel), carries the rounding of the terms, not of the result. So
/// does every input gradient where a row sees one key: there `P = 1` and
/// `dS = P·(dP − D)` is 0 exactly, but `dP` and `D` are the same dot
/// product summed in two orders, and f32 leaves a few ulps of `|dP|`
/// (about `|d_y|·|v|`), which the queries and keys carry into `d_x` and
/// the weights' gradients however small their real part is. Measured over
/// 2.3 million random cases: up to 9e-7 of the terms (sums over the
/// widths, rows and heads), so a floor of 1% of them (`tol` = 2e-5: 2e-7)
/// still failed one case in 300 000; a real bug is off by the order of
/// the terms.
fn assert_f32_matches_f64(case64: &Case<f64>, tol: f64) -> f64 {
    let case32 = case64.cast::<f32>();
    let case64 = case32.cast::<f64>();
    let g32 = case32.gradients();
    let g64 = case64.gradients();
    let pairs = |g: &LayerGradients<f64>, h: &LayerGradients<f32>| {
        let mut pairs: Vec<(String, Vec<f64>, Vec<f64>)> = vec![(
            "d_x".into(),
            g.d_x.iter().copied().collect(),
            h.d_x.iter().map(|&x| x as f64).collect(),
        )];
        if let (Some(a), Some(b)) = (&g.d_x_kv, &h.d_x_kv) {
            pairs.push((
                "d_x_kv".into(),
                a.iter().copied().collect(),
                b.iter().map(|&x| x as f64).collect(),
            ));
        }
        if let (Some(a), Some(b)) = (&g.d_attention_bias, &h.d_attention_bias) {
            pairs.push((
                "d_attention_bias".into(),
                a.iter().copied().collect(),
                b.iter().map(|&x| x as f64).collect(),
            ));
        }
        for ((name, a), (_, b)) in g.d_parameters.iter().zip(h.d_parameters.iter()) {
            pairs.push((
                name.into(),
                a.iter().copied().collect(),
                b.iter().map(|&x| x as f64).collect(),
            ));
        }
        pairs
    };
    assert_eq!(
        g32.d_parameters.iter().count(),
        g64.d_parameters.iter().count()
    );
    let pairs = pairs(&g64, &g32);
    let global = max_abs(pairs.iter().flat_map(|(_, a, _)| a));
    let w = &case64.weights;
    let inputs = max_abs(case64.x.iter().chain(case64.x_kv.iter().flatten()));
    let weights = max_abs(
        w.w_q
            .iter()
            .chain(&w.w_k)
            .chain(&w.w_v)
            .chain(w.w_o.iter().flatten())
            .chain(w.b_q.iter().flatten())
            .chain(w.b_k.iter().flatten())
            .chain(w.b_v.iter().flatten())
            .chain(w.b_o.iter().flatten()),
    );
    let terms = max_abs(&case64.d_y) * inputs.max(1.0) * weights;
    let mut worst: f64 = 0.0;
    for (name, reference, fast) in &pairs {
        let scale = max_abs(reference).max(0.1 * global).max(terms).max(1e-30);
        for (i, (a, b)) in reference.iter().zip(fast).enumerate() {
            let error = (a - b).abs() / scale;
            worst = worst.max(error);
            assert!(
                error <= tol,
                "{name}[{i}]: f64 {a} vs f32 {b} (relative error {error:.2e})"
            );
        }
    }
    worst
}

/// The largest magnitude among `values` (0 for none).
fn max_abs<'a>(values: impl IntoIterator<Item = &'a f64>) -> f64 {
    values.into_iter().fold(0.0_f64, |m, x| m.max(x.abs()))
}

/// f32 rounding, amplified by sums over a few hundred terms.
const F32_TOLERANCE: f64 = 2e-5;

#[test]
fn f32_matches_f64_on_the_configurations() {
    let cases = [
        Case::new(
            Kind::SelfAttention,
            AttentionConfig::new(5, 1)
                .with_head_dim(3)
                .with_value_dim(4),
            2,
            4,
            0,
            31,
        ),
        Case::new(
            Kind::SelfAttention,
            AttentionConfig::new(6, 4)
                .with_head_dim(2)
                .with_kv_heads(2)
                .with_output_projection(6)
                .with_bias(true),
            2,
            5,
            0,
            32,
        )
        .with_keep_mask([2, 1, 5, 5], 33)
        .with_attention_bias([1, 4, 5, 5], 34),
        Case::new(
            Kind::Cross,
            AttentionConfig::new(4, 2)
                .with_value_dim(3)
                .with_d_model_kv(6)
                .with_output_projection(5)
                .with_bias(true),
            3,
            3,
            6,
            35,
        )
        .with_key_lengths(&[6, 2, 0]),
        Case::new(
            Kind::Causal,
            AttentionConfig::new(6, 3)
                .with_head_dim(3)
                .with_value_dim(2)
                .with_kv_heads(1)
                .with_output_projection(4),
            2,
            7,
            0,
            36,
        )
        .with_key_lengths(&[7, 4])
        .with_window(3),
    ];
    for case in &cases {
        assert_f32_matches_f64(case, F32_TOLERANCE);
    }
}

#[test]
fn f32_matches_f64_on_model_sized_layers() {
    // Past the fused path's tiles: 8 heads of 16 over d_model 64, 2 kv heads.
    let config = AttentionConfig::new(64, 8)
        .with_head_dim(16)
        .with_kv_heads(2)
        .with_output_projection(64)
        .with_bias(true);
    let mut case = Case::new(Kind::Causal, config, 2, 130, 0, 37).with_key_lengths(&[130, 77]);
    // Xavier-sized weights, as a model would have, so the scores stay O(1).
    let bound = (6.0_f64 / 80.0).sqrt();
    for (_, mut p) in case.layer_parameters_mut() {
        p.mapv_inplace(|w| w * bound);
    }
    assert_f32_matches_f64(&case, F32_TOLERANCE);

    let config = AttentionConfig::new(48, 4)
        .with_d_model_kv(32)
        .with_output_projection(48);
    let mut case =
        Case::new(Kind::Cross, config, 2, 40, 150, 38).with_causal(CausalAlignment::BottomRight);
    let bound = (6.0_f64 / 80.0).sqrt();
    for (_, mut p) in case.layer_parameters_mut() {
        p.mapv_inplace(|w| w * bound);
    }
    assert_f32_matches_f64(&case, F32_TOLERANCE);
}

impl Case<f64> {
    /// The case's weights, writable, in the layer's parameter order.
    fn layer_parameters_mut(&mut self) -> Vec<(&'static str, ndarray::ArrayViewMutD<'_, f64>)> {
        let w = &mut self.weights;
        let mut list = vec![
            ("w_q", w.w_q.view_mut().into_dyn()),
            ("w_k", w.w_k.view_mut().into_dyn()),
            ("w_v", w.w_v.view_mut().into_dyn()),
        ];
        if let Some(w_o) = &mut w.w_o {
            list.push(("w_o", w_o.view_mut().into_dyn()));
        }
        list
    }
}

// ---------------------------------------------------------------------------
// Random shapes and options.

/// A random case: any layer kind, heads and kv heads, widths 1 to 4,
/// optional `W^O` and biases, batch 1 to 3, lengths 0 to 5, and random
/// key lengths, keep mask, attention bias, causal alignment (cross) and
/// window.
fn random_case() -> impl Strategy<Value = Case<f64>> {
    (
        (
            0..3_usize,
            1..4_usize,
            1..4_usize,
            1..5_usize,
            1..4_usize,
            1..4_usize,
        ),
        (prop::option::of(1..5_usize), any::<bool>(), 1..5_usize),
        (1..4_usize, 0..6_usize, 0..6_usize),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            0..3_usize,
            prop::option::of(1..4_usize),
        ),
        any::<u64>(),
    )
        .prop_map(
            |(
                (kind, kv_heads, group, d_model, d_k, d_v),
                (d_model_out, bias, d_model_kv),
                (batch, len_q, len_kv),
                (key_lengths, keep_mask, attention_bias, causal, window),
                seed,
            )| {
                let kind = [Kind::SelfAttention, Kind::Cross, Kind::Causal][kind];
                let mut config = AttentionConfig::new(d_model, kv_heads * group)
                    .with_head_dim(d_k)
                    .with_value_dim(d_v)
                    .with_kv_heads(kv_heads)
                    .with_bias(bias);
                if let Some(d_model_out) = d_model_out {
                    config = config.with_output_projection(d_model_out);
                }
                if kind == Kind::Cross {
                    config = config.with_d_model_kv(d_model_kv);
                }
                let len_kv = if kind == Kind::Cross { len_kv } else { len_q };
                let heads = config.heads;
                let mut case = Case::new(kind, config, batch, len_q, len_kv, seed);
                let mut rng = Rng::new(seed ^ 0x5eed);
                if key_lengths {
                    let lengths: Vec<usize> = (0..batch).map(|_| rng.below(len_kv + 1)).collect();
                    case = case.with_key_lengths(&lengths);
                }
                if keep_mask {
                    case = case.with_keep_mask([batch, 1, len_q, len_kv], rng.next_u64());
                }
                if attention_bias {
                    case = case.with_attention_bias([1, heads, len_q, len_kv], rng.next_u64());
                }
                if kind == Kind::Cross {
                    case.causal = [
                        None,
                        Some(CausalAlignment::BottomRight),
                        Some(CausalAlignment::TopLeft),
                    ][causal];
                }
                if kind == Kind::Causal {
                    case.window = window;
                }
                case
            },
        )
}

proptest! {
    #![proptest_config(common::config(96))]

    #[test]
    fn gradients_match_finite_differences_on_random_cases(case in random_case(), seed in any::<u64>()) {
        if let Err(message) = case.check_gradients(Some((4, seed))) {
            return Err(TestCaseError::fail(message));
        }
    }

    #[test]
    fn f32_gradients_match_f64_on_random_cases(case in random_case()) {
        assert_f32_matches_f64(&case, F32_TOLERANCE);
    }
}

// ---------------------------------------------------------------------------
// Bad shapes: an error, never a panic.

fn small_layer() -> (Attention<f64>, Array3<f64>) {
    let config = AttentionConfig::new(4, 2)
        .with_output_projection(3)
        .with_bias(true);
    let layer = Attention::new_seeded(config, 40).unwrap();
    let x = Array3::from_shape_fn((2, 5, 4), |(b, i, j)| (b + i * j) as f64 * 0.1);
    (layer, x)
}

#[test]
fn d_output_of_the_wrong_shape_is_an_error() {
    let (layer, x) = small_layer();
    let (y, cache) = layer
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap();
    assert_eq!(y.shape(), &[2, 5, 3]);
    for shape in [(2, 5, 4), (2, 4, 3), (1, 5, 3), (2, 5, 2)] {
        let err = layer
            .backward(&cache, Array3::zeros(shape).view())
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
        assert!(err.to_string().contains("d_output"), "{err}");
    }
}

#[test]
fn a_cache_from_another_layer_config_is_an_error() {
    let (layer, x) = small_layer();
    let other = Attention::<f64>::new_seeded(
        layer
            .config()
            .with_heads(1)
            .with_head_dim(4)
            .with_value_dim(4),
        41,
    )
    .unwrap();
    let (y, cache) = other
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap();
    let err = layer.backward(&cache, y.view()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    assert!(err.to_string().contains("forward cache"), "{err}");
}

#[test]
fn gradients_of_another_layer_config_are_an_error() {
    let (mut layer, x) = small_layer();
    let other = Attention::<f64>::new_seeded(layer.config().with_bias(false), 42).unwrap();
    let (y, cache) = other
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap();
    let grads = other.backward(&cache, y.view()).unwrap();
    let before = layer.clone();
    let err = layer.sgd_step(&grads, 0.1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    assert!(err.to_string().contains("b_q"), "{err}");
    let mut called = false;
    assert!(
        layer
            .apply_gradients(&grads, |_, _, _| called = true)
            .is_err()
    );
    assert!(!called);
    assert_eq!(layer, before);
}

#[test]
fn inputs_of_the_wrong_width_are_an_error() {
    let (layer, _) = small_layer();
    let x = Array3::<f64>::zeros((2, 5, 3));
    let err = layer
        .forward_train(x.view(), &AttentionOptions::new())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    assert!(err.to_string().contains("d_model"), "{err}");

    let causal = CausalAttention::<f64>::new_seeded(layer.config(), 43).unwrap();
    assert!(
        causal
            .forward_train(x.view(), &AttentionOptions::new())
            .is_err()
    );

    let cross = Attention::<f64>::new_seeded(layer.config().with_d_model_kv(6), 44).unwrap();
    let x_q = Array3::<f64>::zeros((2, 3, 4));
    let wrong_kv = Array3::<f64>::zeros((2, 5, 4));
    let err = cross
        .forward_cross_train(x_q.view(), wrong_kv.view(), &AttentionOptions::new())
        .unwrap_err();
    assert!(err.to_string().contains("d_model_kv"), "{err}");
    let other_batch = Array3::<f64>::zeros((3, 5, 6));
    let err = cross
        .forward_cross_train(x_q.view(), other_batch.view(), &AttentionOptions::new())
        .unwrap_err();
    assert!(err.to_string().contains("batch"), "{err}");
    // A cross-attention layer has no self-attention forward.
    let err = cross
        .forward_train(x_q.view(), &AttentionOptions::new())
        .unwrap_err();
    assert!(err.to_string().contains("forward_cross"), "{err}");
}

#[test]
fn options_that_do_not_fit_are_an_error() {
    let (layer, x) = small_layer();
    let err = layer
        .forward_train(x.view(), &AttentionOptions::new().key_lengths(&[5]))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::KeyLengths);
    let err = layer
        .forward_train(x.view(), &AttentionOptions::new().key_lengths(&[5, 6]))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::KeyLengths);
    let mask = Array4::from_elem((2, 3, 5, 5), true);
    let err = layer
        .forward_train(x.view(), &AttentionOptions::new().keep_mask(mask.view()))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotBroadcastable);
}

#[test]
fn one_sequence_trains_as_a_batch_of_one() {
    let config = AttentionConfig::new(4, 2);
    let layer = CausalAttention::<f64>::new_seeded(config, 45).unwrap();
    let x = Array2::from_shape_fn((5, 4), |(i, j)| (i as f64 - j as f64) * 0.2);
    let (y, cache) = layer
        .forward_train(x.view().insert_axis(Axis(0)), &AttentionOptions::new())
        .unwrap();
    assert_eq!(y.index_axis(Axis(0), 0), layer.forward(x.view()).unwrap());
    let grads = layer.backward(&cache, y.view()).unwrap();
    assert_eq!(grads.d_x.shape(), &[1, 5, 4]);
    assert_eq!(cache.lengths(), (1, 5, 5));
}
