//! Checks an attention call's arguments against each other, once, before
//! any path runs, and hands the paths one checked value: [`Call`] for a
//! forward, [`BackwardCall`] for a backward. After the check every index
//! the paths compute is in bounds.
//!
//! Below both paths: it imports only the options and the error type.

use ndarray::{
    ArrayBase, ArrayView2, ArrayView3, ArrayView4, ArrayViewMut2, Axis, Data, DataMut, Ix4,
};

use crate::alloc;
use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};
use crate::options::AttentionOptions;

/// The dimensions of a checked attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttentionShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub len_q: usize,
    pub len_kv: usize,
    pub d_k: usize,
    pub d_v: usize,
}

impl AttentionShape {
    /// Query heads per key/value head (GQA/MQA).
    #[inline]
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The key/value head that query head `h` reads: consecutive groups of
    /// `heads / kv_heads` query heads share one key/value head.
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group()
    }

    /// `[batch, heads, len_q, d_v]`, the output's shape.
    pub fn output_dim(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.heads, self.len_q, self.d_v)
    }
}

/// A forward call whose arguments agree with each other: the inputs, the
/// options, the dimensions and the scale to use. It borrows what the caller
/// passed, under one lifetime (ndarray's views are invariant in theirs, so
/// the views and options are reborrowed rather than moved).
///
/// The keys and values are stored in `KV` and the queries in `Q`: the
/// compute type `F` itself, except for half-precision calls, whose keys
/// and values stay in `bf16`/`f16` (widened tile by tile, or packed as
/// they are), and whose queries do too (a half call's, widened as a query
/// tile loads them) or are `f32` (a half `KvCache` attended from `f32`
/// projections).
#[derive(Debug, Clone)]
pub(crate) struct Call<'a, F, KV = F, Q = F> {
    pub q: ArrayView4<'a, Q>,
    pub k: ArrayView4<'a, KV>,
    pub v: ArrayView4<'a, KV>,
    pub opts: AttentionOptions<'a, F>,
    pub shape: AttentionShape,
    pub scale: F,
}

/// A backward call: the forward's call, its result and `d_out`, all of the
/// forward's output shape.
#[derive(Debug, Clone)]
pub(crate) struct BackwardCall<'a, F> {
    pub forward: Call<'a, F>,
    pub out: ArrayView4<'a, F>,
    pub log_sum_exp: ArrayView3<'a, F>,
    pub d_out: ArrayView4<'a, F>,
}

/// Checks `q`, `k`, `v` and the options against each other.
pub(crate) fn check<'a, F: Element, KV, Q>(
    q: &'a ArrayView4<'_, Q>,
    k: &'a ArrayView4<'_, KV>,
    v: &'a ArrayView4<'_, KV>,
    opts: &'a AttentionOptions<'_, F>,
) -> Result<Call<'a, F, KV, Q>, AttentionError> {
    let shape = check_shapes(&PADDED, q.shape(), k.shape(), v.shape())?;
    let layouts = || (PADDED.describe)(q.shape(), k.shape(), v.shape());
    let total_len_kv = match opts.key_shard {
        Some(shard) if shard.total_len_kv > isize::MAX as usize => {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!(
                    "key_shard: total_len_kv = {} is past isize::MAX: {}",
                    shard.total_len_kv,
                    layouts()
                ),
            ));
        }
        Some(shard)
            if shard
                .offset
                .checked_add(shape.len_kv)
                .is_none_or(|end| end > shard.total_len_kv) =>
        {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!(
                    "key_shard: {} keys from offset {} do not fit in total_len_kv = {}: {}",
                    shape.len_kv,
                    shard.offset,
                    shard.total_len_kv,
                    layouts()
                ),
            ));
        }
        Some(shard) => shard.total_len_kv,
        None => shape.len_kv,
    };
    for given in [&opts.keep_mask_given, &opts.bias_given] {
        if let Some(error) = &given.error {
            return Err(error.clone());
        }
    }
    let full = [shape.batch, shape.heads, shape.len_q, total_len_kv];
    if let Some(mask) = &opts.keep_mask {
        check_broadcast("keep_mask", mask.shape(), opts.keep_mask_given.rank, &full)?;
    }
    if let Some(bias) = &opts.bias {
        check_broadcast("bias", bias.shape(), opts.bias_given.rank, &full)?;
    }
    for (name, given) in [
        ("key_lengths", opts.key_lengths),
        ("key_starts", opts.key_starts),
    ] {
        let Some(lengths) = given else { continue };
        if lengths.len() != shape.batch {
            return Err(AttentionError::new(
                ErrorKind::KeyLengths,
                format!(
                    "{name} has {} entries but batch is {}: {}",
                    lengths.len(),
                    shape.batch,
                    layouts()
                ),
            ));
        }
        if let Some((b, &len)) = lengths
            .iter()
            .enumerate()
            .find(|&(_, &len)| len > total_len_kv)
        {
            return Err(AttentionError::new(
                ErrorKind::KeyLengths,
                format!(
                    "{name}[{b}] = {len} is past len_kv = {}: {}",
                    total_len_kv,
                    layouts()
                ),
            ));
        }
    }
    if opts.window == Some(0) {
        return Err(AttentionError::new(
            ErrorKind::InvalidOption,
            "window must be at least 1 key, got 0",
        ));
    }
    crate::modifiers::check(opts, &shape)?;
    // Every result has this many elements or fewer per head dimension; a
    // view with huge broadcast lengths could describe more than fits.
    let (b, h, l, d) = shape.output_dim();
    alloc::element_count::<F>("the output", &[b, h, l, d])?;
    let scale = match opts.scale {
        Some(s) if !s.is_finite() => {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!("scale must be finite, got {s}"),
            ));
        }
        Some(s) => s,
        None => F::one() / F::from(shape.d_k).unwrap_or_else(F::one).sqrt(),
    };
    Ok(Call {
        q: q.view(),
        k: k.view(),
        v: v.view(),
        opts: opts.reborrow(),
        shape,
        scale,
    })
}

