//! `KvCache<bf16>` and `KvCache<f16>`: decoding over keys and values
//! stored in half precision, on every kernel set, against the reference
//! (`sdpa::core`, in `f64`) on the same rounded keys and values; and bit
//! for bit against an `f32` cache holding those rounded values, which runs
//! the same kernels on the same numbers (the half cache only widens them
//! tile by tile on the way in).
//!
//! Bound asserted per output entry of an `f32` output (`attend_compute*`),
//! against `r`, the `f64` reference on the rounded inputs:
//!
//! ```text
//! |out − r| ≤ 2e-5·(1 + max|v|)
//! ```
//!
//! (the `f32` path's own error: the inputs are exact in `f32`). With the
//! output in the cache's type (`attend`), one rounding more: `u·|r|` added,
//! `u` the type's unit roundoff.

use half::{bf16, f16};
use ndarray::{Array3, Array4, ArrayView4, s};
use sdpa::simd::{available_kernel_sets, with_kernel_set};
use sdpa::{
    AttentionConfig, AttentionOptions, CausalAttention, ErrorKind, KvCache, Storage, alibi_slopes,
};

use crate::common::Rng;

/// The half-precision types under test.
trait Half: Storage<Compute = f32> + PartialEq {
    const UNIT_ROUNDOFF: f64;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Half for bf16 {
    const UNIT_ROUNDOFF: f64 = 1.0 / 256.0;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Half for f16 {
    const UNIT_ROUNDOFF: f64 = 1.0 / 2048.0;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// `x` rounded to `H` and widened back: what a half cache holds, in `f32`.
fn through<H: Half>(x: &Array4<f32>) -> Array4<f32> {
    x.mapv(|x| H::from_f32(x).to_f32())
}

fn to_half<H: Half>(x: &Array4<f32>) -> Array4<H> {
    x.mapv(H::from_f32)
}

const HEADS: usize = 4;
const SINKS: [f32; HEADS] = [0.5, -1.0, 2.0, 0.0];

/// One decoding configuration: `[kv_heads, d_k, d_v]` and the ring, if
/// any. Head dims 16/64/128 are whole vectors on every set (the widened
/// decode path); 7/5 and 17/9 are not (the fallback), and 24 is whole on
/// AVX2 but not on AVX-512.
const CONFIGS: [([usize; 3], Option<usize>); 6] = [
    ([2, 16, 16], None),
    ([4, 64, 32], Some(5)),
    ([1, 128, 128], None),
    ([1, 7, 5], None),
    ([2, 17, 9], Some(3)),
    ([2, 24, 24], Some(70)),
];

/// The option sets decoding takes, in `T` (the sets' windows are no wider
/// than the rings they run on).
fn option_sets<'a, T: Copy + From<f32>>(
    slopes: &'a [T],
    sinks: &'a [T],
) -> Vec<(&'static str, AttentionOptions<'a, T>)> {
    let t = T::from;
    vec![
        ("plain", AttentionOptions::new()),
        ("scale", AttentionOptions::new().scale(t(0.7))),
        ("alibi", AttentionOptions::new().alibi(slopes)),
        ("sinks", AttentionOptions::new().sinks(sinks)),
        ("softcap", AttentionOptions::new().softcap(t(0.8))),
        ("window", AttentionOptions::new().window(3)),
        (
            "all modifiers",
            AttentionOptions::new()
                .alibi(slopes)
                .sinks(sinks)
                .softcap(t(1.5))
                .scale(t(0.9)),
        ),
        (
            "alibi, window",
            AttentionOptions::new().alibi(slopes).window(2),
        ),
    ]
}

/// The whole-sequence options a cache with `ring` equals.
fn whole<'a, T: Copy + std::fmt::Debug>(
    opts: &AttentionOptions<'a, T>,
    ring: Option<usize>,
) -> AttentionOptions<'a, T> {
    let has_window = format!("{opts:?}").contains("window: Some");
    match ring {
        Some(w) if !has_window => opts.clone().window(w),
        _ => opts.clone().causal(),
    }
}

