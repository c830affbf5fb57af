//! [`AttentionOptions`]: which keys each query may see (causal alignment,
//! keep mask, key lengths and starts, window, key shard), the scale, and an additive
//! bias. A builder only: what the options mean for each query row is
//! `mask.rs`'s business.

use ndarray::{ArrayView, ArrayView4, Axis, Dimension, Ix4};

use crate::error::{AttentionError, ErrorKind};

/// How a causal mask lines the queries up against the keys when
/// `len_q != len_kv`.
///
/// With `len_q == len_kv` both alignments give the usual lower triangle.
///
/// ```
/// use sdpa::{AttentionOptions, CausalAlignment};
/// // 2 new queries against 5 keys: the last query sees all 5 keys.
/// let kv_cache = AttentionOptions::<f32>::new().causal(); // BottomRight
/// // PyTorch's `is_causal=True`: query i sees keys 0..=i.
/// let torch_like = AttentionOptions::<f32>::new().causal_aligned(CausalAlignment::TopLeft);
/// # let _ = (kv_cache, torch_like);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CausalAlignment {
    /// Query `i` sees keys `j ≤ i + (len_kv − len_q)`: the last query sees the
    /// last key. This is what decoding with a KV cache needs, where the
    /// queries are the newest `len_q` positions of a `len_kv`-long sequence.
    #[default]
    BottomRight,
    /// Query `i` sees keys `j ≤ i`, PyTorch's `is_causal=True`.
    TopLeft,
}

/// The options of an attention call: a by-value builder in which every option
/// composes with the others.
///
/// `AttentionOptions::new()` (or `default()`) is bidirectional attention with
/// scale `1/√d_k`.
///
/// A key `j` is visible to query `i` of batch item `b` and head `h` when all
/// of these hold:
/// - the causal rule, if any, allows it ([`CausalAlignment`]);
/// - `j < key_lengths[b]`, if key lengths were given;
/// - `j ≥ key_starts[b]`, if key starts were given;
/// - `j` is within the [`window`](Self::window), if one was given;
/// - `keep_mask[b, h, i, j]` is `true`, if a keep mask was given.
///
/// Invisible keys get weight exactly 0 by selection, so NaN or ±inf in their
/// keys, values or bias never reach the output. A query with no visible key
/// outputs zeros.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::AttentionOptions;
///
/// let keep = Array4::from_elem((1, 1, 4, 4), true);
/// let bias = Array4::<f32>::zeros((1, 8, 4, 4));
/// let opts = AttentionOptions::new()
///     .causal()
///     .scale(0.125)
///     .keep_mask(keep.view())
///     .bias(bias.view())
///     .key_lengths(&[3]);
/// # let _ = opts;
/// ```
#[derive(Debug, Clone)]
pub struct AttentionOptions<'a, F> {
    pub(crate) causal: Option<CausalAlignment>,
    pub(crate) scale: Option<F>,
    pub(crate) keep_mask: Option<ArrayView4<'a, bool>>,
    pub(crate) bias: Option<ArrayView4<'a, F>>,
    pub(crate) key_lengths: Option<&'a [usize]>,
    pub(crate) key_starts: Option<&'a [usize]>,
    pub(crate) window: Option<usize>,
    pub(crate) key_shard: Option<KeyShard>,
    /// How the keep mask was given, for the call's check.
    pub(crate) keep_mask_given: Given,
    /// How the bias was given, for the call's check.
    pub(crate) bias_given: Given,
    /// Score modifiers (`modifiers.rs`): ALiBi slopes and sink logits,
    /// one per query head.
    pub(crate) alibi: Option<&'a [F]>,
    pub(crate) sinks: Option<&'a [F]>,
    pub(crate) softcap: Option<F>,
}

impl<F> Default for AttentionOptions<'_, F> {
    fn default() -> Self {
        Self {
            causal: None,
            scale: None,
            keep_mask: None,
            bias: None,
            key_lengths: None,
            key_starts: None,
            window: None,
            key_shard: None,
            keep_mask_given: Given::default(),
            bias_given: Given::default(),
            alibi: None,
            sinks: None,
            softcap: None,
        }
    }
}

