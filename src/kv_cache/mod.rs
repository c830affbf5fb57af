//! [`KvCache`]: the keys and values of sequences being decoded, kept
//! between calls so that each new token attends to every earlier one
//! without projecting them again.
//!
//! Two modes share one type:
//!
//! - **growing** ([`KvCache::new`]): every position is kept, in order, in
//!   preallocated `[batch, kv_heads, capacity, d]` buffers; when an append
//!   does not fit, the capacity at least doubles (one reallocation and copy
//!   of the filled part), so appending `n` tokens one at a time costs
//!   O(log n) reallocations, never one per token;
//! - **ring buffer** ([`KvCache::with_window`]): for sliding-window
//!   attention with window `W`, only the last `W` positions are kept, in `W`
//!   slots that never grow; position `p` overwrites the slot of `p − W`.
//!
//! Attention over the cache ([`KvCache::attend`]) is bottom-right causal:
//! the `n` new queries are the newest `n` positions. In a ring the keys are
//! rotated in memory, which attention does not mind (it is invariant under a
//! permutation of the keys), so only which keys each query may see matters:
//! one new token sees every entry held; several new tokens are attended
//! against the held entries unrolled into position order followed by the
//! new ones, with the window option giving each its own range.
//!
//! Every call that changes the cache checks and allocates first and
//! changes it last, so that on an error (a bad shape, a buffer too large to
//! address or to allocate, a failed attention) the cache is as it was: new
//! keys and values wait in slots the cache does not show (past `len`) or in
//! new buffers, and count only once the attention over them has succeeded.
//! The one exception is a full ring's single new token, which must take
//! the oldest entry's slot before attention (its query must not see that
//! entry); the entry is copied aside first and put back on an error.
//!
//! Decoding takes options ([`KvCache::attend_with`], [`KvCache::prefill`]):
//! the score modifiers, a window, and on a growing cache a bias or keep
//! mask. Sequences of different lengths share the cache through a padded
//! prompt, stored left-padded so that they end together; the cache keeps
//! each one's start.
//!
//! This file holds the type and its public API; `attend` the staging of
//! new entries around an attention; `attended` what a step's queries
//! attend over (one or two runs of keys in position order) and which
//! options decoding takes; `padding` the move of a right-padded prompt to
//! the left; `ring` the ring's slot arithmetic, unrolling and truncation;
//! `check` the checks of every argument and the sizes of the buffers. They
//! only store and copy; the attention is
//! [`crate::scaled_dot_product_attention_into`] (or its partials, merged),
//! run by `Attended::attend_into` (the cache's own `attend_with`) or
//! `attend_compute_into` (`attend_compute*`, a layer's step and prefill)
//! for whoever called `attend_next_with` or `restart_with`.

mod attend;
mod attended;
mod buffer;
mod check;
mod padding;
mod ring;

pub(crate) use attended::Attended;
pub(crate) use padding::RightPadding;

use ndarray::{Array4, ArrayView4, ArrayViewMut4, Axis, s};

use crate::element::Storage;
use crate::error::{AttentionError, ErrorKind};
use crate::options::AttentionOptions;
use attended::{DecodeCall, check_decode_options};
use buffer::Buffer;
use check::{KEYS, VALUES, check_dims, zeroed_buffer};

