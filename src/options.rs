//! [`AttentionOptions`]: which keys each query may see (causal alignment,
//! keep mask, key lengths), the scale, and an additive bias.
//!
//! This module also holds the one definition of the masking semantics that
//! every path (`core`, the fused driver, the layers) shares: see
//! [`VisibleKeys`].

use ndarray::{ArrayView1, ArrayView4, Axis};

use crate::simd::KernelSet;

/// How a causal mask lines the queries up against the keys when
/// `len_q != len_kv`.
///
/// With `len_q == len_kv` both alignments give the usual lower triangle.
///
/// ```
/// use sdpa::{AttentionOptions, CausalAlignment};
/// // 2 new queries against 5 keys: the last query sees all 5 keys.
/// let kv_cache = AttentionOptions::<f32>::new().causal(); // BottomRight
/// // PyTorch's `is_causal=True`: query i sees keys 0..=i.
/// let torch_like = AttentionOptions::<f32>::new().causal_aligned(CausalAlignment::TopLeft);
/// # let _ = (kv_cache, torch_like);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CausalAlignment {
    /// Query `i` sees keys `j ≤ i + (len_kv − len_q)`: the last query sees the
    /// last key. This is what decoding with a KV cache needs, where the
    /// queries are the newest `len_q` positions of a `len_kv`-long sequence.
    #[default]
    BottomRight,
    /// Query `i` sees keys `j ≤ i`, PyTorch's `is_causal=True`.
    TopLeft,
}

/// The options of an attention call: a by-value builder in which every option
/// composes with the others.
///
/// `AttentionOptions::new()` (or `default()`) is bidirectional attention with
/// scale `1/√d_k`.
///
/// A key `j` is visible to query `i` of batch item `b` and head `h` when all
/// of these hold:
/// - the causal rule, if any, allows it ([`CausalAlignment`]);
/// - `j < key_lengths[b]`, if key lengths were given;
/// - `keep_mask[b, h, i, j]` is `true`, if a keep mask was given.
///
/// Invisible keys get weight exactly 0 by selection, so NaN or ±inf in their
/// keys, values or bias never reach the output. A query with no visible key
/// outputs zeros.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::AttentionOptions;
///
/// let keep = Array4::from_elem((1, 1, 4, 4), true);
/// let bias = Array4::<f32>::zeros((1, 8, 4, 4));
/// let opts = AttentionOptions::new()
///     .causal()
///     .scale(0.125)
///     .keep_mask(keep.view())
///     .bias(bias.view())
///     .key_lengths(&[3]);
/// # let _ = opts;
/// ```
#[derive(Debug, Clone)]
pub struct AttentionOptions<'a, F> {
    pub(crate) causal: Option<CausalAlignment>,
    pub(crate) scale: Option<F>,
    pub(crate) keep_mask: Option<ArrayView4<'a, bool>>,
    pub(crate) bias: Option<ArrayView4<'a, F>>,
    pub(crate) key_lengths: Option<&'a [usize]>,
    pub(crate) window: Option<usize>,
    pub(crate) key_shard: Option<KeyShard>,
    pub(crate) kernel_set: Option<KernelSet>,
}

impl<F> Default for AttentionOptions<'_, F> {
    fn default() -> Self {
        Self {
            causal: None,
            scale: None,
            keep_mask: None,
            bias: None,
            key_lengths: None,
            window: None,
            key_shard: None,
            kernel_set: None,
        }
    }
}

impl<'a, F: Copy> AttentionOptions<'a, F> {
    /// Bidirectional attention with scale `1/√d_k` and no mask or bias.
    pub fn new() -> Self {
        Self::default()
    }

    /// Causal attention, bottom-right aligned: query `i` sees keys
    /// `j ≤ i + (len_kv − len_q)`. Same as top-left when `len_q == len_kv`.
    pub fn causal(self) -> Self {
        self.causal_aligned(CausalAlignment::BottomRight)
    }

    /// Causal attention with the given alignment.
    pub fn causal_aligned(mut self, alignment: CausalAlignment) -> Self {
        // A window set earlier keeps working with the new alignment.
        self.causal = Some(alignment);
        self
    }

    /// Multiplies the scores `Q·Kᵀ` by `scale` instead of `1/√d_k`.
    /// It must be finite; the call returns an error otherwise.
    pub fn scale(mut self, scale: F) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Only keys whose entry is `true` may be attended to. The shape is
    /// `[batch, heads, len_q, len_kv]`, where any dimension may be 1 to
    /// broadcast (so `[batch, 1, 1, len_kv]` is a key-padding mask).
    pub fn keep_mask(mut self, keep_mask: ArrayView4<'a, bool>) -> Self {
        self.keep_mask = Some(keep_mask);
        self
    }

    /// Adds `bias` to the scaled scores before the softmax (ALiBi, relative
    /// positions). Shape `[batch, heads, len_q, len_kv]`, broadcasting like
    /// the keep mask. A `-inf` bias gives a visible key weight 0.
    pub fn bias(mut self, bias: ArrayView4<'a, F>) -> Self {
        self.bias = Some(bias);
        self
    }

