//! The oracle written from the README's semantics, the tolerances derived
//! from each case's conditioning, and the forward checks against them.

use super::*;

/// The answer in `f64`, computed here with loops from the README's
/// semantics: invisible keys are skipped; a `−inf` bias gives weight 0 and
/// its value is never multiplied in; a row with no unhidden visible key is
/// zeros with log-sum-exp `−inf`, one whose unhidden visible scores are all
/// `−inf` NaN with log-sum-exp `−inf`; a NaN or `+inf` score makes the row
/// NaN; a non-finite value of a key of weight reaches its column.
///
/// The score modifiers, from the options' documentation: a softcap makes
/// the scaled score `s` into `cap·tanh(s/cap)` (`±inf` into `±cap`) before
/// the bias; ALiBi adds `slope_h·(j − p_i)` after it; a sink joins each
/// softmax's denominator, `P_ij = e^(S_ij) / (e^(sink_h) + Σ_j e^(S_ij))`,
/// and a row that sees no key, or whose scores are all `−inf`, is zeros
/// with log-sum-exp `sink_h` (the sink takes all the weight).
pub(super) struct Reference {
    pub(super) out: Array4<f64>,
    pub(super) lse: Array3<f64>,
    /// The log-sum-exp of the row's keys alone, without the sink: `−inf`
    /// for a row that sees no key or whose scores are all `−inf`. Equal to
    /// `lse` without sinks.
    pub(super) keys_lse: Array3<f64>,
    /// The sink logit each head's rows count, if any (`Case::sink`).
    pub(super) sinks: Vec<Option<f64>>,
    /// Rows whose answer the README leaves open: a `−inf` bias on a key
    /// whose score is NaN or infinite (does the bias hide the key or is
    /// `NaN − inf` NaN?), or a non-finite value of a key whose weight
    /// underflows to 0. Only closeness of finite entries is checked there.
    pub(super) ambiguous: Array3<bool>,
    /// Rows that see a non-finite input: their query (if they see a key),
    /// a visible key, a NaN or `+inf` bias of a visible key, or a value of
    /// a live key. Such a row may come out non-finite on an `f32` path even
    /// where the `f64` answer is finite (say `scale·q` underflows to 0 and
    /// meets an infinite key: 0·inf = NaN).
    pub(super) sees_non_finite: Array3<bool>,
}

