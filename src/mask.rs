//! Which keys a query row may see, and how masks and biases broadcast: the
//! one definition of the masking semantics that every path (`core`, the
//! fused driver) asks.
//!
//! A key `j` is visible to query `i` of batch item `b` and head `h` when the
//! causal rule and window allow it, `j` is below the batch item's key
//! length, and the keep mask (if any) says `true`. The first three give a
//! contiguous range ([`Call::visible_range`]); the keep mask is checked
//! inside it ([`VisibleKeys::contains`]). A bias of `−inf` hides a key
//! too, by selection ([`biased`]).
//!
//! What a row's result is when its visible scores are not all finite:
//! - no visible key, or every visible key hidden by a `−inf` bias: zeros,
//!   log-sum-exp `−inf` (the row saw nothing);
//! - a visible score that is NaN or `+inf` (from a non-finite query, key or
//!   bias): NaN, through the softmax;
//! - a product `scale·q·k` that overflowed the type, whatever its sign:
//!   NaN ([`Call::mark_overflowed_scores`]), on every path;
//! - every visible, unhidden score `−inf` (from a non-finite input): output
//!   NaN, never the zeros of a row that saw nothing
//!   ([`Call::has_unhidden_key`] tells the two apart), and log-sum-exp
//!   `−inf`, the log of its zero sum of weights, so that a key shard of
//!   such keys merges into the others' result as nothing. With a sink the
//!   weights sum to `0 / e^(sink)`: zeros with log-sum-exp `sink_h`, what
//!   merging the sink's own partial gives (`modifiers::apply_sink`).

use std::ops::Range;

use ndarray::{ArrayView1, ArrayView4, ArrayViewMut1, Axis};
use num_traits::Float;

use crate::call::{Call, head};
use crate::options::CausalAlignment;

/// The keys one query row may see: a contiguous range `[start, end)` from
/// the causal rule, the window and the key lengths, then, inside it, the
/// keep-mask row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct VisibleKeys<'m> {
    /// Keys before `start` are outside the sliding window.
    pub start: usize,
    /// Keys at index `>= end` are invisible.
    pub end: usize,
    /// The keep-mask row for this query, of length `total_len_kv` or 1
    /// (broadcast), indexed by `key_offset + j`.
    pub keep: Option<ArrayView1<'m, bool>>,
    /// Index in the whole sequence of the call's key 0.
    pub key_offset: usize,
}

impl VisibleKeys<'_> {
    /// Whether key `j` is visible.
    #[inline]
    pub fn contains(&self, j: usize) -> bool {
        (self.start..self.end).contains(&j)
            && self
                .keep
                .as_ref()
                .is_none_or(|row| row[broadcast(row.len(), self.key_offset + j)])
    }
}

/// `score + bias`, except that a `−inf` bias hides the key whatever its
/// score (even NaN): the result is then `−inf`, which the softmax turns
/// into a weight of exactly 0.
#[inline]
pub(crate) fn biased<F: Float>(score: F, bias: F) -> F {
    if bias == F::neg_infinity() {
        bias
    } else {
        score + bias
    }
}

/// The index into a broadcast axis of length `len` (1 or the full length).
#[inline]
pub(crate) fn broadcast(len: usize, index: usize) -> usize {
    if len == 1 { 0 } else { index }
}

/// The last-axis row `[b, h, i, ..]` of a broadcastable 4-D view.
pub(crate) fn broadcast_row<'v, T>(
    view: &'v ArrayView4<'_, T>,
    b: usize,
    h: usize,
    i: usize,
) -> ArrayView1<'v, T> {
    let shape = view.shape();
    view.index_axis(Axis(0), broadcast(shape[0], b))
        .index_axis_move(Axis(0), broadcast(shape[1], h))
        .index_axis_move(Axis(0), broadcast(shape[2], i))
}

