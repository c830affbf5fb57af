//! [`Checkpoint`]: the tensors of a safetensors file, read by name into
//! ndarray arrays of the crate's element types (feature `safetensors`).
//!
//! The format is parsed by the `safetensors` crate; this module only owns
//! the bytes, looks tensors up under a prefix and converts their elements.
//! The file is read into memory with `std::fs` (no memory map: that would
//! need `unsafe`, which the crate keeps to `simd`).

use std::path::Path;

use ndarray::{ArrayD, IxDyn};
use safetensors::{Dtype, SafeTensors};

use crate::element::Element;
use crate::error::{AttentionError, ErrorKind};

/// The tensors of a [safetensors](https://huggingface.co/docs/safetensors)
/// file, as PyTorch (`safetensors.torch.save_file`) and Hugging Face
/// (`model.safetensors`) write them: a name, a shape and little-endian
/// elements per tensor.
///
/// Tensors are read by name, with an optional prefix joined by a `.`
/// (`"model.layers.0.self_attn"` and `"q_proj.weight"` name
/// `model.layers.0.self_attn.q_proj.weight`; a prefix that already ends in
/// `.` is used as it is). `F32` and `F64` tensors are read, into `f32` or
/// `f64` (converted if they differ); other element types (`F16`, `BF16`,
/// integers) are an error naming the tensor and its type.
///
/// [`LayerParameters`](crate::LayerParameters)' `load_*` constructors read
/// a layer's projections from a checkpoint in the layout of the framework
/// that wrote it.
///
/// ```
/// use sdpa::{Checkpoint, ErrorKind};
///
/// // Written by scripts/make_fixtures.py with torch and safetensors.
/// let checkpoint = Checkpoint::from_file("tests/fixtures/torch_mha.safetensors")?;
/// let weight = checkpoint.tensor::<f32>("mha.in_proj_weight")?;
/// assert_eq!(weight.shape(), &[3 * 16, 16]);
/// assert!(checkpoint.names().contains(&"mha.out_proj.weight".to_owned()));
///
/// let err = checkpoint.tensor::<f32>("mha.q_proj.weight").unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::MissingTensor);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Checkpoint {
    bytes: Vec<u8>,
}

