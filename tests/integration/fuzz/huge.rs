//! Huge shapes: errors, never panics or aborts.

use super::*;

/// Shapes whose output cannot be allocated, reached through zero strides
/// (so the inputs are tiny): `len_q`, batch, heads or `d_v` of 2^60 (an
/// output of 2^62 bytes or more: no machine maps that) or 2^62 (past
/// `isize::MAX` bytes), and `attention_weights` of 2^30 × 2^30. Every path
/// must return an `Err`, never panic, never abort the process: `TooLarge`
/// when the result's bytes in that element type pass `isize::MAX` (then
/// no allocation is even tried), `OutOfMemory` when they do not.
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

/// In this process, not a child: a child is the test binary run again,
/// which an emulated target (the aarch64 run under qemu user mode) cannot
/// always exec. A panic is caught per call; an abort would end the run
/// with Rust's "memory allocation of N bytes failed" on stderr, which
/// names the failure as well as a child's exit status did.
#[test]
pub(super) fn huge_shapes_give_errors_not_panics_or_aborts() {
    let failures: Vec<String> = (0..HUGE_CASES.len()).filter_map(huge_case).collect();
    assert!(failures.is_empty(), "huge shapes:\n{}", failures.join("\n"));
}

/// Runs one huge case through every path; `Some` says what went wrong.
fn huge_case(index: usize) -> Option<String> {
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
    // (path, element size in bytes, outcome)
    let mut outcomes: Vec<(String, usize, Result<Option<ErrorKind>, String>)> = Vec::new();
    let weights = name.starts_with("attention_weights");
    for set in available_kernel_sets() {
        if !weights {
            outcomes.push((
                format!("fused {set}"),
                4,
                outcome(&guarded(|| {
                    forced(set, || {
                        sdpa::scaled_dot_product_attention(q32, k32, v32, &o32)
                    })
                })),
            ));
            outcomes.push((
                format!("fused {set} partial"),
                4,
                outcome(&guarded(|| {
                    forced(set, || {
                        sdpa::scaled_dot_product_attention_partial(q32, k32, v32, &o32)
                    })
                })),
            ));
        }
    }
    if weights {
        outcomes.push((
            "core f32 attention_weights".into(),
            4,
            outcome(&guarded(|| sdpa::core::attention_weights(q32, k32, &o32))),
        ));
        outcomes.push((
            "core f64 attention_weights".into(),
            8,
            outcome(&guarded(|| sdpa::core::attention_weights(q64, k64, &o64))),
        ));
    } else {
        outcomes.push((
            "core f32".into(),
            4,
            outcome(&guarded(|| {
                sdpa::core::scaled_dot_product_attention(q32, k32, v32, &o32)
            })),
        ));
        outcomes.push((
            "core f64".into(),
            8,
            outcome(&guarded(|| {
                sdpa::core::scaled_dot_product_attention(q64, k64, v64, &o64)
            })),
        ));
    }
    // The elements of the result: the output, or the weights matrix.
    let elements = [
        q_shape[0],
        q_shape[1],
        q_shape[2],
        if weights { k_shape[2] } else { d_v },
    ]
    .iter()
    .try_fold(1usize, |n, &len| n.checked_mul(len));
    let expected = |size: usize| match elements.and_then(|n| n.checked_mul(size)) {
        Some(bytes) if bytes <= isize::MAX as usize => ErrorKind::OutOfMemory,
        _ => ErrorKind::TooLarge,
    };
    let wrong: Vec<_> = outcomes
        .iter()
        .filter(|(_, size, o)| *o != Ok(Some(expected(*size))))
        .collect();
    (!wrong.is_empty()).then(|| {
        format!(
            "{name}: not the expected error (TooLarge past isize::MAX bytes, else OutOfMemory): {wrong:?}"
        )
    })
}
