//! The data path every pass of a layer shares: the input checks, the
//! projections, the head split, the attention call and the output
//! projection. `forward`, `decode` and `backward` are built from these.
//!
//! The data path of a forward call, with `b` batch items, `h` heads and
//! `g` key/value heads:
//!
//! ```text
//! x_q [b, len_q, d_model] · W^Q (+ b_q)  → q [b, len_q, h·d_k]  ─┐ views, no copies:
//! x_kv [b, len_kv, d_model_kv] · W^K     → k [b, len_kv, g·d_k] ─┤ [b, len, h, d] permuted
//! x_kv · W^V                             → v [b, len_kv, g·d_v] ─┘ to [b, h, len, d]
//! attention into a [b, len_q, h, d_v] buffer seen as [b, h, len_q, d_v]
//!   → that buffer *is* the concatenated heads [b, len_q, h·d_v]
//!   → · W^O (+ b_o) when there is an output projection
//! ```
//!
//! The single-head layer of the seed is the case `h = g = 1` with no
//! output projection.
//!
//! Every buffer here is sized from the caller's lengths (a broadcast input
//! may be far longer than its memory), so each is allocated fallibly
//! (`crate::alloc`): too large a call is an error, never a panic or an
//! abort.

use ndarray::linalg::general_mat_mul;
use ndarray::{
    Array, Array1, Array2, Array3, Array4, ArrayView2, ArrayView3, ArrayView4, ArrayViewMut4, Axis,
    CowArray, Dimension, IntoDimension, Ix3, ShapeError,
};

use super::Layer;
use super::config::describe_config;
use crate::alloc::{element_count, try_with_capacity, try_zeros};
use crate::element::{Element, Storage};
use crate::error::{AttentionError, shape_error};
use crate::kv_cache::Attended;
use crate::options::AttentionOptions;
use crate::rope::RopePositions;

impl<F: Element> Layer<F> {
    /// The projections of one sequence `x` `[len, d_model]` for
    /// self-attention, as batch item 0 of a batch of 1.
    pub(super) fn project_sequence(
        &self,
        x: ArrayView2<'_, F>,
    ) -> Result<Projected<F>, AttentionError> {
        // Checked here so the message speaks of the caller's 2-D shape.
        self.check_query_width("x", x.shape(), "[len, d_model]")?;
        self.project_batch(x.insert_axis(Axis(0)))
    }

    /// The projections of a batch `x` `[batch, len, d_model]` for
    /// self-attention.
    pub(super) fn project_batch(
        &self,
        x: ArrayView3<'_, F>,
    ) -> Result<Projected<F>, AttentionError> {
        self.check_query_width("x", x.shape(), "[batch, len, d_model]")?;
        self.check_self_attention()?;
        self.project_all(x, x, 0)
    }

    /// The projections for cross-attention: queries from `x_q`
    /// `[batch, len_q, d_model]`, keys and values from `x_kv`
    /// `[batch, len_kv, d_model_kv]`.
    pub(super) fn project_cross(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
    ) -> Result<Projected<F>, AttentionError> {
        self.check_query_width("x_q", x_q.shape(), "[batch, len_q, d_model]")?;
        self.check_kv_width("x_kv", x_kv.shape(), "[batch, len_kv, d_model_kv]")?;
        if x_q.len_of(Axis(0)) != x_kv.len_of(Axis(0)) {
            return Err(shape_error(format!(
                "batch sizes differ: x_q {:?} = [batch, len_q, d_model], \
                 x_kv {:?} = [batch, len_kv, d_model_kv]",
                x_q.shape(),
                x_kv.shape()
            )));
        }
        self.project_all(x_q, x_kv, 0)
    }

