//! [`Buffer`]: the memory of a cache's keys or of its values, one
//! `[batch, kv_heads, slots, d]` array.
//!
//! A decoding step reads the whole cache once, so its speed is the memory
//! read rate, and in a virtual machine 4 KiB pages cost a page walk (two
//! levels of tables) every few KiB of that stream. On Linux, a buffer of at
//! least one transparent huge page is therefore an anonymous mapping
//! advised `MADV_HUGEPAGE`: the kernel backs it with huge pages whenever
//! transparent huge pages are `always` or `madvise` (the common default,
//! under which an ordinary allocation gets none). On an Intel Xeon (KVM
//! guest) a decode step read 9.4 GB/s from 4 KiB pages and 12.0 GB/s from
//! huge pages, 84% of a one-thread streaming read (docs/PERFORMANCE.md).
//!
//! Everywhere else (other systems, no transparent huge pages, a buffer
//! smaller than one huge page, a mapping the system refuses, Miri) the
//! buffer is an ordinary `Vec`. Both are zeroed and hold the same values;
//! only where the memory comes from differs. All of this is safe code:
//! `memmap2` maps and advises, `bytemuck` views the bytes as elements.

use ndarray::{ArrayView, ArrayView4, ArrayViewMut, ArrayViewMut4, Axis, Ix4, SliceArg};

use crate::alloc::{element_count, try_filled};
use crate::element::Storage;
use crate::error::AttentionError;

/// A zeroed `[batch, kv_heads, slots, d]` array of `F` in memory chosen for
/// streaming reads (see the module's documentation).
pub(super) struct Buffer<F> {
    dims: [usize; 4],
    memory: Memory<F>,
}

enum Memory<F> {
    Heap(Vec<F>),
    #[cfg(all(target_os = "linux", not(miri)))]
    Mapped(huge::Mapping),
}

impl<F: Storage> Buffer<F> {
    /// A buffer of zeros of shape `dims`, or the error of addressing or
    /// allocating it (`alloc` also checks the product of the nonzero
    /// lengths, which ndarray bounds even when another length is 0: a cache
    /// for batch 0 with a huge capacity).
    pub(super) fn zeroed(what: &str, dims: [usize; 4]) -> Result<Self, AttentionError> {
        let what = format!("{what} {dims:?}");
        let len = element_count::<F>(&what, &dims)?;
        #[cfg(all(target_os = "linux", not(miri)))]
        if let Some(mapping) = huge::Mapping::zeroed(len * size_of::<F>()) {
            return Ok(Self {
                dims,
                memory: Memory::Mapped(mapping),
            });
        }
        Ok(Self {
            dims,
            memory: Memory::Heap(try_filled(&what, len, F::zero())?),
        })
    }

    /// The lengths of the four axes.
    pub(super) fn dim(&self) -> (usize, usize, usize, usize) {
        let [batch, heads, slots, d] = self.dims;
        (batch, heads, slots, d)
    }

    /// The length of `axis`.
    pub(super) fn len_of(&self, axis: Axis) -> usize {
        self.dims[axis.index()]
    }

    /// The whole array.
    pub(super) fn view(&self) -> ArrayView4<'_, F> {
        ArrayView4::from_shape(self.dims, self.elements())
            .expect("the buffer has the shape's length")
    }

    /// The whole array, writable.
    pub(super) fn view_mut(&mut self) -> ArrayViewMut4<'_, F> {
        let dims = self.dims;
        ArrayViewMut4::from_shape(dims, self.elements_mut())
            .expect("the buffer has the shape's length")
    }

    /// A slice of the array, as [`ndarray::ArrayBase::slice`].
    pub(super) fn slice<I: SliceArg<Ix4>>(&self, info: I) -> ArrayView<'_, F, I::OutDim> {
        self.view().slice_move(info)
    }

    /// A writable slice of the array, as [`ndarray::ArrayBase::slice_mut`].
    pub(super) fn slice_mut<I: SliceArg<Ix4>>(
        &mut self,
        info: I,
    ) -> ArrayViewMut<'_, F, I::OutDim> {
        self.view_mut().slice_move(info)
    }

    fn elements(&self) -> &[F] {
        match &self.memory {
            Memory::Heap(vec) => vec,
            #[cfg(all(target_os = "linux", not(miri)))]
            Memory::Mapped(mapping) => bytemuck::cast_slice(mapping.bytes()),
        }
    }

    fn elements_mut(&mut self) -> &mut [F] {
        match &mut self.memory {
            Memory::Heap(vec) => vec,
            #[cfg(all(target_os = "linux", not(miri)))]
            Memory::Mapped(mapping) => bytemuck::cast_slice_mut(mapping.bytes_mut()),
        }
    }

    /// Whether the memory is a huge-page mapping (for the tests).
    #[cfg(test)]
    fn is_mapped(&self) -> bool {
        !matches!(self.memory, Memory::Heap(_))
    }
}

