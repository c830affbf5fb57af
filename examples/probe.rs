//! A fixed amount of work for instruction counting: `calls` attention calls
//! on the throughput example's data, no timing, no warm-up loop, so that
//! `valgrind --tool=callgrind` counts the same instructions every run.
//!
//! ```text
//! cargo build --release --example probe
//! SDPA_KERNEL=avx2 valgrind --tool=callgrind target/release/examples/probe 256 causal fwd 3
//! SDPA_KERNEL=avx2 valgrind --tool=callgrind target/release/examples/probe 1024 full fwd 3 alibi
//! SDPA_KERNEL=avx2 valgrind --tool=callgrind target/release/examples/probe 4096 causal decode 20 sinks
//! ```
//!
//! Arguments: `N` (default 256), `causal` or `full`, then the work:
//! - `fwd`: the forward with its log-sum-exp, `len_q = len_kv = N`;
//! - `bwd`: that forward, then the backward;
//! - `decode`: one query row per head against `N` keys and values (the
//!   decode driver, keys read in place);
//!
//! then the number of calls (default 3), and a score modifier (default
//! `plain`, none): `alibi` (the standard slopes, [`sdpa::alibi_slopes`]),
//! `softcap` (cap 30, or `SOFTCAP`) or `sinks` (one logit per head, −1 to 0.75). B = 1,
//! H = 8 and d = 64 unless `H`/`D` are set; `KV` sets the key/value heads
//! of a decode run (grouped-query decoding, e.g. `H=32 KV=8`).
//!
//! `DTYPE=bf16` or `f16` runs the calls on inputs stored in that type
//! (`half` feature); `DTYPE=bf16-by-hand` converts them to `f32` first,
//! calls the `f32` path and rounds the output back, the bar a half call
//! must meet on a CPU without native BF16.
//! `AMX=1` forces prefills onto AMX tiles wherever they can run (`f32`
//! by the three-way split too), `AMX=0` keeps them off
//! ([`sdpa::simd::with_amx`]); `BF16_DOT` likewise for native `bf16`
//! ([`sdpa::simd::with_bf16_dot`]), as in the throughput example.
//! Valgrind has no AVX-512: force `SDPA_KERNEL=avx2` (or `scalar`) under it.

use ndarray::{Array3, Array4};
use sdpa::{AttentionGradients, AttentionOptions, AttentionPartial, Storage};

#[path = "support/machine.rs"]
mod machine;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The score modifier a probe run applies.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Modifier {
    Plain,
    Alibi,
    Softcap,
    Sinks,
}

impl Modifier {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "plain" => Some(Modifier::Plain),
            "alibi" => Some(Modifier::Alibi),
            "softcap" => Some(Modifier::Softcap),
            "sinks" => Some(Modifier::Sinks),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Modifier::Plain => "plain",
            Modifier::Alibi => "alibi",
            Modifier::Softcap => "softcap",
            Modifier::Sinks => "sinks",
        }
    }
}

/// Options with `modifier` applied; `slopes` and `sinks` hold one value
/// per head.
fn with_modifier<'a>(
    opts: AttentionOptions<'a, f32>,
    modifier: Modifier,
    slopes: &'a [f32],
    sinks: &'a [f32],
) -> AttentionOptions<'a, f32> {
    match modifier {
        Modifier::Plain => opts,
        Modifier::Alibi => opts.alibi(slopes),
        Modifier::Softcap => opts.softcap(softcap_cap()),
        Modifier::Sinks => opts.sinks(sinks),
    }
}

