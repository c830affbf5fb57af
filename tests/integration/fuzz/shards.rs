//! Key shards merged equal the unsplit call.

use super::*;

/// A partial call over the given keys and values (the queries fixed).
pub(super) type PartialCall<'c, F> = dyn Fn(
        ArrayView4<'_, F>,
        ArrayView4<'_, F>,
        &AttentionOptions<'_, F>,
    ) -> Result<AttentionPartial<F>, AttentionError>
    + 'c;

pub(super) const SHARDS: &str = "key shards merged equal the unsplit call";

/// The keys split at random cuts, each shard's partial computed with
/// `key_shard` (composed with the case's own shard), merged in order or in
/// reverse: the unsplit call's output and log-sum-exp, within twice the
/// forward tolerance, with the same non-finite entries. On the fused path
/// (every kernel set) and on `core` in `f64`. Cases whose `f32` scores may
/// overflow are skipped: there the split changes which partial overflows.
#[test]
pub(super) fn key_shards_merge_to_the_unsplit_call() {
    Failures::run(
        "fuzz::shards::key_shards_merge_to_the_unsplit_call",
        shard_case,
    )
    .finish();
}

pub(super) fn shard_case(case: &Case, report: &mut CaseReport) {
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
    let (offset, total) = case.shard();
    // With no keys at all, every empty shard at offset 0 counts the sink
    // (which of them holds key 0 cannot be told): keep one.
    if case.sinks.is_some() && total == 0 {
        bounds = vec![0, 0];
    }
    let reverse = rng.chance(0.5);
    let ambiguous = oracle(case, &case.visibility()).ambiguous;
    let exact_pattern = conditioning.underflow_free;

    pub(super) fn split<F: Element>(
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
                   path: PathKind,
                   whole: (Array4<f64>, Array3<f64>),
                   merged: (Array4<f64>, Array3<f64>)| {
        let tol = 2.0 * path.output_tolerance(&conditioning);
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
                    2.0 * path.lse_tolerance(&conditioning, w)
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
                compare(
                    report,
                    format!("fused {set}"),
                    F32_PATH,
                    f(whole),
                    f(merged),
                );
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
            F64_PATH,
            whole.into_parts(),
            merged.into_parts(),
        ),
        Ok(Err(e)) => report.fail(EXPECTED, format!("core f64: {e}")),
        Err(panic) => report.fail(NO_PANIC, format!("core f64: {panic}")),
    }
}
