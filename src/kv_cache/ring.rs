//! The ring-buffer mode of [`KvCache`]: the last `window` positions in
//! `window` slots. Position `p` overwrites the slot of `p − window`, so
//! once the ring is full the entries are rotated in memory: they run from
//! the oldest slot to the end of the buffer, then from its start. While it
//! is not full, the oldest slot is 0 and the entries are slots `0..len`.
//!
//! Rotation does not matter to one new query, which sees every entry held
//! (attention is invariant under a permutation of the keys). Several new
//! queries need different ranges, so they are attended against the held
//! entries unrolled into position order, followed by the new ones.

use ndarray::{Array4, ArrayView4, ArrayViewMut4, Axis, s};

use super::KvCache;
use crate::element::Element;
use crate::error::{AttentionError, ErrorKind};
use crate::options::AttentionOptions;

impl<F: Element> KvCache<F> {
    /// Stores checked `k`, `v` `[batch, kv_heads, n, d]` in the ring:
    /// only the last `window` new positions survive.
    pub(super) fn push_into_ring(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        window: usize,
    ) {
        let n = k.len_of(Axis(2));
        let skip = n.saturating_sub(window);
        for t in skip..n {
            let slot = if self.len < window {
                self.len += 1;
                self.len - 1
            } else {
                let slot = self.oldest_slot;
                self.oldest_slot = (slot + 1) % window;
                slot
            };
            self.keys
                .slice_mut(s![.., .., slot, ..])
                .assign(&k.slice(s![.., .., t, ..]));
            self.values
                .slice_mut(s![.., .., slot, ..])
                .assign(&v.slice(s![.., .., t, ..]));
        }
    }

    /// Attention of several (checked) new queries: the held entries in
    /// position order, then the new ones, under the window option. The new
    /// keys and values are written to the ring only afterwards, as they
    /// would overwrite entries the first new queries see.
    pub(super) fn attend_several_in_ring(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        window: usize,
        out: ArrayViewMut4<'_, F>,
    ) -> Result<(), AttentionError> {
        let opts = AttentionOptions::new().window(window);
        if self.len == 0 {
            crate::scaled_dot_product_attention_into(q, k, v, &opts, out)?;
        } else {
            let (keys, values) = self.unrolled_with(&k, &v);
            crate::scaled_dot_product_attention_into(q, keys.view(), values.view(), &opts, out)?;
        }
        self.push(k, v);
        Ok(())
    }

    /// [`truncate`](Self::truncate) of a ring to `total_len` positions,
    /// below the current total.
    pub(super) fn truncate_ring(
        &mut self,
        total_len: usize,
        window: usize,
    ) -> Result<(), AttentionError> {
        let first_held = self.total_len - self.len;
        let kept = total_len.saturating_sub(first_held);
        let needed = total_len.min(window - 1);
        if kept < needed {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!(
                    "cannot truncate a ring-buffer cache (window {window}) to {total_len} \
                     positions: it holds positions {first_held}..{}, and the next query would \
                     need positions {}..{total_len}",
                    self.total_len,
                    total_len - needed
                ),
            ));
        }
        // Keep positions first_held..total_len, unrolled into slots 0.. so
        // that the ring, no longer full, holds a prefix of its slots.
        self.keys = self.unrolled(&self.keys, kept, window);
        self.values = self.unrolled(&self.values, kept, window);
        self.len = kept;
        self.total_len = total_len;
        self.oldest_slot = 0;
        Ok(())
    }

    /// The entries held in position order, followed by `k`, `v`.
    fn unrolled_with(
        &self,
        k: &ArrayView4<'_, F>,
        v: &ArrayView4<'_, F>,
    ) -> (Array4<F>, Array4<F>) {
        let room = self.len + k.len_of(Axis(2));
        let mut keys = self.unrolled(&self.keys, self.len, room);
        let mut values = self.unrolled(&self.values, self.len, room);
        keys.slice_mut(s![.., .., self.len.., ..]).assign(k);
        values.slice_mut(s![.., .., self.len.., ..]).assign(v);
        (keys, values)
    }

    /// A copy of `buffer` (the keys' or the values') with room for `room`
    /// entries, holding its oldest `count` entries in position order in
    /// `0..count`. The entries run from the oldest slot to the end of the
    /// buffer, then from its start.
    fn unrolled(&self, buffer: &Array4<F>, count: usize, room: usize) -> Array4<F> {
        let (batch, kv_heads, capacity, d) = buffer.dim();
        let mut out = Array4::zeros((batch, kv_heads, room, d));
        let oldest = self.oldest_slot;
        let to_end = (capacity - oldest).min(count);
        out.slice_mut(s![.., .., ..to_end, ..])
            .assign(&buffer.slice(s![.., .., oldest..oldest + to_end, ..]));
        out.slice_mut(s![.., .., to_end..count, ..])
            .assign(&buffer.slice(s![.., .., ..count - to_end, ..]));
        out
    }
}
