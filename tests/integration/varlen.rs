//! Packed variable-length batches: `scaled_dot_product_attention_varlen`
//! and its `_into`, `_partial` and `_backward` forms.
//!
//! Each sequence's rows of every result must be bitwise those of the 4-D
//! call on that sequence alone (copied out into its own standard-layout
//! `[1, heads, len, d]` arrays): the fused `f32` path on every kernel set,
//! and the reference in `f64`, which is also checked against the naive
//! oracle of `common` with the per-sequence causal, window and ALiBi rules
//! written out, and whose gradients are checked against finite
//! differences. Ragged lengths include 0 and 1, `len_q ≠ len_kv` both
//! ways, GQA and MQA, sequences past one query and key tile and
//! decode-sized ones. The `_into` forms of the partial and the backward
//! write the same bits into a caller's NaN-filled column-major arrays.
//! Beyond the numbers: NaN in one sequence never
//! reaches another, results do not depend on the thread count, and every
//! bad input is an error of the right kind naming the offending values.

use std::ops::Range;

use crate::common;

use crate::common::with_threads;
use common::{Inputs, Rng, assert_close, cast, close, naive_attention, nan_filled, to_f64};
use ndarray::{Array1, Array2, Array3, Array4, ArrayView, ArrayView3, Axis, Dimension, s};
use sdpa::simd::{available_kernel_sets, with_kernel_set};
use sdpa::{
    AttentionError, AttentionOptions, CausalAlignment, Element, ErrorKind, VarlenGradients,
    VarlenPartial, scaled_dot_product_attention, scaled_dot_product_attention_backward,
    scaled_dot_product_attention_partial, scaled_dot_product_attention_varlen,
    scaled_dot_product_attention_varlen_backward,
    scaled_dot_product_attention_varlen_backward_into, scaled_dot_product_attention_varlen_into,
    scaled_dot_product_attention_varlen_partial, scaled_dot_product_attention_varlen_partial_into,
};

/// `cu_seqlens` for sequences of the given lengths.
fn offsets(lengths: &[usize]) -> Vec<usize> {
    let mut offsets = vec![0];
    for &len in lengths {
        offsets.push(offsets.last().unwrap() + len);
    }
    offsets
}

/// The shapes of a packed batch: heads, head widths and per-sequence
/// lengths.
#[derive(Debug, Clone)]
struct Layout {
    heads: usize,
    kv_heads: usize,
    d_k: usize,
    d_v: usize,
    q_lens: Vec<usize>,
    kv_lens: Vec<usize>,
}

/// The batches most tests run: GQA with a sequence past one query tile (96
/// rows) and one key tile (64), queries without keys, keys without queries,
/// an empty sequence, `len_q > len_kv` and `len_q < len_kv`; MQA with
/// decode-sized sequences (the fused decode path); MHA with tile-sized ones.
fn layouts() -> Vec<Layout> {
    vec![
        Layout {
            heads: 4,
            kv_heads: 2,
            d_k: 16,
            d_v: 12,
            q_lens: vec![5, 0, 1, 130, 17, 9, 0, 3],
            kv_lens: vec![5, 4, 0, 150, 17, 4, 0, 70],
        },
        Layout {
            heads: 3,
            kv_heads: 1,
            d_k: 8,
            d_v: 5,
            q_lens: vec![1, 1, 1, 2, 40],
            kv_lens: vec![1, 2, 3, 1, 40],
        },
        Layout {
            heads: 2,
            kv_heads: 2,
            d_k: 33,
            d_v: 7,
            q_lens: vec![97, 64],
            kv_lens: vec![64, 97],
        },
    ]
}

/// A packed batch: its layout, offsets and data.
#[derive(Debug, Clone)]
struct Batch<F> {
    layout: Layout,
    cu_q: Vec<usize>,
    cu_kv: Vec<usize>,
    q: Array3<F>,
    k: Array3<F>,
    v: Array3<F>,
}

impl<F: Element> Batch<F> {
    /// Entries uniform in `[-1, 1)` from `seed`.
    fn random(layout: &Layout, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let (cu_q, cu_kv) = (offsets(&layout.q_lens), offsets(&layout.kv_lens));
        let (total_q, total_kv) = (*cu_q.last().unwrap(), *cu_kv.last().unwrap());
        let mut array = |dim: (usize, usize, usize)| {
            Array3::from_shape_simple_fn(dim, || cast::<F>(rng.uniform(-1.0, 1.0)))
        };
        Self {
            q: array((total_q, layout.heads, layout.d_k)),
            k: array((total_kv, layout.kv_heads, layout.d_k)),
            v: array((total_kv, layout.kv_heads, layout.d_v)),
            layout: layout.clone(),
            cu_q,
            cu_kv,
        }
    }

    fn to_f64(&self) -> Batch<f64> {
        Batch {
            layout: self.layout.clone(),
            cu_q: self.cu_q.clone(),
            cu_kv: self.cu_kv.clone(),
            q: self.q.mapv(to_f64),
            k: self.k.mapv(to_f64),
            v: self.v.mapv(to_f64),
        }
    }

    fn sequences(&self) -> usize {
        self.cu_q.len() - 1
    }

    fn queries(&self, s: usize) -> Range<usize> {
        self.cu_q[s]..self.cu_q[s + 1]
    }

    fn keys(&self, s: usize) -> Range<usize> {
        self.cu_kv[s]..self.cu_kv[s + 1]
    }

    /// A random `[total_q, heads, d_v]` array, e.g. a `d_out`.
    fn random_output(&self, seed: u64) -> Array3<F> {
        let mut rng = Rng::new(seed);
        let dim = (self.q.dim().0, self.layout.heads, self.layout.d_v);
        Array3::from_shape_simple_fn(dim, || cast::<F>(rng.uniform(-1.0, 1.0)))
    }

    fn forward(&self, opts: &AttentionOptions<'_, F>) -> Result<Array3<F>, AttentionError> {
        let (q, k, v) = (self.q.view(), self.k.view(), self.v.view());
        scaled_dot_product_attention_varlen(q, k, v, &self.cu_q, &self.cu_kv, opts)
    }

    fn partial(&self, opts: &AttentionOptions<'_, F>) -> Result<VarlenPartial<F>, AttentionError> {
        let (q, k, v) = (self.q.view(), self.k.view(), self.v.view());
        scaled_dot_product_attention_varlen_partial(q, k, v, &self.cu_q, &self.cu_kv, opts)
    }

    fn partial_into(
        &self,
        opts: &AttentionOptions<'_, F>,
        partial: &mut VarlenPartial<F>,
    ) -> Result<(), AttentionError> {
        let (q, k, v) = (self.q.view(), self.k.view(), self.v.view());
        let (cu_q, cu_kv) = (&self.cu_q[..], &self.cu_kv[..]);
        scaled_dot_product_attention_varlen_partial_into(q, k, v, cu_q, cu_kv, opts, partial)
    }

