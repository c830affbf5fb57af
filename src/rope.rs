//! Rotary position embeddings (RoPE): each pair of features of a query or
//! key row is rotated by an angle proportional to the token's position, so
//! that `q·k` after the rotation depends on the positions only through
//! their difference.
//!
//! For a row `x` of `d` features at position `p`, with `r = rotary_dim`
//! (even, `≤ d`) and `θ` the base, pair `i < r/2` turns by
//! `p·ω_i`, `ω_i = θ^(−2i/r)`:
//!
//! ```text
//! (x_a, x_b) ← (x_a·cos − x_b·sin,  x_b·cos + x_a·sin)
//! half-split (GPT-NeoX, Llama): a = i,  b = i + r/2   (rotate_half)
//! interleaved (GPT-J):          a = 2i, b = 2i + 1    (rotate_every_two)
//! ```
//!
//! and features `r..d` pass through. The cosines and sines are computed in
//! `f64` once, for every position below `max_positions`, into a
//! [`RopeTable`], and rounded to the element type: the hot path (a decode
//! step rotates one row per head) only looks rows up and runs a loop over
//! contiguous slices the compiler vectorizes. The rotation is orthogonal, so
//! its backward is the rotation by the opposite angle.
//!
//! Below the attention paths and beside them: it touches only the element
//! type, the error type and fallible allocation.

use ndarray::{Array4, ArrayView2, ArrayView4, ArrayViewMut1, ArrayViewMut4, Axis};

use crate::alloc;
use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};

/// Which features of a row form the pairs that rotary embeddings rotate.
///
/// The two layouts are not interchangeable: weights trained with one give
/// wrong results with the other.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{apply_rope, RopeLayout, RopePositions, RopeTable};
///
/// // One row of 4 features at position 1, every angle 90°.
/// let x = Array4::<f64>::from_shape_vec((1, 1, 1, 4), vec![1.0, 2.0, 3.0, 4.0]).unwrap();
/// let quarter_turn = |layout| {
///     let angle = std::f64::consts::FRAC_PI_2;
///     let table = RopeTable::from_inverse_frequencies(&[angle, angle], 2)?.with_layout(layout);
///     apply_rope(x.view(), &table, RopePositions::Start(1))
/// };
/// let round = |a: Array4<f64>| a.iter().map(|v| v.round()).collect::<Vec<_>>();
/// // Half-split pairs (0, 2) and (1, 3): (1, 3) → (−3, 1), (2, 4) → (−4, 2).
/// assert_eq!(round(quarter_turn(RopeLayout::HalfSplit)?), [-3.0, -4.0, 1.0, 2.0]);
/// // Interleaved pairs (0, 1) and (2, 3): (1, 2) → (−2, 1), (3, 4) → (−4, 3).
/// assert_eq!(round(quarter_turn(RopeLayout::Interleaved)?), [-2.0, 1.0, -4.0, 3.0]);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum RopeLayout {
    /// Feature `i` pairs with feature `i + rotary_dim/2`: the first half of
    /// the rotary features holds the pairs' first coordinates. Hugging
    /// Face's `rotate_half`, used by GPT-NeoX, Llama, Mistral, Qwen2 and most
    /// models since.
    #[default]
    HalfSplit,
    /// Feature `2i` pairs with feature `2i + 1`: GPT-J's `rotate_every_two`
    /// (and the original RoFormer and Meta's Llama reference code, which
    /// rotates adjacent pairs as complex numbers).
    Interleaved,
}

