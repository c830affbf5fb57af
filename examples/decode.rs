//! Prints the decoding throughput: one query row per head against a long
//! KV cache, in GB/s of keys and values read, in the format of the peers'
//! `py_decode.py` (which also prints the machine's copy bandwidth).
//!
//! The header names the CPU; each line also gives the rate at which one
//! thread streams the same number of bytes with the same kernel set
//! ([`sdpa::simd::read_rate`]), measured just before, and decoding's
//! fraction of it: the floor of a memory-bound call.
//!
//! ```text
//! cargo run --release --example decode
//! RAYON_NUM_THREADS=1 H=32 D=128 cargo run --release --example decode -- 4096 16384
//! ```

use std::time::Instant;

use ndarray::Array4;
use sdpa::AttentionOptions;
use sdpa::simd::{KernelSet, available_kernel_sets, read_rate};

#[path = "support/machine.rs"]
mod machine;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median seconds of 7 runs after one warm-up.
/// [`median_seconds`] with every call of `f` on kernel set `set`.
fn median_seconds_on(set: KernelSet, f: impl FnMut()) -> f64 {
    sdpa::simd::with_kernel_set(set, || median_seconds(f)).expect("an available kernel set")
}

fn median_seconds(mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let lengths: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let lengths = if lengths.is_empty() {
        vec![4096, 16384]
    } else {
        lengths
    };
    let (heads, d) = (env_or("H", 32), env_or("D", 128));
    let sets: Vec<KernelSet> = available_kernel_sets()
        .into_iter()
        .filter(|&set| set != KernelSet::Scalar)
        .collect();
    println!("{}", machine::cpu_model());
    for &len_kv in &lengths {
        let q = Array4::<f32>::from_shape_fn((1, heads, 1, d), |(_, h, _, c)| {
            ((h * 7 + c) % 13) as f32 / 13.0 - 0.5
        });
        let k = Array4::<f32>::from_shape_fn((1, heads, len_kv, d), |(_, h, j, c)| {
            ((h + j * 3 + c * 5) % 17) as f32 / 17.0 - 0.5
        });
        let v = k.mapv(|x| x * 0.5 + 0.1);
        let mut out = Array4::<f32>::zeros((1, heads, 1, d));
        let bytes = (k.len() + v.len()) as f64 * 4.0;
        print!("decode H={heads} d={d} S={len_kv}:");
        // The streaming read of as many bytes, from a buffer of its own.
        let stream = vec![1.0_f32; k.len() + v.len()];
        for &set in &sets {
            let read = read_rate(set, &stream, 7).expect("an available kernel set");
            let opts = AttentionOptions::new().causal();
            let seconds = median_seconds_on(set, || {
                sdpa::scaled_dot_product_attention_into(
                    q.view(),
                    k.view(),
                    v.view(),
                    &opts,
                    out.view_mut(),
                )
                .expect("valid shapes");
            });
            let rate = bytes / seconds / 1e9;
            print!(
                "  sdpa_{set} {rate:.1} GB/s ({:.2} ms; read {read:.1} GB/s, {:.0}%)",
                seconds * 1e3,
                100.0 * rate / read
            );
        }
        println!();
    }
}
