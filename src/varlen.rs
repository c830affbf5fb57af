//! Packed variable-length batches: sequences of different lengths
//! concatenated along the token axis and described by `cu_seqlens`
//! offsets, as FlashAttention's `flash_attn_varlen_func` and candle's
//! `flash_attn_varlen_cpu` take them. No padding is stored or computed.
//!
//! ```text
//! q: [total_q,  heads,    d_k]   sequence s owns rows cu_seqlens_q[s]  .. cu_seqlens_q[s + 1]
//! k: [total_kv, kv_heads, d_k]   and rows cu_seqlens_kv[s] .. cu_seqlens_kv[s + 1] of k and v
//! v: [total_kv, kv_heads, d_v]
//! out: [total_q, heads, d_v],  log-sum-exp: [total_q, heads]
//! ```
//!
//! Each sequence is attended to on its own and sees only its own keys.
//! Its `[len, heads, d]` rows are viewed, without a copy, as a
//! `[1, heads, len, d]` call of the 4-D API, which goes through the same
//! check and the same path ([`Element`]: fused for `f32`, [`core`](crate::core)
//! for `f64`) as [`scaled_dot_product_attention`](crate::scaled_dot_product_attention),
//! and writes straight into its rows of the packed output. So every
//! sequence's result is bitwise that of the 4-D call on its rows (viewed
//! so; the fused path picks its decode driver by the keys' strides, so a
//! copy with other strides may differ in the last bit), and every option
//! means per sequence what it means there:
//!
//! - `scale`, `softcap`: the same for every sequence.
//! - `causal` (either alignment) and `window`: per sequence, with its own
//!   `len_q` and `len_kv` (bottom-right: query `i` of sequence `s` sees its
//!   keys `j ≤ i + len_kv_s − len_q_s`).
//! - `alibi`: positions within the sequence (`p_i = i + len_kv_s − len_q_s`,
//!   keys at `0..len_kv_s`).
//! - `sinks`: every sequence's rows count the sink; `d_sinks` is the sum
//!   over the sequences.
//! - `keep_mask`, `bias`, `key_lengths`, `key_starts` and `key_shard` are rejected
//!   ([`ErrorKind::InvalidOption`]): each has a batch axis or a key axis of
//!   the padded `[batch, …, len_kv]` layout, which a packed batch does not
//!   have, and none has one obvious meaning here (`cu_seqlens_kv` already
//!   gives each sequence's keys; ALiBi is an option of its own).
//!
//! Sequences are work items of their own: with the `rayon` feature they
//! run in parallel, one sequence per task, and each call splits its own
//! work further as the 4-D API does. Many short sequences thus keep every
//! thread busy, and since each sequence is computed the same way whichever
//! thread runs it (and `d_sinks` is summed in sequence order), the result
//! is bitwise identical for any thread count. The kernel set the calling
//! thread would use ([`crate::simd::with_kernel_set`]) is forced on every
//! thread that runs a sequence.
//!
//! Everything that can be checked is checked before any output is written:
//! the shapes, the offsets (start at 0, non-decreasing, end at the token
//! count, as many for the queries as for the keys) and the options (once,
//! on a call with no tokens, so an empty batch reports bad options too).
//!
//! Above the call check, beside the functional entry points of `lib.rs`:
//! it imports the call check, the sealed element paths, the sink gradients,
//! the thread split and the kernel-set choice, never a path's internals.

use std::ops::Range;

use ndarray::{
    Array1, Array2, Array3, ArrayView2, ArrayView3, ArrayView4, ArrayViewMut, ArrayViewMut2,
    ArrayViewMut3, ArrayViewMut4, Axis, Dimension, Slice,
};

use crate::alloc::{self, try_zeros};
use crate::call::{self, BackwardCall};
use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};
use crate::gradients::GradientsViewMut;
use crate::options::AttentionOptions;
use crate::parallel::map_with;
use crate::simd::{self, KernelSet};

/// The result of a packed forward that the backward needs: the output
/// `[total_q, heads, d_v]` and each row's log-sum-exp of its visible
/// scaled scores, `[total_q, heads]` (`−inf` for a row that sees no key;
/// with sinks, the sink counted).
///
/// Made by [`scaled_dot_product_attention_varlen_partial`] (or written
/// again by [`scaled_dot_product_attention_varlen_partial_into`]), or from
/// received arrays with [`from_parts`](Self::from_parts); taken by
/// [`scaled_dot_product_attention_varlen_backward`] and its `_into`.
#[derive(Debug, Clone, PartialEq)]
pub struct VarlenPartial<F> {
    output: Array3<F>,
    log_sum_exp: Array2<F>,
}

