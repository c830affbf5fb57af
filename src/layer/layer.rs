//! [`Layer`]: the one multi-head attention implementation both public
//! layer types wrap. It owns the config and the weights and does the
//! projections, the head split and merge and the output projection; the
//! attention itself is [`crate::scaled_dot_product_attention_into`] (or the
//! [`KvCache`]'s incremental form of it), so the layers hold no attention
//! math of their own.
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

use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, ArrayView4, Axis, ShapeError};

use super::config::{AttentionConfig, AttentionWeights, describe_config};
use super::init::{SplitMix64, xavier_uniform};
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::kv_cache::KvCache;
use crate::options::AttentionOptions;

/// A layer's output and, when asked for, its per-head weights
/// `[batch, heads, len_q, len_kv]`.
pub(crate) type Forward<F, D> = (ndarray::Array<F, D>, Option<Array4<F>>);

/// The weights and the computation every layer type shares.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Layer<F> {
    pub(crate) config: AttentionConfig,
    pub(crate) weights: AttentionWeights<F>,
}

impl<F: Element> Layer<F> {
    pub(crate) fn new(
        config: AttentionConfig,
        weights: AttentionWeights<F>,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        weights.check(&config)?;
        Ok(Self { config, weights })
    }

    /// The seed's single-head layer, its config read off the weights' shapes.
    pub(crate) fn from_single_head_weights(
        w_q: Array2<F>,
        w_k: Array2<F>,
        w_v: Array2<F>,
    ) -> Result<Self, AttentionError> {
        let (qs, ks, vs) = (w_q.shape(), w_k.shape(), w_v.shape());
        let layouts = || {
            format!(
                "w_q {qs:?} = [d_model, d_k], w_k {ks:?} = [d_model, d_k], \
                 w_v {vs:?} = [d_model, d_v]"
            )
        };
        if ks[0] != qs[0] || vs[0] != qs[0] {
            return Err(shape_error(format!(
                "the weights disagree on d_model (rows): {}",
                layouts()
            )));
        }
        if ks[1] != qs[1] {
            return Err(shape_error(format!(
                "w_q and w_k disagree on d_k (columns): {}",
                layouts()
            )));
        }
        let config = AttentionConfig::new(qs[0], qs[1], vs[1]);
        config
            .check()
            .map_err(|err| AttentionError::new(err.kind(), format!("{}: {}", err, layouts())))?;
        Ok(Self {
            config,
            weights: AttentionWeights::new(w_q, w_k, w_v),
        })
    }

    /// Xavier-uniform weights from one SplitMix64 stream: `W^Q`, `W^K`,
    /// `W^V`, then `W^O`, each row by row; zero biases.
    pub(crate) fn new_seeded(config: AttentionConfig, seed: u64) -> Result<Self, AttentionError> {
        config.check()?;
        let mut rng = SplitMix64::new(seed);
        let mut draw = |(rows, cols): (usize, usize)| xavier_uniform::<F>(&mut rng, rows, cols);
        let mut weights = AttentionWeights::new(
            draw(config.w_q_dim()),
            draw(config.w_k_dim()),
            draw(config.w_v_dim()),
        );
        weights.w_o = config.w_o_dim().map(&mut draw);
        if config.bias {
            let zeros = |(_, cols): (usize, usize)| Array1::zeros(cols);
            weights.b_q = Some(zeros(config.w_q_dim()));
            weights.b_k = Some(zeros(config.w_k_dim()));
            weights.b_v = Some(zeros(config.w_v_dim()));
            weights.b_o = config.w_o_dim().map(zeros);
        }
        Ok(Self { config, weights })
    }

