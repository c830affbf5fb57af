//! The integration tests, one binary: the public API as an outside crate
//! sees it. Each module is one concern; `common` holds the shared helpers
//! (a seeded generator, shape strategies, a naive oracle written from the
//! definition, tolerant comparisons).

mod common;

mod backward;
mod errors;
mod fast_path;
mod fused_backward;
mod fuzz;
mod kv_cache;
mod layer_gradients;
mod layers;
mod modifiers;
mod partials;
mod properties;
mod reliability;
mod semantics;
mod sequence;
mod threads;
