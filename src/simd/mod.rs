//! Hand-vectorized `f32` kernels for the fused attention path, and the
//! run-time choice of which instruction set runs them.
//!
//! The kernels are written once, generic over a small `Vector` trait (the
//! memchr pattern), one kernel family per file:
//!
//! | file | what |
//! |---|---|
//! | `kernel.rs` | `Kernel`, what the driver sees; `KernelOp`, the shape of every kernel |
//! | `vector.rs` | `Vector`, the register operations the kernels use; `Load`, the element types they read in place (`f32`, and `bf16`/`f16` widened as loaded) |
//! | `exp.rs` | the vectorised `e^x` and its constants |
//! | `scores.rs` | `S = Q·Kᵀ`: the packed microkernel and the in-place decode kernel |
//! | `softmax.rs` | the online-softmax row pass; the backward's shifted `exp` |
//! | `values.rs` | `O ← α·O + P·V` |
//! | `layout.rs` | rows and strided weights read in place; prefetching |
//! | `panels.rs` | key rows packed into the `Q·Kᵀ` kernel's panels (transposed in registers, or gathered), with their magnitude bound |
//! | `rows.rs` | the drivers' element-wise passes: scaled copies, magnitude bounds, finiteness, dot products |
//! | `convert.rs` | `bf16` ↔ `f32` over slices, 16 at a time on AVX-512, bit for bit `half`'s; the largest `bf16` magnitude, from the bits |
//! | `probe.rs` | [`fma_peak`], [`bf16_dot_peak`], [`amx_bf16_peak`] and [`read_rate`]: this core's limits, for benchmarks |
//! | `bf16.rs` | `Bf16Dot`: Q·Kᵀ and P·V on `bf16` pairs with AVX-512 BF16 (`vdpbf16ps`), for `bf16` calls |
//! | `pair_pack.rs` | keys and values packed into the `bf16` pairs both native kernels read |
//! | `pair_kernels.rs` | `PairKernels`: which of the two runs a native `bf16` prefill |
//! | `amx.rs` | `Amx`: the same two products on AMX-BF16 tiles (`tdpbf16ps`, inline `asm!`), where the CPU and OS allow; and both of `f32` operands split into three `bf16` parts |
//! | `split.rs` | `f32` as three `bf16` parts (`x = hi + mid + lo`), and the six partial products that give `f32` accuracy on the tiles |
//!
//! Each instruction set has a file that implements `Vector` for its register
//! type and `Kernel` for a kernel type, with its register tile sizes and one
//! `#[target_feature]` trampoline into which every kernel is inlined (the
//! rten-simd dispatch pattern):
//!
//! | file | kernel set | vector | rows × key lanes (Q·Kᵀ) | rows × value lanes (P·V) |
//! |---|---|---|---|---|
//! | `scalar.rs` | [`KernelSet::Scalar`] | `f32` | 6 × 4 | 6 × 4 |
//! | `avx2.rs` | [`KernelSet::Avx2`] | `__m256` | 6 × 16 | 6 × 16 |
//! | `avx512.rs` | [`KernelSet::Avx512`] | `__m512` | 6 × 64 | 6 × 64 |
//! | `neon.rs` | [`KernelSet::Neon`] | `float32x4_t` | 6 × 16 | 6 × 16 |
//!
//! A kernel type (say `Avx512`) can only be built by its `new()`, which
//! checks the CPU: holding one is the proof that its trampoline may run,
//! which the `unsafe trait` `Kernel` states as its implementers' promise.
//! All `unsafe` of the crate lives in this module.
//!
//! The choice is made once and cached: the best set this CPU has, unless the
//! `SDPA_KERNEL` environment variable (`scalar`, `avx2`, `avx512`, `neon`)
//! forces one. [`with_kernel_set`] overrides it for a closure on the calling
//! thread (for tests and benchmarks); [`available_kernel_sets`] lists what
//! this CPU can run, so tests can check each against the reference.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;
use std::thread::LocalKey;

