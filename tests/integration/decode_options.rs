//! Decoding with options: `KvCache::prefill` / `attend_with` and the
//! layers' `prefill_with` / `step_with` give, step by step, what the
//! functional API (or the layer's forward) gives with the same options over
//! the whole sequence; on growing caches and rings (whose rotated keys must
//! not move ALiBi's distances), for every option decoding takes; padded
//! prompts (left and right) decode each sequence as if it were alone, and
//! its padding never leaks; every option decoding cannot take is an error
//! that leaves the cache as it was.

use ndarray::{Array3, Array4, ArrayView4, Axis, s};
use sdpa::{
    AttentionConfig, AttentionOptions, CausalAlignment, CausalAttention, ErrorKind, KvCache,
    RopeConfig, alibi_slopes, scaled_dot_product_attention,
};

use crate::common::Rng;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
// A whole number of vectors on every kernel set, so that steps run the
// decode driver, which reads the cache in place.
const D: usize = 16;

fn slopes() -> Vec<f32> {
    alibi_slopes(HEADS).iter().map(|&s| s as f32).collect()
}

const SINKS: [f32; HEADS] = [0.5, -1.0, 2.0, 0.0];

/// The option sets decoding takes, by name, each built from `slopes`,
/// `bias` (`[1, HEADS, len, len]`, for growing caches only) and `SINKS`.
fn option_sets<'a>(
    slopes: &'a [f32],
    bias: Option<ArrayView4<'a, f32>>,
) -> Vec<(&'static str, AttentionOptions<'a, f32>)> {
    let mut sets = vec![
        ("plain", AttentionOptions::new()),
        ("scale", AttentionOptions::new().scale(0.7)),
        ("alibi", AttentionOptions::new().alibi(slopes)),
        ("sinks", AttentionOptions::new().sinks(&SINKS)),
        ("softcap", AttentionOptions::new().softcap(0.8)),
        ("window", AttentionOptions::new().window(3)),
        (
            "all modifiers",
            AttentionOptions::new()
                .alibi(slopes)
                .sinks(&SINKS)
                .softcap(1.5)
                .scale(0.9),
        ),
        (
            "alibi, window",
            AttentionOptions::new().alibi(slopes).window(2),
        ),
    ];
    if let Some(bias) = bias {
        sets.push(("bias", AttentionOptions::new().bias(bias)));
        sets.push((
            "bias, alibi",
            AttentionOptions::new().bias(bias).alibi(slopes),
        ));
    }
    sets
}

/// The whole-sequence options a cache with `ring` equals: causal, within
/// the ring's window unless the options have a window (the sets' windows
/// are no wider than the rings they run on).
fn whole<'a>(opts: &AttentionOptions<'a, f32>, ring: Option<usize>) -> AttentionOptions<'a, f32> {
    let has_window = format!("{opts:?}").contains("window: Some");
    match ring {
        Some(w) if !has_window => opts.clone().window(w),
        _ => opts.clone().causal(),
    }
}

