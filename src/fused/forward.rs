//! The prefill driver: many query rows per head. Each `(batch, kv_head)`
//! packs its keys and values once, then runs every query tile of every head
//! that shares them over the packed key tiles. Calls with few query rows go
//! to `decode.rs` instead.

use ndarray::{
    ArrayView2, ArrayViewMut, ArrayViewMut3, ArrayViewMut4, Axis, Dimension, RemoveAxis,
};
use num_traits::Float;

use super::decode;
use super::pack::PackedHead;
#[cfg(all(target_arch = "x86_64", feature = "half"))]
use super::split;
use super::tile::{KeySource, QueryTile, TilePosition, TileSource};
use super::{KEY_TILE, Output, Query, forward_query_tile};
use crate::call::{Call, head};
use crate::error::AttentionError;
use crate::parallel::{map_with, split_into_chunks};
use crate::simd::{Kernel, Load, WithKernel};

/// One forward call, waiting for its kernel.
pub(super) struct Forward<'c, 'a, KV, Q, O> {
    pub(super) call: &'c Call<'a, f32, KV, Q>,
    pub(super) out: ArrayViewMut4<'c, O>,
    pub(super) log_sum_exp: Option<ArrayViewMut3<'c, f32>>,
}

impl<KV: Load + Float, Q: Query, O: Output> WithKernel for Forward<'_, '_, KV, Q, O> {
    type Output = Result<(), AttentionError>;

    fn run<K: Kernel>(self, kernel: K) -> Self::Output {
        let Forward {
            call,
            out,
            log_sum_exp,
        } = self;
        forward_or_decode(kernel, call, out, log_sum_exp, |kernel, call, out, lse| {
            #[cfg(all(target_arch = "x86_64", feature = "half"))]
            if let Some(amx) = split::tiles_for::<K, _, _>(call) {
                return split::prefill(kernel, amx, call, out, lse);
            }
            prefill(kernel, call, out, lse)
        })
    }
}

/// How every forward call starts, whatever its keys' type: nothing to do
/// for an empty output, the decode driver for a decoding step it reads in
/// place, else `prefill`.
///
/// # Errors
/// As `prefill`, and when a decoding buffer cannot be allocated.
pub(super) fn forward_or_decode<'c, 'o, K: Kernel, KV: Load + Float, Q: Query, O: Output>(
    kernel: K,
    call: &Call<'c, f32, KV, Q>,
    out: ArrayViewMut4<'o, O>,
    log_sum_exp: Option<ArrayViewMut3<'o, f32>>,
    prefill: impl FnOnce(
        K,
        &Call<'c, f32, KV, Q>,
        ArrayViewMut4<'o, O>,
        Option<ArrayViewMut3<'o, f32>>,
    ) -> Result<(), AttentionError>,
) -> Result<(), AttentionError> {
    // With `d_v = 0` the output is empty but a log-sum-exp asked for
    // is not: the softmax still runs.
    if out.is_empty() && log_sum_exp.as_ref().is_none_or(|lse| lse.is_empty()) {
        return Ok(());
    }
    if decode::reads_keys_in_place::<K, _, _>(call) {
        decode::decode(kernel, call, out, log_sum_exp)
    } else {
        prefill(kernel, call, out, log_sum_exp)
    }
}

/// One job per `(batch, kv_head)`: pack its keys and values once (widened
/// to `f32` as they are packed, when they are stored in half precision),
/// then run every query tile of every head that shares them. Jobs and
/// tiles run in parallel; each tile writes its own rows of `out` (and of
/// `log_sum_exp`).
///
/// # Errors
/// When a packing or tile buffer cannot be allocated.
pub(super) fn prefill<K: Kernel, KV: Load + Float, Q: Query, O: Output>(
    kernel: K,
    call: &Call<'_, f32, KV, Q>,
    out: ArrayViewMut4<'_, O>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
) -> Result<(), AttentionError> {
    let shape = call.shape;
    prefill_with(
        kernel,
        call,
        // The panels and value rows are `f32` whatever the keys' type.
        forward_query_tile(call, size_of::<f32>()),
        out,
        log_sum_exp,
        |b, kv_h| {
            // Fresh per job: reusing one per rayon piece (as the backward
            // does) measured 3–4% slower at N = 256, one thread.
            let mut packed = PackedHead::new::<K>(shape.len_kv, shape.d_k, shape.d_v)?;
            packed.pack(
                kernel,
                head(&call.k, b, kv_h),
                call.scale,
                Some(head(&call.v, b, kv_h)),
            )?;
            Ok(PackedKeys {
                packed,
                d_k: shape.d_k,
            })
        },
    )
}

/// [`prefill`] with the keys and values of each `(batch, kv_head)` packed
/// by `pack` into a [`TileSource`] of any layout (the `f32` panels above,
/// or `bf16` pairs in `pairs.rs`): the jobs, tiles, threads, masks and
/// softmax are this one driver's for every layout.
///
/// # Errors
/// When `pack` or a tile buffer fails.
pub(super) fn prefill_with<
    K: Kernel,
    S: TileSource + Sync,
    KV: Float + Sync,
    Q: Query,
    O: Output,