    fn backward_into(
        &self,
        opts: &AttentionOptions<'_, F>,
        forward: &VarlenPartial<F>,
        d_out: &Array3<F>,
        gradients: &mut VarlenGradients<F>,
    ) -> Result<(), AttentionError> {
        let (q, k, v) = (self.q.view(), self.k.view(), self.v.view());
        scaled_dot_product_attention_varlen_backward_into(
            q,
            k,
            v,
            &self.cu_q,
            &self.cu_kv,
            opts,
            forward,
            d_out.view(),
            gradients,
        )
    }

    fn backward(
        &self,
        opts: &AttentionOptions<'_, F>,
        forward: &VarlenPartial<F>,
        d_out: &Array3<F>,
    ) -> Result<VarlenGradients<F>, AttentionError> {
        let (q, k, v) = (self.q.view(), self.k.view(), self.v.view());
        scaled_dot_product_attention_varlen_backward(
            q,
            k,
            v,
            &self.cu_q,
            &self.cu_kv,
            opts,
            forward,
            d_out.view(),
        )
    }
}

/// Rows `rows` of a packed `[total, heads, d]` array, copied out into a
/// standard-layout `[1, heads, len, d]` array of their own.
fn alone<F: Clone>(x: &Array3<F>, rows: Range<usize>) -> Array4<F> {
    x.slice(s![rows, .., ..])
        .permuted_axes([1, 0, 2])
        .insert_axis(Axis(0))
        .as_standard_layout()
        .into_owned()
}

/// Rows `rows` of a packed `[total, heads, d]` view as a `[1, heads, len, d]`
/// view of the same data, strides and all.
fn as_call<'a, F>(x: ArrayView3<'a, F>, rows: Range<usize>) -> ndarray::ArrayView4<'a, F> {
    x.slice_move(s![rows, .., ..])
        .permuted_axes([1, 0, 2])
        .insert_axis(Axis(0))
}

/// Rows `rows` of a packed `[total, heads]` log-sum-exp as `[1, heads, len]`.
fn alone_lse<F: Clone>(x: &Array2<F>, rows: Range<usize>) -> Array3<F> {
    x.slice(s![rows, ..])
        .reversed_axes()
        .insert_axis(Axis(0))
        .as_standard_layout()
        .into_owned()
}

/// Bitwise equality (NaN equals NaN), naming `what` and the first index
/// that differs.
#[track_caller]
fn assert_bitwise<F: Element, D: Dimension>(
    actual: &ArrayView<'_, F, D>,
    expected: &ArrayView<'_, F, D>,
    what: &str,
) {
    assert_eq!(actual.shape(), expected.shape(), "{what}: shapes differ");
    for ((index, &a), &e) in actual.indexed_iter().zip(expected.iter()) {
        let same = to_f64(a).to_bits() == to_f64(e).to_bits() || (a.is_nan() && e.is_nan());
        assert!(same, "{what}: differs at {index:?}: {a} vs {e}");
    }
}

/// Per-head ALiBi slopes and sink logits for `heads` heads.
struct Modifiers<F> {
    slopes: Vec<F>,
    sinks: Vec<F>,
}

impl<F: Element> Modifiers<F> {
    fn new(heads: usize) -> Self {
        Self {
            slopes: sdpa::alibi_slopes(heads).into_iter().map(cast).collect(),
            sinks: (0..heads).map(|h| cast(0.5 * h as f64 - 0.7)).collect(),
        }
    }
}

/// Every per-sequence option, alone and composed.
fn option_cases<F: Element>(m: &Modifiers<F>) -> Vec<(&'static str, AttentionOptions<'_, F>)> {
    let new = AttentionOptions::new;
    vec![
        ("none", new()),
        ("causal", new().causal()),
        (
            "top-left causal",
            new().causal_aligned(CausalAlignment::TopLeft),
        ),
        ("window 3", new().window(3)),
        (
            "top-left window 2",
            new().causal_aligned(CausalAlignment::TopLeft).window(2),
        ),
        ("scale", new().scale(cast(0.3))),
        ("causal alibi", new().causal().alibi(&m.slopes)),
        ("bidirectional alibi", new().alibi(&m.slopes)),
        ("sinks", new().sinks(&m.sinks)),
        ("softcap", new().softcap(cast(1.5))),
        (
            "everything",
            new()
                .causal()
                .window(5)
                .scale(cast(0.4))
                .alibi(&m.slopes)
                .sinks(&m.sinks)
                .softcap(cast(2.0)),
        ),
    ]
}

/// Checks the forward, partial and `_into` results of `batch` against the
/// 4-D calls on each sequence alone, bitwise.
fn check_forward_against_each_sequence<F: Element>(
    batch: &Batch<F>,
    opts: &AttentionOptions<'_, F>,
    what: &str,
) {
    let out = batch.forward(opts).expect("valid call");
    let partial = batch.partial(opts).expect("valid call");
    // Into a buffer of other strides ([heads, total_q, d_v] in memory),
    // filled with NaN so an unwritten entry shows.
    let (total_q, heads, d_v) = out.dim();
    let mut buffer = Array3::from_elem((heads, total_q, d_v), F::nan());
    scaled_dot_product_attention_varlen_into(
        batch.q.view(),
        batch.k.view(),
        batch.v.view(),
        &batch.cu_q,
        &batch.cu_kv,
        opts,
        buffer.view_mut().permuted_axes([1, 0, 2]),
    )
    .expect("valid call");
    assert_bitwise(
        &buffer.view().permuted_axes([1, 0, 2]),
        &out.view(),
        &format!("{what}: _into"),
    );
    for s in 0..batch.sequences() {
        let (queries, keys) = (batch.queries(s), batch.keys(s));
        let (q, k, v) = (
            alone(&batch.q, queries.clone()),
            alone(&batch.k, keys.clone()),
            alone(&batch.v, keys),
        );
        let expected =
            scaled_dot_product_attention(q.view(), k.view(), v.view(), opts).expect("valid call");
        let what = format!("{what}, sequence {s}");
        assert_bitwise(
            &alone(&out, queries.clone()).view(),
            &expected.view(),
            &what,
        );
        let expected = scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), opts)
            .expect("valid call");
        assert_bitwise(
            &alone(&partial.output().to_owned(), queries.clone()).view(),
            &expected.output(),
            &format!("{what}: partial output"),
        );
        assert_bitwise(
            &alone_lse(&partial.log_sum_exp().to_owned(), queries).view(),
            &expected.log_sum_exp(),
            &format!("{what}: log-sum-exp"),
        );
    }
}

#[test]
fn f32_varlen_is_bitwise_the_per_sequence_call_on_every_kernel_set() {
    for set in available_kernel_sets() {
        for (n, layout) in layouts().iter().enumerate() {
            let batch = Batch::<f32>::random(layout, 10 + n as u64);
            let modifiers = Modifiers::new(layout.heads);
            for (name, opts) in option_cases(&modifiers) {
                with_kernel_set(set, || {
                    check_forward_against_each_sequence(
                        &batch,
                        &opts,
                        &format!("{set} layout {n} {name}"),
                    )
                })
                .unwrap();
            }
        }
    }
}

