//! Criterion benchmarks of the layers, `f32`, batch 1, d_model 512, 8 heads
//! of d_k = d_v = 64, output projection 512.
//!
//! Groups:
//! - `layer_forward`: `Attention::forward_batch` (`full`) and
//!   `CausalAttention::forward_batch` (`causal`) at len ∈ {128, 512}: four
//!   512×512 projections and the attention. Throughput in FLOPs under
//!   criterion's "elements/s": 2·len·d_model²·4 for the projections plus
//!   4·len²·d_model for the attention (half for causal).
//! - `decode_step`: one new token against a KV cache of S ∈ {1024, 4096}
//!   positions. `layer` is `CausalAttention::step` (the token's four
//!   projections, the cache append, attention over S + 1 keys); `cache` is
//!   `KvCache::attend` alone, with the token's `q`, `k`, `v` given.
//!   Throughput in bytes: the K and V read, 2·(S + 1)·d_model·4 B, plus,
//!   for `layer`, the 4·d_model²·4 B of weights the projections read.
//!   Each iteration first truncates the cache back to S (O(1)), so every
//!   step sees the same S.
//!
//! `cargo bench --bench layers -- decode_step` runs a part;
//! `RAYON_NUM_THREADS=1 cargo bench --bench layers` measures one thread.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndarray::{Array3, Array4, Dimension, ShapeBuilder};
use sdpa::{Attention, AttentionConfig, CausalAttention, KvCache};

const D_MODEL: usize = 512;
const HEADS: usize = 8;
const HEAD_DIM: usize = D_MODEL / HEADS;
const SEED: u64 = 7;
const LENGTHS: [usize; 2] = [128, 512];
const CACHE_LENGTHS: [usize; 2] = [1024, 4096];

fn config() -> AttentionConfig {
    AttentionConfig::new(D_MODEL, HEADS)
        .with_head_dim(HEAD_DIM)
        .with_output_projection(D_MODEL)
}

/// Deterministic values in [-1, 1).
fn filled<D: Dimension, Sh: ShapeBuilder<Dim = D>>(salt: u64, shape: Sh) -> ndarray::Array<f32, D> {
    let mut state = salt;
    ndarray::Array::from_shape_simple_fn(shape, || {
        // A 64-bit LCG; its top 24 bits as a fraction.
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    })
}

fn layer_forward(c: &mut Criterion) {
    let bidirectional = Attention::<f32>::new_seeded(config(), SEED).expect("a valid config");
    let causal = CausalAttention::<f32>::new_seeded(config(), SEED).expect("a valid config");
    let mut group = c.benchmark_group("layer_forward");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for len in LENGTHS {
        let x: Array3<f32> = filled(1, (1, len, D_MODEL));
        let projections = 2 * len * D_MODEL * D_MODEL * 4;
        let attention = 4 * len * len * D_MODEL;
        group.throughput(Throughput::Elements((projections + attention) as u64));
        group.bench_function(BenchmarkId::new("full", len), |b| {
            b.iter(|| {
                black_box(
                    bidirectional
                        .forward_batch(black_box(x.view()))
                        .expect("valid"),
                )
            })
        });
        group.throughput(Throughput::Elements((projections + attention / 2) as u64));
        group.bench_function(BenchmarkId::new("causal", len), |b| {
            b.iter(|| black_box(causal.forward_batch(black_box(x.view())).expect("valid")))
        });
    }
    group.finish();
}

fn decode_step(c: &mut Criterion) {
    let layer = CausalAttention::<f32>::new_seeded(config(), SEED).expect("a valid config");
    let mut group = c.benchmark_group("decode_step");
    group
        .sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for len in CACHE_LENGTHS {
        let kv_bytes = 2 * (len + 1) * D_MODEL * std::mem::size_of::<f32>();
        let weight_bytes = 4 * D_MODEL * D_MODEL * std::mem::size_of::<f32>();

        // The layer: prefill `len` positions, then step one token.
        let mut cache = layer.new_cache(1, len + 1).expect("a small cache");
        let prompt: Array3<f32> = filled(2, (1, len, D_MODEL));
        layer.prefill(prompt.view(), &mut cache).expect("valid");
        let token: Array3<f32> = filled(3, (1, 1, D_MODEL));
        group.throughput(Throughput::Bytes((kv_bytes + weight_bytes) as u64));
        group.bench_function(BenchmarkId::new("layer", len), |b| {
            b.iter(|| {
                cache.truncate(len).expect("a growing cache truncates");
                black_box(
                    layer
                        .step(black_box(token.view()), &mut cache)
                        .expect("valid"),
                )
            })
        });

        // The cache alone: the token's q, k, v given.
        let mut cache = KvCache::<f32>::new(1, HEADS, HEAD_DIM, HEAD_DIM, len + 1).expect("valid");
        let (k, v): (Array4<f32>, Array4<f32>) = (
            filled(4, (1, HEADS, len, HEAD_DIM)),
            filled(5, (1, HEADS, len, HEAD_DIM)),
        );
        cache.append(k.view(), v.view()).expect("valid");
        let q: Array4<f32> = filled(6, (1, HEADS, 1, HEAD_DIM));
        let (k_new, v_new): (Array4<f32>, Array4<f32>) = (
            filled(7, (1, HEADS, 1, HEAD_DIM)),
            filled(8, (1, HEADS, 1, HEAD_DIM)),
        );
        let mut out = Array4::<f32>::zeros((1, HEADS, 1, HEAD_DIM));
        group.throughput(Throughput::Bytes(kv_bytes as u64));
        group.bench_function(BenchmarkId::new("cache", len), |b| {
            b.iter(|| {
                cache.truncate(len).expect("a growing cache truncates");
                cache
                    .attend_into(
                        black_box(q.view()),
                        k_new.view(),
                        v_new.view(),
                        out.view_mut(),
                    )
                    .expect("valid");
                black_box(&out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, layer_forward, decode_step);
criterion_main!(benches);