/// The position of every token of a `[batch, heads, len, d]` tensor, for
/// [`apply_rope`].
///
/// With a KV cache, the `len` new tokens of a decode step start at the
/// cache's length: `RopePositions::Start(cache_len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePositions<'a> {
    /// Token `i` is at position `start + i`, in every batch item.
    Start(usize),
    /// Token `i` is at position `positions[i]`, in every batch item; one
    /// position per token (`len` of them).
    Tokens(&'a [usize]),
    /// Token `i` of batch item `b` is at position `starts[b] + i`: sequences
    /// of different lengths decoded together. One start per batch item.
    Starts(&'a [usize]),
    /// Token `i` of batch item `b` is at position `positions[[b, i]]`,
    /// Hugging Face's `position_ids`: shape `[batch, len]`, or `[1, len]` to
    /// share one row among the batch items.
    PerItem(ArrayView2<'a, usize>),
}

/// The cosines and sines of rotary position embeddings for every position
/// below `max_positions`: built once, then shared by every call (and every
/// decode step) that rotates with it.
///
/// `RopeTable::new(rotary_dim, theta, max_positions)` uses Hugging Face's
/// default frequencies, `inv_freq[i] = 1 / theta^(2i / rotary_dim)` for
/// `i < rotary_dim / 2`, and the [`RopeLayout::HalfSplit`] layout; the angle
/// of pair `i` at position `p` is `p · inv_freq[i]`. Frequencies, angles,
/// cosines and sines are computed in `f64` and rounded once to `F`, so an
/// `f32` table is correctly rounded where PyTorch's, computed in `f32`, is
/// off by up to about `p · 2⁻²⁴` at position `p`.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{apply_rope, RopePositions, RopeTable};
///
/// // Llama-style: head dim 64, all of it rotary, θ = 10000, up to 4096 tokens.
/// let table = RopeTable::<f32>::new(64, 10_000.0, 4096)?;
/// let q = Array4::<f32>::ones((1, 8, 16, 64));
/// let rotated = apply_rope(q.view(), &table, RopePositions::Start(0))?;
/// // Position 0 is not rotated.
/// assert_eq!(rotated.slice(ndarray::s![.., .., 0, ..]), q.slice(ndarray::s![.., .., 0, ..]));
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable<F> {
    layout: RopeLayout,
    rotary_dim: usize,
    max_positions: usize,
    /// `[max_positions, rotary_dim / 2]`, row `p` the cosines at position `p`.
    cos: Vec<F>,
    /// Likewise, the sines.
    sin: Vec<F>,
}

impl<F: Element> RopeTable<F> {
    /// The table for `rotary_dim` rotary features (even; the first
    /// `rotary_dim` features of each row rotate, the rest pass through),
    /// base `theta` (10000 in most models; Llama 3 uses 500000) and positions
    /// `0..max_positions`, in the [`RopeLayout::HalfSplit`] layout (change it
    /// with [`with_layout`](Self::with_layout)).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidOption`] when `rotary_dim` is odd or `theta` is
    /// not finite and positive; [`ErrorKind::TooLarge`] or
    /// [`ErrorKind::OutOfMemory`] when the table cannot be allocated.
    pub fn new(
        rotary_dim: usize,
        theta: f64,
        max_positions: usize,
    ) -> Result<Self, AttentionError> {
        if !rotary_dim.is_multiple_of(2) {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!("rotary_dim must be even (the features rotate in pairs), got {rotary_dim}"),
            ));
        }
        if !(theta.is_finite() && theta > 0.0) {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!("rotary theta must be finite and positive, got {theta}"),
            ));
        }
        // Hugging Face: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)).
        let inverse_frequencies: Vec<f64> = (0..rotary_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64))
            .collect();
        Self::from_inverse_frequencies(&inverse_frequencies, max_positions)
    }

    /// The table for the given inverse frequencies (radians per position,
    /// one per pair, so `rotary_dim = 2 · inverse_frequencies.len()`): for
    /// frequency schemes other than the default, such as Llama 3's or
    /// linear scaling, computed by the caller.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidOption`] when a frequency is not finite;
    /// [`ErrorKind::TooLarge`] or [`ErrorKind::OutOfMemory`] when the table
    /// cannot be allocated.
    pub fn from_inverse_frequencies(
        inverse_frequencies: &[f64],
        max_positions: usize,
    ) -> Result<Self, AttentionError> {
        if let Some(bad) = inverse_frequencies.iter().find(|f| !f.is_finite()) {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!("rotary inverse frequencies must be finite, got {bad}"),
            ));
        }
        let half = inverse_frequencies.len();
        let count = alloc::element_count::<F>("the rotary table", &[max_positions, half, 2])?;
        let mut cos = alloc::try_with_capacity("the rotary table", count / 2)?;
        let mut sin = alloc::try_with_capacity("the rotary table", count / 2)?;
        for position in 0..max_positions {
            for &frequency in inverse_frequencies {
                let (s, c) = (position as f64 * frequency).sin_cos();
                cos.push(F::from(c).unwrap_or_else(F::nan));
                sin.push(F::from(s).unwrap_or_else(F::nan));
            }
        }
        Ok(Self {
            layout: RopeLayout::HalfSplit,
            rotary_dim: 2 * half,
            max_positions,
            cos,
            sin,
        })
    }

    /// The same table with the features paired as `layout` says. Costs
    /// nothing: the cosines and sines do not depend on the layout.
    pub fn with_layout(mut self, layout: RopeLayout) -> Self {
        self.layout = layout;
        self
    }

    /// The layout the features are paired in.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// How many leading features of each row rotate.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// One past the last position the table holds.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The cosines of the `rotary_dim / 2` angles at `position`, if the
    /// table holds it.
    pub fn cos(&self, position: usize) -> Option<&[F]> {
        self.row(&self.cos, position)
    }

    /// The sines of the `rotary_dim / 2` angles at `position`, if the table
    /// holds it.
    pub fn sin(&self, position: usize) -> Option<&[F]> {
        self.row(&self.sin, position)
    }

    fn row<'t>(&self, values: &'t [F], position: usize) -> Option<&'t [F]> {
        let half = self.rotary_dim / 2;
        (position < self.max_positions).then(|| &values[position * half..(position + 1) * half])
    }
}

