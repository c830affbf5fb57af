//! Building a [`Layer`]: from a config and parameters (checked against
//! each other), from the seed's three projection matrices, or seeded —
//! Xavier/Glorot-uniform draws from a SplitMix64 stream, made in `f64` so
//! that a seed gives the same weights on every platform and for both
//! element types.

use ndarray::Array2;

use super::Layer;
use super::config::AttentionConfig;
use super::params::LayerParameters;
use crate::element::Element;
use crate::error::{AttentionError, shape_error};
use crate::rope::RopeTable;

impl<F: Element> Layer<F> {
    pub(super) fn new(
        config: AttentionConfig,
        parameters: LayerParameters<F>,
    ) -> Result<Self, AttentionError> {
        config.check()?;
        parameters.check(&config)?;
        let rope = rope_table(&config)?;
        Ok(Self {
            config,
            parameters,
            rope,
        })
    }

    /// The seed's single-head layer, its config read off the matrices' shapes.
    pub(super) fn from_projections(
        w_q: Array2<F>,
        w_k: Array2<F>,
        w_v: Array2<F>,
    ) -> Result<Self, AttentionError> {
        let (qs, ks, vs) = (w_q.shape(), w_k.shape(), w_v.shape());
        let layouts = || {
            format!(
                "w_q {qs:?} = [d_model, d_k], w_k {ks:?} = [d_model, d_k], \
                 w_v {vs:?} = [d_model, d_v]"
            )
        };
        if ks[0] != qs[0] || vs[0] != qs[0] {
            return Err(shape_error(format!(
                "the projections disagree on d_model (rows): {}",
                layouts()
            )));
        }
        if ks[1] != qs[1] {
            return Err(shape_error(format!(
                "w_q and w_k disagree on d_k (columns): {}",
                layouts()
            )));
        }
        let config = AttentionConfig::new(qs[0], 1)
            .with_head_dim(qs[1])
            .with_value_dim(vs[1]);
        config
            .check()
            .map_err(|err| AttentionError::new(err.kind(), format!("{}: {}", err, layouts())))?;
        Ok(Self {
            config,
            parameters: LayerParameters::new(w_q, w_k, w_v),
            rope: None,
        })
    }

    /// A causal layer attends within one sequence, so both sides have one
    /// width.
    pub(super) fn check_causal(self) -> Result<Self, AttentionError> {
        let config = &self.config;
        if config.kv_input_width() != config.d_model {
            return Err(shape_error(format!(
                "a causal layer is self-attention: d_model_kv ({}) must equal d_model ({})",
                config.kv_input_width(),
                config.d_model
            )));
        }
        Ok(self)
    }

    /// Xavier-uniform weight matrices from one SplitMix64 stream, in table
    /// order (`W^Q`, `W^K`, `W^V`, then `W^O`), each row by row; zero
    /// biases.
    pub(super) fn new_seeded(config: AttentionConfig, seed: u64) -> Result<Self, AttentionError> {
        config.check()?;
        let rope = rope_table(&config)?;
        let mut parameters = LayerParameters::zeros(&config)?;
        let mut rng = SplitMix64::new(seed);
        for weight in parameters.weights_mut() {
            fill_xavier_uniform(&mut rng, weight);
        }
        Ok(Self {
            config,
            parameters,
            rope,
        })
    }
}

/// The rotary table a checked config asks for, if any.
fn rope_table<F: Element>(
    config: &AttentionConfig,
) -> Result<Option<RopeTable<F>>, AttentionError> {
    let Some(rope) = config.rope else {
        return Ok(None);
    };
    let rotary_dim = rope.rotary_dim.unwrap_or(config.d_k());
    let table = RopeTable::new(rotary_dim, rope.theta, rope.max_positions)
        .map_err(|err| AttentionError::new(err.kind(), format!("the layer's rope: {err}")))?;
    Ok(Some(table.with_layout(rope.layout)))
}

/// Fills a `[fan_in, fan_out]` matrix from `U(−a, a)`,
/// `a = √(6 / (fan_in + fan_out))`, row by row.
fn fill_xavier_uniform<F: Element>(rng: &mut SplitMix64, weight: &mut Array2<F>) {
    let (fan_in, fan_out) = weight.dim();
    let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
    // `iter_mut` walks in logical (row-major) order whatever the layout.
    for w in weight.iter_mut() {
        let draw = (2.0 * rng.next_unit() - 1.0) * bound;
        *w = F::from(draw).unwrap_or_else(F::zero);
    }
}

/// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit state advanced by a
/// fixed odd constant and mixed by two multiply-xorshift rounds. Tiny,
/// fast, passes BigCrush, and fully specified, so the weights a seed gives
/// never depend on a dependency's version.
struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`: the top 53 bits as an `f64` mantissa.
    fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1_u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs of the reference C implementation for seed 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let expected = [
            6_457_827_717_110_365_317_u64,
            3_203_168_211_198_807_973,
            9_817_491_932_198_370_423,
            4_593_380_528_125_082_431,
            16_408_922_859_458_223_821,
        ];
        for e in expected {
            assert_eq!(rng.next_u64(), e);
        }
    }

    #[test]
    fn unit_draws_stay_in_the_half_open_interval() {
        let mut rng = SplitMix64::new(0);
        for _ in 0..10_000 {
            let u = rng.next_unit();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
