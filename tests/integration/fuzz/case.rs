//! Cases: random shapes, options, magnitudes and non-finite values, each
//! drawn from its own seed.

use super::*;

/// What a case's call must return.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Expect {
    Ok,
    /// An error of this kind (the case has exactly one thing wrong).
    Err(ErrorKind),
}

/// How the values of one argument are drawn.
#[derive(Debug, Clone, Copy)]
pub(super) enum Magnitude {
    /// Uniform in `[-m, m)`.
    Uniform(f64),
    /// `±10^e`, `e` uniform in `[-20, 20]`, entry by entry.
    Wild,
}

impl Magnitude {
    pub(super) fn random(rng: &mut Rng) -> Self {
        if rng.chance(0.6) {
            Magnitude::Uniform(1.0)
        } else if rng.chance(0.15) {
            Magnitude::Wild
        } else {
            Magnitude::Uniform(pick(rng, &[1e-20, 1e-10, 1e-3, 10.0, 1e3, 1e10, 1e20]))
        }
    }

    pub(super) fn value(self, rng: &mut Rng) -> f32 {
        match self {
            Magnitude::Uniform(m) => (rng.uniform(-1.0, 1.0) * m) as f32,
            Magnitude::Wild => {
                let sign = if rng.chance(0.5) { -1.0 } else { 1.0 };
                (sign * 10f64.powf(rng.uniform(-20.0, 20.0))) as f32
            }
        }
    }

    pub(super) fn is_at_most_one(self) -> bool {
        matches!(self, Magnitude::Uniform(m) if m <= 1.0)
    }
}

/// One attention call: the arguments, the options, how each is laid out,
/// and what it must return.
#[derive(Debug, Clone)]
pub(super) struct Case {
    pub(super) seed: u64,
    pub(super) expect: Expect,
    pub(super) q: Tensor<f32>,
    pub(super) k: Tensor<f32>,
    pub(super) v: Tensor<f32>,
    pub(super) keep_mask: Option<Tensor<bool>>,
    pub(super) bias: Option<Tensor<f32>>,
    pub(super) causal: Option<CausalAlignment>,
    pub(super) window: Option<usize>,
    pub(super) scale: Option<f32>,
    pub(super) key_lengths: Option<Vec<usize>>,
    pub(super) key_shard: Option<(usize, usize)>,
    /// ALiBi slopes, one per query head (another count, or a non-finite
    /// slope, only in a case that expects the error).
    pub(super) alibi: Option<Vec<f32>>,
    /// Sink logits, one per query head (likewise).
    pub(super) sinks: Option<Vec<f32>>,
    pub(super) softcap: Option<f32>,
    /// The layout of the caller's buffer for `_into`.
    pub(super) out_layout: Layout,
    /// The gradient of the loss for the backward, `[batch, heads, len_q, d_v]`.
    pub(super) d_out: Tensor<f32>,
    pub(super) magnitudes: [Magnitude; 3],
    /// Whether q, k, v and d_out are all of magnitude at most 1 (the
    /// backward's closeness check needs moderate inputs).
    pub(super) moderate: bool,
    /// Non-finite values placed where a query can see them.
    pub(super) visible_poison: Vec<String>,
}

pub(super) const LENGTHS: &[usize] = &[
    0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 191,
    193,
];
pub(super) const HEAD_DIMS: &[usize] = &[
    1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 80, 96, 128,
];
/// Head dims that are whole vectors on every kernel set (the decode path).
pub(super) const VECTOR_DIMS: &[usize] = &[4, 8, 16, 32, 48, 64, 128];

pub(super) fn length(rng: &mut Rng) -> usize {
    if rng.chance(0.45) {
        rng.below(12)
    } else {
        pick(rng, LENGTHS)
    }
}

