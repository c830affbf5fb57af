//! A fuzz test that stays (issue 9): random shapes, options, strides,
//! magnitudes and non-finite values through every path — the fused `f32`
//! path on every kernel set this CPU has, `core` in `f32` and `core` in
//! `f64` — checked against an oracle written here from the README's
//! semantics and against each other.
//!
//! Every case is drawn from its own seed, so a failure names the seed that
//! replays it. Environment:
//!
//! - `SDPA_FUZZ_CASES`: cases per test (default [`DEFAULT_CASES`]; `.ci/run`
//!   runs many more);
//! - `SDPA_FUZZ_SEED`: the first case's seed (default [`DEFAULT_SEED`]);
//!   case `n` has seed `SDPA_FUZZ_SEED + n`;
//! - `SDPA_FUZZ_REPLAY`: run only the case with this seed (decimal or
//!   `0x` hex), and print it;
//! - `SDPA_FUZZ_VERBOSE`: print every failure of every case as it happens.
//!
//! ```text
//! SDPA_FUZZ_REPLAY=0x5eed0000000003a cargo test --test fuzz forward -- --nocapture
//! ```
//!
//! Each test runs every case, collects what fails by property, and fails
//! at the end naming, per property, how many cases failed and the smallest
//! one. Calls run under `catch_unwind`, so a panic is a failure with its
//! case, not the end of the run. Tests run in the test profile, which keeps
//! overflow checks on (Cargo.toml's `[profile.test]` sets only opt-level).

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use ndarray::{Array3, Array4, ArrayView3, ArrayView4, ArrayViewMut4, Axis, Slice, s};
use sdpa::simd::{KernelSet, available_kernel_sets, with_kernel_set};
use sdpa::{
    AttentionError, AttentionOptions, AttentionPartial, CausalAlignment, Element, ErrorKind,
};

mod common;
use common::{Rng, cast};

/// Cases per test under a plain `cargo test`: about a second each in the
/// test profile on one core.
const DEFAULT_CASES: u64 = 120;
const DEFAULT_SEED: u64 = 0x5eed_0000_0000_0000;

const EPS32: f64 = f32::EPSILON as f64;
const EPS64: f64 = f64::EPSILON;

/// A bound on the work of one forward call, `batch·heads·len_q·len_kv·(d_k
/// + d_v)`, so a case stays in the milliseconds.
const WORK_BUDGET: usize = 1_500_000;

// ---------------------------------------------------------------------------
// Running cases and collecting failures
// ---------------------------------------------------------------------------

fn env_u64(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    let text = text.trim();
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16).ok(),
        None => text.replace('_', "").parse().ok(),
    }
}

/// The seeds of the cases to run.
fn case_seeds() -> Vec<u64> {
    if let Some(seed) = env_u64("SDPA_FUZZ_REPLAY") {
        return vec![seed];
    }
    let cases = env_u64("SDPA_FUZZ_CASES").unwrap_or(DEFAULT_CASES);
    let first = env_u64("SDPA_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    (0..cases).map(|n| first.wrapping_add(n)).collect()
}

/// One failed property in one case.
struct Failure {
    seed: u64,
    size: usize,
    case: String,
    message: String,
}

/// The cases that failed one property: how many, how many on each path,
/// and the two smallest.
#[derive(Default)]
struct PropertyFailures {
    cases: usize,
    by_path: BTreeMap<String, usize>,
    smallest: Vec<Failure>,
}

/// The failures of one test, by property: how many cases, on which paths,
/// and the two smallest.
#[derive(Default)]
struct Failures {
    cases: usize,
    by_property: BTreeMap<&'static str, PropertyFailures>,
}

impl Failures {
    /// Runs `check` on every case, each under `catch_unwind`.
    fn run(test: &str, check: impl Fn(&Case, &mut CaseReport)) -> Self {
        let mut failures = Failures::default();
        let replay = env_u64("SDPA_FUZZ_REPLAY").is_some();
        let verbose = std::env::var_os("SDPA_FUZZ_VERBOSE").is_some();
        for seed in case_seeds() {
            let case = Case::generate(seed);
            if replay {
                println!("{test}: {}", case.describe());
            }
            let mut report = CaseReport::default();
            if let Err(panic) = guarded(|| check(&case, &mut report)) {
                report.fail(NO_PANIC, format!("the test itself: {panic}"));
            }
            if verbose {
                for (property, message, paths) in &report.failed {
                    println!("{test} {:#x}: `{property}` {paths:?}: {message}", case.seed);
                }
            }
            failures.add(&case, report);
        }
        failures
    }

    fn add(&mut self, case: &Case, report: CaseReport) {
        self.cases += 1;
        for (property, message, paths) in report.failed {
            let PropertyFailures {
                cases: count,
                by_path,
                smallest,
            } = self.by_property.entry(property).or_default();
            *count += 1;
            for path in paths {
                *by_path.entry(path).or_default() += 1;
            }
            smallest.push(Failure {
                seed: case.seed,
                size: case.size(),
                case: case.describe(),
                message,
            });
            smallest.sort_by_key(|f| f.size);
            smallest.truncate(2);
        }
    }

    /// Fails the test with a summary if any property failed.
    fn finish(self, test: &str) {
        if self.by_property.is_empty() {
            return;
        }
        let mut summary = format!(
            "{} of the properties of `{test}` fail ({} cases run):\n",
            self.by_property.len(),
            self.cases
        );
        for (property, failures) in &self.by_property {
            let PropertyFailures {
                cases: count,
                by_path,
                smallest,
            } = failures;
            summary += &format!(
                "\n* `{property}` fails in {count} cases (by path: {by_path:?}); the smallest:\n"
            );
            for f in smallest {
                summary += &format!(
                    "  - seed {:#x}: {}\n    {}\n    replay: SDPA_FUZZ_REPLAY={:#x} cargo test --test fuzz {test} -- --nocapture\n",
                    f.seed, f.message, f.case, f.seed
                );
            }
        }
        panic!("{summary}");
    }
}

/// The properties one case failed, each once: the first message, and the
/// paths that failed it (each message starts with its path, `fused avx2:`).
#[derive(Default)]
struct CaseReport {
    failed: Vec<(&'static str, String, std::collections::BTreeSet<String>)>,
}

impl CaseReport {
    fn fail(&mut self, property: &'static str, message: String) {
        let path = match message.split_once(": ") {
            Some((path, _)) if path.len() <= 40 => path.to_string(),
            _ => "-".to_string(),
        };
        match self.failed.iter_mut().find(|(p, ..)| *p == property) {
            Some((.., paths)) => {
                paths.insert(path);
            }
            None => self.failed.push((property, message, [path].into())),
        }
    }
}

/// Runs `f`, turning a panic into `Err(message)`.
fn guarded<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with a non-string payload".to_string())
    })
}

/// What a guarded call gave: a panic (outer `Err`), or the call's result.
type Called<T> = Result<Result<T, AttentionError>, String>;

/// `Ok(None)` for `Ok`, `Ok(Some(kind))` for an error, `Err` for a panic.
fn outcome<T>(called: &Called<T>) -> Result<Option<ErrorKind>, String> {
    match called {
        Ok(Ok(_)) => Ok(None),
        Ok(Err(e)) => Ok(Some(e.kind())),
        Err(panic) => Err(panic.clone()),
    }
}

/// Runs `f` with kernel set `set` forced on this thread.
fn forced<R>(
    set: KernelSet,
    f: impl FnOnce() -> Result<R, AttentionError>,
) -> Result<R, AttentionError> {
    with_kernel_set(set, f).and_then(|r| r)
}

fn pick<T: Copy>(rng: &mut Rng, items: &[T]) -> T {
    items[rng.below(items.len())]
}

// ---------------------------------------------------------------------------
// Strided arrays: transposed, reversed, stepped and broadcast views
// ---------------------------------------------------------------------------

/// How a 4-D array is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Layout {
    /// Memory axis `m` (outermost first) holds logical axis `order[m]`.
    order: [usize; 4],
    /// Stored back to front, read through a negative stride.
    reversed: [bool; 4],
    /// Stored with a gap (filled with NaN, or `true` for a mask) after every
    /// element, read with a step of 2.
    stepped: [bool; 4],
    /// Stored once, read through a zero stride (`broadcast`); the values
    /// along such an axis are all equal.
    broadcast: [bool; 4],
}

impl Layout {
    const STANDARD: Layout = Layout {
        order: [0, 1, 2, 3],
        reversed: [false; 4],
        stepped: [false; 4],
        broadcast: [false; 4],
    };

    /// Standard half the time; otherwise a random permutation, reversals,
    /// at most one stepped axis and (if allowed) zero strides.
    /// `contiguous_rows` keeps the last axis innermost and forward, as the
    /// decode path needs.
    fn random(
        rng: &mut Rng,
        shape: [usize; 4],
        allow_broadcast: bool,
        contiguous_rows: bool,
    ) -> Self {
        if rng.chance(0.5) {
            return Self::STANDARD;
        }
        let mut layout = Self::STANDARD;
        if rng.chance(0.5) {
            let p = rng.permutation(4);
            layout.order = [p[0], p[1], p[2], p[3]];
        }
        for (a, &len) in shape.iter().enumerate() {
            layout.reversed[a] = rng.chance(0.25);
            layout.broadcast[a] = allow_broadcast && len > 1 && rng.chance(0.15);
        }
        if rng.chance(0.3) {
            let a = rng.below(4);
            layout.stepped[a] = !layout.broadcast[a];
        }
        if contiguous_rows {
            let m = layout.order.iter().position(|&a| a == 3).unwrap();
            layout.order.swap(m, 3);
            layout.reversed[3] = false;
            layout.stepped[3] = false;
            layout.broadcast[3] = false;
        }
        layout
    }

    fn is_standard(&self) -> bool {
        *self == Self::STANDARD
    }

    /// Logical axis `a` ← memory axis `inverse()[a]`.
    fn inverse(&self) -> [usize; 4] {
        let mut inverse = [0; 4];
        for (m, &a) in self.order.iter().enumerate() {
            inverse[a] = m;
        }
        inverse
    }

    /// The memory shape holding a logical `shape` whose broadcast axes are
    /// stored once (`stored_broadcast`) or at full length.
    fn memory_shape(&self, shape: [usize; 4], stored_broadcast: bool) -> [usize; 4] {
        let stored: [usize; 4] = std::array::from_fn(|a| {
            if self.broadcast[a] && stored_broadcast {
                1
            } else if self.stepped[a] {
                2 * shape[a]
            } else {
                shape[a]
            }
        });
        std::array::from_fn(|m| stored[self.order[m]])
    }

