//! Trains a small causal attention model, end to end, on two tasks that
//! only attention can solve, and checks that it learns them:
//!
//! - **copy**: at every position, output the token seen 3 positions
//!   earlier. A position's own input says nothing about that token; the
//!   model must learn where to look (a query matching the key of the
//!   position 3 back) and copy what it finds.
//! - **retrieval**: after six key–value pairs `k₁ v₁ … k₆ v₆` comes a query
//!   key; output the value stored after it. This takes two steps of
//!   attention (an induction head): in the first layer each value looks at
//!   the key before it; in the second the query finds the value whose key
//!   matches it, wherever it is.
//!
//! The model, in f32 (so the crate's fused forward and backward run):
//!
//! ```text
//! x  = E[token] + P[position]                  token and position embeddings, [batch, len, 32]
//! h1 = x  + CausalAttention₁(x)                4 heads of 8, W^O, biases
//! h2 = h1 + CausalAttention₂(h1)               4 heads of 8, W^O, biases
//! logits = h2 · W_r + b_r                      [batch, len, vocabulary]
//! loss = mean cross-entropy over the positions that have a target
//! ```
//!
//! Everything but the attention layers — embeddings, readout, the
//! cross-entropy and its gradient, the residual sums, Adam — is plain
//! ndarray, written here; the layers' gradients come from `forward_train`
//! and `backward`, and Adam updates the layers' parameters through
//! `apply_gradients`. Seeded and deterministic (the same output for any
//! thread count). It prints the loss as it falls and the accuracy on
//! held-out sequences (drawn from another random stream), and fails unless
//! that accuracy is at least 99% on both tasks.
//!
//! ```text
//! cargo run --release --example train
//! SEED=7 cargo run --release --example train     # another initialisation and data
//! ```

use std::time::Instant;

use ndarray::{Array1, Array2, Array3, ArrayD, ArrayView2, ArrayViewD, ArrayViewMutD, Axis, s};
use sdpa::{AttentionConfig, AttentionError, AttentionOptions, CausalAttention, LayerGradients};

/// Model width, heads, layers.
const D: usize = 32;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const HELD_OUT: usize = 2000;

/// SplitMix64: seeded, reproducible, no dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-bound, bound)`.
    fn uniform(&mut self, bound: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * unit - 1.0) * bound
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One sequence and the target at each position, if it has one.
type Sample = (Vec<usize>, Vec<Option<usize>>);

/// A task: sequences of `len` tokens from `0..vocab`, and a target token
/// at some positions.
struct Task {
    name: &'static str,
    vocab: usize,
    len: usize,
    /// The accuracy of a uniform guess among the possible targets.
    chance: f64,
    steps: usize,
    batch: usize,
    learning_rate: f32,
    /// One sequence and its targets.
    sample: fn(&mut Rng) -> Sample,
}

/// A batch of sequences `[count, len]` and their targets.
struct Batch {
    tokens: Array2<usize>,
    targets: Array2<Option<usize>>,
}

impl Task {
    fn batch(&self, rng: &mut Rng, count: usize) -> Batch {
        let mut tokens = Array2::zeros((count, self.len));
        let mut targets = Array2::from_elem((count, self.len), None);
        for b in 0..count {
            let (sequence, sequence_targets) = (self.sample)(rng);
            tokens.row_mut(b).assign(&Array1::from(sequence));
            targets.row_mut(b).assign(&Array1::from(sequence_targets));
        }
        Batch { tokens, targets }
    }
}

/// Copy: at position `t ≥ 3`, the token at `t − 3`.
const COPY_SHIFT: usize = 3;
const COPY: Task = Task {
    name: "copy the token 3 positions back",
    vocab: 16,
    len: 24,
    chance: 1.0 / 16.0,
    steps: 600,
    batch: 32,
    learning_rate: 3e-3,
    sample: |rng| {
        let tokens: Vec<usize> = (0..24).map(|_| rng.below(16)).collect();
        let targets = (0..24)
            .map(|t: usize| t.checked_sub(COPY_SHIFT).map(|source| tokens[source]))
            .collect();
        (tokens, targets)
    },
};

