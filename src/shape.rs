//! Checks an attention call's arguments against each other, once, before any
//! path runs; afterwards every index the paths compute is in bounds.

use ndarray::ArrayView4;

use crate::element::Element;
use crate::error::{AttentionError, ErrorKind, shape_error};
use crate::options::AttentionOptions;

/// The dimensions of a checked attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttentionShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub len_q: usize,
    pub len_kv: usize,
    pub d_k: usize,
    pub d_v: usize,
}

impl AttentionShape {
    /// The key/value head that query head `h` reads (GQA/MQA): consecutive
    /// groups of `heads / kv_heads` query heads share one key/value head.
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// `[batch, heads, len_q, d_v]`, the output's shape.
    pub fn output_dim(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.heads, self.len_q, self.d_v)
    }
}

/// Checks `q`, `k`, `v` and the options against each other; returns the
/// shape and the scale to use.
pub(crate) fn check<F: Element>(
    q: &ArrayView4<'_, F>,
    k: &ArrayView4<'_, F>,
    v: &ArrayView4<'_, F>,
    opts: &AttentionOptions<'_, F>,
) -> Result<(AttentionShape, F), AttentionError> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let layouts = || {
        format!(
            "q {qs:?} = [batch, heads, len_q, d_k], k {ks:?} = [batch, kv_heads, len_kv, d_k], \
             v {vs:?} = [batch, kv_heads, len_kv, d_v]"
        )
    };
    if ks[0] != qs[0] || vs[0] != qs[0] {
        return Err(shape_error(format!("batch sizes differ: {}", layouts())));
    }
    if qs[3] == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!("d_k must be positive: {}", layouts()),
        ));
    }
    if ks[3] != qs[3] {
        return Err(shape_error(format!("d_k of q and k differ: {}", layouts())));
    }
    if vs[1] != ks[1] {
        return Err(shape_error(format!(
            "kv_heads of k and v differ: {}",
            layouts()
        )));
    }
    if vs[2] != ks[2] {
        return Err(shape_error(format!(
            "len_kv of k and v differ: {}",
            layouts()
        )));
    }
    if qs[1] == 0 || ks[1] == 0 {
        return Err(AttentionError::new(
            ErrorKind::ZeroDimension,
            format!("heads and kv_heads must be positive: {}", layouts()),
        ));
    }
    if qs[1] % ks[1] != 0 {
        return Err(AttentionError::new(
            ErrorKind::HeadsNotDivisible,
            format!(
                "heads ({}) must be a multiple of kv_heads ({}): {}",
                qs[1],
                ks[1],
                layouts()
            ),
        ));
    }
    let shape = AttentionShape {
        batch: qs[0],
        heads: qs[1],
        kv_heads: ks[1],
        len_q: qs[2],
        len_kv: ks[2],
        d_k: qs[3],
        d_v: vs[3],
    };
    let total_len_kv = match opts.key_shard {
        Some(shard) if shard.offset + shape.len_kv > shard.total_len_kv => {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!(
                    "key_shard: keys {}..{} do not fit in total_len_kv = {}: {}",
                    shard.offset,
                    shard.offset + shape.len_kv,
                    shard.total_len_kv,
                    layouts()
                ),
            ));
        }
        Some(shard) => shard.total_len_kv,
        None => shape.len_kv,
    };
    let full = [shape.batch, shape.heads, shape.len_q, total_len_kv];
    if let Some(mask) = &opts.keep_mask {
        check_broadcast("keep_mask", mask.shape(), &full)?;
    }
    if let Some(bias) = &opts.bias {
        check_broadcast("bias", bias.shape(), &full)?;
    }
    if let Some(lengths) = opts.key_lengths {
        if lengths.len() != shape.batch {
            return Err(AttentionError::new(
                ErrorKind::KeyLengths,
                format!(
                    "key_lengths has {} entries but batch is {}: {}",
                    lengths.len(),
                    shape.batch,
                    layouts()
                ),
            ));
        }
        if let Some((b, &len)) = lengths
            .iter()
            .enumerate()
            .find(|&(_, &len)| len > total_len_kv)
        {
            return Err(AttentionError::new(
                ErrorKind::KeyLengths,
                format!(
                    "key_lengths[{b}] = {len} is past len_kv = {}: {}",
                    total_len_kv,
                    layouts()
                ),
            ));
        }
    }
    if opts.window == Some(0) {
        return Err(AttentionError::new(
            ErrorKind::InvalidOption,
            "window must be at least 1 key, got 0",
        ));
    }
    let scale = match opts.scale {
        Some(s) if !s.is_finite() => {
            return Err(AttentionError::new(
                ErrorKind::InvalidOption,
                format!("scale must be finite, got {s}"),
            ));
        }
        Some(s) => s,
        None => F::one() / F::from(shape.d_k).unwrap_or_else(F::one).sqrt(),
    };
    Ok((shape, scale))
}

/// Checks that `out` has exactly the output's shape.
pub(crate) fn check_output(shape: &AttentionShape, out: &[usize]) -> Result<(), AttentionError> {
    let (b, h, l, d) = shape.output_dim();
    if out != [b, h, l, d] {
        return Err(shape_error(format!(
            "out has shape {out:?} but the output is [batch, heads, len_q, d_v] = {:?}",
            [b, h, l, d]
        )));
    }
    Ok(())
}

fn check_broadcast(name: &str, got: &[usize], full: &[usize; 4]) -> Result<(), AttentionError> {
    let fits = got.iter().zip(full).all(|(&g, &f)| g == f || g == 1);
    if fits {
        Ok(())
    } else {
        Err(AttentionError::new(
            ErrorKind::NotBroadcastable,
            format!(
                "{name} has shape {got:?}, which does not broadcast to \
                 [batch, heads, len_q, len_kv] = {full:?} (each dimension must match or be 1)"
            ),
        ))
    }
}