impl Case {
    pub(super) fn generate(seed: u64) -> Case {
        let mut rng = Rng::new(seed);
        let rng = &mut rng;

        // Shapes.
        let long = rng.chance(0.06);
        let mut batch = pick(rng, &[1, 1, 1, 2, 2, 3, 0]);
        let mut kv_heads = pick(rng, &[1, 1, 2, 3]);
        let mut group = pick(rng, &[1, 1, 2, 3, 4]);
        let (mut len_q, mut len_kv) = if long {
            let len_kv = if rng.chance(0.5) {
                pick(rng, &[1023, 1024, 1025, 1088, 2047, 2048, 2049])
            } else {
                1025 + rng.below(1200)
            };
            (1 + rng.below(8), len_kv)
        } else {
            (length(rng), length(rng))
        };
        let (mut d_k, mut d_v) = if long || (len_q <= 8 && rng.chance(0.5)) {
            (pick(rng, VECTOR_DIMS), pick(rng, VECTOR_DIMS))
        } else {
            (pick(rng, HEAD_DIMS), pick(rng, HEAD_DIMS))
        };
        if rng.chance(0.03) {
            d_v = 0;
        }
        if long {
            (d_k, d_v) = (d_k.min(16), d_v.min(16));
        }
        while batch * kv_heads * group * len_q * len_kv * (d_k + d_v + 2) > WORK_BUDGET {
            if batch > 1 {
                batch = 1;
            } else if group > 1 {
                group = 1;
            } else if kv_heads > 1 {
                kv_heads = 1;
            } else if len_q > 8 {
                len_q /= 2;
            } else if d_k > 16 || d_v > 16 {
                (d_k, d_v) = (d_k.min(16), d_v.min(16));
            } else {
                len_kv /= 2;
            }
        }
        let heads = kv_heads * group;

        // Options.
        let key_shard = rng.chance(0.15).then(|| {
            let offset = rng.below(8);
            (offset, offset + len_kv + rng.below(8))
        });
        let total = key_shard.map_or(len_kv, |(_, total)| total);
        let full = [batch, heads, len_q, total];
        let broadcast_shape = |rng: &mut Rng| -> [usize; 4] {
            std::array::from_fn(|a| if rng.chance(0.3) { 1 } else { full[a] })
        };
        let causal = match rng.below(8) {
            0 | 1 => Some(CausalAlignment::BottomRight),
            2 => Some(CausalAlignment::TopLeft),
            _ => None,
        };
        let window = rng.chance(0.15).then(|| 1 + rng.below(total + 2));
        let scale = match rng.below(20) {
            0..=10 => None,
            11..=14 => Some(rng.uniform(-2.0, 2.0) as f32),
            15 => Some(0.0),
            16 => Some(pick(rng, &[1e-30, 1e-10])),
            17 => Some(pick(rng, &[1e10, 1e30])),
            _ => Some(pick(rng, &[1e38, -1e38, 3.0, -0.5])),
        };
        let key_lengths = rng.chance(0.25).then(|| {
            (0..batch)
                .map(|_| {
                    if rng.chance(0.5) {
                        total
                    } else {
                        rng.below(total + 1)
                    }
                })
                .collect::<Vec<_>>()
        });
        let mask_shape = rng.chance(0.35).then(|| broadcast_shape(rng));
        let bias_shape = rng.chance(0.35).then(|| broadcast_shape(rng));
        // Score modifiers (issue 12), each on its own: ALiBi slopes and
        // sink logits are drawn with the values, one per head.
        let alibi = rng.chance(0.2).then(PerHead::default);
        let sinks = rng.chance(0.2).then(PerHead::default);
        let softcap = rng
            .chance(0.2)
            .then(|| pick(rng, &[1e-3, 0.5, 1.0, 5.0, 20.0, 30.0, 50.0, 1e3, 1e30]));

        let mut case = CaseShapes {
            q: [batch, heads, len_q, d_k],
            k: [batch, kv_heads, len_kv, d_k],
            v: [batch, kv_heads, len_kv, d_v],
            mask: mask_shape,
            bias: bias_shape,
            causal,
            window,
            scale,
            key_lengths,
            key_shard,
            alibi,
            sinks,
            softcap,
            expect: Expect::Ok,
        };
        if rng.chance(0.12) {
            case.break_one_thing(rng);
        }

        // Values.
        let magnitudes = [
            Magnitude::random(rng),
            Magnitude::random(rng),
            Magnitude::random(rng),
        ];
        let decode_rows = len_q <= 8 && rng.chance(0.5);
        let q_layout = Layout::random(rng, case.q, true, false);
        let k_layout = Layout::random(rng, case.k, true, decode_rows);
        let v_layout = Layout::random(rng, case.v, true, decode_rows);
        let q = Tensor::random(case.q, q_layout, || magnitudes[0].value(rng));
        let k = Tensor::random(case.k, k_layout, || magnitudes[1].value(rng));
        let v = Tensor::random(case.v, v_layout, || magnitudes[2].value(rng));
        let keep_mask = case.mask.map(|shape| {
            let p = pick(rng, &[0.0, 0.3, 0.7, 0.95, 1.0]);
            let layout = Layout::random(rng, shape, true, false);
            Tensor::random(shape, layout, || rng.chance(p))
        });
        let bias = case.bias.map(|shape| {
            let magnitude = if rng.chance(0.7) {
                1.0
            } else {
                pick(rng, &[10.0, 1e3, 1e20])
            };
            let hidden = pick(rng, &[0.0, 0.0, 0.1, 0.5, 1.0]);
            let layout = Layout::random(rng, shape, true, false);
            Tensor::random(shape, layout, || {
                if rng.chance(hidden) {
                    f32::NEG_INFINITY
                } else {
                    (rng.uniform(-1.0, 1.0) * magnitude) as f32
                }
            })
        });
        let out_shape = [case.q[0], case.q[1], case.q[2], case.v[3]];
        let out_layout = Layout::random(rng, out_shape, false, false);
        let d_out_layout = Layout::random(rng, out_shape, true, false);
        let d_out = Tensor::random(out_shape, d_out_layout, || rng.uniform(-1.0, 1.0) as f32);
        let moderate = magnitudes.iter().all(|m| m.is_at_most_one());
        let heads = case.q[1];
        let alibi = case.alibi.map(|draw| draw.values(rng, heads, alibi_slopes));
        let sinks = case.sinks.map(|draw| draw.values(rng, heads, sink_logits));

        let mut case = Case {
            seed,
            expect: case.expect,
            q,
            k,
            v,
            keep_mask,
            bias,
            causal: case.causal,
            window: case.window,
            scale: case.scale,
            key_lengths: case.key_lengths,
            key_shard: case.key_shard,
            alibi,
            sinks,
            softcap: case.softcap,
            out_layout,
            d_out,
            magnitudes,
            moderate,
            visible_poison: Vec::new(),
        };
        if case.expect == Expect::Ok && rng.chance(0.15) {
            case.poison_visible(rng);
        }
        case
    }

