//! Every kernel set this CPU has, against the f64 reference (`sdpa::core`),
//! on odd shapes, edges, every option combination and misaligned views.

use crate::common::{Engine, engines};
use ndarray::{Array4, ArrayView4, Axis, s};
use sdpa::simd::{KernelSet, available_kernel_sets};
use sdpa::{AttentionOptions, CausalAlignment};

/// `f` with every `f32` call on this thread running on `engine`.
fn on<R>(engine: Engine, f: impl FnOnce() -> R) -> R {
    engine.run(f).expect("an available kernel set")
}

/// Deterministic uniform numbers in [-1, 1) (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// A standard normal number (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (1.0 - (self.next() + 1.0) / 2.0, (self.next() + 1.0) / 2.0);
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn array(&mut self, dim: (usize, usize, usize, usize), magnitude: f64) -> Array4<f64> {
        Array4::from_shape_simple_fn(dim, || self.next() * magnitude)
    }
}

/// Which options a case uses.
#[derive(Clone, Copy, Debug, Default)]
struct Case {
    causal: Option<CausalAlignment>,
    keep_mask: bool,
    bias: bool,
    key_lengths: bool,
    scale: Option<f64>,
    window: Option<usize>,
}

const HEAD_DIMS: [usize; 13] = [1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 65, 127, 128];

fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for causal in [
        None,
        Some(CausalAlignment::BottomRight),
        Some(CausalAlignment::TopLeft),
    ] {
        for flags in 0..8u8 {
            cases.push(Case {
                causal,
                keep_mask: flags & 1 != 0,
                bias: flags & 2 != 0,
                key_lengths: flags & 4 != 0,
                ..Case::default()
            });
        }
    }
    cases.push(Case {
        scale: Some(0.3),
        ..Case::default()
    });
    for (window, causal, keep_mask, key_lengths) in [
        (1, None, false, false),
        (5, None, true, false),
        (70, Some(CausalAlignment::TopLeft), false, true),
        (13, Some(CausalAlignment::TopLeft), true, true),
        (64, Some(CausalAlignment::BottomRight), false, false),
    ] {
        cases.push(Case {
            window: Some(window),
            causal,
            keep_mask,
            key_lengths,
            ..Case::default()
        });
    }
    cases
}

/// Inputs for one call, in f64; `f32` copies are made from them.
#[derive(Clone)]
struct Inputs {
    q: Array4<f64>,
    k: Array4<f64>,
    v: Array4<f64>,
    keep_mask: Array4<bool>,
    bias: Array4<f64>,
    key_lengths: Vec<usize>,
}

#[allow(clippy::too_many_arguments)]
fn inputs(
    rng: &mut Rng,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    len_q: usize,
    len_kv: usize,
    d_k: usize,
    d_v: usize,
    magnitude: f64,
) -> Inputs {
    let q = rng.array((batch, heads, len_q, d_k), magnitude);
    let k = rng.array((batch, kv_heads, len_kv, d_k), magnitude);
    let v = rng.array((batch, kv_heads, len_kv, d_v), 1.0);
    // Broadcast over heads; about one key in five hidden, some rows fully.
    let keep_mask = Array4::from_shape_simple_fn((batch, 1, len_q, len_kv), || rng.next() > -0.6);
    let bias = rng.array((1, heads, len_q, len_kv), 2.0);
    let key_lengths = (0..batch)
        .map(|b| (len_kv * (b + 2)) / (batch + 2))
        .collect();
    Inputs {
        q,
        k,
        v,
        keep_mask,
        bias,
        key_lengths,
    }
}

fn options<'a, F: Copy>(
    case: &Case,
    keep_mask: &'a Array4<bool>,
    bias: &'a Array4<F>,
    key_lengths: &'a [usize],
    scale: Option<F>,
) -> AttentionOptions<'a, F> {
    let mut opts = AttentionOptions::new();
    if let Some(alignment) = case.causal {
        opts = opts.causal_aligned(alignment);
    }
    if case.keep_mask {
        opts = opts.keep_mask(keep_mask.view());
    }
    if case.bias {
        opts = opts.bias(bias.view());
    }
    if case.key_lengths {
        opts = opts.key_lengths(key_lengths);
    }
    if let Some(scale) = scale {
        opts = opts.scale(scale);
    }
    if let Some(window) = case.window {
        opts = opts.window(window);
    }
    opts
}

