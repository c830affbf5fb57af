//! Attention / CausalAttention layer types (to be written).