    pub(super) fn out_shape(&self) -> [usize; 4] {
        [
            self.q.shape[0],
            self.q.shape[1],
            self.q.shape[2],
            self.v.shape[3],
        ]
    }

    pub(super) fn len_kv(&self) -> usize {
        self.k.shape[2]
    }

    /// `(offset, total_len_kv)` of the call's keys in the whole sequence.
    pub(super) fn shard(&self) -> (usize, usize) {
        self.key_shard.unwrap_or((0, self.len_kv()))
    }

    /// The number of input values, to find the smallest failing case.
    pub(super) fn size(&self) -> usize {
        let n = |shape: [usize; 4]| shape.iter().product::<usize>();
        n(self.q.shape)
            + n(self.k.shape)
            + n(self.v.shape)
            + self.keep_mask.as_ref().map_or(0, |m| n(m.shape))
            + self.bias.as_ref().map_or(0, |b| n(b.shape))
    }

    pub(super) fn scale_f64(&self) -> f64 {
        match self.scale {
            Some(s) => s as f64,
            // Exact; an `f32` path's rounded 1/√d_k is within its score
            // tolerance.
            None => 1.0 / (self.q.shape[3] as f64).sqrt(),
        }
    }

    pub(super) fn describe(&self) -> String {
        let mut options = Vec::new();
        if let Some(c) = self.causal {
            options.push(format!("causal {c:?}"));
        }
        if let Some(w) = self.window {
            options.push(format!("window {w}"));
        }
        if let Some(s) = self.scale {
            options.push(format!("scale {s:e}"));
        }
        if let Some(m) = &self.keep_mask {
            let visible = m.base.iter().filter(|&&x| x).count();
            options.push(format!(
                "keep_mask {:?} ({} of {} true, {})",
                m.shape,
                visible,
                m.base.len(),
                m.layout.describe()
            ));
        }
        if let Some(b) = &self.bias {
            let hidden = b.base.iter().filter(|x| **x == f32::NEG_INFINITY).count();
            options.push(format!(
                "bias {:?} ({} of {} −inf, max |finite| {:e}, {})",
                b.shape,
                hidden,
                b.base.len(),
                max_abs(b.base.iter()),
                b.layout.describe()
            ));
        }
        if let Some(l) = &self.key_lengths {
            options.push(format!("key_lengths {l:?}"));
        }
        if let Some((o, t)) = self.key_shard {
            options.push(format!("key_shard({o}, {t})"));
        }
        if let Some(slopes) = &self.alibi {
            options.push(format!("alibi {slopes:?}"));
        }
        if let Some(sinks) = &self.sinks {
            options.push(format!("sinks {sinks:?}"));
        }
        if let Some(cap) = self.softcap {
            options.push(format!("softcap {cap:e}"));
        }
        format!(
            "expect {:?}; q {:?} ({}), k {:?} ({}), v {:?} ({}); magnitudes q/k/v {:?}; options [{}]; out {}; visible non-finite: {:?}",
            self.expect,
            self.q.shape,
            self.q.layout.describe(),
            self.k.shape,
            self.k.layout.describe(),
            self.v.shape,
            self.v.layout.describe(),
            self.magnitudes,
            options.join(", "),
            self.out_layout.describe(),
            self.visible_poison,
        )
    }