fn to_f32(x: &Array4<f64>) -> Array4<f32> {
    x.mapv(|x| x as f32)
}

/// Runs one case on `set` with f32 views `q`, `k`, `v` (of any layout) and
/// compares with the f64 reference. `tolerance` is absolute, on outputs of
/// magnitude ≤ 1.
fn check(
    set: Engine,
    case: &Case,
    inputs: &Inputs,
    views: (ArrayView4<f32>, ArrayView4<f32>, ArrayView4<f32>),
    tolerance: f64,
) {
    let bias32 = to_f32(&inputs.bias);
    let reference_opts = options(
        case,
        &inputs.keep_mask,
        &inputs.bias,
        &inputs.key_lengths,
        case.scale,
    );
    let expected = sdpa::core::scaled_dot_product_attention(
        inputs.q.view(),
        inputs.k.view(),
        inputs.v.view(),
        &reference_opts,
    )
    .expect("reference call");
    let fast_opts = options(
        case,
        &inputs.keep_mask,
        &bias32,
        &inputs.key_lengths,
        case.scale.map(|s| s as f32),
    );
    let (q, k, v) = views;
    let got = on(set, || {
        sdpa::scaled_dot_product_attention(q, k, v, &fast_opts)
    })
    .expect("fast call");
    assert_eq!(got.shape(), expected.shape());
    for ((index, &g), &e) in got.indexed_iter().zip(expected.iter()) {
        let error = (g as f64 - e).abs();
        assert!(
            error <= tolerance,
            "{set}: {case:?}, q {:?} k {:?} v {:?}: out{index:?} = {g}, reference {e}, error {error:e} > {tolerance:e}",
            inputs.q.shape(),
            inputs.k.shape(),
            inputs.v.shape()
        );
    }
}

fn check_contiguous(set: Engine, case: &Case, inputs: &Inputs, tolerance: f64) {
    let (q, k, v) = (to_f32(&inputs.q), to_f32(&inputs.k), to_f32(&inputs.v));
    check(set, case, inputs, (q.view(), k.view(), v.view()), tolerance);
}

#[test]
fn every_kernel_set_matches_the_reference_on_all_lengths_and_head_dims() {
    let mut rng = Rng(1);
    let cases = all_cases();
    for set in engines() {
        for len in 0..=67usize {
            // Off-diagonal lengths too: len_q <, =, > len_kv.
            let len_kv = [len, (len * 5 + 3) % 68, len / 3][len % 3];
            let d_k = HEAD_DIMS[len % HEAD_DIMS.len()];
            let d_v = HEAD_DIMS[(len * 7 + 2) % HEAD_DIMS.len()];
            let inputs = inputs(&mut rng, 2, 4, 2, len, len_kv, d_k, d_v, 1.0);
            let case = &cases[len % cases.len()];
            check_contiguous(set, case, &inputs, 2e-6);
        }
    }
}

#[test]
fn every_kernel_set_matches_the_reference_for_every_option_and_head_dim() {
    let mut rng = Rng(2);
    for set in engines() {
        for (n, case) in all_cases().iter().enumerate() {
            for (m, &d) in HEAD_DIMS.iter().enumerate() {
                let (len_q, len_kv) =
                    [(13, 13), (5, 37), (70, 41), (1, 130), (97, 97)][(n + m) % 5];
                let inputs = inputs(
                    &mut rng,
                    2,
                    2,
                    1,
                    len_q,
                    len_kv,
                    d,
                    HEAD_DIMS[(m + n) % 13],
                    1.0,
                );
                check_contiguous(set, case, &inputs, 2e-6);
            }
        }
    }
}

