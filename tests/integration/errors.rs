//! Bad input gives `Err(AttentionError)` naming the argument and the shapes,
//! never a panic: one test per case listed in DESIGN.md, run through every
//! entry point (`sdpa::` and `sdpa::core::`, allocating and `_into`) in
//! `f32` and `f64`. Empty `len_q` / `len_kv` are valid.

use crate::common;

use ndarray::Array4;
use proptest::prelude::*;
use sdpa::{AttentionError, AttentionOptions, Element, ErrorKind};

/// The shapes and options of one call; arrays are built from it per type.
#[derive(Debug, Clone)]
struct Case {
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    keep_mask: Option<[usize; 4]>,
    bias: Option<[usize; 4]>,
    key_lengths: Option<Vec<usize>>,
    scale: Option<f64>,
    causal: bool,
    window: Option<usize>,
}

/// The base of every case: batch 2, heads 4, kv_heads 2 (GQA), len_q 3,
/// len_kv 5, d_k 4, d_v 6. Valid as it stands.
fn valid() -> Case {
    Case {
        q: [2, 4, 3, 4],
        k: [2, 2, 5, 4],
        v: [2, 2, 5, 6],
        keep_mask: None,
        bias: None,
        key_lengths: None,
        scale: None,
        causal: false,
        window: None,
    }
}

/// `[batch, heads, len_q, len_kv]` of [`valid`].
const SCORES: [usize; 4] = [2, 4, 3, 5];

/// How a shape appears in messages.
fn shape(s: [usize; 4]) -> String {
    format!("{s:?}")
}

impl Case {
    fn out_shape(&self) -> [usize; 4] {
        [self.q[0], self.q[1], self.q[2], self.v[3]]
    }

    /// Runs the case through every attention entry point in `F`; `_into`
    /// calls get an `out` of `out_shape` (the right one when `None`).
    /// Returns each entry point's name and result.
    fn run<F: Element>(
        &self,
        out_shape: Option<[usize; 4]>,
    ) -> Vec<(&'static str, Result<(), AttentionError>)> {
        let q = Array4::<F>::ones(self.q);
        let k = Array4::<F>::ones(self.k);
        let v = Array4::<F>::ones(self.v);
        let mask = self.keep_mask.map(|s| Array4::from_elem(s, true));
        let bias = self.bias.map(Array4::<F>::zeros);
        let mut opts = AttentionOptions::new();
        if self.causal {
            opts = opts.causal();
        }
        if let Some(mask) = &mask {
            opts = opts.keep_mask(mask.view());
        }
        if let Some(bias) = &bias {
            opts = opts.bias(bias.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(common::cast(scale));
        }
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        let out_shape = out_shape.unwrap_or(self.out_shape());
        let sentinel: F = common::cast(7.0);
        let mut out = Array4::from_elem(out_shape, sentinel);
        let mut core_out = Array4::from_elem(out_shape, sentinel);
        let results = vec![
            (
                "sdpa::scaled_dot_product_attention",
                sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).map(drop),
            ),
            (
                "sdpa::scaled_dot_product_attention_into",
                sdpa::scaled_dot_product_attention_into(
                    q.view(),
                    k.view(),
                    v.view(),
                    &opts,
                    out.view_mut(),
                ),
            ),
            (
                "sdpa::core::scaled_dot_product_attention",
                sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts)
                    .map(drop),
            ),
            (
                "sdpa::core::scaled_dot_product_attention_into",
                sdpa::core::scaled_dot_product_attention_into(
                    q.view(),
                    k.view(),
                    v.view(),
                    &opts,
                    core_out.view_mut(),
                ),
            ),
        ];
        // An `_into` call that fails must not have written to `out`.
        for ((entry, result), out) in [(&results[1], &out), (&results[3], &core_out)] {
            if result.is_err() {
                assert!(
                    out.iter().all(|&x| x == sentinel),
                    "{entry}: a failed call wrote to out"
                );
            }
        }
        results
    }

    /// `sdpa::core::attention_weights` on the case (`v` is not involved).
    fn weights<F: Element>(&self) -> Result<(), AttentionError> {
        let q = Array4::<F>::ones(self.q);
        let k = Array4::<F>::ones(self.k);
        let mask = self.keep_mask.map(|s| Array4::from_elem(s, true));
        let bias = self.bias.map(Array4::<F>::zeros);
        let mut opts = AttentionOptions::new();
        if let Some(mask) = &mask {
            opts = opts.keep_mask(mask.view());
        }
        if let Some(bias) = &bias {
            opts = opts.bias(bias.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(common::cast(scale));
        }
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        sdpa::core::attention_weights(q.view(), k.view(), &opts).map(drop)
    }
}