impl<F: Element> VarlenPartial<F> {
    /// A partial from its two arrays, e.g. kept from an earlier forward.
    ///
    /// # Errors
    /// When `log_sum_exp` is not `[total_q, heads]` of `output`.
    pub fn from_parts(output: Array3<F>, log_sum_exp: Array2<F>) -> Result<Self, AttentionError> {
        let o = output.shape();
        if log_sum_exp.shape() != &o[..2] {
            return Err(shape_error(format!(
                "log_sum_exp has shape {:?} but output {o:?} needs [total_q, heads] = {:?}",
                log_sum_exp.shape(),
                &o[..2]
            )));
        }
        Ok(Self {
            output,
            log_sum_exp,
        })
    }

    /// The attention output, `[total_q, heads, d_v]`.
    pub fn output(&self) -> ArrayView3<'_, F> {
        self.output.view()
    }

    /// Each row's log-sum-exp, `[total_q, heads]`.
    pub fn log_sum_exp(&self) -> ArrayView2<'_, F> {
        self.log_sum_exp.view()
    }

    /// The two arrays.
    pub fn into_parts(self) -> (Array3<F>, Array2<F>) {
        (self.output, self.log_sum_exp)
    }

    /// The attention output, `[total_q, heads, d_v]`.
    pub fn into_output(self) -> Array3<F> {
        self.output
    }
}

/// The gradients of a scalar loss with respect to the inputs of a packed
/// attention call, from [`scaled_dot_product_attention_varlen_backward`]
/// (or written again by [`scaled_dot_product_attention_varlen_backward_into`]),
/// in the packed layouts of the inputs. With grouped-query attention, `d_k`
/// and `d_v` of a key/value head are summed over the query heads that
/// share it.
#[derive(Debug, Clone, PartialEq)]
pub struct VarlenGradients<F> {
    /// `∂L/∂q`, `[total_q, heads, d_k]`.
    pub d_q: Array3<F>,
    /// `∂L/∂k`, `[total_kv, kv_heads, d_k]`.
    pub d_k: Array3<F>,
    /// `∂L/∂v`, `[total_kv, kv_heads, d_v]`.
    pub d_v: Array3<F>,
    /// `∂L/∂sinks`, one per query head, summed over the sequences, when the
    /// options had [`sinks`](crate::AttentionOptions::sinks); `None`
    /// otherwise.
    pub d_sinks: Option<Array1<F>>,
}

/// Scaled dot-product attention over a packed batch of sequences of
/// different lengths, each attending only to its own keys (see the
/// [module documentation](self) for the layout and what each option means
/// per sequence).
///
/// - `q`: `[total_q, heads, d_k]`, the queries of every sequence, one after
///   the other
/// - `k`: `[total_kv, kv_heads, d_k]`, `v`: `[total_kv, kv_heads, d_v]`,
///   with `heads % kv_heads == 0` (GQA/MQA)
/// - `cu_seqlens_q`, `cu_seqlens_kv`: `batch + 1` offsets each, starting at
///   0, non-decreasing, ending at `total_q` (`total_kv`): sequence `s` has
///   queries `cu_seqlens_q[s] .. cu_seqlens_q[s + 1]` and keys
///   `cu_seqlens_kv[s] .. cu_seqlens_kv[s + 1]`. Empty sequences are valid
///   (a sequence with queries but no keys outputs zeros).
/// - returns `[total_q, heads, d_v]`
///
/// Sequence `s`'s rows of the result are bitwise those of
/// [`scaled_dot_product_attention`](crate::scaled_dot_product_attention) on
/// its rows alone (as `[1, heads, len, d]` views), for any thread count.
/// Views of any strides are accepted.
///
/// # Errors
/// An [`AttentionError`] naming the argument and the values when
/// - the shapes disagree, `d_k`, `heads` or `kv_heads` is 0 or `heads` is
///   not a multiple of `kv_heads` (as in the 4-D API);
/// - an offsets slice is empty, does not start at 0, decreases (naming the
///   index and both values) or does not end at the token count, or the two
///   have different lengths ([`ErrorKind::SequenceOffsets`]);
/// - the options ask for a keep mask, bias, key lengths or key shard
///   ([`ErrorKind::InvalidOption`], see the module documentation), or are
///   bad as in the 4-D API (a non-finite scale, a window of 0, a wrong
///   number of ALiBi slopes or sinks, a bad softcap).
///
/// ```
/// use ndarray::{Array3, ArrayView4, Axis, s};
/// use sdpa::{scaled_dot_product_attention, scaled_dot_product_attention_varlen, AttentionOptions};
///
/// // Three sequences of 3, 0 and 5 tokens, 2 heads of width 4, packed.
/// let cu_seqlens = [0, 3, 3, 8];
/// let q = Array3::<f32>::from_shape_fn((8, 2, 4), |(t, h, d)| ((t + 2 * h + 3 * d) % 7) as f32 * 0.2 - 0.6);
/// let (k, v) = (q.mapv(|x| x * 0.5), q.mapv(|x| 1.0 - x));
/// let opts = AttentionOptions::new().causal();
/// let out = scaled_dot_product_attention_varlen(
///     q.view(), k.view(), v.view(), &cu_seqlens, &cu_seqlens, &opts)?;
/// assert_eq!(out.shape(), &[8, 2, 4]);
///
/// // The last sequence alone, as a [1, heads, len, d] call, gives its rows.
/// fn alone(x: &Array3<f32>) -> ArrayView4<'_, f32> {
///     x.slice(s![3..8, .., ..]).permuted_axes([1, 0, 2]).insert_axis(Axis(0))
/// }
/// let expected = scaled_dot_product_attention(alone(&q), alone(&k), alone(&v), &opts)?;
/// assert_eq!(alone(&out), expected);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_varlen<F: Element>(
    q: ArrayView3<'_, F>,
    k: ArrayView3<'_, F>,
    v: ArrayView3<'_, F>,
    cu_seqlens_q: &[usize],
    cu_seqlens_kv: &[usize],
    opts: &AttentionOptions<'_, F>,
) -> Result<Array3<F>, AttentionError> {
    let packed = check(&q, &k, &v, cu_seqlens_q, cu_seqlens_kv, opts)?;
    let mut out = try_zeros("the output", packed.output_dim())?;
    forward(&packed, opts, [q, k, v], out.view_mut(), None)?;
    Ok(out)
}

