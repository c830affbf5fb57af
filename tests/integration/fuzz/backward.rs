//! The fused backward against the `f64` reference, and a backward from a
//! made-up forward partial.

use ndarray::ArrayView1;

use super::*;

pub(super) const BACKWARD_CLOSE: &str = "fused backward within tolerance of the f64 reference";
pub(super) const BACKWARD_ZERO: &str =
    "hidden queries, keys and bias entries get exactly zero gradients";
pub(super) const BACKWARD_GARBAGE: &str =
    "a backward from any forward partial (garbage lse) neither panics nor fails";

/// The fused backward (every kernel set, from its own forward) against
/// `core`'s in `f64`, when the inputs are finite where seen and moderate
/// (q, k, v of magnitude at most 1, `scale·q` and `scale·k` at most 10,
/// finite bias at most 10, scores that span at most 40, no overflow). Invisible entries may hold NaN/inf.
/// Hidden queries, keys and bias entries get exactly zero gradients. A
/// backward given a made-up forward partial (say a log-sum-exp of −1e30)
/// must not panic.
#[test]
pub(super) fn backward_matches_the_f64_reference() {
    Failures::run(
        "fuzz::backward::backward_matches_the_f64_reference",
        backward_case,
    )
    .finish();
}

pub(super) fn backward_case(case: &Case, report: &mut CaseReport) {
    let c = Conditioning::of(case);
    if case.expect != Expect::Ok {
        return;
    }
    let mut rng = Rng::new(case.seed ^ 0xbac4_0000);
    garbage_backward(case, &mut rng, report);
    // d_k = scale·dSᵀ·Q and d_q = scale·dS·K: a large scale multiplies
    // the rounding error of dS, which cancellation can leave far larger
    // than the exact gradient; such cases are not compared.
    let scale = case.scale_f64().abs();
    let scaled_inputs = scale * max_abs(case.q.base.iter()).max(max_abs(case.k.base.iter()));
    if !case.visible_poison.is_empty()
        || !case.moderate
        || scaled_inputs > 10.0
        || c.bias_bound + c.alibi_bound > 10.0
        || c.score_bound + c.bias_bound + c.alibi_bound > 20.0
    {
        return;
    }
    let case = &if rng.chance(0.5) {
        case.poison_invisible(&mut rng, 1.0).0
    } else {
        case.clone()
    };
    let vis = case.visibility();
    let d32 = Data::<f32>::new(case);
    let d64 = Data::<f64>::new(case);
    let (o32, o64) = (case.options(&d32), case.options(&d64));
    let (q64, k64, v64) = d64.qkv();
    let (expected, (terms, sink_terms)) = match guarded(|| {
        let forward = sdpa::scaled_dot_product_attention_partial(q64, k64, v64, &o64)?;
        let gradients = sdpa::core::scaled_dot_product_attention_backward(
            q64,
            k64,
            v64,
            &o64,
            &forward,
            d64.d_out.view(),
        )?;
        let weights = sdpa::core::attention_weights(q64, k64, &o64)?;
        let terms = GradientTerms::of(case, &weights, &forward, &d64, scaled_inputs);
        Ok::<_, AttentionError>((
            gradients,
            (terms, sink_terms(case, &forward, &d64.d_out.view())),
        ))
    }) {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => return report.fail(EXPECTED, format!("core f64 backward: {e}")),
        Err(panic) => return report.fail(NO_PANIC, format!("core f64 backward: {panic}")),
    };
    check_zero_gradients(
        "core f64",
        case,
        &vis,
        [&expected.d_q, &expected.d_k, &expected.d_v],
        expected.d_bias.as_ref(),
        report,
    );
    let (q, k, v) = d32.qkv();
    for set in available_kernel_sets() {
        let got = match guarded(|| {
            forced(set, || {
                let forward = sdpa::scaled_dot_product_attention_partial(q, k, v, &o32)?;
                sdpa::scaled_dot_product_attention_backward(
                    q,
                    k,
                    v,
                    &o32,
                    &forward,
                    d32.d_out.view(),
                )
            })
        }) {
            Ok(Ok(g)) => g,
            Ok(Err(e)) => {
                report.fail(EXPECTED, format!("fused {set} backward: {e}"));
                continue;
            }
            Err(panic) => {
                report.fail(NO_PANIC, format!("fused {set} backward: {panic}"));
                continue;
            }
        };
        let to64 = |a: &Array4<f32>| a.mapv(f64::from);
        check_zero_gradients(
            &format!("fused {set}"),
            case,
            &vis,
            [&to64(&got.d_q), &to64(&got.d_k), &to64(&got.d_v)],
            got.d_bias.as_ref().map(to64).as_ref(),
            report,
        );
        let mut pairs = vec![
            ("d_q", to64(&got.d_q), &expected.d_q, terms.d_q),
            ("d_k", to64(&got.d_k), &expected.d_k, terms.d_k),
            ("d_v", to64(&got.d_v), &expected.d_v, terms.d_v),
        ];
        match (&got.d_bias, &expected.d_bias) {
            (Some(g), Some(e)) => pairs.push(("d_bias", to64(g), e, terms.d_bias)),
            (None, None) => {}
            _ => report.fail(
                BACKWARD_CLOSE,
                format!("fused {set}: d_bias present in one result only"),
            ),
        }
        match (&got.d_sinks, &expected.d_sinks) {
            (Some(g), Some(e)) => {
                // d_sinks[h] = −Σ_(b,i) p_sink·D_i sums a row's worth of
                // error per row: the tolerance grows with Σ |p_sink·D|.
                for (h, (&g, &e)) in g.iter().zip(e).enumerate() {
                    let g = f64::from(g);
                    let tol = (1.0 + sink_terms[h]) * (2e-5 + 4.0 * c.score_error(EPS32));
                    if !(g.is_finite() && (g - e).abs() <= tol) {
                        report.fail(
                            BACKWARD_CLOSE,
                            format!("fused {set}: d_sinks[{h}] = {g:e}, f64 reference {e:e} (tolerance {tol:e})"),
                        );
                    }
                }
            }
            (None, None) => {}
            _ => report.fail(
                BACKWARD_CLOSE,
                format!("fused {set}: d_sinks present in one result only"),
            ),
        }
        for (name, g, e, terms) in pairs {
            // The rounding scales with the terms summed, which cancellation
            // can leave far larger than the result (a row that sees one key
            // has d_q = 0 in exact arithmetic).
            let result = e.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let scale = 1.0 + result.max(terms);
            let tol = scale * (2e-5 + 4.0 * c.score_error(EPS32));
            if let Some(((index, &g), &e)) = g
                .indexed_iter()
                .zip(e.iter())
                .find(|&((_, &g), &e)| !(g.is_finite() && (g - e).abs() <= tol))
            {
                report.fail(BACKWARD_CLOSE, format!("fused {set}: {name}{index:?} = {g:e}, f64 reference {e:e} (tolerance {tol:e})"));
            }
        }
    }
}

