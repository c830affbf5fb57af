//! [`Element`]: the float types attention is computed in.

use std::fmt::{Debug, Display};

use ndarray::{LinalgScalar, ScalarOperand};
use num_traits::Float;

// The sealed trait is nameable only inside the crate, so the crate-private
// types in its signature are never visible to users.
#[allow(private_interfaces)]
pub(crate) mod sealed {
    use ndarray::{ArrayView3, ArrayView4, ArrayViewMut3, ArrayViewMut4};

    use crate::core::backward::GradientsViewMut;

    use crate::error::AttentionError;
    use crate::options::AttentionOptions;
    use crate::shape::AttentionShape;

    /// Keeps [`Element`](super::Element) to the types the crate has paths for,
    /// and routes each to its fastest path.
    /// The `Err` is for a kernel set this CPU cannot run.
    pub trait Sealed: Sized {
        /// Computes attention into `out`, and each row's log-sum-exp into
        /// `log_sum_exp` when given. The arguments were checked by
        /// `shape::check` and `out` has the output's shape.
        #[allow(clippy::too_many_arguments)]
        fn attention_into_checked(
            q: &ArrayView4<'_, Self>,
            k: &ArrayView4<'_, Self>,
            v: &ArrayView4<'_, Self>,
            opts: &AttentionOptions<'_, Self>,
            shape: &AttentionShape,
            scale: Self,
            out: ArrayViewMut4<'_, Self>,
            log_sum_exp: Option<ArrayViewMut3<'_, Self>>,
        ) -> Result<(), AttentionError>;

        /// Computes the gradients of attention into `gradients`. The
        /// arguments were checked by `core::backward::check_backward`.
        #[allow(clippy::too_many_arguments)]
        fn backward_into_checked(
            q: &ArrayView4<'_, Self>,
            k: &ArrayView4<'_, Self>,
            v: &ArrayView4<'_, Self>,
            opts: &AttentionOptions<'_, Self>,
            shape: &AttentionShape,
            scale: Self,
            out: &ArrayView4<'_, Self>,
            log_sum_exp: &ArrayView3<'_, Self>,
            d_out: &ArrayView4<'_, Self>,
            gradients: GradientsViewMut<'_, Self>,
        ) -> Result<(), AttentionError>;
    }

    impl Sealed for f32 {
        fn backward_into_checked(
            q: &ArrayView4<'_, f32>,
            k: &ArrayView4<'_, f32>,
            v: &ArrayView4<'_, f32>,
            opts: &AttentionOptions<'_, f32>,
            shape: &AttentionShape,
            scale: f32,
            out: &ArrayView4<'_, f32>,
            log_sum_exp: &ArrayView3<'_, f32>,
            d_out: &ArrayView4<'_, f32>,
            gradients: GradientsViewMut<'_, f32>,
        ) -> Result<(), AttentionError> {
            crate::fused::backward::backward_into(
                q,
                k,
                v,
                opts,
                shape,
                scale,
                out,
                log_sum_exp,
                d_out,
                gradients,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn attention_into_checked(
            q: &ArrayView4<'_, f32>,
            k: &ArrayView4<'_, f32>,
            v: &ArrayView4<'_, f32>,
            opts: &AttentionOptions<'_, f32>,
            shape: &AttentionShape,
            scale: f32,
            out: ArrayViewMut4<'_, f32>,
            log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
        ) -> Result<(), AttentionError> {
            crate::fused::attention_into(q, k, v, opts, shape, scale, out, log_sum_exp)
        }
    }

    impl Sealed for f64 {
        fn backward_into_checked(
            q: &ArrayView4<'_, f64>,
            k: &ArrayView4<'_, f64>,
            v: &ArrayView4<'_, f64>,
            opts: &AttentionOptions<'_, f64>,
            shape: &AttentionShape,
            scale: f64,
            out: &ArrayView4<'_, f64>,
            log_sum_exp: &ArrayView3<'_, f64>,
            d_out: &ArrayView4<'_, f64>,
            gradients: GradientsViewMut<'_, f64>,
        ) -> Result<(), AttentionError> {
            crate::core::backward::backward_into_checked(
                q,
                k,
                v,
                opts,
                shape,
                scale,
                out,
                log_sum_exp,
                d_out,
                gradients,
            );
            Ok(())
        }

        #[allow(clippy::too_many_arguments)]
        fn attention_into_checked(
            q: &ArrayView4<'_, f64>,
            k: &ArrayView4<'_, f64>,
            v: &ArrayView4<'_, f64>,
            opts: &AttentionOptions<'_, f64>,
            shape: &AttentionShape,
            scale: f64,
            out: ArrayViewMut4<'_, f64>,
            log_sum_exp: Option<ArrayViewMut3<'_, f64>>,
        ) -> Result<(), AttentionError> {
            crate::core::attention_into_checked(q, k, v, opts, shape, scale, out, log_sum_exp);
            Ok(())
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