/// [`scaled_dot_product_attention_varlen`] writing into a caller's buffer
/// `out` (`[total_q, heads, d_v]`, any strides); allocates no output.
///
/// # Errors
/// As [`scaled_dot_product_attention_varlen`], and when `out` does not have
/// the output's shape; nothing is written then. (A working buffer that
/// cannot be allocated is reported after other sequences may have been
/// written.)
///
/// ```
/// use ndarray::Array3;
/// use sdpa::{scaled_dot_product_attention_varlen_into, AttentionOptions};
///
/// // Two sequences: 2 queries against 3 keys, and 1 query against 2 keys.
/// let q = Array3::<f64>::ones((3, 4, 8));
/// let kv = Array3::<f64>::ones((5, 2, 8));
/// let mut out = Array3::<f64>::zeros((3, 4, 8));
/// scaled_dot_product_attention_varlen_into(
///     q.view(), kv.view(), kv.view(), &[0, 2, 3], &[0, 3, 5], &AttentionOptions::new(), out.view_mut())?;
/// assert!(out.iter().all(|&x| (x - 1.0).abs() < 1e-12));
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_varlen_into<F: Element>(
    q: ArrayView3<'_, F>,
    k: ArrayView3<'_, F>,
    v: ArrayView3<'_, F>,
    cu_seqlens_q: &[usize],
    cu_seqlens_kv: &[usize],
    opts: &AttentionOptions<'_, F>,
    out: ArrayViewMut3<'_, F>,
) -> Result<(), AttentionError> {
    let packed = check(&q, &k, &v, cu_seqlens_q, cu_seqlens_kv, opts)?;
    packed.check_output("out", out.shape())?;
    forward(&packed, opts, [q, k, v], out, None)
}

/// [`scaled_dot_product_attention_varlen`] keeping each row's log-sum-exp:
/// the forward result [`scaled_dot_product_attention_varlen_backward`]
/// takes.
///
/// # Errors
/// As [`scaled_dot_product_attention_varlen`].
///
/// ```
/// use ndarray::Array3;
/// use sdpa::{scaled_dot_product_attention_varlen_partial, AttentionOptions};
///
/// let x = Array3::<f64>::zeros((5, 1, 2));
/// let forward = scaled_dot_product_attention_varlen_partial(
///     x.view(), x.view(), x.view(), &[0, 2, 5], &[0, 2, 5], &AttentionOptions::new())?;
/// // All scores 0: each row's log-sum-exp is ln(its sequence's key count).
/// assert!((forward.log_sum_exp()[[1, 0]] - 2f64.ln()).abs() < 1e-15);
/// assert!((forward.log_sum_exp()[[4, 0]] - 3f64.ln()).abs() < 1e-15);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_varlen_partial<F: Element>(
    q: ArrayView3<'_, F>,
    k: ArrayView3<'_, F>,
    v: ArrayView3<'_, F>,
    cu_seqlens_q: &[usize],
    cu_seqlens_kv: &[usize],
    opts: &AttentionOptions<'_, F>,
) -> Result<VarlenPartial<F>, AttentionError> {
    let packed = check(&q, &k, &v, cu_seqlens_q, cu_seqlens_kv, opts)?;
    let mut output = try_zeros("the output", packed.output_dim())?;
    let mut log_sum_exp = try_zeros("the log-sum-exp", (packed.total_q, packed.heads))?;
    let lse = Some(log_sum_exp.view_mut());
    forward(&packed, opts, [q, k, v], output.view_mut(), lse)?;
    Ok(VarlenPartial {
        output,
        log_sum_exp,
    })
}