    pub(super) fn options<'a, F: Element>(&'a self, data: &'a Data<F>) -> AttentionOptions<'a, F> {
        let mut opts = AttentionOptions::new();
        if let Some(window) = self.window {
            opts = opts.window(window);
        }
        if let Some(alignment) = self.causal {
            opts = opts.causal_aligned(alignment);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(cast(scale as f64));
        }
        if let Some(mask) = &data.keep_mask {
            opts = opts.keep_mask(mask.view());
        }
        if let Some(bias) = &data.bias {
            opts = opts.bias(bias.view());
        }
        if let Some(lengths) = &self.key_lengths {
            opts = opts.key_lengths(lengths);
        }
        if let Some((offset, total)) = self.key_shard {
            opts = opts.key_shard(offset, total);
        }
        if let Some(slopes) = &data.alibi {
            opts = opts.alibi(slopes);
        }
        if let Some(sinks) = &data.sinks {
            opts = opts.sinks(sinks);
        }
        if let Some(cap) = self.softcap {
            opts = opts.softcap(cast(cap as f64));
        }
        opts
    }

    /// Whether query `i` of `(b, h)` may see the call's key `j`, from the
    /// README's definitions (positions in the whole sequence for a shard).
    pub(super) fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (offset, total) = self.shard();
        let len_q = self.q.shape[2];
        let j = offset + j;
        let alignment = self
            .causal
            .or(self.window.map(|_| CausalAlignment::BottomRight));
        let causal = match alignment {
            None => true,
            Some(CausalAlignment::BottomRight) => j + len_q <= i + total,
            Some(CausalAlignment::TopLeft) => j <= i,
        };
        let in_window = self.window.is_none_or(|w| match alignment {
            Some(CausalAlignment::TopLeft) => j + w > i,
            _ => j + w + len_q > i + total,
        });
        causal
            && in_window
            && self.key_lengths.as_ref().is_none_or(|l| j < l[b])
            && self.keep_mask.as_ref().is_none_or(|m| m.at([b, h, i, j]))
    }

    /// ALiBi's bias of the call's key `j` for query `i` of head `h`, from
    /// the README's definition: `slope_h·(j_whole − p_i)` with `j_whole`
    /// the key's position in the whole sequence and `p_i = i + total_len_kv
    /// − len_q` the query's (bottom-right aligned, whatever the causal
    /// alignment); 0 without ALiBi.
    pub(super) fn alibi_at(&self, h: usize, i: usize, j: usize) -> f64 {
        let Some(slopes) = &self.alibi else {
            return 0.0;
        };
        let (offset, total) = self.shard();
        let query = i as f64 + total as f64 - self.q.shape[2] as f64;
        slopes[h] as f64 * ((offset + j) as f64 - query)
    }

    /// The largest `|alibi_at|` over the call's queries and keys (the
    /// distance is linear in `i` and `j`: its extremes are at the corners).
    pub(super) fn alibi_bound(&self) -> f64 {
        let Some(slopes) = &self.alibi else {
            return 0.0;
        };
        let (len_q, len_kv) = (self.q.shape[2], self.len_kv());
        if len_q == 0 || len_kv == 0 {
            return 0.0;
        }
        let (offset, total) = self.shard();
        // In f64: an error case's shard may sit near `usize::MAX`.
        let distance = |i: usize, j: usize| {
            (offset as f64 + j as f64 - (i as f64 + total as f64 - len_q as f64)).abs()
        };
        let max_distance = [
            (0, 0),
            (0, len_kv - 1),
            (len_q - 1, 0),
            (len_q - 1, len_kv - 1),
        ]
        .into_iter()
        .map(|(i, j)| distance(i, j))
        .fold(0.0, f64::max);
        max_abs(slopes.iter()) * max_distance
    }

    /// The sink logit of head `h` that this call counts, from the README:
    /// every call's, except that with a key shard only the shard holding
    /// key 0 of the whole sequence counts it (with no keys at all, a shard
    /// at offset 0). `None` past the logits of an error case.
    pub(super) fn sink(&self, h: usize) -> Option<f64> {
        let logit = *self.sinks.as_ref()?.get(h)?;
        let counts = match self.key_shard {
            None => true,
            Some((offset, total)) => offset == 0 && (self.len_kv() > 0 || total == 0),
        };
        counts.then_some(logit as f64)
    }

    pub(super) fn bias_at(&self, b: usize, h: usize, i: usize, j: usize) -> f32 {
        let offset = self.shard().0;
        self.bias
            .as_ref()
            .map_or(0.0, |bias| bias.at([b, h, i, offset + j]))
    }

    /// Which keys each query sees, and what follows from it.
    pub(super) fn visibility(&self) -> Visibility {
        let [batch, heads, len_q, _] = self.q.shape;
        let [_, kv_heads, len_kv, _] = self.k.shape;
        let group = heads / kv_heads;
        let visible = Array4::from_shape_fn((batch, heads, len_q, len_kv), |(b, h, i, j)| {
            self.visible(b, h, i, j)
        });
        let live = Array4::from_shape_fn((batch, heads, len_q, len_kv), |(b, h, i, j)| {
            visible[[b, h, i, j]] && self.bias_at(b, h, i, j) != f32::NEG_INFINITY
        });
        let any_row = |a: &Array4<bool>| {
            Array3::from_shape_fn((batch, heads, len_q), |(b, h, i)| {
                a.slice(s![b, h, i, ..]).iter().any(|&x| x)
            })
        };
        let any_key = |a: &Array4<bool>| {
            Array3::from_shape_fn((batch, kv_heads, len_kv), |(b, g, j)| {
                a.slice(s![b, g * group..(g + 1) * group, .., j])
                    .iter()
                    .any(|&x| x)
            })
        };
        Visibility {
            row_sees: any_row(&visible),
            row_lives: any_row(&live),
            key_seen: any_key(&visible),
            key_lives: any_key(&live),
            visible,
            live,
        }
    }

    /// The entries of each tensor no query can see (an entry of a
    /// broadcast tensor only if every position it stands for is unseen):
    /// queries that see no key; keys and values no query sees; values
    /// whose key every query that sees it gives a `−inf` bias; bias
    /// entries of hidden positions.
    pub(super) fn invisible_entries(&self, vis: &Visibility) -> Invisible {
        let unseen = |t: &Tensor<f32>, seen: &dyn Fn([usize; 4]) -> bool| {
            let mut free = Array4::from_elem(t.base.raw_dim(), true);
            for pos in ndarray::indices(t.shape) {
                let pos = [pos.0, pos.1, pos.2, pos.3];
                if seen(pos) {
                    free[t.base_index(pos)] = false;
                }
            }
            free
        };
        let (offset, _) = self.shard();
        let len_kv = self.len_kv();
        Invisible {
            q: unseen(&self.q, &|[b, h, i, _]| vis.row_sees[[b, h, i]]),
            k: unseen(&self.k, &|[b, g, j, _]| vis.key_seen[[b, g, j]]),
            v: unseen(&self.v, &|[b, g, j, _]| vis.key_lives[[b, g, j]]),
            bias: self.bias.as_ref().map(|bias| {
                let [batch, heads, len_q, _] = self.q.shape;
                let mut free = Array4::from_elem(bias.base.raw_dim(), true);
                for (b, h, i, j) in ndarray::indices((batch, heads, len_q, len_kv)) {
                    if vis.visible[[b, h, i, j]] {
                        free[bias.base_index([b, h, i, offset + j])] = false;
                    }
                }
                free
            }),
        }
    }

    /// A copy with every entry no query can see (with probability `p`)
    /// replaced by NaN or ±inf; and how many were.
    pub(super) fn poison_invisible(&self, rng: &mut Rng, p: f64) -> (Case, usize) {
        let invisible = self.invisible_entries(&self.visibility());
        let mut poisoned = self.clone();
        let mut count = 0;
        let mut poison = |t: &mut Tensor<f32>, free: &Array4<bool>| {
            for (x, &free) in t.base.iter_mut().zip(free) {
                if free && rng.chance(p) {
                    *x = pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
                    count += 1;
                }
            }
        };
        poison(&mut poisoned.q, &invisible.q);
        poison(&mut poisoned.k, &invisible.k);
        poison(&mut poisoned.v, &invisible.v);
        if let (Some(bias), Some(free)) = (poisoned.bias.as_mut(), &invisible.bias) {
            poison(bias, free);
        }
        (poisoned, count)
    }

    /// Places one to three NaN or ±inf where a query sees them: in a query
    /// that sees a key, in a key some query sees, in a value of a key some
    /// query gives weight, or in a bias entry of a visible position.
    pub(super) fn poison_visible(&mut self, rng: &mut Rng) {
        let vis = self.visibility();
        let (offset, _) = self.shard();
        for _ in 0..1 + rng.below(3) {
            let value = pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
            let (name, tensor, seen) = match rng.below(3) {
                0 => ("q", &mut self.q, &vis.row_sees),
                1 => ("k", &mut self.k, &vis.key_seen),
                _ => ("v", &mut self.v, &vis.key_lives),
            };
            let spots: Vec<_> = seen
                .indexed_iter()
                .filter(|(_, x)| **x)
                .map(|(p, _)| p)
                .collect();
            if spots.is_empty() || tensor.shape[3] == 0 {
                continue;
            }
            let (a, b, c) = spots[rng.below(spots.len())];
            let pos = [a, b, c, rng.below(tensor.shape[3])];
            let index = tensor.base_index(pos);
            tensor.base[index] = value;
            self.visible_poison.push(format!("{name}{pos:?} = {value}"));
        }
        if let Some(bias) = &mut self.bias
            && rng.chance(0.3)
        {
            let spots: Vec<_> = vis
                .visible
                .indexed_iter()
                .filter(|(_, x)| **x)
                .map(|(p, _)| p)
                .collect();
            if !spots.is_empty() {
                let (b, h, i, j) = spots[rng.below(spots.len())];
                let value = pick(rng, &[f32::NAN, f32::INFINITY]);
                let index = bias.base_index([b, h, i, offset + j]);
                bias.base[index] = value;
                self.visible_poison
                    .push(format!("bias{:?} = {value}", [b, h, i, offset + j]));
            }
        }
    }
}

