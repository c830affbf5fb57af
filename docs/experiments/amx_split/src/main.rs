//! Feasibility measurement: f32 attention products on AMX-BF16 via a 3-way bf16 split.
//! Usage: amx_split <acc|peak|qk|pv|step|split|all> [args]
#![allow(clippy::missing_safety_doc)]
use std::arch::asm;
use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

// ---------------------------------------------------------------- utilities
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unif(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// normal-ish: sum of 4 uniforms, unit variance
    fn normalish(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| self.unif()).sum::<f64>() - 2.0;
        (s * 3f64.sqrt()) as f32
    }
    /// sign * 2^e * (1+u), e uniform in [-20, 20)
    fn spread(&mut self) -> f32 {
        let e = self.unif() * 40.0 - 20.0;
        let s = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
        (s * e.exp2()) as f32
    }
}

/// bf16 round-to-nearest-even of a finite f32 (bits); DAZ-free.
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16) as u16
}
fn bf16_val(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}
/// n-way split: parts[i] = bf16(remainder)
fn split(x: f32, n: usize) -> [u16; 3] {
    let mut out = [0u16; 3];
    let mut r = x;
    for o in out.iter_mut().take(n) {
        *o = bf16_bits(r);
        r -= bf16_val(*o); // exact
    }
    out
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

// ---------------------------------------------------------------- AMX plumbing
#[repr(C, align(64))]
struct TileConfig([u8; 64]);
static CONFIG: TileConfig = {
    let mut b = [0u8; 64];
    b[0] = 1;
    let mut t = 0;
    while t < 8 {
        b[16 + 2 * t] = 64;
        b[48 + t] = 16;
        t += 1;
    }
    TileConfig(b)
};

fn amx_init() {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    assert_eq!(r, 0, "arch_prctl(ARCH_REQ_XCOMP_PERM) failed");
    unsafe { asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly, preserves_flags)) };
}

#[inline(always)]
unsafe fn tl<const T: u8, E>(base: *const E, stride: usize) {
    asm!("tileloadd tmm{t}, [{b} + {s}*1]", t = const T, b = in(reg) base, s = in(reg) stride,
        options(nostack, readonly, preserves_flags));
}
#[inline(always)]
unsafe fn ts<const T: u8, E>(base: *mut E, stride: usize) {
    asm!("tilestored [{b} + {s}*1], tmm{t}", t = const T, b = in(reg) base, s = in(reg) stride,
        options(nostack, preserves_flags));
}
#[inline(always)]
unsafe fn tz<const T: u8>() {
    asm!("tilezero tmm{t}", t = const T, options(nomem, nostack, preserves_flags));
}
#[inline(always)]
unsafe fn dp<const C: u8, const A: u8, const B: u8>() {
    asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
        options(nomem, nostack, preserves_flags));
}

