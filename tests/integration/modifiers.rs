//! Score modifiers (ALiBi, attention sinks): against a naive softmax over
//! explicitly built scores in f64, finite differences for the gradients,
//! every kernel set against the reference on the packed and decode paths,
//! key shards merged against the unsplit call, composed with the other
//! options, and NaN in masked data never leaking.

use ndarray::{Array1, Array3, Array4, ArrayView4, Axis, s};

use crate::common::{option_case, seeded};
use sdpa::simd::available_kernel_sets;
use sdpa::{
    AttentionOptions, AttentionPartial, CausalAlignment, alibi_slopes,
    scaled_dot_product_attention_backward, scaled_dot_product_attention_partial,
};

/// What the naive oracle applies: the standard options it knows, and the
/// modifiers.
#[derive(Clone, Default)]
struct Naive {
    causal: Option<CausalAlignment>,
    window: Option<usize>,
    key_lengths: Option<Vec<usize>>,
    keep: Option<Array4<bool>>,
    bias: Option<Array4<f64>>,
    alibi: Option<Vec<f64>>,
    sinks: Option<Vec<f64>>,
    softcap: Option<f64>,
}

impl Naive {
    fn options(&self) -> AttentionOptions<'_, f64> {
        let mut opts = AttentionOptions::new();
        if let Some(alignment) = self.causal {
            opts = opts.causal_aligned(alignment);
        }
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some(keep) = &self.keep {
            opts = opts.keep_mask(keep.view());
        }
        if let Some(bias) = &self.bias {
            opts = opts.bias(bias.view());
        }
        if let Some(alibi) = &self.alibi {
            opts = opts.alibi(alibi);
        }
        if let Some(sinks) = &self.sinks {
            opts = opts.sinks(sinks);
        }
        if let Some(cap) = self.softcap {
            opts = opts.softcap(cap);
        }
        opts
    }

    /// `softmax` over the explicitly built scores of each row, with the
    /// sink as an extra term of the denominator: the output and the
    /// log-sum-exp (`−inf` for a row that sees nothing and has no sink).
    fn attend(
        &self,
        q: &Array4<f64>,
        k: &Array4<f64>,
        v: &Array4<f64>,
    ) -> (Array4<f64>, Array3<f64>) {
        let (batch, heads, len_q, d_k) = q.dim();
        let (_, kv_heads, len_kv, _) = k.dim();
        let d_v = v.dim().3;
        let group = heads / kv_heads;
        let scale = 1.0 / (d_k as f64).sqrt();
        let mut out = Array4::zeros((batch, heads, len_q, d_v));
        let mut lse = Array3::from_elem((batch, heads, len_q), f64::NEG_INFINITY);
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..len_q {
                    // The query's bottom-right aligned position.
                    let position = i as i64 + len_kv as i64 - len_q as i64;
                    let mut scores = Vec::new();
                    for j in 0..len_kv {
                        let diagonal = match self.causal {
                            None => i64::MAX,
                            Some(CausalAlignment::TopLeft) => i as i64,
                            Some(CausalAlignment::BottomRight) => position,
                        };
                        let mut visible = (j as i64) <= diagonal;
                        if let Some(w) = self.window {
                            visible &= (j as i64) > diagonal - w as i64;
                        }
                        if let Some(lengths) = &self.key_lengths {
                            visible &= j < lengths[b];
                        }
                        if let Some(keep) = &self.keep {
                            visible &= keep[[b, h, i, j]];
                        }
                        if !visible {
                            continue;
                        }
                        let mut score = scale
                            * (0..d_k)
                                .map(|c| q[[b, h, i, c]] * k[[b, h / group, j, c]])
                                .sum::<f64>();
                        // Gemma 2's order: scale, cap, then the additive terms.
                        if let Some(cap) = self.softcap {
                            score = cap * (score / cap).tanh();
                        }
                        if let Some(bias) = &self.bias {
                            score += bias[[b, h, i, j]];
                        }
                        if let Some(alibi) = &self.alibi {
                            score -= alibi[h] * (position - j as i64) as f64;
                        }
                        scores.push((j, score));
                    }
                    let sink = self.sinks.as_ref().map(|s| s[h]);
                    let max = scores
                        .iter()
                        .map(|&(_, s)| s)
                        .chain(sink)
                        .fold(f64::NEG_INFINITY, f64::max);
                    if max == f64::NEG_INFINITY {
                        continue;
                    }
                    let total: f64 = scores.iter().map(|&(_, s)| (s - max).exp()).sum::<f64>()
                        + sink.map_or(0.0, |s| (s - max).exp());
                    for &(j, score) in &scores {
                        let p = (score - max).exp() / total;
                        for c in 0..d_v {
                            out[[b, h, i, c]] += p * v[[b, h / group, j, c]];
                        }
                    }
                    lse[[b, h, i]] = max + total.ln();
                }
            }
        }
        (out, lse)
    }
}

