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
//! `softcap` (cap 30) or `sinks` (one logit per head, −1 to 0.75). B = 1,
//! H = 8 and d = 64 unless `H`/`D` are set.
//! Valgrind has no AVX-512: force `SDPA_KERNEL=avx2` (or `scalar`) under it.

use ndarray::Array4;
use sdpa::AttentionOptions;

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
        Modifier::Softcap => opts.softcap(30.0),
        Modifier::Sinks => opts.sinks(sinks),
    }
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
        let k = Array4::<f32>::from_shape_fn((1, heads, n, d), |(_, h, j, c)| {
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
    let work = if decode {
        "decode"
    } else if backward {
        "bwd"
    } else {
        "fwd"
    };
    println!(
        "{n} {} {work} {} x{calls}: checksum {checksum:.6e}",
        if causal { "causal" } else { "full" },
        modifier.name(),
    );
}