// ---------------------------------------------------------------- frequency
/// Core clock in GHz from a chain of dependent imul (3-cycle latency).
fn core_ghz() -> f64 {
    let run = |n: u64| {
        let t = Instant::now();
        unsafe {
            asm!(
                "2:",
                ".rept 200", "imul {x}, {x}", ".endr",
                "dec {n}", "jnz 2b",
                x = inout(reg) 0u64 => _, n = inout(reg) n => _,
                options(nomem, nostack)
            );
        }
        (n * 600) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    run(100_000);
    let mut v: Vec<f64> = (0..7).map(|_| run(1_000_000)).collect();
    median(&mut v)
}

// ---------------------------------------------------------------- accuracy
/// Orders of the products in the AMX accumulation. (a_part, b_part, acc tile)
/// per 32-deep chunk; `Phase` lets a product list run over all chunks before the next.
#[derive(Clone, Copy, PartialEq)]
enum Scheme {
    /// 3-split, per chunk: hh first, then hm mh hl lh mm; one accumulator
    HhFirst,
    /// 3-split, per chunk: hm mh hl lh mm, then hh; one accumulator
    HhLast,
    /// 3-split, all chunks' corrections first, then all chunks' hh; one accumulator
    CorrAllFirst,
    /// 3-split, hh in tile 0, corrections in tile 1, summed in f32 at the end
    TwoAcc,
    /// 2-split (hi, lo=bf16(x-hi)), per chunk hh, hl, lh; one accumulator
    Split2,
    /// plain bf16 (hi only)
    Bf16,
}
const HH: (usize, usize) = (0, 0);
const CORR: [(usize, usize); 5] = [(0, 1), (1, 0), (0, 2), (2, 0), (1, 1)];

/// Steps (a_part, b_part, chunk, acc) for a scheme.
fn steps(s: Scheme, chunks: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut v = vec![];
    match s {
        Scheme::HhFirst => {
            for t in 0..chunks {
                v.push((HH.0, HH.1, t, 0));
                v.extend(CORR.iter().map(|&(a, b)| (a, b, t, 0)));
            }
        }
        Scheme::HhLast => {
            for t in 0..chunks {
                v.extend(CORR.iter().map(|&(a, b)| (a, b, t, 0)));
                v.push((HH.0, HH.1, t, 0));
            }
        }
        Scheme::CorrAllFirst => {
            for t in 0..chunks {
                v.extend(CORR.iter().map(|&(a, b)| (a, b, t, 0)));
            }
            for t in 0..chunks {
                v.push((HH.0, HH.1, t, 0));
            }
        }
        Scheme::TwoAcc => {
            for t in 0..chunks {
                v.push((HH.0, HH.1, t, 0));
                v.extend(CORR.iter().map(|&(a, b)| (a, b, t, 1)));
            }
        }
        Scheme::Split2 => {
            for t in 0..chunks {
                v.extend([(0, 0, t, 0), (0, 1, t, 0), (1, 0, t, 0)]);
            }
        }
        Scheme::Bf16 => {
            for t in 0..chunks {
                v.push((0, 0, t, 0));
            }
        }
    }
    v
}

/// 16x16 dots of 16 a-rows by 16 b-columns on real AMX.
/// a_parts[p]: [16][d] bf16; b_parts[p]: [d/2][16] bf16 pairs.
unsafe fn amx_dots(a: &[Vec<u16>; 3], b: &[Vec<u32>; 3], d: usize, st: &[(usize, usize, usize, usize)], out: &mut [[f32; 256]; 2]) {
    tz::<0>();
    tz::<1>();
    for &(ap, bp, t, acc) in st {
        tl::<2, _>(a[ap].as_ptr().add(t * 32), d * 2);
        tl::<3, _>(b[bp].as_ptr().add(t * 16 * 16), 64);
        if acc == 0 {
            dp::<0, 2, 3>();
        } else {
            dp::<1, 2, 3>();
        }
    }
    ts::<0, _>(out[0].as_mut_ptr(), 64);
    ts::<1, _>(out[1].as_mut_ptr(), 64);
}

/// Scalar emulation of the same steps, pseudocode semantics: per pair two f32 adds
/// (round-to-nearest-even), flush-to-zero. `fused_pair`: one rounding per pair.
fn emu_dots(a: &[Vec<u16>; 3], b: &[Vec<u32>; 3], d: usize, st: &[(usize, usize, usize, usize)], mode: usize) -> [[f32; 256]; 2] {
    // mode 0: pseudocode, two f32 RNE adds per pair; 1: one rounding per pair;
    // 2: one rounding per instruction (acc + exact sum of its 32 products);
    // 3: exact sum of the 32 products rounded to f32, then added to acc (two roundings).
    let ftz = |x: f32| if x.abs() < f32::MIN_POSITIVE { 0.0 } else { x };
    let mut out = [[0f32; 256]; 2];
    for i in 0..16 {
        for j in 0..16 {
            let mut acc = [0f32; 2];
            for &(ap, bp, t, c) in st {
                let mut sum = 0f64; // exact for these data (products have 16-bit significands, spread < 2^37)
                for k in 0..16 {
                    let p = t * 16 + k;
                    let a0 = bf16_val(a[ap][i * d + 2 * p]);
                    let a1 = bf16_val(a[ap][i * d + 2 * p + 1]);
                    let bw = b[bp][p * 16 + j];
                    let b0 = bf16_val(bw as u16);
                    let b1 = bf16_val((bw >> 16) as u16);
                    match mode {
                        0 => {
                            acc[c] = ftz(acc[c] + a0 * b0);
                            acc[c] = ftz(acc[c] + a1 * b1);
                        }
                        1 => {
                            let s = (a0 as f64 * b0 as f64 + a1 as f64 * b1 as f64) + acc[c] as f64;
                            acc[c] = ftz(s as f32);
                        }
                        _ => sum += a0 as f64 * b0 as f64 + a1 as f64 * b1 as f64,
                    }
                }
                if mode == 2 {
                    acc[c] = ftz((acc[c] as f64 + sum) as f32);
                } else if mode == 3 {
                    acc[c] = ftz(acc[c] + sum as f32);
                }
            }
            out[0][i * 16 + j] = acc[0];
            out[1][i * 16 + j] = acc[1];
        }
    }
    out
}

#[derive(Default, Clone)]
struct Stat {
    max: f64,
    sum: f64,
    n: usize,
}
impl Stat {
    fn add(&mut self, e: f64) {
        self.max = self.max.max(e);
        self.sum += e;
        self.n += 1;
    }
    fn mean(&self) -> f64 {
        self.sum / self.n as f64
    }
}

fn accuracy(batches: usize) {
    amx_init();
    let schemes = [
        ("b  3-split/6 hh-first 1acc", Scheme::HhFirst),
        ("b' 3-split/6 hh-last  1acc", Scheme::HhLast),
        ("b\" 3-split/6 corr-all-first", Scheme::CorrAllFirst),
        ("b* 3-split/6 two acc tiles", Scheme::TwoAcc),
        ("c  2-split/3 products", Scheme::Split2),
        ("-  plain bf16 (1 product)", Scheme::Bf16),
    ];
    for dist in ["normal", "spread2^-20..2^20"] {
        for d in [64usize, 128] {
            let chunks = d / 32;
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (d as u64) ^ if dist == "normal" { 0 } else { 77 });
            let mut st_fma = Stat::default();
            let mut st_fma16 = Stat::default();
            let mut st_s: Vec<Stat> = vec![Stat::default(); schemes.len()];
            let mut emu_eq = [0usize; 4];
            let mut emu_n = 0usize;
            for batch in 0..batches {
                let gen = |rng: &mut Rng| if dist == "normal" { rng.normalish() } else { rng.spread() };
                let av: Vec<f32> = (0..16 * d).map(|_| gen(&mut rng)).collect(); // [16][d]
                let bv: Vec<f32> = (0..16 * d).map(|_| gen(&mut rng)).collect(); // [16 cols][d]
                // reference, fma
                let mut refs = [0f64; 256];
                let mut norm = [0f64; 256];
                for i in 0..16 {
                    for j in 0..16 {
                        let (x, y) = (&av[i * d..(i + 1) * d], &bv[j * d..(j + 1) * d]);
                        let r: f64 = x.iter().zip(y).map(|(&p, &q)| p as f64 * q as f64).sum();
                        let nm: f64 = x.iter().zip(y).map(|(&p, &q)| (p as f64 * q as f64).abs()).sum();
                        refs[i * 16 + j] = r;
                        norm[i * 16 + j] = nm;
                        let mut acc = 0f32;
                        for k in 0..d {
                            acc = x[k].mul_add(y[k], acc);
                        }
                        st_fma.add((acc as f64 - r).abs() / nm);
                        // 16-lane blocked FMA then pairwise-ish horizontal sum (as AVX-512 kernels do)
                        let mut lanes = [0f32; 16];
                        for k in 0..d {
                            lanes[k % 16] = x[k].mul_add(y[k], lanes[k % 16]);
                        }
                        let mut w = 16;
                        while w > 1 {
                            w /= 2;
                            for l in 0..w {
                                lanes[l] += lanes[l + w];
                            }
                        }
                        st_fma16.add((lanes[0] as f64 - r).abs() / nm);
                    }
                }
                for (si, &(_, sch)) in schemes.iter().enumerate() {
                    let n = match sch {
                        Scheme::Split2 => 2,
                        Scheme::Bf16 => 1,
                        _ => 3,
                    };
                    let mut ap: [Vec<u16>; 3] = [vec![0; 16 * d], vec![0; 16 * d], vec![0; 16 * d]];
                    let mut bp: [Vec<u32>; 3] = [vec![0; d / 2 * 16], vec![0; d / 2 * 16], vec![0; d / 2 * 16]];
                    for i in 0..16 * d {
                        let s = split(av[i], n);
                        for p in 0..3 {
                            ap[p][i] = s[p];
                        }
                    }
                    for j in 0..16 {
                        for p in 0..d / 2 {
                            let s0 = split(bv[j * d + 2 * p], n);
                            let s1 = split(bv[j * d + 2 * p + 1], n);
                            for q in 0..3 {
                                bp[q][p * 16 + j] = s0[q] as u32 | (s1[q] as u32) << 16;
                            }
                        }
                    }
                    let stp = steps(sch, chunks);
                    let mut out = [[0f32; 256]; 2];
                    unsafe { amx_dots(&ap, &bp, d, &stp, &mut out) };
                    for e in 0..256 {
                        let got = if sch == Scheme::TwoAcc { out[0][e] + out[1][e] } else { out[0][e] };
                        st_s[si].add((got as f64 - refs[e]).abs() / norm[e]);
                    }
                    if sch == Scheme::HhFirst && batch < 40 {
                        for k in 0..4 {
                            let em = emu_dots(&ap, &bp, d, &stp, k);
                            emu_eq[k] += (0..256).filter(|&e| em[0][e].to_bits() == out[0][e].to_bits()).count();
                        }
                        emu_n += 256;
                    }
                }
            }
            println!("\n== {dist}, d = {d}, dots = {}  (error = |got - ref_f64| / sum|a_i b_i|)", st_fma.n);
            println!("{:32} {:>11} {:>11} {:>9}", "method", "max", "mean", "mean/(a)");
            let base = st_fma.mean();
            println!("{:32} {:11.3e} {:11.3e} {:9.2}", "a  f32 FMA sequential", st_fma.max, st_fma.mean(), 1.0);
            println!("{:32} {:11.3e} {:11.3e} {:9.2}", "a' f32 FMA 16 lanes+tree", st_fma16.max, st_fma16.mean(), st_fma16.mean() / base);
            for (si, (name, _)) in schemes.iter().enumerate() {
                let s = &st_s[si];
                println!("{:32} {:11.3e} {:11.3e} {:9.2}   (max/(a)max {:.2})", format!("{name} [AMX]"), s.max, s.mean(), s.mean() / base, s.max / st_fma.max);
            }
            println!(
                "scalar emulation of b vs real AMX, bit-equal of {emu_n}: two RNE adds per pair (Intel pseudocode) {}, one rounding per pair {}, one rounding per instruction {}, per-instruction sum rounded then added {}",
                emu_eq[0], emu_eq[1], emu_eq[2], emu_eq[3]
            );
        }
    }
}

