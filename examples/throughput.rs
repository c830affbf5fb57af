//! Prints `sdpa`'s attention throughput in GFLOP/s on the fast-path grid,
//! in the same format as the peers' scripts, one column per kernel set.
//!
//! ```text
//! cargo run --release --example throughput -- [--backward [--fresh]] [N ...]
//! H=8 D=64 B=1 cargo run --release --example throughput -- 256 1024 4096
//! DTYPE=f32,bf16,f16 RAYON_NUM_THREADS=1 cargo run --release --example throughput
//! ```
//!
//! `SETS=avx512` (a list of kernel set names) measures only those sets;
//! `AMX=0` keeps prefills off AMX tiles (native `bf16` on `vdpbf16ps`
//! only, `f32` on the FMA kernels), and
//! `BF16_DOT=0|1` forces `bf16` to convert or to read natively
//! ([`sdpa::simd::with_amx`], [`sdpa::simd::with_bf16_dot`]).
//! `DTYPE` is the input type, `f32` (the default), `bf16`, `f16`, or a
//! list (`f32,bf16,f16`): one column per type and kernel set, all in one
//! run, so their ratios share the machine's state. A `bf16` column on a set
//! where `bf16` runs natively ([`sdpa::simd::bf16_dot_runs_on`]: AVX-512
//! with AVX-512 BF16) reads as a fraction of the `vdpbf16ps` peak
//! ([`sdpa::simd::bf16_dot_peak`]), or where it runs on AMX tiles
//! ([`sdpa::simd::amx_runs_on`]) of the `tdpbf16ps` peak
//! ([`sdpa::simd::amx_bf16_peak`]), else of the FMA peak (the inputs are
//! converted to `f32`, as `f16` inputs always are). An `f32` column reads
//! as a fraction of the FMA peak even where its prefill splits the products
//! onto AMX tiles ([`sdpa::simd::amx_runs_on`]: `d_k` ≥ 64), so it can
//! pass 100% there. The forward only (no `--backward`) for the half types.
//!
//! FLOPs counted: `4·B·H·N²·d`, half of that for causal. With `--backward`,
//! forward (with its log-sum-exp) plus backward, counted as 3.5 times the
//! forward's FLOPs, as `../shared/peers/py_backward.py` counts torch's.
//! As the forward writes into one output array kept across calls, the
//! forward+backward writes its forward result and gradients into arrays
//! kept across calls, as a training loop does
//! (`scaled_dot_product_attention_partial_into`,
//! `scaled_dot_product_attention_backward_into`); `--fresh` measures the
//! allocating calls instead, whose new arrays are faulted in page by page
//! on every call (as torch's are). Each
//! cell is the median of repeated calls (at least 5, at least 0.3 s). The
//! thread count is rayon's (`RAYON_NUM_THREADS`).
//!
//! The header names the CPU and each kernel set's measured one-thread FMA
//! peak ([`sdpa::simd::fma_peak`]); each cell is followed by its fraction
//! of that peak (per thread: with `RAYON_NUM_THREADS=2` the fraction is of
//! two cores' peak).

use std::time::{Duration, Instant};

use half::{bf16, f16};
use ndarray::Array4;
use sdpa::simd::{
    KernelSet, amx_bf16_peak, amx_runs_on, available_kernel_sets, bf16_dot_peak, bf16_dot_runs_on,
    fma_peak,
};
use sdpa::{AttentionOptions, AttentionPartial, Storage};

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
    machine::with_bf16_choice(|| sdpa::simd::with_kernel_set(set, || median_seconds(f)))
        .expect("an available kernel set")
}

/// A forward's inputs in a half-precision type.
struct HalfInputs<H> {
    q: Array4<H>,
    k: Array4<H>,
    v: Array4<H>,
}

impl<H: Storage<Compute = f32>> HalfInputs<H> {
    /// `q`, `k` and `v` rounded to `H`.
    fn new(q: &Array4<f32>, k: &Array4<f32>, v: &Array4<f32>, round: fn(f32) -> H) -> Self {
        Self {
            q: q.mapv(round),
            k: k.mapv(round),
            v: v.mapv(round),
        }
    }

