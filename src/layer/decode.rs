//! Incremental decoding with a [`KvCache`]: `CausalAttention`'s
//! `new_cache`, `new_window_cache` (and their `_in` forms, a cache in
//! another storage type: `bf16` or `f16` for an `f32` layer), `prefill`
//! and `step`. A step projects only the new positions, attends their
//! queries to everything cached and their own keys and values, and applies
//! the output projection; only once all of that has succeeded are the new
//! keys and values stored (the cache's `attend_next_with` and
//! `restart_with`), so a failed step leaves the cache as it was.

use ndarray::{Array3, ArrayView3, Axis};

use super::project::Heads;
use super::{CausalAttention, Layer};
use crate::alloc::try_zeros;
use crate::element::{Element, Storage};
use crate::error::{AttentionError, shape_error};
use crate::kv_cache::{KvCache, RightPadding};
use crate::options::AttentionOptions;

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
        self.new_cache_in(batch, capacity)
    }

    /// [`new_cache`](Self::new_cache) storing its keys and values in `C`:
    /// for an `f32` layer, `bf16` or `f16` (with the `half` feature) halves
    /// the cache's memory and the bytes each [`step`](Self::step) reads.
    /// The layer's projections are rounded to `C` as they go in (to
    /// nearest, ties to even); the new queries see the keys and values as
    /// the cache holds them, and the attention itself is computed in `F`.
    ///
    /// # Errors
    /// As [`new_cache`](Self::new_cache).
    ///
    /// ```
    /// # #[cfg(feature = "half")] {
    /// use ndarray::{s, Array3};
    /// use sdpa::half::bf16;
    /// use sdpa::{AttentionConfig, CausalAttention};
    ///
    /// let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(16, 4), 7)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 9, 16), |(_, i, j)| ((i * 5 + j) % 9) as f32 * 0.1 - 0.4);
    ///
    /// let mut cache = layer.new_cache_in::<bf16>(1, 16)?;
    /// layer.prefill(x.slice(s![.., ..8, ..]), &mut cache)?;
    /// let last = layer.step(x.slice(s![.., 8..9, ..]), &mut cache)?;
    ///
    /// // Within bf16's rounding of the keys and values of the f32 cache's step.
    /// let full = layer.forward_batch(x.view())?;
    /// for (a, b) in last.iter().zip(full.slice(s![.., 8.., ..]).iter()) {
    ///     assert!((a - b).abs() < 1e-2);
    /// }
    /// # }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn new_cache_in<C: Storage<Compute = F>>(
        &self,
        batch: usize,
        capacity: usize,
    ) -> Result<KvCache<C>, AttentionError> {
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
        self.new_window_cache_in(batch, window)
    }

    /// [`new_window_cache`](Self::new_window_cache) storing its keys and
    /// values in `C`, as [`new_cache_in`](Self::new_cache_in) does.
    ///
    /// # Errors
    /// As [`new_window_cache`](Self::new_window_cache).
    pub fn new_window_cache_in<C: Storage<Compute = F>>(
        &self,
        batch: usize,
        window: usize,
    ) -> Result<KvCache<C>, AttentionError> {
        let c = self.layer.config;
        KvCache::with_window(window, batch, c.kv_heads, c.d_k(), c.d_v())
    }

    /// Starts decoding: clears `cache`, then runs [`step`](Self::step) on
    /// the prompt `x` `[batch, len, d_model]`, returning its
    /// `[batch, len, output_width]` output (the same as
    /// [`forward_batch`](Self::forward_batch) with a cache of `F`, within
    /// the rounding of the keys and values to a half-precision cache's type)
    /// and leaving its keys and values in the cache.
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
    pub fn prefill<C: Storage<Compute = F>>(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.prefill(x, &AttentionOptions::new(), cache)
    }

    /// [`prefill`](Self::prefill) with options: those of
    /// [`KvCache::prefill`], which say what decoding can take (scale,
    /// ALiBi, sinks, softcap, a window, and on a growing cache a bias or
    /// keep mask) and how a prompt of sequences of different lengths is
    /// padded: on the left ([`key_starts`](AttentionOptions::key_starts))
    /// or on the right ([`key_lengths`](AttentionOptions::key_lengths),
    /// stored left-padded so that the sequences end together). Returns
    /// `[batch, len, output_width]` in the prompt's layout; a row of
    /// padding sees no key, so it is the output projection of zeros (its
    /// bias, or zeros without one).
    ///
    /// With rotary embeddings, each token is rotated at its position in
    /// the cache: a sequence's positions are its tokens' own shifted by its
    /// padding, which leaves every score as it is (a rotary score depends
    /// only on the difference of the two positions).
    ///
    /// # Errors
    /// As [`step`](Self::step) and [`KvCache::prefill`]. The cache is
    /// unchanged on error.
    ///
    /// ```
    /// use ndarray::{s, Array3};
    /// use sdpa::{AttentionConfig, AttentionOptions, CausalAttention};
    ///
    /// let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(8, 2), 3)?;
    /// let x = Array3::<f32>::from_shape_fn((2, 6, 8), |(b, i, j)| ((b + 3 * i + j) % 7) as f32 * 0.1);
    /// // Sequence 1 is 4 tokens long, left-padded to 6.
    /// let opts = AttentionOptions::new().key_starts(&[0, 2]);
    /// let mut cache = layer.new_cache(2, 8)?;
    /// let y = layer.prefill_with(x.view(), &opts, &mut cache)?;
    ///
    /// // Its rows are what the layer gives on its 4 tokens alone.
    /// let alone = layer.forward_batch(x.slice(s![1..2, 2.., ..]))?;
    /// for (a, b) in y.slice(s![1, 2.., ..]).iter().zip(alone.iter()) {
    ///     assert!((a - b).abs() < 1e-5);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn prefill_with<C: Storage<Compute = F>>(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.prefill(x, opts, cache)
    }

    /// One decoding step: `x_new` `[batch, n, d_model]` are the next `n`
    /// positions of the sequences in `cache` (usually `n = 1`). Their keys
    /// and values are appended to the cache, and only their `n` query rows
    /// are computed, against everything cached, bottom-right causal (the
    /// new rows are the newest positions; in a ring-buffer cache, each sees
    /// only the last `window` positions). Returns
    /// `[batch, n, output_width]`: rows `total_len .. total_len + n` of what
    /// [`forward_batch`](Self::forward_batch) gives on the whole sequence
    /// (with a half-precision cache, on keys and values rounded to its type).
    ///
    /// With rotary embeddings ([`AttentionConfig::with_rope`](crate::AttentionConfig::with_rope)),
    /// the new queries and keys are at positions `total_len .. total_len + n`
    /// (the absolute count, also in a ring cache), and the keys are cached
    /// rotated.
    ///
    /// The scale is `1/√d_k`; [`step_with`](Self::step_with) takes options.
    ///
    /// # Errors
    /// [`ErrorKind::ShapeMismatch`](crate::ErrorKind::ShapeMismatch) when
    /// `x_new` is not `d_model` wide, or the cache was not made for this
    /// layer and batch (its `batch`, `kv_heads`, `d_k` or `d_v` differ);
    /// [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge) or
    /// [`ErrorKind::OutOfMemory`](crate::ErrorKind::OutOfMemory) when the
    /// projections, their copies rounded to a half-precision cache's type,
    /// the output or the cache's grown buffers cannot be addressed or
    /// allocated;
    /// [`ErrorKind::Positions`](crate::ErrorKind::Positions) when a new
    /// token's position is past the rope's `max_positions`. The cache is
    /// unchanged on error.
    pub fn step<C: Storage<Compute = F>>(
        &self,
        x_new: ArrayView3<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.step(x_new, &AttentionOptions::new(), cache)
    }

    /// [`step`](Self::step) with the options of [`KvCache::attend_with`]:
    /// scale, ALiBi, sinks, softcap, a window, and on a growing cache a
    /// bias or keep mask of `total_len + n` columns. Each sequence's
    /// padding is the one its prompt was given to
    /// [`prefill_with`](Self::prefill_with).
    ///
    /// # Errors
    /// As [`step`](Self::step) and [`KvCache::attend_with`]. The cache is
    /// unchanged on error.
    ///
    /// ```
    /// use ndarray::{s, Array3};
    /// use sdpa::{alibi_slopes, AttentionConfig, AttentionOptions, CausalAttention};
    ///
    /// let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(8, 2), 5)?;
    /// let x = Array3::<f32>::from_shape_fn((1, 7, 8), |(_, i, j)| ((2 * i + j) % 5) as f32 * 0.2);
    /// let slopes: Vec<f32> = alibi_slopes(2).iter().map(|&s| s as f32).collect();
    /// let opts = AttentionOptions::new().alibi(&slopes);
    ///
    /// let mut cache = layer.new_window_cache(1, 3)?;
    /// layer.prefill_with(x.slice(s![.., ..4, ..]), &opts, &mut cache)?;
    /// let mut last = None;
    /// for t in 4..7 {
    ///     last = Some(layer.step_with(x.slice(s![.., t..t + 1, ..]), &opts, &mut cache)?);
    /// }
    /// let full = layer.forward_batch_with(x.view(), &opts.window(3))?;
    /// for (a, b) in last.unwrap().iter().zip(full.slice(s![.., 6.., ..])) {
    ///     assert!((a - b).abs() < 1e-5);
    /// }
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn step_with<C: Storage<Compute = F>>(
        &self,
        x_new: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        self.layer.step(x_new, opts, cache)
    }
}

