//! Criterion benchmarks of scaled dot-product attention, `f32`, on the grid
//! batch 1, 8 heads, head dim d ∈ {64, 128}, sequence length
//! N ∈ {256, 1024, 4096} (len_q = len_kv = N), full and causal.
//!
//! Throughput is reported as `Throughput::Elements(flops)` with
//! flops = 4·B·H·N²·d (the two matrix products Q·Kᵀ and P·V, 2·N²·d each
//! per head), half of that for causal. Criterion then prints FLOP/s under
//! the name "elements/s": `85.3 Gelem/s` means 85.3 GFLOP/s.
//!
//! Groups, one per path, each over the same grid:
//! - `core`: `sdpa::core::scaled_dot_product_attention_into`, the reference
//!   (N ≤ 1024 only: it is slow and holds N² weights per head);
//! - `fused_<set>`: `sdpa::scaled_dot_product_attention_into`, the fused
//!   path, forced to each kernel set this CPU has (`fused_avx512`, …).
//!
//! Then `forward_backward`: the forward with its log-sum-exp and the
//! backward pass, d = 64, counted as 3.5 times the forward's FLOPs. And
//! `decode`: one query row per head against a KV cache of S keys
//! (H = 32, d = 128), throughput in bytes of K and V read, so criterion
//! prints GB/s.
//!
//! `cargo bench --bench attention -- fused_avx512/d64` runs a part of the
//! grid; `RAYON_NUM_THREADS=1 cargo bench` measures one thread.

use std::hint::black_box;
use std::time::Duration;

use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group,
    criterion_main, measurement::WallTime,
};
use ndarray::{Array4, ArrayView4, ArrayViewMut4};
use sdpa::simd::{KernelSet, available_kernel_sets};
use sdpa::{AttentionError, AttentionOptions};

const BATCH: usize = 1;
const HEADS: usize = 8;
const HEAD_DIMS: [usize; 2] = [64, 128];
const LENGTHS: [usize; 3] = [256, 1024, 4096];

/// A function computing attention into `out`, like the crate's `_into` calls.
type IntoFn = Box<
    dyn Fn(
        ArrayView4<'_, f32>,
        ArrayView4<'_, f32>,
        ArrayView4<'_, f32>,
        &AttentionOptions<'_, f32>,
        ArrayViewMut4<'_, f32>,
    ) -> Result<(), AttentionError>,
>;

/// One benchmarked path: the group's name, the function, and the longest
/// sequence it runs (slow paths skip the long ones).
struct Path {
    group: String,
    run: IntoFn,
    max_len: usize,
}

/// The groups to run: the reference, then the fused path once per kernel
/// set this CPU has (the portable scalar set only up to N = 1024).
fn paths() -> Vec<Path> {
    let mut paths = vec![Path {
        group: "core".into(),
        run: Box::new(sdpa::core::scaled_dot_product_attention_into::<f32>),
        max_len: 1024,
    }];
    for set in available_kernel_sets() {
        paths.push(Path {
            group: format!("fused_{set}"),
            run: Box::new(move |q, k, v, opts, out| {
                sdpa::simd::with_kernel_set(set, || {
                    sdpa::scaled_dot_product_attention_into(q, k, v, opts, out)
                })?
            }),
            max_len: if set == KernelSet::Scalar {
                1024
            } else {
                usize::MAX
            },
        });
    }
    paths
}

/// One point of the grid.
#[derive(Debug, Clone, Copy)]
struct Shape {
    head_dim: usize,
    len: usize,
    causal: bool,
}

impl Shape {
    fn grid() -> impl Iterator<Item = Shape> {
        HEAD_DIMS.into_iter().flat_map(|head_dim| {
            LENGTHS.into_iter().flat_map(move |len| {
                [false, true].map(|causal| Shape {
                    head_dim,
                    len,
                    causal,
                })
            })
        })
    }

    /// 4·B·H·N²·d, half for causal (the masked half is not work).
    fn flops(&self) -> u64 {
        let full = 4 * BATCH * HEADS * self.len * self.len * self.head_dim;
        (if self.causal { full / 2 } else { full }) as u64
    }

    /// The benchmark's name inside its group, e.g. `d64/causal/1024`.
    fn id(&self) -> BenchmarkId {
        let mask = if self.causal { "causal" } else { "full" };
        BenchmarkId::new(format!("d{}/{mask}", self.head_dim), self.len)
    }

