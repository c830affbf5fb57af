//! Fallible allocation: every buffer whose size follows from the caller's
//! shapes is sized with checked arithmetic and allocated with
//! `try_reserve`, so a shape too large to address or a request the machine
//! cannot meet is an [`AttentionError`], never a panic or an abort of the
//! host process.

use ndarray::{Array, Dimension, IntoDimension};
use num_traits::Zero;

use crate::error::{AttentionError, ErrorKind};

/// The number of elements of `dims`, if it and its size in bytes as `T`
/// fit in `isize` (ndarray's and the allocator's limit).
pub(crate) fn element_count<T>(what: &str, dims: &[usize]) -> Result<usize, AttentionError> {
    let fits = |n: usize| {
        n.checked_mul(size_of::<T>().max(1))
            .is_some_and(|bytes| bytes <= isize::MAX as usize)
    };
    let too_large = |why: &str| {
        AttentionError::new(
            ErrorKind::TooLarge,
            format!(
                "{what} of shape {dims:?} would need {why}more than isize::MAX bytes of {}",
                std::any::type_name::<T>()
            ),
        )
    };
    let count = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| fits(n))
        .ok_or_else(|| too_large(""))?;
    // ndarray also wants the product of the nonzero lengths to fit, even
    // when a zero length makes the array empty.
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d.max(1)))
        .filter(|&n| fits(n))
        .ok_or_else(|| too_large("(its nonzero lengths) "))?;
    Ok(count)
}

/// `len` copies of `value`, or an error if they cannot be allocated.
pub(crate) fn try_filled<T: Clone>(
    what: &str,
    len: usize,
    value: T,
) -> Result<Vec<T>, AttentionError> {
    let mut vec = try_with_capacity(what, len)?;
    vec.resize(len, value);
    Ok(vec)
}

/// An empty vector with room for `len` items, or an error if they cannot be
/// allocated.
pub(crate) fn try_with_capacity<T>(what: &str, len: usize) -> Result<Vec<T>, AttentionError> {
    element_count::<T>(what, &[len])?;
    let mut vec = Vec::new();
    vec.try_reserve_exact(len).map_err(|_| {
        AttentionError::new(
            ErrorKind::OutOfMemory,
            format!(
                "could not allocate {what}: {len} elements of {} ({} bytes)",
                std::any::type_name::<T>(),
                len.saturating_mul(size_of::<T>())
            ),
        )
    })?;
    Ok(vec)
}

/// An array of zeros of shape `dim`, or an error if it is too large to
/// address or cannot be allocated.
pub(crate) fn try_zeros<T, D, Sh>(what: &str, dim: Sh) -> Result<Array<T, D>, AttentionError>
where
    T: Clone + Zero,
    D: Dimension,
    Sh: IntoDimension<Dim = D>,
{
    let dim = dim.into_dimension();
    let len = element_count::<T>(what, dim.slice())?;
    let data = try_filled(what, len, T::zero())?;
    Ok(Array::from_shape_vec(dim, data).expect("the length is the shape's product"))
}