impl<F: Element> Layer<F> {
    /// Starts a new sequence in `cache` with the prompt `x`
    /// `[batch, len, d_model]`: its queries attend causally to its own keys
    /// and values (within the window, for a ring), as in a forward; the
    /// cache is cleared and given them only once that has succeeded.
    fn prefill<C: Storage<Compute = F>>(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        let Some(lengths) = opts.key_lengths else {
            return self.prefill_left_padded(x, opts, cache);
        };
        let (batch, len, _) = x.dim();
        let padding = RightPadding::new(lengths, batch, len)?;
        let x_left = padding.to_left("the left-padded prompt", x, Axis(1))?;
        let mut left_opts = opts.reborrow();
        left_opts.key_lengths = None;
        left_opts.key_starts = Some(padding.starts());
        let y_left = self.prefill_left_padded(x_left.view(), &left_opts, cache)?;
        let mut y = try_zeros("the output [batch, len, output_width]", y_left.raw_dim())?;
        padding.to_right(y_left.view(), Axis(1), y.view_mut());
        Ok(y)
    }

    /// [`prefill`](Self::prefill) of a prompt with no right padding.
    fn prefill_left_padded<C: Storage<Compute = F>>(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        // The cache restarts: the prompt is at positions 0..len.
        let projected = self.project_all(x, x, 0)?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        let (k, v) = (C::compute_to_storage(k)?, C::compute_to_storage(v)?);
        let heads_out = self.heads_buffer(q.dim())?;
        cache.restart_with(k.view(), v.view(), opts, |attended| {
            self.attend_cached(q, attended, heads_out)
        })
    }

    /// The newest positions `x` `[batch, len_new, d_model]` of the sequences
    /// `cache` holds: attends their queries to everything cached and their
    /// own keys and values (see [`KvCache::attend_with`]), which the cache
    /// then keeps.
    fn step<C: Storage<Compute = F>>(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        cache: &mut KvCache<C>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        // The absolute position, not a ring's slot: the keys go in rotated.
        let projected = self.project_all(x, x, cache.total_len())?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        // Rounded to the cache's type (borrowed as they are for an F cache).
        let (k, v) = (C::compute_to_storage(k)?, C::compute_to_storage(v)?);
        let heads_out = self.heads_buffer(q.dim())?;
        // `check_step` matched the cache to the config, which was validated
        // when the layer was built: the projections fit the cache.
        cache.attend_next_with(k.view(), v.view(), opts, |attended| {
            self.attend_cached(q, attended, heads_out)
        })
    }

    fn check_step<C: Storage<Compute = F>>(
        &self,
        x: ArrayView3<'_, F>,
        cache: &KvCache<C>,
    ) -> Result<(), AttentionError> {
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
