//! `KvCache` and incremental decoding: any sequence of appends (of random
//! chunk sizes), truncations and clears, on a growing cache or a ring
//! buffer, gives what the functional API gives over the whole sequence
//! (causal, or with the window); the layers' prefill and steps equal their
//! full forward; growth; and one test per bad shape.

use approx::assert_abs_diff_eq;
use ndarray::{Array3, Array4, ArrayView4, Axis, s};
use proptest::prelude::*;
use sdpa::{
    AttentionConfig, AttentionError, AttentionOptions, CausalAttention, Element, ErrorKind,
    KvCache, scaled_dot_product_attention,
};

/// SplitMix64 fill, entries uniform in [-1, 1), so a case is replayed from
/// its seed.
fn filled<F: Element, Sh: ndarray::ShapeBuilder<Dim = ndarray::Ix4>>(
    seed: u64,
    shape: Sh,
) -> Array4<F> {
    let mut state = seed;
    Array4::from_shape_simple_fn(shape, || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        F::from((z >> 11) as f64 / (1_u64 << 53) as f64 * 2.0 - 1.0).unwrap()
    })
}

fn filled3<F: Element>(seed: u64, shape: (usize, usize, usize)) -> Array3<F> {
    filled::<F, _>(seed, (1, shape.0, shape.1, shape.2)).index_axis_move(Axis(0), 0)
}

/// The options the cache's attention must equal over the whole sequence.
fn full_options<'a, F: Copy>(window: Option<usize>) -> AttentionOptions<'a, F> {
    match window {
        Some(w) => AttentionOptions::new().window(w),
        None => AttentionOptions::new().causal(),
    }
}

/// Concatenates along the length axis.
fn concat<F: Element>(a: &Array4<F>, b: &Array4<F>) -> Array4<F> {
    ndarray::concatenate(Axis(2), &[a.view(), b.view()]).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    /// Attend this many new positions.
    Attend(usize),
    /// Truncate to this fraction (in 0..=8 eighths) of the total length.
    Truncate(usize),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..5_usize).prop_map(Op::Attend),
        1 => Just(Op::Attend(9)),
        2 => (0..=8_usize).prop_map(Op::Truncate),
        1 => Just(Op::Clear),
    ]
}

/// Shapes: batch, kv_heads, query heads per kv head, d_k, d_v, initial
/// capacity, window.
type Dims = (usize, usize, usize, usize, usize, usize, Option<usize>);

fn dims() -> impl Strategy<Value = Dims> {
    (
        1..3_usize,
        1..3_usize,
        1..3_usize,
        1..6_usize,
        1..5_usize,
        0..6_usize,
        prop::option::of(1..7_usize),
    )
}

/// Runs `ops` on a cache and checks every attend against the functional
/// API over the whole logical sequence (the positions appended, less those
/// truncated). Returns the final logical keys for further checks.
fn run_ops<F: Element>(dims: Dims, ops: &[Op], seed: u64, epsilon: f64) -> Array4<F> {
    let (batch, kv_heads, group, d_k, d_v, capacity, window) = dims;
    let heads = kv_heads * group;
    let mut cache = match window {
        Some(w) => KvCache::<F>::with_window(w, batch, kv_heads, d_k, d_v).unwrap(),
        None => KvCache::<F>::new(batch, kv_heads, d_k, d_v, capacity).unwrap(),
    };
    let mut keys = Array4::<F>::zeros((batch, kv_heads, 0, d_k));
    let mut values = Array4::<F>::zeros((batch, kv_heads, 0, d_v));
    for (step, op) in ops.iter().enumerate() {
        let seed = seed.wrapping_add(step as u64 * 1000);
        match *op {
            Op::Attend(n) => {
                let q = filled::<F, _>(seed, (batch, heads, n, d_k));
                let k = filled::<F, _>(seed + 1, (batch, kv_heads, n, d_k));
                let v = filled::<F, _>(seed + 2, (batch, kv_heads, n, d_v));
                let out = cache.attend(q.view(), k.view(), v.view()).unwrap();
                keys = concat(&keys, &k);
                values = concat(&values, &v);
                let expected = scaled_dot_product_attention(
                    q.view(),
                    keys.view(),
                    values.view(),
                    &full_options(window),
                )
                .unwrap();
                assert_abs_diff_eq!(out.mapv(to_f64), expected.mapv(to_f64), epsilon = epsilon);
            }
            Op::Truncate(eighths) => {
                let total = keys.len_of(Axis(2));
                let target = total * eighths / 8;
                let (len, total_len) = (cache.len(), cache.total_len());
                match cache.truncate(target) {
                    Ok(()) => {
                        let kept = target.min(total);
                        keys = keys.slice(s![.., .., ..kept, ..]).to_owned();
                        values = values.slice(s![.., .., ..kept, ..]).to_owned();
                    }
                    Err(err) => {
                        // Only a ring that has overwritten what the next
                        // query needs refuses, and then changes nothing.
                        let w = window.expect("a growing cache always truncates");
                        let first_held = total_len - len;
                        assert!(first_held > 0, "{err}");
                        assert!(target.saturating_sub(first_held) < target.min(w - 1));
                        assert_eq!(err.kind(), ErrorKind::InvalidOption);
                        assert_eq!((cache.len(), cache.total_len()), (len, total_len));
                    }
                }
            }
            Op::Clear => {
                cache.clear();
                keys = keys.slice(s![.., .., ..0, ..]).to_owned();
                values = values.slice(s![.., .., ..0, ..]).to_owned();
            }
        }
        let total = keys.len_of(Axis(2));
        assert_eq!(cache.total_len(), total);
        match window {
            None => {
                assert_eq!(cache.len(), total);
                assert!(cache.capacity() >= total);
                // A growing cache holds every position, in order.
                assert_eq!(cache.keys(), keys.view());
                assert_eq!(cache.values(), values.view());
            }
            Some(w) => {
                assert_eq!(cache.capacity(), w);
                assert!(cache.len() <= w.min(total));
                assert!(cache.len() >= (w - 1).min(total));
                assert_eq!(cache.keys().dim(), (batch, kv_heads, cache.len(), d_k));
                // Every entry held is one of the last `len` positions.
                let recent = keys.slice(s![.., .., total - cache.len().., ..]);
                assert!(same_rows_in_any_order(cache.keys(), recent));
            }
        }
    }
    keys
}

