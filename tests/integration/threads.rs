//! The fast path gives bitwise the same output for any thread count.

use crate::common::{engines, with_threads};
use ndarray::Array4;
use sdpa::AttentionOptions;

fn data(dim: (usize, usize, usize, usize), seed: usize) -> Array4<f32> {
    Array4::from_shape_fn(dim, |(b, h, i, c)| {
        let x = (b * 7919 + h * 104_729 + i * 31 + c * 17 + seed * 1_000_003) % 1009;
        x as f32 / 504.5 - 1.0
    })
}

#[test]
fn output_is_bitwise_identical_for_one_two_and_three_threads() {
    // Every engine: on a CPU with AMX the `f32` prefill on the tiles too
    // (forced for d_k = 64; by the rule for 128).
    for set in engines() {
        for (heads, kv_heads, len_q, len_kv, causal, d_k) in [
            (4, 2, 300, 300, true, 40),
            (4, 2, 300, 300, true, 64),
            (2, 1, 520, 520, false, 128),
            (2, 1, 3, 2100, true, 40),
            (3, 3, 1, 1000, false, 40),
            (2, 1, 97, 130, false, 64),
            (8, 8, 5, 5, true, 40),
        ] {
            let q = data((2, heads, len_q, d_k), 1);
            let k = data((2, kv_heads, len_kv, d_k), 2);
            let v = data((2, kv_heads, len_kv, 24), 3);
            let opts = AttentionOptions::new();
            let opts = if causal { opts.causal() } else { opts };
            // The kernel set is chosen on the calling thread, which here is
            // one of the pool's.
            let run = || {
                set.run(|| sdpa::scaled_dot_product_attention(q.view(), k.view(), v.view(), &opts))
                    .unwrap()
                    .unwrap()
            };
            let one = with_threads(1, run);
            for threads in [2, 3] {
                let many = with_threads(threads, run);
                assert!(
                    one.iter()
                        .zip(&many)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{set}: {threads} threads differ from one"
                );
            }
        }
    }
}