#[test]
fn f64_varlen_is_bitwise_the_per_sequence_reference_and_f32_agrees() {
    for (n, layout) in layouts().iter().enumerate() {
        let batch32 = Batch::<f32>::random(layout, 20 + n as u64);
        let batch = batch32.to_f64();
        let (modifiers, modifiers32) = (Modifiers::new(layout.heads), Modifiers::new(layout.heads));
        for ((name, opts), (_, opts32)) in
            option_cases(&modifiers)
                .into_iter()
                .zip(option_cases::<f32>(&modifiers32))
        {
            check_forward_against_each_sequence(&batch, &opts, &format!("layout {n} {name}"));
            let out = batch.forward(&opts).unwrap();
            for s in 0..batch.sequences() {
                let (queries, keys) = (batch.queries(s), batch.keys(s));
                let expected = sdpa::core::scaled_dot_product_attention(
                    alone(&batch.q, queries.clone()).view(),
                    alone(&batch.k, keys.clone()).view(),
                    alone(&batch.v, keys).view(),
                    &opts,
                )
                .unwrap();
                assert_bitwise(
                    &alone(&out, queries).view(),
                    &expected.view(),
                    &format!("layout {n} {name}, sequence {s}: sdpa::core"),
                );
            }
            let out32 = batch32.forward(&opts32).unwrap();
            assert_close(&out32.view(), &out.view(), 1e-4);
        }
    }
}

#[test]
fn each_sequence_is_causal_windowed_and_alibi_biased_on_its_own_positions() {
    // The naive oracle with the rules written out per sequence: query i of
    // a sequence with len_q queries and len_kv keys sits at position
    // p = i + len_kv − len_q (bottom-right) or i (top-left).
    let layout = &layouts()[0];
    let batch = Batch::<f64>::random(layout, 30);
    let slopes = sdpa::alibi_slopes(layout.heads);
    let scale = 1.0 / (layout.d_k as f64).sqrt();
    type Rule = fn(i: usize, j: usize, len_q: usize, len_kv: usize) -> bool;
    let cases: [(&str, AttentionOptions<'_, f64>, Rule, bool); 5] = [
        (
            "bottom-right causal",
            AttentionOptions::new().causal(),
            |i, j, lq, lk| j + lq <= i + lk,
            false,
        ),
        (
            "top-left causal",
            AttentionOptions::new().causal_aligned(CausalAlignment::TopLeft),
            |i, j, _, _| j <= i,
            false,
        ),
        (
            "bottom-right window 3",
            AttentionOptions::new().window(3),
            |i, j, lq, lk| j + lq <= i + lk && j + 3 + lq > i + lk,
            false,
        ),
        (
            "top-left window 2",
            AttentionOptions::new()
                .causal_aligned(CausalAlignment::TopLeft)
                .window(2),
            |i, j, _, _| j <= i && j + 2 > i,
            false,
        ),
        (
            "causal alibi",
            AttentionOptions::new().causal().alibi(&slopes),
            |i, j, lq, lk| j + lq <= i + lk,
            true,
        ),
    ];
    for (name, opts, rule, alibi) in cases {
        let out = batch.forward(&opts).unwrap();
        for s in 0..batch.sequences() {
            let (queries, keys) = (batch.queries(s), batch.keys(s));
            let (len_q, len_kv) = (queries.len(), keys.len());
            let inputs = Inputs {
                q: alone(&batch.q, queries.clone()),
                k: alone(&batch.k, keys.clone()),
                v: alone(&batch.v, keys),
            };
            let expected = naive_attention(
                &inputs,
                scale,
                |_, _, i, j| rule(i, j, len_q, len_kv),
                |_, h, i, j| {
                    let position = (i + len_kv) as f64 - len_q as f64;
                    if alibi {
                        -slopes[h] * (position - j as f64)
                    } else {
                        0.0
                    }
                },
            );
            if let Err(message) = close(&alone(&out, queries).view(), &expected.view(), 1e-12) {
                panic!("{name}, sequence {s}: {message}");
            }
        }
    }
}

#[test]
fn a_batch_of_equal_lengths_is_the_padded_4d_batch_call() {
    let layout = Layout {
        heads: 4,
        kv_heads: 2,
        d_k: 16,
        d_v: 8,
        q_lens: vec![7; 3],
        kv_lens: vec![11; 3],
    };
    let batch = Batch::<f32>::random(&layout, 40);
    // [batch·len, heads, d] ↔ [batch, heads, len, d].
    let padded = |x: &Array3<f32>, len: usize| {
        let (_, heads, d) = x.dim();
        x.to_shape((3, len, heads, d))
            .unwrap()
            .permuted_axes([0, 2, 1, 3])
            .as_standard_layout()
            .into_owned()
    };
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            let opts = AttentionOptions::new().causal();
            let out = batch.forward(&opts).unwrap();
            let expected = scaled_dot_product_attention(
                padded(&batch.q, 7).view(),
                padded(&batch.k, 11).view(),
                padded(&batch.v, 11).view(),
                &opts,
            )
            .unwrap();
            assert_bitwise(&padded(&out, 7).view(), &expected.view(), &format!("{set}"));
        })
        .unwrap();
    }
}

#[test]
fn strided_inputs_give_the_per_sequence_result_on_the_same_views() {
    let layout = &layouts()[0];
    let batch = Batch::<f32>::random(layout, 50);
    // q stored [heads, total_q, d_k]; k every other column of a wider array.
    let q_store = batch
        .q
        .view()
        .permuted_axes([1, 0, 2])
        .as_standard_layout()
        .into_owned();
    let (total_kv, kv_heads, d_k) = batch.k.dim();
    let mut k_store = Array3::<f32>::from_elem((total_kv, kv_heads, 2 * d_k), f32::NAN);
    k_store.slice_mut(s![.., .., ..;2]).assign(&batch.k);
    let (q, k) = (
        q_store.view().permuted_axes([1, 0, 2]),
        k_store.slice(s![.., .., ..;2]),
    );
    let opts = AttentionOptions::new().causal();
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            let got = scaled_dot_product_attention_varlen(
                q,
                k,
                batch.v.view(),
                &batch.cu_q,
                &batch.cu_kv,
                &opts,
            )
            .unwrap();
            // Bitwise the 4-D call on the same strided rows...
            for s in 0..batch.sequences() {
                let (queries, keys) = (batch.queries(s), batch.keys(s));
                let expected = scaled_dot_product_attention(
                    as_call(q, queries.clone()),
                    as_call(k, keys.clone()),
                    as_call(batch.v.view(), keys),
                    &opts,
                )
                .unwrap();
                assert_bitwise(
                    &alone(&got, queries).view(),
                    &expected.view(),
                    &format!("{set} sequence {s}"),
                );
            }
            // ... and, within rounding, the contiguous inputs' result (the
            // fused path picks its decode driver by the keys' strides).
            let contiguous = batch.forward(&opts).unwrap();
            assert_close(&got.view(), &contiguous.view(), 1e-5);
        })
        .unwrap();
    }
}

