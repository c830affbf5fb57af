//! What this core can do at most, per kernel set, so a benchmark can print
//! its figures as a fraction of the machine: the FMA peak (the floor of a
//! compute-bound call, prefill) and a one-thread streaming read (the floor
//! of a memory-bound one, decode). Both are measured, never looked up: the
//! same kernel set runs at different peaks on different CPUs (two 512-bit
//! FMA ports on Sapphire Rapids and Zen 5, double-pumped ones on Zen 4).

use std::time::{Duration, Instant};

use super::kernel::{Kernel, KernelOp};
use super::vector::Vector;
use super::{KernelSet, WithKernel, with_kernel};
use crate::error::AttentionError;

/// Independent FMA chains: enough to cover the FMA latency times the FMA
/// ports of every CPU the crate targets (4–5 cycles × 2 ports), and few
/// enough to stay in AVX2's 16 registers with the two constants.
const CHAINS: usize = 12;

/// `CHAINS` dependent chains of `acc ← acc·b + c`, `rounds` steps each.
/// Returns the lanes' sum so the work cannot be dropped.
struct FmaChains {
    rounds: usize,
    /// 1 at run time, hidden from the optimiser: with constant operands
    /// the chains would fold to their fixed point and the loop vanish.
    one: f32,
}

impl KernelOp for FmaChains {
    type Output = f32;

    #[inline(always)]
    unsafe fn run<V: Vector, const R: usize, const KV: usize, const VV: usize>(self) -> f32 {
        // SAFETY (every `Vector` call): the caller promises the CPU has
        // `V`'s instruction set; no memory is touched.
        unsafe {
            // b < 1 keeps each chain at its fixed point c / (1 − b) = 1.
            let (b, c) = (V::splat(0.999 * self.one), V::splat(0.001 * self.one));
            let mut acc = [V::splat(self.one); CHAINS];
            for _ in 0..self.rounds {
                for a in &mut acc {
                    *a = a.mul_add(b, c);
                }
            }
            acc.iter().map(|a| a.reduce_sum()).sum()
        }
    }
}

/// The sum of `data`, read once with several vector accumulators.
struct StreamSum<'a> {
    data: &'a [f32],
}

impl KernelOp for StreamSum<'_> {
    type Output = f32;

    #[inline(always)]
    unsafe fn run<V: Vector, const R: usize, const KV: usize, const VV: usize>(self) -> f32 {
        const ACCUMULATORS: usize = 8;
        let block = ACCUMULATORS * V::LANES;
        let mut blocks = self.data.chunks_exact(block);
        // SAFETY (every `Vector` call): the caller promises the CPU has
        // `V`'s instruction set; each load reads `LANES` floats at
        // `chunk[i·LANES]`, inside the `block`-long chunk.
        unsafe {
            let mut acc = [V::splat(0.0); ACCUMULATORS];
            for chunk in &mut blocks {
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = a.add(V::load(chunk.as_ptr().add(i * V::LANES)));
                }
            }
            let tail: f32 = blocks.remainder().iter().sum();
            acc.iter().map(|a| a.reduce_sum()).sum::<f32>() + tail
        }
    }
}

/// Runs a probe operation on whichever kernel a set has.
struct Probe<Op>(Op);

impl<Op: KernelOp> WithKernel for Probe<Op> {
    type Output = Op::Output;

    fn run<K: Kernel>(self, kernel: K) -> Op::Output {
        kernel.run(self.0)
    }
}