#[track_caller]
fn check_error(
    type_name: &str,
    entry: &str,
    result: Result<(), AttentionError>,
    kind: ErrorKind,
    needles: &[&str],
) {
    let err = match result {
        Ok(()) => panic!("{entry} ({type_name}) accepted bad input; expected {kind:?}"),
        Err(err) => err,
    };
    assert_eq!(
        err.kind(),
        kind,
        "{entry} ({type_name}): wrong kind for `{err}`"
    );
    let message = err.to_string();
    assert_eq!(message, err.message(), "Display is the message");
    for needle in needles {
        assert!(
            message.contains(needle),
            "{entry} ({type_name}): message `{message}` does not mention `{needle}`"
        );
    }
}

/// Every entry point, in `f32` and `f64`, fails with `kind` and a message
/// containing each of `needles`. `weights`: whether
/// `core::attention_weights` sees the defect too (it does not read `v`).
#[track_caller]
fn expect_error_in<F: Element>(case: &Case, kind: ErrorKind, needles: &[&str], weights: bool) {
    let type_name = std::any::type_name::<F>();
    for (entry, result) in case.run::<F>(None) {
        check_error(type_name, entry, result, kind, needles);
    }
    if weights {
        check_error(
            type_name,
            "sdpa::core::attention_weights",
            case.weights::<F>(),
            kind,
            needles,
        );
    } else {
        assert!(
            case.weights::<F>().is_ok(),
            "attention_weights ({type_name}) does not read v and should accept {case:?}"
        );
    }
}

#[track_caller]
fn expect_error(case: Case, kind: ErrorKind, needles: &[&str]) {
    expect_error_in::<f32>(&case, kind, needles, true);
    expect_error_in::<f64>(&case, kind, needles, true);
}

/// As [`expect_error`] for a defect in `v` only.
#[track_caller]
fn expect_error_in_v(case: Case, kind: ErrorKind, needles: &[&str]) {
    expect_error_in::<f32>(&case, kind, needles, false);
    expect_error_in::<f64>(&case, kind, needles, false);
}

#[track_caller]
fn expect_ok_in<F: Element>(case: &Case) {
    for (entry, result) in case.run::<F>(None) {
        if let Err(err) = result {
            panic!(
                "{entry} ({}) rejected {case:?}: {err}",
                std::any::type_name::<F>()
            );
        }
    }
    case.weights::<F>()
        .expect("attention_weights accepts the case");
}

#[track_caller]
fn expect_ok(case: Case) {
    expect_ok_in::<f32>(&case);
    expect_ok_in::<f64>(&case);
}

#[test]
fn the_base_case_is_valid() {
    expect_ok(valid());
    expect_ok(Case {
        keep_mask: Some(SCORES),
        bias: Some(SCORES),
        key_lengths: Some(vec![5, 0]),
        scale: Some(0.5),
        causal: true,
        ..valid()
    });
}

#[test]
fn batch_of_k_differs_from_q() {
    let case = Case {
        k: [3, 2, 5, 4],
        ..valid()
    };
    let needles = ["batch", &shape(case.q), &shape(case.k)];
    expect_error(case.clone(), ErrorKind::ShapeMismatch, &needles);
}