/// The magnitude of the sums each gradient is made of, from the `f64`
/// forward. With `t_ij = P_ij·(Σ_c |dO_ic·v_jc| + Σ_c |dO_ic·O_ic|)`, which
/// bounds `|dS_ij| = P_ij·|dO_i·v_j − dO_i·O_i|` term by term (a softcap's
/// slope is at most 1):
/// - `d_q`: `|scale|·max|k|·max_i Σ_j t_ij`;
/// - `d_k`: `|scale|·max|q|·max_j Σ_(h in j's group, i) t_ij`;
/// - `d_v`: `max_j Σ_(h in j's group, i) P_ij·max_c |dO_ic|`;
/// - `d_bias`: the largest sum of `t_ij` over the positions an entry
///   broadcasts to.
struct GradientTerms {
    d_q: f64,
    d_k: f64,
    d_v: f64,
    d_bias: f64,
}

impl GradientTerms {
    /// `scaled_inputs` is `|scale|·max(max|q|, max|k|)` of the unpoisoned
    /// case.
    fn of(
        case: &Case,
        weights: &Array4<f64>,
        forward: &AttentionPartial<f64>,
        d64: &Data<f64>,
        scaled_inputs: f64,
    ) -> Self {
        let (batch, heads, len_q, len_kv) = weights.dim();
        let kv_heads = case.k.shape[1];
        let group = heads / kv_heads;
        let (v, d_out, out) = (d64.v.view(), d64.d_out.view(), forward.output());
        let mut row_terms = Array3::<f64>::zeros((batch, heads, len_q));
        let mut key_terms = Array3::<f64>::zeros((batch, kv_heads, len_kv));
        let mut value_terms = Array3::<f64>::zeros((batch, kv_heads, len_kv));
        let mut bias_terms = case.bias.as_ref().map(|b| Array4::<f64>::zeros(b.shape));
        let offset = case.shard().0;
        for ((b, h, i, j), &p) in weights.indexed_iter() {
            // Hidden and invisible entries have weight 0 and may hold NaN.
            if p == 0.0 {
                continue;
            }
            let g = h / group;
            let (d_o, o, v_j) = (
                d_out.slice(s![b, h, i, ..]),
                out.slice(s![b, h, i, ..]),
                v.slice(s![b, g, j, ..]),
            );
            let dot = |x: ArrayView1<'_, f64>| -> f64 {
                d_o.iter().zip(x).map(|(a, b)| (a * b).abs()).sum()
            };
            let t = p * (dot(v_j) + dot(o));
            row_terms[[b, h, i]] += t;
            key_terms[[b, g, j]] += t;
            value_terms[[b, g, j]] += p * d_o.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            if let Some(terms) = &mut bias_terms {
                let pos = [b, h, i, offset + j];
                let index: [usize; 4] =
                    std::array::from_fn(|a| if terms.shape()[a] == 1 { 0 } else { pos[a] });
                terms[index] += t;
            }
        }
        let max = |a: &[f64]| a.iter().fold(0.0f64, |m, &x| m.max(x));
        GradientTerms {
            d_q: scaled_inputs * max(row_terms.as_slice().unwrap()),
            d_k: scaled_inputs * max(key_terms.as_slice().unwrap()),
            d_v: max(value_terms.as_slice().unwrap()),
            d_bias: bias_terms.map_or(0.0, |t| max(t.as_slice().unwrap())),
        }
    }
}

