//! Prints `sdpa`'s attention throughput in GFLOP/s on the fast-path grid,
//! in the same format as the peers' scripts, one column per kernel set.
//!
//! ```text
//! cargo run --release --example throughput -- [--backward] [N ...]
//! H=8 D=64 B=1 cargo run --release --example throughput -- 256 1024 4096
//! ```
//!
//! FLOPs counted: `4·B·H·N²·d`, half of that for causal. With `--backward`,
//! forward (with its log-sum-exp) plus backward, counted as 3.5 times the
//! forward's FLOPs, as `../shared/peers/py_backward.py` counts torch's. Each
//! cell is the median of repeated calls (at least 5, at least 0.3 s). The
//! thread count is rayon's (`RAYON_NUM_THREADS`).
//!
//! The header names the CPU and each kernel set's measured one-thread FMA
//! peak ([`sdpa::simd::fma_peak`]); each cell is followed by its fraction
//! of that peak (per thread: with `RAYON_NUM_THREADS=2` the fraction is of
//! two cores' peak).

use std::time::{Duration, Instant};

use ndarray::Array4;
use sdpa::AttentionOptions;
use sdpa::simd::{KernelSet, available_kernel_sets, fma_peak};

#[path = "support/machine.rs"]
mod machine;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median seconds of `f` over at least 5 runs and at least 0.3 s.
/// [`median_seconds`] with every call of `f` on kernel set `set`.
fn median_seconds_on(set: KernelSet, f: impl FnMut()) -> f64 {
    sdpa::simd::with_kernel_set(set, || median_seconds(f)).expect("an available kernel set")
}

fn median_seconds(mut f: impl FnMut()) -> f64 {
    f();
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 5 || (start.elapsed() < Duration::from_millis(300) && times.len() < 200) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let backward = std::env::args().any(|a| a == "--backward");
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![256, 1024, 4096]
    } else {
        sizes
    };
    let (batch, heads, d) = (env_or("B", 1), env_or("H", 8), env_or("D", 64));
    let sets: Vec<KernelSet> = available_kernel_sets()
        .into_iter()
        .filter(|&set| set != KernelSet::Scalar || std::env::var("SCALAR").is_ok())
        .collect();
    let what = if backward {
        "forward+backward"
    } else {
        "forward"
    };
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|t| t.parse::<usize>().ok())
        .filter(|&t| t > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    println!("{}", machine::cpu_model());
    let peaks: Vec<f64> = sets
        .iter()
        .map(|&set| fma_peak(set).expect("an available kernel set"))
        .collect();
    for (set, peak) in sets.iter().zip(&peaks) {
        println!("{set}: FMA peak {peak:.1} GFLOP/s per thread (measured now)");
    }
    println!(
        "sdpa {what} B={batch} H={heads} d={d} f32, {threads} thread(s); GFLOP/s (median, % of peak)"
    );
    print!("{:>6} {:>6}", "N", "causal");
    for set in &sets {
        print!(" {:>18}", format!("sdpa_{set}"));
    }
    println!();
    for &n in &sizes {
        let q = Array4::<f32>::from_shape_fn((batch, heads, n, d), |(b, h, i, c)| {
            (((b * 31 + h * 17 + i * 7 + c * 3) % 23) as f32 - 11.0) / 11.0
        });
        let (k, v) = (q.mapv(|x| -x * 0.5), q.mapv(|x| x * 0.25 + 0.1));
        let mut out = Array4::<f32>::zeros((batch, heads, n, d));
        for causal in [false, true] {
            let flops = 4.0 * (batch * heads * n * n * d) as f64 * if causal { 0.5 } else { 1.0 };
            let flops = if backward { 3.5 * flops } else { flops };
            print!("{n:>6} {:>6}", if causal { "yes" } else { "no" });
            for (&set, peak) in sets.iter().zip(&peaks) {
                let opts = AttentionOptions::new();
                let opts = if causal { opts.causal() } else { opts };
                let seconds = if backward {
                    median_seconds_on(set, || {
                        let forward = sdpa::scaled_dot_product_attention_partial(
                            q.view(),
                            k.view(),
                            v.view(),
                            &opts,
                        )
                        .expect("valid shapes");
                        // Any d_out will do: the work does not depend on it.
                        sdpa::scaled_dot_product_attention_backward(
                            q.view(),
                            k.view(),
                            v.view(),
                            &opts,
                            &forward,
                            forward.output(),
                        )
                        .expect("valid shapes");
                    })
                } else {
                    median_seconds_on(set, || {
                        sdpa::scaled_dot_product_attention_into(
                            q.view(),
                            k.view(),
                            v.view(),
                            &opts,
                            out.view_mut(),
                        )
                        .expect("valid shapes");
                    })
                };
                let rate = flops / seconds / 1e9;
                let percent = 100.0 * rate / (peak * threads as f64);
                print!(" {:>11.1} ({percent:>3.0}%)", rate);
            }
            println!();
        }
    }
}
