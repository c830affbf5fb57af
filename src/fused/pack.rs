//! Packing operands into the layouts the kernels read: a head's keys in
//! panels for the `scores` kernel beside a second matrix over the same keys
//! as padded rows for the `accumulate_values` kernel ([`PackedHead`]), and
//! the backward's query rows ([`QueryRows`]).
//!
//! Padding (keys to whole key tiles, rows to whole query tiles, columns to
//! whole vectors) is zero, so the kernels have no ragged edges.

use ndarray::{ArrayView1, ArrayView2, Axis, s};

use super::scratch::Scratch;
use super::{KEY_TILE, QUERY_TILE};
use crate::alloc::{element_count, try_filled};
use crate::call::{AttentionShape, BackwardCall, head};
use crate::error::AttentionError;
use crate::simd::{Kernel, Load};

/// Two matrices over the same `len_kv` keys, laid out for the kernels and
/// padded to whole key tiles: `panels` for the `scores` kernel (S = Q·Kᵀ
/// in the forward; dP = dO·Vᵀ in the backward, with the values there) and
/// rows for the `accumulate_values` kernel (P·V in the forward; dS·K in
/// the backward, with the keys there), when the caller wants them.
pub(crate) struct PackedHead<'a> {
    /// The first matrix in panels of `K::KEY_PANEL` keys, each
    /// `[width][KEY_PANEL]`.
    panels: Scratch,
    rows: HeadRows<'a>,
    row_width: usize,
    /// The largest `|x|` in the first matrix, or `+inf` when it holds a NaN
    /// or an infinity: with the queries' it bounds the scores, which tells
    /// when they may overflow.
    pub(crate) panels_max_abs: f32,
    /// Per key tile: do the rows hold a NaN or an infinity there?
    pub(crate) tile_has_nonfinite_rows: Vec<bool>,
}

/// Where a [`PackedHead`]'s second matrix is read from.
enum HeadRows<'a> {
    /// Nowhere: not asked for, or not packed yet.
    Absent,
    /// The caller's `f32` rows, as they are: each row contiguous, a whole
    /// number of vectors wide and starting on a vector boundary
    /// ([`rows_on_vector_boundaries`]), the `accumulate_values` kernel reads
    /// them where they lie, and a copy would cost a pass over them per head
    /// for nothing (the packed value rows were about 1.5% of a 256-token
    /// forward on Zen 4).
    InPlace(ArrayView2<'a, f32>),
    /// Copied into a buffer `[len_kv padded][row_width]`, rows padded with
    /// zeros to whole vectors and the keys to whole tiles: rows in half
    /// precision (widened), strided across their numbers, ragged, or off
    /// the vectors' boundaries.
    Packed(Scratch),
}

impl<'a> PackedHead<'a> {
    /// Buffers for `len_kv` keys, panels of `panel_width` numbers per key
    /// and rows of `row_width`. The rows' buffer is taken when
    /// [`pack`](Self::pack) needs one.
    ///
    /// # Errors
    /// When they are too large to address or cannot be allocated.
    pub(crate) fn new<K: Kernel>(
        len_kv: usize,
        panel_width: usize,
        row_width: usize,
    ) -> Result<Self, AttentionError> {
        let tiles = len_kv.div_ceil(KEY_TILE);
        let padded_keys = tiles * KEY_TILE;
        let row_width = row_width.div_ceil(K::LANES) * K::LANES;
        let panels = element_count::<f32>("packed keys", &[padded_keys, panel_width])?;
        element_count::<f32>("packed values", &[padded_keys, row_width])?;
        Ok(Self {
            // `pack` writes every entry, padding included.
            panels: Scratch::for_writing("packed keys", panels)?,
            rows: HeadRows::Absent,
            row_width,
            panels_max_abs: 0.0,
            tile_has_nonfinite_rows: try_filled("packed values", tiles, false)?,
        })
    }