/// A prompt of `PROMPT` positions, then single steps to `LEN` (past one
/// 64-key tile), with one two-token step in the middle (a ring's several
/// new tokens take the unrolled path).
const PROMPT: usize = 6;
const LEN: usize = 75;

/// The steps: `(t0, t1)` position ranges after the prompt.
fn steps() -> Vec<(usize, usize)> {
    let mut steps = Vec::new();
    let mut t = PROMPT;
    while t < LEN {
        let n = if t == 40 { 2 } else { 1 };
        steps.push((t, t + n));
        t += n;
    }
    steps
}

/// Random `q` `[1, HEADS, LEN, d_k]`, `k`, `v` in `f32`.
fn inputs(kv_heads: usize, d_k: usize, d_v: usize, seed: u64) -> [Array4<f32>; 3] {
    let mut rng = Rng::new(seed);
    [
        rng.array([1, HEADS, LEN, d_k]),
        rng.array([1, kv_heads, LEN, d_k]),
        rng.array([1, kv_heads, LEN, d_v]),
    ]
}

fn assert_within(
    got: ArrayView4<'_, f32>,
    expected: ArrayView4<'_, f64>,
    relative: f64,
    absolute: f64,
    what: &str,
) {
    assert_eq!(got.shape(), expected.shape(), "{what}");
    for (&a, &r) in got.iter().zip(expected.iter()) {
        let error = (f64::from(a) - r).abs();
        assert!(
            error <= relative * r.abs() + absolute,
            "{what}: {a} vs reference {r} (error {error:e})"
        );
    }
}

/// Decodes with a half cache (`f32` projections, `attend_compute_with`)
/// and checks every step against the `f64` reference on the rounded keys
/// and values, and bit for bit against an `f32` cache holding them.
fn decodes_as_the_reference<H: Half>(name: &str) {
    let slopes32: Vec<f32> = alibi_slopes(HEADS).iter().map(|&s| s as f32).collect();
    let slopes64: Vec<f64> = slopes32.iter().map(|&s| f64::from(s)).collect();
    let sinks64: Vec<f64> = SINKS.iter().map(|&s| f64::from(s)).collect();
    for (c, &([kv_heads, d_k, d_v], ring)) in CONFIGS.iter().enumerate() {
        let [q, k, v] = inputs(kv_heads, d_k, d_v, 100 + c as u64);
        let (k_held, v_held) = (through::<H>(&k), through::<H>(&v));
        let max_v = v_held.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
        let sets32 = option_sets(&slopes32, &SINKS);
        let sets64 = option_sets(&slopes64, &sinks64);
        for ((label, opts), (_, opts64)) in sets32.iter().zip(&sets64) {
            let reference = sdpa::core::scaled_dot_product_attention(
                q.mapv(f64::from).view(),
                k_held.mapv(f64::from).view(),
                v_held.mapv(f64::from).view(),
                &whole(opts64, ring),
            )
            .unwrap();
            for set in available_kernel_sets() {
                let what = format!("{name} {set}, config {c} (ring {ring:?}), {label}");
                with_kernel_set(set, || {
                    let new = |cap| match ring {
                        Some(w) => KvCache::<H>::with_window(w, 1, kv_heads, d_k, d_v),
                        None => KvCache::<H>::new(1, kv_heads, d_k, d_v, cap),
                    };
                    let new32 = |cap| match ring {
                        Some(w) => KvCache::<f32>::with_window(w, 1, kv_heads, d_k, d_v),
                        None => KvCache::<f32>::new(1, kv_heads, d_k, d_v, cap),
                    };
                    // A small capacity, so the growing cache grows.
                    let (mut cache, mut cache32) = (new(8).unwrap(), new32(8).unwrap());
                    let prompt = s![.., .., ..PROMPT, ..];
                    let (qp, kp, vp) = (q.slice(prompt), k.slice(prompt), v.slice(prompt));
                    cache.append_compute(kp, vp).unwrap();
                    cache32
                        .append(k_held.slice(prompt), v_held.slice(prompt))
                        .unwrap();
                    let _ = qp;
                    for (t0, t1) in steps() {
                        let new = s![.., .., t0..t1, ..];
                        let out = cache
                            .attend_compute_with(q.slice(new), k.slice(new), v.slice(new), opts)
                            .unwrap();
                        let out32 = cache32
                            .attend_with(q.slice(new), k_held.slice(new), v_held.slice(new), opts)
                            .unwrap();
                        let what = format!("{what}, positions {t0}..{t1}");
                        assert_within(
                            out.view(),
                            reference.slice(new),
                            0.0,
                            2e-5 * (1.0 + max_v),
                            &what,
                        );
                        let same = out
                            .iter()
                            .zip(&out32)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{what}: not the f32 cache's bits\n{out}\n{out32}");
                    }
                })
                .unwrap();
            }
        }
    }
}

