//! What a decoding step's new queries attend over ([`Attended`]), and the
//! options a decoding call may take.
//!
//! The cache hands an [`Attended`] to whoever computes the attention (its
//! own `attend`, or a layer's step, which also projects the output): the
//! keys and values as one run of slots, or two, and the options that say
//! which each new query sees. Positions inside it are relative to the
//! first key it holds: in a growing cache that is position 0, so they are
//! the absolute positions; in a ring it is the oldest position the window
//! still holds. Everything positional (the causal rule, the window, ALiBi's
//! distances, each sequence's left padding) depends only on differences of
//! positions or is shifted with them, so relative positions give the
//! result absolute ones would.
//!
//! Two runs happen in a full ring: after the newest key takes the oldest
//! one's slot, the keys run in position order from the slot after it to
//! the end of the buffer, then from the start. When nothing the options
//! ask for depends on positions, the ring's slots are attended as one run
//! in slot order instead (attention does not depend on the order of its
//! keys); otherwise each run is attended as a key shard and the two
//! partials are merged, the exact online-softmax merge.

use std::borrow::Cow;

use ndarray::{ArrayView4, ArrayViewMut3, ArrayViewMut4, Axis};

use crate::element::Storage;
use crate::error::{AttentionError, ErrorKind};
use crate::options::{AttentionOptions, CausalAlignment};
use crate::partial::AttentionPartial;

/// The keys and values a decoding step's new queries attend over, in
/// position order (or, when that cannot matter, slot order), and the
/// options that say which each query sees.
#[derive(Debug)]
pub(crate) struct Attended<'a, F: Storage> {
    /// The first run of keys and values.
    first: (ArrayView4<'a, F>, ArrayView4<'a, F>),
    /// The second, in a full ring attended in position order.
    second: Option<(ArrayView4<'a, F>, ArrayView4<'a, F>)>,
    /// The caller's options, checked by [`check_decode_options`].
    user: AttentionOptions<'a, F::Compute>,
    /// A ring's window, which every query keeps to.
    ring_window: Option<usize>,
    /// Each sequence's first real position, relative to the first key.
    key_starts: Option<Cow<'a, [usize]>>,
}

impl<'a, F: Storage> Attended<'a, F> {
    /// Keys and values in position order, relative position 0 first.
    pub(crate) fn in_order(
        keys: ArrayView4<'a, F>,
        values: ArrayView4<'a, F>,
        user: AttentionOptions<'a, F::Compute>,
        ring_window: Option<usize>,
        key_starts: Option<Cow<'a, [usize]>>,
    ) -> Self {
        Self {
            first: (keys, values),
            second: None,
            user,
            ring_window,
            key_starts,
        }
    }

    /// Keys and values in two runs that follow each other in position
    /// order.
    pub(crate) fn in_two_runs(
        first: (ArrayView4<'a, F>, ArrayView4<'a, F>),
        second: (ArrayView4<'a, F>, ArrayView4<'a, F>),
        user: AttentionOptions<'a, F::Compute>,
        ring_window: Option<usize>,
        key_starts: Option<Cow<'a, [usize]>>,
    ) -> Self {
        Self {
            first,
            second: Some(second),
            user,
            ring_window,
            key_starts,
        }
    }

    /// Whether the keys may be attended in any order: nothing asked for
    /// depends on a key's position, given that each query sees every key
    /// held (a ring's single new token). Left padding counts only while
    /// a padded position is still held.
    pub(crate) fn order_free(
        user: &AttentionOptions<'_, F::Compute>,
        keys_held: usize,
        key_starts: Option<&[usize]>,
    ) -> bool {
        user.alibi.is_none()
            && user.bias.is_none()
            && user.keep_mask.is_none()
            && user.window.is_none_or(|window| window >= keys_held)
            && key_starts.is_none_or(|starts| starts.iter().all(|&start| start == 0))
    }