    fn options(&self) -> AttentionOptions<'static, f32> {
        if self.causal {
            AttentionOptions::new().causal()
        } else {
            AttentionOptions::new()
        }
    }

    /// Long runs take seconds per call: fewer, evenly sized samples keep
    /// the whole grid to minutes.
    fn configure(&self, group: &mut BenchmarkGroup<'_, WallTime>) {
        if self.len >= 4096 {
            group
                .sample_size(10)
                .sampling_mode(SamplingMode::Flat)
                .warm_up_time(Duration::from_secs(1))
                .measurement_time(Duration::from_secs(10));
        } else {
            group
                .sample_size(20)
                .sampling_mode(SamplingMode::Auto)
                .warm_up_time(Duration::from_secs(1))
                .measurement_time(Duration::from_secs(3));
        }
    }
}

/// `q`, `k`, `v` of one shape and a preallocated `out`.
struct Problem {
    q: Array4<f32>,
    k: Array4<f32>,
    v: Array4<f32>,
    out: Array4<f32>,
}

impl Problem {
    /// Deterministic values in [-1, 1), different for q, k and v.
    fn new(shape: &Shape) -> Self {
        let dim = (BATCH, HEADS, shape.len, shape.head_dim);
        let fill = |salt: u64| {
            let mut state = salt;
            Array4::from_shape_simple_fn(dim, || {
                // A 64-bit LCG; its top 24 bits as a fraction.
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
        };
        Self {
            q: fill(1),
            k: fill(2),
            v: fill(3),
            out: Array4::zeros(dim),
        }
    }
}

fn attention(c: &mut Criterion) {
    for path in paths() {
        let mut group = c.benchmark_group(&path.group);
        for shape in Shape::grid().filter(|s| s.len <= path.max_len) {
            let mut problem = Problem::new(&shape);
            let opts = shape.options();
            shape.configure(&mut group);
            group.throughput(Throughput::Elements(shape.flops()));
            group.bench_function(shape.id(), |bencher| {
                bencher.iter(|| {
                    (path.run)(
                        black_box(problem.q.view()),
                        black_box(problem.k.view()),
                        black_box(problem.v.view()),
                        &opts,
                        problem.out.view_mut(),
                    )
                    .expect("the benchmark's shapes are valid");
                    black_box(&problem.out);
                })
            });
        }
        group.finish();
    }
}

/// One query row per head against a long cache: bandwidth-bound, so the
/// throughput is the bytes of K and V read.
fn decode(c: &mut Criterion) {
    let (heads, d) = (32, 128);
    let mut group = c.benchmark_group("decode");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    for len_kv in [4096, 16384] {
        let fill = |len: usize, salt: usize| {
            Array4::from_shape_fn((1, heads, len, d), |(_, h, j, c)| {
                ((h * 31 + j * 7 + c * 3 + salt) % 23) as f32 / 11.5 - 1.0
            })
        };
        let (q, k, v) = (fill(1, 1), fill(len_kv, 2), fill(len_kv, 3));
        let mut out = Array4::zeros((1, heads, 1, d));
        let opts = AttentionOptions::new().causal();
        group.throughput(Throughput::Bytes(((k.len() + v.len()) * 4) as u64));
        group.bench_function(BenchmarkId::new("h32_d128", len_kv), |bencher| {
            bencher.iter(|| {
                sdpa::scaled_dot_product_attention_into(
                    black_box(q.view()),
                    k.view(),
                    v.view(),
                    &opts,
                    out.view_mut(),
                )
                .expect("the benchmark's shapes are valid");
            })
        });
    }
    group.finish();
}

/// Forward (with its log-sum-exp) plus backward, `f32`, d = 64, counted as
/// 3.5 times the forward's FLOPs (the backward's five products against the
/// forward's two), as PyTorch's numbers in the README are.
fn backward(c: &mut Criterion) {
    let mut group = c.benchmark_group("forward_backward");
    for len in [256, 1024, 2048] {
        for causal in [false, true] {
            let shape = Shape {
                head_dim: 64,
                len,
                causal,
            };
            let problem = Problem::new(&shape);
            let opts = shape.options();
            shape.configure(&mut group);
            group.throughput(Throughput::Elements(shape.flops() * 7 / 2));
            group.bench_function(shape.id(), |bencher| {
                bencher.iter(|| {
                    let (q, k, v) = (problem.q.view(), problem.k.view(), problem.v.view());
                    let forward = sdpa::scaled_dot_product_attention_partial(q, k, v, &opts)
                        .expect("the benchmark's shapes are valid");
                    let gradients = sdpa::scaled_dot_product_attention_backward(
                        q,
                        k,
                        v,
                        &opts,
                        &forward,
                        problem.out.view(),
                    )
                    .expect("the benchmark's shapes are valid");
                    black_box(gradients);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, attention, decode, backward);
criterion_main!(benches);
