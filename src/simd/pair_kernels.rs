//! Which kernels run the two products of a native `bf16` prefill: AMX
//! tiles ([`Amx`]) where the CPU, the OS and the head dim allow, else
//! AVX-512 BF16 ([`Bf16Dot`]). Both read the same packed pairs, so the
//! driver (`fused/pairs.rs`) holds one [`PairKernels`] and never asks
//! which.

use super::amx::Amx;
use super::bf16::Bf16Dot;

/// The kernels of a native `bf16` prefill.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PairKernels {
    /// `vdpbf16ps`, one vector of 16 keys or columns at a time.
    Dot(Bf16Dot),
    /// `tdpbf16ps` on 16 × 16 tiles.
    Tiles(Amx),
}

impl PairKernels {
    /// Rows the kernels compute for a query tile of `rows` real rows:
    /// whole AMX tiles (16), which `Bf16Dot` takes too (it takes any
    /// number), so a query tile's buffers fit either.
    pub(crate) fn computed_rows(rows: usize) -> usize {
        Amx::computed_rows(rows)
    }

    /// `s[r][j] = scale · Σ_p q_pairs[r][p] · k_pairs[p][j]` for the rows
    /// of `q_pairs` (computed rows) and the 64 keys of one packed key tile; see [`Bf16Dot::scores`].
    pub(crate) fn scores(
        self,
        q_pairs: &[u32],
        d_pairs: usize,
        k_pairs: &[u32],
        scale: f32,
        s: &mut [f32],
        s_stride: usize,
    ) {
        match self {
            Self::Dot(dot) => dot.scores(q_pairs, d_pairs, k_pairs, scale, s, s_stride),
            Self::Tiles(amx) => amx.scores(q_pairs, d_pairs, k_pairs, scale, s, s_stride),
        }
    }

    /// `o[r] ← alpha[r]·o[r] + Σ_j p[r][j]·v[j]` for one packed value
    /// tile, the weights in two `bf16` parts (`vdpbf16ps`, within 2⁻¹⁵ of
    /// each) or rounded to `bf16` (AMX tiles, 2⁻⁸); see
    /// [`Bf16Dot::accumulate_values`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn accumulate_values(
        self,
        p: &[f32],
        p_stride: usize,
        v_pairs: &[u32],
        width: usize,
        alpha: &[f32],
        o: &mut [f32],
        skip_zero_weights: bool,
    ) {
        match self {
            Self::Dot(dot) => {
                dot.accumulate_values(p, p_stride, v_pairs, width, alpha, o, skip_zero_weights);
            }
            Self::Tiles(amx) => {
                amx.accumulate_values(p, p_stride, v_pairs, width, alpha, o, skip_zero_weights);
            }
        }
    }

    /// Whether the products run on AMX tiles.
    pub(crate) fn on_tiles(self) -> bool {
        matches!(self, Self::Tiles(_))
    }

    /// Packs key rows into key tiles; see [`Bf16Dot::pack_keys`].
    pub(crate) fn pack_keys(self, keys: &[half::bf16], d_k: usize, out: &mut [u32]) {
        self.dot().pack_keys(keys, d_k, out);
    }

    /// Packs value rows into value tiles, noting the tiles with NaN or an
    /// infinity; see [`Bf16Dot::pack_values`].
    pub(crate) fn pack_values(
        self,
        values: &[half::bf16],
        d_v: usize,
        width: usize,
        out: &mut [u32],
        nonfinite: &mut [bool],
    ) {
        self.dot().pack_values(values, d_v, width, out, nonfinite);
    }

    /// The AVX-512 BF16 kernels, which both variants have.
    fn dot(self) -> Bf16Dot {
        match self {
            Self::Dot(dot) => dot,
            Self::Tiles(amx) => amx.dot(),
        }
    }

    /// Called when a query tile is done on this thread: gives the tile
    /// state back (AMX), so it is not kept between calls.
    pub(crate) fn finish(self) {
        if let Self::Tiles(amx) = self {
            amx.release();
        }
    }
}
