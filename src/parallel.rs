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