    /// `x_q · W^Q + b_q`, `x_kv · W^K + b_k`, `x_kv · W^V + b_v`; with
    /// rotary embeddings, the queries and keys rotated, token `i` of each
    /// sequence at position `start + i`.
    pub(super) fn project_all(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        start: usize,
    ) -> Result<Projected<F>, AttentionError> {
        let w = &self.parameters;
        let mut projected = Projected {
            q: project(x_q, &w.w_q, w.b_q.as_ref())?,
            k: project(x_kv, &w.w_k, w.b_k.as_ref())?,
            v: project(x_kv, &w.w_v, w.b_v.as_ref())?,
        };
        if let Some(table) = &self.rope {
            let c = &self.config;
            for (x, heads) in [(&mut projected.q, c.heads), (&mut projected.k, c.kv_heads)] {
                let x = split_heads_mut(x, heads)?;
                crate::rope::apply_rope_inplace(x, table, RopePositions::Start(start))
                    .map_err(|err| self.rope_error(err))?;
            }
        }
        Ok(projected)
    }

    /// Names the layer's `max_positions` in a rotary error.
    pub(super) fn rope_error(&self, err: AttentionError) -> AttentionError {
        let max_positions = self.config.rope.map_or(0, |rope| rope.max_positions);
        AttentionError::new(
            err.kind(),
            format!("the layer's rope (max_positions = {max_positions}): {err}"),
        )
    }