/// [`scaled_dot_product_attention_varlen_partial`] writing into a caller's
/// `partial` (an earlier step's, or one made with
/// [`VarlenPartial::from_parts`]; any layout): a training loop that keeps
/// it allocates no result and faults no new pages in on each step (see
/// [`scaled_dot_product_attention_partial_into`](crate::scaled_dot_product_attention_partial_into)).
///
/// # Errors
/// As [`scaled_dot_product_attention_varlen`], and when `partial`'s output
/// is not `[total_q, heads, d_v]`. Every error named there leaves `partial`
/// unchanged (all is checked before anything is written); only a kernel
/// set the CPU lacks or a working buffer that cannot be allocated may
/// leave it partly written.
///
/// ```
/// use ndarray::{Array2, Array3};
/// use sdpa::{scaled_dot_product_attention_varlen_partial, scaled_dot_product_attention_varlen_partial_into, AttentionOptions, VarlenPartial};
///
/// let x = Array3::<f64>::from_shape_fn((5, 1, 2), |(t, _, d)| (t + d) as f64 * 0.1);
/// let (cu, opts) = ([0, 2, 5], AttentionOptions::new());
/// let mut kept = VarlenPartial::from_parts(Array3::zeros((5, 1, 2)), Array2::zeros((5, 1)))?;
/// scaled_dot_product_attention_varlen_partial_into(
///     x.view(), x.view(), x.view(), &cu, &cu, &opts, &mut kept)?;
/// let fresh = scaled_dot_product_attention_varlen_partial(
///     x.view(), x.view(), x.view(), &cu, &cu, &opts)?;
/// assert_eq!(kept, fresh);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn scaled_dot_product_attention_varlen_partial_into<F: Element>(
    q: ArrayView3<'_, F>,
    k: ArrayView3<'_, F>,
    v: ArrayView3<'_, F>,
    cu_seqlens_q: &[usize],
    cu_seqlens_kv: &[usize],
    opts: &AttentionOptions<'_, F>,
    partial: &mut VarlenPartial<F>,
) -> Result<(), AttentionError> {
    let packed = check(&q, &k, &v, cu_seqlens_q, cu_seqlens_kv, opts)?;
    // `from_parts` made the log-sum-exp `[total_q, heads]` of the output.
    packed.check_output("partial's output", partial.output.shape())?;
    forward(
        &packed,
        opts,
        [q, k, v],
        partial.output.view_mut(),
        Some(partial.log_sum_exp.view_mut()),
    )
}

/// The gradients of a scalar loss with respect to `q`, `k`, `v` (and the
/// sinks) of a packed attention call, given the call's result `forward`
/// (from [`scaled_dot_product_attention_varlen_partial`]) and `d_out`, the
/// gradient of the loss with respect to the output, `[total_q, heads, d_v]`.
///
/// `q`, `k`, `v`, the offsets and `opts` are the forward's, unchanged; the
/// weights are recomputed from the log-sum-exp. Each sequence runs
/// [`scaled_dot_product_attention_backward`](crate::scaled_dot_product_attention_backward)'s
/// path on its rows (fused for `f32`, the reference for `f64`), writing its
/// rows of `d_q`, `d_k` and `d_v`; so they are bitwise that call's, for any
/// thread count. Keys of a sequence no query sees (a sequence with no
/// queries) get zero gradients, and `d_sinks` is the sum over the sequences.
///
/// # Errors
/// As [`scaled_dot_product_attention_varlen`], and when the forward's
/// output or `d_out` is not `[total_q, heads, d_v]`.
///
/// ```
/// use ndarray::Array3;
/// use sdpa::{scaled_dot_product_attention_varlen_backward, scaled_dot_product_attention_varlen_partial, AttentionOptions};
///
/// let (cu_q, cu_kv) = ([0, 2, 7], [0, 4, 9]);
/// let q = Array3::<f32>::from_shape_fn((7, 2, 8), |(t, h, d)| ((h + 3 * t + d) % 7) as f32 * 0.2 - 0.5);
/// let k = Array3::<f32>::from_shape_fn((9, 1, 8), |(t, _, d)| ((t + 2 * d) % 5) as f32 * 0.3 - 0.6);
/// let v = k.mapv(|x| 1.0 - x);
/// let opts = AttentionOptions::new().causal();
/// let forward = scaled_dot_product_attention_varlen_partial(q.view(), k.view(), v.view(), &cu_q, &cu_kv, &opts)?;
/// // The loss is the sum of the outputs, so its gradient is all ones.
/// let d_out = Array3::<f32>::ones(forward.output().raw_dim());
/// let grads = scaled_dot_product_attention_varlen_backward(
///     q.view(), k.view(), v.view(), &cu_q, &cu_kv, &opts, &forward, d_out.view())?;
/// assert_eq!(grads.d_k.shape(), k.shape());
/// // Each row's weights sum to 1, so the gradients with respect to v sum
/// // to the number of output entries.
/// assert!((grads.d_v.sum() - 7.0 * 2.0 * 8.0).abs() < 1e-3);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
// The forward's six arguments, its result and `d_out`, as in the 4-D
// backward: grouping the offsets into a type of their own would make the
// packed calls read unlike FlashAttention's for this one function.
#[allow(clippy::too_many_arguments)]
pub fn scaled_dot_product_attention_varlen_backward<F: Element>(
    q: ArrayView3<'_, F>,
    k: ArrayView3<'_, F>,
    v: ArrayView3<'_, F>,
    cu_seqlens_q: &[usize],
    cu_seqlens_kv: &[usize],
    opts: &AttentionOptions<'_, F>,
    forward: &VarlenPartial<F>,
    d_out: ArrayView3<'_, F>,
) -> Result<VarlenGradients<F>, AttentionError> {
    let packed = check_backward(
        [&q, &k, &v],
        [cu_seqlens_q, cu_seqlens_kv],
        opts,
        forward,
        &d_out,
    )?;
    let mut gradients = VarlenGradients {
        d_q: try_zeros("d_q", q.raw_dim())?,
        d_k: try_zeros("d_k", k.raw_dim())?,
        d_v: try_zeros("d_v", v.raw_dim())?,
        d_sinks: None,
    };
    backward(&packed, opts, [q, k, v], forward, d_out, &mut gradients)?;
    Ok(gradients)
}

