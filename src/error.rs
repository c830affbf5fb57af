//! The one error type of the crate.

use std::fmt;

/// What kind of bad input an [`AttentionError`] reports.
///
/// Matching on the kind lets a caller react to a class of mistakes; the
/// error's `Display` says exactly which argument and which shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Two arguments disagree on a dimension they must share
    /// (batch, head dim, key/value length, output shape, layer weights).
    ShapeMismatch,
    /// A dimension that must be positive is zero (`d_k`, heads, `d_model`).
    ZeroDimension,
    /// The number of query heads is not a multiple of the number of key/value heads.
    HeadsNotDivisible,
    /// A keep mask or bias cannot be broadcast to `[batch, heads, len_q, len_kv]`.
    NotBroadcastable,
    /// A key length or key start is past `len_kv`, or the wrong number of
    /// them was given.
    KeyLengths,
    /// A scale or other scalar option is not finite or out of range, or
    /// the call does not take an option given (a keep mask on a packed
    /// batch, say; the message says why).
    InvalidOption,
    /// Rotary positions do not match the tensor (one per token, one start
    /// per batch item, `[batch, len]`), or one is past the rotary table.
    Positions,
    /// A requested kernel set is unknown or not supported by this CPU.
    UnsupportedKernel,
    /// The `cu_seqlens` offsets of a packed batch
    /// ([`scaled_dot_product_attention_varlen`](crate::scaled_dot_product_attention_varlen))
    /// are not a packing of the tensors' rows: empty, not starting at 0,
    /// decreasing, not ending at the row count, or the query and key
    /// offsets count different sequences.
    SequenceOffsets,
    /// A result or working buffer would have more elements or bytes than
    /// this machine can address (the message names the shape); typically
    /// broadcast views whose lengths are far larger than their memory.
    TooLarge,
    /// Allocating a result or working buffer failed (the message names the
    /// size): the call needs more memory than is available.
    OutOfMemory,
    /// A checkpoint could not be read: the file is missing or unreadable,
    /// or its bytes are not a valid safetensors file.
    Checkpoint,
    /// A tensor a loader needs is not in the checkpoint (the message names
    /// it, with the prefix, and the tensors that are there).
    MissingTensor,
    /// A tensor has an element type the loader does not read (the message
    /// names the tensor and the type; `F32` and `F64` are read).
    UnsupportedDtype,
}

/// Bad input to an attention call: the kind, and a message naming the
/// argument and the shapes involved.
///
/// ```
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention, AttentionOptions, ErrorKind};
///
/// let q = Array4::<f32>::zeros((1, 2, 3, 4));
/// let k = Array4::<f32>::zeros((1, 2, 3, 5)); // d_k disagrees with q
/// let v = Array4::<f32>::zeros((1, 2, 3, 4));
/// let err = scaled_dot_product_attention(q.view(), k.view(), v.view(), &AttentionOptions::new())
///     .unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
/// assert!(err.to_string().contains("d_k"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionError {
    kind: ErrorKind,
    message: String,
}

impl AttentionError {
    /// An error of `kind` with a message for people.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The kind of error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, naming the argument and the shapes.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AttentionError {}

/// Shorthand used throughout the crate.
pub(crate) fn shape_error(message: impl Into<String>) -> AttentionError {
    AttentionError::new(ErrorKind::ShapeMismatch, message)
}
