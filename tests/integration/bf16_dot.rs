//! The `bf16` forward read natively, on AVX-512 BF16 (`vdpbf16ps`) and,
//! where the CPU has them, on AMX tiles (`tdpbf16ps`), each test once per
//! path: against `core` in `f64` on the same rounded inputs, on shapes and
//! options the prefill reaches; NaN in masked keys and values; rows that
//! see nothing; and bitwise the same result for 1 and 2 threads. The
//! native path is forced with `with_bf16_dot(true, ..)` and the tiles on
//! or off with `with_amx`, so `vdpbf16ps` is tested also on CPUs whose
//! default is AMX or converting; skipped where the CPU has no AVX-512 BF16
//! (then `bf16` converts to `f32`, which `half.rs` tests).
//!
//! The bound asserted, per output entry, against `r`, the `f64` reference:
//!
//! ```text
//! |out − r| ≤ 2⁻⁸·|r| + ε·max|v| + 2e-5·(1 + max|v|)
//! ```
//!
//! The first term is the output's rounding to bf16; the second the
//! weights' form in bf16 for `P·V`, each within a relative `ε` of the f32
//! weight (2⁻¹⁵ in two parts on `vdpbf16ps`, 2⁻⁸ rounded once on AMX
//! tiles; an output is a weighted mean of values, its denominator summed
//! from the f32 weights); the third the f32 arithmetic, as in `half.rs`.
//! The scores add nothing: the queries and keys are bf16 and their
//! products exact in f32.

use half::bf16;
use ndarray::{Array4, ArrayView4, s};
use sdpa::simd::{
    KernelSet, amx_runs_on, bf16_dot_runs_on, with_amx, with_bf16_dot, with_kernel_set,
};
use sdpa::{AttentionOptions, CausalAlignment, alibi_slopes, scaled_dot_product_attention};

use crate::common::with_threads;
use crate::common::{Rng, native_weights_error};

/// A native bf16 path: the AVX-512 set, with or without AMX tiles.
#[derive(Debug, Clone, Copy)]
struct Engine {
    set: KernelSet,
    amx: bool,
}

impl Engine {
    /// `ε`: how far each weight's bf16 form in `P·V` may be from the f32
    /// weight, relative to it.
    fn weights_error(self) -> f64 {
        native_weights_error(self.amx)
    }
}

/// The native paths this CPU runs: `vdpbf16ps` where it has AVX-512 BF16,
/// and AMX tiles where it has them too (both tested there).
fn engines() -> Vec<Engine> {
    let set = KernelSet::Avx512;
    let mut engines = Vec::new();
    if with_bf16_dot(true, || with_amx(false, || bf16_dot_runs_on(set))) {
        engines.push(Engine { set, amx: false });
    }
    if with_bf16_dot(true, || amx_runs_on(set)) {
        engines.push(Engine { set, amx: true });
    }
    engines
}

fn random(rng: &mut Rng, shape: [usize; 4], spread: f64) -> Array4<bf16> {
    Array4::from_shape_simple_fn(shape, || bf16::from_f64(rng.uniform(-spread, spread)))
}

fn wide(x: &Array4<bf16>) -> Array4<f64> {
    x.mapv(bf16::to_f64)
}

fn run(
    engine: Engine,
    q: &Array4<bf16>,
    k: &Array4<bf16>,
    v: &Array4<bf16>,
    opts: &AttentionOptions<'_, f32>,
) -> Array4<bf16> {
    run_views(engine, true, q.view(), k.view(), v.view(), opts)
}

/// [`run`] on views, on the native path or (`native` false) told to
/// convert to `f32`.
fn run_views(
    engine: Engine,
    native: bool,
    q: ArrayView4<'_, bf16>,
    k: ArrayView4<'_, bf16>,
    v: ArrayView4<'_, bf16>,
    opts: &AttentionOptions<'_, f32>,
) -> Array4<bf16> {
    with_bf16_dot(native, || {
        with_amx(engine.amx, || {
            with_kernel_set(engine.set, || scaled_dot_product_attention(q, k, v, opts))
        })
    })
    .expect("the set runs here")
    .expect("the call runs")
}

