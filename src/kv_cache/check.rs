//! The checks of [`KvCache`]'s arguments, and the one way its buffers are
//! allocated. Every call that changes the cache checks everything first,
//! so that on an error the cache is unchanged.

use ndarray::{Array4, ArrayView4};

use super::KvCache;
use crate::alloc::try_zeros;
use crate::element::Storage;
use crate::error::{AttentionError, ErrorKind, shape_error};
use num_traits::Zero;

/// What the key buffer is called in errors.
pub(super) const KEYS: &str = "the cache's keys [batch, kv_heads, slots, d_k]";
/// What the value buffer is called in errors.
pub(super) const VALUES: &str = "the cache's values [batch, kv_heads, slots, d_v]";

/// A buffer of zeros of shape `dims`, or the error of addressing or
/// allocating it (`alloc` also checks the product of the nonzero lengths,
/// which ndarray bounds even when another length is 0: a cache for batch 0
/// with a huge capacity).
pub(super) fn zeroed_buffer<F: Clone + Zero>(
    what: &str,
    dims: [usize; 4],
) -> Result<Array4<F>, AttentionError> {
    try_zeros(&format!("{what} {dims:?}"), dims)
}

impl<F: Storage> KvCache<F> {
    /// Checks new keys and values against the cache and each other.
    pub(super) fn check_new(
        &self,
        k: &ArrayView4<'_, F>,
        v: &ArrayView4<'_, F>,
    ) -> Result<(), AttentionError> {
        self.check_new_shapes(k.shape(), v.shape())
    }

    /// [`check_new`](Self::check_new) on the shapes of `k` and `v`, which
    /// may be in the compute type.
    pub(super) fn check_new_shapes(
        &self,
        ks: &[usize],
        vs: &[usize],
    ) -> Result<(), AttentionError> {
        let cache = [self.batch(), self.kv_heads(), self.d_k(), self.d_v()];
        let fits = ks[0] == cache[0]
            && vs[0] == cache[0]
            && ks[1] == cache[1]
            && vs[1] == cache[1]
            && ks[3] == cache[2]
            && vs[3] == cache[3]
            && ks[2] == vs[2];
        if !fits {
            return Err(shape_error(format!(
                "k {ks:?} = [batch, kv_heads, n, d_k] and v {vs:?} = [batch, kv_heads, n, d_v] \
                 do not fit the cache: batch = {}, kv_heads = {}, d_k = {}, d_v = {}, and the \
                 same n for both",
                cache[0], cache[1], cache[2], cache[3]
            )));
        }
        Ok(())
    }

    /// Checks the queries of a step against the new keys and `out`.
    pub(super) fn check_queries(
        &self,
        q: &ArrayView4<'_, F>,
        k: &ArrayView4<'_, F>,
        out: &[usize],
    ) -> Result<(), AttentionError> {
        self.check_query_shapes(q.shape(), k.shape(), out)
    }

    /// [`check_queries`](Self::check_queries) on the shapes of `q` and `k`,
    /// which may be in the compute type.
    pub(super) fn check_query_shapes(
        &self,
        qs: &[usize],
        ks: &[usize],
        out: &[usize],
    ) -> Result<(), AttentionError> {
        let layouts = || {
            format!(
                "q {qs:?} = [batch, heads, n, d_k], k {ks:?} = [batch, kv_heads, n, d_k], \
                 cache d_v = {}",
                self.d_v()
            )
        };
        if qs[0] != ks[0] || qs[2] != ks[2] || qs[3] != ks[3] {
            return Err(shape_error(format!(
                "q and k disagree on batch, n or d_k: {}",
                layouts()
            )));
        }
        if qs[1] == 0 {
            return Err(AttentionError::new(
                ErrorKind::ZeroDimension,
                format!("heads must be positive: {}", layouts()),
            ));
        }
        if !qs[1].is_multiple_of(ks[1]) {
            return Err(AttentionError::new(
                ErrorKind::HeadsNotDivisible,
                format!(
                    "heads ({}) must be a multiple of kv_heads ({}): {}",
                    qs[1],
                    ks[1],
                    layouts()
                ),
            ));
        }
        let expected = [qs[0], qs[1], qs[2], self.d_v()];
        if out != expected {
            return Err(shape_error(format!(
                "out has shape {out:?} but the output is [batch, heads, n, d_v] = {expected:?}: {}",
                layouts()
            )));
        }
        Ok(())
    }
}

/// Checks the sizes of a new cache.
pub(super) fn check_dims(kv_heads: usize, d_k: usize, d_v: usize) -> Result<(), AttentionError> {
    if kv_heads == 0 || d_k == 0 || d_v == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!(
                "kv_heads, d_k and d_v must be positive, got kv_heads = {kv_heads}, d_k = {d_k}, \
                 d_v = {d_v}"
            ),
        ));
    }
    Ok(())
}
