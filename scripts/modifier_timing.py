#!/usr/bin/env python3
"""Times the score modifiers against the plain fused forward (issue 12) with
`examples/probe.rs`, on a machine shared with other work.

    cargo build --release --example probe
    python3 scripts/modifier_timing.py [ROUNDS] [SDPA_KERNEL]

Each measurement is the probe's CPU time (user + system of the child, from
`wait4`), not wall-clock: the probe runs on one thread
(`RAYON_NUM_THREADS=1`), and on a shared machine its wall-clock time
includes waiting for a core. A run with 0 calls (set-up only) is
subtracted, and the rest divided by the calls. Rounds interleave plain,
ALiBi, softcap and sinks; the ratio to plain is taken within each round and
its median (and range) printed, with the load average, so a table can say
how quiet the machine was. Instruction counts (callgrind) are the exact
measurement; see docs/PERFORMANCE.md, "Modifier costs".
"""

import os
import statistics
import subprocess
import sys

PROBE = "target/release/examples/probe"
# (N, mask, work, calls per run)
CONFIGS = [
    ("1024", "full", "fwd", 20),
    ("1024", "causal", "fwd", 30),
    ("4096", "causal", "decode", 3000),
]
MODIFIERS = {
    "fwd": ["plain", "alibi", "softcap", "sinks"],
    "decode": ["plain", "alibi", "sinks", "softcap"],
}


def cpu_seconds(env, n, mask, work, calls, modifier):
    child = subprocess.Popen(
        [PROBE, n, mask, work, str(calls), modifier],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        sys.exit(f"{PROBE} failed with status {status}")
    return usage.ru_utime + usage.ru_stime


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    if len(sys.argv) > 2:
        env["SDPA_KERNEL"] = sys.argv[2]
    print(f"kernel set: {env.get('SDPA_KERNEL', 'default')}; {rounds} rounds")
    times = {}
    for r in range(rounds):
        for n, mask, work, calls in CONFIGS:
            for modifier in MODIFIERS[work]:
                setup = cpu_seconds(env, n, mask, work, 0, modifier)
                total = cpu_seconds(env, n, mask, work, calls, modifier)
                times.setdefault((n, mask, work, modifier), []).append((total - setup) / calls)
        with open("/proc/loadavg") as load:
            print(f"round {r + 1}: load average {' '.join(load.read().split()[:3])}", flush=True)
    for n, mask, work, calls in CONFIGS:
        plain = times[(n, mask, work, "plain")]
        for modifier in MODIFIERS[work]:
            t = times[(n, mask, work, modifier)]
            ratios = [a / b for a, b in zip(t, plain)]
            print(
                f"{work} N={n} {mask} {modifier:8} median {statistics.median(t) * 1e3:8.3f} ms"
                f" ({calls} calls a run); ratio to plain: median {statistics.median(ratios):.3f}"
                f" [{min(ratios):.3f}..{max(ratios):.3f}]"
            )


if __name__ == "__main__":
    main()
