//! Prints this core's limits per kernel set: the `f32` FMA peak (the floor
//! of the compute-bound forward) and a one-thread streaming read rate (the
//! floor of memory-bound decoding), with the CPU model, so that the other
//! examples' figures can be read as a fraction of the machine.
//!
//! ```text
//! cargo run --release --example peak [-- MiB]
//! ```
//!
//! The read covers 512 MiB unless given, far past any last-level cache.
//! On a CPU with AVX-512 BF16 it also prints the `vdpbf16ps` peak (32
//! multiply-adds of `bf16` pairs into `f32` per instruction), the ceiling
//! of a `bf16` forward.

use sdpa::simd::{amx_bf16_peak, available_kernel_sets, bf16_dot_peak, fma_peak, read_rate};

#[path = "support/machine.rs"]
mod machine;

fn main() -> Result<(), sdpa::AttentionError> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(512);
    println!("{}", machine::cpu_model());
    let data = vec![1.0_f32; mib << 18];
    println!(
        "{:>8} {:>18} {:>22}",
        "set", "FMA peak GFLOP/s", "read GB/s (one thread)"
    );
    for set in available_kernel_sets() {
        let peak = fma_peak(set)?;
        let read = read_rate(set, &data, 5)?;
        println!("{:>8} {peak:>18.1} {read:>22.1}", set.name());
    }
    match bf16_dot_peak() {
        Ok(peak) => println!("vdpbf16ps (AVX-512 BF16) peak: {peak:.1} GFLOP/s (one thread)"),
        Err(error) => println!("no bf16 dot-product peak: {error}"),
    }
    match amx_bf16_peak() {
        Ok(peak) => println!("tdpbf16ps (AMX-BF16) peak: {peak:.1} GFLOP/s (one thread)"),
        Err(error) => println!("no AMX peak: {error}"),
    }
    Ok(())
}