#[test]
fn long_sequences_cross_many_tiles() {
    // 300 × 333 crosses many 64-key and 96- or 48-row tiles. 2053 keys of
    // d_k + d_v = 512 are 4.2 MB of packed keys and values, of which a row
    // sees all, or 1854 to 2053 keys bottom-right causal: past the 2 MiB
    // from which the forward runs query tiles of 192 rows
    // (`fused::LONG_QUERY_TILE`; 200 rows are one tall tile and a ragged
    // one), with grouped heads and odd head widths. The window keeps its
    // rows on short tiles (the rule's unit test says which takes which).
    let mut rng = Rng(3);
    let cases = [
        Case::default(),
        Case {
            causal: Some(CausalAlignment::BottomRight),
            ..Case::default()
        },
        Case {
            causal: Some(CausalAlignment::TopLeft),
            window: Some(700),
            key_lengths: true,
            ..Case::default()
        },
    ];
    let shapes = [(2, 300, 333, 64, 64), (1, 200, 2053, 257, 255)];
    for (kv_heads, len_q, len_kv, d_k, d_v) in shapes {
        let inputs = inputs(&mut rng, 1, 2, kv_heads, len_q, len_kv, d_k, d_v, 1.0);
        for set in engines() {
            for case in &cases {
                check_contiguous(set, case, &inputs, 2e-6);
            }
        }
    }
}

/// Inputs past the `f32` prefill's thresholds for AMX tiles (`d_k` ≥ 64,
/// 2¹⁶ unmasked scores a head, 2¹⁸ at `d_k = 64`), with `d_k` and `d_v` in
/// whole tiles or not.
const SPLIT_SHAPES: [(usize, usize, usize, usize); 2] = [(520, 520, 128, 80), (600, 530, 96, 128)];

#[test]
fn split_tiles_match_the_reference_for_every_option() {
    let mut rng = Rng(9);
    for (n, case) in all_cases().iter().enumerate() {
        let (len_q, len_kv, d_k, d_v) = SPLIT_SHAPES[n % 2];
        let inputs = inputs(&mut rng, 1, 2, 1, len_q, len_kv, d_k, d_v, 1.0);
        for set in engines() {
            check_contiguous(set, case, &inputs, 2e-6);
        }
    }
}

/// The AVX-512 set with AMX tiles forced on and off, where the CPU has
/// them.
fn tiles_and_fma() -> Option<(Engine, Engine)> {
    let tiles = engines()
        .into_iter()
        .find(|engine| engine.amx == Some(true))?;
    let fma = Engine {
        amx: Some(false),
        ..tiles
    };
    Some((tiles, fma))
}

/// The output of a call on `engine` with no option but `scale`.
fn plain(engine: Engine, inputs: &Inputs, scale: Option<f32>) -> Array4<f32> {
    let (q, k, v) = (to_f32(&inputs.q), to_f32(&inputs.k), to_f32(&inputs.v));
    let opts = match scale {
        Some(scale) => AttentionOptions::new().scale(scale),
        None => AttentionOptions::new(),
    };
    on(engine, || {
        sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
    })
    .expect("a valid call")
}

#[test]
fn split_tiles_run_where_the_rule_says() {
    // Where the CPU has AMX, a call the rule gives the tiles sums in
    // another order than the FMA kernels (other bits, within f32
    // accuracy); one it does not (d_k below 64, or too few scores for its
    // d_k) gives the same bits by default as with the tiles off.
    let Some((forced, fma)) = tiles_and_fma() else {
        return;
    };
    let tiles = Engine {
        amx: None,
        ..forced
    };
    let mut rng = Rng(11);
    for (len, d_k, taken) in [
        (520, 128, true),
        (512, 96, true),
        (520, 32, false),
        (512, 64, true),
        (496, 64, false),
        (256, 128, true),
        (224, 128, false),
    ] {
        let inputs = inputs(&mut rng, 1, 2, 1, len, len, d_k, 64, 1.0);
        let (split, reference) = (plain(tiles, &inputs, None), plain(fma, &inputs, None));
        let differ = split
            .iter()
            .zip(&reference)
            .any(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differ, taken, "len {len}, d_k {d_k}");
        for (a, b) in split.iter().zip(&reference) {
            assert!((a - b).abs() <= 2e-6, "len {len}, d_k {d_k}: {a} vs {b}");
        }
    }
}