/// Per head, `Σ_(b,i) p_sink·Σ_c |dO·O|` from the `f64` forward: the
/// magnitude of the sum `d_sinks[h]` is (zeros without sinks).
fn sink_terms(
    case: &Case,
    forward: &AttentionPartial<f64>,
    d_out: &ArrayView4<'_, f64>,
) -> Vec<f64> {
    let [batch, heads, len_q, _] = case.q.shape;
    (0..heads)
        .map(|h| {
            let Some(sink) = case.sink(h) else {
                return 0.0;
            };
            ndarray::indices((batch, len_q))
                .into_iter()
                .map(|(b, i)| {
                    let p_sink = (sink - forward.log_sum_exp()[[b, h, i]]).exp();
                    let out = forward.output();
                    let delta: f64 = out
                        .slice(s![b, h, i, ..])
                        .iter()
                        .zip(d_out.slice(s![b, h, i, ..]))
                        .map(|(o, d)| (o * d).abs())
                        .sum();
                    if p_sink.is_finite() {
                        p_sink * delta
                    } else {
                        0.0
                    }
                })
                .sum()
        })
        .collect()
}

/// Gradients that must be exactly zero: `d_q` of queries with no live key,
/// `d_k`/`d_v` of keys live for no query, `d_bias` entries of positions
/// that are not live.
pub(super) fn check_zero_gradients(
    label: &str,
    case: &Case,
    vis: &Visibility,
    [d_q, d_k, d_v]: [&Array4<f64>; 3],
    d_bias: Option<&Array4<f64>>,
    report: &mut CaseReport,
) {
    let mut fail = |what: String| report.fail(BACKWARD_ZERO, format!("{label}: {what}"));
    for ((b, h, i), &lives) in vis.row_lives.indexed_iter() {
        if !lives && d_q.slice(s![b, h, i, ..]).iter().any(|&x| x != 0.0) {
            fail(format!(
                "d_q[{b}, {h}, {i}, ..] = {} for a query with no live key",
                d_q.slice(s![b, h, i, ..])
            ));
        }
    }
    for ((b, g, j), &lives) in vis.key_lives.indexed_iter() {
        for (name, grad) in [("d_k", d_k), ("d_v", d_v)] {
            if !lives && grad.slice(s![b, g, j, ..]).iter().any(|&x| x != 0.0) {
                fail(format!(
                    "{name}[{b}, {g}, {j}, ..] = {} for a key live for no query",
                    grad.slice(s![b, g, j, ..])
                ));
            }
        }
    }
    if let (Some(d_bias), Some(bias)) = (d_bias, &case.bias) {
        let (offset, _) = case.shard();
        let mut touched = Array4::from_elem(d_bias.raw_dim(), false);
        for ((b, h, i, j), &live) in vis.live.indexed_iter() {
            if live {
                let pos = [b, h, i, offset + j];
                let index: [usize; 4] =
                    std::array::from_fn(|a| if bias.shape[a] == 1 { 0 } else { pos[a] });
                touched[index] = true;
            }
        }
        if let Some((index, x)) = d_bias
            .indexed_iter()
            .zip(&touched)
            .find_map(|((index, &x), &t)| (!t && x != 0.0).then_some((index, x)))
        {
            fail(format!(
                "d_bias{index:?} = {x:e} for a position live for no query"
            ));
        }
    }
}

