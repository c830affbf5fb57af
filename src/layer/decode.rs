//! Incremental decoding with a [`KvCache`]: `CausalAttention`'s
//! `new_cache`, `new_window_cache`, `prefill` and `step`. A step projects
//! only the new positions, appends their keys and values to the cache and
//! attends their queries to everything cached
//! ([`KvCache::attend_into`]), then applies the output projection.

use ndarray::{Array3, Array4, ArrayView3, Axis};

use super::project::Heads;
use super::{CausalAttention, Layer};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::kv_cache::KvCache;

impl<F: Element> CausalAttention<F> {
    /// An empty growing [`KvCache`] shaped for this layer (its `kv_heads`,
    /// `d_k`, `d_v`), for `batch` sequences, with room for `capacity`
    /// positions before it first grows.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> KvCache<F> {
        let c = &self.layer.config;
        KvCache::allocate(batch, c.kv_heads, c.d_k, c.d_v, capacity, None)
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
    /// `window` is 0.
    pub fn new_window_cache(
        &self,
        batch: usize,
        window: usize,
    ) -> Result<KvCache<F>, AttentionError> {
        let c = self.layer.config;
        KvCache::with_window(window, batch, c.kv_heads, c.d_k, c.d_v)
    }

    /// Starts decoding: clears `cache`, then runs [`step`](Self::step) on
    /// the prompt `x` `[batch, len, d_model]`, returning its
    /// `[batch, len, output_width]` output (the same as
    /// [`forward_batch`](Self::forward_batch)) and leaving its keys and
    /// values in the cache.
    ///
    /// # Errors
    /// As [`step`](Self::step); the cache is not cleared then.
    ///
    /// ```
    /// use ndarray::{s, Array3};
    /// use sdpa::{AttentionConfig, CausalAttention};
    ///
    /// let config = AttentionConfig::new(16, 4, 4).with_heads(4).with_kv_heads(2).with_output_projection(16);
    /// let layer = CausalAttention::<f32>::new_seeded(config, 7)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 12, 16), |(_, i, j)| ((i * 5 + j) % 9) as f32 * 0.1 - 0.4);
    ///
    /// let mut cache = layer.new_cache(1, 8);
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
    /// The scale is `1/√d_k`; other options (masks, bias) are not taken,
    /// as their shapes would depend on the cache.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x_new` is not `d_model` wide, or the cache was not made for this
    /// layer and batch (its `batch`, `kv_heads`, `d_k` or `d_v` differ);
    /// the cache is unchanged then.
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
    /// `[batch, len, d_model]`: the cache is cleared (only once the
    /// arguments are checked), then [`step`](Self::step).
    fn prefill(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        cache.clear();
        self.step(x, cache)
    }

    /// The newest positions `x` `[batch, len_new, d_model]` of the sequences
    /// `cache` holds: appends their keys and values to it and attends their
    /// queries to everything cached (see [`KvCache::attend`]).
    fn step(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        let projected = self.project_all(x, x)?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        let (batch, len_new, _) = projected.q.dim();
        let mut heads_out = Array4::zeros((batch, len_new, self.config.heads, self.config.d_v));
        // `check_step` matched the cache to the config, which was validated
        // when the layer was built: the projections fit the cache.
        cache.attend_into_prechecked(q, k, v, heads_out.view_mut().permuted_axes([0, 2, 1, 3]))?;
        self.output(heads_out)
    }

    fn check_step(&self, x: ArrayView3<'_, F>, cache: &KvCache<F>) -> Result<(), AttentionError> {
        self.check_query_width("x", x.shape(), "[batch, len_new, d_model]")?;
        let c = &self.config;
        let batch = x.len_of(Axis(0));
        if cache.batch() != batch
            || cache.kv_heads() != c.kv_heads
            || cache.d_k() != c.d_k
            || cache.d_v() != c.d_v
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
                c.d_k,
                c.d_v
            )));
        }
        Ok(())
    }
}