fn max_diff<F: sdpa::Element>(a: &ArrayView4<F>, b: &Array4<f64>) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x.to_f64().unwrap() - y).abs())
        .fold(0.0, f64::max)
}

fn inputs(
    dims: (usize, usize, usize, usize, usize, usize, usize),
    seed: u64,
) -> (Array4<f64>, Array4<f64>, Array4<f64>) {
    let (batch, heads, kv_heads, len_q, len_kv, d_k, d_v) = dims;
    (
        seeded((batch, heads, len_q, d_k), seed, 1.5),
        seeded((batch, kv_heads, len_kv, d_k), seed ^ 1, 1.5),
        seeded((batch, kv_heads, len_kv, d_v), seed ^ 2, 1.0),
    )
}

/// Modifier sets: ALiBi; sinks; both; a softcap with sinks and ALiBi.
const MODIFIER_SETS: usize = 4;

/// Modifier set `case`: ALiBi slopes, sink logits, softcap.
fn modifiers(case: usize, heads: usize) -> (Option<Vec<f64>>, Option<Vec<f64>>, Option<f64>) {
    let sinks: Vec<f64> = (0..heads).map(|h| 0.7 * h as f64 - 1.1).collect();
    match case % MODIFIER_SETS {
        0 => (Some(alibi_slopes(heads)), None, None),
        1 => (None, Some(sinks), None),
        2 => (Some(alibi_slopes(heads)), Some(sinks), None),
        _ => (Some(alibi_slopes(heads)), Some(sinks), Some(1.5)),
    }
}

/// The naive oracle's option sets, composed with the modifiers.
fn naive_cases(dims: (usize, usize, usize, usize, usize, usize, usize), seed: u64) -> Vec<Naive> {
    let (batch, heads, _, len_q, len_kv, _, _) = dims;
    let keep = seeded((batch, heads, len_q, len_kv), seed ^ 7, 1.0).mapv(|x| x > -0.6);
    let bias = seeded((batch, heads, len_q, len_kv), seed ^ 8, 1.0);
    let lengths: Vec<usize> = (0..batch).map(|b| len_kv.saturating_sub(b * 3)).collect();
    let mut cases = Vec::new();
    for m in 0..MODIFIER_SETS {
        let (alibi, sinks, softcap) = modifiers(m, heads);
        let base = Naive {
            alibi,
            sinks,
            softcap,
            ..Naive::default()
        };
        cases.push(base.clone());
        cases.push(Naive {
            causal: Some(CausalAlignment::BottomRight),
            ..base.clone()
        });
        cases.push(Naive {
            causal: Some(CausalAlignment::TopLeft),
            keep: Some(keep.clone()),
            ..base.clone()
        });
        cases.push(Naive {
            causal: Some(CausalAlignment::BottomRight),
            window: Some(3),
            bias: Some(bias.clone()),
            ..base.clone()
        });
        cases.push(Naive {
            key_lengths: Some(lengths.clone()),
            bias: Some(bias.clone()),
            keep: Some(keep.clone()),
            ..base.clone()
        });
    }
    cases
}

/// Odd shapes: GQA, len_q above, equal to and below len_kv, decode-sized
/// query counts with whole-vector head dims (the decode path) and ragged
/// ones (the packed path).
const SHAPES: &[(usize, usize, usize, usize, usize, usize, usize)] = &[
    (2, 4, 2, 7, 13, 5, 3),
    (1, 3, 1, 13, 13, 8, 6),
    (2, 2, 2, 17, 9, 3, 4),
    (1, 4, 2, 3, 150, 16, 16),
    (2, 2, 1, 1, 70, 32, 16),
    (1, 2, 1, 100, 130, 9, 7),
    (1, 2, 1, 2, 2100, 16, 16),
];

#[test]
fn alibi_slopes_are_bloom_s() {
    // BLOOM's build_alibi_tensor, written out: 2^(-8k/n) for the closest
    // power of two n, then 2^(-4k/n) for odd k.
    assert_eq!(alibi_slopes(0), Vec::<f64>::new());
    assert_eq!(alibi_slopes(1), vec![2f64.powi(-8)]);
    assert_eq!(alibi_slopes(4), vec![0.25, 0.0625, 0.015625, 0.00390625]);
    assert_eq!(
        alibi_slopes(6),
        vec![0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    );
    let twelve = alibi_slopes(12);
    let expected: Vec<f64> = (1..=8)
        .map(|k| 2f64.powf(-(k as f64)))
        .chain([0.5, 1.5, 2.5, 3.5].map(|e| 2f64.powf(-e)))
        .collect();
    for (got, want) in twelve.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-15, "{twelve:?}");
    }
    assert_eq!(alibi_slopes(40).len(), 40);
}