>(
    kernel: K,
    call: &Call<'_, f32, KV, Q>,
    query_tile: usize,
    out: ArrayViewMut4<'_, O>,
    log_sum_exp: Option<ArrayViewMut3<'_, f32>>,
    pack: impl Fn(usize, usize) -> Result<S, AttentionError> + Sync,
) -> Result<(), AttentionError> {
    let shape = call.shape;
    let mut heads = heads_of(out)
        .into_iter()
        .zip(match log_sum_exp {
            Some(lse) => heads_of(lse).into_iter().map(Some).collect::<Vec<_>>(),
            None => (0..shape.batch * shape.heads)
                .map(|_| None)
                .collect::<Vec<_>>(),
        })
        .enumerate();
    let mut jobs = Vec::with_capacity(shape.batch * shape.kv_heads);
    for b in 0..shape.batch {
        for kv_h in 0..shape.kv_heads {
            let job_heads: Vec<_> = heads
                .by_ref()
                .take(shape.group())
                .map(|(bh, views)| (bh % shape.heads, views))
                .collect();
            jobs.push((b, kv_h, job_heads));
        }
    }
    let keys = 0..shape.len_kv;
    let results = map_with(
        jobs,
        || (),
        |_, (b, kv_h, job_heads)| {
            let source = pack(b, kv_h)?;
            let mut tiles = Vec::new();
            for (h, (out_head, lse_head)) in job_heads {
                let out_tiles = split_into_chunks(out_head, Axis(0), query_tile);
                let mut lse_tiles =
                    lse_head.map(|lse| split_into_chunks(lse, Axis(0), query_tile).into_iter());
                for (t, out_tile) in out_tiles.into_iter().enumerate() {
                    let at = TilePosition {
                        b,
                        h,
                        i0: t * query_tile,
                        rows: out_tile.nrows(),
                        heads: 1,
                    };
                    let lse_tile = lse_tiles.as_mut().and_then(Iterator::next);
                    tiles.push((at, out_tile, lse_tile));
                }
            }
            map_with(
                tiles,
                || QueryTile::new::<K, S>(&shape, query_tile),
                |tile, (at, mut out_tile, lse_tile)| {
                    let tile = tile.as_mut().map_err(|error| error.clone())?;
                    tile.attend(
                        kernel,
                        call,
                        &at,
                        &source,
                        keys.clone(),
                        O::WEIGHT_PRECISION,
                    );
                    let sink = call.sink(at.h);
                    tile.write_output(
                        kernel,
                        call,
                        &at,
                        keys.clone(),
                        &mut out_tile,
                        lse_tile,
                        sink,
                    );
                    Ok(())
                },
            )
            .into_iter()
            .collect::<Result<(), AttentionError>>()
        },
    );
    results.into_iter().collect()
}

/// One head's keys packed for the register-tiled kernels, and its values
/// packed or read in place.
struct PackedKeys<'a> {
    packed: PackedHead<'a>,
    d_k: usize,
}

impl KeySource for PackedKeys<'_> {
    type Value = f32;

    /// The panels hold `scale·k`: the queries go to the kernel unscaled,
    /// read in place where they can be.
    const SCALED_KEYS: bool = true;

    /// The register-tiled Q·Kᵀ kernel needs whole register tiles of rows
    /// (padding rows are computed and dropped).
    fn computed_rows<K: Kernel>(rows: usize) -> usize {
        rows.div_ceil(K::ROWS) * K::ROWS
    }

    fn scores<K: Kernel>(&self, kernel: K, q: &[f32], d_k: usize, j0: usize, scores: &mut [f32]) {
        let panels = self.packed.tile_panels(j0, self.d_k);
        kernel.scores(q, d_k, panels, scores, KEY_TILE);
    }

    fn max_abs_key(&self) -> f32 {
        self.packed.panels_max_abs
    }

    /// Packing noted which tiles hold a non-finite value. In place, the
    /// last tile has only the real keys.
    fn values(&self, j0: usize, _p: ArrayView2<'_, f32>) -> (ArrayView2<'_, f32>, bool) {
        (
            self.packed.tile_rows(j0),
            self.packed.tile_has_nonfinite_rows[j0 / KEY_TILE],
        )
    }
}

/// The `[batch·heads]` views `x[b, h]` of a `[batch, heads, …]` view, in
/// order, each free to go to another thread.
pub(super) fn heads_of<'a, A, D>(
    x: ArrayViewMut<'a, A, D>,
) -> Vec<ArrayViewMut<'a, A, <D::Smaller as Dimension>::Smaller>>
where
    D: RemoveAxis,
    D::Smaller: RemoveAxis,
{
    split_into_chunks(x, Axis(0), 1)
        .into_iter()
        .flat_map(|x_b| split_into_chunks(x_b.index_axis_move(Axis(0), 0), Axis(0), 1))
        .map(|x_bh| x_bh.index_axis_move(Axis(0), 0))
        .collect()
}