/// [`scaled_dot_product_attention_varlen_backward`] writing into a caller's
/// `gradients` (an earlier step's, of any layout): every entry of `d_q`,
/// `d_k` and `d_v` is overwritten (keys no query sees get zeros), and
/// `d_sinks` is replaced. A training loop that keeps them allocates no
/// gradients and faults no new pages in on each step (see
/// [`scaled_dot_product_attention_backward_into`](crate::scaled_dot_product_attention_backward_into)).
///
/// # Errors
/// As [`scaled_dot_product_attention_varlen_backward`], and when `d_q`,
/// `d_k` or `d_v` does not have its input's shape. Every error named there
/// leaves `gradients` unchanged (all is checked before anything is
/// written); only a kernel set the CPU lacks or a working buffer that
/// cannot be allocated may leave them partly written.
///
/// ```
/// use ndarray::Array3;
/// use sdpa::{scaled_dot_product_attention_varlen_backward, scaled_dot_product_attention_varlen_backward_into, scaled_dot_product_attention_varlen_partial, AttentionOptions};
///
/// let (cu_q, cu_kv) = ([0, 2, 5], [0, 3, 6]);
/// let q = Array3::<f32>::from_shape_fn((5, 2, 4), |(t, h, d)| ((t + 2 * h + d) % 5) as f32 * 0.3 - 0.6);
/// let kv = Array3::<f32>::from_shape_fn((6, 1, 4), |(t, _, d)| ((2 * t + d) % 7) as f32 * 0.2 - 0.5);
/// let opts = AttentionOptions::new().causal();
/// let forward = scaled_dot_product_attention_varlen_partial(q.view(), kv.view(), kv.view(), &cu_q, &cu_kv, &opts)?;
/// let d_out = Array3::<f32>::ones(forward.output().raw_dim());
/// let mut grads = scaled_dot_product_attention_varlen_backward(
///     q.view(), kv.view(), kv.view(), &cu_q, &cu_kv, &opts, &forward, d_out.view())?;
/// let first = grads.clone();
/// // The next step reuses the arrays.
/// scaled_dot_product_attention_varlen_backward_into(
///     q.view(), kv.view(), kv.view(), &cu_q, &cu_kv, &opts, &forward, d_out.view(), &mut grads)?;
/// assert_eq!(grads, first);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
// As the allocating call, and the caller's gradients.
#[allow(clippy::too_many_arguments)]
pub fn scaled_dot_product_attention_varlen_backward_into<F: Element>(
    q: ArrayView3<'_, F>,
    k: ArrayView3<'_, F>,
    v: ArrayView3<'_, F>,
    cu_seqlens_q: &[usize],
    cu_seqlens_kv: &[usize],
    opts: &AttentionOptions<'_, F>,
    forward: &VarlenPartial<F>,
    d_out: ArrayView3<'_, F>,
    gradients: &mut VarlenGradients<F>,
) -> Result<(), AttentionError> {
    let packed = check_backward(
        [&q, &k, &v],
        [cu_seqlens_q, cu_seqlens_kv],
        opts,
        forward,
        &d_out,
    )?;
    call::check_gradient_shapes([
        ("d_q", gradients.d_q.shape(), "q", q.shape()),
        ("d_k", gradients.d_k.shape(), "k", k.shape()),
        ("d_v", gradients.d_v.shape(), "v", v.shape()),
    ])?;
    backward(&packed, opts, [q, k, v], forward, d_out, gradients)
}