#[test]
fn batch_of_v_differs_from_q() {
    let case = Case {
        v: [1, 2, 5, 6],
        ..valid()
    };
    let needles = ["batch", &shape(case.q), &shape(case.v)];
    expect_error_in_v(case.clone(), ErrorKind::ShapeMismatch, &needles);
}

#[test]
fn d_k_of_k_differs_from_q() {
    let case = Case {
        k: [2, 2, 5, 3],
        ..valid()
    };
    let needles = ["d_k", &shape(case.q), &shape(case.k)];
    expect_error(case.clone(), ErrorKind::ShapeMismatch, &needles);
}

#[test]
fn d_k_zero() {
    let case = Case {
        q: [2, 4, 3, 0],
        k: [2, 2, 5, 0],
        ..valid()
    };
    let needles = ["d_k", &shape(case.q), &shape(case.k)];
    expect_error(case.clone(), ErrorKind::ZeroDimension, &needles);
}

#[test]
fn kv_heads_of_k_and_v_differ() {
    let case = Case {
        v: [2, 1, 5, 6],
        ..valid()
    };
    let needles = ["kv_heads", &shape(case.k), &shape(case.v)];
    expect_error_in_v(case.clone(), ErrorKind::ShapeMismatch, &needles);
}

#[test]
fn len_kv_of_k_and_v_differ() {
    let case = Case {
        v: [2, 2, 4, 6],
        ..valid()
    };
    let needles = ["len_kv", &shape(case.k), &shape(case.v)];
    expect_error_in_v(case.clone(), ErrorKind::ShapeMismatch, &needles);
}

#[test]
fn heads_zero() {
    let case = Case {
        q: [2, 0, 3, 4],
        ..valid()
    };
    let needles = ["heads", &shape(case.q)];
    expect_error(case.clone(), ErrorKind::ZeroDimension, &needles);
}

#[test]
fn kv_heads_zero() {
    let case = Case {
        k: [2, 0, 5, 4],
        v: [2, 0, 5, 6],
        ..valid()
    };
    let needles = ["kv_heads", &shape(case.k)];
    expect_error(case.clone(), ErrorKind::ZeroDimension, &needles);
}

#[test]
fn heads_not_a_multiple_of_kv_heads() {
    let case = Case {
        q: [2, 3, 3, 4],
        ..valid()
    };
    let needles = ["heads (3)", "kv_heads (2)", &shape(case.q), &shape(case.k)];
    expect_error(case.clone(), ErrorKind::HeadsNotDivisible, &needles);
}

/// `name`'s shape is [`SCORES`] with dimension `axis` set to `len`
/// (neither the full size nor 1).
fn not_broadcastable(name: &str, axis: usize, len: usize) {
    let mut bad = SCORES;
    bad[axis] = len;
    let case = if name == "keep_mask" {
        Case {
            keep_mask: Some(bad),
            ..valid()
        }
    } else {
        Case {
            bias: Some(bad),
            ..valid()
        }
    };
    let needles = [name, &shape(bad), &shape(SCORES)];
    expect_error(case, ErrorKind::NotBroadcastable, &needles);
}

#[test]
fn keep_mask_batch_not_broadcastable() {
    not_broadcastable("keep_mask", 0, 3);
}

#[test]
fn keep_mask_heads_not_broadcastable() {
    // kv_heads (2) is not enough: the mask is per query head.
    not_broadcastable("keep_mask", 1, 2);
}

#[test]
fn keep_mask_len_q_not_broadcastable() {
    not_broadcastable("keep_mask", 2, 2);
}

#[test]
fn keep_mask_len_kv_not_broadcastable() {
    not_broadcastable("keep_mask", 3, 4);
}

#[test]
fn keep_mask_of_size_zero_is_not_broadcastable() {
    not_broadcastable("keep_mask", 3, 0);
}

#[test]
fn bias_batch_not_broadcastable() {
    not_broadcastable("bias", 0, 3);
}

#[test]
fn bias_heads_not_broadcastable() {
    not_broadcastable("bias", 1, 2);
}