// ---------------------------------------------------------------- throughput kernels
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);
fn abuf(bytes: usize) -> Vec<Line> {
    vec![Line([0; 64]); bytes.div_ceil(64)]
}

struct Data {
    d: usize,
    q: [Vec<Line>; 3], // [32][d] bf16
    k: [Vec<Line>; 3], // [d/2][64] bf16 pairs
    s: Vec<Line>,      // [32][64] f32
    s2: Vec<Line>,     // [32][64] f32 second accumulator
    p: [Vec<Line>; 3], // [32][64] bf16
    v: [Vec<Line>; 3], // [32 key pairs][d] bf16 pairs
    o: Vec<Line>,      // [32][d] f32
    pf: Vec<Line>,     // [32][64] f32 weights for splitting
}
impl Data {
    fn new(d: usize) -> Self {
        let mut rng = Rng(12345);
        let mut fill16 = |n: usize, scale: f32| -> [Vec<Line>; 3] {
            let mut parts = [abuf(n * 2), abuf(n * 2), abuf(n * 2)];
            for i in 0..n {
                let s = split(rng.normalish() * scale, 3);
                for p in 0..3 {
                    unsafe { *(parts[p].as_mut_ptr() as *mut u16).add(i) = s[p] };
                }
            }
            parts
        };
        let q = fill16(32 * d, 0.125);
        let k = fill16(64 * d, 0.125);
        let p = fill16(32 * 64, 1.0 / 1024.0);
        let v = fill16(64 * d, 1.0 / 1024.0);
        let mut pf = abuf(32 * 64 * 4);
        for i in 0..32 * 64 {
            unsafe { *(pf.as_mut_ptr() as *mut f32).add(i) = rng.unif() as f32 };
        }
        Data { d, q, k, s: abuf(32 * 64 * 4), s2: abuf(32 * 64 * 4), p, v, o: abuf(32 * d * 4), pf }
    }
}

