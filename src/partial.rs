//! Attention split over the keys: a partial result per key shard, and the
//! exact merge of any number of partials in any grouping.
//!
//! Softmax attention over keys `A ∪ B` is a weighted mean of the attention
//! over `A` and over `B`: with `lse_X` the log-sum-exp of row `i`'s visible
//! scores in `X`,
//!
//! ```text
//! lse = log(e^lse_A + e^lse_B)
//! out = e^(lse_A − lse) · out_A + e^(lse_B − lse) · out_B
//! ```
//!
//! This is the building block of split-KV decoding across threads and of
//! ring or sequence-parallel attention across processes and machines: each
//! worker computes
//! [`scaled_dot_product_attention_partial`](crate::scaled_dot_product_attention_partial)
//! on its key shard
//! (with [`AttentionOptions::key_shard`] telling it where the shard sits, so
//! causal masks, windows and key lengths stay right), ships the two arrays,
//! and anyone merges them.

//!
//! Below both paths: the fused decode driver merges its key chunks with
//! [`merge_row`]; the backward takes a forward's `AttentionPartial`.

use ndarray::{Array3, Array4, ArrayView3, ArrayView4, ArrayViewMut1, Zip};
use num_traits::Float;

use crate::element::Storage;
use crate::error::{AttentionError, shape_error};

/// Attention over a shard of the keys: the output normalised over the
/// shard, `[batch, heads, len_q, d_v]`, and each row's log-sum-exp of its
/// visible scaled scores in the shard, `[batch, heads, len_q]`.
///
/// A row that sees no key of the shard has output 0 and log-sum-exp `−inf`,
/// and merging it changes nothing.
///
/// Made by
/// [`scaled_dot_product_attention_partial`](crate::scaled_dot_product_attention_partial)
/// (the forward result that
/// [`scaled_dot_product_attention_backward`](crate::scaled_dot_product_attention_backward)
/// takes), by merging, or from received arrays with
/// [`from_parts`](Self::from_parts).
///
/// The log-sum-exp is in the call's compute type
/// ([`Storage::Compute`]): `f32` for a `bf16` or `f16` output, whose
/// partials merge in `f32` and round their output back once.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionPartial<F: Storage> {
    output: Array4<F>,
    log_sum_exp: Array3<F::Compute>,
}

impl<F: Storage> AttentionPartial<F> {
    /// Merges `other` (attention over other keys, same queries) into `self`.
    ///
    /// A `bf16` or `f16` partial is merged in `f32` (its output widened
    /// exactly) and its output rounded back once; to merge many, use
    /// [`merge_all`](Self::merge_all), which rounds once for all of them.
    ///
    /// # Errors
    /// When the two partials' shapes differ, or a half-precision output's
    /// `f32` copy cannot be allocated.
    pub fn merge(&mut self, other: &Self) -> Result<(), AttentionError> {
        self.merge_in(std::slice::from_ref(other))
    }

    /// Merges any number of partials, in order. Half-precision outputs are
    /// merged in `f32` and rounded once, at the end.
    ///
    /// # Errors
    /// When there are none, or their shapes differ, or a half-precision
    /// output's `f32` copy cannot be allocated.
    pub fn merge_all(partials: impl IntoIterator<Item = Self>) -> Result<Self, AttentionError> {
        let mut partials = partials.into_iter();
        let mut merged = partials
            .next()
            .ok_or_else(|| shape_error("merge_all needs at least one partial"))?;
        let rest: Vec<Self> = partials.collect();
        merged.merge_in(&rest)?;
        Ok(merged)
    }

    /// Merges `others` into `self` in order, in the compute type.
    fn merge_in(&mut self, others: &[Self]) -> Result<(), AttentionError> {
        if let Some(other) = others
            .iter()
            .find(|other| other.output.shape() != self.output.shape())
        {
            return Err(shape_error(format!(
                "cannot merge partials of shapes {:?} and {:?}",
                self.output.shape(),
                other.output.shape()
            )));
        }
        let log_sum_exp = &mut self.log_sum_exp;
        F::update_compute(self.output.view_mut(), |mut output| {
            for other in others {
                let other_output = F::to_compute(other.output.view())?;
                Zip::from(output.rows_mut())
                    .and(&mut *log_sum_exp)
                    .and(other_output.view().rows())
                    .and(&other.log_sum_exp)
                    .for_each(|out, lse, other_out, &other_lse| {
                        merge_row(out, lse, other_out.iter().copied(), other_lse);
                    });
            }
            Ok(())
        })
    }
}