/// The shapes and options of a case before any value is drawn, so that one
/// thing can be made wrong.
pub(super) struct CaseShapes {
    pub(super) q: [usize; 4],
    pub(super) k: [usize; 4],
    pub(super) v: [usize; 4],
    pub(super) mask: Option<[usize; 4]>,
    pub(super) bias: Option<[usize; 4]>,
    pub(super) causal: Option<CausalAlignment>,
    pub(super) window: Option<usize>,
    pub(super) scale: Option<f32>,
    pub(super) key_lengths: Option<Vec<usize>>,
    pub(super) key_shard: Option<(usize, usize)>,
    pub(super) alibi: Option<PerHead>,
    pub(super) sinks: Option<PerHead>,
    pub(super) softcap: Option<f32>,
    pub(super) expect: Expect,
}

/// A per-head modifier array (ALiBi slopes, sink logits) before its values
/// are drawn: one entry per query head unless a case breaks it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PerHead {
    /// Entries other than one per query head (an error case).
    pub(super) wrong_len: Option<usize>,
    /// A non-finite entry at a random index (an error case).
    pub(super) non_finite: Option<f32>,
}

impl PerHead {
    /// The entries for `heads` query heads, from `draw`.
    pub(super) fn values(
        self,
        rng: &mut Rng,
        heads: usize,
        draw: fn(&mut Rng, usize) -> Vec<f32>,
    ) -> Vec<f32> {
        let mut values = draw(rng, self.wrong_len.unwrap_or(heads));
        if let Some(x) = self.non_finite
            && !values.is_empty()
        {
            let at = rng.below(values.len());
            values[at] = x;
        }
        values
    }
}

