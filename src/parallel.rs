//! Splitting work over threads: rayon's global pool (`RAYON_NUM_THREADS`)
//! with the `rayon` feature, a plain loop without it.
//!
//! Each item is computed the same way whichever thread runs it, so results
//! are bitwise identical for any thread count.

/// `work` applied to every item, with per-thread state made by `init`;
/// the results in the items' order.
pub(crate) fn map_with<T, S, R>(
    items: Vec<T>,
    init: impl Fn() -> S + Send + Sync,
    work: impl Fn(&mut S, T) -> R + Send + Sync,
) -> Vec<R>
where
    T: Send,
    R: Send,
{
    #[cfg(feature = "rayon")]
    {
        use rayon::prelude::*;
        // With one thread, rayon would still hand the items to its pool's
        // thread and sleep until it is done: a wake-up each way per call,
        // which cost a one-thread 256-token forward 16% on a Xeon (mostly
        // time asleep, which profiles of the CPU do not show). Run them
        // here instead, in order.
        if rayon::current_num_threads() > 1 {
            // One item per task: items are tiles of thousands of FMAs or more.
            return items
                .into_par_iter()
                .with_max_len(1)
                .map_init(init, work)
                .collect();
        }
    }
    let mut state = init();
    items
        .into_iter()
        .map(|item| work(&mut state, item))
        .collect()
}

/// Splits `view` along `axis` into consecutive pieces of `chunk` (the last
/// may be shorter), each a view of the same lifetime that can go to another
/// thread.
pub(crate) fn split_into_chunks<'a, A, D: ndarray::Dimension>(
    mut view: ndarray::ArrayViewMut<'a, A, D>,
    axis: ndarray::Axis,
    chunk: usize,
) -> Vec<ndarray::ArrayViewMut<'a, A, D>> {
    let mut pieces = Vec::with_capacity(view.len_of(axis).div_ceil(chunk.max(1)));
    while view.len_of(axis) > chunk {
        let (first, rest) = view.split_at(axis, chunk);
        pieces.push(first);
        view = rest;
    }
    if view.len_of(axis) > 0 {
        pieces.push(view);
    }
    pieces
}

/// Elements per piece of [`for_each_piece`]: 32 Ki, 128 KiB of `f32`,
/// enough work per task (a conversion runs at several elements per
/// nanosecond) for the split to pay.
#[cfg_attr(not(feature = "rayon"), allow(dead_code))]
const PIECE: usize = 32 * 1024;
/// The fewest elements [`for_each_piece`] splits: below this the pool's
/// wake-ups cost more than the split saves (measured with two threads on
/// a Sapphire Rapids Xeon: a 256-token causal bf16 forward, whose q and
/// output are 128 Ki elements each, ran 9% slower split in four).
#[cfg_attr(not(feature = "rayon"), allow(dead_code))]
const SPLIT_FROM: usize = 8 * PIECE;

/// `work(x_piece, y_piece)` over `x` and `y` (of one length) cut into
/// matching pieces: element-wise work, such as a whole input's conversion,
/// which would otherwise run on one thread before and after a parallel
/// call. In one piece when short (under [`SPLIT_FROM`]) or with one
/// thread.
#[cfg_attr(not(feature = "half"), allow(dead_code))]
pub(crate) fn for_each_piece<A: Sync, B: Send>(
    x: &[A],
    y: &mut [B],
    work: impl Fn(&[A], &mut [B]) + Send + Sync,
) {
    assert_eq!(x.len(), y.len(), "matching lengths");
    #[cfg(feature = "rayon")]
    {
        use rayon::prelude::*;
        if x.len() >= SPLIT_FROM && rayon::current_num_threads() > 1 {
            x.par_chunks(PIECE)
                .zip(y.par_chunks_mut(PIECE))
                .for_each(|(x, y)| work(x, y));
            return;
        }
    }
    work(x, y);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_element_once_in_place() {
        // Past the split threshold, with a ragged last piece, and short.
        for len in [SPLIT_FROM + PIECE / 3, 1000, 0] {
            let x: Vec<u32> = (0..len as u32).collect();
            let mut y = vec![0u64; len];
            for_each_piece(&x, &mut y, |x, y| {
                for (y, &x) in y.iter_mut().zip(x) {
                    *y += u64::from(x) * 3 + 1;
                }
            });
            assert!(
                y.iter().enumerate().all(|(i, &y)| y == i as u64 * 3 + 1),
                "{len}"
            );
        }
    }
}