    /// Packs `panel_scale·for_panels` `[len_kv, panel_width]` (the forward's
    /// keys carry the call's scale), and lays out `for_rows` `[len_kv,
    /// row_width]` when given: read in place where
    /// the `accumulate_values` kernel can, else packed (the buffers may hold
    /// anything before; padding is written as zeros). Elements in half
    /// precision (a half call's keys and values) are widened to `f32` on
    /// the way, a key tile at a time, never as a whole copy.
    ///
    /// # Errors
    /// When the buffer a key tile is widened in, or the rows' buffer,
    /// cannot be allocated.
    pub(crate) fn pack<K: Kernel, E: Load>(
        &mut self,
        kernel: K,
        for_panels: ArrayView2<'_, E>,
        panel_scale: f32,
        for_rows: Option<ArrayView2<'a, E>>,
    ) -> Result<(), AttentionError> {
        // Padding included, and the bound of the keys in the same pass.
        self.panels_max_abs = match E::as_f32(for_panels) {
            Some(keys) => kernel.pack_panels(keys, &mut self.panels, panel_scale),
            None => self.pack_widened_panels(kernel, for_panels, panel_scale)?,
        };
        let for_rows = match for_rows {
            Some(rows) if self.row_width > 0 => rows,
            _ => {
                // No rows wanted, or `d_v = 0` (a forward for the
                // log-sum-exp alone).
                self.tile_has_nonfinite_rows.fill(false);
                return Ok(());
            }
        };
        let in_place = E::as_f32(for_rows).filter(|rows| {
            rows.ncols() == self.row_width
                && (rows.ncols() <= 1 || rows.strides()[1] == 1)
                && rows_on_vector_boundaries::<K>(rows)
        });
        if let Some(rows) = in_place {
            for (nonfinite, tile) in self
                .tile_has_nonfinite_rows
                .iter_mut()
                .zip(rows.axis_chunks_iter(Axis(0), KEY_TILE))
            {
                *nonfinite = match tile.as_slice_memory_order() {
                    Some(all) => !kernel.all_finite(all),
                    None => !tile.rows().into_iter().all(|row| {
                        kernel.all_finite(row.as_slice_memory_order().expect("contiguous rows"))
                    }),
                };
            }
            self.rows = HeadRows::InPlace(rows);
            return Ok(());
        }
        let packed_len = self.tile_has_nonfinite_rows.len() * KEY_TILE * self.row_width;
        let mut packed = match std::mem::replace(&mut self.rows, HeadRows::Absent) {
            HeadRows::Packed(buffer) => buffer,
            _ => Scratch::for_writing("packed values", packed_len)?,
        };
        let len_kv = for_rows.nrows();
        scaled_rows(kernel, for_rows, &mut packed, self.row_width, 1.0);
        packed[len_kv * self.row_width..].fill(0.0);
        for (nonfinite, tile) in self
            .tile_has_nonfinite_rows
            .iter_mut()
            .zip(packed.chunks_exact(KEY_TILE * self.row_width))
        {
            *nonfinite = !kernel.all_finite(tile);
        }
        self.rows = HeadRows::Packed(packed);
        Ok(())
    }

    /// [`Kernel::pack_panels`] for keys stored in half precision: each key
    /// tile widened into a buffer that stays in L1, then packed from there
    /// into its panels. Returns the bound of all of them.
    fn pack_widened_panels<K: Kernel, E: Load>(
        &mut self,
        kernel: K,
        keys: ArrayView2<'_, E>,
        scale: f32,
    ) -> Result<f32, AttentionError> {
        let (len_kv, width) = keys.dim();
        if width == 0 || len_kv == 0 {
            // Nothing to widen: the panels are all padding (zeros), if any.
            self.panels.fill(0.0);
            return Ok(0.0);
        }
        let what = "a widened key tile";
        let tile_len = element_count::<f32>(what, &[KEY_TILE, width])?;
        let mut wide = Scratch::for_writing(what, tile_len)?;
        let mut bound = 0.0f32;
        for (t, panels) in self.panels.chunks_exact_mut(tile_len).enumerate() {
            let rows = (t * KEY_TILE..((t + 1) * KEY_TILE).min(len_kv)).len();
            for (i, wide_row) in wide.chunks_exact_mut(width).take(rows).enumerate() {
                scaled_row(kernel, keys.row(t * KEY_TILE + i), wide_row, 1.0);
            }
            let tile =
                ArrayView2::from_shape((rows, width), &wide[..rows * width]).expect("whole rows");
            // NaN or an infinity makes a tile's bound `+inf`, and the max.
            bound = bound.max(kernel.pack_panels(tile, panels, scale));
        }
        Ok(bound)
    }

    /// The rows of the key tile starting at `j0`: `[KEY_TILE, row_width]`
    /// packed, or up to `KEY_TILE` of the caller's rows read in place (the
    /// last tile's padding keys, whose weights are zero, are not there).
    ///
    /// # Panics
    /// When the head was packed without rows (a bug in the driver).
    pub(crate) fn tile_rows(&self, j0: usize) -> ArrayView2<'_, f32> {
        match &self.rows {
            HeadRows::InPlace(rows) => rows.slice(s![j0..(j0 + KEY_TILE).min(rows.nrows()), ..]),
            HeadRows::Packed(packed) => {
                let tile = &packed[j0 * self.row_width..(j0 + KEY_TILE) * self.row_width];
                ArrayView2::from_shape((KEY_TILE, self.row_width), tile).expect("a whole tile")
            }
            HeadRows::Absent => panic!("rows of a head packed without them"),
        }
    }

    /// The `panel_width`-wide panels of the key tile starting at `j0`.
    pub(crate) fn tile_panels(&self, j0: usize, panel_width: usize) -> &[f32] {
        &self.panels[j0 * panel_width..(j0 + KEY_TILE) * panel_width]
    }
}