impl<'a, F: Copy> AttentionOptions<'a, F> {
    /// Bidirectional attention with scale `1/√d_k` and no mask or bias.
    pub fn new() -> Self {
        Self::default()
    }

    /// Causal attention, bottom-right aligned: query `i` sees keys
    /// `j ≤ i + (len_kv − len_q)`. Same as top-left when `len_q == len_kv`.
    pub fn causal(self) -> Self {
        self.causal_aligned(CausalAlignment::BottomRight)
    }

    /// Causal attention with the given alignment.
    pub fn causal_aligned(mut self, alignment: CausalAlignment) -> Self {
        // A window set earlier keeps working with the new alignment.
        self.causal = Some(alignment);
        self
    }

    /// Multiplies the scores `Q·Kᵀ` by `scale` instead of `1/√d_k`.
    /// It must be finite; the call returns an error otherwise.
    pub fn scale(mut self, scale: F) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Only keys whose entry is `true` may be attended to. The full shape
    /// is `[batch, heads, len_q, len_kv]`, where any dimension may be 1 to
    /// broadcast (so `[batch, 1, 1, len_kv]` is a key-padding mask).
    ///
    /// A mask of lower rank is broadcast from the right, as PyTorch
    /// broadcasts `attn_mask`: `[len_q, len_kv]` is shared by every batch
    /// item and head, `[heads, len_q, len_kv]` by every batch item (ranks 0
    /// and 1 work the same way). A rank above 4, or a shape that does not
    /// broadcast, makes the call return an error
    /// ([`ErrorKind::NotBroadcastable`]).
    ///
    /// ```
    /// use ndarray::{Array2, Array4};
    /// use sdpa::AttentionOptions;
    ///
    /// let x = Array4::<f64>::ones((2, 3, 4, 8));
    /// // A torch-style [len_q, len_kv] mask: query i sees keys 0..=i.
    /// let keep = Array2::from_shape_fn((4, 4), |(i, j)| j <= i);
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().keep_mask(keep.view()))?;
    /// let causal = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().causal())?;
    /// assert_eq!(w, causal);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn keep_mask<D: Dimension>(mut self, keep_mask: ArrayView<'a, bool, D>) -> Self {
        let (mask, given) = to_rank_4("keep_mask", keep_mask);
        (self.keep_mask, self.keep_mask_given) = (mask, given);
        self
    }

    /// Adds `bias` to the scaled scores before the softmax (ALiBi, relative
    /// positions). Full shape `[batch, heads, len_q, len_kv]`; it broadcasts
    /// like the keep mask, lower ranks from the right (`[len_q, len_kv]`,
    /// `[heads, len_q, len_kv]`). A `-inf` bias gives a visible key weight 0.
    ///
    /// ```
    /// use ndarray::{Array1, Array4, Array3};
    /// use sdpa::AttentionOptions;
    ///
    /// let x = Array4::<f64>::ones((1, 2, 3, 4));
    /// // A [heads, len_q, len_kv] bias (ALiBi-like slopes), the same for every batch item.
    /// let bias = Array3::from_shape_fn((2, 3, 3), |(h, i, j)| -((h + 1) as f64) * (i as f64 - j as f64).abs());
    /// let w3 = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().bias(bias.view()))?;
    /// let bias4 = bias.clone().insert_axis(ndarray::Axis(0));
    /// let w4 = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().bias(bias4.view()))?;
    /// assert_eq!(w3, w4);
    /// // A vector is broadcast over the keys' axis too: one bias per key.
    /// let per_key = Array1::from(vec![0.0, 0.0, f64::NEG_INFINITY]);
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().bias(per_key.view()))?;
    /// assert_eq!(w[[0, 1, 2, 2]], 0.0);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn bias<D: Dimension>(mut self, bias: ArrayView<'a, F, D>) -> Self {
        let (bias, given) = to_rank_4("bias", bias);
        (self.bias, self.bias_given) = (bias, given);
        self
    }

    /// For each batch item `b`, keys at index `≥ key_lengths[b]` are padding
    /// and invisible. One length per batch item, each `≤ len_kv`.
    pub fn key_lengths(mut self, key_lengths: &'a [usize]) -> Self {
        self.key_lengths = Some(key_lengths);
        self
    }

    /// For each batch item `b`, keys at index `< key_starts[b]` are padding
    /// and invisible: the left padding of a batch whose sequences end
    /// together (as Hugging Face pads prompts for batched generation), where
    /// [`key_lengths`](Self::key_lengths) is the right padding. One start
    /// per batch item, each `≤ len_kv` (with
    /// [`key_shard`](Self::key_shard), indices in the whole sequence). A
    /// query row with no visible key outputs zeros, so with `.causal()` the
    /// padded query rows of a left-padded prompt are zeros.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::AttentionOptions;
    ///
    /// // Two sequences of lengths 3 and 2, left-padded to 3.
    /// let x = Array4::<f64>::ones((2, 1, 3, 2));
    /// let opts = AttentionOptions::new().causal().key_starts(&[0, 1]);
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &opts)?;
    /// assert_eq!(w.slice(ndarray::s![1, 0, 2, ..]).to_vec(), vec![0.0, 0.5, 0.5]);
    /// assert_eq!(w.slice(ndarray::s![1, 0, 0, ..]).to_vec(), vec![0.0; 3]); // a padded row
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn key_starts(mut self, key_starts: &'a [usize]) -> Self {
        self.key_starts = Some(key_starts);
        self
    }

    /// Sliding-window attention: each query sees at most the `window` most
    /// recent keys up to its causal position, i.e. keys `j` with
    /// `p − window < j ≤ p` where `p` is the query's diagonal position.
    /// Implies causal attention, bottom-right aligned unless
    /// [`causal_aligned`](Self::causal_aligned) says otherwise. `window`
    /// must be at least 1; the call returns an error otherwise.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::AttentionOptions;
    ///
    /// let x = Array4::<f64>::ones((1, 1, 5, 2));
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().window(2))?;
    /// // Query 4 sees keys 3 and 4 only.
    /// assert_eq!(w.slice(ndarray::s![0, 0, 4, ..]).to_vec(), vec![0.0, 0.0, 0.0, 0.5, 0.5]);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn window(mut self, window: usize) -> Self {
        self.window = Some(window);
        if self.causal.is_none() {
            self.causal = Some(CausalAlignment::BottomRight);
        }
        self
    }

    /// Declares that the keys and values passed are a shard of a longer
    /// sequence: keys `offset .. offset + len_kv` of `total_len_kv`. Causal
    /// alignment, window, key lengths, keep mask and bias then refer to
    /// positions in the whole sequence (the mask and bias have
    /// `total_len_kv` columns, or 1). With
    /// [`scaled_dot_product_attention_partial`](crate::scaled_dot_product_attention_partial),
    /// this computes one shard's part of a call split across threads,
    /// processes or machines. The call returns an error if the shard does
    /// not fit in `total_len_kv`.
    pub fn key_shard(mut self, offset: usize, total_len_kv: usize) -> Self {
        self.key_shard = Some(KeyShard {
            offset,
            total_len_kv,
        });
        self
    }

    /// ALiBi (Press et al., BLOOM, MPT): adds `−slope_h·(p_i − j)` to the
    /// scaled scores of query head `h`, where `j` is the key's position in
    /// the whole sequence (see [`key_shard`](Self::key_shard)) and
    /// `p_i = i + total_len_kv − len_q` the query's bottom-right aligned
    /// position (its own position in a KV cache). Computed per tile from
    /// the positions, never stored as a `len_q × len_kv` matrix.
    ///
    /// One slope per query head (`slopes.len() == heads`, each finite; the
    /// call returns an error otherwise); [`alibi_slopes`](crate::alibi_slopes)
    /// gives the standard ones. Bidirectionally, a key after the query gets
    /// `+slope·(j − p_i)`: the bias is `slope·j − slope·p_i`, and the
    /// softmax drops the row's constant `slope·p_i`, so every row's weights
    /// are those of BLOOM's `build_alibi_tensor`, which adds `slope·j`.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::{alibi_slopes, AttentionOptions};
    ///
    /// let slopes: Vec<f64> = alibi_slopes(2);
    /// let x = Array4::<f64>::zeros((1, 2, 3, 4));
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().causal().alibi(&slopes))?;
    /// // The last query sees keys 0..=2 with weights ∝ e^(−slope·distance).
    /// let ratio = w[[0, 0, 2, 1]] / w[[0, 0, 2, 2]];
    /// assert!((ratio - (-slopes[0]).exp()).abs() < 1e-12);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn alibi(mut self, slopes: &'a [F]) -> Self {
        self.alibi = Some(slopes);
        self
    }

    /// Attention sinks (gpt-oss): for each query head `h` a learned logit
    /// `sinks[h]` joins the softmax's denominator as a virtual key that
    /// holds no value, so a row's weights sum to less than 1:
    /// `P_ij = e^(S_ij) / (e^(sinks[h]) + Σ_j e^(S_ij))`. The logit is not
    /// scaled, biased or masked. One finite logit per query head; the call
    /// returns an error otherwise.
    ///
    /// A row that sees no key, or whose visible keys all score `−inf`,
    /// outputs zeros and has log-sum-exp `sinks[h]`: the sink takes all the
    /// weight (without sinks, a row of `−inf` scores is NaN). With
    /// [`key_shard`](Self::key_shard), only the shard holding key 0 of the
    /// whole sequence counts the sink (with no keys at all, a shard at
    /// offset 0), so merging the shards' partials counts it once and gives
    /// the unsplit call's result; the backward's `d_sinks` is likewise
    /// that shard's, and zeros for the others.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::AttentionOptions;
    ///
    /// let x = Array4::<f64>::zeros((1, 1, 1, 3));
    /// let w = sdpa::core::attention_weights(x.view(), x.view(), &AttentionOptions::new().sinks(&[0.0]))?;
    /// // One key of score 0 against a sink of logit 0: half the weight each.
    /// assert!((w[[0, 0, 0, 0]] - 0.5).abs() < 1e-15);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn sinks(mut self, logits: &'a [F]) -> Self {
        self.sinks = Some(logits);
        self
    }

    /// Logit softcapping (Gemma 2, Grok-1): each scaled score `s` becomes
    /// `cap·tanh(s/cap)` before the bias, ALiBi and the mask are applied,
    /// the order of Hugging Face's Gemma 2 eager attention (scale, cap,
    /// then the additive mask). An infinite score becomes `±cap` (tanh's
    /// limits, as in PyTorch); NaN stays NaN. `cap` must be positive and
    /// finite; the call returns an error otherwise. The backward applies
    /// its derivative `1 − tanh²(s/cap)` to the scores' gradient (the
    /// bias's gradient is taken after the cap, where the bias is added).
    ///
    /// The fused `f32` forward and backward cap each score tile with a
    /// vectorized `tanh` (≤ 3 ulp).
    ///
    /// ```
    /// use ndarray::Array4;
    /// use sdpa::AttentionOptions;
    ///
    /// let q = Array4::<f64>::from_elem((1, 1, 1, 1), 100.0);
    /// let k = Array4::<f64>::from_shape_vec((1, 1, 2, 1), vec![1.0, 0.0]).unwrap();
    /// let w = sdpa::core::attention_weights(q.view(), k.view(), &AttentionOptions::new().softcap(1.0))?;
    /// // Scores 100 and 0 are capped to tanh(100) ≈ 1 and 0.
    /// assert!((w[[0, 0, 0, 0]] - 1f64.exp() / (1f64.exp() + 1.0)).abs() < 1e-12);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn softcap(mut self, cap: F) -> Self {
        self.softcap = Some(cap);
        self
    }
}

