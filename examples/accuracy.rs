//! Prints the fast `f32` path's error against the `f64` reference on random
//! normal inputs scaled by σ, as `max |err| / max |ref|` and
//! `‖err‖ / ‖ref‖`, in the format of the peers' `py_accuracy.py` (torch's
//! f32 SDPA against f64), one block per kernel set.
//!
//! ```text
//! cargo run --release --example accuracy
//! DTYPE=bf16 cargo run --release --example accuracy
//! ```
//!
//! With `DTYPE=bf16` (feature `half`), the inputs are rounded to `bf16` and
//! the reference is `sdpa::core` in `f64` on those rounded inputs; the
//! output is `bf16`, as torch's is (`scripts/bf16_accuracy.py` prints
//! torch's bf16 SDPA the same way). On a set where `bf16` runs natively
//! (AVX-512 with AVX-512 BF16) this is the `vdpbf16ps` path, or the AMX
//! tile path where the CPU has AMX ([`sdpa::simd::amx_runs_on`]), its
//! weights rounded to `bf16` for `P·V` either way.

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

fn main() -> Result<(), sdpa::AttentionError> {
    let mut normal = Normal(0);
    let bf16_inputs = std::env::var("DTYPE").is_ok_and(|t| t.eq_ignore_ascii_case("bf16"));
    assert!(
        !bf16_inputs || cfg!(feature = "half"),
        "DTYPE=bf16 needs the half feature"
    );
    for set in available_kernel_sets() {
        if bf16_inputs {
            let how = if sdpa::simd::amx_runs_on(set) {
                "native AMX tdpbf16ps"
            } else if sdpa::simd::bf16_dot_runs_on(set) {
                "native vdpbf16ps"
            } else {
                "converted to f32"
            };
            println!(
                "sdpa bf16 ({how}), kernel set {set}, against sdpa::core in f64 on the same bf16 inputs"
            );
        } else {
            println!("sdpa f32 fused path, kernel set {set}, against sdpa::core in f64");
        }
        println!(
            "{:>5} {:>4} {:>6} {:>6} {:>10} {:>10}",
            "N", "d", "sigma", "causal", "max_rel", "norm_rel"
        );
        for (n, d) in [(256, 64), (1024, 64), (1024, 128)] {
            for sigma in [1.0, 4.0] {
                for causal in [false, true] {
                    let dim = (1, 8, n, d);
                    let (q, k, v) = (
                        normal.array(dim, sigma),
                        normal.array(dim, sigma),
                        normal.array(dim, sigma),
                    );
                    // bf16 inputs: the reference runs on the rounded numbers.
                    let round = |x: Array4<f64>| {
                        if bf16_inputs {
                            x.mapv(round_to_bf16)
                        } else {
                            x
                        }
                    };
                    let (q, k, v) = (round(q), round(k), round(v));
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
                    if bf16_inputs {
                        let fast = bf16_call(set, causal, &q, &k, &v)?;
                        print_errors(n, d, sigma, causal, &fast, &reference);
                        continue;
                    }
                    let to_f32 = |x: &Array4<f64>| x.mapv(|x| x as f32);
                    let fast_opts = if causal {
                        AttentionOptions::new().causal()
                    } else {
                        AttentionOptions::new()
                    };
                    let fast = sdpa::simd::with_kernel_set(set, || {
                        sdpa::scaled_dot_product_attention(
                            to_f32(&q).view(),
                            to_f32(&k).view(),
                            to_f32(&v).view(),
                            &fast_opts,
                        )
                    })??;
                    print_errors(n, d, sigma, causal, &fast.mapv(f64::from), &reference);
                }
            }
        }
    }
    Ok(())
}

/// One line: `max |err| / max |ref|` and `‖err‖ / ‖ref‖`.
fn print_errors(
    n: usize,
    d: usize,
    sigma: f64,
    causal: bool,
    fast: &Array4<f64>,
    reference: &Array4<f64>,
) {
    let (mut max_err, mut max_ref, mut err2, mut ref2) = (0f64, 0f64, 0f64, 0f64);
    Zip::from(fast).and(reference).for_each(|&f, &r| {
        let e = f - r;
        max_err = max_err.max(e.abs());
        max_ref = max_ref.max(r.abs());
        err2 += e * e;
        ref2 += r * r;
    });
    println!(
        "{n:>5} {d:>4} {sigma:>6.1} {:>6} {:>10.2e} {:>10.2e}",
        if causal { "True" } else { "False" },
        max_err / max_ref,
        (err2 / ref2).sqrt()
    );
}

/// `x` rounded to the nearest `bf16`.
#[cfg(feature = "half")]
fn round_to_bf16(x: f64) -> f64 {
    half::bf16::from_f64(x).to_f64()
}

#[cfg(not(feature = "half"))]
fn round_to_bf16(_: f64) -> f64 {
    unreachable!("DTYPE=bf16 is refused without the half feature")
}

/// The `bf16` call on `q`, `k`, `v` (already `bf16` numbers), widened.
#[cfg(feature = "half")]
fn bf16_call(
    set: sdpa::simd::KernelSet,
    causal: bool,
    q: &Array4<f64>,
    k: &Array4<f64>,
    v: &Array4<f64>,
) -> Result<Array4<f64>, sdpa::AttentionError> {
    use half::bf16;
    let opts = if causal {
        AttentionOptions::new().causal()
    } else {
        AttentionOptions::new()
    };
    let (q, k, v) = (
        q.mapv(bf16::from_f64),
        k.mapv(bf16::from_f64),
        v.mapv(bf16::from_f64),
    );
    let out = sdpa::simd::with_kernel_set(set, || {
        sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
    })??;
    Ok(out.mapv(bf16::to_f64))
}

#[cfg(not(feature = "half"))]
fn bf16_call(
    _: sdpa::simd::KernelSet,
    _: bool,
    _: &Array4<f64>,
    _: &Array4<f64>,
    _: &Array4<f64>,
) -> Result<Array4<f64>, sdpa::AttentionError> {
    unreachable!("DTYPE=bf16 is refused without the half feature")
}
