//! Score modifiers, the one definition every path (`core`, the fused
//! drivers, both backwards) asks: ALiBi's per-head linear bias, computed
//! from positions rather than stored, and attention sinks, a virtual key
//! per head in the softmax's denominator.
//!
//! The order of operations on a score, on every path:
//!
//! ```text
//! s_ij = scale·q_i·k_j,  then  cap·tanh(s_ij/cap)  with a softcap
//! S_ij = s_ij  (+ bias_ij, a −inf bias hides the key)  − slope_h·(p_i − j)
//! masked keys: weight exactly 0, by selection
//! P_ij = e^(S_ij) / (e^(sink_h) + Σ_j e^(S_ij)),   lse_i = log(e^(sink_h) + Σ_j e^(S_ij))
//! ```
//!
//! A sink is a partial result of its own, output 0 and log-sum-exp
//! `sink_h` (see `partial.rs`): every path computes the keys' result and
//! merges the sink into it once ([`apply_sink`]), after the keys' chunks
//! are merged. Its gradient needs only the forward's output, its
//! log-sum-exp and `d_out` ([`sink_gradients`]): with
//! `p_sink = e^(sink − lse_i)` and `D_i = Σ_c dO_ic·O_ic`,
//!
//! ```text
//! ∂L/∂sink_h = −Σ_(b,i) p_sink_(b,h,i) · D_(b,h,i)
//! ```
//!
//! and the keys' `dS = P ∘ (dP − D)` is unchanged (the sink holds no
//! value, so `D_i` is still `Σ_j P_ij·dP_ij`). A softcap multiplies the
//! gradient of `s_ij` by `1 − tanh²(s_ij/cap)` ([`softcapped`]).
//!
//! Below both paths: imports only the call, the options and the errors.

use ndarray::{Array1, Axis};
use num_traits::Float;

use crate::call::{AttentionShape, BackwardCall, Call};
use crate::element::Element;
use crate::error::{AttentionError, ErrorKind};
use crate::options::AttentionOptions;

/// The standard ALiBi slopes for `heads` heads, as the ALiBi paper and
/// BLOOM's `build_alibi_tensor` define them: with `n` the largest power of
/// two `≤ heads`, the geometric sequence `2^(−8k/n)` for `k = 1..=n`, then,
/// when `heads` is not a power of two, the odd terms `2^(−4k/n)` for
/// `k = 1, 3, 5, …` (`heads − n` of them) of the sequence for `2n` heads.
///
/// ```
/// let slopes = sdpa::alibi_slopes(8);
/// assert_eq!(slopes[0], 0.5);
/// assert_eq!(slopes[7], 1.0 / 256.0);
/// // 12 heads: the 8 slopes above, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
/// let twelve = sdpa::alibi_slopes(12);
/// assert_eq!(&twelve[..8], &slopes[..]);
/// assert!((twelve[9] - 2f64.powf(-1.5)).abs() < 1e-15);
/// ```
pub fn alibi_slopes(heads: usize) -> Vec<f64> {
    if heads == 0 {
        return Vec::new();
    }
    let closest = 1usize << heads.ilog2();
    let n = closest as f64;
    let mut slopes: Vec<f64> = (1..=closest)
        .map(|k| (-8.0 * k as f64 / n).exp2())
        .collect();
    let extra = heads - closest;
    slopes.extend((0..extra).map(|e| (-4.0 * (2 * e + 1) as f64 / n).exp2()));
    slopes
}

/// Checks the modifiers' per-head arrays against the call's head count.
pub(crate) fn check<F: Element>(
    opts: &AttentionOptions<'_, F>,
    shape: &AttentionShape,
) -> Result<(), AttentionError> {
    for (name, values) in [("alibi", opts.alibi), ("sinks", opts.sinks)] {
        let Some(values) = values else { continue };
        if values.len() != shape.heads {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!(
                    "{name} has {} entries but the call has {} query heads (one per head)",
                    values.len(),
                    shape.heads
                ),
            ));
        }
        if let Some((h, x)) = values.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!("{name}[{h}] must be finite, got {x}"),
            ));
        }
    }
    if let Some(cap) = opts.softcap
        && !(cap.is_finite() && cap > F::zero())
    {
        return Err(AttentionError::new(
            ErrorKind::InvalidOption,
            format!("softcap must be positive and finite, got {cap}"),
        ));
    }
    Ok(())
}

/// `cap·tanh(score/cap)` (`±inf` gives `±cap`, tanh's limits; NaN stays
/// NaN), and its derivative `1 − tanh²(score/cap)`.
#[inline]
pub(crate) fn softcapped<F: Float>(score: F, cap: F) -> (F, F) {
    let t = (score / cap).tanh();
    (cap * t, F::one() - t * t)
}

/// ALiBi for one query row: the bias of the call's key `j` is
/// `slope·(key_offset + j − query_position)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AlibiRow<F> {
    pub slope: F,
    /// `key_offset − query_position`: the signed distance of the call's key
    /// 0 from the query (negative when the key is before it).
    pub key_0_distance: i64,
}

