//! Strided arrays: transposed, reversed, stepped and broadcast views of
//! the generated data, so every path sees the layouts users pass.

use super::*;

/// How a 4-D array is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Layout {
    /// Memory axis `m` (outermost first) holds logical axis `order[m]`.
    pub(super) order: [usize; 4],
    /// Stored back to front, read through a negative stride.
    pub(super) reversed: [bool; 4],
    /// Stored with a gap (filled with NaN, or `true` for a mask) after every
    /// element, read with a step of 2.
    pub(super) stepped: [bool; 4],
    /// Stored once, read through a zero stride (`broadcast`); the values
    /// along such an axis are all equal.
    pub(super) broadcast: [bool; 4],
}

impl Layout {
    const STANDARD: Layout = Layout {
        order: [0, 1, 2, 3],
        reversed: [false; 4],
        stepped: [false; 4],
        broadcast: [false; 4],
    };

    /// Standard half the time; otherwise a random permutation, reversals,
    /// at most one stepped axis and (if allowed) zero strides.
    /// `contiguous_rows` keeps the last axis innermost and forward, as the
    /// decode path needs.
    pub(super) fn random(
        rng: &mut Rng,
        shape: [usize; 4],
        allow_broadcast: bool,
        contiguous_rows: bool,
    ) -> Self {
        if rng.chance(0.5) {
            return Self::STANDARD;
        }
        let mut layout = Self::STANDARD;
        if rng.chance(0.5) {
            let p = rng.permutation(4);
            layout.order = [p[0], p[1], p[2], p[3]];
        }
        for (a, &len) in shape.iter().enumerate() {
            layout.reversed[a] = rng.chance(0.25);
            layout.broadcast[a] = allow_broadcast && len > 1 && rng.chance(0.15);
        }
        if rng.chance(0.3) {
            let a = rng.below(4);
            layout.stepped[a] = !layout.broadcast[a];
        }
        if contiguous_rows {
            let m = layout.order.iter().position(|&a| a == 3).unwrap();
            layout.order.swap(m, 3);
            layout.reversed[3] = false;
            layout.stepped[3] = false;
            layout.broadcast[3] = false;
        }
        layout
    }

    pub(super) fn is_standard(&self) -> bool {
        *self == Self::STANDARD
    }

    /// Logical axis `a` ← memory axis `inverse()[a]`.
    pub(super) fn inverse(&self) -> [usize; 4] {
        let mut inverse = [0; 4];
        for (m, &a) in self.order.iter().enumerate() {
            inverse[a] = m;
        }
        inverse
    }

    /// The memory shape holding a logical `shape` whose broadcast axes are
    /// stored once (`stored_broadcast`) or at full length.
    pub(super) fn memory_shape(&self, shape: [usize; 4], stored_broadcast: bool) -> [usize; 4] {
        let stored: [usize; 4] = std::array::from_fn(|a| {
            if self.broadcast[a] && stored_broadcast {
                1
            } else if self.stepped[a] {
                2 * shape[a]
            } else {
                shape[a]
            }
        });
        std::array::from_fn(|m| stored[self.order[m]])
    }

    pub(super) fn describe(&self) -> String {
        if self.is_standard() {
            return "standard".into();
        }
        let axes = |flags: [bool; 4]| -> Vec<usize> { (0..4).filter(|&a| flags[a]).collect() };
        format!(
            "order {:?} reversed {:?} stepped {:?} broadcast {:?}",
            self.order,
            axes(self.reversed),
            axes(self.stepped),
            axes(self.broadcast)
        )
    }
}

/// An array stored in some [`Layout`], seen through a view of its logical
/// shape.
pub(super) struct Strided<T> {
    pub(super) storage: Array4<T>,
    pub(super) layout: Layout,
    pub(super) shape: [usize; 4],
}

impl<T: Clone> Strided<T> {
    /// `base` has the logical shape with 1 on the layout's broadcast axes;
    /// gaps of stepped axes hold `gap`.
    pub(super) fn new(base: &Array4<T>, shape: [usize; 4], layout: Layout, gap: T) -> Self {
        let storage = Array4::from_elem(layout.memory_shape(shape, true), gap);
        let mut strided = Strided {
            storage,
            layout,
            shape,
        };
        let mut view = strided.storage.view_mut().permuted_axes(layout.inverse());
        Self::walk(&layout, &mut view);
        view.assign(base);
        strided
    }

    /// Steps and reversals, in the same order for reading and writing.
    pub(super) fn walk<V: ndarray::RawData>(
        layout: &Layout,
        view: &mut ndarray::ArrayBase<V, ndarray::Ix4>,
    ) {
        for a in 0..4 {
            if layout.stepped[a] {
                view.slice_axis_inplace(Axis(a), Slice::new(0, None, 2));
            }
            if layout.reversed[a] {
                view.invert_axis(Axis(a));
            }
        }
    }

    pub(super) fn view(&self) -> ArrayView4<'_, T> {
        let full = self.layout.memory_shape(self.shape, false);
        let mut view = self
            .storage
            .broadcast(full)
            .expect("broadcast axes are stored once")
            .permuted_axes(self.layout.inverse());
        Self::walk(&self.layout, &mut view);
        view
    }

    /// A writable view; only for layouts without broadcast axes.
    pub(super) fn view_mut(&mut self) -> ArrayViewMut4<'_, T> {
        let mut view = self.storage.view_mut().permuted_axes(self.layout.inverse());
        Self::walk(&self.layout, &mut view);
        view
    }
}

/// The values of one argument: its logical shape, its layout, and its
/// values with 1 on the broadcast axes.
#[derive(Debug, Clone)]
pub(super) struct Tensor<T> {
    pub(super) shape: [usize; 4],
    pub(super) layout: Layout,
    pub(super) base: Array4<T>,
}

impl<T: Clone> Tensor<T> {
    pub(super) fn random(shape: [usize; 4], layout: Layout, mut value: impl FnMut() -> T) -> Self {
        let base_shape: [usize; 4] =
            std::array::from_fn(|a| if layout.broadcast[a] { 1 } else { shape[a] });
        Tensor {
            shape,
            layout,
            base: Array4::from_shape_simple_fn(base_shape, &mut value),
        }
    }

    /// The entry of `base` that position `pos` reads, where `pos` may index
    /// the full `[batch, heads, len_q, total_len_kv]` of a broadcast mask
    /// or bias.
    pub(super) fn base_index(&self, pos: [usize; 4]) -> [usize; 4] {
        let shape = self.base.shape();
        std::array::from_fn(|a| if shape[a] == 1 { 0 } else { pos[a] })
    }

    pub(super) fn at(&self, pos: [usize; 4]) -> T {
        self.base[self.base_index(pos)].clone()
    }

    pub(super) fn strided<U: Clone>(&self, convert: impl Fn(&T) -> U, gap: U) -> Strided<U> {
        Strided::new(&self.base.map(convert), self.shape, self.layout, gap)
    }
}

// ---------------------------------------------------------------------------