/// `x` in every other column of an array twice as wide, the columns
/// between NaN: slicing it `s![.., .., .., ..;2]` gives `x` as a strided
/// view.
fn every_other_column(x: &Array4<bf16>) -> Array4<bf16> {
    let (b, h, l, d) = x.dim();
    let mut wide = Array4::from_elem((b, h, l, 2 * d), bf16::NAN);
    wide.slice_mut(s![.., .., .., ..;2]).assign(x);
    wide
}

/// The largest error against `want` as a fraction of the bound, asserting
/// it is at most 1 (NaN only where the reference has NaN).
fn check(engine: Engine, got: &Array4<bf16>, want: &Array4<f64>, max_v: f64, what: &str) -> f64 {
    let absolute = engine.weights_error() * max_v + 2e-5 * (1.0 + max_v);
    let mut worst: f64 = 0.0;
    for ((index, g), &w) in got.indexed_iter().zip(want) {
        let g = g.to_f64();
        if w.is_nan() {
            assert!(g.is_nan(), "{what} at {index:?}: got {g}, reference NaN");
            continue;
        }
        let bound = w.abs() / 256.0 + absolute;
        let error = (g - w).abs();
        assert!(
            error <= bound,
            "{what} at {index:?}: got {g}, reference {w}, error {error} > {bound}"
        );
        worst = worst.max(error / bound);
    }
    worst
}

/// `[batch, heads, kv_heads, len_q, len_kv, d_k, d_v]`: lengths off the
/// 64-key and 48/96/192-row tiles, d_k odd and off multiples of 32 (which AMX
/// does not take), multiples of 32 with d_v off whole tile pairs, GQA/MQA.
const SHAPES: [[usize; 7]; 10] = [
    // 4 MiB of bf16 keys and values, nearly all of them seen by each row
    // but for windows and top-left causal: the bidirectional cases (and on
    // `vdpbf16ps` the bottom-right causal ones; AMX runs causal calls on
    // 64-row tiles) run query tiles of 192 rows (`fused::LONG_QUERY_TILE`).
    [1, 1, 1, 200, 4100, 384, 128],
    [1, 4, 2, 150, 333, 33, 40],
    [1, 2, 1, 150, 333, 32, 40],
    [2, 3, 1, 61, 500, 128, 128],
    [1, 2, 2, 100, 130, 96, 24],
    [2, 2, 1, 97, 64, 1, 17],
    [1, 3, 1, 9, 200, 64, 64],
    [1, 2, 2, 257, 257, 64, 64],
    [1, 2, 1, 65, 1000, 127, 31],
    [2, 8, 2, 40, 129, 80, 16],
];

/// What a case's options borrow, in `T` (f32 for the bf16 call, the same
/// numbers in f64 for the reference).
struct Store<T> {
    keep: Array4<bool>,
    bias: Array4<T>,
    lengths: Vec<usize>,
    slopes: Vec<T>,
    sinks: Vec<T>,
}

impl Store<f32> {
    fn new(shape: [usize; 7], rng: &mut Rng) -> Self {
        let [batch, heads, _, len_q, len_kv, _, _] = shape;
        Store {
            keep: Array4::from_shape_simple_fn([batch, 1, len_q, len_kv], || rng.chance(0.75)),
            bias: Array4::from_shape_simple_fn([1, heads, len_q, len_kv], || {
                rng.uniform(-1.0, 1.0) as f32
            }),
            lengths: (0..batch).map(|_| rng.below(len_kv + 1)).collect(),
            slopes: alibi_slopes(heads).iter().map(|&x| x as f32).collect(),
            sinks: (0..heads).map(|_| rng.uniform(-1.0, 2.0) as f32).collect(),
        }
    }

    fn wide(&self) -> Store<f64> {
        Store {
            keep: self.keep.clone(),
            bias: self.bias.mapv(f64::from),
            lengths: self.lengths.clone(),
            slopes: self.slopes.iter().map(|&x| f64::from(x)).collect(),
            sinks: self.sinks.iter().map(|&x| f64::from(x)).collect(),
        }
    }
}