macro_rules! six {
    ($c:literal) => {
        // A parts tmm2 (hi) tmm3 (mid) tmm4 (lo); B parts tmm5 (hi) tmm6 (mid) tmm7 (lo)
        dp::<$c, 2, 5>(); // hh
        dp::<$c, 2, 6>(); // hm
        dp::<$c, 3, 5>(); // mh
        dp::<$c, 2, 7>(); // hl
        dp::<$c, 4, 5>(); // lh
        dp::<$c, 3, 6>(); // mm
    };
}

/// S[32][64] = sum of 6 split products of Q(32 x d) and K(64 x d); 2 C tiles (rows 0-15, 16-31)
/// share the 3 B tiles; A parts are streamed. `cb` runs after every 6 products (for interleaving).
#[inline(always)]
unsafe fn qk_g<F: FnMut()>(d: usize, q: [*const u16; 3], k: [*const u32; 3], s: *mut f32, cb: &mut F) {
    let ([q0, q1, q2], [k0, k1, k2]) = (q, k);
    for h in 0..4 {
        tz::<0>();
        tz::<1>();
        for t in 0..d / 32 {
            let ko = t * 16 * 64 + h * 16;
            tl::<5, _>(k0.add(ko), 256);
            tl::<6, _>(k1.add(ko), 256);
            tl::<7, _>(k2.add(ko), 256);
            let qo = t * 32;
            tl::<2, _>(q0.add(qo), 2 * d);
            tl::<3, _>(q1.add(qo), 2 * d);
            tl::<4, _>(q2.add(qo), 2 * d);
            six!(0);
            cb();
            let qo = 16 * d + t * 32;
            tl::<2, _>(q0.add(qo), 2 * d);
            tl::<3, _>(q1.add(qo), 2 * d);
            tl::<4, _>(q2.add(qo), 2 * d);
            six!(1);
            cb();
        }
        ts::<0, _>(s.add(h * 16), 256);
        ts::<1, _>(s.add(16 * 64 + h * 16), 256);
    }
}