impl<F: Float> AlibiRow<F> {
    /// The bias of the call's key `j`.
    #[inline]
    pub fn bias(&self, j: usize) -> F {
        let distance = self.key_0_distance + j as i64;
        self.slope * F::from(distance).unwrap_or_else(F::zero)
    }
}

impl<F: Copy, KV, Q> Call<'_, F, KV, Q> {
    /// The ALiBi of query `i` of head `h`, if the call has ALiBi.
    pub(crate) fn alibi(&self, h: usize, i: usize) -> Option<AlibiRow<F>> {
        let slopes = self.opts.alibi?;
        let total_len_kv = self
            .opts
            .key_shard
            .map_or(self.shape.len_kv, |shard| shard.total_len_kv);
        // Bottom-right aligned: the last query sits at the last key.
        let query_position = i as i64 + total_len_kv as i64 - self.shape.len_q as i64;
        Some(AlibiRow {
            slope: slopes[h],
            key_0_distance: self.key_offset() as i64 - query_position,
        })
    }

    /// The sink logit of head `h` this call counts: the unsharded call's,
    /// or that of the shard holding key 0 of the whole sequence (with no
    /// keys at all, of a shard at offset 0); `None` otherwise. An empty
    /// shard at offset 0 beside the one holding key 0 does not count it.
    pub(crate) fn sink(&self, h: usize) -> Option<F> {
        let holds_key_0 = match self.opts.key_shard {
            None => true,
            Some(shard) => shard.offset == 0 && (self.shape.len_kv > 0 || shard.total_len_kv == 0),
        };
        match self.opts.sinks {
            Some(sinks) if holds_key_0 => Some(sinks[h]),
            _ => None,
        }
    }
}

/// Merges a sink of logit `sink` (a partial result with output 0) into a
/// row's normalised output and log-sum-exp, as merging the sink's partial
/// would (`merge_row`). A row whose keys have no weight (`lse = −inf`: it
/// saw none, or they all scored `−inf`, a NaN row) becomes zeros with
/// `lse = sink` exactly: each `P_ij = 0 / e^(sink)`, the sink takes all
/// the weight. A NaN row would not match a key shard's merge, where the
/// shard of such keys merges into the sink's shard as nothing.
#[inline]
pub(crate) fn apply_sink<'o, F: Float + 'o>(
    out: impl IntoIterator<Item = &'o mut F>,
    lse: &mut F,
    sink: F,
) {
    if *lse == F::neg_infinity() {
        out.into_iter().for_each(|x| *x = F::zero());
        *lse = sink;
        return;
    }
    // NaN in `lse` gives NaN here (`(NaN − max).exp()`).
    let max = lse.max(sink);
    let total = max + ((*lse - max).exp() + (sink - max).exp()).ln();
    let factor = (*lse - total).exp();
    out.into_iter().for_each(|x| *x = *x * factor);
    *lse = total;
}

/// Whether a row of forward log-sum-exp `lse` sees a key that has weight:
/// false for `−inf`, and, with a sink, for `lse ≤ sink` (the sink took all
/// the weight; exactly `lse = sink` for a row that sees no key).
#[inline]
pub(crate) fn sees_keys<F: Float>(lse: F, sink: Option<F>) -> bool {
    lse != F::neg_infinity() && sink.is_none_or(|sink| lse > sink || lse.is_nan())
}

/// `∂L/∂sinks` of a backward call (see the module header), when the call
/// has sinks: per head, `−Σ_(b,i) e^(sink − lse)·Σ_c dO·O`, summing only
/// the output entries that are not 0 (a row that saw nothing has output 0
/// and may have any `d_out`). Zeros for a key shard that does not count
/// the sink (see `Call::sink`).
///
/// # Errors
/// When the result cannot be allocated.
pub(crate) fn sink_gradients<F: Element>(
    call: &BackwardCall<'_, F>,
) -> Result<Option<Array1<F>>, AttentionError> {
    let forward = &call.forward;
    let Some(sinks) = forward.opts.sinks else {
        return Ok(None);
    };
    let mut d_sinks: Array1<F> = crate::alloc::try_zeros("d_sinks", sinks.len())?;
    for (h, d_sink) in d_sinks.iter_mut().enumerate() {
        let Some(sink) = forward.sink(h) else {
            continue;
        };
        let mut sum = F::zero();
        for b in 0..forward.shape.batch {
            let out = crate::call::head(&call.out, b, h);
            let d_out = crate::call::head(&call.d_out, b, h);
            let lse = call.log_sum_exp.index_axis(Axis(0), b);
            for i in 0..forward.shape.len_q {
                let lse = lse[[h, i]];
                let p_sink = (sink - lse).exp();
                if p_sink == F::zero() {
                    continue;
                }
                let delta = out
                    .row(i)
                    .iter()
                    .zip(d_out.row(i))
                    .filter(|(o, _)| **o != F::zero())
                    .fold(F::zero(), |sum, (&o, &d_o)| sum + o * d_o);
                sum = sum + p_sink * delta;
            }
        }
        *d_sink = -sum;
    }
    Ok(Some(d_sinks))
}