/// Checks the `_into` forms against the allocating calls' results, bitwise:
/// the partial into NaN-filled column-major arrays, and the backward into
/// NaN-filled ones with a stale `d_sinks`, which must be replaced.
fn check_into_forms<F: Element>(
    batch: &Batch<F>,
    opts: &AttentionOptions<'_, F>,
    forward: &VarlenPartial<F>,
    d_out: &Array3<F>,
    grads: &VarlenGradients<F>,
    what: &str,
) {
    let (output, log_sum_exp) = (forward.output(), forward.log_sum_exp());
    let mut kept = VarlenPartial::from_parts(
        nan_filled(output.raw_dim()),
        nan_filled(log_sum_exp.raw_dim()),
    )
    .unwrap();
    batch.partial_into(opts, &mut kept).unwrap();
    let into = format!("{what}: partial_into");
    assert_bitwise(&kept.output(), &output, &format!("{into} output"));
    assert_bitwise(&kept.log_sum_exp(), &log_sum_exp, &format!("{into} lse"));

    let mut kept = VarlenGradients {
        d_q: nan_filled(batch.q.raw_dim()),
        d_k: nan_filled(batch.k.raw_dim()),
        d_v: nan_filled(batch.v.raw_dim()),
        d_sinks: Some(Array1::from_elem(3, cast::<F>(f64::NAN))),
    };
    batch
        .backward_into(opts, forward, d_out, &mut kept)
        .unwrap();
    let into = format!("{what}: backward_into");
    for (name, got, expected) in [
        ("d_q", &kept.d_q, &grads.d_q),
        ("d_k", &kept.d_k, &grads.d_k),
        ("d_v", &kept.d_v, &grads.d_v),
    ] {
        assert_bitwise(&got.view(), &expected.view(), &format!("{into} {name}"));
    }
    match (&kept.d_sinks, &grads.d_sinks) {
        (Some(got), Some(expected)) => {
            assert_bitwise(&got.view(), &expected.view(), &format!("{into} d_sinks"))
        }
        (None, None) => {}
        (got, _) => panic!("{into}: d_sinks is {got:?}"),
    }
}

/// Checks the packed backward against the 4-D backward of each sequence
/// alone, bitwise; `d_sinks` against the per-sequence ones summed in order;
/// and the `_into` forms against the allocating calls.
fn check_backward_against_each_sequence<F: Element>(
    batch: &Batch<F>,
    opts: &AttentionOptions<'_, F>,
    seed: u64,
    what: &str,
) {
    let forward = batch.partial(opts).unwrap();
    let d_out = batch.random_output(seed);
    let grads = batch.backward(opts, &forward, &d_out).unwrap();
    check_into_forms(batch, opts, &forward, &d_out, &grads, what);
    assert_eq!(grads.d_q.shape(), batch.q.shape());
    assert_eq!(grads.d_k.shape(), batch.k.shape());
    assert_eq!(grads.d_v.shape(), batch.v.shape());
    let mut summed: Option<Array1<F>> = None;
    for s in 0..batch.sequences() {
        let (queries, keys) = (batch.queries(s), batch.keys(s));
        let (q, k, v) = (
            alone(&batch.q, queries.clone()),
            alone(&batch.k, keys.clone()),
            alone(&batch.v, keys.clone()),
        );
        let forward4 = scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), opts)
            .expect("valid call");
        let expected = scaled_dot_product_attention_backward(
            q.view(),
            k.view(),
            v.view(),
            opts,
            &forward4,
            alone(&d_out, queries.clone()).view(),
        )
        .expect("valid call");
        let what = format!("{what}, sequence {s}");
        for (name, got, expected) in [
            ("d_q", alone(&grads.d_q, queries), &expected.d_q),
            ("d_k", alone(&grads.d_k, keys.clone()), &expected.d_k),
            ("d_v", alone(&grads.d_v, keys), &expected.d_v),
        ] {
            assert_bitwise(&got.view(), &expected.view(), &format!("{what}: {name}"));
        }
        if let Some(d_sinks) = &expected.d_sinks {
            let sum = summed.get_or_insert_with(|| Array1::zeros(d_sinks.len()));
            sum.zip_mut_with(d_sinks, |total, &x| *total = *total + x);
        }
    }
    match (&grads.d_sinks, &summed) {
        (Some(got), Some(expected)) => {
            assert_bitwise(&got.view(), &expected.view(), &format!("{what}: d_sinks"))
        }
        (None, None) => {}
        (got, expected) => panic!(
            "{what}: d_sinks {} on the packed call, {} on the sequences",
            got.is_some(),
            expected.is_some()
        ),
    }
}

#[test]
fn f32_backward_is_bitwise_the_per_sequence_backward_on_every_kernel_set() {
    for set in available_kernel_sets() {
        for (n, layout) in layouts().iter().enumerate() {
            let batch = Batch::<f32>::random(layout, 60 + n as u64);
            let modifiers = Modifiers::new(layout.heads);
            for (c, (name, opts)) in option_cases(&modifiers).into_iter().enumerate() {
                with_kernel_set(set, || {
                    check_backward_against_each_sequence(
                        &batch,
                        &opts,
                        70 + c as u64,
                        &format!("{set} layout {n} {name}"),
                    )
                })
                .unwrap();
            }
        }
    }
}

#[test]
fn f64_backward_is_bitwise_the_per_sequence_reference_backward() {
    for (n, layout) in layouts().iter().enumerate() {
        let batch = Batch::<f64>::random(layout, 80 + n as u64);
        let modifiers = Modifiers::new(layout.heads);
        for (c, (name, opts)) in option_cases(&modifiers).into_iter().enumerate() {
            check_backward_against_each_sequence(
                &batch,
                &opts,
                90 + c as u64,
                &format!("layout {n} {name}"),
            );
        }
    }
}

/// The five-point central difference of `loss` in every entry of `x`.
fn numeric_gradient<X: Clone>(
    x: &X,
    entries: usize,
    entry: impl Fn(&mut X, usize) -> &mut f64,
    loss: impl Fn(&X) -> f64,
) -> Vec<f64> {
    const STEP: f64 = 1e-3;
    (0..entries)
        .map(|e| {
            let at = |delta: f64| {
                let mut x = x.clone();
                *entry(&mut x, e) += delta;
                loss(&x)
            };
            (8.0 * (at(STEP) - at(-STEP)) - (at(2.0 * STEP) - at(-2.0 * STEP))) / (12.0 * STEP)
        })
        .collect()
}

/// `|g − fd| ≤ 1e-6 · max(|g|, |fd|, 1e-2)` for every entry.
#[track_caller]
fn assert_gradient(analytic: &[f64], numeric: &[f64], what: &str) {
    assert_eq!(analytic.len(), numeric.len());
    for (e, (&g, &fd)) in analytic.iter().zip(numeric).enumerate() {
        let error = (g - fd).abs() / g.abs().max(fd.abs()).max(1e-2);
        assert!(error <= 1e-6, "{what}[{e}]: analytic {g}, numeric {fd}");
    }
}