/// A packed call whose arguments agree: its offsets and dimensions.
struct Packed<'a> {
    cu_seqlens_q: &'a [usize],
    cu_seqlens_kv: &'a [usize],
    total_q: usize,
    heads: usize,
    d_v: usize,
}

impl Packed<'_> {
    /// `[total_q, heads, d_v]`, the output's shape.
    fn output_dim(&self) -> (usize, usize, usize) {
        (self.total_q, self.heads, self.d_v)
    }

    /// Sequence `s` of the packed `q`, `k` and `v` as a 4-D call's
    /// inputs, with its query rows (to slice the arrays shaped like `q`).
    fn sequence<'v, F>(
        &self,
        s: usize,
        [q, k, v]: [ArrayView3<'v, F>; 3],
    ) -> (Range<usize>, [ArrayView4<'v, F>; 3]) {
        let queries = self.cu_seqlens_q[s]..self.cu_seqlens_q[s + 1];
        let keys = self.cu_seqlens_kv[s]..self.cu_seqlens_kv[s + 1];
        let inputs = [as_call(q, &queries), as_call(k, &keys), as_call(v, &keys)];
        (queries, inputs)
    }

    /// Checks that the array `name` has exactly the output's shape.
    fn check_output(&self, name: &str, got: &[usize]) -> Result<(), AttentionError> {
        let (t, h, d) = self.output_dim();
        if got != [t, h, d] {
            return Err(shape_error(format!(
                "{name} has shape {got:?} but the output is [total_q, heads, d_v] = {:?}",
                [t, h, d]
            )));
        }
        Ok(())
    }
}

/// Checks a packed call: the options this layout does not take, the
/// shapes, the offsets, then the options as the 4-D check sees them.
fn check<'a, F: Element>(
    q: &ArrayView3<'_, F>,
    k: &ArrayView3<'_, F>,
    v: &ArrayView3<'_, F>,
    cu_seqlens_q: &'a [usize],
    cu_seqlens_kv: &'a [usize],
    opts: &AttentionOptions<'_, F>,
) -> Result<Packed<'a>, AttentionError> {
    reject_padded_options(opts)?;
    let shape = call::check_shapes(&call::PACKED, q.shape(), k.shape(), v.shape())?;
    check_offsets(
        "cu_seqlens_q",
        cu_seqlens_q,
        "q has",
        "total_q",
        shape.len_q,
    )?;
    check_offsets(
        "cu_seqlens_kv",
        cu_seqlens_kv,
        "k and v have",
        "total_kv",
        shape.len_kv,
    )?;
    if cu_seqlens_q.len() != cu_seqlens_kv.len() {
        return Err(AttentionError::new(
            ErrorKind::SequenceOffsets,
            format!(
                "cu_seqlens_q has {} offsets ({} sequences) but cu_seqlens_kv has {} \
                 ({} sequences): each sequence has a query range and a key range",
                cu_seqlens_q.len(),
                cu_seqlens_q.len() - 1,
                cu_seqlens_kv.len(),
                cu_seqlens_kv.len() - 1
            ),
        ));
    }
    // The options as every sequence's call sees them, checked once on a
    // sequence with no tokens: they do not depend on the lengths, and this
    // way an empty batch reports them too.
    let no_tokens = 0..0;
    let (q0, k0, v0) = (
        as_call(*q, &no_tokens),
        as_call(*k, &no_tokens),
        as_call(*v, &no_tokens),
    );
    call::check(&q0, &k0, &v0, opts)?;
    Ok(Packed {
        cu_seqlens_q,
        cu_seqlens_kv,
        total_q: shape.len_q,
        heads: shape.heads,
        d_v: shape.d_v,
    })
}

/// Checks a packed backward call: the forward's arguments ([`check`]),
/// then the forward's output and `d_out` against the output's shape.
fn check_backward<'a, F: Element>(
    [q, k, v]: [&ArrayView3<'_, F>; 3],
    [cu_seqlens_q, cu_seqlens_kv]: [&'a [usize]; 2],
    opts: &AttentionOptions<'_, F>,
    forward: &VarlenPartial<F>,
    d_out: &ArrayView3<'_, F>,
) -> Result<Packed<'a>, AttentionError> {
    let packed = check(q, k, v, cu_seqlens_q, cu_seqlens_kv, opts)?;
    packed.check_output("the forward's output", forward.output.shape())?;
    packed.check_output("d_out", d_out.shape())?;
    Ok(packed)
}