    /// Self-attention over one sequence `[len, d_model]`, as batch item 0
    /// of a batch of 1.
    pub(crate) fn forward(
        &self,
        x: ndarray::ArrayView2<'_, F>,
        opts: &AttentionOptions<'_, F>,
        want_weights: bool,
    ) -> Result<Forward<F, ndarray::Ix2>, AttentionError> {
        // Checked here so the message speaks of the caller's 2-D shape.
        self.check_query_width("x", x.shape(), "[len, d_model]")?;
        let (out, weights) = self.forward_batch(x.insert_axis(Axis(0)), opts, want_weights)?;
        Ok((out.remove_axis(Axis(0)), weights))
    }

    /// Self-attention over a batch `[batch, len, d_model]`.
    pub(crate) fn forward_batch(
        &self,
        x: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        want_weights: bool,
    ) -> Result<Forward<F, ndarray::Ix3>, AttentionError> {
        self.check_query_width("x", x.shape(), "[batch, len, d_model]")?;
        self.check_self_attention()?;
        let projected = self.project_all(x, x)?;
        self.attend(&projected, opts, want_weights)
    }

    /// Cross-attention: queries from `x_q` `[batch, len_q, d_model]`, keys
    /// and values from `x_kv` `[batch, len_kv, d_model_kv]`.
    pub(crate) fn forward_cross(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
        opts: &AttentionOptions<'_, F>,
        want_weights: bool,
    ) -> Result<Forward<F, ndarray::Ix3>, AttentionError> {
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
        let projected = self.project_all(x_q, x_kv)?;
        self.attend(&projected, opts, want_weights)
    }

    /// Starts a new sequence in `cache` with the prompt `x`
    /// `[batch, len, d_model]`: the cache is cleared (only once the
    /// arguments are checked), then [`step`](Self::step).
    pub(crate) fn prefill(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        cache.clear();
        self.step(x, cache)
    }

    /// The newest positions `x` `[batch, len_new, d_model]` of the sequences
    /// `cache` holds: appends their keys and values to it and attends their
    /// queries to everything cached (see [`KvCache::attend`]).
    pub(crate) fn step(
        &self,
        x: ArrayView3<'_, F>,
        cache: &mut KvCache<F>,
    ) -> Result<Array3<F>, AttentionError> {
        self.check_step(x, cache)?;
        let projected = self.project_all(x, x)?;
        let Heads { q, k, v } = self.split_all(&projected)?;
        let (batch, len_new, _) = projected.q.dim();
        let mut heads_out = Array4::zeros((batch, len_new, self.config.heads, self.config.d_v));
        cache.attend_into(q, k, v, heads_out.view_mut().permuted_axes([0, 2, 1, 3]))?;
        self.output(heads_out)
    }

    /// An empty cache shaped for this layer: growing, or a ring of `window`.
    pub(crate) fn new_cache(
        &self,
        batch: usize,
        capacity: usize,
        window: Option<usize>,
    ) -> KvCache<F> {
        let c = &self.config;
        KvCache::allocate(batch, c.kv_heads, c.d_k, c.d_v, capacity, window)
    }