pub(super) fn oracle(case: &Case, vis: &Visibility) -> Reference {
    let [batch, heads, len_q, d_k] = case.q.shape;
    let [_, kv_heads, len_kv, d_v] = case.v.shape;
    let group = heads / kv_heads;
    let scale = case.scale_f64();
    let mut out = Array4::zeros((batch, heads, len_q, d_v));
    let mut lse = Array3::from_elem((batch, heads, len_q), f64::NEG_INFINITY);
    let mut keys_lse = Array3::from_elem((batch, heads, len_q), f64::NEG_INFINITY);
    let sinks: Vec<Option<f64>> = (0..heads).map(|h| case.sink(h)).collect();
    let mut ambiguous = Array3::from_elem((batch, heads, len_q), false);
    let mut sees_non_finite = Array3::from_elem((batch, heads, len_q), false);
    let finite_row = |t: &Tensor<f32>, b: usize, h: usize, i: usize, d: usize| {
        (0..d).all(|c| t.at([b, h, i, c]).is_finite())
    };
    for (b, h, i) in ndarray::indices((batch, heads, len_q)) {
        let g = h / group;
        let sink = sinks[h];
        // A row that sees no key, or only `−inf` scores, has log-sum-exp
        // `−inf`, or the sink's logit.
        lse[[b, h, i]] = sink.unwrap_or(f64::NEG_INFINITY);
        sees_non_finite[[b, h, i]] = (0..len_kv).any(|j| {
            let bias = case.bias_at(b, h, i, j);
            vis.visible[[b, h, i, j]]
                && (!finite_row(&case.q, b, h, i, d_k)
                    || !finite_row(&case.k, b, g, j, d_k)
                    || bias.is_nan()
                    || bias == f32::INFINITY
                    || (vis.live[[b, h, i, j]] && !finite_row(&case.v, b, g, j, d_v)))
        });
        let mut scores = Vec::new();
        for j in 0..len_kv {
            if !vis.visible[[b, h, i, j]] {
                continue;
            }
            let dot: f64 = (0..d_k)
                .map(|d| case.q.at([b, h, i, d]) as f64 * case.k.at([b, g, j, d]) as f64)
                .sum();
            let bias = case.bias_at(b, h, i, j) as f64;
            let mut score = scale * dot;
            if let Some(cap) = case.softcap {
                let cap = cap as f64;
                score = cap * (score / cap).tanh();
            }
            if bias == f64::NEG_INFINITY {
                ambiguous[[b, h, i]] |= !score.is_finite();
                continue;
            }
            scores.push((j, score + bias + case.alibi_at(h, i, j)));
        }
        let max = scores.iter().fold(f64::NEG_INFINITY, |m, &(_, s)| {
            if m.is_nan() || s.is_nan() {
                f64::NAN
            } else {
                m.max(s)
            }
        });
        if scores.is_empty() {
            continue; // no visible key, or all hidden by a −inf bias: zeros
        }
        if max == f64::NEG_INFINITY {
            // Every unhidden visible score −inf from the data: a sum of
            // weights of 0, so NaN out and log-sum-exp −inf. With a sink
            // every weight is `0 / e^(sink)`: zeros, log-sum-exp `sink_h`.
            if sink.is_none() {
                out.slice_mut(s![b, h, i, ..]).fill(f64::NAN);
            }
            continue;
        }
        if !max.is_finite() {
            out.slice_mut(s![b, h, i, ..]).fill(f64::NAN);
            lse[[b, h, i]] = f64::NAN;
            keys_lse[[b, h, i]] = f64::NAN;
            continue;
        }
        let keys_sum: f64 = scores.iter().map(|&(_, s)| (s - max).exp()).sum();
        keys_lse[[b, h, i]] = max + keys_sum.ln();
        // With a sink, every weight is relative to the larger of the two.
        let max = sink.map_or(max, |sink| max.max(sink));
        let sum = scores.iter().map(|&(_, s)| (s - max).exp()).sum::<f64>()
            + sink.map_or(0.0, |sink| (sink - max).exp());
        for &(j, score) in &scores {
            let weight = (score - max).exp() / sum;
            let values = (0..d_v).map(|c| case.v.at([b, g, j, c]) as f64);
            if weight == 0.0 {
                ambiguous[[b, h, i]] |=
                    score > f64::NEG_INFINITY && values.clone().any(|x| !x.is_finite());
                continue;
            }
            for (c, x) in values.enumerate() {
                out[[b, h, i, c]] += weight * x;
            }
        }
        lse[[b, h, i]] = max + sum.ln();
    }
    Reference {
        out,
        lse,
        keys_lse,
        sinks,
        ambiguous,
        sees_non_finite,
    }
}

/// How well conditioned a case is, and the tolerances that follow.
///
/// Error model, for a path computing in precision `eps` (inputs exact in
/// both): the scaled, biased score `s = scale·q·k + bias` has error at most
/// `Δs = 8·eps·(S + B + 1)`, where `S = |scale|·max|q|·max|k|·d_k` bounds
/// `|scale|·Σ|q_d·k_d|` and `B = max|bias|` (8 covers the blocked dot
/// product's depth, the max subtraction and the bias addition). A weight
/// `w = e^(s − lse)` then has relative error at most `e^(2Δs) − 1 ≤ 4Δs`
/// (for `Δs ≤ 0.6`), so the output `Σ w·v`, a convex combination, moves by
/// at most `4Δs·max|v|`, plus `eps·(32 + 4·log2 len_kv)·max|v|` for `exp`
/// (≤ 2 ulp), the normalisation and the summation. When `Δs` is large the
/// bound exceeds `2·max|v|`, which no two convex combinations exceed: the
/// check relaxes by itself where f32 cannot resolve the scores (a score of
/// 1e6 has an ulp of 0.06). For inputs of order 1 it is about 3e-5·max|v|,
/// the tolerance of the other tests.
///
/// The modifiers: ALiBi adds a bias of at most `A = max|slope|·max|j − p_i|`,
/// counted with the bias. A softcap's tanh has slope at most 1, so the
/// dot product's error passes through it shrunk (and a capped score moves
/// by at most `2·cap`), and the cap itself adds a few ulp of
/// `min(S, cap)` (tanh ≤ 3 ulp, the division and the product). A sink
/// scales the keys' convex combination by `W = e^(lse_keys − lse)`, whose
/// relative error is at most `2Δs` plus the rounding of two log-sum-exps
/// of magnitude up to `S + B + A + |sink|`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Conditioning {
    pub(super) score_bound: f64,
    pub(super) bias_bound: f64,
    /// `A` above: the largest `|ALiBi bias|` of the call, 0 without ALiBi.
    pub(super) alibi_bound: f64,
    pub(super) softcap: Option<f64>,
    /// The largest `|score|` after the softcap: `min(S, cap)`, or `cap`
    /// when a query or key holds an infinity (which the cap makes `±cap`);
    /// `S` without a softcap.
    pub(super) capped_bound: f64,
    /// The largest `|sink|` the call counts, `None` without sinks.
    pub(super) sink_bound: Option<f64>,
    pub(super) v_max: f64,
    pub(super) len_kv: usize,
    /// A score (or a partial product of it, in whatever order a path
    /// multiplies) may pass `f32::MAX`: a non-finite `f32` output is then
    /// explained.
    pub(super) overflow_risk: bool,
    /// Scores span less than 80, so no `f32` weight of a finite score
    /// underflows to 0 (`e^−80 > f32::MIN_POSITIVE`), and a non-finite
    /// value of a live key must reach the output.
    pub(super) underflow_free: bool,
}