/// The options that describe the padded `[batch, …, len_kv]` layout are
/// errors on a packed batch.
fn reject_padded_options<F>(opts: &AttentionOptions<'_, F>) -> Result<(), AttentionError> {
    let keep_mask = opts.keep_mask.is_some() || opts.keep_mask_given.error.is_some();
    let bias = opts.bias.is_some() || opts.bias_given.error.is_some();
    let why = if keep_mask {
        "keep_mask is not supported on a packed batch: its [batch, heads, len_q, len_kv] \
         axes are those of a padded batch; use causal or window, or a 4-D call per sequence"
    } else if bias {
        "bias is not supported on a packed batch: its [batch, heads, len_q, len_kv] axes \
         are those of a padded batch; use alibi (positions per sequence), or a 4-D call \
         per sequence"
    } else if opts.key_lengths.is_some() || opts.key_starts.is_some() {
        "key_lengths and key_starts are not supported on a packed batch: cu_seqlens_kv \
         already gives each sequence's keys, so pack only the keys a sequence attends to"
    } else if opts.key_shard.is_some() {
        "key_shard is not supported on a packed batch: a shard's offset and total \
         length place the keys of one sequence, and a packed batch has many"
    } else {
        return Ok(());
    };
    Err(AttentionError::new(ErrorKind::InvalidOption, why))
}

/// Checks that `offsets` (`name`) are `batch + 1` offsets into `total`
/// rows (`rows` says whose, as "q has"): starting at 0, non-decreasing,
/// ending at `total`.
fn check_offsets(
    name: &str,
    offsets: &[usize],
    rows: &str,
    total_name: &str,
    total: usize,
) -> Result<(), AttentionError> {
    let error = |message: String| AttentionError::new(ErrorKind::SequenceOffsets, message);
    let Some((&first, &last)) = offsets.first().zip(offsets.last()) else {
        return Err(error(format!(
            "{name} is empty: it needs batch + 1 offsets, from 0 to {total_name} = {total}"
        )));
    };
    if first != 0 {
        return Err(error(format!("{name}[0] = {first} but must be 0")));
    }
    if let Some(s) = offsets.windows(2).position(|pair| pair[1] < pair[0]) {
        return Err(error(format!(
            "{name}[{}] = {} is less than {name}[{s}] = {}: offsets must not decrease",
            s + 1,
            offsets[s + 1],
            offsets[s]
        )));
    }
    if last != total {
        return Err(error(format!(
            "{name}[{}] = {last} but {rows} {total_name} = {total} rows: the last offset \
             is the row count",
            offsets.len() - 1,
        )));
    }
    Ok(())
}

