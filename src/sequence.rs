//! Attention on one sequence as 2-D views: the seed's simplest
//! self-attention without projections ([`simple_self_attention`]) and a
//! `[len, d]` convenience over the 4-D functional API
//! ([`single_sequence_attention`]).
//!
//! Both only reshape their views (no copies) and call
//! [`crate::scaled_dot_product_attention`], so they take whatever path that
//! function takes for the element type; they hold no attention math of their own.

use ndarray::{Array2, ArrayView2, ArrayView4, Axis};

use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};
use crate::options::AttentionOptions;

/// The seed's simplest self-attention, with no learned projections:
/// `y_i = Σ_j softmax_j(x_i · x_j) x_j`.
///
/// `x` is `[len, d]`, one input vector per row; the result is `[len, d]`.
/// Each input is its own query, key and value. The scores are the **raw**
/// dot products `x_i · x_j`, with no `1/√d` scaling (scale 1), as in the
/// seed's first formula; for the scaled form call
/// [`single_sequence_attention`]`(x, x, x, &AttentionOptions::new())`.
/// With `causal` the sum runs over `j ≤ i` (as
/// [`AttentionOptions::causal`]); without, over every `j`.
///
/// An empty sequence (`len == 0`) gives an empty `[0, d]` output.
///
/// # Errors
/// [`ErrorKind::ZeroDimension`] when `d == 0`.
///
/// ```
/// use ndarray::array;
/// use sdpa::simple_self_attention;
///
/// let x = array![[1.0_f64, 0.0], [0.0, 1.0], [1.0, 1.0]];
/// let causal = true;
/// let y = simple_self_attention(x.view(), causal)?;
/// // The first position sees only itself.
/// assert_eq!(y.row(0), x.row(0));
/// // The third: scores 1, 1, 2, so weights ∝ e, e, e².
/// let e = 1.0_f64.exp();
/// let sum = 2.0 * e + e * e;
/// assert!((y[[2, 0]] - (e + e * e) / sum).abs() < 1e-12);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn simple_self_attention<F: Element>(
    x: ArrayView2<'_, F>,
    causal: bool,
) -> Result<Array2<F>, AttentionError> {
    if x.ncols() == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!("x has shape {:?} = [len, d]; d must be positive", x.shape()),
        ));
    }
    let opts = AttentionOptions::new().scale(F::one());
    let opts = if causal { opts.causal() } else { opts };
    single_sequence_attention(x, x, x, &opts)
}

/// Scaled dot-product attention on one sequence and one head, as 2-D views.
///
/// - `q`: `[len_q, d_k]`
/// - `k`: `[len_kv, d_k]`
/// - `v`: `[len_kv, d_v]`
/// - returns `[len_q, d_v]`
///
/// The views are reshaped to `[1, 1, len, d]` without copying and passed to
/// [`crate::scaled_dot_product_attention`], so every option means what it
/// means there, with `batch = heads = 1`: a keep mask or bias has shape
/// `[1, 1, len_q, len_kv]` (any of the last two may be 1 to broadcast, so
/// `[1, 1, 1, len_kv]` masks keys), and `key_lengths` takes exactly one length.
/// Views of any strides are accepted.
///
/// # Errors
/// An [`AttentionError`] naming the shapes when `d_k == 0`
/// ([`ErrorKind::ZeroDimension`]), `q` and `k` disagree on `d_k` or `k` and
/// `v` on `len_kv` ([`ErrorKind::ShapeMismatch`]), or the options do not fit
/// (a mask or bias that does not broadcast to `[1, 1, len_q, len_kv]`, a
/// key length count other than 1 or a length past `len_kv`, a non-finite scale).
///
/// ```
/// use ndarray::{array, Array4};
/// use sdpa::{single_sequence_attention, AttentionOptions};
///
/// let q = array![[1.0_f32, 1.0]];                           // one query
/// let k = array![[1.0_f32, 0.0], [0.0, 1.0], [1.0, 1.0]];   // three keys
/// let v = array![[1.0_f32, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]];
/// // Hide the second key.
/// let keep = Array4::from_shape_vec((1, 1, 1, 3), vec![true, false, true]).unwrap();
/// let opts = AttentionOptions::new().keep_mask(keep.view());
/// let y = single_sequence_attention(q.view(), k.view(), v.view(), &opts)?;
/// assert_eq!(y.shape(), &[1, 3]);
/// assert_eq!(y[[0, 1]], 0.0);
/// assert!((y.sum() - 1.0).abs() < 1e-6);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn single_sequence_attention<F: Element>(
    q: ArrayView2<'_, F>,
    k: ArrayView2<'_, F>,
    v: ArrayView2<'_, F>,
    opts: &AttentionOptions<'_, F>,
) -> Result<Array2<F>, AttentionError> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    // Checked here so the messages speak of the caller's 2-D shapes, not of
    // the [1, 1, len, d] views passed on.
    let layouts =
        || format!("q {qs:?} = [len_q, d_k], k {ks:?} = [len_kv, d_k], v {vs:?} = [len_kv, d_v]");
    if qs[1] == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!("d_k must be positive: {}", layouts()),
        ));
    }
    if ks[1] != qs[1] {
        return Err(shape_error(format!("d_k of q and k differ: {}", layouts())));
    }
    if vs[0] != ks[0] {
        return Err(shape_error(format!(
            "len_kv of k and v differ: {}",
            layouts()
        )));
    }
    let out = crate::scaled_dot_product_attention(
        one_sequence(q),
        one_sequence(k),
        one_sequence(v),
        opts,
    )?;
    Ok(out.remove_axis(Axis(0)).remove_axis(Axis(0)))
}

/// `[len, d]` as `[batch = 1, heads = 1, len, d]`, a view of the same data.
fn one_sequence<F>(x: ArrayView2<'_, F>) -> ArrayView4<'_, F> {
    x.insert_axis(Axis(0)).insert_axis(Axis(0))
}