/// ALiBi slopes: the standard ones (`sdpa::alibi_slopes`), positive ones of
/// order 1, signed ones (a bias that grows with distance: valid, if odd),
/// or large and tiny ones, whose biases f32 resolves poorly.
pub(super) fn alibi_slopes(rng: &mut Rng, heads: usize) -> Vec<f32> {
    match rng.below(10) {
        0..=3 => sdpa::alibi_slopes(heads)
            .into_iter()
            .map(|s| s as f32)
            .collect(),
        4..=6 => (0..heads).map(|_| rng.uniform(0.0, 1.0) as f32).collect(),
        7 | 8 => (0..heads).map(|_| rng.uniform(-1.0, 1.0) as f32).collect(),
        _ => (0..heads)
            .map(|_| {
                let sign = if rng.chance(0.5) { -1.0 } else { 1.0 };
                sign * pick(rng, &[1e-6, 8.0, 100.0, 1e4])
            })
            .collect(),
    }
}

/// Sink logits: of the order of the scores, larger, or extreme (a sink that
/// takes all the weight, or none).
pub(super) fn sink_logits(rng: &mut Rng, heads: usize) -> Vec<f32> {
    match rng.below(4) {
        0 | 1 => (0..heads).map(|_| rng.uniform(-3.0, 3.0) as f32).collect(),
        2 => (0..heads)
            .map(|_| rng.uniform(-30.0, 30.0) as f32)
            .collect(),
        _ => (0..heads)
            .map(|_| pick(rng, &[-1e10, -100.0, 0.0, 20.0, 100.0, 1e4, 1e10]))
            .collect(),
    }
}

