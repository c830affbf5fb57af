//! Attending the next entries, check first and mutate last: new keys and
//! values wait in slots the cache does not show (past `len`) or in new
//! buffers, and count only once the attention over them has succeeded
//! (see the module header of `kv_cache` for the one exception, a full
//! ring's single new token).

use std::borrow::Cow;

use super::attended::{Attended, DecodeCall, check_decode_options};
use super::buffer::Buffer;
use super::check::{KEYS, VALUES};
use crate::element::Storage;
use crate::error::{AttentionError, ErrorKind};
use crate::options::AttentionOptions;
use ndarray::{ArrayView4, ArrayViewMut4, Axis, s};

use super::KvCache;

impl<F: Storage> KvCache<F> {
    /// [`attend_into_with`](Self::attend_into_with) on checked arguments.
    pub(super) fn attend_into_prechecked(
        &mut self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
        out: ArrayViewMut4<'_, F>,
    ) -> Result<(), AttentionError> {
        self.attend_next_with(k, v, opts, |attended| attended.attend_into(q, out))
    }

    /// The step of [`attend_into_with`](Self::attend_into_with) with the
    /// attention left to the caller (a layer's decoding step, which also
    /// projects the output): `attention` gets what the next `n` positions'
    /// queries attend over ([`Attended`]), under the caller's `opts`
    /// (checked by [`check_decode_options`] as a step); `k` and `v`, which
    /// must fit the cache (a layer's projections do by construction), are
    /// stored only once it succeeds. On any error, from it or from sizing
    /// and allocating the buffers, the cache is unchanged.
    pub(crate) fn attend_next_with<R>(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
        attention: impl FnOnce(&Attended<'_, F>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        debug_assert!(
            self.check_new(&k, &v).is_ok(),
            "the caller promised keys and values that fit the cache"
        );
        check_decode_options(opts, self.window.is_some(), DecodeCall::Step)?;
        let n = k.len_of(Axis(2));
        if n == 0 {
            // No query: nothing to see, nothing to store.
            let first = self.total_len - self.len;
            let attended = Attended::in_order(
                self.keys(),
                self.values(),
                opts.reborrow(),
                self.window,
                self.starts_from(first),
            );
            return attention(&attended);
        }
        let total_len = self.total_after(n)?;
        let result = match self.window {
            None => self.attend_growing(k, v, opts, attention)?,
            Some(window) => self.attend_in_ring(k, v, window, opts, attention)?,
        };
        self.total_len = total_len;
        Ok(result)
    }

    /// [`attend_next_with`](Self::attend_next_with) for the first positions
    /// of a new sequence (a layer's prefill): `attention` gets `k` and `v`
    /// themselves, as the cache would hold them once cleared, under `opts`
    /// (checked as a prefill's, with no `key_lengths`: a right-padded
    /// prompt comes here moved to the left) and with `key_starts`, each
    /// sequence's left padding, which the cache keeps for the steps that
    /// follow. Only once it succeeds is the cache cleared and `k`, `v`
    /// stored. A growing cache too small for them grows as an append to an
    /// empty cache would, its buffers allocated before `attention` is
    /// called. On any error the cache is unchanged.
    pub(crate) fn restart_with<R>(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
        attention: impl FnOnce(&Attended<'_, F>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        debug_assert!(
            self.check_new(&k, &v).is_ok(),
            "the caller promised keys and values that fit the cache"
        );
        check_decode_options(opts, self.window.is_some(), DecodeCall::Prefill)?;
        debug_assert!(
            opts.key_lengths.is_none(),
            "right padding is moved left first"
        );
        let n = k.len_of(Axis(2));
        let grown = match self.window {
            None if n > self.capacity() => Some(self.buffers(self.grown_capacity(n))?),
            _ => None,
        };
        let mut user = opts.reborrow();
        user.key_starts = None;
        let starts = opts.key_starts.map(Cow::Borrowed);
        let result = attention(&Attended::in_order(k, v, user, self.window, starts))?;
        self.clear();
        match self.window {
            Some(window) => self.push_into_ring(k, v, window),
            None => {
                if let Some((keys, values)) = grown {
                    self.keys = keys;
                    self.values = values;
                }
                self.write(k, v, 0);
                self.len = n;
            }
        }
        self.total_len = n;
        // Only starts past 0 mean padding; `call::check` has bounded them by n.
        self.key_starts = opts
            .key_starts
            .filter(|starts| starts.iter().any(|&start| start > 0))
            .map(<[usize]>::to_vec);
        Ok(result)
    }