/// A backward given a forward partial made up from arbitrary numbers: it
/// must return `Ok` (the shapes are right) without panicking, on every path.
pub(super) fn garbage_backward(case: &Case, rng: &mut Rng, report: &mut CaseReport) {
    let out_shape = case.out_shape();
    let lse_values = [
        f32::NEG_INFINITY,
        f32::INFINITY,
        f32::NAN,
        -1e30,
        1e30,
        -100.0,
        0.0,
        3.0,
    ];
    let lse = Array3::from_shape_simple_fn((out_shape[0], out_shape[1], out_shape[2]), || {
        pick(rng, &lse_values)
    });
    let out = Array4::from_shape_simple_fn(out_shape, || pick(rng, &[0.0f32, 1.0, -2.5, f32::NAN]));
    let Ok(partial) = AttentionPartial::from_parts(out, lse) else {
        return report.fail(
            BACKWARD_GARBAGE,
            "from_parts refused arrays of the right shapes".into(),
        );
    };
    let d32 = Data::<f32>::new(case);
    let opts = case.options(&d32);
    let (q, k, v) = d32.qkv();
    let mut calls: Vec<(String, Called<sdpa::AttentionGradients<f32>>)> = available_kernel_sets()
        .into_iter()
        .map(|set| {
            (
                format!("fused {set}"),
                guarded(|| {
                    forced(set, || {
                        sdpa::scaled_dot_product_attention_backward(
                            q,
                            k,
                            v,
                            &opts,
                            &partial,
                            d32.d_out.view(),
                        )
                    })
                }),
            )
        })
        .collect();
    calls.push((
        "core f32".into(),
        guarded(|| {
            sdpa::core::scaled_dot_product_attention_backward(
                q,
                k,
                v,
                &opts,
                &partial,
                d32.d_out.view(),
            )
        }),
    ));
    // Merging made-up partials must not panic either.
    let mut merged = partial.clone();
    if let Err(panic) = guarded(|| merged.merge(&partial)) {
        report.fail(BACKWARD_GARBAGE, format!("merge panicked: {panic}"));
    }
    for (label, called) in calls {
        match called {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => report.fail(BACKWARD_GARBAGE, format!("{label}: {e}")),
            Err(panic) => report.fail(BACKWARD_GARBAGE, format!("{label} panicked: {panic}")),
        }
    }
}
