//! [`Storage`] and [`Element`]: the types attention reads and writes, the
//! float types it computes in, and which path each one runs.
//!
//! An [`Element`] (`f32`, `f64`) is both: its calls compute in the type
//! itself. A half-precision [`Storage`] type (`half::bf16`, `half::f16`,
//! with the `half` feature) is only stored: the functional entry points
//! read its queries, keys and values where they are and compute in its
//! [`Compute`](Storage::Compute) type (`f32`): a decoding step widens keys
//! and values as it loads them; `bf16`'s prefill packs them as `bf16`
//! pairs on CPUs with native `bf16` products; else the `f32` prefill
//! widens them as it packs them and the queries as a query tile loads
//! them, and each output row is rounded once as it is finished; the
//! softmax's `e^x` is then good to 6e-6 rather than 2 ulp, which the
//! output's rounding (2⁻⁹ or 2⁻¹²) hides (`WeightPrecision`). `core`
//! converts them to its [`Reference`](Storage::Reference) type (`f64`)
//! instead. Options of
//! a half call (scale, bias, ALiBi slopes, sinks, softcap) are given in the
//! compute type, so they are never rounded to 8 or 11 bits, and the
//! log-sum-exp, `d_bias` and `d_sinks` come back in it too.

use std::fmt::{Debug, Display};

use ndarray::{LinalgScalar, ScalarOperand};
use num_traits::Float;

// The sealed traits are nameable only inside the crate, so the
// crate-private types in their signatures are never visible to users.
#[allow(private_interfaces)]
pub(crate) mod sealed {
    #[cfg(feature = "half")]
    use half::slice::HalfFloatSliceExt;
    use ndarray::{Array, ArrayView, ArrayViewMut3, ArrayViewMut4, CowArray, Dimension};

    use super::{Element, Storage};
    #[cfg(feature = "half")]
    use crate::alloc::try_zeros;
    use crate::call::{BackwardCall, Call};
    use crate::error::AttentionError;
    use crate::gradients::GradientsViewMut;
    use crate::options::AttentionOptions;

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

        /// Gives a buffer of a [`Converted`] copy back for reuse: `f32`'s
        /// go to this thread's spares; `f64` copies are made only by the
        /// reference, whose speed is not the point, and are freed.
        fn keep_spare(buffer: Vec<Self>);
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

        fn keep_spare(buffer: Vec<f32>) {
            crate::fused::scratch::keep(buffer);
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

        fn keep_spare(buffer: Vec<f64>) {
            drop(buffer);
        }
    }