#[test]
fn f64_gradients_match_finite_differences() {
    // Sequence 1 has keys but no queries, sequence 3 queries but no keys.
    let layout = Layout {
        heads: 2,
        kv_heads: 1,
        d_k: 3,
        d_v: 2,
        q_lens: vec![3, 0, 2, 1, 4],
        kv_lens: vec![4, 2, 2, 0, 3],
    };
    let batch = Batch::<f64>::random(&layout, 100);
    let w = batch.random_output(101);
    let slopes = sdpa::alibi_slopes(2);
    let sinks = vec![0.3, -0.4];
    let with_sinks = |sinks: &[f64], case: usize| -> f64 {
        let opts = match case {
            0 => AttentionOptions::new(),
            1 => AttentionOptions::new()
                .causal()
                .alibi(&slopes)
                .sinks(sinks)
                .softcap(1.5),
            _ => AttentionOptions::new()
                .causal_aligned(CausalAlignment::TopLeft)
                .window(2)
                .sinks(sinks)
                .scale(0.7),
        };
        (&batch.forward(&opts).unwrap() * &w).sum()
    };
    for case in 0..3 {
        let opts = match case {
            0 => AttentionOptions::new(),
            1 => AttentionOptions::new()
                .causal()
                .alibi(&slopes)
                .sinks(&sinks)
                .softcap(1.5),
            _ => AttentionOptions::new()
                .causal_aligned(CausalAlignment::TopLeft)
                .window(2)
                .sinks(&sinks)
                .scale(0.7),
        };
        let forward = batch.partial(&opts).unwrap();
        let grads = batch.backward(&opts, &forward, &w).unwrap();
        let loss = |b: &Batch<f64>| (&b.forward(&opts).unwrap() * &w).sum();
        let flat = |a: &Array3<f64>| a.iter().copied().collect::<Vec<_>>();
        let what = format!("case {case}");
        assert_gradient(
            &flat(&grads.d_q),
            &numeric_gradient(
                &batch,
                batch.q.len(),
                |b, e| b.q.iter_mut().nth(e).unwrap(),
                loss,
            ),
            &format!("{what} d_q"),
        );
        assert_gradient(
            &flat(&grads.d_k),
            &numeric_gradient(
                &batch,
                batch.k.len(),
                |b, e| b.k.iter_mut().nth(e).unwrap(),
                loss,
            ),
            &format!("{what} d_k"),
        );
        assert_gradient(
            &flat(&grads.d_v),
            &numeric_gradient(
                &batch,
                batch.v.len(),
                |b, e| b.v.iter_mut().nth(e).unwrap(),
                loss,
            ),
            &format!("{what} d_v"),
        );
        match &grads.d_sinks {
            Some(d_sinks) => assert_gradient(
                d_sinks.as_slice().unwrap(),
                &numeric_gradient(
                    &sinks,
                    sinks.len(),
                    |s, e| &mut s[e],
                    |s| with_sinks(s, case),
                ),
                &format!("{what} d_sinks"),
            ),
            None => assert_eq!(case, 0, "d_sinks missing"),
        }
        // The keys of sequence 1 are seen by no query: exactly zero.
        let unseen = batch.keys(1);
        assert!(
            grads
                .d_k
                .slice(s![unseen.clone(), .., ..])
                .iter()
                .all(|&g| g == 0.0)
        );
        assert!(
            grads
                .d_v
                .slice(s![unseen, .., ..])
                .iter()
                .all(|&g| g == 0.0)
        );
        // Sequence 3's query sees no key: zero output and d_q.
        let blind = batch.queries(3);
        assert!(
            forward
                .output()
                .slice(s![blind.clone(), .., ..])
                .iter()
                .all(|&x| x == 0.0)
        );
        assert!(grads.d_q.slice(s![blind, .., ..]).iter().all(|&g| g == 0.0));
    }
}

/// NaN and ±inf in every row of sequence `poisoned` (queries, keys,
/// values and `d_out`) change no other sequence's output, log-sum-exp or
/// gradient, on one path.
fn check_poison_stays_in_its_sequence<F: Element>(what: &str) {
    let layout = &layouts()[0];
    let clean = Batch::<F>::random(layout, 110);
    let d_out = clean.random_output(111);
    let modifiers = Modifiers::<F>::new(layout.heads);
    // Sequence 3 is the long one; sequence 1 has keys and no queries.
    for poisoned in [3, 1, 7] {
        let mut dirty = clean.clone();
        let mut dirty_d_out = d_out.clone();
        let (queries, keys) = (clean.queries(poisoned), clean.keys(poisoned));
        dirty
            .q
            .slice_mut(s![queries.clone(), .., ..])
            .fill(F::nan());
        dirty.k.slice_mut(s![keys.clone(), .., ..]).fill(F::nan());
        dirty
            .v
            .slice_mut(s![keys.clone(), .., ..])
            .fill(F::infinity());
        dirty_d_out
            .slice_mut(s![queries.clone(), .., ..])
            .fill(F::nan());
        for (name, opts) in [
            ("none", AttentionOptions::new()),
            (
                "causal sinks",
                AttentionOptions::new().causal().sinks(&modifiers.sinks),
            ),
        ] {
            let what = format!("{what} {name}, sequence {poisoned} poisoned");
            let (f_clean, f_dirty) = (clean.partial(&opts).unwrap(), dirty.partial(&opts).unwrap());
            let g_clean = clean.backward(&opts, &f_clean, &d_out).unwrap();
            let g_dirty = dirty.backward(&opts, &f_dirty, &dirty_d_out).unwrap();
            if !queries.is_empty() {
                // The poison is real: the sequence's own output is NaN.
                assert!(
                    f_dirty
                        .output()
                        .slice(s![queries.clone(), .., ..])
                        .iter()
                        .any(|x| x.is_nan())
                );
            }
            for s in (0..clean.sequences()).filter(|&s| s != poisoned) {
                let (q_rows, kv_rows) = (clean.queries(s), clean.keys(s));
                let rows =
                    |a: &Array3<F>, r: &Range<usize>| a.slice(s![r.clone(), .., ..]).to_owned();
                let pairs = [
                    (
                        "output",
                        rows(&f_dirty.output().to_owned(), &q_rows),
                        rows(&f_clean.output().to_owned(), &q_rows),
                    ),
                    (
                        "d_q",
                        rows(&g_dirty.d_q, &q_rows),
                        rows(&g_clean.d_q, &q_rows),
                    ),
                    (
                        "d_k",
                        rows(&g_dirty.d_k, &kv_rows),
                        rows(&g_clean.d_k, &kv_rows),
                    ),
                    (
                        "d_v",
                        rows(&g_dirty.d_v, &kv_rows),
                        rows(&g_clean.d_v, &kv_rows),
                    ),
                ];
                for (array, dirty, clean) in pairs {
                    assert!(
                        dirty.iter().all(|x| x.is_finite()),
                        "{what}: {array} of sequence {s}"
                    );
                    assert_bitwise(
                        &dirty.view(),
                        &clean.view(),
                        &format!("{what}: {array} of sequence {s}"),
                    );
                }
                assert_bitwise(
                    &f_dirty.log_sum_exp().slice(s![q_rows.clone(), ..]),
                    &f_clean.log_sum_exp().slice(s![q_rows, ..]),
                    &format!("{what}: log-sum-exp of sequence {s}"),
                );
            }
        }
    }
}