#[test]
fn bf16_cache_decodes_as_the_reference_on_every_kernel_set() {
    decodes_as_the_reference::<bf16>("bf16");
}

#[test]
fn f16_cache_decodes_as_the_reference_on_every_kernel_set() {
    decodes_as_the_reference::<f16>("f16");
}

/// `attend` with `q` and the output in the cache's type: one rounding of
/// `q` (the reference sees the rounded `q`) and one of the output.
fn half_queries_and_output<H: Half>(name: &str) {
    let (kv_heads, d_k, d_v) = (2, 32, 32);
    let [q, k, v] = inputs(kv_heads, d_k, d_v, 7);
    let (qh, kh, vh) = (to_half::<H>(&q), to_half::<H>(&k), to_half::<H>(&v));
    let widen = |x: &Array4<H>| x.mapv(|x| f64::from(x.to_f32()));
    let reference = sdpa::core::scaled_dot_product_attention(
        widen(&qh).view(),
        widen(&kh).view(),
        widen(&vh).view(),
        &AttentionOptions::new().causal(),
    )
    .unwrap();
    let max_v = widen(&vh).iter().fold(0f64, |m, &x| m.max(x.abs()));
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            let mut cache = KvCache::<H>::new(1, kv_heads, d_k, d_v, 16).unwrap();
            let prompt = s![.., .., ..PROMPT, ..];
            let out = cache
                .prefill(
                    qh.slice(prompt),
                    kh.slice(prompt),
                    vh.slice(prompt),
                    &AttentionOptions::new(),
                )
                .unwrap();
            let mut rows = vec![(0, PROMPT, out)];
            for (t0, t1) in steps() {
                let new = s![.., .., t0..t1, ..];
                let out = cache
                    .attend(qh.slice(new), kh.slice(new), vh.slice(new))
                    .unwrap();
                rows.push((t0, t1, out));
            }
            for (t0, t1, out) in rows {
                let out = out.mapv(|x| x.to_f32());
                assert_within(
                    out.view(),
                    reference.slice(s![.., .., t0..t1, ..]),
                    H::UNIT_ROUNDOFF,
                    2e-5 * (1.0 + max_v),
                    &format!("{name} {set}, positions {t0}..{t1}"),
                );
            }
        })
        .unwrap();
    }
}

#[test]
fn bf16_queries_and_output_are_rounded_once() {
    half_queries_and_output::<bf16>("bf16");
}

#[test]
fn f16_queries_and_output_are_rounded_once() {
    half_queries_and_output::<f16>("f16");
}

