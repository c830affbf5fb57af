//! A layer's learned parameters, [`LayerParameters`], and the parameter
//! table every use of them reads.
//!
//! A layer has four projections, `Q`, `K`, `V` and the optional output
//! projection `O`; each is a weight matrix `w_*` and, when the config asks
//! for biases, a bias vector `b_*` as long as the matrix is wide.
//! [`PROJECTIONS`] lists them once, with their names and the shape of each
//! weight under a config. From it come:
//!
//! - the order and names of [`LayerParameters::iter`] (every weight, then
//!   every bias: `w_q`, `w_k`, `w_v`, `w_o`, `b_q`, `b_k`, `b_v`, `b_o`),
//!   which the layers' `parameters_mut`, the gradients (a
//!   [`LayerParameters`] too) and `apply_gradients` follow;
//! - the shape check of a layer's parameters and of gradients;
//! - the zero parameters the seeded initialisation fills.
//!
//! The fields are named only where Rust needs them by name:
//! [`LayerParameters::slots`] and its `_mut` twin, which hand them out in
//! table order, and [`LayerParameters::zeros`], which builds them in it
//! (the unit test at the bottom holds all three to the table).

use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD};

use super::config::{AttentionConfig, describe_config};
use crate::alloc::try_zeros;
use crate::element::Element;
use crate::error::{AttentionError, shape_error};

/// One projection of a layer: a row of the parameter table.
struct Projection {
    /// The name of its weight matrix, as the field of [`LayerParameters`].
    weight: &'static str,
    /// The name of its bias vector.
    bias: &'static str,
    /// The weight's shape in the config's terms, for messages.
    layout: &'static str,
    /// The weight's shape `[rows, columns]` under a config, `None` when a
    /// layer of that config has no such projection.
    shape: fn(&AttentionConfig) -> Option<(usize, usize)>,
}

impl Projection {
    /// The bias length under `config`: the weight's width, when the config
    /// has biases and this projection.
    fn bias_len(&self, config: &AttentionConfig) -> Option<usize> {
        (self.shape)(config)
            .filter(|_| config.bias)
            .map(|(_, columns)| columns)
    }
}

/// The parameter table, in parameter order. Head `h` owns columns
/// `h·d_k .. (h+1)·d_k` of `W^Q` (and likewise for the others).
const PROJECTIONS: [Projection; 4] = [
    Projection {
        weight: "w_q",
        bias: "b_q",
        layout: "[d_model, heads·d_k]",
        shape: |c| Some((c.d_model, c.heads * c.d_k())),
    },
    Projection {
        weight: "w_k",
        bias: "b_k",
        layout: "[d_model_kv, kv_heads·d_k]",
        shape: |c| Some((c.kv_input_width(), c.kv_heads * c.d_k())),
    },
    Projection {
        weight: "w_v",
        bias: "b_v",
        layout: "[d_model_kv, kv_heads·d_v]",
        shape: |c| Some((c.kv_input_width(), c.kv_heads * c.d_v())),
    },
    Projection {
        weight: "w_o",
        bias: "b_o",
        layout: "[heads·d_v, d_model_out]",
        shape: |c| c.d_model_out.map(|width| (c.heads * c.d_v(), width)),
    },
];

