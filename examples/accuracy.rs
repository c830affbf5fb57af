//! Prints the fast `f32` path's error against the `f64` reference on random
//! normal inputs scaled by σ, as `max |err| / max |ref|` and
//! `‖err‖ / ‖ref‖`, in the format of the peers' `py_accuracy.py` (torch's
//! f32 SDPA against f64), one block per kernel set.
//!
//! ```text
//! cargo run --release --example accuracy
//! ```

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
    for set in available_kernel_sets() {
        println!("sdpa f32 fused path, kernel set {set}, against sdpa::core in f64");
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
                    let (mut max_err, mut max_ref, mut err2, mut ref2) = (0f64, 0f64, 0f64, 0f64);
                    Zip::from(&fast).and(&reference).for_each(|&f, &r| {
                        let e = f as f64 - r;
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
            }
        }
    }
    Ok(())
}