    /// The median seconds of a forward on `set`.
    fn forward_seconds(&self, set: KernelSet, opts: &AttentionOptions<'_, f32>) -> f64 {
        let mut out = Array4::<H>::zeros(self.q.dim());
        median_seconds_on(set, || {
            sdpa::scaled_dot_product_attention_into(
                self.q.view(),
                self.k.view(),
                self.v.view(),
                opts,
                out.view_mut(),
            )
            .expect("valid shapes");
        })
    }
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
    let fresh = std::env::args().any(|a| a == "--fresh");
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
        .filter(|&set| {
            std::env::var("SETS").map_or(true, |sets| sets.split(',').any(|s| s == set.name()))
        })
        .collect();
    let what = match (backward, fresh) {
        (true, false) => "forward+backward (into kept arrays)",
        (true, true) => "forward+backward (fresh arrays)",
        (false, _) => "forward",
    };
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|t| t.parse::<usize>().ok())
        .filter(|&t| t > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    println!("{}", machine::cpu_model());
    let dtypes: Vec<String> = std::env::var("DTYPE")
        .unwrap_or_else(|_| "f32".into())
        .split(',')
        .map(|t| t.trim().to_lowercase())
        .collect();
    assert!(
        dtypes
            .iter()
            .all(|t| ["f32", "bf16", "f16"].contains(&t.as_str())),
        "DTYPE takes f32, bf16, f16 or a list of them"
    );
    assert!(
        !backward || dtypes.iter().all(|t| t == "f32"),
        "--backward is measured for f32 only"
    );
    let peaks: Vec<f64> = sets
        .iter()
        .map(|&set| fma_peak(set).expect("an available kernel set"))
        .collect();
    for (set, peak) in sets.iter().zip(&peaks) {
        println!("{set}: FMA peak {peak:.1} GFLOP/s per thread (measured now)");
    }
    let dot_peak = bf16_dot_peak().ok();
    if let Some(peak) = dot_peak {
        println!("vdpbf16ps (AVX-512 BF16) peak {peak:.1} GFLOP/s per thread (measured now)");
    }
    let tile_peak = amx_bf16_peak().ok();
    if let Some(peak) = tile_peak {
        println!("tdpbf16ps (AMX-BF16) peak {peak:.1} GFLOP/s per thread (measured now)");
    }
    // (type, set, peak): bf16 on a native set against the bf16 peak.
    let columns: Vec<(&str, KernelSet, f64)> = dtypes
        .iter()
        .flat_map(|t| {
            sets.iter()
                .zip(&peaks)
                .map(move |(&set, &peak)| (t.as_str(), set, peak))
        })
        .map(|(t, set, peak)| match (t, tile_peak, dot_peak) {
            ("bf16", Some(tiles), _)
                if machine::with_bf16_choice(|| bf16_dot_runs_on(set) && amx_runs_on(set)) =>
            {
                (t, set, tiles)
            }
            ("bf16", _, Some(dot)) if machine::with_bf16_choice(|| bf16_dot_runs_on(set)) => {
                (t, set, dot)
            }
            _ => (t, set, peak),
        })
        .collect();
    println!(
        "sdpa {what} B={batch} H={heads} d={d} {}, {threads} thread(s); GFLOP/s (median, % of peak)",
        dtypes.join(",")
    );
    print!("{:>6} {:>6}", "N", "causal");
    for (t, set, _) in &columns {
        let name = if *t == "f32" {
            format!("sdpa_{set}")
        } else {
            format!("sdpa_{set}_{t}")
        };
        print!(" {name:>18}");
    }
    println!();
    for &n in &sizes {
        let q = Array4::<f32>::from_shape_fn((batch, heads, n, d), |(b, h, i, c)| {
            (((b * 31 + h * 17 + i * 7 + c * 3) % 23) as f32 - 11.0) / 11.0
        });
        let (k, v) = (q.mapv(|x| -x * 0.5), q.mapv(|x| x * 0.25 + 0.1));
        let mut out = Array4::<f32>::zeros((batch, heads, n, d));
        let as_bf16 = HalfInputs::new(&q, &k, &v, bf16::from_f32);
        let as_f16 = HalfInputs::new(&q, &k, &v, f16::from_f32);
        for causal in [false, true] {
            let flops = 4.0 * (batch * heads * n * n * d) as f64 * if causal { 0.5 } else { 1.0 };
            let flops = if backward { 3.5 * flops } else { flops };
            print!("{n:>6} {:>6}", if causal { "yes" } else { "no" });
            for &(dtype, set, peak) in &columns {
                let opts = AttentionOptions::new();
                let opts = if causal { opts.causal() } else { opts };
                let seconds = if dtype == "bf16" {
                    as_bf16.forward_seconds(set, &opts)
                } else if dtype == "f16" {
                    as_f16.forward_seconds(set, &opts)
                } else if backward {
                    let (q, k, v) = (q.view(), k.view(), v.view());
                    let partial = || sdpa::scaled_dot_product_attention_partial(q, k, v, &opts);
                    let mut forward = partial().expect("valid shapes");
                    // Any d_out will do: the work does not depend on it.
                    let d_out = forward.output().to_owned();
                    let gradients_of = |forward: &AttentionPartial<f32>| {
                        sdpa::scaled_dot_product_attention_backward(
                            q,
                            k,
                            v,
                            &opts,
                            forward,
                            d_out.view(),
                        )
                    };
                    let mut gradients = gradients_of(&forward).expect("valid shapes");
                    median_seconds_on(set, || {
                        if fresh {
                            gradients_of(&partial().expect("valid shapes")).expect("valid shapes");
                        } else {
                            sdpa::scaled_dot_product_attention_partial_into(
                                q,
                                k,
                                v,
                                &opts,
                                &mut forward,
                            )
                            .expect("valid shapes");
                            sdpa::scaled_dot_product_attention_backward_into(
                                q,
                                k,
                                v,
                                &opts,
                                &forward,
                                d_out.view(),
                                &mut gradients,
                            )
                            .expect("valid shapes");
                        }
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