/// O[32][d] += sum of 6 split products of P(32 x 64) and V(64 x d); output tiles loaded/stored
/// per 16-column block (2 C tiles: rows 0-15, 16-31). `cb` after every 6 products.
#[inline(always)]
unsafe fn pv_g<F: FnMut()>(d: usize, p: [*const u16; 3], v: [*const u32; 3], o: *mut f32, cb: &mut F) {
    let ([p0, p1, p2], [v0, v1, v2]) = (p, v);
    for c in 0..d / 16 {
        tl::<0, _>(o.add(c * 16), 4 * d);
        tl::<1, _>(o.add(16 * d + c * 16), 4 * d);
        for t in 0..2 {
            let vo = t * 16 * d + c * 16;
            tl::<5, _>(v0.add(vo), 4 * d);
            tl::<6, _>(v1.add(vo), 4 * d);
            tl::<7, _>(v2.add(vo), 4 * d);
            let po = t * 32;
            tl::<2, _>(p0.add(po), 128);
            tl::<3, _>(p1.add(po), 128);
            tl::<4, _>(p2.add(po), 128);
            six!(0);
            cb();
            let po = 16 * 64 + t * 32;
            tl::<2, _>(p0.add(po), 128);
            tl::<3, _>(p1.add(po), 128);
            tl::<4, _>(p2.add(po), 128);
            six!(1);
            cb();
        }
        ts::<0, _>(o.add(c * 16), 4 * d);
        ts::<1, _>(o.add(16 * d + c * 16), 4 * d);
    }
}

fn p16(v: &[Vec<Line>; 3]) -> [*const u16; 3] {
    [v[0].as_ptr() as _, v[1].as_ptr() as _, v[2].as_ptr() as _]
}
fn p32(v: &[Vec<Line>; 3]) -> [*const u32; 3] {
    [v[0].as_ptr() as _, v[1].as_ptr() as _, v[2].as_ptr() as _]
}

#[inline(always)]
unsafe fn qk(x: &mut Data) {
    qk_g(x.d, p16(&x.q), p32(&x.k), x.s.as_mut_ptr() as *mut f32, &mut || {});
}
#[inline(always)]
unsafe fn pv(x: &mut Data) {
    pv_g(x.d, p16(&x.p), p32(&x.v), x.o.as_mut_ptr() as *mut f32, &mut || {});
}

/// Stand-in for the softmax's vector work on one vector of 16 scores (16 AVX-512 ops incl. the
/// load: max, 14 FMAs of a polynomial), fused with the 3-way split of the result (cvt variant)
/// into the three P parts.
#[inline(always)]
unsafe fn softmax_split_vec(s: *const f32, out: [*mut u16; 3], m: &mut __m512, c: &[__m512; 15]) {
    let x = _mm512_load_ps(s);
    *m = _mm512_max_ps(*m, x);
    let mut y = _mm512_fmadd_ps(x, c[14], c[13]);
    for i in (0..13).rev() {
        y = _mm512_fmadd_ps(y, x, c[i]);
    }
    let hi: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(y));
    let hif = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
    let r = _mm512_sub_ps(y, hif);
    let mid: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(r));
    let midf = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(mid)));
    let r2 = _mm512_sub_ps(r, midf);
    let lo: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(r2));
    _mm256_store_si256(out[0] as *mut __m256i, hi);
    _mm256_store_si256(out[1] as *mut __m256i, mid);
    _mm256_store_si256(out[2] as *mut __m256i, lo);
}

/// Streaming pipeline over `nkt` distinct key tiles (K, V parts in L2 when large): iteration j
/// runs QK(j) and PV(j-2) on AMX; with `vector`, the vector work (softmax stand-in + split) of
/// tile j-1 is interleaved, `256/d` vectors after every 6 tile products.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pipeline(x: &mut Pipe, iters: usize, vector: bool, amx: bool, kind: usize) {
    let d = x.d;
    let nkt = x.k.len();
    let coef: [__m512; 15] = std::array::from_fn(|i| _mm512_set1_ps(1.0 / (1..=i).map(|v| v as f32).product::<f32>()));
    let per_block = 256 / d;
    let mut m = _mm512_setzero_ps();
    for j in 2..iters + 2 {
        let s_cur = x.s[j & 1].as_mut_ptr() as *mut f32;
        let s_prev = x.s[(j - 1) & 1].as_ptr() as *const f32;
        let pw: [*mut u16; 3] = std::array::from_fn(|i| x.p[(j - 1) & 1][i].as_mut_ptr() as *mut u16);
        let mut u = 0usize;
        let mut work = || {
            if vector {
                for _ in 0..per_block {
                    let (row, col) = (u / 4, (u % 4) * 16);
                    if kind == 0 {
                        softmax_split_vec(s_prev.add(row * 64 + col), pw.map(|q| q.add(row * 64 + col)), &mut m, &coef);
                    } else {
                        // probe: 27 register-only FMAs (same p0/p5 uop count, no memory)
                        asm!(".rept 3",
                            "vfmadd231ps zmm20, zmm29, zmm30", "vfmadd231ps zmm21, zmm29, zmm30", "vfmadd231ps zmm22, zmm29, zmm30",
                            "vfmadd231ps zmm23, zmm29, zmm30", "vfmadd231ps zmm24, zmm29, zmm30", "vfmadd231ps zmm25, zmm29, zmm30",
                            "vfmadd231ps zmm26, zmm29, zmm30", "vfmadd231ps zmm27, zmm29, zmm30", "vfmadd231ps zmm28, zmm29, zmm30",
                            ".endr",
                            out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _,
                            out("zmm26") _, out("zmm27") _, out("zmm28") _, out("zmm29") _, out("zmm30") _,
                            options(nomem, nostack, preserves_flags));
                    }
                    u += 1;
                }
            }
        };
        if amx {
            qk_g(d, p16(&x.q), p32(&x.k[j % nkt]), s_cur, &mut work);
            pv_g(d, p16(&x.p[j & 1]), p32(&x.v[(j - 2) % nkt]), x.o.as_mut_ptr() as *mut f32, &mut work);
        } else {
            for _ in 0..d / 2 {
                work();
            }
        }
    }
    black_box(m);
}