    fn describe(&self) -> String {
        if self.is_standard() {
            return "standard".into();
        }
        let axes = |flags: [bool; 4]| -> Vec<usize> { (0..4).filter(|&a| flags[a]).collect() };
        format!(
            "order {:?} reversed {:?} stepped {:?} broadcast {:?}",
            self.order,
            axes(self.reversed),
            axes(self.stepped),
            axes(self.broadcast)
        )
    }
}

/// An array stored in some [`Layout`], seen through a view of its logical
/// shape.
struct Strided<T> {
    storage: Array4<T>,
    layout: Layout,
    shape: [usize; 4],
}

impl<T: Clone> Strided<T> {
    /// `base` has the logical shape with 1 on the layout's broadcast axes;
    /// gaps of stepped axes hold `gap`.
    fn new(base: &Array4<T>, shape: [usize; 4], layout: Layout, gap: T) -> Self {
        let storage = Array4::from_elem(layout.memory_shape(shape, true), gap);
        let mut strided = Strided {
            storage,
            layout,
            shape,
        };
        let mut view = strided.storage.view_mut().permuted_axes(layout.inverse());
        Self::walk(&layout, &mut view);
        view.assign(base);
        strided
    }

    /// Steps and reversals, in the same order for reading and writing.
    fn walk<V: ndarray::RawData>(layout: &Layout, view: &mut ndarray::ArrayBase<V, ndarray::Ix4>) {
        for a in 0..4 {
            if layout.stepped[a] {
                view.slice_axis_inplace(Axis(a), Slice::new(0, None, 2));
            }
            if layout.reversed[a] {
                view.invert_axis(Axis(a));
            }
        }
    }

    fn view(&self) -> ArrayView4<'_, T> {
        let full = self.layout.memory_shape(self.shape, false);
        let mut view = self
            .storage
            .broadcast(full)
            .expect("broadcast axes are stored once")
            .permuted_axes(self.layout.inverse());
        Self::walk(&self.layout, &mut view);
        view
    }

    /// A writable view; only for layouts without broadcast axes.
    fn view_mut(&mut self) -> ArrayViewMut4<'_, T> {
        let mut view = self.storage.view_mut().permuted_axes(self.layout.inverse());
        Self::walk(&self.layout, &mut view);
        view
    }
}

/// The values of one argument: its logical shape, its layout, and its
/// values with 1 on the broadcast axes.
#[derive(Debug, Clone)]
struct Tensor<T> {
    shape: [usize; 4],
    layout: Layout,
    base: Array4<T>,
}

impl<T: Clone> Tensor<T> {
    fn random(shape: [usize; 4], layout: Layout, mut value: impl FnMut() -> T) -> Self {
        let base_shape: [usize; 4] =
            std::array::from_fn(|a| if layout.broadcast[a] { 1 } else { shape[a] });
        Tensor {
            shape,
            layout,
            base: Array4::from_shape_simple_fn(base_shape, &mut value),
        }
    }

    /// The entry of `base` that position `pos` reads, where `pos` may index
    /// the full `[batch, heads, len_q, total_len_kv]` of a broadcast mask
    /// or bias.
    fn base_index(&self, pos: [usize; 4]) -> [usize; 4] {
        let shape = self.base.shape();
        std::array::from_fn(|a| if shape[a] == 1 { 0 } else { pos[a] })
    }

    fn at(&self, pos: [usize; 4]) -> T {
        self.base[self.base_index(pos)].clone()
    }

    fn strided<U: Clone>(&self, convert: impl Fn(&T) -> U, gap: U) -> Strided<U> {
        Strided::new(&self.base.map(convert), self.shape, self.layout, gap)
    }
}

// ---------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------

/// What a case's call must return.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Ok,
    /// An error of this kind (the case has exactly one thing wrong).
    Err(ErrorKind),
}

/// How the values of one argument are drawn.
#[derive(Debug, Clone, Copy)]
enum Magnitude {
    /// Uniform in `[-m, m)`.
    Uniform(f64),
    /// `±10^e`, `e` uniform in `[-20, 20]`, entry by entry.
    Wild,
}

impl Magnitude {
    fn random(rng: &mut Rng) -> Self {
        if rng.chance(0.6) {
            Magnitude::Uniform(1.0)
        } else if rng.chance(0.15) {
            Magnitude::Wild
        } else {
            Magnitude::Uniform(pick(rng, &[1e-20, 1e-10, 1e-3, 10.0, 1e3, 1e10, 1e20]))
        }
    }

    fn value(self, rng: &mut Rng) -> f32 {
        match self {
            Magnitude::Uniform(m) => (rng.uniform(-1.0, 1.0) * m) as f32,
            Magnitude::Wild => {
                let sign = if rng.chance(0.5) { -1.0 } else { 1.0 };
                (sign * 10f64.powf(rng.uniform(-20.0, 20.0))) as f32
            }
        }
    }

    fn is_at_most_one(self) -> bool {
        matches!(self, Magnitude::Uniform(m) if m <= 1.0)
    }
}

/// One attention call: the arguments, the options, how each is laid out,
/// and what it must return.
#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    expect: Expect,
    q: Tensor<f32>,
    k: Tensor<f32>,
    v: Tensor<f32>,
    keep_mask: Option<Tensor<bool>>,
    bias: Option<Tensor<f32>>,
    causal: Option<CausalAlignment>,
    window: Option<usize>,
    scale: Option<f32>,
    key_lengths: Option<Vec<usize>>,
    key_shard: Option<(usize, usize)>,
    /// The layout of the caller's buffer for `_into`.
    out_layout: Layout,
    /// The gradient of the loss for the backward, `[batch, heads, len_q, d_v]`.
    d_out: Tensor<f32>,
    magnitudes: [Magnitude; 3],
    /// Whether q, k, v and d_out are all of magnitude at most 1 (the
    /// backward's closeness check needs moderate inputs).
    moderate: bool,
    /// Non-finite values placed where a query can see them.
    visible_poison: Vec<String>,
}

const LENGTHS: &[usize] = &[
    0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 191,
    193,
];
const HEAD_DIMS: &[usize] = &[
    1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 80, 96, 128,
];
/// Head dims that are whole vectors on every kernel set (the decode path).
const VECTOR_DIMS: &[usize] = &[4, 8, 16, 32, 48, 64, 128];

fn length(rng: &mut Rng) -> usize {
    if rng.chance(0.45) {
        rng.below(12)
    } else {
        pick(rng, LENGTHS)
    }
}

impl Case {
    fn generate(seed: u64) -> Case {
        let mut rng = Rng::new(seed);
        let rng = &mut rng;

        // Shapes.
        let long = rng.chance(0.06);
        let mut batch = pick(rng, &[1, 1, 1, 2, 2, 3, 0]);
        let mut kv_heads = pick(rng, &[1, 1, 2, 3]);
        let mut group = pick(rng, &[1, 1, 2, 3, 4]);
        let (mut len_q, mut len_kv) = if long {
            let len_kv = if rng.chance(0.5) {
                pick(rng, &[1023, 1024, 1025, 1088, 2047, 2048, 2049])
            } else {
                1025 + rng.below(1200)
            };
            (1 + rng.below(8), len_kv)
        } else {
            (length(rng), length(rng))
        };
        let (mut d_k, mut d_v) = if long || (len_q <= 8 && rng.chance(0.5)) {
            (pick(rng, VECTOR_DIMS), pick(rng, VECTOR_DIMS))
        } else {
            (pick(rng, HEAD_DIMS), pick(rng, HEAD_DIMS))
        };
        if rng.chance(0.03) {
            d_v = 0;
        }
        if long {
            (d_k, d_v) = (d_k.min(16), d_v.min(16));
        }
        while batch * kv_heads * group * len_q * len_kv * (d_k + d_v + 2) > WORK_BUDGET {
            if batch > 1 {
                batch = 1;
            } else if group > 1 {
                group = 1;
            } else if kv_heads > 1 {
                kv_heads = 1;
            } else if len_q > 8 {
                len_q /= 2;
            } else if d_k > 16 || d_v > 16 {
                (d_k, d_v) = (d_k.min(16), d_v.min(16));
            } else {
                len_kv /= 2;
            }
        }
        let heads = kv_heads * group;

        // Options.
        let key_shard = rng.chance(0.15).then(|| {
            let offset = rng.below(8);
            (offset, offset + len_kv + rng.below(8))
        });
        let total = key_shard.map_or(len_kv, |(_, total)| total);
        let full = [batch, heads, len_q, total];
        let broadcast_shape = |rng: &mut Rng| -> [usize; 4] {
            std::array::from_fn(|a| if rng.chance(0.3) { 1 } else { full[a] })
        };
        let causal = match rng.below(8) {
            0 | 1 => Some(CausalAlignment::BottomRight),
            2 => Some(CausalAlignment::TopLeft),
            _ => None,
        };
        let window = rng.chance(0.15).then(|| 1 + rng.below(total + 2));
        let scale = match rng.below(20) {
            0..=10 => None,
            11..=14 => Some(rng.uniform(-2.0, 2.0) as f32),
            15 => Some(0.0),
            16 => Some(pick(rng, &[1e-30, 1e-10])),
            17 => Some(pick(rng, &[1e10, 1e30])),
            _ => Some(pick(rng, &[1e38, -1e38, 3.0, -0.5])),
        };
        let key_lengths = rng.chance(0.25).then(|| {
            (0..batch)
                .map(|_| {
                    if rng.chance(0.5) {
                        total
                    } else {
                        rng.below(total + 1)
                    }
                })
                .collect::<Vec<_>>()
        });
        let mask_shape = rng.chance(0.35).then(|| broadcast_shape(rng));
        let bias_shape = rng.chance(0.35).then(|| broadcast_shape(rng));

        let mut case = CaseShapes {
            q: [batch, heads, len_q, d_k],
            k: [batch, kv_heads, len_kv, d_k],
            v: [batch, kv_heads, len_kv, d_v],
            mask: mask_shape,
            bias: bias_shape,
            causal,
            window,
            scale,
            key_lengths,
            key_shard,
            expect: Expect::Ok,
        };
        if rng.chance(0.12) {
            case.break_one_thing(rng);
        }

        // Values.
        let magnitudes = [
            Magnitude::random(rng),
            Magnitude::random(rng),
            Magnitude::random(rng),
        ];
        let decode_rows = len_q <= 8 && rng.chance(0.5);
        let q_layout = Layout::random(rng, case.q, true, false);
        let k_layout = Layout::random(rng, case.k, true, decode_rows);
        let v_layout = Layout::random(rng, case.v, true, decode_rows);
        let q = Tensor::random(case.q, q_layout, || magnitudes[0].value(rng));
        let k = Tensor::random(case.k, k_layout, || magnitudes[1].value(rng));
        let v = Tensor::random(case.v, v_layout, || magnitudes[2].value(rng));
        let keep_mask = case.mask.map(|shape| {
            let p = pick(rng, &[0.0, 0.3, 0.7, 0.95, 1.0]);
            let layout = Layout::random(rng, shape, true, false);
            Tensor::random(shape, layout, || rng.chance(p))
        });
        let bias = case.bias.map(|shape| {
            let magnitude = if rng.chance(0.7) {
                1.0
            } else {
                pick(rng, &[10.0, 1e3, 1e20])
            };
            let hidden = pick(rng, &[0.0, 0.0, 0.1, 0.5, 1.0]);
            let layout = Layout::random(rng, shape, true, false);
            Tensor::random(shape, layout, || {
                if rng.chance(hidden) {
                    f32::NEG_INFINITY
                } else {
                    (rng.uniform(-1.0, 1.0) * magnitude) as f32
                }
            })
        });
        let out_shape = [case.q[0], case.q[1], case.q[2], case.v[3]];
        let out_layout = Layout::random(rng, out_shape, false, false);
        let d_out_layout = Layout::random(rng, out_shape, true, false);
        let d_out = Tensor::random(out_shape, d_out_layout, || rng.uniform(-1.0, 1.0) as f32);
        let moderate = magnitudes.iter().all(|m| m.is_at_most_one());

        let mut case = Case {
            seed,
            expect: case.expect,
            q,
            k,
            v,
            keep_mask,
            bias,
            causal: case.causal,
            window: case.window,
            scale: case.scale,
            key_lengths: case.key_lengths,
            key_shard: case.key_shard,
            out_layout,
            d_out,
            magnitudes,
            moderate,
            visible_poison: Vec::new(),
        };
        if case.expect == Expect::Ok && rng.chance(0.15) {
            case.poison_visible(rng);
        }
        case
    }