impl<F: Copy> AttentionOptions<'_, F> {
    /// The same options, borrowing the mask, bias and key lengths for a
    /// shorter lifetime.
    pub(crate) fn reborrow(&self) -> AttentionOptions<'_, F> {
        AttentionOptions {
            causal: self.causal,
            scale: self.scale,
            keep_mask: self.keep_mask.as_ref().map(|mask| mask.view()),
            bias: self.bias.as_ref().map(|bias| bias.view()),
            key_lengths: self.key_lengths,
            key_starts: self.key_starts,
            window: self.window,
            key_shard: self.key_shard,
            keep_mask_given: self.keep_mask_given.clone(),
            bias_given: self.bias_given.clone(),
            alibi: self.alibi,
            sinks: self.sinks,
            softcap: self.softcap,
        }
    }
}

/// How a keep mask or bias was given: its rank before axes of length 1
/// were added on the left, and the error to report if it cannot be used
/// (the builder cannot fail, so the call reports it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Given {
    pub rank: usize,
    pub error: Option<AttentionError>,
}

impl Default for Given {
    fn default() -> Self {
        Self {
            rank: 4,
            error: None,
        }
    }
}

/// `view` of rank 4 or less as a rank-4 view, with axes of length 1 added
/// on the left: PyTorch's broadcasting from the right. A higher rank gives
/// no view and the error to report.
fn to_rank_4<'a, T, D: Dimension>(
    name: &str,
    view: ArrayView<'a, T, D>,
) -> (Option<ArrayView4<'a, T>>, Given) {
    let rank = view.ndim();
    let too_many = |shape: &[usize]| {
        let error = AttentionError::new(
            ErrorKind::NotBroadcastable,
            format!(
                "{name} has shape {shape:?} of rank {rank}, which does not broadcast to \
                 [batch, heads, len_q, len_kv]: a mask or bias has rank 4 or less"
            ),
        );
        (
            None,
            Given {
                rank,
                error: Some(error),
            },
        )
    };
    if rank > 4 {
        return too_many(view.shape());
    }
    // No allocation: a dynamic dimension of rank 4 or less is stored inline.
    let mut padded = view.into_dyn();
    while padded.ndim() < 4 {
        padded.insert_axis_inplace(Axis(0));
    }
    match padded.into_dimensionality::<Ix4>() {
        Ok(padded) => (Some(padded), Given { rank, error: None }),
        Err(_) => too_many(&[]),
    }
}