/// Case `case`'s options: none; causal both ways; a window with key
/// lengths; a keep mask with a bias; ALiBi, softcap and sinks; all of
/// them; a negative scale (which the softmax cannot apply for the scores
/// kernel: it flips the maxima).
fn options<T: Copy + num_traits::Float + From<f32>>(
    case: usize,
    store: &Store<T>,
) -> AttentionOptions<'_, T> {
    let t = |x: f32| <T as From<f32>>::from(x);
    let opts = AttentionOptions::new();
    match case {
        0 => opts,
        1 => opts.causal(),
        2 => opts.causal_aligned(CausalAlignment::TopLeft).scale(t(0.3)),
        3 => opts.window(37).key_lengths(&store.lengths),
        4 => opts.keep_mask(store.keep.view()).bias(store.bias.view()),
        5 => opts
            .causal()
            .alibi(&store.slopes)
            .softcap(t(5.0))
            .sinks(&store.sinks),
        6 => opts
            .causal()
            .window(50)
            .scale(t(0.2))
            .keep_mask(store.keep.view())
            .key_lengths(&store.lengths)
            .bias(store.bias.view())
            .alibi(&store.slopes)
            .softcap(t(4.0))
            .sinks(&store.sinks),
        7 => opts.scale(t(-0.4)),
        _ => opts.keep_mask(store.keep.view()),
    }
}

const CASES: usize = 9;

/// One case's inputs and option data.
struct Case {
    q: Array4<bf16>,
    k: Array4<bf16>,
    v: Array4<bf16>,
    store: Store<f32>,
}

impl Case {
    fn new(shape: [usize; 7], seed: u64) -> Self {
        let [batch, heads, kv_heads, len_q, len_kv, d_k, d_v] = shape;
        let mut rng = Rng::new(seed);
        Case {
            q: random(&mut rng, [batch, heads, len_q, d_k], 2.0),
            k: random(&mut rng, [batch, kv_heads, len_kv, d_k], 2.0),
            v: random(&mut rng, [batch, kv_heads, len_kv, d_v], 3.0),
            store: Store::new(shape, &mut rng),
        }
    }

    fn max_abs_v(&self) -> f64 {
        self.v.iter().fold(0.0, |m: f64, x| m.max(x.to_f64().abs()))
    }

    /// `core` in f64 on the rounded inputs, with the options widened.
    fn reference(&self, case: usize) -> Array4<f64> {
        let wide_store = self.store.wide();
        let (q, k, v) = (wide(&self.q), wide(&self.k), wide(&self.v));
        sdpa::core::scaled_dot_product_attention(
            q.view(),
            k.view(),
            v.view(),
            &options(case, &wide_store),
        )
        .expect("the reference runs")
    }
}

#[test]
fn the_native_forward_matches_the_f64_reference_within_the_bound() {
    engines()
        .into_iter()
        .for_each(the_native_forward_matches_the_f64_reference_within_the_bound_on);
}

fn the_native_forward_matches_the_f64_reference_within_the_bound_on(engine: Engine) {
    let mut worst: f64 = 0.0;
    for (s, &shape) in SHAPES.iter().enumerate() {
        for case in 0..CASES {
            let c = Case::new(shape, 100 * s as u64 + case as u64);
            let got = run(engine, &c.q, &c.k, &c.v, &options(case, &c.store));
            let what = format!("{shape:?} case {case}");
            worst = worst.max(check(
                engine,
                &got,
                &c.reference(case),
                c.max_abs_v(),
                &what,
            ));
        }
    }
    // The output's own rounding alone can take nearly all of it on
    // `vdpbf16ps` (2⁻⁸·|r| for an `r` just past a power of two, against
    // absolute terms of 2e-4), about half on AMX tiles.
    println!("worst error: {worst:.3} of the bound");
}