fn to_f64<F: Element>(x: F) -> f64 {
    x.to_f64().unwrap()
}

/// Whether `a` and `b` hold the same rows (axis 2) in some order, for every
/// batch item and head.
fn same_rows_in_any_order<F: Element>(a: ArrayView4<'_, F>, b: ArrayView4<'_, F>) -> bool {
    a.dim() == b.dim()
        && a.outer_iter().zip(b.outer_iter()).all(|(a, b)| {
            a.outer_iter().zip(b.outer_iter()).all(|(a, b)| {
                let key = |row: ndarray::ArrayView1<'_, F>| -> Vec<u64> {
                    row.iter().map(|&x| to_f64(x).to_bits()).collect()
                };
                let mut ra: Vec<_> = a.rows().into_iter().map(key).collect();
                let mut rb: Vec<_> = b.rows().into_iter().map(key).collect();
                ra.sort();
                rb.sort();
                ra == rb
            })
        })
}

/// The full forward of a seeded causal layer over `x` (with the window, if
/// any) and the same rows from a prefill of `prompt` positions and steps of
/// `chunks` positions, both as `f64`.
fn decode<F: Element>(
    config: AttentionConfig,
    seed: u64,
    x: &Array3<F>,
    prompt: usize,
    chunks: &[usize],
    window: Option<usize>,
    capacity: usize,
) -> (Array3<f64>, Array3<f64>) {
    let layer = CausalAttention::<F>::new_seeded(config, seed).unwrap();
    let batch = x.len_of(Axis(0));
    let (mut cache, opts) = match window {
        Some(w) => (
            layer.new_window_cache(batch, w).unwrap(),
            AttentionOptions::new().window(w),
        ),
        None => (
            layer.new_cache(batch, capacity).unwrap(),
            AttentionOptions::new(),
        ),
    };
    let full = layer.forward_batch_with(x.view(), &opts).unwrap();
    let mut parts = vec![
        layer
            .prefill(x.slice(s![.., ..prompt, ..]), &mut cache)
            .unwrap(),
    ];
    let mut at = prompt;
    for &n in chunks {
        parts.push(
            layer
                .step(x.slice(s![.., at..at + n, ..]), &mut cache)
                .unwrap(),
        );
        at += n;
    }
    assert_eq!(cache.total_len(), at);
    let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
    let decoded = ndarray::concatenate(Axis(1), &views).unwrap();
    (full.mapv(to_f64), decoded.mapv(to_f64))
}