/// The learned parameters of an attention layer, for
/// [`Attention::new`](crate::Attention::new) and
/// [`CausalAttention::new`](crate::CausalAttention::new), as a layer's
/// [`parameters`](crate::Attention::parameters) returns them, and the
/// shape of its gradients ([`LayerGradients::d_parameters`](crate::LayerGradients::d_parameters)).
///
/// For a config with `heads`, `kv_heads`, `d_k`, `d_v` (see
/// [`AttentionConfig`]), the shapes are:
///
/// | parameter | shape | present |
/// |---|---|---|
/// | `w_q` | `[d_model, heads·d_k]` | always |
/// | `w_k` | `[d_model_kv, kv_heads·d_k]` | always |
/// | `w_v` | `[d_model_kv, kv_heads·d_v]` | always |
/// | `w_o` | `[heads·d_v, d_model_out]` | with an output projection |
/// | `b_q`, `b_k`, `b_v` | `[heads·d_k]`, `[kv_heads·d_k]`, `[kv_heads·d_v]` | with `bias` |
/// | `b_o` | `[d_model_out]` | with `bias` and an output projection |
///
/// Every weight is **`[in, out]`**: a projection is `Y = X·W + b`. That is
/// the layout of GPT-2's `Conv1D`, and the **transpose** of PyTorch's
/// `nn.Linear.weight` (`[out, in]`, `y = x·Wᵀ + b`), which Hugging Face's
/// Llama, Mistral and Qwen2 projections and `nn.MultiheadAttention` use. A
/// square `[out, in]` weight passes every shape check here and gives wrong
/// numbers, so load checkpoints through the constructors that name their
/// layout: [`from_torch_linear`](Self::from_torch_linear),
/// [`from_torch_multihead_attention`](Self::from_torch_multihead_attention),
/// [`from_gpt2_conv1d`](Self::from_gpt2_conv1d), and, with the feature
/// `safetensors`, their `load_*` forms that read a
/// `Checkpoint` by tensor name.
///
/// Head `h` owns columns `h·d_k .. (h+1)·d_k` of `W^Q` (and likewise for
/// the others), as in those frameworks. A model without a bias on one
/// projection (Whisper's keys, Qwen2's output) gives a zero bias there.
///
/// ```
/// use ndarray::{Array1, Array2};
/// use sdpa::LayerParameters;
///
/// let parameters = LayerParameters::new(Array2::<f32>::zeros((8, 8)), Array2::zeros((8, 8)), Array2::zeros((8, 8)))
///     .with_output(Array2::zeros((8, 8)))
///     .with_biases(Array1::zeros(8), Array1::zeros(8), Array1::zeros(8))
///     .with_output_bias(Array1::zeros(8));
/// assert!(parameters.b_o.is_some());
/// assert_eq!(parameters.iter().count(), 8);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LayerParameters<F> {
    /// The query projection `W^Q`, `[in, out]` = `[d_model, heads·d_k]`.
    pub w_q: Array2<F>,
    /// The key projection `W^K`, `[in, out]` = `[d_model_kv, kv_heads·d_k]`.
    pub w_k: Array2<F>,
    /// The value projection `W^V`, `[in, out]` = `[d_model_kv, kv_heads·d_v]`.
    pub w_v: Array2<F>,
    /// The output projection `W^O`, `[in, out]` = `[heads·d_v, d_model_out]`, if any.
    pub w_o: Option<Array2<F>>,
    /// The query bias, `[heads·d_k]`, if any.
    pub b_q: Option<Array1<F>>,
    /// The key bias, `[kv_heads·d_k]`, if any.
    pub b_k: Option<Array1<F>>,
    /// The value bias, `[kv_heads·d_v]`, if any.
    pub b_v: Option<Array1<F>>,
    /// The output bias, `[d_model_out]`, if any.
    pub b_o: Option<Array1<F>>,
}

/// Every weight, then every bias, in table order; `None` where absent.
type Slots<W, B> = ([Option<W>; 4], [Option<B>; 4]);

impl<F> LayerParameters<F> {
    /// The three input projections, each **`[in, out]`** (`Q = X·W^Q`):
    /// `w_q_in_out` `[d_model, heads·d_k]`, `w_k_in_out`
    /// `[d_model_kv, kv_heads·d_k]`, `w_v_in_out` `[d_model_kv, kv_heads·d_v]`;
    /// with no output projection and no biases. For PyTorch's `[out, in]`
    /// weights use [`from_torch_linear`](Self::from_torch_linear).
    pub fn new(w_q_in_out: Array2<F>, w_k_in_out: Array2<F>, w_v_in_out: Array2<F>) -> Self {
        Self {
            w_q: w_q_in_out,
            w_k: w_k_in_out,
            w_v: w_v_in_out,
            w_o: None,
            b_q: None,
            b_k: None,
            b_v: None,
            b_o: None,
        }
    }

    /// Adds the output projection `W^O`, **`[in, out]`** =
    /// `[heads·d_v, d_model_out]` (the transpose of an `nn.Linear` weight).
    pub fn with_output(mut self, w_o_in_out: Array2<F>) -> Self {
        self.w_o = Some(w_o_in_out);
        self
    }

    /// Adds the biases of the three input projections.
    pub fn with_biases(mut self, b_q: Array1<F>, b_k: Array1<F>, b_v: Array1<F>) -> Self {
        self.b_q = Some(b_q);
        self.b_k = Some(b_k);
        self.b_v = Some(b_v);
        self
    }

    /// Adds the bias of the output projection, `[d_model_out]`.
    pub fn with_output_bias(mut self, b_o: Array1<F>) -> Self {
        self.b_o = Some(b_o);
        self
    }