/// Whether every row of `rows` starts on a boundary of `K`'s vectors, so
/// that no vector load of a row read in place straddles two cache lines.
/// A caller's array rarely does: a large `Vec` comes from `mmap` 16 bytes
/// past a page boundary, and there every other 32-byte load of a row split
/// across two lines; reading such rows in place made the `P·V` kernel the
/// slower of the two at d = 128 on Zen 3 (AVX2), and packing them into an
/// aligned buffer instead measured +0–4% on a whole forward there, d = 64
/// and 128 (`docs/PERFORMANCE.md`).
fn rows_on_vector_boundaries<K: Kernel>(rows: &ArrayView2<'_, f32>) -> bool {
    let vector_bytes = K::LANES * size_of::<f32>();
    let start = rows.as_ptr() as usize;
    let stride_bytes = rows.strides()[0].unsigned_abs() * size_of::<f32>();
    start.is_multiple_of(vector_bytes)
        && (rows.nrows() <= 1 || stride_bytes.is_multiple_of(vector_bytes))
}

/// One query head's rows for the backward, packed for the kernels; rows
/// padded to whole query tiles. Rows that see no key (log-sum-exp `−inf`)
/// and padding rows are zero, and their log-sum-exp is `−inf`, so they add
/// nothing anywhere.
pub(crate) struct QueryRows {
    /// `scale·q`, `[padded][d_k]` for `scores`, and `[padded][k_width]` as
    /// rows: none where `d_k = k_width`, the same numbers in the same
    /// places, read from `q_scaled`.
    pub(crate) q_scaled: Scratch,
    q_scaled_rows: Option<Scratch>,
    /// `d_out`, `[padded][d_v]` for `scores`, and `[padded][v_width]` as
    /// rows (none where `d_v = v_width`, as above).
    pub(crate) d_out: Scratch,
    d_out_rows: Option<Scratch>,
    k_width: usize,
    v_width: usize,
    /// `D_i = Σ_c dO_ic · O_ic`.
    pub(crate) delta: Vec<f32>,
    /// One output row `[d_v]`, copied here when the forward's output is
    /// strided, so that its `D` is the same dot product as a contiguous
    /// row's.
    out_row: Vec<f32>,
    pub(crate) log_sum_exp: Vec<f32>,
    pub(crate) padded: usize,
}

impl QueryRows {
    /// Zeroed buffers for one query head of `shape`.
    ///
    /// # Errors
    /// When they are too large to address or cannot be allocated.
    pub(crate) fn new<K: Kernel>(shape: &AttentionShape) -> Result<Self, AttentionError> {
        let (d_k, d_v) = (shape.d_k, shape.d_v);
        let padded = shape.len_q.div_ceil(QUERY_TILE) * QUERY_TILE;
        let (k_width, v_width) = (
            d_k.div_ceil(K::LANES) * K::LANES,
            d_v.div_ceil(K::LANES) * K::LANES,
        );
        let what = "the backward's query rows";
        let buffer = |width| Scratch::zeroed(what, element_count::<f32>(what, &[padded, width])?);
        let padded_rows = |width, padded_width| {
            (width != padded_width)
                .then(|| buffer(padded_width))
                .transpose()
        };
        Ok(QueryRows {
            q_scaled: buffer(d_k)?,
            q_scaled_rows: padded_rows(d_k, k_width)?,
            d_out: buffer(d_v)?,
            d_out_rows: padded_rows(d_v, v_width)?,
            k_width,
            v_width,
            delta: try_filled(what, padded, 0.0)?,
            out_row: try_filled(what, d_v, 0.0)?,
            log_sum_exp: try_filled(what, padded, f32::NEG_INFINITY)?,
            padded,
        })
    }