impl Checkpoint {
    /// Reads a safetensors file into memory and checks its header.
    ///
    /// # Errors
    /// [`ErrorKind::Checkpoint`] when the file cannot be read or is not a
    /// valid safetensors file; the message names the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, AttentionError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|err| {
            AttentionError::new(
                ErrorKind::Checkpoint,
                format!("cannot read the checkpoint {}: {err}", path.display()),
            )
        })?;
        Self::parse(bytes, &path.display().to_string())
    }

    /// A checkpoint from the bytes of a safetensors file (read from
    /// anywhere: an archive, the network, `include_bytes!`).
    ///
    /// # Errors
    /// [`ErrorKind::Checkpoint`] when the bytes are not a valid safetensors
    /// file.
    ///
    /// ```
    /// use sdpa::{Checkpoint, ErrorKind};
    ///
    /// let err = Checkpoint::from_bytes(b"not a checkpoint".to_vec()).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::Checkpoint);
    /// ```
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, AttentionError> {
        Self::parse(bytes.into(), "given as bytes")
    }

    fn parse(bytes: Vec<u8>, source: &str) -> Result<Self, AttentionError> {
        SafeTensors::deserialize(&bytes).map_err(|err| {
            AttentionError::new(
                ErrorKind::Checkpoint,
                format!("the checkpoint {source} is not a valid safetensors file: {err:?}"),
            )
        })?;
        Ok(Self { bytes })
    }

    /// The file's tensors; the bytes were checked when it was made.
    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes)
            .expect("the bytes were checked to be a safetensors file when the checkpoint was made")
    }

    /// The names of every tensor in the checkpoint, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .tensors()
            .names()
            .into_iter()
            .map(str::to_owned)
            .collect();
        names.sort();
        names
    }

    /// Whether the checkpoint has a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors().tensor(name).is_ok()
    }

    /// The tensor `name`, converted to `F`.
    ///
    /// # Errors
    /// [`ErrorKind::MissingTensor`] when there is no such tensor (the
    /// message lists those there are, up to a few dozen);
    /// [`ErrorKind::UnsupportedDtype`] when its elements are not `F32` or
    /// `F64` (or, with the `half` feature, `BF16` or `F16`, which convert
    /// exactly); [`ErrorKind::OutOfMemory`] when the array cannot be
    /// allocated.
    pub fn tensor<F: Element>(&self, name: &str) -> Result<ArrayD<F>, AttentionError> {
        self.get(name)?.ok_or_else(|| self.missing(name))
    }

    /// The tensor `name` converted to `F`, or `None` when the checkpoint has
    /// no such tensor.
    ///
    /// # Errors
    /// As [`tensor`](Self::tensor), except that a missing tensor is `None`.
    pub fn get<F: Element>(&self, name: &str) -> Result<Option<ArrayD<F>>, AttentionError> {
        let tensors = self.tensors();
        let Ok(view) = tensors.tensor(name) else {
            return Ok(None);
        };
        let shape = view.shape().to_vec();
        let data = view.data();
        let elements: Vec<F> = match view.dtype() {
            Dtype::F32 => convert::<F, 4>(data, |b| f64::from(f32::from_le_bytes(b)))?,
            Dtype::F64 => convert::<F, 8>(data, f64::from_le_bytes)?,
            // Half-precision checkpoints (the usual bf16 release) load into
            // f32 or f64 layers exactly: every bf16 and f16 is an f32.
            #[cfg(feature = "half")]
            Dtype::BF16 => convert::<F, 2>(data, |b| f64::from(half::bf16::from_le_bytes(b)))?,
            #[cfg(feature = "half")]
            Dtype::F16 => convert::<F, 2>(data, |b| f64::from(half::f16::from_le_bytes(b)))?,
            other => {
                return Err(AttentionError::new(
                    ErrorKind::UnsupportedDtype,
                    format!(
                        "tensor `{name}` {shape:?} has dtype {other:?}; only {READ} \
                         tensors are read (convert it, e.g. with tensor.float() in torch)"
                    ),
                ));
            }
        };
        ArrayD::from_shape_vec(IxDyn(&shape), elements)
            .map(Some)
            .map_err(|err| {
                AttentionError::new(
                    ErrorKind::Checkpoint,
                    format!("tensor `{name}` {shape:?} does not match its data: {err}"),
                )
            })
    }

    /// The error for a tensor that is not there, listing the names that
    /// are (so a wrong prefix shows).
    pub(crate) fn missing(&self, name: &str) -> AttentionError {
        const SHOWN: usize = 40;
        let names = self.names();
        let mut list = names
            .iter()
            .take(SHOWN)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ");
        if names.len() > SHOWN {
            list.push_str(&format!(", ... ({} in all)", names.len()));
        }
        AttentionError::new(
            ErrorKind::MissingTensor,
            format!("the checkpoint has no tensor `{name}`; it has: {list}"),
        )
    }
}

/// The element types [`Checkpoint::get`] reads, for its error message.
#[cfg(feature = "half")]
const READ: &str = "F32, F64, BF16 and F16";
#[cfg(not(feature = "half"))]
const READ: &str = "F32 and F64";

/// `prefix` and `name` joined by a `.`, unless the prefix is empty or
/// already ends in one.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() || prefix.ends_with('.') {
        format!("{prefix}{name}")
    } else {
        format!("{prefix}.{name}")
    }
}

/// Little-endian elements of `N` bytes, through `f64`, into `F`.
fn convert<F: Element, const N: usize>(
    data: &[u8],
    read: impl Fn([u8; N]) -> f64,
) -> Result<Vec<F>, AttentionError> {
    let mut out = crate::alloc::try_with_capacity("a checkpoint tensor", data.len() / N)?;
    for chunk in data.chunks_exact(N) {
        let mut bytes = [0; N];
        bytes.copy_from_slice(chunk);
        // Every f64 converts to f32 or f64 (out of range becomes ±inf).
        out.push(F::from(read(bytes)).unwrap_or_else(F::nan));
    }
    Ok(out)
}