#[test]
fn nan_in_one_sequence_never_reaches_another() {
    for set in available_kernel_sets() {
        with_kernel_set(set, || {
            check_poison_stays_in_its_sequence::<f32>(&format!("{set}"))
        })
        .unwrap();
    }
    check_poison_stays_in_its_sequence::<f64>("f64");
}

#[test]
fn results_are_bitwise_identical_for_one_two_and_three_threads() {
    // Many short sequences (the case sequence-level parallelism is for) and
    // a long one.
    let mut rng = Rng::new(120);
    let mut q_lens: Vec<usize> = (0..60).map(|_| rng.below(25)).collect();
    let mut kv_lens: Vec<usize> = q_lens.iter().map(|&l| l + rng.below(6)).collect();
    q_lens.push(200);
    kv_lens.push(260);
    let layout = Layout {
        heads: 4,
        kv_heads: 2,
        d_k: 32,
        d_v: 24,
        q_lens,
        kv_lens,
    };
    let batch = Batch::<f32>::random(&layout, 121);
    let d_out = batch.random_output(122);
    let modifiers = Modifiers::<f32>::new(layout.heads);
    let opts = AttentionOptions::new().causal().sinks(&modifiers.sinks);
    for set in available_kernel_sets() {
        // The kernel set is chosen on the calling thread, one of the pool's.
        let run = || {
            with_kernel_set(set, || {
                let out = batch.forward(&opts).unwrap();
                let forward = batch.partial(&opts).unwrap();
                let grads = batch.backward(&opts, &forward, &d_out).unwrap();
                (out, forward, grads)
            })
            .unwrap()
        };
        let (out, forward, grads) = with_threads(1, run);
        for threads in [2, 3] {
            let (out_n, forward_n, grads_n) = with_threads(threads, run);
            let what = |name: &str| format!("{set}, {threads} threads: {name}");
            assert_bitwise(&out_n.view(), &out.view(), &what("output"));
            assert_bitwise(&forward_n.output(), &forward.output(), &what("partial"));
            assert_bitwise(
                &forward_n.log_sum_exp(),
                &forward.log_sum_exp(),
                &what("lse"),
            );
            assert_bitwise(&grads_n.d_q.view(), &grads.d_q.view(), &what("d_q"));
            assert_bitwise(&grads_n.d_k.view(), &grads.d_k.view(), &what("d_k"));
            assert_bitwise(&grads_n.d_v.view(), &grads.d_v.view(), &what("d_v"));
            assert_bitwise(
                &grads_n.d_sinks.as_ref().unwrap().view(),
                &grads.d_sinks.as_ref().unwrap().view(),
                &what("d_sinks"),
            );
        }
    }
}

#[test]
fn empty_batches_sequences_and_value_widths_are_valid() {
    let sinks = [0.25, -1.0];
    let opts = AttentionOptions::new().causal().sinks(&sinks);
    // No sequences at all.
    let empty = Batch::<f64>::random(
        &Layout {
            heads: 2,
            kv_heads: 1,
            d_k: 4,
            d_v: 3,
            q_lens: vec![],
            kv_lens: vec![],
        },
        130,
    );
    assert_eq!(empty.cu_q, [0]);
    let forward = empty.partial(&opts).unwrap();
    assert_eq!(forward.output().shape(), &[0, 2, 3]);
    assert_eq!(forward.log_sum_exp().shape(), &[0, 2]);
    let grads = empty
        .backward(&opts, &forward, &Array3::zeros((0, 2, 3)))
        .unwrap();
    assert_eq!(grads.d_q.shape(), &[0, 2, 4]);
    assert_eq!(grads.d_sinks.unwrap().to_vec(), vec![0.0, 0.0]);
    // Empty sequences only, and sequences with queries and no keys: zero
    // output, log-sum-exp the sink (-inf without sinks).
    for (q_lens, kv_lens) in [
        (vec![0, 0, 0], vec![0, 0, 0]),
        (vec![2, 0, 3], vec![0, 0, 0]),
    ] {
        let batch = Batch::<f32>::random(
            &Layout {
                heads: 2,
                kv_heads: 2,
                d_k: 4,
                d_v: 3,
                q_lens,
                kv_lens,
            },
            131,
        );
        for set in available_kernel_sets() {
            with_kernel_set(set, || {
                let sinks = [0.25f32, -1.0];
                let with_sinks = AttentionOptions::new().sinks(&sinks);
                let forward = batch.partial(&with_sinks).unwrap();
                assert!(forward.output().iter().all(|&x| x == 0.0));
                for row in forward.log_sum_exp().rows() {
                    assert_eq!(row.to_vec(), sinks.to_vec());
                }
                let plain = batch.partial(&AttentionOptions::new()).unwrap();
                assert!(plain.log_sum_exp().iter().all(|&x| x == f32::NEG_INFINITY));
                let d_out = batch.random_output(132);
                let grads = batch.backward(&with_sinks, &forward, &d_out).unwrap();
                assert!(grads.d_q.iter().all(|&g| g == 0.0));
                assert_eq!(grads.d_sinks.unwrap().to_vec(), vec![0.0, 0.0]);
            })
            .unwrap();
        }
    }
    // d_v = 0: an empty output, but the log-sum-exp is still computed,
    // bitwise as each sequence's 4-D call computes it, and (the fused
    // path picks its driver by d_v too) within rounding of that of d_v = 1.
    let layout = Layout {
        d_v: 0,
        ..layouts()[0].clone()
    };
    let batch = Batch::<f32>::random(&layout, 133);
    let opts = AttentionOptions::new().causal();
    check_forward_against_each_sequence(&batch, &opts, "d_v = 0");
    let forward = batch.partial(&opts).unwrap();
    assert_eq!(forward.output().shape(), &[batch.q.dim().0, 4, 0]);
    let with_width = Batch {
        v: Array3::zeros((batch.k.dim().0, 2, 1)),
        ..batch.clone()
    };
    let expected = with_width.partial(&opts).unwrap();
    assert_close(&forward.log_sum_exp(), &expected.log_sum_exp(), 1e-6);
}

/// A base batch for the error cases: 2 sequences, GQA.
fn error_batch() -> Batch<f32> {
    Batch::random(
        &Layout {
            heads: 4,
            kv_heads: 2,
            d_k: 8,
            d_v: 6,
            q_lens: vec![3, 5],
            kv_lens: vec![4, 2],
        },
        140,
    )
}