    /// Each sequence's first real position relative to position `first`
    /// (the first key an [`Attended`] holds), if any sequence is padded.
    pub(super) fn starts_from(&self, first: usize) -> Option<Cow<'_, [usize]>> {
        let starts = self.key_starts.as_deref()?;
        Some(if first == 0 {
            Cow::Borrowed(starts)
        } else {
            Cow::Owned(
                starts
                    .iter()
                    .map(|start| start.saturating_sub(first))
                    .collect(),
            )
        })
    }

    /// The position count after `n` more positions, or an error if it
    /// would overflow (a ring takes any number of positions, as views that
    /// broadcast one row).
    pub(super) fn total_after(&self, n: usize) -> Result<usize, AttentionError> {
        self.total_len.checked_add(n).ok_or_else(|| {
            AttentionError::new(
                ErrorKind::TooLarge,
                format!(
                    "the cache has seen {} positions; {n} more would overflow usize",
                    self.total_len
                ),
            )
        })
    }

    /// The growing mode's step: the new entries wait in the slots past
    /// `len` (which the cache does not show) or, when they do not fit, in
    /// grown buffers holding the filled part too; they count, and grown
    /// buffers replace the old, only once `attention` over them succeeds.
    pub(super) fn attend_growing<R>(
        &mut self,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F::Compute>,
        attention: impl FnOnce(&Attended<'_, F>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        // `total_after` has checked `total_len + n`, and `len` is `total_len`.
        let needed = self.len + k.len_of(Axis(2));
        let filled = s![.., .., ..needed, ..];
        let result = if needed <= self.capacity() {
            self.write(k, v, self.len);
            let attended = Attended::in_order(
                self.keys.slice(filled),
                self.values.slice(filled),
                opts.reborrow(),
                None,
                self.starts_from(0),
            );
            attention(&attended)?
        } else {
            let (mut keys, mut values) = self.buffers(self.grown_capacity(needed))?;
            let held = s![.., .., ..self.len, ..];
            keys.slice_mut(held).assign(&self.keys());
            values.slice_mut(held).assign(&self.values());
            let new = s![.., .., self.len..needed, ..];
            keys.slice_mut(new).assign(&k);
            values.slice_mut(new).assign(&v);
            let attended = Attended::in_order(
                keys.slice(filled),
                values.slice(filled),
                opts.reborrow(),
                None,
                self.starts_from(0),
            );
            let result = attention(&attended)?;
            drop(attended);
            self.keys = keys;
            self.values = values;
            result
        };
        self.len = needed;
        Ok(result)
    }

    /// Writes `k`, `v` into slots `at..at + n` of a growing cache's buffers,
    /// which have room.
    pub(super) fn write(&mut self, k: ArrayView4<'_, F>, v: ArrayView4<'_, F>, at: usize) {
        let range = s![.., .., at..at + k.len_of(Axis(2)), ..];
        self.keys.slice_mut(range).assign(&k);
        self.values.slice_mut(range).assign(&v);
    }

    /// The capacity a growing cache grows to when it must hold `needed`
    /// entries: at least double, so appends one at a time reallocate
    /// O(log n) times.
    pub(super) fn grown_capacity(&self, needed: usize) -> usize {
        self.capacity()
            .checked_mul(2)
            .map_or(needed, |doubled| doubled.max(needed))
    }

    /// Empty key and value buffers of this cache's shape with `slots`
    /// slots, or the error of addressing or allocating them.
    pub(super) fn buffers(&self, slots: usize) -> Result<(Buffer<F>, Buffer<F>), AttentionError> {
        let (batch, kv_heads, d_k, d_v) = (self.batch(), self.kv_heads(), self.d_k(), self.d_v());
        Ok((
            Buffer::zeroed(KEYS, [batch, kv_heads, slots, d_k])?,
            Buffer::zeroed(VALUES, [batch, kv_heads, slots, d_v])?,
        ))
    }
}

