//! NaN/inf in entries no query can see changes nothing.

use super::*;

pub(super) const POISON_LEAK: &str =
    "NaN/inf in invisible entries never reaches the fused output or lse";
pub(super) const POISON_FUSED: &str =
    "NaN/inf in invisible entries changes no bit of the fused output or lse";
pub(super) const POISON_CORE: &str =
    "NaN/inf in invisible entries changes no core output beyond rounding";

/// Every entry no query can see — queries that see no key, keys no query
/// sees, values of keys hidden by selection or a `−inf` bias, bias entries
/// of hidden positions — replaced by NaN or ±inf: the fused output and
/// log-sum-exp keep every bit; `core` keeps its non-finite pattern and
/// stays within rounding (its value product switches to a per-key loop
/// when a head's values are not all finite, which rounds differently).
#[test]
pub(super) fn poisoning_invisible_data_changes_nothing() {
    Failures::run(
        "fuzz::poison::poisoning_invisible_data_changes_nothing",
        poison_case,
    )
    .finish();
}

pub(super) fn poison_case(case: &Case, report: &mut CaseReport) {
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
    for set in engines() {
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
