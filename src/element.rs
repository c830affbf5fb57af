//! [`Element`]: the float types attention is computed in, and which path
//! each one runs.

use std::fmt::{Debug, Display};

use ndarray::{LinalgScalar, ScalarOperand};
use num_traits::Float;

// The sealed trait is nameable only inside the crate, so the crate-private
// types in its signature are never visible to users.
#[allow(private_interfaces)]
pub(crate) mod sealed {
    use ndarray::{ArrayViewMut3, ArrayViewMut4};

    use crate::call::{BackwardCall, Call};
    use crate::error::AttentionError;
    use crate::gradients::GradientsViewMut;

    /// Keeps [`Element`](super::Element) to the types the crate has paths for,
    /// and routes each to its fastest path.
    /// The `Err` is for a kernel set this CPU cannot run, or a working
    /// buffer that cannot be allocated.
    pub trait Sealed: Sized {
        /// Computes attention into `out` (of the output's shape), and each
        /// row's log-sum-exp into `log_sum_exp` when given.
        fn forward(
            call: &Call<'_, Self>,
            out: ArrayViewMut4<'_, Self>,
            log_sum_exp: Option<ArrayViewMut3<'_, Self>>,
        ) -> Result<(), AttentionError>;

        /// Computes the gradients of attention into `gradients`.
        fn backward(
            call: &BackwardCall<'_, Self>,
            gradients: GradientsViewMut<'_, Self>,
        ) -> Result<(), AttentionError>;
    }

    /// `f32` runs the fused, hand-vectorized path.
    impl Sealed for f32 {
        fn forward(
            call: &Call<'_, f32>,
            out: ArrayViewMut4<'_, f32>,
            log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
        ) -> Result<(), AttentionError> {
            crate::fused::forward(call, out, log_sum_exp)
        }

        fn backward(
            call: &BackwardCall<'_, f32>,
            gradients: GradientsViewMut<'_, f32>,
        ) -> Result<(), AttentionError> {
            crate::fused::backward(call, gradients)
        }
    }

    /// `f64` runs the reference.
    impl Sealed for f64 {
        fn forward(
            call: &Call<'_, f64>,
            out: ArrayViewMut4<'_, f64>,
            log_sum_exp: Option<ArrayViewMut3<'_, f64>>,
        ) -> Result<(), AttentionError> {
            crate::core::forward::forward(call, out, log_sum_exp)
        }

        fn backward(
            call: &BackwardCall<'_, f64>,
            gradients: GradientsViewMut<'_, f64>,
        ) -> Result<(), AttentionError> {
            crate::core::backward::backward(call, gradients)
        }
    }
}

/// A float type attention is computed in: `f32` or `f64`.
///
/// Sealed: the fast path is written for the types the crate knows. `f32`
/// calls run the fused, hand-vectorized path; `f64` calls run
/// [`core`](crate::core), the reference.
pub trait Element:
    Float + LinalgScalar + ScalarOperand + Debug + Display + Send + Sync + 'static + sealed::Sealed
{
}

impl Element for f32 {}
impl Element for f64 {}