use crate::error::{AttentionError, ErrorKind};

#[cfg(feature = "half")]
mod convert;
mod cpu;
mod exp;
mod kernel;
mod layout;
mod panels;
mod probe;
mod rows;
mod scalar;
mod scores;
mod softmax;
mod tanh;
mod values;
mod vector;

#[cfg(target_arch = "x86_64")]
#[cfg_attr(not(feature = "half"), allow(dead_code))]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
#[cfg_attr(not(feature = "half"), allow(dead_code))]
mod bf16;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(all(target_arch = "x86_64", feature = "half"))]
mod pair_kernels;
#[cfg(all(target_arch = "x86_64", feature = "half"))]
mod pair_pack;
#[cfg(target_arch = "x86_64")]
#[cfg_attr(not(feature = "half"), allow(dead_code))]
mod split;

#[cfg(all(target_arch = "x86_64", feature = "half"))]
pub(crate) use amx::Amx;
#[cfg(all(target_arch = "x86_64", feature = "half"))]
use bf16::Bf16Dot;
#[cfg(all(target_arch = "x86_64", feature = "half"))]
pub(crate) use bf16::PAIR_KEYS;
#[cfg(feature = "half")]
pub(crate) use convert::{
    BF16_INFINITY_BITS, BF16_MAGNITUDE_BITS, bf16_magnitude_bound, max_bf16_magnitude_bits,
    narrow_bf16, widen_bf16,
};
pub(crate) use kernel::Kernel;
#[cfg(all(not(target_arch = "x86_64"), feature = "half"))]
pub(crate) use no_bf16::{PAIR_KEYS, PairKernels, pair_kernels};
#[cfg(all(target_arch = "x86_64", feature = "half"))]
pub(crate) use pair_kernels::PairKernels;
pub use probe::{amx_bf16_peak, bf16_dot_peak, fma_peak, read_rate};
pub(crate) use softmax::{SoftmaxRows, WeightPrecision};
pub(crate) use values::{ValueRows, ZeroWeights};
pub(crate) use vector::Load;

/// One set of hand-vectorized kernels, named by the instruction set it needs.
///
/// ```
/// let sets = sdpa::simd::available_kernel_sets();
/// assert!(sets.contains(&sdpa::simd::KernelSet::Scalar));
/// println!("this CPU runs {sets:?}, and calls use {}", sdpa::simd::selected_kernel_set()?);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum KernelSet {
    /// Portable Rust, one lane at a time; always available.
    Scalar,
    /// x86-64 AVX2 with FMA (8 lanes).
    Avx2,
    /// x86-64 AVX-512F (16 lanes).
    Avx512,
    /// aarch64 NEON (4 lanes).
    Neon,
}