proptest! {
    #[test]
    fn any_appends_truncations_and_clears_equal_the_whole_sequence_f64(
        dims in dims(),
        ops in prop::collection::vec(op(), 1..16),
        seed in any::<u64>(),
    ) {
        run_ops::<f64>(dims, &ops, seed, 1e-12);
    }

    #[test]
    fn any_appends_truncations_and_clears_equal_the_whole_sequence_f32(
        dims in dims(),
        ops in prop::collection::vec(op(), 1..16),
        seed in any::<u64>(),
    ) {
        run_ops::<f32>(dims, &ops, seed, 2e-5);
    }

    #[test]
    fn prefill_and_steps_equal_the_full_causal_forward(
        (d_model, d_k, d_v, kv_heads, group) in (1..7_usize, 1..5_usize, 1..5_usize, 1..3_usize, 1..3_usize),
        (d_model_out, bias, batch) in (prop::option::of(1..6_usize), any::<bool>(), 1..3_usize),
        prompt in 0..8_usize,
        chunks in prop::collection::vec(1..4_usize, 0..8),
        window in prop::option::of(1..6_usize),
        capacity in 0..4_usize,
        seed in any::<u64>(),
    ) {
        let mut config = AttentionConfig::new(d_model, kv_heads * group).with_head_dim(d_k).with_value_dim(d_v)
            .with_kv_heads(kv_heads)
            .with_bias(bias);
        config.d_model_out = d_model_out;
        let total = prompt + chunks.iter().sum::<usize>();
        let x = filled3::<f64>(seed, (batch, total, d_model));
        let (full, decoded) = decode::<f64>(config, seed, &x, prompt, &chunks, window, capacity);
        assert_abs_diff_eq!(decoded, full, epsilon = 1e-12);
        let (full, decoded) = decode::<f32>(config, seed, &x.mapv(|x| x as f32), prompt, &chunks, window, capacity);
        assert_abs_diff_eq!(decoded, full, epsilon = 2e-5);
    }

    #[test]
    fn prefill_starts_over(
        seed in any::<u64>(),
        first in 0..6_usize,
        second in 0..6_usize,
        window in prop::option::of(1..4_usize),
    ) {
        let layer = CausalAttention::<f64>::new_seeded(AttentionConfig::new(4, 2).with_head_dim(3).with_value_dim(2), seed).unwrap();
        let mut cache = match window {
            Some(w) => layer.new_window_cache(1, w).unwrap(),
            None => layer.new_cache(1, 2).unwrap(),
        };
        let a = filled3::<f64>(seed, (1, first, 4));
        let b = filled3::<f64>(seed ^ 7, (1, second, 4));
        layer.prefill(a.view(), &mut cache).unwrap();
        let y = layer.prefill(b.view(), &mut cache).unwrap();
        let mut fresh = match window {
            Some(w) => layer.new_window_cache(1, w).unwrap(),
            None => layer.new_cache(1, 2).unwrap(),
        };
        prop_assert_eq!(y, layer.prefill(b.view(), &mut fresh).unwrap());
        prop_assert_eq!(cache.total_len(), second);
    }
}

#[test]
fn growth_doubles_and_never_reallocates_within_capacity() {
    let mut cache = KvCache::<f32>::new(1, 2, 4, 3, 4).unwrap();
    let one = |t: usize| {
        (
            filled::<f32, _>(t as u64, (1, 2, 1, 4)),
            filled::<f32, _>(t as u64 + 99, (1, 2, 1, 3)),
        )
    };
    let mut capacities = vec![];
    let mut reallocations = 0;
    let mut pointer = cache.keys().as_ptr();
    for t in 0..40 {
        let (k, v) = one(t);
        cache.append(k.view(), v.view()).unwrap();
        if cache.keys().as_ptr() != pointer {
            reallocations += 1;
            pointer = cache.keys().as_ptr();
        }
        capacities.push(cache.capacity());
    }
    assert_eq!(cache.len(), 40);
    // 4 → 8 → 16 → 32 → 64: four reallocations for 40 single-token appends.
    assert_eq!(reallocations, 4);
    assert_eq!(capacities[3], 4);
    assert_eq!(capacities[4], 8);
    assert_eq!(capacities[8], 16);
    assert_eq!(capacities[16], 32);
    assert_eq!(capacities[39], 64);
    // The entries survived every move.
    for t in 0..40 {
        let (k, v) = one(t);
        assert_eq!(cache.keys().slice(s![.., .., t..t + 1, ..]), k);
        assert_eq!(cache.values().slice(s![.., .., t..t + 1, ..]), v);
    }
}

#[test]
fn a_large_append_grows_to_fit_at_once() {
    let mut cache = KvCache::<f64>::new(2, 1, 2, 2, 0).unwrap();
    assert_eq!(cache.capacity(), 0);
    let k = filled::<f64, _>(1, (2, 1, 5, 2));
    cache.append(k.view(), k.view()).unwrap();
    assert_eq!(cache.capacity(), 5);
    let k = filled::<f64, _>(2, (2, 1, 20, 2));
    cache.append(k.view(), k.view()).unwrap();
    assert_eq!(cache.capacity(), 25);
    cache
        .append(k.slice(s![.., .., ..1, ..]), k.slice(s![.., .., ..1, ..]))
        .unwrap();
    assert_eq!(cache.capacity(), 50);
}