#[test]
fn core_matches_the_naive_softmax_in_f64_and_f32() {
    for (n, &dims) in SHAPES.iter().enumerate() {
        let (q, k, v) = inputs(dims, 100 + n as u64);
        for (c, case) in naive_cases(dims, n as u64).iter().enumerate() {
            let (expected, expected_lse) = case.attend(&q, &k, &v);
            let opts = case.options();
            let got =
                scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts).unwrap();
            let diff = max_diff(&got.output(), &expected);
            assert!(diff < 1e-12, "shape {dims:?} case {c}: {diff}");
            for (&a, &b) in got.log_sum_exp().iter().zip(&expected_lse) {
                assert!(a == b || (a - b).abs() < 1e-12, "lse {a} vs {b}");
            }
            // The reference in f32 (attention_weights runs `core` for f32).
            let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
            let (q32, k32) = (f32s(&q), f32s(&k));
            let bias32 = case.bias.as_ref().map(f32s);
            let alibi32: Option<Vec<f32>> = case
                .alibi
                .as_ref()
                .map(|a| a.iter().map(|&x| x as f32).collect());
            let sinks32: Option<Vec<f32>> = case
                .sinks
                .as_ref()
                .map(|a| a.iter().map(|&x| x as f32).collect());
            let opts32 = f32_options(case, bias32.as_ref(), &alibi32, &sinks32);
            let w32 = sdpa::core::attention_weights(q32.view(), k32.view(), &opts32).unwrap();
            let w64 = sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap();
            let diff = max_diff(&w32.view(), &w64);
            assert!(diff < 1e-5, "f32 weights, shape {dims:?} case {c}: {diff}");
        }
    }
}

fn f32_options<'a>(
    case: &'a Naive,
    bias: Option<&'a Array4<f32>>,
    alibi: &'a Option<Vec<f32>>,
    sinks: &'a Option<Vec<f32>>,
) -> AttentionOptions<'a, f32> {
    let mut opts = AttentionOptions::new();
    if let Some(alignment) = case.causal {
        opts = opts.causal_aligned(alignment);
    }
    if let Some(window) = case.window {
        opts = opts.window(window);
    }
    if let Some(lengths) = &case.key_lengths {
        opts = opts.key_lengths(lengths);
    }
    if let Some(keep) = &case.keep {
        opts = opts.keep_mask(keep.view());
    }
    if let Some(bias) = bias {
        opts = opts.bias(bias.view());
    }
    if let Some(alibi) = alibi {
        opts = opts.alibi(alibi);
    }
    if let Some(sinks) = sinks {
        opts = opts.sinks(sinks);
    }
    if let Some(cap) = case.softcap {
        opts = opts.softcap(cap as f32);
    }
    opts
}

/// The modifiers composed with the shared option cases, in f32 and f64.
struct Composed {
    keep: Array4<bool>,
    bias: Array4<f64>,
    bias32: Array4<f32>,
    lengths: Vec<usize>,
    alibi: Vec<f64>,
    alibi32: Vec<f32>,
    sinks: Vec<f64>,
    sinks32: Vec<f32>,
}

impl Composed {
    fn new(batch: usize, heads: usize, len_q: usize, len_kv: usize, seed: u64) -> Self {
        let keep = seeded((batch, heads, len_q, len_kv), seed ^ 3, 1.0).mapv(|x| x > -0.5);
        let bias = seeded((batch, heads, len_q, len_kv), seed ^ 4, 1.0);
        let sinks: Vec<f64> = (0..heads).map(|h| 0.5 * h as f64 - 0.8).collect();
        let alibi = alibi_slopes(heads);
        Composed {
            bias32: bias.mapv(|x| x as f32),
            keep,
            bias,
            lengths: (0..batch)
                .map(|b| len_kv.saturating_sub(2 * b + 1))
                .collect(),
            alibi32: alibi.iter().map(|&x| x as f32).collect(),
            alibi,
            sinks32: sinks.iter().map(|&x| x as f32).collect(),
            sinks,
        }
    }

