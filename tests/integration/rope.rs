//! Rotary position embeddings against Hugging Face `transformers` (the
//! fixtures `scripts/make_rope_fixtures.py` wrote under
//! `tests/fixtures/rope/`: Llama with GQA, a Llama 3 theta, GPT-NeoX's
//! partial rotary and GPT-J's interleaved partial rotary), and the
//! properties of a rotation: it preserves norms, its backward is its
//! transpose, `q·k` after it depends only on the difference of positions,
//! and `f32` agrees with `f64`.

use std::path::PathBuf;

use ndarray::{Array2, Array4, ArrayD, IxDyn, s};
use proptest::prelude::*;
use sdpa::{
    RopeLayout, RopePositions, RopeTable, apply_rope, apply_rope_backward, apply_rope_inplace,
};

use crate::common::{Rng, config};

/// A `.npy` array: its shape and its values as `f64` (from `<f4`, `<f8` or
/// `<i8`, C order, the only forms the script writes).
fn read_npy(name: &str) -> ArrayD<f64> {
    let path: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "tests",
        "fixtures",
        "rope",
        name,
    ]
    .iter()
    .collect();
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{name}: not a .npy file");
    let (header_len, header_start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[header_start..header_start + header_len]).unwrap();
    assert!(
        header.contains("'fortran_order': False"),
        "{name}: {header}"
    );
    let descr = header
        .split("'descr': '")
        .nth(1)
        .unwrap()
        .split('\'')
        .next()
        .unwrap();
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .filter(|d| !d.trim().is_empty())
        .map(|d| d.trim().parse().unwrap())
        .collect();
    let data = &bytes[header_start + header_len..];
    let values: Vec<f64> = match descr {
        "<f4" => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        "<f8" => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "<i8" => data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        other => panic!("{name}: unexpected dtype {other}"),
    };
    ArrayD::from_shape_vec(IxDyn(&shape), values).unwrap()
}

fn read4(name: &str) -> Array4<f64> {
    read_npy(name).into_dimensionality().unwrap()
}

/// One fixture case: what the script's table says about it.
struct Case {
    name: &'static str,
    layout: RopeLayout,
    rotary_dim: usize,
    theta: f64,
}

const CASES: [Case; 4] = [
    Case {
        name: "llama",
        layout: RopeLayout::HalfSplit,
        rotary_dim: 16,
        theta: 10_000.0,
    },
    Case {
        name: "llama3_theta",
        layout: RopeLayout::HalfSplit,
        rotary_dim: 32,
        theta: 500_000.0,
    },
    Case {
        name: "neox_partial",
        layout: RopeLayout::HalfSplit,
        rotary_dim: 8,
        theta: 10_000.0,
    },
    Case {
        name: "gptj_partial",
        layout: RopeLayout::Interleaved,
        rotary_dim: 8,
        theta: 10_000.0,
    },
];

fn positions_of(case: &Case) -> Array2<usize> {
    read_npy(&format!("{}_positions.npy", case.name))
        .into_dimensionality::<ndarray::Ix2>()
        .unwrap()
        .mapv(|p| p as usize)
}

fn max_abs_difference(a: &Array4<f64>, b: &Array4<f64>) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn f64_matches_hugging_face_in_f64() {
    for case in &CASES {
        let positions = positions_of(case);
        let table = RopeTable::<f64>::new(case.rotary_dim, case.theta, 128)
            .unwrap()
            .with_layout(case.layout);
        for tensor in ["q", "k"] {
            let x = read4(&format!("{}_{tensor}.npy", case.name));
            let want = read4(&format!("{}_{tensor}_out_f64.npy", case.name));
            let got =
                apply_rope(x.view(), &table, RopePositions::PerItem(positions.view())).unwrap();
            let error = max_abs_difference(&got, &want);
            assert!(error < 1e-13, "{} {tensor}: {error:e}", case.name);
        }
    }
}

