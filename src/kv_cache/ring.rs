//! The ring-buffer mode of [`KvCache`]: the last `window` positions in
//! `window` slots. Position `p` overwrites the slot of `p − window`, so
//! once the ring is full the entries are rotated in memory: they run from
//! the oldest slot to the end of the buffer, then from its start. While it
//! is not full, the oldest slot is 0 and the entries are slots `0..len`.
//!
//! Rotation does not matter to one new query, which sees every entry held
//! (attention is invariant under a permutation of the keys), unless an
//! option depends on positions (ALiBi, a narrower window, padding still
//! held): then the two runs of the rotation are attended in position order
//! and merged (`attended`). Several new queries need different ranges, so
//! they are attended against the held entries unrolled into position
//! order, followed by the new ones.
//!
//! The ring is written only once the attention has succeeded, with one
//! exception: a single new token in a full ring takes the slot of the
//! oldest entry, which its query must not see, before the attention. That
//! entry is copied aside first and put back if the attention fails.

use ndarray::{ArrayView4, Axis, s};

use super::KvCache;
use super::attended::Attended;
use super::buffer::Buffer;
use super::check::{KEYS, VALUES};
use crate::element::Storage;
use crate::error::{AttentionError, ErrorKind};
use crate::options::AttentionOptions;

impl<F: Storage> KvCache<F> {
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

    /// The ring's step of [`attend_next_with`](Self::attend_next_with)
    /// for `n ≥ 1` checked new positions.
    pub(super) fn attend_in_ring<R>(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        window: usize,
        opts: &AttentionOptions<'_, F::Compute>,
        attention: impl FnOnce(&Attended<'_, F>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        if k.len_of(Axis(2)) == 1 {
            return self.attend_one_in_ring(k, v, window, opts, attention);
        }
        // Several: the held entries in position order, then the new ones,
        // under the window option. The new entries are written to the ring
        // only afterwards, as they would overwrite entries the first new
        // queries see.
        let first = self.total_len - self.len;
        let starts = self.starts_from(first);
        let result = if self.len == 0 {
            attention(&Attended::in_order(
                k,
                v,
                opts.reborrow(),
                Some(window),
                starts,
            ))?
        } else {
            let (keys, values) = self.unrolled_with(&k, &v)?;
            let attended = Attended::in_order(
                keys.view(),
                values.view(),
                opts.reborrow(),
                Some(window),
                starts,
            );
            attention(&attended)?
        };
        self.push_into_ring(k, v, window);
        Ok(result)
    }

    /// One new token sees every entry held once it has replaced the one
    /// that fell out of its window. In a ring that is not full it goes to
    /// the first free slot, past those shown, and the entries are in
    /// position order; in a full ring they are in two runs, attended as
    /// one in slot order when the options allow ([`Attended::order_free`]).
    fn attend_one_in_ring<R>(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        window: usize,
        opts: &AttentionOptions<'_, F::Compute>,
        attention: impl FnOnce(&Attended<'_, F>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        if self.len < window {
            let slot = s![.., .., self.len..self.len + 1, ..];
            self.keys.slice_mut(slot).assign(&k);
            self.values.slice_mut(slot).assign(&v);
            let held = s![.., .., ..self.len + 1, ..];
            let first = self.total_len - self.len;
            let attended = Attended::in_order(
                self.keys.slice(held),
                self.values.slice(held),
                opts.reborrow(),
                Some(window),
                self.starts_from(first),
            );
            let result = attention(&attended)?;
            self.len += 1;
            return Ok(result);
        }
        let oldest = self.oldest_slot;
        let slot = s![.., .., oldest..oldest + 1, ..];
        let (mut old_key, mut old_value) = self.buffers(1)?;
        old_key.view_mut().assign(&self.keys.slice(slot));
        old_value.view_mut().assign(&self.values.slice(slot));
        self.keys.slice_mut(slot).assign(&k);
        self.values.slice_mut(slot).assign(&v);
        // The oldest position still seen is the one after the replaced entry's.
        let starts = self.starts_from(self.total_len + 1 - window);
        let result = {
            let (keys, values) = (self.keys.view(), self.values.view());
            let (user, ring) = (opts.reborrow(), Some(window));
            let attended = if oldest + 1 == window
                || Attended::<F>::order_free(opts, window, starts.as_deref())
            {
                Attended::in_order(keys, values, user, ring, starts)
            } else {
                let (older, newer) = (s![.., .., oldest + 1.., ..], s![.., .., ..=oldest, ..]);
                Attended::in_two_runs(
                    (keys.slice_move(older), values.slice_move(older)),
                    (self.keys.slice(newer), self.values.slice(newer)),
                    user,
                    ring,
                    starts,
                )
            };
            attention(&attended)
        };
        match result {
            Ok(result) => {
                self.oldest_slot = (oldest + 1) % window;
                Ok(result)
            }
            Err(err) => {
                self.keys.slice_mut(slot).assign(&old_key.view());
                self.values.slice_mut(slot).assign(&old_value.view());
                Err(err)
            }
        }
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
        let keys = self.unrolled(KEYS, &self.keys, kept, window)?;
        let values = self.unrolled(VALUES, &self.values, kept, window)?;
        self.keys = keys;
        self.values = values;
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
    ) -> Result<(Buffer<F>, Buffer<F>), AttentionError> {
        // `total_after` has checked `total_len + n`, and `len ≤ total_len`.
        let room = self.len + k.len_of(Axis(2));
        let keys = "the held and new keys [batch, kv_heads, len + n, d_k]";
        let values = "the held and new values [batch, kv_heads, len + n, d_v]";
        let mut keys = self.unrolled(keys, &self.keys, self.len, room)?;
        let mut values = self.unrolled(values, &self.values, self.len, room)?;
        keys.slice_mut(s![.., .., self.len.., ..]).assign(k);
        values.slice_mut(s![.., .., self.len.., ..]).assign(v);
        Ok((keys, values))
    }

    /// A copy of `buffer` (the keys' or the values') with room for `room`
    /// entries, holding its oldest `count` entries in position order in
    /// `0..count`. The entries run from the oldest slot to the end of the
    /// buffer, then from its start.
    fn unrolled(
        &self,
        what: &str,
        buffer: &Buffer<F>,
        count: usize,
        room: usize,
    ) -> Result<Buffer<F>, AttentionError> {
        let (batch, kv_heads, capacity, d) = buffer.dim();
        let mut out = Buffer::zeroed(what, [batch, kv_heads, room, d])?;
        let oldest = self.oldest_slot;
        let to_end = (capacity - oldest).min(count);
        out.slice_mut(s![.., .., ..to_end, ..])
            .assign(&buffer.slice(s![.., .., oldest..oldest + to_end, ..]));
        out.slice_mut(s![.., .., to_end..count, ..])
            .assign(&buffer.slice(s![.., .., ..count - to_end, ..]));
        Ok(out)
    }
}