    fn out_shape(&self) -> [usize; 4] {
        [
            self.q.shape[0],
            self.q.shape[1],
            self.q.shape[2],
            self.v.shape[3],
        ]
    }

    fn len_kv(&self) -> usize {
        self.k.shape[2]
    }

    /// `(offset, total_len_kv)` of the call's keys in the whole sequence.
    fn shard(&self) -> (usize, usize) {
        self.key_shard.unwrap_or((0, self.len_kv()))
    }

    /// The number of input values, to find the smallest failing case.
    fn size(&self) -> usize {
        let n = |shape: [usize; 4]| shape.iter().product::<usize>();
        n(self.q.shape)
            + n(self.k.shape)
            + n(self.v.shape)
            + self.keep_mask.as_ref().map_or(0, |m| n(m.shape))
            + self.bias.as_ref().map_or(0, |b| n(b.shape))
    }

    fn scale_f64(&self) -> f64 {
        match self.scale {
            Some(s) => s as f64,
            // Exact; an `f32` path's rounded 1/√d_k is within its score
            // tolerance.
            None => 1.0 / (self.q.shape[3] as f64).sqrt(),
        }
    }

    fn describe(&self) -> String {
        let mut options = Vec::new();
        if let Some(c) = self.causal {
            options.push(format!("causal {c:?}"));
        }
        if let Some(w) = self.window {
            options.push(format!("window {w}"));
        }
        if let Some(s) = self.scale {
            options.push(format!("scale {s:e}"));
        }
        if let Some(m) = &self.keep_mask {
            let visible = m.base.iter().filter(|&&x| x).count();
            options.push(format!(
                "keep_mask {:?} ({} of {} true, {})",
                m.shape,
                visible,
                m.base.len(),
                m.layout.describe()
            ));
        }
        if let Some(b) = &self.bias {
            let hidden = b.base.iter().filter(|x| **x == f32::NEG_INFINITY).count();
            options.push(format!(
                "bias {:?} ({} of {} −inf, max |finite| {:e}, {})",
                b.shape,
                hidden,
                b.base.len(),
                max_abs(b.base.iter()),
                b.layout.describe()
            ));
        }
        if let Some(l) = &self.key_lengths {
            options.push(format!("key_lengths {l:?}"));
        }
        if let Some((o, t)) = self.key_shard {
            options.push(format!("key_shard({o}, {t})"));
        }
        format!(
            "expect {:?}; q {:?} ({}), k {:?} ({}), v {:?} ({}); magnitudes q/k/v {:?}; options [{}]; out {}; visible non-finite: {:?}",
            self.expect,
            self.q.shape,
            self.q.layout.describe(),
            self.k.shape,
            self.k.layout.describe(),
            self.v.shape,
            self.v.layout.describe(),
            self.magnitudes,
            options.join(", "),
            self.out_layout.describe(),
            self.visible_poison,
        )
    }

    fn options<'a, F: Element>(&'a self, data: &'a Data<F>) -> AttentionOptions<'a, F> {
        let mut opts = AttentionOptions::new();
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        if let Some(alignment) = self.causal {
            opts = opts.causal_aligned(alignment);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(cast(scale as f64));
        }
        if let Some(mask) = &data.keep_mask {
            opts = opts.keep_mask(mask.view());
        }
        if let Some(bias) = &data.bias {
            opts = opts.bias(bias.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some((offset, total)) = self.key_shard {
            opts = opts.key_shard(offset, total);
        }
        opts
    }

    /// Whether query `i` of `(b, h)` may see the call's key `j`, from the
    /// README's definitions (positions in the whole sequence for a shard).
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (offset, total) = self.shard();
        let len_q = self.q.shape[2];
        let j = offset + j;
        let alignment = self
            .causal
            .or(self.window.map(|_| CausalAlignment::BottomRight));
        let causal = match alignment {
            None => true,
            Some(CausalAlignment::BottomRight) => j + len_q <= i + total,
            Some(CausalAlignment::TopLeft) => j <= i,
        };
        let in_window = self.window.is_none_or(|w| match alignment {
            Some(CausalAlignment::TopLeft) => j + w > i,
            _ => j + w + len_q > i + total,
        });
        causal
            && in_window
            && self.key_lengths.as_ref().is_none_or(|l| j < l[b])
            && self.keep_mask.as_ref().is_none_or(|m| m.at([b, h, i, j]))
    }

    fn bias_at(&self, b: usize, h: usize, i: usize, j: usize) -> f32 {
        let offset = self.shard().0;
        self.bias
            .as_ref()
            .map_or(0.0, |bias| bias.at([b, h, i, offset + j]))
    }

    /// Which keys each query sees, and what follows from it.
    fn visibility(&self) -> Visibility {
        let [batch, heads, len_q, _] = self.q.shape;
        let [_, kv_heads, len_kv, _] = self.k.shape;
        let group = heads / kv_heads;
        let visible = Array4::from_shape_fn((batch, heads, len_q, len_kv), |(b, h, i, j)| {
            self.visible(b, h, i, j)
        });
        let live = Array4::from_shape_fn((batch, heads, len_q, len_kv), |(b, h, i, j)| {
            visible[[b, h, i, j]] && self.bias_at(b, h, i, j) != f32::NEG_INFINITY
        });
        let any_row = |a: &Array4<bool>| {
            Array3::from_shape_fn((batch, heads, len_q), |(b, h, i)| {
                a.slice(s![b, h, i, ..]).iter().any(|&x| x)
            })
        };
        let any_key = |a: &Array4<bool>| {
            Array3::from_shape_fn((batch, kv_heads, len_kv), |(b, g, j)| {
                a.slice(s![b, g * group..(g + 1) * group, .., j])
                    .iter()
                    .any(|&x| x)
            })
        };
        Visibility {
            row_sees: any_row(&visible),
            row_lives: any_row(&live),
            key_seen: any_key(&visible),
            key_lives: any_key(&live),
            visible,
            live,
        }
    }

    /// The entries of each tensor no query can see (an entry of a
    /// broadcast tensor only if every position it stands for is unseen):
    /// queries that see no key; keys and values no query sees; values
    /// whose key every query that sees it gives a `−inf` bias; bias
    /// entries of hidden positions.
    fn invisible_entries(&self, vis: &Visibility) -> Invisible {
        let unseen = |t: &Tensor<f32>, seen: &dyn Fn([usize; 4]) -> bool| {
            let mut free = Array4::from_elem(t.base.raw_dim(), true);
            for pos in ndarray::indices(t.shape) {
                let pos = [pos.0, pos.1, pos.2, pos.3];
                if seen(pos) {
                    free[t.base_index(pos)] = false;
                }
            }
            free
        };
        let (offset, _) = self.shard();
        let len_kv = self.len_kv();
        Invisible {
            q: unseen(&self.q, &|[b, h, i, _]| vis.row_sees[[b, h, i]]),
            k: unseen(&self.k, &|[b, g, j, _]| vis.key_seen[[b, g, j]]),
            v: unseen(&self.v, &|[b, g, j, _]| vis.key_lives[[b, g, j]]),
            bias: self.bias.as_ref().map(|bias| {
                let [batch, heads, len_q, _] = self.q.shape;
                let mut free = Array4::from_elem(bias.base.raw_dim(), true);
                for (b, h, i, j) in ndarray::indices((batch, heads, len_q, len_kv)) {
                    if vis.visible[[b, h, i, j]] {
                        free[bias.base_index([b, h, i, offset + j])] = false;
                    }
                }
                free
            }),
        }
    }

    /// A copy with every entry no query can see (with probability `p`)
    /// replaced by NaN or ±inf; and how many were.
    fn poison_invisible(&self, rng: &mut Rng, p: f64) -> (Case, usize) {
        let invisible = self.invisible_entries(&self.visibility());
        let mut poisoned = self.clone();
        let mut count = 0;
        let mut poison = |t: &mut Tensor<f32>, free: &Array4<bool>| {
            for (x, &free) in t.base.iter_mut().zip(free) {
                if free && rng.chance(p) {
                    *x = pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
                    count += 1;
                }
            }
        };
        poison(&mut poisoned.q, &invisible.q);
        poison(&mut poisoned.k, &invisible.k);
        poison(&mut poisoned.v, &invisible.v);
        if let (Some(bias), Some(free)) = (poisoned.bias.as_mut(), &invisible.bias) {
            poison(bias, free);
        }
        (poisoned, count)
    }

    /// Places one to three NaN or ±inf where a query sees them: in a query
    /// that sees a key, in a key some query sees, in a value of a key some
    /// query gives weight, or in a bias entry of a visible position.
    fn poison_visible(&mut self, rng: &mut Rng) {
        let vis = self.visibility();
        let (offset, _) = self.shard();
        for _ in 0..1 + rng.below(3) {
            let value = pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
            let (name, tensor, seen) = match rng.below(3) {
                0 => ("q", &mut self.q, &vis.row_sees),
                1 => ("k", &mut self.k, &vis.key_seen),
                _ => ("v", &mut self.v, &vis.key_lives),
            };
            let spots: Vec<_> = seen
                .indexed_iter()
                .filter(|(_, x)| **x)
                .map(|(p, _)| p)
                .collect();
            if spots.is_empty() || tensor.shape[3] == 0 {
                continue;
            }
            let (a, b, c) = spots[rng.below(spots.len())];
            let pos = [a, b, c, rng.below(tensor.shape[3])];
            let index = tensor.base_index(pos);
            tensor.base[index] = value;
            self.visible_poison.push(format!("{name}{pos:?} = {value}"));
        }
        if let Some(bias) = &mut self.bias
            && rng.chance(0.3)
        {
            let spots: Vec<_> = vis
                .visible
                .indexed_iter()
                .filter(|(_, x)| **x)
                .map(|(p, _)| p)
                .collect();
            if !spots.is_empty() {
                let (b, h, i, j) = spots[rng.below(spots.len())];
                let value = pick(rng, &[f32::NAN, f32::INFINITY]);
                let index = bias.base_index([b, h, i, offset + j]);
                bias.base[index] = value;
                self.visible_poison
                    .push(format!("bias{:?} = {value}", [b, h, i, offset + j]));
            }
        }
    }
}

/// The shapes and options of a case before any value is drawn, so that one
/// thing can be made wrong.
struct CaseShapes {
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    mask: Option<[usize; 4]>,
    bias: Option<[usize; 4]>,
    causal: Option<CausalAlignment>,
    window: Option<usize>,
    scale: Option<f32>,
    key_lengths: Option<Vec<usize>>,
    key_shard: Option<(usize, usize)>,
    expect: Expect,
}

impl CaseShapes {
    /// Makes exactly one thing wrong, and records the error kind that the
    /// README (and issue 9, for key shards) says it gives.
    fn break_one_thing(&mut self, rng: &mut Rng) {
        let total = self.key_shard.map_or(self.k[2], |(_, t)| t);
        let full = [self.q[0], self.q[1], self.q[2], total];
        use ErrorKind::*;
        self.expect = Expect::Err(match rng.below(17) {
            0 => {
                (self.q[3], self.k[3]) = (0, 0);
                ZeroDimension
            }
            1 => {
                self.q[1] = 0;
                ZeroDimension
            }
            2 => {
                (self.k[1], self.v[1]) = (0, 0);
                ZeroDimension
            }
            3 => {
                (self.k[1], self.v[1]) = (self.q[1] + 1, self.q[1] + 1);
                HeadsNotDivisible
            }
            4 => {
                self.v[0] += 1;
                ShapeMismatch
            }
            5 => {
                self.k[3] += 1;
                ShapeMismatch
            }
            6 => {
                self.v[2] += 1;
                ShapeMismatch
            }
            7 => {
                self.v[1] += 1;
                ShapeMismatch
            }
            8 => {
                let mut shape = self.mask.unwrap_or(full);
                shape[rng.below(4)] += 2;
                self.mask = Some(shape);
                NotBroadcastable
            }
            9 => {
                let mut shape = self.bias.unwrap_or(full);
                shape[rng.below(4)] += 2;
                self.bias = Some(shape);
                NotBroadcastable
            }
            10 => {
                self.key_lengths = Some(vec![0; self.q[0] + 1]);
                KeyLengths
            }
            11 if self.q[0] > 0 => {
                let mut lengths = vec![total; self.q[0]];
                lengths[rng.below(self.q[0])] = total + 1 + rng.below(3);
                self.key_lengths = Some(lengths);
                KeyLengths
            }
            12 => {
                self.window = Some(0);
                InvalidOption
            }
            13 => {
                self.scale = Some(pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]));
                InvalidOption
            }
            14 => {
                // Keys offset..offset + len_kv past total_len_kv.
                let offset = 1 + rng.below(4);
                self.key_shard = Some((
                    offset,
                    (offset + self.k[2]).saturating_sub(1 + rng.below(2)),
                ));
                self.fit_columns();
                InvalidOption
            }
            15 => {
                // Issue 9, item 7: overflows `offset + len_kv`.
                self.key_shard = Some((usize::MAX - rng.below(2), 5));
                self.fit_columns();
                InvalidOption
            }
            _ => {
                // Issue 9, item 7: the causal diagonal overflows.
                self.key_shard = Some((0, usize::MAX));
                self.causal = Some(CausalAlignment::BottomRight);
                self.fit_columns();
                self.key_lengths = None;
                InvalidOption
            }
        });
    }

    /// Mask and bias columns that broadcast whatever the shard says, so
    /// only the shard is wrong.
    fn fit_columns(&mut self) {
        for shape in [&mut self.mask, &mut self.bias].into_iter().flatten() {
            shape[3] = 1;
        }
        self.key_lengths = None;
    }
}