    /// The projections `[batch, len, heads·d]` as `[batch, heads, len, d]` views.
    pub(super) fn split_all<'a>(
        &self,
        projected: &'a Projected<F>,
    ) -> Result<Heads<'a, F>, AttentionError> {
        let c = &self.config;
        Ok(Heads {
            q: split_heads(&projected.q, c.heads)?,
            k: split_heads(&projected.k, c.kv_heads)?,
            v: split_heads(&projected.v, c.kv_heads)?,
        })
    }

    /// Attention of the projected queries over the projected keys and
    /// values, then the output projection: `[batch, len_q, output_width]`.
    pub(super) fn attend(
        &self,
        projected: &Projected<F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array3<F>, AttentionError> {
        let Heads { q, k, v } = self.split_all(projected)?;
        let heads_out = self.heads_buffer(q.dim())?;
        self.attend_heads(q, k, v, opts, heads_out)
    }

    /// The buffer the heads' output is written to, for queries
    /// `[batch, heads, len_q, d_k]`: laid out `[batch, len_q, heads, d_v]`
    /// and written through a `[batch, heads, len_q, d_v]` view, so the
    /// concatenated heads need no copy.
    pub(super) fn heads_buffer(
        &self,
        (batch, heads, len_q, _): (usize, usize, usize, usize),
    ) -> Result<Array4<F>, AttentionError> {
        let dim = (batch, len_q, heads, self.config.d_v());
        zeros("the heads' output [batch, len_q, heads, d_v]", dim)
    }

    /// Attention of the heads `q` over `k`, `v` into `heads_out` (from
    /// [`heads_buffer`](Self::heads_buffer)), then the output projection:
    /// `[batch, len_q, output_width]`.
    pub(super) fn attend_heads(
        &self,
        q: ArrayView4<'_, F>,
        k: ArrayView4<'_, F>,
        v: ArrayView4<'_, F>,
        opts: &AttentionOptions<'_, F>,
        heads_out: Array4<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.attend_into_heads(heads_out, |out| {
            crate::scaled_dot_product_attention_into(q, k, v, opts, out)
        })
    }

    /// [`attend_heads`](Self::attend_heads) over what a KV cache gives a
    /// decoding step.
    pub(super) fn attend_cached<C: Storage<Compute = F>>(
        &self,
        q: ArrayView4<'_, F>,
        attended: &Attended<'_, C>,
        heads_out: Array4<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.attend_into_heads(heads_out, |out| attended.attend_compute_into(q, out))
    }

    /// Runs `attention` into `heads_out` `[batch, len, heads, d_v]` seen as
    /// `[batch, heads, len, d_v]`, then applies the [`output`](Self::output)
    /// projection.
    fn attend_into_heads(
        &self,
        mut heads_out: Array4<F>,
        attention: impl FnOnce(ArrayViewMut4<'_, F>) -> Result<(), AttentionError>,
    ) -> Result<Array3<F>, AttentionError> {
        attention(heads_out.view_mut().permuted_axes([0, 2, 1, 3]))?;
        self.output(heads_out)
    }

    /// The attention weights of each head, `[batch, heads, len_q, len_kv]`,
    /// by [`crate::core::attention_weights`] on the projected queries and
    /// keys (which materialises `len_q × len_kv` per head).
    pub(super) fn attention_weights(
        &self,
        projected: &Projected<F>,
        opts: &AttentionOptions<'_, F>,
    ) -> Result<Array4<F>, AttentionError> {
        let Heads { q, k, .. } = self.split_all(projected)?;
        crate::core::attention_weights(q, k, opts)
    }

    /// `[batch, len, heads, d_v]` → concatenated `[batch, len, heads·d_v]`
    /// → `· W^O + b_o` when there is an output projection.
    pub(super) fn output(&self, heads_out: Array4<F>) -> Result<Array3<F>, AttentionError> {
        let (batch, len, heads, d_v) = heads_out.dim();
        let concatenated = heads_out
            .into_shape_with_order((batch, len, heads * d_v))
            .map_err(reshape_error)?;
        match &self.parameters.w_o {
            None => Ok(concatenated),
            Some(w_o) => project(concatenated.view(), w_o, self.parameters.b_o.as_ref()),
        }
    }

    fn check_self_attention(&self) -> Result<(), AttentionError> {
        if self.config.kv_input_width() != self.config.d_model {
            return Err(shape_error(format!(
                "self-attention needs d_model_kv = d_model, but {}: this is a cross-attention \
                 layer, call forward_cross",
                describe_config(&self.config)
            )));
        }
        Ok(())
    }

    pub(super) fn check_query_width(
        &self,
        name: &str,
        shape: &[usize],
        layout: &str,
    ) -> Result<(), AttentionError> {
        self.check_width(name, shape, layout, "d_model", self.config.d_model)
    }

    fn check_kv_width(
        &self,
        name: &str,
        shape: &[usize],
        layout: &str,
    ) -> Result<(), AttentionError> {
        self.check_width(
            name,
            shape,
            layout,
            "d_model_kv",
            self.config.kv_input_width(),
        )
    }

    fn check_width(
        &self,
        name: &str,
        shape: &[usize],
        layout: &str,
        width_name: &str,
        width: usize,
    ) -> Result<(), AttentionError> {
        if shape[shape.len() - 1] != width {
            let w = &self.parameters;
            return Err(shape_error(format!(
                "{name} has shape {shape:?} = {layout} but the layer's {width_name} is {width} \
                 (w_q {:?}, w_k {:?}, w_v {:?})",
                w.w_q.shape(),
                w.w_k.shape(),
                w.w_v.shape()
            )));
        }
        Ok(())
    }
}

/// The projected queries, keys and values, `[batch, len, heads·d]`.
#[derive(Debug, Clone)]
pub(super) struct Projected<F> {
    pub(super) q: Array3<F>,
    pub(super) k: Array3<F>,
    pub(super) v: Array3<F>,
}

/// [`Projected`] split into heads: `[batch, heads, len, d]` views.
pub(super) struct Heads<'a, F> {
    pub(super) q: ArrayView4<'a, F>,
    pub(super) k: ArrayView4<'a, F>,
    pub(super) v: ArrayView4<'a, F>,
}

/// Up to this many rows, [`project`] sums scaled rows of the weights
/// instead of calling a matrix product.
const FEW_ROWS: usize = 4;