    /// For each batch item `b`, keys at index `≥ key_lengths[b]` are padding
    /// and invisible. One length per batch item, each `≤ len_kv`.
    pub fn key_lengths(mut self, key_lengths: &'a [usize]) -> Self {
        self.key_lengths = Some(key_lengths);
        self
    }

    /// Sliding-window attention: each query sees at most the `window` most
    /// recent keys up to its causal position, i.e. keys `j` with
    /// `p − window < j ≤ p` where `p` is the query's diagonal position.
    /// Implies causal attention, bottom-right aligned unless
    /// [`causal_aligned`](Self::causal_aligned) says otherwise. `window`
    /// must be at least 1; the call returns an error otherwise.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::AttentionOptions;
    ///
    /// let x = Array4::<f64>::ones((1, 1, 5, 2));
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().window(2))?;
    /// // Query 4 sees keys 3 and 4 only.
    /// assert_eq!(w.slice(ndarray::s![0, 0, 4, ..]).to_vec(), vec![0.0, 0.0, 0.0, 0.5, 0.5]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn window(mut self, window: usize) -> Self {
        self.window = Some(window);
        if self.causal.is_none() {
            self.causal = Some(CausalAlignment::BottomRight);
        }
        self
    }

    /// Declares that the keys and values passed are a shard of a longer
    /// sequence: keys `offset .. offset + len_kv` of `total_len_kv`. Causal
    /// alignment, window, key lengths, keep mask and bias then refer to
    /// positions in the whole sequence (the mask and bias have
    /// `total_len_kv` columns, or 1). With
    /// [`scaled_dot_product_attention_partial`](crate::scaled_dot_product_attention_partial),
    /// this computes one shard's part of a call split across threads,
    /// processes or machines. The call returns an error if the shard does
    /// not fit in `total_len_kv`.
    pub fn key_shard(mut self, offset: usize, total_len_kv: usize) -> Self {
        self.key_shard = Some(KeyShard {
            offset,
            total_len_kv,
        });
        self
    }

    /// Runs `f32` calls on this kernel set instead of the one chosen at run
    /// time (see [`crate::simd`]); for tests and benchmarks. The call
    /// returns an error if this CPU cannot run it. `f64` calls always run
    /// [`crate::core`] and ignore it.
    pub fn kernel_set(mut self, set: KernelSet) -> Self {
        self.kernel_set = Some(set);
        self
    }
}

/// Where the keys of a call sit in the whole key sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyShard {
    /// Index in the whole sequence of the call's first key.
    pub offset: usize,
    /// Keys in the whole sequence.
    pub total_len_kv: usize,
}

/// The keys one query row may see: a contiguous range `[start, end)` from
/// the causal rule, the window and the key lengths, then, inside it, the
/// keep-mask row.
///
/// Every path asks this type, so the masking semantics live in one place.
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

impl<'a, F: Copy> AttentionOptions<'a, F> {
    /// Index in the whole key sequence of the call's key 0 (see
    /// [`key_shard`](Self::key_shard)).
    pub(crate) fn key_offset(&self) -> usize {
        self.key_shard.map_or(0, |shard| shard.offset)
    }

    /// The contiguous visible key range `[start, end)` for query `i` of
    /// batch item `b`, from the causal rule, the window and the key lengths,
    /// in the call's own key indices (`len_kv` of them).
    pub(crate) fn visible_range(
        &self,
        b: usize,
        i: usize,
        len_q: usize,
        len_kv: usize,
    ) -> std::ops::Range<usize> {
        let (offset, len_kv_local) = (self.key_offset(), len_kv);
        let len_kv = self.key_shard.map_or(len_kv, |shard| shard.total_len_kv);
        // One past the last key the query may see under the causal rule
        // (its diagonal), before clamping to the keys there are.
        let diagonal_end = match self.causal {
            None => len_kv,
            Some(CausalAlignment::TopLeft) => i + 1,
            // j ≤ i + len_kv − len_q, i.e. j < i + 1 + len_kv − len_q, clamped at 0.
            Some(CausalAlignment::BottomRight) => (i + 1 + len_kv).saturating_sub(len_q),
        };
        let start = match self.window {
            Some(window) => diagonal_end.saturating_sub(window),
            None => 0,
        };
        let key_length = self.key_lengths.map_or(len_kv, |lengths| lengths[b]);
        let end = diagonal_end.min(len_kv).min(key_length);
        // From the whole sequence's indices to the call's own.
        let local = |j: usize| j.saturating_sub(offset).min(len_kv_local);
        let (start, end) = (local(start.min(end)), local(end));
        start..end
    }

    /// The keys visible to query `i` of batch item `b`, head `h`.
    /// Only valid after the options were checked against the shapes.
    pub(crate) fn visible_keys(
        &self,
        b: usize,
        h: usize,
        i: usize,
        len_q: usize,
        len_kv: usize,
    ) -> VisibleKeys<'_> {
        let range = self.visible_range(b, i, len_q, len_kv);
        VisibleKeys {
            start: range.start,
            end: range.end,
            key_offset: self.key_offset(),
            keep: self
                .keep_mask
                .as_ref()
                .map(|mask| broadcast_row(mask, b, h, i)),
        }
    }
}