/// Attention over every sequence of a checked call, into `out` (and
/// `log_sum_exp`), one sequence per work item.
fn forward<F: Element>(
    packed: &Packed<'_>,
    opts: &AttentionOptions<'_, F>,
    [q, k, v]: [ArrayView3<'_, F>; 3],
    out: ArrayViewMut3<'_, F>,
    log_sum_exp: Option<ArrayViewMut2<'_, F>>,
) -> Result<(), AttentionError> {
    let out = split_at_offsets(out, packed.cu_seqlens_q)?;
    let log_sum_exp = match log_sum_exp {
        Some(lse) => split_at_offsets(lse, packed.cu_seqlens_q)?
            .into_iter()
            .map(Some)
            .collect(),
        None => (0..out.len()).map(|_| None).collect::<Vec<_>>(),
    };
    let items = out.into_iter().zip(log_sum_exp).enumerate().collect();
    let kernel_set = simd::current_kernel_set().ok();
    map_with(
        items,
        || (),
        |_, (s, (out, log_sum_exp))| {
            on_kernel_set(kernel_set, || {
                let (_, [q, k, v]) = packed.sequence(s, [q, k, v]);
                let call = call::check(&q, &k, &v, opts)?;
                F::forward(
                    &call,
                    as_call_mut(out),
                    log_sum_exp.map(log_sum_exp_as_call_mut),
                )
            })
        },
    )
    .into_iter()
    .collect()
}

/// The packed backward of a checked call into `gradients` of the inputs'
/// shapes: each sequence runs the 4-D backward's path on its rows, which
/// writes every entry of its views; `d_sinks` is replaced.
fn backward<F: Element>(
    packed: &Packed<'_>,
    opts: &AttentionOptions<'_, F>,
    [q, k, v]: [ArrayView3<'_, F>; 3],
    forward: &VarlenPartial<F>,
    d_out: ArrayView3<'_, F>,
    gradients: &mut VarlenGradients<F>,
) -> Result<(), AttentionError> {
    // Allocated before anything is written: a failure leaves the
    // gradients as they were.
    let mut sinks_sum = match opts.sinks {
        Some(_) => Some(try_zeros::<F, _, _>("d_sinks", packed.heads)?),
        None => None,
    };
    let VarlenGradients {
        d_q,
        d_k,
        d_v,
        d_sinks,
    } = gradients;
    let items = split_at_offsets(d_q.view_mut(), packed.cu_seqlens_q)?
        .into_iter()
        .zip(split_at_offsets(d_k.view_mut(), packed.cu_seqlens_kv)?)
        .zip(split_at_offsets(d_v.view_mut(), packed.cu_seqlens_kv)?)
        .enumerate()
        .map(|(s, ((d_q, d_k), d_v))| (s, d_q, d_k, d_v))
        .collect();
    let kernel_set = simd::current_kernel_set().ok();
    let (out, log_sum_exp) = (forward.output.view(), forward.log_sum_exp.view());
    let d_sinks_per_sequence = map_with(
        items,
        || (),
        |_, (s, d_q, d_k, d_v)| {
            on_kernel_set(kernel_set, || {
                let (queries, [q, k, v]) = packed.sequence(s, [q, k, v]);
                let (out, d_out) = (as_call(out, &queries), as_call(d_out, &queries));
                let log_sum_exp = log_sum_exp_as_call(log_sum_exp, &queries);
                let call = BackwardCall {
                    forward: call::check(&q, &k, &v, opts)?,
                    out,
                    log_sum_exp,
                    d_out,
                };
                // Each backward path writes every entry of its views,
                // zeros where no query sees a key.
                let gradients = GradientsViewMut {
                    d_q: as_call_mut(d_q),
                    d_k: as_call_mut(d_k),
                    d_v: as_call_mut(d_v),
                    d_bias: None,
                };
                F::backward(&call, gradients)?;
                crate::modifiers::sink_gradients(&call)
            })
        },
    );
    // Summed in sequence order, so the sum is the same for any thread count.
    for sequence in d_sinks_per_sequence {
        if let (Some(sum), Some(sequence)) = (sinks_sum.as_mut(), sequence?) {
            sum.zip_mut_with(&sequence, |total, &x| *total = *total + x);
        }
    }
    *d_sinks = sinks_sum;
    Ok(())
}

/// Runs `work` with `set` forced, when the calling thread chose one: the
/// work may run on another thread, whose own choice could differ (see
/// [`simd::with_kernel_set`]). With no set (`SDPA_KERNEL` is bad), `work`
/// runs as it is and an `f32` call reports the error itself.
fn on_kernel_set<R>(
    set: Option<KernelSet>,
    work: impl FnOnce() -> Result<R, AttentionError>,
) -> Result<R, AttentionError> {
    match set {
        Some(set) => simd::with_kernel_set(set, work)?,
        None => work(),
    }
}

/// Rows `rows` of a packed `[total, heads, d]` view as the
/// `[1, heads, len, d]` view of one sequence, without a copy.
fn as_call<'a, F>(x: ArrayView3<'a, F>, rows: &Range<usize>) -> ArrayView4<'a, F> {
    x.slice_axis_move(Axis(0), Slice::from(rows.clone()))
        .permuted_axes([1, 0, 2])
        .insert_axis(Axis(0))
}

/// [`as_call`] of a sequence's own mutable rows, `[len, heads, d]`.
fn as_call_mut<F>(x: ArrayViewMut3<'_, F>) -> ArrayViewMut4<'_, F> {
    x.permuted_axes([1, 0, 2]).insert_axis(Axis(0))
}

/// Rows `rows` of a packed `[total_q, heads]` log-sum-exp as one
/// sequence's `[1, heads, len]`.
fn log_sum_exp_as_call<'a, F>(x: ArrayView2<'a, F>, rows: &Range<usize>) -> ArrayView3<'a, F> {
    x.slice_axis_move(Axis(0), Slice::from(rows.clone()))
        .reversed_axes()
        .insert_axis(Axis(0))
}

/// [`log_sum_exp_as_call`] of a sequence's own mutable rows, `[len, heads]`.
fn log_sum_exp_as_call_mut<F>(x: ArrayViewMut2<'_, F>) -> ArrayViewMut3<'_, F> {
    x.reversed_axes().insert_axis(Axis(0))
}

/// `view` split along axis 0 into the rows of each sequence: piece `s` is
/// rows `offsets[s] .. offsets[s + 1]`. The offsets are checked (they
/// start at 0, do not decrease and end at the row count).
fn split_at_offsets<'a, A, D: Dimension>(
    mut view: ArrayViewMut<'a, A, D>,
    offsets: &[usize],
) -> Result<Vec<ArrayViewMut<'a, A, D>>, AttentionError> {
    let mut pieces = alloc::try_with_capacity("the sequences", offsets.len().saturating_sub(1))?;
    for pair in offsets.windows(2) {
        let (piece, rest) = view.split_at(Axis(0), pair[1] - pair[0]);
        pieces.push(piece);
        view = rest;
    }
    Ok(pieces)
}