impl KernelSet {
    /// Every kernel set the crate has, on any CPU, slowest first (more may
    /// be added in later versions).
    ///
    /// ```
    /// use sdpa::simd::KernelSet;
    /// assert_eq!(KernelSet::all()[0], KernelSet::Scalar);
    /// assert!(KernelSet::all().iter().all(|set| set.name().parse::<KernelSet>() == Ok(*set)));
    /// ```
    pub fn all() -> &'static [KernelSet] {
        &[
            KernelSet::Scalar,
            KernelSet::Avx2,
            KernelSet::Avx512,
            KernelSet::Neon,
        ]
    }

    /// The name `SDPA_KERNEL` takes for this set.
    pub fn name(self) -> &'static str {
        match self {
            KernelSet::Scalar => "scalar",
            KernelSet::Avx2 => "avx2",
            KernelSet::Avx512 => "avx512",
            KernelSet::Neon => "neon",
        }
    }

    /// Whether this CPU can run the set.
    pub fn is_available(self) -> bool {
        match self {
            KernelSet::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            KernelSet::Avx2 => avx2::Avx2::new().is_some(),
            #[cfg(target_arch = "x86_64")]
            KernelSet::Avx512 => avx512::Avx512::new().is_some(),
            #[cfg(target_arch = "aarch64")]
            KernelSet::Neon => neon::Neon::new().is_some(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

impl fmt::Display for KernelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KernelSet {
    type Err = AttentionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let names = || KernelSet::all().iter().map(|set| set.name());
        KernelSet::all()
            .iter()
            .copied()
            .find(|set| set.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                AttentionError::new(
                    ErrorKind::UnsupportedKernel,
                    format!(
                        "unknown kernel set {s:?}: expected one of {}",
                        names().collect::<Vec<_>>().join(", ")
                    ),
                )
            })
    }
}

/// Whether `bf16` forward calls on kernel set `set` read their inputs as
/// `bf16` natively rather than converting them to `f32`: on the AVX-512
/// set, on a CPU with AVX-512 BF16, with the `half` feature, where that
/// pays: where the CPU's `vdpbf16ps` outruns its `f32` FMAs (AMD's Zen 4
/// and 5: twice), or where the products run on AMX tiles
/// ([`amx_runs_on`]: Intel's Sapphire Rapids and later, whose `vdpbf16ps`
/// alone runs at half the FMA rate), unless [`with_bf16_dot`] decides
/// otherwise. Said for head dims `d_k` that are multiples of 32 (every
/// common one); where only AMX would make it pay, a call with another
/// `d_k` converts. Decoding steps (at most 8 query rows a head) widen
/// their keys and values to `f32` as they load them, in any case, and a
/// `bf16` `KvCache` attended from `f32` queries that are not all `bf16`
/// values (a layer's projections) takes the `f32` kernels, so that its
/// queries are never rounded.
///
/// The weights `P` are then taken in `bf16` for `P·V`: on `vdpbf16ps` in
/// two parts (a relative error of at most 2⁻¹⁵ each), on AMX tiles
/// rounded once (2⁻⁸ each), which moves an output by at most
/// `2⁻¹⁵·max|v|` or `2⁻⁸·max|v|` over its visible keys beyond the `f32`
/// path's error.
///
/// ```
/// use sdpa::simd::{KernelSet, bf16_dot_runs_on};
/// assert!(!bf16_dot_runs_on(KernelSet::Scalar));
/// ```
pub fn bf16_dot_runs_on(set: KernelSet) -> bool {
    #[cfg(all(target_arch = "x86_64", feature = "half"))]
    let native = pair_kernels(set, 64).is_some();
    #[cfg(not(all(target_arch = "x86_64", feature = "half")))]
    let native = {
        let _ = set;
        false
    };
    native
}

/// Whether prefills on kernel set `set` run their products on AMX-BF16
/// tiles (`tdpbf16ps`): on a CPU with AMX-TILE and AMX-BF16 whose OS
/// grants the tile state (Linux, on request at the first such call), unless
/// [`with_amx`] turns it off; only the AVX-512 set does.
///
/// - Native `bf16` forward calls (see [`bf16_dot_runs_on`]) with `d_k` a
///   multiple of 32 run both products there. Value tiles that hold NaN or
///   an infinity still run on `vdpbf16ps`, which skips zero weights.
/// - `f32` forward prefills with `d_k` a multiple of 32 and at least 64,
///   and at least 2¹⁶ unmasked scores a head, 2¹⁸ at `d_k = 64` (where
///   the tiles pay; any multiple of 32 under `with_amx(true, ..)`), split
///   every query, key, value and weight into three `bf16` parts (`x = hi +
///   mid + lo`) and sum the six partial products of order ≥ 2⁻¹⁶: `f32`
///   accuracy (measured: 0.5–1.07 times the error of an `f32` FMA sum), on
///   an Emerald Rapids Xeon 16–24% faster than the FMA kernels at `d_k =
///   128` and N = 512–2048 (causal 10–15%), 4–10% at `d_k = 64` (causal up
///   to 8%). Numbers the split cannot hold (NaN, infinities, magnitudes past `√(f32::MAX/(4·d_k))`, values
///   past 2¹²⁷) are computed in `f32`, so results mean what the FMA
///   kernels' do (but for scores that overflow: the queries carry the
///   scale here, the keys there); their bits differ from them (another
///   order of the sums), never with the thread count. Decoding steps and
///   the backward run the FMA kernels.
///
/// ```
/// use sdpa::simd::{KernelSet, amx_runs_on};
/// assert!(!amx_runs_on(KernelSet::Scalar));
/// ```
pub fn amx_runs_on(set: KernelSet) -> bool {
    #[cfg(all(target_arch = "x86_64", feature = "half"))]
    let tiles = set == KernelSet::Avx512 && amx_override() != Some(false) && Amx::new().is_some();
    #[cfg(not(all(target_arch = "x86_64", feature = "half")))]
    let tiles = {
        let _ = set;
        false
    };
    tiles
}

/// The kernels of a native `bf16` prefill on `set` with head dim `d_k`,
/// or `None` when the call converts to `f32` (see [`bf16_dot_runs_on`]).
#[cfg(all(target_arch = "x86_64", feature = "half"))]
pub(crate) fn pair_kernels(set: KernelSet, d_k: usize) -> Option<PairKernels> {
    if set != KernelSet::Avx512 {
        return None;
    }
    let dot = Bf16Dot::new()?;
    let tiles_allowed = FORCED_AMX.with(Cell::get).unwrap_or(true);
    let tiles = (tiles_allowed && Amx::takes(d_k)).then(Amx::new).flatten();
    let native = FORCED_BF16_DOT
        .with(Cell::get)
        .unwrap_or_else(|| tiles.is_some() || Bf16Dot::outruns_fma());
    native.then(|| tiles.map_or(PairKernels::Dot(dot), PairKernels::Tiles))
}

/// What [`with_amx`] set on this thread, if anything: `Some(false)` keeps
/// prefills off AMX tiles, `Some(true)` puts `f32` ones on them wherever
/// they can run (not only where they pay), `None` leaves it to the rules.
#[cfg(all(target_arch = "x86_64", feature = "half"))]
pub(crate) fn amx_override() -> Option<bool> {
    FORCED_AMX.with(Cell::get)
}

/// Runs `f` with the `bf16` forward calls it makes on this thread reading
/// `bf16` natively (`native`, where [`bf16_dot_runs_on`] could at all: the
/// AVX-512 set on a CPU with AVX-512 BF16) or converting to `f32` (`!native`),
/// whatever this CPU's default: for tests and benchmarks that compare the
/// two. The previous choice is restored when `f` returns or panics; calls
/// nest, and cover what [`with_kernel_set`]'s would.
///
/// ```
/// use sdpa::simd::{KernelSet, bf16_dot_runs_on, with_bf16_dot};
///
/// assert!(!with_bf16_dot(false, || bf16_dot_runs_on(KernelSet::Avx512)));
/// assert!(!with_bf16_dot(true, || bf16_dot_runs_on(KernelSet::Scalar)));
/// ```
pub fn with_bf16_dot<R>(native: bool, f: impl FnOnce() -> R) -> R {
    with_forced(&FORCED_BF16_DOT, native, f)
}

/// Runs `f` with the prefills it makes on this thread on AMX tiles
/// ([`amx_runs_on`]) or not: for tests and benchmarks that compare the
/// two. `enabled` puts native `bf16` prefills on the tiles where they take
/// the head dim (as by default) and `f32` prefills wherever the tiles can
/// run them (`d_k` a multiple of 32), also where the rule that decides by
/// default says they do not pay; `!enabled` keeps native `bf16` on
/// `vdpbf16ps` only and `f32` on the FMA kernels. Restored when `f`
/// returns or panics; calls nest.
///
/// ```
/// use sdpa::simd::{KernelSet, amx_runs_on, with_amx};
///
/// assert!(!with_amx(false, || amx_runs_on(KernelSet::Avx512)));
/// ```
pub fn with_amx<R>(enabled: bool, f: impl FnOnce() -> R) -> R {
    with_forced(&FORCED_AMX, enabled, f)
}

/// Runs `f` with this thread's override `slot` set to `value`, and puts
/// the previous override back when `f` returns or unwinds (so calls nest).
fn with_forced<T: Copy + 'static, R>(
    slot: &'static LocalKey<Cell<Option<T>>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    /// Puts the previous override back, also when `f` unwinds.
    struct Restore<T: Copy + 'static>(&'static LocalKey<Cell<Option<T>>>, Option<T>);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|forced| forced.set(self.1));
        }
    }
    let _restore = Restore(slot, slot.with(|forced| forced.replace(Some(value))));
    f()
}

