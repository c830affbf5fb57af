//! Criterion benchmarks of the score modifiers (issue 12) against the plain
//! fused forward, `f32`, on the kernel set this CPU selects.
//!
//! Groups:
//! - `modifiers`: batch 1, 8 heads, d = 64, len_q = len_kv = 1024, full and
//!   causal, each with no modifier (`plain`), `.alibi(&alibi_slopes(8))`,
//!   `.softcap(30.0)` and `.sinks(&logits)`. Throughput as in
//!   `attention.rs`: `Throughput::Elements(flops)` with
//!   flops = 4·B·H·N²·d, half for causal, so criterion's "elements/s" are
//!   FLOP/s.
//! - `modifiers_decode`: one query row per head against a KV cache of
//!   S = 4096 keys, 8 heads and 8 KV heads, d = 64, causal (as a decoding
//!   step is), `plain`, `alibi`, `sinks` and `softcap`. Throughput in bytes
//!   of K and V read, as `attention.rs`'s `decode`, so criterion prints GB/s.
//!
//! A modifier's cost is its time over `plain`'s in the same group. The
//! wall-clock numbers of a shared machine are noisy; `docs/PERFORMANCE.md`
//! ("Modifier costs") gives the instruction counts of the same calls
//! (`examples/probe.rs` under callgrind), which are not.
//!
//! `cargo bench --bench modifiers -- modifiers/causal` runs a part;
//! `RAYON_NUM_THREADS=1 cargo bench --bench modifiers` measures one thread.

use std::hint::black_box;
use std::time::Duration;

use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group,
    criterion_main, measurement::WallTime,
};
use ndarray::Array4;
use sdpa::AttentionOptions;

const BATCH: usize = 1;
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const LEN: usize = 1024;
const DECODE_LEN_KV: usize = 4096;
/// Gemma 2's attention softcap.
const SOFTCAP: f32 = 30.0;

/// The score modifier of one benchmark.
#[derive(Debug, Clone, Copy)]
enum Modifier {
    Plain,
    Alibi,
    Softcap,
    Sinks,
}

impl Modifier {
    const ALL: [Modifier; 4] = [
        Modifier::Plain,
        Modifier::Alibi,
        Modifier::Softcap,
        Modifier::Sinks,
    ];

    fn name(self) -> &'static str {
        match self {
            Modifier::Plain => "plain",
            Modifier::Alibi => "alibi",
            Modifier::Softcap => "softcap",
            Modifier::Sinks => "sinks",
        }
    }
}

/// The per-head arrays the modifiers borrow: the standard ALiBi slopes and
/// sink logits in [−1, 0.75].
struct PerHead {
    slopes: Vec<f32>,
    sinks: Vec<f32>,
}

impl PerHead {
    fn new(heads: usize) -> Self {
        Self {
            slopes: sdpa::alibi_slopes(heads)
                .into_iter()
                .map(|s| s as f32)
                .collect(),
            sinks: (0..heads).map(|h| (h % 8) as f32 * 0.25 - 1.0).collect(),
        }
    }

    fn options(&self, causal: bool, modifier: Modifier) -> AttentionOptions<'_, f32> {
        let opts = AttentionOptions::new();
        let opts = if causal { opts.causal() } else { opts };
        match modifier {
            Modifier::Plain => opts,
            Modifier::Alibi => opts.alibi(&self.slopes),
            Modifier::Softcap => opts.softcap(SOFTCAP),
            Modifier::Sinks => opts.sinks(&self.sinks),
        }
    }
}

/// Deterministic values in [-1, 1), different for each salt (the LCG of
/// `attention.rs`).
fn fill(dim: (usize, usize, usize, usize), salt: u64) -> Array4<f32> {
    let mut state = salt;
    Array4::from_shape_simple_fn(dim, || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    })
}

/// The N = 1024 calls take tens of milliseconds: `attention.rs`'s settings
/// for N < 4096.
fn configure(group: &mut BenchmarkGroup<'_, WallTime>) {
    group
        .sample_size(20)
        .sampling_mode(SamplingMode::Auto)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
}

/// The fused forward at N = 1024, full and causal, with each modifier.
fn forward(c: &mut Criterion) {
    let dim = (BATCH, HEADS, LEN, HEAD_DIM);
    let (q, k, v) = (fill(dim, 1), fill(dim, 2), fill(dim, 3));
    let mut out = Array4::zeros(dim);
    let per_head = PerHead::new(HEADS);
    let mut group = c.benchmark_group("modifiers");
    configure(&mut group);
    for causal in [false, true] {
        let full = 4 * BATCH * HEADS * LEN * LEN * HEAD_DIM;
        let flops = if causal { full / 2 } else { full };
        group.throughput(Throughput::Elements(flops as u64));
        let mask = if causal { "causal" } else { "full" };
        for modifier in Modifier::ALL {
            let opts = per_head.options(causal, modifier);
            let id = BenchmarkId::new(format!("d{HEAD_DIM}/{mask}/{}", modifier.name()), LEN);
            group.bench_function(id, |bencher| {
                bencher.iter(|| {
                    sdpa::scaled_dot_product_attention_into(
                        black_box(q.view()),
                        black_box(k.view()),
                        black_box(v.view()),
                        &opts,
                        out.view_mut(),
                    )
                    .expect("the benchmark's shapes are valid");
                    black_box(&out);
                })
            });
        }
    }
    group.finish();
}

/// One query row per head against S = 4096 keys, with each modifier.
fn decode(c: &mut Criterion) {
    let q = fill((1, HEADS, 1, HEAD_DIM), 1);
    let k = fill((1, HEADS, DECODE_LEN_KV, HEAD_DIM), 2);
    let v = fill((1, HEADS, DECODE_LEN_KV, HEAD_DIM), 3);
    let mut out = Array4::zeros((1, HEADS, 1, HEAD_DIM));
    let per_head = PerHead::new(HEADS);
    let mut group = c.benchmark_group("modifiers_decode");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(((k.len() + v.len()) * 4) as u64));
    for modifier in Modifier::ALL {
        let opts = per_head.options(true, modifier);
        let id = BenchmarkId::new(
            format!("h{HEADS}_d{HEAD_DIM}/{}", modifier.name()),
            DECODE_LEN_KV,
        );
        group.bench_function(id, |bencher| {
            bencher.iter(|| {
                sdpa::scaled_dot_product_attention_into(
                    black_box(q.view()),
                    k.view(),
                    v.view(),
                    &opts,
                    out.view_mut(),
                )
                .expect("the benchmark's shapes are valid");
                black_box(&out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, forward, decode);
criterion_main!(benches);