/// Where the keys of a call sit in the whole key sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyShard {
    /// Index in the whole sequence of the call's first key.
    pub offset: usize,
    /// Keys in the whole sequence.
    pub total_len_kv: usize,
}

#[cfg(feature = "half")]
impl AttentionOptions<'_, f32> {
    /// Runs `f` on these options with the scalars, bias, slopes and sinks
    /// widened to `f64` (exactly): the reference's options for a
    /// half-precision call, whose options are `f32`.
    ///
    /// # Errors
    /// When the widened bias cannot be allocated, or as `f`.
    pub(crate) fn with_f64<R>(
        &self,
        f: impl FnOnce(&AttentionOptions<'_, f64>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        let bias = match &self.bias {
            Some(bias) => {
                let mut wide = crate::alloc::try_zeros("the bias in f64", bias.raw_dim())?;
                wide.zip_mut_with(bias, |y, &x| *y = f64::from(x));
                Some(wide)
            }
            None => None,
        };
        let widen = |values: Option<&[f32]>| -> Result<Option<Vec<f64>>, AttentionError> {
            let Some(values) = values else {
                return Ok(None);
            };
            let mut wide =
                crate::alloc::try_with_capacity("per-head options in f64", values.len())?;
            wide.extend(values.iter().map(|&x| f64::from(x)));
            Ok(Some(wide))
        };
        let (alibi, sinks) = (widen(self.alibi)?, widen(self.sinks)?);
        let wide = AttentionOptions {
            causal: self.causal,
            scale: self.scale.map(f64::from),
            keep_mask: self.keep_mask.as_ref().map(|mask| mask.view()),
            bias: bias.as_ref().map(|bias| bias.view()),
            key_lengths: self.key_lengths,
            key_starts: self.key_starts,
            window: self.window,
            key_shard: self.key_shard,
            keep_mask_given: self.keep_mask_given.clone(),
            bias_given: self.bias_given.clone(),
            alibi: alibi.as_deref(),
            sinks: sinks.as_deref(),
            softcap: self.softcap.map(f64::from),
        };
        f(&wide)
    }
}