impl<F: Storage> Clone for Buffer<F> {
    /// A copy in memory of the same kind. Like `Vec`'s `clone`, it aborts
    /// if the memory cannot be had.
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed("a copy of a cache buffer", self.dims)
            .unwrap_or_else(|err| panic!("{err}"));
        copy.elements_mut().copy_from_slice(self.elements());
        copy
    }
}

impl<F: Storage> std::fmt::Debug for Buffer<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.view().fmt(f)
    }
}

#[cfg(all(target_os = "linux", not(miri)))]
mod huge {
    //! Anonymous mappings advised as transparent huge pages.

    use std::sync::OnceLock;

    use memmap2::{Advice, MmapMut};

    /// The kernel's transparent huge page size, read once; `None` when the
    /// kernel has none (or does not say). It is the PMD size: 2 MiB on
    /// x86-64 and on aarch64 with 4 KiB pages, 512 MiB with 64 KiB pages.
    pub(super) fn huge_page_size() -> Option<usize> {
        static SIZE: OnceLock<Option<usize>> = OnceLock::new();
        *SIZE.get_or_init(|| {
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
                .ok()?
                .trim()
                .parse()
                .ok()
                .filter(|size: &usize| size.is_power_of_two())
        })
    }

    /// `len` zeroed bytes starting on a huge-page boundary, inside an
    /// anonymous mapping one huge page longer (so the boundary can be
    /// chosen; the unused part is never touched and costs no memory).
    pub(super) struct Mapping {
        map: MmapMut,
        start: usize,
        len: usize,
    }

    impl Mapping {
        /// The mapping, or `None` when `len` is under one huge page, the
        /// kernel has none, or the mapping fails (the caller then
        /// allocates on the heap, which reports a failure as an error).
        pub(super) fn zeroed(len: usize) -> Option<Self> {
            let huge = huge_page_size()?;
            if len < huge {
                return None;
            }
            let map = MmapMut::map_anon(len.checked_add(huge)?).ok()?;
            let address = map.as_ptr() as usize;
            let start = address.next_multiple_of(huge) - address;
            // A hint: if the kernel declines it, the memory is still there
            // (in 4 KiB pages), so an error changes nothing we could act on.
            let _ = map.advise_range(Advice::HugePage, start, len);
            Some(Self { map, start, len })
        }

        pub(super) fn bytes(&self) -> &[u8] {
            &self.map[self.start..self.start + self.len]
        }

        pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.map[self.start..self.start + self.len]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::s;

    /// Heap and mapped buffers (if this system maps one) read back what
    /// was written, start zeroed, and clone to an equal buffer of the
    /// same kind.
    #[test]
    fn buffers_of_every_size_hold_their_values() {
        // 4 MiB of f32 maps on a Linux with transparent huge pages; 4 KiB never.
        for dims in [[1, 2, 8, 64], [2, 4, 1024, 128], [0, 4, 1 << 20, 8]] {
            let mut buffer = Buffer::<f32>::zeroed("a test buffer", dims).unwrap();
            assert!(buffer.view().iter().all(|&x| x == 0.0));
            buffer
                .view_mut()
                .indexed_iter_mut()
                .for_each(|((b, h, i, d), x)| *x = (b + 3 * h + 5 * i + 7 * d) as f32);
            buffer.slice_mut(s![.., .., 1, ..]).fill(-1.0);
            let copy = buffer.clone();
            assert_eq!(copy.is_mapped(), buffer.is_mapped());
            for buffer in [&buffer, &copy] {
                assert_eq!(buffer.dim(), dims.into());
                for ((b, h, i, d), &x) in buffer.view().indexed_iter() {
                    let want = if i == 1 {
                        -1.0
                    } else {
                        (b + 3 * h + 5 * i + 7 * d) as f32
                    };
                    assert_eq!(x, want);
                }
            }
            if dims[0] * dims[1] * dims[2] * dims[3] * 4 < 1 << 20 {
                assert!(!buffer.is_mapped(), "{dims:?}");
            }
        }
    }

    /// A large buffer is a huge-page mapping whose data starts on a huge
    /// page boundary, where the system has transparent huge pages.
    #[cfg(all(target_os = "linux", not(miri)))]
    #[test]
    fn large_buffers_start_on_a_huge_page() {
        let Some(huge) = huge::huge_page_size() else {
            return;
        };
        let buffer = Buffer::<f32>::zeroed("a test buffer", [1, 1, 2, huge / 4]).unwrap();
        assert!(buffer.is_mapped());
        assert_eq!(buffer.elements().as_ptr() as usize % huge, 0);
    }
}