    /// Rows `i0..i0 + n` of `scale·q`, `[n, k_width]`.
    pub(crate) fn q_scaled_rows(&self, i0: usize, n: usize) -> ArrayView2<'_, f32> {
        let all = self.q_scaled_rows.as_deref().unwrap_or(&self.q_scaled);
        let rows = &all[i0 * self.k_width..(i0 + n) * self.k_width];
        ArrayView2::from_shape((n, self.k_width), rows).expect("whole rows")
    }

    /// Rows `i0..i0 + n` of `d_out`, `[n, v_width]`.
    pub(crate) fn d_out_rows(&self, i0: usize, n: usize) -> ArrayView2<'_, f32> {
        let all = self.d_out_rows.as_deref().unwrap_or(&self.d_out);
        let rows = &all[i0 * self.v_width..(i0 + n) * self.v_width];
        ArrayView2::from_shape((n, self.v_width), rows).expect("whole rows")
    }

    /// Packs query head `h` of batch item `b`. Every real row is written
    /// (zeros for rows that see no key); padding rows stay as `new` made
    /// them, so the buffers serve head after head.
    pub(crate) fn fill<K: Kernel>(
        &mut self,
        kernel: K,
        call: &BackwardCall<'_, f32>,
        b: usize,
        h: usize,
    ) {
        let (d_k, d_v) = (call.forward.shape.d_k, call.forward.shape.d_v);
        let scale = call.forward.scale;
        let (q, out, d_out) = (
            head(&call.forward.q, b, h),
            head(&call.out, b, h),
            head(&call.d_out, b, h),
        );
        // With a sink, a row that sees no key has lse = sink.
        let sink = call.forward.sink(h);
        let lse = call
            .log_sum_exp
            .index_axis(Axis(0), b)
            .index_axis_move(Axis(0), h);
        let out_row = &mut self.out_row[..];
        let rows = q
            .rows()
            .into_iter()
            .zip(out.rows())
            .zip(d_out.rows())
            .zip(&lse)
            .zip(self.q_scaled.chunks_exact_mut(d_k))
            .zip(self.d_out.chunks_exact_mut(d_v))
            .zip(self.delta.iter_mut().zip(self.log_sum_exp.iter_mut()));
        for ((((((q, out), d_out), &lse), q_scaled), d_out_packed), (delta, lse_packed)) in rows {
            // Rows that see no key are zero, whatever q and d_out hold there
            // (rows the sink outweighs entirely count as such).
            let sees_keys = crate::modifiers::sees_keys(lse, sink);
            *lse_packed = lse;
            copy_scaled(kernel, q_scaled, q, if sees_keys { scale } else { 0.0 });
            copy_scaled(
                kernel,
                d_out_packed,
                d_out,
                if sees_keys { 1.0 } else { 0.0 },
            );
            *delta = if sees_keys {
                match out.as_slice() {
                    Some(out) => kernel.dot(d_out_packed, out),
                    None => {
                        out_row.iter_mut().zip(out).for_each(|(y, &x)| *y = x);
                        kernel.dot(d_out_packed, out_row)
                    }
                }
            } else {
                0.0
            };
        }
        // The rows padded to whole vectors, where they differ (their
        // padding stays zero).
        let len_q = q.nrows();
        for (compact, padded, width, padded_width) in [
            (&self.q_scaled, &mut self.q_scaled_rows, d_k, self.k_width),
            (&self.d_out, &mut self.d_out_rows, d_v, self.v_width),
        ] {
            if let Some(padded) = padded {
                let rows = padded.chunks_exact_mut(padded_width);
                for (to, from) in rows.zip(compact.chunks_exact(width)).take(len_q) {
                    to[..width].copy_from_slice(from);
                }
            }
        }
    }
}

/// `to[c] = factor · from[c]`, on slices when `from` is contiguous. A zero
/// factor writes zeros even where `from` holds NaN.
fn copy_scaled<K: Kernel>(kernel: K, to: &mut [f32], from: ArrayView1<'_, f32>, factor: f32) {
    if factor == 0.0 {
        to.fill(0.0);
        return;
    }
    scaled_row(kernel, from, to, factor);
}

/// `to = factor · from` for the rows of `from` (any [`Load`] type, widened
/// as [`scaled_row`] does) into rows of `width ≥ from.ncols()` in `to`,
/// each row's padding zero. Rows back to back and as wide as `width` go in
/// one kernel call, not one per row (those calls were 4% of a 256-token
/// forward on Zen 4).
pub(crate) fn scaled_rows<K: Kernel, E: Load>(
    kernel: K,
    from: ArrayView2<'_, E>,
    to: &mut [f32],
    width: usize,
    factor: f32,
) {
    match from.as_slice() {
        Some(all) if from.ncols() == width => kernel.scaled_copy(all, &mut to[..all.len()], factor),
        _ => {
            for (row, packed) in from.rows().into_iter().zip(to.chunks_exact_mut(width)) {
                scaled_row(kernel, row, &mut packed[..row.len()], factor);
                packed[row.len()..].fill(0.0);
            }
        }
    }
}