    /// An input in its compute type: a view of it when it is stored in
    /// that type, else a converted copy in a buffer from this thread's
    /// spares, given back when dropped. Fresh copies would be faulted in
    /// page by page on every call (buffers of 128 KiB or more are mapped
    /// and unmapped each time): at N = 256 a `bf16` forward ran at 56% of
    /// the `f32` one's rate (47 against 84 GFLOP/s on an Emerald Rapids
    /// Xeon), and at 85–90% once its copies were reused.
    pub struct Converted<'a, T: Element, D: Dimension>(CowArray<'a, T, D>);

    impl<'a, T: Element, D: Dimension> Converted<'a, T, D> {
        /// The input viewed in place.
        pub fn borrowed(x: ArrayView<'a, T, D>) -> Self {
            Self(CowArray::from(x))
        }

        /// A converted copy of `x`, of its shape in standard order, which
        /// `fill` makes a buffer from this thread's spares hold (with room
        /// for `x.len()` elements, and whatever it last held).
        #[cfg(feature = "half")]
        fn copied<A>(
            x: ArrayView<'_, A, D>,
            fill: impl FnOnce(ArrayView<'_, A, D>, &mut Vec<T>),
        ) -> Result<Self, AttentionError>
        where
            T: crate::fused::scratch::ScratchElement,
        {
            let mut buffer = crate::fused::scratch::spare("a converted copy of an input", x.len())?;
            let dim = x.raw_dim();
            fill(x, &mut buffer);
            let array =
                Array::from_shape_vec(dim, buffer).expect("the length is the shape's product");
            Ok(Self(CowArray::from(array)))
        }

        /// A view of the input in the compute type.
        pub fn view(&self) -> ArrayView<'_, T, D> {
            self.0.view()
        }
    }

    impl<T: Element, D: Dimension> Drop for Converted<'_, T, D> {
        fn drop(&mut self) {
            if self.0.is_owned() {
                // An empty array in its place allocates nothing.
                let empty = CowArray::from(Array::zeros(D::zeros(self.0.ndim())));
                let copy = std::mem::replace(&mut self.0, empty).into_owned();
                T::keep_spare(copy.into_raw_vec_and_offset().0);
            }
        }
    }

    /// Moves arrays between a [`Storage`](super::Storage) type and the
    /// types it computes in. For an [`Element`](super::Element) every
    /// conversion is the identity and borrows or moves without copying.
    /// Plain old data (`bytemuck::Pod`): the KV cache views mapped bytes
    /// as elements.
    pub trait Convert: Sized + bytemuck::Pod {
        /// `x` in the compute type.
        fn to_compute<'a, D: Dimension>(
            x: ArrayView<'a, Self, D>,
        ) -> Result<Converted<'a, <Self as Storage>::Compute, D>, AttentionError>
        where
            Self: Storage;

        /// `x`, computed in the compute type, in this type.
        fn from_compute<D: Dimension>(
            x: Array<<Self as Storage>::Compute, D>,
        ) -> Result<Array<Self, D>, AttentionError>
        where
            Self: Storage;

        /// `x`, in the compute type, in this type: borrowed for an
        /// `Element`; for a half type, rounded (to nearest, ties to even)
        /// into a new array.
        fn compute_to_storage<'a, D: Dimension>(
            x: ArrayView<'a, <Self as Storage>::Compute, D>,
        ) -> Result<CowArray<'a, Self, D>, AttentionError>
        where
            Self: Storage;

        /// Runs `f` on a compute-type buffer for `out`, then writes it to
        /// `out` (for an `Element`, `f` writes `out` itself).
        fn write_compute<R>(
            out: ArrayViewMut4<'_, Self>,
            f: impl FnOnce(ArrayViewMut4<'_, <Self as Storage>::Compute>) -> Result<R, AttentionError>,
        ) -> Result<R, AttentionError>
        where
            Self: Storage;

        /// Runs `f` on `x` in the compute type and keeps what it wrote: `x`
        /// itself for an `Element`; for a half type, a widened copy (in a
        /// buffer from this thread's spares) rounded back into `x` once `f`
        /// returns `Ok`.
        fn update_compute<R>(
            x: ArrayViewMut4<'_, Self>,
            f: impl FnOnce(ArrayViewMut4<'_, <Self as Storage>::Compute>) -> Result<R, AttentionError>,
        ) -> Result<R, AttentionError>
        where
            Self: Storage;

        /// `x` in the reference type.
        fn to_reference<'a, D: Dimension>(
            x: ArrayView<'a, Self, D>,
        ) -> Result<CowArray<'a, <Self as Storage>::Reference, D>, AttentionError>
        where
            Self: Storage;

        /// `x`, computed in the reference type, in this type.
        fn from_reference<D: Dimension>(
            x: Array<<Self as Storage>::Reference, D>,
        ) -> Result<Array<Self, D>, AttentionError>
        where
            Self: Storage;

        /// Runs `f` on a reference-type buffer for `out`, then writes it to
        /// `out`.
        fn write_reference<R>(
            out: ArrayViewMut4<'_, Self>,
            f: impl FnOnce(ArrayViewMut4<'_, <Self as Storage>::Reference>) -> Result<R, AttentionError>,
        ) -> Result<R, AttentionError>
        where
            Self: Storage;

        /// `x`, in the compute type, in the reference type.
        fn compute_to_reference<'a, D: Dimension>(
            x: ArrayView<'a, <Self as Storage>::Compute, D>,
        ) -> Result<CowArray<'a, <Self as Storage>::Reference, D>, AttentionError>
        where
            Self: Storage;

        /// `x`, in the reference type, in the compute type.
        fn reference_to_compute<D: Dimension>(
            x: Array<<Self as Storage>::Reference, D>,
        ) -> Result<Array<<Self as Storage>::Compute, D>, AttentionError>
        where
            Self: Storage;

        /// The forward of `call`, checked, with its queries in the compute
        /// type and its keys and values stored in this type (a functional
        /// call's or a `KvCache`'s): an `Element` runs its own path; a half
        /// type reads the keys and values as they are where its kernels can
        /// (a decoding step widens them tile by tile as it reads them, and
        /// `bf16`'s prefill packs them as `bf16` pairs on AVX-512 BF16 or
        /// AMX for `bf16` queries), else widens them as the `f32` path's
        /// prefill packs them.
        fn forward_stored(
            call: &Call<'_, <Self as Storage>::Compute, Self>,
            out: ArrayViewMut4<'_, <Self as Storage>::Compute>,
            log_sum_exp: Option<ArrayViewMut3<'_, <Self as Storage>::Compute>>,
        ) -> Result<(), AttentionError>
        where
            Self: Storage;

        /// [`forward_stored`](Self::forward_stored) with the queries and the
        /// output in this type too (a functional call's): a half type's
        /// queries are widened a query tile at a time and its output rows
        /// rounded as they are finished, never through whole `f32` copies.
        fn forward_all_stored(
            call: &Call<'_, <Self as Storage>::Compute, Self, Self>,
            out: ArrayViewMut4<'_, Self>,
            log_sum_exp: Option<ArrayViewMut3<'_, <Self as Storage>::Compute>>,
        ) -> Result<(), AttentionError>
        where
            Self: Storage;

        /// Runs `f` on `opts` with its scalars and bias in the reference type.
        fn with_reference_options<R>(
            opts: &AttentionOptions<'_, <Self as Storage>::Compute>,
            f: impl FnOnce(
                &AttentionOptions<'_, <Self as Storage>::Reference>,
            ) -> Result<R, AttentionError>,
        ) -> Result<R, AttentionError>
        where
            Self: Storage;
    }

    /// The identity conversions of a type that computes in itself.
    macro_rules! identity_convert {
        ($t:ty) => {
            impl Convert for $t {
                fn to_compute<'a, D: Dimension>(
                    x: ArrayView<'a, $t, D>,
                ) -> Result<Converted<'a, $t, D>, AttentionError> {
                    Ok(Converted::borrowed(x))
                }

                fn from_compute<D: Dimension>(
                    x: Array<$t, D>,
                ) -> Result<Array<$t, D>, AttentionError> {
                    Ok(x)
                }

                fn compute_to_storage<'a, D: Dimension>(
                    x: ArrayView<'a, $t, D>,
                ) -> Result<CowArray<'a, $t, D>, AttentionError> {
                    Ok(CowArray::from(x))
                }

                fn write_compute<R>(
                    out: ArrayViewMut4<'_, $t>,
                    f: impl FnOnce(ArrayViewMut4<'_, $t>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    f(out)
                }

                fn update_compute<R>(
                    x: ArrayViewMut4<'_, $t>,
                    f: impl FnOnce(ArrayViewMut4<'_, $t>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    f(x)
                }

                fn to_reference<'a, D: Dimension>(
                    x: ArrayView<'a, $t, D>,
                ) -> Result<CowArray<'a, $t, D>, AttentionError> {
                    Ok(CowArray::from(x))
                }

                fn from_reference<D: Dimension>(
                    x: Array<$t, D>,
                ) -> Result<Array<$t, D>, AttentionError> {
                    Ok(x)
                }

                fn write_reference<R>(
                    out: ArrayViewMut4<'_, $t>,
                    f: impl FnOnce(ArrayViewMut4<'_, $t>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    f(out)
                }

                fn compute_to_reference<'a, D: Dimension>(
                    x: ArrayView<'a, $t, D>,
                ) -> Result<CowArray<'a, $t, D>, AttentionError> {
                    Ok(CowArray::from(x))
                }

                fn reference_to_compute<D: Dimension>(
                    x: Array<$t, D>,
                ) -> Result<Array<$t, D>, AttentionError> {
                    Ok(x)
                }

                fn with_reference_options<R>(
                    opts: &AttentionOptions<'_, $t>,
                    f: impl FnOnce(&AttentionOptions<'_, $t>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    f(opts)
                }

                fn forward_stored(
                    call: &Call<'_, $t>,
                    out: ArrayViewMut4<'_, $t>,
                    log_sum_exp: Option<ArrayViewMut3<'_, $t>>,
                ) -> Result<(), AttentionError> {
                    <$t as Sealed>::forward(call, out, log_sum_exp)
                }

                fn forward_all_stored(
                    call: &Call<'_, $t>,
                    out: ArrayViewMut4<'_, $t>,
                    log_sum_exp: Option<ArrayViewMut3<'_, $t>>,
                ) -> Result<(), AttentionError> {
                    <$t as Sealed>::forward(call, out, log_sum_exp)
                }
            }
        };
    }
    identity_convert!(f32);
    identity_convert!(f64);

    /// The conversions of a half-precision type: to `f32` for the fast
    /// path, to `f64` for the reference, each a single rounding back.
    #[cfg(feature = "half")]
    macro_rules! half_convert {
        ($t:ty, widen: $widen:expr, narrow: $narrow:expr, forward: $forward:path) => {
            impl Half for $t {
                fn widen<D: Dimension>(x: ArrayView<'_, $t, D>, y: &mut Vec<f32>) {
                    convert_by_slice_into(x, y, $widen);
                }

                fn narrow(out: &mut ArrayViewMut4<'_, $t>, x: ndarray::ArrayView4<'_, f32>) {
                    write(out, x, $narrow, <$t>::from_f32);
                }
            }

            /// The fused forward's output rows, rounded as `narrow` rounds.
            impl crate::fused::Output for $t {
                const WEIGHT_PRECISION: crate::simd::WeightPrecision =
                    crate::simd::WeightPrecision::Half;

                fn store(x: &[f32], y: &mut [$t]) {
                    ($narrow)(x, y);
                }

                fn from_f32(x: f32) -> $t {
                    <$t>::from_f32(x)
                }
            }

            impl Convert for $t {
                fn to_compute<'a, D: Dimension>(
                    x: ArrayView<'a, $t, D>,
                ) -> Result<Converted<'a, f32, D>, AttentionError> {
                    Converted::copied(x, Self::widen)
                }

                fn from_compute<D: Dimension>(
                    x: Array<f32, D>,
                ) -> Result<Array<$t, D>, AttentionError> {
                    Ok(Self::compute_to_storage(x.view())?.into_owned())
                }

                fn compute_to_storage<'a, D: Dimension>(
                    x: ArrayView<'a, f32, D>,
                ) -> Result<CowArray<'a, $t, D>, AttentionError> {
                    convert_by_slice(x, $narrow).map(CowArray::from)
                }

                fn write_compute<R>(
                    out: ArrayViewMut4<'_, $t>,
                    f: impl FnOnce(ArrayViewMut4<'_, f32>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    through_compute(out, false, f)
                }

                fn update_compute<R>(
                    x: ArrayViewMut4<'_, $t>,
                    f: impl FnOnce(ArrayViewMut4<'_, f32>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    through_compute(x, true, f)
                }

                fn to_reference<'a, D: Dimension>(
                    x: ArrayView<'a, $t, D>,
                ) -> Result<CowArray<'a, f64, D>, AttentionError> {
                    let converted = convert(x, <$t>::to_f64)?;
                    Ok(CowArray::from(converted))
                }

                fn from_reference<D: Dimension>(
                    x: Array<f64, D>,
                ) -> Result<Array<$t, D>, AttentionError> {
                    convert(x.view(), <$t>::from_f64)
                }

                fn write_reference<R>(
                    mut out: ArrayViewMut4<'_, $t>,
                    f: impl FnOnce(ArrayViewMut4<'_, f64>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    let mut buffer = try_zeros("the output in f64", out.raw_dim())?;
                    let result = f(buffer.view_mut())?;
                    write(
                        &mut out,
                        buffer.view(),
                        |s, d: &mut [$t]| d.convert_from_f64_slice(s),
                        <$t>::from_f64,
                    );
                    Ok(result)
                }

                fn compute_to_reference<'a, D: Dimension>(
                    x: ArrayView<'a, f32, D>,
                ) -> Result<CowArray<'a, f64, D>, AttentionError> {
                    Ok(CowArray::from(convert(x, f64::from)?))
                }

                fn reference_to_compute<D: Dimension>(
                    x: Array<f64, D>,
                ) -> Result<Array<f32, D>, AttentionError> {
                    convert(x.view(), |x| x as f32)
                }

                fn with_reference_options<R>(
                    opts: &AttentionOptions<'_, f32>,
                    f: impl FnOnce(&AttentionOptions<'_, f64>) -> Result<R, AttentionError>,
                ) -> Result<R, AttentionError> {
                    opts.with_f64(f)
                }

                fn forward_stored(
                    call: &Call<'_, f32, $t>,
                    out: ArrayViewMut4<'_, f32>,
                    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
                ) -> Result<(), AttentionError> {
                    $forward(call, out, log_sum_exp)
                }

                fn forward_all_stored(
                    call: &Call<'_, f32, $t, $t>,
                    out: ArrayViewMut4<'_, $t>,
                    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
                ) -> Result<(), AttentionError> {
                    $forward(call, out, log_sum_exp)
                }
            }
        };
    }
    #[cfg(feature = "half")]
    // Both convert by slice: bf16 with the crate's AVX-512 conversions
    // (`simd::widen_bf16`: half's run element by element for bf16), f16
    // with half's, which use F16C where the CPU has it (measured with
    // callgrind: per element, f16 costs 16% more instructions than by
    // slice). bf16's prefill packs its keys and values as bf16 pairs where
    // the CPU runs that faster (`fused::forward_bf16`); f16's widens them
    // for the f32 path.
    half_convert!(
        half::bf16,
        widen: crate::simd::widen_bf16,
        narrow: |x: &[f32], y: &mut [half::bf16]| crate::simd::narrow_bf16(x, y),
        forward: crate::fused::forward_bf16
    );
    #[cfg(feature = "half")]
    half_convert!(
        half::f16,
        widen: |x: &[half::f16], y: &mut [f32]| x.convert_to_f32_slice(y),
        narrow: |x: &[f32], y: &mut [half::f16]| y.convert_from_f32_slice(x),
        forward: crate::fused::forward
    );

    /// The two conversions of a half-precision type that its calls make
    /// on the way to `f32` and back.
    #[cfg(feature = "half")]
    trait Half: Copy {
        /// Makes `y` hold `x` widened to `f32` (exactly), in standard order.
        fn widen<D: Dimension>(x: ArrayView<'_, Self, D>, y: &mut Vec<f32>);
        /// Writes `x` rounded to this type into `out` (the same shape).
        fn narrow(out: &mut ArrayViewMut4<'_, Self>, x: ndarray::ArrayView4<'_, f32>);
    }

    /// Runs `f` on an `f32` buffer of `x`'s shape, from this thread's
    /// spares (as `Converted` copies are), holding `x` widened when `load`
    /// and, otherwise, whatever the spare last held; rounds it into `x`
    /// when `f` returns `Ok`.
    ///
    /// Not filled when not loaded: every `f` given an output here writes
    /// every element of it — a forward (a half `KvCache`'s attention) its
    /// output, a backward (`scaled_dot_product_attention_backward_into`,
    /// which the allocating backward calls) each gradient (the `f32`
    /// calls hand them the caller's arrays as they are, and the tests
    /// fill those with NaN first, as
    /// `half_forwards_write_every_output_element_into_unfilled_spares`
    /// fills the spares).
    /// The fill was 2–4% of a `bf16` functional forward at N = 256–1024
    /// when those came through here too.
    #[cfg(feature = "half")]
    fn through_compute<T: Half, R>(
        mut x: ArrayViewMut4<'_, T>,
        load: bool,
        f: impl FnOnce(ArrayViewMut4<'_, f32>) -> Result<R, AttentionError>,
    ) -> Result<R, AttentionError> {
        let mut buffer = crate::fused::scratch::spare("an array in f32", x.len())?;
        if load {
            T::widen(x.view(), &mut buffer);
        } else {
            buffer.resize(x.len(), 0.0);
        }
        let mut buffer =
            Array::from_shape_vec(x.raw_dim(), buffer).expect("the length is the shape's product");
        let result = f(buffer.view_mut());
        if result.is_ok() {
            T::narrow(&mut x, buffer.view());
        }
        crate::fused::scratch::keep(buffer.into_raw_vec_and_offset().0);
        result
    }

    /// `x` converted element by element into a new standard-layout array.
    #[cfg(feature = "half")]
    fn convert<A: Copy, B, D: Dimension>(
        x: ArrayView<'_, A, D>,
        each: impl Fn(A) -> B,
    ) -> Result<Array<B, D>, AttentionError> {
        let mut y = crate::alloc::try_with_capacity("a converted copy of an input", x.len())?;
        let dim = x.raw_dim();
        convert_into(x, &mut y, each);
        Ok(Array::from_shape_vec(dim, y).expect("the length is the shape's product"))
    }

    /// Appends `x` converted element by element, in standard order, to
    /// `y`. By `extend` rather than into zeros: a contiguous `x` converts
    /// in one vectorizable pass, with no `memset` first.
    #[cfg(feature = "half")]
    fn convert_into<A: Copy, B, D: Dimension>(
        x: ArrayView<'_, A, D>,
        y: &mut Vec<B>,
        each: impl Fn(A) -> B,
    ) {
        match x.as_slice() {
            Some(x) => y.extend(x.iter().map(|&x| each(x))),
            None => y.extend(x.iter().map(|&x| each(x))),
        }
    }

    /// `x` converted by `slice` into a new standard-layout array.
    #[cfg(feature = "half")]
    fn convert_by_slice<A: Copy + Sync, B: Copy + Send + num_traits::Zero, D: Dimension>(
        x: ArrayView<'_, A, D>,
        slice: impl Fn(&[A], &mut [B]) + Send + Sync,
    ) -> Result<Array<B, D>, AttentionError> {
        let mut y = crate::alloc::try_with_capacity("a converted copy of an input", x.len())?;
        let dim = x.raw_dim();
        convert_by_slice_into(x, &mut y, slice);
        Ok(Array::from_shape_vec(dim, y).expect("the length is the shape's product"))
    }

    /// Makes `y` hold `x` converted by `slice` (vectorized where the CPU
    /// allows), in standard order: whole when `x` is contiguous in
    /// standard order, row by row when its rows are (a slice of a longer
    /// array, such as a decoding step's new position), else element by
    /// element. Of a reused `y`, only the elements it did not hold yet are
    /// zeroed before `slice` overwrites them all: a `memset` of a whole
    /// input measured 4% of a short `bf16` call.
    #[cfg(feature = "half")]
    fn convert_by_slice_into<A: Copy + Sync, B: Copy + Send + num_traits::Zero, D: Dimension>(
        x: ArrayView<'_, A, D>,
        y: &mut Vec<B>,
        slice: impl Fn(&[A], &mut [B]) + Send + Sync,
    ) {
        let rows_contiguous = x.ndim() > 0 && x.strides().last() == Some(&1);
        match x.as_slice() {
            Some(x) => {
                y.truncate(x.len());
                y.resize(x.len(), B::zero());
                crate::parallel::for_each_piece(x, y, slice);
            }
            None if rows_contiguous => {
                y.truncate(x.len());
                y.resize(x.len(), B::zero());
                let width = x.shape()[x.ndim() - 1];
                for (row, y) in x.rows().into_iter().zip(y.chunks_exact_mut(width.max(1))) {
                    slice(row.as_slice().expect("a row with unit stride"), y);
                }
            }
            None => {
                y.clear();
                y.extend(x.iter().map(|&x| {
                    let mut converted = B::zero();
                    slice(&[x], std::slice::from_mut(&mut converted));
                    converted
                }));
            }
        }
    }

    /// Writes `x` converted into `out` (the same shape, any strides).
    #[cfg(feature = "half")]
    fn write<A: Copy + Sync, B: Send>(
        out: &mut ArrayViewMut4<'_, B>,
        x: ndarray::ArrayView4<'_, A>,
        slice: impl Fn(&[A], &mut [B]) + Send + Sync,
        each: impl Fn(A) -> B,
    ) {
        match (x.as_slice(), out.as_slice_mut()) {
            (Some(x), Some(out)) => crate::parallel::for_each_piece(x, out, slice),
            _ => ndarray::Zip::from(out)
                .and(&x)
                .for_each(|y, &x| *y = each(x)),
        }
    }
}

/// A type attention's tensors hold: an [`Element`] (`f32`, `f64`), which
/// is also the type its calls compute in, or, with the `half` feature
/// (on by default), `half::bf16` or `half::f16`, which are stored only.
///
/// A half-precision call widens `q`, `k` and `v` to `f32` as the fused
/// path reads them (a tile at a time, never as whole copies), computes in
/// `f32` (softmax, running max and sum, accumulator and log-sum-exp) and
/// rounds each output row to the input type once.
/// Its options are `AttentionOptions<f32>`: the scale, bias, ALiBi slopes,
/// sinks and softcap are `f32`, so `1/√d_k` and a bias are not rounded to
/// the storage type; the log-sum-exp of a partial, `d_bias` and `d_sinks`
/// are `f32` as well. [`core`](crate::core) computes half-precision inputs
/// in `f64`.
///
/// Sealed: the crate has paths for these four types only.
///
/// ```
/// # #[cfg(feature = "half")] {
/// use half::bf16;
/// use ndarray::Array4;
/// use sdpa::{scaled_dot_product_attention, AttentionOptions};
///
/// let q = Array4::from_shape_fn((1, 2, 5, 8), |(_, h, i, d)| bf16::from_f32(((h + i * d) % 7) as f32 * 0.1));
/// // The options of a bf16 call are f32 (here a scale, exact in f32).
/// let opts = AttentionOptions::new().causal().scale(1.0 / 8f32.sqrt());
/// let out: Array4<bf16> = scaled_dot_product_attention(q.view(), q.view(), q.view(), &opts)?;
/// assert_eq!(out.shape(), &[1, 2, 5, 8]);
/// # }
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
pub trait Storage:
    Copy + Debug + Display + Send + Sync + 'static + num_traits::Zero + sealed::Convert
{
    /// The type the fast path computes in, which the call's options, the
    /// log-sum-exp, `d_bias` and `d_sinks` are given in: the type itself
    /// for an [`Element`], `f32` for `bf16` and `f16`.
    type Compute: Element;
    /// The type [`core`](crate::core), the reference, computes in: the
    /// type itself for an [`Element`], `f64` for `bf16` and `f16`.
    type Reference: Element;
}

/// A float type attention is computed in: `f32` or `f64`.
///
/// Sealed: the fast path is written for the types the crate knows. `f32`
/// calls run the fused, hand-vectorized path; `f64` calls run
/// [`core`](crate::core), the reference. Every `Element` is a [`Storage`]
/// type that computes in itself.
pub trait Element:
    Storage<Compute = Self, Reference = Self>
    + Float
    + LinalgScalar
    + ScalarOperand
    + Debug
    + Display
    + Send
    + Sync
    + 'static
    + sealed::Sealed
{
}

impl Storage for f32 {
    type Compute = f32;
    type Reference = f32;
}
impl Storage for f64 {
    type Compute = f64;
    type Reference = f64;
}
impl Element for f32 {}
impl Element for f64 {}

#[cfg(feature = "half")]
impl Storage for half::bf16 {
    type Compute = f32;
    type Reference = f64;
}
#[cfg(feature = "half")]
impl Storage for half::f16 {
    type Compute = f32;
    type Reference = f64;
}

#[cfg(all(test, feature = "half"))]
mod tests {
    use half::{bf16, f16};
    use ndarray::{Array3, s};

    use super::sealed::Convert;

    #[test]
    fn converted_copies_reuse_their_buffers_and_hold_only_the_new_input() {
        let big = Array3::from_shape_fn((3, 5, 7), |(i, j, k)| {
            bf16::from_f32((i * 35 + j * 7 + k) as f32)
        });
        let first = bf16::to_compute(big.view()).unwrap();
        assert_eq!(first.view(), big.mapv(f32::from));
        let address = first.view().as_ptr();
        drop(first);
        // A smaller, strided input lands in the same buffer, and nothing of
        // the first input shows through.
        let strided = big.slice(s![.., 1..4, ..;2]);
        let second = bf16::to_compute(strided).unwrap();
        assert_eq!(second.view().as_ptr(), address);
        assert_eq!(second.view(), strided.mapv(f32::from));
        assert!(second.view().is_standard_layout());
        // f16 converts by slice, contiguous or not.
        let halves = big.mapv(|x| f16::from_f32(x.to_f32() / 8.0));
        for x in [halves.view(), halves.slice(s![.., ..;2, 1..])] {
            assert_eq!(f16::to_compute(x).unwrap().view(), x.mapv(f32::from));
        }
        // Both ways, for every layout: whole, by rows (a slice whose rows
        // are contiguous), element by element (a transposed view), empty.
        let wide = big.mapv(|x| x.to_f32() * 1.001);
        let layouts = [
            wide.view(),
            wide.slice(s![.., 2..4, ..]),
            wide.slice(s![..;-1, .., 1..6]),
            wide.view().reversed_axes(),
            wide.slice(s![.., .., 3..3]),
        ];
        for x in layouts {
            let rounded = bf16::compute_to_storage(x).unwrap();
            assert_eq!(rounded, x.mapv(bf16::from_f32), "{:?}", x.strides());
            let widened = bf16::to_compute(rounded.view()).unwrap();
            assert_eq!(widened.view(), rounded.mapv(f32::from));
        }
        // An input already in the compute type is viewed in place.
        let exact = big.mapv(f32::from);
        assert_eq!(
            f32::to_compute(exact.view()).unwrap().view().as_ptr(),
            exact.as_ptr()
        );
    }

    /// A half `KvCache` computes into an `f32` buffer from this thread's
    /// spares without filling it first (`through_compute`), and every
    /// forward's working buffers are taken for writing too: with every
    /// spare holding NaN,
    /// finite inputs must still give finite outputs, on every forward path
    /// (prefill, `bf16` pairs, decoding steps, rows that see no key, empty
    /// sequences, a log-sum-exp asked for).
    #[test]
    fn half_forwards_write_every_output_element_into_unfilled_spares() {
        use crate::{AttentionOptions, Storage};
        use ndarray::Array4;

        fn poison() {
            for len in [1 << 8, 1 << 12, 1 << 15, 1 << 17, 1 << 19] {
                for _ in 0..3 {
                    crate::fused::scratch::keep(vec![f32::NAN; len]);
                }
            }
        }
        fn check<H: Storage<Compute = f32> + num_traits::Float + Send + Sync>(
            shape: [usize; 7],
            causal: bool,
        ) {
            let [batch, heads, kv_heads, len_q, len_kv, d_k, d_v] = shape;
            let value = |i: usize| H::from(((i * 37) % 101) as f32 / 50.0 - 1.0).unwrap();
            let mut n = 0;
            let mut next = || {
                n += 1;
                value(n)
            };
            let q = Array4::from_shape_simple_fn([batch, heads, len_q, d_k], &mut next);
            let k = Array4::from_shape_simple_fn([batch, kv_heads, len_kv, d_k], &mut next);
            let v = Array4::from_shape_simple_fn([batch, kv_heads, len_kv, d_v], &mut next);
            // The last batch item sees no key; in the first, rows 1..3
            // see none through the mask.
            let mut lengths = vec![len_kv; batch];
            lengths[batch - 1] = 0;
            let mut keep = Array4::from_elem([batch, 1, len_q, len_kv], true);
            keep.slice_mut(s![0, .., 1..3.min(len_q), ..]).fill(false);
            let mut opts = AttentionOptions::new()
                .key_lengths(&lengths)
                .keep_mask(keep.view());
            if causal {
                opts = opts.causal();
            }
            poison();
            let out = crate::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
                .expect("the call runs");
            assert!(
                out.iter().all(|x| x.is_finite()),
                "{shape:?} causal {causal}"
            );
            poison();
            let partial =
                crate::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)
                    .expect("the partial runs");
            assert!(partial.output().iter().all(|x| x.is_finite()), "{shape:?}");
            // The backward's gradients come through here too, into a
            // caller's arrays (`_into`, here full of NaN) or new ones.
            poison();
            let (q, k, v, d_out) = (q.view(), k.view(), v.view(), partial.output());
            let mut gradients =
                crate::scaled_dot_product_attention_backward(q, k, v, &opts, &partial, d_out)
                    .expect("the backward runs");
            for d in [&mut gradients.d_q, &mut gradients.d_k, &mut gradients.d_v] {
                assert!(d.iter().all(|x| x.is_finite()), "{shape:?} causal {causal}");
                d.fill(H::nan());
            }
            poison();
            crate::scaled_dot_product_attention_backward_into(
                q,
                k,
                v,
                &opts,
                &partial,
                d_out,
                &mut gradients,
            )
            .expect("the backward runs into a caller's arrays");
            for d in [&gradients.d_q, &gradients.d_k, &gradients.d_v] {
                assert!(
                    d.iter().all(|x| x.is_finite()),
                    "{shape:?} causal {causal} _into"
                );
            }
            // A half cache's attention computes into an unfilled `f32`
            // buffer and rounds it into the output (`through_compute`).
            if batch == 2 && !causal {
                let mut cache = crate::KvCache::<H>::new(batch, kv_heads, d_k, d_v, 0).unwrap();
                poison();
                let (k, v) = (
                    k.slice(s![.., .., ..len_q, ..]),
                    v.slice(s![.., .., ..len_q, ..]),
                );
                let out = cache.attend(q.view(), k, v).expect("the cache attends");
                assert!(out.iter().all(|x| x.is_finite()), "{shape:?} cache");
            }
        }
        // Prefills with odd dims, the bf16 pairs' shapes (d_k 64), decoding
        // steps (one and four query rows), GQA.
        let shapes = [
            [2, 2, 1, 70, 90, 33, 17],
            [2, 2, 2, 100, 130, 64, 64],
            [3, 4, 2, 1, 300, 64, 64],
            [2, 2, 1, 4, 70, 32, 48],
        ];
        for shape in shapes {
            for causal in [false, true] {
                check::<bf16>(shape, causal);
                check::<f16>(shape, causal);
            }
        }
    }
}