struct Pipe {
    d: usize,
    q: [Vec<Line>; 3],
    k: Vec<[Vec<Line>; 3]>,
    v: Vec<[Vec<Line>; 3]>,
    s: [Vec<Line>; 2],
    p: [[Vec<Line>; 3]; 2],
    o: Vec<Line>,
}
impl Pipe {
    fn new(d: usize, nkt: usize) -> Self {
        let mut x = Data::new(d);
        let dup = |v: &[Vec<Line>; 3]| [v[0].clone(), v[1].clone(), v[2].clone()];
        let s0 = x.s.clone();
        // distinct buffers per key tile (same contents)
        let k = (0..nkt).map(|_| dup(&x.k)).collect();
        let v = (0..nkt).map(|_| dup(&x.v)).collect();
        unsafe { qk(&mut x) };
        let _ = s0;
        Pipe { d, q: dup(&x.q), k, v, s: [x.s.clone(), x.s.clone()], p: [dup(&x.p), dup(&x.p)], o: x.o.clone() }
    }
}

/// Two-accumulator QK variant (hh in one tile, corrections in another): one 16x16 output at a
/// time, all six operand tiles loaded per chunk; both accumulators stored.
#[inline(always)]
unsafe fn qk_twoacc(x: &mut Data) {
    let d = x.d;
    let (q0, q1, q2) = (x.q[0].as_ptr() as *const u16, x.q[1].as_ptr() as *const u16, x.q[2].as_ptr() as *const u16);
    let (k0, k1, k2) = (x.k[0].as_ptr() as *const u32, x.k[1].as_ptr() as *const u32, x.k[2].as_ptr() as *const u32);
    let s = x.s.as_mut_ptr() as *mut f32;
    let s2 = x.s2.as_mut_ptr() as *mut f32;
    for r in 0..2 {
        for h in 0..4 {
            tz::<0>();
            tz::<1>();
            for t in 0..d / 32 {
                let ko = t * 16 * 64 + h * 16;
                let qo = r * 16 * d + t * 32;
                tl::<2, _>(q0.add(qo), 2 * d);
                tl::<5, _>(k0.add(ko), 256);
                dp::<0, 2, 5>();
                tl::<6, _>(k1.add(ko), 256);
                tl::<3, _>(q1.add(qo), 2 * d);
                dp::<1, 2, 6>();
                dp::<1, 3, 5>();
                dp::<1, 3, 6>();
                tl::<7, _>(k2.add(ko), 256);
                tl::<4, _>(q2.add(qo), 2 * d);
                dp::<1, 2, 7>();
                dp::<1, 4, 5>();
            }
            ts::<0, _>(s.add(r * 16 * 64 + h * 16), 256);
            ts::<1, _>(s2.add(r * 16 * 64 + h * 16), 256);
        }
    }
}

/// Tile peak: 4 independent chains.
unsafe fn peak_chains(rounds: usize) {
    for _ in 0..rounds {
        dp::<0, 4, 6>();
        dp::<1, 4, 7>();
        dp::<2, 5, 6>();
        dp::<3, 5, 7>();
    }
}

fn time_it<F: FnMut(usize)>(mut f: F, target_s: f64) -> (f64, usize) {
    // calibrate
    let mut n = 16usize;
    loop {
        let t = Instant::now();
        f(n);
        if t.elapsed().as_secs_f64() > target_s / 4.0 {
            break;
        }
        n *= 2;
    }
    let mut v: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            f(n);
            t.elapsed().as_secs_f64() / n as f64
        })
        .collect();
    (median(&mut v), n)
}