/// Which keys each query sees.
struct Visibility {
    /// `[batch, heads, len_q, len_kv]`: by selection (causal, window, key
    /// lengths, keep mask).
    visible: Array4<bool>,
    /// Visible with a bias other than `−inf`: takes part in the softmax.
    live: Array4<bool>,
    /// `[batch, heads, len_q]`: the query sees at least one key.
    row_sees: Array3<bool>,
    /// The query has at least one live key.
    row_lives: Array3<bool>,
    /// `[batch, kv_heads, len_kv]`: some query of the group sees the key.
    key_seen: Array3<bool>,
    /// Some query of the group has the key live.
    key_lives: Array3<bool>,
}

/// Entries (of each tensor's stored values) that no query can see.
struct Invisible {
    q: Array4<bool>,
    k: Array4<bool>,
    v: Array4<bool>,
    bias: Option<Array4<bool>>,
}

/// A case's arguments as views of element type `F`.
struct Data<F> {
    q: Strided<F>,
    k: Strided<F>,
    v: Strided<F>,
    keep_mask: Option<Strided<bool>>,
    bias: Option<Strided<F>>,
    d_out: Strided<F>,
}

impl<F: Element> Data<F> {
    fn new(case: &Case) -> Self {
        let convert = |x: &f32| cast::<F>(*x as f64);
        Data {
            q: case.q.strided(convert, F::nan()),
            k: case.k.strided(convert, F::nan()),
            v: case.v.strided(convert, F::nan()),
            keep_mask: case.keep_mask.as_ref().map(|m| m.strided(|&x| x, true)),
            bias: case.bias.as_ref().map(|b| b.strided(convert, F::nan())),
            d_out: case.d_out.strided(convert, F::nan()),
        }
    }

    fn qkv(&self) -> (ArrayView4<'_, F>, ArrayView4<'_, F>, ArrayView4<'_, F>) {
        (self.q.view(), self.k.view(), self.v.view())
    }
}

fn max_abs<'a>(values: impl Iterator<Item = &'a f32>) -> f64 {
    values
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, &x| m.max((x as f64).abs()))
}

// ---------------------------------------------------------------------------
// The oracle and the tolerances
// ---------------------------------------------------------------------------

/// The answer in `f64`, computed here with loops from the README's
/// semantics: invisible keys are skipped; a `−inf` bias gives weight 0 and
/// its value is never multiplied in; a row with no key of weight is zeros
/// with log-sum-exp `−inf`; a NaN or `+inf` score makes the row NaN; a
/// non-finite value of a key of weight reaches its column.
struct Reference {
    out: Array4<f64>,
    lse: Array3<f64>,
    /// Rows whose answer the README leaves open: a `−inf` bias on a key
    /// whose score is NaN or infinite (does the bias hide the key or is
    /// `NaN − inf` NaN?), or a non-finite value of a key whose weight
    /// underflows to 0. Only closeness of finite entries is checked there.
    ambiguous: Array3<bool>,
    /// Rows that see a non-finite input: their query (if they see a key),
    /// a visible key, a NaN or `+inf` bias of a visible key, or a value of
    /// a live key. Such a row may come out non-finite on an `f32` path even
    /// where the `f64` answer is finite (say `scale·q` underflows to 0 and
    /// meets an infinite key: 0·inf = NaN).
    sees_non_finite: Array3<bool>,
}

fn oracle(case: &Case, vis: &Visibility) -> Reference {
    let [batch, heads, len_q, d_k] = case.q.shape;
    let [_, kv_heads, len_kv, d_v] = case.v.shape;
    let group = heads / kv_heads;
    let scale = case.scale_f64();
    let mut out = Array4::zeros((batch, heads, len_q, d_v));
    let mut lse = Array3::from_elem((batch, heads, len_q), f64::NEG_INFINITY);
    let mut ambiguous = Array3::from_elem((batch, heads, len_q), false);
    let mut sees_non_finite = Array3::from_elem((batch, heads, len_q), false);
    let finite_row = |t: &Tensor<f32>, b: usize, h: usize, i: usize, d: usize| {
        (0..d).all(|c| t.at([b, h, i, c]).is_finite())
    };
    for (b, h, i) in ndarray::indices((batch, heads, len_q)) {
        let g = h / group;
        sees_non_finite[[b, h, i]] = (0..len_kv).any(|j| {
            let bias = case.bias_at(b, h, i, j);
            vis.visible[[b, h, i, j]]
                && (!finite_row(&case.q, b, h, i, d_k)
                    || !finite_row(&case.k, b, g, j, d_k)
                    || bias.is_nan()
                    || bias == f32::INFINITY
                    || (vis.live[[b, h, i, j]] && !finite_row(&case.v, b, g, j, d_v)))
        });
        let mut scores = Vec::new();
        for j in 0..len_kv {
            if !vis.visible[[b, h, i, j]] {
                continue;
            }
            let dot: f64 = (0..d_k)
                .map(|d| case.q.at([b, h, i, d]) as f64 * case.k.at([b, g, j, d]) as f64)
                .sum();
            let bias = case.bias_at(b, h, i, j) as f64;
            let score = scale * dot;
            if bias == f64::NEG_INFINITY {
                ambiguous[[b, h, i]] |= !score.is_finite();
                continue;
            }
            scores.push((j, score + bias));
        }
        let max = scores.iter().fold(f64::NEG_INFINITY, |m, &(_, s)| {
            if m.is_nan() || s.is_nan() {
                f64::NAN
            } else {
                m.max(s)
            }
        });
        if max == f64::NEG_INFINITY {
            continue;
        }
        if !max.is_finite() {
            out.slice_mut(s![b, h, i, ..]).fill(f64::NAN);
            lse[[b, h, i]] = f64::NAN;
            continue;
        }
        let sum: f64 = scores.iter().map(|&(_, s)| (s - max).exp()).sum();
        for &(j, score) in &scores {
            let weight = (score - max).exp() / sum;
            let values = (0..d_v).map(|c| case.v.at([b, g, j, c]) as f64);
            if weight == 0.0 {
                ambiguous[[b, h, i]] |=
                    score > f64::NEG_INFINITY && values.clone().any(|x| !x.is_finite());
                continue;
            }
            for (c, x) in values.enumerate() {
                out[[b, h, i, c]] += weight * x;
            }
        }
        lse[[b, h, i]] = max + sum.ln();
    }
    Reference {
        out,
        lse,
        ambiguous,
        sees_non_finite,
    }
}

