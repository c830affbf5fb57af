//! The seeded initialisation of a layer: Xavier/Glorot-uniform draws from
//! a SplitMix64 stream, made in `f64` so that a seed gives the same weights
//! on every platform and for both element types.

use ndarray::Array2;

use crate::element::Element;

/// A `[fan_in, fan_out]` matrix drawn from `U(−a, a)`,
/// `a = √(6 / (fan_in + fan_out))`, row by row.
pub(crate) fn xavier_uniform<F: Element>(
    rng: &mut SplitMix64,
    fan_in: usize,
    fan_out: usize,
) -> Array2<F> {
    let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
    Array2::from_shape_simple_fn((fan_in, fan_out), || {
        let w = (2.0 * rng.next_unit() - 1.0) * bound;
        F::from(w).unwrap_or_else(F::zero)
    })
}

/// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit state advanced by a
/// fixed odd constant and mixed by two multiply-xorshift rounds. Tiny,
/// fast, passes BigCrush, and fully specified, so the weights a seed gives
/// never depend on a dependency's version.
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`: the top 53 bits as an `f64` mantissa.
    pub(crate) fn next_unit(&mut self) -> f64 {
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