impl<F: Copy, KV, Q> Call<'_, F, KV, Q> {
    /// Index in the whole key sequence of the call's key 0 (see
    /// [`AttentionOptions::key_shard`](crate::AttentionOptions::key_shard)).
    pub(crate) fn key_offset(&self) -> usize {
        self.opts.key_shard.map_or(0, |shard| shard.offset)
    }

    /// The contiguous visible key range `[start, end)` for query `i` of
    /// batch item `b`, from the causal rule, the window and the key lengths,
    /// in the call's own key indices (`len_kv` of them).
    pub(crate) fn visible_range(&self, b: usize, i: usize) -> Range<usize> {
        let opts = &self.opts;
        let (len_q, len_kv_local, offset) =
            (self.shape.len_q, self.shape.len_kv, self.key_offset());
        let len_kv = opts
            .key_shard
            .map_or(len_kv_local, |shard| shard.total_len_kv);
        // One past the last key the query may see under the causal rule
        // (its diagonal), before clamping to the keys there are. With
        // i < len_q, neither form overflows for any len_kv.
        let diagonal_end = match opts.causal {
            None => len_kv,
            Some(CausalAlignment::TopLeft) => i + 1,
            // j ≤ i + len_kv − len_q, i.e. j < i + 1 + len_kv − len_q, clamped at 0.
            Some(CausalAlignment::BottomRight) if len_kv >= len_q => i + 1 + (len_kv - len_q),
            Some(CausalAlignment::BottomRight) => (i + 1).saturating_sub(len_q - len_kv),
        };
        let window_start = match opts.window {
            Some(window) => diagonal_end.saturating_sub(window),
            None => 0,
        };
        let start = window_start.max(opts.key_starts.map_or(0, |starts| starts[b]));
        let key_length = opts.key_lengths.map_or(len_kv, |lengths| lengths[b]);
        let end = diagonal_end.min(len_kv).min(key_length);
        // From the whole sequence's indices to the call's own.
        let local = |j: usize| j.saturating_sub(offset).min(len_kv_local);
        let (start, end) = (local(start.min(end)), local(end));
        start..end
    }

    /// The keys visible to query `i` of batch item `b`, head `h`.
    pub(crate) fn visible_keys(&self, b: usize, h: usize, i: usize) -> VisibleKeys<'_> {
        let range = self.visible_range(b, i);
        VisibleKeys {
            start: range.start,
            end: range.end,
            key_offset: self.key_offset(),
            keep: self
                .opts
                .keep_mask
                .as_ref()
                .map(|mask| broadcast_row(mask, b, h, i)),
        }
    }

    /// Whether query `i` of batch item `b`, head `h` has a visible key in
    /// `keys` that a `−inf` bias does not hide. When every visible score of
    /// such a row comes out `−inf`, a non-finite input or an overflowing
    /// product is to blame, and the row's result is NaN rather than zeros.
    pub(crate) fn has_unhidden_key(&self, b: usize, h: usize, i: usize, keys: Range<usize>) -> bool
    where
        F: Float,
    {
        let visible = self.visible_keys(b, h, i);
        let bias = self.bias_row(b, h, i);
        let offset = self.key_offset();
        (visible.start.max(keys.start)..visible.end.min(keys.end)).any(|j| {
            visible.contains(j)
                && bias
                    .as_ref()
                    .is_none_or(|bias| bias[broadcast(bias.len(), offset + j)] != F::neg_infinity())
        })
    }

    /// Marks as NaN each score of query `i` of batch item `b`, head `h`
    /// against keys `j0..j0 + scores.len()` that is not finite although
    /// its query row and key row are: the product `scale·q·k` overflowed
    /// the type. Such a sum's sign depends on the order of its terms (one
    /// that overflows towards `−inf` would silently give the key weight 0),
    /// so every path makes it NaN and the row shows it. Scores a
    /// non-finite input explains are left as they are.
    ///
    /// Called only for rows with a non-finite score: it reads the inputs.
    pub(crate) fn mark_overflowed_scores(
        &self,
        b: usize,
        h: usize,
        i: usize,
        j0: usize,
        scores: ArrayViewMut1<'_, F>,
    ) where
        F: Float,
        KV: Float,
        Q: Float,
    {
        if !head(&self.q, b, h).row(i).iter().all(|x| x.is_finite()) {
            return;
        }
        let keys = head(&self.k, b, self.shape.kv_head(h));
        for (j, score) in (j0..).zip(scores) {
            if !score.is_finite() && keys.row(j).iter().all(|x| x.is_finite()) {
                *score = F::nan();
            }
        }
    }

    /// The bias row of query `i` of batch item `b`, head `h` (indexed like a
    /// keep-mask row: by `key_offset + j`, broadcast), if there is a bias.
    pub(crate) fn bias_row(&self, b: usize, h: usize, i: usize) -> Option<ArrayView1<'_, F>> {
        self.opts
            .bias
            .as_ref()
            .map(|bias| broadcast_row(bias, b, h, i))
    }
}