impl CaseShapes {
    /// Makes exactly one thing wrong, and records the error kind that the
    /// README (and issue 9, for key shards) says it gives.
    pub(super) fn break_one_thing(&mut self, rng: &mut Rng) {
        let total = self.key_shard.map_or(self.k[2], |(_, t)| t);
        let full = [self.q[0], self.q[1], self.q[2], total];
        use ErrorKind::*;
        let heads = self.q[1];
        // A count of entries that is not one per head (`heads ≥ 1` here:
        // nothing else is broken).
        let wrong_len = |rng: &mut Rng| pick(rng, &[0, heads + 1, heads + 3, 2 * heads]);
        self.expect = Expect::Err(match rng.below(21) {
            0 => {
                (self.q[3], self.k[3]) = (0, 0);
                ZeroDimension
            }
            1 => {
                self.q[1] = 0;
                ZeroDimension
            }
            2 => {
                (self.k[1], self.v[1]) = (0, 0);
                ZeroDimension
            }
            3 => {
                (self.k[1], self.v[1]) = (self.q[1] + 1, self.q[1] + 1);
                HeadsNotDivisible
            }
            4 => {
                self.v[0] += 1;
                ShapeMismatch
            }
            5 => {
                self.k[3] += 1;
                ShapeMismatch
            }
            6 => {
                self.v[2] += 1;
                ShapeMismatch
            }
            7 => {
                self.v[1] += 1;
                ShapeMismatch
            }
            8 => {
                let mut shape = self.mask.unwrap_or(full);
                let axis = rng.below(4);
                // A length that is neither 1 nor the full one.
                shape[axis] += if shape[axis] + 2 == full[axis] { 3 } else { 2 };
                self.mask = Some(shape);
                NotBroadcastable
            }
            9 => {
                let mut shape = self.bias.unwrap_or(full);
                let axis = rng.below(4);
                // A length that is neither 1 nor the full one.
                shape[axis] += if shape[axis] + 2 == full[axis] { 3 } else { 2 };
                self.bias = Some(shape);
                NotBroadcastable
            }
            10 => {
                self.key_lengths = Some(vec![0; self.q[0] + 1]);
                KeyLengths
            }
            11 if self.q[0] > 0 => {
                let mut lengths = vec![total; self.q[0]];
                lengths[rng.below(self.q[0])] = total + 1 + rng.below(3);
                self.key_lengths = Some(lengths);
                KeyLengths
            }
            12 => {
                self.window = Some(0);
                InvalidOption
            }
            13 => {
                self.scale = Some(pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]));
                InvalidOption
            }
            14 => {
                // Keys offset..offset + len_kv past total_len_kv.
                let offset = 1 + rng.below(4);
                self.key_shard = Some((
                    offset,
                    (offset + self.k[2]).saturating_sub(1 + rng.below(2)),
                ));
                self.fit_columns();
                InvalidOption
            }
            15 => {
                // Issue 9, item 7: overflows `offset + len_kv`.
                self.key_shard = Some((usize::MAX - rng.below(2), 5));
                self.fit_columns();
                InvalidOption
            }
            17 => {
                self.alibi = Some(PerHead {
                    wrong_len: Some(wrong_len(rng)),
                    non_finite: None,
                });
                InvalidOption
            }
            18 => {
                self.sinks = Some(PerHead {
                    wrong_len: Some(wrong_len(rng)),
                    non_finite: None,
                });
                InvalidOption
            }
            19 => {
                let broken = Some(PerHead {
                    wrong_len: None,
                    non_finite: Some(pick(rng, &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY])),
                });
                if rng.chance(0.5) {
                    self.alibi = broken;
                } else {
                    self.sinks = broken;
                }
                InvalidOption
            }
            20 => {
                self.softcap = Some(pick(
                    rng,
                    &[
                        0.0,
                        -0.0,
                        -1.0,
                        -30.0,
                        f32::NAN,
                        f32::INFINITY,
                        f32::NEG_INFINITY,
                    ],
                ));
                InvalidOption
            }
            _ => {
                // Issue 9, item 7: the causal diagonal overflows.
                self.key_shard = Some((0, usize::MAX));
                self.causal = Some(CausalAlignment::BottomRight);
                self.fit_columns();
                self.key_lengths = None;
                InvalidOption
            }
        });
    }

    /// Mask and bias columns that broadcast whatever the shard says, so
    /// only the shard is wrong.
    pub(super) fn fit_columns(&mut self) {
        for shape in [&mut self.mask, &mut self.bias].into_iter().flatten() {
            shape[3] = 1;
        }
        self.key_lengths = None;
    }
}