/// The best (shortest) time of `f` over `repeats` runs.
fn best_seconds(repeats: usize, mut f: impl FnMut()) -> f64 {
    (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// This core's `f32` FMA peak on kernel set `set`, in GFLOP/s (an FMA is
/// two FLOPs), measured on the calling thread: independent chains of vector
/// FMAs, the best of several runs of about 20 ms (the best, because
/// anything else the machine does only ever slows a run down).
///
/// The fused forward's figures read as a fraction of this; a scalar-set
/// figure is of the scalar code's peak, not the CPU's.
///
/// ```
/// use sdpa::simd::{fma_peak, selected_kernel_set};
/// let set = selected_kernel_set()?;
/// let peak = fma_peak(set)?;
/// assert!(peak > 0.0);
/// println!("{set}: {peak:.0} GFLOP/s on one thread");
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
///
/// # Errors
/// When this CPU cannot run `set`.
pub fn fma_peak(set: KernelSet) -> Result<f64, AttentionError> {
    let lanes = with_kernel(set, LanesOf)?;
    // Calibrate the rounds to about 20 ms, then keep the best of five.
    let mut rounds = 1 << 12;
    loop {
        let seconds = best_seconds(1, || {
            std::hint::black_box(
                with_kernel(
                    set,
                    Probe(FmaChains {
                        rounds,
                        one: std::hint::black_box(1.0),
                    }),
                )
                .ok(),
            );
        });
        if seconds > 0.02 || rounds >= 1 << 30 {
            break;
        }
        rounds *= 2;
    }
    let seconds = best_seconds(5, || {
        std::hint::black_box(
            with_kernel(
                set,
                Probe(FmaChains {
                    rounds,
                    one: std::hint::black_box(1.0),
                }),
            )
            .ok(),
        );
    });
    let flops = 2.0 * (CHAINS * lanes * rounds) as f64;
    Ok(flops / seconds / 1e9)
}

/// This core's AVX-512 BF16 dot-product peak in GFLOP/s, measured on the
/// calling thread: independent chains of `vdpbf16ps` (32 multiply-adds of
/// `bf16` pairs into `f32` per instruction, 64 FLOPs), the best of five
/// runs of about 20 ms. A `bf16` forward's figures read as a fraction of
/// this, as an `f32` forward's read against [`fma_peak`].
///
/// ```
/// match sdpa::simd::bf16_dot_peak() {
///     Ok(peak) => println!("vdpbf16ps: {peak:.0} GFLOP/s on one thread"),
///     Err(error) => println!("{error}"),
/// }
/// ```
///
/// # Errors
/// When this CPU has no AVX-512 BF16 instructions.
pub fn bf16_dot_peak() -> Result<f64, AttentionError> {
    #[cfg(target_arch = "x86_64")]
    let peak = super::bf16::dot_peak();
    #[cfg(not(target_arch = "x86_64"))]
    let peak = None;
    peak.ok_or_else(|| {
        AttentionError::new(
            crate::error::ErrorKind::UnsupportedKernel,
            "this CPU has no AVX-512 BF16 instructions (vdpbf16ps)",
        )
    })
}

/// This core's AMX-BF16 peak in GFLOP/s, measured on the calling thread:
/// four independent chains of `tdpbf16ps` (16 × 16 × 32 multiply-adds of
/// `bf16` pairs into `f32` per instruction, 16384 FLOPs), the best of five
/// runs of about 20 ms. A `bf16` forward on tiles ([`super::amx_runs_on`])
/// reads as a fraction of this.
///
/// ```
/// match sdpa::simd::amx_bf16_peak() {
///     Ok(peak) => println!("tdpbf16ps: {peak:.0} GFLOP/s on one thread"),
///     Err(error) => println!("{error}"),
/// }
/// ```
///
/// # Errors
/// When this CPU has no AMX-BF16 tiles, or the OS does not grant them.
pub fn amx_bf16_peak() -> Result<f64, AttentionError> {
    #[cfg(target_arch = "x86_64")]
    let peak = super::amx::tile_peak();
    #[cfg(not(target_arch = "x86_64"))]
    let peak = None;
    peak.ok_or_else(|| {
        AttentionError::new(
            crate::error::ErrorKind::UnsupportedKernel,
            "this CPU has no AMX-BF16 tiles, or the OS does not grant them (tdpbf16ps)",
        )
    })
}

/// The rate, in GB/s (10⁹ bytes), at which the calling thread reads `data`
/// once from start to end with kernel set `set`'s vector loads: the median
/// of `passes` passes (at least one). Pass data larger than the last-level
/// cache to measure memory; the decode example passes as many bytes as a
/// step reads from its cache's keys and values.
///
/// ```
/// let data = vec![1.0_f32; 1 << 20];
/// let set = sdpa::simd::selected_kernel_set()?;
/// assert!(sdpa::simd::read_rate(set, &data, 3)? > 0.0);
/// # Ok::<(), sdpa::AttentionError>(())
/// ```
///
/// # Errors
/// When this CPU cannot run `set`.
pub fn read_rate(set: KernelSet, data: &[f32], passes: usize) -> Result<f64, AttentionError> {
    let mut times = Vec::with_capacity(passes.max(1));
    for _ in 0..passes.max(1) {
        let start = Instant::now();
        std::hint::black_box(with_kernel(set, Probe(StreamSum { data }))?);
        times.push(start.elapsed().max(Duration::from_nanos(1)).as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(std::mem::size_of_val(data) as f64 / times[times.len() / 2] / 1e9)
}

/// The vector width of a kernel set.
struct LanesOf;

impl WithKernel for LanesOf {
    type Output = usize;

    fn run<K: Kernel>(self, _: K) -> usize {
        K::LANES
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::available_kernel_sets;

    #[test]
    fn the_stream_sum_reads_every_element_once_on_every_set() {
        for set in available_kernel_sets() {
            let lanes = with_kernel(set, LanesOf).unwrap();
            for len in [0, 1, 8 * lanes - 1, 8 * lanes, 8 * lanes + 1, 1003] {
                // Small whole numbers: every partial sum is exact in f32.
                let data: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
                let sum = with_kernel(set, Probe(StreamSum { data: &data })).unwrap();
                let expected: usize = (0..len).map(|i| i % 7).sum();
                assert_eq!(sum, expected as f32, "{set}, {len} elements");
            }
        }
    }

    #[test]
    fn the_fma_chains_stay_at_their_fixed_point_on_every_set() {
        for set in available_kernel_sets() {
            let lanes = with_kernel(set, LanesOf).unwrap();
            let sum = with_kernel(
                set,
                Probe(FmaChains {
                    rounds: 1000,
                    one: 1.0,
                }),
            )
            .unwrap();
            let chains = (CHAINS * lanes) as f32;
            assert!((sum - chains).abs() < 1e-3 * chains, "{set}: {sum}");
            assert!(fma_peak(set).unwrap() > 0.0);
            assert!(read_rate(set, &[1.0; 64], 1).unwrap() > 0.0);
        }
    }
}
