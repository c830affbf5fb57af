//! A fixed amount of work for instruction counting: `calls` attention calls
//! on the throughput example's data, no timing, no warm-up loop, so that
//! `valgrind --tool=callgrind` counts the same instructions every run.
//!
//! ```text
//! cargo build --release --example probe
//! SDPA_KERNEL=avx2 valgrind --tool=callgrind target/release/examples/probe 256 causal fwd 3
//! ```
//!
//! Arguments: `N` (default 256), `causal` or `full`, `fwd` or `bwd`
//! (forward with its log-sum-exp, then the backward), and the number of
//! calls (default 3). B = 1, H = 8 and d = 64 unless `H`/`D` are set.
//! Valgrind has no AVX-512: force `SDPA_KERNEL=avx2` (or `scalar`) under it.

use ndarray::Array4;
use sdpa::AttentionOptions;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n = args.first().and_then(|a| a.parse().ok()).unwrap_or(256);
    let causal = args.iter().any(|a| a == "causal");
    let backward = args.iter().any(|a| a == "bwd");
    let calls = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(3);
    let (heads, d) = (env_or("H", 8), env_or("D", 64));
    let q = Array4::<f32>::from_shape_fn((1, heads, n, d), |(b, h, i, c)| {
        (((b * 31 + h * 17 + i * 7 + c * 3) % 23) as f32 - 11.0) / 11.0
    });
    let (k, v) = (q.mapv(|x| -x * 0.5), q.mapv(|x| x * 0.25 + 0.1));
    let opts = AttentionOptions::new();
    let opts = if causal { opts.causal() } else { opts };
    let mut checksum = 0.0f64;
    for _ in 0..calls {
        let forward =
            sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), &opts)
                .expect("valid shapes");
        if backward {
            let gradients = sdpa::scaled_dot_product_attention_backward(
                q.view(),
                k.view(),
                v.view(),
                &opts,
                &forward,
                forward.output(),
            )
            .expect("valid shapes");
            checksum += f64::from(gradients.d_q.sum());
        }
        checksum += f64::from(forward.output().sum());
    }
    println!(
        "{n} {} {} x{calls}: checksum {checksum:.6e}",
        if causal { "causal" } else { "full" },
        if backward { "bwd" } else { "fwd" }
    );
}