fn assert_close(got: ArrayView4<'_, f32>, expected: ArrayView4<'_, f32>, what: &str) {
    assert_eq!(got.shape(), expected.shape(), "{what}");
    for (a, b) in got.iter().zip(expected.iter()) {
        assert!(
            (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
            "{what}: {a} vs {b}\ngot {got}\nexpected {expected}"
        );
    }
}

/// The bias rows of the new positions `t0..t1` for a growing cache:
/// `[1, HEADS, n, t1]`, the rows of the whole-sequence bias.
fn bias_rows(bias: &Array4<f32>, t0: usize, t1: usize) -> Array4<f32> {
    bias.slice(s![.., .., t0..t1, ..t1]).to_owned()
}

#[test]
fn steps_with_options_equal_the_whole_sequence() {
    let len = 11;
    let mut rng = Rng::new(17);
    let q = rng.array::<f32>([2, HEADS, len, D]);
    let k = rng.array::<f32>([2, KV_HEADS, len, D]);
    let v = rng.array::<f32>([2, KV_HEADS, len, D]);
    let bias = rng.array::<f32>([1, HEADS, len, len]);
    let slopes = slopes();
    // Chunks of new positions: a prompt of 3, then 1, 2, 1, 1, 3.
    let chunks = [0, 3, 4, 6, 7, 8, 11];
    for ring in [None, Some(4), Some(3)] {
        let bias_view = ring.is_none().then(|| bias.view());
        let sets = option_sets(&slopes, bias_view);
        for (index, (name, opts)) in sets.iter().enumerate() {
            let expected =
                scaled_dot_product_attention(q.view(), k.view(), v.view(), &whole(opts, ring))
                    .unwrap();
            for capacity in [2, 16] {
                let mut cache = match ring {
                    Some(w) => KvCache::with_window(w, 2, KV_HEADS, D, D).unwrap(),
                    None => KvCache::new(2, KV_HEADS, D, D, capacity).unwrap(),
                };
                for pair in chunks.windows(2) {
                    let (t0, t1) = (pair[0], pair[1]);
                    let new = s![.., .., t0..t1, ..];
                    // A growing cache's bias has a column per position so far.
                    let rows = bias_rows(&bias, t0, t1);
                    let step_sets = option_sets(&slopes, ring.is_none().then(|| rows.view()));
                    let step_opts = &step_sets[index].1;
                    let got = if t0 == 0 {
                        cache.prefill(q.slice(new), k.slice(new), v.slice(new), step_opts)
                    } else {
                        cache.attend_with(q.slice(new), k.slice(new), v.slice(new), step_opts)
                    }
                    .unwrap();
                    let what = format!("{name}, ring {ring:?}, capacity {capacity}, {t0}..{t1}");
                    assert_close(got.view(), expected.slice(new), &what);
                }
            }
        }
    }
}

#[test]
fn a_ring_attends_alibi_in_position_order_for_every_rotation() {
    // One token at a time through many rotations of a ring of 5: the
    // single-token path in a full ring, whose keys run in two parts.
    let len = 17;
    let mut rng = Rng::new(3);
    let q = rng.array::<f32>([1, HEADS, len, D]);
    let k = rng.array::<f32>([1, KV_HEADS, len, D]);
    let v = rng.array::<f32>([1, KV_HEADS, len, D]);
    let slopes = slopes();
    for opts in [
        AttentionOptions::new().alibi(&slopes),
        AttentionOptions::new().alibi(&slopes).sinks(&SINKS),
        AttentionOptions::new().window(3).sinks(&SINKS),
    ] {
        let expected =
            scaled_dot_product_attention(q.view(), k.view(), v.view(), &whole(&opts, Some(5)))
                .unwrap();
        let mut cache = KvCache::with_window(5, 1, KV_HEADS, D, D).unwrap();
        for t in 0..len {
            let new = s![.., .., t..t + 1, ..];
            let got = cache
                .attend_with(q.slice(new), k.slice(new), v.slice(new), &opts)
                .unwrap();
            assert_close(got.view(), expected.slice(new), &format!("{opts:?}, t {t}"));
        }
    }
}

/// `[batch, heads, len, d]` inputs of sequences of `lengths`, each padded
/// to `len` on the left (`left`) or the right, the padding NaN; and each
/// sequence alone, unpadded.
struct Padded {
    q: Array4<f32>,
    k: Array4<f32>,
    v: Array4<f32>,
    alone: Vec<[Array4<f32>; 3]>,
}

fn padded(lengths: &[usize], len: usize, steps: usize, left: bool, seed: u64) -> Padded {
    let mut rng = Rng::new(seed);
    let batch = lengths.len();
    let total = len + steps;
    let mut q = Array4::from_elem((batch, HEADS, total, D), f32::NAN);
    let mut k = Array4::from_elem((batch, KV_HEADS, total, D), f32::NAN);
    let mut v = Array4::from_elem((batch, KV_HEADS, total, D), f32::NAN);
    let mut alone = Vec::new();
    for (b, &length) in lengths.iter().enumerate() {
        let own = length + steps;
        let parts = [
            rng.array::<f32>([1, HEADS, own, D]),
            rng.array::<f32>([1, KV_HEADS, own, D]),
            rng.array::<f32>([1, KV_HEADS, own, D]),
        ];
        let at = if left { len - length } else { 0 };
        for (target, part) in [&mut q, &mut k, &mut v].into_iter().zip(&parts) {
            let mut seq = target.slice_mut(s![b..=b, .., .., ..]);
            seq.slice_mut(s![.., .., at..at + length, ..])
                .assign(&part.slice(s![.., .., ..length, ..]));
            seq.slice_mut(s![.., .., len.., ..])
                .assign(&part.slice(s![.., .., length.., ..]));
        }
        alone.push(parts);
    }
    Padded { q, k, v, alone }
}

#[test]
fn padded_prompts_decode_each_sequence_as_if_alone() {
    let (lengths, len, steps) = ([5, 2, 0, 4], 5, 4);
    let slopes = slopes();
    for left in [true, false] {
        let p = padded(&lengths, len, steps, left, 29);
        let starts: Vec<usize> = lengths.iter().map(|&l| len - l).collect();
        for ring in [None, Some(3)] {
            for (name, opts) in option_sets(&slopes, None) {
                let mut cache = match ring {
                    Some(w) => KvCache::with_window(w, lengths.len(), KV_HEADS, D, D).unwrap(),
                    None => KvCache::new(lengths.len(), KV_HEADS, D, D, 4).unwrap(),
                };
                let prompt = s![.., .., ..len, ..];
                let prefill_opts = if left {
                    opts.clone().key_starts(&starts)
                } else {
                    opts.clone().key_lengths(&lengths)
                };
                let y = cache
                    .prefill(
                        p.q.slice(prompt),
                        p.k.slice(prompt),
                        p.v.slice(prompt),
                        &prefill_opts,
                    )
                    .unwrap();
                let expected_starts = starts.iter().any(|&s| s > 0).then_some(&starts[..]);
                assert_eq!(cache.key_starts(), expected_starts);
                let mut steps_out = Vec::new();
                for t in len..len + steps {
                    let new = s![.., .., t..t + 1, ..];
                    let out = cache
                        .attend_with(p.q.slice(new), p.k.slice(new), p.v.slice(new), &opts)
                        .unwrap();
                    steps_out.push(out);
                }
                for (b, &length) in lengths.iter().enumerate() {
                    let [q, k, v] = &p.alone[b];
                    let expected = scaled_dot_product_attention(
                        q.view(),
                        k.view(),
                        v.view(),
                        &whole(&opts, ring),
                    )
                    .unwrap();
                    let what = format!("{name}, left {left}, ring {ring:?}, sequence {b}");
                    let at = if left { len - length } else { 0 };
                    assert_close(
                        y.slice(s![b..=b, .., at..at + length, ..]),
                        expected.slice(s![.., .., ..length, ..]),
                        &format!("{what}, prompt"),
                    );
                    let pad = if left {
                        s![b..=b, .., ..at, ..]
                    } else {
                        s![b..=b, .., length..len, ..]
                    };
                    assert!(
                        y.slice(pad).iter().all(|&x| x == 0.0),
                        "{what}: padding rows"
                    );
                    for (step, out) in steps_out.iter().enumerate() {
                        assert_close(
                            out.slice(s![b..=b, .., .., ..]),
                            expected.slice(s![.., .., length + step..=length + step, ..]),
                            &format!("{what}, step {step}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn options_decoding_cannot_take_are_errors_that_change_nothing() {
    let mut rng = Rng::new(5);
    let x = rng.array::<f32>([1, KV_HEADS, 4, D]);
    let bias = Array4::<f32>::zeros((1, 1, 1, 5));
    let mut growing = KvCache::new(1, KV_HEADS, D, D, 8).unwrap();
    let mut ring = KvCache::with_window(3, 1, KV_HEADS, D, D).unwrap();
    for cache in [&mut growing, &mut ring] {
        cache
            .prefill(x.view(), x.view(), x.view(), &AttentionOptions::new())
            .unwrap();
    }
    let new = x.slice(s![.., .., ..1, ..]);
    let step_errors = [
        AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft),
        AttentionOptions::new().key_shard(0, 5),
        AttentionOptions::new().key_lengths(&[1]),
        AttentionOptions::new().key_starts(&[0]),
    ];
    for cache in [&mut growing, &mut ring] {
        let before = (cache.len(), cache.total_len(), cache.keys().to_owned());
        for opts in &step_errors {
            let err = cache.attend_with(new, new, new, opts).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidOption, "{err}");
        }
        // A slope per head is checked as in a forward.
        let err = cache
            .attend_with(new, new, new, &AttentionOptions::new().alibi(&[0.5]))
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidOption, "{err}");
        assert_eq!(
            (cache.len(), cache.total_len(), cache.keys().to_owned()),
            before
        );
    }
    // A ring has no fixed column for a bias.
    let err = ring
        .attend_with(new, new, new, &AttentionOptions::new().bias(bias.view()))
        .unwrap_err();
    assert!(err.to_string().contains("ring"), "{err}");
    // A growing cache's bias must cover the positions so far.
    let short = Array4::<f32>::zeros((1, 1, 1, 3));
    let err = growing
        .attend_with(new, new, new, &AttentionOptions::new().bias(short.view()))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotBroadcastable, "{err}");

    // Prefill: one padding at a time, padding not past the prompt, and no
    // bias with a right padding.
    let before = (
        growing.len(),
        growing.total_len(),
        growing.keys().to_owned(),
    );
    let prompt_bias = Array4::<f32>::zeros((1, 1, 4, 4));
    for (opts, kind) in [
        (
            AttentionOptions::new().key_lengths(&[2]).key_starts(&[1]),
            ErrorKind::InvalidOption,
        ),
        (
            AttentionOptions::new().key_lengths(&[5]),
            ErrorKind::KeyLengths,
        ),
        (
            AttentionOptions::new().key_lengths(&[1, 2]),
            ErrorKind::KeyLengths,
        ),
        (
            AttentionOptions::new().key_starts(&[5]),
            ErrorKind::KeyLengths,
        ),
        (
            AttentionOptions::new()
                .key_lengths(&[2])
                .bias(prompt_bias.view()),
            ErrorKind::InvalidOption,
        ),
    ] {
        let err = growing
            .prefill(x.view(), x.view(), x.view(), &opts)
            .unwrap_err();
        assert_eq!(err.kind(), kind, "{err}");
    }
    assert_eq!(
        (
            growing.len(),
            growing.total_len(),
            growing.keys().to_owned()
        ),
        before
    );
}

#[test]
fn nan_in_a_sequences_padding_never_leaks() {
    // `padded` fills padding with NaN; the padded-prompt test checks the
    // values. Here: every output of a left-padded decode is finite, for a
    // sequence with no real prompt token too.
    let lengths = [3, 0, 1];
    let p = padded(&lengths, 3, 2, true, 41);
    let starts: Vec<usize> = lengths.iter().map(|&l| 3 - l).collect();
    let slopes = slopes();
    let opts = AttentionOptions::new().alibi(&slopes).sinks(&SINKS);
    for ring in [None, Some(2)] {
        let mut cache = match ring {
            Some(w) => KvCache::with_window(w, 3, KV_HEADS, D, D).unwrap(),
            None => KvCache::new(3, KV_HEADS, D, D, 2).unwrap(),
        };
        let prompt = s![.., .., ..3, ..];
        let y = cache
            .prefill(
                p.q.slice(prompt),
                p.k.slice(prompt),
                p.v.slice(prompt),
                &opts.clone().key_starts(&starts),
            )
            .unwrap();
        assert!(y.iter().all(|x| x.is_finite()), "ring {ring:?}: {y}");
        for t in 3..5 {
            let new = s![.., .., t..t + 1, ..];
            let out = cache
                .attend_with(p.q.slice(new), p.k.slice(new), p.v.slice(new), &opts)
                .unwrap();
            assert!(
                out.iter().all(|x| x.is_finite()),
                "ring {ring:?}, t {t}: {out}"
            );
        }
    }
}

fn layer(rope: bool) -> CausalAttention<f32> {
    let mut config = AttentionConfig::new(16, HEADS)
        .with_kv_heads(KV_HEADS)
        .with_output_projection(16);
    if rope {
        config = config.with_rope(RopeConfig::new(10_000.0, 64));
    }
    CausalAttention::new_seeded(config, 11).unwrap()
}

#[test]
fn layer_steps_with_options_equal_its_forward() {
    let mut rng = Rng::new(7);
    let x: Array3<f32> = rng.array::<f32>([1, 2, 9, 16]).index_axis_move(Axis(0), 0);
    let slopes = slopes();
    for rope in [false, true] {
        let layer = layer(rope);
        for ring in [None, Some(4)] {
            for (name, opts) in option_sets(&slopes, None) {
                let full_opts = whole(&opts, ring);
                let expected = layer.forward_batch_with(x.view(), &full_opts).unwrap();
                let mut cache = match ring {
                    Some(w) => layer.new_window_cache(2, w).unwrap(),
                    None => layer.new_cache(2, 2).unwrap(),
                };
                let what = format!("{name}, rope {rope}, ring {ring:?}");
                let y = layer
                    .prefill_with(x.slice(s![.., ..5, ..]), &opts, &mut cache)
                    .unwrap();
                assert_close(
                    y.view().insert_axis(Axis(0)),
                    expected.slice(s![.., ..5, ..]).insert_axis(Axis(0)),
                    &what,
                );
                for t in 5..9 {
                    let y = layer
                        .step_with(x.slice(s![.., t..t + 1, ..]), &opts, &mut cache)
                        .unwrap();
                    assert_close(
                        y.view().insert_axis(Axis(0)),
                        expected.slice(s![.., t..t + 1, ..]).insert_axis(Axis(0)),
                        &format!("{what}, t {t}"),
                    );
                }
            }
        }
    }
}

#[test]
fn a_layer_decodes_padded_prompts_as_if_each_sequence_were_alone() {
    // With rotary embeddings too: a sequence's positions in the cache are
    // its own shifted by its padding, which leaves every score as it is.
    let (lengths, len, steps) = ([6, 3, 1], 6, 3);
    let mut rng = Rng::new(23);
    let slopes = slopes();
    for rope in [false, true] {
        let layer = layer(rope);
        for left in [true, false] {
            let alone: Vec<Array3<f32>> = lengths
                .iter()
                .map(|&l| {
                    rng.array::<f32>([1, 1, l + steps, 16])
                        .index_axis_move(Axis(0), 0)
                })
                .collect();
            let mut x = Array3::from_elem((3, len + steps, 16), f32::NAN);
            for (b, &length) in lengths.iter().enumerate() {
                let at = if left { len - length } else { 0 };
                x.slice_mut(s![b, at..at + length, ..])
                    .assign(&alone[b].slice(s![0, ..length, ..]));
                x.slice_mut(s![b, len.., ..])
                    .assign(&alone[b].slice(s![0, length.., ..]));
            }
            let starts: Vec<usize> = lengths.iter().map(|&l| len - l).collect();
            for opts in [
                AttentionOptions::new(),
                AttentionOptions::new().alibi(&slopes).softcap(2.0),
            ] {
                let prefill_opts = if left {
                    opts.clone().key_starts(&starts)
                } else {
                    opts.clone().key_lengths(&lengths)
                };
                let mut cache = layer.new_cache(3, 4).unwrap();
                let y = layer
                    .prefill_with(x.slice(s![.., ..len, ..]), &prefill_opts, &mut cache)
                    .unwrap();
                let mut step_rows = Vec::new();
                for t in len..len + steps {
                    step_rows.push(
                        layer
                            .step_with(x.slice(s![.., t..t + 1, ..]), &opts, &mut cache)
                            .unwrap(),
                    );
                }
                for (b, &length) in lengths.iter().enumerate() {
                    let expected = layer
                        .forward_batch_with(alone[b].view(), &opts.clone().causal())
                        .unwrap();
                    let what = format!("rope {rope}, left {left}, sequence {b}");
                    let at = if left { len - length } else { 0 };
                    assert_close(
                        y.slice(s![b..=b, at..at + length, ..]).insert_axis(Axis(0)),
                        expected.slice(s![.., ..length, ..]).insert_axis(Axis(0)),
                        &what,
                    );
                    for (step, row) in step_rows.iter().enumerate() {
                        assert_close(
                            row.slice(s![b..=b, .., ..]).insert_axis(Axis(0)),
                            expected
                                .slice(s![.., length + step..=length + step, ..])
                                .insert_axis(Axis(0)),
                            &format!("{what}, step {step}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn key_starts_hide_exactly_the_keys_a_keep_mask_would() {
    // The option on its own, in the functional API: the fused f32 forward
    // and backward against the f64 reference with the equivalent keep mask,
    // causal or not, with key lengths too, across tiles (len 70 > a key tile).
    let (batch, len_q, len_kv) = (3, 5, 70);
    let mut rng = Rng::new(13);
    let q = rng.array::<f64>([batch, HEADS, len_q, D]);
    let k = rng.array::<f64>([batch, KV_HEADS, len_kv, D]);
    let v = rng.array::<f64>([batch, KV_HEADS, len_kv, D]);
    let d_out = rng.array::<f64>([batch, HEADS, len_q, D]);
    let (starts, lengths) = ([0, 33, 69], [70, 60, 70]);
    let f32s = |x: &Array4<f64>| x.mapv(|x| x as f32);
    for causal in [false, true] {
        let mut keep = Array4::from_elem((batch, 1, len_q, len_kv), false);
        for ((b, _, i, j), keep) in keep.indexed_iter_mut() {
            let diagonal = i + len_kv - len_q;
            *keep = j >= starts[b] && j < lengths[b] && (!causal || j <= diagonal);
        }
        let with_starts = causal_if(AttentionOptions::new(), causal)
            .key_starts(&starts)
            .key_lengths(&lengths);
        let with_mask = causal_if(AttentionOptions::new(), causal).keep_mask(keep.view());
        let reference =
            sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &with_mask)
                .unwrap();
        let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
        let opts32 = causal_if(
            AttentionOptions::<f32>::new()
                .key_starts(&starts)
                .key_lengths(&lengths),
            causal,
        );
        let fused =
            scaled_dot_product_attention(q32.view(), k32.view(), v32.view(), &opts32).unwrap();
        assert_close(
            fused.view(),
            reference.mapv(|x| x as f32).view(),
            &format!("causal {causal}"),
        );
        let own =
            sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &with_starts)
                .unwrap();
        assert!(
            own.iter()
                .zip(&reference)
                .all(|(a, b)| (a - b).abs() < 1e-14)
        );

        let forward =
            sdpa::scaled_dot_product_attention_partial(q32.view(), k32.view(), v32.view(), &opts32)
                .unwrap();
        let grads = sdpa::scaled_dot_product_attention_backward(
            q32.view(),
            k32.view(),
            v32.view(),
            &opts32,
            &forward,
            f32s(&d_out).view(),
        )
        .unwrap();
        let forward64 =
            sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &with_mask)
                .unwrap();
        let expected = sdpa::core::scaled_dot_product_attention_backward(
            q.view(),
            k.view(),
            v.view(),
            &with_mask,
            &forward64,
            d_out.view(),
        )
        .unwrap();
        for (got, want, name) in [
            (&grads.d_q, &expected.d_q, "d_q"),
            (&grads.d_k, &expected.d_k, "d_k"),
            (&grads.d_v, &expected.d_v, "d_v"),
        ] {
            assert_close(
                got.view(),
                want.mapv(|x| x as f32).view(),
                &format!("{name}, causal {causal}"),
            );
        }
    }
}

fn causal_if<F: Copy>(opts: AttentionOptions<'_, F>, causal: bool) -> AttentionOptions<'_, F> {
    if causal { opts.causal() } else { opts }
}

#[test]
fn truncating_into_a_sequences_padding_restarts_it_at_the_next_position() {
    let mut rng = Rng::new(31);
    let x = rng.array::<f32>([2, KV_HEADS, 6, D]);
    let q = rng.array::<f32>([2, HEADS, 6, D]);
    for ring in [None, Some(8)] {
        let mut cache = match ring {
            Some(w) => KvCache::with_window(w, 2, KV_HEADS, D, D).unwrap(),
            None => KvCache::new(2, KV_HEADS, D, D, 8).unwrap(),
        };
        let prompt = s![.., .., ..5, ..];
        let opts = AttentionOptions::new().key_starts(&[0, 4]);
        cache
            .prefill(q.slice(prompt), x.slice(prompt), x.slice(prompt), &opts)
            .unwrap();
        cache.truncate(3).unwrap();
        assert_eq!(cache.key_starts(), Some(&[0, 3][..]), "ring {ring:?}");
        let new = s![.., .., 5..6, ..];
        let out = cache
            .attend(q.slice(new), x.slice(new), x.slice(new))
            .unwrap();
        // Sequence 1 has only its new token: the output is its value.
        assert_close(
            out.slice(s![1..2, ..1, .., ..]),
            x.slice(s![1..2, ..1, 5..6, ..]),
            "alone",
        );
    }
}