/// `x` `[batch, len, width]` `· w` `[width, cols]` `+ b`, as one matrix
/// product over all positions of all batch items (`x` is copied first only
/// when its layout does not allow viewing it as `[batch·len, width]`).
pub(super) fn project<F: Element>(
    x: ArrayView3<'_, F>,
    w: &Array2<F>,
    b: Option<&Array1<F>>,
) -> Result<Array3<F>, AttentionError> {
    let (batch, len, width) = x.dim();
    let columns = w.ncols();
    // The result is reshaped to this, so it must be addressable too.
    addressable::<F>("a projection [batch, len, columns]", &[batch, len, columns])?;
    let x = contiguous("a layer input [batch, len, width]", x)?;
    let rows = x
        .view()
        .into_shape_with_order((batch * len, width))
        .map_err(reshape_error)?;
    let mut out = zeros("a projection [batch·len, columns]", (rows.nrows(), columns))?;
    if rows.nrows() <= FEW_ROWS && w.is_standard_layout() {
        // out[i] = Σ_r x[i, r]·w[r, ..]: reads `w` once, row by row, where
        // a matrix product would first copy all of it into packed panels.
        // Decoding steps project one or a few rows at a time.
        for (x_column, w_row) in rows.columns().into_iter().zip(w.rows()) {
            for (&x, mut out_row) in x_column.iter().zip(out.rows_mut()) {
                out_row.scaled_add(x, &w_row);
            }
        }
    } else {
        // β = 0: `out` is only written.
        general_mat_mul(F::one(), &rows, w, F::zero(), &mut out);
    }
    if let Some(b) = b {
        // `rhs` broadcasts over the rows.
        out.zip_mut_with(b, |o, &bias| *o = *o + bias);
    }
    out.into_shape_with_order((batch, len, w.ncols()))
        .map_err(reshape_error)
}

/// [`try_zeros`], after checking that ndarray can address the shape.
fn zeros<F: Element, Sh: IntoDimension>(
    what: &str,
    shape: Sh,
) -> Result<Array<F, Sh::Dim>, AttentionError> {
    let dim = shape.into_dimension();
    addressable::<F>(what, dim.slice())?;
    try_zeros(what, dim)
}

/// Checks that ndarray can address an array of shape `dims`: the product
/// of its nonzero lengths, in bytes, within `isize::MAX`, even when one
/// length is zero (an empty batch of huge broadcast inputs).
fn addressable<F>(what: &str, dims: &[usize]) -> Result<(), AttentionError> {
    element_count::<F>(what, dims).map(|_| ())
}

/// `x` itself when it is in standard (row-major, contiguous) layout;
/// otherwise [`copied`].
fn contiguous<'v, F: Element>(
    what: &str,
    x: ArrayView3<'v, F>,
) -> Result<CowArray<'v, F, Ix3>, AttentionError> {
    if x.is_standard_layout() {
        Ok(x.into())
    } else {
        copied(what, x).map(CowArray::from)
    }
}

/// A copy of `x` in standard layout, allocated fallibly: a broadcast view
/// may be far larger than its memory.
pub(super) fn copied<F: Element>(
    what: &str,
    x: ArrayView3<'_, F>,
) -> Result<Array3<F>, AttentionError> {
    let mut data = try_with_capacity(what, x.len())?;
    // `iter` walks in logical (row-major) order whatever the layout.
    data.extend(x.iter().copied());
    Array3::from_shape_vec(x.raw_dim(), data).map_err(reshape_error)
}

/// `[batch, len, heads·d]` as `[batch, heads, len, d]`, a view of the same data.
pub(super) fn split_heads<F>(
    x: &Array3<F>,
    heads: usize,
) -> Result<ArrayView4<'_, F>, AttentionError> {
    let (batch, len, width) = x.dim();
    let split = x
        .view()
        .into_shape_with_order((batch, len, heads, width / heads))
        .map_err(reshape_error)?;
    Ok(split.permuted_axes([0, 2, 1, 3]))
}

/// [`split_heads`], writable.
pub(super) fn split_heads_mut<F>(
    x: &mut Array3<F>,
    heads: usize,
) -> Result<ArrayViewMut4<'_, F>, AttentionError> {
    let (batch, len, width) = x.dim();
    let split = x
        .view_mut()
        .into_shape_with_order((batch, len, heads, width / heads))
        .map_err(reshape_error)?;
    Ok(split.permuted_axes([0, 2, 1, 3]))
}

/// The element counts always agree, so a reshape cannot fail; report it as
/// an error rather than panic should that ever change.
pub(super) fn reshape_error(err: ShapeError) -> AttentionError {
    shape_error(format!("internal reshape of x failed: {err}"))
}