    fn with_modifiers<'a, F: Copy>(
        opts: AttentionOptions<'a, F>,
        m: usize,
        alibi: &'a [F],
        sinks: &'a [F],
        cap: F,
    ) -> AttentionOptions<'a, F> {
        match m % MODIFIER_SETS {
            0 => opts.alibi(alibi),
            1 => opts.sinks(sinks),
            2 => opts.alibi(alibi).sinks(sinks),
            _ => opts.alibi(alibi).sinks(sinks).softcap(cap),
        }
    }

    fn f64(&self, case: usize, m: usize) -> AttentionOptions<'_, f64> {
        let opts = option_case(case, &self.keep, &self.bias, &self.lengths);
        Self::with_modifiers(opts, m, &self.alibi, &self.sinks, 1.5)
    }

    fn f32(&self, case: usize, m: usize) -> AttentionOptions<'_, f32> {
        let opts = option_case(case, &self.keep, &self.bias32, &self.lengths);
        Self::with_modifiers(opts, m, &self.alibi32, &self.sinks32, 1.5)
    }
}

#[test]
fn every_kernel_set_matches_the_reference_on_the_packed_and_decode_paths() {
    for (n, &dims) in SHAPES.iter().enumerate() {
        let (batch, heads, _, len_q, len_kv, _, _) = dims;
        let (q, k, v) = inputs(dims, 200 + n as u64);
        let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
        let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
        let composed = Composed::new(batch, heads, len_q, len_kv, n as u64);
        for case in 0..8 {
            for m in 0..MODIFIER_SETS {
                let expected = scaled_dot_product_attention_partial(
                    q.view(),
                    k.view(),
                    v.view(),
                    &composed.f64(case, m),
                )
                .unwrap();
                for set in available_kernel_sets() {
                    let got = sdpa::simd::with_kernel_set(set, || {
                        scaled_dot_product_attention_partial(
                            q32.view(),
                            k32.view(),
                            v32.view(),
                            &composed.f32(case, m),
                        )
                    })
                    .unwrap()
                    .unwrap();
                    let diff = max_diff(&got.output(), &expected.output().to_owned());
                    assert!(diff < 2e-5, "{set} shape {dims:?} case {case}/{m}: {diff}");
                    for (&a, &b) in got.log_sum_exp().iter().zip(expected.log_sum_exp()) {
                        let (a, b) = (f64::from(a), b);
                        assert!(a == b || (a - b).abs() < 1e-4 * (1.0 + b.abs()), "{a} {b}");
                    }
                }
            }
        }
    }
}

#[test]
fn alibi_equals_its_dense_bias_and_bloom_s_key_position_bias() {
    let dims = (2, 4, 2, 9, 21, 6, 5);
    let (batch, heads, _, len_q, len_kv, _, _) = dims;
    let (q, k, v) = inputs(dims, 5);
    let slopes = alibi_slopes(heads);
    // −slope·(p_i − j), materialised; and BLOOM's slope·j.
    let dense = Array4::from_shape_fn((batch, heads, len_q, len_kv), |(_, h, i, j)| {
        -slopes[h] * ((i + len_kv - len_q) as f64 - j as f64)
    });
    let bloom = Array4::from_shape_fn((1, heads, 1, len_kv), |(_, h, _, j)| slopes[h] * j as f64);
    for causal in [false, true] {
        let base = if causal {
            AttentionOptions::new().causal()
        } else {
            AttentionOptions::new()
        };
        let run = |opts: &AttentionOptions<f64>| {
            sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), opts).unwrap()
        };
        let alibi = run(&base.clone().alibi(&slopes));
        assert!(max_diff(&alibi.view(), &run(&base.clone().bias(dense.view()))) < 1e-13);
        assert!(max_diff(&alibi.view(), &run(&base.clone().bias(bloom.view()))) < 1e-13);
    }
}

/// Splits the keys at `cuts` and merges the shards' partials.
fn split_and_merge<F: sdpa::Element>(
    q: ArrayView4<F>,
    k: ArrayView4<F>,
    v: ArrayView4<F>,
    cuts: &[usize],
    opts: &AttentionOptions<F>,
) -> AttentionPartial<F> {
    let len_kv = k.len_of(Axis(2));
    let mut bounds = vec![0];
    bounds.extend(cuts.iter().copied().filter(|&c| c <= len_kv));
    bounds.push(len_kv);
    bounds.sort_unstable();
    let partials: Vec<AttentionPartial<F>> = bounds
        .windows(2)
        .rev()
        .map(|w| {
            scaled_dot_product_attention_partial(
                q,
                k.slice(s![.., .., w[0]..w[1], ..]),
                v.slice(s![.., .., w[0]..w[1], ..]),
                &opts.clone().key_shard(w[0], len_kv),
            )
            .unwrap()
        })
        .collect();
    AttentionPartial::merge_all(partials).unwrap()
}