/// How well conditioned a case is, and the tolerances that follow.
///
/// Error model, for a path computing in precision `eps` (inputs exact in
/// both): the scaled, biased score `s = scale·q·k + bias` has error at most
/// `Δs = 8·eps·(S + B + 1)`, where `S = |scale|·max|q|·max|k|·d_k` bounds
/// `|scale|·Σ|q_d·k_d|` and `B = max|bias|` (8 covers the blocked dot
/// product's depth, the max subtraction and the bias addition). A weight
/// `w = e^(s − lse)` then has relative error at most `e^(2Δs) − 1 ≤ 4Δs`
/// (for `Δs ≤ 0.6`), so the output `Σ w·v`, a convex combination, moves by
/// at most `4Δs·max|v|`, plus `eps·(32 + 4·log2 len_kv)·max|v|` for `exp`
/// (≤ 2 ulp), the normalisation and the summation. When `Δs` is large the
/// bound exceeds `2·max|v|`, which no two convex combinations exceed: the
/// check relaxes by itself where f32 cannot resolve the scores (a score of
/// 1e6 has an ulp of 0.06). For inputs of order 1 it is about 3e-5·max|v|,
/// the tolerance of the other tests.
#[derive(Debug, Clone, Copy)]
struct Conditioning {
    score_bound: f64,
    bias_bound: f64,
    v_max: f64,
    len_kv: usize,
    /// A score (or a partial product of it, in whatever order a path
    /// multiplies) may pass `f32::MAX`: a non-finite `f32` output is then
    /// explained.
    overflow_risk: bool,
    /// Scores span less than 80, so no `f32` weight of a finite score
    /// underflows to 0 (`e^−80 > f32::MIN_POSITIVE`), and a non-finite
    /// value of a live key must reach the output.
    underflow_free: bool,
}

impl Conditioning {
    fn of(case: &Case) -> Self {
        let q_max = max_abs(case.q.base.iter());
        let k_max = max_abs(case.k.base.iter());
        let scale = case.scale_f64().abs();
        let d_k = case.q.shape[3] as f64;
        let bias_bound = case.bias.as_ref().map_or(0.0, |b| max_abs(b.base.iter()));
        let score_bound = scale * q_max * k_max * d_k;
        let worst_order = scale.max(1.0) * q_max.max(1.0) * k_max.max(1.0) * d_k + bias_bound;
        Conditioning {
            score_bound,
            bias_bound,
            v_max: max_abs(case.v.base.iter()),
            len_kv: case.len_kv(),
            overflow_risk: worst_order * 64.0 > f32::MAX as f64,
            underflow_free: 2.0 * (score_bound + bias_bound) < 80.0,
        }
    }

    fn score_error(&self, eps: f64) -> f64 {
        8.0 * eps * (self.score_bound + self.bias_bound + 1.0)
    }

    fn log_len(&self) -> f64 {
        ((self.len_kv + 1) as f64).log2()
    }

    fn output(&self, eps: f64) -> f64 {
        self.v_max * (4.0 * self.score_error(eps) + eps * (32.0 + 4.0 * self.log_len()))
            + f32::MIN_POSITIVE as f64
    }

    fn log_sum_exp(&self, eps: f64, lse: f64) -> f64 {
        2.0 * self.score_error(eps) + eps * (lse.abs() + 4.0 * self.log_len() + 4.0)
    }
}

/// What a path is held to.
#[derive(Clone, Copy)]
struct PathKind {
    eps: f64,
    /// `f32` paths may give non-finite output where the scores overflow.
    may_overflow: bool,
}

const F32_PATH: PathKind = PathKind {
    eps: EPS32,
    may_overflow: true,
};
const F64_PATH: PathKind = PathKind {
    eps: EPS64,
    may_overflow: false,
};

const EXPLAINED: &str = "non-finite output only where the f64 answer, a visible non-finite input or f32 overflow explains it";
const PROPAGATES: &str = "non-finite visible input reaches the output (no silent finite value)";
const SEES_KEY: &str = "a row that sees a key is never reported as seeing none (zeros / lse −inf)";
const SEES_NONE: &str = "a row that sees no key outputs exact zeros and lse −inf";
const CLOSE: &str = "output within tolerance of the f64 answer";
const LSE_CLOSE: &str = "log-sum-exp within tolerance of the f64 answer";

/// Checks one path's output (and log-sum-exp) against the oracle.
fn check_forward(
    label: &str,
    path: PathKind,
    out: &ArrayView4<'_, f64>,
    lse: Option<&ArrayView3<'_, f64>>,
    reference: &Reference,
    c: &Conditioning,
    report: &mut CaseReport,
) {
    let overflow = path.may_overflow && c.overflow_risk;
    let propagate = !path.may_overflow || (c.underflow_free && !c.overflow_risk);
    let tol = c.output(path.eps);
    for ((b, h, i), &ambiguous) in reference.ambiguous.indexed_iter() {
        let explained = ambiguous || (path.may_overflow && reference.sees_non_finite[[b, h, i]]);
        let got = out.slice(s![b, h, i, ..]);
        let want = reference.out.slice(s![b, h, i, ..]);
        let want_lse = reference.lse[[b, h, i]];
        let got_lse = lse.map(|l| l[[b, h, i]]);
        let at = |what: &str, c: usize, g: f64, w: f64| {
            format!("{label}: {what}[{b}, {h}, {i}, {c}] = {g:e}, f64 answer {w:e}")
        };
        for (col, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if !g.is_finite() && w.is_finite() && !explained && !overflow {
                report.fail(EXPLAINED, at("out", col, g, w));
            }
            if !w.is_finite() && g.is_finite() && !ambiguous && propagate {
                report.fail(PROPAGATES, at("out", col, g, w));
            }
            if g.is_finite() && w.is_finite() && (g - w).abs() > tol {
                report.fail(
                    CLOSE,
                    format!(
                        "{}, |error| {:e} > tolerance {tol:e}",
                        at("out", col, g, w),
                        (g - w).abs()
                    ),
                );
            }
        }
        if let Some(g) = got_lse {
            let w = want_lse;
            if !g.is_finite() && w.is_finite() && !explained && !overflow {
                report.fail(EXPLAINED, at("lse", 0, g, w));
            }
            if w.is_nan() && !g.is_nan() && !ambiguous && propagate {
                report.fail(PROPAGATES, at("lse", 0, g, w));
            }
            let tol = c.log_sum_exp(path.eps, w);
            if g.is_finite() && w.is_finite() && (g - w).abs() > tol {
                report.fail(
                    LSE_CLOSE,
                    format!(
                        "{}, |error| {:e} > tolerance {tol:e}",
                        at("lse", 0, g, w),
                        (g - w).abs()
                    ),
                );
            }
        }
        if ambiguous {
            continue;
        }
        if want_lse == f64::NEG_INFINITY {
            if got.iter().any(|&g| g != 0.0) || got_lse.is_some_and(|g| g != f64::NEG_INFINITY) {
                report.fail(
                    SEES_NONE,
                    format!("{label}: row [{b}, {h}, {i}] = {got} with lse {got_lse:?}"),
                );
            }
        } else {
            let zeros = want.iter().all(|w| w.is_finite())
                && want.iter().any(|&w| w != 0.0)
                && got.iter().all(|&g| g == 0.0);
            if zeros || got_lse == Some(f64::NEG_INFINITY) {
                report.fail(SEES_KEY, format!("{label}: row [{b}, {h}, {i}] = {got} with lse {got_lse:?}, f64 answer {want} with lse {want_lse:e}"));
            }
        }
    }
}