impl Conditioning {
    pub(super) fn of(case: &Case) -> Self {
        let q_max = max_abs(case.q.base.iter());
        let k_max = max_abs(case.k.base.iter());
        let scale = case.scale_f64().abs();
        let d_k = case.q.shape[3] as f64;
        let bias_bound = case.bias.as_ref().map_or(0.0, |b| max_abs(b.base.iter()));
        let alibi_bound = case.alibi_bound();
        let softcap = case.softcap.map(f64::from);
        let score_bound = scale * q_max * k_max * d_k;
        let worst_order =
            scale.max(1.0) * q_max.max(1.0) * k_max.max(1.0) * d_k + bias_bound + alibi_bound;
        // Capped scores span at most 2·cap: no weight underflows there.
        let qk_finite = case
            .q
            .base
            .iter()
            .chain(&case.k.base)
            .all(|x| x.is_finite());
        let capped_bound = softcap.map_or(score_bound, |cap| {
            if qk_finite { score_bound.min(cap) } else { cap }
        });
        let heads = case.q.shape[1];
        let sink_bound = case.sinks.as_ref().map(|_| {
            (0..heads)
                .filter_map(|h| case.sink(h))
                .fold(0.0, |m: f64, s| m.max(s.abs()))
        });
        Conditioning {
            score_bound,
            bias_bound,
            alibi_bound,
            softcap,
            capped_bound,
            sink_bound,
            v_max: max_abs(case.v.base.iter()),
            len_kv: case.len_kv(),
            overflow_risk: worst_order * 64.0 > f32::MAX as f64,
            underflow_free: 2.0 * (capped_bound + bias_bound + alibi_bound) < 80.0,
        }
    }

    pub(super) fn score_error(&self, eps: f64) -> f64 {
        let dot = 8.0 * eps * (self.score_bound + 1.0);
        let scores = match self.softcap {
            Some(cap) => dot.min(2.0 * cap) + 8.0 * eps * self.capped_bound,
            None => dot,
        };
        scores + 8.0 * eps * (self.bias_bound + self.alibi_bound)
    }

    /// The relative error of a sink's share `W` of the weight (see above),
    /// 0 without sinks.
    fn sink_share_error(&self, eps: f64) -> f64 {
        self.sink_bound.map_or(0.0, |sink| {
            let lse_bound =
                self.capped_bound + self.bias_bound + self.alibi_bound + self.log_len() + sink;
            2.0 * self.score_error(eps) + 8.0 * eps * (lse_bound + 4.0)
        })
    }

    pub(super) fn log_len(&self) -> f64 {
        ((self.len_kv + 1) as f64).log2()
    }

    pub(super) fn output(&self, eps: f64) -> f64 {
        self.v_max
            * (4.0 * self.score_error(eps)
                + self.sink_share_error(eps)
                + eps * (32.0 + 4.0 * self.log_len()))
            + f32::MIN_POSITIVE as f64
    }