#[test]
fn f32_matches_hugging_face_in_f32() {
    for case in &CASES {
        let positions = positions_of(case);
        let table = RopeTable::<f32>::new(case.rotary_dim, case.theta, 128)
            .unwrap()
            .with_layout(case.layout);
        for tensor in ["q", "k"] {
            let x = read4(&format!("{}_{tensor}.npy", case.name)).mapv(|v| v as f32);
            let hugging_face = read4(&format!("{}_{tensor}_out.npy", case.name));
            let exact = read4(&format!("{}_{tensor}_out_f64.npy", case.name));
            let got = apply_rope(x.view(), &table, RopePositions::PerItem(positions.view()))
                .unwrap()
                .mapv(f64::from);
            // Hugging Face forms the angles in f32 (off by up to about
            // p·2⁻²⁴ at position p ≤ 63); this crate rounds exact ones.
            let against_hf = max_abs_difference(&got, &hugging_face);
            assert!(
                against_hf < 1e-5,
                "{} {tensor}: {against_hf:e} from Hugging Face",
                case.name
            );
            let against_exact = max_abs_difference(&got, &exact);
            assert!(
                against_exact < 2e-6,
                "{} {tensor}: {against_exact:e} from exact",
                case.name
            );
        }
    }
}

#[test]
fn a_kv_cache_offset_is_a_start_position() {
    // The llama fixture's item 1 runs from position 9: rotating it alone
    // with Start(9) gives Hugging Face's rows, and so does each token
    // rotated on its own, as decode steps would.
    let case = &CASES[0];
    let table = RopeTable::<f64>::new(case.rotary_dim, case.theta, 128).unwrap();
    let x = read4("llama_k.npy");
    let want = read4("llama_k_out_f64.npy");
    let item = x.slice(s![1..2, .., .., ..]);
    let got = apply_rope(item, &table, RopePositions::Start(9)).unwrap();
    assert!(max_abs_difference(&got, &want.slice(s![1..2, .., .., ..]).to_owned()) < 1e-13);
    for i in 0..x.shape()[2] {
        let mut token = x.slice(s![1..2, .., i..i + 1, ..]).to_owned();
        apply_rope_inplace(token.view_mut(), &table, RopePositions::Start(9 + i)).unwrap();
        let want = want.slice(s![1..2, .., i..i + 1, ..]).to_owned();
        assert!(max_abs_difference(&token, &want) < 1e-13);
    }
    // And Starts gives both items at once.
    let both = apply_rope(x.view(), &table, RopePositions::Starts(&[0, 9])).unwrap();
    assert!(max_abs_difference(&both, &want) < 1e-13);
}

/// A layout, a head dim, a rotary dim ≤ it (even), a theta, and a shape.
fn rope_case() -> impl Strategy<Value = (RopeLayout, usize, usize, f64, [usize; 4], u64)> {
    (
        prop_oneof![Just(RopeLayout::HalfSplit), Just(RopeLayout::Interleaved)],
        1usize..=40,
        prop_oneof![Just(10_000.0), Just(500_000.0), 2.0f64..1e6],
        (1usize..=3, 1usize..=3, 1usize..=6),
        any::<u64>(),
    )
        .prop_flat_map(|(layout, d, theta, (batch, heads, len), seed)| {
            (0..=d / 2)
                .prop_map(move |half| (layout, d, 2 * half, theta, [batch, heads, len, d], seed))
        })
}