#[test]
fn the_native_path_is_taken_and_differs_from_converting_only_by_the_weights() {
    engines()
        .into_iter()
        .for_each(the_native_path_is_taken_and_differs_from_converting_only_by_the_weights_on);
}

fn the_native_path_is_taken_and_differs_from_converting_only_by_the_weights_on(engine: Engine) {
    let shape = [1, 2, 1, 100, 300, 64, 64];
    let c = Case::new(shape, 9);
    let opts = AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft);
    let got = run(engine, &c.q, &c.k, &c.v, &opts);
    // The f32 path on the same numbers, rounded once to bf16.
    let (q, k, v) = (
        c.q.mapv(bf16::to_f32),
        c.k.mapv(bf16::to_f32),
        c.v.mapv(bf16::to_f32),
    );
    let f32_path = with_kernel_set(engine.set, || {
        scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
    })
    .expect("the set runs")
    .expect("the call runs");
    let converted = f32_path.mapv(bf16::from_f32);
    // The first row sees one key: its weight is 1, exact in bf16.
    assert_eq!(
        got.slice(s![.., .., 0, ..]),
        converted.slice(s![.., .., 0, ..])
    );
    // The native path ran: `vdpbf16ps` and `tdpbf16ps` read bf16
    // subnormals as zero, where the f32 kernels keep them, so a value
    // column of subnormals gives zeros natively and not when converted.
    let mut tiny = c.v.clone();
    tiny.slice_mut(s![.., .., .., 0])
        .fill(bf16::from_bits(0x0040)); // 2⁻¹²⁷
    let column = |x: &Array4<bf16>| x.slice(s![.., .., .., 0]).mapv(bf16::to_f32);
    let natively = run(engine, &c.q, &c.k, &tiny, &opts);
    assert!(column(&natively).iter().all(|&x| x == 0.0), "{engine:?}");
    let converting = run_views(engine, false, c.q.view(), c.k.view(), tiny.view(), &opts);
    assert!(column(&converting).iter().all(|&x| x > 0.0));
    // Told to convert, a bf16 call is the f32 path rounded once, but for
    // the softmax's `exp`, which a half output lets be looser (6e-6): an
    // output one bf16 step away where the f32 result lies that close to
    // a rounding boundary.
    let told_to_convert = run_views(engine, false, c.q.view(), c.k.view(), c.v.view(), &opts);
    let max_v = c.max_abs_v();
    for (a, b) in told_to_convert.iter().zip(&f32_path) {
        let bound = b.abs() as f64 / 256.0 + 2e-5 * max_v;
        assert!(
            (a.to_f64() - f64::from(*b)).abs() <= bound,
            "converted: {a} against {b}"
        );
    }
    for (a, b) in got.iter().zip(&f32_path) {
        let bound = engine.weights_error() * max_v + b.abs() as f64 / 256.0 + 1e-6;
        assert!(
            (a.to_f64() - f64::from(*b)).abs() <= bound,
            "{a} against {b}"
        );
    }
}

#[test]
fn products_that_overflow_only_unscaled_give_the_f32_paths_answer() {
    engines()
        .into_iter()
        .for_each(products_that_overflow_only_unscaled_give_the_f32_paths_answer_on);
}