/// `x` (`[batch, heads, len, d]`, a query or key tensor, any strides) with
/// rotary position embeddings applied: the first `table.rotary_dim()`
/// features of each row rotated by its token's position, the rest copied.
///
/// # Errors
/// An [`AttentionError`] when `table.rotary_dim() > d`
/// ([`ErrorKind::ShapeMismatch`]), when the positions do not match the
/// batch or length of `x`, or a position is at or past
/// `table.max_positions()` ([`ErrorKind::Positions`]), or when the output
/// cannot be allocated.
///
/// ```
/// use ndarray::{Array4, s};
/// use sdpa::{apply_rope, RopePositions, RopeTable};
///
/// let table = RopeTable::<f64>::new(8, 10_000.0, 128)?;
/// let q = Array4::<f64>::from_shape_fn((1, 2, 3, 8), |(_, h, i, d)| (h + i + d) as f64 * 0.1);
/// let k = q.mapv(|x| 1.0 - x);
/// // Rotated at positions 0..3, and the same rows at positions 10..13.
/// let (q0, k0) = (apply_rope(q.view(), &table, RopePositions::Start(0))?, apply_rope(k.view(), &table, RopePositions::Start(0))?);
/// let (q10, k10) = (apply_rope(q.view(), &table, RopePositions::Start(10))?, apply_rope(k.view(), &table, RopePositions::Start(10))?);
/// // q·k depends only on the difference of positions: query 2 against key 0.
/// let dot = |a: &Array4<f64>, b: &Array4<f64>| (&a.slice(s![0, 0, 2, ..]) * &b.slice(s![0, 0, 0, ..])).sum();
/// assert!((dot(&q0, &k0) - dot(&q10, &k10)).abs() < 1e-12);
/// // Rotation preserves each row's length.
/// let norm = |a: ndarray::ArrayView1<f64>| a.dot(&a).sqrt();
/// assert!((norm(q10.slice(s![0, 1, 2, ..])) - norm(q.slice(s![0, 1, 2, ..]))).abs() < 1e-12);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn apply_rope<F: Element>(
    x: ArrayView4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) -> Result<Array4<F>, AttentionError> {
    rotated::<F, false>(x, table, positions)
}