fn throughput() {
    amx_init();
    let ghz = core_ghz();
    println!("core clock (dependent imul chain, median of 7): {ghz:.3} GHz");
    // tile peak, operands small
    let ops = vec![0x3b80_3b80u32; 256]; // bf16 pairs of 2^-8
    unsafe {
        for t in [4u8, 5, 6, 7] {
            match t {
                4 => tl::<4, _>(ops.as_ptr(), 64),
                5 => tl::<5, _>(ops.as_ptr(), 64),
                6 => tl::<6, _>(ops.as_ptr(), 64),
                _ => tl::<7, _>(ops.as_ptr(), 64),
            }
        }
        tz::<0>();
        tz::<1>();
        tz::<2>();
        tz::<3>();
    }
    let (t, _) = time_it(|n| unsafe { peak_chains(n) }, 0.3);
    let bf16_peak = 4.0 * 16384.0 / t / 1e9;
    println!(
        "tdpbf16ps peak: {:.0} GFLOP/s bf16 ({:.2} cycles/tdpbf16ps at {ghz:.2} GHz) -> 6-product f32-equivalent ceiling {:.0} GFLOP/s",
        bf16_peak,
        t / 4.0 * ghz * 1e9,
        bf16_peak / 6.0
    );
    // AVX-512 FMA peak for reference
    let (t, _) = time_it(
        |n| unsafe {
            asm!(
                "vxorps zmm0, zmm0, zmm0", "vxorps zmm1, zmm1, zmm1", "vxorps zmm2, zmm2, zmm2", "vxorps zmm3, zmm3, zmm3",
                "vxorps zmm4, zmm4, zmm4", "vxorps zmm5, zmm5, zmm5", "vxorps zmm6, zmm6, zmm6", "vxorps zmm7, zmm7, zmm7",
                "vxorps zmm8, zmm8, zmm8", "vxorps zmm9, zmm9, zmm9",
                "2:",
                "vfmadd231ps zmm0, zmm10, zmm11", "vfmadd231ps zmm1, zmm10, zmm11", "vfmadd231ps zmm2, zmm10, zmm11",
                "vfmadd231ps zmm3, zmm10, zmm11", "vfmadd231ps zmm4, zmm10, zmm11", "vfmadd231ps zmm5, zmm10, zmm11",
                "vfmadd231ps zmm6, zmm10, zmm11", "vfmadd231ps zmm7, zmm10, zmm11", "vfmadd231ps zmm8, zmm10, zmm11",
                "vfmadd231ps zmm9, zmm10, zmm11",
                "dec {n}", "jnz 2b",
                n = inout(reg) n => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
                out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                options(nomem, nostack)
            )
        },
        0.3,
    );
    println!("AVX-512 FMA peak: {:.0} GFLOP/s", 10.0 * 32.0 / t / 1e9);

    for d in [64usize, 128] {
        let mut x = Data::new(d);
        let flops_qk = 2.0 * d as f64 * 32.0 * 64.0;
        let tdps_qk = (8 * (d / 32) * 6) as f64;
        let report = |name: &str, t: f64, flops: f64, tdps: f64| {
            let cyc = t * ghz * 1e9;
            println!(
                "d={d:3} {name:34} {:8.1} ns/step {:8.0} cycles  {:6.0} GFLOP/s f32-equiv   ({:.1} cycles per tdpbf16ps, {:.0}% of tile peak)",
                t * 1e9,
                cyc,
                flops / t / 1e9,
                cyc / tdps,
                100.0 * tdps * 16384.0 / t / 1e9 / bf16_peak
            );
        };
        let (t, _) = time_it(|n| unsafe { for _ in 0..n { qk(&mut x); black_box(&x.s); } }, 0.3);
        report("QK (6 products, S stored)", t, flops_qk, tdps_qk);
        let (t, _) = time_it(|n| unsafe { for _ in 0..n { qk_twoacc(&mut x); black_box(&x.s); } }, 0.3);
        report("QK two-accumulator variant", t, flops_qk, tdps_qk);
        let (t, _) = time_it(|n| unsafe { for _ in 0..n { pv(&mut x); black_box(&x.o); } }, 0.3);
        report("PV (6 products, O ld/st)", t, flops_qk, tdps_qk);
        let (t, _) = time_it(|n| unsafe { for _ in 0..n { qk(&mut x); pv(&mut x); black_box(&x.o); } }, 0.3);
        report("step = QK + PV", t, 2.0 * flops_qk, 2.0 * tdps_qk);
        // step with the AVX-512 split of the weights done in between (serially dependent-free:
        // splits pf into the P parts the PV reads)
        let (t, _) = time_it(
            |n| unsafe {
                for _ in 0..n {
                    qk(&mut x);
                    split_cvt(x.pf.as_ptr() as *const f32, [x.p[0].as_mut_ptr() as *mut u16, x.p[1].as_mut_ptr() as *mut u16, x.p[2].as_mut_ptr() as *mut u16]);
                    pv(&mut x);
                    black_box(&x.o);
                }
            },
            0.3,
        );
        report("step + split_cvt of P in between", t, 2.0 * flops_qk, 2.0 * tdps_qk);
        for nkt in [1usize, 16] {
            let mut pp = Pipe::new(d, nkt);
            for (name, vector, amx, kind) in [("AMX only", false, true, 0), ("vector work only", true, false, 0), ("AMX + interleaved vector work", true, true, 0),
                ("probe: 27 reg FMAs/16 only", true, false, 1), ("probe: AMX + 27 reg FMAs/16", true, true, 1)] {
                let (t, _) = time_it(|n| unsafe { pipeline(&mut pp, n, vector, amx, kind) }, 0.3);
                report(&format!("pipe N={:4} {name}", 64 * nkt), t, 2.0 * flops_qk, 2.0 * tdps_qk);
            }
        }
    }
}