/// Runs every entry point on `batch` with `opts` (the backward with a
/// forward result and `d_out` of the right shape) and checks that each
/// fails with `kind` and a message containing every needle, and that
/// `_into` leaves its buffer untouched.
#[track_caller]
fn expect_error(
    batch: &Batch<f32>,
    opts: &AttentionOptions<'_, f32>,
    kind: ErrorKind,
    needles: &[&str],
) {
    let (q, k, v) = (batch.q.view(), batch.k.view(), batch.v.view());
    let (total_q, heads, d_v) = (q.dim().0, q.dim().1, v.dim().2);
    let mut buffer = Array3::from_elem((total_q, heads, d_v), 7.0f32);
    let forward = VarlenPartial::from_parts(
        Array3::zeros((total_q, heads, d_v)),
        Array2::zeros((total_q, heads)),
    )
    .unwrap();
    let d_out = Array3::zeros((total_q, heads, d_v));
    let mut kept_forward = VarlenPartial::from_parts(
        Array3::from_elem((total_q, heads, d_v), 7.0),
        Array2::from_elem((total_q, heads), 7.0),
    )
    .unwrap();
    let mut kept_gradients = VarlenGradients {
        d_q: batch.q.mapv(|_| 7.0),
        d_k: batch.k.mapv(|_| 7.0),
        d_v: batch.v.mapv(|_| 7.0),
        d_sinks: Some(Array1::from_elem(1, 7.0)),
    };
    let (cu_q, cu_kv) = (&batch.cu_q[..], &batch.cu_kv[..]);
    let results = [
        ("varlen", batch.forward(opts).map(|_| ())),
        ("partial", batch.partial(opts).map(|_| ())),
        (
            "into",
            scaled_dot_product_attention_varlen_into(q, k, v, cu_q, cu_kv, opts, buffer.view_mut()),
        ),
        (
            "backward",
            batch.backward(opts, &forward, &d_out).map(|_| ()),
        ),
        ("partial_into", batch.partial_into(opts, &mut kept_forward)),
        (
            "backward_into",
            batch.backward_into(opts, &forward, &d_out, &mut kept_gradients),
        ),
    ];
    for (entry, result) in results {
        let error = result.expect_err(entry);
        assert_eq!(error.kind(), kind, "{entry}: {error}");
        for needle in needles {
            assert!(
                error.to_string().contains(needle),
                "{entry}: {error:?} does not mention {needle:?}"
            );
        }
    }
    assert!(
        buffer.iter().all(|&x| x == 7.0),
        "_into wrote before failing"
    );
    let (output, lse) = kept_forward.into_parts();
    let untouched = output.iter().chain(lse.iter()).all(|&x| x == 7.0);
    assert!(untouched, "partial_into wrote before failing");
    let g = &kept_gradients;
    let d_sinks = g.d_sinks.iter().flatten();
    let untouched = g.d_q.iter().chain(&g.d_k).chain(&g.d_v).chain(d_sinks);
    assert!(
        untouched.into_iter().all(|&x| x == 7.0) && g.d_sinks.is_some(),
        "backward_into wrote before failing"
    );
}

#[test]
fn bad_offsets_are_errors_naming_the_index_and_values() {
    let base = error_batch(); // cu_q [0, 3, 8], cu_kv [0, 4, 6]
    let opts = AttentionOptions::new();
    let with = |cu_q: &[usize], cu_kv: &[usize]| Batch {
        cu_q: cu_q.to_vec(),
        cu_kv: cu_kv.to_vec(),
        ..base.clone()
    };
    let kind = ErrorKind::SequenceOffsets;
    expect_error(
        &with(&[], &[0, 4, 6]),
        &opts,
        kind,
        &["cu_seqlens_q is empty", "total_q = 8"],
    );
    expect_error(
        &with(&[0, 3, 8], &[]),
        &opts,
        kind,
        &["cu_seqlens_kv is empty", "total_kv = 6"],
    );
    expect_error(
        &with(&[1, 3, 8], &[0, 4, 6]),
        &opts,
        kind,
        &["cu_seqlens_q[0] = 1"],
    );
    expect_error(
        &with(&[0, 3, 8], &[0, 4, 3, 6]),
        &opts,
        kind,
        &["cu_seqlens_kv[2] = 3 is less than cu_seqlens_kv[1] = 4"],
    );
    expect_error(
        &with(&[0, 3, 7], &[0, 4, 6]),
        &opts,
        kind,
        &["cu_seqlens_q[2] = 7", "q has total_q = 8"],
    );
    expect_error(
        &with(&[0, 3, 9], &[0, 4, 6]),
        &opts,
        kind,
        &["cu_seqlens_q[2] = 9", "q has total_q = 8"],
    );
    expect_error(
        &with(&[0, 3, 8], &[0, 4, 7]),
        &opts,
        kind,
        &["cu_seqlens_kv[2] = 7", "k and v have total_kv = 6"],
    );
    expect_error(
        &with(&[0, 3, 8], &[0, 1, 4, 6]),
        &opts,
        kind,
        &[
            "cu_seqlens_q has 3 offsets (2 sequences)",
            "cu_seqlens_kv has 4 (3 sequences)",
        ],
    );
    // A batch of one sequence with no tokens while q has some.
    expect_error(
        &with(&[0], &[0]),
        &opts,
        kind,
        &["cu_seqlens_q[0] = 0", "total_q = 8"],
    );
}

#[test]
fn bad_shapes_are_errors_naming_the_packed_shapes() {
    let base = error_batch();
    let opts = AttentionOptions::new();
    let (total_q, total_kv) = (8, 6);
    let cases: Vec<(Batch<f32>, ErrorKind, &[&str])> = vec![
        (
            Batch {
                q: Array3::zeros((total_q, 4, 0)),
                k: Array3::zeros((total_kv, 2, 0)),
                ..base.clone()
            },
            ErrorKind::ZeroDimension,
            &["d_k must be positive", "[total_q, heads, d_k]"],
        ),
        (
            Batch {
                k: Array3::zeros((total_kv, 2, 7)),
                ..base.clone()
            },
            ErrorKind::ShapeMismatch,
            &["d_k of q and k differ", "k [6, 2, 7]"],
        ),
        (
            Batch {
                v: Array3::zeros((total_kv + 1, 2, 6)),
                cu_kv: vec![0, 4, 6],
                ..base.clone()
            },
            ErrorKind::ShapeMismatch,
            &["total_kv of k and v differ", "v [7, 2, 6]"],
        ),
        (
            Batch {
                v: Array3::zeros((total_kv, 1, 6)),
                ..base.clone()
            },
            ErrorKind::ShapeMismatch,
            &["kv_heads of k and v differ"],
        ),
        (
            Batch {
                q: Array3::zeros((total_q, 0, 8)),
                ..base.clone()
            },
            ErrorKind::ZeroDimension,
            &["heads and kv_heads must be positive"],
        ),
        (
            Batch {
                k: Array3::zeros((total_kv, 0, 8)),
                v: Array3::zeros((total_kv, 0, 6)),
                ..base.clone()
            },
            ErrorKind::ZeroDimension,
            &["heads and kv_heads must be positive"],
        ),
        (
            Batch {
                k: Array3::zeros((total_kv, 3, 8)),
                v: Array3::zeros((total_kv, 3, 6)),
                ..base.clone()
            },
            ErrorKind::HeadsNotDivisible,
            &["heads (4) must be a multiple of kv_heads (3)"],
        ),
    ];
    for (batch, kind, needles) in cases {
        expect_error(&batch, &opts, kind, needles);
    }
}