fn products_that_overflow_only_unscaled_give_the_f32_paths_answer_on(engine: Engine) {
    // One key head of the second batch item holds keys near 2¹²⁰: q·k
    // unscaled (the native path's tiles) passes f32::MAX, scaled by 1/8
    // first (the f32 path) it does not. The whole call must take the f32
    // path, bit for bit what converting gives, and stay finite.
    let shape = [2, 2, 2, 40, 150, 64, 32];
    let c = Case::new(shape, 11);
    let mut k = c.k.clone();
    k.slice_mut(s![1, 1, .., ..])
        .mapv_inplace(|x| bf16::from_f32(x.to_f32() * 2f32.powi(120)));
    let opts = AttentionOptions::new();
    let got = run(engine, &c.q, &k, &c.v, &opts);
    let converted = run_views(engine, false, c.q.view(), k.view(), c.v.view(), &opts);
    assert!(got.iter().all(|x| x.is_finite()));
    assert!(
        got.iter()
            .zip(&converted)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    // And the reference agrees: such scores make each row's weights one-hot.
    let (q, k, v) = (wide(&c.q), wide(&k), wide(&c.v));
    let want = sdpa::core::scaled_dot_product_attention(
        q.view(),
        k.view(),
        v.view(),
        &AttentionOptions::new(),
    )
    .expect("the reference runs");
    check(engine, &got, &want, c.max_abs_v(), "overflowing products");
}

#[test]
fn queries_whose_products_overflow_only_unscaled_give_the_f32_paths_answer() {
    engines()
        .into_iter()
        .for_each(queries_whose_products_overflow_only_unscaled_give_the_f32_paths_answer_on);
}

fn queries_whose_products_overflow_only_unscaled_give_the_f32_paths_answer_on(engine: Engine) {
    // The queries' side of the bound above, read from their bits: one
    // query head near 2¹²⁰ sends the call to the f32 path; NaN and
    // infinite queries are left out of the bound, so they alone do not.
    // Each with the queries in one block and read through a strided view.
    let shape = [2, 2, 2, 40, 150, 64, 32];
    let c = Case::new(shape, 12);
    let opts = AttentionOptions::new();
    let call = |q, native| run_views(engine, native, q, c.k.view(), c.v.view(), &opts);
    let mut large = c.q.clone();
    large
        .slice_mut(s![1, 0, .., ..])
        .mapv_inplace(|x| bf16::from_f32(x.to_f32() * 2f32.powi(120)));
    let converted = call(large.view(), false);
    assert!(converted.iter().all(|x| x.is_finite()));
    let wide = every_other_column(&large);
    for q in [large.view(), wide.slice(s![.., .., .., ..;2])] {
        let got = call(q, true);
        assert!(
            got.iter()
                .zip(&converted)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "large queries take the f32 path"
        );
    }

    let clean = call(c.q.view(), true);
    let mut dirty = c.q.clone();
    for (i, x) in [bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        dirty[[0, 1, 3 + i, 5]] = x;
    }
    let wide = every_other_column(&dirty);
    for q in [dirty.view(), wide.slice(s![.., .., .., ..;2])] {
        let got = call(q, true);
        for ((index, a), b) in got.indexed_iter().zip(&clean) {
            if index.0 == 0 && index.1 == 1 && (3..6).contains(&index.2) {
                assert!(!a.is_finite(), "a non-finite query's row at {index:?}");
            } else {
                assert_eq!(a.to_bits(), b.to_bits(), "other rows stay at {index:?}");
            }
        }
    }
}

#[test]
fn nan_in_masked_keys_and_values_never_reaches_the_output() {
    engines()
        .into_iter()
        .for_each(nan_in_masked_keys_and_values_never_reaches_the_output_on);
}

fn nan_in_masked_keys_and_values_never_reaches_the_output_on(engine: Engine) {
    let shape = [2, 4, 2, 130, 200, 40, 24];
    for case in [3, 4, 6, 8] {
        let mut c = Case::new(shape, 50 + case as u64);
        // Every seventh key hidden from every row, in tiles whose other
        // keys rows see: the value kernel's zero-weight path.
        for j in (3..shape[4]).step_by(7) {
            c.store.keep.slice_mut(s![.., .., .., j]).fill(false);
        }
        let opts = options(case, &c.store);
        let clean = run(engine, &c.q, &c.k, &c.v, &opts);
        // NaN and infinities in every key and value no row may see: past
        // the key lengths (cases 3, 6), and keys a keep mask hides from
        // every row of a batch item (cases 4, 6, 8; 8 with nothing else,
        // so the softmax applies the scale: NaN keys must not move it).
        let (mut k, mut v) = (c.k.clone(), c.v.clone());
        let [batch, _, _, len_q, len_kv, _, _] = shape;
        for b in 0..batch {
            for j in 0..len_kv {
                let past_length = matches!(case, 3 | 6) && j >= c.store.lengths[b];
                let hidden = case != 3 && (0..len_q).all(|i| !c.store.keep[[b, 0, i, j]]);
                if past_length || hidden {
                    // NaN and both infinities: none may move the call
                    // off the native path (a bound over every key would).
                    k.slice_mut(s![b, .., j, ..]).fill(match j % 3 {
                        0 => bf16::NAN,
                        1 => bf16::INFINITY,
                        _ => bf16::NEG_INFINITY,
                    });
                    v.slice_mut(s![b, .., j, ..]).fill(if j % 2 == 0 {
                        bf16::NAN
                    } else {
                        bf16::INFINITY
                    });
                }
            }
        }
        let dirty = run(engine, &c.q, &k, &v, &opts);
        assert!(
            dirty
                .iter()
                .zip(&clean)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "case {case}: masked NaN changed the output"
        );
        assert!(dirty.iter().all(|x| x.is_finite()), "case {case}");
    }
}

#[test]
fn infinite_keys_a_row_sees_give_the_references_answer() {
    engines()
        .into_iter()
        .for_each(infinite_keys_a_row_sees_give_the_references_answer_on);
}

fn infinite_keys_a_row_sees_give_the_references_answer_on(engine: Engine) {
    // One number of key 150 is +inf (head 0) or −inf (head 1): a row's
    // score there is +inf or −inf by the sign of its query's first
    // number, so some rows turn NaN (an infinite maximum) and the others
    // give that key weight 0. Infinite keys no longer send a call to the
    // converted path, so the native one must give the reference's
    // answer, NaN where it has NaN.
    let shape = [1, 2, 2, 200, 200, 32, 32];
    let mut c = Case::new(shape, 5);
    c.k[[0, 0, 150, 0]] = bf16::INFINITY;
    c.k[[0, 1, 150, 0]] = bf16::NEG_INFINITY;
    // Cases 0 and 1 of `options`: no option, and causal.
    for case in [0, 1] {
        let got = run(engine, &c.q, &c.k, &c.v, &options(case, &c.store));
        let want = c.reference(case);
        assert!(want.iter().any(|x| x.is_nan()) && want.iter().any(|x| x.is_finite()));
        check(engine, &got, &want, c.max_abs_v(), "infinite keys");
    }
}

#[test]
fn nan_in_keys_a_row_masks_but_its_tile_holds() {
    engines()
        .into_iter()
        .for_each(nan_in_keys_a_row_masks_but_its_tile_holds_on);
}

fn nan_in_keys_a_row_masks_but_its_tile_holds_on(engine: Engine) {
    // Causal: row i sees keys 0..=i; NaN in key/value 150 reaches only rows
    // from 150 on, though tiles of earlier rows hold it.
    let shape = [1, 2, 2, 200, 200, 32, 32];
    let c = Case::new(shape, 3);
    let (mut k, mut v) = (c.k.clone(), c.v.clone());
    k.slice_mut(s![.., .., 150, ..]).fill(bf16::NAN);
    v.slice_mut(s![.., .., 150, ..]).fill(bf16::NAN);
    let opts = AttentionOptions::new().causal();
    let clean = run(engine, &c.q, &c.k, &c.v, &opts);
    let dirty = run(engine, &c.q, &k, &v, &opts);
    for i in 0..200 {
        let (a, b) = (
            dirty.slice(s![.., .., i, ..]),
            clean.slice(s![.., .., i, ..]),
        );
        if i < 150 {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "row {i}"
            );
        } else {
            assert!(a.iter().all(|x| x.is_nan()), "row {i} sees the NaN key");
        }
    }
}