    /// The options every run is attended with (before its key shard).
    fn options(&self) -> AttentionOptions<'_, F::Compute> {
        let mut opts = self.user.reborrow();
        opts.causal = Some(CausalAlignment::BottomRight);
        opts.window = match (opts.window, self.ring_window) {
            (Some(user), Some(ring)) => Some(user.min(ring)),
            (user, ring) => user.or(ring),
        };
        opts.key_starts = self.key_starts.as_deref();
        opts
    }

    /// The keys held in the runs, in the order given.
    #[cfg(test)]
    pub(crate) fn keys(&self) -> impl Iterator<Item = &F> {
        self.first
            .0
            .iter()
            .chain(self.second.iter().flat_map(|(keys, _)| keys.iter()))
    }

    /// Attention of `q` `[batch, heads, n, d_k]` over the runs into `out`
    /// `[batch, heads, n, d_v]` (any strides), both in the cache's type
    /// (a half-precision cache's queries are widened, and its output
    /// rounded, once).
    pub(crate) fn attend_into(
        &self,
        q: ArrayView4<'_, F>,
        out: ArrayViewMut4<'_, F>,
    ) -> Result<(), AttentionError> {
        let q = F::to_compute(q)?;
        F::write_compute(out, |out| self.attend_compute_into(q.view(), out))
    }

    /// [`attend_into`](Self::attend_into) with `q` and `out` in the compute
    /// type. The keys and values stay in the cache's type: a half-precision
    /// cache's are widened tile by tile as the kernels read them
    /// (`Convert::forward_stored`).
    pub(crate) fn attend_compute_into(
        &self,
        q: ArrayView4<'_, F::Compute>,
        mut out: ArrayViewMut4<'_, F::Compute>,
    ) -> Result<(), AttentionError> {
        let opts = self.options();
        let (keys, values) = (self.first.0.view(), self.first.1.view());
        let Some((later_keys, later_values)) = &self.second else {
            return attend_stored::<F>(q, keys, values, &opts, out, None);
        };
        let split = keys.len_of(Axis(2));
        let total = split + later_keys.len_of(Axis(2));
        let shard = |offset| opts.clone().key_shard(offset, total);
        let partial = |keys, values, offset| {
            let mut partial = AttentionPartial::<F::Compute>::zeros(out.dim())?;
            let (output, log_sum_exp) = partial.parts_mut();
            attend_stored::<F>(
                q.view(),
                keys,
                values,
                &shard(offset),
                output,
                Some(log_sum_exp),
            )?;
            Ok::<_, AttentionError>(partial)
        };
        let mut merged = partial(keys, values, 0)?;
        merged.merge(&partial(later_keys.view(), later_values.view(), split)?)?;
        out.assign(&merged.output());
        Ok(())
    }
}

/// Whether a decoding call is a prefill (which may give the prompt's
/// padding) or a step (whose padding the cache already holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeCall {
    /// A new sequence's prompt.
    Prefill,
    /// The next positions of the sequences held.
    Step,
}

/// Checks the options of a decoding call against what decoding can take.
///
/// Decoding is bottom-right causal by construction (`.causal()` is allowed
/// and changes nothing); it cannot be a key shard; a ring's rotated keys
/// have no fixed column for a bias or keep mask; and padding is given once,
/// with the prompt.
pub(crate) fn check_decode_options<F>(
    opts: &AttentionOptions<'_, F>,
    ring: bool,
    call: DecodeCall,
) -> Result<(), AttentionError> {
    let invalid = |message: &str| Err(AttentionError::new(ErrorKind::InvalidOption, message));
    if opts.causal == Some(CausalAlignment::TopLeft) {
        return invalid(
            "decoding with a KV cache is bottom-right causal (the new queries are the newest \
             positions); CausalAlignment::TopLeft cannot be used",
        );
    }
    if opts.key_shard.is_some() {
        return invalid(
            "a KV cache attends over all its keys; key_shard is for the functional API's partials",
        );
    }
    if ring && (opts.bias.is_some() || opts.keep_mask.is_some()) {
        return invalid(
            "a ring-buffer cache's keys have no fixed column for a bias or keep mask; use a \
             growing cache, or ALiBi and the window, which follow the positions",
        );
    }
    match call {
        DecodeCall::Step if opts.key_lengths.is_some() || opts.key_starts.is_some() => invalid(
            "key_lengths and key_starts give a prompt's padding, to prefill; a step's new \
             positions follow each sequence's own, which the cache holds",
        ),
        DecodeCall::Prefill if opts.key_lengths.is_some() && opts.key_starts.is_some() => invalid(
            "a prompt is padded on the right (key_lengths) or on the left (key_starts), not both",
        ),
        DecodeCall::Prefill
            if opts.key_lengths.is_some() && (opts.bias.is_some() || opts.keep_mask.is_some()) =>
        {
            invalid(
                "a right-padded prompt (key_lengths) is stored left-padded, which would move a \
                 bias's or keep mask's columns; pad the prompt on the left (key_starts) instead",
            )
        }
        _ => Ok(()),
    }
}

/// Attention of `q` (in the compute type) over `k` and `v` stored in `F`,
/// into `out` and, when given, `log_sum_exp` (of the output's shape).
fn attend_stored<F: Storage>(
    q: ArrayView4<'_, F::Compute>,
    k: ArrayView4<'_, F>,
    v: ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F::Compute>,
    out: ArrayViewMut4<'_, F::Compute>,
    log_sum_exp: Option<ArrayViewMut3<'_, F::Compute>>,
) -> Result<(), AttentionError> {
    let call = crate::call::check(&q, &k, &v, opts)?;
    crate::call::check_output("out", &call.shape, out.shape())?;
    F::forward_stored(&call, out, log_sum_exp)
}