    /// Every parameter there is, with its name (`"w_q"`, `"w_k"`, `"w_v"`,
    /// then `"w_o"`, `"b_q"`, `"b_k"`, `"b_v"`, `"b_o"` where present), in
    /// that order: the order of a layer's
    /// [`parameters_mut`](crate::Attention::parameters_mut) and of
    /// [`apply_gradients`](crate::Attention::apply_gradients).
    ///
    /// ```
    /// use sdpa::{Attention, AttentionConfig};
    ///
    /// let config = AttentionConfig::new(8, 2).with_output_projection(8);
    /// let layer = Attention::<f32>::new_seeded(config, 0)?;
    /// let names: Vec<_> = layer.parameters().iter().map(|(name, _)| name).collect();
    /// assert_eq!(names, ["w_q", "w_k", "w_v", "w_o"]);
    /// let count: usize = layer.parameters().iter().map(|(_, p)| p.len()).sum();
    /// assert_eq!(count, 4 * 8 * 8);
    /// # Ok::<(), sdpa::AttentionError>(())
    /// ```
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, ArrayViewD<'_, F>)> {
        let (weights, biases) = self.slots();
        let weights = PROJECTIONS.iter().zip(weights);
        let weights = weights.filter_map(|(p, w)| Some((p.weight, w?.view().into_dyn())));
        let biases = PROJECTIONS.iter().zip(biases);
        let biases = biases.filter_map(|(p, b)| Some((p.bias, b?.view().into_dyn())));
        weights.chain(biases)
    }

    /// [`iter`](Self::iter), writable: the same names, in the same order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&'static str, ArrayViewMutD<'_, F>)> {
        let (weights, biases) = self.slots_mut();
        let weights = PROJECTIONS.iter().zip(weights);
        let weights = weights.filter_map(|(p, w)| Some((p.weight, w?.view_mut().into_dyn())));
        let biases = PROJECTIONS.iter().zip(biases);
        let biases = biases.filter_map(|(p, b)| Some((p.bias, b?.view_mut().into_dyn())));
        weights.chain(biases)
    }

    /// The fields in table order: the accessor column of the table.
    fn slots(&self) -> Slots<&Array2<F>, &Array1<F>> {
        let Self {
            w_q,
            w_k,
            w_v,
            w_o,
            b_q,
            b_k,
            b_v,
            b_o,
        } = self;
        (
            [Some(w_q), Some(w_k), Some(w_v), w_o.as_ref()],
            [b_q.as_ref(), b_k.as_ref(), b_v.as_ref(), b_o.as_ref()],
        )
    }

    /// [`slots`](Self::slots), writable; a separate list only because one
    /// `&mut self` must yield every field at once.
    fn slots_mut(&mut self) -> Slots<&mut Array2<F>, &mut Array1<F>> {
        let Self {
            w_q,
            w_k,
            w_v,
            w_o,
            b_q,
            b_k,
            b_v,
            b_o,
        } = self;
        (
            [Some(w_q), Some(w_k), Some(w_v), w_o.as_mut()],
            [b_q.as_mut(), b_k.as_mut(), b_v.as_mut(), b_o.as_mut()],
        )
    }

    /// The shapes of every parameter, for error messages.
    fn describe(&self) -> String {
        self.iter()
            .map(|(name, p)| format!("{name} {:?}", p.shape()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks every parameter's shape, and which are present, against
    /// `config`, which was checked.
    pub(super) fn check(&self, config: &AttentionConfig) -> Result<(), AttentionError> {
        let expected = |what: &str, expected: String| {
            shape_error(format!(
                "{what}, expected {expected} for {}; got {}",
                describe_config(config),
                self.describe()
            ))
        };
        let (weights, biases) = self.slots();
        for (projection, weight) in PROJECTIONS.iter().zip(weights) {
            let name = projection.weight;
            match (weight, (projection.shape)(config)) {
                (Some(w), Some(dim)) if w.dim() == dim => {}
                (Some(w), Some((rows, columns))) => {
                    return Err(expected(
                        &format!("{name} has shape {:?}", w.shape()),
                        format!("{} = [{rows}, {columns}]", projection.layout),
                    ));
                }
                (None, None) => {}
                // Only the output projection is optional.
                (Some(w), None) => {
                    return Err(expected(
                        &format!("{name} {:?} was given", w.shape()),
                        "no output projection (d_model_out = None)".to_owned(),
                    ));
                }
                (None, Some((rows, columns))) => {
                    return Err(expected(
                        &format!("{name} is missing"),
                        format!("{name} {} = [{rows}, {columns}]", projection.layout),
                    ));
                }
            }
        }
        for (projection, bias) in PROJECTIONS.iter().zip(biases) {
            let name = projection.bias;
            match (bias, projection.bias_len(config)) {
                (Some(b), Some(len)) if b.len() == len => {}
                (Some(b), Some(len)) => {
                    return Err(expected(
                        &format!("{name} has shape {:?}", b.shape()),
                        format!("[{len}]"),
                    ));
                }
                (None, None) => {}
                (Some(b), None) => {
                    return Err(expected(
                        &format!("{name} {:?} was given", b.shape()),
                        "no bias there (bias = false, or no output projection)".to_owned(),
                    ));
                }
                (None, Some(len)) => {
                    return Err(expected(
                        &format!("{name} is missing"),
                        format!("{name} [{len}] (bias = true)"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl<F: Element> LayerParameters<F> {
    /// Zero parameters of the shapes `config` (checked) asks for, or the
    /// error of addressing or allocating one (named, with its shape).
    pub(super) fn zeros(config: &AttentionConfig) -> Result<Self, AttentionError> {
        let [w_q, w_k, w_v, w_o] = PROJECTIONS.map(|p| {
            (p.shape)(config)
                .map(|shape| try_zeros(&format!("{} {}", p.weight, p.layout), shape))
                .transpose()
        });
        let [b_q, b_k, b_v, b_o] = PROJECTIONS.map(|p| {
            p.bias_len(config)
                .map(|len| try_zeros(p.bias, len))
                .transpose()
        });
        let always = "the table gives every config W^Q, W^K and W^V";
        Ok(Self {
            w_q: w_q?.expect(always),
            w_k: w_k?.expect(always),
            w_v: w_v?.expect(always),
            w_o: w_o?,
            b_q: b_q?,
            b_k: b_k?,
            b_v: b_v?,
            b_o: b_o?,
        })
    }

    /// The weight matrices there are, writable, in table order.
    pub(super) fn weights_mut(&mut self) -> impl Iterator<Item = &mut Array2<F>> {
        self.slots_mut().0.into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::{LayerParameters, PROJECTIONS};
    use crate::layer::config::AttentionConfig;

    /// A config whose every parameter has a shape no other has.
    fn distinct() -> AttentionConfig {
        AttentionConfig::new(2, 4)
            .with_head_dim(3)
            .with_value_dim(5)
            .with_kv_heads(2)
            .with_d_model_kv(7)
            .with_output_projection(11)
            .with_bias(true)
    }

    #[test]
    fn the_slots_follow_the_table() {
        let config = distinct();
        let mut parameters = LayerParameters::<f64>::zeros(&config).unwrap();
        parameters.check(&config).unwrap();
        let names: Vec<_> = PROJECTIONS
            .iter()
            .map(|p| p.weight)
            .chain(PROJECTIONS.iter().map(|p| p.bias))
            .collect();
        let shapes: Vec<Vec<usize>> = PROJECTIONS
            .iter()
            .map(|p| {
                let (rows, columns) = (p.shape)(&config).unwrap();
                vec![rows, columns]
            })
            .chain(
                PROJECTIONS
                    .iter()
                    .map(|p| vec![p.bias_len(&config).unwrap()]),
            )
            .collect();
        let read: Vec<_> = parameters
            .iter()
            .map(|(name, p)| (name, p.shape().to_vec()))
            .collect();
        let written: Vec<_> = parameters
            .iter_mut()
            .map(|(name, p)| (name, p.shape().to_vec()))
            .collect();
        let table: Vec<_> = names.into_iter().zip(shapes).collect();
        assert_eq!(read, table);
        assert_eq!(written, table);
        // And each field holds its own parameter.
        let p = &parameters;
        let lengths = |b: &Option<ndarray::Array1<f64>>| b.as_ref().map(|b| b.len());
        assert_eq!(
            (
                p.w_q.dim(),
                p.w_k.dim(),
                p.w_v.dim(),
                p.w_o.as_ref().map(|w| w.dim())
            ),
            ((2, 12), (7, 6), (7, 10), Some((20, 11)))
        );
        assert_eq!(
            [
                lengths(&p.b_q),
                lengths(&p.b_k),
                lengths(&p.b_v),
                lengths(&p.b_o)
            ],
            [Some(12), Some(6), Some(10), Some(11)]
        );
    }
}