/// Where a layout keeps each dimension of `q`, `k` and `v`: the padded
/// `[batch, heads, len, d]` of the 4-D calls, or the packed
/// `[total, heads, d]` of the varlen calls. One check serves both.
pub(crate) struct Layout {
    /// The batch axis; a packed layout has none (its shape's batch is 1).
    batch: Option<usize>,
    heads: usize,
    len: usize,
    d: usize,
    /// What the layout calls the key length axis: `len_kv` or `total_kv`.
    len_kv_name: &'static str,
    /// The shapes of `q`, `k` and `v` with their axes named, for messages.
    describe: fn(&[usize], &[usize], &[usize]) -> String,
}

/// The 4-D layout: `[batch, heads, len, d]`.
pub(crate) const PADDED: Layout = Layout {
    batch: Some(0),
    heads: 1,
    len: 2,
    d: 3,
    len_kv_name: "len_kv",
    describe: |qs, ks, vs| {
        format!(
            "q {qs:?} = [batch, heads, len_q, d_k], k {ks:?} = [batch, kv_heads, len_kv, d_k], \
             v {vs:?} = [batch, kv_heads, len_kv, d_v]"
        )
    },
};

/// The packed layout of the varlen calls: `[total, heads, d]`.
pub(crate) const PACKED: Layout = Layout {
    batch: None,
    heads: 1,
    len: 0,
    d: 2,
    len_kv_name: "total_kv",
    describe: |qs, ks, vs| {
        format!(
            "q {qs:?} = [total_q, heads, d_k], k {ks:?} = [total_kv, kv_heads, d_k], \
             v {vs:?} = [total_kv, kv_heads, d_v]"
        )
    },
};

/// The dimensions of `q`, `k` and `v` laid out as `layout` says, if they
/// agree.
pub(crate) fn check_shapes(
    layout: &Layout,
    qs: &[usize],
    ks: &[usize],
    vs: &[usize],
) -> Result<AttentionShape, AttentionError> {
    let layouts = || (layout.describe)(qs, ks, vs);
    let Layout { heads, len, d, .. } = *layout;
    if let Some(b) = layout.batch
        && (ks[b] != qs[b] || vs[b] != qs[b])
    {
        return Err(shape_error(format!("batch sizes differ: {}", layouts())));
    }
    if qs[d] == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!("d_k must be positive: {}", layouts()),
        ));
    }
    if ks[d] != qs[d] {
        return Err(shape_error(format!("d_k of q and k differ: {}", layouts())));
    }
    if vs[heads] != ks[heads] {
        return Err(shape_error(format!(
            "kv_heads of k and v differ: {}",
            layouts()
        )));
    }
    if vs[len] != ks[len] {
        return Err(shape_error(format!(
            "{} of k and v differ: {}",
            layout.len_kv_name,
            layouts()
        )));
    }
    if qs[heads] == 0 || ks[heads] == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!("heads and kv_heads must be positive: {}", layouts()),
        ));
    }
    if !qs[heads].is_multiple_of(ks[heads]) {
        return Err(AttentionError::new(
            ErrorKind::HeadsNotDivisible,
            format!(
                "heads ({}) must be a multiple of kv_heads ({}): {}",
                qs[heads],
                ks[heads],
                layouts()
            ),
        ));
    }
    Ok(AttentionShape {
        batch: layout.batch.map_or(1, |b| qs[b]),
        heads: qs[heads],
        kv_heads: ks[heads],
        len_q: qs[len],
        len_kv: ks[len],
        d_k: qs[d],
        d_v: vs[d],
    })
}