    pub(super) fn log_sum_exp(&self, eps: f64, lse: f64) -> f64 {
        // With a sink, one more log-sum-exp of two terms.
        let sink = if self.sink_bound.is_some() {
            4.0 * eps * (lse.abs() + 2.0)
        } else {
            0.0
        };
        2.0 * self.score_error(eps) + eps * (lse.abs() + 4.0 * self.log_len() + 4.0) + sink
    }
}

/// What a path is held to.
#[derive(Clone, Copy)]
pub(super) struct PathKind {
    pub(super) eps: f64,
    /// `f32` paths may give non-finite output where the scores overflow.
    pub(super) may_overflow: bool,
    /// Whether a row's sums are held to the worst case of adding `len_kv`
    /// terms one by one, a relative error of `eps·len_kv`, rather than the
    /// log-length growth of [`Conditioning`]'s model. `core` adds a row's
    /// weights in order, and adding many small terms to a large sum can
    /// round the same way each time: in `f64` the log-sum-exp passed the
    /// model's tolerance in two cases of 20 000 (seeds 0x1234567800001c83
    /// and 0x1234567800002c41, the second by 2×: 4.9e-14 against 2.4e-14).
    /// The worst case costs nothing in `f64`; the `f32` paths keep the
    /// model, which no run has exceeded, so that their check stays tight.
    pub(super) worst_case_sums: bool,
}

impl PathKind {
    /// The tolerance of an output entry on this path.
    pub(super) fn output_tolerance(&self, c: &Conditioning) -> f64 {
        c.output(self.eps) + c.v_max * self.sum_error(c)
    }

    /// The tolerance of a log-sum-exp near `lse` on this path.
    pub(super) fn lse_tolerance(&self, c: &Conditioning, lse: f64) -> f64 {
        c.log_sum_exp(self.eps, lse) + self.sum_error(c)
    }

    /// The relative error of a row's sums beyond the model's, 0 unless
    /// [`worst_case_sums`](Self::worst_case_sums).
    fn sum_error(&self, c: &Conditioning) -> f64 {
        if self.worst_case_sums {
            self.eps * c.len_kv as f64
        } else {
            0.0
        }
    }
}

pub(super) const F32_PATH: PathKind = PathKind {
    eps: EPS32,
    may_overflow: true,
    worst_case_sums: false,
};
pub(super) const F64_PATH: PathKind = PathKind {
    eps: EPS64,
    may_overflow: false,
    worst_case_sums: true,
};

pub(super) const EXPLAINED: &str = "non-finite output only where the f64 answer, a visible non-finite input or f32 overflow explains it";
pub(super) const PROPAGATES: &str =
    "non-finite visible input reaches the output (no silent finite value)";
pub(super) const SEES_KEY: &str =
    "a row that sees a key is never reported as seeing none (zeros / lse −inf)";
pub(super) const SEES_NONE: &str =
    "a row that sees no key outputs exact zeros and lse −inf (the sink's logit, with sinks)";
pub(super) const CLOSE: &str = "output within tolerance of the f64 answer";
pub(super) const LSE_CLOSE: &str = "log-sum-exp within tolerance of the f64 answer";

