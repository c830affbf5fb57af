//! Checkpoints written by PyTorch and Hugging Face `transformers`
//! (`scripts/make_fixtures.py` and `scripts/make_model_fixtures.py`, files
//! in `tests/fixtures/`), loaded through the layout-named constructors and
//! run through the layers and the functional API: the outputs must match
//! what torch computed from the same weights and inputs. One module per
//! source (`torch`, `hf` for single attention modules, `models` for
//! attentions observed inside whole models) and one for the errors.

mod errors;
mod hf;
mod models;
mod torch;

use ndarray::{ArrayD, Dimension};
use sdpa::{Checkpoint, Element};

/// The agreement asked of `f32` against torch's `f32` (the bound).
pub const F32_TOLERANCE: f64 = 1e-5;

/// A fixture file by name.
pub fn fixture(name: &str) -> Checkpoint {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    Checkpoint::from_file(&path).unwrap_or_else(|err| panic!("{path}: {err}"))
}

/// A tensor of the fixture, of rank `D`.
pub fn tensor<F: Element, D: Dimension>(
    checkpoint: &Checkpoint,
    name: &str,
) -> ndarray::Array<F, D> {
    checkpoint
        .tensor::<F>(name)
        .unwrap()
        .into_dimensionality::<D>()
        .unwrap()
}

/// The largest absolute difference between two arrays of the same shape.
pub fn max_difference<F: Element>(a: &ndarray::ArrayRef<F, impl Dimension>, b: &ArrayD<F>) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.iter()
        .zip(b.iter())
        .map(|(x, y)| num_traits::cast::<F, f64>(*x - *y).unwrap().abs())
        .fold(0.0, f64::max)
}
