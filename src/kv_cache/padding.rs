//! Right-padded prompts stored left-padded. A cache decodes its sequences
//! in lockstep, every step appending one position to each, so sequences
//! of different lengths must end together: a prompt padded on the right
//! (`key_lengths`) has each sequence's tokens moved to the end of the
//! prompt first, and its result moved back. Positions then differ from
//! the tokens' own by each sequence's padding, the same for all of its
//! tokens, so what depends on differences of positions (the causal rule,
//! ALiBi, rotary embeddings applied at the cache's positions) is as it was.

use ndarray::{Array, ArrayView, ArrayViewMut, Axis, Dimension, Slice};

use crate::alloc::try_zeros;
use crate::error::{AttentionError, ErrorKind};
use num_traits::Zero;

/// A right-padded batch's lengths, and the left padding they become.
#[derive(Debug, Clone)]
pub(crate) struct RightPadding<'a> {
    lengths: &'a [usize],
    /// Each sequence's first position once moved to the end: its padding.
    starts: Vec<usize>,
    /// The padded length.
    len: usize,
}

impl<'a> RightPadding<'a> {
    /// The padding of `batch` sequences of `lengths`, padded to `len`.
    ///
    /// # Errors
    /// [`ErrorKind::KeyLengths`] when there is not one length per sequence
    /// or one is past `len`.
    pub(crate) fn new(
        lengths: &'a [usize],
        batch: usize,
        len: usize,
    ) -> Result<Self, AttentionError> {
        if lengths.len() != batch {
            return Err(AttentionError::new(
                ErrorKind::KeyLengths,
                format!(
                    "key_lengths has {} entries but batch is {batch}",
                    lengths.len()
                ),
            ));
        }
        if let Some((b, length)) = lengths.iter().enumerate().find(|&(_, &l)| l > len) {
            return Err(AttentionError::new(
                ErrorKind::KeyLengths,
                format!("key_lengths[{b}] = {length} is past the prompt's length {len}"),
            ));
        }
        let starts = lengths.iter().map(|&length| len - length).collect();
        Ok(Self {
            lengths,
            starts,
            len,
        })
    }

    /// Each sequence's left padding, for `key_starts`.
    pub(crate) fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// `x` (batch on axis 0, positions on `axis`) with each sequence's
    /// tokens moved to the end and zeros before them.
    pub(crate) fn to_left<F: Clone + Zero, D: Dimension>(
        &self,
        what: &str,
        x: ArrayView<'_, F, D>,
        axis: Axis,
    ) -> Result<Array<F, D>, AttentionError> {
        let mut left = try_zeros(what, x.raw_dim())?;
        self.each_sequence(|b, tokens, moved| {
            sequence_mut(&mut left, b, axis, moved).assign(&sequence(&x, b, axis, tokens));
        });
        Ok(left)
    }

    /// The inverse of [`to_left`](Self::to_left) for a result: each
    /// sequence's rows of `left` back at its start in `out`, and its rows
    /// of padding after them.
    pub(crate) fn to_right<F: Clone, D: Dimension>(
        &self,
        left: ArrayView<'_, F, D>,
        axis: Axis,
        mut out: ArrayViewMut<'_, F, D>,
    ) {
        self.each_sequence(|b, tokens, moved| {
            sequence_mut(&mut out, b, axis, tokens).assign(&sequence(&left, b, axis, moved));
        });
        for (b, (&length, &start)) in self.lengths.iter().zip(&self.starts).enumerate() {
            sequence_mut(&mut out, b, axis, Slice::from(length..)).assign(&sequence(
                &left,
                b,
                axis,
                Slice::from(..start),
            ));
        }
    }

    /// Calls `f(b, tokens, moved)` with each sequence's token range in the
    /// right-padded layout and in the left-padded one.
    fn each_sequence(&self, mut f: impl FnMut(usize, Slice, Slice)) {
        for (b, (&length, &start)) in self.lengths.iter().zip(&self.starts).enumerate() {
            f(b, Slice::from(..length), Slice::from(start..self.len));
        }
    }
}

/// Batch item `b`'s positions `range` along `axis` of `x`.
fn sequence<'v, F, D: Dimension>(
    x: &'v ArrayView<'_, F, D>,
    b: usize,
    axis: Axis,
    range: Slice,
) -> ArrayView<'v, F, D> {
    let mut view = x.slice_axis(Axis(0), Slice::from(b..=b));
    view.slice_axis_inplace(axis, range);
    view
}

/// [`sequence`] of a mutable array or view.
fn sequence_mut<'v, F, S, D>(
    x: &'v mut ndarray::ArrayBase<S, D>,
    b: usize,
    axis: Axis,
    range: Slice,
) -> ArrayViewMut<'v, F, D>
where
    S: ndarray::DataMut<Elem = F>,
    D: Dimension,
{
    let mut view = x.slice_axis_mut(Axis(0), Slice::from(b..=b));
    view.slice_axis_inplace(axis, range);
    view
}