/// Appending `f32` projections rounds each element to nearest-even: the
/// cache then holds exactly what appending the rounded values gives,
/// through growth, a ring's wrap and truncation.
fn appends_from_f32_and_from_half_agree<H: Half>() {
    let mut rng = Rng::new(3);
    // Values that round both ways, ties included: x·(1 + small).
    let k: Array4<f32> = rng.array([2, 2, 20, 8]).mapv(|x: f32| x * 300.0);
    let v: Array4<f32> = rng.array([2, 2, 20, 8]);
    for ring in [None, Some(7)] {
        let new = || match ring {
            Some(w) => KvCache::<H>::with_window(w, 2, 2, 8, 8).unwrap(),
            None => KvCache::<H>::new(2, 2, 8, 8, 3).unwrap(),
        };
        let (mut from_f32, mut from_half) = (new(), new());
        for t in 0..20 {
            let at = s![.., .., t..t + 1, ..];
            from_f32.append_compute(k.slice(at), v.slice(at)).unwrap();
            from_half
                .append(
                    to_half::<H>(&k.slice(at).to_owned()).view(),
                    to_half::<H>(&v.slice(at).to_owned()).view(),
                )
                .unwrap();
        }
        from_f32.truncate(19).unwrap();
        from_half.truncate(19).unwrap();
        let bits =
            |x: ArrayView4<'_, H>| x.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(from_f32.keys()),
            bits(from_half.keys()),
            "ring {ring:?}"
        );
        assert_eq!(
            bits(from_f32.values()),
            bits(from_half.values()),
            "ring {ring:?}"
        );
        assert_eq!(from_f32.len(), from_half.len());
    }
    // A tie rounds to even: 1 + 2⁻⁸ is halfway between bf16 1 and 1 + 2⁻⁷.
    let mut cache = KvCache::<H>::new(1, 1, 1, 1, 1).unwrap();
    let tie = Array4::from_elem((1, 1, 1, 1), 1.0 + H::UNIT_ROUNDOFF as f32);
    cache.append_compute(tie.view(), tie.view()).unwrap();
    assert_eq!(cache.keys()[[0, 0, 0, 0]].to_f32(), 1.0);
}

#[test]
fn appends_from_f32_round_to_nearest_even() {
    appends_from_f32_and_from_half_agree::<bf16>();
    appends_from_f32_and_from_half_agree::<f16>();
}

/// Past one decode chunk (1024 keys): the chunks' partials merge.
#[test]
fn long_half_caches_merge_their_chunks() {
    let (kv_heads, d, len) = (1, 64, 1100);
    let mut rng = Rng::new(11);
    let (q, k, v): (Array4<f32>, Array4<f32>, Array4<f32>) = (
        rng.array([1, 2, len, d]),
        rng.array([1, kv_heads, len, d]),
        rng.array([1, kv_heads, len, d]),
    );
    let (k_held, v_held) = (through::<bf16>(&k), through::<bf16>(&v));
    let reference = sdpa::core::scaled_dot_product_attention(
        q.mapv(f64::from).view(),
        k_held.mapv(f64::from).view(),
        v_held.mapv(f64::from).view(),
        &AttentionOptions::new().causal(),
    )
    .unwrap();
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            let mut cache = KvCache::<bf16>::new(1, kv_heads, d, d, 64).unwrap();
            let prompt = s![.., .., ..len - 3, ..];
            cache
                .append_compute(k.slice(prompt), v.slice(prompt))
                .unwrap();
            for t in len - 3..len {
                let new = s![.., .., t..t + 1, ..];
                let out = cache
                    .attend_compute(q.slice(new), k.slice(new), v.slice(new))
                    .unwrap();
                assert_within(
                    out.view(),
                    reference.slice(new),
                    0.0,
                    4e-5,
                    &format!("{set}, {t}"),
                );
            }
        })
        .unwrap();
    }
}