/// Checks one path's output (and log-sum-exp) against the oracle.
pub(super) fn check_forward(
    label: &str,
    path: PathKind,
    out: &ArrayView4<'_, f64>,
    lse: Option<&ArrayView3<'_, f64>>,
    reference: &Reference,
    c: &Conditioning,
    report: &mut CaseReport,
) {
    let overflow = path.may_overflow && c.overflow_risk;
    let propagate = !path.may_overflow || (c.underflow_free && !c.overflow_risk);
    let tol = path.output_tolerance(c);
    for ((b, h, i), &ambiguous) in reference.ambiguous.indexed_iter() {
        let explained = ambiguous || (path.may_overflow && reference.sees_non_finite[[b, h, i]]);
        let got = out.slice(s![b, h, i, ..]);
        let want = reference.out.slice(s![b, h, i, ..]);
        let want_lse = reference.lse[[b, h, i]];
        let got_lse = lse.map(|l| l[[b, h, i]]);
        let at = |what: &str, c: usize, g: f64, w: f64| {
            format!("{label}: {what}[{b}, {h}, {i}, {c}] = {g:e}, f64 answer {w:e}")
        };
        for (col, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if !g.is_finite() && w.is_finite() && !explained && !overflow {
                report.fail(EXPLAINED, at("out", col, g, w));
            }
            if !w.is_finite() && g.is_finite() && !ambiguous && propagate {
                report.fail(PROPAGATES, at("out", col, g, w));
            }
            if g.is_finite() && w.is_finite() && (g - w).abs() > tol {
                report.fail(
                    CLOSE,
                    format!(
                        "{}, |error| {:e} > tolerance {tol:e}",
                        at("out", col, g, w),
                        (g - w).abs()
                    ),
                );
            }
        }
        if let Some(g) = got_lse {
            let w = want_lse;
            if !g.is_finite() && w.is_finite() && !explained && !overflow {
                report.fail(EXPLAINED, at("lse", 0, g, w));
            }
            if w.is_nan() && !g.is_nan() && !ambiguous && propagate {
                report.fail(PROPAGATES, at("lse", 0, g, w));
            }
            let tol = path.lse_tolerance(c, w);
            if g.is_finite() && w.is_finite() && (g - w).abs() > tol {
                report.fail(
                    LSE_CLOSE,
                    format!(
                        "{}, |error| {:e} > tolerance {tol:e}",
                        at("lse", 0, g, w),
                        (g - w).abs()
                    ),
                );
            }
        }
        if ambiguous {
            continue;
        }
        // Whether the row sees a key is a matter of its keys alone: the
        // sink, if any, only joins their log-sum-exp.
        let keys_lse = reference.keys_lse[[b, h, i]];
        // A row whose unhidden keys all scored −inf (NaN, log-sum-exp −inf,
        // or zeros with a sink) was checked above; on an `f32` path such a
        // row, which sees a non-finite input, may come out non-finite
        // (say `scale·q·k` overflows where `f64` gives −inf).
        let non_finite = got.iter().any(|g| !g.is_finite());
        if keys_lse == f64::NEG_INFINITY
            && (want.iter().any(|w| w.is_nan()) || (explained && non_finite))
        {
            continue;
        }
        if keys_lse == f64::NEG_INFINITY {
            // Zeros, and log-sum-exp −inf or exactly the sink's logit.
            if got.iter().any(|&g| g != 0.0) || got_lse.is_some_and(|g| g != want_lse) {
                report.fail(
                    SEES_NONE,
                    format!("{label}: row [{b}, {h}, {i}] = {got} with lse {got_lse:?}, f64 lse {want_lse:e}"),
                );
            }
        } else {
            // With a sink, the keys' share of the weight may underflow
            // (f32 flushes e^−104): zeros are wrong only where the keys
            // hold at least half of it and the log-sum-exps are resolved.
            let share_resolved = reference.sinks[h].is_none()
                || ((keys_lse - want_lse).exp() >= 0.5 && path.lse_tolerance(c, want_lse) < 1.0);
            let zeros = share_resolved
                && want.iter().all(|w| w.is_finite())
                && want.iter().any(|&w| w != 0.0)
                && got.iter().all(|&g| g == 0.0);
            if zeros || got_lse == Some(f64::NEG_INFINITY) {
                report.fail(SEES_KEY, format!("{label}: row [{b}, {h}, {i}] = {got} with lse {got_lse:?}, f64 answer {want} with lse {want_lse:e}"));
            }
        }
    }
}

/// The first index where two arrays differ in bits (NaNs of any payload
/// count as equal).
pub(super) fn first_bit_difference(
    a: &ArrayView4<'_, f32>,
    b: &ArrayView4<'_, f32>,
) -> Option<String> {
    if a.shape() != b.shape() {
        return Some(format!("shapes {:?} and {:?}", a.shape(), b.shape()));
    }
    a.indexed_iter()
        .zip(b.iter())
        .find_map(|((index, &x), &y)| {
            (x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
                .then(|| format!("{index:?}: {x:e} vs {y:e}"))
        })
}

pub(super) fn to_f64_4(a: &ArrayView4<'_, f32>) -> Array4<f64> {
    a.mapv(f64::from)
}

pub(super) fn to_f64_3(a: &ArrayView3<'_, f32>) -> Array3<f64> {
    a.mapv(f64::from)
}