#[test]
fn bias_len_q_not_broadcastable() {
    not_broadcastable("bias", 2, 4);
}

#[test]
fn bias_len_kv_not_broadcastable() {
    not_broadcastable("bias", 3, 6);
}

#[test]
fn key_lengths_too_few() {
    let case = Case {
        key_lengths: Some(vec![5]),
        ..valid()
    };
    expect_error(
        case,
        ErrorKind::KeyLengths,
        &["key_lengths", "batch", "1 entries"],
    );
}

#[test]
fn key_lengths_too_many() {
    let case = Case {
        key_lengths: Some(vec![5, 5, 5]),
        ..valid()
    };
    expect_error(
        case,
        ErrorKind::KeyLengths,
        &["key_lengths", "batch", "3 entries"],
    );
}

#[test]
fn key_length_past_len_kv() {
    let case = Case {
        key_lengths: Some(vec![5, 6]),
        ..valid()
    };
    let needles = ["key_lengths[1] = 6", "len_kv = 5", &shape(case.k)];
    expect_error(case.clone(), ErrorKind::KeyLengths, &needles);
}

#[test]
fn window_zero() {
    let case = Case {
        window: Some(0),
        ..valid()
    };
    expect_error(case, ErrorKind::InvalidOption, &["window"]);
}

#[test]
fn scale_not_finite() {
    for scale in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let case = Case {
            scale: Some(scale),
            ..valid()
        };
        expect_error(case, ErrorKind::InvalidOption, &["scale", "finite"]);
    }
}

/// The `_into` entry points reject `out` of shape `bad` and leave it alone;
/// the allocating ones (no `out`) accept the case.
fn wrong_out(bad: [usize; 4]) {
    fn check<F: Element>(bad: [usize; 4]) {
        let case = valid();
        let needles = ["out", &shape(bad), &shape(case.out_shape())];
        for (entry, result) in case.run::<F>(Some(bad)) {
            if entry.ends_with("_into") {
                check_error(
                    std::any::type_name::<F>(),
                    entry,
                    result,
                    ErrorKind::ShapeMismatch,
                    &needles,
                );
            } else {
                assert!(result.is_ok(), "{entry} has no out and should succeed");
            }
        }
    }
    check::<f32>(bad);
    check::<f64>(bad);
}

#[test]
fn out_too_small() {
    wrong_out([2, 4, 2, 6]);
    wrong_out([1, 4, 3, 6]);
    wrong_out([2, 4, 3, 0]);
}

#[test]
fn out_too_large() {
    wrong_out([2, 4, 4, 6]);
    wrong_out([2, 4, 3, 7]);
}

#[test]
fn out_with_kv_heads_instead_of_heads() {
    wrong_out([2, 2, 3, 6]);
}

#[test]
fn out_with_d_k_instead_of_d_v() {
    wrong_out([2, 4, 3, 4]);
}

#[test]
fn out_with_right_size_but_wrong_shape() {
    // 144 elements, as the output, but transposed.
    wrong_out([2, 4, 6, 3]);
}

#[test]
fn error_is_a_std_error_with_kind_and_message() {
    let err = sdpa::scaled_dot_product_attention(
        Array4::<f32>::zeros((1, 1, 1, 2)).view(),
        Array4::<f32>::zeros((1, 1, 1, 3)).view(),
        Array4::<f32>::zeros((1, 1, 1, 2)).view(),
        &AttentionOptions::new(),
    )
    .unwrap_err();
    let as_std: &dyn std::error::Error = &err;
    assert_eq!(as_std.to_string(), err.message());
    assert_eq!(err.clone(), err);
    let made = AttentionError::new(ErrorKind::InvalidOption, "scale must be finite");
    assert_eq!(made.kind(), ErrorKind::InvalidOption);
    assert_eq!(made.to_string(), "scale must be finite");
}