#[test]
fn clear_and_truncate_keep_the_buffers() {
    let mut cache = KvCache::<f32>::new(1, 1, 2, 2, 3).unwrap();
    let k = filled::<f32, _>(1, (1, 1, 10, 2));
    cache.append(k.view(), k.view()).unwrap();
    let capacity = cache.capacity();
    cache.truncate(4).unwrap();
    assert_eq!(
        (cache.len(), cache.total_len(), cache.capacity()),
        (4, 4, capacity)
    );
    assert_eq!(cache.keys(), k.slice(s![.., .., ..4, ..]));
    cache.truncate(7).unwrap(); // past the length: nothing happens
    assert_eq!(cache.len(), 4);
    cache.clear();
    assert!(cache.is_empty());
    assert_eq!((cache.total_len(), cache.capacity()), (0, capacity));
}

#[test]
fn a_ring_keeps_the_last_window_positions() {
    let mut cache = KvCache::<f64>::with_window(3, 1, 1, 1, 1).unwrap();
    assert_eq!(cache.window(), Some(3));
    let k = Array4::from_shape_fn((1, 1, 7, 1), |(_, _, t, _)| t as f64);
    for t in 0..7 {
        let row = k.slice(s![.., .., t..t + 1, ..]);
        cache.append(row, row).unwrap();
    }
    // Positions 4, 5, 6 in slots 4 mod 3 = 1, 2, 0.
    assert_eq!(
        cache.keys().iter().copied().collect::<Vec<_>>(),
        vec![6.0, 4.0, 5.0]
    );
    assert_eq!(
        (cache.len(), cache.total_len(), cache.capacity()),
        (3, 7, 3)
    );
    // A chunk longer than the window keeps its own last three.
    cache.append(k.view(), k.view()).unwrap();
    let mut held: Vec<f64> = cache.keys().iter().copied().collect();
    held.sort_by(f64::total_cmp);
    assert_eq!(held, vec![4.0, 5.0, 6.0]);
    assert_eq!(cache.total_len(), 14);
}

#[test]
fn a_ring_truncates_only_as_far_as_it_can() {
    let mut cache = KvCache::<f32>::with_window(4, 1, 1, 2, 2).unwrap();
    let k = filled::<f32, _>(3, (1, 1, 10, 2));
    cache.append(k.view(), k.view()).unwrap();
    // Holds positions 6..10; the next query at 9 needs 6, 7, 8: back by one works.
    let err = cache.truncate(8).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidOption);
    assert!(err.to_string().contains("positions 6..10"), "{err}");
    assert_eq!((cache.len(), cache.total_len()), (4, 10));
    cache.truncate(9).unwrap();
    assert_eq!((cache.len(), cache.total_len()), (3, 9));
    assert_eq!(cache.keys(), k.slice(s![.., .., 6..9, ..]));
    // Before a ring wraps, anything goes.
    let mut young = KvCache::<f32>::with_window(4, 1, 1, 2, 2).unwrap();
    young
        .append(k.slice(s![.., .., ..4, ..]), k.slice(s![.., .., ..4, ..]))
        .unwrap();
    young.truncate(1).unwrap();
    assert_eq!(young.keys(), k.slice(s![.., .., ..1, ..]));
    // A window of 1 needs no history.
    let mut single = KvCache::<f32>::with_window(1, 1, 1, 2, 2).unwrap();
    single.append(k.view(), k.view()).unwrap();
    single.truncate(2).unwrap();
    assert_eq!((single.len(), single.total_len()), (0, 2));
}

#[test]
fn an_empty_step_changes_nothing() {
    let layer = CausalAttention::<f32>::new_seeded(AttentionConfig::new(4, 2), 1).unwrap();
    let mut cache = layer.new_cache(2, 4).unwrap();
    let x = filled3::<f32>(1, (2, 3, 4));
    layer.prefill(x.view(), &mut cache).unwrap();
    let y = layer.step(x.slice(s![.., ..0, ..]), &mut cache).unwrap();
    assert_eq!(y.dim(), (2, 0, 4));
    assert_eq!(cache.total_len(), 3);
}