fn dot(a: &Array4<f64>, b: &Array4<f64>) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn rotation_preserves_each_rows_norm(
        (layout, _d, rotary_dim, theta, shape, seed) in rope_case(),
        start in 0usize..1000,
    ) {
        let table = RopeTable::<f64>::new(rotary_dim, theta, 1100).unwrap().with_layout(layout);
        let x: Array4<f64> = Rng::new(seed).array(shape);
        let y = apply_rope(x.view(), &table, RopePositions::Start(start)).unwrap();
        for (row_x, row_y) in x.rows().into_iter().zip(y.rows()) {
            let (nx, ny) = (row_x.dot(&row_x).sqrt(), row_y.dot(&row_y).sqrt());
            prop_assert!((nx - ny).abs() <= 1e-12 * nx.max(1.0));
        }
        // The pass-through features are untouched.
        prop_assert_eq!(y.slice(s![.., .., .., rotary_dim..]), x.slice(s![.., .., .., rotary_dim..]));
    }

    #[test]
    fn backward_is_the_transpose(
        (layout, _d, rotary_dim, theta, shape, seed) in rope_case(),
        tokens in proptest::collection::vec(0usize..500, 6),
    ) {
        // ⟨R x, y⟩ = ⟨x, Rᵀ y⟩ for every x and y.
        let table = RopeTable::<f64>::new(rotary_dim, theta, 500).unwrap().with_layout(layout);
        let mut rng = Rng::new(seed);
        let (x, y): (Array4<f64>, Array4<f64>) = (rng.array(shape), rng.array(shape));
        let positions = RopePositions::Tokens(&tokens[..shape[2]]);
        let rx = apply_rope(x.view(), &table, positions).unwrap();
        let rty = apply_rope_backward(y.view(), &table, positions).unwrap();
        prop_assert!((dot(&rx, &y) - dot(&x, &rty)).abs() < 1e-12 * (1.0 + dot(&x, &x) + dot(&y, &y)));
    }

    #[test]
    fn scores_depend_only_on_the_difference_of_positions(
        (layout, d, rotary_dim, theta, _shape, seed) in rope_case(),
        (query_position, key_position, shift) in (0usize..300, 0usize..300, 0usize..300),
    ) {
        let table = RopeTable::<f64>::new(rotary_dim, theta, 1000).unwrap().with_layout(layout);
        let mut rng = Rng::new(seed);
        let (q, k): (Array4<f64>, Array4<f64>) = (rng.array([1, 1, 1, d]), rng.array([1, 1, 1, d]));
        let score = |pq: usize, pk: usize| {
            let q = apply_rope(q.view(), &table, RopePositions::Start(pq)).unwrap();
            let k = apply_rope(k.view(), &table, RopePositions::Start(pk)).unwrap();
            dot(&q, &k)
        };
        let (near, far) = (score(query_position, key_position), score(query_position + shift, key_position + shift));
        // Angles up to 600 rad lose about 600·2⁻⁵³ each to rounding.
        prop_assert!((near - far).abs() < 1e-10 * d as f64, "{} vs {}", near, far);
    }

    #[test]
    fn f32_agrees_with_f64(
        (layout, _d, rotary_dim, theta, shape, seed) in rope_case(),
        start in 0usize..2000,
    ) {
        let x64: Array4<f64> = Rng::new(seed).array(shape);
        let x32 = x64.mapv(|v| v as f32);
        let positions = RopePositions::Start(start);
        let t64 = RopeTable::<f64>::new(rotary_dim, theta, 2100).unwrap().with_layout(layout);
        let t32 = RopeTable::<f32>::new(rotary_dim, theta, 2100).unwrap().with_layout(layout);
        let y64 = apply_rope(x32.mapv(f64::from).view(), &t64, positions).unwrap();
        let y32 = apply_rope(x32.view(), &t32, positions).unwrap().mapv(f64::from);
        // Inputs in [-1, 1): a rounded cos and sin and two products.
        prop_assert!(max_abs_difference(&y32, &y64) < 1e-6);
        let b32 = apply_rope_backward(x32.view(), &t32, positions).unwrap().mapv(f64::from);
        let b64 = apply_rope_backward(x32.mapv(f64::from).view(), &t64, positions).unwrap();
        prop_assert!(max_abs_difference(&b32, &b64) < 1e-6);
    }
}