/// The keys and values of `batch` sequences being decoded, for incremental
/// (token by token) attention: `[batch, kv_heads, len, d_k]` keys and
/// `[batch, kv_heads, len, d_v]` values.
///
/// A growing cache ([`new`](Self::new)) keeps every position; its capacity
/// at least doubles whenever an append would overflow it, so appends never
/// reallocate per token. A ring-buffer cache
/// ([`with_window`](Self::with_window)) keeps the last `W` positions in a
/// fixed `W` slots, for sliding-window attention; it never reallocates.
///
/// [`attend`](Self::attend) appends the newest keys and values and computes
/// attention of their queries over everything cached: the decoding step of
/// a model that runs its own projections (say, with rotary embeddings
/// applied to `q` and `k`). The layer methods
/// [`CausalAttention::prefill`](crate::CausalAttention::prefill) and
/// [`step`](crate::CausalAttention::step) do the projections too.
///
/// **Half precision** (feature `half`): `KvCache<half::bf16>` and
/// `KvCache<half::f16>` store the keys and values in that type, half the
/// memory of an `f32` cache. Softmax and accumulation are in `f32`, and the
/// options are `AttentionOptions<f32>` (as for the functional API's half
/// calls). [`append`](Self::append), [`attend`](Self::attend) and
/// [`prefill`](Self::prefill) take `q`, `k`, `v` and return the output in
/// the cache's type; [`append_compute`](Self::append_compute) and
/// [`attend_compute_with`](Self::attend_compute_with) take `f32`
/// projections (rounded to the cache's type on write, to nearest-even) and
/// return `f32`. A decoding step reads the cache in its own type, half the
/// bytes of an `f32` cache's step: each 64-key tile is widened to `f32`
/// into a scratch tile the `f32` kernels read (the cache is never widened
/// whole), when the head dims are whole vectors of the kernel set (a
/// multiple of 16 covers them all); other shapes, and prompts of more than
/// 8 queries, take the `f32` path's prefill, which widens the keys and
/// values as it packs them, a key tile at a time (or, for a bf16 cache
/// whose queries are all bf16 values, packs them as bf16 pairs for the
/// native kernels; `f32` projections are never rounded to bf16).
///
/// The cache holds `batch` sequences decoded in lockstep: every step
/// appends the same number of positions to each. Sequences of different
/// lengths start from a padded prompt (see [`prefill`](Self::prefill)).
///
/// ```
/// use ndarray::{s, Array4};
/// use sdpa::{scaled_dot_product_attention, AttentionOptions, KvCache};
///
/// // 1 sequence, 4 query heads sharing 2 key/value heads, d = 8.
/// let (q, k, v) = (
///     Array4::<f32>::from_shape_fn((1, 4, 10, 8), |(_, h, i, d)| ((h + i * d) % 5) as f32 * 0.2),
///     Array4::<f32>::from_shape_fn((1, 2, 10, 8), |(_, h, i, d)| ((h * i + d) % 7) as f32 * 0.1),
///     Array4::<f32>::from_shape_fn((1, 2, 10, 8), |(_, h, i, d)| (h + i + d) as f32 * 0.05),
/// );
/// let mut cache = KvCache::<f32>::new(1, 2, 8, 8, 16)?;
/// // A 6-token prompt, then one token at a time.
/// let mut rows = vec![cache.attend(q.slice(s![.., .., ..6, ..]), k.slice(s![.., .., ..6, ..]), v.slice(s![.., .., ..6, ..]))?];
/// for t in 6..10 {
///     let new = s![.., .., t..t + 1, ..];
///     rows.push(cache.attend(q.slice(new), k.slice(new), v.slice(new))?);
/// }
/// assert_eq!((cache.len(), cache.capacity()), (10, 16));
///
/// // The same as causal attention over the whole sequence at once.
/// let full = scaled_dot_product_attention(q.view(), k.view(), v.view(), &AttentionOptions::new().causal())?;
/// let last = rows.last().unwrap();
/// for (a, b) in last.iter().zip(full.slice(s![.., .., 9..10, ..]).iter()) {
///     assert!((a - b).abs() < 1e-5);
/// }
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
// No `PartialEq`: slots past `len` hold stale entries, so equal caches
// could compare unequal. `Clone` and `Debug` are written out below: the
// buffers have them only for the crate's element types.
pub struct KvCache<F> {
    /// `[batch, kv_heads, capacity, d_k]`; slots `0..len` are filled.
    keys: Buffer<F>,
    /// `[batch, kv_heads, capacity, d_v]`; slots `0..len` are filled.
    values: Buffer<F>,
    /// Entries held.
    len: usize,
    /// Positions appended since the cache was created or cleared (less any
    /// truncated): the position the next token will have.
    total_len: usize,
    /// The ring's size `W`, or `None` for a growing cache.
    window: Option<usize>,
    /// In a ring, the slot of the oldest entry held. Whenever the ring is
    /// not full it is 0, so the entries held are always slots `0..len`.
    oldest_slot: usize,
    /// Each sequence's first real position, when a padded prompt made
    /// some start later than others (left padding); `None` when every
    /// sequence starts at position 0.
    key_starts: Option<Vec<usize>>,
}

impl<F: Storage> Clone for KvCache<F> {
    fn clone(&self) -> Self {
        Self {
            keys: self.keys.clone(),
            values: self.values.clone(),
            key_starts: self.key_starts.clone(),
            ..*self
        }
    }
}