#[test]
fn padded_layout_options_are_rejected_with_the_reason() {
    let batch = error_batch();
    let keep = Array4::from_elem((1, 1, 1, 1), true);
    let too_many_axes = ndarray::Array5::from_elem((1, 1, 1, 1, 1), true);
    let bias = Array2::<f32>::zeros((8, 6));
    let lengths = [4, 2];
    let kind = ErrorKind::InvalidOption;
    let cases: [(AttentionOptions<'_, f32>, &[&str]); 7] = [
        (
            AttentionOptions::new().keep_mask(keep.view()),
            &["keep_mask is not supported on a packed batch", "padded"],
        ),
        (
            AttentionOptions::new().keep_mask(too_many_axes.view()),
            &["keep_mask is not supported"],
        ),
        (
            AttentionOptions::new().bias(bias.view()),
            &["bias is not supported on a packed batch", "alibi"],
        ),
        (
            AttentionOptions::new().key_lengths(&lengths),
            &[
                "key_lengths and key_starts are not supported",
                "cu_seqlens_kv",
            ],
        ),
        (
            AttentionOptions::new().key_starts(&lengths),
            &[
                "key_lengths and key_starts are not supported",
                "cu_seqlens_kv",
            ],
        ),
        (
            AttentionOptions::new().key_shard(0, 6),
            &["key_shard is not supported"],
        ),
        (
            AttentionOptions::new().causal().key_shard(2, 10),
            &["key_shard is not supported"],
        ),
    ];
    for (opts, needles) in cases {
        expect_error(&batch, &opts, kind, needles);
    }
}

#[test]
fn bad_options_are_errors_even_for_an_empty_batch() {
    let two_slopes = [0.5f32, 0.25];
    let nan_sinks = [0.0f32, f32::NAN, 0.0, 0.0];
    let cases: [(AttentionOptions<'_, f32>, &[&str]); 5] = [
        (
            AttentionOptions::new().scale(f32::NAN),
            &["scale must be finite"],
        ),
        (
            AttentionOptions::new().window(0),
            &["window must be at least 1"],
        ),
        (
            AttentionOptions::new().alibi(&two_slopes),
            &["alibi has 2 entries", "4 query heads"],
        ),
        (
            AttentionOptions::new().sinks(&nan_sinks),
            &["sinks[1] must be finite"],
        ),
        (
            AttentionOptions::new().softcap(-1.0),
            &["softcap must be positive"],
        ),
    ];
    let base = error_batch();
    let empty = Batch {
        cu_q: vec![0],
        cu_kv: vec![0],
        q: Array3::zeros((0, 4, 8)),
        k: Array3::zeros((0, 2, 8)),
        v: Array3::zeros((0, 2, 6)),
        ..base.clone()
    };
    for (opts, needles) in cases {
        expect_error(&base, &opts, ErrorKind::InvalidOption, needles);
        expect_error(&empty, &opts, ErrorKind::InvalidOption, needles);
    }
}

#[test]
fn wrong_output_forward_and_d_out_shapes_are_errors() {
    let batch = error_batch();
    let (q, k, v) = (batch.q.view(), batch.k.view(), batch.v.view());
    let opts = AttentionOptions::new();
    let (cu_q, cu_kv) = (&batch.cu_q[..], &batch.cu_kv[..]);
    let mut out = Array3::from_elem((8, 4, 5), 7.0f32);
    let error =
        scaled_dot_product_attention_varlen_into(q, k, v, cu_q, cu_kv, &opts, out.view_mut())
            .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    assert!(
        error.to_string().contains("out has shape [8, 4, 5]"),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("[total_q, heads, d_v] = [8, 4, 6]"),
        "{error}"
    );
    assert!(out.iter().all(|&x| x == 7.0));

    let forward = batch.partial(&opts).unwrap();
    let d_out = Array3::<f32>::zeros((8, 4, 6));
    let short = VarlenPartial::from_parts(Array3::zeros((7, 4, 6)), Array2::zeros((7, 4))).unwrap();
    let error = batch.backward(&opts, &short, &d_out).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    assert!(
        error
            .to_string()
            .contains("the forward's output has shape [7, 4, 6]"),
        "{error}"
    );
    let error = batch
        .backward(&opts, &forward, &Array3::zeros((8, 4, 7)))
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    assert!(
        error.to_string().contains("d_out has shape [8, 4, 7]"),
        "{error}"
    );

    let error = VarlenPartial::<f32>::from_parts(Array3::zeros((8, 4, 6)), Array2::zeros((4, 8)))
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    assert!(
        error.to_string().contains("[total_q, heads] = [8, 4]"),
        "{error}"
    );
    let (output, log_sum_exp) = forward.clone().into_parts();
    assert_eq!(
        VarlenPartial::from_parts(output, log_sum_exp).unwrap(),
        forward
    );

    // The caller's arrays of the `_into` forms: a wrong shape is an error
    // naming the array, and nothing is written.
    let mut written = short.clone();
    let error = batch.partial_into(&opts, &mut written).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
    assert!(
        error
            .to_string()
            .contains("partial's output has shape [7, 4, 6]"),
        "{error}"
    );
    assert_eq!(written, short, "nothing is written");
    let d_out = batch.random_output(141);
    let grads = batch.backward(&opts, &forward, &d_out).unwrap();
    type Spoil = fn(&mut VarlenGradients<f32>);
    let wrong: [(&str, Spoil); 3] = [
        ("d_q has shape [8, 4, 6] but q", |g| {
            g.d_q = Array3::zeros((8, 4, 6))
        }),
        ("d_k has shape [6, 4, 8] but k", |g| {
            g.d_k = Array3::zeros((6, 4, 8))
        }),
        ("d_v has shape [5, 2, 6] but v", |g| {
            g.d_v = Array3::zeros((5, 2, 6))
        }),
    ];
    for (needle, spoil) in wrong {
        let mut gradients = grads.clone();
        spoil(&mut gradients);
        let mut written = gradients.clone();
        let error = batch
            .backward_into(&opts, &forward, &d_out, &mut written)
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::ShapeMismatch);
        assert!(error.to_string().contains(needle), "{error}");
        assert_eq!(written, gradients, "nothing is written");
    }
}