/// The softcap's cap: `SOFTCAP` if set, else 30. A small cap moves the
/// scores past `tanh`'s switch point (`|s| ≥ 0.6·cap`), its slow form.
fn softcap_cap() -> f32 {
    std::env::var("SOFTCAP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30.0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n = args.first().and_then(|a| a.parse().ok()).unwrap_or(256);
    let causal = args.iter().any(|a| a == "causal");
    let backward = args.iter().any(|a| a == "bwd");
    let decode = args.iter().any(|a| a == "decode");
    let calls = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(3);
    let modifier = match args.get(4) {
        None => Modifier::Plain,
        Some(name) => Modifier::parse(name).unwrap_or_else(|| {
            eprintln!("unknown modifier {name:?}: plain, alibi, softcap or sinks");
            std::process::exit(2)
        }),
    };
    let (heads, d) = (env_or("H", 8), env_or("D", 64));
    let len_q = if decode { 1 } else { n };
    let q = Array4::<f32>::from_shape_fn((1, heads, len_q, d), |(b, h, i, c)| {
        (((b * 31 + h * 17 + i * 7 + c * 3) % 23) as f32 - 11.0) / 11.0
    });
    let (k, v) = if decode {
        let kv_heads = env_or("KV", heads);
        let k = Array4::<f32>::from_shape_fn((1, kv_heads, n, d), |(_, h, j, c)| {
            ((h + j * 3 + c * 5) % 17) as f32 / 17.0 - 0.5
        });
        let v = k.mapv(|x| x * 0.5 + 0.1);
        (k, v)
    } else {
        (q.mapv(|x| -x * 0.5), q.mapv(|x| x * 0.25 + 0.1))
    };
    let slopes: Vec<f32> = sdpa::alibi_slopes(heads)
        .into_iter()
        .map(|s| s as f32)
        .collect();
    let sinks: Vec<f32> = (0..heads).map(|h| (h % 8) as f32 * 0.25 - 1.0).collect();
    let opts = AttentionOptions::new();
    let opts = if causal { opts.causal() } else { opts };
    let opts = with_modifier(opts, modifier, &slopes, &sinks);
    let dtype = std::env::var("DTYPE").unwrap_or_else(|_| "f32".into());
    let calls_on_inputs = || match dtype.as_str() {
        "f32" => run([q, k, v], &opts, backward, calls),
        #[cfg(feature = "half")]
        "bf16" => run(
            [&q, &k, &v].map(|x| x.mapv(sdpa::half::bf16::from_f32)),
            &opts,
            backward,
            calls,
        ),
        #[cfg(feature = "half")]
        "f16" => run(
            [&q, &k, &v].map(|x| x.mapv(sdpa::half::f16::from_f32)),
            &opts,
            backward,
            calls,
        ),
        #[cfg(feature = "half")]
        "bf16-by-hand" => by_hand(
            [&q, &k, &v].map(|x| x.mapv(sdpa::half::bf16::from_f32)),
            &opts,
            calls,
        ),
        other => panic!("DTYPE {other}: f32, bf16, f16 or bf16-by-hand (with the half feature)"),
    };
    let checksum = machine::with_bf16_choice(calls_on_inputs);
    let work = if decode {
        "decode"
    } else if backward {
        "bwd"
    } else {
        "fwd"
    };
    println!(
        "{n} {} {work} {} {dtype} x{calls}: checksum {checksum:.6e}",
        if causal { "causal" } else { "full" },
        modifier.name(),
    );
}

/// `calls` forwards (and backwards) on `[q, k, v]`.
fn run<F: Storage + Into<f64>>(
    [q, k, v]: [Array4<F>; 3],
    opts: &AttentionOptions<'_, F::Compute>,
    backward: bool,
    calls: usize,
) -> f64 {
    let widen = |x: &F| -> f64 { (*x).into() };
    // The results go into arrays kept across calls, as a training loop
    // keeps them: fresh ones would add the allocator's page faults.
    let (b, h, n, _) = q.dim();
    let output = Array4::zeros((b, h, n, v.dim().3));
    let mut forward =
        AttentionPartial::from_parts(output, Array3::zeros((b, h, n))).expect("consistent shapes");
    // Any d_out of the output's shape will do: the work does not depend on
    // it. Here `q`'s, the output's shape since the probe's d_k = d_v; no
    // bias, so no `d_bias`.
    let d_out = q.to_owned();
    let mut gradients = AttentionGradients {
        d_q: Array4::zeros(q.raw_dim()),
        d_k: Array4::zeros(k.raw_dim()),
        d_v: Array4::zeros(v.raw_dim()),
        d_bias: None,
        d_sinks: None,
    };
    let (q, k, v) = (q.view(), k.view(), v.view());
    let mut checksum = 0.0f64;
    for _ in 0..calls {
        sdpa::scaled_dot_product_attention_partial_into(q, k, v, opts, &mut forward)
            .expect("valid shapes");
        if backward {
            sdpa::scaled_dot_product_attention_backward_into(
                q,
                k,
                v,
                opts,
                &forward,
                d_out.view(),
                &mut gradients,
            )
            .expect("valid shapes");
            checksum += gradients.d_q.iter().map(widen).sum::<f64>();
        }
        checksum += forward.output().iter().map(widen).sum::<f64>();
    }
    checksum
}

/// `calls` forwards of bf16 inputs done by hand: each converted to `f32`,
/// the `f32` call, the output rounded to bf16.
#[cfg(feature = "half")]
fn by_hand(
    [q, k, v]: [Array4<sdpa::half::bf16>; 3],
    opts: &AttentionOptions<'_, f32>,
    calls: usize,
) -> f64 {
    use sdpa::half::bf16;
    let mut checksum = 0.0f64;
    for _ in 0..calls {
        let (q, k, v) = (q.mapv(f32::from), k.mapv(f32::from), v.mapv(f32::from));
        let partial =
            sdpa::scaled_dot_product_attention_partial(q.view(), k.view(), v.view(), opts)
                .expect("valid shapes");
        let out = partial.output().mapv(bf16::from_f32);
        checksum += out.iter().map(|&x| f64::from(x)).sum::<f64>();
    }
    checksum
}
