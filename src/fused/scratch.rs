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

use crate::alloc::try_with_capacity;
use crate::error::AttentionError;

/// Floats per 64-byte cache line: the alignment of every buffer.
const LINE: usize = 16;
/// The most memory a thread keeps in spare buffers between calls.
const SPARE_BYTES: usize = 64 << 20;

thread_local! {
    /// This thread's spare buffers, each with room for at least its
    /// capacity.
    static SPARE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// `len` floats starting on a 64-byte boundary, taken from this thread's
/// spares when one is large enough, and given back to them when dropped.
pub(crate) struct Scratch {
    data: Vec<f32>,
    start: usize,
    len: usize,
}

impl Scratch {
    /// `len` copies of `value`.
    ///
    /// # Errors
    /// When the buffer is too large to address or cannot be allocated.
    pub(crate) fn filled(what: &str, len: usize, value: f32) -> Result<Self, AttentionError> {
        let mut scratch = Self::take(what, len)?;
        scratch.data.clear();
        scratch.data.resize(scratch.start + len, value);
        Ok(scratch)
    }

    /// `len` floats of any value: what a reused buffer last held (NaN
    /// included), zeros where it is new. For buffers the caller writes
    /// before it reads, which spares the fill (a memset of every query
    /// tile's buffers was 6% of a 256-token forward's instructions).
    ///
    /// # Errors
    /// As [`filled`](Self::filled).
    pub(crate) fn for_writing(what: &str, len: usize) -> Result<Self, AttentionError> {
        let mut scratch = Self::take(what, len)?;
        scratch.data.resize(scratch.start + len, 0.0);
        Ok(scratch)
    }

    /// A buffer with room for `len` floats from a 64-byte boundary, from
    /// this thread's spares when one is large enough; its contents are
    /// whatever it held.
    fn take(what: &str, len: usize) -> Result<Self, AttentionError> {
        let room = len.saturating_add(LINE);
        let reused = SPARE.with_borrow_mut(|spare| {
            // The smallest spare that fits, so large ones stay for large calls.
            let best = (0..spare.len())
                .filter(|&i| spare[i].capacity() >= room)
                .min_by_key(|&i| spare[i].capacity())?;
            Some(spare.swap_remove(best))
        });
        let data = match reused {
            Some(data) => data,
            None => try_with_capacity(what, room)?,
        };
        // Where the first whole cache line starts (at most LINE − 1 floats
        // in, as the allocation is at least 4-byte aligned). The same
        // allocation always gives the same start.
        let start = data.as_ptr().align_offset(64).min(LINE - 1);
        Ok(Self { data, start, len })
    }

    /// `len` zeros.
    ///
    /// # Errors
    /// As [`filled`](Self::filled).
    pub(crate) fn zeroed(what: &str, len: usize) -> Result<Self, AttentionError> {
        Self::filled(what, len, 0.0)
    }
}

impl Deref for Scratch {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.data[self.start..self.start + self.len]
    }
}

impl DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.data[self.start..self.start + self.len]
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        // `try_with` and `try_borrow_mut`: a thread being torn down, or a
        // buffer dropped while the pool is in use, simply frees it.
        let _ = SPARE.try_with(|spare| {
            if let Ok(mut spare) = spare.try_borrow_mut() {
                let kept: usize = spare.iter().map(|d| d.capacity() * 4).sum();
                if kept + data.capacity() * 4 <= SPARE_BYTES {
                    spare.push(data);
                }
            }
        });
    }
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
        let second = Scratch::zeroed("a test buffer", 900).unwrap();
        assert!(second.iter().all(|&x| x == 0.0));
        assert_eq!(second.as_ptr() as usize % 64, 0);
        // The same memory, reused (its start may move to stay aligned).
        assert!((second.as_ptr() as usize).abs_diff(address as usize) < 64);
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