/// [`apply_rope`] writing into a caller's buffer `out` of `x`'s shape (any
/// strides); allocates nothing.
///
/// # Errors
/// As [`apply_rope`], and when `out` does not have `x`'s shape.
pub fn apply_rope_into<F: Element>(
    x: ArrayView4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
    out: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    rotate_into::<F, false>(x, table, positions, out)
}

/// [`apply_rope`] in place: rotates `x` itself (any strides). The form for
/// a decode step, which rotates the new queries and keys before they enter
/// the cache.
///
/// # Errors
/// As [`apply_rope`]; `x` is left unchanged on error.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{apply_rope, apply_rope_inplace, RopePositions, RopeTable};
///
/// let table = RopeTable::<f32>::new(16, 10_000.0, 1024)?;
/// let mut k = Array4::<f32>::ones((1, 4, 1, 16)); // one new token per head
/// let copy = apply_rope(k.view(), &table, RopePositions::Start(57))?;
/// apply_rope_inplace(k.view_mut(), &table, RopePositions::Start(57))?; // cache length 57
/// assert_eq!(k, copy);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn apply_rope_inplace<F: Element>(
    x: ArrayViewMut4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) -> Result<(), AttentionError> {
    rotate_inplace::<F, false>(x, table, positions)
}

/// The backward of [`apply_rope`]: given `d_out`, the gradient of a loss
/// with respect to the rotated tensor, the gradient with respect to the
/// tensor before rotation. The rotation is orthogonal, so this is the
/// rotation by the opposite angles (`Rᵀ = R⁻¹`); the pass-through features'
/// gradients are copied.
///
/// # Errors
/// As [`apply_rope`], for `d_out`.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{apply_rope, apply_rope_backward, RopeLayout, RopePositions, RopeTable};
///
/// let table = RopeTable::<f64>::new(6, 10_000.0, 64)?.with_layout(RopeLayout::Interleaved);
/// let x = Array4::<f64>::from_shape_fn((2, 1, 4, 8), |(b, _, i, d)| (b + 2 * i + d) as f64 * 0.25 - 1.0);
/// let positions = RopePositions::Starts(&[3, 20]);
/// let y = apply_rope(x.view(), &table, positions)?;
/// // Undoing the rotation gives back x.
/// let back = apply_rope_backward(y.view(), &table, positions)?;
/// assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-12));
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub fn apply_rope_backward<F: Element>(
    d_out: ArrayView4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) -> Result<Array4<F>, AttentionError> {
    rotated::<F, true>(d_out, table, positions)
}

/// [`apply_rope_backward`] writing into a caller's buffer `d_x` of
/// `d_out`'s shape (any strides).
///
/// # Errors
/// As [`apply_rope_backward`], and when `d_x` does not have `d_out`'s shape.
pub fn apply_rope_backward_into<F: Element>(
    d_out: ArrayView4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
    d_x: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    rotate_into::<F, true>(d_out, table, positions, d_x)
}

/// [`apply_rope_backward`] in place: turns the gradient `d` with respect to
/// the rotated tensor into the gradient with respect to the tensor before
/// rotation.
///
/// # Errors
/// As [`apply_rope_backward`]; `d` is left unchanged on error.
pub fn apply_rope_backward_inplace<F: Element>(
    d: ArrayViewMut4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) -> Result<(), AttentionError> {
    rotate_inplace::<F, true>(d, table, positions)
}

fn rotated<F: Element, const INVERSE: bool>(
    x: ArrayView4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) -> Result<Array4<F>, AttentionError> {
    check(x.shape(), table, positions)?;
    let mut out = alloc::try_zeros("the rotated tensor", x.raw_dim())?;
    out.assign(&x);
    rotate_checked::<F, INVERSE>(out.view_mut(), table, positions);
    Ok(out)
}

