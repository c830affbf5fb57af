//! Prints the fast `f32` path's error against the `f64` reference on random
//! normal inputs scaled by σ, as `max |err| / max |ref|` and
//! `‖err‖ / ‖ref‖`, in the format of the peers' `py_accuracy.py` (torch's
//! f32 SDPA against f64), one block per kernel set.
//!
//! ```text
//! cargo run --release --example accuracy
//! DTYPE=bf16 cargo run --release --example accuracy
//! DTYPE=f16 cargo run --release --example accuracy
//! ```
//!
//! With `DTYPE=bf16` (feature `half`), the inputs are rounded to `bf16` and
//! the reference is `sdpa::core` in `f64` on those rounded inputs; the
//! output is `bf16`, as torch's is (`scripts/half_accuracy.py bf16` prints
//! torch's bf16 SDPA the same way); `DTYPE=f16` likewise in `f16`
//! (`scripts/half_accuracy.py f16`), which runs the `f32` kernels on
//! widened inputs on every set. On a set where `bf16` runs natively
//! (AVX-512 with AVX-512 BF16) this is the `vdpbf16ps` path, or the AMX
//! tile path where the CPU has AMX ([`sdpa::simd::amx_runs_on`]), its
//! weights rounded to `bf16` for `P·V` either way.
//!
//! The last two columns are the floor: the same two errors of the `f64`
//! reference itself rounded to the output type, what a call that computed
//! exactly and rounded once would show. In `bf16` the output's rounding
//! (a relative step of 2⁻⁸) is most of either error, so a `max_rel` above
//! the floor by less than the floor's own spread over the cells says
//! little.

use ndarray::{Array4, Zip};
use sdpa::AttentionOptions;
use sdpa::simd::available_kernel_sets;

/// Standard normal numbers: SplitMix64 and the Box–Muller transform.
struct Normal(u64);

impl Normal {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn sample(&mut self) -> f64 {
        let (u, v) = (1.0 - self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn array(&mut self, dim: (usize, usize, usize, usize), sigma: f64) -> Array4<f64> {
        Array4::from_shape_simple_fn(dim, || self.sample() * sigma)
    }
}

/// The input and output type the example measures (`DTYPE`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Input {
    F32,
    Bf16,
    F16,
}

impl Input {
    fn from_env() -> Self {
        let dtype = std::env::var("DTYPE").unwrap_or_default().to_lowercase();
        let input = match dtype.as_str() {
            "" | "f32" => Input::F32,
            "bf16" => Input::Bf16,
            "f16" => Input::F16,
            other => panic!("DTYPE={other}: f32, bf16 or f16"),
        };
        assert!(
            input == Input::F32 || cfg!(feature = "half"),
            "DTYPE=bf16 and DTYPE=f16 need the half feature"
        );
        input
    }