#[test]
fn masked_out_values_do_not_leak_from_a_ring() {
    // NaN in a position that falls out of every new query's window, still
    // held while several tokens are attended at once.
    let mut cache = KvCache::<f32>::with_window(3, 1, 1, 2, 2).unwrap();
    let k = filled::<f32, _>(5, (1, 1, 6, 2));
    let mut v = filled::<f32, _>(6, (1, 1, 6, 2));
    v[[0, 0, 0, 0]] = f32::NAN;
    cache
        .append(k.slice(s![.., .., ..3, ..]), v.slice(s![.., .., ..3, ..]))
        .unwrap();
    let q = filled::<f32, _>(7, (1, 1, 3, 2));
    let out = cache
        .attend(
            q.view(),
            k.slice(s![.., .., 3.., ..]),
            v.slice(s![.., .., 3.., ..]),
        )
        .unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
}

// --- errors, one test per case ----------------------------------------------

fn assert_error(
    result: Result<impl std::fmt::Debug, AttentionError>,
    kind: ErrorKind,
    parts: &[&str],
) {
    let err = result.unwrap_err();
    assert_eq!(err.kind(), kind, "{err}");
    let message = err.to_string();
    for part in parts {
        assert!(message.contains(part), "{message:?} does not name {part:?}");
    }
}

#[test]
fn new_zero_kv_heads() {
    assert_error(
        KvCache::<f32>::new(1, 0, 2, 2, 4),
        ErrorKind::ZeroDimension,
        &["kv_heads = 0"],
    );
}

#[test]
fn new_zero_d_k() {
    assert_error(
        KvCache::<f64>::new(1, 1, 0, 2, 4),
        ErrorKind::ZeroDimension,
        &["d_k = 0"],
    );
}

#[test]
fn new_zero_d_v() {
    assert_error(
        KvCache::<f32>::new(1, 1, 2, 0, 4),
        ErrorKind::ZeroDimension,
        &["d_v = 0"],
    );
}

#[test]
fn with_window_zero() {
    assert_error(
        KvCache::<f32>::with_window(0, 1, 1, 2, 2),
        ErrorKind::InvalidOption,
        &["window"],
    );
}

#[test]
fn with_window_zero_d_k() {
    assert_error(
        KvCache::<f32>::with_window(4, 1, 1, 0, 2),
        ErrorKind::ZeroDimension,
        &["d_k = 0"],
    );
}

/// A cache for batch 2, 2 key/value heads, d_k 3, d_v 4, with 2 positions.
fn cache() -> KvCache<f64> {
    let mut cache = KvCache::new(2, 2, 3, 4, 8).unwrap();
    let (k, v) = (Array4::zeros((2, 2, 2, 3)), Array4::zeros((2, 2, 2, 4)));
    cache.append(k.view(), v.view()).unwrap();
    cache
}

fn assert_append_error(
    k: (usize, usize, usize, usize),
    v: (usize, usize, usize, usize),
    part: &str,
) {
    let mut cache = cache();
    let (k, v) = (Array4::<f64>::zeros(k), Array4::<f64>::zeros(v));
    assert_error(
        cache.append(k.view(), v.view()),
        ErrorKind::ShapeMismatch,
        &[part, "batch = 2, kv_heads = 2, d_k = 3, d_v = 4"],
    );
    assert_eq!(cache.len(), 2, "an error changes nothing");
    let q = Array4::<f64>::zeros((2, 2, k.len_of(Axis(2)), 3));
    assert_error(
        cache.attend(q.view(), k.view(), v.view()),
        ErrorKind::ShapeMismatch,
        &[part],
    );
    assert_eq!(cache.len(), 2, "an error changes nothing");
}

#[test]
fn append_wrong_batch() {
    assert_append_error((3, 2, 1, 3), (3, 2, 1, 4), "k [3, 2, 1, 3]");
}

#[test]
fn append_wrong_kv_heads() {
    assert_append_error((2, 1, 1, 3), (2, 1, 1, 4), "k [2, 1, 1, 3]");
}

#[test]
fn append_wrong_d_k() {
    assert_append_error((2, 2, 1, 5), (2, 2, 1, 4), "k [2, 2, 1, 5]");
}

#[test]
fn append_wrong_d_v() {
    assert_append_error((2, 2, 1, 3), (2, 2, 1, 3), "v [2, 2, 1, 3]");
}

#[test]
fn append_keys_and_values_of_different_lengths() {
    assert_append_error((2, 2, 2, 3), (2, 2, 1, 4), "the same n");
}

#[test]
fn attend_queries_of_another_length() {
    let mut cache = cache();
    let (q, k, v) = (
        Array4::zeros((2, 2, 2, 3)),
        Array4::zeros((2, 2, 1, 3)),
        Array4::zeros((2, 2, 1, 4)),
    );
    assert_error(
        cache.attend(q.view(), k.view(), v.view()),
        ErrorKind::ShapeMismatch,
        &["q [2, 2, 2, 3]", "batch, n or d_k"],
    );
    assert_eq!(cache.len(), 2);
}