fn rotate_into<F: Element, const INVERSE: bool>(
    x: ArrayView4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
    mut out: ArrayViewMut4<'_, F>,
) -> Result<(), AttentionError> {
    check(x.shape(), table, positions)?;
    if out.shape() != x.shape() {
        return Err(shape_error(format!(
            "out has shape {:?} but the rotated tensor has shape {:?}",
            out.shape(),
            x.shape()
        )));
    }
    out.assign(&x);
    rotate_checked::<F, INVERSE>(out, table, positions);
    Ok(())
}

fn rotate_inplace<F: Element, const INVERSE: bool>(
    x: ArrayViewMut4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) -> Result<(), AttentionError> {
    check(x.shape(), table, positions)?;
    rotate_checked::<F, INVERSE>(x, table, positions);
    Ok(())
}

/// Checks `x`'s shape `[batch, heads, len, d]` and the positions against
/// the table, so that every position [`position`] gives is in the table.
fn check(
    shape: &[usize],
    table: &RopeTable<impl Sized>,
    positions: RopePositions<'_>,
) -> Result<(), AttentionError> {
    let (batch, len, d) = (shape[0], shape[2], shape[3]);
    let described = || format!("x has shape {shape:?} = [batch, heads, len, d]");
    if table.rotary_dim > d {
        return Err(shape_error(format!(
            "rotary_dim = {} is larger than the head dim d = {d}: {}",
            table.rotary_dim,
            described()
        )));
    }
    let error = |message: String| AttentionError::new(ErrorKind::Positions, message);
    let max = table.max_positions;
    let past = |what: String, position: usize| {
        error(format!(
            "{what} = {position} is past the rotary table, which holds positions 0..{max}: {}",
            described()
        ))
    };
    // The last position of a run of `len` tokens from `start`, if any.
    let check_run = |what: &str, start: usize| -> Result<(), AttentionError> {
        match len.checked_sub(1).map(|last| start.checked_add(last)) {
            None => Ok(()),
            Some(Some(end)) if end < max => Ok(()),
            Some(end) => Err(error(format!(
                "{what} = {start} puts the last of {len} tokens at position {}, past the rotary \
                 table, which holds positions 0..{max}: {}",
                end.map_or_else(|| "past usize::MAX".to_string(), |e| e.to_string()),
                described()
            ))),
        }
    };
    match positions {
        RopePositions::Start(start) => check_run("the start position", start),
        RopePositions::Tokens(tokens) => {
            if tokens.len() != len {
                return Err(error(format!(
                    "{} token positions given for len = {len} tokens: {}",
                    tokens.len(),
                    described()
                )));
            }
            match tokens.iter().enumerate().find(|&(_, &p)| p >= max) {
                Some((i, &p)) => Err(past(format!("positions[{i}]"), p)),
                None => Ok(()),
            }
        }
        RopePositions::Starts(starts) => {
            if starts.len() != batch {
                return Err(error(format!(
                    "{} start positions given for batch = {batch}: {}",
                    starts.len(),
                    described()
                )));
            }
            for (b, &start) in starts.iter().enumerate() {
                check_run(&format!("starts[{b}]"), start)?;
            }
            Ok(())
        }
        RopePositions::PerItem(per_item) => {
            let rows = per_item.nrows();
            if !(rows == batch || rows == 1) || per_item.ncols() != len {
                return Err(error(format!(
                    "positions have shape {:?}, but [batch, len] = {:?} (or [1, len]) is needed: {}",
                    per_item.shape(),
                    [batch, len],
                    described()
                )));
            }
            match per_item.indexed_iter().find(|&(_, &p)| p >= max) {
                Some(((b, i), &p)) => Err(past(format!("positions[[{b}, {i}]]"), p)),
                None => Ok(()),
            }
        }
    }
}