#[test]
fn split_tiles_compute_what_they_cannot_split_in_f32() {
    // A query (scale 1) and keys past the split's bound (√(f32::MAX/(4·d_k))
    // ≈ 8e17 at d_k = 128), a value past 2¹²⁷, an infinite key and a NaN
    // value, all seen by every row: NaN where the FMA kernels give NaN,
    // the same numbers elsewhere.
    let Some((tiles, fma)) = tiles_and_fma() else {
        return;
    };
    let mut rng = Rng(12);
    let mut inputs = inputs(&mut rng, 1, 1, 1, 520, 520, 128, 64, 1.0);
    // Past the half-way point from `bf16`'s largest finite number to 2¹²⁸
    // (≈ 3.3961e38): their `hi` parts would round to infinity.
    // A row the infinite key (in dim 1) does not make NaN.
    let row = (0..520)
        .find(|&i| inputs.q[[0, 0, i, 1]] < 0.0)
        .expect("a row");
    inputs.q[[0, 0, row, 3]] = 3.397e38;
    inputs.k[[0, 0, 7, 0]] = 3.397e38;
    inputs.v[[0, 0, 9, 2]] = 3.397e38;
    // Past the bound, inside `bf16`'s range.
    inputs.k[[0, 0, 8, 2]] = 3e18;
    inputs.k[[0, 0, 13, 1]] = f64::INFINITY;
    inputs.v[[0, 0, 11, 1]] = f64::NAN;
    let (split, reference) = (
        plain(tiles, &inputs, Some(1.0)),
        plain(fma, &inputs, Some(1.0)),
    );
    let mut finite = 0;
    for ((index, a), b) in split.indexed_iter().zip(&reference) {
        assert_eq!(a.is_nan(), b.is_nan(), "{index:?}: {a} vs {b}");
        if a.is_finite() {
            finite += 1;
            // Scores up to ±10 at scale 1: both paths' f32 errors in them
            // move the weights by a few parts in a million.
            let tolerance = 1e-5 * b.abs().max(1.0);
            assert!((a - b).abs() <= tolerance, "{index:?}: {a} vs {b}");
        }
    }
    assert!(finite > 1000, "the poisons leave most rows finite");
}

#[test]
fn split_tiles_never_see_masked_nan() {
    // Keys past a batch item's length hold NaN and infinities: no bit of
    // the output changes, on any engine.
    let mut rng = Rng(13);
    let clean = inputs(&mut rng, 1, 2, 1, 520, 520, 128, 64, 1.0);
    let mut poisoned = clean.clone();
    poisoned.k.slice_mut(s![.., .., 400.., ..]).fill(f64::NAN);
    poisoned
        .v
        .slice_mut(s![.., .., 400.., 3])
        .fill(f64::INFINITY);
    poisoned.v.slice_mut(s![.., .., 450.., ..]).fill(f64::NAN);
    let lengths = [400];
    let run = |engine: Engine, inputs: &Inputs| {
        let (q, k, v) = (to_f32(&inputs.q), to_f32(&inputs.k), to_f32(&inputs.v));
        let opts = AttentionOptions::new().key_lengths(&lengths);
        on(engine, || {
            sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
        })
        .expect("a valid call")
    };
    for engine in engines() {
        let (a, b) = (run(engine, &clean), run(engine, &poisoned));
        assert!(
            a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{engine}: a masked poison changed the output"
        );
    }
}