/// Checks that `out` (named `what` in the error) has exactly the output's shape.
pub(crate) fn check_output(
    what: &str,
    shape: &AttentionShape,
    out: &[usize],
) -> Result<(), AttentionError> {
    let (b, h, l, d) = shape.output_dim();
    if out != [b, h, l, d] {
        return Err(shape_error(format!(
            "{what} has shape {out:?} but the output is [batch, heads, len_q, d_v] = {:?}",
            [b, h, l, d]
        )));
    }
    Ok(())
}

/// Checks that the gradient arrays a caller passes have their inputs'
/// shapes, each given as `(gradient, its shape, input, the input's shape)`:
/// `d_q`, `d_k` and `d_v` of the 4-D and the packed `_into` backward.
pub(crate) fn check_gradient_shapes(
    pairs: [(&str, &[usize], &str, &[usize]); 3],
) -> Result<(), AttentionError> {
    for (name, got, input, expected) in pairs {
        if got != expected {
            return Err(shape_error(format!(
                "{name} has shape {got:?} but {input} has shape {expected:?}"
            )));
        }
    }
    Ok(())
}

/// Checks that a caller's `d_bias` is there, in the bias's shape, exactly
/// when the options have a bias.
pub(crate) fn check_bias_gradient(
    d_bias: Option<&[usize]>,
    bias: Option<&[usize]>,
) -> Result<(), AttentionError> {
    if d_bias != bias {
        return Err(shape_error(format!(
            "d_bias is {} but the options' bias is {}",
            d_bias.map_or("None".into(), |s| format!("of shape {s:?}")),
            bias.map_or("None".into(), |s| format!("of shape {s:?}")),
        )));
    }
    Ok(())
}

/// Checks a backward call: the forward's arguments ([`check`]), then the
/// forward's result (`out` and its `log_sum_exp`) and `d_out` against the
/// forward's output shape.
pub(crate) fn check_backward<'a, F: Element>(
    forward: Call<'a, F>,
    out: &'a ArrayView4<'_, F>,
    log_sum_exp: &'a ArrayView3<'_, F>,
    d_out: &'a ArrayView4<'_, F>,
) -> Result<BackwardCall<'a, F>, AttentionError> {
    let (b, h, l, d) = forward.shape.output_dim();
    let expected = [b, h, l, d];
    for (name, got) in [
        ("the forward's output", out.shape()),
        ("d_out", d_out.shape()),
        ("the forward's log-sum-exp", log_sum_exp.shape()),
    ] {
        let expected = &expected[..got.len().min(4)];
        if got != expected {
            return Err(shape_error(format!(
                "{name} has shape {got:?} but the call's output is \
                 [batch, heads, len_q, d_v] = {:?} (q {:?}, v {:?})",
                [b, h, l, d],
                forward.q.shape(),
                forward.v.shape()
            )));
        }
    }
    Ok(BackwardCall {
        forward,
        out: out.view(),
        log_sum_exp: log_sum_exp.view(),
        d_out: d_out.view(),
    })
}

/// Checks that `got` (a mask or bias given in rank `given_rank`, padded on
/// the left to rank 4) broadcasts to `full`.
fn check_broadcast(
    name: &str,
    got: &[usize],
    given_rank: usize,
    full: &[usize; 4],
) -> Result<(), AttentionError> {
    let fits = got.iter().zip(full).all(|(&g, &f)| g == f || g == 1);
    if fits {
        return Ok(());
    }
    // Name the shape as the caller gave it, and the padding if any.
    let given = &got[4 - given_rank.min(4)..];
    let padded = if given_rank < 4 {
        format!(" (rank {given_rank}, broadcast from the right as {got:?})")
    } else {
        String::new()
    };
    Err(AttentionError::new(
        ErrorKind::NotBroadcastable,
        format!(
            "{name} has shape {given:?}{padded}, which does not broadcast to \
             [batch, heads, len_q, len_kv] = {full:?} (each dimension must match or be 1)"
        ),
    ))
}

/// The `[len, d]` matrix of batch item `b`, head `h`.
pub(crate) fn head<'v, F, S: Data<Elem = F>>(
    x: &'v ArrayBase<S, Ix4>,
    b: usize,
    h: usize,
) -> ArrayView2<'v, F> {
    x.index_axis(Axis(0), b).index_axis_move(Axis(0), h)
}

/// The mutable `[len, d]` matrix of batch item `b`, head `h`.
pub(crate) fn head_mut<'v, F, S: DataMut<Elem = F>>(
    x: &'v mut ArrayBase<S, Ix4>,
    b: usize,
    h: usize,
) -> ArrayViewMut2<'v, F> {
    x.index_axis_mut(Axis(0), b).index_axis_move(Axis(0), h)
}