/// The position of token `i` of batch item `b`, once [`check`] has passed.
#[inline]
fn position(positions: &RopePositions<'_>, b: usize, i: usize) -> usize {
    match positions {
        RopePositions::Start(start) => start + i,
        RopePositions::Tokens(tokens) => tokens[i],
        RopePositions::Starts(starts) => starts[b] + i,
        RopePositions::PerItem(per_item) => {
            per_item[[if per_item.nrows() == 1 { 0 } else { b }, i]]
        }
    }
}

/// Rotates every row of `x` in place, once [`check`] has passed.
fn rotate_checked<F: Element, const INVERSE: bool>(
    mut x: ArrayViewMut4<'_, F>,
    table: &RopeTable<F>,
    positions: RopePositions<'_>,
) {
    let rotary_dim = table.rotary_dim;
    if rotary_dim == 0 {
        return;
    }
    // A strided row is rotated in this scratch copy.
    let mut scratch = Vec::new();
    for (b, mut item) in x.axis_iter_mut(Axis(0)).enumerate() {
        for mut head in item.axis_iter_mut(Axis(0)) {
            for (i, row) in head.axis_iter_mut(Axis(0)).enumerate() {
                let p = position(&positions, b, i);
                let (cos, sin) = (table.cos(p), table.sin(p));
                let (Some(cos), Some(sin)) = (cos, sin) else {
                    debug_assert!(false, "position {p} was checked to be in the table");
                    continue;
                };
                rotate_row::<F, INVERSE>(row, rotary_dim, table.layout, cos, sin, &mut scratch);
            }
        }
    }
}

/// Rotates the first `rotary_dim` features of `row`, contiguous or not.
fn rotate_row<F: Element, const INVERSE: bool>(
    mut row: ArrayViewMut1<'_, F>,
    rotary_dim: usize,
    layout: RopeLayout,
    cos: &[F],
    sin: &[F],
    scratch: &mut Vec<F>,
) {
    let mut rotary = row.slice_mut(ndarray::s![..rotary_dim]);
    if let Some(features) = rotary.as_slice_mut() {
        rotate_slice::<F, INVERSE>(features, layout, cos, sin);
    } else {
        scratch.clear();
        scratch.extend(rotary.iter().copied());
        rotate_slice::<F, INVERSE>(scratch, layout, cos, sin);
        rotary
            .iter_mut()
            .zip(scratch.iter())
            .for_each(|(x, &s)| *x = s);
    }
}