/// `to[c] = factor · from[c]` for a row of any [`Load`] type, widened to
/// `f32` (exactly) on the way: by the kernel where the row is contiguous,
/// else one element at a time.
pub(crate) fn scaled_row<K: Kernel, E: Load>(
    kernel: K,
    from: ArrayView1<'_, E>,
    to: &mut [f32],
    factor: f32,
) {
    match from.as_slice() {
        Some(from) => kernel.scaled_copy(from, to, factor),
        None => (to.iter_mut().zip(from.iter())).for_each(|(t, &x)| *t = x.to_f32() * factor),
    }
}

#[cfg(all(test, feature = "half"))]
mod tests {
    use half::{bf16, f16};
    use ndarray::{Array2, ArrayView2, s};

    use super::PackedHead;
    use crate::fused::KEY_TILE;
    use crate::simd::{Kernel, Load, WithKernel, available_kernel_sets, with_kernel};

    /// Half keys and values packed as they are give the bits of the same
    /// numbers widened first, with the same bound and non-finite tiles:
    /// lengths around the key tile, odd widths, strided and reversed rows,
    /// NaN and infinities.
    struct HalvesAsWidened;

    impl WithKernel for HalvesAsWidened {
        type Output = ();

        fn run<K: Kernel>(self, kernel: K) {
            check::<K, bf16>(kernel);
            check::<K, f16>(kernel);
        }
    }

    fn check<K: Kernel, H: Load + num_traits::Float>(kernel: K) {
        let pack = |keys: ArrayView2<'_, H>, values: ArrayView2<'_, H>| {
            let wide = |x: ArrayView2<'_, H>| x.mapv(|x| Load::to_f32(x));
            let (len, d_k, d_v) = (keys.nrows(), keys.ncols(), values.ncols());
            let mut half = PackedHead::new::<K>(len, d_k, d_v).unwrap();
            half.pack(kernel, keys, 0.37, Some(values)).unwrap();
            let (wide_keys, wide_values) = (wide(keys), wide(values));
            let mut f32s = PackedHead::new::<K>(len, d_k, d_v).unwrap();
            f32s.pack(kernel, wide_keys.view(), 0.37, Some(wide_values.view()))
                .unwrap();
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let what = format!("{} {len}×{d_k}/{d_v}", K::SET);
            assert_eq!(bits(&half.panels), bits(&f32s.panels), "{what}: panels");
            // The `f32` rows may be read in place, with no padding keys;
            // the real keys' rows are the same numbers either way.
            for j0 in (0..len).step_by(KEY_TILE) {
                let keys = KEY_TILE.min(len - j0);
                let tile_bits = |head: &PackedHead<'_>| {
                    let rows = head.tile_rows(j0);
                    let rows = rows.slice(s![..keys, ..]);
                    rows.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(tile_bits(&half), tile_bits(&f32s), "{what}: rows at {j0}");
            }
            assert_eq!(
                half.panels_max_abs.to_bits(),
                f32s.panels_max_abs.to_bits(),
                "{what}"
            );
            assert_eq!(
                half.tile_has_nonfinite_rows, f32s.tile_has_nonfinite_rows,
                "{what}"
            );
        };
        for len in [0, 1, 63, 64, 65, 200] {
            for (d_k, d_v) in [(1, 1), (17, 33), (64, 16)] {
                let number = |i: usize, j: usize| {
                    H::from(((i * 31 + j * 7) % 23) as f32 * 0.37 - 4.0).unwrap()
                };
                let keys = Array2::from_shape_fn((len, 2 * d_k), |(i, j)| number(i, j));
                let values = Array2::from_shape_fn((len, d_v), |(i, j)| number(j, i));
                pack(keys.slice(s![.., ..d_k]), values.view());
                pack(keys.slice(s![..;-1, ..;2]), values.slice(s![..;-1, ..]));
                if len > 0 {
                    let (mut keys, mut values) = (keys.clone(), values.clone());
                    keys[[len / 2, 0]] = H::nan();
                    values[[len - 1, d_v - 1]] = H::infinity();
                    pack(keys.slice(s![.., ..d_k]), values.view());
                }
            }
        }
    }

    #[test]
    fn half_keys_and_values_pack_as_their_widened_copies() {
        for set in available_kernel_sets() {
            with_kernel(set, HalvesAsWidened).unwrap();
        }
    }
}
