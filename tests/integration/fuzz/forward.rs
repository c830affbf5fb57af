//! Forward calls on every path against the oracle and each other.

use super::*;

pub(super) const NO_PANIC: &str = "no panic";
pub(super) const SAME_OUTCOME: &str = "the same Ok/Err and ErrorKind on every path";
pub(super) const EXPECTED: &str = "the Ok or ErrorKind the README promises";
pub(super) const BITWISE_INTO: &str = "`_into` and `_partial` give the bits of the plain call";

/// Forward calls on every path: the same `Ok`/`Err`, never a panic, and
/// against the oracle: non-finite only where explained, no NaN swallowed,
/// zeros only for rows that see nothing, within tolerance.
#[test]
pub(super) fn forward() {
    Failures::run("fuzz::forward::forward", forward_case).finish();
}

pub(super) fn forward_case(case: &Case, report: &mut CaseReport) {
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
    for set in engines() {
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
pub(super) fn check_outcomes(
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
