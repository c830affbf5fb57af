//! Running cases and collecting failures: each case under `catch_unwind`,
//! failures grouped by property with the smallest cases kept for replay.

use super::*;

pub(super) fn env_u64(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    let text = text.trim();
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16).ok(),
        None => text.replace('_', "").parse().ok(),
    }
}

/// The seeds of the cases to run.
pub(super) fn case_seeds() -> Vec<u64> {
    if let Some(seed) = env_u64("SDPA_FUZZ_REPLAY") {
        return vec![seed];
    }
    let cases = env_u64("SDPA_FUZZ_CASES").unwrap_or(DEFAULT_CASES);
    let first = env_u64("SDPA_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    (0..cases).map(|n| first.wrapping_add(n)).collect()
}

/// One failed property in one case.
pub(super) struct Failure {
    pub(super) seed: u64,
    pub(super) size: usize,
    pub(super) case: String,
    pub(super) message: String,
}

/// The cases that failed one property: how many, how many on each path,
/// and the two smallest.
#[derive(Default)]
pub(super) struct PropertyFailures {
    pub(super) cases: usize,
    pub(super) by_path: BTreeMap<String, usize>,
    pub(super) smallest: Vec<Failure>,
}

/// The failures of one test, by property: how many cases, on which paths,
/// and the two smallest.
#[derive(Default)]
pub(super) struct Failures {
    /// The test's path in the binary, `fuzz::forward::forward`.
    pub(super) test: &'static str,
    pub(super) cases: usize,
    pub(super) by_property: BTreeMap<&'static str, PropertyFailures>,
}

impl Failures {
    /// Runs `check` on every case, each under `catch_unwind`.
    pub(super) fn run(test: &'static str, check: impl Fn(&Case, &mut CaseReport)) -> Self {
        let mut failures = Failures {
            test,
            ..Failures::default()
        };
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

    pub(super) fn add(&mut self, case: &Case, report: CaseReport) {
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
    pub(super) fn finish(self) {
        let test = self.test;
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
                    "  - seed {:#x}: {}\n    {}\n    replay: SDPA_FUZZ_REPLAY={:#x} cargo test --test integration -- --exact {test} --nocapture\n",
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
pub(super) struct CaseReport {
    pub(super) failed: Vec<(&'static str, String, std::collections::BTreeSet<String>)>,
}

impl CaseReport {
    pub(super) fn fail(&mut self, property: &'static str, message: String) {
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
pub(super) fn guarded<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with a non-string payload".to_string())
    })
}

/// What a guarded call gave: a panic (outer `Err`), or the call's result.
pub(super) type Called<T> = Result<Result<T, AttentionError>, String>;

/// `Ok(None)` for `Ok`, `Ok(Some(kind))` for an error, `Err` for a panic.
pub(super) fn outcome<T>(called: &Called<T>) -> Result<Option<ErrorKind>, String> {
    match called {
        Ok(Ok(_)) => Ok(None),
        Ok(Err(e)) => Ok(Some(e.kind())),
        Err(panic) => Err(panic.clone()),
    }
}

/// Runs `f` with kernel set `set` (and its AMX choice, for an [`Engine`])
/// forced on this thread.
pub(super) fn forced<R>(
    set: impl Into<Engine>,
    f: impl FnOnce() -> Result<R, AttentionError>,
) -> Result<R, AttentionError> {
    set.into().run(f).and_then(|r| r)
}

pub(super) fn pick<T: Copy>(rng: &mut Rng, items: &[T]) -> T {
    items[rng.below(items.len())]
}