#[cfg(test)]
mod tests {
    //! The staging of new entries, with an attention that fails: the
    //! public API cannot make a checked attention fail on demand.

    use ndarray::Array4;

    use super::KvCache;
    use crate::error::{AttentionError, ErrorKind};
    use crate::options::AttentionOptions;

    fn options() -> AttentionOptions<'static, f64> {
        AttentionOptions::new()
    }

    /// `[1, 1, n, 1]` keys (and values) holding `from..from + n`.
    fn positions(from: usize, n: usize) -> Array4<f64> {
        Array4::from_shape_fn((1, 1, n, 1), |(_, _, t, _)| (from + t) as f64)
    }

    /// A cache that has been given positions `0..n`, one at a time (so a
    /// ring wraps).
    fn holding(mut cache: KvCache<f64>, n: usize) -> KvCache<f64> {
        for t in 0..n {
            let x = positions(t, 1);
            cache.append(x.view(), x.view()).unwrap();
        }
        cache
    }

    /// Everything about the cache, hidden state included.
    fn state(cache: &KvCache<f64>) -> (usize, usize, usize, usize, Vec<f64>, Vec<f64>) {
        (
            cache.len,
            cache.total_len,
            cache.capacity(),
            cache.oldest_slot,
            cache.keys().iter().copied().collect(),
            cache.values().iter().copied().collect(),
        )
    }

    fn injected() -> AttentionError {
        AttentionError::new(ErrorKind::InvalidOption, "injected")
    }

    /// Growing with room, growing past its capacity, a ring not full, a
    /// full ring that has wrapped (its oldest entry in slot 1).
    fn caches() -> Vec<KvCache<f64>> {
        vec![
            holding(KvCache::new(1, 1, 1, 1, 8).unwrap(), 3),
            holding(KvCache::new(1, 1, 1, 1, 3).unwrap(), 3),
            holding(KvCache::with_window(5, 1, 1, 1, 1).unwrap(), 3),
            holding(KvCache::with_window(3, 1, 1, 1, 1).unwrap(), 7),
        ]
    }

    #[test]
    fn a_failed_attention_stores_nothing() {
        for n in [1, 2, 4] {
            for (case, mut cache) in caches().into_iter().enumerate() {
                let before = state(&cache);
                let new = positions(100, n);
                let mut seen = 0;
                let result: Result<(), _> =
                    cache.attend_next_with(new.view(), new.view(), &options(), |attended| {
                        seen = attended.keys().count();
                        // The new entries are among those the queries see.
                        assert!(attended.keys().any(|&k| k == 100.0), "case {case}, n {n}");
                        Err(injected())
                    });
                assert_eq!(result.unwrap_err(), injected());
                assert!(seen >= n, "case {case}, n {n}");
                assert_eq!(state(&cache), before, "case {case}, n {n}");

                let result: Result<(), _> =
                    cache.restart_with(new.view(), new.view(), &options(), |_| Err(injected()));
                assert_eq!(result.unwrap_err(), injected());
                assert_eq!(state(&cache), before, "case {case}, n {n}, restart");
            }
        }
    }

    #[test]
    fn a_successful_attention_stores_the_new_entries() {
        for (case, mut cache) in caches().into_iter().enumerate() {
            let new = positions(100, 2);
            cache
                .attend_next_with(new.view(), new.view(), &options(), |_| Ok(()))
                .unwrap();
            let held: Vec<f64> = cache.keys().iter().copied().collect();
            assert!(
                held.contains(&100.0) && held.contains(&101.0),
                "case {case}: {held:?}"
            );
            cache
                .restart_with(new.view(), new.view(), &options(), |_| Ok(()))
                .unwrap();
            let held: Vec<f64> = cache.keys().iter().copied().collect();
            assert_eq!(
                (cache.total_len(), held),
                (2, vec![100.0, 101.0]),
                "case {case}"
            );
        }
    }
}