/// Runs every entry point on an empty problem and returns the outputs of
/// the allocating calls and the `_into` calls (the latter prefilled with a
/// sentinel, so "zeros" means they were written).
fn empty_outputs<F: Element>(case: &Case) -> Vec<Array4<F>> {
    let q = Array4::<F>::ones(case.q);
    let k = Array4::<F>::ones(case.k);
    let v = Array4::<F>::ones(case.v);
    let mask = case.keep_mask.map(|s| Array4::from_elem(s, true));
    let mut opts = AttentionOptions::new();
    if case.causal {
        opts = opts.causal();
    }
    if let Some(mask) = &mask {
        opts = opts.keep_mask(mask.view());
    }
    if let Some(lengths) = &case.key_lengths {
        opts = opts.key_lengths(lengths);
    }
    let sentinel: F = common::cast(7.0);
    let mut into = Array4::from_elem(case.out_shape(), sentinel);
    sdpa::scaled_dot_product_attention_into(q.view(), k.view(), v.view(), &opts, into.view_mut())
        .unwrap();
    let mut core_into = Array4::from_elem(case.out_shape(), sentinel);
    sdpa::core::scaled_dot_product_attention_into(
        q.view(),
        k.view(),
        v.view(),
        &opts,
        core_into.view_mut(),
    )
    .unwrap();
    let weights = sdpa::core::attention_weights(q.view(), k.view(), &opts).unwrap();
    assert_eq!(
        weights.shape(),
        &[case.q[0], case.q[1], case.q[2], case.k[2]]
    );
    assert!(weights.iter().all(|&w| w == F::zero()));
    vec![
        sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap(),
        sdpa::core::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts).unwrap(),
        into,
        core_into,
    ]
}

fn expect_zeros<F: Element>(case: &Case) {
    for out in empty_outputs::<F>(case) {
        assert_eq!(out.shape(), &case.out_shape());
        assert!(
            out.iter().all(|&x| x == F::zero()),
            "{case:?} ({}): expected zeros, got {out}",
            std::any::type_name::<F>()
        );
    }
}

#[test]
fn empty_len_q_gives_empty_output() {
    for causal in [false, true] {
        let case = Case {
            q: [2, 4, 0, 4],
            keep_mask: Some([2, 4, 0, 5]),
            key_lengths: Some(vec![5, 2]),
            causal,
            ..valid()
        };
        expect_zeros::<f32>(&case);
        expect_zeros::<f64>(&case);
    }
}

#[test]
fn empty_len_kv_gives_zeros() {
    for causal in [false, true] {
        let case = Case {
            k: [2, 2, 0, 4],
            v: [2, 2, 0, 6],
            keep_mask: Some([2, 4, 3, 0]),
            key_lengths: Some(vec![0, 0]),
            causal,
            ..valid()
        };
        expect_zeros::<f32>(&case);
        expect_zeros::<f64>(&case);
        let plain = Case {
            keep_mask: None,
            key_lengths: None,
            ..case
        };
        expect_zeros::<f32>(&plain);
        expect_zeros::<f64>(&plain);
    }
}

#[test]
fn empty_len_q_and_len_kv() {
    let case = Case {
        q: [2, 4, 0, 4],
        k: [2, 2, 0, 4],
        v: [2, 2, 0, 6],
        causal: true,
        ..valid()
    };
    expect_zeros::<f32>(&case);
    expect_zeros::<f64>(&case);
}

/// Whether `got` broadcasts to `full`.
fn broadcasts(got: [usize; 4], full: [usize; 4]) -> bool {
    got.iter().zip(&full).all(|(&g, &f)| g == f || g == 1)
}