/// NaN in a sequence's padding, or in keys a window hides, never reaches
/// the output.
#[test]
fn nan_in_hidden_half_keys_never_leaks() {
    let d = 16;
    let mut rng = Rng::new(5);
    let mut k: Array4<f32> = rng.array([2, 1, 12, d]);
    let mut v: Array4<f32> = rng.array([2, 1, 12, d]);
    let q: Array4<f32> = rng.array([2, 2, 12, d]);
    // Sequence 1 has 5 tokens of a 10-token right-padded prompt.
    k.slice_mut(s![1, .., 5..10, ..]).fill(f32::NAN);
    v.slice_mut(s![1, .., 5..10, ..]).fill(f32::NAN);
    // Sequence 0's first keys are hidden by a window of 4 once decoding.
    k.slice_mut(s![0, .., 0..2, ..]).fill(f32::NAN);
    v.slice_mut(s![0, .., 0..2, ..]).fill(f32::INFINITY);
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            let mut cache = KvCache::<bf16>::new(2, 1, d, d, 16).unwrap();
            let prompt = s![.., .., ..10, ..];
            let lengths = [10, 5];
            let opts = AttentionOptions::new().key_lengths(&lengths).window(4);
            let out = cache
                .prefill(
                    to_half::<bf16>(&q.slice(prompt).to_owned()).view(),
                    to_half::<bf16>(&k.slice(prompt).to_owned()).view(),
                    to_half::<bf16>(&v.slice(prompt).to_owned()).view(),
                    &opts,
                )
                .unwrap();
            // Sequence 0's first rows see the NaN keys: only later rows count.
            assert!(
                out.slice(s![1, .., ..5, ..]).iter().all(|x| x.is_finite()),
                "{set}"
            );
            assert!(
                out.slice(s![0, .., 5.., ..]).iter().all(|x| x.is_finite()),
                "{set}"
            );
            for t in 10..12 {
                let new = s![.., .., t..t + 1, ..];
                let out = cache
                    .attend_compute_with(
                        q.slice(new),
                        k.slice(new),
                        v.slice(new),
                        &AttentionOptions::new().window(4),
                    )
                    .unwrap();
                assert!(out.iter().all(|x| x.is_finite()), "{set}, step {t}: {out}");
            }
        })
        .unwrap();
    }
}

/// Bad shapes are errors that change nothing, from `f32` as from half.
#[test]
fn bad_half_appends_are_errors_that_change_nothing() {
    let mut cache = KvCache::<f16>::new(1, 2, 8, 8, 4).unwrap();
    let x = Array4::<f32>::ones((1, 2, 3, 8));
    cache.append_compute(x.view(), x.view()).unwrap();
    let wrong = Array4::<f32>::ones((1, 3, 1, 8));
    let err = cache
        .append_compute(wrong.view(), wrong.view())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ShapeMismatch);
    let q = Array4::<f32>::ones((1, 3, 1, 8));
    let one = Array4::<f32>::ones((1, 2, 1, 8));
    let err = cache
        .attend_compute(q.view(), one.view(), one.view())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::HeadsNotDivisible);
    // A broadcast view too long to copy is an error, not an abort.
    let many = one.broadcast((1, 2, 1 << 58, 8)).unwrap();
    let err = cache.append_compute(many, many).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::TooLarge | ErrorKind::OutOfMemory),
        "{err}"
    );
    assert_eq!((cache.len(), cache.capacity()), (3, 4));
}