/// Rotates the pairs of `features` (`2 · cos.len()` of them, contiguous) by
/// the angles whose cosines and sines are given, or by their opposites when
/// `INVERSE`. Written as zips over slices of equal length so the compiler
/// checks no bounds and vectorizes the loop.
#[inline]
fn rotate_slice<F: Element, const INVERSE: bool>(
    features: &mut [F],
    layout: RopeLayout,
    cos: &[F],
    sin: &[F],
) {
    let half = cos.len();
    match layout {
        RopeLayout::HalfSplit => {
            let (first, second) = features.split_at_mut(half);
            for (((a, b), &c), &s) in first.iter_mut().zip(second).zip(cos).zip(sin) {
                let s = if INVERSE { -s } else { s };
                let (x, y) = (*a, *b);
                *a = x * c - y * s;
                *b = y * c + x * s;
            }
        }
        RopeLayout::Interleaved => {
            let (pairs, _) = features.as_chunks_mut::<2>();
            for (([x, y], &c), &s) in pairs.iter_mut().zip(cos).zip(sin) {
                let s = if INVERSE { -s } else { s };
                (*x, *y) = (*x * c - *y * s, *y * c + *x * s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, Array4, s};

    use super::*;

    fn sample(shape: (usize, usize, usize, usize)) -> Array4<f64> {
        Array4::from_shape_fn(shape, |(b, h, i, d)| {
            ((b * 7 + h * 5 + i * 3 + d * 11) % 13) as f64 * 0.15 - 0.9
        })
    }

    /// The rotation written from the definition, one element at a time.
    fn naive(
        x: &Array4<f64>,
        rotary_dim: usize,
        theta: f64,
        layout: RopeLayout,
        start: usize,
    ) -> Array4<f64> {
        let mut out = x.clone();
        let half = rotary_dim / 2;
        for ((b, h, i, _), _) in x.indexed_iter().filter(|((.., d), _)| *d == 0) {
            for pair in 0..half {
                let angle = (start + i) as f64 / theta.powf(2.0 * pair as f64 / rotary_dim as f64);
                let (a, c) = match layout {
                    RopeLayout::HalfSplit => (pair, pair + half),
                    RopeLayout::Interleaved => (2 * pair, 2 * pair + 1),
                };
                let (u, v) = (x[[b, h, i, a]], x[[b, h, i, c]]);
                out[[b, h, i, a]] = u * angle.cos() - v * angle.sin();
                out[[b, h, i, c]] = v * angle.cos() + u * angle.sin();
            }
        }
        out
    }

    #[test]
    fn matches_the_definition_in_both_layouts_with_partial_rotary() {
        let x = sample((2, 3, 5, 10));
        for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
            for rotary_dim in [0, 2, 4, 10] {
                let table = RopeTable::new(rotary_dim, 500.0, 64)
                    .unwrap()
                    .with_layout(layout);
                let got = apply_rope(x.view(), &table, RopePositions::Start(7)).unwrap();
                let want = naive(&x, rotary_dim, 500.0, layout, 7);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-12),
                    "{layout:?} {rotary_dim}"
                );
                assert_eq!(
                    got.slice(s![.., .., .., rotary_dim..]),
                    x.slice(s![.., .., .., rotary_dim..])
                );
            }
        }
    }

    #[test]
    fn strided_views_and_every_form_of_positions_agree() {
        let x = sample((2, 3, 4, 8));
        let table = RopeTable::new(6, 10_000.0, 32).unwrap();
        let want = apply_rope(x.view(), &table, RopePositions::Start(5)).unwrap();
        // A transposed (non-contiguous rows) view.
        let transposed = x
            .clone()
            .permuted_axes([0, 1, 3, 2])
            .as_standard_layout()
            .to_owned();
        let strided = transposed.view().permuted_axes([0, 1, 3, 2]);
        assert!(strided.slice(s![0, 0, 0, ..]).as_slice().is_none());
        assert_eq!(
            apply_rope(strided, &table, RopePositions::Start(5)).unwrap(),
            want
        );
        let mut inplace = transposed.clone();
        apply_rope_inplace(
            inplace.view_mut().permuted_axes([0, 1, 3, 2]),
            &table,
            RopePositions::Start(5),
        )
        .unwrap();
        assert_eq!(inplace.view().permuted_axes([0, 1, 3, 2]), want);
        let tokens = [5, 6, 7, 8];
        assert_eq!(
            apply_rope(x.view(), &table, RopePositions::Tokens(&tokens)).unwrap(),
            want
        );
        assert_eq!(
            apply_rope(x.view(), &table, RopePositions::Starts(&[5, 5])).unwrap(),
            want
        );
        let per_item = Array2::from_shape_fn((2, 4), |(_, i)| 5 + i);
        assert_eq!(
            apply_rope(x.view(), &table, RopePositions::PerItem(per_item.view())).unwrap(),
            want
        );
        let shared = Array2::from_shape_fn((1, 4), |(_, i)| 5 + i);
        assert_eq!(
            apply_rope(x.view(), &table, RopePositions::PerItem(shared.view())).unwrap(),
            want
        );
        let mut out = Array4::zeros((2, 3, 4, 8));
        apply_rope_into(x.view(), &table, RopePositions::Start(5), out.view_mut()).unwrap();
        assert_eq!(out, want);
        // Per item: item 1 at other positions.
        let per = apply_rope(x.view(), &table, RopePositions::Starts(&[5, 0])).unwrap();
        assert_eq!(per.slice(s![0, .., .., ..]), want.slice(s![0, .., .., ..]));
        let item1 = apply_rope(
            x.slice(s![1..2, .., .., ..]),
            &table,
            RopePositions::Start(0),
        )
        .unwrap();
        assert_eq!(per.slice(s![1..2, .., .., ..]), item1);
    }

    #[test]
    fn backward_undoes_the_rotation() {
        let x = sample((1, 2, 6, 12));
        for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
            let table = RopeTable::new(8, 10_000.0, 16).unwrap().with_layout(layout);
            let y = apply_rope(x.view(), &table, RopePositions::Start(3)).unwrap();
            let back = apply_rope_backward(y.view(), &table, RopePositions::Start(3)).unwrap();
            assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-12));
            let mut d = y.clone();
            apply_rope_backward_inplace(d.view_mut(), &table, RopePositions::Start(3)).unwrap();
            assert_eq!(d, back);
            let mut d_x = Array4::zeros(y.raw_dim());
            apply_rope_backward_into(y.view(), &table, RopePositions::Start(3), d_x.view_mut())
                .unwrap();
            assert_eq!(d_x, back);
        }
    }

    #[test]
    fn bad_input_is_an_error_and_leaves_x_unchanged() {
        assert_eq!(
            RopeTable::<f32>::new(7, 10_000.0, 8).unwrap_err().kind(),
            ErrorKind::InvalidOption
        );
        for theta in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(
                RopeTable::<f32>::new(8, theta, 8).unwrap_err().kind(),
                ErrorKind::InvalidOption
            );
        }
        assert_eq!(
            RopeTable::<f32>::from_inverse_frequencies(&[1.0, f64::NAN], 8)
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidOption
        );
        assert_eq!(
            RopeTable::<f32>::new(8, 10_000.0, usize::MAX)
                .unwrap_err()
                .kind(),
            ErrorKind::TooLarge
        );
        let table = RopeTable::<f32>::new(8, 10_000.0, 10).unwrap();
        let mut x = Array4::<f32>::ones((2, 1, 3, 6));
        let err = apply_rope_inplace(x.view_mut(), &table, RopePositions::Start(0)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
        assert!(
            err.to_string().contains("rotary_dim = 8") && err.to_string().contains("[2, 1, 3, 6]"),
            "{err}"
        );
        let mut x = Array4::<f32>::from_elem((2, 1, 3, 8), 0.5);
        let before = x.clone();
        let per_item = Array2::<usize>::zeros((3, 3));
        for (positions, mentions) in [
            (RopePositions::Start(8), "position 10"),
            (RopePositions::Start(usize::MAX), "past usize::MAX"),
            (RopePositions::Tokens(&[0, 1]), "2 token positions"),
            (RopePositions::Tokens(&[0, 1, 10]), "positions[2] = 10"),
            (RopePositions::Starts(&[0]), "1 start positions"),
            (RopePositions::Starts(&[0, 9]), "starts[1] = 9"),
            (RopePositions::PerItem(per_item.view()), "[3, 3]"),
        ] {
            let err = apply_rope_inplace(x.view_mut(), &table, positions).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Positions, "{positions:?}");
            assert!(err.to_string().contains(mentions), "{err}");
            assert_eq!(x, before);
        }
        let mut out = Array4::<f32>::zeros((2, 1, 3, 9));
        let err =
            apply_rope_into(x.view(), &table, RopePositions::Start(0), out.view_mut()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
        // Empty tensors are fine, whatever the start.
        let empty = Array4::<f32>::zeros((2, 1, 0, 8));
        assert!(apply_rope(empty.view(), &table, RopePositions::Start(usize::MAX)).is_ok());
    }
}