#[test]
fn attend_queries_of_another_width() {
    let mut cache = cache();
    let (q, k, v) = (
        Array4::zeros((2, 2, 1, 2)),
        Array4::zeros((2, 2, 1, 3)),
        Array4::zeros((2, 2, 1, 4)),
    );
    assert_error(
        cache.attend(q.view(), k.view(), v.view()),
        ErrorKind::ShapeMismatch,
        &["q [2, 2, 1, 2]"],
    );
}

#[test]
fn attend_zero_heads() {
    let mut cache = cache();
    let (q, k, v) = (
        Array4::zeros((2, 0, 1, 3)),
        Array4::zeros((2, 2, 1, 3)),
        Array4::zeros((2, 2, 1, 4)),
    );
    assert_error(
        cache.attend(q.view(), k.view(), v.view()),
        ErrorKind::ZeroDimension,
        &["heads"],
    );
}

#[test]
fn attend_heads_not_a_multiple_of_kv_heads() {
    let mut cache = cache();
    let (q, k, v) = (
        Array4::zeros((2, 3, 1, 3)),
        Array4::zeros((2, 2, 1, 3)),
        Array4::zeros((2, 2, 1, 4)),
    );
    assert_error(
        cache.attend(q.view(), k.view(), v.view()),
        ErrorKind::HeadsNotDivisible,
        &["heads (3)", "kv_heads (2)"],
    );
    assert_eq!(cache.len(), 2);
}

#[test]
fn attend_into_wrong_output() {
    let mut cache = cache();
    let (q, k, v) = (
        Array4::zeros((2, 4, 1, 3)),
        Array4::zeros((2, 2, 1, 3)),
        Array4::zeros((2, 2, 1, 4)),
    );
    let mut out = Array4::zeros((2, 4, 1, 3));
    assert_error(
        cache.attend_into(q.view(), k.view(), v.view(), out.view_mut()),
        ErrorKind::ShapeMismatch,
        &["out has shape [2, 4, 1, 3]", "[2, 4, 1, 4]"],
    );
    assert_eq!(cache.len(), 2);
}

fn layer() -> CausalAttention<f64> {
    let config = AttentionConfig::new(6, 4)
        .with_head_dim(3)
        .with_value_dim(4)
        .with_kv_heads(2);
    CausalAttention::new_seeded(config, 1).unwrap()
}

#[test]
fn layer_new_window_cache_zero() {
    assert_error(
        layer().new_window_cache(1, 0),
        ErrorKind::InvalidOption,
        &["window"],
    );
}

#[test]
fn layer_step_wrong_width() {
    let layer = layer();
    let mut cache = layer.new_cache(1, 4).unwrap();
    let x = Array3::zeros((1, 1, 5));
    assert_error(
        layer.step(x.view(), &mut cache),
        ErrorKind::ShapeMismatch,
        &["x has shape [1, 1, 5]", "d_model is 6"],
    );
}

#[test]
fn layer_step_with_a_cache_for_another_batch() {
    let layer = layer();
    let mut cache = layer.new_cache(2, 4).unwrap();
    let x = Array3::zeros((1, 1, 6));
    assert_error(
        layer.step(x.view(), &mut cache),
        ErrorKind::ShapeMismatch,
        &["the cache holds batch = 2", "batch = 1"],
    );
}

#[test]
fn layer_step_with_a_cache_for_another_layer() {
    let layer = layer();
    let other = CausalAttention::<f64>::new_seeded(
        AttentionConfig::new(6, 4)
            .with_head_dim(3)
            .with_value_dim(4),
        1,
    )
    .unwrap();
    let mut cache = other.new_cache(1, 4).unwrap();
    let x = Array3::zeros((1, 1, 6));
    assert_error(
        layer.step(x.view(), &mut cache),
        ErrorKind::ShapeMismatch,
        &["kv_heads = 4", "kv_heads = 2"],
    );
}

#[test]
fn layer_prefill_errors_leave_the_cache_alone() {
    let layer = layer();
    let mut cache = layer.new_cache(1, 4).unwrap();
    layer
        .prefill(Array3::zeros((1, 3, 6)).view(), &mut cache)
        .unwrap();
    let x = Array3::zeros((1, 2, 7));
    assert_error(
        layer.prefill(x.view(), &mut cache),
        ErrorKind::ShapeMismatch,
        &["[1, 2, 7]", "d_model is 6"],
    );
    assert_eq!(cache.total_len(), 3);
    let mut wrong = KvCache::<f64>::new(1, 2, 3, 5, 4).unwrap();
    assert_error(
        layer.prefill(Array3::zeros((1, 2, 6)).view(), &mut wrong),
        ErrorKind::ShapeMismatch,
        &["d_v = 5"],
    );
}