#[test]
fn key_shards_merge_to_the_unsplit_call_counting_the_sink_once() {
    for (n, &dims) in SHAPES.iter().enumerate() {
        let (batch, heads, _, len_q, len_kv, _, _) = dims;
        let (q, k, v) = inputs(dims, 300 + n as u64);
        let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
        let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
        let composed = Composed::new(batch, heads, len_q, len_kv, n as u64);
        let cuts = [0, len_kv / 3, len_kv / 3, len_kv / 2 + 1];
        for case in 0..8 {
            for m in 0..MODIFIER_SETS {
                let opts = composed.f64(case, m);
                let whole =
                    scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)
                        .unwrap();
                let merged = split_and_merge(q.view(), k.view(), v.view(), &cuts, &opts);
                let diff = max_diff(&merged.output(), &whole.output().to_owned());
                assert!(diff < 1e-12, "f64 shape {dims:?} case {case}/{m}: {diff}");
                for (&a, &b) in merged.log_sum_exp().iter().zip(whole.log_sum_exp()) {
                    assert!(a == b || (a - b).abs() < 1e-12, "{a} {b}");
                }
                for set in available_kernel_sets() {
                    let merged = sdpa::simd::with_kernel_set(set, || {
                        split_and_merge(
                            q32.view(),
                            k32.view(),
                            v32.view(),
                            &cuts,
                            &composed.f32(case, m),
                        )
                    })
                    .unwrap();
                    let diff = max_diff(&merged.output(), &whole.output().to_owned());
                    assert!(diff < 2e-5, "{set} shape {dims:?} case {case}/{m}: {diff}");
                }
            }
        }
    }
}

/// `L = Σ out ∘ w` for a fixed `w`.
fn loss(
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
    opts: &AttentionOptions<f64>,
    w: &Array4<f64>,
) -> f64 {
    let out = sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), opts).unwrap();
    (&out * w).sum()
}

#[test]
fn core_gradients_match_finite_differences_including_the_sinks() {
    let dims = (2, 4, 2, 5, 7, 3, 4);
    let (batch, heads, _, len_q, len_kv, _, d_v) = dims;
    let (q, k, v) = inputs(dims, 11);
    let w = seeded((batch, heads, len_q, d_v), 12, 1.0);
    let composed = Composed::new(batch, heads, len_q, len_kv, 13);
    for case in 0..8 {
        for m in 0..MODIFIER_SETS {
            let opts = composed.f64(case, m);
            let forward =
                scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts).unwrap();
            let grads = sdpa::core::scaled_dot_product_attention_backward(
                q.view(),
                k.view(),
                v.view(),
                &opts,
                &forward,
                w.view(),
            )
            .unwrap();
            assert_eq!(grads.d_sinks.is_some(), m % MODIFIER_SETS != 0);
            let h = 1e-6;
            let check = |name: &str, x: &Array4<f64>, grad: &Array4<f64>, which: usize| {
                for index in [[0, 0, 0, 0], [1, 1, 2, 1], [1, which % 2, 4, 2]] {
                    let index = [
                        index[0],
                        index[1] % x.dim().1,
                        index[2] % x.dim().2,
                        index[3] % x.dim().3,
                    ];
                    let (mut up, mut down) = (x.clone(), x.clone());
                    up[index] += h;
                    down[index] -= h;
                    let (lu, ld) = match name {
                        "q" => (loss(&up, &k, &v, &opts, &w), loss(&down, &k, &v, &opts, &w)),
                        "k" => (loss(&q, &up, &v, &opts, &w), loss(&q, &down, &v, &opts, &w)),
                        _ => (loss(&q, &k, &up, &opts, &w), loss(&q, &k, &down, &opts, &w)),
                    };
                    let numeric = (lu - ld) / (2.0 * h);
                    assert!(
                        (grad[index] - numeric).abs() < 1e-7,
                        "d_{name}{index:?} case {case}/{m}: {} vs {numeric}",
                        grad[index]
                    );
                }
            };
            check("q", &q, &grads.d_q, case);
            check("k", &k, &grads.d_k, case);
            check("v", &v, &grads.d_v, case);
            // The bias is added after the cap: its gradient is the capped
            // score's.
            if let Some(d_bias) = &grads.d_bias {
                for index in [[0, 0, 0, 0], [1, 3, 4, 6], [1, 2, 3, 1]] {
                    let with = |delta: f64| {
                        let mut bias = composed.bias.clone();
                        bias[index] += delta;
                        let base = option_case(case, &composed.keep, &bias, &composed.lengths);
                        let o = Composed::with_modifiers(
                            base,
                            m,
                            &composed.alibi,
                            &composed.sinks,
                            1.5,
                        );
                        loss(&q, &k, &v, &o, &w)
                    };
                    let numeric = (with(h) - with(-h)) / (2.0 * h);
                    assert!(
                        (d_bias[index] - numeric).abs() < 1e-7,
                        "d_bias{index:?} case {case}/{m}: {} vs {numeric}",
                        d_bias[index]
                    );
                }
            }
            if let Some(d_sinks) = &grads.d_sinks {
                for head in 0..heads {
                    let mut sinks = composed.sinks.clone();
                    sinks[head] += h;
                    let with = |s: &[f64]| {
                        let base =
                            option_case(case, &composed.keep, &composed.bias, &composed.lengths);
                        let o = match m {
                            1 => base.clone().sinks(s),
                            2 => base.clone().alibi(&composed.alibi).sinks(s),
                            _ => base.clone().alibi(&composed.alibi).sinks(s).softcap(1.5),
                        };
                        loss(&q, &k, &v, &o, &w)
                    };
                    let up = with(&sinks);
                    sinks[head] -= 2.0 * h;
                    let down = with(&sinks);
                    let numeric = (up - down) / (2.0 * h);
                    assert!(
                        (d_sinks[head] - numeric).abs() < 1e-7,
                        "d_sinks[{head}] case {case}/{m}: {} vs {numeric}",
                        d_sinks[head]
                    );
                }
            }
        }
    }
}