/// The validity rule of DESIGN.md, written independently of the crate.
fn is_valid(case: &Case) -> bool {
    let (q, k, v) = (case.q, case.k, case.v);
    let scores = [q[0], q[1], q[2], k[2]];
    q[0] == k[0]
        && q[0] == v[0]
        && q[3] > 0
        && q[3] == k[3]
        && k[1] == v[1]
        && k[2] == v[2]
        && q[1] > 0
        && k[1] > 0
        && q[1] % k[1] == 0
        && case.keep_mask.is_none_or(|m| broadcasts(m, scores))
        && case.bias.is_none_or(|b| broadcasts(b, scores))
        && case
            .key_lengths
            .as_ref()
            .is_none_or(|l| l.len() == q[0] && l.iter().all(|&n| n <= k[2]))
        && case.scale.is_none_or(f64::is_finite)
        && case.window != Some(0)
}

/// A shape for the keep mask or bias: the full scores shape with some
/// dimensions broadcast (1).
fn broadcast_of(scores: [usize; 4], ones: [bool; 4]) -> [usize; 4] {
    std::array::from_fn(|d| if ones[d] { 1 } else { scores[d] })
}

/// Replaces one number of `case` (picked by `slot`) with `value`.
fn mutate(case: &mut Case, slot: usize, value: usize) {
    match slot {
        0..=3 => case.q[slot] = value,
        4..=7 => case.k[slot - 4] = value,
        8..=11 => case.v[slot - 8] = value,
        12..=15 => {
            if let Some(mask) = &mut case.keep_mask {
                mask[slot - 12] = value;
            }
        }
        16 => {
            if let Some(bias) = &mut case.bias {
                bias[value] = 2;
            }
        }
        17 => {
            if let Some(lengths) = &mut case.key_lengths {
                lengths.push(value);
            }
        }
        _ => {
            if let Some(first) = case.key_lengths.as_mut().and_then(|l| l.first_mut()) {
                *first += value;
            }
        }
    }
}

prop_compose! {
    /// A valid call on small shapes (lengths and batch may be 0), then up to
    /// three of its numbers replaced by arbitrary small ones, so that valid
    /// and invalid calls of every kind are both common.
    fn any_case()(
        (batch, kv_heads, group, len_q, len_kv, d_k, d_v) in
            (0usize..=2, 1usize..=2, 1usize..=2, 0usize..=3, 0usize..=3, 1usize..=3, 0usize..=3),
        mask_ones in prop::option::of(any::<[bool; 4]>()),
        bias_ones in prop::option::of(any::<[bool; 4]>()),
        key_lengths in prop::option::of(prop::collection::vec(any::<prop::sample::Index>(), 0..=2)),
        scale in prop::option::of(prop_oneof![
            4 => -2.0..2.0f64, 1 => Just(f64::NAN), 1 => Just(f64::INFINITY),
        ]),
        causal in any::<bool>(),
        window in prop::option::of(0usize..=3),
        mutations in prop::collection::vec((0usize..19, 0usize..=3), 0..=3),
    ) -> Case {
        let heads = kv_heads * group;
        let scores = [batch, heads, len_q, len_kv];
        let mut case = Case {
            q: [batch, heads, len_q, d_k],
            k: [batch, kv_heads, len_kv, d_k],
            v: [batch, kv_heads, len_kv, d_v],
            keep_mask: mask_ones.map(|ones| broadcast_of(scores, ones)),
            bias: bias_ones.map(|ones| broadcast_of(scores, ones)),
            // One length per batch item unless mutated below.
            key_lengths: key_lengths.map(|picks| {
                (0..batch)
                    .map(|b| picks.get(b).map_or(len_kv, |i| i.index(len_kv + 1)))
                    .collect()
            }),
            scale,
            causal,
            window,
        };
        for (slot, value) in mutations {
            mutate(&mut case, slot, value);
        }
        case
    }
}

proptest! {
    /// Any combination of shapes and options either succeeds or fails with
    /// an error, never a panic, and exactly the valid ones succeed.
    #[test]
    fn every_call_is_ok_exactly_when_valid(case in any_case()) {
        let valid = is_valid(&case);
        for (entry, result) in case.run::<f32>(None).into_iter().chain(case.run::<f64>(None)) {
            prop_assert_eq!(result.is_ok(), valid, "{} on {:?}: {:?}", entry, case, result);
        }
    }
}