// --- too large to address, past memory, and check first, then mutate ------

/// 2^40 positions: 4 TiB for keys one `f32` wide, an allocation that fails
/// at once (no machine this runs on has that much memory).
const PAST_MEMORY: usize = 1 << 40;

/// Everything a cache shows.
#[derive(Debug, PartialEq)]
struct Shown<F> {
    len: usize,
    total_len: usize,
    capacity: usize,
    window: Option<usize>,
    keys: Array4<F>,
    values: Array4<F>,
}

fn shown<F: Element>(cache: &KvCache<F>) -> Shown<F> {
    Shown {
        len: cache.len(),
        total_len: cache.total_len(),
        capacity: cache.capacity(),
        window: cache.window(),
        keys: cache.keys().to_owned(),
        values: cache.values().to_owned(),
    }
}

#[test]
fn new_with_a_capacity_too_large_to_address() {
    let max = usize::MAX.to_string();
    assert_error(
        KvCache::<f32>::new(1, 1, 4, 4, usize::MAX),
        ErrorKind::TooLarge,
        &["keys", &max],
    );
    assert_error(
        KvCache::<f64>::with_window(usize::MAX, 1, 1, 4, 4),
        ErrorKind::TooLarge,
        &["keys", &max],
    );
    // Batch 0 holds nothing, but the other lengths must still be addressable.
    assert_error(
        KvCache::<f32>::new(0, 1, 4, 4, usize::MAX),
        ErrorKind::TooLarge,
        &["nonzero lengths", &max],
    );
}

#[test]
fn new_with_a_capacity_past_memory() {
    // 2^40 f32 = 4398046511104 bytes.
    assert_error(
        KvCache::<f32>::new(1, 1, 1, 1, PAST_MEMORY),
        ErrorKind::OutOfMemory,
        &["keys", "4398046511104 bytes"],
    );
    assert_error(
        KvCache::<f32>::with_window(PAST_MEMORY, 1, 1, 1, 1),
        ErrorKind::OutOfMemory,
        &["keys", "4398046511104 bytes"],
    );
}

/// Caches for batch 2, 2 key/value heads, d_k 3, d_v 4, each holding some
/// positions: growing with room to spare, growing and full, a ring that
/// has wrapped (its oldest entry not in slot 0), and a ring not yet full.
fn used_caches() -> Vec<KvCache<f32>> {
    let fill = |mut cache: KvCache<f32>, chunks: &[usize]| {
        for &n in chunks {
            let k = filled::<f32, _>(n as u64, (2, 2, n, 3));
            let v = filled::<f32, _>(n as u64 + 1, (2, 2, n, 4));
            cache.append(k.view(), v.view()).unwrap();
        }
        cache
    };
    vec![
        fill(KvCache::new(2, 2, 3, 4, 8).unwrap(), &[5]),
        fill(KvCache::new(2, 2, 3, 4, 5).unwrap(), &[5]),
        fill(KvCache::with_window(4, 2, 2, 3, 4).unwrap(), &[5, 1, 1]),
        fill(KvCache::with_window(4, 2, 2, 3, 4).unwrap(), &[2]),
    ]
}