#[test]
fn fused_backward_matches_the_reference_on_every_kernel_set() {
    for (n, &dims) in SHAPES.iter().enumerate() {
        let (batch, heads, _, len_q, len_kv, _, d_v) = dims;
        let (q, k, v) = inputs(dims, 400 + n as u64);
        let d_out = seeded((batch, heads, len_q, d_v), 401 + n as u64, 1.0);
        let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
        let (q32, k32, v32, d_out32) = (f32s(&q), f32s(&k), f32s(&v), f32s(&d_out));
        let composed = Composed::new(batch, heads, len_q, len_kv, n as u64);
        for case in 0..8 {
            for m in 0..MODIFIER_SETS {
                let opts = composed.f64(case, m);
                let forward =
                    scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)
                        .unwrap();
                let expected = scaled_dot_product_attention_backward(
                    q.view(),
                    k.view(),
                    v.view(),
                    &opts,
                    &forward,
                    d_out.view(),
                )
                .unwrap();
                for set in available_kernel_sets() {
                    let opts = composed.f32(case, m);
                    let got = sdpa::simd::with_kernel_set(set, || {
                        let forward = scaled_dot_product_attention_partial(
                            q32.view(),
                            k32.view(),
                            v32.view(),
                            &opts,
                        )
                        .unwrap();
                        scaled_dot_product_attention_backward(
                            q32.view(),
                            k32.view(),
                            v32.view(),
                            &opts,
                            &forward,
                            d_out32.view(),
                        )
                        .unwrap()
                    })
                    .unwrap();
                    let tolerance = 1e-4 * (len_kv as f64).sqrt();
                    for (name, a, b) in [
                        ("d_q", &got.d_q, &expected.d_q),
                        ("d_k", &got.d_k, &expected.d_k),
                        ("d_v", &got.d_v, &expected.d_v),
                    ] {
                        let diff = max_diff(&a.view(), b);
                        assert!(diff < tolerance, "{set} {name} {dims:?} {case}/{m}: {diff}");
                    }
                    match (&got.d_sinks, &expected.d_sinks) {
                        (Some(a), Some(b)) => {
                            for (&a, &b) in a.iter().zip(b) {
                                let err = (f64::from(a) - b).abs();
                                assert!(err < tolerance * (1.0 + b.abs()), "{set} d_sinks {a} {b}");
                            }
                        }
                        (None, None) => {}
                        _ => panic!("d_sinks present on one path only"),
                    }
                }
            }
        }
    }
}

#[test]
fn sharded_sink_gradients_sum_to_the_unsplit_one() {
    let dims = (1, 2, 1, 4, 10, 3, 2);
    let (q, k, v) = inputs(dims, 21);
    let d_out = seeded((1, 2, 4, 2), 22, 1.0);
    let sinks = [0.3, -0.4];
    let opts = AttentionOptions::new().causal().sinks(&sinks);
    let forward =
        scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts).unwrap();
    let backward = |k, v, opts: &AttentionOptions<f64>| {
        scaled_dot_product_attention_backward(q.view(), k, v, opts, &forward, d_out.view()).unwrap()
    };
    let whole = backward(k.view(), v.view(), &opts);
    let mut d_sinks = Array1::zeros(2);
    let mut d_q = Array4::zeros(q.raw_dim());
    for (a, b) in [(0, 3), (3, 10)] {
        let part = backward(
            k.slice(s![.., .., a..b, ..]),
            v.slice(s![.., .., a..b, ..]),
            &opts.clone().key_shard(a, 10),
        );
        d_sinks += part.d_sinks.as_ref().unwrap();
        d_q += &part.d_q;
    }
    let d_sinks_whole = whole.d_sinks.unwrap();
    assert!((&d_sinks - &d_sinks_whole).iter().all(|x| x.abs() < 1e-14));
    assert!(max_diff(&d_q.view(), &whole.d_q) < 1e-13);
}