    fn check_step(&self, x: ArrayView3<'_, F>, cache: &KvCache<F>) -> Result<(), AttentionError> {
        self.check_query_width("x", x.shape(), "[batch, len_new, d_model]")?;
        let c = &self.config;
        let batch = x.len_of(Axis(0));
        if cache.batch() != batch
            || cache.kv_heads() != c.kv_heads
            || cache.d_k() != c.d_k
            || cache.d_v() != c.d_v
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
                c.d_k,
                c.d_v
            )));
        }
        Ok(())
    }

    /// `x_q · W^Q + b_q`, `x_kv · W^K + b_k`, `x_kv · W^V + b_v`.
    pub(super) fn project_all(
        &self,
        x_q: ArrayView3<'_, F>,
        x_kv: ArrayView3<'_, F>,
    ) -> Result<Projected<F>, AttentionError> {
        let w = &self.weights;
        Ok(Projected {
            q: project(x_q, &w.w_q, w.b_q.as_ref())?,
            k: project(x_kv, &w.w_k, w.b_k.as_ref())?,
            v: project(x_kv, &w.w_v, w.b_v.as_ref())?,
        })
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

    /// Attention of the projected `q` over `k`, `v`, then the output
    /// projection; the weights too when asked.
    fn attend(
        &self,
        projected: &Projected<F>,
        opts: &AttentionOptions<'_, F>,
        want_weights: bool,
    ) -> Result<Forward<F, ndarray::Ix3>, AttentionError> {
        let Heads { q, k, v } = self.split_all(projected)?;
        let (batch, len_q, _) = projected.q.dim();
        // Laid out [batch, len_q, heads, d_v] and written through a
        // [batch, heads, len_q, d_v] view, so the concatenated heads need no copy.
        let mut heads_out = Array4::zeros((batch, len_q, self.config.heads, self.config.d_v));
        crate::scaled_dot_product_attention_into(
            q,
            k,
            v,
            opts,
            heads_out.view_mut().permuted_axes([0, 2, 1, 3]),
        )?;
        let weights = if want_weights {
            Some(crate::core::attention_weights(q, k, opts)?)
        } else {
            None
        };
        Ok((self.output(heads_out)?, weights))
    }

    /// `[batch, len, heads, d_v]` → concatenated `[batch, len, heads·d_v]`
    /// → `· W^O + b_o` when there is an output projection.
    fn output(&self, heads_out: Array4<F>) -> Result<Array3<F>, AttentionError> {
        let (batch, len, heads, d_v) = heads_out.dim();
        let concatenated = heads_out
            .into_shape_with_order((batch, len, heads * d_v))
            .map_err(reshape_error)?;
        match &self.weights.w_o {
            None => Ok(concatenated),
            Some(w_o) => project(concatenated.view(), w_o, self.weights.b_o.as_ref()),
        }
    }

    pub(super) fn check_self_attention(&self) -> Result<(), AttentionError> {
        if self.config.kv_input_width() != self.config.d_model {
            return Err(shape_error(format!(
                "self-attention needs d_model_kv = d_model, but {}: this is a cross-attention \
                 layer, call forward_cross",
                describe_config(&self.config)
            )));
        }
        Ok(())
    }

    pub(crate) fn check_query_width(
        &self,
        name: &str,
        shape: &[usize],
        layout: &str,
    ) -> Result<(), AttentionError> {
        self.check_width(name, shape, layout, "d_model", self.config.d_model)
    }

    pub(super) fn check_kv_width(
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
            let w = &self.weights;
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
/// product over all positions of all batch items; `to_shape` is a view
/// when the layout allows it.
pub(super) fn project<F: Element>(
    x: ArrayView3<'_, F>,
    w: &Array2<F>,
    b: Option<&Array1<F>>,
) -> Result<Array3<F>, AttentionError> {
    let (batch, len, width) = x.dim();
    let rows = x.to_shape((batch * len, width)).map_err(reshape_error)?;
    let mut out = if rows.nrows() <= FEW_ROWS && w.is_standard_layout() {
        // out[i] = Σ_r x[i, r]·w[r, ..]: reads `w` once, row by row, where
        // a matrix product would first copy all of it into packed panels.
        // Decoding steps project one or a few rows at a time.
        let mut out = Array2::zeros((rows.nrows(), w.ncols()));
        for (x_column, w_row) in rows.columns().into_iter().zip(w.rows()) {
            for (&x, mut out_row) in x_column.iter().zip(out.rows_mut()) {
                out_row.scaled_add(x, &w_row);
            }
        }
        out
    } else {
        rows.dot(w)
    };
    if let Some(b) = b {
        // `rhs` broadcasts over the rows.
        out.zip_mut_with(b, |o, &bias| *o = *o + bias);
    }
    out.into_shape_with_order((batch, len, w.ncols()))
        .map_err(reshape_error)
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

/// The element counts always agree, so a reshape cannot fail; report it as
/// an error rather than panic should that ever change.
pub(super) fn reshape_error(err: ShapeError) -> AttentionError {
    shape_error(format!("internal reshape of x failed: {err}"))
}
