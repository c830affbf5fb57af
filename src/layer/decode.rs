//! Incremental decoding with a [`KvCache`]: `CausalAttention`'s
//! `new_cache`, `new_window_cache`, `prefill` and `step`. A step projects
//! only the new positions, attends their queries to everything cached and
//! their own keys and values, and applies the output projection; only once
//! all of that has succeeded are the new keys and values stored (the
//! cache's `attend_next_with` and `restart_with`), so a failed step leaves
//! the cache as it was.

use ndarray::{Array3, ArrayView3, Axis};

use super::project::Heads;
use super::{CausalAttention, Layer};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::kv_cache::KvCache;

impl<F: Element> CausalAttention<F> {
    /// An empty growing [`KvCache`] shaped for this layer (its `kv_heads`,
    /// `d_k`, `d_v`), for `batch` sequences, with room for `capacity`
    /// positions before it first grows.
    ///
    /// # Errors
    /// [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge) when its buffers
    /// would be too large to address, and
    /// [`ErrorKind::OutOfMemory`](crate::ErrorKind::OutOfMemory) when they
    /// cannot be allocated (see [`KvCache::new`]).
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache<F>, AttentionError> {
        let c = &self.layer.config;
        KvCache::new(batch, c.kv_heads, c.d_k(), c.d_v(), capacity)
    }

    /// An empty ring-buffer [`KvCache`] shaped for this layer, for
    /// sliding-window attention: with it, [`prefill`](Self::prefill) and
    /// [`step`](Self::step) give what
    /// [`forward_batch_with`](Self::forward_batch_with) with
    /// [`AttentionOptions::window`](crate::AttentionOptions::window)`(window)` gives, keeping only the last
    /// `window` positions.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidOption`](crate::ErrorKind::InvalidOption) when
    /// `window` is 0; as [`new_cache`](Self::new_cache) when its `window`
    /// slots cannot be addressed or allocated.
    pub fn new_window_cache(
        &self,
        batch: usize,
        window: usize,
    ) -> Result<KvCache<F>, AttentionError> {
        let c = self.layer.config;
        KvCache::with_window(window, batch, c.kv_heads, c.d_k(), c.d_v())
    }

    /// Starts decoding: clears `cache`, then runs [`step`](Self::step) on
    /// the prompt `x` `[batch, len, d_model]`, returning its
    /// `[batch, len, output_width]` output (the same as
    /// [`forward_batch`](Self::forward_batch)) and leaving its keys and
    /// values in the cache.
    ///
    /// # Errors
    /// As [`step`](Self::step); the cache is unchanged then (not cleared).
    ///
    /// ```
    /// use ndarray::{s, Array3};
    /// use sdpa::{AttentionConfig, CausalAttention};
    ///
    /// let config = AttentionConfig::new(16, 4).with_kv_heads(2).with_output_projection(16);
    /// let layer = CausalAttention::<f32>::new_seeded(config, 7)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 12, 16), |(_, i, j)| ((i * 5 + j) % 9) as f32 * 0.1 - 0.4);
    ///
    /// let mut cache = layer.new_cache(1, 8)?;
    /// let prompt = layer.prefill(x.slice(s![.., ..8, ..]), &mut cache)?;
    /// let mut last = prompt;
    /// for t in 8..12 {
    ///     // In a model, x_new would come from the token just generated.
    ///     last = layer.step(x.slice(s![.., t..t + 1, ..]), &mut cache)?;
    /// }
    /// assert_eq!((cache.len(), cache.capacity()), (12, 16)); // grew once, by doubling
    ///
    /// let full = layer.forward_batch(x.view())?;
    /// for (a, b) in last.iter().zip(full.slice(s![.., 11.., ..]).iter()) {
    ///     assert!((a - b).abs() < 1e-5);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn prefill(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.prefill(x, cache)
    }

    /// One decoding step: `x_new` `[batch, n, d_model]` are the next `n`
    /// positions of the sequences in `cache` (usually `n = 1`). Their keys
    /// and values are appended to the cache, and only their `n` query rows
    /// are computed, against everything cached, bottom-right causal (the
    /// new rows are the newest positions; in a ring-buffer cache, each sees
    /// only the last `window` positions). Returns
    /// `[batch, n, output_width]`: rows `total_len .. total_len + n` of what
    /// [`forward_batch`](Self::forward_batch) gives on the whole sequence.
    ///
    /// With rotary embeddings ([`AttentionConfig::with_rope`](crate::AttentionConfig::with_rope)),
    /// the new queries and keys are at positions `total_len .. total_len + n`
    /// (the absolute count, also in a ring cache), and the keys are cached
    /// rotated.
    ///
    /// The scale is `1/√d_k`; other options (masks, bias) are not taken,
    /// as their shapes would depend on the cache.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x_new` is not `d_model` wide, or the cache was not made for this
    /// layer and batch (its `batch`, `kv_heads`, `d_k` or `d_v` differ);
    /// [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge) or
    /// [`ErrorKind::OutOfMemory`](crate::ErrorKind::OutOfMemory) when the
    /// projections, the output or the cache's grown buffers cannot be
    /// addressed or allocated;
    /// [`ErrorKind::Positions`](crate::ErrorKind::Positions) when a new
    /// token's position is past the rope's `max_positions`. The cache is
    /// unchanged on error.
    pub fn step(
        &self,
        x_new: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.step(x_new, cache)
    }
}

impl<F: Element> Layer<F> {
    /// Starts a new sequence in `cache` with the prompt `x`
    /// `[batch, len, d_model]`: its queries attend causally to its own keys
    /// and values (within the window, for a ring), as in a forward; the
    /// cache is cleared and given them only once that has succeeded.
    fn prefill(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        // The cache restarts: the prompt is at positions 0..len.
        let projected = self.project_all(x, x, 0)?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        let heads_out = self.heads_buffer(q.dim())?;
        cache.restart_with(k, v, |keys, values, opts| {
            self.attend_heads(q, keys, values, opts, heads_out)
        })
    }

    /// The newest positions `x` `[batch, len_new, d_model]` of the sequences
    /// `cache` holds: attends their queries to everything cached and their
    /// own keys and values (see [`KvCache::attend`]), which the cache then
    /// keeps.
    fn step(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        // The absolute position, not a ring's slot: the keys go in rotated.
        let projected = self.project_all(x, x, cache.total_len())?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        let heads_out = self.heads_buffer(q.dim())?;
        // `check_step` matched the cache to the config, which was validated
        // when the layer was built: the projections fit the cache.
        cache.attend_next_with(k, v, |keys, values, opts| {
            self.attend_heads(q, keys, values, opts, heads_out)
        })
    }

    fn check_step(&self, x: ArrayView3<'_, F>, cache: &KvCache<F>) -> Result<(), AttentionError> {
        self.check_query_width("x", x.shape(), "[batch, len_new, d_model]")?;
        let c = &self.config;
        let batch = x.len_of(Axis(0));
        if cache.batch() != batch
            || cache.kv_heads() != c.kv_heads
            || cache.d_k() != c.d_k()
            || cache.d_v() != c.d_v()
        {
            return Err(shape_error(format!(
                "the cache holds batch = {}, kv_heads = {}, d_k = {}, d_v = {}, but x {:?} = \
                 [batch, len_new, d_model] has batch = {batch} and the layer kv_heads = {}, \
                 d_k = {}, d_v = {}",
                cache.batch(),
                cache.kv_heads(),
                cache.d_k(),
                cache.d_v(),
                x.shape(),
                c.kv_heads,
                c.d_k(),
                c.d_v()
            )));
        }
        Ok(())
    }
}