#[test]
fn nan_in_masked_keys_never_leaks_and_a_row_that_sees_nothing_gives_the_sink() {
    // Keys 5.. are padding holding NaN; batch item 1 sees no key at all.
    let (mut q, mut k, mut v) = inputs((2, 2, 1, 6, 40, 8, 8), 31);
    k.slice_mut(s![.., .., 5.., ..]).fill(f64::NAN);
    v.slice_mut(s![.., .., 5.., ..]).fill(f64::NAN);
    q.slice_mut(s![1, .., .., ..]).fill(f64::NAN);
    let lengths = [5, 0];
    let slopes = alibi_slopes(2);
    let sinks = [0.25, -2.0];
    let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
    let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
    let (slopes32, sinks32) = ([slopes[0] as f32, slopes[1] as f32], [0.25f32, -2.0]);
    let d_out = seeded((2, 2, 6, 8), 32, 1.0).mapv(|x| x as f32);
    for causal in [false, true] {
        let mut opts = AttentionOptions::new()
            .key_lengths(&lengths)
            .alibi(&slopes32)
            .sinks(&sinks32)
            .softcap(3.0);
        if causal {
            opts = opts.causal_aligned(CausalAlignment::TopLeft);
        }
        let mut opts64 = AttentionOptions::new()
            .key_lengths(&lengths)
            .alibi(&slopes)
            .sinks(&sinks)
            .softcap(3.0);
        if causal {
            opts64 = opts64.causal_aligned(CausalAlignment::TopLeft);
        }
        let reference =
            scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts64).unwrap();
        assert!(reference.output().iter().all(|x| x.is_finite()));
        for set in available_kernel_sets() {
            sdpa::simd::with_kernel_set(set, || {
                let got =
                    scaled_dot_product_attention_partial(q32.view(), k32.view(), v32.view(), &opts)
                        .unwrap();
                assert!(got.output().iter().all(|x| x.is_finite()), "{set}");
                assert!(
                    got.output()
                        .slice(s![1, .., .., ..])
                        .iter()
                        .all(|&x| x == 0.0)
                );
                for ((_, h, _), &lse) in got.log_sum_exp().slice(s![1..2, .., ..]).indexed_iter() {
                    assert_eq!(lse, sinks32[h], "{set}");
                }
                let grads = scaled_dot_product_attention_backward(
                    q32.view(),
                    k32.view(),
                    v32.view(),
                    &opts,
                    &got,
                    d_out.view(),
                )
                .unwrap();
                for g in [&grads.d_q, &grads.d_k, &grads.d_v] {
                    assert!(g.iter().all(|x| x.is_finite()), "{set}");
                }
                assert!(grads.d_sinks.unwrap().iter().all(|x| x.is_finite()));
            })
            .unwrap();
        }
    }
}

/// A visible NaN value reaches the output however large the sink: the
/// sink scales a row's output after its values are summed, on every path,
/// so a weight it would round to 0 (here e^−110 of the row, below `f32`'s
/// subnormals) does not skip the value as a masked one is skipped.
#[test]
fn a_large_sink_does_not_hide_a_visible_nan_value() {
    // Scores 10 and −10 (d 1, scale 1) under a sink of 100.
    let q = Array4::from_elem((1, 1, 1, 1), 1.0f32);
    let k = Array4::from_shape_vec((1, 1, 2, 1), vec![10.0f32, -10.0]).unwrap();
    let v = Array4::from_shape_vec((1, 1, 2, 2), vec![1.0f32, 2.0, f32::NAN, 3.0]).unwrap();
    let sinks = [100.0f32];
    let opts = AttentionOptions::new().scale(1.0).sinks(&sinks);
    let expect = |out: &Array4<f32>, what: &str| {
        assert!(out[[0, 0, 0, 0]].is_nan(), "{what}: {out}");
        // The other column is finite: about 2·e^−90.
        assert!(out[[0, 0, 0, 1]].is_finite(), "{what}: {out}");
    };
    let core = sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts);
    expect(&core.unwrap(), "core");
    for set in available_kernel_sets() {
        let fused = sdpa::simd::with_kernel_set(set, || {
            sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
        });
        expect(&fused.unwrap().unwrap(), &format!("{set}"));
    }
}