#[test]
fn failed_appends_and_attends_change_nothing() {
    let zeros = |n: usize, heads: usize, d: usize| Array4::<f32>::zeros((2, heads, n, d));
    let (k1, v1) = (zeros(1, 2, 3), zeros(1, 2, 4));
    let one = |d: usize| Array4::<f32>::zeros((2, 2, 1, d));
    let (k_row, v_row, q_row) = (one(3), one(4), Array4::<f32>::zeros((2, 4, 1, 3)));
    for (case, mut cache) in used_caches().into_iter().enumerate() {
        let twin = cache.clone();
        let before = shown(&cache);
        let expect =
            |result: Result<(), AttentionError>, kinds: &[ErrorKind], cache: &KvCache<f32>| {
                let err = result.unwrap_err();
                assert!(kinds.contains(&err.kind()), "cache {case}: {err}");
                assert_eq!(shown(cache), before, "cache {case}, after: {err}");
            };
        let shape = [ErrorKind::ShapeMismatch];
        let wrong_batch = Array4::<f32>::zeros((3, 2, 1, 3));
        expect(cache.append(wrong_batch.view(), v1.view()), &shape, &cache);
        let wrong_heads = zeros(1, 3, 3);
        expect(
            cache
                .attend(wrong_heads.view(), k1.view(), v1.view())
                .map(drop),
            &[ErrorKind::HeadsNotDivisible],
            &cache,
        );
        let no_heads = zeros(1, 0, 3);
        expect(
            cache
                .attend(no_heads.view(), k1.view(), v1.view())
                .map(drop),
            &[ErrorKind::ZeroDimension],
            &cache,
        );
        let mut wrong_out = zeros(1, 4, 3);
        expect(
            cache.attend_into(q_row.view(), k1.view(), v1.view(), wrong_out.view_mut()),
            &shape,
            &cache,
        );
        // 2^40 new positions, broadcast from one: their output (and, in a
        // growing cache, its grown buffers) cannot be allocated; 2^58 cannot
        // even be addressed.
        for (n, kind) in [
            (PAST_MEMORY, ErrorKind::OutOfMemory),
            (1 << 58, ErrorKind::TooLarge),
        ] {
            let q = q_row.broadcast((2, 4, n, 3)).unwrap();
            let k = k_row.broadcast((2, 2, n, 3)).unwrap();
            let v = v_row.broadcast((2, 2, n, 4)).unwrap();
            expect(cache.attend(q, k, v).map(drop), &[kind], &cache);
            if cache.window().is_none() {
                expect(cache.append(k, v), &[kind], &cache);
            }
        }
        // And the cache goes on as if nothing had happened.
        let mut twin = twin;
        for n in [1, 3] {
            let q = filled::<f32, _>(7, (2, 4, n, 3));
            let k = filled::<f32, _>(8, (2, 2, n, 3));
            let v = filled::<f32, _>(9, (2, 2, n, 4));
            let out = cache.attend(q.view(), k.view(), v.view()).unwrap();
            let expected = twin.attend(q.view(), k.view(), v.view()).unwrap();
            assert_eq!(out, expected, "cache {case}");
            assert_eq!(shown(&cache), shown(&twin), "cache {case}");
        }
    }
}

#[test]
fn a_ring_takes_any_number_of_positions_until_their_count_overflows() {
    let mut ring = KvCache::<f32>::with_window(3, 1, 1, 1, 1).unwrap();
    let row = filled::<f32, _>(1, (1, 1, 1, 1));
    let many = row.broadcast((1, 1, 1 << 62, 1)).unwrap();
    for _ in 0..3 {
        ring.append(many, many).unwrap();
    }
    assert_eq!((ring.len(), ring.total_len()), (3, 3 << 62));
    assert_eq!(ring.keys(), row.broadcast((1, 1, 3, 1)).unwrap());
    let before = shown(&ring);
    assert_error(
        ring.append(many, many),
        ErrorKind::TooLarge,
        &["13835058055282163712 positions", "overflow"],
    );
    assert_eq!(shown(&ring), before);
}

#[test]
fn failed_steps_and_prefills_change_nothing() {
    let layer = layer(); // d_model 6, 4 heads over 2 key/value heads, d_k 3, d_v 4
    let x = filled3::<f64>(3, (1, 7, 6));
    let row = x.slice(s![.., ..1, ..]);
    // The layer's projections of 2^40 positions cannot be allocated; of
    // 2^60, not even addressed.
    let past_memory = row.broadcast((1, PAST_MEMORY, 6)).unwrap();
    let too_large = row.broadcast((1, 1 << 60, 6)).unwrap();
    let wide = Array3::<f64>::zeros((1, 2, 5));
    let caches = [
        KvCache::<f64>::new(1, 2, 3, 4, 8).unwrap(),
        KvCache::new(1, 2, 3, 4, 7).unwrap(),
        KvCache::with_window(4, 1, 2, 3, 4).unwrap(),
        KvCache::with_window(9, 1, 2, 3, 4).unwrap(),
    ];
    for (case, mut cache) in caches.into_iter().enumerate() {
        layer.prefill(x.view(), &mut cache).unwrap();
        let mut twin = cache.clone();
        let before = shown(&cache);
        for (input, kind) in [
            (wide.view(), ErrorKind::ShapeMismatch),
            (past_memory, ErrorKind::OutOfMemory),
            (too_large, ErrorKind::TooLarge),
        ] {
            for prefill in [false, true] {
                let result = match prefill {
                    true => layer.prefill(input, &mut cache),
                    false => layer.step(input, &mut cache),
                };
                let err = result.unwrap_err();
                assert_eq!(err.kind(), kind, "cache {case}: {err}");
                assert_eq!(
                    shown(&cache),
                    before,
                    "cache {case}, prefill {prefill}: {err}"
                );
            }
        }
        for n in [1, 2] {
            let next = filled3::<f64>(4 + n as u64, (1, n, 6));
            let y = layer.step(next.view(), &mut cache).unwrap();
            assert_eq!(
                y,
                layer.step(next.view(), &mut twin).unwrap(),
                "cache {case}"
            );
            assert_eq!(shown(&cache), shown(&twin), "cache {case}");
        }
    }
}