impl<F: Storage> std::fmt::Debug for KvCache<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("keys", &self.keys)
            .field("values", &self.values)
            .field("len", &self.len)
            .field("total_len", &self.total_len)
            .field("window", &self.window)
            .field("oldest_slot", &self.oldest_slot)
            .field("key_starts", &self.key_starts)
            .finish()
    }
}

impl<F: Storage> KvCache<F> {
    /// An empty growing cache for `batch` sequences of `kv_heads` key/value
    /// heads, keys `d_k` wide and values `d_v` wide, with room for
    /// `capacity` positions before it first grows (0 is allowed).
    ///
    /// Growth: an append that does not fit makes the capacity
    /// `max(2·capacity, len + new)` and copies the filled part once.
    ///
    /// # Errors
    /// [`ErrorKind::ZeroDimension`] when `kv_heads`, `d_k` or `d_v` is zero;
    /// [`ErrorKind::TooLarge`] when the buffers
    /// `[batch, kv_heads, capacity, d]` would be too large to address, and
    /// [`ErrorKind::OutOfMemory`] when they cannot be allocated.
    ///
    /// ```
    /// use sdpa::{ErrorKind, KvCache};
    ///
    /// let cache = KvCache::<f32>::new(2, 8, 64, 64, 1024)?;
    /// assert_eq!((cache.len(), cache.capacity(), cache.window()), (0, 1024, None));
    ///
    /// let err = KvCache::<f32>::new(1, 1, 64, 64, usize::MAX).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::TooLarge);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn new(
        batch: usize,
        kv_heads: usize,
        d_k: usize,
        d_v: usize,
        capacity: usize,
    ) -> Result<Self, AttentionError> {
        check_dims(kv_heads, d_k, d_v)?;
        Self::allocate(batch, kv_heads, d_k, d_v, capacity, None)
    }

    /// An empty ring-buffer cache for sliding-window attention: each query
    /// sees at most the `window` most recent positions (itself included),
    /// so the cache keeps the last `window` positions in `window` slots and
    /// never grows. [`attend`](Self::attend) on it equals the functional
    /// API with [`AttentionOptions::window`](crate::AttentionOptions::window) over the whole sequence.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidOption`] when `window` is 0;
    /// [`ErrorKind::ZeroDimension`] when `kv_heads`, `d_k` or `d_v` is zero;
    /// [`ErrorKind::TooLarge`] or [`ErrorKind::OutOfMemory`] when the
    /// `window` slots cannot be addressed or allocated.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::KvCache;
    ///
    /// let mut cache = KvCache::<f64>::with_window(3, 1, 1, 2, 2)?;
    /// let x = Array4::<f64>::ones((1, 1, 1, 2));
    /// for _ in 0..5 {
    ///     cache.attend(x.view(), x.view(), x.view())?;
    /// }
    /// // Five positions seen, the last three held, in three slots.
    /// assert_eq!((cache.total_len(), cache.len(), cache.capacity()), (5, 3, 3));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn with_window(
        window: usize,
        batch: usize,
        kv_heads: usize,
        d_k: usize,
        d_v: usize,
    ) -> Result<Self, AttentionError> {
        if window == 0 {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                "window must be at least 1 key, got 0",
            ));
        }
        check_dims(kv_heads, d_k, d_v)?;
        Self::allocate(batch, kv_heads, d_k, d_v, window, Some(window))
    }

    /// An empty cache of checked, positive dimensions.
    fn allocate(
        batch: usize,
        kv_heads: usize,
        d_k: usize,
        d_v: usize,
        capacity: usize,
        window: Option<usize>,
    ) -> Result<Self, AttentionError> {
        Ok(Self {
            keys: Buffer::zeroed(KEYS, [batch, kv_heads, capacity, d_k])?,
            values: Buffer::zeroed(VALUES, [batch, kv_heads, capacity, d_v])?,
            len: 0,
            total_len: 0,
            window,
            oldest_slot: 0,
            key_starts: None,
        })
    }

    /// The number of entries held: `total_len()` for a growing cache, at
    /// most the window for a ring.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the cache holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The number of positions appended since the cache was created or
    /// cleared (less any truncated): the position the next token will have.
    /// Equal to [`len`](Self::len) unless a ring has dropped old entries.
    pub fn total_len(&self) -> usize {
        self.total_len
    }

    /// The number of entries the buffers have room for before a growing
    /// cache must grow; a ring's window.
    pub fn capacity(&self) -> usize {
        self.keys.len_of(Axis(2))
    }

    /// The window of a ring-buffer cache, `None` for a growing cache.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The number of sequences.
    pub fn batch(&self) -> usize {
        self.keys.len_of(Axis(0))
    }

    /// The number of key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.keys.len_of(Axis(1))
    }

    /// The width of each key.
    pub fn d_k(&self) -> usize {
        self.keys.len_of(Axis(3))
    }

    /// The width of each value.
    pub fn d_v(&self) -> usize {
        self.values.len_of(Axis(3))
    }

    /// The keys held, `[batch, kv_heads, len, d_k]`: a view of the filled
    /// part of the buffer. In a growing cache, entry `j` is position `j`.
    /// In a full ring the entries are rotated: position `p` is in slot
    /// `p mod window`.
    pub fn keys(&self) -> ArrayView4<'_, F> {
        self.keys.slice(s![.., .., ..self.len, ..])
    }

    /// The values held, `[batch, kv_heads, len, d_v]`, in the same order as
    /// [`keys`](Self::keys).
    pub fn values(&self) -> ArrayView4<'_, F> {
        self.values.slice(s![.., .., ..self.len, ..])
    }

    /// Empties the cache for a new sequence, keeping its buffers.
    pub fn clear(&mut self) {
        self.len = 0;
        self.total_len = 0;
        self.oldest_slot = 0;
        self.key_starts = None;
    }

    /// Each sequence's first real position, when the prompt given to
    /// [`prefill`](Self::prefill) was padded (on either side: a
    /// right-padded prompt is stored left-padded, so that the sequences end
    /// together); `None` when every sequence starts at position 0. Keys
    /// before a sequence's start are never attended.
    pub fn key_starts(&self) -> Option<&[usize]> {
        self.key_starts.as_deref()
    }

    /// Drops the newest positions so that `total_len` positions remain
    /// (rolling back rejected tokens, say); nothing happens if `total_len`
    /// is not below [`total_len()`](Self::total_len). The buffers are kept.
    /// A sequence cut back into its padding (see [`prefill`](Self::prefill))
    /// starts again at the next position.
    ///
    /// A ring can only go back as far as it still holds what the next
    /// query needs: the `window − 1` positions before it. Once the ring has
    /// overwritten anything, that is one position back.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidOption`] when a ring would have to bring back
    /// positions it has overwritten; [`ErrorKind::OutOfMemory`] when a ring
    /// cannot allocate the copy it rewrites its entries into. The cache is
    /// unchanged then.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::KvCache;
    ///
    /// let mut cache = KvCache::<f32>::new(1, 1, 4, 4, 8)?;
    /// let x = Array4::<f32>::ones((1, 1, 5, 4));
    /// cache.append(x.view(), x.view())?;
    /// cache.truncate(3)?;
    /// assert_eq!((cache.len(), cache.total_len()), (3, 3));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn truncate(&mut self, total_len: usize) -> Result<(), AttentionError> {
        if total_len >= self.total_len {
            return Ok(());
        }
        match self.window {
            None => {
                self.len = total_len;
                self.total_len = total_len;
            }
            Some(window) => self.truncate_ring(total_len, window)?,
        }
        // A sequence cut back into its padding starts again with the next
        // position.
        if let Some(starts) = &mut self.key_starts {
            starts
                .iter_mut()
                .for_each(|start| *start = (*start).min(total_len));
        }
        Ok(())
    }

    /// Appends the keys `k` `[batch, kv_heads, n, d_k]` and values `v`
    /// `[batch, kv_heads, n, d_v]` of the next `n` positions. A growing
    /// cache grows if they do not fit (see [`new`](Self::new)); a ring
    /// keeps the last `window` positions.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`] when `k` or `v` does not match the
    /// cache's batch, heads and widths, or they disagree on `n`;
    /// [`ErrorKind::TooLarge`] when the grown buffers would be too large to
    /// address (or the count of positions would overflow), and
    /// [`ErrorKind::OutOfMemory`] when they cannot be allocated. The cache
    /// is unchanged on error.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::{ErrorKind, KvCache};
    ///
    /// let mut cache = KvCache::<f32>::new(1, 1, 4, 4, 8)?;
    /// let x = Array4::<f32>::ones((1, 1, 3, 4));
    /// cache.append(x.view(), x.view())?;
    /// // 2^60 more positions (a broadcast view of one) cannot be addressed.
    /// let one = Array4::<f32>::ones((1, 1, 1, 4));
    /// let many = one.broadcast((1, 1, 1 << 60, 4)).unwrap();
    /// let err = cache.append(many, many).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::TooLarge);
    /// assert_eq!((cache.len(), cache.capacity()), (3, 8));
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn append(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
    ) -> Result<(), AttentionError> {
        self.check_new(&k, &v)?;
        let total_len = self.total_after(k.len_of(Axis(2)))?;
        match self.window {
            None => self.attend_growing(k, v, &AttentionOptions::new(), |_| Ok(()))?,
            Some(window) => self.push_into_ring(k, v, window),
        }
        self.total_len = total_len;
        Ok(())
    }

    /// One decoding step at the level of the functional API: appends the
    /// keys `k` `[batch, kv_heads, n, d_k]` and values `v`
    /// `[batch, kv_heads, n, d_v]` of the next `n` positions, then returns
    /// the attention of their queries `q` `[batch, heads, n, d_k]` over
    /// everything cached, `[batch, heads, n, d_v]`.
    ///
    /// Causal, bottom-right aligned: query `i` is position
    /// `total_len + i` and sees every cached position up to itself (only
    /// the last `window` of them, in a ring). So a prompt attended at once
    /// and then one token at a time gives what
    /// [`crate::scaled_dot_product_attention`] with `.causal()` (or
    /// `.window(W)`) gives over the whole sequence. `heads` must be a
    /// multiple of `kv_heads` (grouped-query attention); the scale is
    /// `1/√d_k`. `n = 0` is valid and changes nothing.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`] when `q`, `k` or `v` does not match the
    /// cache or each other (batch, `n`, `d_k`, `kv_heads`);
    /// [`ErrorKind::ZeroDimension`] when `heads` is 0;
    /// [`ErrorKind::HeadsNotDivisible`] when `heads` is not a multiple of
    /// `kv_heads`; [`ErrorKind::TooLarge`] or [`ErrorKind::OutOfMemory`]
    /// when the output, the grown buffers (or, in a ring, the held and
    /// new entries in position order) cannot be addressed or allocated.
    /// The cache is unchanged on error.
    pub fn attend(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
    ) -> Result<Array4<F>, AttentionError> {
        self.attend_with(q, k, v, &AttentionOptions::new())
    }

    /// [`attend`](Self::attend) writing into `out`
    /// `[batch, heads, n, d_v]` (any strides); allocates no output.
    ///
    /// # Errors
    /// As [`attend`](Self::attend), and when `out` does not have the
    /// output's shape. The cache is unchanged on error; `out` may have been
    /// written.
    pub fn attend_into(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        out: ArrayViewMut4<'_, F>,
    ) -> Result<(), AttentionError> {
        self.attend_into_with(q, k, v, &AttentionOptions::new(), out)
    }

    /// [`attend`](Self::attend) with options: what
    /// [`crate::scaled_dot_product_attention`] with `opts` gives over the
    /// whole sequence, for the newest `n` rows. Decoding takes
    /// - [`scale`](AttentionOptions::scale), [`alibi`](AttentionOptions::alibi),
    ///   [`sinks`](AttentionOptions::sinks), [`softcap`](AttentionOptions::softcap):
    ///   as in a forward; ALiBi's distances are the positions' (also in a
    ///   ring, whose rotated keys are then attended in position order);
    /// - [`window`](AttentionOptions::window): a sliding window on a
    ///   growing cache (a ring keeps to the narrower of its own and this);
    /// - [`bias`](AttentionOptions::bias) and
    ///   [`keep_mask`](AttentionOptions::keep_mask), growing cache only:
    ///   `[.., n, total_len + n]` after broadcasting, column `j` for
    ///   position `j` (the rows of a whole-sequence bias for the new
    ///   positions);
    /// - [`causal`](AttentionOptions::causal), which changes nothing:
    ///   decoding is bottom-right causal.
    ///
    /// Each sequence's padding, if its prompt was padded, is the cache's
    /// (see [`prefill`](Self::prefill)).
    ///
    /// # Errors
    /// As [`attend`](Self::attend);
    /// [`ErrorKind::InvalidOption`] for `causal_aligned(TopLeft)`,
    /// `key_shard`, `key_lengths` or `key_starts` (padding is given to
    /// [`prefill`](Self::prefill)), a bias or keep mask on a ring, and
    /// every error the options give in a forward (a slope per head, a
    /// bias that does not broadcast). The cache is unchanged on error.
    ///
    /// ```
    /// use ndarray::{s, Array4};
    /// use sdpa::{alibi_slopes, scaled_dot_product_attention, AttentionOptions, KvCache};
    ///
    /// let x = Array4::<f32>::from_shape_fn((1, 2, 9, 8), |(_, h, i, d)| ((h + 2 * i + d) % 7) as f32 * 0.1);
    /// let slopes: Vec<f32> = alibi_slopes(2).iter().map(|&s| s as f32).collect();
    /// let opts = AttentionOptions::new().alibi(&slopes).softcap(5.0);
    ///
    /// // A ring of 4: ALiBi's distances follow the positions, not the slots.
    /// let mut cache = KvCache::<f32>::with_window(4, 1, 2, 8, 8)?;
    /// let mut last = cache.prefill(x.slice(s![.., .., ..3, ..]), x.slice(s![.., .., ..3, ..]), x.slice(s![.., .., ..3, ..]), &opts)?;
    /// for t in 3..9 {
    ///     let new = s![.., .., t..t + 1, ..];
    ///     last = cache.attend_with(x.slice(new), x.slice(new), x.slice(new), &opts)?;
    /// }
    /// let full = scaled_dot_product_attention(x.view(), x.view(), x.view(), &opts.window(4))?;
    /// for (a, b) in last.iter().zip(full.slice(s![.., .., 8.., ..])) {
    ///     assert!((a - b).abs() < 1e-5);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn attend_with(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
    ) -> Result<Array4<F>, AttentionError> {
        let mut out = self.output_for(&q, &k, &v)?;
        self.attend_into_prechecked(q, k, v, opts, out.view_mut())?;
        Ok(out)
    }

    /// [`attend_with`](Self::attend_with) writing into `out`
    /// `[batch, heads, n, d_v]` (any strides); allocates no output.
    ///
    /// # Errors
    /// As [`attend_with`](Self::attend_with), and when `out` does not have
    /// the output's shape. The cache is unchanged on error; `out` may have
    /// been written.
    pub fn attend_into_with(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
        out: ArrayViewMut4<'_, F>,
    ) -> Result<(), AttentionError> {
        self.check_new(&k, &v)?;
        self.check_queries(&q, &k, out.shape())?;
        self.attend_into_prechecked(q, k, v, opts, out)
    }

    /// [`append`](Self::append) from keys and values in the compute type:
    /// `f32` projections into a `bf16` or `f16` cache, each element rounded
    /// to the cache's type on the way in (to nearest, ties to even, as
    /// `half`'s `from_f32`; NaN stays NaN). For an `f32` or `f64` cache this
    /// is `append`.
    ///
    /// # Errors
    /// As [`append`](Self::append), and [`ErrorKind::TooLarge`] or
    /// [`ErrorKind::OutOfMemory`] when the rounded copy of `k` or `v`
    /// cannot be addressed or allocated. The cache is unchanged on error.
    ///
    /// ```
    /// # #[cfg(feature = "half")] {
    /// use half::bf16;
    /// use ndarray::Array4;
    /// use sdpa::KvCache;
    ///
    /// let mut cache = KvCache::<bf16>::new(1, 1, 4, 4, 8)?;
    /// let x = Array4::<f32>::from_elem((1, 1, 2, 4), 1.0 + 1.0 / 1024.0);
    /// cache.append_compute(x.view(), x.view())?;
    /// // 1 + 2⁻¹⁰ is not a bf16 (8 bits of mantissa): it is stored as 1.
    /// assert!(cache.keys().iter().all(|&k| k == bf16::ONE));
    /// # }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn append_compute(
        &mut self,
        k: ArrayView4<'_, F::Compute>,
        v: ArrayView4<'_, F::Compute>,
    ) -> Result<(), AttentionError> {
        self.check_new_shapes(k.shape(), v.shape())?;
        let (k, v) = (F::compute_to_storage(k)?, F::compute_to_storage(v)?);
        self.append(k.view(), v.view())
    }

    /// [`attend`](Self::attend) with `q`, `k`, `v` and the output in the
    /// compute type: the decoding step of a model that computes in `f32`
    /// and keeps its cache in `bf16` or `f16` (half the memory, and half
    /// the bytes each step reads). `k` and `v` are rounded to the cache's
    /// type as in [`append_compute`](Self::append_compute) before anything
    /// attends to them, so the new queries see the keys and values as the
    /// cache holds them, as later steps will; `q` is not rounded, and the
    /// output is not rounded either. Softmax and accumulation are in `f32`
    /// whatever the storage. For an `f32` or `f64` cache this is `attend`.
    ///
    /// # Errors
    /// As [`attend`](Self::attend) and
    /// [`append_compute`](Self::append_compute). The cache is unchanged on
    /// error.
    pub fn attend_compute(
        &mut self,
        q: ArrayView4<'_, F::Compute>,
        k: ArrayView4<'_, F::Compute>,
        v: ArrayView4<'_, F::Compute>,
    ) -> Result<Array4<F::Compute>, AttentionError> {
        self.attend_compute_with(q, k, v, &AttentionOptions::new())
    }

    /// [`attend_compute`](Self::attend_compute) with options, as
    /// [`attend_with`](Self::attend_with) takes them.
    ///
    /// # Errors
    /// As [`attend_with`](Self::attend_with) and
    /// [`append_compute`](Self::append_compute). The cache is unchanged on
    /// error.
    ///
    /// ```
    /// # #[cfg(feature = "half")] {
    /// use half::f16;
    /// use ndarray::Array4;
    /// use sdpa::{AttentionOptions, KvCache};
    ///
    /// // An f32 model with an f16 cache: 4 query heads over 2 key/value heads.
    /// let mut cache = KvCache::<f16>::new(1, 2, 16, 16, 64)?;
    /// let q = Array4::<f32>::from_shape_fn((1, 4, 1, 16), |(_, h, _, d)| (h + d) as f32 * 0.1);
    /// let kv = Array4::<f32>::from_shape_fn((1, 2, 1, 16), |(_, h, _, d)| (h * d) as f32 * 0.01);
    /// let opts = AttentionOptions::new().softcap(30.0);
    /// let out: Array4<f32> = cache.attend_compute_with(q.view(), kv.view(), kv.view(), &opts)?;
    /// assert_eq!((out.dim(), cache.len()), ((1, 4, 1, 16), 1));
    /// # }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn attend_compute_with(
        &mut self,
        q: ArrayView4<'_, F::Compute>,
        k: ArrayView4<'_, F::Compute>,
        v: ArrayView4<'_, F::Compute>,
        opts: &AttentionOptions<'_, F::Compute>,
    ) -> Result<Array4<F::Compute>, AttentionError> {
        self.check_new_shapes(k.shape(), v.shape())?;
        let (batch, heads, n, _) = q.dim();
        let shape = [batch, heads, n, self.d_v()];
        self.check_query_shapes(q.shape(), k.shape(), &shape)?;
        let (k, v) = (F::compute_to_storage(k)?, F::compute_to_storage(v)?);
        let mut out = zeroed_buffer("the output [batch, heads, n, d_v]", shape)?;
        self.attend_next_with(k.view(), v.view(), opts, |attended| {
            attended.attend_compute_into(q, out.view_mut())
        })?;
        Ok(out)
    }

    /// Starts new sequences: clears the cache, then attends the prompt's
    /// queries `q` `[batch, heads, n, d_k]` causally over its keys `k` and
    /// values `v` (within the window, in a ring), with `opts` as in
    /// [`attend_with`](Self::attend_with), and keeps the keys and values.
    /// Returns `[batch, heads, n, d_v]`.
    ///
    /// Sequences of different lengths go in one padded prompt, with their
    /// padding in `opts`:
    /// - **left-padded** (as Hugging Face pads for batched generation):
    ///   [`key_starts`](AttentionOptions::key_starts), sequence `b`'s tokens at
    ///   `key_starts[b]..n`;
    /// - **right-padded**: [`key_lengths`](AttentionOptions::key_lengths),
    ///   sequence `b`'s tokens at `0..key_lengths[b]`. The cache stores them
    ///   left-padded (moved to the end of the prompt) so that every
    ///   sequence's next token is position `n`; the result is returned in
    ///   the prompt's own layout.
    ///
    /// Every later step then appends one position to each sequence, and no
    /// query ever sees another sequence's padding. Rows of padding see no
    /// key and output zeros. Moving a sequence shifts all its positions alike, so what
    /// depends on distances (the causal rule, ALiBi, rotary embeddings
    /// applied at the positions' differences) is unchanged.
    ///
    /// # Errors
    /// As [`attend_with`](Self::attend_with), but padding is allowed here:
    /// [`ErrorKind::KeyLengths`] for a length or start past `n` or not one
    /// per sequence; [`ErrorKind::InvalidOption`] for both paddings at once,
    /// or a right padding with a bias or keep mask (whose columns would
    /// move). The cache is unchanged on error.
    ///
    /// ```
    /// use ndarray::{s, Array4};
    /// use sdpa::{scaled_dot_product_attention, AttentionOptions, KvCache};
    ///
    /// // Sequence 0 has 5 tokens, sequence 1 has 3, right-padded to 5.
    /// let x = Array4::<f32>::from_shape_fn((2, 1, 7, 4), |(b, _, i, d)| ((3 * b + i + d) % 5) as f32 * 0.2);
    /// let mut cache = KvCache::<f32>::new(2, 1, 4, 4, 8)?;
    /// let prompt = x.slice(s![.., .., ..5, ..]);
    /// cache.prefill(prompt, prompt, prompt, &AttentionOptions::new().key_lengths(&[5, 3]))?;
    /// assert_eq!(cache.key_starts(), Some(&[0, 2][..]));
    ///
    /// // Sequence 1's next token attends to its own 3 tokens and itself.
    /// let (q_new, kv_new) = (x.slice(s![.., .., 5..6, ..]), x.slice(s![.., .., 6..7, ..]));
    /// let step = cache.attend(q_new, kv_new, kv_new)?;
    /// let mut alone = x.slice(s![1..2, .., ..4, ..]).to_owned();
    /// alone.slice_mut(s![.., .., 3, ..]).assign(&x.slice(s![1..2, .., 6, ..]));
    /// let mut q_alone = alone.clone();
    /// q_alone.slice_mut(s![.., .., 3, ..]).assign(&x.slice(s![1..2, .., 5, ..]));
    /// let expected = scaled_dot_product_attention(q_alone.view(), alone.view(), alone.view(), &AttentionOptions::new().causal())?;
    /// for (a, b) in step.slice(s![1, 0, 0, ..]).iter().zip(expected.slice(s![0, 0, 3, ..])) {
    ///     assert!((a - b).abs() < 1e-6);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn prefill(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
    ) -> Result<Array4<F>, AttentionError> {
        let mut out = self.output_for(&q, &k, &v)?;
        check_decode_options(opts, self.window.is_some(), DecodeCall::Prefill)?;
        let Some(lengths) = opts.key_lengths else {
            self.restart_with(k, v, opts, |attended| {
                attended.attend_into(q, out.view_mut())
            })?;
            return Ok(out);
        };
        let (batch, _, n, _) = k.dim();
        let padding = RightPadding::new(lengths, batch, n)?;
        let q_left = padding.to_left("the left-padded queries", q, Axis(2))?;
        let k_left = padding.to_left("the left-padded keys", k, Axis(2))?;
        let v_left = padding.to_left("the left-padded values", v, Axis(2))?;
        let mut left_opts = opts.reborrow();
        left_opts.key_lengths = None;
        left_opts.key_starts = Some(padding.starts());
        let mut out_left = zeroed_buffer("the left-padded output", out.dim().into())?;
        self.restart_with(k_left.view(), v_left.view(), &left_opts, |attended| {
            attended.attend_into(q_left.view(), out_left.view_mut())
        })?;
        padding.to_right(out_left.view(), Axis(2), out.view_mut());
        Ok(out)
    }

    /// The checked shapes of a step's `q`, `k`, `v`, and a buffer for its
    /// output.
    fn output_for(
        &self,
        q: &ArrayView4<'_, F>,
        k: &ArrayView4<'_, F>,
        v: &ArrayView4<'_, F>,
    ) -> Result<Array4<F>, AttentionError> {
        let (batch, heads, n, _) = q.dim();
        let shape = [batch, heads, n, self.d_v()];
        self.check_new(k, v)?;
        self.check_queries(q, k, &shape)?;
        zeroed_buffer("the output [batch, heads, n, d_v]", shape)
    }
}