#[test]
fn rows_that_see_no_key_are_zero() {
    engines()
        .into_iter()
        .for_each(rows_that_see_no_key_are_zero_on);
}

fn rows_that_see_no_key_are_zero_on(engine: Engine) {
    let shape = [3, 2, 1, 70, 90, 16, 48];
    let c = Case::new(shape, 4);
    // Batch item 1 has no keys; in item 2 the keep mask hides every key
    // from rows 10..20.
    let lengths = [90, 0, 90];
    let mut keep = Array4::from_elem([3, 1, 70, 90], true);
    keep.slice_mut(s![2, .., 10..20, ..]).fill(false);
    let opts = AttentionOptions::new()
        .key_lengths(&lengths)
        .keep_mask(keep.view());
    let out = run(engine, &c.q, &c.k, &c.v, &opts);
    assert!(
        out.slice(s![1, .., .., ..])
            .iter()
            .all(|x| x.to_bits() == 0)
    );
    assert!(
        out.slice(s![2, .., 10..20, ..])
            .iter()
            .all(|x| x.to_bits() == 0)
    );
    assert!(
        out.slice(s![0, .., .., ..])
            .iter()
            .any(|x| x.to_f64() != 0.0)
    );
}

#[test]
fn one_and_two_threads_give_the_same_bits() {
    engines()
        .into_iter()
        .for_each(one_and_two_threads_give_the_same_bits_on);
}