/// A row whose keys all score `−inf` is NaN without a sink (its weights
/// sum to 0), and zeros with log-sum-exp `sink_h` with one: every
/// `P_ij = 0 / e^(sink_h)`, the sink takes all the weight. That is also
/// what key shards give merged: the shard of such keys (NaN, log-sum-exp
/// `−inf`) merges into the sink's shard as nothing.
#[test]
fn a_sink_takes_all_the_weight_of_a_row_whose_keys_all_score_minus_infinity() {
    // Head 0's query is 1 and head 1's −1 (d 1, scale 1): keys of −inf and
    // +inf score −inf for both heads.
    let q = Array4::from_shape_vec((1, 2, 1, 1), vec![1.0f32, -1.0]).unwrap();
    let k = Array4::from_shape_vec(
        (1, 2, 2, 1),
        vec![
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::INFINITY,
        ],
    )
    .unwrap();
    let v = Array4::from_shape_fn((1, 2, 2, 3), |(_, h, j, c)| (h * 6 + j * 3 + c) as f32);
    let sinks = [0.5f32, -3.0];
    let with_sinks = AttentionOptions::new().scale(1.0).sinks(&sinks);
    let expect_sink = |p: &AttentionPartial<f32>, what: &str| {
        assert!(
            p.output().iter().all(|&x| x == 0.0),
            "{what}: {}",
            p.output()
        );
        assert_eq!(p.log_sum_exp().as_slice().unwrap(), &sinks, "{what}");
    };
    let f64s = |x: &Array4<f32>| x.mapv(f64::from);
    let sinks64 = sinks.map(f64::from);
    let opts64 = AttentionOptions::new().scale(1.0).sinks(&sinks64);
    let core64 = scaled_dot_product_attention_partial(
        f64s(&q).view(),
        f64s(&k).view(),
        f64s(&v).view(),
        &opts64,
    )
    .unwrap();
    assert!(core64.output().iter().all(|&x| x == 0.0), "core f64");
    assert_eq!(
        core64.log_sum_exp().as_slice().unwrap(),
        &sinks64,
        "core f64"
    );
    // `core` in f64 (above: the partial's path for f64) and in f32.
    let core = sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &with_sinks)
        .unwrap();
    assert!(core.iter().all(|&x| x == 0.0), "core: {core}");
    let weights = sdpa::core::attention_weights(q.view(), k.view(), &with_sinks).unwrap();
    assert!(weights.iter().all(|&w| w == 0.0), "weights: {weights}");
    for set in available_kernel_sets() {
        sdpa::simd::with_kernel_set(set, || {
            let run = |opts: &AttentionOptions<f32>| {
                scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), opts).unwrap()
            };
            let whole = run(&with_sinks);
            expect_sink(&whole, &format!("{set}"));
            // Without sinks, the same rows are NaN with log-sum-exp −inf.
            let plain = run(&AttentionOptions::new().scale(1.0));
            assert!(plain.output().iter().all(|x| x.is_nan()), "{set}");
            assert!(
                plain.log_sum_exp().iter().all(|&l| l == f32::NEG_INFINITY),
                "{set}"
            );
            // One shard per key, merged in either order.
            for order in [[0, 1], [1, 0]] {
                let parts = order.map(|j| {
                    scaled_dot_product_attention_partial(
                        q.view(),
                        k.slice(s![.., .., j..j + 1, ..]),
                        v.slice(s![.., .., j..j + 1, ..]),
                        &with_sinks.clone().key_shard(j, 2),
                    )
                    .unwrap()
                });
                let merged = AttentionPartial::merge_all(parts.to_vec()).unwrap();
                expect_sink(&merged, &format!("{set}, shards {order:?}"));
            }
        })
        .unwrap();
    }
}

#[test]
fn bad_modifiers_are_errors() {
    let x = Array4::<f32>::zeros((1, 2, 3, 4));
    let run = |opts: &AttentionOptions<f32>| {
        sdpa::scaled_dot_product_attention(x.view(), x.view(), x.view(), opts)
    };
    for opts in [
        AttentionOptions::new().alibi(&[0.5]),
        AttentionOptions::new().alibi(&[0.5, f32::NAN]),
        AttentionOptions::new().sinks(&[0.0, 0.0, 0.0]),
        AttentionOptions::new().sinks(&[0.0, f32::INFINITY]),
        AttentionOptions::new().softcap(0.0),
        AttentionOptions::new().softcap(-1.0),
        AttentionOptions::new().softcap(f32::INFINITY),
        AttentionOptions::new().softcap(f32::NAN),
    ] {
        let error = run(&opts).unwrap_err();
        assert_eq!(error.kind(), sdpa::ErrorKind::InvalidOption, "{error}");
    }
    assert!(
        run(&AttentionOptions::new()
            .alibi(&[0.5, 0.25])
            .sinks(&[1.0, 2.0]))
        .is_ok()
    );
}
