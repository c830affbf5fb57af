//! A fuzz test that stays (issue 9): random shapes, options (the score
//! modifiers of issue 12 among them: ALiBi, sinks, softcap), strides,
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
//! SDPA_FUZZ_REPLAY=0x5eed0000000003a cargo test --test integration -- --exact fuzz::forward::forward --nocapture
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
use sdpa::simd::available_kernel_sets;
use sdpa::{
    AttentionError, AttentionOptions, AttentionPartial, CausalAlignment, Element, ErrorKind,
};

use crate::common::{Engine, Rng, cast, engines};

mod backward;
mod case;
mod forward;
mod huge;
mod oracle;
mod poison;
mod runner;
mod shards;
mod strided;

use case::*;
use forward::*;
use oracle::*;
use runner::*;
use strided::*;

/// Cases per test under a plain `cargo test`: about a second each in the
/// test profile on one core.
const DEFAULT_CASES: u64 = 120;
const DEFAULT_SEED: u64 = 0x5eed_0000_0000_0000;

const EPS32: f64 = f32::EPSILON as f64;
const EPS64: f64 = f64::EPSILON;

/// A bound on the work of one forward call, `batch·heads·len_q·len_kv·(d_k
/// + d_v)`, so a case stays in the milliseconds.
const WORK_BUDGET: usize = 1_500_000;
