//! Prints the decoding throughput: one query row per head against a long
//! KV cache, in GB/s of keys and values read, in the format of the peers'
//! `py_decode.py` (which also prints the machine's copy bandwidth).
//!
//! The header names the CPU; each line also gives the rate at which one
//! thread streams the same number of bytes with the same kernel set
//! ([`sdpa::simd::read_rate`]), measured just before, and decoding's
//! fraction of it: the floor of a memory-bound call.
//!
//! With `DTYPE=bf16` or `DTYPE=f16` it also times a `KvCache` step (the
//! `S`-th token appended and attended, `f32` projections) on an `f32`
//! cache and on a cache of that type, per kernel set in the same run, and
//! prints the half cache's time as a fraction of the `f32` cache's: the
//! half cache reads half the bytes.
//!
//! `KV` sets the number of key/value heads (default `H`, one per query
//! head): `KV=8` with `H=32` is a grouped-query model's step (Llama's
//! layout), whose keys and values are a quarter of the bytes.
//!
//! ```text
//! cargo run --release --example decode
//! RAYON_NUM_THREADS=1 H=32 D=128 cargo run --release --example decode -- 4096 16384
//! RAYON_NUM_THREADS=1 DTYPE=bf16 cargo run --release --example decode -- 4096 16384
//! ```

use std::time::Instant;

use ndarray::Array4;
#[cfg(feature = "half")]
use ndarray::s;
use sdpa::AttentionOptions;
use sdpa::simd::{KernelSet, available_kernel_sets, read_rate};
#[cfg(feature = "half")]
use sdpa::{KvCache, Storage};

#[path = "support/machine.rs"]
mod machine;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// [`median_seconds`] with every call of `f` on kernel set `set`.
fn median_seconds_on(set: KernelSet, f: impl FnMut()) -> f64 {
    sdpa::simd::with_kernel_set(set, || median_seconds(f)).expect("an available kernel set")
}

/// Median seconds of 7 runs after one warm-up.
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

/// [`paired_steps`] for one half type.
#[cfg(feature = "half")]
type PairedSteps = fn(KernelSet, &Array4<f32>, &Array4<f32>, &Array4<f32>) -> (f64, f64, f64);

/// A `KvCache<H>` holding the first `S − 1` positions of `k`, `v`.
#[cfg(feature = "half")]
fn filled_cache<H: Storage<Compute = f32>>(k: &Array4<f32>, v: &Array4<f32>) -> KvCache<H> {
    let (_, heads, len_kv, d) = k.dim();
    let mut cache = KvCache::<H>::new(1, heads, d, d, len_kv).expect("room for the cache");
    let held = s![.., .., ..len_kv - 1, ..];
    cache
        .append_compute(k.slice(held), v.slice(held))
        .expect("valid shapes");
    cache
}

/// One decoding step on `cache`: the `S`-th position appended and
/// attended (`f32` projections, rounded on write for a half cache), then
/// truncated away again (which only moves the length) for the next run.
#[cfg(feature = "half")]
fn cache_step<H: Storage<Compute = f32>>(
    cache: &mut KvCache<H>,
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
) {
    let len_kv = k.dim().2;
    let last = s![.., .., len_kv - 1.., ..];
    cache.truncate(len_kv - 1).expect("a growing cache");
    cache
        .attend_compute(q.view(), k.slice(last), v.slice(last))
        .expect("valid shapes");
}

/// Median seconds of an `f32` cache's step and an `H` cache's, and the
/// median of their ratios, over 9 pairs run alternately on kernel set
/// `set` after a warm-up: both see the same machine load, which on a
/// shared machine moves more than either's own variation.
#[cfg(feature = "half")]
fn paired_steps<H: Storage<Compute = f32>>(
    set: KernelSet,
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
) -> (f64, f64, f64) {
    let (mut full, mut half) = (filled_cache::<f32>(k, v), filled_cache::<H>(k, v));
    sdpa::simd::with_kernel_set(set, || {
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        };
        cache_step(&mut full, q, k, v);
        cache_step(&mut half, q, k, v);
        let mut pairs: Vec<(f64, f64)> = (0..9)
            .map(|_| {
                let a = time(&mut || cache_step(&mut full, q, k, v));
                let b = time(&mut || cache_step(&mut half, q, k, v));
                (a, b)
            })
            .collect();
        let median = |mut x: Vec<f64>| {
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let ratio = median(pairs.iter().map(|(a, b)| b / a).collect());
        pairs.sort_by(|x, y| x.0.total_cmp(&y.0));
        let f32_step = pairs[pairs.len() / 2].0;
        (f32_step, median(pairs.iter().map(|p| p.1).collect()), ratio)
    })
    .expect("an available kernel set")
}

fn main() {
    #[cfg(feature = "half")]
    let dtype = std::env::var("DTYPE").unwrap_or_default();
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
    let kv_heads = env_or("KV", heads);
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads),
        "KV must divide H"
    );
    let sets: Vec<KernelSet> = available_kernel_sets()
        .into_iter()
        .filter(|&set| set != KernelSet::Scalar)
        .collect();
    println!("{}", machine::cpu_model());
    for &len_kv in &lengths {
        let q = Array4::<f32>::from_shape_fn((1, heads, 1, d), |(_, h, _, c)| {
            ((h * 7 + c) % 13) as f32 / 13.0 - 0.5
        });
        let k = Array4::<f32>::from_shape_fn((1, kv_heads, len_kv, d), |(_, h, j, c)| {
            ((h + j * 3 + c * 5) % 17) as f32 / 17.0 - 0.5
        });
        let v = k.mapv(|x| x * 0.5 + 0.1);
        let mut out = Array4::<f32>::zeros((1, heads, 1, d));
        let bytes = (k.len() + v.len()) as f64 * 4.0;
        print!("decode H={heads} KV={kv_heads} d={d} S={len_kv}:");
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
        #[cfg(feature = "half")]
        {
            let paired: PairedSteps = match dtype.as_str() {
                "bf16" => paired_steps::<sdpa::half::bf16>,
                "f16" => paired_steps::<sdpa::half::f16>,
                _ => continue,
            };
            print!("cache step H={heads} KV={kv_heads} d={d} S={len_kv}:");
            for &set in &sets {
                let (f32_step, step, ratio) = paired(set, &q, &k, &v);
                print!(
                    "  {set}: f32 {:.2} ms, {dtype} {:.2} ms ({ratio:.2}x, {:.1} GB/s)",
                    f32_step * 1e3,
                    step * 1e3,
                    bytes / 2.0 / step / 1e9
                );
            }
            println!();
        }
    }
}