/// An `f32` layer decoding with a `bf16`/`f16` cache (`new_cache_in`,
/// `new_window_cache_in`), growing and ring, on every kernel set. With
/// weights and inputs on a grid whose projections are exact in half
/// precision (multiples of 1/32 below 8 bits), the half cache holds the
/// f32 cache's numbers, and prefill and steps give the f32 cache's bits.
/// With seeded weights, the cache holds the projections rounded to nearest
/// even: the f32 cache's entries, rounded.
fn layer_decodes_with_a_half_cache<H: Half>(name: &str) {
    let config = AttentionConfig::new(32, 2)
        .with_kv_heads(1)
        .with_output_projection(32);
    let seeded = CausalAttention::<f32>::new_seeded(config, 5).unwrap();
    let mut on_grid = seeded.clone();
    for (_, mut parameter) in on_grid.parameters_mut() {
        for (n, w) in parameter.iter_mut().enumerate() {
            *w = ((n * 7 % 5) as f32 - 2.0) * 0.25;
        }
    }
    let x = Array3::from_shape_fn((2, 9, 32), |(b, t, j)| {
        ((b + t * 5 + j) % 7) as f32 * 0.125 - 0.375
    });
    let bits = |y: &Array3<f32>| y.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
    let rounded = |x: ArrayView4<'_, f32>| x.mapv(|x| H::from_f32(x).to_f32());
    let widened = |x: ArrayView4<'_, H>| x.mapv(H::to_f32);
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            for (layer, exact) in [(&on_grid, true), (&seeded, false)] {
                for window in [None, Some(4)] {
                    let (mut full, mut half) = match window {
                        None => (
                            layer.new_cache(2, 4).unwrap(),
                            layer.new_cache_in::<H>(2, 4).unwrap(),
                        ),
                        Some(w) => (
                            layer.new_window_cache(2, w).unwrap(),
                            layer.new_window_cache_in::<H>(2, w).unwrap(),
                        ),
                    };
                    let what = format!("{name}, {set:?}, exact {exact}, window {window:?}");
                    let prompt = x.slice(s![.., ..6, ..]);
                    let a = layer.prefill(prompt, &mut full).unwrap();
                    let b = layer.prefill(prompt, &mut half).unwrap();
                    let mut outputs = vec![(a, b)];
                    for t in 6..9 {
                        let token = x.slice(s![.., t..t + 1, ..]);
                        let a = layer.step(token, &mut full).unwrap();
                        let b = layer.step(token, &mut half).unwrap();
                        outputs.push((a, b));
                    }
                    assert_eq!(half.total_len(), 9, "{what}");
                    assert_eq!(widened(half.keys()), rounded(full.keys()), "{what}: keys");
                    assert_eq!(
                        widened(half.values()),
                        rounded(full.values()),
                        "{what}: values"
                    );
                    if exact {
                        assert_eq!(full.keys(), rounded(full.keys()), "{what}: on the grid");
                        for (a, b) in &outputs {
                            assert_eq!(bits(a), bits(b), "{what}: outputs");
                        }
                    } else {
                        assert_ne!(full.keys(), rounded(full.keys()), "{what}: rounding");
                    }
                }
            }
        })
        .expect("an available kernel set");
    }
}

#[test]
fn f32_layer_decodes_with_a_bf16_cache() {
    layer_decodes_with_a_half_cache::<bf16>("bf16");
}

#[test]
fn f32_layer_decodes_with_an_f16_cache() {
    layer_decodes_with_a_half_cache::<f16>("f16");
}

/// A cache attended with `f32` queries (`attend_compute`, a layer's path)
/// never rounds them, on any kernel set, prefill (many queries) or step:
/// here the winning key is decided by a query bit below `bf16`'s
/// precision. Query `(1 + 2⁻⁹, 1, 0, …)` against keys `2¹⁶·e₀` and
/// `2¹⁶·e₁`: exact scores differ by 2¹⁶·2⁻⁹/8 = 16 after the scale, so the
/// first key takes all but e⁻¹⁶ of the weight; a query rounded or cut to
/// `bf16` (1 + 2⁻⁹ is not one) would tie them.
#[test]
fn f32_queries_are_not_rounded_to_a_bf16_cache() {
    let d = 64;
    for n in [16, 2] {
        let mut q = Array4::<f32>::zeros((1, 2, n, d));
        q.slice_mut(s![.., .., .., 0]).fill(1.0 + 2f32.powi(-9));
        q.slice_mut(s![.., .., .., 1]).fill(1.0);
        let mut k = Array4::<f32>::zeros((1, 1, n, d));
        k[[0, 0, 0, 0]] = 65536.0;
        k[[0, 0, 1, 1]] = 65536.0;
        let mut v = Array4::<f32>::zeros((1, 1, n, d));
        v.slice_mut(s![.., .., 0, ..]).fill(1.0);
        v.slice_mut(s![.., .., 1, ..]).fill(-1.0);
        for set in available_kernel_sets() {
            let out = with_kernel_set(set, || {
                let mut cache = KvCache::<bf16>::new(1, 1, d, d, n).unwrap();
                cache.attend_compute(q.view(), k.view(), v.view()).unwrap()
            })
            .unwrap();
            // Every row sees key 0; from row 1 on also key 1 (causal).
            for x in out.iter() {
                assert!((x - 1.0).abs() < 1e-5, "{} n {n}: {x}", set.name());
            }
        }
    }
}