/// Which keys each query sees.
pub(super) struct Visibility {
    /// `[batch, heads, len_q, len_kv]`: by selection (causal, window, key
    /// lengths, keep mask).
    pub(super) visible: Array4<bool>,
    /// Visible with a bias other than `−inf`: takes part in the softmax.
    pub(super) live: Array4<bool>,
    /// `[batch, heads, len_q]`: the query sees at least one key.
    pub(super) row_sees: Array3<bool>,
    /// The query has at least one live key.
    pub(super) row_lives: Array3<bool>,
    /// `[batch, kv_heads, len_kv]`: some query of the group sees the key.
    pub(super) key_seen: Array3<bool>,
    /// Some query of the group has the key live.
    pub(super) key_lives: Array3<bool>,
}

/// Entries (of each tensor's stored values) that no query can see.
pub(super) struct Invisible {
    pub(super) q: Array4<bool>,
    pub(super) k: Array4<bool>,
    pub(super) v: Array4<bool>,
    pub(super) bias: Option<Array4<bool>>,
}

/// A case's arguments as views of element type `F`.
pub(super) struct Data<F> {
    pub(super) q: Strided<F>,
    pub(super) k: Strided<F>,
    pub(super) v: Strided<F>,
    pub(super) keep_mask: Option<Strided<bool>>,
    pub(super) bias: Option<Strided<F>>,
    pub(super) d_out: Strided<F>,
    pub(super) alibi: Option<Vec<F>>,
    pub(super) sinks: Option<Vec<F>>,
}

impl<F: Element> Data<F> {
    pub(super) fn new(case: &Case) -> Self {
        let convert = |x: &f32| cast::<F>(*x as f64);
        Data {
            q: case.q.strided(convert, F::nan()),
            k: case.k.strided(convert, F::nan()),
            v: case.v.strided(convert, F::nan()),
            keep_mask: case.keep_mask.as_ref().map(|m| m.strided(|&x| x, true)),
            bias: case.bias.as_ref().map(|b| b.strided(convert, F::nan())),
            d_out: case.d_out.strided(convert, F::nan()),
            alibi: case.alibi.as_ref().map(|a| a.iter().map(convert).collect()),
            sinks: case.sinks.as_ref().map(|s| s.iter().map(convert).collect()),
        }
    }

    pub(super) fn qkv(&self) -> (ArrayView4<'_, F>, ArrayView4<'_, F>, ArrayView4<'_, F>) {
        (self.q.view(), self.k.view(), self.v.view())
    }
}

pub(super) fn max_abs<'a>(values: impl Iterator<Item = &'a f32>) -> f64 {
    values
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, &x| m.max((x as f64).abs()))
}

// ---------------------------------------------------------------------------