impl<F: Storage> AttentionPartial<F> {
    /// Zero output and log-sum-exp of the given shape, to be written.
    pub(crate) fn zeros(output_dim: (usize, usize, usize, usize)) -> Result<Self, AttentionError> {
        let (b, h, l, _) = output_dim;
        Ok(Self {
            output: crate::alloc::try_zeros("the output", output_dim)?,
            log_sum_exp: crate::alloc::try_zeros("the log-sum-exp", (b, h, l))?,
        })
    }

    /// Both arrays, to be written by a forward path.
    pub(crate) fn parts_mut(
        &mut self,
    ) -> (
        ndarray::ArrayViewMut4<'_, F>,
        ndarray::ArrayViewMut3<'_, F::Compute>,
    ) {
        (self.output.view_mut(), self.log_sum_exp.view_mut())
    }

    /// A partial from its two arrays, e.g. received from another machine.
    ///
    /// # Errors
    /// When `log_sum_exp` is not `[batch, heads, len_q]` of `output`.
    pub fn from_parts(
        output: Array4<F>,
        log_sum_exp: Array3<F::Compute>,
    ) -> Result<Self, AttentionError> {
        let o = output.shape();
        if log_sum_exp.shape() != &o[..3] {
            return Err(shape_error(format!(
                "log_sum_exp has shape {:?} but output {o:?} needs [batch, heads, len_q] = {:?}",
                log_sum_exp.shape(),
                &o[..3]
            )));
        }
        Ok(Self {
            output,
            log_sum_exp,
        })
    }

    /// The output over this shard's keys, `[batch, heads, len_q, d_v]`.
    pub fn output(&self) -> ArrayView4<'_, F> {
        self.output.view()
    }

    /// Each row's log-sum-exp over this shard, `[batch, heads, len_q]`.
    pub fn log_sum_exp(&self) -> ArrayView3<'_, F::Compute> {
        self.log_sum_exp.view()
    }

    /// The two arrays, to send elsewhere.
    pub fn into_parts(self) -> (Array4<F>, Array3<F::Compute>) {
        (self.output, self.log_sum_exp)
    }

    /// The attention output: once every shard is merged in, the result of
    /// the unsplit call.
    pub fn into_output(self) -> Array4<F> {
        self.output
    }
}

/// Merges one row: `(out, lse) ← (out, lse) ⊕ (other_out, other_lse)`.
/// A side with `lse = −inf` has no weight and contributes nothing beside
/// one that has (its output is never multiplied, so even a NaN there cannot
/// leak). When neither has weight, a NaN output sticks: a row whose
/// visible keys all scored `−inf` is NaN, split or not (see `mask.rs`),
/// unless a sink's partial joins it (zeros, `modifiers::apply_sink`).
pub(crate) fn merge_row<F: Float>(
    mut out: ArrayViewMut1<'_, F>,
    lse: &mut F,
    other_out: impl Iterator<Item = F>,
    other_lse: F,
) {
    if other_lse == F::neg_infinity() {
        if *lse == F::neg_infinity() {
            // Neither side has weight; a NaN output (a row whose keys all
            // scored −inf) sticks over the zeros of one that saw nothing.
            out.iter_mut().zip(other_out).for_each(|(x, y)| *x = *x + y);
        }
        return;
    }
    if *lse == F::neg_infinity() {
        out.iter_mut().zip(other_out).for_each(|(x, y)| *x = y);
        *lse = other_lse;
        return;
    }
    let max = lse.max(other_lse);
    let (own, others) = ((*lse - max).exp(), (other_lse - max).exp());
    let total = own + others;
    let (own, others) = (own / total, others / total);
    out.iter_mut()
        .zip(other_out)
        .for_each(|(x, y)| *x = own * *x + others * y);
    *lse = max + total.ln();
}
