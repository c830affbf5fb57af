//! The integration tests, one binary: the public API as an outside crate
//! sees it. Each module is one concern; `common` holds the shared helpers
//! (a seeded generator, shape strategies, a naive oracle written from the
//! definition, tolerant comparisons).

mod common;

mod config;
mod decode_options;

mod backward;
#[cfg(feature = "half")]
mod bf16_dot;
#[cfg(feature = "safetensors")]
mod checkpoints;
mod errors;
mod fast_path;
mod fused_backward;
mod fuzz;
#[cfg(feature = "half")]
mod half;
mod kv_cache;
#[cfg(feature = "half")]
mod kv_cache_half;
mod layer_gradients;
mod layer_layouts;
mod layer_rope;
mod layers;
mod mask_rank;
mod modifiers;
mod partials;
mod properties;
mod reliability;
mod rope;
mod semantics;
mod sequence;
mod threads;
mod varlen;
