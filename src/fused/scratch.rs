//! Working buffers of the fused path: 64-byte aligned, and kept by each
//! thread for its next call.
//!
//! Why both: buffers of 128 KiB or more come from `mmap` and go back to the
//! system when freed, so a fresh buffer per call is faulted in page by page
//! again (about 900 faults per forward call at N = 1024, 18% of a
//! forward+backward at N = 256, measured on a Xeon); and key panels that
//! straddle cache lines cost the microkernel about 4%. A thread's spare
//! buffers are reused by its next call (rayon's workers live as long as the
//! process), up to [`SPARE_BYTES`] per thread.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

use crate::alloc::try_with_capacity;
use crate::error::AttentionError;

/// The most memory a thread keeps in spare buffers of one element type
/// between calls.
const SPARE_BYTES: usize = 64 << 20;

/// This thread's spare buffers of one element type, each with room for at
/// least its capacity.
type Spares<T> = RefCell<Vec<Vec<T>>>;

thread_local! {
    static SPARE_F32: Spares<f32> = const { RefCell::new(Vec::new()) };
    static SPARE_U32: Spares<u32> = const { RefCell::new(Vec::new()) };
}

/// An element type of working buffers: `f32` for the `f32` kernels, `u32`
/// for `bf16` pairs. Each has its own pool of spares.
pub(crate) trait ScratchElement: Copy + 'static {
    /// What a new buffer's elements are.
    const ZERO: Self;
    /// This thread's spares of this type.
    fn spares() -> &'static LocalKey<Spares<Self>>;
}

impl ScratchElement for f32 {
    const ZERO: Self = 0.0;
    fn spares() -> &'static LocalKey<Spares<Self>> {
        &SPARE_F32
    }
}

impl ScratchElement for u32 {
    const ZERO: Self = 0;
    fn spares() -> &'static LocalKey<Spares<Self>> {
        &SPARE_U32
    }
}

/// `len` elements (floats unless said) starting on a 64-byte boundary,
/// taken from this thread's spares when one is large enough, and given back
/// to them when dropped.
pub(crate) struct Scratch<T: ScratchElement = f32> {
    data: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: ScratchElement> Scratch<T> {
    /// Elements per 64-byte cache line: the alignment of every buffer.
    const LINE: usize = 64 / size_of::<T>();

    /// `len` copies of `value`.
    ///
    /// # Errors
    /// When the buffer is too large to address or cannot be allocated.
    pub(crate) fn filled(what: &str, len: usize, value: T) -> Result<Self, AttentionError> {
        let mut scratch = Self::take(what, len)?;
        scratch.data.clear();
        scratch.data.resize(scratch.start + len, value);
        Ok(scratch)
    }

    /// `len` elements of any value: what a reused buffer last held (NaN
    /// included), zeros where it is new. For buffers the caller writes
    /// before it reads, which spares the fill (a memset of every query
    /// tile's buffers was 6% of a 256-token forward's instructions).
    ///
    /// # Errors
    /// As [`filled`](Self::filled).
    pub(crate) fn for_writing(what: &str, len: usize) -> Result<Self, AttentionError> {
        let mut scratch = Self::take(what, len)?;
        scratch.data.resize(scratch.start + len, T::ZERO);
        Ok(scratch)
    }

    /// A buffer with room for `len` elements from a 64-byte boundary, from
    /// this thread's spares when one is large enough; its contents are
    /// whatever it held.
    fn take(what: &str, len: usize) -> Result<Self, AttentionError> {
        let data: Vec<T> = spare(what, len.saturating_add(Self::LINE))?;
        // Where the first whole cache line starts (at most LINE − 1
        // elements in, as the allocation is aligned to its element). The
        // same allocation always gives the same start.
        let start = data.as_ptr().align_offset(64).min(Self::LINE - 1);
        Ok(Self { data, start, len })
    }

    /// `len` zeros.
    ///
    /// # Errors
    /// As [`filled`](Self::filled).
    pub(crate) fn zeroed(what: &str, len: usize) -> Result<Self, AttentionError> {
        Self::filled(what, len, T::ZERO)
    }
}

impl<T: ScratchElement> Deref for Scratch<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.data[self.start..self.start + self.len]
    }
}

impl<T: ScratchElement> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data[self.start..self.start + self.len]
    }
}

impl<T: ScratchElement> Drop for Scratch<T> {
    fn drop(&mut self) {
        keep(std::mem::take(&mut self.data));
    }
}

/// A buffer with room for at least `room` elements (its length is what it
/// last held): the smallest of this thread's spares that is large enough,
/// or a new one.
///
/// # Errors
/// When a new buffer is too large to address or cannot be allocated.
pub(crate) fn spare<T: ScratchElement>(what: &str, room: usize) -> Result<Vec<T>, AttentionError> {
    let reused = T::spares().with_borrow_mut(|spare| {
        // The smallest spare that fits, so large ones stay for large calls.
        let best = (0..spare.len())
            .filter(|&i| spare[i].capacity() >= room)
            .min_by_key(|&i| spare[i].capacity())?;
        Some(spare.swap_remove(best))
    });
    match reused {
        Some(data) => Ok(data),
        None => try_with_capacity(what, room),
    }
}

/// Gives `data` to this thread's spares, if they stay within
/// [`SPARE_BYTES`]; frees it otherwise.
pub(crate) fn keep<T: ScratchElement>(data: Vec<T>) {
    // `try_with` and `try_borrow_mut`: a thread being torn down, or a
    // buffer dropped while the pool is in use, simply frees it.
    let _ = T::spares().try_with(|spare| {
        if let Ok(mut spare) = spare.try_borrow_mut() {
            let bytes = |d: &Vec<T>| d.capacity() * size_of::<T>();
            let kept: usize = spare.iter().map(bytes).sum();
            if kept + bytes(&data) <= SPARE_BYTES {
                spare.push(data);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_filled_and_reused() {
        let first = Scratch::filled("a test buffer", 1000, 2.5).unwrap();
        assert_eq!(first.len(), 1000);
        assert!(first.iter().all(|&x| x == 2.5));
        assert_eq!(first.as_ptr() as usize % 64, 0);
        let address = first.as_ptr();
        drop(first);
        let second = Scratch::<f32>::zeroed("a test buffer", 900).unwrap();
        assert!(second.iter().all(|&x| x == 0.0));
        assert_eq!(second.as_ptr() as usize % 64, 0);
        // The same memory, reused (its start may move to stay aligned).
        assert!((second.as_ptr() as usize).abs_diff(address as usize) < 64);
        // `u32` buffers (bf16 pairs) are aligned too, from their own pool.
        let pairs = Scratch::<u32>::filled("a test buffer", 300, 7).unwrap();
        assert!(pairs.iter().all(|&x| x == 7));
        assert_eq!(pairs.as_ptr() as usize % 64, 0);
    }

    #[test]
    fn a_buffer_for_writing_keeps_what_it_held_and_zeroes_what_is_new() {
        // A large buffer, then a short use of the same memory.
        drop(Scratch::filled("a test buffer", 200, 1.0).unwrap());
        let mut short = Scratch::filled("a test buffer", 100, 7.0).unwrap();
        short[99] = f32::NAN;
        let address = short.as_ptr();
        drop(short);
        let again = Scratch::for_writing("a test buffer", 150).unwrap();
        assert_eq!(again.as_ptr(), address);
        assert!(again[..99].iter().all(|&x| x == 7.0));
        assert!(again[99].is_nan());
        // Past what the last use held, zeros (not the first use's ones).
        assert!(again[100..].iter().all(|&x| x == 0.0));
    }
}