#[test]
fn large_scores_stay_accurate() {
    // Scores up to about ±1e4: the exponent range is exercised, and the
    // error grows with the score's magnitude only through f32 rounding of
    // the scores themselves.
    let mut rng = Rng(4);
    for set in engines() {
        for case in [
            Case::default(),
            Case {
                causal: Some(CausalAlignment::TopLeft),
                bias: true,
                ..Case::default()
            },
        ] {
            // |q|, |k| ≤ 50 at d = 16, scale 1/4: |scores| up to 1e4.
            let inputs = inputs(&mut rng, 1, 2, 1, 40, 50, 16, 8, 50.0);
            check_contiguous(set, &case, &inputs, 5e-3);
        }
    }
}

#[test]
fn misaligned_and_strided_views_match() {
    let mut rng = Rng(5);
    for set in engines() {
        for pad in 0..4 {
            let inputs = inputs(&mut rng, 2, 2, 2, 19, 23, 17, 9, 1.0);
            // Start every view `pad` elements into a bigger buffer, so rows
            // are misaligned and strides are not the contiguous ones.
            let embed = |x: &Array4<f64>| {
                let (b, h, l, d) = x.dim();
                let mut big = Array4::<f32>::zeros((b, h, l, d + pad + 3));
                big.slice_mut(s![.., .., .., pad..pad + d])
                    .assign(&to_f32(x));
                big
            };
            let (q, k, v) = (embed(&inputs.q), embed(&inputs.k), embed(&inputs.v));
            let (dk, dv) = (inputs.q.dim().3, inputs.v.dim().3);
            let case = Case {
                causal: Some(CausalAlignment::BottomRight),
                ..Case::default()
            };
            check(
                set,
                &case,
                &inputs,
                (
                    q.slice(s![.., .., .., pad..pad + dk]),
                    k.slice(s![.., .., .., pad..pad + dk]),
                    v.slice(s![.., .., .., pad..pad + dv]),
                ),
                2e-6,
            );
            // Transposed memory order: heads and rows swapped in storage.
            let q_t = to_f32(&inputs.q)
                .permuted_axes([0, 2, 1, 3])
                .as_standard_layout()
                .to_owned();
            let q_t = q_t.view().permuted_axes([0, 2, 1, 3]);
            let (k32, v32) = (to_f32(&inputs.k), to_f32(&inputs.v));
            check(set, &case, &inputs, (q_t, k32.view(), v32.view()), 2e-6);
        }
    }
}

#[test]
fn masked_nan_and_infinity_never_reach_the_output() {
    for set in engines() {
        let mut rng = Rng(6);
        let mut inputs = inputs(&mut rng, 1, 1, 1, 70, 70, 8, 8, 1.0);
        // Causal: key j is hidden from rows i < j. Poison the last keys.
        inputs.k.slice_mut(s![.., .., 69, ..]).fill(f64::NAN);
        inputs.v.slice_mut(s![.., .., 69, ..]).fill(f64::INFINITY);
        inputs.v.slice_mut(s![.., .., 68, 0]).fill(f64::NAN);
        let got = on(set, || {
            sdpa::scaled_dot_product_attention(
                to_f32(&inputs.q).view(),
                to_f32(&inputs.k).view(),
                to_f32(&inputs.v).view(),
                &AttentionOptions::new().causal(),
            )
        })
        .unwrap();
        // Rows 0..=67 see neither poisoned key.
        for i in 0..68 {
            assert!(
                got.slice(s![0, 0, i, ..]).iter().all(|x| x.is_finite()),
                "{set}: row {i} leaked"
            );
        }
        // And they equal the reference.
        let expected = sdpa::core::scaled_dot_product_attention(
            inputs.q.view(),
            inputs.k.view(),
            inputs.v.view(),
            &AttentionOptions::new().causal(),
        )
        .unwrap();
        for i in 0..68 {
            for c in 0..8 {
                let (g, e) = (got[[0, 0, i, c]] as f64, expected[[0, 0, i, c]]);
                assert!((g - e).abs() < 2e-6, "{set}: row {i}: {g} vs {e}");
            }
        }
    }
}