/// The kernel sets this CPU can run, slowest first.
pub fn available_kernel_sets() -> Vec<KernelSet> {
    KernelSet::all()
        .iter()
        .copied()
        .filter(|set| set.is_available())
        .collect()
}

/// The kernel set `f32` attention calls use: `SDPA_KERNEL` if it is set,
/// else the fastest this CPU has. Decided at the first call and cached.
///
/// # Errors
/// When `SDPA_KERNEL` names an unknown set, or one this CPU lacks.
pub fn selected_kernel_set() -> Result<KernelSet, AttentionError> {
    static SELECTED: OnceLock<Result<KernelSet, AttentionError>> = OnceLock::new();
    SELECTED
        .get_or_init(|| match std::env::var("SDPA_KERNEL") {
            Ok(name) if !name.trim().is_empty() => {
                let set: KernelSet = name.parse()?;
                check_available(set)
            }
            _ => Ok(*available_kernel_sets()
                .last()
                .expect("the scalar set is always available")),
        })
        .clone()
}

thread_local! {
    /// The set [`with_kernel_set`] forces on this thread, if any.
    static FORCED: Cell<Option<KernelSet>> = const { Cell::new(None) };
    /// The `bf16` path [`with_bf16_dot`] forces on this thread, if any.
    static FORCED_BF16_DOT: Cell<Option<bool>> = const { Cell::new(None) };
    /// Whether [`with_amx`] lets this thread's native `bf16` calls use AMX.
    static FORCED_AMX: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Runs `f` with every `f32` attention call it makes on this thread using
/// the kernel set `set`, instead of [`selected_kernel_set`]: for tests and
/// benchmarks that compare kernel sets. The previous choice is restored
/// when `f` returns or panics; calls nest.
///
/// A call chooses its set on the calling thread when it starts, before it
/// splits its work over threads, so the override covers all of its work;
/// calls that `f` makes on other threads it spawns are not covered.
///
/// ```
/// use sdpa::simd::{available_kernel_sets, with_kernel_set};
/// use sdpa::{AttentionOptions, scaled_dot_product_attention};
///
/// let x = ndarray::Array4::<f32>::ones((1, 2, 8, 16));
/// let opts = AttentionOptions::new().causal();
/// for set in available_kernel_sets() {
///     let out = with_kernel_set(set, || {
///         scaled_dot_product_attention(x.view(), x.view(), x.view(), &opts)
///     })??;
///     assert_eq!(out.dim(), (1, 2, 8, 16));
/// }
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
///
/// # Errors
/// When this CPU cannot run `set` (then `f` is not run).
pub fn with_kernel_set<R>(set: KernelSet, f: impl FnOnce() -> R) -> Result<R, AttentionError> {
    check_available(set)?;
    Ok(with_forced(&FORCED, set, f))
}

/// The kernel set a call starting now on this thread runs on: the one
/// [`with_kernel_set`] forces, else [`selected_kernel_set`]. The driver
/// reads it once, at the start of a call on the calling thread, before any
/// work goes to other threads; so a thread-local override is enough.
///
/// # Errors
/// As [`selected_kernel_set`].
pub(crate) fn current_kernel_set() -> Result<KernelSet, AttentionError> {
    match FORCED.with(Cell::get) {
        Some(set) => Ok(set),
        None => selected_kernel_set(),
    }
}

/// `Ok(set)` when this CPU can run `set`.
pub(crate) fn check_available(set: KernelSet) -> Result<KernelSet, AttentionError> {
    if set.is_available() {
        Ok(set)
    } else {
        Err(unavailable(set))
    }
}

fn unavailable(set: KernelSet) -> AttentionError {
    AttentionError::new(
        ErrorKind::UnsupportedKernel,
        format!(
            "kernel set {set} is not supported by this CPU (available: {:?})",
            available_kernel_sets()
        ),
    )
}

/// Code generic over a kernel, run with the kernel set chosen at run time.
///
/// `run` itself is ordinary code, not compiled for the set's target
/// features: the driver hands its work to rayon as closures, and a closure
/// takes target features only from the function it is written in, so a
/// trampoline around `run` would not reach the kernels. Each [`Kernel`]
/// call enters the set's trampoline instead, once per tile.
pub(crate) trait WithKernel {
    /// What the code returns.
    type Output;
    /// Runs the code with kernel `kernel`.
    fn run<K: Kernel>(self, kernel: K) -> Self::Output;
}

/// Runs `job` with the kernels of `set`.
///
/// # Errors
/// When this CPU cannot run `set`.
pub(crate) fn with_kernel<J: WithKernel>(
    set: KernelSet,
    job: J,
) -> Result<J::Output, AttentionError> {
    match set {
        KernelSet::Scalar => Ok(job.run(scalar::Scalar)),
        #[cfg(target_arch = "x86_64")]
        KernelSet::Avx2 => match avx2::Avx2::new() {
            Some(kernel) => Ok(job.run(kernel)),
            None => Err(unavailable(set)),
        },
        #[cfg(target_arch = "x86_64")]
        KernelSet::Avx512 => match avx512::Avx512::new() {
            Some(kernel) => Ok(job.run(kernel)),
            None => Err(unavailable(set)),
        },
        #[cfg(target_arch = "aarch64")]
        KernelSet::Neon => match neon::Neon::new() {
            Some(kernel) => Ok(job.run(kernel)),
            None => Err(unavailable(set)),
        },
        #[allow(unreachable_patterns)]
        _ => Err(unavailable(set)),
    }
}

/// Where the CPU has no AVX-512 BF16 instructions at all: kernels that
/// cannot be built, so the driver compiles and never takes the path.
#[cfg(all(not(target_arch = "x86_64"), feature = "half"))]
mod no_bf16 {
    /// No value of this type exists.
    #[derive(Debug, Clone, Copy)]
    enum Never {}

    pub(crate) const PAIR_KEYS: usize = 64;

    /// The native `bf16` kernels, which this architecture does not have.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct PairKernels(Never);

    impl PairKernels {
        pub(crate) fn computed_rows(rows: usize) -> usize {
            rows
        }

        pub(crate) fn scores(
            self,
            _: &[u32],
            _: usize,
            _: &[u32],
            _: f32,
            _: &mut [f32],
            _: usize,
        ) {
            match self.0 {}
        }

        #[allow(clippy::too_many_arguments)]
        pub(crate) fn accumulate_values(
            self,
            _: &[f32],
            _: usize,
            _: &[u32],
            _: usize,
            _: &[f32],
            _: &mut [f32],
            _: bool,
        ) {
            match self.0 {}
        }

        pub(crate) fn finish(self) {
            match self.0 {}
        }

        pub(crate) fn on_tiles(self) -> bool {
            match self.0 {}
        }

        pub(crate) fn pack_keys(self, _: &[half::bf16], _: usize, _: &mut [u32]) {
            match self.0 {}
        }

        pub(crate) fn pack_values(
            self,
            _: &[half::bf16],
            _: usize,
            _: usize,
            _: &mut [u32],
            _: &mut [bool],
        ) {
            match self.0 {}
        }
    }

    /// Never any: see [`super::bf16_dot_runs_on`].
    pub(crate) fn pair_kernels(_: super::KernelSet, _: usize) -> Option<PairKernels> {
        None
    }
}

#[cfg(test)]
mod tests;