/// Retrieval: `k₁ v₁ k₂ v₂ … k₆ v₆ q`, six distinct keys (tokens 0..12)
/// each followed by a value (tokens 12..24), then a query, one of the
/// keys; the target at the query is the value stored after it. Solving it
/// takes two steps of attention (an induction head): the first layer lets
/// each value see the key before it, the second lets the query find the
/// value whose key matches it.
const KEYS: usize = 12;
const PAIRS: usize = 6;
const RETRIEVAL: Task = Task {
    name: "retrieve the value stored after a key",
    vocab: 2 * KEYS,
    len: 2 * PAIRS + 1,
    chance: 1.0 / KEYS as f64,
    steps: 2000,
    batch: 64,
    learning_rate: 3e-3,
    sample: |rng| {
        let mut keys: Vec<usize> = (0..KEYS).collect();
        for i in 0..PAIRS {
            let j = i + rng.below(KEYS - i);
            keys.swap(i, j);
        }
        let mut tokens = Vec::with_capacity(2 * PAIRS + 1);
        let mut values = Vec::with_capacity(PAIRS);
        for &key in &keys[..PAIRS] {
            let value = KEYS + rng.below(KEYS);
            tokens.extend([key, value]);
            values.push(value);
        }
        let asked = rng.below(PAIRS);
        tokens.push(keys[asked]);
        let mut targets = vec![None; 2 * PAIRS + 1];
        targets[2 * PAIRS] = Some(values[asked]);
        (tokens, targets)
    },
};

/// Adam (Kingma and Ba, 2015), one moment pair per parameter slot. The
/// slots are the parameters in the order `update` is called each step.
struct Adam {
    learning_rate: f32,
    step: i32,
    moments: Vec<(ArrayD<f32>, ArrayD<f32>)>,
}

impl Adam {
    const BETA1: f32 = 0.9;
    const BETA2: f32 = 0.999;
    const EPSILON: f32 = 1e-8;

    fn new(learning_rate: f32) -> Self {
        Self {
            learning_rate,
            step: 0,
            moments: Vec::new(),
        }
    }

    fn begin_step(&mut self) {
        self.step += 1;
    }

    fn update(
        &mut self,
        slot: usize,
        mut parameter: ArrayViewMutD<'_, f32>,
        gradient: ArrayViewD<'_, f32>,
    ) {
        if slot == self.moments.len() {
            let zeros = ArrayD::zeros(parameter.raw_dim());
            self.moments.push((zeros.clone(), zeros));
        }
        let (m, v) = &mut self.moments[slot];
        let correction1 = 1.0 - Self::BETA1.powi(self.step);
        let correction2 = 1.0 - Self::BETA2.powi(self.step);
        let rate = self.learning_rate;
        ndarray::Zip::from(&mut parameter)
            .and(m)
            .and(v)
            .and(&gradient)
            .for_each(|p, m, v, &g| {
                *m = Self::BETA1 * *m + (1.0 - Self::BETA1) * g;
                *v = Self::BETA2 * *v + (1.0 - Self::BETA2) * g * g;
                let m_hat = *m / correction1;
                let v_hat = *v / correction2;
                *p -= rate * m_hat / (v_hat.sqrt() + Self::EPSILON);
            });
    }
}

/// The model; everything but the attention layers is plain ndarray.
struct Model {
    token_embedding: Array2<f32>,    // E [vocab, D]
    position_embedding: Array2<f32>, // P [len, D]
    layers: Vec<CausalAttention<f32>>,
    readout: Array2<f32>,      // W_r [D, vocab]
    readout_bias: Array1<f32>, // b_r [vocab]
}

/// The gradients of the model's parameters.
struct ModelGradients {
    token_embedding: Array2<f32>,
    position_embedding: Array2<f32>,
    layers: Vec<LayerGradients<f32>>,
    readout: Array2<f32>,
    readout_bias: Array1<f32>,
}

impl Model {
    fn new(task: &Task, seed: u64) -> Result<Self, AttentionError> {
        let mut rng = Rng(seed);
        let config = AttentionConfig::new(D, HEADS)
            .with_output_projection(D)
            .with_bias(true);
        let layers = (0..LAYERS as u64)
            .map(|i| CausalAttention::new_seeded(config, seed + 1 + i))
            .collect::<Result<_, _>>()?;
        let xavier = (6.0 / (D + task.vocab) as f32).sqrt();
        Ok(Self {
            token_embedding: Array2::from_shape_simple_fn((task.vocab, D), || rng.uniform(1.0)),
            position_embedding: Array2::from_shape_simple_fn((task.len, D), || rng.uniform(1.0)),
            layers,
            readout: Array2::from_shape_simple_fn((D, task.vocab), || rng.uniform(xavier)),
            readout_bias: Array1::zeros(task.vocab),
        })
    }