/// The first index where two arrays differ in bits (NaNs of any payload
/// count as equal).
fn first_bit_difference(a: &ArrayView4<'_, f32>, b: &ArrayView4<'_, f32>) -> Option<String> {
    if a.shape() != b.shape() {
        return Some(format!("shapes {:?} and {:?}", a.shape(), b.shape()));
    }
    a.indexed_iter()
        .zip(b.iter())
        .find_map(|((index, &x), &y)| {
            (x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
                .then(|| format!("{index:?}: {x:e} vs {y:e}"))
        })
}

fn to_f64_4(a: &ArrayView4<'_, f32>) -> Array4<f64> {
    a.mapv(f64::from)
}

fn to_f64_3(a: &ArrayView3<'_, f32>) -> Array3<f64> {
    a.mapv(f64::from)
}

// ---------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------

const NO_PANIC: &str = "no panic";
const SAME_OUTCOME: &str = "the same Ok/Err and ErrorKind on every path";
const EXPECTED: &str = "the Ok or ErrorKind the README promises";
const BITWISE_INTO: &str = "`_into` and `_partial` give the bits of the plain call";

/// Forward calls on every path: the same `Ok`/`Err`, never a panic, and
/// against the oracle: non-finite only where explained, no NaN swallowed,
/// zeros only for rows that see nothing, within tolerance.
#[test]
fn forward() {
    Failures::run("forward", forward_case).finish("forward");
}

fn forward_case(case: &Case, report: &mut CaseReport) {
    let d32 = Data::<f32>::new(case);
    let d64 = Data::<f64>::new(case);
    let (o32, o64) = (case.options(&d32), case.options(&d64));
    let (q, k, v) = d32.qkv();
    let (q64, k64, v64) = d64.qkv();
    let out_shape = case.out_shape();
    let new_buffer = || {
        Strided::new(
            &Array4::from_elem(out_shape, 0.0),
            out_shape,
            case.out_layout,
            f32::NAN,
        )
    };

    let mut outcomes: Vec<(String, Result<Option<ErrorKind>, String>)> = Vec::new();
    let mut results32: Vec<(String, Array4<f32>, Option<Array3<f32>>)> = Vec::new();
    for set in available_kernel_sets() {
        let plain = guarded(|| forced(set, || sdpa::scaled_dot_product_attention(q, k, v, &o32)));
        let partial = guarded(|| {
            forced(set, || {
                sdpa::scaled_dot_product_attention_partial(q, k, v, &o32)
            })
        });
        let mut buffer = new_buffer();
        let into = guarded(|| {
            forced(set, || {
                sdpa::scaled_dot_product_attention_into(q, k, v, &o32, buffer.view_mut())
            })
        });
        outcomes.push((format!("fused {set}"), outcome(&plain)));
        outcomes.push((format!("fused {set} partial"), outcome(&partial)));
        outcomes.push((format!("fused {set} into"), outcome(&into)));
        if let (Ok(Ok(plain)), Ok(Ok(partial)), Ok(Ok(()))) = (plain, partial, into) {
            if let Some(at) = first_bit_difference(&buffer.view(), &plain.view()) {
                report.fail(
                    BITWISE_INTO,
                    format!("fused {set}: into differs from plain at {at}"),
                );
            }
            if let Some(at) = first_bit_difference(&partial.output(), &plain.view()) {
                report.fail(
                    BITWISE_INTO,
                    format!("fused {set}: partial differs from plain at {at}"),
                );
            }
            results32.push((
                format!("fused {set}"),
                plain,
                Some(partial.log_sum_exp().to_owned()),
            ));
        }
    }
    let core32 = guarded(|| sdpa::core::scaled_dot_product_attention(q, k, v, &o32));
    let mut buffer = new_buffer();
    let core32_into =
        guarded(|| sdpa::core::scaled_dot_product_attention_into(q, k, v, &o32, buffer.view_mut()));
    outcomes.push(("core f32".into(), outcome(&core32)));
    outcomes.push(("core f32 into".into(), outcome(&core32_into)));
    if let (Ok(Ok(plain)), Ok(Ok(()))) = (core32, core32_into) {
        if let Some(at) = first_bit_difference(&buffer.view(), &plain.view()) {
            report.fail(
                BITWISE_INTO,
                format!("core f32: into differs from plain at {at}"),
            );
        }
        results32.push(("core f32".into(), plain, None));
    }
    let core64 = guarded(|| sdpa::core::scaled_dot_product_attention(q64, k64, v64, &o64));
    let core64_partial =
        guarded(|| sdpa::scaled_dot_product_attention_partial(q64, k64, v64, &o64));
    outcomes.push(("core f64".into(), outcome(&core64)));
    outcomes.push(("core f64 partial".into(), outcome(&core64_partial)));

    if !check_outcomes(case, &outcomes, report) {
        return;
    }
    // A wrongly shaped buffer for `_into`.
    let mut wrong = [out_shape[0], out_shape[1], out_shape[2] + 1, out_shape[3]];
    if case.seed.is_multiple_of(2) {
        wrong[3] += 1;
        wrong[2] -= 1;
    }
    let mut buffer = Array4::<f32>::zeros(wrong);
    let wrong_outcomes = [
        (
            "fused into a wrong buffer".to_string(),
            outcome(&guarded(|| {
                sdpa::scaled_dot_product_attention_into(q, k, v, &o32, buffer.view_mut())
            })),
        ),
        (
            "core f32 into a wrong buffer".to_string(),
            outcome(&guarded(|| {
                sdpa::core::scaled_dot_product_attention_into(q, k, v, &o32, buffer.view_mut())
            })),
        ),
    ];
    for (label, got) in wrong_outcomes {
        if got != Ok(Some(ErrorKind::ShapeMismatch)) {
            report.fail(
                EXPECTED,
                format!("{label} {wrong:?}: {got:?}, expected Err(ShapeMismatch)"),
            );
        }
    }

    let vis = case.visibility();
    let reference = oracle(case, &vis);
    let conditioning = Conditioning::of(case);
    for (label, out, lse) in &results32 {
        let lse = lse.as_ref().map(|l| to_f64_3(&l.view()));
        check_forward(
            label,
            F32_PATH,
            &to_f64_4(&out.view()).view(),
            lse.as_ref().map(|l| l.view()).as_ref(),
            &reference,
            &conditioning,
            report,
        );
    }
    if let (Ok(Ok(plain)), Ok(Ok(partial))) = (&core64, &core64_partial) {
        check_forward(
            "core f64",
            F64_PATH,
            &plain.view(),
            None,
            &reference,
            &conditioning,
            report,
        );
        check_forward(
            "core f64 partial",
            F64_PATH,
            &partial.output(),
            Some(&partial.log_sum_exp()),
            &reference,
            &conditioning,
            report,
        );
    }
}

/// No panic; every path gave the same outcome; and the one expected.
/// Returns whether every call succeeded.
fn check_outcomes(
    case: &Case,
    outcomes: &[(String, Result<Option<ErrorKind>, String>)],
    report: &mut CaseReport,
) -> bool {
    for (label, got) in outcomes {
        if let Err(panic) = got {
            report.fail(NO_PANIC, format!("{label} panicked: {panic}"));
        }
    }
    let kinds: Vec<_> = outcomes
        .iter()
        .filter_map(|(l, o)| o.as_ref().ok().map(|k| (l, k)))
        .collect();
    if kinds.windows(2).any(|w| w[0].1 != w[1].1) {
        report.fail(SAME_OUTCOME, format!("-: {kinds:?}"));
    }
    let expected = match case.expect {
        Expect::Ok => None,
        Expect::Err(kind) => Some(kind),
    };
    if let Some((label, got)) = kinds.iter().find(|(_, k)| **k != expected) {
        report.fail(
            EXPECTED,
            format!("{label}: {got:?}, expected {:?}", case.expect),
        );
    }
    outcomes.iter().all(|(_, o)| *o == Ok(None))
}

const POISON_LEAK: &str = "NaN/inf in invisible entries never reaches the fused output or lse";
const POISON_FUSED: &str = "NaN/inf in invisible entries changes no bit of the fused output or lse";
const POISON_CORE: &str = "NaN/inf in invisible entries changes no core output beyond rounding";

/// Every entry no query can see — queries that see no key, keys no query
/// sees, values of keys hidden by selection or a `−inf` bias, bias entries
/// of hidden positions — replaced by NaN or ±inf: the fused output and
/// log-sum-exp keep every bit; `core` keeps its non-finite pattern and
/// stays within rounding (its value product switches to a per-key loop
/// when a head's values are not all finite, which rounds differently).
#[test]
fn poisoning_invisible_data_changes_nothing() {
    Failures::run("poisoning_invisible_data_changes_nothing", poison_case)
        .finish("poisoning_invisible_data_changes_nothing");
}

fn poison_case(case: &Case, report: &mut CaseReport) {
    if case.expect != Expect::Ok {
        return;
    }
    let mut rng = Rng::new(case.seed ^ 0x9015_0000);
    let p = pick(&mut rng, &[0.3, 1.0]);
    let (poisoned, count) = case.poison_invisible(&mut rng, p);
    if count == 0 {
        return;
    }
    let (clean32, dirty32) = (Data::<f32>::new(case), Data::<f32>::new(&poisoned));
    let (clean64, dirty64) = (Data::<f64>::new(case), Data::<f64>::new(&poisoned));
    let conditioning = Conditioning::of(case);
    for set in available_kernel_sets() {
        let run = |data: &Data<f32>| {
            let (q, k, v) = data.qkv();
            guarded(|| {
                forced(set, || {
                    sdpa::scaled_dot_product_attention_partial(q, k, v, &case.options(data))
                })
            })
        };
        match (run(&clean32), run(&dirty32)) {
            (Ok(Ok(clean)), Ok(Ok(dirty))) => {
                let lse =
                    |p: &AttentionPartial<f32>| p.log_sum_exp().insert_axis(Axis(3)).to_owned();
                let (clean_lse, dirty_lse) = (lse(&clean), lse(&dirty));
                for (what, clean, dirty) in [
                    ("output", clean.output(), dirty.output()),
                    ("lse", clean_lse.view(), dirty_lse.view()),
                ] {
                    if let Some(at) = first_bit_difference(&dirty, &clean) {
                        report.fail(
                            POISON_FUSED,
                            format!(
                                "fused {set}: {count} entries poisoned, {what} differs at {at}"
                            ),
                        );
                    }
                    let tol = if what == "lse" {
                        conditioning.log_sum_exp(EPS32, 0.0)
                    } else {
                        conditioning.output(EPS32)
                    };
                    let leak = clean
                        .indexed_iter()
                        .zip(dirty.iter())
                        .find(|&((_, &a), &b)| {
                            a.is_finite() != b.is_finite()
                                || (a.is_finite() && (a as f64 - b as f64).abs() > tol)
                        });
                    if let Some(((index, a), b)) = leak {
                        report.fail(POISON_LEAK, format!("fused {set}: {count} entries poisoned, {what}{index:?} = {b:e}, unpoisoned {a:e}"));
                    }
                }
            }
            (Err(panic), _) | (_, Err(panic)) => {
                report.fail(NO_PANIC, format!("fused {set}: {panic}"))
            }
            (a, b) => report.fail(
                EXPECTED,
                format!("fused {set}: {:?} then {:?}", outcome(&a), outcome(&b)),
            ),
        }
    }
    let core32 = |data: &Data<f32>| {
        let (q, k, v) = data.qkv();
        guarded(|| sdpa::core::scaled_dot_product_attention(q, k, v, &case.options(data)))
    };
    let core64 = |data: &Data<f64>| {
        let (q, k, v) = data.qkv();
        guarded(|| sdpa::core::scaled_dot_product_attention(q, k, v, &case.options(data)))
    };
    let pairs = [
        (
            "core f32",
            EPS32,
            core32(&clean32).map(|r| r.map(|a| a.mapv(f64::from))),
            core32(&dirty32).map(|r| r.map(|a| a.mapv(f64::from))),
        ),
        ("core f64", EPS64, core64(&clean64), core64(&dirty64)),
    ];
    for (label, eps, clean, dirty) in pairs {
        match (clean, dirty) {
            (Ok(Ok(clean)), Ok(Ok(dirty))) => {
                let tol = conditioning.output(eps);
                let bad = clean
                    .indexed_iter()
                    .zip(dirty.iter())
                    .find(|&((_, &a), &b)| {
                        a.is_finite() != b.is_finite() || (a.is_finite() && (a - b).abs() > tol)
                    });
                if let Some(((index, a), b)) = bad {
                    report.fail(POISON_CORE, format!("{label}: {count} entries poisoned, out{index:?} = {b:e}, unpoisoned {a:e} (tolerance {tol:e})"));
                }
            }
            (Err(panic), _) | (_, Err(panic)) => report.fail(NO_PANIC, format!("{label}: {panic}")),
            (a, b) => report.fail(
                EXPECTED,
                format!("{label}: {:?} then {:?}", outcome(&a), outcome(&b)),
            ),
        }
    }
}

/// A partial call over the given keys and values (the queries fixed).
type PartialCall<'c, F> = dyn Fn(
        ArrayView4<'_, F>,
        ArrayView4<'_, F>,
        &AttentionOptions<'_, F>,
    ) -> Result<AttentionPartial<F>, AttentionError>
    + 'c;

