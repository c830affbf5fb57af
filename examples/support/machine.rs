//! What the examples print in their headers, so every table they produce
//! can be traced to its machine: the CPU model, the kernel set and its
//! measured peak; and the kernel choices their environment forces.

/// The CPU's model name (`/proc/cpuinfo` on Linux), or the architecture
/// where that is not available.
#[allow(dead_code)]
pub fn cpu_model() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        });
    let family_model = std::fs::read_to_string("/proc/cpuinfo").ok().map(|info| {
        let field = |name: &str| {
            info.lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        format!("family {} model {}", field("cpu family"), field("model"))
    });
    match (model, family_model) {
        (Some(model), Some(fm)) => format!("CPU: {model} ({fm})"),
        _ => format!("CPU: {}", std::env::consts::ARCH),
    }
}

/// The kernel set calls use, and its measured one-thread FMA peak in
/// GFLOP/s.
#[allow(dead_code)]
pub fn selected_set_and_peak() -> (sdpa::simd::KernelSet, f64) {
    let set = sdpa::simd::selected_kernel_set().expect("a usable kernel set");
    (
        set,
        sdpa::simd::fma_peak(set).expect("the selected set runs"),
    )
}

/// `f` with the `bf16` choices `AMX` and `BF16_DOT` force, if set (`0`
/// turns one off, anything else on; see `sdpa::simd::with_amx` and
/// `with_bf16_dot`).
#[allow(dead_code)]
pub fn with_bf16_choice<R>(f: impl FnOnce() -> R) -> R {
    let forced = |name| std::env::var(name).ok().map(|v| v != "0");
    let f = || match forced("AMX") {
        Some(enabled) => sdpa::simd::with_amx(enabled, f),
        None => f(),
    };
    match forced("BF16_DOT") {
        Some(native) => sdpa::simd::with_bf16_dot(native, f),
        None => f(),
    }
}