    /// `E[token] + P[position]`, `[batch, len, D]`.
    fn embed(&self, tokens: ArrayView2<'_, usize>) -> Array3<f32> {
        let (batch, len) = tokens.dim();
        Array3::from_shape_fn((batch, len, D), |(b, t, c)| {
            self.token_embedding[[tokens[[b, t]], c]] + self.position_embedding[[t, c]]
        })
    }

    /// The logits `[batch, len, vocab]`, with the plain forward.
    fn logits(&self, tokens: ArrayView2<'_, usize>) -> Result<Array3<f32>, AttentionError> {
        let mut h = self.embed(tokens);
        for layer in &self.layers {
            h = &h + &layer.forward_batch(h.view())?;
        }
        Ok(readout(&h, &self.readout, &self.readout_bias))
    }

    /// The mean cross-entropy over the batch's targets, and its gradients.
    fn loss_and_gradients(&self, batch: &Batch) -> Result<(f32, ModelGradients), AttentionError> {
        let (count, len) = batch.tokens.dim();
        let vocab = self.readout.ncols();
        // Forward, keeping what each layer's backward needs.
        let mut h = self.embed(batch.tokens.view());
        let mut caches = Vec::new();
        let options = AttentionOptions::new();
        for layer in &self.layers {
            let (y, cache) = layer.forward_train(h.view(), &options)?;
            caches.push(cache);
            h = &h + &y;
        }
        let logits = readout(&h, &self.readout, &self.readout_bias);

        // Cross-entropy and its gradient with respect to the logits,
        // (softmax − one-hot) / number of targets; 0 where there is none.
        let targets = batch.targets.iter().flatten().count() as f32;
        let mut loss = 0.0;
        let mut d_logits = Array3::<f32>::zeros(logits.raw_dim());
        for ((b, t), target) in batch.targets.indexed_iter() {
            let Some(target) = *target else { continue };
            let row = logits.slice(s![b, t, ..]);
            let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let exp = row.mapv(|x| (x - max).exp());
            let sum = exp.sum();
            loss -= (exp[target] / sum).ln();
            let mut d_row = d_logits.slice_mut(s![b, t, ..]);
            d_row.assign(&(exp / (sum * targets)));
            d_row[target] -= 1.0 / targets;
        }
        loss /= targets;

        // The readout: logits = h·W_r + b_r.
        let h_rows = h
            .view()
            .into_shape_with_order((count * len, D))
            .expect("contiguous");
        let d_rows = d_logits
            .view()
            .into_shape_with_order((count * len, vocab))
            .expect("contiguous");
        let d_readout = h_rows.t().dot(&d_rows);
        let d_readout_bias = d_rows.sum_axis(Axis(0));
        let mut d_h = d_rows
            .dot(&self.readout.t())
            .into_shape_with_order((count, len, D))
            .expect("contiguous");

        // The residual attention blocks, last first: h_out = h_in +
        // layer(h_in), so ∂L/∂h_in = ∂L/∂h_out + the layer's d_x.
        let mut layers = Vec::new();
        for (layer, cache) in self.layers.iter().zip(&caches).rev() {
            let gradients = layer.backward(cache, d_h.view())?;
            d_h += &gradients.d_x;
            layers.push(gradients);
        }
        layers.reverse();

        // The embeddings: scatter-add into the rows that were used.
        let mut token_embedding = Array2::<f32>::zeros(self.token_embedding.raw_dim());
        let mut position_embedding = Array2::<f32>::zeros(self.position_embedding.raw_dim());
        for ((b, t), &token) in batch.tokens.indexed_iter() {
            let g = d_h.slice(s![b, t, ..]);
            let mut row = token_embedding.row_mut(token);
            row += &g;
            let mut row = position_embedding.row_mut(t);
            row += &g;
        }
        let gradients = ModelGradients {
            token_embedding,
            position_embedding,
            layers,
            readout: d_readout,
            readout_bias: d_readout_bias,
        };
        Ok((loss, gradients))
    }