// ---------------------------------------------------------------- split of the weight tile
/// 32x64 f32 -> 3 bf16 parts [32][64] via vcvtneps2bf16, remainder via widen+shift+sub.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)]
unsafe fn split_cvt(p: *const f32, out: [*mut u16; 3]) {
    for i in 0..32 * 64 / 16 {
        let x = _mm512_loadu_ps(p.add(16 * i));
        let hi: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
        let hif = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
        let r = _mm512_sub_ps(x, hif);
        let mid: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(r));
        let midf = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(mid)));
        let r2 = _mm512_sub_ps(r, midf);
        let lo: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(r2));
        _mm256_store_si256(out[0].add(16 * i) as *mut __m256i, hi);
        _mm256_store_si256(out[1].add(16 * i) as *mut __m256i, mid);
        _mm256_store_si256(out[2].add(16 * i) as *mut __m256i, lo);
    }
}

/// Same with a Veltkamp split in f32 (C = 2^16 + 1 gives 8-bit hi) and vcvtne2ps2bf16 packing
/// (exact, as the parts already have <= 8 significant bits).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)]
unsafe fn split_veltkamp(p: *const f32, out: [*mut u16; 3]) {
    let c = _mm512_set1_ps(65537.0);
    let part = |x: __m512| {
        let t = _mm512_mul_ps(x, c);
        let hi = _mm512_sub_ps(t, _mm512_sub_ps(t, x));
        (hi, _mm512_sub_ps(x, hi))
    };
    for i in 0..32 * 64 / 32 {
        let x0 = _mm512_loadu_ps(p.add(32 * i));
        let x1 = _mm512_loadu_ps(p.add(32 * i + 16));
        let (h0, r0) = part(x0);
        let (h1, r1) = part(x1);
        let (m0, l0) = part(r0);
        let (m1, l1) = part(r1);
        _mm512_store_si512(out[0].add(32 * i) as *mut _, std::mem::transmute(_mm512_cvtne2ps_pbh(h1, h0)));
        _mm512_store_si512(out[1].add(32 * i) as *mut _, std::mem::transmute(_mm512_cvtne2ps_pbh(m1, m0)));
        _mm512_store_si512(out[2].add(32 * i) as *mut _, std::mem::transmute(_mm512_cvtne2ps_pbh(l1, l0)));
    }
}

/// Single bf16 rounding (today's path) for comparison.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline(never)]
unsafe fn split_one(p: *const f32, out: *mut u16) {
    for i in 0..32 * 64 / 32 {
        let x0 = _mm512_loadu_ps(p.add(32 * i));
        let x1 = _mm512_loadu_ps(p.add(32 * i + 16));
        _mm512_store_si512(out.add(32 * i) as *mut _, std::mem::transmute(_mm512_cvtne2ps_pbh(x1, x0)));
    }
}

fn split_bench() {
    let ghz = core_ghz();
    println!("core clock: {ghz:.3} GHz");
    let mut x = Data::new(64);
    let pf = x.pf.as_ptr() as *const f32;
    let outs = [x.p[0].as_mut_ptr() as *mut u16, x.p[1].as_mut_ptr() as *mut u16, x.p[2].as_mut_ptr() as *mut u16];
    // correctness: both splits exact and equal to the scalar RNE split for cvt
    unsafe {
        for (name, f) in [("cvt", split_cvt as unsafe fn(*const f32, [*mut u16; 3])), ("veltkamp", split_veltkamp)] {
            f(pf, outs);
            let mut exact = 0;
            let mut same_as_rne = 0;
            for i in 0..2048 {
                let v = *pf.add(i);
                let parts: Vec<f32> = (0..3).map(|p| bf16_val(*outs[p].add(i))).collect();
                if (parts[0] as f64 + parts[1] as f64 + parts[2] as f64) == v as f64 {
                    exact += 1;
                }
                let s = split(v, 3);
                if (0..3).all(|p| s[p] == *outs[p].add(i)) {
                    same_as_rne += 1;
                }
            }
            println!("split_{name}: {exact}/2048 exact (hi+mid+lo == x), {same_as_rne}/2048 identical to scalar RNE split");
        }
    }
    for (name, f) in [("split_cvt (3 parts)", 0), ("split_veltkamp (3 parts)", 1), ("one bf16 rounding (today)", 2)] {
        let (t, _) = time_it(
            |n| unsafe {
                for _ in 0..n {
                    match f {
                        0 => split_cvt(black_box(pf), outs),
                        1 => split_veltkamp(black_box(pf), outs),
                        _ => split_one(black_box(pf), outs[0]),
                    }
                }
            },
            0.3,
        );
        println!("{name:28} {:7.1} ns per 32x64 tile = {:6.2} cycles per 16 weights", t * 1e9, t * ghz * 1e9 / 128.0);
    }
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or("all".into());
    let batches: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(400);
    match mode.as_str() {
        "acc" => accuracy(batches),
        "tp" => throughput(),
        "split" => split_bench(),
        _ => {
            accuracy(batches);
            throughput();
            split_bench();
        }
    }
}