#[test]
fn a_forced_kernel_set_the_cpu_lacks_is_an_error() {
    let x = Array4::<f32>::zeros((1, 1, 2, 2));
    for &set in KernelSet::all() {
        let result = sdpa::simd::with_kernel_set(set, || {
            sdpa::scaled_dot_product_attention(
                x.view(),
                x.view(),
                x.view(),
                &AttentionOptions::new(),
            )
        });
        assert_eq!(
            result.is_ok(),
            available_kernel_sets().contains(&set),
            "{set}"
        );
        if let Err(error) = result {
            assert_eq!(error.kind(), sdpa::ErrorKind::UnsupportedKernel);
        }
    }
}

#[test]
fn sdpa_kernel_forces_the_selected_set() {
    // CI runs the suite once per kernel set with SDPA_KERNEL set; this test
    // fails if the forced set is not the one that runs.
    match std::env::var("SDPA_KERNEL") {
        Ok(name) if !name.is_empty() => {
            let forced: KernelSet = name.parse().expect("SDPA_KERNEL names a kernel set");
            assert_eq!(
                sdpa::simd::selected_kernel_set().expect("the forced set is available"),
                forced
            );
        }
        _ => assert_eq!(
            sdpa::simd::selected_kernel_set().unwrap(),
            *available_kernel_sets().last().unwrap()
        ),
    }
}

#[test]
fn rows_with_no_visible_key_are_zero() {
    for set in engines() {
        let x = Array4::<f32>::ones((1, 1, 5, 4));
        // Bottom-right causal with len_q > len_kv: the first rows see nothing.
        let k = x.slice(s![.., .., ..3, ..]);
        let out = on(set, || {
            sdpa::scaled_dot_product_attention(x.view(), k, k, &AttentionOptions::new().causal())
        })
        .unwrap();
        assert!(out.index_axis(Axis(2), 0).iter().all(|&y| y == 0.0));
        assert!(out.index_axis(Axis(2), 1).iter().all(|&y| y == 0.0));
        assert!(
            out.index_axis(Axis(2), 2)
                .iter()
                .all(|&y| (y - 1.0).abs() < 1e-6)
        );
    }
}

/// `‖fast − reference‖ / ‖reference‖` on random normal inputs scaled by `sigma`.
fn relative_frobenius_error(set: Engine, causal: bool, sigma: f64, rng: &mut Rng) -> f64 {
    let dim = (1, 4, 256, 64);
    let mut normal = |_| Array4::from_shape_simple_fn(dim, || rng.normal() * sigma);
    let (q, k, v) = (normal(0), normal(1), normal(2));
    let opts = |o: AttentionOptions<'static, f64>| if causal { o.causal() } else { o };
    let reference = sdpa::core::scaled_dot_product_attention(
        q.view(),
        k.view(),
        v.view(),
        &opts(AttentionOptions::new()),
    )
    .unwrap();
    let fast_opts = AttentionOptions::new();
    let fast_opts = if causal {
        fast_opts.causal()
    } else {
        fast_opts
    };
    let fast = on(set, || {
        sdpa::scaled_dot_product_attention(
            to_f32(&q).view(),
            to_f32(&k).view(),
            to_f32(&v).view(),
            &fast_opts,
        )
    })
    .unwrap();
    let error: f64 = fast
        .iter()
        .zip(&reference)
        .map(|(&f, &r)| (f as f64 - r).powi(2))
        .sum();
    let norm: f64 = reference.iter().map(|r| r * r).sum();
    (error / norm).sqrt()
}

#[test]
fn accuracy_is_at_least_torchs_on_random_normal_inputs() {
    // torch's f32 SDPA on this machine (../shared/peers/py_accuracy.py):
    // relative Frobenius error about 4e-7 at sigma 1 and 2e-6 at sigma 4.
    let mut rng = Rng(7);
    for set in engines() {
        for causal in [false, true] {
            for (sigma, torch) in [(1.0, 4e-7), (4.0, 2e-6)] {
                let error = relative_frobenius_error(set, causal, sigma, &mut rng);
                assert!(
                    error <= torch,
                    "{set}: causal {causal}, sigma {sigma}: {error:e} > {torch:e}"
                );
            }
        }
    }
}