    /// One Adam step on every parameter, the layers' through `apply_gradients`.
    fn update(
        &mut self,
        gradients: &ModelGradients,
        adam: &mut Adam,
    ) -> Result<(), AttentionError> {
        adam.begin_step();
        let own = [
            (
                self.token_embedding.view_mut().into_dyn(),
                gradients.token_embedding.view().into_dyn(),
            ),
            (
                self.position_embedding.view_mut().into_dyn(),
                gradients.position_embedding.view().into_dyn(),
            ),
            (
                self.readout.view_mut().into_dyn(),
                gradients.readout.view().into_dyn(),
            ),
            (
                self.readout_bias.view_mut().into_dyn(),
                gradients.readout_bias.view().into_dyn(),
            ),
        ];
        let mut slot = 0;
        for (parameter, gradient) in own {
            adam.update(slot, parameter, gradient);
            slot += 1;
        }
        for (layer, layer_gradients) in self.layers.iter_mut().zip(&gradients.layers) {
            layer.apply_gradients(layer_gradients, |_name, parameter, gradient| {
                adam.update(slot, parameter, gradient);
                slot += 1;
            })?;
        }
        Ok(())
    }

    /// The fraction of targets that are the most likely token.
    fn accuracy(&self, batch: &Batch) -> Result<f64, AttentionError> {
        let logits = self.logits(batch.tokens.view())?;
        let (mut correct, mut total) = (0, 0);
        for ((b, t), target) in batch.targets.indexed_iter() {
            let Some(target) = *target else { continue };
            let row = logits.slice(s![b, t, ..]);
            let predicted = (0..row.len())
                .max_by(|&i, &j| row[i].total_cmp(&row[j]))
                .expect("a vocabulary");
            correct += usize::from(predicted == target);
            total += 1;
        }
        Ok(correct as f64 / total as f64)
    }
}

/// `h · W_r + b_r` for every position.
fn readout(h: &Array3<f32>, w: &Array2<f32>, b: &Array1<f32>) -> Array3<f32> {
    let (batch, len, width) = h.dim();
    let rows = h
        .view()
        .into_shape_with_order((batch * len, width))
        .expect("contiguous");
    (rows.dot(w) + b)
        .into_shape_with_order((batch, len, w.ncols()))
        .expect("contiguous")
}

/// Trains a fresh model on `task`; returns the held-out accuracy.
fn train(task: &Task, seed: u64) -> Result<f64, AttentionError> {
    let start = Instant::now();
    println!(
        "\ntask: {} (vocabulary {}, length {}); {} steps of {} sequences, Adam, lr {} decaying to a tenth",
        task.name, task.vocab, task.len, task.steps, task.batch, task.learning_rate
    );
    let mut model = Model::new(task, seed)?;
    let mut adam = Adam::new(task.learning_rate);
    let mut data = Rng(seed ^ 0xDA7A);
    let report_every = task.steps / 10;
    let mut running = 0.0;
    for step in 1..=task.steps {
        // Cosine decay from the task's rate to a tenth of it.
        let progress = (step - 1) as f32 / task.steps as f32;
        adam.learning_rate =
            task.learning_rate * (0.1 + 0.45 * (1.0 + (std::f32::consts::PI * progress).cos()));
        let batch = task.batch(&mut data, task.batch);
        let (loss, gradients) = model.loss_and_gradients(&batch)?;
        model.update(&gradients, &mut adam)?;
        running += loss;
        if step % report_every == 0 {
            println!(
                "  step {step:5}  loss {:.4}  ({:.1} s)",
                running / report_every as f32,
                start.elapsed().as_secs_f64()
            );
            running = 0.0;
        }
    }
    // Sequences drawn from another stream than the training data's.
    let held_out = task.batch(&mut Rng(seed ^ 0x0DDBA11), HELD_OUT);
    let accuracy = model.accuracy(&held_out)?;
    println!(
        "  held-out accuracy {:.2}% ({} sequences, chance {:.1}%); {:.1} s",
        100.0 * accuracy,
        HELD_OUT,
        100.0 * task.chance,
        start.elapsed().as_secs_f64()
    );
    Ok(accuracy)
}

fn main() -> Result<(), AttentionError> {
    println!(
        "model: token and position embeddings, {LAYERS} residual causal attention layers \
         ({HEADS} heads, d_model {D}, W^O, biases), linear readout; f32"
    );
    // SEED=n trains from another seed (the default is the one the README quotes).
    let seed = std::env::var("SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(2024);
    let start = Instant::now();
    for task in [&COPY, &RETRIEVAL] {
        let accuracy = train(task, seed)?;
        assert!(
            accuracy >= 0.99,
            "the model did not learn to {}: held-out accuracy {accuracy}",
            task.name
        );
    }
    println!(
        "\nboth tasks learned in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