    /// The header of kernel set `set`'s block.
    fn header(self, set: sdpa::simd::KernelSet) -> String {
        let against = "against sdpa::core in f64";
        match self {
            Input::F32 => {
                // The N = 1024 cells take the split tiles where they run.
                let tiles = if sdpa::simd::amx_runs_on(set) {
                    " (N = 1024 on AMX tiles, split in three bf16 parts)"
                } else {
                    ""
                };
                format!("sdpa f32 fused path, kernel set {set}{tiles}, {against}")
            }
            Input::Bf16 => {
                let native = sdpa::simd::bf16_dot_runs_on(set);
                let how = if native && sdpa::simd::amx_runs_on(set) {
                    "native AMX tdpbf16ps"
                } else if native {
                    "native vdpbf16ps"
                } else {
                    "converted to f32"
                };
                format!("sdpa bf16 ({how}), kernel set {set}, {against} on the same bf16 inputs")
            }
            Input::F16 => format!(
                "sdpa f16 (widened to f32), kernel set {set}, {against} on the same f16 inputs"
            ),
        }
    }
}

fn main() -> Result<(), sdpa::AttentionError> {
    let mut normal = Normal(0);
    let input = Input::from_env();
    for set in available_kernel_sets() {
        println!("{}", input.header(set));
        println!(
            "{:>5} {:>4} {:>6} {:>6} {:>10} {:>10} {:>10} {:>10}",
            "N", "d", "sigma", "causal", "max_rel", "norm_rel", "floor_max", "floor_norm"
        );
        for (n, d) in [(256, 64), (1024, 64), (1024, 128)] {
            for sigma in [1.0, 4.0] {
                for causal in [false, true] {
                    let dim = (1, 8, n, d);
                    // Half inputs: the reference runs on the rounded numbers.
                    let (q, k, v) = (
                        round(input, normal.array(dim, sigma)),
                        round(input, normal.array(dim, sigma)),
                        round(input, normal.array(dim, sigma)),
                    );
                    let opts = if causal {
                        AttentionOptions::new().causal()
                    } else {
                        AttentionOptions::new()
                    };
                    let reference = sdpa::core::scaled_dot_product_attention(
                        q.view(),
                        k.view(),
                        v.view(),
                        &opts,
                    )?;
                    let fast = fast_call(input, set, causal, &q, &k, &v)?;
                    let floor = reference.mapv(|x| round_output(input, x));
                    let [fast, floor] = [&fast, &floor].map(|y| errors(y, &reference));
                    println!(
                        "{n:>5} {d:>4} {sigma:>6.1} {:>6} {:>10.2e} {:>10.2e} {:>10.2e} {:>10.2e}",
                        if causal { "True" } else { "False" },
                        fast.0,
                        fast.1,
                        floor.0,
                        floor.1
                    );
                }
            }
        }
    }
    Ok(())
}

/// `x` in the call's input type: `f32` inputs are rounded by the call
/// itself (the reference keeps `f64`, as `py_accuracy.py` does); half
/// inputs are rounded here, so the reference sees them too.
fn round(input: Input, x: Array4<f64>) -> Array4<f64> {
    match input {
        Input::F32 => x,
        Input::Bf16 | Input::F16 => x.mapv(|x| round_to_half(input, x)),
    }
}

/// The fast call on `q`, `k`, `v` in the input type, its output widened.
fn fast_call(
    input: Input,
    set: sdpa::simd::KernelSet,
    causal: bool,
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
) -> Result<Array4<f64>, sdpa::AttentionError> {
    match input {
        Input::F32 => {
            Ok(call(set, causal, [q, k, v].map(|x| x.mapv(|x| x as f32)))?.mapv(f64::from))
        }
        Input::Bf16 | Input::F16 => half_call(input, set, causal, q, k, v),
    }
}

/// The forward on kernel set `set` in the inputs' own type.
fn call<T: sdpa::Storage>(
    set: sdpa::simd::KernelSet,
    causal: bool,
    [q, k, v]: [Array4<T>; 3],
) -> Result<Array4<T>, sdpa::AttentionError> {
    let opts = if causal {
        AttentionOptions::new().causal()
    } else {
        AttentionOptions::new()
    };
    sdpa::simd::with_kernel_set(set, || {
        sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
    })?
}

/// `max |err| / max |ref|` and `‖err‖ / ‖ref‖` of `y` against `reference`.
fn errors(y: &Array4<f64>, reference: &Array4<f64>) -> (f64, f64) {
    let (mut max_err, mut max_ref, mut err2, mut ref2) = (0f64, 0f64, 0f64, 0f64);
    Zip::from(y).and(reference).for_each(|&f, &r| {
        let e = f - r;
        max_err = max_err.max(e.abs());
        max_ref = max_ref.max(r.abs());
        err2 += e * e;
        ref2 += r * r;
    });
    (max_err / max_ref, (err2 / ref2).sqrt())
}

/// `x` rounded to the output type (the input type).
fn round_output(input: Input, x: f64) -> f64 {
    match input {
        Input::F32 => f64::from(x as f32),
        Input::Bf16 | Input::F16 => round_to_half(input, x),
    }
}

/// `x` rounded to the nearest half value of the input type.
#[cfg(feature = "half")]
fn round_to_half(input: Input, x: f64) -> f64 {
    match input {
        Input::F16 => half::f16::from_f64(x).to_f64(),
        _ => half::bf16::from_f64(x).to_f64(),
    }
}

#[cfg(not(feature = "half"))]
fn round_to_half(_: Input, _: f64) -> f64 {
    unreachable!("half inputs are refused without the half feature")
}

/// The half call on `q`, `k`, `v` (already numbers of the input type), its
/// output widened.
#[cfg(feature = "half")]
fn half_call(
    input: Input,
    set: sdpa::simd::KernelSet,
    causal: bool,
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
) -> Result<Array4<f64>, sdpa::AttentionError> {
    use half::{bf16, f16};
    Ok(match input {
        Input::F16 => {
            call(set, causal, [q, k, v].map(|x| x.mapv(f16::from_f64)))?.mapv(f16::to_f64)
        }
        _ => call(set, causal, [q, k, v].map(|x| x.mapv(bf16::from_f64)))?.mapv(bf16::to_f64),
    })
}

#[cfg(not(feature = "half"))]
fn half_call(
    _: Input,
    _: sdpa::simd::KernelSet,
    _: bool,
    _: &Array4<f64>,
    _: &Array4<f64>,
    _: &Array4<f64>,
) -> Result<Array4<f64>, sdpa::AttentionError> {
    unreachable!("half inputs are refused without the half feature")
}