#[test]
fn a_window_equals_its_definition_as_a_keep_mask() {
    let mut rng = Rng(8);
    for (len_q, len_kv) in [(9, 9), (4, 11), (11, 4)] {
        let inputs = inputs(&mut rng, 1, 1, 1, len_q, len_kv, 5, 3, 1.0);
        for alignment in [CausalAlignment::BottomRight, CausalAlignment::TopLeft] {
            for window in [1, 2, 3, 20] {
                // Query i's diagonal position p; it sees keys p - window < j <= p.
                let p = |i: usize| match alignment {
                    CausalAlignment::BottomRight => i as i64 + len_kv as i64 - len_q as i64,
                    _ => i as i64,
                };
                let keep = Array4::from_shape_fn((1, 1, len_q, len_kv), |(_, _, i, j)| {
                    let j = j as i64;
                    j <= p(i) && j > p(i) - window as i64
                });
                let by_definition = sdpa::core::scaled_dot_product_attention(
                    inputs.q.view(),
                    inputs.k.view(),
                    inputs.v.view(),
                    &AttentionOptions::new().keep_mask(keep.view()),
                )
                .unwrap();
                let windowed = AttentionOptions::new()
                    .causal_aligned(alignment)
                    .window(window);
                let got = sdpa::core::scaled_dot_product_attention(
                    inputs.q.view(),
                    inputs.k.view(),
                    inputs.v.view(),
                    &windowed,
                )
                .unwrap();
                assert!(
                    got.iter()
                        .zip(&by_definition)
                        .all(|(a, b)| (a - b).abs() < 1e-12),
                    "{alignment:?} window {window}"
                );
            }
        }
    }
}

#[test]
fn decoding_against_a_long_cache_matches_the_reference() {
    // A few query rows against more keys than one decode chunk: keys are
    // read in place and chunk partials merged.
    let mut rng = Rng(9);
    for set in engines() {
        for (n, case) in all_cases().iter().enumerate() {
            let len_q = 1 + n % 4;
            let (d_k, d_v) = [(64, 64), (128, 16), (16, 128), (17, 5)][n % 4];
            let inputs = inputs(&mut rng, 1, 4, 2, len_q, 2500 + n, d_k, d_v, 1.0);
            check_contiguous(set, case, &inputs, 2e-6);
        }
    }
}

#[test]
fn decoding_never_lets_masked_nan_through() {
    let mut rng = Rng(10);
    for set in engines() {
        let mut inputs = inputs(&mut rng, 2, 2, 2, 2, 1500, 16, 16, 1.0);
        // Padding keys past each item's length hold NaN and infinity.
        inputs.key_lengths = vec![1100, 700];
        inputs.k.slice_mut(s![1, .., 700.., ..]).fill(f64::NAN);
        inputs.v.slice_mut(s![1, .., 700.., ..]).fill(f64::INFINITY);
        inputs.v.slice_mut(s![0, .., 1100.., ..]).fill(f64::NAN);
        let case = Case {
            key_lengths: true,
            causal: Some(CausalAlignment::BottomRight),
            ..Case::default()
        };
        check_contiguous(set, &case, &inputs, 2e-6);
    }
}