const SHARDS: &str = "key shards merged equal the unsplit call";

/// The keys split at random cuts, each shard's partial computed with
/// `key_shard` (composed with the case's own shard), merged in order or in
/// reverse: the unsplit call's output and log-sum-exp, within twice the
/// forward tolerance, with the same non-finite entries. On the fused path
/// (every kernel set) and on `core` in `f64`. Cases whose `f32` scores may
/// overflow are skipped: there the split changes which partial overflows.
#[test]
fn key_shards_merge_to_the_unsplit_call() {
    Failures::run("key_shards_merge_to_the_unsplit_call", shard_case)
        .finish("key_shards_merge_to_the_unsplit_call");
}

fn shard_case(case: &Case, report: &mut CaseReport) {
    let conditioning = Conditioning::of(case);
    if case.expect != Expect::Ok || conditioning.overflow_risk {
        return;
    }
    let mut rng = Rng::new(case.seed ^ 0x54a2_d000);
    let len_kv = case.len_kv();
    let mut bounds: Vec<usize> = (0..rng.below(4)).map(|_| rng.below(len_kv + 1)).collect();
    bounds.push(0);
    bounds.push(len_kv);
    bounds.sort_unstable();
    let reverse = rng.chance(0.5);
    let (offset, total) = case.shard();
    let ambiguous = oracle(case, &case.visibility()).ambiguous;
    let exact_pattern = conditioning.underflow_free;

    fn split<F: Element>(
        case: &Case,
        data: &Data<F>,
        bounds: &[usize],
        reverse: bool,
        (offset, total): (usize, usize),
        call: &PartialCall<'_, F>,
    ) -> Result<(AttentionPartial<F>, AttentionPartial<F>), AttentionError> {
        let (k, v) = (data.k.view(), data.v.view());
        let opts = case.options(data);
        let whole = call(k, v, &opts)?;
        let mut parts = bounds
            .windows(2)
            .map(|w| {
                let keys = s![.., .., w[0]..w[1], ..];
                call(
                    k.slice(keys),
                    v.slice(keys),
                    &opts.clone().key_shard(offset + w[0], total),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        if reverse {
            parts.reverse();
        }
        Ok((whole, AttentionPartial::merge_all(parts)?))
    }

    let compare = |report: &mut CaseReport,
                   label: String,
                   eps: f64,
                   whole: (Array4<f64>, Array3<f64>),
                   merged: (Array4<f64>, Array3<f64>)| {
        let tol = 2.0 * conditioning.output(eps);
        for ((b, h, i), &amb) in ambiguous.indexed_iter() {
            let (whole_row, merged_row) = (
                whole.0.slice(s![b, h, i, ..]),
                merged.0.slice(s![b, h, i, ..]),
            );
            let rows = whole_row
                .iter()
                .copied()
                .chain([whole.1[[b, h, i]]])
                .zip(merged_row.iter().copied().chain([merged.1[[b, h, i]]]));
            for (n, (w, m)) in rows.enumerate() {
                let is_lse = n == case.v.shape[3];
                let tol = if is_lse {
                    2.0 * conditioning.log_sum_exp(eps, w)
                } else {
                    tol
                };
                let bad = if w.is_finite() && m.is_finite() {
                    (w - m).abs() > tol
                } else {
                    w.is_finite() != m.is_finite() && !amb && exact_pattern
                        || (w == f64::NEG_INFINITY) != (m == f64::NEG_INFINITY) && is_lse && !amb
                };
                if bad {
                    let what = if is_lse {
                        "lse".to_string()
                    } else {
                        format!("out column {n}")
                    };
                    report.fail(SHARDS, format!("{label}: cuts {bounds:?}{}: row [{b}, {h}, {i}] {what}: merged {m:e}, unsplit {w:e} (tolerance {tol:e})", if reverse { " merged in reverse" } else { "" }));
                }
            }
        }
    };

    let d32 = Data::<f32>::new(case);
    let q = d32.q.view();
    for set in available_kernel_sets() {
        let call =
            |k: ArrayView4<'_, f32>, v: ArrayView4<'_, f32>, o: &AttentionOptions<'_, f32>| {
                forced(set, || {
                    sdpa::scaled_dot_product_attention_partial(q, k, v, o)
                })
            };
        match guarded(|| split(case, &d32, &bounds, reverse, (offset, total), &call)) {
            Ok(Ok((whole, merged))) => {
                let f = |p: AttentionPartial<f32>| {
                    let (o, l) = p.into_parts();
                    (o.mapv(f64::from), l.mapv(f64::from))
                };
                compare(report, format!("fused {set}"), EPS32, f(whole), f(merged));
            }
            Ok(Err(e)) => report.fail(EXPECTED, format!("fused {set}: {e}")),
            Err(panic) => report.fail(NO_PANIC, format!("fused {set}: {panic}")),
        }
    }
    let d64 = Data::<f64>::new(case);
    let q = d64.q.view();
    let call = |k: ArrayView4<'_, f64>, v: ArrayView4<'_, f64>, o: &AttentionOptions<'_, f64>| {
        sdpa::scaled_dot_product_attention_partial(q, k, v, o)
    };
    match guarded(|| split(case, &d64, &bounds, reverse, (offset, total), &call)) {
        Ok(Ok((whole, merged))) => compare(
            report,
            "core f64".into(),
            EPS64,
            whole.into_parts(),
            merged.into_parts(),
        ),
        Ok(Err(e)) => report.fail(EXPECTED, format!("core f64: {e}")),
        Err(panic) => report.fail(NO_PANIC, format!("core f64: {panic}")),
    }
}

const BACKWARD_CLOSE: &str = "fused backward within tolerance of the f64 reference";
const BACKWARD_ZERO: &str = "hidden queries, keys and bias entries get exactly zero gradients";
const BACKWARD_GARBAGE: &str =
    "a backward from any forward partial (garbage lse) neither panics nor fails";

/// The fused backward (every kernel set, from its own forward) against
/// `core`'s in `f64`, when the inputs are finite where seen and moderate
/// (q, k, v of magnitude at most 1, finite bias at most 10, scores that
/// span at most 40, no overflow). Invisible entries may hold NaN/inf.
/// Hidden queries, keys and bias entries get exactly zero gradients. A
/// backward given a made-up forward partial (say a log-sum-exp of −1e30)
/// must not panic.
#[test]
fn backward_matches_the_f64_reference() {
    Failures::run("backward_matches_the_f64_reference", backward_case)
        .finish("backward_matches_the_f64_reference");
}

fn backward_case(case: &Case, report: &mut CaseReport) {
    let c = Conditioning::of(case);
    if case.expect != Expect::Ok {
        return;
    }
    let mut rng = Rng::new(case.seed ^ 0xbac4_0000);
    garbage_backward(case, &mut rng, report);
    if !case.visible_poison.is_empty()
        || !case.moderate
        || c.bias_bound > 10.0
        || c.score_bound + c.bias_bound > 20.0
    {
        return;
    }
    let case = &if rng.chance(0.5) {
        case.poison_invisible(&mut rng, 1.0).0
    } else {
        case.clone()
    };
    let vis = case.visibility();
    let d32 = Data::<f32>::new(case);
    let d64 = Data::<f64>::new(case);
    let (o32, o64) = (case.options(&d32), case.options(&d64));
    let (q64, k64, v64) = d64.qkv();
    let expected = match guarded(|| {
        let forward = sdpa::scaled_dot_product_attention_partial(q64, k64, v64, &o64)?;
        sdpa::core::scaled_dot_product_attention_backward(
            q64,
            k64,
            v64,
            &o64,
            &forward,
            d64.d_out.view(),
        )
    }) {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => return report.fail(EXPECTED, format!("core f64 backward: {e}")),
        Err(panic) => return report.fail(NO_PANIC, format!("core f64 backward: {panic}")),
    };
    check_zero_gradients(
        "core f64",
        case,
        &vis,
        [&expected.d_q, &expected.d_k, &expected.d_v],
        expected.d_bias.as_ref(),
        report,
    );
    let (q, k, v) = d32.qkv();
    for set in available_kernel_sets() {
        let got = match guarded(|| {
            forced(set, || {
                let forward = sdpa::scaled_dot_product_attention_partial(q, k, v, &o32)?;
                sdpa::scaled_dot_product_attention_backward(
                    q,
                    k,
                    v,
                    &o32,
                    &forward,
                    d32.d_out.view(),
                )
            })
        }) {
            Ok(Ok(g)) => g,
            Ok(Err(e)) => {
                report.fail(EXPECTED, format!("fused {set} backward: {e}"));
                continue;
            }
            Err(panic) => {
                report.fail(NO_PANIC, format!("fused {set} backward: {panic}"));
                continue;
            }
        };
        let to64 = |a: &Array4<f32>| a.mapv(f64::from);
        check_zero_gradients(
            &format!("fused {set}"),
            case,
            &vis,
            [&to64(&got.d_q), &to64(&got.d_k), &to64(&got.d_v)],
            got.d_bias.as_ref().map(to64).as_ref(),
            report,
        );
        let mut pairs = vec![
            ("d_q", to64(&got.d_q), &expected.d_q),
            ("d_k", to64(&got.d_k), &expected.d_k),
            ("d_v", to64(&got.d_v), &expected.d_v),
        ];
        match (&got.d_bias, &expected.d_bias) {
            (Some(g), Some(e)) => pairs.push(("d_bias", to64(g), e)),
            (None, None) => {}
            _ => report.fail(
                BACKWARD_CLOSE,
                format!("fused {set}: d_bias present in one result only"),
            ),
        }
        for (name, g, e) in pairs {
            let scale = 1.0 + e.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let tol = scale * (2e-5 + 4.0 * c.score_error(EPS32));
            if let Some(((index, &g), &e)) = g
                .indexed_iter()
                .zip(e.iter())
                .find(|&((_, &g), &e)| !(g.is_finite() && (g - e).abs() <= tol))
            {
                report.fail(BACKWARD_CLOSE, format!("fused {set}: {name}{index:?} = {g:e}, f64 reference {e:e} (tolerance {tol:e})"));
            }
        }
    }
}

/// Gradients that must be exactly zero: `d_q` of queries with no live key,
/// `d_k`/`d_v` of keys live for no query, `d_bias` entries of positions
/// that are not live.
fn check_zero_gradients(
    label: &str,
    case: &Case,
    vis: &Visibility,
    [d_q, d_k, d_v]: [&Array4<f64>; 3],
    d_bias: Option<&Array4<f64>>,
    report: &mut CaseReport,
) {
    let mut fail = |what: String| report.fail(BACKWARD_ZERO, format!("{label}: {what}"));
    for ((b, h, i), &lives) in vis.row_lives.indexed_iter() {
        if !lives && d_q.slice(s![b, h, i, ..]).iter().any(|&x| x != 0.0) {
            fail(format!(
                "d_q[{b}, {h}, {i}, ..] = {} for a query with no live key",
                d_q.slice(s![b, h, i, ..])
            ));
        }
    }
    for ((b, g, j), &lives) in vis.key_lives.indexed_iter() {
        for (name, grad) in [("d_k", d_k), ("d_v", d_v)] {
            if !lives && grad.slice(s![b, g, j, ..]).iter().any(|&x| x != 0.0) {
                fail(format!(
                    "{name}[{b}, {g}, {j}, ..] = {} for a key live for no query",
                    grad.slice(s![b, g, j, ..])
                ));
            }
        }
    }
    if let (Some(d_bias), Some(bias)) = (d_bias, &case.bias) {
        let (offset, _) = case.shard();
        let mut touched = Array4::from_elem(d_bias.raw_dim(), false);
        for ((b, h, i, j), &live) in vis.live.indexed_iter() {
            if live {
                let pos = [b, h, i, offset + j];
                let index: [usize; 4] =
                    std::array::from_fn(|a| if bias.shape[a] == 1 { 0 } else { pos[a] });
                touched[index] = true;
            }
        }
        if let Some((index, x)) = d_bias
            .indexed_iter()
            .zip(&touched)
            .find_map(|((index, &x), &t)| (!t && x != 0.0).then_some((index, x)))
        {
            fail(format!(
                "d_bias{index:?} = {x:e} for a position live for no query"
            ));
        }
    }
}

/// A backward given a forward partial made up from arbitrary numbers: it
/// must return `Ok` (the shapes are right) without panicking, on every path.
fn garbage_backward(case: &Case, rng: &mut Rng, report: &mut CaseReport) {
    let out_shape = case.out_shape();
    let lse_values = [
        f32::NEG_INFINITY,
        f32::INFINITY,
        f32::NAN,
        -1e30,
        1e30,
        -100.0,
        0.0,
        3.0,
    ];
    let lse = Array3::from_shape_simple_fn((out_shape[0], out_shape[1], out_shape[2]), || {
        pick(rng, &lse_values)
    });
    let out = Array4::from_shape_simple_fn(out_shape, || pick(rng, &[0.0f32, 1.0, -2.5, f32::NAN]));
    let Ok(partial) = AttentionPartial::from_parts(out, lse) else {
        return report.fail(
            BACKWARD_GARBAGE,
            "from_parts refused arrays of the right shapes".into(),
        );
    };
    let d32 = Data::<f32>::new(case);
    let opts = case.options(&d32);
    let (q, k, v) = d32.qkv();
    let mut calls: Vec<(String, Called<sdpa::AttentionGradients<f32>>)> = available_kernel_sets()
        .into_iter()
        .map(|set| {
            (
                format!("fused {set}"),
                guarded(|| {
                    forced(set, || {
                        sdpa::scaled_dot_product_attention_backward(
                            q,
                            k,
                            v,
                            &opts,
                            &partial,
                            d32.d_out.view(),
                        )
                    })
                }),
            )
        })
        .collect();
    calls.push((
        "core f32".into(),
        guarded(|| {
            sdpa::core::scaled_dot_product_attention_backward(
                q,
                k,
                v,
                &opts,
                &partial,
                d32.d_out.view(),
            )
        }),
    ));
    // Merging made-up partials must not panic either.
    let mut merged = partial.clone();
    if let Err(panic) = guarded(|| merged.merge(&partial)) {
        report.fail(BACKWARD_GARBAGE, format!("merge panicked: {panic}"));
    }
    for (label, called) in calls {
        match called {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => report.fail(BACKWARD_GARBAGE, format!("{label}: {e}")),
            Err(panic) => report.fail(BACKWARD_GARBAGE, format!("{label} panicked: {panic}")),
        }
    }
}

// ---------------------------------------------------------------------------
// Huge shapes, each in a child process (an abort would end this one)
// ---------------------------------------------------------------------------

const HUGE_CHILD: &str = "SDPA_FUZZ_HUGE_CASE";

/// Shapes whose output cannot be allocated, reached through zero strides
/// (so the inputs are tiny): `len_q`, batch, heads or `d_v` of 2^60 (an
/// output of 2^62 bytes or more: no machine maps that) or 2^62 (past
/// `isize::MAX` bytes), and `attention_weights` of 2^30 × 2^30. Every path
/// must return the same `Err`: never panic, never abort the process.
const HUGE_CASES: &[(&str, [usize; 4], [usize; 4], usize)] = &[
    // (name, q shape, k shape, d_v); v is k's shape with d_v columns.
    (
        "len_q = 2^62, d_v = 2: 2^63 output elements",
        [1, 1, 1 << 62, 1],
        [1, 1, 3, 1],
        2,
    ),
    (
        "len_q = 2^60, d_v = 1: 2^62 bytes",
        [1, 1, 1 << 60, 1],
        [1, 1, 3, 1],
        1,
    ),
    ("batch = 2^60", [1 << 60, 1, 1, 1], [1 << 60, 1, 3, 1], 1),
    (
        "heads = 2^60 over one kv head",
        [1, 1 << 60, 1, 1],
        [1, 1, 3, 1],
        1,
    ),
    ("d_v = 2^62, len_q = 2", [1, 1, 2, 4], [1, 1, 1, 4], 1 << 62),
    (
        "attention_weights of 2^30 × 2^30",
        [1, 1, 1 << 30, 1],
        [1, 1, 1 << 30, 1],
        1,
    ),
];

#[test]
fn huge_shapes_give_errors_not_panics_or_aborts() {
    if let Some(index) = env_u64(HUGE_CHILD) {
        return huge_case(index as usize);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut failures = Vec::new();
    for (index, (name, ..)) in HUGE_CASES.iter().enumerate() {
        let mut child = std::process::Command::new(&exe)
            .args([
                "huge_shapes_give_errors_not_panics_or_aborts",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HUGE_CHILD, index.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the test binary runs");
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for the child") {
                break Some(status);
            }
            if start.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let output = child.wait_with_output().expect("the child's output");
        match status {
            Some(status) if status.success() => {}
            status => {
                let stderr = String::from_utf8_lossy(&output.stderr);
                let stdout = String::from_utf8_lossy(&output.stdout);
                let said: Vec<&str> = stdout
                    .lines()
                    .chain(stderr.lines())
                    .filter(|l| {
                        l.contains("huge:") || l.contains("panicked") || l.contains("memory")
                    })
                    .collect();
                failures.push(format!(
                    "{name}: {}: {}",
                    status.map_or("still running after 60 s".to_string(), |s| s.to_string()),
                    said.join(" | ")
                ));
            }
        }
    }
    assert!(failures.is_empty(), "huge shapes:\n{}", failures.join("\n"));
}

fn huge_case(index: usize) {
    let (name, q_shape, k_shape, d_v) = HUGE_CASES[index];
    let (q, k) = (
        Array4::<f32>::ones([1, 1, 1, q_shape[3]]),
        Array4::<f32>::ones([1, 1, 1, k_shape[3]]),
    );
    let v = Array4::<f32>::ones([1, 1, 1, 1]);
    let v_shape = [k_shape[0], k_shape[1], k_shape[2], d_v];
    let (q32, k32, v32) = (
        q.broadcast(q_shape).unwrap(),
        k.broadcast(k_shape).unwrap(),
        v.broadcast(v_shape).unwrap(),
    );
    let (q64, k64, v64) = (q.mapv(f64::from), k.mapv(f64::from), v.mapv(f64::from));
    let (q64, k64, v64) = (
        q64.broadcast(q_shape).unwrap(),
        k64.broadcast(k_shape).unwrap(),
        v64.broadcast(v_shape).unwrap(),
    );
    let (o32, o64) = (
        AttentionOptions::<f32>::new(),
        AttentionOptions::<f64>::new(),
    );
    let mut outcomes: Vec<(String, Result<Option<ErrorKind>, String>)> = Vec::new();
    let weights = name.starts_with("attention_weights");
    for set in available_kernel_sets() {
        if !weights {
            println!("huge: {name}: fused {set}");
            outcomes.push((
                format!("fused {set}"),
                outcome(&guarded(|| {
                    forced(set, || {
                        sdpa::scaled_dot_product_attention(q32, k32, v32, &o32)
                    })
                })),
            ));
            outcomes.push((
                format!("fused {set} partial"),
                outcome(&guarded(|| {
                    forced(set, || {
                        sdpa::scaled_dot_product_attention_partial(q32, k32, v32, &o32)
                    })
                })),
            ));
        }
    }
    println!("huge: {name}: core");
    if weights {
        outcomes.push((
            "core f32 attention_weights".into(),
            outcome(&guarded(|| sdpa::core::attention_weights(q32, k32, &o32))),
        ));
        outcomes.push((
            "core f64 attention_weights".into(),
            outcome(&guarded(|| sdpa::core::attention_weights(q64, k64, &o64))),
        ));
    } else {
        outcomes.push((
            "core f32".into(),
            outcome(&guarded(|| {
                sdpa::core::scaled_dot_product_attention(q32, k32, v32, &o32)
            })),
        ));
        outcomes.push((
            "core f64".into(),
            outcome(&guarded(|| {
                sdpa::core::scaled_dot_product_attention(q64, k64, v64, &o64)
            })),
        ));
    }
    println!("huge: {name}: {outcomes:?}");
    let panics: Vec<_> = outcomes.iter().filter(|(_, o)| o.is_err()).collect();
    assert!(panics.is_empty(), "huge: {name}: panics {panics:?}");
    assert!(
        outcomes.iter().all(|(_, o)| matches!(o, Ok(Some(_)))),
        "huge: {name}: not every path returned Err: {outcomes:?}"
    );
    assert!(
        outcomes.windows(2).all(|w| w[0].1 == w[1].1),
        "huge: {name}: kinds differ: {outcomes:?}"
    );
}