fn one_and_two_threads_give_the_same_bits_on(engine: Engine) {
    for (s, shape) in [[2, 4, 2, 300, 300, 40, 24], [1, 8, 1, 97, 1000, 64, 64]]
        .into_iter()
        .enumerate()
    {
        for case in [0, 1, 6] {
            let c = Case::new(shape, 70 + s as u64);
            let opts = options(case, &c.store);
            let call = || run(engine, &c.q, &c.k, &c.v, &opts);
            let one = with_threads(1, call);
            let two = with_threads(2, call);
            assert!(
                one.iter()
                    .zip(&two)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{shape:?} case {case}"
            );
        }
    }
}

#[test]
fn a_bf16_cache_prefill_with_bf16_queries_takes_the_native_path() {
    engines()
        .into_iter()
        .for_each(a_bf16_cache_prefill_with_bf16_queries_takes_the_native_path_on);
}

fn a_bf16_cache_prefill_with_bf16_queries_takes_the_native_path_on(engine: Engine) {
    // A cache widens its bf16 queries to f32 before attending; they are
    // still bf16 values, so its prefill runs the native kernels: bit for
    // bit the functional call's (causal, as a prompt on an empty cache).
    let shape = [2, 4, 2, 100, 100, 64, 64];
    let c = Case::new(shape, 21);
    let opts = AttentionOptions::new().causal();
    let functional = run(engine, &c.q, &c.k, &c.v, &opts);
    let cached = with_bf16_dot(true, || {
        with_amx(engine.amx, || {
            with_kernel_set(engine.set, || {
                let mut cache = sdpa::KvCache::<bf16>::new(2, 2, 64, 64, 100).unwrap();
                cache.attend(c.q.view(), c.k.view(), c.v.view()).unwrap()
            })
        })
    })
    .expect("the set runs here");
    assert!(
        cached
            .iter()
            .zip(&functional)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{engine:?}"
    );
}

#[test]
fn strided_queries_give_the_bits_of_contiguous_ones() {
    engines()
        .into_iter()
        .for_each(strided_queries_give_the_bits_of_contiguous_ones_on);
}

/// Queries whose rows are not contiguous (every other column of a wider
/// array) take the widening copy instead of the bits as they are: the
/// same pairs, so the same output, for even and odd head dims.
fn strided_queries_give_the_bits_of_contiguous_ones_on(engine: Engine) {
    for d_k in [64, 33] {
        let shape = [1, 2, 2, 70, 90, d_k, 16];
        let c = Case::new(shape, 77);
        let wide = every_other_column(&c.q);
        let strided = wide.slice(s![.., .., .., ..;2]);
        assert!(strided.as_slice().is_none());
        let opts = AttentionOptions::new().causal();
        let contiguous = run(engine, &c.q, &c.k, &c.v, &opts);
        let from_strided = run_views(engine, true, strided, c.k.view(), c.v.view(), &opts);
        assert_eq!(from_strided, contiguous, "d_k {d_k}");
    }
}