#[test]
fn grouped_decoding_gives_each_row_the_bits_of_its_repeated_head() {
    // Decoding stacks the rows of a group's query heads in one tile; each
    // row must come out as it does with its key/value head repeated (one
    // query head per tile), whatever the options, to the bit.
    let mut rng = Rng(11);
    for set in engines() {
        for (n, case) in all_cases().iter().enumerate() {
            let len_q = 1 + n % 3;
            let (d_k, d_v) = [(128, 128), (64, 16), (17, 5)][n % 3];
            let inputs = inputs(&mut rng, 2, 8, 2, len_q, 300 + 7 * n, d_k, d_v, 1.0);
            let repeat = |a: &Array4<f64>| {
                let [b, _, l, d] = [a.shape()[0], a.shape()[1], a.shape()[2], a.shape()[3]];
                to_f32(&Array4::from_shape_fn((b, 8, l, d), |(b, h, j, c)| {
                    a[[b, h / 4, j, c]]
                }))
            };
            let bias = to_f32(&inputs.bias);
            let opts = options(
                case,
                &inputs.keep_mask,
                &bias,
                &inputs.key_lengths,
                case.scale.map(|s| s as f32),
            );
            let q = to_f32(&inputs.q);
            let (k, v) = (to_f32(&inputs.k), to_f32(&inputs.v));
            let grouped = on(set, || {
                sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
            })
            .expect("grouped call");
            let (k, v) = (repeat(&inputs.k), repeat(&inputs.v));
            let repeated = on(set, || {
                sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
            })
            .expect("repeated call");
            let bits = |a: &Array4<f32>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&grouped),
                bits(&repeated),
                "{set}: {case:?}, len_q {len_q}, d {d_k}/{d_v}"
            );
        }
    }
}

/// `x` copied into a buffer `offset` elements past a 64-byte boundary, and
/// that buffer (the view's storage).
fn placed(x: &Array4<f32>, offset: usize) -> (Vec<f32>, usize) {
    let mut buffer = vec![0.0f32; x.len() + 32];
    let start = buffer.as_ptr().align_offset(64) + offset;
    buffer[start..start + x.len()].copy_from_slice(x.as_slice().expect("standard layout"));
    (buffer, start)
}

#[test]
fn rows_on_or_off_vector_boundaries_give_the_same_bits() {
    // The fused path reads value rows (and, backward, key rows) where they
    // lie only when each starts on a vector boundary, and packs them into
    // an aligned buffer otherwise: the same sums either way.
    let mut rng = Rng(11);
    for set in engines() {
        for (len, d) in [(70, 16), (130, 64), (67, 128)] {
            let dim = (1, 2, len, d);
            let (q, k, v) = (
                to_f32(&rng.array(dim, 1.0)),
                to_f32(&rng.array(dim, 1.0)),
                to_f32(&rng.array(dim, 1.0)),
            );
            let d_out = to_f32(&rng.array(dim, 1.0));
            for causal in [false, true] {
                let opts = if causal {
                    AttentionOptions::new().causal()
                } else {
                    AttentionOptions::new()
                };
                let run = |offset: usize| {
                    let ((k_buffer, k_start), (v_buffer, v_start)) =
                        (placed(&k, offset), placed(&v, offset));
                    let k = ArrayView4::from_shape(dim, &k_buffer[k_start..k_start + k.len()])
                        .expect("the same shape");
                    let v = ArrayView4::from_shape(dim, &v_buffer[v_start..v_start + v.len()])
                        .expect("the same shape");
                    on(set, || {
                        let forward =
                            sdpa::scaled_dot_product_attention_partial(q.view(), k, v, &opts)
                                .expect("valid shapes");
                        let gradients = sdpa::scaled_dot_product_attention_backward(
                            q.view(),
                            k,
                            v,
                            &opts,
                            &forward,
                            d_out.view(),
                        )
                        .expect("valid shapes");
                        let bits = |x: ArrayView4<f32>| x.iter().map(|x| x.to_bits()).collect();
                        let all: [Vec<u32>; 4] = [
                            bits(forward.output()),
                            bits(gradients.d_q.view()),
                            bits(gradients.d_k.view()),
                            bits(gradients.d_v.view()),
                        ];
                        all
                    })
                };
                let aligned = run(0);
                for offset in [1, 4, 8] {
                    assert_eq!(
                        run(offset),
                        aligned,
                        "{set}: len {len}, d {d}, causal {causal}, {offset} floats off a 64-byte boundary"
                    );
                }
            }
        }
    }
}
